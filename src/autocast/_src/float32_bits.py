"""Powers of two in float32, read off and built from the bits: exact where ``frexp`` and
``exp2`` are not promised to be on every backend, and a few integer operations that XLA
fuses. The float8 scales (``fp8/products.py``) and the rounding of the training state onto
narrow grids (``state/rounding.py``) both compute with them."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

MANTISSA_BITS = 23
BIAS = 127


def exponent(v: Any) -> Any:
    """``floor(log2(v))`` of non-negative float32 ``v``, its exponent field unbiased: exact
    for normal values, -127 for zeros and subnormals, 128 for an infinity or NaN."""
    bits = jax.lax.bitcast_convert_type(v, jnp.uint32) >> MANTISSA_BITS
    return bits.astype(jnp.int32) - BIAS


def two_to(e: Any) -> Any:
    """``2**e`` in float32 for integers ``e`` in float32's normal range, -126 to 127."""
    return jax.lax.bitcast_convert_type((e + BIAS).astype(jnp.uint32) << MANTISSA_BITS, jnp.float32)
