"""The kernels as compiled for TPU: structure of the scheduled HLO.

Every op is compiled ahead of time for real TPU topologies from the CPU host
and the compiled HLO text is read back. Each start and done must be a Mosaic
custom call with our instruction name; the done must alias the destination
(exactly one alias per kernel, jax-ml/jax#24023); the start's semaphore
outputs must reach the done; and start kernels that synchronise with
different peer patterns must use different barrier ids (the barrier race of
jax-ml/jax PR #27963).
"""

import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import topologies
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import asyncops
from asyncops import _jax_compat as jc
from asyncops.inspect import Instr, Module, parse_module

# Several test processes may compile for TPU at once on one host; libtpu
# otherwise refuses to load twice (it takes a lock meant for real chips).
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

TOPOLOGIES = ("v5e:2x4", "v4:2x2x1", "v6e:2x4")
SEM = ("s32", (), 2)  # a DMA semaphore: s32[] in memory space S(2)


def is_sem(leaf) -> bool:
  """Whether a shape leaf is a semaphore (the tiling printed varies by
  libtpu version: ``s32[]{:S(2)}`` or ``s32[]{:T(128)S(2)}``)."""
  return (leaf.dtype, leaf.dims, leaf.memory_space) == SEM


# HLO helpers (parsing is asyncops.inspect's) ---------------------------------


def kernels(m: Module, kind: str, phase: str) -> list[Instr]:
  """Our custom calls ``asyncops_<kind>_<phase>``, in name order."""
  pattern = re.compile(rf"asyncops_{kind}_{phase}(\.\d+)?$")
  return sorted(
    (i for i in m.instructions.values() if pattern.match(i.name)),
    key=lambda i: i.name,
  )


def sem_outputs(m: Module, start: Instr) -> set[str]:
  """Names of the ``get-tuple-element``s taking semaphores out of a start."""
  return {
    i.name
    for i in m.instructions.values()
    if i.opcode == "get-tuple-element"
    and i.operands == (start.name,)
    and len(i.leaves) == 1
    and is_sem(i.leaves[0])
  }


# Compilation -----------------------------------------------------------------


@functools.cache
def tpu_mesh(topology: str, shape=(2, 4), names=("x", "y")):
  devices = topologies.get_topology_desc(topology, platform="tpu").devices
  return jax.sharding.Mesh(np.array(devices).reshape(shape), names)


def compile_hlo(f, mesh, shape=(16, 512), dtype=jnp.float32) -> str:
  """Compiled TPU HLO of ``f`` under ``shard_map`` over every mesh axis."""
  spec = P(*mesh.axis_names)
  g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec))
  x = jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))
  return g.trace(x).lower().compile().as_text()


def check_pair(hlo: str, kind: str, n_sems: int) -> tuple[Instr, Instr]:
  """Asserts the start/done structure of the one ``kind`` op in ``hlo``."""
  m = parse_module(hlo)
  (start,) = kernels(m, kind, "start")
  (done,) = kernels(m, kind, "done")
  for k in (start, done):
    assert k.opcode == "custom-call", k.attrs[:200]
    assert k.attr("custom_call_target") == '"tpu_custom_call"'
  assert start.aliasing == (((0,), 0, ()),)  # the source passes through
  assert done.aliasing == (((), 1, ()),)  # the destination, and only it
  sems = sem_outputs(m, start)
  assert len(sems) == n_sems
  assert sems <= set(done.operands)
  assert sum(map(is_sem, start.leaves)) == n_sems
  assert done.collective_id is None  # done kernels never synchronise
  return start, done


# Per op, per topology --------------------------------------------------------


def _ppermute_full(x):
  x, fut = asyncops.ppermute_start(x, "y", shift=1)
  return asyncops.ppermute_done(fut) + x


def _ppermute_partial(x):
  x, fut = asyncops.ppermute_start(x, "y", perm=[(0, 1), (1, 2)])
  return asyncops.ppermute_done(fut) + x


def _bidirectional(x):
  x, fut = asyncops.bidirectional_start(x, "y")
  return asyncops.bidirectional_done(fut) + x


