"""The benchmark harness (``make bench``): every measure, side by side.

Sections, each a table (``--only`` picks some):

- ``jaxpr``: float32, the same model cast to bfloat16 by hand, and amp with bfloat16 compute,
  on the MLP and the GPT-style models (the demo's small one; a 4-layer one unrolled and
  scanned, with and without checkpoints): loss, 16-bit share of matmul FLOPs forward and
  backward, casts, activation memory and its ratios;
- ``families``: CNNs with BatchNorm and GroupNorm, a ResNet, a ViT and a Flax Linen GPT:
  activation memory against float32 and the framework's own bfloat16, gradient error, loss
  after a training run;
- ``torch``: the same GPTs and CNNs under ``torch.autocast`` (saved-tensor bytes against
  torch's own float32), next to amp's ratios; only when PyTorch is installed (the
  ``bench-torch`` extra);
- ``parallel``: a tensor-parallel MLP on 8 simulated CPU devices (its own process): bytes
  communicated per step, loss against float32;
- ``trace``: ``jit(amp(f)).lower`` over ``jit(f).lower`` on a 12-layer GPT, and a gradient
  step's first call (trace, compile, run) under amp over the hand-cast model's;
- ``recompute``: an unrolled MLP's gradient step with its chains recomputed in the backward
  pass against the same program with the recomputation merged away by XLA;
- ``third_party``: amp on custom rules with closures, diffrax, optimistix, lineax, Pallas;
- ``fp8``: amp with float8 products against amp bfloat16: 8-bit and e5m2 FLOP shares,
  gradient error, activation memory, loss after training the demo's GPT;
- ``state``: the training state in 16 and 8 bits (``training_state.py``): bytes per
  parameter of each choice, the demo's GPT trained 300 steps with each (final loss against
  float32 parameters and moments), and the optimizer update's time against plain Adam;
- ``diagnose``: what ``autocast.diagnose`` costs against amp's first call (trace, compile,
  run) on the demo's GPT as a loss, a gradient, and a jitted gradient of scanned blocks;
- ``gpu``: training steps at real sizes (``gpu_step.py``: GPT-2 small and medium, a 24x2048
  decoder, ResNet-18; float32, hand-cast, amp bf16 and fp8, naive and fused attention,
  torch.autocast where PyTorch has CUDA), each in its own process; on a GPU only;
- ``step``: gradient step time and peak memory (``compiled.memory_analysis()``, and the
  device's own peak where it reports one), float32 vs hand-cast vs amp bfloat16 vs amp float8.
  Runs by default on a
  GPU only; ``--step-figures`` runs it on any backend, so the GPU path is exercised on CPU.

Prints the tables and writes all figures to ``--json`` (default ``benchmarks/results.json``).

Run: ``.venv/bin/python benchmarks/bench.py [--only jaxpr,families] [--step-figures]``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

import diagnose_cost  # noqa: E402
import fp8_compute  # noqa: E402
import gpu_step  # noqa: E402
import mixed_precision  # noqa: E402
import model_families  # noqa: E402
import recompute_cost  # noqa: E402
import third_party  # noqa: E402
import torch_autocast  # noqa: E402
import trace_overhead  # noqa: E402
import training_state  # noqa: E402

from autocast._src.tools import measure as _measure  # noqa: E402


def step_figures(loss_fn: Callable[..., Any], args: Sequence[Any], repeats: int = 20) -> dict:
    """Per variant: the jitted gradient step's time (ms, best of ``repeats`` after a warm-up),
    its planned peak memory, and the device's measured peak where it reports one (GPUs)."""
    figures = {}
    for name, fn in mixed_precision.variants(loss_fn, fp8=True).items():
        compiled = jax.jit(jax.grad(fn)).lower(*args).compile()
        jax.block_until_ready(compiled(*args))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            times.append(time.perf_counter() - start)
        stats = jax.devices()[0].memory_stats() or {}
        figures[name] = {
            "step_ms": 1e3 * min(times),
            "planned_peak_bytes": _measure.planned_peak_bytes(compiled),
            "device_peak_bytes": stats.get("peak_bytes_in_use"),
        }
    return figures


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:5.2f}x" if a and b else "    -"


def run_step(results: dict, options: argparse.Namespace) -> None:
    print(f"== {jax.default_backend()}: gradient step time and peak memory ==")
    print(
        f"{'model':15} {'variant':9} {'step ms':>8} {'vs f32':>6} "
        f"{'planned MB':>10} {'vs f32':>6} {'device MB':>9}"
    )
    step = results["step"] = {}
    for name, loss_fn, model_args in mixed_precision.models(options.models):
        step[name] = figures = step_figures(loss_fn, model_args, options.step_repeats)
        f32 = figures["float32"]
        for k, r in figures.items():
            planned, device = r["planned_peak_bytes"], r["device_peak_bytes"]
            print(
                f"{name:15} {k:9} {r['step_ms']:8.3f} {_ratio(r['step_ms'], f32['step_ms']):>6} "
                f"{(planned or 0) / 2**20:10.2f} {_ratio(planned, f32['planned_peak_bytes']):>6} "
                f"{'-' if device is None else f'{device / 2**20:.2f}':>9}"
            )


def run_jaxpr(results: dict, options: argparse.Namespace) -> None:
    print("== mixed precision, read off the jaxprs ==")
    results["models"] = mixed_precision.main(options.models)


def run_families(results: dict, options: argparse.Namespace) -> None:
    print("== model families: activation memory and gradient error, Flax Linen ==")
    results["model_families"] = model_families.main(options.train_steps)


