"""``amp``: evaluate any JAX function under a mixed-precision policy; ``amp_stop``."""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import threading
import weakref
from typing import Any, Callable, Iterator, Mapping, Sequence, TypeVar, overload

import jax

from autocast import _compat
from autocast._src.fp8 import products as fp8
from autocast._src.policy.casting import cast_value
from autocast._src.policy.dtypes import canonicalize_float_dtype, half_dtype_for
from autocast._src.policy.precision import is_compute_rule
from autocast._src.policy.table import changes_no_dtype, default_amp_policy
from autocast._src.policy.target import emulated_compute_refusal, target_of
from autocast._src.transform import (
    closures,
    entry_points,
    handlers,  # noqa: F401 - fills the interpreter's handler table
    writes,
)
from autocast._src.transform.interpreter import RAW, UNMAPPED, Context, eval_jaxpr
from autocast._src.tree import is_array, is_floating_dtype

F = TypeVar("F", bound=Callable[..., Any])

# Traces kept per amp-wrapped function, most recent last (like jit's cache, but bounded).
_TRACE_CACHE_SIZE = 64

# Arrays are traced, and so are Python floats, as jax.jit traces them: a learning rate that
# changes every call is one program. But code may branch on a float (``eqx.nn.Dropout(0.0)``
# checks ``p == 0`` only for a Python number, as eqx.filter_jit keeps it), so where tracing
# with floats traced fails, amp traces again with them static, and remembers that for the
# argument structure: there a new float value is a new trace. Every other leaf is static.

# Traces are shared by every amp function of the same fn and settings, as jax.jit's cache is
# keyed on the function: ``amp(loss)(params, batch)`` written inside a loop traces once. The
# cache holds fn weakly, and its traces do not refer to fn.
_SHARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _TraceCache:
    """The traces of one function under one setting, and the argument structures whose
    Python floats must stay static."""

    __slots__ = ("traces", "static_floats")

    def __init__(self) -> None:
        self.traces: collections.OrderedDict = collections.OrderedDict()
        self.static_floats: set = set()


def _shared_cache(fn: Any, settings: tuple) -> _TraceCache:
    try:
        return _SHARED.setdefault(fn, {}).setdefault(settings, _TraceCache())
    except TypeError:  # fn or a setting cannot be hashed or weakly referenced: its own cache
        return _TraceCache()


# While amp traces a function, an amp function called inside it is transparent: the
# outermost amp's settings decide, as the outermost context does for torch.autocast.
_tracing = threading.local()


def _outer_amp_tracing() -> bool:
    return getattr(_tracing, "depth", 0) > 0


@contextlib.contextmanager
def _tracing_fn() -> Iterator[None]:
    _tracing.depth = getattr(_tracing, "depth", 0) + 1
    try:
        with closures.rewriting():
            yield
    finally:
        _tracing.depth -= 1


def _is_dynamic(x: Any) -> bool:
    return is_array(x)


def _check_policy(amp_policy: Any) -> dict[Any, Callable[..., Any]]:
    if not isinstance(amp_policy, Mapping):
        raise TypeError(
            "amp_policy must be a dict from named-scope strings or jax primitives to precision "
            f"functions, got {type(amp_policy).__name__}"
        )
    for key, rule in amp_policy.items():
        if not isinstance(key, (str, _compat.Primitive)):
            raise TypeError(
                f"amp_policy key {key!r} is neither a named-scope string nor a jax primitive "
                "(such as jax.lax.exp_p)"
            )
        if not callable(rule):
            raise TypeError(
                f"amp_policy[{key!r}] must be a precision function "
                f"f(compute_dtype, original_dtypes, *invars, **params), got {rule!r}"
            )
    return dict(amp_policy)


