"""Numerics of the model-shaped collective matmuls on 8 CPU devices.

Any gather/scatter dimension, leading batch dimensions, several weights per
gather, the gathered ``lhs``, and the gated / sequence-parallel MLP block,
against the ``jax.lax`` program they replace. Every device's own result is
compared (each output gets a leading axis sharded over the ring), under
both emulation transfer points (which must agree bit for bit).
"""

import functools
import math

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st
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

MESHES = {"2x4": (2, 4), "1x8": (1, 8)}
DTYPES = ("float32", "bfloat16", "int32")
APIS = ("value", "ref")
# (bidirectional, api) for the parameterized forms; the unidirectional Ref
# ring is covered by the hypothesis tests and the bit-for-bit comparison.
RINGS = [(False, "value"), (True, "value"), (True, "ref")]


def _mesh(name):
  return jax.make_mesh(
    MESHES[name], ("x", "y"), axis_types=(jax.sharding.AxisType.Explicit,) * 2
  )


def _data(shape, dtype, seed):
  key = jax.random.key(seed)
  if dtype == "int32":
    return jax.random.randint(key, shape, -3, 4, jnp.int32)
  return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def _spec(rank, dim):
  """``P`` sharding ``dim`` of a rank-``rank`` array over ``y``."""
  return P(*[("y" if i == dim else None) for i in range(rank)])


def _run(mesh, body, args, specs, transfer="start"):
  """Each device's outputs of ``body``, stacked on a new leading axis."""

  def stacked(*a):
    return jax.tree.map(lambda o: o[None], body(*a))

  with asyncops.emulation(transfer):
    f = jax.jit(
      jax.shard_map(
        stacked,
        mesh=mesh,
        in_specs=specs,
        out_specs=P(("x", "y")),
      )
    )
    args = [
      jax.device_put(a, NamedSharding(mesh, s))
      for a, s in zip(args, specs, strict=True)
    ]
    return jax.tree.map(np.asarray, f(*args))


def _ours_and_ref(mesh, ours, ref, args, specs, both_points=True):
  """Runs ``ours`` under both transfer points (identical) and ``ref``.

  ``both_points=False`` (the hypothesis tests, to keep the suite short):
  the "start" transfer point only; the parameterized forms cover both.
  """
  got = _run(mesh, ours, args, specs, "start")
  if both_points:
    again = _run(mesh, ours, args, specs, "done")
    jax.tree.map(np.testing.assert_array_equal, got, again)
  return got, _run(mesh, ref, args, specs)


def _close(got, want, dtype, contracting):
  got = np.asarray(got, np.float64)
  want = np.asarray(want, np.float64)
  assert got.shape == want.shape
  if dtype == "int32":
    np.testing.assert_array_equal(got, want)
  elif dtype == "float32":
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * contracting)
  else:
    tol = 2e-2 * np.sqrt(contracting)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=tol)


# all-gather ------------------------------------------------------------------


def check_allgather(
  mesh_name,
  local,
  dim,
  fs,
  dtype,
  api,
  bidirectional,
  gathered,
  single,
  both_points=True,
):
  """``allgather_matmul`` vs ``[all_gather(lhs, dim) @ w for w in ws]``.

  ``local`` is the per-device shape of ``lhs``; weights are replicated.
  """
  mesh = _mesh(mesh_name)
  n = mesh.shape["y"]
  rank = len(local)
  d = dim % rank
  glob = tuple(s * n if i == d else s for i, s in enumerate(local))
  k = local[-1] * (n if d == rank - 1 else 1)
  lhs = _data(glob, dtype, 0)
  ws = [_data((k, f), dtype, 1 + i) for i, f in enumerate(fs)]
  specs = (_spec(rank, d),) + (P(),) * len(ws)

  def ours(x, *ws):
    out = allgather_matmul(
      x,
      ws[0] if single else list(ws),
      "y",
      gather_dim=dim,
      return_gathered=gathered,
      api=api,
      bidirectional=bidirectional,
    )
    res, g = out if gathered else (out, None)
    res = (res,) if single else res
    assert isinstance(res, tuple) and len(res) == len(ws)
    return res, g

  def ref(x, *ws):
    full = jax.lax.all_gather(x, "y", axis=d, tiled=True)
    res = tuple(jnp.matmul(full, w, preferred_element_type=x.dtype) for w in ws)
    return res, (full if gathered else None)

  got, want = _ours_and_ref(mesh, ours, ref, [lhs, *ws], specs, both_points)
  for g, w in zip(got[0], want[0], strict=True):
    _close(g, w, dtype, k)
  if gathered:
    np.testing.assert_array_equal(got[1], want[1])
  # And the global product (the reference could share a bug).
  lhs64 = np.asarray(lhs, np.float64)
  for g, w in zip(got[0], ws, strict=True):
    _close(g[0], lhs64 @ np.asarray(w, np.float64), dtype, k)


