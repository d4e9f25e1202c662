"""The guard on every path: branches, and copies in flight for two transfers.

Two holes of the harness (``design/inspect.md``, "Every path"), each shown
on programs compiled ahead of time for TPU (v5e and v6e) or on their HLO
edited into the unsafe neighbour:

- a future awaited in one branch of a ``lax.cond`` and dropped in the
  other reached a done, so the start counted as awaited, and the guard
  passed a program whose DMA runs on, unwaited, on the other branch;
- a future whose source one branch passes through and the other replaces:
  the source reached the done through the first branch, so it counted as
  live, while XLA (branches are exclusive) computes the other branch's
  value into the very buffer the DMA reads;
- a copy in flight for two transfers was graded by the first one only
  (``Copy.grade``, ``Report.assert_no_hazards``): harmless for that one,
  it passed while it was the buffer the second one's done waits on.
"""

import pathlib
import re

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import asyncops
from asyncops import scheduling as sch
from asyncops.inspect import CopyHazardError, analyze, hazards
from asyncops.inspect._analysis import _resolve, analyze_module
from asyncops.inspect._guard import check_report
from asyncops.inspect._hlo import parse_module
from tests import util as u

THIS = pathlib.Path(__file__).name
TOPOLOGIES = ("v5e:2x4", "v6e:2x4")
SHARD = (1024, 1024)  # f32 per device


def _line(marker: str) -> int:
  return u.marker_line(__file__, marker)


def _compile(fn, topology):
  return u.ring_program(fn, topology, SHARD)


@pytest.fixture
def no_trace_checks(monkeypatch):
  """The trace-time future check off: the guard is its backstop."""
  from asyncops import _jax_compat as jc

  monkeypatch.setattr(jc, "_jaxpr_checks", [])


# A future awaited on one branch only ------------------------------------------


def awaited_on_one_branch(x):
  _, fut = asyncops.ppermute_start(x * 2.0, "i", shift=1)  # ONE_BRANCH
  p = lax.axis_index("i") == 0
  return lax.cond(p, lambda f, a: asyncops.ppermute_done(f), _drop, fut, x)


def _drop(f, a):
  return a * 3.0


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_a_future_dropped_on_a_branch_is_refused(topology, no_trace_checks):
  f, x = _compile(awaited_on_one_branch, topology)
  r = analyze(f, x)
  # What XLA compiles: the start's tuple goes to the awaiting branch only;
  # the other branch neither takes it nor waits, and after the conditional
  # nothing holds the source or the destination.
  (p,) = r.kernel_pairs
  assert len(p.crossing) == 1 and p.crossing[0].startswith("into branch")
  cond = r.module.instr(p.crossing[0].rpartition(" %")[2])
  assert len(cond.branches) == 2
  assert r.unawaited_branches == ((p.start, _other_branch(p, cond)),)
  (h,) = [h for h in hazards(r) if h.kind == "start with no done on a branch"]
  assert h.start_line.startswith(f"{THIS}:{_line('ONE_BRANCH')} in ")
  with pytest.raises(AssertionError, match="has no done on branch"):
    r.assert_no_hazards()
  with pytest.raises(CopyHazardError, match="no done waits for them"):
    asyncops.inspect.assert_copy_free(f, x)


def _other_branch(p, cond):
  k = int(p.crossing[0].split()[2])
  return f"branch {1 - k} of %{cond.name}"


def awaited_on_both_branches(x):
  _, fut = asyncops.ppermute_start(x * 2.0, "i", shift=1)
  p = lax.axis_index("i") == 0
  return lax.cond(
    p,
    lambda f, a: asyncops.ppermute_done(f),
    lambda f, a: asyncops.ppermute_done(f) * a,
    fut,
    x,
  )


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_a_future_awaited_on_every_branch_passes(topology):
  f, x = _compile(awaited_on_both_branches, topology)
  r = analyze(f, x)
  assert len(r.kernel_pairs) == 2 and not r.unawaited_branches
  assert hazards(r) == [], [str(h) for h in hazards(r)]


