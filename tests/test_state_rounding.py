"""Rounding onto bfloat16 and float16 grids (src/autocast/_src/state/rounding.py): the
float32 update it returns lands ``optax.apply_updates`` exactly on the rounded value, over
every exponent, zeros of both signs and subnormals; stochastic rounding is unbiased; its
random bits do not depend on the array's shape or on which element is asked for."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import autocast.optax
from autocast._src.state import bits as B
from autocast._src.state import rounding
from autocast._src.tools import measure as _measure

DTYPES = [jnp.bfloat16, jnp.float16]


@jax.jit
def _step(p, u, seed):
    """x = p + u in float32; its stochastic and nearest roundings, made canonical, their
    updates, and where optax.apply_updates lands each."""
    x = p.astype(jnp.float32) + u
    out = {"x": x}
    for name, bits in (("sr", B.element_bits(seed, p.shape)), ("rn", None)):
        r = rounding.round_onto(x, p.dtype, bits=bits)
        r, d = rounding.landing_update(r, p)
        out[name] = (r, d, optax.apply_updates(p, d))
    return out


def _bits_of(x, dtype):
    return np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(x).astype(dtype), jnp.uint16))


def _spacing(v, dtype):
    """The dtype's spacing at |v| (float64), float32's subnormals left out."""
    info = jnp.finfo(dtype)
    v = np.abs(np.asarray(v, np.float64))
    e = np.floor(np.log2(np.maximum(v, float(info.tiny))))
    return np.maximum(2.0 ** (e - (info.nmant)), max(float(info.smallest_subnormal), 2.0**-126))


def _check(p, u, seed=(3, 5)):
    """Every property of one batch of parameters ``p`` (16-bit) and updates ``u``."""
    dtype = p.dtype
    out = _step(p, u, jnp.asarray(seed, jnp.uint32))
    x = np.asarray(out["x"], np.float64)
    p64 = np.asarray(p.astype(jnp.float32), np.float64)
    for name in ("sr", "rn"):
        r, d, landed = out[name]
        r64, d = np.asarray(r, np.float64), np.asarray(d)
        ok = np.isfinite(d) | ~np.isfinite(r64)  # r - p past float32's range: see below
        # 1. apply_updates lands on the rounded value, bit for bit
        same = _bits_of(landed, dtype) == _bits_of(r, dtype)
        assert np.all(same | ~ok), (name, p[~same], u[~same], r64[~same], landed[~same])
        # 2. the rounded value is on the dtype's grid (its float32 value converts exactly)
        back = np.asarray(jnp.asarray(r).astype(dtype).astype(jnp.float32), np.float64)
        assert np.array_equal(back, r64, equal_nan=True), name
        # 3. next to x: within one spacing (the dtype's at x, or p's float32 spacing where an
        #    update cancels p); to nearest, within half of it
        finite = np.isfinite(x) & (np.abs(x) <= float(jnp.finfo(dtype).max))
        near = np.maximum(_spacing(x, dtype), np.abs(p64) * 2.0**-23)
        with np.errstate(invalid="ignore"):  # inf - inf where x overflowed
            gap, moved = np.abs(r64 - x), np.abs(x - p64)
        limit = near if name == "sr" else near / 2
        #    but a normal parameter keeps its value where the rounded value would be less
        #    than 2**-126 from it (an update a CPU flushes to zero: landing_update)
        kept = (r64 == p64) & (np.abs(p64) >= 2.0**-126) & (moved < 2.0**-126 + near)
        assert np.all(gap[finite & ~kept] <= limit[finite & ~kept] * (1 + 1e-9)), name
    return out


def _edge_values(dtype):
    info = jnp.finfo(dtype)
    tiny, sub, top = float(info.tiny), float(info.smallest_subnormal), float(info.max)
    base = [0.0, -0.0, 1.0, -1.0, 1.5, tiny, -tiny, sub, -sub, top, -top, 2.0**-126, 3e-39]
    return np.array(base + [v * k for v in (1.0, 2.0**-8, 2.0**20, 2.0**-40) for k in (1, -3)])


@pytest.mark.parametrize("dtype", DTYPES, ids=["bfloat16", "float16"])
def test_edge_cases_land_exactly(dtype):
    ps = _edge_values(dtype)
    p = jnp.asarray(np.repeat(ps, len(ps) + 6)).astype(dtype)
    p32 = np.asarray(p.astype(jnp.float32), np.float64)
    us = np.tile(np.concatenate([ps, [-0.0, 1e-45, -1e-45, 1e-40, 2e-38, -2e-38]]), len(ps))
    # and updates that cancel p to a tiny fraction of itself, the exact-landing hard case
    cancel = (
        -p32
        * (1 + np.tile([2.0**-9, -(2.0**-17), 2.0**-30, 3.0 * 2**-20], len(p32) // 4 + 1))[
            : len(p32)
        ]
    )
    u = jnp.asarray(np.concatenate([us, cancel]), jnp.float32)
    _check(jnp.concatenate([p, p]), u)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bfloat16", "float16"])
def test_a_zero_update_keeps_every_parameter_bit_for_bit(dtype):
    ps = _edge_values(dtype)
    p = jnp.asarray(ps).astype(dtype)
    # subnormal bfloat16 parameters are left out: a CPU reads them as zero in any arithmetic
    # (numpy decides: XLA on a CPU compares a subnormal as zero)
    p32 = np.asarray(p.astype(jnp.float32))
    p = p[(np.abs(p32) >= 2.0**-126) | (p32 == 0)]
    for zero in (0.0, -0.0):
        out = _step(p, jnp.full(p.shape, zero, jnp.float32), jnp.asarray([1, 2], jnp.uint32))
        for name in ("sr", "rn"):
            _, d, landed = out[name]
            assert np.array_equal(_bits_of(landed, dtype), _bits_of(p, dtype)), (name, zero)
            assert np.all(np.signbit(np.asarray(d))), (name, zero)  # -0.0 updates


def test_a_step_smaller_than_float32s_smallest_normal_keeps_the_parameter():
    # 1.1953125 * 2**-126 + 2**-126 rounds to a bfloat16 value 0.98 * 2**-126 above the
    # parameter: an update a CPU flushes to zero (hypothesis found it). The parameter keeps
    # its value on every platform, and Kahan's compensation keeps the whole update.
    p = jnp.asarray([1.1953125 * 2.0**-126, 1.0], jnp.bfloat16)
    u = jnp.asarray([2.0**-126, 2.0**-126], jnp.float32)
    out = _step(p, u, jnp.asarray([1, 2], jnp.uint32))
    for name in ("sr", "rn"):
        r, d, landed = out[name]
        assert np.array_equal(_bits_of(landed, p.dtype), _bits_of(p, p.dtype)), name
        assert np.array_equal(_bits_of(r, p.dtype), _bits_of(p, p.dtype)), name
    kahan = autocast.optax.kahan_summation()
    d, state = kahan.update({"w": u}, kahan.init({"w": p}), {"w": p})
    assert np.array_equal(_bits_of(optax.apply_updates(p, d["w"]), p.dtype), _bits_of(p, p.dtype))
    np.testing.assert_array_equal(np.asarray(state.compensation["w"], np.float32), np.asarray(u))


_P_BITS = st.integers(0, 2**16 - 1)
_LONGEST = 48
_F32 = st.floats(width=32, allow_nan=False, allow_infinity=False, allow_subnormal=True)


NARROW = {jnp.dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn)}


def _narrow_values(jaxpr):
    """The narrow float dtypes of the values ``jaxpr``'s equations make, nested ones too."""
    eqns = _measure.equations(jaxpr)
    return {v.aval.dtype for e in eqns for v in e.outvars if v.aval.dtype in NARROW}


