"""amp on code it did not write: forward and gradient error against float32, per case.

Run: ``.venv/bin/python benchmarks/third_party.py`` (also part of ``make bench``).
Each case runs in float32 and under ``amp(compute_dtype=bfloat16)``; the gradient is taken
both ways round, ``grad(amp(f))`` and ``amp(grad(f))``. Errors are relative L2 norms over
all gradient leaves; "ok" means it ran and returned gradients in the primal dtypes, anything
else is the error it raised. Needs the test extra (diffrax, optimistix, lineax).
"""

from __future__ import annotations

import traceback
from typing import Any, Callable

import equinox as eqx
import jax
import jax.numpy as jnp

import autocast
from autocast._src.tools import measure as _measure

BF16 = jnp.bfloat16
KEYS = jax.random.split(jax.random.key(7), 8)
W = jax.random.normal(KEYS[0], (16, 8)) / 4
X = jax.random.normal(KEYS[1], (4, 16))


def custom_gradient(x: Any, w: Any) -> Any:
    w2 = w * 1.5

    @jax.custom_gradient
    def project(x: Any) -> Any:
        return x @ w2, lambda g: (g @ w2.T,)

    return jnp.sum(jnp.tanh(project(x)) ** 2)


def closure_custom_vjp(x: Any, w: Any) -> Any:
    @jax.custom_vjp
    def layer(x: Any) -> Any:
        return jnp.tanh(x @ w)

    layer.defvjp(
        lambda x: (jnp.tanh(x @ w), jnp.tanh(x @ w)),
        lambda y, g: ((g * (1 - y**2)) @ w.T,),
    )
    return jnp.sum(layer(x) ** 2)


def closure_custom_jvp(x: Any, w: Any) -> Any:
    @jax.custom_jvp
    def layer(x: Any) -> Any:
        return jnp.sin(x @ w)

    layer.defjvp(lambda p, t: (jnp.sin(p[0] @ w), jnp.cos(p[0] @ w) * (t[0] @ w)))
    return jnp.sum(layer(x) ** 2)


# The Levenberg-Marquardt fit's data parameters.
LM_W = jnp.array([0.9, -0.4, 0.3, 0.6])


# The neural ODE's path is fitted to a circle at these times (tests/test_third_party.py
# solves the same one).
TS = jnp.linspace(0.0, 1.0, 5)
TARGET = jnp.stack([jnp.cos(TS), jnp.sin(TS)], -1)


def vector_field(t: Any, y: Any, model: Any) -> Any:
    """The neural ODE's right-hand side: ``model`` applied to the state. One function for
    every solve (diffrax jits its solver with the term static: a new lambda each call would
    be a new program to trace, in every test that solves it)."""
    return model(y)


def neural_ode_loss(model: Any, y0: Any = None, adjoint: Any = None) -> Any:
    """The mean squared distance of a neural ODE's path (vector field ``model``, from ``y0``,
    by default ``[1, 0]``) to the circle at ``TS``: diffrax's Tsit5 with an adaptive step,
    differentiated by ``adjoint`` (diffrax's default when None)."""
    import diffrax

    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(vector_field),
        diffrax.Tsit5(),
        0.0,
        1.0,
        0.1,
        jnp.array([1.0, 0.0]) if y0 is None else y0,
        args=model,
        saveat=diffrax.SaveAt(ts=TS),
        stepsize_controller=diffrax.PIDController(rtol=1e-3, atol=1e-4),
        **({} if adjoint is None else {"adjoint": adjoint}),
    )
    return jnp.mean((sol.ys - TARGET) ** 2)


def _root_residual(y: Any, w: Any) -> Any:
    """What the root find drives to zero (one function for every solve, as for
    :func:`vector_field`: optimistix jits its solver with the function static)."""
    return jnp.tanh(w @ y) + y - 1.0


def root_loss(w: Any) -> Any:
    """The squared norm of the root of ``tanh(w @ y) + y = 1``, found by optimistix's Newton
    to bfloat16's resolution (a function evaluated in 16 bits cannot be driven below its own
    rounding: docs/third_party.md on iterative solvers)."""
    import optimistix as optx

    sol = optx.root_find(
        _root_residual,
        optx.Newton(rtol=1e-2, atol=1e-2),
        jnp.zeros(2),
        args=w,
    )
    return jnp.sum(sol.value**2)


