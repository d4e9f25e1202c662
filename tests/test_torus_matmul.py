"""All-gather matmul over a 2-D torus (``_torus.torus_allgather_matmul``).

CPU: equals ``all_gather(lhs, ("x", "y"), tiled) @ rhs`` on 2x4 and 4x2
meshes, both emulation transfer points; errors name the argument. TPU
(``v5e:4x4``, ``v6e:4x4``): ``(nx - 1) + (ny - 1) = 6`` steps of two
bidirectional kernels each, one per mesh axis (distinct barrier ids, so
the x and y links both carry data in every step), every pair overlapped
with block matmuls, no defensive or in-flight copy.
"""

import collections
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import asyncops
from asyncops import _jax_compat as jc
from asyncops.collective_matmul import torus_allgather_matmul
from asyncops.inspect import analyze, tpu_mesh
from asyncops.testing import cpu_mesh

S = P(None, ("x", "y"))


def _fn(mesh, **kw):
  return jax.jit(
    jax.shard_map(
      lambda a, w: torus_allgather_matmul(a, w, ("x", "y"), **kw),
      mesh=mesh,
      in_specs=(S, S),
      out_specs=S,
    )
  )


@pytest.mark.parametrize("shape", [(2, 4), (4, 2)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_equals_lax(shape, dtype):
  mesh = cpu_mesh(shape, ("x", "y"))
  rng = np.random.default_rng(1)
  a = jnp.asarray(rng.normal(size=(2, 8, 8 * 16)), dtype)
  w = jnp.asarray(rng.normal(size=(8 * 16, 64)), dtype)
  ref = jnp.einsum(
    "bmk,kf->bmf",
    a.astype(jnp.float32),
    w.astype(jnp.float32),
    precision="highest",
  )
  spec3 = P(None, None, ("x", "y"))
  f = jax.jit(
    jax.shard_map(
      lambda a, w: torus_allgather_matmul(a, w, ("x", "y")),
      mesh=mesh,
      in_specs=(spec3, S),
      out_specs=spec3,
    )
  )
  outs = []
  for transfer in ("start", "done"):
    with asyncops.emulation(transfer):
      outs.append(f(a, w))
  np.testing.assert_array_equal(outs[0], outs[1])
  tol = 2e-5 if dtype == jnp.float32 else 2e-2
  np.testing.assert_allclose(
    np.asarray(outs[0], np.float32), ref, rtol=tol, atol=tol * 20
  )


@pytest.mark.parametrize(
  "axes,a_shape,match",
  [
    (("x",), (8, 16), r"axis_names must be two distinct"),
    (("x", "y"), (6, 16), r"6 rows .*multiple of 4"),
  ],
)
def test_errors(axes, a_shape, match):
  mesh = cpu_mesh((2, 4), ("x", "y"))
  a = jax.ShapeDtypeStruct((a_shape[0], a_shape[1] * 8), jnp.float32)
  w = jax.ShapeDtypeStruct((a_shape[1] * 8, 64), jnp.float32)
  f = jax.jit(
    jax.shard_map(
      lambda a, w: torus_allgather_matmul(a, w, axes),
      mesh=mesh,
      in_specs=(S, S),
      out_specs=S,
    )
  )
  with pytest.raises(ValueError, match=match):
    f.trace(a, w)


def test_rhs_rows_error():
  mesh = cpu_mesh((2, 4), ("x", "y"))
  f = _fn(mesh)
  a = jax.ShapeDtypeStruct((8, 128), jnp.float32)
  w = jax.ShapeDtypeStruct((64, 64), jnp.float32)
  with pytest.raises(ValueError, match=r"rhs has 64 rows .*\[128, f\]"):
    f.trace(a, w)


@functools.cache
def _report(topology):
  mesh = tpu_mesh(topology, (4, 4), ("x", "y"))
  a = jax.ShapeDtypeStruct(
    (1024, 8192), jnp.bfloat16, sharding=NamedSharding(mesh, S)
  )
  w = jax.ShapeDtypeStruct(
    (8192, 8192), jnp.bfloat16, sharding=NamedSharding(mesh, S)
  )
  return analyze(_fn(mesh), a, w)


@pytest.mark.parametrize("topology", ["v5e:4x4", "v6e:4x4"])
def test_tpu_four_links_every_step(topology):
  report = _report(topology)
  pairs = report.pairs_for("bidirectional")
  assert len(pairs) == 12
  report.assert_all_awaited()
  report.assert_no_defensive_copies()
  report.assert_no_inflight_copies()
  lonely = [p.kernel for p in pairs if not p.overlapped]
  if jc.ALL_WINDOWS_KEPT:
    report.assert_overlapped(min_pairs=12, op="bidirectional")
  else:
    # jax 0.9's libtpu: step 2's two transfers exposed (_jax_compat).
    assert len(lonely) == 2, lonely
    assert all("/torus2/" in k for k in lonely), lonely
  # Per step: two start kernels, one per mesh axis (their barrier patterns
  # differ, so their collective ids do).
  by_step = collections.defaultdict(list)
  for p in pairs:
    start = report.module.instr(p.start)
    step = re.search(r"torus(\d+)/", start.op_name).group(1)
    by_step[int(step)].append(start.collective_id)
  assert sorted(by_step) == list(range(6))
  ids = {frozenset(v) for v in by_step.values()}
  assert all(len(v) == 2 and len(set(v)) == 2 for v in by_step.values())
  assert len(ids) == 1  # the same two axes every step
  # Phase one moves [M/2, k] halves, phase two the gathered [2, 4, M/4, k].
  moved = re.findall(
    r"%asyncops_bidirectional_start[.\d]* = \((\w+\[[\d,]+\])",
    report.hlo_text,
  )
  assert collections.Counter(moved) == {
    "bf16[512,512]": 6,
    "bf16[2,4,256,512]": 6,
  }


def test_model_routes_both_axes():
  """benchmarks/_timeline routes the torus' x transfers (op name
  ``ring_axis_x``) along mesh columns and its y transfers along rows, so
  every step loads links of both grid dimensions."""
  from benchmarks import _chips, _hlo, _mesh, _timeline

  report = _report("v5e:4x4")
  mesh = tpu_mesh("v5e:4x4", (4, 4), ("x", "y"))
  coords = _mesh.coords(mesh)
  tl = _timeline.simulate(
    _hlo.parse(report.hlo_text),
    _chips.chip_for("v5e:4x4"),
    coords=coords,
    rings=_mesh.mesh_rings(mesh),
  )
  dims = collections.defaultdict(set)  # step -> grid dims its links change
  for e in tl.events:
    links = e.args.get("links") or {}
    instr = report.module.instructions.get(e.name)
    m = instr and re.search(r"torus(\d+)/", instr.op_name)
    for a, b in links:
      changed = [i for i, (u, v) in enumerate(zip(a, b, strict=True)) if u != v]
      if m and changed:
        dims[int(m.group(1))].update(changed)
  assert dims, "no ICI transfer of the torus in the timeline"
  assert all(len(d) == 2 for d in dims.values()), dict(dims)
