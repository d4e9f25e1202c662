"""What a Pallas kernel costs: XLA's estimate of its jnp twin.

XLA writes no ``estimated_cycles`` for a Mosaic kernel (and a figure the
kernel passes about itself, ``pl.CostEstimate``, is the author's claim, not
a measurement). So a kernel that computes is charged what XLA estimates for
the same work written with ``jnp`` ops of the same shapes, compiled for the
same chip and modelled the same way, and never less than the kernel's own
roofline (FLOPs at peak, HBM bytes at HBM bandwidth; the timeline applies
that floor). Otherwise our kernels would be graded more kindly than XLA's.

The twin's program is modelled as the kernel reads its operands, which
the kernel's author declares next to the twin from the kernel's
``BlockSpec``s (:class:`Reads`, :func:`register_reads`): a cross-program
prefetch XLA puts in the twin is free only for an operand the kernel
streams under its dots (double-buffered blocks); an operand the kernel
reads whole before its first dot (a ``pl.Buffered(1)`` block) and the
first block of each streamed one are its pipeline fill, charged at HBM
bandwidth before the twin's first op (``_timeline.Fill``); a prefetch of
any other operand is charged (its reader waits for it). A twin with no
declared reads streams nothing and has no fill. See
``KernelCoster.__call__``.

A kernel author registers the twin next to the benchmark variant that uses
the kernel::

  def _twin(operands, results, attrs):      # attrs: the call's HLO text
    x, w = operands[:2]                      # Leaf: .dims, .dtype
    return jnp.matmul, (x, w)                # fn, arguments (Leaf or SDS)

  register("asyncops_fused_matmul", _twin)   # instruction-name prefix

  def _reads(operands, results, attrs):     # from the kernel's BlockSpecs
    # x whole, w streamed in [k, bn] blocks: one of them in the fill.
    return Reads(whole=(0,), streamed=(1,), first=((1, k * bn * 2),))

  register_reads("asyncops_fused_matmul", _reads)

A twin may return a third item, :class:`Steps`: the kernel then runs
step by step, one twin dot per step (in program order), each step gated on
the receive slots it consumes (``benchmarks._timeline.KernelSteps``), and,
on a chained ring (the fused reduce-scatter), sending a slot after a step
(``Steps.sends``); the kernel's total is still the twin program's modelled
time.

Kernels with no twin fall back to the bytes model and are flagged in the
row (``custom call without a cost``); our pure DMA start/done kernels need
none (the model costs their transfers).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from asyncops.inspect import Instr
from benchmarks import _hlo, _timeline
from benchmarks._chips import Chip

# twin(operands, results, attrs) -> (fn, args[, Steps]) or None when it
# does not apply.
Twin = Callable[[Sequence[Any], Sequence[Any], str], "tuple | None"]


@dataclasses.dataclass(frozen=True)
class Steps:
  """A twin's step structure: per dot of its program (in order), the
  receive slots the kernel waits for before that step, and the kernel's
  column blocks per step (see ``_timeline.KernelSteps``)."""

  needs: tuple[tuple[int, ...], ...]
  blocks: int = 1
  tails: tuple[float, ...] = ()
  # Per step, the twin's parameter number of the chunk operand its dot
  # reads (empty: the dots are taken in schedule order), and its chunks
  # (empty: one, plus one per slot it waits for after the first step).
  params: tuple[int, ...] = ()
  units: tuple[int, ...] = ()
  # Per step, the receive slot it sends once it ends (-1: none): a chained
  # ring, the fused reduce-scatter's (``_timeline.KernelSteps.sends``).
  sends: tuple[int, ...] = ()
  # ``needs`` number slots' halves per direction (half-steps,
  # ``_timeline.KernelSteps.halves``).
  halves: bool = False
  # ``(lo, hi)``: the kernel runs only steps ``lo .. hi`` of its twin's
  # (``AgSpec.forward``'s two compute kernels each run part of the one
  # kernel's plan, charged as there); a kernel from ``lo > 0`` first waits
  # for step ``lo``'s slots as it begins (a first step of no cost). None:
  # every step.
  keep: tuple[int, int] | None = None
  # HBM bytes the kernel reads and writes, for its floor in place of its
  # operands' and results' (a kernel that reads some rows of an operand,
  # ``_timeline.KernelSteps.hbm_bytes``); 0: theirs.
  hbm_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class Reads:
  """How a kernel reads its twin's parameters (numbered as the twin's
  ``args``), from the kernel's ``BlockSpec``s.

  Attributes:
    whole: parameters the kernel reads whole before its first dot (a
      ``pl.Buffered(1)`` block): their bytes are in its fill.
    streamed: parameters it streams under its dots (a double-buffered
      block, or chunks it copies into VMEM under an earlier dot): XLA's
      prefetch of one in the twin stays free.
    first: ``(parameter, bytes)``: the first block of a streamed operand,
      in its fill.
    extra_bytes: the rest of its fill: what it reads whole that is no twin
      parameter (a quantized chunk's scales).
  """

  whole: tuple[int, ...] = ()
  streamed: tuple[int, ...] = ()
  first: tuple[tuple[int, int], ...] = ()
  extra_bytes: int = 0


Reader = Callable[[Sequence[Any], Sequence[Any], str], Reads]

_TWINS: dict[str, Twin] = {}
_READS: dict[str, Reader] = {}

_DTYPES = {
  "bf16": jnp.bfloat16,
  "f32": jnp.float32,
  "f16": jnp.float16,
  "s32": jnp.int32,
  "s8": jnp.int8,
  "u8": jnp.uint8,
  "pred": jnp.bool_,
}


def register(prefix: str, twin: Twin) -> None:
  """Registers ``twin`` for kernels whose instruction name starts with
  ``prefix`` (the ``pallas_call`` name, e.g. ``"asyncops_fused_matmul"``).

  Raises:
    ValueError: ``prefix`` is empty.
  """
  if not prefix:
    raise ValueError("register: prefix must name a kernel, got ''.")
  _TWINS[prefix] = twin


def register_reads(prefix: str, reads: Reader) -> None:
  """Registers how the kernels named ``prefix`` read their twin's
  parameters: ``reads(operands, results, attrs) -> Reads`` (the same
  arguments as the twin). Without it the kernel streams nothing (every
  prefetch in its twin is charged) and has no fill.

  Raises:
    ValueError: ``prefix`` is empty.
  """
  if not prefix:
    raise ValueError("register_reads: prefix must name a kernel, got ''.")
  _READS[prefix] = reads


def unregister(prefix: str) -> None:
  _TWINS.pop(prefix, None)
  _READS.pop(prefix, None)


def fill_of(reads: Reads, args: Sequence[Any], chip: Chip) -> _timeline.Fill:
  """The twin's ``_timeline.Fill`` for a kernel that reads ``args`` (its
  twin's arguments, shaped) as ``reads`` says: the whole reads and the
  first blocks at HBM bandwidth (the pipeline's prologue is a DMA from
  HBM into VMEM, as the model charges every copy on its DMA track); an
  op of the twin bound by its bytes that reads those parts from HBM
  itself is charged them once (``_timeline.Fill.parts``)."""
  whole = sum(_nbytes(args[p]) for p in reads.whole)
  bw = chip.hbm_bytes_per_s
  first = sum(b for _, b in reads.first)
  parts = [(p, _nbytes(args[p]) / bw) for p in reads.whole]
  return _timeline.Fill(
    frozenset(reads.whole),
    frozenset(reads.streamed),
    (whole + first + reads.extra_bytes) / bw,
    tuple((p, b / bw) for p, b in reads.first),
    tuple(parts) + tuple((p, b / bw) for p, b in reads.first),
  )


def _nbytes(arg) -> int:
  return int(np.prod(arg.shape)) * jnp.dtype(arg.dtype).itemsize


def _sds(leaf, sharding):
  if isinstance(leaf, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
  return jax.ShapeDtypeStruct(
    leaf.dims, _DTYPES.get(leaf.dtype, jnp.float32), sharding=sharding
  )


@dataclasses.dataclass
class KernelCoster:
  """The ``kernel_cost`` hook of :func:`benchmarks._timeline.simulate`.

  Attributes:
    chip: the generation's figures (the twin is modelled with them).
    device: one device of the same topology (the twin compiles there).
  """

  chip: Chip
  device: Any
  cache: dict = dataclasses.field(default_factory=dict)

  def __call__(self, ins: Instr, module: _hlo.Module) -> float | None:
    name = ins.name.split(".")[0]
    prefix = next((p for p in _TWINS if name.startswith(p)), None)
    if prefix is None:
      return None
    table = {i.name: i for c in module.computations.values() for i in c}
    operands = [
      lf for n in ins.operands if n in table for lf in table[n].arrays
    ]
    built = _TWINS[prefix](operands, list(ins.arrays), ins.attrs)
    if built is None:
      return None
    fn, args, *steps = built
    s = jax.sharding.SingleDeviceSharding(self.device)
    args = tuple(_sds(a, s) for a in args)
    reader = _READS.get(prefix)
    reads = reader(operands, list(ins.arrays), ins.attrs) if reader else Reads()
    shapes = tuple((a.shape, str(a.dtype)) for a in args)
    key = (prefix, shapes, reads, *steps)
    if key not in self.cache:
      text = jax.jit(fn).trace(*args).lower().compile().as_text()
      module = _hlo.parse(text)
      # The kernel uses no cross-program prefetch: it reads ``reads.whole``
      # and the first block of each streamed operand before its first dot
      # (its fill, first on the twin's timeline), then streams its blocks
      # from HBM through its pipeline under its dots. So XLA's prefetch
      # of a streamed operand in the twin is free (the dot reading it
      # still ends no earlier than its bytes have crossed HBM, after the
      # whole reads: ``_timeline._stream_end``), one of a whole-read
      # operand is the fill's read, any other is charged; ``_twin_cost``
      # floors the kernel at its roofline.
      fill = fill_of(reads, args, self.chip)
      tl = _timeline.simulate(module, self.chip, prefetch="free", fill=fill)
      self.cache[key] = (
        step_costs(module, tl, steps[0], fill.seconds) if steps else tl.step_s
      )
    return self.cache[key]


def step_costs(
  module: _hlo.Module,
  tl: _timeline.Timeline,
  steps: Steps,
  fill: float = 0.0,
) -> _timeline.KernelSteps:
  """A twin's modelled time ``tl`` split by the kernel's ``steps``, each
  dot charged to the step whose chunks it reads in ``module`` (the twin's
  compiled HLO); ``fill`` (the kernel's pipeline fill, the first box of
  ``tl``) runs before the first step."""
  owners, reads = _dot_steps(module, steps.params)
  return _split(tl, steps, owners, reads, fill)


def _dot_steps(module: _hlo.Module, params: tuple[int, ...]):
  """``(owners, reads)``: entry instruction name -> step, for each
  instruction that reads exactly one step's chunk parameter
  (``params[s]``) directly or through copies (a cross-program prefetch's
  copy-start / copy-done); and name -> its operands' names."""
  reads = {i.name: set(i.operands) for i in module.computations[module.entry]}
  if not params:
    return {}, reads
  step_of = {p: s for s, p in enumerate(params)}
  reach: dict[str, set] = {}
  owners = {}
  for ins in module.computations[module.entry]:
    if ins.opcode == "parameter":
      reach[ins.name] = {ins.parameter_number}
      continue
    came = set().union(*(reach.get(o, set()) for o in ins.operands))
    if ins.opcode in ("copy-start", "copy-done", "copy", "bitcast"):
      reach[ins.name] = came
    steps = {step_of[p] for p in came if p in step_of}
    if len(steps) == 1:
      owners[ins.name] = steps.pop()
  return owners, reads


def _split(
  tl: _timeline.Timeline,
  steps: Steps,
  owners: dict | None = None,
  reads: dict | None = None,
  fill: float = 0.0,
) -> _timeline.KernelSteps:
  """The twin's modelled time step by step.

  Each dot box is charged to the step whose chunks it reads (``owners``,
  from the twin's HLO: XLA may schedule the steps' dots in another order
  than the kernel runs them, e.g. a paired step's dot last), or when that
  is not known to the steps in schedule order; each other compute box
  joins the step of the next dot. A dot box that also adds earlier dots'
  results (``reads``: XLA fuses the accumulation into one step's dot)
  keeps for its step at most what the dearest plain dot costs per chunk,
  times its step's chunks; the rest (the accumulation and the final cast,
  work the kernel finishes in its last step) and any box after the last
  dot go to the last step, so a step's cost never carries work of the
  steps after it. If XLA did not keep one dot per step, the time is split
  in proportion to each step's chunks (its slots; one for the first
  step). The kernel's pipeline fill (``fill`` seconds, its box in ``tl``)
  is in no step: it runs before the first (``KernelSteps.fill``)."""
  n = len(steps.needs)
  sizes = steps.units or tuple(max(len(nd), 1) for nd in steps.needs)
  costs = [0.0] * n
  boxes = [
    e
    for e in tl.events
    if e.track == "compute" and e.args.get("op") != _timeline.FILL_OP
  ]
  dots = [e for e in boxes if e.args.get("flops", 0) > 0]
  owners, reads = owners or {}, reads or {}
  order = [owners.get(e.name) for e in dots]
  if sorted(s for s in order if s is not None) != list(range(n)):
    order = list(range(len(dots)))  # schedule order
  if len(dots) == n:
    names = {e.name for e in dots}
    charged, pending = [], 0.0
    for e in boxes:
      pending += e.dur
      if e.args.get("flops", 0) > 0:
        charged.append((e, pending))
        pending = 0.0
    adds = [bool(reads.get(e.name, set()) & names) for e, _ in charged]
    plain = [
      c / sizes[order[i]] for i, (_, c) in enumerate(charged) if not adds[i]
    ]
    rest = pending  # the last step writes the result
    for i, (_, c) in enumerate(charged):
      st = order[i]
      keep = min(c, max(plain) * sizes[st]) if adds[i] and plain else c
      costs[st] += keep
      rest += c - keep
    costs[-1] += rest
    # Anything off the compute track.
    costs[-1] += tl.step_s - fill - sum(costs)
  else:
    costs = [(tl.step_s - fill) * g / sum(sizes) for g in sizes]
  needs, tails, sends = steps.needs, steps.tails, steps.sends
  if steps.keep is not None:
    lo, hi = steps.keep
    costs, needs = list(costs[lo:hi]), needs[lo:hi]
    tails, sends = tails[lo:hi], sends[lo:hi]
    if lo > 0:  # it waits for its first step's slots as it begins
      costs, needs = [0.0, *costs], ((), *needs)
      tails = (1.0, *tails) if tails else ()
      sends = (-1, *sends) if sends else ()
  return _timeline.KernelSteps(
    tuple(costs),
    needs,
    steps.blocks,
    tails,
    sends,
    fill,
    steps.halves,
    float(steps.hbm_bytes),
  )
