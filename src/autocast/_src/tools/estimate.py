"""A training step's time on a GPU, estimated from the program XLA compiled for it without
one (``make gpu-plan``).

The roofline: per kernel, the larger of its floating-point work over the device's peak rate
for the arithmetic it runs in and its bytes over the device's memory bandwidth, summed over
every kernel one step launches. No launch cost, no overlap, no cache, every kernel at the
device's peak for what bounds it: a floor. Beside the steps GPUs measured it came out at
0.39x to 0.77x of them, and it put float8 ahead of bfloat16 where the devices put it behind
(docs/benchmarks.md, "A time estimate from the plan").

The estimate adds what those steps showed the roofline leaves out, as two constants fitted
to the 16-bit steps alone (:data:`TENSOR_EFFICIENCY`, :data:`LAUNCH_SECONDS`): the matrix
kernels run at a fraction of the tensor cores' peak, and every launch costs a few
microseconds whatever it does. The float8 steps, which the fit did not see, are its check.
"""

from __future__ import annotations

import dataclasses

from autocast._src.tools import plan, xla_program

# Dense tensor-core peaks in FLOP/s by arithmetic (xla_program.MATH), from NVIDIA's published
# figures for the SXM parts: H100 and H200 are the same chip and differ in memory, whose
# bandwidth their device descriptions hold (autocast.plan's GPU targets).
_HOPPER = {"f8": 1979e12, "16-bit": 989.4e12, "tf32": 494.7e12, "f32": 66.9e12}
# B200 (HGX), dense: half of NVIDIA's figures with sparsity. Block-scaled MXFP8 GEMMs run at
# the f8 rate. No B200 step has been measured: the fitted constants below are Hopper's.
_BLACKWELL = {"f8": 4500e12, "16-bit": 2250e12, "tf32": 1100e12, "f32": 75e12}
PEAKS: dict[str, dict[str, float]] = {"h100": _HOPPER, "h200": _HOPPER, "b200": _BLACKWELL}


# The fraction of the tensor cores' peak the matrix kernels reach, and the time each launch
# costs besides its work: fitted (least squares on relative error, the bandwidth held at the
# device's) to the 12 bfloat16 steps measured on an H200 and an H100, and rounded; rerun by
# ``benchmarks/gpu_plan.py --measured``, which prints the fit beside these.
TENSOR_EFFICIENCY = 0.77
LAUNCH_SECONDS = 6.7e-6


def memory_bandwidth(gpu: str) -> float:
    """Bytes per second of ``gpu``'s memory, as its device description gives it."""
    _peaks(gpu)
    return float(plan.description_field(gpu, "memory_bandwidth"))


def _peaks(gpu: str) -> dict[str, float]:
    if gpu not in PEAKS:
        raise ValueError(f"no peak rates for GPU {gpu!r}; known: {', '.join(PEAKS)}")
    return PEAKS[gpu]


@dataclasses.dataclass(frozen=True)
class Estimate:
    """A step's roofline seconds, split into the kernels their arithmetic bounds (``matrix``:
    GEMMs, attention and convolutions at their peak rate) and those their bytes bound
    (``memory``); ``launches`` counts the kernels; and the estimate, which runs the matrix
    kernels at :data:`TENSOR_EFFICIENCY` of the peak and adds :data:`LAUNCH_SECONDS` a
    launch."""

    roofline_seconds: float
    matrix_seconds: float
    memory_seconds: float
    launches: int

    @property
    def seconds(self) -> float:
        return (
            self.matrix_seconds / TENSOR_EFFICIENCY
            + self.memory_seconds
            + self.launches * LAUNCH_SECONDS
        )


def step_time(program: xla_program.Program, gpu: str) -> Estimate:
    """The roofline and the estimate for one run of ``program`` on ``gpu`` (``"h100"`` or
    ``"h200"``). A kernel counts as matrix-bound where its FLOPs at the peak take longer
    than its bytes at the bandwidth.

    >>> from autocast._src.tools.estimate import memory_bandwidth
    >>> memory_bandwidth("h100") / 1e12
    3.35
    """
    rates = _peaks(gpu)
    bandwidth = memory_bandwidth(gpu)
    matrix = memory = 0.0
    launches = 0
    for k in program.kernels():
        compute = k.flops / rates[k.math] if k.flops else 0.0
        moved = (k.reads + k.writes) / bandwidth
        launches += k.runs
        if compute > moved:
            matrix += k.runs * compute
        else:
            memory += k.runs * moved
    return Estimate(matrix + memory, matrix, memory, launches)
