"""Every GPU (or TPU) program of the benchmarks, planned on a machine without one: the memory
XLA plans for it, the buffers live at its peak, and the kernels it chose.

Each row is compiled by ``autocast.plan`` (docs/planning.md), which compiles for a GPU or TPU
this machine does not have: with the CUDA plugin installed (``make gpu-plan`` builds
``.venv-gpu-plan``, the JAX of ``.venv`` and its plugin), compile-only devices made from a
device description (an H100 and an H200, from public figures) run XLA's whole GPU
pipeline: fusion, the GEMM rewriters, cuDNN's attention and convolutions, scheduling and
buffer assignment. Nothing runs, so time is only estimated from the kernels (a roofline,
and an estimate fitted to the steps GPUs measured: ``autocast._src.tools.estimate``,
``--measured`` checks it against them); autotuning is off (there is
no device to time kernels on), so where XLA would choose between a Triton GEMM and cuBLAS by
timing them, the plan shows its untuned choice (``--triton off`` shows
cuBLAS's). The memory plan is XLA's own: on an H200 it came within 2.5% of the device's
measured peaks.

Rows (``--rows MODEL/VARIANT/ATTENTION;...``, default :data:`DEFAULT_ROWS`):

- ``gpu_step.py``'s training steps (GPT-2 small and medium, the 24x2048 decoder, ResNet-18),
  built exactly as it builds them, with cuDNN's attention for "fused";
- ``MLP``: 512 -> 3 x 2048 (tanh GELU) -> 10 at batch 8192, unrolled, ``jit(grad(f))``;
  ``MLP timed``: ``recompute_cost.py``'s 256 -> 3 x 1024 -> 10 at the batch a GPU times it
  with (8192); ``amp bf16 merged`` leaves the recomputed chains for XLA to merge;
- ``linear``: one layer 8192 x 1024 -> 4096, forward and backward (``fp8_gemm.py``'s).

Per row and device it prints the planned peak (arguments + outputs + temporaries - aliased,
as ``compiled.memory_analysis()`` gives them) and the temporaries; the largest buffers live
at the peak (XLA's live ranges) with the shape, what made each (a loop's stacked residual
names what it stacks) and the user's line; the kernels by kind, with launches per step and
the bytes they read and write; each GEMM's output type and, for float8, whether its scales
are fused (a computed scale operand) or applied afterwards (a constant 1); and, where
docs/benchmarks.md has a device figure for the row, planned / measured.

``--tiny`` plans the CPU-sized models in seconds (the tests run it).

TPU targets (``--target tpu``, ``make tpu-plan``; ``.venv-tpu-plan`` holds libtpu): one chip
of a v5e, v5p or v6e host (``--devices v5e,v5p,v6e``), compile-only devices from
``jax.experimental.topologies``, the TPU compiler run whole. Per row: the planned peak and
temporaries, or the compiler's refusal with the bytes that did not fit; the largest buffers
live at the peak with the user's line; every dot and convolution by its operand types; the
compile time. "fused" attention on a TPU is ``jax.nn.dot_product_attention``'s XLA path;
"pallas" is the Pallas TPU flash-attention kernel, an entry point of amp
(``autocast.in_compute_dtype``), left out of ``--tiny``.
The compiler's time estimate (``cost_analysis()["optimal_seconds"]``) is left out: it came
back negative for scanned and float8 programs, and counts a loop body once.

Run: ``make gpu-plan`` or ``.venv-gpu-plan/bin/python benchmarks/gpu_plan.py [--tiny]
[--rows ...] [--devices H100,H200] [--triton on,off] [--json PATH]``; ``make tpu-plan`` or
``.venv-tpu-plan/bin/python benchmarks/gpu_plan.py --target tpu [--tiny] [--devices ...]``
"""

from __future__ import annotations

import os

# JAX starts on the CPU whatever plugins are installed: the GPU is only compiled for.
os.environ["JAX_PLATFORMS"] = "cpu"

import argparse  # noqa: E402
import collections  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Sequence  # noqa: E402

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

