"""One layer's float8 products on their own: how XLA compiles each way of writing them, and
what each costs, against the same layer in bfloat16.

For each shape (tokens x in -> out, from GPT-2 medium and the 24x2048 decoder), a linear
layer's forward and backward (``jax.vjp`` of ``x @ w``) runs under ``amp`` with:

- ``bf16``: ``compute_dtype=jnp.bfloat16``;
- ``fp8 direct`` / ``fp8 dequantised``: ``compute_dtype="fp8"`` (current scaling) with the
  float8 product written either way (``autocast._src.fp8.products.GEMM_FORMS``);
- ``delay direct`` / ``delay dequantised``: ``amp_fp8_delayed`` with a measured history.

Columns: mean milliseconds per forward+backward, the float8 GEMMs XLA's compiled program calls
(custom calls whose target names float8, ``f8``) and the dtype of their results, the number of
fusions (kernels XLA writes itself), and whether the layer of all-ones inputs is finite and
right (a GPU run once gave inf there).

On a GPU, ``--triton on,off`` times each row with XLA's Triton GEMM fusions on (its default:
float8 dots become Triton kernels, 0 float8 custom calls) and off (cuBLASLt's float8 GEMMs):
``make gpu-plan`` shows both programs without a GPU, but only this says which is faster.

Run: ``.venv/bin/python benchmarks/fp8_gemm.py [--tiny] [--triton on,off] [--json PATH]``
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp

import autocast
from autocast._src.fp8 import products as fp8

HERE = Path(__file__).parent
SHAPES = {
    "GPT-2 medium fc": (8192, 1024, 4096),
    "decoder fc": (4096, 2048, 8192),
    "decoder qkv": (4096, 2048, 6144),
}
TINY = {"tiny": (64, 32, 48)}
VARIANTS = ("bf16", "fp8 direct", "fp8 dequantised", "delay direct", "delay dequantised")


def _layer(variant: str) -> tuple[Callable[..., Any], bool]:
    """The layer's loss-free forward ``(x, w) -> x @ w`` under the variant's amp, and whether
    it takes a float8 history first."""
    f = lambda x, w: x @ w  # noqa: E731
    if variant == "bf16":
        return autocast.amp(f, compute_dtype=jnp.bfloat16), False
    if variant.startswith("fp8"):
        return autocast.amp(f, compute_dtype="fp8"), False
    return autocast.amp_fp8_delayed(f, history=4), True


def _step(variant: str, x: jax.Array, w: jax.Array) -> tuple[Callable[..., Any], tuple]:
    """A jitted forward+backward of the layer (output gradient ``g``), and its arguments."""
    layer, delayed = _layer(variant)
    g = jnp.ones((x.shape[0], w.shape[1]), jnp.bfloat16) / x.shape[0]
    if delayed:
        history = layer.init(x, w)

        @jax.jit
        def step(history: Any, x: jax.Array, w: jax.Array) -> Any:
            out, pull = jax.vjp(layer, history, x, w)
            return out, pull(g.astype(out.dtype))

        return step, (history, x, w)

    @jax.jit
    def step(x: jax.Array, w: jax.Array) -> Any:  # type: ignore[misc]
        out, pull = jax.vjp(layer, x, w)
        return out, pull(g.astype(out.dtype))

    return step, (x, w)


def _f8_calls(hlo: str) -> tuple[int, str]:
    """How many float8 GEMM custom calls the optimised HLO makes, and their result types."""
    calls = [
        line
        for line in hlo.splitlines()
        if "custom-call(" in line and "f8" in line.split("custom_call_target=")[-1]
    ]
    kinds = sorted(
        {m.group(1) for line in calls for m in [re.search(r"=\s*\(?\s*(\w+)\[", line)] if m}
    )
    return len(calls), ",".join(kinds) or "-"


def measure(variant: str, shape: tuple[int, int, int], repeats: int, triton: bool = True) -> dict:
    tokens, n_in, n_out = shape
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (tokens, n_in), jnp.float32)
    w = jax.random.normal(kw, (n_in, n_out), jnp.float32) / n_in**0.5
    form = "dequantised" if variant.endswith("dequantised") else "direct"
    options = {"xla_gpu_enable_triton_gemm": triton} if jax.default_backend() == "gpu" else {}
    previous, fp8._GEMM_FORM = fp8._GEMM_FORM, form
    try:
        step, args = _step(variant, x, w)
        compiled = step.lower(*args).compile(compiler_options=options)
        hlo = compiled.as_text()
        jax.block_until_ready(compiled(*args))
        start = time.perf_counter()
        for _ in range(repeats):
            out = compiled(*args)
        jax.block_until_ready(out)
        ms = 1e3 * (time.perf_counter() - start) / repeats
        # all-ones operands: every float8 value is one power of two, the product n_in
        ones_step, ones_args = _step(variant, jnp.ones_like(x), jnp.ones_like(w))
        ones_out, _ = ones_step.lower(*ones_args).compile(compiler_options=options)(*ones_args)
        ones_ok = bool(jnp.all(ones_out.astype(jnp.float32) == n_in))
    finally:
        fp8._GEMM_FORM = previous
    calls, kinds = _f8_calls(hlo)
    return {
        "ms": ms,
        "f8_gemms": calls,
        "f8_result": kinds,
        "fusions": hlo.count(" fusion("),
        "all_ones_right": ones_ok,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tiny", action="store_true", help="a CPU-sized shape (the tests run this)"
    )
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--triton", default="on", help="Triton GEMM fusions 'on', 'off' or 'on,off' (a GPU's)"
    )
    parser.add_argument("--json", default=str(HERE / "fp8_gemm.json"))
    options = parser.parse_args(argv)
    settings = [t.strip() for t in options.triton.split(",") if t.strip()]
    if not settings or any(t not in ("on", "off") for t in settings):
        parser.error("--triton takes 'on', 'off' or 'on,off'")
    if jax.default_backend() != "gpu":
        settings = settings[:1]  # no Triton on a CPU: one setting is all there is
    shapes = TINY if options.tiny else SHAPES
    results: dict[str, dict] = {}
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}")
    print(
        f"{'shape':16} {'variant':18} {'Triton':6} {'ms':>8} {'f8 GEMMs':>8} {'result':>10} "
        f"{'fusions':>7} {'ones ok':>7}"
    )
    for name, shape in shapes.items():
        for variant in VARIANTS:
            for triton in settings:
                r = measure(variant, shape, options.repeats, triton == "on")
                results.setdefault(name, {})[f"{variant} / Triton {triton}"] = r
                print(
                    f"{name:16} {variant:18} {triton:6} {r['ms']:8.3f} {r['f8_gemms']:8d} "
                    f"{r['f8_result']:>10} {r['fusions']:7d} {str(r['all_ones_right']):>7}"
                )
    Path(options.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
