"""The collective matmuls on compiled TPU HLO (ahead of time, no TPU).

For every variant, direction and topology, at the chapter's shape
(B, D, F) = (1024, 2048, 8192): no defensive copies, no copy of a buffer a
transfer is reading or writing, and every ring transfer has the chunk
matmul of its own step (a ``convolution`` fusion traced from the same
``chunk<s>`` scope) scheduled between its start and its done.
"""

import functools
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from asyncops import _jax_compat as jc
from asyncops import collective_matmul as _cm
from asyncops.inspect import analyze, tpu_mesh
from asyncops.testing import assert_copy_free

# These tests are about the rings (value and Ref APIs): method="ring".
# The default, method="auto", may run the fused kernel or XLA's
# collective instead (tests/test_fused_matmul*.py, test_auto_default).
allgather_matmul = functools.partial(_cm.allgather_matmul, method="ring")
matmul_allreduce = functools.partial(_cm.matmul_allreduce, method="ring")
matmul_reducescatter = functools.partial(
  _cm.matmul_reducescatter, method="ring"
)
mlp_block = functools.partial(_cm.mlp_block, method="ring")

B, D, F = 1024, 2048, 8192
TOPOLOGIES = {
  "v5e:2x4": (2, 4),
  "v4:2x2x1": (2, 4),
  "v6e:2x4": (2, 4),
}
# variant -> (fn, global operand shapes, in_specs, out_specs, matmuls that
# ring: how many chunk matmuls per direction sit in a window).
VARIANTS = {
  "allgather": (
    allgather_matmul,
    ((B, D), (D, F)),
    (P("x", "y"), P(None, "y")),
    P("x", "y"),
  ),
  "reducescatter": (
    matmul_reducescatter,
    ((B, F), (F, D)),
    (P("x", "y"), P("y", None)),
    P("x", "y"),
  ),
  "allreduce": (
    matmul_allreduce,
    ((B, F), (F, D)),
    (P("x", "y"), P("y", None)),
    P("x", None),
  ),
  "mlp": (
    mlp_block,
    ((B, D), (D, F), (F, D)),
    (P("x", "y"), P(None, "y"), P("y", None)),
    P("x", "y"),
  ),
}
# Ring stages per variant: mlp has an up and a down ring.
STAGES = {"allgather": 1, "reducescatter": 1, "allreduce": 1, "mlp": 2}
MATMUL_OPS = ("fusion", "convolution", "dot")
# Transfer kernels per bidirectional value-API ring step, summed over the
# stages: every ring moves both halves with one bidirectional_start kernel.
BIDI_KERNELS = {"allgather": 1, "reducescatter": 1, "allreduce": 1, "mlp": 2}
_SCOPE = re.compile(r"^(.*/chunk\d+)/ring_step/")


def _report(topology, variant, bidirectional, dtype=jnp.bfloat16, api="value"):
  fn, shapes, in_specs, out_spec = VARIANTS[variant]
  mesh = tpu_mesh(topology, TOPOLOGIES[topology], ("x", "y"))
  args = [
    jax.ShapeDtypeStruct(s, dtype, sharding=NamedSharding(mesh, spec))
    for s, spec in zip(shapes, in_specs, strict=True)
  ]
  f = jax.jit(
    jax.shard_map(
      functools.partial(
        fn, axis_name="y", bidirectional=bidirectional, api=api
      ),
      mesh=mesh,
      in_specs=in_specs,
      out_specs=out_spec,
    )
  )
  return analyze(f, *args)


def chunk_scope(op_name: str) -> str | None:
  """``.../chunk<s>`` of an instruction traced inside a ring step."""
  m = _SCOPE.match(op_name)
  return m.group(1) if m else None


def window_matmuls(pair) -> list:
  """The chunk matmuls of the pair's own step inside its window."""
  scope = chunk_scope(pair.start_instr.op_name)
  return [
    i
    for i in pair.between
    if i.opcode in MATMUL_OPS
    and "dot_general" in i.op_name
    and chunk_scope(i.op_name) == scope
  ]


class _P:
  """A pair with its start instruction resolved."""

  def __init__(self, report, pair):
    self.pair = pair
    self.start_instr = report.module.instr(pair.start)
    self.between = pair.between


