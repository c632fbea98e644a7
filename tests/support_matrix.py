"""The support matrix: every combination of compute dtype, loss scaling, transformation,
framework and tool a user may write, and what each must give. The tests run it
(tests/test_support_matrix.py) and docs/support_matrix.md is printed from it:

    .venv/bin/python tests/support_matrix.py > docs/support_matrix.md

A cell is right when one SGD step under it lands within the compute dtype's tolerance of the
same step in float32 (loss and parameters), the loss scale it started from is kept (no step
of this model overflows) and nothing is skipped; or it is refused, when the table says so,
with the error type and words it names.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import sys
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

import autocast

COMPUTE = ("bf16", "f16", "fp8", "fp8 delayed")
SCALING = ("none", "jaxamp face", "optax face", "jmp objects")
TRANSFORMS = (
    "jit",
    "eager",
    "vmap inside",
    "amp under vmap",
    "scan",
    "checkpoint",
    "cond",
    "fori_loop",
    "while_loop",
)
# Transformations over several devices: their cells run in a child process with 4 CPU devices.
DEVICE_TRANSFORMS = ("shard_map", "sharded jit")
DEVICES = 4
FRAMEWORKS = ("JAX", "Flax Linen", "Flax NNX", "Equinox", "Haiku")
TOOLS = ("report", "diagnose")
# A lax.while_loop differentiated forward: the value and a jvp against float32's.
FORWARD = ("while_loop value", "while_loop jvp")
# The train step's extras, with each loss scaling face: clipping by global norm, and
# accumulating two microbatches' gradients with optax.MultiSteps (inside the scaling; the
# optax face also with the scaling inside MultiSteps, which is refused).
EXTRAS = ("clip", "accumulate", "accumulate, scaling inside")
EXTRA_COMPUTE = ("bf16", "f16")
CLIP = 0.05
# The training state in fewer bits (autocast.optax, docs/training_state.md): bfloat16
# parameters rounded stochastically or with a compensation (float32 moments), or Adam's
# moments stored in bfloat16 or 8 bits (float32 parameters). Every state with every loss
# scaling face under float16, and with bfloat16 and float8 compute unscaled.
STATES = ("bf16 params, SR", "bf16 params, Kahan", "bf16 moments", "8-bit moments")
STATE_COMPUTE = ("bf16", "f16", "fp8")
STATE_LR = 0.01
# What a state adds to two steps' error against the same steps with float32 parameters and
# plain optax, relative to the steps: bfloat16 parameters are rounded to a spacing of 2**-8
# of themselves (about a tenth of these steps), 8-bit moments keep 3 mantissa bits
# (measured: 0.06, 0.054, 0.0007, 0.015).
STATE_TOLERANCE = {
    "bf16 params, SR": 0.1,
    "bf16 params, Kahan": 0.1,
    "bf16 moments": 0.005,
    "8-bit moments": 0.05,
}

# Relative error of one step's parameters and loss against float32's, per compute dtype.
TOLERANCE = {"bf16": 2e-2, "f16": 5e-3, "fp8": 0.15, "fp8 delayed": 0.15}
SCALE = 2.0**10
LR = 0.1


@dataclasses.dataclass(frozen=True)
class Refused:
    """What a refused cell raises: the error type and words of its message."""

    error: type
    says: str

    def __str__(self) -> str:
        return f"refused: {self.error.__name__} ({self.says})"


# The combinations that are refused, and why. Everything else must be right.
_TOOL_ON_DELAYED = Refused(TypeError, "called inside another amp")
REFUSED: dict[tuple[str, ...], Refused] = {
    ("fp8 delayed", "report"): _TOOL_ON_DELAYED,
    ("fp8 delayed", "diagnose"): _TOOL_ON_DELAYED,
    # JAX's own refusal, which amp passes on unchanged: a while_loop's trip count is a value
    ("while_loop",): Refused(ValueError, "Reverse-mode differentiation does not work"),
    # float8 products are custom_vjp functions, which JAX differentiates in reverse mode only
    ("fp8", "while_loop jvp"): Refused(TypeError, "forward-mode autodiff"),
    ("fp8 delayed", "while_loop jvp"): Refused(TypeError, "forward-mode autodiff"),
    ("optax face", "accumulate, scaling inside"): Refused(
        TypeError, "MultiSteps(inner, k).gradient_transformation()"
    ),
}
# Cells that do not exist: the other faces have no wrapper to put inside MultiSteps.
ABSENT = {("accumulate, scaling inside", s) for s in ("none", "jaxamp face", "jmp objects")}


def expected(cell: tuple[str, ...]) -> Refused | None:
    """The refusal ``cell`` must meet, or None where it must be right."""
    for key, refusal in REFUSED.items():
        if set(key) <= set(cell):
            return refusal
    return None


def cells() -> list[tuple[str, ...]]:
    """Every cell: compute x scaling x transformation on a plain JAX model (every pair of those
    axes, and the triples users write, float8 with a scaler in a scan among them); compute x
    framework under jit with each compute dtype's usual scaling; compute x tool."""
    out = [
        ("JAX", c, s, t)
        for c, s, t in itertools.product(COMPUTE, SCALING, TRANSFORMS + DEVICE_TRANSFORMS)
    ]
    out += [(f, c, _usual(c), "jit") for f, c in itertools.product(FRAMEWORKS[1:], COMPUTE)]
    out += [("JAX", c, "none", tool) for c, tool in itertools.product(COMPUTE, TOOLS)]
    out += [("JAX", c, "none", mode) for c, mode in itertools.product(COMPUTE, FORWARD)]
    out += [
        ("JAX", c, s, e)
        for c, s, e in itertools.product(EXTRA_COMPUTE, SCALING, EXTRAS)
        if (e, s) not in ABSENT
    ]
    out += [("JAX", "f16", s, state) for s, state in itertools.product(SCALING, STATES)]
    out += [
        ("JAX", c, "none", state)
        for c, state in itertools.product(STATE_COMPUTE, STATES)
        if c != "f16"
    ]
    return out


