"""16-bit parameters that still learn: the last transformation of an optax chain rounds
each bfloat16 or float16 parameter's float32 update onto the parameter's grid, by
stochastic rounding or with a Kahan compensation buffer, and returns the float32 update
that ``optax.apply_updates`` turns into exactly that rounded value.

Without either, ``apply_updates`` rounds ``p + u`` to nearest, and an update smaller than
half of ``p``'s spacing (2**-9 of ``|p|`` in bfloat16) is lost: a parameter of 1.0 cannot
move by less than 0.002 per step, so small learning rates and late, small updates stop
training. Stochastic rounding keeps each update's expected value; a compensation buffer
keeps what was rounded away and adds it to the next update.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from autocast._src.state import bits as _bits
from autocast._src.state import order, rounding
from autocast._src.state.keys import StoredKey
from autocast._src.tree import is_floating_array

_NARROW_NAMES = "bfloat16 or float16"


def _narrow(p: Any) -> bool:
    return is_floating_array(p) and jnp.dtype(p.dtype) in rounding.PARAMETER_DTYPES


def _check_params(params: Any, owner: str) -> None:
    if params is None:
        raise ValueError(
            f"{owner} rounds onto the parameters and needs them: call "
            "tx.update(updates, state, params)"
        )
    refuse_8_bit_params(
        params,
        owner,
        f"are rounded onto {_NARROW_NAMES} (float32 and wider pass through), not onto 8-bit floats",
    )


def _refuse_upcast(path: Any, p: Any, was: Any, owner: str) -> None:
    """Raises a TypeError where a parameter this step rounded onto a 16-bit grid (``was``:
    its dtype then, None where not known) came back wider: an apply that adds the float32
    update without casting back."""
    if is_floating_array(p) and jnp.dtype(p.dtype).itemsize > 2:
        was = _NARROW_NAMES if was is None else str(jnp.dtype(was))
        raise TypeError(
            f"{owner}: parameter {jax.tree_util.keystr(tuple(path))} is {p.dtype}, and was "
            f"{was} when the state was made: its last update was added without a "
            f"cast back to {was} (equinox.apply_updates and a plain p + u keep the "
            "float32 update's dtype), so it takes twice the bytes and is no longer rounded. "
            "Apply the updates with optax.apply_updates(params, updates), which casts back; "
            "for an Equinox model: params, static = eqx.partition(model, eqx.is_array); "
            "model = eqx.combine(optax.apply_updates(params, updates), static)"
        )


def refuse_8_bit_params(params: Any, owner: str, why: str) -> None:
    """Raises a TypeError naming the first parameter in an 8-bit float dtype; ``why`` says
    what parameters are, after "parameters"."""
    for path, p in jax.tree_util.tree_flatten_with_path(params)[0]:
        if is_floating_array(p) and jnp.dtype(p.dtype).itemsize < 2:
            raise TypeError(
                f"{owner}: parameter {jax.tree_util.keystr(path)} is {p.dtype}; parameters {why}"
            )


class StochasticRoundingState(NamedTuple):
    """The state of :func:`stochastic_rounding`: its PRNG key's raw data.

    A ``NamedTuple`` of one uint32 array (``jax.random.key_data`` of the key), so that a
    checkpoint saves it as any array. It advances at every ``update``: a run is reproducible
    from the key it started with, and a step that is skipped (by
    :func:`autocast.optax.dynamic_loss_scaling`, or by a train step that keeps the old
    optimizer state) leaves it as it was.

    Attributes:
        key: The key's data, uint32 (shape ``(2,)`` for JAX's default threefry keys).
        rounded: A tree of the parameters' structure: for each bfloat16 or float16
            parameter, a scalar zero of its dtype, what ``init`` saw (so that a parameter an
            apply turned into float32 is refused by name at the next ``update``);
            ``optax.MaskedNode()`` for the others. None in a state made before it existed,
            which is then not checked.

    Example:
        >>> import autocast.optax, jax, jax.numpy as jnp
        >>> tx = autocast.optax.stochastic_rounding(jax.random.key(0))
        >>> state = tx.init({"w": jnp.ones(3, jnp.bfloat16)})
        >>> state.key.dtype, state.key.shape
        (dtype('uint32'), (2,))
    """

    key: jax.Array
    rounded: Any = None


def _markers(params: Any) -> Any:
    """For each 16-bit parameter a scalar zero of its dtype, ``optax.MaskedNode()`` elsewhere."""
    return jax.tree_util.tree_map(
        lambda p: jnp.zeros((), p.dtype) if _narrow(p) else optax.MaskedNode(), params
    )


def _beside_params(tree: Any, params: Any, what: str) -> list[tuple[Any, Any, Any]]:
    """``(path, parameter, entry)`` for each parameter and the entry of ``tree`` (a state's
    tree of the parameters' structure) beside it; a ValueError where the structures differ."""
    try:
        entries = jax.tree_util.tree_structure(params).flatten_up_to(tree)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"{what} does not have the parameters' structure (a state made for other "
            f"parameters): {e}"
        ) from None
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return [(path, p, entry) for (path, p), entry in zip(flat, entries)]


