"""Walking a jaxpr: every equation, those of nested jaxprs included.

Kept below the rooms that read programs (float8's histories, the measurements of
``tools/``), so that none of them has to import another to walk one.
"""

from __future__ import annotations

from typing import Any, Iterator

from autocast import _compat


def equations(jaxpr: Any) -> Iterator[Any]:
    """Every equation of ``jaxpr`` (closed or open), sub-jaxprs included, depth first.

    >>> import jax
    >>> jaxpr = jax.make_jaxpr(jax.jit(lambda x: x * 2.0 + 1.0))(1.0)
    >>> [e.primitive.name for e in equations(jaxpr)][1:]
    ['mul', 'add']
    """
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in _compat.sub_jaxprs(eqn):
            yield from equations(sub)
