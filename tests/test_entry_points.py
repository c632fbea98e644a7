"""Entry points (fused attention, bfloat16-only kernels) trace in the compute dtype under amp,
on either side of grad, and their result flows on in it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import eqns_named, operand_dtypes, require

import autocast
from autocast._src.policy.target import Target
from autocast._src.tools import measure as _measure
from autocast._src.transform import entry_points

BF16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
KEYS = jax.random.split(jax.random.PRNGKey(0), 4)
Q = jax.random.normal(KEYS[0], (2, 16, 4, 8))
K = jax.random.normal(KEYS[1], (2, 16, 4, 8))
V = jax.random.normal(KEYS[2], (2, 16, 4, 8))
W = jax.random.normal(KEYS[3], (32, 8)) / 6


@autocast.in_compute_dtype
def bf16_only_attention(q, k, v):
    """Stands for a kernel that checks its dtype while it traces, as cuDNN's does."""
    if q.dtype != jnp.bfloat16:
        raise ValueError(f"Q must be bf16, got {q.dtype}")
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")


def reference_attention(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")


def block(attention):
    def loss(q, k, v, w):
        o = attention(q, k, v)
        return jnp.sum(jnp.tanh(o.reshape(*o.shape[:2], -1) @ w) ** 2)

    return loss


def test_outside_amp_the_entry_point_runs_as_called():
    with pytest.raises(ValueError, match="must be bf16"):
        block(bf16_only_attention)(Q, K, V, W)


def test_under_amp_it_traces_in_the_compute_dtype_and_its_result_stays_16_bit():
    f = autocast.amp(block(bf16_only_attention), compute_dtype=jnp.bfloat16)
    jaxpr = jax.make_jaxpr(f)(Q, K, V, W)
    # the projection after the attention takes its result in bfloat16, no float32 round trip
    assert operand_dtypes(jaxpr, "dot_general")[-1] == ("bfloat16", "bfloat16")
    assert not [
        c
        for c in _measure.float_casts(jaxpr.jaxpr)
        if c.outvars[0].aval.dtype == F32 and c.invars[0].aval.shape == (2, 16, 4, 8)
    ]
    want = block(reference_attention)(Q, K, V, W)
    np.testing.assert_allclose(f(Q, K, V, W), want, rtol=3e-2)


@pytest.mark.slow
def test_on_either_side_of_grad():
    want = jax.grad(block(reference_attention), (0, 1, 2, 3))(Q, K, V, W)
    outer = jax.grad(
        autocast.amp(block(bf16_only_attention), compute_dtype=jnp.bfloat16), (0, 1, 2, 3)
    )
    inner = autocast.amp(
        jax.grad(block(bf16_only_attention), (0, 1, 2, 3)), compute_dtype=jnp.bfloat16
    )
    for got in (outer(Q, K, V, W), inner(Q, K, V, W)):
        assert [g.dtype for g in got] == [F32] * 4
        assert _measure.relative_error(got, want) < 0.05


def _seen(monkeypatch):
    """The dtypes each entry-point call under amp received, recorded."""
    seen = []
    call = entry_points._call

    def spy(fn, dtype, args, kwargs):
        def recorded(*args, **kwargs):
            leaves = jax.tree_util.tree_leaves(args)
            seen.append((fn.__name__, [x.dtype for x in leaves if hasattr(x, "dtype")]))
            return fn(*args, **kwargs)

        return call(recorded, dtype, args, kwargs)

    monkeypatch.setattr(entry_points, "_call", spy)
    return seen


def test_amp_stop_float32_compute_and_fp8(monkeypatch):
    seen = _seen(monkeypatch)
    attention = autocast.in_compute_dtype(reference_attention)

    def stopped(q, k, v, w):
        with autocast.amp_stop():
            o = attention(q, k, v)
        return jnp.sum(o.reshape(*o.shape[:2], -1) @ w)

    jax.make_jaxpr(autocast.amp(stopped, compute_dtype=jnp.bfloat16))(Q, K, V, W)
    jax.make_jaxpr(autocast.amp(block(attention), compute_dtype=jnp.float32))(Q, K, V, W)
    assert seen == []  # both ran as called, in float32
    wide = jnp.concatenate([W, W], axis=1)  # 16 outputs: narrower products stay bfloat16 under FP8
    jaxpr = jax.make_jaxpr(autocast.amp(block(attention), compute_dtype="fp8"))(Q, K, V, wide)
    assert seen == [("reference_attention", [BF16] * 3)]  # attention stays 16-bit under FP8
    assert operand_dtypes(jaxpr, "dot_general")[-1] == ("float8_e4m3fn", "float8_e4m3fn")


def _on_a_gpu(monkeypatch):
    """Arguments on this CPU taken for a GPU's (tests/test_target.py places them on one)."""
    h100 = Target("gpu", "NVIDIA H100 80GB HBM3", "9.0")
    monkeypatch.setattr(entry_points, "target_of", lambda *trees: h100)


def test_jax_nn_dot_product_attention_is_an_entry_point_where_it_may_pick_cudnn(monkeypatch):
    assert jax.nn.dot_product_attention._autocast_entry_point
    possible = entry_points.fused_attention_possible
    assert possible(Q, K, V, implementation="cudnn")
    assert not possible(Q, K, V, implementation="xla")
    _on_a_gpu(monkeypatch)
    assert possible(Q, K, V)  # left to JAX's choice on a GPU
    monkeypatch.setattr(entry_points, "target_of", lambda *trees: Target("cpu", "cpu"))
    assert not possible(Q, K, V)  # the XLA path: amp's own policy runs it


def test_flax_attention_reaches_the_entry_point(monkeypatch):
    nnx = require("flax.nnx")
    seen = _seen(monkeypatch)
    _on_a_gpu(monkeypatch)  # where JAX may choose cuDNN
    mha = nnx.MultiHeadAttention(
        num_heads=4, in_features=32, qkv_features=32, decode=False, rngs=nnx.Rngs(0)
    )
    x = jax.random.normal(KEYS[0], (2, 16, 32))

    def loss(x):
        return jnp.sum(mha(x) ** 2)

    got = autocast.amp(loss, compute_dtype=jnp.bfloat16)(x)
    assert [name for name, _ in seen] == ["dot_product_attention"]
    assert seen[0][1][:3] == [BF16] * 3
    np.testing.assert_allclose(got, loss(x), rtol=5e-2)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN's fused attention needs a GPU")
def test_cudnn_attention_under_amp_matches_a_hand_cast():
    cudnn = lambda q, k, v: jax.nn.dot_product_attention(  # noqa: E731
        q, k, v, is_causal=True, implementation="cudnn"
    )
    q, k, v = (jax.random.normal(key, (2, 128, 4, 64)) for key in KEYS[:3])
    w = jax.random.normal(KEYS[3], (256, 64)) / 16
    hand = jax.grad(
        lambda *a: block(cudnn)(*(x.astype(jnp.bfloat16) for x in a)).astype(F32), (0, 3)
    )
    amped = jax.grad(autocast.amp(block(cudnn), compute_dtype=jnp.bfloat16), (0, 3))
    jaxpr = jax.make_jaxpr(amped)(q, k, v, w)
    assert any(
        "cudnn" in str(e.params).lower() or "attention" in e.primitive.name
        for e in _measure.equations(jaxpr)
    )
    assert _measure.relative_error(amped(q, k, v, w), hand(q, k, v, w)) < 0.02
    assert not eqns_named(jaxpr, "exp")  # the softmax ran inside the fused kernel
