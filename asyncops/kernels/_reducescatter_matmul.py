"""Fused ring matmul-reduce-scatter: ``psum_scatter(x @ w, 1, tiled)``.

Algorithm. Inside ``shard_map`` over a ring of ``n`` devices each device
holds ``x`` ``[m, k]`` and ``w`` ``[k, n c]``; the result on device ``i``
is column block ``i`` (``c`` wide) of the sum over devices of ``x @ w``.
Partial sums travel around the ring and each device adds its own
contribution as they pass (the chapter's "permute the result as you
accumulate it"): at step ``s`` a device computes its product for one
block, adds the partial sum of that block it received from its
neighbour, and sends the sum on; after ``n - 1`` hops each block has
collected every device's contribution on the device that owns it. Only the
partial sums move, never ``x`` or ``w``.

Two directions (``directions=2``): the columns of every block are split in
halves; partial sums of first halves travel to ``i + 1`` (block ``i - s -
1`` at step ``s``), of second halves to ``i - 1`` (block ``i + s + 1``).
Each column of ``w`` is used at exactly one step, so ``w`` is read once.

Steps and kernels, in program order:

0. ``ring_reducescatter_matmul_first``: step 0, which has no partial sum
   to add, as a plain (non-communicating) matmul: ``p0 [d, m, c/d]`` in
   the transfer dtype. (XLA's own matmul of these column-sliced halves
   estimates 4.5x its FLOPs on v5e.)
1. ``asyncops_ring_reducescatter_start``: a two-round barrier with the ring
   neighbours, then sends ``p0``'s halves into their receive buffers.
   Returns the receive buffer ``[d, n - 1, m, c/d]`` (slot ``t`` holds the
   partial sum a device adds at step ``t + 1``; its first output, which
   ``benchmarks/`` routes) and DMA semaphore arrays ``[d, n - 1]``.
2. ``ring_reducescatter_matmul`` (``n >= 3``): steps ``1 .. n - 2``, grid
   ``(n - 2, d, c / (d bn))``. Each ``[m, bn]`` product block accumulates
   into a float32 VMEM buffer. After block ``max(nb - 2, 0)`` of a half it
   waits for the neighbour's partial sum and starts copying it into VMEM;
   after the last block it adds it, casts, and sends the sum on from a
   VMEM double buffer (a send two steps back is awaited before its buffer
   is reused, the last two at the kernel's end).
3. ``asyncops_ring_reducescatter_done``: waits for the last receive and the
   start's sends.
4. ``ring_reducescatter_matmul_finish``: step ``n - 1``: the device's own
   block, ``x @ w[:, block] + received``, written as ``[m, bn]`` blocks. It
   does not communicate, so XLA writes its output where the consumer wants
   it (outputs of communicating kernels are copied when they are the
   program's result).

The travelling partial sums have the transfer dtype (the input dtype, as
XLA's reduce-scatter), so bfloat16 sums round once per hop; each device's
own products accumulate in float32.

Limits. ``c / d`` a multiple of 128 and of ``bn``; ``x`` ``[m, k]``, the
float32 partial ``[m, c/d]`` and the send/receive buffers must fit in VMEM
(the caller splits ``m`` into panels when they do not). One ring axis.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from asyncops.kernels import _common as c


@dataclasses.dataclass(frozen=True)
class RsSpec:
  """Static description of one fused matmul-reduce-scatter.

  Attributes:
    axis_name: the ring's mesh axis.
    mesh_axes: every mesh axis name.
    n: ring size (>= 2).
    m: rows of ``x``.
    k: columns of ``x`` (rows of ``w``).
    c: columns of one output block (``w`` has ``n c``).
    dtype: dtype of ``x`` and ``w`` at the MXU, and of the partial sums
      that travel.
    out_dtype: the result's dtype.
    directions: 1 (partial sums to ``i + 1``) or 2 (halves both ways).
    bn: columns of a ``w`` block.
    precision: ``jax.lax.Precision`` name for the in-kernel dots.
    collective_id: barrier semaphore id of the start kernel.
    vmem_limit: VMEM bytes the compute kernels may use.
  """

  axis_name: str
  mesh_axes: tuple[str, ...]
  n: int
  m: int
  k: int
  c: int
  dtype: str
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
    if self.c % self.directions or self.ch % self.bn:
      raise ValueError(f"c/directions and bn must divide: {self}")

  @property
  def shifts(self) -> tuple[int, ...]:
    return (1, -1) if self.directions == 2 else (1,)

  @property
  def ch(self) -> int:
    """Columns of one direction's half of a block."""
    return self.c // self.directions

  @property
  def nb(self) -> int:
    """``w`` blocks per half block."""
    return self.ch // self.bn

  @property
  def acc_dtype(self):
    return jnp.int32 if jnp.dtype(self.dtype) == jnp.int8 else jnp.float32


