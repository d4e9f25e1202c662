"""What the harness reports: copies, start/done pairs and their windows.

Example:

  >>> from asyncops.inspect import analyze
  >>> r = analyze('''HloModule m, is_scheduled=true
  ... ENTRY %main (p: f32[8]) -> f32[8] {
  ...   %p = f32[8]{0} parameter(0)
  ...   ROOT %c = f32[8]{0} copy(%p)
  ... }''')
  >>> [c.kind for c in r.copies]
  ['output']
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ._hlo import MEMORY_SPACES, Instr, Module

COPY_KINDS = (
  "defensive",
  "memory_space",
  "layout",
  "output",
  "boundary",
  "scalar",
)

_WHY = {
  "defensive": (
    "copy insertion: XLA saw a buffer aliased by an in-place op while "
    "another user still needed the old value (costs a full read+write)"
  ),
  "memory_space": (
    "a move between memory spaces (e.g. HBM <-> VMEM, or CMEM on v4)"
  ),
  "layout": (
    "a change of layout (a transpose or retiling) that XLA's layout "
    "assignment chose; not copy insertion (costs a full read+write)"
  ),
  "output": "an entry parameter copied into a non-donated output",
  "boundary": (
    "at the program's edge: a start aliases its source, so a parameter the "
    "caller still owns is copied before it is sent (donating it does not "
    "help: a communicating kernel's outputs live in memory XLA allocates); "
    "a received buffer is copied before it is returned, as XLA's own "
    "collective-permute's is (on v4/v5e/v6e the same copies are usually "
    "HBM<->VMEM moves). One read and one write of the buffer per call"
  ),
  "scalar": "a scalar (loop counter or similar); harmless",
}


def _space(n: int | None) -> str:
  if n is None:
    return "tuple"
  return MEMORY_SPACES.get(n, f"S({n})")


@dataclasses.dataclass(frozen=True)
class Copy:
  """One copy in the scheduled HLO.

  Attributes:
    name: instruction name.
    kind: ``defensive``, ``memory_space``, ``layout``, ``output``,
      ``boundary`` or ``scalar`` (``_WHY`` says what each is).
    shape: the result shape text.
    computation: the computation holding the copy.
    operand: the copied instruction.
    spaces: ``(from, to)`` memory spaces, e.g. ``("HBM", "VMEM")``.
    source: user code the copied value comes from, e.g. ``f.py:42 in f``.
    estimated_cycles: the compiler's estimate, when printed.
    inflight: for in-flight copies, which transfer buffer they touch, e.g.
      ``"destination of %start (-> %done)"``; ``""`` otherwise.
    instr: the parsed instruction.
    opcode: ``copy``, ``copy-start``, or the op hiding a whole-buffer copy
      (``fusion``, ``dynamic-update-slice``).
    output_index: which output of a multi-output fusion is the copy.
    pair: ``(start, done)`` instruction names of the transfer whose buffer
      the copy touches (``done`` is ``""`` when only the start is known);
      empty for copies of other buffers.
    grade: what an in-flight copy can break: ``"hazard"`` (it reads or
      replaces a destination the DMA is writing, or reads a source whose
      buffer XLA may free or reuse before the done: wrong results),
      ``"cost"`` (it only reads a source that stays live until the done:
      right values, extra memory traffic) or ``""`` (not in flight).
    nbytes: bytes of the copied buffer; the copy reads and writes that
      many each time its computation runs (once per call in the entry
      computation, once per trip in a loop body).
    read_only_source: an in-flight copy the guard accepts: a move between
      memory spaces that only reads the source of the transfers in flight
      around it, which stays the operand each of their dones waits on
      (``_analysis._read_only_source`` has the conditions,
      ``design/inspect.md`` the argument).
    feeds_source: a copy not in flight whose result *is* the source a
      library start then sends (scheduled before the start, in its
      computation): copy insertion giving the start a buffer of its own,
      because the start aliases its operand and the value copied is used
      again (a loop-carried residual, a donated parameter, a remat
      constant). Costs a copy; endangers no transfer (the guard accepts
      it; ``_analysis._feeds_start``, ``design/inspect.md``).
    feeds_destination: a copy not in flight whose result *is* the
      destination buffer a Ref-API start then writes in place (scheduled
      before the start, in its computation, read by nothing else): copy
      insertion giving the destination Ref its initial value in a buffer
      of its own, because that value is also another value's buffer (the
      source's, when ``new_ref(v)`` makes both and XLA's CSE makes them one
      ``v``, or a value read again after the start). Costs a copy;
      endangers no transfer (the guard accepts it;
      ``_analysis._feeds_start``, ``design/inspect.md``, h-guardfp).
  """

  name: str
  kind: str
  shape: str
  computation: str
  operand: str
  spaces: tuple[str, str]
  source: str
  estimated_cycles: float | None
  inflight: str
  instr: Instr = dataclasses.field(repr=False, compare=False)
  opcode: str = "copy"
  output_index: tuple[int, ...] = ()
  pair: tuple[str, str] | tuple[()] = ()
  grade: str = ""
  read_only_source: bool = False
  nbytes: int = 0
  feeds_source: bool = False
  feeds_destination: bool = False


@dataclasses.dataclass(frozen=True)
class Pair:
  """An asynchronous start matched with its done.

  Attributes:
    start: start instruction name.
    done: done instruction name.
    kind: ``"kernel"`` (a custom call returning semaphores) or ``"xla"``
      (an XLA ``*-start``/``*-done`` op such as ``copy-start``).
    kernel: the start's label (named scopes and op name), e.g.
      ``asyncops.ppermute_start/pallas_call``.
    done_kernel: the done's label.
    computation: the start's computation.
    done_computation: the done's computation.
    crossing: loop/call boundaries the future crosses from start to done,
      e.g. ``("next iteration of %while.3",)``; empty when both are in the
      same straight-line computation.
    between: the instructions the schedule places between start and done.
    between_cycles: the sum of their estimated cycles.
    overlapped: whether real compute (a fusion, convolution, dot, other
      custom call or non-scalar arithmetic) sits in the window.
    source_live: whether the start's source buffer reaches the done (via
      aliasing, tuples and loop carries, without a copy; a source a loop
      body passes through unchanged is the loop operand's buffer), so XLA
      cannot free or reuse it while the transfer reads it.
    dest_live: the same for the destination buffer.
    start_source: user code of the start.
    done_source: user code of the done.
    inplace_writes: instructions inside the window that write in place
      into the transfer's source or destination buffer (the DMA reads or
      writes it concurrently), each as ``"%name (opcode) writes into the
      source"``.
  """

  start: str
  done: str
  kind: str
  kernel: str
  done_kernel: str
  computation: str
  done_computation: str
  crossing: tuple[str, ...]
  between: tuple[Instr, ...] = dataclasses.field(repr=False)
  between_cycles: float
  overlapped: bool
  source_live: bool
  dest_live: bool
  start_source: str = ""
  done_source: str = ""
  inplace_writes: tuple[str, ...] = ()

  @property
  def loop_carried(self) -> bool:
    return bool(self.crossing)


@dataclasses.dataclass(frozen=True)
class Report:
  """The harness's findings for one compiled program.

  Attributes:
    hlo_text: the scheduled HLO text.
    compile_seconds: lowering + compile time (0 for given text).
    memory: ``compiled.memory_analysis()`` fields (empty for text).
    module: the parsed module.
    copies: every whole-buffer copy (``copy``, ``copy-start``, and
      fusions or dynamic-update-slices that only move one operand),
      classified.
    pairs: every start matched with each done it reaches.
    starts: start instructions found.
    dones: done instructions found.
    schedule: per computation, its instructions in scheduled order.
    unawaited_branches: ``(start, "branch K of %conditional")`` for each
      branch of a conditional the start's semaphores enter on which no done
      waits for them (the DMA runs on with its buffers dead to XLA).
    unawaited_semaphores: ``(start, output index)`` for each DMA semaphore
      of an awaited start that reaches no done (a ``send_done`` with no
      ``recv_done``: the receive is never waited for).
  """

  hlo_text: str = dataclasses.field(repr=False)
  compile_seconds: float
  memory: dict[str, Any]
  module: Module = dataclasses.field(repr=False)
  copies: tuple[Copy, ...]
  pairs: tuple[Pair, ...]
  starts: tuple[Instr, ...]
  dones: tuple[Instr, ...]
  schedule: dict[str, tuple[Instr, ...]] = dataclasses.field(repr=False)
  unawaited_branches: tuple[tuple[str, str], ...] = ()
  unawaited_semaphores: tuple[tuple[str, tuple[int, ...]], ...] = ()

  @property
  def defensive_copies(self) -> list[Copy]:
    return [c for c in self.copies if c.kind == "defensive"]

  @property
  def inflight_copies(self) -> list[Copy]:
    return [c for c in self.copies if c.inflight]

  @property
  def boundary_copies(self) -> list[Copy]:
    """Copies at the program's edge (see ``COPY_KINDS``): a parameter into
    a communicating kernel's buffer, or such a buffer into an output."""
    return [c for c in self.copies if c.kind == "boundary"]

  def copied_bytes(self, kind: str | None = None) -> int:
    """Bytes copied (each read once and written once) by the copies of
    ``kind`` (all kinds when None), counting each copy once.

    Example: ``report.copied_bytes("boundary")`` is what the program's
    edge costs per call (8 MiB for the README's ``overlap`` step on
    ``v5p:2x2x2``, f32[1024,1024] per device: a parameter in, a result
    out).
    """
    if kind is not None and kind not in COPY_KINDS:
      raise ValueError(
        f"copied_bytes(kind={kind!r}): not a copy kind; choose from "
        f"{', '.join(COPY_KINDS)} or None"
      )
    return sum(c.nbytes for c in self.copies if kind in (None, c.kind))

  @property
  def hazardous_copies(self) -> list[Copy]:
    """In-flight copies that can give wrong results (``grade="hazard"``)."""
    return [c for c in self.copies if c.grade == "hazard"]

  @property
  def unawaited_starts(self) -> list[Instr]:
    """Kernel starts that reach no done: their DMA is never waited for."""
    paired = {p.start for p in self.pairs}
    return [
      s
      for s in self.starts
      if s.name not in paired and s.opcode == "custom-call"
    ]

  @property
  def kernel_pairs(self) -> list[Pair]:
    return [p for p in self.pairs if p.kind == "kernel"]

  def pairs_for(self, op: str | None = None) -> list[Pair]:
    """Kernel pairs whose start label or op name contains ``op``."""
    out = []
    for p in self.kernel_pairs:
      start = self.module.instr(p.start)
      if op is None or op in p.kernel or op in start.op_name:
        out.append(p)
    return out

  def assert_no_defensive_copies(self) -> None:
    """Raises AssertionError listing defensive copies, if any."""
    if self.defensive_copies:
      raise AssertionError(
        "defensive copies found:\n"
        + "\n".join(_copy_line(c) for c in self.defensive_copies)
      )

  def assert_no_inflight_copies(self) -> None:
    """Raises AssertionError listing copies of in-flight buffers, if any."""
    if self.inflight_copies:
      raise AssertionError(
        "copies of buffers that a transfer is reading or writing:\n"
        + "\n".join(_copy_line(c) for c in self.inflight_copies)
      )

  def assert_no_hazards(self) -> None:
    """Raises AssertionError on what can corrupt data: a copy graded
    ``hazard`` or a start with no done (read-only copies of a live source
    only cost time and pass)."""
    lines = [_copy_line(c) for c in self.hazardous_copies]
    lines += [_orphan_line(s) for s in self.unawaited_starts]
    lines += [f"  %{s} has no done on {b}" for s, b in self.unawaited_branches]
    lines += [
      f"  %{s} has no done for its semaphore {{{','.join(map(str, i))}}}"
      for s, i in self.unawaited_semaphores
    ]
    if lines:
      raise AssertionError("hazards found:\n" + "\n".join(lines))

  def assert_all_awaited(self) -> None:
    """Raises AssertionError listing kernel starts that reach no done."""
    if self.unawaited_starts:
      raise AssertionError(
        "starts with no done:\n"
        + "\n".join(_orphan_line(s) for s in self.unawaited_starts)
      )

  def assert_overlapped(self, min_pairs: int = 1, op: str | None = None):
    """Asserts every (matching) kernel pair has compute in its window.

    Args:
      min_pairs: at least this many kernel pairs must match.
      op: substring of the start's label/op name (e.g.
        ``"asyncops.ppermute_start"``); None for all kernel pairs.

    Raises:
      AssertionError: too few pairs, or a pair with an empty window.
    """
    pairs = self.pairs_for(op)
    if len(pairs) < min_pairs:
      raise AssertionError(
        f"expected >= {min_pairs} start/done pairs matching {op!r}, "
        f"found {len(pairs)}"
      )
    bad = [p for p in pairs if not p.overlapped]
    if bad:
      raise AssertionError(
        "no compute between start and done:\n"
        + "\n".join(_pair_line(p) for p in bad)
      )

  def summary(self) -> str:
    """A readable report: copies and why they matter, pairs, memory."""
    return _summary(self)

  def __str__(self) -> str:
    return self.summary()


