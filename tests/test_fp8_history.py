"""Delayed float8 scaling (``autocast.amp_fp8_delayed``): scales from an amax history, the
history's exact transitions, what keeps current scaling, and what it refuses."""

from __future__ import annotations

import dataclasses
import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings

import autocast
from autocast._src.demo import models as _models
from autocast._src.fp8 import products as fp8
from autocast._src.tools import measure as _measure

H = 4


@pytest.fixture(autouse=True)
def _float8_at_any_size(monkeypatch):
    # These tests read float8 programs off products of a few elements; which sizes run in
    # float8 by default is tested in test_fp8_selection.py.
    monkeypatch.setattr(fp8, "MIN_EXTENT", 1)


def _mlp(params, x):
    h = jnp.tanh(x @ params["w1"])
    return jnp.mean((h @ params["w2"]) ** 2)


def _mlp_args(scale=1.0):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    params = {
        "w1": jax.random.normal(k1, (16, 32)) * 0.3,
        "w2": jax.random.normal(k2, (32, 8)) * 0.3,
    }
    return params, jax.random.normal(k3, (8, 16)) * scale


def _amax_bf16(x):
    return float(jnp.max(jnp.abs(x.astype(jnp.bfloat16))).astype(jnp.float32))


def _bound(v):
    """The power of two at or above ``v``, as histories hold amaxes."""
    return float(2.0 ** np.ceil(np.log2(v)))


def _step(delayed, history, params, *rest):
    """One training step's value, next history and gradient of the parameters."""
    value, (g_history, grads) = jax.value_and_grad(delayed, argnums=(0, 1))(history, params, *rest)
    return value, history.advance(g_history), grads


def test_first_step_after_init_is_current_scaling_up_to_the_scales_power_of_two():
    # init fills every history with this step's amax, rounded up to a power of two: the
    # quantised values differ from current scaling's by float8 rounding only
    params, x = _mlp_args()
    delayed = autocast.amp_fp8_delayed(_mlp, history=H)
    history = delayed.init(params, x)
    current = autocast.amp(_mlp, compute_dtype="fp8")
    want_v, want_g = jax.jit(jax.value_and_grad(current))(params, x)
    got_v, _, got_g = jax.jit(functools.partial(_step, delayed))(history, params, x)
    assert abs(float(got_v) - float(want_v)) < 0.05 * abs(float(want_v))
    assert _measure.relative_error(got_g, want_g) < 0.15


def test_history_rows_are_operand_and_gradient_amaxes_newest_first():
    params, x = _mlp_args()
    delayed = autocast.amp_fp8_delayed(_mlp, history=H)
    history = delayed.init(params, x)
    assert history.measured == ((True, True, True), (True, True, True))
    assert len(history.amax) == 2 and all(h.shape == (3, H) for h in history.amax)
    first = history.amax[0]
    assert np.all(first[0] == _bound(_amax_bf16(x))) and np.all(
        first[1] == _bound(_amax_bf16(params["w1"]))
    )
    x2 = x * 3.0
    _, new, _ = _step(delayed, history, params, x2)
    for old, nxt in zip(history.amax, new.amax):
        np.testing.assert_array_equal(nxt[:, 1:], old[:, :-1])  # the rest moved one back
    assert float(new.amax[0][0, 0]) == _bound(_amax_bf16(x2))
    assert float(new.amax[0][1, 0]) == _bound(_amax_bf16(params["w1"]))
    # the output gradient row: the amax of what reached the first product's output
    assert 0 < float(new.amax[0][2, 0]) < np.inf


def test_scales_come_from_the_history_not_the_tensor():
    # a history 256 times larger than the tensor: the operand is quantised with that scale,
    # so its float8 values are 256 times smaller, those below e4m3's normal numbers rounded
    # more coarsely, and the result differs from current scaling's, but only by that rounding
    # (the scales are powers of two: a factor of 10 would only divide these operands' float8
    # values by 16, exactly)
    params, x = _mlp_args()
    delayed = autocast.amp_fp8_delayed(_mlp, history=H)
    history = delayed.init(params, x)
    wide = dataclasses.replace(history, amax=tuple(h * 256.0 for h in history.amax))
    got = float(delayed(wide, params, x))
    same = float(delayed(history, params, x))
    assert got != same
    assert abs(got - same) / same < 0.1


