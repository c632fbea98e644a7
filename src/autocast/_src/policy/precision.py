"""Precision functions: how one equation's inputs are cast before it is bound.

A precision function has the signature of ``jaxamp``:

    f(compute_dtype, original_dtypes, *invars, **bind_params) -> (invars, bind_params)

``original_dtypes`` are the dtypes the unmodified program had at that equation; ``invars``
are the values as they arrive under amp (possibly already 16-bit). The function returns the
values to bind the primitive with, and its parameters. Integer, boolean and float64 values
are never cast by any function here.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Sequence, TypeVar, Union

import jax.numpy as jnp
import numpy as np

from autocast import _compat
from autocast._src.policy.casting import cast_value, castable, castable_dtypes
from autocast._src.policy.dtypes import canonicalize_float_dtype

PrecisionFn = Callable[..., tuple[Sequence[Any], dict[str, Any]]]
PolicyKey = Union[str, _compat.Primitive]
AmpPolicy = Mapping[PolicyKey, PrecisionFn]

# Parameters that fix a primitive's result dtype; a rule that moves the inputs moves them too.
_RESULT_DTYPE_PARAMS = ("preferred_element_type", "out_dtype")


@functools.lru_cache(maxsize=None)
def _default_result_width(original_dtypes: tuple[Any, ...]) -> int:
    """Bytes of the floating result JAX gives these operands when not asked for another
    (0 when none is a floating dtype amp may cast)."""
    return max((np.dtype(o).itemsize for o in original_dtypes if castable_dtypes(o, o)), default=0)


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
        if value is None or not castable_dtypes(value, value):
            continue
        if np.dtype(value).itemsize > _default_result_width(tuple(original_dtypes)):
            continue  # asked for explicitly: the user's accumulator stays
        params = {**params, key: np.dtype(dtype)}
    return params


F = TypeVar("F", bound=Callable[..., Any])

# The arguments every precision function takes, written once: a rule's docstring says
# "Args: those of every precision function" and the decorator puts them there, so help() and
# the docs show them in full.
RULE_ARGS = """    Args:
        compute_dtype: The compute dtype ``amp`` runs under, a NumPy floating dtype.
        original_dtypes: The dtypes the original program gave the equation's inputs, one per
            value in ``invars``.
        *invars: The equation's input values as they arrive under ``amp``: arrays or tracers,
            possibly already 16-bit.
        **bind_params: The primitive's parameters, as the equation records them.
