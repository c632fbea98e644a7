"""Precision policies: the dtypes that parameters, computation and outputs use.

A :class:`Policy` says which dtype the parameters are stored in, which dtype the computation
runs in and which dtype the outputs are returned in. :func:`get_policy` reads the short string
form (``"p=f32,c=bf16"``) that ``jmp`` made familiar. All casting helpers touch only the
floating-point array leaves of a pytree: integer, boolean and non-array leaves pass through.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import jax.numpy as jnp
import numpy as np

from autocast._src.policy.target import Target, target_of
from autocast._src.tree import map_floating

T = TypeVar("T")

# Every fixed spelling parse_dtype understands ("half" is not fixed: it means half_dtype(), as
# in jmp), and the canonical short name str(Policy) prints.
_DTYPE_ALIASES: dict[str, np.dtype] = {
    "f32": np.dtype(jnp.float32),
    "float32": np.dtype(jnp.float32),
    "full": np.dtype(jnp.float32),
    "f16": np.dtype(jnp.float16),
    "float16": np.dtype(jnp.float16),
    "bf16": np.dtype(jnp.bfloat16),
    "bfloat16": np.dtype(jnp.bfloat16),
    "f64": np.dtype(jnp.float64),
    "float64": np.dtype(jnp.float64),
}
_SHORT_NAMES: dict[np.dtype, str] = {
    np.dtype(jnp.float32): "f32",
    np.dtype(jnp.float16): "f16",
    np.dtype(jnp.bfloat16): "bf16",
    np.dtype(jnp.float64): "f64",
}
_POLICY_KEYS: dict[str, str] = {
    "p": "param_dtype",
    "params": "param_dtype",
    "c": "compute_dtype",
    "compute": "compute_dtype",
    "o": "output_dtype",
    "output": "output_dtype",
}
_SHORT_KEYS = {"param_dtype": "p", "compute_dtype": "c", "output_dtype": "o"}


def _accepted_dtype_names() -> str:
    return ", ".join([*_DTYPE_ALIASES, "half"])


def canonicalize_float_dtype(dtype: Any, *, what: str = "dtype") -> np.dtype:
    """Turns anything ``jnp.dtype`` understands into a NumPy dtype, insisting it is floating.

    Strings go through :func:`parse_dtype`, so ``"bf16"`` works wherever a dtype is asked for.
    """
    if isinstance(dtype, str):
        return parse_dtype(dtype)
    try:
        result = np.dtype(jnp.dtype(dtype))
    except TypeError as e:
        raise TypeError(
            f"{what} must be a floating-point dtype such as jnp.bfloat16 or 'bf16', got {dtype!r}"
        ) from e
    if not jnp.issubdtype(result, jnp.floating):
        raise TypeError(
            f"{what} must be a floating-point dtype (float16, bfloat16, float32, float64, ...), "
            f"got {result.name}"
        )
    return result


def parse_dtype(value: str) -> np.dtype:
    """Parses a dtype name such as ``"bf16"``, ``"float32"`` or ``"half"`` into a NumPy dtype.

    Accepted names: ``f32``/``float32``/``full``, ``f16``/``float16``,
    ``bf16``/``bfloat16``, ``f64``/``float64`` and ``half``, plus the NumPy name of any
    other floating dtype (``"float8_e4m3fn"``). Case and surrounding whitespace are ignored.
    As in ``jmp``, ``"half"`` means :func:`half_dtype`, the backend's preferred 16-bit type
    (bfloat16 on CPU and TPU), not necessarily IEEE float16.

    Args:
        value: The name to parse.

    Returns:
        The floating ``numpy.dtype`` the name stands for.

    Raises:
        TypeError: If ``value`` is not a string.
        ValueError: If ``value`` is empty or blank, names no dtype, or names a dtype that is
            not floating-point (``"int8"``).

    Example:
        >>> import autocast
        >>> autocast.parse_dtype("bf16")
        dtype(bfloat16)
        >>> autocast.parse_dtype(" Float32 ")
        dtype('float32')
        >>> autocast.parse_dtype("half") == autocast.half_dtype()
        True
    """
    if not isinstance(value, str):
        raise TypeError(f"parse_dtype expects a string such as 'bf16', got {type(value).__name__}")
    name = value.strip().lower()
    if not name:
        raise ValueError(f"empty dtype name; accepted names: {_accepted_dtype_names()}")
    if name in _DTYPE_ALIASES:
        return _DTYPE_ALIASES[name]
    if name == "half":
        return half_dtype()
    try:
        dtype = np.dtype(jnp.dtype(name))
    except TypeError:
        # Capitalised as jmp writes it: code that matches on jmp's message keeps working.
        raise ValueError(
            f"Unknown dtype {value!r}; accepted names: {_accepted_dtype_names()} "
            "(or the NumPy name of another floating dtype)"
        ) from None
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(
            f"dtype {value!r} is not floating-point; accepted names: {_accepted_dtype_names()}"
        )
    return dtype


def half_dtype_for(target: Target) -> np.dtype:
    """The 16-bit float ``target`` runs fastest: float16 only where bfloat16 arithmetic is
    missing, on NVIDIA GPUs before Ampere (compute capability 8.0)."""
    capability = target.nvidia_capability
    if capability is not None and capability < (8, 0):
        return np.dtype(jnp.float16)
    return np.dtype(jnp.bfloat16)


def half_dtype() -> np.dtype:
    """The 16-bit float the current device runs fastest: bfloat16, or float16 on old GPUs.

    bfloat16 on TPU, CPU and GPUs that have bfloat16 arithmetic (NVIDIA Ampere and newer, AMD);
    float16 on NVIDIA GPUs older than Ampere. The device is the one of the mesh set by
    ``jax.set_mesh`` where that mesh names its devices, else JAX's default device,
    ``jax.devices()[0]``, read at each call. :func:`autocast.amp` decides the same way for
    the device its arguments are placed on (a TPU step planned from a CPU gets the TPU's
    answer).

    Returns:
        ``numpy.dtype(jnp.bfloat16)`` or ``numpy.dtype(jnp.float16)``.

    Example:
        >>> import autocast, jax.numpy as jnp
        >>> autocast.half_dtype() in (jnp.bfloat16, jnp.float16)
        True
    """
    return half_dtype_for(target_of())


def cast_tree(dtype: Any, tree: T) -> T:
    """Casts every floating-point array leaf of ``tree`` to ``dtype``; other leaves pass through.

    Floating-point array leaves are JAX and NumPy arrays and NumPy scalars of a real floating
    dtype, float64 included. Integer, boolean and complex arrays, Python numbers and every other
    leaf are returned as they are.

    Args:
        dtype: The floating dtype to cast to: a dtype (``jnp.bfloat16``) or a name
            :func:`parse_dtype` accepts (``"bf16"``).
        tree: Any pytree.

    Returns:
        A pytree of the same structure, with its floating-point array leaves in ``dtype``.

    Raises:
        TypeError: If ``dtype`` is not a floating dtype.
        ValueError: If ``dtype`` is a string that names no floating dtype.

    Example:
        >>> import autocast, jax.numpy as jnp
        >>> tree = {"w": jnp.ones(2), "step": jnp.int32(3), "name": "x"}
        >>> out = autocast.cast_tree(jnp.bfloat16, tree)
        >>> out["w"].dtype, out["step"].dtype, out["name"]
        (dtype(bfloat16), dtype('int32'), 'x')
    """
    dtype = canonicalize_float_dtype(dtype)
    return map_floating(lambda x: x if x.dtype == dtype else x.astype(dtype), tree)


def cast_to_full(tree: T) -> T:
    """Casts the floating-point leaves of ``tree`` to float32.

    ``cast_tree(jnp.float32, tree)``: see :func:`cast_tree` for which leaves are cast.

    Args:
        tree: Any pytree.

    Returns:
        A pytree of the same structure, with its floating-point array leaves in float32.

    Example:
        >>> import autocast, jax.numpy as jnp
        >>> autocast.cast_to_full(jnp.ones(2, jnp.bfloat16)).dtype
        dtype('float32')
    """
    return cast_tree(jnp.float32, tree)


def cast_to_half(tree: T) -> T:
    """Casts the floating-point leaves of ``tree`` to :func:`half_dtype`.

    ``cast_tree(half_dtype(), tree)``: see :func:`cast_tree` for which leaves are cast.

    Args:
        tree: Any pytree.

    Returns:
        A pytree of the same structure, with its floating-point array leaves in bfloat16, or
        float16 where :func:`half_dtype` says so.

    Example:
        >>> import autocast, jax.numpy as jnp
        >>> autocast.cast_to_half(jnp.ones(2)).dtype == autocast.half_dtype()
        True
    """
    return cast_tree(half_dtype(), tree)


@dataclasses.dataclass(frozen=True)
class Policy:
    """Which dtypes parameters, computation and outputs use.

    Frozen and hashable, so it can be a static argument of ``jax.jit``. Any floating dtype
    spelling is accepted (``jnp.bfloat16``, ``"bf16"``, ``np.float32``); fields hold NumPy
    dtypes. ``str(policy)`` prints the form :func:`get_policy` reads back. The casting methods
    touch only floating-point array leaves, as :func:`cast_tree` does.

    Attributes:
        param_dtype: The dtype parameters are stored in.
        compute_dtype: The dtype the computation runs in.
        output_dtype: The dtype outputs are returned in.

    Raises:
        TypeError: If a field is given something that is not a floating dtype.
        ValueError: If a field is given a string that names no floating dtype.

    Example:
        >>> import autocast, jax.numpy as jnp
        >>> policy = autocast.Policy(jnp.float32, jnp.bfloat16, jnp.float32)
        >>> str(policy)
        'p=f32,c=bf16,o=f32'
        >>> policy.cast_to_compute({"w": jnp.ones(3), "n": 2})["w"].dtype
        dtype(bfloat16)
    """

    param_dtype: np.dtype
    compute_dtype: np.dtype
    output_dtype: np.dtype

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = canonicalize_float_dtype(getattr(self, field.name), what=field.name)
            object.__setattr__(self, field.name, value)

    def cast_to_param(self, x: T) -> T:
        """Casts the floating-point leaves of ``x`` to ``param_dtype``.

        Args:
            x: Any pytree.

        Returns:
            A pytree of the same structure, with its floating-point array leaves in
            ``param_dtype``.
        """
        return cast_tree(self.param_dtype, x)

    def cast_to_compute(self, x: T) -> T:
        """Casts the floating-point leaves of ``x`` to ``compute_dtype``.

        Args:
            x: Any pytree.

        Returns:
            A pytree of the same structure, with its floating-point array leaves in
            ``compute_dtype``.
        """
        return cast_tree(self.compute_dtype, x)

    def cast_to_output(self, x: T) -> T:
        """Casts the floating-point leaves of ``x`` to ``output_dtype``.

        Args:
            x: Any pytree.

        Returns:
            A pytree of the same structure, with its floating-point array leaves in
            ``output_dtype``.
        """
        return cast_tree(self.output_dtype, x)

    def with_param_dtype(self, dtype: Any) -> Policy:
        """A copy with another ``param_dtype``.

        Args:
            dtype: The new ``param_dtype``: any floating dtype spelling the constructor accepts.

        Returns:
            A new :class:`Policy`; ``self`` is unchanged.

        Raises:
            TypeError: If ``dtype`` is not a floating dtype.
            ValueError: If ``dtype`` is a string that names no floating dtype.
        """
        return dataclasses.replace(self, param_dtype=dtype)

    def with_compute_dtype(self, dtype: Any) -> Policy:
        """A copy with another ``compute_dtype``.

        Args:
            dtype: The new ``compute_dtype``: any floating dtype spelling the constructor accepts.

        Returns:
            A new :class:`Policy`; ``self`` is unchanged.

        Raises:
            TypeError: If ``dtype`` is not a floating dtype.
            ValueError: If ``dtype`` is a string that names no floating dtype.
        """
        return dataclasses.replace(self, compute_dtype=dtype)

    def with_output_dtype(self, dtype: Any) -> Policy:
        """A copy with another ``output_dtype``.

        Args:
            dtype: The new ``output_dtype``: any floating dtype spelling the constructor accepts.

        Returns:
            A new :class:`Policy`; ``self`` is unchanged.

        Raises:
            TypeError: If ``dtype`` is not a floating dtype.
            ValueError: If ``dtype`` is a string that names no floating dtype.
        """
        return dataclasses.replace(self, output_dtype=dtype)

    def __str__(self) -> str:
        return ",".join(
            f"{_SHORT_KEYS[f.name]}="
            f"{_SHORT_NAMES.get(getattr(self, f.name), getattr(self, f.name).name)}"
            for f in dataclasses.fields(self)
        )


# Keras' mixed policy names, with Keras' meaning: variables in float32, computation (and so
# each layer's output) in the 16-bit dtype. Its plain names ("float32", "bfloat16",
# "float16") are dtype names, which set all three dtypes, as in Keras.
KERAS_POLICIES = {
    "mixed_bfloat16": (np.dtype(jnp.float32), np.dtype(jnp.bfloat16)),
    "mixed_float16": (np.dtype(jnp.float32), np.dtype(jnp.float16)),
}


def get_policy(policy_name: str | Policy) -> Policy:
    """Reads a policy from its short string form, ``jmp``'s loose grammar or Keras' names.

    Either one dtype name, which sets all three dtypes (``"bfloat16"`` means
    ``p=bf16,c=bf16,o=bf16``), one of Keras' mixed policies (``"mixed_bfloat16"`` means
    ``p=f32,c=bf16,o=bf16``: float32 variables, 16-bit computation and layer outputs;
    ``"mixed_float16"`` likewise), or comma-separated ``key=value`` pairs. Keys: ``p``/``params``,
    ``c``/``compute``, ``o``/``output``. Values: any name :func:`parse_dtype` accepts
    (``half`` is :func:`half_dtype`). Unnamed fields default as in ``jmp``: params to float32,
    compute to the params dtype, output to the compute dtype. Case and whitespace are ignored.

    Args:
        policy_name: The policy string, or a :class:`Policy`, which is returned unchanged.

    Returns:
        The :class:`Policy` the string describes.

    Raises:
        TypeError: If ``policy_name`` is neither a string nor a :class:`Policy`.
        ValueError: If the string is empty, a part is not ``key=dtype``, a key is unknown or
            given twice, or a name is not a floating dtype.

    Example:
        >>> import autocast
        >>> str(autocast.get_policy("c=f16"))
        'p=f32,c=f16,o=f16'
        >>> str(autocast.get_policy("params=float32, compute=bfloat16, output=float32"))
        'p=f32,c=bf16,o=f32'
        >>> str(autocast.get_policy("bfloat16"))
        'p=bf16,c=bf16,o=bf16'
        >>> str(autocast.get_policy("mixed_bfloat16"))
        'p=f32,c=bf16,o=bf16'
    """
    if isinstance(policy_name, Policy):
        return policy_name
    if not isinstance(policy_name, str):
        raise TypeError(
            "get_policy expects a string such as 'p=f32,c=bf16,o=f32' or a Policy, "
            f"got {type(policy_name).__name__}"
        )
    if not policy_name.strip():
        raise ValueError("empty policy string; expected pairs such as 'p=f32,c=bf16,o=f32'")
    accepted_keys = ", ".join(_POLICY_KEYS)
    bare = policy_name.strip()
    keras = KERAS_POLICIES.get(bare.lower())
    if keras is not None:
        variables, compute = keras
        return Policy(variables, compute, compute)
    if "=" not in bare and "," not in bare and bare.lower() not in _POLICY_KEYS:
        try:
            dtype = parse_dtype(bare)
        except ValueError as e:
            raise ValueError(
                f"{e}. A policy is one dtype name (for all three dtypes), one of Keras' "
                f"{' or '.join(KERAS_POLICIES)}, or key=dtype pairs such as "
                f"'p=f32,c=bf16,o=f32' with keys among {accepted_keys}"
            ) from None
        return Policy(dtype, dtype, dtype)
    chosen: dict[str, np.dtype] = {}
    for part in policy_name.split(","):
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or not key or not value.strip():
            raise ValueError(
                f"malformed part {part.strip()!r} of policy {policy_name!r}; expected key=dtype "
                f"with a key among {accepted_keys}"
            )
        if key not in _POLICY_KEYS:
            raise ValueError(
                f"unknown key {key!r} in policy {policy_name!r}; accepted keys: {accepted_keys}"
            )
        field = _POLICY_KEYS[key]
        if field in chosen:
            raise ValueError(f"policy {policy_name!r} sets {field} twice")
        try:
            chosen[field] = parse_dtype(value)
        except ValueError as e:
            raise ValueError(f"in policy {policy_name!r}, key {key!r}: {e}") from None
    param = chosen.get("param_dtype", np.dtype(jnp.float32))
    compute = chosen.get("compute_dtype", param)
    output = chosen.get("output_dtype", compute)
    return Policy(param, compute, output)
