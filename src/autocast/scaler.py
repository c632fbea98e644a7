"""Loss scaling around a differentiated function: ``jaxamp``'s ``DynamicScalerState`` face.

``dynamic_scale_value_and_grad(fun)`` multiplies ``fun``'s value by the current scale before
differentiating, divides the gradients by it afterwards, checks them for inf and NaN, and
moves the scale with the one rule of :func:`autocast.next_loss_scale`. It never looks inside
``fun`` and never leaves the device: the decision to skip, retry and adjust is data.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from autocast._tree import is_array, is_inexact_array
from autocast.loss_scale import (
    _LossScaleBase,
    _check_finite_flag,
    _checked_count,
    _checked_scale,
    _concrete,
    _register,
    all_finite,
    next_loss_scale,
)

# DynamicScalerState has no floor of its own; the smallest normal float32 keeps it off zero.
_FLOOR = np.float32(np.finfo(np.float32).tiny)


@_register
class DynamicScalerState(_LossScaleBase):
    """The state of dynamic loss scaling, as ``jaxamp`` names it; a pytree of arrays.

    After a step whose gradients are finite, ``count`` goes up by one, unless it had already
    reached ``patience``: then ``scaler`` is multiplied by ``adjust_factor`` and ``count``
    restarts. After a step with inf or NaN gradients ``scaler`` is divided by
    ``adjust_factor``, ``count`` restarts and ``total_resets`` goes up by one. The scaler is
    float32 and never becomes 0 or inf.

    >>> import autocast, jax.numpy as jnp
    >>> state = autocast.DynamicScalerState(patience=1, scaler=8.0)
    >>> state = state.adjust(jnp.bool_(True)).adjust(jnp.bool_(True))
    >>> state.scaler, state.count
    (Array(16., dtype=float32), Array(0, dtype=int32))
    >>> state.adjust(jnp.bool_(False)).total_resets
    Array(1, dtype=int32)
    """

    _fields = ("patience", "adjust_factor", "scaler", "count", "total_resets")
    patience: jax.Array
    adjust_factor: jax.Array
    scaler: jax.Array
    count: jax.Array
    total_resets: jax.Array

    def __init__(
        self,
        patience: Any = 2000,
        adjust_factor: Any = 2.0,
        scaler: Any = 2.0**15,
        count: Any = 0,
        total_resets: Any = 0,
    ) -> None:
        if hasattr(scaler, "dtype") and not jnp.issubdtype(scaler.dtype, jnp.floating):
            raise TypeError(
                f"scaler must be a float (a Python number or a floating array), got {scaler.dtype}"
            )
        values = {
            "patience": _checked_count(patience, "patience", minimum=1),
            "adjust_factor": _checked_scale(adjust_factor, "adjust_factor"),
            "scaler": _checked_scale(scaler, "scaler"),
            "count": _checked_count(count, "count", minimum=0),
            "total_resets": _checked_count(total_resets, "total_resets", minimum=0),
        }
        factor = _concrete(values["adjust_factor"])
        if factor is not None and factor <= 1:
            raise ValueError(f"adjust_factor must be greater than 1, got {factor}")
        for name in self._fields:
            object.__setattr__(self, name, values[name])

    @property
    def loss_scale(self) -> jax.Array:  # type: ignore[override]
        """The current scale (``scaler``), under the name the other loss scales use."""
        return self.scaler

    def adjust(self, grads_finite: jax.Array) -> DynamicScalerState:
        """The next state, given whether this step's gradients were all finite."""
        finite = _check_finite_flag(grads_finite)
        # jaxamp grows once `count` has reached `patience` before this step: in the shared
        # rule's terms, after `patience + 1` consecutive finite steps.
        update = next_loss_scale(
            finite, self.scaler, self.count, self.patience + 1, self.adjust_factor, _FLOOR
        )
        resets = self.total_resets + (~finite).astype(self.total_resets.dtype)
        return jax.tree_util.tree_unflatten(
            jax.tree_util.tree_structure(self),
            [self.patience, self.adjust_factor, update.loss_scale, update.counter, resets],
        )