# A source one branch replaces -------------------------------------------------


def source_replaced_on_a_branch(x):
  y = x * 5.0
  _, fut = asyncops.ppermute_start(x * 2.0, "i", shift=1)  # REPLACED
  z = jnp.tanh(y) @ y
  p = lax.axis_index("i") == 0

  def replace(f, z):  # a new source in the future: the done holds it
    leaves, tree = jax.tree.flatten(f)
    leaves[2] = jnp.sin(z)
    return jax.tree.unflatten(tree, leaves)

  fut = lax.cond(p, lambda f, z: f, replace, fut, z)
  return asyncops.ppermute_done(fut) + z


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_a_source_replaced_on_a_branch_is_not_live(topology, no_trace_checks):
  f, x = _compile(source_replaced_on_a_branch, topology)
  r = analyze(f, x)
  m = r.module
  (p,) = r.kernel_pairs
  s, d = m.instr(p.start), m.instr(p.done)
  # What XLA compiles: the done takes the conditional's result; the
  # identity branch returns its parameter (the start's aliased source)
  # with no copy, so the result *is* the source's buffer, and the other
  # branch computes sin(z) into it while the DMA reads it.
  cond = m.instr(_resolve(m, (d.operands[0], ()))[0])
  assert cond.opcode == "conditional"
  roots = [m.computations[b].root for b in cond.branches]
  assert sorted(r.opcode for r in roots) == ["fusion", "parameter"] or (
    sorted(r.opcode for r in roots) == ["parameter", "sine"]
  ), [r.opcode for r in roots]
  k = next(k for k, r in enumerate(roots) if r.opcode == "parameter")
  assert _resolve(m, (cond.operands[k + 1], ())) == (s.name, (0,))
  assert not [c for c in r.copies if c.computation in cond.branches]
  # Reachable through the identity branch, so it was "live"; not on
  # every path.
  assert not p.source_live
  (h,) = [h for h in hazards(r) if h.kind == "source not live"]
  assert h.start_line.startswith(f"{THIS}:{_line('REPLACED')} in ")
  with pytest.raises(CopyHazardError, match="source not live"):
    asyncops.inspect.assert_copy_free(f, x)


def future_through_both_branches(x):
  _, fut = asyncops.ppermute_start(x * 2.0, "i", shift=1)
  p = lax.axis_index("i") == 0

  def branch(fn):
    def run(f, z):
      z, f = sch.overlap(f, lambda a: fn(a) @ a, z)
      return f, z

    return run

  fut, z = lax.cond(p, branch(jnp.tanh), branch(jnp.sin), fut, x)
  return asyncops.ppermute_done(fut) + z


def future_forwarded_past_both_branches(x):
  """Both branches return the future unchanged, with no barrier: JAX takes
  it out of the cond (the result is the operand), which keeps the operand,
  unused by every branch. The trace-time check refused this once."""
  _, fut = asyncops.ppermute_start(x * 2.0, "i", shift=1)
  p = lax.axis_index("i") == 0

  def branch(fn):
    return lambda f, z: (f, fn(z) @ z)

  fut, z = lax.cond(p, branch(jnp.tanh), branch(jnp.sin), fut, x)
  return asyncops.ppermute_done(fut) + z


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_a_future_forwarded_past_both_branches_passes(topology):
  f, x = _compile(future_forwarded_past_both_branches, topology)
  r = analyze(f, x)  # traced with the future check on
  (p,) = r.kernel_pairs
  # The semaphores do not enter the conditional (XLA may pass the
  # unused operands in, but no branch returns them).
  assert not [c for c in p.crossing if c.startswith("out of")], p.crossing
  assert not r.unawaited_branches and p.source_live and p.dest_live
  assert hazards(r) == [], [str(h) for h in hazards(r)]


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_a_future_through_both_branches_passes(topology):
  # Semaphores and buffers go into both branches and out of the
  # conditional to one done, with no copy (XLA keeps the result in place).
  # The start's trace visits each position once, so only the first branch
  # is seen reaching the done: the every-branch rules must not refuse it.
  # The barriers of ``overlap`` keep JAX from forwarding the future past
  # the cond (``future_forwarded_past_both_branches``).
  f, x = _compile(future_through_both_branches, topology)
  r = analyze(f, x)
  (p,) = r.kernel_pairs
  assert p.crossing[0].startswith("into branch ") and len(p.crossing) == 2
  cond = r.module.instr(p.crossing[1].rpartition(" %")[2])
  for b in cond.branches:  # each branch passes the semaphores on
    root = r.module.computations[b].root
    assert root.opcode == "tuple"
    assert all(
      r.module.instr(o).opcode == "get-tuple-element" for o in root.operands[:4]
    )
  assert not r.unawaited_branches and p.source_live and p.dest_live
  assert hazards(r) == [], [str(h) for h in hazards(r)]