def test_values_above_the_history_saturate_and_stay_finite():
    params, x = _mlp_args()
    delayed = autocast.amp_fp8_delayed(lambda w, x: x @ w, history=H)
    history = delayed.init(params["w1"], x)
    out = delayed(history, params["w1"], x * 100.0)
    assert bool(jnp.all(jnp.isfinite(out)))
    # saturated: far below the true product, whose scale the history did not know
    assert float(jnp.max(jnp.abs(out))) < 0.5 * float(jnp.max(jnp.abs(x * 100.0 @ params["w1"])))


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_non_finite_input_reaches_the_loss_and_leaves_the_history_as_it_was(bad):
    params, x = _mlp_args()
    delayed = autocast.amp_fp8_delayed(_mlp, history=H)
    history = delayed.init(params, x)
    value, new, grads = _step(delayed, history, params, x.at[0, 0].set(bad))
    assert not np.isfinite(float(value))
    assert not bool(autocast.all_finite(grads))
    # the operand's row keeps its entries (an inf amax would poison every later scale)
    np.testing.assert_array_equal(new.amax[0][0], history.amax[0][0])
    assert bool(autocast.all_finite(new))


def test_quantisations_wait_for_no_reduction_of_their_own_tensor():
    params, x = _mlp_args()
    delayed = autocast.amp_fp8_delayed(_mlp, history=H)
    history = delayed.init(params, x)
    step_delayed = jax.make_jaxpr(jax.value_and_grad(delayed, argnums=(0, 1)))(history, params, x)
    step_current = jax.make_jaxpr(jax.value_and_grad(autocast.amp(_mlp, compute_dtype="fp8")))(
        params, x
    )
    assert _measure.float8_casts(step_delayed) == _measure.float8_casts(step_current) == 6
    assert _measure.serial_quantisations(step_current) == 6
    assert _measure.serial_quantisations(step_delayed) == 0


def test_products_in_branches_keep_current_scaling():
    def f(w, x):
        y = x @ w  # in the program itself: takes a history
        # a branch's products would leave the untaken branch's histories without a gradient
        y = jax.lax.cond(jnp.sum(y) > 0, lambda y: y @ w, lambda y: -y, y)
        return jnp.sum(y)

    w, x = jnp.eye(8) * 0.5, jnp.ones((4, 8))
    delayed = autocast.amp_fp8_delayed(f, history=H)
    history = delayed.init(w, x)
    assert len(history.amax) == 1
    step = jax.make_jaxpr(jax.grad(delayed, argnums=(0, 1)))(history, w, x)
    current = jax.make_jaxpr(jax.grad(autocast.amp(f, compute_dtype="fp8")))(w, x)
    # the first product's three quantisations (two operands, one output gradient) no longer
    # wait for a reduction; those in the branch still do
    assert _measure.serial_quantisations(step) == _measure.serial_quantisations(current) - 3 > 0
    assert float(delayed(history, w, x)) == float(autocast.amp(f, compute_dtype="fp8")(w, x))


def test_plain_jit_calls_are_evaluated_in_place_and_take_histories():
    inner = jax.jit(lambda w, x: jnp.tanh(x @ w))
    delayed = autocast.amp_fp8_delayed(lambda w, x: jnp.sum(inner(w, inner(w, x))), history=H)
    assert len(delayed.init(jnp.eye(8), jnp.ones((2, 8))).amax) == 2


def test_eager_and_jit_calls_agree():
    params, x = _mlp_args()
    delayed = autocast.amp_fp8_delayed(_mlp, history=H)
    history = delayed.init(params, x)
    assert float(delayed(history, params, x)) == float(jax.jit(delayed)(history, params, x))


def test_a_history_another_function_made_is_refused():
    # the same products and shapes, another program: its amaxes would scale this one's
    # operands 100x too small (15.5 where float32 gives 9299, before the check)
    f = lambda w, x: jnp.mean((x @ w) ** 2)  # noqa: E731
    g = lambda w, x: jnp.mean(((100.0 * x) @ w) ** 2)  # noqa: E731
    w = jax.random.normal(jax.random.PRNGKey(0), (64, 16)) / 8
    x = jax.random.normal(jax.random.PRNGKey(1), (32, 64))
    from_f = autocast.amp_fp8_delayed(f).init(w, x)
    with pytest.raises(ValueError, match="made for another program"):
        autocast.amp_fp8_delayed(g)(from_f, w, x)
    with pytest.raises(ValueError, match="made for another program"):
        jax.jit(autocast.amp_fp8_delayed(g))(from_f, w, x)
    # the same function on another batch size, or wrapped again, is the same program
    again = autocast.amp_fp8_delayed(f)
    assert np.isfinite(float(again(from_f, w, x[:16])))
    own = autocast.amp_fp8_delayed(g)
    assert float(own(own.init(w, x), w, x)) == pytest.approx(float(g(w, x)), rel=0.1)


