"""An optimizer's floating-point state stored in 16 or 8 bits and computed in float32:
:func:`low_precision_state` wraps any optax transformation."""

from __future__ import annotations

import functools
import sys
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax

from autocast._src.scaling.optax import LossScalingState
from autocast._src.state import bits as _bits
from autocast._src.state import blocks, order, rounding
from autocast._src.state.keys import StoredKey
from autocast._src.state.params import KahanState, StochasticRoundingState, refuse_8_bit_params
from autocast._src.tree import is_floating_array, map_floating

_STORABLE = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float32))
_ACCEPTED = "jnp.bfloat16, jnp.float8_e4m3fn (8 bits with a scale per block) or jnp.float32"
_WHY_NOT = {
    jnp.dtype(jnp.float16): (
        "float16 spans 6e-8 to 65504: Adam's second moment (squared gradients) underflows "
        "there and its first moment loses small gradients; bfloat16 has float32's range"
    ),
    jnp.dtype(jnp.float8_e5m2): (
        "e5m2 keeps 2 mantissa bits; with a scale per block e4m3's range is enough and it keeps 3"
    ),
}
# Leaves stored compactly: floating arrays with at least one axis whose dtype is one of
# these. Scalars (a step size in optax.inject_hyperparams, a loss scale) stay as they are.
_COMPACTABLE = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
SECOND_MOMENTS = ("nu", "nu_max", "sum_of_squares")
# An 8-bit float parameter cannot take a float32 update: the step would be lost or NaN.
_PARAMETERS = "are floats of 16 bits or more (the dtype low_precision_state takes is its state's)"


class LowPrecisionState(NamedTuple):
    """The state of :func:`low_precision_state`.

    Attributes:
        inner: The wrapped transformation's state, its floating-point arrays stored in the
            chosen form: bfloat16 arrays, or :class:`BlockScaled` for 8 bits. Integer leaves
            (Adam's count), scalars and other leaves are the inner state's own.
        key: The raw data (uint32) of the PRNG key that stochastic rounding of the state
            draws from, advanced at every update; None when rounding to nearest.

    Example:
        >>> import autocast.optax, jax.numpy as jnp, optax
        >>> tx = autocast.optax.low_precision_state(optax.adam(1e-3))
        >>> state = tx.init({"w": jnp.zeros((2, 3))})
        >>> adam = state.inner[0]
        >>> adam.count.dtype, adam.mu["w"].dtype, adam.nu["w"].dtype, state.key
        (dtype('int32'), dtype(bfloat16), dtype(bfloat16), None)
    """

    inner: Any
    key: Any = None


def _storage_dtype(dtype: Any) -> Any:
    try:
        d = jnp.dtype(dtype)
    except TypeError:
        d = None
    if d in _STORABLE:
        return d
    why = _WHY_NOT.get(d, "")
    raise TypeError(
        f"low_precision_state cannot store optimizer state in {dtype}"
        + (f" ({why})" if why else "")
        + f"; accepted: {_ACCEPTED}"
    )


def _steps(path: Any) -> tuple[str, ...]:
    """A key path an entry at a time, as ``keystr`` writes each."""
    return tuple(jax.tree_util.keystr((entry,)) for entry in path)


def _mirrors(state_paths: list[tuple[str, ...]], mirrored: frozenset) -> frozenset:
    """The prefixes of the state's paths under which the state mirrors the parameters
    (``mirrored``: each parameter's own path): every leaf below one ends in a parameter's
    path (Adam's ``.mu``; not ``[0]``, which also holds ``.count``)."""
    below: dict[tuple[str, ...], set[tuple[str, ...]]] = {}
    for steps in state_paths:
        for cut in range(len(steps) + 1):
            below.setdefault(steps[:cut], set()).add(steps[cut:])
    return frozenset(prefix for prefix, ends in below.items() if ends <= mirrored)


def _named(path: Any, steps: tuple[str, ...], names: frozenset[str], mirrors: frozenset) -> bool:
    """Whether a field on ``path`` (``steps``, as :func:`_steps` writes it) is one of
    ``names``, looking only above the parameter tree the state mirrors there (the shortest of
    ``mirrors`` on the path): Adam's first moment of a parameter named ``nu`` is
    ``mu['nu']``, and is not a second moment."""
    own = next((cut for cut in range(len(steps) + 1) if steps[:cut] in mirrors), len(steps))
    for entry in path[:own]:
        name = getattr(entry, "name", getattr(entry, "key", None))
        if isinstance(name, str) and name in names:
            return True
    return False


