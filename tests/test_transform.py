"""The amp transform: signature, decisions, eligibility,
composition with JAX transformations, caching and errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import DETERMINISTIC, eqns_named, jaxpr_of, operand_dtypes, program_text, require
from jax import lax

import autocast
from autocast import _compat
from autocast._src.demo import models as _models
from autocast._src.tools import measure as _measure

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32


def bf16_amp(fn, **kw):
    return autocast.amp(fn, compute_dtype=BF16, **kw)


def _matmul_chain(w, x):
    return jnp.tanh(x @ w) @ w


W = jnp.linspace(-1, 1, 16, dtype=F32).reshape(4, 4)
X = jnp.linspace(-2, 2, 12, dtype=F32).reshape(3, 4)


# --- 3.1 signature ---------------------------------------------------------------------------


def test_returns_the_same_pytree_shapes_and_dtypes():
    def fn(params, batch, *, scale):
        h = batch["x"] @ params["w"]
        return {
            "y": h * scale,
            "pair": (h.sum(), batch["ids"] + 1),
            "none": None,
            "name": "out",
            "half": h.astype(F16),
            "mask": batch["ids"] > 0,
        }

    params = {"w": W}
    batch = {"x": X, "ids": jnp.arange(3)}
    want = fn(params, batch, scale=2.0)
    got = bf16_amp(fn)(params, batch, scale=2.0)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        if isinstance(w, str):
            assert g == w
        else:
            assert (g.shape, g.dtype) == (w.shape, w.dtype)
    np.testing.assert_array_equal(got["pair"][1], want["pair"][1])


def test_non_array_leaves_pass_through_and_python_ints_are_static():
    seen = []

    def fn(x, cfg):
        seen.append(cfg["act"])
        act = {"tanh": jnp.tanh, "relu": jax.nn.relu}[cfg["act"]]
        return act(x @ W) * cfg["scale"], cfg["act"]

    f = bf16_amp(fn)
    out, name = f(X, {"act": "tanh", "scale": 3})
    assert name == "tanh" and out.dtype == F32
    f(X, {"act": "relu", "scale": 3})
    assert seen == ["tanh", "relu"]


def test_gradients_come_back_in_the_primal_dtypes():
    def loss(w, x16, xb):
        return (jnp.tanh(x16.astype(F32) @ w) + xb.astype(F32) @ w).sum()

    args = (W, X.astype(F16), X.astype(BF16))
    grads = jax.grad(bf16_amp(loss), argnums=(0, 1, 2))(*args)
    assert [g.dtype for g in grads] == [F32, F16, BF16]


# --- caching ----------------------------------------------------------------------------------


def test_python_floats_are_traced_as_jit_traces_them():
    calls = []

    def fn(x, lr):
        calls.append(type(lr))
        return (x @ W) * lr

    f = bf16_amp(fn)
    outs = [f(X, 0.1 * (i % 3 + 1)) for i in range(12)]
    assert len(calls) == 1 and calls[0] is not float  # traced once, for every value
    for i, out in enumerate(outs):
        np.testing.assert_allclose(out, (X @ W) * (0.1 * (i % 3 + 1)), rtol=2e-2, atol=2e-2)
    # a scalar that changes every call, passed as an array, is traced once
    calls.clear()
    outs = [f(X, jnp.float32(0.1 * (i + 1))) for i in range(12)]
    assert len(calls) == 1
    # a float scalar times a bfloat16 activation stays bfloat16
    jaxpr = jaxpr_of(bf16_amp(lambda x, s: (x @ W) * s), X, 0.5)
    assert [e.outvars[0].aval.dtype for e in eqns_named(jaxpr, "mul")] == [jnp.dtype(BF16)]


def test_a_number_computed_from_python_floats_comes_back_as_jit_gives_it():
    fn = lambda a, b: (a * b, b * 3)  # noqa: E731
    got, want = bf16_amp(fn)(jnp.ones(3), 2.0), jax.jit(fn)(jnp.ones(3), 2.0)
    assert float(got[1]) == float(want[1]) == 6.0
    assert got[1].dtype == want[1].dtype and got[1].weak_type == want[1].weak_type


@pytest.mark.slow
def test_code_that_branches_on_a_python_number_sees_it():
    # Equinox's Dropout(0.0) skips itself only for a Python number; traced, it would ask for a key
    eqx = require("equinox")
    attention = eqx.nn.MultiheadAttention(2, 8, key=jax.random.key(0))
    x = jnp.linspace(-1, 1, 32).reshape(4, 8)
    loss = lambda m, x: jnp.sum(m(x, x, x) ** 2)  # noqa: E731
    value, grads = eqx.filter_value_and_grad(bf16_amp(loss))(attention, x)
    want, want_grads = eqx.filter_value_and_grad(loss)(attention, x)
    np.testing.assert_allclose(value, want, rtol=2e-2)
    assert (
        _measure.relative_error(
            jax.tree_util.tree_leaves(eqx.filter(grads, eqx.is_array)),
            jax.tree_util.tree_leaves(eqx.filter(want_grads, eqx.is_array)),
        )
        < 0.05
    )

    def branches(x, p):
        return x @ W if p == 0 else (x @ W) * p

    assert float(bf16_amp(lambda x, p: branches(x, p).sum())(X, 0.0)) == pytest.approx(
        float(branches(X, 0.0).sum()), rel=2e-2
    )


def test_a_python_float_passed_through_under_transformations():
    g = bf16_amp(lambda x, a: (jnp.sum(x @ W) * a, a))
    assert g(X, 0.5)[1] == 0.5
    assert jax.grad(lambda x: g(x, 0.5)[0])(X).dtype == F32
    assert jax.jvp(lambda x: g(x, 0.5), (X,), (X,))[0][1] == 0.5
    np.testing.assert_array_equal(jax.vmap(lambda x: g(x, 0.5)[1])(X), np.full(3, 0.5))


def test_a_broadcast_parameter_keeps_its_bits_in_a_float32_rule():
    # The exponent of x ** p is not narrowed to the activation's 16 bits on its way to the
    # float32 pow.
    p = jnp.full((1, 4), 1.003, F32)
    fn = lambda x, p: (x @ W + 3.0) ** p  # noqa: E731
    np.testing.assert_allclose(bf16_amp(fn)(X, p), fn(X, p), rtol=1e-2)
    casts = eqns_named(jaxpr_of(bf16_amp(fn), X, p), "convert_element_type")
    assert not [
        e for e in casts if e.outvars[0].aval.shape == (1, 4) and e.outvars[0].aval.dtype == BF16
    ]


@pytest.mark.parametrize(
    "fn, args",
    [
        (lambda a: a * 2, (jnp.float32(1.0),)),
        (lambda a, b: (a + b, a * b), (jnp.ones(3), 2.0)),
        (lambda a: jnp.sin(a) + 1, (0.5,)),
    ],
)
def test_output_weak_types_match_jit(fn, args):
    want = jax.jit(fn)(*args)
    for f in (bf16_amp(fn), jax.jit(bf16_amp(fn))):
        got = f(*args)
        for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            assert jax.typeof(g).weak_type == jax.typeof(w).weak_type and g.dtype == w.dtype


def test_nested_amp_uses_the_outermost_settings():
    inner = autocast.amp(_matmul_chain, compute_dtype=F16)
    outer = autocast.amp(inner, compute_dtype=BF16)
    assert set(operand_dtypes(jaxpr_of(outer, W, X), "dot_general")) == {("bfloat16", "bfloat16")}
    stop_all = {"amp_default": autocast.use_original_precision}
    outer = autocast.amp(autocast.amp(_matmul_chain), amp_policy=stop_all)
    assert set(operand_dtypes(jaxpr_of(outer, W, X), "dot_general")) == {("float32", "float32")}
    # a nested amp under a transformation inside the outer one is transparent too
    outer = autocast.amp(jax.grad(lambda w, x: inner(w, x).sum()), compute_dtype=BF16)
    assert {d for pair in operand_dtypes(jaxpr_of(outer, W, X), "dot_general") for d in pair} == {
        "bfloat16"
    }


def test_a_callable_object_keeps_its_own_attributes():
    class Layer:
        def __init__(self):
            self._fn = "not a function"
            self.scale = 2.0

        def __call__(self, x):
            return (x @ W) * self.scale

    layer = Layer()
    f = bf16_amp(layer)
    np.testing.assert_allclose(f(X), layer(X), rtol=2e-2, atol=2e-2)


def test_a_generator_output_is_a_clear_error():
    def fn(x):
        return (y for y in (x @ W, x))

    with pytest.raises(TypeError, match="returned a generator"):
        bf16_amp(fn)(X)


def test_traces_once_per_structure_and_avals():
    calls = []

    def fn(w, x):
        calls.append(x.shape)
        return x @ w

    f = bf16_amp(fn)
    f(W, X)
    f(W + 1, X * 2)
    jax.jit(f)(W, X)
    assert calls == [(3, 4)]
    f(W, X[:2])
    assert calls == [(3, 4), (2, 4)]
    f(W, X.astype(BF16))
    assert len(calls) == 3


def test_decorator_forms():
    @autocast.amp
    def plain(w, x):
        return x @ w

    @autocast.amp(compute_dtype=F16)
    def half(w, x):
        return x @ w

    assert operand_dtypes(jaxpr_of(half, W, X), "dot_general") == [("float16", "float16")]
    assert plain.__name__ == "plain"
    expected = np.dtype(autocast.half_dtype()).name
    assert operand_dtypes(jaxpr_of(plain, W, X), "dot_general") == [(expected, expected)]


# --- 3.2 decision order -----------------------------------------------------------------------


def _scoped(w, x):
    with jax.named_scope("outer"):
        with jax.named_scope("inner"):
            a = x @ w
        b = a @ w
    return b @ w


def test_outermost_scope_wins_then_primitive_then_default():
    policy = {
        "outer": autocast.use_precision(F16),
        "inner": autocast.use_original_precision,
        lax.dot_general_p: autocast.use_compute_precision,
    }
    dts = operand_dtypes(jaxpr_of(bf16_amp(_scoped, amp_policy=policy), W, X), "dot_general")
    assert dts == [("float16", "float16"), ("float16", "float16"), ("bfloat16", "bfloat16")]

    inner_only = {
        "inner": autocast.use_original_precision,
        lax.dot_general_p: autocast.use_compute_precision,
    }
    dts = operand_dtypes(jaxpr_of(bf16_amp(_scoped, amp_policy=inner_only), W, X), "dot_general")
    assert dts == [("float32", "float32"), ("bfloat16", "bfloat16"), ("bfloat16", "bfloat16")]


def test_amp_default_decides_unlisted_primitives():
    policy = {"amp_default": autocast.use_compute_precision}
    jaxpr = jaxpr_of(bf16_amp(lambda x: jnp.tanh(x) * 2, amp_policy=policy), X)
    assert operand_dtypes(jaxpr, "tanh") == [("bfloat16",)]
    # without the key, unlisted primitives keep their original precision
    jaxpr = jaxpr_of(bf16_amp(lambda x: jnp.tanh(x.astype(BF16)), amp_policy={}), X)
    assert operand_dtypes(jaxpr, "tanh") == [("bfloat16",)]


def test_a_scope_also_governs_the_backward_pass():
    def loss(w, x):
        with jax.named_scope("precise"):
            h = x @ w
        return (h @ w).sum()

    policy = {**autocast.default_amp_policy, "precise": autocast.use_original_precision}
    # amp over grad: the backward equations carry jvp(...)/transpose(...) around the scope
    inner = jaxpr_of(bf16_amp(jax.grad(loss), amp_policy=policy), W, X)
    dts = operand_dtypes(inner, "dot_general")
    assert ("float32", "float32") in dts and ("bfloat16", "bfloat16") in dts
    precise = [
        e for e in eqns_named(inner, "dot_general") if "precise" in str(e.source_info.name_stack)
    ]
    assert len(precise) >= 2  # forward and at least one backward matmul
    assert all(v.aval.dtype == F32 for e in precise for v in e.invars)


def test_amp_stop_as_context_and_decorator_and_amp_step():
    @autocast.amp_stop
    def precise(w, x):
        return x @ w

    def fn(w, x):
        a = precise(w, x)
        with autocast.amp_stop():
            b = a @ w
        with jax.named_scope("amp_step"):
            c = b @ w
        return c @ w

    assert operand_dtypes(jaxpr_of(bf16_amp(fn), W, X), "dot_general") == [
        ("float32", "float32")
    ] * 3 + [("bfloat16", "bfloat16")]


def test_scope_around_the_call_applies():
    f = bf16_amp(_matmul_chain)

    def caller(w, x):
        with autocast.amp_stop():
            return f(w, x)

    assert set(operand_dtypes(jaxpr_of(caller, W, X), "dot_general")) == {("float32", "float32")}


def test_named_scopes_survive_into_the_result():
    jaxpr = jaxpr_of(bf16_amp(_scoped), W, X)
    stacks = [str(e.source_info.name_stack) for e in eqns_named(jaxpr, "dot_general")]
    assert stacks == ["outer/inner", "outer", ""]


def test_unsupported_higher_order_primitive_is_named_unless_stopped():
    def fn(x):
        return lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] @ W), (0, x))[1]

    try:
        bf16_amp(fn)(X)
    except NotImplementedError as e:
        assert "'while'" in str(e) and "amp_stop" in str(e)
    else:  # supported by a later release: then it must run in bfloat16
        assert ("bfloat16", "bfloat16") in operand_dtypes(jaxpr_of(bf16_amp(fn), X), "dot_general")

    stopped = bf16_amp(autocast.amp_stop(fn))
    np.testing.assert_allclose(stopped(X), fn(X), rtol=1e-6)


# --- 3.5 eligibility --------------------------------------------------------------------------


def test_integers_and_booleans_are_never_cast():
    def fn(x, ids, mask):
        y = jnp.where(mask[:, None], x @ W, 0.0)
        return y, ids * 2 + 1, jnp.cumsum(ids)

    ids, mask = jnp.arange(3, dtype=jnp.int32), jnp.array([True, False, True])
    jaxpr = jaxpr_of(bf16_amp(fn), X, ids, mask)
    for e in eqns_named(jaxpr, "convert_element_type"):
        assert jnp.issubdtype(e.invars[0].aval.dtype, jnp.floating)
    _, i2, c = bf16_amp(fn)(X, ids, mask)
    np.testing.assert_array_equal(i2, ids * 2 + 1)
    np.testing.assert_array_equal(c, jnp.cumsum(ids))


def _enable_x64():
    # jax.enable_x64 is the newer spelling; older releases only have the experimental one
    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(True)
    from jax.experimental import enable_x64

    return enable_x64()


def test_float64_is_never_cast():
    with _enable_x64():
        w64 = np.asarray(W, np.float64)
        x64 = np.asarray(X, np.float64)
        jaxpr = jaxpr_of(bf16_amp(lambda w, x: jnp.exp(x @ w).sum()), w64, x64)
        assert operand_dtypes(jaxpr, "dot_general") == [("float64", "float64")]
        assert not eqns_named(jaxpr, "convert_element_type")


def test_weak_literals_follow_the_activation():
    jaxpr = jaxpr_of(bf16_amp(lambda w, x: jnp.tanh((x @ w) * 2.0 + 1.0)), W, X)
    assert operand_dtypes(jaxpr, "mul") == [("bfloat16", "bfloat16")]
    assert operand_dtypes(jaxpr, "tanh") == [("bfloat16",)]


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
def test_float32_extremes_in_a_mask_stay_finite_so_padded_rows_keep_finite_gradients(dtype):
    # Flax's and Equinox's attention fill masked logits with finfo(float32).min, which is -inf
    # in bfloat16 as in float16: the padded query row, masked whole, was a softmax of -infs
    # (NaN), and its gradient NaN even with the row left out of the loss
    valid = jnp.array([True, True, False])
    mask = valid[:, None] & valid[None, :]

    def loss(w, x):
        q = x @ w
        logits = jnp.where(mask, q @ q.T, jnp.finfo(jnp.float32).min)
        out = jax.nn.softmax(logits, axis=-1) @ q
        return jnp.sum(jnp.where(valid[:, None], out, 0.0) ** 2)

    amp_loss = autocast.amp(loss, compute_dtype=dtype)
    fills = [
        float(_literal(e.invars[0]))
        for e in eqns_named(jaxpr_of(amp_loss, W, X), "broadcast_in_dim")
        if _literal(e.invars[0]) is not None
    ]
    assert fills and all(np.isfinite(fills)) and min(fills) == float(jnp.finfo(dtype).min)
    want = jax.grad(loss)(W, X)
    for got in (jax.grad(amp_loss)(W, X), autocast.amp(jax.grad(loss), compute_dtype=dtype)(W, X)):
        assert bool(jnp.all(jnp.isfinite(got)))
        assert _measure.relative_error(got, want) < 0.05
    # a cast the program writes itself overflows, as on a device (the inner jit keeps the
    # cast in the program, which a cast of a NumPy scalar at trace time would not)
    inner = jax.jit(lambda c, x: x.sum() + c.astype(F16).astype(F32))
    wrote = lambda x: inner(np.finfo(np.float32).min, x)  # noqa: E731
    assert float(autocast.amp(wrote, compute_dtype=dtype)(X)) == -np.inf
    # and so does any other constant beyond the range: x * 1e5 in float16 is inf, which loss
    # scaling sees (at 65504 it would be a wrong finite number)
    times = jaxpr_of(autocast.amp(lambda w, x: (x @ w) * 1e5, compute_dtype=F16), W, X)
    big = [_literal(v) for e in eqns_named(times, "mul") for v in e.invars]
    assert [float(v) for v in big if v is not None] == [np.inf]


def _literal(var):
    """A literal's value, or None for a variable."""
    return _compat.literal_value(var) if isinstance(var, jax.extend.core.Literal) else None


