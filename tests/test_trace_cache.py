"""amp traces as jax.jit does: a changing Python float is one program, re-wrapping the same
function costs no trace, and code that branches on a float still works."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import autocast


def _counting():
    calls = []

    def loss(x, lr):
        calls.append(None)
        return jnp.sum(jnp.tanh(x @ x.T) * lr)

    return loss, calls


def test_a_new_learning_rate_is_the_same_program():
    loss, calls = _counting()
    f = autocast.amp(loss, compute_dtype=jnp.bfloat16)
    x = jnp.ones((4, 4))
    values = [float(f(x, 0.01 * i)) for i in range(30)]
    assert len(calls) == 1  # one trace for 30 learning rates (was 30 traces and compiles)
    assert values[2] == float(f(x, 0.02)) and values[0] == 0.0
    want = float(jax.jit(loss)(x, 0.29))
    assert abs(values[29] - want) <= 1e-2 * abs(want)


def test_rewrapping_in_a_loop_traces_once():
    loss, calls = _counting()
    x = jnp.ones((4, 4))
    outs = [float(autocast.amp(loss, compute_dtype=jnp.bfloat16)(x, 0.5)) for _ in range(5)]
    assert len(calls) == 1 and len(set(outs)) == 1
    # other settings are another program
    autocast.amp(loss, compute_dtype=jnp.float16)(x, 0.5)
    assert len(calls) == 2


def test_code_that_branches_on_a_float_gets_it_static():
    x = jnp.arange(4.0)
    f = autocast.amp(lambda m, x: m(x), compute_dtype=jnp.bfloat16)
    # Dropout(0.0) returns its input only when p is a Python number equal to 0
    assert np.array_equal(f(eqx.nn.Dropout(0.0), x), x)
    calls = []

    def scaled(x, factor):
        calls.append(None)
        return x * 2 if factor > 1 else x  # needs the value

    g = autocast.amp(scaled, compute_dtype=jnp.bfloat16)
    assert np.array_equal(g(x, 3.0), 2 * x) and np.array_equal(g(x, 0.5), x)
    # the first call tried the float traced, then static; each new value is a trace after
    assert len(calls) == 3
