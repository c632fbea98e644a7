"""Entry points that choose their kernel by dtype while they trace run in the compute dtype.

amp traces ``fn`` at its original dtypes and decides each equation afterwards. A function that
looks at its inputs' dtype while it traces has decided by then: cuDNN's fused attention
(``jax.nn.dot_product_attention(..., implementation="cudnn")``) refuses float32 queries,
``implementation=None`` picks a slower kernel for them, and a Pallas flash-attention kernel
written for bfloat16 does not trace at all. torch.autocast meets this by listing
``scaled_dot_product_attention`` among the operations that run in the lower precision; amp
does the same one level up, for whole functions.

A function marked with :func:`in_compute_dtype` (``jax.nn.dot_product_attention`` is marked
when autocast is imported) is an *entry point*. While amp traces, a call to it casts its
floating-point array arguments to the compute dtype before the call, so it traces, chooses
and checks at that dtype, and casts its floating results back to the widest dtype among those
arguments, so the traced program keeps its signature. That restoring cast is marked (the
named scope :data:`RESTORE_SCOPE`) and amp's interpreter drops it: the result flows on in the
compute dtype to the next matrix product, as a hand-cast model's does. Statistics the entry
point keeps inside (a fused attention's softmax maxima and sums) are its own: cuDNN and JAX's
XLA attention keep them in float32.

Nothing changes outside amp's trace, under a compute dtype of 32 bits or more, under a float8
recipe's bfloat16 carrier the call runs in bfloat16 (Transformer Engine also keeps attention
in 16 bits), and inside a named scope the policy keeps in higher precision (``amp_stop``).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Iterator

import jax
import numpy as np

from autocast import _compat
from autocast._src.policy.casting import cast_value, castable
from autocast._src.policy.target import target_of
from autocast._src.tree import is_array

RESTORE_SCOPE = "amp_entry_output"

_state = threading.local()


@contextlib.contextmanager
def tracing(
    compute_dtype: Any, keeps_precision: Callable[[tuple[str, ...]], bool]
) -> Iterator[None]:
    """While amp traces: entry points cast to ``compute_dtype`` unless
    ``keeps_precision(scopes)`` says the named scopes active at the call keep their
    precision. Nested traces (an amp inside an amp) use the outermost's settings."""
    stack = _state.__dict__.setdefault("stack", [])
    stack.append((np.dtype(compute_dtype), keeps_precision))
    try:
        yield
    finally:
        stack.pop()


def _target_dtype() -> np.dtype | None:
    """The dtype entry points run in here, or None where they run as called."""
    stack = getattr(_state, "stack", None)
    if not stack:
        return None
    compute_dtype, keeps_precision = stack[0]
    if compute_dtype.itemsize >= 4 or keeps_precision(_compat.current_scope_names()):
        return None
    return compute_dtype


def _number(x: Any) -> bool:
    """A weakly typed scalar: a Python number the user passed, which amp traces as jax.jit
    does (a softmax scale, an epsilon). It reaches the kernel as it is, as under jax.jit,
    not rounded to 16 bits."""
    return np.ndim(x) == 0 and bool(getattr(_compat.aval_of(x), "weak_type", False))


def _narrowed(x: Any, dtype: np.dtype) -> Any:
    if (
        is_array(x)
        and castable(x, x.dtype)
        and np.dtype(x.dtype).itemsize > dtype.itemsize
        and not _number(x)
    ):
        return cast_value(x, dtype)
    return x


def _call(fn: Callable[..., Any], dtype: np.dtype, args: tuple, kwargs: dict) -> Any:
    leaves = jax.tree_util.tree_leaves((args, kwargs))
    wide = [x.dtype for x in leaves if is_array(x) and castable(x, x.dtype) and not _number(x)]
    if not wide:
        return fn(*args, **kwargs)
    back = max((np.dtype(d) for d in wide), key=lambda d: d.itemsize)
    if back.itemsize <= dtype.itemsize:
        return fn(*args, **kwargs)
    args, kwargs = jax.tree_util.tree_map(lambda x: _narrowed(x, dtype), (args, kwargs))
    out = fn(*args, **kwargs)
    with jax.named_scope(RESTORE_SCOPE):
        return jax.tree_util.tree_map(
            lambda y: cast_value(y, back) if is_array(y) and y.dtype == dtype else y, out
        )


