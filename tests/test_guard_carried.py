"""The guard on a Ref future carried through a scan and awaited in a branch.

A Ref future carried through ``lax.scan``, awaited in both branches of a
``lax.cond`` in the body and restarted, its final done after the loop
(``tests/test_stateful.py::_carried_then_branch``). The source Ref's value
is loop-invariant: XLA passes it into the while as a tuple element the
body returns unchanged, and on v5e, v5p and v4 hands the done after the
loop the while's *operand* (the value before the loop) instead of its
result. Buffer assignment gives the operand, the body's element and the
while's result one value, one allocation, live to that done (the DMA of
the start in the body reads the buffer the done holds), so the guard's
"source not live" was a false positive there (``design/inspect.md``, "A
Ref future carried through scan, awaited in a branch (branch h-carry)").
The rule (``_analysis._loop_invariant``) takes only the exact
pass-through; the compiled HLO edited into its unsafe neighbours (the
body returns another value in that slot, a copy in the body or before the
loop, a write into the hoisted value before the done) is still refused.

On jax 0.9 the program is refused at trace time
(``stateful._api._unpin_captured``).
"""

import functools
import pathlib
import re

import jax
import jax.numpy as jnp
import pytest

import asyncops
from asyncops import _jax_compat as jc
from asyncops import stateful as st
from asyncops.inspect import CopyHazardError, hazards
from asyncops.inspect._analysis import (
  _buffers,
  _Graph,
  _loop_invariant,
  _reaches,
  _resolve,
  analyze_module,
)
from asyncops.inspect._guard import check_hlo
from asyncops.inspect._hlo import parse_module
from tests import util as u

THIS = pathlib.Path(__file__).name
TOPOLOGIES = ("v5e:2x4", "v6e:2x4", "v5p:2x2x2", "v4:2x2x1")
HOISTED = ("v5e:2x4", "v5p:2x2x2", "v4:2x2x1")  # the done takes the operand
SHARD = (1024, 1024)  # f32 per device


def carried_then_branch(x):
  a, b = jax.new_ref(x * 2.0), jax.new_ref(jnp.zeros_like(x))
  i = jax.lax.axis_index("i")

  def step(fut, _):
    done = lambda: st.ppermute_done(fut, a, b)  # noqa: E731  # DONE_IN_BRANCH
    jax.lax.cond(i == 0, done, done)
    return st.ppermute_start(a, b, "i", shift=1), None

  fut, _ = jax.lax.scan(step, st.ppermute_start(a, b, "i", shift=1), None, 2)
  st.ppermute_done(fut, a, b)
  return b[...]


@functools.cache
def _text(topology: str) -> str:
  f, x = u.ring_program(carried_then_branch, topology, SHARD)
  return f.trace(x).lower().compile().as_text()


def _analyze(text):
  return analyze_module(parse_module(text), text)


def _loop_pair(r):
  """The pair of the start in the scan body and the done after the loop."""
  m = r.module
  (p,) = [
    p
    for p in r.kernel_pairs
    if m.instr(p.done).computation == m.entry_name
    and m.instr(p.start).computation != m.entry_name
  ]
  return p


def _compiled(topology: str):
  """The program's text, its parsed module and the loop's pair."""
  text = _text(topology)
  r = _analyze(text)
  return text, r.module, _loop_pair(r)


def _edit(text: str, name: str, old: str, new: str) -> str:
  """``text`` with operand ``%old`` of instruction ``%name`` made ``%new``."""
  line = re.search(
    rf"^\s*(?:ROOT )?%{re.escape(name)} = .*$", text, re.M
  ).group(0)
  edited = re.sub(rf"%{re.escape(old)}\b", f"%{new}", line, count=1)
  assert edited != line
  return text.replace(line, edited)


def _insert_before(text: str, name: str, new_line: str) -> str:
  """``text`` with ``new_line`` scheduled just before ``%name``."""
  line = re.search(
    rf"^\s*(?:ROOT )?%{re.escape(name)} = .*$", text, re.M
  ).group(0)
  head = line[: len(line) - len(line.lstrip())]
  return text.replace(line, f"{head}{new_line}\n{line}")


def _shape(m, name: str) -> str:
  return m.instr(name).shape_text


