"""Activation memory and accuracy of amp across model families, side by side (issue 10).

For each model: float32; the framework's own bfloat16 (Flax modules built with
``dtype=jnp.bfloat16``, float32 parameters); amp with bfloat16 compute. Columns:

- ``act/f32``: bytes of the residuals ``jax.vjp`` keeps, leaving out arguments it keeps as
  they are (SPEC 5's activation memory), as a ratio to float32's;
- ``act/own``: the same against the framework's own bfloat16 model;
- ``loss dev``: relative deviation of the loss from float32's;
- ``grad err``: relative L2 error of the gradient (all leaves) against float32's.

Models (Flax Linen, batch 8 at 32x32x3 unless said): a CNN of three Conv -> BatchNorm ->
relu blocks, pooling and a Dense head; the same with GroupNorm; a ResNet-style net with
residual connections; a ViT-style block stack (patch embedding, pre-norm attention and MLP).

Run: ``.venv/bin/python benchmarks/model_families.py``
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import autocast
from autocast import _measure


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
        x = nn.relu(nn.BatchNorm(use_running_average=False, dtype=self.dtype)(nn.Conv(32, (3, 3), dtype=self.dtype)(x)))
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


def _loss_fn(model: nn.Module) -> Callable[..., jax.Array]:
    def loss(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        logits, _ = model.apply(params, x, mutable=["batch_stats"])
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()

    return loss


def families() -> list[tuple[str, Callable[[Any], nn.Module]]]:
    return [
        ("CNN BatchNorm", lambda dtype: CNN("batch", dtype)),
        ("CNN GroupNorm", lambda dtype: CNN("group", dtype)),
        ("ResNet", lambda dtype: ResNet(dtype)),
        ("ViT", lambda dtype: ViT(dtype)),
    ]


def data(batch: int = 8) -> tuple[jax.Array, jax.Array]:
    kx, ky = jax.random.split(jax.random.key(0))
    return jax.random.normal(kx, (batch, 32, 32, 3)), jax.random.randint(ky, (batch,), 0, 10)


def _rel(a: Any, b: Any) -> float:
    da = jnp.concatenate([jnp.ravel(v).astype(jnp.float32) for v in jax.tree_util.tree_leaves(a)])
    db = jnp.concatenate([jnp.ravel(v).astype(jnp.float32) for v in jax.tree_util.tree_leaves(b)])
    return float(jnp.linalg.norm(da - db) / jnp.linalg.norm(db))


def measure(make: Callable[[Any], nn.Module], x: jax.Array, y: jax.Array) -> dict[str, dict]:
    f32_loss = _loss_fn(make(None))
    params = make(None).init(jax.random.key(1), x)
    variants = {
        "float32": f32_loss,
        "own bf16": _loss_fn(make(jnp.bfloat16)),
        "amp bf16": autocast.amp(f32_loss, compute_dtype=jnp.bfloat16),
    }
    ref_loss, ref_grad = jax.jit(jax.value_and_grad(f32_loss))(params, x, y)
    rows = {}
    for name, fn in variants.items():
        loss, grad = jax.jit(jax.value_and_grad(fn))(params, x, y)
        rows[name] = {
            "act": _measure.residual_bytes(fn, params, x, y, include_inputs=False),
            "loss_dev": abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)),
            "grad_err": _rel(grad, ref_grad),
        }
    return rows


def main() -> dict[str, dict]:
    """Prints the table; returns its figures, model -> variant -> measures."""
    print(f"jax {jax.__version__}, backend {jax.default_backend()}")
    results = {}
    print(f"{'model':14} {'variant':9} {'act MB':>7} {'act/f32':>7} {'act/own':>7} {'loss dev':>8} {'grad err':>8}")
    x, y = data()
    for name, make in families():
        rows = results[name] = measure(make, x, y)
        for variant, r in rows.items():
            print(
                f"{name:14} {variant:9} {r['act'] / 2**20:7.2f} {r['act'] / rows['float32']['act']:7.2f} "
                f"{r['act'] / rows['own bf16']['act']:7.2f} {r['loss_dev']:8.2%} {r['grad_err']:8.4f}"
            )
    return results


if __name__ == "__main__":
    main()
