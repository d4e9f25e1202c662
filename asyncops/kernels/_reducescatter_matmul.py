"""Fused ring matmul-reduce-scatter: ``psum_scatter(x @ w, 1, tiled)``.

Algorithm. Inside ``shard_map`` over a ring of ``n`` devices each device
holds ``x`` ``[m, k]`` and ``w`` ``[k, n c]``; the result on device ``i``
is column block ``i`` (``c`` wide) of the sum over devices of ``x @ w``.
Partial sums travel around the ring and each device adds its own
contribution as they pass (the chapter's "permute the result as you
accumulate it"): at step ``s`` a device computes its product for one block
in ``[m, bn]`` pieces (``w`` streamed from HBM by the Pallas pipeline) into
a float32 VMEM buffer, adds the partial sum of that block its neighbour
sent one step earlier, and sends the sum on; after ``n - 1`` hops each
block holds every device's contribution on the device that owns it. Only
the partial sums move, never ``x`` or ``w``.

Two directions (``directions=2``): the columns of every block are split in
halves; partial sums of first halves travel to ``i + 1`` (block ``i - s -
1`` at step ``s``), of second halves to ``i - 1`` (block ``i + s + 1``).
Each column of ``w`` is used at exactly one step, so ``w`` is read once.

Kernels, in program order (all four appear in the compiled HLO):

1. ``asyncops_ring_reducescatter_start``: a two-round barrier with the ring
   neighbours (the second on a kernel-local semaphore, jax-ml/jax PR
   #27963). Returns the receive buffer ``[d, n - 1, m, c/d]`` (slot ``t``
   holds the partial sum added at step ``t + 1``; its first output, which
   ``benchmarks/`` routes) and DMA semaphore arrays ``[d, n - 1]``. It
   starts no transfer: the first partial sums exist only after step 0.
   The receive buffer is in VMEM where the plan finds room for it
   (``RsSpec.recv_vmem``, below), else in HBM.
2. ``ring_reducescatter_matmul``: grid ``(n, d, c / (d bn))``, every
   product and every send. After block ``max(nb - 2, 0)`` of a half at
   step ``1 <= s <= n - 2`` it waits for the neighbour's partial sum and
   starts copying it into VMEM; after the last block it adds it, casts,
   and sends the sum on from slot ``s`` of a VMEM send buffer. At step
   ``n - 1`` it keeps its own product (float32) in a VMEM output ``[d, m,
   c/d]``. The send buffer ``[n - 1, d, m, c/d]`` is an output too, so it
   outlives the kernel while the last sends are in flight.
3. ``ring_reducescatter_finish``: grid ``(d,)``. Waits for the last
   partial sum of each half, adds it to the own product and writes the
   ``[m, c]`` result. It starts **no remote DMA** and returns an SMEM token
   besides the result.
4. ``asyncops_ring_reducescatter_done``: waits for every send; it takes
   the token (not the result), so it runs after the finish, and reads the
   send buffer (and a VMEM receive buffer) in VMEM (its scoped VMEM limit
   is raised to hold them).

The receive buffer in VMEM (branch h-rsslots). In HBM it is ``n - 1``
partial sums per direction held from the start to the done: the
program's HBM temporaries were ``n - 1`` chunks where issue 15's memory
target allows jit's plus two (the Llama-3-70B shard at tp 8, M = 1024:
``bf16[2, 7, 1024, 512]``, 14.06 MiB against 4.16). XLA places a
kernel's VMEM output for the kernels that take it in VMEM, as it does the
sent partial sums, and the peers' remote DMAs write into it there; the
steps kernel and the finish copy a slot out of it VMEM to VMEM. Its
bytes count against the chip's VMEM beside the steps kernel's scoped
limit and the other VMEM outputs (:func:`resident_vmem_bytes`; XLA
refuses a program over the chip's VMEM), so the plan keeps it in HBM
where they would not fit or would leave XLA too little beside them
(``_fused._RECV_VMEM_SHARE``). Mosaic's scoped area holds only the
steps kernel's ``x`` and ``w`` blocks and scratch
(:func:`scoped_vmem_bytes`); XLA places the VMEM outputs beside it. The
steps kernel's limit counts the outputs too (:func:`steps_vmem_limit`,
``room``: VMEM XLA would otherwise fill with prefetches of ``w``), and
where the receive buffer does not fit beside that the plan takes the
tight limit, the scoped area's need alone (branch h-rsvmem: the Llama
shard's tp 4, M >= 1024 on v5e and v6e came to 117.25 of 128 MiB with
the buffer and kept it in HBM, 12 MiB over issue 15's memory target;
with the tight limit 87.25 MiB, XLA's buffer assignment to the byte, and
the buffer is in VMEM at every point of the Llama sweep on v5e, v6e and
v5p). Bounded slots (two per direction, a credit semaphore
per slot for flow control) would meet the target in HBM too; not built
(design/benchmarks.md, "The reduce-scatter's receive slots").

Why a finish kernel. XLA treats a kernel that starts a remote DMA as
communicating and copies its result before it leaves the program (see
``_allgather_matmul.py``; here the ``[m, c]`` result was placed in VMEM and
copied to HBM at the end, v5e and v6e). The partial sums are computed
before they are sent, so the sends cannot move to the start kernel as the
all-gather's do; instead the one step that sends nothing is split off.
Only the addition of the last partial sum moves: the steps kernel still
computes every product (one pipeline over all of ``w``; XLA estimates the
narrow per-step dots at several times their FLOPs, so a split of the last
step's dot would be charged about 7 us more at the chapter's shape), and
the finish reads its own product from VMEM. The last partial sum arrives
while the steps kernel computes the own product, as before the split.

The travelling partial sums have the transfer dtype (the input dtype, as
XLA's reduce-scatter), so bfloat16 sums round once per hop; each device's
own products accumulate in float32.

Tools reading the schedule see the transfers begin at the start kernel,
up to one step's compute earlier than they do; they end at the done, as
they do.

Row panels (``RsSpec.panel``): the kernels of panel ``p`` read rows ``p
m ..`` of the ``x`` they are given (the steps kernel's ``x`` block), and
the finish writes those rows of the result, taking the previous panel's
result as an aliased operand (``finish``'s ``into``): no slice of ``x``,
no concatenation of the panels' results.

Limits. ``c / d`` a multiple of 128 and of ``bn``; ``x`` ``[m, k]``, the
float32 partial ``[m, c/d]``, the own products ``[m, c]`` (float32), the
received and the ``n - 1`` sent partial sums must fit in VMEM (the caller
splits ``m`` into panels when they do not), and the receive buffer too
where it is in VMEM. One ring axis.
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
    dtype: dtype of ``x`` at the MXU (``w`` is cast to it in VMEM) and of
      the partial sums that travel.
    out_dtype: the result's dtype.
    directions: 1 (partial sums to ``i + 1``) or 2 (halves both ways).
    bn: columns of a ``w`` block.
    precision: ``jax.lax.Precision`` name for the in-kernel dots.
    collective_id: barrier semaphore id of the start kernel.
    vmem_limit: the steps kernel's scoped VMEM limit (:func:`steps_vmem_limit`;
      its VMEM outputs are outside it).
    panel: the row panel these kernels run (``m`` rows of every panel):
      the steps kernel reads rows ``panel m ..`` of the ``x`` it is given
      and the finish writes its rows of the result (``finish``'s
      ``into``); 0 for one panel.
    recv_vmem: the start's receive buffer ``[d, n - 1, m, c/d]`` in VMEM
      (the peers' partial sums land there; the steps, finish and done
      kernels take it in VMEM), else in HBM. The plan
      (``_fused.plan_reducescatter``) puts it in VMEM where it fits
      beside the kernels' other VMEM (:func:`resident_vmem_bytes`).
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
  panel: int = 0
  recv_vmem: bool = False

  def __post_init__(self):
    c.check_ring(self.directions, self.n)
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


def scoped_vmem_bytes(spec: RsSpec) -> int:
  """VMEM the steps kernel uses within its scoped limit: its ``x`` and
  ``w`` blocks and its scratch. Its VMEM outputs (the sent partial sums,
  the own products) are not there: XLA places them beside the scoped
  area (branch h-rsvmem, the Llama-3-70B shard's tp 4, M = 1024: the
  compiled call's ``used_scoped_memory_configs``, Mosaic's use, is 41.03
  MiB on v5e, this 41.0, and 27.86 on v6e, which keeps one ``x`` buffer;
  with the former limit, 85.25 MiB, the sent partial sums were at offset
  85.25 MiB, after the scoped area)."""
  t = jnp.dtype(spec.dtype).itemsize
  half = spec.m * spec.ch
  return (
    2 * spec.m * spec.k * t  # x block (Mosaic keeps two buffers)
    + 2 * spec.k * spec.bn * t  # w blocks
    + half * 4  # float32 partial of one half
    + half * t  # received partial
  )


def vmem_bytes(spec: RsSpec) -> int:
  """VMEM the kernels need: the steps kernel's scoped VMEM
  (:func:`scoped_vmem_bytes`), its VMEM outputs and the finish's output
  blocks (the plan's test for row panels)."""
  o = jnp.dtype(spec.out_dtype).itemsize
  half = spec.m * spec.ch
  return (
    scoped_vmem_bytes(spec)
    + (spec.n - 1) * spec.directions * half * jnp.dtype(spec.dtype).itemsize
    + spec.directions * half * 4  # own products (the finish adds them)
    + 2 * half * o  # the finish's output blocks
  )


def steps_vmem_limit(spec: RsSpec, cap: int, *, room: bool = True) -> int:
  """The steps kernel's scoped VMEM limit on a chip of ``cap`` bytes of
  VMEM: what it needs and a quarter more, plus 4 MiB, at most 90% of
  ``cap``. ``room``: the need is :func:`vmem_bytes`, which also counts
  the VMEM outputs XLA places beside the scoped area; the limit then
  keeps VMEM that XLA would otherwise fill with prefetches of the
  kernel's operands (branch h-rsvmem: v6e, the Llama-3-70B shard's tp 8,
  M = 2048, two row panels: with the tight limit XLA prefetched all of
  ``w``, 56 MiB, into VMEM, 219.0 -> 225.1 us in the benchmark model;
  M = 4096, 430.0 -> 441.1). Else the need is
  :func:`scoped_vmem_bytes` alone, what Mosaic uses: the plan's choice
  where the receive buffer fits VMEM only so."""
  need = vmem_bytes(spec) if room else scoped_vmem_bytes(spec)
  return c.scoped_limit(need, cap)


def block_of(me, shift, s, n: int):
  """The block a direction with ``shift`` works on at step ``s``."""
  return jax.lax.rem(me - shift * (s + 1) + 2 * n * n, n)


def _shift_of(spec: RsSpec, d):
  """The shift of direction ``d`` (a traced grid index)."""
  if spec.directions == 1:
    return jnp.int32(spec.shifts[0])
  return jnp.where(d == 0, jnp.int32(1), jnp.int32(-1))


# Kernel bodies ---------------------------------------------------------------


def start_kernel(*, spec: RsSpec):
  """Barrier with the ring neighbours (who will write into our buffers)."""
  me = jax.lax.axis_index(spec.axis_name)
  c.ring_barrier(spec, me)


def step_body(
  me,
  x_ref,
  w_ref,
  recv_ref,
  send_sems,
  recv_sems,
  sent_ref,
  own_ref,
  part,
  rbuf,
  copy_sem,
  *,
  spec: RsSpec,
):
  """Grid step ``(s, d, j)``, block ``j`` of half ``d`` at step ``s``: the
  product; after the last block, at ``s < n - 1`` the neighbour's partial
  sum added and the sum sent on, at ``s = n - 1`` the product kept in
  ``own_ref`` (the finish kernel adds the last partial sum)."""
  s, d, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  n, nb, bn = spec.n, spec.nb, spec.bn

  part[:, pl.ds(pl.multiple_of(j * bn, bn), bn)] = jnp.dot(
    x_ref[...],
    w_ref[...].astype(x_ref.dtype),
    preferred_element_type=spec.acc_dtype,
    precision=jax.lax.Precision[spec.precision],
  )
  receives = (s >= 1) & (s < n - 1)

  # Slot s - 1 holds the neighbour's partial sum of this step's block.
  @pl.when(receives & (j == max(nb - 2, 0)))
  def _():
    here = recv_ref.at[d, s - 1]
    c.wait_dma(here, recv_sems.at[d, s - 1])
    pltpu.make_async_copy(here, rbuf, copy_sem).start()

  def total():
    return part[...] + rbuf[...].astype(part.dtype)

  @pl.when(receives & (j == nb - 1))
  def _():
    pltpu.make_async_copy(recv_ref.at[d, s - 1], rbuf, copy_sem).wait()

  @pl.when((s < n - 1) & (j == nb - 1))
  def _():
    slot = sent_ref.at[s, d]
    slot[...] = jnp.where(s == 0, part[...], total()).astype(sent_ref.dtype)
    for dd, sh in enumerate(spec.shifts):

      @pl.when(d == dd)
      def _(dd=dd, sh=sh):
        pltpu.make_async_remote_copy(
          sent_ref.at[s, dd],
          recv_ref.at[dd, s],
          send_sems.at[dd, s],
          recv_sems.at[dd, s],
          device_id=c.ring_peer(spec, me, sh),
          device_id_type=pl.DeviceIdType.MESH,
        ).start()

  @pl.when((s == n - 1) & (j == nb - 1))
  def _():
    own_ref[d] = part[...]


def steps_kernel(
  me_ref,
  x_ref,
  w_ref,
  recv_ref,
  send_sems,
  recv_sems,
  sent_ref,
  own_ref,
  part,
  rbuf,
  copy_sem,
  *,
  spec: RsSpec,
):
  """Grid step ``(s, d, j)``: every product and every send."""
  step_body(
    me_ref[0],
    x_ref,
    w_ref,
    recv_ref,
    send_sems,
    recv_sems,
    sent_ref,
    own_ref,
    part,
    rbuf,
    copy_sem,
    spec=spec,
  )


def finish_body(
  d, own_ref, recv_ref, recv_sems, o_ref, rbuf, copy_sem, *, spec
):
  """Half ``d``: the last partial sum received, added to this device's own
  product and written to ``o_ref``. No remote DMA."""
  last = recv_ref.at[d, spec.n - 2]
  c.wait_dma(last, recv_sems.at[d, spec.n - 2])
  copy = pltpu.make_async_copy(last, rbuf, copy_sem)
  copy.start()
  copy.wait()
  total = own_ref[d] + rbuf[...].astype(own_ref.dtype)
  o_ref[...] = total.astype(o_ref.dtype)


def done_kernel(sent_ref, send_sems, *, spec: RsSpec):
  """Waits for every send."""
  for t in range(spec.n - 1):
    for d in range(spec.directions):
      c.wait_dma(sent_ref.at[t, d], send_sems.at[d, t])


# pallas_calls ----------------------------------------------------------------


def _sem_array(spec: RsSpec):
  return pltpu.SemaphoreType.DMA((spec.directions, spec.n - 1))


def _recv_shape(x, spec: RsSpec):
  t = jnp.dtype(spec.dtype)
  return c.shape_like(x, recv_dims(spec), t)


def recv_dims(spec: RsSpec) -> tuple[int, int, int, int]:
  """The receive buffer's shape, ``[d, n - 1, m, c/d]``: slot ``t`` of
  direction ``d`` holds the partial sum added at step ``t + 1``."""
  return (spec.directions, spec.n - 1, spec.m, spec.ch)


def recv_bytes(spec: RsSpec) -> int:
  """Bytes of the receive buffer (as many as the sent partial sums)."""
  size = 1
  for v in recv_dims(spec):
    size *= v
  return size * jnp.dtype(spec.dtype).itemsize


def recv_hbm_bytes(spec: RsSpec) -> int:
  """HBM bytes of the receive buffer: all of it, or 0 in VMEM."""
  return 0 if spec.recv_vmem else recv_bytes(spec)


def resident_vmem_bytes(spec: RsSpec, recv_vmem: bool) -> int:
  """VMEM in use while the steps kernel runs: its scoped limit
  (``spec.vmem_limit``, :func:`steps_vmem_limit`) plus the buffers XLA
  places in VMEM beside the scoped area across the kernels, the sent
  partial sums, the own products and, with ``recv_vmem``, the receive
  buffer (the buffer assignment's VMEM temporaries, exactly: v5e and v6e,
  the Llama-3-70B shard's tp 4, ``m`` 1024, 87.25 MiB). XLA refuses a
  program whose VMEM buffers and scoped limits exceed the chip's VMEM
  ("Too many buffers are colored in the alternate memory": v5e, tp 4,
  ``m`` 1024 of the Llama-3-70B shard at 129.25 of 128 MiB with the
  former limit; 127.25 compiled)."""
  own = spec.directions * spec.m * spec.ch * 4
  recv = recv_bytes(spec) if recv_vmem else 0
  return (spec.vmem_limit or 0) + sent_bytes(spec) + own + recv


def _recv_out(x, spec: RsSpec):
  """The start's receive buffer, in VMEM or pinned to HBM."""
  shape = _recv_shape(x, spec)
  if spec.recv_vmem:
    return pltpu.VMEM(shape.shape, shape.dtype)
  return c.hbm_like(shape)


def _recv_spec(spec: RsSpec):
  """The receive buffer's ``BlockSpec`` in every kernel that takes it."""
  return _VMEM if spec.recv_vmem else c.HBM


def _params(spec: RsSpec, collective_id=None, *, dims=3, vmem_limit=None):
  return pltpu.CompilerParams(
    dimension_semantics=("arbitrary",) * dims,
    has_side_effects=True,
    vmem_limit_bytes=vmem_limit or spec.vmem_limit,
    collective_id=collective_id,
  )


def _in_specs(spec: RsSpec):
  """``x`` (fetched once: row panel ``p`` is block ``p`` of the ``x``
  given) and the ``w`` block of step ``s``, half ``d``."""
  n, nb = spec.n, spec.nb
  cb = spec.c // spec.bn  # w blocks per output block

  def w_index(s, d, j, me_ref):
    b = block_of(me_ref[0], _shift_of(spec, d), s, n)
    return (0, b * cb + d * nb + j)

  return [
    pl.BlockSpec(
      (spec.m, spec.k),
      lambda s, d, j, me: (spec.panel, 0),
      pipeline_mode=pl.Buffered(1),
    ),
    pl.BlockSpec((spec.k, spec.bn), w_index),
  ]


def _scratch(spec: RsSpec):
  t = jnp.dtype(spec.dtype)
  return [
    pltpu.VMEM((spec.m, spec.ch), spec.acc_dtype),
    pltpu.VMEM((spec.m, spec.ch), t),
    pltpu.SemaphoreType.DMA(()),
  ]


def _sent_shape(spec: RsSpec):
  shape = (spec.n - 1, spec.directions, spec.m, spec.ch)
  return pltpu.VMEM(shape, jnp.dtype(spec.dtype))


_SMEM = pl.BlockSpec(memory_space=pltpu.SMEM)
_VMEM = pl.BlockSpec(memory_space=pltpu.VMEM)


def start(me, *, spec: RsSpec, after=None):
  """``-> (recv, send_sems, recv_sems)``; the barrier.

  Its operand is the ring index ``me`` (``int32[1]``, unread): it starts
  no transfer, so it needs nothing of ``x``. (Given the whole ``x`` of
  row panels, XLA evicted the steps kernels' VMEM outputs, the sent
  partial sums and own products, to HBM before the finish and the done:
  15 copies, 26.5 us exposed in the benchmark model at the Llama-3-70B
  shard's tp 8, M = 4096, on v5p. The sends read the sent partial sums
  until the done.)

  ``after``: the previous row panel's done token (SMEM, unread), so this
  panel's kernels run after that done (branch h-rsrace). Without it XLA
  hoisted every panel's start and scheduled every done after the last
  finish; it evicted a panel's sent partial sums to HBM, gave the done
  the copy and their VMEM to the next panel's steps kernel while the last
  sends could still read it (the fused all-reduce at (2048, 8192, 28672),
  v5e). Ordering only the next steps kernel after the done left the
  starts hoisted, every panel's receive buffer live from the top: the
  fused all-reduce at tp 8, M = 4096 did not compile ("Too many buffers
  are colored in the alternate memory"), as on main."""

  extra = () if after is None else (after,)

  def kernel(me_ref, *refs):
    del me_ref, refs
    start_kernel(spec=spec)

  return pl.pallas_call(
    kernel,
    out_shape=(
      _recv_out(me, spec),
      _sem_array(spec),
      _sem_array(spec),
    ),
    in_specs=[c.ANY] + [_SMEM] * len(extra),
    out_specs=(_recv_spec(spec), c.SEM, c.SEM),
    compiler_params=c.params(collective_id=spec.collective_id),
    name="asyncops_ring_reducescatter_start",
  )(me, *extra)


def _own_shape(spec: RsSpec):
  return pltpu.VMEM((spec.directions, spec.m, spec.ch), spec.acc_dtype)


def steps(me, x, w, recv, send_sems, recv_sems, *, spec: RsSpec):
  """Every product and every send; returns ``(sent partial sums, own
  products [d, m, c/d])``, both in VMEM."""
  return pl.pallas_call(
    functools.partial(steps_kernel, spec=spec),
    out_shape=(_sent_shape(spec), _own_shape(spec)),
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1,
      grid=(spec.n, spec.directions, spec.nb),
      in_specs=_in_specs(spec) + [_recv_spec(spec), c.SEM, c.SEM],
      out_specs=(_VMEM, _VMEM),
      scratch_shapes=_scratch(spec),
    ),
    compiler_params=_params(spec),
    name="ring_reducescatter_matmul",
  )(me, x, w, recv, send_sems, recv_sems)


