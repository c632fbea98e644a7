"""Decoder training steps planned for TPU pods with no TPU: the memory per chip under data
parallelism and FSDP, and the largest global batch that fits (``autocast.plan``).

Rows: the 24x2048 decoder of ``gpu_step.py`` (about 1.3 B parameters) and a 32x4096 one
(about 6.9 B), sequence 1024, AdamW; hand bf16 (the parameters cast by hand), amp bf16, amp
bf16 with 16-bit parameters and moments, amp bf16 with 8-bit moments. "DP" replicates the
parameters and the optimizer's state on every chip; "FSDP" splits every parameter over the
chips along its largest dimension the chip count divides, a leading one before the last (an
8-bit moment is blocks along the last dimension, kept whole, so it can follow only a split of
a leading one), and puts each array of the optimizer's state where its parameter is
(``autocast.optax.state_shardings``). The tokens are split over the chips in both. Per
row: the planned peak per chip at one sequence per chip (or the compiler's refusal, with the
bytes it needed) and, with ``--search``, the largest global batch that fits, found by
doubling the sequences per chip, each probe one compile.

Run: ``.venv-tpu-plan/bin/python benchmarks/tpu_pods.py [--pods v5e:4x4,v5p:4x4x4]
[--models ...] [--shardings DP,FSDP] [--variants ...] [--search] [--json PATH]``
"""

from __future__ import annotations

import os

os.environ["JAX_PLATFORMS"] = "cpu"  # the TPUs are only compiled for

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Sequence  # noqa: E402

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

import gpu_models  # noqa: E402
import gpu_step  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import autocast  # noqa: E402
import autocast.optax  # noqa: E402
from autocast._src.tools import plan as planning  # noqa: E402

GiB = 2**30
P = jax.sharding.PartitionSpec
MODELS = {
    "decoder 24x2048": gpu_step.MODELS["decoder 24x2048"],
    "decoder 32x4096": dict(
        kind="gpt", layers=32, d=4096, heads=32, seq=1024, batch=1, vocab=gpu_step.GPT_VOCAB
    ),
}
VARIANTS = ("hand bf16", "amp bf16", "amp bf16 state16", "amp bf16 moments8")
SHARDINGS = ("DP", "FSDP")
PODS = ("v5e:4x4", "v5p:4x4x4")


def _split(tree: Any, chips: int) -> Any:
    """FSDP's placement of the parameters: each array split over ``"data"`` along its largest
    leading dimension that ``chips`` divides, else its last, replicated where none does."""

    def spec(a: Any) -> P:
        dims = [i for i, n in enumerate(a.shape) if n % chips == 0]
        dims = [i for i in dims if i < len(a.shape) - 1] or dims
        if not dims:
            return P()
        i = max(dims, key=lambda i: a.shape[i])
        return P(*([None] * i), "data")

    return jax.tree_util.tree_map(spec, tree)


def _beside(opt_state: Any, params: Any, specs: Any) -> Any:
    """The optimizer state's PartitionSpecs, each array where its parameter is, by
    ``autocast.optax.state_shardings``; it reads only the specs' axis names, so a one-device
    mesh of this machine's CPU names them."""
    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:1]), ("data",))
    placed = jax.tree_util.tree_map(
        lambda a, spec: jax.ShapeDtypeStruct(
            a.shape, a.dtype, sharding=jax.sharding.NamedSharding(mesh, spec)
        ),
        params,
        specs,
    )
    where = autocast.optax.state_shardings(opt_state, placed)
    return jax.tree_util.tree_map(lambda s: s.spec, where)


