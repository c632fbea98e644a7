"""Which values and leaves count as arrays, floating or inexact: one answer for the package."""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

T = TypeVar("T")

# Python floats are left out on purpose: casting a hyper-parameter such as a learning rate
# that sits in a pytree would silently turn it into an array.
ARRAY_TYPES = (jax.Array, np.ndarray, np.generic)


def is_array(x: Any) -> bool:
    """A JAX or NumPy array, tracer or NumPy scalar."""
    return isinstance(x, ARRAY_TYPES)


@functools.lru_cache(maxsize=None)
def is_floating_dtype(dtype: Any) -> bool:
    """A real floating dtype (float16, bfloat16, float32, float8...). Cached: on the trace path."""
    return bool(jnp.issubdtype(dtype, jnp.floating))


@functools.lru_cache(maxsize=None)
def is_inexact_dtype(dtype: Any) -> bool:
    """A floating or complex dtype: what has gradients and can hold inf or NaN."""
    return bool(jnp.issubdtype(dtype, jnp.inexact))


def is_floating_array(x: Any) -> bool:
    """True for a JAX or NumPy array (or NumPy scalar) whose dtype is a real floating type."""
    return is_array(x) and is_floating_dtype(x.dtype)


def is_inexact_array(x: Any) -> bool:
    """True for an array whose dtype is floating or complex."""
    return is_array(x) and is_inexact_dtype(x.dtype)


def map_floating(fn: Callable[[Any], Any], tree: T) -> T:
    """Applies ``fn`` to the floating-point array leaves of ``tree``; other leaves pass through."""
    return jax.tree_util.tree_map(lambda x: fn(x) if is_floating_array(x) else x, tree)


def map_inexact(fn: Callable[[Any], Any], tree: T) -> T:
    """Applies ``fn`` to the floating-point and complex array leaves of ``tree`` (those that
    have gradients); other leaves pass through."""
    return jax.tree_util.tree_map(lambda x: fn(x) if is_inexact_array(x) else x, tree)
