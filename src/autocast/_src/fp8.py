"""Float8 matrix products: ``amp(fn, compute_dtype=jnp.float8_e4m3fn)``.

The recipe is a policy, not a second engine: the default table with its matrix-product rows
(``dot_general``, ``conv_general_dilated``) given :func:`use_fp8_precision`, and bfloat16 as
the compute dtype of everything else. A product under that rule quantises each operand with
*per-tensor current scaling*: its scale is ``amax / max`` of the float8 format, computed in
float32 inside the program from the tensor itself, so there is no state to thread through the
train step. Forward operands are stored in e4m3 (3 mantissa bits), the output gradient that
meets them in the backward products in e5m2 (2 mantissa bits, about 14 more binades: gradients
span a wider range than activations), the hybrid format of NVIDIA's Transformer Engine.
Products accumulate in float32 (``preferred_element_type``, which XLA maps to FP8 GEMMs on
GPUs that have them); the result is rescaled and carried on in bfloat16.

``jax.nn.scaled_dot_general`` is not used: it implements block scaling (MXFP8, NVFP4, one
scale per 32 elements), which needs contraction sizes divisible by the block and hardware
from NVIDIA's Blackwell generation on, and has no convolution.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from autocast import _compat
from autocast._src.policy.casting import castable
from autocast._src.policy.dtypes import canonicalize_float_dtype
from autocast._src.policy.precision import (
    CUSTOM_BINDINGS,
    PolicyKey,
    PrecisionFn,
    use_compute_precision,
)

_F32 = np.dtype(np.float32)

# What everything but the scaled products runs in (the bfloat16 rules).
CARRIER = np.dtype(jnp.bfloat16)

# Forward format -> the format of the output gradients in the backward products. e5m2
# forward means e5m2 everywhere; the "fnuz" formats (AMD's, no infinities, no -0) pair up.
GRADIENT_FORMAT: dict[np.dtype, np.dtype] = {
    np.dtype(jnp.float8_e4m3fn): np.dtype(jnp.float8_e5m2),
    np.dtype(jnp.float8_e5m2): np.dtype(jnp.float8_e5m2),
    np.dtype(jnp.float8_e4m3fnuz): np.dtype(jnp.float8_e5m2fnuz),
    np.dtype(jnp.float8_e5m2fnuz): np.dtype(jnp.float8_e5m2fnuz),
}
# Spellings of the default recipe, e4m3 forward and e5m2 gradients.
_NAMES = ("fp8", "float8")
ACCEPTED = ", ".join([*(repr(n) for n in _NAMES), *(d.name for d in GRADIENT_FORMAT)])

# The products the recipe scales, and those of them whose operands must share one dtype
# (JAX refuses a convolution of e5m2 by e4m3; a dot_general takes them).
PRODUCTS = frozenset({"dot_general", "conv_general_dilated"})
_SAME_OPERAND_DTYPES = frozenset({"conv_general_dilated"})


@dataclasses.dataclass(frozen=True)
class Recipe:
    """The float8 formats of one recipe: forward operands, and backward output gradients;
    whether batched products (attention's) run in float8 too, which by default they do
    not (see :func:`_pays_in_float8`); and the scaling: ``history`` 0 is per-tensor current
    scaling, a positive ``history`` is delayed scaling from that many past steps' amax
    (:mod:`autocast._src.fp8_history`). ``amp`` takes a recipe as its ``compute_dtype``."""

    forward: np.dtype
    gradient: np.dtype
    batched_products: bool = False
    history: int = 0


# One recipe per forward format.
RECIPES: dict[np.dtype, Recipe] = {f: Recipe(f, g) for f, g in GRADIENT_FORMAT.items()}
DEFAULT_RECIPE = RECIPES[np.dtype(jnp.float8_e4m3fn)]


def recipe_for(compute_dtype: Any) -> Recipe | None:
    """The recipe ``compute_dtype`` asks for, or None when it is not a float8 type.

    ``"fp8"``, ``"float8"`` and ``float8_e4m3fn`` give e4m3 forward and e5m2 gradients;
    ``float8_e5m2`` gives e5m2 for both; the ``fnuz`` variants likewise with their own pair.
    Anything that is no floating dtype at all is refused as ``amp`` refuses it.
    """
    if isinstance(compute_dtype, Recipe):
        if GRADIENT_FORMAT.get(compute_dtype.forward) != compute_dtype.gradient:
            raise ValueError(f"{compute_dtype} pairs formats no recipe pairs; accepted: {ACCEPTED}")
        if compute_dtype.history:
            raise ValueError(
                f"{compute_dtype}: delayed scaling takes its histories as an argument; use "
                "autocast.amp_fp8_delayed"
            )
        return compute_dtype
    if isinstance(compute_dtype, str) and compute_dtype.strip().lower() in _NAMES:
        return DEFAULT_RECIPE
    dtype = canonicalize_float_dtype(compute_dtype, what="compute_dtype")
    if dtype.itemsize != 1:
        return None
    recipe = RECIPES.get(dtype)
    if recipe is None:
        raise ValueError(
            f"compute_dtype {dtype.name} has no float8 recipe (its range or encoding suits no "
            "GPU's FP8 products)"
        )
    return recipe


_TINY = float(jnp.finfo(_F32).tiny)


def _scale(x: Any, top: float) -> Any:
    """Per-tensor current scale of ``x`` for a format whose largest value is ``top``:
    ``amax / top`` in float32, never
    below float32's smallest normal number (a subnormal scale would flush to zero and divide
    zeros into NaN). An empty tensor's amax is 0. A non-finite amax gives a non-finite scale
    on purpose: an overflow in the step must reach the loss scaler's check, not be clipped
    into range."""
    return jnp.maximum(amax(x) / top, _TINY)


def quantise(x: Any, fmt: Any) -> tuple[Any, Any]:
    """``x`` in the float8 format ``fmt`` with per-tensor current scaling: ``(q, scale)``
    with ``q * scale ≈ x``, ``q``'s largest magnitude the format's largest finite value.

    >>> import jax.numpy as jnp
    >>> from autocast._src.fp8 import quantise
    >>> q, s = quantise(jnp.array([1e-6, -2e-6, 4e-6]), jnp.float8_e4m3fn)
    >>> q.dtype, q.astype(jnp.float32).tolist(), round(float(s) * 1e6, 4)
    (dtype(float8_e4m3fn), [112.0, -224.0, 448.0], 0.0089)
    """
    fmt = np.dtype(fmt)
    top = float(jnp.finfo(fmt).max)
    s = _scale(x, top)
    return jnp.clip(x.astype(_F32) / s, -top, top).astype(fmt), s


def quantise_with(x: Any, fmt: Any, scale: Any) -> Any:
    """``x / scale`` in the float8 format ``fmt``, finite values saturating at the format's
    largest. An infinity of ``x`` stays one (NaN in a format without infinities), so an
    overflow upstream reaches the loss scaler's check instead of being clipped into range;
    a finite value never becomes one, however small ``scale`` is."""
    fmt = np.dtype(fmt)
    top = float(jnp.finfo(fmt).max)
    x32 = x.astype(_F32)
    return jnp.where(jnp.isinf(x32), x32, jnp.clip(x32 / scale, -top, top)).astype(fmt)


def amax(x: Any) -> Any:
    """The largest magnitude in ``x`` as a float32 scalar (0 for an empty tensor)."""
    return jnp.max(jnp.abs(x), initial=0).astype(_F32)


def _widened(params: Mapping[str, Any]) -> dict[str, Any]:
    """A product's parameters with float32 accumulation."""
    return {**params, "preferred_element_type": _F32}


