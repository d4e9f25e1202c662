"""The harness grades what each copy can break, finds orphan starts, and
names memory spaces per TPU generation (compiled TPU HLO, no TPU needed)."""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import asyncops
from asyncops import _jax_compat as jc
from asyncops.compare._patterns import BY_NAME
from asyncops.futures._primitives import start_p
from asyncops.inspect import analyze, tpu_mesh
from asyncops.inspect._hlo import MEMORY_SPACES
from tests import util

SHARD = (1024, 1024)  # f32 per device: 4 MiB
GENERATIONS = {"v4": "v4:2x2x1", "v5e": "v5e:2x4", "v5p": "v5p:2x2x2"}
GENERATIONS["v6e"] = "v6e:2x4"


def _x(mesh):
  return jax.ShapeDtypeStruct(
    (8 * SHARD[0], SHARD[1]),
    jnp.float32,
    sharding=NamedSharding(mesh, P("i")),
  )


def _jit(body, mesh):
  return jax.jit(
    jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i"))
  )


def cond_in_window(x):
  """A conditional inside the window: its identity branch copies the
  in-flight source into the conditional's result. The source itself
  stays live until the done (the done reads it), so the copy only costs."""
  x, fut = asyncops.ppermute_start(x, "i", shift=1)

  def pick(a):
    pred = jax.lax.axis_index("i") == 0
    return jax.lax.cond(pred, lambda a: a, lambda a: a * 2, a)

  z, fut = asyncops.overlap(fut, pick, x)
  return asyncops.ppermute_done(fut) + z


def dropped_future(x):
  """The future is never awaited (with the trace-time check off)."""
  x2, _ = asyncops.ppermute_start(x, "i", shift=1)
  return x2 * 2


@functools.cache
def _report(name, generation):
  mesh = tpu_mesh(GENERATIONS[generation], (8,), ("i",))
  return analyze(_jit(globals()[name], mesh), _x(mesh))


@pytest.mark.parametrize("generation", ["v5e", "v4"])
def test_read_only_copy_of_a_live_source_is_a_cost(generation):
  r = _report("cond_in_window", generation)
  (pair,) = r.kernel_pairs
  assert pair.source_live
  (copy,) = r.inflight_copies
  assert copy.grade == "cost"
  assert copy.inflight.startswith("source of %")
  # Inside a branch of the conditional scheduled in the window.
  assert copy.computation != pair.computation
  r.assert_no_hazards()  # right values: only time is lost
  with pytest.raises(AssertionError, match=r"IN FLIGHT \(COST\)"):
    r.assert_no_inflight_copies()
  text = r.summary()
  assert "cost only" in text and "DANGER" not in text
  assert "(0 hazards)" in text


@pytest.mark.parametrize("generation", ["v5e", "v4"])
def test_copies_of_inflight_buffers_that_break_values_are_hazards(generation):
  r = util.pattern_report("staggered_unroll1", GENERATIONS[generation])
  grades = {c.inflight.split(" ")[0]: c.grade for c in r.inflight_copies}
  # The destination copy reads a buffer being written; the source copy's
  # original buffer is not kept live until the done.
  assert grades == {"destination": "hazard", "source": "hazard"}
  assert not all(p.source_live for p in r.kernel_pairs)
  with pytest.raises(AssertionError, match=r"IN FLIGHT \(HAZARD\)"):
    r.assert_no_hazards()
  assert "DANGER" in r.summary()


@pytest.mark.filterwarnings("ignore:asyncops. future.*never awaited")
@pytest.mark.parametrize("generation", ["v5e", "v4"])
def test_start_with_no_done_is_reported(generation, monkeypatch):
  # The trace-time check refuses this program (test_hazards.py), and
  # dead-code elimination would remove the start; with both off, the
  # harness must still see the orphan in the compiled HLO.
  monkeypatch.setattr(jc, "_jaxpr_checks", [])
  monkeypatch.delitem(jc.dce_rules(), start_p)
  mesh = tpu_mesh(GENERATIONS[generation], (8,), ("i",))
  r = analyze(_jit(dropped_future, mesh), _x(mesh))
  assert not r.kernel_pairs
  (orphan,) = r.unawaited_starts
  assert "ppermute_start" in orphan.name
  assert "test_hazards_inspect.py" in orphan.where
  with pytest.raises(AssertionError, match="NO DONE"):
    r.assert_all_awaited()
  with pytest.raises(AssertionError, match="NO DONE"):
    r.assert_no_hazards()
  assert "Starts with no done: 1" in r.summary()


def test_clean_program_has_no_orphans_or_hazards():
  r = _report("cond_in_window", "v5e")
  assert not r.unawaited_starts
  r.assert_all_awaited()


# Memory spaces ----------------------------------------------------------------


@functools.cache
def _matmul_report(generation):
  p = BY_NAME["matmul"]
  mesh = tpu_mesh(GENERATIONS[generation], (2, 4), ("x", "y"))
  spec = P(("x", "y"))
  g = jax.jit(
    jax.shard_map(
      p.value, mesh=mesh, in_specs=(spec, P()), out_specs=(spec,) * p.n_out
    )
  )
  x = jax.ShapeDtypeStruct(
    (8 * SHARD[0], SHARD[1]), jnp.float32, sharding=NamedSharding(mesh, spec)
  )
  w = jax.ShapeDtypeStruct(
    (SHARD[1],) * 2, jnp.float32, sharding=NamedSharding(mesh, P())
  )
  return analyze(g, x, w)


@pytest.mark.parametrize("generation", sorted(GENERATIONS))
def test_memory_spaces_are_named_per_generation(generation):
  r = _matmul_report(generation)
  spaces = {
    (lf.memory_space, lf.nbytes)
    for c in r.module.computations.values()
    for i in c.instrs
    for lf in i.leaves
  }
  # v4 has a 128 MiB CMEM (S(3)) and a 16 MiB VMEM; the others put whole
  # buffers in VMEM (S(1)) and have no CMEM.
  fast = "CMEM" if generation == "v4" else "VMEM"
  big = {MEMORY_SPACES[s] for s, n in spaces if n >= 1 << 20 and s != 0}
  assert big == {fast}
  for c in r.copies:
    assert set(c.spaces) <= {"HBM", fast, "SCALAR", "tuple"}, c
  for space, nbytes in spaces:
    # Semaphores and scalar-unit values are one word; no 4 MiB "SMEM".
    if MEMORY_SPACES.get(space) in ("SEM", "SMEM", "SCALAR"):
      assert nbytes <= 8, (space, nbytes)
  if generation != "v4":
    assert 3 not in {s for s, _ in spaces}


def test_v4_s3_is_cmem_memory_space_assignment():
  # Turning off XLA's CMEM placement removes every S(3) buffer on v4.
  mesh = tpu_mesh(GENERATIONS["v4"], (8,), ("i",))
  lowered = _jit(cond_in_window, mesh).trace(_x(mesh)).lower()
  on = analyze(lowered.compile())
  off = analyze(
    lowered.compile({"xla_tpu_cmem_memory_space_assignment": False})
  )

  def s3(r):
    return [
      lf
      for c in r.module.computations.values()
      for i in c.instrs
      for lf in i.leaves
      if lf.memory_space == 3
    ]

  assert s3(on) and not s3(off)
  assert all("CMEM" not in c.spaces for c in off.copies)