class _Traced:
    """One trace of the user's function: its jaxpr, how to rebuild its outputs, and the
    compiled versions used when it is called outside any transformation."""

    __slots__ = ("jaxpr", "out_tree", "out_static", "out_avals", "writes", "compiled")

    def __init__(self, jaxpr: Any, out_tree: Any, out_static: list, writes: list) -> None:
        self.jaxpr = jaxpr
        self.out_tree = out_tree
        self.out_static = out_static
        self.out_avals = list(jaxpr.out_avals)
        # (index among the arguments' NNX variables, its new value if static, else None):
        # the jaxpr's last outputs are the new values of those written with an array
        self.writes = writes
        self.compiled: dict[tuple, Callable[..., list]] = {}

    def evaluate(self, ctx: Context) -> Callable[..., list]:
        """The jaxpr evaluated under ``ctx``, outputs cast back to the original dtypes and
        weak types (``amp(lambda a: a * 2)(1.0)`` is weak, as under ``jax.jit``). Under a
        policy that changes no dtype, the jaxpr as recorded (see
        :func:`autocast._src.policy.table.changes_no_dtype`)."""
        if ctx.observer is None and changes_no_dtype(ctx.policy, ctx.compute_dtype):
            return functools.partial(jax.core.eval_jaxpr, self.jaxpr.jaxpr, self.jaxpr.consts)

        def run(*args: Any) -> list[Any]:
            consts = self.jaxpr.consts
            # under jax.vmap(amp(f)): which vmaps map each constant and argument
            const_maps = [_compat.vmapped_by(x) for x in consts]
            arg_maps = [_compat.vmapped_by(x) for x in args]
            every = frozenset().union(*const_maps, *arg_maps)
            outs = eval_jaxpr(
                self.jaxpr.jaxpr,
                consts,
                args,
                ctx,
                arg_kinds=_unmapped(arg_maps, every),
                const_kinds=_unmapped(const_maps, every),
            )
            return [_restore(x, a) for x, a in zip(outs, self.out_avals)]

        return run

    def rebuild(self, outs: Any) -> Any:
        """The function's output structure around the jaxpr's outputs ``outs`` (its static
        leaves put back in place); the new values of written variables that follow are
        left out."""
        it = iter(outs)
        leaves = [next(it) if s is None else s for s in self.out_static]
        return jax.tree_util.tree_unflatten(self.out_tree, leaves)

    def write_back(self, arguments: Any, outs: Sequence[Any]) -> None:
        """Sets the NNX variables in ``arguments`` (the caller's) that the function wrote to
        the values it wrote, from the jaxpr's outputs ``outs``."""
        if not self.writes:
            return
        held = writes.variables(arguments)
        written = iter(outs[len(outs) - sum(v is None for _, v in self.writes) :])
        for index, static in self.writes:
            writes.set_value(held[index], next(written) if static is None else static)


def _unmapped(mapped_by: Sequence[frozenset], every: frozenset) -> list[int] | None:
    """Kinds for values when ``jax.vmap(amp(f))`` maps some inputs and not others, else None:
    those not mapped by every vmap are UNMAPPED (see
    :mod:`autocast._src.transform.interpreter`), so both
    orders give a bias add the same dtype."""
    if not every:
        return None
    return [UNMAPPED if m != every else RAW for m in mapped_by]


def _restore(x: Any, aval: Any) -> Any:
    """``x`` with the dtype and weak type the original program gave that output."""
    dtype = aval.dtype
    if x.dtype != dtype and is_floating_dtype(x.dtype) and is_floating_dtype(dtype):
        x = cast_value(x, dtype)
    if aval.weak_type and not _compat.aval_of(x).weak_type:
        x = _compat.convert(x, dtype, weak_type=True)
    return x


