"""Numerics of the collective matmuls on 8 CPU devices.

Every variant is compared with the ``jax.lax`` collective + ``jnp.dot``
reference it replaces, under both emulation transfer points (data moving
at the start or at the done must give the same result), on a 2x4 and a
1x8 mesh, in float32 (equal up to summation order) and bfloat16 (within
its tolerance). The chapter's shape (1024, 2048, 8192) runs once.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import asyncops
from asyncops import collective_matmul as _cm

# These tests are about the rings (value and Ref APIs): method="ring".
# The default, method="auto", may run the fused kernel or XLA's
# collective instead (tests/test_fused_matmul*.py, test_auto_default).
allgather_matmul = functools.partial(_cm.allgather_matmul, method="ring")
matmul_allreduce = functools.partial(_cm.matmul_allreduce, method="ring")
matmul_reducescatter = functools.partial(
  _cm.matmul_reducescatter, method="ring"
)
mlp_block = functools.partial(_cm.mlp_block, method="ring")

MESHES = {"2x4": ((2, 4), ("x", "y")), "1x8": ((1, 8), ("x", "y"))}
# (B, D, F): global shapes; small ones keep the file fast.
SHAPES = [(16, 32, 64), (8, 64, 32), (48, 128, 96)]
TOL = {jnp.float32: dict(rtol=2e-5, atol=2e-5), jnp.bfloat16: None}


def _mesh(name):
  shape, names = MESHES[name]
  return jax.make_mesh(
    shape, names, axis_types=(jax.sharding.AxisType.Explicit,) * 2
  )


def _rand(key, shape, dtype):
  x = jax.random.normal(jax.random.key(key), shape, jnp.float32)
  return x.astype(dtype)


def _put(mesh, x, spec):
  return jax.device_put(x, NamedSharding(mesh, spec))


def _shmap(mesh, fn, in_specs, out_specs):
  return jax.jit(
    jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
  )


def _close(got, want, dtype, contracting: int):
  got = np.asarray(got.astype(jnp.float32))
  want = np.asarray(want.astype(jnp.float32))
  assert got.shape == want.shape
  if dtype == jnp.float32:
    np.testing.assert_allclose(got, want, **TOL[jnp.float32])
  else:
    # bf16 has an 8-bit mantissa: allow a few ulps of the output scale,
    # which grows like sqrt(contracting) for unit normal inputs.
    scale = np.sqrt(contracting)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * scale)


def _both_transfers(run):
  outs = []
  for transfer in ("start", "done"):
    with asyncops.emulation(transfer):
      outs.append(run())
  np.testing.assert_array_equal(np.asarray(outs[0]), np.asarray(outs[1]))
  return outs[0]


# Specs per variant: (in_specs, out_specs, reference body).
def _ag_ref(a, w):
  return jnp.dot(jax.lax.all_gather(a, "y", axis=1, tiled=True), w)


def _rs_ref(h, w):
  return jax.lax.psum_scatter(
    jnp.dot(h, w), "y", scatter_dimension=1, tiled=True
  )


def _ar_ref(h, w):
  return jax.lax.psum(jnp.dot(h, w), "y")


VARIANTS = {
  "allgather": (allgather_matmul, (P("x", "y"), P(None, "y")), P("x", "y")),
  "reducescatter": (
    matmul_reducescatter,
    (P("x", "y"), P("y", None)),
    P("x", "y"),
  ),
  "allreduce": (matmul_allreduce, (P("x", "y"), P("y", None)), P("x", None)),
}
REFS = {"allgather": _ag_ref, "reducescatter": _rs_ref, "allreduce": _ar_ref}


def _operands(variant, shape, dtype):
  b, d, f = shape
  a = _rand(0, (b, d), dtype)
  w = _rand(1, (d, f), dtype)
  return a, w


# (mesh, shape, dtype, bidirectional): every shape in float32 on 2x4, both
# dtypes and directions, and the 1x8 ring; kept short so the file is fast.
CASES = [
  ("2x4", SHAPES[0], jnp.float32, False),
  ("2x4", SHAPES[1], jnp.float32, False),
  ("2x4", SHAPES[2], jnp.float32, False),
  ("2x4", SHAPES[0], jnp.float32, True),
  ("2x4", SHAPES[2], jnp.bfloat16, False),
  ("2x4", SHAPES[1], jnp.bfloat16, True),
  ("1x8", SHAPES[2], jnp.float32, True),
  ("1x8", SHAPES[0], jnp.bfloat16, False),
]


@pytest.mark.parametrize("mesh_name,shape,dtype,bidirectional", CASES)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_reference(variant, mesh_name, shape, dtype, bidirectional):
  fn, in_specs, out_spec = VARIANTS[variant]
  mesh = _mesh(mesh_name)
  a, w = _operands(variant, shape, dtype)
  a, w = _put(mesh, a, in_specs[0]), _put(mesh, w, in_specs[1])
  ours = _shmap(
    mesh,
    functools.partial(fn, axis_name="y", bidirectional=bidirectional),
    in_specs,
    out_spec,
  )
  ref = _shmap(mesh, REFS[variant], in_specs, out_spec)
  got = _both_transfers(lambda: ours(a, w))
  _close(got, ref(a, w), dtype, shape[1])
  # And the global product itself (the reference could share a bug).
  want = np.asarray(a, np.float32) @ np.asarray(w, np.float32)
  _close(got, jnp.asarray(want), dtype, shape[1])


@pytest.mark.parametrize(
  "mesh_name,api", [("1x8", "value"), ("1x8", "ref"), ("2x4", "value")]
)
def test_two_way_whole_chunks(monkeypatch, mesh_name, api):
  """Long-prefill two-way rings move whole chunks both ways and add two
  chunks' products per step (forced here at a small shape), and their
  gradient (whose residual is ``x`` itself) matches the reference's."""
  from asyncops.collective_matmul import _gather_rings

  monkeypatch.setattr(_gather_rings, "WHOLE_ACC_BYTES", 0)
  fn, in_specs, out_spec = VARIANTS["allgather"]
  mesh = _mesh(mesh_name)
  a, w = _operands("allgather", SHAPES[2], jnp.float32)
  a, w = _put(mesh, a, in_specs[0]), _put(mesh, w, in_specs[1])
  body = functools.partial(fn, axis_name="y", api=api, bidirectional=True)
  ours = _shmap(mesh, body, in_specs, out_spec)
  got = _both_transfers(lambda: ours(a, w))
  want = np.asarray(a, np.float32) @ np.asarray(w, np.float32)
  _close(got, jnp.asarray(want), jnp.float32, SHAPES[2][1])
  ref = _shmap(mesh, REFS["allgather"], in_specs, out_spec)

  def loss(f):
    return lambda a, w: jnp.sum(jnp.sin(f(a, w)))

  with jax.set_mesh(mesh):
    gots = jax.grad(loss(ours), (0, 1))(a, w)
    wants = jax.grad(loss(ref), (0, 1))(a, w)
  for g, r in zip(gots, wants, strict=True):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), 2e-4, 2e-4)


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_ref_api_matches_value_api(variant, bidirectional):
  fn, in_specs, out_spec = VARIANTS[variant]
  mesh = _mesh("2x4")
  a, w = _operands(variant, SHAPES[2], jnp.float32)
  a, w = _put(mesh, a, in_specs[0]), _put(mesh, w, in_specs[1])

  def run(api):
    body = functools.partial(
      fn, axis_name="y", api=api, bidirectional=bidirectional
    )
    return _shmap(mesh, body, in_specs, out_spec)(a, w)

  got = _both_transfers(lambda: run("ref"))
  # Same chunks in the same order: bit for bit.
  np.testing.assert_array_equal(np.asarray(got), np.asarray(run("value")))


