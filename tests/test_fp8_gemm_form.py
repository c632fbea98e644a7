"""How a float8 product is written for XLA's GPU compiler: each product writes bfloat16 and is
rescaled by one scalar (which XLA folds into the float8 GEMM), the scales are powers of two
(so that scalar is exact in bfloat16), what that costs, and which recipe no float8 GEMM
takes; read off jaxprs and checked against float32. The GPU plan (``benchmarks/gpu_plan.py``,
a compile for an H100 without one) shows what XLA makes of it where ``make gpu-plan`` built
its venv."""

from __future__ import annotations

import functools
from pathlib import Path

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import gpu_plans, needs_gpu_plan_venv
from hypothesis import given, settings

import autocast
from autocast import _compat
from autocast._src.fp8 import numerics
from autocast._src.fp8 import products as fp8
from autocast._src.policy.target import Target
from autocast._src.tools import measure as _measure

ROOT = Path(__file__).parents[1]
E4M3, E5M2 = np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)


def _layer(x, w):
    return jnp.sum(jnp.tanh(x @ w))


def _args(scale=1.0, seed=0):
    kx, kw = jax.random.split(jax.random.PRNGKey(seed))
    return jax.random.normal(kx, (32, 48)) * scale, jax.random.normal(kw, (48, 64)) / 7


def _square(x, w):
    return jnp.sum((x @ w) ** 2)


def _levels(jaxpr):
    yield jaxpr
    for eqn in jaxpr.eqns:
        for sub in _compat.sub_jaxprs(eqn):
            yield from _levels(getattr(sub, "jaxpr", sub))


def _products_and_their_users(closed):
    """``(product, users of its result)`` for every float8 ``dot_general``, level by level."""
    found = []
    for level in _levels(closed.jaxpr):
        users = {}
        for eqn in level.eqns:
            for v in eqn.invars:
                if not isinstance(v, _compat.Literal):
                    users.setdefault(v, []).append(eqn)
        for eqn in level.eqns:
            if eqn.primitive.name == "dot_general" and all(
                v.aval.dtype.itemsize == 1 for v in eqn.invars
            ):
                found.append((eqn, users.get(eqn.outvars[0], [])))
    return found


def test_each_float8_product_writes_bfloat16_rescaled_by_one_scalar():
    # XLA's cuBLASLt rewriter folds one scalar multiply of the GEMM's result into the GEMM
    # (through the transposition a backward product ends with, which it folds first); a
    # second multiply or a float32 result would stay a pass of its own
    f = autocast.amp(_layer, compute_dtype="fp8")
    jaxpr = jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(*_args())
    found = _products_and_their_users(jaxpr)
    assert len(found) == 3
    for product, users in found:
        assert product.outvars[0].aval.dtype == jnp.bfloat16
        assert product.params["preferred_element_type"] == jnp.bfloat16
        ((user,),) = [users]
        result = product.outvars[0]
        if user.primitive.name == "transpose":
            result, (user,) = user.outvars[0], _users_of(jaxpr, user.outvars[0])
        assert user.primitive.name == "mul"
        scale = [v for v in user.invars if v is not result]
        assert len(scale) == 1 and scale[0].aval.shape == () and scale[0].aval.dtype == jnp.bfloat16


def _users_of(closed, var):
    return [
        e
        for level in _levels(closed.jaxpr)
        for e in level.eqns
        if any(v is var for v in e.invars if not isinstance(v, _compat.Literal))
    ]


def test_a_float16_result_is_written_by_a_float32_gemm():
    # the unscaled sums (256**2 x 48 here) overflow float16: the GEMM writes float32, and the
    # scaled result is rounded to float16 after it
    policy = {**autocast.default_amp_policy, "mlp": autocast.use_fp8_precision}

    def f(x, w):
        with jax.named_scope("mlp"):
            return x @ w

    amp16 = autocast.amp(f, compute_dtype=jnp.float16, amp_policy=policy)
    ones = jnp.ones((32, 48)), jnp.ones((48, 64))
    ((product, users),) = _products_and_their_users(jax.make_jaxpr(amp16)(*ones))
    assert product.outvars[0].aval.dtype == jnp.float32
    np.testing.assert_array_equal(amp16(*ones), 48.0)


