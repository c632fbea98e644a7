"""The precision report (what ran in which dtype, which casts amp added, what it saved)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import autocast
from autocast import _models


def _gpt(**kw):
    key = jax.random.PRNGKey(0)
    params = _models.init_gpt(key, layers=2)
    return params, _models.gpt_batch(key)


def test_report_on_the_gpt_model():
    params, tokens = _gpt()
    r = autocast.report(_models.gpt_loss, compute_dtype=jnp.bfloat16)(params, tokens)
    share = r.summary["low_precision_flop_share"]
    assert share["forward"] >= 0.99 and share["backward"] >= 0.99
    assert r.summary["residual_bytes"] < r.summary["residual_bytes_original"]
    assert isinstance(r.summary["casts"], int) and r.summary["casts"] > 0
    dots = [row for row in r.rows if row.primitive == "dot_general"]
    assert dots and all(row.input_dtypes == "bfloat16,bfloat16" for row in dots)
    assert all(row.rule == "use_compute_precision" for row in dots)
    exps = [row for row in r.rows if row.primitive == "exp"]
    assert exps and all(row.output_dtypes == "float32" for row in exps)
    assert sum(c.count for c in r.casts) == r.summary["casts"]
    assert any("_models.py" in c.where for c in r.casts)  # casts point at the user's code
    text = str(r)
    for needle in ("dot_general", "use_compute_precision", "casts amp added", "low_precision_flop_share"):
        assert needle in text


def test_report_on_scan_and_checkpoint():
    params, tokens = _gpt()
    stacked = _models.stack_blocks(params)
    loss = lambda p, t: _models.gpt_loss(p, t, scan=True, remat=True)  # noqa: E731
    r = autocast.report(loss, compute_dtype=jnp.bfloat16)(stacked, tokens)
    assert r.summary["low_precision_flop_share"]["forward"] >= 0.99
    assert r.summary["low_precision_flop_share"]["backward"] >= 0.99
    assert r.summary["residual_bytes"] < r.summary["residual_bytes_original"]
    # the equations inside the scan body are reported too (every layer's matmuls)
    assert sum(row.count for row in r.rows if row.primitive == "dot_general") >= 5


def test_report_counts_every_call_of_a_shared_helper():
    @jax.jit
    def helper(h):
        return jnp.tanh(h)

    def fn(w, x):
        return helper(helper(x @ w) @ w).sum()

    r = autocast.report(fn, compute_dtype=jnp.bfloat16)(jnp.ones((3, 3)), jnp.ones((2, 3)))
    assert sum(row.count for row in r.rows if row.primitive == "tanh") == 2


def test_report_of_a_function_with_integer_outputs():
    r = autocast.report(lambda x: (x @ x).astype(jnp.int32))(jnp.ones((2, 2)))
    assert r.summary["low_precision_flop_share"] == {"forward": 1.0, "backward": None}
    assert r.summary["residual_bytes"] == 0  # nothing flows back through an integer
