"""Float8 with finer scales than one per tensor: ``compute_dtype="fp8_rowwise"`` (a scale per
row of each operand) and ``compute_dtype="mxfp8"`` (a power-of-two scale per 32 contracted
elements, bound as ``jax.lax.scaled_dot``); read off jaxprs and checked against float32."""

from __future__ import annotations

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import eqns_named
from hypothesis import given, settings

import autocast
from autocast._src.fp8 import products as fp8
from autocast._src.policy.target import Target

HAS_SCALED_DOT = hasattr(jax.lax, "scaled_dot")
needs_scaled_dot = pytest.mark.skipif(
    not HAS_SCALED_DOT, reason="this JAX has no jax.lax.scaled_dot (mxfp8 is refused)"
)
FINER = ["fp8_rowwise", pytest.param("mxfp8", marks=needs_scaled_dot)]
H100 = Target("gpu", "NVIDIA H100 80GB HBM3", "9.0")
B200 = Target("gpu", "NVIDIA B200", "10.0")


def _error(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def _operands(m=64, k=128, n=96, seed=0):
    kx, kw = jax.random.split(jax.random.PRNGKey(seed))
    return jax.random.normal(kx, (m, k)), jax.random.normal(kw, (k, n)) / np.sqrt(k)


def _product(x, w):
    return x @ w


@pytest.mark.parametrize("compute_dtype", FINER)
def test_an_outlier_row_costs_only_its_own_row_its_precision(compute_dtype):
    # one token 2**20 times the others: one scale for the tensor puts the other rows below
    # e4m3's smallest subnormal, and they come out zero; a scale per row keeps them
    x, w = _operands()
    x = x.at[0].multiply(2.0**20)
    want = x @ w
    per_tensor = jax.jit(autocast.amp(_product, compute_dtype="fp8"))(x, w)
    finer = jax.jit(autocast.amp(_product, compute_dtype=compute_dtype))(x, w)
    assert _error(per_tensor[1:], want[1:]) > 0.5
    assert _error(finer[1:], want[1:]) < 0.06
    assert _error(finer[:1], want[:1]) < 0.06

    # the weight's gradient contracts over the rows (tokens), so its scales run along them
    # and the outlier still shares them with the other tokens: docs/fp8.md says so


@needs_scaled_dot
def test_mxfp8_scales_each_block_of_32_on_its_own():
    # x @ I returns x as it was quantised (the identity's codes are exact): beside one
    # element 2**20 times its row, rowwise scaling flushes the row's other elements, and
    # MXFP8 loses only the other 31 of its block
    x, _ = _operands(m=32, k=128)
    x = x.at[1, 0].set(2.0**20)
    eye = jnp.eye(128)
    rowwise = jax.jit(autocast.amp(_product, compute_dtype="fp8_rowwise"))(x, eye)
    blocks = jax.jit(autocast.amp(_product, compute_dtype="mxfp8"))(x, eye)
    rest = np.s_[1, 32:]
    assert _error(rowwise[rest], x[rest]) > 0.5
    assert _error(blocks[rest], x[rest]) < 2.0**-4
    assert float(blocks[1, 0]) == 2.0**20
    # every other row within e4m3's rounding
    assert _error(blocks[2:], x[2:]) < 2.0**-4


@pytest.mark.parametrize("compute_dtype", FINER)
@settings(max_examples=15, deadline=None)
@given(exponents=st.lists(st.integers(-40, 40), min_size=32, max_size=32))
def test_scaling_a_row_by_a_power_of_two_scales_its_result_exactly(compute_dtype, exponents):
    # the invariant of a scale per row: each output row depends on its own input row alone
    x, w = _operands(m=32, k=64, n=32, seed=1)
    f = jax.jit(autocast.amp(_product, compute_dtype=compute_dtype))
    factors = jnp.asarray(2.0 ** np.asarray(exponents, np.float64), jnp.float32)[:, None]
    np.testing.assert_array_equal(np.asarray(f(x * factors, w)), np.asarray(f(x, w) * factors))


@pytest.mark.parametrize("compute_dtype", FINER)
def test_what_runs_in_float8_forward_and_backward(compute_dtype):
    x, w = _operands()
    loss = lambda w, x: jnp.sum(jnp.tanh(x @ w))  # noqa: E731
    amp_loss = autocast.amp(loss, compute_dtype=compute_dtype)
    jaxpr = jax.make_jaxpr(jax.grad(amp_loss))(w, x)
    name = "scaled_dot" if compute_dtype == "mxfp8" else "dot_general"
    products = eqns_named(jaxpr, name)
    assert len(products) == 3  # the forward product and the two gradients
    operand_formats = [tuple(v.aval.dtype.name for v in e.invars[:2]) for e in products]
    if compute_dtype == "mxfp8":
        assert set(operand_formats) == {("float8_e4m3fn", "float8_e4m3fn")}
        scales = {v.aval.dtype.name for e in products for v in e.invars[2:]}
        assert scales == {"float8_e8m0fnu"}
        # one scale per 32 contracted elements
        assert [e.invars[2].aval.shape[-1] * 32 for e in products] == [
            e.invars[0].aval.shape[-1] for e in products
        ]
    else:
        assert operand_formats[0] == ("float8_e4m3fn", "float8_e4m3fn")
        assert {"float8_e5m2"} <= {d for pair in operand_formats[1:] for d in pair}
        # one amax per row of x (64) and per column of w (96) forward, and per row of each
        # operand of the backward products (the weight's 128 inputs, the gradient's 64
        # rows and 96 columns, x's 128 columns)
        amaxes = {e.outvars[0].aval.size for e in eqns_named(jaxpr, "reduce_max")}
        assert {64, 96, 128} <= amaxes
    summary = autocast.report(loss, compute_dtype=compute_dtype)(w, x).summary
    assert summary["fp8_flop_share"] == {"forward": 1.0, "backward": 1.0}


@needs_scaled_dot
def test_mxfp8_takes_one_scale_per_tensor_where_a_size_is_no_multiple_of_32():
    # 48 contracted inputs: no whole blocks, so the product is the per-tensor one
    x, w = _operands(m=64, k=48, n=64)
    jaxpr = jax.make_jaxpr(
        jax.grad(lambda w, x: jnp.sum(autocast.amp(_product, compute_dtype="mxfp8")(x, w)))
    )(w, x)
    assert not eqns_named(jaxpr, "scaled_dot")
    dots = [
        tuple(v.aval.dtype.itemsize for v in e.invars) for e in eqns_named(jaxpr, "dot_general")
    ]
    assert dots and set(dots) == {(1, 1)}
    gradients = {v.aval.dtype.name for e in eqns_named(jaxpr, "dot_general") for v in e.invars}
    assert "float8_e5m2" in gradients  # "fp8"'s formats with "fp8"'s scaling


@pytest.mark.parametrize("compute_dtype", FINER)
@pytest.mark.parametrize(
    "spec, x_shape, w_shape",
    [
        ("btd,dn->btn", (4, 16, 64), (64, 96)),  # two free dimensions (batch, tokens)
        ("btd,dhk->bthk", (2, 32, 64), (64, 4, 32)),  # the weight's outputs in two
        ("bi,oi->bo", (64, 128), (96, 128)),  # contracted on the last of both
    ],
)
def test_each_layout_matches_float32(compute_dtype, spec, x_shape, w_shape):
    kx, kw = jax.random.split(jax.random.PRNGKey(2))
    x = jax.random.normal(kx, x_shape)
    w = jax.random.normal(kw, w_shape) / np.sqrt(x_shape[-1])
    product = lambda w, x: jnp.einsum(spec, x, w)  # noqa: E731
    got = jax.jit(autocast.amp(product, compute_dtype=compute_dtype))(w, x)
    assert _error(got, product(w, x)) < 0.06
    loss = lambda w, x: jnp.sum(jnp.sin(product(w, x)))  # noqa: E731
    grads = jax.grad(loss, argnums=(0, 1))(w, x)
    got_grads = jax.jit(jax.grad(autocast.amp(loss, compute_dtype=compute_dtype), argnums=(0, 1)))(
        w, x
    )
    for got, want in zip(got_grads, grads):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert _error(got, want) < 0.1


@pytest.mark.parametrize("compute_dtype", FINER)
def test_equinox_layers_under_vmap_and_a_scan_over_layers(compute_dtype):
    # Equinox's per-example weight @ x, batched by vmap, and filter_grad over the module
    model = eqx.nn.MLP(64, 32, 128, depth=2, key=jax.random.PRNGKey(3))
    x = jax.random.normal(jax.random.PRNGKey(4), (64, 64))

    def loss(model, x):
        return jnp.mean(jax.vmap(model)(x) ** 2)

    want = eqx.filter_grad(loss)(model, x)
    grad = eqx.filter_grad(autocast.amp(loss, compute_dtype=compute_dtype))
    got = eqx.filter_jit(grad)(model, x)
    per_tensor = eqx.filter_jit(eqx.filter_grad(autocast.amp(loss, compute_dtype="fp8")))(model, x)
    leaves = lambda t: jax.tree.leaves(eqx.filter(t, eqx.is_array))  # noqa: E731
    for g, p, r in zip(leaves(got), leaves(per_tensor), jax.tree.leaves(want)):
        # a power-of-two scale per row rounds as one per tensor wherever the tensor's range
        # fits e4m3's normal numbers (as these layers' do): no worse, and within fp8's error
        assert _error(g, r) <= 1.05 * _error(p, r) + 1e-3 and _error(g, r) < 0.25
    # and the finer scales ran: amaxes per row or block, not one per tensor
    jaxpr, *_ = eqx.filter_make_jaxpr(grad)(model, x)
    assert any(e.outvars[0].aval.size > 1 for e in eqns_named(jaxpr, "reduce_max"))

    # layers stacked and scanned over
    ws = jax.random.normal(jax.random.PRNGKey(5), (3, 64, 64)) / 8

    def scanned(ws, x):
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
        return jnp.sum(h**2)

    want = jax.grad(scanned)(ws, x)
    amp_scanned = autocast.amp(scanned, compute_dtype=compute_dtype)
    assert _error(jax.jit(jax.grad(amp_scanned))(ws, x), want) < 0.1


@pytest.mark.parametrize("compute_dtype", FINER)
def test_convolutions_keep_one_scale_per_tensor(compute_dtype):
    x = jax.random.normal(jax.random.PRNGKey(6), (8, 16, 16, 32))
    k = jax.random.normal(jax.random.PRNGKey(7), (3, 3, 32, 32)) / 24

    def loss(k, x):
        y = jax.lax.conv_general_dilated(
            x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
        return jnp.sum(y**2)

    jaxpr = jax.make_jaxpr(jax.grad(autocast.amp(loss, compute_dtype=compute_dtype)))(k, x)
    convs = eqns_named(jaxpr, "conv_general_dilated")
    assert convs and all(v.aval.dtype.itemsize == 1 for e in convs for v in e.invars)
    # as "fp8" runs them: e5m2 output gradients, whose range one scale per tensor needs
    assert any(v.aval.dtype == jnp.float8_e5m2 for e in convs for v in e.invars)
    assert (
        _error(
            jax.jit(jax.grad(autocast.amp(loss, compute_dtype=compute_dtype)))(k, x),
            jax.grad(loss)(k, x),
        )
        < 0.1
    )


@pytest.mark.parametrize("compute_dtype", FINER)
def test_second_derivatives_are_refused(compute_dtype):
    x, w = _operands(m=32, k=32, n=32)
    loss = autocast.amp(lambda w: jnp.sum((x @ w) ** 2), compute_dtype=compute_dtype)
    with pytest.raises(TypeError, match="first derivatives only"):
        jax.hessian(loss)(w)


def test_an_overflow_reaches_the_output():
    # an inf in an operand must reach the loss scaler's check, not be clipped into range
    x, w = _operands(m=32, k=64, n=32)
    for compute_dtype in ["fp8_rowwise"] + (["mxfp8"] if HAS_SCALED_DOT else []):
        out = np.asarray(
            autocast.amp(_product, compute_dtype=compute_dtype)(x.at[3, 5].set(jnp.inf), w)
        )
        assert not np.all(np.isfinite(out[3]))
        assert np.all(np.isfinite(np.delete(out, 3, axis=0)))


def test_a_large_row_scale_does_not_overflow_a_finite_result():
    # x near float32's top by w near 1e-6: the result is finite, and the row's scale alone
    # (about 2**116) times the float8 product would not be in bfloat16
    x, w = _operands(m=32, k=64, n=32)
    x, w = x * 1e37, w * 1e-6
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    got = autocast.amp(_product, compute_dtype="fp8_rowwise")(x, w)
    assert np.all(np.isfinite(np.asarray(got)))
    assert _error(got, want) < 0.06


def test_mxfp8_is_refused_where_no_block_scaled_gemm_runs_it():
    mx, rows = fp8.FINER_RECIPES["mxfp8"], fp8.FINER_RECIPES["fp8_rowwise"]
    why = fp8.float8_refusal(mx, H100)
    assert "block-scaled" in why and "compute_dtype='fp8'" in why and "'mxfp8'" in why
    assert fp8.float8_refusal(mx, B200) is None
    assert fp8.float8_refusal(rows, H100) is None
    assert "no float8 GEMMs" in fp8.float8_refusal(
        rows, Target("gpu", "NVIDIA A100-SXM4-80GB", "8.0")
    )
    tpu = Target("tpu", "TPU v5 lite")
    assert "bfloat16" in fp8.float8_refusal(mx, tpu) and "bfloat16" in fp8.float8_refusal(rows, tpu)


def test_the_names_and_what_a_wrong_one_is_told():
    assert fp8.recipe_for("FP8-rowwise") == fp8.FINER_RECIPES["fp8_rowwise"]
    with pytest.raises(ValueError, match="fp8_rowwise.*mxfp8"):
        autocast.amp(_product, compute_dtype="fp8_colwise")
    bad = fp8.Recipe(fp8.FINER_RECIPES["mxfp8"].forward, np.dtype(jnp.float8_e5m2), scaling="block")
    with pytest.raises(ValueError, match="pairs formats"):
        fp8.recipe_for(bad)
    with pytest.raises(ValueError, match="scaling 'column'"):
        fp8.recipe_for(fp8.Recipe(bad.forward, bad.forward, scaling="column"))


@pytest.mark.skipif(HAS_SCALED_DOT, reason="this JAX has jax.lax.scaled_dot")
def test_mxfp8_without_scaled_dot_is_refused_by_name():
    with pytest.raises(ValueError, match="jax.lax.scaled_dot.*fp8_rowwise"):
        autocast.amp(_product, compute_dtype="mxfp8")


@pytest.mark.parametrize("compute_dtype", FINER)
def test_a_checkpointed_scan_under_jax_upgrade_flags(compute_dtype):
    flags = [f for f in ("jax_custom_vjp3", "jax_remat3") if hasattr(jax.config, f)]
    if not flags:
        pytest.skip(f"JAX {jax.__version__} has neither jax_custom_vjp3 nor jax_remat3")
    ws = jax.random.normal(jax.random.PRNGKey(5), (3, 64, 64)) / 8
    x = jax.random.normal(jax.random.PRNGKey(4), (64, 64))

    def scanned(ws, x):
        body = jax.checkpoint(lambda h, w: (jnp.tanh(h @ w), None))
        return jnp.sum(jax.lax.scan(body, x, ws)[0] ** 2)

    want = jax.grad(scanned)(ws, x)
    before = {f: getattr(jax.config, f) for f in flags}
    try:
        for f in flags:
            jax.config.update(f, True)
        got = jax.jit(jax.grad(autocast.amp(scanned, compute_dtype=compute_dtype)))(ws, x)
    finally:
        for f, v in before.items():
            jax.config.update(f, v)
    assert _error(got, want) < 0.1


@pytest.mark.parametrize("compute_dtype", FINER)
def test_diagnose_reads_the_float8_product(compute_dtype):
    x, w = _operands()
    d = autocast.diagnose(_product, compute_dtype=compute_dtype)(x, w)
    (entry,) = [e for e in d.entries if e.primitive == "dot_general"]
    assert entry.dtype == np.dtype(jnp.float8_e4m3fn)


@pytest.mark.skipif(
    not hasattr(jax, "set_mesh"), reason="explicit sharding needs jax.set_mesh (JAX 0.7+)"
)
@pytest.mark.parametrize("compute_dtype", FINER)
def test_an_explicit_mesh_takes_one_scale_per_tensor(compute_dtype):
    from jax.sharding import AxisType, PartitionSpec

    mesh = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Explicit,))
    f = autocast.amp(lambda w, x: jnp.sum(jnp.sin(x @ w)), compute_dtype=compute_dtype)
    x, w = _operands(m=64, k=64, n=32)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, PartitionSpec("x", None))
        gw, gx = jax.jit(jax.grad(f, (0, 1)))(w, xs)
        assert jax.typeof(gx).sharding.spec == jax.typeof(xs).sharding.spec
    want = jax.grad(lambda w, x: jnp.sum(jnp.sin(x @ w)), (0, 1))(w, x)
    assert _error(gw, want[0]) < 0.1 and _error(gx, want[1]) < 0.1


