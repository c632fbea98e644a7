"""Multi-process training and checkpoint/resume, as jobs run on several hosts.

tests/multiprocess_child.py is run as 2 local processes joined by ``jax.distributed`` (gloo
CPU collectives, 2 host devices each, a global mesh of 4) and as 1 process with 4 devices.
The two must take the same decisions (the same skipped steps, the same loss scales) and
reach the same parameters, to float32 rounding: the cross-process all-reduce may add in
another order. Each also saves its state at step 10 with orbax, and a fresh job restores it
and runs to step 20: that must give the uninterrupted run's state bit for bit.

docs/scaling_out.md's example is run as 2 processes here as well, on every JAX that CI tests
(jax.distributed, gloo, an orbax checkpoint restored bit for bit):
test_the_scaling_out_page_s_example_runs_as_two_processes. The jobs above, a dozen
configurations (state_shardings over processes, float8 histories, a resume in a fresh job),
are once: make test runs them, a minute of both cores on a 2-core machine.
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import COMPILE_FAST

pytest.importorskip("orbax.checkpoint")

pytestmark = pytest.mark.slow  # runs subprocesses: make test-fast leaves it out

ROOT = Path(__file__).parents[1]
CHILD = Path(__file__).parent / "multiprocess_child.py"
TIMEOUT = 420  # seconds for one job; a 2-core machine running other tests is slow
# How far the parameters of 2 processes may be from 1 process's, relative to the largest.
# Under jit, XLA all-reduces the float16 partial sums of the weight gradients (amp keeps
# collectives in 16 bits), and 2 processes add them in another order (each process's 2
# devices first): float16 rounding, which adam's normalisation carries into the update
# (measured: 4e-5 of 1 after 6 steps). shard_map's cases take a float32 pmean: float32
# rounding (measured: bit-identical).
TOLERANCE = {
    "case_dp_optax": 1e-3,
    "case_fsdp_jmp": 1e-3,
    "case_shard_map_jaxamp": 1e-5,
    "case_fp8_delayed": 1e-5,
    # bfloat16 parameters rounded stochastically: where the gradients differ in their last
    # float16 bits, an element may round to the other neighbour, one bfloat16 spacing
    # (2**-8 of it) away
    "case_fsdp_state16": 2**-7,
}
COMPARISONS = tuple(TOLERANCE)
CHECKPOINTS = ("ck_bf16", "ck_f16_jaxamp", "ck_f16_optax", "ck_f16_jmp", "ck_state16", "ck_fp8")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def run_job(
    script: Path, processes: int, args: list[str], timeout: float = TIMEOUT, env: dict | None = None
) -> list[str]:
    """``script`` as ``processes`` local processes of one job (``MP_PROCESSES``, ``MP_ID``,
    ``MP_PORT`` set); their outputs, in process order. Fails with every process's output if
    one dies, or when the job outlives ``timeout`` (a process waiting on a dead peer would
    otherwise hang the suite)."""
    port = str(free_port())
    # the suite's compile flags, not a device count the parent may have been given
    extra, env = env or {}, {**os.environ, "XLA_FLAGS": COMPILE_FAST}
    env.update(
        {
            "JAX_PLATFORMS": "cpu",
            "MP_PROCESSES": str(processes),
            "MP_PORT": port,
            "PYTHONUNBUFFERED": "1",
        }
    )
    # the names docs/scaling_out.md's example reads, and the host devices it expects
    env.update({"COORDINATOR": f"localhost:{port}", "NUM_PROCESSES": str(processes), **extra})
    if script != CHILD:
        env["XLA_FLAGS"] = f"{COMPILE_FAST} --xla_force_host_platform_device_count={4 // processes}"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), *args],
            env={**env, "MP_ID": str(i), "PROCESS_ID": str(i)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(processes)
    ]
    outputs, failed = [], False
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, _ = p.communicate()
            out += f"\n[killed after {timeout} s]"
            failed = True
        outputs.append(out)
        failed |= p.returncode != 0
    if failed:
        shown = "\n".join(
            f"--- process {i} (exit {p.returncode}) ---\n{_tail(o)}"
            for i, (p, o) in enumerate(zip(procs, outputs))
        )
        pytest.fail(
            f"{script.name} as {processes} process(es) {' '.join(args)} failed:\n{shown}",
            pytrace=False,
        )
    return outputs


def _tail(text: str, lines: int = 60) -> str:
    kept = [line for line in text.splitlines() if "[Gloo]" not in line]
    return "\n".join(kept[-lines:])


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """The child's train and resume phases, as 1 process and as 2: run once per test session
    (pytest-xdist workers share them through a lock), results by process count."""
    session = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    base = tmp_path_factory.getbasetemp()
    root = (base.parent / f"multiprocess-{session}") if session else (base / "multiprocess")
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the first worker runs the jobs, the others wait
        done = root / "done.json"
        if not done.exists():
            # the 1-process and the 2-process job side by side: a worker waiting on the
            # lock would otherwise leave its core idle while one process compiles
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                for job in [pool.submit(_train_and_resume, root, n) for n in (1, 2)]:
                    job.result()
            done.write_text("{}")
    return root


def _train_and_resume(root: Path, processes: int) -> None:
    out, ckpt = root / f"out{processes}", root / f"ckpt{processes}"
    out.mkdir(exist_ok=True)
    ckpt.mkdir(exist_ok=True)
    for phase in ("train", "resume"):
        log = run_job(CHILD, processes, ["--out", str(out), "--ckpt", str(ckpt), "--phase", phase])
        (out / f"{phase}.log.json").write_text(json.dumps(log))


def _load(root: Path, processes: int, name: str) -> dict:
    with np.load(root / f"out{processes}" / f"{name}.npz") as f:
        return {k: f[k] for k in f.files}


def _logs(root: Path, processes: int, phase: str) -> list[str]:
    return json.loads((root / f"out{processes}" / f"{phase}.log.json").read_text())


@pytest.mark.once
@pytest.mark.parametrize("case", COMPARISONS)
def test_two_processes_train_as_one_process_on_as_many_devices(jobs, case):
    one, two = _load(jobs, 1, case), _load(jobs, 2, case)
    assert one.keys() == two.keys()
    # the same decisions: the poisoned example (on process 1's device) skipped step 2 in
    # both, and the scale moved alike
    assert np.array_equal(one["skipped"], two["skipped"]), (one["skipped"], two["skipped"])
    assert one["skipped"][1] == 0 and one["skipped"][2] == 1 and one["skipped"][-1] == 1, one[
        "skipped"
    ]
    assert np.array_equal(one["scale"], two["scale"]), (one["scale"], two["scale"])
    for key in one:
        if key not in ("skipped", "scale"):
            assert np.isfinite(one[key]).all(), f"{case}: {key} is not finite"
            atol = TOLERANCE[case] * np.abs(one[key]).max()
            np.testing.assert_allclose(
                two[key], one[key], rtol=0, atol=atol, err_msg=f"{case}: {key}"
            )


@pytest.mark.once
def test_every_process_took_the_same_decisions(jobs):
    for phase in ("train", "resume"):
        seen = [json.loads((jobs / "out2" / f"p{i}-{phase}.json").read_text()) for i in range(2)]
        assert seen[0] == seen[1], phase
    assert seen[0]["ck_f16_jmp_resume"]["['scale']/.loss_scale"] > 0
    train = json.loads((jobs / "out2" / "p1-train.json").read_text())
    assert train["case_dp_optax"]["skipped"][-1] == 1


@pytest.mark.once
def test_fp8_histories_of_two_processes_are_one_process_s(jobs):
    one, two = _load(jobs, 1, "case_fp8_delayed"), _load(jobs, 2, "case_fp8_delayed")
    # powers of two, from the largest amax over every device of both processes
    for key in ("amax0", "amax1", "measured"):
        assert np.array_equal(one[key], two[key]), key


@pytest.mark.once
def test_report_and_diagnose_work_in_a_multi_process_job_and_print_once(jobs):
    one, two = _load(jobs, 1, "case_tools"), _load(jobs, 2, "case_tools")
    assert float(two["report_share"]) == float(one["report_share"]) == 1.0
    np.testing.assert_allclose(two["diagnosis_errors"], one["diagnosis_errors"], rtol=1e-6)
    logs = _logs(jobs, 2, "train")
    # the tools print nothing themselves; process 0 prints their text, once in the job
    assert sum(len(re.findall(r"^REPORT amp precision report$", log, re.M)) for log in logs) == 1
    assert sum(len(re.findall(r"^DIAGNOSIS \d+ entries$", log, re.M)) for log in logs) == 1
    assert "REPORT" not in logs[1] and "DIAGNOSIS" not in logs[1]


@pytest.mark.once
@pytest.mark.parametrize("processes", (1, 2))
@pytest.mark.parametrize("case", CHECKPOINTS)
def test_resumed_from_a_checkpoint_runs_on_bit_for_bit(jobs, case, processes):
    whole, resumed = (
        _load(jobs, processes, f"{case}_train"),
        _load(jobs, processes, f"{case}_resume"),
    )
    assert whole.keys() == resumed.keys()
    for key in whole:
        assert whole[key].dtype == resumed[key].dtype, key
        # a NaN would make the comparison fail for another reason than the resume
        assert not np.issubdtype(whole[key].dtype, np.floating) or np.isfinite(whole[key]).all(), (
            key
        )
        assert np.array_equal(whole[key], resumed[key]), (
            f"{case}, {processes} process(es): {key} differs"
        )


@pytest.mark.once
def test_the_float8_checkpoint_kept_rows_init_could_not_measure(jobs):
    # the zero-initialised layer: init on the trained weights would now measure these rows
    measured = _load(jobs, 1, "ck_fp8_resume")["history__measured"]
    assert not measured.all(), measured


NOT_RUN_TWO = "<!-- not run: two processes, run by tests/test_multiprocess.py -->"


def test_the_scaling_out_page_s_example_runs_as_two_processes(tmp_path):
    text = (ROOT / "docs" / "scaling_out.md").read_text()
    block = re.search(re.escape(NOT_RUN_TWO) + r"\n```python\n(.*?)\n```", text, re.S)
    assert block, "docs/scaling_out.md lost its two-process example"
    script = tmp_path / "train.py"
    script.write_text(block.group(1))
    outputs = run_job(script, 2, [], env={"CKPT_DIR": str(tmp_path / "ckpt")})
    printed = [
        [
            line
            for line in out.splitlines()
            if not line.startswith("[Gloo]") and "WARNING" not in line
        ]
        for out in outputs
    ]
    assert "skipped 1 of 6 steps, loss scale 16384" in printed[0], outputs[0]
    assert "restored bit for bit" in printed[0], outputs[0]
    assert not any(line.startswith(("skipped", "restored")) for line in printed[1]), outputs[1]
