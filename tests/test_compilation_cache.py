"""JAX's persistent compilation cache serves amp's programs: a second process that traces the
same step finds the first one's compiled program (docs/fp8.md#the-first-compile).

A trace that carried something of its process (an object's address, a counter, a random
name) would miss the cache every time, and a float8 step would pay its whole first compile,
autotuning included, on every run.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import users_environ

# Traces a bfloat16 and a float8 gradient step (the latter with delayed scaling's history)
# with the cache on for every program however fast it compiles, and prints the entries.
STEP = """
import os, sys
import jax, jax.numpy as jnp
import autocast
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)

def loss(w, x):
    return jnp.sum(jnp.tanh(jnp.tanh(x @ w) @ w) ** 2)

w, x = jnp.ones((64, 64)) / 8, jnp.ones((16, 64))
jax.jit(jax.grad(autocast.amp(loss, compute_dtype=jnp.bfloat16)))(w, x).block_until_ready()
jax.jit(jax.grad(autocast.amp(loss, compute_dtype="fp8")))(w, x).block_until_ready()
delayed = autocast.amp_fp8_delayed(loss)
history = delayed.init(w, x)
grads = jax.jit(jax.grad(delayed, argnums=(0, 1)))(history, w, x)
jax.block_until_ready(history.advance(grads[0]))
print(len([f for f in os.listdir(sys.argv[1]) if f.endswith("-cache")]))
"""


def _entries(cache: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", STEP, cache],
        capture_output=True,
        text=True,
        env={**users_environ(), "JAX_PLATFORMS": "cpu"},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.split()[-1])


@pytest.mark.slow
def test_a_second_process_compiles_none_of_amps_programs_again(tmp_path):
    first = _entries(str(tmp_path))
    assert first > 0
    # a miss would write a second entry under another key
    assert _entries(str(tmp_path)) == first
