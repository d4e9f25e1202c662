"""The copy guard: ``assert_copy_free`` and ``asyncops.jit``.

A program that copies, overwrites or frees a buffer in flight is refused
at compile time with the user's source line of the start; a clean program
passes. Programs are compiled ahead of time for TPU topologies (v5e here;
``test_scheduling.py`` covers the generations).
"""

import functools
import pathlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import asyncops
from asyncops import scheduling as sch
from asyncops.inspect import (
  CopyHazardError,
  analyze,
  assert_copy_free,
  hazards,
  tpu_mesh,
)
from benchmarks import edge_copies

THIS = pathlib.Path(__file__).name
V5E = "v5e:2x4"
SHARD = (1024, 1024)  # f32 per device


def _lines(marker: str) -> list[int]:
  """The numbers of the lines in this file ending with ``marker``."""
  return [
    n + 1
    for n, text in enumerate(pathlib.Path(__file__).read_text().splitlines())
    if text.rstrip().endswith(f"# {marker}")
  ]


def _line(marker: str) -> int:
  """The line number of the line in this file ending with ``marker``."""
  for n, text in enumerate(pathlib.Path(__file__).read_text().splitlines()):
    if text.rstrip().endswith(f"# {marker}"):
      return n + 1
  raise AssertionError(marker)


def accumulate(loop):
  """The seed design's accumulate loop, with the given fori_loop."""

  def f(x):
    out = jnp.zeros_like(x)
    x, fut = asyncops.ppermute_start(x, "i", shift=1)  # PROLOGUE
    out = out + x

    def body(i, carry):
      out, fut = carry
      x = asyncops.ppermute_done(fut)
      x, fut = asyncops.ppermute_start(x, "i", shift=1)  # BODY
      return out + x, fut

    out, fut = loop(0, 6, body, (out, fut))
    return out, asyncops.ppermute_done(fut)

  return f


LAX2 = functools.partial(jax.lax.fori_loop, unroll=2)
SPECS = dict(in_specs=P("i"), out_specs=(P("i"), P("i")))


@functools.cache
def _mesh(topology=V5E):
  return tpu_mesh(topology, (8,), ("i",))


def _x(mesh):
  return jax.ShapeDtypeStruct(
    (8 * SHARD[0], SHARD[1]), jnp.float32, sharding=NamedSharding(mesh, P("i"))
  )


def _program(loop, mesh=None):
  return jax.shard_map(accumulate(loop), mesh=mesh or _mesh(), **SPECS)


# Source lines -----------------------------------------------------------------


def test_starts_name_the_user_line_in_prologue_and_loop_body():
  # Each start's HLO metadata names the line that called it (not the
  # prologue's line for a start in a loop body, and no asyncops frame).
  r = analyze(jax.jit(_program(sch.fori_loop)), _x(_mesh()))
  lines = sorted(
    {r.module.instr(p.start).source for p in r.kernel_pairs},
  )
  prologue, body = _line("PROLOGUE"), _line("BODY")
  assert lines == [
    f"{THIS}:{prologue} in accumulate.<locals>.f",
    f"{THIS}:{body} in accumulate.<locals>.f.<locals>.body",
  ], lines
  assert not any("asyncops/" in p.start_source for p in r.kernel_pairs)


def _start_once(x):
  x, fut = asyncops.ppermute_start(x, "i", shift=1)  # ONCE
  return x, asyncops.ppermute_done(fut)


def _start_in_loop(x):
  def body(i, x):
    y, fut = asyncops.ppermute_start(x, "i", shift=1)  # IN_LOOP
    return y + asyncops.ppermute_done(fut)

  return sch.fori_loop(0, 4, body, x), x


