"""Which products the float8 recipe runs in float8 at its default settings, and how their
backward products accumulate; read off jaxprs, the same on every backend."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from conftest import eqns_named, operand_dtypes

import autocast
from autocast._src.fp8 import products as fp8

F8 = {"float8_e4m3fn", "float8_e5m2"}


def _product_dtypes(f, *args):
    return operand_dtypes(jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(*args), "dot_general")


@pytest.mark.parametrize(
    "shapes",
    [((16, 4), (4, 16)), ((16, 16), (16, 8)), ((2, 4), (4, 3))],
    ids=["short contraction", "few columns", "tiny"],
)
def test_a_product_with_an_extent_below_16_runs_in_bfloat16(shapes):
    # a GPU hands such a float8 dot to no float8 GEMM: XLA computed it in float16 and
    # overflowed (inf for a 4x4 product of ones on an H200). The activation is computed
    # (x + 0), so w is the weight whose size decides
    f = autocast.amp(lambda x, w: jnp.sum((x + 0.0) @ w), compute_dtype="fp8")
    dtypes = _product_dtypes(f, jnp.ones(shapes[0]), jnp.ones(shapes[1]))
    assert dtypes and all(set(d) == {"bfloat16"} for d in dtypes)
    assert (
        float(f(jnp.ones(shapes[0]), jnp.ones(shapes[1])))
        == shapes[0][0] * shapes[0][1] * shapes[1][1]
    )


def test_products_of_16_and_more_run_in_float8():
    f = autocast.amp(lambda x, w: jnp.sum(x @ w), compute_dtype="fp8")
    dtypes = _product_dtypes(f, jnp.ones((16, 32)), jnp.ones((32, 16)))
    assert len(dtypes) == 3 and all(set(d) <= F8 for d in dtypes)


def test_rows_do_not_decide_so_one_example_and_one_shard_choose_as_the_batch():
    # the rows are the batch: under vmap amp sees one example, under shard_map one device's
    # shard, and a float8 history made on the whole batch must fit both
    f = autocast.amp(lambda x, w: jnp.sum(x @ w), compute_dtype="fp8")
    for rows in (1, 4, 64):
        (forward, *_) = _product_dtypes(f, jnp.ones((rows, 32)), jnp.ones((32, 16)))
        assert set(forward) == {"float8_e4m3fn"}
    delayed = autocast.amp_fp8_delayed(lambda w, x: jnp.sum(x @ w), history=2)
    w, batch = jnp.ones((32, 16)) / 32, jnp.ones((64, 32))
    history = delayed.init(w, batch)
    per_example = jax.vmap(delayed, in_axes=(None, None, 0))(history, w, batch[:, None])
    assert per_example.shape == (64,) and bool(jnp.all(jnp.isfinite(per_example)))


def test_extents_leave_batch_dimensions_out_and_read_convolutions():
    x, w = jnp.ones((8, 16, 16, 4)), jnp.ones((8, 4, 32))
    (eqn,) = eqns_named(
        jax.make_jaxpr(lambda x, w: jnp.einsum("bmhk,bkn->bmhn", x, w))(x, w), "dot_general"
    )
    assert fp8._extents(eqn) == (16 * 16, 32, 4)
    conv = lambda x, k: jax.lax.conv_general_dilated(  # noqa: E731
        x, k, (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    x, k = jnp.ones((2, 8, 8, 3)), jnp.ones((3, 3, 3, 24))
    (eqn,) = eqns_named(jax.make_jaxpr(conv)(x, k), "conv_general_dilated")
    # rows: batch x output positions; columns: output features; contraction: 3x3x3
    assert fp8._extents(eqn) == (2 * 4 * 4, 24, 27)


def test_backward_products_sum_exactly_and_forward_products_fast():
    # Hopper's fast float8 accumulation lost 1.2% of a 1024-term sum on an H200; the
    # backward products, which sum over the tokens, ask for exact sums (HIGHEST)
    f = autocast.amp(lambda x, w: jnp.sum(x @ w), compute_dtype="fp8")
    jaxpr = jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(jnp.ones((32, 16)), jnp.ones((16, 32)))
    dots = [e for e in eqns_named(jaxpr, "dot_general") if e.invars[0].aval.dtype.itemsize == 1]
    exact = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)
    assert [e.params["precision"] == exact for e in dots] == [False, True, True]


def test_the_rule_is_the_same_under_delayed_scaling():
    f = autocast.amp_fp8_delayed(lambda x, w: jnp.sum(x @ w), history=2)
    small, large = (jnp.ones((16, 4)), jnp.ones((4, 16))), (jnp.ones((16, 32)), jnp.ones((32, 16)))
    for (x, w), float8 in ((small, False), (large, True)):
        jaxpr = jax.make_jaxpr(f)(f.init(x, w), x, w)
        (dtypes,) = operand_dtypes(jaxpr, "dot_general")
        assert (set(dtypes) <= F8) is float8


def _float8_products(fn, *args):
    """How many forward products of ``fn`` take float8 operands."""
    return sum(set(d) <= F8 for d in operand_dtypes(jax.make_jaxpr(fn)(*args), "dot_general"))


def test_the_weight_decides_whichever_side_the_batch_sits_on():
    # Equinox's Linear computes weight @ x per example; under vmap the batch becomes the
    # product's columns. The weight (an input reached by data movement alone) decides: a
    # 64 -> 4 head stays in bfloat16 in both layouts and at every batch size, the second
    # 64-wide layer runs in float8 at every batch size, and one example under vmap outside
    # amp chooses as the batch does. The first layer multiplies two inputs, the weight and
    # the batch, both contracted on their last dimension in Equinox's layout, which names
    # no weight (an einsum "bi,oi->bo" is laid out alike with the weight on the right): the
    # smaller free size decides there, so it joins float8 from a batch of 16
    w1, w2, head = (
        jax.random.normal(k, s) / 8
        for k, s in zip(jax.random.split(jax.random.key(0), 3), ((32, 64), (64, 64), (64, 4)))
    )

    def weight_first(ws, x):  # Equinox's layout: weight @ x, one example at a time
        def one(x):
            for w in ws:
                x = jnp.tanh(w.T @ x)
            return x

        return jnp.sum(jax.vmap(one)(x) ** 2)

    def batch_first(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w)
        return jnp.sum(x**2)

    ws = (w1, w2, head)
    for fn, small in ((weight_first, 1), (batch_first, 2)):
        amp = autocast.amp(fn, compute_dtype="fp8")
        counts = {b: _float8_products(amp, ws, jnp.ones((b, 32))) for b in (1, 8, 16, 64)}
        assert counts == {1: small, 8: small, 16: 2, 64: 2}, (fn.__name__, counts)
    per_example = jax.vmap(
        autocast.amp(lambda ws, x: batch_first(ws, x[None]), compute_dtype="fp8"),
        in_axes=(None, 0),
    )
    assert _float8_products(per_example, ws, jnp.ones((8, 32))) == 2


def test_a_history_made_on_one_batch_fits_smaller_batches():
    # the products that may run in float8 hold histories whatever the batch, so a history
    # made on a batch of 32 fits the last batch of 8, or a device's shard of 8 rows (it
    # raised: "2 histories but the program has 0 float8 products")
    eqx = pytest.importorskip("equinox")
    mlp = eqx.nn.MLP(32, 4, 64, 2, key=jax.random.key(1))
    params, static = eqx.partition(mlp, eqx.is_inexact_array)

    def loss(p, x):
        return jnp.mean(jax.vmap(eqx.combine(p, static))(x) ** 2)

    delayed = autocast.amp_fp8_delayed(loss, history=2)
    history = delayed.init(params, jnp.ones((32, 32)))
    for rows in (8, 3):
        value = jax.jit(delayed)(history, params, jnp.ones((rows, 32)) / 4)
        want = loss(params, jnp.ones((rows, 32)) / 4)
        assert abs(float(value) - float(want)) <= 0.15 * abs(float(want))


def test_a_layer_of_two_inputs_with_fewer_than_16_outputs_stays_out_of_float8():
    # a first layer multiplies two of the function's inputs; its weight's outputs decide,
    # not the batch (x (64, 32) @ w (32, 1) ran wholly in float8: the batch of 64 decided).
    # A one-output float8 product is what a GPU computed outside float8 and overflowed
    def share(f, *args):
        return autocast.report(f, compute_dtype="fp8")(*args).summary["fp8_flop_share"]

    f = lambda x, w: jnp.sum(x @ w)  # noqa: E731
    assert share(f, jnp.ones((64, 32)), jnp.ones((32, 1))) == {"forward": 0.0, "backward": 0.0}
    assert share(f, jnp.ones((64, 32)), jnp.ones((32,)))["forward"] == 0.0  # a weight vector
    for rows in (1, 8, 64):  # a 32 -> 64 layer runs in float8 at every batch size
        assert share(f, jnp.ones((rows, 32)), jnp.ones((32, 64))) == {
            "forward": 1.0,
            "backward": 1.0,
        }
    # both contracted on their last dimension, the layout does not name the weight (the
    # weight is on the left in Equinox's weight @ x under vmap, on the right in an einsum):
    # the smaller free size decides, so a one-output layer stays out either way
    per_example = lambda w, x: jnp.sum(jax.vmap(lambda x: w @ x)(x))  # noqa: E731
    einsum = lambda x, w: jnp.sum(jnp.einsum("bi,oi->bo", x, w))  # noqa: E731
    assert share(per_example, jnp.ones((1, 32)), jnp.ones((64, 32)))["forward"] == 0.0
    assert share(einsum, jnp.ones((64, 32)), jnp.ones((1, 32)))["forward"] == 0.0
    assert share(per_example, jnp.ones((64, 32)), jnp.ones((64, 32)))["forward"] == 1.0
    assert share(per_example, jnp.ones((64, 32)), jnp.ones((4, 32)))["forward"] == 0.0
