"""Train a Flax Linen model whose blocks run in ``nn.scan`` over ``nn.remat``, under amp.

Run: ``.venv/bin/python examples/flax_linen.py [--steps 60]``. Prints float32 and amp
losses side by side.

Nothing in the model changes for amp: the loss function is wrapped once,
``jax.value_and_grad(autocast.amp(loss_fn))``, and amp looks inside the ``scan`` and the
``checkpoint`` that Linen's lifted transforms produce, so the blocks' matrix products run in
bfloat16, forward and backward, while the layer norms' statistics and the loss stay float32.
"""

from __future__ import annotations

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import autocast


class Block(nn.Module):
    """A pre-norm residual MLP block; the carry is the residual stream."""

    width: int

    @nn.compact
    def __call__(self, h: jax.Array, _: None) -> tuple[jax.Array, None]:
        z = nn.Dense(4 * self.width)(nn.LayerNorm()(h))
        return h + nn.Dense(self.width)(nn.gelu(z)), None


class Model(nn.Module):
    width: int = 32
    depth: int = 4
    classes: int = 5

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.Dense(self.width)(x)
        blocks = nn.scan(
            nn.remat(Block),
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=self.depth,
        )
        h, _ = blocks(self.width)(h, None)
        return nn.Dense(self.classes)(nn.LayerNorm()(h))


def make_data(key: jax.Array, n: int = 128) -> tuple[jax.Array, jax.Array]:
    """Points labelled by which of five fixed directions they lie closest to."""
    kx, kd = jax.random.split(key)
    x = jax.random.normal(kx, (n, 16))
    directions = jax.random.normal(kd, (5, 16))
    return x, jnp.argmax(x @ directions.T, axis=-1)


def loss_fn(params, model: Model, x: jax.Array, y: jax.Array) -> jax.Array:
    logits = model.apply(params, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def train(steps: int = 60, compute_dtype=jnp.bfloat16) -> dict:
    model = Model()
    x, y = make_data(jax.random.key(0))
    params0 = model.init(jax.random.key(1), x)
    optimizer = optax.adam(3e-3)
    results = {}
    for name, fn in (
        ("float32", loss_fn),
        ("amp", autocast.amp(loss_fn, compute_dtype=compute_dtype)),
    ):
        grad_fn = jax.value_and_grad(fn)

        @jax.jit
        def step(params, opt_state, grad_fn=grad_fn):
            loss, grads = grad_fn(params, model, x, y)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        params, opt_state, losses = params0, optimizer.init(params0), []
        for _ in range(steps):
            params, opt_state, loss = step(params, opt_state)
            losses.append(float(loss))
        results[name] = {"losses": losses}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    results = train(parser.parse_args().steps)
    f32, amp = results["float32"]["losses"], results["amp"]["losses"]
    print(f"{'step':>5} {'float32':>9} {'amp bf16':>9}")
    for i in range(0, len(f32), max(1, len(f32) // 6)):
        print(f"{i:>5} {f32[i]:9.4f} {amp[i]:9.4f}")
    print(f"final {f32[-1]:9.4f} {amp[-1]:9.4f}")


if __name__ == "__main__":
    main()
