"""The 8-bit stored form of a float32 array: float8 e4m3 codes with one float32 scale per
block of elements along the last axis.

Why blocks, why the last axis, why e4m3, why square roots:

- One scale per block of a few hundred elements (256 by default) instead of one per array:
  a scale follows its block's largest magnitude, so a block of small values is not flushed
  to zero by a large value elsewhere in the array. It costs 4 bytes per block, 1/64 byte
  per element at 256.
- Blocks run along the last axis and never cross it: an array sharded on a leading axis
  (FSDP shards parameters, and so their optimizer state, on the first) splits along whole
  rows of blocks, and each device encodes and decodes its own shard without communication.
  The stored codes have the shape ``(..., blocks, block)``, the leading axes unchanged.
- float8 e4m3 (values up to 448, 3 mantissa bits, subnormals down to 2**-9) spans about 18
  octaves inside one block, where an 8-bit integer code spans 7: momentum and squared
  gradients within a row differ by more than 2**7.
- Adam's second moment ``nu`` is non-negative and holds squared gradients, so its values
  span twice the octaves of the gradients: a block whose gradients differ by 2**9 holds
  ``nu`` values 2**18 apart, beyond e4m3's reach, and the smallest would be stored as zero,
  which turns the next update ``mu / (sqrt(nu) + eps)`` into ``mu / eps``, a jump. Stored
  as its square root it spans the gradients' octaves again, and what Adam divides by is that
  square root anyway. ``root=True`` marks such an array: codes hold ``sqrt(x)``, and decoding
  squares them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from autocast._src.state import rounding

CODE_DTYPE = jnp.dtype(jnp.float8_e4m3fn)
_CODE_MAX = float(jnp.finfo(CODE_DTYPE).max)  # 448


@dataclasses.dataclass(frozen=True)
class BlockScaled:
    """An array stored as 8-bit float codes with one float32 scale per block of its last axis.

    A pytree (its codes and scales are the leaves; ``size`` and ``root`` are static), so
    ``jax.jit``, ``jax.tree_util`` and orbax checkpoints carry it as they carry arrays.
    :func:`autocast.optax.low_precision_state` stores an optimizer's floating-point state in
    this form when given ``jnp.float8_e4m3fn``.

    Attributes:
        codes: ``float8_e4m3fn`` codes of shape ``(*leading, blocks, block)``: the values
            divided by their block's scale (square roots of them where ``root``), the last
            block padded with zeros.
        scales: float32 scales of shape ``(*leading, blocks)``: each block's largest
            magnitude over 448, e4m3's largest value (0 for a block of zeros).
        size: The length of the original last axis.
        root: Whether the codes hold square roots of the values (non-negative state such as
            Adam's ``nu``).

    Example:
        >>> import autocast.optax, jax.numpy as jnp, optax
        >>> tx = autocast.optax.low_precision_state(optax.adam(1e-3), jnp.float8_e4m3fn)
        >>> nu = tx.init({"w": jnp.ones((4, 1000))}).inner[0].nu["w"]
        >>> type(nu).__name__, nu.codes.shape, nu.codes.dtype, nu.scales.shape, nu.root
        ('BlockScaled', (4, 4, 256), dtype(float8_e4m3fn), (4, 4), True)
    """

    codes: Any
    scales: Any
    size: int
    root: bool = False

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the array it stands for."""
        return (*self.codes.shape[:-2], self.size)

    @property
    def nbytes(self) -> int:
        """Bytes held: codes and scales."""
        return int(self.codes.size * self.codes.dtype.itemsize) + int(
            self.scales.size * self.scales.dtype.itemsize
        )


jax.tree_util.register_dataclass(
    BlockScaled, data_fields=["codes", "scales"], meta_fields=["size", "root"]
)


def layout(size: int, block_size: int) -> tuple[int, int]:
    """``(blocks, block)`` for a last axis of ``size``: one block when it fits, else blocks of
    ``block_size`` with the last one padded."""
    if size <= block_size:
        return 1, max(size, 1)
    return math.ceil(size / block_size), block_size


def encode(x: jax.Array, block_size: int, root: bool, bits: jax.Array | None) -> BlockScaled:
    """``x`` (float32, at least one axis) in 8 bits. ``bits``: one uint32 per code (shape
    ``(*leading, blocks, block)``) for stochastic rounding, or None for nearest."""
    x = x.astype(jnp.float32)
    size = x.shape[-1]
    blocks, block = layout(size, block_size)
    if root:
        x = jnp.sqrt(jnp.maximum(x, 0.0))
    pad = blocks * block - size
    if pad:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    x = x.reshape(*x.shape[:-1], blocks, block)
    amax = jnp.max(jnp.abs(x), axis=-1)
    scales = amax / _CODE_MAX
    safe = jnp.where(scales > 0, scales, 1.0)[..., None]
    codes = rounding.round_onto(x / safe, CODE_DTYPE, bits=bits).astype(CODE_DTYPE)
    return BlockScaled(codes, scales, size, root)


def decode(stored: BlockScaled) -> jax.Array:
    """The float32 array ``stored`` stands for."""
    x = stored.codes.astype(jnp.float32) * stored.scales[..., None]
    # the joined length written out: -1 cannot be inferred where a leading axis is empty
    x = x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])[..., : stored.size]
    return x * x if stored.root else x


def code_shape(shape: tuple[int, ...], block_size: int) -> tuple[int, ...]:
    """The shape of the codes of an array of ``shape``."""
    return (*shape[:-1], *layout(shape[-1], block_size))
