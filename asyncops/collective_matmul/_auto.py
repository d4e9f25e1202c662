"""``method="auto"``, the default of the public collective matmuls: which
implementation a call runs.

Candidates (per device, inside ``shard_map``):

- ``"fused"``: the fused ring kernels (``asyncops.collective_matmul._fused``):
  chunks or partial sums travel both ways around the ring while the matmul
  consumes them, the accumulator in VMEM. Only the canonical forms (gather
  the contracting dimension, scatter the columns) with one weight; they
  differentiate through ``_vjp.fused_allgather`` / ``fused_reducescatter``
  (a ``custom_vjp`` with the ring backward).
- ``"xla"``: XLA's collective and then (or before) ``jnp.dot``:
  ``all_gather(x) @ w``, ``psum_scatter(x @ w)``, ``psum(x @ w)``.
- ``"ring"`` / ``"ring_bidi"``: the value-API ring of ``start``/``done``
  futures around XLA's chunk matmuls, one- or two-way (the two-way ring
  sends half of every chunk or partial sum each way: half the bytes per
  link per step; it needs an even number of rows). ``"auto"`` runs the
  ring the caller configured when a ring-only option is set
  (``api="ref"``, ``bidirectional=True``); for the canonical forms both
  rings are candidates beside the fused kernel and XLA; for the forms the
  fused kernels do not run (row gathers and scatters, several weights on
  one gather, ``return_gathered``) the one-way ring runs unless the matmul
  is bound by reading the weights (:func:`explain_ring`).

The choice is made at trace time from the per-device shapes, the dtype,
the ring size, the chip the mesh is made of (``AbstractMesh.
abstract_device``; a v5e if the mesh names none, e.g. on CPU, where every
method computes the same result with ``jax.lax``) and the slice's wiring
(:func:`wiring`: the ring's devices' coordinates, ``_wiring``; an ideal
ring when they are unknown). Each candidate gets an analytic estimate
from public chip figures (:data:`CHIPS`) and a few per-chip constants fit
to the benchmark model's figures (:data:`CAL`):

- MXU time ``C`` = FLOPs / peak (float32 at ``HIGHEST`` takes six bf16
  passes); HBM time ``M`` = bytes every method must read or write once
  (``w``, the chunks, the result) / HBM bandwidth; ``W`` = the weight
  read alone;
- ring time ``T(d)`` = bytes on the busiest directed link / link
  bandwidth plus a microsecond per link the longest message crosses, per
  step, with ``d`` directions in use. On a ring whose every hop is one
  link, ``T(2)`` moves half of ``T(1)``'s bytes per link; on a line (a
  sub-pod v5e/v6e ``y`` axis laid along one row of chips, no wraparound)
  the wrapping message crosses ``n - 1`` links and both directions share
  each link, so ``T(2)`` moves as many bytes as ``T(1)``. Our kernels and
  value rings run in the mesh axis's order; XLA's collectives in XLA's
  (``Wiring.xla``: a physical cycle through the ring's chips where one
  exists, as the benchmark model reorders them).

- ``xla ~ 1 us + T(1) + max(C, M) + CAL.xla_ag_w W``: XLA's collective
  inside ``shard_map`` blocks and runs over one ring direction (what the
  benchmark model finds in XLA's all-gather and reduce-scatter); XLA's
  estimate of its dot, which the model charges, is over the longer of
  its FLOPs and bytes by a share of the weight read (after the
  all-gather, ``CAL.xla_ag_w``: v5p one weight read, v6e 0.2; before
  the reduce-scatter, ``CAL.xla_rs_w``: v5p 0.35); the reduce-scatter's
  matmul, which it waits for, is charged the weight read at
  ``CAL.xla_hbm`` of HBM bandwidth. XLA's reduce-scatter and all-reduce
  move the result's dtype (float32 partial sums in float32; the fused
  kernels move them in bfloat16 at ``DEFAULT``).
- ``fused``, the all-gather: per row panel, ``1.5 us`` plus its steps'
  share of one contraction over all its chunks (each step the longer of
  its FLOPs times ``CAL.fused_dot`` and its rows of ``W`` times
  ``CAL.fused_w`` where XLA does not prefetch ``w`` into VMEM; the
  accumulator stays in VMEM, no pass charged: ``CAL.fused_acc`` 0 since
  branch h-agrefit), or the direct sends to every peer (the busiest
  link's load from the wiring, at ``1 / CAL.fused_ring`` of the link
  bandwidth) and the last step, whichever is longer; extra panels cost
  ``CAL.fused_panel W`` each (times ``P / CAL.fused_panel_knee`` for
  ``P`` panels beyond the knee) and ``CAL.fused_panels_s`` once, and
  ``CAL.fused_panel_s`` each on the contraction's path (hidden where the
  ring binds). The split last half (``AgSpec.split``) waits only before
  the last half-step's second row part. Where the plan can relay the
  antipode's halves (``AgSpec.forward``: a ring of 4, one panel, the
  receive buffer in VMEM) and the chip admits it (``CAL.fused_relay``,
  v6e), the relay is estimated too (the start's two halves on each
  link, the local step, its wait for slot 0 and issue, the relayed
  halves behind the start's, the rest kernel's fill and steps) and
  runs (``"fused_fwd"``) where 3% under the one kernel.
- ``fused``, the reduce-scatter: per row panel, ``1.5 us + W`` (the
  kernel's charge, XLA's estimate of the same dots, reads the weight
  before them; on v5p ``CAL.rs_overlap`` of the shorter of ``W`` and the
  panel's dots hides) plus the larger of its dots and its ring ``T(2)``,
  then its finish kernel (its panel's receive buffer read, the result
  written); extra panels cost ``CAL.rs_panel_w`` weight reads (v5e
  0.35) and ``CAL.rs_panel_s`` each. On v5e (and v4, one panel) the read
  streams under the dots (``CAL.rs_stream``; on v5e in row panels too:
  ``CAL.rs_stream_panels``) and the panel is the model's chain
  (``CAL.rs_stream_chain``): its steps' dots, each at least its bytes,
  the ring after the first step's fill (its rows of ``x`` and a block of
  ``w``) and dots, each middle step's share after its wait added to its
  transfer; on v6e the same chain with the read serial in the kernel
  (``CAL.rs_chain``).
- the reduce-scatter's ``ring(d)`` (:func:`_rs_ring_s`), the model's
  steps: the first block's ``d`` dots, then ``n - 1`` steps of the
  start, ``max(d dots, T(d))``, the done and the add of what arrived
  (``CAL.rs_add`` passes over the partial sums). A dot is its FLOPs plus
  ``CAL.rs_ring_w`` of its column block's read, never less than its own
  bytes (float32 at the prefill shape). A 32-bit integer matmul keeps the
  form below.
- the all-gather's ``ring(d)``: ``n`` steps, each ``max(C / n + rho
  bytes / HBM + fixed, T(d) / (n - 1))`` plus a tenth of the shorter
  (``CAL.ring_rho``, ``ring_step_s``, ``ring_dot_s`` for the second
  direction's dot). The two-way ring's two dots per step meet different
  rows of ``w``: its bytes count them twice. The one-way all-gather ring
  with a float32 accumulator large enough for the two-way ring's whole
  chunks is charged ``CAL.ag_ring_pass`` of a pass over it per step; the
  two-way ring of whole chunks counts its row panels (each later one's
  restart, ``CAL.whole_panel``), its antipode's slower dots where their
  rows of ``w`` are sliced inside them (``CAL.whole_tail``) or else the
  up-front slice of those rows (``CAL.whole_slice``) and its stacking of
  ``w``'s rows (``CAL.whole_stack``), the two-way ring of halves a share
  of a pass over its accumulator per step (``CAL.bidi_ag_acc``); the two-way
  reduce-scatter ring with float32 partial sums of 128 MiB or more (on
  v5p 32 MiB, ``CAL.bidi_rs_acc_from``) is charged ``CAL.bidi_rs_acc``
  of a pass over them per step (beside its adds). A 32-bit
  integer matmul runs off the MXU (``CAL.int32_flops`` of the bf16
  peak), and a ring step's other traffic hides under its dots.

The fastest estimate wins; the fused kernel is kept over a ring within 2%
(it holds less memory), and a ring or fused kernel must be 3% under XLA's
program. The reduce-scatter's one-way fused kernel (``"fused_uni"``,
whole blocks one way round the ring) replaces the two-way kernel where it
is estimated 3% faster, both with their rings charged from the kernel's
start as the model does and each with XLA's prefetch of ``x`` into VMEM
where that fits beside the kernel's scoped VMEM (``CAL.rs_x_vmem``, v6e):
of the benchmark's points only v6e's prefill shape (198.3 us against
206.3). Memory (the issue's target: peak temporary memory within jit's
plus one chunk's send and receive buffers, in the buffer assignment's
sense: ``n + 1`` chunks of ``x``) is a constraint of the all-gather's pick
where its float32 accumulator is 64 MiB or more
(``_gather_rings.WHOLE_ACC_BYTES``): where the two-way ring of whole
chunks runs in row panels (``_gather_rings.whole_panels``, which cuts its
float32 accumulator to a panel's rows to meet the target), the one-way
ring, which holds the whole accumulator ``[M, f]``, is no candidate (v5e
tp 4, M = 16384 of the Llama shard: 10814.3 us at 640.1 MiB against the
two-way ring's 11602.3 at 256.6, jit 192.2 plus 128); where a ring holds
it in one panel, over the target (:func:`_ag_memory`; not on v6e, whose
memory-space assignment keeps it in VMEM, ``Cal.ring_acc_hbm``), the fused
kernel runs if it is estimated 3% under XLA's program (v5p tp 4, M = 4096
and 16384: 1322.5 and 5290.2 us at 6.3 and 7.0 MiB against the two-way
ring's 1436.6 and 5292.8 at 188.1 and 668.1). Smaller accumulators, and
points where the fused kernel is not under XLA's program, are picked by
time alone (v5p tp 4 M = 1024: the one-way ring 332.4 us at 36.0 MiB, over
jit's 12.1 plus 8, against the fused kernel's 361.5 at 12.1 and
``xla_best``'s 331.7).

With ``memory="jit"`` (the public ops' option; the default ``"fastest"``
picks as above) the fused kernels' HBM receive slots (one per peer and
direction of a row panel's rows) are a constraint of both picks too
(:func:`_slots_over`): over jit's temporaries (96 KiB on v5e and v6e,
whose windowed einsum holds no chunks at the Llama shard's M <= 1024;
``n - 1`` chunks elsewhere) plus a chunk's two buffers, the fused kernel
is no candidate and the fastest of the rest runs (v5e and v6e tp 8, M =
16 to 256 of the Llama shard's all-gather: XLA's program). The fused
reduce-scatter's receive buffer is in VMEM wherever its plan finds room
(``RsSpec.recv_vmem``, branch h-rsslots: the Llama shard's tp 8 and
tp 4 M <= 512 on v5e and v6e), so no HBM slots are counted
(:func:`_rs_slots`) and ``"jit"`` keeps it (before, v5e tp 8 M = 1024
ran the two-way ring, 471.0 us and 4.14 MiB against the fused kernel's
354.5 and 14.06, limit 4.16; the fused kernel now 344.2 us at 0.06
MiB); where its plan keeps the buffer in HBM (tp 4 M >= 1024 there) the
rule applies as to the all-gather, to the one-way kernel's plan
apart.
Where the fused kernel is dropped for its slots alone and the matmul is
bound by its weight read (``C < M``), the value rings are no candidates
either and XLA's program runs (branch
h-memrule's rule ran the rings there, 1.026x and 1.363x of ``xla_best``
at v5e and v6e tp 8 all-gather M = 256; their estimates there are 13% to
17% under the model). Only a fused pick moves: where the default picks a
value ring or XLA's program (one chunk's buffers), ``"jit"`` keeps it.

For the all-gather, a matmul bound by reading ``w`` (``C < M / 2``, decode
sizes) keeps XLA's program (no extra kernels, no barrier) when
XLA's all-gather takes less than the weight read ``W`` and than the fused
kernel's fixed costs, ``n`` steps of ``CAL.ag_step_s`` (which its
estimate leaves out), unless the fused kernel is estimated 3% under XLA's
program (less its all-gather on rings of at most ``CAL.xla_ag_hidden_n``,
where it hides under the weight read): since branch h-acctwin the model
charges the kernel one stream of ``w`` with its ring hidden (v5e tp 8 M =
16 73.7 us against XLA's 83.3; v6e tp 8 40.5 against 46.5), while at v5e
tp 4 the two are within 1% and XLA's program stays. When
the all-gather is longer (small float32 shapes on v6e: 20 us of transfer
beside a 10 us weight read at the chapter's shape; v6e and v5p at tp 4,
M = 64 and 256 of the Llama shard, 11.5 and 37 us beside 10 us of fixed
costs) the estimates decide. The reduce-scatter has no such rule:
XLA's reduce-scatter waits for the whole matmul, the fused kernel sends
partial sums as they are made, which the benchmark model finds faster at
decode sizes too.

The all-reduce is the fused reduce-scatter plus XLA's all-gather against
XLA's all-reduce (both halves over both ring directions); the all-gather
half, a collective of its own, is costed at one ring direction, so XLA's
all-reduce is kept wherever the link time matters (every shape of the
benchmark tables).

:func:`explain_allgather` (and ``_reducescatter`` / ``_allreduce`` /
``explain_ring``) returns the :class:`Choice` with the estimates and the
reason; :func:`recording` collects the choices made while tracing, which
the benchmark tables print.
"""

