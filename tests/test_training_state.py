"""16- and 8-bit training state (autocast.optax.low_precision_state, stochastic_rounding,
kahan_summation): the dtype of every leaf, parameters that still learn, exact state
transitions (a skipped step under each loss-scaling face, accumulation, a resume), and the
errors bad input gets. The rounding itself is tested in tests/test_state_rounding.py; two
processes and FSDP-sharded state in tests/test_multiprocess.py."""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autocast
import autocast.optax as ao
from autocast._src.state import blocks

BF16, F32, E4M3 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32), jnp.dtype(jnp.float8_e4m3fn)


def _params(dtype=jnp.bfloat16):
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w": (0.5 * jax.random.normal(k1, (8, 300))).astype(dtype),
        "b": jnp.zeros((300,), dtype),
        "scale": jnp.ones((), jnp.float32),  # a float32 leaf among 16-bit ones
        "steps": jnp.zeros((3,), jnp.int32),  # an integer leaf
    }


def _grads(params, seed=1):
    def one(p, k):
        if not jnp.issubdtype(p.dtype, jnp.floating):
            return np.zeros(p.shape, jax.dtypes.float0)
        return (0.1 * jax.random.normal(k, p.shape)).astype(p.dtype)

    leaves, tree = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree_util.tree_unflatten(tree, [one(p, k) for p, k in zip(leaves, keys)])


def _float_params(params):
    return {k: v for k, v in params.items() if k != "steps"}


def _assert_bit_identical(a, b, what):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b), what
    for i, (x, y) in enumerate(zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b))):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape, (what, i)
        assert np.array_equal(x.reshape(-1).view(np.uint8), y.reshape(-1).view(np.uint8)), (what, i)


# ---- the dtype of every leaf --------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn, jnp.float32])
def test_every_leaf_of_adam_s_state_is_stored_as_asked(dtype):
    params = _float_params(_params())
    tx = ao.low_precision_state(optax.adam(1e-3), dtype, key=jax.random.key(3))
    state = tx.init(params)
    for _ in range(2):  # init, then after an update: the same forms
        adam = state.inner[0]
        assert adam.count.dtype == jnp.int32 and adam.count.shape == ()
        for field in ("mu", "nu"):
            tree = getattr(adam, field)
            # the scalar float32 parameter's moments are scalars: kept as they are
            assert tree["scale"].dtype == F32 and tree["scale"].shape == ()
            for name in ("w", "b"):
                leaf = tree[name]
                if jnp.dtype(dtype) == E4M3:
                    assert isinstance(leaf, ao.BlockScaled), (field, name)
                    assert leaf.codes.dtype == E4M3 and leaf.scales.dtype == F32
                    assert leaf.shape == params[name].shape
                    assert leaf.codes.shape == blocks.code_shape(params[name].shape, 256)
                    assert leaf.root == (field == "nu")  # the second moment as square roots
                else:
                    assert leaf.dtype == jnp.dtype(dtype) and leaf.shape == params[name].shape
        assert state.key.dtype == jnp.uint32 and state.key.shape == (2,)
        updates, state = jax.jit(tx.update)(_grads(params), state, params)
        for name in ("w", "b", "scale"):
            assert updates[name].dtype == F32  # float32 updates, rounded once, onto params


class _Moments(NamedTuple):
    mu: Any
    nu: Any


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_an_eager_init_stores_what_the_rounding_gives_operation_by_operation(dtype):
    # an eager init stores the state through one compiled program (one for all its shapes,
    # not one per operation and shape): what the rounding run an operation at a time stores,
    # on a state that is not all zeros, to a float32 rounding of the block scales (XLA of
    # JAX 0.6.2 divides by 448 as a product with its reciprocal in a compiled program)
    def init(params):
        grown = jax.tree_util.tree_map(lambda p: p.astype(F32) * 1.37 + 1e-3, params)
        return _Moments(grown, jax.tree_util.tree_map(lambda m: m * m * 1e-4, grown))

    inner = optax.GradientTransformation(init, lambda u, s, p=None: (u, s))
    tx = ao.low_precision_state(inner, dtype)
    params = _float_params(_params())

    def values(state):
        return [
            np.asarray(blocks.decode(x) if isinstance(x, ao.BlockScaled) else x.astype(F32))
            for x in jax.tree_util.tree_leaves(
                state, is_leaf=lambda x: isinstance(x, ao.BlockScaled)
            )
        ]

    compiled = tx.init(params)
    with jax.disable_jit():
        one_at_a_time = tx.init(params)
    assert jax.tree_util.tree_structure(compiled) == jax.tree_util.tree_structure(one_at_a_time)
    for got, want in zip(values(compiled), values(one_at_a_time)):
        np.testing.assert_allclose(got, want, rtol=2**-20, atol=0)  # nu: a scale squared
    nu = compiled.inner.nu["w"]
    assert bool(jnp.all((blocks.decode(nu) if dtype == E4M3 else nu.astype(F32)) > 0))


