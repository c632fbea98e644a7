"""The main job runs end to end (a few steps) and writes what it promises."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import autocast
from autocast._src.demo import run as demo


@pytest.mark.once
@pytest.mark.slow
def test_demo_runs_and_writes_table_plot_and_figures(tmp_path, capsys):
    results = demo.run(steps=12, out=tmp_path)
    printed = capsys.readouterr().out
    assert "amp float16 + scaling" in printed and "final loss" in printed
    assert set(results) == {
        "float32",
        "amp bfloat16",
        "amp float16 + scaling",
        "amp float8",
        "amp bf16, 16-bit state",
    }
    # float32 parameters, gradients and Adam's two moments: 16 bytes; all in bfloat16: 8
    assert abs(results["float32"]["state_bytes_per_param"] - 16) < 0.01
    assert abs(results["amp bf16, 16-bit state"]["state_bytes_per_param"] - 8) < 0.01
    assert np.isfinite(results["amp bf16, 16-bit state"]["final_loss"])
    assert (tmp_path / "demo.png").stat().st_size > 10_000
    saved = json.loads((tmp_path / "demo.json").read_text())
    assert saved["amp bfloat16"]["low_precision_flop_share"] >= 0.99
    assert saved["float32"]["low_precision_flop_share"] == 0.0
    # every weight product in float8; attention's batched products (8% here) in bfloat16
    assert 0.85 <= saved["amp float8"]["fp8_flop_share"] < 0.99
    assert saved["amp bfloat16"]["fp8_flop_share"] == 0.0
    assert "amp float8" in printed and "8-bit FLOPs" in printed
    assert len(saved["amp float16 + scaling"]["scales"]) == 12
    assert results["amp bfloat16"]["activation_bytes"] < results["float32"]["activation_bytes"]


def test_corpus_is_generated_and_learnable_text():
    text = demo.corpus(n_sums=50)
    assert set(text) <= set(demo.ALPHABET)
    first = text.split(";")[0]
    a, rest = first.split("+")
    b, c = rest.split("=")
    assert int(a) + int(b) == int(c)


def test_command_line():
    # the entry point; the training itself is the first test, its arguments the next one
    done = subprocess.run(
        [sys.executable, "-m", "autocast", "demo", "--help"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert "--steps" in done.stdout and "--out" in done.stdout


def test_command_line_passes_steps_and_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(demo, "run", lambda steps, out: print(f"run steps={steps} out={out}"))
    from autocast import __main__

    __main__.main(["demo", "--steps", "3", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert f"run steps=3 out={tmp_path}" in printed and f"written to {tmp_path}/" in printed


def test_command_line_version_defaults_and_missing_extra(monkeypatch, capsys):
    from autocast import __main__

    with pytest.raises(SystemExit):
        __main__.main(["--version"])
    assert capsys.readouterr().out.strip() == f"jax-autocast {autocast.__version__}"
    with pytest.raises(SystemExit):
        __main__.main(["diagnose", "--help"])
    assert "(default: float16)" in capsys.readouterr().out
    # without the demo extra: a clear message naming it, not a ModuleNotFoundError
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "optax" else real(name, *a)
    )
    with pytest.raises(SystemExit, match=r"needs optax.*pip install 'jax-autocast\[demo\]'"):
        __main__.main(["diagnose"])


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["demo", "--steps", "0"], "--steps must be a whole number of training steps >= 1, got 0"),
        (
            ["demo", "--steps", "-5"],
            "--steps must be a whole number of training steps >= 1, got -5",
        ),
        (["demo", "--out", "FILE"], "is a file; give a folder"),
        (["demo", "--out", "FILE/sub"], "cannot be made: "),
        (["demo", "--out", "FILE/sub/deeper"], "is a file, not a folder"),
        (["demo", "--out", "LOCKED/sub"], "is not writable"),
        (["demo", "--out", "/proc/autocast-demo"], "--out '/proc/autocast-demo' cannot be made"),
        (["diagnose", "--rows", "-3"], "--rows must be a number of table rows >= 1, got -3"),
    ],
)
def test_bad_arguments_get_one_line_and_nothing_runs_or_is_written(
    argv, says, tmp_path, monkeypatch
):
    existing = tmp_path / "figures.txt"
    existing.write_text("kept")
    locked = tmp_path / "locked"
    argv = [a.replace("FILE", str(existing)).replace("LOCKED", str(locked)) for a in argv]
    if any(str(locked) in a for a in argv):
        if os.geteuid() == 0:
            pytest.skip("root may write in any folder")
        locked.mkdir(mode=0o500)
    ran = []
    monkeypatch.setattr(demo, "run", lambda **kw: ran.append(kw))
    monkeypatch.setattr(demo, "diagnose_demo", lambda *a, **kw: ran.append(a))
    monkeypatch.chdir(tmp_path)
    from autocast import __main__

    with pytest.raises(SystemExit) as exit_:
        __main__.main(argv)
    message = str(exit_.value.code)
    assert says in message and "\n" not in message  # sys.exit(text): status 1, text on stderr
    assert ran == [] and existing.read_text() == "kept"
    assert sorted(tmp_path.iterdir()) == sorted([existing, *([locked] if locked.exists() else [])])
