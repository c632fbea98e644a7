"""The numerics debugger: attribution of overflow and lost precision to equations and lines,
the float32 reference, loops, branches and backward passes."""

from __future__ import annotations

import inspect
import math

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

import autocast
from autocast._src.demo import models as _models

HERE = __file__


def _line(fn, text: str) -> str:
    """``"<this file>:<line>"`` of the line of ``fn`` holding ``text``."""
    lines, start = inspect.getsourcelines(fn)
    offset = next(i for i, line in enumerate(lines) if text in line)
    return f"{HERE}:{start + offset}"


def _overflowing(w, x):
    h = jnp.tanh(x @ w)
    big = h @ (w * 400.0)  # float16 cannot hold this product
    return jnp.mean(big / 400.0)


def test_float16_overflow_is_found_on_its_line_and_the_suggestion_cures_it():
    kw, kx = jax.random.split(jax.random.key(0))
    w = jax.random.normal(kw, (64, 64)) + 3.0
    x = jax.random.normal(kx, (8, 64))
    d = autocast.diagnose(_overflowing, compute_dtype=jnp.float16)(w, x)
    first = d.first_nonfinite
    assert first is not None
    assert first.primitive == "dot_general"
    assert first.source == _line(_overflowing, "float16 cannot hold")
    assert first.dtype == jnp.float16
    assert first.overflow > 0 and math.isinf(first.rel_error)
    # the first matmul is fine: finite, small error
    ok = [
        e
        for e in d.entries
        if e.source == _line(_overflowing, "jnp.tanh(x @ w)") and e.primitive == "dot_general"
    ]
    assert ok and ok[0].overflow == 0 and ok[0].rel_error < 1e-2
    assert "!" in str(d) and "first non-finite: dot_general in float16" in str(d)
    # amp as it was overflows; with the suggested policy it is finite and close to float32
    assert not np.isfinite(autocast.amp(_overflowing, compute_dtype=jnp.float16)(w, x))
    fixed = autocast.amp(_overflowing, compute_dtype=jnp.float16, amp_policy=d.suggested_policy)(
        w, x
    )
    exact = _overflowing(w, x)
    assert np.isfinite(fixed)
    assert abs(float(fixed) - float(exact)) <= 0.01 * abs(float(exact))
    assert d.suggested_policy[jax.lax.dot_general_p] is autocast.use_full_precision
    assert all(
        d.suggested_policy[k] is v
        for k, v in autocast.default_amp_policy.items()
        if k is not jax.lax.dot_general_p
    )


def _cancelling(w, x):
    a = jnp.tanh(x @ w)
    # The barrier stores a + 1000 in the compute dtype before 1000 is taken away, as a CPU
    # does anyway: a GPU's fusion may keep that sum in float32 (XLA's excess precision), and
    # the cancellation then loses nothing.
    b = jax.lax.optimization_barrier(a + 1000.0) - 1000.0
    return jnp.sum(b @ w)


def test_catastrophic_cancellation_has_the_largest_added_error_on_its_line():
    kw, kx = jax.random.split(jax.random.key(1))
    w = jax.random.normal(kw, (32, 32)) / 6
    x = jax.random.normal(kx, (8, 32))
    d = autocast.diagnose(_cancelling, compute_dtype=jnp.bfloat16)(w, x)
    worst = max(d.entries, key=lambda e: e.added_error)
    assert worst.source == _line(_cancelling, "1000.0")
    assert worst.added_error > 0.1
    assert worst.dtype == jnp.bfloat16
    assert d.worst(1)[0] is worst
    matmuls = [e for e in d.entries if e.primitive == "dot_general"]
    assert len(matmuls) == 2
    first_matmul = next(e for e in matmuls if e.source == _line(_cancelling, "jnp.tanh"))
    assert first_matmul.rel_error < 0.05
    # the matmul after the cancellation only inherits its error
    second = next(e for e in matmuls if e is not first_matmul)
    assert second.added_error < 0.05 < second.rel_error
    assert d.first_nonfinite is None


