"""The two-way all-gather ring of whole chunks in row panels, compiled for
TPU (ahead of time, v5e and v6e).

At a large-M shape on a 4-chip ring (per device ``x [16384, 1024]``,
``w [4096, 4096]``: a 256 MiB float32 accumulator, so the ring of whole
chunks runs unforced, in ``_gather_rings.whole_panels`` = 2 panels): no
copy of ``x`` or ``w``, ``n`` bidirectional transfers per panel each with
one dot of its own step in its window, and peak temporary memory (from
the compiled program's memory analysis) within jit's plus one chunk's
send and receive buffers (v5e: 136.1 MiB against 94.7 + 64); in one
panel (the ring before) it is not.
"""

import functools
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from asyncops import collective_matmul as _cm
from asyncops.collective_matmul import _gather_rings
from asyncops.inspect import analyze, tpu_mesh
from asyncops.testing import assert_copy_free

TOPOLOGIES = ["v5e:2x4", "v6e:2x4"]
M, D, F = 16384, 4096, 16384  # per device x [M, D / 4], w [D, F / 4]
N = 4
SPECS = (P("x", "y"), P(None, "y"))
CHUNK = M * (D // N) * 2  # one chunk of x, bf16


def _args(mesh):
  return (
    jax.ShapeDtypeStruct(
      (2 * M, D), jnp.bfloat16, sharding=NamedSharding(mesh, SPECS[0])
    ),
    jax.ShapeDtypeStruct(
      (D, F), jnp.bfloat16, sharding=NamedSharding(mesh, SPECS[1])
    ),
  )


def _ours(mesh):
  body = functools.partial(
    _cm.allgather_matmul, axis_name="y", bidirectional=True, method="ring"
  )
  return jax.jit(
    jax.shard_map(body, mesh=mesh, in_specs=SPECS, out_specs=P("x", "y"))
  )


def _temp(report) -> int:
  """Peak bytes beyond arguments, outputs and code (a compile-only
  executable reports ``temp_size_in_bytes`` 0)."""
  m = report.memory
  fixed = (
    m["argument_size_in_bytes"]
    + m["output_size_in_bytes"]
    - m.get("alias_size_in_bytes", 0)
    + m["generated_code_size_in_bytes"]
  )
  return m["peak_memory_in_bytes"] - fixed


def _jit_temp(mesh) -> int:
  jit = jax.jit(
    lambda a, w: a @ w, out_shardings=NamedSharding(mesh, P("x", "y"))
  )
  return _temp(analyze(jit, *_args(mesh)))


@pytest.fixture(scope="module", params=TOPOLOGIES)
def topology(request):
  return request.param


def test_rule_picks_panels():
  k, f = D // N, F // N
  assert k < f and _gather_rings.whole_chunks(M, f, jnp.float32, N)
  assert _gather_rings.whole_panels(M, f, jnp.float32) == 2


def test_panels_copy_free_overlapped_within_memory(topology):
  mesh = tpu_mesh(topology, (2, N), ("x", "y"))
  r = analyze(_ours(mesh), *_args(mesh))
  assert_copy_free(r)
  panels = _gather_rings.whole_panels(M, F // N, jnp.float32)
  pairs = r.pairs_for("asyncops.bidirectional")
  assert len(pairs) == N * panels and not r.pairs_for("asyncops.ppermute")
  k, h = D // N, M // panels // 2  # a piece: half a panel's rows
  for p in pairs:
    assert p.overlapped, p.start
    start = r.module.instr(p.start)
    dots = [
      i
      for i in p.between
      if i.opcode in ("fusion", "convolution") and "dot_general" in i.op_name
    ]
    assert len(dots) == 1, (p.start, [i.name for i in dots])
    # Each transfer moves a piece of two chunks (half a panel's rows of
    # each) into a buffer of that size, from x itself (the first of each
    # panel) or from a piece; never x whole.
    src, dst = re.findall(r"bf16\[(\d+),(\d+)\]", start.shape_text)[:2]
    assert dst == (str(2 * h), str(k)), (p.start, start.shape_text)
    assert src in ((str(M), str(k)), dst), (p.start, start.shape_text)
  # No copy of x ([M, k]) or w ([D, f]) beside the parameters' own moves.
  copies = [
    i
    for instrs in r.schedule.values()
    for i in instrs
    if i.opcode == "copy"
    and (
      i.shape_text.startswith(f"bf16[{M},{k}]")
      or i.shape_text.startswith(f"bf16[{D},{F // N}]")
    )
    and r.module.instr(i.operands[0]).opcode != "parameter"
  ]
  assert not copies, [i.name for i in copies]
  limit = _jit_temp(mesh) + 2 * CHUNK
  assert _temp(r) <= limit, (_temp(r) / 2**20, limit / 2**20)


def test_one_panel_is_over_the_limit(monkeypatch):
  """The ring before (one panel, v5e): its [M, f] float32 accumulator
  (256 MiB) puts it over jit's plus one chunk's buffers, so the limit
  above can fail."""
  monkeypatch.setattr(_gather_rings, "whole_panels", lambda *args: 1)
  mesh = tpu_mesh("v5e:2x4", (2, N), ("x", "y"))
  r = analyze(_ours(mesh), *_args(mesh))
  assert len(r.pairs_for("asyncops.bidirectional")) == N
  assert _temp(r) > _jit_temp(mesh) + 2 * CHUNK


def test_panel_count_is_tile_aligned():
  """A 320 MiB accumulator (per device ``w [4096, 5120]``) needs 3 panels
  by size; 3 panels of 16384 rows cut pieces of 2730 rows, which the start
  kernel's slice of ``x`` cannot take on TPU (Mosaic: "Slice sizes along
  tiled dimensions must be aligned to tiles"; the rule before compiled
  to that error). ``whole_panels`` rounds up to 4 panels of 4096 rows,
  and the program compiles, copy-free."""
  f = 5120
  assert _gather_rings.whole_panels(M, f, jnp.float32) == 4
  mesh = tpu_mesh("v5e:2x4", (2, N), ("x", "y"))
  args = (
    _args(mesh)[0],
    jax.ShapeDtypeStruct(
      (D, N * f), jnp.bfloat16, sharding=NamedSharding(mesh, SPECS[1])
    ),
  )
  r = analyze(_ours(mesh), *args)
  assert_copy_free(r)
  assert len(r.pairs_for("asyncops.bidirectional")) == N * 4