@pytest.mark.parametrize("dtype", [*DTYPES, jnp.float8_e4m3fn])
def test_the_rounding_holds_no_narrow_value_a_gpu_could_widen(dtype):
    # XLA on a GPU drops a conversion to a narrow type and back as excess precision: the
    # rounding written that way came back unrounded on an H100 (0.708984375 rounded to
    # itself). Made of float32 and integer arithmetic only, there is nothing to widen.
    x, key_bits = jnp.ones(8), jnp.ones(8, jnp.uint32)
    for bits in (key_bits, None):
        jaxpr = jax.make_jaxpr(lambda x, b: rounding.round_onto(x, dtype, bits=b))(x, bits)
        assert not _narrow_values(jaxpr.jaxpr)
    p = jnp.ones(8, dtype)
    jaxpr = jax.make_jaxpr(lambda r, p: rounding.landing_update(r, p)[1])(x, p)
    assert not _narrow_values(jaxpr.jaxpr)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=["bfloat16", "float16"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.lists(
        st.tuples(
            _P_BITS, _F32, st.floats(-2.0, 2.0, width=32), st.integers(-45, 2), st.booleans()
        ),
        min_size=1,
        max_size=_LONGEST,
    ),
    seed=st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1)),
)
def test_landing_is_exact_for_any_parameter_and_update(dtype, data, seed):
    # padded with zero parameters and zero updates to the longest list: one shape, so one
    # program serves every example (the random bits do not depend on the shape)
    data = data + [(0, 0.0, 0.0, 0, True)] * (_LONGEST - len(data))
    bits = np.array([d[0] for d in data], np.uint16)
    p = jax.lax.bitcast_convert_type(jnp.asarray(bits), dtype)
    p = jnp.where(jnp.isfinite(p), p, jnp.zeros_like(p))
    p32 = np.asarray(p.astype(jnp.float32), np.float64)
    # half the updates arbitrary float32 values, half ones that cancel p to 2**-45..2**2 of it
    free = np.array([d[1] for d in data], np.float32)
    cancel = (-p32 * (1 + np.array([d[2] * 2.0 ** d[3] for d in data]))).astype(np.float32)
    u = np.where([d[4] for d in data], free, cancel)
    u = np.where(np.isfinite(u), u, 0.0).astype(np.float32)
    _check(p, jnp.asarray(u), seed)


