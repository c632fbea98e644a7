"""Float8 matrix products: ``amp(fn, compute_dtype=jnp.float8_e4m3fn)``.

The recipe is a policy, not a second engine: the default table with its matrix-product rows
(``dot_general``, ``conv_general_dilated``) given :func:`use_fp8_precision`, and bfloat16 as
the compute dtype of everything else. A product under that rule quantises each operand with
*per-tensor current scaling*: its scale is the power of two at or above ``amax / max`` of the
float8 format, computed in float32 inside the program from the tensor itself, so there is no
state to thread through the train step. Forward operands are stored in e4m3 (3 mantissa
bits), the output gradient that meets them in the backward products in e5m2 (2 mantissa bits,
about 14 more binades: gradients span a wider range than activations), the hybrid format of
NVIDIA's Transformer Engine. Products accumulate in float32 and write bfloat16
(``preferred_element_type``), multiplied by the product of the two scales, which XLA folds
into the FP8 GEMM of GPUs that have one (:func:`scaled_product`); bfloat16 carries it on.

Two recipes scale more finely (:mod:`autocast._src.fp8.finer_scaling`): ``"fp8_rowwise"``, a
scale per row of each operand, and ``"mxfp8"``, a scale per 32 contracted elements (block
scaling, for NVIDIA's Blackwell GPUs). ``jax.nn.scaled_dot_general`` is not used for the
latter: on a CPU it has no lowering, so its numerics could not be checked there.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from autocast import _compat
from autocast._src.float32_bits import exponent, two_to
from autocast._src.fp8 import finer_scaling
from autocast._src.fp8.numerics import (
    CARRIER,
    EXACT_SUMS,
    first_derivative_only,
    gemm_dtype,
    memo,
    rounded,
    scale_for,
)
from autocast._src.policy.casting import castable
from autocast._src.policy.dtypes import canonicalize_float_dtype
from autocast._src.policy.precision import (
    CUSTOM_BINDINGS,
    PolicyKey,
    PrecisionFn,
    use_compute_precision,
)
from autocast._src.policy.target import Target

_F32 = np.dtype(np.float32)


# Forward format -> the format of the output gradients in the backward products. e5m2
# forward means e5m2 everywhere (refused on NVIDIA's GPUs: see float8_refusal); the
# "fnuz" formats (AMD's, no infinities, no -0) pair up.
GRADIENT_FORMAT: dict[np.dtype, np.dtype] = {
    np.dtype(jnp.float8_e4m3fn): np.dtype(jnp.float8_e5m2),
    np.dtype(jnp.float8_e5m2): np.dtype(jnp.float8_e5m2),
    np.dtype(jnp.float8_e4m3fnuz): np.dtype(jnp.float8_e5m2fnuz),
    np.dtype(jnp.float8_e5m2fnuz): np.dtype(jnp.float8_e5m2fnuz),
}
# Spellings of the default recipe, e4m3 forward and e5m2 gradients.
_NAMES = ("fp8", "float8")
# How a recipe scales its dot_general operands: one scale per tensor, per row (along what the
# product contracts), or per block of 32 contracted elements (MXFP8). Convolutions take one
# scale per tensor in every recipe.
SCALINGS = ("tensor", "row", "block")

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
    (:mod:`autocast._src.fp8.history`); and how finely the ``dot_general`` operands are
    scaled (:data:`SCALINGS`). ``amp`` takes a recipe as its ``compute_dtype``."""

    forward: np.dtype
    gradient: np.dtype
    batched_products: bool = False
    history: int = 0
    scaling: str = "tensor"


