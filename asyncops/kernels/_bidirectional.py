"""Bidirectional ring permute: half of ``x`` each way around the ring.

Algorithm. ``x`` is split along axis 0 into halves of ``h = x.shape[0] // 2``
rows. Device ``i`` of the ring over ``spec.axis_name`` (size ``n``) sends the
first half to ``right = i + 1`` and the second half to ``left = i - 1``
(modulo ``n``), so both ICI directions of the ring carry data. The result on
device ``i`` is ``concat(x_{i-1}[:h], x_{i+1}[h:])``. The start kernel:

1. signals the global barrier semaphore of both neighbours (each sends into
   this device's destination) and waits for two signals (both neighbours
   are ready to receive),
2. runs the second, kernel-local barrier (``_common.second_barrier``): this
   device waits for signals from two peers, so without it a fast neighbour
   re-entering a later kernel with the same ``collective_id`` could supply
   both signals on its own (jax-ml/jax PR #27963),
3. starts two remote DMAs, ``x[:h]`` into the right neighbour's ``o[:h]``
   and ``x[h:]`` into the left neighbour's ``o[h:]``, and returns: the
   aliased source, the destination and four DMA semaphores
   ``(send_right, send_left, recv_from_left, recv_from_right)``.

Each direction has its own send and receive semaphore; the done kernels wait
on each with a half-sized descriptor.

Axis size 2: both neighbours are the same device. It receives two barrier
signals from it, and both halves go to it over two DMAs; nothing changes.
Axis size 1: the device is its own neighbour, so the "transfer" is a local
copy. The kernel runs two local async copies (``x`` halves into ``o``) on the
*send* semaphores, with no barrier, and ``wait_recv`` waits for nothing: a
local copy's semaphore covers its read and its write, and ``recv_done``
always runs after ``send_done`` (or inside the combined done), so the
source is held until the copy has read it and the destination is complete
when it is returned.

Reversed ring. When ``spec.perm`` is the ring ``i -> i - 1`` the halves
swap directions: the first half goes to ``index - 1`` and the second to
``index + 1``. That is the transpose of the default ring (the gradient of
the row half that came from the left goes back to the left), so the
backward pass of a bidirectional permute is one bidirectional kernel too.

Whole (``spec.whole``). All of ``x`` travels each way, no halves: the
destination is twice ``x`` along the split axis, ``concat(x_{i-1},
x_{i+1})`` on device ``i``. Both DMAs read the one source, so the first
step of a ring of whole chunks (``collective_matmul._gather_rings``)
needs no buffer holding two copies of ``x``; its later steps send that
destination on with the default kernel. Its transpose is the reversed
default kernel on the destination's cotangent, then the sum of the two
halves that come back.

Split axis. The halves are taken along axis 0, except under ``jax.vmap``
with the batch at axis 0: the rows are then axis 1 (``spec.gather_axis``)
and each half is a strided DMA, so the batch needs no relayout.

Limits. ``x.shape[0]`` must be even (checked by ``bidirectional_start``).
On TPU each half is one DMA that Mosaic must be able to slice: 1-D halves
must be whole tiles (and, on jax 0.9, 2-D arrays whole 128-lane rows);
``check_tpu_halves`` refuses other shapes with the fix.
One mesh axis per call. Dtypes must be DMA-able (``_common.MOVABLE_DTYPES``).
"""

import functools

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from asyncops import _jax_compat as jc
from asyncops.kernels import _common as c
from asyncops.kernels import _registry
from asyncops.kernels._spec import OpSpec


def direction(spec: OpSpec) -> int:
  """+1 when the first half travels to ``index + 1`` (the default), -1 when
  ``spec.perm`` is the reversed ring (the transpose's transfer)."""
  n = spec.axis_size
  if n > 2 and spec.perm and (spec.perm[0][1] - spec.perm[0][0]) % n == n - 1:
    return -1
  return 1


def neighbours(spec: OpSpec) -> tuple[jax.Array, jax.Array]:
  """Traced ``(right, left)`` ring neighbours of this device.

  "right" receives the first half. It is ``index + 1`` for the default
  ring and ``index - 1`` for the reversed one (``direction(spec) == -1``).
  """
  n = spec.axis_size
  me = jax.lax.axis_index(spec.axis_name)
  plus, minus = jax.lax.rem(me + 1, n), jax.lax.rem(me + (n - 1), n)
  return (plus, minus) if direction(spec) == 1 else (minus, plus)


def split_axis(spec: OpSpec) -> int:
  """The axis halved: 0, or 1 under ``jax.vmap`` with the batch at 0
  (``spec.gather_axis`` holds it; the batch then needs no relayout)."""
  return spec.gather_axis