def cases() -> list[tuple[str, Callable[..., Any], tuple]]:
    import diffrax
    import lineax as lx
    import optimistix as optx
    from jax.experimental import pallas as pl

    mlp = eqx.nn.MLP(2, 2, 16, 2, activation=jnp.tanh, key=KEYS[2])

    def ode(adjoint: Any) -> Callable[..., Any]:
        return lambda model: neural_ode_loss(model, adjoint=adjoint)

    def fit(tight: bool, stopped: bool) -> Callable[..., Any]:
        """A Levenberg-Marquardt fit of a one-layer model, y = tanh(features @ p), to data made
        from ``w``; the loss reads the fitted parameters. ``stopped``: the solve inside
        ``amp_stop()``."""
        features = jax.random.normal(KEYS[3], (32, 4))

        def loss(w: Any) -> Any:
            data = jnp.tanh(features @ w) + 0.05 * jnp.sin(7 * features[:, 0])

            def solve() -> Any:
                return optx.least_squares(
                    lambda p, d: jnp.tanh(features @ p) - d,
                    optx.LevenbergMarquardt(rtol=1e-6 if tight else 1e-2, atol=1e-6),
                    jnp.zeros(4),
                    args=data,
                    max_steps=64,
                    throw=False,
                ).value

            if stopped:
                with autocast.amp_stop():
                    p = solve()
            else:
                p = solve()
            return jnp.sum(p**2)

        return loss

    def solve(w: Any, b: Any) -> Any:
        op = lx.FunctionLinearOperator(
            lambda v: w @ v + 4 * v, jax.ShapeDtypeStruct((2,), jnp.float32)
        )
        return jnp.sum(lx.linear_solve(op, b).value ** 2)

    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = jnp.tanh(x_ref[...]) * x_ref[...]

    def grad_kernel(x_ref: Any, g_ref: Any, o_ref: Any) -> None:
        t = jnp.tanh(x_ref[...])
        o_ref[...] = g_ref[...] * (t + x_ref[...] * (1 - t * t))

    def call(k: Any, *args: Any) -> Any:
        out = jax.ShapeDtypeStruct(args[0].shape, args[0].dtype)
        return pl.pallas_call(k, out_shape=out, interpret=True)(*args)

    @jax.custom_vjp
    def gate(x: Any) -> Any:
        return call(kernel, x)

    gate.defvjp(lambda x: (call(kernel, x), x), lambda x, g: (call(grad_kernel, x, g),))
    w2 = jax.random.normal(KEYS[4], (8, 8)) / 3
    a = jnp.array([[3.0, 1.0], [1.0, 2.0]])
    return [
        ("jax.custom_gradient, rule closes over an intermediate", custom_gradient, (X, W)),
        ("custom_vjp, rules close over a weight", closure_custom_vjp, (X, W)),
        ("custom_jvp, rule closes over a weight", closure_custom_jvp, (X, W)),
        (
            "diffrax neural ODE, RecursiveCheckpointAdjoint",
            ode(diffrax.RecursiveCheckpointAdjoint()),
            (mlp,),
        ),
        ("diffrax neural ODE, BacksolveAdjoint", ode(diffrax.BacksolveAdjoint()), (mlp,)),
        ("optimistix Newton root find (tol 1e-2)", root_loss, (a,)),
        ("optimistix Levenberg-Marquardt (rtol 1e-2)", fit(False, False), (LM_W,)),
        ("optimistix Levenberg-Marquardt (rtol 1e-6)", fit(True, False), (LM_W,)),
        ("  the same, the solve inside amp_stop()", fit(True, True), (LM_W,)),
        ("lineax solve, function operator", solve, (a, jnp.ones(2))),
        (
            "Pallas kernel (interpret) between two matmuls",
            lambda w, x: jnp.sum((gate(x @ w) @ w2) ** 2),
            (W, X),
        ),
    ]


def measure(loss: Callable[..., Any], args: tuple) -> dict[str, Any]:
    amp_loss = autocast.amp(loss, compute_dtype=BF16)
    row: dict[str, Any] = {}
    try:
        value = float(eqx.filter_jit(loss)(*args))
        row["forward"] = abs(float(eqx.filter_jit(amp_loss)(*args)) - value) / abs(value)
    except Exception as e:  # reported, not raised: the table shows what fails
        row["forward"] = f"{type(e).__name__}"
        traceback.print_exc()
    want = eqx.filter_jit(eqx.filter_grad(loss))(*args)
    for name, fn in (
        ("grad(amp(f))", eqx.filter_grad(amp_loss)),
        ("amp(grad(f))", autocast.amp(eqx.filter_grad(loss), compute_dtype=BF16)),
    ):
        try:
            got = eqx.filter_jit(fn)(*args)
            same = [x.dtype for x in jax.tree_util.tree_leaves(got)] == [
                x.dtype for x in jax.tree_util.tree_leaves(want)
            ]
            row[name] = _measure.relative_error(got, want) if same else "wrong dtypes"
        except Exception as e:
            row[name] = f"{type(e).__name__}"
            traceback.print_exc()
    return row


def main() -> dict[str, dict[str, Any]]:
    results = {name: measure(loss, args) for name, loss, args in cases()}
    header = f"{'case':<52} {'forward':>9} {'grad(amp(f))':>13} {'amp(grad(f))':>13}"
    print(header)
    print("-" * len(header))
    for name, row in results.items():
        cells = [f"{v:.2e}" if isinstance(v, float) else v for v in row.values()]
        print(f"{name:<52} {cells[0]:>9} {cells[1]:>13} {cells[2]:>13}")
    print("(relative error vs float32; forward: loss value, gradients: L2 over all leaves)")
    return results


if __name__ == "__main__":
    main()
