"""Run by tests/test_multiprocess.py: one process of a training job on a mesh of 4 CPU devices,
either alone (4 devices) or as one of 2 processes joined by ``jax.distributed`` (2 devices
each, gloo collectives). The same code runs in both, so their results can be compared.

Environment: ``MP_PROCESSES`` (1 or 2), ``MP_ID`` (this process), ``MP_PORT`` (the
coordinator's, with 2). Arguments: ``--out DIR`` (results: ``p<id>.json`` from every process,
``<case>.npz`` from process 0), ``--ckpt DIR`` (checkpoints), ``--phase`` ``train`` (the
comparison cases, and the checkpoint cases run 20 steps, saving at step 10) or ``resume``
(the checkpoint cases restored at step 10 and run to 20, in this fresh process).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import autocast
import autocast.optax
from autocast import _compat

PROCESSES = int(os.environ.get("MP_PROCESSES", "1"))
PROCESS_ID = int(os.environ.get("MP_ID", "0"))
DEVICES = 4
MESH: jax.sharding.Mesh  # set by start(): a mesh of every device of the job
# Optimiser states are made replicated over the mesh, counters included: left to jit, a
# counter that depends on no input lands on one device, and a checkpoint restored into it
# would keep it there, apart from the mesh's arrays.
REPLICATED: NamedSharding


def start() -> None:
    """This process's devices, the job joined, the mesh built. Called by main only, so that
    importing this file (pytest collects it for doctests) changes nothing."""
    global MESH, REPLICATED
    # before the backend starts: the host devices this process simulates
    flags = f"--xla_force_host_platform_device_count={DEVICES // PROCESSES}"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()
    join_processes()
    assert jax.device_count() == DEVICES and jax.process_count() == PROCESSES, jax.devices()
    MESH = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
    REPLICATED = NamedSharding(MESH, P())


def join_processes() -> None:
    """``jax.distributed.initialize`` with gloo's CPU collectives (XLA's CPU backend has no
    cross-process collectives without them). The option is a string from JAX 0.4.34 on, a
    boolean flag before; both spellings are tried so the child names no version."""
    if PROCESSES == 1:
        return
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except AttributeError:
        jax.config.update("jax_cpu_enable_gloo_collectives", True)
    jax.distributed.initialize(
        f"localhost:{os.environ['MP_PORT']}",
        num_processes=PROCESSES,
        process_id=PROCESS_ID,
        initialization_timeout=120,
    )


BATCH, D_IN, D_HID, D_OUT = 32, 16, 32, 16  # float8 products need extents of 16 and more
POISON_ROW = 29  # rows 24..31 live on the mesh's last device, in process 1 of 2
STEPS = 6
POISONED = {2}


def put(x: np.ndarray, spec: P) -> jax.Array:
    """A global array from a value every process holds whole: each takes its own shards."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, NamedSharding(MESH, spec), lambda i: x[i])


