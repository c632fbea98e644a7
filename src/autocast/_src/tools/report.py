"""What amp did to a function: which primitive ran in which dtype, by which rule, which
casts it added and where, and what that saved (measures read off the jaxpr)."""

from __future__ import annotations

import collections
import dataclasses
import os
from typing import Any, Callable, Mapping

import jax
import numpy as np
from jax.extend import source_info_util

from autocast import _compat
from autocast._src.tools import measure as _measure
from autocast._src.transform.amp import amp as _amp
from autocast._src.tree import is_array, is_inexact_dtype


@dataclasses.dataclass(frozen=True)
class PrimitiveRow:
    """One line of the report: a primitive with one combination of dtypes and rule."""

    primitive: str
    count: int
    input_dtypes: str
    output_dtypes: str
    rule: str


@dataclasses.dataclass(frozen=True)
class CastRow:
    """Casts amp added at one place: ``from -> to`` dtypes, where, how many."""

    source: str
    target: str
    where: str
    count: int


@dataclasses.dataclass(frozen=True)
class Report:
    """The precision report of one call; ``str(report)`` renders it as text tables.

    ``summary`` holds the figures: ``low_precision_flop_share`` (forward and, when the
    function can be differentiated, ``backward``), ``fp8_flop_share`` likewise for float8
    operands (only where amp runs float8 products), ``casts`` (casts amp added),
    ``residual_bytes`` and ``residual_bytes_original`` (bytes ``jax.vjp`` keeps for the
    backward pass with and without amp, ``None`` when not differentiable). The backward
    pass is taken with respect to the floating-point array leaves of the arguments, as
    Equinox's filtered transformations take it; where it cannot be (a custom rule that
    refuses a tangent), ``backward`` says why and the forward figures are still given.

    Attributes:
        rows: One row per primitive and combination of dtypes and rule, most frequent first:
            each has the fields ``primitive``, ``count``, ``input_dtypes`` and
            ``output_dtypes`` (dtype names joined by commas, ``"-"`` for none) and ``rule``
            (the precision function's name).
        casts: The casts amp added, grouped by place, most frequent first: each row has the
            fields ``source`` and ``target`` (dtype names), ``where`` (named scope and source
            location) and ``count``.
        summary: The figures described above, a dict from their names to numbers, dicts with
            the keys ``"forward"`` and ``"backward"``, or ``None``; with the key ``backward``
            (a string) where the backward pass could not be measured, or only with respect to
            the first argument.

    Example:
        >>> import autocast, jax.numpy as jnp
        >>> f = lambda w: jnp.sum(w @ w)
        >>> r = autocast.report(f, compute_dtype=jnp.bfloat16)(jnp.ones((2, 2)))
        >>> [(x.primitive, x.input_dtypes, x.rule) for x in r.rows if x.primitive == "dot_general"]
        [('dot_general', 'bfloat16,bfloat16', 'use_compute_precision')]
    """

    rows: tuple[PrimitiveRow, ...]
    casts: tuple[CastRow, ...]
    summary: Mapping[str, Any]

    def __str__(self) -> str:
        lines = ["amp precision report", ""]
        lines += _table(
            ("primitive", "count", "inputs", "outputs", "rule"),
            [
                (r.primitive, str(r.count), r.input_dtypes, r.output_dtypes, r.rule)
                for r in self.rows
            ],
        )
        lines += ["", "casts amp added"]
        lines += (
            _table(
                ("from", "to", "where", "count"),
                [(c.source, c.target, c.where, str(c.count)) for c in self.casts],
            )
            if self.casts
            else ["  (none)"]
        )
        lines += ["", "summary"]
        lines += [f"  {k}: {_fmt(v)}" for k, v in self.summary.items()]
        return "\n".join(lines)


def _fmt(v: Any) -> str:
    if isinstance(v, dict):
        return ", ".join(f"{k} {_fmt(x)}" for k, x in v.items())
    if isinstance(v, float):
        return f"{v:.1%}" if 0 <= v <= 1 else f"{v:.4g}"
    return str(v)


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)
    ]
    line = lambda cells: ("  " + "  ".join(c.ljust(w) for c, w in zip(cells, widths))).rstrip()  # noqa: E731
    return [line(header), line(tuple("-" * w for w in widths))] + [line(r) for r in rows]


