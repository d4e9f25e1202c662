"""Argument checks for the collective matmuls.

Every error names the argument and says how to fix it. The checks run at
trace time, inside ``shard_map``, on per-device (local) shapes.
"""

from typing import Literal

import jax
import jax.numpy as jnp

from asyncops.kernels import _common

Api = Literal["value", "ref"]
Accumulation = Literal["float32", "output"]
ACCUMULATIONS: tuple[str, ...] = ("float32", "output")
Memory = Literal["fastest", "jit"]
MEMORIES: tuple[str, ...] = ("fastest", "jit")


# Operand dtypes of the collective matmuls: the 8 to 32-bit ones a DMA
# moves. (8-bit floats and 4-bit types move too, but a ring's chunk
# matmul would accumulate 4-bit integers in 4 bits; quantized transfers,
# transfer="int8" / "float8_e4m3fn", are the way to send fewer bytes.)
OPERAND_DTYPES = tuple(
  d for d in _common.MOVABLE_DTYPES if d not in _common.NARROW_DTYPES
)


def operand(x, fn: str, name: str, *, matrix: bool = True) -> None:
  """Checks ``x`` is an array of a dtype a TPU DMA can move.

  ``matrix``: rank exactly 2 (a weight); else rank at least 1 (an
  activation with leading batch dimensions).
  """
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(
      f"{fn}: {name} must be a JAX array, got {type(x).__name__}. "
      f"Convert it with jnp.asarray({name})."
    )
  if matrix and len(x.shape) != 2:
    raise ValueError(
      f"{fn}: {name} must be a matrix (rank 2, per device), got shape "
      f"{tuple(x.shape)}. Batched weights are not supported: loop over "
      "them, or fold the batch into the activations."
    )
  if not matrix and len(x.shape) < 1:
    raise ValueError(
      f"{fn}: {name} must have at least one dimension (the contracting "
      f"one, last), got a scalar. Use {name}.reshape(1, -1)."
    )
  if jnp.dtype(x.dtype).name not in OPERAND_DTYPES:
    raise TypeError(
      f"{fn}: {name} has dtype {jnp.dtype(x.dtype).name}, which the "
      f"collective matmuls do not take. Supported: "
      f"{', '.join(OPERAND_DTYPES)}. Cast {name} first, e.g. "
      f"{name}.astype(jnp.bfloat16); to send fewer bytes, keep {name} in "
      "bfloat16 and pass transfer='int8' or 'float8_e4m3fn' (all-gather "
      "matmul)."
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


def accumulation(value, fn: str) -> Accumulation:
  """Checks ``accumulation=`` is a known setting."""
  if not isinstance(value, str) or value not in ACCUMULATIONS:
    raise ValueError(
      f"{fn}: accumulation must be one of {ACCUMULATIONS}, got {value!r}. "
      "'float32' (the default) adds the chunk products in float32 and "
      "rounds once; 'output' adds them in the output dtype (XLA's "
      "windowed einsum's numerics), rounding at every step."
    )
  return value


def memory(value, fn: str) -> Memory:
  """Checks ``memory=`` is a known target."""
  if not isinstance(value, str) or value not in MEMORIES:
    raise ValueError(
      f"{fn}: memory must be one of {MEMORIES}, got {value!r}. 'fastest' "
      "(the default) lets method='auto' pick by time alone; 'jit' keeps "
      "its pick's temporaries within jit's plus one chunk's buffers."
    )
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

  ``lhs`` is an activation (rank >= 1, contracting dimension last), ``rhs``
  a weight matrix.

  Returns:
    The size of ``axis_name``.
  """
  api(api_value, fn)
  operand(lhs, fn, "lhs", matrix=False)
  operand(rhs, fn, "rhs")
  same_dtype(lhs, rhs, fn)
  return axis(axis_name, fn)


def weights(rhs, lhs, fn: str) -> tuple[tuple, tuple[str, ...], bool]:
  """``rhs`` as a tuple of weight matrices of ``lhs``'s dtype.

  Returns:
    ``(ws, names, single)``: the weights, their names for messages
    (``"rhs"`` or ``"rhs[i]"``) and whether ``rhs`` was one array.
  """
  if hasattr(rhs, "shape"):
    ws, names, single = (rhs,), ("rhs",), True
  elif isinstance(rhs, (list, tuple)):
    if not rhs:
      raise ValueError(
        f"{fn}: rhs is an empty sequence. Pass one weight matrix or a "
        "non-empty list of them (one result per weight)."
      )
    ws = tuple(rhs)
    names = tuple(f"rhs[{i}]" for i in range(len(ws)))
    single = False
  else:
    raise TypeError(
      f"{fn}: rhs must be a JAX array or a list/tuple of arrays (one result "
      f"per weight), got {type(rhs).__name__}."
    )
  for w, name in zip(ws, names, strict=True):
    operand(w, fn, name)
    same_dtype(lhs, w, fn, ("lhs", name))
  return ws, names, single


def dim(value, rank: int, fn: str, name: str, hint: str) -> int:
  """Checks ``value`` is an axis of a rank-``rank`` array; normalizes it."""
  if isinstance(value, bool) or not isinstance(value, int):
    raise TypeError(
      f"{fn}: {name} must be an int (an axis), got {value!r}. {hint}"
    )
  if not -rank <= value < rank:
    raise ValueError(
      f"{fn}: {name} = {value} is not an axis of a rank-{rank} lhs (valid: "
      f"{-rank} .. {rank - 1}). {hint}"
    )
  return value % rank


def contracting(lhs, rhs, fn: str, k_lhs: int, names=("lhs", "rhs")) -> None:
  """Checks ``rhs.shape[0] == k_lhs`` (the contracting sizes agree)."""
  if rhs.shape[0] != k_lhs:
    raise ValueError(
      f"{fn}: the contracting dimensions disagree: {names[1]}.shape[0] = "
      f"{rhs.shape[0]} but {names[0]} contributes {k_lhs} (per-device "
      f"shapes {names[0]} {tuple(lhs.shape)}, {names[1]} "
      f"{tuple(rhs.shape)}). Check the shard_map in_specs."
    )


def even_rows(m: int, fn: str, name: str) -> None:
  """Bidirectional contracting/column forms send half the rows each way."""
  if m % 2:
    raise ValueError(
      f"{fn}: bidirectional=True sends half of {name}'s rows each way, but "
      f"{name} has {m} rows (the product of its leading dimensions), an "
      f"odd number. Pad {name} to an even number of rows, or pass "
      "bidirectional=False."
    )


def halvable(p: int, r: int, fn: str, name: str, dim_name: str) -> None:
  """Bidirectional row forms halve the outer batch or each chunk's rows."""
  if p % 2 and r % 2:
    raise ValueError(
      f"{fn}: bidirectional=True sends half of every chunk each way, "
      f"halving either the dimensions before {dim_name} ({p} in all) or "
      f"the rows of one chunk ({r}); both are odd. Pad {name} so one of "
      "them is even, or pass bidirectional=False."
    )