def on_every_jax(cell: tuple[str, ...]) -> bool:
    """Whether CI runs ``cell`` on every JAX it tests, or on the middle one only (``make
    test``; the other suites leave out tests marked ``once``).

    Every cell outside the plain-JAX compute x scaling x transformation cube runs on every
    JAX, and a quarter of the cube in which every pair of values of two of its axes still
    meets (a Latin square: the scaling face turns with the compute dtype and the
    transformation). What changes from one JAX to another is how a transformation, a dtype
    or a framework is traced, which every pair meets; how a scaling face and a compute
    dtype meet inside a transformation is autocast's own work, and the middle JAX checks
    all of it.
    """
    framework, compute, scaling, what = cell
    axis = TRANSFORMS + DEVICE_TRANSFORMS
    if framework != "JAX" or what not in axis or scaling not in SCALING:
        return True
    turn = (COMPUTE.index(compute) + axis.index(what)) % len(SCALING)
    return SCALING.index(scaling) == turn


def _usual(compute: str) -> str:
    return "jaxamp face" if compute == "f16" else "none"


# ---- models: one loss per framework, products of extent 16 and more (float8 runs them) ----

D, LAYERS, BATCH = 32, 2, 16


def _data() -> tuple[Any, Any]:
    kx, ky = jax.random.split(jax.random.key(7))
    return jax.random.normal(kx, (BATCH, D)), jax.random.normal(ky, (BATCH, D))


def _layers(x: Any, ws: Any, transform: str) -> Any:
    """The stacked layers ``ws`` applied to ``x`` as the transformation asks."""
    layer = lambda h, w: jnp.tanh(h @ w)  # noqa: E731
    if transform == "scan":
        return jax.lax.scan(lambda h, w: (layer(h, w), None), x, ws)[0]
    if transform == "checkpoint":
        for w in ws:
            x = jax.checkpoint(layer)(x, w)
        return x
    if transform == "cond":
        return jax.lax.cond(
            jnp.sum(x) > -1e30, lambda h: layer(layer(h, ws[0]), ws[1]), lambda h: h, x
        )
    if transform == "fori_loop":  # static bounds: JAX lowers it to a scan
        return jax.lax.fori_loop(0, ws.shape[0], lambda i, h: layer(h, ws[i]), x)
    if transform == "while_loop":  # the trip count a value: a loop of its own
        n = ws.shape[0]
        body = lambda c: (c[0] + 1, layer(c[1], ws[jnp.minimum(c[0], n - 1)]))  # noqa: E731
        return jax.lax.while_loop(lambda c: c[0] < n, body, (jnp.int32(0), x))[1]
    for w in ws:
        x = layer(x, w)
    return x


def jax_model(transform: str) -> tuple[Callable[..., Any], Any]:
    ws = jax.random.normal(jax.random.key(1), (LAYERS, D, D)) / np.sqrt(D)
    params = {"ws": ws, "out": jax.random.normal(jax.random.key(2), (D, D)) / np.sqrt(D)}

    def one(params: Any, x: Any, y: Any) -> Any:
        h = _layers(x, params["ws"], transform)
        return jnp.mean((h @ params["out"] - y) ** 2)

    if transform == "vmap inside":

        def loss(params: Any, x: Any, y: Any) -> Any:
            per = jax.vmap(lambda xi, yi: one(params, xi[None], yi[None]))(x, y)
            return jnp.mean(per)

        return loss, params
    return one, params


