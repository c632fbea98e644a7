"""Reading a program XLA compiled for a GPU or TPU: its kernels, the bytes each moves, the
buffers live at its memory peak and the operand types of its products.

XLA writes what it decided into a dump folder (``xla_dump_to``): the optimised HLO module
(``*after_optimizations.txt``: every instruction with its shape, the kernel it became and the
Python line that made it) and the live ranges of its buffers (``*-live-range.txt``, with the
list of buffers live at the peak). :func:`read` turns the two into a :class:`Program`.

The kernels are the instructions that launch work on the device: fusions (XLA's own kernels,
Triton's GEMM fusions, cuDNN fusions), custom calls (cuBLAS(Lt) GEMMs, float8 ones among
them, cuDNN attention and convolutions) and the few unfused copies and collectives, in the
entry computation and in the bodies of its loops and branches (a loop body's kernels count
once per iteration where XLA knows the trip count). What a kernel reads is the sum of its
operands, what it writes the sum of its results (a GEMM's scratch workspace left out); a
matrix kernel also gives its floating-point operations and the arithmetic they run in.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Iterator

# Bytes per element of HLO's element types.
_ITEMSIZE = {
    "pred": 1, "s2": 1, "s4": 1, "s8": 1, "u2": 1, "u4": 1, "u8": 1,
    "f4e2m1fn": 1, "f8e3m4": 1, "f8e4m3": 1, "f8e4m3fn": 1, "f8e4m3b11fnuz": 1,
    "f8e4m3fnuz": 1, "f8e5m2": 1, "f8e5m2fnuz": 1, "f8e8m0fnu": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8,
    "c128": 16, "token": 0,
}  # fmt: skip
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
# Instructions that launch nothing: bookkeeping, control flow (its bodies are read instead),
# and what XLA folds into the buffers around it.
_NO_KERNEL = frozenset(
    {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional"}
    | {"call", "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency"}
    | {"domain", "iota-no-kernel"}
)
# Custom-call targets by kernel kind (prefixes).
_CUSTOM_CALLS = (
    ("__cublas$lt$matmul$f8", "float8 cuBLASLt GEMM"),
    ("__cublas$lt$matmul", "cuBLASLt GEMM"),
    ("__cublas$gemm", "cuBLAS GEMM"),
    ("__cudnn$fmha", "cuDNN attention"),
    ("__cudnn$conv", "cuDNN convolution"),
    ("__cudnn$norm", "cuDNN norm"),
)
# Fusion kinds XLA names in a fusion's backend config.
_FUSION_KINDS = {
    "__triton_gemm": "Triton GEMM fusion",
    "__triton_nested_gemm_fusion": "Triton GEMM fusion",
    "__triton_scaled_dot_fusion": "Triton GEMM fusion",
    "__triton": "Triton fusion",
    "__cudnn$fusion": "cuDNN fusion",
    "__custom_fusion": "address-computation fusion",
    "__dynamic_memcpy": "copy",
}
# Instructions that hand a value on unchanged (followed back to what made it).
_PASSING = frozenset({"bitcast", "copy", "get-tuple-element"})
GEMM_KINDS = ("float8 cuBLASLt GEMM", "cuBLASLt GEMM", "cuBLAS GEMM", "Triton GEMM fusion")


@dataclasses.dataclass(frozen=True)
class Array:
    dtype: str
    dims: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = _ITEMSIZE.get(self.dtype, 4)
        for d in self.dims:
            n *= d
        return n

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.dims))}]"


def arrays(shape: str) -> list[Array]:
    """The arrays of an HLO shape, a tuple's in order (``(f32[2], s8[64])`` gives two)."""
    return [
        Array(m.group(1), tuple(int(d) for d in m.group(2).split(",") if d))
        for m in _ARRAY.finditer(shape)
        if m.group(1) in _ITEMSIZE
    ]


@dataclasses.dataclass
class Instruction:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    arguments: str
    attributes: str
    computation: str

    @property
    def outputs(self) -> list[Array]:
        return arrays(self.shape)

    def attribute(self, key: str) -> str | None:
        m = re.search(rf"\b{re.escape(key)}=(%?[\w.$\-]+|\"[^\"]*\")", self.attributes)
        return None if m is None else m.group(1).strip('"').lstrip("%")

    @property
    def backend_config(self) -> dict:
        at = self.attributes.find("backend_config=")
        if at < 0:
            return {}
        text = self.attributes[at + len("backend_config=") :]
        try:
            return json.JSONDecoder().raw_decode(text)[0]
        except ValueError:
            return {}


