"""Precision functions and the default policy: which primitive runs in which dtype, and why.

A precision function has the signature of ``jaxamp``:

    f(compute_dtype, original_dtypes, *invars, **bind_params) -> (invars, bind_params)

``original_dtypes`` are the dtypes the unmodified program had at that equation; ``invars``
are the values as they arrive under amp (possibly already 16-bit). The function returns the
values to bind the primitive with, and its parameters. Integer, boolean and float64 values
are never cast by any function here.

The default policy is the table :data:`DEFAULT_PRECISION_TABLE`: one row per primitive with
its category and the reason it sits there. Everything not in the table keeps its original
precision, so an unknown primitive is never silently degraded.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, Mapping, Sequence, Union

import jax.numpy as jnp
import numpy as np

from autocast import _compat

PrecisionFn = Callable[..., tuple[Sequence[Any], dict[str, Any]]]
PolicyKey = Union[str, _compat.Primitive]
AmpPolicy = Mapping[PolicyKey, PrecisionFn]

_F64 = np.dtype(np.float64)
# Parameters that fix a primitive's result dtype; a rule that moves the inputs moves them too.
_RESULT_DTYPE_PARAMS = ("preferred_element_type", "out_dtype")


@functools.lru_cache(maxsize=None)
def _castable_dtypes(dtype: Any, original: Any) -> bool:
    return bool(
        jnp.issubdtype(dtype, jnp.floating)
        and dtype != _F64
        and jnp.issubdtype(original, jnp.floating)
        and original != _F64
    )


def _castable(x: Any, original: Any) -> bool:
    """Floating-point, not float64, now and in the original program."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and _castable_dtypes(dtype, original)


# One memo per jaxpr being evaluated (innermost last): a value used by several equations is
# cast once, not once per use. Entries hold the source value so its id stays unique.
_cast_memos: list[dict[tuple[int, Any], tuple[Any, Any]]] = []


@contextlib.contextmanager
def cast_memo() -> Iterator[None]:
    """Within this context, casting the same value to the same dtype twice reuses the cast."""
    _cast_memos.append({})
    try:
        yield
    finally:
        _cast_memos.pop()


def cast_value(x: Any, dtype: Any) -> Any:
    """Casts one value; NumPy constants are cast on the host so no device work is traced."""
    if x.dtype == dtype:
        return x
    if isinstance(x, (np.ndarray, np.generic)):
        with np.errstate(over="ignore"):  # -1e9 in float16 is -inf, as it is on a device
            return np.asarray(x).astype(dtype)
    if not _cast_memos:
        return _compat.convert(x, dtype)
    memo = _cast_memos[-1]
    key = (id(x), dtype)
    hit = memo.get(key)
    if hit is None:
        hit = memo[key] = (x, _compat.convert(x, dtype))
    return hit[1]


@functools.lru_cache(maxsize=None)
def _default_result_width(original_dtypes: tuple[Any, ...]) -> int:
    """Bytes of the floating result JAX gives these operands when not asked for another
    (0 when none is a floating dtype amp may cast)."""
    return max((np.dtype(o).itemsize for o in original_dtypes if _castable_dtypes(o, o)), default=0)


def _with_result_dtype(
    params: dict[str, Any], dtype: Any, original_dtypes: Sequence[Any]
) -> dict[str, Any]:
    """``params`` with their result dtype (``preferred_element_type``...) moved to ``dtype``.

    JAX records the operands' own dtype there (``jnp.matmul`` of float32 arrays says
    float32), and that follows the operands. A result dtype wider than the original operands
    would give is the user's own choice (``jnp.einsum(a16, b16,
    preferred_element_type=jnp.float32)``, accumulate in float32) and is kept.
    """
    for key in _RESULT_DTYPE_PARAMS:
        value = params.get(key)
        if value is None or not _castable_dtypes(value, value):
            continue
        if np.dtype(value).itemsize > _default_result_width(tuple(original_dtypes)):
            continue  # asked for explicitly: the user's accumulator stays
        params = {**params, key: np.dtype(dtype)}
    return params


def _cast_all(dtype: Any, original_dtypes: Sequence[Any], invars: Sequence[Any]) -> tuple:
    return tuple(
        cast_value(x, dtype) if _castable(x, o) else x for x, o in zip(invars, original_dtypes)
    )


