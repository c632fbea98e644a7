"""Handlers for primitives that carry sub-jaxprs, one function each, in a table by name.

A handler re-interprets the sub-jaxpr under the policy with the dtypes its inputs actually
have (a bfloat16 activation entering a jitted helper stays bfloat16) and binds the primitive
again with the re-traced sub-jaxpr and its other parameters unchanged (shardings, donation,
remat policies, names). Adding support for a primitive is one function and one table entry.
A primitive with sub-jaxprs that has no entry raises: it is never bound unchanged, which
would silently skip everything inside it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from autocast import _compat
from autocast._src.policy.casting import cast_value, castable
from autocast._src.policy.precision import use_original_precision
from autocast._src.transform import interpreter
from autocast._src.transform.closures import traced_call
from autocast._src.transform.interpreter import SPREAD, STRONG, Context, eval_jaxpr
from autocast._src.transform.retrace import (
    TRACES,
    literals_of,
    retrace,
    retrace_closed,
    spec_like,
    spec_of,
    with_dtype,
)
from autocast._src.tree import is_array, is_inexact_dtype


def _as_list(eqn: Any, outs: Any) -> list[Any]:
    return list(outs) if eqn.primitive.multiple_results else [outs]


def _float0_zeros(aval: Any) -> np.ndarray:
    return np.zeros(aval.shape, jax.dtypes.float0)


# --- calls --------------------------------------------------------------------------------------


def _sole_casts(jaxpr: Any) -> dict[int, Any]:
    """Inputs of ``jaxpr`` whose only use is one cast to another floating dtype: position ->
    that dtype."""
    uses: dict[Any, list] = {v: [] for v in jaxpr.invars}
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            if not isinstance(v, _compat.Literal) and v in uses:
                uses[v].append(eqn)
    for v in jaxpr.outvars:
        if not isinstance(v, _compat.Literal) and v in uses:
            uses[v].append(None)
    found = {}
    for i, v in enumerate(jaxpr.invars):
        if len(uses[v]) == 1 and uses[v][0] is not None:
            eqn = uses[v][0]
            if eqn.primitive.name == "convert_element_type" and castable(
                v.aval, eqn.params["new_dtype"]
            ):
                found[i] = eqn.params["new_dtype"]
    return found


def _jit(eqn: Any, invals: list, kinds: Sequence[int], ctx: Context) -> Sequence[Any]:
    """``jax.jit`` (``pjit`` before JAX 0.7): re-bind with the re-traced jaxpr.

    Shardings, donation, the name and the inlining flag are kept as they were. An input that
    the re-traced body only ever uses through one cast is cast before the call instead, where
    the caller's own cast of the same value can be shared (``jnp.var`` inside a layer norm
    whose ``jnp.mean`` already cast its input).
    """
    inner = ctx.enter(eqn)
    jaxpr = retrace_closed(eqn.params["jaxpr"], invals, kinds, inner)
    hoisted = _sole_casts(jaxpr.jaxpr)
    if hoisted:
        invals = [cast_value(x, hoisted[i]) if i in hoisted else x for i, x in enumerate(invals)]
        jaxpr = retrace_closed(eqn.params["jaxpr"], invals, kinds, inner)
    return _compat.bind_equation(eqn, invals, {**eqn.params, "jaxpr": jaxpr})


def _inline_call(eqn: Any, invals: list, kinds: Sequence[int], ctx: Context) -> Sequence[Any]:
    """``closed_call`` / ``core_call`` (``eval_jaxpr`` after JAX 0.11.0): a call with no
    parameters worth keeping, evaluated in place (its equations keep the call's name stack)."""
    jaxpr, consts = _compat.called_jaxpr(eqn)
    return eval_jaxpr(jaxpr, consts, invals, ctx.enter(eqn, in_place=True), kinds)


def _checkpoint_body(
    eqn: Any, jaxpr: Any, consts: Sequence[Any], invals: list, kinds: Sequence[int], ctx: Context
) -> tuple[Any, list, list]:
    """A checkpoint's body re-traced under the policy: the closed jaxpr, the float8
    histories it takes after its inputs, and the inputs as they enter.

    A checkpoint's inputs are what the backward pass keeps. A SPREAD one (the embedding that
    starts a residual stream) enters in the compute dtype, as the stream it starts is 16-bit
    from the first block on; other inputs, constants included, enter as they are."""
    invals = [
        cast_value(x, ctx.compute_dtype) if k == SPREAD and castable(x, v.aval.dtype) else x
        for x, k, v in zip(invals, kinds, eqn.invars)
    ]
    # the checkpoint recomputes its body by the user's policy: no chains of amp's inside
    inner = dataclasses.replace(ctx.enter(eqn), recompute=False)
    plan = dict(specs=[spec_of(x) for x in invals], kinds=kinds, literals=literals_of(invals))
    # a checkpointed layer's float8 products take their histories as inputs of the checkpoint
    with_histories = _retrace_with_histories(ctx, inner, jaxpr, consts, plan, tuple)
    traced, rows = with_histories or (retrace(jaxpr, consts, ctx=inner, **plan), [])
    return traced, rows, invals


def _remat(eqn: Any, invals: list, kinds: Sequence[int], ctx: Context) -> Sequence[Any]:
    """``jax.checkpoint``: the same ``policy`` object, ``prevent_cse`` and ``differentiated``
    flag, so ``checkpoint_name`` marks inside still decide what is saved."""
    traced, rows, invals = _checkpoint_body(eqn, eqn.params["jaxpr"], (), invals, kinds, ctx)
    open_jaxpr, consts = _compat.open_jaxpr(traced)
    return _compat.bind_equation(
        eqn, [*consts, *invals, *rows], {**eqn.params, "jaxpr": open_jaxpr}
    )


def _remat3(eqn: Any, invals: list, kinds: Sequence[int], ctx: Context) -> Sequence[Any]:
    """``jax.checkpoint`` under ``jax_remat3`` (a ``RematTraced``): as :func:`_remat`, bound
    again as a ``RematTraced`` with the same ``policy`` and ``prevent_cse``; the
    ``checkpoint_name`` marks inside keep their names (``CheckpointName``)."""
    jaxpr, consts = _compat.remat3_body(eqn)
    traced, rows, invals = _checkpoint_body(eqn, jaxpr, consts, invals, kinds, ctx)
    return _compat.bind_remat3(eqn, traced, invals, rows)


# --- control flow -----------------------------------------------------------------------------


def _carry_dtypes(
    body: Any,
    consts: Sequence[Any],
    specs: list[Any],
    kinds: list[int],
    carry: range,
    ctx: Context,
    literals: dict[int, Any],
) -> list[Any]:
    """The dtype each loop carry keeps through the loop.

    A carry keeps the dtype it enters with, except one that enters SPREAD (a residual stream
    starting at an embedding): that one takes the dtype one iteration makes of it, as it
    would if the loop were unrolled, provided the next iteration keeps it. So a stream of
    activations is 16-bit through the loop, while an accumulator, which starts at a constant
    such as ``jnp.zeros``, keeps the dtype it starts with.
    """
    entering = [specs[i].dtype for i in carry]
    spread = [kinds[i] == SPREAD for i in carry]
    if not any(spread):
        return entering
    first = retrace(body, consts, specs, kinds, ctx, literals=literals)
    proposed = [
        a.dtype if s else d for a, d, s in zip(first.out_avals[: len(carry)], entering, spread)
    ]
    if proposed == entering:
        return entering
    trial_specs = list(specs)
    for i, d in zip(carry, proposed):
        trial_specs[i] = with_dtype(specs[i], d)
    trial_kinds = [STRONG if i in carry else k for i, k in enumerate(kinds)]
    second = retrace(body, consts, trial_specs, trial_kinds, ctx, literals=literals)
    stable = [a.dtype for a in second.out_avals[: len(carry)]] == proposed
    return proposed if stable else entering


def _loop_plan(
    body: Any,
    invals: list,
    kinds: Sequence[int],
    n_consts: int,
    n_carry: int,
    ctx: Context,
    spec: Callable[[int, Any], Any],
) -> tuple[list, dict[str, Any]]:
    """How to re-trace a loop body taking ``invals``: ``n_consts`` constants, ``n_carry``
    carries, then per-iteration inputs whose specs ``spec(position, value)`` gives. Returns the
    inputs with each carry cast to its loop dtype, and the arguments of :func:`retrace` that
    trace the body for them. Inside, carries are STRONG: every iteration recomputes them."""
    specs = [spec(i, x) for i, x in enumerate(invals)]
    literals = literals_of(invals, range(n_consts))
    carry = range(n_consts, n_consts + n_carry)
    dtypes = _carry_dtypes(body.jaxpr, body.consts, specs, list(kinds), carry, ctx, literals)
    invals, kinds = list(invals), list(kinds)
    for i, d in zip(carry, dtypes):
        if invals[i].dtype != d:
            invals[i] = cast_value(invals[i], d)
            specs[i] = with_dtype(specs[i], d)
        kinds[i] = STRONG
    out_dtypes = [*dtypes, *[None] * (len(body.jaxpr.outvars) - n_carry)]
    return invals, dict(specs=specs, kinds=kinds, literals=literals, out_dtypes=out_dtypes)


def _scan(eqn: Any, invals: list, kinds: Sequence[int], ctx: Context) -> Sequence[Any]:
    """``lax.scan`` (and ``fori_loop``, ``lax.map``): the body runs under the policy, and each
    carry keeps one dtype through the loop (see :func:`_carry_dtypes`), so it is cast at most
    once per iteration, never per use."""
    p = eqn.params
    body = p["jaxpr"]
    n_consts, n_carry = _compat.scan_layout(eqn)
    body_vars = body.jaxpr.invars

    def spec(i: int, x: Any) -> Any:
        return spec_of(x) if i < n_consts + n_carry else spec_like(body_vars[i], x)

    if ctx.fp8_history is not None:
        outs = _scan_with_histories(eqn, invals, kinds, ctx, spec)
        if outs is not None:
            return outs
    inner = ctx.enter(eqn)
    invals, plan = _loop_plan(body, invals, kinds, n_consts, n_carry, inner, spec)
    traced = retrace(body.jaxpr, body.consts, ctx=inner, **plan)
    return _compat.bind_equation(eqn, invals, {**p, "jaxpr": traced})


def _retrace_with_histories(
    ctx: Context,
    inner: Context,
    jaxpr: Any,
    consts: Sequence[Any],
    plan: dict[str, Any],
    outer_shape: Callable[[tuple], tuple],
) -> tuple[Any, list] | None:
    """A body re-traced (``retrace(jaxpr, consts, **plan)`` under ``inner``) to take float8
    histories from ``ctx``'s slots as extra inputs, and the arrays to pass there (history,
    inbox, ... per product, in the shapes ``outer_shape`` gives them outside the body). None
    when ``ctx`` threads no histories, the body takes none, or ``ctx`` is only counting them
    (their shapes are then recorded). The body is traced once with a counting
    :class:`~autocast._src.transform.histories.Slots` to learn what it takes."""
    if ctx.fp8_history is None:
        return None
    counted = ctx.fp8_history.counter()
    retrace(jaxpr, consts, ctx=dataclasses.replace(inner, fp8_history=counted), **plan)
    if not counted.taken:
        return None
    taken = [ctx.fp8_history.take(outer_shape(shape)) for shape in counted.shapes]
    if any(t is None for t in taken):
        return None
    counted.measured = [t.measured for t in taken]
    traced = retrace(jaxpr, consts, ctx=inner, histories=counted, **plan)
    return traced, [x for t in taken for x in (t.history, t.inbox)]


def _scan_with_histories(
    eqn: Any, invals: list, kinds: Sequence[int], ctx: Context, spec: Callable[[int, Any], Any]
) -> list | None:
    """A scan whose body has float8 products with delayed scaling: each iteration takes its
    own histories, sliced from stacked ones like any scanned input (so every layer of a
    scanned model keeps its own), and their gradient is stacked the same way. None when the
    body has no such product, or while counting (the stacked shapes are then recorded)."""
    p = eqn.params
    body = p["jaxpr"]
    n_consts, n_carry = _compat.scan_layout(eqn)
    inner = ctx.enter(eqn)
    invals, plan = _loop_plan(body, invals, kinds, n_consts, n_carry, inner, spec)
    length = p["length"]
    with_histories = _retrace_with_histories(
        ctx, inner, body.jaxpr, body.consts, plan, lambda shape: (length, *shape)
    )
    if with_histories is None:
        return None
    traced, stacked = with_histories
    consts, carry, xs = (
        invals[:n_consts],
        invals[n_consts : n_consts + n_carry],
        invals[n_consts + n_carry :],
    )

    def step(carry: list, sliced: tuple) -> tuple[list, list]:
        outs = jax.core.eval_jaxpr(traced.jaxpr, traced.consts, *consts, *carry, *sliced)
        return outs[:n_carry], outs[n_carry:]

    # lax.scan rather than the equation re-bound: the body takes inputs the equation's
    # parameters do not describe, and how those describe the inputs changes across JAX versions
    carry_out, ys = jax.lax.scan(
        step,
        carry,
        (*xs, *stacked),
        length=length,
        reverse=p.get("reverse", False),
        unroll=p.get("unroll", 1),
    )
    return [*carry_out, *ys]


def _while(eqn: Any, invals: list, kinds: Sequence[int], ctx: Context) -> Sequence[Any]:
    """``lax.while_loop``: condition and body under the policy, carries as in ``scan``."""
    p = eqn.params
    n_cond, n_body = _compat.while_layout(eqn)
    inner = ctx.enter(eqn)
    cond_consts = invals[:n_cond]
    n_carry = len(invals) - n_cond - n_body
    rest, plan = _loop_plan(
        p["body_jaxpr"],
        invals[n_cond:],
        kinds[n_cond:],
        n_body,
        n_carry,
        inner,
        lambda i, x: spec_of(x),
    )
    body = retrace(p["body_jaxpr"].jaxpr, p["body_jaxpr"].consts, ctx=inner, **plan)
    carry = rest[n_body:]
    cond = retrace(
        p["cond_jaxpr"].jaxpr,
        p["cond_jaxpr"].consts,
        [spec_of(x) for x in [*cond_consts, *carry]],
        [*kinds[:n_cond], *[STRONG] * n_carry],
        inner,
        literals=literals_of(cond_consts),
    )
    new_invals = [*cond_consts, *rest]
    return _compat.bind_equation(eqn, new_invals, {**p, "body_jaxpr": body, "cond_jaxpr": cond})


def _cond(eqn: Any, invals: list, kinds: Sequence[int], ctx: Context) -> Sequence[Any]:
    """``lax.cond`` / ``lax.switch``: every branch under the policy; where branches disagree
    on an output's dtype, all return the widest."""
    index, operands = invals[0], invals[1:]
    inner = ctx.enter(eqn)
    specs = [spec_of(x) for x in operands]
    literals = literals_of(operands)

    def trace(out_dtypes: Sequence[Any] | None) -> list[Any]:
        return [
            retrace(
                b.jaxpr, b.consts, specs, kinds[1:], inner, literals=literals, out_dtypes=out_dtypes
            )
            for b in eqn.params["branches"]
        ]

    branches = trace(None)
    per_output = list(zip(*[[a.dtype for a in b.out_avals] for b in branches]))
    if any(len(set(dts)) > 1 for dts in per_output):
        branches = trace(
            [jnp.result_type(*dts) if len(set(dts)) > 1 else None for dts in per_output]
        )
    return _compat.bind_equation(
        eqn, [index, *operands], {**eqn.params, "branches": tuple(branches)}
    )


# --- custom derivatives -------------------------------------------------------------------------


def _once_per_equation(build: Callable[..., Any]) -> Callable[..., Any]:
    """``build(eqn, *key)`` computed once per equation and key (cached by identity in the
    shared cache)."""

    def cached(eqn: Any, *key: Any) -> Any:
        full = (build.__name__, id(eqn), *key)
        hit = TRACES.get(full, (eqn,))
        if hit is None:
            hit = build(eqn, *key)
            TRACES.put(full, (eqn,), hit)
        return hit

    return cached


def _split(
    perturbed: Sequence[bool], values: Sequence[Any]
) -> tuple[list, Callable[[Sequence[Any]], list]]:
    """The perturbed ``values``, and how to put them back among the others."""
    moving = [x for x, p in zip(values, perturbed) if p]

    def merge(new: Sequence[Any]) -> list[Any]:
        it = iter(new)
        return [next(it) if p else x for x, p in zip(values, perturbed)]

    return moving, merge


@_once_per_equation
def _custom_jvp_rule_jaxpr(eqn: Any, perturbed: tuple[bool, ...]) -> Any:
    """The jaxpr of ``eqn``'s own JVP rule at the original dtypes, for the inputs marked
    ``perturbed``: primals and their tangents in, primal and float tangent outputs out. The
    other inputs enter as constants of the differentiation, so the rule sees their tangents as
    symbolic zeros, as it would without amp (Equinox's ``nondifferentiable`` relies on it)."""
    in_avals = [v.aval for v in eqn.invars]
    out_diff = [is_inexact_dtype(v.aval.dtype) for v in eqn.outvars]

    def rule(*args: Any) -> list[Any]:
        primals = list(args[: len(in_avals)])
        moving, merge = _split(perturbed, primals)
        outs, out_tangents = jax.jvp(
            lambda *p: _as_list(eqn, _compat.bind_equation(eqn, merge(p), eqn.params)),
            tuple(moving),
            tuple(args[len(in_avals) :]),
        )
        return list(outs) + [t for t, d in zip(out_tangents, out_diff) if d]

    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in in_avals]
    return jax.make_jaxpr(rule)(*specs, *[s for s, p in zip(specs, perturbed) if p])


