"""Picks: one element per row of a large array, differentiated without a scatter.

A classifier's loss picks each example's target from its log-probabilities
(``jnp.take_along_axis(logp, targets[..., None], axis=-1)``): a ``gather`` of one element per
row. JAX's derivative of a gather is a ``scatter-add`` of the cotangent into zeros the size
of the whole array, and a GPU compiler cannot fuse a scatter into the kernels around it: the
backward pass writes a float32 array of ``tokens x vocabulary`` (1.5 GiB for GPT-2 at 8192
tokens) only to read it back. Where each row gives exactly one element, the same derivative
is a select, ``where(iota == index, g, 0)``, which XLA computes inside the kernel that
consumes it. The forward pass is the gather as written.

Only gathers of that form are changed, and only under 16-bit compute (``compute_dtype``
float32 keeps the program bit for bit): every operand axis but one is a batch axis shared
with the indices, one index per row, slices of size one. The values are those of the
scatter, a zero of negative sign aside (``0 + (-0)`` is ``+0``; the select keeps ``-0``).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp

from autocast import _compat


def _picked_axis(eqn: Any) -> tuple[int, tuple[int, ...]] | None:
    """The operand axis a gather picks one element of per row, and the order of the index
    axes that lines them up with the operand's axes (the row of one standing for the picked
    axis); None when the gather is not of that form (see the module docstring)."""
    operand, indices = eqn.invars[0].aval, eqn.invars[1].aval
    if not jnp.issubdtype(operand.dtype, jnp.floating):
        return None
    rank = len(operand.shape)
    p = eqn.params
    dn = p["dimension_numbers"]
    batch = tuple(getattr(dn, "operand_batching_dims", None) or ())
    index_batch = tuple(getattr(dn, "start_indices_batching_dims", None) or ())
    if tuple(dn.offset_dims) or any(s != 1 for s in p["slice_sizes"]):
        return None
    if len(dn.start_index_map) != 1 or tuple(dn.collapsed_slice_dims) != tuple(dn.start_index_map):
        return None
    axis = dn.start_index_map[0]
    if sorted(batch) != [d for d in range(rank) if d != axis] or len(index_batch) != len(batch):
        return None
    # indices: the batch axes and one row of picks in some order, then the index vector
    if len(indices.shape) != rank + 1 or indices.shape[-1] != 1:
        return None
    (row,) = [d for d in range(rank) if d not in index_batch] or [None]
    if row is None or indices.shape[row] != 1:
        return None
    if any(indices.shape[i] != operand.shape[d] for d, i in zip(batch, index_batch)):
        return None
    order = tuple(row if d == axis else index_batch[batch.index(d)] for d in range(rank))
    return axis, order


def bind_equation(eqn: Any, invals: Sequence[Any], params: dict) -> Any:
    """``eqn`` bound as written, except a gather that picks one element per row: that one
    with the select as its derivative. For 16-bit compute only (see the module docstring)."""
    found = _picked_axis(eqn) if eqn.primitive.name == "gather" else None
    if found is None:
        return _compat.bind_equation(eqn, invals, params)
    axis, order = found
    operand, indices = invals
    mode = params["mode"]
    clip = "CLIP" in str(mode).upper()
    size = operand.shape[axis]

    def gathered(operand: Any, indices: Any) -> Any:
        return _compat.bind_equation(eqn, [operand, indices], params)

    @jax.custom_vjp
    def pick(operand: Any, indices: Any) -> Any:
        return gathered(operand, indices)

    def forward(operand: Any, indices: Any) -> tuple[Any, Any]:
        return gathered(operand, indices), (indices, jnp.zeros((), operand.dtype))

    def backward(saved: Any, g: Any) -> tuple[Any, None]:
        indices, zero = saved
        index = indices[..., 0]  # the batch axes and the row of one
        if clip:
            index = jnp.clip(index, 0, size - 1)
        # in the operand's order, the row of one where the picked axis is: both broadcast
        index, g = jnp.transpose(index, order), jnp.transpose(g, order)
        shape = list(g.shape)
        shape[axis] = size
        iota = jax.lax.broadcasted_iota(index.dtype, shape, axis)
        return jnp.where(iota == index, g, zero), None

    pick.defvjp(forward, backward)
    return pick(operand, indices)
