"""Re-tracing a sub-jaxpr under the policy, for the dtypes its inputs have now; cached.

Every higher-order handler comes here: it says what the sub-jaxpr's inputs look like (their
avals, kinds, and which are literals) and which dtypes some outputs must keep (a loop carry,
branches that must agree), and gets back a new closed jaxpr to bind the primitive with.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Sequence

import jax
import numpy as np

from autocast import _compat
from autocast._src.policy.casting import cast_value, castable
from autocast._src.transform.histories import Slots, inbox_shape
from autocast._src.transform.interpreter import Context, eval_jaxpr


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


# Entries hold jaxprs and their constants (weights a function closed over): kept small.
TRACES = _IdentityCache(512)


def spec_of(x: Any) -> Any:
    """The abstract value of ``x`` (shape, dtype, weak type, sharding), which
    ``jax.make_jaxpr`` takes in place of an argument and which is hashable."""
    return _compat.aval_of(x)


def spec_like(var: Any, x: Any) -> Any:
    """The recorded abstract value of ``var`` with the dtype ``x`` has now (a loop body's
    slice of a scanned array, a shard of a mapped one)."""
    return with_dtype(var.aval, x.dtype)


def with_dtype(aval: Any, dtype: Any) -> Any:
    """``aval`` with another dtype, its shape, sharding and the rest unchanged."""
    return aval if aval.dtype == dtype else aval.update(dtype=np.dtype(dtype), weak_type=False)


def literals_of(invals: Sequence[Any], positions: Sequence[int] | None = None) -> dict[int, Any]:
    """The inputs that are literals of the enclosing jaxpr (NumPy scalars here), by position.

    Inside the re-traced jaxpr they are used by value, so casting them costs nothing at run
    time; they are still passed, unused, to keep the equation's signature.
    """
    chosen = range(len(invals)) if positions is None else positions
    return {i: invals[i] for i in chosen if isinstance(invals[i], np.generic)}


def retrace(
    jaxpr: Any,
    consts: Sequence[Any],
    specs: Sequence[Any],
    kinds: Sequence[int],
    ctx: Context,
    *,
    literals: dict[int, Any] | None = None,
    out_dtypes: Sequence[Any] | None = None,
    histories: Slots | None = None,
) -> Any:
    """The open ``jaxpr`` (with ``consts``) interpreted under ``ctx`` and traced again.

    ``specs`` describe the inputs, ``kinds`` their kinds, ``literals`` the inputs used by
    value, and ``out_dtypes`` (None entries free) the dtypes outputs are cast to at the end.
    ``histories``: a :class:`Slots` that counted the float8 histories the body takes (and
    says which were measured); the traced jaxpr then takes two more inputs per history, its
    history and inbox, after ``specs``, and hands them to the body's products (see
    :mod:`autocast._src.transform.histories`).
    """
    literals = literals or {}
    out_key = None if out_dtypes is None else tuple(out_dtypes)
    key = (
        id(jaxpr),
        tuple(specs),
        tuple(kinds),
        tuple((i, x.dtype, x.tobytes()) for i, x in literals.items()),  # -0.0 is not 0.0
        out_key,
        id(ctx.policy),
        ctx.compute_dtype,
        ctx.scopes,
        ctx.recompute,
        ctx.in_loop,
    )
    held = (jaxpr, ctx.policy)
    # An observer must see every equation, and float8 histories are handed out per call, so
    # nothing is served from the cache to either.
    cached = ctx.observer is None and ctx.fp8_history is None and histories is None
    hit = TRACES.get(key, held) if cached else None
    if hit is not None:
        return hit
    n_rows = 0 if histories is None else 2 * histories.taken

    def interpret(*args: Any) -> list[Any]:
        run_ctx = ctx
        if n_rows:
            args, flat = args[: len(args) - n_rows], args[len(args) - n_rows :]
            slots = Slots(list(zip(flat[::2], flat[1::2])), histories.measuring, histories.measured)
            run_ctx = dataclasses.replace(ctx, fp8_history=slots)
        args = [literals.get(i, a) for i, a in enumerate(args)]
        outs = eval_jaxpr(jaxpr, consts, args, run_ctx, kinds)
        if n_rows:
            run_ctx.fp8_history.check_all_taken()
        if out_key is not None:
            outs = [
                x if d is None or not castable(x, d) else cast_value(x, d)
                for x, d in zip(outs, out_key)
            ]
        return outs

    row_specs = [
        jax.ShapeDtypeStruct(shape, np.float32)
        for s in ([] if histories is None else histories.shapes)
        for shape in (s, inbox_shape(s))
    ]
    traced = jax.make_jaxpr(interpret)(*specs, *row_specs)
    if cached:
        TRACES.put(key, held, traced)
    return traced


def retrace_closed(closed: Any, invals: Sequence[Any], kinds: Sequence[int], ctx: Context) -> Any:
    """A closed sub-jaxpr called with exactly ``invals`` (``jit``, ``custom_jvp``)."""
    return retrace(
        closed.jaxpr,
        closed.consts,
        [spec_of(x) for x in invals],
        kinds,
        ctx,
        literals=literals_of(invals),
    )