def use_compute_precision(
    compute_dtype: Any, original_dtypes: Sequence[Any], *invars: Any, **bind_params: Any
) -> tuple[Sequence[Any], dict[str, Any]]:
    """Runs the primitive in ``compute_dtype``: inputs are cast and so is the result.

    It only ever narrows: an operation the program already wrote in fewer bits than
    ``compute_dtype`` (a bfloat16 matmul under ``compute_dtype=float32``) keeps its dtype.
    A result dtype wider than the original operands give by default was asked for by the
    user (``preferred_element_type=jnp.float32`` on bfloat16 operands) and is kept.

    >>> import autocast, jax.numpy as jnp
    >>> (a, b), params = autocast.use_compute_precision(
    ...     jnp.bfloat16, [jnp.float32] * 2, jnp.ones(2), jnp.ones(2),
    ...     preferred_element_type=jnp.float32)
    >>> a.dtype, params["preferred_element_type"]
    (dtype(bfloat16), dtype(bfloat16))
    >>> _, params = autocast.use_compute_precision(
    ...     jnp.bfloat16, [jnp.bfloat16] * 2, jnp.ones(2, jnp.bfloat16), jnp.ones(2, jnp.bfloat16),
    ...     preferred_element_type=jnp.float32)
    >>> params["preferred_element_type"] == jnp.float32
    True
    """
    widths = [np.dtype(o).itemsize for x, o in zip(invars, original_dtypes) if _castable(x, o)]
    if widths and max(widths) < np.dtype(compute_dtype).itemsize:
        return use_original_precision(compute_dtype, original_dtypes, *invars, **bind_params)
    target = _no_less_range(compute_dtype, invars, original_dtypes)
    return _cast_all(target, original_dtypes, invars), _with_result_dtype(
        bind_params, target, original_dtypes
    )


def _no_less_range(dtype: Any, invars: Sequence[Any], original_dtypes: Sequence[Any]) -> np.dtype:
    """``dtype``, or an input's own dtype of the same width and more range: bfloat16 values
    are never cast sideways to float16, where 720 would be inf."""
    dtype = np.dtype(dtype)
    for x, o in zip(invars, original_dtypes):
        if _castable(x, o) and np.dtype(x.dtype).itemsize == dtype.itemsize and x.dtype != dtype:
            if float(jnp.finfo(x.dtype).max) > float(jnp.finfo(dtype).max):
                dtype = np.dtype(x.dtype)
    return dtype


def use_original_precision(
    compute_dtype: Any, original_dtypes: Sequence[Any], *invars: Any, **bind_params: Any
) -> tuple[Sequence[Any], dict[str, Any]]:
    """Runs the primitive exactly as the original program did: inputs go back to their dtypes.

    >>> import autocast, jax.numpy as jnp
    >>> (a,), _ = autocast.use_original_precision(jnp.bfloat16, [jnp.float32],
    ...                                          jnp.ones(2, jnp.bfloat16))
    >>> a.dtype
    dtype('float32')
    """
    invars = tuple(
        cast_value(x, o) if _castable(x, o) else x for x, o in zip(invars, original_dtypes)
    )
    return invars, bind_params


def _widest(invars: Sequence[Any], original_dtypes: Sequence[Any]) -> Any:
    dtypes = {x.dtype for x, o in zip(invars, original_dtypes) if _castable(x, o)}
    if len(dtypes) <= 1:
        return next(iter(dtypes), None)
    return np.dtype(jnp.result_type(*dtypes))


def use_widest_precision(
    compute_dtype: Any, original_dtypes: Sequence[Any], *invars: Any, **bind_params: Any
) -> tuple[Sequence[Any], dict[str, Any]]:
    """Casts every floating-point input to the widest floating dtype among them.

    For joins (``concatenate``, ``select_n``, ``scatter``...), whose operands must agree: a
    value that arrives in float32 is never narrowed to meet a 16-bit one.

    >>> import autocast, jax.numpy as jnp
    >>> (a, b), _ = autocast.use_widest_precision(
    ...     jnp.bfloat16, [jnp.float32] * 2, jnp.ones(2, jnp.bfloat16), jnp.ones(2))
    >>> a.dtype, b.dtype
    (dtype('float32'), dtype('float32'))
    """
    widest = _widest(invars, original_dtypes)
    if widest is None:
        return invars, bind_params
    params = _with_result_dtype(bind_params, widest, original_dtypes)
    return _cast_all(widest, original_dtypes, invars), params