def _custom_jvp(eqn: Any, invals: list, kinds: Sequence[int], ctx: Context) -> Sequence[Any]:
    """``jax.custom_jvp`` functions (``jax.nn.relu``...): the primal and the user's JVP rule
    both run under the policy, and the custom rule is still what differentiation uses. Which
    inputs are perturbed is passed on, so a rule that asks for symbolic zeros gets them."""
    inner = ctx.enter(eqn)
    primal = retrace_closed(_primal_jaxpr(eqn), invals, kinds, inner)
    out_dtypes = [a.dtype for a in primal.out_avals]

    @jax.custom_jvp
    def fn(*args: Any) -> list[Any]:
        return jax.core.eval_jaxpr(primal.jaxpr, primal.consts, *args)

    def fn_jvp(primals: Sequence[Any], tangents: Sequence[Any]) -> tuple[list, list]:
        perturbed = tuple(
            not isinstance(t, SymbolicZero) and is_inexact_dtype(v.aval.dtype)
            for t, v in zip(tangents, eqn.invars)
        )
        rule = _custom_jvp_rule_jaxpr(eqn, perturbed)
        moving = [t for t, p in zip(tangents, perturbed) if p]
        outs = eval_jaxpr(rule.jaxpr, rule.consts, [*primals, *moving], inner)
        n_out = len(eqn.outvars)
        out_primals = [cast_value(x, d) for x, d in zip(outs[:n_out], out_dtypes)]
        it = iter(outs[n_out:])
        out_tangents = [
            cast_value(next(it), d) if is_inexact_dtype(v.aval.dtype) else _float0_zeros(v.aval)
            for v, d in zip(eqn.outvars, out_dtypes)
        ]
        return out_primals, out_tangents

    fn.defjvp(fn_jvp, symbolic_zeros=True)
    return fn(*invals)


