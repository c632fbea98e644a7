"""PRNG keys kept in an optimizer state: checked when given, stored as their raw uint32
data (a plain array, which every checkpoint library saves), rebuilt to be split."""

from __future__ import annotations

import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

ACCEPTED = "a PRNG key (jax.random.key(0) or jax.random.PRNGKey(0)) or an int seed"


class StoredKey:
    """A key as a transformation keeps it: its raw data, and the implementation that reads
    it (``None``: JAX's default, for keys made by ``jax.random.PRNGKey``)."""

    def __init__(self, key: Any, owner: str) -> None:
        self.owner = owner
        # Folded into each step's draw: a user who gives the same key to two transformations
        # (the state's rounding and the parameters') gets two streams of bits, not one.
        self.stream = zlib.crc32(owner.encode()) & 0x7FFFFFFF
        if key is None:
            raise TypeError(f"{owner} needs a key: {ACCEPTED}; got None")
        if isinstance(key, (bool, np.bool_)) or not isinstance(
            key, (int, np.integer, jax.Array, np.ndarray)
        ):
            raise TypeError(f"{owner}: key must be {ACCEPTED}; got {type(key).__name__}")
        if isinstance(key, (int, np.integer)):
            key = jax.random.key(int(key))
        if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
            if key.shape != ():
                raise ValueError(f"{owner}: key must be one key, got an array of shape {key.shape}")
            self.impl = jax.random.key_impl(key)
            self.data = jax.random.key_data(key)
        else:
            default = jax.random.key_data(jax.random.key(0)).shape
            if key.dtype != jnp.uint32 or key.shape != default:
                raise TypeError(
                    f"{owner}: key must be {ACCEPTED}; got an array of {key.dtype} with shape "
                    f"{key.shape} (a raw key is uint32 of shape {default})"
                )
            self.impl = None
            self.data = key

    def check(self, data: Any) -> None:
        """Refuses stored data this key's implementation cannot read."""
        if not hasattr(data, "shape") or data.shape != self.data.shape or data.dtype != jnp.uint32:
            raise ValueError(
                f"{self.owner}: the state's key is not a key of this transformation's kind "
                f"(uint32 of shape {self.data.shape}, got "
                f"{getattr(data, 'dtype', type(data).__name__)} of shape "
                f"{getattr(data, 'shape', '-')}): a state from another configuration"
            )

    def split(self, data: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(the next stored data, a typed key to draw this step's bits from, this
        transformation's own)."""
        self.check(data)
        key = jax.random.wrap_key_data(data, impl=self.impl)
        following, now = jax.random.split(key)
        return jax.random.key_data(following), jax.random.fold_in(now, self.stream)