def test_blocks_run_along_the_last_axis_and_pad_the_last():
    x = jnp.arange(2 * 600, dtype=jnp.float32).reshape(2, 600) / 600
    stored = blocks.encode(x, 256, root=False, bits=None)
    assert stored.codes.shape == (2, 3, 256) and stored.scales.shape == (2, 3)
    # each block's scale is its own largest magnitude over 448; padding is zeros
    np.testing.assert_allclose(stored.scales[0], np.array([255, 511, 599]) / 600 / 448, rtol=1e-6)
    assert np.all(np.asarray(stored.codes[:, 2, 600 - 512 :].astype(jnp.float32)) == 0)
    back = blocks.decode(stored)
    assert back.shape == x.shape and back.dtype == F32
    # e4m3 keeps 3 mantissa bits: within half a spacing, 2**-4 of each value, of it
    np.testing.assert_allclose(back, x, rtol=2**-4, atol=1e-30)
    assert stored.nbytes == 2 * 3 * 256 + 2 * 3 * 4


@pytest.mark.parametrize("dtype", [BF16, E4M3])
def test_the_stored_state_is_decoded_only_once_the_gradients_exist(dtype):
    # decoded from the arguments alone, a compiler may decode it first and hold float32
    # moments through the backward pass's peak (a TPU plan did: docs/benchmarks.md)
    params = {"w": jnp.ones((8, 300), F32)}
    tx = ao.low_precision_state(optax.adam(1e-3), dtype)
    state = tx.init(params)
    jaxpr = jax.make_jaxpr(tx.update)(params, state, params)
    stored = [v for v in jaxpr.jaxpr.invars if v.aval.dtype == dtype]
    grads = jaxpr.jaxpr.invars[0]
    (barrier,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "optimization_barrier"]
    assert grads in barrier.invars and stored and set(stored) <= set(barrier.invars)
    # and nothing reads the stored arrays but the barrier
    readers = [e for e in jaxpr.jaxpr.eqns if any(v in stored for v in e.invars)]
    assert readers == [barrier]


@pytest.mark.parametrize("dtype", [BF16, E4M3])
def test_an_empty_parameter_is_stored_and_updated_beside_the_others(dtype):
    # an empty leading axis: the 8-bit codes' decode once inferred a length from it and
    # divided by zero
    params = {"empty": jnp.zeros((0, 8)), "b": jnp.ones((3,))}
    opt = ao.low_precision_state(optax.adam(0.1), dtype)
    state = opt.init(params)
    updates, state = jax.jit(opt.update)(params, state, params)
    assert updates["empty"].shape == (0, 8) and updates["empty"].dtype == F32
    np.testing.assert_allclose(updates["b"], -0.1 * np.ones(3), rtol=1e-3)
    assert blocks.decode(blocks.encode(jnp.zeros((0, 8)), 256, False, None)).shape == (0, 8)


def test_square_roots_keep_small_second_moments_that_plain_codes_flush():
    # one row of squared gradients spanning 2**28: e4m3's normal values span 2**15 per block
    nu = jnp.asarray([[2.0**-28, 2.0**-20, 1.0] + [2.0**-10] * 61], jnp.float32)
    plain = blocks.decode(blocks.encode(nu, 256, root=False, bits=None))
    rooted = blocks.decode(blocks.encode(nu, 256, root=True, bits=None))
    assert float(plain[0, 0]) == 0.0  # flushed: Adam would divide by eps alone there
    assert float(rooted[0, 0]) > 0.0
    np.testing.assert_allclose(rooted, nu, rtol=2**-3)


class _Inner(NamedTuple):  # parameter trees with attribute names, as Equinox's
    w: jax.Array


class _Outer(NamedTuple):
    w: jax.Array
    nu: _Inner


