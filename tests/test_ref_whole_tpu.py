"""The Ref API's two-way ring of whole chunks on compiled TPU HLO.

Ahead of time for two generations (v5e, v6e), the ring forced at the
chapter's shape (``WHOLE_ACC_BYTES = 0``; (B, D, F) = (1024, 2048, 8192) on
a 2x4 mesh, ring of 4, bf16): no defensive (on jax 0.9 one, of a
destination's zeros before its start, which the guard accepts:
``_jax_compat.REF_RING_DESTINATIONS_UNCOPIED``) or in-flight copy, the first
transfers read ``x`` itself, ``2 (n - 1)`` half-chunk permutes, one dot of
its own step in every window, no ``[2 M, k]`` or ``[2, M, k]`` buffer, and
the compiled memory analysis's temporary memory below the former Ref ring
(two ``new_ref(x)``, one piece) and no more than the value ring's.
"""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from asyncops import _jax_compat as jc
from asyncops import collective_matmul as _cm
from asyncops.collective_matmul import _gather_rings
from asyncops.inspect import analyze, check_report, tpu_mesh
from benchmarks._measure import peak_temp_bytes

B, D, F = 1024, 2048, 8192
MESH = (2, 4)
M, K = B // MESH[0], D // MESH[1]  # x per device
MATMUL_OPS = ("fusion", "convolution", "dot")


def _report(topology, api="ref", b=B):
  mesh = tpu_mesh(topology, MESH, ("x", "y"))
  specs = (P("x", "y"), P(None, "y"))
  args = [
    jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=NamedSharding(mesh, sp))
    for s, sp in zip(((b, D), (D, F)), specs, strict=True)
  ]
  body = functools.partial(
    _cm.allgather_matmul,
    axis_name="y",
    api=api,
    bidirectional=True,
    method="ring",
  )
  f = jax.jit(
    jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P("x", "y"))
  )
  return analyze(f, *args)


def _scope(op_name):
  # ".../chunk<s>/ring_step/..." -> ".../chunk<s>"
  head, sep, _ = op_name.partition("/ring_step/")
  return head if sep else None


def _window_dots(r, pair):
  scope = _scope(r.module.instr(pair.start).op_name)
  return [
    i
    for i in pair.between
    if i.opcode in MATMUL_OPS
    and "dot_general" in i.op_name
    and i.op_name.startswith(scope + "/")
  ]


def _producer(r, name):
  """Follows bitcasts, tuples and barriers back from ``name``."""
  i = r.module.instr(name)
  while i.opcode in ("bitcast", "get-tuple-element", "tuple", "opt-barrier"):
    i = r.module.instr(i.operands[0])
  return i


def _assert_destination_init_copy(r):
  """jax 0.9 (``jc.REF_RING_DESTINATIONS_UNCOPIED`` off): the one defensive
  copy is of the zeros broadcast two starts take as their destination's
  initial value, VMEM to VMEM, read only by the start that writes it in
  place, before that start and outside every window: nothing in flight is
  copied, so the guard accepts it (``Copy.feeds_destination``)."""
  (c,) = r.defensive_copies
  assert c.feeds_destination and not c.inflight, c
  assert c.spaces == ("VMEM", "VMEM") and c.nbytes == 2 * (M // 2) * K * 2, c
  assert r.module.instr(c.operand).opcode == "broadcast", c.operand
  pairs = r.pairs_for("asyncops.ppermute")
  assert c.pair[0] in {p.start for p in pairs}, c.pair
  at = r.module.instr(c.name).position
  assert at < r.module.instr(c.pair[0]).position
  for p in pairs:
    start, done = r.module.instr(p.start), r.module.instr(p.done)
    assert not start.position < at < done.position, (c.name, p.start)


@pytest.fixture
def whole(monkeypatch):
  monkeypatch.setattr(_gather_rings, "WHOLE_ACC_BYTES", 0)


@pytest.mark.parametrize("topology", ["v5e:2x4", "v6e:2x4"])
def test_structure(whole, topology):
  r = _report(topology)
  if jc.REF_RING_DESTINATIONS_UNCOPIED:
    r.assert_no_defensive_copies()
  else:
    _assert_destination_init_copy(r)
  check_report(r, f"Ref ring of whole chunks on {topology}")
  assert not r.hazardous_copies, r.hazardous_copies
  # x is read by the local dot while two transfers read it: on v6e XLA
  # prefetches it into VMEM for the dot (512 KiB here), a read-only
  # memory-space move the guard grades "cost"; any other copy of a buffer
  # in flight fails.
  other = [
    c
    for c in r.inflight_copies
    if not (c.kind == "memory_space" and c.grade == "cost")
  ]
  assert not other, other
  n = MESH[1]
  pairs = r.pairs_for("asyncops.ppermute")
  assert len(pairs) == 2 * (n - 1), [p.start for p in pairs]
  assert not r.pairs_for("asyncops.bidirectional")
  for p in pairs:
    assert p.source_live and p.dest_live and not p.crossing, p
    start = r.module.instr(p.start)
    assert start.shape_text.startswith(f"(bf16[2,{M // 2},{K}]"), p.start
  # The windows: each of the n - 1 + 1 = 2 (n / 2) transfers' pairs (the
  # two directions of a piece share a window) holds one dot of its step.
  windows = {}
  for p in pairs:
    dots = _window_dots(r, p)
    assert dots, f"%{p.start}: no dot of its own step in the window"
    windows.setdefault(frozenset(i.name for i in dots), []).append(p.start)
  assert all(len(d) == 1 for d in windows), list(windows)
  assert len(windows) == 2 * (n // 2), windows
  # The first two starts (piece 0, both ways) read x: the parameter
  # itself, or its move into another memory space; no copy of x.
  first = sorted(
    (r.module.instr(p.start) for p in pairs), key=lambda i: i.position
  )
  x0 = _producer(r, first[0].operands[0])
  assert x0.opcode in ("parameter", "copy", "copy-done"), x0.name
  assert x0.shape_text.startswith((f"bf16[{M},{K}]", f"bf16[2,{M // 2},{K}]"))
  built = [
    i.name
    for instrs in r.schedule.values()
    for i in instrs
    if i.shape_text.startswith((f"bf16[{2 * M},{K}]", f"bf16[2,{M},{K}]"))
  ]
  assert not built, built  # no buffer of two copies of x


@pytest.mark.parametrize("topology", ["v5e:2x4", "v6e:2x4"])
def test_peak_memory(whole, topology):
  """Peak temporary memory (the compiled memory analysis, as the benchmark
  tables report it) at 4x the chapter's rows (x [2048, 512] per device,
  where the buffers no longer fit on chip): no more than the value ring's
  of whole chunks (v5e 53.4 MiB, this ring 45.4). The former Ref ring of
  whole chunks (two ``[M, k]`` Refs from ``x``: 48.0 MiB and a defensive
  copy) is gone; with this ring off the Ref API runs its ring of halves."""
  b = 4 * B
  new = peak_temp_bytes(_report(topology, b=b).memory)
  value = peak_temp_bytes(_report(topology, api="value", b=b).memory)
  assert new <= value, (new, value)
