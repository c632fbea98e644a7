"""Training state precision: bytes per parameter, convergence and step time of each choice.

The choices (``CHOICES``), all with Adam(W) and amp's bfloat16 compute unless named:

- ``float32``: float32 parameters and moments, plain ``optax.adamw``;
- ``bf16 params, nearest``: bfloat16 parameters updated by ``optax.apply_updates`` alone
  (round to nearest), float32 moments: the stagnation the rounding exists for;
- ``bf16 params SR``: the same with ``stochastic_rounding``;
- ``bf16 params SR, bf16 moments``: and ``low_precision_state`` in bfloat16 (stochastic);
- ``bf16 params Kahan, bf16 moments``: a bfloat16 compensation instead of random bits;
- ``bf16 params SR, 8-bit moments``: moments in float8 e4m3 with a scale per 256 values;
- ``f32 params, bf16 moments`` / ``f32 params, 8-bit moments``: the moments alone;
- ``f32 params, bf16 moments nearest``: moments rounded to nearest, without a key;
- ``f16 compute + scaling, bf16 state``: amp float16 with ``dynamic_loss_scaling``,
  bfloat16 parameters (stochastic rounding) and moments.

Figures:

- bytes per parameter of the training state: parameters + gradients (the parameters'
  dtype: amp returns gradients in it) + optimizer state, from the arrays themselves (block
  scales and counters included), for GPT-2 medium's shapes (355 M parameters, made
  abstractly);
- the final loss of each choice (the trained model's float32 loss on held-out text, as the
  demo measures it), against float32's: the demo's GPT and a larger one, trained with a
  warm-up and cosine decay of the learning rate (the decay is where small updates vanish);
- the step time (median, after compiling) against plain ``optax.adamw``: the whole training
  step of the larger GPT, and the optimizer's update alone (``update`` and
  ``apply_updates``) on 16 M parameters;
- the optimizer update's compile time (``jit(tx.update)`` lowered and compiled on GPT-2
  medium's shapes, a leaf per layer's array as a module per layer makes: 292, nothing
  allocated) against plain AdamW on the same
  bfloat16 tree, for the rounding and state choices (``COMPILE_CHOICES``); ``--compile-only``
  prints this table alone.

Run: ``.venv/bin/python benchmarks/training_state.py`` (the demo's GPT, 300 steps: a few
minutes on 2 cores), ``--long`` (both GPTs, 1000 steps: about half an hour);
``.venv-gpu-plan/bin/python benchmarks/training_state.py --compile-only --device H100``
compiles the update for an H100 on this machine (``make gpu-plan``'s venv, no GPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

import autocast
import autocast.optax as ao
from autocast._src.demo import models as _models
from autocast._src.demo import run as _demo

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))


@dataclasses.dataclass(frozen=True)
class Choice:
    params: Any  # the parameters' dtype
    moments: Any  # None: plain optax; else low_precision_state's dtype
    rounding: str = "nearest"  # of the parameters: nearest, stochastic or kahan
    moment_key: bool = True  # stochastic rounding of the moments
    compute: Any = jnp.bfloat16
    scaling: bool = False


CHOICES = {
    "float32": Choice(jnp.float32, None),
    "bf16 params, nearest": Choice(jnp.bfloat16, jnp.float32),
    "bf16 params SR": Choice(jnp.bfloat16, jnp.float32, "stochastic"),
    "bf16 params SR, bf16 moments": Choice(jnp.bfloat16, jnp.bfloat16, "stochastic"),
    "bf16 params Kahan, bf16 moments": Choice(jnp.bfloat16, jnp.bfloat16, "kahan"),
    "bf16 params SR, 8-bit moments": Choice(jnp.bfloat16, jnp.float8_e4m3fn, "stochastic"),
    "f32 params, bf16 moments": Choice(jnp.float32, jnp.bfloat16),
    "f32 params, 8-bit moments": Choice(jnp.float32, jnp.float8_e4m3fn),
    "f32 params, bf16 moments nearest": Choice(jnp.float32, jnp.bfloat16, moment_key=False),
    "f16 compute + scaling, bf16 state": Choice(
        jnp.bfloat16, jnp.bfloat16, "stochastic", compute=jnp.float16, scaling=True
    ),
}
# Bytes per parameter: the distinct layouts (the compute dtype changes none).
BYTES_CHOICES = (
    "float32",
    "bf16 params SR",
    "bf16 params SR, bf16 moments",
    "bf16 params Kahan, bf16 moments",
    "bf16 params SR, 8-bit moments",
    "f32 params, bf16 moments",
    "f32 params, 8-bit moments",
)
MODELS = {
    "demo GPT": dict(vocab=len(_demo.ALPHABET), d=64, layers=2, seq=32),
    "GPT 4x128": dict(vocab=len(_demo.ALPHABET), d=128, layers=4, seq=32),
}
BATCH = 16
PEAK_LR, FINAL_LR, WARMUP = 3e-3, 3e-5, 50


def optimizer(choice: Choice, steps: int, seed: int = 0) -> optax.GradientTransformation:
    """AdamW with a warm-up and cosine decay, its state and rounding as ``choice`` says."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, PEAK_LR, WARMUP, max(steps, WARMUP + 1), FINAL_LR
    )
    adamw = optax.adamw(schedule, weight_decay=0.01)
    parts = []
    if choice.moments is None:
        parts.append(adamw)
    else:
        key = jax.random.key(seed + 1) if choice.moment_key else None
        parts.append(ao.low_precision_state(adamw, choice.moments, key=key))
    if choice.rounding == "stochastic":
        parts.append(ao.stochastic_rounding(jax.random.key(seed + 2)))
    elif choice.rounding == "kahan":
        parts.append(ao.kahan_summation())
    tx = parts[0] if len(parts) == 1 else optax.chain(*parts)
    if choice.scaling:
        tx = ao.dynamic_loss_scaling(tx)
    return tx


