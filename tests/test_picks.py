"""A gather that picks one element per row (a classifier's target log-probability) is
differentiated by a select under 16-bit compute, not by a scatter into a full-size zero
array: the same gradient, and no float32 ``tokens x vocabulary`` buffer in the backward pass."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import eqns_named

import autocast
from autocast._src.tools import measure
from autocast._src.transform import picks


def _keys(n: int) -> list:
    return list(jax.random.split(jax.random.key(0), n))


def _cross_entropy(axis: int, mode: str | None = None):
    # a new function object per call: amp's traces are shared per function
    def loss(w, x, t):
        logits = (x @ w).astype(jnp.float32)
        logits = jnp.moveaxis(logits, -1, axis)
        logp = jax.nn.log_softmax(logits, axis=axis)
        picked = jnp.take_along_axis(logp, jnp.expand_dims(t, axis), axis=axis, mode=mode)
        return -jnp.mean(picked)

    return loss


def _args(targets_high: int = 40):
    k = _keys(3)
    w = jax.random.normal(k[0], (16, 40))
    x = jax.random.normal(k[1], (4, 6, 16))
    t = jax.random.randint(k[2], (4, 6), 0, targets_high)
    return w, x, t


def _without_picks(monkeypatch, fn, *args):
    """``fn(*args)`` with the gather differentiated as JAX does (a scatter-add)."""
    with monkeypatch.context() as m:
        m.setattr(picks, "_picked_axis", lambda eqn: None)
        return fn(*args)


@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_the_pick_is_differentiated_by_a_select_with_the_scatters_values(monkeypatch, axis):
    args = _args()
    grad = jax.jit(jax.grad(autocast.amp(_cross_entropy(axis)), argnums=(0, 1)))
    jaxpr = jax.make_jaxpr(grad)(*args)
    assert not eqns_named(jaxpr.jaxpr, "scatter-add") and not eqns_named(jaxpr.jaxpr, "scatter_add")
    got = grad(*args)
    again = jax.jit(jax.grad(autocast.amp(_cross_entropy(axis)), argnums=(0, 1)))
    scattered = jax.make_jaxpr(lambda *a: _without_picks(monkeypatch, again, *a))(*args)
    assert eqns_named(scattered.jaxpr, "scatter-add") or eqns_named(scattered.jaxpr, "scatter_add")
    want = _without_picks(monkeypatch, again, *args)
    # the select gives the scatter's values; the two programs around them are compiled apart,
    # so they agree to the rounding of what XLA may fuse otherwise, not to the bit
    for g, r in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-7)


def test_out_of_range_targets_get_the_scatters_gradient_in_every_mode(monkeypatch):
    args = _args(targets_high=60)  # some targets beyond the 40 classes
    for mode in ("clip", "fill"):
        grad = jax.grad(autocast.amp(_cross_entropy(-1, mode)))
        want = _without_picks(monkeypatch, jax.grad(autocast.amp(_cross_entropy(-1, mode))), *args)
        np.testing.assert_allclose(np.asarray(grad(*args)), np.asarray(want), rtol=1e-5, atol=1e-7)


def test_gathers_that_may_repeat_an_element_keep_their_sum():
    # an embedding lookup reads rows (slices, not elements) and repeats tokens: its gradient
    # adds the repeats, as JAX's scatter does
    def loss(table, tokens, w):
        return jnp.sum((table[tokens] @ w) ** 2)

    k = _keys(2)
    table, w = jax.random.normal(k[0], (10, 16)), jax.random.normal(k[1], (16, 16))
    tokens = jnp.array([[1, 1, 1, 2], [2, 3, 1, 1]])
    got = jax.grad(autocast.amp(loss))(table, tokens, w)
    want = jax.grad(loss)(table, tokens, w)
    assert measure.relative_error(got, want) < 0.02  # bfloat16 products, the repeats summed
    assert jnp.linalg.norm(got[1]) > 2 * jnp.linalg.norm(got[3])  # token 1 four times, 3 once
    # two picks per row may name the same element twice: a scatter, as written
    pairs = lambda x, t: jnp.sum(jnp.take_along_axis(x, t, axis=-1) ** 2)  # noqa: E731
    x, t = jax.random.normal(k[0], (3, 8)), jnp.array([[1, 1], [2, 5], [0, 0]])
    jaxpr = jax.make_jaxpr(jax.grad(autocast.amp(pairs)))(x.astype(jnp.bfloat16), t)
    assert eqns_named(jaxpr.jaxpr, "scatter-add") or eqns_named(jaxpr.jaxpr, "scatter_add")
    np.testing.assert_array_equal(
        np.asarray(jax.grad(autocast.amp(pairs))(x, t)), np.asarray(jax.grad(pairs)(x, t))
    )


def test_float32_compute_keeps_the_program_as_written():
    args = _args()
    loss = _cross_entropy(-1)
    jaxpr = jax.make_jaxpr(jax.grad(autocast.amp(loss, compute_dtype=jnp.float32)))(*args)
    assert eqns_named(jaxpr.jaxpr, "scatter-add") or eqns_named(jaxpr.jaxpr, "scatter_add")
    # the same equations, but amp's are compiled as one program and the reference runs op by
    # op: XLA's CPU kernels may then differ in the last bits (they do on JAX 0.12)
    np.testing.assert_allclose(
        np.asarray(jax.grad(autocast.amp(loss, compute_dtype=jnp.float32))(*args)),
        np.asarray(jax.grad(loss)(*args)),
        rtol=1e-5,
        atol=1e-7,
    )


def test_under_vmap_and_a_second_amp_the_pick_still_differentiates():
    w, x, t = _args()
    per_example = jax.vmap(jax.grad(autocast.amp(_cross_entropy(-1))), in_axes=(None, 0, 0))
    got = per_example(w, x, t)
    want = jax.vmap(jax.grad(_cross_entropy(-1)), in_axes=(None, 0, 0))(w, x, t)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0.05, atol=5e-3)
