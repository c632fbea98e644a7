"""Loss scaling that cannot stall: bad data costs one skipped step and no scale, a genuine
gradient overflow is still retried and cured, the scale has a floor, and the state counts
what a stalled run looks like, on the device."""

from __future__ import annotations

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from jax.experimental import checkify

import autocast
from autocast._src.demo import models as _models

pytestmark = pytest.mark.slow  # trains models or runs subprocesses: make test-fast leaves it out

AMP_MLP_F16 = autocast.amp(_models.mlp_loss, compute_dtype=jnp.float16)
BAD_STEPS = (5, 6, 20, 41)


def _batch(step, bad=False):
    kx, ky = jax.random.split(jax.random.fold_in(jax.random.key(0), step))
    x = jax.random.normal(kx, (64, 32))
    y = jnp.argmax(x[:, :10], axis=-1)  # learnable: the label is the largest of ten features
    return jnp.where(bad, x.at[3, 7].set(jnp.inf), x), y


def _train(state, steps=60, bad_steps=BAD_STEPS, **options):
    grad_fn = autocast.dynamic_scale_value_and_grad(AMP_MLP_F16, **options)

    @jax.jit
    def step(params, state, i, bad):
        x, y = _batch(i, bad)
        state, (loss, grads) = grad_fn(params, x, y, dynamic_scaler_state=state)
        new = jax.tree_util.tree_map(lambda p, g: p - 0.5 * g, params, grads)
        return autocast.select_tree(autocast.all_finite(grads), new, params), state, loss

    params = _models.init_mlp(jax.random.key(1))
    history = []
    for i in range(steps):
        before = params
        params, state, loss = step(params, state, i, i in bad_steps)
        history.append((before, params, state, float(loss)))
    return history