# One recipe per forward format.
RECIPES: dict[np.dtype, Recipe] = {f: Recipe(f, g) for f, g in GRADIENT_FORMAT.items()}
_E4M3 = np.dtype(jnp.float8_e4m3fn)
DEFAULT_RECIPE = RECIPES[_E4M3]
# A scale per row keeps the hybrid formats. With a scale per 32 elements, e4m3's range is
# ample for gradients too: e4m3 everywhere, as the MX recipes of Transformer Engine and of
# jax.nn.scaled_dot_general default to.
FINER_RECIPES: dict[str, Recipe] = {
    "fp8_rowwise": Recipe(_E4M3, GRADIENT_FORMAT[_E4M3], scaling="row"),
    "mxfp8": Recipe(_E4M3, _E4M3, scaling="block"),
}
ACCEPTED = ", ".join(
    [*(repr(n) for n in (*_NAMES, *FINER_RECIPES)), *(d.name for d in GRADIENT_FORMAT)]
)
_FOR_FLOAT8 = f"accepted for float8 matrix products: {ACCEPTED}"
# A named recipe -> its name, for the refusals.
_RECIPE_NAMES = {DEFAULT_RECIPE: "fp8", **{r: n for n, r in FINER_RECIPES.items()}}


def _pairs_formats(recipe: Recipe) -> bool:
    """Whether ``recipe``'s forward and gradient formats are a pair some recipe uses."""
    if recipe.scaling == "block":
        return recipe.forward == recipe.gradient == _E4M3
    return GRADIENT_FORMAT.get(recipe.forward) == recipe.gradient


def _available(recipe: Recipe) -> Recipe:
    """``recipe``, refused where the installed JAX cannot bind its products."""
    if recipe.scaling == "block" and finer_scaling.SCALED_DOT is None:
        raise ValueError(
            f"compute_dtype 'mxfp8' binds jax.lax.scaled_dot, which JAX {jax.__version__} "
            "does not have; upgrade JAX, or use compute_dtype='fp8_rowwise' or 'fp8'"
        )
    return recipe


def recipe_for(compute_dtype: Any) -> Recipe | None:
    """The recipe ``compute_dtype`` asks for, or None when it is not a float8 type.

    ``"fp8"``, ``"float8"`` and ``float8_e4m3fn`` give e4m3 forward and e5m2 gradients;
    ``"fp8_rowwise"`` the same formats with a scale per row, ``"mxfp8"`` e4m3 throughout with
    a scale per 32 elements (:mod:`autocast._src.fp8.finer_scaling`);
    ``float8_e5m2`` gives e5m2 for both (which ``amp`` refuses on an NVIDIA GPU, see
    :func:`float8_refusal`); the ``fnuz`` variants likewise with their own pair.
    Anything that is no floating dtype at all is refused as ``amp`` refuses it.
    """
    if isinstance(compute_dtype, Recipe):
        if compute_dtype.scaling not in SCALINGS:
            raise ValueError(
                f"{compute_dtype}: scaling {compute_dtype.scaling!r} is none of {SCALINGS}"
            )
        if not _pairs_formats(compute_dtype):
            needs = (
                "a block-scaled recipe takes float8_e4m3fn for both"
                if compute_dtype.scaling == "block"
                else f"accepted: {ACCEPTED}"
            )
            raise ValueError(f"{compute_dtype} pairs formats no recipe pairs; {needs}")
        if compute_dtype.history:
            raise ValueError(
                f"{compute_dtype}: delayed scaling takes its histories as an argument; use "
                "autocast.amp_fp8_delayed"
            )
        return _available(compute_dtype)
    if isinstance(compute_dtype, str):
        name = compute_dtype.strip().lower().replace("-", "_")
        if name in _NAMES:
            return DEFAULT_RECIPE
        if name in FINER_RECIPES:
            return _available(FINER_RECIPES[name])
    try:
        dtype = canonicalize_float_dtype(compute_dtype, what="compute_dtype")
    except (TypeError, ValueError) as e:
        raise type(e)(f"{e}; {_FOR_FLOAT8}") from None
    if dtype.itemsize != 1:
        return None
    recipe = RECIPES.get(dtype)
    if recipe is None:
        raise ValueError(
            f"compute_dtype {dtype.name} has no float8 recipe (its range or encoding suits no "
            f"GPU's FP8 products); {_FOR_FLOAT8}"
        )
    return recipe


