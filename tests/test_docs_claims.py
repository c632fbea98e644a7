"""Sentences of docs/*.md that state behaviour and that no runnable block of the page shows.

Each test names the page and quotes (or closely paraphrases) the sentence it checks; when a
test fails, fix the code or the sentence, not the test alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest

import autocast
import autocast.optax

F16 = jnp.float16


def _small_problem():
    # small enough that float16 gradients at the default scale of 2**15 do not overflow
    return jnp.full((4, 4), 0.01), jnp.ones((2, 4))


def test_a_nan_metric_in_aux_neither_skips_the_step_nor_shrinks_the_scale():
    # loss_scaling.md: "The loss and the gradients decide whether a step was finite: a NaN
    # metric in `aux` neither skips the step nor shrinks the scale."
    # migration.md: what decides "not finite" is "the gradients and the loss ...; not `aux`".
    w, x = _small_problem()

    def loss(w, x):
        return jnp.mean((x @ w) ** 2), {"metric": jnp.float32(jnp.nan)}

    state0 = autocast.DynamicScalerState()
    grad_fn = autocast.dynamic_scale_value_and_grad(
        autocast.amp(loss, compute_dtype=F16), has_aux=True
    )
    state, ((value, aux), grads) = grad_fn(w, x, dynamic_scaler_state=state0)
    assert bool(jnp.isnan(aux["metric"])) and bool(jnp.isfinite(value))
    assert bool(autocast.all_finite(grads))
    assert float(state.scaler) == float(state0.scaler)
    assert int(state.total_resets) == 0 and int(state.skipped_in_a_row) == 0


@pytest.mark.parametrize("face", ["value_and_grad", "grad"])
def test_a_nan_loss_with_finite_gradients_is_skipped_once_and_keeps_the_scale(face):
    # loss_scaling.md: "A step whose batch, parameters or loss hold an inf or NaN is skipped
    # once and keeps its scale ... A non-finite loss turns the returned gradients NaN".
    # migration.md: "one skipped step, the scale kept, no retry; `total_resets` and
    # `skipped_in_a_row` go up by one".
    w, x = _small_problem()

    def loss(w, x):  # the NaN term does not reach the parameters
        return jnp.mean((x @ w) ** 2) + jnp.sqrt(jnp.float32(-1.0))

    make = getattr(autocast, f"dynamic_scale_{face}")
    state0 = autocast.DynamicScalerState()
    state, out = make(autocast.amp(loss, compute_dtype=F16), redo_on_nan=10)(
        w, x, dynamic_scaler_state=state0
    )
    grads = out[1] if face == "value_and_grad" else out
    assert bool(jnp.isnan(grads).all())
    assert float(state.scaler) == float(state0.scaler)
    assert int(state.total_resets) == 1 and int(state.skipped_in_a_row) == 1


def test_the_optax_face_sees_the_loss_only_where_given_value():
    # loss_scaling.md: "The wrapper sees the loss only where `update` is given it as `value=`:
    # then a non-finite loss skips the step even where the gradients are finite ...; without
    # it, only the gradients decide. It halves once per bad step whatever the cause".
    w, x = _small_problem()
    amp_loss = autocast.amp(
        lambda w, x: jnp.mean((x @ w) ** 2) + jnp.sqrt(jnp.float32(-1.0)), compute_dtype=F16
    )
    tx = autocast.optax.dynamic_loss_scaling(optax.sgd(0.1))
    opt_state = tx.init(w)
    scale = autocast.optax.loss_scale_of(opt_state)
    loss, grads = jax.value_and_grad(lambda p: scale.scale(amp_loss(p, x)))(w)
    assert bool(jnp.isnan(loss)) and bool(autocast.all_finite(grads))

    _, without = tx.update(grads, opt_state, w)
    assert int(autocast.optax.skipped_steps(without)) == 0

    updates, given = tx.update(grads, opt_state, w, value=loss)
    assert int(autocast.optax.skipped_steps(given)) == 1
    assert float(autocast.optax.loss_scale_of(given).loss_scale) == float(scale.loss_scale) / 2
    assert bool((updates == 0).all())


def test_python_floats_are_traced_and_ints_static():
    # amp.md: "A Python `float` (or `complex`) argument is traced ...: a new learning rate does
    # not trace again ... Python `int` and `bool` arguments are static ... Outputs keep the
    # weak types `jax.jit(fn)` gives."
    traces = []

    def fn(x, lr, c, n, train):
        traces.append(None)
        return (x @ x) * lr, (x * c).real.sum(), lr * 2.0, x * n if train else x

    wrapped = autocast.amp(fn)
    x = jnp.ones((4, 4))
    for lr, c in ((0.1, 1 + 2j), (0.2, 3 + 1j), (0.3, 2j)):
        out = wrapped(x, lr, c, 3, True)
    assert len(traces) == 1
    wrapped(x, 0.3, 2j, 4, True)
    wrapped(x, 0.3, 2j, 4, False)
    assert len(traces) == 3
    assert out[2].weak_type and jax.jit(fn, static_argnums=(3, 4))(x, 0.3, 2j, 3, True)[2].weak_type


def test_a_python_float_argument_reaches_an_entry_point_as_jit_passes_it():
    # fused_attention.md: "Python scalars written in the code pass through unchanged. A Python
    # float that is an argument of the function amp wraps is traced ..., as jax.jit traces it:
    # it reaches the entry point as a weakly typed float32 scalar ... and is not cast to the
    # compute dtype with the arrays."
    seen = []

    @autocast.in_compute_dtype
    def kernel(q, s):
        seen.append(s)
        return q * s

    q = jnp.ones((2, 16))
    autocast.amp(lambda q: kernel(q, 0.1).sum(), compute_dtype=jnp.bfloat16)(q)
    autocast.amp(lambda q, s: kernel(q, s).sum(), compute_dtype=jnp.bfloat16)(q, 0.1)
    written, argument = seen
    assert type(written) is float and written == 0.1
    assert argument.dtype == jnp.float32 and argument.weak_type


def test_float8_init_needs_concrete_arguments_and_starts_at_loss_scale_one():
    # fp8.md: "`init` runs one compiled step on concrete arguments (not under `jax.jit`)";
    # "a history keeps its amaxes at its own `loss_scale` (1 from `init`)"; "one (3, 16)
    # history per product".
    f = lambda a, b: jnp.sum(a @ b)  # noqa: E731
    a = jnp.ones((32, 32)) / 32
    loss8 = autocast.amp_fp8_delayed(f, history=16)
    with pytest.raises(TypeError, match="concrete"):
        jax.jit(loss8.init)(a, a)
    history = loss8.init(a, a)
    assert float(history.loss_scale) == 1.0
    assert [h.shape for h in history.amax] == [(3, 16)]


def test_float8_types_without_a_recipe_are_refused():
    # fp8.md: "AMD's `float8_e4m3fnuz` pairs with `float8_e5m2fnuz`. Other float8 types are
    # refused."
    f = lambda a, b: jnp.sum(a @ b)  # noqa: E731
    a = jnp.ones((32, 32)) / 32
    autocast.amp(f, compute_dtype=jnp.float8_e4m3fnuz)(a, a)
    with pytest.raises(ValueError, match="float8_e4m3b11fnuz"):
        autocast.amp(f, compute_dtype=jnp.float8_e4m3b11fnuz)(a, a)