def _nonnegative_fields(paths: list[Any], params: Any, names: frozenset[str]) -> list[bool]:
    """For each of a state's leaf ``paths``, whether it lies in a field of ``names`` above
    the parameter tree (``params``: the parameters or the gradients, whose structure the
    state's moments mirror)."""
    steps = [_steps(path) for path in paths]
    own = frozenset(_steps(path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0])
    mirrors = _mirrors(steps, own)
    return [_named(path, s, names, mirrors) for path, s in zip(paths, steps)]


def _compactable(x: Any) -> bool:
    return is_floating_array(x) and x.ndim >= 1 and jnp.dtype(x.dtype) in _COMPACTABLE


def low_precision_state(
    inner: optax.GradientTransformation,
    dtype: Any = jnp.bfloat16,
    *,
    key: Any = None,
    block_size: int = 256,
    nonnegative: Sequence[str] = SECOND_MOMENTS,
) -> optax.GradientTransformationExtraArgs:
    """Stores ``inner``'s floating-point state in 16 or 8 bits; computes it in float32.

    ``update`` decodes the stored state to float32, casts the gradients (and parameters) to
    float32, runs ``inner.update`` on them and stores its new state again, rounding each
    value to nearest, or stochastically when a ``key`` is given. The updates it returns are
    float32: follow it with :func:`stochastic_rounding` or :func:`kahan_summation` for
    16-bit parameters, so that they are rounded once, onto the parameters.

    What is stored compactly: every floating-point array of the state with at least one
    axis (Adam's ``mu`` and ``nu``, momentum's ``trace``, ``optax.MultiSteps``'
    accumulated gradients...). Integer leaves (step counts), scalars (a learning rate in
    ``optax.inject_hyperparams``) and non-array leaves pass through.

    - ``jnp.bfloat16``: 2 bytes per value, float32's range, 8 significant bits.
    - ``jnp.float8_e4m3fn``: 1 byte per value plus one float32 scale per block of
      ``block_size`` values along the last axis (:class:`BlockScaled`); leaves named in
      ``nonnegative`` (Adam's ``nu``) are stored as their square root, which halves the
      octaves their values span within a block.
    - ``jnp.float32``: stored as float32 (for 16-bit parameters whose moments stay float32).

    Stochastic rounding matters for the state as it does for parameters: Adam's ``nu``
    decays by ``b2 = 0.999`` per step, a change of 0.1%, below half of bfloat16's spacing
    (0.2%): rounded to nearest, a ``nu`` that only decays never changes at all.

    Put it inside :func:`dynamic_loss_scaling` (a skipped step then keeps the stored state
    bit for bit) and around the optimizer only, not around :func:`stochastic_rounding`.

    Args:
        inner: Any optax transformation (``optax.adamw(...)``, an ``optax.chain``...).
        dtype: How to store the state: ``jnp.bfloat16`` (the default),
            ``jnp.float8_e4m3fn`` or ``jnp.float32``.
        key: A PRNG key or int seed for stochastic rounding of the state; None (the
            default) rounds to nearest.
        block_size: Values per scale in 8-bit storage, along the last axis (an axis shorter
            than that is one block).
        nonnegative: Names of state fields (attribute or dict keys on the path to a leaf,
            above the parameter tree the state mirrors: a parameter named ``nu`` does not
            make its first moment one) that are non-negative, stored as square roots in 8
            bits; values below zero there would be stored as zero.

    Returns:
        An ``optax.GradientTransformationExtraArgs``; ``init(params)`` returns a
        :class:`LowPrecisionState`; ``update(updates, state, params=None, **extra_args)``
        returns float32 updates.

    Raises:
        TypeError: If ``inner`` is not an optax transformation, ``dtype`` is not one of
            those (float16, for one, is refused with the reason), or ``key`` is not a key;
            from ``init``, if ``inner`` contains :func:`stochastic_rounding`,
            :func:`kahan_summation` or :func:`dynamic_loss_scaling`; from ``init`` and
            ``update``, if a parameter is an 8-bit float; from ``update``, if ``state`` is
            not a :class:`LowPrecisionState`.
        ValueError: If ``block_size`` is not a positive int; from ``update``, if the
            state was stored by another configuration (another dtype, block size or key).

    Example:
        >>> import autocast.optax, jax, jax.numpy as jnp, optax
        >>> params = {"w": jnp.ones((2, 3), jnp.bfloat16)}
        >>> tx = optax.chain(
        ...     autocast.optax.low_precision_state(optax.adam(1e-2), key=jax.random.key(1)),
        ...     autocast.optax.stochastic_rounding(jax.random.key(2)),
        ... )
        >>> state = tx.init(params)
        >>> updates, state = tx.update({"w": jnp.ones((2, 3), jnp.bfloat16)}, state, params)
        >>> params = optax.apply_updates(params, updates)
        >>> params["w"].dtype, state[0].inner[0].mu["w"].dtype
        (dtype(bfloat16), dtype(bfloat16))
    """
    if not isinstance(inner, optax.GradientTransformation):
        raise TypeError(
            f"low_precision_state wraps an optax.GradientTransformation, got {type(inner).__name__}"
        )
    dtype = _storage_dtype(dtype)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(
            f"low_precision_state: block_size must be a positive int, got {block_size!r}"
        )
    stored_key = None if key is None else StoredKey(key, "low_precision_state")
    roots = frozenset(nonnegative)
    inner = optax.with_extra_args_support(inner)

    def encode(state: Any, draw: Any, params: Any) -> Any:
        leaves, tree = jax.tree_util.tree_flatten_with_path(state)
        named = [False] * len(leaves)  # square roots: 8-bit codes only
        if roots and dtype == blocks.CODE_DTYPE:
            named = _nonnegative_fields([path for path, _ in leaves], params, roots)
        chosen = [i for i, (_, x) in enumerate(leaves) if _compactable(x)]
        seed = None if draw is None else _bits.seeds(draw)
        out = [x for _, x in leaves]
        xs = [leaves[i][1] for i in chosen]
        rooted = tuple(named[i] for i in chosen)
        if seed is None and not any(isinstance(x, jax.core.Tracer) for x in xs):
            stored = _stored_to_nearest(xs, dtype, block_size, rooted)
        else:
            offsets = _bits.offsets([_rounded_shape(x.shape, dtype, block_size) for x in xs])
            stored = [
                _stored(x, dtype, block_size, root, seed, offset)
                for x, root, offset in zip(xs, rooted, offsets)
            ]
        for i, x in zip(chosen, stored):
            out[i] = x
        return jax.tree_util.tree_unflatten(tree, out)

    def decode(state: Any) -> Any:
        def one(x: Any) -> Any:
            if isinstance(x, blocks.BlockScaled):
                if dtype != blocks.CODE_DTYPE or x.codes.shape[-2:] != blocks.layout(
                    x.size, block_size
                ):
                    raise ValueError(
                        "low_precision_state: the state holds 8-bit blocks of "
                        f"{x.codes.shape[-1]} values; this transformation stores {dtype.name}"
                        + (f" in blocks of {block_size}" if dtype == blocks.CODE_DTYPE else "")
                        + ": a state from another configuration"
                    )
                return blocks.decode(x)
            if _compactable(x):
                if jnp.dtype(x.dtype) != dtype:
                    raise ValueError(
                        f"low_precision_state: the state holds {x.dtype} arrays; this "
                        f"transformation stores {dtype}: a state from another configuration"
                    )
                return x.astype(jnp.float32)
            return x

        return jax.tree_util.tree_map(
            one, state, is_leaf=lambda x: isinstance(x, blocks.BlockScaled)
        )

    def init(params: Any) -> LowPrecisionState:
        refuse_8_bit_params(params, "low_precision_state", _PARAMETERS)
        inner_state = inner.init(_to_float32(params))
        _refuse_inside(inner_state)
        return LowPrecisionState(
            _unwrap_blocks(encode(inner_state, None, params)),
            None if stored_key is None else jnp.asarray(stored_key.data),
        )

    def update(
        updates: Any, state: LowPrecisionState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, LowPrecisionState]:
        if not isinstance(state, LowPrecisionState):
            raise TypeError(
                "low_precision_state.update takes a LowPrecisionState, got "
                f"{type(state).__name__}: a state from another transformation"
            )
        if (state.key is None) != (stored_key is None):
            raise ValueError(
                "low_precision_state: the state was made "
                + ("with a key (stochastic rounding)" if state.key is not None else "without a key")
                + ", this transformation "
                + ("has one" if stored_key is not None else "has none")
                + ": a state from another configuration"
            )
        refuse_8_bit_params(params, "low_precision_state", _PARAMETERS)
        order.warn_if_unrounded(params, "low_precision_state")
        # The decoded float32 state depends only on the step's arguments, so a compiler may
        # decode it before the backward pass and hold it through the activations' peak (the
        # TPU's does); tied to the gradients, it is decoded once they exist.
        updates, stored = jax.lax.optimization_barrier((updates, state.inner))
        new_updates, inner_state = inner.update(
            _to_float32(updates), decode(stored), _to_float32(params), **extra_args
        )
        following, draw = (None, None) if stored_key is None else stored_key.split(state.key)
        return new_updates, LowPrecisionState(encode(inner_state, draw, updates), following)

    return optax.GradientTransformationExtraArgs(init, update)


