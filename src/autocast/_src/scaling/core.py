"""Loss scaling's one core: the rule that grows and shrinks the scale, its floor, the health
counters, and the finiteness checks every face of the library shares.

Float16 gradients underflow unless the loss is multiplied by a large factor before
differentiation and the gradients are divided by it afterwards. The rule that moves that
factor is :func:`next_loss_scale`; jmp's ``DynamicLossScale`` (``scaling/jmp.py``), jaxamp's
``DynamicScalerState`` (``scaling/jaxamp.py``) and the optax wrapper (``scaling/optax.py``)
all call it, and :func:`next_health` for their health counters, so neither is written twice.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from autocast._src.tree import is_array, is_inexact_array

T = TypeVar("T")

# The smallest normal float32: the floor under every scale, so that none ever reaches 0.
FLOAT32_TINY = np.float32(np.finfo(np.float32).tiny)


def concrete_value(x: Any) -> np.ndarray | None:
    """The value of ``x`` when it is known at trace time, else None (a tracer)."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def checked_scale(value: Any, name: str, *, allow_zero: bool = False) -> jax.Array:
    """``value`` as a float32 scalar, after checking it is a positive finite number there."""
    what = "a non-negative" if allow_zero else "a positive"
    if isinstance(value, (bool, np.bool_, str, bytes)) or (
        hasattr(value, "dtype") and not jnp.issubdtype(value.dtype, jnp.number)
    ):
        raise TypeError(f"{name} must be {what} finite number, got {value!r}")
    concrete = concrete_value(value)
    if concrete is not None:
        if concrete.shape != ():
            raise ValueError(f"{name} must be a scalar, got shape {concrete.shape}")
        if not jnp.issubdtype(concrete.dtype, jnp.number) or jnp.issubdtype(
            concrete.dtype, jnp.complexfloating
        ):
            raise TypeError(f"{name} must be {what} finite number, got {value!r}")
        # Checked after the cast, so 1e39 (inf in float32) and 1e-46 (0) are refused too.
        with np.errstate(over="ignore", under="ignore"):
            as_f32 = np.asarray(concrete, np.float32)
        if not np.isfinite(as_f32) or as_f32 < 0 or (as_f32 == 0 and not allow_zero):
            raise ValueError(f"{name} must be {what} finite number (in float32), got {concrete}")
    return jnp.asarray(value, dtype=jnp.float32)


def checked_count(value: Any, name: str, *, minimum: int) -> jax.Array:
    """``value`` as an int32 scalar. A float with a whole value (``5.0``) counts as an integer,
    as it does in ``jmp`` and ``jaxamp``; a fractional one is refused rather than truncated."""
    if isinstance(value, (bool, np.bool_, str, bytes)) or (
        hasattr(value, "dtype") and not jnp.issubdtype(value.dtype, jnp.number)
    ):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    concrete = concrete_value(value)
    if concrete is None:
        if not jnp.issubdtype(value.dtype, jnp.integer):
            # A traced float cannot be checked for a whole value; truncating it would be silent.
            raise TypeError(f"{name} must be an integer, got a traced {value.dtype} value")
        return jnp.asarray(value, dtype=jnp.int32)
    if concrete.shape != ():
        raise ValueError(f"{name} must be a scalar, got shape {concrete.shape}")
    if np.issubdtype(concrete.dtype, np.floating):
        if not np.isfinite(concrete) or concrete != np.round(concrete):
            raise ValueError(f"{name} must be a whole number, got {concrete}")
    elif not np.issubdtype(concrete.dtype, np.integer):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if concrete < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {concrete}")
    if concrete > np.iinfo(np.int32).max:
        raise ValueError(f"{name} must fit in int32, got {concrete}")
    if np.issubdtype(concrete.dtype, np.floating):
        return jnp.asarray(int(concrete), dtype=jnp.int32)
    return jnp.asarray(value, dtype=jnp.int32)


def widened_product(x: jax.Array, factor: jax.Array) -> jax.Array:
    """``x * factor`` in at least float32: a 16-bit ``x`` is promoted, so a scaled loss cannot
    overflow float16 and the factor is never rounded to 16 bits (2**16 is inf in float16)."""
    wide = jnp.promote_types(x.dtype, jnp.float32)
    return jnp.multiply(x.astype(wide), jnp.asarray(factor).astype(wide))


