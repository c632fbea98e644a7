"""jax-autocast: automatic mixed precision for JAX.

Policies and casting helpers (``Policy``, ``get_policy``, ``cast_to_half``, ...) and loss-scale
objects (``DynamicLossScale``, ``all_finite``, ...) keep the names ``jmp`` made familiar, so
code written for ``jmp`` or ``neurai.mp`` ports by changing its import line.
"""

from autocast.loss_scale import (
    DynamicLossScale,
    LossScaleUpdate,
    NoOpLossScale,
    StaticLossScale,
    all_finite,
    next_loss_scale,
    select_tree,
)
from autocast.policy import (
    Policy,
    cast_to_full,
    cast_to_half,
    cast_tree,
    get_policy,
    half_dtype,
    parse_dtype,
)

__version__ = "0.1.0.dev0"

__all__ = [
    "DynamicLossScale",
    "LossScaleUpdate",
    "NoOpLossScale",
    "Policy",
    "StaticLossScale",
    "all_finite",
    "cast_to_full",
    "cast_to_half",
    "cast_tree",
    "get_policy",
    "half_dtype",
    "next_loss_scale",
    "parse_dtype",
    "select_tree",
]
