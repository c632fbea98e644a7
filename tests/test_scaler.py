"""Tests for loss scaling around a differentiated function: ``autocast._src.scaling.jaxamp``
(jaxamp's face).

Covers the ``DynamicScalerState`` rule (hand-written transitions, a property test against a
plain-Python model run under one ``jit``, agreement with ``DynamicLossScale``), the shapes,
values and dtypes of ``dynamic_scale_grad`` / ``dynamic_scale_value_and_grad`` (``has_aux``,
``argnums``, ``filter``), ``redo_on_nan`` retries inside the compiled program, input
validation, round trips (jit, pytree, pickle, flax, orbax), float16 ``amp`` training of the
reference MLP, the absence of host synchronisation and ``axis_name`` under ``vmap``.
"""

from __future__ import annotations

import inspect
import pickle
from typing import Callable

import equinox as eqx
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import division_ulps, eqns_named, require
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

import autocast
from autocast._src.demo import models as _models
from autocast._src.scaling import jaxamp
from autocast._src.tools import measure as _measure

JAXAMP_FIELDS = ("patience", "adjust_factor", "scaler", "count", "total_resets")
# after jaxamp's: the floor and the health counters (autocast.ScalingHealth)
FIELDS = (*JAXAMP_FIELDS, "min_scaler", "skipped_in_a_row", "steps_at_floor", "zero_grad_steps")
FIELD_DTYPES = {
    "patience": jnp.int32,
    "adjust_factor": jnp.float32,
    "scaler": jnp.float32,
    "count": jnp.int32,
    "total_resets": jnp.int32,
    "min_scaler": jnp.float32,
    "skipped_in_a_row": jnp.int32,
    "steps_at_floor": jnp.int32,
    "zero_grad_steps": jnp.int32,
}
TINY = np.float32(np.finfo(np.float32).tiny)
T = jnp.bool_(True)
F = jnp.bool_(False)

# One amp-wrapped MLP loss for the whole module: amp caches its traces per wrapped function.
AMP_MLP_F16 = autocast.amp(_models.mlp_loss, compute_dtype=jnp.float16)


def _fields(state):
    """Every field of a DynamicScalerState as a Python number."""
    return {
        name: (float if name in ("adjust_factor", "scaler", "min_scaler") else int)(
            getattr(state, name)
        )
        for name in FIELDS
    }


def _assert_storage(state):
    assert type(state) is autocast.DynamicScalerState
    for name in FIELDS:
        leaf = jnp.asarray(getattr(state, name))
        assert leaf.dtype == FIELD_DTYPES[name], (name, leaf.dtype)
        assert leaf.shape == (), (name, leaf.shape)


def _assert_same_state(a, b):
    _assert_storage(a)
    _assert_storage(b)
    for name in FIELDS:
        x, y = np.asarray(getattr(a, name)), np.asarray(getattr(b, name))
        assert x.dtype == y.dtype and x == y, (name, x, y)


def _sample_state():
    # Every field differs from its default, so a field silently reset to its default shows.
    return autocast.DynamicScalerState(
        patience=7,
        adjust_factor=4.0,
        scaler=2.0**9,
        count=3,
        total_resets=5,
        min_scaler=0.5,
        skipped_in_a_row=2,
        steps_at_floor=1,
        zero_grad_steps=4,
    )


def _mlp_data(batch=64, seed=0):
    kx, ky = jax.random.split(jax.random.PRNGKey(seed))
    x = jax.random.normal(kx, (batch, 32), jnp.float32)
    y = jax.random.randint(ky, (batch,), 0, 10)
    return x, y


def _rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


# ---- 1. the DynamicScalerState rule ---------------------------------------------------------


def test_defaults_and_storage_dtypes():
    state = autocast.DynamicScalerState()
    _assert_storage(state)
    assert _fields(state) == {
        "patience": 2000,
        "adjust_factor": 2.0,
        "scaler": 2.0**15,
        "count": 0,
        "total_resets": 0,
        "min_scaler": 1.0,
        "skipped_in_a_row": 0,
        "steps_at_floor": 0,
        "zero_grad_steps": 0,
    }
    assert float(state.loss_scale) == 2.0**15


def test_hand_written_transitions():
    s = autocast.DynamicScalerState(patience=2, adjust_factor=2.0, scaler=8.0)
    seen = []
    for flag in [T, T, T, T, F, T, F, F, T, T, T]:
        s = s.adjust(flag)
        _assert_storage(s)
        seen.append((float(s.scaler), int(s.count), int(s.total_resets)))
    assert seen == [
        (8.0, 1, 0),  # count 0 < patience: count += 1
        (8.0, 2, 0),  # count 1 < patience: count += 1
        (16.0, 0, 0),  # count 2 >= patience: grow, reset
        (16.0, 1, 0),
        (8.0, 0, 1),  # non-finite: divide, reset, total_resets += 1
        (8.0, 1, 1),
        (4.0, 0, 2),
        (2.0, 0, 3),
        (2.0, 1, 3),
        (2.0, 2, 3),
        (4.0, 0, 3),
    ]
    # patience and adjust_factor are carried along untouched.
    assert int(s.patience) == 2 and float(s.adjust_factor) == 2.0


def test_count_already_past_patience_grows_at_once():
    s = autocast.DynamicScalerState(patience=2, adjust_factor=3.0, scaler=1.0, count=9)
    s = s.adjust(T)
    assert (float(s.scaler), int(s.count)) == (3.0, 0)


def test_scaler_never_becomes_zero_or_inf():
    big = float(np.finfo(np.float32).max) / 2
    s = autocast.DynamicScalerState(patience=1, adjust_factor=4.0, scaler=big, count=1)
    for _ in range(5):
        s = s.adjust(T)
        assert np.isfinite(float(s.scaler)) and float(s.scaler) > 0
    assert float(s.scaler) == np.float32(big)  # growth that would overflow is not taken
    s = autocast.DynamicScalerState(patience=1, adjust_factor=2.0**20, scaler=1e-30, min_scaler=0.0)
    for _ in range(5):
        s = s.adjust(F)
        assert np.isfinite(float(s.scaler)) and float(s.scaler) > 0
    assert float(s.scaler) >= TINY
    assert int(s.total_resets) == 5


def test_adjust_rejects_non_boolean_flag():
    s = autocast.DynamicScalerState()
    with pytest.raises(TypeError, match="grads_finite"):
        s.adjust(jnp.float32(1.0))
    with pytest.raises(TypeError, match="grads_finite"):
        s.adjust(jnp.array([True, False]))


def _reference_step(scaler, count, resets, patience, factor, finite):
    """Plain-Python (numpy float32) model of one step of the rule, including the never-0/inf
    guard."""
    scaler, factor = np.float32(scaler), np.float32(factor)
    with np.errstate(over="ignore", under="ignore"):
        if not finite:
            return max(np.float32(scaler / factor), TINY), 0, resets + 1
        if count < patience:
            return scaler, count + 1, resets
        grown = np.float32(scaler * factor)
        return (grown if np.isfinite(grown) else scaler), 0, resets


@jax.jit
def _run_both_faces(state, loss_scale, flags):
    """Adjusts a DynamicScalerState and a DynamicLossScale along ``flags`` in one program."""

    def body(carry, flag):
        s, ls = carry
        s, ls = s.adjust(flag), ls.adjust(flag)
        return (s, ls), (s.scaler, s.count, s.total_resets, ls.loss_scale, ls.counter)

    return lax.scan(body, (state, loss_scale), flags)