def _mlp_ref(x, w_in, w_out):
  h = jax.nn.gelu(_ag_ref(x, w_in))
  return _rs_ref(h, w_out)


MLP_SPECS = ((P("x", "y"), P(None, "y"), P("y", None)), P("x", "y"))


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("mesh_name", ["2x4", "1x8"])
def test_mlp_block(mesh_name, dtype, bidirectional):
  mesh = _mesh(mesh_name)
  b, d, f = 16, 64, 128
  x = _put(mesh, _rand(0, (b, d), dtype), MLP_SPECS[0][0])
  w_in = _put(mesh, _rand(1, (d, f), dtype) / 8, MLP_SPECS[0][1])
  w_out = _put(mesh, _rand(2, (f, d), dtype) / 8, MLP_SPECS[0][2])
  ours = _shmap(
    mesh,
    functools.partial(mlp_block, axis_name="y", bidirectional=bidirectional),
    *MLP_SPECS,
  )
  got = _both_transfers(lambda: ours(x, w_in, w_out))
  want = _shmap(mesh, _mlp_ref, *MLP_SPECS)(x, w_in, w_out)
  _close(got, want, dtype, f)


def test_chapter_shape():
  """(B, D, F) = (1024, 2048, 8192) on 2x4: per device [512,512]x[2048,2048].

  Integer inputs as in the chapter (exact in float32: every product and
  partial sum is an integer below 2**24), so the check is bit for bit.
  """
  mesh = _mesh("2x4")
  b, d, f = 1024, 2048, 8192
  a = jax.random.randint(jax.random.key(0), (b, d), -2, 3).astype(jnp.float32)
  w = jax.random.randint(jax.random.key(1), (d, f), -2, 3).astype(jnp.float32)
  fn, in_specs, out_spec = VARIANTS["allgather"]
  a, w = _put(mesh, a, in_specs[0]), _put(mesh, w, in_specs[1])
  got = _shmap(mesh, functools.partial(fn, axis_name="y"), in_specs, out_spec)(
    a, w
  )
  np.testing.assert_array_equal(np.asarray(got), np.asarray(a) @ np.asarray(w))