def _rounded(x, dtype, n, seed):
    xs = jnp.full((n,), x, jnp.float32)
    bits = B.element_bits(jnp.asarray(seed, jnp.uint32), (n,))
    return np.asarray(jax.jit(rounding.round_onto, static_argnums=1)(xs, dtype, bits=bits))


@pytest.mark.parametrize(
    "dtype, x",
    [
        (jnp.bfloat16, 1.0 + 0.3 * 2**-7),  # chance 0.3
        (jnp.bfloat16, -(3.0 + 0.9 * 2**-6)),  # negative, chance 0.9
        (jnp.bfloat16, 5e-37),  # tiny: computed scaled by 2**64
        (jnp.bfloat16, 1.3e-38),  # just above float32's smallest normal
        (jnp.float16, 0.1 + 0.37 * 2**-14),
        (jnp.float16, 2.5e-7),  # float16 subnormals
        (jnp.float8_e4m3fn, 0.1234),  # the 8-bit state's codes
        (jnp.float8_e4m3fn, 7e-4),  # below e4m3's smallest value: 0 or 2**-9
    ],
    ids=[
        "bf16",
        "bf16 negative",
        "bf16 tiny",
        "bf16 smallest",
        "f16",
        "f16 subnormal",
        "e4m3",
        "e4m3 below",
    ],
)
def test_stochastic_rounding_is_unbiased(dtype, x):
    n = 1 << 16
    r = _rounded(x, dtype, n, (11, 13))
    values = np.unique(r)
    assert len(values) <= 2, values  # only the two neighbours
    lo, hi = (values[0], values[-1]) if len(values) == 2 else (values[0], values[0])
    x32 = float(np.float32(x))
    assert lo <= x32 <= hi
    # each element rounds up with probability q = (x - lo) / (hi - lo): the mean of n of them
    # is x with standard deviation (hi - lo) sqrt(q (1 - q) / n); 6 of them bound it (a
    # false alarm once in 5e8 runs)
    q = (x32 - lo) / (hi - lo) if hi > lo else 0.0
    sigma = (hi - lo) * np.sqrt(q * (1 - q) / n)
    assert abs(np.mean(r, dtype=np.float64) - x32) <= 6 * sigma + 1e-12 * abs(x32), (
        np.mean(r, dtype=np.float64),
        x32,
        sigma,
    )
    # and the same element over many steps (seeds) is unbiased too
    per_step = np.array([_rounded(x, dtype, 8, (s, 7 * s + 1))[3] for s in range(400)])
    assert abs(per_step.mean() - x32) <= 6 * (hi - lo) * np.sqrt(q * (1 - q) / 400) + 1e-12


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bfloat16", "float16"])
def test_rounding_to_nearest_matches_ieee_away_from_zero(dtype):
    x = jnp.asarray(np.random.default_rng(0).standard_normal(4096) * 10.0, jnp.float32)
    got = jax.jit(rounding.round_onto, static_argnums=1)(x, dtype)
    assert np.array_equal(np.asarray(got), np.asarray(x.astype(dtype).astype(jnp.float32)))