def make_step(loss: Callable[..., Any], tx: optax.GradientTransformation, scaled: bool) -> Any:
    @jax.jit
    def step(params: Any, opt_state: Any, tokens: jax.Array) -> tuple[Any, Any, jax.Array]:
        if scaled:
            scale = ao.loss_scale_of(opt_state)
            value, grads = jax.value_and_grad(lambda p: scale.scale(loss(p, tokens)))(params)
            value = scale.unscale(value)
        else:
            value, grads = jax.value_and_grad(loss)(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return step


def bytes_per_parameter(params: Any, choice: Choice) -> dict[str, float]:
    """Parameters, gradients and optimizer state, per parameter, for ``choice``."""
    typed = jax.tree_util.tree_map(lambda p: jax.ShapeDtypeStruct(p.shape, choice.params), params)
    n = sum(int(np.prod(p.shape)) for p in jax.tree_util.tree_leaves(params))
    state = jax.eval_shape(optimizer(choice, 1000).init, typed)
    p = _demo.array_bytes(typed) / n
    return {
        "params": p,
        "grads": p,
        "state": _demo.array_bytes(state) / n,
        "total": _demo.state_bytes_per_parameter(typed, state),
    }


def gpt2_medium_params() -> Any:
    """GPT-2 medium's parameter shapes (float32), made abstractly."""
    import gpu_models
    import gpu_step

    config = gpu_step.MODELS["GPT-2 medium"]
    return jax.eval_shape(
        lambda: gpu_models.init_gpt2(
            jax.random.key(0), **{k: v for k, v in config.items() if k != "kind"}
        )
    )


def per_layer(params: Any) -> Any:
    """``params`` with its stacked ``blocks`` split into one subtree per layer, as a model
    written with a module per layer (Flax, Equinox, Haiku) holds them."""
    blocks = params["blocks"]
    layers = jax.tree_util.tree_leaves(blocks)[0].shape[0]
    split = [
        jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), blocks)
        for _ in range(layers)
    ]
    return {**{k: v for k, v in params.items() if k != "blocks"}, "blocks": split}