def test_a_bias_follows_the_activation_but_parameters_do_not_follow_gradients():
    b = jnp.ones(4)

    def fn(w, b, x):
        return jnp.tanh(x @ w + b)

    assert operand_dtypes(jaxpr_of(bf16_amp(fn), W, b, X), "tanh") == [("bfloat16",)]

    def step(w, x):
        g = jax.grad(lambda w: (x @ w).sum())(w)
        return w - 0.1 * g  # a float32 parameter updated by a 16-bit gradient

    jaxpr = jaxpr_of(bf16_amp(step), W, X)
    assert operand_dtypes(jaxpr, "sub") == [("float32", "float32")]
    np.testing.assert_allclose(bf16_amp(step)(W, X), step(W, X), rtol=1e-2, atol=1e-2)


def test_user_casts_keep_their_target():
    def fn(w16, x):
        h = (x @ w16.astype(F32)).astype(BF16).astype(F32)  # both casts change a dtype
        return jnp.tanh(h), x.astype(F16) @ w16

    jaxpr = jaxpr_of(bf16_amp(fn), W.astype(F16), X)
    assert operand_dtypes(jaxpr, "tanh") == [("float32",)]
    to_f16 = [e for e in eqns_named(jaxpr, "convert_element_type") if e.params["new_dtype"] == F16]
    assert F32 in [e.invars[0].aval.dtype for e in to_f16]  # the user's x.astype(F16)
    assert bf16_amp(fn)(W.astype(F16), X)[1].dtype == F16