@_once_per_equation
def _custom_vjp_fwd_jaxpr(eqn: Any, perturbed: tuple[bool, ...]) -> tuple[Any, Any, list]:
    """The user's forward rule as a jaxpr at the original dtypes, for the arguments marked
    ``perturbed``, traced once: ``fwd(consts, args) -> (outs, residuals)``, with the tree
    that rebuilds the pullback from the residuals and the residuals' shapes. The leading
    ``num_consts`` inputs are values the function closed over: never differentiated.
    Unperturbed arguments enter as constants, so the user's forward rule sees them
    unperturbed, as it would without amp."""
    n_consts = _compat.custom_vjp3_consts(eqn)
    store: dict[str, Any] = {}

    def fwd(*inputs: Any) -> tuple[list, list]:
        consts, args = inputs[:n_consts], list(inputs[n_consts:])
        moving, merge = _split(perturbed, args)
        outs, vjp_fn = jax.vjp(
            lambda *a: _as_list(eqn, _compat.bind_equation(eqn, [*consts, *merge(a)], eqn.params)),
            *moving,
        )
        residuals, store["tree"] = jax.tree_util.tree_flatten(vjp_fn)
        return outs, residuals

    specs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars]
    fwd_jaxpr, (_, res_shapes) = jax.make_jaxpr(fwd, return_shape=True)(*specs)
    return fwd_jaxpr, store["tree"], list(res_shapes)


