"""Float8 compute: ``amp(compute_dtype="fp8")`` against amp with bfloat16.

For each model, amp bfloat16, amp float8 (e4m3 forward operands, e5m2 output gradients,
per-tensor current scaling; attention's batched products in bfloat16), to show what that
choice saves amp float8 with the batched products in float8 too ("fp8 all"), and
``autocast.amp_fp8_delayed`` ("fp8 delay", history 16: scales from past steps' amax; products
inside loops keep current scaling), and the finer scales: ``compute_dtype="fp8_rowwise"``
("fp8 rows", a scale per row) and ``"mxfp8"`` (a scale per 32 contracted elements; where the
installed JAX has ``jax.lax.scaled_dot``). Columns:

- ``8b fwd``, ``8b bwd``: share of matmul/conv FLOPs whose operands are all 8-bit, in the
  forward pass and in the backward pass (read off the jaxpr of ``jax.value_and_grad``);
- ``e5m2 bwd``: share of the backward FLOPs with an e5m2 operand;
- ``grad err``: relative L2 error of the gradient (all leaves) against float32's;
- ``act/bf16``: bytes of the residuals ``jax.vjp`` keeps (arguments left out), over amp
  bfloat16's;
- ``bytes/bf16``: bytes the compiled gradient step reads and writes (XLA's cost analysis),
  over amp bfloat16's: the CPU-side proxy for what quantisation costs a GPU in memory traffic;
- ``q passes``: tensors quantised to float8 in the gradient step, each a pass over it;
- ``serial``: those of them that wait for an amax of their own tensor (current scaling: a
  reduction, then the rounding pass; delayed scaling's wait for a history only);
- ``trained``, ``vs bf16``: for the demo's GPT, the mean loss of the last 10 of 150 Adam
  steps (learning rate 1e-3) on fresh generated token windows, and its deviation from amp
  bfloat16's.

After the table, one product with an outlier row (a token 2**20 times the others): the error
of the other rows' results against float32 in each scaling.

Step time against bfloat16 is in ``make bench``'s ``step`` section (a GPU, or
``--step-figures``): on a CPU, XLA runs float8 products by converting them, so no speed-up
can show there.

Run: ``.venv/bin/python benchmarks/fp8_compute.py``
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp

import autocast
from autocast._src.fp8 import products as fp8
from autocast._src.tools import measure as _measure

sys.path.insert(0, str(Path(__file__).parent))
import _training  # noqa: E402
import mixed_precision  # noqa: E402
import model_families  # noqa: E402

TRAIN_STEPS = 150
HISTORY = 16
# The default recipe with attention's batched products in float8 as well.
ALL_PRODUCTS = dataclasses.replace(fp8.DEFAULT_RECIPE, batched_products=True)
# The finer-scaled recipes, by the name of their row.
FINER = {
    "fp8 rows": "fp8_rowwise",
    **({"mxfp8": "mxfp8"} if hasattr(jax.lax, "scaled_dot") else {}),
}


def _has_e5m2(dtypes: list[Any]) -> bool:
    return any(d == jnp.float8_e5m2 for d in dtypes)


def shares(fn: Callable[..., Any], args: tuple) -> dict[str, float]:
    """8-bit FLOP shares forward and backward, and the backward's share with an e5m2 operand."""
    fwd = jax.make_jaxpr(fn)(*args)
    both = jax.make_jaxpr(jax.value_and_grad(fn))(*args)
    fp8 = _measure.flop_shares(fwd, both, _measure.at_most_bits(8))
    e5m2 = _measure.flop_shares(fwd, both, _has_e5m2)
    return {"fp8_fwd": fp8["forward"], "fp8_bwd": fp8["backward"], "e5m2_bwd": e5m2["backward"]}


def _models_to_measure() -> list[tuple[str, Callable[..., Any], tuple]]:
    out = list(mixed_precision.models(("MLP", "GPT small", "GPT scan +ckpt")))
    for name, make, batches in model_families.families():
        if name in ("CNN BatchNorm", "ViT"):
            loss, params, x, y = model_families.setup(make, batches)
            out.append((name, loss, (params, x, y)))
    return out


def _gpt_tokens(step: jax.Array) -> tuple[jax.Array]:
    x, y = model_families.generated_tokens(step, batch=16, seq=32, vocab=64)
    return (jnp.concatenate([x, y[:, -1:]], axis=1),)