def ref_source_written_on_a_branch(x):
  """The Ref API: each branch awaits, one writes the source first."""
  from asyncops import stateful

  a, b = jax.new_ref(x * 2.0), jax.new_ref(jnp.zeros_like(x))
  fa = stateful.ppermute_start(a, b, "i", shift=1)  # REF_BRANCH

  def write_then_wait(f):
    a[...] = jnp.sin(x)
    stateful.ppermute_done(f, a, b)

  p = lax.axis_index("i") == 0
  lax.cond(p, lambda f: stateful.ppermute_done(f, a, b), write_then_wait, fa)
  return b[...] + a[...]


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_a_ref_source_written_on_a_branch_is_refused(topology, no_trace_checks):
  # One pair per branch (each has its own done): the writing branch's done
  # takes the new value of ``a``, computed into a buffer of its own, not
  # the one the DMA reads. Refused per pair, before this change too.
  f, x = _compile(ref_source_written_on_a_branch, topology)
  r = analyze(f, x)
  pairs = r.kernel_pairs
  assert len(pairs) == 2 and not r.unawaited_branches
  assert sorted(p.source_live for p in pairs) == [False, True]
  (h,) = [h for h in hazards(r) if h.kind == "source not live"]
  assert h.start_line.startswith(f"{THIS}:{_line('REF_BRANCH')} in ")


# A loop that may run zero times ----------------------------------------------


def _maybe_zero_trips(use_after):
  def f(x):
    n = lax.axis_index("i") % 2  # zero trips on half the devices
    x1, fut = asyncops.ppermute_start(x * 2.0, "i", shift=1)  # ZERO_TRIPS

    def body(c):
      i, fut = c
      y = asyncops.ppermute_done(fut) + 1.0
      return i + 1, asyncops.ppermute_start(y, "i", shift=1)[1]

    _, fut = lax.while_loop(lambda c: c[0] < n, body, (0, fut))
    y = asyncops.ppermute_done(fut)
    return y + x1.at[0].set(5.0) if use_after else y

  return f


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("use_after", [False, True])
def test_a_loop_that_may_not_run(topology, use_after):
  # With zero trips the prologue's transfer is awaited by the epilogue's
  # done, a pair the harness does not list (it follows a while operand
  # into the body only). Argued safe (design/inspect.md, "Every path"):
  # the carry is one buffer live to the epilogue done; any other use of
  # the prologue's buffers after the loop makes XLA copy them before the
  # loop, inside the prologue's window, which is refused.
  f, x = _compile(_maybe_zero_trips(use_after), topology)
  r = analyze(f, x)
  if not use_after:
    assert hazards(r) == [], [str(h) for h in hazards(r)]
    assert not r.copies or {c.kind for c in r.copies} <= {
      "memory_space",
      "scalar",
    }
    return
  (c,) = [c for c in r.copies if c.inflight]
  assert c.inflight.startswith("source of") and "into %while" in c.inflight
  while_ = r.module.instr(c.inflight.rpartition("into %")[2].rstrip("]"))
  assert c.computation == while_.computation
  assert c.instr.position < while_.position  # before the loop
  # Not a false refusal: the use after the loop, x1.at[0].set, is run by
  # XLA before the loop, in place on the buffer the prologue's DMA reads
  # (the copy feeds the carry; buffer assignment gives the source and the
  # dynamic-update-slice one offset, v5e and v6e; design/inspect.md).
  (w,) = [h for h in hazards(r) if h.kind == "in-place write"]
  dus = r.module.instr(w.instr.lstrip("%"))
  assert dus.opcode == "dynamic-update-slice", dus
  assert dus.computation == while_.computation
  assert dus.position < while_.position
  assert w.start == c.inflight.split()[2].lstrip("%")
  with pytest.raises(CopyHazardError) as e:
    asyncops.inspect.assert_copy_free(f, x)
  assert f"{THIS}:{_line('ZERO_TRIPS')} in " in str(e.value)