@pytest.mark.parametrize("compute_dtype", FINER)
def test_inside_shard_map(compute_dtype):
    from jax.sharding import PartitionSpec as P

    from autocast import _compat

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
    x, w = _operands(m=64, k=64, n=32)
    loss = lambda w, x: jnp.sum(jnp.sin(x @ w))  # noqa: E731
    sharded = _compat.shard_map(
        lambda w, x: jax.lax.psum(autocast.amp(loss, compute_dtype=compute_dtype)(w, x), "d"),
        mesh,
        (P(), P("d")),
        P(),
    )
    got = jax.jit(jax.grad(sharded, (0, 1)))(w, x)
    want = jax.grad(loss, (0, 1))(w, x)
    assert _error(got[0], want[0]) < 0.1 and _error(got[1], want[1]) < 0.1


@pytest.mark.parametrize("compute_dtype", FINER)
def test_an_equinox_training_step_with_donation_tree_at_and_a_small_last_batch(compute_dtype):
    import optax

    model = eqx.nn.MLP(64, 32, 128, depth=2, key=jax.random.PRNGKey(8))
    # a weight replaced the Equinox way, as a user loading or surgery would
    model = eqx.tree_at(lambda m: m.layers[0].weight, model, model.layers[0].weight * 0.5)
    optimizer = optax.sgd(1e-2)

    def loss(model, x):
        return jnp.mean(jax.vmap(model)(x) ** 2)

    def make_step(loss_fn):
        @eqx.filter_jit(donate="all")
        def step(model, state, x):
            value, grads = eqx.filter_value_and_grad(loss_fn)(model, x)
            updates, state = optimizer.update(grads, state, eqx.filter(model, eqx.is_array))
            return eqx.apply_updates(model, updates), state, value

        return step

    amp_step, ref_step = make_step(autocast.amp(loss, compute_dtype=compute_dtype)), make_step(loss)
    leaves = lambda t: jax.tree.leaves(eqx.filter(t, eqx.is_array))  # noqa: E731
    # full batches of 64, then a last batch of 3 (no multiple of 32: mxfp8 scales per tensor)
    batches = [jax.random.normal(jax.random.PRNGKey(9 + i), (64, 64)) for i in range(2)]
    batches.append(jax.random.normal(jax.random.PRNGKey(11), (3, 64)))
    copy = lambda t: jax.tree.map(lambda x: jnp.array(x, copy=True) if eqx.is_array(x) else x, t)  # noqa: E731
    ours, theirs = copy(model), copy(model)
    ours_state = optimizer.init(eqx.filter(ours, eqx.is_array))
    theirs_state = optimizer.init(eqx.filter(theirs, eqx.is_array))
    for x in batches:
        ours, ours_state, value = amp_step(ours, ours_state, x)
        theirs, theirs_state, want = ref_step(theirs, theirs_state, x)
        assert abs(float(value) - float(want)) < 0.05 * abs(float(want))
    # three SGD steps on both: the parameters moved alike, in their own dtypes
    for got, ref, start in zip(leaves(ours), leaves(theirs), leaves(model)):
        assert got.dtype == ref.dtype == jnp.float32
        assert _error(got - start, ref - start) < 0.2


