"""The TPU timeline model (benchmarks/_timeline.py) on handwritten HLO and
one real TPU compile. Asserts modelled structure, never wall time."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import _chips, _hlo, _timeline

CHIP = _chips.CHIPS["v5e"]
LINE = [(i, 0) for i in range(4)]
SQUARE = [(0, 0), (1, 0), (1, 1), (0, 1)]  # a physical 4-cycle

_HEAD = "HloModule m, is_scheduled=true\n\n"


def _cfg(cycles):
  cfg = '{"window_config":{"estimated_cycles":"' + str(cycles) + '"}}'
  return "backend_config=" + cfg


def _module(body: str, extra: str = "") -> _hlo.Module:
  return _hlo.parse(
    _HEAD + extra + "ENTRY %main (p: f32[512,512]) -> "
    "f32[512,512] {\n" + body + "\n}\n"
  )


def _pair(compute_cycles: int, nbytes_rows: int = 512) -> str:
  shape = f"f32[{nbytes_rows},512]"
  lines = [
    f"  %p = {shape}{{1,0}} parameter(0)",
    f"  %s = ({shape}, {shape}, u32[], u32[]) collective-permute-start(%p),"
    " channel_id=1, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}",
  ]
  if compute_cycles:
    lines.append(
      f"  %c = {shape}{{1,0}} fusion(%p), kind=kOutput, calls=%f, "
      + _cfg(compute_cycles)
    )
  lines.append(f"  ROOT %d = {shape}{{1,0}} collective-permute-done(%s)")
  return "\n".join(lines)


def _transfer_s(nbytes: int, hops: int) -> float:
  return nbytes / CHIP.ici_link_bytes_per_s + hops * CHIP.ici_hop_s


@pytest.mark.parametrize("rows", [128, 512])
def test_compute_between_start_and_done_hides_transfer(rows):
  nbytes = rows * 512 * 4
  transfer = _transfer_s(nbytes, hops=3)  # {3,0} crosses 3 links on a line
  cycles = int(2 * transfer * CHIP.clock_hz)  # twice the transfer
  tl = _timeline.simulate(_module(_pair(cycles, rows)), CHIP, coords=LINE)
  assert tl.exposed_comm_s == 0.0
  expect = CHIP.issue_s + cycles / CHIP.clock_hz + CHIP.done_s
  assert tl.step_s == pytest.approx(expect)
  ici = [e for e in tl.events if e.track == "ici"]
  assert len(ici) == 1 and ici[0].dur == pytest.approx(transfer)


@pytest.mark.parametrize("rows", [128, 512])
def test_no_compute_exposes_transfer(rows):
  nbytes = rows * 512 * 4
  tl = _timeline.simulate(_module(_pair(0, rows)), CHIP, coords=LINE)
  transfer = _transfer_s(nbytes, hops=3)
  assert tl.exposed_comm_s == pytest.approx(transfer)
  assert tl.step_s == pytest.approx(CHIP.issue_s + transfer + CHIP.done_s)


def test_partial_overlap_exposes_the_rest():
  transfer = _transfer_s(512 * 512 * 4, hops=3)
  cycles = int(0.25 * transfer * CHIP.clock_hz)
  tl = _timeline.simulate(_module(_pair(cycles)), CHIP, coords=LINE)
  assert tl.exposed_comm_s == pytest.approx(transfer - cycles / CHIP.clock_hz)


@pytest.mark.parametrize(
  "collectives, shards, hops",
  [
    # XLA's ring: 3 steps, each link carries 3 shards; the wrap-around
    # message of each step crosses the whole line (3 hops).
    ("ring", 3, 3 * 3),
    # Multicast: the last link carries 3 shards; 3 hops at most.
    ("multicast", 3, 3),
  ],
)
def test_synchronous_all_gather_is_exposed_and_routed(
  collectives, shards, hops
):
  body = (
    "  %p = f32[512,512]{1,0} parameter(0)\n"
    "  ROOT %ag = f32[512,2048]{1,0} all-gather(%p), channel_id=1, "
    "replica_groups=[1,4]<=[4], dimensions={1}"
  )
  tl = _timeline.simulate(
    _module(body), CHIP, coords=LINE, collectives=collectives
  )
  expect = _transfer_s(shards * 512 * 512 * 4, hops=hops)
  assert tl.exposed_comm_s == pytest.approx(expect)
  assert tl.step_s == pytest.approx(expect)


def test_ring_collective_on_a_square_uses_one_direction():
  """On a physical 4-cycle XLA's ring (colors:1) sends every shard one way:
  3 steps of one shard per link; colors:2 halves each direction's bytes."""
  for colors, shards in ((1, 3), (2, 1.5)):
    body = (
      "  %p = f32[512,512]{1,0} parameter(0)\n"
      "  ROOT %ag = f32[512,2048]{1,0} all-gather(%p), channel_id=1, "
      "replica_groups={{0,1,2,3}}, dimensions={1}, backend_config="
      f'{{"collective_algorithm_config":{{"debug":"StrategyRing{{colors:{colors}"}}}}'
    )
    tl = _timeline.simulate(_module(body), CHIP, coords=SQUARE)
    expect = _transfer_s(shards * 512 * 512 * 4, hops=3)
    assert tl.exposed_comm_s == pytest.approx(expect)


