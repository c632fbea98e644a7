"""Float8 compute: scaled e4m3 products forward, e5m2 output gradients backward,
float32 accumulation into bfloat16 results, bfloat16 for the rest; read off jaxprs and checked
against float32."""

from __future__ import annotations

import dataclasses
import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import FULL_OPTIMISATION, eqns_named, operand_dtypes
from hypothesis import given, settings

import autocast
from autocast._src.demo import models as _models
from autocast._src.demo import run as demo
from autocast._src.fp8 import products as fp8
from autocast._src.tools import measure as _measure


@pytest.fixture(autouse=True)
def _float8_at_any_size(monkeypatch):
    # These tests read float8 programs off products of a few elements; which sizes run in
    # float8 by default is tested in test_fp8_selection.py.
    monkeypatch.setattr(fp8, "MIN_EXTENT", 1)


E4M3, E5M2 = "float8_e4m3fn", "float8_e5m2"


def _is_fp8(dtypes):
    return all(d.itemsize == 1 for d in dtypes)


def _has_e5m2(dtypes):
    return any(d == jnp.float8_e5m2 for d in dtypes)


def _demo_gpt():
    config = dict(vocab=len(demo.ALPHABET), d=64, layers=2, seq=32)
    params = _models.init_gpt(jax.random.PRNGKey(0), **config)
    return params, next(demo.batches(demo.corpus(), batch=16, seq=config["seq"]))


def _batched(eqn):
    return eqn.primitive.name == "dot_general" and bool(eqn.params["dimension_numbers"][1][0])


def _flops_where(jaxpr, which, products):
    """(chosen, total) FLOPs of the products ``products`` selects, ``which`` judging dtypes."""
    total = chosen = 0
    for eqn in _measure.equations(jaxpr):
        if eqn.primitive.name in _measure.MATMUL_NAMES and products(eqn):
            flops = _measure.matmul_flops(eqn)
            total += flops
            chosen += flops if which([v.aval.dtype for v in eqn.invars[:2]]) else 0
    return chosen, total


# once: a model's share of the rule that every JAX checks product by product below (the
# formats of each spelling, convolutions' e4m3 forward and e5m2 gradients, the transformer's
# float8 residuals, attention's batched products in bfloat16)
@pytest.mark.once
@pytest.mark.slow
def test_gpt_weight_products_are_float8_forward_and_backward_with_e5m2_gradients():
    params, tokens = _demo_gpt()
    f8 = autocast.amp(_models.gpt_loss, compute_dtype=jnp.float8_e4m3fn)
    fwd = jax.make_jaxpr(f8)(params, tokens)
    both = jax.make_jaxpr(jax.value_and_grad(f8))(params, tokens)
    weights = lambda e: not _batched(e)  # noqa: E731
    fp8_fwd, total_fwd = _flops_where(fwd, _is_fp8, weights)
    fp8_all, total_all = _flops_where(both, _is_fp8, weights)
    e5m2_all, _ = _flops_where(both, _has_e5m2, weights)
    back = total_all - total_fwd
    assert fp8_fwd / total_fwd >= 0.95
    assert (fp8_all - fp8_fwd) / back >= 0.95
    assert e5m2_all / back >= 0.40
    # attention's batched products run in bfloat16, as Transformer Engine runs them
    batched = [
        tuple(v.aval.dtype.name for v in e.invars)
        for e in eqns_named(both, "dot_general")
        if _batched(e)
    ]
    assert batched and set(batched) == {("bfloat16", "bfloat16")}
    # every float8 product writes bfloat16 (its sums are float32 inside), rescaled after
    # it by XLA in the GEMM itself (test_fp8_gemm_form.py)
    assert all(
        e.outvars[0].aval.dtype == jnp.bfloat16
        for e in eqns_named(both, "dot_general")
        if _is_fp8([v.aval.dtype for v in e.invars])
    )
    loss, grads = jax.jit(jax.value_and_grad(f8))(params, tokens)
    loss32, grads32 = jax.jit(jax.value_and_grad(_models.gpt_loss))(params, tokens)
    assert loss.dtype == jnp.float32 and np.isfinite(loss)
    assert abs(float(loss) - float(loss32)) < 0.05 * float(loss32)
    same = jax.tree_util.tree_map(
        lambda g, r: g.dtype == r.dtype and g.shape == r.shape, grads, grads32
    )
    assert all(jax.tree_util.tree_leaves(same))
    assert autocast.all_finite(grads)
    assert _measure.relative_error(grads, grads32) < 0.2