def _scale(x: Any, top: float) -> Any:
    """Per-tensor current scale of ``x`` for a format whose largest value is ``top``: the
    power of two at or above ``amax / top``, in float32, and never below float32's smallest
    normal number (a subnormal scale would flush to zero and divide zeros into NaN).

    A power of two, so that dividing by it is exact (the float8 rounding is the only one)
    and so that it stays exact when XLA hands it to the GEMM rounded to the output's 16 bits
    (:func:`scaled_product`). It costs at most one binade of the format's range: the largest
    magnitude lands in ``(top / 2, top]``, not on ``top``. An empty tensor's amax is 0. A
    non-finite amax gives a non-finite scale on purpose: an overflow in the step must reach
    the loss scaler's check, not be clipped into range."""
    return scale_for(amax(x), top)


def quantise(x: Any, fmt: Any) -> tuple[Any, Any]:
    """``x`` in the float8 format ``fmt`` with per-tensor current scaling: ``(q, scale)``
    with ``q * scale ≈ x``, the scale a power of two, ``q``'s largest magnitude above half
    the format's largest finite value.

    >>> import jax.numpy as jnp
    >>> from autocast._src.fp8.products import quantise
    >>> q, s = quantise(jnp.array([0.5, -1.5, 3.0]), jnp.float8_e4m3fn)
    >>> q.dtype, q.astype(jnp.float32).tolist(), float(s) == 2.0**-7
    (dtype(float8_e4m3fn), [64.0, -192.0, 384.0], True)
    """
    fmt = np.dtype(fmt)
    top = float(jnp.finfo(fmt).max)
    s = _scale(x, top)
    return rounded(x, fmt, s), s


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
    """A product's parameters with a float32 result, as its transposes are traced."""
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


# How a scaled float8 product is written for XLA; benchmarks/gpu_plan.py shows what XLA's GPU
# compiler makes of each. "direct": the product of the float8 operands, written by the GEMM in
# the result's dtype (bfloat16) and multiplied by one scalar, the product of the two scales.
# XLA's cuBLASLt rewriter takes that one multiply into the float8 GEMM as its scale operand
# (one only: a second multiply would stay a pass over the result), and a Triton GEMM fusion
# takes it into its epilogue, so no kernel follows the GEMM with Triton GEMM fusions on or
# off. "dequantised": each operand converted to bfloat16 and multiplied by its scale *before*
# the product, which XLA's cuBLASLt rewriter matches to a float8 GEMM with each scale an
# operand of its own; but with Triton GEMM fusions on, XLA gives that bfloat16 dot to Triton
# as it is, and no float8 product is left (planned for an H200, JAX 0.10.2). Both compute the
# same products.
GEMM_FORMS = ("direct", "dequantised")
_GEMM_FORM = "direct"

# The exponent of float32's (and bfloat16's) smallest normal number. The GEMM applies the
# product of two scales as one float32; below this it would be subnormal, rounded, and
# flushed to zero by a GPU's epilogue.
_LOWEST_EXPONENT = -126


def _balanced(sa: Any, sb: Any) -> tuple[Any, Any]:
    """Two operands' power-of-two scales (each at least float32's smallest normal number),
    raised together where their product would fall below float32's normal numbers (both
    operands' amaxes near 1e-17, or one far smaller): each operand then gives up half the
    missing binades at the bottom of its range, instead of the product coming out zero.
    Otherwise they are returned as they are."""
    missing = jnp.maximum(_LOWEST_EXPONENT - exponent(sa) - exponent(sb), 0)
    half = missing // 2
    return sa * two_to(missing - half), sb * two_to(half)


def _raised(sg: Any, sa: Any, sb: Any) -> Any:
    """The output gradient's scale ``sg``, raised where its product with an operand's scale
    would fall below float32's normal numbers (see :func:`_balanced`; the operands are
    already quantised, so only the gradient can give)."""
    lowest = _LOWEST_EXPONENT - jnp.minimum(exponent(sa), exponent(sb))
    return jnp.maximum(sg, two_to(jnp.maximum(lowest, _LOWEST_EXPONENT)))