@pytest.mark.parametrize("trips", [1, 3, 7])
def test_while_body_runs_trip_count_times(trips):
  extra = (
    "%body (t: (s32[], f32[512,512])) -> (s32[], f32[512,512]) {\n"
    "  %t = (s32[], f32[512,512]) parameter(0)\n"
    "  %x = f32[512,512]{1,0} get-tuple-element(%t), index=1\n"
    "  %i = s32[] get-tuple-element(%t), index=0\n"
    "  %y = f32[512,512]{1,0} fusion(%x), kind=kOutput, calls=%f, "
    + _cfg(9000)
    + "\n  ROOT %r = (s32[], f32[512,512]) tuple(%i, %y)\n}\n\n"
    "%cond (t: (s32[], f32[512,512])) -> pred[] {\n"
    "  %t = (s32[], f32[512,512]) parameter(0)\n"
    "  ROOT %b = pred[] constant(true)\n}\n\n"
  )
  body = (
    "  %p = f32[512,512]{1,0} parameter(0)\n"
    "  %z = s32[] constant(0)\n"
    "  %t0 = (s32[], f32[512,512]) tuple(%z, %p)\n"
    "  %w = (s32[], f32[512,512]) while(%t0), condition=%cond, body=%body, "
    'backend_config={"known_trip_count":{"n":"' + str(trips) + '"}}\n'
    "  ROOT %o = f32[512,512]{1,0} get-tuple-element(%w), index=1"
  )
  tl = _timeline.simulate(_module(body, extra), CHIP, coords=LINE)
  assert tl.step_s == pytest.approx(trips * 9000 / CHIP.clock_hz)


def test_transfer_crossing_loop_iterations_is_paired_in_order():
  # Start in the entry, done inside the body (via the loop carry): the
  # done resolves to the oldest pending transfer of its kind.
  extra = (
    "%body (t: (bf16[8], f32[512,512])) -> (bf16[8], f32[512,512]) {\n"
    "  %t = (bf16[8], f32[512,512]) parameter(0)\n"
    "  %x = f32[512,512]{1,0} get-tuple-element(%t), index=1\n"
    "  %d = f32[512,512]{1,0} collective-permute-done(%x)\n"
    "  %g = bf16[8] get-tuple-element(%t), index=0\n"
    "  ROOT %r = (bf16[8], f32[512,512]) tuple(%g, %d)\n}\n\n"
  )
  body = (
    "  %p = f32[512,512]{1,0} parameter(0)\n"
    "  %s = (f32[512,512], f32[512,512], u32[], u32[]) "
    "collective-permute-start(%p), source_target_pairs={{0,1},{1,0}}\n"
    "  %q = bf16[8] constant(0)\n"
    "  %t0 = (bf16[8], f32[512,512]) tuple(%q, %p)\n"
    "  %w = (bf16[8], f32[512,512]) while(%t0), condition=%c, body=%body, "
    'backend_config={"known_trip_count":{"n":"1"}}\n'
    "  ROOT %o = f32[512,512]{1,0} get-tuple-element(%w), index=1"
  )
  tl = _timeline.simulate(_module(body, extra), CHIP, coords=LINE)
  assert tl.exposed_comm_s == pytest.approx(_transfer_s(512 * 512 * 4, 1))