@pytest.mark.slow
def test_backward_pass_of_a_scanned_model_under_jit_grad():
    key = jax.random.key(2)
    params = _models.stack_blocks(_models.init_gpt(key, vocab=13, d=16, layers=2, seq=8))
    tokens = _models.gpt_batch(key, batch=2, seq=8, vocab=13)
    loss = lambda p, t: _models.gpt_loss(p, t, scan=True)  # noqa: E731
    d = autocast.diagnose(jax.jit(jax.grad(loss)), compute_dtype=jnp.bfloat16)(params, tokens)
    dots = [e for e in d.entries if e.primitive == "dot_general"]
    backward = [e for e in dots if e.backward]
    forward = [e for e in dots if not e.backward]
    assert len(backward) >= len(forward) > 0
    in_loop = [e for e in backward if e.runs == 2]  # once per layer of the scan
    assert in_loop
    assert all(e.dtype == jnp.bfloat16 for e in dots)
    assert all(math.isfinite(e.rel_error) and math.isfinite(e.added_error) for e in d.entries)
    assert all(e.rel_error < 0.05 for e in dots)
    assert d.first_nonfinite is None
    # the reference is the program in float32
    exact = jax.jit(jax.grad(loss))(params, tokens)
    for r, x in zip(jax.tree_util.tree_leaves(d.reference), jax.tree_util.tree_leaves(exact)):
        np.testing.assert_allclose(r, x, rtol=1e-4, atol=1e-6)  # XLA may fuse differently
    assert 0 < d.output_error < 0.05


@pytest.mark.slow
def test_reference_is_the_float32_program_and_float32_compute_adds_nothing():
    key = jax.random.key(3)
    params = _models.init_gpt(key, vocab=13, d=16, layers=1, seq=8)
    tokens = _models.gpt_batch(key, batch=2, seq=8, vocab=13)
    d = autocast.diagnose(_models.gpt_loss, compute_dtype=jnp.float32)(params, tokens)
    # the reference is evaluated equation by equation, the program op by op: float32's
    # rounding apart, not bit for bit (a CPU with AVX-512 moved the loss by one ulp, and a GPU
    # fuses and sums otherwise)
    tol = 1e-6
    np.testing.assert_allclose(
        float(d.reference), float(_models.gpt_loss(params, tokens)), rtol=tol
    )
    assert all(e.rel_error <= tol and e.overflow == 0 and e.underflow == 0 for e in d.entries)
    assert d.culprits == () and dict(d.suggested_policy) == dict(autocast.default_amp_policy)


def _looped(w, x, n):
    def body(i, h):
        return jnp.tanh(h @ w) * 1.5

    def doubled(h):
        return h * 2.0

    def shifted(h):
        return h - 1.0

    h = jax.lax.fori_loop(0, n, body, x)  # n traced: a while loop
    return jax.lax.cond(jnp.sum(h) > 0, doubled, shifted, h).sum()


def _looped_h(w, x):
    return jax.lax.fori_loop(0, 5, lambda i, h: jnp.tanh(h @ w) * 1.5, x)


def test_loops_aggregate_over_iterations_and_branches_are_followed():
    kw, kx = jax.random.split(jax.random.key(4))
    w = jax.random.normal(kw, (16, 16)) / 4
    x = jax.random.normal(kx, (4, 16))
    d = autocast.diagnose(_looped, compute_dtype=jnp.bfloat16)(w, x, jnp.int32(5))
    dot = next(e for e in d.entries if e.primitive == "dot_general")
    assert dot.runs == 5 and dot.source == _line(_looped, "h @ w")
    assert dot.dtype == jnp.bfloat16 and 0 < dot.rel_error < 0.05
    taken = "h * 2.0" if float(jnp.sum(_looped_h(w, x))) > 0 else "h - 1.0"
    other = "h - 1.0" if taken == "h * 2.0" else "h * 2.0"
    assert [e.runs for e in d.entries if e.source == _line(_looped, taken)] == [1]
    assert [e.runs for e in d.entries if e.source == _line(_looped, other)] == []
    assert d.diverged == 0
    np.testing.assert_allclose(d.reference, _looped(w, x, 5), rtol=1e-6)


