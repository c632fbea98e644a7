"""``make bench``'s GPU path (step time, peak memory) runs on any backend with a flag, so the
first GPU it meets holds no surprise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import load_script

bench = load_script(Path(__file__).parents[1] / "benchmarks" / "bench.py")


def test_step_figures_run_on_this_backend_with_the_flag(tmp_path):
    out = tmp_path / "results.json"
    argv = ["--only", "step", "--step-figures", "--models", "MLP", "--step-repeats", "2", "--json", str(out)]
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