def use_input_precision(
    compute_dtype: Any, original_dtypes: Sequence[Any], *invars: Any, **bind_params: Any
) -> tuple[Sequence[Any], dict[str, Any]]:
    """Runs the primitive in whatever dtype its inputs arrive in (PyTorch's rule for the rest).

    Cheap elementwise and data-movement work uses this, so activations stay 16-bit between
    matrix products. Mixed floating inputs are promoted to the widest, as PyTorch does.

    >>> import autocast, jax.numpy as jnp
    >>> (a,), _ = autocast.use_input_precision(jnp.bfloat16, [jnp.float32],
    ...                                       jnp.ones(2, jnp.bfloat16))
    >>> a.dtype
    dtype(bfloat16)
    """
    return use_widest_precision(compute_dtype, original_dtypes, *invars, **bind_params)


def use_precision(dtype: Any) -> PrecisionFn:
    """A precision function that runs the primitive in ``dtype`` (e.g. float32).

    >>> import autocast, jax.numpy as jnp
    >>> rule = autocast.use_precision(jnp.float32)
    >>> (a,), _ = rule(jnp.bfloat16, [jnp.float32], jnp.ones(2, jnp.bfloat16))
    >>> a.dtype, rule.__name__
    (dtype('float32'), 'use_precision(float32)')
    """
    from autocast.policy import canonicalize_float_dtype

    dtype = canonicalize_float_dtype(dtype, what="use_precision's dtype")

    def rule(
        compute_dtype: Any, original_dtypes: Sequence[Any], *invars: Any, **bind_params: Any
    ) -> tuple[Sequence[Any], dict[str, Any]]:
        params = _with_result_dtype(bind_params, dtype, original_dtypes)
        return _cast_all(dtype, original_dtypes, invars), params

    rule.__name__ = rule.__qualname__ = f"use_precision({dtype.name})"
    return rule


def use_full_precision(
    compute_dtype: Any, original_dtypes: Sequence[Any], *invars: Any, **bind_params: Any
) -> tuple[Sequence[Any], dict[str, Any]]:
    """Runs the primitive no narrower than the program did: in the wider of each input's
    original dtype and the dtype it arrives in. For a float32 program that is float32; an
    operation the program itself wrote in bfloat16 stays bfloat16, so ``compute_dtype=float32``
    changes nothing at all.

    >>> import autocast, jax.numpy as jnp
    >>> (a,), _ = autocast.use_full_precision(jnp.bfloat16, [jnp.float32], jnp.ones(2, jnp.bfloat16))
    >>> (b,), _ = autocast.use_full_precision(jnp.bfloat16, [jnp.bfloat16], jnp.ones(2, jnp.bfloat16))
    >>> a.dtype, b.dtype
    (dtype('float32'), dtype(bfloat16))
    """
    wanted = {
        np.dtype(jnp.promote_types(x.dtype, o))
        for x, o in zip(invars, original_dtypes)
        if _castable(x, o)
    }
    if not wanted:
        return invars, bind_params
    target = next(iter(wanted)) if len(wanted) == 1 else np.dtype(jnp.result_type(*wanted))
    params = _with_result_dtype(bind_params, target, original_dtypes)
    return _cast_all(target, original_dtypes, invars), params


def use_own_precision(
    compute_dtype: Any, original_dtypes: Sequence[Any], *invars: Any, **bind_params: Any
) -> tuple[Sequence[Any], dict[str, Any]]:
    """Every input keeps the dtype it arrives in, each on its own: for collectives, whose
    operands are independent values travelling together (a 16-bit activation crosses the
    network in 16 bits, a float32 one in float32). Under 16-bit compute, when only matrix
    products consume the results of a collective that adds nothing (a gather, a permute,
    ``pvary``), amp casts its computed float32 activations to the compute dtype first, as the
    products would on arrival; the gradient of a value ``pvary`` marks is then summed in 16
    bits. Parameters and sums keep their dtype.

    >>> import autocast, jax.numpy as jnp
    >>> (a, b), _ = autocast.use_own_precision(jnp.bfloat16, [jnp.float32] * 2,
    ...                                        jnp.ones(2, jnp.bfloat16), jnp.ones(2))
    >>> a.dtype, b.dtype
    (dtype(bfloat16), dtype('float32'))
    """
    return invars, bind_params


