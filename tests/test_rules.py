"""Precision functions and the default policy table."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import eqns_named, operand_dtypes
from jax import lax

import autocast
from autocast import _compat
from autocast._src.demo import models as _models
from autocast._src.policy import precision as rules
from autocast._src.tools import measure as _measure

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
    _, params = autocast.use_compute_precision(
        BF16, [F32], jnp.ones(2), preferred_element_type=None
    )
    assert params["preferred_element_type"] is None
    _, params = autocast.use_compute_precision(
        BF16, [np.dtype(np.int8)], jnp.ones(2, jnp.int8), preferred_element_type=np.dtype(np.int32)
    )
    assert params["preferred_element_type"] == np.int32  # integer matmuls keep their accumulator


def test_use_original_precision_restores_recorded_dtypes():
    out, params = autocast.use_original_precision(
        BF16, ORIGINAL, *_args(), preferred_element_type=F32
    )
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
    for rule in (
        autocast.use_compute_precision,
        autocast.use_original_precision,
        autocast.use_widest_precision,
        autocast.use_precision(F16),
    ):
        (out,), _ = rule(BF16, [np.dtype(np.float64)], x)
        assert out is x


def test_integer_pow_rule_depends_on_the_exponent():
    x = jnp.ones(2, BF16)
    dtypes = {
        y: rules.use_precision_by_exponent(BF16, [F32], x, y=y)[0][0].dtype
        for y in (-3, -2, -1, 1, 2, 3, 4, 7)
    }
    assert dtypes == {-3: F32, -2: F32, -1: F32, 1: BF16, 2: F32, 3: BF16, 4: F32, 7: F32}
    # never wider than the program: a square the program wrote in bfloat16 stays bfloat16
    (same,), _ = rules.use_precision_by_exponent(BF16, [BF16], x, y=2)
    assert same is x


def test_a_result_dtype_wider_than_the_operands_default_is_kept():
    a16, a32 = jnp.ones(2, BF16), jnp.ones(2, F32)
    # what jnp.matmul records for float32 operands: follows the operands into bfloat16
    _, p = autocast.use_compute_precision(BF16, [F32, F32], a32, a32, preferred_element_type=F32)
    assert p["preferred_element_type"] == BF16
    # float32 asked for on bfloat16 operands: the user's accumulator, kept
    out, p = autocast.use_compute_precision(
        BF16, [BF16, BF16], a16, a16, preferred_element_type=F32
    )
    assert [x.dtype for x in out] == [BF16, BF16] and p["preferred_element_type"] == F32
    # mixed operands default to their promotion (float32): nothing explicit about float32
    _, p = autocast.use_compute_precision(BF16, [BF16, F32], a16, a32, preferred_element_type=F32)
    assert p["preferred_element_type"] == BF16
    # a float result of integer operands is the user's choice too
    i8 = jnp.ones(2, jnp.int8)
    _, p = autocast.use_compute_precision(
        BF16, [np.dtype(np.int8)] * 2, i8, i8, preferred_element_type=F32
    )
    assert p["preferred_element_type"] == F32
    # every rule that moves the result dtype keeps an explicit one
    moving = (
        autocast.use_precision(F16),
        autocast.use_widest_precision,
        autocast.use_full_precision,
    )
    for rule in moving:
        _, p = rule(BF16, [BF16, BF16], a16, a16, preferred_element_type=F32)
        assert p["preferred_element_type"] == F32, rule


def _einsum_f32(a, b):
    return jnp.einsum("ij,jk->ik", a, b, preferred_element_type=jnp.float32)


def test_einsum_with_an_explicit_float32_result_accumulates_in_float32():
    a = jax.random.normal(jax.random.PRNGKey(0), (16, 512)).astype(BF16)
    b = jax.random.normal(jax.random.PRNGKey(1), (512, 8)).astype(BF16)
    amp_fn = autocast.amp(_einsum_f32, compute_dtype=BF16)
    (dot,) = eqns_named(jax.make_jaxpr(amp_fn)(a, b), "dot_general")
    assert [v.aval.dtype for v in dot.invars] == [BF16, BF16]
    assert dot.outvars[0].aval.dtype == F32 and dot.params["preferred_element_type"] == F32
    # the values are the float32 accumulation of the bfloat16 products, not a bfloat16 sum
    want = a.astype(F32) @ b.astype(F32)
    got = amp_fn(a, b)
    assert got.dtype == F32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    # backward: gradients in the operands' dtype, through the same float32 accumulation
    grads = jax.grad(lambda a, b: amp_fn(a, b).sum(), argnums=(0, 1))(a, b)
    assert [g.dtype for g in grads] == [BF16, BF16]


def test_a_float32_matmul_still_runs_in_bfloat16():
    a, b = jnp.ones((4, 8)), jnp.ones((8, 3))
    for fn in (jnp.matmul, lambda a, b: jnp.einsum("ij,jk->ik", a, b)):
        jaxpr = jax.make_jaxpr(fn)(a, b)
        assert eqns_named(jaxpr, "dot_general")[0].params["preferred_element_type"] == F32
        amp_jaxpr = jax.make_jaxpr(autocast.amp(fn, compute_dtype=BF16))(a, b)
        (dot,) = eqns_named(amp_jaxpr, "dot_general")
        assert [v.aval.dtype for v in dot.invars] == [BF16, BF16]
        assert dot.outvars[0].aval.dtype == BF16


def _one_pass_variances(x, w):
    """BatchNorm's statistics as Haiku computes them, written with square and with ** 2."""
    h = x @ w
    with_square = jnp.mean(jnp.square(h), 0) - jnp.square(jnp.mean(h, 0))
    with_pow = jnp.mean(h**2, 0) - jnp.mean(h, 0) ** 2
    return with_square, with_pow


