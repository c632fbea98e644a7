"""The short training run the benchmarks compare float32 and amp with."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

import autocast


def first_history(loss: Callable[..., Any], params: Any, *batch: Any) -> Any:
    """The float8 history a function of :func:`autocast.amp_fp8_delayed` starts from (its
    ``init`` on these arguments); None for any other loss."""
    return loss.init(params, *batch) if isinstance(loss, autocast.DelayedFp8) else None


def loss_and_grads(
    loss: Callable[..., Any], history: Any, params: Any, *batch: Any
) -> tuple[Any, Any, Any]:
    """One step's loss value, the next float8 history (None when ``history`` is) and the
    parameters' gradients: a delayed-scaling loss takes its history first and advances it."""
    if history is None:
        value, grads = jax.value_and_grad(loss)(params, *batch)
        return value, None, grads
    value, (g_history, grads) = jax.value_and_grad(loss, argnums=(0, 1))(history, params, *batch)
    return value, history.advance(g_history), grads


def final_loss(
    loss: Callable[..., jax.Array],
    params: Any,
    batches: Callable[[jax.Array], tuple],
    steps: int,
    last: int,
) -> float:
    """The mean loss of the ``last`` of ``steps`` Adam steps (learning rate 1e-3), the step
    number choosing each batch (``batches(i)`` gives ``loss``'s arguments after ``params``):
    a mean, so that one noisy batch does not decide a comparison. A function of
    :func:`autocast.amp_fp8_delayed` starts from ``init`` on the first batch and carries its
    history from step to step."""
    optimizer = optax.adam(1e-3)

    @jax.jit
    def step(
        history: Any, params: Any, opt_state: Any, i: jax.Array
    ) -> tuple[Any, Any, Any, jax.Array]:
        value, history, grads = loss_and_grads(loss, history, params, *batches(i))
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return history, optax.apply_updates(params, updates), opt_state, value

    history = first_history(loss, params, *batches(jnp.asarray(0)))
    opt_state, losses = optimizer.init(params), []
    for i in range(steps):
        history, params, opt_state, value = step(history, params, opt_state, jnp.asarray(i))
        losses.append(value)
    return float(jnp.mean(jnp.stack(losses[-last:])))