@pytest.mark.parametrize("bidirectional,api", RINGS)
@pytest.mark.parametrize(
  "local,dim",
  [
    ((4, 8), 0),  # sequence parallel [s/n, d]
    ((2, 4, 8), 1),  # [b, s/n, d]: P = 2, halves along b
    ((3, 4, 8), 1),  # P = 3 odd: halves along the rows (a transpose)
    ((4, 2, 8), 0),  # [s/n, b, d]: R = 2 * 2
    ((2, 3, 8), -1),  # contracting gather with a batch dimension
  ],
)
def test_allgather_forms(local, dim, bidirectional, api):
  check_allgather(
    "2x4", local, dim, (6, 3), "float32", api, bidirectional, True, False
  )


@hypothesis.settings(max_examples=10, deadline=None)
@hypothesis.given(
  lead=st.lists(st.integers(1, 3), min_size=0, max_size=3),
  k=st.sampled_from([2, 8]),
  fs=st.lists(st.integers(1, 5), min_size=1, max_size=3),
  dtype=st.sampled_from(DTYPES),
  mesh_name=st.sampled_from(list(MESHES)),
  api=st.sampled_from(APIS),
  bidirectional=st.booleans(),
  gathered=st.booleans(),
  data=st.data(),
)
def test_allgather_hypothesis(
  lead, k, fs, dtype, mesh_name, api, bidirectional, gathered, data
):
  local = (*lead, k)
  rank = len(local)
  dim = data.draw(st.integers(-rank, rank - 1), label="gather_dim")
  d = dim % rank
  if bidirectional:
    if d == rank - 1:
      hypothesis.assume(math.prod(local[:-1]) % 2 == 0)
    else:
      p, r = math.prod(local[:d]), math.prod(local[d:-1])
      hypothesis.assume(p % 2 == 0 or r % 2 == 0)
  single = len(fs) == 1 and data.draw(st.booleans(), label="single")
  check_allgather(
    mesh_name,
    local,
    dim,
    fs,
    dtype,
    api,
    bidirectional,
    gathered,
    single,
    False,
  )


@pytest.mark.parametrize("bidirectional", [False, True])
def test_ref_api_equals_value_api_bit_for_bit(bidirectional):
  """Same pieces in the same order: the Ref rings give identical bits."""
  mesh = _mesh("2x4")
  x = _data((2, 16, 8), "float32", 0)
  w = _data((8, 6), "float32", 1)
  w2 = _data((8, 4), "float32", 2)
  specs = (_spec(3, 1), P(), P())

  def run(api):
    def body(x, w, w2):
      (a, b), g = allgather_matmul(
        x,
        (w, w2),
        "y",
        gather_dim=1,
        return_gathered=True,
        api=api,
        bidirectional=bidirectional,
      )
      h = jnp.concatenate([a, b], axis=-1)
      wo = jnp.ones((10, 8), h.dtype)
      return (
        a,
        b,
        g,
        matmul_reducescatter(
          h, wo, "y", scatter_dim=1, api=api, bidirectional=bidirectional
        ),
      )

    return _run(mesh, body, [x, w, w2], specs)

  jax.tree.map(np.testing.assert_array_equal, run("ref"), run("value"))