@settings(max_examples=40, deadline=None)
@given(
    exponent=st.integers(-30, 30),
    mantissa=st.floats(1.0, 1.999),
    fmt=st.sampled_from([E4M3, E5M2]),
)
def test_scales_are_powers_of_two_with_the_amax_in_the_formats_top_binade(exponent, mantissa, fmt):
    top = float(jnp.finfo(fmt).max)
    amax = mantissa * 2.0**exponent
    x = jnp.array([amax, -amax / 3, amax / 1000], jnp.float32)
    s = float(fp8._scale(x, top))
    assert np.frexp(s)[0] == 0.5  # a power of two
    # the largest magnitude lands in (top / 2, top]: at most one binade of range given up
    assert top / 2 < float(jnp.float32(amax)) / s <= top
    q, s2 = fp8.quantise(x, fmt)
    assert float(s2) == s and float(jnp.max(jnp.abs(q.astype(jnp.float32)))) <= top


def test_delayed_scales_are_powers_of_two_too():
    history = jnp.array([2.0**5, 2.0**3, 0.0])  # powers of two, as histories hold amaxes
    assert float(fp8._from_history(history, E4M3)) == 2.0**5 / 256
    assert float(fp8._from_history(history, E5M2)) == 2.0**5 / 32768
    assert float(fp8._from_history(jnp.zeros(3), E4M3)) == 1.0


def test_power_of_two_bounds_keep_infinities_and_nans():
    v = jnp.array([1.0, 1.5, 2.0**-126, 3.0e38, jnp.inf, jnp.nan], jnp.float32)
    got = np.asarray(numerics.power_of_two_at_or_above(v))
    np.testing.assert_array_equal(got[:5], [1.0, 2.0, 2.0**-126, np.inf, np.inf])
    assert np.isnan(got[5])


def test_scales_whose_product_is_no_normal_float32_are_raised_into_range():
    # the GEMM applies sa * sb as one float32: below 2**-126 it would flush to zero on a GPU
    sa, sb = fp8._balanced(jnp.float32(2.0**-70), jnp.float32(2.0**-80))
    assert float(sa) * float(sb) == 2.0**-126
    assert (float(sa), float(sb)) == (2.0**-58, 2.0**-68)  # each gave up half the binades
    same = fp8._balanced(jnp.float32(2.0**-3), jnp.float32(2.0**-9))
    assert tuple(map(float, same)) == (2.0**-3, 2.0**-9)
    assert float(fp8._raised(jnp.float32(2.0**-120), jnp.float32(2.0**-10), jnp.float32(1.0))) == (
        2.0**-116
    )
    assert float(fp8._raised(jnp.float32(0.5), jnp.float32(2.0**-10), jnp.float32(1.0))) == 0.5


def test_the_product_is_its_float8_values_multiplied_and_rounded_once():
    # power-of-two scales divide exactly and multiply exactly, so the only roundings are
    # the float8 ones and the bfloat16 of the result (CPU: float32 sums, as the GEMM's)
    x, w = _args(scale=3.0)
    got = autocast.amp(lambda x, w: x @ w, compute_dtype="fp8")(x, w)

    def float8_product(x, w):
        (qx, sx), (qw, sw) = fp8.quantise(x, E4M3), fp8.quantise(w, E4M3)
        exact = (np.asarray(qx, np.float64) * float(sx)) @ (np.asarray(qw, np.float64) * float(sw))
        return np.asarray(jnp.asarray(exact, jnp.float32).astype(jnp.bfloat16), np.float32)

    # amp rounds the operands to bfloat16 before quantising them; XLA on a GPU may drop that
    # rounding as excess precision and quantise the float32 operands themselves (the five
    # elements an H100's log showed were exactly their product), which a CPU never does
    wants = [float8_product(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16))]
    if jax.default_backend() != "cpu":
        wants.append(float8_product(x, w))
    atol = 1e-3 * np.abs(wants[0]).max()
    assert any(np.allclose(got, want, rtol=2.0**-7, atol=atol) for want in wants)
    assert _measure.relative_error(got, x @ w) < 0.1


@pytest.mark.parametrize("scale", [1e-8, 1.0, 1e8])
def test_gradients_against_float32_at_any_magnitude(scale):
    x, w = _args(scale)
    f8 = jax.grad(autocast.amp(_square, compute_dtype="fp8"), argnums=(0, 1))(x, w)
    f32 = jax.grad(_square, argnums=(0, 1))(x, w)
    assert _measure.relative_error(f8, f32) < 0.15