@pytest.mark.once
@pytest.mark.slow
def test_training_150_adam_steps_ends_within_5_percent_of_bfloat16():
    params, _ = _demo_gpt()
    optimizer = optax.adam(3e-3)

    def train(loss_fn):
        @functools.partial(jax.jit, compiler_options=FULL_OPTIMISATION)
        def step(p, s, t):
            value, grads = jax.value_and_grad(loss_fn)(p, t)
            updates, s = optimizer.update(grads, s, p)
            return optax.apply_updates(p, updates), s, value

        p, s, losses = params, optimizer.init(params), []
        data = demo.batches(demo.corpus(), batch=16, seq=32)
        for _ in range(150):
            p, s, value = step(p, s, next(data))
            losses.append(float(value))
        return np.mean(losses[-10:]), losses

    bf16, _ = train(autocast.amp(_models.gpt_loss, compute_dtype=jnp.bfloat16))
    f8, losses = train(autocast.amp(_models.gpt_loss, compute_dtype="fp8"))
    assert np.all(np.isfinite(losses))
    assert losses[-1] < 0.8 * losses[0]  # it learned
    assert abs(f8 / bf16 - 1) < 0.05


@pytest.mark.parametrize("scale", [1e-6, 1.0, 1e4])
def test_per_tensor_scaling_holds_ranges_e4m3_cannot(scale):
    kx, kw = jax.random.split(jax.random.PRNGKey(1))
    x = jax.random.normal(kx, (32, 64)) * scale
    w = jax.random.normal(kw, (64, 48))
    exact = x @ w
    got = autocast.amp(lambda x, w: x @ w, compute_dtype="fp8")(x, w)
    assert got.dtype == jnp.float32
    assert _measure.relative_error(got, exact) < 0.1
    # the same operands cast to e4m3 unscaled: 1e-6 is below its smallest subnormal (2**-9)
    # and 1e4 above its largest value (448), so without the scale both would be lost
    unscaled = x.astype(jnp.float8_e4m3fn).astype(jnp.float32) @ w
    if scale != 1.0:
        assert not _measure.relative_error(unscaled, exact) < 0.5


@pytest.mark.slow
@settings(max_examples=15, deadline=None)
@given(k=st.integers(-40, 40), seed=st.integers(0, 2**16))
def test_scaling_an_operand_by_a_power_of_two_scales_the_product_exactly(k, seed):
    kx, kw = jax.random.split(jax.random.PRNGKey(seed))
    x = jax.random.normal(kx, (8, 16))
    w = jax.random.normal(kw, (16, 4))
    product = jax.jit(autocast.amp(lambda x, w: x @ w, compute_dtype="fp8"))
    # the quantised values are the same, only the float32 scale moves
    np.testing.assert_array_equal(product(x * 2.0**k, w), product(x, w) * 2.0**k)


@pytest.mark.parametrize(
    "spelling, forward, gradient",
    [
        ("fp8", E4M3, E5M2),
        (" FP8 ", E4M3, E5M2),
        ("float8", E4M3, E5M2),
        (jnp.float8_e4m3fn, E4M3, E5M2),
        ("float8_e4m3fn", E4M3, E5M2),
        (jnp.float8_e5m2, E5M2, E5M2),
        (jnp.float8_e4m3fnuz, "float8_e4m3fnuz", "float8_e5m2fnuz"),
    ],
)
def test_spellings_choose_forward_and_gradient_formats(spelling, forward, gradient):
    w, x = jnp.ones((4, 3)), jnp.ones((2, 4))
    f = autocast.amp(lambda w, x: jnp.sum(x @ w), compute_dtype=spelling)
    jaxpr = jax.make_jaxpr(jax.grad(f))(w, x)
    dots = operand_dtypes(jaxpr, "dot_general")
    assert dots[0] == (forward, forward)
    assert all(sorted(d) == sorted((forward, gradient)) for d in dots[1:]) and len(dots) == 3
    assert float(f(w, x)) == 24.0