@_once_per_equation
def _custom_vjp_bwd_jaxpr(eqn: Any, perturbed: tuple[bool, ...], zero_cts: tuple[bool, ...]) -> Any:
    """The user's backward rule as a jaxpr, ``bwd(residuals, cotangents) -> cotangents of
    the perturbed args``, taking only the cotangents not marked ``zero_cts``: the others
    reach the rule as the symbolic zeros they were (JAX 0.12's ``vmap`` refuses a rule that
    gets a nonzero cotangent for an output shared across the batch and gives a batched
    cotangent to an unbatched input; a zero array there would be such a cotangent)."""
    _, tree, res_shapes = _custom_vjp_fwd_jaxpr(eqn, perturbed)
    out_avals = [v.aval for v in eqn.outvars]

    def bwd(residuals: list, given: list) -> list:
        it = iter(given)
        cts = [_compat.zero_cotangent(a) if z else next(it) for a, z in zip(out_avals, zero_cts)]
        return list(jax.tree_util.tree_unflatten(tree, residuals)(cts))

    ct_specs = [
        jax.ShapeDtypeStruct(a.shape, a.dtype) for a, z in zip(out_avals, zero_cts) if not z
    ]
    return jax.make_jaxpr(bwd)(res_shapes, ct_specs)


# A hijax custom-derivative equation (``jax_custom_vjp3``, ``jax_custom_jvp3``) keeps its
# primal as a function: traced once per equation.
_traced_primal = _once_per_equation(_compat.custom_call_jaxpr)


