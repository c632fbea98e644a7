"""Wide regions: elementwise work on a narrowed activation, done in float32, stored in 16 bits.

A normalisation mixes a 16-bit activation with float32 statistics (``(x - mean) *
rsqrt(var)``); a softmax shifts, exponentiates and divides; a GELU multiplies an activation
by an ``erf`` of it. Done one equation at a time, such work either runs in 16 bits (losing
the precision the float32 rule was there for) or widens the activation stream to float32 for
every operation after it, and ``jax.vjp`` then keeps float32 copies of whole activations for
the backward pass.

Here such work is instead gathered, equation by equation, into a :class:`Wide` value (nothing
is emitted yet). When something that is not elementwise needs the value (a matrix product, a
loop, a function output), the gathered equations are emitted together as one
``jax.checkpoint`` region that replays the *original program's* float32 arithmetic on its
inputs and stores the result in the activation's 16-bit dtype, as cuDNN's batch norm does.
Reductions and the arithmetic on their results join the region too (a layer norm's mean,
variance and output are one region, reading the activation once); a statistic that leaves
a region leaves it in float32. Because the
region is a checkpoint, its backward pass recomputes the float32 intermediates from the
region's inputs: the only residuals are the 16-bit activation and the small statistics. On a
GPU, XLA fuses the region into one pass over the activation.

Under float16 a result is stored in 16 bits only where its range allows: a region that
computed ``exp``, a square, a reciprocal of an activation or a product of two activations
keeps float32 (a matrix product that consumes it casts it down anyway, and keeps only its
16-bit cast).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import jax
import numpy as np

from autocast import _compat
from autocast._src.policy.casting import cast_memo, cast_value, castable
from autocast._src.policy.precision import (
    INPUT_PRECISION_EXPONENTS,
    use_full_precision,
    use_input_precision,
    use_input_precision_for_casts,
    use_precision_by_exponent,
    use_widest_precision,
)
from autocast._src.transform import picks

_F32 = np.dtype(np.float32)

# Elementwise primitives a region may hold.
ELEMENTWISE = frozenset(
    {
        "add",
        "sub",
        "mul",
        "div",
        "neg",
        "max",
        "min",
        "abs",
        "sign",
        "select_n",
        "clamp",
        "exp",
        "exp2",
        "expm1",
        "log",
        "log1p",
        "tanh",
        "logistic",
        "erf",
        "erfc",
        "sqrt",
        "rsqrt",
        "cbrt",
        "square",
        "integer_pow",
        "pow",
        "sin",
        "cos",
    }
)
# Data movement a region may carry on through once it has started (never starts one).
MOVEMENT = frozenset(
    {
        "reshape",
        "squeeze",
        "expand_dims",
        "broadcast_in_dim",
        "transpose",
        "convert_element_type",
        "slice",
        "dynamic_slice",
        "gather",
        "stop_gradient",
    }
)
# Reductions of an activation start or join a region; their results are statistics.
REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod"})
# The default policy's rules a region may stand in for; a policy that names another rule
# for an equation (amp_stop, a user's own) is followed as it is.
CHAINABLE = frozenset(
    {
        use_input_precision,
        use_widest_precision,
        use_full_precision,
        use_precision_by_exponent,
        use_input_precision_for_casts,
    }
)
# Rules under which an equation would compute in float32 on a 16-bit activation.
WIDENING = frozenset({use_full_precision})
# Results that may exceed float16's range (65504) or come near zero's reciprocal.
_RANGE_UNSAFE = frozenset({"exp", "exp2", "expm1", "pow", "square", "rsqrt"})
_GATHERED = ELEMENTWISE | MOVEMENT | REDUCTIONS


class Wide:
    """One equation of the original program, to be evaluated in its own (float32) dtypes on
    arguments that are other :class:`Wide` values or concrete values (the region's inputs).

    ``stream`` is the 16-bit dtype the result is stored in when it leaves the region; None
    for a broadcast of a parameter or constant replayed inside a region (see :func:`replay`).
    """

    __slots__ = (
        "eqn",
        "args",
        "rule",
        "stream",
        "unsafe",
        "full",
        "ctx",
        "dtype",
        "shape",
        "links",
        "_made",
    )

    def __init__(self, eqn: Any, args: Sequence[Any], rule: Any, stream: Any, ctx: Any) -> None:
        self.eqn = eqn
        self.args = tuple(args)
        self.rule = rule
        self.stream = None if stream is None else np.dtype(stream)
        self.ctx = ctx
        aval = eqn.outvars[0].aval
        self.dtype, self.shape = aval.dtype, aval.shape
        # an activation (some input is one, at the result's size), or a statistic of one
        self.full = eqn.primitive.name not in REDUCTIONS and any(
            _is_full(a, self.shape) if not isinstance(a, Wide) else a.full for a in self.args
        )
        # a statistic leaves its region in float32, so only an activation can be out of range
        self.unsafe = self.full and _is_range_unsafe(eqn, self.args)
        self._made: dict[Any, Any] = {}
        # its recomputed-chain links by dtype (autocast._src.transform.recompute)
        self.links: dict[Any, Any] = {}

    @property
    def narrow_dtype(self) -> np.dtype:
        """The dtype this value leaves its region in: an activation's 16-bit stream dtype
        where its range allows, float32 for a statistic."""
        if not self.full or (self.stream == np.dtype(np.float16) and self.unsafe):
            return self.dtype
        return self.stream

    def materialize(self, dtype: Any = None) -> Any:
        """Emits the region computing this value, stored in ``dtype`` (default: narrow)."""
        dtype = np.dtype(self.narrow_dtype if dtype is None else dtype)
        made = self._made.get(dtype)
        if made is None:
            made = self._made[dtype] = _emit(self, dtype)
        return made


class Moved:
    """An activation reshaped (transposed, ...) from another, as a region input: the region
    reads the other and replays the movement when the other is an input of it anyway (a
    group norm's statistics read the activation in groups, its normalisation reads it
    whole), so the backward keeps one residual, not two shapes of the same data."""

    __slots__ = ("value", "eqn", "source")

    def __init__(self, value: Any, eqn: Any, source: Any) -> None:
        self.value, self.eqn, self.source = value, eqn, source

    @property
    def shape(self) -> Any:
        return self.value.shape

    @property
    def dtype(self) -> Any:
        return self.value.dtype


# The reductions whose results a checkpoint of amp's keeps, and by how many times at least a
# kept one shrinks its input: a statistic is a small fraction of the activation it reads.
STATISTICS = frozenset({"reduce_sum", "reduce_max", "reduce_min"})
STATISTIC_SHRINKS = 16


def saves_statistic(prim: Any, *avals: Any, **params: Any) -> bool:
    """Whether a checkpoint of amp's keeps an equation's result: a reduction to a statistic
    (a batch norm's means, a softmax's maxima), which the backward pass would otherwise
    compute again with one more pass over the full activation. The activation itself, and
    everything elementwise, is recomputed."""
    if prim.name not in STATISTICS or not avals:
        return False
    shape = avals[0].shape
    return math.prod(shape[a] for a in params.get("axes", ())) >= STATISTIC_SHRINKS


def keep_statistics(prim: Any, *avals: Any, **params: Any) -> bool:
    """The checkpoint policy of a wide region: its backward recomputes everything from the
    region's inputs but its statistics (:func:`saves_statistic`). A function of its own, so
    measures can tell amp's regions apart."""
    return saves_statistic(prim, *avals, **params)


def _is_full(arg: Any, shape: Sequence[int]) -> bool:
    """Whether ``arg`` is data the size of the result (not a constant, statistic or broadcast)."""
    if _is_constant(arg):
        return False
    if isinstance(arg, Wide):
        return arg.stream is not None and tuple(arg.shape) == tuple(shape)
    return tuple(np.shape(arg)) == tuple(shape)


def _is_range_unsafe(eqn: Any, args: Sequence[Any]) -> bool:
    """Whether float16 may not hold this activation: it, or one it is computed from, may
    overflow or come close to a reciprocal of zero."""
    if any(isinstance(a, Wide) and a.unsafe for a in args):
        return True
    name = eqn.primitive.name
    shape = eqn.outvars[0].aval.shape
    if name in _RANGE_UNSAFE:
        return True
    if name == "integer_pow":
        return eqn.params["y"] not in INPUT_PRECISION_EXPONENTS or eqn.params["y"] < 0
    if name == "div":
        return _is_full(args[1], shape)  # 1/x of an activation; a statistic only rescales
    if name == "mul":
        return _is_full(args[0], shape) and _is_full(args[1], shape)
    return False


def _leaves(node: Wide, found: dict[int, Any], moves: list[Moved], seen: set[int]) -> None:
    if id(node) in seen:
        return
    seen.add(id(node))
    for arg in node.args:
        if isinstance(arg, Wide):
            _leaves(arg, found, moves, seen)
        elif isinstance(arg, Moved):
            moves.append(arg)
        elif not _is_constant(arg):
            found.setdefault(id(arg), arg)


def _inputs(root: Wide) -> tuple[list[Any], dict[int, Any]]:
    """The region's inputs, and what each :class:`Moved` argument stands for (by ``id``):
    the movement replayed on its source where the source is an input anyway, else the
    moved value itself, an input of its own."""
    found: dict[int, Any] = {}
    moves: list[Moved] = []
    _leaves(root, found, moves, set())
    resolved = {
        id(m): replay(m.eqn, m.source, root.ctx) if id(m.source) in found else m.value
        for m in moves
    }
    for m in moves:
        if id(m.source) not in found:
            found.setdefault(id(m.value), m.value)
    return list(found.values()), resolved


def _is_constant(x: Any) -> bool:
    return isinstance(x, (np.ndarray, np.generic, int, float, bool))


# What a region may do to an input that float32's backward pass does not keep: sum it (its
# derivative is a broadcast of the cotangent), after moving or casting it.
_SUMMED = frozenset({"reduce_sum"})
_PASSED = frozenset({"convert_element_type", "reshape", "squeeze", "expand_dims", "transpose"})


def _only_summed(root: Wide, resolved: dict[int, Any]) -> bool:
    """Whether every input of the region as large as its result or larger is only summed,
    through casts and reshapes (a mean before pooling, a loss's mean). Its backward pass
    then needs none of those inputs, so it is emitted as plain float32 arithmetic, which
    keeps what float32 keeps (values smaller than the inputs), and not as a checkpoint,
    which would keep the whole activation. Inputs smaller than the result (the scale and
    bias of a layer norm after the pooling, a scalar) may be used in any way."""
    users: dict[int, list[Wide]] = {}
    nodes: dict[int, Wide] = {}

    def visit(node: Wide) -> None:
        if id(node) in nodes:
            return
        nodes[id(node)] = node
        for arg in node.args:
            arg = resolved.get(id(arg), arg)
            if isinstance(arg, Wide):
                users.setdefault(id(arg), []).append(node)
                visit(arg)

    visit(root)

    def summed(node: Wide) -> bool:
        name = node.eqn.primitive.name
        if name in _SUMMED:
            return True
        return (
            name in _PASSED and node is not root and all(summed(u) for u in users.get(id(node), ()))
        )

    size = math.prod(root.shape)
    for node in nodes.values():
        for arg in node.args:
            arg = resolved.get(id(arg), arg)
            if isinstance(arg, Wide) or _is_constant(arg) or math.prod(np.shape(arg)) < size:
                continue
            if not summed(node):
                return False
    return True


def _body(
    root: Wide, dtype: np.dtype, leaves: Sequence[Any], resolved: dict[int, Any]
) -> Callable[..., Any]:
    """The region computing ``root`` as a function of values for its inputs ``leaves``: the
    original program's arithmetic on them, the result stored in ``dtype``."""
    position = {id(x): i for i, x in enumerate(leaves)}

    def region(*values: Any) -> Any:
        with cast_memo():
            done: dict[int, Any] = {}

            def evaluate(node: Wide) -> Any:
                hit = done.get(id(node))
                if hit is not None:
                    return hit
                ins = []
                for arg, var in zip(node.args, node.eqn.invars):
                    original = var.aval.dtype
                    arg = resolved.get(id(arg), arg)
                    if isinstance(arg, Wide):
                        value = evaluate(arg)
                    else:
                        value = arg if _is_constant(arg) else values[position[id(arg)]]
                    ins.append(cast_value(value, original) if castable(value, original) else value)
                with _compat.equation_context(node.eqn):
                    out = picks.bind_equation(node.eqn, ins, node.eqn.params)
                out = done[id(node)] = node.ctx.observed(node.eqn, node.rule, ins, out)
                return out

            out = evaluate(root)
            return cast_value(out, dtype) if castable(out, dtype) else out

    return region


def recomputable(root: Wide, dtype: Any = None) -> tuple[Callable[..., Any], list[Any], Any] | None:
    """The region computing the activation ``root`` (stored in ``dtype``, default its narrow
    one) as a function of its inputs, the inputs, and a hashable description of the region
    (None where it has none), for a checkpoint of a consumer's to recompute
    (:mod:`autocast._src.transform.recompute`); None for a statistic, and for a region
    emitted as plain arithmetic (one that only sums its large inputs)."""
    if not root.full:
        return None
    dtype = np.dtype(root.narrow_dtype if dtype is None else dtype)
    leaves, resolved = _inputs(root)
    if _only_summed(root, resolved):
        return None
    position = {id(x): i for i, x in enumerate(leaves)}
    key = _structure(root, position, resolved, leaves, dtype)
    return _body(root, dtype, leaves, resolved), leaves, key


def trace_cache() -> dict | None:
    """The traces of the program being evaluated, by structure (None outside an evaluation):
    recomputed chains share it with the regions."""
    return _traced_regions[-1] if _traced_regions else None


def _emit(root: Wide, dtype: np.dtype) -> Any:
    leaves, resolved = _inputs(root)
    position = {id(x): i for i, x in enumerate(leaves)}
    region = _body(root, dtype, leaves, resolved)

    if _only_summed(root, resolved):
        return region(*leaves)
    cache = _traced_regions[-1] if _traced_regions and root.ctx.observer is None else None
    key = _structure(root, position, resolved, leaves, dtype) if cache is not None else None
    # outside a loop body, XLA would merge the backward's recomputation with the forward
    # pass and keep the float32 intermediates the region was made to spare
    prevent_cse = not root.ctx.in_loop and root.full
    return checkpoint(region, leaves, keep_statistics, prevent_cse, cache, key)


def checkpoint(
    fn: Callable[..., Any],
    leaves: Sequence[Any],
    policy: Callable[..., bool],
    prevent_cse: bool,
    cache: dict | None,
    key: Any,
) -> Any:
    """``jax.checkpoint(fn, prevent_cse=..., policy=policy)(*leaves)``, traced once per ``key``
    in ``cache`` (the blocks of a model share a structure); traced on its own where either is
    None."""
    if cache is None or key is None:
        return jax.checkpoint(fn, prevent_cse=prevent_cse, policy=policy)(*leaves)
    traced = cache.get(key)
    if traced is None:
        traced = cache[key] = _compat.trace_open(fn, leaves)
    return _compat.bind_checkpoint(*traced, leaves, policy=policy, prevent_cse=prevent_cse)


# The regions traced so far in the program amp is evaluating (innermost last), by structure:
# the blocks of a model repeat theirs, and tracing each once instead of per block is most of
# the time wide regions add to tracing.
_traced_regions: list[dict] = []


class traced_regions:
    """Within this context, regions of the same structure are traced once and reused."""

    def __enter__(self) -> None:
        _traced_regions.append({})

    def __exit__(self, *_: Any) -> None:
        _traced_regions.pop()


def equation_key(eqn: Any) -> tuple:
    """What an equation of a region binds with: primitive, parameters, and the context the
    traced copy carries on (name stack, source lines, XLA metadata, compute placement), so
    a reused region reports the blocks it stands for, not the first one's."""
    info = eqn.source_info
    return (
        eqn.primitive,
        tuple(sorted(eqn.params.items())),
        str(info.name_stack),
        info.traceback,
        getattr(eqn, "ctx", None),
    )


def _structure(
    root: Wide,
    position: dict[int, int],
    resolved: dict[int, Any],
    leaves: Sequence[Any],
    dtype: np.dtype,
) -> Any:
    """A hashable description of the region ``root`` heads: its equations, how they connect,
    their constants, the inputs' types and the stored dtype. None where something in it
    cannot be hashed (the region is then traced on its own)."""
    order: dict[int, int] = {}
    rows: list[Any] = []

    def visit(node: Wide) -> int:
        index = order.get(id(node))
        if index is not None:
            return index
        refs = []
        for arg in node.args:
            arg = resolved.get(id(arg), arg)
            if isinstance(arg, Wide):
                refs.append(("n", visit(arg)))
            elif _is_constant(arg):
                refs.append(
                    ("c", np.asarray(arg).dtype.str, np.shape(arg), np.asarray(arg).tobytes())
                )
            else:
                refs.append(("l", position[id(arg)]))
        rows.append((*equation_key(node.eqn), tuple(refs)))
        order[id(node)] = index = len(order)
        return index

    visit(root)
    avals = tuple(_compat.aval_of(x) for x in leaves)
    if not all(_compat.retraceable(a) for a in avals):
        return None
    key = (tuple(rows), avals, dtype)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def replay(eqn: Any, operand: Any, ctx: Any) -> Wide:
    """A movement replayed inside a region on its operand: a broadcast not yet emitted (the
    region keeps the small operand as its input, not the broadcast value), or a reshape of
    an activation the region reads anyway (see :class:`Moved`)."""
    return Wide(eqn, [operand], use_input_precision, None, ctx)


def settle(x: Any, dtype: Any = None) -> Any:
    """``x``, emitted if it is a :class:`Wide` value (in ``dtype``, default its narrow one)."""
    return x.materialize(dtype) if isinstance(x, Wide) else x


def narrowed(x: Any, var: Any) -> bool:
    """Whether ``x`` is a 16-bit value the program had in float32."""
    if isinstance(x, Wide) or _is_constant(x):
        return False
    if var.aval.dtype != _F32:  # also keeps typed PRNG keys away from np.dtype
        return False
    dtype = getattr(x, "dtype", None)
    return dtype is not None and np.dtype(dtype).itemsize == 2


SIXTEEN_BIT = frozenset({np.dtype(jax.numpy.bfloat16), np.dtype(np.float16)})


def sixteen_bit(x: Any, var: Any) -> bool:
    """Whether ``x`` is a 16-bit value a recomputed chain may start from: one amp narrowed
    from the program's float32, or one the program itself computes in 16 bits (bfloat16
    parameters make a model's bias and activation function 16-bit before amp sees them)."""
    if narrowed(x, var):
        return True
    if isinstance(x, Wide) or _is_constant(x) or var.aval.dtype not in SIXTEEN_BIT:
        return False
    return getattr(x, "dtype", None) == var.aval.dtype


def _activation_dtype(eqn: Any, invals: Sequence[Any], data: Sequence[bool]) -> Any:
    """The 16-bit dtype of a full-size data input amp narrowed from the program's float32."""
    shape = tuple(eqn.outvars[0].aval.shape)
    for x, var, yes in zip(invals, eqn.invars, data):
        if yes and narrowed(x, var) and tuple(np.shape(x)) == shape:
            return np.dtype(x.dtype)
    return None


def float32_inputs(eqn: Any, invals: Sequence[Any], data: Sequence[bool]) -> tuple[bool, bool]:
    """Whether a float32 data input of ``eqn`` is full-size (a float32 stream), and whether
    one is smaller than the result (a statistic broadcast over it)."""
    if not eqn.outvars:  # jax.debug.print, a checkify check: no result to size against
        return False, False
    shape = tuple(eqn.outvars[0].aval.shape)
    stream = statistic = False
    for x, yes in zip(invals, data):
        if not yes or isinstance(x, Wide) or _is_constant(x):
            continue
        if getattr(x, "dtype", None) == _F32:
            if tuple(np.shape(x)) == shape:
                stream = True
            else:
                statistic = True
    return stream, statistic


def widening(eqn: Any, rule: Any) -> bool:
    """Whether ``rule`` computes ``eqn`` in float32 on a 16-bit activation whatever its
    inputs are: a float32 row of the table, or a power that goes to float32 (``x ** 2`` is
    a square however it is spelled). The interpreter asks it of later equations too, so
    that an elementwise value feeding one (a tanh before its square) joins the region."""
    return rule in WIDENING or (
        rule is use_precision_by_exponent and eqn.params.get("y") not in INPUT_PRECISION_EXPONENTS
    )


def may_gather(eqn: Any, rule: Any) -> bool:
    """Whether :func:`gather` could take ``eqn`` at all: a cheap test on the trace's hot path."""
    return (
        eqn.primitive.name in _GATHERED
        and rule in CHAINABLE
        and not eqn.primitive.multiple_results
        and eqn.outvars[0].aval.dtype == _F32
    )


def gather(
    eqn: Any,
    invals: Sequence[Any],
    data: Sequence[bool],
    rule: Any,
    ctx: Any,
    feeds_wide: Callable[[], bool],
    starts: Callable[[], Sequence[Any]] | None = None,
) -> Any:
    """Gathers ``eqn`` (for which :func:`may_gather` holds) into a region, or ends one; None
    where ``eqn`` runs as usual.

    ``data`` marks the inputs that are data rather than constants or broadcast parameters
    (the interpreter's STRONG and RAW values). ``feeds_wide()`` says whether the result goes
    on into a float32 rule (the shift of a softmax before its ``exp``); it is asked last, as
    answering it reads the whole jaxpr once. ``starts()`` gives the inputs a region that
    starts here reads (a :class:`Moved` for a reshaped activation); by default ``invals``.
    """
    name = eqn.primitive.name
    wide = [x for x in invals if isinstance(x, Wide) and x.stream is not None]
    stream32, statistic = float32_inputs(eqn, invals, data)
    if wide:
        if stream32:
            return None
        if name == "convert_element_type" and eqn.params["new_dtype"] != eqn.invars[0].aval.dtype:
            return None  # a cast the program wrote is kept; the region ends before it
        return Wide(eqn, invals, rule, wide[0].stream, ctx)
    if name in REDUCTIONS:
        # a statistic of an activation: computed from the float32 value the region that
        # normalises the activation reads anyway, so the activation is cast once
        x = invals[0]
        if data[0] and narrowed(x, eqn.invars[0]):
            return Wide(eqn, invals if starts is None else starts(), rule, x.dtype, ctx)
        return None
    if name not in ELEMENTWISE or stream32:
        return None
    stream = _activation_dtype(eqn, invals, data)
    if stream is None:
        return None
    widens = (
        widening(eqn, rule)
        or statistic
        or (name == "div" and _is_full(invals[1], eqn.outvars[0].aval.shape))  # 1/x
    )
    if widens or feeds_wide():
        return Wide(eqn, invals if starts is None else starts(), rule, stream, ctx)
    return None