def test_float8_types_without_a_recipe_are_refused_by_name():
    with pytest.raises(ValueError, match="float8_e4m3b11fnuz.*accepted.*'fp8'.*float8_e5m2"):
        autocast.amp(lambda x: x, compute_dtype=jnp.float8_e4m3b11fnuz)
    with pytest.raises(ValueError, match="fp9"):
        autocast.amp(lambda x: x, compute_dtype="fp9")


def test_everything_but_the_products_follows_the_bfloat16_rules():
    w, x = jnp.ones((8, 8)), jnp.ones((4, 8))

    def f(w, x):
        h = jnp.tanh(x @ w)
        return jnp.sum(jnp.exp(h @ w))

    def dtypes(jaxpr, name):
        return [e.outvars[0].aval.dtype.name for e in eqns_named(jaxpr, name)]

    f8 = jax.make_jaxpr(autocast.amp(f, compute_dtype="fp8"))(w, x)
    bf = jax.make_jaxpr(autocast.amp(f, compute_dtype=jnp.bfloat16))(w, x)
    for name in ("tanh", "exp", "reduce_sum"):
        assert dtypes(f8, name) == dtypes(bf, name)
    assert dtypes(f8, "tanh") == ["bfloat16"] and dtypes(f8, "exp") == ["float32"]


@pytest.mark.slow
def test_convolutions_run_in_float8_with_e5m2_gradients():
    kk, ki = jax.random.split(jax.random.PRNGKey(2))
    img = jax.random.normal(ki, (2, 3, 16, 16))
    kernel = jax.random.normal(kk, (8, 3, 3, 3)) / 5
    depthwise = jax.random.normal(kk, (3, 1, 3, 3))

    def conv(kernel, img, groups):
        y = jax.lax.conv_general_dilated(img, kernel, (2, 2), "SAME", feature_group_count=groups)
        return jnp.sum(jnp.sin(y))

    # JAX's convolution takes one operand dtype: both backward operands are e5m2. GPUs have
    # no float8 grouped (depthwise) convolution: those run in bfloat16, forward and backward.
    expected = {1: [(E4M3, E4M3), (E5M2, E5M2), (E5M2, E5M2)], 3: [("bfloat16", "bfloat16")] * 3}
    for k, groups in ((kernel, 1), (depthwise, 3)):
        f8 = autocast.amp(conv, compute_dtype="fp8")
        jaxpr = jax.make_jaxpr(jax.grad(f8, (0, 1)), static_argnums=2)(k, img, groups)
        assert operand_dtypes(jaxpr, "conv_general_dilated") == expected[groups]
        got = jax.grad(f8, (0, 1))(k, img, groups)
        want = jax.grad(conv, (0, 1))(k, img, groups)
        assert _measure.relative_error(got, want) < 0.15


@pytest.mark.slow
def test_products_under_vmap_scan_checkpoint_and_jit():
    kw, kx = jax.random.split(jax.random.PRNGKey(3))
    w = jax.random.normal(kw, (8, 8)) / 3
    xs = jax.random.normal(kx, (5, 4, 8))

    def scanned(w, x):
        @jax.checkpoint
        def body(c, _):
            return jnp.tanh(c @ w), None

        return jnp.sum(jax.lax.scan(body, x, None, length=3)[0] ** 2)

    grad8 = jax.jit(jax.vmap(jax.grad(autocast.amp(scanned, compute_dtype="fp8")), (None, 0)))
    want = jax.vmap(jax.grad(scanned), (None, 0))(w, xs)
    assert _measure.relative_error(grad8(w, xs), want) < 0.15
    dots = operand_dtypes(jax.make_jaxpr(grad8)(w, xs), "dot_general")
    assert dots and all(_is_fp8([np.dtype(d) for d in ds]) for ds in dots)
    assert any(E5M2 in ds for ds in dots)


def test_nonfinite_operands_stay_nonfinite_and_zeros_stay_zero():
    f = autocast.amp(lambda x, w: x @ w, compute_dtype="fp8")
    w = jnp.ones((4, 2))
    # an overflow upstream must reach the loss scaler's check, not be clipped into range
    for bad in (jnp.inf, jnp.nan):
        assert not np.all(np.isfinite(f(jnp.ones((3, 4)).at[0, 0].set(bad), w)))
    np.testing.assert_array_equal(f(jnp.zeros((3, 4)), w), jnp.zeros((3, 2)))
    g = jax.grad(lambda x: jnp.sum(f(x, w) * 0.0))(jnp.ones((3, 4)))
    np.testing.assert_array_equal(g, jnp.zeros((3, 4)))