def _check_rounded(rounded: Any, params: Any) -> None:
    if rounded is None:
        return
    for path, p, mark in _beside_params(rounded, params, "stochastic_rounding: the state"):
        was = None if isinstance(mark, optax.MaskedNode) else mark.dtype
        if was is not None and not _narrow(p):
            _refuse_upcast(path, p, was, "stochastic_rounding")
        if (was is None) == _narrow(p) or (was is not None and jnp.dtype(was) != p.dtype):
            raise ValueError(
                f"stochastic_rounding: parameter {jax.tree_util.keystr(tuple(path))} is "
                f"{getattr(p, 'dtype', type(p).__name__)} and the state was made for "
                f"{'a parameter it does not round' if was is None else jnp.dtype(was)}: a "
                "state made for other parameters"
            )


def stochastic_rounding(key: Any) -> optax.GradientTransformation:
    """Rounds 16-bit parameters' updates stochastically: place it last in an optax chain.

    For every bfloat16 or float16 parameter ``p`` with float32 update ``u``, ``update``
    computes ``x = p + u`` in float32, rounds ``x`` onto ``p``'s dtype stochastically (up
    with probability equal to ``x``'s distance from the value below, over the spacing, so
    the expected result is ``x``) and returns the float32 update ``round(x) - p``, with which
    ``optax.apply_updates(params, updates)`` lands on the rounded value exactly, bit for bit.
    Updates of float32 (and wider, and integer) parameters pass through unchanged.

    Why: stored in bfloat16, a parameter keeps 8 significant bits, and rounding ``p + u`` to
    nearest drops every update smaller than half its spacing (2**-9 of ``|p|``); a model
    trained so stops learning once its updates get small. Stochastic rounding loses no
    update on average. The random bits come from ``key``, kept in the state and advanced at
    every update; every copy of a parameter (data-parallel replicas, every process of a
    job) draws the same bits, whatever its sharding, so copies stay equal.

    Results below 2**-126 are rounded onto 0 and 2**-126 (float32's subnormals, which a
    CPU flushes to zero and a GPU keeps, are left out, so that every backend lands alike).
    Finite results beyond the dtype's range saturate at its largest value.

    Put it after every transformation that changes the updates (after the optimizer,
    ``optax.scale_by_learning_rate``, weight decay), and give it float32 updates: those of
    :func:`low_precision_state` are. Inside :func:`dynamic_loss_scaling` a skipped step
    leaves parameters and key bit-identical.

    Args:
        key: A PRNG key (``jax.random.key(0)``, ``jax.random.PRNGKey(0)``) or an int seed.

    Returns:
        An ``optax.GradientTransformation``; ``init(params)`` returns a
        :class:`StochasticRoundingState`; ``update(updates, state, params)`` needs
        ``params`` and returns float32 updates for the 16-bit parameters.

    Raises:
        TypeError: If ``key`` is None or not a key or an int; from ``init`` and ``update``,
            if a parameter is an 8-bit float; from ``update``, if ``state`` is not a
            :class:`StochasticRoundingState`, or a parameter that was 16-bit at ``init``
            is now wider (applied by ``equinox.apply_updates``, which does not cast back).
        ValueError: If ``key`` is an array of several keys; from ``update``, if ``params``
            is None, the state's key is of another kind than ``key``, or the state was
            made for other parameters.

    Example:
        >>> import autocast.optax, jax, jax.numpy as jnp, optax
        >>> params = {"w": jnp.ones(256, jnp.bfloat16)}
        >>> tx = optax.chain(optax.sgd(1e-3), autocast.optax.stochastic_rounding(jax.random.key(0)))
        >>> state = tx.init(params)
        >>> grads = {"w": jnp.ones(256, jnp.bfloat16)}
        >>> for _ in range(100):  # each step moves by 1e-3, a quarter of bfloat16's spacing
        ...     updates, state = tx.update(grads, state, params)
        ...     params = optax.apply_updates(params, updates)
        >>> params["w"].dtype, bool(abs(params["w"].astype(float).mean() - 0.9) < 0.01)
        (dtype(bfloat16), True)
    """
    stored = StoredKey(key, "stochastic_rounding")

    def init(params: Any) -> StochasticRoundingState:
        _check_params(params, "stochastic_rounding")
        order.note_rounding(params)
        return StochasticRoundingState(jnp.asarray(stored.data), _markers(params))

    def update(
        updates: Any, state: StochasticRoundingState, params: Any = None
    ) -> tuple[Any, StochasticRoundingState]:
        if not isinstance(state, StochasticRoundingState):
            raise TypeError(
                "stochastic_rounding.update takes a StochasticRoundingState, got "
                f"{type(state).__name__}: a state from another transformation"
            )
        _check_params(params, "stochastic_rounding")
        _check_rounded(state.rounded, params)
        following, now = stored.split(state.key)
        narrow = [p for p in jax.tree_util.tree_leaves(params) if _narrow(p)]
        seed = _bits.seeds(now)
        offsets = iter(_bits.offsets([p.shape for p in narrow]))

        def one(u: Any, p: Any) -> Any:
            if not _narrow(p):
                return u
            offset = next(offsets)  # drawn for every 16-bit parameter, an update or not
            if u is None:
                return u
            x = p.astype(jnp.float32) + u.astype(jnp.float32)
            bits = _bits.element_bits(seed, p.shape, offset)
            r = rounding.round_onto(x, p.dtype, bits=bits)
            return rounding.landing_update(r, p)[1]

        out = jax.tree_util.tree_map(one, updates, params, is_leaf=lambda x: x is None)
        return out, StochasticRoundingState(following, state.rounded)

    return optax.GradientTransformation(init, update)