N_FLAGS = 48


@settings(max_examples=60, deadline=None)
@given(
    flags=st.lists(st.booleans(), min_size=N_FLAGS, max_size=N_FLAGS),
    patience=st.integers(1, 6),
    factor=st.sampled_from([1.5, 2.0, 3.0, 10.0, 2.0**20]),
    scaler=st.sampled_from([float(TINY), 1e-30, 0.75, 1.0, 2.0**15, 1e30, 3e38]),
    count=st.integers(0, 8),
    resets=st.integers(0, 3),
)
def test_property_rule_matches_reference_and_dynamic_loss_scale(
    flags, patience, factor, scaler, count, resets
):
    state = autocast.DynamicScalerState(
        patience=patience,
        adjust_factor=factor,
        scaler=scaler,
        count=count,
        total_resets=resets,
        min_scaler=0.0,  # no floor but float32's smallest normal number, as the reference's
    )
    # The same core behind the jmp face: growth after patience + 1 finite steps, same floor.
    twin = autocast.DynamicLossScale(
        scaler, counter=count, period=patience + 1, factor=factor, min_loss_scale=TINY
    )
    (final, _), (scalers, counts, totals, ls_scales, ls_counters) = _run_both_faces(
        state, twin, jnp.asarray(flags)
    )
    scalers, counts, totals = np.asarray(scalers), np.asarray(counts), np.asarray(totals)
    assert scalers.dtype == np.float32
    assert np.all(np.isfinite(scalers)) and np.all(scalers > 0), scalers

    # each step against the rule applied to the state before it
    before = (scaler, count, resets)
    for i, (flag, g) in enumerate(zip(flags, zip(scalers, counts.tolist(), totals.tolist()))):
        e = _reference_step(*before, patience, factor, flag)
        assert g[1:] == e[1:], (i, flags[: i + 1], e, g)
        np.testing.assert_array_max_ulp(g[0], e[0], maxulp=division_ulps(), dtype=np.float32)
        before = g

    np.testing.assert_array_equal(np.asarray(ls_scales), scalers)
    np.testing.assert_array_equal(np.asarray(ls_counters), counts)
    assert int(final.patience) == patience and float(final.adjust_factor) == np.float32(factor)
    assert int(final.total_resets) == resets + flags.count(False)


def test_scaler_rule_is_the_shared_core(monkeypatch):
    """One scaling core, two faces: DynamicScalerState.adjust goes through next_loss_scale."""
    calls = []
    original = jaxamp.next_loss_scale

    def spy(*args):
        calls.append(args)
        return original(*args)

    monkeypatch.setattr(jaxamp, "next_loss_scale", spy)
    autocast.DynamicScalerState(patience=3).adjust(T)
    assert len(calls) == 1


def test_dynamic_loss_scale_works_as_the_state():
    """The jmp face can drive dynamic_scale_value_and_grad too, and keeps its own type."""
    grad_fn = autocast.dynamic_scale_value_and_grad(_overflowing_loss, redo_on_nan=5)
    state, (value, grads) = grad_fn(
        W8, dynamic_scaler_state=autocast.DynamicLossScale(2.0**15, period=1)
    )
    assert type(state) is autocast.DynamicLossScale
    np.testing.assert_array_equal(np.asarray(grads), np.full(4, 16.0, np.float32))
    # 2**15 .. 2**12 overflowed (halved four times), 2**11 worked and, with period 1, grew.
    assert float(state.loss_scale) == 2.0**12 and int(state.counter) == 0


# ---- 2. shapes, values and dtypes of the returned functions --------------------------------


def _small_loss(params, x):
    h = jnp.tanh(x @ params["w"]) + params["b"]
    return jnp.mean(h * h)


def _small_params(dtype):
    kw, kx = jax.random.split(jax.random.PRNGKey(3))
    params = {
        "w": (jax.random.normal(kw, (4, 3)) * 0.5).astype(dtype),
        "b": jnp.linspace(-0.3, 0.3, 3).astype(dtype),
    }
    x = jax.random.normal(kx, (5, 4)).astype(dtype)
    return params, x


TOL = {jnp.float32: 1e-6, jnp.bfloat16: 1e-2, jnp.float16: 1e-2}


def _assert_tree_close(got, want, rtol):
    got_l, got_t = jax.tree_util.tree_flatten(got)
    want_l, want_t = jax.tree_util.tree_flatten(want)
    assert got_t == want_t
    for g, w in zip(got_l, want_l):
        assert g.dtype == w.dtype, (g.dtype, w.dtype)
        assert g.shape == w.shape
        np.testing.assert_allclose(
            np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=rtol, atol=rtol * 1e-2
        )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_value_and_grad_unscaled_in_primal_dtype(dtype):
    params, x = _small_params(dtype)
    want_value, want_grads = jax.value_and_grad(_small_loss)(params, x)
    state0 = autocast.DynamicScalerState()
    grad_fn = autocast.dynamic_scale_value_and_grad(_small_loss)
    state, (value, grads) = grad_fn(params, x, dynamic_scaler_state=state0)
    _assert_storage(state)
    assert (int(state.count), int(state.total_resets), float(state.scaler)) == (1, 0, 2.0**15)
    assert value.dtype == want_value.dtype == dtype
    np.testing.assert_allclose(float(value), float(want_value), rtol=TOL[dtype])
    _assert_tree_close(grads, want_grads, TOL[dtype])
    # The gradients really are unscaled: nowhere near 2**15 times too large.
    largest = max(float(jnp.abs(g).max()) for g in jax.tree_util.tree_leaves(grads))
    assert largest < 10

    state_g, grads_only = autocast.dynamic_scale_grad(_small_loss)(
        params, x, dynamic_scaler_state=state0
    )
    _assert_same_state(state_g, state)
    _assert_tree_close(grads_only, want_grads, TOL[dtype])


def test_has_aux_return_shapes():
    params, x = _small_params(jnp.float32)

    def loss_aux(p, x):
        v = _small_loss(p, x)
        return v, {"double": 2 * v, "tag": "aux-string"}

    state0 = autocast.DynamicScalerState()
    want_value, want_grads = jax.value_and_grad(_small_loss)(params, x)

    state, ((value, aux), grads) = autocast.dynamic_scale_value_and_grad(loss_aux, has_aux=True)(
        params, x, dynamic_scaler_state=state0
    )
    assert isinstance(state, autocast.DynamicScalerState)
    np.testing.assert_allclose(float(value), float(want_value), rtol=1e-6)
    np.testing.assert_allclose(float(aux["double"]), 2 * float(want_value), rtol=1e-6)
    assert aux["tag"] == "aux-string"
    _assert_tree_close(grads, want_grads, 1e-6)

    state, (grads, aux) = autocast.dynamic_scale_grad(loss_aux, has_aux=True)(
        params, x, dynamic_scaler_state=state0
    )
    assert isinstance(state, autocast.DynamicScalerState)
    assert aux["tag"] == "aux-string"
    np.testing.assert_allclose(float(aux["double"]), 2 * float(want_value), rtol=1e-6)
    _assert_tree_close(grads, want_grads, 1e-6)

    # Without has_aux: (state, grads) and (state, (value, grads)).
    out = autocast.dynamic_scale_grad(_small_loss)(params, x, dynamic_scaler_state=state0)
    assert len(out) == 2 and isinstance(out[0], autocast.DynamicScalerState)
    assert jax.tree_util.tree_structure(out[1]) == jax.tree_util.tree_structure(params)
    out = autocast.dynamic_scale_value_and_grad(_small_loss)(params, x, dynamic_scaler_state=state0)
    state, (value, grads) = out
    assert value.shape == ()
    assert jax.tree_util.tree_structure(grads) == jax.tree_util.tree_structure(params)


