"""Everything that touches JAX internals or differs between supported JAX versions.

The rest of the package imports from here and nowhere else below ``jax``'s public API, so a
JAX upgrade is met in this one file. Supported: JAX 0.6.2 to 0.12 (README, "Supported
versions", says how each is tested).
"""

from __future__ import annotations

import functools
import importlib
import re
from typing import Any, Iterator, Sequence

import jax
import jax.extend.core as jex
import numpy as np
from jax.extend import source_info_util

Literal = jex.Literal
Jaxpr = jex.Jaxpr
ClosedJaxpr = jex.ClosedJaxpr
Primitive = jex.Primitive

# `jax.jit` records its equations as "pjit" up to JAX 0.6 and as "jit" from 0.7 on.
JIT_NAMES = frozenset({"pjit", "jit"})


def is_plain_jit(eqn: Any) -> bool:
    """A ``jax.jit`` call with nothing of its own to keep: no shardings, layouts, donation or
    compiler options (``jnp.var``'s, ``jax.nn.gelu``'s, a user's bare ``jax.jit``)."""
    p = eqn.params
    return (
        not any(p.get("donated_invars", ()))
        and all(
            type(s).__name__ == "UnspecifiedValue"
            for s in (*p.get("in_shardings", ()), *p.get("out_shardings", ()))
        )
        and all(x is None for x in (*p.get("in_layouts", ()), *p.get("out_layouts", ())))
        and not p.get("compiler_options_kvs")
        and not p.get("keep_unused", False)
    )


@functools.lru_cache(maxsize=None)
def primitive_by_name(name: str) -> Primitive | None:
    """The primitive called ``name`` in this JAX version, or None if it has none by that name.

    Most primitives are public in ``jax.extend.core.primitives`` or ``jax.lax``; a few (the
    ragged dot, ``checkpoint_name``'s primitive before JAX 0.7, Pallas's kernel call, some
    collectives) only inside ``jax._src``.
    """
    attr = name.replace("-", "_") + "_p"
    for module in _primitive_modules():
        prim = getattr(module, attr, None)
        if isinstance(prim, Primitive) and prim.name == name:
            return prim
    return None


def _primitive_modules() -> Iterator[Any]:
    yield jex.primitives
    yield jax.lax
    for internal in (
        "jax._src.lax.lax",
        "jax._src.lax.parallel",  # reduce_scatter (psum_scatter), the *_invariant collectives
        "jax._src.core",  # pvary
        "jax._src.ad_checkpoint",
        "jax._src.pallas.pallas_call",
    ):
        try:
            yield importlib.import_module(internal)
        except ImportError:  # pragma: no cover - layout of a future JAX
            pass


def bind_equation(eqn: Any, invals: Sequence[Any], params: dict[str, Any]) -> Any:
    """Binds ``eqn``'s primitive on ``invals`` with ``params``, as ``jax.core.eval_jaxpr`` would.

    ``get_bind_params`` turns stored sub-jaxprs back into the callables some primitives bind
    with; it returned ``(subfuns, params)`` up to JAX 0.6 and one dict since. A hijax
    equation's object is typed for its recorded inputs (see :func:`hijax_name`): a
    ``checkpoint_name`` mark is made again for the type its input has now, any other is
    bound only on inputs of the recorded types.
    """
    if hijax_name(eqn) is not None:
        return _bind_hijax(eqn, invals, params)
    bind_params = eqn.primitive.get_bind_params(params)
    if isinstance(bind_params, tuple):
        subfuns, bind_params = bind_params
        return eqn.primitive.bind(*subfuns, *invals, **bind_params)
    return eqn.primitive.bind(*invals, **bind_params)


_convert_p = jex.primitives.convert_element_type_p


def convert(x: Any, dtype: Any, weak_type: bool = False) -> Any:
    """``x`` cast to ``dtype`` by binding the primitive directly (weakly typed if asked).

    ``lax.convert_element_type`` does the same with much more Python around it; amp emits
    hundreds of casts per model, so the trace-time difference shows.
    """
    return _convert_p.bind(x, new_dtype=np.dtype(dtype), weak_type=weak_type, sharding=None)