import gpu_step  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from autocast._src.tools import estimate, xla_program  # noqa: E402
from autocast._src.tools import plan as planning  # noqa: E402

MiB = 2**20
# B200 only when named (--devices): no GPU of it has measured these steps
DEVICES = ("H100", "H200", "B200")
# TPU targets: one chip each (autocast.plan's "tpu-v5e" and the others)
TPUS = ("v5e", "v5p", "v6e")

# Device peaks measured on one H200 (docs/benchmarks.md, "On a GPU"; JAX 0.11.2, the
# library at commit 2e4a7d8, before recomputed chains): MiB, by row.
MEASURED_ON = "H200"
MEASURED_AT = "2e4a7d8"
MEASURED = {
    ("GPT-2 small", "hand bf16", "fused"): 10457,
    ("GPT-2 small", "amp bf16", "fused"): 9015,
    ("GPT-2 small", "amp fp8", "fused"): 7994,
    ("GPT-2 small", "hand bf16", "naive"): 17325,
    ("GPT-2 small", "amp bf16", "naive"): 13571,
    ("GPT-2 medium", "hand bf16", "fused"): 23087,
    ("GPT-2 medium", "amp bf16", "fused"): 19244,
    ("GPT-2 medium", "amp fp8", "fused"): 17162,
    ("GPT-2 medium", "amp fp8 delay", "fused"): 17162,
    ("decoder 24x2048", "hand bf16", "fused"): 37580,
    ("decoder 24x2048", "amp bf16", "fused"): 33940,
    ("decoder 24x2048", "amp fp8", "fused"): 31424,
    ("decoder 24x2048", "amp fp8 delay", "fused"): 31261,
    ("ResNet-18", "flax bf16", "-"): 1667,
    ("ResNet-18", "amp bf16", "-"): 1720,
}
# Device peaks measured on one H100 (docs/benchmarks.md, "An H100, after recomputed chains";
# JAX 0.11.2, the library at commit 6b6f5fd): MiB, by row.
MEASURED_H100 = {
    ("GPT-2 medium", "amp bf16", "fused"): 9855,
    ("GPT-2 medium", "amp fp8", "fused"): 11469,
    ("decoder 24x2048 b8", "amp bf16", "fused"): 28532,
}
# Each device's measured peaks and the commit they were measured at.
MEASUREMENTS = {MEASURED_ON: (MEASURED_AT, MEASURED), "H100": ("6b6f5fd", MEASURED_H100)}
# Step times measured on the same two GPUs at the same commits (docs/benchmarks.md): ms, by
# row, the yardstick of the plan's time estimate.
MEASURED_MS = {
    ("GPT-2 small", "hand bf16", "fused"): 25.5,
    ("GPT-2 small", "amp bf16", "fused"): 24.1,
    ("GPT-2 small", "amp fp8", "fused"): 28.0,
    ("GPT-2 small", "hand bf16", "naive"): 47.0,
    ("GPT-2 small", "amp bf16", "naive"): 37.2,
    ("GPT-2 medium", "hand bf16", "fused"): 63.7,
    ("GPT-2 medium", "amp bf16", "fused"): 59.9,
    ("GPT-2 medium", "amp fp8", "fused"): 65.6,
    ("GPT-2 medium", "amp fp8 delay", "fused"): 66.1,
    ("GPT-2 medium", "amp fp8 dq", "fused"): 107.3,
    ("decoder 24x2048", "hand bf16", "fused"): 101.2,
    ("decoder 24x2048", "amp bf16", "fused"): 93.1,
    ("decoder 24x2048", "amp fp8", "fused"): 92.0,
    ("decoder 24x2048", "amp fp8 delay", "fused"): 93.4,
    ("ResNet-18", "flax bf16", "-"): 8.3,
    ("ResNet-18", "amp bf16", "-"): 8.5,
}
MEASURED_MS_H100 = {
    ("GPT-2 medium", "amp bf16", "fused"): 58.1,
    ("GPT-2 medium", "amp fp8", "fused"): 60.9,
    ("decoder 24x2048 b8", "amp bf16", "fused"): 157.6,
}
STEP_TIMES = {MEASURED_ON: MEASURED_MS, "H100": MEASURED_MS_H100}
# The rows a GPU has timed, for ``--measured``: every one on the device that timed it.
TIMED_ROWS = tuple((*row, device) for device, rows in STEP_TIMES.items() for row in rows)
# torch.compile's measured peaks on the same GPTs (the H200's run), the memory targets'
# yardstick.
TORCH_COMPILE = {"GPT-2 small": 7178, "GPT-2 medium": 14723}

