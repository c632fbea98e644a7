"""The install line of the README, as a user runs it: a wheel built from the repository and
installed into a fresh virtual environment, where ``import autocast`` and each extra's entry
point work (the extras' packages come from this suite's environment, so nothing is
downloaded but the build backend)."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

# slow: builds a wheel and a virtual environment; once: what the wheel holds and how it
# installs is the same whatever JAX the suite runs on (make test-oldest and make test-newest
# leave out the 25 s it costs)
pytestmark = [pytest.mark.slow, pytest.mark.once]

ROOT = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("install")
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "-q",
            "-w",
            str(tmp / "dist"),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp / "dist").glob("jax_autocast-*.whl")
    env = tmp / "env"
    venv.EnvBuilder(with_pip=True).create(env)
    python = env / "bin" / "python"
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # the dependencies from this suite's environment, after the wheel's own site-packages (a
    # path in a .pth file is searched, its own .pth files are not: this suite's editable
    # install of autocast stays out)
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    (Path(site) / "suite_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return wheel, python


def _run(python: Path, code: str) -> str:
    done = subprocess.run(
        [str(python), "-c", code], capture_output=True, text=True, timeout=300, cwd="/"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def test_the_wheel_ships_the_package_its_types_and_its_extras(installed):
    wheel, _ = installed
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        metadata = next(z.read(n).decode() for n in names if n.endswith("METADATA"))
    assert "autocast/__init__.py" in names and "autocast/py.typed" in names
    assert not any(n.startswith(("tests/", "benchmarks/")) for n in names)
    extras = {
        line.split(": ", 1)[1]
        for line in metadata.splitlines()
        if line.startswith("Provides-Extra")
    }
    assert {"optax", "checkpoint", "demo"} <= extras


def test_a_users_script_runs_from_the_installed_wheel(installed):
    _, python = installed
    out = _run(
        python,
        "import autocast, jax, jax.numpy as jnp\n"
        "assert 'site-packages' in autocast.__file__, autocast.__file__\n"
        "f = autocast.amp(lambda w, x: jnp.sum(jnp.tanh(x @ w)), compute_dtype=jnp.bfloat16)\n"
        "print(jax.grad(f)(jnp.ones((16, 16)), jnp.ones((4, 16))).dtype)\n",
    )
    assert out == "float32"


def test_each_extras_entry_point_works_there(installed):
    _, python = installed
    # optax: the loss-scaling wrapper
    assert (
        _run(
            python,
            "import autocast.optax, optax, jax.numpy as jnp\n"
            "tx = autocast.optax.dynamic_loss_scaling(optax.sgd(0.1))\n"
            "print(float(autocast.optax.loss_scale_of(tx.init(jnp.ones(2))).loss_scale))\n",
        )
        == "32768.0"
    )
    # checkpoint: a loss scale saved and restored with orbax
    assert (
        _run(
            python,
            "import tempfile, autocast, orbax.checkpoint as ocp, jax.numpy as jnp\n"
            "state = {'scale': autocast.DynamicLossScale(jnp.float32(1024.0))}\n"
            "with tempfile.TemporaryDirectory() as d:\n"
            "    ocp.PyTreeCheckpointer().save(d + '/s', state)\n"
            "    back = ocp.PyTreeCheckpointer().restore(d + '/s', item=state)\n"
            "print(float(back['scale'].loss_scale))\n",
        )
        == "1024.0"
    )
    # demo: the command line
    help_text = _run(
        python,
        "import runpy, sys; sys.argv = ['autocast', 'demo', '--help']\n"
        "try:\n    runpy.run_module('autocast', run_name='__main__')\n"
        "except SystemExit:\n    pass\n",
    )
    assert "--steps" in help_text and "--out" in help_text
