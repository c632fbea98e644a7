"""amp meets what newer JAX versions bring: the ``jax_*3`` options, under which
``jax.checkpoint``, ``lax.scan`` and the custom-derivative functions become hijax operations
(one primitive, ``call_hi_primitive``, binds an object of a class per operation); users' own
hijax operations; ``Ref``s; block-scaled products; explicit sharding. Each test runs where the
installed JAX has what it tests and is skipped elsewhere. The options are checked on a few
small programs that hold every construct, not by running the suite again under each, which
would add a whole suite's time to CI per option; these tests take seconds."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import eqns_named, hijax_base, hijax_cube, jaxpr_of, operand_dtypes
from jax import lax
from jax.ad_checkpoint import checkpoint_name

import autocast

BF16, F32 = jnp.bfloat16, jnp.float32
W = jnp.linspace(-0.5, 0.5, 16, dtype=F32).reshape(4, 4)
X = jnp.linspace(-1, 1, 12, dtype=F32).reshape(3, 4)
XS = jnp.linspace(-1, 1, 24, dtype=F32).reshape(2, 3, 4)  # two steps of a scan

OPTIONS = ("jax_remat3", "jax_scan3", "jax_custom_vjp3", "jax_custom_jvp3")


def _set_option(name: str):
    """Turns the JAX option ``name`` on until the returned function is called (the test is
    skipped where the installed JAX has no such option)."""
    if not hasattr(jax.config, name):
        pytest.skip(f"JAX {jax.__version__} has no {name}")
    before = getattr(jax.config, name)
    jax.config.update(name, True)
    return lambda: jax.config.update(name, before)


@pytest.fixture(params=OPTIONS)
def option(request):
    """Each of JAX's ``jax_*3`` options in turn, on for the test (JAX includes them in its
    trace caches' keys, so nothing traced under one leaks into another test)."""
    restore = _set_option(request.param)
    yield request.param
    restore()


@pytest.fixture
def remat3():
    restore = _set_option("jax_remat3")
    yield
    restore()


def bf16_amp(fn):
    return autocast.amp(fn, compute_dtype=BF16)


def _products(jaxpr):
    return set(operand_dtypes(jaxpr, "dot_general"))


def _hijax(jaxpr, name):
    """The equations of ``jaxpr`` that bind the hijax operation of class ``name``."""
    eqns = eqns_named(jaxpr, "call_hi_primitive")
    return [e for e in eqns if type(e.params["_prim"]).__name__ == name]


def _close(got, want, tol):
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert g.dtype == w.dtype
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=tol, atol=tol)


# --- every construct under each option ---------------------------------------------------------


def _tanh_matmul():
    """A custom_vjp function, made anew: JAX 0.10 reads ``jax_custom_vjp3`` when one is
    made, 0.12 when one is called."""

    @jax.custom_vjp
    def tanh_matmul(x, w):
        return jnp.tanh(x @ w)

    def fwd(x, w):
        y = jnp.tanh(x @ w)
        return y, (x, w, y)

    def bwd(res, g):
        x, w, y = res
        d = g * (1 - y * y) * 3.0  # not the true derivative: the gradient shows the rule ran
        return d @ w.T, x.T @ d

    tanh_matmul.defvjp(fwd, bwd)
    return tanh_matmul


def _model(w, xs):
    """A scanned, checkpointed block holding a custom_vjp function, a custom_jvp one
    (``jax.nn.relu``) and a jitted helper: the issue's model, whose gradient ran wholly in
    float32 under amp with ``jax_remat3``."""

    tanh_matmul = _tanh_matmul()

    def block(c, x):
        h = jax.nn.relu((c + x) @ w)
        return tanh_matmul(h, w) + jax.jit(jnp.sin)(h)

    def step(c, x):
        return jax.checkpoint(block)(c, x), None

    c, _ = lax.scan(step, xs[0], xs)
    return jnp.sum(c * c)