def host(x: jax.Array) -> np.ndarray:
    """A global array's whole value on every process (shards of other processes gathered)."""
    if x.is_fully_addressable:
        return np.asarray(x)
    if x.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def loss_fn(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    pred = jnp.tanh(x @ params["w1"]) @ params["w2"]
    return jnp.mean((pred - y) ** 2)


def init_params(zero_w2: bool = False) -> dict:
    rng = np.random.default_rng(0)
    w1 = (0.3 * rng.standard_normal((D_IN, D_HID))).astype(np.float32)
    w2 = (0.3 * rng.standard_normal((D_HID, D_OUT))).astype(np.float32)
    return {"w1": w1, "w2": np.zeros_like(w2) if zero_w2 else w2}


def batch(step: int, poisoned: set[int]) -> tuple[jax.Array, jax.Array]:
    """Step ``step``'s global batch, split over the mesh by rows; one inf example in a
    poisoned step, on the last device."""
    rng = np.random.default_rng(100 + step)
    x = rng.standard_normal((BATCH, D_IN)).astype(np.float32)
    y = rng.standard_normal((BATCH, D_OUT)).astype(np.float32)
    if step in poisoned:
        x[POISON_ROW, 3] = np.inf
    return put(x, P("d")), put(y, P("d"))


def global_copy(tree: object) -> object:
    """Every leaf of ``tree`` (a scaler's state) replicated over the mesh: a leaf left on one
    device, restored from a checkpoint, would stay there, apart from the mesh's arrays."""
    return jax.tree.map(lambda v: put(v, P()), tree)


def replicated(params: dict) -> dict:
    return {k: put(v, P()) for k, v in params.items()}


FSDP = {"w1": P("d", None), "w2": P("d", None)}  # each device holds a quarter of every weight


def fsdp(params: dict) -> dict:
    return {k: put(v, FSDP[k]) for k, v in params.items()}


amp16 = autocast.amp(loss_fn, compute_dtype=jnp.float16)


# --- the comparison cases: each returns {name: array} -----------------------------------


def case_dp_optax() -> dict:
    """Data-parallel jit, float16 with the optax face."""
    tx = autocast.optax.dynamic_loss_scaling(
        optax.adam(1e-2), autocast.DynamicLossScale(jnp.float32(2.0**15), period=2)
    )
    params = replicated(init_params())
    opt_state = jax.jit(tx.init, out_shardings=REPLICATED)(params)

    @jax.jit
    def step(params, opt_state, x, y):
        scale = autocast.optax.loss_scale_of(opt_state)
        grads = jax.grad(lambda p: scale.scale(amp16(p, x, y)))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    scales, skipped = [], []
    for i in range(STEPS):
        params, opt_state = step(params, opt_state, *batch(i, POISONED))
        scales.append(host(autocast.optax.loss_scale_of(opt_state).loss_scale))
        skipped.append(host(autocast.optax.skipped_steps(opt_state)))
    return {
        **{k: host(v) for k, v in params.items()},
        "scale": np.array(scales),
        "skipped": np.array(skipped),
    }


def case_fsdp_jmp() -> dict:
    """Parameters sharded over the mesh (FSDP-style), float16 with a jmp-style loss scale."""
    shardings = {k: NamedSharding(MESH, s) for k, s in FSDP.items()}
    params = fsdp(init_params())
    ls = global_copy(autocast.DynamicLossScale(jnp.float32(2.0**15), period=2))

    @jax.jit
    def step(params, ls, x, y):
        grads = ls.unscale(jax.grad(lambda p: ls.scale(amp16(p, x, y)))(params))
        finite = autocast.all_finite(grads)
        new = jax.tree.map(lambda p, g: p - 0.05 * g, params, grads)
        params = jax.lax.with_sharding_constraint(
            autocast.select_tree(finite, new, params), shardings
        )
        return params, ls.adjust(finite), finite

    scales, finite = [], []
    for i in range(STEPS):
        params, ls, ok = step(params, ls, *batch(i, POISONED))
        scales.append(host(ls.loss_scale))
        finite.append(host(ok))
    assert all(p.sharding.spec == FSDP[k] for k, p in params.items()), (
        "the weights left their shards"
    )
    skipped = np.cumsum(~np.array(finite))
    return {
        **{k: host(v) for k, v in params.items()},
        "scale": np.array(scales),
        "skipped": skipped,
    }


def case_shard_map_jaxamp() -> dict:
    """The jaxamp face inside shard_map, axis_name spanning every device of both processes."""
    grad_fn = autocast.dynamic_scale_value_and_grad(amp16, axis_name="d")

    def local(params, state, x, y):
        state, (loss, grads) = grad_fn(params, x, y, dynamic_scaler_state=state)
        grads = jax.lax.pmean(grads, "d")
        finite = autocast.all_finite(grads)
        new = jax.tree.map(lambda p, g: p - 0.05 * g, params, grads)
        return autocast.select_tree(finite, new, params), state

    step = jax.jit(_compat.shard_map(local, MESH, (P(), P(), P("d"), P("d")), (P(), P())))
    params = replicated(init_params())
    state = global_copy(autocast.DynamicScalerState(patience=2))
    scales, skipped = [], []
    for i in range(STEPS):
        params, state = step(params, state, *batch(i, POISONED))
        scales.append(host(state.scaler))
        skipped.append(host(state.total_resets))
    return {
        **{k: host(v) for k, v in params.items()},
        "scale": np.array(scales),
        "skipped": np.array(skipped),
    }


def case_fp8_delayed() -> dict:
    """Delayed float8 under the jaxamp face: the history advanced from the global gradient."""
    loss8 = autocast.amp_fp8_delayed(loss_fn, history=4)
    params = replicated(init_params())
    history = loss8.init(params, *batch(0, set()))
    grad_fn = jax.jit(autocast.dynamic_scale_grad(loss8, argnums=(0, 1)))
    state = global_copy(autocast.DynamicScalerState(patience=2))

    @jax.jit
    def apply(history, params, g_history, grads):
        finite = autocast.all_finite(grads)
        new = jax.tree.map(lambda p, g: p - 0.05 * g, params, grads)
        return history.advance(g_history), autocast.select_tree(finite, new, params)

    scales, skipped = [], []
    for i in range(STEPS):
        x, y = batch(i, POISONED)
        state, (g_history, grads) = grad_fn(history, params, x, y, dynamic_scaler_state=state)
        history, params = apply(history, params, g_history, grads)
        scales.append(host(state.scaler))
        skipped.append(host(state.total_resets))
    out = {k: host(v) for k, v in params.items()}
    out.update({f"amax{i}": host(a) for i, a in enumerate(history.amax)})
    out["measured"] = np.array(history.measured)
    return {**out, "scale": np.array(scales), "skipped": np.array(skipped)}


def _state16_tx():
    """float16 with the optax face around AdamW whose moments are stored in 8 bits, the
    bfloat16 parameters rounded stochastically (docs/training_state.md)."""
    return autocast.optax.dynamic_loss_scaling(
        optax.chain(
            autocast.optax.low_precision_state(optax.adamw(1e-2), jnp.float8_e4m3fn, key=1),
            autocast.optax.stochastic_rounding(2),
        ),
        autocast.DynamicLossScale(jnp.float32(2.0**15), period=2),
    )


def _state16_start(tx):
    """bfloat16 parameters sharded FSDP-style, and the optimizer state made where they are."""
    params = {k: put(v.astype(jnp.bfloat16), FSDP[k]) for k, v in init_params().items()}
    where = autocast.optax.state_shardings(jax.eval_shape(tx.init, params), params)
    return params, jax.jit(tx.init, out_shardings=where)(params), where


def _state16_step(tx, where):
    shardings = {k: NamedSharding(MESH, s) for k, s in FSDP.items()}

    @jax.jit
    def step(params, opt_state, x, y):
        scale = autocast.optax.loss_scale_of(opt_state)
        grads = jax.grad(lambda p: scale.scale(amp16(p, x, y)))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = jax.lax.with_sharding_constraint(optax.apply_updates(params, updates), shardings)
        return params, jax.lax.with_sharding_constraint(opt_state, where)

    return step


def _assert_where(tree, where) -> None:
    """Every array of ``tree`` placed as ``where`` says (specs compared without trailing
    Nones, which split nothing)."""

    def spec(s):
        s = tuple(s.spec)
        while s and s[-1] is None:
            s = s[:-1]
        return s

    got = [spec(a.sharding) for a in jax.tree_util.tree_leaves(tree)]
    want = [spec(s) for s in jax.tree_util.tree_leaves(where)]
    assert got == want, (got, want)


def case_fsdp_state16() -> dict:
    """bfloat16 parameters sharded over the mesh (FSDP), AdamW's moments in 8 bits sharded
    as their parameters are, stochastic rounding, float16 with the optax face."""
    tx = _state16_tx()
    params, opt_state, where = _state16_start(tx)
    step = _state16_step(tx, where)
    mu = opt_state.inner.inner_state[0].inner[0].mu["w1"]
    assert tuple(mu.codes.sharding.spec)[:1] == ("d",), mu.codes.sharding
    scales, skipped = [], []
    for i in range(STEPS):
        params, opt_state = step(params, opt_state, *batch(i, POISONED))
        scales.append(host(autocast.optax.loss_scale_of(opt_state).loss_scale))
        skipped.append(host(autocast.optax.skipped_steps(opt_state)))
    _assert_where(opt_state, where)
    assert all(p.dtype == jnp.bfloat16 for p in params.values())
    return {
        **{k: host(v).astype(np.float32) for k, v in params.items()},
        "scale": np.array(scales),
        "skipped": np.array(skipped),
    }


def case_tools() -> dict:
    """report and diagnose on global arrays; they print nothing: process 0 prints their text."""
    params = replicated(init_params())
    x, y = batch(0, set())
    report = autocast.report(loss_fn, compute_dtype=jnp.float16)(params, x, y)
    diagnosis = autocast.diagnose(loss_fn, compute_dtype=jnp.float16)(params, x, y)
    if jax.process_index() == 0:  # the usual multi-process habit: one process prints
        print(f"REPORT {str(report).splitlines()[0]}", flush=True)
        print(f"DIAGNOSIS {len(diagnosis.entries)} entries", flush=True)
    return {
        "report_share": np.array(report.summary["low_precision_flop_share"]["forward"]),
        "diagnosis_errors": np.array([e.rel_error for e in diagnosis.entries]),
    }


# --- checkpoint and resume --------------------------------------------------------------

SAVE_AT, END = 10, 20
CK_POISONED = {3, 13}  # one bad step before the save, one after


def _sgd_select(params, grads):
    finite = autocast.all_finite(grads)
    new = jax.tree.map(lambda p, g: p - 0.05 * g, params, grads)
    return autocast.select_tree(finite, new, params)


def ck_bf16():
    """amp bfloat16 with adam: the state is params and adam's."""
    amp = autocast.amp(loss_fn, compute_dtype=jnp.bfloat16)
    tx = optax.adam(1e-2)
    params = replicated(init_params())
    state = {"params": params, "opt": jax.jit(tx.init, out_shardings=REPLICATED)(params)}

    @jax.jit
    def step(state, x, y):
        grads = jax.grad(amp)(state["params"], x, y)
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}

    return state, step, None