def step_and_state(config: dict, variant: str) -> tuple[Any, Any, Any]:
    """The jitted training step of one row and its abstract parameters and optimizer state."""
    hand = jnp.bfloat16 if variant == "hand bf16" else None
    loss = functools.partial(
        gpu_models.gpt2_loss, heads=config["heads"], attention="naive", hand=hand
    )
    if variant.startswith("amp"):
        loss = autocast.amp(loss, compute_dtype=jnp.bfloat16)
    params = jax.eval_shape(functools.partial(gpu_models.init_gpt2, jax.random.key(0), **config))
    optimizer = optax.adamw(3e-4, weight_decay=0.1)
    if variant in gpu_step.STATE_VARIANTS:
        params, optimizer = gpu_step._state_in(gpu_step.STATE_VARIANTS[variant], params, optimizer)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params: Any, opt_state: Any, tokens: jax.Array) -> tuple[Any, Any, jax.Array]:
        value, grads = jax.value_and_grad(loss)(params, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return step, params, jax.eval_shape(optimizer.init, params)


def plan_row(config: dict, variant: str, pod: str, sharding: str, per_chip: int) -> Any:
    step, params, opt_state = step_and_state(config, variant)
    n = len(planning._devices("tpu-" + pod)[0])
    tokens = jax.ShapeDtypeStruct((per_chip * n, config["seq"] + 1), jnp.int32)
    if sharding == "FSDP":
        specs = _split(params, n)
        state = (specs, _beside(opt_state, params, specs))
    else:
        state = (None, None)
    return autocast.plan(
        step, params, opt_state, tokens, target="tpu-" + pod, shardings=(*state, P("data"))
    )


def _needed(refusal: str) -> str:
    """What the compiler's refusal says was needed, and of how much."""
    m = re.search(r"for ([\w ]+?) \(([\d.]+G)\) exceeds available HBM \(([\d.]+G)\)", refusal)
    return f"{m.group(1)} {m.group(2)} > {m.group(3)}" if m else refusal[:70]


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", default=",".join(PODS))
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--shardings", default=",".join(SHARDINGS))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--search", action="store_true", help="the largest batch that fits")
    parser.add_argument("--json", default=str(HERE / "tpu_pods.json"))
    options = parser.parse_args(argv)
    pick = lambda text: [x.strip() for x in text.split(",") if x.strip()]  # noqa: E731
    results: dict[str, Any] = {}
    print(f"jax {jax.__version__}; per-chip figures; compiled with no TPU")
    print(
        f"{'model':16} {'pod':10} {'shard':5} {'variant':18} {'peak GiB':>8} {'of':>4} "
        f"{'compile s':>9}  largest global batch"
    )
    for model in pick(options.models):
        for pod in pick(options.pods):
            for sharding in pick(options.shardings):
                for variant in pick(options.variants):
                    p = plan_row(MODELS[model], variant, pod, sharding, 1)
                    row = {
                        "chips": p.chips,
                        "fits": p.fits,
                        "peak_gib": None if p.peak_bytes is None else p.peak_bytes / GiB,
                        "refusal": p.refusal,
                        "compile_s": p.compile_seconds,
                        "largest_global_batch": None,
                    }
                    if options.search and p.fits:
                        per_chip = 1
                        while per_chip < 32:
                            probe = plan_row(MODELS[model], variant, pod, sharding, 2 * per_chip)
                            if not probe.fits:
                                break
                            per_chip *= 2
                        row["largest_global_batch"] = per_chip * p.chips
                    results[f"{model} / {pod} / {sharding} / {variant}"] = row
                    if p.fits:
                        peak = f"{row['peak_gib']:8.2f}"
                    elif p.refusal is None:
                        peak = f"over the chip's memory: {row['peak_gib']:.2f}"
                    else:
                        peak = f"refused: {_needed(p.refusal)}"
                    batch = row["largest_global_batch"] or "-"
                    print(
                        f"{model:16} {pod:10} {sharding:5} {variant:18} {peak} "
                        f"{p.capacity_bytes // GiB if p.fits else '':>4} "
                        f"{p.compile_seconds:9.0f}  {batch}",
                        flush=True,
                    )
                    Path(options.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