@pytest.mark.parametrize("topology", [V5E, "v6e:2x4"])
def test_equal_starts_in_two_programs_name_their_own_lines(topology):
  # The same start (same shapes and axis) traced first at one line, then
  # inside a loop body of another program: nothing cached from the first
  # trace (a kernel's jaxpr, a lowering) may carry its line into the
  # second program's metadata (innermost frame, or anywhere in the stack).
  mesh = _mesh(topology)
  for fn, marker in ((_start_once, "ONCE"), (_start_in_loop, "IN_LOOP")):
    r = analyze(jax.jit(jax.shard_map(fn, mesh=mesh, **SPECS)), _x(mesh))
    wheres = {p.start_source for p in r.kernel_pairs}
    assert r.kernel_pairs and all(
      w.startswith(f"{THIS}:{_line(marker)} in {fn.__name__}") for w in wheres
    ), (marker, wheres)
    other = "IN_LOOP" if marker == "ONCE" else "ONCE"
    assert not any(f"{THIS}:{_line(other)} " in w for w in wheres), wheres


# assert_copy_free -------------------------------------------------------------


def test_lax_accumulate_loop_is_refused_with_the_user_line():
  with pytest.raises(CopyHazardError) as e:
    assert_copy_free(jax.jit(_program(LAX2)), _x(_mesh()))
  msg = str(e.value)
  assert e.type is asyncops.scheduling.CopyHazardError
  assert "in-flight copy" in msg and "%copy" in msg
  assert "-> %asyncops_ppermute_done" in msg
  assert f"started at {THIS}:{_line('BODY')} in " in msg
  assert f"started at {THIS}:{_line('PROLOGUE')} in " in msg
  assert "asyncops.scheduling.fori_loop" in msg  # the fix


def test_clean_loop_passes_and_returns_the_report():
  r = assert_copy_free(jax.jit(_program(sch.fori_loop)), _x(_mesh()))
  assert r.kernel_pairs and hazards(r) == []


def test_topology_retargets_a_context_mesh_program():
  # A program written for the context mesh (shard_map without mesh=) is
  # checked on TPU from CPU arrays' shapes and specs.
  cpu = jax.make_mesh((8,), ("i",), devices=jax.devices("cpu")[:8])
  x = jax.device_put(jnp.zeros((8 * 16, 128)), NamedSharding(cpu, P("i")))
  f = jax.jit(jax.shard_map(accumulate(LAX2), **SPECS))
  with pytest.raises(CopyHazardError, match=f"{THIS}:{_line('BODY')}"):
    assert_copy_free(f, x, topology=V5E)
  g = jax.jit(jax.shard_map(accumulate(sch.fori_loop), **SPECS))
  assert assert_copy_free(g, x, topology=V5E).kernel_pairs


def test_cpu_arguments_without_topology_are_an_error():
  cpu = jax.make_mesh((8,), ("i",), devices=jax.devices("cpu")[:8])
  x = jax.device_put(jnp.zeros((8 * 16, 128)), NamedSharding(cpu, P("i")))
  f = jax.jit(jax.shard_map(accumulate(sch.fori_loop), mesh=cpu, **SPECS))
  with pytest.raises(ValueError, match="Pass topology="):
    assert_copy_free(f, x)
  with pytest.raises(ValueError, match="without mesh="):
    assert_copy_free(f, x, topology=V5E)


# asyncops.jit -----------------------------------------------------------------


def test_jit_refuses_ahead_of_time_compiles():
  x = _x(_mesh())
  f = asyncops.jit(_program(LAX2))
  line = f"{THIS}:{_line('BODY')} in "
  with pytest.raises(CopyHazardError, match=line):
    f.lower(x).compile()
  with pytest.raises(CopyHazardError, match=line):
    f.trace(x).lower().compile()
  with pytest.raises(CopyHazardError, match=line):
    f.compile_checked(x)  # what a first call on a TPU runs
  assert f.last_check_seconds is not None and f.last_check_seconds < 5.0


def test_jit_passes_a_clean_program_and_caches_it():
  x = _x(_mesh())
  f = asyncops.jit(_program(sch.fori_loop))
  compiled = f.lower(x).compile()
  assert "asyncops_ppermute_start" in compiled.as_text()
  assert hazards(f.last_report) == []
  assert f.compile_checked(x) is f.compile_checked(x)


def test_jit_warn_and_off():
  x = _x(_mesh())
  with pytest.warns(asyncops.inspect.CopyHazardWarning, match="in-flight"):
    asyncops.jit(_program(LAX2), check="warn").lower(x).compile()
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    f = asyncops.jit(_program(LAX2), check="off")
    f.lower(x).compile()
  assert f.last_check_seconds is None