def test_a_cast_that_changes_nothing_leaves_no_trace():
    # documented limitation: astype(float32) on a float32 value is not in the jaxpr at all
    jaxpr = jaxpr_of(bf16_amp(lambda w, x: jnp.tanh((x @ w).astype(F32))), W, X)
    assert operand_dtypes(jaxpr, "tanh") == [("bfloat16",)]


def test_random_numbers_are_untouched():
    def fn(key, x):
        noise = jax.random.normal(key, x.shape)
        keep = jax.random.bernoulli(key, 0.5, x.shape)
        return noise, keep, jnp.where(keep, x @ W, 0.0)

    key = jax.random.PRNGKey(3)
    got, want = bf16_amp(fn)(key, X), fn(key, X)
    # the bits are drawn alike; the normal's float32 transformation of them is compiled under
    # amp and eager here, so equal to float32's rounding
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(got[1], want[1])


@pytest.mark.slow
def test_float32_compute_is_bit_identical_on_a_transformer():
    params = _models.init_gpt(jax.random.PRNGKey(0))
    tokens = _models.gpt_batch(jax.random.PRNGKey(1))
    f = _models.gpt_loss
    a = autocast.amp(f, compute_dtype=F32)
    # the contract on every backend: the very program f compiles to, forward and backward
    assert program_text(a, params, tokens) == program_text(f, params, tokens)
    assert program_text(jax.grad(a), params, tokens) == program_text(jax.grad(f), params, tokens)
    # amp called on concrete values runs one compiled program, so it is compared with jit(f):
    # f's own op-by-op evaluation can differ from its compiled result in the last bit
    ga, gf = jax.jit(jax.grad(a))(params, tokens), jax.jit(jax.grad(f))(params, tokens)
    pairs = [(a(params, tokens), jax.jit(f)(params, tokens))]
    pairs += zip(jax.tree_util.tree_leaves(ga), jax.tree_util.tree_leaves(gf))
    for x, y in pairs:
        if DETERMINISTIC:
            np.testing.assert_array_equal(x, y)
        else:  # the embedding's gradient is a scatter-add, summed in a varying order
            np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)


