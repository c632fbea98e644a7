"""Whether 16-bit parameters get a rounding step, and whether it comes last: a warning, once,
where autocast can see the chain.

Without :func:`~autocast.optax.stochastic_rounding` or :func:`~autocast.optax.kahan_summation`
last in the chain, ``optax.apply_updates`` rounds each bfloat16 parameter's update to
nearest and drops every update below half its spacing; a transformation placed after the
rounding step (``optax.add_decayed_weights``) changes the update that was to land exactly,
and the sum is rounded to nearest again. Neither raises, and both cost final loss.

What can be seen:

- ``dynamic_loss_scaling(inner)`` sees ``inner``'s whole state: a rounding step's state that
  is missing, or not the last of its ``optax.chain``, is told exactly.
- ``low_precision_state(opt)`` sits in the chain before the rounding step, and sees neither
  the chain nor what follows it. A rounding step records the shapes and dtypes of the
  16-bit parameters it is made for (at ``init``, which ``optax.chain`` calls after
  ``low_precision_state``'s); ``low_precision_state.update`` warns where no rounding step was
  made for its 16-bit parameters in this process. A misplaced step is not seen there.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import optax

import autocast
from autocast._src.state import rounding
from autocast._src.tree import is_floating_array

_ROUNDED: set[tuple] = set()  # the 16-bit parameter signatures a rounding step was made for
_WARNED: set[tuple] = set()

_FIX = (
    "put autocast.optax.stochastic_rounding(key) or autocast.optax.kahan_summation() last in "
    "the chain, after every transformation that changes the updates (the optimizer, "
    "optax.add_decayed_weights, clipping); docs/training_state.md"
)


def narrow_signature(params: Any) -> tuple:
    """The shapes and dtypes of ``params``' bfloat16 and float16 leaves, sorted: the same for
    an NNX module's variables and their values."""
    return tuple(
        sorted(
            (tuple(p.shape), jnp.dtype(p.dtype).name)
            for p in jax.tree_util.tree_leaves(params)
            if is_floating_array(p) and jnp.dtype(p.dtype) in rounding.PARAMETER_DTYPES
        )
    )


def note_rounding(params: Any) -> None:
    """Records that a rounding step was made for ``params``."""
    _ROUNDED.add(narrow_signature(params))


# Frames of these packages are left out of the line a warning names: the user's own line
# is the one that called into optax or autocast (a jitted step's update, a chain's init).
_LIBRARIES = tuple(
    os.path.dirname(m.__file__) + os.sep for m in (autocast, jax, optax) if m.__file__
)


def _user_frame() -> tuple[str, int]:
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARIES):
        frame = frame.f_back
    return ("<unknown>", 0) if frame is None else (frame.f_code.co_filename, frame.f_lineno)


def _warn(what: str, owner: str, signature: tuple) -> None:
    if (what, owner, signature) in _WARNED:
        return
    _WARNED.add((what, owner, signature))
    filename, lineno = _user_frame()
    warnings.warn_explicit(f"{owner}: {what}; {_FIX}", UserWarning, filename, lineno)


def _first(signature: tuple) -> str:
    shape, dtype = signature[0]
    more = f" and {len(signature) - 1} more" if len(signature) > 1 else ""
    return f"{dtype} parameters (one of shape {shape}{more})"


def warn_if_unrounded(params: Any, owner: str) -> None:
    """Warns, once, where ``params`` has 16-bit leaves and no rounding step was made for them."""
    signature = narrow_signature(params)
    if signature and signature not in _ROUNDED:
        _warn(
            f"{_first(signature)} and no rounding step was made for them: "
            "optax.apply_updates rounds their updates to nearest and drops those below half "
            "a spacing (2**-9 of a bfloat16 parameter)",
            owner,
            signature,
        )


def check_chain(state: Any, params: Any, owner: str, steps: dict[type, str]) -> None:
    """Warns, once, where ``params`` has 16-bit leaves and ``state`` (an optimizer's whole
    state) holds no rounding step's state, or holds one that is not the last of its chain
    (a plain tuple or a ``named_chain``'s dict, as optax builds them). ``steps``: the
    rounding steps' state types, with the names they are told by."""
    signature = narrow_signature(params)
    if not signature:
        return
    kinds = tuple(steps)
    found = []

    def walk(x: Any, last: bool) -> None:
        if isinstance(x, kinds):
            found.append((steps[type(x)], last))
        elif type(x) is tuple or isinstance(x, dict):
            children = list(x.values()) if isinstance(x, dict) else list(x)
            for i, child in enumerate(children):
                walk(child, last and i == len(children) - 1)
        elif isinstance(x, tuple):  # a NamedTuple state holds inner states in its fields
            for child in x:
                walk(child, last)

    walk(state, True)
    if not found:
        _warn(
            f"{_first(signature)} and no rounding step in the chain: optax.apply_updates "
            "rounds their updates to nearest and drops those below half a spacing",
            owner,
            signature,
        )
    for name, last in found:
        if not last:
            _warn(
                f"{name} is not the last transformation of its chain: what follows it "
                "changes the updates it made to land on the rounded parameters, and they are "
                "rounded to nearest again",
                owner,
                signature,
            )
