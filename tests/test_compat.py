"""The compatibility layer reads each JAX version's structures: loops' input groups, closed and
open jaxprs, calls, and what a linearised custom_vjp's backward returns.

Real programs of the installed JAX exercise the branch that version takes. The other
versions' records, which cannot be made here, are built as their source writes them
(JAX 0.11's ``ft_in`` flat tree; the ``(cotangents, logs)`` pair after 0.11.0), so both
branches run on every JAX; ``make test-newest`` runs the suite on JAX 0.12 and 0.11."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import bind_closed_call, eqns_named, hijax_base, hijax_cube
from jax import lax

from autocast import _compat


def _scan_eqn(n_consts: int, n_carry: int, n_xs: int):
    consts = [jnp.full((2,), float(i)) for i in range(n_consts)]

    def f(init, xs):
        def body(carry, x):
            new = tuple(c * 0.5 + sum(consts, 0.0) + x[0] for c in carry)
            return new, sum(new)

        return lax.scan(body, init, xs)

    init = tuple(jnp.ones(2) * i for i in range(n_carry))
    xs = tuple(jnp.ones((3, 2)) for _ in range(n_xs))
    (eqn,) = eqns_named(jax.make_jaxpr(f)(init, xs), "scan")
    return eqn


def test_scan_layout_reads_the_installed_jax():
    for n_consts, n_carry in ((0, 1), (2, 3)):
        eqn = _scan_eqn(n_consts, n_carry, 1)
        got_consts, got_carry = _compat.scan_layout(eqn)
        assert got_carry == n_carry
        # JAX hoists closed-over arrays into constants (a constant may be folded away)
        assert got_consts + got_carry + 1 == len(eqn.invars)


class _Group:
    """A stand-in for one group of JAX 0.11's ``FlatTree`` (``len`` is its leaf count)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


def test_scan_layout_reads_jax_0_11s_flat_tree():
    # JAX 0.11 binds scan with ft_in=ft.pack((consts, carry, xs)) and no num_consts/num_carry
    ft_in = types.SimpleNamespace(unpack=lambda: (_Group(2), _Group(3), _Group(1)))
    eqn = types.SimpleNamespace(params={"ft_in": ft_in, "jaxpr": None, "length": 4})
    assert _compat.scan_layout(eqn) == (2, 3)


def test_scan_layout_names_what_it_cannot_read():
    eqn = types.SimpleNamespace(params={"jaxpr": None, "length": 4})
    try:
        _compat.scan_layout(eqn)
    except NotImplementedError as e:
        assert "scan" in str(e) and "length" in str(e)
    else:
        raise AssertionError("no error")


def test_while_layout_reads_the_jaxprs_arity():
    w = jnp.ones(2)

    def f(x, n):
        return lax.while_loop(lambda c: c[1] < n, lambda c: (c[0] * w, c[1] + 1), (x, 0))

    (eqn,) = eqns_named(jax.make_jaxpr(f)(jnp.ones(2), 3), "while")
    n_cond, n_body = _compat.while_layout(eqn)
    assert n_cond + n_body + 2 == len(eqn.invars)
    assert (n_cond, n_body) == (eqn.params["cond_nconsts"], eqn.params["body_nconsts"])


def test_closed_and_open_jaxprs():
    w = jnp.linspace(0.0, 1.0, 4).reshape(2, 2)
    closed = jax.make_jaxpr(lambda x: x @ w)(jnp.ones((1, 2)))
    assert _compat.holds_constants(closed)
    opened = _compat.constants_unbound(closed)
    if opened is not None:  # JAX after 0.11.0 has no jaxpr with unbound constants
        assert opened.constvars and not _compat.holds_constants(opened)
    assert not _compat.holds_constants(np.ones(2))


def test_calls_are_read_whatever_the_primitive_is_called():
    closed = jax.make_jaxpr(lambda x: [jnp.sin(x)])(jnp.ones(2))

    def fn(x):
        return bind_closed_call(closed, x)

    (eqn,) = jax.make_jaxpr(fn)(jnp.ones(2)).eqns
    jaxpr, consts = _compat.called_jaxpr(eqn)
    np.testing.assert_allclose(jax.core.eval_jaxpr(jaxpr, consts, jnp.ones(2))[0], jnp.sin(1.0))


