"""jax-autocast: automatic mixed precision for JAX.

``amp(fn)`` runs a JAX function's matrix work in bfloat16 or float16 and keeps the delicate
parts in float32, through ``jit``, ``grad`` and ``vmap``. Policies and casting helpers
(``Policy``, ``get_policy``, ``cast_to_half``, ...) and loss-scale objects
(``DynamicLossScale``, ``all_finite``, ...) keep the names of ``jaxamp`` and ``jmp``, so
code written for them ports by changing its import line. ``amp(fn, compute_dtype="fp8")``
runs the matrix products in float8 with per-tensor scaling. ``diagnose(fn)`` finds the equation,
and the line, where mixed precision lost accuracy or overflowed. Loss scaling for float16 training:
``DynamicScalerState`` with ``dynamic_scale_value_and_grad``, or ``autocast.optax`` (optional).
"""

from autocast._src.fp8.history import DelayedFp8, Fp8History, amp_fp8_delayed
from autocast._src.fp8.products import use_fp8_precision
from autocast._src.policy.dtypes import (
    Policy,
    cast_to_full,
    cast_to_half,
    cast_tree,
    get_policy,
    half_dtype,
    parse_dtype,
)
from autocast._src.policy.precision import (
    use_compute_precision,
    use_full_precision,
    use_input_precision,
    use_original_precision,
    use_own_precision,
    use_precision,
    use_widest_precision,
)
from autocast._src.policy.table import (
    DEFAULT_PRECISION_TABLE,
    default_amp_policy,
    describe_default_policy,
)
from autocast._src.scaling.core import (
    LossScaleUpdate,
    ScalingHealth,
    all_finite,
    check_not_stalled,
    next_loss_scale,
    nonfinite_leaves,
    nonfinite_paths,
    select_tree,
    stalled,
)
from autocast._src.scaling.jaxamp import (
    DynamicScalerState,
    dynamic_scale_grad,
    dynamic_scale_tx,
    dynamic_scale_value_and_grad,
)
from autocast._src.scaling.jmp import DynamicLossScale, LossScale, NoOpLossScale, StaticLossScale
from autocast._src.tools.diagnose import Diagnosis, Entry, diagnose
from autocast._src.tools.plan import Plan, PlannedBuffer, PlannedProduct, plan
from autocast._src.tools.report import Report, report
from autocast._src.transform.amp import amp, amp_stop
from autocast._src.transform.entry_points import in_compute_dtype

__version__ = "0.1.0.dev0"

__all__ = [
    "DEFAULT_PRECISION_TABLE",
    "DelayedFp8",
    "Diagnosis",
    "DynamicLossScale",
    "DynamicScalerState",
    "Entry",
    "Fp8History",
    "LossScale",
    "LossScaleUpdate",
    "NoOpLossScale",
    "Plan",
    "PlannedBuffer",
    "PlannedProduct",
    "Policy",
    "Report",
    "ScalingHealth",
    "StaticLossScale",
    "all_finite",
    "amp",
    "amp_fp8_delayed",
    "amp_stop",
    "cast_to_full",
    "cast_to_half",
    "cast_tree",
    "check_not_stalled",
    "default_amp_policy",
    "diagnose",
    "describe_default_policy",
    "dynamic_scale_grad",
    "dynamic_scale_tx",
    "dynamic_scale_value_and_grad",
    "get_policy",
    "half_dtype",
    "in_compute_dtype",
    "next_loss_scale",
    "nonfinite_leaves",
    "nonfinite_paths",
    "parse_dtype",
    "plan",
    "report",
    "select_tree",
    "stalled",
    "use_compute_precision",
    "use_fp8_precision",
    "use_full_precision",
    "use_input_precision",
    "use_original_precision",
    "use_own_precision",
    "use_precision",
    "use_widest_precision",
]