def _settled(*scales: Any) -> tuple:
    """``scales`` (float32 scalars) computed before anything reads them, so that XLA makes
    them in one small kernel. A Triton GEMM fusion takes float arithmetic into its epilogue
    but not the bit arithmetic of a power of two, and without the barrier XLA split each
    scale's arithmetic around the GEMMs into several scalar kernels: planned for GPT-2
    medium with Triton GEMM fusions on, 2628 kernels besides the GEMMs per step, 2144 with
    it, 2095 with the scales of before (not powers of two); the same 2338 in each with
    Triton off, where the joint scales are the GEMMs' own operands."""
    return jax.lax.optimization_barrier(scales)


def scaled_product(
    bind: Callable[..., Any],
    qa: Any,
    sa: Any,
    qb: Any,
    sb: Any,
    out_dtype: Any,
    joint: Any = None,
) -> Any:
    """``bind(a, b, dtype)`` of the float8 values ``qa * sa`` and ``qb * sb``, in
    ``out_dtype``; ``bind`` writes its product in ``dtype`` (accumulating in float32), and
    ``joint``, if given, is ``sa * sb`` as the caller computed it (:func:`_settled`).

    The scales are powers of two whose product is a normal float32 (:func:`_balanced`), so
    it stays exact as the bfloat16 scalar the GEMM's result is multiplied by, and on a CPU
    the program computes what the GPU's fused GEMM does. Past float32's range (both amaxes
    near 1e22) that product is infinite, and so is the result, or NaN where it is exactly
    zero: the step's overflow check sees it. A backward product's scaling follows the
    transposition JAX's rule puts after its ``dot_general``: XLA folds that transposition
    into the GEMM, and then the scaling (planned for GPT-2 medium: every layer's weight
    gradient; scaled before the transposition, their GEMMs wrote the transposed layout and
    kept the scaling out)."""
    wide = gemm_dtype(out_dtype)
    if _GEMM_FORM == "dequantised":
        dequantised = lambda q, s: q.astype(CARRIER) * s.astype(CARRIER)  # noqa: E731
        # without the barrier XLA computes a backward product's dequantised operand once with
        # the forward one, keeps it in bfloat16, and its GEMM has no float8 operand left
        qa, qb = jax.lax.optimization_barrier((qa, qb))
        return bind(dequantised(qa, sa), dequantised(qb, sb), wide).astype(out_dtype)
    joint = sa * sb if joint is None else joint
    return (bind(qa, qb, wide) * joint.astype(wide)).astype(out_dtype)


def _writing(prim: Any, params: Mapping[str, Any]) -> Callable[..., Any]:
    """``bind`` of :func:`scaled_product` for ``prim`` with ``params``."""
    return lambda a, b, dtype: prim.bind(a, b, **{**params, "preferred_element_type": dtype})


def _evaluate(closed: Any, args: Sequence[Any], same_dtype: Any, dtype: Any) -> Any:
    """Evaluates a transpose jaxpr on float8 operands. Its products write ``dtype`` and sum
    exactly (:data:`EXACT_SUMS`); for one that needs equal operand dtypes, both go to
    ``same_dtype``. The rest of the jaxpr only moves data (``rev``, ``transpose``) and follows
    its inputs' dtypes."""
    env = dict(zip(closed.jaxpr.invars, args))
    env.update(zip(closed.jaxpr.constvars, closed.consts))
    read = lambda v: _compat.literal_value(v) if isinstance(v, _compat.Literal) else env[v]  # noqa: E731
    for eqn in closed.jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        params = dict(eqn.params)
        if eqn.primitive.name in PRODUCTS:
            params = {**params, "preferred_element_type": dtype, "precision": EXACT_SUMS}
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
    ``gradient = (qg, sg, joints)`` against the float8 operands the forward pass kept,
    ``kept = (qa, sa, qb, sb)``, through JAX's own transposition of the product; rescaled by
    ``joints``, ``(sg * sb, sa * sg)``, and returned in the operands' dtypes ``dtypes``."""
    (qa, sa, qb, sb), (qg, sg, (to_a_joint, to_b_joint)) = kept, gradient
    a, b = _compat.abstract_like(qa, _F32), _compat.abstract_like(qb, _F32)
    to_a = memo(_cached_transposed, _transposed, prim, wide, a, b, 0)
    to_b = memo(_cached_transposed, _transposed, prim, wide, a, b, 1)
    to_da = lambda g, b, dt: _evaluate(to_a, [g, b], recipe.gradient, dt)  # noqa: E731
    to_db = lambda a, g, dt: _evaluate(to_b, [a, g], recipe.gradient, dt)  # noqa: E731
    da = scaled_product(to_da, qg, sg, qb, sb, dtypes[0], to_a_joint)
    db = scaled_product(to_db, qa, sa, qg, sg, dtypes[1], to_b_joint)
    return da, db


