"""How far 8-bit Adam moments drift without a key: one gradient far larger than the rest of
its block, then 200 ordinary steps; the total update of the block's other parameters
against float32 Adam's, with and without stochastic rounding of the state.

    .venv/bin/python benchmarks/state_drift.py

docs/training_state.md ("8-bit moments") quotes the ratios.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import autocast.optax as ao


def total_update(tx: optax.GradientTransformation, spike: float, steps: int = 200) -> np.ndarray:
    """The summed updates of every parameter but the first of each 256-wide row, when the
    first step's gradient of the first is ``spike`` times the others'."""
    params = {"w": jnp.zeros((16, 256))}
    state = tx.init(params)
    update = jax.jit(tx.update)
    total = np.zeros((16, 255))
    for t in range(steps):
        g = jnp.abs(jax.random.normal(jax.random.key(t), (16, 256))) * 1e-3
        if t == 0:
            g = g.at[:, 0].set(spike * 1e-3)
        updates, state = update({"w": g}, state, params)
        total += np.asarray(updates["w"])[:, 1:]
    return total


def drift(spike: float, key: int | None, steps: int = 200) -> float:
    """The 8-bit state's mean total update over float32 Adam's (1.0: no drift)."""
    reference = total_update(optax.adam(1e-3), spike, steps)
    stored = ao.low_precision_state(optax.adam(1e-3), jnp.float8_e4m3fn, key=key)
    return float(np.mean(total_update(stored, spike, steps) / reference))


def main() -> None:
    print("spike   no key   key")
    for k in (10, 14, 17):
        print(f"2**{k}  {drift(2.0**k, None):7.3f} {drift(2.0**k, 0):6.3f}")


if __name__ == "__main__":
    main()
