"""Precision functions and the default policy table (SPEC 3.3, 3.4)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import autocast
from autocast import _compat, _measure, _models, rules

BF16, F16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32)


def _args():
    return (
        jnp.ones(2, F32),
        jnp.ones(2, BF16),
        jnp.arange(2),
        jnp.array([True, False]),
        np.float32(2.0),
    )


ORIGINAL = [F32, F32, np.dtype(np.int32), np.dtype(bool), F32]


def test_use_compute_precision_casts_floats_and_the_result_dtype():
    out, params = autocast.use_compute_precision(
        BF16, ORIGINAL, *_args(), preferred_element_type=F32, axes=(0,)
    )
    assert [x.dtype for x in out] == [BF16, BF16, np.int32, bool, BF16]
    assert params == {"preferred_element_type": BF16, "axes": (0,)}
    _, params = autocast.use_compute_precision(BF16, [F32], jnp.ones(2), preferred_element_type=None)
    assert params["preferred_element_type"] is None
    _, params = autocast.use_compute_precision(BF16, [np.dtype(np.int8)], jnp.ones(2, jnp.int8),
                                               preferred_element_type=np.dtype(np.int32))
    assert params["preferred_element_type"] == np.int32  # integer matmuls keep their accumulator


def test_use_original_precision_restores_recorded_dtypes():
    out, params = autocast.use_original_precision(BF16, ORIGINAL, *_args(), preferred_element_type=F32)
    assert [x.dtype for x in out] == [F32, F32, np.int32, bool, F32]
    assert params == {"preferred_element_type": F32}


def test_use_widest_and_input_precision_promote_mixed_inputs_only():
    a, b = jnp.ones(2, BF16), jnp.ones(2, F32)
    for rule in (autocast.use_widest_precision, autocast.use_input_precision):
        out, _ = rule(BF16, [F32, F32], a, b)
        assert [x.dtype for x in out] == [F32, F32]
        out, _ = rule(BF16, [F32, F32], a, a)
        assert [x.dtype for x in out] == [BF16, BF16]
        assert out[0] is a  # nothing to do, nothing emitted
        out, _ = rule(BF16, [F16, F32], jnp.ones(2, F16), a)
        assert [x.dtype for x in out] == [F32, F32]  # float16 and bfloat16 meet in float32


def test_use_precision_builds_a_named_rule_and_validates():
    rule = autocast.use_precision("f16")
    out, params = rule(BF16, ORIGINAL, *_args(), preferred_element_type=F32)
    assert [x.dtype for x in out][:2] == [F16, F16] and params["preferred_element_type"] == F16
    assert rule.__name__ == "use_precision(float16)"
    with pytest.raises(TypeError, match="use_precision's dtype must be a floating-point dtype"):
        autocast.use_precision(jnp.int32)


def test_float64_values_are_never_touched_by_any_rule():
    x = np.ones(2, np.float64)
    for rule in (autocast.use_compute_precision, autocast.use_original_precision,
                 autocast.use_widest_precision, autocast.use_precision(F16)):
        (out,), _ = rule(BF16, [np.dtype(np.float64)], x)
        assert out is x


def test_integer_pow_rule_depends_on_the_exponent():
    x = jnp.ones(2, BF16)
    (small,), _ = rules.use_input_precision_for_small_powers(BF16, [F32], x, y=3)
    (large,), _ = rules.use_input_precision_for_small_powers(BF16, [F32], x, y=4)
    assert (small.dtype, large.dtype) == (BF16, F32)


def test_cast_rule_keeps_real_casts_and_drops_weak_type_only_ones():
    x = jnp.ones(2, BF16)
    (_,), p = rules.use_input_precision_for_casts(BF16, [F32], x, new_dtype=F32, weak_type=False)
    assert p["new_dtype"] == BF16  # f32 -> f32 in the original program: no cast at all
    (_,), p = rules.use_input_precision_for_casts(BF16, [F32], x, new_dtype=F16, weak_type=False)
    assert p["new_dtype"] == F16  # a real cast keeps its target


# --- the default table ------------------------------------------------------------------------

def test_table_has_one_row_per_primitive_and_a_reason_for_each():
    names = [name for name, _, _ in autocast.DEFAULT_PRECISION_TABLE]
    assert len(names) == len(set(names))
    public = {autocast.use_compute_precision, autocast.use_original_precision,
              autocast.use_widest_precision, autocast.use_input_precision,
              rules.use_float32_precision, rules.use_input_precision_for_small_powers,
              rules.use_input_precision_for_casts}
    for name, rule, reason in autocast.DEFAULT_PRECISION_TABLE:
        assert rule in public, name
        assert len(reason) > 20, name


def test_default_policy_is_the_table_plus_special_scopes():
    policy = autocast.default_amp_policy
    for scope in ("amp_stop", "amp_step", "amp_default"):
        assert policy[scope] is autocast.use_original_precision
    assert policy[lax.dot_general_p] is autocast.use_compute_precision
    assert policy[lax.exp_p] is rules.use_float32_precision
    assert policy[lax.add_p] is autocast.use_input_precision
    assert policy[lax.concatenate_p] is autocast.use_widest_precision
    present = {k.name for k in policy if not isinstance(k, str)}
    for name, _, _ in autocast.DEFAULT_PRECISION_TABLE:
        assert (name in present) == (_compat.primitive_by_name(name) is not None), name


def test_matmuls_and_convolutions_are_the_only_compute_rows():
    compute = {n for n, r, _ in autocast.DEFAULT_PRECISION_TABLE if r is autocast.use_compute_precision}
    assert compute == {"dot_general", "conv_general_dilated", "ragged_dot_general", "ragged_dot"}


def test_the_printed_table_lists_every_row():
    text = autocast.describe_default_policy()
    for name, rule, reason in autocast.DEFAULT_PRECISION_TABLE:
        assert f"| `{name}` | {rule.__name__} | {reason} |" in text
    assert "anything else | use_original_precision" in text


def test_docs_print_the_current_table():
    from pathlib import Path

    root = Path(__file__).parents[1]
    for page in (root / "docs" / "default_policy.md", root / "README.md"):
        text = page.read_text()
        assert autocast.describe_default_policy() in text, f"{page.name}: python -m autocast policy"


def _cnn(params, x):
    y = lax.conv_general_dilated(x, params["k"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    y = jax.nn.relu(y + params["b"])
    y = lax.reduce_window(y, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
    mean = y.mean(axis=(0, 1, 2))
    var = y.var(axis=(0, 1, 2))
    y = (y - mean) / jnp.sqrt(var + 1e-5)
    y = jnp.mean(y, axis=(1, 2))  # global average pool
    logits = jax.nn.silu(y) @ params["w"]
    return optax_like_ce(logits, jnp.arange(x.shape[0]) % logits.shape[-1])


def optax_like_ce(logits, labels):
    return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(labels.shape[0]), labels])


def _float_primitives(fn, *args):
    names = set()
    for jaxpr in (jax.make_jaxpr(fn)(*args), jax.make_jaxpr(jax.grad(fn))(*args)):
        for eqn in _measure.equations(jaxpr):
            if any(jnp.issubdtype(v.aval.dtype, jnp.floating) for v in eqn.invars):
                names.add(eqn.primitive.name)
    return names


HIGHER_ORDER = {"jit", "pjit", "custom_jvp_call"}


@pytest.mark.parametrize("model", ["mlp", "cnn", "gpt"])
def test_every_primitive_of_ordinary_models_is_classified(model):
    key = jax.random.PRNGKey(0)
    if model == "mlp":
        params = _models.init_mlp(key)
        args = (params, jnp.ones((4, 32)), jnp.arange(4))
        names = _float_primitives(_models.mlp_loss, *args)
    elif model == "cnn":
        params = {"k": jnp.ones((3, 3, 3, 8)) * 0.1, "b": jnp.zeros(8), "w": jnp.ones((8, 5)) * 0.1}
        names = _float_primitives(_cnn, params, jnp.ones((2, 8, 8, 3)))
    else:
        args = (_models.init_gpt(key), _models.gpt_batch(key))
        names = _float_primitives(_models.gpt_loss, *args)
    table = {name for name, _, _ in autocast.DEFAULT_PRECISION_TABLE}
    assert names - HIGHER_ORDER - table == set()
