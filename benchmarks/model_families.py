"""Activation memory and accuracy of amp across model families, side by side.

For each model: float32; the framework's own bfloat16 (Flax modules built with
``dtype=jnp.bfloat16``, float32 parameters); amp with bfloat16 compute. Columns:

- ``act/f32``: bytes of the residuals ``jax.vjp`` keeps, leaving out arguments it keeps as
  they are (the activation memory), as a ratio to float32's;
- ``act/own``: the same against the framework's own bfloat16 model;
- ``loss dev``: relative deviation of the loss from float32's;
- ``grad err``: relative L2 error of the gradient (all leaves) against float32's;
- ``trained``, ``dev``: the loss after a training run (Adam, 200 steps of fresh generated
  batches, mean of the last 20) and its relative deviation from float32's.

Models (Flax Linen, batch 8 at 32x32x3 unless said): a CNN of three Conv -> BatchNorm ->
relu blocks, pooling and a Dense head; the same with GroupNorm; a ResNet-style net with
residual connections; a ViT-style block stack (patch embedding, pre-norm attention and MLP);
a GPT with ``nn.Embed`` and ``nn.scan(nn.remat(block))`` (batch 16 of 32 tokens, d=64, 2 layers).

Run: ``.venv/bin/python benchmarks/model_families.py [--steps 200]``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import autocast
from autocast._src.tools import measure as _measure

sys.path.insert(0, str(Path(__file__).parent))
import _training  # noqa: E402


class CNN(nn.Module):
    norm: str = "batch"
    dtype: Any = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for width in (32, 64, 64):
            x = nn.Conv(width, (3, 3), dtype=self.dtype)(x)
            if self.norm == "batch":
                x = nn.BatchNorm(use_running_average=False, dtype=self.dtype)(x)
            else:
                x = nn.GroupNorm(num_groups=8, dtype=self.dtype)(x)
            x = nn.relu(x)
        x = nn.avg_pool(x, (2, 2), (2, 2))
        return nn.Dense(10, dtype=self.dtype)(x.mean(axis=(1, 2)))


class ResNet(nn.Module):
    dtype: Any = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.relu(
            nn.BatchNorm(use_running_average=False, dtype=self.dtype)(
                nn.Conv(32, (3, 3), dtype=self.dtype)(x)
            )
        )
        for _ in range(3):
            y = nn.Conv(32, (3, 3), dtype=self.dtype)(x)
            y = nn.relu(nn.BatchNorm(use_running_average=False, dtype=self.dtype)(y))
            y = nn.Conv(32, (3, 3), dtype=self.dtype)(y)
            y = nn.BatchNorm(use_running_average=False, dtype=self.dtype)(y)
            x = nn.relu(x + y)
        return nn.Dense(10, dtype=self.dtype)(x.mean(axis=(1, 2)))


class ViT(nn.Module):
    dtype: Any = None
    width: int = 64
    depth: int = 2
    heads: int = 4

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.Conv(self.width, (4, 4), strides=(4, 4), dtype=self.dtype)(x)
        x = x.reshape(x.shape[0], -1, self.width)
        for _ in range(self.depth):
            h = nn.LayerNorm(dtype=self.dtype)(x)
            x = x + nn.MultiHeadDotProductAttention(self.heads, dtype=self.dtype)(h, h)
            h = nn.LayerNorm(dtype=self.dtype)(x)
            h = nn.Dense(4 * self.width, dtype=self.dtype)(h)
            x = x + nn.Dense(self.width, dtype=self.dtype)(nn.gelu(h))
        return nn.Dense(10, dtype=self.dtype)(nn.LayerNorm(dtype=self.dtype)(x).mean(axis=1))


class GPTBlock(nn.Module):
    """A pre-norm transformer block; the carry of ``nn.scan`` is the residual stream."""

    dtype: Any = None
    heads: int = 4

    @nn.compact
    def __call__(self, x: jax.Array, _: None) -> tuple[jax.Array, None]:
        h = nn.LayerNorm(dtype=self.dtype)(x)
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        x = x + nn.SelfAttention(self.heads, dtype=self.dtype)(h, mask=mask)
        h = nn.Dense(4 * x.shape[-1], dtype=self.dtype)(nn.LayerNorm(dtype=self.dtype)(x))
        return x + nn.Dense(x.shape[-1], dtype=self.dtype)(nn.gelu(h)), None


class LinenGPT(nn.Module):
    """Token and position embeddings by ``nn.Embed`` (a ``jnp.take`` inside an inner jit),
    then ``nn.scan(nn.remat(GPTBlock))``: how Linen models usually stack their layers."""

    dtype: Any = None
    vocab: int = 64
    width: int = 64
    depth: int = 2

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = nn.Embed(self.vocab, self.width, dtype=self.dtype)(tokens)
        x = x + nn.Embed(tokens.shape[1], self.width, dtype=self.dtype)(jnp.arange(tokens.shape[1]))
        blocks = nn.scan(
            nn.remat(GPTBlock),
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=self.depth,
        )
        x, _ = blocks(self.dtype)(x, None)
        return nn.Dense(self.vocab, dtype=self.dtype)(nn.LayerNorm(dtype=self.dtype)(x))


def _loss_fn(model: nn.Module) -> Callable[..., jax.Array]:
    def loss(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        logits, _ = model.apply(params, x, mutable=["batch_stats"])
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()

    return loss


Batches = Callable[[jax.Array], tuple[jax.Array, jax.Array]]


def families() -> list[tuple[str, Callable[[Any], nn.Module], Batches]]:
    """(name, model for a dtype, its training batch for a step number) for each family."""
    return [
        ("CNN BatchNorm", lambda dtype: CNN("batch", dtype), generated_images),
        ("CNN GroupNorm", lambda dtype: CNN("group", dtype), generated_images),
        ("ResNet", lambda dtype: ResNet(dtype), generated_images),
        ("ViT", lambda dtype: ViT(dtype), generated_images),
        ("Linen GPT", lambda dtype: LinenGPT(dtype), generated_tokens),
    ]


def generated_images(
    step: jax.Array, batch: int = 8, noise: float = 1.0
) -> tuple[jax.Array, jax.Array]:
    """A fresh batch of 32x32 RGB images for each training step, with labels: each of 10
    classes is a tinted stripe pattern of its own orientation under Gaussian noise, so a
    conv net learns it but the loss levels off above zero."""
    angle = jnp.arange(10) * jnp.pi / 10
    r, c = jnp.meshgrid(jnp.arange(32.0), jnp.arange(32.0), indexing="ij")
    phase = 0.8 * (
        r[None] * jnp.cos(angle)[:, None, None] + c[None] * jnp.sin(angle)[:, None, None]
    )
    tint = jax.random.uniform(jax.random.key(2), (10, 1, 1, 3), minval=0.5, maxval=1.5)
    patterns = jnp.sin(phase)[..., None] * tint
    ky, kn = jax.random.split(jax.random.fold_in(jax.random.key(3), step))
    y = jax.random.randint(ky, (batch,), 0, 10)
    return patterns[y] + noise * jax.random.normal(kn, (batch, 32, 32, 3)), y


def generated_tokens(
    step: jax.Array, batch: int = 16, seq: int = 32, vocab: int = 64
) -> tuple[jax.Array, jax.Array]:
    """Token windows and their next tokens, ``(batch, seq)`` each: a sequence that mostly
    steps by a fixed stride from a random start, with 10% of tokens replaced at random."""
    k0, kr, km = jax.random.split(jax.random.fold_in(jax.random.key(4), step), 3)
    start = jax.random.randint(k0, (batch, 1), 0, vocab)
    t = (start + 7 * jnp.arange(seq + 1)) % vocab
    t = jnp.where(
        jax.random.uniform(km, t.shape) < 0.1, jax.random.randint(kr, t.shape, 0, vocab), t
    )
    return t[:, :-1], t[:, 1:]


def train(loss: Callable[..., jax.Array], params: Any, batches: Batches, steps: int = 200) -> float:
    """Final loss of ``steps`` Adam steps on fresh batches: the mean over the last 20."""
    return _training.final_loss(loss, params, batches, steps, last=20)


def setup(
    make: Callable[[Any], nn.Module], batches: Batches
) -> tuple[Callable[..., jax.Array], Any, Any, Any]:
    """The float32 loss, initial parameters and first batch ``(x, y)`` of a family."""
    x, y = batches(jnp.asarray(0))
    return _loss_fn(make(None)), make(None).init(jax.random.key(1), x), x, y


def measure(
    make: Callable[[Any], nn.Module], batches: Batches, steps: int = 200
) -> dict[str, dict]:
    """Each variant's measures on the first batch, and its loss after ``steps`` of training
    (none when 0)."""
    f32_loss, params, x, y = setup(make, batches)
    variants = {
        "float32": f32_loss,
        "own bf16": _loss_fn(make(jnp.bfloat16)),
        "amp bf16": autocast.amp(f32_loss, compute_dtype=jnp.bfloat16),
    }
    ref_loss, ref_grad = jax.jit(jax.value_and_grad(f32_loss))(params, x, y)
    rows: dict[str, dict] = {}
    for name, fn in variants.items():
        # float32's row is the reference itself: compiled once, not twice
        loss, grad = (
            (ref_loss, ref_grad)
            if fn is f32_loss
            else jax.jit(jax.value_and_grad(fn))(params, x, y)
        )
        rows[name] = {
            "act": _measure.residual_bytes(fn, params, x, y, include_inputs=False),
            "loss_dev": abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)),
            "grad_err": _measure.relative_error(grad, ref_grad),
        }
        if steps:
            rows[name]["trained"] = train(fn, params, batches, steps)
    if steps:
        for r in rows.values():
            r["trained_dev"] = (
                abs(r["trained"] - rows["float32"]["trained"]) / rows["float32"]["trained"]
            )
    return rows


def main(steps: int = 200) -> dict[str, dict]:
    """Prints the table; returns its figures, model -> variant -> measures."""
    print(f"jax {jax.__version__}, backend {jax.default_backend()}; training runs of {steps} steps")
    results = {}
    print(
        f"{'model':14} {'variant':9} {'act MB':>7} {'act/f32':>7} {'act/own':>7} {'loss dev':>8} "
        f"{'grad err':>8} {'trained':>8} {'dev':>6}"
    )
    for name, make, batches in families():
        rows = results[name] = measure(make, batches, steps)
        for variant, r in rows.items():
            trained = (
                f"{r['trained']:8.4f} {r['trained_dev']:6.2%}" if steps else f"{'-':>8} {'-':>6}"
            )
            print(
                f"{name:14} {variant:9} {r['act'] / 2**20:7.2f} "
                f"{r['act'] / rows['float32']['act']:7.2f} "
                f"{r['act'] / rows['own bf16']['act']:7.2f} {r['loss_dev']:8.2%} "
                f"{r['grad_err']:8.4f} {trained}"
            )
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="training steps per run (0: none)")
    main(parser.parse_args().steps)
