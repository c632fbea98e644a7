"""Recomputed chains: elementwise work in the compute dtype, kept as its inputs.

Between two matrix products a model applies elementwise work to a full-size activation in
the compute dtype: a tanh-GELU (a cube, three scalings, two additions, a ``tanh``, a product
with its input), a SiLU, a relu, a bias. Evaluated equation by equation, ``jax.vjp`` keeps
what each equation's derivative reads: the tanh-GELU of a transformer keeps six 16-bit
copies of its ``[batch, seq, 4d]`` activation, the largest arrays of the step, where
PyTorch's compiled step keeps one (its partitioner recomputes the chain in the backward).

Here such equations are not bound when the interpreter reaches them. Each becomes a
:class:`Link`, a node that records the equation, what it reads and the 16-bit dtype its
result will have. When something that is not a link needs the value (a matrix product, a
region, a loop, a function output), the chain is emitted:

- into a matrix product in the compute dtype: the chain and the product are one
  ``jax.checkpoint`` that keeps only the chain's inputs (and the product's other operand), so
  the product's weight gradient reads the recomputed value and nothing of the chain is kept;
- into anything else: the chain alone as such a checkpoint, its value leaving it;
- either way only where that keeps fewer bytes than the equations as written would
  (:func:`_worth_it`); else the chain is bound as written, which is what amp did before.

The equations are evaluated exactly as they would be one by one (the same rule, the same
casts), so the forward values are the same bits; on a GPU, XLA fuses the recomputation into
the kernels of the backward pass.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from autocast import _compat
from autocast._src.policy.casting import cast_memo
from autocast._src.transform import regions

# Elementwise primitives a chain may hold: those a wide region may hold, less the ones that
# the default policy computes in float32 (exponentials, logarithms, roots, powers, squares,
# trigonometry: they go into wide regions) and sign, and with one_minus_square (tanh's
# derivative on JAX 0.11 and later). Also the data movement a chain may carry on through (a
# reshape of an attention output on its way into the output projection).
_NOT_IN_CHAINS = frozenset(
    {"cbrt", "cos", "erf", "erfc", "exp", "exp2", "expm1", "log", "log1p", "pow", "rsqrt"}
    | {"sign", "sin", "sqrt", "square"}
)
ELEMENTWISE = (regions.ELEMENTWISE - _NOT_IN_CHAINS) | {"one_minus_square"}
MOVEMENT = frozenset({"reshape", "squeeze", "expand_dims", "transpose"})
LINKS = ELEMENTWISE | MOVEMENT

# What the derivative of each primitive reads, for the estimate of what a chain written
# out keeps: its own output, or its full-size inputs (a product of two activations reads
# both; a product with a scale reads the scale, which is small).
_READS_OUTPUT = frozenset({"tanh", "logistic"})
_READS_INPUTS = frozenset({"integer_pow", "max", "min", "abs", "clamp", "select_n", "mul", "div"})
# An activation function with a derivative rule of its own (jax.nn.relu's custom_jvp): what
# the rule reads is its affair; a relu's reads a mask of its input, counted as the input.
ACTIVATION_CALLS = frozenset({"custom_jvp_call"})


# Whether checkpoints outside a loop body are kept apart from the forward pass (see
# _checkpointed); False only to measure what the barrier costs (benchmarks/recompute_cost.py).
PREVENT_CSE_OUTSIDE_LOOPS = True


def recompute_chain(prim: Any, *avals: Any, **params: Any) -> bool:
    """The checkpoint policy of a recomputed chain: nothing inside is kept but the statistics
    of a wide region recomputed with it (:func:`regions.saves_statistic`). A function of its
    own, so measures can tell these checkpoints from wide regions and the user's."""
    return regions.saves_statistic(prim, *avals, **params)