import contextlib
import contextvars
import dataclasses
from typing import Literal

import jax.numpy as jnp

from asyncops import _jax_compat as jc
from asyncops.collective_matmul import _fused, _gather_rings, _wiring
from asyncops.collective_matmul._chips import CAL as CAL
from asyncops.collective_matmul._chips import CHIPS as CHIPS
from asyncops.collective_matmul._chips import Cal as Cal
from asyncops.collective_matmul._chips import Chip as Chip
from asyncops.collective_matmul._chips import chip_for as chip_for
from asyncops.kernels import _allgather_matmul as agk
from asyncops.kernels import _reducescatter_matmul as rsk

Method = Literal["auto", "fused", "ring", "xla"]
METHODS: tuple[str, ...] = ("auto", "fused", "ring", "xla")
# What ``method="auto"`` weighs besides time (the public ops' ``memory``):
# ``"fastest"`` by time alone (with the value rings' accumulators,
# :func:`_ag_memory`), ``"jit"`` also the fused kernels' receive slots
# (:func:`_slots_over`).
Memory = Literal["fastest", "jit"]

_HOP_S = 1e-6
_FUSED_OVERHEAD_S = 1.5e-6  # the start's barrier and issue, the done
# The start's issue, shared by its sends; a split send's extra piece is
# charged its share (the benchmark model's convention, h-agsplit).
_SPLIT_ISSUE_S = 1e-6
_XLA_OVERHEAD_S = 1e-6
_MARGIN = 0.97
# The fused kernel is kept over a value ring estimated up to 2% faster (it
# holds less memory; the model's v5p tp 4 M = 16384 reduce-scatter has the
# one-way ring 0.5% under the fused kernel's 32 copy-free panels, 128.1
# against 14.0 MiB, estimated 0.6%).
_KEEP_FUSED = 0.98
# A value-ring step whose dots and transfer take about as long costs a
# tenth of the shorter beyond the longer (the model's steps, v5e and v6e).
_RING_CONTENTION = 0.1
_BIDI_ACC_BYTES = 128 * 2**20
# The two-way all-gather ring of halves (``_halves_ring_s``): XLA's
# scheduler places the prefetch of ``w`` into VMEM about 1.3 times its
# HBM time in (the model: 4 of 8 steps read HBM at v5e and v6e tp 8 M =
# 16, 3 at M = 256, 2 of 4 at v5e tp 4), and a dot reading its rows from
# VMEM is charged its FLOPs and a fifth of their HBM read (v5e tp 4 M =
# 16: 8.1 us for 1.2 of FLOPs and a 35.8 us read; tp 8 1.4 for 9.0).
_HALVES_COPY = 1.3
# The fused all-gather's relay (``_fused_fwd_ag_s``) is picked only where
# it is also 3% under the one kernel with both kernels' steps this much
# longer (the model's steps, XLA's estimate of the contraction, are up to
# 1.27x the estimate's where it takes the relay for faster and the model
# does not: v5e's chapter shard, v6e's Llama shard at tp 4, M = 512, on a
# line of 4).
_RELAY_STEPS = 1.3
_HALVES_VMEM_R = 0.2


@dataclasses.dataclass(frozen=True)
class Choice:
  """What ``method="auto"`` runs, and why.

  Attributes:
    method: ``"fused"``, ``"xla"``, ``"ring"`` (one-way value ring) or
      ``"ring_bidi"`` (two-way value ring).
    reason: one line.
    fused_us: the fused kernels' estimate (None when they cannot run).
    xla_us: the XLA program's estimate (with ``ring_form``: the larger of
      the matmul's and the weight read's times).
    chip: the chip the estimate is for.
    ring_form: a form the fused kernels do not run (ring or XLA).
    ring_us: the one-way value ring's estimate (None: not a candidate).
    ring_bidi_us: the two-way value ring's (None: not a candidate, e.g.
      odd rows).
    fused_uni_us: the one-way fused reduce-scatter kernel's (None: not a
      candidate; only the reduce-scatter has one).
    fused_fwd_us: the fused all-gather's with the antipode's halves
      relayed (``"fused_fwd"``, ``AgSpec.forward``; None: not a
      candidate, its plan does not run one).
  """

  method: str
  reason: str
  fused_us: float | None
  xla_us: float
  chip: str
  ring_form: bool = False
  ring_us: float | None = None
  ring_bidi_us: float | None = None
  fused_uni_us: float | None = None
  fused_fwd_us: float | None = None

  def __str__(self) -> str:
    if self.ring_form:
      return (
        f"{self.method} ({self.reason}; est. max(matmul, weight read) "
        f"{self.xla_us:.1f} us on {self.chip})"
      )

    def us(v):
      return "n/a" if v is None else f"{v:.1f}"

    rings = ""
    if self.fused_uni_us is not None:
      rings = f", one-way fused {us(self.fused_uni_us)}"
    if self.fused_fwd_us is not None:
      rings = f", relayed {us(self.fused_fwd_us)}"
    if self.ring_us is not None or self.ring_bidi_us is not None:
      rings += (
        f", ring {us(self.ring_us)}, two-way ring {us(self.ring_bidi_us)}"
      )
    return (
      f"{self.method} ({self.reason}; est. fused {us(self.fused_us)}"
      f"{rings}, xla {self.xla_us:.1f} us on {self.chip})"
    )


def _off_mxu(dtype) -> bool:
  """A 32-bit integer matmul (XLA runs it off the MXU)."""
  dt = jnp.dtype(dtype)
  return bool(jnp.issubdtype(dt, jnp.integer) and dt.itemsize >= 4)


def _flops_rate(chip: Chip, dtype, precision: str) -> float:
  """Float32 at ``HIGHEST`` is six bf16 passes; a 32-bit integer matmul
  does not run on the MXU (``CAL.int32_flops`` of the bf16 peak, XLA's
  estimate); the rest at the bf16 peak."""
  dt = jnp.dtype(dtype)
  if dt == jnp.float32 and precision == "HIGHEST":
    return chip.bf16_flops / 6
  if _off_mxu(dt):
    return chip.bf16_flops * CAL[chip.name].int32_flops
  return chip.bf16_flops


def _decide(
  fused_reason,
  fused_s,
  xla_s,
  compute_s,
  hbm_s,
  chip,
  *,
  hbm_rule=True,
  ring_s=None,
  ring_bidi_s=None,
  xla_comm_s=0.0,
  w_s=float("inf"),
  fused_uni_s=None,
  decode_xla_s=None,
  fused_fwd_s=None,
) -> Choice:
  """The fastest candidate by estimate; a ring or fused kernel must beat
  XLA's program by 3% (it adds kernels and barriers). With ``hbm_rule``,
  a matmul bound by reading the weights (``compute_s < hbm_s / 2``) whose
  XLA collective takes less than ``w_s`` (the weight read, or for the
  all-gather the fused kernel's fixed costs over the ring when shorter)
  keeps XLA's program. ``fused_uni_s`` (the one-way fused reduce-scatter,
  when it can run) is picked over the two-way kernel only 3% under it, and
  stands for the fused kernel against the rings and XLA. So does
  ``fused_fwd_s`` (the all-gather's relay, ``"fused_fwd"``) where it is
  3% under the plain kernel."""

  def us(v):
    return None if v is None else v * 1e6

  est = dict(
    fused_us=us(fused_s) if fused_reason is None else None,
    xla_us=xla_s * 1e6,
    chip=chip.name,
    ring_us=us(ring_s),
    ring_bidi_us=us(ring_bidi_s),
    fused_uni_us=us(fused_uni_s) if fused_reason is None else None,
    fused_fwd_us=us(fused_fwd_s) if fused_reason is None else None,
  )
  kernel = "fused"
  if fused_reason is None:
    # The one-way fused kernel (the relay) replaces the two-way one where
    # it is 3% faster (the two-way kernel is the measured default
    # elsewhere).
    if fused_uni_s is not None and fused_uni_s < _MARGIN * fused_s:
      kernel, fused_s = "fused_uni", fused_uni_s
    elif fused_fwd_s is not None and fused_fwd_s < _MARGIN * fused_s:
      kernel, fused_s = "fused_fwd", fused_fwd_s
  rings = {"ring": ring_s, "ring_bidi": ring_bidi_s}
  rings = {k: v for k, v in rings.items() if v is not None}
  if fused_reason is not None and not rings:
    return Choice("xla", f"fused kernels unavailable: {fused_reason}", **est)
  if hbm_rule and compute_s < hbm_s / 2 and xla_comm_s < w_s:
    # The all-gather's decode rule weighs the fused kernel against XLA's
    # program (``decode_xla_s``: its estimate, less the all-gather where
    # that hides under the weight read) and keeps XLA's unless the fused
    # kernel is 3% under it.
    if (
      decode_xla_s is not None
      and fused_reason is None
      and fused_s < _MARGIN * decode_xla_s
    ):
      return Choice(
        kernel,
        "bound by reading the weights from HBM, but the fused kernel, which "
        "streams them once with its ring hidden, is estimated under XLA's "
        "program",
        **est,
      )
    return Choice(
      "xla",
      "bound by reading the weights from HBM (decode-size rows): no "
      "transfer left to hide",
      **est,
    )
  ours = dict(rings)
  if fused_reason is None:
    ours[kernel] = fused_s
  best = min(ours, key=ours.get)
  if best != kernel and kernel in ours and ours[best] > _KEEP_FUSED * fused_s:
    best = kernel  # within the margin: the kernel holds less memory
  if ours[best] > _MARGIN * xla_s:
    why = "no ring is estimated faster than XLA's collective here"
    if fused_reason is not None:
      why = f"{why} (fused kernels unavailable: {fused_reason})"
    return Choice("xla", why, **est)
  if best in _FUSED:
    why = "the ring transfers hide under the matmul"
    if compute_s < hbm_s / 2 and hbm_rule:
      why = (
        "bound by reading the weights from HBM, but XLA's blocking "
        "all-gather takes longer than the fused kernel's fixed costs: the "
        "fused kernel hides it"
      )
    elif compute_s < hbm_s / 2:
      why = (
        "bound by reading the weights from HBM, but the partial sums leave "
        "as they are made (XLA's reduce-scatter waits for the whole matmul)"
      )
    if best == "fused_uni":
      why = (
        "the one-way fused kernel: its ring hides under the matmul, and "
        "XLA prefetches x into VMEM before the two-way kernel only"
      )
    if best == "fused_fwd":
      why = (
        f"{why}; the neighbours relay the antipode's halves (three on "
        "the busiest link, not four)"
      )
    return Choice(best, why, **est)
  why = {
    "ring": "the one-way value ring is estimated fastest",
    "ring_bidi": "the two-way value ring is estimated fastest: half the "
    "bytes per link per step",
  }[best]
  if fused_reason is not None:
    why = f"{why}; fused kernels unavailable: {fused_reason}"
  return Choice(best, why, **est)


