"""The models ``gpu_step.py`` times, written once in float32 as their users write them.

- ``gpt2_loss``: a GPT-2-style decoder (learned positions, pre-norm blocks, tanh GELU, the head
  tied to the token embedding, blocks scanned over stacked parameters), with attention
  written out (``"naive"``: einsum, causal mask, softmax) or by
  ``jax.nn.dot_product_attention`` (``"cudnn"``: cuDNN's fused kernel, 16-bit inputs only;
  ``"xla"``: JAX's own path, for a float32 program; ``"pallas"``: the Pallas TPU
  flash-attention kernel JAX ships, ``jax.experimental.pallas.ops.tpu``, a TPU target only).
  ``hand`` gives the careful
  hand cast: weights and activations in bfloat16 around the products, layer norm, softmax
  and loss in float32.
- ``ResNet18``: Flax Linen's ResNet-18 with BatchNorm in training mode; ``dtype`` is Flax's
  own mixed precision (parameters float32, computation in ``dtype``).

Batches are generated on the device from the step number, learnable so that the loss after
training says something: token streams that mostly step by a fixed stride, and stripe
images whose orientation is the class.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

Params = dict[str, Any]


# ---- GPT-2-style decoder -------------------------------------------------------------------


def init_gpt2(key: jax.Array, *, vocab: int, d: int, layers: int, seq: int, **_: Any) -> Params:
    def dense(k: jax.Array, n_in: int, n_out: int, scale: float = 0.02) -> Params:
        return {
            "w": jax.random.normal(k, (layers, n_in, n_out)) * scale,
            "b": jnp.zeros((layers, n_out)),
        }

    def norm() -> Params:
        return {"g": jnp.ones((layers, d)), "b": jnp.zeros((layers, d))}

    k = jax.random.split(key, 6)
    out_scale = 0.02 / np.sqrt(2 * layers)
    return {
        "wte": jax.random.normal(k[0], (vocab, d)) * 0.02,
        "wpe": jax.random.normal(k[1], (seq, d)) * 0.01,
        "blocks": {
            "ln1": norm(),
            "qkv": dense(k[2], d, 3 * d),
            "proj": dense(k[3], d, d, out_scale),
            "ln2": norm(),
            "fc": dense(k[4], d, 4 * d),
            "out": dense(k[5], 4 * d, d, out_scale),
        },
        "ln_f": {"g": jnp.ones((d,)), "b": jnp.zeros((d,))},
    }


def _layer_norm(p: Params, x: jax.Array, hand: Any) -> jax.Array:
    y = x.astype(jnp.float32) if hand is not None else x
    mean = y.mean(-1, keepdims=True)
    y = (y - mean) * jax.lax.rsqrt(((y - mean) ** 2).mean(-1, keepdims=True) + 1e-5) * p["g"] + p[
        "b"
    ]
    return y.astype(x.dtype)


def _pallas_flash(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """The Pallas TPU flash-attention kernel JAX ships, called as a user calls it (under amp
    an entry point: it runs in the compute dtype, docs/fused_attention.md)."""
    from jax.experimental.pallas.ops.tpu import flash_attention as tpu_flash

    # the kernel's layout is (batch, heads, sequence, head); the model's (batch, sequence,
    # heads, head)
    q, k, v = (z.transpose(0, 2, 1, 3) for z in (q, k, v))
    out = tpu_flash.flash_attention(q, k, v, causal=True, sm_scale=q.shape[-1] ** -0.5)
    return out.transpose(0, 2, 1, 3)


def _attention(q: jax.Array, k: jax.Array, v: jax.Array, kind: str, hand: Any) -> jax.Array:
    if kind == "pallas":
        return _pallas_flash(q, k, v)
    if kind != "naive":  # "cudnn", or "xla" (JAX's own fused-attention path, any dtype)
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=kind)
    t, c = q.shape[1], q.shape[-1]
    # a Python float keeps the scores' dtype (NumPy's float64 scalar would make them float32)
    scores = jnp.einsum("bqhc,bkhc->bhqk", q, k) / math.sqrt(c)
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
    if hand is not None:
        probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(hand)
    else:
        probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bhqk,bkhc->bqhc", probs, v)


def gpt2_loss(
    params: Params, tokens: jax.Array, *, heads: int, attention: str = "naive", hand: Any = None
) -> jax.Array:
    """Next-token cross-entropy; ``tokens`` is ``(batch, seq + 1)``."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    cast = (
        (lambda t: jax.tree_util.tree_map(lambda a: a.astype(hand), t)) if hand else (lambda t: t)
    )
    wte = cast(params["wte"])
    x = wte[inputs] + cast(params["wpe"])[: inputs.shape[1]]
    b, t, d = x.shape

    def block(x: jax.Array, p: Params) -> tuple[jax.Array, None]:
        p = cast(p)
        qkv = _layer_norm(p["ln1"], x, hand) @ p["qkv"]["w"] + p["qkv"]["b"]
        q, k, v = (z.reshape(b, t, heads, d // heads) for z in jnp.split(qkv, 3, axis=-1))
        x = (
            x
            + _attention(q, k, v, attention, hand).reshape(b, t, d) @ p["proj"]["w"]
            + p["proj"]["b"]
        )
        h = jax.nn.gelu(_layer_norm(p["ln2"], x, hand) @ p["fc"]["w"] + p["fc"]["b"])
        return x + h @ p["out"]["w"] + p["out"]["b"], None

    x, _ = jax.lax.scan(block, x, params["blocks"])
    x = _layer_norm(cast(params["ln_f"]), x, hand)
    logits = (x @ wte.T).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def gpt2_params_count(params: Params) -> int:
    return sum(x.size for x in jax.tree_util.tree_leaves(params))


def gpt2_batch(step: jax.Array, *, batch: int, seq: int, vocab: int, **_: Any) -> jax.Array:
    """``(batch, seq + 1)`` tokens that mostly step by a stride of 7, 10% replaced at random."""
    k0, kr, km = jax.random.split(jax.random.fold_in(jax.random.key(4), step), 3)
    start = jax.random.randint(k0, (batch, 1), 0, vocab)
    t = (start + 7 * jnp.arange(seq + 1)) % vocab
    return jnp.where(
        jax.random.uniform(km, t.shape) < 0.1, jax.random.randint(kr, t.shape, 0, vocab), t
    )


# ---- ResNet-18 -------------------------------------------------------------------------------


class _Residual(nn.Module):
    width: int
    stride: int
    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        norm = lambda: nn.BatchNorm(use_running_average=False, momentum=0.9, dtype=self.dtype)  # noqa: E731
        y = nn.Conv(self.width, (3, 3), self.stride, use_bias=False, dtype=self.dtype)(x)
        y = nn.relu(norm()(y))
        y = norm()(nn.Conv(self.width, (3, 3), use_bias=False, dtype=self.dtype)(y))
        if self.stride != 1 or x.shape[-1] != self.width:
            x = norm()(
                nn.Conv(self.width, (1, 1), self.stride, use_bias=False, dtype=self.dtype)(x)
            )
        return nn.relu(x + y)


class ResNet18(nn.Module):
    """ResNet-18 for ``(batch, size, size, 3)`` images; ``width`` is the first stage's."""

    classes: int = 1000
    width: int = 64
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.Conv(self.width, (7, 7), 2, use_bias=False, dtype=self.dtype)(x)
        x = nn.relu(nn.BatchNorm(use_running_average=False, momentum=0.9, dtype=self.dtype)(x))
        x = nn.max_pool(x, (3, 3), (2, 2), "SAME")
        for stage in range(4):
            for i in range(2):
                x = _Residual(self.width * 2**stage, 2 if stage and not i else 1, self.dtype)(x)
        return nn.Dense(self.classes, dtype=self.dtype)(x.mean(axis=(1, 2)))


def resnet_loss(model: ResNet18) -> Any:
    """``loss(params, images, labels) -> (loss, new batch statistics)``."""

    def loss(params: Params, images: jax.Array, labels: jax.Array) -> tuple[jax.Array, Any]:
        logits, state = model.apply(params, images, mutable=["batch_stats"])
        logp = jax.nn.log_softmax(logits.astype(jnp.float32))
        return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=-1)), state["batch_stats"]

    return loss


def image_batch(
    step: jax.Array, *, batch: int, size: int, classes: int, **_: Any
) -> tuple[jax.Array, jax.Array]:
    """Stripe images whose orientation is the class, under noise, and their labels."""
    angle = jnp.arange(classes) * jnp.pi / classes
    ky, kn = jax.random.split(jax.random.fold_in(jax.random.key(3), step))
    y = jax.random.randint(ky, (batch,), 0, classes)
    r, c = jnp.meshgrid(
        jnp.arange(size, dtype=jnp.float32), jnp.arange(size, dtype=jnp.float32), indexing="ij"
    )
    phase = 0.3 * (
        r[None] * jnp.cos(angle[y])[:, None, None] + c[None] * jnp.sin(angle[y])[:, None, None]
    )
    x = jnp.sin(phase)[..., None] * jnp.ones(3) + 0.5 * jax.random.normal(
        kn, (batch, size, size, 3)
    )
    return x, y