_NAMED_LIKE_MOMENTS = {
    # a dict key and an attribute called nu: Adam's mu["nu"] and mu["a"].nu.w
    "key": {"nu": jnp.zeros((4, 8)), "other": jnp.zeros((2, 8))},
    "attribute": {"a": _Outer(jnp.zeros((2, 8)), _Inner(jnp.zeros((3, 8))))},
    # at the top, the inner w's path .nu.w ends Adam's nu of the outer w, [0].nu.w
    "top": _Outer(jnp.zeros((2, 8)), _Inner(jnp.zeros((3, 8)))),
}


@pytest.mark.parametrize("name", list(_NAMED_LIKE_MOMENTS))
def test_a_parameter_named_like_a_second_moment_keeps_a_signed_first_moment(name):
    # Adam's first moment of a parameter called "nu" lives at mu["nu"]: the name is the
    # parameter's, not the state's, so it is stored signed (it once became a square root,
    # its negative values zero, and the second step moved the parameter by half as much),
    # and a second moment stays a square root whatever its parameter is called
    params = _NAMED_LIKE_MOMENTS[name]
    grads = jax.tree_util.tree_map(lambda p: -jnp.ones_like(p), params)
    tx, plain = ao.low_precision_state(optax.adam(1e-2), E4M3), optax.adam(1e-2)
    state, want_state = tx.init(params), plain.init(params)
    for _ in range(2):
        got, state = tx.update(grads, state, params)
        want, want_state = plain.update(grads, want_state, params)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(g, w, rtol=2**-4)
    adam = state.inner[0]
    assert not any(b.root for b in jax.tree_util.tree_leaves(adam.mu, is_leaf=_is_blocks))
    assert all(b.root for b in jax.tree_util.tree_leaves(adam.nu, is_leaf=_is_blocks))


def _is_blocks(x: Any) -> bool:
    return isinstance(x, blocks.BlockScaled)


def test_stochastic_block_encoding_is_unbiased():
    x = jnp.full((4096, 4), 0.3, jnp.float32).at[:, 0].set(1.0)  # 0.3 lies between codes
    keys = jax.random.split(jax.random.key(0), 64)

    @jax.jit
    def mean_of(keys):
        def one(k):
            bits = jax.random.bits(k, blocks.code_shape(x.shape, 256), jnp.uint32)
            return blocks.decode(blocks.encode(x, 256, root=False, bits=bits))[:, 1]

        return jnp.mean(jax.vmap(one)(keys))

    # e4m3 neighbours of 0.3 * 448 = 134.4 are 128 and 144: sigma of one draw <= 8/448
    sigma = (16 / 448 / 2) / np.sqrt(4096 * 64)
    assert abs(float(mean_of(keys)) - 0.3) <= 6 * sigma


def test_stochastic_rounding_and_kahan_state_leaves():
    params = _params()
    sr = ao.stochastic_rounding(jax.random.key(7)).init(params)
    assert sr.key.dtype == jnp.uint32 and sr.key.shape == (2,)
    k = ao.kahan_summation().init(params)
    assert k.compensation["w"].dtype == BF16 and k.compensation["b"].dtype == BF16
    assert isinstance(k.compensation["scale"], optax.MaskedNode)
    assert isinstance(k.compensation["steps"], optax.MaskedNode)
    assert ao.kahan_summation(jnp.float32).init(params).compensation["w"].dtype == F32


# ---- parameters that still learn ----------------------------------------------------------


def _sgd_run(last, steps=200, lr=1e-4):
    """bfloat16 parameters of 1.0 under SGD whose steps (1e-4) are a fortieth of their
    spacing; the final mean parameter."""
    params = {"w": jnp.ones((1024,), jnp.bfloat16)}
    grads = {"w": jnp.ones((1024,), jnp.bfloat16)}
    tx = optax.chain(optax.sgd(lr), *([last] if last is not None else []))
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for _ in range(steps):
        params, state = step(params, state)
    assert params["w"].dtype == BF16
    return float(jnp.mean(params["w"].astype(jnp.float32)))


def test_small_updates_vanish_without_rounding_and_survive_with_it():
    want = 1.0 - 200 * 1e-4  # 0.98
    assert _sgd_run(None) == 1.0  # round to nearest: every update lost (the stagnation)
    # stochastic: the mean of 1024 parameters, each off by a random walk of 200 steps of
    # about 2**-8 with chance 1/40: sigma of the mean about 1.4e-4
    assert abs(_sgd_run(ao.stochastic_rounding(jax.random.key(0))) - want) < 1e-3
    # Kahan: deterministic, to within one bfloat16 spacing below 1.0 (2**-8)
    assert abs(_sgd_run(ao.kahan_summation()) - want) <= 2**-8


