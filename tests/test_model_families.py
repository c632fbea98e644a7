"""The model families of ``benchmarks/model_families.py`` held to their bounds: conv nets
with normalisation and a Flax Linen GPT keep 16-bit activations, and train like float32."""

from __future__ import annotations

import functools
from pathlib import Path

import jax.numpy as jnp
import pytest
from conftest import load_script

import autocast

# trains models or runs subprocesses: make test-fast leaves it out. A benchmark script's
# models, once: on every JAX, test_recompute holds conv, batch norm and relu layers to what they
# save for the backward pass, and test_examples runs Flax Linen's scanned remat blocks
pytestmark = [pytest.mark.slow, pytest.mark.once]

families = load_script(Path(__file__).parents[1] / "benchmarks" / "model_families.py")
FAMILIES = {name: (make, batches) for name, make, batches in families.families()}


@functools.cache
def measured(name: str) -> dict[str, dict]:
    """A family's measures, made when a test first asks."""
    return families.measure(*FAMILIES[name], steps=0)


@pytest.mark.parametrize("name", ["CNN BatchNorm", "CNN GroupNorm"])
def test_conv_nets_keep_activations_at_or_below_torch_autocast(name):
    rows = measured(name)
    amp, f32, own = rows["amp bf16"], rows["float32"], rows["own bf16"]
    assert amp["act"] <= 0.55 * f32["act"]  # torch.autocast keeps 0.55x on this net
    assert amp["act"] <= own["act"]
    assert amp["loss_dev"] < 0.02
    assert amp["grad_err"] < 0.1


def test_a_linen_gpt_with_embed_and_scanned_remat_blocks_keeps_16_bit_activations():
    rows = measured("Linen GPT")
    assert rows["amp bf16"]["act"] <= 0.7 * rows["float32"]["act"]
    assert rows["amp bf16"]["grad_err"] < 0.05


@pytest.mark.parametrize("name", ["CNN BatchNorm", "CNN GroupNorm"])
def test_conv_nets_train_200_steps_to_float32s_loss(name):
    make, batches = FAMILIES[name]
    loss, params, _, _ = families.setup(make, batches)
    f32 = families.train(loss, params, batches, steps=200)
    amp = families.train(autocast.amp(loss, compute_dtype=jnp.bfloat16), params, batches, steps=200)
    assert f32 < 0.8  # it learned: chance is ln 10 = 2.3
    assert abs(amp - f32) <= 0.02 * f32
