"""Policies, dtype parsing and the casting helpers."""

from __future__ import annotations

import pickle

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

import autocast
from autocast._src.policy import dtypes
from autocast._src.policy.dtypes import half_dtype_for
from autocast._src.policy.target import Target

F32, F16, BF16, F64 = (np.dtype(d) for d in (jnp.float32, jnp.float16, jnp.bfloat16, jnp.float64))


@pytest.mark.parametrize(
    "name, dtype",
    [
        ("f32", F32),
        ("float32", F32),
        ("full", F32),
        ("f16", F16),
        ("float16", F16),
        ("bf16", BF16),
        ("bfloat16", BF16),
        ("f64", F64),
        ("float64", F64),
        (" BF16 ", BF16),
        ("Float32", F32),
        ("float8_e4m3fn", np.dtype(jnp.float8_e4m3fn)),
    ],
)
def test_parse_dtype_names(name, dtype):
    assert autocast.parse_dtype(name) == dtype


@pytest.mark.parametrize(
    "policy, expected",
    [
        ("c=f16", (F32, F16, F16)),
        ("p=f16", (F16, F16, F16)),
        ("p=f16,c=bf16", (F16, BF16, BF16)),
        ("p=f32,c=bf16,o=f32", (F32, BF16, F32)),
        ("params=float32,compute=float16,output=full", (F32, F16, F32)),
        (" P = F32 , C = BF16 ", (F32, BF16, BF16)),
        ("o=bf16", (F32, F32, BF16)),
        ("o=f16,c=bf16", (F32, BF16, F16)),
        ("c=f64", (F32, F64, F64)),
    ],
)
def test_get_policy_grammar_and_defaults(policy, expected):
    p = autocast.get_policy(policy)
    assert (p.param_dtype, p.compute_dtype, p.output_dtype) == expected


def test_half_means_half_dtype_as_in_jmp(monkeypatch):
    """jmp: "half" is half_dtype() (bfloat16 where that is preferred), not always float16."""
    half = autocast.half_dtype()
    assert autocast.parse_dtype("half") == half
    assert autocast.get_policy("c=half").compute_dtype == half
    assert autocast.Policy("f32", "half", "f32").compute_dtype == half
    # It follows half_dtype() wherever that lands, e.g. float16 on a pre-Ampere GPU.
    monkeypatch.setattr(dtypes, "half_dtype", lambda: F16)
    assert autocast.parse_dtype(" HALF ") == F16
    assert autocast.get_policy("params=float32,compute=half,output=full").compute_dtype == F16


@pytest.mark.parametrize(
    "name, dtype",
    [
        ("bfloat16", BF16),
        ("float16", F16),
        ("float32", F32),
        ("f32", F32),
        ("bf16", BF16),
        ("full", F32),
        ("f64", F64),
        (" BFloat16 ", BF16),
        ("float8_e4m3fn", np.dtype(jnp.float8_e4m3fn)),
    ],
)
def test_get_policy_bare_dtype_sets_all_three(name, dtype):
    """jmp: a policy string that is just a dtype name means params=compute=output=dtype."""
    p = autocast.get_policy(name)
    assert (p.param_dtype, p.compute_dtype, p.output_dtype) == (dtype, dtype, dtype)


def test_get_policy_bare_half():
    h = autocast.half_dtype()
    assert autocast.get_policy("half") == autocast.Policy(h, h, h)


def test_get_policy_passes_a_policy_through():
    p = autocast.Policy(F32, BF16, F32)
    assert autocast.get_policy(p) is p


_FLOAT_DTYPES = [F32, F16, BF16, F64, np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)]


@settings(max_examples=100, deadline=None)
@given(st.tuples(*[st.sampled_from(_FLOAT_DTYPES)] * 3))
def test_get_policy_round_trips_str(dtypes):
    policy = autocast.Policy(*dtypes)
    assert autocast.get_policy(str(policy)) == policy


@settings(max_examples=100, deadline=None)
@given(
    st.sampled_from(["p", "params", "P", "Params"]),
    st.sampled_from(["c", "compute", "C"]),
    st.sampled_from(["f32", "float32", "full", "bf16", "bfloat16", "f16", "half", "float16"]),
    st.sampled_from(["f32", "bf16", "half", "F16"]),
    st.text(alphabet=" \t", max_size=2),
)
def test_get_policy_spellings_agree(pkey, ckey, pval, cval, pad):
    text = f"{pad}{pkey}{pad}={pad}{pval}{pad},{ckey}={cval}{pad}"
    p = autocast.get_policy(text)
    assert p.param_dtype == autocast.parse_dtype(pval)
    assert p.compute_dtype == p.output_dtype == autocast.parse_dtype(cval)