def test_a_run_is_reproducible_from_its_key_and_the_key_advances():
    def run(key):
        tx = ao.stochastic_rounding(key)
        params = {"w": jnp.full((64,), 1.0, jnp.bfloat16)}
        state = tx.init(params)
        keys = []
        for _ in range(3):
            updates, state = tx.update({"w": jnp.full((64,), 1e-3)}, state, params)
            params = optax.apply_updates(params, updates)
            keys.append(np.asarray(state.key))
        return np.asarray(params["w"].astype(jnp.float32)), keys

    a, keys_a = run(jax.random.key(5))
    b, _ = run(jax.random.PRNGKey(5))  # the raw form of the same key
    c, _ = run(6)  # an int seed: jax.random.key(6)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert len({k.tobytes() for k in keys_a}) == 3  # a new key at every update


# ---- exact state transitions: skipped steps, accumulation ----------------------------------


def _state16(key=0):
    return optax.chain(
        ao.low_precision_state(optax.adam(1e-2), jnp.float8_e4m3fn, key=key + 1),
        ao.stochastic_rounding(key + 2),
    )


def _loss(params, x):
    return jnp.mean(jnp.tanh(x @ params["w"]) * (1 + params["b"])) + jnp.sum(params["scale"] ** 2)


def _optax_face_step(amp_loss, tx):
    """A jitted step under the optax face: (parameters, state, the updates)."""

    @jax.jit
    def step(params, state, x):
        scale = ao.loss_scale_of(state)
        grads = jax.grad(lambda p: scale.scale(amp_loss(p, x)))(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, updates

    return step


@pytest.mark.parametrize(
    "compute",
    [
        jnp.bfloat16,
        pytest.param(jnp.float16, marks=pytest.mark.slow),
        pytest.param("fp8", marks=pytest.mark.slow),
    ],
)
def test_a_skipped_step_of_the_optax_face_keeps_everything_bit_for_bit(compute):
    params = _float_params(_params())
    x = jax.random.normal(jax.random.key(2), (16, 8))
    amp_loss = autocast.amp(_loss, compute_dtype=compute)
    tx = ao.dynamic_loss_scaling(_state16())
    state = tx.init(params)
    step = _optax_face_step(amp_loss, tx)
    params, state, _ = step(params, state, x)  # a good step first: nothing at its default
    before = (params, state.inner.inner_state)
    new_params, state, updates = step(params, state, x.at[3, 1].set(jnp.inf))
    assert int(ao.skipped_steps(state)) == 1
    assert all(u.dtype == F32 for u in jax.tree_util.tree_leaves(updates))
    _assert_bit_identical(new_params, before[0], "parameters")
    _assert_bit_identical(state.inner.inner_state, before[1], "moments and both keys")
    new_params, state, _ = step(new_params, state, x)  # and it trains on
    assert not np.array_equal(np.asarray(new_params["w"]), np.asarray(params["w"]))


@pytest.mark.slow
@pytest.mark.parametrize("face", ["jaxamp", "jmp"])
def test_a_skipped_step_of_the_other_faces_keeps_everything_bit_for_bit(face):
    params = _float_params(_params())
    x = jax.random.normal(jax.random.key(2), (16, 8))
    amp_loss = autocast.amp(_loss, compute_dtype=jnp.float16)
    tx = _state16()

    @jax.jit
    def step(params, opt_state, scaler, x):
        if face == "jaxamp":
            scaler, grads = autocast.dynamic_scale_grad(amp_loss)(
                params, x, dynamic_scaler_state=scaler
            )
        else:
            grads = scaler.unscale(jax.grad(lambda p: scaler.scale(amp_loss(p, x)))(params))
            scaler = scaler.adjust(autocast.all_finite(grads))
        finite = autocast.all_finite(grads)
        updates, new_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        return (*autocast.select_tree(finite, (new_params, new_state), (params, opt_state)), scaler)

    scaler = (
        autocast.DynamicScalerState()
        if face == "jaxamp"
        else autocast.DynamicLossScale(jnp.float32(2.0**15))
    )
    params, opt_state, scaler = step(params, tx.init(params), scaler, x)
    after, state_after, _ = step(params, opt_state, scaler, x.at[0, 0].set(jnp.nan))
    _assert_bit_identical(after, params, "parameters")
    _assert_bit_identical(state_after, opt_state, "moments and keys")


@pytest.mark.slow
def test_accumulation_inside_the_scaling_with_clipping():
    params = _float_params(_params())
    x = jax.random.normal(jax.random.key(2), (16, 8))
    amp_loss = autocast.amp(_loss, compute_dtype=jnp.float16)
    inner = optax.chain(
        ao.low_precision_state(
            optax.chain(optax.clip_by_global_norm(0.1), optax.adam(1e-2)), jnp.bfloat16, key=1
        ),
        ao.stochastic_rounding(2),
    )
    tx = ao.dynamic_loss_scaling(optax.MultiSteps(inner, 2).gradient_transformation())
    state = tx.init(params)
    step = _optax_face_step(amp_loss, tx)
    history = [params]
    for bad in [False, False, True, False, False]:
        params, state, _ = step(params, state, x.at[1, 1].set(jnp.inf) if bad else x)
        history.append(params)
    same = [
        np.array_equal(np.asarray(a["w"]), np.asarray(b["w"])) for a, b in zip(history, history[1:])
    ]
    # microbatches 1 and 2 make one update; 3 overflows and is skipped whole; 4 and 5 the next
    assert same == [True, False, True, True, False], same
    assert int(ao.skipped_steps(state)) == 1
    assert params["w"].dtype == BF16


# ---- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, says",
    [
        (jnp.float16, "float16 spans"),
        (jnp.float8_e5m2, "e5m2"),
        (jnp.int8, "accepted: jnp.bfloat16"),
        ("not a dtype", "accepted: jnp.bfloat16"),
    ],
)
def test_a_dtype_the_state_cannot_be_stored_in_is_refused(dtype, says):
    with pytest.raises(TypeError, match=says):
        ao.low_precision_state(optax.adam(1e-3), dtype)


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match="block_size"):
        ao.low_precision_state(optax.adam(1e-3), jnp.float8_e4m3fn, block_size=0)
    with pytest.raises(TypeError, match="GradientTransformation"):
        ao.low_precision_state(lambda g: g)
    with pytest.raises(TypeError, match="needs a key"):
        ao.stochastic_rounding(None)
    with pytest.raises(TypeError, match="PRNG key"):
        ao.stochastic_rounding("seed")
    with pytest.raises(TypeError, match="uint32 of shape"):
        ao.stochastic_rounding(jnp.zeros((3,), jnp.uint32))
    with pytest.raises(ValueError, match="one key"):
        ao.stochastic_rounding(jax.random.split(jax.random.key(0), 2))
    with pytest.raises(TypeError, match="low_precision_state: key"):
        ao.low_precision_state(optax.adam(1e-3), key=1.5)
    with pytest.raises(TypeError, match="bfloat16, float16, float32 or None"):
        ao.kahan_summation(jnp.int8)


