"""Small reference models in plain JAX, shared by the tests, the benchmarks and the demo.

Each is written once in float32. ``hand_cast`` gives the version a careful engineer would
write by hand for mixed precision: weights and activations cast to 16 bits around the matrix
products, layer norm, softmax and the loss kept in float32. amp is measured against both.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Params = dict[str, Any]


def _dense(key: jax.Array, n_in: int, n_out: int) -> Params:
    return {
        "w": jax.random.normal(key, (n_in, n_out), jnp.float32) / np.sqrt(n_in),
        "b": jnp.zeros((n_out,), jnp.float32),
    }


def _hand(x: jax.Array, dtype: Any) -> jax.Array:
    return x if dtype is None else x.astype(dtype)


# ---- MLP ---------------------------------------------------------------------------------


def init_mlp(key: jax.Array, sizes: tuple[int, ...] = (32, 64, 64, 10)) -> list[Params]:
    keys = jax.random.split(key, len(sizes) - 1)
    return [_dense(k, a, b) for k, a, b in zip(keys, sizes[:-1], sizes[1:])]


def mlp_loss(params: list[Params], x: jax.Array, y: jax.Array, hand_cast: Any = None) -> jax.Array:
    """Softmax cross-entropy of a tanh/GELU MLP."""
    h = _hand(x, hand_cast)
    for i, layer in enumerate(params):
        h = h @ _hand(layer["w"], hand_cast) + _hand(layer["b"], hand_cast)
        if i < len(params) - 1:
            h = jax.nn.gelu(h)
    logp = jax.nn.log_softmax(h.astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=-1))


# ---- GPT ---------------------------------------------------------------------------------


def init_gpt(
    key: jax.Array, *, vocab: int = 64, d: int = 32, layers: int = 2, seq: int = 16
) -> Params:
    k_emb, k_pos, k_out, *k_layers = jax.random.split(key, 3 + layers)

    def block(k: jax.Array) -> Params:
        k1, k2, k3, k4 = jax.random.split(k, 4)
        return {
            "ln1": {"g": jnp.ones((d,)), "b": jnp.zeros((d,))},
            "qkv": _dense(k1, d, 3 * d),
            "proj": _dense(k2, d, d),
            "ln2": {"g": jnp.ones((d,)), "b": jnp.zeros((d,))},
            "up": _dense(k3, d, 4 * d),
            "down": _dense(k4, 4 * d, d),
        }

    return {
        "embed": jax.random.normal(k_emb, (vocab, d)) * 0.02,
        "pos": jax.random.normal(k_pos, (seq, d)) * 0.02,
        "blocks": [block(k) for k in k_layers],
        "ln_f": {"g": jnp.ones((d,)), "b": jnp.zeros((d,))},
        "head": _dense(k_out, d, vocab),
    }


def stack_blocks(params: Params) -> Params:
    """The same parameters with the blocks stacked on a leading axis, for ``lax.scan``."""
    stacked = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *params["blocks"])
    return {**params, "blocks": stacked}


def _layer_norm(p: Params, x: jax.Array, hand_cast: Any) -> jax.Array:
    dtype = x.dtype
    x = x.astype(jnp.float32) if hand_cast is not None else x
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.var(x, axis=-1, keepdims=True)
    y = (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["g"] + p["b"]
    return y.astype(dtype) if hand_cast is not None else y


def _linear(p: Params, x: jax.Array, hand_cast: Any) -> jax.Array:
    return x @ _hand(p["w"], hand_cast) + _hand(p["b"], hand_cast)


def _block(p: Params, x: jax.Array, heads: int, hand_cast: Any) -> jax.Array:
    b, t, d = x.shape
    h = _layer_norm(p["ln1"], x, hand_cast)
    q, k, v = jnp.split(_linear(p["qkv"], h, hand_cast), 3, axis=-1)
    q, k, v = (z.reshape(b, t, heads, d // heads) for z in (q, k, v))
    scores = jnp.einsum("bqhc,bkhc->bhqk", q, k) / np.sqrt(d // heads)
    mask = jnp.tril(jnp.ones((t, t), bool))
    scores = jnp.where(mask, scores, -1e9)
    if hand_cast is not None:
        probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(hand_cast)
    else:
        probs = jax.nn.softmax(scores, axis=-1)
    att = jnp.einsum("bhqk,bkhc->bqhc", probs, v).reshape(b, t, d)
    x = x + _linear(p["proj"], att, hand_cast)
    h = _layer_norm(p["ln2"], x, hand_cast)
    return x + _linear(p["down"], jax.nn.gelu(_linear(p["up"], h, hand_cast)), hand_cast)


def gpt_loss(
    params: Params,
    tokens: jax.Array,
    hand_cast: Any = None,
    *,
    heads: int = 4,
    scan: bool = False,
    remat: bool = False,
) -> jax.Array:
    """Next-token cross-entropy of a pre-norm GPT. ``scan`` runs stacked blocks with
    ``lax.scan`` (see :func:`stack_blocks`); ``remat`` checkpoints each block."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    x = params["embed"][inputs] + params["pos"][: inputs.shape[1]]
    x = _hand(x, hand_cast)

    def block(x: jax.Array, p: Params) -> jax.Array:
        return _block(p, x, heads, hand_cast)

    if remat:
        block = jax.checkpoint(block)
    if scan:
        x, _ = jax.lax.scan(lambda x, p: (block(x, p), None), x, params["blocks"])
    else:
        for p in params["blocks"]:
            x = block(x, p)
    x = _layer_norm(params["ln_f"], x, hand_cast)
    logits = _linear(params["head"], x, hand_cast).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def gpt_batch(key: jax.Array, *, batch: int = 4, seq: int = 16, vocab: int = 64) -> jax.Array:
    """Random tokens of shape ``(batch, seq + 1)``."""
    return jax.random.randint(key, (batch, seq + 1), 0, vocab)
