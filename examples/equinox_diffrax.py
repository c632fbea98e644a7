"""Train an Equinox neural ODE, solved with diffrax, under amp.

Run: ``.venv/bin/python examples/equinox_diffrax.py [--steps 60]``. Prints float32 and amp
losses side by side.

The vector field is an ``eqx.nn.MLP``; ``diffrax.diffeqsolve`` (Tsit5, adaptive steps)
integrates it, and its default adjoint differentiates through the solve. The loss is wrapped
once, ``eqx.filter_value_and_grad(autocast.amp(loss))``: every evaluation of the vector
field inside the solver's loops runs its matrix products in bfloat16, while the solver's
error estimates and step-size control see float32 state. A step-size controller cannot
converge below the resolution of the function it integrates, so its tolerances stay at
1e-3 or looser under bfloat16 (the README says more on iterative solvers).
"""

from __future__ import annotations

import argparse

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import autocast

TS = jnp.linspace(0.0, 2.0, 12)


def true_field(t, y, args):
    """A damped rotation: the dynamics the model has to learn."""
    return jnp.array([[-0.1, 1.0], [-1.0, -0.1]]) @ y


def model_field(t, y, model):
    """The learnt dynamics: the MLP applied to the state. One named function rather than a
    lambda per call: diffrax's solver is jitted with the term as a static argument, and a
    new lambda is a new solver program to trace."""
    return model(y)


def solve(field, y0: jax.Array, args=None) -> jax.Array:
    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(field),
        diffrax.Tsit5(),
        TS[0],
        TS[-1],
        0.1,
        y0,
        args=args,
        saveat=diffrax.SaveAt(ts=TS),
        stepsize_controller=diffrax.PIDController(rtol=1e-3, atol=1e-4),
    )
    return sol.ys


def make_data(key: jax.Array, n: int = 16) -> tuple[jax.Array, jax.Array]:
    y0 = jax.random.uniform(key, (n, 2), minval=-1.0, maxval=1.0)
    return y0, jax.vmap(lambda y: solve(true_field, y))(y0)


def loss(model: eqx.nn.MLP, y0: jax.Array, ys: jax.Array) -> jax.Array:
    pred = jax.vmap(lambda y: solve(model_field, y, model))(y0)
    return jnp.mean((pred - ys) ** 2)


def train(steps: int = 60, compute_dtype=jnp.bfloat16) -> dict:
    y0, ys = make_data(jax.random.key(0))
    model0 = eqx.nn.MLP(2, 2, 32, 2, activation=jnp.tanh, key=jax.random.key(1))
    optimizer = optax.adam(1e-2)
    results = {}
    for name, fn in (("float32", loss), ("amp", autocast.amp(loss, compute_dtype=compute_dtype))):

        @eqx.filter_jit
        def step(model, opt_state, fn=fn):
            value, grads = eqx.filter_value_and_grad(fn)(model, y0, ys)
            updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
            return eqx.apply_updates(model, updates), opt_state, value

        model, opt_state, losses = model0, optimizer.init(eqx.filter(model0, eqx.is_array)), []
        for _ in range(steps):
            model, opt_state, value = step(model, opt_state)
            losses.append(float(value))
        results[name] = {"losses": losses}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    results = train(parser.parse_args().steps)
    f32, amp = results["float32"]["losses"], results["amp"]["losses"]
    print(f"{'step':>5} {'float32':>9} {'amp bf16':>9}")
    for i in range(0, len(f32), max(1, len(f32) // 6)):
        print(f"{i:>5} {f32[i]:9.5f} {amp[i]:9.5f}")
    print(f"final {f32[-1]:9.5f} {amp[-1]:9.5f}")


if __name__ == "__main__":
    main()