def is_drop_var(var: Any) -> bool:
    """True for the placeholder output variable of an equation whose result is unused."""
    return type(var).__name__ == "DropVar"


def literal_value(lit: Any) -> Any:
    """A literal's value, with the dtype the jaxpr recorded for it.

    Newer JAX stores literals as float/int subclasses that carry their dtype; NumPy would read
    them back as 64-bit; older JAX sometimes stores a 0-d array. Scalars come back as NumPy
    scalars of the recorded dtype, which amp casts on the host.
    """
    dtype = lit.aval.dtype
    val = lit.val
    if np.ndim(val) == 0:
        return np.asarray(val, dtype=dtype)[()]
    return val


_TRANSFORM_WRAPPER = re.compile(r"^\w+\((.*)\)$")


def scope_names(eqn: Any) -> tuple[str, ...]:
    """The ``jax.named_scope`` names an equation was traced under, outermost first.

    Transformation markers (``jvp``, ``transpose``, ``vmap``...) are dropped, so a scope's
    policy also governs the derivative of what it contains. A scope name that an older
    transformation flattened into text such as ``"transpose(jvp(mlp))"`` is unwrapped too.
    """
    return _scope_names(eqn.source_info.name_stack)


@functools.lru_cache(maxsize=4096)
def _scope_names(name_stack: Any) -> tuple[str, ...]:
    # Name stacks are immutable and shared by the equations traced under them: read each once.
    names = []
    for item in name_stack.stack:
        if type(item).__name__ != "Scope":
            continue
        for part in item.name.split("/"):
            while (m := _TRANSFORM_WRAPPER.match(part)) is not None:
                part = m.group(1)
            names.append(part)
    return tuple(names)


def current_scope_names() -> tuple[str, ...]:
    """The named scopes active where the caller is running, outermost first."""
    return tuple(
        item.name
        for item in source_info_util.current_name_stack().stack
        if type(item).__name__ == "Scope"
    )


class equation_context:
    """Re-emits ``eqn`` with the traceback, name stack and config context it was traced with.

    Without this, equations that amp re-binds lose their ``jax.named_scope`` names (which
    later passes, profiles and ``checkpoint_name`` policies rely on) and their source lines.
    A class rather than a generator: it is entered once per equation of every model.
    """

    __slots__ = ("eqn", "user", "config")

    def __init__(self, eqn: Any) -> None:
        self.eqn = eqn

    def __enter__(self) -> None:
        info = self.eqn.source_info
        name_stack = source_info_util.current_name_stack() + info.name_stack
        self.user = source_info_util.user_context(info.traceback, name_stack=name_stack)
        self.user.__enter__()
        self.config = self.eqn.ctx.manager
        self.config.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        self.config.__exit__(*exc)
        return self.user.__exit__(*exc)


def sub_jaxpr_params(params: dict[str, Any]) -> list[str]:
    """Names of the parameters of an equation that hold jaxprs (the mark of a higher-order op)."""
    found = []
    for key, value in params.items():
        values = value if isinstance(value, (tuple, list)) else (value,)
        if any(isinstance(v, (Jaxpr, ClosedJaxpr)) for v in values):
            found.append(key)
    return found


def holds_constants(value: Any) -> bool:
    """Whether ``value`` is a jaxpr that holds its constants' values (a closed jaxpr), which
    can be re-traced and put back in its place. Up to JAX 0.10 that is a ``ClosedJaxpr``;
    from 0.11 on the two classes are one, and a jaxpr is closed when its constants are
    attached (``is_closed``)."""
    if ClosedJaxpr is Jaxpr:
        # 0.11.0 marks a jaxpr whose constants lack values; after it, a jaxpr's constants
        # are by definition those with values, so every jaxpr is closed
        return isinstance(value, Jaxpr) and getattr(value, "is_closed", True)
    return isinstance(value, ClosedJaxpr)


def constants_unbound(closed: Any) -> Any | None:
    """``closed``'s jaxpr with the values of its constants left out (an open jaxpr), as a
    library that keeps its constants elsewhere holds one; None where this JAX has no such
    jaxprs (after 0.11.0, a constant without a value is an input)."""
    if ClosedJaxpr is not Jaxpr:
        return closed.jaxpr
    if not hasattr(closed, "is_closed"):
        return None
    return closed.replace(consts=[])