def framework_model(name: str) -> tuple[Callable[..., Any], Any]:
    """A two-layer MLP written the framework's way, as ``(loss(params, x, y), params)``."""
    x, _ = _data()
    mse = lambda out, y: jnp.mean((out - y) ** 2)  # noqa: E731
    if name == "Flax Linen":
        import flax.linen as nn

        class MLP(nn.Module):
            @nn.compact
            def __call__(self, x: Any) -> Any:
                return nn.Dense(D)(nn.tanh(nn.Dense(D)(x)))

        model = MLP()
        return (lambda p, x, y: mse(model.apply(p, x), y)), model.init(jax.random.key(0), x)
    if name == "Flax NNX":
        from flax import nnx

        class NMLP(nnx.Module):
            def __init__(self, rngs: Any) -> None:
                self.a, self.b = nnx.Linear(D, D, rngs=rngs), nnx.Linear(D, D, rngs=rngs)

            def __call__(self, x: Any) -> Any:
                return self.b(jnp.tanh(self.a(x)))

        graph, state = nnx.split(NMLP(nnx.Rngs(0)))
        return (lambda p, x, y: mse(nnx.merge(graph, p)(x), y)), state
    if name == "Equinox":
        import equinox as eqx

        model = eqx.nn.MLP(D, D, D, 1, activation=jnp.tanh, key=jax.random.key(0))
        params, static = eqx.partition(model, eqx.is_inexact_array)
        return (lambda p, x, y: mse(jax.vmap(eqx.combine(p, static))(x), y)), params
    if name == "Haiku":
        import haiku as hk

        net = hk.without_apply_rng(
            hk.transform(lambda x: hk.nets.MLP([D, D], activation=jnp.tanh)(x))
        )
        return (lambda p, x, y: mse(net.apply(p, x), y)), net.init(jax.random.key(0), x)
    raise ValueError(name)


# ---- one step under a cell ----------------------------------------------------------------

_DTYPES = {"bf16": jnp.bfloat16, "f16": jnp.float16, "fp8": "fp8"}


def _under_compute(loss: Callable[..., Any], compute: str) -> Callable[..., Any]:
    if compute == "fp8 delayed":
        return autocast.amp_fp8_delayed(loss, history=4)
    return autocast.amp(loss, compute_dtype=_DTYPES[compute])


def _sgd(params: Any, grads: Any) -> Any:
    return jax.tree_util.tree_map(lambda p, g: p - LR * g, params, grads)


def step_of(
    loss: Callable[..., Any], compute: str, scaling: str, transform: str
) -> Callable[..., Any]:
    """``step(params, x, y) -> (loss, new params, scale, skipped)``: one SGD step of ``loss``
    under the compute dtype, the scaling face and the transformation."""
    amp_loss = _under_compute(loss, compute)
    delayed = compute == "fp8 delayed"
    if transform == "amp under vmap":  # amp inside, vmap outside it, the mean outside both
        per = jax.vmap(amp_loss, in_axes=(None, None, 0, 0) if delayed else (None, 0, 0))
        if delayed:
            amp_loss = functools.wraps(amp_loss)(
                lambda h, p, x, y: jnp.mean(per(h, p, x[:, None], y[:, None]))
            )
            amp_loss.init = lambda p, x, y: _under_compute(loss, compute).init(p, x[:1], y[:1])  # type: ignore[attr-defined]
        else:
            amp_loss = lambda p, x, y: jnp.mean(per(p, x[:, None], y[:, None]))  # noqa: E731
    if transform == "shard_map":  # amp inside shard_map on each device's shard of the batch
        from jax.sharding import PartitionSpec as P

        from autocast import _compat

        mesh = _auto_mesh()
        inner, n = amp_loss, 2 if delayed else 1
        specs = (P(),) * n + (P("d"), P("d"))
        amp_loss = _compat.shard_map(lambda *a: jax.lax.pmean(inner(*a), "d"), mesh, specs, P())
    argnums = (0, 1) if delayed else 0

    def grads_of(history: Any, params: Any, x: Any, y: Any) -> tuple[Any, Any, Any, Any, Any]:
        """(loss, params grads, history grads or None, scale after, skipped)."""
        args = (history, params, x, y) if delayed else (params, x, y)
        if scaling == "none":
            value, g = jax.value_and_grad(amp_loss, argnums=argnums)(*args)
            return (value, *_split(g, delayed), jnp.float32(1.0), jnp.int32(0))
        if scaling == "jaxamp face":
            state = autocast.DynamicScalerState(scaler=jnp.float32(SCALE))
            state, (value, g) = autocast.dynamic_scale_value_and_grad(amp_loss, argnums=argnums)(
                *args, dynamic_scaler_state=state
            )
            return (value, *_split(g, delayed), state.scaler, state.skipped_in_a_row)
        scale = autocast.DynamicLossScale(jnp.float32(SCALE))
        if delayed:
            args = (history.at_loss_scale(scale.loss_scale), *args[1:])
        value, g = jax.value_and_grad(lambda *a: scale.scale(amp_loss(*a)), argnums=argnums)(*args)
        g_params, g_history = _split(g, delayed)
        if g_history is not None:
            g_history = g_history.measured_under(scale.loss_scale)
        if scaling == "optax face":
            import optax

            import autocast.optax as ao

            tx = ao.dynamic_loss_scaling(optax.sgd(LR), scale)
            updates, state = tx.update(g_params, tx.init(params), params, value=value)
            # the wrapper updates; hand back its gradients' equivalent for one SGD step
            g_params = jax.tree_util.tree_map(lambda u: -u / LR, updates)
            return (
                scale.unscale(value),
                g_params,
                g_history,
                ao.loss_scale_of(state).loss_scale,
                ao.skipped_steps(state),
            )
        finite = autocast.all_finite(scale.unscale(g_params))
        return (
            scale.unscale(value),
            scale.unscale(g_params),
            g_history,
            scale.adjust(finite).loss_scale,
            (~finite).astype(jnp.int32),
        )

    def step(history: Any, params: Any, x: Any, y: Any) -> tuple[Any, Any, Any, Any, Any]:
        value, g, g_history, scale, skipped = grads_of(history, params, x, y)
        history = history.advance(g_history) if delayed else None
        return value, _sgd(params, g), history, scale, skipped

    return step if transform == "eager" else jax.jit(step)


