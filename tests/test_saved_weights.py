"""What the backward pass keeps of a weight the program transforms before its product.

Hugging Face's Flax GPT-2 stores its kernels as ``(out, in)`` and transposes each before the
product (``FlaxConv1D``). Where the product's other operand is a recomputed chain, amp binds
the chain and the product in one checkpoint; the kernel must enter it as its 16-bit cast,
not as the float32 transpose, which would be kept for the backward pass at twice the bytes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autocast
from autocast._src.tools import measure as _measure

KEY = jax.random.PRNGKey(0)


def _residual_avals(fn, *args):
    jaxpr = jax.make_jaxpr(lambda *a: jax.tree_util.tree_leaves(jax.vjp(fn, *a)[1]))(*args).jaxpr
    inputs = set(jaxpr.invars)
    return [
        v.aval for v in jaxpr.outvars if isinstance(v, jax.extend.core.Literal) or v not in inputs
    ]


def _conv1d(kernel, bias, x):
    # the (out, in) kernel transposed in the program, as FlaxConv1D does
    y = jax.lax.dot_general(x, kernel.T, (((x.ndim - 1,), (0,)), ((), ())))
    return y + bias


def _block(k1, b1, k2, b2, x):
    h = jax.nn.relu(_conv1d(k1, b1, x))
    return jnp.mean(_conv1d(k2, b2, h * 0.5 + 1.0) ** 2)


def _args():
    keys = jax.random.split(KEY, 3)
    return (
        jax.random.normal(keys[0], (256, 64)) / 8,
        jnp.zeros(256),
        jax.random.normal(keys[1], (64, 256)) / 16,
        jnp.zeros(64),
        jax.random.normal(keys[2], (8, 64)),
    )


@pytest.mark.parametrize("compute_dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_a_transposed_kernel_is_kept_as_its_16_bit_cast(compute_dtype):
    args = _args()
    amp = autocast.amp(_block, compute_dtype=compute_dtype)
    kernels = [a for a in _residual_avals(amp, *args) if a.size == 64 * 256 and a.ndim == 2]
    assert kernels, "the backward pass keeps each kernel in some form"
    assert {np.dtype(a.dtype) for a in kernels} == {np.dtype(compute_dtype)}, kernels
    # the gradients are float32 amp's, to 16-bit precision
    got = jax.grad(amp, argnums=(0, 2))(*args)
    want = jax.grad(_block, argnums=(0, 2))(*args)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=0.05, atol=0.02 * float(jnp.abs(w).max()))


def test_an_untransposed_kernel_is_kept_as_the_argument():
    # the argument itself is kept at no cost: no 16-bit copy is added for it
    def block(w1, w2, x):
        return jnp.mean((jax.nn.relu(x @ w1) * 0.5 + 1.0) @ w2) ** 2

    w1, _, w2, _, x = _args()
    kept = _measure.residual_bytes(
        autocast.amp(block, compute_dtype=jnp.bfloat16), w1.T, w2.T, x, include_inputs=False
    )
    transposed = _measure.residual_bytes(
        autocast.amp(lambda k1, k2, x: block(k1.T, k2.T, x), compute_dtype=jnp.bfloat16),
        w1,
        w2,
        x,
        include_inputs=False,
    )
    # a transposed kernel costs its 16-bit cast at most: 2 bytes per weight beyond the rest
    assert transposed <= kept + 2 * 2 * w1.size
