"""Train a small MLP with float16 compute and dynamic loss scaling, the jaxamp way.

Run: ``.venv/bin/python examples/float16_training.py [--steps 300]``. Prints the loss, the
loss scale and how many steps were skipped; float32 is trained alongside for comparison.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import optax

import autocast


def init_mlp(key, sizes):
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        {"w": jax.random.normal(k, (a, b)) / jnp.sqrt(a), "b": jnp.zeros(b)}
        for k, a, b in zip(keys, sizes[:-1], sizes[1:])
    ]


def mlp_loss(params, x, y):
    """Softmax cross-entropy of a GELU MLP, written in float32."""
    h = x
    for i, layer in enumerate(params):
        h = h @ layer["w"] + layer["b"]
        if i < len(params) - 1:
            h = jax.nn.gelu(h)
    return optax.softmax_cross_entropy_with_integer_labels(h, y).mean()


def make_step(loss_fn, optimizer):
    grad_fn = autocast.dynamic_scale_value_and_grad(loss_fn)

    @jax.jit
    def train_step(params, opt_state, scaler_state, x, y):
        scaler_state, (loss, grads) = grad_fn(params, x, y, dynamic_scaler_state=scaler_state)
        finite = autocast.all_finite(grads)
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        # a step with inf/NaN gradients changes nothing but the (now smaller) scale
        params, opt_state = autocast.select_tree(
            finite, (new_params, new_opt_state), (params, opt_state)
        )
        return params, opt_state, scaler_state, loss

    return train_step


def train(steps: int = 300, seed: int = 0) -> dict:
    key = jax.random.PRNGKey(seed)
    params = init_mlp(key, (32, 64, 64, 10))
    teacher = init_mlp(jax.random.PRNGKey(seed + 1), (32, 16, 10))
    optimizer = optax.adam(3e-3)
    amp_loss = autocast.amp(mlp_loss, compute_dtype=jnp.float16)
    steppers = {
        "float32": make_step(mlp_loss, optimizer),
        "float16 amp": make_step(amp_loss, optimizer),
    }
    runs = {
        name: (params, optimizer.init(params), autocast.DynamicScalerState()) for name in steppers
    }
    history = {name: [] for name in steppers}
    for step in range(steps):
        x = jax.random.normal(jax.random.fold_in(key, step), (64, 32))
        logits = x
        for i, layer in enumerate(teacher):
            logits = logits @ layer["w"] + layer["b"]
            logits = jnp.tanh(logits) if i < len(teacher) - 1 else logits
        y = jnp.argmax(logits, axis=-1)
        for name, step_fn in steppers.items():
            p, o, s = runs[name]
            p, o, s, loss = step_fn(p, o, s, x, y)
            runs[name] = (p, o, s)
            history[name].append(float(loss))
    return {
        name: {
            "first_loss": history[name][0],
            "final_loss": sum(history[name][-20:]) / 20,
            "scale": float(runs[name][2].scaler),
            "skipped": int(runs[name][2].total_resets),
        }
        for name in steppers
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    for name, r in train(args.steps).items():
        print(
            f"{name:12} loss {r['first_loss']:.3f} -> {r['final_loss']:.3f}   "
            f"scale {r['scale']:g}   skipped steps {r['skipped']}"
        )


if __name__ == "__main__":
    main()
