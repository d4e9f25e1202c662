"""A copy that makes a Ref transfer's destination (design/inspect.md, "A
copy that makes a destination (branch h-guardfp)").

When the destination Ref's initial value is also another value's buffer
(``a, b = new_ref(x * 2), new_ref(x * 2)``, which XLA's CSE makes one
value, or a value XLA proves equal to one read after the start), copy
insertion gives the destination a buffer of its own: a same-space copy,
before the start, whose only reader is the start, in the operand the start
aliases and the DMA writes. No transfer is in flight on it; the guard
accepted such a copy only for a source and refused this one as a
``defensive copy``. It now accepts it (``Copy.feeds_destination``), and
refuses the same copy when anything else reads it or when it is not made
before the start. Numerics on 8 CPU devices against ``jax.lax``;
structure on compiled TPU HLO (v5e, v6e: the copy, VMEM to VMEM; v5p: the
same copy VMEM to HBM, a memory-space move accepted before).
"""

import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import asyncops
from asyncops import stateful as st
from asyncops.futures._future import NeverAwaitedWarning
from asyncops.inspect import CopyHazardError, analyze, hazards
from asyncops.inspect._analysis import _resolve, analyze_module
from asyncops.inspect._guard import check_report
from asyncops.inspect._hlo import parse_module
from asyncops.inspect._json import report_dict
from tests import util as u

N = 8
RING = [(k, (k + 1) % N) for k in range(N)]
PARTIAL = [(k, k + 1) for k in range(N - 1)]  # device 0 receives nothing


@pytest.fixture(autouse=True)
def _quiet_gc_warnings():
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", NeverAwaitedWarning)
    yield


def _mm(y):
  return jnp.tanh(y) @ y


def _ring(a, b):
  return st.ppermute_start(a, b, "i", shift=1)


def _part(a, b):
  return st.ppermute_start(a, b, "i", perm=PARTIAL)


def _lax_part(v, old):
  got = jax.lax.ppermute(v, "i", PARTIAL)
  return jnp.where(jax.lax.axis_index("i") == 0, old, got)


# Source and destination of one value (CSE'd): XLA copies it for b.
def _one_value(x):
  a, b = jax.new_ref(x * 2.0), jax.new_ref(x * 2.0)
  f = _ring(a, b)
  st.ppermute_done(f, a, b)
  return b[...]


def _one_value_partial(x):
  # Device 0 keeps b's own value: the copy is what it keeps.
  a, b = jax.new_ref(x * 2.0), jax.new_ref(x * 2.0)
  f = _part(a, b)
  st.ppermute_done(f, a, b)
  return b[...]


def _xla_equal_partial(x):
  # One value to XLA only (it drops the * 1 and CSEs the rest).
  a, b = jax.new_ref(x * 2.0), jax.new_ref(x * 2.0 * 1.0)
  f = _part(a, b)
  st.ppermute_done(f, a, b)
  return b[...]


# A window read of a local Ref c whose value XLA proves equal to the
# destination's (not the same computation in the jaxpr): tied after the
# start (h-topread), so XLA copies that value for b before the start.
def _tied(make_c):
  def body(x):
    a, b = jax.new_ref(x * 2.0), jax.new_ref(x * 3.0)
    c = make_c(x, b)
    f = _ring(a, b)
    z = _mm(c[...])
    st.ppermute_done(f, a, b)
    return b[...] + z

  return body


def _write_later(x, b):
  c = jax.new_ref(jnp.zeros_like(x))
  c[...] = b[...] * 1.0
  return c


def _halves(x, b):
  h = x.shape[0] // 2
  return jax.new_ref(jnp.concatenate([b[0:h], b[h:]]))


def _tied_lax(x):
  return jax.lax.ppermute(x * 2.0, "i", RING) + _mm(x * 3.0)


