"""Train a Haiku conv net with BatchNorm state under amp.

Run: ``.venv/bin/python examples/haiku_cnn.py [--steps 40]``. Prints float32 and amp losses
side by side, and how far BatchNorm's moving statistics travelled.

Haiku keeps mutable state out of the module: ``hk.transform_with_state`` gives a pure
``apply(params, state, rng, x) -> (out, new_state)``. That is exactly what amp wraps. The
loss returns the new state as auxiliary output, ``jax.value_and_grad(amp(loss),
has_aux=True)`` differentiates it, and the state comes back in the dtypes it went in
(float32), ready for the next step. The convolutions run in bfloat16; the batch statistics
are computed in float32.
"""

from __future__ import annotations

import argparse

import haiku as hk
import jax
import jax.numpy as jnp
import optax

import autocast


def forward(x: jax.Array, is_training: bool) -> jax.Array:
    for channels in (16, 32):
        x = hk.Conv2D(channels, kernel_shape=3)(x)
        x = hk.BatchNorm(create_scale=True, create_offset=True, decay_rate=0.9)(x, is_training)
        x = jax.nn.relu(x)
    return hk.Linear(4)(x.mean(axis=(1, 2)))


model = hk.transform_with_state(forward)


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


def loss_fn(params: hk.Params, state: hk.State, x: jax.Array, y: jax.Array):
    logits, state = model.apply(params, state, None, x, is_training=True)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), state


def _bn_mean(state: hk.State) -> jax.Array:
    return state["batch_norm/~/mean_ema"]["average"]


def train(steps: int = 40, compute_dtype=jnp.bfloat16) -> dict:
    x, y = make_data(jax.random.key(0))
    params0, state0 = model.init(jax.random.key(1), x, is_training=True)
    optimizer = optax.adam(3e-3)
    results = {}
    for name, fn in (
        ("float32", loss_fn),
        ("amp", autocast.amp(loss_fn, compute_dtype=compute_dtype)),
    ):
        grad_fn = jax.value_and_grad(fn, has_aux=True)

        @jax.jit
        def step(params, state, opt_state, grad_fn=grad_fn):
            (loss, state), grads = grad_fn(params, state, x, y)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), state, opt_state, loss

        params, state, opt_state, losses = params0, state0, optimizer.init(params0), []
        for _ in range(steps):
            params, state, opt_state, loss = step(params, state, opt_state)
            losses.append(float(loss))
        results[name] = {"losses": losses, "state0": state0, "state": state}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    results = train(parser.parse_args().steps)
    f32, amp = results["float32"]["losses"], results["amp"]["losses"]
    print(f"{'step':>5} {'float32':>9} {'amp bf16':>9}")
    for i in range(0, len(f32), max(1, len(f32) // 6)):
        print(f"{i:>5} {f32[i]:9.4f} {amp[i]:9.4f}")
    print(f"final {f32[-1]:9.4f} {amp[-1]:9.4f}")
    moved = jnp.abs(_bn_mean(results["amp"]["state"]) - _bn_mean(results["amp"]["state0"])).max()
    print(
        f"under amp: BatchNorm moving mean moved by up to {float(moved):.3f} "
        f"(dtype {_bn_mean(results['amp']['state']).dtype})"
    )


if __name__ == "__main__":
    main()
