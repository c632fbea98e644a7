"""amp's program and its float32 reference, evaluated together, equation by equation.

The numerics debugger (:func:`autocast.diagnose`) traces amp's program with each output of a
user's equation marked (a ``checkpoint_name`` whose name holds the equation's *site*
number), then evaluates that one jaxpr once, carrying two values per variable: amp's, and
the reference's, which is the same equation computed with every 16-bit floating dtype
widened to float32. Because amp only casts and re-types (it never reorders arithmetic), the
reference is the original program in float32. Where amp rounded a literal to 16 bits, the
reference takes the literal the original program had.

At each marked equation both values go to the host (an ordered callback, so in the order
the program runs them, loop iterations included), where a :class:`Recorder` measures them.
Loops run as loops, carrying both values; a ``while`` runs until both amp's loop and the
reference's have stopped, each side keeping its last value once its own condition fails;
both sides of a ``cond`` follow amp's branch. Iterations or branches where the two differ
are counted, and a ``while`` iteration only one side runs is not measured.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from autocast import _compat
from autocast._src.tools.measure import SCALE_TYPES
from autocast._src.tree import is_floating_dtype

PREFIX = "autocast.diagnose/"
_F32 = np.dtype(np.float32)


def mark(value: Any, site: int, index: int) -> Any:
    """``value`` (output ``index`` of the equation numbered ``site``), marked for the pass."""
    return checkpoint_name(value, f"{PREFIX}{site}/{index}")


def site_of(eqn: Any) -> int | None:
    """The site number a marking equation carries; None for any other equation."""
    name = _compat.mark_name(eqn)  # checkpoint_name's mark, with or without jax_remat3
    if not isinstance(name, str) or not name.startswith(PREFIX):
        return None
    return int(name[len(PREFIX) :].split("/")[0])


def marked(jaxpr: Any) -> dict[Any, int]:
    """Variable -> site, for the variables ``jaxpr`` marks."""
    return {
        eqn.invars[0]: s
        for eqn in jaxpr.eqns
        if (s := site_of(eqn)) is not None and not isinstance(eqn.invars[0], _compat.Literal)
    }


def widen(dtype: Any) -> Any:
    """float32 for a floating dtype narrower than it (bfloat16, float16, float8), else ``dtype``."""
    dtype = np.dtype(dtype)
    return _F32 if is_floating_dtype(dtype) and dtype.itemsize < 4 else dtype


def _widen_param(value: Any) -> Any:
    if isinstance(value, np.dtype) or (isinstance(value, type) and issubclass(value, np.generic)):
        return widen(value)
    return value


def _as(x: Any, dtype: Any) -> Any:
    """``x`` in exactly ``dtype``, not weakly typed (loop carries must match exactly).
    Extended dtypes (typed PRNG keys) are left as they are."""
    if jax.dtypes.issubdtype(getattr(x, "dtype", _F32), jax.dtypes.extended):
        return x
    return jax.lax.convert_element_type(x, dtype)


def _is_float(x: Any) -> bool:
    return hasattr(x, "dtype") and is_floating_dtype(x.dtype)


def _widened(x: Any) -> Any:
    return _as(x, widen(x.dtype)) if _is_float(x) else x


@dataclasses.dataclass
class Value:
    """A variable of amp's program: amp's value and the reference's."""

    amp: Any
    ref: Any


def compare(amp: np.ndarray, ref: np.ndarray) -> tuple[float, int, int]:
    """``(relative error, overflow count, underflow count)`` of ``amp`` against ``ref``.

    The relative error is ``|amp - ref| / max(|ref|, |amp|)`` in the L2 norm over the
    elements where both are finite (0 when both are all zeros); infinite where amp is not
    finite but the reference is (an *overflow*). Dividing by the larger norm keeps a value
    that cancels to rounding noise (a sum that is zero in exact arithmetic) from reading as
    an error of thousands: at most 2, 1 for a value amp flushed to zero. An *underflow* is
    an element amp flushed to zero where the reference is not zero.
    """
    a = np.asarray(amp, np.float64)
    r = np.asarray(ref, np.float64)
    finite_r = np.isfinite(r)
    finite_a = np.isfinite(a)
    overflow = int(np.count_nonzero(finite_r & ~finite_a))
    underflow = int(np.count_nonzero(finite_r & (r != 0) & (a == 0)))
    if overflow:
        return float("inf"), overflow, underflow
    both = finite_r & finite_a
    scale = max(float(np.linalg.norm(r[both])), float(np.linalg.norm(a[both])))
    dn = float(np.linalg.norm(a[both] - r[both]))
    rel = dn / scale if scale > 0 else 0.0
    return rel, overflow, underflow


