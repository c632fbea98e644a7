"""amp on models written with the frameworks our users train with: Flax, Equinox, Haiku."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autocast
from conftest import jaxpr_of, operand_dtypes, require

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


def test_flax_dense_bias_follows_the_activation():
    # Flax adds its bias as y + b.reshape(1, n): broadcast by the add itself, not by a
    # broadcast_in_dim, it must still follow the 16-bit activation, so a stack of Dense
    # layers stays 16-bit between its matmuls.
    nn = require("flax.linen")
    model = nn.Sequential([nn.Dense(16), nn.relu, nn.Dense(16), nn.relu, nn.Dense(4)])
    x = jnp.ones((8, 8))
    params = model.init(jax.random.key(0), x)
    jaxpr = jaxpr_of(autocast.amp(lambda p, x: model.apply(p, x), compute_dtype=BF16), params, x)
    adds = [e for e in jaxpr.eqns if e.primitive.name == "add"]
    assert len(adds) == 3 and all(e.outvars[0].aval.dtype == BF16 for e in adds)
    _check(lambda p, x: jnp.sum(model.apply(p, x) ** 2), params, x)


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
    state, (value, grads) = eqx.filter_jit(grad_fn)(model, x, dynamic_scaler_state=autocast.DynamicScalerState())
    assert np.isfinite(float(value)) and grads.activation is None
    assert grads.layers[0].weight.dtype == jnp.float32


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