def _auto_mesh() -> Any:
    """A mesh of the devices along "d" whose sharding XLA propagates (data parallelism as
    ``jit`` of sharded arrays does it; explicit axes would ask the weight gradient, a sum
    over the sharded batch, for an output sharding in float32 as well)."""
    try:
        from jax.sharding import AxisType

        return jax.make_mesh((DEVICES,), ("d",), axis_types=(AxisType.Auto,))
    except (ImportError, TypeError):  # JAX before explicit sharding: every axis is automatic
        return jax.make_mesh((DEVICES,), ("d",))


def _split(g: Any, delayed: bool) -> tuple[Any, Any]:
    """(params grads, history grads or None) of ``jax.grad``'s result."""
    return (g[1], g[0]) if delayed else (g, None)


def _model(framework: str, what: str) -> tuple[Callable[..., Any], Any]:
    return jax_model(what) if framework == "JAX" else framework_model(framework)


@functools.cache
def _reference(framework: str, what: str) -> tuple[Any, Any]:
    """float32's loss and SGD step of a model, the same for every compute dtype and scaling
    face: computed once per process (the models are made from fixed keys), as one program
    (eagerly, each of its operations would be a program XLA compiles)."""
    loss, params = _model(framework, what)
    value, grads = jax.jit(jax.value_and_grad(loss))(params, *_data())
    return value, _sgd(params, grads)


def run_cell(cell: tuple[str, ...]) -> dict:
    """Runs one cell; returns its figures (relative errors, scale, skipped) or raises."""
    framework, compute, scaling, what = cell
    x, y = _data()
    if what in TOOLS:
        loss, params = jax_model("jit")
        tool = autocast.report if what == "report" else autocast.diagnose
        fn = _under_compute(loss, compute) if compute == "fp8 delayed" else loss
        dtype = "fp8" if compute == "fp8 delayed" else _DTYPES[compute]
        result = tool(fn, compute_dtype=dtype)(params, x, y)
        return {"text": str(result)}
    if what in FORWARD:
        return _forward_cell(compute, what)
    if what in EXTRAS:
        return _extra_cell(compute, scaling, what)
    if what in STATES:
        return _state_cell(compute, scaling, what)
    # a framework's model is the same under every transformation
    model = "jit" if what in DEVICE_TRANSFORMS else what if framework == "JAX" else ""
    loss, params = _model(framework, model)
    if what in DEVICE_TRANSFORMS:  # the batch split over the devices, parameters replicated
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        mesh = _auto_mesh()
        x, y = (jax.device_put(a, NamedSharding(mesh, P("d"))) for a in (x, y))
    history = _under_compute(loss, compute).init(params, x, y) if compute == "fp8 delayed" else None
    if compute == "fp8 delayed" and what == "amp under vmap":
        history = _under_compute(loss, compute).init(params, x[:1], y[:1])
    value, got, new_history, scale, skipped = step_of(loss, compute, scaling, what)(
        history, params, x, y
    )
    # after amp's step: a refusal the table expects must be amp's, not the float32 reference's
    # (JAX refuses to differentiate a while_loop in reverse mode, with or without amp)
    want_loss, want = _reference(framework, model)
    flat = lambda t: jnp.concatenate(  # noqa: E731
        [jnp.ravel(a).astype(jnp.float32) for a in jax.tree_util.tree_leaves(t)]
    )
    return {
        # the step's error against float32's step, relative to that step's size
        "param_error": float(
            jnp.linalg.norm(flat(got) - flat(want)) / jnp.linalg.norm(flat(want) - flat(params))
        ),
        "loss_error": abs(float(value) - float(want_loss)) / abs(float(want_loss)),
        "scale": float(scale),
        "skipped": int(skipped),
        "history_finite": new_history is None or bool(autocast.all_finite(new_history.amax)),
    }


