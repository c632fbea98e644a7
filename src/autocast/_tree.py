"""Pytree helpers shared by the casting and scaling code: which leaves count as floating."""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

T = TypeVar("T")

# Python floats are left alone on purpose: casting a hyper-parameter such as a learning rate
# that sits in a pytree would silently turn it into an array.
_ARRAY_TYPES = (jax.Array, np.ndarray, np.generic)


def is_floating_array(x: Any) -> bool:
    """True for a JAX or NumPy array (or NumPy scalar) whose dtype is a real floating type."""
    return isinstance(x, _ARRAY_TYPES) and jnp.issubdtype(x.dtype, jnp.floating)


def map_floating(fn: Callable[[Any], Any], tree: T) -> T:
    """Applies ``fn`` to the floating-point array leaves of ``tree``; other leaves pass through."""
    return jax.tree_util.tree_map(lambda x: fn(x) if is_floating_array(x) else x, tree)
