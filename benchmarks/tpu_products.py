"""What a TPU's matrix units multiply: one product per operand dtype, compiled for each chip.

For each TPU (compile-only devices: libtpu runs here, no TPU needed) and each operand dtype,
one 512 x 512 by 512 x 512 ``dot_general`` is compiled with the TPU compiler's low-level
program dumped (``--xla_jf_dump_llo_text``), and the matrix instructions it holds are
counted by kind: ``vmatmul.bf16`` is a bfloat16 product in the matrix unit, ``vmatmul.f32``
a float32 one, and ``vcvt.f32.hf16`` a conversion of float16 to float32 before it. This is
what decides which compute dtypes amp accepts on a TPU (docs/tpu.md).

Run: ``.venv-tpu-plan/bin/python benchmarks/tpu_products.py`` (``make tpu-plan`` builds the
venv; about a minute).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

TOPOLOGIES = {"v4": "v4:2x2x1", "v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}
DTYPES = ("bfloat16", "float16", "float8_e4m3fn", "float32")
# An instruction of the low-level program: a matrix product or a conversion, with its types
# (the matrix unit it runs on, ``.mxu0`` and so on, is left out).
_INSTRUCTION = re.compile(r"\b(vmatmul(?:\.mubr)?\.[a-z0-9]+|vcvt\.[a-z0-9]+\.[a-z0-9]+)")

# Compiles one product in a fresh process: libtpu reads its dump flags when it starts.
_ONE = """
import sys
import jax, jax.numpy as jnp, numpy as np
from jax.experimental import topologies
topology, name = sys.argv[1], sys.argv[2]
devices = topologies.get_topology_desc(topology_name=topology, platform="tpu").devices
where = jax.sharding.NamedSharding(
    jax.sharding.Mesh(np.array(devices[:1]), ("x",)), jax.sharding.PartitionSpec()
)
dtype = jnp.dtype(name)
x = jax.ShapeDtypeStruct((512, 512), dtype, sharding=where)
out = jnp.bfloat16 if dtype.itemsize == 1 else dtype
product = lambda a, b: jax.lax.dot(a, b, preferred_element_type=out)
print(jax.devices()[0].platform, devices[0].device_kind)
jax.jit(product).lower(x, x).compile()
"""


def instructions(topology: str, dtype: str) -> tuple[str, dict[str, int]]:
    """The chip's device kind and the matrix and conversion instructions, by kind, of one
    ``dtype`` product compiled for ``topology``."""
    with tempfile.TemporaryDirectory() as dump:
        env = {
            **os.environ,
            "JAX_PLATFORMS": "cpu",
            "LIBTPU_INIT_ARGS": f"--xla_jf_dump_to={dump} --xla_jf_dump_llo_text=true",
        }
        done = subprocess.run(
            [sys.executable, "-c", _ONE, topology, dtype],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        )
        kind = done.stdout.strip().split(" ", 1)[1]
        counts: collections.Counter = collections.Counter()
        for path in Path(dump).rglob("*"):
            if path.is_file():
                counts.update(_INSTRUCTION.findall(path.read_text(errors="replace")))
    return kind, dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--chips", default=",".join(TOPOLOGIES), help="of: " + ", ".join(TOPOLOGIES)
    )
    parser.add_argument("--json", default="", help="where to write the counts")
    options = parser.parse_args(argv)
    results: dict = {}
    for chip in [c.strip() for c in options.chips.split(",") if c.strip()]:
        for dtype in DTYPES:
            kind, counts = instructions(TOPOLOGIES[chip], dtype)
            results.setdefault(chip, {"kind": kind})[dtype] = counts
            matrix = {k: v for k, v in counts.items() if k.startswith("vmatmul")}
            converts = {k: v for k, v in counts.items() if k.startswith("vcvt")}
            print(
                f"{chip:4} ({kind}) {dtype:14} matrix: "
                + ", ".join(f"{k} {v}" for k, v in matrix.items())
                + (
                    "; converts: " + ", ".join(f"{k} {v}" for k, v in converts.items())
                    if converts
                    else ""
                ),
                flush=True,
            )
    if options.json:
        Path(options.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
