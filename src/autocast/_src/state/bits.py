"""Random bits for stochastic rounding: one uint32 per element, from a PRNG key.

``jax.random.bits`` (threefry) costs about 38 ns an element on a CPU core, 17 times the
rounding it serves; a step of a 1 B-parameter model would spend most of its optimizer time
drawing them. So the key is used where JAX's generator is good and cheap, for two 32-bit
seeds per step, and each element's bits are a hash of those seeds and the element's
position in the tree: two rounds of a 32-bit integer mixer (Wellons' "lowbias32", a
bijection of uint32 whose output bits each flip with probability close to 1/2 when any
input bit does). An array's elements are numbered from its offset, the number of elements
of the arrays before it in the tree, so that no two elements of a tree share bits in a step
(up to 2**32 elements; beyond, positions repeat modulo 2**32).

One pair of seeds for the whole tree, not a pair per array: XLA fuses each array's rounding
into a kernel of its own, and a kernel that reads its own row of a table of seeds took a
CPU compiler several times as long as one that reads a shared pair, for the same program.
The position is computed from ``broadcasted_iota`` along each axis, which XLA's
partitioner gives each shard its own part of: the bits of an element do not depend on how
its array is sharded, and every process that holds a copy of an array draws the same bits
for it.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_M1 = 0x7FEB352D
_M2 = 0x846CA68B


def _mix(x: jax.Array) -> jax.Array:
    """lowbias32: a bijection of uint32 with good avalanche."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(_M1)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(_M2)
    return x ^ (x >> 16)


def positions(shape: tuple[int, ...]) -> jax.Array:
    """Each element's row-major position in an array of ``shape``, as uint32 (modulo 2**32),
    built from one iota per axis so that a sharded array computes only its shard's."""
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):
        iota = lax.broadcasted_iota(jnp.uint32, shape, axis)
        index = index + iota * jnp.uint32(stride % 2**32)
        stride *= shape[axis]
    return index


def seeds(key: Any) -> jax.Array:
    """A pair of uint32 seeds from ``key`` (a typed key): shape ``(2,)``."""
    return jax.random.bits(key, (2,), jnp.uint32)


def offsets(shapes: list[tuple[int, ...]]) -> list[int]:
    """Where each array of ``shapes`` begins when a tree's elements are numbered in order,
    modulo 2**32."""
    out, total = [], 0
    for shape in shapes:
        out.append(total % 2**32)
        total += math.prod(shape)
    return out


def element_bits(seed: jax.Array, shape: tuple[int, ...], offset: int = 0) -> jax.Array:
    """One uint32 per element of ``shape``, from a pair of uint32 seeds; the elements are
    numbered from ``offset`` (from :func:`offsets`)."""
    h = _mix((positions(shape) + np.uint32(offset % 2**32)) ^ seed[0])
    return _mix(h + seed[1])
