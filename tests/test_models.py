"""End to end on the reference models: amp against float32 and against a careful hand cast
(the measures of benchmarks/mixed_precision.py)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

import autocast
from autocast._src.demo import models as _models
from autocast._src.tools import measure as _measure


# Built when a test first asks (collection imports this module in every xdist worker, and
# initialising the models there ran eagerly, op by op: 3 s of each worker's start).
@functools.cache
def _case(name):
    key = jax.random.PRNGKey(0)
    if name == "mlp":
        mlp = _models.init_mlp(key, (32, 64, 64, 10))
        x = jax.random.normal(key, (16, 32))
        return _models.mlp_loss, (mlp, x, jnp.arange(16) % 10)
    gpt = _models.init_gpt(key, vocab=64, d=32, layers=2, seq=16)
    return _models.gpt_loss, (gpt, _models.gpt_batch(key))


@pytest.fixture(params=["gpt", "mlp"])
def case(request):
    fn, args = _case(request.param)
    return fn, args, autocast.amp(fn, compute_dtype=jnp.bfloat16)


def test_loss_within_one_percent_of_float32(case):
    fn, args, amp_fn = case
    ref = float(jax.jit(fn)(*args))
    assert abs(float(jax.jit(amp_fn)(*args)) - ref) <= 0.01 * abs(ref)


def test_all_matmul_flops_run_in_bfloat16_forward_and_backward(case):
    fn, args, amp_fn = case
    assert _measure.low_precision_flop_share(jax.make_jaxpr(amp_fn)(*args)) >= 0.99
    assert _measure.low_precision_flop_share(jax.make_jaxpr(jax.grad(amp_fn))(*args)) >= 0.99


def test_no_more_casts_than_the_hand_cast_model(case):
    """Forward and backward, apart from the backward's recomputation of amp's wide regions
    (which widens 16-bit residuals where the hand-cast model kept float32 copies)."""
    fn, args, amp_fn = case
    hand = lambda *a: fn(*a, jnp.bfloat16)  # noqa: E731
    for transform in (lambda f: f, jax.grad):
        amp_jaxpr = jax.make_jaxpr(transform(amp_fn))(*args)
        hand_jaxpr = jax.make_jaxpr(transform(hand))(*args)
        recomputed = _measure.recompute_casts(amp_jaxpr) if transform is jax.grad else 0
        assert _measure.count_casts(amp_jaxpr) - recomputed <= _measure.count_casts(hand_jaxpr)
        assert _measure.wasted_casts(amp_jaxpr) == 0


def test_activation_memory_falls(case):
    fn, args, amp_fn = case
    ours = _measure.residual_bytes(amp_fn, *args)
    assert ours <= 0.65 * _measure.residual_bytes(fn, *args)
    assert ours <= 1.05 * _measure.residual_bytes(lambda *a: fn(*a, jnp.bfloat16), *args)


@pytest.mark.slow
def test_gradients_close_to_float32(case):
    fn, args, amp_fn = case
    g_ref = jax.jit(jax.grad(fn))(*args)
    g_amp = jax.jit(jax.grad(amp_fn))(*args)
    for a, b in zip(jax.tree_util.tree_leaves(g_amp), jax.tree_util.tree_leaves(g_ref)):
        assert a.dtype == b.dtype
        scale = float(jnp.max(jnp.abs(b))) + 1e-6
        assert float(jnp.max(jnp.abs(a - b))) <= 0.05 * scale


@pytest.mark.slow
@pytest.mark.parametrize(
    "config, batch",
    [
        (dict(vocab=64, d=64, layers=2, seq=32), 16),  # the demo's model and batch
        (dict(vocab=256, d=128, layers=4, seq=64), 8),
    ],
)
def test_gpt_activations_at_or_below_torch_autocast_and_hand_cast(config, batch):
    # torch.autocast keeps 0.56-0.66x of its own float32 on these (benchmarks/torch_autocast.py)
    key = jax.random.PRNGKey(0)
    params = _models.init_gpt(key, **config)
    tokens = _models.gpt_batch(key, batch=batch, seq=config["seq"], vocab=config["vocab"])
    act = lambda f: _measure.residual_bytes(f, params, tokens, include_inputs=False)  # noqa: E731
    amp_bytes = act(autocast.amp(_models.gpt_loss, compute_dtype=jnp.bfloat16))
    assert amp_bytes <= 0.56 * act(_models.gpt_loss)
    assert amp_bytes <= act(lambda p, t: _models.gpt_loss(p, t, jnp.bfloat16))
