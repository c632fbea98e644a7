"""Recomputed chains (autocast._src.transform.recompute), summed products under float16 and
a pooled activation kept once: read off residuals and jaxprs."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autocast
from autocast import _compat
from autocast._src.tools import measure as _measure
from autocast._src.transform.recompute import recompute_chain

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
KEY = jax.random.PRNGKey(0)


def _mlp_args(d=32, hidden=128, rows=64):
    k1, k2, k3 = jax.random.split(KEY, 3)
    return (
        jax.random.normal(k1, (d, hidden)) / np.sqrt(d),
        jax.random.normal(k2, (hidden, d)) / np.sqrt(hidden),
        jax.random.normal(k3, (rows, d)),
    )


def _gelu_mlp(w1, w2, x):
    return jnp.sum((jax.nn.gelu(x @ w1) @ w2) ** 2)


def residual_avals(fn, *args):
    """The avals of what jax.vjp keeps, arguments left out."""
    jaxpr = jax.make_jaxpr(lambda *a: jax.tree_util.tree_leaves(jax.vjp(fn, *a)[1]))(*args).jaxpr
    inputs = set(jaxpr.invars)
    return [
        v.aval for v in jaxpr.outvars if isinstance(v, jax.extend.core.Literal) or v not in inputs
    ]


def hidden_residuals(fn, *args, shape):
    return [a for a in residual_avals(fn, *args) if tuple(a.shape) == shape]


def recomputed_checkpoints(jaxpr):
    return sum(
        1
        for e in _measure.equations(jaxpr)
        if e.primitive.name in ("remat2", "checkpoint")
        and e.params.get("policy") is recompute_chain
    )


def test_a_tanh_gelu_between_products_keeps_only_its_input():
    args = _mlp_args()
    amp = autocast.amp(_gelu_mlp, compute_dtype=BF16)
    kept = hidden_residuals(amp, *args, shape=(64, 128))
    # the product's output, the GELU's input: nothing of the chain, not the GELU's output
    # (the second product's weight gradient reads it recomputed); 6 arrays before
    assert [a.dtype for a in kept] == [BF16]
    assert recomputed_checkpoints(jax.make_jaxpr(jax.grad(amp))(*args)) == 1
    # the float32 program keeps more than twice as much
    assert _measure.residual_bytes(
        amp, *args, include_inputs=False
    ) < 0.4 * _measure.residual_bytes(_gelu_mlp, *args, include_inputs=False)


def test_recomputation_gives_the_same_values_forward_and_backward():
    # inside a checkpoint amp recomputes no chains (the checkpoint does): the same operations
    # in the same dtypes, compiled as two programs, so equal to what XLA's fusion may round
    # otherwise (on the CPUs this has run on, bit for bit)
    args = _mlp_args()
    amp = autocast.amp(_gelu_mlp, compute_dtype=BF16)
    plain = autocast.amp(jax.checkpoint(_gelu_mlp), compute_dtype=BF16)
    assert recomputed_checkpoints(jax.make_jaxpr(jax.grad(plain))(*args)) == 0
    (l1, g1), (l2, g2) = (
        jax.jit(jax.value_and_grad(amp, argnums=(0, 1, 2)))(*args),
        jax.jit(jax.value_and_grad(plain, argnums=(0, 1, 2)))(*args),
    )
    np.testing.assert_allclose(float(l1), float(l2), rtol=1e-6)
    for a, b in zip(g1, g2):
        np.testing.assert_allclose(a, b, rtol=2**-8, atol=2**-8 * float(jnp.max(jnp.abs(b))))


def test_a_relu_into_a_product_keeps_one_array_and_a_sum_of_two_is_not_recomputed():
    w1, w2, x = _mlp_args()
    # written out (jax.nn.relu, a custom_jvp, is a link too: see the convolution test)
    relu = lambda w1, w2, x: jnp.sum((jnp.maximum(x @ w1 + 0.5, 0.0) @ w2) ** 2)  # noqa: E731
    amp = autocast.amp(relu, compute_dtype=BF16)
    assert len(hidden_residuals(amp, w1, w2, x, shape=(64, 128))) == 1
    assert recomputed_checkpoints(jax.make_jaxpr(jax.grad(amp))(w1, w2, x)) == 1
    # x @ w1 + x @ w1' into a product: recomputing would keep two arrays where the product
    # keeps one; it is bound as written
    added = lambda w1, w2, x: jnp.sum(((x @ w1) + (x @ (2 * w1))) @ w2)  # noqa: E731
    amp = autocast.amp(added, compute_dtype=BF16)
    assert recomputed_checkpoints(jax.make_jaxpr(jax.grad(amp))(w1, w2, x)) == 0
    assert len(hidden_residuals(amp, w1, w2, x, shape=(64, 128))) == 1


def test_chains_in_a_scan_body_and_under_vmap():
    w1, w2, x = _mlp_args()
    ws1, ws2 = jnp.stack([w1, w1]), jnp.stack([w2, w2])

    def scanned(ws1, ws2, x):
        def body(h, w):
            return h + jax.nn.gelu(h @ w[0]) @ w[1], None

        return jnp.sum(jax.lax.scan(body, x, (ws1, ws2))[0] ** 2)

    amp = autocast.amp(scanned, compute_dtype=BF16)
    assert len(hidden_residuals(amp, ws1, ws2, x, shape=(2, 64, 128))) == 1
    # vmap on either side: the same chain, one kept array per layer
    per_row = lambda w1, w2, x: _gelu_mlp(w1, w2, x[None])  # noqa: E731
    for fn in (
        jax.vmap(autocast.amp(per_row, compute_dtype=BF16), (None, None, 0)),
        autocast.amp(jax.vmap(per_row, (None, None, 0)), compute_dtype=BF16),
    ):
        kept = hidden_residuals(fn, w1, w2, x, shape=(64, 1, 128)) + hidden_residuals(
            fn, w1, w2, x, shape=(64, 128)
        )
        assert len(kept) == 1


def test_float8_products_keep_their_operand_and_the_chain_only_its_input():
    w1, w2, x = _mlp_args(d=32, hidden=128, rows=64)
    amp = autocast.amp(_gelu_mlp, compute_dtype="fp8")
    kept = hidden_residuals(amp, w1, w2, x, shape=(64, 128))
    # the chain's bfloat16 input and the float8 copy the second product quantised
    assert sorted(str(a.dtype) for a in kept) == ["bfloat16", "float8_e4m3fn"]


def test_a_reshape_into_a_product_keeps_the_array_it_reshapes():
    # attention's output [batch, seq, heads, c] reshaped into the output projection: the
    # projection keeps the attention output itself, which a fused attention keeps anyway
    # (cuDNN's does), not a reshaped copy
    def f(q, k, w):
        a = jnp.einsum("bqhc,bkhc->bqhc", q, k)
        return jnp.sum((a.reshape(q.shape[0], q.shape[1], -1) @ w) ** 2)

    q, w = jax.random.normal(KEY, (2, 16, 4, 8)), jax.random.normal(KEY, (32, 8))
    amp = autocast.amp(f, compute_dtype=BF16)
    assert hidden_residuals(amp, q, q, w, shape=(2, 16, 32)) == []
    assert [a.dtype for a in hidden_residuals(amp, q, q, w, shape=(2, 16, 4, 8))] == [BF16]


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_a_product_of_two_activations_for_a_sum_runs_in_float32(dtype):
    # a dot product for a cosine similarity: 320 * 480 overflows float16
    x, w = jnp.full((2, 8), 20.0), jnp.full((8, 4), 2.0)

    def cosine(x, w):
        a, b = x @ w, x @ (1.5 * w)
        return jnp.sum(a * b, -1) / (jnp.linalg.norm(a, axis=-1) * jnp.linalg.norm(b, axis=-1))

    def dot(x, w):
        return ((x @ w) * (x @ (1.5 * w))).sum(-1)

    np.testing.assert_allclose(
        autocast.amp(cosine, compute_dtype=dtype)(x, w), [1.0, 1.0], rtol=1e-3
    )
    np.testing.assert_allclose(
        autocast.amp(dot, compute_dtype=dtype)(x, w), [614400.0] * 2, rtol=1e-2
    )
    # also with strongly typed inputs, and the gradient is finite
    xs, ws = x.astype(jnp.float32), w.astype(jnp.float32)
    np.testing.assert_allclose(
        autocast.amp(dot, compute_dtype=dtype)(xs, ws), [614400.0] * 2, rtol=1e-2
    )
    g = jax.grad(lambda x, w: autocast.amp(cosine, compute_dtype=dtype)(x, w).sum(), argnums=1)(
        xs, ws
    )
    assert bool(jnp.all(jnp.isfinite(g)))


def test_a_product_used_elsewhere_too_stays_16_bit():
    # only a product that nothing but a sum reads moves to float32
    x, w = jax.random.normal(KEY, (4, 8)), jax.random.normal(KEY, (8, 8))

    def f(x, w):
        p = (x @ w) * (x @ (2 * w))
        return p.sum(-1), p

    jaxpr = jax.make_jaxpr(autocast.amp(f, compute_dtype=F16))(x, w)
    muls = [
        e
        for e in jaxpr.jaxpr.eqns
        if e.primitive.name == "mul" and e.outvars[0].aval.shape == (4, 8)
    ]
    assert [str(e.outvars[0].aval.dtype) for e in muls] == ["float16"]


def test_an_equinox_cnn_tail_keeps_its_pooled_activation_once():
    eqx = pytest.importorskip("equinox")
    k = jax.random.split(KEY, 3)

    class CNN(eqx.Module):
        conv: eqx.nn.Conv2d
        norm: eqx.nn.LayerNorm
        head: eqx.nn.Linear

        def __init__(self, k):
            self.conv = eqx.nn.Conv2d(3, 32, 3, padding=1, key=k[0])
            self.norm = eqx.nn.LayerNorm(32)  # with scale and bias
            self.head = eqx.nn.Linear(32, 10, key=k[1])

        def __call__(self, x):
            return self.head(self.norm(jax.nn.relu(self.conv(x)).mean(axis=(1, 2))))

    def loss(m, x):
        return jnp.mean(jax.vmap(m)(x) ** 2)

    m, x = CNN(k), jax.random.normal(k[2], (8, 3, 16, 16))
    amp = autocast.amp(loss, compute_dtype=BF16)
    # the relu's output is only summed by the mean: the region of mean and layer norm keeps
    # none of it (it kept the relu's bfloat16 output beside the relu's own residuals, 0.96x
    # float32's bytes)
    full = [
        a
        for a in residual_avals(amp, m, x)
        if math.prod(a.shape) == 8 * 32 * 16 * 16 and a.dtype == BF16
    ]
    assert len(full) == 1  # the zeros jax.nn.relu's derivative keeps (float32 keeps them too)
    ratio = _measure.residual_bytes(amp, m, x, include_inputs=False) / _measure.residual_bytes(
        loss, m, x, include_inputs=False
    )
    assert ratio < 0.65


def _checkpoints(jaxpr, policy):
    """``(prevent_cse, inside a loop body)`` of each checkpoint amp emitted with ``policy``."""
    found = []

    def walk(jaxpr, in_loop):
        for e in jaxpr.eqns:
            if e.primitive.name in ("remat2", "checkpoint") and e.params.get("policy") is policy:
                found.append((e.params["prevent_cse"], in_loop))
            loop = in_loop or e.primitive.name in ("scan", "while")
            for sub in _compat.sub_jaxprs(e):
                walk(getattr(sub, "jaxpr", sub), loop)

    walk(jaxpr.jaxpr, False)
    return found


def test_outside_a_loop_recomputation_is_kept_apart_from_the_forward_pass():
    # XLA would merge a backward recomputation with the identical forward computation (common
    # subexpressions) and keep what the chain spares; a loop body's backward runs in a loop of
    # its own, where it cannot, and barriers would only hinder XLA there
    from autocast._src.transform.regions import keep_statistics

    args = _mlp_args()
    unrolled = autocast.amp(_gelu_mlp, compute_dtype=BF16)
    assert _checkpoints(jax.make_jaxpr(jax.grad(unrolled))(*args), recompute_chain) == [
        (True, False)
    ]

    def scanned(w1, w2, x):
        h, _ = jax.lax.scan(lambda h, _: (jax.nn.gelu(h @ w1) @ w2, None), x, None, length=2)
        return jnp.sum(h**2)

    amp = autocast.amp(scanned, compute_dtype=BF16)
    assert set(_checkpoints(jax.make_jaxpr(jax.grad(amp))(*args), recompute_chain)) == {
        (False, True)
    }

    # a wide region whose result flows on as an activation is kept apart too; one that ends in
    # a statistic (a loss) is not: its cotangent is known in the forward pass, where XLA then
    # computes its backward without keeping its input
    def norm(h):
        return (h - h.mean(-1, keepdims=True)) * jax.lax.rsqrt(h.var(-1, keepdims=True) + 1e-5)

    def normed(w1, w2, x):
        logp = jax.nn.log_softmax((norm(x @ w1) @ w2).astype(jnp.float32))
        return -jnp.mean(logp[:, 0])

    amp = autocast.amp(normed, compute_dtype=BF16)
    jaxpr = jax.make_jaxpr(jax.grad(amp))(*args)
    assert _checkpoints(jaxpr, keep_statistics) == [(False, False)]  # the loss
    # the layer norm, recomputed with the product that reads it
    assert _checkpoints(jaxpr, recompute_chain) == [(True, False)]
    amp = autocast.amp(lambda w1, x: norm(x @ w1), compute_dtype=BF16)
    jaxpr = jax.make_jaxpr(jax.grad(lambda *a: jnp.sum(amp(*a) ** 2)))(args[0], args[2])
    assert _checkpoints(jaxpr, keep_statistics) == [(True, False)]  # an output: its own region


def _conv(x, w):
    dims = ("NHWC", "HWIO", "NHWC")
    return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=dims)


def _batch_norm(h):
    return (h - h.mean((0, 1, 2))) * jax.lax.rsqrt(h.var((0, 1, 2)) + 1e-5)


def test_conv_batch_norm_relu_keeps_one_array_per_layer():
    # the batch norm's region and jax.nn.relu (a custom_jvp) are recomputed with the next
    # convolution: each layer keeps its convolution's output, where it kept that, the
    # normalised array and the relu's (float32 keeps eight, and two masks)
    def net(w1, w2, w3, x):
        h = jax.nn.relu(_batch_norm(_conv(x, w1)))
        h = jax.nn.relu(_batch_norm(_conv(h, w2)))
        return jnp.sum(_conv(h, w3) ** 2)

    k = jax.random.split(KEY, 4)
    w1 = jax.random.normal(k[0], (3, 3, 3, 16)) * 0.2
    w2, w3 = (jax.random.normal(kk, (3, 3, 16, 16)) * 0.1 for kk in k[1:3])
    x = jax.random.normal(k[3], (4, 8, 8, 3))
    args = (w1, w2, w3, x)
    amp = autocast.amp(net, compute_dtype=BF16)
    # the two convolutions' outputs that feed a norm, and the last one's (its square reads it)
    kept = hidden_residuals(amp, *args, shape=(4, 8, 8, 16))
    assert [a.dtype for a in kept] == [BF16] * 3
    got = jax.grad(amp, argnums=(0, 1, 2))(*args)
    assert _measure.relative_error(got, jax.grad(net, argnums=(0, 1, 2))(*args)) < 0.02


def test_a_layer_norm_into_a_product_keeps_the_activation_it_normalises():
    def block(w1, w2, x):
        h = x @ w1
        h = (h - h.mean(-1, keepdims=True)) * jax.lax.rsqrt(h.var(-1, keepdims=True) + 1e-5)
        return jnp.sum((h @ w2) ** 2)

    w1, w2, x = _mlp_args()
    amp = autocast.amp(block, compute_dtype=BF16)
    # h @ w1 and nothing else of that shape: the normalised h is recomputed for w2's gradient
    assert [a.dtype for a in hidden_residuals(amp, w1, w2, x, shape=(64, 128))] == [BF16]
    got = jax.grad(amp, argnums=(0, 1))(w1, w2, x)
    assert _measure.relative_error(got, jax.grad(block, argnums=(0, 1))(w1, w2, x)) < 0.02


def test_float16_attention_written_out_keeps_16_bit_scores_as_bfloat16_does():
    # under float16 the softmax's region keeps float32 (exp may overflow float16), and the
    # product reading it casts it down; recomputed with that product, the region keeps its
    # 16-bit input, the scores: no float32 copy of the attention matrix is kept
    def attention(q, k, v):
        scores = q @ jnp.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
        return jax.nn.softmax(scores, axis=-1) @ v

    q, k, v = (jax.random.normal(kk, (2, 4, 32, 16)) for kk in jax.random.split(KEY, 3))
    kept = {}
    for dtype in (BF16, F16):
        amp = autocast.amp(attention, compute_dtype=dtype)
        avals = residual_avals(amp, q, k, v)
        assert not [a for a in avals if a.dtype == jnp.float32 and a.shape == (2, 4, 32, 32)]
        kept[dtype] = _measure.residual_bytes(amp, q, k, v, include_inputs=False)
    f32 = _measure.residual_bytes(attention, q, k, v, include_inputs=False)
    assert kept[F16] == kept[BF16] <= 0.6 * f32


def test_a_chain_read_by_two_products_agrees_to_rounding_not_to_the_bit(monkeypatch):
    # each product recomputes the chain in its own checkpoint, so the chain's gradient is the
    # sum of two backward passes, added where the program without recomputation does not add
    # them: equal to the compute dtype's rounding, and as close to float32 (docs/amp.md)
    from autocast._src.transform import recompute

    def f(w1, b1, w2, w3, x):
        h = jax.nn.gelu(x @ w1 + b1)
        return jnp.sum((h @ w2 + h @ w3) ** 2)

    k = jax.random.split(jax.random.PRNGKey(1), 5)
    args = (
        jax.random.normal(k[0], (32, 128)) / 6,
        jax.random.normal(k[1], (128,)) * 0.1,
        jax.random.normal(k[2], (128, 32)) / 11,
        jax.random.normal(k[3], (128, 32)) / 11,
        jax.random.normal(k[4], (64, 32)),
    )

    def grads():
        amp = autocast.amp(lambda *a: f(*a), compute_dtype=BF16)  # a new trace each time
        return jax.jit(jax.grad(amp, argnums=(0, 1)))(*args)

    recomputed = grads()
    with monkeypatch.context() as m:
        m.setattr(recompute, "_worth_it", lambda *a: False)
        written = grads()
    reference = jax.grad(f, argnums=(0, 1))(*args)
    for a, b, r in zip(recomputed, written, reference):
        assert _measure.relative_error(a, b) < 0.01
        err_a, err_b = _measure.relative_error(a, r), _measure.relative_error(b, r)
        assert err_a < 0.02 and err_a < 1.25 * err_b


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_a_program_already_16_bit_keeps_its_gelu_s_input_only(dtype):
    # 16-bit parameters (autocast.optax.stochastic_rounding) make the bias and the GELU
    # 16-bit before amp sees them: the chain forms there too, in the program's dtype, and the
    # gradients are those of the program as written
    w1, w2, x = _mlp_args()
    b1 = jnp.linspace(-1.0, 1.0, 128)
    loss = lambda w1, b1, w2, x: jnp.sum(  # noqa: E731
        (jax.nn.gelu(x @ w1 + b1) @ w2).astype(jnp.float32) ** 2
    )
    args = [a.astype(dtype) for a in (w1, b1, w2, x)]
    amp = autocast.amp(loss, compute_dtype=dtype)
    plain = hidden_residuals(loss, *args, shape=(64, 128))  # 6 arrays (5 on JAX 0.12)
    assert len(plain) >= 5 and {a.dtype for a in plain} == {np.dtype(dtype)}
    assert [a.dtype for a in hidden_residuals(amp, *args, shape=(64, 128))] == [dtype]
    assert recomputed_checkpoints(jax.make_jaxpr(jax.grad(amp))(*args)) == 1
    grads = jax.jit(jax.grad(amp, argnums=(0, 1, 2, 3)))(*args)
    want = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args)
    for got, expected in zip(grads, want):
        assert got.dtype == dtype
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(expected, np.float32), rtol=2**-7, atol=1e-3
        )


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_a_layer_norm_written_in_16_bits_keeps_its_input_only(dtype):
    # With 16-bit parameters the layer norm runs in the program's dtype, as the model writes
    # it: ``x - mean`` twice (for the variance and for the output), each kept as written for
    # a derivative. The variance's chain and the normalisation's (recomputed with the next
    # product) both read the input, so together they keep it once.
    w1, w2, x = _mlp_args()
    g, b = jnp.linspace(0.5, 1.5, 128), jnp.linspace(-0.1, 0.1, 128)

    def loss(w1, g, b, w2, x):
        h = x @ w1
        mean = h.mean(-1, keepdims=True)
        var = ((h - mean) ** 2).mean(-1, keepdims=True)
        y = (h - mean) * jax.lax.rsqrt(var + 1e-5) * g + b
        return jnp.sum((y @ w2).astype(jnp.float32) ** 2)

    args = [a.astype(dtype) for a in (w1, g, b, w2, x)]
    amp = autocast.amp(loss, compute_dtype=dtype)
    plain = hidden_residuals(loss, *args, shape=(64, 128))
    assert len(plain) >= 2 and {a.dtype for a in plain} == {np.dtype(dtype)}
    assert [a.dtype for a in hidden_residuals(amp, *args, shape=(64, 128))] == [dtype]
    assert recomputed_checkpoints(jax.make_jaxpr(jax.grad(amp))(*args)) == 2
    values = jax.jit(amp)(*args), jax.jit(loss)(*args)
    assert values[0] == values[1]  # the forward pass is the program's, bit for bit
    grads = jax.jit(jax.grad(amp, argnums=(0, 1, 2, 3)))(*args)
    want = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args)
    for got, expected in zip(grads, want):
        assert got.dtype == dtype
        scale = float(jnp.max(jnp.abs(expected.astype(jnp.float32))))
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(expected, np.float32), atol=2**-6 * scale
        )


def _adds_in_checkpoints(jaxpr, shape):
    """Full-size additions recomputed inside amp's chain checkpoints."""
    found = 0
    for e in _measure.equations(jaxpr):
        if (
            e.primitive.name in ("remat2", "checkpoint")
            and e.params.get("policy") is recompute_chain
        ):
            inner = getattr(e.params["jaxpr"], "jaxpr", e.params["jaxpr"])
            found += sum(
                1
                for q in _measure.equations(inner)
                if q.primitive.name == "add" and tuple(q.outvars[0].aval.shape) == shape
            )
    return found