def finish(own, recv, recv_sems, *, spec: RsSpec, out_shape, into=None):
  """The last partial sums plus this device's own products: returns
  ``(out [m, c], token)``. It starts no remote DMA, so XLA writes its
  output in place as the program's result.

  ``into``: the result buffer of the previous row panel, aliased to this
  kernel's result (row panel ``spec.panel`` writes its ``m`` rows of it
  in place; ``out_shape`` is the whole result)."""
  t = jnp.dtype(spec.dtype)

  def kernel(own_ref, recv_ref, recv_sems, *refs):
    if into is not None:
      refs = refs[1:]  # the aliased result buffer: written through o_ref
    o_ref, token_ref, rbuf, sem = refs
    d = pl.program_id(0)
    finish_body(d, own_ref, recv_ref, recv_sems, o_ref, rbuf, sem, spec=spec)
    token_ref[0] = jnp.int32(0)

  extra = () if into is None else (into,)
  # Row panel ``p`` writes rows ``p m ..`` of the whole result.
  out_block = pl.BlockSpec((spec.m, spec.ch), lambda d: (spec.panel, d))
  return pl.pallas_call(
    kernel,
    out_shape=(out_shape, c.shape_like(recv, (1,), jnp.int32)),
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=0,
      grid=(spec.directions,),
      in_specs=[_VMEM, _recv_spec(spec), c.SEM] + [c.ANY] * len(extra),
      out_specs=(out_block, _SMEM),
      scratch_shapes=[
        pltpu.VMEM((spec.m, spec.ch), t),
        pltpu.SemaphoreType.DMA(()),
      ],
    ),
    compiler_params=_params(spec, dims=1, vmem_limit=finish_vmem_limit(spec)),
    input_output_aliases={} if into is None else {3: 0},
    name="ring_reducescatter_finish",
  )(own, recv, recv_sems, *extra)


