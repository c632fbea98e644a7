"""amp on code it did not write: custom rules that close over traced values, the Equinox
scientific stack (diffrax, optimistix, lineax) and Pallas kernels.

Every case is checked three ways against float32: the forward value, ``grad(amp(f))`` and
``amp(grad(f))``; gradients must come back in the primal dtypes and within bfloat16 noise.
"""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, load_script, require

import autocast
from autocast import _compat
from autocast._src.tools import measure as _measure

BF16 = jnp.bfloat16
KEYS = jax.random.split(jax.random.key(7), 8)


def dtypes(tree):
    return [x.dtype for x in jax.tree_util.tree_leaves(tree)]


def all_eqns(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs it carries, however deeply nested."""
    for e in jaxpr.eqns:
        yield e
        for v in e.params.values():
            for x in v if isinstance(v, (tuple, list)) else (v,):
                if isinstance(x, jax.extend.core.ClosedJaxpr):
                    yield from all_eqns(x.jaxpr)
                elif isinstance(x, jax.extend.core.Jaxpr):
                    yield from all_eqns(x)


def matmul_dtypes(jaxpr) -> set:
    """The operand dtypes of every dot_general, however deeply nested."""
    found = set()

    def walk(j):
        for e in j.eqns:
            if e.primitive.name == "dot_general":
                found.update(v.aval.dtype for v in e.invars)
            for v in e.params.values():
                for x in v if isinstance(v, (tuple, list)) else (v,):
                    if isinstance(x, jax.extend.core.ClosedJaxpr):
                        walk(x.jaxpr)
                    elif isinstance(x, jax.extend.core.Jaxpr):
                        walk(x)

    walk(jaxpr.jaxpr)
    return found


def check_three_ways(loss, args, *, tol, argnums=0, also=()):
    """Forward, grad(amp(f)) and amp(grad(f)) against float32, compiled together (one
    compilation keeps the suite fast); returns the two gradient errors. ``also``: more
    functions of ``args`` whose gradients must match float32's too (in the same program)."""
    amp_loss = autocast.amp(loss, compute_dtype=BF16)
    grad = lambda f: eqx.filter_grad(f) if argnums == 0 else jax.grad(f, argnums)  # noqa: E731
    # the float32 reference's value and gradient from one trace (a solver's trace is most of
    # a test's time); amp's forward runs on its own, outside any differentiation
    reference = (
        eqx.filter_value_and_grad(loss) if argnums == 0 else jax.value_and_grad(loss, argnums)
    )

    @eqx.filter_jit
    def everything(*args):
        return (
            reference(*args),
            amp_loss(*args),
            grad(amp_loss)(*args),
            autocast.amp(grad(loss), compute_dtype=BF16)(*args),
            [grad(f)(*args) for f in also],
        )

    (value, want), amp_value, outside, inside, more = everything(*args)
    assert abs(float(amp_value) - float(value)) <= tol * abs(float(value)) + 1e-6
    errors = []
    for got in (outside, inside, *more):
        assert dtypes(got) == dtypes(want)
        errors.append(_measure.relative_error(got, want))
    assert max(errors) < tol, errors
    return errors


# --- custom rules that close over traced values ---------------------------------------------------

W = jax.random.normal(KEYS[0], (16, 8)) / 4
X = jax.random.normal(KEYS[1], (4, 16))


def custom_gradient_loss(x, w):
    w2 = w * 1.5  # a value computed inside the loss: the rule closes over a traced intermediate

    @jax.custom_gradient
    def project(x):
        return x @ w2, lambda g: (g @ w2.T,)

    return jnp.sum(jnp.tanh(project(x)) ** 2)


def custom_vjp_loss(x, w):
    w2 = w * 1.5

    @jax.custom_vjp
    def layer(x):
        return jnp.tanh(x @ w2)

    def fwd(x):
        y = jnp.tanh(x @ w2)
        return y, (y,)

    def bwd(res, g):
        (y,) = res
        return ((g * (1 - y**2)) @ w2.T,)

    layer.defvjp(fwd, bwd)
    return jnp.sum(layer(x) ** 2)


def custom_jvp_loss(x, w):
    @jax.custom_jvp
    def layer(x):
        return jnp.sin(x @ w)

    @layer.defjvp
    def layer_jvp(primals, tangents):
        (x,), (dx,) = primals, tangents
        return jnp.sin(x @ w), jnp.cos(x @ w) * (dx @ w)

    return jnp.sum(layer(x) ** 2)


CLOSURES = [custom_gradient_loss, custom_vjp_loss, custom_jvp_loss]


@pytest.mark.parametrize("loss", CLOSURES, ids=lambda f: f.__name__)
def test_rules_closing_over_traced_values(loss):
    check_three_ways(loss, (X, W), tol=0.05)


@pytest.mark.parametrize("loss", CLOSURES, ids=lambda f: f.__name__)
def test_closure_rules_run_under_the_policy(loss):
    # The rules' own matrix products run in bfloat16 too, not only the primal's.
    jaxpr = jax.make_jaxpr(jax.grad(autocast.amp(loss, compute_dtype=BF16)))(X, W)
    assert matmul_dtypes(jaxpr) == {np.dtype(BF16)}


@pytest.mark.parametrize("loss", CLOSURES, ids=lambda f: f.__name__)
def test_differentiating_a_closed_over_value_is_a_clear_error(loss):
    with pytest.raises(ValueError, match="close over"):
        jax.grad(autocast.amp(loss), argnums=1)(X, W)


def test_closure_rules_under_vmap_and_jit():
    amp_loss = autocast.amp(custom_vjp_loss, compute_dtype=BF16)
    per_example = jax.jit(jax.vmap(jax.grad(amp_loss), in_axes=(0, None)))(X[:, None], W)
    want = jax.vmap(jax.grad(custom_vjp_loss), in_axes=(0, None))(X[:, None], W)
    assert _measure.relative_error(per_example, want) < 0.05


def symbolic_zeros_loss(x, w):
    # A rule asking for symbolic zeros, whose residuals depend on what is perturbed.
    w2 = w * 1.5

    @jax.custom_vjp
    def layer(x):
        return jnp.tanh(x @ w2)

    def fwd(x):
        return jnp.tanh(x.value @ w2), (x.value if x.perturbed else None)

    def bwd(x, g):
        return jax.vjp(lambda x: jnp.tanh(x @ w2), x)[1](g)

    layer.defvjp(fwd, bwd, symbolic_zeros=True)
    return jnp.sum(layer(x) ** 2)


def equinox_custom_vjp_loss(x, w):
    w2 = w * 1.5

    @eqx.filter_custom_vjp
    def layer(x, scale):
        return jnp.tanh(x @ w2) * scale

    @layer.def_fwd
    def layer_fwd(perturbed, x, scale):
        return jnp.tanh(x @ w2) * scale, (x if perturbed else None)

    @layer.def_bwd
    def layer_bwd(res, g, perturbed, x, scale):
        return jax.vjp(lambda x: jnp.tanh(x @ w2) * scale, x)[1](g)[0]

    return jnp.sum(layer(x, 2.0) ** 2)


@pytest.mark.parametrize(
    "loss", [symbolic_zeros_loss, equinox_custom_vjp_loss], ids=lambda f: f.__name__
)
def test_closures_in_rules_that_ask_for_symbolic_zeros(loss):
    check_three_ways(loss, (X, W), tol=0.05)


def test_a_rule_without_closures_is_not_traced_early():
    # Finding closures must not cost every relu a trace of its rule, nor run user rules
    # that differentiation never asks for.
    calls = []

    @jax.custom_vjp
    def f(x):
        return jnp.sin(x)

    def fwd(x):
        calls.append("fwd")
        return jnp.sin(x), x

    def bwd(x, g):
        calls.append("bwd")
        return (g * jnp.cos(x),)

    f.defvjp(fwd, bwd)
    jax.make_jaxpr(autocast.amp(lambda x: f(x @ W) * 2))(X)
    assert calls == []


def test_a_rule_without_closures_is_left_alone():
    # jax.nn.relu's rule closes over nothing traced: the equation is JAX's own, unrewritten.
    jaxpr = jax.make_jaxpr(autocast.amp(lambda x: jax.nn.relu(x @ W), compute_dtype=BF16))(X)
    calls = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "custom_jvp_call"]
    assert len(calls) == 1 and len(calls[0].invars) == 1


