"""Loss scaling around a differentiated function: ``jaxamp``'s ``DynamicScalerState`` face.

``dynamic_scale_value_and_grad(fun)`` multiplies ``fun``'s value by the current scale before
differentiating, divides the gradients by it afterwards, checks them for inf and NaN, and
moves the scale with the one rule of :func:`autocast.next_loss_scale`. ``dynamic_scale_tx``
does the same around any gradient transformation (``jax.grad``, ``eqx.filter_grad``...). It
never looks inside ``fun`` and never leaves the device: the decision to skip, retry and adjust
is data.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from autocast._src.scaling.core import (
    FLOAT32_TINY,
    ScalingHealth,
    all_finite,
    all_zero,
    check_finite_flag,
    checked_count,
    checked_scale,
    concrete_value,
    next_health,
    next_loss_scale,
    register_fields,
    select_tree,
    widened_product,
)
from autocast._src.scaling.jmp import DynamicLossScale, LossScale
from autocast._src.tree import is_array, is_inexact_array, is_inexact_dtype

# The keyword that carries the state into the function handed to a gradient transformation;
# jaxamp's name, so a transformation written for jaxamp sees what it expects.
_STATE_KEYWORD = "_dynamic_scaler_state"


class _ScalerStateFields(NamedTuple):
    patience: Any = 2000
    adjust_factor: Any = 2.0
    scaler: Any = 2.0**15
    count: Any = 0
    total_resets: Any = 0
    # not jaxamp's: a floor (jmp's min_loss_scale) and the health counters (ScalingHealth)
    min_scaler: Any = 1.0
    skipped_in_a_row: Any = 0
    steps_at_floor: Any = 0
    zero_grad_steps: Any = 0


def _state_from_leaves(cls: type, values: tuple) -> Any:
    """Rebuilds a state without the constructor's checks (pickle may hold any leaves)."""
    return tuple.__new__(cls, values)


