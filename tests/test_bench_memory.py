"""The benchmark's memory column on compiled TPU programs: the HBM bytes an
executable reserves for temporaries (XLA's buffer assignment,
``_measure.peak_alloc_bytes``) against XLA's ``temp_size_in_bytes``. No
wall time."""

import functools
import re

import jax
import jax.numpy as jnp
import pytest

from benchmarks import _measure, _mesh, _variants

TOPOLOGIES = ["v5e:2x4", "v6e:2x4"]
# The Llama-3-70B shard at tp 4, M = 1024 tokens per device. On v5e and
# v5p the ring's chunks and accumulator live in HBM; on v6e memory-space
# assignment puts them in VMEM (up to M = 2048, where the accumulator
# alone reaches HBM), as it does on every chip at smaller shapes.
RING_TOPOLOGIES = ["v5e:2x4", "v5p:2x2x2"]
SHAPE = (2048, 8192, 28672)
TP = 4
CHUNK = 1024 * (8192 // TP) * 2  # bf16 [M, D / tp], 4 MiB
ACC = 1024 * (28672 // TP) * 4  # float32 [M, F / tp], 28 MiB

_VALUE = re.compile(r"^ value: <\d+ (\S+) @(\d+)> \(size=(\d+),offset=(\d+)\)")


@functools.cache
def _compile(variant, topology, options=None):
  mesh = _measure.mesh_for(topology, "ring", TP)
  fn = _variants.build(variant, mesh)
  args = _variants.abstract_args(variant, mesh, SHAPE, jnp.bfloat16)
  with _mesh.quiet_fd2():
    lowered = fn.trace(*args).lower()
  compiled, text = _measure.compile_with_assignment(lowered, options)
  mem = compiled.memory_analysis()
  figures = {k: getattr(mem, k) for k in _measure._MEM}
  figures.update(_measure.assignment_temps(text))
  return compiled, text, figures


def _hbm_temp_allocations(text):
  """Sizes of the color-0 ``preallocated-temp`` allocations, read apart
  from the parser under test."""
  return [
    int(m[1])
    for m in re.finditer(
      r"^allocation \d+: size (\d+), preallocated-temp:$", text, re.M
    )
  ]


def _slots(text):
  """``{value name: (allocation, offset, size)}``."""
  out, alloc = {}, None
  for line in text.splitlines():
    if line.startswith("allocation "):
      alloc = int(line.split()[1].rstrip(":"))
    m = _VALUE.match(line)
    if m:
      out[m[1]] = (alloc, int(m[4]), int(m[3]))
  return out


@pytest.fixture(params=RING_TOPOLOGIES)
def ring(request):
  return _compile("allgather_matmul", request.param)


@pytest.fixture(params=TOPOLOGIES)
def jit(request):
  return _compile("jit", request.param)


def test_ring_alloc_is_the_buffer_assignment(ring):
  _, text, mem = ring
  temps = _hbm_temp_allocations(text)
  assert temps, "no HBM temporaries: the shape no longer reaches HBM"
  assert _measure.peak_alloc_bytes(mem) == sum(temps)


def test_done_and_its_destination_share_one_slot(ring):
  # The done's result aliases the start's destination ({1}): one buffer,
  # which the measure counts once.
  _, text, _ = ring
  slots = _slots(text)
  dones = [v for v in slots if v.startswith("asyncops_ppermute_done")]
  assert len(dones) >= 2
  for done in dones:
    start = done.replace("_done", "_start") + "{1}"
    assert slots[done] == slots[start], (done, start)


def test_the_source_in_flight_is_a_second_buffer(ring):
  # During a transfer the chunk read ({0}) and the one written ({1}) are
  # genuinely two buffers: the measure holds both and the accumulator.
  _, text, mem = ring
  slots = _slots(text)
  starts = sorted(
    {v.split("{")[0] for v in slots if v.startswith("asyncops_ppermute_start")}
  )
  for start in starts:
    src, dst = slots[start + "{0}"], slots[start + "{1}"]
    assert src[0] == dst[0] and src[1] != dst[1], start
  assert _measure.peak_alloc_bytes(mem) >= ACC + 2 * CHUNK


def test_xla_temp_size_counts_the_alias_again(ring):
  # The artefact the buffer assignment corrects: XLA's temp_size counts
  # the done's result and its destination as two chunks.
  _, _, mem = ring
  alloc = _measure.peak_alloc_bytes(mem)
  assert mem["temp_size_in_bytes"] >= alloc + CHUNK
  assert mem["temp_size_in_bytes"] < alloc + CHUNK + 2**20


def test_jit_alloc_is_the_buffer_assignment(jit):
  _, text, mem = jit
  temps = _hbm_temp_allocations(text)
  assert temps
  alloc = _measure.peak_alloc_bytes(mem)
  assert alloc == sum(temps)
  # No aliasing custom call: XLA's figure and the assignment agree to
  # within padding.
  assert abs(mem["temp_size_in_bytes"] - alloc) < 2**20


def test_vmem_is_kept_apart():
  # On v5e XLA prefetches (part of) the weight into VMEM: 112 MiB with jax
  # 0.10's libtpu, 26 MiB with jax 0.9's. peak_memory_in_bytes holds that
  # VMEM; the HBM measure leaves it out.
  _, _, mem = _compile("jit", "v5e:2x4")
  vmem = mem[f"{_measure._ALLOC_KEY}_color1"]
  assert vmem >= 16 * 2**20
  fixed = mem["argument_size_in_bytes"] + mem["output_size_in_bytes"]
  assert mem["peak_memory_in_bytes"] - fixed >= vmem
  assert _measure.peak_alloc_bytes(mem) < vmem


def test_the_dump_leaves_the_program_alone():
  mesh = _measure.mesh_for("v5e:2x4", "ring", TP)
  fn = _variants.build("jit", mesh)
  args = _variants.abstract_args("jit", mesh, SHAPE, jnp.bfloat16)
  with _mesh.quiet_fd2():
    lowered = fn.trace(*args).lower()
    plain = lowered.compile().as_text()
  dumped, _ = _measure.compile_with_assignment(lowered)
  assert dumped.as_text() == plain


def _live_temps(n_live, topology):
  """A program holding ``n_live`` float32 [8192, 4096] (128 MiB)
  temporaries at once, kept apart by an optimization barrier."""
  mesh = _mesh.make_mesh(topology)
  s = jax.sharding.SingleDeviceSharding(mesh.devices.flat[0])
  x = jax.ShapeDtypeStruct((8192, 4096), jnp.float32, sharding=s)

  def f(x):
    temps = jax.lax.optimization_barrier(
      tuple(x * (i + 2) for i in range(n_live))
    )
    return sum(t.sum() for t in temps)

  with _mesh.quiet_fd2():
    lowered = jax.jit(f).trace(x).lower()
  compiled, text = _measure.compile_with_assignment(lowered)
  return compiled, text


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_a_genuine_extra_buffer_is_counted(topology):
  size = 8192 * 4096 * 4
  allocs = {}
  for n in (1, 2):
    _, text = _live_temps(n, topology)
    allocs[n] = _measure.peak_alloc_bytes(_measure.assignment_temps(text))
  assert allocs[2] - allocs[1] >= size, allocs
  assert allocs[1] >= size, allocs
