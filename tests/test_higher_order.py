"""amp inside every higher-order primitive: values against float32, dtypes read off
the jaxpr (sub-jaxprs included), gradients, and parameters kept."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import bind_closed_call, eqns_named, jaxpr_of, operand_dtypes, xla_flags
from jax import lax
from jax.ad_checkpoint import checkpoint_name

import autocast
from autocast import _compat
from autocast._src.demo import models as _models
from autocast._src.tools import measure as _measure

BF16, F32 = jnp.bfloat16, jnp.float32
W = jnp.linspace(-0.5, 0.5, 16, dtype=F32).reshape(4, 4)
X = jnp.linspace(-1, 1, 12, dtype=F32).reshape(3, 4)


def bf16_amp(fn, **kw):
    return autocast.amp(fn, compute_dtype=BF16, **kw)


def assert_all_matmuls_16_bit(fn, *args):
    """Every matmul of amp(fn), and of its gradient, has bfloat16 operands."""
    amp_fn = bf16_amp(fn)
    for jaxpr in (
        jaxpr_of(amp_fn, *args),
        jaxpr_of(jax.grad(lambda *a: jnp.sum(amp_fn(*a))), *args),
    ):
        dts = operand_dtypes(jaxpr, "dot_general")
        assert dts and set(dts) == {("bfloat16", "bfloat16")}, dts


def assert_close_to_float32(fn, *args, rtol=3e-2):
    want, got = jax.jit(fn)(*args), jax.jit(bf16_amp(fn))(*args)
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=rtol, atol=rtol
    )
    g_want = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a))))(*args)
    g_got = jax.jit(jax.grad(lambda *a: jnp.sum(bf16_amp(fn)(*a))))(*args)
    assert g_got.dtype == g_want.dtype
    np.testing.assert_allclose(g_got, g_want, rtol=5 * rtol, atol=5 * rtol)


# --- jit --------------------------------------------------------------------------------------


def test_activation_entering_a_jitted_helper_stays_16_bit():
    @jax.jit
    def helper(h):
        return jnp.tanh(h) * 2.0

    fn = lambda w, x: helper(x @ w) @ w  # noqa: E731
    jaxpr = jaxpr_of(bf16_amp(fn), W, X)
    assert operand_dtypes(jaxpr, "tanh") == [("bfloat16",)]
    assert operand_dtypes(jaxpr, "mul") == [("bfloat16", "bfloat16")]
    assert_all_matmuls_16_bit(fn, W, X)
    assert_close_to_float32(fn, W, X)


def test_jit_parameters_are_kept():
    helper = jax.jit(lambda a, b: a @ b, donate_argnums=(1,), inline=False)
    jaxpr = jaxpr_of(bf16_amp(lambda w, x: helper(w, x.T)), W, X)
    (eqn,) = [e for e in jaxpr.eqns if e.primitive.name in ("jit", "pjit")]
    assert eqn.params["name"] == "<lambda>"
    assert eqn.params["donated_invars"] == (False, True)
    inner = eqn.params["jaxpr"]
    assert [v.aval.dtype for v in inner.jaxpr.invars] == [jnp.dtype(BF16)] * 2  # cast hoisted


# --- scan, fori_loop, map, while ----------------------------------------------------------------


def _scan_layers(ws, x):
    def body(h, w):
        return jnp.tanh(h @ w), jnp.sum(h)

    h, sums = lax.scan(body, x, ws)
    return h.sum() + sums.sum()


def test_scan_runs_its_body_in_16_bit():
    ws = jnp.stack([W, W * 0.5, -W])
    assert_all_matmuls_16_bit(lambda x: _scan_layers(ws, x), X)
    assert_close_to_float32(lambda x: _scan_layers(ws, x), X)


def test_a_carry_keeps_one_dtype_and_is_cast_once_per_iteration():
    def fn(x):
        acc = jnp.zeros(())  # weak accumulator of float32 sums: stays float32
        return lax.fori_loop(
            0, 4, lambda i, c: (c[0] + jnp.sum(c[1]), jnp.tanh(c[1] @ W)), (acc, x)
        )

    jaxpr = jaxpr_of(bf16_amp(fn), X)
    (loop,) = [e for e in jaxpr.eqns if e.primitive.name in ("scan", "while")]
    sub = loop.params["jaxpr" if loop.primitive.name == "scan" else "body_jaxpr"].jaxpr
    carry_in = [v.aval.dtype for v in sub.invars if v.aval.shape in ((), (3, 4))]
    assert jnp.dtype(F32) in carry_in
    body_casts = [e for e in _measure.float_casts(sub)]
    assert len(body_casts) <= 3  # x and w into the matmul, the result back: once per iteration
    acc, h = bf16_amp(fn)(X)
    want_acc, want_h = fn(X)
    assert (acc.dtype, h.dtype) == (jnp.dtype(F32), jnp.dtype(F32))
    np.testing.assert_allclose(h, want_h, rtol=3e-2, atol=3e-2)


def test_a_weak_stream_entering_a_scan_takes_its_unrolled_dtype():
    params = _models.stack_blocks(_models.init_gpt(jax.random.PRNGKey(0), layers=2))
    tokens = _models.gpt_batch(jax.random.PRNGKey(1))
    fn = lambda p, t: _models.gpt_loss(p, t, scan=True)  # noqa: E731
    jaxpr = jaxpr_of(bf16_amp(fn), params, tokens)
    (scan,) = eqns_named(jaxpr, "scan")
    n_consts, n_carry = _compat.scan_layout(scan)
    carry = scan.params["jaxpr"].jaxpr.invars[n_consts : n_consts + n_carry]
    assert [v.aval.dtype for v in carry] == [jnp.dtype(BF16)]  # the residual stream


def test_lax_map_and_while_loop():
    def mapped(x):
        return lax.map(lambda row: jnp.tanh(row @ W), x)

    assert_all_matmuls_16_bit(mapped, X)
    assert_close_to_float32(mapped, X)

    def looped(x):
        return lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.tanh(c[1] @ W)), (0, x))[
            1
        ]

    jaxpr = jaxpr_of(bf16_amp(looped), X)
    assert set(operand_dtypes(jaxpr, "dot_general")) == {("bfloat16", "bfloat16")}
    (loop,) = eqns_named(jaxpr, "while")
    assert loop.params["body_jaxpr"].out_avals[0].dtype == jnp.int32  # the counter is untouched
    np.testing.assert_allclose(bf16_amp(looped)(X), looped(X), rtol=3e-2, atol=3e-2)


# --- cond / switch ------------------------------------------------------------------------------


def test_cond_branches_agree_on_dtypes():
    def fn(x):
        # one branch ends in a 16-bit matmul, the other in a float32 exp: both return float32
        return lax.cond(x.sum() > 0, lambda x: x @ W, lambda x: jnp.exp(x), x)

    jaxpr = jaxpr_of(bf16_amp(fn), X)
    (cond,) = eqns_named(jaxpr, "cond")
    outs = [b.out_avals[0].dtype for b in cond.params["branches"]]
    assert outs == [jnp.dtype(F32)] * 2
    for x in (X, -X - 1):
        np.testing.assert_allclose(bf16_amp(fn)(x), fn(x), rtol=3e-2, atol=3e-2)


def test_switch_of_matmuls_and_its_gradient():
    def fn(x):
        branches = [lambda x: x @ W, lambda x: jnp.tanh(x @ W), lambda x: (x @ W) @ W]
        return lax.switch(jnp.int32(2), branches, x)

    assert_all_matmuls_16_bit(fn, X)
    assert_close_to_float32(fn, X)


# --- checkpoint ---------------------------------------------------------------------------------


def test_checkpoint_keeps_policy_and_names():
    policy = jax.checkpoint_policies.save_only_these_names("hidden")

    def block(x):
        h = checkpoint_name(jnp.tanh(x @ W), "hidden")
        return jnp.tanh(h @ W)

    fn = jax.checkpoint(block, policy=policy, prevent_cse=False)
    jaxpr = jaxpr_of(bf16_amp(fn), X)
    (remat,) = [e for e in jaxpr.eqns if e.primitive.name in ("remat2", "checkpoint")]
    assert remat.params["policy"] is policy
    assert remat.params["prevent_cse"] is False
    names = eqns_named(remat.params["jaxpr"], "name")
    assert [e.params["name"] for e in names] == ["hidden"]
    assert names[0].invars[0].aval.dtype == jnp.dtype(BF16)  # the mark does not upcast
    assert_all_matmuls_16_bit(fn, X)
    assert_close_to_float32(fn, X)
    # the policy still decides what is saved: the one named residual, in bfloat16
    res = jax.eval_shape(lambda x: jax.vjp(bf16_amp(fn), x)[1], X)
    saved = [(r.shape, r.dtype) for r in jax.tree_util.tree_leaves(res)]
    assert ((3, 4), jnp.dtype(BF16)) in saved


# --- custom derivatives -------------------------------------------------------------------------


@jax.custom_vjp
def scaled_tanh_matmul(x, w):
    return jnp.tanh(x @ w)


def _fwd(x, w):
    y = jnp.tanh(x @ w)
    return y, (x, w, y)


def _bwd(res, g):
    x, w, y = res
    d = g * (1 - y * y) * 3.0  # deliberately not the true derivative: the rule must be used
    return d @ w.T, x.T @ d


scaled_tanh_matmul.defvjp(_fwd, _bwd)


def test_custom_vjp_forward_and_backward_run_under_the_policy():
    loss = lambda x, w: scaled_tanh_matmul(x, w).sum()  # noqa: E731
    jaxpr = jaxpr_of(jax.grad(bf16_amp(loss), argnums=(0, 1)), X, W)
    assert set(operand_dtypes(jaxpr, "dot_general")) == {("bfloat16", "bfloat16")}
    got = jax.grad(bf16_amp(loss), argnums=(0, 1))(X, W)
    want = jax.grad(loss, argnums=(0, 1))(X, W)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        np.testing.assert_allclose(g, w, rtol=5e-2, atol=5e-2)  # includes the factor 3


def test_custom_vjp_cotangents_come_back_in_the_dtypes_the_inputs_arrived_in():
    def loss(x, w):
        h = x @ w  # bfloat16 under amp: it enters the custom_vjp function as such
        return scaled_tanh_matmul(h, w).sum()

    jaxpr = jaxpr_of(jax.grad(bf16_amp(loss)), X, W)
    assert jaxpr.out_avals[0].dtype == jnp.dtype(F32)
    np.testing.assert_allclose(
        jax.grad(bf16_amp(loss))(X, W), jax.grad(loss)(X, W), rtol=6e-2, atol=6e-2
    )


def test_custom_jvp_nn_functions_keep_16_bit_inputs():
    fn = lambda x: jax.nn.relu(x @ W) @ W + jax.nn.silu(x @ W) @ W  # noqa: E731
    jaxpr = jaxpr_of(bf16_amp(fn), X)
    for eqn in eqns_named(jaxpr, "custom_jvp_call"):
        assert eqn.invars[0].aval.dtype == jnp.dtype(BF16)
    assert_all_matmuls_16_bit(fn, X)
    assert_close_to_float32(fn, X)


# --- calls ---------------------------------------------------------------------------------------


def test_closed_call_is_evaluated_under_the_policy():
    closed = jax.make_jaxpr(lambda x: [jnp.tanh(x @ W)])(X)

    def fn(x):
        return bind_closed_call(closed, x)

    assert set(operand_dtypes(jaxpr_of(bf16_amp(fn), X), "dot_general")) == {
        ("bfloat16", "bfloat16")
    }
    np.testing.assert_allclose(bf16_amp(fn)(X), fn(X), rtol=3e-2, atol=3e-2)


def test_an_unknown_higher_order_primitive_is_refused_by_name():
    # Another library's primitive carrying an open jaxpr (whose constants amp could not
    # re-type in place); one carrying closed jaxprs is handled (tests/test_third_party.py).
    from jax.extend.core import Primitive

    my_call = Primitive("my_call")
    my_call.def_impl(lambda x, *, body: jax.core.eval_jaxpr(body, (), x)[0])
    my_call.def_abstract_eval(lambda x, *, body: body.outvars[0].aval)
    body = _compat.constants_unbound(jax.make_jaxpr(lambda x: x @ W)(X))
    if body is None:
        pytest.skip(f"JAX {jax.__version__} has no jaxprs with unbound constants")
    assert body.constvars  # W is a constant whose value the primitive keeps elsewhere
    fn = lambda x: my_call.bind(x, body=body)  # noqa: E731
    with pytest.raises(NotImplementedError, match="'my_call'.*parameter\\(s\\) body.*amp_stop"):
        jaxpr_of(bf16_amp(fn), X)
    # under amp_stop it is bound exactly as recorded, on float32 inputs
    (eqn,) = eqns_named(jaxpr_of(bf16_amp(autocast.amp_stop(fn)), X), "my_call")
    assert eqn.params["body"] is body and eqn.invars[0].aval.dtype == jnp.dtype(F32)


# --- shard_map and pmap run on 4 CPU devices, in a child process ---------------------------------


@pytest.mark.slow
def test_shard_map_and_pmap_on_several_devices():
    script = Path(__file__).with_name("multidevice_check.py")
    env = {
        **os.environ,
        "XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=4"),
        "JAX_PLATFORMS": "cpu",
    }
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert all(
        f"{what} ok" in done.stdout
        for what in ("shard_map", "psum", "loss scaling", "pmap", "fp8 history")
    )


# --- random nests of all of the above (hypothesis) ---------------------------------------------

import hypothesis.strategies as st  # noqa: E402
from hypothesis import given, settings  # noqa: E402


def _wrap_custom_jvp(f):
    g = jax.custom_jvp(f)
    g.defjvp(lambda primals, tangents: jax.jvp(f, primals, tangents))
    return g


def _wrap_custom_vjp(f):
    g = jax.custom_vjp(f)

    def fwd(x):
        y, pullback = jax.vjp(f, x)
        return y, pullback

    g.defvjp(fwd, lambda pullback, ct: pullback(ct))
    return g


WRAPPERS = {
    "jit": jax.jit,
    "checkpoint": jax.checkpoint,
    "scan": lambda f: lambda x: lax.scan(lambda c, _: (f(c), None), x, None, length=2)[0],
    "fori": lambda f: lambda x: lax.fori_loop(0, 2, lambda i, c: f(c), x),
    "cond": lambda f: lambda x: lax.cond(jnp.sum(x) > 0, f, lambda z: f(z) * 0.5, x),
    "custom_jvp": _wrap_custom_jvp,
    "custom_vjp": _wrap_custom_vjp,
}


def _core(x):
    return jnp.tanh(x @ W) + 0.5 * x


@pytest.mark.slow
@settings(max_examples=20, deadline=None)
@given(st.lists(st.sampled_from(sorted(WRAPPERS)), min_size=1, max_size=4))
def test_random_nests_run_16_bit_and_agree_with_float32(nest):
    fn = _core
    for name in nest:
        fn = WRAPPERS[name](fn)
    amp_fn = bf16_amp(fn)
    # A custom_vjp inside a custom_jvp rule too: JAX linearises it into custom_lin, whose
    # backward amp re-binds under the policy.
    assert_all_matmuls_16_bit(fn, X)
    out = jax.jit(amp_fn)(X)
    assert out.dtype == jnp.dtype(F32)
    np.testing.assert_allclose(out, jax.jit(fn)(X), rtol=5e-2, atol=5e-2)
    grad = jax.jit(jax.grad(lambda x: amp_fn(x).sum()))(X)
    assert grad.dtype == jnp.dtype(F32)
    want = jax.jit(jax.grad(lambda x: fn(x).sum()))(X)
    np.testing.assert_allclose(grad, want, rtol=1e-1, atol=1e-1)
