"""Fused all-gather matmul: ``all_gather(x, 1, tiled) @ w``.

Algorithm. Inside ``shard_map`` over a ring of ``n`` devices, device ``i``
holds ``x`` ``[m, k]`` (chunk ``i`` of the contracting dimension) and every
row of ``w`` ``[n k, f]``. Every device sends its chunk to every peer at
once; each device multiplies each chunk by its ``k`` rows of ``w`` as the
chunk arrives and accumulates the ``[m, f]`` product in float32 (int32 for
int8) **in VMEM** (it never goes back to HBM between steps), then writes
the result once, in bf16/f32/int8 as the output asks.

Ring units and slots. Unit ``0`` is the local chunk; unit ``u >= 1`` is
what receive slot ``u - 1`` holds, from the peer ``hops[u - 1]`` away,
nearest first on both sides: ``hops = (1, n - 1, 2, n - 2, ...)`` (``n -
1`` ahead is the neighbour behind, one link away on a cycle). Two
directions (``directions=2``): the columns of every chunk are split in
halves; unit ``u`` holds the first half of chunk ``i - hops[u - 1]`` and
the second half of chunk ``i + hops[u - 1]``, so on a 4-ring units 1 and 2
are both neighbours' whole chunks and unit 3 the antipode's; each half
meets its own ``[k/2, bn]`` blocks of ``w`` (each row of ``w`` belongs to
exactly one (chunk, half): ``w`` is read from HBM once). One direction:
unit ``u`` holds the whole chunk ``i + hops[u - 1]``.

Step plan (``AgSpec.steps``, chosen by ``collective_matmul._fused.
choose_steps`` from the shape, dtype and chip): step ``s`` multiplies
``steps[s]`` consecutive units, e.g. ``(1, 1, 1, 1)`` (one unit per step)
or ``(1, 2, 1)`` (the local chunk, then both neighbours at once, then the
antipode). A step of ``g`` units is one ``[m, g k] @ [g k, f]`` dot
tiled in ``[k/d, bn]`` blocks, run as one half-step per direction
(:func:`half_steps`; grid ``(step, half, block, unit of the step)``):
half ``0`` of each of its units over every block, then half ``1``. A
half-step cannot start before its halves have arrived; it does not wait
for the other direction's (on a 4-cycle the antipode's two halves cross
the same two links one after the other, so the first is multiplied
while the second is still on its way).

Kernels, in program order (all three appear in the compiled HLO):

1. ``asyncops_ring_allgather_start``: a two-round barrier with every peer
   of the ring (each writes into this device's receive buffer; the second
   round on a kernel-local semaphore, jax-ml/jax PR #27963), then **direct
   sends**: half ``d`` of ``x`` to the
   peer ``shift_d * hops[t]`` away, into its slot ``t``, for ``t = 0 ..
   n - 2``, nearest first. Returns the receive buffer ``[d, n - 1, m,
   k/d]`` (slot ``t`` of direction ``d`` holds the half of unit ``t +
   1``; its first output, which ``benchmarks/`` routes) and DMA
   semaphore arrays ``[d, n - 1]`` for sends and receives. The buffer is
   in HBM, or in VMEM where it fits (``AgSpec.recv_vmem``, below).
2. ``ring_allgather_matmul``: grid ``(steps, d, f / bn, max(steps))``.
   Half-step ``(s, h)`` multiplies half ``h`` of the units it holds
   (``x`` at step 0) by their ``w`` blocks (streamed by the Pallas
   pipeline) into the float32 VMEM accumulator. After the last unit of
   block ``max(nf - 2, 0)`` of a half-step (or before its last
   ``AgSpec.tail`` parts of iterations: with a tail each iteration's
   block runs as ``AgSpec.parts`` dots, so the wait may fall
   mid-iteration) it waits for the halves of the next half-step and
   starts copying them into a VMEM double buffer ``[2, max(steps), m,
   k]`` (step ``s`` in slot ``s % 2``, half ``h`` in its columns), so
   the copies overlap that block (or those parts); with the receive
   buffer in VMEM it only waits, and reads the halves in place. The last
   half-step
   adds its product and writes ``[m, bn]`` output blocks. It starts **no
   remote DMA**, and returns an SMEM token besides the result. It runs
   in a ``ring_steps_<plan>_nf<blocks>[_t<tail>p<parts>]_halves`` named
   scope (the start in ``ring_hops_<hops>``), which
   ``benchmarks/_timeline.py`` reads.
3. ``asyncops_ring_allgather_done``: waits for every send; it takes the
   token (not the result), so it runs after the compute kernel and the
   sends stay in flight under the matmul.

Why direct sends and a token. XLA treats a kernel that starts a remote DMA
as communicating and copies such a kernel's result before it leaves the
program (measured on v5e and v6e: the result placed in VMEM, then a
synchronous copy to HBM, 5 us at the chapter's bf16 shape, 36 us at
prefill; pinning the output to HBM moves the copy to the ROOT). A kernel
that reads its result later (a done taking the result) makes XLA stage it
in VMEM and evict it too. With the sends in the start kernel and the done
ordered by a token, the compute kernel's output *is* the program's result,
in HBM. The price is link traffic: a ring forwards each chunk (``n - 1``
link crossings per chunk), direct sends route one copy per peer (``4``
crossings per chunk instead of ``3`` on a 4-ring with wraparound, more on
the open lines of small slices and at ``n = 8``). Where the matmul is
longer than the transfers (the shapes this kernel is for), that is hidden;
``benchmarks/_timeline.py`` routes each copy on its own.

The relay (``AgSpec.forward``, off by default). On a ring of 4 the
antipode's halves can come through a neighbour instead: the start sends
to both neighbours only, and the compute runs as two kernels,
:func:`compute_local` (step 0; its float32 accumulator a VMEM output),
which at its end waits for slot 0 of each direction and sends it on
(:func:`forward_kernel`; three halves on the busiest link, not four),
and :func:`compute_rest` (the other steps, on top of it), which starts
no remote DMA and writes the result. XLA's copy is an entry-output
rule: it does not give the program's result buffer to a communicating
kernel, as output or operand; the local kernel's outputs are not the
result, so nothing is copied (design/benchmarks.md, "Forwarding in the
fused all-gather").

The last half in pieces (``AgSpec.split``, where its wait is exposed:
v5e's chapter shape). The start's last send, the last direction's half of
the farthest chunk, goes as two row pieces on their own semaphores (one
more pair in each semaphore array); the last half-step waits for the
first piece where it waited for the whole half, and for the second only
before its first iteration's second part (each iteration's two parts
split rows then), whose copy into VMEM overlaps the first part. ``x`` is
then read by halves (one ``[m, k/d]`` block per direction), so the
pipeline fill reads half of it.

Quantized transfers (``AgSpec.quantized``): ``x`` arrives as int8 codes
with one float32 scale per row and half (``[d, m, 128]``, the scale
broadcast over a lane tile so it moves as one DMA block). Each half's
scales travel beside it on the same semaphores (a semaphore counts bytes:
the codes and the scales are each waited for by their own size); the
codes meet the MXU as bfloat16 (exact for int8) and each step's product is
scaled per row before it is accumulated: the result is
``all_gather(dequantize(quantize(x))) @ w``.

The receive buffer in VMEM (``AgSpec.recv_vmem``). All ``n - 1``
receive slots are allocated up front, as a forwarding ring's are, and
live from the start to the done: ``(n - 1) m k`` elements, in HBM on v5e
and v6e over issue 15's memory target (jit's temporaries plus one
chunk's send and receive buffers) wherever ``n > 3`` (the Llama-3-70B
shard at tp 8, M = 256: 3.5 MiB against 0.13 + 1.0). Where the slots
are not rows of the
result (``recv_in_out``), the kernel runs one row panel and the buffer
fits the chip's VMEM budget (``collective_matmul._fused``), the start
returns it in VMEM instead (``S(1)`` in the compiled HLO; the peers'
DMAs write it there): the compute kernel takes it in VMEM and reads each
unit's half in place (``recv[d, slot]``, only at steps after the first:
before, the peers are still writing every slot), so it has no chunk
double buffer and makes no local copies, and the done takes it in VMEM
(its and the start's scoped VMEM limits raised above 8 MiB of it, as the
reduce-scatter's done holds its sent partial sums). XLA neither copies
nor evicts it (measured on v5e, v6e and v5p at the Llama shard's tp 8, M
= 16 to 256, and on v5e and v6e at M = 1024; ``tests/test_ag_slots_tpu.
py``): the program's HBM
temporaries drop to 0.05 MiB there, and the benchmark model's step times
are unchanged (design/benchmarks.md, "The all-gather's receive slots").

Limits. ``k / d`` a multiple of 128; ``f`` divisible by ``bn``; the
accumulator ``[m, f]`` (float32; int32 for int8), ``2 max(steps)``
``[m, k]`` chunk buffers (or the VMEM receive buffer) and the ``w``
blocks must fit in VMEM (the caller splits ``m`` into panels when they
do not). One ring axis; other mesh axes keep this device's coordinates.
A step waits for its units inside the kernel; the benchmark model
charges that wait (each slot arrives on its own, FIFO per link, in the
order the start sends them).
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from asyncops import _jax_compat as jc
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
    steps: chunks per step (the step plan; None: one chunk per step).
    tail: parts of grid iterations (each iteration's ``[m, k/d] @ [k/d,
      bn]`` runs as :attr:`parts` dots of ``bn / parts`` columns) at the
      end of a half-step that the copies of the next half-step's halves
      overlap: it waits for those halves before its last ``tail``
      parts. None: before its last column block (after all of it when
      ``f = bn``). A short tail waits later, so a late half stalls less,
      but the copies must still fit under the tail's matmuls
      (``collective_matmul._fused.choose_tail``).
    panel: the row panel this kernel runs (``m`` rows of every panel):
      the start sends rows ``panel m ..`` of the ``x`` it is given and
      the compute kernel reads them and writes its rows of the result
      (``compute``'s ``into``); 0 for one panel.
    recv_in_out: the receive slots live in the result's own HBM buffer,
      in this panel's rows (slot ``t`` of direction ``d``: columns ``(d
      (n - 1) + t) k/d ..``), which the kernel writes only in its last
      step, after every chunk has arrived and been copied into VMEM: the
      start returns the result buffer (or takes the previous panel's,
      aliased), the compute kernel writes it in place, and no separate
      ``(n - 1) m k`` receive buffer is allocated. Needs the chunks in
      the result's dtype, ``(n - 1) k <= f`` and no quantized scales
      (:func:`recv_fits_out`).
    split: the last half to arrive (slot ``n - 2`` of the last direction,
      the start's last send) travels as two row pieces, rows ``0 .. m/2``
      and ``m/2 .. m``, each its own DMA on its own semaphore pair (slot
      ``n - 1`` of the last direction in the semaphore arrays holds the
      second piece's): the last half-step waits for the first piece where
      it waited for the whole half and for the second only before its
      first iteration, whose two parts then split rows (:attr:`parts`).
      ``x`` is then read by halves (a double-buffered ``[m, k/d]`` block,
      half 1 fetched under half-step ``(0, 0)``), not whole before the
      first dot. Chosen by ``collective_matmul._fused.choose_split`` where
      the last half's wait is exposed.
    recv_vmem: the receive buffer ``[d, n - 1, m, k/d]`` is a VMEM output
      of the start (memory space ``S(1)``: the peers' DMAs land there),
      which the compute kernel reads each unit's half from in place (no
      copy into a VMEM chunk buffer, of which it then has none) and the
      done takes in VMEM: no receive buffer in HBM. :func:`vmem_bytes`
      counts it and :func:`recv_vmem_limit` raises the start's and the
      done's scoped VMEM limits to hold it. Chosen by
      ``collective_matmul._fused`` where it fits the chip's VMEM budget;
      not with :attr:`recv_in_out`.
    forward: the antipode's halves are forwarded, not sent direct (a
      4-cycle, two directions, :attr:`recv_vmem`, one panel, no
      :attr:`split`, unquantized): the start sends each half to both
      neighbours only (slots ``0`` and ``1``); the compute kernel runs
      as two kernels, the local step (:func:`compute_local`, its float32
      accumulator a VMEM output), which at its end waits for slot ``0``
      of each direction and sends it on to the next neighbour the same
      way, into its slot ``2`` (:attr:`fwd_slot`; :func:`forward_kernel`,
      on the start's semaphores of that slot), and the rest
      (:func:`compute_rest`, which takes the accumulator). The busiest
      directed link then carries three halves, not four. The result's
      kernel starts no remote DMA: XLA copies the result of one that
      does at the program's output (design/benchmarks.md, "Forwarding in
      the fused all-gather").
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
  quantized: bool = False
  steps: tuple[int, ...] | None = None
  tail: int | None = None
  panel: int = 0
  recv_in_out: bool = False
  split: bool = False
  recv_vmem: bool = False
  forward: bool = False

  def __post_init__(self):
    c.check_ring(self.directions, self.n)
    if self.tail is not None and (
      not isinstance(self.tail, int) or self.tail < 1
    ):
      raise ValueError(
        f"AgSpec.tail must be a positive int (iteration parts) or None, "
        f"got {self.tail!r}."
      )
    if self.steps is not None:
      st = tuple(self.steps)
      if (
        not st
        or any(not isinstance(g, int) or g < 1 for g in st)
        or sum(st) != self.n
        or st[0] != 1
      ):
        raise ValueError(
          f"AgSpec.steps must be positive ints summing to n = {self.n} "
          f"with steps[0] == 1 (the local chunk), got {self.steps!r}; e.g. "
          f"{(1,) * self.n} (one chunk per step) or {(1, self.n - 1)}."
        )
    if self.quantized and jnp.dtype(self.dtype) != jnp.int8:
      raise ValueError(f"quantized chunks travel as int8, got {self.dtype}")
    if self.k % self.directions or self.f % self.bn:
      raise ValueError(f"k/directions and f/bn must divide: {self}")
    if self.split and (self.quantized or self.m % 2):
      raise ValueError(
        f"AgSpec.split needs unquantized chunks and even m, got {self}"
      )
    if self.recv_vmem and self.recv_in_out:
      raise ValueError(
        "AgSpec.recv_vmem and recv_in_out are exclusive (the receive slots "
        f"are a VMEM buffer or rows of the result), got {self}"
      )
    if self.forward and not (
      self.n == 4
      and self.directions == 2
      and self.recv_vmem
      and self.panel == 0
      and not (self.split or self.quantized)
    ):
      raise ValueError(
        "AgSpec.forward needs a ring of 4, two directions, recv_vmem, one "
        f"panel, no split and unquantized chunks, got {self}"
      )
    if self.recv_in_out and not recv_fits_out(self):
      raise ValueError(
        "AgSpec.recv_in_out needs unquantized chunks in the result's dtype "
        f"and (n - 1) k <= f; got dtype {self.dtype}, out_dtype "
        f"{self.out_dtype}, quantized {self.quantized}, (n - 1) k = "
        f"{(self.n - 1) * self.k}, f = {self.f}. Leave it False."
      )

  @property
  def fwd_slot(self) -> int:
    """The slot the :attr:`forward` relay fills (the antipode's, two
    hops away); -1 without :attr:`forward`."""
    return self.hops.index(2) if self.forward else -1

  @property
  def plan(self) -> tuple[int, ...]:
    """Chunks per step (``steps``, or one chunk per step)."""
    return tuple(self.steps) if self.steps is not None else (1,) * self.n

  @property
  def parts(self) -> int:
    """Parts of each grid iteration's block (one dot each), the unit of
    :attr:`tail`: two where a tail is given and ``bn / 2`` is a multiple
    of 128 (the wait may then fall mid-iteration), else one; with
    :attr:`split` always two, of ``m / 2`` rows each (not ``bn / 2``
    columns)."""
    if self.split:
      return 2
    return 2 if self.tail is not None and self.bn % 256 == 0 else 1

  @property
  def mh(self) -> int:
    """Rows of each piece of the split half (:attr:`split`)."""
    return self.m // 2

  @property
  def g(self) -> int:
    """Most chunks of one step (the grid's chunk axis)."""
    return max(self.plan)

  @property
  def offsets(self) -> tuple[int, ...]:
    """First ring unit of each step."""
    out, a = [], 0
    for g in self.plan:
      out.append(a)
      a += g
    return tuple(out)

  @property
  def scope(self) -> str:
    """The named scope the compute kernel runs in (the benchmark model
    reads the step plan from it)."""
    plan = "-".join(str(g) for g in self.plan)
    tail = "" if self.tail is None else f"_t{self.tail}p{self.parts}"
    split = "_split" if self.split else ""
    fwd = "_fwd" if self.forward else ""
    return f"ring_steps_{plan}_nf{self.nf}{tail}_halves{split}{fwd}"

  @property
  def hops(self) -> tuple[int, ...]:
    """Ring distance of the peer each receive slot comes from, nearest
    first: ``1, n - 1, 2, n - 2, ...`` (slot ``t`` of direction ``d``
    holds half ``d`` of the chunk ``shift_d * hops[t]`` behind; ``n - 1``
    ahead is the neighbour on the other side, one hop away on a cycle)."""
    out = []
    for a in range(1, self.n // 2 + 1):
      for b in (a, self.n - a):
        if b not in out:
          out.append(b)
    return tuple(out)

  @property
  def slots_scope(self) -> str:
    """The named scope of a ``recv_in_out`` start and compute kernel: the
    receive slots' layout ``ring_slots_<d>x<n - 1>x<m>x<k/d>x<bytes>``
    (bytes per element; the benchmark model reads it: the slots are
    rows of the result, not a buffer of their own)."""
    t = jnp.dtype(self.dtype).itemsize
    return f"ring_slots_{self.directions}x{self.n - 1}x{self.m}x{self.kh}x{t}"

  @property
  def hops_scope(self) -> str:
    """The named scope the start kernel runs in (the benchmark model reads
    the order of the sends from it)."""
    split = "_split" if self.split else ""
    fwd = "_fwd" if self.forward else ""
    return "ring_hops_" + "-".join(str(a) for a in self.hops) + split + fwd

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
    if jnp.dtype(self.dtype) == jnp.int8 and not self.quantized:
      return jnp.int32
    return jnp.float32

  @property
  def mxu_dtype(self):
    """What the chunks meet the MXU as (int8 codes as exact bf16)."""
    return jnp.bfloat16 if self.quantized else jnp.dtype(self.dtype)


def recv_fits_out(spec: AgSpec) -> bool:
  """Whether ``spec``'s receive slots fit in its panel of the result
  (:attr:`AgSpec.recv_in_out`): chunks of the result's dtype, not
  quantized, ``n - 1`` chunks of ``k`` columns within ``f``."""
  return (
    not spec.quantized
    and jnp.dtype(spec.dtype) == jnp.dtype(spec.out_dtype)
    and (spec.n - 1) * spec.k <= spec.f
  )


def slot_ref(spec: AgSpec, buf, d: int, t: int):
  """Receive slot ``t`` of direction ``d`` in ``buf``: ``buf[d, t]`` of a
  receive buffer, or (``recv_in_out``) its ``[m, k/d]`` block of this
  panel's rows of the result."""
  if not spec.recv_in_out:
    return buf.at[d, t]
  col = (d * (spec.n - 1) + t) * spec.kh
  return buf.at[pl.ds(spec.panel * spec.m, spec.m), pl.ds(col, spec.kh)]


def slot_rows(spec: AgSpec, buf, d: int, t: int, r0: int, nr: int):
  """Rows ``r0 .. r0 + nr`` of receive slot ``t`` of direction ``d``
  (:func:`slot_ref`)."""
  if not spec.recv_in_out:
    return buf.at[d, t, pl.ds(r0, nr)]
  col = (d * (spec.n - 1) + t) * spec.kh
  return buf.at[pl.ds(spec.panel * spec.m + r0, nr), pl.ds(col, spec.kh)]


def pieces(spec: AgSpec, d: int, t: int):
  """The DMAs slot ``t`` of direction ``d`` arrives in, ``(first row,
  rows, semaphore index)``: one (the whole half, ``(d, t)``), or for the
  split half (:attr:`AgSpec.split`) two row pieces, the second on
  ``(d, n - 1)``."""
  if spec.split and d == spec.directions - 1 and t == spec.n - 2:
    return [(0, spec.mh, (d, t)), (spec.mh, spec.mh, (d, spec.n - 1))]
  return [(0, spec.m, (d, t))]


def vmem_bytes(spec: AgSpec) -> int:
  """VMEM the compute kernel needs (accumulator, buffers, blocks)."""
  t = jnp.dtype(spec.dtype).itemsize
  w = jnp.dtype(spec.w_dtype).itemsize
  o = jnp.dtype(spec.out_dtype).itemsize
  if spec.recv_vmem:
    chunks = recv_bytes(spec)  # the receive buffer (and scales), in place
  else:
    chunks = 2 * spec.g * spec.m * spec.k * t  # chunk double buffer
  return (
    spec.m * spec.f * 4 * (1 + spec.forward)  # accumulator (and the local's)
    + chunks
    + 2 * spec.m * spec.k * t  # x block (Mosaic keeps two buffers)
    + 2 * spec.k * spec.bn * w  # w blocks, both halves, two buffers
    + 2 * spec.m * spec.bn * o  # output blocks
    + (
      (2 * spec.directions * spec.m * SCALE_LANES * 4)
      * (1 if spec.recv_vmem else spec.g + 1)
      if spec.quantized
      else 0
    )
  )


def recv_shapes(spec: AgSpec) -> list[tuple[tuple[int, ...], jnp.dtype]]:
  """``(shape, dtype)`` of each receive buffer the start returns: the
  chunk halves ``[d, n - 1, m, k/d]`` and, quantized, their scales ``[d,
  n - 1, m, 128]`` float32 (none with :attr:`AgSpec.recv_in_out`: the
  slots are rows of the result)."""
  if spec.recv_in_out:
    return []
  d, n1, m = spec.directions, spec.n - 1, spec.m
  out = [((d, n1, m, spec.kh), jnp.dtype(spec.dtype))]
  if spec.quantized:
    out.append(((d, n1, m, SCALE_LANES), jnp.dtype(jnp.float32)))
  return out


def recv_bytes(spec: AgSpec) -> int:
  """Bytes of the receive buffers (:func:`recv_shapes`), wherever they
  live."""
  return sum(
    math.prod(shape) * dtype.itemsize for shape, dtype in recv_shapes(spec)
  )


def recv_hbm_bytes(spec: AgSpec) -> int:
  """Bytes of the receive buffers in HBM, one row panel's: none with
  :attr:`AgSpec.recv_vmem` (in VMEM) or :attr:`AgSpec.recv_in_out` (rows
  of the result)."""
  return 0 if spec.recv_vmem else recv_bytes(spec)


def recv_vmem_limit(spec: AgSpec) -> int | None:
  """The scoped VMEM limit of a :attr:`AgSpec.recv_vmem` start and done,
  which hold the receive buffer in VMEM: above 8 MiB of it raised to hold
  it (as the reduce-scatter's done holding its sent partial sums); None
  (XLA's default) below and without ``recv_vmem``."""
  if not spec.recv_vmem or recv_bytes(spec) <= 8 * 2**20:
    return None
  return recv_bytes(spec) + 2**22


# A quantized chunk half travels with its per-row scales, one float32 per
# row broadcast over a lane tile (a DMA-friendly [m, 128] block).
SCALE_LANES = 128


def half_steps(spec: AgSpec) -> list[tuple[int, int, int, int]]:
  """The compute kernel's half-steps in order, ``(step, direction, next
  step, next direction)``: step ``s`` multiplies half ``0`` of each of its
  units over every column block, then half ``1`` (one direction: the
  whole chunks), so it waits for each direction's halves on their own
  (on a 4-cycle the antipode's two halves cross the same two links one
  after the other: the second arrives a half's transfer after the
  first). The last one's next is ``(-1, -1)``.

  Example:
    >>> s = AgSpec("y", ("y",), 4, 8, 256, 512, "bfloat16", "bfloat16",
    ...            "bfloat16", steps=(1, 2, 1))
    >>> half_steps(s)[:3]
    [(0, 0, 0, 1), (0, 1, 1, 0), (1, 0, 1, 1)]
  """
  steps, nd = range(len(spec.plan)), range(spec.directions)
  order = [(s, d) for s in steps for d in nd]
  nxt = order[1:] + [(-1, -1)]
  return [(*a, *b) for a, b in zip(order, nxt, strict=True)]


def _chunk(me, shift: int, s, n: int):
  """The chunk a direction with ``shift`` holds at ring unit ``s``."""
  return jax.lax.rem(me - shift * s + 2 * n * n, n)


def _table(values, i):
  """``values[i]`` for a traced ``i`` (a static tuple of ints)."""
  out = jnp.int32(values[-1])
  for idx in range(len(values) - 2, -1, -1):
    out = jnp.where(i == idx, jnp.int32(values[idx]), out)
  return out


def _unit(spec: "AgSpec", s, c):
  """``(ring unit of chunk c of step s, is c a chunk of step s)``; the
  unit is clamped to the step's last chunk where ``c`` is past it (the
  pipeline then fetches no new ``w`` block)."""
  size = _table(spec.plan, s)
  first = _table(spec.offsets, s)
  return first + jnp.minimum(c, size - 1), c < size


# Kernel bodies ---------------------------------------------------------------


def start_kernel(
  x_ref, recv_ref, send_sems, recv_sems, *, spec: AgSpec, scales=None
):
  """Barrier with the ring neighbours, then the first hop of each half.

  ``scales``: for quantized chunks, ``(xs_ref [d, m, 128], recv_s_ref [d,
  n - 1, m, 128])``; each half's scales travel with it on its semaphores.
  """
  me = jax.lax.axis_index(spec.axis_name)
  n, kh = spec.n, spec.kh
  barrier = pltpu.get_barrier_semaphore()
  # Every peer writes into this device's receive buffer, so each device
  # tells every peer it has entered (its buffers exist) before any send.
  senders = [jax.lax.rem(me + t, n) for t in range(1, n)]
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
  # Direct sends, nearest first: half d goes to the peer sh * hops[t] away,
  # which uses it at step t + 1 (its slot t). ``x`` may hold every row
  # panel: this one's rows start at ``panel m``.
  rows = pl.ds(spec.panel * spec.m, spec.m)
  for t in range(n - 1):
    if t == spec.fwd_slot:
      continue  # relayed by the neighbour (:func:`forward_kernel`)
    for d, sh in enumerate(spec.shifts):
      pairs = [
        (
          x_ref.at[pl.ds(spec.panel * spec.m + r0, nr), pl.ds(d * kh, kh)],
          slot_rows(spec, recv_ref, d, t, r0, nr),
          at,
        )
        for r0, nr, at in pieces(spec, d, t)
      ]
      if scales is not None:
        pairs.append((scales[0].at[d, rows], scales[1].at[d, t], (d, t)))
      for src, dst, at in pairs:
        pltpu.make_async_remote_copy(
          src,
          dst,
          send_sems.at[at],
          recv_sems.at[at],
          device_id=c.ring_peer(spec, me, sh * spec.hops[t]),
          device_id_type=pl.DeviceIdType.MESH,
        ).start()


def compute_kernel(
  *refs, spec: AgSpec, lo: int = 0, hi: int | None = None, relay_sems=None
):
  """Grid step ``(s, d, j, c)``: half ``d`` of chunk ``c`` of step ``s``,
  output block ``j`` (each (chunk, half) meets its own ``w`` rows, so they
  are separate grid steps; ``w`` is one operand, read once; half-step
  ``(s, d)`` runs every block of its units' halves ``d``). A step of
  ``g`` chunks runs ``c = 0 .. g - 1`` (the grid's chunk axis is the
  largest step's; the other iterations do nothing and fetch nothing).

  ``refs``: ``me, x, [x scales], w, recv, [recv scales], recv_sems, out,
  token, acc, chunk buffer, [scale buffer], copy_sems`` (the bracketed ones
  for quantized chunks). It starts no remote DMA, so XLA does not treat it
  as communicating and writes its result in place (a communicating
  kernel's result is copied once more before it leaves the program).

  ``lo``, ``hi``: the steps this kernel runs (:attr:`AgSpec.forward`'s
  two kernels; all of them by default). Steps ``0 .. hi`` with ``hi``
  short of the plan (:func:`compute_local`): no ``out`` and no
  accumulator scratch, the accumulator is the output (``me, x, w, recv,
  recv_sems, acc, token, copy_sems``). From ``lo > 0``
  (:func:`compute_rest`): no ``x``, and the previous kernel's accumulator
  after ``recv_sems`` (``me, w, recv, recv_sems, acc_in, out, token, acc,
  copy_sems``), which the first half-step's products are added to.

  ``relay_sems``: the start's send semaphores, given to the kernel that
  runs step 0 with :attr:`AgSpec.forward`: after step 0's last iteration
  it relays slot 0 (:func:`forward_kernel`). That kernel then starts
  remote DMAs; it is not the one whose output is the result
  (:func:`compute_local`).
  """
  q = spec.quantized
  hi = len(spec.plan) if hi is None else hi
  has_final = hi == len(spec.plan)
  refs = list(refs)
  me_ref = refs.pop(0)
  x_ref = refs.pop(0) if lo == 0 else None
  xs_ref = refs.pop(0) if q else None
  w_ref, recv_ref = refs.pop(0), refs.pop(0)
  rs_ref = refs.pop(0) if q else None
  recv_sems = refs.pop(0)
  acc_in = refs.pop(0) if lo > 0 else None
  if has_final:
    o_ref, tok_ref, acc_ref, *bufs, copy_sems = refs
  else:
    o_ref = None
    acc_ref, tok_ref, *bufs, copy_sems = refs
  vm = spec.recv_vmem  # units read in place from the VMEM receive buffer
  xbuf, sbuf = (None, None) if vm else (bufs[0], bufs[1] if q else None)
  nd = spec.directions
  kh, bn, nf = spec.kh, spec.bn, spec.nf
  plan, offsets, last = spec.plan, spec.offsets, len(spec.plan) - 1
  s, d = pl.program_id(0) + lo, pl.program_id(1)
  j, ci = pl.program_id(2), pl.program_id(3)
  slot = jax.lax.rem(s, 2)
  del me_ref  # only the w index map reads it
  unit, valid = _unit(spec, s, ci)
  # The receive slot of this iteration's unit (clamped at the local one).
  u1 = jnp.maximum(unit - 1, 0)
  first_it = (j == 0) & (ci == 0)

  @pl.when((s == lo) & (d == 0) & first_it)
  def _():
    tok_ref[0] = jnp.int32(0)

  def local_copies(dd, src_slot, cc, dst_slot, piece=0):
    """``(source, destination, copy semaphore)`` of piece ``piece`` of
    the slot's DMAs (:func:`pieces`; the second piece of the split half
    on copy semaphore ``(g, 0)``)."""
    r0, nr, _ = pieces(spec, dd, src_slot)[piece]
    sem = copy_sems.at[spec.g, 0] if piece else copy_sems.at[cc, dd]
    out = [
      (
        slot_rows(spec, recv_ref, dd, src_slot, r0, nr),
        xbuf.at[dst_slot, cc, pl.ds(r0, nr), pl.ds(dd * kh, kh)],
        sem,
      )
    ]
    if q:
      out.append((rs_ref.at[dd, src_slot], sbuf.at[dst_slot, cc, dd], sem))
    return out

  # Step ss > 0 holds ring units offsets[ss] ..; unit u arrived in slot
  # u - 1 (one per direction). Half-step (ss, dd) multiplies half dd of
  # each of them.
  def each_copy(ss, dd, dst_slot):
    for cc in range(plan[ss]):
      yield cc, dd, offsets[ss] + cc - 1, dst_slot

  for ss in range(1, last + 1):
    for dd in range(nd):
      if vm and not spec.split:
        continue  # nothing was copied: the units are read in place

      @pl.when((s == ss) & (d == dd) & first_it)
      def _(ss=ss, dd=dd):
        for cc, dd_, u1, dst in each_copy(ss, dd, ss % 2):
          if not vm:
            for src, dst_ref, sem in local_copies(dd_, u1, cc, dst):
              pltpu.make_async_copy(src, dst_ref, sem).wait()
          if len(pieces(spec, dd_, u1)) > 1:
            # The split half's second piece: waited for here, before the
            # last half-step's first part; its copy overlaps that part
            # (``recv_vmem``: read in place, no copy).
            r0, nr, at = pieces(spec, dd_, u1)[1]
            c.wait_dma(
              slot_rows(spec, recv_ref, dd_, u1, r0, nr), recv_sems.at[at]
            )
            if not vm:
              for src, dst_ref, sem in local_copies(dd_, u1, cc, dst, 1):
                pltpu.make_async_copy(src, dst_ref, sem).start()

  half = pl.ds(pl.multiple_of(d * kh, kh), kh)

  def held_rows(rows):
    """Rows ``rows`` of the half this iteration multiplies (``x`` at
    step 0: by halves, its block, with :attr:`AgSpec.split`)."""
    if lo > 0:  # past the local step: every unit is a received one
      return recv_ref[d, u1, rows, :].astype(spec.mxu_dtype)
    mine = x_ref[rows, :] if spec.split else x_ref[rows, half]
    if hi == 1:  # the local step only
      return mine.astype(spec.mxu_dtype)
    if vm:
      # Read only at s > 0: at step 0 the peers are still writing every
      # slot (a read then would race their DMAs, however discarded).
      held = jax.lax.cond(
        s == 0, lambda: mine, lambda: recv_ref[d, u1, rows, :]
      )
    else:
      held = jnp.where(s == 0, mine, xbuf[slot, ci, rows, half])
    return held.astype(spec.mxu_dtype)

  if not spec.split:
    held_all = held_rows(slice(None))
  first = (s == lo) & (ci == 0) & (d == 0)
  final = (s == last) & (ci == plan[last] - 1) & (d == nd - 1)
  if not has_final:
    final = jnp.bool_(False)

  def wait_next(ns, nd_):
    """Waits for the halves of half-step ``(ns, nd_)`` and starts their
    copies into VMEM (``recv_vmem``: only waits)."""
    for cc, dd_, u1, dst in each_copy(ns, nd_, ns % 2):
      if spec.forward and u1 == 0:
        continue  # slot 0: waited for by the relay (:func:`forward_kernel`)
      r0, nr, at = pieces(spec, dd_, u1)[0]  # the split half's first piece
      c.wait_dma(slot_rows(spec, recv_ref, dd_, u1, r0, nr), recv_sems.at[at])
      if q:
        c.wait_dma(rs_ref.at[dd_, u1], recv_sems.at[dd_, u1])
      if vm:
        continue
      for src, dst_ref, sem in local_copies(dd_, u1, cc, dst):
        pltpu.make_async_copy(src, dst_ref, sem).start()

  # Each iteration's block in ``parts`` column parts, one dot each: the
  # wait for the next half-step's halves falls after a part (``spec.tail``
  # counts parts), so a late half stalls at most a part's matmul before
  # the half-step ends.
  # With ``spec.split`` the parts are row parts (``m / 2`` rows, the
  # whole block's columns): the split half's second piece is copied into
  # VMEM under the last half-step's first part.
  # With the relay (:attr:`AgSpec.forward`) step 1 waits for its first
  # half-step's halves as it begins, not under step 0's last block: the
  # relay runs between the two (after step 0's last iteration, the end of
  # the local kernel), and a neighbour's relayed half may be one of them.
  # The wait only (recv_vmem: nothing to copy).
  cut = 1 if spec.forward else None
  if cut is not None and lo <= cut < hi:

    @pl.when((s == cut) & (d == 0) & first_it)
    def _():
      wait_next(cut, 0)

  parts = spec.parts
  sub = bn if spec.split else bn // parts
  sr = spec.mh if spec.split else spec.m
  last_first = (s == last) & (d == nd - 1) & first_it
  for part in range(parts):
    r = pl.ds(part * sr, sr) if spec.split else slice(None)
    oc = 0 if spec.split else part * sub
    cols = pl.ds(pl.multiple_of(j * bn + oc, sub), sub)
    if spec.split:
      if part == 1 and not vm:  # recv_vmem: nothing copied, read in place

        @pl.when(last_first)
        def _():
          for cc, dd_, u1, dst in each_copy(last, nd - 1, last % 2):
            if len(pieces(spec, dd_, u1)) > 1:
              for src, dst_ref, sem in local_copies(dd_, u1, cc, dst, 1):
                pltpu.make_async_copy(src, dst_ref, sem).wait()

      held = held_rows(r)
    else:
      held = held_all
    y = jnp.dot(
      held,
      w_ref[:, pl.ds(oc, sub)].astype(spec.mxu_dtype),
      preferred_element_type=spec.acc_dtype,
      precision=jax.lax.Precision[spec.precision],
    )
    if q:
      if vm:
        scale = jax.lax.cond(s == 0, lambda: xs_ref[d], lambda: rs_ref[d, u1])
      else:
        scale = jnp.where(s == 0, xs_ref[d], sbuf[slot, ci, d])
      y = y * scale[:, :1]

    @pl.when(valid & first)
    def _(r=r, cols=cols, y=y):
      if lo > 0:
        acc_ref[r, cols] = acc_in[r, cols] + y
      else:
        acc_ref[r, cols] = y

    @pl.when(valid & ~first & ~final)
    def _(r=r, cols=cols, y=y):
      acc_ref[r, cols] += y

    if has_final:

      @pl.when(valid & final)
      def _(r=r, cols=cols, y=y, oc=oc):
        o_ref[r, pl.ds(oc, sub)] = (acc_ref[r, cols] + y).astype(o_ref.dtype)

    # The halves of the next half-step (half 1 of this step after half 0,
    # else half 0 of the next step): wait for them and copy them into
    # VMEM (the copies overlap this half-step's last block, or its last
    # ``spec.tail`` parts).
    for ss, dd, ns, nd_ in half_steps(spec)[:-1]:
      if ns == 0:
        continue  # the local chunk's second half: x, already in VMEM
      if not lo <= ss < hi or ns >= hi:
        continue  # not this kernel's (compute_local / compute_rest)
      if cut is not None and ss < cut <= ns:
        continue  # waited for as step ``cut`` begins
      if spec.tail is None:
        if part < parts - 1:
          continue
        at = (j == max(nf - 2, 0)) & (ci == plan[ss] - 1)
      else:
        after = max(nf * plan[ss] * parts - spec.tail - 1, 0)
        if after % parts != part:
          continue
        at = (j * plan[ss] + ci == after // parts) & (ci < plan[ss])

      @pl.when((s == ss) & (d == dd) & at)
      def _(ns=ns, nd_=nd_):
        wait_next(ns, nd_)

  if relay_sems is not None and lo == 0:
    # The relay, after step 0's last iteration (its dots done).
    end0 = (s == 0) & (d == nd - 1) & (j == nf - 1) & (ci == spec.g - 1)

    @pl.when(end0)
    def _():
      forward_kernel(recv_ref, recv_sems, relay_sems, spec=spec)


def done_kernel(
  recv_ref, send_sems, *, spec: AgSpec, recv_scales=None, from_x=False
):
  """Waits for every send of the start (with :attr:`AgSpec.forward`, the
  relay's sends in place of slot :attr:`AgSpec.fwd_slot`'s, on the same
  semaphores and of the same size). ``recv_ref``: the receive buffer
  (its slots give the sizes), or with ``from_x`` ``x`` itself (a
  ``recv_in_out`` done does not take the result; this panel's rows of
  half ``d`` of ``x`` are a slot's size)."""
  for d in range(spec.directions):
    for t in range(spec.n - 1):
      for r0, nr, at in pieces(spec, d, t):
        if from_x:
          rows = pl.ds(spec.panel * spec.m + r0, nr)
          ref = recv_ref.at[rows, pl.ds(d * spec.kh, spec.kh)]
        else:
          ref = slot_rows(spec, recv_ref, d, t, r0, nr)
        c.wait_dma(ref, send_sems.at[at])
      if recv_scales is not None:
        c.wait_dma(recv_scales.at[d, t], send_sems.at[d, t])


def forward_kernel(recv_ref, recv_sems, send_sems, *, spec: AgSpec):
  """The relay (:attr:`AgSpec.forward`): waits for slot ``0`` of each
  direction (half ``d`` of the neighbour's chunk ``shift_d`` behind) and
  sends it on to the neighbour ``shift_d`` ahead, into its slot
  :attr:`AgSpec.fwd_slot` (for it that chunk is two hops behind), on the
  start's semaphores of that slot, which the start leaves unused
  (``send_sems[d, fwd_slot]`` here, ``recv_sems[d, fwd_slot]`` there)."""
  fs = spec.fwd_slot
  me = jax.lax.axis_index(spec.axis_name)
  for d in range(spec.directions):
    c.wait_dma(recv_ref.at[d, 0], recv_sems.at[d, 0])
  for d, sh in enumerate(spec.shifts):
    pltpu.make_async_remote_copy(
      recv_ref.at[d, 0],
      recv_ref.at[d, fs],
      send_sems.at[d, fs],
      recv_sems.at[d, fs],
      device_id=c.ring_peer(spec, me, sh),
      device_id_type=pl.DeviceIdType.MESH,
    ).start()


# pallas_calls ----------------------------------------------------------------


def _sem_array(spec: AgSpec):
  """``[d, n - 1]`` DMA semaphores, one a slot (``[d, n]`` with
  :attr:`AgSpec.split`: the split half's second piece on ``(d - 1, n -
  1)``)."""
  return pltpu.SemaphoreType.DMA((spec.directions, spec.n - 1 + spec.split))


def _recv_shapes(x, spec: AgSpec):
  """The receive buffers (:func:`recv_shapes`) as outputs varying as
  ``x`` does."""
  return [c.shape_like(x, shape, dt) for shape, dt in recv_shapes(spec)]


def _shift_of(spec: AgSpec, d):
  """The shift of direction ``d`` (a traced grid index)."""
  if spec.directions == 1:
    return jnp.int32(spec.shifts[0])
  return jnp.where(d == 0, jnp.int32(1), jnp.int32(-1))


def _once(shape, index=None):
  """A block fetched once (its index never changes): one buffer."""
  index = index or (0,) * len(shape)
  return pl.BlockSpec(
    shape, lambda s, d, j, ci, me: index, pipeline_mode=pl.Buffered(1)
  )


def _in_specs(spec: AgSpec, lo: int = 0):
  """``x`` (and its scales) fetched once, then ``w``'s block ``[k/d, bn]``:
  rows of the chunk direction ``d`` holds at chunk ``ci`` of step ``s``,
  columns of block ``j``. From step ``lo > 0`` (grid step ``s`` is step
  ``s + lo``): no ``x``."""

  def w_index(s, d, j, ci, me_ref):
    unit, _ = _unit(spec, s + lo, ci)
    hop = _table((0, *spec.hops), unit)
    chunk = _chunk(me_ref[0], _shift_of(spec, d), hop, spec.n)
    return (chunk * spec.directions + d, j)

  # Row panel ``p`` of ``x`` (and of its scales) is block ``p``; split:
  # ``x`` by halves, half ``d`` at half-step ``(0, d)`` (the pipeline
  # fetches half 1 under half-step (0, 0)), then kept.
  if spec.split:
    nd = spec.directions
    xs = [
      pl.BlockSpec(
        (spec.m, spec.kh),
        lambda s, d, j, ci, me: (spec.panel, jnp.where(s == 0, d, nd - 1)),
      )
    ]
  else:
    xs = [_once((spec.m, spec.k), (spec.panel, 0))]
  if spec.quantized:
    scales = (spec.directions, spec.m, SCALE_LANES)
    xs.append(_once(scales, (0, spec.panel, 0)))
  if lo > 0:
    xs = []
  return xs + [pl.BlockSpec((spec.kh, spec.bn), w_index)]


def _out_block(spec: AgSpec, lo: int = 0):
  # Only the last half-step (the last step's last direction) writes the
  # output; before it every iteration maps to block (panel, 0), which is
  # first written (and flushed) then: a block flushed earlier would write
  # garbage over receive slots still to be read (``recv_in_out``). Row
  # panel ``p`` writes rows ``p m ..`` of the whole result.
  last = len(spec.plan) - 1
  return pl.BlockSpec(
    (spec.m, spec.bn),
    lambda s, d, j, ci, me: (
      spec.panel,
      jnp.where((s + lo == last) & (d == spec.directions - 1), j, 0),
    ),
  )


def _scratch(spec: AgSpec, acc: bool = True):
  out = [pltpu.VMEM((spec.m, spec.f), spec.acc_dtype)] if acc else []
  if not spec.recv_vmem:  # else the units are read in the receive buffer
    out.append(pltpu.VMEM((2, spec.g, spec.m, spec.k), jnp.dtype(spec.dtype)))
  if spec.quantized and not spec.recv_vmem:
    shape = (2, spec.g, spec.directions, spec.m, SCALE_LANES)
    out.append(pltpu.VMEM(shape, jnp.float32))
  # (g, 0) of g + 1 rows: the split half's second piece's copy.
  sems = (spec.g + spec.split, spec.directions)
  return out + [pltpu.SemaphoreType.DMA(sems)]


def _grid(spec: AgSpec, lo: int = 0, hi: int | None = None):
  """``(steps, directions, column blocks, chunks of the largest step)``:
  each step runs one half-step per direction (:func:`half_steps`); steps
  ``lo .. hi`` of the plan (all by default)."""
  hi = len(spec.plan) if hi is None else hi
  return (hi - lo, spec.directions, spec.nf, spec.g)


def _params(spec: AgSpec, collective_id=None):
  return pltpu.CompilerParams(
    dimension_semantics=("arbitrary",) * 4,
    has_side_effects=True,
    vmem_limit_bytes=spec.vmem_limit,
    collective_id=collective_id,
  )


_SMEM = pl.BlockSpec(memory_space=pltpu.SMEM)
_VMEM = pl.BlockSpec(memory_space=pltpu.VMEM)


def _recv_spec(spec: AgSpec):
  """Where the kernels take the receive buffers: VMEM (``recv_vmem``) or
  HBM (pinned: XLA would otherwise move a small one to VMEM and copy it
  back while the peers write it)."""
  return _VMEM if spec.recv_vmem else c.HBM


def _recv_params(spec: AgSpec, collective_id=None):
  """The start's and the done's compiler params: a ``recv_vmem`` buffer
  above 8 MiB raises their scoped VMEM limit (:func:`recv_vmem_limit`)."""
  params = c.params(collective_id=collective_id)
  limit = recv_vmem_limit(spec)
  if limit is None:
    return params
  return dataclasses.replace(params, vmem_limit_bytes=limit)


def _scales_of(refs, spec: AgSpec):
  return (refs[0], refs[1]) if spec.quantized else None


def start(xs, *, spec: AgSpec, out_shape=None, into=None):
  """``(x, [x scales]) -> (receive buffers, send_sems, recv_sems)``; begins
  the first hop.

  ``x`` is read by DMAs after this kernel returns; it is not aliased (no
  user code sees it, and aliasing a parameter makes XLA copy it). The done
  takes ``x`` as an operand, so XLA keeps it alive until the sends end;
  :func:`run` gives all three kernels ``x`` pinned to HBM
  (:func:`pinned`), so that operand is the very buffer the DMAs read.

  ``recv_in_out``: the receive buffer is the result buffer, ``into`` (the
  previous row panel's result) or a new one of ``out_shape``; the start
  takes it as an operand and returns it unchanged (the peers write this
  panel's rows of it; the compute kernel, which waits for them, takes it
  aliased to its result). It is not the start's own result: XLA copies a
  communicating kernel's result once more before it leaves the program
  (measured: the Llama-3-70B shard on v6e, a 14 MiB ``copy`` at the
  ROOT).
  """
  nq = len(xs)
  if spec.recv_in_out:
    buf = _empty(out_shape) if into is None else into

    def kernel(*refs):
      x_ref, buf_ref, ss, rs = refs
      start_kernel(x_ref, buf_ref, ss, rs, spec=spec)

    with jax.named_scope(spec.hops_scope):
      ss, rs = pl.pallas_call(
        kernel,
        out_shape=(_sem_array(spec), _sem_array(spec)),
        in_specs=[c.ANY, c.ANY],
        out_specs=(c.SEM, c.SEM),
        compiler_params=c.params(collective_id=spec.collective_id),
        name="asyncops_ring_allgather_start",
      )(*xs, buf)
    return (buf,), ss, rs

  def kernel(*refs):
    ins, outs = refs[:nq], refs[nq:]
    recvs, (ss, rs) = outs[:nq], outs[nq:]
    scales = (ins[1], recvs[1]) if spec.quantized else None
    start_kernel(ins[0], recvs[0], ss, rs, spec=spec, scales=scales)

  with jax.named_scope(spec.hops_scope):
    out = _start_call(kernel, xs, spec)
  return tuple(out[:nq]), out[nq], out[nq + 1]


def _empty(out_shape):
  """A result buffer in HBM that nothing writes (a kernel that does
  nothing): the first row panel's receive slots and result."""

  def kernel(o_ref):
    del o_ref

  return pl.pallas_call(
    kernel,
    out_shape=c.hbm_like(out_shape),
    out_specs=c.HBM,
    name="asyncops_ring_allgather_buffer",
  )()


def _start_call(kernel, xs, spec: AgSpec):
  nq = len(xs)
  if spec.recv_vmem:
    # In VMEM: the peers' DMAs land there and the compute kernel reads
    # each unit in place (``AgSpec.recv_vmem``).
    shapes = tuple(
      pltpu.VMEM(r.shape, r.dtype) for r in _recv_shapes(xs[0], spec)
    )
  else:
    shapes = tuple(c.hbm_like(r) for r in _recv_shapes(xs[0], spec))
  out = pl.pallas_call(
    kernel,
    out_shape=shapes + (_sem_array(spec), _sem_array(spec)),
    in_specs=[c.ANY] * nq,
    out_specs=(_recv_spec(spec),) * nq + (c.SEM, c.SEM),
    compiler_params=_recv_params(spec, spec.collective_id),
    name="asyncops_ring_allgather_start",
  )(*xs)
  # The receive buffers vary as ``x`` does (their memory-space shapes
  # carry no manual axes): on jax 0.9 the compute kernel's ``lax.cond``
  # between a read of ``x`` and one of a VMEM buffer needs both refs typed
  # alike (``c.vary_like``; no HLO).
  return (*(c.vary_like(r, xs[0]) for r in out[:nq]), *out[nq:])


def compute(me, xs, w, recvs, recv_sems, *, spec: AgSpec, out_shape, into=None):
  """The chunk matmuls; returns the result and a token (an SMEM scalar the
  done takes, so it runs after this kernel without reading the result: a
  later reader of the result makes XLA stage it in VMEM and copy it out).

  ``into``: the result buffer of the previous row panel, aliased to this
  kernel's result (row panel ``spec.panel`` writes its ``m`` rows of it
  in place; ``out_shape`` is the whole result). ``recv_in_out``: the
  receive buffer ``recvs[0]`` is the result buffer, aliased (``into``
  must be None: the start took it)."""
  nq = len(xs)
  with jax.named_scope(spec.scope):
    return _compute_call(me, xs, w, recvs, recv_sems, spec, out_shape, nq, into)


def _compute_call(me, xs, w, recvs, recv_sems, spec, out_shape, nq, into):
  kernel = functools.partial(compute_kernel, spec=spec)
  in_specs = _in_specs(spec) + [_recv_spec(spec)] * nq + [c.SEM]
  extra, aliases = (), {}
  if spec.recv_in_out:
    if into is not None:
      raise ValueError("recv_in_out: the start takes the previous result")
    # me, x, w, then the receive buffer: the result itself, pinned to HBM
    # (XLA otherwise kept it in VMEM, prefetching the buffer there while
    # the peers wrote into it in HBM, and copied the result out).
    aliases = {nq + 2: 0}
    out_shape = c.hbm_like(out_shape)
    # The operand too: with ``x`` constrained (:func:`pinned`), jax 0.9's
    # lowering colours only the constrained operands, and XLA refuses an
    # uncoloured operand aliased to a coloured output (jax 0.10 colours
    # it from the output; the same HLO there).
    recvs = pinned(recvs)
  elif into is not None:
    # me, x, [xs], w, recv, [recv scales], sems, then the buffer.
    at = 2 * nq + 3

    def kernel(*refs):
      refs = list(refs)
      del refs[at]
      compute_kernel(*refs, spec=spec)

    extra, aliases, in_specs = (into,), {at: 0}, in_specs + [c.ANY]
  return pl.pallas_call(
    kernel,
    out_shape=(out_shape, c.shape_like(xs[0], (1,), jnp.int32)),
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1,
      grid=_grid(spec),
      in_specs=in_specs,
      out_specs=(_out_block(spec), _SMEM),
      scratch_shapes=_scratch(spec),
    ),
    compiler_params=_params(spec),
    input_output_aliases=aliases,
    name="ring_allgather_matmul",
  )(me, *_order(xs, w, recvs), recv_sems, *extra)


def compute_local(me, xs, w, recvs, recv_sems, send_sems, *, spec: AgSpec):
  """:attr:`AgSpec.forward`'s first compute kernel: step ``0`` (the local
  chunk), then the relay (:func:`forward_kernel`, on the start's
  semaphores); returns its float32 accumulator ``[m, f]`` in VMEM (what
  :func:`compute_rest` goes on from) and a token. It starts remote DMAs:
  XLA gives the program's result to no such kernel (it copies it at the
  ROOT), but this kernel's outputs are not the result."""

  def kernel(*refs):
    refs = list(refs)
    relay = refs.pop(4)  # me, x, w, recv, send_sems, recv_sems, ...
    compute_kernel(*refs, spec=spec, lo=0, hi=1, relay_sems=relay)

  acc, token = pl.pallas_call(
    kernel,
    out_shape=(
      pltpu.VMEM((spec.m, spec.f), spec.acc_dtype),
      c.shape_like(xs[0], (1,), jnp.int32),
    ),
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1,
      grid=_grid(spec, 0, 1),
      in_specs=_in_specs(spec) + [_recv_spec(spec), c.SEM, c.SEM],
      out_specs=(_VMEM, _SMEM),
      scratch_shapes=_scratch(spec, acc=False),
    ),
    compiler_params=_params(spec),
    name="ring_allgather_matmul_local",
  )(me, *xs, w, *recvs, send_sems, recv_sems)
  return c.vary_like(acc, xs[0]), token


def compute_rest(me, w, recvs, recv_sems, acc, token, *, spec, out_shape):
  """:attr:`AgSpec.forward`'s second compute kernel: steps ``1 ..`` on
  top of :func:`compute_local`'s accumulator ``acc`` (VMEM; it takes
  the local kernel's ``token`` too); returns the result and a token. No
  remote DMA: its output is the program's result as it is."""

  def kernel(*refs):
    refs = list(refs)
    del refs[5]  # me, w, recv, recv_sems, acc, token: the local's token
    compute_kernel(*refs, spec=spec, lo=1)

  return pl.pallas_call(
    kernel,
    out_shape=(out_shape, c.shape_like(acc, (1,), jnp.int32)),
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1,
      grid=_grid(spec, 1),
      in_specs=_in_specs(spec, lo=1) + [_recv_spec(spec), c.SEM, _VMEM, _SMEM],
      out_specs=(_out_block(spec, lo=1), _SMEM),
      scratch_shapes=_scratch(spec),
    ),
    compiler_params=_params(spec),
    name="ring_allgather_matmul_rest",
  )(me, w, *recvs, recv_sems, acc, token)