def test_a_history_of_the_same_program_scaled_by_another_constant_is_refused():
    # the digest leaves shapes out, and the constants they spell, but not the program's own:
    # 0.01 * x and 100 * x have amaxes 10**4 apart, and one's history scaled the other's
    # product to 0.0039 where float32 gives 10277
    f = lambda x, w: jnp.mean(((0.01 * x) @ w) ** 2)  # noqa: E731
    g = lambda x, w: jnp.mean(((100.0 * x) @ w) ** 2)  # noqa: E731
    x = jax.random.normal(jax.random.PRNGKey(2), (32, 64))
    w = jax.random.normal(jax.random.PRNGKey(3), (64, 32))
    from_f = autocast.amp_fp8_delayed(f).init(x, w)
    with pytest.raises(ValueError, match="made for another program"):
        autocast.amp_fp8_delayed(g)(from_f, x, w)
    with pytest.raises(ValueError, match="saved by another program"):
        autocast.amp_fp8_delayed(g).restore(from_f, x, w)
    # a mean's divisor is the batch size: another batch is the same program
    own = autocast.amp_fp8_delayed(f)
    assert float(own(own.init(x[:8], w), x, w)) == pytest.approx(float(f(x, w)), rel=0.15)


def _gelu_model(w, x):
    # a GELU spells 0.5, 1.0 and its tanh approximation's constants as literals, and 0.3 *
    # x one more; the mean divides by the batch
    return jnp.mean(jax.nn.gelu((0.3 * x) @ w) ** 2)


def _gelu_args(rows):
    w = jax.random.normal(jax.random.PRNGKey(4), (16, 16)) / 4
    return w, jax.random.normal(jax.random.PRNGKey(5), (rows, 16))


def test_a_history_made_outside_shard_map_fits_a_function_with_literals_inside_it():
    # init runs outside shard_map; inside, each literal reaches its equation through a
    # placement equation (pvary), which the digest skipped with the constant in it: the
    # history was refused as "made for another program", with no way to comply
    from jax.sharding import PartitionSpec as P

    from autocast import _compat

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
    w, x = _gelu_args(8)
    delayed = autocast.amp_fp8_delayed(_gelu_model, history=H)
    history = delayed.init(w, x)

    def sharded(fn):
        return _compat.shard_map(
            lambda h, w, x: jax.lax.pmean(fn(h, w, x), "d"), mesh, (P(), P(), P("d")), P()
        )

    value = jax.jit(sharded(delayed))(history, w, x)
    assert float(value) == pytest.approx(float(_gelu_model(w, x)), rel=0.15)
    # the constants still count inside: another one is another program there too
    other = autocast.amp_fp8_delayed(lambda w, x: _gelu_model(w, 30.0 * x), history=H)
    with pytest.raises(ValueError, match="made for another program"):
        jax.jit(sharded(other))(history, w, x)


def test_a_history_made_on_a_batch_fits_a_last_batch_of_one_or_two_and_one_example():
    # a GELU's 1.0 and 0.5 equal a size (or its reciprocal) at batches of 1 and 2, and the
    # digest left them out there only: the history made at 32 was refused at 1 and 2
    delayed = autocast.amp_fp8_delayed(_gelu_model, history=H)
    w, x = _gelu_args(32)
    history = delayed.init(w, x)
    for rows in (1, 2, 3):
        value = jax.jit(delayed)(history, w, x[:rows])
        assert float(value) == pytest.approx(float(_gelu_model(w, x[:rows])), rel=0.15)
    per_example = jax.vmap(delayed, in_axes=(None, None, 0))(history, w, x[:, None])
    want = jax.vmap(_gelu_model, in_axes=(None, 0))(w, x[:, None])
    np.testing.assert_allclose(per_example, want, rtol=0.15, atol=1e-3)


