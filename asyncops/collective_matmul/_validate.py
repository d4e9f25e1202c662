"""Argument checks for the collective matmuls.

Every error names the argument and says how to fix it. The checks run at
trace time, inside ``shard_map``, on per-device (local) shapes.
"""

from typing import Literal

import jax
import jax.numpy as jnp

from asyncops.kernels import _common

Api = Literal["value", "ref"]


def operand(x, fn: str, name: str) -> None:
  """Checks ``x`` is a rank-2 array of a dtype a TPU DMA can move."""
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(
      f"{fn}: {name} must be a JAX array, got {type(x).__name__}. "
      f"Convert it with jnp.asarray({name})."
    )
  if len(x.shape) != 2:
    raise ValueError(
      f"{fn}: {name} must be a matrix (rank 2, per device), got shape "
      f"{tuple(x.shape)}. Reshape batch dimensions into the rows first, "
      f"e.g. {name}.reshape(-1, {name}.shape[-1])."
    )
  if jnp.dtype(x.dtype).name not in _common.MOVABLE_DTYPES:
    raise TypeError(
      f"{fn}: {name} has dtype {jnp.dtype(x.dtype).name}, which a TPU DMA "
      f"cannot move. Supported: {', '.join(_common.MOVABLE_DTYPES)}. Cast "
      f"{name} first, e.g. {name}.astype(jnp.bfloat16)."
    )


def same_dtype(lhs, rhs, fn: str, names=("lhs", "rhs")) -> None:
  """Checks both operands share a dtype (no silent promotion)."""
  a, b = jnp.dtype(lhs.dtype), jnp.dtype(rhs.dtype)
  if a != b:
    raise TypeError(
      f"{fn}: {names[0]} has dtype {a.name} but {names[1]} has {b.name}. "
      f"Cast one of them so both match, e.g. "
      f"{names[1]}.astype({names[0]}.dtype)."
    )


def api(value, fn: str) -> Api:
  """Checks ``api=`` is a known mode."""
  if value not in ("value", "ref"):
    raise ValueError(f"{fn}: api must be 'value' or 'ref', got {value!r}.")
  return value


def axis(axis_name, fn: str) -> int:
  """Checks ``axis_name`` is one bound mesh axis; returns its size."""
  if not isinstance(axis_name, str):
    raise TypeError(
      f"{fn}: axis_name must be one mesh axis name (a str), got "
      f"{axis_name!r}. Collective matmuls run over one mesh axis."
    )
  try:
    return int(jax.lax.axis_size(axis_name))
  except NameError:
    raise NameError(
      f"{fn}: axis_name {axis_name!r} is not bound. Call {fn} inside "
      f"jax.shard_map over a mesh with an axis named {axis_name!r}."
    ) from None


def matmul_operands(lhs, rhs, axis_name, api_value, fn: str) -> int:
  """The checks every two-operand collective matmul starts with.

  Returns:
    The size of ``axis_name``.
  """
  api(api_value, fn)
  operand(lhs, fn, "lhs")
  operand(rhs, fn, "rhs")
  same_dtype(lhs, rhs, fn)
  return axis(axis_name, fn)


def contracting(lhs, rhs, fn: str, k_lhs: int, names=("lhs", "rhs")) -> None:
  """Checks ``rhs.shape[0] == k_lhs`` (the contracting sizes agree)."""
  if rhs.shape[0] != k_lhs:
    raise ValueError(
      f"{fn}: the contracting dimensions disagree: {names[1]}.shape[0] = "
      f"{rhs.shape[0]} but {names[0]} contributes {k_lhs} (per-device "
      f"shapes {names[0]} {tuple(lhs.shape)}, {names[1]} "
      f"{tuple(rhs.shape)}). Check the shard_map in_specs."
    )


def even_rows(x, fn: str, name: str) -> None:
  """Bidirectional variants send half the rows each way."""
  if x.shape[0] % 2:
    raise ValueError(
      f"{fn}: bidirectional=True sends half of {name}'s rows each way, but "
      f"{name}.shape[0] = {x.shape[0]} is odd. Pad {name} to an even number "
      "of rows, or pass bidirectional=False."
    )
