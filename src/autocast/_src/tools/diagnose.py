"""The numerics debugger: which equation, on which line, lost precision or overflowed under
amp, measured against the program in float32, and the policy that cures it.

amp's program is traced with every output of a user's equation marked, then evaluated once
beside its float32 reference (:mod:`autocast._src.tools.paired`); each marked equation becomes an
:class:`Entry`. How the figures are defined is in ``docs/diagnose.md``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.extend import source_info_util

from autocast import _compat
from autocast._src import jaxprs
from autocast._src.policy.precision import use_full_precision
from autocast._src.tools import paired, provenance
from autocast._src.tools.report import _table
from autocast._src.transform.amp import amp as _amp
from autocast._src.tree import is_floating_dtype


@dataclasses.dataclass(frozen=True)
class Entry:
    """One equation of the program as amp ran it, against the float32 reference.

    ``rel_error`` is the relative error of amp's output at this point (the error carried
    in from earlier equations included); ``added_error`` is how much of it this equation
    added: ``rel_error`` less the largest ``rel_error`` among the values it was given,
    floored at 0. ``overflow`` counts elements that are infinite or NaN where the
    reference's are finite; ``underflow`` elements that are zero where the reference's are
    not. In a loop, errors are the worst over iterations, counts are totals, and ``runs``
    says how many times the equation ran. How the figures are defined is in
    ``docs/diagnose.md``.

    Attributes:
        primitive: The primitive's name (``"dot_general"``).
        source: ``"file:line"`` of the user's code: the equation's own line or, for an
            equation inside a library function, that of the innermost enclosing call that
            has one (``""`` if none has).
        function: The name of the function that line is in.
        scopes: The named scopes around the equation, outermost first.
        dtype: The NumPy dtype amp ran the equation in.
        rel_error: The relative error of the output, a float: ``inf`` where amp's output is
            non-finite and the reference's finite.
        added_error: The part of ``rel_error`` this equation added, a float.
        overflow: The number of elements non-finite here and finite in the reference.
        underflow: The number of elements zero here and non-zero in the reference.
        runs: How many times the equation ran.
        backward: Whether the equation belongs to a backward pass (a transposed equation).
        policy_key: The key a policy gives to change this equation's precision: its innermost
            named scope, or else its primitive. Not shown in ``repr``, not compared.
        scope: The named scopes joined by ``/`` (``""`` where there are none).
        where: A short location for tables: the file's base name and line, and the scope.

    Example:
        >>> import autocast, jax.numpy as jnp
        >>> def f(w, x):
        ...     return jnp.sum(x @ w)
        >>> w, x = jnp.full((4, 4), 300.0), jnp.ones((2, 4))
        >>> d = autocast.diagnose(f, compute_dtype=jnp.float16)(w, x)
        >>> e = d.entries[0]
        >>> e.primitive, e.dtype, e.function, e.scopes, e.runs, e.backward
        ('dot_general', dtype('float16'), 'f', (), 1, False)
    """

    primitive: str
    source: str  # "file:line" of the user's code
    function: str  # the function that line is in
    scopes: tuple[str, ...]  # named scopes, outermost first
    dtype: np.dtype  # what amp ran it in
    rel_error: float
    added_error: float
    overflow: int
    underflow: int
    runs: int
    backward: bool  # part of a backward pass (a transposed equation)
    policy_key: Any = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def scope(self) -> str:
        """The named scopes joined by ``/`` (``""`` where there are none)."""
        return "/".join(self.scopes)

    @property
    def where(self) -> str:
        """Short location for tables: the file's base name and line, and the scope."""
        short = os.path.basename(self.source)
        return f"{short} {self.scope}" if self.scope else short


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    """What :func:`diagnose` found; ``str(diagnosis)`` renders it as a table.

    Attributes:
        entries: One :class:`Entry` per equation that ran, in program order.
        first_nonfinite: The earliest entry, in the order the program ran, whose output was
            non-finite where the reference's was finite; ``None`` if there is none.
        suggested_policy: The policy amp ran with, extended so the culprits run in full
            precision (:func:`autocast.use_full_precision`), keyed by each one's innermost
            named scope where it has one, else by its primitive. Pass it as ``amp_policy``.
        culprits: The entries where non-finite values arose from finite inputs, or else the
            one that added the most error (none if no entry added any).
        output: amp's result, with ``fn``'s output structure and NumPy arrays as leaves.
        reference: The float32 program's result, in the same form.
        output_error: The largest relative error among the floating outputs, a float.
        diverged: How many times amp's program took another branch or loop trip count than
            the reference (both then follow amp's branch; a loop runs on until both have
            stopped).
        compute_dtype: The dtype amp computed in: for a float8 recipe, the forward float8
            format.

    Example:
        >>> import autocast, jax.numpy as jnp
        >>> f = lambda w: jnp.sum(w @ w)
        >>> d = autocast.diagnose(f, compute_dtype=jnp.float16)(jnp.full((2, 2), 300.0))
        >>> [e.primitive for e in d.entries], [e.primitive for e in d.culprits]
        (['dot_general', 'reduce_sum'], ['dot_general'])
        >>> d.output, d.reference
        (array(inf, dtype=float32), array(720000., dtype=float32))
        >>> print(d.table(rows=1))
        amp numerics diagnosis (float16 compute; reference: the program in float32)
          2 equations (0 in backward passes); output relative error inf
          first non-finite: dot_general in float16 at ...
        ...
          ... 1 more (Diagnosis.entries)
        <BLANKLINE>
          suggested_policy: the policy with dot_general in full precision
    """

    entries: tuple[Entry, ...]
    first_nonfinite: Entry | None
    suggested_policy: Mapping[Any, Callable[..., Any]]
    culprits: tuple[Entry, ...]
    output: Any
    reference: Any
    output_error: float
    diverged: int
    compute_dtype: np.dtype

    def worst(self, n: int | None = None) -> list[Entry]:
        """Entries from worst to best: the first non-finite one, then by added error.

        Ties in added error are broken by relative error, then by overflow count.

        Args:
            n: How many entries to return; ``None`` (the default) for all.

        Returns:
            A list of at most ``n`` :class:`Entry` objects.
        """
        ranked = sorted(
            self.entries,
            key=lambda e: (
                e is not self.first_nonfinite,
                -e.added_error,
                -e.rel_error,
                -e.overflow,
            ),
        )
        return ranked if n is None else ranked[:n]

    def table(self, rows: int = 15) -> str:
        """The diagnosis as text, with the ``rows`` worst entries; ``str()`` shows 15.

        Args:
            rows: How many entries the table lists, worst first (default 15); a line after the
                table says how many more there are.

        Returns:
            A multi-line string: a header with the compute dtype, the number of equations, the
            output's relative error and the first non-finite equation, then the table, then the
            keys :attr:`suggested_policy` moves to full precision.
        """
        return _render(self, rows)

    def __str__(self) -> str:
        return self.table()


