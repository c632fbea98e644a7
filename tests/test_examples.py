"""The runnable examples stay runnable and keep showing what they claim (few steps)."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import eqns_named, jaxpr_of, load_script, operand_dtypes, require

pytestmark = pytest.mark.slow  # trains models or runs subprocesses: make test-fast leaves it out

EXAMPLES = Path(__file__).parents[1] / "examples"


def _load(name: str):
    return load_script(EXAMPLES / f"{name}.py")


def _learns_like_float32(f32: list[float], amp: list[float], rtol: float = 0.05) -> None:
    """amp learns, and ends within ``rtol`` of float32's loss; a loss that both drove close
    to zero is compared against 1% of the starting loss instead."""
    assert amp[-1] < 0.8 * amp[0]
    assert abs(amp[-1] - f32[-1]) <= max(rtol * f32[-1], 0.01 * f32[0])


def test_every_example_is_listed_and_tested():
    listed = (EXAMPLES / "README.md").read_text()
    tests = Path(__file__).read_text()
    for script in EXAMPLES.glob("*.py"):
        assert f"({script.name})" in listed, script.name
        assert f'_load("{script.stem}")' in tests, script.name


# once, as the jmp migration's below: plain-JAX training runs (60 and 80 steps) whose faces
# every JAX checks in the support matrix and, for jmp's, in test_jmp_suite; the Flax and
# Haiku examples run on every JAX, against the framework each suite installs
@pytest.mark.once
def test_float16_training_example_learns_like_float32():
    result = _load("float16_training").train(steps=60)
    f32, f16 = result["float32"], result["float16 amp"]
    assert f16["final_loss"] < 0.8 * f16["first_loss"]
    assert abs(f16["final_loss"] - f32["final_loss"]) <= 0.05 * f32["final_loss"]
    assert f16["scale"] > 0


def test_flax_nnx_example_updates_batchnorm_and_dropout_state_under_amp():
    require("flax.nnx")
    example = _load("flax_nnx")
    results = example.train(steps=25)
    _learns_like_float32(results["float32"]["losses"], results["amp"]["losses"])
    snaps = results["amp"]["snapshots"]
    assert float(jnp.abs(snaps[-1]["bn_mean"] - snaps[0]["bn_mean"]).max()) > 0.01
    assert snaps[-1]["bn_mean"].dtype == jnp.float32
    assert [s["rng_count"] for s in snaps] == list(
        range(snaps[0]["rng_count"], snaps[0]["rng_count"] + 26)
    )


def test_flax_nnx_writes_under_amp_reach_the_model_as_documented():
    """What the example's docstring says of the direct form, without the split pattern:
    Flax 0.11 and later keep the writes (BatchNorm's statistics, the dropout RNG's count)
    as the pattern does; Flax 0.10 refuses them."""
    require("flax.nnx")
    from flax import errors, nnx

    import autocast

    example = _load("flax_nnx")
    x, y = example.make_data(jax.random.key(0))

    def loss(model, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

    direct = example.ConvNet(nnx.Rngs(0, dropout=1))
    before = example._snapshot(direct)
    try:
        nnx.value_and_grad(autocast.amp(loss))(direct, x, y)
    except errors.TraceContextError:  # Flax 0.10 refuses the write
        return
    after = example._snapshot(direct)
    assert after["rng_count"] > before["rng_count"]
    assert not bool(jnp.all(after["bn_mean"] == before["bn_mean"]))
    # the same statistics as the pattern the example uses
    split = example.ConvNet(nnx.Rngs(0, dropout=1))

    def pattern(model, x, y):
        graphdef, state = nnx.split(model)
        value, state = autocast.amp(example.pure_loss)(graphdef, state, x, y)
        nnx.update(model, state)
        return value

    nnx.value_and_grad(pattern)(split, x, y)
    assert after["rng_count"] == example._snapshot(split)["rng_count"]
    np.testing.assert_array_equal(after["bn_mean"], example._snapshot(split)["bn_mean"])


def test_flax_linen_example_runs_scanned_remat_blocks_in_bfloat16():
    example = _load("flax_linen")
    results = example.train(steps=40)
    _learns_like_float32(results["float32"]["losses"], results["amp"]["losses"])

    import autocast

    model = example.Model()
    x, y = example.make_data(jax.random.key(0))
    params = model.init(jax.random.key(1), x)
    forward = jaxpr_of(lambda p: autocast.amp(example.loss_fn)(p, model, x, y), params)
    (scan,) = eqns_named(forward, "scan")
    body = scan.params["jaxpr"].jaxpr.eqns  # the primitive's name differs between JAX versions
    assert [e.primitive.name in ("checkpoint", "remat2") for e in body].count(True) == 1
    jaxpr = jaxpr_of(jax.grad(lambda p: autocast.amp(example.loss_fn)(p, model, x, y)), params)
    per_scan = [operand_dtypes(s.params["jaxpr"], "dot_general") for s in eqns_named(jaxpr, "scan")]
    # forward: a block's two products; backward: four, plus the one remat recomputes
    assert sorted(len(dots) for dots in per_scan) == [2, 5]
    assert all(d == ("bfloat16", "bfloat16") for d in operand_dtypes(jaxpr, "dot_general"))


@pytest.mark.once
def test_equinox_diffrax_example_trains_a_neural_ode_like_float32():
    results = _load("equinox_diffrax").train(steps=20)
    _learns_like_float32(results["float32"]["losses"], results["amp"]["losses"], rtol=0.1)


def test_haiku_example_threads_batchnorm_state_through_amp():
    require("haiku")
    example = _load("haiku_cnn")
    results = example.train(steps=25)
    _learns_like_float32(results["float32"]["losses"], results["amp"]["losses"])
    amp = results["amp"]
    moved = jnp.abs(example._bn_mean(amp["state"]) - example._bn_mean(amp["state0"]))
    assert float(moved.max()) > 0.01
    assert jax.tree_util.tree_map(lambda a: a.dtype, amp["state"]) == jax.tree_util.tree_map(
        lambda a: a.dtype, amp["state0"]
    )


@pytest.mark.once
def test_jmp_migration_example_trains_alike_all_ways():
    require("jmp")
    results = _load("jmp_migration").train(steps=80)
    assert set(results) == {"float32", "jmp", "import autocast as jmp", "autocast.amp"}
    f32 = results["float32"]["losses"]
    for name in ("jmp", "import autocast as jmp", "autocast.amp"):
        _learns_like_float32(f32, results[name]["losses"], rtol=0.01)
        assert results[name]["loss_scale"] >= 1.0
