"""Trace overhead of amp on a 12-layer unrolled GPT-style transformer:

- the wall time of ``jax.jit(amp(f)).lower(...)`` over ``jax.jit(f).lower(...)``;
- a training step's first call, ``jax.jit(jax.grad(amp(f)))(...)`` (tracing, compiling and
  running once), over the same for the model cast to bfloat16 by hand (its ``hand_cast``
  argument): what a user waits for before the first step, amp against doing it by hand.

Run: ``.venv/bin/python benchmarks/trace_overhead.py [--layers 12] [--repeats 5]``
Each repeat wraps the functions afresh, so every lowering traces (and every first call
compiles) from scratch, and the two alternate so both meet the same machine load. The best of
the repeats is reported: tracing is deterministic CPU work, so the fastest run is the one
least disturbed by anything else.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

import autocast
from autocast._src.demo import models as _models


def _lower_seconds(make_fn, args) -> float:
    fn = make_fn()
    start = time.perf_counter()
    jax.jit(fn).lower(*args)
    return time.perf_counter() - start


def _first_call_seconds(make_fn, args) -> float:
    fn = make_fn()
    start = time.perf_counter()
    jax.block_until_ready(jax.jit(jax.grad(fn))(*args))
    return time.perf_counter() - start


def best_of_interleaved(make_a, make_b, args, repeats: int, measure=_lower_seconds) -> tuple:
    """Best time of each, alternating a and b so both meet the same machine load."""
    a, b = [], []
    for _ in range(repeats):
        a.append(measure(make_a, args))
        b.append(measure(make_b, args))
    return min(a), min(b)


def measure(layers: int = 12, repeats: int = 25, grad: bool = False) -> dict:
    """The lowering times (ms) of f and amp(f), and the first-call times of a gradient step
    cast by hand and under amp, with their ratios."""
    key = jax.random.PRNGKey(0)
    params = _models.init_gpt(key, layers=layers, d=64, seq=32)
    tokens = _models.gpt_batch(key, seq=32)

    def plain():
        f = lambda p, t: _models.gpt_loss(p, t)  # noqa: E731 - a fresh function defeats caches
        return jax.grad(f) if grad else f

    def amped():
        f = autocast.amp(lambda p, t: _models.gpt_loss(p, t), compute_dtype=jnp.bfloat16)
        return jax.grad(f) if grad else f

    def hand():
        return lambda p, t: _models.gpt_loss(p, t, hand_cast=jnp.bfloat16)  # noqa: E731

    def amp_loss():
        return autocast.amp(lambda p, t: _models.gpt_loss(p, t), compute_dtype=jnp.bfloat16)

    best_of_interleaved(plain, amped, (params, tokens), 1)  # warm JAX's own caches
    base, mixed = best_of_interleaved(plain, amped, (params, tokens), repeats)
    calls = max(1, repeats // 5)  # a first call compiles: seconds each
    by_hand, by_amp = best_of_interleaved(
        hand, amp_loss, (params, tokens), calls, measure=_first_call_seconds
    )
    return {
        "plain_ms": 1e3 * base,
        "amp_ms": 1e3 * mixed,
        "ratio": mixed / base,
        "first_call_hand_ms": 1e3 * by_hand,
        "first_call_amp_ms": 1e3 * by_amp,
        "first_call_ratio": by_amp / by_hand,
        "first_calls": calls,
    }


def report(r: dict, layers: int, repeats: int, grad: bool = False) -> None:
    what = "grad of " if grad else ""
    print(f"jax {jax.__version__}, {what}{layers}-layer unrolled GPT, best of {repeats}")
    print(f"jit(f).lower:      {r['plain_ms']:8.1f} ms")
    print(f"jit(amp(f)).lower: {r['amp_ms']:8.1f} ms")
    print(f"ratio:             {r['ratio']:8.2f}x")
    print(f"first call of jit(grad(.)), best of {r['first_calls']}:")
    print(f"hand-cast bf16:    {r['first_call_hand_ms']:8.1f} ms")
    print(f"amp bf16:          {r['first_call_amp_ms']:8.1f} ms")
    print(f"ratio:             {r['first_call_ratio']:8.2f}x  (target <= 1.1x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--grad", action="store_true", help="lower the gradient instead")
    args = parser.parse_args()
    report(measure(args.layers, args.repeats, args.grad), args.layers, args.repeats, args.grad)


if __name__ == "__main__":
    main()
