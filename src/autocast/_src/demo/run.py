"""The main job: train a small GPT-style language model five ways and compare them.

float32, amp with bfloat16, amp with float16 plus dynamic loss scaling, amp with float8
matrix products (per-tensor scaling), and amp with bfloat16 whose training state is 16-bit
too (bfloat16 parameters and Adam moments, stochastically rounded), on text the
package generates itself (sums such as ``"17+25=42;"``; nothing is downloaded). Prints a
progress bar per run, then a table, and writes a plot and the figures to ``--out``.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import autocast
import autocast.optax
from autocast._src.demo import models as _models
from autocast._src.tools import measure as _measure

ALPHABET = "0123456789+=;"


def corpus(n_sums: int = 4000, seed: int = 0) -> str:
    """A text of random sums, ``"a+b=c;"`` with a, b below 100: learnable, and generated."""
    rng = np.random.default_rng(seed)
    a, b = rng.integers(0, 100, n_sums), rng.integers(0, 100, n_sums)
    return "".join(f"{x}+{y}={x + y};" for x, y in zip(a, b))


def batches(text: str, *, batch: int, seq: int, seed: int = 0):
    """Endless random windows of ``seq + 1`` tokens (inputs and next-token targets)."""
    tokens = np.array([ALPHABET.index(c) for c in text], np.int32)
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(tokens) - seq - 1, batch)
        yield jnp.asarray(np.stack([tokens[s : s + seq + 1] for s in starts]))


def _progress(total: int, label: str) -> Any:
    try:
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=label, ncols=90, leave=True)
    except ImportError:  # the demo extra is missing: a plain counter

        class Plain:
            def __init__(self) -> None:
                self.n = 0

            def update(self, k: int) -> None:
                self.n += k
                if self.n % max(total // 10, 1) == 0 or self.n == total:
                    print(f"{label}: {self.n}/{total}", flush=True)

            def set_postfix_str(self, _: str) -> None:
                pass

            def close(self) -> None:
                pass

        return Plain()


def _make_step(loss_fn: Callable[..., Any], optimizer: Any, scaled: bool) -> Callable[..., Any]:
    if scaled:
        grad_fn = autocast.dynamic_scale_value_and_grad(loss_fn)

        def step(params, opt_state, scaler, tokens):
            scaler, (loss, grads) = grad_fn(params, tokens, dynamic_scaler_state=scaler)
            finite = autocast.all_finite(grads)
            updates, new_opt = optimizer.update(grads, opt_state, params)
            new_params = optax.apply_updates(params, updates)
            params, opt_state = autocast.select_tree(
                finite, (new_params, new_opt), (params, opt_state)
            )
            return params, opt_state, scaler, loss
    else:

        def step(params, opt_state, scaler, tokens):
            loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, scaler, loss

    return jax.jit(step)


STATE16 = "amp bf16, 16-bit state"


def _state16(optimizer: Any, params: Any, seed: int) -> tuple[Any, Any]:
    """The parameters in bfloat16 and ``optimizer`` with its moments stored in bfloat16,
    both rounded stochastically (docs/training_state.md)."""
    params = jax.tree_util.tree_map(lambda p: p.astype(jnp.bfloat16), params)
    optimizer = optax.chain(
        autocast.optax.low_precision_state(optimizer, jnp.bfloat16, key=seed + 1),
        autocast.optax.stochastic_rounding(seed + 2),
    )
    return optimizer, params


def array_bytes(tree: Any) -> int:
    """Bytes of the array leaves of ``tree`` (shapes and dtypes suffice: abstract trees too)."""
    return sum(
        math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
        for x in jax.tree_util.tree_leaves(tree)
        if hasattr(x, "shape") and hasattr(x, "dtype")
    )


def state_bytes_per_parameter(params: Any, opt_state: Any) -> float:
    """Bytes of the training state per parameter: parameters, their gradients (amp returns
    them in the parameters' dtypes) and the optimizer state."""
    n = sum(math.prod(p.shape) for p in jax.tree_util.tree_leaves(params))
    return (2 * array_bytes(params) + array_bytes(opt_state)) / n


def run(
    steps: int = 600, out: str | Path = "autocast-demo", *, seed: int = 0, quiet: bool = False
) -> dict:
    """Trains the five ways, prints the table, writes ``demo.png`` and ``demo.json``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = dict(vocab=len(ALPHABET), d=64, layers=2, seq=32)
    params0 = _models.init_gpt(jax.random.PRNGKey(seed), **config)
    text = corpus(seed=seed)
    optimizer = optax.adam(3e-3)
    runs = {
        "float32": (_models.gpt_loss, False),
        "amp bfloat16": (autocast.amp(_models.gpt_loss, compute_dtype=jnp.bfloat16), False),
        "amp float16 + scaling": (autocast.amp(_models.gpt_loss, compute_dtype=jnp.float16), True),
        "amp float8": (autocast.amp(_models.gpt_loss, compute_dtype="fp8"), False),
        STATE16: (autocast.amp(_models.gpt_loss, compute_dtype=jnp.bfloat16), False),
    }
    results: dict[str, dict] = {}
    probe = next(batches(text, batch=16, seq=config["seq"], seed=seed))
    # Judged on sums none of the runs trained on, in float32 for all four: one run's last
    # training batches are as much luck as skill, a fixed held-out set is not.
    held_out_text = corpus(n_sums=1000, seed=seed + 1)
    held_out_data = batches(held_out_text, batch=64, seq=config["seq"], seed=seed + 1)
    held_out = [next(held_out_data) for _ in range(8)]
    # in float32, whatever the parameters are stored in
    evaluate = jax.jit(lambda p, t: _models.gpt_loss(autocast.cast_to_full(p), t))
    for name, (loss_fn, scaled) in runs.items():
        tx, first = _state16(optimizer, params0, seed) if name == STATE16 else (optimizer, params0)
        step = _make_step(loss_fn, tx, scaled)
        # patience 100 rather than 2000, so a short run shows the scale move
        params, opt_state = first, tx.init(first)
        scaler = autocast.DynamicScalerState(patience=100)
        losses, scales, times = [], [], []
        bar = _progress(steps, name)
        data = batches(text, batch=16, seq=config["seq"], seed=seed)
        for i in range(steps):
            tokens = next(data)
            start = time.perf_counter()
            params, opt_state, scaler, loss = step(params, opt_state, scaler, tokens)
            loss = float(loss)  # waits for the step: the time is the step's
            times.append(time.perf_counter() - start)
            losses.append(loss)
            scales.append(float(scaler.scaler))
            bar.update(1)
            if i % 10 == 0:
                bar.set_postfix_str(f"loss {loss:.3f}")
        bar.close()
        grad_jaxpr = jax.make_jaxpr(jax.grad(loss_fn))(first, probe)
        results[name] = {
            "final_loss": statistics.fmean(float(evaluate(params, t)) for t in held_out),
            "final_train_loss": statistics.fmean(losses[-20:]),
            "step_ms": 1e3 * statistics.median(times[1:]) if len(times) > 1 else 1e3 * times[0],
            "activation_bytes": _measure.residual_bytes(loss_fn, first, probe),
            "state_bytes_per_param": state_bytes_per_parameter(params, opt_state),
            "low_precision_flop_share": _measure.low_precision_flop_share(grad_jaxpr),
            "fp8_flop_share": _measure.low_precision_flop_share(grad_jaxpr, bits=8),
            "skipped_steps": int(scaler.total_resets) if scaled else 0,
            "scale_changes": int(np.count_nonzero(np.diff(scales))) if scaled else 0,
            "losses": losses,
            "scales": scales if scaled else None,
        }
    table = format_table(results)
    if not quiet:
        print(table)
    _plot(results, out / "demo.png")
    (out / "demo.json").write_text(json.dumps(results, indent=1))
    (out / "demo.txt").write_text(table + "\n")
    return results


def format_table(results: dict[str, dict]) -> str:
    """The comparison table, with losses relative to float32. The final loss is the trained
    model's float32 loss on held-out sums (8 batches of 64 windows of a text no run saw);
    ``state B/p`` the bytes per parameter of parameters, gradients and Adam's state."""
    ref = results["float32"]["final_loss"]
    head = (
        f"{'run':24} {'final loss':>10} {'vs f32':>7} {'step ms':>8} {'act. MB':>8} "
        f"{'state B/p':>9} {'16-bit FLOPs':>12} {'8-bit FLOPs':>11} {'skipped':>7} "
        f"{'scale changes':>13}"
    )
    lines = [head, "-" * len(head)]
    for name, r in results.items():
        lines.append(
            f"{name:24} {r['final_loss']:10.4f} {r['final_loss'] / ref - 1:+7.2%} "
            f"{r['step_ms']:8.2f} {r['activation_bytes'] / 2**20:8.2f} "
            f"{r['state_bytes_per_param']:9.1f} {r['low_precision_flop_share']:12.1%} "
            f"{r['fp8_flop_share']:11.1%} "
            f"{r['skipped_steps']:7d} {r['scale_changes']:13d}"
        )
    return "\n".join(lines)


def _plot(results: dict[str, dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed (pip install jax-autocast[demo]); no plot at {path}")
        return
    fig, (ax_loss, ax_scale) = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in results.items():
        ax_loss.plot(r["losses"], label=name, linewidth=1)
    ax_loss.set(title="training loss", xlabel="step", ylabel="cross-entropy")
    ax_loss.legend()
    for name, r in results.items():
        if r["scales"] is not None:
            ax_scale.semilogy(r["scales"], label=name)
    ax_scale.set(title="float16 loss scale", xlabel="step", ylabel="scale")
    ax_scale.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def harmful_policy() -> dict:
    """The default policy with the softmax and cross-entropy's exponentials, logarithms and
    sums moved to the compute dtype: what a careless hand-written policy does."""
    bad = {
        p: autocast.use_compute_precision
        for p in (jax.lax.exp_p, jax.lax.log_p, jax.lax.reduce_sum_p)
    }
    return {**autocast.default_amp_policy, **bad}


def diagnose_demo(
    dtype: str = "float16", *, harmful: bool = True, rows: int = 12, seed: int = 0
) -> str:
    """The numerics debugger on a float16 training step's gradient of the demo's GPT (its
    size, a batch of its text, the loss multiplied by the loss scale float16 training
    starts from, 2**15): the table, then what the suggested policy does to the error."""
    config = dict(vocab=len(ALPHABET), d=64, layers=2, seq=32)
    params = _models.init_gpt(jax.random.PRNGKey(seed), **config)
    tokens = next(batches(corpus(seed=seed), batch=16, seq=config["seq"], seed=seed))
    policy = harmful_policy() if harmful else None

    def scaled_loss(params: Any, tokens: Any) -> Any:
        return _models.gpt_loss(params, tokens) * 2.0**15

    grad = jax.grad(scaled_loss)
    start = time.perf_counter()
    d = autocast.diagnose(grad, compute_dtype=dtype, amp_policy=policy)(params, tokens)
    took = time.perf_counter() - start
    cured = autocast.diagnose(grad, compute_dtype=dtype, amp_policy=d.suggested_policy)(
        params, tokens
    )
    which = (
        "a harmful policy (exp, log and reduce_sum in 16 bits)" if harmful else "the default policy"
    )
    state = "finite" if cured.first_nonfinite is None else "still non-finite"
    return "\n".join(
        [
            f"gradient of the demo GPT's loss x 2**15 under amp({dtype}) with {which}",
            f"(diagnosed in {took:.1f} s)",
            "",
            d.table(rows),
            "",
            f"gradient relative error: {d.output_error:.3g} as given, {cured.output_error:.3g} "
            f"with suggested_policy ({state})",
        ]
    )
