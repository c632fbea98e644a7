"""The tools people reach for when a mixed-precision run goes wrong work under amp on values
that come out of amp's float32 regions (a sum, an exp, a logsumexp of an activation):
jax.debug.print, jax.debug.callback and checkify, eagerly and under jit, grad and vmap."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import autocast

X, W = jnp.ones((4, 8)), jnp.ones((8, 16)) / 4


def _amp(f):
    return autocast.amp(f, compute_dtype=jnp.bfloat16)


def _debug_print(x, w):
    jax.debug.print("sum={s}", s=(x @ w).sum())
    return jnp.tanh(x @ w).sum()


def test_debug_print_of_a_regions_value(capfd):
    f = _amp(_debug_print)
    for run in (
        lambda: f(X, W),
        lambda: jax.jit(f)(X, W),
        lambda: jax.grad(f)(X, W),
        lambda: jax.vmap(f, (0, None))(jnp.stack([X, X]), W),
    ):
        jax.block_until_ready(run())
    jax.effects_barrier()
    printed = capfd.readouterr().out
    assert printed.count("sum=128.0") >= 5  # eager, jit, grad, and both vmapped examples


def test_debug_callback_gets_the_float32_statistic():
    seen = []

    def f(x, w):
        jax.debug.callback(
            lambda v: seen.append(np.asarray(v)), jax.nn.logsumexp(x @ w), ordered=True
        )
        jax.debug.callback(lambda v: seen.append(np.asarray(v)), jnp.exp(x @ w).max(), ordered=True)
        return jnp.tanh(x @ w).sum()

    g = _amp(f)
    for run in (lambda: g(X, W), lambda: jax.jit(g)(X, W), lambda: jax.grad(g)(X, W)):
        jax.block_until_ready(run())
    jax.effects_barrier()
    assert len(seen) == 6
    np.testing.assert_allclose(seen[0], 2 + np.log(64), rtol=1e-2)  # every entry of x @ w is 2
    np.testing.assert_allclose(seen[1], np.e**2, rtol=1e-2)
    assert all(v.dtype == np.float32 for v in seen)


def _checked(x, w):
    checkify.check(jnp.all(jnp.exp(x @ w) > 0), "exp must be positive")
    checkify.check(
        jax.nn.logsumexp(x @ w) < 10, "logsumexp {v} too large", v=jax.nn.logsumexp(x @ w)
    )
    return jnp.tanh(x @ w).sum()


@pytest.mark.parametrize("order", ["checkify(amp(f))", "jit(checkify(amp(f)))"])
def test_checkify_of_amp(order):
    f = checkify.checkify(_amp(_checked))
    if order.startswith("jit"):
        f = jax.jit(f)
    err, out = f(X, W)
    err.throw()  # passes
    np.testing.assert_allclose(out, jnp.tanh(X @ W).sum(), rtol=1e-2)
    err, _ = f(X * 10, W)
    with pytest.raises(checkify.JaxRuntimeError, match="logsumexp .* too large"):
        err.throw()


def test_checkify_under_grad_and_vmap():
    f = checkify.checkify(_amp(_checked))
    g = jax.grad(lambda x: f(x, W)[1])(X)
    assert g.shape == X.shape and bool(jnp.all(jnp.isfinite(g)))
    errs, outs = jax.vmap(lambda x: f(x, W))(jnp.stack([X, X * 10]))
    assert outs.shape == (2,)
    with pytest.raises(checkify.JaxRuntimeError):
        errs.throw()
