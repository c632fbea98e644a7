"""Cases a review of the first complete version found broken; each stays fixed."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from conftest import jaxpr_of

import autocast

BF16, F32 = jnp.bfloat16, jnp.float32


def bf16_amp(fn):
    return autocast.amp(fn, compute_dtype=BF16)


def test_scatter_max_min_mul_and_segment_max_run():
    x, i = jnp.array([1.0, 5.0, 3.0]), jnp.array([0, 2, 2])

    def fn(x):
        return (
            jnp.zeros(3).at[i].max(x),
            jnp.full(3, 9.0).at[i].min(x),
            jnp.ones(3).at[i].mul(x),
            jax.ops.segment_max(x, i, num_segments=3),
        )

    for got, want in zip(bf16_amp(fn)(x), fn(x)):
        np.testing.assert_allclose(got, want)


def test_linear_solves_run_in_original_precision():
    a = jnp.eye(3) * 2 + 0.1
    fn = lambda b: jnp.linalg.solve(a, b) + jnp.linalg.inv(a) @ b  # noqa: E731
    b = jnp.array([1.0, 2.0, 3.0])
    np.testing.assert_allclose(bf16_amp(fn)(b), fn(b), rtol=2e-2)


def test_unscale_at_the_largest_scales():
    ls = autocast.DynamicLossScale(np.float32(2.0**127))
    assert float(ls.unscale(jnp.float32(2.0**127))) == 1.0


def test_typed_prng_key_in_a_loop_carry():
    def fn(h):
        def body(c, _):
            key, h = c
            key, sub = jax.random.split(key)
            return (key, h + jax.random.normal(sub, h.shape)), None

        return jax.lax.scan(body, (jax.random.key(1), h), None, length=3)[0][1]

    # the key passes through; the float32 arithmetic on its draws is compiled under amp and
    # eager here, so equal to float32's rounding
    np.testing.assert_allclose(bf16_amp(fn)(jnp.ones(2)), fn(jnp.ones(2)), rtol=1e-6)


def test_static_arguments_are_told_apart_by_type_and_sign():
    af = bf16_amp(lambda a, s: a * s)
    assert af(jnp.arange(3), 2).dtype == jnp.int32
    assert af(jnp.arange(3), 2.0).dtype == jnp.float32
    fn = lambda x: (1 / jnp.where(x > 0, x, 0.0), 1 / jnp.where(x > 0, x, -0.0))  # noqa: E731
    x = jnp.array([-1.0, 2.0])
    for got, want in zip(bf16_amp(fn)(x), fn(x)):
        np.testing.assert_array_equal(got, want)


def test_float32_compute_keeps_a_programs_own_16_bit_operations():
    fn = lambda a, b: jnp.exp(a.astype(BF16) @ b.astype(BF16) / 8).astype(F32)  # noqa: E731
    a = jax.random.normal(jax.random.PRNGKey(0), (16, 16))
    b = jax.random.normal(jax.random.PRNGKey(1), (16, 16))
    np.testing.assert_array_equal(
        jax.jit(autocast.amp(fn, compute_dtype=F32))(a, b), jax.jit(fn)(a, b)
    )


def test_an_accumulator_starting_at_zeros_keeps_float32():
    xs = jax.random.normal(jax.random.PRNGKey(0), (200, 8))
    w = jax.random.normal(jax.random.PRNGKey(1), (8, 8)) / 3
    fn = lambda xs, w: jax.lax.fori_loop(  # noqa: E731
        0, 200, lambda i, acc: acc + jax.nn.relu(xs[i] @ w), jnp.zeros(8)
    )
    (loop,) = [
        e for e in jaxpr_of(bf16_amp(fn), xs, w).eqns if e.primitive.name in ("scan", "while")
    ]
    carries = [v.aval for v in loop.outvars if v.aval.shape == (8,)]
    assert [a.dtype for a in carries] == [jnp.dtype(F32)]
    ref = fn(xs, w)
    assert float(jnp.max(jnp.abs(bf16_amp(fn)(xs, w) - ref)) / jnp.max(jnp.abs(ref))) < 5e-3


def test_constant_positions_enter_a_checkpoint_unchanged():
    def block(x, pos):
        return jnp.sin(pos[:, None] * 0.5) * x

    def fn(x):
        return jax.checkpoint(block)(x, jnp.arange(x.shape[0], dtype=F32))

    x = jnp.ones((2048, 2))
    (remat,) = [
        e for e in jaxpr_of(bf16_amp(fn), x).eqns if e.primitive.name in ("remat2", "checkpoint")
    ]
    assert remat.invars[1].aval.dtype == jnp.dtype(F32)
    np.testing.assert_allclose(bf16_amp(fn)(x), fn(x), atol=1e-6)


def test_scaler_signature_names_the_state_keyword():
    import inspect

    grad_fn = autocast.dynamic_scale_value_and_grad(lambda w, x: jnp.sum((w * x) ** 2))
    assert "dynamic_scaler_state" in inspect.signature(grad_fn).parameters