def _frozen(params: Mapping[str, Any]) -> tuple:
    return tuple(sorted(params.items()))


def _transposed(prim: Any, frozen: tuple, a: Any, b: Any, which: int) -> Any:
    """The closed jaxpr of the product's transpose in operand ``which``, traced in float32
    on the abstract operands ``a`` and ``b`` (shape and, under an explicit mesh, sharding):
    ``(g, other) -> gradient of operand which``. JAX's own transposition rule writes it, so
    every dimension layout, dilation and feature grouping is covered; it is then evaluated on
    float8 values (:func:`_evaluate`)."""
    params = dict(frozen)
    out = jax.eval_shape(lambda a, b: prim.bind(a, b, **params), a, b)
    if which == 0:
        return jax.make_jaxpr(
            lambda g, b: jax.linear_transpose(lambda a: prim.bind(a, b, **params), a)(g)[0]
        )(out, b)
    return jax.make_jaxpr(
        lambda a, g: jax.linear_transpose(lambda b: prim.bind(a, b, **params), b)(g)[0]
    )(a, out)


_cached_transposed = functools.lru_cache(maxsize=512)(_transposed)


def _memo(cached: Callable[..., Any], build: Callable[..., Any], *key: Any) -> Any:
    """``cached(*key)``, or ``build(*key)`` when a parameter in ``key`` cannot be hashed."""
    try:
        return cached(*key)
    except TypeError:
        return build(*key)