def test_jit_is_jax_jit_on_cpu():
  mesh = jax.make_mesh((8,), ("i",), devices=jax.devices("cpu")[:8])
  x = jax.device_put(
    jnp.arange(8 * 16 * 128, dtype=jnp.float32).reshape(8 * 16, 128),
    NamedSharding(mesh, P("i")),
  )
  f = _program(sch.fori_loop, mesh)
  got = asyncops.jit(f)(x)
  for a, b in zip(got, jax.jit(f)(x), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_jit_as_a_decorator_with_static_arguments():
  @asyncops.jit(static_argnums=1, check="raise")
  def scale(x, k):
    return x * k

  assert scale(jnp.ones(2), 3).tolist() == [3.0, 3.0]
  mesh = _mesh()
  y = jax.ShapeDtypeStruct(
    (8, 128), jnp.float32, sharding=NamedSharding(mesh, P())
  )
  assert scale.compile_checked(y, 3) is scale.compile_checked(y, 3)
  assert scale.compile_checked(y, 3) is not scale.compile_checked(y, 4)


def test_jit_rejects_an_unknown_mode():
  with pytest.raises(ValueError, match="check='strict'"):
    asyncops.jit(lambda x: x, check="strict")


# The harness gap: writes into a buffer in flight ------------------------------


def _write(role):
  def f(x):
    x, fut = asyncops.ppermute_start(x * 2.0, "i", shift=1)
    if role == "source":
      src, dst = x.at[0].set(7.0), fut.dst  # WRITE_SOURCE
    else:
      src, dst = x, fut.dst.at[0].set(7.0)  # WRITE_DESTINATION
    fut._status = "awaited"  # replaced by a hand-built future below
    fut = asyncops.Future(fut.sems, src, dst, fut.spec)
    return asyncops.ppermute_done(fut) + src

  return f


@pytest.mark.parametrize("role", ["source", "destination"])
def test_a_write_into_a_buffer_in_flight_is_a_hazard(role):
  mesh = _mesh()
  f = jax.jit(
    jax.shard_map(_write(role), mesh=mesh, in_specs=P("i"), out_specs=P("i"))
  )
  r = analyze(f, _x(mesh))
  (pair,) = r.kernel_pairs
  (w,) = pair.inplace_writes
  assert f"writes into the {role}" in w
  assert f"{THIS}:{_line('WRITE_' + role.upper())}" in w
  assert "IN-PLACE WRITE" in r.summary()
  with pytest.raises(CopyHazardError, match="in-place write"):
    assert_copy_free(f, _x(mesh))


def test_a_write_after_the_done_is_not_a_hazard():
  def f(x):
    x, fut = asyncops.ppermute_start(x * 2.0, "i", shift=1)
    return asyncops.ppermute_done(fut) + x.at[0].set(7.0)

  mesh = _mesh()
  g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("i"), out_specs=P("i")))
  r = assert_copy_free(g, _x(mesh))
  assert not r.kernel_pairs[0].inplace_writes


# Starts no done waits for ----------------------------------------------------


def _swap_futures(x):
  """Two transfers whose futures a ``lax.cond`` swaps on one device.

  The trace-time check accepts it (each future is awaited once); XLA
  compiles the swap into copies of both futures, semaphores included."""
  x = x * 2.0
  _, fa = asyncops.ppermute_start(x, "i", shift=1)  # SWAP_A
  _, fb = asyncops.ppermute_start(x + 1.0, "i", shift=1)  # SWAP_B
  p = jax.lax.axis_index("i") == 0
  fa, fb = jax.lax.cond(p, lambda f, g: (f, g), lambda f, g: (g, f), fa, fb)
  return asyncops.ppermute_done(fa) * 2.0 + asyncops.ppermute_done(fb)


def _swap_ref_futures(x):
  """The same with the Ref API, whose futures are semaphores only: XLA
  copies the semaphores and no buffer."""
  from asyncops import stateful

  a, b = jax.new_ref(x * 2.0), jax.new_ref(jnp.zeros_like(x))
  c, d = jax.new_ref(x * 3.0), jax.new_ref(jnp.zeros_like(x))
  fa = stateful.ppermute_start(a, b, "i", shift=1)  # SWAP_A
  fb = stateful.ppermute_start(c, d, "i", shift=1)  # SWAP_B
  p = jax.lax.axis_index("i") == 0
  fa, fb = jax.lax.cond(p, lambda f, g: (f, g), lambda f, g: (g, f), fa, fb)
  stateful.ppermute_done(fa, a, b)
  stateful.ppermute_done(fb, c, d)
  return b[...] + d[...]