def test_custom_jvp_rules_are_kept():
    # jax.nn.relu's own rule says the derivative at 0 is 0; differentiating max(x, 0) would not
    g = jax.grad(lambda x: bf16_amp(lambda x: jax.nn.relu(x).sum())(x))(jnp.zeros(3))
    np.testing.assert_array_equal(g, jnp.zeros(3))

    @jax.custom_jvp
    def double_grad(x):
        return x @ W

    @double_grad.defjvp
    def _(primals, tangents):
        (x,), (t,) = primals, tangents
        return x @ W, 2.0 * (t @ W)

    def loss(x):
        return double_grad(x).sum()

    np.testing.assert_allclose(jax.grad(bf16_amp(loss))(X), jax.grad(loss)(X), rtol=2e-2)
    jaxpr = jaxpr_of(jax.grad(bf16_amp(loss)), X)
    assert set(operand_dtypes(jaxpr, "dot_general")) == {("bfloat16", "bfloat16")}


def test_scatter_combiner_is_retyped():
    def fn(table, ids):
        return jnp.zeros_like(table).at[ids].add(table[ids] * 2.0).sum()

    table = X.astype(BF16)
    ids = jnp.array([0, 2, 2])
    policy = {**autocast.default_amp_policy, lax.scatter_add_p: autocast.use_input_precision}
    out = jax.jit(bf16_amp(fn, amp_policy=policy))(table, ids)
    np.testing.assert_allclose(float(out), float(fn(table, ids)), rtol=1e-2)
    grads = jax.jit(jax.grad(bf16_amp(lambda t: fn(t.astype(F32), ids))))(X)
    assert grads.dtype == F32