class Recorder:
    """Host side: measures each marked equation as the program runs it and keeps, per site,
    ``[worst error, worst added error, overflow total, underflow total, evaluation count at
    the first overflow (None if none), runs]``. ``before[site]`` names the sites whose
    errors reach that site's inputs (:mod:`autocast._src.tools.provenance`)."""

    def __init__(self, before: dict[int, frozenset]) -> None:
        self.before = before
        self.latest: dict[int, float] = {}
        self.stats: dict[int, list] = {}
        self.count = 0
        self.diverged = 0

    def site(self, site: int, active: Any, amps: list, refs: list) -> None:
        if not bool(active):
            return
        self.count += 1
        rel, overflow, underflow = 0.0, 0, 0
        for a, r in zip(amps, refs):
            e, o, u = compare(a, r)
            rel, overflow, underflow = max(rel, e), overflow + o, underflow + u
        before = max((self.latest.get(s, 0.0) for s in self.before.get(site, ())), default=0.0)
        added = 0.0 if before >= rel else rel - before
        self.latest[site] = rel
        st = self.stats.setdefault(site, [0.0, 0.0, 0, 0, None, 0])
        st[0], st[1] = max(st[0], rel), max(st[1], added)
        st[2] += overflow
        st[3] += underflow
        if overflow and st[4] is None:
            st[4] = self.count
        st[5] += 1

    def diverge(self, flag: Any) -> None:
        self.diverged += int(flag)


@dataclasses.dataclass(frozen=True)
class Site:
    """What the trace recorded of one user's equation: the equation of the original program
    (literals, source, scopes), the named scopes enclosing it, and the source of the call
    it was inside (for equations of library functions that have no line of the user's)."""

    eqn: Any
    scopes: tuple[str, ...]
    caller: Any = None


