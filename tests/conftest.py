"""Shared helpers for the tests: walking jaxprs, reading dtypes off them, loading scripts."""

from __future__ import annotations

import gc
import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

# Most of the suite's time is XLA compiling small CPU programs that then run a few times, and
# half of each compile is LLVM optimising machine code: the suite compiles at LLVM's -O0
# (XLA's passes over the program, hence every jaxpr, HLO and memory figure, are unchanged; a
# sample of the support matrix took 39 s instead of 66). Set before JAX starts its backend,
# in every xdist worker; the processes tests start inherit it through the environment.
LLVM_O0 = "--xla_backend_optimization_level=0"
# Of what is left, most is XLA's CPU fusion emitters (MLIR) on JAX 0.10: with the emitters
# they replaced (which fuse less) the suite compiles in about half the time
# (make test: 11m34s instead of 17m12s on JAX 0.10.2); jaxprs are the same, and the tests
# that read a CPU program's memory plan pass either way. JAX 0.6.2 takes the flag and changes
# nothing; JAX 0.12 no longer knows it and aborts on it, so the first process of a run asks a
# child whether its JAX starts with it, and the workers inherit the answer.
OLD_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
_SUITE_FLAGS = (LLVM_O0, OLD_EMITTERS)


def xla_flags(*flags: str) -> str:
    """``XLA_FLAGS`` with ``flags`` added to what the environment holds (the suite's
    ``COMPILE_FAST`` among it), for a process a test starts."""
    held = os.environ.get("XLA_FLAGS", "").split()
    return " ".join([*held, *(f for f in flags if f not in held)])


def jax_starts_with(flags: str, env: dict[str, str] | None = None) -> bool:
    """Whether this Python's JAX starts its CPU backend with ``XLA_FLAGS=flags`` in ``env``
    (default: this process's environment): XLA aborts on a flag it does not know, and which
    it knows changes from one JAX to the next."""
    env = {**(os.environ if env is None else env), "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    probe = [sys.executable, "-c", "import jax; jax.devices()"]
    return subprocess.run(probe, env=env, capture_output=True, timeout=300).returncode == 0


if LLVM_O0 not in os.environ.get("XLA_FLAGS", "").split():  # else a parent decided
    probed = [OLD_EMITTERS] if jax_starts_with(OLD_EMITTERS) else []
    os.environ["XLA_FLAGS"] = xla_flags(LLVM_O0, *probed)
# The suite's compile flags as this run holds them: what a process a test starts is given.
COMPILE_FAST = " ".join(f for f in os.environ["XLA_FLAGS"].split() if f in _SUITE_FLAGS)

# Tests compile the same small programs again and again (one test's model is another's, and
# each xdist worker compiles its own): one persistent compilation cache for the whole run,
# which its workers and the processes tests start share through the environment. Made by
# the process pytest starts in, before it starts the workers; removed when it ends.
_CACHE_MADE_HERE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
# every program goes into the cache, however small and quick to compile
_CACHE_SETTINGS = {
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
}
if _CACHE_MADE_HERE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="autocast-tests-xla-")
    os.environ.update(_CACHE_SETTINGS)
_SUITE_ONLY = ("JAX_COMPILATION_CACHE_DIR", "XLA_FLAGS", *_CACHE_SETTINGS)


def pytest_unconfigure(config: Any) -> None:
    if _CACHE_MADE_HERE and not hasattr(config, "workerinput"):
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


# Tracing and lowering make and drop objects by the million, and each of Python's full
# collections walked every object the imports made (JAX, Flax, the tests): 3.5% of a sample of
# tests (test_transform, test_regions, test_recompute on JAX 0.6.2: 2.6 s of 73). Collected
# less often, and with what exists after collection set aside, it took 0.7 s.
gc.set_threshold(50_000, 50, 100)


def pytest_collection_finish(session: Any) -> None:
    gc.collect()
    gc.freeze()


def users_environ() -> dict[str, str]:
    """The environment without what the suite adds to it (the compile flags, the shared
    cache): for a script that must run as a user runs it (the GPU plan reads XLA's dumps,
    which a cached program does not write)."""
    env = {k: v for k, v in os.environ.items() if k not in _SUITE_ONLY}
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if f not in _SUITE_FLAGS]
    return {**env, "XLA_FLAGS": " ".join(flags)} if flags else env


import jax  # noqa: E402 - after XLA_FLAGS, which the backend reads when it starts
import pytest  # noqa: E402

from autocast._src.tools import measure as _measure  # noqa: E402


def eqns_named(jaxpr: Any, name: str) -> list[Any]:
    """Every equation of primitive ``name`` in ``jaxpr``, sub-jaxprs included."""
    return [e for e in _measure.equations(jaxpr) if e.primitive.name == name]


def operand_dtypes(jaxpr: Any, name: str) -> list[tuple[str, ...]]:
    """The operand dtype names of each ``name`` equation, sub-jaxprs included."""
    return [tuple(v.aval.dtype.name for v in e.invars) for e in eqns_named(jaxpr, name)]


