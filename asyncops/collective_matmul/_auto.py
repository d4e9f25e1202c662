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
the ring size and the chip the mesh is made of (``AbstractMesh.
abstract_device``; a v5e if the mesh names none, e.g. on CPU, where every
method computes the same result with ``jax.lax``). Each candidate gets an
analytic estimate from public chip figures (:data:`CHIPS`) and a few
per-chip constants fit to the benchmark model's figures (:data:`CAL`):

- MXU time ``C`` = FLOPs / peak (float32 at ``HIGHEST`` takes six bf16
  passes); HBM time ``M`` = bytes every method must read or write once
  (``w``, the chunks, the result) / HBM bandwidth; ``W`` = the weight
  read alone;
- ring time ``T(d)`` = bytes received per link direction / link bandwidth
  plus a hop of latency per step, with ``d`` directions in use.

- ``xla ~ 1 us + T(1) + max(C, M)``: XLA's collective inside
  ``shard_map`` blocks and runs over one ring direction (what the
  benchmark model finds in XLA's all-gather and reduce-scatter); the
  reduce-scatter's matmul, which it waits for, is charged the weight read
  at ``CAL.xla_hbm`` of HBM bandwidth.
- ``fused``, the all-gather: per row panel, ``1.5 us`` plus its steps'
  dots (each the longer of its FLOPs and its rows of ``W`` with a pass
  over the float32 accumulator), or the direct sends to every peer and
  the last step, whichever is longer; extra panels cost
  ``CAL.fused_panel W`` each.
- ``fused``, the reduce-scatter: per row panel, ``1.5 us + W`` (the
  kernel's charge, XLA's estimate of the same dots, reads the weight
  before them) plus the larger of its dots and its ring ``T(2)``; extra
  panels cost ``CAL.rs_panel_s`` each.
- ``ring(d)``: ``n`` steps, each ``max(C / n + rho bytes / HBM + fixed,
  T(d) / (n - 1))`` plus a tenth of the shorter (``CAL.ring_rho``,
  ``ring_step_s``, ``ring_dot_s`` for the second direction's dot).

The fastest estimate wins; the fused kernel is kept over a ring within 3%
(it holds less memory), and a ring or fused kernel must be 3% under XLA's
program. For the all-gather, a matmul bound by reading ``w`` (``C < M /
2``, decode sizes) keeps XLA's program (no extra kernels, no barrier): the
step is the weight read either way. The reduce-scatter has no such rule:
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
from asyncops.collective_matmul import _fused, _gather_rings

Method = Literal["auto", "fused", "ring", "xla"]
METHODS: tuple[str, ...] = ("auto", "fused", "ring", "xla")


@dataclasses.dataclass(frozen=True)
class Chip:
  """Public per-chip figures (Cloud TPU docs; links at 0.92 of nominal,
  as measured with pipelined remote DMAs in a public Pallas study).

  Attributes:
    name: generation.
    bf16_flops: peak bf16 FLOP/s.
    hbm: HBM bytes/s.
    link: one ICI link, one direction, bytes/s.
  """

  name: str
  bf16_flops: float
  hbm: float
  link: float


CHIPS = {
  "v4": Chip("v4", 275e12, 1200e9, 45e9 * 0.92),
  "v5e": Chip("v5e", 197e12, 819e9, 50e9 * 0.92),
  "v5p": Chip("v5p", 459e12, 2765e9, 100e9 * 0.92),
  "v6e": Chip("v6e", 918e12, 1640e9, 100e9 * 0.92),
}
_HOP_S = 1e-6
_FUSED_OVERHEAD_S = 1.5e-6  # the start's barrier and issue, the done
_XLA_OVERHEAD_S = 1e-6
_MARGIN = 0.97
# A value-ring step whose dots and transfer take about as long costs a
# tenth of the shorter beyond the longer (the model's steps, v5e and v6e).
_RING_CONTENTION = 0.1
_BIDI_ACC_BYTES = 128 * 2**20


def chip_for(device_kind: str | None) -> Chip:
  """The figures for a device kind (``"TPU v5 lite"`` -> v5e); v5e when
  unknown."""
  kind = (device_kind or "").lower()
  if "v6" in kind:
    return CHIPS["v6e"]
  if "v5" in kind and ("lite" in kind or "v5e" in kind):
    return CHIPS["v5e"]
  if "v5" in kind:
    return CHIPS["v5p"]
  if "v4" in kind:
    return CHIPS["v4"]
  return CHIPS["v5e"]


@dataclasses.dataclass(frozen=True)
class Cal:
  """How the benchmark model's charges depart from the roofline, per chip
  (fit to the Llama-3-70B sweep of ``design/benchmarks.md``; the figures
  of :data:`CHIPS` are the roofline).

  Attributes:
    ring_rho: the share of a value-ring step's HBM traffic (its rows of
      ``w``, the chunk, the partial sums or accumulator) that does not
      hide under the step's matmul (XLA's chunk dots and adds).
    ring_step_s: a value-ring step's fixed cost (start, done, the dot's
      launch).
    fused_panel: a fused all-gather's cost per extra row panel beyond its
      weight read, in weight reads (its ring restarts and accumulator
      flushes; the model, tp 8: v5e 100 us over the one-panel estimate
      at 2 panels, 300 us per extra panel at 8; v6e 172 us at 8).
    ring_dot_s: the two-way ring's extra cost per step (a second dot).
    ring_acc: the share of the all-gather ring's float32 accumulator
      traffic (read and write per step) charged beside its dots.
    rs_panel_s: a fused reduce-scatter's cost per extra row panel (the
      model, tp 8, up to 16 MiB of sent partial sums per panel: 74 us on
      v5e at 4 and 16 panels, 12 to 17 us on v6e).
    xla_hbm: the share of HBM bandwidth XLA's matmul is charged at when
      reading the weights bounds it (the reduce-scatter's matmul, which
      its collective waits for).
  """

  ring_rho: float
  ring_step_s: float
  ring_dot_s: float
  ring_acc: float
  fused_panel: float
  xla_hbm: float
  rs_panel_s: float


# v5e and v6e: fit to the Llama-3-70B sweep at tp 8 (design/benchmarks.md);
# v5p: three points of it (its value-ring steps cost about 13 us more than
# their dots at decode, and its two-way ring's second dot 5 us); v4 takes
# v5e's.
CAL = {
  "v4": Cal(0.65, 8e-6, 1.4e-6, 0.5, 4.2, 0.85, 74e-6),
  "v5e": Cal(0.65, 8e-6, 1.4e-6, 0.5, 4.2, 0.85, 74e-6),
  "v5p": Cal(0.9, 13e-6, 5e-6, 0.5, 1.4, 0.76, 2e-6),
  "v6e": Cal(0.9, 4e-6, 1.4e-6, 0.5, 4.8, 0.76, 15e-6),
}


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
  """

  method: str
  reason: str
  fused_us: float | None
  xla_us: float
  chip: str
  ring_form: bool = False
  ring_us: float | None = None
  ring_bidi_us: float | None = None

  def __str__(self) -> str:
    if self.ring_form:
      return (
        f"{self.method} ({self.reason}; est. max(matmul, weight read) "
        f"{self.xla_us:.1f} us on {self.chip})"
      )

    def us(v):
      return "n/a" if v is None else f"{v:.1f}"

    rings = ""
    if self.ring_us is not None or self.ring_bidi_us is not None:
      rings = f", ring {us(self.ring_us)}, two-way ring {us(self.ring_bidi_us)}"
    return (
      f"{self.method} ({self.reason}; est. fused {us(self.fused_us)}"
      f"{rings}, xla {self.xla_us:.1f} us on {self.chip})"
    )


def _flops_rate(chip: Chip, dtype, precision: str) -> float:
  if jnp.dtype(dtype) == jnp.float32 and precision == "HIGHEST":
    return chip.bf16_flops / 6
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
) -> Choice:
  """The fastest candidate by estimate; a ring or fused kernel must beat
  XLA's program by 3% (it adds kernels and barriers)."""

  def us(v):
    return None if v is None else v * 1e6

  est = dict(
    fused_us=us(fused_s) if fused_reason is None else None,
    xla_us=xla_s * 1e6,
    chip=chip.name,
    ring_us=us(ring_s),
    ring_bidi_us=us(ring_bidi_s),
  )
  rings = {"ring": ring_s, "ring_bidi": ring_bidi_s}
  rings = {k: v for k, v in rings.items() if v is not None}
  if fused_reason is not None and not rings:
    return Choice("xla", f"fused kernels unavailable: {fused_reason}", **est)
  if hbm_rule and compute_s < hbm_s / 2:
    return Choice(
      "xla",
      "bound by reading the weights from HBM (decode-size rows): no "
      "transfer left to hide",
      **est,
    )
  ours = dict(rings)
  if fused_reason is None:
    ours["fused"] = fused_s
  best = min(ours, key=ours.get)
  if best != "fused" and "fused" in ours and ours[best] > _MARGIN * fused_s:
    best = "fused"  # within the margin: the kernel holds less memory
  if ours[best] > _MARGIN * xla_s:
    why = "no ring is estimated faster than XLA's collective here"
    if fused_reason is not None:
      why = f"{why} (fused kernels unavailable: {fused_reason})"
    return Choice("xla", why, **est)
  if best == "fused":
    why = "the ring transfers hide under the matmul"
    if compute_s < hbm_s / 2:
      why = (
        "bound by reading the weights from HBM, but the partial sums leave "
        "as they are made (XLA's reduce-scatter waits for the whole matmul)"
      )
    return Choice("fused", why, **est)
  why = {
    "ring": "the one-way value ring is estimated fastest",
    "ring_bidi": "the two-way value ring is estimated fastest: half the "
    "bytes per link per step",
  }[best]
  if fused_reason is not None:
    why = f"{why}; fused kernels unavailable: {fused_reason}"
  return Choice(best, why, **est)


def _fused_s(panels, compute, w_s, rest_s, n, chunk, link, floor_s=0.0):
  """The fused reduce-scatter's estimate over ``panels`` row panels, one
  after the other: each reads ``w`` before its matmul (the kernel's charge:
  XLA's estimate of the same dots, which serialises the weight read), and
  runs its own ring of ``1 / panels`` of the rows (``rest_s``: the other
  HBM traffic, ``chunk``: one step's bytes, ``floor_s``: the least a
  panel's dots cost, ``n`` steps of them). The partial sums travel on, one
  hop per step, once the dots have made them."""
  p = panels
  ring = (n - 1) * (chunk / p / (2 * link) + _HOP_S)
  c = max(compute / p, floor_s, rest_s / p)
  return p * (_FUSED_OVERHEAD_S + w_s + max(c, ring + c / n))


def _fused_ag_s(panels, plan, compute, w_s, acc_s, n, chunk, link):
  """The fused all-gather's estimate over ``panels`` row panels, one after
  the other. Each step of the kernel's ``plan`` (``g`` chunks) is charged
  one dot (XLA's estimate: its FLOPs, or its rows of ``w`` and a pass over
  the float32 accumulator, ``acc_s``, whichever is longer). The start sends
  every chunk to every peer over both directions (``sum(min(d, n - d)) /
  2`` chunks per directed link, 8 at ``n = 8`` where forwarding takes 3.5)
  before the dots begin; the last step waits for the farthest chunk. (The
  benchmark model: within 1% at the chapter's and prefill shapes on v5e
  and at M = 256 and 1024 of the Llama-3-70B sweep, tp 8.)"""
  p = panels
  load = sum(min(d, n - d) for d in range(1, n)) / 2
  ring = load * chunk / p / link + (n - 1) * _HOP_S
  steps = [max(g * compute / (n * p), g * w_s / n + acc_s / p) for g in plan]
  c = sum(steps)
  return p * (_FUSED_OVERHEAD_S + max(c, ring + steps[-1]))


def _ring_s(n, d, compute, hidden, extra, chip, chunk, cal) -> float:
  """The value ring over ``d`` directions: ``n`` steps, each its dots
  (``compute / n``, or the HBM time of the ``hidden`` bytes a step reads
  under them when longer), plus ``cal.ring_rho`` of the ``extra`` bytes
  that stream beside them and a fixed cost (one more dot launch per extra
  direction), or the step's transfer (``chunk / d`` bytes per link) when
  that is longer (plus :data:`_RING_CONTENTION` of the shorter)."""
  dots = max(compute / n, cal.ring_rho * hidden / chip.hbm)
  dots += cal.ring_rho * extra / chip.hbm
  transfer = chunk / (d * chip.link) + _HOP_S
  fixed = cal.ring_step_s + (d - 1) * cal.ring_dot_s
  step = max(dots + fixed, transfer) + _RING_CONTENTION * min(dots, transfer)
  return _XLA_OVERHEAD_S + n * step


def _whole_ring_s(n, compute, acc, chunk, out_bytes, chip) -> float:
  """The two-way ring of whole chunks (``_gather_rings.whole_chunks``):
  ``x`` written twice into the travelling buffer; step 0 the local dot;
  ``n / 2 - 1`` steps of two chunks' dots plus half an accumulator pass
  (XLA's estimate of that fusion, the model at tp 8, M = 16384: v6e 478
  us for 262 of FLOPs and a 286 us pass; v5e 1354 for 1224 and 574),
  each at least a whole chunk's transfer; then the antipode's dot, a
  full pass and the output (v6e 495 us, v5e 1124)."""
  c = compute / n
  a = acc / chip.hbm
  transfer = chunk / chip.link + _HOP_S
  mid = max(2 * c + a / 2, transfer)
  last = c + a + out_bytes / chip.hbm
  copy = 3 * chunk / chip.hbm
  return _XLA_OVERHEAD_S + copy + max(c, transfer) + (n // 2 - 1) * mid + last


def explain_allgather(
  m: int, k: int, f: int, n: int, dtype, *, precision: str, device_kind
) -> Choice:
  """The choice for ``all_gather(x [m, k]) @ w [n k, f]`` on ``n`` devices.

  The fused estimate counts its row panels (each re-reads ``w`` and
  restarts the ring); XLA's all-gather, blocking, is costed over one ring
  direction (what the benchmark model finds in XLA's program: 12.0 us
  exposed at M = 16, 5113 us at M = 16384, v5e, tp 8). The value rings
  (one- and two-way) read their rows of ``w`` at every step (the two-way
  ring twice: its halves meet different rows) and their float32
  accumulator.
  """
  chip = chip_for(device_kind)
  cal = CAL[chip.name]
  b = jnp.dtype(dtype).itemsize
  t = jnp.dtype(_fused.transfer_dtype(dtype, precision)).itemsize
  w_bytes = n * k * f * b
  out_bytes = m * f * b
  compute = 2 * m * n * k * f / _flops_rate(chip, dtype, precision)
  hbm = (w_bytes + n * m * k * t + out_bytes) / chip.hbm
  chunk = m * k * t
  xla_ring = (n - 1) * (chunk / chip.link + _HOP_S)
  xla = _XLA_OVERHEAD_S + xla_ring + max(compute, hbm)
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
  # The kernel's charge, XLA's estimate of its n chunk dots, reads and
  # writes their float32 accumulator at every step (in its panel's rows).
  plan_steps = _fused.choose_steps(
    n,
    -(-m // panels),
    k,
    f,
    dtype,
    device_kind,
    _fused.transfer_dtype(dtype, precision),
  )
  fused = (
    _fused_ag_s(
      panels, plan_steps, compute, w_s, acc / chip.hbm, n, chunk, chip.link
    )
    + (panels - 1) * cal.fused_panel * w_s
  )
  rings = {}
  for d in (1, 2):
    if d == 2 and m % 2:
      continue
    # The value ring moves x as it is (``chunk`` is the fused kernel's).
    hidden = k * f * b + m * k * b + cal.ring_acc * acc
    # The two-way ring's two half accumulators ([2, m/2, f]) are charged
    # their traffic beside the dots once they are large (the model, tp 8:
    # within 4% of this estimate without it at M <= 4096, 1.35x and 2.0x
    # over it at M = 16384 on v5e and v6e; 56 and 224 MiB accumulators).
    extra = acc if d == 2 and acc // 2 > _BIDI_ACC_BYTES else 0
    rings[d] = _ring_s(n, d, compute, hidden, extra, chip, m * k * b, cal)
    if d == 2 and _gather_rings.whole_chunks(m, f, jnp.float32, n):
      rings[d] = _whole_ring_s(n, compute, acc, m * k * b, out_bytes, chip)
  choice = _decide(
    reason,
    fused,
    xla,
    compute,
    hbm,
    chip,
    ring_s=rings.get(1),
    ring_bidi_s=rings.get(2),
  )
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
  return choice


def explain_reducescatter(
  m: int, k: int, c: int, n: int, dtype, *, precision: str, device_kind
) -> Choice:
  """The choice for ``psum_scatter(x [m, k] @ w [k, n c])`` (the fused
  estimate counts its row panels, as :func:`explain_allgather`; the value
  rings move partial sums of ``m x c`` in the input dtype, the two-way
  ring half of each block per direction)."""
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
  ring = (n - 1) * (part / chip.link + _HOP_S)
  xla = _XLA_OVERHEAD_S + ring + max(compute, hbm / cal.xla_hbm)
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
  panels = max(plan.panels, 1)
  w_s = w_bytes / chip.hbm
  fused = _fused_s(
    panels,
    compute,
    w_s,
    hbm - w_s,
    n,
    part,
    chip.link,
  )
  fused += (panels - 1) * cal.rs_panel_s
  rings = {}
  for d in (1, 2):
    if d == 2 and m % 2:
      continue
    extra = m * k * b + 2 * m * c * b
    rings[d] = _ring_s(n, d, compute, k * c * b, extra, chip, m * c * b, cal)
  # No decode rule here: XLA's reduce-scatter runs after the whole matmul
  # and stays exposed, while the fused kernel sends each partial sum as it
  # is made (modelled on v5e, tp 8, Llama-3-70B MLP shard: 86.3 against
  # XLA's best 96.7 us at M = 16, 97.7 against 122.5 at M = 64).
  choice = _decide(
    reason,
    fused,
    xla,
    compute,
    hbm,
    chip,
    hbm_rule=False,
    ring_s=rings.get(1),
    ring_bidi_s=rings.get(2),
  )
  if panels > 1 and choice.method.startswith("ring"):
    choice = dataclasses.replace(
      choice,
      reason=f"{choice.reason}; the fused kernel would run {panels} row "
      "panels, each re-reading w",
    )
  return choice


def explain_allreduce(
  m: int, k: int, f: int, n: int, dtype, *, precision: str, device_kind
) -> Choice:
  """The choice for ``psum(x [m, k] @ w [k, f])``: the fused reduce-scatter
  plus XLA's all-gather, against XLA's all-reduce.

  Both move the blocks twice around the ring, and only the first half can
  hide under the matmul. XLA's all-reduce is one collective over both ring
  directions; the all-gather after the fused reduce-scatter is a separate
  collective XLA runs over one direction (its plain all-gather of the
  result), so its half costs twice the link time.
  """
  c = -(-f // n)
  rs = explain_reducescatter(
    m, k, c, n, dtype, precision=precision, device_kind=device_kind
  )
  chip = chip_for(device_kind)
  t = jnp.dtype(_fused.transfer_dtype(dtype, precision)).itemsize
  half = m * c * t / chip.link
  # XLA's all-reduce: both halves over both ring directions (``rs``'s
  # XLA estimate has its reduce-scatter over one).
  xla = rs.xla_us * 1e-6 - (n - 1) * (half + _HOP_S)
  xla += 2 * (n - 1) * (half / 2 + _HOP_S)
  if rs.fused_us is None:
    # The rings' all-reduce is not estimated here: XLA's all-reduce.
    return Choice(
      "xla",
      "fused kernels unavailable for the reduce-scatter half",
      None,
      xla * 1e6,
      rs.chip,
    )
  fused = rs.fused_us * 1e-6 + _XLA_OVERHEAD_S + (n - 1) * (half + _HOP_S)
  compute = 2 * m * k * n * c / _flops_rate(chip, dtype, precision)
  hbm = k * n * c * jnp.dtype(dtype).itemsize / chip.hbm
  return _decide(None, fused, xla, compute, hbm, chip)


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
