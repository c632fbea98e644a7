"""Run by test_higher_order.py in a child process with 4 CPU devices: amp inside shard_map and
pmap. Exits non-zero (an AssertionError) on any failure."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import autocast
from autocast import _compat
from autocast._src.tools import measure as _measure


def dot_dtypes(jaxpr):
    return {
        tuple(v.aval.dtype.name for v in e.invars)
        for e in _measure.equations(jaxpr)
        if e.primitive.name == "dot_general"
    }


def main() -> None:
    assert len(jax.devices()) == 4, jax.devices()
    w = jnp.linspace(-0.5, 0.5, 16).reshape(4, 4)
    x = jnp.linspace(-1, 1, 32).reshape(8, 4)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))  # automatic axes in every version
    x_sharded = jax.device_put(x, NamedSharding(mesh, P("d")))

    def local(xb, w):
        return jax.lax.psum(jnp.tanh(xb @ w).sum(), "d")

    fn = _compat.shard_map(local, mesh, (P("d"), P()), P())
    amp_fn = autocast.amp(fn, compute_dtype=jnp.bfloat16)
    jaxpr = jax.make_jaxpr(amp_fn)(x_sharded, w)
    assert dot_dtypes(jaxpr) == {("bfloat16", "bfloat16")}, jaxpr
    (sm,) = [e for e in _measure.equations(jaxpr) if e.primitive.name == "shard_map"]
    assert sm.params["mesh"] == mesh
    np.testing.assert_allclose(jax.jit(amp_fn)(x_sharded, w), fn(x_sharded, w), rtol=3e-2)
    g = jax.jit(jax.grad(amp_fn, argnums=1))(x_sharded, w)
    np.testing.assert_allclose(g, jax.grad(fn, argnums=1)(x_sharded, w), rtol=5e-2, atol=5e-2)
    assert dot_dtypes(jax.make_jaxpr(jax.grad(amp_fn, argnums=1))(x_sharded, w)) == {
        ("bfloat16", "bfloat16")
    }
    print("shard_map ok")

    # float32 partial sums that overflow float16 one by one but not summed: the psum runs on
    # them as they are (casting before a sum is not casting after it)
    def summed(part, w):
        return jax.lax.psum(part[0], "d") @ w

    sum_fn = _compat.shard_map(summed, mesh, (P("d"), P()), P())
    parts = jnp.array([6e4, 6e4, -6e4, -5.9e4])[:, None, None] * jnp.ones((4, 1, 8))
    got = jax.jit(autocast.amp(sum_fn, compute_dtype=jnp.float16))(parts, jnp.eye(8))
    np.testing.assert_allclose(got, sum_fn(parts, jnp.eye(8)), rtol=1e-3)
    print("psum ok")

    # loss scaling under shard_map: one poisoned example on one device; every device takes
    # the same decision (a skip), and the scale is kept (no smaller scale cures bad data)
    loss = lambda w, x: jnp.sum(jnp.tanh(x.astype(jnp.float16) @ w.astype(jnp.float16))).astype(  # noqa: E731
        jnp.float32
    )
    grad_fn = autocast.dynamic_scale_value_and_grad(loss, axis_name="d")

    def scaled_step(x, w):
        state, (_, g) = grad_fn(
            w, x, dynamic_scaler_state=autocast.DynamicScalerState(scaler=2.0**10)
        )
        return state.scaler[None], state.skipped_in_a_row[None], g[None]

    step = _compat.shard_map(scaled_step, mesh, (P("d"), P()), (P("d"), P("d"), P("d")))
    poisoned = x.at[5, 1].set(jnp.inf)  # device 2's rows
    scalers, skipped, _ = jax.jit(step)(jax.device_put(poisoned, NamedSharding(mesh, P("d"))), w)
    assert np.asarray(scalers).tolist() == [2.0**10] * 4, scalers
    assert np.asarray(skipped).tolist() == [1] * 4, skipped
    scalers, skipped, grads = jax.jit(step)(x_sharded, w)
    assert np.asarray(skipped).tolist() == [0] * 4 and np.all(np.isfinite(np.asarray(grads)))
    print("loss scaling ok")

    pfn = jax.pmap(lambda xb: jnp.tanh(xb @ w), axis_name="i")
    xs = x.reshape(4, 2, 4)
    amp_p = autocast.amp(pfn, compute_dtype=jnp.bfloat16)
    assert dot_dtypes(jax.make_jaxpr(amp_p)(xs)) == {("bfloat16", "bfloat16")}
    np.testing.assert_allclose(amp_p(xs), pfn(xs), rtol=3e-2, atol=3e-2)
    print("pmap ok")

    # delayed float8 scaling: a replicated history's gradient is the sum over devices, and
    # its bins still show the largest amax of any device's shard
    # (extents of 16 and more: narrower products stay bfloat16 under float8)
    w = jnp.linspace(-0.5, 0.5, 256).reshape(16, 16)
    big = jnp.linspace(-1, 1, 1024).reshape(64, 16).at[40].multiply(40.0)  # device 2's rows
    f8 = autocast.amp_fp8_delayed(lambda w, xb: jnp.mean(jnp.tanh(xb @ w)), history=4)
    history = f8.init(w, big)
    sharded = _compat.shard_map(
        lambda h, w, xb: jax.lax.pmean(f8(h, w, xb), "d"), mesh, (P(), P(), P("d")), P()
    )
    step = jax.jit(jax.grad(sharded, argnums=(0, 1)))
    for _ in range(3):
        g_history, g_w = step(history, w, jax.device_put(big, NamedSharding(mesh, P("d"))))
        history = history.advance(g_history)
        assert np.all(np.isfinite(np.asarray(g_w)))
    want = 2.0 ** np.ceil(np.log2(float(jnp.max(jnp.abs(big.astype(jnp.bfloat16))))))
    assert np.asarray(history.amax[0][0]).tolist() == [want] * 4, history.amax[0]
    print("fp8 history ok")


if __name__ == "__main__":
    main()
