"""What recomputed chains cost in time once XLA cannot merge the recomputation away.

Outside a loop body amp's chain checkpoints are emitted with ``prevent_cse=True``
(docs/amp.md, "Recomputed chains"): the backward pass really recomputes the elementwise work
(a tanh-GELU here) from the chain's inputs, where without the barrier XLA merges it with the
forward pass and keeps what the chain spares. This times the gradient step of an unrolled
MLP (tanh-GELU between its products) both ways, and float32 beside them; the GPU plan
(``make gpu-plan``, rows ``MLP timed``: this MLP at batch 8192) shows the memory side for
an H100: temporaries 150 MiB merged, 84 MiB recomputed, 192 MiB in float32. An H100 took
0.56, 0.61 and 1.02 ms (docs/benchmarks.md).

On a CPU the 16-bit products are emulated, so the figures say what the extra elementwise
work costs next to them here, not on a GPU, where the recomputation fuses into the backward
pass's kernels.

Run: ``.venv/bin/python benchmarks/recompute_cost.py [--batch 1024] [--repeats 10]``
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

import autocast
from autocast._src.transform import recompute

WIDTHS = (256, 1024, 1024, 1024, 10)


def mlp_loss(params: list, x: jax.Array, y: jax.Array) -> jax.Array:
    for i, (w, b) in enumerate(params):
        x = x @ w + b
        if i < len(params) - 1:
            x = jax.nn.gelu(x)
    return jnp.mean((x - y) ** 2)


def _args(batch: int, widths: tuple[int, ...]) -> tuple:
    keys = jax.random.split(jax.random.key(0), len(widths) + 1)
    params = [
        (jax.random.normal(k, (a, b)) / a**0.5, jnp.zeros((b,)))
        for k, a, b in zip(keys, widths[:-1], widths[1:])
    ]
    x = jax.random.normal(keys[-1], (batch, widths[0]))
    return params, x, jnp.zeros((batch, widths[-1]))


def _best_ms(step: Callable[..., Any], args: tuple, repeats: int) -> float:
    jax.block_until_ready(step(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(step(*args))
        best = min(best, time.perf_counter() - start)
    return 1e3 * best


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=10)
    options = parser.parse_args(argv)
    args = _args(options.batch, WIDTHS)
    results = {"float32": _best_ms(jax.jit(jax.grad(mlp_loss)), args, options.repeats)}
    for name, apart in (("amp, recomputed", True), ("amp, merged by XLA", False)):
        recompute.PREVENT_CSE_OUTSIDE_LOOPS = apart
        try:
            # a new function object: amp's traces are shared per function and settings
            amp = autocast.amp(lambda *a: mlp_loss(*a), compute_dtype=jnp.bfloat16)
            results[name] = _best_ms(jax.jit(jax.grad(amp)), args, options.repeats)
        finally:
            recompute.PREVENT_CSE_OUTSIDE_LOOPS = True
    print(
        f"jax {jax.__version__}, {jax.default_backend()}: gradient step of an MLP "
        f"{' -> '.join(map(str, WIDTHS))} (tanh-GELU), batch {options.batch}, best of "
        f"{options.repeats}"
    )
    for name, ms in results.items():
        print(f"{name:20} {ms:8.2f} ms")
    ratio = results["amp, recomputed"] / results["amp, merged by XLA"]
    print(f"recomputed / merged: {ratio:.2f}x")
    return results


if __name__ == "__main__":
    main()
