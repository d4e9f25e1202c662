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

Kernels, in program order (all four appear in the compiled HLO):

1. ``asyncops_ring_allgather_start``: a two-round barrier with the ring
   neighbours (the second round on a kernel-local semaphore, jax-ml/jax PR
   #27963), then the first hop of every direction: ``x``'s halves into the
   neighbours' receive buffers. Returns the receive buffer ``[d, n - 1, m,
   k/d]`` (slot ``t`` of direction ``c`` holds the half used at step
   ``t + 1``; its first output, which ``benchmarks/`` routes) and DMA
   semaphore arrays ``[d, n - 1]`` for sends and receives.
2. ``ring_allgather_matmul``: steps ``0 .. n - 2``, grid ``(n - 1, f /
   bn)``. Step ``s`` multiplies the halves it holds (``x`` at step 0) by
   their ``w`` blocks (streamed by the Pallas pipeline) into the float32
   accumulator, a VMEM output. After block ``max(nf - 2, 0)`` of step
   ``s < n - 2`` it waits for the halves of step ``s + 1``, forwards them
   one hop further (the next device needs them a whole step later) and
   starts copying them into the other slot of a VMEM double buffer, so the
   copy overlaps the step's last block.
3. ``asyncops_ring_allgather_done``: waits for the last receive and for
   every send (the start's and each forward).
4. ``ring_allgather_matmul_finish``: step ``n - 1``: the last chunk's
   product plus the accumulator, written as ``[m, bn]`` output blocks.

Why the last step is its own kernel: XLA allocates every output of a kernel
that communicates so that peers could write into it, and copies such an
output when it is the program's result (measured on v5e: a 5 us copy of a
2 MiB bfloat16 result); the finish kernel does not communicate, so its
output is written where its consumer wants it. It also keeps the schedule
honest for tools that read it: the last chunk is multiplied after the wait
that proves it arrived.

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
    + spec.m * spec.k * t  # x block (fetched once)
    + 2 * spec.k * spec.bn * w  # w blocks, both halves, two buffers
    + 2 * spec.m * spec.bn * o  # output blocks (finish kernel)
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


def _product(halves, w_refs, spec: AgSpec):
  """``sum_d halves(d) @ w_refs[d]`` in the accumulator dtype."""
  out = None
  for d in range(spec.directions):
    y = jnp.dot(
      halves(d),
      w_refs[d][...].astype(jnp.dtype(spec.dtype)),
      preferred_element_type=spec.acc_dtype,
      precision=jax.lax.Precision[spec.precision],
    )
    out = y if out is None else out + y
  return out


def compute_kernel(
  me_ref,
  x_ref,
  *refs,
  spec: AgSpec,
):
  """Grid step ``(s, j)``, ``s < n - 1``: block ``j`` of step ``s``."""
  nd = spec.directions
  w_refs = refs[:nd]
  (recv_ref, send_sems, recv_sems, acc_ref, xbuf, copy_sems) = refs[nd:]
  n, kh, bn, nf = spec.n, spec.kh, spec.bn, spec.nf
  s, j = pl.program_id(0), pl.program_id(1)
  slot = jax.lax.rem(s, 2)
  me = me_ref[0]

  @pl.when((s > 0) & (j == 0))
  def _():
    for d in range(nd):
      pltpu.make_async_copy(
        recv_ref.at[d, 0], xbuf.at[slot, :, pl.ds(d * kh, kh)], copy_sems.at[d]
      ).wait()

  cols = pl.ds(pl.multiple_of(j * bn, bn), bn)

  @pl.when(s == 0)
  def _():
    acc_ref[:, cols] = _product(
      lambda d: x_ref[:, d * kh : (d + 1) * kh], w_refs, spec
    )

  @pl.when(s > 0)
  def _():
    acc_ref[:, cols] += _product(
      lambda d: xbuf[slot, :, d * kh : (d + 1) * kh], w_refs, spec
    )

  @pl.when((s < n - 2) & (j == max(nf - 2, 0)))
  def _():
    # Slot s holds the halves of step s + 1; the neighbour needs them as its
    # slot s + 1 (used at its step s + 2, a whole step from now).
    for d, sh in enumerate(spec.shifts):
      here = recv_ref.at[d, s]
      c.wait_dma(here, recv_sems.at[d, s])
      pltpu.make_async_remote_copy(
        here,
        recv_ref.at[d, s + 1],
        send_sems.at[d, s + 1],
        recv_sems.at[d, s + 1],
        device_id=_peer(spec, me, sh),
        device_id_type=pl.DeviceIdType.MESH,
      ).start()
      pltpu.make_async_copy(
        here, xbuf.at[1 - slot, :, pl.ds(d * kh, kh)], copy_sems.at[d]
      ).start()