def test_custom_vjp_inside_custom_jvp_differentiates():
    @jax.custom_vjp
    def inner(x):
        return jnp.tanh(x)

    inner.defvjp(lambda x: (jnp.tanh(x), jnp.tanh(x)), lambda y, g: (g * (1 - y**2),))

    @jax.custom_jvp
    def outer(x):
        return inner(x)

    @outer.defjvp
    def outer_jvp(p, t):
        return jax.jvp(inner, p, t)

    loss = lambda x, w: jnp.sum(outer(x @ w) ** 2)  # noqa: E731
    check_three_ways(loss, (X, W), tol=0.05)


def test_custom_vjp_backward_inside_custom_jvp_runs_under_the_policy():
    # JAX linearises the inner custom_vjp into custom_lin, whose backward it calls while
    # transposing; amp re-binds it so that backward's matmul is 16-bit too.
    v = jax.random.normal(KEYS[5], (8, 8)) / 3

    @jax.custom_vjp
    def inner(x):
        return jnp.tanh(x)

    inner.defvjp(lambda x: (jnp.tanh(x), x), lambda x, g: ((g @ v) * (1 - jnp.tanh(x) ** 2),))

    @jax.custom_jvp
    def outer(x):
        return inner(x)

    outer.defjvp(lambda p, t: jax.jvp(inner, p, t))
    loss = lambda x, w: jnp.sum(outer(x @ w) ** 2)  # noqa: E731
    jaxpr = jax.make_jaxpr(jax.grad(autocast.amp(loss, compute_dtype=BF16)))(X, W)
    assert matmul_dtypes(jaxpr) == {np.dtype(BF16)}
    check_three_ways(loss, (X, W), tol=0.05)