@register_fields
class DynamicScalerState(_ScalerStateFields, LossScale):
    """The state of dynamic loss scaling, as ``jaxamp`` names it: a NamedTuple and a pytree.

    After a step whose gradients are finite, ``count`` goes up by one, unless it had already
    reached ``patience``: then ``scaler`` is multiplied by ``adjust_factor`` and ``count``
    restarts. After a step with inf or NaN gradients ``scaler`` is divided by
    ``adjust_factor``, never below ``min_scaler`` (1 by default, as jmp's
    ``min_loss_scale``), ``count`` restarts and ``total_resets`` goes up by one. The scaler is
    float32 and never becomes 0 or inf. As in ``jaxamp`` it is a ``NamedTuple`` (``_replace``,
    ``_asdict``); the constructor and ``_replace`` check and convert every field (int32
    counts, float32 factor, scaler and floor). Beyond jaxamp's fields it carries the floor and
    the :class:`autocast.ScalingHealth` counters, updated once per step by
    :func:`dynamic_scale_value_and_grad`, :func:`dynamic_scale_grad` and
    :func:`dynamic_scale_tx` (not by :meth:`adjust`) and read by :func:`autocast.stalled`.
    It is an :class:`autocast.LossScale`: ``loss_scale`` and ``min_loss_scale`` are
    ``scaler`` and ``min_scaler`` under the other classes' names, and ``scale`` and
    ``unscale`` work as there.

    Attributes:
        patience: The ``count`` at which the next finite step grows the scale, an int32
            scalar, at least 1 (default 2000).
        adjust_factor: What the scale is multiplied by to grow and divided by to shrink, a
            float32 scalar greater than 1 (default 2).
        scaler: The current scale, a positive float32 scalar (default 2**15).
        count: Consecutive finite steps since the scale last changed, an int32 scalar
            (default 0).
        total_resets: How many attempts, retries included, had gradients that were not
            finite, an int32 scalar (default 0).
        min_scaler: The floor of the scale, a non-negative float32 scalar at most ``scaler``
            (default 1); below the smallest normal float32, that number is the floor.
        skipped_in_a_row: Consecutive skipped steps (see :class:`autocast.ScalingHealth`),
            an int32 scalar (default 0).
        steps_at_floor: Consecutive steps that ended at the floor, an int32 scalar (default 0).
        zero_grad_steps: Steps whose finite gradients were all zero, an int32 scalar
            (default 0).

    Raises:
        TypeError: If a field is not a real number, or a count is not an integer (a float with
            a whole value is accepted; a traced float is not).
        ValueError: If a field is not a scalar; if ``scaler``, ``adjust_factor`` or
            ``min_scaler`` is not finite in float32 or not positive (``min_scaler`` may be 0);
            if a count is fractional, below its minimum or beyond int32; if ``adjust_factor``
            is not greater than 1; if ``scaler`` is below ``min_scaler``.

    Example:
        >>> import autocast, jax.numpy as jnp
        >>> state = autocast.DynamicScalerState(patience=1, scaler=8.0)
        >>> state = state.adjust(jnp.bool_(True)).adjust(jnp.bool_(True))
        >>> state.scaler, state.count
        (Array(16., dtype=float32), Array(0, dtype=int32))
        >>> state.adjust(jnp.bool_(False)).total_resets
        Array(1, dtype=int32)
        >>> float(state._replace(scaler=4.0).scaler)
        4.0
    """

    __slots__ = ()

    def __new__(
        cls,
        patience: Any = 2000,
        adjust_factor: Any = 2.0,
        scaler: Any = 2.0**15,
        count: Any = 0,
        total_resets: Any = 0,
        min_scaler: Any = 1.0,
        skipped_in_a_row: Any = 0,
        steps_at_floor: Any = 0,
        zero_grad_steps: Any = 0,
    ) -> DynamicScalerState:
        adjust_factor = checked_scale(adjust_factor, "adjust_factor")
        factor = concrete_value(adjust_factor)
        if factor is not None and factor <= 1:
            raise ValueError(f"adjust_factor must be greater than 1, got {factor}")
        scaler = checked_scale(scaler, "scaler")
        min_scaler = checked_scale(min_scaler, "min_scaler", allow_zero=True)
        lo, hi = concrete_value(min_scaler), concrete_value(scaler)
        if lo is not None and hi is not None and hi < lo:
            raise ValueError(f"scaler ({hi}) is below min_scaler ({lo}); pass a smaller min_scaler")
        values = (
            checked_count(patience, "patience", minimum=1),
            adjust_factor,
            scaler,
            checked_count(count, "count", minimum=0),
            checked_count(total_resets, "total_resets", minimum=0),
            min_scaler,
            checked_count(skipped_in_a_row, "skipped_in_a_row", minimum=0),
            checked_count(steps_at_floor, "steps_at_floor", minimum=0),
            checked_count(zero_grad_steps, "zero_grad_steps", minimum=0),
        )
        return tuple.__new__(cls, values)

    def _replace(self, **changes: Any) -> DynamicScalerState:
        """A copy with some fields changed, checked and converted like the constructor's.

        Args:
            **changes: New values by field name.

        Returns:
            A new :class:`DynamicScalerState`; ``self`` is unchanged.

        Raises:
            ValueError: If a name in ``changes`` is not a field; or as the constructor raises.
            TypeError: As the constructor raises.
        """
        unknown = sorted(set(changes) - set(self._fields))
        if unknown:
            raise ValueError(
                f"DynamicScalerState has no field(s) {unknown}; fields: {', '.join(self._fields)}"
            )
        return type(self)(**{**self._asdict(), **changes})

    def __reduce__(self) -> tuple[Any, ...]:
        return _state_from_leaves, (type(self), tuple(self))

    @property
    def loss_scale(self) -> jax.Array:  # type: ignore[override]
        """The current scale (``scaler``), under the name the other loss scales use."""
        return self.scaler  # type: ignore[no-any-return]

    def adjust(self, grads_finite: jax.Array) -> DynamicScalerState:
        """The next state, given whether this step's gradients were all finite.

        Moves ``scaler``, ``count`` and ``total_resets`` by the rule described above; the floor and
        the health counters are carried over unchanged. Runs on device and may be traced.

        Args:
            grads_finite: A boolean scalar, traced or not: whether this step's gradients were all
                finite, as :func:`autocast.all_finite` returns it.

        Returns:
            A new :class:`DynamicScalerState`; ``self`` is unchanged.

        Raises:
            TypeError: If ``grads_finite`` is not a boolean scalar.
        """
        finite = check_finite_flag(grads_finite)
        # Fields rebuilt by _make or a pytree map may arrive as plain numbers.
        scaler = jnp.asarray(self.scaler, jnp.float32)
        count = jnp.asarray(self.count, jnp.int32)
        resets = jnp.asarray(self.total_resets, jnp.int32)
        # jaxamp grows once `count` has reached `patience` before this step: in the shared
        # rule's terms, after `patience + 1` consecutive finite steps.
        update = next_loss_scale(
            finite, scaler, count, self.patience + 1, self.adjust_factor, self.min_scaler
        )
        return self._replace_leaves(
            scaler=update.loss_scale,
            count=update.counter,
            total_resets=resets + (~finite).astype(jnp.int32),
        )

    def _replace_leaves(self, **changes: Any) -> DynamicScalerState:
        # No checks: inside a traced step the fields are tracers the checks cannot read.
        return self._make(tuple(changes.get(f, v) for f, v in zip(self._fields, self)))

    @property
    def min_loss_scale(self) -> jax.Array:
        """The floor (``min_scaler``), under the name the other loss scales use."""
        return self.min_scaler  # type: ignore[no-any-return]


