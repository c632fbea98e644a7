"""jmp's own test suite, run against autocast: the proof that jmp code ports by its import line.

The installed ``jmp`` wheel ships its tests (``jmp/_src/policy_test.py`` and
``jmp/_src/loss_scale_test.py``). At collection time this module finds them through the
package metadata (jmp itself is never imported), swaps their single ``from jmp._src import ...
as jmp`` line for ``import autocast as jmp``, executes them in a fresh module and runs every
method of their ``absltest``/``parameterized`` TestCase classes with ``unittest``, one pytest
item each. Nothing of jmp's is copied into this repository.

Every test must pass except the ones in ``EXPECTED_DIFFERENCES``: the places where autocast
differs from jmp on purpose (docs/migration.md explains each). Those are run too, must still
fail, and must fail with the documented symptom, so the list cannot go stale; they are then
reported as xfail with their reason.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
import types
import unittest
from pathlib import Path
from typing import Callable, NamedTuple

import jax
import numpy as np
import pytest
from conftest import require

import autocast

require("absl.testing.parameterized")

# The one line of each jmp test file that binds the name ``jmp``; it is replaced, nothing else.
SUITES = {
    "policy_test": "from jmp._src import policy as jmp",
    "loss_scale_test": "from jmp._src import loss_scale as jmp",
}
SWAPPED_IN = "import autocast as jmp  # swapped in by tests/test_jmp_suite.py"


class Difference(NamedTuple):
    """A jmp test that fails on purpose: why, and the text its failure must contain."""

    reason: str
    symptom: str
    applies: Callable[[], bool] = lambda: True


def _jmp_half_dtype_differs() -> bool:
    # jmp: bfloat16 on TPU, float16 everywhere else. autocast: bfloat16 wherever the backend
    # has bfloat16 arithmetic. On a TPU (or a pre-Ampere GPU) the two agree.
    platform = jax.local_devices()[0].platform
    jmp_choice = np.dtype("bfloat16") if platform == "tpu" else np.dtype("float16")
    return autocast.half_dtype() != jmp_choice


_STR_REASON = (
    "reads jmp's private table jmp._src.policy.dtype_to_names, which is not part of jmp's "
    "public API; autocast also prints float32 as 'f32' where jmp prints 'full' (both parse)"
)
_LEAVES_REASON = (
    "every field of an autocast loss scale is a pytree leaf (jmp keeps period and factor in "
    "the treedef and drops min_loss_scale on unflatten, which is jmp's checkpoint bug)"
)
_INT_SCALE_REASON = (
    "jmp warns about an integer loss_scale / min_loss_scale and keeps it integer; autocast "
    "converts it to float32 (the scale is always float32), so there is nothing to warn about"
)

EXPECTED_DIFFERENCES: dict[str, Difference] = {
    "policy_test::PolicyTest::test_half_dtype": Difference(
        "half_dtype() is bfloat16 on CPU and on GPUs with bfloat16 arithmetic; jmp returns "
        "float16 everywhere except on TPU",
        "AssertionError",
        _jmp_half_dtype_differs,
    ),
    **{
        f"policy_test::PolicyTest::test_str{i}": Difference(
            _STR_REASON, "has no attribute 'dtype_to_names'"
        )
        for i in range(5)
    },
    "loss_scale_test::LossScaleTest::test_static_empty_trees_StaticLossScale": Difference(
        "StaticLossScale(0) is refused (a zero scale zeroes every gradient), and the scale is a "
        "pytree leaf so that it survives jit and checkpoints",
        "loss_scale must be a positive finite number",
    ),
    "loss_scale_test::LossScaleTest::test_dynamic_loss_scale_tree": Difference(
        _LEAVES_REASON, "Lists differ"
    ),
    **{
        f"loss_scale_test::LossScaleTest::test_dynamic_loss_scale_raises_type_error_on_int_{arg}": (
            Difference(_INT_SCALE_REASON, "Warning not triggered")
        )
        for arg in ("loss_scale", "min_loss_scale")
    },
    "loss_scale_test::LossScaleTest::test_select_tree_rejects_non_scalar": Difference(
        "a non-boolean or non-scalar predicate raises TypeError naming the problem; jmp uses "
        "an assert, which raises AssertionError and vanishes under python -O",
        "TypeError: pred must be a boolean scalar",
    ),
}


def _test_file(name: str) -> Path:
    """The installed jmp test file, found from the distribution's file list (no import)."""
    try:
        dist = importlib.metadata.distribution("jmp")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("jmp is not installed", allow_module_level=True)
    for entry in dist.files or ():
        if entry.as_posix() == f"jmp/_src/{name}.py":
            return Path(str(dist.locate_file(entry)))
    pytest.skip(f"the installed jmp {dist.version} ships no {name}.py", allow_module_level=True)