def _fused_s(
  panels,
  compute,
  w_s,
  rest_s,
  n,
  chunk,
  link,
  wiring,
  overlap=0.0,
  *,
  directions=2,
  x_copy_s=0.0,
  finish_s=0.0,
  floor_s=0.0,
  stream=False,
  chain=False,
  step_floor_s=0.0,
  fill_s=0.0,
  tail=0.0,
):
  """The fused reduce-scatter's estimate over ``panels`` row panels, one
  after the other: each reads ``w`` before its matmul (the kernel's charge:
  XLA's estimate of the same dots, which serialises the weight read, but
  for ``overlap`` of the shorter of the read and the panel's dots,
  ``Cal.rs_overlap``), and runs its own ring of ``1 / panels`` of the rows
  (``rest_s``: the other HBM traffic, ``chunk``: one step's bytes, ``n``
  steps). The partial sums travel on, one ring hop per step both ways
  (``wiring.bidi_load`` chunks per link), once the dots have made them.

  With ``directions=1`` every block travels whole one way
  (``wiring.shift_load``), a step's whole partial sum on one link: the
  kernel's chain (each step sends its partial sums when it ends, the next
  waits for them before its last block) is then ring-bound where the
  two-way kernel's halves are not (the model since h-rswait, ring layout,
  chapter's shape: one-way 51.2 us on v5e, 27.3 on v6e, against the
  two-way kernel's 43.7 and 20.3). ``x_copy_s`` is XLA's prefetch of a
  panel's ``x`` into VMEM before the kernel (``Cal.rs_x_vmem``), exposed.
  ``finish_s`` is the finish kernel over all the panels (each panel's
  receive buffer read, the result written), after each panel's steps
  (the model, v5e tp 4 M = 1024: 20.5 us after a 784.6 us steps kernel).
  ``floor_s`` is each panel's steps kernel's floor: its operands' bytes
  at HBM bandwidth (the model charges a Pallas kernel no less than its
  roofline; a panel's kernel is handed all of ``x``).
  ``stream`` (with ``overlap`` 1, ``Cal.rs_stream``): the read streams
  under the dots (the longer of the two, the model's twin since
  h-twinfree), while the ring still starts after the whole read. With
  ``chain`` too (``Cal.rs_stream_chain``) the panel is charged the model's
  chain: each of its ``n`` steps' dots is no shorter than
  ``step_floor_s`` (its bytes: the panel's rows of ``x``, its block of
  ``w``, its partial sums; the twin's step dot reads all three), and the
  ring starts after the first step's dots (a ``1 / n`` share of the
  kernel), each later step waiting for the longer of its dots and the
  transfer before it, not after the whole read (the model, v5e, the
  chapter's K and N at m = 256 on the 2x2 squares in device order: step
  dots of 4.2 us, transfers of 7.7, 1 + 4.2 + 3 x 7.7 + 1.3 + 0.5 = 30.1
  us; charged the whole read first, 36.1). ``chain`` without ``stream``
  (``Cal.rs_chain``, v6e) keeps the serial read in the kernel but starts
  the ring after the first step's share of it, as the model does: at v6e
  tp 8 the kernel's partial sums leave after one step's dot (10.5 us),
  not after the whole weight read (35.8), and the panel is ring-bound
  (7 transfers of 12.4 us against dots of 10.5). ``fill_s`` (with
  ``chain``): the steps kernel's fill before its first dot, the panel's
  rows of ``x`` and one block of ``w`` read whole (the model's
  ``_timeline.Fill`` since h-xfill: 6.7 us a panel at v6e tp 8, 2.6 at
  v5e's chapter shape), which the ring waits for too. ``tail`` (with
  ``chain``): the share of a step's dot after its wait for the
  neighbour's partial sums (each half waits before its last of ``nb``
  ``w`` blocks: ``1 / (directions nb)`` where ``nb > 1``, else 0, the
  model's ``Steps.tails``), which the ring-bound chain's ``n - 2`` middle
  steps add to their transfers (the one-way kernel at v6e tp 8, two
  blocks a step: 29.0 us a step, a 23.8 us transfer and half a 10.5 us
  dot)."""
  p = panels
  w = wiring
  c = max(compute / p, rest_s / p)
  read = w_s - overlap * min(w_s, c)
  load, hops = (w.shift_load, w.shift_hops)
  if directions == 2:
    load, hops = (w.bidi_load, w.bidi_hops)
  ring = (n - 1) * (chunk / p * load / link + hops * _HOP_S)
  fin = finish_s / p
  kernel = max(read + c, floor_s)
  # The finish adds the last partial sums once they arrive: after the
  # dots, or after the ring when it is the longer (the last step's own
  # product is made while the last sums travel).
  # The ring's partial sums wait for their step's weight block whether or
  # not the read streams under the dots (``stream``): for the whole read,
  # or with ``chain`` for the first step's dots only.
  first = w_s if stream else read
  if chain:
    kernel = max(kernel, n * step_floor_s)
    first = fill_s + kernel / n
    ring += max(n - 2, 0) * tail * kernel / n
  ring_after = first + ring
  return p * (_FUSED_OVERHEAD_S + x_copy_s + max(kernel, ring_after) + fin)


def _fused_ag_s(
  panels,
  plan,
  compute,
  w_s,
  acc_s,
  n,
  chunk,
  link,
  wiring,
  step_s=0.0,
  cast_s=0.0,
  mid_acc_s=None,
  directions=2,
  cover=0.0,
  split=None,
  panel_s=0.0,
):
  """The fused all-gather's estimate over ``panels`` row panels, one after
  the other. Each step of the kernel's ``plan`` (``g`` chunks) is charged
  its chunks' share of one contraction (the benchmark's twin since branch
  h-acctwin: ``compute``, or the read of ``w``, ``w_s``, whichever is
  longer; the callers scale both, ``Cal.fused_dot``, ``_fused_w``) and
  ``acc_s`` of a pass over the float32 accumulator (0 since branch
  h-agrefit: it stays in VMEM). The start sends
  every chunk to every peer (``wiring.direct_load`` chunks on the busiest
  directed link: ``sum(min(d, n - d)) / 2`` on a ring, 8 at ``n = 8``
  where forwarding takes 3.5; 4 on a line of 4) before the dots begin;
  each step runs as ``directions`` half-steps (``AgSpec``: one per ring
  direction, each waiting for its own halves only), so after the last
  half of the farthest chunk arrives only the last half-step is left,
  ``1 / directions`` of the last step, after ``cover`` of the half-step
  before it (the share it runs after its wait for the next halves:
  :func:`_fused_cover`; branch h-agest; before it the whole last step
  was charged after the arrival). (The
  benchmark model: within 1% at the chapter's and prefill shapes on v5e
  and at M = 256 and 1024 of the Llama-3-70B sweep, tp 8.) Each step
  also costs ``step_s`` (``Cal.fused_step_s``), and the last one
  ``cast_s`` of the accumulator's final read and cast, over the panels
  (``Cal.fused_cast``). ``mid_acc_s`` (None: ``acc_s``) is the
  accumulator's charge in the steps between the first and the last
  (``Cal.fused_acc_vmem``: XLA keeps it in VMEM there). ``directions``:
  the kernel's (``AgSpec.directions``). ``split`` (None: not split): with
  ``AgSpec.split`` the last half to arrive comes as two row pieces, one
  after the other on the same links, so the second lands when the whole
  half would have, after the start's extra issue (``_SPLIT_ISSUE_S``
  over its ``directions (n - 1)`` sends, the model's convention since
  h-agsplit); the last half-step waits for it only after its first row
  part, this share of it (:func:`_fused_split`), which with the cover
  before it waits for the first piece, a piece's transfer earlier.
  ``panel_s`` (``Cal.fused_panel_s``): each panel after the first
  restarts its steps, on the contraction's path (under the ring where
  the ring binds: the model at v5p tp 8 has 155.4 us a panel of 1024
  rows in 1, 4, 8 and 16 panels; branch h-v5pcal)."""
  p = panels
  extra_hops = wiring.direct_hops - _wiring.ideal(n).direct_hops
  ring = wiring.direct_load * chunk / p / link + (n - 1 + extra_hops) * _HOP_S
  steps = _fused_ag_steps(p, plan, compute, w_s, acc_s, n, step_s, mid_acc_s)
  # The last half-step (the last direction's share of the last step)
  # waits for the last half to arrive; the final cast follows it.
  half = (steps[-1] - step_s) / directions
  after = half * (1 + cover) + step_s
  if split is not None:
    ring += _SPLIT_ISSUE_S / (directions * (n - 1))
    piece = chunk / p / link / (2 * directions)  # half of one half
    after = max(half * (cover + split) - piece, 0.0) + half * (1 - split)
    after += step_s
  after += cast_s / p
  steps[-1] += cast_s / p
  c = sum(steps)
  return p * _FUSED_OVERHEAD_S + max(
    p * c + (p - 1) * panel_s, p * (ring + after)
  )


def _fused_ag_steps(p, plan, compute, w_s, acc_s, n, step_s, mid_acc_s):
  """The fused all-gather's steps (seconds, one panel of ``p``): each
  step of ``plan`` its chunks' share of the contraction or of the read
  of ``w``, whichever is longer, and its accumulator charge
  (:func:`_fused_ag_s`)."""
  mid = acc_s if mid_acc_s is None else mid_acc_s
  last = len(plan) - 1
  return [
    max(
      g * compute / (n * p),
      g * w_s / n + (acc_s if s in (0, last) else mid) / p,
    )
    + step_s
    for s, g in enumerate(plan)
  ]


def _fused_fwd_ag_s(
  plan,
  compute,
  w_s,
  acc_s,
  n,
  chunk,
  link,
  wiring,
  step_s=0.0,
  cast_s=0.0,
  mid_acc_s=None,
  cover=0.0,
  fill_s=0.0,
):
  """The fused all-gather with the antipode's halves relayed
  (``AgSpec.forward``: a ring of 4, two directions, one panel), charged
  as the benchmark model runs it (``_timeline._relay``, branch h-agfwd2).
  The start sends each half to both neighbours only (slots 0 and 1, two
  halves on each link, ``2 wiring.bidi_load`` messages); the local-step
  kernel runs step 0 (``plan[0]`` chunks), waits for slot 0 (the first
  half on each link, and its hop), issues the two relay sends
  (``_SPLIT_ISSUE_S / (n - 2)``: the start's issue per send, as a split
  send's extra piece is charged), which queue on their links behind the
  start's two halves and land a half's transfer and a hop later as the
  neighbours' slot 2 (the antipode's halves, the last step's). The
  rest kernel starts after the relay, reads its first block of ``w``
  (``fill_s``; the local kernel's fill is the one kernel's), and runs
  the other steps; it waits for the relayed halves before its last step
  (with one chunk in it, within the step before: ``cover`` of its last
  half-step; both halves land together, so the whole last step runs
  after) and, where its first step holds more than the neighbours' slot
  0, for slot 1 as it begins. The rest as :func:`_fused_ag_s` (one
  panel); ``directions`` is 2."""
  steps = _fused_ag_steps(1, plan, compute, w_s, acc_s, n, step_s, mid_acc_s)
  steps[-1] += cast_s
  per = 2 * wiring.bidi_load  # messages on the busiest link, one shift
  half = chunk / 2 / link  # one half on one link
  hop = wiring.bidi_hops * _HOP_S
  slot0 = per * half + hop
  start_busy = 2 * per * half  # the start's two halves on each link
  relay = max(steps[0], slot0) + _SPLIT_ISSUE_S / (n - 2)
  landed = max(relay, start_busy) + per * half + hop
  begin = relay + fill_s
  if len(plan) > 1 and plan[1] > 1:
    begin = max(begin, start_busy + hop)  # slot 1's halves
  post = steps[-1]
  if len(plan) > 2 and plan[-1] == 1:
    post += cover * (steps[-2] - step_s) / 2
  return _FUSED_OVERHEAD_S + max(begin + sum(steps[1:]), landed + post)


def _fused_cover(spec) -> float:
  """The share of a half-step of the fused all-gather's last step that
  runs after its wait for the next half-step's halves (``AgSpec``): its
  last ``tail`` parts of ``parts`` per iteration over ``f / bn`` blocks
  of ``g`` units, or without a tail its last block (all of it where it
  has one block). 0 without a spec."""
  if spec is None:
    return 0.0
  nf = spec.f // spec.bn
  if spec.tail is None:
    return 1.0 / nf
  return min(1.0, spec.tail / (spec.parts * nf * spec.plan[-1]))