def ck_f16_jaxamp():
    """float16 with DynamicScalerState and dynamic_scale_grad."""
    grad_fn = autocast.dynamic_scale_grad(amp16)
    params = replicated(init_params())
    state = {"params": params, "scaler": global_copy(autocast.DynamicScalerState(patience=3))}

    @jax.jit
    def step(state, x, y):
        scaler, grads = grad_fn(state["params"], x, y, dynamic_scaler_state=state["scaler"])
        return {"params": _sgd_select(state["params"], grads), "scaler": scaler}

    return state, step, None


def ck_f16_optax():
    """float16 with the optax face around adam."""
    tx = autocast.optax.dynamic_loss_scaling(
        optax.adam(1e-2), autocast.DynamicLossScale(jnp.float32(2.0**15), period=3)
    )
    params = replicated(init_params())
    state = {"params": params, "opt": jax.jit(tx.init, out_shardings=REPLICATED)(params)}

    @jax.jit
    def step(state, x, y):
        scale = autocast.optax.loss_scale_of(state["opt"])
        grads = jax.grad(lambda p: scale.scale(amp16(p, x, y)))(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}

    return state, step, None


def ck_f16_jmp():
    """float16 with a jmp-style DynamicLossScale, the weights sharded over the mesh: each
    process saves and restores its own shards."""
    shardings = {k: NamedSharding(MESH, s) for k, s in FSDP.items()}
    ls = global_copy(autocast.DynamicLossScale(jnp.float32(2.0**15), period=3))
    state = {"params": fsdp(init_params()), "scale": ls}

    @jax.jit
    def step(state, x, y):
        ls = state["scale"]
        grads = ls.unscale(jax.grad(lambda p: ls.scale(amp16(p, x, y)))(state["params"]))
        params = jax.lax.with_sharding_constraint(_sgd_select(state["params"], grads), shardings)
        return {"params": params, "scale": ls.adjust(autocast.all_finite(grads))}

    return state, step, None