def _jax_can(transformed, *args):
    """Whether JAX itself can apply the transformation ``transformed`` wraps: under
    ``jax_scan3`` (JAX 0.10 to 0.12) its Scan3 has no reverse-mode rule, and no batching
    rule on 0.10."""
    try:
        jax.eval_shape(transformed, *args)
    except NotImplementedError:
        return False
    return True


def test_every_construct_runs_its_products_in_16_bit_under_each_option(option):
    amp_model = bf16_amp(_model)
    assert _products(jaxpr_of(amp_model, W, XS)) == {("bfloat16", "bfloat16")}
    _close(jax.jit(amp_model)(W, XS), jax.jit(_model)(W, XS), 5e-2)
    grad = jax.grad(amp_model, argnums=(0, 1))
    batched = jax.vmap(amp_model, (None, 0))
    batch = jnp.stack([XS, XS[::-1]])  # two sequences
    checks = (
        (grad, jax.grad(_model, argnums=(0, 1)), (W, XS), 1e-1),
        (batched, jax.vmap(_model, (None, 0)), (W, batch), 5e-2),
    )
    for amp_fn, fn, args, tol in checks:
        if not _jax_can(fn, *args):
            assert option == "jax_scan3"
            with pytest.raises(NotImplementedError):  # as without amp
                jax.eval_shape(amp_fn, *args)
            continue
        assert _products(jaxpr_of(amp_fn, *args)) == {("bfloat16", "bfloat16")}
        _close(jax.jit(amp_fn)(*args), jax.jit(fn)(*args), tol)


def test_the_numerics_debugger_sees_every_equation_under_each_option(option):
    if option == "jax_scan3":
        pytest.skip("the debugger does not look inside a Scan3 (JAX cannot differentiate one)")
    restore_option = getattr(jax.config, option)
    jax.config.update(option, False)
    try:
        want = autocast.diagnose(_model, compute_dtype=BF16)(W, XS)
    finally:
        jax.config.update(option, restore_option)
    got = autocast.diagnose(_model, compute_dtype=BF16)(W, XS)
    # the checkpoint's, the custom functions' and the marks' equations, as without the option
    assert [e.primitive for e in got.entries] == [e.primitive for e in want.entries]
    assert got.output_error < 0.05


# --- jax.checkpoint under jax_remat3 -----------------------------------------------------------


def test_a_remat3_checkpoint_keeps_its_policy_and_names_and_saves_in_16_bit(remat3):
    policy = jax.checkpoint_policies.save_only_these_names("hidden")

    def block(x):
        h = checkpoint_name(jnp.tanh(x @ W), "hidden")
        return jnp.tanh(h @ W)

    fn = jax.checkpoint(block, policy=policy)
    jaxpr = jaxpr_of(bf16_amp(fn), X)
    (remat,) = _hijax(jaxpr, "RematTraced")
    assert remat.params["_prim"].params["policy"] is policy
    (name,) = _hijax(jaxpr, "CheckpointName")
    assert name.params["_prim"].params["name"] == "hidden"
    assert name.invars[0].aval.dtype == jnp.dtype(BF16)  # the mark does not upcast
    # the policy still decides what the backward pass keeps: the named value, in bfloat16
    res = jax.eval_shape(lambda x: jax.vjp(bf16_amp(fn), x)[1], X)
    saved = {(r.shape, r.dtype) for r in jax.tree_util.tree_leaves(res)}
    assert ((3, 4), jnp.dtype(BF16)) in saved
    assert ((3, 4), jnp.dtype(F32)) in saved  # the input, as without amp
    grad = jax.grad(lambda x: jnp.sum(bf16_amp(fn)(x)))
    assert _products(jaxpr_of(grad, X)) == {("bfloat16", "bfloat16")}
    _close(jax.jit(grad)(X), jax.jit(jax.grad(lambda x: jnp.sum(fn(x))))(X), 5e-2)


def test_an_amp_function_traces_again_when_a_jax_option_changes():
    # the checkpoint made at each trace: JAX 0.10 reads jax_remat3 when one is made
    fn = bf16_amp(lambda x: jax.checkpoint(lambda y: jnp.tanh(y @ W))(x))
    assert not _hijax(jaxpr_of(fn, X), "RematTraced")
    restore = _set_option("jax_remat3")
    try:  # not the trace made without the option, as jax.jit would not reuse it either
        assert _hijax(jaxpr_of(fn, X), "RematTraced")
    finally:
        restore()