def _filtered_value_and_grad(
    fun: Callable[..., Any], argnums: int | tuple[int, ...], has_aux: bool, **grad_kwargs: Any
) -> Callable[..., Any]:
    """``jax.value_and_grad`` over the floating-point array leaves of the ``argnums``
    arguments only; other leaves (ints, strings, functions, Equinox static fields) are held
    fixed and have ``None`` gradients, as ``equinox.filter_value_and_grad`` gives."""
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)

    def run(*args: Any, **kwargs: Any) -> Any:
        diffs = [
            jax.tree_util.tree_map(lambda x: x if is_inexact_array(x) else None, args[i])
            for i in nums
        ]

        def inner(*new_diffs: Any) -> Any:
            full = list(args)
            for i, d in zip(nums, new_diffs):
                full[i] = jax.tree_util.tree_map(
                    lambda d, x: x if d is None else d, d, args[i], is_leaf=lambda x: x is None
                )
            return fun(*full, **kwargs)

        which = 0 if isinstance(argnums, int) else tuple(range(len(nums)))
        return jax.value_and_grad(inner, argnums=which, has_aux=has_aux, **grad_kwargs)(*diffs)

    return run


def _check_options(fun: Any, redo_on_nan: Any, name: str = "fun") -> None:
    if not callable(fun):
        raise TypeError(f"expected a function to differentiate as {name}, got {type(fun).__name__}")
    if isinstance(redo_on_nan, bool) or not isinstance(redo_on_nan, (int, np.integer)):
        raise TypeError(f"redo_on_nan must be a non-negative int, got {redo_on_nan!r}")
    if redo_on_nan < 0:
        raise ValueError(f"redo_on_nan must be a non-negative int, got {redo_on_nan}")


def _with_keyword(
    wrapped: Callable[..., Any], fun: Callable[..., Any], keyword: str
) -> Callable[..., Any]:
    """Names and documents ``wrapped`` after ``fun``, with a signature that also shows the
    extra ``keyword`` (tools such as ``eqx.filter_jit`` bind arguments by signature)."""
    functools.update_wrapper(wrapped, fun)
    del wrapped.__wrapped__
    try:
        sig = inspect.signature(fun)
    except (TypeError, ValueError):  # a builtin or C function: leave the signature alone
        return wrapped
    params = list(sig.parameters.values())
    state = inspect.Parameter(keyword, inspect.Parameter.KEYWORD_ONLY)
    at = next((i for i, p in enumerate(params) if p.kind == p.VAR_KEYWORD), len(params))
    params.insert(at, state)
    try:
        wrapped.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    except ValueError:  # parameter order fun's signature does not allow: keep fun's as is
        pass
    return wrapped


def _check_state(state: Any, name: str) -> None:
    if state is None:
        raise TypeError(
            f"{name} needs the keyword argument dynamic_scaler_state, "
            "e.g. dynamic_scaler_state=autocast.DynamicScalerState()"
        )
    if not all(hasattr(state, name) for name in ("loss_scale", "adjust", "unscale")):
        raise TypeError(
            "dynamic_scaler_state must be an autocast.DynamicScalerState (or another "
            f"autocast.LossScale), got {type(state).__name__}"
        )