def _dtype_name(dtype: Any) -> str:
    """``float32``, ``bfloat16``... and for an extended dtype its own name, such as the
    ``key<fry>`` of a typed PRNG key, which NumPy cannot interpret."""
    return dtype.name if hasattr(dtype, "name") else str(dtype)


def _dtypes(values: Any) -> str:
    names = [_dtype_name(x.dtype) for x in values if hasattr(x, "dtype")]
    return ",".join(names) if names else "-"


_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _where(eqn: Any) -> str:
    scope = str(eqn.source_info.name_stack)
    location = source_info_util.summarize(eqn.source_info)
    return f"{scope} @ {location}" if scope else location


def _cast_places(jaxpr: Any) -> dict[int, str]:
    """Where each cast of ``jaxpr`` is reported: its own line, or, for one bound by amp's own
    code outside any equation of the user's (a region's input cast before a final sum), the
    line of the user's equation that takes it."""
    consumers: dict[Any, Any] = {}
    for eqn in _measure.equations(jaxpr):
        for v in eqn.invars:
            if not isinstance(v, _compat.Literal):
                consumers.setdefault(v, eqn)
    places = {}
    for eqn in _measure.float_casts(jaxpr):
        at, hops = eqn, 0
        while _PACKAGE in source_info_util.summarize(at.source_info) and hops < 16:
            nxt = consumers.get(at.outvars[0])
            if nxt is None:
                break
            at, hops = nxt, hops + 1
        places[id(eqn)] = _where(at)
    return places


def _cotangent(out: Any) -> Any:
    """Ones for a floating output; the symbolic zero ``float0`` for the rest (integers,
    booleans, typed PRNG keys), which is all ``jax.vjp`` accepts for them."""
    if is_inexact_dtype(out.dtype):
        return np.ones(out.shape, out.dtype)
    return np.zeros(out.shape, jax.dtypes.float0)


def _over_floats(
    f: Callable[..., Any], leaves: list, in_tree: Any, floats: list[int]
) -> Callable[..., Any]:
    """``f`` as a function of the floating-point array leaves of its arguments (positions
    ``floats``), the others held as given, returning its floating-point array outputs: what
    a gradient can be taken of, as Equinox's filtered transformations take it."""

    def flat(*xs: Any) -> list[Any]:
        full = list(leaves)
        for i, x in zip(floats, xs):
            full[i] = x
        args, kwargs = jax.tree_util.tree_unflatten(in_tree, full)
        outs = jax.tree_util.tree_leaves(f(*args, **kwargs))
        return [y for y in outs if is_array(y) and is_inexact_dtype(y.dtype)]

    return flat


def _pullback(f: Callable[..., Any]) -> Callable[..., Any]:
    """``f`` followed by its backward pass, for reading both off one jaxpr."""

    def run_vjp(*args: Any) -> Any:
        out, vjp_fn = jax.vjp(f, *args)
        return vjp_fn(jax.tree_util.tree_map(_cotangent, out))

    return run_vjp