def test_a_remat3_checkpoint_keeps_a_prevent_cse_given_per_input(remat3):
    fn = jax.checkpoint(lambda x, w: jnp.tanh(x @ w), prevent_cse=(True, False))
    try:
        recorded = _hijax(jaxpr_of(fn, X, W), "RematTraced")[0].params["_prim"]
    except (TypeError, ValueError, NotImplementedError):
        pytest.skip(f"JAX {jax.__version__} takes prevent_cse as one flag under jax_remat3")
    if "prevent_cse" not in recorded.params:
        pytest.skip(f"JAX {jax.__version__}'s RematTraced keeps no prevent_cse")
    (remat,) = _hijax(jaxpr_of(bf16_amp(fn), X, W), "RematTraced")
    cse = remat.params["_prim"].params["prevent_cse"]
    # one flag per input of the re-traced body: its constants first, then the user's
    assert tuple(cse[-2:]) == (True, False) and not any(cse[:-2])


# --- custom derivatives under jax_custom_vjp3 and jax_custom_jvp3 -------------------------------


def test_a_custom_vjp3_function_runs_its_rules_under_the_policy():
    restore = _set_option("jax_custom_vjp3")
    try:
        tanh_matmul = _tanh_matmul()
        loss = lambda x, w: jnp.sum(tanh_matmul(x @ w, w))  # noqa: E731
        (call,) = _hijax(jaxpr_of(bf16_amp(loss), X, W), "CustomVJPTraced")
        assert [v.aval.dtype for v in call.invars] == [jnp.dtype(BF16), jnp.dtype(F32)]
        jaxpr = jaxpr_of(jax.grad(bf16_amp(loss), argnums=(0, 1)), X, W)
        assert _products(jaxpr) == {("bfloat16", "bfloat16")}
        got = jax.grad(bf16_amp(loss), argnums=(0, 1))(X, W)
        _close(got, jax.grad(loss, argnums=(0, 1))(X, W), 1e-1)  # the rule's factor 3 in both
    finally:
        restore()


def test_a_custom_jvp3_function_takes_its_16_bit_input_as_it_is():
    restore = _set_option("jax_custom_jvp3")
    try:
        fn = lambda x: jax.nn.relu(x @ W) @ W  # noqa: E731
        jaxpr = jaxpr_of(bf16_amp(fn), X)
        (relu,) = _hijax(jaxpr, "CustomJVPTraced")
        assert relu.invars[0].aval.dtype == jnp.dtype(BF16)
        grad = jax.grad(lambda x: jnp.sum(bf16_amp(fn)(x)))
        assert _products(jaxpr_of(grad, X)) == {("bfloat16", "bfloat16")}
        _close(jax.jit(grad)(X), jax.grad(lambda x: jnp.sum(fn(x)))(X), 5e-2)
    finally:
        restore()


def test_custom_rematerialisation_rules_are_refused_by_name(remat3):
    restore = _set_option("jax_custom_vjp3")
    try:
        f = jax.custom_vjp(lambda x: jnp.tanh(x @ W))
        if not hasattr(f, "defremat"):
            pytest.skip(f"JAX {jax.__version__} has no custom_vjp.defremat")
        f.defremat(
            lambda x: (jnp.tanh(x @ W), (x,)),
            lambda res, x: (jnp.tanh(x @ W), (jnp.tanh(x @ W),)),
            lambda res, g: ((g * (1 - res[0] ** 2)) @ W.T,),
        )
        loss = lambda x: jnp.sum(jax.checkpoint(f)(x))  # noqa: E731
        with pytest.raises(NotImplementedError, match="defremat.*amp_stop"):
            jax.grad(bf16_amp(loss))(X)
        # under amp_stop it runs as written, in float32
        got = jax.grad(bf16_amp(autocast.amp_stop(loss)))(X)
        np.testing.assert_allclose(got, jax.grad(loss)(X), rtol=1e-6)
    finally:
        restore()