# The models besides gpu_step.py's, real size and tiny.
MLP = {
    "MLP": dict(widths=(512, 2048, 2048, 2048, 10), batch=8192),
    "MLP timed": dict(widths=(256, 1024, 1024, 1024, 10), batch=8192),
}
MLP_TINY = {
    "MLP": dict(widths=(32, 64, 64, 64, 10), batch=64),
    "MLP timed": dict(widths=(16, 32, 32, 32, 10), batch=64),
}
LINEAR = {"linear": dict(tokens=8192, n_in=1024, n_out=4096)}
LINEAR_TINY = {"linear": dict(tokens=64, n_in=32, n_out=48)}
MLP_VARIANTS = ("float32", "amp bf16", gpu_step.MERGED_VARIANT)
LINEAR_VARIANTS = ("bf16", "fp8", "fp8 dq", "fp8 delay")

DEFAULT_ROWS = (
    *[
        (m, v, "fused")
        for m in ("GPT-2 small", "GPT-2 medium", "decoder 24x2048")
        for v in ("hand bf16", "amp bf16", "amp fp8", "amp fp8 delay")
    ],
    # float8's target is set at the decoder's batch 8 (docs/fp8.md)
    *[("decoder 24x2048 b8", v, "fused") for v in ("amp bf16", "amp fp8")],
    # the training state in fewer bits (docs/training_state.md)
    *[
        (m, v, "fused")
        for m in ("GPT-2 medium", "decoder 24x2048")
        for v in ("amp bf16 state16", "amp bf16 moments8")
    ],
    ("GPT-2 small", "hand bf16", "naive"),
    ("GPT-2 small", "amp bf16", "naive"),
    *[("ResNet-18", v, "-") for v in ("flax bf16", "amp bf16", "amp fp8")],
    *[("MLP", v, "-") for v in MLP_VARIANTS[:2]],
    *[("MLP timed", v, "-") for v in MLP_VARIANTS],
    *[("linear", v, "-") for v in LINEAR_VARIANTS],
)

# A TPU's rows (make tpu-plan): gpu_step.py's models with attention written out, through
# jax.nn.dot_product_attention (XLA's path there) and through the Pallas TPU flash-attention
# kernel ("pallas"), the variants the issue of TPU plans names.
TPU_ROWS = (
    *[
        (m, v, a)
        for m in ("GPT-2 small", "GPT-2 medium", "decoder 24x2048")
        for a in ("naive", "fused")
        for v in ("hand bf16", "amp bf16", "amp bf16 state16", "amp bf16 moments8")
    ],
    *[
        (m, v, "pallas")
        for m in ("GPT-2 small", "GPT-2 medium", "decoder 24x2048")
        for v in ("hand bf16", "amp bf16")
    ],
    *[("ResNet-18", v, "-") for v in ("float32", "flax bf16", "amp bf16")],
)


# ---- the devices -----------------------------------------------------------------------------


def target(device: str) -> str:
    """``autocast.plan``'s target for a device name of :data:`DEVICES` or :data:`TPUS`."""
    return ("tpu-" if device in TPUS else "gpu-") + device.lower()


