"""Safe programs the guard refused, and the one copy that made it refuse.

Each program below compiles (v5e, v6e, v5p) to a same-space copy that
copy insertion adds right before a library start, whose result *is* the
buffer the start sends: the start aliases its operand to an output, and
the value it is given is read again afterwards (the residual of a layer
in a ``lax.scan``, a donated parameter that is also returned, a constant
``jax.checkpoint`` rematerializes). The copy reads no buffer in flight
and writes a new one before any DMA reads it (``Copy.feeds_source``;
``design/inspect.md``, "Copies that make a source"). The guard refused
each as a ``defensive copy``; it now accepts them, and still refuses the
same copy when anything else uses its result.
"""

import functools
import re

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import asyncops
from asyncops.inspect import CopyHazardError, analyze, hazards, tpu_mesh
from asyncops.inspect._analysis import _resolve, analyze_module
from asyncops.inspect._guard import check_report
from asyncops.inspect._hlo import parse_module

TOPOLOGIES = ("v5e:2x4", "v6e:2x4", "v5p:2x2x2")
SHARD = (1024, 1024)  # f32 per device


def scan_residual(x):
  """``h + allgather_matmul(h)`` per layer, in a ``lax.scan``."""
  w = jnp.ones((3, 1024, 128), x.dtype) * x[0, 0]

  def layer(h, w):
    y = asyncops.collective_matmul.allgather_matmul(
      h, w, axis_name="i", method="ring"
    )
    return h + y, None

  h, _ = lax.scan(layer, x[:, :128], w)
  return jnp.tile(h, (1, 8))


def sent_and_returned(x):
  """Sends its (donated) parameter and returns it."""
  x, fut = asyncops.ppermute_start(x, "i", shift=1)
  return asyncops.ppermute_done(fut), x


def remat_grad(x):
  """``jax.checkpoint`` around start and done, differentiated."""

  @jax.checkpoint
  def g(x):
    x, fut = asyncops.ppermute_start(x, "i", shift=1)
    z = jnp.tanh(x) @ x
    return asyncops.ppermute_done(fut) + z

  return jax.grad(lambda x: g(x).sum())(x)


PROGRAMS = {
  "scan_residual": (scan_residual, P("i"), ()),
  "donated_parameter": (sent_and_returned, (P("i"), P("i")), (0,)),
  "remat_grad": (remat_grad, P("i"), ()),
}


@functools.cache
def _report(name, topology):
  fn, out_specs, donate = PROGRAMS[name]
  mesh = tpu_mesh(topology, (8,), ("i",))
  x = jax.ShapeDtypeStruct(
    (8 * SHARD[0], SHARD[1]), jnp.float32, sharding=NamedSharding(mesh, P("i"))
  )
  f = jax.jit(
    jax.shard_map(fn, mesh=mesh, in_specs=P("i"), out_specs=out_specs),
    donate_argnums=donate,
  )
  return analyze(f, x)


def _feeding(r):
  """Copies outside every window whose result a start then sends."""
  m = r.module
  out = []
  for c in r.copies:
    if not c.pair or c.inflight or c.opcode != "copy":
      continue
    users = [
      i for i in m.computations[c.computation].instrs if c.name in i.operands
    ]
    if [u.name for u in users] == [c.pair[0]]:
      out.append(c)
  return out


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_a_copy_that_makes_the_source_is_accepted(name, topology):
  r = _report(name, topology)
  m = r.module
  copies = _feeding(r)
  assert copies, "XLA no longer copies the value sent"
  # v5p moves the donated parameter VMEM->HBM instead (a memory-space
  # copy, accepted before); everywhere else the copy stays in one space.
  moved = name == "donated_parameter" and topology.startswith("v5p")
  for c in copies:
    # Out of every window, scheduled right before the start that sends
    # its result, which nothing else reads.
    s = m.instr(c.pair[0])
    assert s.position > c.instr.position
    assert _resolve(m, (s.operands[0], ())) == (c.name, ())
    if moved:
      assert c.kind == "memory_space", c
    else:
      assert c.kind == "defensive" and c.spaces[0] == c.spaces[1], c
      assert c.feeds_source and c.grade == "", c
  assert all(p.source_live and p.dest_live for p in r.kernel_pairs)
  assert not r.inflight_copies and not r.unawaited_starts
  assert hazards(r) == [], [str(h) for h in hazards(r)]
  r.assert_no_hazards()


def _edit(text: str, name: str, old: str, new: str) -> str:
  line = re.search(rf"^\s*%{re.escape(name)} = .*$", text, re.M).group(0)
  edited = re.sub(rf"%{re.escape(old)}\b", f"%{new}", line, count=1)
  assert edited != line
  return text.replace(line, edited)


@pytest.mark.parametrize("topology", ("v5e:2x4", "v6e:2x4"))
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_the_same_copy_read_by_the_done_is_refused(name, topology):
  # The copy's result also read by the done (edited HLO; the done still
  # holds the buffer, so this one would be safe): the rule is narrow, a
  # copy with any reader besides the start stays a refused defensive copy.
  r = _report(name, topology)
  m = r.module
  c = _feeding(r)[0]
  d = m.instr(next(p.done for p in r.kernel_pairs if p.start == c.pair[0]))
  text = _edit(r.hlo_text, d.name, d.operands[0], c.name)
  bad = analyze_module(parse_module(text), text)
  (c2,) = [x for x in bad.copies if x.name == c.name]
  assert not c2.feeds_source
  assert "defensive copy" in {h.kind for h in hazards(bad)}
  with pytest.raises(CopyHazardError):
    check_report(bad)