@pytest.mark.parametrize("api", ["value", "ref"])
@pytest.mark.parametrize("topology", [V5E, "v6e:2x4"])
def test_copied_semaphores_are_refused(topology, api):
  # A copy of a DMA semaphore (SEM->SEM) was a ``scalar`` copy the guard
  # let pass, and the start whose semaphores were copied reached no done
  # (the harness stops at a copy), so nothing checked its window.
  mesh = _mesh(topology)
  fn = _swap_futures if api == "value" else _swap_ref_futures
  f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("i"), out_specs=P("i")))
  r = analyze(f, _x(mesh))
  sem_copies = [c for c in r.copies if "SEM" in c.spaces]
  assert sem_copies and r.unawaited_starts
  found = hazards(r)
  kinds = [h.kind for h in found]
  assert kinds.count("semaphore copy") == len(sem_copies), kinds
  orphans = [h for h in found if h.kind == "start with no done"]
  assert len(orphans) == len(r.unawaited_starts)
  lines = [f"{THIS}:{n} in " for n in _lines("SWAP_A") + _lines("SWAP_B")]
  assert all(any(h.start_line.startswith(ln) for ln in lines) for h in orphans)
  if api == "ref":  # no buffer is copied: the semaphores are the hazard
    assert not [c for c in r.copies if c.kind == "defensive" or c.inflight]
  with pytest.raises(CopyHazardError, match="semaphore copy.*SEM->SEM"):
    assert_copy_free(f, _x(mesh))


def _dropped(x):
  x, _ = asyncops.ppermute_start(x * 2.0, "i", shift=1)  # DROPPED
  return x * 2.0


@pytest.mark.filterwarnings("ignore:asyncops. future.*never awaited")
@pytest.mark.parametrize("topology", [V5E, "v6e:2x4"])
def test_a_start_no_done_waits_for_is_refused(topology, monkeypatch):
  # The guard is the backstop of the trace-time check: with that check
  # (and the start's dead-code rule) off, the compiled program has a start
  # and no done. The report called it a hazard; the guard passed it.
  from asyncops import _jax_compat as jc
  from asyncops.futures._primitives import start_p

  monkeypatch.setattr(jc, "_jaxpr_checks", [])
  monkeypatch.delitem(jc.dce_rules(), start_p)
  mesh = _mesh(topology)
  f = jax.jit(
    jax.shard_map(_dropped, mesh=mesh, in_specs=P("i"), out_specs=P("i"))
  )
  r = analyze(f, _x(mesh))
  assert not r.kernel_pairs and len(r.unawaited_starts) == 1
  (h,) = hazards(r)
  assert h.kind == "start with no done" and not h.done
  assert h.start_line.startswith(f"{THIS}:{_line('DROPPED')} in _dropped")
  with pytest.raises(CopyHazardError, match="start with no done"):
    assert_copy_free(f, _x(mesh))


# The Ref API's rings: the source a start sends is the one its done holds ------


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("topology", [V5E, "v5p:2x2x2"])
def test_ref_ring_dones_hold_the_source_their_start_sends(
  topology, bidirectional
):
  # A Ref start aliases its destination and only reads its other operand.
  # The done pinned that source to HBM and the start did not, so where XLA
  # placed the source in VMEM the start sent the VMEM buffer while the done
  # held an HBM copy of it: the buffer the DMA read could be freed in
  # flight. The harness counted the destination's liveness as the
  # source's and saw nothing.
  from asyncops.inspect._analysis import _resolve
  from tests.test_accumulation_tpu import _report

  r = _report(topology, "float32", bidirectional, "ref")
  m = r.module
  pairs = r.pairs_for("asyncops.ppermute_ref")
  assert pairs
  for p in pairs:
    s, d = m.instr(p.start), m.instr(p.done)
    (src,) = [
      o
      for k, o in enumerate(s.operands)
      if k not in {a[1] for a in s.aliasing}
      and m.instr(o).leaves[0].num_elements > 2
    ]
    held = {_resolve(m, (o, ())) for o in d.operands}
    assert _resolve(m, (src, ())) in held, (s.name, src, d.operands)
    assert p.source_live
  assert hazards(r) == [], [str(h) for h in hazards(r)]