def test_policy_is_frozen_hashable_and_a_valid_static_argument():
    a = autocast.Policy("f32", jnp.bfloat16, np.float32)
    b = autocast.get_policy("p=f32,c=bf16,o=f32")
    assert a == b and hash(a) == hash(b)
    assert {a: 1}[b] == 1
    with pytest.raises(AttributeError):
        a.compute_dtype = F16  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(a)) == a

    f = jax.jit(lambda x, policy: policy.cast_to_compute(x), static_argnums=1)
    assert f(jnp.ones(2), a).dtype == BF16


def test_policy_with_methods():
    p = autocast.get_policy("c=bf16")
    assert p.with_compute_dtype("f16").compute_dtype == F16
    assert p.with_param_dtype(jnp.bfloat16).param_dtype == BF16
    assert p.with_output_dtype("f32").output_dtype == F32
    assert p.compute_dtype == BF16  # unchanged


def _mixed_tree():
    return {
        "f32": jnp.ones((2, 3), jnp.float32),
        "bf16": jnp.ones(2, jnp.bfloat16),
        "f16": np.ones(4, np.float16),
        "int": jnp.arange(3),
        "bool": jnp.array([True, False]),
        "np_int": np.arange(2, dtype=np.int8),
        "complex": jnp.ones(2, jnp.complex64),
        "py_float": 0.1,
        "py_int": 3,
        "name": "layer",
        "none": None,
    }


@pytest.mark.parametrize(
    "method, attr",
    [
        ("cast_to_param", "param_dtype"),
        ("cast_to_compute", "compute_dtype"),
        ("cast_to_output", "output_dtype"),
    ],
)
def test_policy_casts_only_floating_array_leaves(method, attr):
    policy = autocast.Policy(F16, BF16, F32)  # three different targets, none needs x64
    tree = _mixed_tree()
    out = getattr(policy, method)(tree)
    target = getattr(policy, attr)
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(tree)
    for key in ("f32", "bf16", "f16"):
        assert out[key].dtype == target, key
        np.testing.assert_array_equal(
            np.asarray(out[key], np.float32), np.asarray(tree[key], np.float32)
        )
    assert isinstance(out["f16"], np.ndarray)  # NumPy arrays stay NumPy arrays
    for key in ("int", "bool", "np_int", "complex"):
        assert out[key].dtype == tree[key].dtype, key
    for key in ("py_float", "py_int", "name", "none"):
        assert out[key] is tree[key], key


def test_cast_helpers():
    tree = _mixed_tree()
    assert autocast.cast_to_full(tree)["bf16"].dtype == F32
    assert autocast.cast_to_half(tree)["f32"].dtype == autocast.half_dtype()
    assert autocast.cast_tree("bf16", tree)["f16"].dtype == BF16
    assert autocast.cast_tree(jnp.float16, tree)["int"].dtype == tree["int"].dtype


def test_cast_tree_leaves_matching_leaves_untouched():
    x = jnp.ones(3, jnp.bfloat16)
    assert autocast.cast_tree(jnp.bfloat16, [x])[0] is x


def test_cast_tree_under_jit_emits_one_convert_per_leaf():
    jaxpr = jax.make_jaxpr(lambda t: autocast.cast_to_half(t))(
        {"a": jnp.ones(2), "i": jnp.arange(2)}
    )
    converts = [e for e in jaxpr.eqns if e.primitive.name == "convert_element_type"]
    assert len(converts) == 1
    assert converts[0].params["new_dtype"] == autocast.half_dtype()


def test_half_dtype_on_this_backend():
    if jax.default_backend() in ("cpu", "tpu"):
        assert autocast.half_dtype() == BF16
    assert autocast.half_dtype() in (BF16, F16)


