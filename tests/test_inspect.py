"""The harness on real scheduled TPU HLO (AOT, no TPU needed)."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from asyncops.inspect import __main__ as cli
from asyncops.inspect import analyze, compile_tpu, tpu_mesh
from tests import util

TOPO = "v5e:2x4"


@pytest.fixture(scope="module")
def reports():
  return util.pattern_report


def _flat(built):
  jitted, args = built
  return (jitted, *args)


def _entry_pos(r, pred):
  return [i.position for i in r.module.entry.instrs if pred(i)]


def test_tpu_mesh_is_cached_and_shaped():
  m = tpu_mesh(TOPO, (2, 4), ("x", "y"))
  assert m is tpu_mesh(TOPO, [2, 4], ["x", "y"])
  assert m.devices.shape == (2, 4)
  assert m.devices.flat[0].platform == "tpu"
  with pytest.raises(ValueError):
    tpu_mesh(TOPO, (3, 3), ("x", "y"))


def test_clean_program_is_clean():
  mesh = tpu_mesh(TOPO, (8,), ("i",))
  x = jax.ShapeDtypeStruct(
    (8 * 256, 256), jnp.float32, sharding=NamedSharding(mesh, P("i"))
  )
  r = analyze(jax.jit(lambda x: jnp.tanh(x) * 2), x)
  assert "is_scheduled=true" in r.hlo_text
  assert r.compile_seconds > 0
  assert r.memory["argument_size_in_bytes"] == 256 * 256 * 4
  assert not r.pairs and not r.starts
  r.assert_no_defensive_copies()
  r.assert_no_inflight_copies()
  with pytest.raises(AssertionError):
    r.assert_overlapped(min_pairs=1)


def test_analyze_accepts_compiled_and_text(reports):
  compiled, _ = compile_tpu(*_flat(util.build(util.with_barriers, TOPO)))
  a = analyze(compiled)
  b = analyze(compiled.as_text())
  assert [p.start for p in a.pairs] == [p.start for p in b.pairs]
  assert a.memory and not b.memory


def test_pre_start_x_puts_compute_before_start(reports):
  r = reports("pre_start_x")
  (pair,) = r.kernel_pairs
  start = r.module.instr(pair.start)
  assert start.computation == r.module.entry_name
  dots = _entry_pos(r, lambda i: "dot_general" in i.op_name)
  assert dots and max(dots) < start.position
  assert not pair.overlapped and pair.source_live
  with pytest.raises(AssertionError, match="no compute between"):
    r.assert_overlapped()
  r.assert_no_inflight_copies()


def test_barriers_place_compute_between(reports):
  r = reports("barriers")
  (pair,) = r.kernel_pairs
  assert pair.overlapped and pair.between_cycles > 0
  assert any("dot_general" in i.op_name for i in pair.between)
  assert pair.source_live and pair.dest_live
  r.assert_overlapped(min_pairs=1, op="pallas_call")
  r.assert_no_defensive_copies()
  r.assert_no_inflight_copies()
  assert pair.start_source.startswith("util.py:")
  assert "with_barriers" in pair.start_source


def test_loop_unroll1_gets_a_defensive_copy_per_iteration(reports):
  r = reports("loop_unroll1")
  (pair,) = r.kernel_pairs
  body = r.module.computations[pair.computation]
  assert not body.is_entry and not pair.crossing
  (copy,) = r.defensive_copies
  assert copy.computation == body.name  # once per iteration
  assert copy.spaces[0] == copy.spaces[1]
  assert "ppermute_done" in copy.source
  r.assert_no_inflight_copies()
  with pytest.raises(AssertionError, match="defensive"):
    r.assert_no_defensive_copies()


def test_loop_unroll2_has_no_defensive_copy(reports):
  r = reports("loop_unroll2")
  assert len(r.kernel_pairs) == 2
  assert {p.computation for p in r.kernel_pairs} == {
    r.kernel_pairs[0].computation
  }
  r.assert_no_defensive_copies()
  r.assert_no_inflight_copies()


def test_staggered_unroll1_copies_both_inflight_buffers(reports):
  r = reports("staggered_unroll1")
  carried = [p for p in r.kernel_pairs if p.crossing]
  kinds = {p.crossing[0].split(" %")[0] for p in carried}
  assert kinds == {"into", "next iteration of", "out of"}
  roles = sorted(c.inflight.split(" ")[0] for c in r.inflight_copies)
  assert roles == ["destination", "source"]
  assert all(c.kind == "defensive" for c in r.inflight_copies)
  nxt = [p for p in carried if p.crossing[0].startswith("next")]
  assert nxt and not any(p.source_live for p in nxt)
  with pytest.raises(AssertionError, match="in flight"):
    r.assert_no_inflight_copies()


def test_staggered_unroll2_is_clean(reports):
  r = reports("staggered_unroll2")
  assert any(p.crossing for p in r.kernel_pairs)
  assert all(p.source_live for p in r.kernel_pairs)
  r.assert_no_defensive_copies()
  r.assert_no_inflight_copies()


def test_barrier_on_pre_start_x_copy_in_hbm(reports):
  """jax#25399 / xla#20440 with raw kernels, buffers large enough for HBM.

  XLA copies the pre-start ``x`` for the start (the compute keeps the
  original); the barrier still holds the compute inside the window. The
  copy is a parameter entering a transfer: a ``boundary`` copy (a
  communicating kernel's buffers live in memory XLA allocates).
  """
  r = reports("barrier_on_pre_start_x", shape=(4096, 4096))
  (pair,) = r.kernel_pairs
  start = r.module.instr(pair.start)
  fed = [c for c in r.copies if c.name in start.operands]
  assert len(fed) == 1 and fed[0].spaces == ("HBM", "HBM")
  assert fed[0].kind == "boundary" and fed[0].pair == (pair.start, "")
  assert r.module.instr(fed[0].operand).opcode == "parameter"
  assert pair.overlapped
  r.assert_no_inflight_copies()


@pytest.mark.parametrize("topology", ["v4:2x2x1", "v5p:2x2x1", "v6e:2x4"])
def test_other_topologies_smoke(reports, topology):
  r = reports("staggered_unroll1", topology)
  assert len(r.kernel_pairs) == 3
  assert r.inflight_copies  # the hazard is not v5e-specific


def test_command_line_report(capsys):
  assert cli.main(["tests.util:pattern_staggered_unroll1"]) == 1  # hazard
  out = capsys.readouterr().out
  assert "IN FLIGHT" in out and "DANGER" in out
  assert "util.py:" in out and "next iteration of %while" in out
  assert "source buffer live until done: NO" in out


def test_staggered_cond_copies_inflight_buffers_in_branch(reports):
  """A future through ``lax.cond`` (traced loop bounds), raw value API.

  XLA copies the buffers of the transfer started inside the taken branch
  into the conditional's result while that transfer is in flight (it is
  awaited in the loop after the conditional).
  """
  r = reports("staggered_cond")
  (cond,) = [
    i
    for c in r.module.computations.values()
    for i in c.instrs
    if i.opcode == "conditional"
  ]
  assert len(cond.branches) == 2
  steps = {s for p in r.kernel_pairs for s in p.crossing}
  assert any(s.startswith("into branch") for s in steps)
  assert f"out of %{cond.name}" in steps
  inflight = {c.name: c for c in r.inflight_copies}
  assert inflight, "copies in the branch must be reported in flight"
  assert all(c.computation in cond.branches for c in inflight.values())
  roles = sorted(c.inflight.split(" ")[0] for c in inflight.values())
  assert roles == ["destination", "source"]
  start = inflight[min(inflight)].inflight.split("%")[1].split(" ")[0]
  assert r.module.instr(start).computation in cond.branches
  out = [p for p in r.kernel_pairs if p.start == start]
  assert out and not any(p.source_live for p in out)
  with pytest.raises(AssertionError, match="in flight"):
    r.assert_no_inflight_copies()