def run_torch(results: dict, options: argparse.Namespace) -> None:
    print("== torch.autocast on the same architectures: saved-tensor bytes vs its own float32 ==")
    if not torch_autocast.available():
        print("(PyTorch not installed: pip install -e '.[bench-torch]' for this column)")
        return
    results["torch"] = torch_ratios = torch_autocast.main()
    # torch's model name -> (section, amp's model name, the section's activation-bytes key)
    ours = {
        "GPT small (demo)": ("models", "GPT small", "activation_bytes"),
        "GPT 4L d128": ("models", "GPT", "activation_bytes"),
        "CNN BatchNorm": ("model_families", "CNN BatchNorm", "act"),
        "CNN GroupNorm": ("model_families", "CNN GroupNorm", "act"),
    }
    print(f"\n{'model':17} {'torch.autocast':>14} {'amp':>6}   (activation bytes / own float32)")
    for name, r in torch_ratios.items():
        section, model, key = ours.get(name, (None, None, None))
        rows = results.get(section, {}).get(model)
        amp = f"{rows['amp bf16'][key] / rows['float32'][key]:6.2f}" if rows else f"{'-':>6}"
        print(f"{name:17} {r['ratio']:14.2f} {amp}")


def run_parallel(results: dict, options: argparse.Namespace) -> None:
    print("== tensor-parallel MLP on 8 simulated CPU devices (own process) ==")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "tp.json"
        done = subprocess.run(
            [sys.executable, str(HERE / "tensor_parallel.py"), "--json", str(out)],
            env={**os.environ, "JAX_PLATFORMS": "cpu"},
            text=True,
            capture_output=True,
        )
        print(done.stdout, end="")
        if done.returncode:
            raise RuntimeError(f"tensor_parallel.py failed:\n{done.stderr}")
        results["tensor_parallel"] = json.loads(out.read_text())


def run_trace(results: dict, options: argparse.Namespace) -> None:
    print("== trace overhead, 12-layer unrolled GPT: lowering and a gradient step's first call ==")
    results["trace_overhead"] = r = trace_overhead.measure(12, options.repeats)
    trace_overhead.report(r, 12, options.repeats)


def run_recompute(results: dict, options: argparse.Namespace) -> None:
    print("== recomputed chains kept apart from the forward pass: what it costs in time ==")
    results["recompute"] = recompute_cost.main(["--repeats", str(options.repeats)])


def run_third_party(results: dict, options: argparse.Namespace) -> None:
    print("== third-party code: error vs float32, bfloat16 compute ==")
    results["third_party"] = third_party.main()


def run_fp8(results: dict, options: argparse.Namespace) -> None:
    print("== float8 compute: amp fp8 vs amp bfloat16 ==")
    results["fp8"] = fp8_compute.main()


def run_gpu(results: dict, options: argparse.Namespace) -> None:
    print("== training steps at real sizes: GPT-2 small/medium, a 24x2048 decoder, ResNet-18 ==")
    if jax.default_backend() != "gpu":
        print("(no GPU: benchmarks/gpu_step.py runs these on one; --tiny runs it on a CPU)")
        return
    results["gpu_step"] = gpu_step.main(["--json", str(HERE / "gpu_step.json"), "--torch"])


def run_state(results: dict, options: argparse.Namespace) -> None:
    print("== training state in 16 and 8 bits: bytes per parameter, loss, update time ==")
    results["training_state"] = training_state.main([])


def run_diagnose(results: dict, options: argparse.Namespace) -> None:
    print("== the numerics debugger's cost: autocast.diagnose vs amp's first call, demo GPT ==")
    results["diagnose"] = diagnose_cost.main()


RUNNERS = {
    "jaxpr": run_jaxpr,
    "families": run_families,
    "torch": run_torch,
    "parallel": run_parallel,
    "trace": run_trace,
    "recompute": run_recompute,
    "third_party": run_third_party,
    "fp8": run_fp8,
    "state": run_state,
    "diagnose": run_diagnose,
    "step": run_step,
    "gpu": run_gpu,
}
SECTIONS = tuple(RUNNERS)


def main(argv: Sequence[str] | None = None) -> dict:
    """Runs the chosen sections; returns (and writes to ``--json``) their figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=str(HERE / "results.json"))
    parser.add_argument(
        "--only", default=",".join(SECTIONS), help=f"comma-separated: {', '.join(SECTIONS)}"
    )
    parser.add_argument(
        "--models", default="", help="comma-separated jaxpr/step model names (default: all)"
    )
    parser.add_argument("--repeats", type=int, default=15, help="trace-overhead repeats")
    parser.add_argument(
        "--step-repeats", type=int, default=20, help="timed gradient steps per variant"
    )
    parser.add_argument(
        "--train-steps", type=int, default=200, help="training steps per model-family run"
    )
    parser.add_argument(
        "--step-figures",
        action="store_true",
        help="measure step time and peak memory on any backend (default: on a GPU only)",
    )
    options = parser.parse_args(argv)
    options.models = [m for m in options.models.split(",") if m]
    chosen = [s for s in options.only.split(",") if s]
    unknown = sorted(set(chosen) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    results: dict = {"jax": jax.__version__, "backend": jax.default_backend()}
    for section in SECTIONS:
        if section not in chosen:
            continue
        if section == "step" and not (options.step_figures or jax.default_backend() == "gpu"):
            print("(no GPU: step time and peak memory run on one, or anywhere with --step-figures)")
            continue
        RUNNERS[section](results, options)
        print()
    Path(options.json).write_text(json.dumps(results, indent=1))
    print(f"figures written to {options.json}")
    return results


if __name__ == "__main__":
    main()
