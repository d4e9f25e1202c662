"""Quantized transfers (``transfer="int8"`` / ``"float8_e4m3fn"``).

All-gather matmul, both forms: results equal the dequantize-then-matmul
reference on CPU. Matmul-reduce-scatter, both forms: results equal the
hop-by-hop requantizing reference and stay within the documented bound of
the exact sum. Derivatives of both are straight-through (checked against
``jnp`` references). On TPU (v5e, v6e) every ring step moves the 1-byte
codes and float32 scales as one ``uint8`` buffer, with no defensive or
in-flight copy, each transfer overlapped.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from asyncops import _jax_compat as jc
from asyncops.collective_matmul import (
  _quantized,
  allgather_matmul,
  matmul_reducescatter,
)
from asyncops.collective_matmul import _quantized_scatter as _qs
from asyncops.inspect import analyze, tpu_mesh
from asyncops.testing import cpu_mesh

TRANSFERS = ["int8", "float8_e4m3fn"]
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
    (
      dict(transfer="int8", return_gathered=True),
      ValueError,
      r"cannot return_gathered=True",
    ),
  ],
)
def test_bad_transfer_names_the_argument(mesh, kw, err, match):
  a, w = _operands(jnp.float32)
  with pytest.raises(err, match=match):
    _ours(mesh, **kw).trace(a, w)


def test_integer_lhs_refused(mesh):
  a, w = _operands(jnp.float32)
  with pytest.raises(TypeError, match=r"quantizes a floating lhs, got int32"):
    _ours(mesh, transfer="int8").trace(a.astype(jnp.int32), w.astype(jnp.int32))


# The matmul-reduce-scatter ------------------------------------------------


def _rs(mesh, specs, **kw):
  return jax.jit(
    jax.shard_map(
      lambda a, w: matmul_reducescatter(a, w, "y", **kw), mesh=mesh, **specs
    )
  )


def _rs_ref(mesh, specs, out_shape, dim, bidirectional, transfer):
  """The same quantization steps by ``jnp`` (``_quantized_scatter``)."""
  n = mesh.shape["y"]

  def ref(a, w):
    mask = _qs.reversed_rows(out_shape, dim, n, bidirectional)
    return _qs.reference(a, w, mask, "y", transfer, dim)

  return jax.jit(jax.shard_map(ref, mesh=mesh, **specs))


# (form, per-device lhs shape builder): the columns form [M, k] @ [k, f]
# -> [M, f/n]; the row form [S, k] -> [S/n, f] (P = 1: two-way halves split
# the rows of a block); [B, S, k] scattered along S (B = 2: two-way halves
# split the batches).
RS_FORMS = {
  "columns": dict(
    specs=dict(in_specs=(P("x", "y"), P("y", None)), out_specs=P("x", "y")),
    shapes=lambda n: ((8, 16 * n), (16 * n, 8 * n)),
    dim=-1,
  ),
  "rows": dict(
    specs=dict(in_specs=(P(None, "y"), P("y", None)), out_specs=P("y", None)),
    shapes=lambda n: ((8 * n, 16 * n), (16 * n, 24)),
    dim=0,
  ),
  "rows3d": dict(
    specs=dict(
      in_specs=(P(None, None, "y"), P("y", None)), out_specs=P(None, "y", None)
    ),
    shapes=lambda n: ((2, 4 * n, 16 * n), (16 * n, 24)),
    dim=1,
  ),
}


def _rs_operands(shapes, dtype, integer):
  """Integer-valued operands (every float32 contribution exact, so the
  reference's quantizations see the ring's bits) or normal ones with rows
  of very different magnitudes."""
  rng = np.random.default_rng(1)
  (xs, ws) = shapes
  if integer:
    a = (
      rng.integers(-4, 5, size=xs)
      * 2.0 ** rng.integers(-2, 3, xs[:-1])[..., None]
    )
    w = rng.integers(-4, 5, size=ws).astype(float)
  else:
    a = rng.normal(size=xs) * np.exp(rng.normal(size=xs[:-1]))[..., None]
    w = rng.normal(size=ws)
  return jnp.asarray(a, dtype), jnp.asarray(w, dtype)


def _partials_bound(a, w, n, dim, transfer):
  """The docstring's bound: ``u (n - 1) max|row of sum_d |P_d||`` per
  element of the global result (``|S_t| <= sum_d |P_d|`` for every partial
  sum, whatever the ring's order), with ``P_d`` device ``d``'s float64
  contribution."""
  a, w = np.asarray(a, np.float64), np.asarray(w, np.float64)
  k = w.shape[0] // n
  mag = sum(
    np.abs(a[..., d * k : (d + 1) * k] @ w[d * k : (d + 1) * k])
    for d in range(n)
  )
  if dim % a.ndim == a.ndim - 1:  # a row of a block: its c = f / n columns
    lead, f = mag.shape[:-1], mag.shape[-1]
    blk = mag.reshape(*lead, n, f // n).max(-1, keepdims=True)
    top = np.broadcast_to(blk, (*lead, n, f // n)).reshape(mag.shape)
  else:
    top = np.broadcast_to(mag.max(-1, keepdims=True), mag.shape)
  return _quantized.UNIT_ERROR[transfer] * (n - 1) * top


@pytest.mark.parametrize("transfer", TRANSFERS)
@pytest.mark.parametrize(
  "form,n,bidirectional,api,dtype",
  [
    ("columns", 4, False, "value", jnp.float32),
    ("columns", 8, True, "value", jnp.bfloat16),
    ("columns", 2, True, "ref", jnp.float32),
    ("rows", 4, True, "value", jnp.float32),
    ("rows3d", 4, True, "ref", jnp.bfloat16),
  ],
)
def test_reducescatter_equals_requantizing_reference(
  transfer, form, n, bidirectional, api, dtype
):
  """Equal to the hop-by-hop model, and within the bound of the exact sum."""
  mesh = cpu_mesh((8 // n, n), ("x", "y"))
  cfg = RS_FORMS[form]
  ours = _rs(
    mesh,
    cfg["specs"],
    scatter_dim=cfg["dim"],
    transfer=transfer,
    bidirectional=bidirectional,
    api=api,
  )
  a, w = _rs_operands(cfg["shapes"](n), dtype, integer=True)
  got = ours(a, w)
  out_shape = list(a.shape[:-1]) + [w.shape[1]]
  dim = cfg["dim"] % len(out_shape)
  if form == "columns":
    out_shape[0] //= mesh.shape["x"]
  out_shape[dim] //= n
  ref = _rs_ref(
    mesh, cfg["specs"], tuple(out_shape), cfg["dim"], bidirectional, transfer
  )(a, w)
  assert got.shape == ref.shape and got.dtype == ref.dtype == dtype
  got32, ref32 = np.asarray(got, np.float32), np.asarray(ref, np.float32)
  top = float(np.max(np.abs(ref32)))
  # float32 summation order only (a quantum is 1/127 or more of a row).
  tol = 1e-6 if dtype == jnp.float32 else 2**-8
  np.testing.assert_allclose(got32, ref32, atol=tol * top, rtol=0)
  # ...and the requantizations' error against the exact float64 sum stays
  # within the docstring's bound (rows of very different magnitudes).
  a, w = _rs_operands(cfg["shapes"](n), dtype, integer=False)
  got = np.asarray(ours(a, w), np.float64)
  exact = np.asarray(a, np.float64) @ np.asarray(w, np.float64)
  bound = _partials_bound(a, w, n, cfg["dim"], transfer)
  bound += np.abs(exact) * (2**-8 if dtype == jnp.bfloat16 else 2**-23)
  err = np.abs(got - exact)
  assert np.all(err <= 1.01 * bound + 1e-6), float(np.max(err / bound))
  # The quantization is really there (not a native ring).
  assert float(np.max(err)) > 0


def test_reducescatter_errors():
  mesh = cpu_mesh((2, 4), ("x", "y"))
  specs = RS_FORMS["columns"]["specs"]
  a, w = _rs_operands(RS_FORMS["columns"]["shapes"](4), jnp.float32, True)
  with pytest.raises(ValueError, match=r"transfer must be one of .*'e4m3'"):
    _rs(mesh, specs, transfer="e4m3").trace(a, w)
  with pytest.raises(TypeError, match=r"quantizes a floating lhs, got int32"):
    _rs(mesh, specs, transfer="int8").trace(
      a.astype(jnp.int32), w.astype(jnp.int32)
    )
  with pytest.raises(ValueError, match=r"method='fused'.*method='auto'"):
    _rs(mesh, specs, transfer="int8", method="fused").trace(a, w)


# The all-gather matmul's row form ------------------------------------------


@pytest.mark.parametrize(
  "transfer,gather_dim,bidirectional,api",
  [
    ("int8", 0, False, "value"),
    ("float8_e4m3fn", 0, True, "ref"),
    ("int8", 1, True, "value"),
  ],
)
def test_rows_form_equals_dequantize_then_matmul(
  mesh, transfer, gather_dim, bidirectional, api
):
  a, w = _operands(jnp.float32, m=32, k=16, f=24)
  if gather_dim == 1:  # [B, S/n, k] -> [B, S, f/n], B = 2 split two-way
    a = a.reshape(2, 16, 16)
    specs = dict(
      in_specs=(P(None, "y", None), P(None, "y")), out_specs=P(None, None, "y")
    )
  else:  # [S/n, k] -> [S, f/n]
    specs = dict(in_specs=(P("y", None), P(None, "y")), out_specs=P(None, "y"))
  kw = dict(gather_dim=gather_dim, transfer=transfer)
  got = jax.jit(
    jax.shard_map(
      lambda a, w: allgather_matmul(
        a, w, "y", bidirectional=bidirectional, api=api, **kw
      ),
      mesh=mesh,
      **specs,
    )
  )(a, w)
  ref = jax.jit(
    jax.shard_map(
      lambda a, w: _quantized.reference(a, w, "y", transfer, gather_dim),
      mesh=mesh,
      **specs,
    )
  )(a, w)
  scale = float(jnp.max(jnp.abs(ref)))
  np.testing.assert_allclose(got, ref, atol=1e-5 * scale, rtol=0)
  err = float(jnp.max(jnp.abs(got - a @ w))) / scale
  assert 0 < err < (0.02 if transfer == "int8" else 0.08), err


# Derivatives: straight-through --------------------------------------------


def _loss(fn):
  """A loss linear in the output: its cotangent does not depend on the
  (quantized) forward values, so the gradients compare exactly."""

  def loss(a, w):
    y = fn(a, w).astype(jnp.float32)
    return jnp.vdot(
      y, jnp.sin(jnp.arange(y.size, dtype=y.dtype)).reshape(y.shape)
    )

  return loss


GRAD_CASES = {
  # name: (op, kwargs, specs, lhs shape, rhs shape)
  "gather_contracting": (
    "ag",
    dict(bidirectional=True),
    SPECS,
    (32, 64),
    (64, 48),
  ),
  "gather_rows": (
    "ag",
    dict(gather_dim=0, api="ref"),
    dict(in_specs=(P("y", None), P(None, "y")), out_specs=P(None, "y")),
    (32, 16),
    (16, 24),
  ),
  "scatter_columns": (
    "rs",
    dict(bidirectional=True),
    RS_FORMS["columns"]["specs"],
    (8, 64),
    (64, 32),
  ),
  "scatter_rows": (
    "rs",
    dict(scatter_dim=0),
    RS_FORMS["rows"]["specs"],
    (32, 64),
    (64, 24),
  ),
}


@pytest.mark.parametrize(
  "case,transfer",
  [
    ("gather_contracting", "int8"),
    ("gather_rows", "float8_e4m3fn"),
    ("scatter_columns", "float8_e4m3fn"),
    ("scatter_rows", "int8"),
  ],
)
def test_grad_and_jvp_straight_through(mesh, case, transfer):
  """``jax.grad`` and ``jax.jvp`` equal those of the ``jnp`` references
  with a straight-through quantizer (the all-gather: ``d lhs`` of the exact
  product, ``d rhs`` of the dequantized lhs; the reduce-scatter: both of
  the exact product)."""
  op, kw, specs, xs, ws = GRAD_CASES[case]
  rng = np.random.default_rng(2)
  a = jnp.asarray(rng.normal(size=xs), jnp.float32)
  w = jnp.asarray(rng.normal(size=ws) / 4, jnp.float32)
  if op == "ag":
    ours = jax.shard_map(
      lambda a, w: allgather_matmul(a, w, "y", transfer=transfer, **kw),
      mesh=mesh,
      **specs,
    )
    gd = kw.get("gather_dim", -1)
    ref = jax.shard_map(
      lambda a, w: _quantized.reference(a, w, "y", transfer, gd),
      mesh=mesh,
      **specs,
    )
  else:
    ours = jax.shard_map(
      lambda a, w: matmul_reducescatter(a, w, "y", transfer=transfer, **kw),
      mesh=mesh,
      **specs,
    )
    dim = kw.get("scatter_dim", -1)

    def exact(a, w):  # the straight-through derivative's function
      return jax.lax.psum_scatter(
        a @ w, "y", scatter_dimension=dim % a.ndim, tiled=True
      )

    ref = jax.shard_map(exact, mesh=mesh, **specs)
  g_ours = jax.jit(jax.grad(_loss(ours), (0, 1)))(a, w)
  g_ref = jax.jit(jax.grad(_loss(ref), (0, 1)))(a, w)
  for got, want in zip(g_ours, g_ref, strict=True):
    scale = float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(got, want, atol=1e-5 * scale, rtol=0)
  ta, tw = jnp.asarray(rng.normal(size=xs), jnp.float32), w[::-1]
  _, t_ours = jax.jit(lambda *p: jax.jvp(ours, p[:2], p[2:]))(a, w, ta, tw)
  _, t_ref = jax.jit(lambda *p: jax.jvp(ref, p[:2], p[2:]))(a, w, ta, tw)
  scale = float(jnp.max(jnp.abs(t_ref)))
  np.testing.assert_allclose(t_ours, t_ref, atol=1e-4 * scale, rtol=0)


# jax 0.9's Mosaic cannot DMA the halves of a two-way transfer of codes and
# scales (a 516-byte last dimension, not whole 128-lane tiles): the public
# op refuses it at trace time on TPU naming bidirectional=False
# (_quantized.check_two_way, _jax_compat.half_dma_problem); jax 0.10 moves
# them.
TWO_WAY_CODES = jc.half_dma_problem((256, 516), jnp.uint8) is None


def _refused_two_way(program, op, moved):
  """Asserts jax 0.9's refusal of a two-way quantized ring on TPU: a
  ValueError when ``jax.jit`` traces it (before any lowering), naming the
  op, the buffer moved, the cause and ``bidirectional=False``."""
  fn, *args = program
  with pytest.raises(ValueError) as e:
    fn.trace(*args)
  msg = str(e.value)
  assert msg.startswith(f"{op}(transfer="), msg
  assert "bidirectional=True): the two-way ring" in msg
  assert f"uint8{moved}" in msg and "not a multiple of 128 lanes" in msg
  assert f"jax {jax.__version__}'s Mosaic" in msg
  assert "Pass bidirectional=False" in msg and "jax[tpu]>=0.10" in msg


def _tpu_program(topology, transfer, bidirectional):
  mesh = tpu_mesh(topology, (2, 4), ("x", "y"))
  a = jax.ShapeDtypeStruct(
    (512, 2048), jnp.bfloat16, sharding=NamedSharding(mesh, P("x", "y"))
  )
  w = jax.ShapeDtypeStruct(
    (2048, 8192), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "y"))
  )
  return _ours(mesh, transfer=transfer, bidirectional=bidirectional), a, w


@functools.cache
def _tpu_report(topology, transfer, bidirectional):
  return analyze(*_tpu_program(topology, transfer, bidirectional))


@pytest.mark.parametrize("topology", ["v5e:2x4", "v6e:2x4"])
@pytest.mark.parametrize(
  "transfer,bidirectional", [("int8", False), ("float8_e4m3fn", True)]
)
def test_tpu_ring_moves_codes_and_scales(topology, transfer, bidirectional):
  if bidirectional and not TWO_WAY_CODES:
    program = _tpu_program(topology, transfer, bidirectional)
    _refused_two_way(program, "allgather_matmul", [256, 516])
    return
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


def _tpu_rs_program(topology, transfer, bidirectional):
  # Tmp[B_X, F_Y] * W2[F_Y, D] -> Out[B_X, D_Y], bf16, global (512, 2048,
  # 2048): per device [256, 512] @ [512, 2048], blocks of 512 columns.
  mesh = tpu_mesh(topology, (2, 4), ("x", "y"))
  specs = RS_FORMS["columns"]["specs"]
  a = jax.ShapeDtypeStruct(
    (512, 2048), jnp.bfloat16, sharding=NamedSharding(mesh, P("x", "y"))
  )
  w = jax.ShapeDtypeStruct(
    (2048, 2048), jnp.bfloat16, sharding=NamedSharding(mesh, P("y", None))
  )
  fn = _rs(mesh, specs, transfer=transfer, bidirectional=bidirectional)
  return fn, a, w


@functools.cache
def _tpu_rs_report(topology, transfer, bidirectional):
  return analyze(*_tpu_rs_program(topology, transfer, bidirectional))


def _tpu_rows_program(topology):
  # Sequence parallel X[S_Y, D] * W[D, F_Y], bf16, global (2048, 512,
  # 2048), int8 two-way: per device [512, 512] rows.
  mesh = tpu_mesh(topology, (2, 4), ("x", "y"))
  a = jax.ShapeDtypeStruct(
    (2048, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P("y", None))
  )
  w = jax.ShapeDtypeStruct(
    (512, 2048), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "y"))
  )
  fn = jax.jit(
    jax.shard_map(
      lambda a, w: allgather_matmul(
        a, w, "y", gather_dim=0, transfer="int8", bidirectional=True
      ),
      mesh=mesh,
      in_specs=(P("y", None), P(None, "y")),
      out_specs=P(None, "y"),
    )
  )
  return fn, a, w


@functools.cache
def _tpu_rows_report(topology):
  return analyze(*_tpu_rows_program(topology))


def _moved(report, kind):
  return set(
    re.findall(
      rf"%asyncops_{kind}_start[.\d]* = \((\w+\[[\d,]+\])", report.hlo_text
    )
  )


@pytest.mark.parametrize("topology", ["v5e:2x4", "v6e:2x4"])
@pytest.mark.parametrize(
  "transfer,bidirectional", [("int8", False), ("float8_e4m3fn", True)]
)
def test_tpu_reducescatter_moves_quantized_partial_sums(
  topology, transfer, bidirectional
):
  if bidirectional and not TWO_WAY_CODES:
    program = _tpu_rs_program(topology, transfer, bidirectional)
    _refused_two_way(program, "matmul_reducescatter", [256, 516])
    return
  report = _tpu_rs_report(topology, transfer, bidirectional)
  kind = "bidirectional" if bidirectional else "ppermute"
  # [M, c + 4] per device: 256 rows, 512 codes + 4 scale bytes (two-way:
  # both halves' [128, 516] in one kernel).
  assert _moved(report, kind) == {"u8[256,516]"}, _moved(report, kind)
  assert len(report.pairs_for(kind)) == 3  # n - 1 hops
  report.assert_all_awaited()
  report.assert_no_defensive_copies()
  report.assert_no_inflight_copies()
  report.assert_overlapped(min_pairs=3, op=kind)


@pytest.mark.parametrize("topology", ["v5e:2x4", "v6e:2x4"])
def test_tpu_rows_form_moves_codes_and_scales(topology):
  if not TWO_WAY_CODES:
    _refused_two_way(
      _tpu_rows_program(topology), "allgather_matmul", [2, 1, 256, 516]
    )
    return
  report = _tpu_rows_report(topology)
  moved = _moved(report, "bidirectional")
  # Two halves of [1, 256, 512 + 4] in one kernel.
  assert moved == {"u8[2,1,256,516]"}, moved
  assert len(report.pairs_for("bidirectional")) == 3
  report.assert_all_awaited()
  report.assert_no_defensive_copies()
  report.assert_no_inflight_copies()
  report.assert_overlapped(min_pairs=3, op="bidirectional")