def finish_vmem_limit(spec: RsSpec) -> int:
  """Its own products, one received half, two output blocks (and room);
  the receive buffer too where it is in VMEM."""
  half = spec.m * spec.ch
  o = jnp.dtype(spec.out_dtype).itemsize
  need = (
    spec.directions * half * 4 + half * jnp.dtype(spec.dtype).itemsize
  ) + 2 * half * o
  need += recv_bytes(spec) - recv_hbm_bytes(spec)
  return c.scoped_limit(need)


def sent_bytes(spec: RsSpec) -> int:
  """Bytes of the sent partial sums (a VMEM buffer from the steps kernel
  to the done)."""
  sent = (spec.n - 1) * spec.directions * spec.m * spec.ch
  return sent * jnp.dtype(spec.dtype).itemsize


def done_vmem_limit(spec: RsSpec) -> int | None:
  """The done reads the sent partial sums in VMEM (and the receive buffer
  where it is there): above 8 MiB of them its scoped limit is raised to
  hold them (XLA's default, 16 MiB on v5e, did not hold 29 MiB); None
  (the default) below."""
  held = sent_bytes(spec) + recv_bytes(spec) - recv_hbm_bytes(spec)
  return None if held <= 8 * 2**20 else held + 2**22


def done(recv, sent, token, send_sems, *, spec: RsSpec):
  """Waits for every send; returns a token nothing needs to read.

  Reads ``recv`` and ``sent`` so XLA keeps both alive until the sends end
  (``sent`` is what they read; peers write into ``recv``), and the finish
  kernel's ``token``, so it runs after it without reading the result (a
  later reader of the result makes XLA stage it in VMEM and copy it out).
  """

  def kernel(recv_ref, sent_ref, token_ref, send_sems, out_ref):
    del recv_ref, token_ref
    done_kernel(sent_ref, send_sems, spec=spec)
    out_ref[0] = jnp.int32(0)

  return pl.pallas_call(
    kernel,
    out_shape=c.shape_like(recv, (1,), jnp.int32),
    in_specs=[_recv_spec(spec), _VMEM, _SMEM, c.SEM],
    out_specs=_SMEM,
    compiler_params=pltpu.CompilerParams(
      has_side_effects=True, vmem_limit_bytes=done_vmem_limit(spec)
    ),
    name="asyncops_ring_reducescatter_done",
  )(recv, sent, token, send_sems)


