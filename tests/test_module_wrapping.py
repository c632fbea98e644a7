"""``amp`` of a module: its parameters stay the pytree's leaves, and a module's writes survive.

Equinox and Flax NNX users wrap modules, not functions: ``amp(model)`` must hand its
parameters to ``eqx.filter_grad``, ``eqx.tree_at`` and ``jax.tree_util`` as the module would,
and an NNX module's state written inside ``amp`` (a counter, BatchNorm's running mean) must
reach the caller's module as it does without ``amp``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autocast
from autocast._src.jaxprs import equations

eqx = pytest.importorskip("equinox")


def _dot_dtypes(jaxpr):
    return [
        e.outvars[0].aval.dtype.name for e in equations(jaxpr) if e.primitive.name == "dot_general"
    ]


def _mlp():
    return eqx.nn.MLP(8, 4, width_size=16, depth=2, key=jax.random.PRNGKey(0))


def _loss(model, x):
    return jnp.mean(jax.vmap(model)(x) ** 2)


X = jax.random.normal(jax.random.PRNGKey(1), (5, 8))


def _arrays(tree):
    return [x for x in jax.tree_util.tree_leaves(tree) if eqx.is_array(x)]


def _nonzero_leaves(tree):
    return sum(bool(jnp.any(g != 0)) for g in _arrays(tree))


def _scaled(tree, factor):
    return jax.tree_util.tree_map(lambda p: factor * p if eqx.is_array(p) else p, tree)


def test_filter_grad_of_an_amp_module_reaches_every_parameter():
    model = _mlp()
    wrapped = autocast.amp(model, compute_dtype=jnp.bfloat16)
    assert len(_arrays(wrapped)) == 6
    grads = eqx.filter_grad(_loss)(wrapped, X)
    assert _nonzero_leaves(grads) == 6
    reference = eqx.filter_grad(_loss)(model, X)
    for g, r in zip(_arrays(grads), _arrays(reference)):
        assert g.dtype == r.dtype == jnp.float32
        np.testing.assert_allclose(g, r, rtol=0.1, atol=2e-3)
    jaxpr = eqx.filter_make_jaxpr(eqx.filter_grad(_loss))(wrapped, X)[0]
    dots = _dot_dtypes(jaxpr)
    assert dots and set(dots) == {"bfloat16"}, dots


def test_a_layer_wrapped_by_tree_at_keeps_learning():
    model = _mlp()
    model = eqx.tree_at(lambda m: m.layers[1], model, autocast.amp(model.layers[1]))
    grads = eqx.filter_grad(_loss)(model, X)
    assert _nonzero_leaves(grads) == 6
    # one optimizer step moves the wrapped layer's weight
    stepped = eqx.apply_updates(model, _scaled(grads, -0.1))
    assert not jnp.array_equal(stepped.layers[1].weight, model.layers[1].weight)
    assert isinstance(stepped.layers[1].__wrapped__, eqx.nn.Linear)
    # the wrapped layer reads and is replaced like the layer: tree_at reaches its weight
    zeroed = eqx.tree_at(lambda m: m.layers[1].weight, stepped, jnp.zeros((16, 16)))
    assert not jnp.any(zeroed.layers[1].__wrapped__.weight)


def test_tree_map_over_an_amp_module_gives_an_amp_module_of_the_mapped_module():
    model = _mlp()
    wrapped = autocast.amp(model, compute_dtype=jnp.bfloat16)
    doubled = _scaled(wrapped, 2)
    assert type(doubled) is type(wrapped)
    expected = autocast.amp(_scaled(model, 2), compute_dtype=jnp.bfloat16)
    np.testing.assert_array_equal(jax.vmap(doubled)(X), jax.vmap(expected)(X))
    # the same settings flatten to equal structures, so filter_jit caches across re-wraps
    again = autocast.amp(model, compute_dtype=jnp.bfloat16)
    assert jax.tree_util.tree_structure(again) == jax.tree_util.tree_structure(wrapped)
    other = autocast.amp(model, compute_dtype=jnp.float16)
    assert jax.tree_util.tree_structure(other) != jax.tree_util.tree_structure(wrapped)


def test_filter_jit_traces_an_amp_module_once_for_new_parameters():
    traces = []

    @eqx.filter_jit
    def step(m, x):
        traces.append(1)
        return _loss(m, x)

    model = _mlp()
    step(autocast.amp(model), X)
    moved = _scaled(model, 3)
    step(autocast.amp(moved), X)
    assert len(traces) == 1


def test_an_amp_function_has_no_leaves_and_stays_a_function():
    def f(x):
        return x @ x.T

    wrapped = autocast.amp(f, compute_dtype=jnp.bfloat16)
    assert jax.tree_util.tree_leaves(wrapped) == []
    rebuilt = jax.tree_util.tree_map(lambda p: p, wrapped)
    np.testing.assert_array_equal(rebuilt(X), wrapped(X))
    assert jax.tree_util.tree_structure(
        autocast.amp(f, compute_dtype=jnp.bfloat16)
    ) == jax.tree_util.tree_structure(wrapped)


def test_an_equinox_bound_method_is_wrapped_with_its_module():
    model = _mlp()
    wrapped = autocast.amp(model.__call__)
    grads = eqx.filter_grad(lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2))(wrapped, X)
    assert _nonzero_leaves(grads) == 6


nnx = pytest.importorskip("flax.nnx")

# Flax 0.11 made NNX modules pytrees; before, amp sees a module as one static leaf, and a
# module that writes its state inside amp meets Flax's own TraceContextError (loud, not lost)
needs_pytree_modules = pytest.mark.skipif(
    jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(nnx.Linear(1, 1, rngs=nnx.Rngs(0)))),
    reason="this Flax's NNX modules are not pytrees (Flax < 0.11)",
)


class _Counted(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(8, 4, rngs=rngs)
        self.norm = nnx.BatchNorm(4, rngs=rngs)
        self.calls = nnx.BatchStat(jnp.zeros((), jnp.int32))

    def __call__(self, x):
        self.calls[...] = self.calls[...] + 1
        return self.norm(self.lin(x))


def _nnx_loss(model, x):
    return jnp.mean(model(x) ** 2)


@needs_pytree_modules
def test_nnx_writes_under_amp_reach_the_callers_module():
    model = _Counted(nnx.Rngs(0))
    for _ in range(3):
        loss, grads = nnx.value_and_grad(autocast.amp(_nnx_loss, compute_dtype=jnp.bfloat16))(
            model, X
        )
    assert int(model.calls[...]) == 3
    assert float(jnp.abs(model.norm.mean[...]).sum()) > 0
    # the same numbers as the module's own update without amp, to bfloat16's precision
    plain = _Counted(nnx.Rngs(0))
    for _ in range(3):
        _, plain_grads = nnx.value_and_grad(_nnx_loss)(plain, X)
    np.testing.assert_allclose(model.norm.mean[...], plain.norm.mean[...], rtol=0.05, atol=1e-3)
    for g, r in zip(
        _arrays(nnx.state(grads, nnx.Param)), _arrays(nnx.state(plain_grads, nnx.Param))
    ):
        np.testing.assert_allclose(g, r, rtol=0.1, atol=3e-3)


@needs_pytree_modules
def test_nnx_writes_survive_an_eager_amp_call_and_nnx_jit():
    model = _Counted(nnx.Rngs(0))
    autocast.amp(_nnx_loss)(model, X)
    assert int(model.calls[...]) == 1
    nnx.jit(autocast.amp(_nnx_loss))(model, X)
    assert int(model.calls[...]) == 2


@needs_pytree_modules
@pytest.mark.parametrize("bound", [False, True], ids=["module", "bound_call"])
def test_an_amp_nnx_module_is_a_pytree_of_its_parameters(bound):
    model = nnx.Linear(8, 4, rngs=nnx.Rngs(0))
    wrapped = autocast.amp(model.__call__ if bound else model, compute_dtype=jnp.bfloat16)
    assert len(_arrays(wrapped)) == 2
    grads = jax.grad(lambda m, x: jnp.mean(m(x) ** 2))(wrapped, X)
    assert _nonzero_leaves(grads) == 2
    dots = _dot_dtypes(jax.make_jaxpr(lambda m, x: m(x))(wrapped, X))
    assert dots == ["bfloat16"]


def test_a_linen_apply_is_wrapped_as_a_function_of_its_parameters():
    linen = pytest.importorskip("flax.linen")
    model = linen.Dense(4)
    params = model.init(jax.random.PRNGKey(0), X)
    wrapped = autocast.amp(model.apply, compute_dtype=jnp.bfloat16)
    assert jax.tree_util.tree_leaves(wrapped) == []  # a Linen module holds no parameters
    grads = jax.grad(lambda p: jnp.mean(wrapped(p, X) ** 2))(params)
    reference = jax.grad(lambda p: jnp.mean(model.apply(p, X) ** 2))(params)
    assert _nonzero_leaves(grads) == 2
    for g, r in zip(_arrays(grads), _arrays(reference)):
        np.testing.assert_allclose(g, r, rtol=0.1, atol=3e-3)
    bound = autocast.amp(model.bind(params).__call__, compute_dtype=jnp.bfloat16)
    assert _dot_dtypes(jax.make_jaxpr(bound)(X)) == ["bfloat16"]