def _gradient_scales(sg: Any, sa: Any, sb: Any) -> tuple[Any, Any]:
    """The output gradient's scale, raised into range (:func:`_raised`), and the joint
    scales of the two backward products, settled together (:func:`_settled`)."""
    sg = _raised(sg, sa, sb)
    sg, to_a, to_b = _settled(sg, sg * sb, sa * sg)
    return sg, (to_a, to_b)


def _product(
    prim: Any, frozen: tuple, recipe: Recipe, dtypes: tuple[Any, Any], out_dtype: Any
) -> Callable[[Any, Any], Any]:
    """The scaled float8 product for one equation's parameters and dtypes, with its custom
    derivative: e5m2 output gradients against the e4m3 operands the forward pass kept (the
    residuals are the float8 operands, half of what a bfloat16 product keeps)."""
    params = dict(frozen)
    wide = _frozen(_widened(params))
    top = float(jnp.finfo(recipe.forward).max)

    def forward(a: Any, b: Any) -> tuple[Any, Any]:
        sa, sb = _balanced(_scale(a, top), _scale(b, top))
        sa, sb, joint = _settled(sa, sb, sa * sb)
        qa, qb = rounded(a, recipe.forward, sa), rounded(b, recipe.forward, sb)
        out = scaled_product(_writing(prim, params), qa, sa, qb, sb, out_dtype, joint)
        return out, (qa, sa, qb, sb)

    def backward(residuals: tuple, g: Any) -> tuple[Any, Any]:
        (qa, sa, qb, sb), g = first_derivative_only((residuals, g))
        sg, joints = _gradient_scales(_scale(g, float(jnp.finfo(recipe.gradient).max)), sa, sb)
        qg = rounded(g, recipe.gradient, sg)
        kept = (qa, sa, qb, sb)
        return _operand_gradients(prim, wide, recipe, dtypes, kept, (qg, sg, joints))

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
    """The delayed scale for ``fmt`` from an amax history: the power of two at or above its
    largest entry over the format's largest value, a power of two as current scaling's is
    (:func:`_scale`); 1 (Transformer Engine's first scale) while the history holds nothing
    above zero. The entries are powers of two at or above the amaxes, so the history's largest
    amax lands at or below 256 in e4m3 (32768 in e5m2), not 448 (57344)."""
    top = jnp.max(history)
    fmax = float(jnp.finfo(np.dtype(fmt)).max)
    scale = scale_for(top, fmax)
    return jnp.where(top > 0, scale, 1.0).astype(_F32)


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
    params = dict(frozen)
    wide = _frozen(_widened(params))

    def scale(x: Any, history: Any, i: int, fmt: Any) -> Any:
        if measuring or not delayed_rows[i]:
            return _scale(x, float(jnp.finfo(fmt).max))
        return _from_history(history[i], fmt)

    def forward(a: Any, b: Any, history: Any, inbox: Any) -> tuple[Any, Any]:
        sa, sb = scale(a, history, 0, recipe.forward), scale(b, history, 1, recipe.forward)
        sa, sb = _balanced(sa, sb)
        sa, sb, joint = _settled(sa, sb, sa * sb)
        qa, qb = quantise_with(a, recipe.forward, sa), quantise_with(b, recipe.forward, sb)
        out = scaled_product(_writing(prim, params), qa, sa, qb, sb, out_dtype, joint)
        return out, (qa, sa, qb, sb, history, inbox, amax(a), amax(b))

    def backward(residuals: tuple, g: Any) -> tuple[Any, Any, Any, Any]:
        *kept, inbox, amax_a, amax_b = residuals  # these only feed the inbox
        (qa, sa, qb, sb, history), g = first_derivative_only((tuple(kept), g))
        sg, joints = _gradient_scales(scale(g, history, 2, recipe.gradient), sa, sb)
        qg = quantise_with(g, recipe.gradient, sg)
        kept = (qa, sa, qb, sb)
        da, db = _operand_gradients(prim, wide, recipe, dtypes, kept, (qg, sg, joints))
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
    """(left free, right free, contraction) sizes of one product of a matrix product
    equation: for a ``dot_general`` the free and contracting sizes of each operand (batch
    dimensions left out), for a convolution the output's positions, its features and one
    output's contraction."""
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


