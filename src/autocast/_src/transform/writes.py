"""Writes to Flax NNX variables inside ``amp``, carried out to the caller's variables.

``amp`` traces its function on copies of the arguments (``jax.tree_util`` rebuilds a module
around tracers), so a module that updates its own state while it runs (a call counter,
BatchNorm's running statistics) writes into the copy. Without ``amp`` the caller's module
would hold the new values, and NNX's transformations (``nnx.grad``, ``nnx.jit``) carry them
out; ``amp`` does the same: each variable whose value the function replaced becomes an output
of the trace, and its new value is set on the caller's variable after the call.

Only NNX variables are mutable state a JAX user expects to see changed; a plain dict or list
argument changed in place is dropped, as ``jax.jit`` drops it.
"""

from __future__ import annotations

import sys
from typing import Any


def _variable_type() -> Any:
    # flax is an optional extra: where no code has imported flax.nnx, no argument holds one
    nnx = sys.modules.get("flax.nnx")
    return getattr(nnx, "Variable", None)


def variables(tree: Any) -> list[Any]:
    """The NNX variables in ``tree``, in its flattening order (none where flax is unused)."""
    variable = _variable_type()
    if variable is None:
        return []
    import jax

    leaves = jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, variable))
    return [x for x in leaves if isinstance(x, variable)]


def value_of(variable: Any) -> Any:
    # flax 0.12 reads with get_value (its .value warns); flax 0.10 has only .value
    get = getattr(variable, "get_value", None)
    return get() if get is not None else variable.value


def set_value(variable: Any, value: Any) -> None:
    setter = getattr(variable, "set_value", None)
    if setter is not None:
        setter(value)
    else:
        variable.value = value