class _Settings:
    """What an ``amp`` function is besides its function: the compute dtype, the float8
    recipe and the policy. Compared and hashed by value, so two ``amp`` of one module with
    the same settings flatten to equal tree structures (``eqx.filter_jit`` hits its cache)."""

    __slots__ = ("compute_dtype", "fp8_recipe", "policy", "scope_keys", "key")

    def __init__(self, compute_dtype: Any, amp_policy: Any, delayed: Any) -> None:
        policy = default_amp_policy if amp_policy is None else _check_policy(amp_policy)
        # recipe_for's errors name what it accepts
        self.fp8_recipe = delayed or (
            None if compute_dtype is None else fp8.recipe_for(compute_dtype)
        )
        # A float8 compute dtype is a recipe: scaled float8 matrix products, and
        # bfloat16 for everything else.
        if self.fp8_recipe is not None:
            compute_dtype = fp8.CARRIER
            policy = fp8.with_fp8_products(policy, self.fp8_recipe)
        # None: each call's device decides (half_dtype_for the call's target)
        self.compute_dtype = (
            None
            if compute_dtype is None
            else canonicalize_float_dtype(compute_dtype, what="compute_dtype")
        )
        self.policy = policy
        self.scope_keys = frozenset(k for k in policy if isinstance(k, str))
        try:
            policy_key: Any = frozenset(policy.items())
        except TypeError:
            policy_key = object()  # unhashable rules: equal only to itself
        # fixed here: the compute dtype resolved later must not change the hash
        self.key = (self.compute_dtype, self.fp8_recipe, policy_key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Settings) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)