def _three_args(a, b, c):
    return jnp.sum(jnp.sin(a) * b) + jnp.sum(c**2 * b[0])


@pytest.mark.parametrize("filter_", [True, False])
@pytest.mark.parametrize("argnums", [1, 2, (0, 2), (2, 0, 1)])
def test_argnums_passed_through(argnums, filter_):
    a = jnp.array([0.1, 0.2, 0.3])
    b = jnp.array([1.0, -2.0, 0.5])
    c = jnp.array([0.7, 0.8])
    want_value, want = jax.value_and_grad(_three_args, argnums=argnums)(a, b, c)
    state, (value, got) = autocast.dynamic_scale_value_and_grad(
        _three_args, argnums=argnums, filter=filter_
    )(a, b, c, dynamic_scaler_state=autocast.DynamicScalerState())
    np.testing.assert_allclose(float(value), float(want_value), rtol=1e-6)
    _assert_tree_close(got, want, 1e-6)
    if isinstance(argnums, tuple):
        assert isinstance(got, tuple) and len(got) == len(argnums)
    state, got = autocast.dynamic_scale_grad(_three_args, argnums=argnums, filter=filter_)(
        a, b, c, dynamic_scaler_state=autocast.DynamicScalerState()
    )
    _assert_tree_close(got, want, 1e-6)


def _mixed_tree():
    return {
        "w": jnp.array([0.5, -1.0, 2.0]),
        "half": jnp.array([0.01, 0.02], jnp.float16),  # 2 * half * 2**15 fits float16
        "name": "layer-1",
        "n": 3,
        "py_float": 2.0,
        "act": jnp.tanh,
        "idx": jnp.array([2, 0], jnp.int32),
        "mask": jnp.array([True, False, True]),
    }


def _mixed_loss(tree, x):
    assert tree["name"] == "layer-1" and tree["n"] == 3  # static leaves arrive unchanged
    w = tree["act"](tree["w"] * x) * tree["n"] * tree["py_float"]
    w = jnp.where(tree["mask"], w, 0.0)
    return jnp.sum(w[tree["idx"]]) + jnp.sum(tree["half"].astype(jnp.float32) ** 2)


def test_filter_true_gives_none_for_non_float_leaves():
    tree, x = _mixed_tree(), jnp.float32(0.3)
    state, (value, grads) = autocast.dynamic_scale_value_and_grad(_mixed_loss)(
        tree, x, dynamic_scaler_state=autocast.DynamicScalerState()
    )
    for name in ("name", "n", "py_float", "act", "idx", "mask"):
        assert grads[name] is None, (name, grads[name])

    # The float leaves match jax.value_and_grad over them with the rest closed over.
    def over_floats(w, half):
        return _mixed_loss({**tree, "w": w, "half": half}, x)

    want_value, (gw, gh) = jax.value_and_grad(over_floats, argnums=(0, 1))(tree["w"], tree["half"])
    np.testing.assert_allclose(float(value), float(want_value), rtol=1e-6)
    assert grads["w"].dtype == jnp.float32 and grads["half"].dtype == jnp.float16
    np.testing.assert_allclose(np.asarray(grads["w"]), np.asarray(gw), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grads["half"], np.float32), np.asarray(gh, np.float32))
    assert int(state.count) == 1 and int(state.total_resets) == 0

    # dynamic_scale_grad, with redo_on_nan (the retry loop carries arrays only).
    state, grads2 = autocast.dynamic_scale_grad(_mixed_loss, redo_on_nan=2)(
        tree, x, dynamic_scaler_state=autocast.DynamicScalerState()
    )
    assert grads2["name"] is None and grads2["act"] is None and grads2["idx"] is None
    np.testing.assert_allclose(np.asarray(grads2["w"]), np.asarray(gw), rtol=1e-6)


class _Linear(eqx.Module):
    weight: jax.Array
    bias: jax.Array
    label: str
    activation: Callable
    width: int
    steps: jax.Array


def test_filter_true_with_equinox_module():
    model = _Linear(
        weight=jnp.array([[0.5, -0.25], [1.0, 0.75]]),
        bias=jnp.array([0.1, -0.1]),
        label="dense",
        activation=jax.nn.gelu,
        width=2,
        steps=jnp.int32(4),
    )
    x = jnp.array([1.0, -2.0])

    def loss(m, x):
        return jnp.sum(m.activation(x @ m.weight + m.bias) ** 2) * m.width + 0.0 * m.steps

    state, (value, grads) = autocast.dynamic_scale_value_and_grad(loss)(
        model, x, dynamic_scaler_state=autocast.DynamicScalerState()
    )
    assert isinstance(grads, _Linear)
    assert grads.label is None and grads.activation is None and grads.width is None
    assert grads.steps is None
    want_value, want = eqx.filter_value_and_grad(loss)(model, x)
    np.testing.assert_allclose(float(value), float(want_value), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grads.weight), np.asarray(want.weight), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grads.bias), np.asarray(want.bias), rtol=1e-6)
    # And under jit, with the non-array fields held static by eqx.partition.
    grad_fn = autocast.dynamic_scale_value_and_grad(loss)
    arrays, static = eqx.partition(model, eqx.is_array)

    @jax.jit
    def jitted(arrays, x, state):
        return grad_fn(eqx.combine(arrays, static), x, dynamic_scaler_state=state)

    _, (value_j, grads_j) = jitted(arrays, x, autocast.DynamicScalerState())
    np.testing.assert_allclose(np.asarray(grads_j.weight), np.asarray(want.weight), rtol=1e-6)
    assert grads_j.label is None


def test_returned_function_advertises_dynamic_scaler_state():
    """The returned function takes the keyword dynamic_scaler_state, so tools that bind
    arguments by signature (eqx.filter_jit, jax.jit's donate_argnames) must accept it."""
    model = _Linear(
        weight=jnp.eye(2),
        bias=jnp.zeros(2),
        label="d",
        activation=jnp.tanh,
        width=1,
        steps=jnp.int32(0),
    )
    x = jnp.array([1.0, -2.0])

    def loss(m, x):
        return jnp.sum(m.activation(x @ m.weight + m.bias) ** 2)

    grad_fn = autocast.dynamic_scale_value_and_grad(loss)
    params = inspect.signature(grad_fn).parameters
    assert "dynamic_scaler_state" in params, (
        f"inspect.signature(grad_fn) is {inspect.signature(grad_fn)}: functools.wraps(fun) "
        "copies fun's signature (via __wrapped__) and hides the dynamic_scaler_state keyword"
    )
    state, (_, grads) = eqx.filter_jit(grad_fn)(
        model, x, dynamic_scaler_state=autocast.DynamicScalerState()
    )
    assert int(state.count) == 1 and grads.label is None
    donated = jax.jit(
        autocast.dynamic_scale_grad(lambda w: jnp.sum(w**2)),
        donate_argnames="dynamic_scaler_state",
    )
    state, grads = donated(jnp.ones(2), dynamic_scaler_state=autocast.DynamicScalerState())
    np.testing.assert_array_equal(np.asarray(grads), [2.0, 2.0])


