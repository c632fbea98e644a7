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

from autocast._src.float32_bits import exponent, two_to

# The narrow dtypes a grid may be: parameters (bfloat16, float16) and stored state (float8).
NARROW = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float8_e4m3fn))
PARAMETER_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_F32_TINY_EXPONENT = -126  # float32's smallest normal: 2**-126
_SIGN = np.uint32(0x80000000)
_MAGNITUDE = np.uint32(0x7FFFFFFF)


def _bits(x: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)


def _pow2(e: jax.Array) -> jax.Array:
    """2**e in float32 for integers ``e``, clipped to float32's normal range [-126, 127]."""
    return two_to(jnp.clip(e, -126, 127))


def _subnormal_exponent(dtype: Any) -> int:
    """log2 of ``dtype``'s smallest subnormal: the spacing of its grid below its normals."""
    return int(np.log2(float(jnp.finfo(dtype).smallest_subnormal)))


def _finest_spacing_exponent(dtype: Any) -> int:
    """log2 of the narrowest spacing of ``dtype``'s grid, float32's subnormals left out."""
    return max(_subnormal_exponent(dtype), _F32_TINY_EXPONENT)


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

    The grid is computed in float32 and integer arithmetic alone, every operation exact: no
    value of ``dtype`` appears in the program. A conversion to ``dtype`` and back would be
    the rounding, but XLA on a GPU removes such a pair as excess precision
    (``xla_allow_excess_precision``, on by default), and the values came back unrounded.
    """
    dtype = jnp.dtype(dtype)
    info = jnp.finfo(dtype)
    x = x.astype(jnp.float32)
    finite = jnp.isfinite(x)
    a = jnp.where(finite, jnp.minimum(jnp.abs(x), float(info.max)), 0.0)
    floor = _finest_spacing_exponent(dtype)
    # bfloat16 reaches float32's subnormal range, whose arithmetic a CPU flushes to zero: tiny
    # magnitudes are scaled up by 2**64 (exactly; bfloat16's grid is the same up there) so
    # that no spacing or difference below is subnormal, and scaled back at the end.
    scaled = info.minexp == jnp.finfo(jnp.float32).minexp
    scale = jnp.where(a < float(2.0**-60), 64, 0) if scaled else 0
    if scaled:
        a = a * _pow2(scale)
    first = _pow2(floor + scale)  # the first grid point above 0
    # The spacing of the grid around v is 2**(exponent of v - mantissa bits), and below the
    # dtype's normal range that of its subnormals.
    subnormal = _subnormal_exponent(dtype) + scale

    def spacing_exponent(v: jax.Array, binade_below: jax.Array | int = 0) -> jax.Array:
        return jnp.maximum(exponent(v) - info.nmant - binade_below, subnormal)

    # the nearest grid value: a scaled to units of its spacing, rounded half to even
    e = spacing_exponent(a)
    n = lax.round(a * _pow2(-e), lax.RoundingMethod.TO_NEAREST_EVEN) * _pow2(e)
    # its neighbours; below the first normal value, 0 and that value
    e_n = spacing_exponent(n)
    power_of_two = (_bits(n) & 0x7FFFFF) == 0
    # above the largest value (bfloat16's max gives inf, float8's 448 gives 480) only where a
    # is that largest value: its chance of going up is then 0
    up = n + _pow2(e_n)
    down = n - _pow2(spacing_exponent(n, power_of_two.astype(jnp.int32)))
    below = n <= a
    tiny = a < first
    lo = jnp.where(tiny, 0.0, jnp.where(below, n, down))
    hi = jnp.where(tiny, first, jnp.where(below, up, n))
    if bits is None:
        magnitude = jnp.where(tiny, jnp.where(a > first / 2, first, 0.0), n)
    else:
        # hi - lo is a power of two: its reciprocal is exact, a division might not be
        chance = (a - lo) * _pow2(-exponent(hi - lo))
        magnitude = jnp.where(uniform24(bits) < chance, hi, lo)
    if scaled:
        magnitude = magnitude * _pow2(-scale)
    signed = lax.bitcast_convert_type(_bits(magnitude) | (_bits(x) & _SIGN), jnp.float32)
    return jnp.where(finite, signed, x)


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