def test_squares_run_in_float32_and_cubes_in_the_input_dtype():
    x, w = jnp.ones((4, 8)), jnp.eye(8)
    jaxpr = jax.make_jaxpr(autocast.amp(_one_pass_variances, compute_dtype=BF16))(x, w)
    assert operand_dtypes(jaxpr, "dot_general") == [("bfloat16", "bfloat16")]
    # the squares of the bfloat16 activations, and the squares of the (float32) means
    assert operand_dtypes(jaxpr, "square") == [("float32",), ("float32",)]
    assert operand_dtypes(jaxpr, "integer_pow") == [("float32",), ("float32",)]
    gelu = jax.make_jaxpr(
        autocast.amp(lambda x, w: jax.nn.gelu(x @ w, approximate=True), compute_dtype=BF16)
    )(x, w)
    cubes = eqns_named(gelu, "integer_pow")
    assert [(e.params["y"], e.invars[0].aval.dtype) for e in cubes] == [(3, BF16)]


def test_one_pass_variance_of_16_bit_activations_does_not_go_negative():
    # Four samples per channel close together, as in the last BatchNorm of a ResNet: 16-bit
    # squares made E[x^2] - E[x]^2 negative for 11 of these 256 channels. Evaluated op by op,
    # as the jaxpr says; under jit, XLA on CPU may keep the excess precision itself.
    x = 3.0 + 0.1 * jax.random.normal(jax.random.PRNGKey(0), (4, 256))
    w = jnp.eye(256)
    want = _one_pass_variances(x.astype(BF16).astype(F32), w)  # float32 on the same values
    with jax.disable_jit():
        got = autocast.amp(_one_pass_variances, compute_dtype=BF16)(x, w)
    for g, v in zip(got, want):
        assert bool(jnp.all(g >= 0))
        np.testing.assert_allclose(g, v, rtol=1e-6, atol=1e-7)


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
    public = {
        autocast.use_compute_precision,
        autocast.use_original_precision,
        autocast.use_widest_precision,
        autocast.use_input_precision,
        autocast.use_full_precision,
        rules.use_precision_by_exponent,
        rules.use_input_precision_for_casts,
        autocast.use_own_precision,
    }
    for name, rule, reason in autocast.DEFAULT_PRECISION_TABLE:
        assert rule in public, name
        assert len(reason) > 20, name