# reduce-scatter --------------------------------------------------------------


def check_reducescatter(
  mesh_name, local, dim, f, dtype, api, bidirectional, both_points=True
):
  """``matmul_reducescatter`` vs ``psum_scatter(lhs @ w, dim, tiled)``.

  ``local`` is the per-device ``lhs`` (its contracting slice), sharded over
  ``y`` along the last dimension; ``w`` is ``[n k, f]`` sharded by rows.
  """
  mesh = _mesh(mesh_name)
  n = mesh.shape["y"]
  rank = len(local)
  k = local[-1]
  lhs = _data((*local[:-1], n * k), dtype, 0)
  w = _data((n * k, f), dtype, 1)
  specs = (_spec(rank, rank - 1), P("y", None))

  def ours(x, w):
    return matmul_reducescatter(
      x, w, "y", scatter_dim=dim, api=api, bidirectional=bidirectional
    )

  def ref(x, w):
    y = jnp.matmul(x, w, preferred_element_type=x.dtype)
    return jax.lax.psum_scatter(
      y, "y", scatter_dimension=dim % rank, tiled=True
    )

  got, want = _ours_and_ref(mesh, ours, ref, [lhs, w], specs, both_points)
  _close(got, want, dtype, n * k)
  # Device i holds block i of the global product.
  full = np.asarray(lhs, np.float64) @ np.asarray(w, np.float64)
  d = dim % rank
  blocks = np.split(full, n, axis=d)
  for i in range(n):
    _close(got[i], blocks[i], dtype, n * k)


@pytest.mark.parametrize("bidirectional,api", RINGS)
@pytest.mark.parametrize(
  "local,dim",
  [
    ((16, 8), 0),  # sequence parallel [s, f/n] -> [s/n, d]
    ((2, 8, 8), 1),  # [b, s, f/n] -> [b, s/n, d], P = 2
    ((3, 8, 8), 1),  # P = 3 odd: halves along the rows
    ((8, 2, 8), 0),  # [s, b, f/n] -> [s/n, b, d]
    ((2, 4, 8), -1),  # columns with a batch dimension
  ],
)
def test_reducescatter_forms(local, dim, bidirectional, api):
  check_reducescatter("2x4", local, dim, 8, "float32", api, bidirectional)


@hypothesis.settings(max_examples=10, deadline=None)
@hypothesis.given(
  lead=st.lists(st.integers(1, 3), min_size=0, max_size=3),
  k=st.sampled_from([2, 8]),
  dtype=st.sampled_from(DTYPES),
  mesh_name=st.sampled_from(list(MESHES)),
  api=st.sampled_from(APIS),
  bidirectional=st.booleans(),
  data=st.data(),
)
def test_reducescatter_hypothesis(
  lead, k, dtype, mesh_name, api, bidirectional, data
):
  n = MESHES[mesh_name][1]
  rank = len(lead) + 1
  dim = data.draw(st.integers(-rank, rank - 1), label="scatter_dim")
  d = dim % rank
  lead = list(lead)
  if d < rank - 1:
    lead[d] *= n  # the scattered dimension holds n blocks
  f = n * data.draw(st.integers(1, 3), label="f/n") if d == rank - 1 else 3
  if bidirectional:
    if d == rank - 1:
      hypothesis.assume(math.prod(lead) % 2 == 0)
    else:
      p, r = math.prod(lead[:d]), math.prod(lead[d:]) // n
      hypothesis.assume(p % 2 == 0 or r % 2 == 0)
  check_reducescatter(
    mesh_name, (*lead, k), dim, f, dtype, api, bidirectional, False
  )