def _variable_types() -> tuple[type, ...]:
    """Flax NNX's variable type, where Flax is imported (never imported here). Flax 0.10
    hands ``init`` its ``VariableState``s, which its optimizer writes back whole: they stay."""
    variable = vars(sys.modules["flax.nnx"]).get("Variable") if "flax.nnx" in sys.modules else None
    return () if variable is None else (variable,)


def _unwrap_blocks(state: Any) -> Any:
    """``state`` with each :class:`BlockScaled` taken out of the NNX variable around it.

    Given an NNX module's parameters, ``init`` mirrors their ``nnx.Param`` variables in the
    moments, and an 8-bit moment is then a variable whose value is a :class:`BlockScaled`.
    ``nnx.Optimizer`` writes each new state back with ``nnx.update``, which sets such a
    variable's value to a plain mapping of the codes and scales, and the container (its
    size and root) is lost. Outside a variable, the container stays and only its arrays are
    wrapped and written back. A 16-bit moment keeps its variable (and its sharding
    metadata); an 8-bit one has another shape than its parameter anyway."""
    kinds = _variable_types()
    if not kinds:
        return state

    def one(x: Any) -> Any:
        if not isinstance(x, kinds):
            return x
        value = x.get_value() if hasattr(x, "get_value") else x.value
        return value if isinstance(value, blocks.BlockScaled) else x

    return jax.tree_util.tree_map(one, state, is_leaf=lambda x: isinstance(x, kinds))