# A copy in flight for two transfers -------------------------------------------


def _edit(text: str, name: str, old: str, new: str) -> str:
  """``text`` with operand ``%old`` of instruction ``%name`` made ``%new``."""
  line = re.search(rf"^\s*%{re.escape(name)} = .*$", text, re.M).group(0)
  edited = re.sub(rf"%{re.escape(old)}\b", f"%{new}", line, count=1)
  assert edited != line
  return text.replace(line, edited)


def _analyze(text):
  return analyze_module(parse_module(text), text)


@pytest.mark.parametrize("topology", ("v5e:2x4", "v5p:2x2x2"))
def test_a_copy_in_flight_for_two_transfers_takes_the_worst_grade(topology):
  # The two-way Ref ring with bfloat16 accumulators: XLA prefetches a
  # received half into VMEM inside the windows of two transfers in flight
  # (one per direction). Edit it into a read of the first transfer's
  # source (harmless: graded ``cost``) whose result the second transfer's
  # done waits on as its destination (the buffer the DMA never writes).
  # Graded by the first transfer only, it was ``cost``, and
  # ``Report.assert_no_hazards`` passed it.
  from tests.test_guard_read_only import _ring_text

  text = _ring_text(topology)
  r = _analyze(text)
  m = r.module
  pairs = r.kernel_pairs
  found = None
  for c in r.inflight_copies:
    i = m.instr(c.name)
    windows = [
      p
      for p in pairs
      if m.instr(p.start).computation == i.computation == p.done_computation
      and m.instr(p.start).position < i.position < m.instr(p.done).position
    ]
    if len({p.start for p in windows}) >= 2:
      found = c, windows[0], windows[-1]
      break
  assert found, "no copy inside the windows of two transfers"
  c, first, second = found
  s, d = m.instr(first.start), m.instr(second.done)
  (src,) = [
    o
    for k, o in enumerate(s.operands)
    if k not in {a[1] for a in s.aliasing}
    and m.instr(o).leaves[0].num_elements > 2
  ]  # what the first transfer's DMA reads
  ((_, k, _),) = d.aliasing  # the second Ref done's destination operand
  copy_done = next(
    u.name
    for comp in m.computations.values()
    for u in comp.instrs
    if u.opcode == "copy-done" and u.operands == (c.name,)
  )
  if c.operand != src:  # v5p: the copy reads the second one's source
    text = _edit(text, c.name, c.operand, src)
  bad = _analyze(_edit(text, d.name, d.operands[k], copy_done))
  (c2,) = [x for x in bad.copies if x.name == c.name]
  assert c2.grade == "hazard", c2
  assert c2.inflight.startswith("result used as the destination of"), c2
  assert c2.pair == (second.start, second.done)
  assert not c2.read_only_source
  with pytest.raises(AssertionError, match="hazards found"):
    bad.assert_no_hazards()
  kinds = {h.kind for h in hazards(bad)}
  assert {"in-flight copy", "destination not live"} <= kinds, kinds
  with pytest.raises(CopyHazardError):
    check_report(bad)
