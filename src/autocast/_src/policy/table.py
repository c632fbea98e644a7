"""The default policy: which primitive runs in which dtype, and why, as one table.

:data:`DEFAULT_PRECISION_TABLE` holds one row per primitive: its precision function and the
reason it sits there. Everything not in the table keeps its original precision, so an
unknown primitive is never silently degraded. ``python -m autocast policy`` prints it.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from autocast import _compat
from autocast._src.policy.precision import (
    PolicyKey,
    PrecisionFn,
    use_compute_precision,
    use_full_precision,
    use_input_precision,
    use_input_precision_for_casts,
    use_original_precision,
    use_own_precision,
    use_precision_by_exponent,
    use_widest_precision,
)

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
    ("exp", use_full_precision, _EXP_LOG),
    ("exp2", use_full_precision, _EXP_LOG),
    ("expm1", use_full_precision, _EXP_LOG),
    ("log", use_full_precision, _EXP_LOG),
    ("log1p", use_full_precision, _EXP_LOG),
    ("pow", use_full_precision, _EXP_LOG),
    ("reduce_sum", use_full_precision, _ACCUMULATE),
    ("reduce_prod", use_full_precision, _ACCUMULATE),
    ("cumsum", use_full_precision, _ACCUMULATE),
    ("cumprod", use_full_precision, _ACCUMULATE),
    ("cumlogsumexp", use_full_precision, _ACCUMULATE),
    ("reduce_window_sum", use_full_precision, _ACCUMULATE),
    ("scatter-add", use_full_precision, _ACCUMULATE + " (repeated indices add up)"),
    ("scatter-mul", use_full_precision, _ACCUMULATE + " (repeated indices multiply)"),
    ("sqrt", use_full_precision, _STATISTIC),
    ("rsqrt", use_full_precision, _STATISTIC),
    ("cbrt", use_full_precision, _STATISTIC),
    ("square", use_full_precision, _SQUARE),
    (
        "integer_pow",
        use_precision_by_exponent,
        "input dtype for cubes (tanh-GELU); float32 for squares, as `square`, for negative"
        " powers, as every spelling of 1/x, and for powers of 4 and more, which overflow float16",
    ),
    ("erf", use_full_precision, _SPECIAL),
    ("erfc", use_full_precision, _SPECIAL),
    ("erf_inv", use_full_precision, _SPECIAL),
    ("lgamma", use_full_precision, _SPECIAL),
    ("digamma", use_full_precision, _SPECIAL),
    ("polygamma", use_full_precision, _SPECIAL),
    ("zeta", use_full_precision, _SPECIAL),
    ("igamma", use_full_precision, _SPECIAL),
    ("igammac", use_full_precision, _SPECIAL),
    ("igamma_grad_a", use_full_precision, _SPECIAL),
    ("bessel_i0e", use_full_precision, _SPECIAL),
    ("bessel_i1e", use_full_precision, _SPECIAL),
    ("regularized_incomplete_beta", use_full_precision, _SPECIAL),
    ("sin", use_full_precision, _TRIG),
    ("cos", use_full_precision, _TRIG),
    ("tan", use_full_precision, _TRIG),
    ("asin", use_full_precision, _TRIG),
    ("acos", use_full_precision, _TRIG),
    ("atan", use_full_precision, _TRIG),
    ("atan2", use_full_precision, _TRIG),
    ("sinh", use_full_precision, _EXP_LOG),
    ("cosh", use_full_precision, _EXP_LOG),
    ("asinh", use_full_precision, _EXP_LOG),
    ("acosh", use_full_precision, _EXP_LOG),
    ("atanh", use_full_precision, _EXP_LOG),
    ("cholesky", use_full_precision, _LINALG),
    ("triangular_solve", use_full_precision, _LINALG),
    ("qr", use_full_precision, _LINALG),
    ("householder_product", use_full_precision, _LINALG),
    ("svd", use_full_precision, _LINALG),
    ("eigh", use_full_precision, _LINALG),
    ("eig", use_full_precision, _LINALG),
    ("lu", use_full_precision, _LINALG),
    ("schur", use_full_precision, _LINALG),
    ("hessenberg", use_full_precision, _LINALG),
    ("tridiagonal", use_full_precision, _LINALG),
    ("tridiagonal_solve", use_full_precision, _LINALG),
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
            "psum",
            "psum_invariant",
            "pmax",
            "pmin",
            "all_gather",
            "all_gather_invariant",
            "ppermute",
            "all_to_all",
            "reduce_scatter",
        )
    ),
    *((name, use_own_precision, _VARYING_MARK) for name in ("pvary", "pbroadcast")),
)
"""The default policy as data: one ``(primitive name, rule, reason)`` row per primitive.