# --- Equinox, diffrax, optimistix, lineax ------------------------------------------------

diffrax = require("diffrax")
optx = require("optimistix")
lx = require("lineax")

# the neural ODE and the root find the third-party benchmark solves, from its script
_bench = load_script(ROOT / "benchmarks" / "third_party.py")
neural_ode_loss, root_loss = _bench.neural_ode_loss, _bench.root_loss


def ode_loss(adjoint):
    return lambda model: neural_ode_loss(model, adjoint=adjoint)


@pytest.mark.slow
@pytest.mark.parametrize(
    "adjoint",
    [
        # once: the oldest and the newest JAX solve with the default adjoint under vmap, below
        pytest.param(diffrax.RecursiveCheckpointAdjoint(), marks=pytest.mark.once),
        diffrax.BacksolveAdjoint(),  # a custom_vjp whose backward solves an ODE: every JAX
    ],
    ids=lambda a: type(a).__name__,
)
def test_diffrax_neural_ode(adjoint):
    model = eqx.nn.MLP(2, 2, 8, 1, activation=jnp.tanh, key=KEYS[2])
    loss = ode_loss(adjoint)
    check_three_ways(loss, (model,), tol=0.1)
    # The vector field's matrix work ran in bfloat16 inside the solver's loops.
    jaxpr, *_ = eqx.filter_make_jaxpr(autocast.amp(loss, compute_dtype=BF16))(model)
    assert np.dtype(BF16) in matmul_dtypes(jaxpr)


@pytest.mark.once
@pytest.mark.slow
def test_diffrax_neural_ode_trains():
    model = eqx.nn.MLP(2, 2, 8, 1, activation=jnp.tanh, key=KEYS[3])
    loss = autocast.amp(ode_loss(diffrax.RecursiveCheckpointAdjoint()), compute_dtype=BF16)

    @eqx.filter_jit
    def step(model):
        value, grads = eqx.filter_value_and_grad(loss)(model)
        return value, eqx.apply_updates(model, jax.tree_util.tree_map(lambda g: -0.5 * g, grads))

    first, model = step(model)
    for _ in range(15):
        last, model = step(model)
    assert float(last) < 0.7 * float(first)


def ode_from(model, y0):
    return neural_ode_loss(model, y0)


def batched_ode_loss(model, y0s):
    """A neural ODE solved from several initial states under ``jax.vmap``: the solver's
    ``custom_vjp`` is batched, and its outputs that depend on the model alone are shared
    across the batch."""
    return jnp.mean(jax.vmap(lambda y0: ode_from(model, y0))(y0s))