def unscale_leaf(x: jax.Array, factor: jax.Array) -> jax.Array:
    # Divides rather than multiplying by the inverse, which is subnormal, or zero, above 2**126;
    # in at least float32, so the factor is not rounded, then back to the leaf's own dtype.
    wide = jnp.promote_types(x.dtype, jnp.float32)
    return jnp.divide(x.astype(wide), jnp.asarray(factor).astype(wide)).astype(x.dtype)


def check_finite_flag(grads_finite: Any) -> jax.Array:
    flag = jnp.asarray(grads_finite)
    if flag.dtype != jnp.bool_ or flag.shape != ():
        raise TypeError(
            "grads_finite must be a boolean scalar such as all_finite(grads), got "
            f"{flag.dtype} with shape {flag.shape}"
        )
    return flag


class LossScaleUpdate(NamedTuple):
    """The outcome of one step of the dynamic rule (see :func:`next_loss_scale`).

    A ``NamedTuple`` of two scalar arrays.

    Attributes:
        loss_scale: The new loss scale, in the dtype of the scale it was computed from.
        counter: The new count of consecutive finite steps, in the dtype of the old count.

    Example:
        >>> import autocast, jax.numpy as jnp
        >>> autocast.LossScaleUpdate(jnp.float32(8.0), jnp.int32(0)).loss_scale
        Array(8., dtype=float32)
    """

    loss_scale: jax.Array
    counter: jax.Array


def next_loss_scale(
    grads_finite: jax.Array,
    loss_scale: jax.Array,
    counter: jax.Array,
    period: jax.Array,
    factor: jax.Array,
    min_loss_scale: jax.Array,
) -> LossScaleUpdate:
    """The dynamic loss-scaling rule, written once for every face of the library.

    Finite gradients add one to ``counter``; when it reaches ``period`` the scale is multiplied
    by ``factor`` (unless that overflows float32) and the counter resets. Non-finite gradients
    divide the scale by ``factor``, never below ``min_loss_scale`` nor below the smallest normal
    float32, and reset the counter. All arguments may be traced: no value leaves the device.
    Nothing is checked here; the loss-scale classes check their fields when they are built.

    Args:
        grads_finite: A boolean scalar: whether this step's gradients were all finite, as
            :func:`all_finite` returns it.
        loss_scale: The current loss scale, a floating scalar array (float32 in the library).
        counter: The number of consecutive finite steps since the scale last changed, an
            integer scalar array.
        period: The number of consecutive finite steps after which the scale grows.
        factor: What the scale is multiplied by to grow and divided by to shrink; greater than 1.
        min_loss_scale: The floor of the scale. Below the smallest normal float32 (0, say),
            that number is the floor.

    Returns:
        A :class:`LossScaleUpdate` ``(loss_scale, counter)``: the new scale in the dtype of
        ``loss_scale`` and the new count in the dtype of ``counter``.

    Example:
        >>> import autocast, jax.numpy as jnp
        >>> autocast.next_loss_scale(jnp.bool_(False), jnp.float32(1024.), jnp.int32(5),
        ...                          jnp.int32(2000), jnp.float32(2.), jnp.float32(1.))
        LossScaleUpdate(loss_scale=Array(512., dtype=float32), counter=Array(0, dtype=int32))
    """
    counted = counter + 1
    grow = counted >= period
    grown = loss_scale * factor
    grown = jnp.where(jnp.isfinite(grown), grown, loss_scale)
    floor = jnp.maximum(min_loss_scale, FLOAT32_TINY)
    shrunk = jnp.maximum(loss_scale / factor, floor)
    new_scale = jnp.where(grads_finite, jnp.where(grow, grown, loss_scale), shrunk)
    new_counter = jnp.where(grads_finite & ~grow, counted, jnp.zeros_like(counter))
    return LossScaleUpdate(new_scale.astype(loss_scale.dtype), new_counter.astype(counter.dtype))


def register_fields(cls: type) -> type:
    """Registers a loss-scale class as a pytree whose leaves are all of its fields.

    Unflattening bypasses the constructor: JAX rebuilds pytrees with tracers or placeholder
    objects as leaves, which the constructor's checks must never see.
    """
    if dataclasses.is_dataclass(cls):
        fields = tuple(f.name for f in dataclasses.fields(cls))

        def unflatten(_: None, leaves: Any) -> Any:
            obj = object.__new__(cls)
            for f, leaf in zip(fields, leaves):
                object.__setattr__(obj, f, leaf)
            return obj

    else:  # a NamedTuple
        fields = cls._fields

        def unflatten(_: None, leaves: Any) -> Any:
            return tuple.__new__(cls, leaves)

    def flatten_with_keys(obj: Any) -> tuple[list[tuple[Any, Any]], None]:
        return [(jax.tree_util.GetAttrKey(f), getattr(obj, f)) for f in fields], None

    def flatten(obj: Any) -> tuple[list[Any], None]:
        return [getattr(obj, f) for f in fields], None

    jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)
    return cls


