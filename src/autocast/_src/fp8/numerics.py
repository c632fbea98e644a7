"""What the float8 recipes share (:mod:`autocast._src.fp8.products` scales one per tensor,
:mod:`autocast._src.fp8.finer_scaling` per row or per block): power-of-two scales read off
float32's bits, the dtype a float8 GEMM writes, the backward products' exact sums, and the
guard that refuses a second derivative."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from autocast._src.float32_bits import MANTISSA_BITS

_F32 = np.dtype(np.float32)

# What everything but the scaled products runs in (the bfloat16 rules).
CARRIER = np.dtype(jnp.bfloat16)

TINY = float(jnp.finfo(_F32).tiny)


# float32's bit fields: an exponent of 8 bits above 23 of mantissa.
_MANTISSA = (1 << MANTISSA_BITS) - 1
_EXPONENT_FIELD = 0xFF << MANTISSA_BITS


def power_of_two_at_or_above(v: Any) -> Any:
    """The smallest power of two at or above each positive float32 ``v`` (an infinity or
    NaN as it is), read off its bits: any mantissa bit carries into the exponent. Bit
    arithmetic, not ``frexp``, so that XLA has a few scalar operations to fuse and not a
    chain of kernels."""
    bits = jax.lax.bitcast_convert_type(v, jnp.uint32)
    up = jax.lax.bitcast_convert_type((bits + _MANTISSA) & _EXPONENT_FIELD, _F32)
    return jnp.where(jnp.isnan(v), v, up)


def memo(cached: Callable[..., Any], build: Callable[..., Any], *key: Any) -> Any:
    """``cached(*key)``, or ``build(*key)`` when a parameter in ``key`` cannot be hashed."""
    try:
        return cached(*key)
    except TypeError:
        return build(*key)


@jax.custom_jvp
def first_derivative_only(values: tuple) -> tuple:
    """The identity on the backward pass's inputs, refusing to be differentiated: through
    the float8 residuals, a second derivative would be rounded to float8 without a scale."""
    return values


@first_derivative_only.defjvp
def _refuse(primals: tuple, tangents: tuple) -> tuple:
    raise TypeError(
        "autocast's float8 products have first derivatives only (jax.grad, jax.vjp); a "
        "second derivative (jax.hessian, grad of grad, a Hessian-vector product) would pass "
        "through float8 values without a scale. Use compute_dtype=jnp.bfloat16 for it, or "
        "keep the products concerned out of float8 with a named scope in amp_policy"
    )


def gemm_dtype(out_dtype: Any) -> np.dtype:
    """What a float8 GEMM writes for a product wanted in ``out_dtype``: that dtype itself
    where it is bfloat16 or float32, so that no pass over the result follows the GEMM;
    float32 for float16, whose range the unscaled sums (448**2 a term in e4m3) overflow."""
    out = np.dtype(out_dtype)
    return out if out in (CARRIER, _F32) else _F32


# The backward products' precision. A float8 GEMM on Hopper with the default precision
# accumulates with fewer bits than float32 ("fast accumulation"): on an H200, 1024 products
# of 448 x 448 summed to 1012 x 448**2, where HIGHEST gave the exact 1024 x 448**2 for 14%
# more time on an 8192x1024x4096 GEMM. The backward products contract over the tokens
# (thousands of terms), so they take the exact sums, as Transformer Engine's do; the forward
# products keep the fast ones, as Transformer Engine's forward does.
EXACT_SUMS = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)


def scale_for(amax: Any, top: float) -> Any:
    """The power-of-two scale for values of largest magnitude ``amax`` (any shape: one per
    tensor, row or block) in a format whose largest value is ``top``: the power of two at or
    above ``amax / top``, never below float32's smallest normal number (a subnormal scale
    would flush to zero and divide zeros into NaN)."""
    return power_of_two_at_or_above(jnp.maximum(amax / top, TINY))


def rounded(x: Any, fmt: Any, scale: Any) -> Any:
    """``x / scale`` rounded to the float8 format ``fmt``, saturating at its largest value."""
    top = float(jnp.finfo(np.dtype(fmt)).max)
    return jnp.clip(x.astype(_F32) / scale, -top, top).astype(fmt)
