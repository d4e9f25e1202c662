"""The one in-flight copy the guard accepts, and its unsafe neighbours.

XLA's memory-space assignment may prefetch a transfer's *source* into
VMEM while the DMA still reads it (a read beside a read). The guard
accepts exactly that (``Copy.read_only_source``, conditions in
``_analysis._read_only_source``, the argument in ``design/inspect.md``):
here the two-way Ref ring of halves with a bfloat16 accumulator, where XLA
prefetches each received half while it is sent on (v5e and v5p, compiled
ahead of time). Its neighbours stay refused: the same program with the
copy reading the destination, with the done waiting on the copy, or with
the source no longer an operand of the done (edits of the compiled HLO),
and compiled programs whose memory-space copies in flight read a
destination or a source XLA may free.
"""

import functools
import re

import pytest

from asyncops.collective_matmul import _gather_rings
from asyncops.inspect import CopyHazardError, hazards
from asyncops.inspect._analysis import analyze_module
from asyncops.inspect._guard import check_report
from asyncops.inspect._hlo import parse_module
from tests import test_guard_adversarial as adversarial
from tests.test_accumulation_tpu import _report

TOPOLOGIES = ("v5e:2x4", "v5p:2x2x2")


@functools.cache
def _ring_text(topology: str) -> str:
  """The two-way Ref ring with bfloat16 accumulators (what
  ``accumulation="output"`` would give it; ``contracting`` keeps float32
  for it because the guard refused this copy)."""
  keep = _gather_rings.accumulator_dtype
  _gather_rings.accumulator_dtype = lambda dtype, accumulation="": dtype
  try:
    return _report(topology, "float32", True, "ref").hlo_text
  finally:
    _gather_rings.accumulator_dtype = keep


def _analyze(text):
  return analyze_module(parse_module(text), text)


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_prefetch_of_a_source_in_flight_is_accepted(topology):
  r = _analyze(_ring_text(topology))
  copies = r.inflight_copies
  assert copies, "XLA no longer prefetches a half in flight"
  for c in copies:
    assert c.read_only_source and c.grade == "cost", c
    assert c.opcode == "copy-start" and c.spaces == ("HBM", "VMEM")
    assert c.inflight.startswith("source of %asyncops_ppermute_ref_start")
  assert hazards(r) == []
  check_report(r)  # the guard passes it


def _edit(text: str, name: str, old: str, new: str) -> str:
  """``text`` with operand ``%old`` of instruction ``%name`` made ``%new``."""
  line = re.search(rf"^\s*%{re.escape(name)} = .*$", text, re.M).group(0)
  edited = re.sub(rf"%{re.escape(old)}\b", f"%{new}", line, count=1)
  assert edited != line
  return text.replace(line, edited)


def _neighbour(topology: str, case: str) -> str:
  """The ring's HLO with one read-only prefetch made unsafe."""
  text = _ring_text(topology)
  r = _analyze(text)
  c = r.inflight_copies[0]
  start, done = (r.module.instr(n) for n in c.pair)
  dst = next(
    u.name
    for c2 in r.module.computations.values()
    for u in c2.instrs
    if u.opcode == "get-tuple-element"
    and u.operands == (start.name,)
    and u.tuple_index == 0
  )  # the Ref start's output {0}: the destination it aliases
  if case == "copy of the destination":
    return _edit(text, c.name, c.operand, dst)
  copy_done = next(
    u.name
    for comp in r.module.computations.values()
    for u in comp.instrs
    if u.opcode == "copy-done" and u.operands == (c.name,)
  )
  if case == "done waits on the copy":
    return _edit(text, done.name, c.operand, copy_done)
  assert case == "source not an operand of the done"
  return _edit(text, done.name, c.operand, dst)


NEIGHBOURS = (
  "copy of the destination",
  "done waits on the copy",
  "source not an operand of the done",
)


@pytest.mark.parametrize("case", NEIGHBOURS)
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_unsafe_neighbours_are_refused(topology, case):
  r = _analyze(_neighbour(topology, case))
  assert not all(c.read_only_source for c in r.inflight_copies)
  kinds = {h.kind for h in hazards(r)}
  assert "in-flight copy" in kinds, kinds
  if case == "source not an operand of the done":
    assert "source not live" in kinds, kinds
  with pytest.raises(CopyHazardError):
    check_report(r)


@pytest.mark.parametrize("topology", ("v5e:2x4", "v6e:2x4"))
def test_memory_space_copies_of_a_destination_or_a_dying_source(topology):
  # Compiled with the library's starts at 4096 x 4096 f32: XLA moves both
  # buffers of a transfer in flight between HBM and VMEM across the back
  # edge of a raw while loop (the source not live, and the destination).
  shard = adversarial.SHARD
  adversarial.SHARD = (4096, 4096)
  try:
    f, x = adversarial._compile(adversarial.while_traced_count, topology)
  finally:
    adversarial.SHARD = shard
  r = adversarial.analyze(f, x)
  moved = [c for c in r.inflight_copies if c.kind == "memory_space"]
  roles = {c.inflight.split(" ")[0] for c in moved}
  assert roles == {"source", "destination"}, roles
  assert not any(c.read_only_source for c in moved)
  assert any(not p.source_live for p in r.kernel_pairs)
  with pytest.raises(CopyHazardError, match="in-flight copy"):
    check_report(r)
