"""Numerics of bidirectional, all_gather and copy on 8 CPU devices.

Each op runs under both emulation transfer points and must match its
``jax.lax`` reference bit for bit: the two-ppermute ring for
``bidirectional_start``, ``lax.all_gather`` (every ``axis``/``tiled``) for
``all_gather_start``, the identity for ``copy_start``. The TPU kernel bodies
themselves run in Pallas's TPU interpret mode against the same references.
"""

import functools

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

import asyncops
from asyncops.kernels import (
  _all_gather,
  _bidirectional,
  _common,
  _copy,
  _ppermute,
  _registry,
)
from asyncops.kernels._spec import OpSpec

DTYPES = ("float32", "bfloat16", "int32")
TRANSFERS = ("start", "done")
# (mesh shape, mesh axis names, the axis communicated over).
MESHES = (
  ((8,), ("i",), "i"),
  ((2, 4), ("x", "y"), "x"),
  ((2, 4), ("x", "y"), "y"),
)
MESH_IDS = ("8-i", "2x4-x", "2x4-y")


@functools.cache
def _mesh(shape, names):
  return jax.make_mesh(shape, names)


def _data(shape, dtype, seed=0):
  """Distinct values per element and device (exact in every dtype)."""
  n = int(np.prod(shape))
  base = (np.arange(n) * 7 + seed) % 251 - 125
  return jnp.asarray(base.reshape(shape), dtype=dtype)


def _run(body, mesh_shape, names, x):
  """``body`` per device over all mesh axes; shards ``x`` on axis 0.

  ``body(x) -> (got, want)``; both are returned stacked over devices.
  """
  mesh = _mesh(mesh_shape, names)
  spec = P(names)
  f = jax.jit(
    jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=(spec, spec))
  )
  return f(jax.device_put(x, jax.NamedSharding(mesh, spec)))


def _abstract(mesh, shape):
  sharding = jax.NamedSharding(mesh, P(mesh.axis_names))
  return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding)


def _assert_same(got, want):
  assert got.dtype == want.dtype
  assert got.shape == want.shape
  np.testing.assert_array_equal(
    np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32))
  )


def _ring(n, k):
  return [(i, (i + k) % n) for i in range(n)]


def _bidirectional_ref(x, axis):
  n = jax.lax.axis_size(axis)
  h = x.shape[0] // 2
  return jnp.concatenate(
    [
      jax.lax.ppermute(x[:h], axis, _ring(n, 1)),
      jax.lax.ppermute(x[h:], axis, _ring(n, -1)),
    ]
  )


def _check_bidirectional(mesh_shape, names, axis, shape, dtype, transfer):
  x = _data((int(np.prod(mesh_shape)) * shape[0], *shape[1:]), dtype)

  def body(x):
    x, fut = asyncops.bidirectional_start(x, axis)
    return asyncops.bidirectional_done(fut), _bidirectional_ref(x, axis)

  with asyncops.emulation(transfer):
    got, want = _run(body, mesh_shape, names, x)
  _assert_same(got, want)
  return got


def _check_all_gather(
  mesh_shape, names, axis, shape, dtype, transfer, gather_axis, tiled
):
  x = _data((int(np.prod(mesh_shape)) * shape[0], *shape[1:]), dtype)

  def body(x):
    x, fut = asyncops.all_gather_start(x, axis, axis=gather_axis, tiled=tiled)
    got = asyncops.all_gather_done(fut)
    want = jax.lax.all_gather(x, axis, axis=gather_axis, tiled=tiled)
    # Stack devices on a new leading axis so every result shape shards.
    return got[None], want[None]

  with asyncops.emulation(transfer):
    got, want = _run(body, mesh_shape, names, x)
  _assert_same(got, want)
  return got


# bidirectional ---------------------------------------------------------------