def load_script(path: Path) -> Any:
    """A repository script (an example, a benchmark) imported as a module by its path."""
    spec = importlib.util.spec_from_file_location(f"{path.parent.name}.{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses (Linen modules) look their module up there
    spec.loader.exec_module(module)
    return module


def division_ulps() -> int:
    """Units in the last place a float32 division may be off on this backend: none on a CPU,
    whose XLA rounds it correctly; two elsewhere (XLA compiles it for an NVIDIA GPU to PTX's
    ``div.full.f32``, documented within 2 ulp, as make gpu-plan's venv shows; on an H200
    the loss scaler's ``scale / factor`` came out one unit off)."""
    return 0 if jax.default_backend() == "cpu" else 2


def require(module: str) -> Any:
    """``module`` imported, or the test skipped with the reason. A package that does not
    support the installed JAX can fail at import with other errors than ImportError (Haiku
    0.0.16 on JAX 0.11 reads ``jax.core.DropVar``, which 0.11 removed)."""
    try:
        return importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - any failure at import means "not usable here"
        pytest.skip(
            f"{module} does not import with JAX {jax.__version__}: {type(e).__name__}: {e}",
            allow_module_level=True,
        )


def program_text(fn: Callable[..., Any], *args: Any) -> str:
    """The HLO XLA compiles ``jax.jit(fn)`` to for ``args``, optimised, without source
    information: two functions with equal texts run the same program on any backend."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    text = re.sub(r", metadata=\{.*?\}", "", text)
    lines = text.splitlines()
    # from the first computation on: the header and the source tables name files and frames
    first = next(i for i, line in enumerate(lines) if line.startswith(("%", "ENTRY")))
    text = "\n".join(lines[first:])
    # names carry counters that depend on what XLA removed on the way: number them afresh
    names: dict[str, str] = {}
    return re.sub(
        r"%?[A-Za-z_][\w\-]*(?:\.\d+)+",
        lambda m: names.setdefault(m.group(0), f"v{len(names)}"),
        text,
    )


# XLA evaluates a program deterministically on the CPU. A GPU's scatter-adds (an embedding's
# gradient) use atomics whose order varies from run to run, so there the same program gives
# values equal to float32 rounding, not bit for bit.
DETERMINISTIC = jax.default_backend() == "cpu"


def bind_closed_call(closed: Any, x: Any) -> Any:
    """``closed`` evaluated on ``x`` through JAX's call primitive (``closed_call``, named
    ``eval_jaxpr`` after JAX 0.11.0), as a library that stages calls would bind it."""
    from jax.extend.core import primitives

    prim = primitives.closed_call_p
    bind_params = prim.get_bind_params({"call_jaxpr": closed})
    if isinstance(bind_params, tuple):  # JAX 0.6
        return prim.bind(*bind_params[0], x, **bind_params[1])[0]
    return prim.bind(x, **bind_params)[0]


def hijax_base() -> Any:
    """JAX's base class for a user's hijax operation; skips where the installed JAX has none."""
    hijax = pytest.importorskip("jax.experimental.hijax")
    base = getattr(hijax, "HiPrim", None) or getattr(hijax, "VJPHiPrimitive", None)
    if base is None:
        pytest.skip(f"JAX {jax.__version__} has no hijax operations")
    return base


def hijax_cube() -> Any:
    """A user's hijax operation that carries nothing: ``Cube(jax.typeof(x))(x)`` is x**3."""

    class Cube(hijax_base()):
        def __init__(self, aval: Any):
            self.in_avals, self.out_aval, self.params = (aval,), aval, {}
            super().__init__()

        def expand(self, x: Any) -> Any:
            return x * x * x

    return Cube


def jaxpr_of(fn: Callable[..., Any], *args: Any) -> Any:
    return jax.make_jaxpr(fn)(*args)


@pytest.fixture(autouse=True)
def _no_x64_leak():
    """Tests that enable float64 must restore the default; this catches ones that forget."""
    before = jax.config.jax_enable_x64
    yield
    assert jax.config.jax_enable_x64 == before


ROOT = Path(__file__).parents[1]
# jax.jit's compiler_options for a loop of thirty steps or more: LLVM's full optimisation,
# as the benchmarks' training runs ask for it (the steps run faster than at COMPILE_FAST)
FULL_OPTIMISATION = load_script(ROOT / "benchmarks" / "_training.py").FULL_OPTIMISATION
# make gpu-plan's venv: JAX with its CUDA plugin, which compiles for a GPU without one
GPU_PLAN_VENV = ROOT / ".venv-gpu-plan"
TPU_PLAN_VENV = ROOT / ".venv-tpu-plan"


def _needs_venv(venv: Path, target: str) -> Callable[[Callable], Callable]:
    def mark(test: Callable) -> Callable:
        built = (venv / ".installed").exists()
        skip = pytest.mark.skipif(not built, reason=f"make {target} builds {venv.name}")
        return pytest.mark.once(skip(test))

    return mark


# Mark a test that runs in make gpu-plan's (tpu-plan's) venv: skipped where it is not built,
# and once (its JAX is .venv's whichever suite runs the test).
needs_gpu_plan_venv = _needs_venv(GPU_PLAN_VENV, "gpu-plan")
needs_tpu_plan_venv = _needs_venv(TPU_PLAN_VENV, "tpu-plan")


def in_venv(venv: Path, *args: str) -> str:
    """``python *args`` in ``venv`` (a plan's), with this tree's autocast: what it printed.
    libtpu takes a lock file that a second process would fail on (tests run in parallel)
    unless told several may load it."""
    done = subprocess.run(
        [str(venv / "bin" / "python"), *args],
        capture_output=True,
        text=True,
        env={
            **users_environ(),
            "PYTHONPATH": str(ROOT / "src"),
            "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
            "JAX_PLATFORMS": "cpu",
        },
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def in_gpu_plan_venv(*args: str) -> str:
    """``python *args`` in make gpu-plan's venv, with this tree's autocast: what it printed."""
    return in_venv(GPU_PLAN_VENV, *args)


def gpu_plans(tmp_path: Path, *args: str) -> tuple[dict, str]:
    """``benchmarks/gpu_plan.py *args`` run in make gpu-plan's venv: (its plans by row, what
    it printed)."""
    out = tmp_path / "plan.json"
    printed = in_gpu_plan_venv(str(ROOT / "benchmarks" / "gpu_plan.py"), *args, "--json", str(out))
    return json.loads(out.read_text()), printed