def _rounded_shape(shape: tuple[int, ...], dtype: Any, block_size: int) -> tuple[int, ...]:
    """The shape of what is rounded for a leaf of ``shape``: its 8-bit codes, or itself."""
    return blocks.code_shape(shape, block_size) if dtype == blocks.CODE_DTYPE else shape


def _stored(
    x: jax.Array, dtype: Any, block_size: int, root: bool, seed: Any, offset: int = 0
) -> Any:
    """One leaf of the state in its stored form: rounded stochastically with the bits of
    ``seed``, its elements numbered from ``offset``, or to nearest where ``seed`` is None."""
    x = x.astype(jnp.float32)
    if dtype == jnp.float32:
        return x
    shape = _rounded_shape(x.shape, dtype, block_size)
    bits = None if seed is None else _bits.element_bits(seed, shape, offset)
    if dtype == blocks.CODE_DTYPE:
        return blocks.encode(x, block_size, root, bits)
    return rounding.round_onto(x, dtype, bits=bits).astype(dtype)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _stored_to_nearest(
    xs: list[jax.Array], dtype: Any, block_size: int, rooted: tuple[bool, ...]
) -> list[Any]:
    """:func:`_stored` to nearest for each of ``xs``, as one compiled program. ``init`` runs
    eagerly, where each of the rounding's few dozen operations would compile a program of its
    own for each shape of the state (the first ``init`` of the demo GPT's Adam state took 18 s
    in bfloat16 or in 8 bits)."""
    return [_stored(x, dtype, block_size, root, None) for x, root in zip(xs, rooted)]


def _to_float32(tree: Any) -> Any:
    """Floating arrays of 32 bits or fewer in float32; other leaves as they are."""
    return map_floating(
        lambda x: x.astype(jnp.float32) if jnp.dtype(x.dtype) in _COMPACTABLE else x, tree
    )


def _refuse_inside(inner_state: Any) -> None:
    """Transformations that must not be wrapped: the parameters' rounding (it would see
    float32 parameters and do nothing) and the loss scaling (a skipped step would store the
    state again, advancing its key)."""
    kinds = (StochasticRoundingState, KahanState, LossScalingState)
    found = [
        x
        for x in jax.tree_util.tree_leaves(inner_state, is_leaf=lambda x: isinstance(x, kinds))
        if isinstance(x, kinds)
    ]
    if not found:
        return
    kind = type(found[0]).__name__
    if kind == "LossScalingState":
        raise TypeError(
            "low_precision_state was given an optimizer containing dynamic_loss_scaling: put "
            "the scaling outside, dynamic_loss_scaling(optax.chain(low_precision_state(opt), "
            "stochastic_rounding(key))), so that a skipped step keeps the stored state"
        )
    raise TypeError(
        f"low_precision_state was given an optimizer containing a {kind}: it rounds onto "
        "16-bit parameters, which the wrapped optimizer sees in float32; chain it after "
        "instead: optax.chain(low_precision_state(opt), stochastic_rounding(key))"
    )
