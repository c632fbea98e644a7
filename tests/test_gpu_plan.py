"""``make gpu-plan``: GPU programs compiled on a machine without a GPU, and read back.

The reader of XLA's dump (``autocast._src.tools.xla_program``) is tested on a small module
written here in XLA's text format; the whole tool runs where ``make gpu-plan`` built its venv (the
CUDA plugin is 5.5 GB, so the suite does not install it)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import (
    TPU_PLAN_VENV,
    gpu_plans,
    in_gpu_plan_venv,
    in_venv,
    needs_gpu_plan_venv,
    needs_tpu_plan_venv,
)

from autocast._src.tools import xla_program

ROOT = Path(__file__).parents[1]

# A forward float8 GEMM whose second scale is a constant 1, a loop that stacks a GEMM's
# output (twice), and a Triton GEMM fusion; the shapes are small so the figures are exact.
MODULE = (Path(__file__).parent / "gpu_plan_module.hlo.txt").read_text()

LIVE_RANGES = """\
HloLiveRange (max 9):
  Live ranges at 5 (peak):
    loop_dus_fusion{}: 128 bytes (cumulative: 128 bytes)
    a{}: 2048 bytes (cumulative: 2176 bytes)
  Stack trace breakdown for peak usage: 2 176 bytes
"""


@pytest.fixture
def program(tmp_path):
    (tmp_path / "module.sm_9.0a_gpu_after_optimizations.txt").write_text(MODULE)
    (tmp_path / "module.sm_9.0a_gpu_after_optimizations-live-range.txt").write_text(LIVE_RANGES)
    return xla_program.read(tmp_path)


def test_kernels_are_read_with_their_kind_runs_and_traffic(program):
    kernels = {k.name: k for k in program.kernels()}
    assert set(kernels) == {
        "cublas-gemm.1",
        "gemm_fusion",
        "loop_dus_fusion",
        "loop_slice_fusion",
        "loop_dus_bitcast_fusion",
        "cudnn-conv",
    }
    f8 = kernels["cublas-gemm.1"]
    assert f8.kind == "float8 cuBLASLt GEMM" and f8.runs == 1
    # operands 64*32 + 32*16 bytes and two f32 scalars; the f32 output without the workspace
    assert (f8.reads, f8.writes) == (2048 + 512 + 8, 64 * 16 * 4)
    assert f8.detail == "f8e4m3fnxf8e4m3fn -> f32, scales fused/1"
    assert f8.source == "model.py:12 (loss)"  # the user's frame, not the library's
    gemm = kernels["gemm_fusion"]
    assert (gemm.kind, gemm.runs, gemm.detail) == ("Triton GEMM fusion", 2, "bf16xbf16 -> bf16")
    # the matrix kernels' work: 2 x outputs x contraction, in the arithmetic of their operands
    assert (f8.flops, f8.math) == (2 * 64 * 16 * 32, "f8")
    assert (gemm.flops, gemm.math) == (2 * 4 * 8 * 16, "16-bit")
    conv = kernels["cudnn-conv"]
    # 2 x the output's 2048 elements x one output's 3 x 3 x 4 inputs
    assert (conv.kind, conv.flops, conv.math) == ("cuDNN convolution", 2 * 2048 * 36, "16-bit")
    assert kernels["loop_dus_fusion"].flops == 0
    # a loop's in-place update writes its slice and reads the slice's value, not the stack
    dus = kernels["loop_dus_fusion"]
    assert (dus.runs, dus.reads, dus.writes) == (2, 4 + 4 * 8 * 2, 4 * 8 * 2)
    # a slice of the stack read through a bitcast (a layer's weight in a scan) reads the slice
    sliced = kernels["loop_slice_fusion"]
    assert (sliced.runs, sliced.reads, sliced.writes) == (2, 4 + 32 * 2, 4 * 8 * 2)
    # and an update of the stack through a bitcast (a change of layout) is in place too
    updated = kernels["loop_dus_bitcast_fusion"]
    assert (updated.runs, updated.reads, updated.writes) == (2, 4 * 8 * 2 + 4, 4 * 8 * 2)


def test_the_peak_names_each_buffer_and_what_a_loop_stacks(program):
    assert program.peak_bytes == 2176
    stacked, argument = program.peak_buffers
    assert (stacked.nbytes, stacked.shape) == (128, "bf16[2,4,8]")
    assert stacked.made_by == "stacked by a loop: dot_general"
    assert stacked.source == "model.py:12 (loss)"
    assert (argument.made_by, argument.shape) == ("argument x", "f8e4m3fn[64,32]")


def test_measured_figures_are_those_of_the_docs_gpu_tables():
    # read off the source: importing the script would set JAX_PLATFORMS for this process
    source = (ROOT / "benchmarks" / "gpu_plan.py").read_text()
    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    tables = (
        ("MEASURED", "## On a GPU", 15),
        ("MEASURED_H100", "### An H100", 3),
        ("MEASURED_MS", "## On a GPU", 16),
        ("MEASURED_MS_H100", "### An H100", 3),
    )
    for name, section, rows in tables:
        table = source.split(f"{name} = {{")[1].split("}")[0]
        figures = re.findall(r"\): ([\d.]+),", table)
        gpu = docs.split(section)[1].split("\n#")[0]
        shown = [f"| {v} |" in gpu or f"| **{v}** |" in gpu for v in figures]  # bold: amp's
        assert len(figures) == rows and all(shown), name


class _Kernels:
    def __init__(self, *kernels):
        self._kernels = list(kernels)

    def kernels(self):
        return self._kernels


def test_the_time_estimate_is_the_roofline_with_an_efficiency_and_a_launch_cost():
    from autocast._src.tools import estimate

    # a float8 GEMM its arithmetic bounds, run twice, and an elementwise kernel of 3.35 GB
    gemm = xla_program.Kernel("Triton GEMM fusion", "g", 2, 10**6, 10**6, "", "", 10**12, "f8")
    fusion = xla_program.Kernel("fusion", "f", 1, 2 * 10**9, 135 * 10**7, "", "", 0, "")
    e = estimate.step_time(_Kernels(gemm, fusion), "h100")
    matrix, memory = 2 * 10**12 / 1979e12, 1e-3
    assert e.matrix_seconds == pytest.approx(matrix) and e.memory_seconds == pytest.approx(memory)
    assert e.roofline_seconds == pytest.approx(matrix + memory) and e.launches == 3
    assert e.seconds == pytest.approx(
        matrix / estimate.TENSOR_EFFICIENCY + memory + 3 * estimate.LAUNCH_SECONDS
    )
    # the H200 differs by its memory alone
    assert estimate.step_time(_Kernels(fusion), "h200").memory_seconds == pytest.approx(
        3.35e9 / 4.8e12
    )
    with pytest.raises(ValueError, match="h100, h200"):
        estimate.step_time(_Kernels(fusion), "a100")
    # a B200: its own peaks and memory (8 TB/s), Hopper's fitted constants
    b200 = estimate.step_time(_Kernels(gemm, fusion), "b200")
    assert b200.matrix_seconds == pytest.approx(2 * 10**12 / 4500e12)
    assert b200.memory_seconds == pytest.approx(3.35e9 / 8e12)


@pytest.mark.slow
@needs_gpu_plan_venv
def test_mxfp8_plans_as_float8_gemms_for_a_b200_and_is_refused_for_an_h100(tmp_path):
    rows = "GPT-2 small/amp mxfp8/fused;GPT-2 small/amp fp8 rowwise/fused"
    plans, _ = gpu_plans(tmp_path, "--tiny", "--devices", "B200", "--rows", rows)
    for variant in ("amp mxfp8", "amp fp8 rowwise"):
        gemms = plans[f"GPT-2 small / {variant} / fused / B200 / Triton GEMM on"]["gemms"]
        # every GEMM of the step multiplies float8 (attention's products are cuDNN's)
        assert gemms and all(g["detail"].startswith("f8") for g in gemms)
    # an H100 has no block-scaled GEMMs: refused, naming what runs there
    with pytest.raises(AssertionError, match="no block-scaled float8 GEMMs"):
        gpu_plans(tmp_path, "--tiny", "--devices", "H100", "--rows", rows.split(";")[0])


@pytest.mark.slow
@needs_gpu_plan_venv
def test_tiny_plans_compile_for_a_gpu_without_one(tmp_path):
    rows = "linear/fp8/-;GPT-2 small/amp bf16/fused"
    args = ["--tiny", "--devices", "H100", "--rows", rows, "--triton", "off"]
    plans, printed = gpu_plans(tmp_path, *args)
    linear = plans["linear / fp8 / - / H100 / Triton GEMM off"]
    gpt = plans["GPT-2 small / amp bf16 / fused / H100 / Triton GEMM off"]
    # the float8 products became float8 cuBLASLt GEMMs, and the attention cuDNN's kernel
    assert linear["kernels"]["float8 cuBLASLt GEMM"]["launches"] == 3
    assert gpt["kernels"]["cuDNN attention"]["launches"] >= 2
    for p in (linear, gpt):
        assert p["peak_mib"] > p["temporaries_mib"] > 0 and p["buffers"]
        # a time beside the memory: the roofline, and the estimate above it
        e = p["estimate"]
        assert e["ms"] > e["roofline_ms"] >= e["matrix_ms"] >= 0 and e["launches"] > 3
    assert "largest buffers live at the peak" in printed
    # current scaling reads each float8 operand once for its amax, in a kernel of its own;
    # a bfloat16 step has no such kernel
    prepared = linear["float8_preparation"]
    assert prepared["amax"]["launches"] >= 2 and prepared["amax"]["read_mib"] > 0
    assert not any(k["launches"] for k in gpt["float8_preparation"].values())
    assert "kernels that only prepare float8 operands" in printed


@pytest.mark.slow
@needs_tpu_plan_venv
def test_tiny_plans_compile_for_a_tpu_without_one(tmp_path):
    rows = "GPT-2 small/amp bf16/naive;ResNet-18/amp bf16/-"
    out = tmp_path / "plan.json"
    args = ["--target", "tpu", "--tiny", "--devices", "v5e", "--rows", rows, "--json", str(out)]
    printed = in_venv(TPU_PLAN_VENV, str(ROOT / "benchmarks" / "gpu_plan.py"), *args)
    plans = json.loads(out.read_text())
    gpt = plans["GPT-2 small / amp bf16 / naive / v5e"]
    resnet = plans["ResNet-18 / amp bf16 / - / v5e"]
    for p in (gpt, resnet):
        assert p["peak_mib"] > p["temporaries_mib"] > 0 and p["buffers"]
        # every dot and convolution of amp's steps takes bfloat16 operands
        assert set(p["products"]) == {"bf16 x bf16"}, p["products"]
    assert "products 21 bf16 x bf16" in printed


# Compiles for an H100 with no GPU: how many conversions a round trip through bfloat16 keeps,
# and how many round-to-nearest-even operations the training state's rounding keeps.
ROUNDING_FOR_A_GPU = """
import sys
sys.path.insert(0, sys.argv[1])
import gpu_plan, jax, jax.numpy as jnp
from autocast._src.state import rounding
where = gpu_plan.sharding("H100")
x = jax.ShapeDtypeStruct((1024,), jnp.float32)
def program(f):
    options = {"xla_gpu_autotune_level": 0}
    compiled = jax.jit(f).lower(*gpu_plan._placed((x,), where)).compile(compiler_options=options)
    return compiled.as_text()
