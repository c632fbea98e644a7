"""Custom derivative rules that close over traced values: made into explicit inputs while amp
traces.

JAX traces a custom rule (a ``custom_vjp``'s forward and backward, a ``custom_jvp``'s JVP)
only when the function is differentiated. ``amp`` traces ``fn`` once and evaluates the jaxpr
afterwards, so when ``jax.grad(amp(fn))`` finally asks for a rule, whatever the rule closed
over (the weight in ``lambda g: g @ w.T`` of a ``jax.custom_gradient``) belongs to a trace that
has ended, and JAX reports a leaked tracer. ``jax.jit`` has the same limit; amp removes it.

While amp traces, each ``custom_vjp`` / ``custom_jvp`` call is rewritten on the spot, while
the values are still alive: its rules are traced once to find the traced values they close
over, and the call becomes one of an equivalent custom function that takes those values as
one more (leading) argument. They are then data in the jaxpr like any other input, and amp
carries their current values to the equation. When a rule is needed later it is traced again
and every closed-over value is replaced by the argument that now carries it. A rule that
closes over nothing traced is left exactly as it was.

As without amp, a rule says nothing about derivatives with respect to what it closes over:
differentiating with respect to such a value raises a ``ValueError`` that says so, where JAX
itself raises a leaked-tracer error.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import types
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from autocast import _compat
from autocast._src.tree import is_array, is_inexact_dtype

_state = threading.local()


def _depth() -> int:
    return getattr(_state, "depth", 0)


@contextlib.contextmanager
def rewriting(on: bool = True) -> Iterator[None]:
    """Within this context (amp's own trace of ``fn``), custom calls are rewritten; ``on=False``
    suspends that (while a rule is traced to see what it closes over)."""
    before = _depth()
    _state.depth = before + 1 if on else 0
    try:
        yield
    finally:
        _state.depth = before


def _closure_error(kind: str, fun: Any) -> ValueError:
    name = getattr(fun, "__name__", repr(fun))
    return ValueError(
        f"differentiating with respect to a value that the {kind} rules of '{name}' close over: "
        "the rule defines no derivative for it. Pass the value as an argument of the custom "
        "function instead (JAX raises a leaked-tracer error for the same program)."
    )


# --- tracing a rule with its closed-over values swapped ------------------------------------------


def _unwrap(x: Any) -> Any:
    return x.value if isinstance(x, CustomVJPPrimal) else x


def _is_wrapper(x: Any) -> bool:
    return isinstance(x, (CustomVJPPrimal, SymbolicZero))


def instantiate(x: Any) -> Any:
    """A symbolic zero as the array of zeros it stands for; anything else as it is."""
    return jnp.zeros(x.shape, x.dtype) if isinstance(x, SymbolicZero) else x


def traced_call(fn: Callable[..., Any], args: Sequence[Any]) -> tuple[Any, Callable, list]:
    """``fn(*args)`` as a closed jaxpr over the array leaves of ``args`` (``CustomVJPPrimal``
    wrappers opened; everything else held as it is), and how to rebuild its output."""
    leaves, tree = jax.tree_util.tree_flatten(list(args), is_leaf=_is_wrapper)
    dynamic = [i for i, x in enumerate(leaves) if is_array(_unwrap(x))]
    values = [_unwrap(leaves[i]) for i in dynamic]
    store: dict[str, Any] = {}

    def flat(*xs: Any) -> list[Any]:
        rebuilt = list(leaves)
        for i, x in zip(dynamic, xs):
            rebuilt[i] = (
                CustomVJPPrimal(x, leaves[i].perturbed)
                if isinstance(leaves[i], CustomVJPPrimal)
                else x
            )
        out = fn(*jax.tree_util.tree_unflatten(tree, rebuilt))
        out_leaves, store["tree"] = jax.tree_util.tree_flatten(out)
        store["static"] = [None if is_array(x) else x for x in out_leaves]
        return [x for x in out_leaves if is_array(x)]

    closed = jax.make_jaxpr(flat)(*values)

    def rebuild(outs: Sequence[Any]) -> Any:
        it = iter(outs)
        return jax.tree_util.tree_unflatten(
            store["tree"], [next(it) if s is None else s for s in store["static"]]
        )

    return closed, rebuild, values


def _call_swapped(
    fn: Callable[..., Any], args: Sequence[Any], old: Sequence[Any], new: Sequence[Any]
) -> Any:
    """``fn(*args)``, with each closed-over traced value in ``old`` replaced by ``new``'s."""
    closed, rebuild, values = traced_call(fn, args)
    swap = {id(o): n for o, n in zip(old, new)}
    consts = [swap.get(id(c), c) if isinstance(c, jax.core.Tracer) else c for c in closed.consts]
    return rebuild(jax.core.eval_jaxpr(closed.jaxpr, consts, *values))


def _closed_over(*closed_jaxprs: Any) -> list[Any]:
    """The traced values (tracers of live traces) that the given jaxprs closed over, once each."""
    found: dict[int, Any] = {}
    for closed in closed_jaxprs:
        for c in closed.consts:
            if isinstance(c, jax.core.Tracer):
                found.setdefault(id(c), c)
    return list(found.values())


# How deep the cheap look at a rule's closure goes before it gives up and traces the rule.
_MAX_DEPTH = 8
_OPAQUE = (
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    type,
    types.ModuleType,
    np.ndarray,
    np.generic,
    np.dtype,
    types.BuiltinFunctionType,
    types.CodeType,
    inspect.Signature,
    jax.tree_util.PyTreeDef,
)


def _may_hold_tracer(obj: Any, seen: set[int] | None = None, depth: int = 0) -> bool:
    """Whether ``obj`` (a rule, what it closes over, what that holds...) may reach a tracer.

    A cheap walk through closures, defaults, partials, bound methods, containers, pytrees and
    object attributes: most rules (``jax.nn.relu``'s, diffrax's) hold nothing traced, and
    tracing them to find out would cost every model a trace of each. Where the walk cannot
    see, it answers yes and the rule is traced.
    """
    if isinstance(obj, jax.core.Tracer):
        return True
    if obj is None or isinstance(obj, _OPAQUE) or isinstance(obj, jax.Array):
        return False
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return False
    seen.add(id(obj))
    if depth > _MAX_DEPTH:
        return True
    if isinstance(obj, types.FunctionType):
        parts = [*_cells(obj), *(obj.__defaults__ or ()), *(obj.__kwdefaults__ or {}).values()]
    elif isinstance(obj, types.MethodType):
        parts = [obj.__func__, obj.__self__]
    elif isinstance(obj, functools.partial):
        parts = [obj.func, *obj.args, *obj.keywords.values()]
    elif isinstance(obj, jax.custom_vjp):  # its primal's closure is JAX's business, not ours
        parts = [obj.fwd, obj.bwd]
    elif isinstance(obj, jax.custom_jvp):
        parts = [getattr(obj, "jvp", None)]
    elif hasattr(obj, "__wrapped__"):  # jax.jit, functools.wraps: what it calls is what matters
        parts = [obj.__wrapped__]
    elif isinstance(obj, (tuple, list, set, frozenset)):
        parts = list(obj)
    elif isinstance(obj, dict):
        parts = list(obj.values())
    else:
        leaves = jax.tree_util.tree_leaves(obj)
        if len(leaves) != 1 or leaves[0] is not obj:
            parts = leaves
        elif hasattr(obj, "__dict__"):
            parts = list(vars(obj).values())
        else:
            return True
    return any(_may_hold_tracer(p, seen, depth + 1) for p in parts)


def _cells(fn: types.FunctionType) -> list[Any]:
    found = []
    for cell in fn.__closure__ or ():
        try:
            found.append(cell.cell_contents)
        except ValueError:  # an empty cell: a name not bound yet
            pass
    return found


def _positional(fun: Callable[..., Any], args: tuple, kwargs: dict) -> tuple | None:
    """The call's arguments as positional ones, as the custom function binds them; None if that
    cannot be done (the original call then reports the problem)."""
    if not kwargs:
        return args
    try:
        bound = inspect.signature(fun).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return None
    bound.apply_defaults()
    return None if bound.kwargs else tuple(bound.args)


def _tangent_spec(x: Any) -> Any:
    dtype = x.dtype if is_inexact_dtype(x.dtype) else jax.dtypes.float0
    return jax.ShapeDtypeStruct(np.shape(x), dtype)


# --- custom_vjp ----------------------------------------------------------------------------------


def _vjp_closure(self: Any, args: tuple) -> list[Any]:
    """The traced values ``self``'s forward and backward rules close over, at ``args``.

    A rule that asks for symbolic zeros may close over different values depending on which
    inputs are perturbed; it is traced as differentiation will most likely call it (every
    floating input perturbed) and, should it refuse that (Equinox asserts that the inputs it
    marked non-differentiable are unperturbed), with nothing perturbed."""
    if not self.symbolic_zeros:
        return _vjp_closure_for(self, args, None)
    try:
        return _vjp_closure_for(self, args, lambda v: is_inexact_dtype(v.dtype))
    except Exception:
        return _vjp_closure_for(self, args, lambda v: False)


def _vjp_closure_for(self: Any, args: tuple, perturbed: Callable[[Any], bool] | None) -> list[Any]:
    nondiff = set(self.nondiff_argnums)

    def fwd_args(xs: Sequence[Any]) -> list[Any]:
        if perturbed is None:
            return list(xs)
        return [
            x
            if i in nondiff
            else jax.tree_util.tree_map(lambda v: CustomVJPPrimal(v, perturbed(v)), x)
            for i, x in enumerate(xs)
        ]

    fwd_jaxpr, rebuild, _ = traced_call(lambda *xs: self.fwd(*fwd_args(xs)), args)
    out, res = rebuild([jax.ShapeDtypeStruct(a.shape, a.dtype) for a in fwd_jaxpr.out_avals])
    statics = [args[i] for i in sorted(nondiff)]
    cts = jax.tree_util.tree_map(_tangent_spec, out)
    res_leaves, res_tree = jax.tree_util.tree_flatten(res)
    array_res = [i for i, x in enumerate(res_leaves) if isinstance(x, jax.ShapeDtypeStruct)]
    ct_leaves, ct_tree = jax.tree_util.tree_flatten(cts)

    def bwd_flat(*xs: Any) -> Any:
        leaves = list(res_leaves)
        for i, x in zip(array_res, xs[: len(array_res)]):
            leaves[i] = x
        ct = jax.tree_util.tree_unflatten(ct_tree, xs[len(array_res) :])
        return self.bwd(*statics, jax.tree_util.tree_unflatten(res_tree, leaves), ct)

    bwd_jaxpr = jax.make_jaxpr(bwd_flat)(*[res_leaves[i] for i in array_res], *ct_leaves)
    return _closed_over(fwd_jaxpr, bwd_jaxpr)


def _hoist(
    self: Any, args: tuple, kwargs: dict, rules: Any, find: Callable[[Any, tuple], list[Any]]
) -> tuple[tuple, list[Any]] | None:
    """The call's positional arguments and the traced values its ``rules`` close over (as
    ``find(self, args)`` finds them), or None where there are none and the call is left as
    the user wrote it: also when a rule cannot be traced at these arguments, so that JAX
    itself says what is wrong with it."""
    positional = _positional(self.fun, args, kwargs)
    if positional is None or not _may_hold_tracer(rules):
        return None
    try:
        with rewriting(False):
            hoisted = find(self, positional)
    except Exception:
        return None
    return (positional, hoisted) if hoisted else None


def _without_closure(fun: Callable[..., Any]) -> Callable[..., Any]:
    """``fun`` taking the hoisted values as a leading argument it does not use."""
    return lambda closure, *xs: fun(*xs)


def _rewrite_vjp(self: Any, original: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    found = _hoist(self, args, kwargs, (self.fwd, self.bwd), _vjp_closure)
    if found is None:
        return original(self, *args, **kwargs)
    positional, hoisted = found
    nondiff = tuple(self.nondiff_argnums)
    user_symbolic = self.symbolic_zeros

    def fwd(closure: Any, *xs: Any) -> Any:
        if any(p.perturbed for p in closure):
            raise _closure_error("custom_vjp", self.fun)
        values = [p.value for p in closure]
        if not user_symbolic:
            xs = tuple(
                x if i in nondiff else jax.tree_util.tree_map(_unwrap, x, is_leaf=_is_wrapper)
                for i, x in enumerate(xs)
            )
        out, res = _call_swapped(self.fwd, xs, hoisted, values)
        return out, (values, res)

    def bwd(*xs: Any) -> tuple:
        *statics, (values, res), cts = xs
        if not user_symbolic:
            cts = jax.tree_util.tree_map(instantiate, cts, is_leaf=_is_wrapper)
        grads = _call_swapped(self.bwd, [*statics, res, cts], hoisted, values)
        return (None, *grads)

    shifted = tuple(i + 1 for i in nondiff)
    rewritten = jax.custom_vjp(_without_closure(self.fun), nondiff_argnums=shifted)
    rewritten.defvjp(fwd, bwd, symbolic_zeros=True)
    return original(rewritten, tuple(hoisted), *positional)


# --- custom_jvp ----------------------------------------------------------------------------------


def _jvp_closure(self: Any, args: tuple) -> list[Any]:
    """The traced values ``self``'s JVP rule closes over, at ``args``."""
    nondiff = set(self.nondiff_argnums)
    statics = [args[i] for i in sorted(nondiff)]
    primals = tuple(x for i, x in enumerate(args) if i not in nondiff)
    tangents = jax.tree_util.tree_map(
        lambda x: np.zeros(np.shape(x), jax.dtypes.float0) if not is_inexact_dtype(x.dtype) else x,
        primals,
    )
    closed, _, _ = traced_call(
        lambda p, t: self.jvp(*statics, tuple(p), tuple(t)), [primals, tangents]
    )
    return _closed_over(closed)


def _rewrite_jvp(self: Any, original: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    rule = getattr(self, "jvp", None)
    found = None if rule is None else _hoist(self, args, kwargs, rule, _jvp_closure)
    if found is None:
        return original(self, *args, **kwargs)
    positional, hoisted = found
    nondiff = tuple(self.nondiff_argnums)
    user_symbolic = self.symbolic_zeros

    def jvp(*xs: Any) -> Any:
        *statics, primals, tangents = xs
        closure, primals = primals[0], tuple(primals[1:])
        if any(not isinstance(t, SymbolicZero) for t in tangents[0]):
            raise _closure_error("custom_jvp", self.fun)
        tangents = tuple(tangents[1:])
        if not user_symbolic:
            tangents = jax.tree_util.tree_map(instantiate, tangents, is_leaf=_is_wrapper)
        return _call_swapped(self.jvp, [*statics, primals, tangents], hoisted, list(closure))

    shifted = tuple(i + 1 for i in nondiff)
    rewritten = jax.custom_jvp(_without_closure(self.fun), nondiff_argnums=shifted)
    rewritten.defjvp(jvp, symbolic_zeros=True)
    return original(rewritten, tuple(hoisted), *positional)


def _hook(rewrite: Callable[..., Any]) -> Callable[..., Any]:
    def call(self: Any, original: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if _depth() <= 0:
            return original(self, *args, **kwargs)
        return rewrite(self, original, args, kwargs)

    return call


_compat.hook_custom_calls(vjp=_hook(_rewrite_vjp), jvp=_hook(_rewrite_jvp))