def test_default_policy_is_the_table_plus_special_scopes():
    policy = autocast.default_amp_policy
    for scope in ("amp_stop", "amp_step", "amp_default"):
        assert policy[scope] is autocast.use_original_precision
    assert policy[lax.dot_general_p] is autocast.use_compute_precision
    assert policy[lax.exp_p] is autocast.use_full_precision
    assert policy[lax.add_p] is autocast.use_input_precision
    assert policy[lax.concatenate_p] is autocast.use_widest_precision
    present = {k.name for k in policy if not isinstance(k, str)}
    for name, _, _ in autocast.DEFAULT_PRECISION_TABLE:
        assert (name in present) == (_compat.primitive_by_name(name) is not None), name


def test_matmuls_and_convolutions_are_the_only_compute_rows():
    compute = {
        n for n, r, _ in autocast.DEFAULT_PRECISION_TABLE if r is autocast.use_compute_precision
    }
    assert compute == {"dot_general", "conv_general_dilated", "ragged_dot_general", "ragged_dot"}


def test_the_printed_table_lists_every_row():
    text = autocast.describe_default_policy()
    for name, rule, reason in autocast.DEFAULT_PRECISION_TABLE:
        assert f"| `{name}` | {rule.__name__} | {reason} |" in text
    assert "anything else | use_original_precision" in text


@pytest.mark.parametrize("page", ["docs/default_policy.md"])
def test_docs_print_the_current_table(page):
    from pathlib import Path

    text = (Path(__file__).parents[1] / page).read_text()
    assert autocast.describe_default_policy() in text, f"{page}: python -m autocast policy"


def test_kernels_keep_their_original_precision():
    rows = {name: (rule, reason) for name, rule, reason in autocast.DEFAULT_PRECISION_TABLE}
    rule, reason = rows["pallas_call"]
    assert rule is autocast.use_original_precision and "kernel" in reason
    assert "| `pallas_call` | use_original_precision |" in autocast.describe_default_policy()
    prim = _compat.primitive_by_name("pallas_call")
    if prim is not None:  # found once _compat knows where this JAX keeps it
        assert autocast.default_amp_policy[prim] is autocast.use_original_precision


def _cnn(params, x):
    y = lax.conv_general_dilated(
        x, params["k"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
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


def test_a_product_of_a_value_with_itself_is_a_square():
    # jnp.linalg.norm writes x * x: in float16 an activation of 640 squares to inf
    x, w = jnp.full((2, 8), 20.0, jnp.float32), jnp.eye(8) * 32
    norm = lambda x, w: jnp.linalg.norm(x @ w, axis=-1)  # noqa: E731
    f16 = autocast.amp(norm, compute_dtype=jnp.float16)
    muls = [e for e in eqns_named(jax.make_jaxpr(f16)(x, w), "mul") if e.invars[0] is e.invars[1]]
    assert muls and all(e.outvars[0].aval.dtype == jnp.float32 for e in muls)
    np.testing.assert_allclose(f16(x, w), norm(x, w), rtol=1e-3)
    unit = lambda x, w: (x @ w) / jnp.linalg.norm(x @ w, axis=-1, keepdims=True)  # noqa: E731
    np.testing.assert_allclose(
        autocast.amp(unit, compute_dtype=jnp.float16)(x, w), unit(x, w), rtol=2e-3
    )


@pytest.mark.parametrize(
    "spelling",
    [lambda y: jnp.reciprocal(y), lambda y: y**-1, lambda y: 1.0 / y, lambda y: jnp.divide(1, y)],
    ids=["reciprocal", "pow -1", "1.0 / y", "divide"],
)
def test_every_spelling_of_one_over_x_is_float32(spelling):
    x, w = (
        jnp.full((2, 8), 1e-6, jnp.float32),
        jnp.eye(8) * 10,
    )  # x @ w is 1e-5: 1 / that overflows float16
    f = lambda x, w: spelling(x @ w)  # noqa: E731
    got = autocast.amp(f, compute_dtype=jnp.float16)(x, w)
    # finite, and as exact as the float16 product (a subnormal there) allows
    assert bool(jnp.all(jnp.isfinite(got)))
    product = x.astype(jnp.float16) @ w.astype(jnp.float16)
    np.testing.assert_allclose(got, 1 / product.astype(jnp.float32), rtol=1e-3)
