"""Train a Flax NNX conv net (BatchNorm, Dropout) under amp, with ``nnx.jit`` and
``nnx.value_and_grad``.

Run: ``.venv/bin/python examples/flax_nnx.py [--steps 40]``. Prints float32 and amp losses
side by side, and shows that BatchNorm's running statistics and Dropout's RNG state move
from step to step under amp.

Module writes. An NNX module is mutable: BatchNorm writes its running statistics and
Dropout advances its RNG counter as the module runs. ``amp`` traces ``fn`` on copies of its
arguments; on Flax 0.11 and later (NNX modules are pytrees) it carries every variable the
function gave a new value out to the caller's module, so
``nnx.value_and_grad(amp(loss_fn))(model, ...)`` updates the statistics as it would without
amp. On Flax 0.10 a module that writes to itself inside amp raises Flax's
``TraceContextError``. This example uses the form that works on both: amp wraps a *pure*
function of the module's state that returns the state it changed, and ``nnx.update``
writes it back outside amp:

    def loss_fn(model, x, y):
        graphdef, state = nnx.split(model)
        loss, state = autocast.amp(pure_loss)(graphdef, state, x, y)   # pure_loss merges,
        nnx.update(model, state)                                       # runs, re-splits
        return loss

``nnx.value_and_grad(loss_fn)`` then differentiates through amp and carries the updates
back to the caller's model, as it does for any NNX function.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import autocast


class ConvNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.conv1 = nnx.Conv(3, 16, kernel_size=(3, 3), rngs=rngs)
        self.bn1 = nnx.BatchNorm(16, rngs=rngs)
        self.conv2 = nnx.Conv(16, 16, kernel_size=(3, 3), rngs=rngs)
        self.bn2 = nnx.BatchNorm(16, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.head = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = nnx.relu(self.bn1(self.conv1(x)))
        x = nnx.relu(self.bn2(self.conv2(x)))
        return self.head(self.drop(x.mean(axis=(1, 2))))


def make_data(key: jax.Array, n: int = 32) -> tuple[jax.Array, jax.Array]:
    """Images whose class is the quadrant holding a bright square."""
    kx, kc = jax.random.split(key)
    labels = jax.random.randint(kc, (n,), 0, 4)
    x = 0.3 * jax.random.normal(kx, (n, 12, 12, 3))
    rows = (labels // 2)[:, None] * 6 + jnp.arange(6)[None]
    cols = (labels % 2)[:, None] * 6 + jnp.arange(6)[None]
    bump = (
        jnp.zeros((n, 12, 12))
        .at[jnp.arange(n)[:, None, None], rows[:, :, None], cols[:, None, :]]
        .set(1.5)
    )
    return x + bump[..., None], labels


def pure_loss(graphdef: nnx.GraphDef, state: nnx.State, x: jax.Array, y: jax.Array):
    """A pure function of the model's state: what amp can wrap. Returns the new state too."""
    model = nnx.merge(graphdef, state)
    logits = model(x)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, nnx.state(model)


def make_step(compute_dtype, optimizer: optax.GradientTransformation):
    run = (
        pure_loss if compute_dtype is None else autocast.amp(pure_loss, compute_dtype=compute_dtype)
    )

    def loss_fn(model: ConvNet, x: jax.Array, y: jax.Array) -> jax.Array:
        graphdef, state = nnx.split(model)
        loss, state = run(graphdef, state, x, y)
        nnx.update(model, state)  # BatchNorm statistics and the dropout RNG, written back
        return loss

    @nnx.jit
    def step(model: ConvNet, opt_state, x, y):
        loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
        params = nnx.state(model, nnx.Param)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        nnx.update(model, optax.apply_updates(params, updates))
        return loss, opt_state

    return step


def _snapshot(model: ConvNet) -> dict:
    counts = jax.tree_util.tree_leaves(nnx.state(model, nnx.RngCount))
    return {"bn_mean": jnp.array(model.bn1.mean[...]), "rng_count": int(sum(counts))}


def train(steps: int = 40, compute_dtype=jnp.bfloat16) -> dict:
    x, y = make_data(jax.random.key(0))
    optimizer = optax.adam(3e-3)
    results = {}
    for name, dtype in (("float32", None), ("amp", compute_dtype)):
        model = ConvNet(nnx.Rngs(0, dropout=1))
        opt_state = optimizer.init(nnx.state(model, nnx.Param))
        step = make_step(dtype, optimizer)
        losses, snapshots = [], [_snapshot(model)]
        for _ in range(steps):
            loss, opt_state = step(model, opt_state, x, y)
            losses.append(float(loss))
            snapshots.append(_snapshot(model))
        results[name] = {"losses": losses, "snapshots": snapshots}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    results = train(parser.parse_args().steps)
    print(f"{'step':>5} {'float32':>9} {'amp bf16':>9}")
    for i in range(0, len(results["float32"]["losses"]), 10):
        print(f"{i:>5} {results['float32']['losses'][i]:9.4f} {results['amp']['losses'][i]:9.4f}")
    print(f"final {results['float32']['losses'][-1]:9.4f} {results['amp']['losses'][-1]:9.4f}")
    snaps = results["amp"]["snapshots"]
    moved = float(jnp.abs(snaps[-1]["bn_mean"] - snaps[0]["bn_mean"]).max())
    print(
        f"under amp: BatchNorm running mean moved by up to {moved:.3f}; "
        f"dropout RNG count {snaps[0]['rng_count']} -> {snaps[-1]['rng_count']}"
    )


if __name__ == "__main__":
    main()