class _Same:
    """A function held in a tree structure, equal only to itself (a callable object may
    define ``==`` without a hash)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.fn is self.fn

    def __hash__(self) -> int:
        return id(self.fn)


def _is_node(fn: Any) -> bool:
    """Whether ``fn`` is a pytree with children of its own (an Equinox or NNX module, an
    Equinox bound method, a ``jax.tree_util.Partial``), not a plain function."""
    return not jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(fn))


def _as_pytree(fn: Any) -> Any:
    """``fn``, or where it is a method bound to a pytree with children (``model.__call__``
    of an Equinox or NNX module is a plain bound method), the same call as a
    ``jax.tree_util.Partial`` whose argument is that pytree, so its leaves are seen."""
    owner = getattr(fn, "__self__", None)
    if inspect.ismethod(fn) and owner is not None and _is_node(owner):
        return jax.tree_util.Partial(fn.__func__, owner)
    return fn


def _call_module(module: Any, *args: Any, **kwargs: Any) -> Any:
    """What ``amp(module)`` traces: the module is an argument, so its array leaves are the
    trace's inputs (their gradients flow) and its structure is part of the trace's key."""
    return module(*args, **kwargs)


class _Amp:
    """The callable ``amp`` returns; one per wrapped function.

    A pytree: where ``fn`` has children (an Equinox or NNX module), they are its children,
    so ``eqx.filter_grad``, ``eqx.tree_at``, ``jax.tree_util`` and checkpointing see the
    module's parameters through it; a plain function has none."""

    def __init__(
        self, fn: Callable[..., Any], compute_dtype: Any, amp_policy: Any, *, delayed: Any = None
    ) -> None:
        """``delayed``: a float8 recipe with delayed scaling (``autocast.amp_fp8_delayed``'s),
        in place of ``compute_dtype``."""
        self._bind(_as_pytree(fn), _Settings(compute_dtype, amp_policy, delayed))
        if fn is not self._fn:  # a bound method: its name and docstring, not Partial's
            functools.update_wrapper(self, fn, updated=())
            self.__wrapped__ = self._fn

    def _bind(self, fn: Callable[..., Any], settings: _Settings) -> None:
        self._fn = fn
        self._settings = settings
        self._node = _is_node(fn)
        # a module's traces are shared by every module (its structure is in their key); a
        # plain function's are its own, as jax.jit's cache is keyed on the function
        self._cache = _shared_cache(_call_module if self._node else fn, settings.key)
        self._traces = self._cache.traces
        # Name and docstring of fn, but not its __dict__: a callable object's attributes
        # would overwrite amp's own (one named _fn, say).
        functools.update_wrapper(self, fn, updated=())

    def __getattr__(self, name: str) -> Any:
        # a wrapped module's fields read through the wrapper (``amp(model).layers``), as
        # ``eqx.tree_at`` and user code reach into a model; only for names amp lacks
        fn = self.__dict__.get("_fn")
        if fn is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(fn, name)

    @property
    def fp8_recipe(self) -> Any:
        return self._settings.fp8_recipe

    @property
    def _policy(self) -> dict:
        return self._settings.policy

    @property
    def _scope_keys(self) -> frozenset:
        return self._settings.scope_keys

    @property
    def _compute_dtype(self) -> Any:
        return self._settings.compute_dtype

    def _tree_flatten_with_keys(self) -> tuple[tuple, tuple]:
        if self._node:
            return ((jax.tree_util.GetAttrKey("__wrapped__"), self._fn),), (self._settings, None)
        return (), (self._settings, _Same(self._fn))

    def _tree_flatten(self) -> tuple[tuple, tuple]:
        if self._node:
            return (self._fn,), (self._settings, None)
        return (), (self._settings, _Same(self._fn))

    @classmethod
    def _tree_unflatten(cls, aux: tuple, children: tuple) -> _Amp:
        settings, same = aux
        new = object.__new__(cls)
        new._bind(same.fn if same is not None else children[0], settings)
        return new

    def _context(self, args: tuple = (), kwargs: dict | None = None) -> Context:
        """The context of a call with ``args`` and ``kwargs``: the device they are placed on
        decides the compute dtype left to amp and whether a float8 recipe runs there
        (:mod:`autocast._src.policy.target`)."""
        target = target_of(self._arguments(args, kwargs or {}))
        recipe = self._settings.fp8_recipe
        if recipe is not None:
            fp8.check_runs_in_float8(recipe, target)
        compute_dtype = self._compute_dtype or half_dtype_for(target)
        refused = emulated_compute_refusal(compute_dtype, target)
        if refused is not None:
            raise ValueError(refused)
        return Context(
            compute_dtype=compute_dtype,
            policy=self._policy,
            scope_keys=self._scope_keys,
            scopes=tuple(s for s in _compat.current_scope_names() if s in self._scope_keys),
        )

    def _keeps_precision(self, scopes: Sequence[str]) -> bool:
        """Whether the outermost of ``scopes`` that the policy names keeps a precision of its
        own rather than the compute dtype (``amp_stop``): entry points there run as called."""
        for name in scopes:
            if name in self._scope_keys:
                return not is_compute_rule(self._policy[name])
        return False

    def _trace(self, in_tree: Any, leaves: list, dynamic: list[int], ctx: Context) -> _Traced:
        """The trace for these leaves (those at ``dynamic`` traced) under ``ctx``, this
        function's :meth:`_context` for the call."""
        specs = [_compat.aval_of(leaves[i]) for i in dynamic]
        dyn = set(dynamic)
        # keyed by type as well as value: 1, 1.0 and True are equal but trace differently
        statics = tuple(
            (
                i,
                type(leaves[i]),
                leaves[i],
                repr(leaves[i]) if isinstance(leaves[i], float) else None,
            )
            for i in range(len(leaves))
            if i not in dyn
        )
        # the caller's scopes and the compute dtype (the call's device may decide it) decide
        # what entry points trace in; JAX's settings what fn traces to (jax_remat3 makes
        # jax.checkpoint another operation)
        key = (
            in_tree,
            tuple(specs),
            statics,
            ctx.scopes,
            ctx.compute_dtype,
            _compat.trace_context(),
        )
        try:
            hit = self._traces.get(key)
        except TypeError:  # an unhashable static leaf: trace every time, as jax.jit would refuse
            key, hit = None, None
        if hit is not None:
            self._traces.move_to_end(key)
            return hit

        out_store: dict[str, Any] = {}

        target = _call_module if self._node else self._fn

        def flat_fn(*dyn: Any) -> list[Any]:
            full = list(leaves)
            for i, x in zip(dynamic, dyn):
                full[i] = x
            args, kwargs = jax.tree_util.tree_unflatten(in_tree, full)
            held = writes.variables((args, kwargs))
            before = [writes.value_of(v) for v in held]
            out = target(*args, **kwargs)
            _check_output(self._fn, out)
            out_leaves, out_store["tree"] = jax.tree_util.tree_flatten(out)
            out_store["static"] = [None if is_array(x) else x for x in out_leaves]
            # the variables the function gave a new value: outputs too (see writes.py)
            after = [writes.value_of(v) for v in held]
            written = [(i, a) for i, (b, a) in enumerate(zip(before, after)) if a is not b]
            out_store["writes"] = [(i, None if is_array(a) else a) for i, a in written]
            return [x for x in out_leaves if is_array(x)] + [a for _, a in written if is_array(a)]

        with _tracing_fn(), entry_points.tracing(ctx.compute_dtype, self._keeps_precision):
            jaxpr = jax.make_jaxpr(flat_fn)(*specs)
        traced = _Traced(jaxpr, out_store["tree"], out_store["static"], out_store["writes"])
        if key is not None and not any(isinstance(c, jax.core.Tracer) for c in jaxpr.consts):
            self._traces[key] = traced
            if len(self._traces) > _TRACE_CACHE_SIZE:
                self._traces.popitem(last=False)
        return traced

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _outer_amp_tracing():
            return self._fn(*args, **kwargs)
        ctx = self._context(args, kwargs)
        traced, args_in = self._traced_call(args, kwargs, ctx)
        if any(isinstance(x, jax.core.Tracer) for x in args_in):
            outs = traced.evaluate(ctx)(*args_in)
        else:
            # Called on concrete values: one compiled program rather than one dispatch per
            # equation, and the same numbers as jax.jit(amp(fn)) gives.
            key = (ctx.compute_dtype, ctx.scopes)  # the policy is fixed per amp function
            compiled = traced.compiled.get(key)
            if compiled is None:
                compiled = traced.compiled[key] = jax.jit(traced.evaluate(ctx))
            outs = compiled(*args_in)
        traced.write_back(self._arguments(args, kwargs), outs)
        return traced.rebuild(outs)

    def _arguments(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The arguments of the traced function: a module's own leaves come first."""
        return ((self._fn, *args) if self._node else args), kwargs

    def _traced_call(self, args: tuple, kwargs: dict, ctx: Context) -> tuple[_Traced, list[Any]]:
        """The trace for these arguments under ``ctx`` (:meth:`_context`), and the values its
        jaxpr takes: the array leaves (a module's first)."""
        leaves, in_tree = jax.tree_util.tree_flatten(self._arguments(args, kwargs))
        arrays = [i for i, x in enumerate(leaves) if _is_dynamic(x)]
        floats = [i for i, x in enumerate(leaves) if type(x) in (float, complex)]
        if not floats or in_tree in self._cache.static_floats:
            return self._trace(in_tree, leaves, arrays, ctx), [leaves[i] for i in arrays]
        dynamic = sorted(arrays + floats)
        try:
            traced = self._trace(in_tree, leaves, dynamic, ctx)
        except Exception:  # noqa: BLE001 - the code needs a float's value: static, as before
            traced = self._trace(in_tree, leaves, arrays, ctx)
            self._cache.static_floats.add(in_tree)
            return traced, [leaves[i] for i in arrays]
        # a traced float enters the program as jax.jit passes it: a weakly typed array
        return traced, [
            _compat.convert(x, jax.dtypes.canonicalize_dtype(type(x)), weak_type=True)
            if i in floats
            else x
            for i, x in ((i, leaves[i]) for i in dynamic)
        ]


jax.tree_util.register_pytree_with_keys(
    _Amp, _Amp._tree_flatten_with_keys, _Amp._tree_unflatten, _Amp._tree_flatten
)


def _check_output(fn: Any, out: Any) -> None:
    leaves = [out] if inspect.isgenerator(out) else jax.tree_util.tree_leaves(out)
    for leaf in leaves:
        if inspect.isgenerator(leaf) or inspect.iscoroutine(leaf):
            name = getattr(fn, "__name__", repr(fn))
            raise TypeError(
                f"amp: {name} returned a {type(leaf).__name__}; an amp function must return "
                "arrays or pytrees of them (evaluate the generator inside the function, e.g. "
                "with list(...) or tuple(...))"
            )


@overload
def amp(fn: F, *, compute_dtype: Any = None, amp_policy: Any = None) -> F: ...
@overload
def amp(*, compute_dtype: Any = None, amp_policy: Any = None) -> Callable[[F], F]: ...


def amp(
    fn: Callable[..., Any] | None = None,
    *,
    compute_dtype: Any = None,
    amp_policy: Mapping[Any, Callable[..., Any]] | None = None,
) -> Any:
    """Runs ``fn`` in mixed precision: matrix work in ``compute_dtype``, delicate parts in float32.

    ``fn`` is traced once per input structure and avals, then each of its equations is
    evaluated under ``amp_policy`` (default :data:`autocast.default_amp_policy`): matrix
    products and convolutions in ``compute_dtype`` (default :func:`autocast.half_dtype`),
    exponentials, logarithms and reductions in float32, cheap elementwise work in whatever
    dtype its inputs arrive in. The result has exactly the structure, shapes and dtypes of
    ``fn``'s, and gradients come back in the dtypes of the inputs. Integer, boolean and
    float64 values are never cast. Works under and around ``jax.jit``, ``jax.grad`` and
    ``jax.vmap``. Usable as ``@amp`` and ``@amp(compute_dtype=...)``.

    The array leaves of the arguments are traced, and so are Python floats, as ``jax.jit``
    traces them: a new learning rate is the same program. Where the code needs a float's
    value (it branches on it, as ``eqx.nn.Dropout(0.0)`` does), ``fn`` is traced again with
    the floats static, as Equinox's ``filter_jit`` keeps them, and for that argument
    structure a new value is then a new trace. Every other leaf is static. Traces are
    shared by every ``amp`` of the same ``fn`` and settings, so re-wrapping ``fn`` on every
    call costs no new trace, as with ``jax.jit``. While an ``amp``
    function is being traced, an ``amp`` function called inside it runs as plain ``fn``: the
    outermost one's settings apply.

    ``fn`` may be a module: ``amp(model)`` of an Equinox or NNX module, or of a method
    bound to one, is a pytree whose children are the module's, so ``eqx.filter_grad``,
    ``eqx.tree_at`` and ``jax.tree_util`` see its parameters through the wrapper. A Flax NNX
    variable the function gives a new value (BatchNorm's statistics) is set on the caller's
    variable after the call, as it would be without ``amp`` (docs/third_party.md).

    A float8 ``compute_dtype`` (``jnp.float8_e4m3fn``, ``"fp8"``, ``jnp.float8_e5m2``) runs
    the matrix products in float8 with per-tensor scaling and everything else in bfloat16
    (:func:`autocast.use_fp8_precision`; docs/fp8.md); ``"fp8_rowwise"`` scales them per
    row and ``"mxfp8"`` per 32 contracted elements (docs/fp8.md, "Finer scales").

    ``amp_policy`` maps ``jax.named_scope`` names and primitives to precision functions; the
    outermost matching scope wins, then the primitive, then the key ``"amp_default"``. A
    policy you pass replaces the default: extend it with ``{**autocast.default_amp_policy,
    ...}``.

    Args:
        fn: The function to run: any callable that takes and returns pytrees of arrays.
            ``None`` (the default) makes ``amp`` return a decorator that applies the given
            keyword arguments, for ``@amp(compute_dtype=...)``.
        compute_dtype: The dtype of matrix products and convolutions: a floating dtype
            (``jnp.bfloat16``, ``jnp.float16``) or a name :func:`autocast.parse_dtype`
            accepts (``"bf16"``), or a float8 recipe: ``"fp8"`` or ``"float8"`` (both
            ``jnp.float8_e4m3fn``), ``"fp8_rowwise"``, ``"mxfp8"``, ``jnp.float8_e4m3fn``,
            ``jnp.float8_e5m2`` or their ``fnuz`` variants. ``None`` (the default) means
            :func:`autocast.half_dtype`, resolved at the first call rather than when ``amp``
            is applied.
        amp_policy: A mapping from named-scope strings and JAX primitives (such as
            ``jax.lax.exp_p``) to precision functions
            ``f(compute_dtype, original_dtypes, *invars, **bind_params)``. ``None`` (the
            default) means :data:`autocast.default_amp_policy`.

    Returns:
        A callable with ``fn``'s name and docstring that takes ``fn``'s arguments and
        returns ``fn``'s result, with the same tree structure, shapes and dtypes. Called
        outside any transformation, it runs one compiled program. With ``fn=None``, a
        decorator that makes such a callable of the function it is applied to.

    Raises:
        TypeError: If ``fn`` is not callable; if ``amp_policy`` is not a mapping, or has a
            key that is neither a string nor a JAX primitive, or a value that is not
            callable; if ``compute_dtype`` is not a floating dtype. With ``fn=None`` these
            checks run when the decorator is applied. When the returned callable is called:
            if ``fn`` returns a generator or a coroutine.
        ValueError: If ``compute_dtype`` is a string that names no floating dtype, or a
            float8 type that has no recipe (``jnp.float8_e3m4``).

    Example:
        >>> import autocast, jax, jax.numpy as jnp
        >>> def layer(w, x):
        ...     return jax.nn.relu(x @ w).sum()
        >>> w, x = jnp.ones((4, 4)), jnp.ones((2, 4))
        >>> autocast.amp(layer, compute_dtype=jnp.bfloat16)(w, x)
        Array(32., dtype=float32)
        >>> jaxpr = jax.make_jaxpr(autocast.amp(layer, compute_dtype=jnp.bfloat16))(w, x)
        >>> [e.outvars[0].aval.dtype for e in jaxpr.eqns if e.primitive.name == "dot_general"]
        [dtype(bfloat16)]
    """
    if fn is None:
        return functools.partial(amp, compute_dtype=compute_dtype, amp_policy=amp_policy)
    if not callable(fn):
        raise TypeError(f"amp expects a callable, got {type(fn).__name__}")
    return _Amp(fn, compute_dtype, amp_policy)


AMP_STOP = "amp_stop"


@overload
def amp_stop(fn: F) -> F: ...
@overload
def amp_stop(fn: None = None) -> contextlib.AbstractContextManager[None]: ...


def amp_stop(fn: Callable[..., Any] | None = None) -> Any:
    """Keeps original precision inside: a context manager, or a decorator.

    It opens the named scope ``"amp_stop"``, which the default policy maps to original
    precision; the policy's other rules do not reach inside. A policy of your own has this
    effect only where it maps ``"amp_stop"`` too, as ``{**autocast.default_amp_policy, ...}``
    does. Outside ``amp`` the scope changes nothing.

    Args:
        fn: A function to run in original precision. ``None`` (the default) makes
            ``amp_stop()`` return a context manager instead.

    Returns:
        With ``fn``, a function with ``fn``'s name and docstring that calls ``fn`` inside
        the scope. Without, a context manager that opens the scope for its ``with`` block.

    Raises:
        TypeError: If ``fn`` is given and is not callable.

    Example:
        >>> import autocast, jax, jax.numpy as jnp
        >>> @autocast.amp_stop
        ... def precise(w, x):
        ...     return x @ w
        >>> def f(w, x):
        ...     with autocast.amp_stop():
        ...         y = x @ w
        ...     return precise(w, y) + x @ w
        >>> g = autocast.amp(f, compute_dtype=jnp.bfloat16)
        >>> jaxpr = jax.make_jaxpr(g)(jnp.ones((2, 2)), jnp.ones((2, 2)))
        >>> [e.outvars[0].aval.dtype.name for e in jaxpr.eqns if e.primitive.name == "dot_general"]
        ['float32', 'float32', 'bfloat16']
    """
    if fn is None:
        return _amp_stop_scope()
    if not callable(fn):
        raise TypeError(f"amp_stop decorates a callable, got {type(fn).__name__}")

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _amp_stop_scope():
            return fn(*args, **kwargs)

    return wrapper


@contextlib.contextmanager
def _amp_stop_scope() -> Iterator[None]:
    with jax.named_scope(AMP_STOP):
        yield