def _primal_jaxpr(eqn: Any) -> Any:
    """The primal jaxpr of a custom-derivative equation: recorded by a ``custom_*_call``,
    traced from a hijax one."""
    if _compat.hijax_name(eqn) is None:
        return _compat.custom_call_jaxpr(eqn)
    return _traced_primal(eqn)


def _custom_vjp(eqn: Any, invals: list, kinds: Sequence[int], ctx: Context) -> Sequence[Any]:
    """``jax.custom_vjp`` functions: the primal, the user's forward rule and the user's
    backward rule all run under the policy; cotangents come back in the dtypes the inputs
    arrived in, and the custom rules are still what differentiation uses. Which arguments are
    perturbed is passed on to the user's rules (Equinox's ``filter_custom_vjp`` checks it).
    Values the function closed over stay closed over, so differentiating with respect to
    them is the same error it is without amp. Under ``jax_custom_vjp3`` (a
    ``CustomVJPTraced``) the same, but for rules other than fwd and bwd, which amp cannot
    carry: those are refused."""
    kept = _compat.custom_call_rules_kept(eqn)
    if kept is not None:
        if interpreter.decide_by_scope(eqn, ctx) is use_original_precision:
            return _bind_in_original_precision(eqn, invals, kinds, ctx)
        raise NotImplementedError(
            f"amp cannot keep the {kept} of a jax.custom_vjp function: it binds the function "
            "again with forward and backward rules that run under its policy. Wrap the call in "
            "autocast.amp_stop() to run it untouched in original precision."
        )
    inner = ctx.enter(eqn)
    primal = retrace_closed(_primal_jaxpr(eqn), invals, kinds, inner)
    out_dtypes = [a.dtype for a in primal.out_avals]
    n_consts = _compat.custom_vjp3_consts(eqn)
    consts, args = invals[:n_consts], invals[n_consts:]
    diff = [is_inexact_dtype(v.aval.dtype) for v in eqn.invars[n_consts:]]
    # The pattern the forward rule was traced for, read back by the backward rule.
    pattern: list[tuple[bool, ...]] = []

    @jax.custom_vjp
    def fn(*args: Any) -> list[Any]:
        return jax.core.eval_jaxpr(primal.jaxpr, primal.consts, *consts, *args)

    # where the rule cannot take symbolic zeros, every argument counts as perturbed
    symbolic = _compat.custom_vjp_takes_symbolic_zeros()

    def fn_fwd(*wrapped: Any) -> tuple[list, list]:
        perturbed = tuple(getattr(w, "perturbed", True) and d for w, d in zip(wrapped, diff))
        pattern.append(perturbed)
        fwd_jaxpr, _, res_shapes = _custom_vjp_fwd_jaxpr(eqn, perturbed)
        values = [w.value for w in wrapped] if symbolic else list(wrapped)
        flat = eval_jaxpr(fwd_jaxpr.jaxpr, fwd_jaxpr.consts, [*consts, *values], inner)
        n_out = len(flat) - len(res_shapes)
        outs, residuals = flat[:n_out], flat[n_out:]
        return [cast_value(x, d) for x, d in zip(outs, out_dtypes)], residuals

    def fn_bwd(residuals: list, cotangents: list) -> tuple:
        perturbed = pattern[-1]
        zero_cts = tuple(isinstance(c, SymbolicZero) for c in cotangents)
        bwd_jaxpr = _custom_vjp_bwd_jaxpr(eqn, perturbed, zero_cts)
        given = [c for c, z in zip(cotangents, zero_cts) if not z]
        cts = iter(eval_jaxpr(bwd_jaxpr.jaxpr, bwd_jaxpr.consts, [*residuals, *given], inner))
        return tuple(cast_value(next(cts), x.dtype) if p else None for x, p in zip(args, perturbed))

    fn.defvjp(fn_fwd, fn_bwd, symbolic_zeros=symbolic)
    return fn(*args)