class ScalingHealth(NamedTuple):
    """How loss scaling is going, counted on the device (nothing is read by the host).

    Carried by :class:`autocast.DynamicScalerState` (as its fields) and by
    ``autocast.optax.dynamic_loss_scaling``'s state, which update the counters once per step
    (retries within a step count once); :func:`stalled` reads them. A ``NamedTuple``; every
    field defaults to 0.

    Attributes:
        skipped_in_a_row: Consecutive steps skipped for non-finite gradients or loss.
        steps_at_floor: Consecutive steps that ended with the scale at its floor, where a
            smaller scale cannot help any more.
        zero_grad_steps: Steps whose finite gradients were all exactly zero, what a scale too
            small for float16 gradients leaves (they underflow).

    Example:
        >>> import autocast
        >>> health = autocast.ScalingHealth(skipped_in_a_row=3)
        >>> health
        ScalingHealth(skipped_in_a_row=3, steps_at_floor=0, zero_grad_steps=0)
        >>> autocast.stalled(health, max_skipped_in_a_row=2)
        Array(True, dtype=bool)
    """

    skipped_in_a_row: Any = 0
    steps_at_floor: Any = 0
    zero_grad_steps: Any = 0


def next_health(health: ScalingHealth, *, finite: Any, at_floor: Any, zero: Any) -> ScalingHealth:
    """The health counters after one step (not one attempt: retries within a step count
    once), given whether its gradients were finite, whether the scale ended at its floor,
    and whether the gradients were all zero. Every face of the library updates them here."""
    i32 = jnp.int32
    return ScalingHealth(
        jnp.where(finite, 0, jnp.asarray(health.skipped_in_a_row, i32) + 1).astype(i32),
        jnp.where(at_floor, jnp.asarray(health.steps_at_floor, i32) + 1, 0).astype(i32),
        (jnp.asarray(health.zero_grad_steps, i32) + (finite & zero).astype(i32)).astype(i32),
    )


def health_of(state: Any) -> ScalingHealth:
    if isinstance(state, ScalingHealth):
        return state
    health = getattr(state, "health", None)  # autocast.optax's state
    if isinstance(health, ScalingHealth):
        return health
    if all(hasattr(state, f) for f in ScalingHealth._fields):  # DynamicScalerState
        return ScalingHealth(*(getattr(state, f) for f in ScalingHealth._fields))
    raise TypeError(
        "expected a DynamicScalerState, an autocast.optax dynamic_loss_scaling state or a "
        f"ScalingHealth, got {type(state).__name__}"
    )


def stalled(
    state: Any,
    *,
    max_skipped_in_a_row: int = 10,
    max_steps_at_floor: int = 200,
    max_zero_grad_steps: int = 10,
) -> jax.Array:
    """Whether loss scaling has stopped training, as a boolean scalar on the device.

    True when more than ``max_skipped_in_a_row`` steps in a row were skipped, the scale has
    sat at its floor for more than ``max_steps_at_floor`` steps, or more than
    ``max_zero_grad_steps`` steps had all-zero gradients. Nothing is read by the host: branch
    on it with ``lax.cond``, fail with :func:`check_not_stalled` under ``checkify``, or read it
    every N steps.

    Args:
        state: A :class:`DynamicScalerState`, the state of
            ``autocast.optax.dynamic_loss_scaling`` (its own ``LossScalingState``: a chain's
            state that holds one is not searched) or a :class:`ScalingHealth`.
        max_skipped_in_a_row: How many consecutive skipped steps are tolerated (default 10).
        max_steps_at_floor: How many consecutive steps at the scale's floor are tolerated
            (default 200).
        max_zero_grad_steps: How many steps with all-zero gradients are tolerated (default 10).

    Returns:
        A boolean scalar ``jax.Array``.

    Raises:
        TypeError: If ``state`` is none of the accepted types.

    Example:
        >>> import autocast, jax.numpy as jnp
        >>> state = autocast.DynamicScalerState(skipped_in_a_row=11)
        >>> autocast.stalled(state), autocast.stalled(state, max_skipped_in_a_row=20)
        (Array(True, dtype=bool), Array(False, dtype=bool))
    """
    h = health_of(state)
    return (
        (jnp.asarray(h.skipped_in_a_row) > max_skipped_in_a_row)
        | (jnp.asarray(h.steps_at_floor) > max_steps_at_floor)
        | (jnp.asarray(h.zero_grad_steps) > max_zero_grad_steps)
    )


