"""The optax face of loss scaling (needs the ``optax`` extra: ``pip install jax-autocast[optax]``).

:func:`dynamic_loss_scaling` wraps any optax optimizer: its state carries the loss scale;
``update`` unscales the gradients, skips the step when they are not all finite (leaving
parameters and the inner optimizer state bit-identical), adjusts the scale and counts the
skipped steps. The skipping is ``optax.apply_if_finite``'s; the scale rule is the one of
:func:`autocast.next_loss_scale`. Nothing leaves the device.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from autocast._src.scaling.core import (
    FLOAT32_TINY,
    ScalingHealth,
    all_finite,
    all_zero,
    next_health,
)
from autocast._src.scaling.jaxamp import DynamicScalerState
from autocast._src.scaling.jmp import DynamicLossScale, LossScale
from autocast._src.state import order
from autocast._src.state.params import KahanState, StochasticRoundingState
from autocast._src.tree import is_array, is_inexact_dtype, map_floating

_ROUNDING_STEPS = {StochasticRoundingState: "stochastic_rounding", KahanState: "kahan_summation"}

# Marks the update function of every transformation dynamic_loss_scaling builds, so that
# wrapping one in another (which would unscale the gradients twice) is refused at once.
_MARK = "_autocast_dynamic_loss_scaling"
# apply_if_finite gives up skipping after this many consecutive bad steps; the loss scale
# shrinks at every one of them, so it must never give up.
_NEVER = int(jnp.iinfo(jnp.int32).max)


class LossScalingState(NamedTuple):
    """The optimizer state of :func:`dynamic_loss_scaling`.

    A ``NamedTuple`` and so a pytree; ``init`` builds it and ``update`` returns the next one.

    Attributes:
        loss_scale: The current loss scale, an :class:`autocast.LossScale` object
            (``DynamicLossScale`` unless another was given); :func:`loss_scale_of` returns it.
        inner: ``optax.apply_if_finite``'s state, which holds the inner optimizer's state and
            the count of skipped steps that :func:`skipped_steps` reads.
        health: The :class:`autocast.ScalingHealth` counters, int32 scalars, that
            :func:`autocast.stalled` reads.

    Example:
        >>> import autocast.optax, jax.numpy as jnp, optax
        >>> state = autocast.optax.dynamic_loss_scaling(optax.sgd(0.1)).init(jnp.ones(2))
        >>> isinstance(state, autocast.optax.LossScalingState)
        True
        >>> state.loss_scale.loss_scale, state.health.skipped_in_a_row
        (Array(32768., dtype=float32), Array(0, dtype=int32))
    """

    loss_scale: Any
    inner: optax.ApplyIfFiniteState
    health: ScalingHealth = ScalingHealth()


def dynamic_loss_scaling(
    inner: optax.GradientTransformation,
    loss_scale: Any = None,
    *,
    min_loss_scale: Any = None,
    axis_name: Any = None,
) -> optax.GradientTransformation:
    """Wraps ``inner`` so it takes gradients of the *scaled* loss and handles the scale.

    ``update`` unscales the gradients, skips the step when they are not all finite (the inner
    optimizer state is kept and the updates are negative zeros, which leave every parameter
    bit-identical), adjusts the scale and counts the skipped steps. The skipping is
    ``optax.apply_if_finite``'s, with no limit on consecutive skips; the scale rule is that of
    :func:`autocast.next_loss_scale`.
    Read the current scale with :func:`loss_scale_of` to scale the loss. The state counts
    consecutive skipped steps, steps at the floor and all-zero gradient steps
    (:class:`autocast.ScalingHealth`); :func:`autocast.stalled` and
    :func:`autocast.check_not_stalled` read them. Wrap an optimizer once: an optimizer already
    wrapped would unscale the gradients twice.

    Gradients of a loss that was never scaled cannot be told from scaled ones here (this
    wrapper never sees the loss): their unscaled values are smaller by the scale, and with a
    learning rate tuned for them training crawls. Scale the loss with ``loss_scale_of(state)``
    inside the differentiated function, or use ``autocast.dynamic_scale_value_and_grad``,
    which scales it for you.

    Args:
        inner: The optax optimizer to wrap.
        loss_scale: The initial loss-scale object: any :class:`autocast.LossScale`
            (``DynamicLossScale``, ``StaticLossScale``, ``NoOpLossScale`` or
            ``DynamicScalerState``). ``None`` (the default) means ``DynamicLossScale(2**15)``.
        min_loss_scale: The floor a dynamic scale never goes below. ``None`` (the default)
            keeps the scale object's own, 1 for both dynamic kinds.
        axis_name: The name of a mapped axis (``pmap``, ``shard_map``) over which every device
            takes the same skip decision and so keeps the same scale; ``None`` (the default)
            for none.

    Returns:
        An ``optax.GradientTransformationExtraArgs``. Its ``init(params)`` returns a
        :class:`LossScalingState`; its ``update(grads, state, params=None, value=None)`` takes
        the gradients of the scaled loss and returns ``(updates, new_state)``, the updates
        unscaled. Give it the loss as ``value`` and a non-finite loss skips the step even
        where the gradients are finite (this wrapper sees nothing else of the loss).
        Gradients of 16-bit parameters are unscaled into float32 (in their own dtype the
        smallest would flush to zero) and ``inner`` computes from those; their updates are
        float32, which ``optax.apply_updates`` casts back to the parameters' dtype, and
        ``inner``'s state keeps the dtypes it had.

    Raises:
        TypeError: If ``inner`` is not an ``optax.GradientTransformation`` or is itself a
            ``dynamic_loss_scaling`` transformation; if ``loss_scale`` is not an
            :class:`autocast.LossScale`; if ``min_loss_scale`` is given for a scale that is not
            dynamic, or is not a real number. From ``init``: if ``inner`` contains
            ``dynamic_loss_scaling`` (inside ``optax.chain``, say).
        ValueError: If ``min_loss_scale`` is not a scalar, is negative or not finite in
            float32, or is above the initial scale.

    Example:
        >>> import autocast.optax, jax, jax.numpy as jnp, optax
        >>> tx = autocast.optax.dynamic_loss_scaling(optax.sgd(0.1))
        >>> params = jnp.ones(2)
        >>> state = tx.init(params)
        >>> loss = lambda p: jnp.sum(p ** 2)
        >>> grads = jax.grad(lambda p: autocast.optax.loss_scale_of(state).scale(loss(p)))(params)
        >>> updates, state = tx.update(grads, state, params)
        >>> optax.apply_updates(params, updates), autocast.optax.skipped_steps(state)
        (Array([0.8, 0.8], dtype=float32), Array(0, dtype=int32))
    """
    if isinstance(inner, optax.MultiSteps):
        raise TypeError(
            "dynamic_loss_scaling wraps an optax.GradientTransformation; for gradient "
            "accumulation pass optax.MultiSteps(...).gradient_transformation(), so that each "
            "microbatch's gradients are unscaled and checked before they are accumulated"
        )
    if not isinstance(inner, optax.GradientTransformation):
        raise TypeError(
            "dynamic_loss_scaling wraps an optax.GradientTransformation, got "
            f"{type(inner).__name__}"
        )
    if getattr(inner.update, _MARK, False):
        raise TypeError(
            "dynamic_loss_scaling was given an optimizer that is already wrapped in "
            "dynamic_loss_scaling: the gradients would be unscaled twice; wrap it once"
        )
    if loss_scale is None:
        loss_scale = DynamicLossScale(2.0**15)
    if not isinstance(loss_scale, LossScale):
        raise TypeError(
            "loss_scale must be an autocast.LossScale (DynamicLossScale, StaticLossScale, "
            f"NoOpLossScale or DynamicScalerState), got {type(loss_scale).__name__}"
        )
    if min_loss_scale is not None:
        loss_scale = _with_floor(loss_scale, min_loss_scale)
    skipping = optax.apply_if_finite(_float32_updates(inner), max_consecutive_errors=_NEVER)

    def init(params: Any) -> LossScalingState:
        _refuse_inside_accumulation()
        inner_state = skipping.init(params)
        order.check_chain(inner_state, params, "dynamic_loss_scaling", _ROUNDING_STEPS)
        if _states_in(inner_state):
            raise TypeError(
                "dynamic_loss_scaling was given an optimizer that already contains "
                "dynamic_loss_scaling (e.g. inside optax.chain): the gradients would be "
                "unscaled twice; use it once, as the outermost wrapper"
            )
        # One array per counter (and a fresh copy of the scale): a donated jitted step needs
        # every leaf of the state in its own buffer.
        return LossScalingState(
            jax.tree_util.tree_map(jnp.array, loss_scale),
            inner_state,
            ScalingHealth(*(jnp.zeros((), jnp.int32) for _ in range(3))),
        )

    def update(
        grads: Any,
        state: LossScalingState,
        params: Any = None,
        *,
        value: Any = None,
        **extra_args: Any,
    ) -> tuple[Any, LossScalingState]:
        del extra_args  # other transformations' extra arguments, passed along by optax.chain
        # 16-bit gradients are unscaled into float32: in their own dtype the smallest would
        # flush to zero, which is what scaling the loss kept them from
        grads = state.loss_scale.unscale(_widened(grads))
        # the loss, where the caller gives it: a NaN loss skips the step even where the
        # gradients are finite (a NaN from a term the parameters do not reach); a Python
        # float counts as the array it stands for
        if value is not None:
            value = jax.tree_util.tree_map(
                lambda v: jnp.asarray(v) if isinstance(v, (float, complex)) else v, value
            )
        finite = all_finite(grads) if value is None else all_finite(grads) & all_finite(value)
        grads = jax.tree_util.tree_map(
            lambda g: jnp.where(finite, g, jnp.nan) if is_inexact_dtype(g.dtype) else g, grads
        )
        if axis_name is not None:
            # apply_if_finite decides per device; poisoning every device's gradients when any
            # one is bad makes them all decide alike.
            finite = lax.pmin(finite.astype(jnp.int32), axis_name).astype(jnp.bool_)
            grads = jax.tree_util.tree_map(
                lambda g: jnp.where(finite, g, jnp.nan) if is_inexact_dtype(g.dtype) else g,
                grads,
            )
        updates, inner_state = skipping.update(grads, state.inner, params)
        # apply_if_finite returns +0 updates on a skipped step; -0 keeps every parameter
        # bit-identical, -0.0 parameters included (-0.0 + 0.0 is +0.0).
        updates = jax.tree_util.tree_map(
            lambda u: jnp.where(finite, u, jnp.negative(jnp.zeros_like(u))), updates
        )
        loss_scale = state.loss_scale.adjust(finite)
        health = next_health(
            state.health, finite=finite, at_floor=_at_floor(loss_scale), zero=all_zero(grads)
        )
        return updates, LossScalingState(loss_scale, inner_state, health)

    setattr(update, _MARK, True)
    return optax.GradientTransformationExtraArgs(init, update)


def _widened(tree: Any) -> Any:
    """``tree`` with its 16-bit (or narrower) floating arrays in float32."""
    return map_floating(
        lambda x: x.astype(jnp.float32) if jnp.dtype(x.dtype).itemsize < 4 else x, tree
    )


def _float32_updates(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """``inner`` as ``apply_if_finite`` needs it when 16-bit gradients arrive in float32: its
    updates float32 where they are narrower (``apply_if_finite`` skips a step with zeros of
    the gradients' dtypes, and its two branches must agree), its state in the dtypes it had
    (an optimizer whose moments follow 16-bit parameters computes them from float32
    gradients in float32 and stores them as before)."""
    inner = optax.with_extra_args_support(inner)

    def update(grads: Any, state: Any, params: Any = None, **extra_args: Any) -> Any:
        updates, new_state = inner.update(grads, state, params, **extra_args)
        updates = _widened(updates)
        try:
            new_state = jax.tree_util.tree_map(
                lambda new, old: (
                    new.astype(old.dtype)
                    if is_array(new) and is_array(old) and new.dtype != old.dtype
                    else new
                ),
                new_state,
                state,
            )
        except ValueError:  # a state whose structure changes: apply_if_finite says so
            pass
        return updates, new_state

    return optax.GradientTransformationExtraArgs(inner.init, update)


_ACCUMULATED = (
    "dynamic_loss_scaling inside optax.MultiSteps: the microbatches' gradients would be "
    "accumulated while still scaled, and one overflow would stay in the accumulator for good "
    "(MultiSteps clears it by multiplying by zero, and inf * 0 is NaN), so every later step "
    "would be skipped. Put the accumulation inside the scaling instead: "
    "dynamic_loss_scaling(optax.MultiSteps(inner, k).gradient_transformation())"
)


def _refuse_inside_accumulation() -> None:
    """Raises where ``init`` is called by ``optax.MultiSteps.init`` (directly, or through a
    chain MultiSteps wraps): the order of the two cannot train (see :data:`_ACCUMULATED`)."""
    frame = inspect.currentframe()
    try:
        for _ in range(32):
            frame = frame.f_back if frame is not None else None
            if frame is None:
                return
            if isinstance(frame.f_locals.get("self"), optax.MultiSteps):
                raise TypeError(_ACCUMULATED)
    finally:
        del frame


def _with_floor(loss_scale: Any, floor: Any) -> Any:
    if isinstance(loss_scale, DynamicLossScale):
        return dataclasses.replace(loss_scale, min_loss_scale=floor)
    if isinstance(loss_scale, DynamicScalerState):
        return loss_scale._replace(min_scaler=floor)
    raise TypeError(
        f"min_loss_scale applies to a dynamic loss scale, not to a {type(loss_scale).__name__}"
    )


def _at_floor(loss_scale: Any) -> jax.Array:
    """Whether a dynamic scale sits at its floor (a fixed one never moves: never at it)."""
    floor = getattr(loss_scale, "min_loss_scale", None)
    if floor is None:
        return jnp.bool_(False)
    return loss_scale.loss_scale <= jnp.maximum(jnp.asarray(floor, jnp.float32), FLOAT32_TINY)


def _states_in(state: Any) -> list[LossScalingState]:
    return [
        s
        for s in jax.tree_util.tree_leaves(state, is_leaf=lambda x: isinstance(x, LossScalingState))
        if isinstance(s, LossScalingState)
    ]


def _accumulating(state: Any) -> bool:
    """Whether a LossScalingState sits inside an ``optax.MultiSteps`` state."""
    steps = [
        s
        for s in jax.tree_util.tree_leaves(
            state, is_leaf=lambda x: isinstance(x, optax.MultiStepsState)
        )
        if isinstance(s, optax.MultiStepsState)
    ]
    return any(_states_in(s.inner_opt_state) for s in steps)


def _find(state: Any) -> LossScalingState:
    if _accumulating(state):
        raise TypeError(_ACCUMULATED)
    found = _states_in(state)
    if len(found) != 1:
        raise ValueError(
            "expected an optimizer state containing exactly one dynamic_loss_scaling state, "
            f"found {len(found)}"
        )
    return found[0]


def loss_scale_of(state: Any) -> Any:
    """The current loss scale in an optimizer state built by :func:`dynamic_loss_scaling`.

    Found also when the state is nested (in a dict, a tuple or another transformation's
    state). Call its ``scale(loss)`` inside the function you differentiate. Put clipping
    inside :func:`dynamic_loss_scaling`, as below: a transformation chained before it would
    see the scaled gradients.

    Args:
        state: An optimizer state that holds exactly one :class:`LossScalingState`.

    Returns:
        The :class:`autocast.LossScale` object of that state.

    Raises:
        ValueError: If ``state`` holds no :class:`LossScalingState`, or more than one.

    Example:
        >>> import autocast.optax, jax.numpy as jnp, optax
        >>> tx = autocast.optax.dynamic_loss_scaling(optax.chain(optax.clip(1.0), optax.sgd(0.1)))
        >>> autocast.optax.loss_scale_of({"optimizer": tx.init(jnp.ones(2))}).loss_scale
        Array(32768., dtype=float32)
    """
    return _find(state).loss_scale


def skipped_steps(state: Any) -> jax.Array:
    """How many steps :func:`dynamic_loss_scaling` has skipped for non-finite gradients.

    The total since ``init``, as ``optax.apply_if_finite`` counts it; the state may be nested
    as for :func:`loss_scale_of`.

    Args:
        state: An optimizer state that holds exactly one :class:`LossScalingState`.

    Returns:
        An int32 scalar array.

    Raises:
        ValueError: If ``state`` holds no :class:`LossScalingState`, or more than one.

    Example:
        >>> import autocast.optax, jax.numpy as jnp, optax
        >>> tx = autocast.optax.dynamic_loss_scaling(optax.sgd(0.1))
        >>> state = tx.init(jnp.ones(2))
        >>> _, state = tx.update(jnp.array([jnp.nan, 1.0]), state, jnp.ones(2))
        >>> autocast.optax.skipped_steps(state), autocast.optax.loss_scale_of(state).loss_scale
        (Array(1, dtype=int32), Array(16384., dtype=float32))
    """
    return _find(state).inner.total_notfinite
