"""``jax.vmap`` over a start/done: the whole batch moves in one transfer.

A transfer is linear and acts on every element of its buffer the same way,
so a batch of transfers is one transfer of a buffer with a batch axis: the
:class:`OpSpec`'s shape grows that axis and the kernels (or the emulation)
run once. Where the batch axis goes:

- ``ppermute``, ``copy``, ``all_gather``: wherever it already is (no
  relayout). The all-gather's raw destination puts its slot axis first, so
  its batch axis is one further right.
- ``bidirectional``: wherever it is; the axis it halves moves right of the
  batch (``spec.gather_axis``), each half then being a strided DMA.
- ``all_to_all`` (only ever the all-gather's reverse): never axis 0, which
  holds the slots; a batch at 0 moves to 1 (one transpose of the source,
  before the start; never of a buffer in flight).

The semaphores are never batched: one transfer, one set of semaphores. The
done's rule rebuilds the start's batched spec from the batch axis of the
source it receives; a destination whose batch axis moved in between (a
``vmap`` of a loop that carries the future moves carries to axis 0) raises
an error rather than relayout a buffer in flight.
"""

import dataclasses

import jax.numpy as jnp
from jax.interpreters import batching

from asyncops.futures import _ad
from asyncops.futures import _primitives as prims
from asyncops.futures._future import FutureError
from asyncops.kernels._spec import OpSpec


def _source_axis(spec: OpSpec, b: int) -> int:
  """Where the batch axis of the source goes for ``spec``."""
  return 1 if b == 0 and spec.kind == "all_to_all" else b


def _dst_axis(spec: OpSpec, b: int) -> int:
  return b + 1 if spec.kind == "all_gather" else b


def _batched(spec: OpSpec, b: int, size: int) -> OpSpec:
  shape = list(spec.shape)
  shape.insert(b, size)
  spec = dataclasses.replace(spec, shape=tuple(shape))
  if spec.kind == "bidirectional" and b <= spec.gather_axis:
    # The halved axis moves right of the batch (a strided DMA per half).
    spec = dataclasses.replace(spec, gather_axis=spec.gather_axis + 1)
  return spec


def _prepare(x, b, spec: OpSpec):
  """Moves the source's batch axis where it goes; returns the batched spec."""
  to = _source_axis(spec, b)
  if to != b:
    x = jnp.moveaxis(x, b, to)
  return x, to, _batched(spec, to, x.shape[to])


def _unbatched_sems(fn: str, spec: OpSpec, dims) -> None:
  if any(d is not None for d in dims):
    raise FutureError(
      f"asyncops: {fn} of {spec.short()} under jax.vmap got batched "
      "semaphores: a future's semaphores belong to one transfer and cannot "
      "be stacked (e.g. futures from separate vmapped calls, or a loop "
      "whose carry vmap batched). Start the transfer inside the vmapped "
      "function and await it there."
    )


def _check_dst(fn: str, spec: OpSpec, b_src, b_dst) -> None:
  want = None if b_src is None else _dst_axis(spec, b_src)
  moved = b_src is not None and _source_axis(spec, b_src) != b_src
  if b_dst != want or moved:
    raise FutureError(
      f"asyncops: {fn} of {spec.short()} under jax.vmap: the destination's "
      f"batch axis is {b_dst} but the start put it at {want}. Something "
      "between the start and the done moved the batch axis of a buffer in "
      "flight (jax.vmap of a loop that carries a future does: it moves "
      "carries to axis 0). Await the future inside the loop body, or vmap "
      "outside the loop's function."
    )


def _start_batch(args, dims, *, spec):
  (x,), (b,) = args, dims
  x, to, batched = _prepare(x, b, spec)
  outs = prims.start_p.bind(x, spec=batched)
  n = prims.n_sems(spec)
  return outs, [to, _dst_axis(spec, to)] + [None] * n


def _done_batch(args, dims, *, spec):
  x, dst, *sems = args
  bx, bd, *bs = dims
  _unbatched_sems("done", spec, bs)
  if bx is None and bd is None:
    return prims.done_p.bind(*args, spec=spec), None
  if bx is None:
    raise FutureError(
      f"asyncops: done of {spec.short()} under jax.vmap: the destination is "
      "batched but the source is not. Pass the future the start returned."
    )
  _check_dst("done", spec, bx, bd)
  batched = _batched(spec, bx, x.shape[bx])
  return prims.done_p.bind(x, dst, *sems, spec=batched), bd


def _send_done_batch(args, dims, *, spec):
  x, dst, *sems = args
  bx, bd, *bs = dims
  _unbatched_sems("send_done", spec, bs)
  if bx is None and bd is None:
    return prims.send_done_p.bind(*args, spec=spec), [None, None]
  _check_dst("send_done", spec, bx, bd)
  batched = _batched(spec, bx, x.shape[bx])
  return prims.send_done_p.bind(x, dst, *sems, spec=batched), [bx, bd]


def _recv_done_batch(args, dims, *, spec):
  dst, *sems = args
  bd, *bs = dims
  _unbatched_sems("recv_done", spec, bs)
  if bd is None:
    return prims.recv_done_p.bind(*args, spec=spec), None
  bx = bd - 1 if spec.kind == "all_gather" else bd
  _check_dst("recv_done", spec, bx if bx >= 0 else None, bd)
  batched = _batched(spec, bx, dst.shape[bd])
  return prims.recv_done_p.bind(dst, *sems, spec=batched), bd


def _lin_start_batch(args, dims, *, spec, pair):
  (t,), (b,) = args, dims
  t, to, batched = _prepare(t, b, spec)
  return _ad.lin_start_p.bind(t, spec=batched, pair=pair), _dst_axis(spec, to)


def _lin_done_batch(args, dims, *, spec, pair):
  (t,), (b,) = args, dims
  bx = b - 1 if spec.kind == "all_gather" else b
  batched = _batched(spec, bx, t.shape[b])
  return _ad.lin_done_p.bind(t, spec=batched, pair=pair), b


batching.primitive_batchers[prims.start_p] = _start_batch
batching.primitive_batchers[prims.done_p] = _done_batch
batching.primitive_batchers[prims.send_done_p] = _send_done_batch
batching.primitive_batchers[prims.recv_done_p] = _recv_done_batch
batching.primitive_batchers[_ad.lin_start_p] = _lin_start_batch
batching.primitive_batchers[_ad.lin_done_p] = _lin_done_batch