def test_a_constant_changed_program_is_refused_at_every_batch_size():
    f = lambda x, w: jnp.mean(((0.01 * x) @ w) ** 2)  # noqa: E731
    g = lambda x, w: jnp.mean(((100.0 * x) @ w) ** 2)  # noqa: E731
    x = jax.random.normal(jax.random.PRNGKey(2), (32, 64))
    w = jax.random.normal(jax.random.PRNGKey(3), (64, 32))
    from_f = autocast.amp_fp8_delayed(f).init(x, w)
    for rows in (32, 2, 1):
        with pytest.raises(ValueError, match="made for another program"):
            autocast.amp_fp8_delayed(g)(from_f, x[:rows], w)
    with pytest.raises(ValueError, match="made for another program"):
        jax.vmap(autocast.amp_fp8_delayed(g), in_axes=(None, 0, None))(from_f, x[:, None], w)


def test_refuses_what_does_not_fit():
    params, x = _mlp_args()
    delayed = autocast.amp_fp8_delayed(_mlp, history=H)
    history = delayed.init(params, x)
    with pytest.raises(TypeError, match="Fp8History"):
        delayed(history.amax, params, x)
    with pytest.raises(ValueError, match="has 1 histories but the program has more"):
        truncated = autocast.Fp8History(
            history.amax[:1], history.inbox[:1], history.measured[:1], history.program
        )
        delayed(truncated, params, x)
    with pytest.raises(ValueError, match=r"expected \(3, 4\)"):
        delayed(dataclasses.replace(history, amax=tuple(h[:, :2] for h in history.amax)), params, x)
    with pytest.raises(TypeError, match="gradient with respect to this history"):
        history.advance(history.amax)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="history must be an int >= 1"):
            autocast.amp_fp8_delayed(_mlp, history=bad)
    # amp itself cannot thread histories: a delayed recipe is refused there, not ignored
    with pytest.raises(ValueError, match="amp_fp8_delayed"):
        autocast.amp(_mlp, compute_dtype=dataclasses.replace(fp8.DEFAULT_RECIPE, history=8))
    # nor run inside another amp, which would drop them
    with pytest.raises(TypeError, match="inside another amp"):
        autocast.amp(lambda p, x: delayed(history, p, x))(params, x)


def test_second_derivatives_are_refused():
    params, x = _mlp_args()
    delayed = autocast.amp_fp8_delayed(lambda x, w: _mlp(w, x), history=H)
    history = delayed.init(x, params)
    with pytest.raises(TypeError, match="first derivatives only"):
        jax.hessian(lambda x: delayed(history, x, params))(x)


@functools.cache
def _tanh_step():
    """One delayed-scaling product and its jitted step, compiled once for every example."""
    delayed = autocast.amp_fp8_delayed(lambda w, x: jnp.sum(jnp.tanh(x @ w)), history=H)
    return delayed, jax.jit(functools.partial(_step, delayed))


@settings(max_examples=15, deadline=None)
@given(
    scales=st.lists(
        st.one_of(st.floats(0.01, 100.0), st.just(float("inf"))), min_size=1, max_size=10
    )
)
def test_history_is_the_last_finite_amaxes(scales):
    """Property: after any schedule of input scales (an inf one is a poisoned batch), the
    operand row holds the newest finite amaxes first, init's value filling the rest; every
    step on finite data gives finite gradients."""
    w = jnp.eye(4) * 0.5
    base = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
    delayed, step = _tanh_step()
    history = delayed.init(w, base)
    seen = [_bound(_amax_bf16(base))] * H
    for s in scales:
        x = base * s if np.isfinite(s) else base.at[0, 0].set(np.inf)
        _, history, grad = step(history, w, x)
        if np.isfinite(s):
            seen = [_bound(_amax_bf16(x)), *seen[:-1]]
            assert bool(jnp.all(jnp.isfinite(grad)))
        np.testing.assert_array_equal(history.amax[0][0], np.asarray(seen, np.float32))


