"""The short training run the benchmarks compare float32 and amp with."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax


def final_loss(
    loss: Callable[..., jax.Array],
    params: Any,
    batches: Callable[[jax.Array], tuple],
    steps: int,
    last: int,
) -> float:
    """The mean loss of the ``last`` of ``steps`` Adam steps (learning rate 1e-3), the step
    number choosing each batch (``batches(i)`` gives ``loss``'s arguments after ``params``):
    a mean, so that one noisy batch does not decide a comparison."""
    optimizer = optax.adam(1e-3)

    @jax.jit
    def step(params: Any, opt_state: Any, i: jax.Array) -> tuple[Any, Any, jax.Array]:
        value, grads = jax.value_and_grad(loss)(params, *batches(i))
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    opt_state, losses = optimizer.init(params), []
    for i in range(steps):
        params, opt_state, value = step(params, opt_state, jnp.asarray(i))
        losses.append(value)
    return float(jnp.mean(jnp.stack(losses[-last:])))


def final_loss_delayed(
    loss: Any,
    params: Any,
    batches: Callable[[jax.Array], tuple],
    steps: int,
    last: int,
) -> float:
    """:func:`final_loss` for a function of :func:`autocast.amp_fp8_delayed`: its history
    made by ``init`` on the first batch, then advanced each step by its gradient."""
    optimizer = optax.adam(1e-3)

    @jax.jit
    def step(history: Any, params: Any, opt_state: Any, i: jax.Array) -> tuple[Any, Any, Any, jax.Array]:
        value, (g_history, grads) = jax.value_and_grad(loss, argnums=(0, 1))(history, params, *batches(i))
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return history.advance(g_history), optax.apply_updates(params, updates), opt_state, value

    history = loss.init(params, *batches(jnp.asarray(0)))
    opt_state, losses = optimizer.init(params), []
    for i in range(steps):
        history, params, opt_state, value = step(history, params, opt_state, jnp.asarray(i))
        losses.append(value)
    return float(jnp.mean(jnp.stack(losses[-last:])))