class _Attempt(NamedTuple):
    value: Any
    aux: Any
    grads: Any
    finite: jax.Array


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


def _check_options(fun: Any, redo_on_nan: Any) -> None:
    if not callable(fun):
        raise TypeError(f"expected a function to differentiate, got {type(fun).__name__}")
    if isinstance(redo_on_nan, bool) or not isinstance(redo_on_nan, (int, np.integer)):
        raise TypeError(f"redo_on_nan must be a non-negative int, got {redo_on_nan!r}")
    if redo_on_nan < 0:
        raise ValueError(f"redo_on_nan must be a non-negative int, got {redo_on_nan}")


def _with_state_keyword(wrapped: Callable[..., Any], fun: Callable[..., Any]) -> Callable[..., Any]:
    """Names and documents ``wrapped`` after ``fun``, with a signature that also shows the
    ``dynamic_scaler_state`` keyword (tools such as ``eqx.filter_jit`` bind arguments by it)."""
    functools.update_wrapper(wrapped, fun)
    del wrapped.__wrapped__
    try:
        sig = inspect.signature(fun)
    except (TypeError, ValueError):  # a builtin or C function: leave the signature alone
        return wrapped
    params = list(sig.parameters.values())
    state = inspect.Parameter("dynamic_scaler_state", inspect.Parameter.KEYWORD_ONLY)
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
    if not (hasattr(state, "loss_scale") and hasattr(state, "adjust") and hasattr(state, "unscale")):
        raise TypeError(
            "dynamic_scaler_state must be an autocast.DynamicScalerState (or another autocast "
            f"loss scale), got {type(state).__name__}"
        )


def _split_static(tree: Any) -> tuple[list, Any, list]:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    dynamic = [x if is_array(x) else None for x in leaves]
    static = [None if d is not None else x for d, x in zip(dynamic, leaves)]
    return dynamic, treedef, static


