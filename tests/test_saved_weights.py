"""What the backward pass keeps of a weight the program computes before its product.

Where a product's other operand is a recomputed chain, amp binds the chain and the product
in one checkpoint, which keeps its inputs. A float32 weight the program computed (a scaled
or standardised kernel) must enter it as its 16-bit cast, not in float32 at twice the bytes.
A transposed argument (Hugging Face's Flax GPT-2 transposes each ``(out, in)`` kernel, a GPT
its tied embedding) enters as it is: the compiled program keeps the argument, and a 16-bit
cast would be a copy.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autocast

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


def _scaled_block(k1, b1, k2, b2, x):
    # each kernel scaled by a float32 factor of its own: a computed float32 weight
    return _block(k1 * jnp.float32(1.5), b1, k2 * jnp.float32(0.5), b2, x)


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
def test_a_computed_kernel_is_kept_as_its_16_bit_cast(compute_dtype):
    args = _args()
    amp = autocast.amp(_scaled_block, compute_dtype=compute_dtype)
    kernels = [a for a in _residual_avals(amp, *args) if a.size == 64 * 256 and a.ndim == 2]
    assert kernels, "the backward pass keeps each kernel in some form"
    assert {np.dtype(a.dtype) for a in kernels} == {np.dtype(compute_dtype)}, kernels
    # the gradients are float32 amp's, to 16-bit precision
    got = jax.grad(amp, argnums=(0, 2))(*args)
    want = jax.grad(_scaled_block, argnums=(0, 2))(*args)
    for g, w in zip(got, want):
        assert float(jnp.linalg.norm(g - w) / jnp.linalg.norm(w)) < 0.03


def test_a_transposed_argument_gets_no_16_bit_copy():
    # the second product's kernel is k2.T (256, 64), the product recomputed with the chain
    # before it: the checkpoint keeps the transpose of the argument, which the compiled
    # program reads from the argument itself, and no 16-bit copy beside it
    kept = _residual_avals(autocast.amp(_block, compute_dtype=jnp.bfloat16), *_args())
    assert [np.dtype(a.dtype) for a in kept if a.shape == (256, 64)] == [np.dtype(np.float32)]