def custom_call_jaxpr(eqn: Any) -> ClosedJaxpr:
    """The primal jaxpr of a ``custom_jvp_call`` or ``custom_vjp_call`` equation, or of the
    ``CustomJVPTraced`` / ``CustomVJPTraced`` that ``jax_custom_jvp3`` / ``jax_custom_vjp3``
    bind instead (traced from the operation: it keeps its primal as a function)."""
    if hijax_name(eqn) is not None:
        return hijax_expansion(eqn)
    return eqn.params["call_jaxpr"]


def open_jaxpr(closed: ClosedJaxpr) -> tuple[Jaxpr, list[Any]]:
    """A closed jaxpr as an open one without constants, which primitives such as
    ``checkpoint``, ``shard_map`` and ``pmap`` require: the constants become leading inputs."""
    if not closed.consts:
        return closed.jaxpr, []
    from jax._src.interpreters import partial_eval as pe

    return pe.convert_constvars_jaxpr(closed.jaxpr), list(closed.consts)


def aval_of(x: Any) -> Any:
    """The abstract value (shape, dtype, weak type) of an array, tracer or Python scalar."""
    return jax.typeof(x)


def abstract_like(x: Any, dtype: Any) -> Any:
    """A ``jax.ShapeDtypeStruct`` of ``x``'s shape in ``dtype``, with the sharding ``x``'s type
    carries under a mesh of explicit axes (``jax.set_mesh``); without one, none."""
    aval = aval_of(x)
    sharding = getattr(aval, "sharding", None)
    if not getattr(getattr(sharding, "mesh", None), "axis_names", ()):
        return jax.ShapeDtypeStruct(aval.shape, dtype)
    return jax.ShapeDtypeStruct(aval.shape, dtype, sharding=sharding)


# Primitives whose parameters hold a scalar computation typed for their operand (the combiner
# of a scatter). They are first-order for amp's purposes, but moving their operands to another
# dtype means re-typing that computation, or lowering fails.
_SCALAR_COMPUTATION_PARAMS = {
    "scatter": ("update_jaxpr", "update_consts"),
    "scatter-add": ("update_jaxpr", "update_consts"),
    "scatter-sub": ("update_jaxpr", "update_consts"),
    "scatter-mul": ("update_jaxpr", "update_consts"),
    "scatter-min": ("update_jaxpr", "update_consts"),
    "scatter-max": ("update_jaxpr", "update_consts"),
}
FIRST_ORDER_WITH_JAXPRS = frozenset(_SCALAR_COMPUTATION_PARAMS)


def retype_scalar_computation(
    eqn: Any, invals: Sequence[Any], params: dict[str, Any]
) -> dict[str, Any]:
    """Re-types a scatter's combiner for the dtype its operand now has."""
    keys = _SCALAR_COMPUTATION_PARAMS.get(eqn.primitive.name)
    if keys is None:
        return params
    jaxpr_key, consts_key = keys
    jaxpr = params.get(jaxpr_key)
    dtype = invals[0].dtype
    if jaxpr is None or all(v.aval.dtype == dtype for v in jaxpr.invars):
        return params
    consts = params.get(consts_key, ())
    scalar = jax.ShapeDtypeStruct((), dtype)
    retyped = jax.make_jaxpr(lambda *xs: jax.core.eval_jaxpr(jaxpr, consts, *xs))(
        *[scalar] * len(jaxpr.invars)
    )
    return {**params, jaxpr_key: retyped.jaxpr, consts_key: tuple(retyped.consts)}


def sub_jaxprs(eqn: Any) -> Iterator[Any]:
    """The open jaxprs an equation carries (closed ones are opened), for walking a program:
    a hijax operation's too (:func:`hijax_jaxprs`)."""
    values = list(eqn.params.values()) if hijax_name(eqn) is None else hijax_jaxprs(eqn)
    for value in values:
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, Jaxpr):
                yield v