def _split_static(tree: Any) -> tuple[list, Any, list]:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    dynamic = [x if is_array(x) else None for x in leaves]
    static = [None if d is not None else x for d, x in zip(dynamic, leaves)]
    return dynamic, treedef, static


def _kept(state: Any) -> Any:
    """``state`` after a step skipped without touching the scale (a non-finite loss, which a
    smaller scale cannot cure): its count of finite steps restarts, as after any skip."""
    if isinstance(state, DynamicScalerState):
        return state._replace_leaves(
            count=jnp.zeros_like(state.count), total_resets=state.total_resets + 1
        )
    if isinstance(state, DynamicLossScale):
        return dataclasses.replace(state, counter=jnp.zeros_like(state.counter))
    return state


def _after_attempt(state: Any, finite: jax.Array, retryable: jax.Array) -> Any:
    """The state after one attempt: moved by the scaling rule, except that a non-finite
    loss skips the step without shrinking the scale."""
    return select_tree(finite | retryable, state.adjust(finite), _kept(state))


def _with_health(state: Any, finite: jax.Array, zero: jax.Array) -> Any:
    """The health counters moved on by one step, for a state that carries them."""
    if not isinstance(state, DynamicScalerState):
        return state
    floor = jnp.maximum(jnp.asarray(state.min_scaler, jnp.float32), FLOAT32_TINY)
    health = next_health(
        ScalingHealth(state.skipped_in_a_row, state.steps_at_floor, state.zero_grad_steps),
        finite=finite,
        at_floor=state.scaler <= floor,
        zero=zero,
    )
    return state._replace_leaves(**health._asdict())


def _with_retries(
    attempt: Callable[[Any], tuple[Any, jax.Array, jax.Array, jax.Array]],
    state: Any,
    redo_on_nan: int,
) -> tuple[Any, Any]:
    """Runs ``attempt(state) -> (results, finite, retryable, zero)``, adjusts the state and,
    while the results are not finite, retries with the adjusted scale, up to ``redo_on_nan``
    times, inside the compiled program. A retry happens only where it can help: the loss
    was finite (``retryable``: the gradients overflowed, not the forward pass or the data)
    and the scale did shrink (it was not at its floor)."""
    results, finite, retryable, zero = attempt(state)
    new = _after_attempt(state, finite, retryable)
    if redo_on_nan:
        shrunk = new.loss_scale < state.loss_scale
        # The loop carries arrays only: non-array leaves of the results are the same every try.
        dynamic, treedef, static = _split_static(results)

        def again(carry: tuple) -> Any:
            _, tries, finite, retryable, shrunk, _, _ = carry
            return (~finite) & retryable & shrunk & (tries < redo_on_nan)

        def retry(carry: tuple) -> tuple:
            state, tries, *_ = carry
            now, finite, retryable, zero = attempt(state)
            new = _after_attempt(state, finite, retryable)
            shrunk = new.loss_scale < state.loss_scale
            return new, tries + 1, finite, retryable, shrunk, zero, _split_static(now)[0]

        new, _, finite, _, _, zero, dynamic = lax.while_loop(
            again, retry, (new, jnp.int32(0), finite, retryable, shrunk, zero, dynamic)
        )
        results = jax.tree_util.tree_unflatten(
            treedef, [s if d is None else d for d, s in zip(dynamic, static)]
        )
    return _with_health(new, finite, zero), results