@pytest.mark.parametrize("compute_dtype", FINER)
def test_an_nnx_optimizer_step(compute_dtype):
    import inspect

    import optax

    nnx = pytest.importorskip("flax.nnx")
    model = nnx.Linear(64, 96, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.PRNGKey(12), (64, 64))
    want = nnx.grad(lambda m: jnp.mean(jnp.sin(m(x))))(model)
    got = nnx.grad(autocast.amp(lambda m: jnp.mean(jnp.sin(m(x))), compute_dtype=compute_dtype))(
        model
    )
    for g, r in zip(jax.tree.leaves(nnx.state(got)), jax.tree.leaves(nnx.state(want))):
        assert g.dtype == r.dtype and _error(g, r) < 0.1
    tx = optax.sgd(0.1)
    kernel = lambda m: np.asarray(nnx.to_pure_dict(nnx.state(m, nnx.Param))["kernel"])  # noqa: E731
    before = kernel(model)
    if "model" in inspect.signature(nnx.Optimizer.update).parameters:  # Flax 0.11 and later
        nnx.Optimizer(model, tx, wrt=nnx.Param).update(model, got)
    else:  # Flax 0.10: the optimizer holds the model
        nnx.Optimizer(model, tx).update(got)
    moved = kernel(model) - before
    step = -0.1 * np.asarray(nnx.to_pure_dict(got)["kernel"])
    np.testing.assert_allclose(moved, step, rtol=1e-5, atol=1e-7)