def _forward_cell(compute: str, mode: str) -> dict:
    """The loss through a while_loop, or its jvp along the parameters, against float32's."""
    loss, params = jax_model("while_loop")
    x, y = _data()
    tangent = jax.tree_util.tree_map(lambda p: p / 10, params)
    fn = _under_compute(loss, compute)
    history = fn.init(params, x, y) if compute == "fp8 delayed" else None
    run = (lambda p: fn(history, p, x, y)) if history is not None else (lambda p: fn(p, x, y))
    if mode == "while_loop value":
        got, want = jax.jit(run)(params), jax.jit(loss)(params, x, y)
    else:
        got = jax.jit(lambda p, t: jax.jvp(run, (p,), (t,))[1])(params, tangent)
        want = jax.jit(lambda p, t: jax.jvp(lambda q: loss(q, x, y), (p,), (t,))[1])(
            params, tangent
        )
    error = abs(float(got) - float(want)) / abs(float(want))
    return {"param_error": 0.0, "loss_error": error, "scale": 1.0, "skipped": 0}


def _extra_cell(compute: str, scaling: str, extra: str) -> dict:
    """One update with clipping, or two microbatches accumulated into one update, under the
    scaling face; against the same in float32 with optax."""
    import optax

    import autocast.optax as ao

    loss, params = jax_model("jit")
    x, y = _data()
    batches = [(x, y)] if extra == "clip" else [(x[:8], y[:8]), (x[8:], y[8:])]

    def optimizer() -> Any:
        if extra == "clip":
            return optax.chain(optax.clip_by_global_norm(CLIP), optax.sgd(LR))
        return optax.MultiSteps(optax.sgd(LR), every_k_schedule=2).gradient_transformation()

    # float32's update, its gradients compiled (one program per batch shape)
    want, grad = params, jax.jit(jax.grad(loss))
    tx = optimizer()
    state = tx.init(params)
    for xb, yb in batches:
        updates, state = tx.update(grad(want, xb, yb), state, want)
        want = optax.apply_updates(want, updates)
    grad_norm = optax.global_norm(grad(params, x, y))
    amp_loss = _under_compute(loss, compute)
    if scaling == "optax face":
        if extra == "accumulate, scaling inside":
            optax.MultiSteps(ao.dynamic_loss_scaling(optax.sgd(LR)), every_k_schedule=2).init(
                params
            )
        tx = ao.dynamic_loss_scaling(optimizer(), autocast.DynamicLossScale(jnp.float32(SCALE)))
    else:
        tx = optimizer()
    opt_state, got = tx.init(params), params
    scaler = autocast.DynamicScalerState(scaler=jnp.float32(SCALE))
    scale = autocast.DynamicLossScale(jnp.float32(SCALE)) if scaling != "none" else None
    skipped = 0
    for xb, yb in batches:
        if scaling == "optax face":
            s = ao.loss_scale_of(opt_state)
            g = jax.grad(lambda p: s.scale(amp_loss(p, xb, yb)))(got)
            updates, opt_state = tx.update(g, opt_state, got)
            got = optax.apply_updates(got, updates)
            continue
        if scaling == "none":
            g = jax.grad(amp_loss)(got, xb, yb)
        elif scaling == "jaxamp face":
            scaler, g = autocast.dynamic_scale_grad(amp_loss)(
                got, xb, yb, dynamic_scaler_state=scaler
            )
        else:
            g = scale.unscale(jax.grad(lambda p: scale.scale(amp_loss(p, xb, yb)))(got))
            scale = scale.adjust(autocast.all_finite(g))
        finite = autocast.all_finite(g)
        skipped += int(~finite)
        updates, new_state = tx.update(g, opt_state, got)
        got, opt_state = autocast.select_tree(
            finite, (optax.apply_updates(got, updates), new_state), (got, opt_state)
        )
    if scaling == "optax face":
        final_scale, skipped = ao.loss_scale_of(opt_state).loss_scale, ao.skipped_steps(opt_state)
    elif scaling == "jaxamp face":
        final_scale = scaler.scaler
    else:
        final_scale = 1.0 if scale is None else scale.loss_scale
    flat = lambda t: jnp.concatenate([jnp.ravel(a) for a in jax.tree_util.tree_leaves(t)])  # noqa: E731
    step = jnp.linalg.norm(flat(want) - flat(params))
    return {
        "param_error": float(jnp.linalg.norm(flat(got) - flat(want)) / step),
        "loss_error": 0.0,
        "scale": float(final_scale),
        "skipped": int(skipped),
        # clipping must have clipped: the float32 gradient is longer than the clip
        "clipped": extra != "clip" or float(grad_norm) > 2 * CLIP,
    }


