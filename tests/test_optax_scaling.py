"""Tests for the optax face of loss scaling: ``autocast.optax``.

Covers fault injection in float16 amp training (bad batches are skipped exactly, parameters
and optimizer state bit-identical across every skipped step, training still converges), the
float16 underflow that loss scaling exists to prevent, ``axis_name`` under ``vmap``, nesting
in ``optax.chain`` and validation, ``-0.0`` parameters across a skipped step and the absence
of host synchronisation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autocast
import autocast.optax as aopt
from autocast._src.demo import models as _models

AMP_MLP_F16 = autocast.amp(_models.mlp_loss, compute_dtype=jnp.float16)


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def _bits(x):
    """The raw bit pattern of a float array (so -0.0 and 0.0, or two NaNs, are told apart)."""
    x = np.asarray(x)
    if x.dtype == np.float32:
        return x.view(np.uint32)
    if x.dtype in (np.float16, jnp.bfloat16):
        return x.view(np.uint16)
    return x


def _assert_bit_identical(before, after, what):
    a, b = _leaves(before), _leaves(after)
    assert len(a) == len(b), what
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.dtype == y.dtype and x.shape == y.shape, (what, i)
        np.testing.assert_array_equal(x, y, err_msg=f"{what}: leaf {i} changed")
        np.testing.assert_array_equal(_bits(x), _bits(y), err_msg=f"{what}: leaf {i} bits changed")


def _teacher_data(n=512, seed=0):
    """A learnable classification task for the reference MLP: labels from a random linear
    teacher, so the loss can fall far below its initial ln(10)."""
    kx, kt = jax.random.split(jax.random.PRNGKey(seed))
    x = np.asarray(jax.random.normal(kx, (n, 32), jnp.float32))
    y = np.argmax(x @ np.asarray(jax.random.normal(kt, (32, 10))), axis=-1).astype(np.int32)
    return x, y


def _make_step(tx, loss_fn):
    """One jitted training step: scale the loss by the state's current scale, differentiate,
    let the wrapper unscale/skip/adjust, apply the updates."""

    def step(params, opt_state, x, y):
        scale = aopt.loss_scale_of(opt_state)
        scaled_loss, grads = jax.value_and_grad(lambda p: scale.scale(loss_fn(p, x, y)))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, scale.unscale(scaled_loss)

    return step


# ---- 1. fault injection ---------------------------------------------------------------------

N_STEPS = 640
BATCH = 64
# Injected steps: a run of three consecutive bad batches, pairs, and singles; the gaps after
# step 40 are longer than the growth period, so the scale also grows between injections.
INJECTED = {
    10: np.nan,
    11: np.inf,
    12: -np.inf,
    40: np.nan,
    200: np.inf,
    201: np.nan,
    350: np.nan,
    480: -np.inf,
    481: np.nan,
    620: np.inf,
}
PERIOD = 100


# once: 640 steps; every JAX checks what a skipped step leaves (the skip tests below and
# test_training_state's bit-for-bit ones)
@pytest.mark.once
@pytest.mark.slow
def test_fault_injection_float16_amp_training():
    x_all, y_all = _teacher_data()
    params = _models.init_mlp(jax.random.PRNGKey(0))
    # Growth every 100 finite steps from 2**15: with ten halvings on the way the scale never
    # exceeds its start, where this model's float16 gradients do not overflow, so every skip
    # is an injected one.
    loss_scale = autocast.DynamicLossScale(2.0**15, period=PERIOD)
    tx = aopt.dynamic_loss_scaling(optax.adam(1e-3), loss_scale)
    opt_state = tx.init(params)
    step = jax.jit(_make_step(tx, AMP_MLP_F16))

    initial_loss = float(_models.mlp_loss(params, x_all, y_all))
    skipped_at, scales = [], [float(aopt.loss_scale_of(opt_state).loss_scale)]
    adam_count = lambda s: int(s.inner.inner_state[0].count)  # noqa: E731
    prev_skipped = int(aopt.skipped_steps(opt_state))
    assert prev_skipped == 0

    for i in range(N_STEPS):
        start = (i * BATCH) % len(x_all)
        x = x_all[start : start + BATCH].copy()
        y = y_all[start : start + BATCH]
        if i in INJECTED:
            x[3, 5] = INJECTED[i]
        before_params = _leaves(params)
        before_inner = _leaves(opt_state.inner.inner_state)

        params, opt_state, _ = step(params, opt_state, x, y)

        after_params = _leaves(params)
        assert all(np.all(np.isfinite(p)) for p in after_params), f"non-finite params at step {i}"
        skipped = int(aopt.skipped_steps(opt_state))
        assert skipped - prev_skipped in (0, 1)
        if skipped != prev_skipped:
            skipped_at.append(i)
        prev_skipped = skipped
        if i in INJECTED:
            assert skipped_at and skipped_at[-1] == i, f"injected step {i} was not skipped"
            _assert_bit_identical(before_params, after_params, f"params across skipped step {i}")
            _assert_bit_identical(
                before_inner, opt_state.inner.inner_state, f"adam state across skipped step {i}"
            )
        else:
            assert not skipped_at or skipped_at[-1] != i, f"clean step {i} was skipped"
            assert any(not np.array_equal(a, b) for a, b in zip(before_params, after_params)), (
                f"clean step {i} did not move the parameters"
            )
        scales.append(float(aopt.loss_scale_of(opt_state).loss_scale))

    assert skipped_at == sorted(INJECTED)
    assert int(aopt.skipped_steps(opt_state)) == len(INJECTED)
    # Adam counted only the applied steps.
    assert adam_count(opt_state) == N_STEPS - len(INJECTED)

    # The scale followed the rule on the injected flags: halve at each bad step, grow after
    # PERIOD consecutive good ones.
    expected, counter = [2.0**15], 0
    for i in range(N_STEPS):
        s = expected[-1]
        if i in INJECTED:
            s, counter = s / 2, 0
        else:
            counter += 1
            if counter == PERIOD:
                s, counter = s * 2, 0
        expected.append(s)
    assert scales == expected
    changes = sum(a != b for a, b in zip(scales, scales[1:]))
    grows = sum(b > a for a, b in zip(scales, scales[1:]))
    assert grows >= 3 and changes == len(INJECTED) + grows

    final_loss = float(_models.mlp_loss(params, x_all, y_all))
    print(
        f"\nfault injection: {N_STEPS} steps, {len(INJECTED)} injected, "
        f"{len(skipped_at)} skipped at {skipped_at}; loss {initial_loss:.4f} -> {final_loss:.4f}; "
        f"{changes} scale changes ({grows} growths), scale {scales[0]:g} -> {scales[-1]:g}"
    )
    assert final_loss < 0.25 * initial_loss, (initial_loss, final_loss)


# ---- 2. underflow ---------------------------------------------------------------------------

# The loss is cross-entropy times 3e-6, as an auxiliary term with a small weight (or a sum
# normalised by a very large token count) would be. Its gradient with respect to the float16
# logits is 3e-6 * (softmax - onehot) / batch, a few times 1e-8: below float16's smallest
# subnormal (6e-8), so without scaling it rounds to zero and so does everything backpropagated
# from it. This is the failure loss scaling exists for; the small weight makes it happen at
# the first step instead of late in training.
LOSS_WEIGHT = 3e-6


def _zero_share(tree):
    leaves = _leaves(tree)
    return sum(int(np.sum(x == 0)) for x in leaves) / sum(x.size for x in leaves)


@pytest.mark.slow
def test_float16_gradients_underflow_without_scaling():
    params = _models.init_mlp(jax.random.PRNGKey(0))
    x, y = _teacher_data(n=BATCH, seed=1)

    def loss(p):
        return LOSS_WEIGHT * AMP_MLP_F16(p, x, y)

    reference = jax.jit(jax.grad(lambda p: LOSS_WEIGHT * _models.mlp_loss(p, x, y)))(params)
    assert _zero_share(reference) == 0.0  # in float32 no gradient entry is exactly zero

    unscaled = jax.jit(jax.grad(loss))(params)

    tx = aopt.dynamic_loss_scaling(optax.sgd(1.0))
    opt_state = tx.init(params)
    scale = aopt.loss_scale_of(opt_state)
    scaled_grads = jax.jit(jax.grad(lambda p: scale.scale(loss(p))))(params)
    # The wrapper unscales; with sgd(1.0) its updates are minus the unscaled gradients.
    updates, opt_state = tx.update(scaled_grads, opt_state, params)
    assert int(aopt.skipped_steps(opt_state)) == 0
    with_scaling = jax.tree_util.tree_map(jnp.negative, updates)

    share_without, share_with = _zero_share(unscaled), _zero_share(with_scaling)
    print(
        f"\nunderflow: exactly-zero gradient entries {share_without:.1%} without scaling, "
        f"{share_with:.4%} with dynamic scaling (scale {float(scale.loss_scale):g})"
    )
    assert share_without > 0.5
    assert share_with < 0.05
    for g, want in zip(_leaves(with_scaling), _leaves(reference)):
        assert g.dtype == np.float32
        assert np.linalg.norm(g - want) / np.linalg.norm(want) < 0.05

    # The same through the DynamicScalerState face.
    state, grads = jax.jit(
        lambda p, s: autocast.dynamic_scale_grad(loss)(p, dynamic_scaler_state=s)
    )(params, autocast.DynamicScalerState())
    assert _zero_share(grads) < 0.05 and int(state.total_resets) == 0


# ---- 3. axis_name ---------------------------------------------------------------------------


def _replica_loss(p, x):
    return jnp.mean(jnp.tanh(x @ p["w"] + p["b"]) ** 2)


@pytest.mark.slow
@pytest.mark.parametrize("inner", [optax.sgd(0.1), optax.adam(1e-2)], ids=["sgd", "adam"])
def test_axis_name_under_vmap_replicas_decide_alike(inner):
    n = 4
    key_w, key_x = jax.random.split(jax.random.PRNGKey(7))
    one = {"w": jax.random.normal(key_w, (3, 2)), "b": jnp.zeros(2)}
    params = jax.tree_util.tree_map(lambda a: jnp.stack([a] * n), one)
    xs = jax.random.normal(key_x, (2, n, 5, 3))  # two steps of per-replica batches
    bad = xs.at[0, 1, 2, 0].set(jnp.nan)  # step 0: only replica 1 sees a NaN

    def run(axis_name):
        tx = aopt.dynamic_loss_scaling(
            inner, autocast.DynamicLossScale(2.0**12, period=1), axis_name=axis_name
        )

        def step(p, s, x):
            scale = aopt.loss_scale_of(s)
            grads = jax.grad(lambda q: scale.scale(_replica_loss(q, x)))(p)
            updates, s = tx.update(grads, s, p)
            return optax.apply_updates(p, updates), s

        vstep = jax.jit(jax.vmap(step, axis_name="r"))
        state = jax.vmap(tx.init)(params)
        p1, s1 = vstep(params, state, bad[0])
        p2, s2 = vstep(p1, s1, bad[1])
        return p1, s1, p2, s2

    p1, s1, p2, s2 = run("r")
    np.testing.assert_array_equal(np.asarray(aopt.skipped_steps(s1)), np.ones(n))
    np.testing.assert_array_equal(
        np.asarray(aopt.loss_scale_of(s1).loss_scale), np.full(n, 2.0**11, np.float32)
    )
    _assert_bit_identical(params, p1, "replicas across the shared skip")
    # The next, clean step: every replica applies it and grows the scale alike.
    np.testing.assert_array_equal(np.asarray(aopt.skipped_steps(s2)), np.ones(n))
    np.testing.assert_array_equal(
        np.asarray(aopt.loss_scale_of(s2).loss_scale), np.full(n, 2.0**12, np.float32)
    )
    assert all(np.all(np.isfinite(x)) for x in _leaves(p2))
    assert not np.array_equal(np.asarray(p2["w"]), np.asarray(params["w"]))

    # Without axis_name only replica 1 skips (so the checks above can fail).
    p1, s1, _, _ = run(None)
    np.testing.assert_array_equal(np.asarray(aopt.skipped_steps(s1)), [0, 1, 0, 0])
    np.testing.assert_array_equal(
        np.asarray(aopt.loss_scale_of(s1).loss_scale), [2.0**13, 2.0**11, 2.0**13, 2.0**13]
    )


# ---- 4. nesting and validation --------------------------------------------------------------


def test_nested_in_chain():
    params = {"w": jnp.array([1.0, -2.0, 3.0])}
    tx = optax.chain(
        optax.chain(aopt.dynamic_loss_scaling(optax.sgd(0.5)), optax.clip(10.0)),
        optax.scale(1.0),
    )
    state = tx.init(params)
    scale = aopt.loss_scale_of(state)
    assert isinstance(scale, autocast.DynamicLossScale) and float(scale.loss_scale) == 2.0**15
    assert int(aopt.skipped_steps(state)) == 0

    @jax.jit
    def step(params, state, x):
        scale = aopt.loss_scale_of(state)
        grads = jax.grad(lambda p: scale.scale(jnp.sum(p["w"] ** 2) * x))(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    new, state = step(params, state, jnp.float32(jnp.nan))
    _assert_bit_identical(params, new, "params across a skipped chained step")
    assert int(aopt.skipped_steps(state)) == 1
    assert float(aopt.loss_scale_of(state).loss_scale) == 2.0**14
    new, state = step(params, state, jnp.float32(1.0))
    # Unscaled: w - 0.5 * 2w = 0.
    np.testing.assert_array_equal(np.asarray(new["w"]), np.zeros(3, np.float32))
    assert int(aopt.skipped_steps(state)) == 1


def test_loss_scale_of_needs_exactly_one_wrapper():
    params = {"w": jnp.ones(2)}
    with pytest.raises(ValueError, match="dynamic_loss_scaling"):
        aopt.loss_scale_of(optax.adam(1e-3).init(params))
    twice = optax.chain(
        aopt.dynamic_loss_scaling(optax.sgd(0.1)), aopt.dynamic_loss_scaling(optax.sgd(0.1))
    )
    with pytest.raises(ValueError, match="dynamic_loss_scaling"):
        aopt.skipped_steps(twice.init(params))


def test_wrapping_dynamic_loss_scaling_in_itself_is_refused():
    """It used to be accepted and unscaled the gradients twice."""
    once = aopt.dynamic_loss_scaling(optax.sgd(0.1))
    with pytest.raises(TypeError, match="already wrapped in dynamic_loss_scaling.*unscaled twice"):
        aopt.dynamic_loss_scaling(once)
    # Hidden inside a chain it is found when the state is built.
    hidden = aopt.dynamic_loss_scaling(optax.chain(optax.clip(1.0), once))
    with pytest.raises(TypeError, match="already contains dynamic_loss_scaling.*unscaled twice"):
        hidden.init({"w": jnp.ones(2)})
    # Wrapped once, outermost, is fine.
    state = optax.chain(optax.clip(1.0), once).init({"w": jnp.ones(2)})
    assert float(aopt.loss_scale_of(state).loss_scale) == 2.0**15


@pytest.mark.parametrize(
    "inner",
    [optax.adam, lambda g, s, p=None: (g, s), (lambda p: (), lambda g, s, p=None: (g, s)), None],
    ids=["factory", "function", "plain-tuple", "none"],
)
def test_rejects_non_gradient_transformation(inner):
    with pytest.raises(TypeError, match="GradientTransformation"):
        aopt.dynamic_loss_scaling(inner)


@pytest.mark.parametrize(
    "loss_scale", [2.0**15, 128, jnp.float32(128.0), "dynamic", {"loss_scale": 1.0}]
)
def test_rejects_bad_loss_scale(loss_scale):
    with pytest.raises(TypeError, match="loss_scale"):
        aopt.dynamic_loss_scaling(optax.sgd(0.1), loss_scale)


@pytest.mark.parametrize(
    "loss_scale, scale_after_skip",
    [
        (autocast.DynamicLossScale(2.0**10), 2.0**9),
        (autocast.DynamicScalerState(scaler=2.0**10), 2.0**9),
        (autocast.StaticLossScale(2.0**10), 2.0**10),
        (autocast.NoOpLossScale(), 1.0),
    ],
    ids=["dynamic", "scaler-state", "static", "noop"],
)
def test_every_loss_scale_kind(loss_scale, scale_after_skip):
    params = {"w": jnp.array([0.5, -1.5])}
    tx = aopt.dynamic_loss_scaling(optax.adam(0.1), loss_scale)
    plain = optax.adam(0.1)
    step = jax.jit(_make_step(tx, lambda p, x, y: jnp.sum((p["w"] * x - y) ** 2)))
    state, plain_state, plain_params = tx.init(params), plain.init(params), params
    p, state, _ = step(params, state, jnp.float32(jnp.inf), jnp.float32(1.0))
    _assert_bit_identical(params, p, "params across a skipped step")
    assert int(aopt.skipped_steps(state)) == 1
    assert float(aopt.loss_scale_of(state).loss_scale) == scale_after_skip
    assert type(aopt.loss_scale_of(state)) is type(loss_scale)
    # On finite steps the wrapper is the inner optimizer on the unscaled gradients (scaling
    # by a power of two and back is exact; XLA may fuse the two programs differently, so
    # allow an ulp or two).
    for x in (2.0, 0.5, -1.0):
        p, state, _ = step(p, state, jnp.float32(x), jnp.float32(1.0))
        g = jax.grad(lambda q: jnp.sum((q["w"] * x - 1.0) ** 2))(plain_params)
        u, plain_state = plain.update(g, plain_state, plain_params)
        plain_params = optax.apply_updates(plain_params, u)
    np.testing.assert_allclose(np.asarray(p["w"]), np.asarray(plain_params["w"]), rtol=1e-6)
    assert not np.allclose(np.asarray(p["w"]), np.asarray(params["w"]))
    assert int(aopt.skipped_steps(state)) == 1


# ---- 5. -0.0 across a skipped step ----------------------------------------------------------


@pytest.mark.parametrize("inner", [optax.sgd(0.1), optax.adam(1e-3)], ids=["sgd", "adam"])
def test_negative_zero_parameter_survives_a_skipped_step(inner):
    params = {
        "w": jnp.array([-0.0, 0.0, 1.0, -2.0], jnp.float32),
        "h": jnp.array([-0.0], jnp.float16),
    }
    tx = aopt.dynamic_loss_scaling(inner)
    state = tx.init(params)
    grads = {"w": jnp.array([1.0, jnp.nan, 1.0, 1.0]), "h": jnp.array([1.0], jnp.float16)}
    updates, state = jax.jit(tx.update)(grads, state, params)
    assert int(aopt.skipped_steps(state)) == 1
    # The updates are -0.0 everywhere, so p + u == p bit for bit, -0.0 included.
    for u in _leaves(updates):
        assert np.all(u == 0) and np.all(np.signbit(u)), u
    new = optax.apply_updates(params, updates)
    _assert_bit_identical(params, new, "params with -0.0 across a skipped step")
    assert np.signbit(np.asarray(new["w"])[0]) and not np.signbit(np.asarray(new["w"])[1])
    assert np.signbit(np.asarray(new["h"])[0])


# ---- 6. no host sync ------------------------------------------------------------------------


@pytest.mark.parametrize("axis_name", [None, "r"])
def test_step_has_no_host_sync(axis_name):
    params = _models.init_mlp(jax.random.PRNGKey(0))
    x, y = _teacher_data(n=BATCH)
    tx = aopt.dynamic_loss_scaling(optax.adam(1e-3), axis_name=axis_name)
    step = _make_step(tx, AMP_MLP_F16)
    state = tx.init(params)
    if axis_name is None:
        lowered = jax.jit(step).lower(params, state, x, y)
    else:
        stack = lambda t: jax.tree_util.tree_map(lambda a: jnp.stack([a, a]), t)  # noqa: E731
        lowered = jax.jit(jax.vmap(step, axis_name=axis_name)).lower(
            stack(params), stack(state), stack(jnp.asarray(x)), stack(jnp.asarray(y))
        )
    text = lowered.as_text().lower()
    for word in ("callback", "infeed", "outfeed"):
        assert word not in text, word


def _accumulation_problem():
    k = jax.random.split(jax.random.key(0), 3)
    params = {
        "w1": jax.random.normal(k[0], (16, 64)) * 0.3,
        "w2": jax.random.normal(k[1], (64, 1)) * 0.3,
    }
    x = jax.random.normal(k[2], (64, 16))

    def loss(p, x, y):
        return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)

    return loss, params, x, jnp.sin(x[:, :1])


def _clipped_adam():
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))


def test_accumulation_inside_the_scaling_trains_and_skips_a_microbatch_exactly():
    # each microbatch's gradients are unscaled and checked before MultiSteps accumulates
    # them: float16 from the default 2**15 trains as float32 does
    loss, params, x, y = _accumulation_problem()
    amp16 = autocast.amp(loss, compute_dtype=jnp.float16)

    def run(scaled: bool, steps: int = 60):
        inner = optax.MultiSteps(_clipped_adam(), every_k_schedule=4).gradient_transformation()
        tx = aopt.dynamic_loss_scaling(inner) if scaled else inner
        state, p = tx.init(params), params

        @jax.jit
        def step(p, state, x):
            if not scaled:
                g = jax.grad(loss)(p, x, y)
            else:
                scale = aopt.loss_scale_of(state)
                g = jax.grad(lambda q: scale.scale(amp16(q, x, y)))(p)
            updates, state = tx.update(g, state, p)
            return optax.apply_updates(p, updates), state

        for _ in range(steps):
            p, state = step(p, state, x)
        return float(loss(p, x, y)), state, step, p

    start = float(loss(params, x, y))
    f16, state, step, p = run(True)
    f32, *_ = run(False)
    assert f16 < 0.2 * start and abs(f16 - f32) < 0.25 * f32
    # an overflowing microbatch: nothing of it reaches the accumulator or the optimizer
    p_next, state_next = step(p, state, x.at[0, 0].set(jnp.inf))
    _assert_bit_identical(p, p_next, "parameters")
    _assert_bit_identical(state.inner.inner_state, state_next.inner.inner_state, "MultiSteps")
    assert int(aopt.skipped_steps(state_next)) == int(aopt.skipped_steps(state)) + 1


def test_scaling_inside_accumulation_is_refused_at_init_naming_the_order_that_trains():
    # MultiSteps would accumulate scaled gradients, and its accumulator keeps an overflow for
    # good (it clears by multiplying by zero): every later step skipped, silently
    _, params, _, _ = _accumulation_problem()
    for inner in (
        aopt.dynamic_loss_scaling(_clipped_adam()),
        optax.chain(optax.clip(1.0), aopt.dynamic_loss_scaling(optax.adam(1e-2))),
    ):
        with pytest.raises(TypeError, match=r"MultiSteps\(inner, k\).gradient_transformation"):
            optax.MultiSteps(inner, every_k_schedule=4).init(params)
    # a state built so anyway is refused where the scale is read
    state = optax.MultiStepsState(
        mini_step=jnp.zeros((), jnp.int32),
        gradient_step=jnp.zeros((), jnp.int32),
        inner_opt_state=aopt.dynamic_loss_scaling(optax.sgd(0.1)).init(params),
        acc_grads=params,
    )
    with pytest.raises(TypeError, match="gradient_transformation"):
        aopt.loss_scale_of(state)
    # and a MultiSteps object given to the scaling, not its transformation, is named
    with pytest.raises(TypeError, match=r"\.gradient_transformation\(\)"):
        aopt.dynamic_loss_scaling(optax.MultiSteps(_clipped_adam(), every_k_schedule=4))


def test_a_python_float_loss_decides_as_an_array_does():
    tx = aopt.dynamic_loss_scaling(optax.sgd(1.0))
    params = jnp.ones(2)
    state = tx.init(params)
    for value, skipped in (
        (float("nan"), 1),
        (np.float32("nan"), 1),
        (jnp.float32(jnp.nan), 1),
        (float("inf"), 1),
        (1.5, 0),
    ):
        updates, after = tx.update(jnp.ones(2), state, params, value=value)
        assert int(aopt.skipped_steps(after)) == skipped, value
        assert bool(jnp.all(updates == 0)) == bool(skipped)


def test_the_state_made_by_init_can_be_donated_to_a_jitted_step():
    # Donation needs every leaf of the state in its own buffer: a shared zero counter made
    # XLA refuse the step ("donate the same buffer twice").
    tx = aopt.dynamic_loss_scaling(optax.sgd(0.1))
    params = {"w": jnp.ones(3, jnp.float32)}
    state = tx.init(params)
    leaves = [x for x in jax.tree_util.tree_leaves(state) if isinstance(x, jax.Array)]
    assert len({id(x) for x in leaves}) == len(leaves)

    def step(params, state):
        updates, state = tx.update(params, state, params)
        return optax.apply_updates(params, updates), state

    params, state = jax.jit(step, donate_argnums=(0, 1))(params, state)
    np.testing.assert_array_equal(np.asarray(state.health.skipped_in_a_row), 0)
