"""What the numerics debugger costs: wall time of ``autocast.diagnose(fn)(...)`` against the
first call of ``autocast.amp(fn)(...)`` (trace, compile, run), on the demo's GPT (2 layers,
d=64, batch 16x32) as a loss, its gradient, and its jitted gradient with scanned (and
checkpointed) blocks.

Run: ``.venv/bin/python benchmarks/diagnose_cost.py [--dtype bfloat16]``
Each measurement wraps the function afresh, so both pay for tracing and compiling.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable

import jax

import autocast
from autocast._src.demo import models as _models


def forms() -> list[tuple[str, Callable[..., Any], tuple]]:
    """(name, function, arguments) of the demo GPT in the forms the debugger must handle."""
    key = jax.random.PRNGKey(0)
    params = _models.init_gpt(key, vocab=64, d=64, layers=2, seq=32)
    stacked = _models.stack_blocks(params)
    tokens = _models.gpt_batch(key, batch=16, seq=32, vocab=64)

    def scanned(remat: bool) -> Callable[..., Any]:
        return jax.jit(jax.grad(lambda p, t: _models.gpt_loss(p, t, scan=True, remat=remat)))

    return [
        ("loss", _models.gpt_loss, (params, tokens)),
        ("grad", jax.grad(_models.gpt_loss), (params, tokens)),
        ("jit(grad), scan", scanned(False), (stacked, tokens)),
        ("jit(grad), scan+ckpt", scanned(True), (stacked, tokens)),
    ]


def _seconds(run: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = run()
    return time.perf_counter() - start, out


def main(dtype: str = "bfloat16") -> dict[str, dict]:
    """Prints and returns, per form: amp's first call, the diagnosis, their ratio, and how
    many equations the diagnosis measured."""
    print(f"{'form':22} {'amp first call s':>16} {'diagnose s':>10} {'ratio':>6} {'equations':>9}")
    rows = {}
    for name, fn, args in forms():
        amp_s, _ = _seconds(
            lambda: jax.block_until_ready(autocast.amp(fn, compute_dtype=dtype)(*args))
        )
        diag_s, d = _seconds(lambda: autocast.diagnose(fn, compute_dtype=dtype)(*args))
        rows[name] = {"amp_s": amp_s, "diagnose_s": diag_s, "equations": len(d.entries)}
        print(f"{name:22} {amp_s:16.2f} {diag_s:10.2f} {diag_s / amp_s:5.1f}x {len(d.entries):9d}")
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    main(parser.parse_args().dtype)