def _weight_extent(eqn: Any, parameters: Sequence[bool]) -> int:
    """The free size of the product's weight: the dimensions ``vmap`` and ``shard_map`` do
    not split, whichever side the weight sits on.

    A convolution's weight is its kernel. A ``dot_general``'s weight is the operand that is
    an input of the function reached through data movement alone (a parameter, or its slice
    in a scan over layers) where the other is computed (an activation): ``x @ w`` and
    Equinox's per-example ``weight @ x`` decide alike. Where both or neither are (a first
    layer, whose input is the batch; a product of two activations), the layout names the
    weight (:func:`_weight_side`), and where it cannot, the smaller free size decides: never
    the batch alone, so that a layer with fewer than 16 outputs (``x (64, 32) @ w (32, 1)``)
    stays out of float8 at every batch size."""
    m, n, _ = _extents(eqn)
    if eqn.primitive.name != "dot_general":
        return n
    left, right = parameters[:2] if len(parameters) >= 2 else (False, False)
    side = (0 if left else 1) if left != right else _weight_side(eqn)
    return min(m, n) if side is None else (m, n)[side]


def _weight_side(eqn: Any) -> int | None:
    """Which operand of a ``dot_general`` is a layer's weight, read off the layout alone
    (0 the left, 1 the right, None where the layout does not say).

    - An operand with no free dimension says nothing: a one-output head's weight vector
      (``x @ w`` with ``w`` of shape ``(n,)``) and one example's features (``weight @ x``
      under ``vmap`` outside ``amp``) are laid out alike.
    - A weight is a matrix: beside an operand of more dimensions (tokens, positions), the
      matrix.
    - Two matrices: the one contracted on its first dimension is the weight of ``x @ w``
      (an example's features are its last dimension). Both contracted on their last says
      nothing: it is the product ``vmap`` makes of a per-example ``weight @ x`` (Equinox's
      Linear, the weight on the left) and also ``jnp.einsum("bi,oi->bo", x, w)`` (the
      weight on the right).
    """
    (lc, rc), (lb, _) = eqn.params["dimension_numbers"]
    shapes = [tuple(v.aval.shape) for v in eqn.invars[:2]]
    if lb or len(lc) != 1:
        return None
    free = [len(s) - 1 for s in shapes]
    if 0 in free:
        return None
    if free != [1, 1]:
        return free.index(1) if 1 in free else None
    first = [tuple(c) == (0,) for c in (lc, rc)]
    return first.index(True) if first[0] != first[1] else None