def main() -> dict[str, dict]:
    """Prints the table; returns model -> variant -> measures."""
    print(f"jax {jax.__version__}, backend {jax.default_backend()}")
    print(
        f"{'model':15} {'variant':9} {'8b fwd':>7} {'8b bwd':>7} {'e5m2 bwd':>8} {'grad err':>8} "
        f"{'act/bf16':>8} {'bytes/bf16':>10} {'q passes':>8} {'serial':>6} "
        f"{'trained':>8} {'vs bf16':>7}"
    )
    results: dict[str, dict] = {}
    for name, loss_fn, args in _models_to_measure():
        _, ref_grad = jax.jit(jax.value_and_grad(loss_fn))(*args)
        delayed = autocast.amp_fp8_delayed(loss_fn, history=HISTORY)
        history = delayed.init(*args)
        variants = {
            "amp bf16": autocast.amp(loss_fn, compute_dtype=jnp.bfloat16),
            "amp fp8": autocast.amp(loss_fn, compute_dtype="fp8"),
            "fp8 all": autocast.amp(loss_fn, compute_dtype=ALL_PRODUCTS),
            # the first step after init: the same scales as current scaling's (shares and
            # activation memory read off this closure; the rest take the history as an argument)
            "fp8 delay": lambda *a, _h=history: delayed(_h, *a),
            **{v: autocast.amp(loss_fn, compute_dtype=c) for v, c in FINER.items()},
        }
        rows = results[name] = {}
        for variant, fn in variants.items():
            step = jax.value_and_grad(fn)
            if variant == "fp8 delay":  # the history an argument, as in a train step
                _, grad = jax.jit(jax.value_and_grad(delayed, argnums=1))(history, *args)
            else:
                _, grad = jax.jit(step)(*args)
            # the whole step: delayed scaling's also makes the next history
            whole, whole_args = (
                (jax.value_and_grad(delayed, argnums=(0, 1)), (history, *args))
                if variant == "fp8 delay"
                else (step, args)
            )
            step_jaxpr = jax.make_jaxpr(whole)(*whole_args)
            rows[variant] = {
                **shares(fn, args),
                "grad_err": _measure.relative_error(grad, ref_grad),
                "act": _measure.residual_bytes(fn, *args, include_inputs=False),
                "bytes": _measure.bytes_accessed(whole, *whole_args),
                "q_passes": _measure.float8_casts(step_jaxpr),
                "serial": _measure.serial_quantisations(step_jaxpr),
            }
            if name == "GPT small" and variant != "fp8 all":
                trained = delayed if variant == "fp8 delay" else fn  # the history carried along
                rows[variant]["trained"] = _training.final_loss(
                    trained, args[0], _gpt_tokens, TRAIN_STEPS, last=10
                )
        for variant, r in rows.items():
            trained = (
                f"{r['trained']:8.4f} {r['trained'] / rows['amp bf16']['trained'] - 1:+7.2%}"
                if "trained" in r
                else f"{'-':>8} {'-':>7}"
            )
            print(
                f"{name:15} {variant:9} {r['fp8_fwd']:7.1%} {r['fp8_bwd']:7.1%} "
                f"{r['e5m2_bwd']:8.1%} "
                f"{r['grad_err']:8.4f} {r['act'] / rows['amp bf16']['act']:8.2f} "
                f"{r['bytes'] / rows['amp bf16']['bytes']:10.2f} {r['q_passes']:8d} "
                f"{r['serial']:6d} {trained}"
            )
    results["outlier row"] = outlier_row()
    return results


def outlier_row(m: int = 256, k: int = 1024, n: int = 1024) -> dict[str, float]:
    """The relative error against float32 of the rows of ``x @ w`` beside an outlier row
    (2**20 times the others), per float8 scaling; printed and returned."""
    kx, kw = jax.random.split(jax.random.PRNGKey(0))
    x = jax.random.normal(kx, (m, k)).at[0].multiply(2.0**20)
    w = jax.random.normal(kw, (k, n)) / k**0.5
    want = x @ w
    errors = {}
    for variant, compute_dtype in {"amp fp8": "fp8", **FINER}.items():
        got = jax.jit(autocast.amp(lambda x, w: x @ w, compute_dtype=compute_dtype))(x, w)
        errors[variant] = _measure.relative_error(got[1:], want[1:])
    print(
        f"x ({m}, {k}) @ w ({k}, {n}), row 0 x 2**20: the other rows' error against float32: "
        + ", ".join(f"{v} {e:.4f}" for v, e in errors.items())
    )
    return errors


if __name__ == "__main__":
    main()
