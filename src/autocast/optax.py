"""The optax face of loss scaling (needs the ``optax`` extra: ``pip install jax-autocast[optax]``).

``dynamic_loss_scaling`` wraps any optax optimizer: its state carries the loss scale, and
``update`` unscales the gradients, skips a step whose gradients are not all finite and
adjusts the scale. ``loss_scale_of`` reads the current scale, ``skipped_steps`` counts.
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

__all__ = ["LossScalingState", "dynamic_loss_scaling", "loss_scale_of", "skipped_steps"]