class Link:
    """One equation of a chain, not yet bound.

    ``args`` are the equation's inputs as the interpreter holds them (other links, deferred
    broadcasts, arrays, constants), ``kinds`` their kinds; ``bind(eqn, invals, kinds)``
    evaluates the equation as the interpreter would. ``dtype`` is the 16-bit dtype of the
    result, known before it is bound (the chain's activation dtype).
    """

    __slots__ = (
        "eqn",
        "args",
        "kinds",
        "dtype",
        "shape",
        "bind",
        "prevent_cse",
        "_plain",
        "_alone",
        "_emitted",
    )

    def __init__(
        self,
        eqn: Any,
        args: Sequence[Any],
        kinds: Sequence[int],
        dtype: Any,
        bind: Callable,
        prevent_cse: bool = True,
    ) -> None:
        self.eqn = eqn
        self.prevent_cse = prevent_cse
        self.args = tuple(args)
        self.kinds = tuple(kinds)
        self.dtype = np.dtype(dtype)
        self.shape = tuple(eqn.outvars[0].aval.shape)
        self.bind = bind
        self._plain: Any = None
        self._alone: Any = None
        self._emitted = False  # recomputed in some checkpoint (its value maybe not bound)
        if _accounts:  # what reads each input, for the ties of _worth_it
            for a in map(_undeferred, self.args):
                if not _is_constant(a):
                    _accounts[-1].readers.setdefault(id(a), []).append(self)

    @property
    def nbytes(self) -> int:
        return _size(self.shape) * self.dtype.itemsize


class RegionLink(Link):
    """A wide region's activation as the first link of a chain: its inputs are the region's
    (the 16-bit activation it normalises, the statistics' gains), and binding it evaluates
    the region on them. Recomputed into a matrix product's checkpoint, a layer norm's output
    is kept as the activation it was computed from, which its region keeps anyway; evaluated
    alone, it is the region as amp emits it (:meth:`regions.Wide.materialize`)."""

    __slots__ = ("wide", "structure")

    def __init__(
        self, wide: Any, dtype: Any, body: Callable, leaves: Sequence[Any], structure: Any
    ) -> None:
        super().__init__(
            wide.eqn,
            leaves,
            (0,) * len(leaves),
            dtype,
            lambda eqn, values, kinds: body(*values),
            prevent_cse=not wide.ctx.in_loop,
        )
        self.wide = wide
        self.structure = structure  # the region's, for traces shared by structure

    def emitted(self) -> Any:
        return self.wide.materialize(self.dtype)


def region_link(x: Any, dtype: Any = None) -> Any:
    """``x`` as a chain's first link where it is a wide region's activation (one per region
    and dtype, so a chain reading it twice recomputes it once); else ``x`` settled."""
    if not isinstance(x, regions.Wide):
        return x
    dtype = np.dtype(x.narrow_dtype if dtype is None else dtype)
    links = x.links
    if dtype not in links:
        found = regions.recomputable(x, dtype)
        links[dtype] = None if found is None else RegionLink(x, dtype, *found)
    return links[dtype] if links[dtype] is not None else x.materialize(dtype)


def _size(shape: Sequence[int]) -> int:
    return int(np.prod(shape, dtype=np.int64)) if shape else 1


def _is_constant(x: Any) -> bool:
    return isinstance(x, (np.ndarray, np.generic, int, float, bool, complex))


def _is_deferred(x: Any) -> bool:
    """Whether ``x`` is one of the interpreter's deferred broadcasts (the interpreter imports
    this module, not the other way round): a class marked ``deferred = True``, with ``eqn``
    and ``operand``, rebuilt as ``type(x)(eqn, operand)`` on the operand's value inside a
    checkpoint, so the checkpoint keeps the small operand and not the broadcast."""
    return getattr(type(x), "deferred", False)


def _undeferred(x: Any) -> Any:
    """What a deferred broadcast (or a chain of them) is of; anything else as it is."""
    while _is_deferred(x):
        x = x.operand
    return x


def _bound(node: Link) -> Any:
    """The link's value where it was already bound as written, else None: a chain reading it
    stops there and keeps that value, which its other readers bound as written have anyway,
    rather than recompute it from what it was computed from. A link emitted alone is not a
    stop: its checkpoint keeps its inputs, not its value."""
    return node._plain


