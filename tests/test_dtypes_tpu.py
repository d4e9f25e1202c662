"""Every dtype a DMA can carry, compiled for TPU (v5e and v6e).

One program per (topology, dtype) runs every value-API op (ppermute,
bidirectional, all-gather, copy) and a Ref-API ppermute where the dtype
allows it. The compiled HLO must hold our start/done kernels on buffers of
the expected element type (the dtype itself, or its carrier), every start
awaited, and no defensive or in-flight copy (``asyncops.inspect``).
"""

import functools
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import asyncops
from asyncops import _jax_compat as jc
from asyncops import stateful as st
from asyncops.inspect import analyze, tpu_mesh

TOPOLOGIES = ("v5e:2x4", "v6e:2x4")
# dtype -> element type the DMA moves, as the HLO prints it.
MOVED = {
  "float8_e4m3fn": "f8e4m3fn",
  "float8_e5m2": "f8e5m2",
  "int4": "s4",
  "float4_e2m1fn": "f4e2m1fn",
  "bool": "u8",
  "complex64": "f32",
}
REF_OK = ("float8_e4m3fn", "float8_e5m2", "int4", "float4_e2m1fn")
if not jc.NARROW_DMA:  # refused on jax < 0.10 (tests/test_dtypes.py)
  MOVED = {d: m for d, m in MOVED.items() if d not in REF_OK}
KINDS = ("ppermute", "bidirectional", "all_gather", "copy")


def _program(x, dtype):
  outs = []
  x, f1 = asyncops.ppermute_start(x, "i", shift=1)
  x, f2 = asyncops.bidirectional_start(x, "i")
  x, f3 = asyncops.all_gather_start(x, "i", axis=0, tiled=True)
  x, f4 = asyncops.copy_start(x)
  outs.append(asyncops.ppermute_done(f1))
  outs.append(asyncops.bidirectional_done(f2))
  outs.append(asyncops.all_gather_done(f3)[: x.shape[0]])
  outs.append(asyncops.copy_done(f4))
  if dtype in REF_OK:
    src, dst = jax.new_ref(x), jax.new_ref(jnp.zeros_like(x))
    fut = st.ppermute_start(src, dst, "i", shift=1)
    st.ppermute_done(fut, src, dst)
    outs.append(dst[...])
  return tuple(outs)


@functools.cache
def _report(topology: str, dtype: str):
  mesh = tpu_mesh(topology, (8,), ("i",))
  n_out = 5 if dtype in REF_OK else 4
  f = jax.jit(
    jax.shard_map(
      functools.partial(_program, dtype=dtype),
      mesh=mesh,
      in_specs=P("i"),
      out_specs=(P("i"),) * n_out,
    )
  )
  x = jax.ShapeDtypeStruct(
    (8 * 64, 512), jnp.dtype(dtype), sharding=NamedSharding(mesh, P("i"))
  )
  return analyze(f, x)


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("dtype", sorted(MOVED))
def test_kernels_move_the_bytes_without_copies(topology, dtype):
  report = _report(topology, dtype)
  hlo = report.hlo_text
  for kind in KINDS:
    starts = re.findall(rf"%asyncops_{kind}_start[.\d]* = \((\w+)\[", hlo)
    assert starts, f"no {kind} start kernel"
    assert set(starts) == {MOVED[dtype]}, (kind, starts)
  if dtype in REF_OK:
    assert re.search(
      rf"%asyncops_ppermute_ref_start[.\d]* = \({MOVED[dtype]}\[", hlo
    )
  report.assert_all_awaited()
  report.assert_no_defensive_copies()
  report.assert_no_inflight_copies()
  assert len(report.pairs_for()) >= len(KINDS)