def check_not_stalled(state: Any, **limits: int) -> None:
    """Fails the step, through ``jax.experimental.checkify``, when :func:`stalled` holds.

    Wrap the train step in ``checkify.checkify`` and call ``err.throw()`` where the host looks
    anyway. The message gives the three counters. Call it inside a function that
    ``checkify.checkify`` transforms: ``jax.jit`` cannot stage a bare ``checkify.check``.

    Args:
        state: What :func:`stalled` accepts: a :class:`DynamicScalerState`, the state of
            ``autocast.optax.dynamic_loss_scaling`` or a :class:`ScalingHealth`.
        **limits: The thresholds of :func:`stalled`: ``max_skipped_in_a_row``,
            ``max_steps_at_floor`` and ``max_zero_grad_steps``, with its defaults.

    Returns:
        None. The failure, if any, is in the error that ``checkify.checkify`` returns.

    Raises:
        TypeError: If ``state`` is none of the accepted types.

    Example:
        >>> import autocast, jax, jax.numpy as jnp
        >>> from jax.experimental import checkify
        >>> def step(state):
        ...     autocast.check_not_stalled(state, max_skipped_in_a_row=3)
        ...     return state.scaler
        >>> err, _ = checkify.checkify(step)(autocast.DynamicScalerState(skipped_in_a_row=4))
        >>> err.get()[:60]
        'loss scaling stalled: 4 steps skipped in a row, 0 at the sca'
    """
    from jax.experimental import checkify

    h = health_of(state)
    checkify.check(
        ~stalled(h, **limits),
        "loss scaling stalled: {a} steps skipped in a row, {b} at the scale floor, "
        "{c} with all-zero gradients",
        a=jnp.asarray(h.skipped_in_a_row),
        b=jnp.asarray(h.steps_at_floor),
        c=jnp.asarray(h.zero_grad_steps),
    )


def all_zero(tree: Any) -> jax.Array:
    """One boolean scalar: are all floating-point leaves of ``tree`` exactly zero? (True for
    a tree with none.)

    >>> import autocast, jax.numpy as jnp
    >>> from autocast._src.scaling.core import all_zero
    >>> all_zero({"a": jnp.zeros(3), "b": jnp.array([0.0, -0.0])}), all_zero(jnp.ones(1))
    (Array(True, dtype=bool), Array(False, dtype=bool))
    """
    leaves = [x for x in jax.tree_util.tree_leaves(tree) if is_inexact_array(x)]
    if not leaves:
        return jnp.array(True)
    return functools.reduce(jnp.logical_and, [(x == 0).all() for x in leaves])


def all_finite(tree: Any) -> jax.Array:
    """Whether all floating-point leaves of ``tree`` are free of inf and NaN, as one boolean scalar.

    Computed on device with no host synchronisation. Complex leaves count (both parts must be
    finite); integer, boolean and non-array leaves are ignored, and an empty tree is finite.

    Args:
        tree: Any pytree, such as the gradients of one step.

    Returns:
        A boolean scalar ``jax.Array``.

    Example:
        >>> import autocast, jax.numpy as jnp
        >>> autocast.all_finite({"a": jnp.ones(3), "b": jnp.array([1.0, jnp.inf])})
        Array(False, dtype=bool)
        >>> autocast.all_finite({})
        Array(True, dtype=bool)
    """
    leaves = [x for x in jax.tree_util.tree_leaves(tree) if is_inexact_array(x)]
    if not leaves:
        return jnp.array(True)
    return functools.reduce(jnp.logical_and, [jnp.isfinite(x).all() for x in leaves])