@jax.custom_jvp
def _first_derivative_only(values: tuple) -> tuple:
    """The identity on the backward pass's inputs, refusing to be differentiated: through
    the float8 residuals, a second derivative would be rounded to float8 without a scale."""
    return values


@_first_derivative_only.defjvp
def _refuse(primals: tuple, tangents: tuple) -> tuple:
    raise TypeError(
        "autocast's float8 products have first derivatives only (jax.grad, jax.vjp); a "
        "second derivative (jax.hessian, grad of grad, a Hessian-vector product) would pass "
        "through float8 values without a scale. Use compute_dtype=jnp.bfloat16 for it, or "
        "keep the products concerned out of float8 with a named scope in amp_policy"
    )


# How a scaled float8 product is written for XLA. "direct": the product of the float8
# operands, accumulated in float32, then multiplied by both scales. "dequantised": each
# operand converted back and multiplied by its scale *before* the product, the form XLA's GPU
# compiler matches to a float8 GEMM that applies the scales itself and writes its output in
# the output dtype (no float32 result pass). Both compute the same products; which one a GPU
# runs faster is measured by benchmarks/fp8_gemm.py.
GEMM_FORMS = ("direct", "dequantised")
_GEMM_FORM = "direct"


def scaled_product(
    bind: Callable[..., Any], qa: Any, sa: Any, qb: Any, sb: Any, out_dtype: Any
) -> Any:
    """``bind(a, b)`` of the float8 values ``qa * sa`` and ``qb * sb``, in ``out_dtype``;
    ``bind`` accumulates in float32."""
    if _GEMM_FORM == "dequantised":
        return bind(qa.astype(_F32) * sa, qb.astype(_F32) * sb).astype(out_dtype)
    # one scale at a time: their product alone may leave float32's range
    return (bind(qa, qb) * sa * sb).astype(out_dtype)


# The backward products' precision. A float8 GEMM on Hopper with the default precision
# accumulates with fewer bits than float32 ("fast accumulation"): on an H200, 1024 products
# of 448 x 448 summed to 1012 x 448**2, where HIGHEST gave the exact 1024 x 448**2 for 14%
# more time on an 8192x1024x4096 GEMM. The backward products contract over the tokens
# (thousands of terms), so they take the exact sums, as Transformer Engine's do; the forward
# products keep the fast ones, as Transformer Engine's forward does.
_EXACT_SUMS = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)


def _evaluate(closed: Any, args: Sequence[Any], same_dtype: Any) -> Any:
    """Evaluates a transpose jaxpr on float8 operands. Its products accumulate in float32,
    exactly (:data:`_EXACT_SUMS`); for one that needs equal operand dtypes, both go to
    ``same_dtype``. The rest of the jaxpr only moves data (``rev``, ``transpose``) and follows
    its inputs' dtypes."""
    env = dict(zip(closed.jaxpr.invars, args))
    env.update(zip(closed.jaxpr.constvars, closed.consts))
    read = lambda v: _compat.literal_value(v) if isinstance(v, _compat.Literal) else env[v]  # noqa: E731
    for eqn in closed.jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        params = dict(eqn.params)
        if eqn.primitive.name in PRODUCTS:
            params = {**_widened(params), "precision": _EXACT_SUMS}
            if eqn.primitive.name in _SAME_OPERAND_DTYPES and invals[0].dtype.itemsize == 1:
                invals = [x.astype(same_dtype) for x in invals]
        outs = _compat.bind_equation(eqn, invals, params)
        outs = outs if eqn.primitive.multiple_results else [outs]
        env.update(zip(eqn.outvars, outs))
    (out,) = [read(v) for v in closed.jaxpr.outvars]
    return out


