"""Fused ring all-gather matmul: ``all_gather(x, 1, tiled) @ w``.

Algorithm. Inside ``shard_map`` over a ring of ``n`` devices, device ``i``
holds ``x`` ``[m, k]`` (chunk ``i`` of the contracting dimension) and every
row of ``w`` ``[n k, f]``. The chunks travel around the ring; every device
multiplies each chunk by its ``k`` rows of ``w`` as the chunk arrives and
accumulates the ``[m, f]`` product in float32 **in VMEM** (it never goes
back to HBM between steps), then writes the result once.

Two directions (``directions=2``): the columns of every chunk are split in
halves; the first half travels to ``i + 1``, the second to ``i - 1``, so
both directions of every ring link carry data and each link carries half a
chunk per step. Each row of ``w`` belongs to exactly one (chunk, half), so
``w`` is read from HBM once, streamed in ``[k/2, bn]`` blocks. (Splitting
rows instead, as the value-API ring does, reads ``w`` twice.) One
direction: whole chunks travel to ``i - 1``.

Kernels, in program order (all three appear in the compiled HLO):

1. ``asyncops_ring_allgather_start``: a two-round barrier with the ring
   neighbours (the second round on a kernel-local semaphore, jax-ml/jax PR
   #27963), then the first hop of every direction: ``x``'s halves into the
   neighbours' receive buffers. Returns the receive buffer ``[d, n - 1, m,
   k/d]`` (slot ``t`` of direction ``c`` holds the half used at step
   ``t + 1``; its first output, which ``benchmarks/`` routes) and DMA
   semaphore arrays ``[d, n - 1]`` for sends and receives.
2. ``ring_allgather_matmul``: grid ``(n, f / bn)``. Step ``s`` multiplies
   the halves it holds (``x`` at step 0) by their ``w`` blocks (streamed by
   the Pallas pipeline) into the float32 VMEM accumulator. After block
   ``max(nf - 2, 0)`` of step ``s < n - 1`` it waits for the halves of
   step ``s + 1``, forwards them one hop further (the next device needs
   them a whole step later) and starts copying them into the other slot of
   a VMEM double buffer, so the copy overlaps the step's last block. The
   last step adds its product and writes ``[m, bn]`` output blocks.
3. ``asyncops_ring_allgather_done``: waits for every send (the start's and
   each forward); it takes the result, so it runs after the compute kernel
   that starts the forwards.

XLA allocates the outputs of a kernel that communicates so that peers could
write into them; when such an output is the program's result XLA copies it
(measured on v5e: a 5 us copy of a 2 MiB bfloat16 result). Moving the last
step into a separate, non-communicating kernel avoids that copy but hands
the float32 accumulator between kernels, which ``benchmarks/`` charges as
two HBM round trips (each kernel is costed by a standalone jnp twin); it
modelled 57.8 us against 44.6 us for this form (v5e, chapter shape, bf16).

Limits. ``k / d`` a multiple of 128; ``f`` divisible by ``bn``; the
accumulator ``[m, f]`` (float32; int32 for int8), two ``[m, k]`` chunk
buffers and the ``w`` blocks must fit in VMEM (the caller splits ``m`` into
panels when they do not). One ring axis; other mesh axes keep this device's
coordinates.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from asyncops.kernels import _common as c


@dataclasses.dataclass(frozen=True)
class AgSpec:
  """Static description of one fused all-gather matmul.

  Attributes:
    axis_name: the ring's mesh axis.
    mesh_axes: every mesh axis name (peers are addressed by coordinates).
    n: ring size (>= 2).
    m: rows of ``x``.
    k: columns of ``x`` (one chunk of the contracting dimension).
    f: columns of ``w`` and of the result.
    dtype: dtype of the chunks that travel and meet the MXU.
    w_dtype: dtype of ``w`` as stored (cast to ``dtype`` in VMEM).
    out_dtype: the result's dtype.
    directions: 1 (whole chunks to ``i - 1``) or 2 (halves both ways).
    bn: columns of a ``w`` block and of an output block.
    precision: ``jax.lax.Precision`` name for the in-kernel dots.
    collective_id: barrier semaphore id of the start kernel.
    vmem_limit: VMEM bytes the compute kernel may use.
  """

  axis_name: str
  mesh_axes: tuple[str, ...]
  n: int
  m: int
  k: int
  f: int
  dtype: str
  w_dtype: str
  out_dtype: str
  directions: int = 2
  bn: int = 512
  precision: str = "DEFAULT"
  collective_id: int | None = None
  vmem_limit: int | None = None

  def __post_init__(self):
    if self.directions not in (1, 2):
      raise ValueError(f"directions must be 1 or 2, got {self.directions}")
    if self.n < 2:
      raise ValueError(f"the ring needs n >= 2 devices, got {self.n}")
    if self.k % self.directions or self.f % self.bn:
      raise ValueError(f"k/directions and f/bn must divide: {self}")

  @property
  def shifts(self) -> tuple[int, ...]:
    return (1, -1) if self.directions == 2 else (-1,)

  @property
  def kh(self) -> int:
    return self.k // self.directions

  @property
  def nf(self) -> int:
    return self.f // self.bn

  @property
  def acc_dtype(self):
    return jnp.int32 if jnp.dtype(self.dtype) == jnp.int8 else jnp.float32


def vmem_bytes(spec: AgSpec) -> int:
  """VMEM the compute kernel needs (accumulator, buffers, blocks)."""
  t = jnp.dtype(spec.dtype).itemsize
  w = jnp.dtype(spec.w_dtype).itemsize
  o = jnp.dtype(spec.out_dtype).itemsize
  return (
    spec.m * spec.f * 4  # accumulator
    + 2 * spec.m * spec.k * t  # chunk double buffer
    + 2 * spec.m * spec.k * t  # x block (Mosaic keeps two buffers)
    + 2 * spec.k * spec.bn * w  # w blocks, both halves, two buffers
    + 2 * spec.m * spec.bn * o  # output blocks
  )


def _chunk(me, shift: int, s, n: int):
  """The chunk a direction with ``shift`` holds at step ``s``."""
  return jax.lax.rem(me - shift * s + 2 * n * n, n)


def _peer(spec: AgSpec, me, shift: int):
  return c.peer(
    spec.mesh_axes, spec.axis_name, jax.lax.rem(me + shift + spec.n, spec.n)
  )


# Kernel bodies ---------------------------------------------------------------


def start_kernel(x_ref, recv_ref, send_sems, recv_sems, *, spec: AgSpec):
  """Barrier with the ring neighbours, then the first hop of each half."""
  me = jax.lax.axis_index(spec.axis_name)
  n, kh = spec.n, spec.kh
  barrier = pltpu.get_barrier_semaphore()
  # Each device tells the peers that send to it that it has entered.
  senders = [jax.lax.rem(me - sh + n, n) for sh in spec.shifts]
  for src in senders:
    c.signal(barrier, spec.mesh_axes, spec.axis_name, src)
  pl.semaphore_wait(barrier, len(senders))
  if len(senders) > 1:
    c.second_barrier(
      spec.mesh_axes,
      spec.axis_name,
      [(src, True) for src in senders],
      len(senders),
    )
  for d, sh in enumerate(spec.shifts):
    pltpu.make_async_remote_copy(
      x_ref.at[:, pl.ds(d * kh, kh)],
      recv_ref.at[d, 0],
      send_sems.at[d, 0],
      recv_sems.at[d, 0],
      device_id=_peer(spec, me, sh),
      device_id_type=pl.DeviceIdType.MESH,
    ).start()


def compute_kernel(
  me_ref,
  x_ref,
  w_ref,
  recv_ref,
  send_sems,
  recv_sems,
  o_ref,
  acc_ref,
  xbuf,
  copy_sems,
  *,
  spec: AgSpec,
):
  """Grid step ``(s, j, d)``: half ``d`` of output block ``j`` at step
  ``s`` (the two halves of a step meet different ``w`` rows, so they are
  two grid steps; ``w`` is one operand, read once)."""
  nd = spec.directions
  n, kh, bn, nf = spec.n, spec.kh, spec.bn, spec.nf
  s, j, d = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  slot = jax.lax.rem(s, 2)
  me = me_ref[0]

  @pl.when((s > 0) & (j == 0) & (d == 0))
  def _():
    for dd in range(nd):
      pltpu.make_async_copy(
        recv_ref.at[dd, 0],
        xbuf.at[slot, :, pl.ds(dd * kh, kh)],
        copy_sems.at[dd],
      ).wait()

  cols = pl.ds(pl.multiple_of(j * bn, bn), bn)
  half = pl.ds(pl.multiple_of(d * kh, kh), kh)
  held = jnp.where(s == 0, x_ref[:, half], xbuf[slot, :, half])
  y = jnp.dot(
    held,
    w_ref[...].astype(jnp.dtype(spec.dtype)),
    preferred_element_type=spec.acc_dtype,
    precision=jax.lax.Precision[spec.precision],
  )

  @pl.when((s == 0) & (d == 0))
  def _():
    acc_ref[:, cols] = y

  @pl.when(((s > 0) | (d > 0)) & ((s < n - 1) | (d < nd - 1)))
  def _():
    acc_ref[:, cols] += y

  @pl.when((s == n - 1) & (d == nd - 1))
  def _():
    o_ref[...] = (acc_ref[:, cols] + y).astype(o_ref.dtype)

  # Slot s holds the halves of step s + 1: wait for them, forward them (the
  # neighbour uses them as its slot s + 1, a whole step from now) unless
  # this is the last slot, and copy them into VMEM for the next step.
  @pl.when((s < n - 1) & (j == max(nf - 2, 0)) & (d == nd - 1))
  def _():
    for dd, sh in enumerate(spec.shifts):
      here = recv_ref.at[dd, s]
      c.wait_dma(here, recv_sems.at[dd, s])

      @pl.when(s <= n - 3)
      def _(dd=dd, sh=sh, here=here):
        pltpu.make_async_remote_copy(
          here,
          recv_ref.at[dd, s + 1],
          send_sems.at[dd, s + 1],
          recv_sems.at[dd, s + 1],
          device_id=_peer(spec, me, sh),
          device_id_type=pl.DeviceIdType.MESH,
        ).start()

      pltpu.make_async_copy(
        here, xbuf.at[1 - slot, :, pl.ds(dd * kh, kh)], copy_sems.at[dd]
      ).start()


def done_kernel(recv_ref, send_sems, *, spec: AgSpec):
  """Waits for every send (the start's and each forward)."""
  for d in range(spec.directions):
    for t in range(spec.n - 1):
      c.wait_dma(recv_ref.at[d, t], send_sems.at[d, t])


# pallas_calls ----------------------------------------------------------------


def _sem_array(spec: AgSpec):
  return pltpu.SemaphoreType.DMA((spec.directions, spec.n - 1))


def _recv_shape(x, spec: AgSpec):
  return c.shape_like(x, (spec.directions, spec.n - 1, spec.m, spec.kh))


def _shift_of(spec: AgSpec, d):
  """The shift of direction ``d`` (a traced grid index)."""
  if spec.directions == 1:
    return jnp.int32(spec.shifts[0])
  return jnp.where(d == 0, jnp.int32(1), jnp.int32(-1))


def _in_specs(spec: AgSpec):
  """``x`` (fetched once), then ``w``'s block ``[k/d, bn]``: rows of the
  chunk direction ``d`` holds at step ``s``, columns of block ``j``."""

  def w_index(s, j, d, me_ref):
    chunk = _chunk(me_ref[0], _shift_of(spec, d), s, spec.n)
    return (chunk * spec.directions + d, j)

  return [
    pl.BlockSpec(
      (spec.m, spec.k),
      lambda s, j, d, me: (0, 0),
      pipeline_mode=pl.Buffered(1),
    ),
    pl.BlockSpec((spec.kh, spec.bn), w_index),
  ]


def _out_block(spec: AgSpec):
  # Only the last step writes the output; before it every step maps to
  # block (0, 0), which is first written (and flushed) at (n - 1, 0, d).
  n = spec.n
  return pl.BlockSpec(
    (spec.m, spec.bn), lambda s, j, d, me: (0, jnp.where(s == n - 1, j, 0))
  )


def _scratch(spec: AgSpec):
  return [
    pltpu.VMEM((spec.m, spec.f), spec.acc_dtype),
    pltpu.VMEM((2, spec.m, spec.k), jnp.dtype(spec.dtype)),
    pltpu.SemaphoreType.DMA((spec.directions,)),
  ]


def _params(spec: AgSpec, collective_id=None):
  return pltpu.CompilerParams(
    dimension_semantics=("arbitrary",) * 3,
    has_side_effects=True,
    vmem_limit_bytes=spec.vmem_limit,
    collective_id=collective_id,
  )


_SMEM = pl.BlockSpec(memory_space=pltpu.SMEM)


def start(x, *, spec: AgSpec):
  """``x -> (recv, send_sems, recv_sems)``; begins the first hop.

  ``x`` is read by DMAs after this kernel returns; it is not aliased (no
  user code sees it, and aliasing a parameter makes XLA copy it). The done
  takes ``x`` as an operand, so XLA keeps it alive until the sends end.
  """
  return pl.pallas_call(
    functools.partial(start_kernel, spec=spec),
    out_shape=(
      c.hbm_like(_recv_shape(x, spec)),
      _sem_array(spec),
      _sem_array(spec),
    ),
    in_specs=[c.ANY],
    out_specs=(c.HBM, c.SEM, c.SEM),
    compiler_params=c.params(collective_id=spec.collective_id),
    name="asyncops_ring_allgather_start",
  )(x)


def compute(me, x, w, recv, send_sems, recv_sems, *, spec: AgSpec, out_shape):
  """The chunk matmuls and the forwards; returns the ``[m, f]`` result."""
  return pl.pallas_call(
    functools.partial(compute_kernel, spec=spec),
    out_shape=out_shape,
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1,
      grid=(spec.n, spec.nf, spec.directions),
      in_specs=_in_specs(spec) + [c.HBM, c.SEM, c.SEM],
      out_specs=_out_block(spec),
      scratch_shapes=_scratch(spec),
    ),
    compiler_params=_params(spec),
    name="ring_allgather_matmul",
  )(me, x, w, recv, send_sems, recv_sems)