def _scaled_transform(
    transform: Callable[..., Any],
    fun: Callable[..., Any],
    *,
    scale_fn: Callable[[Any, Any], Any],
    unscale_fn: Callable[[Any, Any], Any],
    finite_fn: Callable[[Any], Any],
    redo_on_nan: int,
    axis_name: Any,
    name: str,
    loss_finite_fn: Callable[[Any], Any] | None = None,
    grads_fn: Callable[[Any], Any] = lambda results: results,
) -> Callable[..., Any]:
    """The one scaling core behind every face of this module.

    ``transform`` receives a version of ``fun`` whose output is scaled by ``scale_fn`` and which
    takes the state as the extra keyword ``_dynamic_scaler_state`` (passed as an argument,
    not closed over, so a transformation that compiles is not retraced for every state).
    A step is retried only when a smaller scale can cure it: the arguments were finite (an
    inf in the batch is not cured by any scale) and, where the face can see it
    (``loss_finite_fn(results)``), so was the loss. ``grads_fn(results)`` picks the
    gradients, whose being all zero the health counters record.
    """

    def scaled_fun(*args: Any, **kwargs: Any) -> Any:
        state = kwargs.pop(_STATE_KEYWORD)
        args, kwargs = _at_loss_scale((args, kwargs), state.loss_scale)
        return scale_fn(fun(*args, **kwargs), state)

    transformed = transform(_with_keyword(scaled_fun, fun, _STATE_KEYWORD))

    def wrapped(*args: Any, dynamic_scaler_state: Any = None, **kwargs: Any) -> Any:
        _check_state(dynamic_scaler_state, name)

        # An inf or NaN in the data (or the parameters) is not cured by any scale either.
        inputs_finite = all_finite((args, kwargs))

        def attempt(state: Any) -> tuple[Any, jax.Array, jax.Array, jax.Array]:
            results = unscale_fn(transformed(*args, **{_STATE_KEYWORD: state}, **kwargs), state)
            results = _measured_under(results, state.loss_scale)
            finite = check_finite_flag(finite_fn(results))
            retryable = (
                inputs_finite if loss_finite_fn is None else inputs_finite & loss_finite_fn(results)
            )
            zero = all_zero(grads_fn(results))
            if axis_name is not None:  # every device takes the same decisions
                finite, retryable, zero = (
                    lax.pmin(f.astype(jnp.int32), axis_name).astype(jnp.bool_)
                    for f in (finite, retryable, zero)
                )
            return results, finite, retryable, zero

        return _with_retries(attempt, dynamic_scaler_state, redo_on_nan)

    return _with_keyword(wrapped, fun, "dynamic_scaler_state")


def _at_loss_scale(tree: Any, scale: Any) -> Any:
    """``tree`` with every leaf that keeps state measured under a loss scale (a float8
    history: ``at_loss_scale``) moved to ``scale``, the scale this attempt multiplies the
    loss by."""
    keeps = lambda x: callable(getattr(x, "at_loss_scale", None))  # noqa: E731
    return jax.tree_util.tree_map(
        lambda x: x.at_loss_scale(scale) if keeps(x) else x, tree, is_leaf=keeps
    )


def _measured_under(tree: Any, scale: Any) -> Any:
    """``tree`` (the step's results) with the gradient of every such state marked as taken
    under ``scale`` (``measured_under``), so that the state's own update undoes it."""
    marks = lambda x: callable(getattr(x, "measured_under", None))  # noqa: E731
    return jax.tree_util.tree_map(
        lambda x: x.measured_under(scale) if marks(x) else x, tree, is_leaf=marks
    )


def _scale_loss(value: Any, state: Any) -> Any:
    """The loss times the scale, widened to at least float32 so that it cannot overflow.

    Anything but a floating (or complex) scalar goes back unchanged, so that the gradient
    transformation raises its own error: ``jax.grad`` refuses integer and boolean outputs
    with a ``TypeError``, and treats a Python float as it always does.
    """
    if is_array(value) or isinstance(value, (bool, int, float, complex)):
        value = jnp.asarray(value)
        if is_inexact_dtype(value.dtype):
            return widened_product(value, state.loss_scale)
    return value


def _describe(value: Any) -> str:
    if is_array(value):  # a tracer's type name would only confuse
        return f"an array of dtype {value.dtype} and shape {tuple(value.shape)}"
    return type(value).__name__


def _default_scale_fn(result: Any, state: Any) -> Any:
    if is_array(result) or isinstance(result, (bool, int, float, complex)):
        return _scale_loss(result, state)
    if isinstance(result, (tuple, list)) and len(result) == 2:
        value, aux = result
        return _scale_loss(value, state), aux
    raise TypeError(
        "dynamic_scale_tx's default scale_fn expects the function to return a scalar loss or "
        f"a (loss, aux) pair, got {_describe(result)}; pass scale_fn= for other outputs"
    )


def _default_unscale_fn(results: Any, state: Any) -> Any:
    return state.unscale(results)


