"""autocast's implementation, by concern; the public face is ``autocast/__init__.py``.

- ``transform``: ``amp`` itself. ``amp`` traces the function (``amp.py``); the interpreter
  evaluates its jaxpr one equation at a time under the policy and owns the registry of
  higher-order handlers, which ``handlers.py`` fills, one function per primitive; ``retrace``
  re-traces sub-jaxprs for the dtypes their inputs have; ``regions`` gathers float32
  elementwise work into checkpointed regions stored in 16 bits; ``closures`` makes what
  custom rules close over explicit; ``entry_points`` runs dtype-dispatching functions (fused
  attention) in the compute dtype; ``writes`` carries a Flax NNX module's writes out of
  amp's trace to the caller's variables.
- ``policy``: what runs in which dtype: the default table (``table``), the precision
  functions (``precision``), casting (``casting``), and jmp's dtype ``Policy`` (``dtypes``).
- ``scaling``: loss scaling: one core (``core``: the rule, the floor, the health counters,
  finiteness), and thin faces: jmp's loss-scale objects (``jmp``), jaxamp's
  ``DynamicScalerState`` and ``dynamic_scale_*`` (``jaxamp``), optax's wrapper (``optax``).
- ``fp8``: the float8 recipes (a scale per tensor, per row or per block; delayed scaling),
  plugged into the policy table.
- ``tools``: the precision report, the numerics debugger (``diagnose``, with the paired
  evaluation and provenance walk it uses), and the measures they share.
- ``demo``: the main job (``python -m autocast demo``) and its small models.

``autocast/_compat.py`` is the one place that touches JAX's internals or differs by version.
"""