def _operand_gradients(
    prim: Any, wide: tuple, recipe: Recipe, dtypes: tuple[Any, Any], kept: tuple, gradient: tuple
) -> tuple[Any, Any]:
    """The backward products of a scaled float8 product: the quantised output gradient
    ``gradient = (qg, sg)`` against the float8 operands the forward pass kept,
    ``kept = (qa, sa, qb, sb)``, through JAX's own transposition of the product; rescaled and
    returned in the operands' dtypes ``dtypes``."""
    (qa, sa, qb, sb), (qg, sg) = kept, gradient
    a, b = _compat.abstract_like(qa, _F32), _compat.abstract_like(qb, _F32)
    to_a = _memo(_cached_transposed, _transposed, prim, wide, a, b, 0)
    to_b = _memo(_cached_transposed, _transposed, prim, wide, a, b, 1)
    da = scaled_product(
        lambda g, b: _evaluate(to_a, [g, b], recipe.gradient), qg, sg, qb, sb, dtypes[0]
    )
    db = scaled_product(
        lambda a, g: _evaluate(to_b, [a, g], recipe.gradient), qa, sa, qg, sg, dtypes[1]
    )
    return da, db


def _product(
    prim: Any, frozen: tuple, recipe: Recipe, dtypes: tuple[Any, Any], out_dtype: Any
) -> Callable[[Any, Any], Any]:
    """The scaled float8 product for one equation's parameters and dtypes, with its custom
    derivative: e5m2 output gradients against the e4m3 operands the forward pass kept (the
    residuals are the float8 operands, half of what a bfloat16 product keeps)."""
    params = _widened(dict(frozen))
    wide = _frozen(params)

    def forward(a: Any, b: Any) -> tuple[Any, Any]:
        (qa, sa), (qb, sb) = quantise(a, recipe.forward), quantise(b, recipe.forward)
        out = scaled_product(lambda a, b: prim.bind(a, b, **params), qa, sa, qb, sb, out_dtype)
        return out, (qa, sa, qb, sb)

    def backward(residuals: tuple, g: Any) -> tuple[Any, Any]:
        (qa, sa, qb, sb), g = _first_derivative_only((residuals, g))
        qg, sg = quantise(g, recipe.gradient)
        return _operand_gradients(prim, wide, recipe, dtypes, (qa, sa, qb, sb), (qg, sg))

    product = jax.custom_vjp(lambda a, b: forward(a, b)[0])
    product.defvjp(forward, backward)
    return product


_cached_product = functools.lru_cache(maxsize=1024)(_product)


# A history's inbox: the gradient with respect to it says what this step measured, in a form
# that stays right when gradients are *summed* (a history used by several calls, under vmap,
# over microbatches, or across the devices of a shard_map): each amax as a one-hot over the
# power of two at or above it, so a sum of them still shows the largest; and a count of the
# backward passes that wrote (its last column). Bin ``e + _BIN_OFFSET`` holds an amax in
# (2**(e-1), 2**e], for e from -149 to 128 (bin 0, a zero, is never written; an amax of
# 2**127 or more is bounded by 2**127, so saturates by up to a factor 2).
_BIN_OFFSET = 150
BINS = 279
INBOX = BINS + 1


def amax_bins(value: Any) -> Any:
    """The inbox row of one amax: its bin, and one use. An inf or NaN has no bin, and nor
    has a zero: an all-zero tensor (a masked batch) says nothing of the next one's range, so
    its history keeps the amaxes it had, as Transformer Engine keeps its scale."""
    mantissa, e = jnp.frexp(value)
    e = e - (mantissa == 0.5).astype(e.dtype)  # a power of two is its own bound
    k = jnp.where(value > 0, e + _BIN_OFFSET, 0)
    known = jnp.isfinite(value) & (value > 0)
    hot = jax.nn.one_hot(k, BINS, dtype=_F32) * known.astype(_F32)
    return jnp.concatenate([hot, jnp.ones((1,), _F32)])