# case -> (program, lax reference, window reads tied)
CASES = {
  "source and destination one value": (
    _one_value,
    lambda x: jax.lax.ppermute(x * 2.0, "i", RING),
    False,
  ),
  "one value, partial perm": (
    _one_value_partial,
    lambda x: _lax_part(x * 2.0, x * 2.0),
    False,
  ),
  "x * 2 * 1 vs x * 2, partial perm": (
    _xla_equal_partial,
    lambda x: _lax_part(x * 2.0, x * 2.0),
    False,
  ),
  "tied c = new_ref(b[...] * 1)": (
    _tied(lambda x, b: jax.new_ref(b[...] * 1.0)),
    _tied_lax,
    True,
  ),
  "tied c = new_ref(x * 3 * 1)": (
    _tied(lambda x, b: jax.new_ref(x * 3.0 * 1.0)),
    _tied_lax,
    True,
  ),
  "tied c = new_ref(b reshaped twice)": (
    _tied(lambda x, b: jax.new_ref(b[...].reshape(-1).reshape(x.shape))),
    _tied_lax,
    True,
  ),
  "tied c = new_ref(b[...].T.T)": (
    _tied(lambda x, b: jax.new_ref(b[...].T.T)),
    _tied_lax,
    True,
  ),
  "tied c = new_ref(concat of b's halves)": (_tied(_halves), _tied_lax, True),
  "tied c[...] = b[...] * 1": (_tied(_write_later), _tied_lax, True),
}


def _jit(body, mesh):
  return jax.jit(
    jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i"))
  )


@pytest.mark.parametrize("case", list(CASES))
def test_numbers_match_lax(case):
  # lax's numbers at both emulation points; the window's read of c tied
  # (two asyncops_tie barriers: after the start and after the compute).
  body, lax_ref, tied = CASES[case]
  mesh = jax.make_mesh((N,), ("i",), devices=jax.devices()[:N])
  x = jax.random.normal(jax.random.key(1), (N * 128, 128)) / 4
  x = jax.device_put(x, NamedSharding(mesh, P("i")))
  want = np.asarray(_jit(lax_ref, mesh)(x))
  for transfer in ("start", "done"):
    with asyncops.emulation(transfer):
      got = np.asarray(_jit(body, mesh)(x))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
  g = jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i"))
  assert u.count_ties(jax.make_jaxpr(g)(x).jaxpr) == (2 if tied else 0)


@functools.cache
def _report(case, topology):
  f, x = u.ring_program(CASES[case][0], topology, (1024, 1024))
  return analyze(f, x)


def _makes_destination(r, c):
  """``c`` is operand 1 (aliased to output 0) of a Ref start scheduled
  after it, and nothing else reads it."""
  m = r.module
  s = m.instr(c.pair[0])
  readers = [i for comp in m.computations.values() for i in comp.instrs]
  readers = [i.name for i in readers if c.name in i.operands]
  (k,) = {k for _, k, _ in s.aliasing}
  return (
    readers == [s.name]
    and s.position > c.instr.position
    and _resolve(m, (s.operands[k], ())) == (c.name, ())
  )


