"""The short training run the benchmarks compare float32 and amp with."""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

import autocast

# What jax.jit's compiler_options asks for XLA's default LLVM optimisation level.
FULL_OPTIMISATION = {"xla_backend_optimization_level": 3}


def first_history(loss: Callable[..., Any], params: Any, *batch: Any) -> Any:
    """The float8 history a function of :func:`autocast.amp_fp8_delayed` starts from (its
    ``init`` on these arguments); None for any other loss."""
    return loss.init(params, *batch) if isinstance(loss, autocast.DelayedFp8) else None


def planned_history(loss: Callable[..., Any], params: Any, *batch: Any) -> Any:
    """A float8 history for a delayed-scaling loss on abstract arguments (shapes and dtypes,
    for compiling without running; ``init`` needs the values): every row measured, each
    amax 1. None for any other loss."""
    if not isinstance(loss, autocast.DelayedFp8):
        return None
    from autocast._src.fp8 import history as fh

    found: dict[str, Any] = {}

    def probe(*args: Any) -> int:  # traced on the abstract arguments, as a step would be
        ctx = loss._amp._context()
        traced, dyn = loss._amp._traced_call(args, {}, ctx)
        found["shapes"] = loss._shapes(traced, ctx, dyn)
        found["program"] = loss._program(traced)
        return 0

    jax.eval_shape(probe, params, *batch)
    shapes, program = found["shapes"], found["program"]
    measured = tuple((True, True, True) for _ in shapes)
    return fh.Fp8History(
        tuple(jnp.ones(s, jnp.float32) for s in shapes),
        tuple(jnp.zeros(fh.inbox_shape(s), jnp.float32) for s in shapes),
        measured,
        program,
        jnp.float32(1.0),
        tuple(jnp.ones(fh._rows_shape(f), jnp.float32) for f in measured),
        jnp.asarray(fh._program_words(program)),
    )


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

    # Hundreds of steps: LLVM's full optimisation (XLA's default) even where XLA_FLAGS asks
    # for fast compiles, as the test suite does (its 200-step CNN trainings took 67 s at -O0,
    # about 50 at full optimisation).
    @functools.partial(jax.jit, compiler_options=FULL_OPTIMISATION)
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