def vmem_bytes(spec: RsSpec) -> int:
  """VMEM the compute kernel needs."""
  t = jnp.dtype(spec.dtype).itemsize
  return (
    spec.m * spec.k * t  # x block (fetched once)
    + 2 * spec.k * spec.bn * t  # w blocks
    + spec.m * spec.ch * 4  # float32 partial of one half
    + spec.m * spec.ch * t  # received partial
    + 2 * spec.directions * spec.m * spec.ch * t  # send double buffer
  )


def block_of(me, shift, s, n: int):
  """The block a direction with ``shift`` works on at step ``s``."""
  return jax.lax.rem(me - shift * (s + 1) + 2 * n * n, n)


def _peer(spec: RsSpec, me, shift: int):
  return c.peer(
    spec.mesh_axes, spec.axis_name, jax.lax.rem(me + shift + spec.n, spec.n)
  )


def _shift_of(spec: RsSpec, d):
  """The shift of direction ``d`` (a traced grid index)."""
  if spec.directions == 1:
    return jnp.int32(spec.shifts[0])
  return jnp.where(d == 0, jnp.int32(1), jnp.int32(-1))


# Kernel bodies ---------------------------------------------------------------


def start_kernel(p_ref, recv_ref, send_sems, recv_sems, *, spec: RsSpec):
  """Barrier with the ring neighbours, then step 0's partial sums."""
  me = jax.lax.axis_index(spec.axis_name)
  n = spec.n
  barrier = pltpu.get_barrier_semaphore()
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
      p_ref.at[d],
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
  part,
  rbuf,
  sbuf,
  copy_sem,
  *,
  spec: RsSpec,
  offset: int = 1,
):
  """Grid step ``(s - offset, d, j)``: block ``j`` of half ``d`` at step
  ``s`` (``1 <= s <= n - 2``)."""
  n, nb, bn = spec.n, spec.nb, spec.bn
  s = pl.program_id(0) + offset
  d = pl.program_id(1)
  j = pl.program_id(2)
  me = me_ref[0]
  slot = jax.lax.rem(s, 2)

  part[:, pl.ds(pl.multiple_of(j * bn, bn), bn)] = jnp.dot(
    x_ref[...],
    w_ref[...].astype(x_ref.dtype),
    preferred_element_type=spec.acc_dtype,
    precision=jax.lax.Precision[spec.precision],
  )

  # Slot s - 1 holds the neighbour's partial sum of this step's block.
  @pl.when(j == max(nb - 2, 0))
  def _():
    here = recv_ref.at[d, s - 1]
    c.wait_dma(here, recv_sems.at[d, s - 1])
    pltpu.make_async_copy(here, rbuf, copy_sem).start()

  @pl.when(j == nb - 1)
  def _():
    pltpu.make_async_copy(recv_ref.at[d, s - 1], rbuf, copy_sem).wait()

    # The send from this buffer two steps back must be done.
    @pl.when(s >= 3)
    def _():
      c.wait_dma(sbuf.at[slot, d], send_sems.at[d, s - 2])

    sbuf[slot, d] = (part[...] + rbuf[...].astype(part.dtype)).astype(
      sbuf.dtype
    )
    for dd, sh in enumerate(spec.shifts):

      @pl.when(d == dd)
      def _(dd=dd, sh=sh):
        pltpu.make_async_remote_copy(
          sbuf.at[slot, dd],
          recv_ref.at[dd, s],
          send_sems.at[dd, s],
          recv_sems.at[dd, s],
          device_id=_peer(spec, me, sh),
          device_id_type=pl.DeviceIdType.MESH,
        ).start()

  # Before the kernel ends (its VMEM goes away) the last sends must be done.
  last = (s == n - 2) & (d == spec.directions - 1)

  @pl.when(last & (j == nb - 1))
  def _():
    for t in range(max(1, n - 3), n - 1):
      for dd in range(spec.directions):
        c.wait_dma(sbuf.at[t % 2, dd], send_sems.at[dd, t])


