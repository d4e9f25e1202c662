"""All-gather by direct remote DMAs into every peer's destination.

Algorithm. The destination (the *raw* layout) is ``(n, *x.shape)`` on every
device, ``n = spec.axis_size``; slot ``j`` receives device ``j``'s shard.
The start kernel on device ``me``:

1. starts a local async copy of ``x`` into its own slot ``o[me]`` (it needs
   no peer, so it overlaps the barrier),
2. signals the global barrier semaphore of all ``n - 1`` peers (each of them
   writes into this device's destination) and waits for ``n - 1`` signals,
3. runs the second, kernel-local barrier with the same peers
   (``_common.second_barrier``): with ``n - 1 >= 2`` signals to wait for, a
   fast peer re-entering a later kernel with the same ``collective_id`` could
   otherwise satisfy the wait on its own (jax-ml/jax PR #27963),
4. starts ``n - 1`` remote DMAs of ``x`` into slot ``me`` of every peer's
   destination, visiting peers at ring offsets ``1 .. n - 1`` so that no two
   devices target the same peer first.

``finalize`` (outside the kernels, after the done) turns the raw layout into
``jax.lax.all_gather(x, axis_name, axis=spec.gather_axis,
tiled=spec.tiled)``'s: a ``moveaxis`` of the slot axis, then for ``tiled`` a
reshape merging it into the next axis. The CPU emulation produces the raw
layout with ``lax.all_gather(x, axis=0, tiled=False)`` so ``finalize`` is
shared and tested on every platform.

Semaphores: one shared send and one shared receive semaphore, not one per
peer. A DMA semaphore counts the bytes (not the transfers) that have moved,
and a wait consumes the size of its descriptor, so waiting ``k`` times with
a shard-sized descriptor returns exactly when ``k`` shards have moved, in
whatever order they finish. The done kernels wait for all of them anyway, so
per-peer semaphores would buy nothing but ``2 (n - 1)`` more semaphore
operands threaded through the HLO of every future (and the semaphore pool is
small). The local copy signals the *send* semaphore: it reads the source,
so ``send_done`` must cover it before the source may be reused; it also
writes slot ``me``, and ``recv_done`` always runs after ``send_done`` (or
inside the combined done), so the destination is complete when returned.
``wait_send`` waits ``n`` shards (``n - 1`` remote reads plus the local
copy); ``wait_recv`` waits ``n - 1`` shards.

Limits. One mesh axis per call. Every device sends ``n - 1`` shards at once;
for large ``n`` and large shards a ring (``ppermute`` in a loop) may use ICI
links better. Axis size 1 is a local copy with no barrier. Dtypes must be
DMA-able (``_common.MOVABLE_DTYPES``).
"""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from asyncops import _jax_compat as jc
from asyncops.kernels import _common as c
from asyncops.kernels import _registry
from asyncops.kernels._spec import OpSpec


def dst_shape(spec: OpSpec) -> tuple[int, ...]:
  return (spec.axis_size, *spec.shape)


def all_gather_start_kernel(
  x_ref, aliased_x_ref, o_ref, send_sem, recv_sem, *, spec: OpSpec
):
  del aliased_x_ref
  n, axes, name = spec.axis_size, spec.mesh_axes, spec.axis_name
  me = jax.lax.axis_index(name)
  with jax.named_scope("local_copy"):
    pltpu.make_async_copy(x_ref, o_ref.at[me], send_sem).start()
  if n == 1:
    return
  peers = c.all_peers_barrier(spec, me)
  with jax.named_scope("dma"):
    for p in peers:
      pltpu.make_async_remote_copy(
        x_ref,
        o_ref.at[me],
        send_sem,
        recv_sem,
        device_id=c.peer(axes, name, p),
        device_id_type=pl.DeviceIdType.MESH,
      ).start()


def wait_send(x_ref, sems, *, spec: OpSpec):
  (send_sem,) = sems
  for _ in range(spec.axis_size):
    c.wait_dma(x_ref, send_sem)


wait_recv = c.wait_recv_slots


def start(x, *, spec: OpSpec):
  return c.start_call(
    all_gather_start_kernel,
    x,
    (jc.shape_like(x), c.shape_like(x, dst_shape(spec))),
    spec=spec,
    name="asyncops_all_gather_start",
  )


def emulate(x, *, spec: OpSpec):
  return jax.lax.all_gather(x, spec.axis_name, axis=0, tiled=False)


def finalize(raw, spec: OpSpec):
  """The raw ``(n, *shape)`` slots in ``lax.all_gather``'s layout."""
  a = spec.gather_axis
  out = jnp.moveaxis(raw, 0, a)
  if spec.tiled:
    shape = spec.shape
    out = out.reshape((*shape[:a], spec.axis_size * shape[a], *shape[a + 1 :]))
  return out


def validate(spec: OpSpec) -> None:
  ndim = len(spec.shape) + (0 if spec.tiled else 1)
  if not 0 <= spec.gather_axis < ndim:
    raise ValueError(
      f"all_gather_start: axis={spec.gather_axis} is out of range for a "
      f"result of rank {ndim} (x.shape = {spec.shape}, tiled="
      f"{spec.tiled}). Pass an axis in [{-ndim}, {ndim})."
    )


_registry.register(
  "all_gather",
  _registry.KernelSet(
    send_sems=lambda spec: 1,
    recv_sems=lambda spec: 1,
    dst_shape=dst_shape,
    start=start,
    wait_send=wait_send,
    wait_recv=wait_recv,
    emulate=emulate,
    finalize=finalize,
    validate=validate,
  ),
)
