"""The collective-matmul variants the benchmarks compare.

Each variant is ``(lhs, rhs) -> out`` for A[B_X, D_Y] * W[D, F_Y] ->
Out[B_X, F_Y] on a mesh with axes ``("x", "y")``; ``build`` returns the
jitted function. ``precision`` is passed to every matmul.

- ``unsharded``: the bound. One device, A[B/X, D] @ W[D, F/Y] (the
  per-device FLOPs with no sharding on the contracting dimension).
- ``jit``: plain ``jax.jit`` with output sharding; XLA all-gathers A.
- ``ppermute``: the chapter's ``shard_map`` + ``lax.ppermute`` loop.
- ``asyncops_manual``: the same loop with ``asyncops.ppermute_start/_done``
  and ``optimization_barrier`` pinning each chunk matmul between them.
- ``allgather_matmul`` / ``allgather_matmul_bidi``:
  ``asyncops.collective_matmul.allgather_matmul`` when it exists.
"""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import asyncops

AXIS = "y"


def _mm(precision):
  return functools.partial(jnp.matmul, precision=precision)


def chapter_ppermute(lhs, rhs, *, precision=None):
  """The chapter's collective matmul (``lax.ppermute`` ring, unrolled)."""
  n = jax.lax.axis_size(AXIS)
  idx = jax.lax.axis_index(AXIS)
  cs = lhs.shape[1]
  mm = _mm(precision)
  perm = [(j, (j - 1) % n) for j in range(n)]

  def chunk(i):
    start = (idx + i) % n * cs
    return jax.lax.dynamic_slice_in_dim(rhs, start, cs)

  acc = jnp.zeros((lhs.shape[0], rhs.shape[1]), lhs.dtype)
  acc = jax.lax.pcast(acc, ("x", AXIS), to="varying")
  for i in range(n - 1):
    acc = acc + mm(lhs, chunk(i))
    lhs = jax.lax.ppermute(lhs, AXIS, perm)
  return acc + mm(lhs, chunk(n - 1))


def asyncops_manual(lhs, rhs, *, precision=None):
  """The ring with asyncops futures; barriers pin each chunk's matmul."""
  n = jax.lax.axis_size(AXIS)
  idx = jax.lax.axis_index(AXIS)
  cs = lhs.shape[1]
  mm = _mm(precision)
  acc = jnp.zeros((lhs.shape[0], rhs.shape[1]), lhs.dtype)
  for i in range(n):
    start = (idx + i) % n * cs
    if i < n - 1:
      lhs, fut = asyncops.ppermute_start(lhs, AXIS, shift=-1)
      lhs, acc = jax.lax.optimization_barrier((lhs, acc))
    part = mm(lhs, jax.lax.dynamic_slice_in_dim(rhs, start, cs))
    acc = acc + part
    if i < n - 1:
      acc, fut = jax.lax.optimization_barrier((acc, fut))
      lhs = asyncops.ppermute_done(fut)
  return acc


def _library(name: str):
  cm = getattr(asyncops, "collective_matmul", None)
  if cm is None:
    try:
      from asyncops import collective_matmul as cm  # noqa: PLC0415
    except ImportError:
      return None
  return getattr(cm, name, None)


def available() -> list[str]:
  """Variant names runnable with this checkout."""
  out = ["unsharded", "jit", "ppermute", "asyncops_manual"]
  if _library("allgather_matmul") is not None:
    out += ["allgather_matmul", "allgather_matmul_bidi"]
  return out


def build(name: str, mesh, *, precision=None):
  """The jitted function for variant ``name`` on ``mesh`` (axes x, y).

  Raises:
    ValueError: unknown variant; lists the available ones.
  """
  in_specs = (P("x", AXIS), P(None, AXIS))
  out_spec = P("x", AXIS)
  if name == "unsharded":
    return jax.jit(_mm(precision))
  if name == "jit":
    return jax.jit(_mm(precision), out_shardings=NamedSharding(mesh, out_spec))
  fns = {
    "ppermute": functools.partial(chapter_ppermute, precision=precision),
    "asyncops_manual": functools.partial(asyncops_manual, precision=precision),
  }
  lib = _library("allgather_matmul")
  if lib is not None:
    # The library takes no precision argument; set the default at trace.
    def _lib(a, w, **kw):
      with jax.default_matmul_precision(precision or "default"):
        return lib(a, w, AXIS, **kw)

    fns["allgather_matmul"] = _lib
    fns["allgather_matmul_bidi"] = functools.partial(_lib, bidirectional=True)
  if name not in fns:
    raise ValueError(
      f"variant {name!r} is not available; choose from {available()}."
    )
  return jax.jit(
    jax.shard_map(fns[name], mesh=mesh, in_specs=in_specs, out_specs=out_spec)
  )


def abstract_args(name, mesh, shape, dtype):
  """ShapeDtypeStructs for variant ``name`` at global shape ``(B, D, F)``."""
  b, d, f = shape
  x, y = mesh.shape["x"], mesh.shape[AXIS]
  if name == "unsharded":
    dev = mesh.devices.flat[0]
    s = jax.sharding.SingleDeviceSharding(dev)
    return (
      jax.ShapeDtypeStruct((b // x, d), dtype, sharding=s),
      jax.ShapeDtypeStruct((d, f // y), dtype, sharding=s),
    )
  return (
    jax.ShapeDtypeStruct(
      (b, d), dtype, sharding=NamedSharding(mesh, P("x", AXIS))
    ),
    jax.ShapeDtypeStruct(
      (d, f), dtype, sharding=NamedSharding(mesh, P(None, AXIS))
    ),
  )