def dynamic_scale_value_and_grad(
    fun: Callable[..., Any],
    *,
    has_aux: bool = False,
    redo_on_nan: int = 0,
    filter: bool = True,  # noqa: A002 - jaxamp's name
    axis_name: Any = None,
    **grad_kwargs: Any,
) -> Callable[..., Any]:
    """``jax.value_and_grad`` with dynamic loss scaling, ``jaxamp``'s signature.

    The returned function takes ``fun``'s arguments plus the keyword
    ``dynamic_scaler_state`` and returns ``(new_state, (value, grads))``, or
    ``(new_state, ((value, aux), grads))`` with ``has_aux``; value and gradients are unscaled
    and in the primal dtypes. Gradients with inf or NaN come back as they are, and the new
    state has a smaller scale: skip the update (``autocast.select_tree``,
    ``optax.apply_if_finite``) or let ``redo_on_nan=k`` retry up to ``k`` times with smaller
    scales inside the compiled program. ``filter=True`` differentiates only the
    floating-point array leaves of the differentiated arguments (``None`` gradients for the
    rest), so Equinox modules and pytrees with strings or ints work. ``axis_name`` makes every
    device under ``pmap``/``shard_map`` take the same decision. Other keywords (``argnums``
    ...) go to ``jax.value_and_grad``.

    A float16 loss whose gradient overflows at the initial scale, retried once at half of it:

    >>> import autocast, jax.numpy as jnp
    >>> loss = lambda w: jnp.sum(w.astype(jnp.float16) ** 2).astype(jnp.float32)
    >>> grad_fn = autocast.dynamic_scale_value_and_grad(loss, redo_on_nan=1)
    >>> state, (value, grads) = grad_fn(jnp.ones(2), dynamic_scaler_state=autocast.DynamicScalerState())
    >>> value, grads, state.scaler, state.total_resets
    (Array(2., dtype=float32), Array([2., 2.], dtype=float32), Array(16384., dtype=float32), Array(1, dtype=int32))
    """
    _check_options(fun, redo_on_nan)
    argnums = grad_kwargs.pop("argnums", 0)

    def scaled(*args: Any, __scale: Any, **kwargs: Any) -> Any:
        out = fun(*args, **kwargs)
        value, aux = out if has_aux else (out, None)
        wide = jnp.promote_types(jnp.result_type(value), jnp.float32)
        return (value.astype(wide) * __scale.astype(wide)).astype(wide), (value, aux)

    if filter:
        value_and_grad = _filtered_value_and_grad(scaled, argnums, True, **grad_kwargs)
    else:
        value_and_grad = jax.value_and_grad(scaled, argnums=argnums, has_aux=True, **grad_kwargs)

    def attempt(state: Any, args: tuple, kwargs: dict) -> _Attempt:
        (_, (value, aux)), grads = value_and_grad(*args, __scale=state.loss_scale, **kwargs)
        grads = state.unscale(grads)
        finite = all_finite(grads)
        if axis_name is not None:
            finite = lax.pmin(finite.astype(jnp.int32), axis_name).astype(jnp.bool_)
        return _Attempt(value, aux, grads, finite)

    def wrapped(*args: Any, dynamic_scaler_state: Any = None, **kwargs: Any) -> Any:
        _check_state(dynamic_scaler_state, "dynamic_scale_value_and_grad")
        first = attempt(dynamic_scaler_state, args, kwargs)
        state = dynamic_scaler_state.adjust(first.finite)
        result = first
        if redo_on_nan:
            # The loop carries arrays only: non-array leaves of aux are the same every try.
            dynamic, treedef, static = _split_static(first)

            def rebuild(dyn: list) -> _Attempt:
                return jax.tree_util.tree_unflatten(
                    treedef, [s if d is None else d for d, s in zip(dyn, static)]
                )

            def again(carry: tuple) -> Any:
                state, tries, dyn = carry
                return (~rebuild(dyn).finite) & (tries < redo_on_nan)

            def retry(carry: tuple) -> tuple:
                state, tries, _ = carry
                now = attempt(state, args, kwargs)
                return state.adjust(now.finite), tries + 1, _split_static(now)[0]

            state, _, dynamic = lax.while_loop(again, retry, (state, jnp.int32(0), dynamic))
            result = rebuild(dynamic)
        value = (result.value, result.aux) if has_aux else result.value
        return state, (value, result.grads)

    return _with_state_keyword(wrapped, fun)


def dynamic_scale_grad(
    fun: Callable[..., Any],
    *,
    has_aux: bool = False,
    redo_on_nan: int = 0,
    filter: bool = True,  # noqa: A002 - jaxamp's name
    axis_name: Any = None,
    **grad_kwargs: Any,
) -> Callable[..., Any]:
    """``jax.grad`` with dynamic loss scaling: returns ``(new_state, grads)``, or
    ``(new_state, (grads, aux))`` with ``has_aux``. See :func:`dynamic_scale_value_and_grad`.

    >>> import autocast, jax.numpy as jnp
    >>> grad_fn = autocast.dynamic_scale_grad(lambda w: jnp.sum(w ** 2), has_aux=False)
    >>> state, grads = grad_fn(jnp.ones(2), dynamic_scaler_state=autocast.DynamicScalerState())
    >>> grads
    Array([2., 2.], dtype=float32)
    """
    value_and_grad = dynamic_scale_value_and_grad(
        fun, has_aux=has_aux, redo_on_nan=redo_on_nan, filter=filter, axis_name=axis_name,
        **grad_kwargs,
    )

    def wrapped(*args: Any, dynamic_scaler_state: Any = None, **kwargs: Any) -> Any:
        _check_state(dynamic_scaler_state, "dynamic_scale_grad")
        state, (value, grads) = value_and_grad(*args, dynamic_scaler_state=dynamic_scaler_state, **kwargs)
        return state, ((grads, value[1]) if has_aux else grads)

    return _with_state_keyword(wrapped, fun)
