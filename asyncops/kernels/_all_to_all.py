"""All-to-all of slots, the asynchronous half of a reduce-scatter.

Algorithm. The source is ``(n, *s)`` on every device, ``n =
spec.axis_size``; so is the destination. Device ``me`` sends its slot ``p``
to device ``p``, which stores it in its slot ``me``: afterwards slot ``j``
of device ``me``'s destination holds slot ``me`` of device ``j``'s source
(``jax.lax.all_to_all(x, axis, 0, 0)``). The start kernel:

1. starts a local async copy of slot ``me`` into its own slot ``me`` (no
   peer needed, so it overlaps the barrier),
2. signals the global barrier semaphore of all ``n - 1`` peers (each writes
   into this device's destination) and waits for ``n - 1`` signals,
3. runs the second, kernel-local barrier (``_common.second_barrier``): with
   ``n - 1 >= 2`` signals to wait for, a fast peer re-entering a later
   kernel with the same ``collective_id`` could otherwise satisfy the wait
   on its own (jax-ml/jax PR #27963),
4. starts ``n - 1`` remote DMAs, slot ``p`` into slot ``me`` of peer
   ``p``'s destination, visiting peers at ring offsets ``1 .. n - 1`` so no
   two devices target the same peer first.

Why this op exists: it is the transpose of the all-gather's raw layout. The
all-gather's destination holds slot ``j = x_j``, so the gradient of ``x_j``
is the sum over devices ``i`` of slot ``j`` of their cotangents: an
all-to-all of the cotangent slots, then a local sum (a reduce-scatter).
``asyncops.futures._ad`` starts it at the all-gather's done (transposed)
and waits for it at the all-gather's start (transposed), so the reverse
transfer runs while the backward pass computes, like the forward one. The
all-to-all is its own transpose.

Semaphores: one shared send and one shared receive semaphore, as in the
all-gather (a DMA semaphore counts bytes; a slot-sized wait returns once a
slot's worth has moved, in any order). The local copy counts on the send
semaphore. ``wait_send`` waits for ``n`` slots, ``wait_recv`` for ``n - 1``.

Limits. One mesh axis; ``x.shape[0]`` must be the axis size. Every device
sends ``n - 1`` slots at once. Dtypes must be DMA-able
(``_common.MOVABLE_DTYPES``).
"""

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from asyncops.kernels import _common as c
from asyncops.kernels import _registry
from asyncops.kernels._spec import OpSpec


def all_to_all_start_kernel(
  x_ref, aliased_x_ref, o_ref, send_sem, recv_sem, *, spec: OpSpec
):
  del aliased_x_ref
  n, axes, name = spec.axis_size, spec.mesh_axes, spec.axis_name
  me = jax.lax.axis_index(name)
  with jax.named_scope("local_copy"):
    pltpu.make_async_copy(x_ref.at[me], o_ref.at[me], send_sem).start()
  if n == 1:
    return
  peers = c.all_peers_barrier(spec, me)
  with jax.named_scope("dma"):
    for p in peers:
      pltpu.make_async_remote_copy(
        x_ref.at[p],
        o_ref.at[me],
        send_sem,
        recv_sem,
        device_id=c.peer(axes, name, p),
        device_id_type=pl.DeviceIdType.MESH,
      ).start()


def wait_send(x_ref, sems, *, spec: OpSpec):
  (send_sem,) = sems
  for _ in range(spec.axis_size):
    c.wait_dma(x_ref.at[0], send_sem)


wait_recv = c.wait_recv_slots


def start(x, *, spec: OpSpec):
  return c.start_call(
    all_to_all_start_kernel,
    x,
    (c.shape_like(x), c.shape_like(x)),
    spec=spec,
    name="asyncops_all_to_all_start",
  )


def emulate(x, *, spec: OpSpec):
  return jax.lax.all_to_all(x, spec.axis_name, 0, 0, tiled=True)


def validate(spec: OpSpec) -> None:
  if not spec.shape or spec.shape[0] != spec.axis_size:
    raise ValueError(
      f"all_to_all: x.shape = {spec.shape}; axis 0 must be the size of "
      f"axis {spec.axis_name!r} ({spec.axis_size}): slot p goes to device p."
    )


_registry.register(
  "all_to_all",
  _registry.KernelSet(
    send_sems=lambda spec: 1,
    recv_sems=lambda spec: 1,
    dst_shape=lambda spec: spec.shape,
    start=start,
    wait_send=wait_send,
    wait_recv=wait_recv,
    emulate=emulate,
    validate=validate,
  ),
)