class Pass:
    """One evaluation of amp's jaxpr beside its reference, reporting to ``recorder``.
    ``dtypes`` collects, per site, the floating dtypes amp bound the equation with."""

    def __init__(self, sites: Sequence[Site], recorder: Recorder) -> None:
        self.sites = sites
        self.recorder = recorder
        self.dtypes: dict[int, tuple[str, ...]] = {}
        # whether the equations being evaluated count (False in a while iteration that only
        # one side runs): a traced boolean inside loops
        self.active: Any = np.bool_(True)
        self._marks: dict[int, dict[Any, int]] = {}

    def run(self, jaxpr: Any, consts: Sequence[Value], args: Sequence[Value]) -> list[Value]:
        env: dict[Any, Value] = {}
        marks = self._marks_of(jaxpr)
        env.update(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))

        def read(v: Any) -> Value:
            if isinstance(v, _compat.Literal):
                value = _compat.literal_value(v)
                return Value(value, _literal_ref(value))
            return env[v]

        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            call = _compat.called_jaxpr(eqn)
            if site_of(eqn) is not None:
                outs = ins  # the marked value passes through; it was measured at its producer
            elif call is not None:
                outs = self.inline(*call, ins)
                site = next((marks[v] for v in eqn.outvars if v in marks), None)
                if site is not None:
                    # an equation amp evaluated as a call of its own (a scaled float8
                    # product): it ran in the narrowest dtype it computed with
                    self._record(
                        site, _narrowest(call[0]), [x.amp for x in outs], [x.ref for x in outs]
                    )
            else:
                handler = _HANDLERS.get(eqn.primitive.name)
                outs = (
                    handler(self, eqn, ins)
                    if handler is not None
                    else self._first_order(eqn, ins, marks)
                )
            for v, x in zip(eqn.outvars, outs):
                if not _compat.is_drop_var(v):
                    env[v] = x
        return [read(v) for v in jaxpr.outvars]

    def inline(self, jaxpr: Any, consts: Sequence[Any], ins: list[Value]) -> list[Value]:
        """``jaxpr`` with constants ``consts`` (the same in both programs) on ``ins``."""
        return self.run(jaxpr, [_constant(c) for c in consts], ins)

    def evaluate(self, closed: Any, args: Sequence[Any]) -> list[Value]:
        """amp's traced program ``closed`` on ``args``, beside its reference."""
        return self.inline(closed.jaxpr, closed.consts, [Value(x, _widened(x)) for x in args])

    def _marks_of(self, jaxpr: Any) -> dict[Any, int]:
        hit = self._marks.get(id(jaxpr))
        if hit is None:
            hit = self._marks[id(jaxpr)] = marked(jaxpr)
        return hit

    def _first_order(self, eqn: Any, ins: list[Value], marks: dict[Any, int]) -> list[Value]:
        amp_out = _as_list(eqn, _compat.bind_equation(eqn, [x.amp for x in ins], eqn.params))
        site = next((marks[v] for v in eqn.outvars if v in marks), None)
        if eqn.effects:
            ref_out = [_widened(a) for a in amp_out]  # effects happen once
        elif (
            _compat.sub_jaxpr_params(eqn.params)
            and eqn.primitive.name not in _compat.FIRST_ORDER_WITH_JAXPRS
        ):
            # a call the pass does not look inside (shard_map, a kernel, another library's
            # primitive): its reference is computed as amp computes it
            ref_out = self._as_amp(eqn, ins)
        else:
            ref_out = self._reference(eqn, ins, site)
        ref_out = [_as(r, widen(a.dtype)) if _is_float(a) else r for a, r in zip(amp_out, ref_out)]
        if site is not None:
            self._record(site, _ran_in(ins, amp_out), amp_out, ref_out)
        return [Value(a, r) for a, r in zip(amp_out, ref_out)]

    def _record(self, site: int, dtypes: tuple[str, ...], amp_out: list, ref_out: list) -> None:
        """Sends the floating outputs of ``site`` to the recorder as the program runs."""
        self.dtypes.setdefault(site, dtypes)
        floats = [i for i, a in enumerate(amp_out) if _is_float(a)]
        jax.debug.callback(
            functools.partial(self.recorder.site, site),
            self.active,
            [amp_out[i] for i in floats],
            [ref_out[i] for i in floats],
            ordered=True,
        )

    def _reference(self, eqn: Any, ins: list[Value], site: int | None) -> list[Any]:
        refs = [x.ref for x in ins]
        original = self.sites[site].eqn if site is not None else None
        if original is not None and len(original.invars) == len(eqn.invars):
            for i, (mine, theirs) in enumerate(zip(eqn.invars, original.invars)):
                if isinstance(mine, _compat.Literal) and isinstance(theirs, _compat.Literal):
                    refs[i] = _literal_ref(_compat.literal_value(theirs))
        params = {k: _widen_param(v) for k, v in eqn.params.items()}
        try:
            params = _compat.retype_scalar_computation(eqn, refs, params)
            return _as_list(eqn, _compat.bind_equation(eqn, refs, params))
        except (TypeError, ValueError):
            # an equation that only exists in 16 bits (a bitcast, a kernel written for them)
            return self._as_amp(eqn, ins)

    def _as_amp(self, eqn: Any, ins: list[Value]) -> list[Any]:
        """The reference computed in amp's own dtypes from the reference's inputs."""
        refs = [_as(x.ref, x.amp.dtype) if _is_float(x.amp) else x.ref for x in ins]
        return _as_list(eqn, _compat.bind_equation(eqn, refs, eqn.params))


def _as_list(eqn: Any, outs: Any) -> list[Any]:
    return list(outs) if eqn.primitive.multiple_results else [outs]


def _literal_ref(value: Any) -> Any:
    dtype = np.asarray(value).dtype
    return np.asarray(value, widen(dtype))[()] if is_floating_dtype(dtype) else value


def _constant(c: Any) -> Value:
    return Value(c, _widened(c))


def _ran_in(ins: list[Value], outs: list[Any]) -> tuple[str, ...]:
    names = [np.dtype(x.amp.dtype).name for x in ins if _is_float(x.amp)]
    if not names:
        names = [np.dtype(x.dtype).name for x in outs if _is_float(x)]
    return tuple(dict.fromkeys(names))


def _narrowest(jaxpr: Any) -> tuple[str, ...]:
    """The narrowest floating dtype the equations of ``jaxpr`` take (none if none); a block
    scale's ``float8_e8m0fnu`` is no dtype values are computed in."""
    dtypes = {
        np.dtype(v.aval.dtype)
        for eqn in jaxpr.eqns
        for v in eqn.invars
        if hasattr(v.aval, "dtype")
        and is_floating_dtype(v.aval.dtype)
        and np.dtype(v.aval.dtype).name not in SCALE_TYPES
    }
    return (min(dtypes, key=lambda d: (d.itemsize, d.name)).name,) if dtypes else ()