def _walk(roots: Sequence[Link]) -> tuple[list[Link], list[Any]]:
    """The links ``roots`` are computed from, in an order that evaluates each after its
    inputs, and the chain's inputs (arrays, by identity; deferred broadcasts are replayed
    on their operand, which is the input)."""
    order: list[Link] = []
    leaves: dict[int, Any] = {}
    seen: set[int] = set()

    def leaf(a: Any) -> None:
        a = _undeferred(a)
        value = _bound(a) if isinstance(a, Link) else None
        if value is not None:
            if _accounts:  # what reads the link reads its value (_read_later)
                _accounts[-1].stops[id(value)] = a  # the link holds the value: ids stay
            a = value
        if not _is_constant(a):
            leaves.setdefault(id(a), a)

    def visit(node: Link) -> None:
        if id(node) in seen:
            return
        seen.add(id(node))
        for a in node.args:
            if isinstance(a, Link) and _bound(a) is None:
                visit(a)
            else:
                leaf(a)
        order.append(node)

    for r in roots:
        visit(r)
    return order, list(leaves.values())


def _nbytes(x: Any) -> int:
    if isinstance(x, Link):
        return x.nbytes
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return 0
    return _size(np.shape(x)) * np.dtype(dtype).itemsize


def _kept_as_written(order: Sequence[Link]) -> int:
    """Bytes the chain's equations keep for their derivatives when bound one by one (an
    estimate: what each primitive's derivative reads, each value counted once, less what
    is kept anyway: :func:`kept_anyway`)."""
    kept: dict[int, int] = {}
    for node in order:
        for a in _read_as_written(node):
            kept[id(a)] = 0 if kept_anyway(a) else _nbytes(a)
    return sum(kept.values())


def _read_as_written(node: Link) -> list[Any]:
    """What the derivative of ``node`` bound as written reads, by the estimate (a link bound
    before the chain, where the chain stops, is read as its value)."""
    name = node.eqn.primitive.name
    if isinstance(node, RegionLink):
        return list(node.args)  # emitted on its own, the region keeps its inputs
    if name in _READS_OUTPUT:
        return [node]
    if name in _READS_INPUTS or name in ACTIVATION_CALLS:
        data = [a for a in node.args if not _is_constant(a) and not _is_deferred(a)]
        if name in ("mul", "div") and len(data) < 2 and len(node.args) == 2:
            # a product with a scale or a constant reads only the scale (small)
            data = [
                a
                for a in data
                if tuple(np.shape(a) if not isinstance(a, Link) else a.shape) != node.shape
            ]
        return [_bound(a) if isinstance(a, Link) and _bound(a) is not None else a for a in data]
    return []


class _Account:
    """What the chains of one program (being evaluated) are weighed against, by id (with
    the value or the link, so that ids are not reused while it lasts):

    - ``kept``: arrays that something already bound keeps for the backward pass whatever
      the chains still to come decide: the inputs of the checkpoints emitted so far (for a
      chain emitted alone, those its derivatives need). Recomputing from one costs none of
      its bytes. What an equation bound as written keeps is not counted: a product's
      derivative reads an operand only where another operand has a tangent, which amp
      cannot know (a dropout mask, a frozen matrix).
    - ``left``: for each array or link, ``[value, n]``: n equations a chain may hold are
      yet to read it (the interpreter counts them in the program); ties only.
    - ``stops``: the link each value a chain stopped at was bound from (what reads the
      link reads the value); ``readers``: the links that read each array or link.
    """

    __slots__ = ("kept", "left", "stops", "readers")

    def __init__(self) -> None:
        self.kept: dict[int, Any] = {}
        self.left: dict[int, list] = {}
        self.stops: dict[int, Link] = {}
        self.readers: dict[int, list[Link]] = {}


# The accounts of the programs being evaluated, innermost last (pending_links).
_accounts: list[_Account] = []