def scan_layout(eqn: Any) -> tuple[int, int]:
    """``(constants, carries)`` among a ``scan`` equation's inputs; the rest are sliced per
    iteration. The body's arity cannot tell carries from constants, so this reads the
    equation's own record of the grouping: ``num_consts``/``num_carry`` up to JAX 0.10, the
    flat tree ``ft_in`` of (constants, carries, sliced inputs) from 0.11 on."""
    p = eqn.params
    if "num_carry" in p:
        return p["num_consts"], p["num_carry"]
    groups = p.get("ft_in")
    if groups is not None:
        consts, carry, _ = groups.unpack()
        return len(consts), len(carry)
    raise NotImplementedError(
        f"amp cannot read how this JAX version ({jax.__version__}) groups a scan's inputs "
        f"(parameters: {', '.join(sorted(p))})"
    )


def while_layout(eqn: Any) -> tuple[int, int]:
    """``(condition constants, body constants)`` among a ``while`` equation's inputs, read
    off its jaxprs' arity: the body returns exactly the carries, and each jaxpr takes its
    constants, then the carries."""
    p = eqn.params
    n_carry = len(p["body_jaxpr"].out_avals)
    return len(p["cond_jaxpr"].in_avals) - n_carry, len(p["body_jaxpr"].in_avals) - n_carry


def shard_map_manual_axes(params: dict[str, Any]) -> frozenset:
    """The mesh axes a ``shard_map`` equation makes manual: ``manual_axes`` up to JAX 0.6,
    ``newly_manual_axes`` since."""
    return frozenset(params.get("newly_manual_axes", params.get("manual_axes", ())))


def hook_custom_calls(*, vjp: Any, jvp: Any) -> None:
    """Routes every call of a ``jax.custom_vjp`` / ``jax.custom_jvp`` function through
    ``vjp(self, original, args, kwargs)`` / ``jvp(...)``, which may call ``original``.

    amp needs to see these calls while the values they close over are alive
    (:mod:`autocast._src.transform.closures`); JAX offers no hook, so the classes'
    ``__call__`` is wrapped,
    once. The hooks pass straight through unless amp is tracing.
    """
    for cls, hook in ((jax.custom_vjp, vjp), (jax.custom_jvp, jvp)):
        original = cls.__call__
        if getattr(original, "_autocast_hook", False):
            continue

        def call(
            self: Any, *args: Any, _original: Any = original, _hook: Any = hook, **kwargs: Any
        ) -> Any:
            return _hook(self, _original, args, kwargs)

        call._autocast_hook = True  # type: ignore[attr-defined]
        call.__wrapped__ = original  # type: ignore[attr-defined]
        cls.__call__ = call


def backward_cotangents(out: Any) -> tuple[list[Any], Any]:
    """The cotangents in what a linearised ``custom_vjp``'s backward rule returned, and how
    to return others in their place: the rule returns a list of them up to JAX 0.11.0, a
    pair ``(cotangents, backward-pass logs)`` after (``custom_vjp.defvjp_with_logs``)."""
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], (list, tuple)):
        cts, logs = out
        return list(cts), lambda new: (list(new), logs)
    return list(out), list


def zero_cotangent(aval: Any) -> Any:
    """A cotangent known to be zero for an output of abstract value ``aval``, to hand to the
    pullback ``jax.vjp`` returned. Where the pullback takes JAX's symbolic zero (0.10 does,
    0.6.2 does not), that: a ``custom_vjp`` rule underneath then receives a symbolic zero, as
    it would without amp, which JAX 0.12's ``vmap`` check of a shared output's cotangent
    needs (a diffrax solve under ``vmap``). Elsewhere an array of zeros."""
    tangent = aval.to_ct_aval() if hasattr(aval, "to_ct_aval") else aval.to_tangent_aval()
    if _pullback_takes_symbolic_zeros():
        from jax._src.ad_util import Zero

        return Zero(tangent)
    return np.zeros(tangent.shape, tangent.dtype)