def mib(nbytes: int) -> str:
  """``nbytes`` for people: ``"4 MiB"``, ``"1.5 KiB"``, ``"12 B"``."""
  for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
    if nbytes >= size:
      return f"{nbytes / size:.4g} {unit}"
  return f"{nbytes} B"


def _copy_line(c: Copy) -> str:
  where = f" from {c.source}" if c.source else ""
  op = "" if c.opcode in ("copy", "copy-start") else f"{c.opcode} "
  out = "{" + ",".join(map(str, c.output_index)) + "}" if c.output_index else ""
  line = (
    f"  %{c.name}{out} [{c.kind}] {c.shape} ({mib(c.nbytes)}) "
    f"{c.spaces[0]}->{c.spaces[1]} "
    f"{op}copy of %{c.operand}{where} (in %{c.computation})"
  )
  if c.inflight:
    tag = "HAZARD" if c.grade == "hazard" else "COST"
    line += f"\n      IN FLIGHT ({tag}): {c.inflight}"
  return line


def _orphan_line(s: Instr) -> str:
  where = f" from {s.where}" if s.where else ""
  return f"  %{s.name} ({_label(s)}){where}: NO DONE"


def _label(i: Instr) -> str:
  parts = [
    p
    for p in i.op_name.split("/")
    if p and not p.startswith("jit(") and p not in ("shard_map",)
  ]
  return "/".join(parts) or i.opcode