def _may_run_in_float8(eqn: Any, recipe: Recipe) -> bool:
    """Whether a product may run in float8 whatever its weight's size and its batch: it
    holds a float8 history then (see :func:`_binding`).

    - A product whose contraction (a layer's inputs) is below :data:`MIN_EXTENT` gains
      nothing from float8 and, on a GPU, may not be given to a float8 GEMM at all (see
      there).
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
    _, _, contraction = _extents(eqn)
    if contraction < MIN_EXTENT:
        return False
    if eqn.primitive.name == "dot_general":
        (_, _), (lhs_batch, _) = p["dimension_numbers"]
        return recipe.batched_products or not lhs_batch
    return p.get("feature_group_count", 1) == 1 and p.get("batch_group_count", 1) == 1


def _pays_in_float8(eqn: Any, recipe: Recipe, parameters: Sequence[bool] = ()) -> bool:
    """Whether a product runs in float8; the others run in the compute dtype: one that
    :func:`_may_run_in_float8`, whose weight's free size (a layer's outputs,
    :func:`_weight_extent`) is :data:`MIN_EXTENT` or more. The batch is not asked: ``vmap``
    and ``shard_map`` split it, and the choice must be the same for one example, one
    device's shard and the whole batch, whichever side of the product the batch sits on."""
    return _may_run_in_float8(eqn, recipe) and _weight_extent(eqn, parameters) >= MIN_EXTENT