def _all_gather(x):
  x, fut = asyncops.all_gather_start(x, "y", axis=1, tiled=True)
  g = asyncops.all_gather_done(fut)
  return g[:, : x.shape[1]] + x


def _copy_hbm(x):
  x, fut = asyncops.copy_start(x)
  return asyncops.copy_done(fut) * 2 + x


def _copy_vmem(x):
  x, fut = asyncops.copy_start(x, memory_space="vmem")
  return asyncops.copy_done(fut) * 2 + x


# (op kind, program, semaphores per start, synchronises)
OPS = {
  "ppermute_full": ("ppermute", _ppermute_full, 2, True),
  "ppermute_partial": ("ppermute", _ppermute_partial, 2, True),
  "bidirectional": ("bidirectional", _bidirectional, 4, True),
  "all_gather": ("all_gather", _all_gather, 2, True),
  "copy_hbm": ("copy", _copy_hbm, 1, False),
}


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("op", sorted(OPS))
def test_start_done_structure(op, topology):
  kind, f, n_sems, synchronises = OPS[op]
  start, _ = check_pair(compile_hlo(f, tpu_mesh(topology)), kind, n_sems)
  assert (start.collective_id is not None) == synchronises
  if synchronises:
    assert '"has_communication":true' in start.attrs


@pytest.mark.parametrize("topology", ("v5e:2x4", "v6e:2x4"))
def test_copy_to_vmem_compiles_on_v5_and_later(topology):
  check_pair(compile_hlo(_copy_vmem, tpu_mesh(topology)), "copy", 1)


def test_copy_to_vmem_on_v4_is_a_clear_error():
  # Without the check, libtpu fails with "Invalid memory space: 1".
  with pytest.raises(NotImplementedError, match=r"needs TPU v5.*TPU v4"):
    compile_hlo(_copy_vmem, tpu_mesh("v4:2x2x1"))


@pytest.mark.parametrize("topology", ("v5e:2x4", "v4:2x2x1"))
def test_copy_under_plain_jit(topology):
  device = tpu_mesh(topology).devices.flat[0]
  x = jax.ShapeDtypeStruct(
    (16, 512), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(device)
  )
  hlo = jax.jit(_copy_hbm).trace(x).lower().compile().as_text()
  check_pair(hlo, "copy", 1)
  with (
    pytest.raises(NotImplementedError, match="needs TPU v5")
    if (topology.startswith("v4"))
    else _no_error()
  ):
    hlo = jax.jit(_copy_vmem).trace(x).lower().compile().as_text()
    check_pair(hlo, "copy", 1)


class _no_error:
  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return False


@pytest.mark.parametrize(
  "mesh_shape,kind,f,n_sems",
  [
    ((4, 2), "bidirectional", _bidirectional, 4),  # both neighbours equal
    ((8, 1), "bidirectional", _bidirectional, 4),  # self: local copies
    ((4, 2), "all_gather", _all_gather, 2),
    ((8, 1), "all_gather", _all_gather, 2),
    ((4, 2), "ppermute", _ppermute_full, 2),
    ((8, 1), "ppermute", _ppermute_full, 2),  # self: a local copy
  ],
  ids=["bidir-2", "bidir-1", "gather-2", "gather-1", "perm-2", "perm-1"],
)
def test_small_axes(mesh_shape, kind, f, n_sems):
  # 16 or 32 rows per device: each half of a bidirectional transfer stays
  # aligned to the (8, 128) tiling, which Mosaic of jax 0.9 requires.
  hlo = compile_hlo(f, tpu_mesh("v5e:2x4", mesh_shape), shape=(128, 512))
  start, _ = check_pair(hlo, kind, n_sems)
  # Axis size 1 needs no peer: no barrier, no collective id.
  assert (start.collective_id is None) == (mesh_shape[1] == 1)