# --- lax.scan under jax_scan3 -------------------------------------------------------------------


def test_a_scan3_body_runs_under_the_policy_and_its_carry_keeps_its_dtype():
    restore = _set_option("jax_scan3")
    try:

        def fn(w, xs):
            def body(c, x):
                h = jnp.tanh((c + x) @ w)
                return h, h @ w

            c, ys = lax.scan(body, xs[0], xs)
            return c, ys

        jaxpr = jaxpr_of(bf16_amp(fn), W, XS)
        (scan,) = _hijax(jaxpr, "Scan3")
        assert _products(jaxpr) == {("bfloat16", "bfloat16")}
        # the carry is a Ref made from the float32 input, which every write is cast back to
        (ref,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "new_ref"]
        assert ref.outvars[0].aval.inner_aval.dtype == jnp.dtype(F32)
        c, ys = jax.jit(bf16_amp(fn))(W, XS)
        assert (c.dtype, ys.dtype) == (jnp.dtype(F32), jnp.dtype(F32))
        _close((c, ys), jax.jit(fn)(W, XS), 5e-2)
    finally:
        restore()


# --- users' hijax operations (jax.experimental.hijax) -------------------------------------------


def test_a_users_hijax_operation_runs_in_original_precision_or_is_refused():
    Cube = hijax_cube()

    class Apply(hijax_base()):  # carries a jaxpr, which amp cannot see how the operation uses
        def __init__(self, closed, aval):
            self.in_avals, self.out_aval = (aval,), aval
            self.params = {"closed": closed}
            super().__init__()

        def expand(self, x):
            return jax.core.eval_jaxpr(self.closed.jaxpr, self.closed.consts, x)[0]

    cube = lambda x: Cube(jax.typeof(x @ W))(x @ W) @ W  # noqa: E731
    jaxpr = jaxpr_of(bf16_amp(cube), X)
    (eqn,) = _hijax(jaxpr, "Cube")
    assert eqn.invars[0].aval.dtype == jnp.dtype(F32)  # unlisted: the program's dtype
    assert _products(jaxpr) == {("bfloat16", "bfloat16")}
    _close(jax.jit(bf16_amp(cube))(X), cube(X), 5e-2)

    closed = jax.make_jaxpr(lambda x: jnp.tanh(x @ W))(X)
    apply = lambda x: Apply(closed, jax.typeof(x))(x)  # noqa: E731
    with pytest.raises(NotImplementedError, match="hijax operation Apply.*amp_stop"):
        jaxpr_of(bf16_amp(apply), X)
    (eqn,) = _hijax(jaxpr_of(bf16_amp(autocast.amp_stop(apply)), X), "Apply")
    assert eqn.invars[0].aval.dtype == jnp.dtype(F32)


# --- Refs, block-scaled products, explicit sharding ---------------------------------------------


def test_a_ref_keeps_the_dtype_the_program_made_it_with():
    if not hasattr(jax, "new_ref"):
        pytest.skip(f"JAX {jax.__version__} has no jax.new_ref")

    def fn(w, x):
        acc = jax.new_ref(jnp.zeros((3, 4)))
        jax.ref.addupdate(acc, ..., x @ w)
        acc[...] = jnp.tanh(acc[...]) @ w
        return acc[...]

    jaxpr = jaxpr_of(bf16_amp(fn), W, X)
    assert _products(jaxpr) == {("bfloat16", "bfloat16")}
    # get, swap and addupdate are unlisted: a value written is cast to the Ref's float32
    for name in ("addupdate", "swap"):
        for eqn in eqns_named(jaxpr, name):
            assert eqn.invars[0].aval.inner_aval.dtype == eqn.invars[1].aval.dtype == F32
    _close(jax.jit(bf16_amp(fn))(W, X), fn(W, X), 5e-2)
    _close(
        jax.grad(lambda w: jnp.sum(bf16_amp(fn)(w, X)))(W),
        jax.grad(lambda w: jnp.sum(fn(w, X)))(W),
        1e-1,
    )
    # the debugger's float32 reference would write the same Ref: refused, by name
    with pytest.raises(NotImplementedError, match="Refs.*new_ref.*autocast.report"):
        autocast.diagnose(fn, compute_dtype=BF16)(W, X)