def test_missing_parameters_and_8_bit_parameters_are_refused():
    params = _params()
    for tx in (ao.stochastic_rounding(0), ao.kahan_summation()):
        state = tx.init(params)
        with pytest.raises(ValueError, match="needs them"):
            tx.update(_grads(params), state)
        with pytest.raises(TypeError, match="not onto 8-bit floats"):
            tx.init({"w": jnp.ones(3, jnp.float8_e4m3fn)})


def test_states_of_another_configuration_are_refused():
    params = _float_params(_params())
    grads = _grads(params)
    bf16 = ao.low_precision_state(optax.adam(1e-3), jnp.bfloat16)
    fp8 = ao.low_precision_state(optax.adam(1e-3), jnp.float8_e4m3fn)
    fp8_128 = ao.low_precision_state(optax.adam(1e-3), jnp.float8_e4m3fn, block_size=128)
    keyed = ao.low_precision_state(optax.adam(1e-3), jnp.bfloat16, key=0)
    with pytest.raises(ValueError, match="holds bfloat16 arrays; this transformation stores"):
        fp8.update(grads, bf16.init(params), params)
    with pytest.raises(ValueError, match="8-bit blocks of 256 values"):
        fp8_128.update(grads, fp8.init(params), params)
    with pytest.raises(ValueError, match="8-bit blocks"):
        bf16.update(grads, fp8.init(params), params)
    with pytest.raises(ValueError, match="made without a key"):
        keyed.update(grads, bf16.init(params), params)
    with pytest.raises(TypeError, match="takes a LowPrecisionState"):
        bf16.update(grads, optax.adam(1e-3).init(params), params)
    with pytest.raises(TypeError, match="takes a KahanState"):
        ao.kahan_summation().update(grads, ao.stochastic_rounding(0).init(params), params)
    with pytest.raises(TypeError, match="takes a StochasticRoundingState"):
        ao.stochastic_rounding(0).update(grads, ao.kahan_summation().init(params), params)
    rbg = ao.stochastic_rounding(jax.random.key(0, impl="rbg"))
    with pytest.raises(ValueError, match="another configuration"):
        rbg.update(grads, ao.stochastic_rounding(0).init(params), params)
    other = {**params, "w": params["w"].astype(jnp.float32)}
    with pytest.raises(ValueError, match="has a compensation of nothing"):
        ao.kahan_summation().update(grads, ao.kahan_summation().init(other), params)
    with pytest.raises(ValueError, match=r"\['w'\] is bfloat16.*made for other parameters"):
        ao.stochastic_rounding(0).update(grads, ao.stochastic_rounding(0).init(other), params)


