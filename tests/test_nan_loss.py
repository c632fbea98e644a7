"""A non-finite loss is a skipped step in every loss-scaling face, even where the gradients
are finite: a NaN from a term the parameters do not reach."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import autocast
import autocast.optax


def _loss(w, x):
    return jnp.mean((x @ w) ** 2) + jnp.sqrt(jnp.float32(-1.0))  # NaN, with finite gradients


W, X = jnp.ones((16, 16)) / 16, jnp.ones((16, 16))
AMP = autocast.amp(_loss, compute_dtype=jnp.float16)


def test_the_jaxamp_face_skips_the_documented_train_step():
    assert np.isnan(float(_loss(W, X))) and bool(autocast.all_finite(jax.grad(_loss)(W, X)))
    grad_fn = autocast.dynamic_scale_value_and_grad(AMP)
    optimizer = optax.adam(1e-2)

    @jax.jit
    def train_step(params, opt_state, scaler_state):  # as docs/loss_scaling.md writes it
        scaler_state, (loss, grads) = grad_fn(params, X, dynamic_scaler_state=scaler_state)
        finite = autocast.all_finite(grads)
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        params, opt_state = autocast.select_tree(
            finite, (new_params, new_opt_state), (params, opt_state)
        )
        return params, opt_state, scaler_state, loss

    opt_state, state = optimizer.init(W), autocast.DynamicScalerState()
    params, new_opt_state, new_state, loss = train_step(W, opt_state, state)
    assert np.isnan(float(loss))
    assert np.array_equal(params, W)  # bit-identical: the step was skipped
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(np.array_equal, new_opt_state, opt_state))
    assert int(new_state.skipped_in_a_row) == 1
    assert float(new_state.scaler) == float(state.scaler)  # no scale cures a NaN loss
    # dynamic_scale_grad is the same face without the value
    state_g, grads = autocast.dynamic_scale_grad(AMP)(W, X, dynamic_scaler_state=state)
    assert not bool(autocast.all_finite(grads)) and int(state_g.skipped_in_a_row) == 1


def test_the_optax_face_skips_when_given_the_loss():
    tx = autocast.optax.dynamic_loss_scaling(optax.sgd(0.1))
    state = tx.init(W)
    scale = autocast.optax.loss_scale_of(state)
    loss, grads = jax.value_and_grad(lambda w: scale.scale(AMP(w, X)))(W)
    assert not np.isfinite(float(loss)) and bool(autocast.all_finite(grads))
    updates, skipped = jax.jit(tx.update)(grads, state, W, value=loss)
    assert np.array_equal(optax.apply_updates(W, updates), W)
    assert int(autocast.optax.skipped_steps(skipped)) == 1
    # without the loss, this face sees finite gradients only, and applies them
    updates, applied = tx.update(grads, state, W)
    assert int(autocast.optax.skipped_steps(applied)) == 0
    # other transformations' extra arguments pass through optax.chain
    chained = optax.chain(tx)
    updates, _ = chained.update(grads, chained.init(W), W, value=loss)
    assert np.array_equal(optax.apply_updates(W, updates), W)
