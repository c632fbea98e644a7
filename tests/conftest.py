"""Shared helpers for the tests: walking jaxprs, reading dtypes off them, loading scripts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any, Callable

import jax
import pytest

from autocast import _measure


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


def jaxpr_of(fn: Callable[..., Any], *args: Any) -> Any:
    return jax.make_jaxpr(fn)(*args)


@pytest.fixture(autouse=True)
def _no_x64_leak():
    """Tests that enable float64 must restore the default; this catches ones that forget."""
    before = jax.config.jax_enable_x64
    yield
    assert jax.config.jax_enable_x64 == before