def ck_state16():
    """bfloat16 parameters sharded over the mesh with 8-bit AdamW moments sharded alike,
    stochastic rounding (its key in the state), float16 with the optax face."""
    tx = _state16_tx()
    params, opt_state, where = _state16_start(tx)
    step = _state16_step(tx, where)

    @jax.jit
    def both(state, x, y):
        params, opt = step(state["params"], state["opt"], x, y)
        return {"params": params, "opt": opt}

    return {"params": params, "opt": opt_state}, both, None


def ck_fp8():
    """Delayed float8 with a zero-initialised layer (rows init cannot measure keep current
    scaling: the issue's case), float16 scaling by the jaxamp face."""
    loss8 = autocast.amp_fp8_delayed(loss_fn, history=4)
    params = replicated(init_params(zero_w2=True))
    history = loss8.init(params, *batch(0, set()))
    assert history.measured[1] != (True, True, True), history.measured
    grad_fn = autocast.dynamic_scale_grad(loss8, argnums=(0, 1))
    state = {"params": params, "scaler": global_copy(autocast.DynamicScalerState(patience=3))}

    @jax.jit
    def step(state, history, x, y):
        scaler, (g_history, grads) = grad_fn(
            history, state["params"], x, y, dynamic_scaler_state=state["scaler"]
        )
        return {"params": _sgd_select(state["params"], grads), "scaler": scaler}, history.advance(
            g_history
        )

    return state, step, (loss8, history)