# Program edges and generations ------------------------------------------------


def _edge_kernel(remote: bool):
  """A start-like Pallas kernel: DMA x into a new buffer (local or remote)."""
  return edge_copies.program(
    edge_copies.Variant(
      remote=remote, alias=False, computed_x=True, wait_reads_x=False
    )
  )


@pytest.mark.parametrize("remote", [False, True])
def test_a_received_buffer_is_copied_at_the_program_edge_on_v5p(remote):
  # The evidence behind the ``boundary`` copy kind, with plain Pallas: on
  # v5p the destination of a remote DMA is copied before it is returned;
  # a local DMA's is not. (v5e places the same copy as VMEM->HBM.)
  mesh = _mesh("v5p:2x2x2")
  f = jax.jit(
    jax.shard_map(
      _edge_kernel(remote),
      mesh=mesh,
      in_specs=P("i"),
      out_specs=P("i"),
      check_vma=False,
    )
  )
  r = analyze(f, _x(mesh))
  big = [c for c in r.copies if c.kind != "scalar"]
  if remote:
    (c,) = big
    assert c.spaces == ("HBM", "HBM") and c.instr.is_root
  else:
    assert big == []


def _aliasing_kernel(remote: bool):
  """A start-like Pallas kernel that aliases its parameter, as ours do; a
  computed result (``+ 1``): no copy of the received buffer."""
  return edge_copies.program(edge_copies.Variant(remote=remote, plus_one=True))


@pytest.mark.parametrize(
  "remote,donate,param_copied",
  [(False, False, True), (False, True, False), (True, True, True)],
)
def test_the_parameter_copy_is_the_starts_alias_on_v5p(
  remote, donate, param_copied
):
  # The evidence behind the parameter half of ``boundary``: a kernel that
  # aliases a parameter the caller still owns gets a copy of it (XLA must
  # assume the kernel writes it); donating the parameter removes the copy
  # for a kernel that does not communicate, not for one that does.
  mesh = _mesh("v5p:2x2x2")
  f = jax.jit(
    jax.shard_map(
      _aliasing_kernel(remote),
      mesh=mesh,
      in_specs=P("i"),
      out_specs=P("i"),
      check_vma=False,
    ),
    donate_argnums=(0,) if donate else (),
  )
  r = analyze(f, _x(mesh))
  start = next(
    i for i in r.module.entry.instrs if i.opcode == "custom-call" and i.aliasing
  )
  fed = r.module.instr(start.operands[0])
  assert (fed.opcode != "parameter") == param_copied, fed
  if param_copied:  # and the harness shows the copy at the edge
    assert any(c.kind in ("boundary", "memory_space") for c in r.copies)


def test_xla_collective_permute_result_is_copied_at_the_edge_on_v5p():
  # XLA's own collective-permute, its result returned: the same copy as a
  # done's result returned (design/scheduling.md section 4).
  mesh = _mesh("v5p:2x2x2")
  ring = [(j, (j + 1) % 8) for j in range(8)]
  f = jax.jit(
    jax.shard_map(
      lambda x: jax.lax.ppermute(x, "i", ring),
      mesh=mesh,
      in_specs=P("i"),
      out_specs=P("i"),
    )
  )
  r = analyze(f, _x(mesh))
  (c,) = [c for c in r.copies if c.kind != "scalar"]
  assert c.kind == "boundary" and c.instr.is_root
  assert c.nbytes == SHARD[0] * SHARD[1] * 4


def _overlap_step(x, w):  # the README's first program
  x, fut = asyncops.ppermute_start(x, "i", shift=1)
  z, fut = sch.overlap(fut, jnp.dot, x, w)
  return asyncops.ppermute_done(fut), z