def diagnose(
    fn: Callable[..., Any],
    *,
    compute_dtype: Any = None,
    amp_policy: Mapping[Any, Callable[..., Any]] | None = None,
) -> Callable[..., Diagnosis]:
    """Finds where ``amp(fn, compute_dtype=..., amp_policy=...)`` loses precision or overflows.

    amp's program is evaluated once beside the same program in float32, and one
    :class:`Entry` is recorded per equation amp evaluated (inside ``jit``, loops, branches,
    checkpoints and custom-derivative functions too), each with its source line, named scopes,
    the dtype it ran in and its error against the reference. ``fn`` may be anything ``amp``
    accepts, ``jax.grad(loss)`` included, to look at a backward pass.

    Args:
        fn: The function to examine: anything ``amp`` accepts.
        compute_dtype: As for :func:`autocast.amp`: a floating dtype, a dtype name or a float8
            recipe; ``None`` (the default) means :func:`autocast.half_dtype`.
        amp_policy: As for :func:`autocast.amp`: a mapping from named-scope strings and
            primitives to precision functions; ``None`` (the default) means
            :data:`autocast.default_amp_policy`.

    Returns:
        A function that takes ``fn``'s arguments and returns a :class:`Diagnosis` for them.

    Raises:
        TypeError: As :func:`autocast.amp` raises it, for ``fn``, ``compute_dtype`` or
            ``amp_policy``; when the returned function is called, if ``fn`` returns a
            generator or a coroutine.
        ValueError: As :func:`autocast.amp` raises it, for a ``compute_dtype`` string that
            names no floating dtype or a float8 type without a recipe.
        NotImplementedError: When the returned function is called, if ``fn``'s program holds
            ``Ref``s (``jax.new_ref``), which the float32 reference cannot share with amp's.

    Example:
        >>> import autocast, jax.numpy as jnp
        >>> def f(w, x):
        ...     return jnp.sum(x @ w)
        >>> w, x = jnp.full((4, 4), 300.0), jnp.full((2, 4), 300.0)
        >>> d = autocast.diagnose(f, compute_dtype=jnp.float16)(w, x)
        >>> d.first_nonfinite.primitive, d.first_nonfinite.dtype
        ('dot_general', dtype('float16'))
        >>> fixed = autocast.amp(f, compute_dtype=jnp.float16, amp_policy=d.suggested_policy)
        >>> float(fixed(jnp.full((4, 4), 300.0), jnp.full((2, 4), 300.0)))
        2880000.0
    """
    amp_fn = _amp(fn, compute_dtype=compute_dtype, amp_policy=amp_policy)

    def run(*args: Any, **kwargs: Any) -> Diagnosis:
        args, kwargs = _on_one_device((args, kwargs))
        base = amp_fn._context(args, kwargs)
        traced, values = amp_fn._traced_call(args, kwargs, base)
        _refuse_refs(traced.jaxpr)
        sites: list[paired.Site] = []

        def observe(eqn: Any, rule: Any, invars: Any, outs: Any, ctx: Any) -> Any:
            many = eqn.primitive.multiple_results
            outs = list(outs) if many else [outs]
            floating = [hasattr(x, "dtype") and is_floating_dtype(x.dtype) for x in outs]
            if not any(floating):
                return None
            site = len(sites)
            sites.append(paired.Site(eqn, ctx.path, ctx.callers))
            marked = [
                paired.mark(x, site, i) if f else x for i, (x, f) in enumerate(zip(outs, floating))
            ]
            return marked if many else marked[0]

        ctx = dataclasses.replace(base, observer=observe, path=_compat.current_scope_names())
        program = jax.make_jaxpr(traced.evaluate(ctx))(*values)
        recorder = paired.Recorder(provenance.before_sites(program.jaxpr))
        p = paired.Pass(sites, recorder)

        def both(*xs: Any) -> tuple[list, list]:
            outs = p.evaluate(program, xs)
            return [o.amp for o in outs], [o.ref for o in outs]

        amps, refs = jax.device_get(jax.jit(both)(*values))
        jax.effects_barrier()
        worst = max(
            (
                paired.compare(a, r)[0]
                for a, r in zip(amps, refs)
                if is_floating_dtype(np.asarray(a).dtype)
            ),
            default=0.0,
        )
        entries = _entries(sites, recorder.stats, p.dtypes)
        overflowed = [(st[4], s) for s, st in recorder.stats.items() if st[4] is not None]
        first = entries[min(overflowed)[1]] if overflowed else None
        plain = tuple(entries.values())
        culprits = _culprits(plain, first)
        suggested = dict(amp_fn._policy)
        for e in culprits:
            suggested[e.policy_key] = use_full_precision
        return Diagnosis(
            entries=plain,
            first_nonfinite=first,
            suggested_policy=suggested,
            culprits=tuple(culprits),
            output=traced.rebuild(amps),
            reference=traced.rebuild(refs),
            output_error=float(worst),
            diverged=recorder.diverged,
            compute_dtype=ctx.compute_dtype
            if amp_fn.fp8_recipe is None
            else amp_fn.fp8_recipe.forward,
        )

    return run


