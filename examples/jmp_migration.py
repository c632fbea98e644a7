"""Move a jmp training loop to autocast: the same loop before and after.

Run: ``.venv/bin/python examples/jmp_migration.py [--steps 200]``. Trains one float16 MLP
three ways and prints their losses next to float32's:

1. ``jmp``: the loop as jmp users write it, every cast by hand (skipped if jmp is absent);
2. ``import autocast as jmp``: *the same function*, with only the module swapped;
3. ``autocast.amp``: the casts deleted; amp casts inside the unmodified loss instead, and
   the loss scale, finiteness check and skip are the same three lines as before.

The loss scale is ``DynamicLossScale`` in all three: float16 needs it (its smallest normal
number is 6e-5, where small gradients would vanish). See docs/migration.md for every place
autocast deliberately differs from jmp.
"""

from __future__ import annotations

import argparse
import types

import jax
import jax.numpy as jnp
import optax

import autocast

try:
    import jmp
except ImportError:  # the example still shows the autocast halves without it
    jmp = None


def init_mlp(key: jax.Array, sizes: tuple[int, ...] = (32, 64, 64, 10)) -> list[dict]:
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        {"w": jax.random.normal(k, (m, n)) / jnp.sqrt(m), "b": jnp.zeros(n)}
        for k, m, n in zip(keys, sizes[:-1], sizes[1:])
    ]


def mlp(params: list[dict], x: jax.Array) -> jax.Array:
    for layer in params[:-1]:
        x = jax.nn.gelu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def loss_fn(params: list[dict], x: jax.Array, y: jax.Array) -> jax.Array:
    logits = mlp(params, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def jmp_style_step(mp: types.ModuleType, optimizer: optax.GradientTransformation):
    """The jmp loop: cast parameters and inputs by hand, scale, unscale, skip bad steps.

    ``mp`` is the module that provides jmp's names: ``jmp`` itself, or ``autocast``.
    """
    policy = mp.get_policy("params=float32,compute=float16,output=float32")

    def scaled_loss(params, loss_scale, x, y):
        params, x = policy.cast_to_compute((params, x))
        logits = policy.cast_to_output(mlp(params, x))
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return loss_scale.scale(loss), loss

    @jax.jit
    def step(params, opt_state, loss_scale, x, y):
        grads, loss = jax.grad(scaled_loss, has_aux=True)(params, loss_scale, x, y)
        grads = loss_scale.unscale(policy.cast_to_param(grads))
        finite = mp.all_finite(grads)
        loss_scale = loss_scale.adjust(finite)
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        params, opt_state = mp.select_tree(finite, (new_params, new_opt_state), (params, opt_state))
        return params, opt_state, loss_scale, loss

    return step, mp.DynamicLossScale(jnp.float32(2**15))


def amp_step(optimizer: optax.GradientTransformation, compute_dtype=jnp.float16):
    """After: no casts in the loss; amp decides what runs in float16."""
    amp_loss = autocast.amp(loss_fn, compute_dtype=compute_dtype)

    @jax.jit
    def step(params, opt_state, loss_scale, x, y):
        loss, grads = jax.value_and_grad(lambda p: loss_scale.scale(amp_loss(p, x, y)))(params)
        grads = loss_scale.unscale(grads)
        loss = loss / loss_scale.loss_scale
        finite = autocast.all_finite(grads)
        loss_scale = loss_scale.adjust(finite)
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        params, opt_state = autocast.select_tree(
            finite, (new_params, new_opt_state), (params, opt_state)
        )
        return params, opt_state, loss_scale, loss

    return step, autocast.DynamicLossScale(jnp.float32(2**15))


def float32_step(optimizer: optax.GradientTransformation):
    @jax.jit
    def step(params, opt_state, loss_scale, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss_scale, loss

    return step, autocast.NoOpLossScale()


def batches(steps: int, key: jax.Array, size: int = 64):
    """A fixed random teacher labels Gaussian inputs."""
    teacher = init_mlp(jax.random.fold_in(key, 1), (32, 16, 10))
    for i in range(steps):
        x = jax.random.normal(jax.random.fold_in(key, 100 + i), (size, 32))
        yield x, jnp.argmax(mlp(teacher, x), axis=-1)


def train(steps: int = 200) -> dict:
    key = jax.random.key(0)
    params0 = init_mlp(key)
    optimizer = optax.adam(3e-3)
    runs = {"float32": float32_step(optimizer)}
    if jmp is not None:
        runs["jmp"] = jmp_style_step(jmp, optimizer)
    runs["import autocast as jmp"] = jmp_style_step(autocast, optimizer)
    runs["autocast.amp"] = amp_step(optimizer)
    results = {}
    for name, (step, loss_scale) in runs.items():
        params, opt_state, losses = params0, optimizer.init(params0), []
        for x, y in batches(steps, key):
            params, opt_state, loss_scale, loss = step(params, opt_state, loss_scale, x, y)
            losses.append(float(loss))
        results[name] = {"losses": losses, "loss_scale": float(loss_scale.loss_scale)}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    results = train(parser.parse_args().steps)
    names = list(results)
    print(f"{'step':>5} " + " ".join(f"{n:>22}" for n in names))
    steps = len(results["float32"]["losses"])
    for i in list(range(0, steps, max(1, steps // 5))) + [steps - 1]:
        print(f"{i:>5} " + " ".join(f"{results[n]['losses'][i]:22.4f}" for n in names))
    print(
        "loss scale at the end: "
        + ", ".join(f"{n} {results[n]['loss_scale']:g}" for n in names[1:])
    )


if __name__ == "__main__":
    main()