print(program(lambda a: a.astype(jnp.bfloat16).astype(jnp.float32) * 2).count("convert("))
print(program(lambda a: rounding.round_onto(a, jnp.bfloat16)).count("round-nearest-even("))
"""


@needs_gpu_plan_venv
def test_a_gpu_program_keeps_the_training_states_rounding():
    # XLA for a GPU removes a conversion to bfloat16 and back (excess precision), which is why
    # the rounding is written in float32 and integer arithmetic alone
    printed = in_gpu_plan_venv("-c", ROUNDING_FOR_A_GPU, str(ROOT / "benchmarks"))
    round_trip_converts, roundings = map(int, printed.split())
    assert round_trip_converts == 0
    assert roundings == 1


# Compiles a float8 gradient step for an H100 with no GPU and prints the kernels that only
# prepare its float8 operands, by what they do.
PREPARATION_FOR_A_GPU = """
import json, sys, tempfile
sys.path.insert(0, sys.argv[1])
import gpu_plan, jax, jax.numpy as jnp, autocast
from autocast._src.tools import xla_program
where = gpu_plan.sharding("H100")
w = jax.ShapeDtypeStruct((256, 512), jnp.float32)
x = jax.ShapeDtypeStruct((128, 256), jnp.float32)
step = jax.grad(autocast.amp(lambda w, x: jnp.sum(jnp.tanh(x @ w) ** 2), compute_dtype="fp8"))
with tempfile.TemporaryDirectory() as dump:
    options = {"xla_gpu_autotune_level": 0, "xla_dump_to": dump}
    jax.jit(step).lower(*gpu_plan._placed((w, x), where)).compile(compiler_options=options)
    program = xla_program.read(dump)
print(json.dumps(xla_program.float8_preparation(program)))
"""


@needs_gpu_plan_venv
def test_the_plan_names_the_kernels_that_only_prepare_float8_operands():
    printed = in_gpu_plan_venv("-c", PREPARATION_FOR_A_GPU, str(ROOT / "benchmarks"))
    prepared = json.loads(printed.splitlines()[-1])
    # x and w each read for an amax; the weight written transposed for the backward GEMM
    assert prepared["amax"]["launches"] >= 2
    assert prepared["quantise"]["launches"] >= 1
    assert prepared["quantise, transposed"]["launches"] >= 1
    # the weight, f32[256, 512], is read whole to be quantised into the transposed layout
    assert prepared["quantise, transposed"]["read_mib"] >= 0.5
