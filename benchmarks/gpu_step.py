"""Training-step time, throughput and peak memory at real sizes: amp against float32,
a careful hand cast, the framework's own bfloat16 and, optionally, torch.autocast.

Models (``gpu_models.py``): GPT-2 small (12x768) and medium (24x1024) at batch 8 of 1024
tokens, a 24x2048 decoder (about 1.3 B parameters) at batch 4 and at batch 8
(``decoder 24x2048 b8``), each with AdamW and with
attention written out ("naive") or fused (cuDNN's kernel through
``jax.nn.dot_product_attention``; JAX's XLA path for a float32 program); ResNet-18 with
BatchNorm on 224x224 images at batch 128, with SGD and momentum.

Variants: ``float32`` (TF32 matmuls on a GPU, XLA's default), ``hand bf16`` (GPTs) or
``flax bf16`` (ResNet-18, Flax's ``dtype=bfloat16``), ``amp bf16``, ``amp fp8``, and for the
GPTs ``amp bf16 state16`` (amp bf16 with the training state in 16 bits: bfloat16
parameters and AdamW moments, both stochastically rounded, ``autocast.optax``), ``amp bf16
moments8`` (float32 parameters, AdamW moments in 8 bits) and ``amp fp8 delay``
(``autocast.amp_fp8_delayed``, history 16, its histories carried in the step's state); by
name only (``--rows``), ``amp bf16 merged`` (recomputed chains left for XLA to merge into the
forward pass, what recomputation costs) and the dequantised float8 forms; with
``--torch``, PyTorch's ``autocast`` eager and under ``torch.compile``, naive attention and
``scaled_dot_product_attention`` (GPTs, when PyTorch and a CUDA device are there).

Each variant runs in a process of its own, so each device peak is that variant's alone.
Figures: mean step time over ``--steps`` steps after two warm-up steps, TFLOP/s from model
FLOPs (GPT: 6 x parameters x tokens + 12 x layers x sequence x width x tokens; ResNet-18:
three times its forward FLOPs from XLA's cost analysis), the device's peak bytes in use
(the compiled program's planned peak where the device reports none) beside the compiled
program's own plan and the compile time, and the loss after the warm-up and timed steps on
generated, learnable batches.

``--tiny`` runs the same code on models a CPU trains in seconds (the test suite runs it);
the real sizes are for a GPU. ``make bench`` runs this on a GPU.

Run: ``.venv/bin/python benchmarks/gpu_step.py [--tiny] [--models ...] [--torch]``
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

HERE = Path(__file__).parent

GPT_VOCAB = 50304
MODELS: dict[str, dict[str, Any]] = {
    "GPT-2 small": dict(kind="gpt", layers=12, d=768, heads=12, seq=1024, batch=8, vocab=GPT_VOCAB),
    "GPT-2 medium": dict(
        kind="gpt", layers=24, d=1024, heads=16, seq=1024, batch=8, vocab=GPT_VOCAB
    ),
    "decoder 24x2048": dict(
        kind="gpt", layers=24, d=2048, heads=16, seq=1024, batch=4, vocab=GPT_VOCAB
    ),
    # the same decoder at twice the batch, where float8's target is set (docs/fp8.md)
    "decoder 24x2048 b8": dict(
        kind="gpt", layers=24, d=2048, heads=16, seq=1024, batch=8, vocab=GPT_VOCAB
    ),
    "ResNet-18": dict(kind="resnet", batch=128, size=224, classes=1000, width=64),
}
TINY: dict[str, dict[str, Any]] = {
    "GPT-2 small": dict(kind="gpt", layers=2, d=64, heads=4, seq=32, batch=2, vocab=128),
    "GPT-2 medium": dict(kind="gpt", layers=3, d=64, heads=4, seq=32, batch=2, vocab=128),
    "decoder 24x2048": dict(kind="gpt", layers=2, d=128, heads=4, seq=32, batch=1, vocab=128),
    "decoder 24x2048 b8": dict(kind="gpt", layers=2, d=128, heads=4, seq=32, batch=2, vocab=128),
    "ResNet-18": dict(kind="resnet", batch=2, size=32, classes=10, width=8),
}
GPT_VARIANTS = (
    "float32",
    "hand bf16",
    "amp bf16",
    "amp bf16 state16",
    "amp bf16 moments8",
    "amp fp8",
    "amp fp8 delay",
)
# The variants with the training state in fewer bits (autocast.optax): parameters' dtype,
# the optimizer state's.
STATE_VARIANTS = {
    "amp bf16 state16": ("bfloat16", "bfloat16"),
    "amp bf16 moments8": ("float32", "float8_e4m3fn"),
}
# The float8 variants with their products written in the other form XLA may match to a
# float8 GEMM (``autocast._src.fp8.products.GEMM_FORMS``): run only when asked for by name.
FORM_VARIANTS = {"amp fp8 dq": "dequantised", "amp fp8 delay dq": "dequantised"}
# The float8 variants with finer scales (docs/fp8.md, "Finer scales"): their compute dtypes;
# run only when asked for by name ("amp mxfp8" needs a Blackwell GPU or a plan for one).
SCALING_VARIANTS = {"amp fp8 rowwise": "fp8_rowwise", "amp mxfp8": "mxfp8"}
# amp bf16 with its recomputed chains merged back into the forward pass by XLA (no
# ``prevent_cse`` barrier outside loops, ``recompute.PREVENT_CSE_OUTSIDE_LOOPS``): what real
# recomputation costs in time against the memory it saves; run only when asked for by name.
MERGED_VARIANT = "amp bf16 merged"


def recompute_for(variant: str) -> None:
    """Sets amp's recomputed chains apart from the forward pass (``prevent_cse``) but for
    :data:`MERGED_VARIANT`. amp reads the switch when it traces, at a step's first lowering,
    so every variant sets it before that."""
    from autocast._src.transform import recompute

    recompute.PREVENT_CSE_OUTSIDE_LOOPS = variant != MERGED_VARIANT


RESNET_VARIANTS = ("float32", "flax bf16", "amp bf16", "amp fp8")
TORCH_VARIANTS = ("torch eager", "torch compile")
ATTENTIONS = ("naive", "fused")


def runs(
    models: Sequence[str],
    torch: bool,
    variants: Sequence[str] = (),
    attentions: Sequence[str] = ATTENTIONS,
) -> list[tuple[str, str, str]]:
    """(model, variant, attention) of every run, in table order; ``variants`` (empty: all)
    and ``attentions`` narrow them."""
    out = []
    for model in models:
        if MODELS[model]["kind"] == "resnet":
            out += [(model, v, "-") for v in RESNET_VARIANTS]
        else:
            names = GPT_VARIANTS + (TORCH_VARIANTS if torch else ())
            out += [(model, v, a) for a in attentions for v in names]
    return [r for r in out if not variants or r[1] in variants]


# ---- one run, in its own process -------------------------------------------------------------


def _gpt_step(
    config: dict, variant: str, attention: str, abstract: bool = False, gpu: bool | None = None
) -> tuple[Callable, Any, float]:
    """The jitted AdamW step ``((history, params), opt_state, i) -> (same, loss)`` (the
    history None but for ``amp fp8 delay``), the initial state, and the model FLOPs of one
    step. ``abstract``: the state as shapes and dtypes only (``jax.eval_shape``), for
    compiling without running; ``gpu``: compile for a GPU (cuDNN's attention) whatever the
    default backend is."""
    import _training
    import gpu_models
    import jax
    import jax.numpy as jnp
    import optax

    import autocast

    gpu = jax.default_backend() == "gpu" if gpu is None else gpu
    if attention in ("naive", "pallas"):
        kind = attention
    else:  # cuDNN's kernel takes 16-bit inputs; a float32 program gets JAX's own fused path
        kind = "cudnn" if gpu and variant != "float32" else "xla"
    hand = jnp.bfloat16 if variant == "hand bf16" else None
    loss = functools.partial(gpu_models.gpt2_loss, heads=config["heads"], attention=kind, hand=hand)
    init = functools.partial(gpu_models.init_gpt2, jax.random.key(0), **config)
    params = jax.eval_shape(init) if abstract else init()
    optimizer = optax.adamw(3e-4, weight_decay=0.1)
    tokens = config["batch"] * config["seq"]
    n = gpu_models.gpt2_params_count(params)
    flops = 6 * n * tokens + 12 * config["layers"] * config["seq"] * config["d"] * tokens
    recompute_for(variant)
    if variant.startswith("amp fp8"):
        from autocast._src.fp8 import products as fp8

        fp8._GEMM_FORM = FORM_VARIANTS.get(variant, "direct")
    if variant.startswith("amp fp8 delay"):
        loss = autocast.amp_fp8_delayed(loss, history=16)
    elif variant.startswith("amp"):
        bf16 = variant.startswith("amp bf16")
        float8 = SCALING_VARIANTS.get(variant, "fp8")
        loss = autocast.amp(loss, compute_dtype=jnp.bfloat16 if bf16 else float8)
    if variant in STATE_VARIANTS:
        params, optimizer = _state_in(STATE_VARIANTS[variant], params, optimizer)
    # the state is (float8 history or None, parameters)
    batch = functools.partial(gpu_models.gpt2_batch, **config)
    if abstract:
        history = _training.planned_history(loss, params, jax.eval_shape(batch, jnp.asarray(0)))
    else:
        history = _training.first_history(loss, params, batch(jnp.asarray(0)))

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(state: Any, opt_state: Any, i: jax.Array) -> tuple[Any, Any, jax.Array]:
        history, params = state
        value, history, grads = _training.loss_and_grads(
            loss, history, params, gpu_models.gpt2_batch(i, **config)
        )
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (history, optax.apply_updates(params, updates)), opt_state, value

    opt_state = (jax.eval_shape if abstract else lambda f, x: f(x))(optimizer.init, params)
    return step, ((history, params), opt_state), float(flops)


def _state_in(dtypes: tuple[Any, Any], params: Any, optimizer: Any) -> tuple[Any, Any]:
    """The parameters in ``dtypes[0]`` (rounded stochastically when 16-bit) and the
    optimizer with its state stored in ``dtypes[1]`` (``autocast.optax``;
    docs/training_state.md)."""
    import jax
    import jax.numpy as jnp
    import optax

    import autocast.optax

    param_dtype, state_dtype = (jnp.dtype(d) for d in dtypes)
    params = jax.tree_util.tree_map(
        lambda p: (
            jax.ShapeDtypeStruct(p.shape, param_dtype)
            if isinstance(p, jax.ShapeDtypeStruct)
            else p.astype(param_dtype)
        ),
        params,
    )
    optimizer = autocast.optax.low_precision_state(optimizer, state_dtype, key=1)
    if param_dtype != jnp.float32:
        optimizer = optax.chain(optimizer, autocast.optax.stochastic_rounding(2))
    return params, optimizer


def _resnet_step(
    config: dict, variant: str, abstract: bool = False
) -> tuple[Callable, Any, float | None]:
    """As :func:`_gpt_step`, for ResNet-18 with SGD and momentum; the FLOPs are None when
    ``abstract`` (they come from running XLA's cost analysis)."""
    import gpu_models
    import jax
    import jax.numpy as jnp
    import optax

    import autocast

    dtype = jnp.bfloat16 if variant == "flax bf16" else jnp.float32
    model = gpu_models.ResNet18(config["classes"], config["width"], dtype)
    batch = jax.jit(functools.partial(gpu_models.image_batch, **config))
    images = (jax.eval_shape if abstract else lambda f, i: f(i))(batch, jnp.asarray(0))[0]
    # a jitted init on the "rbg" generator compiles in a third of the default's time
    init = functools.partial(model.init, jax.random.key(0, impl="rbg"))
    variables = jax.eval_shape(init, images) if abstract else jax.jit(init)(images)
    loss = gpu_models.resnet_loss(model)
    if variant.startswith("amp"):
        loss = autocast.amp(loss, compute_dtype=jnp.bfloat16 if variant == "amp bf16" else "fp8")
    optimizer = optax.sgd(0.05, momentum=0.9)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(variables: Any, opt_state: Any, i: jax.Array) -> tuple[Any, Any, jax.Array]:
        (value, stats), grads = jax.value_and_grad(
            lambda p: loss({**variables, "params": p}, *gpu_models.image_batch(i, **config)),
            has_aux=True,
        )(variables["params"])
        updates, opt_state = optimizer.update(grads, opt_state, variables["params"])
        params = optax.apply_updates(variables["params"], updates)
        return {"params": params, "batch_stats": stats}, opt_state, value

    opt_state = (jax.eval_shape if abstract else lambda f, x: f(x))(
        optimizer.init, variables["params"]
    )
    if abstract:
        return step, (variables, opt_state), None
    # the unoptimised forward program's FLOPs: no compile needed for them
    forward = jax.jit(lambda v, x: model.apply(v, x, mutable=["batch_stats"])).lower(
        variables, images
    )
    cost = forward.cost_analysis()
    if not cost:  # a GPU backend of JAX 0.11 has none before compiling
        cost = forward.compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return step, (variables, opt_state), 3.0 * float(cost["flops"])


def run_jax(config: dict, variant: str, attention: str, steps: int) -> dict:
    import jax
    import jax.numpy as jnp

    from autocast._src.tools import measure

    if config["kind"] == "gpt":
        step, (params, opt_state), flops = _gpt_step(config, variant, attention)
    else:
        step, (params, opt_state), flops = _resnet_step(config, variant)
    start = time.perf_counter()
    compiled = step.lower(params, opt_state, jnp.asarray(0)).compile()
    compile_s = time.perf_counter() - start
    planned = measure.planned_peak_bytes(compiled)
    for i in range(2):  # warm-up
        params, opt_state, value = step(params, opt_state, jnp.asarray(i))
    jax.block_until_ready(value)
    start = time.perf_counter()
    for i in range(2, 2 + steps):
        params, opt_state, value = step(params, opt_state, jnp.asarray(i))
    jax.block_until_ready((params, value))
    seconds = (time.perf_counter() - start) / steps
    device = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    return {
        "step_ms": 1e3 * seconds,
        "tflops": flops / seconds / 1e12,
        "peak_bytes": device if device else planned,
        "peak_is_device": bool(device),
        # the device's own plan of the step, autotuned: beside make gpu-plan's (which sums
        # arguments + outputs + temporaries - aliased, as "plan_sum_bytes" does)
        "planned_bytes": planned,
        "plan_sum_bytes": measure.planned_sum_bytes(compiled.memory_analysis()),
        "compile_s": compile_s,
        "loss": float(value),
    }


def run_torch(config: dict, variant: str, attention: str, steps: int) -> dict:
    """PyTorch's autocast (bfloat16) on the same GPT, eager or under ``torch.compile``."""
    import torch
    import torch_autocast

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_default_device(device)
    torch.manual_seed(0)
    params = torch_autocast.init_gpt(
        vocab=config["vocab"], d=config["d"], layers=config["layers"], seq=config["seq"]
    )
    leaves = torch_autocast._tensors(params)
    optimizer = torch.optim.AdamW(leaves, lr=3e-4, weight_decay=0.1)
    loss_fn = functools.partial(
        torch_autocast.gpt_loss,
        heads=config["heads"],
        attention="sdpa" if attention == "fused" else "naive",
    )
    if variant == "torch compile":
        loss_fn = torch.compile(loss_fn)

    def batch(i: int) -> torch.Tensor:
        g = torch.Generator(device=device).manual_seed(i)
        start = torch.randint(0, config["vocab"], (config["batch"], 1), generator=g)
        t = (start + 7 * torch.arange(config["seq"] + 1)) % config["vocab"]
        noise = torch.rand(t.shape, generator=g) < 0.1
        return torch.where(noise, torch.randint(0, config["vocab"], t.shape, generator=g), t)

    def step(i: int) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = loss_fn(params, batch(i))
        loss.backward()
        optimizer.step()
        return loss.detach()

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for i in range(2):
        step(i)
    sync()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for i in range(2, 2 + steps):
        value = step(i)
    sync()
    seconds = (time.perf_counter() - start) / steps
    tokens = config["batch"] * config["seq"]
    n = sum(p.numel() for p in leaves)
    flops = 6 * n * tokens + 12 * config["layers"] * config["seq"] * config["d"] * tokens
    return {
        "step_ms": 1e3 * seconds,
        "tflops": flops / seconds / 1e12,
        "peak_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None,
        "peak_is_device": device == "cuda",
        "loss": float(value),
    }


def _one(argv: Sequence[str]) -> None:
    """``--one MODEL VARIANT ATTENTION STEPS TINY OUT``: a single run, its figures as JSON."""
    model, variant, attention, steps, tiny, out = argv
    config = (TINY if tiny == "1" else MODELS)[model]
    sys.path.insert(0, str(HERE))
    run = run_torch if variant.startswith("torch") else run_jax
    Path(out).write_text(json.dumps(run(config, variant, attention, int(steps))))


# ---- the table -------------------------------------------------------------------------------


def _spawn(
    model: str, variant: str, attention: str, steps: int, tiny: bool, timeout: float | None = None
) -> dict:
    """One run in a process of its own; its figures, or ``{"error": why}``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        try:
            done = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--one",
                    model,
                    variant,
                    attention,
                    str(steps),
                    str(int(tiny)),
                    str(out),
                ],
                text=True,
                capture_output=True,
                env=os.environ.copy(),
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            return {"error": f"took longer than {timeout:g} s"}
        if done.returncode:
            last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            return {"error": last[:200]}
        return json.loads(out.read_text())


def _torch_ready() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def main(argv: Sequence[str] | None = None) -> dict:
    """Runs every (model, variant, attention), each in its own process; prints the table and
    returns ``{model: {"variant / attention": figures}}``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="CPU-sized models (the tests run this)")
    parser.add_argument(
        "--models", default=",".join(MODELS), help=f"comma-separated: {', '.join(MODELS)}"
    )
    parser.add_argument(
        "--steps", type=int, default=20, help="timed steps per run (after 2 warm-up steps)"
    )
    parser.add_argument(
        "--torch", action="store_true", help="add torch.autocast runs (needs PyTorch and CUDA)"
    )
    parser.add_argument(
        "--variants", default="", help="comma-separated variants to run (default: all)"
    )
    parser.add_argument(
        "--attention", default=",".join(ATTENTIONS), help="comma-separated: naive, fused"
    )
    parser.add_argument(
        "--rows",
        default="",
        help="runs in this order, instead of the table: 'MODEL/VARIANT/ATTENTION;...' "
        f"(variants also {', '.join((*FORM_VARIANTS, MERGED_VARIANT))})",
    )
    parser.add_argument(
        "--timeout", type=float, default=None, help="seconds one run may take (default: no limit)"
    )
    parser.add_argument(
        "--json", default=str(HERE / "gpu_step.json"), help="where the figures are written"
    )
    options = parser.parse_args(argv)
    models = [m for m in options.models.split(",") if m]
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    torch = options.torch and (_torch_ready() or options.tiny)
    if options.torch and not torch:
        print("(--torch needs PyTorch and a CUDA device: the torch.autocast runs are left out)")
    if options.rows:
        chosen = [_row(text, parser) for text in options.rows.split(";") if text.strip()]
    else:
        chosen = runs(
            models,
            torch,
            [v for v in options.variants.split(",") if v],
            options.attention.split(","),
        )
    results: dict[str, dict] = {}
    print(
        f"{'model':18} {'variant':16} {'attention':9} {'step ms':>8} {'TFLOP/s':>8} "
        f"{'peak MiB':>9} {'plan MiB':>9} {'compile s':>9} {'loss':>7}",
        flush=True,
    )
    for model, variant, attention in chosen:
        r = _spawn(model, variant, attention, options.steps, options.tiny, options.timeout)
        results.setdefault(model, {})[f"{variant} / {attention}"] = r
        # written after every run, so that a run cut short keeps what it measured
        Path(options.json).write_text(json.dumps(results, indent=1))
        if "error" in r:
            print(f"{model:18} {variant:16} {attention:9} failed: {r['error']}", flush=True)
            continue
        peak = (
            "-"
            if r["peak_bytes"] is None
            else f"{r['peak_bytes'] / 2**20:.1f}" + ("" if r["peak_is_device"] else "*")
        )
        plan = r.get("plan_sum_bytes")
        plan = "-" if plan is None else f"{plan / 2**20:.1f}"
        compile_s = r.get("compile_s")
        compile_s = "-" if compile_s is None else f"{compile_s:.1f}"
        print(
            f"{model:18} {variant:16} {attention:9} {r['step_ms']:8.1f} {r['tflops']:8.2f} "
            f"{peak:>9} {plan:>9} {compile_s:>9} {r['loss']:7.3f}",
            flush=True,
        )
    print("(* the compiled program's planned peak: this device reports no peak of its own)")
    return results


def _row(text: str, parser: argparse.ArgumentParser) -> tuple[str, str, str]:
    """``MODEL/VARIANT/ATTENTION`` of ``--rows``, checked against the known names."""
    parts = [p.strip() for p in text.split("/")]
    kinds = {
        **{v: "gpt" for v in (*GPT_VARIANTS, *FORM_VARIANTS, MERGED_VARIANT, *TORCH_VARIANTS)},
        **{v: "resnet" for v in RESNET_VARIANTS},
    }
    if (
        len(parts) != 3
        or parts[0] not in MODELS
        or parts[1] not in kinds
        or parts[2] not in (*ATTENTIONS, "-")
    ):
        parser.error(f"--rows: {text!r} is not MODEL/VARIANT/ATTENTION with known names")
    return parts[0], parts[1], parts[2]


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        _one(sys.argv[2:])
    else:
        main()
