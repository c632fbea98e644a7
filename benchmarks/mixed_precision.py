"""What amp does to a model, read off its jaxpr: for a float32 MLP and GPT-style
transformers, compare float32, the same model cast to bfloat16 by hand (float32 layer norm,
softmax and loss), and amp with bfloat16 compute.

The demo's small GPT (2 layers, d=64, batch 16 of 32 tokens) runs as it is; a 4-layer GPT
(d=128, batch 8 of 64 tokens) runs in four forms: unrolled and as ``lax.scan`` over stacked
layers, each with and without ``jax.checkpoint`` per layer.

Columns: loss (and its deviation from float32), share of matmul FLOPs with 16-bit operands
forward and backward, float-to-float casts in the forward and gradient jaxprs, casts that
round-trip (a -> b -> a), and bytes of the residuals jax.vjp keeps (the activation
memory) with ratios to float32 and to the hand-cast model; "act" repeats the two ratios
leaving out residuals that are arguments passed through unchanged (float32 weights that a
checkpointed layer needs again): the memory the forward pass adds.

Last, GPT-2 small at its real size (``gpu_models.gpt2_loss``: 12x768, batch 8 of 1024):
the saved activations of each variant, from the jaxpr alone (nothing runs).

Run: ``.venv/bin/python benchmarks/mixed_precision.py``
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

import autocast
from autocast._src.demo import models as _models
from autocast._src.tools import measure as _measure


def measure(fn, args, reference_loss):
    fwd = jax.make_jaxpr(fn)(*args)
    bwd = jax.make_jaxpr(jax.grad(fn))(*args)
    loss = float(jax.jit(fn)(*args))
    return {
        "loss": loss,
        "loss_dev": abs(loss - reference_loss) / abs(reference_loss),
        "share_fwd": _measure.low_precision_flop_share(fwd),
        "share_bwd": _measure.low_precision_flop_share(bwd),
        "casts_fwd": _measure.count_casts(fwd),
        "casts_bwd": _measure.count_casts(bwd),
        "waste": _measure.wasted_casts(fwd) + _measure.wasted_casts(bwd),
        "residual_bytes": _measure.residual_bytes(fn, *args),
        "activation_bytes": _measure.residual_bytes(fn, *args, include_inputs=False),
    }


def models(names: Sequence[str] = ()):
    """(name, loss, arguments) of each model, or of those named."""
    key = jax.random.PRNGKey(0)
    chosen = lambda name: not names or name in names  # noqa: E731
    if chosen("MLP"):
        mlp_params = _models.init_mlp(key, (256, 512, 512, 10))
        x = jax.random.normal(key, (128, 256))
        y = jnp.arange(128) % 10
        yield "MLP", _models.mlp_loss, (mlp_params, x, y)
    if chosen("GPT small"):  # the demo's model and batch
        small = _models.init_gpt(key, vocab=64, d=64, layers=2, seq=32)
        yield (
            "GPT small",
            _models.gpt_loss,
            (small, _models.gpt_batch(key, batch=16, seq=32, vocab=64)),
        )
    forms = [
        (("GPT scan" if scan else "GPT") + (" +ckpt" if remat else ""), scan, remat)
        for scan in (False, True)
        for remat in (False, True)
    ]
    if not any(chosen(name) for name, _, _ in forms):
        return
    gpt_params = _models.init_gpt(key, vocab=256, d=128, layers=4, seq=64)
    stacked = _models.stack_blocks(gpt_params)
    tokens = _models.gpt_batch(key, batch=8, seq=64, vocab=256)
    for name, scan, remat in forms:
        if chosen(name):
            yield name, _gpt_loss(scan, remat), (stacked if scan else gpt_params, tokens)


def _gpt_loss(scan: bool, remat: bool) -> Callable[..., jax.Array]:
    def loss(p: Any, t: jax.Array, hand_cast: Any = None) -> jax.Array:
        return _models.gpt_loss(p, t, hand_cast, scan=scan, remat=remat)

    return loss


def variants(loss_fn: Callable[..., Any], fp8: bool = False) -> dict[str, Callable[..., Any]]:
    """float32, cast to bfloat16 by hand (the model's ``hand_cast`` argument), amp bfloat16,
    and with ``fp8`` amp with float8 products."""
    out = {
        "float32": loss_fn,
        "hand bf16": lambda *a, f=loss_fn: f(*a, jnp.bfloat16),
        "amp bf16": autocast.amp(loss_fn, compute_dtype=jnp.bfloat16),
    }
    if fp8:
        out["amp fp8"] = autocast.amp(loss_fn, compute_dtype="fp8")
    return out


def main(names: Sequence[str] = ()) -> dict[str, dict]:
    """Prints the table; returns model -> variant -> measures."""
    print(f"jax {jax.__version__}, backend {jax.default_backend()}")
    header = (
        f"{'model':14} {'variant':9} {'loss':>7} {'dev':>6} {'bf16 fwd':>8} {'bf16 bwd':>8} "
        f"{'casts f/b':>9} {'waste':>5} {'resid MB':>8} {'vs f32':>6} {'vs hand':>7} "
        f"{'act/f32':>7} {'act/hand':>8}"
    )
    print(header)
    results = {}
    for name, loss_fn, args in models(names):
        ref = float(jax.jit(loss_fn)(*args))
        rows = results[name] = {k: measure(f, args, ref) for k, f in variants(loss_fn).items()}
        f32, hand = rows["float32"], rows["hand bf16"]
        for k, r in rows.items():
            print(
                f"{name:14} {k:9} {r['loss']:7.4f} {r['loss_dev']:6.2%} {r['share_fwd']:8.1%} "
                f"{r['share_bwd']:8.1%} {r['casts_fwd']:>4}/{r['casts_bwd']:<4} {r['waste']:>5} "
                f"{r['residual_bytes'] / 2**20:8.2f} "
                f"{r['residual_bytes'] / f32['residual_bytes']:6.2f} "
                f"{r['residual_bytes'] / hand['residual_bytes']:7.2f} "
                f"{r['activation_bytes'] / f32['activation_bytes']:7.2f} "
                f"{r['activation_bytes'] / hand['activation_bytes']:8.2f}"
            )
    if not names or "GPT-2 small" in names:
        results["GPT-2 small"] = real_size_activations()
    return results


def real_size_activations() -> dict[str, dict]:
    """Saved activations of GPT-2 small at its real size (12 layers, d=768, batch 8 of 1024
    tokens, attention written out), read off the jaxpr of ``jax.vjp`` with abstract inputs:
    nothing runs, so any machine can rerun it. Arguments kept as they are (the float32
    parameters) are left out."""
    import functools
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    import gpu_models
    import gpu_step

    cfg = dict(gpu_step.MODELS["GPT-2 small"])
    params = jax.eval_shape(lambda: gpu_models.init_gpt2(jax.random.key(0), **cfg))
    tokens = jax.ShapeDtypeStruct((cfg["batch"], cfg["seq"] + 1), jnp.int32)
    loss = functools.partial(gpu_models.gpt2_loss, heads=cfg["heads"], attention="naive")
    fns = {
        "float32": loss,
        "hand bf16": functools.partial(loss, hand=jnp.bfloat16),
        "amp bf16": autocast.amp(loss, compute_dtype=jnp.bfloat16),
    }
    rows = {
        k: {"activation_bytes": _measure.residual_bytes(f, params, tokens, include_inputs=False)}
        for k, f in fns.items()
    }
    f32, hand = rows["float32"]["activation_bytes"], rows["hand bf16"]["activation_bytes"]
    print(
        "GPT-2 small at real size (12x768, batch 8x1024, attention written out), saved activations:"
    )
    for k, r in rows.items():
        b = r["activation_bytes"]
        print(f"  {k:9} {b / 2**20:9.0f} MiB  act/f32 {b / f32:5.2f}  act/hand {b / hand:5.2f}")
    return rows


if __name__ == "__main__":
    main()