class pending_links:
    """Within this context (a program's evaluation), what chains are weighed against is
    recorded (:class:`_Account`)."""

    def __enter__(self) -> None:
        _accounts.append(_Account())

    def __exit__(self, *_: Any) -> None:
        _accounts.pop()


def _registered(a: Any) -> Any:
    a = _undeferred(a)
    return None if _is_constant(a) or isinstance(a, Link) else a


def kept_anyway(a: Any) -> bool:
    """Whether something already bound keeps ``a`` for the backward pass."""
    a = _registered(a)
    return a is not None and bool(_accounts) and id(a) in _accounts[-1].kept


def _keep(values: Sequence[Any]) -> None:
    if _accounts:
        for a in map(_registered, values):
            if a is not None:
                _accounts[-1].kept.setdefault(id(a), a)


# Equations whose derivatives read none of their operands (a mul or div by a constant is
# one too: see _recomputed_from).
_LINEAR = frozenset({"add", "sub", "neg", "add_any"}) | MOVEMENT


def _recomputed_from(order: Sequence[Link]) -> list[Any]:
    """The inputs a checkpoint of the chain ``order`` emitted alone keeps: those that the
    values its derivatives read are computed from. JAX keeps no input that only linear
    work reads (``tanh(a) + c`` keeps ``a``, not ``c``)."""
    sources: dict[int, dict[int, Any]] = {}

    def of(a: Any) -> dict[int, Any]:
        a = _undeferred(a)
        if isinstance(a, Link) and id(a) in sources:
            return sources[id(a)]
        if isinstance(a, Link):
            a = _bound(a)
        return {} if _is_constant(a) else {id(a): a}

    needed: dict[int, Any] = {}
    for node in order:
        sources[id(node)] = {k: v for a in node.args for k, v in of(a).items()}
        name = node.eqn.primitive.name
        data = [not _is_constant(a) for a in node.args]
        if isinstance(node, RegionLink) or name not in _LINEAR | {"mul", "div"}:
            read = list(node.args)
        elif name == "mul":  # each operand is read for the other's derivative
            read = [a for i, a in enumerate(node.args) if any(data[:i] + data[i + 1 :])]
        elif name == "div" and data[1:] == [True]:
            read = list(node.args)
        else:
            read = []
        for a in read:
            needed.update(of(a))
    return list(needed.values())


def reading(args: Sequence[Any], counts: Sequence[int]) -> None:
    """Records that an equation a chain may hold reads ``args`` (links or not), of which the
    program has ``counts[i]`` such readers in all."""
    if _accounts:
        left = _accounts[-1].left
        for a, n in zip(map(_undeferred, args), counts):
            if not _is_constant(a):
                entry = left.setdefault(id(a), [a, n])
                entry[1] -= 1


def _read_later(x: Any, order: Sequence[Link]) -> bool:
    """Whether a chain still to come reads ``x`` (or the link it is the value of): a link
    outside ``order`` not yet bound reads it, or an equation a chain may hold is yet to."""
    if not _accounts:
        return False
    account = _accounts[-1]
    mine = {id(n) for n in order}
    for a in (x, account.stops.get(id(x))):
        if a is None:
            continue
        entry = account.left.get(id(a))
        if entry is not None and entry[1] > 0:
            return True
        for r in account.readers.get(id(a), ()):
            if id(r) not in mine and _bound(r) is None and not r._emitted:
                return True
    return False


# Products whose derivatives read an operand only where another has a tangent, which amp
# cannot know (a dropout mask, a frozen matrix): what they keep as written is an upper
# bound, so a chain holding one is never recomputed at a tie.
_READS_AN_OPERAND = frozenset({"mul", "div"})