def _state_run(compute: str, scaling: str, state: str | None) -> tuple[Any, Any, float, int]:
    """Two Adam steps under the compute dtype and the scaling face, the training state as
    ``state`` says (None: float32 parameters and plain ``optax.adam``): (parameters at the
    start, after, the final loss scale, skipped steps)."""
    import optax

    import autocast.optax as ao

    loss, params = jax_model("jit")
    x, y = _data()
    narrow = state is not None and state.startswith("bf16 params")
    start = jax.tree_util.tree_map(lambda p: p.astype(jnp.bfloat16), params) if narrow else params
    if state is None:
        tx = optax.adam(STATE_LR)
    else:
        moments = {"bf16 moments": jnp.bfloat16, "8-bit moments": jnp.float8_e4m3fn}.get(
            state, jnp.float32
        )
        parts = [ao.low_precision_state(optax.adam(STATE_LR), moments, key=1)]
        if narrow:
            parts.append(ao.stochastic_rounding(2) if "SR" in state else ao.kahan_summation())
        tx = optax.chain(*parts)
    if scaling == "optax face":
        tx = ao.dynamic_loss_scaling(tx, autocast.DynamicLossScale(jnp.float32(SCALE)))
    amp_loss = _under_compute(loss, compute)
    scaler = autocast.DynamicScalerState(scaler=jnp.float32(SCALE))
    scale = autocast.DynamicLossScale(jnp.float32(SCALE))

    @jax.jit
    def step(p: Any, opt: Any, scaler: Any, scale: Any) -> tuple[Any, Any, Any, Any, Any]:
        if scaling == "optax face":
            s = ao.loss_scale_of(opt)
            grads = jax.grad(lambda q: s.scale(amp_loss(q, x, y)))(p)
        elif scaling == "jaxamp face":
            scaler, grads = autocast.dynamic_scale_grad(amp_loss)(
                p, x, y, dynamic_scaler_state=scaler
            )
        elif scaling == "jmp objects":
            grads = scale.unscale(jax.grad(lambda q: scale.scale(amp_loss(q, x, y)))(p))
            scale = scale.adjust(autocast.all_finite(grads))
        else:
            grads = jax.grad(amp_loss)(p, x, y)
        finite = autocast.all_finite(grads)
        updates, new_opt = tx.update(grads, opt, p)
        p, opt = autocast.select_tree(finite, (optax.apply_updates(p, updates), new_opt), (p, opt))
        return p, opt, scaler, scale, (~finite).astype(jnp.int32)

    got, opt, skipped = start, tx.init(start), 0
    for _ in range(2):
        got, opt, scaler, scale, bad = step(got, opt, scaler, scale)
        skipped += int(bad)
    if scaling == "optax face":
        final_scale, skipped = ao.loss_scale_of(opt).loss_scale, int(ao.skipped_steps(opt))
    elif scaling == "jaxamp face":
        final_scale = scaler.scaler
    elif scaling == "jmp objects":
        final_scale = scale.loss_scale
    else:
        final_scale = 1.0
    return params, got, float(final_scale), int(skipped)


@functools.cache
def _state_reference(compute: str, scaling: str) -> tuple[Any, Any, float, int]:
    """The float32 state's two steps, shared by the cells of every state."""
    return _state_run(compute, scaling, None)


def _state_cell(compute: str, scaling: str, state: str) -> dict:
    """Two Adam steps with the training state in fewer bits against the same two steps with
    float32 parameters and plain optax (the same compute dtype and scaling face): what the
    state costs, and that it composes."""
    params, want, _, _ = _state_reference(compute, scaling)
    _, got, final_scale, skipped = _state_run(compute, scaling, state)
    flat = lambda t: jnp.concatenate(  # noqa: E731
        [jnp.ravel(a).astype(jnp.float32) for a in jax.tree_util.tree_leaves(t)]
    )
    narrow = state.startswith("bf16 params")
    dtypes = {str(a.dtype) for a in jax.tree_util.tree_leaves(got)}
    return {
        "param_error": float(
            jnp.linalg.norm(flat(got) - flat(want)) / jnp.linalg.norm(flat(want) - flat(params))
        ),
        "loss_error": 0.0,
        "scale": final_scale,
        "skipped": skipped,
        "dtypes_kept": dtypes == ({"bfloat16"} if narrow else {"float32"}),
    }


