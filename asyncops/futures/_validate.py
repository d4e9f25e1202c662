"""Argument checks: bad input gets an error naming the argument and the fix."""

import operator
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from asyncops import _jax_compat as jc
from asyncops.futures import _bitcast
from asyncops.kernels import _common


def array(x, fn: str, name: str = "x", *, carriers: bool = True):
  """Checks ``x`` is an array asyncops can move.

  ``carriers``: whether dtypes that travel as a carrier (``bool``,
  ``complex64``; ``asyncops.futures._bitcast``) are accepted: the value
  API converts them, the Ref API (which writes into the user's buffer)
  cannot.
  """
  if jc.is_ref(x):
    raise TypeError(
      f"{fn}: {name} is a jax.Ref; the value API (asyncops.{fn}) takes "
      f"arrays. Transfer between Refs with asyncops.stateful.{fn}(src_ref, "
      f"dst_ref, ...), or pass the Ref's value ({name}[...])."
    )
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(
      f"{fn}: {name} must be a JAX array, got {type(x).__name__}. "
      f"Convert it with jnp.asarray({name})."
    )
  dtype = jnp.dtype(x.dtype)
  if dtype.name in _common.NARROW_DTYPES and not jc.NARROW_DMA:
    raise TypeError(
      f"{fn}: {name} has dtype {dtype.name}, which our kernels move on jax "
      f">= 0.10 only (this jax {jax.__version__}'s libtpu aborts compiling "
      f"such transfers). Upgrade: pip install 'jax[tpu]>=0.10', or move "
      f"the bytes as uint8 (jax.lax.bitcast_convert_type({name}, "
      "jnp.uint8) for 8-bit floats)."
    )
  if dtype.name not in _common.MOVABLE_DTYPES:
    carried = _bitcast.carrier(dtype)
    if carried is None:
      raise TypeError(
        f"{fn}: {name} has dtype {dtype.name}, which a TPU DMA cannot move. "
        f"Supported: {', '.join(_common.MOVABLE_DTYPES + _bitcast.CARRIED)}. "
        f"Cast {name} first (e.g. {name}.astype(jnp.float32), or bitcast a "
        "64-bit array to uint32 pairs with jax.lax.bitcast_convert_type)."
      )
    if not carriers:
      raise TypeError(
        f"{fn}: {name} holds {dtype.name}, which a TPU DMA cannot move and "
        f"a Ref transfer cannot carry (it writes into the Ref's own buffer; "
        f"the value API converts {dtype.name} to {carried.dtype} and back, "
        f"which needs a buffer of its own). Hold the data in a "
        f"{carried.dtype} Ref (e.g. jax.new_ref(x.astype(jnp.uint8)) for "
        "bool, or real and imaginary parts in a float32 Ref for complex64) "
        "and convert where it is read, or use the value API "
        f"(asyncops.{fn})."
      )
  if len(x.shape) == 0:
    raise ValueError(
      f"{fn}: {name} is a scalar; DMAs move arrays. Pass {name}[None] and "
      "index the result with [0]."
    )
  return x


def integer(value, fn: str, name: str) -> int:
  """Checks ``value`` is a Python (or NumPy) int, not a bool; returns it."""
  if isinstance(value, bool) or not hasattr(value, "__index__"):
    raise TypeError(f"{fn}: {name} must be an int, got {value!r}.")
  return operator.index(value)


def boolean(value, fn: str, name: str) -> bool:
  """Checks ``value`` is a bool (Python or NumPy); returns it."""
  if not isinstance(value, bool | np.bool_):
    raise TypeError(f"{fn}: {name} must be True or False, got {value!r}.")
  return bool(value)


def axis(axis_name, fn: str) -> int:
  """Checks ``axis_name`` is one bound mesh axis; returns its size."""
  if not isinstance(axis_name, str):
    raise TypeError(
      f"{fn}: axis_name must be one mesh axis name (a str), got "
      f"{axis_name!r}. Tuples of axes are not supported; communicate over "
      "one axis per call."
    )
  try:
    size = jax.lax.axis_size(axis_name)
  except NameError:
    raise NameError(
      f"{fn}: axis_name {axis_name!r} is not bound. Call {fn} inside "
      f"jax.shard_map over a mesh with an axis named {axis_name!r}."
    ) from None
  return int(size)


def mesh_axes(axis_name: str, fn: str) -> tuple[str, ...]:
  """All mesh axis names; the kernels address peers by full coordinates."""
  mesh = jax.sharding.get_abstract_mesh()
  names = tuple(mesh.axis_names)
  manual = set(getattr(mesh, "manual_axes", names))
  missing = [a for a in names if a not in manual]
  if missing:
    raise ValueError(
      f"{fn}: the enclosing shard_map is manual over {sorted(manual)} but "
      f"not over {missing}. asyncops kernels address devices by full mesh "
      f"coordinates; shard_map over every mesh axis (drop axis_names=) "
      f"and use P(None) for axes {missing} in the specs."
    )
  if axis_name not in names:
    raise NameError(f"{fn}: axis_name {axis_name!r} is not in mesh {names}.")
  return names


def perm(perm, shift, axis_size: int, fn: str) -> tuple[tuple[int, int], ...]:
  """Normalises ``perm=`` / ``shift=`` to a tuple of pairs, checking both."""
  if (perm is None) == (shift is None):
    raise TypeError(
      f"{fn}: pass exactly one of perm= (a list of (source, destination) "
      "pairs, as for jax.lax.ppermute) or shift= (an int: every device "
      "sends to index + shift, modulo the axis size)."
    )
  if shift is not None:
    if isinstance(shift, bool) or not hasattr(shift, "__index__"):
      raise TypeError(f"{fn}: shift must be a Python int, got {shift!r}.")
    shift = operator.index(shift)
    return tuple((i, (i + shift) % axis_size) for i in range(axis_size))
  if not isinstance(perm, Sequence) or isinstance(perm, str):
    raise TypeError(
      f"{fn}: perm must be a sequence of (source, destination) pairs, got "
      f"{perm!r}."
    )
  pairs = []
  for p in perm:
    try:
      if any(isinstance(v, bool) for v in p):
        raise TypeError
      s, d = (operator.index(v) for v in p)
    except (TypeError, ValueError):
      raise TypeError(
        f"{fn}: perm entries must be pairs of ints (source, destination), "
        f"got {p!r}."
      ) from None
    for role, v in (("source", s), ("destination", d)):
      if not 0 <= v < axis_size:
        raise ValueError(
          f"{fn}: perm {role} index {v} in {p!r} is out of range for an "
          f"axis of size {axis_size}; indices must be in [0, {axis_size})."
        )
    pairs.append((s, d))
  for role, k in (("source", 0), ("destination", 1)):
    seen = {}
    for p in pairs:
      if p[k] in seen:
        raise ValueError(
          f"{fn}: perm has duplicate {role} {p[k]} in {seen[p[k]]} and "
          f"{p}; each device may send to and receive from at most one "
          "peer per call. Split it into several calls."
        )
      seen[p[k]] = p
  return tuple(pairs)