def done(x, recv, out, send_sems, *, spec: AgSpec):
  """Waits for every send; returns a token nothing needs to read.

  Reads ``x`` and ``recv`` (so XLA keeps them alive until the sends end)
  and ``out`` (so it runs after the compute kernel, which starts the
  forwards it waits for). It has side effects, so XLA keeps it.
  """

  def kernel(x_ref, recv_ref, out_ref, send_sems, token_ref):
    del x_ref, out_ref
    done_kernel(recv_ref, send_sems, spec=spec)
    token_ref[0] = jnp.int32(0)

  return pl.pallas_call(
    kernel,
    out_shape=c.shape_like(x, (1,), jnp.int32),
    in_specs=[c.ANY, c.HBM, c.ANY, c.SEM],
    out_specs=_SMEM,
    compiler_params=c.params(),
    name="asyncops_ring_allgather_done",
  )(x, recv, out, send_sems)


def run(me, x, w, *, spec: AgSpec, out_shape):
  """The three kernels in order; returns the ``[m, f]`` result."""
  recv, send_sems, recv_sems = start(x, spec=spec)
  out = compute(
    me, x, w, recv, send_sems, recv_sems, spec=spec, out_shape=out_shape
  )
  done(x, recv, out, send_sems, spec=spec)
  return out