def test_link_load_multicast_and_unicast():
  line = [(i,) for i in range(4)]
  ring = {i: [(i - 1) % 4] for i in range(4)}
  assert _timeline.link_load(ring, 10.0, line) == (10.0, 3)
  gather = {i: [j for j in range(4) if j != i] for i in range(4)}
  assert _timeline.link_load(gather, 10.0, line) == (30.0, 3)


def test_iota_replica_groups():
  ins = _hlo.parse(
    _HEAD + "ENTRY %m (p: f32[8]) -> f32[8] {\n  ROOT %a = f32[8] all-gather("
    "%p), replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}\n}\n"
  ).computations["m"][0]
  groups = _timeline.replica_groups(ins, 8)
  assert groups == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_unknown_topology_names_the_fix():
  with pytest.raises(ValueError, match="v5e:2x4"):
    _chips.chip_for("v9z:2x4")


# One real compile ------------------------------------------------------------


@pytest.fixture(scope="module")
def v5e_mesh():
  from benchmarks.run import make_mesh

  return make_mesh("v5e:2x4")


@pytest.mark.parametrize("rows", [1024, 2048])
def test_real_matmul_is_near_its_flop_roofline(v5e_mesh, rows):
  """Clock and XLA's estimates agree with the public peak (within 25%)."""
  dev = v5e_mesh.devices.flat[0]
  s = jax.sharding.SingleDeviceSharding(dev)
  a = jax.ShapeDtypeStruct((rows, 2048), jnp.bfloat16, sharding=s)
  b = jax.ShapeDtypeStruct((2048, 2048), jnp.bfloat16, sharding=s)
  text = jax.jit(jnp.matmul).trace(a, b).lower().compile().as_text()
  tl = _timeline.simulate(_hlo.parse(text), CHIP)
  roofline = 2 * rows * 2048 * 2048 / CHIP.bf16_flops
  assert roofline <= tl.step_s <= 1.25 * roofline
  assert tl.exposed_comm_s == 0.0


def test_real_collective_matmul_overlaps(v5e_mesh):
  """The chapter's ppermute loop: 3 transfers, partly hidden, in order."""
  from benchmarks import _variants

  args = _variants.abstract_args(
    "ppermute", v5e_mesh, (256, 512, 2048), jnp.float32
  )
  fn = _variants.build("ppermute", v5e_mesh)
  text = fn.trace(*args).lower().compile().as_text()
  coords = [d.coords for d in v5e_mesh.devices.flat]
  tl = _timeline.simulate(_hlo.parse(text), CHIP, coords=coords)
  ici = [e for e in tl.events if e.track == "ici"]
  assert len(ici) == 3
  assert all(
    a.start + a.dur <= b.start for a, b in zip(ici, ici[1:], strict=False)
  )
  transfer_total = sum(e.dur for e in ici)
  assert tl.exposed_comm_s < transfer_total
  assert tl.step_s == pytest.approx(
    max(e.start + e.dur for e in tl.events if e.track == "compute")
  )
  assert np.isfinite(tl.step_s)


def _two_permutes(pairs_a: str, pairs_b: str) -> _hlo.Module:
  shape = "f32[512,512]"
  body = "\n".join(
    [
      f"  %p = {shape}{{1,0}} parameter(0)",
      f"  %a = ({shape}, {shape}, u32[], u32[]) collective-permute-start(%p),"
      f" channel_id=1, source_target_pairs={{{pairs_a}}}",
      f"  %b = ({shape}, {shape}, u32[], u32[]) collective-permute-start(%p),"
      f" channel_id=2, source_target_pairs={{{pairs_b}}}",
      f"  %da = {shape}{{1,0}} collective-permute-done(%a)",
      f"  ROOT %db = {shape}{{1,0}} collective-permute-done(%b)",
    ]
  )
  return _module(body)


_RIGHT = "{0,1},{1,2},{2,3},{3,0}"
_LEFT = "{0,3},{1,0},{2,1},{3,2}"