def test_the_wrong_nesting_is_refused_with_the_right_one_named():
    params = _float_params(_params())
    with pytest.raises(TypeError, match=r"optax.chain\(low_precision_state\(opt\), stochastic"):
        ao.low_precision_state(optax.chain(optax.adam(1e-3), ao.stochastic_rounding(0))).init(
            params
        )
    with pytest.raises(TypeError, match="dynamic_loss_scaling\\(optax.chain"):
        ao.low_precision_state(ao.dynamic_loss_scaling(optax.adam(1e-3))).init(params)


# ---- a checkpoint and a resume --------------------------------------------------------------


@pytest.mark.slow
def test_a_resume_from_an_orbax_checkpoint_runs_on_bit_for_bit(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    params = _float_params(_params())
    x = jax.random.normal(jax.random.key(2), (16, 8))
    amp_loss = autocast.amp(_loss, compute_dtype=jnp.float16)

    def make():
        return ao.dynamic_loss_scaling(
            optax.chain(
                ao.low_precision_state(optax.adamw(1e-2), jnp.float8_e4m3fn, key=1),
                ao.kahan_summation(),
            )
        )

    tx = make()

    @jax.jit
    def step(state, x):
        params, opt = state["params"], state["opt"]
        scale = ao.loss_scale_of(opt)
        grads = jax.grad(lambda p: scale.scale(amp_loss(p, x)))(params)
        updates, opt = tx.update(grads, opt, params)
        return {"params": optax.apply_updates(params, updates), "opt": opt}

    state = {"params": params, "opt": tx.init(params)}
    for i in range(3):
        state = step(state, x.at[0, 0].set(jnp.inf) if i == 1 else x)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "state", state)
    checkpointer.wait_until_finished()
    # restored into what a fresh process makes: the parameters and a new init
    fresh = {"params": params, "opt": make().init(params)}
    restored = checkpointer.restore(tmp_path / "state", fresh)
    checkpointer.close()
    _assert_bit_identical(restored, state, "restored")
    for _ in range(3):
        state, restored = step(state, x), step(restored, x)
    _assert_bit_identical(restored, state, "resumed")
    assert int(ao.skipped_steps(state["opt"])) == 1


def test_the_optax_face_unscales_16_bit_gradients_into_float32():
    # a float16 parameter whose scaled gradient, 5e-4 at a scale of 2**15, unscales to 1.5e-8:
    # below half of float16's smallest subnormal (6e-8), so in float16 it would be zero
    params = {"h": jnp.ones((4,), jnp.float16), "w": jnp.ones((4,), jnp.float32)}
    tx = ao.dynamic_loss_scaling(optax.adam(1e-3))
    state = tx.init(params)
    grads = {"h": jnp.full((4,), 5e-4, jnp.float16), "w": jnp.full((4,), 5e-4, jnp.float32)}
    updates, new_state = jax.jit(tx.update)(grads, state, params)
    assert updates["h"].dtype == F32 and updates["w"].dtype == F32
    assert np.all(np.asarray(updates["h"]) < 0)  # Adam's first step, -lr: the gradient arrived
    # the inner state keeps its dtypes (Adam's moments follow the float16 parameter)
    before = jax.tree_util.tree_map(lambda a: a.dtype, state.inner.inner_state)
    after = jax.tree_util.tree_map(lambda a: a.dtype, new_state.inner.inner_state)
    assert before == after
    assert new_state.inner.inner_state[0].nu["h"].dtype == jnp.float16
    assert optax.apply_updates(params, updates)["h"].dtype == jnp.float16


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_low_precision_state_refuses_float8_parameters(dtype):
    # float8 parameters cannot take the update the state computes (it came back NaN): the
    # parameter is named, at init and at update alike
    tx = ao.low_precision_state(optax.adam(1e-3), dtype)
    params = {"w": jnp.ones((4, 8), jnp.float8_e4m3fn)}
    with pytest.raises(TypeError, match=r"\['w'\].*float8_e4m3fn"):
        tx.init(params)
    good = {"w": jnp.ones((4, 8), jnp.float32)}
    state = tx.init(good)
    with pytest.raises(TypeError, match=r"\['w'\].*float8_e4m3fn"):
        tx.update(good, state, params)