def bins_bound(bins: Any) -> tuple[Any, Any]:
    """``(bound, any)`` of inbox bins (last axis): the power of two at or above the largest
    amax they hold (0 for a zero amax), and whether they hold one at all."""
    held = bins > 0
    k = jnp.max(jnp.where(held, jnp.arange(BINS), -1), axis=-1)
    e = jnp.clip(k - _BIN_OFFSET, -149, 127)  # 2**128 is no float32
    bound = jnp.where(k > 0, jnp.ldexp(jnp.ones_like(e, _F32), e), 0.0)
    return bound, jnp.any(held, axis=-1)


def _from_history(history: Any, fmt: Any) -> Any:
    """The delayed scale for ``fmt`` from an amax history: its largest entry over the
    format's largest value; 1 (Transformer Engine's first scale) while the history holds
    nothing above zero."""
    top = jnp.max(history)
    fmax = float(jnp.finfo(np.dtype(fmt)).max)
    return jnp.where(top > 0, jnp.maximum(top / fmax, _TINY), 1.0).astype(_F32)


def _delayed_product(
    prim: Any,
    frozen: tuple,
    recipe: Recipe,
    dtypes: tuple[Any, Any],
    out_dtype: Any,
    measuring: bool,
    delayed_rows: tuple[bool, bool, bool] = (True, True, True),
) -> Callable[[Any, Any, Any, Any], Any]:
    """The float8 product with *delayed* scaling: each operand, and the output gradient, is
    quantised with the scale its amax history gives (rows 0, 1 and 2 of ``history``, shape
    ``(3, n)``), so a quantisation no longer waits for a reduction over its own tensor and can
    fuse into the kernel that produces it. This step's amaxes are still taken (a reduction
    beside the quantisation, not before it) and come back as the gradient with respect to
    ``inbox`` (see :func:`amax_bins`), from which :meth:`Fp8History.advance` makes the next
    history. Measuring (``measuring=True``, for a first history) scales from this step's amax
    instead, and so does a row ``delayed_rows`` leaves out (one ``init`` could not measure)."""
    params = _widened(dict(frozen))
    wide = _frozen(params)

    def scale(x: Any, history: Any, i: int, fmt: Any) -> Any:
        if measuring or not delayed_rows[i]:
            return _scale(x, float(jnp.finfo(fmt).max))
        return _from_history(history[i], fmt)

    def forward(a: Any, b: Any, history: Any, inbox: Any) -> tuple[Any, Any]:
        sa, sb = scale(a, history, 0, recipe.forward), scale(b, history, 1, recipe.forward)
        qa, qb = quantise_with(a, recipe.forward, sa), quantise_with(b, recipe.forward, sb)
        out = scaled_product(lambda a, b: prim.bind(a, b, **params), qa, sa, qb, sb, out_dtype)
        return out, (qa, sa, qb, sb, history, inbox, amax(a), amax(b))

    def backward(residuals: tuple, g: Any) -> tuple[Any, Any, Any, Any]:
        *kept, inbox, amax_a, amax_b = residuals  # these only feed the inbox
        (qa, sa, qb, sb, history), g = _first_derivative_only((tuple(kept), g))
        sg = scale(g, history, 2, recipe.gradient)
        qg = quantise_with(g, recipe.gradient, sg)
        da, db = _operand_gradients(prim, wide, recipe, dtypes, (qa, sa, qb, sb), (qg, sg))
        measured = jnp.stack([amax_bins(v) for v in (amax_a, amax_b, amax(g))])
        # under shard_map, a replicated inbox's gradient must be replicated too: the sum over
        # devices, whose bins show the largest amax of any
        measured = _compat.invariant_like(measured, inbox)
        return da, db, jnp.zeros_like(history), measured

    product = jax.custom_vjp(lambda a, b, history, inbox: forward(a, b, history, inbox)[0])
    product.defvjp(forward, backward)
    return product


_cached_delayed_product = functools.lru_cache(maxsize=1024)(_delayed_product)


def _scaled(x: Any) -> bool:
    """A value the recipe quantises: floating, wider than 8 bits, not float64."""
    return castable(x, x.dtype) and np.dtype(x.dtype).itemsize > 1


# The smallest extent (columns, contraction) of a product that runs in float8. On an
# H200 with JAX 0.11.2, XLA hands a float8 dot with an extent below 16 to neither cuBLASLt
# nor Triton: it converts the float8 operands to float16, where the scaled values' products
# (448 x 448) overflow, so a 4x4 product of ones came out inf. 16 and above came out right.
MIN_EXTENT = 16


