"""``autocast.plan``: a step compiled for a target this machine may not have, and what the
compiler planned for it (docs/planning.md).

The CPU target runs everywhere (CI); TPU targets run in ``make tpu-plan``'s venv (libtpu),
skipped where it is not built."""

from __future__ import annotations

import importlib.util
import json

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from conftest import ROOT, TPU_PLAN_VENV, in_venv, needs_tpu_plan_venv

import autocast
import autocast.optax
from autocast._src.tools import measure

P = jax.sharding.PartitionSpec
W = jax.ShapeDtypeStruct((256, 256), jnp.float32)
X = jax.ShapeDtypeStruct((32, 256), jnp.float32)


def loss(w, x):
    return jnp.tanh(x @ w).sum()  # the user's line every buffer and product names


def test_a_cpu_plan_gives_the_compilers_memory_figures_and_the_users_lines():
    step = jax.jit(jax.grad(autocast.amp(loss)))
    p = autocast.plan(step, W, X, target="cpu")
    compiled = step.lower(W, X).compile()
    assert p.fits and p.refusal is None and p.chips == 1
    assert p.peak_bytes == measure.planned_sum_bytes(compiled.memory_analysis())
    assert p.argument_bytes == (256 * 256 + 32 * 256) * 4
    made = [b for b in p.buffers if not b.made_by.startswith("argument")]
    assert all(b.where.startswith("test_plan.py:") for b in made), p.buffers
    assert made, p.buffers
    # the forward and the backward product of the one line, and no file of the library
    assert sum(q.count for q in p.products) == 2
    assert {q.where.split(":")[0] for q in p.products} == {"test_plan.py"}
    assert "largest buffers live at the peak" in str(p)


def test_a_program_the_persistent_compilation_cache_holds_is_planned_all_the_same():
    # XLA writes its dumps only when it compiles; the suite runs with a persistent cache
    # (conftest.py), as a user may, and one program planned twice is in it the second time
    assert jax.config.jax_compilation_cache_dir
    first, second = (autocast.plan(lambda w: jnp.sin(w) @ w, W, target="cpu") for _ in "ab")
    assert second.products == first.products and second.products, second
    assert second.buffers == first.buffers and second.buffers, second
    assert jax.config.jax_enable_compilation_cache  # as the user had it


def test_an_unjitted_step_is_jitted_and_a_jitted_ones_donation_kept():
    def sgd(w, x):
        return w - 0.1 * jax.grad(autocast.amp(loss))(w, x)

    plain = autocast.plan(sgd, W, X, target="cpu")
    donated = autocast.plan(jax.jit(sgd, donate_argnums=0), W, X, target="cpu")
    assert plain.alias_bytes == 0
    assert donated.alias_bytes == 256 * 256 * 4


def test_an_equinox_module_and_an_optax_state_plan_as_they_are_passed():
    model = eqx.nn.MLP(64, 8, 128, 2, key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_array)
    optimizer = optax.adamw(1e-3)

    @eqx.filter_jit
    def step(params, opt_state, x):
        def f(p):
            return autocast.amp(lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2))(
                eqx.combine(p, static), x
            )

        grads = jax.grad(f)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return eqx.apply_updates(params, updates), opt_state

    opt_state = optimizer.init(params)
    x = jax.ShapeDtypeStruct((16, 64), jnp.float32)
    p = autocast.plan(jax.jit(step), params, opt_state, x, target="cpu")
    state_bytes = sum(a.nbytes for a in jax.tree_util.tree_leaves((params, opt_state)))
    assert p.argument_bytes == state_bytes + 16 * 64 * 4


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(target="tpu-v9"), ValueError, "tpu-v5e[:TOPOLOGY]"),
        (dict(target=5), TypeError, "target must be a string"),
        (dict(target="gpu-h100:2x2"), ValueError, "one GPU"),
        (dict(target="cpu", mesh={"data": 2}), ValueError, "product must be"),
        (dict(target="cpu", mesh={"data": 0}), TypeError, "positive sizes"),
        (dict(target="cpu", shardings=(P(),)), ValueError, "one entry per argument (2"),
        (dict(target="cpu", shardings=P()), ValueError, "one entry per argument"),
    ],
)
def test_bad_input_is_refused_naming_it(kwargs, error, words):
    with pytest.raises(error, match=None) as e:
        autocast.plan(jax.jit(loss), W, X, **kwargs)
    assert words in str(e.value)


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is not None, reason="libtpu installed")
def test_a_tpu_target_without_libtpu_says_what_to_install():
    with pytest.raises(ImportError, match=r'pip install "jax\[tpu\]=='):
        autocast.plan(jax.jit(loss), W, X, target="tpu-v5e")


# Compiles for TPUs with no TPU (make tpu-plan's venv): what amp decided for a v5e, a program
# too large for one chip, and a step sharded over 8 chips.
ON_A_TPU = """
import json, jax, jax.numpy as jnp, autocast
P = jax.sharding.PartitionSpec

def loss(w, x):
    return jnp.tanh(x @ w).sum()

w = jax.ShapeDtypeStruct((4096, 4096), jnp.float32)
x = jax.ShapeDtypeStruct((1024, 4096), jnp.float32)
step = jax.jit(jax.grad(autocast.amp(loss)))
one = autocast.plan(step, w, x, target="tpu-v5e")
fsdp = autocast.plan(step, w, x, target="tpu-v5e:2x4", mesh={"data": 4, "model": 2},
                     shardings=(P(None, "model"), P("data")))
big = jax.ShapeDtypeStruct((80000, 80000), jnp.float32)
refused = autocast.plan(jax.jit(lambda a: (a @ a).sum()), big, target="tpu-v5e")
print(json.dumps({
    "one": [one.fits, one.argument_bytes, [q.operands for q in one.products], one.capacity_bytes],
    "fsdp": [fsdp.chips, fsdp.argument_bytes],
    "refused": [refused.fits, refused.refusal],
}))
"""


@pytest.mark.slow
@needs_tpu_plan_venv
def test_a_tpu_plan_from_a_cpu_decides_for_the_chip_shards_and_refuses():
    out = json.loads(in_venv(TPU_PLAN_VENV, "-c", ON_A_TPU).splitlines()[-1])
    fits, arguments, products, capacity = out["one"]
    assert fits and capacity == 16 * 2**30
    assert products == ["bf16 x bf16"]  # a v5e multiplies bfloat16
    assert arguments == (4096 * 4096 + 1024 * 4096) * 4
    # the weight's columns over 2 chips, the batch over 4: each chip holds its shards
    assert out["fsdp"] == [8, (4096 * 2048 + 256 * 4096) * 4]
    fits, refusal = out["refused"]
    assert not fits and "HBM" in refusal


def test_the_pod_benchmark_puts_8_bit_moments_where_their_parameters_are(monkeypatch):
    # blocks of an 8-bit moment run along the parameter's last axis and stay whole, so FSDP
    # must split a parameter along a leading axis for its moments to follow it
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    tpu_pods = importlib.import_module("tpu_pods")
    params = {"w": jax.ShapeDtypeStruct((24, 2048, 8192), jnp.float32)}
    tx = autocast.optax.low_precision_state(optax.adam(1e-3), jnp.float8_e4m3fn)
    opt_state = jax.eval_shape(tx.init, params)
    specs = tpu_pods._split(params, 64)
    moments = tpu_pods._beside(opt_state, params, specs).inner[0]
    assert specs["w"] == P(None, "data")
    assert moments.mu["w"].codes == P(None, "data", None, None) == moments.nu["w"].codes
    assert moments.mu["w"].scales == P(None, "data", None)