def _fused_split(spec) -> float | None:
  """The share of the fused all-gather's last half-step that runs before
  its wait for the split half's second piece (``AgSpec.split``: one row
  part of its first iteration, ``1 / (parts nf)`` of the one unit's
  half-step), or None where the kernel does not split (or without a
  spec)."""
  if spec is None or not spec.split:
    return None
  return 1.0 / (spec.parts * spec.nf * spec.plan[-1])


def _fused_w(cal, chip, w_bytes) -> float:
  """The fused all-gather's charge for its weight read, in reads of ``w``:
  1 where XLA prefetches all of ``w`` into VMEM before the contraction
  (``w`` within ``Cal.halves_w_vmem`` of VMEM), else ``Cal.fused_w``."""
  cap = _fused.vmem_capacity(f"TPU {chip.name}")
  return 1.0 if w_bytes <= cal.halves_w_vmem * cap else cal.fused_w


def _fused_mid_acc(cal, chip, panels, w_bytes, acc):
  """The fused all-gather's accumulator charge (seconds) in the steps
  between its first and last, or None (the full ``Cal.fused_acc``
  pass; ``acc`` bytes read and written): where it runs one panel and all
  of ``w`` and its accumulator fit within ``Cal.fused_acc_vmem`` of VMEM,
  XLA's estimate of its step dots keeps the accumulator in VMEM there
  (the model, v5e chapter shape: steps of 8.4, 8.4, 5.6 and 13.8 us for
  5.5 us of FLOPs, 2.6 of rows of ``w`` and a 10.2 us pass), which this
  charges as half a pass."""
  cap = _fused.vmem_capacity(f"TPU {chip.name}")
  if panels > 1 or w_bytes + acc // 2 > cal.fused_acc_vmem * cap:
    return None
  return cal.fused_acc * acc / 2 / chip.hbm


def _x_copy_s(plan, k, t, chip, cal) -> float:
  """XLA's prefetch of a fused reduce-scatter panel's ``x`` (``rows x k``
  in ``t`` bytes) into VMEM before the kernel, which waits for it: charged
  where ``x`` fits beside the kernel's scoped VMEM limit within
  ``Cal.rs_x_vmem`` of VMEM (0: never). In row panels each panel's kernel
  is handed all of ``x``, so all of it must fit (branch h-rsv6e8: the
  model at v6e tp 4 M = 8192 on a line, 8 panels, 112 MiB of ``x``: no
  prefetch, each panel's fill reads its rows from HBM, 11.2 us, and the
  two kernels' panels cost alike, 224.2 and 227.7 us; charged a panel's
  rows, 9.0 us, the one-way kernel ran, the model 1836.1 us against the
  one-way value ring's 1766.2). The limit compared is the roomy one
  (``rsk.steps_vmem_limit``) also where the plan tightened it to hold
  the receive buffer in VMEM (branch h-rsvmem): the freed VMEM holds that
  buffer, and the model's times there did not move (v6e tp 4 M = 1024,
  two-way 200.6 us, one-way 218.2, before and after)."""
  spec = plan.spec
  x_bytes = spec.m * k * t
  x_all = x_bytes * max(plan.panels, 1)
  cap = _fused.vmem_capacity(f"TPU {chip.name}")
  limit = rsk.steps_vmem_limit(spec, cap, room=True)
  if limit + x_all > cal.rs_x_vmem * cap:
    return 0.0
  return x_bytes / chip.hbm


def _rs_fill_s(plan, k, t, b, chip) -> float:
  """The fused reduce-scatter steps kernel's fill (``plan``'s panel, ``x``
  in ``t`` bytes an element, ``w`` in ``b``): what it reads before its
  first dot, the panel's rows of ``x`` whole and the first ``[k, bn]``
  block of ``w``, at HBM bandwidth (the model's ``_timeline.Fill`` since
  h-xfill, the kernel's ``BlockSpec``s: v6e tp 8, the Llama shard, 4.5
  and 2.2 us, 6.7 a panel). 0 without a plan."""
  spec = plan.spec
  if spec is None:
    return 0.0
  return (spec.m * k * t + k * spec.bn * b) / chip.hbm


def _rs_tail(plan) -> float:
  """The share of a fused reduce-scatter step's dot after its wait for
  the neighbour's partial sums: each half waits before its last of
  ``nb`` blocks of ``w`` (``c / directions / bn``), ``1 / (directions
  nb)`` where ``nb > 1``; none where a half is one block (it waits after
  its dot). 0 without a plan."""
  spec = plan.spec
  if spec is None:
    return 0.0
  nb = spec.c // spec.directions // spec.bn
  return 1 / (spec.directions * nb) if nb > 1 else 0.0


def _on(choice: Choice, wiring: _wiring.Wiring) -> Choice:
  """``choice`` with the wiring in its reason when it is not a ring's."""
  if wiring.is_ideal:
    return choice
  return dataclasses.replace(
    choice, reason=f"{choice.reason}; on {wiring.describe()}"
  )


def _links(wiring: _wiring.Wiring | None, n: int) -> _wiring.Wiring:
  """The wiring to charge: the mesh's, or an ideal ring of ``n``."""
  if wiring is None or wiring.n != n:
    return _wiring.ideal(n)
  return wiring


def _ring_s(
  n,
  d,
  compute,
  hidden,
  extra,
  chip,
  chunk,
  cal,
  wiring,
  *,
  w_share=0.0,
  dot_bytes=0.0,
  off_mxu=False,
) -> float:
  """The value ring over ``d`` directions: ``n`` steps, each its dots
  (``compute / n``, or the HBM time of the ``hidden`` bytes a step reads
  under them when longer), plus ``cal.ring_rho`` of the ``extra`` bytes
  that stream beside them and a fixed cost (one more dot launch per extra
  direction), or the step's transfer (``chunk / d`` bytes per link on a
  ring; ``wiring`` says how many chunks the busiest link carries, and how
  many links the longest hop crosses) when that is longer (plus
  :data:`_RING_CONTENTION` of the shorter). ``w_share`` of the ``hidden``
  bytes' HBM time is charged beside the dots (the part of a lone dot's
  weight read its MXU work does not cover); no step's ``d`` dots are shorter
  than ``d`` times ``dot_bytes`` (one dot's own operands and result) at
  HBM bandwidth. With ``off_mxu`` (a 32-bit integer matmul, about ten
  times longer than at the MXU) the ``extra`` bytes and the ``w_share``
  read stream under the dots rather than beside them (the model, v5e,
  the chapter's int32 reduce-scatter: the one-way ring 245.8 us, 16 over
  the unsharded matmul)."""
  lone = w_share * hidden / chip.hbm
  dots = max(
    compute / n + (0.0 if off_mxu else lone),
    lone,
    cal.ring_rho * hidden / chip.hbm,
    d * dot_bytes / chip.hbm,
  )
  if off_mxu:
    dots = max(dots, cal.ring_rho * extra / chip.hbm)
  else:
    dots += cal.ring_rho * extra / chip.hbm
  load, hops = (
    (wiring.shift_load, wiring.shift_hops)
    if d == 1
    else (wiring.bidi_load, wiring.bidi_hops)
  )
  transfer = chunk * load / chip.link + hops * _HOP_S
  fixed = cal.ring_step_s + (d - 1) * cal.ring_dot_s
  step = max(dots + fixed, transfer) + _RING_CONTENTION * min(dots, transfer)
  return _XLA_OVERHEAD_S + n * step