def _order(xs, w, recvs):
  """Operand order of the compute kernel: ``x, [xs], w, recv, [recv_s]``."""
  return (*xs, w, *recvs)


def done(xs, recvs, token, send_sems, *, spec: AgSpec):
  """Waits for every send; returns a token nothing needs to read.

  Reads the sources and receive buffers (so XLA keeps them alive until the
  sends end) and the compute kernel's ``token`` (so it runs after it: the
  transfers stay in flight under the matmul). It has side effects, so XLA
  keeps it. ``recv_in_out``: not the receive buffer (the result, which
  the compute kernel wrote in place: a later reader would make XLA copy
  it); the slots' sizes are ``x``'s halves.
  """
  nq = len(xs)
  if spec.recv_in_out:
    recvs = ()

  def kernel(*refs):
    nr = len(recvs)
    recv_refs = refs[nq : nq + nr]
    send_sems, token_ref = refs[nq + nr + 1], refs[nq + nr + 2]
    done_kernel(
      recv_refs[0] if nr else refs[0],
      send_sems,
      spec=spec,
      recv_scales=recv_refs[1] if spec.quantized else None,
      from_x=not nr,
    )
    token_ref[0] = jnp.int32(0)

  return pl.pallas_call(
    kernel,
    out_shape=c.shape_like(xs[0], (1,), jnp.int32),
    in_specs=[c.ANY] * nq + [_recv_spec(spec)] * len(recvs) + [_SMEM, c.SEM],
    out_specs=_SMEM,
    compiler_params=_recv_params(spec),
    name="asyncops_ring_allgather_done",
  )(*xs, *recvs, token, send_sems)


