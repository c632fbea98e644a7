"""Handlers for primitives that carry sub-jaxprs, one function each, in a table by name.

A handler re-interprets the sub-jaxpr under the policy with the dtypes its inputs actually
have (a bfloat16 activation entering a jitted helper stays bfloat16) and binds the primitive
again with the re-traced sub-jaxpr and its other parameters unchanged. Adding support for a
primitive is one function and one table entry. A primitive with sub-jaxprs that has no entry
raises: it is never bound unchanged, which would silently skip everything inside it.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from autocast import _compat
from autocast.interpreter import Context, decide_by_scope, eval_jaxpr
from autocast.rules import _castable, cast_value, use_original_precision

Handler = Callable[[Any, list, Sequence[int], Context], Sequence[Any]]


class _IdentityCache:
    """A bounded LRU cache whose keys name objects by ``id``; each entry holds those objects,
    so no id can be reused by another object while its entry lives.

    Shared by every amp-wrapped function: re-wrapping a function (as a train step re-traced
    for a new shape does) reuses the re-traced helpers, and with them JAX's own lowering
    caches.
    """

    def __init__(self, size: int) -> None:
        self._size = size
        self._entries: collections.OrderedDict = collections.OrderedDict()

    def get(self, key: tuple, held: tuple) -> Any:
        entry = self._entries.get(key)
        if entry is None or any(a is not b for a, b in zip(entry[0], held)):
            return None
        self._entries.move_to_end(key)
        return entry[1]

    def put(self, key: tuple, held: tuple, value: Any) -> None:
        self._entries[key] = (held, value)
        if len(self._entries) > self._size:
            self._entries.popitem(last=False)


_TRACES = _IdentityCache(4096)


def _context_key(ctx: Context) -> tuple:
    return (id(ctx.policy), ctx.compute_dtype, ctx.scopes)


def _abstract(x: Any) -> jax.ShapeDtypeStruct:
    aval = _compat.aval_of(x)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)


def retrace(
    closed: Any, invals: Sequence[Any], kinds: Sequence[int], ctx: Context
) -> Any:
    """``closed`` re-traced under ``ctx`` for the avals of ``invals``; cached.

    Inputs that are literals in the enclosing jaxpr (NumPy scalars here) are used by value
    inside, so casting them costs nothing at run time; they are still passed, unused, to keep
    the equation's signature.
    """
    specs = [_abstract(x) for x in invals]
    literals = {i: x for i, x in enumerate(invals) if isinstance(x, np.generic)}
    key = (
        id(closed),
        tuple((s.shape, s.dtype, s.weak_type) for s in specs),
        tuple(kinds),
        tuple((i, x.dtype, x.item()) for i, x in literals.items()),
        _context_key(ctx),
    )
    held = (closed, ctx.policy)
    hit = _TRACES.get(key, held)
    if hit is not None:
        return hit

    def interpret(*args: Any) -> list[Any]:
        args = [literals.get(i, a) for i, a in enumerate(args)]
        return eval_jaxpr(closed.jaxpr, closed.consts, args, ctx, kinds)

    traced = jax.make_jaxpr(interpret)(*specs)
    _TRACES.put(key, held, traced)
    return traced


def _jit(eqn: Any, invals: list, kinds: Sequence[int], ctx: Context) -> Sequence[Any]:
    """``jax.jit`` (``pjit`` before JAX 0.7): re-bind with the re-traced jaxpr.

    Shardings, donation, the name and the inlining flag are kept as they were.
    """
    jaxpr = retrace(eqn.params["jaxpr"], invals, kinds, ctx.enter(eqn))
    return _compat.bind_equation(eqn, invals, {**eqn.params, "jaxpr": jaxpr})


def _inexact(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.inexact)


def _custom_jvp_rule_jaxpr(eqn: Any, ctx: Context) -> Any:
    """The jaxpr of ``eqn``'s own JVP rule at the original dtypes: primals and float tangents
    in, primal and float tangent outputs out. Traced once per equation."""
    key = ("custom_jvp_rule", id(eqn))
    hit = _TRACES.get(key, (eqn,))
    if hit is not None:
        return hit
    in_avals = [v.aval for v in eqn.invars]
    diff = [_inexact(a.dtype) for a in in_avals]
    out_diff = [_inexact(v.aval.dtype) for v in eqn.outvars]

    def rule(*args: Any) -> list[Any]:
        primals = tuple(args[: len(in_avals)])
        it = iter(args[len(in_avals) :])
        tangents = tuple(
            next(it) if d else np.zeros(a.shape, jax.dtypes.float0) for a, d in zip(in_avals, diff)
        )
        outs, out_tangents = jax.jvp(
            lambda *p: _as_list(eqn, _compat.bind_equation(eqn, p, eqn.params)), primals, tangents
        )
        return list(outs) + [t for t, d in zip(out_tangents, out_diff) if d]

    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in in_avals]
    traced = jax.make_jaxpr(rule)(*specs, *[s for s, d in zip(specs, diff) if d])
    _TRACES.put(key, (eqn,), traced)
    return traced


def _as_list(eqn: Any, outs: Any) -> list[Any]:
    return list(outs) if eqn.primitive.multiple_results else [outs]


def _custom_jvp(eqn: Any, invals: list, kinds: Sequence[int], ctx: Context) -> Sequence[Any]:
    """``jax.custom_jvp`` functions (``jax.nn.relu``...): the primal and the user's JVP rule
    both run under the policy, and the custom rule is still what differentiation uses."""
    inner = ctx.enter(eqn)
    call_jaxpr, _ = _compat.custom_jvp_parts(eqn)
    primal = retrace(call_jaxpr, invals, kinds, inner)
    out_dtypes = [a.dtype for a in primal.out_avals]

    @jax.custom_jvp
    def fn(*args: Any) -> list[Any]:
        return jax.core.eval_jaxpr(primal.jaxpr, primal.consts, *args)

    @fn.defjvp
    def fn_jvp(primals: Sequence[Any], tangents: Sequence[Any]) -> tuple[list, list]:
        rule = _custom_jvp_rule_jaxpr(eqn, ctx)
        float_tangents = [t for t, v in zip(tangents, eqn.invars) if _inexact(v.aval.dtype)]
        outs = eval_jaxpr(rule.jaxpr, rule.consts, [*primals, *float_tangents], inner)
        n_out = len(eqn.outvars)
        out_primals = [cast_value(x, d) for x, d in zip(outs[:n_out], out_dtypes)]
        it = iter(outs[n_out:])
        out_tangents = [
            cast_value(next(it), d) if _inexact(v.aval.dtype) else np.zeros(v.aval.shape, jax.dtypes.float0)
            for v, d in zip(eqn.outvars, out_dtypes)
        ]
        return out_primals, out_tangents

    return fn(*invals)


HANDLERS: dict[str, Handler] = {
    **{name: _jit for name in _compat.JIT_NAMES},
    "custom_jvp_call": _custom_jvp,
}


def _bind_in_original_precision(
    eqn: Any, invals: list, kinds: Sequence[int], ctx: Context
) -> Sequence[Any]:
    """An unsupported higher-order equation under a scope that asks for original precision:
    bound exactly as recorded, on inputs cast back to their recorded dtypes."""
    invals = [
        cast_value(x, v.aval.dtype) if _castable(x, v.aval.dtype) else x
        for x, v in zip(invals, eqn.invars)
    ]
    return _compat.bind_equation(eqn, invals, eqn.params)


# Primitive names seen to carry no sub-jaxprs: the common case is decided once per name.
_FIRST_ORDER: set[str] = set(_compat.FIRST_ORDER_WITH_JAXPRS)


def handler_for(eqn: Any, ctx: Context) -> Handler | None:
    """The handler of a higher-order equation, None for a first-order one.

    Raises ``NotImplementedError`` for a primitive that carries sub-jaxprs but has no handler,
    unless a named scope puts the equation in original precision (``amp_stop``).
    """
    name = eqn.primitive.name
    if name in _FIRST_ORDER:
        return None
    handler = HANDLERS.get(name)
    if handler is not None:
        return handler
    carried = _compat.sub_jaxpr_params(eqn.params)
    if not carried:
        _FIRST_ORDER.add(name)
        return None
    if decide_by_scope(eqn, ctx) is use_original_precision:
        return _bind_in_original_precision
    raise NotImplementedError(
        f"amp does not support the higher-order primitive '{name}' (it carries the sub-jaxpr "
        f"parameter(s) {', '.join(carried)}); supported: {', '.join(sorted(HANDLERS))}. "
        "Wrap the call in autocast.amp_stop() to run it untouched in original precision."
    )