def report(
    fn: Callable[..., Any],
    *,
    compute_dtype: Any = None,
    amp_policy: Mapping[Any, Callable[..., Any]] | None = None,
) -> Callable[..., Report]:
    """Explains what ``amp(fn, compute_dtype=..., amp_policy=...)`` does on given arguments.

    Nothing is run: everything is read off jaxprs, of the forward pass and of the backward pass
    taken with ``jax.vjp``.

    Args:
        fn: The function to examine: anything ``amp`` accepts.
        compute_dtype: As for :func:`autocast.amp`: a floating dtype, a dtype name or a float8
            recipe; ``None`` (the default) means :func:`autocast.half_dtype`.
        amp_policy: As for :func:`autocast.amp`: a mapping from named-scope strings and
            primitives to precision functions; ``None`` (the default) means
            :data:`autocast.default_amp_policy`.

    Returns:
        A function that takes ``fn``'s arguments and returns a :class:`Report` for them.

    Raises:
        TypeError: As :func:`autocast.amp` raises it, for ``fn``, ``compute_dtype`` or
            ``amp_policy``; when the returned function is called, if ``fn`` returns a
            generator or a coroutine.
        ValueError: As :func:`autocast.amp` raises it, for a ``compute_dtype`` string that
            names no floating dtype or a float8 type without a recipe.

    Example:
        >>> import autocast, jax, jax.numpy as jnp
        >>> def loss(w, x):
        ...     return jnp.mean(jnp.tanh(x @ w) ** 2)
        >>> w, x = jnp.ones((4, 4)), jnp.ones((2, 4))
        >>> r = autocast.report(loss, compute_dtype=jnp.bfloat16)(w, x)
        >>> r.summary["low_precision_flop_share"]
        {'forward': 1.0, 'backward': 1.0}
        >>> print(str(r).splitlines()[0])
        amp precision report
    """
    amp_fn = _amp(fn, compute_dtype=compute_dtype, amp_policy=amp_policy)

    def run(*args: Any, **kwargs: Any) -> Report:
        seen: collections.Counter = collections.Counter()

        def observe(eqn: Any, rule: Any, invars: Any, outs: Any, ctx: Any) -> None:
            outs = outs if eqn.primitive.multiple_results else [outs]
            name = getattr(rule, "__name__", repr(rule))
            seen[(eqn.primitive.name, _dtypes(invars), _dtypes(outs), name)] += 1

        leaves, in_tree = jax.tree_util.tree_flatten((args, kwargs))
        dynamic = [i for i, x in enumerate(leaves) if is_array(x)]
        base = amp_fn._context(args, kwargs)
        traced = amp_fn._trace(in_tree, leaves, dynamic, base)
        ctx = dataclasses.replace(base, observer=observe)
        amp_jaxpr = jax.make_jaxpr(traced.evaluate(ctx))(*[leaves[i] for i in dynamic])
        original = traced.jaxpr

        casts: collections.Counter = collections.Counter()
        places = _cast_places(amp_jaxpr)
        for eqn in _measure.float_casts(amp_jaxpr):
            casts[
                (eqn.invars[0].aval.dtype.name, eqn.outvars[0].aval.dtype.name, places[id(eqn)])
            ] += 1

        every = [i for i in dynamic if is_inexact_dtype(leaves[i].dtype)]
        first = jax.tree_util.tree_structure(args[:1]).num_leaves if args else 0
        both = backward = None
        # with respect to every float; failing that (a custom rule that refuses a tangent for
        # some argument), to the first argument's, which jax.grad differentiates by default
        for floats in (every, [i for i in every if i < first]):
            values = [leaves[i] for i in floats]
            try:
                both = jax.make_jaxpr(_pullback(_over_floats(amp_fn, leaves, in_tree, floats)))(
                    *values
                )
            except Exception as e:  # noqa: BLE001 - whatever keeps the backward pass from being read
                message = str(e).splitlines()[0] if str(e) else ""
                backward = f"not measured: {type(e).__name__}: {message}"
                continue
            if floats != every:
                backward = (
                    f"with respect to the first argument only ({backward[len('not measured: ') :]})"
                )
            else:
                backward = None
            break
        summary: dict[str, Any] = {
            "low_precision_flop_share": _measure.flop_shares(
                amp_jaxpr, both, _measure.at_most_bits(16)
            )
        }
        fp8_share = _measure.flop_shares(amp_jaxpr, both, _measure.at_most_bits(8))
        if fp8_share["forward"] or amp_fn.fp8_recipe is not None:
            summary["fp8_flop_share"] = fp8_share
        summary["casts"] = _measure.count_casts(amp_jaxpr) - _measure.count_casts(original)
        summary["residual_bytes"] = summary["residual_bytes_original"] = None
        if both is not None:
            for key, f in (("residual_bytes", amp_fn), ("residual_bytes_original", fn)):
                summary[key] = _measure.residual_bytes(
                    _over_floats(f, leaves, in_tree, floats), *values
                )
        if backward is not None:
            summary["backward"] = backward

        rows = tuple(
            PrimitiveRow(prim, n, ins, outs, rule)
            for (prim, ins, outs, rule), n in sorted(seen.items(), key=lambda kv: (-kv[1], kv[0]))
        )
        cast_rows = tuple(
            CastRow(src, dst, where, n)
            for (src, dst, where), n in sorted(casts.items(), key=lambda kv: (-kv[1], kv[0]))
        )
        return Report(rows, cast_rows, summary)

    return run