def test_allreduce_batch_dimensions():
  mesh = _mesh("2x4")
  x = _data((2, 3, 32), "float32", 0)
  w = _data((32, 10), "float32", 1)  # 10 columns: padded internally
  specs = (_spec(3, 2), P("y", None))
  for bidirectional in (False, True):
    got, want = _ours_and_ref(
      mesh,
      functools.partial(
        matmul_allreduce, axis_name="y", bidirectional=bidirectional
      ),
      lambda x, w: jax.lax.psum(x @ w, "y"),
      [x, w],
      specs,
    )
    _close(got, want, "float32", 32)


def test_axis_size_one_new_forms():
  """A ring of one device is a local matmul (no transfer kernel)."""
  mesh = jax.make_mesh(
    (8, 1), ("x", "y"), axis_types=(jax.sharding.AxisType.Explicit,) * 2
  )
  x = _data((8, 4, 8), "float32", 0)
  w, w2 = _data((8, 6), "float32", 1), _data((8, 3), "float32", 2)
  specs = (P("x"), P(), P())

  def body(x, w, w2):
    (a, b), g = allgather_matmul(
      x, [w, w2], "y", gather_dim=1, return_gathered=True
    )
    c = matmul_reducescatter(x, w, "y", scatter_dim=1)
    return a, b, g, c

  got = _run(mesh, body, [x, w, w2], specs)
  xs = np.asarray(x).reshape(8, 1, 4, 8)
  tol = dict(rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got[0], xs @ np.asarray(w), **tol)
  np.testing.assert_allclose(got[1], xs @ np.asarray(w2), **tol)
  np.testing.assert_array_equal(got[2], xs)
  np.testing.assert_allclose(got[3], xs @ np.asarray(w), **tol)
  text = jax.jit(
    jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P("x"))
  ).lower(
    *[
      jax.device_put(a, NamedSharding(mesh, s))
      for a, s in zip([x, w, w2], specs, strict=True)
    ]
  )
  assert "asyncops" not in text.as_text()


# MLP block -------------------------------------------------------------------


def _mlp_ref(x, w_in, w_out, w_gate, *, dim, activation):
  full = jax.lax.all_gather(x, "y", axis=dim, tiled=True)
  h = activation(full @ w_in)
  if w_gate is not None:
    h = activation(full @ w_gate) * (full @ w_in)
  return jax.lax.psum_scatter(h @ w_out, "y", scatter_dimension=dim, tiled=True)


def check_mlp(
  local, seq_dim, gated, dtype, api, bidirectional, sp=True, both_points=True
):
  mesh = _mesh("2x4")
  n = mesh.shape["y"]
  rank = len(local)
  d_model = local[-1] * (1 if sp else n)
  dim = seq_dim % rank if sp else rank - 1
  f = 4 * n
  glob = tuple(s * n if i == dim else s for i, s in enumerate(local))
  x = _data(glob, dtype, 0)
  w_in = _data((d_model, f), dtype, 1) / 4
  w_out = _data((f, d_model), dtype, 2) / 4
  w_gate = _data((d_model, f), dtype, 3) / 4
  specs = (_spec(rank, dim), P(None, "y"), P("y", None), P(None, "y"))

  def ours(x, w_in, w_out, w_gate):
    return mlp_block(
      x,
      w_in,
      w_out,
      "y",
      w_gate=w_gate if gated else None,
      activation=jax.nn.silu,
      sequence_parallel=sp,
      sequence_dim=seq_dim,
      api=api,
      bidirectional=bidirectional,
    )

  def ref(x, w_in, w_out, w_gate):
    return _mlp_ref(
      x,
      w_in,
      w_out,
      w_gate if gated else None,
      dim=dim,
      activation=jax.nn.silu,
    )

  got, want = _ours_and_ref(
    mesh, ours, ref, [x, w_in, w_out, w_gate], specs, both_points
  )
  assert got.shape[1:] == local
  _close(got, want, dtype, f)