def _rs_ring_s(n, d, compute, m, k, c, b, chip, cal, wiring, *, sums_s=0.0):
  """The value reduce-scatter ring over ``d`` directions (``x [m, k] @ w
  [k, n c]``, ``b`` bytes an element), in the benchmark model's form (its
  timelines, branch h-rsest): step 0 runs the ``d`` dots of the first
  block, with no transfer; each of the other ``n - 1`` starts the previous
  partial sums on their way (``m c / d`` elements a direction, the busiest
  link's load from ``wiring``), runs its ``d`` dots under the transfer,
  waits for it (``cal.rs_step_s``: the start and the done) and adds what
  arrived to its dots' results (one fusion after the done:
  ``cal.rs_add`` passes over the ``[m, c]`` partial sums, plus
  ``sums_s``).

  A dot ``[m / d, k] @ [k, c]`` is charged its FLOPs plus
  ``cal.rs_ring_w`` of its column block's read (XLA's estimate of the
  chunk dot: the model at v5e tp 8, M = 4096, half-dots of 80.4 us
  against 76.3 of FLOPs and a 9.0 us read), and never less than its own
  bytes (its column block, rows of ``x`` and result) at HBM bandwidth
  (float32 at the prefill shape). The one-way ring's dot, bound by those
  bytes, is charged them with ``cal.rs_ring_w`` more and half its FLOPs
  beside (the model at v5e tp 8, M = 16 and 256: 16.4 and 21.4 us against
  9.1 and 11.8 us of bytes; the two-way ring's half-dots at M = 16, 8
  rows, cost about their bytes)."""
  cr = k * c * b / chip.hbm
  one_dot = (k * c + (m // d) * (k + c)) * b / chip.hbm
  flops = compute / (n * d) * (1 + cal.rs_ring_f)
  w = cal.rs_ring_w
  floor = (1 + w) * one_dot + flops / 2
  if d == 2:
    # A half-row dot bound by its bytes: XLA's charge for it, which reads
    # its column block through a slice inside the dot's fusion
    # (``cal.rs_halves_w`` of that read; the model at v5p tp 4 M = 16:
    # 24.9 and 20.0 us for a 10.6 us read, tp 8 M = 256: 8.8 for 2.65).
    floor = max(one_dot, cal.rs_halves_w * cr)
  # A dot whose x stays in HBM: XLA keeps the ring's x [m, k] in VMEM
  # where it fits there beside one column block of w, else each dot reads
  # its rows of x from HBM in windows split along k, charged
  # ``cal.rs_ring_x`` of that read beside its FLOPs (v6e, the model at tp
  # 4: the two-way ring's half-dots at M = 8192, 216.2 and 199.7 us for
  # 131.0 of FLOPs and a 35.8 us read; its half-dots at M = 16384 and the
  # one-way ring's dots at M = 8192, 415.1 and 387.5 for 262.0 and 71.6;
  # branch h-v6ebidi).
  cap = _fused.vmem_capacity(f"TPU {chip.name}")
  if (m * k + k * c) * b > cap:
    flops += cal.rs_ring_x * (m // d) * k * b / chip.hbm
  dots = d * max(flops + w * cr, floor)
  add = cal.rs_add * m * c * b / chip.hbm + sums_s
  load, hops = (
    (wiring.shift_load, wiring.shift_hops)
    if d == 1
    else (wiring.bidi_load, wiring.bidi_hops)
  )
  transfer = m * c * b * load / chip.link + hops * _HOP_S
  step = cal.rs_step_s + max(dots, transfer) + add
  return _XLA_OVERHEAD_S + dots + add + (n - 1) * step


def _halves_ring_s(n, compute, m, k, f, b, acc, chip, cal, wiring) -> float:
  """The two-way all-gather ring of halves (``x [m, k]`` chunks, ``w [n k,
  f]``, ``b`` bytes an element, ``acc`` bytes of float32 accumulator read
  and written a pass) in the benchmark model's form (its timelines, branch
  h-est3): ``n`` steps, each the start and done (``cal.rs_step_s``) and
  two half-row dots ``[m / 2, k] @ [k, f]`` (or the step's transfer when
  longer), then the accumulator's cast (read in float32, written in the
  input dtype; the model at v6e tp 8 M = 1024: 26.9 us).

  A half-row dot reads its rows of ``w`` through a slice inside its fusion
  (``R``, ``k f`` elements at HBM bandwidth) and is charged the longer of
  its FLOPs and ``cal.halves_w`` times ``R`` (XLA's estimate of that
  fusion: the model's decode dots, v5e tp 4 M = 16: 59.2 us for a 35.8 us
  read, 1.2 of FLOPs; at M = 1024 82.9 for 76.3 of FLOPs), plus
  ``cal.bidi_ag_acc`` of its rows' accumulator pass. Where the dots are
  bound by that read and ``w`` fits within ``cal.halves_w_vmem`` of VMEM,
  XLA prefetches all of ``w`` into VMEM (a ``copy-start`` at the
  program's start): the dots after its ``copy-done`` read VMEM, charged
  their FLOPs and ``_HALVES_VMEM_R`` of ``R`` (v5e tp 4 M = 16: 8.1 us),
  and the copy-done lands after the step where ``_HALVES_COPY`` times the
  copy's HBM time has passed (v5e tp 8 M = 16: 4 of 8 steps read HBM, a
  71.7 us copy under steps of 26.7 us)."""
  r = k * f * b / chip.hbm
  flops = compute / (2 * n)
  acc_half = cal.bidi_ag_acc * acc / 2 / chip.hbm
  load, hops = wiring.bidi_load, wiring.bidi_hops
  transfer = m * k * b * load / chip.link + hops * _HOP_S
  dot = max(flops, cal.halves_w * r) + acc_half
  step = cal.rs_step_s + max(2 * dot, transfer)
  steps = n
  w_bytes = n * k * f * b
  cap = _fused.vmem_capacity(f"TPU {chip.name}")
  if cal.halves_w * r > flops and w_bytes <= cal.halves_w_vmem * cap:
    copy = _HALVES_COPY * w_bytes / chip.hbm
    steps = min(n, -(-copy // step))
  vmem = max(flops, _HALVES_VMEM_R * r) + acc_half
  step_v = cal.rs_step_s + max(2 * vmem, transfer)
  # (A float32 result is the accumulator itself: no cast.)
  cast = 0.0 if b == 4 else m * f * (4 + b) / chip.hbm
  return _XLA_OVERHEAD_S + steps * step + (n - steps) * step_v + cast


def _whole_ring_s(
  n,
  compute,
  acc,
  chunk,
  out_bytes,
  w_rows,
  chip,
  panels=1,
  unhidden=0.0,
  *,
  tail=0.0,
  stack=0.0,
  panel=0.0,
  sliced=False,
  slice_passes=0.0,
) -> float:
  """The two-way ring of whole chunks (``_gather_rings.whole_chunks``) in
  two row pieces: every transfer is half a chunk each way, the first two
  straight from ``x`` (no copy); step 0 the local dot; then one window per
  piece of each two-chunk step: a dot over half the rows of two chunks
  (one chunk's FLOPs) overlapped with its rows' accumulator pass in one
  fusion, plus the stacked rows of ``w`` (``w_rows`` bytes per chunk,
  read from ``w`` and written once, read by each step's dots); then the
  antipode's pieces, a pass and the output. The model at tp 8, M = 16384
  in one panel: a two-chunk piece 681 us on v5e (610 of FLOPs, a 287 us
  half pass) and 48 us of stacking per step, 212 and 24 on v6e (131,
  143); the antipode's pieces 1021 and 471; in all 6004.0 and 2153.6 us
  (this estimate: 5905 and 1682, so v6e's is kind: the two-way ring is
  far ahead there).

  In ``panels`` row panels (``_gather_rings.whole_panels``) the ring runs
  once per panel on its rows, one panel after the other: each panel's
  local dot and first transfer, its steps, its antipode and its rows of
  the output; the stacked rows of ``w`` are made once, before the first
  panel, and each panel's dots read them again. The model (bf16, M =
  16384): v5e tp 4 11552.6 us in 1 panel, 11602.3 in 4 (this estimate
  11130.5 and 11348.6); tp 8 6004.0 and 5912.3 in 2 (5906.3 and
  5961.1); v6e tp 4 3983.6 and 3688.2 in 4 (2777.3, 2887.7); v5p tp 8
  2507.3 and 2618.1 in 2 (2399.6, 2416.6). Panels cost the re-read of
  the stacked rows and each panel's exposed first step (here 1% to 4%);
  the model's differences (-7% to +4% at these points, up to +17% in 4
  panels at v5e tp 8 and v5p tp 4) are mostly XLA's tiling of the
  smaller dots, which this estimate does not follow.

  ``unhidden`` (``Cal.whole_unhidden``) of the shorter of a piece's dot
  and pass is charged beside the longer: v6e 0.5 (its dot is short
  against the pass; the estimates there become 3174.2 us at tp 4 in 4
  panels and 2077.9 at tp 8 in 1, models 3688.2 and 2153.6); 0 on every
  chip since branch h-agest, whose terms below fit the model's phases.

  Three terms the model's phases show (branch h-agest: the model's
  timelines at the sweep's whole-chunk points, ``design/benchmarks.md``,
  "The two-way all-gather ring's estimate on v6e and v5p"): ``tail``
  (``Cal.whole_tail``) of the antipode's FLOPs charged again (its two
  half-row dots of one chunk read their rows of ``w`` through a slice
  inside the dot's fusion, with the accumulator's read and the output's
  write: XLA tiles them below the MXU rate, v6e 137.6 us a piece for 65.5
  of FLOPs, v5p 220 for 131); ``stack`` (``Cal.whole_stack``) of the
  stacked rows' making charged again (v5p: 76.6 us for 42.5 of bytes);
  and ``panel`` (``Cal.whole_panel``) of each later panel's accumulator
  write and stacked-row read (its local dot writes its float32 rows
  beside its FLOPs, and v6e copies the stacked rows into VMEM before each
  panel's pieces, exposed: per panel 221 us against a lone panel's 152.5,
  and 34 us of ``slice-done``).

  With ``sliced`` (``_gather_rings.antipode_sliced``: in row panels, or
  in one panel on v5p) the ring slices its antipode's rows of ``w`` up
  front (branch h-antipode), so its antipode's dots read a plain operand
  and run near their FLOPs: ``tail`` is not charged, and the slice is,
  once, ``slice_passes`` (``Cal.whole_slice``) passes over those rows
  (read and written; in row panels the slice's fusion also writes the
  other steps' stacked rows). The model (branch h-wtail, the sweep's
  seven sliced points): the antipode 0.80 to 1.23 times its FLOPs, pass
  and output (v5p tp 4 M = 16384 1085.8 us for 1048 of FLOPs), the slice
  2.2 to 7.7 passes (v5p tp 4 46.4 us, v5e tp 4 M = 16384 in 4 panels
  273.9)."""
  p = panels
  c = compute / n / p
  a = acc / chip.hbm / p
  half = chunk / p / 2 / chip.link + _HOP_S  # a piece: half a chunk each way
  make = 2 * 2 * w_rows / chip.hbm  # a step's rows of w read and stacked
  read = 2 * w_rows / chip.hbm  # and read back by its dots
  both = max(c, a / 2) + unhidden * min(c, a / 2)
  piece = max(both + a / 8 + read / 2, half)
  two = n // 2 - (1 - n % 2)  # steps carrying two chunks
  even = n % 2 == 0
  cut = sliced and even  # the antipode's rows sliced up front
  anti = (1 + (0.0 if cut else tail)) * c + a / 2 if even else 0.0
  end = anti + out_bytes / p / chip.hbm
  one = _XLA_OVERHEAD_S + max(c, half) + 2 * two * piece + end
  restart = (p - 1) * panel * (a / 2 + two * read)
  cut_s = slice_passes * read if cut else 0.0  # one chunk's rows, r + w
  return two * make * (1 + stack) + p * one + restart + cut_s


def _ag_memory(m, k, f, n, b, one_acc, acc, whole_panels, rings):
  """The value rings (``1``: one-way, ``2``: two-way, of ``rings``) whose
  HBM temporaries are over the issue's memory target, where the float32
  accumulator is ``_gather_rings.WHOLE_ACC_BYTES`` or more (else none).

  The target, in the benchmark's buffer-assignment sense
  (``peak_alloc_mib``): jit's temporaries plus one chunk's send and
  receive buffers. jit's are its all-gather's ``n - 1`` received chunks
  of ``x`` (the Llama-3-70B shard at tp 4: 12.1, 48.1 and 192.1 MiB at M
  = 1024, 4096 and 16384, three 4, 16 and 64 MiB chunks), so the limit
  is ``n + 1`` chunks. A ring in one panel holds its accumulator
  (``one_acc``, ``acc`` bytes) and a chunk's two buffers (the one-way
  ring at v5p tp 4 M = 1024: 28 + 8 = 36.0 MiB); the two-way ring of
  whole chunks in ``whole_panels`` row panels is cut to meet the target
  (:func:`_gather_rings.whole_panels`). The fused kernel keeps its
  accumulator in VMEM and holds at most ``n - 1`` received chunks in HBM
  (v5p tp 4: 12.1 and 6.3 MiB at M = 1024 and 4096, in 2 and 8 row
  panels; none where they are in VMEM, ``AgSpec.recv_vmem``, or rows of
  the result), within the limit."""
  if not _gather_rings.whole_chunks(m, f, jnp.float32, n):
    return set()
  chunk = m * k * b
  limit = (n + 1) * chunk
  held = {1: one_acc, 2: acc}
  if whole_panels > 1:
    held.pop(2)
  return {d for d, a in held.items() if d in rings and a + 2 * chunk > limit}


# Chips whose jit program (XLA's windowed einsum, default flags) holds no
# gathered chunks or partial sums in HBM at the Llama-3-70B sweep's
# decode and short-prefill sizes (the benchmark's buffer assignment,
# tp 4 and 8, M <= 1024: 0.09 to 0.27 MiB), counted as ``_JIT_MIN``;
# elsewhere (v5p, v4) XLA's collective holds its ``n - 1`` chunks (v5p:
# 3.0 to 11.0 chunks at every M).
_JIT_HOLDS_NONE = frozenset({"v5e", "v6e"})
# jit's smallest HBM temporaries there (v6e tp 4 all-gather: 0.09 MiB).
_JIT_MIN = 96 * 2**10


def _slots_over(chip, n, chunk, slots):
  """The fused kernel's HBM receive slots against the issue's memory
  target (``memory="jit"``); ``None`` if within, else a reason.

  The target, in the benchmark's buffer-assignment sense
  (``peak_alloc_mib``): jit's temporaries plus one chunk's send and
  receive buffers (``chunk``: one transferred block, ``m k`` of ``x``
  for the all-gather, ``m c`` partial sums for the reduce-scatter).
  jit's are counted as ``_JIT_MIN`` on ``_JIT_HOLDS_NONE`` chips, else
  ``n - 1`` chunks. ``slots``: the start's receive buffer, one slot per
  peer and direction of one row panel's rows (``[d, n - 1, m / p, k /
  d]``; 0 where the all-gather's chunks land in the result,
  ``AgSpec.recv_in_out``, or the reduce-scatter's receive buffer is in
  VMEM, :func:`_rs_slots`): v5e tp 8, M = 1024 of the reduce-scatter
  with the buffer in HBM, ``bf16[2, 7, 1024, 512]``, 14.0 MiB against
  0.16 + 4.0. The value
  rings hold one chunk's send and receive buffers (their accumulators:
  :func:`_ag_memory`), within; XLA's program is not counted (it stays
  the fallback; at v5e tp 4 reduce-scatter M = 64 and 256 it is itself
  over: 1.00 and 4.00 MiB against 0.63 and 2.14)."""
  jit = _JIT_MIN if chip.name in _JIT_HOLDS_NONE else (n - 1) * chunk
  limit = jit + 2 * chunk
  if slots <= limit:
    return None
  return (
    f"its receive slots ({slots / 2**20:.2f} MiB) are over the memory "
    f"target ({limit / 2**20:.2f} MiB: jit's plus a chunk's two buffers)"
  )


_NO_FUSED = "the fused kernel is no candidate"
_FUSED = ("fused", "fused_uni", "fused_fwd")


def _mem_reason(choice, mem, fused_s, rings=None):
  """``choice`` with the fused kernel's estimate kept (``fused_s``) and
  the memory reason said where its receive slots are over the target
  (``mem``). ``rings``: the value rings' estimates (s), shown where they
  were no candidates (bound by the weight read)."""
  if mem is None:
    return choice
  why = choice.reason
  if mem not in why:
    why = f"{why}; {_NO_FUSED}: {mem}"
  else:
    why = why.replace("fused kernels unavailable: ", f"{_NO_FUSED}: ")
  est = {}
  if rings:
    why = (
      f"{why}; bound by the weight read, the value rings are no "
      "candidates either: XLA's program"
    )
    est = dict(
      ring_us=None if 1 not in rings else rings[1] * 1e6,
      ring_bidi_us=None if 2 not in rings else rings[2] * 1e6,
    )
  return dataclasses.replace(choice, reason=why, fused_us=fused_s * 1e6, **est)


def _rs_slots(plan) -> int:
  """The fused reduce-scatter's receive buffer in HBM (bytes; one panel):
  the kernel's own shape (``rsk.recv_dims``), 0 where the plan puts it
  in VMEM (``RsSpec.recv_vmem``, since branch h-rsslots: the Llama
  shard's tp 8 and tp 4 M <= 512 on v5e and v6e)."""
  return 0 if plan.spec is None else rsk.recv_hbm_bytes(plan.spec)


def _ag_slots(plan) -> int:
  """The fused all-gather's receive slots in HBM (bytes; one panel), from
  the kernel's receive buffers (``_allgather_matmul.recv_hbm_bytes``):
  none where they are in VMEM (``AgSpec.recv_vmem``: the Llama shard's
  tp 8, M = 16 to 1024, on v5e, v6e and v5p) or rows of the result
  (``AgSpec.recv_in_out``)."""
  if plan.spec is None:
    return 0
  return agk.recv_hbm_bytes(plan.spec)


def explain_allgather(
  m: int,
  k: int,
  f: int,
  n: int,
  dtype,
  *,
  precision: str,
  device_kind,
  wiring: _wiring.Wiring | None = None,
  accumulation: str = "float32",
  memory: Memory = "fastest",
) -> Choice:
  """The choice for ``all_gather(x [m, k]) @ w [n k, f]`` on ``n`` devices.

  The fused estimate counts its row panels (each re-reads ``w`` and
  restarts the ring); XLA's all-gather, blocking, is costed over one ring
  direction (what the benchmark model finds in XLA's program: 12.0 us
  exposed at M = 16, 5113 us at M = 16384, v5e, tp 8). The value rings
  (one- and two-way) read their rows of ``w`` at every step (the two-way
  ring twice: its halves meet different rows) and their float32
  accumulator (``accumulation="output"``: the one-way ring's is of
  ``dtype``, as that ring then holds; the two-way ring keeps its float32
  estimate, the fused kernel its float32 accumulator in VMEM). With
  ``memory="jit"`` the fused kernel whose receive slots are over the
  memory target is no candidate (:func:`_slots_over`), nor, where the
  matmul is bound by its weight read, the value rings.
  """
  if memory == "jit":
    # Only a fused pick over the target moves: a faster pick (a value
    # ring, XLA's program) holds one chunk's buffers, within it.
    fast = explain_allgather(
      m,
      k,
      f,
      n,
      dtype,
      precision=precision,
      device_kind=device_kind,
      wiring=wiring,
      accumulation=accumulation,
    )
    if fast.method not in _FUSED:
      return fast
  chip = chip_for(device_kind)
  cal = CAL[chip.name]
  b = jnp.dtype(dtype).itemsize
  t = jnp.dtype(_fused.transfer_dtype(dtype, precision)).itemsize
  w_bytes = n * k * f * b
  out_bytes = m * f * b
  compute = 2 * m * n * k * f / _flops_rate(chip, dtype, precision)
  hbm = (w_bytes + n * m * k * t + out_bytes) / chip.hbm
  chunk = m * k * t
  wr = _links(wiring, n)
  # XLA's all-gather runs over its own ring order (a physical cycle where
  # the mesh's order is not one: ``Wiring.xla``); our kernels, the mesh's.
  wx = wr.xla
  xla_ring = (n - 1) * (
    chunk * wx.shift_load / chip.link + wx.shift_hops * _HOP_S
  )
  # XLA's dot after its all-gather: the longer of its FLOPs and bytes,
  # and ``Cal.xla_ag_w`` of the weight read beside (XLA's estimate).
  xla_dot = max(compute, hbm) + cal.xla_ag_w * w_bytes / chip.hbm
  xla = _XLA_OVERHEAD_S + xla_ring + xla_dot
  plan = _fused.plan_allgather(
    m,
    k,
    f,
    n,
    dtype,
    dtype,
    dtype,
    directions=2,
    precision=precision,
    device_kind=device_kind,
  )
  reason = None if plan.spec is not None else plan.reason
  panels = max(plan.panels, 1)
  w_s = w_bytes / chip.hbm
  acc = 2 * m * f * 4 if jnp.issubdtype(dtype, jnp.floating) else 2 * m * f * b
  # The one-way value ring's accumulator with ``accumulation`` (``acc``
  # by default; the fused kernel's is float32 in VMEM). The two-way
  # ring keeps its float32 estimate: charged a bfloat16 accumulator it
  # was kind (v5e tp 4, M = 4096 of the Llama-3-70B shard: 2553.8 us
  # against 2930.5 modelled, over the one-way ring's 2596.0).
  one_dt = jnp.float32
  if accumulation != "float32":
    one_dt = _gather_rings.accumulator_dtype(dtype, accumulation)
  one_acc = acc if one_dt == jnp.float32 else 2 * m * f * one_dt.itemsize
  # The kernel's charge (the benchmark's twin since branch h-acctwin):
  # XLA's estimate of one contraction over its chunks, the accumulator
  # in VMEM, split over the plan's steps by chunks.
  plan_steps = _fused.choose_steps(
    n,
    -(-m // panels),
    k,
    f,
    dtype,
    device_kind,
    _fused.transfer_dtype(dtype, precision),
  )
  if plan.spec is not None:
    # The plan's own (one chunk per step where it runs one panel by
    # ``Cal.fused_one_panel_vmem``; else the same).
    plan_steps = plan.spec.plan
  fused = _fused_ag_s(
    panels,
    plan_steps,
    cal.fused_dot * compute,
    _fused_w(cal, chip, w_bytes) * w_s,
    cal.fused_acc * acc / chip.hbm,
    n,
    chunk,
    chip.link / cal.fused_ring,
    wr,
    # Past decode sizes (where the weight read does not bound the matmul)
    # each step's fixed cost (``Cal.fused_step_s``); the final cast (both
    # 0 since branch h-agrefit: the contraction has neither).
    cal.fused_step_s if compute >= hbm / 2 else 0.0,
    cal.fused_cast * m * f * 4 / chip.hbm,
    # A small program's accumulator stays in VMEM between the first and
    # the last step (``Cal.fused_acc_vmem``): half a pass there.
    _fused_mid_acc(cal, chip, panels, w_bytes, acc),
    plan.spec.directions if plan.spec is not None else 2,
    _fused_cover(plan.spec),
    _fused_split(plan.spec),
    cal.fused_panel_s,
  )
  if panels > 1:
    knee = max(1.0, panels / cal.fused_panel_knee)
    fused += (panels - 1) * cal.fused_panel * w_s * knee
    fused += cal.fused_panels_s
  # The relay (``AgSpec.forward``) where its plan runs one
  # (:func:`_fused_fwd_ag_s`), estimated from the same charges.
  fwd_plan = None
  fwd = None
  if plan.spec is not None and panels == 1 and cal.fused_relay:
    fwd_plan = _fused.plan_allgather(
      m,
      k,
      f,
      n,
      dtype,
      dtype,
      dtype,
      directions=2,
      precision=precision,
      device_kind=device_kind,
      forward=True,
    )
    if fwd_plan.spec is None or not fwd_plan.spec.forward:
      fwd_plan = None
  fwd_shown = None
  if fwd_plan is not None:
    fs = fwd_plan.spec

    def relay_s(longer):
      return _fused_fwd_ag_s(
        fs.plan,
        longer * cal.fused_dot * compute,
        longer * _fused_w(cal, chip, w_bytes) * w_s,
        cal.fused_acc * acc / chip.hbm,
        n,
        chunk,
        chip.link / cal.fused_ring,
        wr,
        cal.fused_step_s if compute >= hbm / 2 else 0.0,
        cal.fused_cast * m * f * 4 / chip.hbm,
        _fused_mid_acc(cal, chip, panels, w_bytes, acc),
        _fused_cover(fs),
        fs.kh * fs.bn * b / chip.hbm,
      )

    def plain_s(longer):
      return _fused_ag_s(
        1,
        plan_steps,
        longer * cal.fused_dot * compute,
        longer * _fused_w(cal, chip, w_bytes) * w_s,
        cal.fused_acc * acc / chip.hbm,
        n,
        chunk,
        chip.link / cal.fused_ring,
        wr,
        cal.fused_step_s if compute >= hbm / 2 else 0.0,
        cal.fused_cast * m * f * 4 / chip.hbm,
        _fused_mid_acc(cal, chip, panels, w_bytes, acc),
        2,
        _fused_cover(plan.spec),
        _fused_split(plan.spec),
        cal.fused_panel_s,
      )

    fwd = fwd_shown = relay_s(1.0)
    # The relay gains only the one kernel's exposed wait for its sends,
    # which the estimate's steps overstate where they are short (the
    # model's are XLA's estimate of the contraction: v5e chapter 27.8 us
    # for the estimate's 21.8; v6e's Llama shard at tp 4 on a line of 4,
    # M = 512, about 107 for 86, where the relay is 1% slower): it must
    # also win with the steps ``_RELAY_STEPS`` times longer.
    if relay_s(_RELAY_STEPS) >= _MARGIN * plain_s(_RELAY_STEPS):
      fwd = None
  rings = {}
  # The two-way ring of whole chunks runs in row panels to hold its
  # float32 accumulator (``_gather_rings.whole_panels``).
  whole_panels = 1
  for d in (1, 2):
    if d == 2 and m % 2:
      continue
    ring_acc, acc_dt = (one_acc, one_dt) if d == 1 else (acc, jnp.float32)
    whole = _gather_rings.whole_chunks(m, f, acc_dt, n)
    if d == 2 and whole:
      whole_panels = _gather_rings.whole_panels(m, f, jnp.float32, n, chip.name)
    # The value ring moves x as it is (``chunk`` is the fused kernel's).
    hidden = d * k * f * b + m * k * b + cal.ring_acc * ring_acc
    # The two-way ring's two half accumulators ([2, m/2, f]) are charged
    # their traffic beside the dots once they are large (the model, tp 8:
    # within 4% of this estimate without it at M <= 4096, 1.35x and 2.0x
    # over it at M = 16384 on v5e and v6e; 56 and 224 MiB accumulators).
    extra = ring_acc if d == 2 and ring_acc // 2 > _BIDI_ACC_BYTES else 0
    rings[d] = _ring_s(
      n,
      d,
      compute,
      hidden,
      extra,
      chip,
      m * k * b,
      cal,
      wr,
      off_mxu=_off_mxu(dtype),
    )
    if d == 1 and whole:
      # A float32 accumulator this large: a share of its pass per step
      # (``CAL.ag_ring_pass``) does not hide under the step's dot.
      rings[d] += n * cal.ag_ring_pass * ring_acc / chip.hbm
    if d == 2 and not whole and not _off_mxu(dtype) and cal.halves_w:
      # The ring of halves in the model's form (``_halves_ring_s``; a share
      # of a pass over its float32 accumulator beside each step's two dots,
      # ``CAL.bidi_ag_acc``, v5p).
      rings[d] = _halves_ring_s(n, compute, m, k, f, b, ring_acc, chip, cal, wr)
    elif d == 2 and not whole and not _off_mxu(dtype):
      # The older form: a share of a pass over its float32 accumulator per
      # step beside the step's two dots (``CAL.bidi_ag_acc``; off the MXU
      # the pass streams under the longer dots, as ``_ring_s``'s extra
      # bytes do).
      rings[d] += n * cal.bidi_ag_acc * ring_acc / chip.hbm
    if d == 2 and whole:
      rings[d] = _whole_ring_s(
        n,
        compute,
        ring_acc,
        m * k * b,
        out_bytes,
        k * f * b,
        chip,
        whole_panels,
        cal.whole_unhidden,
        tail=cal.whole_tail,
        stack=cal.whole_stack,
        panel=cal.whole_panel,
        sliced=_gather_rings.antipode_sliced(whole_panels, chip.name),
        slice_passes=cal.whole_slice,
      )
  # ``memory="jit"``: the fused kernel's receive slots against the memory
  # target (:func:`_slots_over`): over it, the kernel is no candidate and
  # the fastest of the rest runs (v5e and v6e tp 8, M = 16 to 256 of the
  # Llama shard: XLA's program).
  mem = None
  if reason is None and memory == "jit":
    # The relay's plan where it would run (its receive buffer in VMEM:
    # no HBM slots; its second float32 accumulator, a VMEM output of the
    # local-step kernel, is within ``_fused._forwarded``'s VMEM share).
    relayed = fwd is not None and fwd < _MARGIN * fused
    mem = _slots_over(
      chip, n, m * k * b, _ag_slots(fwd_plan if relayed else plan)
    )
    reason = mem
  # Dropped for its slots alone, bound by the weight read: XLA's program,
  # not a value ring (their estimates there are 13% to 17% under the
  # model: v5e and v6e tp 8 M = 256, the one-way ring 171.0 us against
  # xla_best's 166.7, the two-way ring 93.5 against 68.6).
  mem_rings = mem is not None and compute < hbm
  # The memory target (peak temporary memory within jit's plus one chunk's
  # buffers): where the two-way ring of whole chunks runs in row panels to
  # hold its float32 accumulator to one panel's rows, the one-way ring,
  # which holds all of it ([M, f]: 448 MiB at tp 4, M = 16384 of the
  # Llama shard), is no candidate.
  # With ``accumulation="output"`` the one-way ring's accumulator is
  # narrower and the rule does not apply (v5e tp 4, M = 16384: 10241.0 us
  # at 128.1 MiB, within the target).
  held = (
    whole_panels > 1 and one_dt == jnp.float32 and 2 in rings and 1 in rings
  )
  # Where the value rings hold a float32 accumulator of
  # ``_gather_rings.WHOLE_ACC_BYTES`` or more in one panel, over the
  # target (:func:`_ag_memory`), the fused kernel, which keeps its
  # accumulator in VMEM, runs if it is estimated 3% under XLA's program,
  # whatever the rings' estimates: v5p tp 4, M = 4096 of the Llama shard,
  # the fused kernel 1322.5 us and 6.3 MiB against the two-way ring's
  # 1436.6 and 188.1 (jit 48.1 plus a chunk's 32; the two-way ring's
  # estimate there, 1197.7, is 17% under the model); M = 16384, 5290.2
  # and 7.0 against 5292.8 and 668.1 (limit 320.1). Smaller
  # accumulators are weighed by time alone (v5p tp 4, M = 1024: the
  # one-way ring 332.4 us at 36.0 MiB against 20.1, the fused kernel
  # 361.5 at 12.1 in two row panels, xla_best 331.7; since branch
  # h-mem1024 the fused kernel runs one panel there, 305.3 at 0.0, and
  # is picked by time).
  over = set()
  if cal.ring_acc_hbm:  # (v6e keeps them in VMEM: ``Cal.ring_acc_hbm``)
    over = _ag_memory(
      m, k, f, n, b, one_acc // 2, acc // 2, whole_panels, rings
    )
  spill = bool(over) and reason is None and fused < _MARGIN * xla
  drop = over if spill else set()
  # At decode sizes the value rings are no candidates beside the fused
  # kernel: each step's dot pays its fixed cost beside its rows of ``w``,
  # and their estimates there are 12% to 25% under the model (v6e tp 4 M
  # = 16 on a line of 4: the one-way ring 84.1 us estimated, 95.9
  # modelled, the fused kernel 87.4 and 87.5; v5e: 129.6 and 174.1
  # against 144.9 and 145.5).
  decode_rings = compute < hbm / 2 and reason is None
  if decode_rings or mem_rings:
    drop = {1, 2}
  choice = _decide(
    reason,
    fused,
    xla,
    compute,
    hbm,
    chip,
    ring_s=None if held or 1 in drop else rings.get(1),
    ring_bidi_s=None if 2 in drop else rings.get(2),
    xla_comm_s=xla_ring,
    # The decode rule yields once XLA's all-gather outlasts the fused
    # kernel's fixed cost per step (``CAL.ag_step_s``) over the ring.
    w_s=min(w_s, n * cal.ag_step_s),
    # At decode sizes XLA's program against the fused kernel: its
    # all-gather hides under the weight read on rings of at most
    # ``Cal.xla_ag_hidden_n`` devices.
    decode_xla_s=xla - (xla_ring if n <= cal.xla_ag_hidden_n else 0.0),
    fused_fwd_s=fwd,
  )
  if fwd_shown is not None and choice.fused_us is not None:
    choice = dataclasses.replace(choice, fused_fwd_us=fwd_shown * 1e6)
  if decode_rings:
    choice = dataclasses.replace(
      choice,
      ring_us=None if 1 not in rings else rings[1] * 1e6,
      ring_bidi_us=None if 2 not in rings else rings[2] * 1e6,
    )
  if held:
    why = choice.reason
    if rings[1] < min(rings[2], fused) and choice.method == "ring_bidi":
      why = (
        f"the two-way value ring of whole chunks meets the memory target "
        f"in {whole_panels} row panels; the one-way ring, estimated "
        f"faster, holds its whole float32 accumulator "
        f"({m * f * 4 / 2**20:.0f} MiB)"
      )
    choice = dataclasses.replace(choice, ring_us=rings[1] * 1e6, reason=why)
  if spill:
    dropped = min(over, key=rings.get)
    held_acc = {1: one_acc // 2, 2: acc // 2}
    name = {1: "one-way", 2: "two-way"}[dropped]
    why = choice.reason
    if choice.method == "fused" and rings[dropped] < fused:
      why = (
        f"the fused kernel keeps its accumulator in VMEM, within the "
        f"memory target; the {name} value ring, estimated faster, holds "
        f"its whole accumulator ({held_acc[dropped] / 2**20:.0f} MiB) in "
        f"one panel, over it"
      )
    choice = dataclasses.replace(
      choice,
      reason=why,
      ring_us=None if 1 not in rings else rings[1] * 1e6,
      ring_bidi_us=None if 2 not in rings else rings[2] * 1e6,
    )
  choice = _mem_reason(choice, mem, fused, rings if mem_rings else None)
  if panels > 1 and choice.method == "fused":
    choice = dataclasses.replace(
      choice, reason=f"{choice.reason} ({panels} row panels)"
    )
  elif panels > 1 and choice.method.startswith("ring"):
    choice = dataclasses.replace(
      choice,
      reason=f"{choice.reason}; the fused kernel would run {panels} row "
      "panels, each re-reading w",
    )
  return _on(choice, wr)


def explain_reducescatter(
  m: int,
  k: int,
  c: int,
  n: int,
  dtype,
  *,
  precision: str,
  device_kind,
  wiring: _wiring.Wiring | None = None,
  memory: Memory = "fastest",
) -> Choice:
  """The choice for ``psum_scatter(x [m, k] @ w [k, n c])`` (the fused
  estimate counts its row panels, as :func:`explain_allgather`; the value
  rings move partial sums of ``m x c`` in the input dtype, the two-way
  ring half of each block per direction; ``memory`` as there)."""
  if memory == "jit":
    # Only a fused pick over the target moves (:func:`explain_allgather`).
    fast = explain_reducescatter(
      m,
      k,
      c,
      n,
      dtype,
      precision=precision,
      device_kind=device_kind,
      wiring=wiring,
    )
    if fast.method not in _FUSED:
      return fast
  chip = chip_for(device_kind)
  cal = CAL[chip.name]
  b = jnp.dtype(dtype).itemsize
  t = jnp.dtype(_fused.transfer_dtype(dtype, precision)).itemsize
  w_bytes = k * n * c * b
  part = m * c * t
  compute = 2 * m * k * n * c / _flops_rate(chip, dtype, precision)
  hbm = (w_bytes + m * k * t + m * c * b) / chip.hbm
  # XLA's reduce-scatter inside shard_map runs over one ring direction
  # after the whole matmul (the model: 11.9 us exposed at M = 16, 85 at
  # M = 256, v5e, tp 8), as its all-gather does.
  wr = _links(wiring, n)
  # XLA's reduce-scatter moves the partial sums in the result's dtype (the
  # fused kernel's ``part`` travels in bfloat16 for float32 at DEFAULT):
  # float32 doubles the bytes (the model, v5e prefill f32, tp 4: 550 us
  # exposed, 3 steps of a 8 MiB float32 block).
  xla_part = m * c * b
  # Over XLA's ring order (``Wiring.xla``): on tpu_mesh's 2x2 squares in
  # device order the square's cycle, every hop one link (the model, v6e,
  # chapter shape: 27.3 us; charged the mesh's order, 32.9).
  wx = wr.xla
  ring = (n - 1) * (
    xla_part * wx.shift_load / chip.link + wx.shift_hops * _HOP_S
  )
  xla_dot = max(compute, hbm / cal.xla_hbm) + cal.xla_rs_w * w_bytes / chip.hbm
  xla = _XLA_OVERHEAD_S + ring + xla_dot
  plan = _fused.plan_reducescatter(
    m,
    k,
    c,
    n,
    dtype,
    dtype,
    directions=2,
    precision=precision,
    device_kind=device_kind,
  )
  reason = None if plan.spec is not None else plan.reason
  # ``memory="jit"``: the fused kernels' receive slots in HBM against the
  # memory target (:func:`_slots_over`, :func:`_rs_slots`: none where the
  # plan holds them in VMEM): over it, no fused candidate. (The one-way
  # kernel's plan is checked apart, below.)
  mem = None
  if reason is None and memory == "jit":
    mem = _slots_over(chip, n, part, _rs_slots(plan))
    reason = mem
  panels = max(plan.panels, 1)
  w_s = w_bytes / chip.hbm
  # The finish kernel, charged its operands in HBM as the model's floor
  # does (branch h-rsv6e8): each panel's whole receive buffer ([d, n - 1,
  # m / p, c / d], though it adds only the last slot) and the result,
  # which the first panel writes whole and the later ones alias; its own
  # float32 products stay in VMEM. At v6e tp 8 M = 4096: 14.1 us for the
  # first panel, 8.9 for each later one (was charged 5.1 a panel, its
  # rows' products, last sums and result); on rings of 4 in bf16 the
  # same bytes as before.
  finish = ((n - 1) * part + m * c * b) / chip.hbm

  def fused_s(p, pl=plan, **kw):
    """The fused kernel in ``p`` row panels of plan ``pl`` (``_fused_s``'s
    options)."""
    # Each panel's steps kernel reads all of w and x and its received
    # partial sums ([d, n - 1, m / p, c / d]): the model's floor for it
    # (v6e tp 4 M = 16384, 16 panels: 222.5 us a panel, the 143.2 us read
    # of all of x, w's 71.6 and the sums' 7.7, against 186.6 at M = 4096).
    floor = (w_bytes + m * k * t + (n - 1) * part / p) / chip.hbm
    # The streamed read as measured: one row panel (``Cal.rs_stream``) or
    # several (``Cal.rs_stream_panels``) on rings of 4 or more (a ring of
    # two's picks not re-measured).
    stream = n > 2 and (cal.rs_stream if p == 1 else cal.rs_stream_panels)
    # One step's dot: the panel's rows of x, a block of w, its partial sums.
    step_floor = (m * k * t / p + w_bytes / n + part / p) / chip.hbm
    # The chain: streamed (``Cal.rs_stream_chain``, v5e) or with the read
    # serial (``Cal.rs_chain``, v6e), on rings of 4 or more.
    chain = n > 2 and (cal.rs_stream_chain if stream else cal.rs_chain)
    est = _fused_s(
      p,
      compute,
      w_s,
      hbm - w_s,
      n,
      part,
      chip.link,
      wr,
      1.0 if stream else cal.rs_overlap,
      finish_s=finish,
      stream=stream,
      chain=chain,
      step_floor_s=step_floor,
      floor_s=floor,
      fill_s=_rs_fill_s(pl, k, t, b, chip),
      tail=_rs_tail(pl),
      **kw,
    )
    return est + (p - 1) * (cal.rs_panel_s + cal.rs_panel_w * w_s)

  fused = fused_s(panels)
  # The one-way kernel (whole blocks one way round the ring): its own
  # plan (a wider w block and more scoped VMEM, so sometimes more panels).
  plan_uni = _fused.plan_reducescatter(
    m,
    k,
    c,
    n,
    dtype,
    dtype,
    directions=1,
    precision=precision,
    device_kind=device_kind,
  )
  fused_uni = None
  # XLA's prefetch of x into VMEM enters only the comparison of the two
  # fused kernels (below): against the rings and XLA the fused estimate
  # stays as fit. Charged whole there, the 2 MiB copy at the chapter's
  # shape (0.3 us exposed in the model) put the fused kernel (the model
  # 20.6 us on the ring layout) over XLA's 3% margin on v6e's 2x2
  # squares (estimated 32.2 against 32.9).
  if plan.spec is not None and plan_uni.spec is not None:
    # The two kernels compared as chains (their rings after each step's
    # dots, as the model charges them since h-rswait; before, from the
    # kernel's start: the one-way kernel's whole partial sums hid under
    # the dots, and it ran at v6e's prefill, the model 209.9 us against
    # the two-way kernel's 198.3), each with its panels and x copy; the
    # one-way kernel's estimate is the two-way one's scaled by their ratio.
    def chained(p, d, pl):
      return fused_s(
        p, pl, directions=d, x_copy_s=_x_copy_s(pl, k, t, chip, cal)
      )

    p1 = max(plan_uni.panels, 1)
    ratio = chained(p1, 1, plan_uni) / chained(panels, 2, plan)
    fused_uni = fused * ratio
    # ``memory="jit"``: the one-way kernel's plan may keep its slots in
    # HBM where the two-way one's are in VMEM (its wider ``w`` block
    # leaves less VMEM: the Llama shard's tp 4, M = 1024 on v5e and v6e,
    # 12.06 MiB against the two-way kernel's 0.06): no candidate then.
    if memory == "jit" and _slots_over(chip, n, part, _rs_slots(plan_uni)):
      fused_uni = None
  rings = {}
  for d in (1, 2):
    if d == 2 and m % 2:
      continue
    # The two-way ring's float32 partial sums, once large, are charged a
    # pass beside its adds (``CAL.bidi_rs_acc``; the model at tp 4, M =
    # 16384: 3724.9 us on v6e against the one-way ring's 3368.4).
    sums = m * c * (4 if jnp.issubdtype(dtype, jnp.floating) else b)
    sums_s = 0.0
    if d == 2 and sums >= min(_BIDI_ACC_BYTES, cal.bidi_rs_acc_from):
      sums_s = cal.ring_rho * cal.bidi_rs_acc * 2 * sums / chip.hbm
    if _off_mxu(dtype):
      # A 32-bit integer matmul (off the MXU, about ten times longer): the
      # per-step form fit before h-rsest (its timelines not re-read).
      rings[d] = _ring_s(
        n,
        d,
        compute,
        d * k * c * b,
        m * k * b + 2 * m * c * b,
        chip,
        m * c * b,
        cal,
        wr,
        dot_bytes=k * c * b + (m // d) * (k + c) * b,
        off_mxu=True,
      )
      continue
    rings[d] = _rs_ring_s(
      n, d, compute, m, k, c, b, chip, cal, wr, sums_s=sums_s
    )
  # No decode rule here: XLA's reduce-scatter runs after the whole matmul
  # and stays exposed, while the fused kernel sends each partial sum as it
  # is made (modelled on v5e, tp 8, Llama-3-70B MLP shard: 86.3 against
  # XLA's best 96.7 us at M = 16, 97.7 against 122.5 at M = 64).
  # The fused kernel dropped for its slots alone (``memory="jit"``), bound
  # by the weight read: XLA's program, not a value ring (as the
  # all-gather).
  mem_rings = mem is not None and compute < hbm
  choice = _decide(
    reason,
    fused,
    xla,
    compute,
    hbm,
    chip,
    hbm_rule=False,
    ring_s=None if mem_rings else rings.get(1),
    ring_bidi_s=None if mem_rings else rings.get(2),
    fused_uni_s=fused_uni,
  )
  choice = _mem_reason(choice, mem, fused, rings if mem_rings else None)
  if panels > 1 and choice.method.startswith("ring"):
    choice = dataclasses.replace(
      choice,
      reason=f"{choice.reason}; the fused kernel would run {panels} row "
      "panels, each re-reading w",
    )
  return _on(choice, wr)


def explain_allreduce(
  m: int,
  k: int,
  f: int,
  n: int,
  dtype,
  *,
  precision: str,
  device_kind,
  wiring: _wiring.Wiring | None = None,
  memory: Memory = "fastest",
) -> Choice:
  """The choice for ``psum(x [m, k] @ w [k, f])``: the fused reduce-scatter
  plus XLA's all-gather, against XLA's all-reduce (``memory`` as
  :func:`explain_reducescatter`'s: with ``"jit"`` a fused kernel over the
  target leaves XLA's all-reduce).

  Both move the blocks twice around the ring, and only the first half can
  hide under the matmul. XLA's all-reduce is one collective over both ring
  directions; the all-gather after the fused reduce-scatter is a separate
  collective XLA runs over one direction (its plain all-gather of the
  result), so its half costs twice the link time.
  """
  c = -(-f // n)
  rs = explain_reducescatter(
    m,
    k,
    c,
    n,
    dtype,
    precision=precision,
    device_kind=device_kind,
    wiring=wiring,
    memory=memory,
  )
  wr = _links(wiring, n)
  wx = wr.xla  # XLA's all-reduce and all-gather: XLA's ring order
  chip = chip_for(device_kind)
  # XLA's all-reduce moves the result's dtype (as its reduce-scatter).
  half = m * c * jnp.dtype(dtype).itemsize / chip.link
  # XLA's all-reduce: both halves over both ring directions (``rs``'s
  # XLA estimate has its reduce-scatter over one).
  one_way = (n - 1) * (half * wx.shift_load + wx.shift_hops * _HOP_S)
  xla = rs.xla_us * 1e-6 - one_way
  xla += 2 * (n - 1) * (half * wx.bidi_load + wx.bidi_hops * _HOP_S)
  if rs.fused_us is None or _NO_FUSED in rs.reason:
    # The rings' all-reduce is not estimated here: XLA's all-reduce.
    # (With ``memory="jit"``, its fused kernel over the memory target.)
    why = "fused kernels unavailable for the reduce-scatter half"
    if rs.fused_us is not None:
      why = f"the reduce-scatter half: {rs.reason}"
    return Choice(
      "xla",
      why,
      None,
      xla * 1e6,
      rs.chip,
    )
  fused = rs.fused_us * 1e-6 + _XLA_OVERHEAD_S + one_way
  compute = 2 * m * k * n * c / _flops_rate(chip, dtype, precision)
  hbm = k * n * c * jnp.dtype(dtype).itemsize / chip.hbm
  return _on(_decide(None, fused, xla, compute, hbm, chip), wr)


def explain_ring(
  flops: float, w_bytes: int, dtype, *, precision: str, device_kind, why: str
) -> Choice:
  """The choice for a form the fused kernels do not run (``why``): the
  value-API ring, unless the matmul is bound by reading the weights from
  HBM (``C < M / 2``, decode-size rows), where XLA's collective and one
  ``jnp.dot`` are kept (the ring reads the weights in ``n`` slices and adds
  a launch per step; modelled 1.36x of ``xla_best`` at M = 16, v5e, tp 8).

  Args:
    flops: the matmul's FLOPs per device.
    w_bytes: the weight bytes each device reads.
    dtype: the operands' dtype.
    precision: ``"DEFAULT"`` or ``"HIGHEST"``.
    device_kind: the chip (None: v5e).
    why: why the fused kernels do not run, for the reason.
  """
  chip = chip_for(device_kind)
  compute = flops / _flops_rate(chip, dtype, precision)
  hbm = w_bytes / chip.hbm
  us = max(compute, hbm) * 1e6
  if compute < hbm / 2:
    return Choice(
      "xla",
      f"{why}; bound by reading the weights from HBM (decode-size rows): "
      "no transfer left to hide",
      None,
      us,
      chip.name,
      ring_form=True,
    )
  return Choice(
    "ring",
    f"{why}; the ring's transfers hide under the matmul",
    None,
    us,
    chip.name,
    ring_form=True,
  )


def pick(
  method: str,
  fn: str,
  *,
  ring_options: tuple[str, ...],
  unfused: str | None,
  explain,
  explain_unfused,
) -> str:
  """The method a public collective matmul runs.

  Args:
    method: the caller's ``method``.
    fn: the public function's name, for errors.
    ring_options: the ring-only options the caller set (``api='ref'``,
      ``bidirectional=True``), as text; ``"auto"`` then runs the ring.
    unfused: why the fused kernels cannot run this call's form (None: they
      can).
    explain: ``() -> Choice`` between ``"fused"``, ``"xla"``,
      ``"ring"`` and ``"ring_bidi"`` (the two-way ring, which the caller
      runs as ``method="ring", bidirectional=True``).
    explain_unfused: ``(why) -> Choice`` between ``"ring"`` and ``"xla"``.

  Raises:
    ValueError: an unknown ``method``; ring options with ``"fused"`` or
      ``"xla"``; ``"fused"`` for a form it does not run.
  """
  if method not in METHODS:
    raise ValueError(
      f"{fn}: method must be one of {METHODS}, got {method!r}. 'auto' "
      "chooses from the shape, dtype, ring size and chip."
    )
  if ring_options and method in ("fused", "xla"):
    raise ValueError(
      f"{fn}: {' and '.join(ring_options)} configure the ring, but "
      f"method={method!r}. Pass method='ring' (or leave method='auto', "
      "which then runs the ring), or drop them."
    )
  if method == "fused" and unfused is not None:
    raise ValueError(
      f"{fn}(method='fused'): the fused kernels do not run this call: "
      f"{unfused}. Use method='auto' (the default) or 'ring'."
    )
  if method != "auto":
    return method
  if ring_options:
    return "ring"
  choice = explain() if unfused is None else explain_unfused(unfused)
  recorder = _RECORDER.get()
  if recorder is not None:
    recorder.append((fn, choice))
  return choice.method


_RECORDER: contextvars.ContextVar[list | None] = contextvars.ContextVar(
  "asyncops_auto_choices", default=None
)


@contextlib.contextmanager
def recording():
  """Collects ``(function, Choice)`` for every ``method="auto"`` choice
  made while tracing inside the block (the benchmark tables print them).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import AxisType, PartitionSpec as P
    >>> from asyncops.collective_matmul import allgather_matmul
    >>> mesh = jax.make_mesh((8,), ("y",), axis_types=(AxisType.Auto,))
    >>> f = jax.shard_map(lambda x, w: allgather_matmul(x, w, "y"),
    ...                   mesh=mesh, in_specs=(P(None, "y"), P(None, "y")),
    ...                   out_specs=P(None, "y"))
    >>> x, w = jnp.ones((8, 64)), jnp.ones((64, 16))
    >>> with recording() as choices:
    ...   _ = jax.jit(f).trace(x, w)
    >>> [(fn, c.method) for fn, c in choices]
    [('allgather_matmul', 'xla')]
  """
  choices: list = []
  token = _RECORDER.set(choices)
  try:
    yield choices
  finally:
    _RECORDER.reset(token)


def device_kind() -> str | None:
  """The chip of the mesh being traced over (None: unknown)."""
  return jc.trace_device_kind()


def wiring(axis_name) -> _wiring.Wiring | None:
  """How the rings along ``axis_name`` of the mesh being traced over load
  the links (None: unknown; the estimates then assume a ring whose every
  hop is one link)."""
  return _wiring.for_axis(axis_name)


# Running the choice --------------------------------------------------------


def _acc(dtype):
  return jnp.int32 if jnp.dtype(dtype) == jnp.int8 else None


def dot(x, w):
  """``x @ w`` in ``x.dtype`` (int8 accumulates in int32, as the rings)."""
  y = jnp.dot(x, w, preferred_element_type=_acc(x.dtype))
  return y.astype(x.dtype)


def ring_options(api: str, bidirectional: bool) -> tuple[str, ...]:
  """The ring-only options a caller set, as text (for :func:`pick`)."""
  out = ("api='ref'",) if api == "ref" else ()
  return out + (("bidirectional=True",) if bidirectional else ())