def check(cell: tuple[str, ...], figures: dict) -> list[str]:
    """What is wrong with a cell's figures (empty: right)."""
    _, compute, scaling, what = cell
    if what in TOOLS:
        return [] if figures["text"] else ["the tool printed nothing"]
    if what in FORWARD:
        scaling = "none"
    if not figures.get("clipped", True):
        return ["the gradient was not clipped: the cell checks nothing"]
    tol = STATE_TOLERANCE[what] if what in STATES else TOLERANCE[compute]
    problems = []
    if not figures.get("dtypes_kept", True):
        problems.append("the parameters left their dtype")
    if not figures["param_error"] <= tol:
        problems.append(f"step error {figures['param_error']:.3g} > {tol}")
    if not figures["loss_error"] <= tol:
        problems.append(f"loss error {figures['loss_error']:.3g} > {tol}")
    if figures["scale"] != (1.0 if scaling == "none" else SCALE):
        problems.append(f"scale {figures['scale']} moved")
    if figures["skipped"]:
        problems.append("a step was skipped")
    if not figures.get("history_finite", True):
        problems.append("the float8 history is not finite")
    return problems


def markdown() -> str:
    """The matrix as docs/support_matrix.md shows it."""
    lines = [
        "# Support matrix",
        "",
        "What each combination gives, from `tests/support_matrix.py`, the same table the tests run",
        "(`tests/test_support_matrix.py`). ✓: one SGD step lands within the compute dtype's",
        "tolerance of float32's ("
        + ", ".join(f"{c} {t:g}" for c, t in TOLERANCE.items())
        + "), the",
        "loss scale is kept and nothing is skipped. Refused: the error the call raises.",
        "",
        "Where the ✓s come from: CPU runs, on a 2-core x86-64 machine without a GPU in CI. CI",
        "runs the whole table with JAX 0.10.2 (Python 3.11); with 0.6.2 (3.10) and 0.12.0.1",
        "(3.13) every table but the first whole, and a quarter of the first in which every",
        "compute dtype meets every scaling face and every transformation, and every scaling",
        "face every transformation (`on_every_jax` in tests/support_matrix.py). It has not",
        "been run on a GPU or TPU, where float8 products run on their own kernels",
        "([fp8.md](fp8.md#hardware)).",
        "",
        "## Compute x loss scaling x transformation (plain JAX)",
        "",
        f"`shard_map` and `sharded jit` run on {DEVICES} CPU devices, the batch split over them:",
        "amp inside `shard_map` (the loss averaged with `pmean`), or a `jit` of sharded arrays.",
        "",
        "| compute | scaling | " + " | ".join(TRANSFORMS + DEVICE_TRANSFORMS) + " |",
        "|---|---|" + "---|" * len(TRANSFORMS + DEVICE_TRANSFORMS),
    ]
    for c, s in itertools.product(COMPUTE, SCALING):
        marks = [_mark(("JAX", c, s, t)) for t in TRANSFORMS + DEVICE_TRANSFORMS]
        lines.append(f"| {c} | {s} | " + " | ".join(marks) + " |")
    lines += [
        "",
        "`fori_loop` has static bounds, which JAX lowers to a `scan`; `while_loop` is a",
        "`lax.while_loop` whose trip count is a value. JAX itself refuses to differentiate",
        'the latter in reverse mode, with or without amp: "Reverse-mode differentiation does',
        "not work for lax.while_loop or lax.fori_loop with dynamic start/stop values. Try using",
        'lax.scan, or using fori_loop with static start/stop." Forward, and in forward mode',
        "(`jax.jvp`), it runs; float8 products are `custom_vjp` functions, which JAX",
        "differentiates in reverse mode only (\"can't apply forward-mode autodiff (jvp) to a",
        'custom_vjp function"), so with float8 a `jax.jvp` is refused wherever it meets one:',
        "",
        "| compute | " + " | ".join(FORWARD) + " |",
        "|---|" + "---|" * len(FORWARD),
    ]
    for c in COMPUTE:
        lines.append(f"| {c} | " + " | ".join(_mark(("JAX", c, "none", m)) for m in FORWARD) + " |")
    lines += [
        "",
        "## Clipping and gradient accumulation x loss scaling",
        "",
        f"One update with `optax.clip_by_global_norm({CLIP})` (the gradient is longer, so it",
        "clips), or two microbatches accumulated into one update by `optax.MultiSteps`,",
        "against the same in float32. `accumulate`: MultiSteps inside the scaling (for the",
        "optax face `dynamic_loss_scaling(optax.MultiSteps(...).gradient_transformation())`;",
        "for the others, MultiSteps as the optimizer of the documented train step). `accumulate,",
        "scaling inside`: `optax.MultiSteps(dynamic_loss_scaling(...))`, which is refused",
        "([loss_scaling.md](loss_scaling.md#clipping-and-gradient-accumulation)).",
        "",
        "| compute | scaling | " + " | ".join(EXTRAS) + " |",
        "|---|---|" + "---|" * len(EXTRAS),
    ]
    for c, s in itertools.product(EXTRA_COMPUTE, SCALING):
        marks = ["-" if (e, s) in ABSENT else _mark(("JAX", c, s, e)) for e in EXTRAS]
        lines.append(f"| {c} | {s} | " + " | ".join(marks) + " |")
    lines += [
        "",
        "## Training state x loss scaling x compute",
        "",
        "Two Adam steps (learning rate " + f"{STATE_LR:g}) with the training state in fewer bits",
        "([training_state.md](training_state.md)): bfloat16 parameters with",
        "`stochastic_rounding` or `kahan_summation` after `low_precision_state(adam,",
        "jnp.float32)`; or float32 parameters with Adam's moments stored by",
        "`low_precision_state` in bfloat16 or `float8_e4m3fn`. ✓: the parameters keep their",
        "dtype and land within the state's tolerance ("
        + ", ".join(f"{k} {v:g}" for k, v in STATE_TOLERANCE.items())
        + ") of the same",
        "two steps with float32 parameters and plain `optax.adam` (the same compute dtype and",
        "scaling), the scale is kept and nothing is skipped. float16 with every scaling face;",
        "bfloat16 and float8 without scaling.",
        "",
        "| compute | scaling | " + " | ".join(STATES) + " |",
        "|---|---|" + "---|" * len(STATES),
    ]
    for s in SCALING:
        lines.append(
            "| f16 | " + s + " | " + " | ".join(_mark(("JAX", "f16", s, t)) for t in STATES) + " |"
        )
    for c in STATE_COMPUTE:
        if c != "f16":
            lines.append(
                f"| {c} | none | " + " | ".join(_mark(("JAX", c, "none", t)) for t in STATES) + " |"
            )
    lines += ["", "## Compute x framework (jit; float16 with the jaxamp face)", ""]
    lines += [
        "| compute | " + " | ".join(FRAMEWORKS[1:]) + " |",
        "|---|" + "---|" * len(FRAMEWORKS[1:]),
    ]
    for c in COMPUTE:
        lines.append(
            f"| {c} | " + " | ".join(_mark((f, c, _usual(c), "jit")) for f in FRAMEWORKS[1:]) + " |"
        )
    lines += ["", "## Compute x tool", ""]
    lines += ["| compute | " + " | ".join(TOOLS) + " |", "|---|" + "---|" * len(TOOLS)]
    for c in COMPUTE:
        lines.append(f"| {c} | " + " | ".join(_mark(("JAX", c, "none", t)) for t in TOOLS) + " |")
    lines += [
        "",
        "Float8 with delayed scaling is refused by the tools: `report` and `diagnose` run their",
        "function under amp, and `amp_fp8_delayed` refuses to run inside another amp, which would",
        'run it without its histories. Call them with `compute_dtype="fp8"` (current scaling)',
        "on the unwrapped loss instead.",
        "",
    ]
    return "\n".join(lines)


def _mark(cell: tuple[str, ...]) -> str:
    refusal = expected(cell)
    return "✓" if refusal is None else str(refusal)


def device_cells(every_jax: bool) -> dict[str, list[str]]:
    """Runs the cells over several devices that :func:`on_every_jax` puts on every JAX (or
    the others), in a process started with that many CPU devices; ``{cell: problems}``, a
    raised error being one."""
    results = {}
    for cell in cells():
        if cell[3] not in DEVICE_TRANSFORMS or on_every_jax(cell) != every_jax:
            continue
        try:
            problems = check(cell, run_cell(cell))
        except Exception as e:  # noqa: BLE001 - reported for the parent test to judge
            problems = [f"raised {type(e).__name__}: {e}"]
        results["/".join(cell)] = problems
    return results


if __name__ == "__main__":
    if sys.argv[1:2] == ["--device-cells"]:
        import json

        print(json.dumps(device_cells(every_jax=sys.argv[2:] == ["every-jax"])))
    else:
        sys.stdout.write(markdown())