@pytest.mark.parametrize(
  "dtype,bidirectional,api",
  [
    ("float32", False, "value"),
    ("float32", True, "value"),
    ("float32", False, "ref"),
    ("float32", True, "ref"),
    ("bfloat16", False, "value"),
    ("bfloat16", True, "value"),
  ],
)
def test_llama_mlp_sequence_parallel(dtype, bidirectional, api):
  """The issue's target: a gated (SwiGLU) MLP, x [s/n, d] in and out."""
  check_mlp((8, 16), -2, True, dtype, api, bidirectional)


@pytest.mark.parametrize(
  "local,seq_dim,gated,sp,bidirectional",
  [
    ((2, 4, 16), -2, True, True, True),  # [b, s/n, d]
    ((4, 2, 16), 0, True, True, False),  # [s/n, b, d]
    ((2, 4, 16), 1, False, True, False),  # ungated, sequence parallel
    ((2, 4, 4), -2, True, False, True),  # gated, model-sharded [b, s, d/n]
  ],
)
def test_mlp_layouts(local, seq_dim, gated, sp, bidirectional):
  check_mlp(local, seq_dim, gated, "float32", "value", bidirectional, sp)


@hypothesis.settings(max_examples=6, deadline=None)
@hypothesis.given(
  lead=st.lists(st.integers(1, 3), min_size=0, max_size=2),
  rows=st.sampled_from([2, 4]),
  gated=st.booleans(),
  sp=st.booleans(),
  dtype=st.sampled_from(["float32", "bfloat16"]),
  api=st.sampled_from(APIS),
  bidirectional=st.booleans(),
  data=st.data(),
)
def test_mlp_hypothesis(lead, rows, gated, sp, dtype, api, bidirectional, data):
  """Any leading dimensions, sequence dimension, gate, layout and ring."""
  local = (*lead, rows, 8 if sp else 2)
  rank = len(local)
  # A row dimension, counted from either end (never the last one).
  rows_dims = [*range(rank - 1), *range(-rank, -1)]
  seq_dim = data.draw(st.sampled_from(rows_dims), label="sequence_dim")
  if bidirectional:
    if sp:
      d = seq_dim % rank
      p, r = math.prod(local[:d]), math.prod(local[d:-1])
      hypothesis.assume(p % 2 == 0 or r % 2 == 0)
    else:
      hypothesis.assume(math.prod(local[:-1]) % 2 == 0)
  check_mlp(local, seq_dim, gated, dtype, api, bidirectional, sp, False)


# Errors ----------------------------------------------------------------------


def _trace(fn, shapes, specs, dtype=jnp.float32):
  mesh = _mesh("2x4")
  args = [
    jax.ShapeDtypeStruct(s, dtype, sharding=NamedSharding(mesh, sp))
    for s, sp in zip(shapes, specs, strict=True)
  ]
  f = jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=P())
  return jax.jit(f).trace(*args)


ROWS = (P("y"), P(None, "y"))  # [s/n, d] x [d, f/n]


@pytest.mark.parametrize(
  "kw,shapes,specs,err,match",
  [
    ({"gather_dim": 2}, ((16, 8), (8, 8)), ROWS, ValueError, "gather_dim = 2"),
    ({"gather_dim": 0.0}, ((16, 8), (8, 8)), ROWS, TypeError, "must be an int"),
    # Rows form, but rhs holds n * k rows: suggest the contracting form.
    (
      {"gather_dim": 0},
      ((16, 8), (32, 8)),
      ROWS,
      ValueError,
      "did you mean gather_dim=-1",
    ),
    # Contracting form, but rhs holds k rows: suggest the rows form.
    (
      {},
      ((16, 32), (8, 8)),
      (P(None, "y"), P()),
      ValueError,
      "gather_dim=0",
    ),
    # Odd batch and odd chunk rows: no halves.
    (
      {"gather_dim": 1, "bidirectional": True},
      ((3, 12, 8), (8, 8)),
      (P(None, "y"), P()),
      ValueError,
      "both are odd",
    ),
    # Contracting form with an odd number of rows (leading dims folded).
    (
      {"bidirectional": True},
      ((3, 1, 32), (32, 8)),
      (P(None, None, "y"), P()),
      ValueError,
      "3 rows",
    ),
  ],
)
def test_allgather_errors(kw, shapes, specs, err, match):
  def body(x, w):
    return allgather_matmul(x, w, "y", **kw)

  with pytest.raises(err, match=match):
    _trace(body, shapes, specs)