@pytest.mark.parametrize(
    "target, expected",
    [
        (Target("cpu", "cpu"), BF16),
        (Target("tpu", "TPU v5 lite"), BF16),
        (Target("gpu", "Tesla T4", "7.5"), F16),
        (Target("gpu", "Tesla V100-SXM2-16GB", "7.0"), F16),
        (Target("gpu", "NVIDIA A100-SXM4-80GB", "8.0"), BF16),
        (Target("gpu", "NVIDIA H100 80GB HBM3", "9.0"), BF16),
        (Target("gpu", "AMD Instinct MI300X", "gfx942"), BF16),  # ROCm's numbering
        (Target("gpu", "some GPU"), BF16),  # no capability known
    ],
)
def test_half_dtype_by_device(target, expected):
    assert half_dtype_for(target) == expected


# --- bad input: each error names the culprit and says what is accepted ----------------------


@pytest.mark.parametrize(
    "text, match",
    [
        ("", "empty policy"),
        ("   ", "empty policy"),
        ("x=f16", r"unknown key 'x'.*accepted keys: p, params, c, compute, o, output"),
        ("param=f16", r"unknown key 'param'"),
        ("c=", r"malformed part 'c='"),
        ("=bf16", r"malformed part '=bf16'"),
        ("c", r"malformed part 'c'"),
        ("c=f16,", r"malformed part ''"),
        ("c=foo", r"key 'c': Unknown dtype 'foo'; accepted names: f32, float32, full"),
        ("compute_float16", r"^Unknown dtype 'compute_float16'.*one dtype name.*key=dtype pairs"),
        ("int8", r"'int8' is not floating-point.*one dtype name"),
        ("p", r"malformed part 'p'"),
        ("c=int8", r"'int8' is not floating-point"),
        ("c=complex64", r"'complex64' is not floating-point"),
        ("p=f32,params=f16", r"sets param_dtype twice"),
        ("c=bf16,o=f16,c=f16", r"sets compute_dtype twice"),
    ],
)
def test_get_policy_rejects(text, match):
    with pytest.raises(ValueError, match=match):
        autocast.get_policy(text)


def test_get_policy_rejects_non_strings():
    with pytest.raises(TypeError, match="expects a string"):
        autocast.get_policy(jnp.float16)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "value, error, match",
    [
        ("", ValueError, "empty dtype name; accepted names"),
        ("bf17", ValueError, r"Unknown dtype 'bf17'; accepted names: f32.*half"),
        ("int32", ValueError, "'int32' is not floating-point"),
        ("bool", ValueError, "'bool' is not floating-point"),
        (16, TypeError, "expects a string"),
    ],
)
def test_parse_dtype_rejects(value, error, match):
    with pytest.raises(error, match=match):
        autocast.parse_dtype(value)


@pytest.mark.parametrize(
    "args, match",
    [
        ((jnp.int32, F32, F32), "param_dtype must be a floating-point dtype.*got int32"),
        ((F32, jnp.bool_, F32), "compute_dtype must be a floating-point dtype.*got bool"),
        ((F32, F32, "int8"), r"'int8' is not floating-point"),
        ((F32, F32, object()), "output_dtype must be a floating-point dtype"),
    ],
)
def test_policy_rejects_non_floating_dtypes(args, match):
    with pytest.raises((TypeError, ValueError), match=match):
        autocast.Policy(*args)


def test_cast_tree_rejects_non_floating_target():
    with pytest.raises(TypeError, match="must be a floating-point dtype.*got int8"):
        autocast.cast_tree(jnp.int8, {"w": jnp.ones(2)})


@pytest.mark.parametrize(
    ("name", "want"),
    [
        ("mixed_bfloat16", "p=f32,c=bf16,o=bf16"),
        ("mixed_float16", "p=f32,c=f16,o=f16"),
        (" MIXED_BFLOAT16 ", "p=f32,c=bf16,o=bf16"),
        ("float32", "p=f32,c=f32,o=f32"),
        ("bfloat16", "p=bf16,c=bf16,o=bf16"),
        ("float16", "p=f16,c=f16,o=f16"),
    ],
)
def test_keras_policy_names_mean_what_they_mean_in_keras(name, want):
    # Keras: mixed_* keeps variables in float32 and computes (and returns) in 16 bits
    assert str(autocast.get_policy(name)) == want


def test_an_unknown_keras_style_name_lists_what_is_accepted():
    with pytest.raises(ValueError, match="mixed_bfloat16 or mixed_float16"):
        autocast.get_policy("mixed_int8")
