"""The device a program is traced for, from which amp's device-dependent choices follow.

Two of amp's choices depend on the chip: the 16-bit type of its products (bfloat16, or
float16 on NVIDIA GPUs older than Ampere) and whether a float8 product can run as one. A
program is often traced for a device that is not the process's default (a TPU or GPU step
planned from a CPU, with compile-only devices), so both follow the device the arguments are
placed on, found in this order:

1. the arguments' shardings: a ``jax.Array``'s devices, a ``jax.ShapeDtypeStruct``'s
   sharding, or, under ``jax.jit``, the mesh in a traced value's type (JAX 0.10 and newer
   keep the device kind there; 0.6.2 does not);
2. the mesh in use (``jax.set_mesh``, ``jax.sharding.use_abstract_mesh``), when it names
   its devices;
3. JAX's default device, ``jax.devices()[0]``.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any

import jax
import jax.numpy as jnp

from autocast._src.tree import is_array

# A GPU known only by its kind (a compile-only device, or a traced value's mesh, carries its
# kind but not its compute capability): the model word of NVIDIA's device kinds, as
# "NVIDIA H100 80GB HBM3" spells it, and that model's compute capability.
_NVIDIA_CAPABILITIES: dict[str, str] = {
    **dict.fromkeys(("P100",), "6.0"),
    **dict.fromkeys(("P40", "P4"), "6.1"),
    **dict.fromkeys(("V100",), "7.0"),
    **dict.fromkeys(("T4", "2080", "2070", "2060"), "7.5"),
    **dict.fromkeys(("A100", "A800", "A30"), "8.0"),
    **dict.fromkeys(("A10", "A10G", "A40", "A6000", "3090", "3080", "3070", "3060"), "8.6"),
    **dict.fromkeys(("L4", "L40", "L40S", "4090", "4080", "4070", "4060"), "8.9"),
    **dict.fromkeys(("H100", "H200", "H800", "H20", "GH200"), "9.0"),
    **dict.fromkeys(("B100", "B200", "GB200"), "10.0"),
    **dict.fromkeys(("B300", "GB300"), "10.3"),
    **dict.fromkeys(("5090", "5080", "5070", "5060"), "12.0"),
}


# The operand dtypes each TPU's matrix units multiply, read off the compiler's machine code
# for one product per operand dtype (benchmarks/tpu_products.py): float16 and float8
# operands are widened and multiplied with float32 matrix instructions, twice as many as
# bfloat16's. A TPU not listed (Ironwood, TPU7x, the first with float8) is refused nothing.
_TPU_MATRIX_DTYPES: dict[str, frozenset[str]] = dict.fromkeys(
    ("TPU v4", "TPU v5", "TPU v5 lite", "TPU v6 lite"),
    frozenset({"bfloat16"}),
)


@dataclasses.dataclass(frozen=True)
class Target:
    """A device a program is traced for: its platform (``"cpu"``, ``"gpu"``, ``"tpu"`` or
    another backend's name), its ``device_kind`` (``"TPU v5 lite"``, ``"NVIDIA H100 80GB
    HBM3"``) and, for a GPU, its compute capability as JAX spells it (``"9.0"``, AMD's
    ``"gfx942"``), None where it is not known."""

    platform: str
    kind: str
    capability: str | None = None

    @property
    def nvidia_capability(self) -> tuple[int, int] | None:
        """``(major, minor)`` of an NVIDIA GPU; None for any other device."""
        if self.platform != "gpu" or self.capability is None:
            return None
        match = re.fullmatch(r"(\d+)\.(\d+)", str(self.capability))
        return (int(match[1]), int(match[2])) if match else None

    def multiplies(self, dtype: Any) -> bool | None:
        """Whether this device's matrix units take ``dtype`` operands as they are; None where
        that is not known (every device but the TPUs measured)."""
        if self.platform != "tpu" or self.kind not in _TPU_MATRIX_DTYPES:
            return None
        return jnp.dtype(dtype).name in _TPU_MATRIX_DTYPES[self.kind]


def _platform(name: str) -> str:
    # CUDA and ROCm devices are "gpu" to JAX's arrays, by name to some plugins and meshes
    return "gpu" if name in ("cuda", "rocm") else name


def _of_device(device: Any) -> Target:
    capability = getattr(device, "compute_capability", None)
    return Target(
        _platform(device.platform),
        str(device.device_kind),
        None if capability is None else str(capability),
    )


@functools.lru_cache(maxsize=None)
def _capability_of_kind(platform: str, kind: str) -> str | None:
    """The compute capability of a GPU known by its kind: a device of this process of that
    kind first, then NVIDIA's models by name."""
    if platform != "gpu":
        return None
    for device in jax.devices():
        if _platform(device.platform) == "gpu" and device.device_kind == kind:
            return str(getattr(device, "compute_capability", None) or "") or None
    for word in kind.replace("-", " ").split():
        if word in _NVIDIA_CAPABILITIES:
            return _NVIDIA_CAPABILITIES[word]
    return None


def _of_mesh(mesh: Any) -> Target | None:
    """The device of a mesh: a concrete mesh's first device, or the device an abstract mesh
    names (newer JAX); None for a mesh that names none."""
    if isinstance(mesh, jax.sharding.Mesh):
        return _of_device(mesh.devices.flat[0]) if mesh.devices.size else None
    device = getattr(mesh, "abstract_device", None)
    if device is None:
        return None
    platform = _platform(str(device.platform))
    kind = str(device.device_kind)
    return Target(platform, kind, _capability_of_kind(platform, kind))


def _of_leaf(leaf: Any) -> Target | None:
    if isinstance(leaf, jax.core.Tracer):  # its type carries the mesh; it has no devices
        sharding = getattr(jax.typeof(leaf), "sharding", None)
    else:
        sharding = getattr(leaf, "sharding", None)
    if sharding is None:
        return None
    mesh = getattr(sharding, "mesh", None)
    if mesh is not None:
        return _of_mesh(mesh)
    try:  # a sharding without a mesh (a jax.Array on one device): its devices
        return _of_device(next(iter(sharding.device_set)))
    except (AttributeError, StopIteration, TypeError):
        return None


def target_of(*trees: Any) -> Target:
    """The device a program taking ``trees`` (its arguments) is traced for: see the module's
    docstring for the order in which it is looked for."""
    for tree in trees:
        for leaf in jax.tree_util.tree_leaves(tree):
            if is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct):
                found = _of_leaf(leaf)
                if found is not None:
                    return found
    context = _of_mesh(jax.sharding.get_abstract_mesh())
    return context if context is not None else _of_device(jax.devices()[0])


def emulated_compute_refusal(dtype: Any, target: Target) -> str | None:
    """Why ``target`` cannot take ``dtype`` as amp's 16-bit compute dtype, or None: a TPU
    multiplies float16 operands with float32 instructions after widening them."""
    if jnp.dtype(dtype) != jnp.float16 or target.multiplies(dtype) is not False:
        return None
    return (
        f"compute_dtype float16 on a {target.kind}: its matrix units multiply bfloat16; the "
        "compiler widens float16 operands to float32 and multiplies them with float32 "
        "instructions, twice bfloat16's (benchmarks/tpu_products.py), and float16's range "
        "would still need loss scaling. Use compute_dtype=jnp.bfloat16 (amp's default there)"
    )