@pytest.mark.parametrize("topology", ("v5e:2x4", "v6e:2x4"))
@pytest.mark.parametrize(
  "per_device,dtype,ok",
  [
    ((6,), jnp.float32, False),  # 3-element halves: never a DMA Mosaic takes
    ((200,), jnp.bfloat16, False),  # off the 128-element tile
    ((8192,), jnp.float32, True),  # whole tiles on every supported jax
    ((12, 128), jnp.float32, True),  # 2-D: 6-row halves compile
    # The quantized two-way row form's codes (a 516-byte last dimension):
    # jax 0.10 DMAs its halves; 0.9's Mosaic wants whole 128-lane tiles.
    ((2, 1, 256, 516), jnp.uint8, jc.JAX_VERSION >= (0, 10)),
  ],
)
def test_bidirectional_halves_mosaic_cannot_slice(
  topology, per_device, dtype, ok
):
  mesh = tpu_mesh(topology, (8,), ("y",))
  shape = (8 * per_device[0], *per_device[1:])
  if ok:
    start, _ = check_pair(
      compile_hlo(_bidirectional, mesh, shape, dtype), "bidirectional", 4
    )
    assert start.collective_id is not None
    return
  with pytest.raises(
    ValueError, match=r"bidirectional_start: x has shape"
  ) as e:
    compile_hlo(_bidirectional, mesh, shape, dtype)
  assert "ppermute_start" in str(e.value)  # the fix is named
  assert str(per_device) in str(e.value)  # the per-device shape


# Split waits -----------------------------------------------------------------


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize(
  "kind,start_fn,n_send,n_recv",
  [
    ("ppermute", lambda x: asyncops.ppermute_start(x, "x", shift=1), 1, 1),
    ("bidirectional", lambda x: asyncops.bidirectional_start(x, "y"), 2, 2),
    ("all_gather", lambda x: asyncops.all_gather_start(x, "y"), 1, 1),
    ("copy", lambda x: asyncops.copy_start(x), 1, 0),
  ],
  ids=["ppermute", "bidirectional", "all_gather", "copy"],
)
def test_send_done_recv_done_split(topology, kind, start_fn, n_send, n_recv):
  def f(x):
    x, fut = start_fn(x)
    src, fut = asyncops.send_done(fut)
    src = src * 3  # the source is free to overwrite now
    y = asyncops.recv_done(fut)
    return y.reshape(-1, *src.shape[1:])[: src.shape[0]] + src

  m = parse_module(compile_hlo(f, tpu_mesh(topology)))
  (start,) = kernels(m, kind, "start")
  (send,) = kernels(m, kind, "send_done")
  (recv,) = kernels(m, kind, "recv_done")
  assert not kernels(m, kind, "done")
  sems = sem_outputs(m, start)
  assert len(sems) == n_send + n_recv
  send_sems = sems & set(send.operands)
  recv_sems = sems & set(recv.operands)
  assert len(send_sems) == n_send and len(recv_sems) == n_recv
  assert not send_sems & recv_sems
  # send_done reads the source without aliasing it (an alias let XLA copy
  # an in-flight source) and passes the destination through (its one
  # alias, operand 1 -> output 1); recv_done takes that result and aliases
  # it (operand 0): the receive wait is ordered after the send wait by
  # data (the local copy of copy / all_gather counts on the send
  # semaphore).
  assert send.aliasing == (((1,), 1, ()),)
  assert recv.aliasing == (((), 0, ()),)
  through = m.instr(recv.operands[0])
  assert through.opcode == "get-tuple-element"
  assert through.operands == (send.name,) and through.tuple_index == 1
  for k in (send, recv):
    assert k.attr("custom_call_target") == '"tpu_custom_call"'


# Sharp edges -----------------------------------------------------------------