def _matching(text: str, start: int) -> int:
    """The index just past the bracket that closes the one at ``start``."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = []
    quoted = False
    for i in range(start, len(text)):
        c = text[i]
        if c == '"' and (i == 0 or text[i - 1] != "\\"):
            quoted = not quoted
        if quoted:
            continue
        if c in pairs:
            stack.append(pairs[c])
        elif stack and c == stack[-1]:
            stack.pop()
            if not stack:
                return i + 1
    return len(text)


_HEAD = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")


def _instruction(line: str, computation: str) -> Instruction | None:
    m = _HEAD.match(line)
    if m is None:
        return None
    rest = line[m.end() :]
    if rest.startswith("("):
        end = _matching(rest, 0)
    else:
        end = rest.find(" ")
    shape, rest = rest[:end], rest[end:].lstrip()
    paren = rest.find("(")
    if paren < 0:
        return None
    opcode = rest[:paren].strip()
    close = _matching(rest, paren)
    arguments = rest[paren + 1 : close - 1]
    operands = re.findall(r"%([\w.\-]+)", arguments)
    return Instruction(m.group(1), shape, opcode, operands, arguments, rest[close:], computation)


@dataclasses.dataclass
class Kernel:
    """One kernel launch site: its kind, the instruction, how many times one step runs it,
    the bytes it reads and writes per run, what it says of itself (a GEMM's output type
    and scales), and for a matrix kernel (a GEMM, cuDNN's attention or convolution) the
    floating-point operations of one run and the arithmetic they run in (:data:`MATH`)."""

    kind: str
    name: str
    runs: int
    reads: int
    writes: int
    detail: str
    source: str
    flops: int = 0
    math: str = ""


@dataclasses.dataclass
class Buffer:
    """A buffer live at the memory peak: its size, shape, and what made it."""

    name: str
    nbytes: int
    shape: str
    made_by: str
    source: str


@dataclasses.dataclass
class Program:
    instructions: dict[str, Instruction]
    computations: dict[str, list[Instruction]]
    entry: str
    locations: dict[int, list[tuple[str, int, str]]]
    peak_buffers: list[Buffer]
    peak_bytes: int | None
    _read: list[Kernel] | None = dataclasses.field(default=None, repr=False, compare=False)

    def kernels(self) -> list[Kernel]:
        """The kernels one run launches, in launch order; read once, on the first call (the
        plan, its float8 listing and its time estimate all read them)."""
        if self._read is None:
            self._read = list(_kernels(self))
        return self._read

    def source(self, ins: Instruction) -> str:
        frame = ins.attribute("stack_frame_id")
        if frame:
            return _user_line(self.locations.get(int(frame), []))
        # older XLA (JAX 0.6) keeps one frame per instruction, the user's as JAX chose it
        path, line = ins.attribute("source_file"), ins.attribute("source_line")
        return f"{Path(path).name}:{line}" if path else ""


def _user_line(stack: list[tuple[str, int, str]]) -> str:
    """The innermost frame of ``stack`` (innermost first) in the user's code: not in an
    installed package and not in autocast itself; the innermost of all where none is."""
    for path, line, function in stack:
        if "site-packages" not in path and "/autocast/" not in path:
            return f"{Path(path).name}:{line} ({function})"
    if stack:
        path, line, function = stack[0]
        return f"{Path(path).name}:{line} ({function})"
    return ""


def _frames(text: str) -> dict[int, list[tuple[str, int, str]]]:
    """Stack frame id -> its stack, innermost first, from the module's FileNames,
    FunctionNames, FileLocations and StackFrames tables."""
    tables: dict[str, dict[int, str]] = {}
    current = None
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = tables.setdefault(line, {})
            continue
        if current is None:
            continue
        m = re.match(r"^(\d+)\s+(.*)$", line)
        if m is None:
            current = None
            continue
        current[int(m.group(1))] = m.group(2)
    files = {k: v.strip('"') for k, v in tables.get("FileNames", {}).items()}
    functions = {k: v.strip('"') for k, v in tables.get("FunctionNames", {}).items()}
    locations = {}
    for k, v in tables.get("FileLocations", {}).items():
        fields = dict(re.findall(r"(\w+)=(\d+)", v))
        locations[k] = (
            files.get(int(fields.get("file_name_id", 0)), "?"),
            int(fields.get("line", 0)),
            functions.get(int(fields.get("function_name_id", 0)), "?"),
        )
    parents, where = {}, {}
    for k, v in tables.get("StackFrames", {}).items():
        fields = dict(re.findall(r"(\w+)=(\d+)", v))
        where[k] = int(fields.get("file_location_id", 0))
        # printed one above the parent's id; 1 (printed) is no parent
        parents[k] = int(fields.get("parent_frame_id", 1)) - 1
    stacks = {}
    for k in where:
        stack, seen, frame = [], set(), k
        while frame in where and frame not in seen:
            seen.add(frame)
            if where[frame] in locations:
                stack.append(locations[where[frame]])
            frame = parents[frame]
        stacks[k] = stack
    return stacks


def _parse(text: str) -> tuple[dict[str, list[Instruction]], str]:
    computations: dict[str, list[Instruction]] = {}
    entry, current = "", None
    for line in text.splitlines():
        if not line.startswith(" ") and line.rstrip().endswith("{"):
            m = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)", line)
            if m:
                current = m.group(2)
                computations[current] = []
                if m.group(1):
                    entry = current
            continue
        if line.startswith("}"):
            current = None
            continue
        if current is not None:
            ins = _instruction(line, current)
            if ins is not None:
                computations[current].append(ins)
    return computations, entry


def _trip_count(ins: Instruction) -> int:
    n = ins.backend_config.get("known_trip_count", {}).get("n")
    return int(n) if n else 1


def _launching(program: Program) -> Iterator[tuple[Instruction, int]]:
    """Every instruction that runs as part of the entry computation or its control flow,
    with how many times one call runs it."""

    def walk(name: str, runs: int) -> Iterator[tuple[Instruction, int]]:
        for ins in program.computations.get(name, []):
            if ins.opcode == "while":
                n = runs * _trip_count(ins)
                yield from walk(ins.attribute("body") or "", n)
                yield from walk(ins.attribute("condition") or "", n)
            elif ins.opcode == "conditional":
                names = re.findall(r"%([\w.\-]+)", ins.attributes.split("branch_computations=")[-1])
                for branch in names:
                    if branch in program.computations:
                        yield from walk(branch, runs)
            elif ins.opcode == "call":
                yield from walk(ins.attribute("to_apply") or "", runs)
            else:
                yield ins, runs

    yield from walk(program.entry, 1)


def kind_of(ins: Instruction) -> str | None:
    """The kernel kind ``ins`` launches, or None for an instruction that launches none."""
    if ins.opcode in _NO_KERNEL:
        return None
    if ins.opcode == "custom-call":
        target = ins.attribute("custom_call_target") or ""
        for prefix, kind in _CUSTOM_CALLS:
            if target.startswith(prefix):
                return kind
        return f"custom call {target}"
    if ins.opcode == "fusion":
        config = ins.backend_config.get("fusion_backend_config", {})
        kind = config.get("kind")
        if kind in _FUSION_KINDS:
            return _FUSION_KINDS[kind]
        return "fusion"
    return ins.opcode


def _dot_in(program: Program, computation: str | None) -> Instruction | None:
    """The dot of a GEMM fusion, looked for through the fusions nested in it."""
    for ins in program.computations.get(computation or "", []):
        if ins.opcode in ("dot", "scaled-dot"):
            return ins
        if ins.opcode == "fusion":
            found = _dot_in(program, ins.attribute("calls"))
            if found is not None:
                return found
    return None


def _operand_types(program: Program, ins: Instruction) -> list[str]:
    types = []
    for name in ins.operands[:2]:
        producer = program.instructions.get(name)
        if producer is not None and producer.outputs:
            types.append(producer.outputs[0].dtype)
    return types


def products_by_line(program: Program) -> collections.Counter:
    """Every dot and convolution of the program, inside fusions too, by ``(its operand types
    ("bf16 x bf16"), the user's line)``, each counted once per appearance in the program (a
    loop body's once)."""
    counts: collections.Counter = collections.Counter()
    for ins in program.instructions.values():
        if ins.opcode in ("dot", "convolution", "scaled-dot"):
            counts[" x ".join(_operand_types(program, ins)), program.source(ins)] += 1
    return counts


def product_operand_types(program: Program) -> collections.Counter:
    """As :func:`products_by_line`, by operand types alone."""
    counts: collections.Counter = collections.Counter()
    for (types, _), n in products_by_line(program).items():
        counts[types] += n
    return counts


def _gemm_detail(program: Program, ins: Instruction, kind: str) -> str:
    """A GEMM's operand and output types and, for a float8 cuBLASLt one, its scale operands
    (the scalar ones): each a computed value (fused into the GEMM) or the constant 1 (applied
    by another kernel); and what else it fused, a bias vector or a matrix it adds to."""
    outs = ins.outputs
    out = outs[0].dtype if outs else "?"
    if kind == "Triton GEMM fusion":
        dot = _dot_in(program, ins.attribute("calls"))
        inputs = _operand_types(program, dot) if dot is not None else []
        return f"{'x'.join(inputs)} -> {out}"
    inputs = _operand_types(program, ins)
    detail = f"{'x'.join(inputs)} -> {out}"
    if kind == "float8 cuBLASLt GEMM":
        scales, extras = [], []
        for name in ins.operands[2:]:
            producer = program.instructions.get(name)
            if producer is None or not producer.outputs:
                continue
            if producer.outputs[0].dims:
                extras.append("bias" if len(producer.outputs[0].dims) == 1 else "adds C")
            elif producer.opcode == "constant":
                scales.append(producer.arguments.strip() or "constant")
            else:
                scales.append("fused")
        detail += f", scales {'/'.join(scales) or '-'}" + "".join(f", {e}" for e in extras)
    return detail


def _root(program: Program, computation: str | None) -> Instruction | None:
    body = program.computations.get(computation or "", [])
    return body[-1] if body else None


def _parameter_number(ins: Instruction) -> int | None:
    return int(ins.arguments) if ins.opcode == "parameter" and ins.arguments.isdigit() else None


def _traffic(program: Program, ins: Instruction, outs: list[Array]) -> tuple[int, int]:
    """``(read, written)`` bytes of one run of ``ins``. A fusion that only slices an operand
    (a loop body's dynamic slice of a stacked array) reads the slice; one whose result is a
    dynamic update of an operand (a loop stacking what it keeps) writes the update in place
    and reads nothing of the operand it updates. Both are found through the bitcasts XLA
    puts between the operand and the slice or update where it changes the stack's layout."""
    sizes = []
    for name in ins.operands:
        producer = program.instructions.get(name)
        sizes.append(sum(a.nbytes for a in producer.outputs) if producer is not None else 0)
    written = sum(a.nbytes for a in outs)
    if ins.opcode != "fusion":
        return sum(sizes), written
    fused = program.computations.get(ins.attribute("calls") or "", [])
    by_name = {f.name: f for f in fused}
    users: dict[str, list[Instruction]] = {}
    for f in fused:
        for o in f.operands:
            users.setdefault(o, []).append(f)
    root = fused[-1] if fused else None
    for f in fused:
        k = _parameter_number(f)
        if k is None or k >= len(sizes):
            continue
        sliced = _sliced_bytes(f.name, users)
        if sliced is not None:
            sizes[k] = sliced
        elif (
            root is not None
            and root.opcode == "dynamic-update-slice"
            and _bitcast_of(by_name, root.operands[0] if root.operands else "") == f.name
        ):
            sizes[k] = 0
            update = by_name.get(root.operands[1]) if len(root.operands) > 1 else None
            if update is not None:
                written = sum(a.nbytes for a in update.outputs)
    return sum(sizes), written


def _bitcast_of(by_name: dict[str, Instruction], name: str) -> str:
    """``name``, or the instruction its chain of bitcasts starts from."""
    ins = by_name.get(name)
    while ins is not None and ins.opcode == "bitcast" and ins.operands:
        name = ins.operands[0]
        ins = by_name.get(name)
    return name


def _sliced_bytes(name: str, users: dict[str, list[Instruction]]) -> int | None:
    """The bytes a fusion reads of its parameter ``name`` where it reads only dynamic slices
    of it, looked for through the bitcasts XLA puts between (a layer's weight sliced out of
    the scan's stack after a change of layout); None where it reads more."""
    uses = users.get(name, [])
    if not uses:
        return None
    total = 0
    for u in uses:
        if u.opcode == "bitcast":
            inner = _sliced_bytes(u.name, users)
            if inner is None:
                return None
            total += inner
        elif u.opcode == "dynamic-slice" and u.operands[0] == name:
            total += sum(a.nbytes for a in u.outputs)
        else:
            return None
    return total


def _kernels(program: Program) -> Iterator[Kernel]:
    for ins, runs in _launching(program):
        kind = kind_of(ins)
        if kind is None:
            continue
        outs = ins.outputs
        if kind in GEMM_KINDS and len(outs) > 1 and outs[-1].dtype == "s8":
            outs = outs[:-1]  # the GEMM's workspace
        reads, written = _traffic(program, ins, outs)
        detail = _gemm_detail(program, ins, kind) if kind in GEMM_KINDS else ""
        flops, math = _work(program, ins, kind)
        yield Kernel(kind, ins.name, runs, reads, written, detail, program.source(ins), flops, math)


# The arithmetic a matrix kernel runs in, by its first operand's element type: each has a
# peak rate of its own on a GPU (benchmarks' device tables). A float32 product runs in TF32
# on the tensor cores unless it asks for exact sums (precision HIGHEST).
MATH = ("f8", "16-bit", "tf32", "f32")
_MATH_OF = {"bf16": "16-bit", "f16": "16-bit", "f32": "tf32"}


def _math(dtype: str, precision: str) -> str:
    if dtype in _FLOAT8:
        return "f8"
    math = _MATH_OF.get(dtype, "f32")
    return "f32" if math == "tf32" and "highest" in precision.lower() else math


def _product_flops(out: Array, lhs: Array, contracting: list[int]) -> int:
    """2 x output elements x the contracted extent."""
    k = 1
    for d in contracting:
        k *= lhs.dims[d] if d < len(lhs.dims) else 1
    return 2 * _elements([out]) * k


def _dims(text: str) -> list[int]:
    return [int(d) for d in re.findall(r"\d+", text)]


def _output_shape_of(program: Program, name: str) -> Array | None:
    producer = program.instructions.get(name)
    return producer.outputs[0] if producer is not None and producer.outputs else None


def _dot_work(program: Program, dot: Instruction) -> tuple[int, str]:
    lhs = program.instructions.get(dot.operands[0]) if dot.operands else None
    if lhs is None or not lhs.outputs or not dot.outputs:
        return 0, ""
    contracting = _dims(dot.attributes.partition("lhs_contracting_dims={")[2].split("}")[0])
    precision = dot.attributes.split("operand_precision={", 1)[-1][:40]
    flops = _product_flops(dot.outputs[0], lhs.outputs[0], contracting)
    return flops, _math(lhs.outputs[0].dtype, precision)


def _work(program: Program, ins: Instruction, kind: str) -> tuple[int, str]:
    """``(FLOPs, math)`` of one run of a matrix kernel; ``(0, "")`` for any other."""
    if kind in ("Triton GEMM fusion", "cuDNN fusion"):
        dot = _dot_in(program, ins.attribute("calls"))
        return _dot_work(program, dot) if dot is not None else (0, "")
    if kind in ("float8 cuBLASLt GEMM", "cuBLASLt GEMM", "cuBLAS GEMM"):
        config = ins.backend_config.get("gemm_backend_config", {})
        numbers = config.get("dot_dimension_numbers", {})
        lhs = _output_shape_of(program, ins.operands[0]) if ins.operands else None
        if lhs is None or not ins.outputs:
            return 0, ""
        contracting = [int(d) for d in numbers.get("lhs_contracting_dimensions", [])]
        precision = " ".join(config.get("precision_config", {}).get("operand_precision", []))
        return _product_flops(ins.outputs[0], lhs, contracting), _math(lhs.dtype, precision)
    if kind == "cuDNN attention":
        return _attention_work(program, ins)
    if kind == "cuDNN convolution":
        return _convolution_work(program, ins)
    return 0, ""


def _attention_work(program: Program, ins: Instruction) -> tuple[int, str]:
    """cuDNN's fused attention: two products of ``batch x heads x queries x keys x head
    dim`` forward, five backward (the scores recomputed, then the gradients of the values,
    the probabilities, the queries and the keys), half of them under a causal mask."""
    config = ins.backend_config.get("cudnn_fmha_backend_config", {})
    scores = [int(d) for d in config.get("intermediate_tensor_shape", {}).get("dimensions", [])]
    q = _output_shape_of(program, ins.operands[0]) if ins.operands else None
    if not scores or q is None:
        return 0, ""
    # the head dimension: what the scores contract the queries over (forward), else the
    # queries' last dimension (the backward kernel names no such product)
    numbers = config.get("bmm1_dot_dimension_numbers", {})
    contracted = [int(d) for d in numbers.get("lhs_contracting_dimensions", [])] or [-1]
    head = 1
    for d in contracted:
        head *= q.dims[d]
    products = 5 if "Backward" in (ins.attribute("custom_call_target") or "") else 2
    flops = 2 * products * _elements([Array("bf16", tuple(scores))]) * head
    if config.get("mask_type", "").startswith("CAUSAL"):
        flops //= 2
    return flops, _math(q.dtype, "")


def _convolution_work(program: Program, ins: Instruction) -> tuple[int, str]:
    """A cuDNN convolution, forward or either backward one: 2 x the forward output's
    elements x the filter's elements over its output features (the window and the input
    features of a group), whichever of the three this kernel computes."""
    target = ins.attribute("custom_call_target") or ""
    labels = ins.attribute("dim_labels") or ""
    filter_labels = labels.split("_", 1)[-1].split("->")[0]
    shapes = [_output_shape_of(program, n) for n in ins.operands[:2]]
    if None in shapes or not ins.outputs or "o" not in filter_labels:
        return 0, ""
    (first, second), result = shapes, ins.outputs[0]
    if "BackwardInput" in target:
        output, kernel = first, second
    elif "BackwardFilter" in target:
        output, kernel = second, result
    else:
        output, kernel = result, second
    features = kernel.dims[filter_labels.index("o")]
    flops = 2 * _elements([output]) * (_elements([kernel]) // max(features, 1))
    return flops, _math(first.dtype, "")


def _peak(text: str) -> tuple[list[tuple[str, int]], int | None]:
    """The buffers live at the peak, ``(instruction{index}, bytes)``, and the peak itself."""
    buffers, peak, inside = [], None, False
    for line in text.splitlines():
        if "(peak):" in line:
            inside = True
            continue
        if inside:
            m = re.match(r"^\s+([\w.\-]+)\{([\d,]*)\}:\s+(\d+) bytes", line)
            if m is None:
                inside = False
            else:
                buffers.append((f"{m.group(1)}{{{m.group(2)}}}", int(m.group(3))))
                continue
        m = re.search(r"Stack trace breakdown for peak usage: ([\d ]+) bytes", line)
        if m:
            peak = int(m.group(1).replace(" ", ""))
    return buffers, peak


def _placements(text: str) -> dict[str, tuple[int, int]]:
    """``instruction{index}`` -> ``(allocation, offset)`` of each value, from XLA's buffer
    assignment: values at one place and live together are one buffer under several names (a
    loop's output is its body's result, updated in place)."""
    places, allocation = {}, -1
    for line in text.splitlines():
        m = re.match(r"^allocation (\d+):", line)
        if m:
            allocation = int(m.group(1))
            continue
        m = re.match(
            r"^\s*value: <\d+ ([\w.\-]+)(\{[\d,]*\})?(?: \(phi\))? @\d+> "
            r"\(size=\d+,offset=(\d+)\)",
            line,
        )
        if m:
            places[m.group(1) + (m.group(2) or "{}")] = (allocation, int(m.group(3)))
    return places


def _distinct(
    live: list[tuple[str, int]], places: dict[str, tuple[int, int]], program: Program
) -> list[tuple[str, int]]:
    """``live`` with each buffer once, under its most telling name: the value a loop or a
    tuple merely passes on is the one its body made."""

    def telling(name: str) -> int:
        ins = program.instructions.get(name.split("{")[0])
        return 1 if ins is None or ins.opcode in ("while", "tuple", "parameter") else 0

    chosen: dict[Any, tuple[str, int]] = {}
    for name, nbytes in live:
        place = places.get(name, name)
        if place not in chosen or telling(name) < telling(chosen[place][0]):
            chosen[place] = (name, nbytes)
    return sorted(chosen.values(), key=lambda b: -b[1])


def _buffer(program: Program, name: str, nbytes: int) -> Buffer:
    base, index = name.split("{")
    index = index.rstrip("}")
    ins = program.instructions.get(base)
    if ins is None:
        return Buffer(base, nbytes, "?", "?", "")
    outs = ins.outputs
    shape = (
        str(outs[int(index.split(",")[0])])
        if index and len(outs) > 1
        else (str(outs[0]) if outs else "?")
    )
    stacked = _stacked_value(program, ins)
    if stacked is not None:
        described = _buffer_origin(program, stacked)
        return Buffer(base, nbytes, shape, f"stacked by a loop: {described[0]}", described[1])
    made_by, source = _buffer_origin(program, ins)
    return Buffer(base, nbytes, shape, made_by, source)


def _stacked_value(program: Program, ins: Instruction) -> Instruction | None:
    """For a fusion that writes one slice of a stacked array per loop iteration (what a
    scan keeps for its backward pass), the instruction that made the slice."""
    if ins.opcode != "fusion":
        return None
    fused = program.computations.get(ins.attribute("calls") or "", [])
    root = fused[-1] if fused else None
    if root is None or root.opcode != "dynamic-update-slice" or len(root.operands) < 2:
        return None
    inner = {f.name: f for f in fused}
    update = _through(inner, inner.get(root.operands[1]))
    k = None if update is None else _parameter_number(update)
    if k is not None and k < len(ins.operands):
        return _through(program.instructions, program.instructions.get(ins.operands[k]))
    return update


def _through(instructions: dict[str, Instruction], ins: Instruction | None) -> Instruction | None:
    """What made ``ins``, past the instructions that hand a value on unchanged."""
    while ins is not None and ins.opcode in _PASSING and ins.operands:
        ins = instructions.get(ins.operands[0], None) or ins
        if ins.opcode in _PASSING and ins.operands and ins.operands[0] not in instructions:
            break
    return ins


def _buffer_origin(program: Program, ins: Instruction) -> tuple[str, str]:
    op_name = (ins.attribute("op_name") or "").replace("\\'", "'")  # HLO text escapes quotes
    if ins.opcode == "parameter" and ins.computation == program.entry:
        made_by = f"argument {op_name or ins.name}"
    else:
        # the primitive, with the transformation it sat under (jvp: the forward pass,
        # transpose: the backward pass)
        parts = [p for p in op_name.split("/") if p]
        phase = "backward " if any(p.startswith("transpose(") for p in parts) else ""
        made_by = f"{phase}{parts[-1] if parts else ins.opcode}"
    return made_by, program.source(ins)


def read(folder: str | Path) -> Program:
    """The program XLA dumped into ``folder`` (one compiled module)."""
    folder = Path(folder)
    (hlo,) = sorted(folder.glob("*after_optimizations.txt"))
    text = hlo.read_text()
    computations, entry = _parse(text)
    instructions = {ins.name: ins for body in computations.values() for ins in body}
    ranges, assignment = (
        [f.read_text() for f in sorted(folder.glob(f"*after_optimizations-{kind}.txt"))]
        for kind in ("live-range", "buffer-assignment")
    )
    program = Program(instructions, computations, entry, _frames(text), [], None)
    # JAX 0.6's XLA writes the live ranges at the end of the buffer assignment
    ranges = ranges or [a for a in assignment if "Live ranges at" in a]
    if ranges:
        live, _ = _peak(ranges[0])
        if assignment:
            live = _distinct(live, _placements(assignment[0]), program)
        program.peak_buffers = [_buffer(program, n, b) for n, b in live]
        program.peak_bytes = sum(b for _, b in live)
    return program


# ---- float8 read-outs --------------------------------------------------------------------------

_FLOAT8 = frozenset(t for t in _ITEMSIZE if t.startswith("f8"))
# What a fusion that only rescales or converts an array computes.
_SCALING = frozenset(
    {"parameter", "constant", "broadcast", "bitcast", "reshape", "copy", "convert"}
    | {"multiply", "divide", "get-tuple-element", "tuple"}
)


def _elements(arrays: list[Array]) -> int:
    return sum(a.nbytes // _ITEMSIZE[a.dtype] for a in arrays)


def _arrays_read(program: Program, ins: Instruction) -> list[Array]:
    read = []
    for name in ins.operands:
        producer = program.instructions.get(name)
        read += [a for a in producer.outputs if a.dims] if producer is not None else []
    return read


def _made_by(program: Program, name: str) -> Instruction | None:
    ins = program.instructions.get(name)
    while ins is not None and ins.opcode in ("bitcast", "get-tuple-element") and ins.operands:
        ins = program.instructions.get(ins.operands[0])
    return ins


def float8_passes(program: Program) -> dict[str, int]:
    """Launches per step of the float8 kernels that are neither a GEMM nor a quantisation:
    ``copies``, kernels that read float8 arrays only and write as many float8 elements (a
    quantised tensor transposed into the layout a GEMM needs), and ``scalings``, fusions
    that read a float8 GEMM's result and only multiply or convert it (the scales applied
    after the GEMM instead of by it)."""
    counts = {"copies": 0, "scalings": 0}
    for ins, runs in _launching(program):
        kind = kind_of(ins)
        if kind is None or kind in GEMM_KINDS:
            continue
        read, written = _arrays_read(program, ins), [a for a in ins.outputs if a.dims]
        if (
            read
            and written
            and all(a.dtype in _FLOAT8 for a in read + written)
            and _elements(read) == _elements(written)
        ):
            counts["copies"] += runs
            continue
        if ins.opcode != "fusion":
            continue
        producers = [_made_by(program, name) for name in ins.operands]
        after_gemm = any(p is not None and kind_of(p) == "float8 cuBLASLt GEMM" for p in producers)
        body = program.computations.get(ins.attribute("calls") or "", [])
        opcodes = {f.opcode for f in body}
        if after_gemm and opcodes <= _SCALING and opcodes & {"multiply", "divide"}:
            counts["scalings"] += runs
    return counts


# The passes that prepare float8 operands, in the order the plan prints them.
PREPARATIONS = ("amax", "quantise", "quantise, transposed")
_PASSED_ON = frozenset({"convert", "bitcast", "reshape", "copy"})


def _max_of_magnitudes(program: Program, body: list[Instruction]) -> bool:
    """Whether a fusion body max-reduces an ``abs`` (through conversions and reshapes)."""
    by_name = {f.name: f for f in body}
    for f in body:
        region = program.computations.get(f.attribute("to_apply") or "", [])
        if f.opcode != "reduce" or not any(r.opcode == "maximum" for r in region):
            continue
        operand = by_name.get(f.operands[0]) if f.operands else None
        while operand is not None and operand.opcode in _PASSED_ON and operand.operands:
            operand = by_name.get(operand.operands[0])
        if operand is not None and operand.opcode == "abs":
            return True
    return False


def _preparation(program: Program, ins: Instruction, amaxes: set[str]) -> str | None:
    """Which of :data:`PREPARATIONS` a kernel is, or None."""
    if ins.opcode != "fusion":
        return None
    read, outs = _arrays_read(program, ins), ins.outputs
    if not read:
        return None
    f8_in = [a for a in read if a.dtype in _FLOAT8]
    f8_out = [a for a in outs if a.dtype in _FLOAT8]
    body = program.computations.get(ins.attribute("calls") or "", [])
    if f8_out and len(f8_out) == len(outs) and not f8_in:
        # every output float8 and none read: the kernel exists to quantise a value that
        # another kernel computed
        return "quantise, transposed" if any(f.opcode == "transpose" for f in body) else "quantise"
    if f8_out or _elements(outs) * 16 > _elements(read):
        return None
    producers = [_made_by(program, name) for name in ins.operands]
    # the second stage of a two-stage amax reads only what a first stage wrote
    arrays = [p for p in producers if p is not None and p.outputs and p.outputs[0].dims]
    second_stage = bool(arrays) and all(p.name in amaxes for p in arrays)
    return "amax" if _max_of_magnitudes(program, body) or second_stage else None


def float8_preparation(program: Program) -> dict[str, dict[str, float]]:
    """Per step, the kernels that only prepare float8 operands, by what they do (see
    :data:`PREPARATIONS`), each with its launches and the MiB it reads and writes: ``amax``
    (a reduction to the largest magnitude that writes nothing else, and the second stage of
    one), ``quantise`` (a wider array another kernel computed, written as float8),
    and ``quantise, transposed`` (the same, into the transposed layout a GEMM needs); a
    float8 array copied into another layout is one of :func:`float8_passes`' copies. A
    quantisation or amax done inside the fusion that computes the value is none of them:
    that is the pass saved."""
    found = {kind: {"launches": 0, "read_mib": 0.0, "written_mib": 0.0} for kind in PREPARATIONS}
    amaxes: set[str] = set()
    for k in program.kernels():  # in launch order: an amax's first stage before its second
        if k.kind in GEMM_KINDS:
            continue
        what = _preparation(program, program.instructions[k.name], amaxes)
        if what is None:
            continue
        if what == "amax":
            amaxes.add(k.name)
        row = found[what]
        row["launches"] += k.runs
        row["read_mib"] += k.runs * k.reads / 2**20
        row["written_mib"] += k.runs * k.writes / 2**20
    return found