@pytest.mark.slow
def test_diffrax_neural_ode_under_vmap():
    # JAX 0.12 refuses a batched custom_vjp whose rule gets a nonzero cotangent for an output
    # shared across the batch and gives a batched cotangent to an unbatched input; amp's
    # re-bound rule must pass on the symbolic zeros it gets, not arrays of zeros.
    model = eqx.nn.MLP(2, 2, 8, 1, activation=jnp.tanh, key=KEYS[4])
    y0s = jnp.array([[1.0, 0.0], [0.0, 1.0], [0.6, -0.8]])
    amp_ode = autocast.amp(ode_from, compute_dtype=BF16)
    vmapped_amp = lambda m, y0s: jnp.mean(jax.vmap(lambda y0: amp_ode(m, y0))(y0s))  # noqa: E731
    # grad(amp(vmap(...))), amp(grad(vmap(...))) and grad(vmap(amp(...)))
    errors = check_three_ways(batched_ode_loss, (model, y0s), tol=0.1, also=[vmapped_amp])
    assert len(errors) == 3
    # the vector field's matrix work ran in bfloat16 inside the solver's loops
    jaxpr, *_ = eqx.filter_make_jaxpr(vmapped_amp)(model, y0s)
    assert np.dtype(BF16) in matmul_dtypes(jaxpr)


@pytest.mark.slow
def test_optimistix_root_find():
    check_three_ways(root_loss, (jnp.array([[3.0, 1.0], [1.0, 2.0]]),), tol=0.1)


def function_operator_loss(w, b):
    op = lx.FunctionLinearOperator(lambda v: w @ v + 4 * v, jax.ShapeDtypeStruct((2,), jnp.float32))
    return jnp.sum(lx.linear_solve(op, b).value ** 2)


def matrix_operator_loss(w, b):
    op = lx.MatrixLinearOperator(w @ w.T + jnp.eye(2))
    return jnp.sum(lx.linear_solve(op, b).value ** 2)


@pytest.mark.parametrize(
    "loss", [matrix_operator_loss, function_operator_loss], ids=lambda f: f.__name__
)
def test_lineax_solve(loss):
    check_three_ways(loss, (jnp.array([[3.0, 1.0], [1.0, 2.0]]), jnp.ones(2)), tol=0.05)


def test_lineax_solve_runs_in_float32_whichever_came_first():
    # A solve with a matrix seen first must not teach amp that linear_solve never carries a
    # sub-program: the function operator's matvec then runs in float32, as linear algebra does.
    w, b = jnp.array([[3.0, 1.0], [1.0, 2.0]]), jnp.ones(2)
    autocast.amp(matrix_operator_loss, compute_dtype=BF16)(w, b)
    jaxpr = jax.make_jaxpr(autocast.amp(function_operator_loss, compute_dtype=BF16))(w, b)
    solves = [e for e in all_eqns(jaxpr.jaxpr) if e.primitive.name == "linear_solve"]
    floats = [
        v.aval.dtype for e in solves for v in e.invars if jnp.issubdtype(v.aval.dtype, jnp.floating)
    ]
    assert solves and floats and set(floats) == {np.dtype(jnp.float32)}


def test_foreign_higher_order_primitive_interprets_its_jaxprs():
    # A primitive of another library keeping a jaxpr in its parameters: the boundary keeps the
    # recorded dtypes, the inside runs under the policy.
    from autocast._src.transform.handlers import _foreign

    prim = jax.extend.core.Primitive("foreign_apply")
    prim.def_impl(lambda x, *, body: jax.core.eval_jaxpr(body[0].jaxpr, body[0].consts, x)[0])
    prim.def_abstract_eval(lambda x, *, body: body[0].out_avals[0])
    from jax.interpreters import mlir

    mlir.register_lowering(
        prim,
        mlir.lower_fun(
            lambda x, *, body: jax.core.eval_jaxpr(body[0].jaxpr, body[0].consts, x)[0],
            multiple_results=False,
        ),
    )
    body = jax.make_jaxpr(lambda v: jnp.tanh(v @ W))(X)
    f = lambda x: prim.bind(x, body=(body, "static"))  # noqa: E731
    jaxpr = jax.make_jaxpr(autocast.amp(f, compute_dtype=BF16))(X)
    (eqn,) = [e for e in jaxpr.jaxpr.eqns if e.primitive is prim]
    assert eqn.invars[0].aval.dtype == jnp.float32 and eqn.outvars[0].aval.dtype == jnp.float32
    assert matmul_dtypes(eqn.params["body"][0]) == {np.dtype(BF16)}
    assert _foreign is not None
    np.testing.assert_allclose(autocast.amp(f, compute_dtype=BF16)(X), f(X), rtol=0.05, atol=0.02)


# --- Pallas kernels ------------------------------------------------------------------------------

pl = require("jax.experimental.pallas")


