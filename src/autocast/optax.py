"""The optax face of loss scaling and of 16- and 8-bit training state (needs the ``optax``
extra: ``pip install jax-autocast[optax]``).

``dynamic_loss_scaling`` wraps any optax optimizer: its state carries the loss scale, and
``update`` unscales the gradients, skips a step whose gradients are not all finite and
adjusts the scale. ``loss_scale_of`` reads the current scale, ``skipped_steps`` counts.

``low_precision_state`` stores any optimizer's state in bfloat16 or block-scaled float8 and
computes it in float32; ``stochastic_rounding`` and ``kahan_summation``, last in a chain,
let bfloat16 and float16 parameters learn from updates smaller than their spacing;
``state_shardings`` puts an optimizer state's arrays where their parameters are.
"""

try:
    import optax  # noqa: F401
except ImportError as e:
    raise ModuleNotFoundError(
        "autocast.optax needs optax, which the optax extra brings: "
        "pip install 'jax-autocast[optax]'",
        name="optax",
    ) from e

from autocast._src.scaling.optax import (  # noqa: E402
    LossScalingState,
    dynamic_loss_scaling,
    loss_scale_of,
    skipped_steps,
)
from autocast._src.state.blocks import BlockScaled  # noqa: E402
from autocast._src.state.moments import LowPrecisionState, low_precision_state  # noqa: E402
from autocast._src.state.params import (  # noqa: E402
    KahanState,
    StochasticRoundingState,
    kahan_summation,
    stochastic_rounding,
)
from autocast._src.state.sharding import state_shardings  # noqa: E402

__all__ = [
    "BlockScaled",
    "KahanState",
    "LossScalingState",
    "LowPrecisionState",
    "StochasticRoundingState",
    "dynamic_loss_scaling",
    "kahan_summation",
    "loss_scale_of",
    "low_precision_state",
    "skipped_steps",
    "state_shardings",
    "stochastic_rounding",
]