@functools.lru_cache(maxsize=None)
def sharding(device: str) -> jax.sharding.NamedSharding:
    """A replicated sharding on one compile-only ``device`` (a name of :data:`DEVICES` or
    :data:`TPUS`; a TPU needs libtpu, ``make tpu-plan``'s venv)."""
    (chip,) = planning._devices(target(device))[0][:1]
    mesh = jax.sharding.Mesh(np.array([chip]), ("x",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def _placed(tree: Any, where: jax.sharding.NamedSharding) -> Any:
    def place(x: Any) -> Any:
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where)
        return x

    return jax.tree_util.tree_map(place, tree)


# ---- the programs ----------------------------------------------------------------------------


def _mlp(config: dict, variant: str) -> tuple[Callable, tuple]:
    from recompute_cost import mlp_loss

    import autocast

    widths, batch = config["widths"], config["batch"]
    gpu_step.recompute_for(variant)
    fn = mlp_loss
    if variant.startswith("amp"):  # a function of its own: amp shares traces per function
        fn = autocast.amp(lambda *a: mlp_loss(*a), compute_dtype=jnp.bfloat16)
    params = [
        (jax.ShapeDtypeStruct((a, b), jnp.float32), jax.ShapeDtypeStruct((b,), jnp.float32))
        for a, b in zip(widths[:-1], widths[1:])
    ]
    x = jax.ShapeDtypeStruct((batch, widths[0]), jnp.float32)
    y = jax.ShapeDtypeStruct((batch, widths[-1]), jnp.float32)
    return jax.jit(jax.grad(fn)), (params, x, y)


def _linear(config: dict, variant: str) -> tuple[Callable, tuple]:
    import _training

    import autocast
    from autocast._src.fp8 import products as fp8

    fp8._GEMM_FORM = "dequantised" if variant.endswith("dq") else "direct"
    f = lambda x, w: x @ w  # noqa: E731
    x = jax.ShapeDtypeStruct((config["tokens"], config["n_in"]), jnp.float32)
    w = jax.ShapeDtypeStruct((config["n_in"], config["n_out"]), jnp.float32)
    g = jnp.ones((config["tokens"], config["n_out"]), jnp.bfloat16)
    if variant == "fp8 delay":
        layer = autocast.amp_fp8_delayed(f, history=4)
        history = _training.planned_history(layer, x, w)

        def delayed(history: Any, x: jax.Array, w: jax.Array) -> Any:
            out, pull = jax.vjp(layer, history, x, w)
            return out, pull(g.astype(out.dtype))

        return jax.jit(delayed), (history, x, w)
    layer = autocast.amp(f, compute_dtype=jnp.bfloat16 if variant == "bf16" else "fp8")

    def step(x: jax.Array, w: jax.Array) -> Any:
        out, pull = jax.vjp(layer, x, w)
        return out, pull(g.astype(out.dtype))

    return jax.jit(step), (x, w)


def program(
    model: str, variant: str, attention: str, tiny: bool, gpu: bool = True
) -> tuple[Callable, tuple]:
    """The jitted function of one row and its abstract arguments; ``gpu`` False for a TPU
    (fused attention is then ``jax.nn.dot_product_attention``'s XLA path, not cuDNN's)."""
    if model in MLP:
        return _mlp((MLP_TINY if tiny else MLP)[model], variant)
    if model in LINEAR:
        return _linear((LINEAR_TINY if tiny else LINEAR)[model], variant)
    config = (gpu_step.TINY if tiny else gpu_step.MODELS)[model]
    if config["kind"] == "gpt":
        step, state, _ = gpu_step._gpt_step(config, variant, attention, abstract=True, gpu=gpu)
    else:
        step, state, _ = gpu_step._resnet_step(config, variant, abstract=True)
    return step, (*state, jax.ShapeDtypeStruct((), jnp.int32))


def known_rows() -> dict[str, tuple[str, ...]]:
    """Model -> the variants a row may name."""
    gpt = (
        *gpu_step.GPT_VARIANTS,
        gpu_step.MERGED_VARIANT,
        *gpu_step.FORM_VARIANTS,
        *gpu_step.SCALING_VARIANTS,
    )
    rows = {m: gpt for m, c in gpu_step.MODELS.items() if c["kind"] == "gpt"}
    rows["ResNet-18"] = gpu_step.RESNET_VARIANTS
    rows.update({m: MLP_VARIANTS for m in MLP})
    rows.update({m: LINEAR_VARIANTS for m in LINEAR})
    return rows


# ---- one plan --------------------------------------------------------------------------------


def plan(
    fn: Callable, args: tuple, device: str, triton: bool, buffers: int = 8, kernels: int = 8
) -> dict:
    """Compiles ``fn`` on ``args`` for ``device`` through ``autocast.plan`` and reads what XLA
    planned; for a program the compiler refuses (a TPU's, out of memory), ``{"refused": its
    message}``."""
    options = {} if device in TPUS else {"xla_gpu_enable_triton_gemm": triton}
    planned, read = planning._planned(
        fn, args, target(device), buffers=buffers, compiler_options=options
    )
    if read is None:
        return {"compile_s": planned.compile_seconds, "refused": planned.refusal}
    launched = read.kernels()
    by_kind: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for k in launched:
        row = by_kind[k.kind]
        row[0] += k.runs
        row[1] += k.runs * k.reads
        row[2] += k.runs * k.writes
    gemms = collections.Counter(
        (k.kind, k.detail, k.source) for k in launched for _ in range(k.runs) if k.detail
    )
    heaviest = sorted(launched, key=lambda k: -(k.reads + k.writes))[:kernels]
    return {
        "compile_s": planned.compile_seconds,
        "peak_mib": planned.peak_bytes / MiB,
        "arguments_mib": planned.argument_bytes / MiB,
        "outputs_mib": planned.output_bytes / MiB,
        "temporaries_mib": planned.temporary_bytes / MiB,
        "aliased_mib": planned.alias_bytes / MiB,
        "live_peak_mib": None if read.peak_bytes is None else read.peak_bytes / MiB,
        "buffers": [
            {"mib": b.nbytes / MiB, "shape": b.shape, "made_by": b.made_by, "source": b.where}
            for b in planned.buffers
        ],
        "kernels": {
            kind: {"launches": n, "read_mib": r / MiB, "written_mib": w / MiB}
            for kind, (n, r, w) in sorted(by_kind.items(), key=lambda kv: -kv[1][1] - kv[1][2])
        },
        "gemms": [
            {"kind": kind, "detail": detail, "source": source, "launches": n}
            for (kind, detail, source), n in gemms.most_common()
        ],
        "estimate": None if device in TPUS else _estimate(read, device),
        "float8_passes": xla_program.float8_passes(read),
        "float8_preparation": xla_program.float8_preparation(read),
        "products": dict(xla_program.product_operand_types(read).most_common()),
        "heaviest": [
            {
                "kind": k.kind,
                "name": k.name,
                "runs": k.runs,
                "read_mib": k.reads / MiB,
                "written_mib": k.writes / MiB,
                "source": k.source,
            }
            for k in heaviest
        ],
    }


def _estimate(read: xla_program.Program, device: str) -> dict:
    """The step's time estimated from its kernels (``autocast._src.tools.estimate``), ms."""
    e = estimate.step_time(read, device.lower())
    return {
        "ms": e.seconds * 1e3,
        "roofline_ms": e.roofline_seconds * 1e3,
        "matrix_ms": e.matrix_seconds * 1e3,
        "memory_ms": e.memory_seconds * 1e3,
        "launches": e.launches,
    }


# ---- the table -------------------------------------------------------------------------------


def _gemm_summary(p: dict, tpu: bool = False) -> str:
    """Launches per GEMM kind, float8 ones with their output type and scales; for a TPU's
    program, its dots and convolutions by operand types, and its compile time."""
    if tpu:
        products = "; ".join(f"{n} {types}" for types, n in p["products"].items())
        return f"products {products or 'none'}; compiled in {p['compile_s']:.0f} s"
    counts: collections.Counter = collections.Counter()
    for g in p["gemms"]:
        short = {
            "float8 cuBLASLt GEMM": "f8 cuBLASLt",
            "cuBLASLt GEMM": "cuBLASLt",
            "cuBLAS GEMM": "cuBLAS",
            "Triton GEMM fusion": "Triton",
        }[g["kind"]]
        types = g["detail"].split(",")[0]
        if "f8" in types:
            short += " " + types.replace(" ", "")
        if g["kind"] == "float8 cuBLASLt GEMM":
            short += f" scales {g['detail'].split('scales ')[-1]}"
        counts[short] += g["launches"]
    for kind in ("cuDNN attention", "cuDNN convolution", "cuDNN fusion"):
        if kind in p["kernels"]:
            counts[kind.replace("cuDNN ", "cuDNN ")] += p["kernels"][kind]["launches"]
    passes = p.get("float8_passes", {})
    counts["f8 copies"] += passes.get("copies", 0)
    counts["scalings after f8 GEMMs"] += passes.get("scalings", 0)
    for what, k in p.get("float8_preparation", {}).items():
        counts[f"f8 {what} passes"] += k["launches"]
    return "; ".join(f"{n} {k}" for k, n in counts.most_common() if n)


def _print_details(label: str, p: dict, measured: float | None, device: str) -> None:
    print(f"\n== {label}")
    line = (
        f"planned peak {p['peak_mib']:.0f} MiB (arguments {p['arguments_mib']:.0f}, outputs "
        f"{p['outputs_mib']:.0f}, temporaries {p['temporaries_mib']:.0f}, aliased "
        f"{p['aliased_mib']:.0f})"
    )
    if p["live_peak_mib"] is not None:
        line += f"; live at the peak {p['live_peak_mib']:.0f}"
    if measured:
        line += f"; measured {measured:.0f} on an {device} at {MEASUREMENTS[device][0]}"
    print(line + f"; compiled in {p['compile_s']:.1f} s")
    if p.get("estimate"):
        e = p["estimate"]
        print(
            f"  time estimate {e['ms']:.1f} ms; roofline {e['roofline_ms']:.1f} ms"
            f" ({e['matrix_ms']:.1f} in kernels their arithmetic bounds, {e['memory_ms']:.1f}"
            f" in kernels their bytes bound), {e['launches']} launches"
            + (f"; measured {p['measured_ms']} ms" if p.get("measured_ms") else "")
        )
    print("  largest buffers live at the peak:")
    for b in p["buffers"]:
        print(f"    {b['mib']:9.1f} MiB  {b['shape']:26} {b['made_by']:48.48} {b['source']}")
    print("  kernels per step:  launches  read MiB  written MiB")
    for kind, k in p["kernels"].items():
        print(f"    {kind:30.30} {k['launches']:6d} {k['read_mib']:10.0f} {k['written_mib']:11.0f}")
    read = sum(k["read_mib"] for k in p["kernels"].values())
    written = sum(k["written_mib"] for k in p["kernels"].values())
    print(f"    {'all kernels':30} {'':6} {read:10.0f} {written:11.0f}")
    preparation = {w: k for w, k in p.get("float8_preparation", {}).items() if k["launches"]}
    if preparation:
        print("  kernels that only prepare float8 operands:")
        for what, k in preparation.items():
            print(
                f"    {what:30.30} {k['launches']:6d} {k['read_mib']:10.0f}"
                f" {k['written_mib']:11.0f}"
            )
    if p["gemms"]:
        print("  GEMMs (launches per step, output type, float8 scale operands, line):")
        for g in p["gemms"]:
            print(f"    {g['launches']:4d} x {g['kind']:22} {g['detail']:44.44} {g['source']}")
    print("  heaviest kernels (one run; runs per step):")
    for k in p["heaviest"]:
        print(
            f"    {k['kind']:26.26} {k['name']:34.34} x{k['runs']:<3d} read {k['read_mib']:8.1f}"
            f" written {k['written_mib']:8.1f} MiB  {k['source']}"
        )


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="CPU-sized models (the tests run it)")
    parser.add_argument(
        "--rows", default="", help="'MODEL/VARIANT/ATTENTION;...' (default: every default row)"
    )
    parser.add_argument(
        "--target", default="gpu", choices=("gpu", "tpu"), help="the default devices and rows"
    )
    parser.add_argument(
        "--devices", default="", help=f"of {', '.join([*DEVICES, *TPUS])} (default: by --target)"
    )
    parser.add_argument(
        "--triton",
        default="",
        help="Triton GEMM fusions 'on', 'off' or 'on,off' (default: on; both for the linear rows)",
    )
    parser.add_argument(
        "--measured",
        action="store_true",
        help="every row a GPU has timed, on that GPU only (the time estimate's check)",
    )
    parser.add_argument("--brief", action="store_true", help="the table only, no details")
    parser.add_argument("--json", default="", help="default: benchmarks/{gpu,tpu}_plan.json")
    options = parser.parse_args(argv)
    options.json = options.json or str(HERE / f"{options.target}_plan.json")
    known = known_rows()
    rows = TPU_ROWS if options.target == "tpu" else DEFAULT_ROWS
    if options.tiny:  # the Pallas kernel's blocks are 128 long, a tiny model's sequence 32
        rows = tuple(r for r in rows if r[2] != "pallas")
    if options.rows:
        rows = []
        for text in options.rows.split(";"):
            parts = tuple(p.strip() for p in text.split("/"))
            if len(parts) != 3 or parts[1] not in known.get(parts[0], ()):
                parser.error(
                    f"--rows: {text!r} is not MODEL/VARIANT/ATTENTION; models and variants: "
                    + "; ".join(f"{m}: {', '.join(v)}" for m, v in known.items())
                )
            rows.append(parts)
    default = ",".join(TPUS) if options.target == "tpu" else "H100,H200"
    devices = [d.strip() for d in (options.devices or default).split(",") if d.strip()]
    unknown = [d for d in devices if d not in DEVICES and d not in TPUS]
    if unknown:
        parser.error(
            f"--devices: unknown {', '.join(unknown)}; choose from {', '.join([*DEVICES, *TPUS])}"
        )
    planned = [(*row, devices) for row in rows]
    if options.measured:
        planned = [(m, v, a, [d]) for m, v, a, d in TIMED_ROWS]
    settings = [s.strip() for s in options.triton.split(",") if s.strip()]
    if any(s not in ("on", "off") for s in settings):
        parser.error("--triton takes 'on', 'off' or 'on,off'")
    print(
        f"jax {jax.__version__}, compiled for {', '.join(devices)} with no GPU or TPU "
        "(a GPU's autotuning off)" + (", tiny models" if options.tiny else "")
    )
    results: dict[str, Any] = {}
    table = []
    for model, variant, attention, devices in planned:
        programs = {}
        tritons = settings or (["on", "off"] if model in LINEAR else ["on"])
        for device in devices:
            gpu = device not in TPUS
            if gpu not in programs:
                programs[gpu] = program(model, variant, attention, options.tiny, gpu=gpu)
            fn, args = programs[gpu]
            for triton in tritons if gpu else ["-"]:
                label = f"{model} / {variant} / {attention} / {device}" + (
                    f" / Triton GEMM {triton}" if gpu else ""
                )
                p = plan(fn, args, device, triton == "on")
                measured = None
                if not options.tiny and device in MEASUREMENTS and triton == "on":
                    measured = MEASUREMENTS[device][1].get((model, variant, attention))
                p["measured_mib"] = measured
                timed = STEP_TIMES.get(device, {}) if not options.tiny and triton == "on" else {}
                p["measured_ms"] = timed.get((model, variant, attention))
                results[label] = p
                if "refused" in p:
                    print(f"\n== {label}\nrefused by the compiler: {p['refused']}")
                elif not options.brief:
                    _print_details(label, p, measured, device)
                table.append((model, variant, attention, device, triton, p, measured))
                Path(options.json).write_text(json.dumps(results, indent=1))
    print(
        f"\n{'model':18} {'variant':16} {'attn':5} {'device':6} {'Triton':6} {'peak MiB':>9} "
        f"{'temp MiB':>9} {'measured':>8} {'plan/meas':>9} {'roof ms':>7} {'est ms':>7} "
        f"{'meas ms':>7} {'est/meas':>8}  GEMMs and cuDNN calls per step"
    )
    for model, variant, attention, device, triton, p, measured in table:
        if "refused" in p:
            print(
                f"{model:18} {variant:16} {attention:5} {device:6} {triton:6} "
                f"refused: {p['refused']}"
            )
            continue
        ratio = f"{p['peak_mib'] / measured:.3f}" if measured else "-"
        est = f"{p['estimate']['ms']:.1f}" if p.get("estimate") else "-"
        roof = f"{p['estimate']['roofline_ms']:.1f}" if p.get("estimate") else "-"
        timed = p.get("measured_ms")
        by = f"{p['estimate']['ms'] / timed:.2f}" if timed and p.get("estimate") else "-"
        print(
            f"{model:18} {variant:16} {attention:5} {device:6} {triton:6} {p['peak_mib']:9.0f} "
            f"{p['temporaries_mib']:9.0f} {measured or '-':>8} {ratio:>9} {roof:>7} {est:>7} "
            f"{timed or '-':>7} {by:>8}  " + _gemm_summary(p, device in TPUS)
        )
    if not options.tiny:
        print(
            "(measured: device peaks with JAX 0.11.2, "
            + ", ".join(f"an {d} at commit {c}" for d, (c, _) in MEASUREMENTS.items())
            + "; docs/benchmarks.md; torch.compile's on the H200: "
            + ", ".join(f"{m} {v} MiB" for m, v in TORCH_COMPILE.items())
            + ")"
        )
    if options.measured:
        _check_estimate(table)
    return results