# --- 3.7 composition --------------------------------------------------------------------------


def _close(a, b, rtol=2e-2, atol=2e-2):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(
            np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=rtol, atol=atol
        )


def test_jit_on_either_side_agrees():
    a = jax.jit(bf16_amp(_matmul_chain))(W, X)
    # eager evaluation rounds after every operation, XLA's fusions do not: close, not equal
    _close(bf16_amp(_matmul_chain)(W, X), a, rtol=1e-2, atol=1e-2)
    _close(jax.jit(bf16_amp(jax.jit(_matmul_chain)))(W, X), a, rtol=0, atol=0)
    jaxpr = jaxpr_of(bf16_amp(jax.jit(_matmul_chain)), W, X)
    assert set(operand_dtypes(jaxpr, "dot_general")) == {("bfloat16", "bfloat16")}


def test_grad_on_either_side_agrees_and_backward_matmuls_are_16_bit():
    loss = lambda w, x: _matmul_chain(w, x).sum()  # noqa: E731
    outer = jax.grad(bf16_amp(loss))(W, X)
    inner = bf16_amp(jax.grad(loss))(W, X)
    _close(outer, jax.grad(loss)(W, X), rtol=5e-2, atol=5e-2)
    _close(inner, outer, rtol=5e-2, atol=5e-2)
    for fn in (jax.grad(bf16_amp(loss)), bf16_amp(jax.grad(loss))):
        dts = operand_dtypes(jaxpr_of(fn, W, X), "dot_general")
        assert len(dts) >= 4 and set(dts) == {("bfloat16", "bfloat16")}