def done_kernel(recv_ref, send_sems, recv_sems, *, spec: AgSpec):
  """Waits for the last receive and for every send."""
  last = spec.n - 2
  for d in range(spec.directions):
    c.wait_dma(recv_ref.at[d, last], recv_sems.at[d, last])
    for t in range(spec.n - 1):
      c.wait_dma(recv_ref.at[d, t], send_sems.at[d, t])


def finish_kernel(me_ref, acc_ref, *refs, spec: AgSpec):
  """Grid step ``j``: output block ``j`` = accumulator + last chunk's."""
  nd = spec.directions
  x_refs, w_refs, (o_ref,) = refs[:nd], refs[nd : 2 * nd], refs[2 * nd :]
  del me_ref
  cols = pl.ds(pl.multiple_of(pl.program_id(0) * spec.bn, spec.bn), spec.bn)
  y = _product(lambda d: x_refs[d][...], w_refs, spec)
  o_ref[...] = (acc_ref[:, cols] + y).astype(o_ref.dtype)


# pallas_calls ----------------------------------------------------------------


def _sem_array(spec: AgSpec):
  return pltpu.SemaphoreType.DMA((spec.directions, spec.n - 1))


def _recv_shape(x, spec: AgSpec):
  return c.shape_like(x, (spec.directions, spec.n - 1, spec.m, spec.kh))


def _w_spec(spec: AgSpec, d: int, shift: int, step=None):
  """``w`` block ``[k/d, bn]`` of direction ``d``: rows of the chunk held
  at step ``s`` (the grid's first index, or the fixed ``step``)."""
  nd = spec.directions

  if step is None:

    def index(s, j, me_ref):
      return (_chunk(me_ref[0], shift, s, spec.n) * nd + d, j)

  else:

    def index(j, me_ref):
      return (_chunk(me_ref[0], shift, step, spec.n) * nd + d, j)

  return pl.BlockSpec((spec.kh, spec.bn), index)


def _compute_grid_spec(spec: AgSpec, tail_specs, out_specs, sems_scratch=()):
  return pltpu.PrefetchScalarGridSpec(
    num_scalar_prefetch=1,
    grid=(spec.n - 1, spec.nf),
    in_specs=[
      pl.BlockSpec(
        (spec.m, spec.k), lambda s, j, me: (0, 0), pipeline_mode=pl.Buffered(1)
      )
    ]
    + [_w_spec(spec, d, sh) for d, sh in enumerate(spec.shifts)]
    + list(tail_specs),
    out_specs=out_specs,
    scratch_shapes=list(sems_scratch)
    + [
      pltpu.VMEM((2, spec.m, spec.k), jnp.dtype(spec.dtype)),
      pltpu.SemaphoreType.DMA((spec.directions,)),
    ],
  )


def _params(spec: AgSpec, n_dims: int, collective_id=None):
  return pltpu.CompilerParams(
    dimension_semantics=("arbitrary",) * n_dims,
    has_side_effects=True,
    vmem_limit_bytes=spec.vmem_limit,
    collective_id=collective_id,
  )


_VMEM = pl.BlockSpec(memory_space=pltpu.VMEM)
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


def compute(me, x, w, recv, send_sems, recv_sems, *, spec: AgSpec):
  """Steps ``0 .. n - 2`` and the forwards; returns the accumulator.

  The accumulator ``[m, f]`` is a VMEM output: it stays on chip until the
  finish kernel reads it.
  """
  return pl.pallas_call(
    functools.partial(compute_kernel, spec=spec),
    out_shape=pltpu.VMEM((spec.m, spec.f), spec.acc_dtype),
    grid_spec=_compute_grid_spec(spec, [c.HBM, c.SEM, c.SEM], _VMEM),
    compiler_params=_params(spec, 2),
    name="ring_allgather_matmul",
  )(me, x, *([w] * spec.directions), recv, send_sems, recv_sems)


def done(x, recv, acc, send_sems, recv_sems, *, spec: AgSpec):
  """Waits for the last receive and every send; returns ``recv``, ordered
  after the wait (the finish kernel reads its last slot).

  Takes the accumulator so it runs after the compute kernel, which starts
  the forwards it waits for. One alias (``recv``), jax-ml/jax#24023.
  """

  def kernel(x_ref, recv_ref, acc_ref, send_sems, recv_sems, out_ref):
    del x_ref, acc_ref, out_ref
    done_kernel(recv_ref, send_sems, recv_sems, spec=spec)

  return pl.pallas_call(
    kernel,
    out_shape=c.hbm_like(recv),
    in_specs=[c.ANY, c.HBM, _VMEM, c.SEM, c.SEM],
    out_specs=c.HBM,
    input_output_aliases={1: 0},
    compiler_params=c.params(),
    name="asyncops_ring_allgather_done",
  )(x, recv, acc, send_sems, recv_sems)


