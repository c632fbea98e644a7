"""Rounding float32 values onto a narrow float grid, to nearest or stochastically, and the
float32 update that lands a parameter exactly on its rounded value.

The grids
---------
``round_onto(x, dtype)`` rounds onto the values of ``dtype`` (bfloat16, float16 or
float8_e4m3fn) that are zero or float32-normal: values below float32's smallest normal,
2**-126, are left out of the grid, because XLA on a CPU flushes them to zero in arithmetic
(FTZ/DAZ) while GPUs keep them, and a rounding that must land the same everywhere cannot
use them. Only bfloat16 has values there; float16 and float8 are unaffected.

Stochastic rounding picks the upper neighbour ``hi`` of ``x`` with probability
``(x - lo) / (hi - lo)``, comparing that ratio with 24 random bits: the probability is exact
wherever the ratio has at most 24 fractional bits, which holds for bfloat16 (16), float16
(13) and float8 (20) grids, and for the step from 0 to the first grid point its error is at
most 2**-24 of that step. So the expected rounded value is ``x`` itself.

Landing exactly
---------------
``landing_update(r, p)`` returns ``d = r - p`` in float32 (``-0.0`` where ``r`` is ``p``),
so that ``optax.apply_updates``, which computes ``(p + d).astype(p.dtype)`` in float32,
lands on ``r`` bit for bit, where ``r`` rounds ``x = p + u`` computed in float32. Why, with
``m`` the significant bits of the narrow dtype (8 for bfloat16, 11 for float16):

- exponents of ``r`` and ``p`` at most ``24 - m`` apart: ``r - p`` spans at most 24 bits, is
  exact in float32, and ``p + (r - p)`` is ``r``;
- ``|r|`` much larger: ``r - p`` rounds, by at most half a float32 spacing of ``r``, and the
  sum rounds back to ``r``, whose low float32 bits are zero (ties go to it);
- ``|r|`` much smaller, an update that cancels its parameter: ``x`` is then a multiple of
  ``p``'s float32 spacing 2**(e_p - 23) (``u`` is within a factor of 2 of ``-p``, so the sum
  is exact) below 2**(e_p - 23 + m), so it has fewer than ``m`` significant bits: it is a
  value of the grid, ``r = x``, and ``r - p`` fits 24 bits again.

A zero result is ``+0.0`` (as ``p + (-p)`` is in float32) unless ``p`` itself is a zero,
which it then keeps, sign included. ``tests/test_state_rounding.py`` checks all of this with
hypothesis over every exponent, zeros of both signs and subnormal inputs. Subnormal
parameters cannot keep their value through float32 arithmetic on a CPU (it reads them as
zero), so there the rounding reads them as zero too, and still lands where it says. For the
same reason an update smaller than 2**-126 cannot move a parameter on a CPU: where the
rounded value is that close to a normal parameter (bfloat16 parameters below 2**-119 only),
the parameter keeps its value on every platform, and Kahan's compensation keeps the update.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# The narrow dtypes a grid may be: parameters (bfloat16, float16) and stored state (float8).
NARROW = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float8_e4m3fn))
PARAMETER_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_F32_TINY_EXPONENT = -126  # float32's smallest normal: 2**-126
_SIGN = np.uint32(0x80000000)
_MAGNITUDE = np.uint32(0x7FFFFFFF)


def _bits(x: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)


def _float32_bits(v: float) -> int:
    return int(np.array(v, np.float32).view(np.uint32))


class _Grid:
    """What rounding onto one narrow dtype needs, in float32's terms: the mantissa bits a
    value of the dtype leaves zero (``drop``), where its normal values begin, the spacing
    below them, and the bits of its largest finite value."""

    def __init__(self, dtype: Any):
        info = jnp.finfo(dtype)
        self.drop = 23 - int(info.nmant)
        self.normal_bits = _float32_bits(2.0**info.minexp)
        # below the normal values the spacing is that of the dtype's subnormals, and never
        # below float32's smallest normal (float32's subnormals are left out of the grid)
        spacing = max(int(info.minexp) - int(info.nmant), _F32_TINY_EXPONENT)
        self.spacing = 2.0**spacing
        self.inverse_spacing = 2.0**-spacing
        self.max_bits = _float32_bits(float(info.max))


_GRIDS = {dtype: _Grid(dtype) for dtype in NARROW}


def uniform24(bits: jax.Array) -> jax.Array:
    """The top 24 of 32 random bits as a float32 uniform on [0, 1), in steps of 2**-24."""
    return (bits >> 8).astype(jnp.float32) * float(2.0**-24)


def round_onto(x: jax.Array, dtype: Any, *, bits: jax.Array | None = None) -> jax.Array:
    """``x`` (float32) rounded onto ``dtype``'s grid, returned as float32 values.

    Args:
        x: The values, float32.
        dtype: bfloat16, float16 or float8_e4m3fn.
        bits: One uint32 of random bits per element for stochastic rounding; None rounds to
            nearest (ties to even).

    Finite values beyond ``dtype``'s range saturate at its largest finite value; inf and
    NaN pass through.

    Where ``dtype`` has normal values, its grid is float32's with the low ``drop`` mantissa
    bits zero, so the rounding is integer arithmetic on the magnitude's bits (a carry into
    the exponent is the step to the next binade): adding ``2**drop - 1 - r``, with ``r`` the
    top ``drop`` random bits, and clearing the low bits goes up exactly when ``r`` is below
    the low bits, with probability their value over the spacing. Below the normal values
    the spacing is fixed, and the magnitude in units of it is split into its integer and
    fractional parts, exactly. No value of ``dtype`` appears in the program: a conversion to
    ``dtype`` and back would be the rounding, but XLA on a GPU removes such a pair as excess
    precision (``xla_allow_excess_precision``, on by default), and the values came back
    unrounded.
    """
    grid = _GRIDS[jnp.dtype(dtype)]
    x = x.astype(jnp.float32)
    b = _bits(x)
    magnitude = jnp.minimum(b & _MAGNITUDE, np.uint32(grid.max_bits))
    low = np.uint32((1 << grid.drop) - 1)
    if bits is None:
        carry = low >> 1
        normal = (magnitude + carry + ((magnitude >> grid.drop) & 1)) & ~low
    else:
        # (~bits) >> (32 - drop) is 2**drop - 1 - r for the top drop bits r
        normal = (magnitude + ((~bits) >> (32 - grid.drop))) & ~low
    # below the normal values: the magnitude in units of the spacing, split exactly; on a
    # CPU a float32 subnormal reads as zero here, as in all of its arithmetic
    units = lax.bitcast_convert_type(magnitude, jnp.float32) * grid.inverse_spacing
    if bits is None:
        whole = lax.round(units, lax.RoundingMethod.TO_NEAREST_EVEN)
    else:
        whole = jnp.floor(units)
        whole = whole + (uniform24(bits) < units - whole).astype(jnp.float32)
    small = _bits(whole * grid.spacing)
    rounded = jnp.where(magnitude < np.uint32(grid.normal_bits), small, normal)
    signed = lax.bitcast_convert_type(rounded | (b & _SIGN), jnp.float32)
    return jnp.where(jnp.isfinite(x), signed, x)


def landing_update(r: jax.Array, p: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(r, d)``: the rounded values with zeros made canonical, and the float32 update ``d``
    with which ``optax.apply_updates(p, d)`` lands on ``r`` bit for bit.

    A zero ``r`` becomes ``p`` where ``p`` is a zero of either sign and ``+0.0`` elsewhere
    (``p + (-p)`` is ``+0.0``); ``r`` becomes ``p`` where ``r - p`` would be below float32's
    smallest normal, 2**-126 (bfloat16 parameters below 2**-119, whose spacing is smaller),
    which a CPU flushes to zero; ``d`` is ``-0.0`` where ``r`` is ``p`` (so a ``-0.0``
    parameter stays ``-0.0``), ``r - p`` elsewhere.
    """
    p32 = p.astype(jnp.float32)
    r_zero = (_bits(r) & _MAGNITUDE) == 0
    p_zero = (_bits(p32) & _MAGNITUDE) == 0
    r = jnp.where(r_zero, jnp.where(p_zero, p32, 0.0), r)
    # A step between two normal values below 2**-119 can be smaller than 2**-126 itself: a
    # CPU flushes such an update to zero, so apply_updates would leave p where it was while
    # the caller (Kahan's compensation) counts on r. The parameter keeps its value there on
    # every platform instead.
    smallest_normal = 2.0**_F32_TINY_EXPONENT
    tiny = (jnp.abs(p32) >= smallest_normal) & (jnp.abs(r - p32) < smallest_normal)
    r = jnp.where(tiny, p32, r)
    same = _bits(r) == _bits(p32)
    return r, jnp.where(same, jnp.float32(-0.0), r - p32)