def done_kernel(recv_ref, send_sems, recv_sems, p_ref, *, spec: RsSpec):
  """Waits for the last receive and for the start's sends."""
  last = spec.n - 2
  for d in range(spec.directions):
    c.wait_dma(recv_ref.at[d, last], recv_sems.at[d, last])
    c.wait_dma(p_ref.at[d], send_sems.at[d, 0])


def finish_kernel(me_ref, x_ref, w_ref, r_ref, o_ref, *, spec: RsSpec):
  """Output block ``j``: own product plus the received partial sum."""
  del me_ref
  y = jnp.dot(
    x_ref[...],
    w_ref[...].astype(x_ref.dtype),
    preferred_element_type=spec.acc_dtype,
    precision=jax.lax.Precision[spec.precision],
  )
  o_ref[...] = (y + r_ref[...].astype(y.dtype)).astype(o_ref.dtype)


# pallas_calls ----------------------------------------------------------------


def _sem_array(spec: RsSpec):
  return pltpu.SemaphoreType.DMA((spec.directions, spec.n - 1))


def _recv_shape(p, spec: RsSpec):
  return c.shape_like(p, (spec.directions, spec.n - 1, spec.m, spec.ch))


def _params(spec: RsSpec, n_dims: int):
  return pltpu.CompilerParams(
    dimension_semantics=("arbitrary",) * n_dims,
    has_side_effects=True,
    vmem_limit_bytes=spec.vmem_limit,
  )


_VMEM = pl.BlockSpec(memory_space=pltpu.VMEM)


def _x_block(spec: RsSpec, index):
  """``x`` whole, fetched once (one buffer: its block never changes)."""
  return pl.BlockSpec((spec.m, spec.k), index, pipeline_mode=pl.Buffered(1))


def first(me, x, w, *, spec: RsSpec):
  """Step 0: ``[d, m, c/d]`` partial sums in the transfer dtype.

  No partial sum arrives before step 0, so this is a plain matmul of each
  half against its block's columns, streamed in ``[k, bn]`` blocks; it does
  not communicate.
  """
  nb, bn = spec.nb, spec.bn
  cb = spec.c // bn

  def w_index(d, j, me_ref):
    b = block_of(me_ref[0], _shift_of(spec, d), 0, spec.n)
    return (0, b * cb + d * nb + j)

  def kernel(me_ref, x_ref, w_ref, o_ref):
    del me_ref
    o_ref[...] = jnp.dot(
      x_ref[...],
      w_ref[...].astype(x_ref.dtype),
      preferred_element_type=spec.acc_dtype,
      precision=jax.lax.Precision[spec.precision],
    ).astype(o_ref.dtype)

  return pl.pallas_call(
    kernel,
    out_shape=c.shape_like(x, (spec.directions, spec.m, spec.ch)),
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1,
      grid=(spec.directions, nb),
      in_specs=[
        _x_block(spec, lambda d, j, me: (0, 0)),
        pl.BlockSpec((spec.k, bn), w_index),
      ],
      out_specs=pl.BlockSpec((None, spec.m, bn), lambda d, j, me: (d, 0, j)),
    ),
    compiler_params=_params(spec, 2),
    name="ring_reducescatter_first",
  )(me, x, w)


def start(p, *, spec: RsSpec):
  """``p [d, m, c/d] -> (recv, send_sems, recv_sems)``; sends step 0."""
  return pl.pallas_call(
    functools.partial(start_kernel, spec=spec),
    out_shape=(
      c.hbm_like(_recv_shape(p, spec)),
      _sem_array(spec),
      _sem_array(spec),
    ),
    in_specs=[c.ANY],
    out_specs=(c.HBM, c.SEM, c.SEM),
    compiler_params=c.params(collective_id=spec.collective_id),
    name="asyncops_ring_reducescatter_start",
  )(p)