def in_compute_dtype(
    fn: Callable[..., Any] | None = None, *, when: Callable[..., bool] | None = None
) -> Any:
    """Marks ``fn`` as an entry point that ``amp`` calls in the compute dtype.

    Under ``amp``, ``fn`` is called on its floating-point arguments cast to the compute dtype,
    and its result flows on in that dtype. For functions that choose or check their kernel by
    dtype while tracing: fused attention, Pallas kernels written for bfloat16. Elsewhere ``fn``
    runs as it is called: outside amp's trace, under a compute dtype of 32 bits or more, and
    inside a named scope the policy keeps in its own precision (``amp_stop``). ``when``, given
    the call's arguments, can limit it to some calls (``jax.nn.dot_product_attention`` is an
    entry point where it may pick cuDNN's kernel). Usable as ``@in_compute_dtype`` and
    ``@in_compute_dtype(when=...)``.

    Only floating-point array arguments wider than the compute dtype are cast (never float64,
    nor a weakly typed scalar: a Python number passed to the wrapped function, kept as it is);
    floating results in the compute dtype are cast back to the widest of those arguments' dtypes,
    so the traced program keeps its signature, and amp's interpreter drops that cast again.

    Args:
        fn: The function to mark. ``None`` (the default) makes ``in_compute_dtype`` return a
            decorator that marks the function it is applied to.
        when: A predicate called with the same arguments as ``fn``; a call for which it returns
            a false value runs as called. ``None`` (the default) makes every call under ``amp``
            an entry-point call.

    Returns:
        A wrapper with ``fn``'s name and docstring, called like ``fn``, that returns ``fn``'s
        result. A function that is already an entry point is returned unchanged (its ``when``
        stays). With ``fn=None``, a decorator.

    Raises:
        TypeError: If ``fn`` is given and is not callable.

    Example:
        >>> import autocast, jax, jax.numpy as jnp
        >>> @autocast.in_compute_dtype
        ... def kernel(q, k):  # stands for a kernel written for bfloat16 only
        ...     assert q.dtype == jnp.bfloat16, q.dtype
        ...     return q @ k.T
        >>> f = autocast.amp(lambda q, k: kernel(q, k).sum(), compute_dtype=jnp.bfloat16)
        >>> f(jnp.ones((2, 4)), jnp.ones((3, 4)))
        Array(24., dtype=float32)
    """
    if fn is None:
        return functools.partial(in_compute_dtype, when=when)
    if not callable(fn):
        raise TypeError(f"in_compute_dtype marks a callable, got {type(fn).__name__}")
    if getattr(fn, "_autocast_entry_point", False):
        return fn

    @functools.wraps(fn)
    def entry(*args: Any, **kwargs: Any) -> Any:
        dtype = _target_dtype()
        if dtype is None or (when is not None and not when(*args, **kwargs)):
            return fn(*args, **kwargs)
        return _call(fn, dtype, args, kwargs)

    entry._autocast_entry_point = True  # type: ignore[attr-defined]
    return entry


def fused_attention_possible(*args: Any, implementation: str | None = None, **kwargs: Any) -> bool:
    """Whether a ``jax.nn.dot_product_attention`` call may run cuDNN's fused kernel: asked
    for, or left to JAX's choice on a GPU (the device its arguments are placed on). Its XLA
    path is plain JAX that amp's own policy runs better (16-bit residuals around float32
    softmax statistics) than at the compute dtype, where it keeps float32 probabilities for
    the backward pass."""
    if implementation is not None:
        return implementation == "cudnn"
    return target_of((args, kwargs)).platform == "gpu"


# Public JAX functions that are entry points, and for which calls (None: all): marked in
# place when autocast is imported. JAX's Pallas TPU flash attention takes any float dtype
# and keeps its softmax statistics in float32; called in a float32 program, it would run
# its products in float32 on the matrix units.
BUILT_IN = (
    ("jax.nn", "dot_product_attention", fused_attention_possible),
    ("jax.experimental.pallas.ops.tpu.flash_attention", "flash_attention", None),
)

for _module, _name, _when in BUILT_IN:
    _compat.replace_public_function(_module, _name, functools.partial(in_compute_dtype, when=_when))