def check_overlap(
  report, n: int, directions: int, stages: int, kernels: int | None = None
):
  """Every transfer hides the chunk matmul(s) of its own step.

  ``directions`` chunk matmuls per window; ``kernels`` transfer kernels per
  ring step summed over the stages (default ``stages * directions``: one
  permute per direction; a bidirectional kernel moves both halves).
  """
  assert_copy_free(report)
  kernels = stages * directions if kernels is None else kernels
  pairs = report.pairs_for("asyncops.ppermute") + report.pairs_for(
    "asyncops.bidirectional"
  )  # value or ref kernels
  assert len(pairs) == kernels * (n - 1), [p.start for p in pairs]
  for p in pairs:
    assert p.source_live and p.dest_live, p
    assert not p.crossing, p  # unrolled: start and done in one computation
    mm = window_matmuls(_P(report, p))
    # A bidirectional step computes one matmul per direction, both
    # between the two starts and the two dones.
    assert len(mm) == directions, (
      f"%{p.start}: expected {directions} chunk matmul(s) of its own step "
      f"in the window, found {[i.name for i in mm]}"
    )
  # And every ring-step matmul sits inside some window.
  inside = {i.name for p in pairs for i in window_matmuls(_P(report, p))}
  ring_mm = [
    i
    for instrs in report.schedule.values()
    for i in instrs
    if i.opcode in MATMUL_OPS
    and "dot_general" in i.op_name
    and chunk_scope(i.op_name)
    and not i.computation.startswith("fused")
  ]
  assert ring_mm and {i.name for i in ring_mm} <= inside


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_every_chunk_overlaps(topology, variant, bidirectional):
  r = _report(topology, variant, bidirectional)
  n = TOPOLOGIES[topology][1]
  kernels = BIDI_KERNELS[variant] if bidirectional else None
  check_overlap(r, n, 2 if bidirectional else 1, STAGES[variant], kernels)
  if bidirectional:
    # One bidirectional_start per step (not two ppermutes).
    assert not r.pairs_for("asyncops.ppermute")
  if bidirectional and variant == "allgather":
    # The two halves are never concatenated (written in place).
    assert "concatenate" not in _opcodes(r)


def _opcodes(report) -> set[str]:
  return {i.opcode for instrs in report.schedule.values() for i in instrs}


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("variant", ["allgather", "reducescatter"])
def test_ref_api_overlaps_v5e(variant, bidirectional):
  r = _report("v5e:2x4", variant, bidirectional, api="ref")
  check_overlap(r, 4, 2 if bidirectional else 1, 1)
  ops = [i for instrs in r.schedule.values() for i in instrs]
  # Two ping-pong Refs per buffer: no stacked [2, ...] double buffer is
  # built, and the all-gather's halves accumulate in place (no concat).
  assert not [i.name for i in ops if i.op_name.endswith("/stack")]
  if variant == "allgather":
    assert "concatenate" not in _opcodes(r)


def test_float32_chapter_shape_v5e():
  r = _report("v5e:2x4", "allgather", False, jnp.float32)
  check_overlap(r, 4, 1, 1)


def test_check_catches_a_matmul_outside_the_window():
  """The checker fails on the chapter's plain ppermute version.

  Without barriers nothing ties XLA's collective-permute to a matmul, and
  our check must notice that there is no asyncops transfer hiding it.
  """
  mesh = tpu_mesh("v5e:2x4", (2, 4), ("x", "y"))

  def naive(a, w):
    # start, done, then the matmul: an empty window.
    from asyncops.futures import _api as fut

    k = a.shape[1]
    acc = jnp.zeros((a.shape[0], w.shape[1]), jnp.float32)
    cur = a
    me = jax.lax.axis_index("y")
    for s in range(3):
      with jax.named_scope(f"chunk{s}"), jax.named_scope("ring_step"):
        nxt, f = fut.ppermute_start(cur, "y", shift=-1)
        nxt = fut.ppermute_done(f)
        rows = jax.lax.dynamic_slice_in_dim(w, ((me + s) % 4) * k, k)
        acc = acc + jnp.dot(nxt, rows, preferred_element_type=jnp.float32)
        cur = nxt
    return acc.astype(a.dtype)

  args = [
    jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=NamedSharding(mesh, spec))
    for s, spec in zip(
      ((B, D), (D, F)), (P("x", "y"), P(None, "y")), strict=True
    )
  ]
  f = jax.jit(
    jax.shard_map(
      naive,
      mesh=mesh,
      in_specs=(P("x", "y"), P(None, "y")),
      out_specs=P("x", "y"),
    )
  )
  r = analyze(f, *args)
  r.assert_no_defensive_copies()  # clean, yet nothing overlaps:
  with pytest.raises(AssertionError, match="chunk matmul"):
    check_overlap(r, 4, 1, 1)