def _binding(recipe: Recipe) -> Callable[..., Any]:
    # What a finer-scaled recipe's other products run: one scale per tensor, with "fp8"'s
    # formats (e4m3 gradients under one scale for a whole tensor would lose e5m2's range).
    per_tensor = dataclasses.replace(
        recipe, gradient=GRADIENT_FORMAT[recipe.forward], scaling="tensor"
    )

    def bind(
        eqn: Any, invars: Sequence[Any], params: dict, ctx: Any, parameters: Sequence[bool] = ()
    ) -> Any:
        if (
            eqn.primitive.name not in PRODUCTS
            or not _may_run_in_float8(eqn, recipe)
            or not all(_scaled(x) for x in invars[:2])
        ):
            return _compat.bind_equation(eqn, invars, params)
        a, b = invars
        out_dtype = params.get("preferred_element_type")
        if out_dtype is None:  # a convolution's default: its operands' dtype
            out_dtype = jnp.result_type(a, b)
        key = (eqn.primitive, _frozen(params), per_tensor, (a.dtype, b.dtype), np.dtype(out_dtype))
        # Delayed scaling where the caller threads histories and this product is in the
        # program itself (not inside a loop, a branch or a re-traced call, see
        # autocast._src.fp8.history); current scaling elsewhere.
        slots = ctx.fp8_history if recipe.history else None
        # every product that may run in float8 holds a history, so that one made on a batch
        # fits a program where the weight's size keeps this one in 16 bits (a first layer,
        # whose free size the batch may decide): it then measures nothing and is not read
        taken = None if slots is None else slots.take((3, recipe.history))
        if not _pays_in_float8(eqn, recipe, parameters):
            return _compat.bind_equation(eqn, invars, params)
        if recipe.scaling != "tensor":
            finer = eqn.primitive.name == "dot_general" and finer_scaling.product_for(
                recipe, params, a, b, out_dtype
            )
            if finer:
                return finer(a, b)
        if taken is None or not any(taken.measured):
            return memo(_cached_product, _product, *key)(a, b)
        rows = tuple(taken.measured)
        delayed = memo(_cached_delayed_product, _delayed_product, *key, slots.measuring, rows)
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
    scaled = "" if recipe.scaling == "tensor" else f", {recipe.scaling}wise scales"
    rule.__name__ = rule.__qualname__ = (
        f"use_fp8_precision({recipe.forward.name}{batched}{delayed}{scaled})"
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


# NVIDIA's float8 GEMMs start with Ada Lovelace and Hopper.
_NVIDIA_FLOAT8 = (8, 9)
# e5m2 x e5m2: every product of ``compute_dtype=jnp.float8_e5m2``, forward and backward.
_E5M2 = np.dtype(jnp.float8_e5m2)
# NVIDIA's block-scaled (MX) GEMMs start with Blackwell.
_NVIDIA_BLOCK_SCALED = (10, 0)


def float8_refusal(recipe: Recipe, target: Target) -> str | None:
    """Why ``recipe``'s products cannot run as float8 products on ``target``, or None where
    they can, or where the device is not known to lack them (a CPU converts every float8
    product, so its numerics can be studied there; an AMD GPU is not checked)."""
    named = _RECIPE_NAMES.get(recipe)
    asked = f"compute_dtype {recipe.forward.name}" + (f" (the {named!r} recipe)" if named else "")
    if target.multiplies(recipe.forward) is False:
        return (
            f"{asked} on a {target.kind}: its matrix units multiply bfloat16, not float8 (the "
            "first TPU with float8 products is Ironwood, TPU7x): the compiler widens float8 "
            "operands to float32 and multiplies them with float32 instructions, twice "
            "bfloat16's (benchmarks/tpu_products.py), slower than bfloat16 and less precise. "
            "Use compute_dtype=jnp.bfloat16 (amp's default there)"
        )
    capability = target.nvidia_capability
    if capability is None:
        return None
    if capability < _NVIDIA_FLOAT8:
        return (
            f"{asked} on an {target.kind} (compute capability {target.capability}): it has "
            "no float8 GEMMs (NVIDIA's start at compute capability 8.9, Ada Lovelace and "
            "Hopper), so XLA would widen each float8 operand and multiply in 16 bits. Use "
            "compute_dtype=jnp.bfloat16"
            + (" (amp's default there)" if capability >= (8, 0) else " or jnp.float16")
        )
    if recipe.scaling == "block" and capability < _NVIDIA_BLOCK_SCALED:
        # XLA decomposes a scaled_dot it has no block-scaled GEMM for: both operands
        # dequantised to the output's 16 bits, then a 16-bit GEMM
        return (
            f"{asked} on an {target.kind} (compute capability {target.capability}): it has "
            "no block-scaled float8 GEMMs (NVIDIA's start at compute capability 10.0, "
            "Blackwell), so XLA would dequantise each operand and multiply in bfloat16. Use "
            "compute_dtype='fp8' (a scale per tensor) or 'fp8_rowwise' (a scale per row): "
            "each product a float8 GEMM here"
        )
    if recipe.forward == recipe.gradient == _E5M2:
        # cuBLASLt multiplies e4m3 by e4m3 or by e5m2 but not e5m2 by e5m2: XLA gives such a
        # dot to a bfloat16 GEMM after converting both operands (planned for an H200 with
        # Triton GEMM fusions off; with them on, to a Triton kernel no GPU has measured).
        return (
            "compute_dtype float8_e5m2 multiplies e5m2 by e5m2 in every product, and an NVIDIA "
            "GPU has no float8 GEMM for that pair (cuBLASLt needs one e4m3 operand; XLA runs "
            "both to bfloat16 for its GEMM instead). Use compute_dtype='fp8' "
            "(float8_e4m3fn): e4m3 operands forward and e5m2 output gradients against them "
            "backward, each product a float8 GEMM"
        )
    return None


def check_runs_in_float8(recipe: Recipe, target: Target) -> None:
    """Refuses ``recipe`` where ``target`` has no float8 product for it
    (:func:`float8_refusal`): the recipe would run slower than bfloat16 and say it ran in
    float8."""
    why = float8_refusal(recipe, target)
    if why is not None:
        raise ValueError(why)


def with_fp8_products(
    policy: Mapping[PolicyKey, PrecisionFn], recipe: Recipe
) -> dict[PolicyKey, PrecisionFn]:
    """``policy`` with each matrix-product primitive it runs in the compute dtype run by
    ``recipe`` instead. Rows that say something else (a user's float32 ``dot_general``) and
    named scopes are kept as they are. Whether the device the program is traced for runs
    them is asked at each call (:func:`check_runs_in_float8`)."""
    fp8_rule = rule_of(recipe)
    changed = dict(policy)
    for name in PRODUCTS:
        prim = _compat.primitive_by_name(name)
        if prim is not None and changed.get(prim) is use_compute_precision:
            changed[prim] = fp8_rule
    return changed
