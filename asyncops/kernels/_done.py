"""Done kernels, shared by every op: wait for sends, receives, or both.

A done kernel takes the semaphores a start kernel returned and blocks until
they have seen the transfers. The combined done also takes the source buffer
as an input it does not read, so XLA keeps the source alive until the done
(the lifetime problem of the design), and aliases the destination buffer to
its output, so every consumer of the result is ordered after the wait.

``send_done`` reads the source without aliasing it and returns it through
an optimization barrier with the wait's token (after it, the source may be
reused); it also passes the destination through (aliased), so the
``recv_done`` that takes it runs after the send wait: for the ops whose
local copy counts on the send semaphores (``copy``, the all-gather's and
all-to-all's own slot) the destination is complete only then, and without
that data edge XLA could schedule ``recv_done`` first (an optimization
barrier does not survive compilation as an order; design/inspect.md,
branch h-dmacover). ``recv_done`` aliases the destination. Each kernel has
exactly one ``input_output_aliases`` entry (several aliases on one kernel
gave wrong values in jax-ml/jax#24023).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from asyncops.kernels import _common as c
from asyncops.kernels import _registry
from asyncops.kernels._spec import OpSpec


def _dst_spec(spec: OpSpec):
  k = _registry.get(spec.kind)
  if k.dst_memory(spec) == "vmem":
    return pl.BlockSpec(memory_space=pltpu.VMEM)
  return c.ANY


def _dst_shape(dst, spec: OpSpec):
  k = _registry.get(spec.kind)
  if k.dst_memory(spec) == "vmem":
    return pltpu.VMEM(dst.shape, dst.dtype)
  return c.shape_like(dst)


def done_kernel(x_ref, o_ref, *refs, spec: OpSpec, n_send: int):
  *sems, aliased_o_ref = refs
  del aliased_o_ref
  k = _registry.get(spec.kind)
  k.wait_send(x_ref, sems[:n_send], spec=spec)
  k.wait_recv(o_ref, sems[n_send:], spec=spec)


def send_done_kernel(x_ref, dst_ref, *refs, spec: OpSpec):
  *sems, token_ref, aliased_dst_ref = refs
  del dst_ref, aliased_dst_ref
  _registry.get(spec.kind).wait_send(x_ref, sems, spec=spec)
  token_ref[0] = jnp.int32(0)


def recv_done_kernel(o_ref, *refs, spec: OpSpec):
  *sems, aliased_o_ref = refs
  del aliased_o_ref
  _registry.get(spec.kind).wait_recv(o_ref, sems, spec=spec)


def done(x, dst, *sems, spec: OpSpec):
  """Waits for sends and receives; returns the destination (aliased)."""
  n_send = _registry.get(spec.kind).send_sems(spec)
  return pl.pallas_call(
    functools.partial(done_kernel, spec=spec, n_send=n_send),
    out_shape=_dst_shape(dst, spec),
    in_specs=[c.ANY, _dst_spec(spec)] + [c.SEM] * len(sems),
    out_specs=_dst_spec(spec),
    input_output_aliases={1: 0},
    compiler_params=c.params(),
    name=f"asyncops_{spec.kind}_done",
  )(x, dst, *sems)


def send_done(x, dst, *send_sems, spec: OpSpec):
  """Waits for the sends; returns the source, now free to reuse, and the
  destination (aliased, untouched: for the receive wait to take).

  The source is a plain (not aliased) input: if the program also reads it
  before this wait, XLA has no reason to copy it, and the buffer the DMA
  reads stays alive until the wait. (With an alias, XLA copied the source
  and handed the copy to the wait, so the real source could be freed while
  the DMA still read it.) A tiny SMEM token orders the returned source after
  the wait, through an optimization barrier. The destination goes through
  the kernel so that ``recv_done`` depends on this wait by data.
  """
  token, dst = pl.pallas_call(
    functools.partial(send_done_kernel, spec=spec),
    out_shape=(c.shape_like(x, (1,), jnp.int32), _dst_shape(dst, spec)),
    in_specs=[c.ANY, _dst_spec(spec)] + [c.SEM] * len(send_sems),
    out_specs=(pl.BlockSpec(memory_space=pltpu.SMEM), _dst_spec(spec)),
    input_output_aliases={1: 1},
    compiler_params=c.params(),
    name=f"asyncops_{spec.kind}_send_done",
  )(x, dst, *send_sems)
  x, _ = jax.lax.optimization_barrier((x, token))
  return x, dst


def recv_done(dst, *recv_sems, spec: OpSpec):
  """Waits for the receives; returns the destination (aliased)."""
  return pl.pallas_call(
    functools.partial(recv_done_kernel, spec=spec),
    out_shape=_dst_shape(dst, spec),
    in_specs=[_dst_spec(spec)] + [c.SEM] * len(recv_sems),
    out_specs=_dst_spec(spec),
    input_output_aliases={0: 0},
    compiler_params=c.params(),
    name=f"asyncops_{spec.kind}_recv_done",
  )(dst, *recv_sems)