def _refused_on_0_9():
  line = u.marker_line(__file__, "DONE_IN_BRANCH")
  f, x = u.ring_program(carried_then_branch, "v5e:2x4", SHARD)
  with pytest.raises(
    NotImplementedError,
    match=rf"ppermute_done at \S*{THIS}:{line} .*lax\.cond branch.*jax 0\.9",
  ):
    f.trace(x)


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_a_loop_invariant_source_carried_through_scan_is_clean(topology):
  if not jc.CAPTURED_DONE_SOURCE_LIVE:
    _refused_on_0_9()
    return
  text = _text(topology)
  r = _analyze(text)
  assert hazards(r) == [], [str(h) for h in hazards(r)]
  check_hlo(text)
  m = r.module
  p = _loop_pair(r)
  assert p.source_live
  s, d = m.instr(p.start), m.instr(p.done)
  (src,) = _buffers(m, s)[0]
  # The start in the body reads a while-body parameter element that the
  # body returns unchanged; the rule resolves it to the loop's operand.
  name, idx = _resolve(m, src)
  param = m.instr(name)
  assert param.opcode == "parameter" and param.computation == s.computation
  root = m.computations[s.computation].root
  e = m.instr(root.operands[idx[0]])
  assert e.opcode == "get-tuple-element" and e.operands == (name,)
  outer = _loop_invariant(m, _Graph(m), src)
  assert m.instr(outer[0]).computation == m.entry_name
  # The done's source: the loop's operand itself (v5e, v5p, v4) or the
  # while's result element of the same index (v6e).
  (w,) = [i for i in m.computations[m.entry_name].instrs if i.opcode == "while"]
  held = _resolve(m, (d.operands[0], ()))
  assert held == (outer if topology in HOISTED else (w.name, idx)), held
  assert _resolve(m, (w.operands[0], idx)) == outer
  # What the rule is for: where XLA handed the done the loop's operand,
  # the body's buffer alone does not reach it.
  g = _Graph(m)
  assert _reaches(g, [src], d) == (topology not in HOISTED)
  assert _reaches(g, [outer], d)
  # asyncops.jit (the guard on every TPU compile) compiles it.
  f, x = u.ring_program(carried_then_branch, topology, SHARD)
  asyncops.jit(f.__wrapped__).lower(x).compile()


@pytest.mark.parametrize("topology", HOISTED[:2])
@pytest.mark.parametrize("edit", ["another value", "copy in the body"])
def test_a_body_that_replaces_the_source_slot_is_refused(topology, edit):
  # The body returns something other than the element it was given (a
  # value it computed, or a copy of it): the start's source is that
  # iteration's value, not the loop operand the done holds.
  if not jc.CAPTURED_DONE_SOURCE_LIVE:
    _refused_on_0_9()
    return
  text, m, p = _compiled(topology)
  s = m.instr(p.start)
  (src,) = _buffers(m, s)[0]
  name, idx = _resolve(m, src)
  root = m.computations[s.computation].root
  elem = root.operands[idx[0]]
  if edit == "another value":
    # the destination the conditional returns: same shape, a new buffer
    (new,) = [
      i.name
      for i in m.computations[s.computation].instrs
      if i.opcode == "conditional"
    ]
  else:
    new = "carried.copy"
    text = _insert_before(
      text, root.name, f"%{new} = {_shape(m, elem)} copy(%{elem})"
    )
  text = _edit(text, root.name, elem, new)
  bad = _analyze(text)
  kinds = {h.kind for h in hazards(bad)}
  assert "source not live" in kinds, kinds
  with pytest.raises(CopyHazardError, match="source not live"):
    check_hlo(text)


@pytest.mark.parametrize("topology", HOISTED[:2])
def test_a_copy_before_the_loop_is_refused(topology):
  # The loop's operand is a copy of the value the done holds: the DMA reads
  # the copy, which nothing keeps alive to the done.
  if not jc.CAPTURED_DONE_SOURCE_LIVE:
    _refused_on_0_9()
    return
  text, m, p = _compiled(topology)
  d = m.instr(p.done)
  value = d.operands[0]
  (w,) = [i for i in m.computations[m.entry_name].instrs if i.opcode == "while"]
  tup = m.instr(w.operands[0])
  assert tup.opcode == "tuple" and value in tup.operands
  new = "invariant.copy"
  text = _insert_before(
    text, tup.name, f"%{new} = {_shape(m, value)} copy(%{value})"
  )
  text = _edit(text, tup.name, value, new)
  kinds = {h.kind for h in hazards(_analyze(text))}
  assert "source not live" in kinds, kinds


@pytest.mark.parametrize("topology", HOISTED[:2])
def test_a_write_into_the_hoisted_source_before_the_done_is_refused(topology):
  # After the loop, before its done, an in-place write into the value the
  # loop passed through (the buffer the body's DMA reads): the rule makes
  # that value the source, so the write is in the window.
  if not jc.CAPTURED_DONE_SOURCE_LIVE:
    _refused_on_0_9()
    return
  text, m, p = _compiled(topology)
  d = m.instr(p.done)
  value = d.operands[0]
  zero = next(
    i.name
    for i in m.computations[m.entry_name].instrs
    if i.opcode == "constant" and i.shape_text.startswith("s32[]")
  )
  shape = _shape(m, value)
  text = _insert_before(
    text,
    d.name,
    f"%write.into = {shape} dynamic-update-slice(%{value}, %{d.operands[1]}"
    f", %{zero}, %{zero})",
  )
  bad = _analyze(text)
  writes = [h for h in hazards(bad) if h.kind == "in-place write"]
  assert [h.instr for h in writes] == ["write.into"], [
    str(h) for h in hazards(bad)
  ]
  assert writes[0].start == p.start
  with pytest.raises(CopyHazardError, match="in-place write"):
    check_hlo(text)