@pytest.mark.parametrize("blocks", [1, 2, 4])
def test_chains_of_an_unrolled_16_bit_model_stop_at_values_already_bound(blocks):
    # Each block's residual add is a link bound as written (the next block's norm and the
    # residual stream both read it). A chain that walked back through it would recompute
    # every earlier block's add at every norm (1, 4, 16 adds at 1, 2, 4 blocks); stopping
    # at it, each chain keeps that value and recomputes its own block only.
    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], (64, 128), BF16)

    def norm(h, g, b):
        mean = h.mean(-1, keepdims=True)
        var = ((h - mean) ** 2).mean(-1, keepdims=True)
        return (h - mean) * jax.lax.rsqrt(var + 1e-5) * g + b

    def model(ps, x):
        for w1, w2, g, b in ps:
            x = x + jax.nn.relu(norm(x, g, b) @ w1) @ w2
        return jnp.sum(x.astype(jnp.float32) ** 2)

    w = [jax.random.normal(k[i], (128, 128), BF16) * 0.05 for i in (1, 2)]
    ps = [(w[0], w[1], jnp.ones(128, BF16), jnp.zeros(128, BF16))] * blocks
    amp = autocast.amp(model, compute_dtype=BF16)
    assert _adds_in_checkpoints(jax.make_jaxpr(jax.grad(amp))(ps, x), (64, 128)) == blocks
    # per block: the norm's input and the relu's (as written: each norm keeps x - mean
    # twice besides, 3 * blocks + 1 arrays)
    assert len(hidden_residuals(amp, ps, x, shape=(64, 128))) == 2 * blocks
    assert len(hidden_residuals(model, ps, x, shape=(64, 128))) > 3 * blocks
    assert jax.jit(amp)(ps, x) == jax.jit(model)(ps, x)
    got, want = jax.jit(jax.grad(amp))(ps, x), jax.jit(jax.grad(model))(ps, x)
    for g, e in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        scale = float(jnp.max(jnp.abs(e.astype(jnp.float32))))
        np.testing.assert_allclose(
            np.asarray(g, np.float32), np.asarray(e, np.float32), atol=2**-6 * scale
        )


