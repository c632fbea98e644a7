"""``autocast.plan``: a step compiled for a TPU or GPU this machine does not have, and what the
compiler planned for it.

A TPU's compiler (libtpu) and a GPU's (the CUDA plugin) run on a CPU machine: JAX makes
compile-only devices of a named topology (``jax.experimental.topologies``), a program lowered
on abstract arguments placed there compiles through the whole pipeline, and its memory plan,
HLO and buffer assignment come back. Nothing runs, so a plan says nothing of time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.metadata
import importlib.util
import re
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from autocast._src.tools import measure, xla_program

_DEVICES = Path(__file__).parent / "gpu_devices"

# A TPU target's chip -> (its name in libtpu's topologies, one host's chips, its memory as
# the chip's public figure in GiB).
_TPUS = {
    "v4": ("v4", "2x2x1", 32),
    "v5e": ("v5e", "2x2", 16),
    "v5p": ("v5p", "2x2x1", 95),
    "v6e": ("v6e", "2x2", 32),
}
# A GPU target -> its device description (public figures; device_memory_size is the memory).
_GPUS = {"h100": "h100_sxm.txtpb", "h200": "h200_sxm.txtpb", "b200": "b200.txtpb"}
_TARGETS = [f"tpu-{chip}[:TOPOLOGY]" for chip in _TPUS] + [f"gpu-{gpu}" for gpu in _GPUS] + ["cpu"]


@dataclasses.dataclass(frozen=True)
class PlannedBuffer:
    """A buffer live at the planned peak: its bytes, HLO shape, what made it (a primitive,
    ``backward`` when the backward pass did, ``stacked by a loop`` for what a ``scan`` keeps
    for its backward pass, or ``argument`` and its path) and the user's line that made it.

    >>> import jax, jax.numpy as jnp, autocast
    >>> w = jax.ShapeDtypeStruct((128, 128), jnp.float32)
    >>> p = autocast.plan(jax.jit(lambda w: jnp.sin(w) @ w), w, target="cpu")
    >>> max(b.nbytes for b in p.buffers) == 128 * 128 * 4
    True
    """

    nbytes: int
    shape: str
    made_by: str
    where: str


@dataclasses.dataclass(frozen=True)
class PlannedProduct:
    """The dots and convolutions of one line of the user's code that the compiled program
    runs with one pair of operand types (``"bf16 x bf16"``), and how many there are (a loop
    body's counted once).

    >>> import jax, jax.numpy as jnp, autocast
    >>> w = jax.ShapeDtypeStruct((128, 128), jnp.float32)
    >>> [(q.operands, q.count) for q in autocast.plan(lambda w: w @ w, w, target="cpu").products]
    [('f32 x f32', 1)]
    """

    operands: str
    where: str
    count: int


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the compiler planned for one step on one target (:func:`plan`). Bytes are per
    chip. ``fits`` is False where the compiler refused the program (a TPU's compiler refuses
    one that does not fit, and ``refusal`` holds its words) or where the planned peak is over
    the chip's memory (a GPU's compiler plans it anyway).

    >>> import jax, jax.numpy as jnp, autocast
    >>> w = jax.ShapeDtypeStruct((128, 128), jnp.float32)
    >>> p = autocast.plan(lambda w: w @ w, w, target="cpu")
    >>> p.fits, p.argument_bytes, p.output_bytes
    (True, 65536, 65536)
    """

    target: str
    chips: int
    fits: bool
    refusal: str | None
    peak_bytes: int | None
    argument_bytes: int | None
    output_bytes: int | None
    temporary_bytes: int | None
    alias_bytes: int | None
    capacity_bytes: int | None
    buffers: tuple[PlannedBuffer, ...]
    products: tuple[PlannedProduct, ...]
    compile_seconds: float

    def __str__(self) -> str:
        def gib(n: int | None) -> str:
            if n is None:
                return "?"
            return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"

        head = f"plan for {self.target} ({self.chips} chip{'s' * (self.chips > 1)})"
        if self.refusal is not None:
            return f"{head}: refused by the compiler: {self.refusal}"
        lines = [
            f"{head}: peak {gib(self.peak_bytes)} per chip of {gib(self.capacity_bytes)}"
            f" ({'fits' if self.fits else 'does not fit'}); arguments {gib(self.argument_bytes)},"
            f" outputs {gib(self.output_bytes)}, temporaries {gib(self.temporary_bytes)},"
            f" aliased {gib(self.alias_bytes)}; compiled in {self.compile_seconds:.1f} s",
            "largest buffers live at the peak:",
        ]
        lines += [
            f"  {b.nbytes / 2**20:9.1f} MiB  {b.shape:28} {b.made_by[:44]:44} {b.where}"
            for b in self.buffers
        ]
        lines.append("products (dots and convolutions) by operand types:")
        lines += [f"  {p.count:4d} x {p.operands:16} {p.where}" for p in self.products]
        return "\n".join(lines)


def plan(
    fn: Callable,
    *args: Any,
    target: str,
    mesh: Mapping[str, int] | None = None,
    shardings: Sequence[Any] | None = None,
    buffers: int = 10,
    compiler_options: Mapping[str, Any] | None = None,
) -> Plan:
    """Compiles ``fn(*args)`` for ``target`` on this machine, with no TPU or GPU, and returns
    what the compiler planned: the peak memory per chip, the largest buffers live at the peak
    with the user's lines that made them, and what each product runs in.

    Args:
      fn: the step; a ``jax.jit``-wrapped function keeps its donation and static arguments,
        any other callable is jitted.
      *args: its arguments: arrays or ``jax.ShapeDtypeStruct`` trees (only shapes and dtypes
        are read; nothing is allocated on the target).
      target: ``"tpu-v5e"`` (one chip), ``"tpu-v5e:4x4"`` (a topology of 16 chips; v4,
        v5e, v5p and v6e, in multiples of a host's 2x2(x1) chips), ``"gpu-h100"``,
        ``"gpu-h200"``, ``"gpu-b200"`` (one GPU, from a description of public figures) or
        ``"cpu"`` (this machine). A TPU needs libtpu (``pip install "jax[tpu]"`` of the
        installed JAX's version), a GPU the CUDA plugin (``pip install "jax[cuda12]"``);
        start the process with ``JAX_PLATFORMS=cpu`` where there is no TPU or GPU.
      mesh: the mesh's axis names and sizes, their product the target's chips
        (``{"data": 4, "model": 4}``); default one axis ``"data"`` over every chip.
      shardings: one entry per argument of ``args``: a ``jax.sharding.PartitionSpec`` for the
        whole argument, a tree of them that is a prefix of the argument, or None to replicate
        it; default every argument replicated.
      buffers: how many of the largest buffers live at the peak to keep.
      compiler_options: passed to ``compile`` (XLA flags).

    Returns:
      A :class:`Plan`.

    Example (``target="tpu-v5e:4x4"`` the same, with libtpu installed):

    >>> import jax, jax.numpy as jnp, autocast
    >>> def loss(w, x):
    ...     return jnp.tanh(x @ w).sum()
    >>> step = jax.jit(jax.grad(autocast.amp(loss)))
    >>> w = jax.ShapeDtypeStruct((512, 512), jnp.float32)
    >>> x = jax.ShapeDtypeStruct((64, 512), jnp.float32)
    >>> p = autocast.plan(step, w, x, target="cpu")
    >>> p.fits, p.argument_bytes
    (True, 1179648)
    """
    return _planned(fn, args, target, mesh, shardings, buffers, compiler_options)[0]


def _planned(
    fn: Callable,
    args: tuple,
    target: str,
    mesh: Mapping[str, int] | None = None,
    shardings: Sequence[Any] | None = None,
    buffers: int = 10,
    compiler_options: Mapping[str, Any] | None = None,
) -> tuple[Plan, xla_program.Program | None]:
    """:func:`plan`'s work, with the compiled program as read from its dump (None where the
    compiler refused it): the benchmarks read its kernels too."""
    devices, capacity = _devices(target)
    axes = dict(mesh) if mesh is not None else {"data": len(devices)}
    _check_mesh(axes, len(devices), target)
    grid = jax.sharding.Mesh(
        np.array(devices[: int(np.prod(list(axes.values())))]).reshape(tuple(axes.values())),
        tuple(axes),
    )
    placed = _placed(args, shardings, grid)
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    options = dict(compiler_options or {})
    if target.startswith("gpu-"):
        options.setdefault("xla_gpu_autotune_level", 0)  # no device to time kernels on
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as dump, _compiled_afresh():
        lowered = jitted.lower(*placed)
        try:
            compiled = lowered.compile(compiler_options={**options, "xla_dump_to": dump})
        except Exception as e:  # noqa: BLE001 - XlaRuntimeError: the compiler's refusal
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            return Plan(
                target, grid.size, False, _refusal(str(e)), None, None, None, None, None,
                capacity, (), (), time.perf_counter() - start,
            ), None  # fmt: skip
        program = xla_program.read(dump)
    seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()
    peak = measure.planned_sum_bytes(memory)
    result = Plan(
        target=target,
        chips=grid.size,
        fits=peak is None or capacity is None or peak <= capacity,
        refusal=None,
        peak_bytes=peak,
        argument_bytes=None if memory is None else int(memory.argument_size_in_bytes),
        output_bytes=None if memory is None else int(memory.output_size_in_bytes),
        temporary_bytes=None if memory is None else int(memory.temp_size_in_bytes),
        alias_bytes=None if memory is None else int(memory.alias_size_in_bytes),
        capacity_bytes=capacity,
        buffers=tuple(
            PlannedBuffer(b.nbytes, b.shape, b.made_by, b.source)
            for b in program.peak_buffers[:buffers]
        ),
        products=tuple(
            PlannedProduct(types, where, n)
            for (types, where), n in xla_program.products_by_line(program).most_common()
        ),
        compile_seconds=seconds,
    )
    return result, program


@contextlib.contextmanager
def _compiled_afresh() -> Any:
    """XLA writes its dumps (the buffer assignment, the live ranges) only when it compiles: a
    program the persistent compilation cache holds comes back without them. JAX decides once
    per process whether it uses that cache, and forgets the decision on ``reset_cache``."""
    from jax.experimental.compilation_cache import compilation_cache

    held = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", held)
        compilation_cache.reset_cache()


def _devices(target: str) -> tuple[list[Any], int | None]:
    """The compile-only devices of ``target`` and one chip's memory in bytes."""
    if not isinstance(target, str):
        raise TypeError(
            f"plan: target must be a string, one of {', '.join(_TARGETS)}; got {target!r}"
        )
    name, _, topology = target.partition(":")
    if name == "cpu" and not topology:
        return jax.devices("cpu"), None
    kind, _, chip = name.partition("-")
    if kind == "tpu" and chip in _TPUS:
        return _tpu_devices(chip, topology), _TPUS[chip][2] * 2**30
    if kind == "gpu" and chip in _GPUS:
        if topology:
            raise ValueError(
                f"plan: target {target!r}: a GPU target is one GPU ({name!r}); a topology "
                "is taken for TPU targets only"
            )
        devices = _gpu_devices(chip)
        return devices, _gpu_memory(chip)
    raise ValueError(f"plan: unknown target {target!r}; targets: {', '.join(_TARGETS)}")


@functools.lru_cache(maxsize=None)
def _tpu_devices(chip: str, topology: str) -> list[Any]:
    from jax.experimental import topologies

    libtpu, host, _ = _TPUS[chip]
    if importlib.util.find_spec("libtpu") is None:
        raise ImportError(
            f"plan: a tpu-{chip} target needs libtpu, the TPU compiler: "
            f'pip install "jax[tpu]=={jax.__version__}" (and start with JAX_PLATFORMS=cpu on a '
            "machine without a TPU)"
        )
    if topology and not re.fullmatch(r"\d+x\d+(x\d+)?", topology):
        raise ValueError(
            f"plan: topology {topology!r} of tpu-{chip} is not AxB or AxBxC chips (a multiple "
            f"of one host's {host})"
        )
    try:
        description = topologies.get_topology_desc(
            topology_name=f"{libtpu}:{topology or host}", platform="tpu"
        )
    except Exception as e:  # noqa: BLE001 - libtpu's own refusal of a topology
        raise ValueError(
            f"plan: libtpu makes no {chip} topology {topology!r} (a multiple of one host's "
            f"{host} chips is needed): {str(e).splitlines()[0]}"
        ) from e
    devices = list(description.devices)
    return devices if topology else devices[:1]


@functools.lru_cache(maxsize=None)
def _gpu_devices(gpu: str) -> list[Any]:
    from jax.experimental import topologies

    config = (_DEVICES / _GPUS[gpu]).read_text() + "\n" + _cuda_versions()
    try:
        description = topologies.get_topology_desc(
            platform="cuda", target_config=config, topology="1x1x1"
        )
    except Exception as e:  # noqa: BLE001 - no CUDA plugin
        raise ImportError(
            f"plan: a gpu-{gpu} target needs JAX's CUDA plugin, the GPU compiler: "
            f'pip install "jax[cuda12]=={jax.__version__}" (and start with JAX_PLATFORMS=cpu on '
            f"a machine without a GPU); the plugin said: {str(e).splitlines()[0][:200]}"
        ) from e
    return list(description.devices)[:1]


def _gpu_memory(gpu: str) -> int:
    return description_field(gpu, "device_memory_size")


def description_field(gpu: str, field: str) -> int:
    """An integer field of ``gpu``'s device description (``memory_bandwidth``, ...)."""
    text = (_DEVICES / _GPUS[gpu]).read_text()
    return int(re.search(rf"{field}:\s*(\d+)", text).group(1))


def _cuda_versions() -> str:
    """The cuDNN and CUDA runtime versions of the installed plugin, as target-config text."""
    lines = []
    for package, field in (
        ("nvidia-cudnn-cu12", "dnn_version_info"),
        ("nvidia-cuda-runtime-cu12", "runtime_version"),
    ):
        try:
            major, minor, patch = (importlib.metadata.version(package).split(".") + ["0"] * 3)[:3]
        except importlib.metadata.PackageNotFoundError:
            continue
        lines.append(f"{field} {{ major: {major} minor: {minor} patch: {patch} }}")
    return "\n".join(lines)


def _check_mesh(axes: dict, chips: int, target: str) -> None:
    if not axes or not all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v > 0
        for k, v in axes.items()
    ):
        raise TypeError(
            f"plan: mesh must map axis names to positive sizes ({{'data': 4, 'model': 4}}); "
            f"got {axes!r}"
        )
    size = int(np.prod(list(axes.values())))
    if size > chips or (not target.startswith("cpu") and size != chips):
        raise ValueError(
            f"plan: mesh {axes!r} has {size} devices and {target!r} has {chips}: their sizes' "
            "product must be the target's chips"
        )