def _refuse_refs(program: Any) -> None:
    """Raises for a program (``fn``'s, as amp traced it) that reads or writes ``Ref``s: the
    pass evaluates each equation twice, amp's and the reference's, and a ``Ref`` holds one
    value, which the two would both write (JAX refuses the program with an effects error of
    its own)."""
    found = sorted(
        {
            _compat.equation_name(e)
            for e in jaxprs.equations(program)
            if any(_compat.is_ref_type(getattr(v, "aval", None)) for v in (*e.invars, *e.outvars))
        }
    )
    if found:
        raise NotImplementedError(
            "autocast.diagnose cannot evaluate a program that holds Refs (its "
            f"{', '.join(found)} equations): the float32 reference would write the same Ref as "
            "amp's program. amp itself runs it (a Ref keeps the dtype it was made with); "
            "diagnose the computation without its Refs, or read autocast.report."
        )


def _on_one_device(tree: Any) -> Any:
    """``tree`` with every array that spans several devices brought whole to the host.

    The paired evaluation reports each equation through an ordered callback, which XLA runs
    on one device only: a batch sharded over a mesh (data-parallel, or one process's part of
    a multi-process job) is evaluated whole instead, on this process's default device. In a
    multi-process job this gathers the other processes' shards (every process must call
    ``diagnose``, as for any collective), and each process then computes the same diagnosis.
    """

    def gather(x: Any) -> Any:
        if (
            not isinstance(x, jax.Array)
            or isinstance(x, jax.core.Tracer)
            or len(x.sharding.device_set) <= 1
        ):
            return x
        if x.is_fully_addressable:
            return np.asarray(x)
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree_util.tree_map(gather, tree)