@pytest.mark.parametrize("program_dtype", [jnp.float32, BF16])
def test_a_chain_sharing_its_inputs_with_a_chain_bound_as_written_keeps_no_more(program_dtype):
    # abs(a + b) written out keeps a mask of a + b; recomputed, it would keep a and b. The
    # later a - b reads them too, but bound as written (its derivative reads nothing) it
    # keeps neither: counting a and b free for the first chain because another reads them
    # kept both for a chain whose written form kept one mask (the reviewer's program).
    k = jax.random.split(KEY, 3)
    w1, w2 = (jax.random.normal(k[i], (32, 128), program_dtype) for i in (0, 1))
    x = jax.random.normal(k[2], (64, 32), program_dtype)

    def loss(w1, w2, x):
        a, b = x @ w1, x @ w2
        f32 = jnp.float32
        return jnp.sum(jnp.abs(a + b).astype(f32)) + jnp.sum((a - b).astype(f32))

    amp = autocast.amp(loss, compute_dtype=BF16)
    # the abs's mask only: not a, b or a + b
    assert [a.dtype for a in hidden_residuals(amp, w1, w2, x, shape=(64, 128))] == [np.bool_]
    got = jax.jit(jax.grad(amp, argnums=(0, 1, 2)))(w1, w2, x)
    assert all(bool(jnp.all(jnp.isfinite(g))) and g.dtype == program_dtype for g in got)
    if program_dtype == BF16:  # the program's own work: the same bits forward
        assert jax.jit(amp)(w1, w2, x) == jax.jit(loss)(w1, w2, x)