def test_inflight_ops_of_different_patterns_have_distinct_collective_ids():
  """Barrier race (jax-ml/jax PR #27963): one id per sync pattern."""

  def f(x):
    x, a = asyncops.ppermute_start(x, "y", shift=1)
    x, b = asyncops.ppermute_start(x, "y", shift=-1)
    x, c = asyncops.bidirectional_start(x, "y")
    x, d = asyncops.all_gather_start(x, "y")
    x, e = asyncops.bidirectional_start(x, "x")
    x, g = asyncops.copy_start(x)
    x, h = asyncops.ppermute_start(x, "y", shift=1)  # same pattern as a
    outs = [asyncops.done(fut) for fut in (a, b, c, e, g, h)]
    gathered = asyncops.done(d)
    return sum(outs) + gathered[0] + x

  m = parse_module(compile_hlo(f, tpu_mesh("v5e:2x4")))
  ids = {}
  for kind in ("ppermute", "bidirectional", "all_gather", "copy"):
    for k in kernels(m, kind, "start"):
      ids[k.name] = k.collective_id
  assert len(ids) == 7
  assert list(ids.values()).count(None) == 1  # the copy
  pp = sorted(ids[n] for n in ids if n.startswith("asyncops_ppermute"))
  # Two shift=1 starts share one id; shift=-1 has its own.
  assert len(pp) == 3 and len(set(pp)) == 2
  distinct = {v for v in ids.values() if v is not None}
  assert len(distinct) == 5  # ppermute +1, -1, bidir y, gather y, bidir x


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_every_done_kernel_has_exactly_one_alias(topology):
  """Several aliases on one Mosaic kernel gave wrong values (jax#24023).

  Every start and done aliases exactly one buffer: send_done the
  destination it passes through (not the source, which it returns through
  an optimization barrier).
  """

  def f(x):
    x, a = asyncops.bidirectional_start(x, "y")
    x, b = asyncops.all_gather_start(x, "x")
    x, c = asyncops.copy_start(x)
    ya = asyncops.bidirectional_done(a)
    src, b = asyncops.send_done(b)
    yb = asyncops.recv_done(b)
    yc = asyncops.copy_done(c)
    return ya + yb[0] + yc + src

  m = parse_module(compile_hlo(f, tpu_mesh(topology)))
  ours = [i for i in m.instructions.values() if i.name.startswith("asyncops_")]
  waits = [
    i for i in ours if re.search(r"_(send_|recv_)?done(\.\d+)?$", i.name)
  ]
  assert len(waits) == 4
  for k in ours:
    assert len(k.aliasing) == 1, (k.name, k.aliasing)


def _perm_program(perms):
  """A program with one in-flight ppermute per perm (8 devices, axis i)."""

  def f(x):
    futs = []
    for p in perms:
      x, fut = asyncops.ppermute_start(x, "i", p)
      futs.append(fut)
    return sum(asyncops.ppermute_done(fut) for fut in futs)

  return f


def _one_cycle(k):
  """A full perm of 8 made of a k-cycle and fixed points; distinct per k."""
  return [(i, (i + 1) % k if i < k else i) for i in range(8)]


def test_collective_ids_are_per_program_not_per_process():
  """Ids are allocated per compiled program: many programs, no exhaustion."""
  mesh = tpu_mesh("v5e:2x4", (8,), ("i",))
  seen = set()
  # Six programs, nine distinct patterns among them (shifts 1-3, six
  # cycles): one compile per cycle, each with one of the shifts.
  for k in range(2, 8):  # a k-cycle with fixed points is never a ring
    shift = 1 + k % 3
    perms = [[(i, (i + shift) % 8) for i in range(8)], _one_cycle(k)]
    m = parse_module(compile_hlo(_perm_program(perms), mesh))
    ids = [s.collective_id for s in kernels(m, "ppermute", "start")]
    assert len(set(ids)) == 2  # distinct patterns, distinct ids
    assert set(ids) <= {0, 1}  # and numbered from 0 in every program
    seen.add(tuple(map(tuple, perms[1])))
  assert len(seen) > asyncops.kernels._common.MAX_COLLECTIVE_IDS // 3


def test_too_many_patterns_in_one_program_is_a_clear_error():
  mesh = tpu_mesh("v5e:2x4", (8,), ("i",))
  limit = asyncops.kernels._common.MAX_COLLECTIVE_IDS
  perms = [[(0, d)] for d in range(1, 8)] + [[(1, d)] for d in (0, 2, 3)]
  perms += [[(2, d)] for d in (0, 1, 3, 4, 5, 6, 7)]
  assert len(perms) > limit
  with pytest.raises(RuntimeError, match="distinct communication patterns"):
    compile_hlo(_perm_program(perms), mesh)