def train(model: str, choice: Choice, steps: int, seed: int = 0) -> dict[str, Any]:
    """Trains one choice; its final held-out loss and training figures."""
    config = MODELS[model]
    params = _models.init_gpt(jax.random.PRNGKey(seed), **config)
    params = jax.tree_util.tree_map(lambda p: p.astype(choice.params), params)
    loss = autocast.amp(_models.gpt_loss, compute_dtype=choice.compute)
    tx = optimizer(choice, steps, seed)
    step = make_step(loss, tx, choice.scaling)
    opt_state = tx.init(params)
    data = _demo.batches(_demo.corpus(seed=seed), batch=BATCH, seq=config["seq"], seed=seed)
    losses, times = [], []
    for _ in range(steps):
        tokens = next(data)
        start = time.perf_counter()
        params, opt_state, value = step(params, opt_state, tokens)
        losses.append(float(value))
        times.append(time.perf_counter() - start)
    held_out_data = _demo.batches(
        _demo.corpus(n_sums=1000, seed=seed + 1), batch=64, seq=config["seq"], seed=seed + 1
    )
    evaluate = jax.jit(lambda p, t: _models.gpt_loss(jax.tree_util.tree_map(jnp.float32, p), t))
    final = statistics.fmean(float(evaluate(params, next(held_out_data))) for _ in range(8))
    return {
        "final_loss": final,
        "final_train_loss": statistics.fmean(losses[-20:]),
        "step_ms": 1e3 * statistics.median(times[1:]),
        "skipped": int(ao.skipped_steps(opt_state)) if choice.scaling else 0,
    }