def _pair_line(p: Pair) -> str:
  where = ", ".join(p.crossing) if p.crossing else "same computation"
  return f"  %{p.start} ({p.kernel}) -> %{p.done} ({p.done_kernel}) [{where}]"


def _summary(r: Report) -> str:
  out = [f"HLO module {r.module.name}"]
  if r.compile_seconds:
    out[0] += f" (compiled in {r.compile_seconds:.2f}s)"
  counts = {k: 0 for k in COPY_KINDS}
  for c in r.copies:
    counts[c.kind] += 1
  out.append(
    "Copies: "
    + ", ".join(
      f"{n} {k}"
      + (f" ({mib(r.copied_bytes(k))})" if n and k != "scalar" else "")
      for k, n in counts.items()
    )
    + f"; {len(r.inflight_copies)} of in-flight buffers "
    f"({len(r.hazardous_copies)} hazards)"
  )
  edge = r.boundary_copies
  if edge:
    n = r.copied_bytes("boundary")
    out.append(
      f"Boundary copies: {len(edge)}, {mib(n)} read and {mib(n)} written "
      "per call at the program's edge (TPU XLA keeps a communicating "
      "kernel's buffers in memory it allocates; send a computed value and "
      "return one to avoid them: design/scheduling.md section 4)"
    )
  for c in r.copies:
    if c.kind == "scalar":
      continue
    out.append(_copy_line(c))
    out.append(f"      why: {_WHY[c.kind]}")
    if c.grade == "hazard":
      out.append(
        "      DANGER: the copy reads or replaces a buffer the DMA is "
        "writing, or the source buffer may be freed before the DMA has "
        "read it -> wrong results"
      )
    elif c.feeds_source:
      out.append(
        "      cost only: copy insertion gives the start a buffer of its own "
        "before it sends it; no transfer is in flight on it"
      )
    elif c.feeds_destination:
      out.append(
        "      cost only: copy insertion makes the destination buffer the "
        "start then writes in place, holding the Ref's initial value (that "
        "value is another value's buffer too, e.g. the source's); no "
        "transfer is in flight on it"
      )
    elif c.grade == "cost":
      out.append(
        "      cost only: a read-only copy of a source that stays live "
        "until the done; values are right, the copy costs memory traffic"
      )
  kp = r.kernel_pairs
  out.append(
    f"Start/done pairs: {len(kp)} kernel, {len(r.pairs) - len(kp)} XLA async"
  )
  orphans = r.unawaited_starts
  if orphans:
    out.append(
      f"Starts with no done: {len(orphans)} (DANGER: the DMA is never "
      "waited for; its buffers may be reused while it runs)"
    )
    out.extend(_orphan_line(s) for s in orphans)
  if r.unawaited_branches:
    out.append(
      f"Branches with no done: {len(r.unawaited_branches)} (DANGER: on "
      "that branch the DMA is never waited for)"
    )
    out.extend(f"  %{s}: {b}" for s, b in r.unawaited_branches)
  if r.unawaited_semaphores:
    out.append(
      f"Semaphores with no done: {len(r.unawaited_semaphores)} (DANGER: "
      "that part of the transfer is never waited for)"
    )
    out.extend(
      f"  %{s}: output {{{','.join(map(str, i))}}}"
      for s, i in r.unawaited_semaphores
    )
  for p in r.pairs:
    out.append(_pair_line(p))
    if p.start_source or p.done_source:
      out.append(f"      start at {p.start_source}; done at {p.done_source}")
    ops = [
      i
      for i in p.between
      if i.opcode
      not in ("get-tuple-element", "tuple", "bitcast", "parameter", "constant")
    ]
    names = ", ".join(f"%{i.name}:{i.opcode}" for i in ops[:8])
    if len(ops) > 8:
      names += f", ... (+{len(ops) - 8})"
    out.append(
      f"      window: {len(p.between)} ops, {p.between_cycles:.0f} est. "
      f"cycles, overlapped={p.overlapped}" + (f": {names}" if names else "")
    )
    if p.kind == "kernel":
      live = "yes" if p.source_live else "NO (XLA may free/reuse it early)"
      out.append(f"      source buffer live until done: {live}")
    for w in p.inplace_writes:
      out.append(f"      IN-PLACE WRITE while in flight: {w}")
  if r.memory:
    keys = [k for k in r.memory if r.memory[k]]
    out.append(
      "Memory: " + ", ".join(f"{k}={r.memory[k]}" for k in keys)
      if keys
      else "Memory: all zero"
    )
  return "\n".join(out)
