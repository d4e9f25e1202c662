"""Stateful start/done primitives over Refs, and what they discharge to.

Two levels:

- ``ref_start_p(*refs, src_slot, dst_slot) -> sems`` and ``ref_done_p(*refs,
  src_slot, dst_slot, *sems) -> ()`` take ``jax.Ref`` operands and carry
  state effects (read the source, write the destination), so JAX orders them
  against every other access to those Refs and never drops them.
- When JAX discharges state before lowering, they become
  ``buf_start_p(*bufs, slots) -> (dst, *sems)`` and ``buf_done_p(*bufs,
  slots, *sems) -> dst`` on the Refs' buffers, which lower to the Mosaic
  kernels of :mod:`asyncops.stateful._kernels` on TPU (destination aliased:
  the DMA writes into the Ref's buffer) and to the value API's emulation
  elsewhere. They carry an effect of their own so that no DCE removes a
  transfer whose result is never read.
"""

import dataclasses

import jax
import jax.numpy as jnp

from asyncops import _jax_compat as jc
from asyncops.kernels import _common, _registry
from asyncops.kernels._spec import OpSpec
from asyncops.stateful import _future, _kernels
from asyncops.stateful._layout import Layout


class TransferEffect(jc.Effect):
  """A DMA in flight: never dead code, whatever reads its result."""

  def __repr__(self):
    return "AsyncopsTransfer"


TRANSFER = TransferEffect()
jc.register_effect(TransferEffect)


def n_sems(spec: OpSpec) -> int:
  k = _registry.get(spec.kind)
  return k.send_sems(spec) + k.recv_sems(spec)


# Value level: the buffers --------------------------------------------------

buf_start_p = jc.Primitive("asyncops_buf_start")
buf_start_p.multiple_results = True
buf_done_p = jc.Primitive("asyncops_buf_done")


@buf_start_p.def_effectful_abstract_eval
def _buf_start_abstract(*args, spec, layout):
  dst = args[layout.dst_i]
  return [dst] + [jc.sem_like(dst)] * n_sems(spec), {TRANSFER}


@buf_done_p.def_effectful_abstract_eval
def _buf_done_abstract(*args, spec, layout):
  return args[layout.dst_i], {TRANSFER}


def _read(buf, slot, slotted):
  return jax.lax.dynamic_index_in_dim(buf, slot, 0, False) if slotted else buf


def _write(buf, val, slot, slotted):
  if not slotted:
    return val
  return jax.lax.dynamic_update_index_in_dim(buf, val, slot, 0)


def _move(bufs, slots, spec: OpSpec, layout: Layout):
  """The emulated transfer: the destination buffer after the data lands."""
  src = _read(bufs[layout.src_i], slots[0], layout.src_slotted)
  dst_buf = bufs[layout.dst_i]
  old = _read(dst_buf, slots[1], layout.dst_slotted)
  new = _registry.get(spec.kind).emulate(src, spec=spec).astype(old.dtype)
  new = new.reshape(old.shape)
  if spec.kind == "ppermute" and not spec.is_full_perm:
    # A device nobody sends to keeps its destination: no DMA writes it.
    me = jax.lax.axis_index(spec.axis_name)
    hit = jnp.isin(me, jnp.array(sorted(spec.destinations), jnp.int32))
    new = jnp.where(hit, new, old)
  return _write(dst_buf, new, slots[1], layout.dst_slotted)


def _start_emulated(*args, spec, layout):
  bufs, slots = args[: layout.n_bufs], args[layout.n_bufs]
  if spec.transfer == "start":
    dst = _move(bufs, slots, spec, layout)
  else:
    dst = bufs[layout.dst_i]
  return (dst,) + (jnp.zeros((), jnp.int32),) * n_sems(spec)


def _done_emulated(*args, spec, layout):
  bufs, slots = args[: layout.n_bufs], args[layout.n_bufs]
  if spec.transfer == "done":
    return _move(bufs, slots, spec, layout)
  return bufs[layout.dst_i]


def _start_tpu(*args, spec, layout):
  bufs, slots = args[: layout.n_bufs], args[layout.n_bufs]
  return tuple(_kernels.start(*bufs, slots=slots, spec=spec, layout=layout))


def _done_tpu(*args, spec, layout):
  n = layout.n_bufs
  bufs, slots, sems = args[:n], args[n], args[n + 1 :]
  return _kernels.done(*bufs, slots=slots, sems=sems, spec=spec, layout=layout)


jc.register_lowering(buf_start_p, _start_emulated)
jc.register_lowering(buf_done_p, _done_emulated, multiple_results=False)
jc.register_lowering(
  buf_start_p,
  _start_tpu,
  platform="tpu",
  prepare=_common.assign_collective_id,
)
jc.register_lowering(
  buf_done_p,
  _done_tpu,
  platform="tpu",
  sem_in=lambda p: range(
    p["layout"].n_bufs + 1, p["layout"].n_bufs + 1 + n_sems(p["spec"])
  ),
  multiple_results=False,
)


# Ref level ------------------------------------------------------------------

ref_start_p = jc.Primitive("asyncops_ref_start")
ref_start_p.multiple_results = True
ref_done_p = jc.Primitive("asyncops_ref_done")
ref_done_p.multiple_results = True


def _effects(layout: Layout):
  return jc.ref_effects(reads=[layout.src_i], writes=[layout.dst_i])


@ref_start_p.def_effectful_abstract_eval
def _ref_start_abstract(*args, spec, layout, token):
  del token
  dst = args[layout.dst_i].inner_aval
  return [jc.sem_like(dst)] * n_sems(spec), _effects(layout)


@ref_done_p.def_effectful_abstract_eval
def _ref_done_abstract(*args, spec, layout):
  del args, spec
  return [], _effects(layout)


def _slots(args, n):
  return jnp.stack([args[n], args[n + 1]]).astype(jnp.int32)


def _ref_start_discharge(in_avals, out_avals, *args, spec, layout, token):
  del in_avals, out_avals
  # Tracing is over when JAX discharges state: a fresh future now was
  # dropped without a done.
  _future.check_awaited(token, spec)
  if token in _future.unpinned:
    layout = dataclasses.replace(layout, pin_source=False)
  n = layout.n_bufs
  dst, *sems = buf_start_p.bind(
    *args[:n], _slots(args, n), spec=spec, layout=layout
  )
  new = [None] * len(args)
  new[layout.dst_i] = dst
  return new, sems


def _ref_done_discharge(in_avals, out_avals, *args, spec, layout):
  del in_avals, out_avals
  n = layout.n_bufs
  dst = buf_done_p.bind(
    *args[:n], _slots(args, n), *args[n + 2 :], spec=spec, layout=layout
  )
  new = [None] * len(args)
  new[layout.dst_i] = dst
  return new, []


jc.register_discharge(ref_start_p, _ref_start_discharge)
jc.register_discharge(ref_done_p, _ref_done_discharge)

# Differentiation rules register themselves on import.
from asyncops.stateful import _ad  # noqa: E402,F401