# Precision functions that evaluate their equation themselves once they have cast its inputs:
# rule -> bind(eqn, invars, params), in place of binding the primitive. Filled where such a
# rule is defined (the scaled float8 products of :mod:`autocast.fp8`); each casts as
# use_compute_precision does.
CUSTOM_BINDINGS: dict[Any, Callable[[Any, Sequence[Any], dict[str, Any]], Any]] = {}


def is_compute_rule(rule: Any) -> bool:
    """Whether ``rule`` runs its equation in the compute dtype (or narrower, in float8)."""
    return rule is use_compute_precision or rule in CUSTOM_BINDINGS


# The float32 rows of the table: float32 for a float32 program, never narrower than the program.
use_float32_precision = use_full_precision

# Exponents whose powers stay in the input dtype: the identity and cubes (the tanh-GELU's
# ``x ** 3`` runs on the widest activations of a transformer). Squares go to float32 with
# ``square`` (see its row), higher powers because they overflow float16, negative ones as
# every spelling of 1/x does (``1.0 / x`` is float32 in a region): a small activation's
# reciprocal overflows float16.
_INPUT_PRECISION_EXPONENTS = frozenset({0, 1, 3})


def use_precision_by_exponent(
    compute_dtype: Any, original_dtypes: Sequence[Any], *invars: Any, **bind_params: Any
) -> tuple[Sequence[Any], dict[str, Any]]:
    """``integer_pow``: input precision for cubes; float32 for squares (like ``square``),
    reciprocals (like ``1.0 / x``) and powers of 4 and more, never narrower than the program.

    >>> import autocast, jax.numpy as jnp
    >>> from autocast.rules import use_precision_by_exponent
    >>> x = jnp.ones(2, jnp.bfloat16)
    >>> [use_precision_by_exponent(jnp.bfloat16, [jnp.float32], x, y=y)[0][0].dtype
    ...  for y in (2, 3, 4)]
    [dtype('float32'), dtype(bfloat16), dtype('float32')]
    """
    if bind_params.get("y") in _INPUT_PRECISION_EXPONENTS:
        rule = use_input_precision
    else:
        rule = use_float32_precision
    return rule(compute_dtype, original_dtypes, *invars, **bind_params)


def use_input_precision_for_casts(
    compute_dtype: Any, original_dtypes: Sequence[Any], *invars: Any, **bind_params: Any
) -> tuple[Sequence[Any], dict[str, Any]]:
    """``convert_element_type``: a cast the program wrote keeps its target dtype.

    A conversion that changed no dtype in the original program (only weak typing, as
    ``jax.numpy`` emits when it promotes a Python scalar) is no cast at all: the value keeps
    the dtype it arrives in.
    """
    target = bind_params.get("new_dtype")
    (x,) = invars
    if target is not None and target == original_dtypes[0] and _castable(x, target):
        bind_params = {**bind_params, "new_dtype": x.dtype}
    return invars, bind_params


_MATMUL = "compute dtype: matrix work, the bulk of the FLOPs; its backward follows by itself"
_EXP_LOG = "float32: overflows or loses its small values in 16 bits"
_ACCUMULATE = "float32: accumulates many terms; 16-bit sums lose low-order bits and overflow"
_STATISTIC = "float32: applied to statistics (variances, norms) whose precision matters"
_SPECIAL = "float32: special function, poor accuracy in 16 bits"
_TRIG = "float32: periodic functions of large arguments need the mantissa"
_LINALG = "float32: factorisations and solves are unstable in 16 bits"
_JOIN = "widest input: joins several values, which must agree; never narrows a float32 one"
_COMPARE = "widest input: compares two values, which must agree"
_ELEMENTWISE = "input dtype: cheap elementwise work; keeps activations 16-bit"
_MOVEMENT = "input dtype: moves data without arithmetic; keeps activations 16-bit"
_SELECTION = "input dtype: picks among values exactly"
_USER_CAST = "input dtype: a cast the user wrote keeps its target dtype"
_SQUARE = (
    "float32: squares feed one-pass variances E[x^2] - E[x]^2, which go negative when the"
    " square is rounded to 16 bits (Haiku BatchNorm: NaN loss), and overflow float16 above"
    " 256; fused into the float32 sum it feeds, it costs no memory in a compiled step"
)
_KERNEL = "original precision: a kernel is written for the dtypes it was given"
_VARYING_MARK = (
    "each input as it arrives: marks a value as varying over devices, moves nothing; its"
    " transpose is a psum, so a computed float32 activation only matrix products consume is"
    " marked in the compute dtype and its gradient summed in 16 bits"
)
_COLLECTIVE = (
    "each input as it arrives: a 16-bit activation travels in 16 bits (half the traffic,"
    " Megatron's tensor-parallel partial sums), float32 stays float32 (a computed activation"
    " only matrix products consume moves in the compute dtype where nothing is added). A"
    " 16-bit psum adds the devices' partial sums in 16 bits: for float32 sums give this row"
    " use_full_precision (docs/default_policy.md, Collectives)"
)