def _custom_lin(eqn: Any, invals: list, kinds: Sequence[int], ctx: Context) -> Sequence[Any]:
    """The linearised ``custom_vjp`` that JAX makes when a JVP rule calls a ``custom_vjp``
    function (a ``custom_vjp`` inside a ``custom_jvp``): its backward rule is called when the
    program is transposed, long after amp has evaluated it, so it is re-bound with a backward
    rule that runs the user's under the policy. Each cotangent comes back in the dtype its
    tangent input has here, as the transpose of the rest of the program expects."""
    p = eqn.params
    bwd = p["bwd"]
    inner = ctx.enter(eqn)
    in_zeros = p.get("in_zeros")
    tangent_dtypes = iter([x.dtype for x in invals[p["num_res"] :]])
    targets = [
        None if in_zeros is not None and zero else next(tangent_dtypes, None)
        for zero in (in_zeros if in_zeros is not None else [False] * (len(invals) - p["num_res"]))
    ]

    n_res = p["num_res"]

    def amp_bwd(*args: Any) -> Any:
        # the user's rule was traced against the residuals' recorded dtypes
        args = (*_recorded_dtypes(eqn.invars[:n_res], args[:n_res]), *args[n_res:])
        closed, rebuild, values = traced_call(bwd.call_wrapped, args)
        outs = eval_jaxpr(closed.jaxpr, closed.consts, values, inner)
        cts, repack = _compat.backward_cotangents(
            rebuild(_cast_to(outs, [a.dtype for a in closed.out_avals]))
        )
        return repack(_cast_to(cts, [*targets, *[None] * (len(cts) - len(targets))]))

    return _compat.bind_equation(eqn, invals, {**p, "bwd": _compat.rewrap(bwd, amp_bwd)})


