"""A tensor-parallel MLP under amp on 8 simulated CPU devices: what crosses the wire.

Megatron-style blocks inside ``shard_map``: the first matrix of each block is split by
columns, the second by rows, so each device holds a slice of the hidden layer and the block
output is a partial sum that one ``psum`` completes. Under amp the partial products are
bfloat16, and a 16-bit partial sum travels in 16 bits (the default policy's ``psum`` row).

Columns, float32 against amp bfloat16: the dtypes of the collectives in the gradient step's
jaxpr; bytes communicated per device per step, read off that jaxpr (each collective's operand
bytes on one device); the loss and its deviation from float32's, at the start and after a
short Adam run; whether the gradients are float32 and finite.

Run: ``.venv/bin/python benchmarks/tensor_parallel.py [--steps 50] [--json out.json]``. It
asks XLA for 8 host devices itself, so run it as its own process (``make bench`` does).
"""

from __future__ import annotations

import os

# eight simulated devices, whatever other XLA flags the caller set
_DEVICES = "--xla_force_host_platform_device_count=8"
if _DEVICES not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICES}".strip()

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import autocast  # noqa: E402
from autocast import _compat  # noqa: E402
from autocast._src.tools import measure as _measure  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import _training  # noqa: E402

COLLECTIVES = frozenset(
    {
        "psum",
        "psum_invariant",
        "pmax",
        "pmin",
        "all_gather",
        "all_gather_invariant",
        "ppermute",
        "all_to_all",
        "reduce_scatter",
    }
)
WIDTH, HIDDEN, DEPTH, BATCH = 128, 512, 2, 64


def init(key: jax.Array) -> dict[str, jax.Array]:
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "up": jax.random.normal(k1, (DEPTH, WIDTH, HIDDEN)) / np.sqrt(WIDTH),
        "down": jax.random.normal(k2, (DEPTH, HIDDEN, WIDTH)) / np.sqrt(HIDDEN),
        "head": jax.random.normal(k3, (WIDTH, 10)) / np.sqrt(WIDTH),
    }


def batch(step: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Inputs and labels for one step: the label is the largest of ten fixed projections."""
    x = jax.random.normal(jax.random.fold_in(jax.random.key(5), step), (BATCH, WIDTH))
    directions = jax.random.normal(jax.random.key(6), (WIDTH, 10))
    return x, jnp.argmax(x @ directions, axis=-1)


def make_loss(mesh: Any) -> Callable[..., jax.Array]:
    def blocks(up: jax.Array, down: jax.Array, x: jax.Array) -> jax.Array:
        # up: this device's columns, down: its rows; x is the same on every device
        for i in range(DEPTH):
            h = x - jnp.mean(x, -1, keepdims=True)
            h = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-5)
            partial = jax.nn.gelu(h @ up[i]) @ down[i]
            x = x + jax.lax.psum(partial, "tp")
        return x

    sharded = _compat.shard_map(blocks, mesh, (P(None, None, "tp"), P(None, "tp", None), P()), P())

    def loss(params: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
        logits = sharded(params["up"], params["down"], x) @ params["head"]
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()

    return loss


def communicated(jaxpr: Any) -> tuple[int, list[tuple[str, str]]]:
    """Operand bytes of every collective on one device, and (primitive, dtype) of each."""
    total, seen = 0, []
    for eqn in _measure.equations(jaxpr):
        if eqn.primitive.name in COLLECTIVES:
            for v in eqn.invars:
                total += int(np.prod(v.aval.shape)) * v.aval.dtype.itemsize
                seen.append((eqn.primitive.name, v.aval.dtype.name))
    return total, seen


def train(loss: Callable[..., jax.Array], params: Any, steps: int) -> float:
    """Mean loss of the last 10 of ``steps`` Adam steps."""
    return _training.final_loss(loss, params, batch, steps, last=10)


def main(steps: int = 50) -> dict[str, dict]:
    """Prints the table; returns variant -> measures."""
    devices = jax.devices()
    if len(devices) < 8:
        raise RuntimeError(
            f"needs 8 devices, found {len(devices)}: run this file as its own process"
        )
    mesh = jax.sharding.Mesh(np.array(devices[:8]), ("tp",))
    loss = make_loss(mesh)
    params = init(jax.random.key(0))
    x, y = batch(jnp.asarray(0))
    variants = {"float32": loss, "amp bf16": autocast.amp(loss, compute_dtype=jnp.bfloat16)}
    rows: dict[str, dict] = {}
    for name, fn in variants.items():
        step = jax.value_and_grad(fn)
        value, grads = jax.jit(step)(params, x, y)
        nbytes, seen = communicated(jax.make_jaxpr(step)(params, x, y))
        leaves = jax.tree_util.tree_leaves(grads)
        rows[name] = {
            "bytes": nbytes,
            "collectives": sorted(set(seen)),
            "loss": float(value),
            "grads_float32_finite": all(
                g.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(g))) for g in leaves
            ),
            "trained": train(fn, params, steps) if steps else None,
        }
    ref = rows["float32"]
    print(
        f"jax {jax.__version__}, {len(devices)} CPU devices; "
        f"MLP d={WIDTH} hidden={HIDDEN} x{DEPTH}, batch {BATCH}"
    )
    print(
        f"{'variant':9} {'KB/step':>8} {'vs f32':>6} {'loss':>7} {'dev':>6} "
        f"{'trained':>8} {'dev':>6} {'grads':>6}  collectives"
    )
    for name, r in rows.items():
        r["loss_dev"] = abs(r["loss"] - ref["loss"]) / ref["loss"]
        r["trained_dev"] = abs(r["trained"] - ref["trained"]) / ref["trained"] if steps else None
        trained = f"{r['trained']:8.4f} {r['trained_dev']:6.2%}" if steps else f"{'-':>8} {'-':>6}"
        kinds = ", ".join(f"{p} {d}" for p, d in r["collectives"])
        print(
            f"{name:9} {r['bytes'] / 1024:8.1f} {r['bytes'] / ref['bytes']:6.2f} {r['loss']:7.4f} "
            f"{r['loss_dev']:6.2%} {trained} "
            f"{'ok' if r['grads_float32_finite'] else 'BAD':>6}  {kinds}"
        )
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps", type=int, default=50, help="Adam steps per training run (0: none)"
    )
    parser.add_argument("--json", help="also write the figures to this file")
    options = parser.parse_args()
    results = main(options.steps)
    if options.json:
        with open(options.json, "w") as f:
            json.dump(results, f, indent=1)