# (primitive name, precision function, reason). Rows for primitives that a JAX version lacks
# are skipped when the policy is built. Public: `autocast.DEFAULT_PRECISION_TABLE`, e.g.
# `[name for name, rule, _ in DEFAULT_PRECISION_TABLE if rule is use_compute_precision]`.
DEFAULT_PRECISION_TABLE: tuple[tuple[str, PrecisionFn, str], ...] = (
    ("dot_general", use_compute_precision, _MATMUL),
    ("conv_general_dilated", use_compute_precision, _MATMUL),
    ("ragged_dot_general", use_compute_precision, _MATMUL),
    ("ragged_dot", use_compute_precision, _MATMUL),
    ("exp", use_float32_precision, _EXP_LOG),
    ("exp2", use_float32_precision, _EXP_LOG),
    ("expm1", use_float32_precision, _EXP_LOG),
    ("log", use_float32_precision, _EXP_LOG),
    ("log1p", use_float32_precision, _EXP_LOG),
    ("pow", use_float32_precision, _EXP_LOG),
    ("reduce_sum", use_float32_precision, _ACCUMULATE),
    ("reduce_prod", use_float32_precision, _ACCUMULATE),
    ("cumsum", use_float32_precision, _ACCUMULATE),
    ("cumprod", use_float32_precision, _ACCUMULATE),
    ("cumlogsumexp", use_float32_precision, _ACCUMULATE),
    ("reduce_window_sum", use_float32_precision, _ACCUMULATE),
    ("scatter-add", use_float32_precision, _ACCUMULATE + " (repeated indices add up)"),
    ("scatter-mul", use_float32_precision, _ACCUMULATE + " (repeated indices multiply)"),
    ("sqrt", use_float32_precision, _STATISTIC),
    ("rsqrt", use_float32_precision, _STATISTIC),
    ("cbrt", use_float32_precision, _STATISTIC),
    ("square", use_float32_precision, _SQUARE),
    (
        "integer_pow",
        use_precision_by_exponent,
        "input dtype for cubes (tanh-GELU); float32 for squares, as `square`, for negative"
        " powers, as every spelling of 1/x, and for powers of 4 and more, which overflow float16",
    ),
    ("erf", use_float32_precision, _SPECIAL),
    ("erfc", use_float32_precision, _SPECIAL),
    ("erf_inv", use_float32_precision, _SPECIAL),
    ("lgamma", use_float32_precision, _SPECIAL),
    ("digamma", use_float32_precision, _SPECIAL),
    ("polygamma", use_float32_precision, _SPECIAL),
    ("zeta", use_float32_precision, _SPECIAL),
    ("igamma", use_float32_precision, _SPECIAL),
    ("igammac", use_float32_precision, _SPECIAL),
    ("igamma_grad_a", use_float32_precision, _SPECIAL),
    ("bessel_i0e", use_float32_precision, _SPECIAL),
    ("bessel_i1e", use_float32_precision, _SPECIAL),
    ("regularized_incomplete_beta", use_float32_precision, _SPECIAL),
    ("sin", use_float32_precision, _TRIG),
    ("cos", use_float32_precision, _TRIG),
    ("tan", use_float32_precision, _TRIG),
    ("asin", use_float32_precision, _TRIG),
    ("acos", use_float32_precision, _TRIG),
    ("atan", use_float32_precision, _TRIG),
    ("atan2", use_float32_precision, _TRIG),
    ("sinh", use_float32_precision, _EXP_LOG),
    ("cosh", use_float32_precision, _EXP_LOG),
    ("asinh", use_float32_precision, _EXP_LOG),
    ("acosh", use_float32_precision, _EXP_LOG),
    ("atanh", use_float32_precision, _EXP_LOG),
    ("cholesky", use_float32_precision, _LINALG),
    ("triangular_solve", use_float32_precision, _LINALG),
    ("qr", use_float32_precision, _LINALG),
    ("householder_product", use_float32_precision, _LINALG),
    ("svd", use_float32_precision, _LINALG),
    ("eigh", use_float32_precision, _LINALG),
    ("eig", use_float32_precision, _LINALG),
    ("lu", use_float32_precision, _LINALG),
    ("schur", use_float32_precision, _LINALG),
    ("hessenberg", use_float32_precision, _LINALG),
    ("tridiagonal", use_float32_precision, _LINALG),
    ("tridiagonal_solve", use_float32_precision, _LINALG),
    ("concatenate", use_widest_precision, _JOIN),
    ("select_n", use_widest_precision, _JOIN),
    ("clamp", use_widest_precision, _JOIN),
    ("pad", use_widest_precision, _JOIN),
    ("add_any", use_widest_precision, _JOIN),
    ("dynamic_update_slice", use_widest_precision, _JOIN),
    ("scatter", use_widest_precision, _JOIN),
    ("scatter-sub", use_widest_precision, _JOIN + " (an in-place update of an activation)"),
    ("stack", use_widest_precision, _JOIN + " (jnp.stack)"),
    ("scatter-min", use_widest_precision, _JOIN),
    ("scatter-max", use_widest_precision, _JOIN),
    ("select_and_scatter_add", use_widest_precision, _JOIN),
    ("select_and_gather_add", use_widest_precision, _JOIN),
    ("eq", use_widest_precision, _COMPARE),
    ("ne", use_widest_precision, _COMPARE),
    ("lt", use_widest_precision, _COMPARE),
    ("le", use_widest_precision, _COMPARE),
    ("gt", use_widest_precision, _COMPARE),
    ("ge", use_widest_precision, _COMPARE),
    ("add", use_input_precision, _ELEMENTWISE),
    ("sub", use_input_precision, _ELEMENTWISE),
    ("mul", use_input_precision, _ELEMENTWISE),
    ("div", use_input_precision, _ELEMENTWISE),
    ("rem", use_input_precision, _ELEMENTWISE),
    ("neg", use_input_precision, _ELEMENTWISE),
    ("max", use_input_precision, _ELEMENTWISE),
    ("min", use_input_precision, _ELEMENTWISE),
    ("abs", use_input_precision, _ELEMENTWISE),
    ("sign", use_input_precision, _ELEMENTWISE),
    ("floor", use_input_precision, _ELEMENTWISE),
    ("ceil", use_input_precision, _ELEMENTWISE),
    ("round", use_input_precision, _ELEMENTWISE),
    ("is_finite", use_input_precision, _ELEMENTWISE),
    ("tanh", use_input_precision, _ELEMENTWISE + " (bounded output)"),
    ("logistic", use_input_precision, _ELEMENTWISE + " (bounded output)"),
    (
        "one_minus_square",
        use_input_precision,
        "input dtype: 1 - y^2 of a tanh output y (the derivative of tanh and the tanh-GELU,"
        " as JAX 0.11.2 writes them), which lies in [0, 1]; grad(amp(f)) runs it there too",
    ),
    ("reduce_precision", use_input_precision, _ELEMENTWISE),
    ("stop_gradient", use_input_precision, _MOVEMENT),
    ("name", use_input_precision, "input dtype: a checkpoint_name mark, no computation"),
    ("reshape", use_input_precision, _MOVEMENT),
    ("transpose", use_input_precision, _MOVEMENT),
    ("broadcast_in_dim", use_input_precision, _MOVEMENT),
    ("squeeze", use_input_precision, _MOVEMENT),
    ("expand_dims", use_input_precision, _MOVEMENT),
    ("slice", use_input_precision, _MOVEMENT),
    ("dynamic_slice", use_input_precision, _MOVEMENT),
    ("gather", use_input_precision, _MOVEMENT),
    ("rev", use_input_precision, _MOVEMENT),
    ("copy", use_input_precision, _MOVEMENT),
    ("copy_p", use_input_precision, _MOVEMENT),
    ("split", use_input_precision, _MOVEMENT),
    ("unstack", use_input_precision, _MOVEMENT),
    ("tile", use_input_precision, _MOVEMENT),
    ("sharding_constraint", use_input_precision, _MOVEMENT),
    ("optimization_barrier", use_input_precision, _MOVEMENT),
    ("device_put", use_input_precision, _MOVEMENT),
    ("reduce_max", use_input_precision, _SELECTION),
    ("reduce_min", use_input_precision, _SELECTION),
    ("argmax", use_input_precision, _SELECTION),
    ("argmin", use_input_precision, _SELECTION),
    ("reduce_window_max", use_input_precision, _SELECTION),
    ("reduce_window_min", use_input_precision, _SELECTION),
    ("cummax", use_input_precision, _SELECTION),
    ("cummin", use_input_precision, _SELECTION),
    ("sort", use_input_precision, _SELECTION),
    ("top_k", use_input_precision, _SELECTION),
    ("convert_element_type", use_input_precision_for_casts, _USER_CAST),
    ("pallas_call", use_original_precision, _KERNEL),
    *(
        (name, use_own_precision, _COLLECTIVE)
        for name in (
            "psum", "psum_invariant", "pmax", "pmin", "all_gather", "all_gather_invariant",
            "ppermute", "all_to_all", "reduce_scatter",
        )
    ),
    *((name, use_own_precision, _VARYING_MARK) for name in ("pvary", "pbroadcast")),
)