# --- mapped and sharded -----------------------------------------------------------------------


def _remapped(
    eqn: Any, invals: list, kinds: Sequence[int], ctx: Context, body: Any, mapper: Callable
) -> list[Any]:
    """Re-traces a per-shard ``body`` through ``mapper`` (``jax.shard_map``/``jax.pmap`` with
    the equation's settings): collectives inside name axes that exist only while it traces."""
    inner = ctx.enter(eqn)

    def local(*args: Any) -> tuple:
        return tuple(eval_jaxpr(body, (), list(args), inner, kinds))

    return list(mapper(local)(*invals))


def _shard_map(eqn: Any, invals: list, kinds: Sequence[int], ctx: Context) -> Sequence[Any]:
    """``shard_map`` (and ``pmap`` from JAX 0.7 on, which is built on it): the per-shard body
    under the policy, with mesh, specs, manual axes and replication checks as they were."""
    p = eqn.params
    return _remapped(
        eqn,
        invals,
        kinds,
        ctx,
        p["jaxpr"],
        lambda f: jax.shard_map(
            f,
            mesh=p["mesh"],
            in_specs=tuple(p["in_specs"]),
            out_specs=tuple(p["out_specs"]),
            axis_names=_compat.shard_map_manual_axes(p),
            check_vma=p["check_vma"],
        ),
    )


def _pmap(eqn: Any, invals: list, kinds: Sequence[int], ctx: Context) -> Sequence[Any]:
    """``jax.pmap`` before JAX 0.7 (``xla_pmap``): the per-device body under the policy, with
    the same axis, mapping, devices and donation."""
    p = eqn.params
    return _remapped(
        eqn,
        invals,
        kinds,
        ctx,
        p["call_jaxpr"],
        lambda f: jax.pmap(
            f,
            axis_name=p["axis_name"],
            in_axes=tuple(p["in_axes"]),
            out_axes=tuple(p["out_axes"]),
            devices=p["devices"],
            backend=p["backend"],
            axis_size=p["axis_size"],
            donate_argnums=tuple(i for i, d in enumerate(p["donated_invars"]) if d),
        ),
    )