def pinned(xs):
  """``xs`` constrained to HBM (``pltpu.with_memory_space_constraint``),
  as the start, the compute kernel and the done take them.

  The start's DMAs read ``x`` (and the scales) after it returns; the done
  takes them so XLA keeps them live until the sends end. Unconstrained,
  XLA may place ``x`` in VMEM for the start and give the compute kernel
  and the done an HBM copy (a user kernel's VMEM output beside a large
  user VMEM buffer, v5e and v6e): the buffer the DMAs read is then free
  while they run, and ``check_hlo`` refuses the program ("source not
  live"). XLA cannot give an HBM-constrained operand a VMEM copy, so the
  three take one buffer, the one the start sends. (The compute kernel
  too: the copy guard pairs the start with it, as it waits for the
  receives, and a VMEM copy there was refused.) Design note: "The fused
  all-gather's source kept live under plain jax.jit"."""
  return tuple(jc.in_hbm(v) for v in xs)


def run(me, x, w, *, spec: AgSpec, out_shape, scales=None, into=None):
  """The three kernels in order; returns the result.

  ``scales``: for quantized ``x`` (int8), its per-row scales ``[d, m,
  128]`` float32 (one per row and half, broadcast over the lanes).
  ``into``: the previous row panel's result, written on in place
  (:func:`compute`; with ``recv_in_out`` the start takes it and the
  peers' chunks land in this panel's rows of it first).
  """
  # What the start's DMAs read, one HBM buffer the three kernels take
  # (:func:`pinned`).
  xs = pinned((x,) if scales is None else (x, scales))
  if spec.recv_in_out:
    with jax.named_scope(spec.slots_scope):
      recvs, send_sems, recv_sems = start(
        xs, spec=spec, out_shape=out_shape, into=into
      )
      out, token = compute(
        me, xs, w, recvs, recv_sems, spec=spec, out_shape=out_shape
      )
  elif spec.forward:
    # Local step, relay, the rest (:attr:`AgSpec.forward`). ``w`` pinned
    # to HBM as well: read by two kernels, XLA otherwise prefetched all
    # of it into VMEM for the second (8 MiB at the v6e chapter shape).
    (w,) = pinned((w,))
    recvs, send_sems, recv_sems = start(xs, spec=spec)
    with jax.named_scope(spec.scope):
      acc, token = compute_local(
        me, xs, w, recvs, recv_sems, send_sems, spec=spec
      )
      out, token = compute_rest(
        me,
        w,
        recvs,
        recv_sems,
        acc,
        token,
        spec=spec,
        out_shape=out_shape,
      )
    done(xs, recvs, token, send_sems, spec=spec)
    return out
  else:
    recvs, send_sems, recv_sems = start(xs, spec=spec)
    out, token = compute(
      me, xs, w, recvs, recv_sems, spec=spec, out_shape=out_shape, into=into
    )
  done(xs, recvs, token, send_sems, spec=spec)
  return out


