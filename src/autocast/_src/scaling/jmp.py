"""jmp's face of loss scaling: the loss-scale objects ``NoOpLossScale``, ``StaticLossScale``
and ``DynamicLossScale``, and their base ``LossScale``.

Every one is a frozen dataclass (value equality, ``dataclasses.replace``) and a pytree whose
every field is a leaf stored as an array, so the whole state survives ``jax.jit``,
``tree_flatten``/``tree_unflatten``, ``pickle`` and checkpoint libraries that save leaves only.
(``jmp`` 0.0.4 kept ``min_loss_scale`` outside its leaves and lost it.) ``DynamicLossScale``
moves by the core's :func:`~autocast._src.scaling.core.next_loss_scale`.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import TypeVar

import jax
import jax.numpy as jnp

from autocast._src.scaling.core import (
    check_finite_flag,
    checked_count,
    checked_scale,
    concrete_value,
    next_loss_scale,
    register_fields,
    unscale_leaf,
    widened_product,
)
from autocast._src.tree import map_floating, map_inexact

T = TypeVar("T")
F = TypeVar("F", bound="LossScale")


class LossScale(abc.ABC):
    """The base type of every loss-scale object, ``jmp.LossScale``'s counterpart.

    ``NoOpLossScale``, ``StaticLossScale``, ``DynamicLossScale`` and ``DynamicScalerState`` are
    all instances, so it serves in annotations and ``isinstance`` checks. A loss scale has a
    float32 ``loss_scale`` and three methods: ``scale(tree)`` multiplies the floating-point
    leaves of a tree (the loss, usually) by it, promoting 16-bit leaves to float32 so that the
    scaled loss cannot overflow; ``unscale(tree)`` divides the floating-point and complex
    leaves (the gradients) by it and keeps each leaf's dtype; ``adjust(grads_finite)``
    returns the next state. It cannot be instantiated itself.

    Attributes:
        loss_scale: The current scale, a float32 scalar array.

    Example:
        >>> import autocast, jax.numpy as jnp
        >>> ls = autocast.StaticLossScale(2.0**15)
        >>> isinstance(ls, autocast.LossScale)
        True
        >>> ls.scale(jnp.float16(3.0))  # 98304 is beyond float16's range
        Array(98304., dtype=float32)
        >>> ls.unscale(jnp.float16(6144.0))  # gradients keep their dtype
        Array(0.1875, dtype=float16)
    """

    __slots__ = ()
    loss_scale: jax.Array

    def scale(self, tree: T) -> T:
        """Multiplies the floating-point leaves of ``tree`` by the loss scale.

        16-bit leaves come back in float32 (a scaled float16 loss of 2 at 2**15 would be inf);
        float32 and float64 leaves keep their dtype. Only array leaves of a real floating dtype are
        scaled: a Python float, a complex or integer array and every other leaf pass through
        unchanged, so give the loss as an array.

        Args:
            tree: A pytree, usually the scalar loss.

        Returns:
            A pytree of the same structure with the floating-point array leaves scaled.
        """
        return map_floating(lambda x: widened_product(x, self.loss_scale), tree)

    def unscale(self, tree: T) -> T:
        """Divides the floating-point and complex leaves of ``tree`` by the loss scale, keeping
        dtypes.

        The division runs in at least float32, so the scale is not rounded to 16 bits, and each
        result is cast back to its leaf's dtype. Complex leaves are divided too, unlike in
        :meth:`scale`: the gradients of complex parameters come from a real scaled loss, so
        they carry the scale. Integer and other leaves pass through unchanged.

        Args:
            tree: A pytree, usually the gradients of the scaled loss.

        Returns:
            A pytree of the same structure, with the floating-point and complex array leaves
            divided by the scale and in their own dtypes.
        """
        return map_inexact(lambda x: unscale_leaf(x, self.loss_scale), tree)

    @abc.abstractmethod
    def adjust(self, grads_finite: jax.Array) -> LossScale:
        """The next loss scale, given whether this step's gradients were all finite.

        Args:
            grads_finite: A boolean scalar, traced or not: whether this step's gradients were all
                finite, as :func:`autocast.all_finite` returns it.

        Returns:
            A loss scale of the same type; ``self`` is not modified.

        Raises:
            TypeError: If ``grads_finite`` is not a boolean scalar.
        """


def _value_equality(cls: type[T]) -> type[T]:
    """Makes ``==`` of a loss-scale dataclass one Python bool on every Python, as tuples of
    fields compared up to Python 3.12; 3.13's generated ``__eq__`` joins the fields'
    comparisons with ``and`` and so returns the last one, a JAX array. The generated
    ``__hash__`` is kept."""

    def __eq__(self: T, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        names = [f.name for f in dataclasses.fields(self)]
        pairs = ((getattr(self, n), getattr(other, n)) for n in names)
        return all(a is b or bool(a == b) for a, b in pairs)

    cls.__eq__ = __eq__  # type: ignore[method-assign]
    return cls


class _Fixed(LossScale):
    """A loss scale that never changes: what :class:`NoOpLossScale` and
    :class:`StaticLossScale` share."""

    def adjust(self: F, grads_finite: jax.Array) -> F:
        """Returns ``self``: this scale never changes.

        Args:
            grads_finite: A boolean scalar, traced or not: whether this step's gradients were all
                finite, as :func:`autocast.all_finite` returns it.

        Returns:
            ``self``.

        Raises:
            TypeError: If ``grads_finite`` is not a boolean scalar.
        """
        check_finite_flag(grads_finite)
        return self


@register_fields
@_value_equality
@dataclasses.dataclass(frozen=True)
class NoOpLossScale(_Fixed):
    """A loss scale that does nothing, for bfloat16 and float32 training.

    It has no fields: ``loss_scale`` is always 1, ``scale`` and ``unscale`` return their
    argument, and ``adjust`` returns the same object.

    Example:
        >>> import autocast, jax.numpy as jnp
        >>> ls = autocast.NoOpLossScale()
        >>> ls.scale(jnp.float32(3.0)), ls.adjust(jnp.bool_(False)) is ls
        (Array(3., dtype=float32), True)
    """

    @property
    def loss_scale(self) -> jax.Array:
        """Always 1, as a float32 scalar array."""
        return jnp.ones((), jnp.float32)

    def scale(self, tree: T) -> T:
        """Returns ``tree`` unchanged.

        Args:
            tree: Any pytree.

        Returns:
            ``tree`` itself.
        """
        return tree

    def unscale(self, tree: T) -> T:
        """Returns ``tree`` unchanged.

        Args:
            tree: Any pytree.

        Returns:
            ``tree`` itself.
        """
        return tree


@register_fields
@_value_equality
@dataclasses.dataclass(frozen=True)
class StaticLossScale(_Fixed):
    """Scales and unscales by a fixed positive factor, kept in float32.

    Attributes:
        loss_scale: The factor, a float32 scalar array. The constructor accepts any positive
            real number that is finite in float32 (a Python or NumPy number, or a scalar
            array).

    Raises:
        TypeError: If ``loss_scale`` is not a real number (a bool, a string, a complex or
            non-numeric array).
        ValueError: If ``loss_scale`` is not a scalar, or not positive and finite in float32.

    Example:
        >>> import autocast, jax.numpy as jnp
        >>> ls = autocast.StaticLossScale(128.0)
        >>> ls.scale(jnp.float16(0.5))
        Array(64., dtype=float32)
        >>> ls.unscale(jnp.float16(64.0))
        Array(0.5, dtype=float16)
    """

    loss_scale: jax.Array

    def __post_init__(self) -> None:
        object.__setattr__(self, "loss_scale", checked_scale(self.loss_scale, "loss_scale"))


@register_fields
@_value_equality
@dataclasses.dataclass(frozen=True)
class DynamicLossScale(LossScale):
    """A loss scale that grows while gradients stay finite and shrinks when they do not.

    Every ``period`` consecutive finite steps multiply the scale by ``factor``; a step with
    non-finite gradients divides it by ``factor`` (never below ``min_loss_scale``, and never to
    0: ``min_loss_scale=0`` means no floor but the smallest normal float32) and restarts the
    count. The scale is kept in float32 whatever dtype it is given in, and every field is a
    pytree leaf, so the state passes through ``jax.jit``, ``pickle`` and checkpoints whole.
    The constructor checks and converts every field; ``dataclasses.replace`` runs it too.

    Attributes:
        loss_scale: The current scale, a float32 scalar array; positive and finite.
        counter: Consecutive finite steps since the scale last changed, an int32 scalar
            (default 0).
        period: How many consecutive finite steps make the scale grow, an int32 scalar, at
            least 1 (default 2000).
        factor: What the scale is multiplied by to grow and divided by to shrink, a float32
            scalar greater than 1 (default 2).
        min_loss_scale: The floor of the scale, a float32 scalar, non-negative and at most
            ``loss_scale`` (default 1).

    Raises:
        TypeError: If a field is not a real number, or a count (``counter``, ``period``) is
            not an integer (a float with a whole value is accepted; a traced float is not).
        ValueError: If a field is not a scalar; if ``loss_scale``, ``factor`` or
            ``min_loss_scale`` is not finite in float32, or not positive (``min_loss_scale``
            may be 0); if a count is fractional, below its minimum or beyond int32; if
            ``factor`` is not greater than 1; if ``loss_scale`` is below ``min_loss_scale``.

    Example:
        >>> import autocast, dataclasses, jax.numpy as jnp
        >>> ls = autocast.DynamicLossScale(2.0**15, period=2)
        >>> grads = ls.unscale(jnp.ones(2, jnp.float16) * 2**10)
        >>> ls = ls.adjust(autocast.all_finite(grads)).adjust(jnp.bool_(True))
        >>> ls.loss_scale, ls.counter
        (Array(65536., dtype=float32), Array(0, dtype=int32))
        >>> ls.adjust(jnp.bool_(False)).loss_scale
        Array(32768., dtype=float32)
        >>> dataclasses.replace(ls, loss_scale=4.0) == autocast.DynamicLossScale(4.0, period=2)
        True
    """

    loss_scale: jax.Array
    counter: jax.Array = 0  # type: ignore[assignment]
    period: jax.Array = 2000  # type: ignore[assignment]
    factor: jax.Array = 2  # type: ignore[assignment]
    min_loss_scale: jax.Array = 1.0  # type: ignore[assignment]

    def __post_init__(self) -> None:
        loss_scale = checked_scale(self.loss_scale, "loss_scale")
        min_loss_scale = checked_scale(self.min_loss_scale, "min_loss_scale", allow_zero=True)
        factor = checked_scale(self.factor, "factor")
        period = checked_count(self.period, "period", minimum=1)
        counter = checked_count(self.counter, "counter", minimum=0)
        f, lo, hi = (
            concrete_value(factor),
            concrete_value(min_loss_scale),
            concrete_value(loss_scale),
        )
        if f is not None and f <= 1:
            raise ValueError(f"factor must be greater than 1, got {f}")
        if lo is not None and hi is not None and hi < lo:
            raise ValueError(f"loss_scale ({hi}) is below min_loss_scale ({lo})")
        values = (loss_scale, counter, period, factor, min_loss_scale)
        for field, value in zip(dataclasses.fields(self), values):
            object.__setattr__(self, field.name, value)

    def adjust(self, grads_finite: jax.Array) -> DynamicLossScale:
        """The next state, given whether this step's gradients were all finite.

        Runs on device and may be traced; the rule is :func:`autocast.next_loss_scale`.

        Args:
            grads_finite: A boolean scalar, traced or not: whether this step's gradients were all
                finite, as :func:`autocast.all_finite` returns it.

        Returns:
            A new :class:`DynamicLossScale` with the new ``loss_scale`` and ``counter``; ``period``,
            ``factor`` and ``min_loss_scale`` are carried over.

        Raises:
            TypeError: If ``grads_finite`` is not a boolean scalar.
        """
        update = next_loss_scale(
            check_finite_flag(grads_finite),
            self.loss_scale,
            self.counter,
            self.period,
            self.factor,
            self.min_loss_scale,
        )
        return jax.tree_util.tree_unflatten(
            jax.tree_util.tree_structure(self),
            [update.loss_scale, update.counter, self.period, self.factor, self.min_loss_scale],
        )