def test_opposite_directions_of_a_ring_run_concurrently():
  tl = _timeline.simulate(_two_permutes(_RIGHT, _LEFT), CHIP, coords=SQUARE)
  a, b = [e for e in tl.events if e.track == "ici"]
  # Disjoint directed links: b starts as soon as it is issued, not after a.
  assert b.start < a.start + a.dur
  assert {a.lane, b.lane} == {0, 1}
  one = _transfer_s(512 * 512 * 4, hops=1)
  assert a.dur == pytest.approx(one) and b.dur == pytest.approx(one)


def test_same_links_queue():
  tl = _timeline.simulate(_two_permutes(_RIGHT, _RIGHT), CHIP, coords=SQUARE)
  a, b = [e for e in tl.events if e.track == "ici"]
  assert (
    b.start + b.dur
    >= a.start + a.dur + 512 * 512 * 4 / (CHIP.ici_link_bytes_per_s) - 1e-9
  )


def test_ring_sends_follow_ring_order():
  sends = _timeline.ring_sends([[0, 2, 3, 1]], 1)
  assert sends == {0: [2], 2: [3], 3: [1], 1: [0]}
  load, hops = _timeline.link_loads(sends, 10.0, SQUARE)
  # Ring order 0,2,3,1 on the square: 0->2 and 3->1 cross a diagonal
  # (2 hops each), 2->3 and 1->0 one hop: 6 link crossings of 10 bytes.
  assert hops == 2 and sum(load.values()) == 60.0


def test_peak_temp_is_peak_minus_arguments_outputs_and_code():
  import types

  from benchmarks.run import peak_temp_bytes

  mem = types.SimpleNamespace(
    peak_memory_in_bytes=100,
    argument_size_in_bytes=30,
    output_size_in_bytes=20,
    alias_size_in_bytes=5,
    generated_code_size_in_bytes=10,
    temp_size_in_bytes=0,
  )
  assert peak_temp_bytes(mem) == 100 - (30 + 20 - 5 + 10)
  mem.temp_size_in_bytes = 60  # a backend that reports temporaries itself
  assert peak_temp_bytes(mem) == 60


def _ref_kernel(
  operands: str, out: str, scope: str, shapes=None, label=None
) -> _hlo.Module:
  """A stateful (``*_ref_start``/``_done``) ppermute pair on ``operands``
  (``label``: the stateful API's message scope, none if None)."""
  shapes = shapes or {
    "a": "bf16[2,512,512]",
    "h": "bf16[512,512]",
    "g": "bf16[512,512]",
  }
  names = [n.strip("%") for n in operands.split(", ")]
  start, done = "asyncops_ppermute_ref_start", "asyncops_ppermute_ref_done"
  tail = f"/{label}/asyncops_ppermute_ref_start" if label else ""
  meta = (
    f'metadata={{op_name="jit(f)/{scope}/asyncops.ppermute_ref_start{tail}"}}'
  )
  call = 'custom_call_target="tpu_custom_call"'
  lines = [f"  %{n} = {shapes[n]} parameter({i})" for i, n in enumerate(names)]
  lines += [
    "  %slots = s32[2]{0} constant({0, 1})",
    f"  %{start}.0 = ({out}, s32[], s32[]) custom-call({operands}, %slots),"
    f" {call}, {meta}",
    f"  %{start}.1 = {out} get-tuple-element(%{start}.0), index=0",
    f"  ROOT %{done}.0 = {out} custom-call(%{start}.1, %slots), {call}",
  ]
  return _module("\n".join(lines))


@pytest.mark.parametrize(
  "operands, out",
  [
    ("%a", "bf16[2,512,512]"),  # two slots of one Ref: one slot moves
    ("%h, %g", "bf16[512,512]"),  # two whole Refs
  ],
)
def test_stateful_kernel_moves_one_message(operands, out):
  """A ``*_ref_start``'s output is its whole destination Ref; the model
  charges one message (512x512 bf16), not the double buffer."""
  m = _ref_kernel(operands, out, "ring_step/ring_shift+1")
  tl = _timeline.simulate(m, CHIP, coords=SQUARE, rings=[[0, 1, 2, 3]])
  (e,) = [e for e in tl.events if e.track == "ici"]
  assert e.dur == pytest.approx(_transfer_s(512 * 512 * 2, hops=1))


