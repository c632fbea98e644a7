"""Shared helpers for the tests: walking jaxprs and reading dtypes off them."""

from __future__ import annotations

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


def jaxpr_of(fn: Callable[..., Any], *args: Any) -> Any:
    return jax.make_jaxpr(fn)(*args)


@pytest.fixture(autouse=True)
def _no_x64_leak():
    """Tests that enable float64 must restore the default; this catches ones that forget."""
    before = jax.config.jax_enable_x64
    yield
    assert jax.config.jax_enable_x64 == before