"""
_ARGS_MARKER = "    Args: those of every precision function (``RULE_ARGS``).\n"


def documented_rule(fn: F) -> F:
    """``fn`` with the arguments of a precision function written into its docstring."""
    if fn.__doc__ is not None:
        fn.__doc__ = fn.__doc__.replace(_ARGS_MARKER, RULE_ARGS)
    return fn


def _cast_all(dtype: Any, original_dtypes: Sequence[Any], invars: Sequence[Any]) -> tuple:
    return tuple(
        cast_value(x, dtype) if castable(x, o) else x for x, o in zip(invars, original_dtypes)
    )


@documented_rule
def use_compute_precision(
    compute_dtype: Any, original_dtypes: Sequence[Any], *invars: Any, **bind_params: Any
) -> tuple[Sequence[Any], dict[str, Any]]:
    """Runs the primitive in ``compute_dtype``: inputs are cast and so is the result.

    It only ever narrows: an operation the program already wrote in fewer bits than
    ``compute_dtype`` (a bfloat16 matmul under ``compute_dtype=float32``) keeps its dtype.
    A result dtype wider than the original operands give by default was asked for by the
    user (``preferred_element_type=jnp.float32`` on bfloat16 operands) and is kept. An input
    that arrives in a dtype as wide as ``compute_dtype`` but with more range is not cast
    sideways: bfloat16 values stay bfloat16 under float16 compute, where 720 would be inf.

    Args: those of every precision function (``RULE_ARGS``).

    Returns:
        A pair ``(invars, bind_params)``. ``invars`` is a tuple with each floating-point input
        (not float64, in the original program nor now) cast to ``compute_dtype``; other values
        are passed through. ``bind_params`` has its result dtype (``preferred_element_type``
        or ``out_dtype``) moved to the same dtype, unless the user asked for a wider one. When
        every floating input was narrower than ``compute_dtype`` in the original program, the
        pair :func:`use_original_precision` returns.

    Example:
        >>> import autocast, jax.numpy as jnp
        >>> (a, b), params = autocast.use_compute_precision(
        ...     jnp.bfloat16, [jnp.float32] * 2, jnp.ones(2), jnp.ones(2),
        ...     preferred_element_type=jnp.float32)
        >>> a.dtype, params["preferred_element_type"]
        (dtype(bfloat16), dtype(bfloat16))
        >>> _, params = autocast.use_compute_precision(
        ...     jnp.bfloat16, [jnp.bfloat16] * 2,
        ...     jnp.ones(2, jnp.bfloat16), jnp.ones(2, jnp.bfloat16),
        ...     preferred_element_type=jnp.float32)
        >>> params["preferred_element_type"] == jnp.float32
        True
    """
    widths = [np.dtype(o).itemsize for x, o in zip(invars, original_dtypes) if castable(x, o)]
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
        if castable(x, o) and np.dtype(x.dtype).itemsize == dtype.itemsize and x.dtype != dtype:
            if float(jnp.finfo(x.dtype).max) > float(jnp.finfo(dtype).max):
                dtype = np.dtype(x.dtype)
    return dtype


@documented_rule
def use_original_precision(
    compute_dtype: Any, original_dtypes: Sequence[Any], *invars: Any, **bind_params: Any
) -> tuple[Sequence[Any], dict[str, Any]]:
    """Runs the primitive exactly as the original program did: inputs go back to their dtypes.

    ``compute_dtype`` is not used. The default policy gives this rule to the special scopes
    (``"amp_stop"``...) and to kernels such as ``pallas_call``; a primitive the policy does not
    name runs this way too, unless the policy maps the key ``"amp_default"`` to another rule.

    Args: those of every precision function (``RULE_ARGS``).

    Returns:
        A pair ``(invars, bind_params)``: ``invars`` a tuple with each floating-point input
        (not float64) cast back to its dtype in ``original_dtypes``, other values passed
        through; ``bind_params`` unchanged.

    Example:
        >>> import autocast, jax.numpy as jnp
        >>> (a,), _ = autocast.use_original_precision(jnp.bfloat16, [jnp.float32],
        ...                                          jnp.ones(2, jnp.bfloat16))
        >>> a.dtype
        dtype('float32')
    """
    invars = tuple(
        cast_value(x, o) if castable(x, o) else x for x, o in zip(invars, original_dtypes)
    )
    return invars, bind_params


def _widest(invars: Sequence[Any], original_dtypes: Sequence[Any]) -> Any:
    dtypes = {x.dtype for x, o in zip(invars, original_dtypes) if castable(x, o)}
    if len(dtypes) <= 1:
        return next(iter(dtypes), None)
    return np.dtype(jnp.result_type(*dtypes))


@documented_rule
def use_widest_precision(
    compute_dtype: Any, original_dtypes: Sequence[Any], *invars: Any, **bind_params: Any
) -> tuple[Sequence[Any], dict[str, Any]]:
    """Casts every floating-point input to the widest floating dtype among them.

    For joins (``concatenate``, ``select_n``, ``scatter``...), whose operands must agree: a
    value that arrives in float32 is never narrowed to meet a 16-bit one. ``compute_dtype``
    is not used.

    Args: those of every precision function (``RULE_ARGS``).

    Returns:
        A pair ``(invars, bind_params)``. ``invars`` is a tuple with each floating-point input
        (not float64) cast to the promoted dtype of the dtypes those inputs arrive in; other
        values are passed through. ``bind_params`` has its result dtype
        (``preferred_element_type`` or ``out_dtype``) moved to that dtype, unless the user asked
        for a wider one. With no such input, ``invars`` and ``bind_params`` unchanged.

    Example:
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