def test_a_transformer_keeps_its_float8_operands_for_its_backward_pass():
    # the products keep their float8 operands where bfloat16 keeps nothing of them: bfloat16
    # recomputes a layer norm's output and the GELU's into the product that reads it,
    # float8 keeps its float8 copy (recomputing it would quantise again, one more amax pass
    # over the activation). Measured on this model: 0.267x float32's against bfloat16's
    # 0.210x, 1.27x bfloat16's (1.004x before bfloat16 recomputed regions too)
    params, tokens = _demo_gpt()
    keep = lambda fn: _measure.residual_bytes(fn, params, tokens, include_inputs=False)  # noqa: E731
    f32 = keep(_models.gpt_loss)
    f8 = keep(autocast.amp(_models.gpt_loss, compute_dtype="fp8"))
    bf = keep(autocast.amp(_models.gpt_loss, compute_dtype=jnp.bfloat16))
    assert bf < f8 < 0.3 * f32 and f8 < 1.35 * bf


def test_a_users_policy_keeps_its_own_product_rows_and_fp8_can_go_to_one_scope():
    w, x = jnp.ones((4, 4)), jnp.ones((2, 4))
    full = {**autocast.default_amp_policy, jax.lax.dot_general_p: autocast.use_full_precision}
    jaxpr = jax.make_jaxpr(autocast.amp(lambda w, x: x @ w, compute_dtype="fp8", amp_policy=full))(
        w, x
    )
    assert operand_dtypes(jaxpr, "dot_general") == [("float32", "float32")]

    def f(w, x):
        with jax.named_scope("mlp"):
            x = x @ w
        return x @ w

    scoped = {**autocast.default_amp_policy, "mlp": autocast.use_fp8_precision}
    jaxpr = jax.make_jaxpr(autocast.amp(f, compute_dtype=jnp.bfloat16, amp_policy=scoped))(w, x)
    assert operand_dtypes(jaxpr, "dot_general") == [(E4M3, E4M3), ("bfloat16", "bfloat16")]


def test_report_and_diagnose_read_float8_programs():
    kw, kx = jax.random.split(jax.random.PRNGKey(5))
    w, x = jax.random.normal(kw, (16, 8)), jax.random.normal(kx, (4, 16))

    def f(w, x):
        return jnp.sum(jnp.tanh(x @ w / 4) ** 2)

    r = autocast.report(f, compute_dtype="fp8")(w, x)
    assert r.summary["fp8_flop_share"] == {"forward": 1.0, "backward": 1.0}
    assert "use_fp8_precision" in {row.rule for row in r.rows}
    assert "fp8_flop_share" not in autocast.report(f, compute_dtype=jnp.bfloat16)(w, x).summary
    d = autocast.diagnose(jax.grad(f), compute_dtype="fp8")(w, x)
    assert d.compute_dtype == jnp.float8_e4m3fn
    dots = [e for e in d.entries if e.primitive == "dot_general"]
    # the forward product, and the backward one for w (x's is not asked for)
    assert [e.backward for e in dots] == [False, True]
    assert all(e.dtype == jnp.float8_e4m3fn and 0 < e.rel_error < 0.2 for e in dots)
    assert 0 < d.output_error < 0.2


def test_the_recipe_is_a_policy_of_the_default_table():
    recipe = fp8.recipe_for("fp8")
    policy = fp8.with_fp8_products(autocast.default_amp_policy, recipe)
    changed = {k for k in policy if policy[k] is not autocast.default_amp_policy[k]}
    assert changed == {jax.lax.dot_general_p, jax.lax.conv_general_dilated_p}
    assert all(policy[k] is autocast.use_fp8_precision for k in changed)
    assert fp8.recipe_for(jnp.bfloat16) is None and fp8.recipe_for("bf16") is None


