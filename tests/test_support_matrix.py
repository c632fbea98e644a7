"""Every cell of the support matrix (tests/support_matrix.py) is right against float32 or
refused as the table says, and docs/support_matrix.md is that table."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import support_matrix as matrix
from conftest import require

_HEAVY_TRANSFORMS = {"eager", "scan", "fori_loop", "cond", "accumulate"}


def _param(cell):
    heavy = "fp8 delayed" in cell or cell[3] in _HEAVY_TRANSFORMS
    # the training-state cells: one per state for f16 with the optax face and bf16
    # unscaled in the quick subset, the rest with the slow ones
    if cell[3] in matrix.STATES:
        heavy = (cell[1], cell[2]) not in (("f16", "optax face"), ("bf16", "none"))
    return pytest.param(cell, id="/".join(cell), marks=[pytest.mark.slow] if heavy else [])


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
def test_cells_over_several_devices():
    # one child process with 4 CPU devices runs them all (a device count is fixed at start)
    env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={matrix.DEVICES}",
        "JAX_PLATFORMS": "cpu",
    }
    done = subprocess.run(
        [sys.executable, matrix.__file__, "--device-cells"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    want = {"/".join(c) for c in matrix.cells() if c[3] in matrix.DEVICE_TRANSFORMS}
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


def test_the_docs_table_is_the_tests_table():
    page = Path(__file__).parents[1] / "docs" / "support_matrix.md"
    assert page.read_text() == matrix.markdown(), (
        "docs/support_matrix.md is out of date: "
        ".venv/bin/python tests/support_matrix.py > docs/support_matrix.md"
    )