def test_filter_false_is_jax_value_and_grad():
    # A Python float leaf: jax.value_and_grad differentiates it, filter=True would not.
    tree = {"w": jnp.array([0.5, -1.0]), "k": 2.0}

    def loss(t, x):
        return jnp.sum(jnp.sin(t["w"] * x) * t["k"])

    x = jnp.float32(1.5)
    want_value, want = jax.value_and_grad(loss)(tree, x)
    state, (value, grads) = autocast.dynamic_scale_value_and_grad(loss, filter=False)(
        tree, x, dynamic_scaler_state=autocast.DynamicScalerState()
    )
    np.testing.assert_allclose(float(value), float(want_value), rtol=1e-6)
    assert grads["k"] is not None
    np.testing.assert_allclose(float(grads["k"]), float(want["k"]), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grads["w"]), np.asarray(want["w"]), rtol=1e-6)
    _, filtered = autocast.dynamic_scale_grad(loss, filter=True)(
        tree, x, dynamic_scaler_state=autocast.DynamicScalerState()
    )
    assert filtered["k"] is None

    # Integer inputs: jax.value_and_grad refuses them, and so does filter=False.
    int_tree = {"w": jnp.array([0.5]), "i": jnp.array([1])}

    def int_loss(t):
        return jnp.sum(t["w"] * t["i"])

    with pytest.raises(TypeError):
        jax.value_and_grad(int_loss)(int_tree)
    with pytest.raises(TypeError):
        autocast.dynamic_scale_value_and_grad(int_loss, filter=False)(
            int_tree, dynamic_scaler_state=autocast.DynamicScalerState()
        )


# ---- 3. redo_on_nan -------------------------------------------------------------------------


def _overflowing_loss(w):
    # d/dw sum(w**2) = 2w = 16 at w = 8; times the scale, float16 overflows (max 65504) for
    # every scale >= 2**12, so at the initial 2**15 it takes four halvings to fit.
    return jnp.sum(w.astype(jnp.float16) ** 2).astype(jnp.float32)


W8 = jnp.full((4,), 8.0, jnp.float32)


def test_redo_on_nan_zero_returns_non_finite_and_halves():
    state, (value, grads) = autocast.dynamic_scale_value_and_grad(_overflowing_loss, redo_on_nan=0)(
        W8, dynamic_scaler_state=autocast.DynamicScalerState()
    )
    assert not bool(autocast.all_finite(grads))
    assert float(value) == 256.0
    assert float(state.scaler) == 2.0**14
    assert (int(state.count), int(state.total_resets)) == (0, 1)


@pytest.mark.parametrize("k", [4, 5, 30])
def test_redo_on_nan_enough_retries(k):
    grad_fn = autocast.dynamic_scale_value_and_grad(_overflowing_loss, redo_on_nan=k)
    state, (value, grads) = grad_fn(W8, dynamic_scaler_state=autocast.DynamicScalerState())
    assert bool(autocast.all_finite(grads)), grads
    np.testing.assert_array_equal(np.asarray(grads), np.full(4, 16.0, np.float32))
    assert grads.dtype == jnp.float32 and float(value) == 256.0
    # Four attempts overflowed (2**15 .. 2**12), the fifth (2**11) worked: four retries.
    assert int(state.total_resets) == 4
    assert float(state.scaler) == 2.0**11
    assert int(state.count) == 1


def test_redo_on_nan_no_retry_when_first_attempt_is_finite():
    w = jnp.full((4,), 0.5, jnp.float32)  # 2w * 2**15 = 32768 fits float16
    state, (value, grads) = autocast.dynamic_scale_value_and_grad(_overflowing_loss, redo_on_nan=5)(
        w, dynamic_scaler_state=autocast.DynamicScalerState()
    )
    np.testing.assert_array_equal(np.asarray(grads), np.full(4, 1.0, np.float32))
    assert (float(state.scaler), int(state.count), int(state.total_resets)) == (2.0**15, 1, 0)


@pytest.mark.parametrize("k", [1, 3])
def test_redo_on_nan_too_few_retries_gives_up(k):
    grad_fn = autocast.dynamic_scale_value_and_grad(_overflowing_loss, redo_on_nan=k)
    state, (value, grads) = grad_fn(W8, dynamic_scaler_state=autocast.DynamicScalerState())
    assert not bool(autocast.all_finite(grads))
    assert int(state.total_resets) == k + 1
    assert float(state.scaler) == 2.0 ** (14 - k)
    assert int(state.count) == 0


def test_redo_on_nan_with_has_aux_returns_last_attempt():
    def loss(w):
        v = _overflowing_loss(w)
        return v, {"v": v, "name": "aux"}

    state, ((value, aux), grads) = autocast.dynamic_scale_value_and_grad(
        loss, has_aux=True, redo_on_nan=6
    )(W8, dynamic_scaler_state=autocast.DynamicScalerState())
    assert aux["name"] == "aux" and float(aux["v"]) == 256.0
    np.testing.assert_array_equal(np.asarray(grads), np.full(4, 16.0, np.float32))
    assert int(state.total_resets) == 4


def test_redo_on_nan_runs_inside_the_compiled_program():
    grad_fn = autocast.dynamic_scale_value_and_grad(_overflowing_loss, redo_on_nan=6)

    def call(w, s):
        return grad_fn(w, dynamic_scaler_state=s)

    state0 = autocast.DynamicScalerState()
    jaxpr = jax.make_jaxpr(jax.jit(call))(W8, state0)
    assert eqns_named(jaxpr, "while"), jaxpr
    state, (value, grads) = jax.jit(call)(W8, state0)
    np.testing.assert_array_equal(np.asarray(grads), np.full(4, 16.0, np.float32))
    assert int(state.total_resets) == 4 and float(state.scaler) == 2.0**11
    # Without redo_on_nan there is no loop at all.
    plain = autocast.dynamic_scale_value_and_grad(_overflowing_loss, redo_on_nan=0)
    jaxpr0 = jax.make_jaxpr(lambda w, s: plain(w, dynamic_scaler_state=s))(W8, state0)
    assert not eqns_named(jaxpr0, "while")


# ---- 4. validation --------------------------------------------------------------------------

FACES = [autocast.dynamic_scale_grad, autocast.dynamic_scale_value_and_grad]


@pytest.mark.parametrize("face", FACES)
def test_missing_or_wrong_state(face):
    grad_fn = face(lambda w: jnp.sum(w**2))
    with pytest.raises(TypeError, match="dynamic_scaler_state"):
        grad_fn(jnp.ones(2))
    with pytest.raises(TypeError, match="dynamic_scaler_state"):
        grad_fn(jnp.ones(2), dynamic_scaler_state=None)
    for wrong in (2.0**15, jnp.float32(2.0**15), {"scaler": 1.0}, "state"):
        with pytest.raises(TypeError, match="dynamic_scaler_state"):
            grad_fn(jnp.ones(2), dynamic_scaler_state=wrong)