# --- the higher-order equations amp's program holds ----------------------------------------


def _pack(values: Sequence[Value]) -> tuple[list, list]:
    return [x.amp for x in values], [x.ref for x in values]


def _unpack(amps: Sequence[Any], refs: Sequence[Any]) -> list[Value]:
    return [Value(a, r) for a, r in zip(amps, refs)]


def _entering(carry: Sequence[Value]) -> tuple[list, list]:
    """A loop's initial carries, the reference's in exactly the widened dtypes."""
    amps, refs = _pack(carry)
    return amps, [_as(r, widen(a.dtype)) if _is_float(a) else r for a, r in zip(amps, refs)]


def _exactly(values: Sequence[Any], like: Sequence[Any]) -> list[Any]:
    return [_as(v, w.dtype) for v, w in zip(values, like)]


def _scan(p: Pass, eqn: Any, ins: list[Value]) -> list[Value]:
    prm = eqn.params
    body = prm["jaxpr"]
    n_consts, n_carry = _compat.scan_layout(eqn)
    consts, carry, xs = (
        ins[:n_consts],
        ins[n_consts : n_consts + n_carry],
        ins[n_consts + n_carry :],
    )
    init_a, init_r = _entering(carry)

    def step(state: tuple, x: tuple) -> tuple:
        outs = p.inline(body.jaxpr, body.consts, [*consts, *_unpack(*state), *_unpack(*x)])
        a, r = _pack(outs[:n_carry])
        return (_exactly(a, init_a), _exactly(r, init_r)), _pack(outs[n_carry:])

    (amps, refs), (ya, yr) = jax.lax.scan(
        step, (init_a, init_r), _pack(xs), length=prm["length"], reverse=prm["reverse"]
    )
    return [*_unpack(amps, refs), *_unpack(ya, yr)]


def _while(p: Pass, eqn: Any, ins: list[Value]) -> list[Value]:
    prm = eqn.params
    cond, body = prm["cond_jaxpr"], prm["body_jaxpr"]
    n_cond, n_body = _compat.while_layout(eqn)
    cond_consts, body_consts, carry = (
        ins[:n_cond],
        ins[n_cond : n_cond + n_body],
        ins[n_cond + n_body :],
    )
    init_a, init_r = _entering(carry)
    outer = p.active

    def going(amps: list, refs: list) -> tuple[Any, Any]:
        # the condition's equations are evaluated, not measured
        p.active = np.bool_(False)
        out = p.inline(cond.jaxpr, cond.consts, [*cond_consts, *_unpack(amps, refs)])[0]
        return out.amp, out.ref

    def keep_going(state: tuple) -> Any:
        amp_go, ref_go = going(*state)
        p.active = outer
        return amp_go | ref_go

    def step(state: tuple) -> tuple:
        amps, refs = state
        amp_go, ref_go = going(amps, refs)
        p.active = outer & amp_go & ref_go
        jax.debug.callback(p.recorder.diverge, amp_go != ref_go, ordered=True)
        a, r = _pack(p.inline(body.jaxpr, body.consts, [*body_consts, *_unpack(amps, refs)]))
        p.active = outer
        a = [jax.numpy.where(amp_go, n, o) for n, o in zip(_exactly(a, amps), amps)]
        r = [jax.numpy.where(ref_go, n, o) for n, o in zip(_exactly(r, refs), refs)]
        return a, r

    amps, refs = jax.lax.while_loop(keep_going, step, (init_a, init_r))
    return _unpack(amps, refs)


def _cond(p: Pass, eqn: Any, ins: list[Value]) -> list[Value]:
    index, operands = ins[0], ins[1:]

    def branch(closed: Any) -> Callable[..., tuple]:
        def run(amps: list, refs: list) -> tuple:
            a, r = _pack(p.inline(closed.jaxpr, closed.consts, _unpack(amps, refs)))
            return a, [_widened(x) if _is_float(y) else x for x, y in zip(r, a)]

        return run

    jax.debug.callback(p.recorder.diverge, index.amp != index.ref, ordered=True)
    amps, refs = jax.lax.switch(
        index.amp, [branch(b) for b in eqn.params["branches"]], *_pack(operands)
    )
    return _unpack(amps, refs)


# Loops and branches; calls are inlined (``_compat.called_jaxpr``).
_HANDLERS: dict[str, Callable[..., list[Value]]] = {
    "scan": _scan,
    "while": _while,
    "cond": _cond,
}