def halves(ref, spec: OpSpec):
  """The two halves of the source ``ref`` along ``split_axis(spec)``, as
  ref views (``ref``, or its ``spec.rows``, twice when ``spec.whole``)."""
  if spec.whole:
    lo = spec.rows[0] if spec.rows else 0
    lead = (slice(None),) * split_axis(spec)
    part = ref.at[(*lead, pl.ds(lo, sent_rows(spec)))]
    return part, part
  return _split(ref, spec.shape[split_axis(spec)] // 2, spec)


def sent_rows(spec: OpSpec) -> int:
  """How much of the split axis one direction moves."""
  if spec.whole and spec.rows:
    return spec.rows[1] - spec.rows[0]
  return spec.shape[split_axis(spec)] // (1 + (not spec.whole))


def dst_halves(ref, spec: OpSpec):
  """The two halves of the destination ``ref``, one per direction."""
  return _split(ref, sent_rows(spec), spec)


def _split(ref, h: int, spec: OpSpec):
  lead = (slice(None),) * split_axis(spec)
  return ref.at[(*lead, pl.ds(0, h))], ref.at[(*lead, pl.ds(h, h))]


def dst_shape(spec: OpSpec) -> tuple[int, ...]:
  """The source's shape, or twice what travels along the split axis if
  whole."""
  if not spec.whole:
    return spec.shape
  a = split_axis(spec)
  return (*spec.shape[:a], 2 * sent_rows(spec), *spec.shape[a + 1 :])


def bidirectional_start_kernel(
  x_ref,
  aliased_x_ref,
  o_ref,
  send_right,
  send_left,
  recv_left,
  recv_right,
  *,
  spec: OpSpec,
):
  del aliased_x_ref
  x_lo, x_hi = halves(x_ref, spec)
  o_lo, o_hi = dst_halves(o_ref, spec)
  if spec.axis_size == 1:
    with jax.named_scope("local_copy"):
      pltpu.make_async_copy(x_lo, o_lo, send_right).start()
      pltpu.make_async_copy(x_hi, o_hi, send_left).start()
    return
  right, left = neighbours(spec)
  axes, name = spec.mesh_axes, spec.axis_name
  with jax.named_scope("barrier"):
    barrier = pltpu.get_barrier_semaphore()
    c.signal(barrier, axes, name, left)
    c.signal(barrier, axes, name, right)
    pl.semaphore_wait(barrier, 2)
    c.second_barrier(axes, name, [(left, True), (right, True)], 2)
  with jax.named_scope("dma"):
    # The receive semaphore named here is the peer's (same kernel, same
    # output slot): the right neighbour receives x[:h] from its left.
    pltpu.make_async_remote_copy(
      x_lo,
      o_lo,
      send_right,
      recv_left,
      device_id=c.peer(axes, name, right),
      device_id_type=pl.DeviceIdType.MESH,
    ).start()
    pltpu.make_async_remote_copy(
      x_hi,
      o_hi,
      send_left,
      recv_right,
      device_id=c.peer(axes, name, left),
      device_id_type=pl.DeviceIdType.MESH,
    ).start()


def wait_send(x_ref, sems, *, spec: OpSpec):
  send_right, send_left = sems
  x_lo, x_hi = halves(x_ref, spec)
  c.wait_dma(x_lo, send_right)
  c.wait_dma(x_hi, send_left)


def wait_recv(o_ref, sems, *, spec: OpSpec):
  recv_left, recv_right = sems
  if spec.axis_size == 1:
    return  # The local copies signalled the send semaphores.
  o_lo, o_hi = dst_halves(o_ref, spec)
  c.wait_dma(o_lo, recv_left)
  c.wait_dma(o_hi, recv_right)


def check_tpu_halves(shape, dtype) -> None:
  """Refuses, with the fix, a shape whose halves Mosaic cannot DMA (it
  would fail to compile the kernel with an internal error)."""
  problem = jc.half_dma_problem(shape, dtype)
  if problem is not None:
    raise ValueError(
      f"bidirectional_start: x has shape {tuple(shape)} and dtype "
      f"{jax.numpy.dtype(dtype).name}; on TPU each half of axis 0 is one DMA "
      f"and {problem} (jax {jax.__version__}). Give x 2-D or higher rank "
      "(e.g. reshape it to [rows, 128 * k]) or pad axis 0, or use "
      "ppermute_start."
    )


def start(x, *, spec: OpSpec):
  # Whole: each destination half is one DMA, the size of x.
  check_tpu_halves(dst_shape(spec), x.dtype)
  return pl.pallas_call(
    functools.partial(bidirectional_start_kernel, spec=spec),
    out_shape=(
      jc.shape_like(x),
      c.shape_like(x, dst_shape(spec)),
      c.DMA,
      c.DMA,
      c.DMA,
      c.DMA,
    ),
    in_specs=[c.ANY],
    out_specs=(c.ANY, c.ANY, c.SEM, c.SEM, c.SEM, c.SEM),
    input_output_aliases={0: 0},
    compiler_params=c.params(
      collective_id=None if spec.axis_size == 1 else spec.collective_id
    ),
    name="asyncops_bidirectional_start",
  )(x)


def emulate(x, *, spec: OpSpec):
  a = split_axis(spec)
  if spec.whole:
    start = spec.rows[0] if spec.rows else 0
    part = jax.lax.slice_in_dim(x, start, start + sent_rows(spec), axis=a)
    lo, hi = part, part
  else:
    lo, hi = jax.numpy.split(x, 2, axis=a)
  n, d = spec.axis_size, direction(spec)
  right = [(i, (i + d) % n) for i in range(n)]
  left = [(i, (i - d) % n) for i in range(n)]
  return jax.numpy.concatenate(
    [
      jax.lax.ppermute(lo, spec.axis_name, right),
      jax.lax.ppermute(hi, spec.axis_name, left),
    ],
    axis=a,
  )


def validate(spec: OpSpec) -> None:
  a = split_axis(spec)
  if len(spec.shape) <= a or (spec.shape[a] % 2 and not spec.whole):
    raise ValueError(
      f"bidirectional_start: x.shape = {spec.shape}; axis {a} must be even "
      "(half of it goes each way). Pad x along axis 0, or use "
      "ppermute_start."
    )


_registry.register(
  "bidirectional",
  _registry.KernelSet(
    send_sems=lambda spec: 2,
    recv_sems=lambda spec: 2,
    dst_shape=dst_shape,
    start=start,
    wait_send=wait_send,
    wait_recv=wait_recv,
    emulate=emulate,
    validate=validate,
  ),
)