@functools.lru_cache(maxsize=None)
def _pullback_takes_symbolic_zeros() -> bool:
    # Asked of the installed JAX once, by trying: its pullback either flattens a symbolic
    # zero as one leaf, or rejects the unknown tree structure (ValueError). Evaluated now,
    # not staged into whatever amp is tracing when it first asks.
    from jax._src.ad_util import Zero

    one = np.float32(1.0)
    with jax.ensure_compile_time_eval():
        _, pullback = jax.vjp(lambda x: (x, x), one)
        try:
            pullback((Zero(jax.typeof(one)), one))
        except ValueError:
            return False
    return True


def replace_public_function(module: str, name: str, wrap: Any) -> None:
    """Replaces the public function ``module.name`` by ``wrap(function)`` (once), so that
    calls through the module reach the wrapper: code that calls
    ``jax.nn.dot_product_attention(...)``, and Flax's attention, which does. A name bound
    by ``from module import name`` before autocast was imported keeps the original. A
    module this JAX (or this platform's jaxlib) lacks is left alone."""
    try:
        owner = importlib.import_module(module)
    except ImportError:
        return
    original = getattr(owner, name, None)
    if original is not None:
        setattr(owner, name, wrap(original))


def rewrap(fun: Any, fn: Any) -> Any:
    """``fn`` in place of the ``lu.WrappedFun`` ``fun`` (a ``custom_lin``'s backward rule),
    with the same debug information."""
    from jax._src import linear_util as lu

    return lu.wrap_init(fn, debug_info=fun.debug_info)


def vmapped_by(x: Any) -> frozenset:
    """The ``jax.vmap`` traces that batch ``x``: its own and those under the primal of a
    differentiation tracer. Empty for a value no enclosing vmap maps."""
    from jax._src.interpreters import ad, batching

    traces = set()
    while isinstance(x, jax.core.Tracer):
        if isinstance(x, batching.BatchTracer):
            if isinstance(x.batch_dim, int):
                traces.add(id(x._trace))
            x = x.val
        elif isinstance(x, (ad.JVPTracer, getattr(ad, "LinearizeTracer", ad.JVPTracer))):
            x = x.primal
        else:
            break
    return frozenset(traces)


def retraceable(aval: Any) -> bool:
    """Whether tracing on ``jax.ShapeDtypeStruct(shape, dtype, weak_type)`` reproduces this
    abstract value: not when it carries a mesh (explicit sharding, or inside ``shard_map``
    the axes it varies over), which the struct would drop."""
    mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
    if mesh is not None and not getattr(mesh, "empty", True):
        return False
    mat = getattr(aval, "mat", None)  # JAX 0.10 on: the manual axes' types
    return not (getattr(aval, "vma", None) or getattr(mat, "varying", None))


def trace_open(fn: Any, args: Sequence[Any]) -> tuple[Jaxpr, list[Any]]:
    """``fn`` traced on the types of ``args``, as an open jaxpr and its constants."""
    closed = jax.make_jaxpr(fn)(
        *(jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=aval_of(x).weak_type) for x in args)
    )
    return open_jaxpr(closed)


def bind_checkpoint(
    jaxpr: Jaxpr,
    consts: Sequence[Any],
    args: Sequence[Any],
    *,
    policy: Any,
    prevent_cse: bool = False,
) -> Any:
    """What ``jax.checkpoint(fn, prevent_cse=prevent_cse, policy=policy)(*args)`` binds, for
    an ``fn`` already traced to ``jaxpr`` (see :func:`trace_open`); its single output."""
    from jax._src.ad_checkpoint import remat_p

    (out,) = remat_p.bind(
        *consts, *args, jaxpr=jaxpr, prevent_cse=prevent_cse, differentiated=False, policy=policy
    )
    return out


# --- hijax: JAX's primitives written as Python objects (JAX 0.10 on) ---------------------------
#
# From JAX 0.10, some of JAX's own operations are objects of a class (``RematTraced`` for
# ``jax.checkpoint`` under ``jax_remat3``, ``CheckpointName``, ``Scan3`` under ``jax_scan3``,
# ``CustomVJPTraced`` under ``jax_custom_vjp3``, ``CustomRoot``, ``Ldexp``...), all bound by
# one primitive, ``call_hi_primitive``, whose only parameter ``_prim`` is the object. The
# object carries the operation's parameters and, for a higher-order one, its jaxprs, where
# no walk of the equation's parameters finds them; so amp names such an equation by the
# object's class and reads its jaxprs here.