# Rules that never move a value to a dtype wider than compute_dtype nor to one the program
# did not have: under a compute dtype of 32 bits or more, each keeps every dtype as recorded.
_NEUTRAL_AT_FULL_WIDTH = frozenset({
    use_compute_precision, use_original_precision, use_full_precision, use_widest_precision,
    use_input_precision, use_own_precision, use_precision_by_exponent,
    use_input_precision_for_casts,
})


def changes_no_dtype(policy: Mapping[Any, PrecisionFn], compute_dtype: Any) -> bool:
    """Whether ``policy`` under ``compute_dtype`` leaves every equation in its recorded
    dtypes: a compute dtype of 32 bits or more, and only rules that never widen (the
    default table's). amp then evaluates the recorded program itself, so
    ``amp(fn, compute_dtype=jnp.float32)`` compiles to exactly ``fn``'s program on every
    backend (SPEC 3.5), not merely to the same arithmetic."""
    return np.dtype(compute_dtype).itemsize >= 4 and all(
        rule in _NEUTRAL_AT_FULL_WIDTH for rule in policy.values()
    )


# Scopes that keep original precision: the seed's special names.
SPECIAL_SCOPES: tuple[str, ...] = ("amp_stop", "amp_step", "amp_default")


def _build_default_policy() -> dict[PolicyKey, PrecisionFn]:
    policy: dict[PolicyKey, PrecisionFn] = {}
    for name, rule, _ in DEFAULT_PRECISION_TABLE:
        prim = _compat.primitive_by_name(name)
        if prim is not None:
            policy[prim] = rule
    for scope in SPECIAL_SCOPES:
        policy[scope] = use_original_precision
    return policy


default_amp_policy: dict[PolicyKey, PrecisionFn] = _build_default_policy()
"""The policy ``amp`` uses unless given another: :data:`DEFAULT_PRECISION_TABLE` plus the
special scopes ``"amp_stop"``, ``"amp_step"`` and ``"amp_default"`` (original precision)."""


def describe_default_policy() -> str:
    """The default policy as a Markdown table: primitive, rule, reason.

    >>> import autocast
    >>> print(autocast.describe_default_policy().splitlines()[2])
    | `dot_general` | use_compute_precision | compute dtype: matrix work, ... |
    """
    lines = ["| primitive | rule | why |", "|---|---|---|"]
    for name, rule, reason in DEFAULT_PRECISION_TABLE:
        lines.append(f"| `{name}` | {rule.__name__} | {reason} |")
    lines.append("| anything else | use_original_precision | an unknown primitive is never degraded |")
    return "\n".join(lines)
