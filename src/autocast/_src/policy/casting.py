"""Casting values for amp: which values may be cast, and one cast per value and dtype.

Integer, boolean and float64 values are never cast; NumPy constants are cast on the host, so
they cost no equation; within one jaxpr's evaluation a value cast twice to the same dtype is
cast once (:func:`cast_memo`).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

import jax.numpy as jnp
import numpy as np

from autocast import _compat

_F64 = np.dtype(np.float64)


@functools.lru_cache(maxsize=None)
def castable_dtypes(dtype: Any, original: Any) -> bool:
    return bool(
        jnp.issubdtype(dtype, jnp.floating)
        and dtype != _F64
        and jnp.issubdtype(original, jnp.floating)
        and original != _F64
    )


def castable(x: Any, original: Any) -> bool:
    """Floating-point, not float64, now and in the original program."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and castable_dtypes(dtype, original)


# One memo per jaxpr being evaluated (innermost last): a value used by several equations is
# cast once, not once per use. Entries hold the source value so its id stays unique.
_cast_memos: list[dict[tuple[int, Any], tuple[Any, Any]]] = []


@contextlib.contextmanager
def cast_memo() -> Iterator[None]:
    """Within this context, casting the same value to the same dtype twice reuses the cast."""
    _cast_memos.append({})
    try:
        yield
    finally:
        _cast_memos.pop()


def cast_value(x: Any, dtype: Any) -> Any:
    """Casts one value; NumPy constants are cast on the host so no device work is traced
    (float32's extremes among them stay finite: :func:`narrowed_constant`)."""
    if x.dtype == dtype:
        return x
    if isinstance(x, (np.ndarray, np.generic)):
        return narrowed_constant(x, dtype)
    if not _cast_memos:
        return _compat.convert(x, dtype)
    memo = _cast_memos[-1]
    key = (id(x), dtype)
    hit = memo.get(key)
    if hit is None:
        hit = memo[key] = (x, _compat.convert(x, dtype))
    return hit[1]


@functools.lru_cache(maxsize=None)
def _saturation(dtype: Any, target: Any) -> tuple[float, float, float] | None:
    """Where ``target``'s range is narrower than ``dtype``'s: its largest finite magnitude,
    the magnitude up to which a value beyond it only rounds away (one of its spacings at the
    top), and ``dtype``'s largest finite magnitude. Else None."""
    if not (jnp.issubdtype(target, jnp.floating) and jnp.issubdtype(dtype, jnp.floating)):
        return None
    info, source_max = jnp.finfo(target), float(jnp.finfo(dtype).max)
    highest = float(info.max)
    if highest >= source_max:
        return None
    return highest, highest * (1 + 2.0 ** -int(info.nmant)), source_max


def narrowed_constant(x: Any, dtype: Any) -> np.ndarray:
    """A constant of the program in ``dtype``, cast on the host. Two kinds of finite value
    beyond ``dtype``'s range become its finite extreme of the same sign, not an infinity:
    one within a spacing of that range (float32's extremes in bfloat16: a rounding, not an
    overflow), and the source dtype's own extremes, which programs write to mean "as low as
    it gets, but finite" (attention masks filled with ``finfo(float32).min``, ``nan_to_num``'s
    bounds: in 16 bits an infinity there turns a fully masked row's softmax into NaN). Any
    other value beyond the range overflows, as on a device (``x * 1e5`` in float16 is inf,
    which loss scaling sees), and infs and NaNs stay."""
    x = np.asarray(x)
    out = folded_cast(x, dtype)
    # every literal of every program passes here: look closer only where the cast overflowed
    if np.isfinite(out).all():
        return out
    bounds = _saturation(x.dtype, np.dtype(dtype))
    if bounds is None:
        return out
    highest, rounds, source_max = bounds
    wide = x.astype(np.float64)
    magnitude = np.abs(wide)
    kept = np.isfinite(magnitude) & (magnitude > highest)
    kept &= (magnitude <= rounds) | (magnitude >= source_max)
    return np.where(kept, np.sign(wide) * highest, out).astype(dtype) if kept.any() else out


def folded_cast(x: Any, dtype: Any) -> np.ndarray:
    """A cast the program wrote, of a constant, done on the host as the device would do it
    (``-1e9`` in float16 is -inf there too)."""
    with np.errstate(over="ignore"):
        return np.asarray(x).astype(dtype)