def _extents(eqn: Any) -> tuple[int, int, int]:
    """(rows, columns, contraction) of one product of a matrix product equation: for a
    ``dot_general`` the free and contracting sizes (batch dimensions left out), for a
    convolution the output's positions, its features and one output's contraction."""
    shapes = [tuple(v.aval.shape) for v in eqn.invars[:2]]
    p = eqn.params
    if eqn.primitive.name == "dot_general":
        (lc, rc), (lb, rb) = p["dimension_numbers"]
        (a, b) = shapes
        k = int(np.prod([a[d] for d in lc]))
        m = int(np.prod([a[d] for d in range(len(a)) if d not in (*lc, *lb)]))
        n = int(np.prod([b[d] for d in range(len(b)) if d not in (*rc, *rb)]))
        return m, n, k
    dn = p["dimension_numbers"]
    out = tuple(eqn.outvars[0].aval.shape)
    m = out[dn.out_spec[0]] * int(np.prod([out[d] for d in dn.out_spec[2:]]))
    kernel = shapes[1]
    k = kernel[dn.rhs_spec[1]] * int(np.prod([kernel[d] for d in dn.rhs_spec[2:]]))
    return m, kernel[dn.rhs_spec[0]], k


def _pays_in_float8(eqn: Any, recipe: Recipe) -> bool:
    """Whether a product runs in float8; the others run in the compute dtype.

    - A product whose columns or contraction (a layer's weight dimensions) are below
      :data:`MIN_EXTENT` gains nothing from float8 and, on a GPU, is not given to a float8
      GEMM at all (see there). Rows are not asked: they are the batch, which ``vmap`` and
      ``shard_map`` split, and the choice must be the same for one example, one device's
      shard and the whole batch (a float8 history made on the batch fits each of them).

    - A batched product (``dot_general`` with batch dimensions: attention's ``q @ k`` and
      ``p @ v``, one small product per head) is two activations multiplied, each quantised
      afresh on every call: on an H100 those quantisation passes cost more than float8 saves
      (GPT-2 medium: amp fp8 101 ms against amp bf16 77 ms per step), and Transformer
      Engine keeps them in 16 bits too.
    - cuDNN has no float8 grouped or depthwise convolution ("No supported configs" for
      ``feature_group_count`` 3 on an H100), and such a convolution is bound by memory, not
      arithmetic: its contraction is one group's channels.
    """
    p = eqn.params
    _, columns, contraction = _extents(eqn)
    if min(columns, contraction) < MIN_EXTENT:
        return False
    if eqn.primitive.name == "dot_general":
        (_, _), (lhs_batch, _) = p["dimension_numbers"]
        return recipe.batched_products or not lhs_batch
    return p.get("feature_group_count", 1) == 1 and p.get("batch_group_count", 1) == 1


def _binding(recipe: Recipe) -> Callable[[Any, Sequence[Any], dict, Any], Any]:
    def bind(eqn: Any, invars: Sequence[Any], params: dict, ctx: Any) -> Any:
        if (
            eqn.primitive.name not in PRODUCTS
            or not _pays_in_float8(eqn, recipe)
            or not all(_scaled(x) for x in invars[:2])
        ):
            return _compat.bind_equation(eqn, invars, params)
        a, b = invars
        out_dtype = params.get("preferred_element_type")
        if out_dtype is None:  # a convolution's default: its operands' dtype
            out_dtype = jnp.result_type(a, b)
        key = (eqn.primitive, _frozen(params), recipe, (a.dtype, b.dtype), np.dtype(out_dtype))
        # Delayed scaling where the caller threads histories and this product is in the
        # program itself (not inside a loop, a branch or a re-traced call, see
        # autocast._src.fp8_history); current scaling elsewhere.
        slots = ctx.fp8_history if recipe.history else None
        taken = None if slots is None else slots.take((3, recipe.history))
        if taken is None or not any(taken.measured):
            return _memo(_cached_product, _product, *key)(a, b)
        rows = tuple(taken.measured)
        delayed = _memo(_cached_delayed_product, _delayed_product, *key, slots.measuring, rows)
        return delayed(a, b, taken.history, taken.inbox)

    return bind


