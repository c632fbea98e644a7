"""Every cell of the support matrix (tests/support_matrix.py) is right against float32 or
refused as the table says, and docs/support_matrix.md is that table."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import support_matrix as matrix
from conftest import require, xla_flags

_HEAVY_TRANSFORMS = {"eager", "scan", "fori_loop", "cond", "accumulate"}


def _param(cell):
    heavy = "fp8 delayed" in cell or cell[3] in _HEAVY_TRANSFORMS
    # the training-state cells: one per state for f16 with the optax face and bf16
    # unscaled in the quick subset, the rest with the slow ones
    if cell[3] in matrix.STATES:
        heavy = (cell[1], cell[2]) not in (("f16", "optax face"), ("bf16", "none"))
    marks = [pytest.mark.slow] if heavy else []
    if not matrix.on_every_jax(cell):
        marks.append(pytest.mark.once)
    return pytest.param(cell, id="/".join(cell), marks=marks)


@pytest.mark.parametrize(
    "cell", [_param(c) for c in matrix.cells() if c[3] not in matrix.DEVICE_TRANSFORMS]
)
def test_cell(cell):
    framework = cell[0]
    if framework != "JAX":
        require(
            {
                "Flax Linen": "flax.linen",
                "Flax NNX": "flax.nnx",
                "Equinox": "equinox",
                "Haiku": "haiku",
            }[framework]
        )
    refusal = matrix.expected(cell)
    if refusal is not None:
        with pytest.raises(refusal.error, match=re.escape(refusal.says)):
            matrix.run_cell(cell)
        return
    figures = matrix.run_cell(cell)
    assert matrix.check(cell, figures) == [], figures


@pytest.mark.slow
@pytest.mark.parametrize(
    "every_jax", [True, pytest.param(False, marks=pytest.mark.once)], ids=["every JAX", "once"]
)
def test_cells_over_several_devices(every_jax):
    # one child process with 4 CPU devices runs them (a device count is fixed at start)
    env = {
        **os.environ,
        "XLA_FLAGS": xla_flags(f"--xla_force_host_platform_device_count={matrix.DEVICES}"),
        "JAX_PLATFORMS": "cpu",
    }
    done = subprocess.run(
        [sys.executable, matrix.__file__, "--device-cells", "every-jax" if every_jax else "once"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    want = {
        "/".join(c)
        for c in matrix.cells()
        if c[3] in matrix.DEVICE_TRANSFORMS and matrix.on_every_jax(c) == every_jax
    }
    assert set(results) == want
    assert {cell: p for cell, p in results.items() if p} == {}


def test_every_pair_of_the_plain_axes_is_a_cell():
    cells = set(matrix.cells())
    for c in matrix.COMPUTE:
        for s in matrix.SCALING:
            for t in matrix.TRANSFORMS + matrix.DEVICE_TRANSFORMS:
                assert ("JAX", c, s, t) in cells
        for f in matrix.FRAMEWORKS[1:]:
            assert any(cell[:2] == (f, c) for cell in cells)
        for tool in matrix.TOOLS:
            assert ("JAX", c, "none", tool) in cells


def test_the_cells_on_every_jax_meet_every_pair_of_the_cube_s_axes():
    kept = [c for c in matrix.cells() if matrix.on_every_jax(c)]
    cube = [
        c
        for c in matrix.cells()
        if c[0] == "JAX" and c[3] in matrix.TRANSFORMS + matrix.DEVICE_TRANSFORMS
    ]
    on_all = [c for c in cube if c in kept]
    assert len(on_all) * len(matrix.SCALING) == len(cube)
    for i, j in itertools.combinations(range(1, 4), 2):
        assert {(c[i], c[j]) for c in on_all} == {(c[i], c[j]) for c in cube}, (i, j)
    assert set(matrix.cells()) - set(cube) <= set(kept)


def test_the_docs_table_is_the_tests_table():
    page = Path(__file__).parents[1] / "docs" / "support_matrix.md"
    assert page.read_text() == matrix.markdown(), (
        "docs/support_matrix.md is out of date: "
        ".venv/bin/python tests/support_matrix.py > docs/support_matrix.md"
    )