def finish(me, acc, recv, w, *, spec: AgSpec, out_shape):
  """Step ``n - 1``: ``acc + last chunk @ w``, cast, as ``[m, bn]`` blocks."""
  last = spec.n - 1

  def x_spec(d):
    return pl.BlockSpec(
      (None, None, spec.m, spec.kh), lambda j, me: (d, last - 1, 0, 0)
    )

  nd = spec.directions
  return pl.pallas_call(
    functools.partial(finish_kernel, spec=spec),
    out_shape=out_shape,
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1,
      grid=(spec.nf,),
      in_specs=[_VMEM]
      + [x_spec(d) for d in range(nd)]
      + [_w_spec(spec, d, sh, step=last) for d, sh in enumerate(spec.shifts)],
      out_specs=pl.BlockSpec((spec.m, spec.bn), lambda j, me: (0, j)),
    ),
    compiler_params=_params(spec, 1),
    name="ring_allgather_matmul_finish",
  )(me, acc, *([recv] * nd), *([w] * nd))


def run(me, x, w, *, spec: AgSpec, out_shape):
  """The four kernels in order; returns the ``[m, f]`` result."""
  recv, send_sems, recv_sems = start(x, spec=spec)
  acc = compute(me, x, w, recv, send_sems, recv_sems, spec=spec)
  recv = done(x, recv, acc, send_sems, recv_sems, spec=spec)
  return finish(me, acc, recv, w, spec=spec, out_shape=out_shape)


def one_kernel(me, x, w, *, spec: AgSpec, out_shape, interpret=None):
  """All four bodies in one kernel, semaphores as scratch.

  Pallas's TPU interpreter cannot return semaphores from a kernel, so the
  CPU tests run this form: grid ``(n, nf)``; the start body before the
  first step, the compute body for steps ``0 .. n - 2``, the done body and
  a copy of the last chunk into VMEM before step ``n - 1``, the finish body
  for it. Same DMAs, waits and arithmetic as the four kernels.
  """
  nd, n, kh = spec.directions, spec.n, spec.kh

  def kernel(me_ref, x_ref, *refs):
    w_refs = refs[:nd]
    x_any, o_ref, recv_ref, ss, rs, acc, last, xbuf, csems = refs[nd:]
    s, j = pl.program_id(0), pl.program_id(1)

    @pl.when((s == 0) & (j == 0))
    def _():
      start_kernel(x_any, recv_ref, ss, rs, spec=spec)

    @pl.when(s < n - 1)
    def _():
      compute_kernel(
        me_ref, x_ref, *w_refs, recv_ref, ss, rs, acc, xbuf, csems, spec=spec
      )

    @pl.when((s == n - 1) & (j == 0))
    def _():
      done_kernel(recv_ref, ss, rs, spec=spec)
      for d in range(nd):
        pltpu.sync_copy(recv_ref.at[d, n - 2], last.at[d])

    @pl.when(s == n - 1)
    def _():
      cols = pl.ds(pl.multiple_of(j * spec.bn, spec.bn), spec.bn)
      y = _product(lambda d: last[d], w_refs, spec)
      o_ref[...] = (acc[:, cols] + y).astype(o_ref.dtype)

  def w_index(d, sh):
    def index(s, j, me_ref):
      return (_chunk(me_ref[0], sh, s, n) * nd + d, j)

    return index

  out, _ = pl.pallas_call(
    kernel,
    out_shape=(out_shape, _recv_shape(x, spec)),
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1,
      grid=(n, spec.nf),
      in_specs=[pl.BlockSpec((spec.m, spec.k), lambda s, j, me: (0, 0))]
      + [
        pl.BlockSpec((kh, spec.bn), w_index(d, sh))
        for d, sh in enumerate(spec.shifts)
      ]
      + [c.ANY],
      out_specs=(
        pl.BlockSpec(
          (spec.m, spec.bn), lambda s, j, me: (0, jnp.where(s == n - 1, j, 0))
        ),
        c.ANY,
      ),
      scratch_shapes=[
        _sem_array(spec),
        _sem_array(spec),
        pltpu.VMEM((spec.m, spec.f), spec.acc_dtype),
        pltpu.VMEM((nd, spec.m, kh), jnp.dtype(spec.dtype)),
        pltpu.VMEM((2, spec.m, spec.k), jnp.dtype(spec.dtype)),
        pltpu.SemaphoreType.DMA((nd,)),
      ],
    ),
    compiler_params=_params(spec, 2, spec.collective_id),
    interpret=interpret,
    name="ring_allgather_matmul_one_kernel",
  )(me, x, *([w] * nd), x)
  return out