_SUMMARY = re.compile(r"^(?P<file>.*?):(?P<line>\d+)(?::\d+)? \((?P<fn>.*)\)$")


def _source(site: paired.Site) -> tuple[str, str]:
    """``("file:line", function)`` of the user's code: the equation's own line, or for an
    equation of a library function (``jnp.where`` is a jitted function) the innermost
    enclosing call that has one."""
    for info in (site.eqn.source_info, *reversed(site.caller or ())):
        m = _SUMMARY.match(source_info_util.summarize(info))
        if m:
            return f"{m['file']}:{m['line']}", m["fn"]
    return "", ""


def _entries(
    sites: list[paired.Site], per_site: Mapping[int, list], dtypes: Mapping[int, tuple[str, ...]]
) -> dict[int, Entry]:
    """An entry per site that ran, by site, in program order."""
    out = {}
    for s in sorted(per_site):
        rel, added, overflow, underflow, first, runs = per_site[s]
        site = sites[s]
        eqn = site.eqn
        scopes = site.scopes + _compat.scope_names(eqn)
        source, function = _source(site)
        names = dtypes.get(s, ())
        dtype = np.dtype(jnp.result_type(*names)) if names else np.dtype(np.float32)
        entry = Entry(
            primitive=eqn.primitive.name,
            source=source,
            function=function,
            scopes=scopes,
            dtype=dtype,
            rel_error=float(rel),
            added_error=float(added),
            overflow=int(overflow),
            underflow=int(underflow),
            runs=int(runs),
            backward=any(_compat.is_transposed(i) for i in (eqn.source_info, *(site.caller or ()))),
            policy_key=scopes[-1] if scopes else eqn.primitive,
        )
        out[s] = entry
    return out


def _culprits(entries: tuple[Entry, ...], first: Entry | None) -> list[Entry]:
    """The equations where non-finite values arose (from finite inputs), or else the one
    that added the most error."""
    if first is not None:
        return [e for e in entries if math.isinf(e.added_error)] or [first]
    worst = max(entries, key=lambda e: e.added_error, default=None)
    return [worst] if worst is not None and worst.added_error > 0 else []


def _fmt_err(x: float) -> str:
    if math.isinf(x):
        return "inf"
    return f"{x:.2e}" if x and x < 1e-3 else f"{x:.4f}"


def _render(d: Diagnosis, rows: int = 15) -> str:
    n_back = sum(e.backward for e in d.entries)
    lines = [
        f"amp numerics diagnosis ({np.dtype(d.compute_dtype).name} compute; "
        "reference: the program in float32)",
        f"  {len(d.entries)} equations ({n_back} in backward passes); "
        f"output relative error {_fmt_err(d.output_error)}",
    ]
    if d.first_nonfinite is not None:
        f = d.first_nonfinite
        lines.append(
            f"  first non-finite: {f.primitive} in {f.dtype.name} at {f.source}"
            + (f" [{f.scope}]" if f.scope else "")
        )
    else:
        lines.append("  no non-finite values where float32 has none")
    if d.diverged:
        lines.append(f"  control flow left the reference's {d.diverged} time(s)")
    header = (
        "",
        "primitive",
        "ran in",
        "rel err",
        "added",
        "overflow",
        "underflow",
        "runs",
        "where",
    )
    body = []
    for e in d.worst(rows):
        mark = "!" if e is d.first_nonfinite else ""
        prim = e.primitive + (" (bwd)" if e.backward else "")
        body.append(
            (
                mark,
                prim,
                e.dtype.name,
                _fmt_err(e.rel_error),
                _fmt_err(e.added_error),
                str(e.overflow),
                str(e.underflow),
                str(e.runs),
                e.where,
            )
        )
    lines += ["", *_table(header, body)]
    if len(d.entries) > rows:
        lines.append(f"  ... {len(d.entries) - rows} more (Diagnosis.entries)")
    if d.culprits:
        keys = dict.fromkeys(
            repr(e.policy_key) if isinstance(e.policy_key, str) else e.policy_key.name
            for e in d.culprits
        )
        lines += ["", f"  suggested_policy: the policy with {', '.join(keys)} in full precision"]
    return "\n".join(lines)
