"""Property-based tests of ``amp`` over randomly generated programs.

A program is a short list of steps (elementwise, binary, matmul, reductions, data movement)
applied to ``x`` of shape ``(n, d)`` with a weight ``w`` of shape ``(d, d)``, optionally a
second array ``y`` of ``x``'s shape, an int32 array and a bool mask. Hypothesis draws the
program and a seed for the input values; every test checks one property of ``amp`` on it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import DETERMINISTIC, program_text
from hypothesis import HealthCheck, given, settings

import autocast
from autocast._src.tools.measure import equations

F32, F16, BF16 = (np.dtype(d) for d in (jnp.float32, jnp.float16, jnp.bfloat16))

SETTINGS = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# --------------------------------------------------------------------------------------------
# Programs
# --------------------------------------------------------------------------------------------

UNARY: dict[str, Callable[[Any], Any]] = {
    "tanh": jnp.tanh,
    "exp": jnp.exp,
    "log_abs1": lambda x: jnp.log(jnp.abs(x) + 1.0),
    "sqrt_abs": lambda x: jnp.sqrt(jnp.abs(x)),
    "negative": jnp.negative,
    "square": lambda x: x * x,
    "relu": jax.nn.relu,
    "gelu": jax.nn.gelu,
    "sigmoid": jax.nn.sigmoid,
}

BINARY: dict[str, Callable[[Any, Any], Any]] = {
    "add": jnp.add,
    "sub": jnp.subtract,
    "mul": jnp.multiply,
    "maximum": jnp.maximum,
}

REDUCE: dict[str, Callable[[Any, int], Any]] = {
    "sum": lambda x, a: jnp.sum(x, axis=a, keepdims=True),
    "mean": lambda x, a: jnp.mean(x, axis=a, keepdims=True),
    "max": lambda x, a: jnp.max(x, axis=a, keepdims=True),
    "softmax": lambda x, a: jax.nn.softmax(x, axis=a),
    "logsumexp": lambda x, a: jax.nn.logsumexp(x, axis=a, keepdims=True),
}

# Steps whose bfloat16 error stays proportional to the values' size: no exponentials,
# logarithms or powers that amplify a rounding error, no sums that grow with the width.
TAME_UNARY = ("tanh", "negative", "relu", "gelu", "sigmoid")
TAME_REDUCE = ("mean", "max", "softmax")


@dataclasses.dataclass(frozen=True)
class Program:
    n: int
    d: int
    steps: tuple
    has_y: bool
    has_int: bool
    has_mask: bool

    def __call__(self, floats: dict, others: dict) -> dict:
        """The program as a Python function of its float inputs and its int/bool inputs."""
        x, w = floats["x"], floats["w"]
        y = floats.get("y")
        for step in self.steps:
            kind = step[0]
            if kind == "unary":
                x = UNARY[step[1]](x)
            elif kind == "binary":
                _, op, operand = step
                x = BINARY[op](x, y if operand == "y" else operand)
            elif kind == "where":
                x = jnp.where(x > 0, x, 0.0)
            elif kind == "mask":
                x = jnp.where(others["m"], x, 0.0)
            elif kind == "int":
                x = x * others["i"].astype(x.dtype)
            elif kind == "matmul":
                if x.shape[-1] != self.d:
                    x = jnp.broadcast_to(x, (x.shape[0], self.d))
                x = x @ w
            elif kind == "reduce":
                _, op, axis = step
                x = REDUCE[op](x, axis)
            elif kind == "reshape":
                x = x.reshape(-1).reshape(x.shape)
            elif kind == "transpose":
                x = jnp.transpose(jnp.transpose(x))
            elif kind == "concat":
                _, axis = step
                size = x.shape[axis]
                both = jnp.concatenate([x, x], axis=axis)
                x = both[:size] if axis == 0 else both[:, :size]
            else:  # pragma: no cover
                raise AssertionError(step)
        out = {"out": x}
        if others:
            out["passthrough"] = tuple(others[k] for k in sorted(others))
        return out

    def has_matmul(self) -> bool:
        return any(s[0] == "matmul" for s in self.steps)


@st.composite
def programs(draw: Any, tame: bool = False, need_matmul: bool = False) -> Program:
    n = draw(st.integers(2, 6))
    d = draw(st.integers(2, 6))
    has_y = draw(st.booleans())
    has_int = draw(st.booleans())
    has_mask = draw(st.booleans())
    unary = TAME_UNARY if tame else tuple(UNARY)
    reduce = TAME_REDUCE if tame else tuple(REDUCE)
    # Tame programs multiply only by values of size at most 1, so magnitudes do not grow.
    mul_scalars = (0.5, -1.0) if tame else (0.5, -1.5, 2.0, 3.0)
    add_scalars = (0.5, -1.0, 1.0)

    def binary(op: str) -> st.SearchStrategy:
        scalars = mul_scalars if op == "mul" else add_scalars
        operands = st.sampled_from(scalars)
        if has_y:
            operands = st.one_of(st.just("y"), operands)
        return st.tuples(st.just("binary"), st.just(op), operands)

    step_kinds = [
        st.tuples(st.just("unary"), st.sampled_from(unary)),
        st.sampled_from(tuple(BINARY)).flatmap(binary),
        st.just(("where",)),
        st.just(("matmul",)),
        st.tuples(st.just("reduce"), st.sampled_from(reduce), st.integers(0, 1)),
        st.just(("reshape",)),
        st.just(("transpose",)),
        st.tuples(st.just("concat"), st.integers(0, 1)),
    ]
    if has_mask:
        step_kinds.append(st.just(("mask",)))
    if has_int and not tame:
        step_kinds.append(st.just(("int",)))
    steps = draw(st.lists(st.one_of(step_kinds), min_size=1, max_size=6))
    if need_matmul and not any(s[0] == "matmul" for s in steps):
        steps.insert(draw(st.integers(0, len(steps))), ("matmul",))
    return Program(n, d, tuple(steps), has_y, has_int, has_mask)


def make_inputs(
    prog: Program,
    seed: int,
    dtypes: dict | None = None,
    specials: bool = False,
    tame: bool = False,
) -> tuple[dict, dict]:
    """Float inputs (by default float32) and int/bool inputs for ``prog``, from ``seed``."""
    rng = np.random.default_rng(seed)
    dtypes = dtypes or {}
    n, d = prog.n, prog.d
    raw = {
        "x": rng.uniform(-2, 2, (n, d)),
        # Rows of w sum to at most 1 in size for tame programs, so x @ w does not grow.
        "w": rng.uniform(-1, 1, (d, d)) / (d if tame else 1),
    }
    if prog.has_y:
        raw["y"] = rng.uniform(-1, 1, (n, d))
    if specials:
        for v in raw.values():
            k = rng.integers(0, 3)
            flat = v.reshape(-1)
            flat[rng.integers(0, flat.size, k)] = rng.choice([np.inf, -np.inf, np.nan, 0.0], k)
    # converted by NumPy and put on the device as they are: jnp.asarray converts through an
    # eager operation, a program compiled for each new shape hypothesis draws
    put = lambda v, dtype: jax.device_put(np.asarray(v, np.dtype(dtype)))  # noqa: E731
    floats = {k: put(v, dtypes.get(k, F32)) for k, v in raw.items()}
    others = {}
    if prog.has_int:
        others["i"] = put(rng.integers(-3, 4, (n, d)), jnp.int32)
    if prog.has_mask:
        others["m"] = put(rng.random((n, d)) < 0.5, jnp.bool_)
    return floats, others


def avals(tree: Any) -> tuple:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, [(tuple(np.shape(x)), np.dtype(x.dtype)) for x in leaves]


def loss(fn: Callable[..., dict], others: dict) -> Callable[[dict], Any]:
    """The scalar ``sum(fn(...)["out"])`` as a function of the float inputs."""
    return lambda floats: fn(floats, others)["out"].sum()


def dots(jaxpr: Any) -> list:
    return [e for e in equations(jaxpr) if e.primitive.name == "dot_general"]


seeds = st.integers(0, 2**32 - 1)
float_dtypes = st.sampled_from([F32, BF16, F16])


# --------------------------------------------------------------------------------------------
# a. Signature: amp(f) returns exactly f's output avals
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
@SETTINGS
@given(prog=programs(), seed=seeds, compute=st.sampled_from([BF16, F16]))
def test_amp_keeps_output_structure_shapes_and_dtypes(prog, seed, compute):
    floats, others = make_inputs(prog, seed)
    expected = avals(jax.eval_shape(prog, floats, others))
    amp_fn = autocast.amp(prog, compute_dtype=compute)
    assert avals(amp_fn(floats, others)) == expected
    assert avals(jax.eval_shape(jax.jit(amp_fn), floats, others)) == expected


@settings(SETTINGS, max_examples=10)
@given(prog=programs(), seed=seeds)
def test_jitted_amp_runs_and_keeps_output_avals(prog, seed):
    floats, others = make_inputs(prog, seed)
    expected = avals(jax.eval_shape(prog, floats, others))
    for compute in (BF16, F16):
        out = jax.jit(autocast.amp(prog, compute_dtype=compute))(floats, others)
        assert avals(out) == expected


# --------------------------------------------------------------------------------------------
# b. compute_dtype=float32 is bit-identical, values and gradients
# --------------------------------------------------------------------------------------------


def assert_trees_bitwise_equal(actual: Any, expected: Any) -> None:
    """Same structure, dtypes and shapes; NaNs in the same places, every other value in the
    same bits (so -0.0 and 0.0 differ)."""
    a_leaves, a_tree = jax.tree_util.tree_flatten(actual)
    e_leaves, e_tree = jax.tree_util.tree_flatten(expected)
    assert a_tree == e_tree
    for a, e in zip(a_leaves, e_leaves):
        a, e = np.asarray(a), np.asarray(e)
        assert a.dtype == e.dtype and a.shape == e.shape
        np.testing.assert_array_equal(a, e)  # readable report; NaNs compare equal here
        if jnp.issubdtype(a.dtype, jnp.floating):
            nan = np.isnan(a)
            np.testing.assert_array_equal(nan, np.isnan(e))
            bits = np.dtype(f"u{a.dtype.itemsize}")
            np.testing.assert_array_equal(a[~nan].view(bits), e[~nan].view(bits))


def assert_trees_equal(actual: Any, expected: Any) -> None:
    """Bit for bit where XLA is deterministic; elsewhere equal to float32 rounding."""
    if DETERMINISTIC:
        assert_trees_bitwise_equal(actual, expected)
        return
    assert jax.tree_util.tree_structure(actual) == jax.tree_util.tree_structure(expected)
    for a, e in zip(jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(expected)):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(e, np.float64), rtol=1e-6)


@pytest.mark.slow
@SETTINGS
@given(prog=programs(), seed=seeds, specials=st.booleans())
def test_float32_compute_is_bit_identical(prog, seed, specials):
    floats, others = make_inputs(prog, seed, specials=specials)
    amp_fn = autocast.amp(prog, compute_dtype=jnp.float32)
    # the same program as f's on every backend, hence the same bits wherever XLA is
    # deterministic (conftest.DETERMINISTIC)
    assert program_text(amp_fn, floats, others) == program_text(prog, floats, others)
    assert_trees_equal(jax.jit(amp_fn)(floats, others), jax.jit(prog)(floats, others))
    # Called on concrete values, amp runs one compiled program: the bits of jax.jit(f). (Not
    # always f's own eager bits: eager f dispatches operation by operation.)
    assert_trees_equal(amp_fn(floats, others), jax.jit(prog)(floats, others))


@pytest.mark.slow
@SETTINGS
@given(prog=programs(), seed=seeds, specials=st.booleans())
def test_float32_compute_has_bit_identical_gradients(prog, seed, specials):
    floats, others = make_inputs(prog, seed, specials=specials)
    amp_fn = autocast.amp(prog, compute_dtype=jnp.float32)
    # Compared under jit: eagerly, JAX 0.6 runs the jnp helpers that amp's trace inlines
    # (jnp.tanh...) as fused XLA calls, which can differ from op-by-op in the last bit.
    # (The compiled programs agree up to the order of independent instructions, which JAX
    # 0.6 differentiates into a different order: the values are compared.)
    grad_amp, grad_f = jax.grad(loss(amp_fn, others)), jax.grad(loss(prog, others))
    got, want = jax.jit(grad_amp)(floats), jax.jit(grad_f)(floats)
    assert set(got) == set(floats)
    assert_trees_equal(got, want)


# --------------------------------------------------------------------------------------------
# c. Gradients come back in the primal inputs' dtypes and shapes
# --------------------------------------------------------------------------------------------


@SETTINGS
@given(
    prog=programs(),
    seed=seeds,
    dtypes=st.fixed_dictionaries({"x": float_dtypes, "w": float_dtypes, "y": float_dtypes}),
    compute=st.sampled_from([BF16, F16]),
)
def test_gradients_keep_primal_dtypes(prog, seed, dtypes, compute):
    floats, others = make_inputs(prog, seed, dtypes=dtypes)
    # Abstract evaluation traces exactly what a call would, without running it.
    grads = jax.eval_shape(
        jax.grad(loss(autocast.amp(prog, compute_dtype=compute), others)), floats
    )
    assert jax.tree_util.tree_structure(grads) == jax.tree_util.tree_structure(floats)
    for k, x in floats.items():
        assert grads[k].dtype == x.dtype, (k, grads[k].dtype, x.dtype)
        assert grads[k].shape == x.shape


# --------------------------------------------------------------------------------------------
# d. bfloat16 results stay close to float32 on programs that do not amplify rounding
# --------------------------------------------------------------------------------------------

RTOL = 3e-2


@pytest.mark.slow
@SETTINGS
@given(prog=programs(tame=True), seed=seeds)
def test_bfloat16_result_is_close_to_float32(prog, seed):
    floats, others = make_inputs(prog, seed, tame=True)
    want = np.asarray(prog(floats, others)["out"])
    got = autocast.amp(prog, compute_dtype=BF16)(floats, others)["out"]
    assert got.dtype == want.dtype
    got = np.asarray(got)
    finite = np.isfinite(want) & (np.abs(want) < 1e3)
    assert np.isfinite(got[finite]).all()
    got, want = got[finite], want[finite]
    # Tame programs keep values of order one (inputs within 2, nothing that grows them), so
    # each of at most a dozen bfloat16 roundings (8 bits) costs at most ~0.4% of the largest
    # value: 3% of the output's scale is loose yet catches a few-bit format or a wrong op.
    # (Measured worst over 300 programs: 0.9%.) The 0.1 floor covers outputs that cancel.
    scale = max(0.1, float(np.abs(want).max(initial=0.0)))
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * scale)


# --------------------------------------------------------------------------------------------
# e. Every dot_general runs on bfloat16 operands, forward and backward
# --------------------------------------------------------------------------------------------


@SETTINGS
@given(prog=programs(need_matmul=True), seed=seeds)
def test_every_matmul_is_bfloat16_forward_and_backward(prog, seed):
    floats, others = make_inputs(prog, seed)
    amp_fn = autocast.amp(prog, compute_dtype=BF16)
    forward = dots(jax.make_jaxpr(amp_fn)(floats, others))
    backward = dots(jax.make_jaxpr(jax.grad(loss(amp_fn, others)))(floats))
    # The original program has float32 matmuls, and as many as amp's forward pass.
    original = dots(jax.make_jaxpr(prog)(floats, others))
    assert original and all(v.aval.dtype == F32 for e in original for v in e.invars)
    assert len(forward) == len(original)
    assert len(backward) >= len(forward)
    for eqn in forward + backward:
        assert [v.aval.dtype for v in eqn.invars] == [BF16, BF16], eqn


# --------------------------------------------------------------------------------------------
# f. Integer and boolean inputs pass through untouched
# --------------------------------------------------------------------------------------------


def _non_float_converts(jaxpr: Any) -> list:
    out = []
    for eqn in equations(jaxpr):
        if eqn.primitive.name != "convert_element_type":
            continue
        src = eqn.invars[0].aval
        if not jnp.issubdtype(src.dtype, jnp.floating):
            out.append((np.dtype(src.dtype), np.dtype(eqn.outvars[0].aval.dtype), src.shape))
    return sorted(out, key=repr)


@pytest.mark.slow
@SETTINGS
@given(
    prog=programs().filter(lambda p: p.has_int or p.has_mask),
    seed=seeds,
    compute=st.sampled_from([BF16, F16]),
)
def test_integer_and_boolean_inputs_pass_through(prog, seed, compute):
    floats, others = make_inputs(prog, seed)
    amp_fn = autocast.amp(prog, compute_dtype=compute)
    passed = amp_fn(floats, others)["passthrough"]
    expected = tuple(others[k] for k in sorted(others))
    assert len(passed) == len(expected)
    for got, want in zip(passed, expected):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    original = _non_float_converts(jax.make_jaxpr(prog)(floats, others))
    converted = _non_float_converts(jax.make_jaxpr(amp_fn)(floats, others))
    for entry in converted:
        assert entry in original, (entry, original)
        original.remove(entry)


# --------------------------------------------------------------------------------------------
# g. No re-tracing for the same avals
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
@settings(SETTINGS, max_examples=15)
@given(prog=programs(), seeds=st.lists(seeds, min_size=3, max_size=3, unique=True))
def test_repeated_calls_with_same_avals_do_not_retrace(prog, seeds):
    calls = []

    def counted(floats, others):
        calls.append(1)
        return prog(floats, others)

    amp_fn = autocast.amp(counted, compute_dtype=BF16)
    first, *rest = (make_inputs(prog, s) for s in seeds)
    out = amp_fn(*first)
    assert len(calls) == 1
    for floats, others in rest:
        amp_fn(floats, others)
        # grad calls amp with tracers of the same avals: still no new trace.
        jax.eval_shape(jax.grad(loss(amp_fn, others)), floats)
    assert len(calls) == 1
    assert avals(out) == avals(jax.eval_shape(prog, *first))

    bigger = dataclasses.replace(prog, n=prog.n + 1)
    amp_fn(*make_inputs(bigger, seeds[0]))
    assert len(calls) == 2
    amp_fn(*first)  # the first shape is still cached
    assert len(calls) == 2