@documented_rule
def use_input_precision(
    compute_dtype: Any, original_dtypes: Sequence[Any], *invars: Any, **bind_params: Any
) -> tuple[Sequence[Any], dict[str, Any]]:
    """Runs the primitive in whatever dtype its inputs arrive in (PyTorch's rule for the rest).

    Cheap elementwise and data-movement work uses this, so activations stay 16-bit between
    matrix products. Mixed floating inputs are promoted to the widest, as PyTorch does, which
    makes this rule :func:`use_widest_precision` under another name.

    Args: those of every precision function (``RULE_ARGS``).

    Returns:
        The pair :func:`use_widest_precision` returns: ``invars`` as a tuple in the dtype
        they arrive in (mixed floating inputs promoted to the widest), and ``bind_params``.

    Example:
        >>> import autocast, jax.numpy as jnp
        >>> (a,), _ = autocast.use_input_precision(jnp.bfloat16, [jnp.float32],
        ...                                       jnp.ones(2, jnp.bfloat16))
        >>> a.dtype
        dtype(bfloat16)
    """
    return use_widest_precision(compute_dtype, original_dtypes, *invars, **bind_params)


def use_precision(dtype: Any) -> PrecisionFn:
    """Makes a precision function that runs the primitive in ``dtype`` (e.g. float32).

    Unlike :func:`use_compute_precision` it also widens: every floating-point input that is not
    float64 goes to ``dtype``, whatever the program or ``compute_dtype`` say. A result dtype
    the user asked for, wider than the original operands give by default, is kept.

    Args:
        dtype: The floating dtype to run in: a dtype (``jnp.float32``) or a name
            :func:`autocast.parse_dtype` accepts (``"f32"``).

    Returns:
        A precision function ``rule(compute_dtype, original_dtypes, *invars, **bind_params)``
        named ``use_precision(<dtype name>)``. It returns the pair ``(invars, bind_params)``:
        a tuple with each floating-point input (not float64) cast to ``dtype``, other values
        passed through, and the parameters with their result dtype (``preferred_element_type``
        or ``out_dtype``) moved to ``dtype``.

    Raises:
        TypeError: If ``dtype`` is not a floating dtype.
        ValueError: If ``dtype`` is a string that names no floating dtype.

    Example:
        >>> import autocast, jax.numpy as jnp
        >>> rule = autocast.use_precision(jnp.float32)
        >>> (a,), _ = rule(jnp.bfloat16, [jnp.float32], jnp.ones(2, jnp.bfloat16))
        >>> a.dtype, rule.__name__
        (dtype('float32'), 'use_precision(float32)')
    """
    dtype = canonicalize_float_dtype(dtype, what="use_precision's dtype")

    def rule(
        compute_dtype: Any, original_dtypes: Sequence[Any], *invars: Any, **bind_params: Any
    ) -> tuple[Sequence[Any], dict[str, Any]]:
        params = _with_result_dtype(bind_params, dtype, original_dtypes)
        return _cast_all(dtype, original_dtypes, invars), params

    rule.__name__ = rule.__qualname__ = f"use_precision({dtype.name})"
    return rule


@documented_rule
def use_full_precision(
    compute_dtype: Any, original_dtypes: Sequence[Any], *invars: Any, **bind_params: Any
) -> tuple[Sequence[Any], dict[str, Any]]:
    """Runs the primitive no narrower than the program did.

    Each floating-point input asks for the wider of its original dtype and the dtype it arrives
    in, and the primitive runs in the widest of these. For a float32 program that is float32;
    an operation the program itself wrote in bfloat16 stays bfloat16, so
    ``compute_dtype=float32`` changes nothing at all. The default policy's float32 rows
    (exponentials, logarithms, sums, special functions) use this rule; ``compute_dtype`` is
    not used.

    Args: those of every precision function (``RULE_ARGS``).

    Returns:
        A pair ``(invars, bind_params)``. ``invars`` is a tuple with each floating-point input
        (not float64) cast to that dtype; other values are passed through. ``bind_params`` has
        its result dtype (``preferred_element_type`` or ``out_dtype``) moved to it, unless the
        user asked for a wider one. With no such input, ``invars`` and ``bind_params``
        unchanged.

    Example:
        >>> import autocast, jax.numpy as jnp
        >>> x = jnp.ones(2, jnp.bfloat16)
        >>> (a,), _ = autocast.use_full_precision(jnp.bfloat16, [jnp.float32], x)
        >>> (b,), _ = autocast.use_full_precision(jnp.bfloat16, [jnp.bfloat16], x)
        >>> a.dtype, b.dtype
        (dtype('float32'), dtype(bfloat16))
    """
    wanted = {
        np.dtype(jnp.promote_types(x.dtype, o))
        for x, o in zip(invars, original_dtypes)
        if castable(x, o)
    }
    if not wanted:
        return invars, bind_params
    target = next(iter(wanted)) if len(wanted) == 1 else np.dtype(jnp.result_type(*wanted))
    params = _with_result_dtype(bind_params, target, original_dtypes)
    return _cast_all(target, original_dtypes, invars), params