def test_inf_in_the_data_costs_one_skipped_step_and_no_scale():
    # jaxamp's defaults (redo_on_nan=10) and a scale of 2**10: four batches with an inf
    history = _train(autocast.DynamicScalerState(scaler=2.0**10))
    for i in BAD_STEPS:
        before, after, state, _ = history[i]
        for a, b in zip(jax.tree_util.tree_leaves(after), jax.tree_util.tree_leaves(before)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # skipped, bit for bit
        assert float(state.scaler) >= 2.0**10  # no smaller scale cures a bad batch
    final = history[-1][2]
    assert float(final.scaler) >= 2.0**10 and int(final.total_resets) == len(BAD_STEPS)
    assert int(history[6][2].skipped_in_a_row) == 2 and int(final.skipped_in_a_row) == 0
    # training goes on after the last bad batch
    losses = [h[3] for h in history]
    assert np.mean(losses[-5:]) < 0.9 * np.mean(losses[42:47])
    assert int(final.zero_grad_steps) == 0 and not autocast.stalled(final)


def test_a_gradient_overflow_is_still_retried_and_cured():
    # a float16 loss whose gradient overflows at 2**15: the loss is finite, retrying helps
    loss = lambda w: jnp.sum(w.astype(jnp.float16) ** 2).astype(jnp.float32) * 8  # noqa: E731
    grad_fn = autocast.dynamic_scale_value_and_grad(loss, redo_on_nan=10)
    state, (value, grads) = grad_fn(jnp.ones(2), dynamic_scaler_state=autocast.DynamicScalerState())
    np.testing.assert_array_equal(grads, [16.0, 16.0])
    assert float(state.scaler) < 2.0**15 and int(state.total_resets) >= 1
    assert int(state.skipped_in_a_row) == 0  # cured within the step: not a skipped step


def test_the_scale_never_goes_below_its_floor_and_retries_stop_there():
    # a finite loss whose float16 gradient overflows at every scale above 1: halve down to
    # the floor of 2, try there, then stop retrying
    loss = lambda w: jnp.sum(w.astype(jnp.float16) * 6e4).astype(jnp.float32)  # noqa: E731
    grad_fn = autocast.dynamic_scale_value_and_grad(loss, redo_on_nan=50)
    state = autocast.DynamicScalerState(scaler=2.0**4, min_scaler=2.0)
    state, _ = grad_fn(jnp.full(2, 1e-3), dynamic_scaler_state=state)
    assert float(state.scaler) == 2.0
    assert int(state.total_resets) == 4  # tried at 16, 8, 4 and 2; no retry once at the floor
    assert int(state.steps_at_floor) == 1 and int(state.skipped_in_a_row) == 1
    floor_default = autocast.DynamicScalerState(scaler=2.0)
    assert float(floor_default.adjust(jnp.bool_(False)).scaler) == 1.0
    assert float(floor_default.adjust(jnp.bool_(False)).adjust(jnp.bool_(False)).scaler) == 1.0


def test_a_stalled_run_fails_fast_under_checkify():
    bad = autocast.dynamic_scale_value_and_grad(lambda w: jnp.sum(w * jnp.inf))

    @jax.jit
    @checkify.checkify
    def step(w, state):
        state, _ = bad(w, dynamic_scaler_state=state)
        autocast.check_not_stalled(state, max_skipped_in_a_row=3)
        return state

    state = autocast.DynamicScalerState()
    for _ in range(3):
        err, state = step(jnp.ones(2), state)
        err.throw()
    err, state = step(jnp.ones(2), state)
    with pytest.raises(checkify.JaxRuntimeError, match="4 steps skipped in a row"):
        err.throw()


def test_optax_face_has_a_floor_and_counts_health():
    optax = pytest.importorskip("optax")
    import autocast.optax as aopt

    tx = aopt.dynamic_loss_scaling(
        optax.sgd(0.1), autocast.DynamicLossScale(4.0), min_loss_scale=2.0
    )
    params = jnp.ones(2)
    state = tx.init(params)
    for _ in range(3):
        _, state = tx.update(jnp.array([jnp.nan, 1.0]), state, params)
    assert float(aopt.loss_scale_of(state).loss_scale) == 2.0
    health = state.health
    assert (int(health.skipped_in_a_row), int(health.steps_at_floor)) == (3, 3)  # 4 -> 2, 2, 2
    _, state = tx.update(jnp.zeros(2), state, params)
    assert (int(state.health.skipped_in_a_row), int(state.health.zero_grad_steps)) == (0, 1)
    assert bool(autocast.stalled(state, max_skipped_in_a_row=2)) is False
    with pytest.raises(TypeError, match="min_loss_scale applies to a dynamic"):
        aopt.dynamic_loss_scaling(optax.sgd(0.1), autocast.StaticLossScale(4.0), min_loss_scale=1.0)


def test_every_device_decides_alike_and_a_poisoned_example_costs_no_scale():
    # the shard_map case on one host: vmap with an axis name stands for the devices
    w = jnp.array([0.5, -0.5, 1.0])
    xs = (jnp.arange(12.0).reshape(4, 3) / 10).at[2, 1].set(jnp.inf)
    loss = lambda w, x: jnp.sum((x @ w).astype(jnp.float16) ** 2).astype(jnp.float32)  # noqa: E731
    grad_fn = autocast.dynamic_scale_value_and_grad(loss, axis_name="d")
    state0 = autocast.DynamicScalerState(scaler=2.0**10)
    state, _ = jax.vmap(lambda x: grad_fn(w, x, dynamic_scaler_state=state0), axis_name="d")(xs)
    np.testing.assert_array_equal(np.asarray(state.scaler), np.full(4, 2.0**10, np.float32))
    np.testing.assert_array_equal(np.asarray(state.skipped_in_a_row), np.ones(4))


@pytest.mark.once
@settings(max_examples=6, deadline=None)
@given(faults=st.lists(st.booleans(), min_size=12, max_size=12), overflow=st.booleans())
def test_random_fault_schedules(faults, overflow):
    """Skipped steps leave the parameters bit-identical, the scale stays within [floor, max],
    and rare faults never stall training."""
    floor, top = 1.0, float(np.finfo(np.float32).max)
    scale = 2.0**18 if overflow else 2.0**8  # 2**18 makes float16 gradients overflow: retried
    history = _train(
        autocast.DynamicScalerState(scaler=scale, patience=3),
        steps=len(faults),
        bad_steps=tuple(i for i, f in enumerate(faults) if f),
        redo_on_nan=10,
    )
    for i, (before, after, state, _) in enumerate(history):
        assert floor <= float(state.scaler) <= top
        if faults[i]:
            for a, b in zip(jax.tree_util.tree_leaves(after), jax.tree_util.tree_leaves(before)):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if sum(faults) <= 2:
        assert not bool(
            autocast.stalled(history[-1][2], max_skipped_in_a_row=2, max_steps_at_floor=5)
        )