def use_fp8_precision(
    compute_dtype: Any, original_dtypes: Sequence[Any], *invars: Any, **bind_params: Any
) -> tuple[Sequence[Any], dict[str, Any]]:
    """Runs matrix products in float8, everything else as :func:`use_compute_precision`.

    A ``dot_general`` or ``conv_general_dilated`` under this rule quantises both operands to
    e4m3 with per-tensor current scaling, accumulates in float32, and returns the rescaled
    product in the compute dtype; its backward products take the output gradient in e5m2.
    ``amp(fn, compute_dtype="fp8")`` gives the matrix-product rows of the policy this rule;
    it can also be given to a named scope only, with a 16-bit compute dtype elsewhere.

    The casts are those of :func:`use_compute_precision`; the float8 product is evaluated when
    ``amp`` binds the equation. Batched products (attention's, one small product per head)
    and grouped or depthwise convolutions run in the compute dtype instead, and a product with
    an operand that is float64 or already 8-bit is bound unscaled. The float8 products have
    first derivatives only: differentiating them twice (``jax.hessian``, grad of grad) raises a
    ``TypeError``.

    Args:
        compute_dtype: The compute dtype ``amp`` runs under, a NumPy floating dtype.
        original_dtypes: The dtypes the original program gave the equation's inputs, one per
            value in ``invars``.
        *invars: The equation's input values as they arrive under ``amp``: arrays or tracers,
            possibly already 16-bit.
        **bind_params: The primitive's parameters, as the equation records them.

    Returns:
        The pair :func:`use_compute_precision` returns: ``invars`` as a tuple with each
        floating-point input cast to the compute dtype, and ``bind_params``.

    Example:
        >>> import autocast, jax, jax.numpy as jnp
        >>> policy = {**autocast.default_amp_policy, "mlp": autocast.use_fp8_precision}
        >>> def f(w, x):
        ...     with jax.named_scope("mlp"):
        ...         x = x @ w
        ...     return x @ w
        >>> r = autocast.report(f, compute_dtype=jnp.bfloat16, amp_policy=policy)(
        ...     jnp.ones((16, 16)), jnp.ones((16, 16)))
        >>> r.summary["fp8_flop_share"]
        {'forward': 0.5, 'backward': 0.5}
    """
    # The casts are the compute dtype's; the float8 product is the binding registered below.
    return use_compute_precision(compute_dtype, original_dtypes, *invars, **bind_params)


def _another_rule(recipe: Recipe) -> PrecisionFn:
    """:func:`use_fp8_precision` under another name: bindings are found by the rule."""

    @functools.wraps(use_fp8_precision)
    def rule(*args: Any, **kwargs: Any) -> tuple[Sequence[Any], dict[str, Any]]:
        return use_fp8_precision(*args, **kwargs)

    batched = ", batched products" if recipe.batched_products else ""
    delayed = f", history {recipe.history}" if recipe.history else ""
    rule.__name__ = rule.__qualname__ = (
        f"use_fp8_precision({recipe.forward.name}{batched}{delayed})"
    )
    return rule


# The precision function of each recipe, each with its binding; made on first use.
_RULES: dict[Recipe, PrecisionFn] = {DEFAULT_RECIPE: use_fp8_precision}
CUSTOM_BINDINGS[use_fp8_precision] = _binding(DEFAULT_RECIPE)


def rule_of(recipe: Recipe) -> PrecisionFn:
    """The precision function that runs ``recipe``'s products (registered with its binding)."""
    rule = _RULES.get(recipe)
    if rule is None:
        rule = _RULES[recipe] = _another_rule(recipe)
        CUSTOM_BINDINGS[rule] = _binding(recipe)
    return rule


def with_fp8_products(
    policy: Mapping[PolicyKey, PrecisionFn], recipe: Recipe
) -> dict[PolicyKey, PrecisionFn]:
    """``policy`` with each matrix-product primitive it runs in the compute dtype run by
    ``recipe`` instead. Rows that say something else (a user's float32 ``dot_general``) and
    named scopes are kept as they are."""
    fp8_rule = rule_of(recipe)
    changed = dict(policy)
    for name in PRODUCTS:
        prim = _compat.primitive_by_name(name)
        if prim is not None and changed.get(prim) is use_compute_precision:
            changed[prim] = fp8_rule
    return changed