@pytest.mark.parametrize("topology", ["v5e:2x4", "v6e:2x4"])
def test_two_way_whole_chunks_overlap(monkeypatch, topology):
  """The long-prefill two-way ring (whole chunks both ways, forced at the
  chapter shape), value API, in two row pieces: no copies, ``n``
  bidirectional transfers on a ring of ``n`` (``n / 2`` steps of two
  pieces), and each window holds one dot, of its own step's chunk scope
  (the local chunk, then each piece's stacked pair). The first two
  transfers send ``x`` itself (the second its alias through the first):
  no instruction builds a buffer of two copies of ``x`` (``[2 M, k]``)."""
  from asyncops.collective_matmul import _gather_rings

  monkeypatch.setattr(_gather_rings, "WHOLE_ACC_BYTES", 0)
  r = _report(topology, "allgather", True)
  assert_copy_free(r)
  n = TOPOLOGIES[topology][1]
  pairs = r.pairs_for("asyncops.bidirectional")
  assert len(pairs) == n and not r.pairs_for("asyncops.ppermute")
  m, k = B // TOPOLOGIES[topology][0], D // n  # x per device
  starts = []
  for p in pairs:
    assert p.source_live and p.dest_live, p
    assert len(window_matmuls(_P(r, p))) == 1, p.start
    start = _P(r, p).start_instr
    starts.append(start)
    src = r.module.instr(start.operands[0]).shape_text
    assert src.startswith(f"bf16[{m},{k}]"), (p.start, src)
    assert start.shape_text.startswith(f"(bf16[{m},{k}]"), p.start
  # x itself: a parameter (or its move to another memory space), then the
  # first start's aliased output.
  first, second = sorted(starts, key=lambda i: i.position)[:2]
  x0 = r.module.instr(first.operands[0])
  assert x0.opcode in ("parameter", "copy"), x0.name
  gte = r.module.instr(second.operands[0])
  while gte.opcode in ("get-tuple-element", "tuple", "opt-barrier"):
    if gte.opcode == "get-tuple-element" and gte.operands[0] == first.name:
      break
    gte = r.module.instr(gte.operands[0])
  assert gte.opcode == "get-tuple-element", gte.name
  assert "concatenate" not in _opcodes(r)
  two = f"bf16[{2 * m},{k}]"
  built = [
    i.name
    for instrs in r.schedule.values()
    for i in instrs
    if i.shape_text.startswith(two)
  ]
  assert not built, built  # no [2 M, k] copy of x (the old broadcast)


@pytest.mark.parametrize("topology", ["v5e:2x4", "v6e:2x4"])
def test_two_way_whole_chunks_backward_copy_free(monkeypatch, topology):
  """``jit(grad)`` through the long-prefill two-way ring (forced at the
  chapter shape, bf16): the backward keeps ``x`` as the forward's last
  transfer of it returned it (no copy of the buffer the first transfer
  aliased), nothing in flight is copied, and every pair overlaps (on jax
  0.9 all but the forward's second transfer:
  ``_jax_compat.ALL_WINDOWS_KEPT``)."""
  from asyncops.collective_matmul import _gather_rings

  monkeypatch.setattr(_gather_rings, "WHOLE_ACC_BYTES", 0)
  mesh = tpu_mesh(topology, TOPOLOGIES[topology], ("x", "y"))

  def loss(x, w):
    y = allgather_matmul(x * 2, w, "y", bidirectional=True)  # computed x
    return jax.lax.psum(jnp.sum(jnp.sin(y.astype(jnp.float32))), ("x", "y"))

  f = jax.shard_map(
    loss, mesh=mesh, in_specs=(P("x", "y"), P(None, "y")), out_specs=P()
  )
  args = (
    jax.ShapeDtypeStruct((B, D), jnp.bfloat16),
    jax.ShapeDtypeStruct((D, F), jnp.bfloat16),
  )
  r = analyze(jax.jit(jax.grad(f, (0, 1))), *args)
  r.assert_no_defensive_copies()
  r.assert_no_inflight_copies()
  n = TOPOLOGIES[topology][1]
  ring = r.pairs_for("asyncops.bidirectional")
  assert len(ring) >= n  # forward's n
  lonely = [p.start for p in r.pairs if not p.overlapped]
  if jc.ALL_WINDOWS_KEPT:
    assert r.pairs and not lonely, lonely
  else:
    # jax 0.9's libtpu: the forward's second transfer (piece 1's first)
    # exposed, every other pair overlapped (_jax_compat).
    fwd = [p.start for p in ring if "transpose(" not in p.kernel]
    assert lonely == [fwd[1]], (lonely, fwd)