@pytest.mark.parametrize("topology", ["v5e:2x4", "v6e:2x4"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_copy_that_makes_the_destination_is_accepted(case, topology):
  r = _report(case, topology)
  (copy,) = r.defensive_copies
  assert copy.spaces[0] == copy.spaces[1] and not copy.inflight
  assert _makes_destination(r, copy)
  assert copy.feeds_destination and not copy.feeds_source
  # Reported as such, not silently (the text report and the JSON).
  assert "copy insertion makes the destination buffer" in r.summary()
  (row,) = [c for c in report_dict(r)["copies"] if c["name"] == copy.name]
  assert row["accepted"] == "feeds_destination"
  (pair,) = r.kernel_pairs
  assert pair.source_live and pair.dest_live and not pair.inplace_writes
  assert pair.overlapped == CASES[case][2]
  assert not r.inflight_copies and not r.unawaited_starts
  assert hazards(r) == [], [str(h) for h in hazards(r)]


@pytest.mark.parametrize("case", list(CASES))
def test_v5p_makes_the_destination_by_a_move(case):
  # v5p makes the same copy from VMEM into HBM: a memory-space copy, which
  # the guard accepted before; clean, the tied compute overlapped.
  r = _report(case, "v5p:2x2x2")
  assert not r.defensive_copies and not r.inflight_copies
  moves = [c for c in r.copies if c.pair and c.kind == "memory_space"]
  assert [c.spaces for c in moves if _makes_destination(r, c)] == [
    ("VMEM", "HBM")
  ]
  assert hazards(r) == []
  (pair,) = r.kernel_pairs
  assert pair.overlapped == CASES[case][2]


def _line(text, name):
  return re.search(rf"^\s*%{re.escape(name)} = .*$", text, re.M).group(0)


def _edit(text, name, old, new):
  line = _line(text, name)
  edited = re.sub(rf"%{re.escape(old)}\b", f"%{new}", line, count=1)
  assert edited != line
  return text.replace(line, edited)


def _refused(text, copy_name, hint=True):
  bad = analyze_module(parse_module(text), text)
  (c2,) = [c for c in bad.copies if c.name == copy_name]
  assert not c2.feeds_destination and not c2.feeds_source
  assert "defensive copy" in {h.kind for h in hazards(bad)}
  with pytest.raises(CopyHazardError, match="defensive copy") as e:
    check_report(bad)
  # The message says what the copy is and what to do (a copy before the
  # start of the value it takes as its destination).
  said = "the destination Ref's value before the start" in str(e.value)
  assert said == hint
  assert ("give it a value of its own" in str(e.value)) == hint


@pytest.mark.parametrize("topology", ["v5e:2x4", "v6e:2x4"])
def test_the_same_copy_read_by_the_done_is_refused(topology):
  # Edited HLO: the done also reads the copy (as its source operand). The
  # rule is narrow: a copy with any reader besides the start stays a
  # refused defensive copy.
  r = _report("source and destination one value", topology)
  (c,) = r.defensive_copies
  (pair,) = r.kernel_pairs
  d = r.module.instr(pair.done)
  _refused(_edit(r.hlo_text, d.name, d.operands[0], c.name), c.name)


@pytest.mark.parametrize("topology", ["v5e:2x4", "v6e:2x4"])
def test_the_same_copy_as_the_source_is_refused(topology):
  # Edited HLO: the start takes the copy as its source too (operand 0,
  # which the DMA reads while writing operand 1): not a buffer that only
  # the destination role owns.
  r = _report("source and destination one value", topology)
  (c,) = r.defensive_copies
  (pair,) = r.kernel_pairs
  s = r.module.instr(pair.start)
  _refused(_edit(r.hlo_text, s.name, s.operands[0], c.name), c.name)


@pytest.mark.parametrize("topology", ["v5e:2x4", "v6e:2x4"])
def test_the_same_copy_after_the_start_is_refused(topology):
  # Edited HLO: the copy scheduled after the start (its line moved below
  # the start's): not made before the DMA writes it.
  r = _report("source and destination one value", topology)
  (c,) = r.defensive_copies
  (pair,) = r.kernel_pairs
  text = r.hlo_text
  copy_line, start_line = _line(text, c.name), _line(text, pair.start)
  text = text.replace(copy_line + "\n", "", 1)
  text = text.replace(start_line, start_line + "\n" + copy_line, 1)
  _refused(text, c.name, hint=False)


def test_v5p_large_destination_copy_in_hbm_is_accepted():
  # 4096^2 f32 per device: v5p copies the shared value HBM -> HBM for the
  # destination (a defensive copy main refused), accepted the same way.
  f, x = u.ring_program(_one_value, "v5p:2x2x2", (4096, 4096))
  r = analyze(f, x)
  (copy,) = r.defensive_copies
  assert copy.spaces == ("HBM", "HBM") and copy.feeds_destination
  assert _makes_destination(r, copy)
  assert hazards(r) == [], [str(h) for h in hazards(r)]