@pytest.mark.once
@pytest.mark.slow
def test_gpt_trains_with_delayed_scaling_as_with_current_scaling():
    config = dict(vocab=32, d=32, layers=2, seq=16)
    params = _models.init_gpt(jax.random.PRNGKey(0), **config)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (8, config["seq"] + 1), 0, config["vocab"])
    optimizer = optax.adam(3e-3)

    def train(loss, history=None):
        p, opt, losses = params, optimizer.init(params), []

        @jax.jit
        def step(history, p, opt):
            if history is None:
                value, grads = jax.value_and_grad(loss)(p, tokens)
            else:
                value, history, grads = _step(loss, history, p, tokens)
            updates, opt = optimizer.update(grads, opt, p)
            return history, optax.apply_updates(p, updates), opt, value

        for _ in range(40):
            history, p, opt, value = step(history, p, opt)
            losses.append(float(value))
        return losses

    delayed = autocast.amp_fp8_delayed(_models.gpt_loss, history=16)
    got = train(delayed, delayed.init(params, tokens))
    want = train(autocast.amp(_models.gpt_loss, compute_dtype="fp8"))
    assert got[-1] < 0.8 * got[0]
    assert abs(got[-1] - want[-1]) / want[-1] < 0.1


def _scanned(params, x):
    def block(h, w):
        return jnp.tanh(h @ w), None

    h, _ = jax.lax.scan(block, x, params)
    return jnp.mean(h**2)


def test_scanned_layers_each_take_their_own_history():
    layers = (
        jax.random.normal(jax.random.PRNGKey(0), (3, 8, 8))
        * jnp.array([0.2, 0.3, 0.4])[:, None, None]
    )
    x = jax.random.normal(jax.random.PRNGKey(1), (4, 8))
    delayed = autocast.amp_fp8_delayed(_scanned, history=H)
    history = delayed.init(layers, x)
    (stacked,) = history.amax
    assert stacked.shape == (3, 3, H)
    # the weight row of each layer: that layer's amax
    for i in range(3):
        assert float(stacked[i, 1, 0]) == _bound(_amax_bf16(layers[i]))
    step = jax.make_jaxpr(jax.value_and_grad(delayed, argnums=(0, 1)))(history, layers, x)
    assert _measure.serial_quantisations(step) == 0
    # the next step: each layer's history moves on with its own amax
    _, new, got = _step(delayed, history, layers * 2.0, x)
    for i in range(3):
        assert float(new.amax[0][i, 1, 0]) == _bound(_amax_bf16(layers[i] * 2.0))
    np.testing.assert_array_equal(new.amax[0][:, :, 1:], stacked[:, :, :-1])
    # at a steady state, as close to float32 as current scaling (the scales are powers of two
    # at or above the amax, and the largest of the history: coarser by up to twice)
    _, _, got = _step(delayed, history, layers, x)
    current = jax.grad(autocast.amp(_scanned, compute_dtype="fp8"))(layers, x)
    f32 = jax.grad(_scanned)(layers, x)
    assert _measure.relative_error(got, f32) < 1.5 * _measure.relative_error(current, f32)


def test_checkpointed_products_take_histories():
    f = lambda w, x: jnp.sum(jax.checkpoint(lambda w, x: jnp.tanh(x @ w) @ w)(w, x))  # noqa: E731
    w, x = jnp.eye(8) * 0.5, jnp.ones((4, 8))
    delayed = autocast.amp_fp8_delayed(f, history=H)
    history = delayed.init(w, x)
    assert len(history.amax) == 2
    step = jax.make_jaxpr(jax.value_and_grad(delayed, argnums=(0, 1)))(history, w, x)
    assert _measure.serial_quantisations(step) == 0
    want = jax.grad(autocast.amp(f, compute_dtype="fp8"))(w, x)
    assert _measure.relative_error(jax.grad(delayed, argnums=1)(history, w, x), want) < 0.1


def test_without_the_histories_gradient_no_amax_pass_is_left():
    # by XLA's cost analysis: evaluating (or differentiating the parameters only) under
    # delayed scaling reads each operand once, where current scaling reads it twice (its
    # amax, then the rounding); the amaxes are only wanted for the next history
    params, x = _mlp_args()
    x = jnp.tile(x, (16, 1))
    delayed = autocast.amp_fp8_delayed(_mlp, history=H)
    history = delayed.init(params, x)
    current = autocast.amp(_mlp, compute_dtype="fp8")
    forward = (
        _measure.bytes_accessed(lambda p, x: delayed(history, p, x), params, x),
        _measure.bytes_accessed(current, params, x),
    )
    params_only = (
        _measure.bytes_accessed(jax.grad(lambda p, x: delayed(history, p, x)), params, x),
        _measure.bytes_accessed(jax.grad(current), params, x),
    )
    assert forward[0] < 0.9 * forward[1]
    assert params_only[0] < 0.9 * params_only[1]