A tuple of 3-tuples: the primitive's name (a string), its precision function, and a short
string that says why it runs there. :data:`default_amp_policy` is built from it:
rows for primitives that the installed JAX version lacks are skipped, and every primitive
without a row keeps its original precision. :func:`describe_default_policy` renders it as a
Markdown table, and ``python -m autocast policy`` prints that.

Example:
    >>> import autocast
    >>> name, rule, reason = autocast.DEFAULT_PRECISION_TABLE[0]
    >>> name, rule.__name__
    ('dot_general', 'use_compute_precision')
    >>> [name for name, rule, _ in autocast.DEFAULT_PRECISION_TABLE
    ...  if rule is autocast.use_compute_precision]
    ['dot_general', 'conv_general_dilated', 'ragged_dot_general', 'ragged_dot']
"""

# Rules that never move a value to a dtype wider than compute_dtype nor to one the program
# did not have: under a compute dtype of 32 bits or more, each keeps every dtype as recorded.
_NEUTRAL_AT_FULL_WIDTH = frozenset(
    {
        use_compute_precision,
        use_original_precision,
        use_full_precision,
        use_widest_precision,
        use_input_precision,
        use_own_precision,
        use_precision_by_exponent,
        use_input_precision_for_casts,
    }
)


def changes_no_dtype(policy: Mapping[Any, PrecisionFn], compute_dtype: Any) -> bool:
    """Whether ``policy`` under ``compute_dtype`` leaves every equation in its recorded
    dtypes: a compute dtype of 32 bits or more, and only rules that never widen (the
    default table's). amp then evaluates the recorded program itself, so
    ``amp(fn, compute_dtype=jnp.float32)`` compiles to exactly ``fn``'s program on every
    backend, not merely to the same arithmetic."""
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
"""The policy ``amp`` uses unless given another.

A dict from JAX primitives and named-scope strings to precision functions:
:data:`DEFAULT_PRECISION_TABLE` (the rows whose primitive the installed JAX has) plus the
special scopes ``"amp_stop"``, ``"amp_step"`` and ``"amp_default"`` (original precision).
``amp`` uses this dict itself, not a copy: to change the policy, extend a copy,
``{**autocast.default_amp_policy, key: rule}``, and pass that as ``amp_policy``.

Example:
    >>> import autocast, jax
    >>> autocast.default_amp_policy[jax.lax.dot_general_p].__name__
    'use_compute_precision'
    >>> autocast.default_amp_policy[jax.lax.exp_p].__name__
    'use_full_precision'
    >>> autocast.default_amp_policy["amp_stop"] is autocast.use_original_precision
    True
"""


def describe_default_policy() -> str:
    """The default policy as a Markdown table: primitive, rule, reason.

    One row per entry of :data:`DEFAULT_PRECISION_TABLE`, including rows for primitives the
    installed JAX lacks, and a last row for every other primitive (original precision).

    Returns:
        A string: a Markdown table with the columns ``primitive``, ``rule`` and ``why``, one
        line per row, joined by newlines.

    Example:
        >>> import autocast
        >>> print(autocast.describe_default_policy().splitlines()[2])
        | `dot_general` | use_compute_precision | compute dtype: matrix work, ... |
    """
    lines = ["| primitive | rule | why |", "|---|---|---|"]
    for name, rule, reason in DEFAULT_PRECISION_TABLE:
        lines.append(f"| `{name}` | {rule.__name__} | {reason} |")
    lines.append(
        "| anything else | use_original_precision | an unknown primitive is never degraded |"
    )
    return "\n".join(lines)
