"""Float8 products with more than one scale per tensor.

- ``compute_dtype="fp8_rowwise"``: a scale per row of each operand along what the product
  contracts, so each output element is rescaled by its row's scale times its column's. An
  activation row a hundred times larger than the rest (an outlier token) then costs only its
  own row its precision, not the whole tensor's.
- ``compute_dtype="mxfp8"``: the OCP microscaling format, a power-of-two scale
  (``float8_e8m0fnu``) per 32 contracted elements, bound as ``jax.lax.scaled_dot``, which
  XLA gives to the block-scaled GEMMs of NVIDIA's Blackwell GPUs and decomposes (dequantise,
  then a 16-bit product) anywhere else.

Both run on one canonical form of a ``dot_general``: each operand laid out ``(batch, free,
contraction)`` as a 3-D array (JAX's transposes and reshapes, differentiated by JAX), so the
scales always run along the last axis. The backward products contract over other axes (the
output's columns for the input's gradient, its rows for the weight's), and a scale must
run along what its product contracts, so they quantise the operands afresh from the values
the forward pass kept: the residuals are the operands as they came (bfloat16 under amp), not
float8 codes. That is the price of the finer scales in memory; ``"fp8"`` keeps float8 codes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from autocast import _compat
from autocast._src.fp8 import numerics

# The elements one scale of MXFP8 covers (the OCP microscaling specification's block).
BLOCK = 32
_SCALE_FORMAT = np.dtype(jnp.float8_e8m0fnu)
# What every product of the canonical form contracts: the last axes, batched over the first.
_CANONICAL = (((2,), (2,)), ((0,), (0,)))

# jax.lax.scaled_dot arrived after the oldest JAX this package supports.
SCALED_DOT = getattr(jax.lax, "scaled_dot", None)


def _quantised(x: Any, fmt: np.dtype, block: int | None) -> tuple[Any, Any]:
    """``x`` (``(..., k)``) in ``fmt`` with a power-of-two scale per ``block`` elements of its
    last axis, or per whole last axis where ``block`` is None: ``(codes, scales)`` with
    ``scales`` of shape ``(..., k // block)``. The scale of a block is the power of two at or
    above its amax over the format's largest value, as the per-tensor recipe's is."""
    k = x.shape[-1]
    size = k if block is None else block
    blocks = x.astype(np.float32).reshape(*x.shape[:-1], k // size, size)
    amax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
    scale = numerics.scale_for(amax, float(jnp.finfo(fmt).max))
    return numerics.rounded(blocks, fmt, scale).reshape(x.shape), scale[..., 0]


def _rowwise_product(x: Any, y: Any, fmts: tuple, out_dtype: Any, exact: bool) -> Any:
    """``x @ y`` contracted over the last axes (``(b, m, k)`` by ``(b, n, k)``), each row
    of each operand quantised with its own scale; the float8 product accumulates in float32,
    written in the GEMM's dtype, and the output is multiplied by its row's and its
    column's scale (powers of two: exact while the results are normal numbers)."""
    (qx, sx), (qy, sy) = _quantised(x, fmts[0], None), _quantised(y, fmts[1], None)
    wide = numerics.gemm_dtype(out_dtype)
    precision = numerics.EXACT_SUMS if exact else None
    out = jax.lax.dot_general(qx, qy, _CANONICAL, precision=precision, preferred_element_type=wide)
    # both scales at once, in float32: multiplied one after the other in bfloat16, a large
    # row scale could overflow a result that the column's scale brings back into range
    joint = sx * jnp.swapaxes(sy, 1, 2)
    return (out.astype(np.float32) * joint).astype(out_dtype)


def _block_product(x: Any, y: Any, fmts: tuple, out_dtype: Any, exact: bool) -> Any:
    """``x @ y`` as :func:`_rowwise_product`, with a ``float8_e8m0fnu`` scale per
    :data:`BLOCK` contracted elements, through ``jax.lax.scaled_dot``."""
    del exact  # scaled_dot takes no precision: the block-scaled GEMMs sum in float32
    (qx, sx), (qy, sy) = _quantised(x, fmts[0], BLOCK), _quantised(y, fmts[1], BLOCK)
    wide = numerics.gemm_dtype(out_dtype)
    out = SCALED_DOT(
        qx,
        qy,
        lhs_scale=sx.astype(_SCALE_FORMAT),
        rhs_scale=sy.astype(_SCALE_FORMAT),
        dimension_numbers=_CANONICAL,
        preferred_element_type=wide,
    )
    return out.astype(out_dtype)


_PRODUCTS: dict[str, Callable[..., Any]] = {"row": _rowwise_product, "block": _block_product}


@dataclasses.dataclass(frozen=True)
class _Layout:
    """How one ``dot_general``'s operands become the canonical ``(batch, rows, contraction)``
    arrays and back: each operand's permutation and shape, and the output's shape."""

    a_order: tuple
    b_order: tuple
    a_shape: tuple
    b_shape: tuple
    sizes: tuple  # (batch, m, n, k)
    out_shape: tuple

    def canonical(self, a: Any, b: Any) -> tuple[Any, Any]:
        batch, m, n, k = self.sizes
        a3 = jnp.transpose(a, self.a_order).reshape(batch, m, k)
        return a3, jnp.transpose(b, self.b_order).reshape(batch, n, k)

    def back(self, x3: Any, order: tuple, shape: tuple) -> Any:
        """A canonical operand's gradient in the operand's own layout."""
        laid = x3.reshape(tuple(shape[d] for d in order))
        return jnp.transpose(laid, tuple(np.argsort(order)))


def _finer_product(recipe: Any, out_dtype: Any, layout: _Layout) -> Callable[[Any, Any], Any]:
    """The finer-scaled ``dot_general`` of operands laid out as ``layout`` says, in
    ``out_dtype``, with its custom derivative: the output gradient in the recipe's gradient
    format against each operand quantised afresh along what the backward product contracts.
    The layout's transposes and reshapes are inside, so the call is the product's one
    equation (``autocast.diagnose`` reads its dtype off it)."""
    multiply = _PRODUCTS[recipe.scaling]
    forward_formats = (recipe.forward, recipe.forward)
    gradient_formats = (recipe.gradient, recipe.forward)
    swap = lambda t: jnp.swapaxes(t, 1, 2)  # noqa: E731
    batch, m, n, _ = layout.sizes

    def forward(a: Any, b: Any) -> tuple[Any, Any]:
        a3, b3 = layout.canonical(a, b)
        # jax.lax.scaled_dot has no derivative of its own: a second derivative reaches the
        # residuals instead, where the backward pass's guard refuses it
        x, y = jax.lax.stop_gradient((a3, b3))
        out = multiply(x, y, forward_formats, out_dtype, False)
        return out.reshape(layout.out_shape), (a3, b3)

    def backward(residuals: tuple, g: Any) -> tuple[Any, Any]:
        (a3, b3), g = numerics.first_derivative_only((residuals, g))
        g3 = g.reshape(batch, m, n)
        # da (b, m, k) = g (b, m, n) . b (b, n, k), contracted over n
        da = multiply(g3, swap(b3), gradient_formats, a3.dtype, True)
        # db (b, n, k) = g (b, m, n) . a (b, m, k), contracted over m
        db = multiply(swap(g3), swap(a3), gradient_formats, b3.dtype, True)
        return (
            layout.back(da, layout.a_order, layout.a_shape),
            layout.back(db, layout.b_order, layout.b_shape),
        )

    product = jax.custom_vjp(lambda a, b: forward(a, b)[0])
    product.defvjp(forward, backward)
    return product


_cached_finer = functools.lru_cache(maxsize=256)(_finer_product)


def _order(shape: tuple, contracting: tuple, batch: tuple) -> tuple[tuple, tuple]:
    """(the permutation to ``batch, free, contracting``, the free dimensions)."""
    free = tuple(d for d in range(len(shape)) if d not in (*contracting, *batch))
    return (*batch, *free, *contracting), free


def _sizes(shape: tuple, dims: tuple) -> int:
    return math.prod(shape[d] for d in dims)


_EXPLICIT = getattr(getattr(jax.sharding, "AxisType", None), "Explicit", None)


def _explicitly_sharded(x: Any) -> bool:
    """Whether ``x``'s type carries a mesh of explicit axes (``jax.set_mesh``)."""
    mesh = getattr(getattr(_compat.aval_of(x), "sharding", None), "mesh", None)
    return _EXPLICIT is not None and _EXPLICIT in tuple(getattr(mesh, "axis_types", ()) or ())


def product_for(
    recipe: Any, params: dict, a: Any, b: Any, out_dtype: Any
) -> Callable[[Any, Any], Any] | None:
    """The finer-scaled ``dot_general`` of ``a`` and ``b`` with ``params`` under ``recipe``
    (``(a, b) -> output``), or None where it does not apply and the product takes one scale
    per tensor instead:

    - under a mesh of explicit axes: the canonical form transposes and reshapes the
      operands, and a sharded dimension may not survive that (a batch split over devices
      merged with the tokens);
    - for MXFP8, inside ``shard_map`` (``jax.lax.scaled_dot`` drops the axes its operands
      vary over, which the custom derivative must keep), and where a size a product of the
      step contracts is no multiple of :data:`BLOCK`: the forward product contracts the
      contraction, the backward ones the rows (tokens) and the columns (outputs).
    """
    if _explicitly_sharded(a) or _explicitly_sharded(b):
        return None
    if recipe.scaling == "block" and (_compat.varying_axes(a) or _compat.varying_axes(b)):
        return None
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    lc, rc, lb, rb = map(tuple, (lc, rc, lb, rb))
    a_order, a_free = _order(a.shape, lc, lb)
    b_order, b_free = _order(b.shape, rc, rb)
    batch, k = _sizes(a.shape, lb), _sizes(a.shape, lc)
    m, n = _sizes(a.shape, a_free), _sizes(b.shape, b_free)
    if recipe.scaling == "block" and any(size % BLOCK for size in (m, n, k)):
        return None
    out_shape = (
        *(a.shape[d] for d in lb),
        *(a.shape[d] for d in a_free),
        *(b.shape[d] for d in b_free),
    )
    layout = _Layout(a_order, b_order, tuple(a.shape), tuple(b.shape), (batch, m, n, k), out_shape)
    return numerics.memo(_cached_finer, _finer_product, recipe, np.dtype(out_dtype), layout)