def test_axis_size_one_is_local_matmul():
  mesh = jax.make_mesh(
    (8, 1), ("x", "y"), axis_types=(jax.sharding.AxisType.Explicit,) * 2
  )
  a = _put(mesh, _rand(0, (16, 32), jnp.float32), P("x", "y"))
  w = _put(mesh, _rand(1, (32, 24), jnp.float32), P(None, "y"))
  for fn in (allgather_matmul, matmul_reducescatter, matmul_allreduce):
    got = _shmap(
      mesh,
      functools.partial(fn, axis_name="y"),
      (P("x", "y"), P(None, "y")),
      P("x", "y"),
    )(a, w)
    np.testing.assert_allclose(
      got, np.asarray(a) @ np.asarray(w), rtol=1e-6, atol=1e-5
    )
    text = (
      jax.jit(
        jax.shard_map(
          functools.partial(fn, axis_name="y"),
          mesh=mesh,
          in_specs=(P("x", "y"), P(None, "y")),
          out_specs=P("x", "y"),
        )
      )
      .lower(a, w)
      .as_text()
    )
    assert "asyncops" not in text and "collective_permute" not in text


def test_allreduce_pads_nondivisible_columns():
  mesh = _mesh("2x4")
  a = _put(mesh, _rand(0, (16, 32), jnp.float32), P("x", "y"))
  w = _put(mesh, _rand(1, (32, 10), jnp.float32), P("y", None))  # 10 % 4
  got = _shmap(
    mesh,
    functools.partial(matmul_allreduce, axis_name="y"),
    (P("x", "y"), P("y", None)),
    P("x", None),
  )(a, w)
  np.testing.assert_allclose(
    got, np.asarray(a) @ np.asarray(w), **TOL[jnp.float32]
  )


# Errors --------------------------------------------------------------------


AG_SPECS = (P("x", "y"), P(None, "y"))


def _trace(fn, a_shape, w_shape, in_specs=AG_SPECS, **kw):
  mesh = _mesh("2x4")
  a = jax.ShapeDtypeStruct(
    a_shape[0], a_shape[1], sharding=NamedSharding(mesh, in_specs[0])
  )
  w = jax.ShapeDtypeStruct(
    w_shape[0], w_shape[1], sharding=NamedSharding(mesh, in_specs[1])
  )
  f = jax.shard_map(
    functools.partial(fn, **kw),
    mesh=mesh,
    in_specs=in_specs,
    out_specs=P("x", "y"),
  )
  return jax.jit(f).trace(a, w)