HIJAX_CALL = "call_hi_primitive"


def hijax_name(eqn: Any) -> str | None:
    """The class name of a hijax equation's operation (``"RematTraced"``...); None for an
    equation of an ordinary primitive."""
    if eqn.primitive.name != HIJAX_CALL:
        return None
    return type(eqn.params["_prim"]).__name__


def equation_name(eqn: Any) -> str:
    """What amp calls ``eqn``'s operation: the primitive's name, or a hijax operation's class
    name."""
    return hijax_name(eqn) or eqn.primitive.name


def _hijax_params(eqn: Any) -> dict[str, Any]:
    return dict(getattr(eqn.params["_prim"], "params", None) or {})


def _jaxprs_in(value: Any) -> Iterator[Any]:
    """The jaxprs (closed or open) held by a hijax operation's parameter: directly, in a
    tuple or list, in a traced function (``jax.jit(f).trace(...)``) or in another hijax
    operation."""
    if isinstance(value, (Jaxpr, ClosedJaxpr)):
        yield value
    elif type(value) in (tuple, list):
        for v in value:
            yield from _jaxprs_in(v)
    elif hasattr(value, "in_avals_flat") and isinstance(getattr(value, "params", None), dict):
        for v in value.params.values():
            yield from _jaxprs_in(v)
    elif type(value).__name__ == "Traced" and hasattr(value, "jaxpr"):
        yield value.jaxpr


def hijax_jaxprs(eqn: Any) -> list[Any]:
    """The jaxprs a hijax equation's operation carries (none for a first-order one)."""
    return [j for v in _hijax_params(eqn).values() for j in _jaxprs_in(v)]


def _bind_hijax(eqn: Any, invals: Sequence[Any], params: dict[str, Any]) -> Any:
    prim = params["_prim"]
    recorded = [v.aval for v in eqn.invars]
    now = [aval_of(x) for x in invals]
    same = all(
        a.shape == b.shape and a.dtype == b.dtype for a, b in zip(recorded, now, strict=True)
    )
    if not same and type(prim).__name__ == "CheckpointName":
        (x,) = invals
        return [type(prim)(_hijax_params(eqn)["name"], now[0])(x)]
    if not same:
        raise TypeError(
            f"amp cannot bind the hijax operation {type(prim).__name__} on inputs of types "
            f"{[a.str_short() for a in now]}: it was recorded for "
            f"{[a.str_short() for a in recorded]} and cannot be re-typed. Give it an "
            "original-precision rule, or run it under autocast.amp_stop()."
        )
    return eqn.primitive.bind(*invals, **params)


def checkpoint_name_primitive(eqn: Any) -> Primitive | None:
    """The primitive ``checkpoint_name`` binds without ``jax_remat3`` (``name``), for a
    ``CheckpointName`` equation, which the policy then decides as that primitive; None for
    any other equation."""
    if hijax_name(eqn) != "CheckpointName":
        return None
    return primitive_by_name("name")


def mark_name(eqn: Any) -> str | None:
    """The name a ``checkpoint_name`` mark gives its value: a ``name`` equation's, or under
    ``jax_remat3`` a ``CheckpointName``'s; None for any other equation."""
    if eqn.primitive.name == "name":
        return eqn.params.get("name")
    if hijax_name(eqn) == "CheckpointName":
        return _hijax_params(eqn).get("name")
    return None


def remat3_body(eqn: Any) -> tuple[Jaxpr, Sequence[Any]]:
    """``(open jaxpr, constants)`` of a ``jax.checkpoint`` under ``jax_remat3`` (a
    ``RematTraced`` equation), evaluated on the equation's inputs."""
    sub = _hijax_params(eqn)["jaxpr"]  # closed (from JAX 0.11 every jaxpr is)
    return sub.jaxpr, sub.consts