def test_backward_cotangents_before_and_after_logs():
    # up to JAX 0.11.0 the rule returns its cotangents; after, (cotangents, logs)
    cts, repack = _compat.backward_cotangents([1.0, 2.0])
    assert cts == [1.0, 2.0] and repack([3.0, 4.0]) == [3.0, 4.0]
    logs = {"norm": 5.0}
    cts, repack = _compat.backward_cotangents(([1.0, 2.0], logs))
    assert cts == [1.0, 2.0] and repack([3.0, 4.0]) == ([3.0, 4.0], logs)
    cts, repack = _compat.backward_cotangents(([1.0], None))
    assert cts == [1.0] and repack([3.0]) == ([3.0], None)


def test_zero_cotangents_reach_a_rule_as_symbolic_zeros_where_the_pullback_takes_them(monkeypatch):
    from jax.custom_derivatives import SymbolicZero

    seen = []

    @jax.custom_vjp
    def f(x):
        return x * 2.0, x * 3.0

    def bwd(_, cts):
        seen.append(tuple(isinstance(c, SymbolicZero) for c in cts))
        given = [c * k for c, k in zip(cts, (2.0, 3.0)) if not isinstance(c, SymbolicZero)]
        return (sum(given, jnp.zeros(3)),)

    f.defvjp(lambda x: (f(x.value), None), bwd, symbolic_zeros=True)
    _, pullback = jax.vjp(f, jnp.ones(3))
    aval = jax.typeof(jnp.ones(3))
    symbolic = _compat._pullback_takes_symbolic_zeros()
    # JAX 0.10's and later pullbacks take them; 0.6.2's does not (it checks a flat tree of arrays)
    assert symbolic == (jax.__version_info__ >= (0, 10))
    (ct,) = pullback((_compat.zero_cotangent(aval), jnp.ones(3)))
    np.testing.assert_array_equal(ct, 3.0)
    assert seen == [(symbolic, False)]
    # the other branch, which every JAX takes: an array of zeros, an ordinary cotangent
    monkeypatch.setattr(_compat, "_pullback_takes_symbolic_zeros", lambda: False)
    zeros = _compat.zero_cotangent(aval)
    assert isinstance(zeros, np.ndarray) and zeros.dtype == np.float32 and not zeros.any()
    (ct,) = pullback((zeros, jnp.ones(3)))
    np.testing.assert_array_equal(ct, 3.0)
    assert seen[-1] == (False, False)


# --- hijax operations (JAX 0.10 on) --------------------------------------------------------------


def _hijax_ops():
    """Two operations of a user's, written with ``jax.experimental.hijax``: ``Cube`` carries
    nothing, ``Holder`` jaxprs in a list and in another operation."""

    class Holder(hijax_base()):
        def __init__(self, parts, inner, aval):
            self.in_avals, self.out_aval = (aval,), aval
            self.params = {"parts": parts, "inner": inner}
            super().__init__()

        def expand(self, x):
            return x

    return hijax_cube(), Holder


def test_hijax_equations_are_named_their_jaxprs_found_and_retyped_only_as_marks():
    cube, holder = _hijax_ops()
    x = jnp.ones((2,), jnp.float32)
    closed = jax.make_jaxpr(jnp.sin)(x)
    inner = holder([], None, jax.typeof(x))
    fn = lambda x: holder([closed, closed], inner, jax.typeof(x))(cube(jax.typeof(x))(x))  # noqa: E731
    c, h = jax.make_jaxpr(fn)(x).eqns
    assert (_compat.hijax_name(c), _compat.equation_name(c)) == ("Cube", "Cube")
    assert _compat.hijax_name(closed.eqns[0]) is None
    assert _compat.equation_name(closed.eqns[0]) == "sin"
    assert _compat.hijax_jaxprs(c) == [] and len(_compat.hijax_jaxprs(h)) == 2
    assert len(list(_compat.sub_jaxprs(h))) == 2 and _compat.called_jaxpr(h) is None
    assert _compat.checkpoint_name_primitive(c) is None
    # bound again on the recorded types; on others only a checkpoint_name mark is re-made
    assert _compat.bind_equation(c, [x], c.params)[0].dtype == np.float32
    with pytest.raises(TypeError, match="hijax operation Cube.*bfloat16.*amp_stop"):
        _compat.bind_equation(c, [x.astype(jnp.bfloat16)], c.params)


