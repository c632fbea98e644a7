"""The runnable examples stay runnable (few steps)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

EXAMPLES = Path(__file__).parents[1] / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_float16_training_example_learns_like_float32():
    result = _load("float16_training").train(steps=60)
    f32, f16 = result["float32"], result["float16 amp"]
    assert f16["final_loss"] < 0.8 * f16["first_loss"]
    assert abs(f16["final_loss"] - f32["final_loss"]) <= 0.05 * f32["final_loss"]
    assert f16["scale"] > 0