@pytest.mark.parametrize(
    "kwargs, error, field",
    [
        ({"patience": 0}, ValueError, "patience"),
        ({"patience": -3}, ValueError, "patience"),
        ({"patience": 2.5}, ValueError, "patience must be a whole number"),
        ({"patience": float("nan")}, ValueError, "patience must be a whole number"),
        ({"patience": True}, TypeError, "patience"),
        ({"adjust_factor": 1.0}, ValueError, "adjust_factor"),
        ({"adjust_factor": 1}, ValueError, "adjust_factor"),
        ({"adjust_factor": 0.5}, ValueError, "adjust_factor"),
        ({"adjust_factor": 0.0}, ValueError, "adjust_factor"),
        ({"adjust_factor": -2.0}, ValueError, "adjust_factor"),
        ({"adjust_factor": float("inf")}, ValueError, "adjust_factor"),
        ({"scaler": jnp.complex64(8)}, TypeError, "scaler"),
        ({"scaler": "8"}, TypeError, "scaler"),
        ({"scaler": True}, TypeError, "scaler"),
        ({"scaler": jnp.bool_(True)}, TypeError, "scaler"),
        ({"scaler": 0.0}, ValueError, "scaler"),
        ({"scaler": -1.0}, ValueError, "scaler"),
        ({"scaler": float("nan")}, ValueError, "scaler"),
        ({"scaler": float("inf")}, ValueError, "scaler"),
        ({"scaler": jnp.ones(2)}, ValueError, "scaler"),
        ({"scaler": 1e39}, ValueError, "scaler"),  # inf in float32
        ({"patience": 2**31}, ValueError, "patience"),  # does not fit int32
        ({"patience": jnp.float32(3.5)}, ValueError, "patience"),
        ({"count": -1}, ValueError, "count"),
        ({"total_resets": -1}, ValueError, "total_resets"),
        ({"total_resets": "1"}, TypeError, "total_resets"),
    ],
)
def test_bad_constructor_arguments(kwargs, error, field):
    with pytest.raises(error, match=field):
        autocast.DynamicScalerState(**kwargs)


@pytest.mark.parametrize("face", FACES)
def test_bad_redo_on_nan_and_fun(face):
    loss = lambda w: jnp.sum(w**2)  # noqa: E731
    with pytest.raises(ValueError, match="redo_on_nan"):
        face(loss, redo_on_nan=-1)
    with pytest.raises(TypeError, match="redo_on_nan"):
        face(loss, redo_on_nan=1.5)
    with pytest.raises(TypeError, match="redo_on_nan"):
        face(loss, redo_on_nan=True)
    with pytest.raises(TypeError, match="redo_on_nan"):
        face(loss, redo_on_nan="2")
    with pytest.raises(TypeError):
        face(3.0)
    # A numpy integer is an integer.
    face(loss, redo_on_nan=np.int64(2))


# ---- 5. round trips -------------------------------------------------------------------------


def test_round_trip_jit_and_pytree():
    s = _sample_state()
    _assert_same_state(jax.jit(lambda x: x)(s), s)
    leaves, treedef = jax.tree_util.tree_flatten(s)
    assert len(leaves) == len(FIELDS)
    _assert_same_state(jax.tree_util.tree_unflatten(treedef, leaves), s)
    # Under jit the rule uses the carried fields, not the defaults.
    adjusted = jax.jit(lambda x: x.adjust(F).adjust(F))(s)
    assert _fields(adjusted) == {
        "patience": 7,
        "adjust_factor": 4.0,
        "scaler": 2.0**5,
        "count": 0,
        "total_resets": 7,
        "min_scaler": 0.5,
        "skipped_in_a_row": 2,
        "steps_at_floor": 1,
        "zero_grad_steps": 4,
    }
    # Built inside jit from traced values (the constructor may not inspect tracers).
    built = jax.jit(lambda p, a, sc, lo: autocast.DynamicScalerState(p, a, sc, 3, 5, lo, 2, 1, 4))(
        jnp.int32(7), jnp.float32(4.0), jnp.float32(2.0**9), jnp.float32(0.5)
    )
    _assert_same_state(built, s)
    # The key paths name the fields (checkpoint libraries save by key).
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(s)[0]]
    assert paths == [f".{f}" for f in FIELDS]


def test_round_trip_pickle():
    s = _sample_state()
    restored = pickle.loads(pickle.dumps(s))
    _assert_same_state(restored, s)
    assert _fields(restored.adjust(F)) == _fields(s.adjust(F))


def _as_state_dict(obj):
    return {
        jax.tree_util.keystr(path): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(obj)[0]
    }


def test_round_trip_flax_into_default_target():
    s = _sample_state()
    target = autocast.DynamicScalerState()  # every field at its default
    blob = flax.serialization.msgpack_serialize(flax.serialization.to_state_dict(_as_state_dict(s)))
    restored_dict = flax.serialization.from_state_dict(
        _as_state_dict(target), flax.serialization.msgpack_restore(blob)
    )
    paths_and_leaves, treedef = jax.tree_util.tree_flatten_with_path(target)
    restored = jax.tree_util.tree_unflatten(
        treedef, [jnp.asarray(restored_dict[jax.tree_util.keystr(p)]) for p, _ in paths_and_leaves]
    )
    _assert_same_state(restored, s)
    assert int(restored.total_resets) == 5

    # flax's list-of-leaves path (to_bytes / from_bytes with a target), inside a bigger tree.
    tree = {"params": jnp.arange(3.0), "scaler": s}
    leaves = flax.serialization.from_bytes(
        jax.tree_util.tree_leaves({"params": jnp.zeros(3), "scaler": target}),
        flax.serialization.to_bytes(jax.tree_util.tree_leaves(tree)),
    )
    back = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(tree), leaves)
    _assert_same_state(jax.tree_util.tree_map(jnp.asarray, back["scaler"]), s)


def test_round_trip_orbax(tmp_path):
    ocp = require("orbax.checkpoint")
    s = _sample_state()
    tree = {"params": jnp.arange(3.0), "scaler": s}
    target = {"params": jnp.zeros(3), "scaler": autocast.DynamicScalerState()}
    path = tmp_path / "ckpt"
    try:
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(path, tree)
        checkpointer.wait_until_finished()
        restored = checkpointer.restore(path, target)
        checkpointer.close()
    except Exception as error:  # pragma: no cover - orbax API drift is not this library's
        pytest.skip(f"orbax StandardCheckpointer unusable here: {error!r}")
    assert isinstance(restored["scaler"], autocast.DynamicScalerState)
    _assert_same_state(jax.tree_util.tree_map(jnp.asarray, restored["scaler"]), s)
    np.testing.assert_array_equal(np.asarray(restored["params"]), np.arange(3.0))


# ---- 6. with amp ----------------------------------------------------------------------------


@pytest.mark.slow
def test_amp_float16_mlp_grads_close_to_float32():
    params = _models.init_mlp(jax.random.PRNGKey(0))
    x, y = _mlp_data()
    want_value, want = jax.value_and_grad(_models.mlp_loss)(params, x, y)
    grad_fn = jax.jit(
        lambda p, x, y, s: autocast.dynamic_scale_value_and_grad(AMP_MLP_F16)(
            p, x, y, dynamic_scaler_state=s
        )
    )
    state, (value, grads) = grad_fn(params, x, y, autocast.DynamicScalerState())
    assert bool(autocast.all_finite(grads))
    assert int(state.total_resets) == 0 and float(state.scaler) == 2.0**15
    assert value.dtype == jnp.float32
    assert abs(float(value) - float(want_value)) < 0.02
    for g, w in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(want)):
        assert g.dtype == jnp.float32 and g.shape == w.shape
        assert _rel_err(g, w) < 0.05, _rel_err(g, w)


