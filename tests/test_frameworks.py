"""amp on models written with the frameworks our users train with: Flax, Equinox, Haiku."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import jaxpr_of, operand_dtypes, require

import autocast
from autocast._src.tools import measure as _measure

BF16 = jnp.bfloat16


def _check(loss, *args):
    """amp(loss): close to float32, every matmul 16-bit forward and backward, float32 grads."""
    amp_loss = autocast.amp(loss, compute_dtype=BF16)
    want, got = float(jax.jit(loss)(*args)), float(jax.jit(amp_loss)(*args))
    assert abs(got - want) <= 0.02 * abs(want) + 1e-3
    for fn in (amp_loss, jax.grad(amp_loss)):
        dts = set(operand_dtypes(jaxpr_of(fn, *args), "dot_general")) | set(
            operand_dtypes(jaxpr_of(fn, *args), "conv_general_dilated")
        )
        assert dts == {("bfloat16", "bfloat16")}, dts
    grads = jax.jit(jax.grad(amp_loss))(*args)
    for g, p in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(args[0])):
        assert g.dtype == p.dtype and bool(jnp.all(jnp.isfinite(g)))


@pytest.mark.slow
def test_flax_dense_bias_follows_the_activation():
    # Flax adds its bias as y + b.reshape(1, n): broadcast by the add itself, not by a
    # broadcast_in_dim, it must still follow the 16-bit activation, so a stack of Dense
    # layers stays 16-bit between its matmuls.
    nn = require("flax.linen")
    model = nn.Sequential([nn.Dense(16), nn.relu, nn.Dense(16), nn.relu, nn.Dense(4)])
    x = jnp.ones((8, 8))
    params = model.init(jax.random.key(0), x)
    jaxpr = jaxpr_of(autocast.amp(lambda p, x: model.apply(p, x), compute_dtype=BF16), params, x)
    # (the two biases before a relu are recomputed, with the relu, by the next layer's product)
    adds = [e for e in _measure.equations(jaxpr) if e.primitive.name == "add"]
    assert len(adds) == 3 and all(e.outvars[0].aval.dtype == BF16 for e in adds)
    _check(lambda p, x: jnp.sum(model.apply(p, x) ** 2), params, x)


@pytest.mark.slow
def test_flax_linen_transformer_block():
    nn = require("flax.linen")

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.LayerNorm()(x)
            h = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=16)(h, h)
            x = x + h
            h = nn.Dense(32)(nn.LayerNorm()(x))
            return x + nn.Dense(16)(nn.gelu(h))

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Conv(16, (3,))(x)
            x = nn.remat(Block)()(x)
            return nn.Dense(4)(x.mean(axis=1))

    x = jax.random.normal(jax.random.PRNGKey(0), (2, 8, 3))
    model = Net()
    params = model.init(jax.random.PRNGKey(1), x)

    def loss(params, x):
        return jnp.mean(model.apply(params, x) ** 2)

    _check(loss, params, x)


@pytest.mark.slow
def test_equinox_mlp_with_static_fields_and_filtered_scaling():
    eqx = require("equinox")
    model = eqx.nn.MLP(8, 4, 16, 2, activation=jax.nn.relu, key=jax.random.PRNGKey(0))
    x = jax.random.normal(jax.random.PRNGKey(1), (5, 8))

    def loss(model, x):
        return jnp.mean(jax.vmap(model)(x) ** 2)

    params, static = eqx.partition(model, eqx.is_inexact_array)
    _check(lambda p, x: loss(eqx.combine(p, static), x), params, x)
    # the whole module (with its activation function field) through amp and loss scaling
    grad_fn = autocast.dynamic_scale_value_and_grad(autocast.amp(loss, compute_dtype=jnp.float16))
    state, (value, grads) = eqx.filter_jit(grad_fn)(
        model, x, dynamic_scaler_state=autocast.DynamicScalerState()
    )
    assert np.isfinite(float(value)) and grads.activation is None
    assert grads.layers[0].weight.dtype == jnp.float32


@pytest.mark.slow
def test_haiku_conv_net():
    hk = require("haiku")

    def forward(x):
        x = hk.Conv2D(8, 3)(x)
        x = jax.nn.relu(x)
        x = hk.max_pool(x, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
        x = hk.Flatten()(x)
        return hk.Linear(3)(x)

    net = hk.without_apply_rng(hk.transform(forward))
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 8, 8, 3))
    params = net.init(jax.random.PRNGKey(1), x)

    def loss(params, x):
        return jnp.mean(net.apply(params, x) ** 2)

    _check(loss, params, x)


def _equinox_layers():
    eqx = require("equinox")
    k = jax.random.split(jax.random.key(7), 8)
    x = jax.random.normal(k[0], (4, 16))
    img = jax.random.normal(k[1], (3, 8, 8))
    return eqx, [
        ("Linear", eqx.nn.Linear(16, 16, key=k[2]), lambda m: jax.vmap(m)(x)),
        ("MLP", eqx.nn.MLP(16, 8, 32, 2, key=k[2]), lambda m: jax.vmap(m)(x)),
        ("MultiheadAttention", eqx.nn.MultiheadAttention(4, 16, key=k[3]), lambda m: m(x, x, x)),
        (
            "Dropout(0.0)",
            eqx.nn.Sequential([eqx.nn.Linear(16, 16, key=k[4]), eqx.nn.Dropout(0.0)]),
            lambda m: jax.vmap(m)(x),
        ),
        (
            "Dropout inference",
            eqx.nn.Sequential(
                [eqx.nn.Linear(16, 16, key=k[4]), eqx.nn.Dropout(0.3, inference=True)]
            ),
            lambda m: jax.vmap(m)(x),
        ),
        (
            "LayerNorm",
            eqx.nn.Sequential([eqx.nn.Linear(16, 16, key=k[5]), eqx.nn.LayerNorm(16)]),
            lambda m: jax.vmap(m)(x),
        ),
        (
            "RMSNorm",
            eqx.nn.Sequential([eqx.nn.Linear(16, 16, key=k[5]), eqx.nn.RMSNorm(16)]),
            lambda m: jax.vmap(m)(x),
        ),
        (
            "GroupNorm",
            eqx.nn.Sequential([eqx.nn.Conv2d(3, 8, 3, key=k[6]), eqx.nn.GroupNorm(4, 8)]),
            lambda m: m(img),
        ),
        ("Embedding", eqx.nn.Embedding(10, 16, key=k[7]), lambda m: jax.vmap(m)(jnp.arange(6))),
        ("GRUCell", eqx.nn.GRUCell(16, 16, key=k[3]), lambda m: m(x[0], x[1])),
    ]


@pytest.mark.slow
def test_equinox_stock_layers_under_amp():
    eqx, layers = _equinox_layers()
    for name, model, apply in layers:
        loss = lambda m: jnp.mean(apply(m).astype(jnp.float32) ** 2)  # noqa: E731
        amp_loss = autocast.amp(loss, compute_dtype=jnp.bfloat16)

        @eqx.filter_jit  # one program for both: eager, every equation compiled one of its own
        def both(m):
            return [eqx.filter_value_and_grad(f)(m) for f in (amp_loss, loss)]

        (value, grads), (want, want_grads) = both(model)
        np.testing.assert_allclose(value, want, rtol=3e-2, err_msg=name)
        got_leaves = jax.tree_util.tree_leaves(eqx.filter(grads, eqx.is_array))
        want_leaves = jax.tree_util.tree_leaves(eqx.filter(want_grads, eqx.is_array))
        assert [g.dtype for g in got_leaves] == [w.dtype for w in want_leaves], name
        assert _measure.relative_error(got_leaves, want_leaves) < 0.06, name
        params, static = eqx.partition(model, eqx.is_array)
        jaxpr = jax.make_jaxpr(lambda p: amp_loss(eqx.combine(p, static)))(params)
        products = operand_dtypes(jaxpr, "dot_general") + operand_dtypes(
            jaxpr, "conv_general_dilated"
        )
        if name != "Embedding":
            assert products and all(d == ("bfloat16", "bfloat16") for d in products), name


def _linen_padded_attention():
    nn = require("flax.linen")
    valid = jnp.array([[True, True, True, False, False]])
    mask = nn.make_attention_mask(valid, valid)  # the padded queries see nothing
    layer = nn.MultiHeadDotProductAttention(num_heads=2)
    x = jax.random.normal(jax.random.key(0), (1, 5, 16))
    params = layer.init(jax.random.key(1), x, mask=mask)

    def loss(params, x):
        y = layer.apply(params, x, mask=mask)
        return jnp.sum(jnp.where(valid[..., None], y, 0.0) ** 2)

    return loss, params, x


def _equinox_padded_attention():
    eqx = require("equinox")
    valid = jnp.array([True, True, True, False, False])
    layer = eqx.nn.MultiheadAttention(2, 16, key=jax.random.key(1))
    params, static = eqx.partition(layer, eqx.is_inexact_array)
    x = jax.random.normal(jax.random.key(0), (5, 16))

    def loss(params, x):
        y = eqx.combine(params, static)(x, x, x, mask=valid[:, None] & valid[None, :])
        return jnp.sum(jnp.where(valid[:, None], y, 0.0) ** 2)

    return loss, params, x


@pytest.mark.parametrize("dtype", [BF16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("make", [_linen_padded_attention, _equinox_padded_attention])
def test_padded_rows_of_stock_attention_keep_finite_gradients(make, dtype):
    # both fill masked logits with finfo(float32).min, an infinity once narrowed to 16 bits
    # by rounding: a padded row, masked whole, had NaN gradients under amp
    loss, params, x = make()
    amp_loss = autocast.amp(loss, compute_dtype=dtype)
    # one program for both: eager, every equation compiled one of its own
    want, got = jax.jit(lambda *a: (jax.grad(loss)(*a), jax.grad(amp_loss)(*a)))(params, x)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree_util.tree_leaves(got))
    assert _measure.relative_error(got, want) < 0.05
