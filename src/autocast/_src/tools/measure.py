"""Measures of what mixed precision did to a program, read off its jaxpr, and how
far its results moved from float32's.

Used by the tests, the benchmarks and the report. Everything here is backend-independent:
shapes, dtypes and values, not timings.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp

from autocast import _compat
from autocast._src.jaxprs import equations
from autocast._src.tree import is_floating_dtype

_REMAT_NAMES = frozenset({"remat2", "checkpoint"})
# scaled_dot: a block-scaled float8 product (compute_dtype="mxfp8")
MATMUL_NAMES = frozenset(
    {"dot_general", "scaled_dot", "conv_general_dilated", "ragged_dot_general", "ragged_dot"}
)


def matmul_flops(eqn: Any) -> int:
    """Multiply-add FLOPs (counted as 2) of a ``dot_general`` or convolution equation."""
    out = eqn.outvars[0].aval
    lhs, rhs = (v.aval for v in eqn.invars[:2])
    name = eqn.primitive.name
    if name in ("dot_general", "scaled_dot"):
        (contract_lhs, _), _ = eqn.params["dimension_numbers"]
        return 2 * math.prod(out.shape) * math.prod(lhs.shape[d] for d in contract_lhs)
    if name == "conv_general_dilated":
        dn = eqn.params["dimension_numbers"]
        kernel_spatial = [rhs.shape[d] for d in dn.rhs_spec[2:]]
        in_features = rhs.shape[dn.rhs_spec[1]]
        return 2 * math.prod(out.shape) * math.prod(kernel_spatial) * in_features
    # ragged dots: bound by the dense equivalent
    return 2 * math.prod(out.shape) * lhs.shape[-1]


def flop_counts_where(jaxpr: Any, which: Callable[[list[Any]], bool]) -> tuple[int, int]:
    """``(chosen, total)``: FLOPs of the matmul/conv equations for whose operand dtypes
    ``which`` holds, and of all of them."""
    total = chosen = 0
    for eqn in equations(jaxpr):
        if eqn.primitive.name not in MATMUL_NAMES:
            continue
        flops = matmul_flops(eqn)
        total += flops
        if which([v.aval.dtype for v in eqn.invars[:2]]):
            chosen += flops
    return chosen, total


def matmul_flop_counts(jaxpr: Any, bits: int = 16) -> tuple[int, int]:
    """``(low, total)``: matmul/conv FLOPs whose operands have at most ``bits`` bits, and all."""
    return flop_counts_where(jaxpr, at_most_bits(bits))


def at_most_bits(bits: int) -> Callable[[list[Any]], bool]:
    """The operand test of :func:`matmul_flop_counts`: every operand has at most ``bits`` bits."""
    return lambda dtypes: all(d.itemsize * 8 <= bits for d in dtypes)


def flop_shares(
    forward: Any, both: Any | None, which: Callable[[list[Any]], bool]
) -> dict[str, Any]:
    """``{"forward": ..., "backward": ...}``: the share of matmul/conv FLOPs for whose operand
    dtypes ``which`` holds, in the jaxpr ``forward`` and in what the jaxpr ``both`` (forward
    and backward pass) adds to it; None where there are no such FLOPs or no ``both``."""
    chosen, total = flop_counts_where(forward, which)
    shares: dict[str, Any] = {"forward": chosen / total if total else None, "backward": None}
    if both is not None:
        chosen_all, total_all = flop_counts_where(both, which)
        back = total_all - total
        shares["backward"] = (chosen_all - chosen) / back if back else None
    return shares


def low_precision_flop_share(jaxpr: Any, bits: int = 16) -> float:
    """Share of matmul/conv FLOPs whose operands are all floats of at most ``bits`` bits."""
    low, total = matmul_flop_counts(jaxpr, bits)
    return low / total if total else float("nan")


def float_casts(jaxpr: Any) -> list[Any]:
    """The ``convert_element_type`` equations that change one floating dtype into another."""
    return [
        eqn
        for eqn in equations(jaxpr)
        if eqn.primitive.name == "convert_element_type"
        and is_floating_dtype(eqn.invars[0].aval.dtype)
        and is_floating_dtype(eqn.outvars[0].aval.dtype)
        and eqn.invars[0].aval.dtype != eqn.outvars[0].aval.dtype
    ]


def bytes_accessed(fn: Callable[..., Any], *args: Any) -> float:
    """Bytes the compiled ``jax.jit(fn)`` reads and writes, by XLA's cost analysis: a
    CPU-side proxy for the memory traffic a GPU step pays for (quantisation passes, casts)."""
    cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    if isinstance(cost, (list, tuple)):  # one entry per program in older JAX
        cost = cost[0]
    return float(cost["bytes accessed"])


# Float8 types that hold scales (MXFP8's power-of-two exponents), not quantised tensors.
SCALE_TYPES = frozenset({"float8_e8m0fnu"})


def float8_casts(jaxpr: Any) -> int:
    """Conversions to a float8 type: one per tensor quantised, each a pass over it (a block
    scale's conversion to ``float8_e8m0fnu`` is none)."""
    return sum(
        eqn.outvars[0].aval.dtype.itemsize == 1
        and eqn.outvars[0].aval.dtype.name not in SCALE_TYPES
        for eqn in float_casts(jaxpr)
    )


def _levels(jaxpr: Any) -> Iterator[Any]:
    """``jaxpr`` (open) and each of its sub-jaxprs, each once."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    yield jaxpr
    for eqn in jaxpr.eqns:
        for sub in _compat.sub_jaxprs(eqn):
            yield from _levels(sub)


def serial_quantisations(jaxpr: Any) -> int:
    """Quantisations to float8 that wait for an amax of a tensor of their own shape, taken in
    the same program: current scaling's two passes, a reduction and then the rounding, which
    cannot fuse into the kernel that produced the tensor. Delayed scaling's quantisations wait
    only for a history and count 0. The search follows each quantisation's inputs back within
    its jaxpr, stopping at matrix products, for a ``reduce_max`` of an ``abs`` of that shape
    (a softmax's plain maximum is no amax; a call or loop is not looked into)."""
    count = 0
    for level in _levels(jaxpr):
        producer = {v: eqn for eqn in level.eqns for v in eqn.outvars}
        absolute = {eqn.outvars[0] for eqn in level.eqns if eqn.primitive.name == "abs"}
        for eqn in level.eqns:
            if not (
                eqn.primitive.name == "convert_element_type"
                and eqn.outvars[0].aval.dtype.itemsize == 1
                and is_floating_dtype(eqn.outvars[0].aval.dtype)
            ):
                continue
            shape, seen = tuple(eqn.outvars[0].aval.shape), set()
            stack = [v for v in eqn.invars if not isinstance(v, _compat.Literal)]
            while stack:
                v = stack.pop()
                src = producer.get(v)
                if src is None or id(src) in seen or src.primitive.name in MATMUL_NAMES:
                    continue
                seen.add(id(src))
                if (
                    src.primitive.name == "reduce_max"
                    and src.invars[0] in absolute
                    and tuple(src.invars[0].aval.shape) == shape
                ):
                    count += 1
                    break
                stack.extend(x for x in src.invars if not isinstance(x, _compat.Literal))
    return count


def count_casts(jaxpr: Any) -> int:
    """Number of casts from one floating dtype to another, sub-jaxprs included."""
    return len(float_casts(jaxpr))


def recompute_casts(jaxpr: Any) -> int:
    """Casts inside the backward pass's recomputations that amp adds: those that widen a
    16-bit input in a wide region (:mod:`autocast._src.transform.regions`), the price of
    keeping the 16-bit input as the residual instead of its float32 copy, and every cast in
    a recomputed chain (:mod:`autocast._src.transform.recompute`), where a matrix product's
    float32 weight is kept and cast again instead of its 16-bit copy. XLA fuses the first
    kind into the kernel that consumes it.

    Meaningful on the jaxpr of a gradient, where a region's forward equations stand inlined
    and only its recomputation remains a checkpoint."""
    from autocast._src.transform.recompute import recompute_chain
    from autocast._src.transform.regions import keep_statistics

    count = 0
    for eqn in equations(jaxpr):
        if eqn.primitive.name not in _REMAT_NAMES:
            continue
        policy = eqn.params.get("policy")
        if policy is keep_statistics:
            count += sum(
                1
                for e in float_casts(eqn.params["jaxpr"])
                if e.invars[0].aval.dtype.itemsize < e.outvars[0].aval.dtype.itemsize
            )
        elif policy is recompute_chain:
            count += len(float_casts(eqn.params["jaxpr"]))
    return count


def wasted_casts(jaxpr: Any) -> int:
    """Casts that undo a cast: ``a -> b -> a`` with nothing in between (round trips)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    return _wasted(jaxpr)


def _wasted(jaxpr: Any) -> int:
    producer = {}
    waste = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "convert_element_type":
            src = eqn.invars[0]
            before = producer.get(src) if not isinstance(src, _compat.Literal) else None
            if before is not None and before.invars[0].aval.dtype == eqn.outvars[0].aval.dtype:
                if is_floating_dtype(eqn.outvars[0].aval.dtype):
                    waste += 1
            producer[eqn.outvars[0]] = eqn
        for sub in _compat.sub_jaxprs(eqn):
            waste += _wasted(sub)
    return waste


def residual_bytes(fn: Callable[..., Any], *args: Any, include_inputs: bool = True) -> int:
    """Bytes of the residuals ``jax.vjp`` keeps for the backward pass of ``fn`` at ``args``.

    With ``include_inputs=False``, residuals that are arguments passed through unchanged (a
    float32 weight a checkpointed layer will need again) are left out: they are alive anyway,
    so what remains is the activation memory the forward pass adds. Computed abstractly:
    nothing runs.
    """

    def residuals(*a: Any) -> Any:
        return jax.tree_util.tree_leaves(jax.vjp(fn, *a)[1])

    jaxpr = jax.make_jaxpr(residuals)(*args).jaxpr
    inputs = set(jaxpr.invars)
    return sum(
        math.prod(v.aval.shape) * v.aval.dtype.itemsize
        for v in jaxpr.outvars
        if include_inputs or isinstance(v, _compat.Literal) or v not in inputs
    )


def relative_error(got: Any, want: Any) -> float:
    """Relative L2 error of the pytree ``got`` against ``want``, over all leaves at once,
    computed in float32 (a 16-bit ``got`` is compared as it is)."""
    got, want = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
    num = sum(float(jnp.sum((jnp.asarray(g, jnp.float32) - w) ** 2)) for g, w in zip(got, want))
    den = sum(float(jnp.sum(jnp.asarray(w, jnp.float32) ** 2)) for w in want)
    return (num / den) ** 0.5


def planned_peak_bytes(compiled: Any) -> int | None:
    """The compiled program's peak memory as XLA plans it: its own figure where the JAX
    version reports one, else :func:`planned_sum_bytes`; None where the backend plans none."""
    stats = compiled.memory_analysis()
    peak = getattr(stats, "peak_memory_in_bytes", 0)
    return int(peak) if peak else planned_sum_bytes(stats)


def planned_sum_bytes(stats: Any) -> int | None:
    """Arguments + outputs + temporaries - aliased buffers of a memory plan (a compiled
    program's ``memory_analysis()``; what ``make gpu-plan`` calls the planned peak, on every
    JAX version); None for None, a backend that plans none."""
    if stats is None:
        return None
    return int(
        stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        + stats.temp_size_in_bytes
        - stats.alias_size_in_bytes
    )