@pytest.mark.parametrize(
  "label, slots",
  [("ref_message_dst_slot", 1), ("ref_message_dst_whole", 2)],
)
def test_stateful_kernel_message_label(label, slots):
  """Two Refs of one shape (``[2, 512, 512]``): unlabelled the model cannot
  tell a slot-to-slot transfer from a whole one; the stateful API's
  op-name label says which (one slot: the Ref whole-chunk ring's pieces)."""
  shapes = {"a": "bf16[2,512,512]", "b": "bf16[2,512,512]"}
  m = _ref_kernel("%a, %b", "bf16[2,512,512]", "ring_shift+1", shapes)
  m_label = _ref_kernel(
    "%a, %b", "bf16[2,512,512]", "ring_shift+1", shapes, label
  )
  for mod, n in ((m, 2), (m_label, slots)):
    tl = _timeline.simulate(mod, CHIP, coords=SQUARE, rings=[[0, 1, 2, 3]])
    (e,) = [e for e in tl.events if e.track == "ici"]
    assert e.dur == pytest.approx(_transfer_s(n * 512 * 512 * 2, hops=1))


def test_stateful_kernel_follows_its_ring_shift_label():
  """Two stateful permutes labelled +1 and -1 use disjoint links."""
  up = _ref_kernel("%h, %g", "bf16[512,512]", "ring_shift+1")
  down = _ref_kernel("%h, %g", "bf16[512,512]", "ring_shift-1")
  loads = []
  for m in (up, down):
    sim = _timeline._Sim(m, CHIP, SQUARE, [[0, 1, 2, 3]], "free")
    sim._index = {}
    sim._comp = m.entry
    ins = next(i for i in m.computations[m.entry] if "_start.0" in i.name)
    loads.append(set(sim._kernel_dur(ins)[1]))
  assert loads[0] and loads[1] and not loads[0] & loads[1]


def test_small_invalid_estimate_is_free():
  """XLA's INVALID estimate for a 2-element iota (1824 cycles on v5e) is
  bookkeeping, not 1.2 us of compute."""
  cfg = (
    'backend_config={"window_config":{"estimated_cycles":"1824",'
    '"cost_model_type":"COST_MODEL_TYPE_INVALID"}}'
  )
  body = (
    "  %p = f32[512,512]{1,0} parameter(0)\n"
    f"  %i = s32[2]{{0:T(128)S(1)}} iota(), iota_dimension=0, {cfg}\n"
    "  ROOT %t = (f32[512,512], s32[2]) tuple(%p, %i)"
  )
  tl = _timeline.simulate(_module(body), CHIP)
  assert tl.step_s == 0.0


def test_ref_ring_models_like_the_value_ring(v5e_mesh):
  """api="ref" moves the same bytes per step as the value API: equal
  modelled transfer durations, every one on the ring's own links."""
  from benchmarks import _variants
  from benchmarks.run import mesh_rings

  coords = [d.coords for d in v5e_mesh.devices.flat]
  durs = {}
  for v in ("allgather_matmul", "allgather_matmul_ref"):
    args = _variants.abstract_args(v, v5e_mesh, (256, 512, 2048), jnp.bfloat16)
    text = _variants.build(v, v5e_mesh).trace(*args).lower().compile()
    tl = _timeline.simulate(
      _hlo.parse(text.as_text()),
      CHIP,
      coords=coords,
      rings=mesh_rings(v5e_mesh),
    )
    durs[v] = sorted(
      round(e.dur, 9)
      for e in tl.events
      if e.track == "ici" and e.name.startswith("asyncops_")
    )
  assert len(durs["allgather_matmul"]) == 3
  assert durs["allgather_matmul_ref"] == durs["allgather_matmul"]


# The model's blind spots, each on real compiled HLO ------------------------


def _compile(topology, tp, variant, shape, dtype, **options):
  from benchmarks import _mesh, _variants

  mesh = _mesh.make_mesh(topology, "ring", tp)
  args = _variants.abstract_args(variant, mesh, shape, dtype)
  with _mesh.quiet_fd2():
    lowered = _variants.build(variant, mesh).trace(*args).lower()
    text = lowered.compile(compiler_options=options or None).as_text()
  return text, mesh