def one_kernel(
  me, x, w, *, spec: AgSpec, out_shape, interpret=None, scales=None, into=None
):
  """The three bodies in one kernel, semaphores as scratch.

  Pallas's TPU interpreter cannot return semaphores from a kernel, so the
  CPU tests run this form: the start body before the first grid step, the
  done body after the last. Same DMAs, waits and arithmetic as the three
  kernels (``into`` as :func:`compute` takes it). ``recv_in_out``: the
  result buffer (``into``, or a new zero one for the first panel) is an
  operand aliased to the result, and the receive slots are its rows.
  """
  nd = spec.directions
  xs = (x,) if scales is None else (x, scales)
  nq = len(xs)
  if spec.recv_in_out and into is None:
    into = jnp.zeros(out_shape.shape, out_shape.dtype)
  extra = () if into is None else (into,)
  rio = spec.recv_in_out

  def kernel(me_ref, *refs):
    refs = list(refs)
    buf = None
    if into is not None:
      buf = refs.pop(2 * nq + 1)  # the aliased result buffer
    blocks = refs[: nq + 1]  # x, [xs], w (pipelined)
    anys = refs[nq + 1 : 2 * nq + 1]  # x, [xs] (HBM, for the start)
    o_ref = refs[2 * nq + 1]
    if rio:
      recvs = [buf]
      ss, rs, *scratch = refs[2 * nq + 2 :]
    else:
      recvs = refs[2 * nq + 2 : 3 * nq + 2]
      ss, rs, *scratch = refs[3 * nq + 2 :]
    s, d = pl.program_id(0), pl.program_id(1)
    j, ci = pl.program_id(2), pl.program_id(3)
    nsteps = len(spec.plan)

    @pl.when((s == 0) & (j == 0) & (ci == 0) & (d == 0))
    def _():
      scl = (anys[1], recvs[1]) if spec.quantized else None
      start_kernel(anys[0], recvs[0], ss, rs, spec=spec, scales=scl)

    tok_ref, *scratch = scratch
    compute_kernel(
      me_ref,
      *blocks,
      *recvs,
      rs,
      o_ref,
      tok_ref,
      *scratch,
      spec=spec,
      relay_sems=ss if spec.forward else None,
    )

    last = (s == nsteps - 1) & (j == spec.nf - 1) & (ci == spec.g - 1)

    @pl.when(last & (d == nd - 1))
    def _():
      done_kernel(
        anys[0] if rio else recvs[0],
        ss,
        spec=spec,
        recv_scales=recvs[1] if spec.quantized else None,
        from_x=rio,
      )

  recv_out = () if rio else tuple(_recv_shapes(x, spec))
  out = pl.pallas_call(
    kernel,
    out_shape=(out_shape, *recv_out),
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1,
      grid=_grid(spec),
      in_specs=_in_specs(spec) + [c.ANY] * (nq + len(extra)),
      out_specs=(_out_block(spec),)
      + ((_VMEM if spec.recv_vmem else c.ANY),) * len(recv_out),
      scratch_shapes=[_sem_array(spec), _sem_array(spec)]
      + [pltpu.SMEM((1,), jnp.int32)]
      + _scratch(spec),
    ),
    compiler_params=_params(spec, spec.collective_id),
    interpret=interpret,
    input_output_aliases={} if into is None else {2 * nq + 2: 0},
    name="ring_allgather_matmul_one_kernel",
  )(me, *xs, w, *xs, *extra)
  return out[0]