def bind_remat3(eqn: Any, traced: Any, args: Sequence[Any], extra: Sequence[Any] = ()) -> list:
    """``eqn``'s ``jax.checkpoint`` (a ``RematTraced`` equation) bound again with the same
    policy and ``prevent_cse``, its body now the closed jaxpr ``traced``, on ``args`` (one
    per recorded input) and ``extra`` (amp's float8 histories). The body's constants become
    leading inputs; neither they nor ``extra`` are covered by a ``prevent_cse`` of the
    user's, given per input."""
    prim = eqn.params["_prim"]
    params = _hijax_params(eqn)
    body, consts = open_jaxpr(traced)
    if ClosedJaxpr is not Jaxpr:  # up to JAX 0.10 RematTraced takes a closed jaxpr
        body = ClosedJaxpr(body, [])
    kwargs = {}
    if "prevent_cse" in params:  # JAX 0.11 on: a flag, or one per input
        cse = params["prevent_cse"]
        if not isinstance(cse, bool):
            cse = (False,) * len(consts) + tuple(cse) + (False,) * len(extra)
        kwargs["prevent_cse"] = cse
    return list(type(prim)(body, params["policy"], **kwargs)(*consts, *args, *extra))


def custom_vjp3_consts(eqn: Any) -> int:
    """How many leading inputs of a ``jax.custom_vjp`` equation are not its arguments but
    values its function closed over: ``num_consts`` of a ``custom_vjp_call``; for the
    ``CustomVJPTraced`` of ``jax_custom_vjp3`` from JAX 0.11 on, the closure and the forward
    rule's extra inputs (0.10 refuses a closure over traced values)."""
    if hijax_name(eqn) is None:
        return eqn.params.get("num_consts", 0)
    prim = eqn.params["_prim"]
    if not hasattr(type(prim), "drop_fwd_consts"):
        return 0
    return sum(c.num_leaves for c in prim.in_tree.children()[:2])


def custom_vjp_takes_symbolic_zeros() -> bool:
    """Whether a ``jax.custom_vjp`` made now may ask for symbolic zeros and still be
    differentiated forward (as a classic ``jax.checkpoint`` does its body): not under
    ``jax_custom_vjp3`` on JAX 0.10, whose ``CustomVJPTraced`` has no JVP with them."""
    if not getattr(jax.config, "jax_custom_vjp3", False):
        return True
    from jax._src import hijax

    return hasattr(hijax.CustomVJPTraced, "drop_fwd_consts")


def custom_call_rules_kept(eqn: Any) -> str | None:
    """What of a ``CustomVJPTraced`` amp cannot carry into the ``jax.custom_vjp`` it binds in
    its place (rules it keeps as given, not as fwd and bwd); None when nothing (and for a
    ``custom_vjp_call``, which has no others)."""
    if hijax_name(eqn) is None:
        return None
    params = _hijax_params(eqn)
    if params.get("remat_rules") is not None:
        return "rematerialisation rules (custom_vjp.defremat, custom_gradient(remat=True))"
    if params.get("bwd_accums") is not None:
        return "accumulating backward rule (custom_vjp.defvjp_with_accums)"
    return None


def hijax_expansion(eqn: Any) -> ClosedJaxpr:
    """What a hijax equation computes, as JAX would lower it (``expand``), as a closed jaxpr
    over the equation's inputs: a ``CustomVJPTraced``'s primal function."""
    prim = eqn.params["_prim"]

    def expanded(*flat: Any) -> list[Any]:
        out = prim.expand(*jax.tree_util.tree_unflatten(prim.in_tree, flat))
        return jax.tree_util.tree_leaves(out)

    return jax.make_jaxpr(expanded)(
        *(
            jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type)
            for v in eqn.invars
        )
    )


def scan3_layout(eqn: Any) -> tuple[Jaxpr, Sequence[Any], list[bool], dict[str, Any]]:
    """A ``lax.scan`` under ``jax_scan3`` (a ``Scan3`` equation): its body as an open jaxpr and
    constants, which of its inputs are sliced per iteration, and ``length``, ``reverse`` and
    ``unroll``. Its carries are ``Ref``s the body reads and writes; its outputs the stacked
    per-iteration results."""
    params = _hijax_params(eqn)
    sub = params["jaxpr"]  # closed, as RematTraced's
    body, consts = sub.jaxpr, sub.consts
    loop = {k: params[k] for k in ("length", "reverse", "unroll")}
    return body, consts, list(params["extensives"]), loop