def _residual_bytes(fn, *args):
    return _measure.residual_bytes(fn, *args, include_inputs=False)


def test_a_chain_does_not_stop_at_a_link_emitted_alone():
    # c is a chain emitted alone for its first reader (the sum): its checkpoint keeps a, not
    # c. The chain into the product must recompute c too, not take c as kept and bind it
    # again as written (which kept tanh's outputs and products: 7 arrays more).
    k = jax.random.split(KEY, 3)
    w1, w3 = jax.random.normal(k[0], (32, 128), BF16), jax.random.normal(k[1], (128, 128), BF16)
    x = jax.random.normal(k[2], (64, 32), BF16)

    def loss(w1, w3, x):
        a = x @ w1
        c = jnp.tanh(a) + jnp.tanh(a) * a
        return jnp.sum(c.astype(F32)) + jnp.sum(((c * 2 + 1) @ w3).astype(F32))

    amp = autocast.amp(loss, compute_dtype=BF16)
    assert [a.dtype for a in hidden_residuals(amp, w1, w3, x, shape=(64, 128))] == [BF16]


@pytest.mark.parametrize("mask", ["comparison", "stop_gradient", "literal"])
def test_a_product_bound_as_written_does_not_count_its_operands_kept(mask):
    # a * m keeps a only where m has a tangent, which amp cannot know: a mask made by a
    # comparison or behind stop_gradient has none, and a literal keeps nothing. Counting a
    # and b as kept made abs(a + b) recompute from them: two arrays instead of its mask.
    k = jax.random.split(KEY, 4)
    w1, w2 = (jax.random.normal(k[i], (32, 128), BF16) for i in (0, 1))
    x = jax.random.normal(k[2], (64, 32), BF16)
    given = (jax.random.uniform(k[3], (64, 128)) > 0.5).astype(BF16)

    def loss(w1, w2, x, given):
        a, b = x @ w1, x @ w2
        m = {
            "comparison": (a > 0).astype(BF16),
            "stop_gradient": jax.lax.stop_gradient(given),
            "literal": 0.5,
        }[mask]
        s = lambda v: jnp.sum(v.astype(F32))  # noqa: E731
        return s(a * m) + s(b * m) + s(jnp.abs(a + b))

    amp = autocast.amp(loss, compute_dtype=BF16)
    # never more than the 16-bit program keeps as written (the mask, and m where it is one)
    assert _residual_bytes(amp, w1, w2, x, given) <= _residual_bytes(loss, w1, w2, x, given)