def test_the_dequantised_form_dequantises_to_bfloat16_and_computes_the_same(monkeypatch):
    x, w = _args()
    direct = jax.grad(autocast.amp(_layer, compute_dtype="fp8"), argnums=(0, 1))(x, w)
    monkeypatch.setattr(fp8, "_GEMM_FORM", "dequantised")
    f = autocast.amp(_layer, compute_dtype="fp8")
    jaxpr = jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(x, w)
    dots = [e for e in _measure.equations(jaxpr) if e.primitive.name == "dot_general"]
    assert len(dots) == 3
    assert all(v.aval.dtype == jnp.bfloat16 for e in dots for v in [*e.invars, *e.outvars])
    widened = [
        e.params["new_dtype"]
        for e in _measure.equations(jaxpr)
        if e.primitive.name == "convert_element_type" and e.invars[0].aval.dtype.itemsize == 1
    ]
    assert widened and all(d == jnp.bfloat16 for d in widened)  # not float32
    assert _measure.float8_casts(jaxpr) == 3  # x, w and the output gradient, once each
    dequantised = jax.grad(f, argnums=(0, 1))(x, w)
    for a, b in zip(dequantised, direct):
        np.testing.assert_allclose(a, b, rtol=0.02, atol=1e-3)


def test_which_devices_have_float8_gemms():
    refused = functools.partial(fp8.float8_refusal, fp8.DEFAULT_RECIPE)
    assert refused(Target("gpu", "NVIDIA H100 80GB HBM3", "9.0")) is None
    assert refused(Target("gpu", "NVIDIA L4", "8.9")) is None
    assert "no float8 GEMMs" in refused(Target("gpu", "NVIDIA A100-SXM4-80GB", "8.0"))
    assert refused(Target("gpu", "AMD Instinct MI300X", "gfx942")) is None  # not checked
    assert refused(Target("cpu", "cpu")) is None  # emulated: its numerics can be studied


def test_e5m2_everywhere_is_refused_where_no_float8_gemm_takes_it():
    # cuBLASLt multiplies e4m3 by e4m3 or e5m2, never e5m2 by e5m2: XLA converts the pair
    # to bfloat16 (docs/fp8.md, "Hardware")
    x, w = _args()
    accepted = autocast.amp(_layer, compute_dtype=jnp.float8_e5m2)
    assert np.isfinite(float(accepted(x, w)))  # a CPU: it runs
    h100 = Target("gpu", "NVIDIA H100 80GB HBM3", "9.0")
    with pytest.raises(ValueError, match=r"float8_e5m2.*NVIDIA.*e4m3 operands forward and e5m2"):
        fp8.check_runs_in_float8(fp8.RECIPES[E5M2], h100)
    for fine in (jnp.float8_e4m3fn, jnp.float8_e5m2fnuz):
        assert fp8.float8_refusal(fp8.RECIPES[np.dtype(fine)], h100) is None
    # the default recipe and AMD's pair are not asked about
    for fine in ("fp8", jnp.float8_e4m3fn, jnp.float8_e5m2fnuz):
        assert np.isfinite(float(autocast.amp(_layer, compute_dtype=fine)(x, w)))


@pytest.mark.slow
@needs_gpu_plan_venv
def test_the_gpu_plan_fuses_the_scales_into_float8_gemms_that_write_bfloat16(tmp_path):
    # the layer at its real size (8192 x 1024 -> 4096, a few seconds a compile): at a tiny one
    # the scales' own few bytes decide which temporaries are larger
    rows = "linear/bf16/-;linear/fp8/-;linear/fp8 dq/-"
    plans, _ = gpu_plans(
        tmp_path, "--brief", "--devices", "H100", "--rows", rows, "--triton", "on,off"
    )

    def plan(variant, triton):
        return plans[f"linear / {variant} / - / H100 / Triton GEMM {triton}"]

    # Triton GEMM fusions off: three float8 cuBLASLt GEMMs, each writing bfloat16 with the
    # scales as its operand, and no kernel left to scale their results
    direct = plan("fp8", "off")
    gemms = [g for g in direct["gemms"] for _ in range(g["launches"])]
    assert len(gemms) == 3 and all(g["kind"] == "float8 cuBLASLt GEMM" for g in gemms)
    assert all("-> bf16, scales fused/1" in g["detail"] for g in gemms)
    assert direct["float8_passes"]["scalings"] == 0
    # the dequantised form: each scale an operand of its own, with Triton off only
    dq = plan("fp8 dq", "off")
    assert [
        g["detail"].split("scales ")[-1] for g in dq["gemms"] for _ in range(g["launches"])
    ] == ["fused/fused"] * 3
    assert all("f8" not in g["detail"] for g in plan("fp8 dq", "on")["gemms"])
    # Triton on: float8 Triton GEMM fusions, the scaling in their epilogue
    triton = plan("fp8", "on")
    assert sum(g["launches"] for g in triton["gemms"] if g["detail"].startswith("f8")) == 3
    for setting in ("on", "off"):
        assert plan("fp8", setting)["temporaries_mib"] <= plan("bf16", setting)["temporaries_mib"]