def update_time(choice: Choice, n: int = 1 << 24, repeats: int = 10) -> float:
    """Milliseconds of the optimizer's update and ``apply_updates`` on ``n`` parameters (a
    few matrices), median of ``repeats`` after compiling."""
    width = min(n // 4, 4096)
    params = {f"w{i}": jnp.full((n // 4 // width, width), 0.5, choice.params) for i in range(4)}
    grads = jax.tree_util.tree_map(lambda p: jnp.full(p.shape, 1e-3, p.dtype), params)
    tx = optimizer(choice, 1000)

    @jax.jit
    def apply(params: Any, opt_state: Any) -> tuple[Any, Any]:
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state = tx.init(params)
    params, opt_state = jax.block_until_ready(apply(params, opt_state))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        params, opt_state = jax.block_until_ready(apply(params, opt_state))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


# The configurations whose update's compile time is compared with plain AdamW's (first: the
# others' ratios are to it).
COMPILE_CHOICES = {
    "bf16 params, AdamW": Choice(jnp.bfloat16, None),
    "float32 params, AdamW": Choice(jnp.float32, None),
    "bf16 params SR": Choice(jnp.bfloat16, None, "stochastic"),
    "bf16 params Kahan": Choice(jnp.bfloat16, None, "kahan"),
    "bf16 params SR, bf16 moments": CHOICES["bf16 params SR, bf16 moments"],
    "bf16 params SR, 8-bit moments": CHOICES["bf16 params SR, 8-bit moments"],
    "bf16 params Kahan, 8-bit moments, no key": Choice(
        jnp.bfloat16, jnp.float8_e4m3fn, "kahan", moment_key=False
    ),
}


def compile_seconds(choice: Choice, params: Any, where: Any = None) -> dict[str, float]:
    """Seconds to trace and lower, and to compile, ``jit(tx.update)`` for ``params`` (shapes)
    in ``choice``'s dtype: nothing is allocated, so GPT-2 medium's tree fits any machine.
    ``where``: a sharding on a compile-only device to compile for (the host's CPU if None)."""

    def shaped(p: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=where)

    typed = jax.tree_util.tree_map(
        lambda p: jax.ShapeDtypeStruct(p.shape, choice.params, sharding=where), params
    )
    tx = optimizer(choice, 1000)
    state = jax.tree_util.tree_map(shaped, jax.eval_shape(tx.init, typed))
    start = time.perf_counter()
    lowered = jax.jit(tx.update).lower(typed, state, typed)
    traced = time.perf_counter()
    lowered.compile()
    return {"lower_s": traced - start, "compile_s": time.perf_counter() - traced}


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--long", action="store_true", help="both GPTs, 1000 steps")
    parser.add_argument("--steps", type=int, default=None, help="training steps per choice")
    parser.add_argument("--models", default="", help=f"';'-separated: {'; '.join(MODELS)}")
    parser.add_argument("--choices", default="", help="';'-separated choices (default: all)")
    parser.add_argument("--no-timing", action="store_true", help="leave out the update timing")
    parser.add_argument(
        "--compile-only", action="store_true", help="only the update's compile time table"
    )
    parser.add_argument(
        "--device",
        default="",
        help="with --compile-only: compile for this GPU (a name of gpu_plan.DEVICES; needs "
        "make gpu-plan's venv) instead of the host's CPU",
    )
    parser.add_argument(
        "--update-params", type=int, default=1 << 24, help="parameters the update is timed on"
    )
    parser.add_argument("--seed", type=int, default=0, help="initial parameters, data and keys")
    parser.add_argument("--json", default="", help="where to write the figures")
    options = parser.parse_args(argv)
    steps = options.steps or (1000 if options.long else 300)
    models = [m.strip() for m in options.models.split(";") if m.strip()] or (
        list(MODELS) if options.long else ["demo GPT"]
    )
    choices = [c.strip() for c in options.choices.split(";") if c.strip()] or list(CHOICES)
    unknown = sorted(set(models) - set(MODELS)) + sorted(set(choices) - set(CHOICES))
    if unknown:
        parser.error(f"unknown: {', '.join(unknown)}")
    results: dict[str, Any] = {"jax": jax.__version__, "steps": steps, "seed": options.seed}

    where = None
    if options.device:
        # Only compiled for: JAX stays on the CPU, the GPU compiler runs here (gpu_plan).
        jax.config.update("jax_platforms", "cpu")
        sys.path.insert(0, str(Path(__file__).parent))
        import gpu_plan

        where = gpu_plan.sharding(options.device)
        results["device"] = options.device
    medium = gpt2_medium_params()
    n = sum(int(np.prod(p.shape)) for p in jax.tree_util.tree_leaves(medium))
    layered = per_layer(medium)
    leaves = len(jax.tree_util.tree_leaves(layered))
    print(
        f"optimizer update's lower + compile, GPT-2 medium, a leaf per layer ({leaves}), seconds:"
    )
    print(f"{'choice':42} {'lower':>6} {'compile':>8} {'total':>6} {'vs bf16 AdamW':>14}")
    results["compile_s"] = {}
    for name, choice in COMPILE_CHOICES.items():
        c = results["compile_s"][name] = compile_seconds(choice, layered, where)
        total = c["lower_s"] + c["compile_s"]
        base = results["compile_s"].get("bf16 params, AdamW", c)
        ratio = total / (base["lower_s"] + base["compile_s"])
        print(f"{name:42} {c['lower_s']:6.2f} {c['compile_s']:8.2f} {total:6.2f} {ratio:13.2f}x")
    if options.compile_only:
        return results

    print(f"\nbytes per parameter, Adam, GPT-2 medium's shapes ({n / 1e6:.0f} M parameters):")
    print(f"{'choice':36} {'params':>6} {'grads':>6} {'state':>6} {'total':>6}")
    results["bytes"] = {}
    for name in BYTES_CHOICES:
        b = results["bytes"][name] = bytes_per_parameter(medium, CHOICES[name])
        print(f"{name:36} {b['params']:6.2f} {b['grads']:6.2f} {b['state']:6.3f} {b['total']:6.3f}")

    results["loss"] = {}
    for model in models:
        print(
            f"\n{model}, {steps} AdamW steps (warm-up {WARMUP}, cosine decay "
            f"{PEAK_LR:g} -> {FINAL_LR:g}), final loss on held-out text:"
        )
        print(f"{'choice':36} {'final loss':>10} {'vs f32':>8} {'train':>7} {'step ms':>8}")
        rows = results["loss"][model] = {}
        for name in choices:
            r = rows[name] = train(model, CHOICES[name], steps, options.seed)
            ref = rows.get("float32", r)["final_loss"]
            print(
                f"{name:36} {r['final_loss']:10.4f} {r['final_loss'] / ref - 1:+8.2%} "
                f"{r['final_train_loss']:7.4f} {r['step_ms']:8.2f}"
                + (f"  skipped {r['skipped']}" if CHOICES[name].scaling else ""),
                flush=True,
            )

    if not options.no_timing:
        n = options.update_params
        print(
            f"\noptimizer update + apply_updates, {n / 2**20:g} Mi parameters (ms, median of 10):"
        )
        results["update_ms"] = {}
        base = None
        for name in BYTES_CHOICES:
            ms = results["update_ms"][name] = update_time(CHOICES[name], n)
            base = base or ms
            print(f"{name:36} {ms:8.1f} {ms / base:6.2f}x", flush=True)
    if options.json:
        Path(options.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