def one_kernel(me, x, w, *, spec: AgSpec, out_shape, interpret=None):
  """The three bodies in one kernel, semaphores as scratch.

  Pallas's TPU interpreter cannot return semaphores from a kernel, so the
  CPU tests run this form: the start body before the first grid step, the
  done body after the last. Same DMAs, waits and arithmetic as the three
  kernels.
  """
  nd = spec.directions

  def kernel(me_ref, x_ref, w_ref, x_any, o_ref, recv_ref, ss, rs, *scratch):
    s, j, d = pl.program_id(0), pl.program_id(1), pl.program_id(2)

    @pl.when((s == 0) & (j == 0) & (d == 0))
    def _():
      start_kernel(x_any, recv_ref, ss, rs, spec=spec)

    compute_kernel(
      me_ref, x_ref, w_ref, recv_ref, ss, rs, o_ref, *scratch, spec=spec
    )

    @pl.when((s == spec.n - 1) & (j == spec.nf - 1) & (d == nd - 1))
    def _():
      done_kernel(recv_ref, ss, spec=spec)

  out, _ = pl.pallas_call(
    kernel,
    out_shape=(out_shape, _recv_shape(x, spec)),
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1,
      grid=(spec.n, spec.nf, nd),
      in_specs=_in_specs(spec) + [c.ANY],
      out_specs=(_out_block(spec), c.ANY),
      scratch_shapes=[_sem_array(spec), _sem_array(spec)] + _scratch(spec),
    ),
    compiler_params=_params(spec, spec.collective_id),
    interpret=interpret,
    name="ring_allgather_matmul_one_kernel",
  )(me, x, w, x)
  return out
