"""Collective permute split into a start kernel and done kernels.

Algorithm. ``perm`` is a static list of ``(source, destination)`` pairs along
one mesh axis, as for ``jax.lax.ppermute``. Each device looks up, from its
``axis_index``, whom it sends to and whom it receives from (either may be
absent for a partial perm). The start kernel:

1. signals the barrier semaphore of its source (it is ready to receive),
2. waits for one signal from its destination (the destination is ready),
3. starts one remote DMA of the whole source buffer into the destination
   device's output buffer, and returns: the aliased source, the destination
   buffer being written, a send semaphore and a receive semaphore.

The done kernels (``asyncops.kernels._done``) wait on those semaphores: the
send wait after which the source may be reused, the receive wait after which
the destination holds the data. Devices that receive from no one get zeros,
as with ``jax.lax.ppermute``; the zeroing is an elementwise select after the
receive, so no buffer is written while a DMA may target it.

On an axis of size 1 the "permute" is a local async copy (or nothing, for an
empty perm), with no barrier and no collective id.

Limits. One mesh axis per call. The source moves as one DMA; dtypes must be
DMA-able (``_common.MOVABLE_DTYPES``). Every device waits for at most one
barrier signal, so reusing the collective id across calls is safe.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from asyncops import _jax_compat as jc
from asyncops.kernels import _common as c
from asyncops.kernels import _registry
from asyncops.kernels._spec import OpSpec


def ring_shift(spec: OpSpec) -> int | None:
  """The shift if ``perm`` is a full ring rotation, else None."""
  n = spec.axis_size
  if not spec.perm or len(spec.perm) != n:
    return None
  s0, d0 = spec.perm[0]
  k = (d0 - s0) % n
  if all((d - s) % n == k for s, d in spec.perm):
    return k
  return None


def peers(spec: OpSpec) -> tuple[jax.Array, jax.Array]:
  """Traced ``(destination, source)`` of this device; -1 where absent."""
  me = jax.lax.axis_index(spec.axis_name)
  shift = ring_shift(spec)
  if shift is not None:
    n = spec.axis_size
    return jax.lax.rem(me + shift, n), jax.lax.rem(me + (n - shift), n)
  dst_of = dict(spec.perm)
  src_of = {d: s for s, d in spec.perm}
  return c.lookup(me, dst_of), c.lookup(me, src_of)


def ppermute_start_kernel(
  x_ref, aliased_x_ref, o_ref, send_sem, recv_sem, *, spec: OpSpec
):
  del aliased_x_ref
  if spec.axis_size == 1:
    # Alone on the axis: a local copy, no barrier, counted on the send
    # semaphore (so send_done cannot release x before it was read).
    if spec.perm:
      pltpu.make_async_copy(x_ref, o_ref, send_sem).start()
    return
  dst, src = peers(spec)
  barrier = pltpu.get_barrier_semaphore()

  @pl.when(src >= 0)
  def _():
    c.signal(barrier, spec.mesh_axes, spec.axis_name, src)

  @pl.when(dst >= 0)
  def _():
    pl.semaphore_wait(barrier, 1)
    pltpu.make_async_remote_copy(
      x_ref,
      o_ref,
      send_sem,
      recv_sem,
      device_id=c.peer(spec.mesh_axes, spec.axis_name, dst),
      device_id_type=pl.DeviceIdType.MESH,
    ).start()


def wait_send(x_ref, sems, *, spec: OpSpec):
  (send_sem,) = sems
  if spec.axis_size == 1:
    if spec.perm:
      c.wait_dma(x_ref, send_sem)
    return
  dst, _ = peers(spec)

  @pl.when(dst >= 0)
  def _():
    c.wait_dma(x_ref, send_sem)


def wait_recv(o_ref, sems, *, spec: OpSpec):
  (recv_sem,) = sems
  if spec.axis_size == 1:
    return  # the local copy was awaited on the send semaphore
  _, src = peers(spec)

  @pl.when(src >= 0)
  def _():
    c.wait_dma(o_ref, recv_sem)


def start(x, *, spec: OpSpec):
  return c.start_call(
    ppermute_start_kernel,
    x,
    (jc.shape_like(x), c.shape_like(x, spec.shape)),
    spec=spec,
    name="asyncops_ppermute_start",
  )


def emulate(x, *, spec: OpSpec):
  return jax.lax.ppermute(x, spec.axis_name, spec.perm)


def finalize(dst, spec: OpSpec):
  if spec.is_full_perm:
    return dst
  me = jax.lax.axis_index(spec.axis_name)
  receives = functools.reduce(
    jnp.logical_or,
    [me == d for d in sorted(spec.destinations)],
    jnp.bool_(False),
  )
  return jnp.where(receives, dst, jnp.zeros_like(dst))


_registry.register(
  "ppermute",
  _registry.KernelSet(
    send_sems=lambda spec: 1,
    recv_sems=lambda spec: 1,
    dst_shape=lambda spec: spec.shape,
    start=start,
    wait_send=wait_send,
    wait_recv=wait_recv,
    emulate=emulate,
    finalize=finalize,
  ),
)
