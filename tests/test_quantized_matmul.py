"""Quantized transfers of the all-gather matmul (``transfer="int8"`` /
``"float8_e4m3fn"``): results equal the dequantize-then-matmul reference
on CPU; on TPU (v5e, v6e) the ring moves the 1-byte codes and scales as one
``uint8 [M, k + 4]`` buffer per step, with no defensive or in-flight copy.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from asyncops.collective_matmul import _quantized, allgather_matmul
from asyncops.inspect import analyze, tpu_mesh
from asyncops.testing import cpu_mesh

SPECS = dict(in_specs=(P("x", "y"), P(None, "y")), out_specs=P("x", "y"))


def _ours(mesh, **kw):
  return jax.jit(
    jax.shard_map(
      lambda a, w: allgather_matmul(a, w, "y", **kw), mesh=mesh, **SPECS
    )
  )


@pytest.fixture(scope="module")
def mesh():
  return cpu_mesh((2, 4), ("x", "y"))


def _operands(dtype, m=32, k=64, f=48):
  rng = np.random.default_rng(0)
  a = rng.normal(size=(m, k)) * np.exp(rng.normal(size=(m, 1)))
  a[3] = 0.0  # an all-zero row: scale 1, codes 0
  w = rng.normal(size=(k, f))
  return jnp.asarray(a, dtype), jnp.asarray(w, dtype)


@pytest.mark.parametrize("transfer", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize(
  "bidirectional,api", [(False, "value"), (True, "value"), (True, "ref")]
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_equals_dequantize_then_matmul(
  mesh, transfer, bidirectional, api, dtype
):
  a, w = _operands(dtype)
  got = _ours(mesh, transfer=transfer, bidirectional=bidirectional, api=api)(
    a, w
  )
  ref = jax.jit(
    jax.shard_map(
      lambda a, w: _quantized.reference(a, w, "y", transfer), mesh=mesh, **SPECS
    )
  )(a, w)
  assert got.dtype == ref.dtype == dtype
  tol = 1e-5 if dtype == jnp.float32 else 1e-2
  scale = float(jnp.max(jnp.abs(ref.astype(jnp.float32))))
  np.testing.assert_allclose(
    np.asarray(got, np.float32), np.asarray(ref, np.float32), atol=tol * scale
  )
  # ...and the quantization error is that of 1-byte codes, not worse.
  exact = a.astype(jnp.float32) @ w.astype(jnp.float32)
  err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - exact))) / scale
  assert err < (0.02 if transfer == "int8" else 0.08), err


def test_several_weights_and_batch_dims(mesh):
  a, w = _operands(jnp.float32, m=16)
  a3 = a.reshape(2, 8, 64)
  f = jax.jit(
    jax.shard_map(
      lambda a, w: allgather_matmul(a, (w, 2 * w), "y", transfer="int8"),
      mesh=mesh,
      in_specs=(P(None, "x", "y"), P(None, "y")),
      out_specs=(P(None, "x", "y"),) * 2,
    )
  )
  y1, y2 = f(a3, w)
  ref = jax.jit(
    jax.shard_map(
      lambda a, w: _quantized.reference(a, w, "y", "int8"), mesh=mesh, **SPECS
    )
  )(a, w)
  np.testing.assert_allclose(y1.reshape(16, -1), ref, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(y2.reshape(16, -1), 2 * ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(
  "kw,err,match",
  [
    (dict(transfer="fp8"), ValueError, r"transfer must be one of .*'fp8'"),
    (dict(transfer="int8", gather_dim=0), ValueError, r"gather_dim=-1"),
    (
      dict(transfer="int8", return_gathered=True),
      ValueError,
      r"cannot return_gathered=True",
    ),
  ],
)
def test_bad_transfer_names_the_argument(mesh, kw, err, match):
  a, w = _operands(jnp.float32)
  if kw.get("gather_dim") == 0:
    w = w[:16]
  with pytest.raises(err, match=match):
    _ours(mesh, **kw).trace(a, w)


def test_integer_lhs_refused(mesh):
  a, w = _operands(jnp.float32)
  with pytest.raises(TypeError, match=r"quantizes a floating lhs, got int32"):
    _ours(mesh, transfer="int8").trace(a.astype(jnp.int32), w.astype(jnp.int32))


@functools.cache
def _tpu_report(topology, transfer, bidirectional):
  mesh = tpu_mesh(topology, (2, 4), ("x", "y"))
  a = jax.ShapeDtypeStruct(
    (512, 2048), jnp.bfloat16, sharding=NamedSharding(mesh, P("x", "y"))
  )
  w = jax.ShapeDtypeStruct(
    (2048, 8192), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "y"))
  )
  return analyze(
    _ours(mesh, transfer=transfer, bidirectional=bidirectional), a, w
  )


@pytest.mark.parametrize("topology", ["v5e:2x4", "v6e:2x4"])
@pytest.mark.parametrize(
  "transfer,bidirectional", [("int8", False), ("float8_e4m3fn", True)]
)
def test_tpu_ring_moves_codes_and_scales(topology, transfer, bidirectional):
  report = _tpu_report(topology, transfer, bidirectional)
  kind = "bidirectional" if bidirectional else "ppermute"
  moved = re.findall(
    rf"%asyncops_{kind}_start[.\d]* = \((\w+\[[\d,]+\])", report.hlo_text
  )
  # [M, k + 4] per device: M = 256 rows, k = 512 codes + 4 scale bytes.
  assert moved and set(moved) == {"u8[256,516]"}, moved
  assert len(report.pairs_for(kind)) == 3  # n - 1 ring steps
  report.assert_all_awaited()
  report.assert_no_defensive_copies()
  report.assert_no_inflight_copies()
  report.assert_overlapped(min_pairs=3, op=kind)
