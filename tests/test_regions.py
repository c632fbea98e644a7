"""Wide regions: float32 arithmetic on narrowed activations, 16-bit storage, 16-bit residuals."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import jaxpr_of, operand_dtypes

import autocast
from autocast import _compat
from autocast._src.tools import measure as _measure
from autocast._src.transform import regions
from autocast._src.transform.recompute import recompute_chain

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
P = jax.sharding.PartitionSpec
KEY = jax.random.key(0)
W = jax.random.normal(KEY, (64, 64)) / 8
X = jax.random.normal(jax.random.fold_in(KEY, 1), (16, 64))


def layer_norm_mlp(w, x):
    h = x @ w
    mean = jnp.mean(h, -1, keepdims=True)
    var = jnp.var(h, -1, keepdims=True)
    h = (h - mean) * jax.lax.rsqrt(var + 1e-5)
    return jnp.sum(jnp.tanh(h @ w) ** 2)


def _regions(jaxpr):
    return [
        e for e in _measure.equations(jaxpr) if e.params.get("policy") is regions.keep_statistics
    ]


def _recomputed(jaxpr):
    """The checkpoints of chains (and of the regions read by matrix products) amp emitted."""
    return [e for e in _measure.equations(jaxpr) if e.params.get("policy") is recompute_chain]


def test_a_normalisation_runs_in_float32_and_leaves_in_16_bits():
    jaxpr = jaxpr_of(autocast.amp(layer_norm_mlp, compute_dtype=BF16), W, X)
    # the layer norm is recomputed with the product that reads it: one checkpoint whose
    # inputs are the 16-bit activation (once) and the weight
    (product,) = _recomputed(jaxpr)
    inner = product.params["jaxpr"]
    full = [v.aval.dtype for v in product.invars if v.aval.shape == (X.shape[0], W.shape[1])]
    assert full == [jnp.dtype(BF16)] and product.invars[-1].aval == W.aval
    assert {d for ds in operand_dtypes(inner, "sub") for d in ds} == {"float32"}
    assert operand_dtypes(inner, "dot_general") == [("bfloat16", "bfloat16")]
    # then tanh(...) ** 2, ending in its sum: a region of its own
    (region,) = _regions(jaxpr)
    assert [v.aval.dtype for v in region.outvars] == [jnp.dtype(F32)]
    assert operand_dtypes(jaxpr, "dot_general") == [("bfloat16", "bfloat16")] * 2


def test_residuals_are_16_bit_activations_and_small_statistics():
    amp_fn = autocast.amp(layer_norm_mlp, compute_dtype=BF16)
    residuals = jax.make_jaxpr(lambda w, x: jax.tree_util.tree_leaves(jax.vjp(amp_fn, w, x)[1]))(
        W, X
    )
    full_f32 = [
        v for v in residuals.jaxpr.outvars if v.aval.dtype == F32 and v.aval.shape == X.shape
    ]
    assert full_f32 == []
    assert _measure.residual_bytes(
        amp_fn, W, X, include_inputs=False
    ) <= 0.8 * _measure.residual_bytes(layer_norm_mlp, W, X, include_inputs=False)


def test_a_tanh_before_its_square_joins_the_region_however_the_square_is_spelled():
    # x ** 2 goes to float32 as jnp.square does, so the tanh feeding it is gathered into the
    # same region: the backward keeps the tanh's 16-bit input, not its output and 1 - y^2 too
    def loss(square):
        return lambda w, x: jnp.sum(square(jnp.tanh(x @ w)))

    kept = []
    for square in (lambda y: y**2, jnp.square):
        fn = autocast.amp(loss(square), compute_dtype=BF16)
        (region,) = _regions(jaxpr_of(fn, W, X))
        assert operand_dtypes(region.params["jaxpr"], "tanh") == [("float32",)]
        kept.append(_measure.residual_bytes(fn, W, X, include_inputs=False))
    # in bfloat16 (2 bytes): w and x for the product's backward, and x @ w, the region's input
    assert kept[0] == kept[1] == 2 * (W.size + X.size + X.size)


def group_norm_mlp(w, x):
    h = x @ w  # (16, 64) in 8 groups of 8
    grouped = h.reshape(16, 8, 8)
    mean = jnp.mean(grouped, -1, keepdims=True)
    var = jnp.mean(jnp.square(grouped), -1, keepdims=True) - jnp.square(mean)
    scale = jnp.repeat(jax.lax.rsqrt(var + 1e-5), 8, axis=-1).reshape(16, 64)
    h = (h - jnp.repeat(mean, 8, axis=-1).reshape(16, 64)) * scale
    return jnp.sum(jnp.tanh(h @ w) ** 2)


@pytest.mark.slow
def test_statistics_read_in_groups_share_the_activation_they_normalise():
    fn = autocast.amp(group_norm_mlp, compute_dtype=BF16)
    residuals = jax.make_jaxpr(lambda w, x: jax.vjp(fn, w, x)[1])(W, X).out_avals
    shapes = [(a.shape, a.dtype.name) for a in residuals]
    assert ((16, 64), "bfloat16") in shapes
    assert not any(shape == (16, 8, 8) for shape, _ in shapes)  # no second copy in groups
    got = jax.grad(fn)(W, X)
    want = jax.grad(group_norm_mlp)(W, X)
    assert _measure.relative_error(got, want) < 0.05


def test_a_reused_region_keeps_the_context_of_the_block_it_stands_for():
    from jax.experimental.xla_metadata import set_xla_metadata

    def ln(h):
        m = jnp.mean(h, -1, keepdims=True)
        return (h - m) * jax.lax.rsqrt(jnp.mean(jnp.square(h - m), -1, keepdims=True) + 1e-5)

    def f(w, x):
        h = ln(x @ w) @ w
        with set_xla_metadata(tag="second"):
            h = ln(h)
        return jnp.sum(h @ w)

    jaxpr = jaxpr_of(autocast.amp(f, compute_dtype=BF16), W, X)
    # each norm is recomputed with the product that reads it; the first keeps no tag
    tagged = [
        any("second" in str(getattr(e.ctx, "xla_metadata", "")) for e in r.params["jaxpr"].eqns)
        for r in _recomputed(jaxpr)
    ]
    assert tagged == [False, True]  # the second norm's region is not the first's


def test_regions_keep_gradients_close_to_float32_on_both_sides_of_grad():
    ref = jax.grad(layer_norm_mlp)(W, X)
    for g in (
        jax.grad(autocast.amp(layer_norm_mlp, compute_dtype=BF16)),
        autocast.amp(jax.grad(layer_norm_mlp), compute_dtype=BF16),
    ):
        got = g(W, X)
        assert got.dtype == F32
        assert float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref)) < 0.05


def test_float32_compute_and_programs_own_16_bit_ops_make_no_region():
    assert _regions(jaxpr_of(autocast.amp(layer_norm_mlp, compute_dtype=F32), W, X)) == []
    own = lambda w, x: layer_norm_mlp(w.astype(BF16), x.astype(BF16)).astype(F32)  # noqa: E731
    assert _regions(jaxpr_of(autocast.amp(own, compute_dtype=BF16), W, X)) == []


def test_a_float32_stream_is_not_narrowed():
    # x stays float32 (a function input of full size): h16 + x comes out float32
    fn = lambda w, x: jnp.sum(jnp.exp(x @ w) + x)  # noqa: E731
    jaxpr = jaxpr_of(autocast.amp(fn, compute_dtype=BF16), W, X)
    assert ("float32", "float32") in operand_dtypes(jaxpr, "add")


# --- float16: the cases PyTorch keeps in float32 ------------------------------------------


def _rms(x, w):
    h = x @ w
    return (h * jax.lax.rsqrt(jnp.mean(h**2, -1, keepdims=True) + 1e-6)) @ w


def _mse_rows(x, w):
    h = x @ w
    return jnp.mean((h - (h + 300.0)) ** 2, -1)


def _reciprocal(x, w):
    return 1.0 / (x @ w)


def _softmax(x, w):
    return jax.nn.softmax(x @ w, -1) @ w


_OUTLIERS = jnp.concatenate([jnp.full((8, 6), 300.0), jax.random.normal(KEY, (8, 294))], axis=1)
_LOG_UNIFORM = jnp.exp(jax.random.uniform(KEY, (8, 300), minval=np.log(1e-3), maxval=np.log(1e2)))


@pytest.mark.parametrize(
    "fn, x",
    [
        (_rms, _OUTLIERS),
        (_mse_rows, _OUTLIERS),
        (_reciprocal, _LOG_UNIFORM),
        (_softmax, _OUTLIERS * 0.01),
    ],
    ids=["rmsnorm", "mse", "reciprocal", "softmax"],
)
def test_float16_unsafe_ops_stay_finite_where_float32_is(fn, x):
    w = jnp.eye(300)
    ref = fn(x, w)
    out = autocast.amp(fn, compute_dtype=F16)(x, w)
    assert out.dtype == ref.dtype
    assert bool(jnp.all(jnp.isfinite(out)))
    assert not bool(jnp.any((out == 0) & (ref != 0)))
    assert float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref)) < 1e-2


# --- policy rows ----------------------------------------------------------------------------


def test_stack_of_two_16_bit_activations_stays_16_bit():
    fn = lambda w, x: jnp.stack([x @ w, x @ w * 2]).sum(0) @ w  # noqa: E731
    jaxpr = jaxpr_of(autocast.amp(fn, compute_dtype=BF16), W, X)
    joins = operand_dtypes(jaxpr, "stack") + operand_dtypes(jaxpr, "concatenate")  # by JAX version
    assert joins and all(set(d) == {"bfloat16"} for d in joins)
    assert operand_dtypes(jaxpr, "dot_general")[-1] == ("bfloat16", "bfloat16")


def test_bfloat16_values_are_never_cast_sideways_to_float16():
    x = jnp.full((4, 4), 300.0, BF16)
    w = jnp.full((4, 4), 0.6, BF16)
    out = autocast.amp(lambda x, w: x @ w, compute_dtype=F16)(x, w)
    assert out.dtype == BF16 and bool(jnp.all(jnp.isfinite(out)))


def test_a_16_bit_partial_sum_travels_in_16_bits():
    mesh = jax.make_mesh((1,), ("i",))

    def local(w, x):
        return jax.lax.psum(x @ w, "i") @ w

    fn = _compat.shard_map(local, mesh, (P(), P()), P())
    jaxpr = jaxpr_of(autocast.amp(lambda w, x: fn(w, x).sum(), compute_dtype=BF16), W, X)
    sums = operand_dtypes(jaxpr, "psum") + operand_dtypes(jaxpr, "psum_invariant")  # by JAX version
    assert sums == [("bfloat16",)]


COLLECTIVES = ("psum", "psum_invariant", "all_gather", "all_gather_invariant", "reduce_scatter")


def _collective_dtypes(jaxpr):
    return [d for name in COLLECTIVES for d in operand_dtypes(jaxpr, name)]


def _mesh():
    return jax.sharding.Mesh(np.array(jax.devices()[:1]), ("i",))  # automatic axes in every version


@pytest.mark.slow
def test_a_tensor_parallel_layer_communicates_16_bits_both_ways():
    mesh = _mesh()

    def local(w_cols, w_rows, x):  # x is the same on every device: its gradient is a psum
        return jax.lax.psum(jnp.tanh(x @ w_cols) @ w_rows, "i")

    fn = _compat.shard_map(local, mesh, (P(None, "i"), P("i", None), P()), P())
    loss = lambda w, x: jnp.sum(fn(w, w, jnp.tanh(x @ w)) ** 2)  # noqa: E731
    grad = jax.grad(autocast.amp(loss, compute_dtype=BF16), argnums=(0, 1))
    sums = _collective_dtypes(jaxpr_of(grad, W, X))
    assert len(sums) >= 2 and all(d == ("bfloat16",) for d in sums)
    ref = jax.grad(loss, argnums=(0, 1))(W, X)
    got = jax.jit(grad)(W, X)
    for g, r in zip(got, ref):
        assert g.dtype == F32 and _measure.relative_error(g, r) < 0.05


def test_an_activation_gathered_for_a_matrix_product_is_gathered_in_16_bits():
    mesh = _mesh()

    def local(w, x):  # a float32 activation (exp runs in float32) gathered from its shards
        return jnp.tanh(jax.lax.all_gather(jnp.exp(x * 0.1), "i", tiled=True) @ w)

    fn = _compat.shard_map(local, mesh, (P(), P("i")), P("i"))
    jaxpr = jaxpr_of(autocast.amp(lambda w, x: fn(w, x).sum(), compute_dtype=BF16), W, X)
    assert _collective_dtypes(jaxpr) == [("bfloat16",)]

    # consumed by anything but matrix products, it is gathered as it is
    def also_summed(w, x):
        h = jax.lax.all_gather(jnp.exp(x * 0.1), "i", tiled=True)
        return h @ w + h.sum(0)

    other = _compat.shard_map(also_summed, mesh, (P(), P("i")), P("i"))
    jaxpr = jaxpr_of(autocast.amp(lambda w, x: other(w, x).sum(), compute_dtype=BF16), W, X)
    assert _collective_dtypes(jaxpr) == [("float32",)]
    # and under a policy that keeps all_gather in float32, it is
    policy = {
        key: autocast.use_full_precision if str(key) == "all_gather" else rule
        for key, rule in autocast.default_amp_policy.items()
    }
    jaxpr = jaxpr_of(
        autocast.amp(lambda w, x: fn(w, x).sum(), compute_dtype=BF16, amp_policy=policy), W, X
    )
    assert _collective_dtypes(jaxpr) == [("float32",)]


def test_parameters_are_gathered_and_sums_made_in_their_own_dtype():
    mesh = _mesh()

    def local(w_shard, x):  # fully sharded parameters: the gradient's reduction is the
        w = jax.lax.all_gather(w_shard, "i", tiled=True)  # gather's transpose
        return jnp.tanh(x @ w) + jax.lax.psum(jnp.exp(x * 0.1), "i") @ w

    fn = _compat.shard_map(local, mesh, (P("i"), P("i")), P("i"))
    jaxpr = jaxpr_of(autocast.amp(lambda w, x: fn(w, x).sum(), compute_dtype=BF16), W, X)
    assert sorted(_collective_dtypes(jaxpr)) == [("float32",), ("float32",)]


def test_a_jit_in_a_compute_scope_is_not_taken_for_a_matrix_product():
    mesh = _mesh()
    proj = jax.jit(lambda w, x: (x @ w, w))  # hands its weight back

    def local(w, x):
        h = jax.lax.all_gather(jnp.exp(w * 0.1), "i", tiled=True)
        with jax.named_scope("proj"):
            y, h2 = proj(h, x)
        return y.sum(0) + h2.sum(0)  # h used in float32 outside the scope

    fn = _compat.shard_map(local, mesh, (P("i"), P()), P("i"))
    policy = {**autocast.default_amp_policy, "proj": autocast.use_compute_precision}
    jaxpr = jaxpr_of(
        autocast.amp(lambda w, x: fn(w, x).sum(), compute_dtype=BF16, amp_policy=policy), W, X
    )
    assert _collective_dtypes(jaxpr) == [("float32",)]


# --- vmap on either side ------------------------------------------------------------------


def _linear(x, w, b):
    return jnp.tanh(x @ w + b)


def _dtypes_of(jaxpr, names=frozenset({"dot_general", "add", "tanh"})):
    return [
        (e.primitive.name, tuple(v.aval.dtype.name for v in e.invars))
        for e in _measure.equations(jaxpr)
        if e.primitive.name in names
    ]


@pytest.mark.parametrize(
    "in_axes, shapes",
    [
        ((0, None, None), ((16, 64), (64, 64), (64,))),  # a batch of inputs
        ((0, 0, None), ((16, 64), (16, 64, 64), (64,))),  # per-example weights, shared bias
        ((None, 0, 0), ((64,), (16, 64, 64), (16, 64))),  # an ensemble of layers, shared input
    ],
)
def test_vmap_of_amp_and_amp_of_vmap_run_a_linear_layer_alike(in_axes, shapes):
    args = [jax.random.normal(jax.random.fold_in(KEY, i), s) for i, s in enumerate(shapes)]
    outside = jaxpr_of(jax.vmap(autocast.amp(_linear, compute_dtype=BF16), in_axes), *args)
    inside = jaxpr_of(autocast.amp(jax.vmap(_linear, in_axes), compute_dtype=BF16), *args)
    assert _dtypes_of(outside) == _dtypes_of(inside)
    if in_axes[2] is None:  # a shared bias is spread over the batch: it adapts to the product
        assert ("add", ("bfloat16", "bfloat16")) in _dtypes_of(outside)


def test_vmap_of_amp_spreads_a_closed_over_bias_and_nested_vmaps_agree():
    b = jnp.ones(64)
    fn = lambda x, w: _linear(x, w, b)  # noqa: E731
    x, w = X[:4].reshape(2, 2, 64), jnp.stack([W, W])
    outside = jax.vmap(jax.vmap(autocast.amp(fn, compute_dtype=BF16), (0, None)), (0, 0))
    inside = autocast.amp(jax.vmap(jax.vmap(fn, (0, None)), (0, 0)), compute_dtype=BF16)
    assert _dtypes_of(jaxpr_of(outside, x, w)) == _dtypes_of(jaxpr_of(inside, x, w))
    np.testing.assert_allclose(jax.jit(outside)(x, w), jax.jit(inside)(x, w), rtol=1e-6)


def test_vmap_of_amp_computes_from_unmapped_inputs_as_amp_of_vmap_does():
    def scaled(x, w, log_scale):  # a learnt temperature: exp of an unmapped parameter
        return jnp.tanh((x @ w) * jnp.exp(log_scale))

    args = (X, W, jnp.zeros(()))
    outside = jaxpr_of(jax.vmap(autocast.amp(scaled, compute_dtype=BF16), (0, None, None)), *args)
    inside = jaxpr_of(autocast.amp(jax.vmap(scaled, (0, None, None)), compute_dtype=BF16), *args)
    plain = jaxpr_of(autocast.amp(scaled, compute_dtype=BF16), *args)
    names = {"exp", "mul", "tanh"}
    assert _dtypes_of(outside, names) == _dtypes_of(inside, names) == _dtypes_of(plain, names)


def test_per_example_gradients_under_vmap_keep_the_bias_add_16_bit():
    loss = lambda p, x: jnp.sum(_linear(x, p["w"], p["b"]) ** 2)  # noqa: E731
    p = {"w": W, "b": jnp.zeros(64)}
    per_example = jax.vmap(jax.grad(autocast.amp(loss, compute_dtype=BF16)), (None, 0))
    jaxpr = jaxpr_of(per_example, p, X)
    assert ("bfloat16", "bfloat16") in operand_dtypes(jaxpr, "add")
    grads = per_example(p, X)
    assert grads["b"].dtype == F32 and grads["b"].shape == (16, 64)


@pytest.mark.slow
@pytest.mark.parametrize(
    "pool",
    [
        lambda h: jnp.mean(h.mean(axis=1) ** 2),
        lambda h: jnp.sum(jnp.exp(h.sum(axis=(1, 2)) / 1e3)),
        lambda h: jnp.mean(jnp.log1p(jnp.abs(h.mean(axis=1)))),
    ],
    ids=["mean then square", "sum then exp", "mean then log1p"],
)
def test_a_region_never_keeps_more_than_float32(pool):
    # a mean's backward needs no input: summing an activation must not keep it
    w = jax.random.normal(jax.random.key(0), (64, 256)) / 8
    x = jax.random.normal(jax.random.key(1), (32, 16, 64))
    loss = lambda w, x: pool(jax.nn.relu(x @ w))  # noqa: E731
    f32 = _measure.residual_bytes(loss, w, x, include_inputs=False)
    amp = _measure.residual_bytes(
        autocast.amp(loss, compute_dtype=jnp.bfloat16), w, x, include_inputs=False
    )
    assert amp <= 0.8 * f32
    got = jax.grad(autocast.amp(loss, compute_dtype=jnp.bfloat16))(w, x)
    assert _measure.relative_error(got, jax.grad(loss)(w, x)) < 0.03


@pytest.mark.parametrize("affine", [False, True], ids=["plain", "scale and offset"])
def test_normalising_with_given_statistics_runs_in_float32(affine):
    # eval-mode batch norm: running statistics are inputs, not computed from the activation;
    # the shift by the mean belongs in float32 with the scaling by rsqrt(var), as in training,
    # inside a region that stores the result in 16 bits
    def bn_eval(x, w, mean, var):
        h = x @ w
        inv = jax.lax.rsqrt(var + 1e-5) * (1.5 if affine else 1.0)
        return jnp.sum(jnp.tanh((h - mean) * inv + (0.1 if affine else 0.0)))

    f32 = jnp.float32  # (a fill without a dtype makes a weakly typed array)
    x, w = (
        jnp.full((8, 16), 1.0, f32),
        jnp.full((16, 32), 16.03, f32),
    )  # h = 256.5: bfloat16 holds 256
    mean, var = (
        jnp.full((32,), 255.3, f32),
        jnp.full((32,), 0.25, f32),
    )  # bfloat16 would round it to 255
    f = autocast.amp(bn_eval, compute_dtype=jnp.bfloat16)
    jaxpr = jax.make_jaxpr(f)(x, w, mean, var)
    subs = [e for e in _measure.equations(jaxpr) if e.primitive.name == "sub"]
    assert subs and all(e.outvars[0].aval.dtype == jnp.float32 for e in subs)
    # no float32 copy of the activation outside a region
    assert not [
        e
        for e in jaxpr.jaxpr.eqns
        if e.outvars
        and e.outvars[0].aval.shape == (8, 32)
        and e.outvars[0].aval.dtype == jnp.float32
    ]
    # what is left is the bfloat16 matrix product's own rounding of h
    h16 = (x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)).astype(jnp.float32)
    inv, shift = jax.lax.rsqrt(var + 1e-5) * (1.5 if affine else 1.0), 0.1 if affine else 0.0
    want = jnp.sum(jnp.tanh((h16 - mean) * inv + shift))
    np.testing.assert_allclose(f(x, w, mean, var), want, rtol=1e-5)


def _conv_batch_norm(hand):
    """Conv -> batch norm -> relu, twice, then a conv: a float32 program, or cast by hand
    (bfloat16 convolutions and activations, float32 statistics)."""
    dtype = BF16 if hand else F32

    def conv(x, w):
        dims = ("NHWC", "HWIO", "NHWC")
        return jax.lax.conv_general_dilated(
            x, w.astype(dtype), (1, 1), "SAME", dimension_numbers=dims
        )

    def norm(y):
        wide = y.astype(F32)
        mean = wide.mean((0, 1, 2))
        var = jnp.maximum((wide**2).mean((0, 1, 2)) - mean**2, 0.0)
        return ((wide - mean) * jax.lax.rsqrt(var + 1e-5)).astype(dtype)

    def loss(ws, x):
        y = x.astype(dtype)
        for w in ws[:-1]:
            y = jax.nn.relu(norm(conv(y, w)))
        return conv(y, ws[-1]).astype(F32).mean()

    return loss


def test_a_batch_norm_backward_reads_the_statistics_its_forward_pass_computed():
    # the backward pass of a region recomputes its float32 arithmetic from the 16-bit
    # activation, but not its means: each would be one more pass over the activation
    ws = [jax.random.normal(jax.random.fold_in(KEY, i), (3, 3, 16, 16)) / 12 for i in range(3)]
    x = jax.random.normal(KEY, (4, 16, 16, 16))

    def passes(fn):
        hlo = jax.jit(jax.grad(fn)).lower(ws, x).compile().as_text()
        # a reduction over batch and space to one value a channel
        return len(re.findall(r"f32\[16\]\S* reduce\(.*dimensions=\{0,1,2\}", hlo))

    amp_fn = autocast.amp(_conv_batch_norm(hand=False), compute_dtype=BF16)
    assert 0 < passes(amp_fn) <= passes(_conv_batch_norm(hand=True))


def test_only_a_reduction_that_shrinks_its_input_is_kept_as_a_statistic():
    aval = jax.core.ShapedArray((8, 64, 2), F32)
    assert regions.saves_statistic(jax.lax.reduce_sum_p, aval, axes=(0, 1))
    assert regions.saves_statistic(jax.lax.reduce_max_p, aval, axes=(1,))
    assert not regions.saves_statistic(jax.lax.reduce_sum_p, aval, axes=(2,))
    assert not regions.saves_statistic(jax.lax.exp_p, aval)