# ---- 7. no device-to-host sync --------------------------------------------------------------


@pytest.mark.parametrize("redo_on_nan", [0, 3])
def test_training_step_has_no_host_sync(redo_on_nan):
    grad_fn = autocast.dynamic_scale_value_and_grad(AMP_MLP_F16, redo_on_nan=redo_on_nan)

    def step(params, state, x, y):
        state, (loss, grads) = grad_fn(params, x, y, dynamic_scaler_state=state)
        new = jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)
        params = autocast.select_tree(autocast.all_finite(grads), new, params)
        return params, state, loss

    params = _models.init_mlp(jax.random.PRNGKey(0))
    x, y = _mlp_data()
    text = jax.jit(step).lower(params, autocast.DynamicScalerState(), x, y).as_text().lower()
    for word in ("callback", "infeed", "outfeed"):
        assert word not in text, word
    if redo_on_nan:
        assert "while" in text  # the retry loop is in the program itself

    # The same step with one bad batch, compiled: skipped (params unchanged). A NaN in the
    # data makes the loss NaN, which no scale cures: no retry, the scale kept.
    jstep = jax.jit(step)
    x_bad = x.at[0, 0].set(jnp.nan)
    new_params, state, _ = jstep(params, autocast.DynamicScalerState(), x_bad, y)
    for a, b in zip(jax.tree_util.tree_leaves(new_params), jax.tree_util.tree_leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(state.total_resets) == 1 and int(state.skipped_in_a_row) == 1
    assert float(state.scaler) == 2.0**15


# ---- 8. axis_name ---------------------------------------------------------------------------


def _dot_loss(w, x):
    return jnp.sum(jnp.sin(w * x))


@pytest.mark.parametrize("redo_on_nan", [0, 2])
def test_axis_name_under_vmap_every_element_decides_alike(redo_on_nan):
    w = jnp.array([0.5, -0.5, 1.0])
    xs = jnp.arange(12.0).reshape(4, 3) / 10
    xs = xs.at[2, 1].set(jnp.nan)  # only element 2 sees a NaN
    state0 = autocast.DynamicScalerState(scaler=2.0**10, count=5, patience=5)

    def run(axis_name):
        grad_fn = autocast.dynamic_scale_value_and_grad(
            _dot_loss, argnums=0, axis_name=axis_name, redo_on_nan=redo_on_nan
        )
        return jax.jit(
            jax.vmap(lambda x: grad_fn(w, x, dynamic_scaler_state=state0), axis_name="b")
        )(xs)

    state, (value, grads) = run("b")
    scalers, resets, counts = (
        np.asarray(a) for a in (state.scaler, state.total_resets, state.count)
    )
    assert scalers.shape == (4,)
    # Every element took the "non-finite" decision: a skip each, the scale kept (the loss was
    # NaN: no smaller scale cures that, so there is no retry either).
    np.testing.assert_array_equal(scalers, np.full(4, 2.0**10, np.float32))
    np.testing.assert_array_equal(resets, np.full(4, 1))
    np.testing.assert_array_equal(counts, np.zeros(4))
    # The clean elements' own gradients were finite: the decision is shared, not local.
    g = np.asarray(grads)
    assert np.all(np.isfinite(g[[0, 1, 3]])) and not np.all(np.isfinite(g[2]))

    # Without axis_name each element decides for itself (so the check above can fail).
    state, _ = run(None)
    local = np.asarray(state.total_resets)
    assert local[2] == 1 and local[[0, 1, 3]].tolist() == [0, 0, 0]
    # Finite elements with count 5 >= patience 5 grew.
    np.testing.assert_array_equal(np.asarray(state.scaler)[[0, 1, 3]], np.full(3, 2.0**11))


@pytest.mark.slow
def test_axis_name_all_finite_grows_together():
    w = jnp.array([0.5, -0.5, 1.0])
    xs = jnp.arange(12.0).reshape(4, 3) / 10
    state0 = autocast.DynamicScalerState(scaler=2.0**10, count=5, patience=5)
    grad_fn = autocast.dynamic_scale_grad(_dot_loss, axis_name="b")
    state, grads = jax.vmap(lambda x: grad_fn(w, x, dynamic_scaler_state=state0), axis_name="b")(xs)
    np.testing.assert_array_equal(np.asarray(state.scaler), np.full(4, 2.0**11, np.float32))
    np.testing.assert_array_equal(np.asarray(state.total_resets), np.zeros(4))
    want = jax.vmap(jax.grad(_dot_loss), in_axes=(None, 0))(w, xs)
    np.testing.assert_allclose(np.asarray(grads), np.asarray(want), rtol=1e-6)


# ---- 9. jaxamp parity: NamedTuple state, defaults, the scaler sequence, dynamic_scale_tx ----


def test_state_is_a_named_tuple():
    s = _sample_state()
    assert isinstance(s, tuple) and s._fields == FIELDS and len(s) == len(FIELDS)
    patience, factor, scaler, count, resets, *_ = s  # unpacking and iteration
    assert (int(patience), float(factor), float(scaler), int(count), int(resets)) == (
        7,
        4.0,
        2.0**9,
        3,
        5,
    )
    assert s[2] is s.scaler and list(s._asdict()) == list(FIELDS)
    assert s == _sample_state() and s != autocast.DynamicScalerState()
    assert autocast.DynamicScalerState._field_defaults == {
        "patience": 2000,
        "adjust_factor": 2.0,
        "scaler": 2.0**15,
        "count": 0,
        "total_resets": 0,
        "min_scaler": 1.0,
        "skipped_in_a_row": 0,
        "steps_at_floor": 0,
        "zero_grad_steps": 0,
    }
    # Positional order is jaxamp's, then the floor and the health counters.
    _assert_same_state(autocast.DynamicScalerState(7, 4.0, 2.0**9, 3, 5, 0.5, 2, 1, 4), s)
    with pytest.raises(AttributeError):
        s.scaler = jnp.float32(1.0)
    with pytest.raises(AttributeError):
        s.extra = 1


def test_replace_checks_and_converts_like_the_constructor():
    s = _sample_state()
    r = s._replace(scaler=1024, count=0)
    assert type(r) is autocast.DynamicScalerState
    _assert_storage(r)
    assert _fields(r) == {**_fields(s), "scaler": 1024.0, "count": 0}
    with pytest.raises(ValueError, match="scaler must be a positive finite number"):
        s._replace(scaler=0.0)
    with pytest.raises(ValueError, match=r"no field\(s\) \['scale'\]"):
        s._replace(scale=2.0)
    # Under jit, with traced values.
    r = jax.jit(lambda s, x: s._replace(scaler=x))(s, jnp.float32(8.0))
    assert float(r.scaler) == 8.0 and int(r.patience) == 7


def test_integer_scaler_is_converted_to_float32():
    """jaxamp converts an integer scaler to float32; so does autocast (the scale is kept in
    float32)."""
    for scaler in (2**15, jnp.int32(2**15), np.int64(2**15)):
        s = autocast.DynamicScalerState(scaler=scaler)
        _assert_storage(s)
        assert float(s.scaler) == 2.0**15
    _assert_storage(autocast.DynamicScalerState(patience=np.float32(3.0), total_resets=1.0))


def test_named_tuple_state_through_flax_state_dict_and_deepcopy():
    import copy

    s = _sample_state()
    # flax serialises a NamedTuple by field name and rebuilds it with the constructor.
    state_dict = flax.serialization.to_state_dict(s)
    assert set(state_dict) == set(FIELDS)
    restored = flax.serialization.from_state_dict(autocast.DynamicScalerState(), state_dict)
    _assert_same_state(restored, s)
    blob = flax.serialization.to_bytes(s)
    _assert_same_state(flax.serialization.from_bytes(autocast.DynamicScalerState(), blob), s)
    _assert_same_state(copy.deepcopy(s), s)
    # A pytree map may put anything in the leaves; rebuilding never runs the checks.
    shapes = jax.eval_shape(lambda s: s.adjust(F), s)
    assert type(shapes) is autocast.DynamicScalerState and shapes.scaler.dtype == jnp.float32
    nones = jax.tree_util.tree_map(lambda _: None, s, is_leaf=lambda x: x is not s)
    assert type(nones) is autocast.DynamicScalerState


def test_jaxamp_defaults():
    """jaxamp 0.0.4: dynamic_scale_value_and_grad retries up to 10 times by default,
    dynamic_scale_grad not at all."""
    vg = inspect.signature(autocast.dynamic_scale_value_and_grad).parameters
    g = inspect.signature(autocast.dynamic_scale_grad).parameters
    assert vg["redo_on_nan"].default == 10 and g["redo_on_nan"].default == 0
    assert vg["filter"].default is True and g["filter"].default is True
    x = jnp.float16(2.0)
    state, (value, grad) = autocast.dynamic_scale_value_and_grad(lambda x: x**3)(
        x, dynamic_scaler_state=autocast.DynamicScalerState()
    )
    assert float(value) == 8.0 and float(grad) == 12.0  # 12 * 2**15 overflowed: retried
    assert float(state.scaler) == 2.0**12 and int(state.total_resets) == 3
    state, grad = autocast.dynamic_scale_grad(lambda x: x**3)(
        x, dynamic_scaler_state=autocast.DynamicScalerState()
    )
    assert not np.isfinite(float(grad)) and float(state.scaler) == 2.0**14


def _unpack(kind, aux, out):
    """(value or None, grads, aux or None) out of what a dynamic-scale function returned."""
    if kind == "grad":
        return (None, *out) if aux else (None, out, None)
    (value, a), g = out if aux else ((out[0], None), out[1])
    return value, g, a


@pytest.mark.parametrize("kind", ["grad", "value_and_grad"])
@pytest.mark.parametrize("filter_", [True, False])
@pytest.mark.parametrize("aux", [True, False])
def test_jaxamp_scaler_sequence(kind, filter_, aux):
    """The behaviour jaxamp's own scaler test checks, written for this project: x**3 at
    float16 2.0 (gradient 12) under a jitted dynamic-scale function, through retries, growth
    after `patience` finite steps and the next overflow."""
    face = {
        "grad": autocast.dynamic_scale_grad,
        "value_and_grad": autocast.dynamic_scale_value_and_grad,
    }[kind]

    def cube(x):
        return (x**3, {"one": jnp.float32(1.0)}) if aux else x**3

    def check(out, state, scaler, count):
        value, grad, extra = _unpack(kind, aux, out)
        assert float(state.scaler) == scaler and int(state.count) == count
        assert state.scaler.dtype == jnp.float32
        if value is not None:
            assert float(value) == 8.0
        if extra is not None:
            assert float(extra["one"]) == 1.0
        return grad

    x = jnp.float16(2.0)
    step = jax.jit(face(cube, filter=filter_, has_aux=aux, redo_on_nan=100))
    state = autocast.DynamicScalerState(patience=10)
    # 12 * 2**15, 2**14 and 2**13 overflow float16; 2**12 fits: three retries, then counted.
    state, out = step(x, dynamic_scaler_state=state)
    assert float(check(out, state, 2.0**12, 1)) == 12.0
    for i in range(9):
        state, out = step(x, dynamic_scaler_state=state)
        assert float(check(out, state, 2.0**12, i + 2)) == 12.0
    state, out = step(x, dynamic_scaler_state=state)  # count reached patience: grow
    check(out, state, 2.0**13, 0)
    state, out = step(x, dynamic_scaler_state=state)  # overflow at 2**13, retried at 2**12
    assert float(check(out, state, 2.0**12, 1)) == 12.0

    # Without retries each overflowing step only halves the scale.
    step = jax.jit(face(cube, filter=filter_, has_aux=aux, redo_on_nan=0))
    state = autocast.DynamicScalerState(scaler=2**15)
    for scaler in (2.0**14, 2.0**13, 2.0**12):
        state, out = step(x, dynamic_scaler_state=state)
        assert not np.isfinite(float(check(out, state, scaler, 0)))
    state, out = step(x, dynamic_scaler_state=state)
    assert float(check(out, state, 2.0**12, 1)) == 12.0
    assert int(state.total_resets) == 3


@pytest.mark.parametrize("face", FACES)
@pytest.mark.parametrize(
    "loss",
    [lambda w: jnp.sum(w).astype(jnp.int32), lambda w: 3, lambda w: jnp.sum(w) > 0],
    ids=["int32-array", "python-int", "bool"],
)
def test_integer_or_boolean_loss_raises_jax_grads_type_error(face, loss):
    """jax.grad refuses integer and boolean outputs with a TypeError; so do these (they once
    promoted the loss to float32 and returned all-zero gradients)."""
    with pytest.raises(TypeError, match="grad requires real-valued outputs") as want:
        jax.grad(loss)(jnp.ones(2))
    with pytest.raises(TypeError, match="grad requires real-valued outputs") as got:
        face(loss)(jnp.ones(2), dynamic_scaler_state=autocast.DynamicScalerState())
    assert str(got.value) == str(want.value)


@pytest.mark.parametrize("face", FACES)
def test_non_scalar_or_python_float_loss_as_jax_grad(face):
    state0 = autocast.DynamicScalerState()
    with pytest.raises(TypeError, match="scalar-output"):
        face(lambda w: w * 2)(jnp.ones(2), dynamic_scaler_state=state0)
    with pytest.raises(TypeError, match="scalar-output"):
        face(lambda w: None)(jnp.ones(2), dynamic_scaler_state=state0)
    # A constant Python float: jax.grad gives zero gradients, and so do these.
    np.testing.assert_array_equal(np.asarray(jax.grad(lambda w: 3.0)(jnp.ones(2))), [0.0, 0.0])
    state, out = face(lambda w: 3.0)(jnp.ones(2), dynamic_scaler_state=state0)
    grads = out if face is autocast.dynamic_scale_grad else out[1]
    np.testing.assert_array_equal(np.asarray(grads), [0.0, 0.0])
    assert int(state.count) == 1
    pair = r"has_aux=True.*\(loss, aux\) pair, got an array of dtype float32 and shape \(\)"
    with pytest.raises(TypeError, match=pair):
        face(lambda w: jnp.sum(w), has_aux=True)(jnp.ones(2), dynamic_scaler_state=state0)


# ---- dynamic_scale_tx ----------------------------------------------------------------------


def _cube(x):
    return x**3


@pytest.mark.parametrize(
    "transform", [jax.grad, eqx.filter_grad], ids=["jax.grad", "eqx.filter_grad"]
)
def test_dynamic_scale_tx_wraps_a_grad_transformation(transform):
    grad_fn = autocast.dynamic_scale_tx(transform, redo_on_nan=10)(_cube)
    state0 = autocast.DynamicScalerState()
    state, g = jax.jit(grad_fn)(jnp.float16(2.0), dynamic_scaler_state=state0)
    assert g.dtype == jnp.float16 and float(g) == 12.0
    assert (float(state.scaler), int(state.count), int(state.total_resets)) == (2.0**12, 1, 3)
    # redo_on_nan defaults to 0, as in jaxamp: the overflowing step only halves the scale.
    state, g = autocast.dynamic_scale_tx(transform)(_cube)(
        jnp.float16(2.0), dynamic_scaler_state=autocast.DynamicScalerState()
    )
    assert not np.isfinite(float(g)) and float(state.scaler) == 2.0**14


def test_dynamic_scale_tx_passes_transform_arguments_and_unscales_every_result():
    def loss(a, b):
        return jnp.sum(a * b)

    a, b = jnp.array([1.0, 2.0]), jnp.array([3.0, -4.0])
    state, (value, grads) = autocast.dynamic_scale_tx(jax.value_and_grad)(loss, argnums=(0, 1))(
        a, b, dynamic_scaler_state=autocast.DynamicScalerState()
    )
    # The default unscale_fn divides every floating result: the value comes back unscaled too.
    assert float(value) == -5.0
    np.testing.assert_array_equal(np.asarray(grads[0]), [3.0, -4.0])
    np.testing.assert_array_equal(np.asarray(grads[1]), [1.0, 2.0])
    assert int(state.count) == 1


def test_dynamic_scale_tx_with_aux_and_custom_functions():
    def loss(w):
        return jnp.sum(w**2), {"n": jnp.float32(7.0)}

    def unscale_grads_only(results, state):
        grads, aux = results
        return state.unscale(grads), aux

    seen = []

    def scale_fn(out, state):
        seen.append(type(state).__name__)
        value, aux = out
        return value * state.loss_scale, aux

    grad_fn = autocast.dynamic_scale_tx(jax.grad, unscale_fn=unscale_grads_only, scale_fn=scale_fn)(
        loss, has_aux=True
    )
    state, (grads, aux) = grad_fn(jnp.ones(2), dynamic_scaler_state=autocast.DynamicScalerState())
    np.testing.assert_array_equal(np.asarray(grads), [2.0, 2.0])
    assert float(aux["n"]) == 7.0 and seen == ["DynamicScalerState"]
    # A DynamicLossScale drives it as well.
    state, _ = grad_fn(jnp.ones(2), dynamic_scaler_state=autocast.DynamicLossScale(8.0, period=1))
    assert type(state) is autocast.DynamicLossScale and float(state.loss_scale) == 16.0


def test_dynamic_scale_tx_state_is_an_argument_not_a_closure():
    """The state reaches the transformed function as a keyword argument, so a transformation
    that compiles (jax.jit around jax.grad) traces the loss once, not once per state."""
    traces = []

    def loss(w):
        traces.append(1)
        return jnp.sum(w**2)

    grad_fn = autocast.dynamic_scale_tx(lambda f: jax.jit(jax.grad(f)))(loss)
    state = autocast.DynamicScalerState(patience=1)
    for _ in range(4):
        state, g = grad_fn(jnp.ones(2), dynamic_scaler_state=state)
    np.testing.assert_array_equal(np.asarray(g), [2.0, 2.0])
    assert float(state.scaler) == 2.0**17  # the states really differed
    assert len(traces) == 1


def test_dynamic_scale_tx_keyword_reaches_the_function():
    captured = {}

    def transform(f):
        captured["sig"] = inspect.signature(f)
        return jax.grad(f)

    grad_fn = autocast.dynamic_scale_tx(transform)(lambda w: jnp.sum(w**2))
    grad_fn(jnp.ones(2), dynamic_scaler_state=autocast.DynamicScalerState())
    assert "_dynamic_scaler_state" in captured["sig"].parameters
    assert "dynamic_scaler_state" in inspect.signature(grad_fn).parameters


def test_dynamic_scale_tx_axis_name_under_vmap():
    xs = jnp.array([1.0, 2.0, jnp.nan])
    grad_fn = autocast.dynamic_scale_tx(jax.grad, axis_name="b")(lambda x: x**2)
    state, grads = jax.vmap(
        lambda x: grad_fn(x, dynamic_scaler_state=autocast.DynamicScalerState()), axis_name="b"
    )(xs)
    np.testing.assert_array_equal(np.asarray(state.total_resets), [1, 1, 1])
    np.testing.assert_array_equal(np.asarray(grads)[:2], [2.0, 4.0])


def test_dynamic_scale_tx_rejects_bad_arguments():
    with pytest.raises(TypeError, match="gradient transformation such as jax.grad"):
        autocast.dynamic_scale_tx("grad")
    with pytest.raises(ValueError, match="redo_on_nan"):
        autocast.dynamic_scale_tx(jax.grad, redo_on_nan=-1)
    with pytest.raises(TypeError, match="unscale_fn must be a function"):
        autocast.dynamic_scale_tx(jax.grad, unscale_fn=1.0)
    with pytest.raises(TypeError, match="scale_fn must be a function"):
        autocast.dynamic_scale_tx(jax.grad, scale_fn="x")
    with pytest.raises(TypeError, match="expected a function to differentiate"):
        autocast.dynamic_scale_tx(jax.grad)(3.0)
    grad_fn = autocast.dynamic_scale_tx(jax.grad)(_cube)
    with pytest.raises(TypeError, match="dynamic_scaler_state"):
        grad_fn(jnp.float32(1.0))
    with pytest.raises(TypeError, match="scalar loss or a \\(loss, aux\\) pair, got dict"):
        autocast.dynamic_scale_tx(jax.grad)(lambda x: {"l": x})(
            jnp.float32(1.0), dynamic_scaler_state=autocast.DynamicScalerState()
        )


# --- which gradients overflowed ------------------------------------------------------------


def test_a_skipped_step_says_which_gradient_leaves_overflowed():
    def loss(p, x):  # the first product's cotangent is 10 * 2**15: inf in float16
        return 10.0 * jnp.sum(x @ p["big"]) + 1e-3 * jnp.sum(x @ p["small"])

    amp_loss = autocast.amp(loss, compute_dtype=jnp.float16)
    grad_fn = autocast.dynamic_scale_value_and_grad(amp_loss, redo_on_nan=0)  # skip, do not retry

    @jax.jit
    def step(params, scaler, x):
        scaler, (_, grads) = grad_fn(params, x, dynamic_scaler_state=scaler)
        return scaler, autocast.nonfinite_leaves(grads)

    params = {"big": jnp.ones((4, 4)), "small": jnp.ones((4, 4)), "count": jnp.int32(3)}
    x = jnp.ones((2, 4))
    jaxpr = jax.make_jaxpr(step)(params, autocast.DynamicScalerState(), x)
    assert not any(
        "callback" in e.primitive.name for e in _measure.equations(jaxpr)
    )  # no host sync
    scaler, flags = step(params, autocast.DynamicScalerState(), x)
    assert float(scaler.scaler) < 2.0**15  # the step was skipped and the scale lowered
    assert flags["count"] is None  # not differentiated (filter=True): no gradient, no flag
    assert autocast.nonfinite_paths(flags) == ["['big']"]