def dynamic_scale_tx(
    transform: Callable[..., Any],
    redo_on_nan: int = 0,
    unscale_fn: Callable[[Any, Any], Any] | None = None,
    scale_fn: Callable[[Any, Any], Any] | None = None,
    *,
    axis_name: Any = None,
) -> Callable[..., Callable[..., Any]]:
    """Adds dynamic loss scaling to any gradient transformation, ``jaxamp``'s signature.

    ``dynamic_scale_tx(transform)(fun, *args, **kwargs)`` is ``transform(fun, *args,
    **kwargs)`` (``jax.grad``, ``jax.value_and_grad``, ``eqx.filter_grad``...) with loss
    scaling: the returned function takes the extra keyword ``dynamic_scaler_state`` and returns
    ``(new_state, results)``. The state moves on whether all the unscaled results are finite;
    ``redo_on_nan=k`` retries up to ``k`` times with smaller scales inside the compiled
    program, except where the arguments hold an inf or NaN (that step keeps its scale) or
    the scale is at its floor; ``axis_name`` makes every device take the same decision. The
    function ``transform`` receives takes the state as an extra keyword argument rather than
    closing over it, so a transformation that compiles is not retraced for every state.

    Args:
        transform: A gradient transformation, called as ``transform(fun, *args, **kwargs)``.
        redo_on_nan: How many times a step whose results are not finite is retried with a
            smaller scale, a non-negative int (default 0).
        unscale_fn: ``unscale_fn(results, state)`` undoes the scaling on what the
            transformation returns. ``None`` (the default): every floating-point leaf divided
            by the scale, dtypes kept; with ``has_aux`` that includes the aux, so pass your own,
            or use :func:`dynamic_scale_grad`.
        scale_fn: ``scale_fn(output, state)`` scales ``fun``'s output before the transformation
            sees it. ``None`` (the default): a scalar loss, or the first element of a
            ``(loss, aux)`` pair, multiplied by the scale in at least float32.
        axis_name: The name of a mapped axis over which every device takes the same decision;
            ``None`` (the default) for none.

    Returns:
        A function ``(fun, *args, **kwargs)`` that returns the transformed ``fun``: a function
        ``(*fun_args, dynamic_scaler_state, **fun_kwargs)`` returning ``(new_state, results)``,
        where ``results`` is what ``transform``'s function returns, unscaled.

    Raises:
        TypeError: If ``transform``, ``unscale_fn`` or ``scale_fn`` is not callable, or
            ``redo_on_nan`` is not an int; if the returned function is given a ``fun`` that is
            not callable. When the transformed function is called: if ``dynamic_scaler_state``
            is missing or is not a loss scale, or if, with the default ``scale_fn``, ``fun``
            returns neither an array, a Python number nor a pair.
        ValueError: If ``redo_on_nan`` is negative.

    Example:
        >>> import autocast, jax, jax.numpy as jnp
        >>> grad_fn = autocast.dynamic_scale_tx(jax.grad, redo_on_nan=5)(lambda x: x**3)
        >>> state, g = grad_fn(jnp.float16(2.0), dynamic_scaler_state=autocast.DynamicScalerState())
        >>> g, state.scaler  # 12 * 2**15 overflows float16: retried at 2**12
        (Array(12., dtype=float16), Array(4096., dtype=float32))
    """
    if not callable(transform):
        raise TypeError(
            "dynamic_scale_tx wraps a gradient transformation such as jax.grad, got "
            f"{type(transform).__name__}"
        )
    _check_options(transform, redo_on_nan, "transform")
    for name, given in (("unscale_fn", unscale_fn), ("scale_fn", scale_fn)):
        if given is not None and not callable(given):
            raise TypeError(f"{name} must be a function (results, state) -> results, got {given!r}")
    do_scale = _default_scale_fn if scale_fn is None else scale_fn
    do_unscale = _default_unscale_fn if unscale_fn is None else unscale_fn

    def scaled_transform(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
        _check_options(fun, redo_on_nan)
        return _scaled_transform(
            lambda f: transform(f, *args, **kwargs),
            fun,
            scale_fn=do_scale,
            unscale_fn=do_unscale,
            finite_fn=all_finite,
            redo_on_nan=redo_on_nan,
            axis_name=axis_name,
            name="the function returned by dynamic_scale_tx",
        )

    return scaled_transform


def dynamic_scale_value_and_grad(
    fun: Callable[..., Any],
    *,
    has_aux: bool = False,
    redo_on_nan: int = 10,
    filter: bool = True,  # noqa: A002 - jaxamp's name
    axis_name: Any = None,
    **grad_kwargs: Any,
) -> Callable[..., Any]:
    """``jax.value_and_grad`` with dynamic loss scaling, ``jaxamp``'s signature and defaults.

    The returned function takes ``fun``'s arguments plus the keyword ``dynamic_scaler_state``.
    It multiplies the loss by the current scale (in at least float32) before differentiating,
    divides the gradients by it afterwards and checks them for inf and NaN; value and gradients
    come back unscaled and in the primal dtypes. When the gradients have inf or NaN the scale
    shrinks and the step is retried, up to ``redo_on_nan`` times, inside the compiled program;
    if they are still not finite they come back as they are: skip the update
    (``autocast.select_tree``, ``optax.apply_if_finite``). A step is retried only where a
    smaller scale can help: not when the loss or the arguments hold an inf or NaN (such a step
    is skipped with its scale kept) and not once the scale sits at its floor. Nothing is read
    by the host. A loss that is not a floating-point scalar raises ``jax.value_and_grad``'s own
    ``TypeError``.

    Args:
        fun: The function to differentiate. It returns a floating-point scalar loss, or a
            ``(loss, aux)`` pair with ``has_aux``.
        has_aux: Whether ``fun`` returns a ``(loss, aux)`` pair (default False).
        redo_on_nan: How many times a step whose gradients are not finite is retried with a
            smaller scale, a non-negative int (default 10, as in ``jaxamp``).
        filter: If True (the default), differentiate only the floating-point array leaves of
            the differentiated arguments and give ``None`` gradients for the rest, so Equinox
            modules and pytrees with strings or ints work. If False, plain
            ``jax.value_and_grad``.
        axis_name: The name of a mapped axis (``pmap``, ``shard_map``) over which every device
            takes the same decision to grow, shrink, retry or skip; ``None`` (the default) for
            none.
        **grad_kwargs: Passed on to ``jax.value_and_grad`` (``argnums``...).

    Returns:
        A function ``(*args, dynamic_scaler_state, **kwargs)`` returning
        ``(new_state, (value, grads))``, or ``(new_state, ((value, aux), grads))`` with
        ``has_aux``. ``new_state`` has the type of ``dynamic_scaler_state`` (a
        :class:`DynamicScalerState` or another :class:`autocast.LossScale`; only the former
        carries health counters). ``grads`` has the structure ``jax.value_and_grad`` gives for
        ``argnums``.

    Raises:
        TypeError: If ``fun`` is not callable or ``redo_on_nan`` is not an int. When the
            returned function is called: if ``dynamic_scaler_state`` is missing or is not a loss
            scale, or if with ``has_aux`` ``fun`` does not return a pair.
        ValueError: If ``redo_on_nan`` is negative.

    Example:
        A float16 loss whose gradient overflows at the initial scale, retried once at half of it:

        >>> import autocast, jax.numpy as jnp
        >>> loss = lambda w: jnp.sum(w.astype(jnp.float16) ** 2).astype(jnp.float32)
        >>> grad_fn = autocast.dynamic_scale_value_and_grad(loss)
        >>> start = autocast.DynamicScalerState()
        >>> state, (value, grads) = grad_fn(jnp.ones(2), dynamic_scaler_state=start)
        >>> value, grads
        (Array(2., dtype=float32), Array([2., 2.], dtype=float32))
        >>> state.scaler, state.total_resets
        (Array(16384., dtype=float32), Array(1, dtype=int32))
    """
    _check_options(fun, redo_on_nan)
    argnums = grad_kwargs.pop("argnums", 0)

    def scale(out: Any, state: Any) -> Any:
        if has_aux and not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise TypeError(
                "with has_aux=True the function must return a (loss, aux) pair, got "
                f"{_describe(out)}"
            )
        value, aux = out if has_aux else (out, None)
        return _scale_loss(value, state), (value, aux)

    def unscale(results: Any, state: Any) -> Any:
        (_, value_and_aux), grads = results
        # A non-finite loss is a skipped step even where its gradients are finite (a NaN
        # from a term the parameters do not reach): the gradients turn NaN, so the state
        # counts the skip and a train step that checks them (all_finite) skips it too.
        loss_finite = all_finite(value_and_aux[0])
        grads = jax.tree_util.tree_map(
            lambda g: jnp.where(loss_finite, g, jnp.nan) if is_inexact_array(g) else g,
            state.unscale(grads),
        )
        return value_and_aux, grads

    def transform(f: Callable[..., Any]) -> Callable[..., Any]:
        if filter:
            return _filtered_value_and_grad(f, argnums, True, **grad_kwargs)
        return jax.value_and_grad(f, argnums=argnums, has_aux=True, **grad_kwargs)

    core = _scaled_transform(
        transform,
        fun,
        scale_fn=scale,
        unscale_fn=unscale,
        finite_fn=lambda results: all_finite(results[1]),
        redo_on_nan=redo_on_nan,
        axis_name=axis_name,
        name="dynamic_scale_value_and_grad",
        loss_finite_fn=lambda results: all_finite(results[0][0]),
        grads_fn=lambda results: results[1],
    )

    def wrapped(*args: Any, dynamic_scaler_state: Any = None, **kwargs: Any) -> Any:
        state, ((value, aux), grads) = core(
            *args, dynamic_scaler_state=dynamic_scaler_state, **kwargs
        )
        return state, (((value, aux) if has_aux else value), grads)

    return _with_keyword(wrapped, fun, "dynamic_scaler_state")


def dynamic_scale_grad(
    fun: Callable[..., Any],
    *,
    has_aux: bool = False,
    redo_on_nan: int = 0,
    filter: bool = True,  # noqa: A002 - jaxamp's name
    axis_name: Any = None,
    **grad_kwargs: Any,
) -> Callable[..., Any]:
    """``jax.grad`` with dynamic loss scaling.

    :func:`dynamic_scale_value_and_grad` without the value, with the same checks, retries and
    skipping. As in ``jaxamp``, ``redo_on_nan`` defaults to 0 here (no retry).

    Args:
        fun: The function to differentiate. It returns a floating-point scalar loss, or a
            ``(loss, aux)`` pair with ``has_aux``.
        has_aux: Whether ``fun`` returns a ``(loss, aux)`` pair (default False).
        redo_on_nan: How many times a step whose gradients are not finite is retried with a
            smaller scale, a non-negative int (default 0).
        filter: If True (the default), differentiate only the floating-point array leaves of
            the differentiated arguments (``None`` gradients for the rest).
        axis_name: The name of a mapped axis over which every device takes the same decision;
            ``None`` (the default) for none.
        **grad_kwargs: Passed on to ``jax.value_and_grad`` (``argnums``...).

    Returns:
        A function ``(*args, dynamic_scaler_state, **kwargs)`` returning
        ``(new_state, grads)``, or ``(new_state, (grads, aux))`` with ``has_aux``.

    Raises:
        TypeError: If ``fun`` is not callable or ``redo_on_nan`` is not an int. When the
            returned function is called: if ``dynamic_scaler_state`` is missing or is not a loss
            scale, or if with ``has_aux`` ``fun`` does not return a pair.
        ValueError: If ``redo_on_nan`` is negative.

    Example:
        >>> import autocast, jax.numpy as jnp
        >>> grad_fn = autocast.dynamic_scale_grad(lambda w: jnp.sum(w ** 2), has_aux=False)
        >>> state, grads = grad_fn(jnp.ones(2), dynamic_scaler_state=autocast.DynamicScalerState())
        >>> grads
        Array([2., 2.], dtype=float32)
    """
    value_and_grad = dynamic_scale_value_and_grad(
        fun,
        has_aux=has_aux,
        redo_on_nan=redo_on_nan,
        filter=filter,
        axis_name=axis_name,
        **grad_kwargs,
    )

    def wrapped(*args: Any, dynamic_scaler_state: Any = None, **kwargs: Any) -> Any:
        _check_state(dynamic_scaler_state, "dynamic_scale_grad")
        state, (value, grads) = value_and_grad(
            *args, dynamic_scaler_state=dynamic_scaler_state, **kwargs
        )
        return state, ((grads, value[1]) if has_aux else grads)

    return _with_keyword(wrapped, fun, "dynamic_scaler_state")