class KahanState(NamedTuple):
    """The state of :func:`kahan_summation`: one compensation per 16-bit parameter.

    Attributes:
        compensation: A tree of the parameters' structure: for each bfloat16 or float16
            parameter, what rounding took from it so far (added to its next update), in the
            compensation dtype; ``optax.MaskedNode()`` for the others.

    Example:
        >>> import autocast.optax, jax.numpy as jnp
        >>> state = autocast.optax.kahan_summation().init({"w": jnp.ones(3, jnp.bfloat16)})
        >>> state.compensation["w"].dtype
        dtype(bfloat16)
    """

    compensation: Any


_COMPENSATION_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def kahan_summation(dtype: Any = None) -> optax.GradientTransformation:
    """Rounds 16-bit parameters' updates to nearest, keeping what rounding took in a
    compensation buffer (Kahan summation): place it last in an optax chain.

    For every bfloat16 or float16 parameter ``p`` with float32 update ``u`` and compensation
    ``c``, ``update`` computes ``y = u + c`` and ``x = p + y`` in float32, rounds ``x`` to the
    nearest value of ``p``'s dtype, ``r``, keeps ``c = (p - r) + y`` (what did not fit) for
    the next step, and returns ``r - p``, with which ``optax.apply_updates`` lands on ``r``
    exactly. No update is lost: one too small to move ``p`` accumulates in ``c`` until it
    does. Deterministic: no random bits, the same result on every run. Results below 2**-126
    and beyond the dtype's range are treated as by :func:`stochastic_rounding`. Other
    parameters' updates pass through.

    It costs one compensation per 16-bit parameter: 2 bytes in bfloat16 (the default for
    bfloat16 parameters), which stores ``c`` to 2**-9 of itself, that is to about 2**-17 of
    ``p``.

    Args:
        dtype: The compensation's dtype: bfloat16, float16 or float32; None (the default)
            means each parameter's own dtype.

    Returns:
        An ``optax.GradientTransformation``; ``init(params)`` returns a :class:`KahanState`;
        ``update(updates, state, params)`` needs ``params``.

    Raises:
        TypeError: If ``dtype`` is not one of those; from ``init`` and ``update``, if a
            parameter is an 8-bit float; from ``update``, if ``state`` is not a
            :class:`KahanState`, or a parameter that was 16-bit at ``init`` is now wider
            (applied by ``equinox.apply_updates``, which does not cast back).
        ValueError: From ``update``: if ``params`` is None, or the state's compensation does
            not match the parameters (a state made for other parameters or another dtype).

    Example:
        >>> import autocast.optax, jax.numpy as jnp, optax
        >>> params = {"w": jnp.ones(4, jnp.bfloat16)}
        >>> tx = optax.chain(optax.sgd(1e-3), autocast.optax.kahan_summation())
        >>> state = tx.init(params)
        >>> grads = {"w": jnp.ones(4, jnp.bfloat16)}
        >>> for _ in range(100):
        ...     updates, state = tx.update(grads, state, params)
        ...     params = optax.apply_updates(params, updates)
        >>> params["w"]  # 0.9 to bfloat16's spacing; rounding to nearest leaves 1.0
        Array([0.898438, 0.898438, 0.898438, 0.898438], dtype=bfloat16)
    """
    if dtype is not None:
        try:
            dtype = jnp.dtype(dtype)
        except TypeError:
            dtype = None if dtype is None else dtype
        if not isinstance(dtype, jnp.dtype) or dtype not in _COMPENSATION_DTYPES:
            raise TypeError(
                f"kahan_summation: dtype must be bfloat16, float16, float32 or None, got {dtype}"
            )

    def comp_dtype(p: Any) -> Any:
        return dtype if dtype is not None else p.dtype

    def init(params: Any) -> KahanState:
        _check_params(params, "kahan_summation")
        order.note_rounding(params)
        return KahanState(
            jax.tree_util.tree_map(
                lambda p: jnp.zeros(p.shape, comp_dtype(p)) if _narrow(p) else optax.MaskedNode(),
                params,
            )
        )

    def update(updates: Any, state: KahanState, params: Any = None) -> tuple[Any, KahanState]:
        if not isinstance(state, KahanState):
            raise TypeError(
                "kahan_summation.update takes a KahanState, got "
                f"{type(state).__name__}: a state from another transformation"
            )
        _check_params(params, "kahan_summation")
        _check_compensation(state.compensation, params, comp_dtype)

        flat_u, tree = jax.tree_util.tree_flatten(updates, is_leaf=lambda x: x is None)
        out, comp = [], []
        for u, p, c in zip(
            flat_u, tree.flatten_up_to(params), tree.flatten_up_to(state.compensation)
        ):
            if u is None or not _narrow(p):
                out.append(u)
                comp.append(c)
                continue
            p32 = p.astype(jnp.float32)
            y = u.astype(jnp.float32) + c.astype(jnp.float32)
            r = rounding.round_onto(p32 + y, p.dtype)
            r, d = rounding.landing_update(r, p)
            out.append(d)
            comp.append(((p32 - r) + y).astype(c.dtype))
        out, comp = tree.unflatten(out), tree.unflatten(comp)
        return out, KahanState(comp)

    return optax.GradientTransformation(init, update)


def _check_compensation(comp: Any, params: Any, comp_dtype: Any) -> None:
    masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731
    for path, p, c in _beside_params(comp, params, "kahan_summation: the state's compensation"):
        want = _narrow(p)
        if not want and not masked(c):
            # the compensation is in the parameter's dtype unless one was given
            was = c.dtype if jnp.dtype(c.dtype) in rounding.PARAMETER_DTYPES else None
            _refuse_upcast(path, p, was, "kahan_summation")
        if want != (not masked(c)) or (
            want and (c.shape != p.shape or jnp.dtype(c.dtype) != jnp.dtype(comp_dtype(p)))
        ):
            got = "nothing" if masked(c) else f"{c.dtype}{list(c.shape)}"
            need = f"{jnp.dtype(comp_dtype(p))}{list(p.shape)}" if want else "nothing"
            raise ValueError(
                f"kahan_summation: a parameter {p.dtype}{list(p.shape)} has a compensation "
                f"of {got}, this transformation keeps {need}: a state from another "
                "configuration or other parameters"
            )