def nonfinite_leaves(tree: Any) -> Any:
    """Leaf by leaf, whether each floating-point leaf holds an inf or NaN.

    The tree of :func:`all_finite`'s answer, for finding out *which* gradients overflowed
    when a dynamically scaled step was skipped. Computed on device with no host
    synchronisation: return it from the jitted step and read it outside (see
    :func:`nonfinite_paths`).

    Args:
        tree: Any pytree, such as the gradients of one step.

    Returns:
        A pytree of ``tree``'s structure whose leaves are boolean scalar arrays: True where a
        floating-point or complex leaf holds an inf or NaN. Integer, boolean and non-array
        leaves are ``False``.

    Example:
        >>> import autocast, jax.numpy as jnp
        >>> autocast.nonfinite_leaves({"a": jnp.ones(3), "b": jnp.array([1.0, jnp.inf]), "n": 3})
        {'a': Array(False, dtype=bool), 'b': Array(True, dtype=bool), 'n': Array(False, dtype=bool)}
    """

    def flag(x: Any) -> jax.Array:
        return jnp.logical_not(jnp.isfinite(x).all()) if is_inexact_array(x) else jnp.array(False)

    return jax.tree_util.tree_map(flag, tree)


def nonfinite_paths(flags: Any) -> list[str]:
    """The key paths of the leaves :func:`nonfinite_leaves` flagged, in tree order.

    Reads the flags on the host: call it outside the compiled step, on what it returned
    (a tree of gradients works too, and is checked the same way). The leaves must be concrete
    values, not tracers.

    Args:
        flags: A tree :func:`nonfinite_leaves` returned, or a tree of gradients. A boolean leaf
            counts when any of its elements is True, a floating-point or complex leaf when it
            holds an inf or NaN; other leaves never count.

    Returns:
        A list of strings, one per leaf that counts, each the leaf's key path as
        ``jax.tree_util.keystr`` writes it (``"['head']['w']"``); empty when none counts.

    Example:
        >>> import autocast, jax.numpy as jnp
        >>> grads = {"head": {"w": jnp.array([jnp.nan])}, "embed": jnp.ones(2)}
        >>> autocast.nonfinite_paths(autocast.nonfinite_leaves(grads))
        ["['head']['w']"]
    """
    found = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(flags):
        if is_inexact_array(leaf):
            bad = not bool(jnp.isfinite(leaf).all())
        else:
            bad = bool(getattr(leaf, "dtype", None) == jnp.bool_ and jnp.any(leaf))
        if bad:
            found.append(jax.tree_util.keystr(path))
    return found


def select_tree(pred: Any, a: T, b: T) -> T:
    """Leaf by leaf, ``a`` where the boolean scalar ``pred`` holds, else ``b``.

    Array leaves must agree in dtype and shape (nothing is promoted); other leaves must be
    equal in both trees and pass through. Works under ``jax.jit`` with a traced ``pred``.
    Used to skip an update: ``select_tree(finite, new_params, params)``.

    Args:
        pred: A boolean scalar (a Python bool, NumPy or JAX value, or a tracer).
        a: The pytree to return where ``pred`` is True.
        b: The pytree to return where ``pred`` is False, with the structure of ``a``.

    Returns:
        A pytree of ``a``'s structure: each array leaf taken from ``a`` or ``b`` by ``pred``,
        each other leaf as it is in both.

    Raises:
        TypeError: If ``pred`` is not a boolean scalar; if array leaves at the same place
            differ in dtype or shape; if non-array leaves at the same place are not equal.

    Example:
        >>> import autocast, jax.numpy as jnp
        >>> autocast.select_tree(jnp.bool_(False), {"w": jnp.ones(2)}, {"w": jnp.zeros(2)})
        {'w': Array([0., 0.], dtype=float32)}
    """
    pred = jnp.asarray(pred)
    if pred.dtype != jnp.bool_ or pred.shape != ():
        raise TypeError(f"pred must be a boolean scalar, got {pred.dtype} with shape {pred.shape}")

    def select(path: Any, x: Any, y: Any) -> Any:
        where = jax.tree_util.keystr(path) or "the root"
        if is_array(x) or is_array(y):
            x, y = jnp.asarray(x), jnp.asarray(y)
            if x.dtype != y.dtype or x.shape != y.shape:
                raise TypeError(
                    f"select_tree: leaves at {where} differ: {x.dtype}{list(x.shape)} vs "
                    f"{y.dtype}{list(y.shape)}; both trees need the same dtypes and shapes"
                )
            return lax.select(jnp.broadcast_to(pred, x.shape), x, y)
        if x is not y and x != y:
            raise TypeError(
                f"select_tree: non-array leaves at {where} differ ({x!r} vs {y!r}); "
                "only array leaves can be selected"
            )
        return x

    return jax.tree_util.tree_map_with_path(select, a, b)