# Pairs of variants whose order in time a device measured: (faster or slower, than).
_ORDERED = (("amp fp8", "amp bf16"), ("amp bf16", "hand bf16"), ("amp bf16", "flax bf16"))


def _check_estimate(table: list) -> None:
    """The time estimate against the measured steps: the ratios' range, the order of each
    measured pair as the roofline, the estimate and the device put it, and the estimate's two
    constants fitted afresh to the 16-bit steps (to set beside ``estimate``'s)."""
    timed = {
        (model, attention, device, variant): (p["estimate"], p["measured_ms"])
        for model, variant, attention, device, _, p, _ in table
        if p.get("estimate") and p.get("measured_ms")
    }
    for key in ("roofline_ms", "ms"):
        ratios = [e[key] / m for e, m in timed.values()]
        print(f"{key}: estimate / measured from {min(ratios):.2f} to {max(ratios):.2f}")
    print("order (a / b: roofline, estimate, measured):")
    for (model, attention, device, variant), (e, m) in timed.items():
        for a, b in _ORDERED:
            other = timed.get((model, attention, device, b))
            if variant != a or other is None:
                continue
            roof, est, meas = (
                e["roofline_ms"] / other[0]["roofline_ms"],
                e["ms"] / other[0]["ms"],
                m / other[1],
            )
            agree = "agrees" if (est > 1) == (meas > 1) else "disagrees"
            print(
                f"  {model} ({attention}) on an {device}, {a} / {b}: {roof:.2f}, {est:.2f},"
                f" {meas:.2f}"
                f" (the estimate {agree})"
            )
    sixteen = [(e, m) for (*_, v), (e, m) in timed.items() if "fp8" not in v]
    a = np.array([[e["matrix_ms"], e["launches"] * 1e-3] for e, _ in sixteen])
    y = np.array([m - e["memory_ms"] for e, m in sixteen])
    w = 1 / np.array([m for _, m in sixteen])
    (inverse, launch), *_ = np.linalg.lstsq(a * w[:, None], y * w, rcond=None)
    print(
        f"fitted to the {len(sixteen)} 16-bit steps: tensor efficiency {1 / inverse:.3f}, "
        f"{launch:.2f} us a launch (estimate.py: {estimate.TENSOR_EFFICIENCY}, "
        f"{estimate.LAUNCH_SECONDS * 1e6:.1f})"
    )


if __name__ == "__main__":
    main()
