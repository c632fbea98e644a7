"""Where an optimizer state's arrays go: each beside the parameter it belongs to."""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from autocast._src.state.blocks import BlockScaled


def _spec(sharding: NamedSharding, ndim: int) -> tuple:
    spec = tuple(sharding.spec)
    return spec + (None,) * (ndim - len(spec))


def state_shardings(state: Any, params: Any) -> Any:
    """Shardings that put an optimizer state's arrays where their parameters are.

    A state leaf belongs to a parameter when the parameter's path in ``params`` ends the
    leaf's path in ``state`` (Adam's ``mu["w"]`` belongs to ``params["w"]``) and it has the
    parameter's shape; it gets the parameter's sharding. The 8-bit form of such a leaf
    (:class:`BlockScaled`) is split as its parameter is along the leading axes, its blocks
    kept whole: codes ``P(*leading, None, None)``, scales ``P(*leading, None)``. Every other
    leaf (counts, keys, scalars) is replicated over the parameters' mesh. Give the result to
    ``jax.jit(tx.init, out_shardings=...)``, so that an FSDP job makes each device's share
    of the state and nothing more, and so that a checkpoint restored into that state
    returns each shard where it was.

    Args:
        state: The optimizer state, or its shapes (``jax.eval_shape(tx.init, params)``).
        params: The parameters, as arrays or ``jax.ShapeDtypeStruct``s, each with a
            ``NamedSharding`` (all on one mesh).

    Returns:
        A tree of ``NamedSharding``s with ``state``'s structure.

    Raises:
        ValueError: If no parameter has a ``NamedSharding``.

    Example:
        >>> import autocast.optax, jax, jax.numpy as jnp, numpy as np, optax
        >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        >>> mesh = Mesh(np.array(jax.devices()[:1]), ("d",))
        >>> params = {"w": jax.device_put(jnp.ones((4, 300)), NamedSharding(mesh, P("d", None)))}
        >>> tx = autocast.optax.low_precision_state(optax.adam(1e-3), jnp.float8_e4m3fn)
        >>> where = autocast.optax.state_shardings(jax.eval_shape(tx.init, params), params)
        >>> state = jax.jit(tx.init, out_shardings=where)(params)
        >>> [tuple(s.sharding.spec) for s in (state.inner[0].mu["w"].codes, state.inner[0].count)]
        [('d', None, None), ()]
    """
    found = [
        (tuple(path), leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
        if isinstance(getattr(leaf, "sharding", None), NamedSharding)
    ]
    if not found:
        raise ValueError(
            "state_shardings needs parameters placed with a NamedSharding (jax.device_put "
            "with NamedSharding(mesh, spec), or ShapeDtypeStructs with sharding=)"
        )
    replicated = NamedSharding(found[0][1].sharding.mesh, P())

    def owner(path: tuple, shape: tuple) -> Any:
        best = None
        for p_path, leaf in found:
            if tuple(leaf.shape) != tuple(shape) or len(p_path) > len(path):
                continue
            if path[len(path) - len(p_path) :] == p_path and (
                best is None or len(p_path) > len(best[0])
            ):
                best = (p_path, leaf)
        return None if best is None else best[1].sharding

    def one(path: Any, leaf: Any) -> Any:
        path = tuple(path)
        if isinstance(leaf, BlockScaled):
            sharding = owner(path, leaf.shape)
            if sharding is None:
                return BlockScaled(replicated, replicated, leaf.size, leaf.root)
            lead = _spec(sharding, len(leaf.shape))[:-1]
            return BlockScaled(
                NamedSharding(sharding.mesh, P(*lead, None, None)),
                NamedSharding(sharding.mesh, P(*lead, None)),
                leaf.size,
                leaf.root,
            )
        if not hasattr(leaf, "shape"):
            return replicated
        return owner(path, leaf.shape) or replicated

    return jax.tree_util.tree_map_with_path(
        one, state, is_leaf=lambda x: isinstance(x, BlockScaled)
    )