def _scan3(eqn: Any, invals: list, kinds: Sequence[int], ctx: Context) -> Sequence[Any]:
    """``lax.scan`` under ``jax_scan3`` (a ``Scan3``): the body runs under the policy, bound
    again as a ``Scan3``. Its carries are ``Ref``s, which keep the dtype they were made
    with (a value written to one is cast to it, as any write to a ``Ref`` is); the stacked
    outputs take the dtypes the body gives them. JAX 0.10 to 0.12 cannot differentiate a
    ``Scan3``, with or without amp."""
    body, consts, extensive, loop = _compat.scan3_layout(eqn)
    inner = ctx.enter(eqn)
    fixed = [x for x, e in zip(invals, extensive) if not e]
    sliced = [x for x, e in zip(invals, extensive) if e]

    def step(slices: Sequence[Any]) -> list[Any]:
        it_fixed, it_sliced = iter(fixed), iter(slices)
        args = [next(it_sliced) if e else next(it_fixed) for e in extensive]
        return eval_jaxpr(body, consts, args, inner, kinds)

    return _compat.bind_scan3(step, sliced, **loop)


def _bind_in_original_precision(
    eqn: Any, invals: list, kinds: Sequence[int], ctx: Context
) -> Sequence[Any]:
    """Bound exactly as recorded, on inputs cast back to their recorded dtypes: linear solves
    and reductions with a computation of their own (linear algebra stays out of 16
    bits), and any higher-order equation under a scope that asks for original precision."""
    return _compat.bind_equation(eqn, _recorded_dtypes(eqn.invars, invals), eqn.params)


def _cast_to(values: Sequence[Any], dtypes: Sequence[Any]) -> list:
    """Each floating array of ``values`` in its dtype of ``dtypes`` (None: left as it is)."""
    return [
        cast_value(x, d) if d is not None and is_array(x) and castable(x, d) else x
        for x, d in zip(values, dtypes)
    ]


def _recorded_dtypes(invars: Sequence[Any], values: Sequence[Any]) -> list:
    """``values`` in the dtypes the jaxpr recorded for ``invars``."""
    return _cast_to(values, [v.aval.dtype for v in invars])


def _foreign(eqn: Any, invals: list, kinds: Sequence[int], ctx: Context) -> Sequence[Any]:
    """A higher-order primitive from another library (Equinox's filtered primitives keep
    their jaxprs in a ``static`` parameter): its rules were written for the jaxprs it was
    given, so its boundary keeps the recorded dtypes, while each closed jaxpr found in its
    parameters is interpreted under the policy with exactly the signature it had (inputs and
    outputs in the recorded dtypes) and put back in its place."""
    inner = ctx.enter(eqn)

    def retyped(value: Any) -> Any:
        if _compat.holds_constants(value):
            specs = list(value.in_avals)
            return retrace(
                value.jaxpr,
                value.consts,
                specs,
                [STRONG] * len(specs),
                inner,
                out_dtypes=[a.dtype for a in value.out_avals],
            )
        if isinstance(value, _compat.Jaxpr):  # open: its constants cannot be re-typed in place
            raise interpreter.unsupported(eqn)
        if type(value) in (tuple, list):
            return type(value)(retyped(v) for v in value)
        return value

    params = {k: retyped(v) for k, v in eqn.params.items()}
    return _compat.bind_equation(eqn, _recorded_dtypes(eqn.invars, invals), params)


interpreter.HANDLERS.update(
    {
        **{name: _jit for name in _compat.JIT_NAMES},
        "closed_call": _inline_call,
        "core_call": _inline_call,
        "eval_jaxpr": _inline_call,
        "remat2": _remat,
        "scan": _scan,
        "while": _while,
        "cond": _cond,
        "custom_jvp_call": _custom_jvp,
        "custom_vjp_call": _custom_vjp,
        "custom_lin": _custom_lin,
        "shard_map": _shard_map,
        "xla_pmap": _pmap,
        "custom_linear_solve": _bind_in_original_precision,  # jnp.linalg.solve / inv, expm, cg
        "linear_solve": _bind_in_original_precision,  # lineax (optimistix's Newton steps too)
        "reduce": _bind_in_original_precision,  # lax.reduce with a computation of its own
        "reduce_window": _bind_in_original_precision,  # lax.reduce_window likewise
        # hijax operations (JAX 0.10 on), by class: see autocast._compat.hijax_name
        "RematTraced": _remat3,  # jax.checkpoint under jax_remat3
        "Scan3": _scan3,  # lax.scan under jax_scan3
        "CustomVJPTraced": _custom_vjp,  # jax.custom_vjp under jax_custom_vjp3
        "CustomJVPTraced": _custom_jvp,  # jax.custom_jvp under jax_custom_jvp3
        "CustomRoot": _bind_in_original_precision,  # lax.custom_root from JAX 0.12: a solve
    }
)
interpreter.ROLES.update(
    {
        "original precision": _bind_in_original_precision,
        "foreign": _foreign,
    }
)
