"""The fused reduce-scatter's sent partial sums kept live (branch h-rsrace).

The steps kernel ``ring_reducescatter_matmul`` sends from its output
``{0}`` (VMEM) and the done ``asyncops_ring_reducescatter_done`` waits for
those sends. On main, the fused all-reduce at (2048, 8192, 28672), bf16,
v5e (four row panels) had every panel's done after the last finish; XLA
evicted panel 2's sent partial sums to HBM right after its steps kernel,
gave the done the copy and their VMEM to panel 3 while the last sends
could still read it, and the guard passed it.

``tests/data/rs_sent_evicted_v5e.hlo`` is that compiled program (main at
a271e8a, ``/work/sweeps/rsfin/allreduce_probe.py v5e:2x4 2048,8192,28672
allreduce:asyncops_fused``), its Mosaic bodies and backend configs
dropped: the guard must refuse it, and pass it with the done given the
original buffer. The library's programs (each panel's start now takes
the previous panel's done token) compile clean on v5e and v6e.
"""

import functools
import pathlib

import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from asyncops import collective_matmul as cm
from asyncops.inspect import (
  CopyHazardError,
  analyze_module,
  check_hlo,
  parse_module,
)
from asyncops.inspect._rs_sent import sent_transfers
from tests import util as u

FIXTURE = pathlib.Path(__file__).parent / "data" / "rs_sent_evicted_v5e.hlo"
TOPOLOGIES = ("v5e:2x4", "v6e:2x4")


def _fixture() -> str:
  return FIXTURE.read_text()


def test_guard_refuses_sent_partial_sums_handed_to_a_copy():
  """Panel 2's done takes ``%copy-done``, the HBM copy of its steps
  kernel's sent partial sums: "source not live" and the copy in flight,
  each naming the steps kernel, its done and the user's line."""
  with pytest.raises(CopyHazardError) as e:
    check_hlo(_fixture(), "fused all-reduce")
  msg = str(e.value)
  assert "(2 hazards)" in msg, msg
  assert "source not live: %ring_reducescatter_matmul.6 " in msg, msg
  assert "in-flight copy: %copy-start (copy-start" in msg, msg
  assert "VMEM->HBM" in msg, msg
  pair = "%ring_reducescatter_matmul.6 -> %asyncops_ring_reducescatter_done.6"
  assert msg.count(pair) == 2, msg
  assert msg.count("started at _fused_variants.py:477") == 2, msg
  # The other three panels' sent partial sums reach their dones.
  for p in (4, 5, 7):
    assert f"%ring_reducescatter_matmul.{p} " not in msg, msg


def test_guard_pairs_each_steps_kernel_with_its_done():
  """Each of the four panels' steps kernels with the done that takes the
  same send semaphores (not another panel's)."""
  text = _fixture()
  r = analyze_module(parse_module(text), text)
  pairs = {s.name: d.name for s, d, _, _ in sent_transfers(r)}
  assert pairs == {
    f"ring_reducescatter_matmul.{p}": f"asyncops_ring_reducescatter_done.{p}"
    for p in (4, 5, 6, 7)
  }, pairs


def test_guard_passes_the_done_given_the_original():
  """The same program with panel 2's done given the original buffer (the
  copy then only reads it, its result unused): no hazard, so the rule
  is the copy handed to the done, not the copy itself."""
  text = _fixture()
  bad = "custom-call(%get-tuple-element.43, %copy-done,"
  assert text.count(bad) == 1
  text = text.replace(
    bad, "custom-call(%get-tuple-element.43, %get-tuple-element.46,"
  )
  check_hlo(text, "fused all-reduce, done given the original")


@functools.cache
def _allreduce_text(topology, shape):
  b, k, f = shape

  def fn(x, w):
    return cm.matmul_allreduce(x, w, "y", method="fused")

  jitted, args = u.aot_sharded(
    topology,
    fn,
    ((b, k), (k, f)),
    (P("x", "y"), P("y", None)),
    P("x", None),
    jnp.bfloat16,
  )
  return jitted.trace(*args).lower().compile().as_text()


def _calls(module, prefix):
  order = {i.name: t for t, i in enumerate(module.entry.instrs)}
  found = [
    i
    for i in module.entry.instrs
    if i.opcode == "custom-call" and i.name.split(".")[0] == prefix
  ]
  return sorted(found, key=lambda i: order[i.name]), order


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_fused_allreduce_panels_await_each_done(topology):
  """The probe's program from the library (``method="fused"``): in row
  panels, each panel's start after the first takes the previous panel's
  done token, so the schedule runs panel by panel (start, steps, finish,
  done); no copy of the sent partial sums or own products; the guard
  passes it."""
  text = _allreduce_text(topology, (2048, 8192, 28672))
  report = check_hlo(text, f"fused all-reduce {topology}")
  m = parse_module(text)
  starts, order = _calls(m, "asyncops_ring_reducescatter_start")
  steps, _ = _calls(m, "ring_reducescatter_matmul")
  dones, _ = _calls(m, "asyncops_ring_reducescatter_done")
  assert len(starts) == len(steps) == len(dones) > 1, len(steps)
  for prev, nxt in zip(dones[:-1], starts[1:], strict=True):
    assert prev.name in nxt.operands, (prev.name, nxt.operands)
  ours = sorted(starts + steps + dones, key=lambda i: order[i.name])
  kernels = [i.name for i in ours]
  assert kernels == [
    i.name for trio in zip(starts, steps, dones, strict=True) for i in trio
  ], kernels
  pairs = {s.name: d.name for s, d, _, _ in sent_transfers(report)}
  assert pairs == {s.name: d.name for s, d in zip(steps, dones, strict=True)}, (
    pairs
  )
  shapes = {tuple(lf.dims) for s in steps for lf in s.leaves}
  moved = [
    i.name
    for i in m.entry.instrs
    if i.opcode in ("copy", "copy-start")
    and any(tuple(lf.dims) in shapes for lf in i.leaves)
  ]
  assert not moved, moved