def _placed(args: tuple, shardings: Sequence[Any] | None, grid: jax.sharding.Mesh) -> tuple:
    P = jax.sharding.PartitionSpec
    if shardings is None:
        shardings = (None,) * len(args)
    if isinstance(shardings, P) or len(shardings) != len(args):
        raise ValueError(
            f"plan: shardings takes one entry per argument ({len(args)}: a PartitionSpec, a "
            f"tree of them or None each); got {shardings!r}"
        )

    def leaf(spec: Any, x: Any) -> Any:
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            return x
        where = jax.sharding.NamedSharding(grid, spec if spec is not None else P())
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where)

    def one(spec_tree: Any, arg: Any) -> Any:
        is_spec = lambda s: s is None or isinstance(s, P)  # noqa: E731
        if is_spec(spec_tree):
            return jax.tree_util.tree_map(functools.partial(leaf, spec_tree), arg)
        try:
            return jax.tree_util.tree_map(
                lambda spec, sub: jax.tree_util.tree_map(functools.partial(leaf, spec), sub),
                spec_tree,
                arg,
                is_leaf=is_spec,
            )
        except ValueError as e:
            raise ValueError(
                f"plan: a sharding tree must be a prefix of its argument's tree: {e}"
            ) from e

    return tuple(one(s, a) for s, a in zip(shardings, args))


def _refusal(message: str) -> str:
    """The line of a compiler's refusal that says what did not fit."""
    lines = [line.strip() for line in message.splitlines() if "exceed" in line or "HBM" in line]
    return (lines or [message.strip().splitlines()[0]])[0][:300]
