"""``make bench``'s GPU path (step time, peak memory) runs on any backend with a flag, so the
first GPU it meets holds no surprise."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import load_script

# trains models or runs subprocesses: make test-fast leaves them out; the scripts measure, and
# do not hinge on the JAX version, so only make test runs them
pytestmark = [pytest.mark.slow, pytest.mark.once]

bench = load_script(Path(__file__).parents[1] / "benchmarks" / "bench.py")


def test_step_figures_run_on_this_backend_with_the_flag(tmp_path):
    out = tmp_path / "results.json"
    argv = [
        "--only",
        "step",
        "--step-figures",
        "--models",
        "MLP",
        "--step-repeats",
        "2",
        "--json",
        str(out),
    ]
    results = bench.main(argv)
    assert json.loads(out.read_text())["step"] == results["step"]
    assert set(results["step"]) == {"MLP"}
    for figures in results["step"].values():
        assert set(figures) == {"float32", "hand bf16", "amp bf16", "amp fp8"}
        for r in figures.values():
            assert r["step_ms"] > 0 and r["planned_peak_bytes"] > 0


def test_without_the_flag_a_cpu_skips_the_step_section(tmp_path, capsys):
    args = ["--only", "step", "--models", "MLP", "--step-repeats", "1"]  # short where a GPU runs it
    results = bench.main([*args, "--json", str(tmp_path / "r.json")])
    if results["backend"] == "cpu":
        assert "step" not in results and "--step-figures" in capsys.readouterr().out


def test_an_unknown_section_is_refused_by_name(tmp_path):
    with pytest.raises(SystemExit):
        bench.main(["--only", "jaxpr,warp", "--json", str(tmp_path / "r.json")])


training_state = load_script(Path(__file__).parents[1] / "benchmarks" / "training_state.py")


def test_the_training_state_benchmark_counts_bytes_and_trains_each_choice():
    chosen = ["float32", "f16 compute + scaling, bf16 state"]
    results = training_state.main(["--steps", "2", "--choices", ";".join(chosen), "--no-timing"])
    total = {k: v["total"] for k, v in results["bytes"].items()}
    # Adam: float32 16 bytes per parameter; bfloat16 parameters and moments 8; 8-bit moments
    # 6 and the block scales (4 bytes per 256 values of each moment)
    assert abs(total["float32"] - 16) < 1e-3
    assert abs(total["bf16 params SR, bf16 moments"] - 8) < 1e-3
    assert 6 < total["bf16 params SR, 8-bit moments"] < 6.04
    assert set(results["loss"]["demo GPT"]) == set(chosen)
    for r in results["loss"]["demo GPT"].values():
        assert np.isfinite(r["final_loss"]) and r["step_ms"] > 0
    eight_bit = training_state.CHOICES["bf16 params SR, 8-bit moments"]
    assert training_state.update_time(eight_bit, 4096, repeats=1) > 0


gpu_step = load_script(Path(__file__).parents[1] / "benchmarks" / "gpu_step.py")


def test_gpu_step_tiny_runs_each_variant_in_its_own_process(tmp_path):
    out = tmp_path / "gpu.json"
    argv = [
        "--tiny",
        "--models",
        "GPT-2 small,ResNet-18",
        "--variants",
        "amp bf16",
        "--attention",
        "fused",
        "--steps",
        "1",
        "--json",
        str(out),
    ]
    results = gpu_step.main(argv)
    assert json.loads(out.read_text()) == results
    assert set(results["GPT-2 small"]) == {"amp bf16 / fused"}
    assert set(results["ResNet-18"]) == {"amp bf16 / -"}
    for r in (*results["GPT-2 small"].values(), *results["ResNet-18"].values()):
        assert "error" not in r, r
        assert r["step_ms"] > 0 and r["tflops"] > 0 and r["peak_bytes"] > 0 and r["loss"] > 0


def test_gpu_step_covers_every_model_variant_and_attention():
    table = gpu_step.runs(list(gpu_step.MODELS), torch=True)
    gpt = [r for r in table if r[0] == "GPT-2 medium"]
    assert {(v, a) for _, v, a in gpt} == {
        (v, a)
        for v in (*gpu_step.GPT_VARIANTS, *gpu_step.TORCH_VARIANTS)
        for a in ("naive", "fused")
    }
    assert [v for m, v, _ in table if m == "ResNet-18"] == list(gpu_step.RESNET_VARIANTS)
    assert set(gpu_step.MODELS) == set(gpu_step.TINY)


def test_gpu_step_hand_cast_gpt_trains_in_process():
    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    r = gpu_step.run_jax(gpu_step.TINY["GPT-2 small"], "hand bf16", "naive", steps=1)
    assert r["loss"] > 0 and r["step_ms"] > 0
