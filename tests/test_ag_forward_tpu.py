"""The fused all-gather's relay (``AgSpec.forward``) on compiled TPU
programs (ahead of time, no TPU) and in the benchmark's timeline model.

The chapter's shape ``(1024, 2048, 8192)`` bf16 on v5e:2x4 and v6e:2x4
(mesh x = 2 by y = 4, the ring of 4 a physical 2x2 cycle), variant
``allgather_matmul_fused_fwd``: four kernels, the start, the local step
(which relays slot 0 at its end), the rest and the done; only the start
and the local kernel start remote DMAs (``has_communication``), so the
program's result is the rest kernel's output as it is (no ``copy`` at
the ROOT, which a forward from the result's kernel costs:
design/benchmarks.md, "Forwarding in the fused all-gather"); the local
step's float32 accumulator goes to the rest kernel in VMEM, not copied;
no defensive copy and no hazard. The model charges the relay: it waits
for slot 0, pays its DMA issues, queues its two sends behind the
start's on the links, and the done waits for them.
"""

import functools

import jax.numpy as jnp
import pytest

from asyncops.inspect import analyze, check_hlo, parse_module
from benchmarks import _chips, _measure, _timeline

SHAPE = (1024, 2048, 8192)
TOPOLOGIES = ("v5e:2x4", "v6e:2x4")


@functools.cache
def _result(topology):
  spec = _measure.Spec(
    "allgather_matmul_fused_fwd", topology, None, SHAPE, jnp.bfloat16
  )
  return _measure.measure(spec)


def _kernels(module):
  return {
    i.name.split(".")[0]: i
    for i in module.entry.instrs
    if i.opcode == "custom-call"
  }


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_relay_kernel_and_no_copy_of_the_result(topology):
  text = _result(topology).text
  m = parse_module(text)
  k = _kernels(m)
  names = (
    "asyncops_ring_allgather_start",
    "ring_allgather_matmul_local",
    "ring_allgather_matmul_rest",
    "asyncops_ring_allgather_done",
  )
  assert set(names) == set(k), sorted(k)
  comm = {n for n, i in k.items() if '"has_communication":true' in i.attrs}
  assert comm == {names[0], names[1]}
  assert "ring_hops_1-3-2_fwd" in k[names[0]].op_name
  # The result: the rest kernel's output, not copied.
  [root] = [i for i in m.entry.instrs if i.is_root]
  assert root.opcode == "get-tuple-element"
  assert root.operands == (k[names[2]].name,)
  assert not [i for i in m.entry.instrs if i.opcode.startswith("copy")]
  # The accumulator: a VMEM output of the local step, the rest's operand.
  acc = k[names[1]].arrays[0]
  assert (acc.dims, acc.dtype, acc.memory_space) == ((512, 2048), "f32", 1)
  gte = [
    i.name
    for i in m.entry.instrs
    if i.opcode == "get-tuple-element" and i.operands == (k[names[1]].name,)
  ]
  assert set(gte) & set(k[names[2]].operands)
  assert analyze(text).defensive_copies == []
  check_hlo(text)


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_model_charges_the_relay(topology):
  tl = _result(topology).timeline
  chip = _chips.chip_for(topology)
  ev = [e for e in tl.events if e.name.startswith("asyncops_ring_allgather")]
  fwd = "ring_allgather_matmul_local"
  sends = [e for e in tl.events if e.name.startswith(fwd) and e.track == "ici"]
  issue = [
    e
    for e in tl.events
    if e.name.startswith(fwd) and e.args.get("op") == _timeline.RELAY_ISSUE_OP
  ]
  assert len(sends) == 2 and len(issue) == 1
  # Two DMAs: issue_s per the start's four sends, two of them.
  assert issue[0].dur == pytest.approx(chip.issue_s / 2)
  # It issues them after its last dot and once slot 0 has landed.
  local = [e for e in tl.events if e.name.startswith(fwd)]
  assert issue[0].start >= max(
    e.start + e.dur for e in local if e.kind == "compute"
  )
  issued = issue[0].start + issue[0].dur
  # Each send leaves after the relay issued it and after the start's
  # sends on its link (two halves of the start's before it).
  [start] = [
    e
    for e in ev
    if e.name.startswith("asyncops_ring_allgather_start") and e.track == "ici"
  ]
  half = 512 * 256 * 2 / chip.ici_link_bytes_per_s
  for e in sends:
    assert e.start >= issued - 1e-12
    assert e.start >= start.start + 2 * half - 1e-9
    assert e.dur >= half
  # The done waits for the relayed halves too.
  done_name = "asyncops_ring_allgather_done"
  [done] = [
    e for e in ev if e.name.startswith(done_name) and e.kind == "overhead"
  ]
  assert done.start >= max(e.start + e.dur for e in sends) - 1e-12