def test_value_and_grad_with_aux_on_either_side():
    def loss(w, x):
        y = _matmul_chain(w, x)
        return y.sum(), {"mean": y.mean(), "n": 3}

    (v1, aux1), g1 = jax.value_and_grad(bf16_amp(loss), has_aux=True)(W, X)
    (v2, aux2), g2 = bf16_amp(jax.value_and_grad(loss, has_aux=True))(W, X)
    (v3, aux3), g3 = jax.value_and_grad(loss, has_aux=True)(W, X)
    assert aux1["n"] == aux2["n"] == 3
    _close((v1, aux1["mean"], g1), (v3, aux3["mean"], g3), rtol=5e-2, atol=5e-2)
    _close((v2, aux2["mean"], g2), (v3, aux3["mean"], g3), rtol=5e-2, atol=5e-2)


def test_vmap_on_either_side_agrees():
    xs = jnp.stack([X, X * 0.5])
    outer = jax.jit(jax.vmap(bf16_amp(_matmul_chain), in_axes=(None, 0)))(W, xs)
    inner = jax.jit(bf16_amp(jax.vmap(_matmul_chain, in_axes=(None, 0))))(W, xs)
    _close(outer, inner, rtol=0, atol=0)
    _close(outer, jax.vmap(_matmul_chain, in_axes=(None, 0))(W, xs))