def test_a_remat3_checkpoint_is_read_as_a_call_and_its_marks_as_names():
    if not hasattr(jax.config, "jax_remat3"):
        pytest.skip(f"JAX {jax.__version__} has no jax_remat3")
    from jax.ad_checkpoint import checkpoint_name

    assert _compat.trace_context() == _compat.trace_context()
    before = _compat.trace_context()
    jax.config.update("jax_remat3", True)
    try:
        assert _compat.trace_context() != before  # a trace made under one is not the other's
        x = jnp.ones((2,), jnp.float32)
        fn = jax.checkpoint(lambda x: checkpoint_name(jnp.sin(x), "s"))
        (remat,) = jax.make_jaxpr(fn)(x).eqns
        assert _compat.hijax_name(remat) == "RematTraced"
        jaxpr, consts = _compat.called_jaxpr(remat)
        np.testing.assert_allclose(jax.core.eval_jaxpr(jaxpr, consts, x)[0], jnp.sin(x))
        (mark,) = [e for e in jaxpr.eqns if _compat.hijax_name(e) == "CheckpointName"]
        assert _compat.checkpoint_name_primitive(mark).name == "name"
        retyped = jax.make_jaxpr(lambda y: _compat.bind_equation(mark, [y], mark.params))(
            x.astype(jnp.bfloat16)
        )
        (eqn,) = retyped.eqns
        assert eqn.invars[0].aval.dtype == jnp.bfloat16 == eqn.outvars[0].aval.dtype
    finally:
        jax.config.update("jax_remat3", False)


def test_what_a_custom_vjp3_function_holds_beyond_its_rules():
    # a stand-in of the hijax equation, as JAX 0.12's CustomVJPTraced records its rules
    def eqn(**params):
        prim = types.SimpleNamespace(params={"remat_rules": None, "bwd_accums": None, **params})
        return types.SimpleNamespace(
            primitive=types.SimpleNamespace(name="call_hi_primitive"), params={"_prim": prim}
        )

    assert _compat.custom_call_rules_kept(eqn()) is None
    assert "defremat" in _compat.custom_call_rules_kept(eqn(remat_rules=(1, 2, 3)))
    assert "with_accums" in _compat.custom_call_rules_kept(eqn(bwd_accums=len))
    classic = types.SimpleNamespace(
        primitive=types.SimpleNamespace(name="custom_vjp_call"), params={"num_consts": 2}
    )
    assert _compat.custom_call_rules_kept(classic) is None
    assert _compat.custom_vjp3_consts(classic) == 2
    assert _compat.custom_vjp_takes_symbolic_zeros()  # without jax_custom_vjp3, always
    if not hasattr(jax.config, "jax_custom_vjp3"):
        return
    jax.config.update("jax_custom_vjp3", True)
    try:
        # JAX 0.10's CustomVJPTraced has no JVP rule with symbolic zeros; 0.11's has
        assert _compat.custom_vjp_takes_symbolic_zeros() == (jax.__version_info__ >= (0, 11))
        z = jnp.ones((2,), jnp.float32)
        f = jax.custom_vjp(lambda x: x * z)  # closes over z, which 0.11 on pass as an input
        f.defvjp(lambda x: (x * z, None), lambda _, g: (g * z,))
        (call,) = jax.make_jaxpr(f)(z).eqns
        assert _compat.hijax_name(call) == "CustomVJPTraced"
        assert _compat.custom_vjp3_consts(call) == len(call.invars) - 1
        primal = _compat.custom_call_jaxpr(call)
        np.testing.assert_allclose(
            jax.core.eval_jaxpr(primal.jaxpr, primal.consts, *[z] * len(call.invars))[0], z * z
        )
    finally:
        jax.config.update("jax_custom_vjp3", False)
