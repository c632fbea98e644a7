"""Evaluates a jaxpr under a mixed-precision policy, one equation at a time.

Each first-order equation is decided (named scopes, then the primitive, then
``"amp_default"``), its inputs are cast by the chosen precision function and the primitive is
bound again on whatever trace is current, so ``jit``, ``grad`` and ``vmap`` compose with
``amp`` from either side. Equations that carry sub-jaxprs go to their handler in
:mod:`autocast._src.transform.handlers`.

Every value has a kind that says how much its dtype should count:

- ``WEAK``: a literal or a value computed from literals alone (``jnp.zeros``, a mask built
  from ``iota``). It carries no dtype decision of its own: before the policy is consulted it
  takes the dtype of the other values it meets, so ``x * 2.0`` and ``jnp.where(m, x, 0.0)``
  keep a 16-bit activation 16-bit.
- ``SPREAD``: an input broadcast against something larger (a bias, a layer-norm gain), rows
  looked up from an input table (an embedding: the lookup is the one-hot matrix product it
  stands for), or values computed from these and constants alone. It adapts like a WEAK
  value, so ``x @ w + b`` stays 16-bit as PyTorch's linear layer does with its bias, and it
  is data: a residual stream that starts at an embedding is 16-bit from the first block on,
  inside loops and checkpoints too, as a hand-cast model's is (a constant is not data: an
  accumulator that starts at ``jnp.zeros`` keeps its dtype).
- ``RAW``: an input of the function (a parameter, a batch) or a piece of one cut out by pure
  data movement. It keeps its dtype, so a float32 parameter updated by a 16-bit gradient is
  updated in float32.
- ``STRONG``: anything computed.
- ``UNMAPPED``: under ``jax.vmap(amp(f))``, an input the vmap does not map, or a piece of
  one. It is RAW, except where it meets mapped data in an elementwise op: there
  ``amp(jax.vmap(f))`` would see it broadcast over the batch, so it is SPREAD, and both
  orders run a layer in the same dtypes.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any, Callable, Mapping, Sequence

import jax.numpy as jnp
import numpy as np

from autocast import _compat
from autocast._src.policy.casting import cast_memo, cast_value, castable, folded_cast
from autocast._src.policy.precision import (
    CUSTOM_BINDINGS,
    INPUT_PRECISION_EXPONENTS,
    PrecisionFn,
    is_compute_rule,
    use_compute_precision,
    use_full_precision,
    use_input_precision,
    use_original_precision,
    use_own_precision,
    use_precision_by_exponent,
    use_widest_precision,
)
from autocast._src.transform import entry_points, picks, recompute, regions
from autocast._src.tree import is_floating_dtype


class Kind(enum.IntEnum):
    """How much a value's dtype counts (see the module's docstring)."""

    STRONG = 0
    RAW = 1
    WEAK = 2
    SPREAD = 3
    UNMAPPED = 4


STRONG, RAW, WEAK, SPREAD, UNMAPPED = Kind
ADAPTABLE = (WEAK, SPREAD)

# Primitives that only move data: an input cut out by them is still an input. Of these,
# broadcasting and looking rows up make it SPREAD: applied across something larger.
_MOVEMENT = frozenset(
    {
        "reshape",
        "squeeze",
        "expand_dims",
        "transpose",
        "slice",
        "dynamic_slice",
        "gather",
        "convert_element_type",
        "copy",
        "copy_p",
        "rev",
        "concatenate",
        "split",
        "broadcast_in_dim",
        "stack",
        "unstack",
        "tile",
    }
)
_BROADCAST = "broadcast_in_dim"
_SPREAD = frozenset({_BROADCAST, "gather"})


def output_kind(name: str, invals: Sequence[Any], kinds: Sequence[int]) -> int:
    """The kind of an equation's outputs, from its primitive and its inputs' kinds."""
    if STRONG in kinds and name not in _MOVEMENT:
        # Fast path for most of a model; a STRONG input can still be an integer index of a
        # WEAK or RAW float value (a gather), which the slow path below sees.
        if any(k == STRONG and is_floating_dtype(x.dtype) for k, x in zip(kinds, invals)):
            return STRONG
    if all(k == WEAK for k in kinds):
        return WEAK
    float_kinds = [k for k, x in zip(kinds, invals) if is_floating_dtype(x.dtype)]
    if not float_kinds:
        return STRONG
    if all(k == WEAK for k in float_kinds):
        return WEAK
    if all(k in ADAPTABLE for k in float_kinds):
        return SPREAD
    if name in _MOVEMENT and STRONG not in float_kinds:
        if name in _SPREAD:
            return SPREAD
        return UNMAPPED if all(k in (UNMAPPED, WEAK) for k in float_kinds) else RAW
    return STRONG


@dataclasses.dataclass(frozen=True)
class Context:
    """What the interpreter needs to decide and cast: the policy and where we are."""

    compute_dtype: np.dtype
    policy: Mapping[Any, PrecisionFn]
    scope_keys: frozenset[str]
    # Named scopes enclosing the jaxpr being evaluated: the caller's, then those of the
    # higher-order equations we descended through (inner jaxprs record scopes relative to them).
    scopes: tuple[str, ...] = ()
    # Every named scope enclosing the jaxpr being evaluated, policy key or not: kept only
    # while an observer listens (the debugger reports them), so traces are cached as before.
    path: tuple[str, ...] = dataclasses.field(default=(), compare=False)
    # Likewise the source information of the calls and loops enclosing it, innermost last (a
    # library function's equations have no line of the user's; its call has).
    callers: tuple[Any, ...] = dataclasses.field(default=(), compare=False)
    # Told of every first-order decision (the precision report and the numerics debugger
    # listen); None in normal use. It may return the outputs to carry on with in place of
    # those it was shown (the debugger marks them), or None to leave them as they are.
    observer: Callable[..., Any] | None = dataclasses.field(default=None, compare=False)
    # The float8 amax histories a delayed-scaling caller threads through this evaluation
    # (autocast._src.fp8.history), or None. Only equations evaluated in place take them: a
    # loop body, a branch or a re-traced call is cached and bound as one equation, so its
    # products cannot take a history per call (they keep current scaling).
    fp8_history: Any = dataclasses.field(default=None, compare=False)
    # Whether elementwise chains may be recomputed in the backward pass
    # (:mod:`autocast._src.transform.recompute`): not inside a checkpoint, whose policy the
    # user chose and which recomputes its body anyway.
    recompute: bool = True
    # Whether the jaxpr is a loop's body. The checkpoints amp emits (wide regions, recomputed
    # chains) stop XLA from merging their backward recomputation into the forward pass
    # (prevent_cse) except there: a loop's backward runs in a loop of its own, where no such
    # merge can happen, and the barriers would only hinder XLA (jax.checkpoint says so).
    in_loop: bool = False

    def enter(self, eqn: Any, *, in_place: bool = False) -> Context:
        """The context for the sub-jaxprs of ``eqn``. Only scopes the policy names are kept:
        they are all a decision can depend on, and re-traced sub-jaxprs are cached by them.
        ``in_place``: the sub-jaxpr is evaluated here, not re-traced (an inlined call)."""
        names = _compat.scope_names(eqn)
        inner = tuple(s for s in names if s in self.scope_keys)
        ctx = self
        if not self.in_loop and _compat.equation_name(eqn) in _LOOPS:
            ctx = dataclasses.replace(ctx, in_loop=True)
        if self.fp8_history is not None and not in_place:
            ctx = dataclasses.replace(ctx, fp8_history=None)
        if self.observer is not None:
            return dataclasses.replace(
                ctx,
                scopes=self.scopes + inner,
                path=self.path + names,
                callers=self.callers + (eqn.source_info,),
            )
        return dataclasses.replace(ctx, scopes=self.scopes + inner) if inner else ctx

    def observed(self, eqn: Any, rule: PrecisionFn, invars: Sequence[Any], outs: Any) -> Any:
        """``outs`` as the observer, if any, hands them back (it may mark them)."""
        if self.observer is None:
            return outs
        seen = self.observer(eqn, rule, invars, outs, self)
        return outs if seen is None else seen


# Primitives whose sub-jaxprs run as a loop's body (``Scan3``: a scan under ``jax_scan3``).
_LOOPS = frozenset({"scan", "while", "Scan3"})


def decide_by_scope(eqn: Any, ctx: Context) -> PrecisionFn | None:
    """The precision function of the outermost named scope of ``eqn`` in the policy, if any."""
    if ctx.scope_keys:
        for name in ctx.scopes + _compat.scope_names(eqn):
            if name in ctx.scope_keys:
                return ctx.policy[name]
    return None


_MUL = _compat.primitive_by_name("mul")
_SQUARE = _compat.primitive_by_name("square")


def _policy_key(eqn: Any) -> Any:
    """The primitive whose policy entry decides ``eqn``: ``x * x`` is a square, whichever way
    the program spelt it (``jnp.linalg.norm`` writes ``x * x``), and is decided as one. A
    ``checkpoint_name`` mark under ``jax_remat3`` is decided as the mark it is without it."""
    prim = eqn.primitive
    if prim.name == _compat.HIJAX_CALL:
        return _compat.checkpoint_name_primitive(eqn) or prim
    if prim is _MUL and _SQUARE is not None:
        a, b = eqn.invars
        if a is b and not isinstance(a, _compat.Literal):
            return _SQUARE
    return prim


def decide(eqn: Any, ctx: Context) -> PrecisionFn:
    """The precision function for ``eqn``: outermost matching scope, primitive, amp_default."""
    rule = decide_by_scope(eqn, ctx)
    if rule is not None:
        return rule
    rule = ctx.policy.get(_policy_key(eqn))
    if rule is None:
        rule = ctx.policy.get("amp_default", use_original_precision)
    return rule


class Deferred:
    """A broadcast of a WEAK or SPREAD value, not yet emitted: its first use decides its dtype.

    Broadcasting a bias, a layer-norm gain or the ``-1e9`` of a mask and then casting the big
    result would cost a full-size cast; emitting the broadcast only once the dtype it must
    have is known casts the small operand instead (a constant costs nothing at all).
    """

    __slots__ = ("eqn", "operand", "dtype", "_made")
    deferred = True  # how recomputed chains tell one (autocast._src.transform.recompute)

    def __init__(self, eqn: Any, operand: Any) -> None:
        self.eqn = eqn
        self.operand = operand
        self.dtype = operand.dtype
        self._made: dict[Any, Any] = {}

    def materialize(self, dtype: Any = None) -> Any:
        """The broadcast value in ``dtype`` (default: the operand's), emitted once per dtype."""
        dtype = self.dtype if dtype is None else dtype
        made = self._made.get(dtype)
        if made is None:
            with _compat.equation_context(self.eqn):
                operand = self.operand
                if isinstance(operand, Deferred):
                    operand = operand.materialize(dtype)
                else:
                    operand = cast_value(operand, dtype)
                made = self._made[dtype] = _compat.bind_equation(
                    self.eqn, [operand], self.eqn.params
                )
        return made


def _materialized(x: Any) -> Any:
    if isinstance(x, recompute.Link):
        return recompute.settle(x)
    return x.materialize() if isinstance(x, (Deferred, regions.Wide)) else x


def _as_region_input(x: Any, ctx: Context) -> Any:
    """A deferred broadcast becomes a broadcast a region replays on the small operand."""
    if isinstance(x, Deferred):
        return regions.replay(x.eqn, _as_region_input(x.operand, ctx), ctx)
    return x


def _unmoved(var: Any, x: Any, moved: Mapping[Any, tuple]) -> Any:
    """``x``, the value of ``var``, marked with the activation it was reshaped from if it was
    (see :class:`autocast._src.transform.regions.Moved`)."""
    hit = None if isinstance(var, _compat.Literal) else moved.get(var)
    return x if hit is None else regions.Moved(x, *hit)


# Movements whose result is the same buffer in another shape, which a region can replay.
_RESHAPES = frozenset({"reshape", "transpose", "squeeze", "expand_dims"})


def _regions_on(ctx: Context) -> bool:
    return ctx.compute_dtype.itemsize == 2


class _Uses:
    """What the equations of a jaxpr do with its variables, found on the first question (most
    jaxprs never ask): which ones elementwise float32 rules consume (the shift before a
    softmax's ``exp``), and which ones only matrix products consume, directly or through data
    movement (a parameter gathered from its shards, an input marked as varying over devices)."""

    __slots__ = ("_jaxpr", "_ctx", "_float32", "_compute", "_summed", "_chain_readers")

    def __init__(self, jaxpr: Any, ctx: Context) -> None:
        self._jaxpr, self._ctx, self._float32, self._compute = jaxpr, ctx, None, None
        self._summed = self._chain_readers = None

    def chain_readers(self, var: Any) -> int:
        """How many equations that a recomputed chain may hold read ``var``, directly or
        through broadcasts (a chain reads a deferred broadcast's operand: a layer norm's
        two ``x - mean`` broadcast the mean twice)."""
        if self._chain_readers is None:
            counts: dict[Any, int] = {}
            for eqn in self._jaxpr.eqns:
                if eqn.primitive.name in _CHAIN_READERS:
                    for v in eqn.invars:
                        if not isinstance(v, _compat.Literal):
                            counts[v] = counts.get(v, 0) + 1
            for eqn in reversed(self._jaxpr.eqns):  # a broadcast's readers, then its operand's
                if eqn.primitive.name == _BROADCAST and eqn.invars:
                    v = eqn.invars[0]
                    if not isinstance(v, _compat.Literal):
                        counts[v] = counts.get(v, 0) + counts.get(eqn.outvars[0], 0)
            self._chain_readers = counts
        return 0 if isinstance(var, _compat.Literal) else self._chain_readers.get(var, 0)

    def feeds_float32(self, var: Any) -> bool:
        if self._float32 is None:
            found = {
                v
                for eqn in self._jaxpr.eqns
                if eqn.primitive.name in regions.ELEMENTWISE
                and regions.widening(eqn, decide(eqn, self._ctx))
                for v in eqn.invars
                if not isinstance(v, _compat.Literal)
            }
            self._float32 = frozenset(found | self._normalised() | self.summed_products())
        return var in self._float32

    def summed_products(self) -> frozenset:
        if self._summed is None:
            self._summed = frozenset(self._find_summed_products())
        return self._summed

    def _find_summed_products(self) -> set:
        """Products of two activations that only float32 sums consume, directly or through
        reshapes and casts that keep float32 (the dot product of a cosine similarity): they
        join the sum's region and are computed in float32, where a 16-bit product
        overflows float16 (320 * 480) and XLA fuses it into the sum."""
        outputs = {v for v in self._jaxpr.outvars if not isinstance(v, _compat.Literal)}

        def sums(eqn: Any, passes_on: Callable[[Any], bool]) -> bool:
            if eqn.primitive.name == "reduce_sum":
                return True
            passes = eqn.primitive.name in _SUM_PASSES and eqn.outvars[0].aval.dtype == np.float32
            return passes and passes_on(eqn)

        summed = _every_reader(
            self._jaxpr.eqns, outputs, sums
        )  # var -> whether every reader sums it
        found = set()
        for eqn in self._jaxpr.eqns:
            if eqn.primitive.name != "mul" or any(
                isinstance(v, _compat.Literal) for v in eqn.invars
            ):
                continue
            out = eqn.outvars[0]
            if all(v.aval.shape == out.aval.shape for v in eqn.invars) and out not in outputs:
                if summed.get(out, False):
                    found.add(out)
        return found

    def _normalised(self) -> set:
        """Variables scaled by a statistic the program computed (``* rsqrt(var + eps)`` of
        given running statistics, an eval-mode batch norm): the shift before it belongs in
        float32 with the scaling, as it does when the statistics are computed in the step.
        A statistic is a computed value broadcast against something larger; a parameter
        broadcast the same way (a layer norm's gain) is not one."""
        source: dict[Any, Any] = {}
        computed: set = set()
        for eqn in self._jaxpr.eqns:
            if eqn.primitive.name in _STATISTIC_MOVES and not isinstance(
                eqn.invars[0], _compat.Literal
            ):
                source[eqn.outvars[0]] = source.get(eqn.invars[0], eqn.invars[0])
            computed.update(eqn.outvars)
        found = set()
        for eqn in self._jaxpr.eqns:
            if eqn.primitive.name not in ("mul", "div") or len(eqn.invars) != 2:
                continue
            size = math.prod(eqn.outvars[0].aval.shape)
            for this, other in (eqn.invars, eqn.invars[::-1]):
                if isinstance(other, _compat.Literal) or isinstance(this, _compat.Literal):
                    continue
                origin = source.get(other, other)
                if origin in computed and math.prod(origin.aval.shape) < size:
                    found.add(this)
        return found

    def feeds_only_compute(self, var: Any) -> bool:
        if self._compute is None:
            self._compute = self._only_compute()
        return var in self._compute

    def _only_compute(self) -> frozenset:
        # Backwards over the equations, so a movement's outputs are judged before its input.
        outputs = {v for v in self._jaxpr.outvars if not isinstance(v, _compat.Literal)}

        def computes(eqn: Any, passes_on: Callable[[Any], bool]) -> bool:
            if is_compute_rule(decide(eqn, self._ctx)):
                # a matrix product; a jit or loop in a compute-precision scope may pass the
                # value on unchanged, so it is not one
                return not _compat.sub_jaxpr_params(eqn.params)
            name = eqn.primitive.name
            return name in _MOVEMENT and name != "convert_element_type" and passes_on(eqn)

        verdict = _every_reader(self._jaxpr.eqns, outputs, computes)
        return frozenset(v for v, ok in verdict.items() if ok and v not in outputs)


# Movements through which a product reaches the sum that consumes it.
_SUM_PASSES = frozenset({"convert_element_type", "reshape", "squeeze", "expand_dims", "transpose"})
# Movements through which a statistic reaches the activation it scales.
_STATISTIC_MOVES = frozenset(
    {"broadcast_in_dim", "reshape", "expand_dims", "squeeze", "convert_element_type"}
)


def adapt_weak(invals: list[Any], kinds: Sequence[int], original: Sequence[Any]) -> list[Any]:
    """Casts WEAK and SPREAD floating inputs to the widest dtype of the other floating inputs."""
    others = {
        x.dtype for x, k, o in zip(invals, kinds, original) if k not in ADAPTABLE and castable(x, o)
    }
    if not others:
        return [_materialized(x) for x in invals]
    target = next(iter(others)) if len(others) == 1 else jnp.result_type(*others)
    adapted = []
    for x, k, o in zip(invals, kinds, original):
        if k in ADAPTABLE and castable(x, o) and x.dtype != target:
            x = x.materialize(target) if isinstance(x, Deferred) else cast_value(x, target)
        adapted.append(_materialized(x))
    return adapted


def _checked_rule_output(rule: PrecisionFn, eqn: Any, result: Any, n_in: int) -> tuple:
    if type(result) is tuple and len(result) == 2:
        invars, params = result
        if len(invars) == n_in and type(params) is dict:
            return invars, params
    name = getattr(rule, "__name__", repr(rule))
    if not (isinstance(result, tuple) and len(result) == 2):
        raise TypeError(
            f"precision function {name} must return (invars, bind_params) for primitive "
            f"'{eqn.primitive.name}', got {type(result).__name__}"
        )
    invars, params = result
    if len(invars) != n_in:
        raise ValueError(
            f"precision function {name} returned {len(invars)} inputs for primitive "
            f"'{eqn.primitive.name}', which takes {n_in}"
        )
    if not isinstance(params, Mapping):
        raise TypeError(
            f"precision function {name} returned bind_params of type {type(params).__name__} "
            f"for primitive '{eqn.primitive.name}'; expected a dict"
        )
    return invars, dict(params)


# Elementwise primitives that broadcast a size-1 axis of an operand by themselves: Flax's
# Dense adds its bias as ``y + bias.reshape(1, n)``, with no broadcast_in_dim in the jaxpr.
_IMPLICIT_BROADCAST = frozenset(
    {
        "add",
        "sub",
        "mul",
        "div",
        "max",
        "min",
        "rem",
        "pow",
        "atan2",
        "select_n",
        "clamp",
        "eq",
        "ne",
        "lt",
        "le",
        "gt",
        "ge",
        "add_any",
    }
)


def _implicitly_spread(eqn: Any, kinds: Sequence[int]) -> Sequence[int]:
    """``kinds`` with each input that ``eqn`` broadcasts implicitly marked SPREAD, as an
    explicit ``broadcast_in_dim`` of it would be."""
    shape = eqn.outvars[0].aval.shape
    spread = list(kinds)
    for i, (k, v) in enumerate(zip(kinds, eqn.invars)):
        s = getattr(v.aval, "shape", shape)
        if (
            k == RAW
            and s != shape
            and len(s) == len(shape)
            and all(a in (1, b) for a, b in zip(s, shape))
        ):
            spread[i] = SPREAD
    return spread


# Primitives whose batching rule broadcasts an unmapped operand against mapped ones.
_BROADCASTS_UNMAPPED = _IMPLICIT_BROADCAST | {"concatenate"}


def _unmapped_as(eqn: Any, invals: Sequence[Any], kinds: Sequence[int]) -> list[int]:
    """``kinds`` with UNMAPPED inputs SPREAD where they meet mapped data (STRONG or RAW
    floating values) in a primitive that would broadcast them, RAW elsewhere."""
    meets = eqn.primitive.name in _BROADCASTS_UNMAPPED and any(
        k in (STRONG, RAW) and is_floating_dtype(x.dtype) for k, x in zip(kinds, invals)
    )
    return [(SPREAD if meets else RAW) if k == UNMAPPED else k for k in kinds]


# Rules that compute from the program's own dtypes (float32, or as recorded): a constant or a
# broadcast parameter meeting a 16-bit activation there is not narrowed first, or the
# exponent of ``x ** p`` would lose its bits on the way to a float32 pow.
_WIDE_RULES = frozenset({use_full_precision, use_original_precision})


# Collectives that move values without adding them: casting before or after them gives the
# same numbers. (A psum is not one: summing 16-bit values rounds at each addition and can
# overflow float16 where the float32 sum would not.)
_EXACT_COLLECTIVES = frozenset(
    {
        "all_gather",
        "all_gather_invariant",
        "ppermute",
        "all_to_all",
        "pmax",
        "pmin",
        "pvary",
        "pbroadcast",
    }
)


def _cast_ahead(
    eqn: Any, invals: list[Any], kinds: Sequence[int], ctx: Context, uses: _Uses | None
) -> list[Any]:
    """A collective's float32 activations in the compute dtype when only matrix products
    consume its outputs, which would cast them on arrival: half the traffic for the same
    forward numbers, and the backward's collective (the psum ``pvary`` turns into) travels
    in 16 bits too, as a tensor-parallel layer's does in Megatron-LM. Only computed values
    (STRONG): a parameter's transpose would be its gradient's reduction, which stays in the
    parameter's dtype."""
    if uses is None or not all(uses.feeds_only_compute(v) for v in eqn.outvars):
        return invals
    return [
        cast_value(x, ctx.compute_dtype)
        if k == STRONG and castable(x, o) and x.dtype.itemsize > ctx.compute_dtype.itemsize
        else x
        for x, k, o in zip(invals, kinds, (v.aval.dtype for v in eqn.invars))
    ]


def _restores_entry_output(eqn: Any) -> bool:
    """Whether ``eqn`` is the cast that restores an entry point's result to the dtype the
    program had (:mod:`autocast._src.transform.entry_points`)."""
    return entry_points.RESTORE_SCOPE in _compat.scope_names(eqn)


def apply_first_order(
    eqn: Any,
    invals: list[Any],
    kinds: Sequence[int],
    ctx: Context,
    uses: _Uses | None = None,
    moved: Mapping[Any, tuple] | None = None,
) -> Any:
    """Decides, casts and binds one first-order equation (or gathers it into a wide region,
    see :mod:`autocast._src.transform.regions`). ``uses`` says how later equations use its
    outputs; ``moved``
    maps a variable holding a reshaped activation to ``(reshape equation, activation)``."""
    if eqn.primitive.name == "convert_element_type" and _restores_entry_output(eqn):
        # an entry point's result cast back for the trace's sake: it flows on as it came
        return _materialized(invals[0])
    original = [v.aval.dtype for v in eqn.invars]
    if UNMAPPED in kinds:
        kinds = _unmapped_as(eqn, invals, kinds)
    if RAW in kinds and eqn.primitive.name in _IMPLICIT_BROADCAST:
        kinds = _implicitly_spread(eqn, kinds)
    rule = decide(eqn, ctx)
    if _regions_on(ctx):
        gatherable = regions.may_gather(eqn, rule)
        wide_in = any(isinstance(x, regions.Wide) for x in invals)
        if gatherable or wide_in:
            data = [k in (STRONG, RAW) for k in kinds]
            if (
                eqn.primitive.name == "mul"
                and uses is not None
                and eqn.outvars[0] in uses.summed_products()
            ):
                # two activations multiplied for a sum are data whatever their kind (arrays
                # made by jnp.full(shape, 20.) are weakly typed)
                data = [not regions._is_constant(x) for x in invals]
            if gatherable:
                nodes = [_as_region_input(x, ctx) for x in invals]
                out = regions.gather(
                    eqn,
                    nodes,
                    data,
                    rule,
                    ctx,
                    feeds_wide=lambda: uses is not None and uses.feeds_float32(eqn.outvars[0]),
                    starts=(lambda: [_unmoved(v, x, moved) for v, x in zip(eqn.invars, nodes)])
                    if moved
                    else None,
                )
                if out is not None:
                    return out
            if wide_in:
                # meeting a float32 stream, a region's value leaves it in float32
                stream32, _ = regions.float32_inputs(eqn, invals, data)
                invals = [regions.settle(x, np.float32 if stream32 else None) for x in invals]
    if WEAK in kinds or SPREAD in kinds:
        if rule in _WIDE_RULES:
            invals = [_materialized(x) for x in invals]
        else:
            invals = adapt_weak(invals, kinds, original)
    if rule is use_own_precision and eqn.primitive.name in _EXACT_COLLECTIVES and _regions_on(ctx):
        invals = _cast_ahead(eqn, invals, kinds, ctx, uses)
    invars, params = _checked_rule_output(
        rule, eqn, rule(ctx.compute_dtype, original, *invals, **eqn.params), len(invals)
    )
    if eqn.primitive.name == "convert_element_type" and isinstance(invars[0], np.generic):
        # A cast of a constant is folded on the host, so it costs no equation.
        return folded_cast(invars[0], params["new_dtype"])
    params = _compat.retype_scalar_computation(eqn, invars, params)
    custom = CUSTOM_BINDINGS.get(rule)
    if custom is not None:
        outs = custom(eqn, invars, params, ctx, tuple(k in (RAW, UNMAPPED) for k in kinds))
    elif _regions_on(ctx):
        outs = picks.bind_equation(eqn, invars, params)
    else:
        outs = _compat.bind_equation(eqn, invars, params)
    return ctx.observed(eqn, rule, invars, outs)


# The rules under which an elementwise equation computes in the dtype of the activation it
# meets, so that it may be a link of a recomputed chain; a cube is one (the tanh-GELU's).
_LINK_RULES = frozenset({use_input_precision, use_widest_precision})
# The result dtypes a link may have: float32 work amp narrows, or the program's own 16-bit.
_LINK_RESULTS = regions.SIXTEEN_BIT | {np.dtype(np.float32)}
# Equations a chain may hold (the elementwise ones and activation functions, which have a
# handler of their own): their readers are counted to break the ties of recompute._worth_it.
_CHAIN_READERS = recompute.LINKS | recompute.ACTIVATION_CALLS


def _read_var(x: Any, var: Any) -> Any:
    """The variable a chain reads for ``var``, whose value is ``x``: a deferred broadcast's
    operand (recompute keeps the operand), else ``var``."""
    while isinstance(x, Deferred) and not isinstance(var, _compat.Literal):
        x, var = x.operand, x.eqn.invars[0]
    return var


# Matrix products a chain is recomputed into (their operands are what they keep).
_PRODUCTS = frozenset({"dot_general", "conv_general_dilated"})


def _chains_on(ctx: Context) -> bool:
    return _regions_on(ctx) and ctx.recompute and ctx.observer is None


def _link_dtype(
    eqn: Any, invals: Sequence[Any], kinds: Sequence[int], ctx: Context, uses: _Uses
) -> Any:
    """The 16-bit dtype ``eqn`` would compute in, where it may be a link of a recomputed
    chain (:mod:`autocast._src.transform.recompute`); None where it runs as usual.

    A link is an elementwise equation (or a reshape) that :func:`apply_first_order` would
    bind in the 16-bit dtype of a full-size activation, which another link gives, which amp
    narrowed from the program's float32 or which the program computes in 16 bits: its rule
    keeps the input dtype, every other floating input adapts to it (a bias, a scale, a
    literal), and it does not go into a wide region (no float32 rule, no float32 input, no
    ``1/x``, nothing float32 after it). The program's own 16-bit work keeps its dtype.
    """
    name = eqn.primitive.name
    if name not in recompute.LINKS or eqn.primitive.multiple_results:
        return None
    out_dtype = eqn.outvars[0].aval.dtype
    if out_dtype not in _LINK_RESULTS:
        return None
    own = out_dtype in regions.SIXTEEN_BIT  # the program's own 16-bit work, as written
    rule = decide(eqn, ctx)
    if rule is use_precision_by_exponent:
        if eqn.params["y"] < 0 or not (own or eqn.params["y"] in INPUT_PRECISION_EXPONENTS):
            return None  # a square of amp's narrowed work goes to float32; the program's stays
    elif rule not in _LINK_RULES:
        return None
    if UNMAPPED in kinds:
        kinds = _unmapped_as(eqn, invals, kinds)
    if RAW in kinds and name in _IMPLICIT_BROADCAST:
        kinds = _implicitly_spread(eqn, kinds)
    size = math.prod(eqn.outvars[0].aval.shape)
    found = None
    full = False  # some input is the activation: as large as the result
    for x, k, var in zip(invals, kinds, eqn.invars):
        if isinstance(x, regions.Wide):
            return None
        if isinstance(x, recompute.Link):
            dtype, full = x.dtype, full or math.prod(x.shape) == size
        elif k in ADAPTABLE or isinstance(x, Deferred):
            continue
        elif not is_floating_dtype(getattr(x, "dtype", np.int32)):
            continue  # a predicate, an index
        elif regions.sixteen_bit(x, var):
            dtype = np.dtype(x.dtype)
            full = full or math.prod(np.shape(x)) == size
        else:
            return None  # a float32 input: the equation widens, or joins a region
        if found is not None and dtype != found:
            return None
        found = dtype
    if found is None or not full or out_dtype not in (np.float32, found):
        return None  # no activation, or the program's own 16-bit work in another dtype
    divisor = invals[1] if name == "div" else None
    if divisor is not None and math.prod(getattr(divisor, "shape", np.shape(divisor))) == size:
        return None  # 1/x of an activation: a wide region's
    if not own and uses.feeds_float32(eqn.outvars[0]):
        return None  # the shift before a softmax's exp: a wide region's (16-bit work is no
        # region's: a layer norm written in bfloat16 shifts and squares in chains)
    return found


def _elementwise_body(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` is elementwise work a chain may hold, on its one input and literals
    (plain ``jax.jit`` calls looked into): a relu's ``max(x, 0)``."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _compat.JIT_NAMES and _compat.is_plain_jit(eqn):
            if not _elementwise_body(eqn.params["jaxpr"].jaxpr):
                return False
        elif eqn.primitive.name not in recompute.ELEMENTWISE or eqn.primitive.multiple_results:
            return False
    return len(jaxpr.invars) == 1 and not jaxpr.constvars


def _activation_link_dtype(eqn: Any, invals: Sequence[Any], ctx: Context, uses: _Uses) -> Any:
    """The 16-bit dtype an activation function with a derivative rule of its own
    (``jax.nn.relu``, a ``custom_jvp`` whose body is elementwise work on one input) computes
    in, where it may be a link of a recomputed chain: its input is a full-size 16-bit
    activation (amp narrowed it, the program computes it in 16 bits, a link gives it, or a
    wide region's does) and nothing after it computes in float32 from it. None where it
    runs as usual: its handler binds it."""
    if eqn.primitive.name not in recompute.ACTIVATION_CALLS or len(eqn.outvars) != 1:
        return None
    out_dtype = eqn.outvars[0].aval.dtype
    if len(invals) != 1 or out_dtype not in _LINK_RESULTS:
        return None
    if decide_by_scope(eqn, ctx) is not None or uses.feeds_float32(eqn.outvars[0]):
        return None
    if not _elementwise_body(_compat.custom_call_jaxpr(eqn).jaxpr):
        return None
    (x,) = invals
    shape = tuple(eqn.outvars[0].aval.shape)
    if isinstance(x, regions.Wide):
        full = x.full and tuple(x.shape) == shape
        dtype = np.dtype(x.narrow_dtype) if full else None
    elif isinstance(x, recompute.Link):
        dtype = x.dtype if x.shape == shape else None
    elif regions.sixteen_bit(x, eqn.invars[0]) and tuple(np.shape(x)) == shape:
        dtype = np.dtype(x.dtype)
    else:
        dtype = None
    if dtype is None or dtype.itemsize != 2 or out_dtype not in (np.float32, dtype):
        return None
    return dtype


def _recomputed_product(eqn: Any, invals: Sequence[Any], ctx: Context) -> bool:
    """Whether ``eqn`` is a matrix product in the compute dtype with a link or a wide
    region's value among its operands, which is recomputed together with the chains (and
    the region) feeding it. Not a float8
    product: it keeps its float8 operands anyway, and recomputing it would quantise again
    in the backward pass (one more amax pass over the activation); its chains are
    recomputed on their own."""
    return (
        eqn.primitive.name in _PRODUCTS
        and decide(eqn, ctx) is use_compute_precision
        and any(isinstance(x, (recompute.Link, regions.Wide)) for x in invals)
    )


def _views_of_inputs(jaxpr: Any) -> set:
    """The arguments and constants of ``jaxpr``, and the values only data movement made of
    them (a transposed kernel): XLA keeps the argument for the backward pass, not a copy."""
    views = {*jaxpr.constvars, *jaxpr.invars}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in recompute.MOVEMENT and all(
            isinstance(v, _compat.Literal) or v in views for v in eqn.invars
        ):
            views.update(eqn.outvars)
    return views


def _narrowed_operands(eqn: Any, invals: list, ctx: Context, inputs: set) -> list:
    """The operands of a product recomputed with its chains, each float32 one the program
    computed (a scaled weight, a float32 activation) cast to the compute dtype before the
    checkpoint rather than inside it: the checkpoint keeps its inputs, and the 16-bit cast
    is half the float32 value's bytes. An argument or constant, or a transpose or reshape
    of one, enters as it is (``inputs``: the compiled program keeps the argument, so a cast
    would be a copy; a GPT's tied output head transposes its embedding), and so does a
    value another checkpoint already keeps, and a broadcast not yet emitted (its first use
    casts the small operand). The product casts its operands to the compute dtype anyway,
    so the values are the same bits."""
    return [
        cast_value(x, ctx.compute_dtype)
        if not isinstance(var, _compat.Literal)
        and var not in inputs
        and not isinstance(x, (recompute.Link, regions.Wide, Deferred))
        and np.dtype(getattr(x, "dtype", np.bool_)) == np.float32
        and not recompute.kept_anyway(x)
        else x
        for var, x in zip(eqn.invars, invals)
    ]


def _every_reader(
    eqns: Sequence[Any], outputs: set, accepts: Callable[[Any, Callable[[Any], bool]], bool]
) -> dict[Any, bool]:
    """``{var: whether every equation reading it is accepted}``, judged backwards over
    ``eqns`` so that an equation's outputs are judged before its inputs. ``accepts(eqn,
    passes_on)`` decides an equation; ``passes_on(eqn)`` says whether every reader of its
    outputs was accepted and none is a program output (for equations that pass values on)."""
    verdict: dict[Any, bool] = {}

    def passes_on(eqn: Any) -> bool:
        return all(verdict.get(v, False) and v not in outputs for v in eqn.outvars)

    for eqn in reversed(eqns):
        ok = accepts(eqn, passes_on)
        for v in eqn.invars:
            if not isinstance(v, _compat.Literal):
                verdict[v] = verdict.get(v, True) and ok
    return verdict


def eval_jaxpr(
    jaxpr: Any,
    consts: Sequence[Any],
    args: Sequence[Any],
    ctx: Context,
    arg_kinds: Sequence[int] | None = None,
    const_kinds: Sequence[int] | None = None,
) -> list[Any]:
    """Evaluates an open ``jaxpr`` on ``args`` under ``ctx``; returns the output values.

    ``arg_kinds`` and ``const_kinds`` give the kind of each argument and constant (default:
    all RAW, the function's inputs).
    """
    with cast_memo(), regions.traced_regions(), recompute.pending_links():
        outs, _ = _eval_jaxpr(jaxpr, consts, args, ctx, arg_kinds, const_kinds)
        return [_materialized(x) for x in outs]


Handler = Callable[[Any, list, Sequence[int], Context], Sequence[Any]]

# The handler of each higher-order primitive, by name, and of the two roles no name selects:
# binding an equation exactly as recorded ("original precision": amp_stop, linear solves)
# and another library's primitive ("foreign"). Filled by autocast._src.transform.handlers,
# beside the handlers' definitions, so this module imports none of them: adding support for
# a primitive is one function and one table entry there.
HANDLERS: dict[str, Handler] = {}
ROLES: dict[str, Handler] = {}

# Kernels are written for fixed dtypes: they are first-order equations for amp, decided by
# the policy like any other primitive (the default table keeps them in original precision),
# so their inner jaxpr is never re-typed and the report lists them.
KERNELS = frozenset({"pallas_call"})

# JAX's own primitives seen to carry no sub-jaxprs: decided once per primitive. Another
# library's primitive can carry a jaxpr in one call and none in the next (lineax's
# linear_solve with a matrix, then with a function operator): it is looked at every time.
_FIRST_ORDER: set[Any] = set()


def handler_for(eqn: Any, ctx: Context) -> Handler | None:
    """The handler of a higher-order equation, None for a first-order one.

    Raises ``NotImplementedError`` for one of JAX's own primitives that carries sub-jaxprs
    but has no handler, unless a named scope puts the equation in original precision
    (``amp_stop``).
    """
    prim = eqn.primitive
    hijax = _compat.hijax_name(eqn)
    if hijax is not None:
        return _hijax_handler(eqn, hijax, ctx)
    if prim in _FIRST_ORDER:
        return None
    name = prim.name
    handler = HANDLERS.get(name)
    if handler is not None:
        return handler
    if name in KERNELS or name in _compat.FIRST_ORDER_WITH_JAXPRS:
        return None
    carried = _compat.sub_jaxpr_params(eqn.params)
    own = _compat.primitive_by_name(name) is prim
    if not carried:
        if own:
            _FIRST_ORDER.add(prim)
        return None
    if decide_by_scope(eqn, ctx) is use_original_precision:
        return ROLES["original precision"]
    if not own:
        return ROLES["foreign"]
    raise unsupported(eqn)


def _hijax_handler(eqn: Any, hijax: str, ctx: Context) -> Handler | None:
    """The handler of a hijax equation (one primitive binds them all, so they are told apart
    by their operation's class, never cached as first-order): its own, None for a
    first-order operation (the policy decides it as ``call_hi_primitive``, or a mark as the
    primitive it marks), an error for one that carries jaxprs and has no handler."""
    handler = HANDLERS.get(hijax)
    if handler is not None:
        return handler
    if not _compat.hijax_jaxprs(eqn):
        return None
    if decide_by_scope(eqn, ctx) is use_original_precision:
        return ROLES["original precision"]
    raise unsupported(eqn)


def unsupported(eqn: Any) -> NotImplementedError:
    """The error for a higher-order equation amp cannot interpret."""
    hijax = _compat.hijax_name(eqn)
    if hijax is not None:
        return NotImplementedError(
            f"amp does not support the hijax operation {hijax} (a '{eqn.primitive.name}' "
            f"equation that carries jaxprs); supported: {', '.join(sorted(HANDLERS))}. Wrap "
            "the call in autocast.amp_stop() to run it untouched in original precision (or "
            "turn off the jax_*3 option that made it, if one did)."
        )
    carried = _compat.sub_jaxpr_params(eqn.params)
    return NotImplementedError(
        f"amp does not support the higher-order primitive '{eqn.primitive.name}' (it carries "
        f"the sub-jaxpr parameter(s) {', '.join(carried)}); supported: "
        f"{', '.join(sorted(HANDLERS))}, and other libraries' primitives that keep closed "
        "jaxprs in their parameters. Wrap the call in autocast.amp_stop() to run it untouched "
        "in original precision."
    )


def _inlined(eqn: Any, ctx: Context) -> bool:
    """Whether to evaluate a ``jax.jit`` call in place. With 16-bit compute, a plain one is:
    a layer norm's ``jnp.var``, an embedding's ``jnp.take`` or a ``jax.nn`` activation then
    joins the wide regions and value kinds around it, as if it had not been jitted (XLA
    inlines such calls anyway)."""
    return (
        eqn.primitive.name in _compat.JIT_NAMES and _regions_on(ctx) and _compat.is_plain_jit(eqn)
    )


def _eval_jaxpr(
    jaxpr: Any,
    consts: Sequence[Any],
    args: Sequence[Any],
    ctx: Context,
    arg_kinds: Sequence[int] | None,
    const_kinds: Sequence[int] | None = None,
) -> tuple[list[Any], list[int]]:
    """The outputs of ``jaxpr`` (deferred and wide values not yet emitted) and their kinds."""
    env: dict[Any, Any] = {}
    kind_of: dict[Any, int] = {}
    uses = _Uses(jaxpr, ctx)
    moved: dict[Any, tuple] = {}
    chains = _chains_on(ctx)

    def bind(eqn: Any, invals: list, kinds: Sequence[int]) -> Any:
        return apply_first_order(eqn, invals, kinds, ctx, uses, moved)

    inputs = _views_of_inputs(jaxpr)
    for i, (var, value) in enumerate(zip(jaxpr.constvars, consts)):
        env[var] = value
        kind_of[var] = RAW if const_kinds is None else const_kinds[i]
    for i, (var, value) in enumerate(zip(jaxpr.invars, args)):
        env[var] = value
        kind_of[var] = WEAK if var.aval.weak_type else (RAW if arg_kinds is None else arg_kinds[i])

    for eqn in jaxpr.eqns:
        invals = []
        kinds = []
        for var in eqn.invars:
            if isinstance(var, _compat.Literal):
                invals.append(_compat.literal_value(var))
                kinds.append(WEAK)
            else:
                invals.append(env[var])
                kinds.append(kind_of[var])
        if _inlined(eqn, ctx):
            inner = eqn.params["jaxpr"]
            outs, out_kinds = _eval_jaxpr(
                inner.jaxpr, inner.consts, invals, ctx.enter(eqn, in_place=True), kinds
            )
            for var, value, k in zip(eqn.outvars, outs, out_kinds):
                if not _compat.is_drop_var(var):
                    env[var], kind_of[var] = value, k
            continue
        kind = output_kind(eqn.primitive.name, invals, kinds)
        handler = handler_for(eqn, ctx)
        if (
            handler is None
            and kind in ADAPTABLE
            and eqn.primitive.name == _BROADCAST
            and not isinstance(invals[0], regions.Wide)
        ):
            if decide(eqn, ctx) is use_input_precision:
                env[eqn.outvars[0]] = Deferred(eqn, invals[0])
                kind_of[eqn.outvars[0]] = kind
                continue
        if chains and eqn.primitive.name in _CHAIN_READERS:
            # every equation a chain may hold, whatever binds it (chain_readers counts them)
            counts = [uses.chain_readers(_read_var(x, v)) for x, v in zip(invals, eqn.invars)]
            recompute.reading(invals, counts)
        if chains and handler is not None:
            dtype = _activation_link_dtype(eqn, invals, ctx, uses)
            if dtype is not None:
                invals = [recompute.region_link(x) for x in invals]
                env[eqn.outvars[0]] = recompute.Link(
                    eqn,
                    invals,
                    kinds,
                    dtype,
                    lambda e, xs, ks, h=handler: h(e, [_materialized(x) for x in xs], ks, ctx)[0],
                    prevent_cse=not ctx.in_loop,
                )
                kind_of[eqn.outvars[0]] = kind
                continue
        if chains and handler is None:
            dtype = _link_dtype(eqn, invals, kinds, ctx, uses)
            if dtype is not None:
                env[eqn.outvars[0]] = recompute.Link(
                    eqn, invals, kinds, dtype, bind, prevent_cse=not ctx.in_loop
                )
                kind_of[eqn.outvars[0]] = kind
                continue
        if chains and handler is None and _recomputed_product(eqn, invals, ctx):
            # a region's value enters the product as apply_first_order would settle it, as
            # the first link of a chain recomputed with the product where it is an activation
            stream32, _ = regions.float32_inputs(eqn, invals, [k in (STRONG, RAW) for k in kinds])
            invals = [recompute.region_link(x, np.float32 if stream32 else None) for x in invals]
            if any(isinstance(x, recompute.Link) for x in invals):
                invals = _narrowed_operands(eqn, invals, ctx, inputs)
                with _compat.equation_context(eqn):
                    out = recompute.into_product(
                        eqn, invals, lambda xs, e=eqn, k=kinds: bind(e, xs, k), kinds
                    )
                env[eqn.outvars[0]], kind_of[eqn.outvars[0]] = out, kind
                continue
        if chains and any(isinstance(x, recompute.Link) for x in invals):
            invals = [recompute.settle(x) for x in invals]
        with _compat.equation_context(eqn):
            if handler is None:
                outs = apply_first_order(eqn, invals, kinds, ctx, uses, moved)
                if eqn.primitive.name in _RESHAPES and regions.narrowed(invals[0], eqn.invars[0]):
                    moved[eqn.outvars[0]] = (eqn, invals[0])
            else:
                outs = handler(eqn, [_materialized(x) for x in invals], kinds, ctx)
        if not eqn.primitive.multiple_results:
            outs = (outs,)
        for var, value in zip(eqn.outvars, outs):
            if _compat.is_drop_var(var):
                continue
            env[var] = value
            kind_of[var] = kind

    outs = [
        _compat.literal_value(v) if isinstance(v, _compat.Literal) else env[v]
        for v in jaxpr.outvars
    ]
    out_kinds = [WEAK if isinstance(v, _compat.Literal) else kind_of[v] for v in jaxpr.outvars]
    return outs, out_kinds