def test_named_scopes_custom_gradients_and_checkpoints_are_looked_inside():
    @jax.custom_vjp
    def scaled(x):
        return x * 0.5

    scaled.defvjp(lambda x: (x * 0.5, None), lambda _, g: (g * 0.5,))

    def f(w, x):
        with jax.named_scope("attention"):
            s = jax.checkpoint(lambda x: jnp.tanh(scaled(x @ (w * 6000.0)) / 1e5))(x)  # overflows
        return jnp.sum(s @ w)

    w = jnp.full((8, 8), 1.0)
    x = jnp.full((2, 8), 2.0)
    d = autocast.diagnose(f, compute_dtype=jnp.float16)(w, x)
    inside = [e for e in d.entries if e.scope == "attention"]
    assert {"dot_general", "mul", "div", "tanh"} <= {e.primitive for e in inside}
    first = d.first_nonfinite
    assert first is not None and first.scope == "attention" and first.primitive == "dot_general"
    assert first.source == _line(f, "overflows")
    # tanh of an infinity is finite again: the output hides what the diagnosis shows
    assert d.output_error > 0.5 and np.isfinite(d.output)
    assert d.suggested_policy["attention"] is autocast.use_full_precision
    fixed = autocast.amp(f, compute_dtype=jnp.float16, amp_policy=d.suggested_policy)(w, x)
    assert np.isfinite(fixed)


@settings(max_examples=12, deadline=None)
@given(scale=st.floats(1.0, 400.0))
def test_overflow_is_reported_exactly_when_float16_cannot_hold_the_product(scale):
    w = jnp.full((4, 4), scale, jnp.float32)
    x = jnp.full((2, 4), scale, jnp.float32)
    product = 4 * np.float16(scale).astype(np.float64) ** 2
    if abs(product - 65504) < 1024:  # rounding decides near the edge
        return
    d = autocast.diagnose(lambda w, x: jnp.sum(x @ w), compute_dtype=jnp.float16)(w, x)
    assert (d.first_nonfinite is not None) == (product > 65504)


def test_bad_input_names_the_culprit():
    with pytest.raises(TypeError, match="amp expects a callable"):
        autocast.diagnose(3)
    with pytest.raises(TypeError, match="amp_policy"):
        autocast.diagnose(jnp.sin, amp_policy=[1])


@pytest.mark.once
@pytest.mark.slow
def test_command_line_diagnoses_the_demo_model_and_the_suggestion_cures_it(capsys):
    from autocast.__main__ import main

    main(["diagnose", "--rows", "4"])
    out = capsys.readouterr().out
    assert "first non-finite: mul in float16" in out
    rows = out.splitlines()
    table = rows.index(next(r for r in rows if r.strip().startswith("primitive")))
    assert rows[table + 2].lstrip().startswith("!  mul ")  # flagged, and first in the table
    assert "gradient relative error: inf as given" in out and "(finite)" in out


def test_a_loop_that_cannot_converge_in_16_bits_is_reported():
    # a fixed-point iteration to a tolerance bfloat16 cannot meet: float32 stops early, amp
    # runs to the step budget and returns what it has
    def solve(w, x):
        def going(c):
            i, h, step = c
            return (i < 50) & (step > 1e-6)

        def body(c):
            i, h, _ = c
            new = jnp.cos(h @ w) * 0.5 + x
            return i + 1, new, jnp.max(jnp.abs(new - h))

        _, h, _ = jax.lax.while_loop(going, body, (0, x, jnp.float32(1.0)))
        return jnp.sum(h)

    w = jnp.eye(8) * 0.3
    x = jnp.linspace(0.1, 0.9, 8)[None]
    d = autocast.diagnose(solve, compute_dtype=jnp.bfloat16)(w, x)
    assert d.diverged >= 1
    assert "control flow left the reference's" in str(d)