def run(me, x, w, *, spec: RsSpec, out_shape, into=None, after=None):
  """The four kernels in order; returns ``(result [m, c], done token)``.

  Row panel ``spec.panel`` reads its rows of ``x`` (which may hold every
  panel's) and, with ``into`` (the previous panel's result, aliased),
  writes its rows of the whole result ``out_shape`` in place
  (:func:`finish`). ``after``: the previous panel's done token; this
  panel's start, so its kernels, then run after that done, and the
  previous panel's sent partial sums stay in place until their sends end
  (:func:`start`)."""
  x = x.astype(spec.dtype)
  recv, send_sems, recv_sems = start(me, spec=spec, after=after)
  sent, own = steps(me, x, w, recv, send_sems, recv_sems, spec=spec)
  out, token = finish(
    own, recv, recv_sems, spec=spec, out_shape=out_shape, into=into
  )
  return out, done(recv, sent, token, send_sems, spec=spec)


def one_kernel(me, x, w, *, spec: RsSpec, out_shape, interpret=None, into=None):
  """The four bodies in one kernel, semaphores as scratch (for Pallas's
  TPU interpreter, which cannot return semaphores): the start body before
  the first grid step, every step's body on grid ``(n, d, j)``, then the
  finish body of each half and the done body after the last (row panels
  and ``into`` as :func:`run` takes them)."""
  x = x.astype(spec.dtype)
  ch = spec.ch
  extra = () if into is None else (into,)
  # Row panel ``p``'s rows of the result, one block written back after the
  # last grid step (the other rows keep the aliased buffer's values).
  out_block = pl.BlockSpec(
    (spec.m, spec.c), lambda s, d, j, me: (spec.panel, 0)
  )

  def kernel(me_ref, x_ref, w_ref, *refs):
    if into is not None:
      refs = refs[1:]  # the aliased result buffer: written through o_ref
    o_ref, sent_ref, recv_ref, *scratch = refs
    ss, rs, own, part, rbuf, sem = scratch
    s, d, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    first = (s == 0) & (d == 0) & (j == 0)
    last = (s == spec.n - 1) & (d == spec.directions - 1) & (j == spec.nb - 1)

    @pl.when(first)
    def _():
      start_kernel(spec=spec)

    step_body(
      me_ref[0],
      x_ref,
      w_ref,
      recv_ref,
      ss,
      rs,
      sent_ref,
      own,
      part,
      rbuf,
      sem,
      spec=spec,
    )

    @pl.when(last)
    def _():
      for dd in range(spec.directions):
        half = o_ref.at[:, pl.ds(dd * ch, ch)]
        finish_body(dd, own, recv_ref, rs, half, rbuf, sem, spec=spec)
      done_kernel(sent_ref, ss, spec=spec)

  out, _, _ = pl.pallas_call(
    kernel,
    out_shape=(out_shape, _sent_shape(spec), _recv_shape(x, spec)),
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1,
      grid=(spec.n, spec.directions, spec.nb),
      in_specs=_in_specs(spec) + [c.ANY] * len(extra),
      out_specs=(out_block, _VMEM, _VMEM if spec.recv_vmem else c.ANY),
      scratch_shapes=[_sem_array(spec), _sem_array(spec), _own_shape(spec)]
      + _scratch(spec),
    ),
    compiler_params=_params(spec, spec.collective_id),
    interpret=interpret,
    input_output_aliases={} if into is None else {3: 0},
    name="ring_reducescatter_matmul_one_kernel",
  )(me, x, w, *extra)
  return out