def _sim(text, mesh, topology="v5e:2x4", **kw):
  from benchmarks import _mesh

  return _timeline.simulate(
    _hlo.parse(text),
    _chips.chip_for(topology),
    coords=_mesh.coords(mesh),
    rings=_mesh.mesh_rings(mesh),
    axis_rings=_mesh.axis_rings(mesh),
    **kw,
  )


@pytest.mark.parametrize(
  "spec, groups",
  [
    ("mesh['axis_0'=2,'axis_1'=4] {'axis_1'}", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    (
      "mesh['axis_0'=2,'axis_1'=4] {'axis_0'}",
      [[0, 4], [1, 5], [2, 6], [3, 7]],
    ),
    ("mesh['a'=2,'b'=4] {'b':(1)2}", [[0, 2], [1, 3], [4, 6], [5, 7]]),
    ("mesh['a'=2,'b'=4] {'b':(2)2}", [[0, 1], [2, 3], [4, 5], [6, 7]]),
    ("mesh['a'=2,'b'=2], device_ids=([[0,2],[1,3]]) {'a'}", [[0, 1], [2, 3]]),
  ],
)
def test_mesh_axes_replica_groups(spec, groups):
  ins = _hlo.parse(
    _HEAD + "ENTRY %m (p: f32[8]) -> f32[8] {\n  ROOT %a = f32[8] all-gather("
    f"%p), replica_groups={spec}, dimensions={{0}}\n}}\n"
  ).computations["m"][0]
  assert _timeline.replica_groups(ins, 8) == groups


def test_unreadable_replica_groups_name_the_fix():
  ins = _hlo.parse(
    _HEAD + "ENTRY %m (p: f32[8]) -> f32[8] {\n  ROOT %a = f32[8] all-gather("
    "%p), replica_groups=mesh[oops], dimensions={0}\n}\n"
  ).computations["m"][0]
  with pytest.raises(ValueError, match="replica_groups"):
    _timeline.replica_groups(ins, 8)


def test_mesh_replica_groups_on_real_hlo():
  """Windowed einsum off: the all-gather's groups on real HLO.

  Newer libtpu prints them as mesh axes (`replica_groups=mesh[...]`), older
  ones (jax 0.9.0's) as iota or explicit lists; the model routes every form
  to the same two squares (the mesh form alone is parsed in the synthetic
  tests above)."""
  shape = (256, 512, 2048)
  off, mesh = _compile(
    "v5e:2x4",
    4,
    "jit",
    shape,
    jnp.bfloat16,
    xla_tpu_enable_windowed_einsum_for_all_gather=False,
  )
  assert "replica_groups=" in off
  tl = _sim(off, mesh)
  (ag,) = [e for e in tl.events if e.kind == "collective"]
  # Each device gathers 3 shards of [128, 128] bf16 over its 2x2 square.
  assert ag.dur >= 3 * 128 * 128 * 2 / 2 / CHIP.ici_link_bytes_per_s
  assert tl.exposed_comm_s >= ag.dur
  ins = next(
    i
    for c in _hlo.parse(off).computations.values()
    for i in c
    if i.opcode == "all-gather"
  )
  assert _timeline.replica_groups(ins, 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_fused_all_reduce_scatter_is_a_collective():
  """XLA's all-reduce-scatter custom fusion moves bytes over the links;
  it is never free compute."""
  text, mesh = _compile(
    "v5e:2x4", 4, "reducescatter:jit", (256, 512, 2048), jnp.float32
  )
  assert "calls=%all-reduce-scatter" in text
  tl = _sim(text, mesh)
  (rs,) = [e for e in tl.events if e.kind == "collective"]
  # Reduce-scatter of a [128, 512] f32 partial: each device ends with a
  # [128, 128] block, after (n - 1) such blocks crossed its links.
  block = 128 * 128 * 4
  assert rs.dur >= 3 * block / 2 / CHIP.ici_link_bytes_per_s
  assert tl.exposed_comm_s == pytest.approx(rs.dur, rel=0.05)


@pytest.mark.parametrize(
  "topology, variant",
  [
    ("v5e:2x4", "jit"),
    ("v5p:2x2x2", "jit"),
    ("v5e:2x4", "reducescatter:jit"),
  ],
)
def test_windowed_einsum_loop_runs_every_trip(topology, variant):
  """XLA's windowed-einsum loop has no known_trip_count: the model reads
  the trip count from the condition, and so executes all the FLOPs."""
  b, d, f = 2048, 2048, 8192
  text, mesh = _compile(topology, 8, variant, (b, d, f), jnp.bfloat16)
  assert " while(" in text and "known_trip_count" not in text
  tl = _sim(text, mesh, topology)
  assert [(n, how) for _, n, how in tl.loops] == [(2, "inferred")]
  assert not tl.flags
  assert tl.flops == pytest.approx(2 * b * d * f / 8)
  chip = _chips.chip_for(topology)
  assert tl.step_s >= tl.flops / chip.bf16_flops


def test_unknown_trip_count_is_flagged():
  extra = (
    "%body (t: (s32[], f32[512,512])) -> (s32[], f32[512,512]) {\n"
    "  %t = (s32[], f32[512,512]) parameter(0)\n"
    "  ROOT %r = (s32[], f32[512,512]) tuple(%t)\n}\n\n"
    "%cond (t: (s32[], f32[512,512])) -> pred[] {\n"
    "  %t = (s32[], f32[512,512]) parameter(0)\n"
    '  ROOT %b = pred[] custom-call(%t), custom_call_target="opaque"\n}\n\n'
  )
  body = (
    "  %p = f32[512,512]{1,0} parameter(0)\n"
    "  %z = s32[] constant(0)\n"
    "  %t0 = (s32[], f32[512,512]) tuple(%z, %p)\n"
    "  ROOT %w = (s32[], f32[512,512]) while(%t0), condition=%cond, "
    "body=%body"
  )
  tl = _timeline.simulate(_module(body, extra), CHIP, coords=LINE)
  assert tl.loops == [("w", 1, "unknown")]
  assert any("unknown trip count" in f for f in tl.flags)


def test_op_is_never_below_its_roofline(v5e_mesh):
  """A decode-size matmul: XLA's estimate is below the time to read the
  weight from HBM; the model charges the read."""
  dev = v5e_mesh.devices.flat[0]
  s = jax.sharding.SingleDeviceSharding(dev)
  a = jax.ShapeDtypeStruct((16, 8192), jnp.bfloat16, sharding=s)
  w = jax.ShapeDtypeStruct((8192, 7168), jnp.bfloat16, sharding=s)
  text = jax.jit(jnp.matmul).trace(a, w).lower().compile().as_text()
  tl = _timeline.simulate(_hlo.parse(text), CHIP, prefetch="charged")
  weight_read = 8192 * 7168 * 2 / CHIP.hbm_bytes_per_s
  assert tl.step_s >= weight_read
  assert tl.flops == pytest.approx(2 * 16 * 8192 * 7168)


def test_two_cores_of_one_chip_copy_at_hbm_bandwidth():
  """v4 puts two devices on one chip; a permute between them uses no ICI
  link but still takes time (an on-chip copy at HBM bandwidth)."""
  same = [(0, 0), (0, 0), (1, 0), (1, 0)]
  tl = _timeline.simulate(
    _two_permutes("{0,1},{1,0}", "{2,3},{3,2}"), CHIP, coords=same
  )
  durs = [e.dur for e in tl.events if e.track == "ici"]
  assert len(durs) == 2
  assert min(durs) >= 512 * 512 * 4 / CHIP.hbm_bytes_per_s
  assert not tl.flags


def test_all_to_all_kernel_sends_one_slot_to_each_peer():
  """asyncops_all_to_all_start's source is (n, ...): n - 1 slots leave,
  one per peer, never the whole buffer to everyone."""
  m = _hlo.parse(
    _HEAD + "ENTRY %main (p: f32[4,128,512]) -> f32[4,128,512] {\n"
    "  %p = f32[4,128,512]{2,1,0} parameter(0)\n"
    "  %asyncops_all_to_all_start.0 = (f32[4,128,512], f32[4,128,512], "
    's32[], s32[]) custom-call(%p), custom_call_target="tpu_custom_call"\n'
    "  ROOT %g = f32[4,128,512] get-tuple-element("
    "%asyncops_all_to_all_start.0), index=1\n}\n"
  )
  sim = _timeline._Sim(m, CHIP, SQUARE, [[0, 1, 2, 3]], "free")
  sim._comp = m.entry
  ins = m.computations[m.entry][1]
  track, load, _ = sim._kernel_dur(ins)
  slot = 128 * 512 * 4
  # On a 4-cycle: offsets 1 and 3 are neighbours, offset 2 crosses 2 links.
  assert track == "ici"
  assert sum(load.values()) == pytest.approx(slot * 4 * (1 + 1 + 2))


@pytest.mark.parametrize("dst_rows", [128, 256])
def test_bidirectional_kernel_moves_half_its_destination_each_way(dst_rows):
  """A bidirectional start sends half its destination each way: its
  source's halves (destination as large as the source), or all of its
  source each way (``whole=True``: the destination twice the source). It
  used to charge half the source, half a whole transfer's bytes."""
  src, dst = "f32[128,512]", f"f32[{dst_rows},512]"
  m = _hlo.parse(
    _HEAD + f"ENTRY %main (p: {src}) -> {dst} {{\n"
    f"  %p = {src}{{1,0}} parameter(0)\n"
    f"  %asyncops_bidirectional_start.0 = ({src}, {dst}, s32[], s32[], "
    's32[], s32[]) custom-call(%p), custom_call_target="tpu_custom_call"\n'
    f"  ROOT %g = {dst} get-tuple-element("
    "%asyncops_bidirectional_start.0), index=1\n}\n"
  )
  sim = _timeline._Sim(m, CHIP, SQUARE, [[0, 1, 2, 3]], "free")
  sim._comp = m.entry
  ins = m.computations[m.entry][1]
  track, load, _ = sim._kernel_dur(ins)
  # Four devices, each sending half the destination to each neighbour.
  assert track == "ici"
  assert sum(load.values()) == pytest.approx(4 * dst_rows * 512 * 4)


def test_combined_all_reduce_moves_every_operand(v5e_mesh):
  """XLA's all-reduce combiner makes one all-reduce of two gradients (a
  tuple): the model moves both, twice the bytes of one (it used to cost
  the first operand only)."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from benchmarks import _mesh

  def compiled(k):
    def body(*a):
      return tuple(jax.lax.psum(v, "x") for v in a)

    f = jax.jit(
      jax.shard_map(
        body,
        mesh=v5e_mesh,
        in_specs=(P("x", "y"),) * k,
        out_specs=(P(None, "y"),) * k,
      )
    )
    s = NamedSharding(v5e_mesh, P("x", "y"))
    args = [jax.ShapeDtypeStruct((1024, 2048), jnp.bfloat16, sharding=s)] * k
    with _mesh.quiet_fd2():
      return f.trace(*args).lower().compile().as_text()

  one, two = (_sim(compiled(k), v5e_mesh) for k in (1, 2))
  (c1,) = [e for e in one.events if e.kind == "collective"]
  durs = [e.dur for e in two.events if e.kind == "collective"]
  # Twice the bytes, the same hop latency (first operand only: 1x).
  assert sum(durs) > 1.8 * c1.dur


def test_kernel_labelled_with_another_axis_uses_its_rings():
  """A ppermute kernel whose op name says ``ring_axis_x`` shifts over the
  ``x`` rings (a data-parallel exchange), not the ring axis'."""
  m = _ref_kernel("%h, %g", "bf16[512,512]", "ring_axis_x/ring_shift+1")
  coords = [(0, 0), (1, 0), (0, 1), (1, 1)]
  sim = _timeline._Sim(
    m,
    CHIP,
    coords,
    [[0, 1], [2, 3]],
    "free",
    axis_rings={"x": [[0, 2], [1, 3]]},
  )
  sim._index = {}
  sim._comp = m.entry
  ins = next(i for i in m.computations[m.entry] if "_start.0" in i.name)
  links = set(sim._kernel_dur(ins)[1])
  assert links == {
    ((0, 0), (0, 1)),
    ((0, 1), (0, 0)),
    ((1, 0), (1, 1)),
    ((1, 1), (1, 0)),
  }
  sim = _timeline._Sim(m, CHIP, coords, [[0, 1], [2, 3]], "free")
  sim._index = {}
  sim._comp = m.entry
  with pytest.raises(ValueError, match="axis_rings"):
    sim._kernel_dur(ins)