def test_allgather_rhs_sequence_errors():
  def empty(x, w):
    return allgather_matmul(x, [], "y", gather_dim=0)

  with pytest.raises(ValueError, match="empty sequence"):
    _trace(empty, ((16, 8), (8, 8)), ROWS)

  def bad_second(x, w):
    return allgather_matmul(x, [w, w[:4]], "y", gather_dim=0)

  with pytest.raises(ValueError, match=r"rhs\[1\].shape\[0\] = 4"):
    _trace(bad_second, ((16, 8), (8, 8)), ROWS)

  def mixed_dtype(x, w):
    return allgather_matmul(x, [w, w.astype(jnp.bfloat16)], "y", gather_dim=0)

  with pytest.raises(TypeError, match=r"rhs\[1\] has bfloat16"):
    _trace(mixed_dtype, ((16, 8), (8, 8)), ROWS)

  def not_array(x, w):
    return allgather_matmul(x, {"w": w}, "y", gather_dim=0)

  with pytest.raises(TypeError, match="list/tuple of arrays"):
    _trace(not_array, ((16, 8), (8, 8)), ROWS)

  def batched_weight(x, w):
    return allgather_matmul(x, w[None], "y", gather_dim=0)

  with pytest.raises(ValueError, match="rhs must be a matrix"):
    _trace(batched_weight, ((16, 8), (8, 8)), ROWS)


def test_reducescatter_errors():
  def rows(x, w):
    return matmul_reducescatter(x, w, "y", scatter_dim=0)

  # 6 rows per device cannot split over 4 devices.
  with pytest.raises(ValueError, match=r"lhs.shape\[0\] = 6 .* not divisible"):
    _trace(rows, ((6, 32), (32, 8)), (P(None, "y"), P("y", None)))

  def bad_dim(x, w):
    return matmul_reducescatter(x, w, "y", scatter_dim=-3)

  with pytest.raises(ValueError, match="scatter_dim = -3"):
    _trace(bad_dim, ((8, 32), (32, 8)), (P(None, "y"), P("y", None)))

  def odd(x, w):
    return matmul_reducescatter(x, w, "y", scatter_dim=1, bidirectional=True)

  # P = 3, R = 4 / 4 = 1: both odd.
  with pytest.raises(ValueError, match="both are odd"):
    _trace(odd, ((3, 4, 32), (32, 8)), (P(None, None, "y"), P("y", None)))


def test_mlp_errors():
  specs = (P("y"), P(None, "y"), P("y", None), P(None, "y"))

  def sp(seq_dim=-2):
    def body(x, w_in, w_out, w_gate):
      return mlp_block(
        x,
        w_in,
        w_out,
        "y",
        w_gate=w_gate,
        sequence_parallel=True,
        sequence_dim=seq_dim,
      )

    return body

  good = ((16, 8), (8, 16), (16, 8), (8, 16))
  with pytest.raises(ValueError, match="sequence_dim = -1 is the model"):
    _trace(sp(-1), good, specs)
  with pytest.raises(ValueError, match="w_gate has shape"):
    _trace(sp(), ((16, 8), (8, 16), (16, 8), (8, 32)), specs)
  with pytest.raises(ValueError, match=r"w_in.shape\[0\] = 16 must be"):
    _trace(sp(), ((16, 8), (16, 16), (16, 8), (16, 16)), specs)
  with pytest.raises(ValueError, match=r"w_out.shape\[1\] = 4 must be"):
    _trace(sp(), ((16, 8), (8, 16), (16, 4), (8, 16)), specs)