def _twice(delayed):
    """A step that uses the history in two calls (two microbatches of one step)."""

    def loss(history, params, x):
        return delayed(history, params, x[:4]) + delayed(history, params, x[4:])

    return loss


def _accumulated(delayed):
    """Gradient accumulation over microbatches with a scan: the history closed over."""

    def loss(history, params, xs):
        def body(total, x):
            return total + delayed(history, params, x), None

        return jax.lax.scan(body, 0.0, xs)[0]

    return loss


@pytest.mark.parametrize("use", ["twice", "vmap", "scan"])
def test_a_history_used_many_times_takes_the_largest_amax_of_them(use):
    # the gradients of every use are summed; the next history must hold their maximum, and
    # its older entries must not grow, however many uses and steps
    params, x = _mlp_args()
    x = x.at[5].multiply(40.0)  # one example, in one microbatch, far larger than the rest
    delayed = autocast.amp_fp8_delayed(_mlp, history=H)
    history = delayed.init(params, x)
    loss = {
        "twice": _twice(delayed),
        "vmap": lambda h, p, x: jnp.sum(jax.vmap(lambda r: delayed(h, p, r[None]))(x)),
        "scan": lambda h, p, x: _accumulated(delayed)(h, p, x.reshape(2, 4, -1)),
    }[use]
    step = jax.jit(lambda h, p, x: jax.grad(loss, argnums=(0, 1))(h, p, x))
    first = history
    for _ in range(5):
        g_history, grads = step(history, params, x)
        history = history.advance(g_history)
        assert bool(autocast.all_finite(grads))
    want = _bound(_amax_bf16(x))
    np.testing.assert_array_equal(history.amax[0][0], np.full(H, want, np.float32))
    # the weights' row: the same amax in every use, never summed up
    np.testing.assert_array_equal(history.amax[0][1], first.amax[0][1])


def test_a_product_no_gradient_reaches_keeps_current_scaling():
    params, x = _mlp_args()

    def f(p, x):
        h = jax.lax.stop_gradient(jnp.tanh(x @ p["w1"]))  # never differentiated
        return jnp.mean((h @ p["w2"]) ** 2)

    delayed = autocast.amp_fp8_delayed(f, history=H)
    history = delayed.init(params, x)
    assert history.measured == ((False, False, False), (True, True, True))
    current = autocast.amp(f, compute_dtype="fp8")
    reference = f(params, x)
    for _ in range(3):
        value, history, _ = _step(delayed, history, params, x)
        assert abs(float(value) - float(reference)) < 0.05 * float(reference)
    assert abs(float(value) - float(current(params, x))) < 0.05 * float(reference)


def test_with_has_aux_a_product_only_the_aux_uses_keeps_current_scaling():
    # its backward pass never runs in training, so no history of it could follow its range
    params, x = _mlp_args()

    def f(p, x):
        return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"]) ** 2), jnp.sum(x @ p["w2"][:16])

    delayed = autocast.amp_fp8_delayed(f, history=H, has_aux=True)
    history = delayed.init(params, x)
    assert history.measured == ((True, True, True), (True, True, True), (False, False, False))
    for scale in (1.0, 30.0, 30.0):
        (value, aux), (g_history, _) = jax.value_and_grad(delayed, argnums=(0, 1), has_aux=True)(
            history, params, x * scale
        )
        history = history.advance(g_history)
    # the aux's product in current scaling: what amp(compute_dtype="fp8") gives it (a
    # history still at scale 1 would saturate x * 30). On a GPU, XLA may quantise the float32
    # operands where a CPU quantises their bfloat16 rounding (excess precision), and the two
    # programs need not make the same choice: they came 1.08% apart on an H100.
    want = autocast.amp(f, compute_dtype="fp8")(params, x * 30.0)[1]
    bound = 0.01 if jax.default_backend() == "cpu" else 0.03
    assert abs(float(aux) - float(want)) < bound * abs(float(want))


def test_all_zero_tensors_leave_the_history_alone():
    # a masked batch (zero gradients) pushes nothing: the next step keeps its scales
    params, x = _mlp_args()
    delayed = autocast.amp_fp8_delayed(_mlp, history=1)
    history = delayed.init(params, x)
    _, after_zeros, _ = _step(delayed, history, params, jnp.zeros_like(x))
    np.testing.assert_array_equal(after_zeros.amax[0][0], history.amax[0][0])
    np.testing.assert_array_equal(after_zeros.amax[1][2], history.amax[1][2])
    current = jax.grad(autocast.amp(_mlp, compute_dtype="fp8"))(params, x)
    _, _, grads = _step(delayed, after_zeros, params, x)
    assert _measure.relative_error(grads, current) < 0.15


