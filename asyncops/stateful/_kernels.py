"""TPU kernels of the stateful API: the value API's kernel bodies on Refs.

Algorithm. A stateful start takes the destination buffer as an operand and
aliases it to its output, so the DMA writes into the Ref's own buffer (the
value API's start allocates a fresh one). Its body is the op's existing
start kernel body (``asyncops.kernels._<kind>.<kind>_start_kernel``) called
on the source and destination views, a slot ``buf.at[i]`` where the Ref is
one. The stateful done reuses the op's ``wait_send``/``wait_recv`` bodies
the same way. The source is an input that is never aliased: reading it while
the DMA runs needs no copy, and the done's read keeps it alive.

Limits. Exactly one ``input_output_aliases`` entry per kernel (jax-ml/jax
#24023): the destination buffer, which is also the source buffer when both
are slots of one Ref. Slot indices travel in SMEM.
"""

import functools
import importlib

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from asyncops import _jax_compat as jc
from asyncops.kernels import _common as c
from asyncops.kernels import _registry
from asyncops.kernels._spec import OpSpec
from asyncops.stateful._layout import Layout

SMEM = pl.BlockSpec(memory_space=pltpu.SMEM)


def start_body(kind: str):
  """The value API's start kernel body for ``kind``."""
  module = importlib.import_module(f"asyncops.kernels._{kind}")
  return getattr(module, f"{kind}_start_kernel")


def _views(bufs, out, slots, layout: Layout):
  """Source and destination views inside a kernel."""
  src = out if layout.n_bufs == 1 else bufs[0]
  if layout.src_slotted:
    src = src.at[slots[0]]
  dst = out.at[slots[1]] if layout.dst_slotted else out
  return src, dst


def _io(bufs, layout: Layout):
  n = layout.n_bufs
  return [c.ANY] * n + [SMEM], {layout.dst_i: 0}, c.shape_like(bufs[-1])


def stateful_start_kernel(*refs, spec: OpSpec, layout: Layout, n_sems: int):
  n = layout.n_bufs
  bufs, slots_ref, out = refs[:n], refs[n], refs[n + 1]
  sems = refs[n + 2 : n + 2 + n_sems]
  slots = (slots_ref[0], slots_ref[1])
  src, dst = _views(bufs, out, slots, layout)
  start_body(spec.kind)(src, None, dst, *sems, spec=spec)


def stateful_done_kernel(*refs, spec: OpSpec, layout: Layout, n_sems: int):
  n = layout.n_bufs
  bufs, slots_ref = refs[:n], refs[n]
  sems = refs[n + 1 : n + 1 + n_sems]
  out = refs[n + 1 + n_sems]
  slots = (slots_ref[0], slots_ref[1])
  src, dst = _views(bufs, out, slots, layout)
  k = _registry.get(spec.kind)
  n_send = k.send_sems(spec)
  k.wait_send(src, sems[:n_send], spec=spec)
  k.wait_recv(dst, sems[n_send:], spec=spec)


def _pinned(bufs, layout: Layout):
  """The operands with a separate source pinned to HBM, for the start and
  the done: the DMA reads it until the done, and the done must hold that
  buffer, not a VMEM copy XLA would otherwise prefetch for it (and then
  free the original in flight). Pinned for the done only, XLA placed the
  source in VMEM for the start and gave the done an HBM copy: the buffer
  the DMA read could be freed in flight (``tests/test_guard.py``).

  Not pinned when ``layout.pin_source`` is False (jax < 0.10, a done in a
  capturing ``lax.cond`` / ``lax.switch`` branch): there the libtpu of jax
  0.9 prefetched the pinned source into VMEM for the conditional and
  handed the branch's done that copy (``_jax_compat.
  CAPTURED_DONE_SOURCE_LIVE``); unpinned, both kernels get the one
  buffer."""
  if layout.n_bufs == 1 or not layout.pin_source:
    return bufs
  bufs = list(bufs)
  bufs[layout.src_i] = jc.in_hbm(bufs[layout.src_i])
  return bufs


def start(*bufs, slots, spec: OpSpec, layout: Layout):
  """Starts the transfer into the destination buffer; ``(dst, *sems)``."""
  k = _registry.get(spec.kind)
  n_sems = k.send_sems(spec) + k.recv_sems(spec)
  in_specs, aliases, dst_shape = _io(bufs, layout)
  return pl.pallas_call(
    functools.partial(
      stateful_start_kernel, spec=spec, layout=layout, n_sems=n_sems
    ),
    out_shape=(dst_shape,) + (c.DMA,) * n_sems,
    in_specs=in_specs,
    out_specs=(c.ANY,) + (c.SEM,) * n_sems,
    input_output_aliases=aliases,
    compiler_params=c.params(collective_id=spec.collective_id),
    name=f"asyncops_{spec.kind}_ref_start",
  )(*_pinned(bufs, layout), slots.astype(jnp.int32))


def done(*bufs, slots, sems, spec: OpSpec, layout: Layout):
  """Waits for the transfer; returns the destination buffer (aliased)."""
  in_specs, aliases, dst_shape = _io(bufs, layout)
  return pl.pallas_call(
    functools.partial(
      stateful_done_kernel, spec=spec, layout=layout, n_sems=len(sems)
    ),
    out_shape=dst_shape,
    in_specs=in_specs + [c.SEM] * len(sems),
    out_specs=c.ANY,
    input_output_aliases=aliases,
    compiler_params=c.params(),
    name=f"asyncops_{spec.kind}_ref_done",
  )(*_pinned(bufs, layout), slots.astype(jnp.int32), *sems)