@pytest.mark.parametrize(
  "topology, panels",
  [("v5p:2x2x2", 1), ("v5e:2x4", 2), ("v6e:2x4", 2), ("v5e:2x4", 1)],
)
def test_two_way_whole_chunks_antipode_reads_its_own_rows(
  monkeypatch, topology, panels
):
  """The long-prefill two-way ring's antipode (forced at the chapter
  shape, ``n`` = 4: step 2): in row panels, or in one on the chips of
  ``_gather_rings.ONE_PANEL_SLICED`` (v5p), each of its half-row dots
  reads the antipode's rows of ``w`` as an operand of their own (``[k,
  f]``, sliced once up front), with no ``dynamic-slice`` inside the dot's
  fusion. Sliced inside it (with the accumulator's read and the output's
  write) XLA tiled those dots far below the MXU's rate. v5e and v6e in
  one panel keep the slice inside (there the separate slice cost more)."""
  from asyncops.collective_matmul import _gather_rings

  monkeypatch.setattr(_gather_rings, "WHOLE_ACC_BYTES", 0)
  monkeypatch.setattr(_gather_rings, "whole_panels", lambda *a: panels)
  monkeypatch.setitem(TOPOLOGIES, "v5p:2x2x2", (2, 4))
  r = _report(topology, "allgather", True)
  assert_copy_free(r)
  n = TOPOLOGIES[topology][1]
  k, f = D // n, F // n

  def inside(i):  # i and every instruction of its (nested) fusions
    out = [i]
    for c in i.called if i.opcode == "fusion" else ():
      for j in r.module.computations[c].instrs:
        out += inside(j)
    return out

  entry = r.module.computations[r.module.entry_name].instrs
  dots = [
    (i, inside(i))
    for i in entry
    if i.opcode in MATMUL_OPS
    and "dot_general" in i.op_name
    and f"/chunk{n // 2}/" in i.op_name
  ]
  dots = [(i, a) for i, a in dots if any(j.opcode == "convolution" for j in a)]
  assert len(dots) == 2 * panels, [i.name for i, _ in dots]  # one a piece
  up_front = panels > 1 or topology[:3] in _gather_rings.ONE_PANEL_SLICED
  for d, a in dots:
    sliced = [i.name for i in a if i.opcode == "dynamic-slice"]
    assert bool(sliced) != up_front, (d.name, sliced)
    if not up_front:
      continue
    shapes = [r.module.instr(o).shape_text for o in d.operands]
    assert any(s.startswith(f"bf16[{k},{f}]") for s in shapes), (
      d.name,
      shapes,
    )


# The weight in VMEM: XLA's cross-program prefetch -------------------------

_PREFETCH = re.compile(
  r"%(\S+) = \(\w+\[(\d+),(\d+)\]\{[^}]*S\(1\)\}.*copy-start\(%(\S+)\), "
  r"cross_program_prefetch_index"
)


