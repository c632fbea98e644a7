"""amp's device-dependent choices follow the device a program is traced for, not the
process's default backend: a TPU or GPU step planned from this CPU decides as on that chip.

The targets here are abstract meshes naming a device kind (no TPU or GPU library needed);
the tests at the end compile for real TPU devices where libtpu is installed
(``make tpu-plan``'s venv) and skip elsewhere.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TPU_PLAN_VENV, in_venv, needs_tpu_plan_venv, operand_dtypes

import autocast
from autocast._src.fp8 import products as fp8
from autocast._src.policy.target import Target, target_of

_CPU_MESH = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
_CPU_DEVICE = getattr(_CPU_MESH.abstract_mesh, "abstract_device", None)

needs_device_kinds = pytest.mark.skipif(
    _CPU_DEVICE is None, reason="this JAX's meshes do not name their devices' kind"
)

TPU_V5E = "TPU v5 lite"
V100 = "Tesla V100-SXM2-16GB"
A100 = "NVIDIA A100-SXM4-80GB"
H100 = "NVIDIA H100 80GB HBM3"


def _mesh(kind: str, platform: str) -> jax.sharding.AbstractMesh:
    device = dataclasses.replace(_CPU_DEVICE, device_kind=kind, platform=platform)
    return jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)


def _on(kind: str, platform: str, *shapes: tuple[int, ...]) -> list[jax.ShapeDtypeStruct]:
    """Arguments placed on one device of ``kind``: what a step planned for it is traced on."""
    where = jax.sharding.NamedSharding(_mesh(kind, platform), jax.sharding.PartitionSpec())
    return [jax.ShapeDtypeStruct(s, jnp.float32, sharding=where) for s in shapes]


def _layer(x, w):
    return jnp.sum(jnp.tanh(x @ w))


def _product_dtypes(jaxpr) -> set[str]:
    """The operand dtypes of every matrix product of ``jaxpr``, sub-jaxprs included."""
    return {
        dtype
        for name in ("dot_general", "conv_general_dilated")
        for dtypes in operand_dtypes(jaxpr, name)
        for dtype in dtypes
    }


@needs_device_kinds
@pytest.mark.parametrize(
    "kind, platform, expected",
    [
        (V100, "gpu", "float16"),  # no bfloat16 arithmetic before Ampere
        (A100, "gpu", "bfloat16"),
        (H100, "gpu", "bfloat16"),
        (TPU_V5E, "tpu", "bfloat16"),
        ("TPU v6 lite", "tpu", "bfloat16"),
    ],
)
def test_the_default_compute_dtype_is_the_target_devices(kind, platform, expected):
    args = _on(kind, platform, (8, 16), (16, 4))
    jaxpr = jax.make_jaxpr(jax.grad(autocast.amp(_layer), argnums=(0, 1)))(*args)
    assert _product_dtypes(jaxpr) == {expected}
    # the same function called on this CPU's arrays decides as the CPU does
    x, w = (jnp.ones(a.shape) for a in args)
    assert _product_dtypes(jax.make_jaxpr(autocast.amp(_layer))(x, w)) == {"bfloat16"}


@needs_device_kinds
@pytest.mark.parametrize("kind", [TPU_V5E, "TPU v5", "TPU v6 lite", "TPU v4"])
def test_fp8_on_a_tpu_without_float8_products_is_refused_naming_what_it_runs(kind):
    args = _on(kind, "tpu", (8, 16), (16, 4))
    f = autocast.amp(_layer, compute_dtype="fp8")
    with pytest.raises(ValueError, match=rf"{re.escape(kind)}.*multiply bfloat16.*jnp\.bfloat16"):
        jax.make_jaxpr(jax.grad(f))(*args)
    # and traced under jax.jit for that device
    with pytest.raises(ValueError, match=re.escape(kind)):
        jax.eval_shape(jax.jit(jax.grad(f)), *args)


@needs_device_kinds
def test_fp8_follows_the_gpu_target():
    f = autocast.amp(_layer, compute_dtype="fp8")
    with pytest.raises(ValueError, match=r"A100.*compute capability 8\.0.*no float8 GEMMs"):
        jax.make_jaxpr(f)(*_on(A100, "gpu", (32, 32), (32, 32)))
    with pytest.raises(ValueError, match=r"V100.*jnp\.float16"):
        jax.make_jaxpr(f)(*_on(V100, "gpu", (32, 32), (32, 32)))
    on_h100 = jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(*_on(H100, "gpu", (32, 32), (32, 32)))
    assert {"float8_e4m3fn", "float8_e5m2"} <= _product_dtypes(on_h100)
    # e5m2 by e5m2 has no GEMM on NVIDIA's GPUs; on this CPU it is emulated and runs
    e5m2 = autocast.amp(_layer, compute_dtype=jnp.float8_e5m2)
    with pytest.raises(ValueError, match=r"e5m2 by e5m2.*compute_dtype='fp8'"):
        jax.make_jaxpr(e5m2)(*_on(H100, "gpu", (32, 32), (32, 32)))
    assert np.isfinite(float(e5m2(jnp.ones((32, 32)), jnp.ones((32, 32)))))


@needs_device_kinds
@pytest.mark.parametrize("kind", [TPU_V5E, "TPU v6 lite"])
def test_float16_on_a_tpu_is_refused_naming_what_it_runs(kind):
    # its compiler widens float16 operands to float32 (benchmarks/tpu_products.py)
    f = autocast.amp(_layer, compute_dtype=jnp.float16)
    with pytest.raises(ValueError, match=rf"float16 on a {kind}.*float32.*jnp\.bfloat16"):
        jax.make_jaxpr(jax.grad(f))(*_on(kind, "tpu", (8, 16), (16, 4)))
    # a GPU multiplies float16: it runs there, and on this CPU
    on_a100 = jax.make_jaxpr(jax.grad(f))(*_on(A100, "gpu", (8, 16), (16, 4)))
    assert _product_dtypes(on_a100) == {"float16"}
    assert np.isfinite(float(f(jnp.ones((8, 16)), jnp.ones((16, 4)))))


@needs_device_kinds
def test_the_target_is_read_from_arrays_structs_tracers_and_the_mesh_in_use():
    (spec,) = _on(TPU_V5E, "tpu", (2,))
    assert target_of(spec) == Target("tpu", TPU_V5E)
    seen = []
    jax.make_jaxpr(lambda a: seen.append(target_of(a)) or a)(spec)
    assert seen == [Target("tpu", TPU_V5E)]
    # a GPU known by its kind gets its compute capability from NVIDIA's models
    (gpu,) = _on(H100, "gpu", (2,))
    assert target_of(gpu).nvidia_capability == (9, 0)
    # a jax.Array: its own device; nothing placed: the default device
    here = jax.devices()[0]
    assert target_of(jnp.ones(2)) == Target(here.platform, here.device_kind)
    assert target_of(1.0, "text") == target_of()
    with jax.sharding.use_abstract_mesh(_mesh(TPU_V5E, "tpu")):
        assert target_of(1.0) == Target("tpu", TPU_V5E)
        assert autocast.half_dtype() == jnp.bfloat16
    with jax.sharding.use_abstract_mesh(_mesh(V100, "gpu")):
        assert autocast.half_dtype() == jnp.float16


def test_float8_refusals_by_device():
    recipe = fp8.DEFAULT_RECIPE
    assert fp8.float8_refusal(recipe, Target("cpu", "cpu")) is None  # emulated, for study
    assert fp8.float8_refusal(recipe, Target("gpu", H100, "9.0")) is None
    assert fp8.float8_refusal(recipe, Target("gpu", "NVIDIA L4", "8.9")) is None
    assert fp8.float8_refusal(recipe, Target("gpu", "AMD Instinct MI300X", "gfx942")) is None
    assert fp8.float8_refusal(recipe, Target("tpu", "TPU7x")) is None  # Ironwood: float8 MXUs
    assert "no float8 GEMMs" in fp8.float8_refusal(recipe, Target("gpu", A100, "8.0"))
    assert "multiply bfloat16" in fp8.float8_refusal(recipe, Target("tpu", TPU_V5E))
    e5m2 = fp8.RECIPES[np.dtype(jnp.float8_e5m2)]
    assert "e5m2 by e5m2" in fp8.float8_refusal(e5m2, Target("gpu", H100, "9.0"))
    assert fp8.float8_refusal(e5m2, Target("cpu", "cpu")) is None


# ---- compiled for TPU devices (make tpu-plan's venv, where libtpu is installed) -------------

_COMPILED = """
import re, sys
import jax, jax.numpy as jnp, numpy as np
from jax.experimental import topologies
import autocast

