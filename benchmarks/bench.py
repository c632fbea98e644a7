"""The benchmark harness (``make bench``): every SPEC 5 measure, side by side, in one run.

For float32, the same model cast to bfloat16 by hand, and amp with bfloat16 compute, on the
MLP and the GPT-style model (unrolled and scanned, with and without checkpoints): loss,
16-bit share of matmul FLOPs forward and backward, casts, activation memory and its ratios;
then the trace-overhead ratio of ``jit(amp(f)).lower`` over ``jit(f).lower``; and, when a
GPU is present, step time and peak memory as ratios to float32; and amp on third-party code
(custom rules with closures, diffrax, optimistix, lineax, a Pallas kernel) against float32.
Prints tables and writes all figures to ``--json`` (default ``benchmarks/results.json``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).parent))

import mixed_precision  # noqa: E402
import model_families  # noqa: E402
import third_party  # noqa: E402
import trace_overhead  # noqa: E402

import autocast  # noqa: E402
from autocast import _models  # noqa: E402


def _variants(loss_fn):
    return {
        "float32": loss_fn,
        "hand bf16": lambda *a, f=loss_fn: f(*a, jnp.bfloat16),
        "amp bf16": autocast.amp(loss_fn, compute_dtype=jnp.bfloat16),
    }


def gpu_step_figures(loss_fn, args, repeats: int = 20) -> dict:
    """Step time and peak memory of a jitted gradient step, per variant (GPU only)."""
    figures = {}
    for name, fn in _variants(loss_fn).items():
        step = jax.jit(jax.grad(fn))
        jax.block_until_ready(step(*args))
        device = jax.devices()[0]
        start = time.perf_counter()
        for _ in range(repeats):
            out = step(*args)
        jax.block_until_ready(out)
        stats = device.memory_stats() or {}
        figures[name] = {
            "step_ms": 1e3 * (time.perf_counter() - start) / repeats,
            "peak_bytes": stats.get("peak_bytes_in_use"),
        }
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=str(Path(__file__).with_name("results.json")))
    parser.add_argument("--repeats", type=int, default=15, help="trace-overhead repeats")
    args = parser.parse_args()
    results: dict = {"jax": jax.__version__, "backend": jax.default_backend(), "models": {}}

    print("== mixed precision, read off the jaxprs ==")
    mixed_precision.main()
    for name, loss_fn, model_args in mixed_precision.models():
        ref = float(jax.jit(loss_fn)(*model_args))
        results["models"][name] = {
            k: mixed_precision.measure(f, model_args, ref) for k, f in _variants(loss_fn).items()
        }

    print("\n== model families: activation memory and gradient error, Flax Linen ==")
    results["model_families"] = model_families.main()

    print("\n== trace overhead: jit(amp(f)).lower / jit(f).lower, 12-layer unrolled GPT ==")
    key = jax.random.PRNGKey(0)
    params = _models.init_gpt(key, layers=12, d=64, seq=32)
    tokens = _models.gpt_batch(key, seq=32)
    plain = lambda: (lambda p, t: _models.gpt_loss(p, t))  # noqa: E731
    amped = lambda: autocast.amp(lambda p, t: _models.gpt_loss(p, t), compute_dtype=jnp.bfloat16)  # noqa: E731
    trace_overhead.best_of_interleaved(plain, amped, (params, tokens), 1)
    base, mixed = trace_overhead.best_of_interleaved(plain, amped, (params, tokens), args.repeats)
    results["trace_overhead"] = {"plain_ms": 1e3 * base, "amp_ms": 1e3 * mixed, "ratio": mixed / base}
    print(f"{1e3 * base:.1f} ms -> {1e3 * mixed:.1f} ms: {mixed / base:.2f}x")

    print("\n== third-party code: error vs float32, bfloat16 compute ==")
    results["third_party"] = third_party.main()

    if jax.default_backend() == "gpu":
        print("\n== GPU: gradient step time and peak memory ==")
        gpu = {}
        for name, loss_fn, model_args in mixed_precision.models():
            gpu[name] = figures = gpu_step_figures(loss_fn, model_args)
            f32 = figures["float32"]
            for k, r in figures.items():
                peak = r["peak_bytes"] and f32["peak_bytes"] and r["peak_bytes"] / f32["peak_bytes"]
                print(f"{name:15} {k:9} step {r['step_ms']:8.3f} ms ({r['step_ms'] / f32['step_ms']:.2f}x)"
                      f"  peak {peak if peak is None else f'{peak:.2f}x'}")
        results["gpu"] = gpu
    else:
        print("\n(no GPU: step time and peak memory are measured only on one)")

    Path(args.json).write_text(json.dumps(results, indent=1))
    print(f"\nfigures written to {args.json}")


if __name__ == "__main__":
    main()