F32 = jnp.float32


@pytest.mark.parametrize(
  "fn,a,w,kw,err,match",
  [
    # allgather: rhs must hold every contracting row.
    (allgather_matmul, (16, 32), (16, 24), {}, ValueError, "rhs.shape.0."),
    # odd rows with bidirectional.
    (
      allgather_matmul,
      (6, 32),
      (32, 24),
      {"bidirectional": True},
      ValueError,
      "odd",
    ),
    (allgather_matmul, (16, 32), (32, 24), {"api": "x"}, ValueError, "api"),
    (allgather_matmul, (16, 32), (32, 24), {}, NameError, "not bound"),
  ],
)
def test_allgather_errors(fn, a, w, kw, err, match):
  axis = "z" if err is NameError else "y"
  with pytest.raises(err, match=match):
    _trace(fn, (a, F32), (w, F32), axis_name=axis, **kw)


def test_dtype_mismatch_names_arguments():
  with pytest.raises(TypeError, match="lhs has dtype float32 but rhs"):
    _trace(
      allgather_matmul, ((16, 32), F32), ((32, 24), jnp.bfloat16), axis_name="y"
    )


def test_non_movable_dtype():
  with pytest.raises(TypeError, match="lhs has dtype complex64, which the"):
    _trace(
      allgather_matmul,
      ((16, 32), jnp.complex64),
      ((32, 24), jnp.complex64),
      axis_name="y",
    )


def test_rank():
  """Leading batch dimensions of lhs are fine; a weight must be a matrix."""
  mesh = _mesh("2x4")
  x = jax.ShapeDtypeStruct(
    (2, 16, 32), F32, sharding=NamedSharding(mesh, P(None, "x", "y"))
  )
  w = jax.ShapeDtypeStruct(
    (2, 32, 24), F32, sharding=NamedSharding(mesh, P(None, None, "y"))
  )
  f = jax.shard_map(
    functools.partial(allgather_matmul, axis_name="y"),
    mesh=mesh,
    in_specs=(P(None, "x", "y"), P(None, None, "y")),
    out_specs=P(None, "x", "y"),
  )
  with pytest.raises(ValueError, match="rhs must be a matrix"):
    jax.jit(f).trace(x, w)


def test_reducescatter_nondivisible_columns():
  # Per device rhs [8, 10]: 10 columns cannot split over 4 devices.
  with pytest.raises(ValueError, match="not divisible by the size 4"):
    _trace(
      matmul_reducescatter,
      ((16, 32), F32),
      ((32, 10), F32),
      in_specs=(P("x", "y"), P("y", None)),
      axis_name="y",
    )


def test_reducescatter_contracting_mismatch():
  with pytest.raises(ValueError, match="contracting dimensions disagree"):
    _trace(
      matmul_reducescatter,
      ((16, 32), F32),
      ((16, 8), F32),
      in_specs=(P("x", "y"), P("y", None)),
      axis_name="y",
    )


def test_mlp_shape_errors():
  mesh = _mesh("2x4")
  specs = MLP_SPECS[0]

  def sds(shape, spec):
    return jax.ShapeDtypeStruct(shape, F32, sharding=NamedSharding(mesh, spec))

  f = jax.jit(
    jax.shard_map(
      functools.partial(mlp_block, axis_name="y"),
      mesh=mesh,
      in_specs=specs,
      out_specs=MLP_SPECS[1],
    )
  )
  with pytest.raises(ValueError, match="w_out.shape.0. = 8 must equal"):
    f.trace(
      sds((16, 32), specs[0]), sds((32, 64), specs[1]), sds((32, 32), specs[2])
    )
  with pytest.raises(ValueError, match="w_out.shape.1. = 16 must be"):
    f.trace(
      sds((16, 32), specs[0]), sds((32, 64), specs[1]), sds((64, 16), specs[2])
    )