devices = topologies.get_topology_desc(topology_name=sys.argv[1], platform="tpu").devices
where = jax.sharding.NamedSharding(
    jax.sharding.Mesh(np.array(devices[:1]), ("x",)), jax.sharding.PartitionSpec()
)
x, w = (jax.ShapeDtypeStruct(s, jnp.float32, sharding=where) for s in ((256, 512), (512, 256)))
layer = lambda x, w: jnp.sum(jnp.tanh(x @ w))

def products(compute_dtype):
    step = jax.jit(jax.grad(autocast.amp(layer, compute_dtype=compute_dtype), argnums=(0, 1)))
    hlo = step.lower(x, w).compile().as_text()
    dtypes = dict(re.findall(r"%(\\S+) = (\\w+)\\[", hlo))
    calls = re.findall(r" (?:dot|convolution)\\(([^)]*)\\)", hlo)
    return sorted({dtypes[n] for c in calls for n in re.findall(r"%([^\\s,)]+)", c)})

print("default", *products(None))
for name in ("float16", "fp8"):
    try:
        products(name)
        print(name, "compiled")
    except ValueError as e:
        print(name, "refused:", e)
"""


@needs_tpu_plan_venv
@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2"])
def test_amp_compiled_for_a_tpu(topology):
    printed = in_venv(TPU_PLAN_VENV, "-c", _COMPILED, topology)
    assert "default bf16\n" in printed  # every dot and convolution of amp's step
    assert "float16 refused:" in printed and "fp8 refused:" in printed


@needs_device_kinds
def test_attention_may_take_cudnn_only_when_traced_for_a_gpu():
    from autocast._src.transform import entry_points

    shape = (2, 16, 4, 8)
    assert entry_points.fused_attention_possible(*_on(H100, "gpu", shape, shape, shape))
    assert not entry_points.fused_attention_possible(*_on(TPU_V5E, "tpu", shape, shape, shape))
    seen = []

    def attention(q, k, v):
        seen.append(target_of(q, k, v))
        return jnp.sum(jax.nn.dot_product_attention(q, k, v, implementation="xla"))

    jax.make_jaxpr(autocast.amp(attention))(*_on(H100, "gpu", shape, shape, shape))
    assert seen and seen[0].platform == "gpu"  # amp's trace keeps the arguments' device


def test_calls_on_devices_of_two_compute_dtypes_do_not_share_a_trace(monkeypatch):
    # concrete arrays carry no device in their type: the trace cache must tell the two apart
    from autocast._src.transform import amp as amp_module
    from autocast._src.transform.entry_points import in_compute_dtype

    f = autocast.amp(lambda q, k: jnp.sum(in_compute_dtype(lambda a, b: a @ b)(q, k)))
    x = jnp.ones((4, 4))
    # a new function each time: make_jaxpr keeps its own trace per function
    assert _product_dtypes(jax.make_jaxpr(lambda a: f(a, a))(x)) == {"bfloat16"}
    monkeypatch.setattr(amp_module, "target_of", lambda *trees: Target("gpu", V100, "7.0"))
    assert _product_dtypes(jax.make_jaxpr(lambda a: f(a, a))(x)) == {"float16"}


@needs_device_kinds
def test_an_equinox_module_planned_for_a_tpu_decides_as_there():
    eqx = pytest.importorskip("equinox")
    model = eqx.nn.MLP(16, 4, 32, depth=2, key=jax.random.key(0))
    where = jax.sharding.NamedSharding(_mesh(TPU_V5E, "tpu"), jax.sharding.PartitionSpec())
    placed = jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=where) if eqx.is_array(a) else a,
        model,
    )
    params, static = eqx.partition(placed, lambda a: isinstance(a, jax.ShapeDtypeStruct))
    (x,) = _on(TPU_V5E, "tpu", (8, 16))

    def loss(params, x, compute_dtype=None):
        m = eqx.combine(params, static)
        return jnp.sum(jax.vmap(autocast.amp(m, compute_dtype=compute_dtype))(x))

    grads = jax.make_jaxpr(eqx.filter_grad(loss))(params, x)
    assert _product_dtypes(grads) == {"bfloat16"}
    with pytest.raises(ValueError, match="TPU v5 lite"):
        jax.make_jaxpr(eqx.filter_grad(lambda p, x: loss(p, x, "fp8")))(params, x)
