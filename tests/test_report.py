"""The precision report (what ran in which dtype, which casts amp added, what it saved)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
from conftest import require

import autocast
from autocast._src.demo import models as _models


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
    assert any("models.py" in c.where for c in r.casts)  # casts point at the user's code
    text = str(r)
    for needle in (
        "dot_general",
        "use_compute_precision",
        "casts amp added",
        "low_precision_flop_share",
    ):
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


# --- typed PRNG keys (jax.random.key), as Flax's dropout carries them -----------------------


def _check_dropout_report(r):
    """Matmuls in bfloat16; the key and the random bits drawn from it untouched."""
    dots = [row for row in r.rows if row.primitive == "dot_general"]
    assert len(dots) == 1 and dots[0].count == 2
    assert (dots[0].input_dtypes, dots[0].output_dtypes) == ("bfloat16,bfloat16", "bfloat16")
    random = [row for row in r.rows if row.primitive.startswith("random_")]
    bits = [row for row in random if row.primitive == "random_bits"]
    assert bits and all(row.input_dtypes.startswith("key<") for row in bits)
    assert all(row.output_dtypes == "uint32" for row in bits)
    for row in random + [row for row in r.rows if row.primitive == "bitcast_convert_type"]:
        assert row.rule == "use_original_precision", row
        assert "bfloat16" not in row.input_dtypes + row.output_dtypes, row
    text = str(r)
    assert "key<" in text and "random_bits" in text
    assert r.summary["low_precision_flop_share"] == {"forward": 1.0, "backward": 1.0}
    assert 0 < r.summary["residual_bytes"] < r.summary["residual_bytes_original"]


def test_report_on_a_flax_linen_model_with_dropout():
    nn = require("flax.linen")

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dropout(0.5, deterministic=False)(nn.relu(nn.Dense(16)(x)))
            return nn.Dense(4)(x)

    model, x = Model(), jnp.ones((8, 12))
    params = model.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x)

    def loss(params, x, key):
        return jnp.mean(model.apply(params, x, rngs={"dropout": key}) ** 2)

    r = autocast.report(loss, compute_dtype=jnp.bfloat16)(params, x, jax.random.key(2))
    _check_dropout_report(r)


def test_report_on_a_flax_nnx_model_with_dropout():
    nnx = require("flax.nnx")

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.hidden = nnx.Linear(12, 16, rngs=rngs)
            self.dropout = nnx.Dropout(0.5, rngs=rngs)
            self.out = nnx.Linear(16, 4, rngs=rngs)

        def __call__(self, x):
            return self.out(self.dropout(nnx.relu(self.hidden(x))))

    graphdef, state = nnx.split(Model(nnx.Rngs(0, dropout=1)))
    leaves = jax.tree_util.tree_leaves(state)  # the dropout's key travels in the state
    assert any(jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) for x in leaves)

    def loss(state, x):
        return jnp.mean(nnx.merge(graphdef, state)(x) ** 2)

    r = autocast.report(loss, compute_dtype=jnp.bfloat16)(state, jnp.ones((8, 12)))
    _check_dropout_report(r)


def test_report_when_a_key_is_kept_for_the_backward_pass_or_returned():
    def loss(w, x, key):
        @jax.checkpoint  # the backward pass re-draws the mask: the key is a residual
        def layer(w, x, key):
            return jnp.where(jax.random.bernoulli(key, 0.5, (x.shape[0], w.shape[1])), x @ w, 0.0)

        key, sub = jax.random.split(key)
        return jnp.sum(layer(w, x, sub) ** 2), key

    r = autocast.report(loss, compute_dtype=jnp.bfloat16)(
        jnp.ones((4, 4)), jnp.ones((2, 4)), jax.random.key(0)
    )
    assert r.summary["low_precision_flop_share"] == {"forward": 1.0, "backward": 1.0}
    bits = [row for row in r.rows if row.primitive == "random_bits"]
    assert bits and all(row.input_dtypes.startswith("key<") for row in bits)


def test_report_on_a_filter_custom_vjp_loss_says_what_it_could_not_measure():
    eqx = require("equinox")

    @eqx.filter_custom_vjp
    def layer(vjp_arg, x):
        (w,) = vjp_arg
        return jnp.tanh(x @ w)

    @layer.def_fwd
    def layer_fwd(perturbed, vjp_arg, x):
        return layer(vjp_arg, x), None

    @layer.def_bwd
    def layer_bwd(res, g, perturbed, vjp_arg, x):
        (w,) = vjp_arg
        y = jnp.tanh(x @ w)
        return (x.T @ (g * (1 - y**2)),)

    loss = lambda w, x: jnp.sum(layer((w,), x) ** 2)  # noqa: E731
    w, x = jnp.ones((4, 4)) / 4, jnp.ones((2, 4))
    assert jax.grad(autocast.amp(loss))(w, x).shape == (4, 4)
    r = autocast.report(loss, compute_dtype=jnp.bfloat16)(w, x)
    assert r.summary["low_precision_flop_share"]["forward"] == 1.0
    assert r.summary["low_precision_flop_share"]["backward"] is not None
    assert r.summary["backward"].startswith("with respect to the first argument only (RuntimeError")
    assert "backward" in str(r)


def test_report_on_an_equinox_module_argument():
    eqx = require("equinox")
    mlp = eqx.nn.MLP(8, 2, 16, 2, key=jax.random.key(0))
    loss = lambda m, x: jnp.sum(jax.vmap(m)(x) ** 2)  # noqa: E731
    r = autocast.report(loss, compute_dtype=jnp.bfloat16)(mlp, jnp.ones((4, 8)))
    assert r.summary["low_precision_flop_share"] == {"forward": 1.0, "backward": 1.0}
    assert 0 < r.summary["residual_bytes"] < r.summary["residual_bytes_original"]
    assert "backward" not in r.summary


def _mean_after_products(w, x):
    h = jnp.tanh(x @ w)
    return jnp.mean(h @ w)  # the cast to float32 in front of this mean is reported here


def test_every_cast_is_placed_at_a_line_of_the_users_code():
    import inspect

    r = autocast.report(_mean_after_products, compute_dtype=jnp.bfloat16)(
        jnp.ones((16, 16)), jnp.ones((16, 16))
    )
    lines, first = inspect.getsourcelines(_mean_after_products)
    mean_line = first + next(i for i, text in enumerate(lines) if "jnp.mean" in text)
    assert r.casts and all(__file__ in c.where for c in r.casts), [c.where for c in r.casts]
    (widening,) = [c for c in r.casts if c.target == "float32"]
    # not the library's own file; JAX 0.6.2 gives no column after the line ("file:186 (fn)")
    assert re.match(rf"{re.escape(__file__)}:{mean_line}\b", widening.where), widening.where