def _load_on_autocast(name: str) -> types.ModuleType:
    """jmp's test module ``name``, executed with ``jmp`` bound to the autocast package."""
    path = _test_file(name)
    source = path.read_text()
    line = SUITES[name]
    if source.count(line) != 1:
        raise RuntimeError(f"{path} no longer has exactly one line {line!r}; update SUITES")
    source = source.replace(line, SWAPPED_IN)
    leftover = re.search(r"^\s*(from|import)\s+jmp\b.*$", source, re.MULTILINE)
    if leftover:
        raise RuntimeError(f"{path} still imports jmp after the swap: {leftover.group(0)!r}")
    module = types.ModuleType(f"_jmp_suite_on_autocast.{name}")
    module.__file__ = str(path)
    # absl looks test classes' modules up by name; the one-for-one line swap keeps jmp's line
    # numbers, so tracebacks point at the right line of jmp's own file.
    sys.modules[module.__name__] = module
    exec(compile(source, str(path), "exec"), module.__dict__)
    assert module.jmp is autocast
    return module


def _collect() -> dict[str, tuple[type, str]]:
    cases: dict[str, tuple[type, str]] = {}
    loader = unittest.TestLoader()
    for name in SUITES:
        module = _load_on_autocast(name)
        classes = [
            obj
            for obj in vars(module).values()
            if isinstance(obj, type)
            and issubclass(obj, unittest.TestCase)
            and obj.__module__ == module.__name__
        ]
        assert classes, f"no TestCase classes found in jmp's {name}"
        for cls in classes:
            for method in loader.getTestCaseNames(cls):
                cases[f"{name}::{cls.__name__}::{method}"] = (cls, method)
    return cases


CASES = _collect()


def _run(cls: type, method: str) -> unittest.TestResult:
    result = unittest.TestResult()
    cls(method).run(result)
    return result


def _failure_text(result: unittest.TestResult) -> str:
    return "\n".join(text for _, text in result.failures + result.errors)


def test_the_suite_was_found_and_swapped():
    assert len(CASES) > 90, len(CASES)  # jmp 0.0.4 has 97
    for key in EXPECTED_DIFFERENCES:
        assert key in CASES, f"{key} is listed as a difference but jmp has no such test"


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # jmp's own numpy
@pytest.mark.parametrize("key", list(CASES))
def test_jmp(key: str) -> None:
    cls, method = CASES[key]
    result = _run(cls, method)
    if result.skipped:
        pytest.skip(f"jmp's test skipped itself: {result.skipped[0][1]}")
    failure = _failure_text(result)
    difference = EXPECTED_DIFFERENCES.get(key)
    if difference is None or not difference.applies():
        if failure:
            pytest.fail(f"jmp's {key} fails on autocast:\n{failure}", pytrace=False)
        return
    if not failure:
        pytest.fail(
            f"jmp's {key} now passes on autocast: remove it from EXPECTED_DIFFERENCES and "
            "from docs/migration.md",
            pytrace=False,
        )
    if difference.symptom not in failure:
        pytest.fail(
            f"jmp's {key} fails, but not with the documented symptom {difference.symptom!r}:\n"
            f"{failure}",
            pytrace=False,
        )
    pytest.xfail(f"deliberate difference: {difference.reason}")


def test_the_suite_really_runs_autocast():
    """Guards the swap itself: the jmp test methods resolve ``jmp`` to the autocast package."""
    for cls, _ in CASES.values():
        assert vars(sys.modules[cls.__module__])["jmp"] is autocast, cls
    assert {cls.__module__ for cls, _ in CASES.values()} == {
        f"_jmp_suite_on_autocast.{name}" for name in SUITES
    }
