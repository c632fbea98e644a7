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
    """Casts one value; NumPy constants are cast on the host so no device work is traced."""
    if x.dtype == dtype:
        return x
    if isinstance(x, (np.ndarray, np.generic)):
        with np.errstate(over="ignore"):  # -1e9 in float16 is -inf, as it is on a device
            return np.asarray(x).astype(dtype)
    if not _cast_memos:
        return _compat.convert(x, dtype)
    memo = _cast_memos[-1]
    key = (id(x), dtype)
    hit = memo.get(key)
    if hit is None:
        hit = memo[key] = (x, _compat.convert(x, dtype))
    return hit[1]