def test_a_block_scaled_product_keeps_the_operands_it_was_given():
    if not hasattr(lax, "scaled_dot"):
        pytest.skip(f"JAX {jax.__version__} has no lax.scaled_dot")
    e4m3, e8m0 = jnp.float8_e4m3fn, jnp.float8_e8m0fnu
    lhs = jnp.linspace(-1, 1, 256, dtype=F32).reshape(1, 4, 64)
    rhs = jnp.linspace(-1, 1, 512, dtype=F32).reshape(1, 64, 8)
    lhs_scale, rhs_scale = jnp.ones((1, 4, 2), e8m0), jnp.ones((1, 2, 8), e8m0)
    w = jnp.eye(64, dtype=F32) * 0.5

    def fn(x, r):
        h = x @ w  # amp's bfloat16: the user's cast to float8 still decides the operand
        return lax.scaled_dot(
            h.astype(e4m3),
            r.astype(e4m3),
            lhs_scale=lhs_scale,
            rhs_scale=rhs_scale,
            preferred_element_type=F32,
        )

    jaxpr = jaxpr_of(bf16_amp(fn), lhs, rhs)
    assert operand_dtypes(jaxpr, "scaled_dot") == [
        ("float8_e4m3fn", "float8_e4m3fn", "float8_e8m0fnu", "float8_e8m0fnu")
    ]
    (eqn,) = eqns_named(jaxpr, "scaled_dot")
    assert eqn.params["preferred_element_type"] == jnp.dtype(F32)
    got = jax.jit(bf16_amp(fn))(lhs, rhs)
    assert got.dtype == jnp.dtype(F32)
    _close(got, jax.jit(fn)(lhs, rhs), 0.2)  # float8 operands either way


def test_products_keep_their_out_sharding_under_explicit_axes():
    if not hasattr(jax, "set_mesh"):
        pytest.skip("explicit sharding needs jax.set_mesh (JAX 0.7+)")
    from jax.sharding import AxisType, PartitionSpec

    mesh = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Explicit,))

    def fn(w, x):
        y = jnp.dot(x, w, out_sharding=PartitionSpec("x", None))
        return jnp.tanh(jnp.einsum("ij,jk->ik", y, w, out_sharding=PartitionSpec(None, "x")))

    with jax.set_mesh(mesh):
        x = jax.device_put(X, PartitionSpec("x", None))
        want = [e.params["out_sharding"] for e in eqns_named(jaxpr_of(fn, W, x), "dot_general")]
        jaxpr = jaxpr_of(bf16_amp(fn), W, x)
        got = [e.params["out_sharding"] for e in eqns_named(jaxpr, "dot_general")]
        assert got == want and all(s is not None for s in got)
        assert _products(jaxpr) == {("bfloat16", "bfloat16")}
        out = jax.jit(bf16_amp(fn))(W, x)
        assert jax.typeof(out).sharding.spec == PartitionSpec(None, "x")
        _close(out, jax.jit(fn)(W, x), 5e-2)


def test_a_custom_root_operation_runs_in_original_precision():
    def fn(x):
        h = x @ W  # bfloat16 under amp; the solve takes it back in float32
        return lax.custom_root(lambda y: y - h, h, lambda g, y0: y0 * 0.0, lambda g, y: y)

    if not _hijax(jaxpr_of(fn, X), "CustomRoot"):
        pytest.skip(f"JAX {jax.__version__}'s custom_root is no hijax operation")
    (root,) = _hijax(jaxpr_of(bf16_amp(fn), X), "CustomRoot")
    assert {v.aval.dtype for v in root.invars} == {jnp.dtype(F32)}
    _close(jax.jit(bf16_amp(fn))(X), fn(X), 5e-2)