def test_one_key_given_to_the_state_and_to_the_rounding_draws_two_streams():
    # The same key is what a user passes to both (key=jax.random.key(0) twice): each
    # transformation folds its own name into the draw, so their random bits differ.
    from autocast._src.state.keys import StoredKey

    key = jax.random.key(0)
    data = jax.random.key_data(key)
    draws = [
        jax.random.bits(StoredKey(key, owner).split(data)[1], (64,), jnp.uint32)
        for owner in ("low_precision_state", "stochastic_rounding")
    ]
    assert not np.any(np.asarray(draws[0]) == np.asarray(draws[1]))
    # and the next stored key is the same for both: only this step's bits are told apart
    np.testing.assert_array_equal(
        StoredKey(key, "low_precision_state").split(data)[0],
        StoredKey(key, "stochastic_rounding").split(data)[0],
    )


@pytest.mark.parametrize(
    "last",
    [lambda: ao.stochastic_rounding(jax.random.key(0)), ao.kahan_summation],
    ids=["stochastic_rounding", "kahan_summation"],
)
def test_a_parameter_upcast_by_an_apply_that_does_not_cast_back_is_refused_with_the_fix(last):
    # eqx.apply_updates adds the float32 update as it is: the bfloat16 parameter came back
    # float32 and the rounding step passed it through from then on, twice the bytes and no
    # rounding, with no error
    eqx = pytest.importorskip("equinox")
    params = {"w": jnp.ones((4, 8), jnp.bfloat16), "scale": jnp.ones((), jnp.float32)}
    grads = jax.tree_util.tree_map(jnp.ones_like, params)
    tx = optax.chain(optax.adam(1e-3), last())
    state = tx.init(params)
    updates, state = tx.update(grads, state, params)
    upcast = eqx.apply_updates(params, updates)
    assert upcast["w"].dtype == F32  # what Equinox gives
    for update in (tx.update, jax.jit(tx.update)):
        with pytest.raises(TypeError, match=r"\['w'\] is float32.*bfloat16.*optax.apply_updates"):
            update(grads, state, upcast)
    # applied so that it casts back, the step goes on (the fix the message names)
    kept = optax.apply_updates(params, updates)
    assert kept["w"].dtype == BF16
    tx.update(grads, state, kept)


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.bfloat16])
def test_an_nnx_optimizer_keeps_the_stored_state_through_its_round_trip(dtype):
    # nnx.Optimizer wraps each state leaf in a variable and writes the new state back with
    # nnx.update: the 8-bit form came back as a plain mapping of codes and scales, and the
    # second update raised "the state holds float32 arrays"
    nnx = pytest.importorskip("flax.nnx")
    import inspect

    model = nnx.Linear(300, 4, rngs=nnx.Rngs(0))
    tx = ao.low_precision_state(optax.adam(1e-2), dtype, key=0)
    if "model" in inspect.signature(nnx.Optimizer.update).parameters:  # Flax 0.11 and later
        opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
        step = lambda grads: opt.update(model, grads)  # noqa: E731
    else:  # Flax 0.10: the optimizer holds the model
        opt = nnx.Optimizer(model, tx)
        step = opt.update
    params = {k: v for k, v in nnx.to_pure_dict(nnx.state(model, nnx.Param)).items()}
    state = tx.init(params)
    x = jax.random.normal(jax.random.key(1), (8, 300))

    def loss(p):
        return jnp.mean((x @ p["kernel"] + p["bias"]) ** 2)

    for _ in range(3):
        grads = jax.grad(loss)(params)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        step(nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model))
    got = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    for k in params:  # the same three steps as the plain optax loop, bit for bit
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(params[k]))