@documented_rule
def use_own_precision(
    compute_dtype: Any, original_dtypes: Sequence[Any], *invars: Any, **bind_params: Any
) -> tuple[Sequence[Any], dict[str, Any]]:
    """Every input keeps the dtype it arrives in, each on its own.

    For collectives, whose operands are independent values travelling together (a 16-bit
    activation crosses the network in 16 bits, a float32 one in float32). Under 16-bit compute,
    when only matrix products consume the results of a collective that adds nothing (a gather,
    a permute, ``pvary``), amp casts its computed float32 activations to the compute dtype
    first, as the products would on arrival; the gradient of a value ``pvary`` marks is then
    summed in 16 bits. Parameters and sums keep their dtype.

    Args: those of every precision function (``RULE_ARGS``).

    Returns:
        The pair ``(invars, bind_params)``, both as given: ``invars`` is the tuple of inputs.

    Example:
        >>> import autocast, jax.numpy as jnp
        >>> (a, b), _ = autocast.use_own_precision(jnp.bfloat16, [jnp.float32] * 2,
        ...                                        jnp.ones(2, jnp.bfloat16), jnp.ones(2))
        >>> a.dtype, b.dtype
        (dtype(bfloat16), dtype('float32'))
    """
    return invars, bind_params


# Precision functions that evaluate their equation themselves once they have cast its inputs:
# rule -> bind(eqn, invars, params, ctx, parameters), in place of binding the primitive (ctx:
# the interpreter's Context; parameters: per input, whether it is an input of the function
# reached through data movement alone, a weight rather than a computed activation). Filled
# where such a rule is defined (the scaled float8 products of autocast._src.fp8.products);
# each casts as use_compute_precision does.
CUSTOM_BINDINGS: dict[Any, Callable[..., Any]] = {}


def is_compute_rule(rule: Any) -> bool:
    """Whether ``rule`` runs its equation in the compute dtype (or narrower, in float8)."""
    return rule is use_compute_precision or rule in CUSTOM_BINDINGS


# Exponents whose powers stay in the input dtype: the identity and cubes (the tanh-GELU's
# ``x ** 3`` runs on the widest activations of a transformer). Squares go to float32 with
# ``square`` (see its row), higher powers because they overflow float16, negative ones as
# every spelling of 1/x does (``1.0 / x`` is float32 in a region): a small activation's
# reciprocal overflows float16.
INPUT_PRECISION_EXPONENTS = frozenset({0, 1, 3})


def use_precision_by_exponent(
    compute_dtype: Any, original_dtypes: Sequence[Any], *invars: Any, **bind_params: Any
) -> tuple[Sequence[Any], dict[str, Any]]:
    """``integer_pow``: input precision for cubes; float32 for squares (like ``square``),
    reciprocals (like ``1.0 / x``) and powers of 4 and more, never narrower than the program.

    >>> import autocast, jax.numpy as jnp
    >>> from autocast._src.policy.precision import use_precision_by_exponent
    >>> x = jnp.ones(2, jnp.bfloat16)
    >>> [use_precision_by_exponent(jnp.bfloat16, [jnp.float32], x, y=y)[0][0].dtype
    ...  for y in (2, 3, 4)]
    [dtype('float32'), dtype(bfloat16), dtype('float32')]
    """
    if bind_params.get("y") in INPUT_PRECISION_EXPONENTS:
        rule = use_input_precision
    else:
        rule = use_full_precision
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
    if target is not None and target == original_dtypes[0] and castable(x, target):
        bind_params = {**bind_params, "new_dtype": x.dtype}
    return invars, bind_params
