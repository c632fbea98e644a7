"""Tests for the loss-scale objects: ``autocast._src.scaling.jmp`` (jmp's face).

Covers the dynamic rule (hand-written transitions and a property test against a plain-Python
model), the ``jmp`` 0.0.4 bugs this project fixes, scale/unscale values and dtypes,
``all_finite``, ``select_tree``, input validation, construction under ``jax.jit`` and
immutability.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import pickle

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import division_ulps
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

import autocast

DYNAMIC_FIELDS = ("loss_scale", "counter", "period", "factor", "min_loss_scale")
FIELD_DTYPES = {
    "loss_scale": jnp.float32,
    "counter": jnp.int32,
    "period": jnp.int32,
    "factor": jnp.float32,
    "min_loss_scale": jnp.float32,
}
F32_MAX = float(np.finfo(np.float32).max)
T = jnp.bool_(True)
F = jnp.bool_(False)


def _state(ls):
    """(loss_scale, counter) of a DynamicLossScale as Python numbers."""
    return float(ls.loss_scale), int(ls.counter)


def _assert_fields(ls, **expected):
    """Every listed field has the expected value and the float32/int32 storage dtype."""
    for name, value in expected.items():
        leaf = getattr(ls, name)
        assert jnp.asarray(leaf).dtype == FIELD_DTYPES[name], name
        assert jnp.asarray(leaf).shape == (), name
        assert float(leaf) == value, (name, float(leaf), value)


def _assert_same_dynamic(a, b):
    assert type(a) is type(b) is autocast.DynamicLossScale
    for name in DYNAMIC_FIELDS:
        x, y = np.asarray(getattr(a, name)), np.asarray(getattr(b, name))
        assert x.dtype == y.dtype, name
        assert x.shape == y.shape == (), name
        assert x == y, (name, x, y)


def _sample_dynamic():
    # Every field differs from its default, so a field silently reset to its default shows.
    return autocast.DynamicLossScale(
        jnp.float32(2.0**12), counter=3, period=7, factor=4.0, min_loss_scale=16.0
    )


@contextlib.contextmanager
def _x64():
    """64-bit mode for the duration of the block, on every supported JAX."""
    if callable(getattr(jax, "enable_x64", None)):
        with jax.enable_x64(True):
            yield
    else:  # JAX < 0.7
        from jax.experimental import enable_x64

        with enable_x64():
            yield


# --------------------------------------------------------------------------------------------
# 1. The dynamic rule, step by step.
# --------------------------------------------------------------------------------------------


def test_finite_steps_count_then_grow_at_period():
    ls = autocast.DynamicLossScale(1024.0, period=3, factor=2)
    ls = ls.adjust(T)
    assert _state(ls) == (1024.0, 1)
    ls = ls.adjust(T)
    assert _state(ls) == (1024.0, 2)
    ls = ls.adjust(T)  # the third consecutive finite step: grow, reset
    assert _state(ls) == (2048.0, 0)
    ls = ls.adjust(T)
    assert _state(ls) == (2048.0, 1)
    _assert_fields(ls, period=3, factor=2.0, min_loss_scale=1.0)


def test_period_one_grows_every_finite_step():
    ls = autocast.DynamicLossScale(2.0, period=1, factor=3)
    for expected in (6.0, 18.0, 54.0):
        ls = ls.adjust(T)
        assert _state(ls) == (expected, 0)


def test_non_finite_step_shrinks_and_resets_counter():
    ls = autocast.DynamicLossScale(1024.0, counter=2, period=3, factor=4)
    ls = ls.adjust(F)
    assert _state(ls) == (256.0, 0)
    # The count starts again from zero: two finite steps are not enough to grow.
    ls = ls.adjust(T).adjust(T)
    assert _state(ls) == (256.0, 2)
    ls = ls.adjust(T)
    assert _state(ls) == (1024.0, 0)


def test_shrink_is_floored_at_min_loss_scale():
    ls = autocast.DynamicLossScale(24.0, counter=1, factor=4, min_loss_scale=8.0)
    ls = ls.adjust(F)  # 24 / 4 = 6 < 8
    assert _state(ls) == (8.0, 0)
    ls = ls.adjust(F)  # stays on the floor
    assert _state(ls) == (8.0, 0)
    _assert_fields(ls, min_loss_scale=8.0, factor=4.0)


def test_default_floor_is_one():
    ls = autocast.DynamicLossScale(1.0)
    assert _state(ls.adjust(F)) == (1.0, 0)


def test_growth_that_would_overflow_float32_keeps_the_scale():
    ls = autocast.DynamicLossScale(2.0**127, counter=0, period=1, factor=2)
    nxt = ls.adjust(T)
    assert _state(nxt) == (2.0**127, 0)
    big = autocast.DynamicLossScale(F32_MAX, period=2, factor=1.5, counter=1)
    nxt = big.adjust(T)
    assert math.isfinite(float(nxt.loss_scale))
    assert _state(nxt) == (F32_MAX, 0)


def test_defaults():
    ls = autocast.DynamicLossScale(2.0**15)
    _assert_fields(ls, loss_scale=2.0**15, counter=0, period=2000, factor=2.0, min_loss_scale=1.0)


def test_adjust_returns_a_new_object_and_leaves_the_old_one_alone():
    ls = autocast.DynamicLossScale(8.0, period=1)
    nxt = ls.adjust(T)
    assert nxt is not ls
    assert type(nxt) is autocast.DynamicLossScale
    assert _state(ls) == (8.0, 0)
    assert _state(nxt) == (16.0, 0)


def test_adjust_accepts_python_and_numpy_bools():
    ls = autocast.DynamicLossScale(8.0, period=1)
    assert _state(ls.adjust(True)) == (16.0, 0)
    assert _state(ls.adjust(np.bool_(False))) == (4.0, 0)


def test_next_loss_scale_is_the_same_rule():
    up = autocast.next_loss_scale(
        jnp.bool_(True),
        jnp.float32(8.0),
        jnp.int32(1),
        jnp.int32(2),
        jnp.float32(2.0),
        jnp.float32(1.0),
    )
    assert isinstance(up, autocast.LossScaleUpdate)
    assert up.loss_scale.dtype == jnp.float32 and up.counter.dtype == jnp.int32
    assert (float(up.loss_scale), int(up.counter)) == (16.0, 0)
    up = autocast.next_loss_scale(
        jnp.bool_(False),
        jnp.float32(8.0),
        jnp.int32(1),
        jnp.int32(2),
        jnp.float32(4.0),
        jnp.float32(4.0),
    )
    assert (float(up.loss_scale), int(up.counter)) == (4.0, 0)


def test_adjust_under_jit_and_scan():
    @jax.jit
    def step(ls, flag):
        return ls.adjust(flag)

    ls = autocast.DynamicLossScale(64.0, period=2, factor=2, min_loss_scale=32.0)
    trail = []
    for flag in (True, True, True, False, False, True):
        ls = step(ls, jnp.bool_(flag))
        trail.append(_state(ls))
    assert trail == [(64.0, 1), (128.0, 0), (128.0, 1), (64.0, 0), (32.0, 0), (32.0, 1)]
    _assert_fields(ls, period=2, factor=2.0, min_loss_scale=32.0)


# The property test: DynamicLossScale.adjust against a plain-Python model of the rule, one trace.

N_STEPS = 40


@jax.jit
def _run_flags(ls, flags):
    def body(carry, flag):
        nxt = carry.adjust(flag)
        return nxt, (nxt.loss_scale, nxt.counter)

    return lax.scan(body, ls, flags)


def _reference_step(scale, counter, period, factor, floor, finite):
    """One step of the rule in plain Python, with float32 arithmetic."""
    scale, factor, floor = np.float32(scale), np.float32(factor), np.float32(floor)
    if not finite:
        return max(np.float32(scale / factor), floor), 0
    if counter + 1 < period:
        return scale, counter + 1
    with np.errstate(over="ignore"):
        grown = np.float32(scale * factor)
    return (grown if np.isfinite(grown) else scale), 0


@st.composite
def _dynamic_setups(draw):
    period = draw(st.integers(1, 6))
    counter = draw(st.integers(0, period - 1))
    factor = draw(
        st.one_of(
            st.sampled_from([2.0, 3.0, 4.0, 1.5, 1024.0]),
            st.floats(1.0, 1024.0, exclude_min=True, width=32),
        )
    )
    # Normal float32 values only, so no step lands on a denormal.
    floor = draw(st.floats(2.0**-100, 2.0**100, width=32))
    scale = draw(st.floats(floor, F32_MAX, width=32))
    flags = draw(st.lists(st.booleans(), min_size=N_STEPS, max_size=N_STEPS))
    return period, counter, factor, floor, scale, flags


@settings(max_examples=50, deadline=None)
@given(_dynamic_setups())
def test_dynamic_rule_matches_reference_model(setup):
    period, counter, factor, floor, scale, flags = setup
    ls = autocast.DynamicLossScale(
        scale, counter=counter, period=period, factor=factor, min_loss_scale=floor
    )
    final, (scales, counters) = _run_flags(ls, jnp.asarray(flags))
    scales, counters = np.asarray(scales), np.asarray(counters)

    # each step against the rule applied to the state before it
    before = (scale, counter)
    for i, (flag, got) in enumerate(zip(flags, zip(scales, counters.tolist()))):
        want = _reference_step(*before, period, factor, floor, flag)
        assert got[1] == want[1], (i, flags[: i + 1], want, got)
        np.testing.assert_array_max_ulp(got[0], want[0], maxulp=division_ulps(), dtype=np.float32)
        before = got

    assert scales.dtype == np.float32 and counters.dtype == np.int32
    assert np.all(np.isfinite(scales))
    assert np.all(scales > 0)
    assert np.all(scales >= np.float32(floor))
    assert np.all((counters >= 0) & (counters < period))
    _assert_fields(final, period=period, factor=factor, min_loss_scale=floor)


# --------------------------------------------------------------------------------------------
# 2. The jmp 0.0.4 bugs this project fixes.
# --------------------------------------------------------------------------------------------


def test_jmp_bug_a_fields_survive_flatten_unflatten():
    """jmp bug (a): DynamicLossScale kept period and factor as static aux data and dropped
    min_loss_scale entirely in tree_flatten, so tree_unflatten reset it to 1.0."""
    ls = _sample_dynamic()
    leaves, treedef = jax.tree_util.tree_flatten(ls)
    assert len(leaves) == len(DYNAMIC_FIELDS)  # every field is a leaf, none is aux data
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(ls)[0]]
    assert all(any(name in p for p in paths) for name in DYNAMIC_FIELDS), paths
    _assert_same_dynamic(jax.tree_util.tree_unflatten(treedef, leaves), ls)
    # The floor is really used after a round trip, not the default 1.0.
    again = jax.tree_util.tree_unflatten(treedef, leaves)
    for _ in range(5):  # 4096 / 4**4 = 16, then floored at 16 rather than 4
        again = again.adjust(F)
    assert _state(again) == (16.0, 0)


def test_jmp_bug_a_fields_survive_jit():
    """jmp bug (a): passing a DynamicLossScale through jax.jit lost min_loss_scale (jmp
    rebuilt it with the default 1.0), so a jitted adjust shrank below the floor."""
    ls = _sample_dynamic()
    _assert_same_dynamic(jax.jit(lambda s: s)(ls), ls)
    shrink = jax.jit(lambda s: s.adjust(jnp.bool_(False)))
    # 4096 / 4 = 1024 -> 256 -> 64 -> 16 -> floored at 16, not 4.
    s = ls
    for expected in (1024.0, 256.0, 64.0, 16.0, 16.0):
        s = shrink(s)
        assert _state(s) == (expected, 0)
    _assert_fields(s, period=7, factor=4.0, min_loss_scale=16.0)
    # period and factor are used inside jit: 4 more finite steps after counter=3 reach 7.
    grow = jax.jit(lambda s: s.adjust(jnp.bool_(True)))
    s = ls
    for _ in range(4):
        s = grow(s)
    assert _state(s) == (2.0**14, 0)


def test_jmp_bug_a_fields_survive_pickle():
    """jmp bug (a): every field of every loss-scale object must survive pickle."""
    ls = _sample_dynamic()
    _assert_same_dynamic(pickle.loads(pickle.dumps(ls)), ls)
    static = pickle.loads(pickle.dumps(autocast.StaticLossScale(256.0)))
    assert type(static) is autocast.StaticLossScale
    assert static.loss_scale.dtype == jnp.float32 and float(static.loss_scale) == 256.0
    noop = pickle.loads(pickle.dumps(autocast.NoOpLossScale()))
    assert type(noop) is autocast.NoOpLossScale
    assert float(noop.loss_scale) == 1.0


def test_jmp_bug_a_fields_survive_checkpoint_into_default_target():
    """jmp bug (a): a checkpoint saves leaves only; restored into a freshly constructed,
    default DynamicLossScale, jmp lost period, factor and min_loss_scale."""
    ls = _sample_dynamic()

    def as_state(obj):
        return {
            jax.tree_util.keystr(path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(obj)[0]
        }

    blob = flax.serialization.msgpack_serialize(flax.serialization.to_state_dict(as_state(ls)))

    target = autocast.DynamicLossScale(1.0)  # every field at its default
    target_state = as_state(target)
    restored_state = flax.serialization.from_state_dict(
        target_state, flax.serialization.msgpack_restore(blob)
    )
    paths_and_leaves, treedef = jax.tree_util.tree_flatten_with_path(target)
    restored = jax.tree_util.tree_unflatten(
        treedef, [restored_state[jax.tree_util.keystr(p)] for p, _ in paths_and_leaves]
    )
    _assert_same_dynamic(restored, ls)
    # And it behaves as the saved state, not as the default target.
    for _ in range(5):
        restored = restored.adjust(F)
    assert _state(restored) == (16.0, 0)

    # The same through flax's list-of-leaves path (to_bytes / from_bytes with a target).
    leaves = flax.serialization.from_bytes(
        jax.tree_util.tree_leaves(target),
        flax.serialization.to_bytes(jax.tree_util.tree_leaves(ls)),
    )
    _assert_same_dynamic(jax.tree_util.tree_unflatten(treedef, leaves), ls)


@pytest.mark.parametrize("half", [jnp.float16, jnp.bfloat16])
def test_jmp_bug_b_half_precision_loss_scale_adjusts(half):
    """jmp bug (b): a float16 loss_scale made adjust raise (lax.select between float32 and
    float16). It must work, and the scale is stored in float32."""
    ls = autocast.DynamicLossScale(half(1024.0), period=1, min_loss_scale=half(2.0))
    _assert_fields(ls, loss_scale=1024.0, min_loss_scale=2.0)
    _assert_fields(ls.adjust(T), loss_scale=2048.0, counter=0)
    _assert_fields(ls.adjust(F), loss_scale=512.0, counter=0)
    _assert_fields(jax.jit(lambda s: s.adjust(F))(ls), loss_scale=512.0)
    static = autocast.StaticLossScale(half(8.0))
    assert static.loss_scale.dtype == jnp.float32 and float(static.loss_scale) == 8.0


def test_jmp_bug_c_float16_scale_grows_past_float16_max():
    """jmp bug (c): a float16 scale cannot pass 65504 (jmp got stuck at 32768 or overflowed
    to inf). Kept in float32, it grows on and stays finite."""
    ls = autocast.DynamicLossScale(jnp.float16(2.0**15), period=1, min_loss_scale=jnp.float16(1))
    ls = ls.adjust(T)
    assert _state(ls) == (2.0**16, 0)
    ls = ls.adjust(T)
    assert _state(ls) == (2.0**17, 0)
    assert ls.loss_scale.dtype == jnp.float32
    odd = autocast.DynamicLossScale(jnp.float16(40000.0), period=1).adjust(T)
    assert _state(odd) == (80000.0, 0)
    # Scaling a float16 leaf by 2**16 does not round the scale itself to float16 (inf).
    scaled = ls.adjust(F).scale(jnp.float16(2.0**-10))  # 2**16 * 2**-10
    assert float(scaled) == 64.0
    unscaled = ls.adjust(F).unscale(jnp.float16(2.0**10))  # 2**10 / 2**16
    assert unscaled.dtype == jnp.float16 and float(unscaled) == 2.0**-6


HALF_AND_FULL = [jnp.float16, jnp.bfloat16, jnp.float32]


@pytest.mark.parametrize("dtype", HALF_AND_FULL)
@pytest.mark.parametrize(
    "ls",
    [autocast.StaticLossScale(8.0), autocast.DynamicLossScale(8.0), autocast.NoOpLossScale()],
    ids=["static", "dynamic", "noop"],
)
def test_jmp_bug_d_unscale_keeps_leaf_dtype_scale_widens_16_bit(ls, dtype):
    """jmp bug (d): unscale multiplied by a float32 scale and promoted float16 and bfloat16
    gradients to float32. unscale keeps each leaf's dtype. scale (of the loss) deliberately
    returns 16-bit leaves in float32, so that a scaled float16 loss cannot overflow; a NoOp
    scale returns the tree itself."""
    tree = {"a": jnp.full((3,), 1.5, dtype), "b": [jnp.asarray(0.25, dtype)]}
    factor = float(ls.loss_scale)
    noop = isinstance(ls, autocast.NoOpLossScale)
    scaled_dtype = dtype if noop else jnp.float32
    for out, mult, want in (
        (ls.scale(tree), factor, scaled_dtype),
        (ls.unscale(tree), 1 / factor, dtype),
    ):
        assert out["a"].dtype == want and out["b"][0].dtype == want
        assert out["a"].shape == (3,) and out["b"][0].shape == ()
        np.testing.assert_array_equal(np.asarray(out["a"], np.float32), 1.5 * mult)
        assert float(out["b"][0]) == 0.25 * mult


def test_jmp_bug_d_dtype_kept_under_jit():
    """jmp bug (d), traced: the jitted unscale keeps float16 and bfloat16 dtypes; the jitted
    scale widens them to float32."""
    ls = autocast.DynamicLossScale(2.0**10)
    tree = {"h": jnp.ones(2, jnp.float16), "b": jnp.ones(2, jnp.bfloat16)}
    scaled, unscaled = jax.jit(lambda s, t: (s.scale(t), s.unscale(t)))(ls, tree)
    assert unscaled["h"].dtype == jnp.float16 and unscaled["b"].dtype == jnp.bfloat16
    assert scaled["h"].dtype == scaled["b"].dtype == jnp.float32
    assert float(scaled["h"][0]) == 1024.0 and float(unscaled["b"][0]) == 2.0**-10


def test_jmp_bug_d_float64_leaves_keep_dtype():
    """jmp bug (d), 64-bit: a float64 leaf stays float64 (and is not rounded to float32)."""
    ls = autocast.StaticLossScale(4.0)
    with _x64():
        x = jnp.asarray([1.0 + 2.0**-40], jnp.float64)
        assert x.dtype == jnp.float64
        scaled, unscaled = ls.scale(x), ls.unscale(x)
        assert scaled.dtype == jnp.float64 and unscaled.dtype == jnp.float64
        assert float(scaled[0]) == 4.0 + 2.0**-38  # needs float64 precision
        assert float(unscaled[0]) == 0.25 + 2.0**-42
        npx = np.asarray([3.0], np.float64)
        assert ls.scale(npx).dtype == np.float64


def test_jmp_bug_d_numpy_half_leaves_keep_dtype():
    """jmp bug (d), NumPy leaves: a NumPy float16 gradient keeps float16 when unscaled."""
    out = autocast.StaticLossScale(2.0).unscale({"n": np.ones(2, np.float16)})
    assert out["n"].dtype == np.float16
    np.testing.assert_array_equal(np.asarray(out["n"]), [0.5, 0.5])
    scaled = autocast.StaticLossScale(2.0).scale({"n": np.ones(2, np.float16)})
    np.testing.assert_array_equal(np.asarray(scaled["n"]), [2.0, 2.0])


@pytest.mark.parametrize(
    "ls",
    [autocast.StaticLossScale(8.0), autocast.DynamicLossScale(8.0)],
    ids=["static", "dynamic"],
)
def test_jmp_bug_d_non_float_leaves_pass_through_untouched(ls):
    """jmp bug (d), other leaves: jmp multiplied integer and bool arrays by the scale (turning
    them into float32) and failed on strings. They must pass through as the same objects."""
    ints = jnp.arange(3, dtype=jnp.int32)
    bools = jnp.array([True, False])
    np_ints = np.arange(2, dtype=np.int64)
    tree = {
        "i": ints,
        "b": bools,
        "n": np_ints,
        "s": "name",
        "p": 0.5,
        "k": 3,
        "none": None,
        "f": jnp.ones(2, jnp.float16),
    }
    for out in (ls.scale(tree), ls.unscale(tree)):
        assert out["i"] is ints and out["b"] is bools and out["n"] is np_ints
        assert out["s"] == "name" and out["none"] is None
        assert out["p"] == 0.5 and type(out["p"]) is float  # Python floats are left alone
        assert out["k"] == 3 and type(out["k"]) is int
    assert ls.unscale(tree)["f"].dtype == jnp.float16
    assert float(ls.scale(tree)["f"][0]) == 8.0


def test_gradients_of_complex_parameters_come_back_unscaled_from_every_face():
    """A real loss scaled by 2**15 scales the gradients of complex parameters as well: each
    face divides them again (they once came back 2**15 times too large, and no check
    noticed: they were finite)."""
    import optax

    import autocast.optax

    w = jnp.array([1.0 + 2.0j, -0.5 + 0.25j], jnp.complex64)
    loss = lambda w: jnp.sum(jnp.abs(w) ** 2)  # noqa: E731
    want = jax.grad(loss)(w)  # 2 * conj(w), JAX's convention for a real function

    ls = autocast.DynamicLossScale(2.0**15)
    got = ls.unscale(jax.grad(lambda p: ls.scale(loss(p)))(w))
    assert got.dtype == jnp.complex64
    np.testing.assert_array_equal(got, want)

    _, (_, got) = autocast.dynamic_scale_value_and_grad(loss)(
        w, dynamic_scaler_state=autocast.DynamicScalerState()
    )
    np.testing.assert_array_equal(got, want)

    tx = autocast.optax.dynamic_loss_scaling(optax.sgd(0.1))
    state = tx.init(w)
    scale = autocast.optax.loss_scale_of(state)
    updates, _ = tx.update(jax.grad(lambda p: scale.scale(loss(p)))(w), state, w)
    np.testing.assert_allclose(updates, -0.1 * want, rtol=1e-6)


# --------------------------------------------------------------------------------------------
# 3. scale / unscale values.
# --------------------------------------------------------------------------------------------


@jax.jit
def _scale_roundtrip(ls, x):
    scaled = ls.scale(x)
    return scaled, ls.unscale(scaled)


@settings(max_examples=50, deadline=None)
@given(
    values=st.lists(
        st.floats(2.0**-90, 2.0**90, width=32).flatmap(lambda v: st.sampled_from([v, -v])),
        min_size=8,
        max_size=8,
    ),
    exponent=st.integers(-20, 30),
)
def test_unscale_inverts_scale_exactly_for_float32(values, exponent):
    x = np.asarray(values, np.float32)
    ls = autocast.StaticLossScale(2.0**exponent)
    scaled, back = _scale_roundtrip(ls, jnp.asarray(x))
    assert scaled.dtype == back.dtype == jnp.float32
    # A power of two multiplies exactly (no overflow or denormals in this range).
    np.testing.assert_array_equal(np.asarray(scaled), x * np.float32(2.0**exponent))
    np.testing.assert_array_equal(np.asarray(back), x)


def test_scale_multiplies_by_power_of_two_exactly_from_float16():
    x = jnp.asarray([0.1, -3.3, 1e-3, 7.0], jnp.float16)
    out = autocast.DynamicLossScale(2.0**10).scale(x)
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x).astype(np.float32) * 1024.0)


@pytest.mark.parametrize(
    "ls",
    [
        autocast.StaticLossScale(2.0**15),
        autocast.DynamicLossScale(2.0**15),
        autocast.DynamicScalerState(),
    ],
    ids=["static", "dynamic", "scaler-state"],
)
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_scaled_16_bit_loss_does_not_overflow(ls, dtype):
    """A float16 loss of 3.0 at the default 2**15 is 98304, beyond float16's 65504: kept in
    16 bits it was inf. scale returns it in float32, finite and exact (as jmp does)."""
    out = ls.scale(jnp.asarray(3.0, dtype))
    assert out.dtype == jnp.float32
    assert float(out) == 3.0 * 2**15
    # Under jit and differentiated: the scaled loss's cotangent flows back into the 16-bit
    # input in 16 bits, and unscale returns the true gradient in that dtype.
    grad = jax.jit(jax.grad(lambda x, s: s.scale(x * x * 0.25)))(jnp.asarray(3.0, dtype), ls)
    assert grad.dtype == dtype and float(grad) == 1.5 * 2**15
    assert ls.unscale(grad).dtype == dtype and float(ls.unscale(grad)) == 1.5


@pytest.mark.parametrize(
    "exponent, grad, expected",
    [
        (24, 2048.0, 2.0**-13),
        (24, 4096.0, 2.0**-12),
        (24, 3072.0, 3 * 2.0**-14),
        (26, 32768.0, 2.0**-11),  # 2**-26 is 0 in float16: the inverse must not be rounded
        (30, 65504.0, 65504.0 * 2.0**-30),
    ],
)
def test_unscale_float16_by_large_scale_does_not_flush(exponent, grad, expected):
    ls = autocast.DynamicLossScale(2.0**exponent)
    out = ls.unscale({"g": jnp.asarray([grad], jnp.float16)})["g"]
    assert out.dtype == jnp.float16
    assert float(out[0]) != 0.0
    assert float(out[0]) == float(np.float16(expected))


def test_unscale_by_non_power_of_two_is_close():
    x = jnp.asarray([3.0, -6.0], jnp.float32)
    out = autocast.StaticLossScale(3.0).unscale(x)
    np.testing.assert_allclose(np.asarray(out), [1.0, -2.0], rtol=1e-6)


# --------------------------------------------------------------------------------------------
# 4. NoOpLossScale and StaticLossScale.
# --------------------------------------------------------------------------------------------


def test_noop_is_identity():
    ls = autocast.NoOpLossScale()
    tree = {"a": jnp.ones(2, jnp.float16), "b": 3.0}
    assert ls.scale(tree) is tree and ls.unscale(tree) is tree
    assert ls.adjust(F) is ls and ls.adjust(T) is ls
    assert float(ls.loss_scale) == 1.0 and ls.loss_scale.dtype == jnp.float32


def test_noop_pytree_round_trip():
    ls = autocast.NoOpLossScale()
    leaves, treedef = jax.tree_util.tree_flatten(ls)
    assert leaves == []
    again = jax.tree_util.tree_unflatten(treedef, leaves)
    assert type(again) is autocast.NoOpLossScale
    out = jax.jit(lambda s, x: (s, s.scale(x)))(ls, jnp.float32(2.0))
    assert type(out[0]) is autocast.NoOpLossScale and float(out[1]) == 2.0


def test_static_scales_by_fixed_factor():
    ls = autocast.StaticLossScale(128.0)
    assert ls.loss_scale.dtype == jnp.float32 and float(ls.loss_scale) == 128.0
    assert float(ls.scale(jnp.float16(0.5))) == 64.0
    assert float(ls.unscale(jnp.float16(64.0))) == 0.5
    assert ls.adjust(F) is ls and ls.adjust(T) is ls
    assert float(ls.adjust(F).loss_scale) == 128.0


def test_static_pytree_round_trip():
    ls = autocast.StaticLossScale(32.0)
    leaves, treedef = jax.tree_util.tree_flatten(ls)
    assert len(leaves) == 1 and float(leaves[0]) == 32.0
    again = jax.tree_util.tree_unflatten(treedef, leaves)
    assert type(again) is autocast.StaticLossScale and float(again.loss_scale) == 32.0
    through = jax.jit(lambda s: s)(ls)
    assert type(through) is autocast.StaticLossScale
    assert through.loss_scale.dtype == jnp.float32 and float(through.loss_scale) == 32.0


def test_repr_names_the_fields():
    text = repr(_sample_dynamic())
    assert text.startswith("DynamicLossScale(")
    for name in DYNAMIC_FIELDS:
        assert f"{name}=" in text


# --------------------------------------------------------------------------------------------
# 5. all_finite.
# --------------------------------------------------------------------------------------------


def test_all_finite_empty_tree_is_true():
    for tree in ({}, [], (), None, {"a": []}):
        out = autocast.all_finite(tree)
        assert out.dtype == jnp.bool_ and out.shape == () and bool(out) is True


@pytest.mark.parametrize("dtype", HALF_AND_FULL)
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("leaf", ["a", "m", "z"])
def test_all_finite_false_on_any_non_finite_leaf(dtype, bad, leaf):
    good = {"a": jnp.ones((2, 3), dtype), "m": [jnp.zeros(4, dtype)], "z": jnp.asarray(1.0, dtype)}
    out = autocast.all_finite(good)
    assert out.dtype == jnp.bool_ and out.shape == () and bool(out) is True
    tree = dict(good)
    if leaf == "a":
        tree["a"] = good["a"].at[1, 2].set(bad)
    elif leaf == "m":
        tree["m"] = [good["m"][0].at[0].set(bad)]
    else:
        tree["z"] = jnp.asarray(bad, dtype)
    out = autocast.all_finite(tree)
    assert out.dtype == jnp.bool_ and out.shape == () and bool(out) is False


def test_all_finite_ignores_non_float_leaves():
    tree = {
        "i": jnp.array([1, 2], jnp.int32),
        "b": jnp.array([True]),
        "n": None,
        "s": "nan",
        "p": float("inf"),  # a Python float is not an array leaf
        "f": np.ones(2, np.float32),
    }
    assert bool(autocast.all_finite(tree)) is True
    tree["f"] = np.array([1.0, np.nan], np.float32)  # NumPy float leaves are checked
    assert bool(autocast.all_finite(tree)) is False


def test_all_finite_under_jit():
    fn = jax.jit(autocast.all_finite)
    tree = {"a": jnp.ones(3, jnp.float16), "b": [jnp.ones(2, jnp.bfloat16)], "i": jnp.arange(3)}
    out = fn(tree)
    assert out.dtype == jnp.bool_ and out.shape == () and bool(out) is True
    tree["b"] = [jnp.array([1.0, np.inf], jnp.bfloat16)]
    out = fn(tree)
    assert out.dtype == jnp.bool_ and out.shape == () and bool(out) is False


def test_all_finite_single_leaf():
    assert bool(autocast.all_finite(jnp.float32(np.nan))) is False
    assert bool(autocast.all_finite(jnp.float32(1.0))) is True


# --------------------------------------------------------------------------------------------
# 6. select_tree.
# --------------------------------------------------------------------------------------------


def test_select_tree_picks_leafwise_with_traced_pred():
    a = {"w": jnp.ones((2, 2), jnp.float16), "i": jnp.array([1, 2])}
    b = {"w": jnp.zeros((2, 2), jnp.float16), "i": jnp.array([3, 4])}

    @jax.jit
    def pick(pred, a, b):
        # Equal non-array leaves (here added inside the trace) pass through.
        out = autocast.select_tree(pred, dict(a, tag="x"), dict(b, tag="x"))
        assert out["tag"] == "x"
        del out["tag"]
        return out

    for pred, src in ((True, a), (False, b)):
        out = pick(jnp.bool_(pred), a, b)
        assert out["w"].dtype == jnp.float16
        np.testing.assert_array_equal(np.asarray(out["w"]), np.asarray(src["w"]))
        np.testing.assert_array_equal(np.asarray(out["i"]), np.asarray(src["i"]))
    # Eager, with equal non-array leaves passing through.
    out = autocast.select_tree(jnp.bool_(False), dict(a, tag="x", lr=0.1), dict(b, tag="x", lr=0.1))
    assert out["tag"] == "x" and out["lr"] == 0.1
    np.testing.assert_array_equal(np.asarray(out["i"]), [3, 4])


def test_select_tree_selects_loss_scale_state():
    old, new = _sample_dynamic(), _sample_dynamic().adjust(F)
    kept = jax.jit(autocast.select_tree)(jnp.bool_(False), new, old)
    _assert_same_dynamic(kept, old)


@pytest.mark.parametrize(
    "pred",
    [jnp.int32(1), 1, jnp.float32(1.0), jnp.array([True]), jnp.array([True, False])],
    ids=["int-array", "python-int", "float", "shape-1", "shape-2"],
)
def test_select_tree_rejects_bad_pred(pred):
    a = {"w": jnp.ones(2)}
    with pytest.raises(TypeError, match="pred"):
        autocast.select_tree(pred, a, a)


def test_select_tree_rejects_dtype_mismatch_naming_the_leaf():
    a = {"layer": {"w": jnp.ones(2, jnp.float32)}}
    b = {"layer": {"w": jnp.ones(2, jnp.float16)}}
    with pytest.raises(TypeError, match=r"\['layer'\]\['w'\]"):
        autocast.select_tree(jnp.bool_(True), a, b)


def test_select_tree_rejects_shape_mismatch_naming_the_leaf():
    a = {"w": jnp.ones(2), "v": [jnp.ones(3)]}
    b = {"w": jnp.ones(2), "v": [jnp.ones((3, 1))]}
    with pytest.raises(TypeError, match=r"\['v'\]\[0\]"):
        autocast.select_tree(jnp.bool_(True), a, b)


def test_select_tree_rejects_differing_non_array_leaves():
    a = {"w": jnp.ones(2), "name": "adam"}
    b = {"w": jnp.ones(2), "name": "sgd"}
    with pytest.raises(TypeError, match=r"\['name'\]"):
        autocast.select_tree(jnp.bool_(True), a, b)


# --------------------------------------------------------------------------------------------
# 7. Bad input.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, pattern",
    [
        (dict(period=0), ValueError, r"^period must be at least 1"),
        (dict(period=-3), ValueError, r"^period must be at least 1"),
        (dict(period=2.5), ValueError, r"^period must be a whole number, got 2.5"),
        (dict(period=float("inf")), ValueError, r"^period must be a whole number"),
        (dict(period=np.float32(2.5)), ValueError, r"^period must be a whole number"),
        (dict(period=1 + 2j), TypeError, r"^period must be an integer"),
        (dict(period=True), TypeError, r"^period must be an integer"),
        (dict(period=jnp.array([1, 2])), ValueError, r"^period must be a scalar"),
        (dict(counter=-1), ValueError, r"^counter must be at least 0"),
        (dict(factor=0), ValueError, r"^factor"),
        (dict(factor=-2.0), ValueError, r"^factor"),
        (dict(factor=1), ValueError, r"^factor must be greater than 1"),
        (dict(factor=0.5), ValueError, r"^factor must be greater than 1"),
        (dict(factor=float("inf")), ValueError, r"^factor"),
        (dict(min_loss_scale=-0.5), ValueError, r"^min_loss_scale must be a non-negative"),
        (dict(min_loss_scale=-1.0), ValueError, r"^min_loss_scale"),
        (dict(min_loss_scale=float("nan")), ValueError, r"^min_loss_scale"),
        (dict(loss_scale=0.5), ValueError, r"below min_loss_scale"),
        (dict(loss_scale=4.0, min_loss_scale=8.0), ValueError, r"below min_loss_scale"),
        (dict(loss_scale=0.0), ValueError, r"^loss_scale must be a positive finite"),
        (dict(loss_scale=-4.0), ValueError, r"^loss_scale must be a positive finite"),
        (dict(loss_scale=float("inf")), ValueError, r"^loss_scale must be a positive finite"),
        (dict(loss_scale=float("nan")), ValueError, r"^loss_scale must be a positive finite"),
        (dict(loss_scale=jnp.ones(2)), ValueError, r"^loss_scale must be a scalar"),
        (dict(loss_scale=[2.0, 4.0]), ValueError, r"^loss_scale must be a scalar"),
        (dict(loss_scale=True), TypeError, r"^loss_scale"),
        (dict(loss_scale=jnp.bool_(True)), TypeError, r"^loss_scale"),
    ],
)
def test_dynamic_rejects_bad_arguments(kwargs, error, pattern):
    kwargs = dict(kwargs)
    loss_scale = kwargs.pop("loss_scale", 1024.0)
    with pytest.raises(error, match=pattern):
        autocast.DynamicLossScale(loss_scale, **kwargs)


@pytest.mark.parametrize(
    "value, error, pattern",
    [
        (0.0, ValueError, r"^loss_scale must be a positive finite"),
        (-1.0, ValueError, r"^loss_scale must be a positive finite"),
        (float("inf"), ValueError, r"^loss_scale must be a positive finite"),
        (float("nan"), ValueError, r"^loss_scale must be a positive finite"),
        (jnp.ones((1,)), ValueError, r"^loss_scale must be a scalar"),
        (False, TypeError, r"^loss_scale"),
    ],
)
def test_static_rejects_bad_loss_scale(value, error, pattern):
    with pytest.raises(error, match=pattern):
        autocast.StaticLossScale(value)


@pytest.mark.parametrize(
    "flag",
    [jnp.int32(1), 1, jnp.float32(1.0), jnp.array([True]), jnp.array([True, False])],
    ids=["int-array", "python-int", "float", "shape-1", "shape-2"],
)
@pytest.mark.parametrize(
    "ls",
    [autocast.DynamicLossScale(8.0), autocast.StaticLossScale(8.0), autocast.NoOpLossScale()],
    ids=["dynamic", "static", "noop"],
)
def test_adjust_rejects_non_bool_or_non_scalar_flag(ls, flag):
    with pytest.raises(TypeError, match="grads_finite"):
        ls.adjust(flag)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_scale_outside_float32_range_is_rejected_not_stored_as_inf_or_zero():
    """The scale "never becomes 0, inf or NaN". A finite Python (float64) value beyond
    the float32 range must be rejected (or clamped), not silently stored as inf or 0."""
    for kwargs in (
        dict(loss_scale=1e39),
        dict(loss_scale=1e-46, min_loss_scale=1e-46),
    ):
        try:
            ls = autocast.DynamicLossScale(**kwargs)
        except ValueError as err:
            assert "loss_scale" in str(err)
            continue
        for name in ("loss_scale", "min_loss_scale"):
            value = float(getattr(ls, name))
            assert math.isfinite(value) and value > 0, (
                f"DynamicLossScale({kwargs}) stored {name}={value}: the check runs on the "
                "float64 value before it is cast to float32"
            )


# --------------------------------------------------------------------------------------------
# 8. Construction inside jax.jit.
# --------------------------------------------------------------------------------------------


def test_dynamic_constructed_from_traced_arguments():
    @jax.jit
    def build(scale, counter, period, factor, floor):
        ls = autocast.DynamicLossScale(scale, counter, period, factor, floor)
        return ls, ls.adjust(jnp.bool_(True))

    ls, nxt = build(
        jnp.float32(64.0), jnp.int32(2), jnp.int32(3), jnp.float32(2.0), jnp.float32(4.0)
    )
    _assert_fields(ls, loss_scale=64.0, counter=2, period=3, factor=2.0, min_loss_scale=4.0)
    _assert_fields(nxt, loss_scale=128.0, counter=0)


def test_dynamic_constructed_with_only_the_scale_traced():
    build = jax.jit(lambda s: autocast.DynamicLossScale(s, period=5, min_loss_scale=2.0))
    ls = build(jnp.float16(8.0))
    _assert_fields(ls, loss_scale=8.0, counter=0, period=5, factor=2.0, min_loss_scale=2.0)


def test_dynamic_constructed_from_constants_inside_jit():
    ls = jax.jit(lambda: autocast.DynamicLossScale(32.0, period=3, factor=4))()
    _assert_fields(ls, loss_scale=32.0, counter=0, period=3, factor=4.0, min_loss_scale=1.0)


def test_static_constructed_from_traced_argument():
    out = jax.jit(lambda s, x: autocast.StaticLossScale(s).unscale(x))(
        jnp.float32(4.0), jnp.ones(2, jnp.float16)
    )
    assert out.dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(out), [0.25, 0.25])


def test_traced_float_period_is_refused():
    with pytest.raises(TypeError, match="period must be an integer, got a traced float32"):
        jax.jit(lambda p: autocast.DynamicLossScale(8.0, period=p))(jnp.float32(3.0))


# --------------------------------------------------------------------------------------------
# 9. Immutability.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, name",
    [
        (lambda: autocast.DynamicLossScale(8.0), "loss_scale"),
        (lambda: autocast.DynamicLossScale(8.0), "min_loss_scale"),
        (lambda: autocast.DynamicLossScale(8.0), "new_attribute"),
        (lambda: autocast.StaticLossScale(8.0), "loss_scale"),
        (lambda: autocast.NoOpLossScale(), "loss_scale"),
        (lambda: jax.tree_util.tree_map(lambda x: x, autocast.DynamicLossScale(8.0)), "counter"),
        (lambda: pickle.loads(pickle.dumps(autocast.DynamicLossScale(8.0))), "period"),
    ],
    ids=["dynamic", "dynamic-min", "dynamic-new", "static", "noop", "unflattened", "unpickled"],
)
def test_setting_an_attribute_raises(make, name):
    ls = make()
    before = repr(ls)
    with pytest.raises(AttributeError):
        setattr(ls, name, jnp.float32(1.0))
    assert repr(ls) == before


# --- review follow-ups ----------------------------------------------------------------------


def test_fields_cannot_be_deleted():
    ls = autocast.DynamicLossScale(8.0)
    with pytest.raises(AttributeError, match="min_loss_scale"):
        del ls.min_loss_scale
    assert float(ls.min_loss_scale) == 1.0


def test_all_finite_counts_complex_leaves():
    assert not bool(autocast.all_finite({"z": jnp.array([1 + 1j, complex(jnp.inf, 0)])}))
    assert bool(autocast.all_finite({"z": jnp.array([1 + 1j])}))


def test_select_tree_selects_numpy_scalars():
    out = autocast.select_tree(jnp.bool_(False), {"a": np.float32(1)}, {"a": np.float32(2)})
    assert float(out["a"]) == 2.0


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(loss_scale="abc"), TypeError, "^loss_scale must be a positive finite number"),
        (dict(loss_scale=1.0, period=2**40), ValueError, "^period must fit in int32"),
        (dict(loss_scale=1.0, factor="2"), TypeError, "^factor must be a positive finite number"),
    ],
)
def test_dynamic_rejects_unusable_values_with_named_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        autocast.DynamicLossScale(**kwargs)


# --------------------------------------------------------------------------------------------
# 10. jmp parity: the LossScale base type, dataclass behaviour, jmp's spellings.
# --------------------------------------------------------------------------------------------


def test_every_loss_scale_is_a_loss_scale():
    for ls in (
        autocast.NoOpLossScale(),
        autocast.StaticLossScale(2.0),
        autocast.DynamicLossScale(2.0),
        autocast.DynamicScalerState(),
    ):
        assert isinstance(ls, autocast.LossScale)
    assert not isinstance(2.0, autocast.LossScale)
    with pytest.raises(TypeError):
        autocast.LossScale()  # abstract: it has no adjust


def test_value_equality():
    assert autocast.NoOpLossScale() == autocast.NoOpLossScale()
    assert autocast.StaticLossScale(2.0) == autocast.StaticLossScale(jnp.float16(2))
    assert autocast.StaticLossScale(2.0) != autocast.StaticLossScale(4.0)
    assert autocast.DynamicLossScale(8.0, period=3) == autocast.DynamicLossScale(
        jnp.float32(8), counter=0, period=3
    )
    assert autocast.DynamicLossScale(8.0) != autocast.DynamicLossScale(8.0, period=3)
    assert autocast.DynamicLossScale(8.0) != autocast.StaticLossScale(8.0)
    ls = _sample_dynamic()
    assert jax.tree_util.tree_map(lambda x: x, ls) == ls
    assert jax.jit(lambda s: s)(ls) == ls
    assert pickle.loads(pickle.dumps(ls)) == ls
    assert ls.adjust(F) != ls
    # a Python bool on every Python (3.13's dataclasses would give the last field's Array)
    assert (ls == jax.tree_util.tree_map(lambda x: x, ls)) is True
    assert (ls.adjust(F) == ls) is False and (ls.adjust(F) != ls) is True
    assert (autocast.StaticLossScale(2.0) == autocast.StaticLossScale(2.0)) is True
    assert (autocast.NoOpLossScale() == autocast.NoOpLossScale()) is True
    assert autocast.StaticLossScale(2.0).__eq__(2.0) is NotImplemented
    assert hash(autocast.NoOpLossScale()) == hash(autocast.NoOpLossScale())


def test_dataclasses_replace_checks_and_converts():
    ls = _sample_dynamic()
    new = dataclasses.replace(ls, loss_scale=64, counter=1)
    _assert_fields(new, loss_scale=64.0, counter=1, period=7, factor=4.0, min_loss_scale=16.0)
    assert dataclasses.replace(autocast.StaticLossScale(2.0), loss_scale=8).loss_scale == 8.0
    with pytest.raises(ValueError, match="factor must be greater than 1"):
        dataclasses.replace(ls, factor=0.5)
    # Under jit, with traced fields, the checks that need values are skipped.
    reset = jax.jit(lambda s: dataclasses.replace(s, counter=0))(ls)
    _assert_fields(reset, loss_scale=2.0**12, counter=0, period=7, factor=4.0)
    assert [f.name for f in dataclasses.fields(ls)] == list(DYNAMIC_FIELDS)


def test_whole_float_counts_are_integers():
    """jmp accepts period=5.0; a float with a whole value counts as that integer."""
    ls = autocast.DynamicLossScale(8.0, counter=np.float32(1), period=5.0)
    _assert_fields(ls, period=5, counter=1)


def test_min_loss_scale_zero_means_no_floor_but_never_zero():
    ls = autocast.DynamicLossScale(10.0, period=20, factor=2, min_loss_scale=0.0)
    _assert_fields(ls, min_loss_scale=0.0)
    for i in range(100):
        ls = ls.adjust(F)
    assert float(ls.loss_scale) == pytest.approx(10.0 / 2**100, rel=1e-5)
    for _ in range(100):  # below 2**-126 the smallest normal float32 is the floor
        ls = ls.adjust(F)
    assert float(ls.loss_scale) == float(np.finfo(np.float32).tiny)
    assert float(ls.adjust(T).loss_scale) > 0


def test_loss_scales_are_unhashable_like_jmps_but_noop_is_hashable():
    # Frozen dataclasses hash their fields; array fields cannot be hashed (as in jmp).
    with pytest.raises(TypeError):
        hash(autocast.DynamicLossScale(8.0))
    assert hash(autocast.NoOpLossScale()) == hash(autocast.NoOpLossScale())