def bind_scan3(body: Any, sliced: Sequence[Any], length: int, reverse: bool, unroll: Any) -> Any:
    """``lax.scan`` as ``jax_scan3`` binds it (a ``Scan3``), of ``body(slices)`` over the
    leading axis of ``sliced``; what ``body`` closes over (the carries' ``Ref``s among it)
    becomes the scan's constants. Its stacked outputs."""
    from jax._src.lax.control_flow.loops import scan_nocarry

    return scan_nocarry(body, list(sliced), length=length, reverse=reverse, unroll=unroll)


def is_ref_type(aval: Any) -> bool:
    """Whether ``aval`` is the type of a ``Ref`` (``jax.new_ref``; none before JAX 0.8)."""
    ref = getattr(getattr(jax, "ref", None), "AbstractRef", None)
    return ref is not None and isinstance(aval, ref)


def trace_context() -> Any:
    """The JAX settings a trace depends on (``jax_enable_x64``, the ``jax_*3`` options, the
    mesh in context...), hashable: what ``jax.jit`` adds to its cache's key, so that a trace
    made under other settings is not reused."""
    from jax._src import config

    return config.trace_context()


def is_transposed(source_info: Any) -> bool:
    """Whether an equation with this source information was made by transposition (it
    belongs to a backward pass). Read off the name stack's items: JAX 0.6 leaves transforms
    out of its string when there are no scopes."""
    return any(
        type(item).__name__ == "Transform" and getattr(item, "name", None) == "transpose"
        for item in getattr(source_info.name_stack, "stack", ())
    )


# Calls: equations that evaluate one sub-jaxpr on their inputs, by the parameter holding it
# (``jax.jit``, ``closed_call``, ``jax.checkpoint``, custom-derivative functions' primals).
_CALLED_JAXPR = {
    **{name: "jaxpr" for name in JIT_NAMES},
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "eval_jaxpr": "call_jaxpr",  # closed_call's primitive, renamed after JAX 0.11.0
    "remat2": "jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
}


def called_jaxpr(eqn: Any) -> tuple[Jaxpr, Sequence[Any]] | None:
    """``(jaxpr, consts)`` of a call equation, evaluated on the equation's inputs to give its
    outputs; None for any other equation. A ``jax.checkpoint`` under ``jax_remat3`` is one,
    and so is a custom-derivative function under ``jax_custom_vjp3`` / ``jax_custom_jvp3``
    (its primal)."""
    hijax = hijax_name(eqn)
    if hijax == "RematTraced":
        return remat3_body(eqn)
    if hijax in ("CustomVJPTraced", "CustomJVPTraced"):
        primal = hijax_expansion(eqn)
        return primal.jaxpr, primal.consts
    key = _CALLED_JAXPR.get(eqn.primitive.name)
    if key is None:
        return None
    sub = eqn.params[key]
    return (sub.jaxpr, sub.consts) if isinstance(sub, ClosedJaxpr) else (sub, ())


def shard_map(fn: Any, mesh: Any, in_specs: Any, out_specs: Any) -> Any:
    """``jax.shard_map`` (``jax.experimental.shard_map`` before JAX 0.7), for the tests and
    benchmarks that build sharded programs."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    from jax.experimental.shard_map import shard_map as legacy

    return legacy(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)


def varying_axes(x: Any) -> frozenset:
    """The ``shard_map`` mesh axes along which ``x`` varies: the type's ``vma`` up to JAX
    0.9, its ``manual_axis_type.varying`` since; empty outside ``shard_map``."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    if manual is not None:
        return frozenset(getattr(manual, "varying", ()))
    return frozenset(getattr(aval, "vma", ()))


def invariant_like(x: Any, like: Any) -> Any:
    """``x`` summed over the ``shard_map`` axes it varies along and ``like`` does not, so it
    can stand as ``like``'s cotangent (a custom derivative rule must give a replicated input
    a replicated cotangent). Outside ``shard_map``, ``x`` as it is."""
    extra = tuple(sorted(varying_axes(x) - varying_axes(like)))
    return jax.lax.psum(x, extra) if extra else x