@pytest.mark.parametrize("transfer", TRANSFERS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mesh_shape,names,axis", MESHES, ids=MESH_IDS)
def test_bidirectional_matches_two_ppermutes(
  mesh_shape, names, axis, dtype, transfer
):
  got = _check_bidirectional(mesh_shape, names, axis, (4, 3), dtype, transfer)
  # The reference itself is not the identity: data really moved.
  x = _data((int(np.prod(mesh_shape)) * 4, 3), dtype)
  assert not np.array_equal(
    np.asarray(got.astype(jnp.float32)), np.asarray(x.astype(jnp.float32))
  )


@pytest.mark.parametrize("transfer", TRANSFERS)
def test_bidirectional_axis_size_one_is_identity(transfer):
  x = _data((8 * 2, 5), "float32")

  def body(x):
    x, fut = asyncops.bidirectional_start(x, "y")
    return asyncops.bidirectional_done(fut), x

  with asyncops.emulation(transfer):
    got, want = _run(body, (8, 1), ("x", "y"), x)
  _assert_same(got, want)


@pytest.mark.parametrize("transfer", TRANSFERS)
def test_bidirectional_axis_size_two(transfer):
  # Both neighbours are the same device: the result is its whole x.
  x = _data((8 * 4, 2), "int32")

  def body(x):
    x, fut = asyncops.bidirectional_start(x, "x")
    swapped = jax.lax.ppermute(x, "x", [(0, 1), (1, 0)])
    return asyncops.bidirectional_done(fut), swapped

  with asyncops.emulation(transfer):
    got, want = _run(body, (2, 4), ("x", "y"), x)
  _assert_same(got, want)


@pytest.mark.parametrize("transfer", TRANSFERS)
def test_bidirectional_send_done_then_recv_done(transfer):
  x = _data((8 * 6, 4), "bfloat16")

  def body(x):
    x, fut = asyncops.bidirectional_start(x, "i")
    src, fut = asyncops.send_done(fut)
    return asyncops.recv_done(fut) + src, _bidirectional_ref(x, "i") + x

  with asyncops.emulation(transfer):
    got, want = _run(body, (8,), ("i",), x)
  _assert_same(got, want)


@pytest.mark.parametrize("rows", [None, (1, 3)])
@pytest.mark.parametrize("transfer", TRANSFERS)
@pytest.mark.parametrize("mesh_shape,names,axis", MESHES, ids=MESH_IDS)
def test_bidirectional_whole_sends_all_of_x_both_ways(
  mesh_shape, names, axis, transfer, rows
):
  """``whole=True``: ``concat(x_{i-1}, x_{i+1})`` (an odd row count is
  fine; ``rows``: of those rows only), and its gradient is the reversed
  transfer's, summed: the cotangent of each copy goes back where it came
  from (zero on the rows that did not travel)."""
  x = _data((int(np.prod(mesh_shape)) * 3, 4), "float32")
  c = _data(x.shape, "float32", seed=5) / 8
  lo, hi = rows or (0, 3)

  def send(x):
    n = jax.lax.axis_size(axis)
    x, fut = asyncops.bidirectional_start(x, axis, whole=True, rows=rows)
    got = asyncops.bidirectional_done(fut)
    want = jnp.concatenate(
      [
        jax.lax.ppermute(x[lo:hi], axis, _ring(n, 1)),
        jax.lax.ppermute(x[lo:hi], axis, _ring(n, -1)),
      ]
    )
    return got, want

  def body(x, c):
    c = c[: hi - lo]
    weights = jnp.concatenate([c, c[::-1]])  # distinct per copy

    def loss(which):
      return lambda x: jnp.sum(jnp.sin(send(x)[which]) * weights)

    got, want = send(x)
    return got, want, jax.grad(loss(0))(x), jax.grad(loss(1))(x)

  mesh = _mesh(mesh_shape, names)
  spec = P(names)
  f = jax.jit(
    jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=(spec,) * 4)
  )
  put = functools.partial(jax.device_put, device=jax.NamedSharding(mesh, spec))
  with asyncops.emulation(transfer):
    got, want, g_got, g_want = f(put(x), put(c))
  assert got.shape == (2 * (hi - lo) * x.shape[0] // 3, 4)
  _assert_same(got, want)
  np.testing.assert_allclose(np.asarray(g_got), np.asarray(g_want), 1e-6, 1e-6)
  assert np.abs(np.asarray(g_got)).sum() > 0


def test_bidirectional_rows_without_whole_is_rejected():
  mesh = _mesh((8,), ("i",))

  def body(x):
    x, fut = asyncops.bidirectional_start(x, "i", rows=(0, 2))
    return asyncops.bidirectional_done(fut)

  f = jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i"))
  with pytest.raises(ValueError, match=r"rows = \(0, 2\) with whole = False"):
    jax.jit(f).trace(_abstract(mesh, (8 * 4, 2)))


def test_bidirectional_odd_leading_dim_is_rejected():
  mesh = _mesh((8,), ("i",))

  def body(x):
    x, fut = asyncops.bidirectional_start(x, "i")
    return asyncops.bidirectional_done(fut)

  f = jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i"))
  with pytest.raises(ValueError, match=r"x.shape\[0\] = 3 is odd.*Pad x"):
    jax.jit(f).trace(_abstract(mesh, (8 * 3, 2)))


@hypothesis.settings(max_examples=8, deadline=None)
@hypothesis.given(
  rows=st.integers(1, 4).map(lambda r: 2 * r),
  rest=st.lists(st.integers(1, 5), min_size=0, max_size=2),
  dtype=st.sampled_from(DTYPES),
  mesh_index=st.integers(0, len(MESHES) - 1),
  transfer=st.sampled_from(TRANSFERS),
)
def test_bidirectional_hypothesis(rows, rest, dtype, mesh_index, transfer):
  mesh_shape, names, axis = MESHES[mesh_index]
  _check_bidirectional(mesh_shape, names, axis, (rows, *rest), dtype, transfer)


# all_gather ------------------------------------------------------------------


@pytest.mark.parametrize("transfer", TRANSFERS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mesh_shape,names,axis", MESHES, ids=MESH_IDS)
def test_all_gather_matches_lax(mesh_shape, names, axis, dtype, transfer):
  _check_all_gather(mesh_shape, names, axis, (2, 3), dtype, transfer, 0, False)


@pytest.mark.parametrize("transfer", TRANSFERS)
@pytest.mark.parametrize("tiled", (False, True))
@pytest.mark.parametrize("gather_axis", (0, 1, 2, -1))
@pytest.mark.parametrize("mesh_shape,names,axis", MESHES, ids=MESH_IDS)
def test_all_gather_axis_and_tiled(
  mesh_shape, names, axis, gather_axis, tiled, transfer
):
  if tiled and gather_axis == 2:
    gather_axis = 1  # A tiled result has the input's rank (2).
  _check_all_gather(
    mesh_shape, names, axis, (2, 3), "float32", transfer, gather_axis, tiled
  )


@pytest.mark.parametrize("transfer", TRANSFERS)
def test_all_gather_axis_size_one(transfer):
  _check_all_gather((8, 1), ("x", "y"), "y", (2, 3), "int32", transfer, 0, True)


@pytest.mark.parametrize("transfer", TRANSFERS)
def test_all_gather_send_done_then_recv_done(transfer):
  x = _data((8 * 2, 4), "float32")

  def body(x):
    x, fut = asyncops.all_gather_start(x, "y", axis=1, tiled=True)
    src, fut = asyncops.send_done(fut)
    got = asyncops.recv_done(fut)
    want = jax.lax.all_gather(x, "y", axis=1, tiled=True)
    return (got + 1)[None], (want + 1)[None]

  with asyncops.emulation(transfer):
    got, want = _run(body, (2, 4), ("x", "y"), x)
  _assert_same(got, want)


@hypothesis.settings(max_examples=10, deadline=None)
@hypothesis.given(
  shape=st.lists(st.integers(1, 4), min_size=1, max_size=3),
  dtype=st.sampled_from(DTYPES),
  mesh_index=st.integers(0, len(MESHES) - 1),
  tiled=st.booleans(),
  data=st.data(),
)
def test_all_gather_hypothesis(shape, dtype, mesh_index, tiled, data):
  mesh_shape, names, axis = MESHES[mesh_index]
  ndim = len(shape) + (0 if tiled else 1)
  gather_axis = data.draw(st.integers(-ndim, ndim - 1), label="axis")
  transfer = data.draw(st.sampled_from(TRANSFERS), label="transfer")
  _check_all_gather(
    mesh_shape, names, axis, tuple(shape), dtype, transfer, gather_axis, tiled
  )


@pytest.mark.parametrize("axis", (2, -3))
def test_all_gather_axis_out_of_range_is_rejected(axis):
  mesh = _mesh((8,), ("i",))

  def body(x):
    x, fut = asyncops.all_gather_start(x, "i", axis=axis, tiled=True)
    return asyncops.all_gather_done(fut)

  f = jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i"))
  with pytest.raises(ValueError, match=f"axis={axis} is out of range"):
    jax.jit(f).trace(_abstract(mesh, (8 * 2, 2)))


# copy ------------------------------------------------------------------------


@pytest.mark.parametrize("transfer", TRANSFERS)
@pytest.mark.parametrize("memory_space", ("any", "vmem"))
@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_in_shard_map_is_identity(dtype, memory_space, transfer):
  x = _data((8 * 3, 4), dtype, seed=3)

  def body(x):
    x, fut = asyncops.copy_start(x, memory_space=memory_space)
    y = x * 2  # compute on the returned source while the copy runs
    return asyncops.copy_done(fut), y // 2 if dtype == "int32" else y / 2

  with asyncops.emulation(transfer):
    got, same = _run(body, (2, 4), ("x", "y"), x)
  _assert_same(got, x)
  _assert_same(same, x)


@pytest.mark.parametrize("transfer", TRANSFERS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_under_plain_jit_is_identity(dtype, transfer):
  x = _data((5, 7), dtype, seed=1)

  @jax.jit
  def f(x):
    x, fut = asyncops.copy_start(x)
    src, fut = asyncops.send_done(fut)
    return asyncops.recv_done(fut), src

  with asyncops.emulation(transfer):
    got, src = f(x)
  _assert_same(got, x)
  _assert_same(src, x)


def test_copy_bad_memory_space_is_rejected():
  with pytest.raises(ValueError, match="memory_space must be 'any' or 'vmem'"):
    asyncops.copy_start(jnp.zeros((2,)), memory_space="hbm")


# The TPU kernel bodies, interpreted on CPU -----------------------------------
#
# The emulation above checks the ops' semantics; this checks the Mosaic kernel
# bodies themselves (barriers, DMA targets, semaphore counts) in Pallas's TPU
# interpret mode, which simulates remote DMAs, semaphores and the barrier on
# CPU devices and detects races. Interpret mode cannot return semaphores from
# a kernel, so the start body and both wait bodies run in one kernel with
# scratch semaphores; the split across kernels is checked on compiled HLO
# (tests/test_kernels_tpu.py).

_START_KERNELS = {
  "ppermute": _ppermute.ppermute_start_kernel,
  "bidirectional": _bidirectional.bidirectional_start_kernel,
  "all_gather": _all_gather.all_gather_start_kernel,
  "copy": _copy.copy_start_kernel,
}


def _fused_kernel(x_ref, o_ref, *sems, spec: OpSpec, n_send: int):
  k = _registry.get(spec.kind)
  _START_KERNELS[spec.kind](x_ref, x_ref, o_ref, *sems, spec=spec)
  k.wait_send(x_ref, sems[:n_send], spec=spec)
  k.wait_recv(o_ref, sems[n_send:], spec=spec)


def _interpret(x, spec: OpSpec):
  k = _registry.get(spec.kind)
  n_send, n_recv = k.send_sems(spec), k.recv_sems(spec)
  raw = pl.pallas_call(
    functools.partial(_fused_kernel, spec=spec, n_send=n_send),
    out_shape=jax.ShapeDtypeStruct(k.dst_shape(spec), x.dtype),
    in_specs=[_common.ANY],
    out_specs=_common.ANY,
    scratch_shapes=[pltpu.SemaphoreType.DMA] * (n_send + n_recv),
    compiler_params=_common.params(collective_id=spec.collective_id),
    interpret=pltpu.InterpretParams(detect_races=True),
  )(x)
  return k.finalize(raw, spec)


@pytest.mark.parametrize(
  "kind,mesh_shape",
  [
    ("bidirectional", (2, 4)),
    ("bidirectional", (4, 2)),
    ("bidirectional", (8, 1)),
    ("all_gather", (2, 4)),
    ("all_gather", (4, 2)),
    ("all_gather", (8, 1)),
    ("ppermute", (2, 4)),
    ("ppermute", (8, 1)),
    ("copy", (2, 4)),
  ],
)
def test_kernel_bodies_interpreted(kind, mesh_shape, capfd):
  n = mesh_shape[1]
  x = _data((8 * 4, 2 * 128), "float32")

  def body(x):
    spec = OpSpec(
      kind=kind,
      shape=tuple(x.shape),
      dtype="float32",
      axis_name="y",
      mesh_axes=("x", "y"),
      axis_size=n,
      perm=tuple((i, (i + 1) % n) for i in range(n)),
      gather_axis=1,
      tiled=True,
      collective_id=0,
    )
    want = _registry.get(kind).finalize(
      _registry.get(kind).emulate(x, spec=spec), spec
    )
    return _interpret(x, spec)[None], want[None]

  mesh = _mesh(mesh_shape, ("x", "y"))
  spec = P(("x", "y"))
  f = jax.jit(
    jax.shard_map(
      body, mesh=mesh, in_specs=spec, out_specs=(spec, spec), check_vma=False
    )
  )
  got, want = f(jax.device_put(x, jax.NamedSharding(mesh, spec)))
  _assert_same(got, want)
  printed = capfd.readouterr().out
  assert "RACE DETECTED" not in printed
  assert "non-zero count" not in printed  # every DMA was waited for