def test_boundary_copies_report_their_bytes_on_v5p():
  from asyncops.inspect._json import report_dict

  mesh = _mesh("v5p:2x2x2")
  f = jax.jit(
    jax.shard_map(
      _overlap_step,
      mesh=mesh,
      in_specs=(P("i"), P()),
      out_specs=(P("i"), P("i")),
    )
  )
  w = jax.ShapeDtypeStruct(
    SHARD, jnp.float32, sharding=NamedSharding(mesh, P())
  )
  r = assert_copy_free(f, _x(mesh), w)  # boundary copies pass the guard
  mib4 = SHARD[0] * SHARD[1] * 4
  # The parameter sent (before the start) and the received buffer returned.
  assert [c.nbytes for c in r.boundary_copies] == [mib4, mib4]
  assert r.copied_bytes("boundary") == 2 * mib4
  assert r.copied_bytes() == sum(c.nbytes for c in r.copies)
  text = r.summary()
  assert "2 boundary (8 MiB)" in text
  assert "Boundary copies: 2, 8 MiB read and 8 MiB written per call" in text
  assert "(4 MiB) HBM->HBM copy of %param" in text
  d = report_dict(r)
  assert d["counts"]["boundary"] == 2
  assert d["copied_bytes"]["boundary"] == 2 * mib4
  assert {c["bytes"] for c in d["copies"] if c["kind"] == "boundary"} == {mib4}
  with pytest.raises(ValueError, match="copied_bytes.kind='edge'"):
    r.copied_bytes("edge")


def test_testing_assert_copy_free_is_the_guard_as_an_assertion():
  # asyncops.testing delegates to the guard and converts its error; its
  # copy_hazards lists the guard's hazards first.
  from asyncops import testing

  r = analyze(jax.jit(_program(LAX2)), _x(_mesh()))
  found = hazards(r)
  assert found and testing.copy_hazards(r)[: len(found)] == [
    str(h) for h in found
  ]
  with pytest.raises(AssertionError) as e:
    testing.assert_copy_free(r)
  assert e.type is AssertionError
  assert "endangers a transfer" in str(e.value)
  assert f"started at {THIS}:{_line('BODY')} in " in str(e.value)
  assert "Copies: " in str(e.value)  # the report follows


# name -> (global operand shapes, in_specs, out_specs), small shapes.
_CM_V5P = {
  "allgather_matmul": (
    ((256, 1024), (1024, 512)),
    (P("x", "y"), P(None, "y")),
    P("x", "y"),
  ),
  "matmul_reducescatter": (
    ((256, 1024), (1024, 512)),
    (P("x", "y"), P("y", None)),
    P("x", "y"),
  ),
  "matmul_allreduce": (
    ((256, 1024), (1024, 512)),
    (P("x", "y"), P("y", None)),
    P("x", None),
  ),
  "mlp_block": (
    ((256, 512), (512, 1024), (1024, 512)),
    (P("x", "y"), P(None, "y"), P("y", None)),
    P("x", "y"),
  ),
}


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("name", list(_CM_V5P))
def test_collective_matmuls_pass_the_guard_on_v5p(name, bidirectional):
  # Only edge copies on v5p: the parameter sent first (allgather), the
  # all-gathered result returned (allreduce, XLA's own all-gather).
  # (v4, v5e and v6e: tests/test_collective_matmul_tpu.py.)
  mesh = tpu_mesh("v5p:2x2x2", (2, 4), ("x", "y"))
  fn = getattr(asyncops.collective_matmul, name)
  shapes, specs, out = _CM_V5P[name]
  args = [
    jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=NamedSharding(mesh, p))
    for s, p in zip(shapes, specs, strict=True)
  ]
  f = asyncops.jit(
    jax.shard_map(
      functools.partial(
        fn, axis_name="y", bidirectional=bidirectional, method="ring"
      ),
      mesh=mesh,
      in_specs=specs,
      out_specs=out,
    )
  )
  f.lower(*args).compile()
  r = f.last_report
  r.assert_no_defensive_copies()
  r.assert_no_inflight_copies()
  assert {c.kind for c in r.copies} <= {"boundary", "memory_space", "scalar"}
  assert r.kernel_pairs and all(p.overlapped for p in r.kernel_pairs)