def _gate_kernel(x_ref, o_ref):
    o_ref[...] = jnp.tanh(x_ref[...]) * x_ref[...]


def _gate_grad_kernel(x_ref, g_ref, o_ref):
    t = jnp.tanh(x_ref[...])
    o_ref[...] = g_ref[...] * (t + x_ref[...] * (1 - t * t))


def _call(kernel, *args):
    out = jax.ShapeDtypeStruct(args[0].shape, args[0].dtype)
    return pl.pallas_call(kernel, out_shape=out, interpret=True)(*args)


@jax.custom_vjp
def gate(x):
    return _call(_gate_kernel, x)


gate.defvjp(lambda x: (_call(_gate_kernel, x), x), lambda x, g: (_call(_gate_grad_kernel, x, g),))

W2 = jax.random.normal(KEYS[4], (8, 8)) / 3


def kernel_loss(w1, x):
    return jnp.sum((gate(x @ w1) @ W2) ** 2)


def test_pallas_kernel_between_amp_matmuls():
    check_three_ways(kernel_loss, (W, X), tol=0.05)
    jaxpr = jax.make_jaxpr(jax.grad(autocast.amp(kernel_loss, compute_dtype=BF16)))(W, X)
    kernels = []

    def walk(j):
        for e in j.eqns:
            if e.primitive.name == "pallas_call":
                kernels.append(e)
            for v in e.params.values():
                for s in v if isinstance(v, (tuple, list)) else (v,):
                    if isinstance(s, jax.extend.core.ClosedJaxpr):
                        walk(s.jaxpr)

    walk(jaxpr.jaxpr)
    # forward and backward kernels ran as written: in the float32 they were given
    assert len(kernels) >= 2
    assert all(v.aval.dtype == jnp.float32 for e in kernels for v in [*e.invars, *e.outvars])
    assert matmul_dtypes(jaxpr) == {np.dtype(BF16)}


def test_pallas_kernel_shows_in_the_report_and_obeys_the_policy():
    text = str(autocast.report(kernel_loss, compute_dtype=BF16)(W, X))
    assert "pallas_call" in text
    # The policy decides a kernel like any other primitive: its entry is consulted.
    seen = []

    def keep_and_count(compute_dtype, original_dtypes, *args, **params):
        seen.append(original_dtypes)
        return autocast.use_original_precision(compute_dtype, original_dtypes, *args, **params)

    policy = {**autocast.default_amp_policy, pl.pallas_call_p: keep_and_count}
    autocast.amp(kernel_loss, compute_dtype=BF16, amp_policy=policy)(W, X)
    assert seen == [[jnp.float32]]


def _pallas_calls(jaxpr):
    found = []

    def walk(j):
        for e in j.eqns:
            if e.primitive.name == "pallas_call":
                found.append(e)
            for sub in _compat.sub_jaxprs(e):
                walk(sub)

    walk(jaxpr.jaxpr)
    return found


def test_jaxs_tpu_flash_attention_is_an_entry_point():
    # JAX's own Pallas TPU kernel, traced only (lowering it needs a TPU target: make
    # tpu-plan compiles it). A kernel runs in the dtypes its program gives it, float32 here,
    # but this one is an entry point: forward and backward kernels take the compute dtype,
    # and inside amp_stop the float32 they were given (docs/fused_attention.md).
    tpu_flash = require("jax.experimental.pallas.ops.tpu.flash_attention")
    q, k, v = (jax.random.normal(KEYS[i], (1, 2, 128, 64)) for i in range(3))

    def attention(q, k, v):
        return tpu_flash.flash_attention(q, k, v, causal=True, sm_scale=0.125)

    def loss(attend, q, k, v):
        return jnp.sum(attend(q, k, v) ** 2)

    def kernel_dtypes(attend):
        fn = autocast.amp(functools.partial(loss, attend), compute_dtype=BF16)
        calls = _pallas_calls(jax.make_jaxpr(jax.grad(fn, argnums=(0, 1, 2)))(q, k, v))
        assert len(calls) >= 3  # the forward kernel, dq's and dk/dv's
        return {e.invars[0].aval.dtype for e in calls}

    def stopped(q, k, v):
        with autocast.amp_stop():
            return attention(q, k, v)

    assert kernel_dtypes(attention) == {jnp.dtype(BF16)}
    assert kernel_dtypes(stopped) == {jnp.dtype(jnp.float32)}