@pytest.mark.slow
def test_amp_over_a_whole_train_step():
    params = _models.init_mlp(jax.random.PRNGKey(0), (4, 8, 3))
    x = jax.random.normal(jax.random.PRNGKey(1), (16, 4))
    y = jnp.arange(16) % 3

    def step(params, x, y):
        loss, grads = jax.value_and_grad(_models.mlp_loss)(params, x, y)
        return jax.tree_util.tree_map(lambda p, g: p - 0.5 * g, params, grads), loss

    amp_step = jax.jit(bf16_amp(step))
    plain_step = jax.jit(step)
    p_amp, p_ref = params, params
    for _ in range(20):
        p_amp, loss_amp = amp_step(p_amp, x, y)
        p_ref, loss_ref = plain_step(p_ref, x, y)
    assert jax.tree_util.tree_map(lambda p: p.dtype, p_amp) == jax.tree_util.tree_map(
        lambda p: p.dtype, params
    )
    assert float(loss_amp) < 0.8 * float(_models.mlp_loss(params, x, y))
    np.testing.assert_allclose(float(loss_amp), float(loss_ref), rtol=5e-2)
    jaxpr = jaxpr_of(bf16_amp(step), params, x, y)
    assert set(operand_dtypes(jaxpr, "dot_general")) == {("bfloat16", "bfloat16")}


# --- 3.8 errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (
            dict(compute_dtype=jnp.int8),
            TypeError,
            "compute_dtype must be a floating-point dtype.*int8",
        ),
        (dict(compute_dtype="bf17"), ValueError, "(?i)unknown dtype 'bf17'"),
        (dict(amp_policy=[1]), TypeError, "amp_policy must be a dict"),
        (dict(amp_policy={3: autocast.use_original_precision}), TypeError, "key 3 is neither"),
        (
            dict(amp_policy={"scope": "fp32"}),
            TypeError,
            r"amp_policy\['scope'\] must be a precision function",
        ),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        autocast.amp(_matmul_chain, **kwargs)


def test_amp_rejects_non_callables():
    with pytest.raises(TypeError, match="amp expects a callable, got int"):
        autocast.amp(3)
    with pytest.raises(TypeError, match="amp_stop decorates a callable"):
        autocast.amp_stop(3)


def test_precision_function_returning_wrong_count_is_named():
    def drops_one(compute_dtype, original_dtypes, *invars, **params):
        return invars[:1], params

    f = bf16_amp(_matmul_chain, amp_policy={lax.dot_general_p: drops_one})
    with pytest.raises(
        ValueError,
        match="precision function drops_one returned 1 inputs for primitive 'dot_general', "
        "which takes 2",
    ):
        f(W, X)


def test_precision_function_returning_garbage_is_named():
    def garbage(compute_dtype, original_dtypes, *invars, **params):
        return list(invars)

    f = bf16_amp(_matmul_chain, amp_policy={lax.tanh_p: garbage})
    with pytest.raises(TypeError, match="precision function garbage must return"):
        f(W, X)
