"""Delayed float8 scaling: amax histories threaded through the train step.

Current scaling (``amp(fn, compute_dtype="fp8")``) quantises each operand with a scale taken
from that very tensor: a reduction over the tensor, then a second pass that divides and rounds
it, which cannot start before the reduction ends. Delayed scaling, Transformer Engine's
default, takes the scale from the largest amax of the last ``history`` steps instead, so the
quantisation needs nothing but the tensor and can fuse into the kernel that produces it. This
step's amax is still taken, beside the quantisation rather than before it, and joins the
history.

The histories are state, so they are an argument: :func:`amp_fp8_delayed` gives ``fn`` a first
argument more, an :class:`Fp8History`, and the gradient with respect to it *is* the next
history (Flax's "overwrite with gradient" convention for float8 metadata). Products take
histories where ``amp`` can thread them: the function's own equations, plain ``jax.jit`` calls
it inlines, checkpoints (the histories become inputs of the checkpoint) and ``scan`` bodies
(one history per iteration, stacked on a leading axis like any scanned input, so each layer of
a scanned model has its own). A ``while_loop`` has no iteration count to stack by, a branch
of ``cond`` would leave the untaken branch's histories without a gradient, and custom
derivative rules and other calls are traced once for every call: products there keep current
scaling.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from autocast import _compat
from autocast._src.fp8 import products as fp8
from autocast._src.jaxprs import equations
from autocast._src.transform import amp as _amp
from autocast._src.transform.histories import Slots, inbox_shape


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["amax", "inbox", "loss_scale", "measured_rows", "program_id"],
    meta_fields=["measured", "program"],
)
@dataclasses.dataclass(frozen=True)
class Fp8History:
    """The amax histories of the float8 products that :func:`amp_fp8_delayed` scales.

    ``amax`` holds one float32 array of shape ``(3, history)`` per product, in the order the
    program runs them: rows for the left operand, the right operand and the output gradient,
    newest first, each entry the power of two at or above a step's amax; a product in a ``scan``
    body has one per iteration, ``(length, 3, history)``. ``inbox`` holds zeros of shape
    ``(3, 280)`` per product (stacked alike): the gradient with respect to it is what the
    step measured, which :meth:`advance` turns into the next history. ``measured`` (static)
    flags, per product, the rows ``init`` could measure (an amax above zero reached them); a
    row it could not keeps current scaling. ``program`` (static) names the program ``init``
    measured, so that a history is never used by another function. A checkpoint saves leaves
    only, so both are kept in leaves as well: ``measured_rows`` holds per product an array of
    ones whose shape spells its flags (``(2, 2, 1)`` for ``(True, True, False)``: 2 where
    measured), and ``program_id`` the program's digest as four 16-bit numbers. A history whose
    ``measured_rows`` disagrees with its ``measured`` (leaves restored into the structure of
    another history) is refused when it is built, even under ``jax.jit``; rebuild a restored
    history with :meth:`DelayedFp8.restore`. ``loss_scale`` is the loss
    scale the gradient rows were measured under (1 from ``init``): output gradients grow with
    the loss scale, so :meth:`at_loss_scale` moves those rows with it, which the loss scalers'
    ``dynamic_scale_grad`` and ``dynamic_scale_value_and_grad`` do at every step. Make one
    with ``init``.

    Example:
        >>> import autocast, jax, jax.numpy as jnp
        >>> f = autocast.amp_fp8_delayed(lambda w, x: (x @ w).sum(), history=4)
        >>> w, x = jnp.ones((16, 16)), jnp.full((16, 16), 3.0)
        >>> h = f.init(w, x)
        >>> len(h.amax), h.amax[0].shape, h.amax[0][:, 0].tolist()
        (1, (3, 4), [4.0, 1.0, 1.0])
        >>> h = h.advance(jax.grad(f)(h, w, 5 * x))   # newest first: 16 > 15
        >>> h.amax[0][0].tolist()
        [16.0, 4.0, 4.0, 4.0]
    """

    amax: tuple[Any, ...]
    inbox: tuple[Any, ...]
    measured: tuple[tuple[bool, bool, bool], ...]
    program: str = ""
    loss_scale: Any = 1.0
    measured_rows: tuple[Any, ...] | None = None
    program_id: Any = None

    def __post_init__(self) -> None:
        # Runs whenever the history is rebuilt from leaves (tree_unflatten calls the class):
        # after a checkpoint library restored leaves into another history's structure, its
        # static measured would silently switch rows between current and delayed scaling.
        # Shapes are known everywhere (tracers, abstract values), so the check needs no sync.
        if self.measured_rows is None:
            return
        for i, (flags, rows) in enumerate(zip(self.measured, self.measured_rows)):
            shape = getattr(rows, "shape", None)
            if shape is None or len(shape) < 3:
                continue  # a tree utility's placeholder, not an array
            if tuple(shape[-3:]) != _rows_shape(flags):
                raise ValueError(
                    f"Fp8History: product {i} is built as measured {flags}, but its "
                    f"measured_rows (the leaf that keeps measured through a checkpoint) say "
                    f"{_flags_of(shape[-3:])}: the leaves were restored into the structure of "
                    "another history (init on other arguments, such as trained parameters, "
                    "measures other rows). Rebuild a restored history with "
                    "DelayedFp8.restore(saved, *args), which reads measured from the leaves"
                )

    def at_loss_scale(self, scale: Any) -> Fp8History:
        """This history for a step whose loss is multiplied by ``scale``: the output-gradient
        rows multiplied by ``scale`` over the loss scale they were measured under, as the
        gradients themselves will be. Without it, a history measured without a loss scale
        would scale a float16 run's gradients, 2**15 times larger, into saturation.

        ``autocast.dynamic_scale_grad`` and ``dynamic_scale_value_and_grad`` call it with
        their state's scale; with a loss scale applied by hand (jmp's objects, the optax
        face's ``loss_scale_of(state).scale``), call it before the step.

        Args:
            scale: The loss scale of the coming step, a positive scalar.

        Returns:
            The history with its gradient rows and ``loss_scale`` at ``scale``.

        Example:
            >>> import autocast, jax.numpy as jnp
            >>> f = autocast.amp_fp8_delayed(lambda w, x: (x @ w).sum(), history=2)
            >>> h = f.init(jnp.ones((16, 16)), jnp.ones((16, 16)))
            >>> h.amax[0][2].tolist(), h.at_loss_scale(2.0**15).amax[0][2].tolist()
            ([1.0, 1.0], [32768.0, 32768.0])
        """
        scale = jnp.asarray(scale, jnp.float32)
        ratio = scale / jnp.asarray(self.loss_scale, jnp.float32)
        amax = tuple(h.at[..., 2, :].multiply(ratio) for h in self.amax)
        return dataclasses.replace(self, amax=amax, loss_scale=scale)

    def advance(self, grad: Fp8History) -> Fp8History:
        """The next history: each product's newest amaxes, from ``grad`` (the gradient of the
        wrapped function with respect to this history), pushed in and the oldest dropped. A
        product that ``grad`` has nothing from (its backward pass did not run, or met an inf
        or NaN) keeps its history as it was.

        However many times the history was used in the step (called twice, under ``vmap``,
        over microbatches, on every device of a ``shard_map``), the newest entry is the
        largest amax of all of them.

        Args:
            grad: The gradient with respect to this history.

        Returns:
            The history for the next step.

        Raises:
            TypeError: If ``grad`` is no :class:`Fp8History` of the same products.
        """
        if not isinstance(grad, Fp8History) or len(grad.inbox) != len(self.inbox):
            raise TypeError(
                "Fp8History.advance takes the gradient with respect to this history (an "
                f"Fp8History with {len(self.inbox)} products), got {type(grad).__name__}"
            )
        for i, (mine, theirs) in enumerate(zip(self.inbox, grad.inbox)):
            if np.shape(mine) != np.shape(theirs):
                raise TypeError(
                    f"Fp8History.advance: product {i}'s gradient has shape {np.shape(theirs)}, "
                    f"the history's inbox {np.shape(mine)}: give the gradient of one step "
                    "(per-example gradients from vmap must be summed first)"
                )
        # the gradient's amaxes were taken under the loss scale its loss_scale names (a loss
        # scaler's face sets it; jax.grad gives 0 there: under this history's own)
        under = jnp.asarray(0.0 if grad.loss_scale is None else grad.loss_scale, jnp.float32)
        own = jnp.asarray(self.loss_scale, jnp.float32)
        ratio = jnp.where(under > 0, own / jnp.where(under > 0, under, 1.0), 1.0)
        return dataclasses.replace(
            self, amax=tuple(_pushed(h, g, ratio) for h, g in zip(self.amax, grad.inbox))
        )

    def measured_under(self, scale: Any) -> Fp8History:
        """This gradient of a history, marked as taken in a step whose loss was multiplied by
        ``scale`` (the loss scalers' faces mark the gradients they return), so that
        :meth:`advance` brings its output-gradient amaxes to the history's own loss scale."""
        return dataclasses.replace(self, loss_scale=jnp.asarray(scale, jnp.float32))


def _rows_shape(flags: Sequence[bool]) -> tuple[int, ...]:
    """The shape of a product's ``measured_rows`` leaf: 2 for a measured row, 1 for another."""
    return tuple(2 if f else 1 for f in flags)


def _flags_of(shape: Sequence[int]) -> tuple[bool, ...]:
    return tuple(int(n) == 2 for n in shape)


def _program_words(program: str) -> np.ndarray:
    """A program's 64-bit digest as four 16-bit numbers, each exact in float32 (a leaf must be
    floating for ``jax.grad`` to take the history as an argument)."""
    return np.array([int(program[i : i + 4], 16) for i in range(0, 16, 4)], np.float32)


def _host(x: Any) -> np.ndarray:
    """A small replicated leaf's value on this host (a multi-process array is not fully
    addressable, but each process holds a full copy)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        x = x.addressable_data(0)
    return np.asarray(x)


def _pushed(history: Any, inbox: Any, ratio: Any) -> Any:
    bound, held = fp8.bins_bound(inbox[..., : fp8.BINS])
    bound = bound.at[..., 2].multiply(ratio)
    shifted = jnp.concatenate([bound[..., None], history[..., :-1]], axis=-1)
    return jnp.where(held[..., None], shifted, history)


def _cotangent(x: Any) -> Any:
    """Ones for a floating output, float0 zeros for any other (``jax.vjp``'s convention)."""
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.ones_like(x)
    return np.zeros(np.shape(x), jax.dtypes.float0)


# Equations that say where a value lives, not what is computed: shard_map's tracing adds them
# (with varying-axis annotations on the types) where the same function traced outside has none,
# and hands each literal to its equation through one (a pvary of 0.5), so the digest reads a
# placement's outputs as its inputs.
_PLACEMENT = frozenset(
    {"pvary", "pbroadcast", "sharding_constraint", "mesh_cast", "reshard", "device_put"}
)

# Equations that move or convert a value without computing with it, between a sum and the
# division that makes it a mean (jnp.mean of bfloat16 sums in float32; jnp.var keeps dims).
_MOVES = _PLACEMENT | {"convert_element_type", "broadcast_in_dim", "reshape", "squeeze", "copy"}


class _Program:
    """A traced program's equations with, for each variable, the equation that made it, so
    that a literal is read through placements and a divisor traced back to its sum."""

    def __init__(self, jaxpr: Any) -> None:
        self.eqns = list(equations(jaxpr))
        self.made_by = {v: e for e in self.eqns for v in e.outvars}

    def source(self, v: Any, through: frozenset = _PLACEMENT) -> Any:
        """``v`` with the equations in ``through`` (one input, one output) looked through."""
        while not isinstance(v, _compat.Literal):
            eqn = self.made_by.get(v)
            if eqn is None or eqn.primitive.name not in through or len(eqn.outvars) != 1:
                return v
            v = eqn.invars[0]
        return v

    def reduced_sizes(self, v: Any) -> set[float]:
        """The sizes a mean of ``v`` may divide by: every product of the axes summed by the
        ``reduce_sum`` that ``v`` is (through data movement); none where it is no sum."""
        eqn = self.made_by.get(self.source(v, _MOVES))
        if eqn is None or eqn.primitive.name != "reduce_sum":
            return set()
        shape = tuple(eqn.invars[0].aval.shape)
        axes = [shape[a] for a in eqn.params.get("axes", ())]
        return {
            float(np.prod([d for i, d in enumerate(axes) if n >> i & 1]))
            for n in range(1, 1 << len(axes))
        }

    def literal(self, v: Any) -> Any:
        """The literal ``v`` is, through placements and conversions (newer JAX's shard_map
        converts each weak-typed literal after its pvary), or None where it is no literal."""
        v = self.source(v, _PLACEMENT | {"convert_element_type"})
        return v if isinstance(v, _compat.Literal) else None

    def literal_site(self, eqn: Any, i: int) -> tuple[int, int, Any] | None:
        """Where input ``i`` of ``eqn``, followed back through data movement, is a literal: the
        equation (its id) and position that hold it, as the digest reads them, and the
        literal."""
        while True:
            literal = self.literal(eqn.invars[i])
            if literal is not None:
                return id(eqn), i, literal
            made = self.made_by.get(self.source(eqn.invars[i]))
            if made is None or made.primitive.name not in _MOVES or len(made.outvars) != 1:
                return None
            eqn, i = made, 0

    def divisor_sites(self) -> set[tuple[int, int]]:
        """The literals that are a mean's divisor: ``n`` in ``s / n`` (or in ``s / (n - ddof)``,
        jnp.var's) where ``s`` is a ``reduce_sum`` and ``n`` a product of the axes it summed.
        The batch sets them, so they are no constant of the program; a literal elsewhere is
        one, whatever size it equals (a GELU's 1.0 at a batch of one)."""
        sites = set()
        for eqn in self.eqns:
            if eqn.primitive.name != "div" or len(eqn.invars) != 2:
                continue
            sizes = self.reduced_sizes(eqn.invars[0])
            if not sizes:
                continue
            site = self.literal_site(eqn, 1)
            if site is None:  # n - ddof
                divisor = self.source(eqn.invars[1], _MOVES)
                made = None if isinstance(divisor, _compat.Literal) else self.made_by.get(divisor)
                if made is not None and made.primitive.name == "sub":
                    site = self.literal_site(made, 0)
            if site is None:
                continue
            value = np.asarray(_compat.literal_value(site[2]))
            if value.shape == () and np.issubdtype(value.dtype, np.floating):
                x = float(value)
                if any(abs(x - n) <= 1e-6 * n for n in sizes):
                    sites.add(site[:2])
        return sites

    def constant(self, literal: Any) -> str | None:
        """A scalar floating literal as the digest spells it; None for any other literal."""
        value = np.asarray(_compat.literal_value(literal))
        if value.shape != () or not np.issubdtype(value.dtype, np.floating):
            return None
        x = float(value)
        return repr(x) if x == 0 or not np.isfinite(x) else repr(float(np.float32(x)))


def program_of(traced: Any) -> str:
    """A name for the program a history belongs to: a digest of its equations in order (with
    sub-jaxprs), each as its primitive, the dtypes of its outputs and its floating scalar
    constants (``0.01 * x`` and ``100.0 * x`` are two programs, whose amaxes differ by a
    factor of 10**4; a GELU's 0.5 and 1.0 are constants of its program). Shapes are left
    out, and so is a mean's divisor, which the batch sets: a literal ``n`` in ``s / n`` (or
    ``s / (n - ddof)``) where ``s`` is a ``reduce_sum`` and ``n`` a product of the axes it
    summed. So the same function on another batch size, one example under ``vmap``, or a
    device's shard under ``shard_map`` (whose placement equations, and the literals they
    carry, are read through) is the same program; a function that differs in any operation
    or other constant is another. Constants held in arrays (closed over, not literals) are
    left out."""
    program = _Program(traced.jaxpr)
    sizes = program.divisor_sites()
    parts = []
    for eqn in program.eqns:
        if eqn.primitive.name in _PLACEMENT or (
            eqn.primitive.name == "convert_element_type"
            and program.literal(eqn.invars[0]) is not None
        ):
            continue  # read as the literal by the equation that takes it
        constants = []
        for i, v in enumerate(eqn.invars):
            literal = program.literal(v)
            if literal is None:
                continue
            constants.append("size" if (id(eqn), i) in sizes else program.constant(literal))
        parts.append(
            f"{eqn.primitive.name}{[str(v.aval.dtype) for v in eqn.outvars]}"
            f"{[c for c in constants if c is not None]}"
        )
    return hashlib.sha256(";".join(parts).encode()).hexdigest()[:16]


class DelayedFp8:
    """What :func:`amp_fp8_delayed` returns: ``fn`` under amp's float8 recipe with delayed
    scaling, taking an :class:`Fp8History` first; ``init`` makes the first history and
    ``history`` is its length.

    Example:
        >>> import autocast, jax, jax.numpy as jnp
        >>> f = autocast.amp_fp8_delayed(lambda w, x: jnp.sum(jnp.tanh(x @ w)), history=8)
        >>> w, x = jnp.eye(16), jnp.ones((16, 16))
        >>> h = f.init(w, x)
        >>> value, (g_h, g_w) = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(h, w, x)
        >>> h = h.advance(g_h)
        >>> isinstance(f, autocast.DelayedFp8), f.history, h.amax[0].shape
        (True, 8, (3, 8))
    """

    def __init__(
        self, fn: Callable[..., Any], history: int, amp_policy: Any, has_aux: bool = False
    ) -> None:
        if isinstance(history, bool) or not isinstance(history, int) or history < 1:
            raise ValueError(f"amp_fp8_delayed: history must be an int >= 1, got {history!r}")
        self.history = history
        self.has_aux = bool(has_aux)
        recipe = dataclasses.replace(fp8.DEFAULT_RECIPE, history=history)
        self._amp = _amp._Amp(fn, None, amp_policy, delayed=recipe)
        self._programs: dict[int, tuple[Any, str]] = {}
        functools.update_wrapper(self, fn, updated=())

    def _program(self, traced: Any) -> str:
        """:func:`program_of` ``traced``, once per trace."""
        name = self._programs.get(id(traced))
        if name is None or name[0] is not traced:
            name = self._programs[id(traced)] = (traced, program_of(traced))
        return name[1]

    def _evaluate(
        self,
        traced: Any,
        ctx: Any,
        rows: Sequence[Any] | None,
        measuring: bool,
        dyn: Sequence[Any],
        measured: Sequence[tuple[bool, bool, bool]] | None = None,
    ) -> tuple[list, Slots]:
        """``traced`` evaluated under ``ctx`` with these histories handed to its products."""
        slots = Slots(rows, measuring, measured)
        outs = traced.evaluate(dataclasses.replace(ctx, fp8_history=slots))(*dyn)
        slots.check_all_taken()
        return outs, slots

    def __call__(self, state: Fp8History, *args: Any, **kwargs: Any) -> Any:
        if _amp._outer_amp_tracing():
            raise TypeError(
                "amp_fp8_delayed: called inside another amp, which would run it without its "
                "histories; call it outside amp"
            )
        if not isinstance(state, Fp8History):
            raise TypeError(
                f"amp_fp8_delayed: the first argument must be an Fp8History (from init), got "
                f"{type(state).__name__}"
            )
        ctx = self._amp._context(args, kwargs)
        traced, dyn = self._amp._traced_call(args, kwargs, ctx)
        program = self._program(traced)
        if state.program != program:
            raise ValueError(
                "amp_fp8_delayed: this Fp8History was made for another program (by the init of "
                "another function, or of this one on arguments of another structure), so its "
                "amaxes say nothing of this one's products; make it with this function's init"
            )
        rows = list(zip(state.amax, state.inbox))
        arrays = (*state.amax, *state.inbox, *dyn)
        if not any(isinstance(x, jax.core.Tracer) for x in arrays):
            # concrete values: one compiled program, as amp itself runs them
            key = ("fp8_history", ctx.scopes, state.measured)
            compiled = traced.compiled.get(key)
            if compiled is None:
                compiled = traced.compiled[key] = jax.jit(
                    lambda rows, *dyn: self._evaluate(
                        traced, ctx, rows, False, dyn, state.measured
                    )[0]
                )
            return traced.rebuild(compiled(rows, *dyn))
        return traced.rebuild(self._evaluate(traced, ctx, rows, False, dyn, state.measured)[0])

    def init(self, *args: Any, **kwargs: Any) -> Fp8History:
        """The first :class:`Fp8History` for calls with arguments shaped like these: every
        history filled with what one step measures on them (a forward pass, and a backward
        pass from ones on every floating output). A row it cannot measure keeps current
        scaling: every row of a product no gradient reaches (under ``stop_gradient``, or
        feeding only integer outputs), and a row whose tensor is all zeros there (a
        zero-initialised layer's weights, and the gradients that meet them), as its history
        would say nothing of the range to come. With ``has_aux``, only the first output is
        differentiated, as ``jax.grad`` will.

        Raises:
            TypeError: Under ``jax.jit`` or another transformation: what is measured decides
                the history's static structure, so it needs concrete arguments (``init``
                compiles its own step).
        """
        ctx = self._amp._context(args, kwargs)
        traced, dyn = self._amp._traced_call(args, kwargs, ctx)
        if any(isinstance(x, jax.core.Tracer) for x in dyn):
            raise TypeError(
                "amp_fp8_delayed: init needs concrete arguments, not tracers (call it outside "
                "jax.jit; it compiles its own step)"
            )
        shapes = self._shapes(traced, ctx, dyn)

        # compiled, as the train step will be: XLA's fused elementwise code may round
        # differently from one dispatch per operation, and the amaxes should be the step's
        @jax.jit
        def measure(*dyn: Any) -> tuple:
            histories = [jnp.zeros(s, jnp.float32) for s in shapes]
            inboxes = tuple(jnp.zeros(inbox_shape(s), jnp.float32) for s in shapes)

            def run(inboxes: tuple) -> list:
                outs = self._evaluate(traced, ctx, list(zip(histories, inboxes)), True, dyn)[0]
                # with an aux, only the loss (the first output) is differentiated, so no
                # backward pass runs for a product that feeds the aux alone
                return outs[:1] if self.has_aux else outs

            outs, pullback = jax.vjp(run, inboxes)
            (got,) = pullback([_cotangent(x) for x in outs])
            bounds = [fp8.bins_bound(g[..., : fp8.BINS]) for g in got]
            filled = [jnp.broadcast_to(b[..., None], s) for (b, _), s in zip(bounds, shapes)]
            # a row is measured where it found an amax, in every iteration of a scan
            held = [jnp.all(h.reshape(-1, 3), axis=0) for _, h in bounds]
            return tuple(filled), tuple(held)

        filled, held = measure(*dyn)
        # _host: in a multi-process program the flags are replicated over devices that
        # this process cannot address, and every process holds a copy
        measured = tuple(tuple(bool(r) for r in _host(rows)) for rows in held)
        zeros = tuple(jnp.zeros(inbox_shape(s), jnp.float32) for s in shapes)
        program = self._program(traced)
        return Fp8History(
            tuple(filled),
            zeros,
            measured,
            program,
            jnp.float32(1.0),
            tuple(jnp.ones(_rows_shape(f), jnp.float32) for f in measured),
            jnp.asarray(_program_words(program)),
        )

    def _shapes(self, traced: Any, ctx: Any, dyn: Sequence[Any]) -> list[tuple[int, ...]]:
        """The history shape of each float8 product of ``traced``, in order (counted, not run)."""
        counted: list[Slots] = []

        def count(*dyn: Any) -> list:
            outs, slots = self._evaluate(traced, ctx, None, False, dyn)
            counted.append(slots)
            return outs

        jax.eval_shape(count, *dyn)
        return counted[0].shapes

    def restore(self, saved: Any, *args: Any, **kwargs: Any) -> Fp8History:
        """A history from a checkpoint, rebuilt for calls with arguments shaped like these:
        the one call to make after restoring one.

        A checkpoint keeps leaves only, and a history's structure (which rows ``init``
        measured, which program it belongs to) is static. ``restore`` reads both from the
        leaves that keep them (``measured_rows``, ``program_id``), so the restored history
        scales exactly the rows the saved one did, whatever ``init`` would measure now
        (``init`` on trained parameters measures rows that were all zeros at the start).

        Args:
            saved: The history's leaves as a checkpoint returned them: the tree a restore
                without a target gives (a mapping with ``amax``, ``inbox``, ``loss_scale``,
                ``measured_rows`` and ``program_id``), or an :class:`Fp8History`.
            *args: Arguments shaped like the calls' (after the history), as for ``init``;
                only their shapes, dtypes and structure matter.
            **kwargs: Keyword arguments, likewise.

        Returns:
            The :class:`Fp8History`, its leaves those of ``saved``.

        Raises:
            ValueError: If ``saved`` does not fit this function on such arguments: saved by
                another program, a history of another length, other products, or leaves
                without ``measured_rows`` and ``program_id`` (a history made by hand).

        Example:
            >>> import autocast, jax.numpy as jnp
            >>> f = autocast.amp_fp8_delayed(lambda w, x: (x @ w).sum(), history=4)
            >>> w, x = jnp.ones((16, 16)), jnp.ones((16, 16))
            >>> saved = {k: getattr(f.init(w, x), k) for k in
            ...          ("amax", "inbox", "loss_scale", "measured_rows", "program_id")}
            >>> f.restore(saved, w, x).measured
            ((True, True, True),)
            >>> g = autocast.amp_fp8_delayed(lambda w, x: (x @ w).max(), history=4)
            >>> g.restore(saved, w, x)
            Traceback (most recent call last):
            ...
            ValueError: amp_fp8_delayed.restore: this history was saved by another program ...
        """
        fields = ("amax", "inbox", "loss_scale", "measured_rows", "program_id")
        if isinstance(saved, Fp8History):
            saved = {k: getattr(saved, k) for k in fields}
        if (
            not hasattr(saved, "get")
            or saved.get("measured_rows") is None
            or saved.get("program_id") is None
        ):
            raise ValueError(
                "amp_fp8_delayed.restore: saved must be a history's leaves, with measured_rows "
                "and program_id (histories from init have them), as a mapping of its fields "
                f"or an Fp8History; got {type(saved).__name__}"
                + (f" with keys {sorted(saved)}" if hasattr(saved, "keys") else "")
            )
        ctx = self._amp._context(args, kwargs)
        traced, dyn = self._amp._traced_call(args, kwargs, ctx)
        program = self._program(traced)
        if not np.array_equal(_host(saved["program_id"]), _program_words(program)):
            raise ValueError(
                "amp_fp8_delayed.restore: this history was saved by another program (another "
                "function, or this one on arguments of another structure), so its amaxes say "
                "nothing of this one's products"
            )
        shapes = self._shapes(traced, ctx, dyn)
        amax, inbox, rows = (tuple(saved[k]) for k in ("amax", "inbox", "measured_rows"))
        got = [tuple(np.shape(h)) for h in amax]
        if (
            got != [tuple(s) for s in shapes]
            or len(inbox) != len(shapes)
            or len(rows) != len(shapes)
            or any(tuple(np.shape(b)) != inbox_shape(s) for b, s in zip(inbox, shapes))
        ):
            raise ValueError(
                f"amp_fp8_delayed.restore: the saved history's shapes {got} do not fit this "
                f"function's float8 products on these arguments, {[tuple(s) for s in shapes]} "
                f"(history={self.history}): restore it for the arguments it was saved with"
            )
        if any(len(np.shape(r)) != 3 or not set(np.shape(r)) <= {1, 2} for r in rows):
            raise ValueError(
                f"amp_fp8_delayed.restore: measured_rows of shapes {[np.shape(r) for r in rows]} "
                "are not a history's (one array of shape (1 or 2,) * 3 per product)"
            )
        measured = tuple(_flags_of(np.shape(r)) for r in rows)
        return Fp8History(
            amax, inbox, measured, program, saved["loss_scale"], rows, saved["program_id"]
        )


def amp_fp8_delayed(
    fn: Callable[..., Any], *, history: int = 16, amp_policy: Any = None, has_aux: bool = False
) -> DelayedFp8:
    """``amp(fn, compute_dtype="fp8")`` with *delayed* scaling: each float8 operand and output
    gradient is scaled by the largest amax of the last ``history`` steps, not by its own.

    The returned function takes an :class:`Fp8History` before ``fn``'s arguments; its
    ``init(*args)`` makes the first one. Differentiate with respect to the history as well as
    the parameters and pass that gradient to :meth:`Fp8History.advance` for the next history
    (it is not for an optimizer, nor for a loss scaler). A value above the history's range
    saturates at the format's largest, as in Transformer Engine; an inf or NaN still reaches
    the outputs and is kept out of the history.

    Products in ``scan`` bodies take one history per iteration (stacked) and those in
    checkpoints take theirs as inputs; those in while loops, branches and custom derivative
    rules keep current scaling (docs/fp8.md). First derivatives only, as with
    ``compute_dtype="fp8"``.

    Args:
        fn: The function to run, as for :func:`autocast.amp`.
        history: How many past steps' amaxes decide a scale (Transformer Engine's default is
            1024 with the largest taken; 16 follows a changing scale faster).
        amp_policy: A policy, as for :func:`autocast.amp`.
        has_aux: Whether ``fn`` returns ``(loss, aux)`` and the step differentiates the loss
            only (``jax.grad(..., has_aux=True)``): ``init`` then measures what the loss's
            gradient reaches, and products that only feed ``aux`` keep current scaling.

    Returns:
        A :class:`DelayedFp8`: ``f(history, *args, **kwargs)`` returns what ``fn`` returns, and
        ``f.init(*args, **kwargs)`` gives the first history.

    Raises:
        ValueError: If ``history`` is not an int >= 1, or a history does not fit the program
            (made by another function, or for other shapes).
        TypeError: If the first argument of a call is not an :class:`Fp8History`, or the
            function is called inside another ``amp``.

    Example:
        >>> import autocast, jax, jax.numpy as jnp
        >>> loss = autocast.amp_fp8_delayed(lambda w, x: jnp.mean((x @ w) ** 2), history=4)
        >>> w, x = jnp.eye(16), jnp.ones((16, 16))
        >>> h = loss.init(w, x)
        >>> g_h, g_w = jax.grad(loss, argnums=(0, 1))(h, w, x)
        >>> h = h.advance(g_h)
        >>> g_w.dtype, h.amax[0].shape
        (dtype('float32'), (3, 4))
    """
    return DelayedFp8(fn, history, amp_policy, has_aux)