def test_element_bits_depend_on_position_and_seed_only():
    seed = jnp.asarray([5, 6], jnp.uint32)
    flat = np.asarray(B.element_bits(seed, (24,)))
    square = np.asarray(B.element_bits(seed, (4, 6)))
    cube = np.asarray(B.element_bits(seed, (2, 3, 4)))
    assert np.array_equal(flat, square.ravel()) and np.array_equal(flat, cube.ravel())
    assert len(set(flat.tolist())) == 24  # a bijection of the position, then of the seed
    other = np.asarray(B.element_bits(jnp.asarray([5, 7], jnp.uint32), (24,)))
    assert np.mean(flat == other) < 0.2
    # the top bits are uniform: 2**16 draws in 16 bins of the top 4 bits
    many = np.asarray(B.element_bits(seed, (1 << 16,))) >> 28
    counts = np.bincount(many, minlength=16)
    expected = (1 << 16) / 16
    chi2 = float(np.sum((counts - expected) ** 2 / expected))
    assert chi2 < 45.0, counts  # 15 degrees of freedom: p < 1e-4


def test_a_tree_s_elements_are_numbered_apart_and_draw_distinct_bits():
    # one pair of seeds for the tree: two arrays of one shape must still draw apart
    seed = jnp.asarray([5, 6], jnp.uint32)
    shapes = [(4, 6), (4, 6), (3,), (2, 2, 2)]
    offsets = B.offsets(shapes)
    assert offsets == [0, 24, 48, 51]
    drawn = np.concatenate(
        [np.asarray(B.element_bits(seed, s, o)).ravel() for s, o in zip(shapes, offsets)]
    )
    assert len(set(drawn.tolist())) == drawn.size
    assert np.array_equal(drawn, np.asarray(B.element_bits(seed, (drawn.size,))))
    assert B.offsets([(2**31,), (2**31,), (1,)]) == [0, 2**31, 0]  # modulo 2**32


def test_stochastic_rounding_gives_same_shaped_parameters_their_own_bits():
    params = {"a": jnp.ones(4096, jnp.bfloat16), "b": jnp.ones(4096, jnp.bfloat16)}
    tx = autocast.optax.stochastic_rounding(jax.random.key(3))
    u = {k: jnp.full(4096, 2.0**-9, jnp.float32) for k in params}  # a quarter spacing
    d, _ = tx.update(u, tx.init(params), params)
    up_a, up_b = (np.asarray(d[k]) > 0 for k in ("a", "b"))
    assert 0.2 < up_a.mean() < 0.3 and 0.2 < up_b.mean() < 0.3
    assert np.mean(up_a == up_b) < 0.7  # independent: 0.625 expected, 1.0 if shared


@pytest.mark.parametrize("dtype", rounding.NARROW, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_rounding_is_a_short_program(dtype, stochastic):
    # XLA compiles each parameter's rounding into a kernel of its own, and its compile time
    # grows with the operations in it: the grid is integer work on the bits (it took 76 to
    # 110 operations when computed in float32 from the exponent)
    x = jnp.ones((8, 8), jnp.float32)
    bits = jnp.ones((8, 8), jnp.uint32) if stochastic else None
    jaxpr = jax.make_jaxpr(lambda x, b: rounding.round_onto(x, dtype, bits=b))(x, bits)
    assert len(jaxpr.jaxpr.eqns) <= 32, len(jaxpr.jaxpr.eqns)