@pytest.mark.slow
def test_second_derivatives_are_refused_not_rounded():
    kx, kw = jax.random.split(jax.random.PRNGKey(6))
    x, w = jax.random.normal(kx, (3, 4)), jax.random.normal(kw, (4, 2))
    f = autocast.amp(lambda w: jnp.sum(jnp.tanh(x @ w)), compute_dtype="fp8")
    for second in (jax.hessian(f), jax.grad(lambda w: jnp.sum(jax.grad(f)(w) ** 2))):
        with pytest.raises(TypeError, match="first derivatives only"):
            second(w)
    # forward mode: JAX's own refusal of a custom derivative
    with pytest.raises(TypeError):
        jax.jvp(f, (w,), (jnp.ones_like(w),))


def test_extreme_but_finite_operands_and_empty_ones():
    f = jax.jit(autocast.amp(lambda x, w: x @ w, compute_dtype="fp8"))
    # an amax so small its scale would be subnormal: zeros stay zeros, not 0/0
    tiny = jnp.array([[1e-36, 0.0, 1e-36, 1e-36]])
    out = f(tiny, jnp.ones((4, 2)))
    np.testing.assert_allclose(out, 3e-36 * jnp.ones((1, 2)), rtol=0.1)
    # two scales whose product leaves float32's range: the GEMM applies them as one factor,
    # so the result is non-finite even where it is exactly zero (0 x inf), never finite and
    # wrong; the step's overflow check sees it (operands' amaxes near 1e22, far past training)
    assert not np.isfinite(f(jnp.array([[1e22, 0.0]]), jnp.array([[0.0], [1e22]]))).any()
    # small times small, where the product of the scales alone would flush to zero: both
    # scales are raised into range, each operand giving up binades at the bottom of its range
    np.testing.assert_allclose(
        f(jnp.full((1, 4), 1e-18), jnp.full((4, 1), 1e-18)), [[4e-36]], rtol=0.1
    )
    x = jnp.array([[1e-18, 3e-19, -2e-20, 0.0]])
    np.testing.assert_allclose(f(x, x.T * 1e-3), x @ x.T * 1e-3, rtol=0.1)
    assert f(jnp.ones((0, 4)), jnp.ones((4, 2))).shape == (0, 2)
    g = jax.grad(lambda x: jnp.sum(f(x, jnp.ones((4, 2)))))(jnp.ones((0, 4)))
    assert g.shape == (0, 4)


@pytest.mark.skipif(
    not hasattr(jax, "set_mesh"), reason="explicit sharding needs jax.set_mesh (JAX 0.7+)"
)
def test_gradients_keep_the_operands_explicit_sharding():
    from jax.sharding import AxisType, PartitionSpec

    mesh = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Explicit,))
    f = autocast.amp(lambda w, x: jnp.sum(jnp.sin(x @ w)), compute_dtype="fp8")
    w = jnp.ones((4, 2)) / 4
    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.ones((4, 4)), PartitionSpec("x", None))
        gw, gx = jax.jit(jax.grad(f, (0, 1)))(w, x)
        assert jax.typeof(gx).sharding.spec == jax.typeof(x).sharding.spec
    want = jax.grad(lambda w, x: jnp.sum(jnp.sin(x @ w)), (0, 1))(w, jnp.ones((4, 4)))
    assert _measure.relative_error((gw, gx), want) < 0.1


@pytest.mark.slow
def test_batched_products_in_bfloat16_cost_fewer_bytes_and_quantisations():
    # by XLA's cost analysis of the compiled gradient step, the CPU-side proxy for a GPU's
    # memory traffic: attention's products in float8 add a quantisation pass per operand
    # the CPU's program on every backend (a GPU's cost analysis counts its own fusions)
    params, tokens = jax.device_put(_demo_gpt(), jax.devices("cpu")[0])
    every = dataclasses.replace(fp8.DEFAULT_RECIPE, batched_products=True)
    steps = {
        name: jax.value_and_grad(autocast.amp(_models.gpt_loss, compute_dtype=dtype))
        for name, dtype in (("default", "fp8"), ("every", every))
    }
    bytes_ = {n: _measure.bytes_accessed(s, params, tokens) for n, s in steps.items()}
    passes = {n: _measure.float8_casts(jax.make_jaxpr(s)(params, tokens)) for n, s in steps.items()}
    assert bytes_["default"] < 0.97 * bytes_["every"]
    assert passes["default"] < passes["every"]