def compute(me, x, w, recv, send_sems, recv_sems, *, spec: RsSpec):
  """Steps ``1 .. n - 2`` (``n >= 3``); returns a token for the done."""
  n, nb, bn = spec.n, spec.nb, spec.bn
  cb = spec.c // bn  # w blocks per output block

  def w_index(s0, d, j, me_ref):
    sh = _shift_of(spec, d)
    b = block_of(me_ref[0], sh, s0 + 1, n)
    return (0, b * cb + d * nb + j)

  def kernel(*refs):
    ins, (token_ref,), scratch = refs[:6], refs[6:7], refs[7:]
    compute_kernel(*ins, *scratch, spec=spec)
    token_ref[0] = jnp.int32(0)

  t = jnp.dtype(spec.dtype)
  return pl.pallas_call(
    kernel,
    out_shape=c.shape_like(x, (1,), jnp.int32),
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1,
      grid=(n - 2, spec.directions, nb),
      in_specs=[
        _x_block(spec, lambda s0, d, j, me: (0, 0)),
        pl.BlockSpec((spec.k, bn), w_index),
        c.HBM,
        c.SEM,
        c.SEM,
      ],
      out_specs=pl.BlockSpec(memory_space=pltpu.SMEM),
      scratch_shapes=[
        pltpu.VMEM((spec.m, spec.ch), spec.acc_dtype),
        pltpu.VMEM((spec.m, spec.ch), t),
        pltpu.VMEM((2, spec.directions, spec.m, spec.ch), t),
        pltpu.SemaphoreType.DMA(()),
      ],
    ),
    compiler_params=_params(spec, 3),
    name="ring_reducescatter_matmul",
  )(me, x, w, recv, send_sems, recv_sems)


def done(p, recv, token, send_sems, recv_sems, *, spec: RsSpec):
  """Waits for the last receive and the start's sends; returns ``recv``
  (aliased), ordered after the wait."""

  def kernel(p_ref, recv_ref, token_ref, send_sems, recv_sems, out_ref):
    del token_ref, out_ref
    done_kernel(recv_ref, send_sems, recv_sems, p_ref, spec=spec)

  return pl.pallas_call(
    kernel,
    out_shape=c.hbm_like(recv),
    in_specs=[c.ANY, c.HBM, c.ANY, c.SEM, c.SEM],
    out_specs=c.HBM,
    input_output_aliases={1: 0},
    compiler_params=c.params(),
    name="asyncops_ring_reducescatter_done",
  )(p, recv, token, send_sems, recv_sems)


def finish(me, x, w, recv, *, spec: RsSpec, out_shape):
  """Step ``n - 1``: own block plus the received partial sums."""
  n, nb, bn = spec.n, spec.nb, spec.bn
  cb = spec.c // bn
  return pl.pallas_call(
    functools.partial(finish_kernel, spec=spec),
    out_shape=out_shape,
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1,
      grid=(cb,),
      in_specs=[
        _x_block(spec, lambda j, me: (0, 0)),
        pl.BlockSpec((spec.k, bn), lambda j, me: (0, me[0] * cb + j)),
        pl.BlockSpec(
          (None, None, spec.m, bn), lambda j, me: (j // nb, n - 2, 0, j % nb)
        ),
      ],
      out_specs=pl.BlockSpec((spec.m, bn), lambda j, me: (0, j)),
    ),
    compiler_params=_params(spec, 1),
    name="ring_reducescatter_finish",
  )(me, x, w, recv)


def run(me, x, w, *, spec: RsSpec, out_shape):
  """Step 0 (XLA), then the kernels in order; returns ``[m, c]``."""
  x = x.astype(spec.dtype)
  p = first(me, x, w, spec=spec)
  recv, send_sems, recv_sems = start(p, spec=spec)
  token = p
  if spec.n >= 3:
    token = compute(me, x, w, recv, send_sems, recv_sems, spec=spec)
  recv = done(p, recv, token, send_sems, recv_sems, spec=spec)
  return finish(me, x, w, recv, spec=spec, out_shape=out_shape)