def test_the_8_bit_state_survives_a_linen_train_state_and_an_equinox_partition():
    eqx = pytest.importorskip("equinox")
    train_state = pytest.importorskip("flax.training.train_state")
    params = {"w": jax.random.normal(jax.random.key(0), (4, 300))}
    tx = ao.low_precision_state(optax.adam(1e-2), jnp.float8_e4m3fn, key=0)
    grads = {"w": jnp.ones((4, 300))}
    ts = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
    state = tx.init(params)
    for _ in range(3):
        ts = jax.jit(lambda ts: ts.apply_gradients(grads=grads))(ts)
        # the state through Equinox's partition and combine, as a filtered step does
        arrays, static = eqx.partition(state, eqx.is_array)

        @jax.jit
        def step(arrays, params):
            updates, state = tx.update(grads, eqx.combine(arrays, static), params)
            return state, optax.apply_updates(params, updates)

        state, params = step(arrays, params)
    np.testing.assert_array_equal(np.asarray(ts.params["w"]), np.asarray(params["w"]))
    assert isinstance(ts.opt_state.inner[0].mu["w"], blocks.BlockScaled)


@pytest.mark.parametrize(
    ("shape", "per_parameter"),
    [
        ((1024, 4096), 2.03),
        ((8, 300), 3.47),
        ((64, 64), 2.125),
        ((3, 3, 64, 16), 2.50),
        ((64, 1), 10),
    ],
)
def test_the_8_bit_moments_cost_what_the_docs_table_says_per_last_axis(shape, per_parameter):
    # docs/training_state.md gave 2.03 bytes for every shape; a short last axis pays a scale
    # per row and a padded block (a 3x3 convolution with 16 outputs: 2.50)
    tx = ao.low_precision_state(optax.adam(1e-3), jnp.float8_e4m3fn)
    state = jax.eval_shape(tx.init, {"w": jax.ShapeDtypeStruct(shape, jnp.float32)})
    adam = state.inner[0]
    held = sum(
        int(np.prod(x.codes.shape)) + 4 * int(np.prod(x.scales.shape))
        for x in (adam.mu["w"], adam.nu["w"])
    )
    assert abs(held / np.prod(shape) - per_parameter) < 0.005


@pytest.mark.slow
def test_8_bit_moments_without_a_key_drift_as_the_docs_say_and_with_one_do_not():
    # the figure docs/training_state.md gives for the default (no key): a block that held one
    # large gradient moves its other parameters about 1.3x as far as float32 Adam over 200 steps
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "benchmarks" / "state_drift.py"
    spec = importlib.util.spec_from_file_location("state_drift", path)
    drift = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(drift)
    assert 1.25 < drift.drift(2.0**14, None) < 1.4
    assert abs(drift.drift(2.0**14, 0) - 1) < 0.03


def _rounding_warnings(make, params):
    """The rounding-order warnings that building ``make()``, its init and one update give."""
    from autocast._src.state import order

    order._WARNED.clear()
    order._ROUNDED.clear()  # what other tests in this process made rounding steps for
    grads = jax.tree_util.tree_map(jnp.ones_like, params)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tx = make()
        state = tx.init(params)
        jax.jit(tx.update)(grads, state, params)
    return [
        str(w.message) for w in caught if "rounding" in str(w.message) or "last" in str(w.message)
    ]


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "loss_scaled"])
def test_16_bit_parameters_without_a_rounding_step_or_with_one_misplaced_are_warned(scaled):
    # bfloat16 parameters under plain adam lost 0.9-2.7% of final loss, and a rounding step
    # placed before add_decayed_weights was accepted as well; neither said a word
    wrap = ao.dynamic_loss_scaling if scaled else (lambda tx: tx)
    p16 = {"w": jnp.ones((4, 8), jnp.bfloat16)}
    missing = _rounding_warnings(
        lambda: wrap(optax.chain(ao.low_precision_state(optax.adam(1e-3)))), p16
    )
    assert missing and all("no rounding step" in m and "(4, 8)" in m for m in missing)
    good = _rounding_warnings(
        lambda: wrap(
            optax.chain(
                ao.low_precision_state(optax.adamw(1e-3)), ao.stochastic_rounding(jax.random.key(0))
            )
        ),
        p16,
    )
    assert good == []
    assert (
        _rounding_warnings(
            lambda: wrap(optax.chain(ao.low_precision_state(optax.adam(1e-3)))),
            {"w": jnp.ones((4, 8), jnp.float32)},
        )
        == []
    )  # float32 parameters need no rounding step
    if scaled:  # the whole chain is seen: a misplaced step is told too
        misplaced = _rounding_warnings(
            lambda: wrap(
                optax.chain(optax.adam(1e-3), ao.kahan_summation(), optax.add_decayed_weights(1e-2))
            ),
            p16,
        )
        assert len(misplaced) == 1 and "kahan_summation is not the last" in misplaced[0]