def _worth_it(order: Sequence[Link], leaves: Sequence[Any], read_by_consumer: int) -> bool:
    """Whether recomputing the chain keeps fewer bytes than binding it as written: its
    inputs against what its equations keep, plus what the consumer keeps of its value
    (a matrix product keeps its operand for the weight gradient), either side less what
    something already bound keeps anyway.

    A tie (the inputs as large as the chain's values weigh what it keeps as written) goes
    to recomputing where a chain still to come reads every input it would keep: recomputed
    in its turn, that chain keeps them anyway (a layer norm written in bfloat16 reads its
    input and mean in the variance's chain and the output's: together they keep them once,
    not the variance's ``x - mean`` besides). The smaller inputs (the mean) are the most a
    tie costs, where that later chain is bound as written after all. A chain holding a
    product (``mul``, ``div``) never wins a tie: what it keeps as written is an upper bound
    (see :data:`_READS_AN_OPERAND`)."""
    fresh = [x for x in leaves if not kept_anyway(x)]
    kept = sum(_nbytes(x) for x in fresh)
    written = _kept_as_written(order) + read_by_consumer
    if all(n.eqn.primitive.name in MOVEMENT for n in order):
        # a reshape into a product: the product keeps the reshaped input's own buffer,
        # which its producer may keep too (a fused attention keeps its output)
        return kept <= written
    if kept < written:
        return True
    if any(n.eqn.primitive.name in _READS_AN_OPERAND for n in order):
        return False  # never a tie: see _READS_AN_OPERAND
    full = max(n.nbytes for n in order)
    large = sum(_nbytes(x) for x in fresh if _nbytes(x) >= full)
    return 0 < large == written and all(_read_later(x, order) for x in fresh)


class _Unkeyable(Exception):
    """A chain with something in it that cannot be described by value."""


def _structure(order: Sequence[Link], leaves: Sequence[Any], finish: Callable) -> Any:
    """A hashable description of a chain's checkpoint: its links (equation, context, how they
    connect, their kinds and dtypes; a region link's region), its constants, its inputs'
    types, and what ``finish`` makes of it (``finish(ref)`` describes it with ``ref``, which
    describes one value). The blocks of a model repeat theirs, so a checkpoint is traced once
    per structure, as wide regions are. None where something cannot be hashed."""
    index = {id(n): i for i, n in enumerate(order)}
    position = {id(x): i for i, x in enumerate(leaves)}

    def ref(a: Any) -> tuple:
        if isinstance(a, Link):
            if id(a) in index:
                return ("n", index[id(a)])
            a = _bound(a)
        if _is_deferred(a):
            return ("d", regions.equation_key(a.eqn), ref(a.operand))
        hit = position.get(id(a))
        if hit is not None:
            return ("l", hit)
        if _is_constant(a):
            value = np.asarray(a)
            return ("c", value.dtype.str, value.shape, value.tobytes())
        raise _Unkeyable

    try:
        rows = []
        for n in order:
            if isinstance(n, RegionLink):
                if n.structure is None:
                    return None
                head: Any = ("region", n.structure)
            else:
                head = regions.equation_key(n.eqn)
            rows.append((head, tuple(ref(a) for a in n.args), n.kinds, n.dtype.str))
        avals = tuple(_compat.aval_of(x) for x in leaves)
        if not all(_compat.retraceable(a) for a in avals):
            return None
        key = ("chain", tuple(rows), avals, finish(ref))
        hash(key)
    except (_Unkeyable, TypeError):
        return None
    return key