def one_kernel(me, x, w, *, spec: RsSpec, out_shape, interpret=None):
  """All five bodies in one kernel, semaphores as scratch (for Pallas's
  TPU interpreter, which cannot return semaphores): grid ``(n, d, nb)``;
  step 0 computes the first partial sums into an HBM buffer and runs the
  start body, steps ``1 .. n - 2`` the compute body, step ``n - 1`` the
  done body and then the finish body."""
  n, nb, bn, nd = spec.n, spec.nb, spec.bn, spec.directions
  cb = spec.c // bn
  t = jnp.dtype(spec.dtype)

  def kernel(me_ref, x_ref, w_ref, o_ref, p_ref, recv_ref, *scratch):
    ss, rs, part, rbuf, sbuf, csem, pbuf = scratch
    s, d, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = pl.ds(pl.multiple_of(j * bn, bn), bn)

    @pl.when(s == 0)
    def _():
      y = jnp.dot(
        x_ref[...],
        w_ref[...].astype(x_ref.dtype),
        preferred_element_type=spec.acc_dtype,
        precision=jax.lax.Precision[spec.precision],
      )
      pbuf[d, :, cols] = y.astype(t)

      @pl.when((d == nd - 1) & (j == nb - 1))
      def _():
        pltpu.sync_copy(pbuf, p_ref)
        start_kernel(p_ref, recv_ref, ss, rs, spec=spec)

    @pl.when((s >= 1) & (s <= n - 2))
    def _():
      compute_kernel(
        me_ref,
        x_ref,
        w_ref,
        recv_ref,
        ss,
        rs,
        part,
        rbuf,
        sbuf,
        csem,
        spec=spec,
        offset=0,
      )

    @pl.when(s == n - 1)
    def _():
      @pl.when((d == 0) & (j == 0))
      def _():
        done_kernel(recv_ref, ss, rs, p_ref, spec=spec)

      pltpu.sync_copy(recv_ref.at[d, n - 2, :, cols], rbuf.at[:, cols])
      y = jnp.dot(
        x_ref[...],
        w_ref[...].astype(x_ref.dtype),
        preferred_element_type=spec.acc_dtype,
        precision=jax.lax.Precision[spec.precision],
      )
      o_ref[...] = (y + rbuf[:, cols].astype(y.dtype)).astype(o_ref.dtype)

  def w_index(s, d, j, me_ref):
    b = block_of(me_ref[0], _shift_of(spec, d), s, n)
    return (0, b * cb + d * nb + j)

  out, _, _ = pl.pallas_call(
    kernel,
    out_shape=(
      out_shape,
      c.shape_like(x, (nd, spec.m, spec.ch), t),
      c.shape_like(x, (nd, n - 1, spec.m, spec.ch), t),
    ),
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1,
      grid=(n, nd, nb),
      in_specs=[
        pl.BlockSpec((spec.m, spec.k), lambda s, d, j, me: (0, 0)),
        pl.BlockSpec((spec.k, bn), w_index),
      ],
      out_specs=(
        pl.BlockSpec(
          (spec.m, bn),
          lambda s, d, j, me: (0, jnp.where(s == n - 1, d * nb + j, 0)),
        ),
        c.ANY,
        c.ANY,
      ),
      scratch_shapes=[
        _sem_array(spec),
        _sem_array(spec),
        pltpu.VMEM((spec.m, spec.ch), spec.acc_dtype),
        pltpu.VMEM((spec.m, spec.ch), t),
        pltpu.VMEM((2, nd, spec.m, spec.ch), t),
        pltpu.SemaphoreType.DMA(()),
        pltpu.VMEM((nd, spec.m, spec.ch), t),
      ],
    ),
    compiler_params=pltpu.CompilerParams(
      dimension_semantics=("arbitrary",) * 3,
      has_side_effects=True,
      collective_id=spec.collective_id,
    ),
    interpret=interpret,
    name="ring_reducescatter_matmul_one_kernel",
  )(me, x, w)
  return out