@pytest.mark.parametrize("topology", ["v5e:2x4", "v5p:2x2x2"])
def test_weight_is_cross_program_prefetched(topology):
  """The one-way value ring at the chapter's shape (per device w
  [2048, 2048]): XLA prefetches the weight into VMEM (``S(1)``) before
  the program (a ``copy-start`` with ``cross_program_prefetch_index``)
  and every chunk's dot fusion reads that copy, as in a plain
  ``jax.lax`` program. It did not while the
  weight passed through the ring step's optimization barrier (an entry
  parameter used by a barrier is no prefetch candidate): then XLA brought
  it to VMEM late, and at the Llama-3-70B shard (v5e tp 4, M = 4096)
  step 1's dot read it from HBM with slower tiling (1487432 estimated
  cycles against 993078). No defensive or in-flight copies."""
  mesh = tpu_mesh(topology, (2, 4), ("x", "y"))
  jitted = jax.jit(
    jax.shard_map(
      lambda a, w: allgather_matmul(a, w, "y"),
      mesh=mesh,
      in_specs=(P("x", "y"), P(None, "y")),
      out_specs=P("x", "y"),
    )
  )
  args = (
    jax.ShapeDtypeStruct(
      (B, D), jnp.bfloat16, sharding=NamedSharding(mesh, P("x", "y"))
    ),
    jax.ShapeDtypeStruct(
      (D, F), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "y"))
    ),
  )
  text = jitted.trace(*args).lower().compile().as_text()
  entry = text[text.index("\nENTRY") :]
  params = dict(re.findall(r"%(param\S*) = \w+\[(\d+,\d+)\]", entry))
  w_param = next(p for p, s in params.items() if s == f"{D},{F // 4}")
  prefetch = [m for m in _PREFETCH.finditer(entry) if m.group(4) == w_param]
  assert len(prefetch) == 1, "the weight is not cross-program prefetched"
  start = prefetch[0].group(1)
  done = re.search(rf"%(\S+) = \S+ copy-done\(%{re.escape(start)}\)", entry)
  assert done, start
  dots = [
    line
    for line in entry.splitlines()
    if " fusion(" in line and "dot_general" in line and "chunk" in line
  ]
  assert len(dots) == 4, len(dots)  # one per chunk
  for line in dots:
    operands = line.split(" fusion(", 1)[1].split(")", 1)[0]
    assert f"%{done.group(1)}" in operands, line[:300]
    assert f"%{w_param}," not in operands + ",", line[:300]
  r = analyze(jitted, *args)
  r.assert_no_defensive_copies()
  r.assert_no_inflight_copies()


# The copy of x before the first transfer: the start's alias of a parameter -


def _ring_with_x(mesh, how):
  """The one-way ring's program with its ``x`` entered ``how``."""
  body = jax.shard_map(
    lambda a, w: allgather_matmul(a * 2 if how == "produced" else a, w, "y"),
    mesh=mesh,
    in_specs=(P("x", "y"), P(None, "y")),
    out_specs=P("x", "y"),
  )
  return jax.jit(body, donate_argnums=(0,) if how == "donated" else ())


@pytest.mark.parametrize("topology", ["v5e:2x4", "v5p:2x2x2", "v6e:2x4"])
def test_x_is_copied_only_when_an_entry_parameter_is_sent(topology):
  """The one-way ring's first start aliases its source ``x``
  (``output_to_operand_aliasing={{0}: (0, {})}``, so the done keeps the
  buffer the DMA reads alive). XLA may not let a kernel write a parameter
  the caller owns, so when ``x`` is the program's parameter it copies it
  once before the first start (16 MiB, 41.0 us modelled at the
  Llama-3-70B shard, v5e tp 4 M = 4096). Donating ``x`` does not remove
  the copy (no output has its shape, and a communicating kernel's buffers
  are XLA's own: ``design/scheduling.md`` section 4). When the program
  computes ``x`` (a model's activation), the start takes the producing
  fusion's buffer and no buffer of ``x``'s shape is copied.
  ``benchmarks.run --x-input`` enters every variant's ``x`` these three
  ways (``design/benchmarks.md``, "The copy of x before the first
  transfer")."""
  mesh = tpu_mesh(topology, (2, 4), ("x", "y"))
  args = (
    jax.ShapeDtypeStruct(
      (B, D), jnp.bfloat16, sharding=NamedSharding(mesh, P("x", "y"))
    ),
    jax.ShapeDtypeStruct(
      (D, F), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "y"))
    ),
  )
  x_shape = f"bf16[{B // 2},{D // 4}]"
  for how in ("parameter", "donated", "produced"):
    jitted = _ring_with_x(mesh, how)
    text = jitted.trace(*args).lower().compile().as_text()
    entry = text[text.index("\nENTRY") :]
    x_param = re.search(rf"%(param\S*) = {re.escape(x_shape)}\{{", entry)
    assert x_param, (how, entry[:500])
    first = re.search(
      r"%asyncops_ppermute_start\S* = .* custom-call\(%([^),]+)\)", entry
    )
    assert first, how
    r = analyze(jitted, *args)
    r.assert_no_defensive_copies()
    r.assert_no_inflight_copies()
    x_copies = [c for c in r.copies if c.shape.startswith(x_shape)]
    if how == "produced":
      assert not x_copies, (how, x_copies)
      src = re.escape(first.group(1))
      producer = re.search(rf"%{src} = (\S+) (\w+)\(", entry)
      assert producer and producer.group(2) == "fusion", (how, producer)
    else:
      assert len(x_copies) == 1, (how, x_copies)
      (c,) = x_copies
      assert c.operand == x_param.group(1), (how, c)
      assert first.group(1) == c.name, (how, first.group(1), c)