def _checkpointed(
    order: Sequence[Link],
    leaves: Sequence[Any],
    finish: Callable[[Callable], Any],
    finish_key: Callable[[Callable], Any] | None = None,
) -> Any:
    """``finish(value_of)`` traced inside a checkpoint that recomputes the chain ``order``
    from ``leaves``; ``value_of(x)`` is the value of a link or other input there.
    ``finish_key(ref)`` describes ``finish`` for sharing the trace (:func:`_structure`); None
    traces it on its own."""
    position = {id(x): i for i, x in enumerate(leaves)}

    def region(*values: Any) -> Any:
        with cast_memo():  # casts of the inputs happen inside, not shared with the outside
            done: dict[int, Any] = {}

            def value_of(a: Any) -> Any:
                if isinstance(a, Link):
                    if id(a) in done:
                        return done[id(a)]
                    a = _bound(a)  # bound before the chain: one of its inputs
                if _is_deferred(a):
                    return type(a)(a.eqn, value_of(a.operand))
                hit = position.get(id(a))
                return a if hit is None else values[hit]

            for node in order:
                with _compat.equation_context(node.eqn):
                    done[id(node)] = _checked(
                        node, node.bind(node.eqn, [value_of(a) for a in node.args], node.kinds)
                    )
            return finish(value_of)

    # outside a loop body, XLA would merge the backward's recomputation with the forward
    # pass and keep what the chain was written to spare
    prevent_cse = PREVENT_CSE_OUTSIDE_LOOPS and any(n.prevent_cse for n in order)
    for n in order:
        n._emitted = True  # no chain to come: its inputs are what this checkpoint keeps
    cache = regions.trace_cache()
    key = None if cache is None or finish_key is None else _structure(order, leaves, finish_key)
    return regions.checkpoint(region, leaves, recompute_chain, prevent_cse, cache, key)


def _checked(node: Link, value: Any) -> Any:
    if getattr(value, "dtype", None) != node.dtype:
        raise AssertionError(
            f"amp's recomputed chain expected {node.eqn.primitive.name} to give {node.dtype}, "
            f"got {type(value).__name__} {getattr(value, 'dtype', None)}; please report this"
        )
    return value


def _plain(node: Link) -> Any:
    """The link bound as written, in the current trace (once)."""
    if node._plain is None:
        order, _ = _walk([node])
        for n in order:
            if n._plain is None and isinstance(n, RegionLink):
                n._plain = n.emitted()
            elif n._plain is None:
                args = [settle_plain(a) for a in n.args]
                with _compat.equation_context(n.eqn):
                    n._plain = _checked(n, n.bind(n.eqn, args, n.kinds))
    return node._plain


def settle_plain(x: Any) -> Any:
    return _plain(x) if isinstance(x, Link) else x


def settle(x: Any) -> Any:
    """``x``'s value, emitted if it is a link: recomputed in the backward pass where that
    keeps fewer bytes, else as written. Emitted once per link."""
    if not isinstance(x, Link):
        return x
    if isinstance(x, RegionLink):
        return x.emitted()  # the region's own checkpoint keeps no more than its inputs
    if x._alone is None:
        if x._plain is not None:
            return x._plain
        order, leaves = _walk([x])
        if _worth_it(order, leaves, 0):
            _keep(_recomputed_from(order))
            x._alone = _checkpointed(
                order, leaves, lambda value_of: value_of(x), lambda ref: ("alone", ref(x))
            )
        else:
            return _plain(x)
    return x._alone


def into_product(
    eqn: Any, invals: Sequence[Any], bind: Callable[[Sequence[Any]], Any], kinds: Sequence[int]
) -> Any:
    """The matrix product ``eqn`` of ``invals`` (some of them links, their kinds ``kinds``),
    bound by ``bind`` together with the chains feeding it in one checkpoint where that keeps
    fewer bytes; else with its chains settled."""
    roots = [x for x in invals if isinstance(x, Link)]
    order, leaves = _walk(roots)
    if any(r._plain is not None for r in roots) or not _worth_it(
        order, leaves, sum(r.nbytes for r in roots)
    ):
        return bind([settle(x) for x in invals])
    known = {id(x) for x in leaves}
    for x in map(_undeferred, invals):
        if not isinstance(x, Link) and not _is_constant(x) and id(x) not in known:
            known.add(id(x))
            leaves.append(x)
    _keep(leaves)  # the product's gradients read the chain's value: all of it is recomputed
    return _checkpointed(
        order,
        leaves,
        lambda value_of: bind([value_of(x) for x in invals]),
        lambda ref: ("product", regions.equation_key(eqn), tuple(map(ref, invals)), tuple(kinds)),
    )
