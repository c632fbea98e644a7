"""Which earlier equations an equation's inputs carry error from, read off amp's program.

The numerics debugger marks each output of a user's equation with its *site* number. A
value's error comes from the sites it was computed from through equations amp inserted
(casts, broadcasts, the copies loops and calls make): those pass error on unchanged. This
walk finds, for every site, the sites its inputs come from that way, through calls, loops
(to a fixed point over iterations) and branches, without evaluating anything.
"""

from __future__ import annotations

from typing import Any, Sequence

from autocast import _compat
from autocast._src.tools.paired import marked, site_of

_EMPTY: frozenset = frozenset()


def _union(sets: Sequence[frozenset]) -> frozenset:
    return frozenset().union(*sets) if sets else _EMPTY


class Walk:
    """Collects ``before[site]``: the sites whose errors reach that site's inputs."""

    def __init__(self) -> None:
        self.before: dict[int, frozenset] = {}

    def run(self, jaxpr: Any, ins: Sequence[frozenset]) -> list[frozenset]:
        env: dict[Any, frozenset] = dict(zip(jaxpr.invars, ins))
        marks = marked(jaxpr)

        def read(v: Any) -> frozenset:
            return _EMPTY if isinstance(v, _compat.Literal) else env.get(v, _EMPTY)

        for eqn in jaxpr.eqns:
            ins_ = [read(v) for v in eqn.invars]
            call = _compat.called_jaxpr(eqn)
            if site_of(eqn) is not None:
                outs = ins_
            else:
                rule = _RULES.get(eqn.primitive.name)
                if call is not None:
                    outs = self.run(call[0], ins_)
                elif rule is not None:
                    outs = rule(self, eqn, ins_)
                else:
                    outs = [_union(ins_)] * len(eqn.outvars)
                site = next((marks[v] for v in eqn.outvars if v in marks), None)
                if site is not None:
                    self.before[site] = self.before.get(site, _EMPTY) | _union(ins_)
                    outs = [frozenset({site})] * len(eqn.outvars)
            for v, s in zip(eqn.outvars, outs):
                env[v] = s
        return [read(v) for v in jaxpr.outvars]


def _loop(
    w: Walk,
    body: Any,
    fixed: list[frozenset],
    carry: list[frozenset],
    rest: list[frozenset],
    n_carry: int,
) -> list[frozenset]:
    """Runs a loop body until its carries' sources stop growing; returns the last outputs."""
    while True:
        outs = w.run(body, [*fixed, *carry, *rest])
        grown = [c | o for c, o in zip(carry, outs[:n_carry])]
        if grown == carry:
            return outs
        carry = grown


def _scan(w: Walk, eqn: Any, ins: list[frozenset]) -> list[frozenset]:
    p = eqn.params
    nc, nk = _compat.scan_layout(eqn)
    outs = _loop(w, p["jaxpr"].jaxpr, ins[:nc], ins[nc : nc + nk], ins[nc + nk :], nk)
    return [c | o for c, o in zip(ins[nc : nc + nk], outs[:nk])] + outs[nk:]


def _while(w: Walk, eqn: Any, ins: list[frozenset]) -> list[frozenset]:
    p = eqn.params
    nc, nb = _compat.while_layout(eqn)
    carry = ins[nc + nb :]
    outs = _loop(w, p["body_jaxpr"].jaxpr, ins[nc : nc + nb], carry, [], len(carry))
    return [c | o for c, o in zip(carry, outs)]


def _cond(w: Walk, eqn: Any, ins: list[frozenset]) -> list[frozenset]:
    per_branch = [w.run(b.jaxpr, ins[1:]) for b in eqn.params["branches"]]
    return [_union(list(outs)) for outs in zip(*per_branch)]


# Loops and branches; calls are walked into (``_compat.called_jaxpr``).
_RULES = {
    "scan": _scan,
    "while": _while,
    "cond": _cond,
}


def before_sites(jaxpr: Any) -> dict[int, frozenset]:
    """For each site marked in ``jaxpr``: the sites whose error reaches its inputs."""
    w = Walk()
    w.run(jaxpr, [_EMPTY] * len(jaxpr.invars))
    return w.before