def test_a_zero_initialised_layer_keeps_current_scaling():
    params, x = _mlp_args()
    zero = {**params, "w2": jnp.zeros_like(params["w2"])}
    delayed = autocast.amp_fp8_delayed(_mlp, history=H)
    history = delayed.init(zero, x)
    # the zero weights' row, and the gradient rows they zero, keep current scaling
    assert history.measured == ((True, True, False), (True, False, False))
    trained = {**params, "w2": params["w2"] * 1e-3}
    want = float(_mlp(trained, x))
    assert abs(float(delayed(history, trained, x)) - want) < 0.1 * want


def test_init_refuses_tracers_and_advance_a_gradient_of_another_shape():
    params, x = _mlp_args()
    delayed = autocast.amp_fp8_delayed(_mlp, history=H)
    with pytest.raises(TypeError, match="concrete arguments"):
        jax.jit(delayed.init)(params, x)
    history = delayed.init(params, x)
    per_example = jax.vmap(jax.grad(delayed), in_axes=(None, None, 0))(history, params, x[:, None])
    with pytest.raises(TypeError, match="summed first"):
        history.advance(per_example)


# Under shard_map (every device takes the largest amax of any): tests/multidevice_check.py.


def _scaler_case():
    f = lambda w, x: jnp.mean((x @ w) ** 2)  # noqa: E731
    w = jax.random.normal(jax.random.PRNGKey(0), (64, 16)) / 8
    x = jax.random.normal(jax.random.PRNGKey(1), (32, 64))
    return f, w, x, jax.grad(f)(w, x)


def test_under_a_loss_scaler_the_gradient_rows_follow_the_scale():
    # init measures unscaled gradients; the scaler multiplies them by 2**15. Before the
    # history followed the scale, e5m2 saturated them and the weight gradient came out
    # 0.00012 of float32's, counted as finite and applied.
    f, w, x, want = _scaler_case()
    loss8 = autocast.amp_fp8_delayed(f, history=4)
    history = loss8.init(w, x)
    step = jax.jit(autocast.dynamic_scale_grad(loss8, argnums=(0, 1)))
    state = autocast.DynamicScalerState()
    for _ in range(3):
        state, (g_history, g_w) = step(history, w, x, dynamic_scaler_state=state)
        ratio = float(jnp.linalg.norm(g_w) / jnp.linalg.norm(want))
        assert 0.95 < ratio < 1.05, ratio
        assert float(state.loss_scale) == 2.0**15  # nothing overflowed, nothing was skipped
        history = history.advance(g_history)
    # the history keeps gradient amaxes at its own loss scale (1): the scaler's are undone
    assert float(history.loss_scale) == 1.0
    assert (
        np.asarray(history.amax[0][2]).tolist() == np.asarray(loss8.init(w, x).amax[0][2]).tolist()
    )


def test_a_loss_scale_applied_by_hand_takes_at_loss_scale():
    f, w, x, want = _scaler_case()
    loss8 = autocast.amp_fp8_delayed(f, history=4)
    history = loss8.init(w, x)
    scale = autocast.DynamicLossScale(jnp.float32(2.0**15))
    scaled = lambda h, w, x: scale.scale(loss8(h, w, x))  # noqa: E731
    for h, right in ((history, False), (history.at_loss_scale(scale.loss_scale), True)):
        g_h, g_w = jax.grad(scaled, argnums=(0, 1))(h, w, x)
        ratio = float(jnp.linalg.norm(scale.unscale(g_w)) / jnp.linalg.norm(want))
        assert (0.95 < ratio < 1.05) is right, ratio
    # advance from a step at the history's own scale keeps that scale's amaxes
    moved = history.at_loss_scale(4.0)
    g_h, _ = jax.grad(lambda h, w, x: 4.0 * loss8(h, w, x), argnums=(0, 1))(moved, w, x)
    assert (
        np.asarray(moved.advance(g_h).amax[0][2]).tolist() == np.asarray(moved.amax[0][2]).tolist()
    )