CHECKPOINT_CASES = {
    f.__name__: f for f in (ck_bf16, ck_f16_jaxamp, ck_f16_optax, ck_f16_jmp, ck_state16, ck_fp8)
}


def run_checkpoint_case(name: str, phase: str, ckpt: str) -> dict:
    import orbax.checkpoint as ocp

    state, step, fp8 = CHECKPOINT_CASES[name]()
    history = fp8[1] if fp8 else None
    ckptr = ocp.StandardCheckpointer()
    where = os.path.join(ckpt, name)
    start = 0
    if phase == "resume":
        # The freshly made state is the target: its structure, and its shardings, which
        # orbax reads each process's shards into.
        state = ckptr.restore(os.path.join(where, "state"), state)
        if fp8:
            loss8 = fp8[0]
            # restored without a target: its structure is rebuilt by the one call for it
            history = loss8.restore(
                ckptr.restore(os.path.join(where, "history")), state["params"], *batch(0, set())
            )
        start = SAVE_AT
    for i in range(start, END):
        if phase == "train" and i == SAVE_AT:
            ckptr.save(os.path.join(where, "state"), state)
            if fp8:
                ckptr.save(os.path.join(where, "history"), history)
            ckptr.wait_until_finished()
        # bfloat16 has no loss scaler to skip a bad batch with: its run has none
        x, y = batch(i, set() if name == "ck_bf16" else CK_POISONED)
        if fp8:
            state, history = step(state, history, x, y)
        else:
            state = step(state, x, y)
    ckptr.close()
    out = {
        "/".join(str(k) for k in path): _plain(host(v))
        for path, v in jax.tree_util.tree_flatten_with_path(state)[0]
    }
    if fp8:
        out.update({f"history/{i}": host(a) for i, a in enumerate(history.amax)})
        out["history/measured"] = np.array(history.measured)
    return out


def _plain(x: np.ndarray) -> np.ndarray:
    """bfloat16 and float8 arrays as their bits (np.savez keeps NumPy's own dtypes only)."""
    if x.dtype.kind == "V" or x.dtype.name in ("bfloat16", "float8_e4m3fn"):
        return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint8)
    return x


COMPARISON_CASES = {
    f.__name__: f
    for f in (
        case_dp_optax,
        case_fsdp_jmp,
        case_shard_map_jaxamp,
        case_fp8_delayed,
        case_fsdp_state16,
        case_tools,
    )
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--phase", choices=("train", "resume"), required=True)
    args = parser.parse_args()
    start()
    results = {}
    if args.phase == "train":
        for name, case in COMPARISON_CASES.items():
            results[name] = case()
    for name in CHECKPOINT_CASES:
        results[f"{name}_{args.phase}"] = run_checkpoint_case(name, args.phase, args.ckpt)
    # every process reports what it saw, so the test can check they all agree
    # (the scales, skip counts and every scaler's fields: whatever is small)
    summary = {
        name: {k: np.asarray(v).tolist() for k, v in r.items() if np.size(v) <= 8}
        for name, r in results.items()
    }
    with open(os.path.join(args.out, f"p{PROCESS_ID}-{args.phase}.json"), "w") as f:
        json.dump(summary, f)
    if PROCESS_ID == 0:
        for name, r in results.items():
            np.savez(
                os.path.join(args.out, f"{name}.npz"),
                **{k.replace("/", "__"): v for k, v in r.items()},
            )
    multihost_utils.sync_global_devices("done") if PROCESSES > 1 else None
    print(f"process {PROCESS_ID} done", flush=True)


if __name__ == "__main__":
    sys.exit(main())
