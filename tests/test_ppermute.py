"""ppermute_start/done: numerics on 8 CPU devices, structure on TPU HLO.

Numerics: both emulation transfer points, traced into one program, must
equal ``jax.lax.ppermute`` bit for bit (f32, bf16, int32; full and partial
perms; shifts of +-1 and +-3; 1-D and 2-D meshes). Structure: the same
programs compiled ahead of time for TPU, where each start and done is a
Mosaic custom call, the done's output aliases the destination and the
start's semaphores reach the done.
"""

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import asyncops
from tests import _hlo_util as hlo

DTYPES = ("float32", "bfloat16", "int32")
MESHES = {"1d": ((8,), ("i",)), "2d": ((2, 4), ("x", "y"))}


def _bits(a) -> np.ndarray:
  a = np.asarray(a)
  return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def _data(shape, dtype, seed=0) -> np.ndarray:
  rng = np.random.default_rng(seed)
  if jnp.issubdtype(dtype, jnp.integer):
    return rng.integers(-(2**31), 2**31 - 1, shape, dtype=np.int64).astype(
      dtype
    )
  return rng.standard_normal(shape).astype(np.float32).astype(dtype)


def _permute_program(mesh, axis, perm, shift):
  """One program: (start-mode result, done-mode result, lax reference)."""
  names = mesh.axis_names
  size = mesh.shape[axis]
  pairs = perm
  if shift is not None:
    pairs = [(j, (j + shift) % size) for j in range(size)]

  def body(x):
    outs = []
    for mode in ("start", "done"):
      with asyncops.emulation(mode):
        y, fut = asyncops.ppermute_start(x, axis, perm, shift=shift)
        outs.append(asyncops.ppermute_done(fut))
        outs.append(y)
    ref = jax.lax.ppermute(x, axis, pairs)
    return (*outs, ref)

  spec = P(names)
  return jax.jit(
    jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=(spec,) * 5)
  )


def _check_numerics(mesh_name, axis, perm, shift, dtype, local_shape):
  shape, names = MESHES[mesh_name]
  mesh = jax.make_mesh(shape, names)
  n = int(np.prod(shape))
  x = _data((local_shape[0] * n, *local_shape[1:]), jnp.dtype(dtype))
  x = jax.device_put(x, NamedSharding(mesh, P(names)))
  f = _permute_program(mesh, axis, perm, shift)
  y_start, x_start, y_done, x_done, ref = f(x)
  for got in (y_start, y_done):
    np.testing.assert_array_equal(_bits(got), _bits(ref))
  for got in (x_start, x_done):  # the returned x is the input, untouched.
    np.testing.assert_array_equal(_bits(got), _bits(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shift", [1, -1, 3, -3])
@pytest.mark.parametrize(
  "mesh_name,axis", [("1d", "i"), ("2d", "y"), ("2d", "x")]
)
def test_shift_matches_lax(mesh_name, axis, shift, dtype):
  _check_numerics(mesh_name, axis, None, shift, dtype, (2, 128))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
  "mesh_name,axis,perm",
  [
    ("1d", "i", [(0, 1), (1, 3), (5, 0)]),  # partial
    ("1d", "i", [(3, 3)]),  # to self only
    ("1d", "i", [(j, 7 - j) for j in range(8)]),  # full, not a ring
    ("2d", "y", [(0, 2), (3, 1)]),  # partial on the minor axis
    ("2d", "x", [(1, 0)]),  # partial on the major axis
  ],
)
def test_perm_matches_lax(mesh_name, axis, perm, dtype):
  _check_numerics(mesh_name, axis, perm, None, dtype, (3, 5))


@st.composite
def _cases(draw):
  mesh_name = draw(st.sampled_from(sorted(MESHES)))
  shape, names = MESHES[mesh_name]
  axis = draw(st.sampled_from(names))
  size = dict(zip(names, shape, strict=True))[axis]
  kind = draw(st.sampled_from(["shift", "full", "partial"]))
  perm = shift = None
  if kind == "shift":
    shift = draw(st.integers(-size - 1, size + 1))
  else:
    dsts = draw(st.permutations(range(size)))
    srcs = range(size)
    if kind == "partial":
      keep = draw(st.lists(st.booleans(), min_size=size, max_size=size))
      srcs = [s for s, k in zip(srcs, keep, strict=True) if k]
    perm = [(s, dsts[s]) for s in srcs]
  dtype = draw(st.sampled_from(DTYPES))
  rank = draw(st.integers(1, 3))
  local = tuple(draw(st.integers(1, 9)) for _ in range(rank))
  return mesh_name, axis, perm, shift, dtype, local


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(_cases())
def test_drawn_cases_match_lax(case):
  _check_numerics(*case)


@pytest.mark.parametrize("mode", ["start", "done"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_send_done_then_recv_done(mode, dtype):
  mesh = jax.make_mesh((8,), ("i",))
  perm = [(0, 2), (2, 4), (4, 0), (7, 6)]

  def body(x):
    with asyncops.emulation(mode):
      x1, fut = asyncops.ppermute_start(x, "i", perm)
      x2, fut2 = asyncops.send_done(fut)
      y = asyncops.recv_done(fut2)
    return x1, x2, y, jax.lax.ppermute(x, "i", perm)

  f = jax.jit(
    jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=(P("i"),) * 4)
  )
  x = jax.device_put(_data((16, 8), jnp.dtype(dtype), 1), mesh_sharding(mesh))
  x1, x2, y, ref = f(x)
  np.testing.assert_array_equal(_bits(y), _bits(ref))
  np.testing.assert_array_equal(_bits(x1), _bits(x))
  np.testing.assert_array_equal(_bits(x2), _bits(x))


def mesh_sharding(mesh):
  return NamedSharding(mesh, P(mesh.axis_names))


# TPU: compiled HLO -----------------------------------------------------------


def _tpu_program(mesh, axis, perm, shift, split=False, read_x=True):
  def body(x):
    x, fut = asyncops.ppermute_start(x, axis, perm, shift=shift)
    z = jnp.sin(x) * 2 if read_x else 0  # compute between start and done
    if split:
      x, fut = asyncops.send_done(fut)
      y = asyncops.recv_done(fut)
      z = z + jnp.cos(x)
    else:
      y = asyncops.ppermute_done(fut)
    return y + z

  spec = P(mesh.axis_names)
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))


TPU_CASES = [
  ((8,), ("i",), "i", None, 1),
  ((8,), ("i",), "i", None, -3),
  ((8,), ("i",), "i", [(0, 1), (1, 3), (5, 0)], None),
  ((2, 4), ("x", "y"), "y", None, 1),
  ((2, 4), ("x", "y"), "x", [(1, 0)], None),
]


def _compile(
  topology, mesh_shape, names, axis, perm, shift, dtype, split, read_x=True
):
  mesh = hlo.tpu_mesh(topology, mesh_shape, names)
  arg = jax.ShapeDtypeStruct(
    (8 * 16, 256), jnp.dtype(dtype), sharding=mesh_sharding(mesh)
  )
  f = _tpu_program(mesh, axis, perm, shift, split, read_x)
  return hlo.compile_hlo(f, arg)


def _check_start(instrs):
  (start,) = hlo.ours(instrs, "_start")
  assert hlo.is_mosaic(start), start.attrs[:200]
  assert ((0,), 0, ()) in start.aliasing  # x aliases through the start
  sems = hlo.sem_indices(start)
  assert len(sems) == 2, start.shape_text
  return start, sems


@pytest.mark.parametrize("topology", hlo.TOPOLOGIES)
@pytest.mark.parametrize("mesh_shape,names,axis,perm,shift", TPU_CASES)
def test_tpu_compile_structure(topology, mesh_shape, names, axis, perm, shift):
  instrs = _compile(
    topology, mesh_shape, names, axis, perm, shift, "float32", False
  )
  start, sems = _check_start(instrs)
  (done,) = hlo.ours(instrs, "_done")
  assert hlo.is_mosaic(done), done.attrs[:200]
  # The done's output aliases its operand 1, the destination buffer the
  # start returned at tuple index 1.
  assert done.aliasing == (((), 1, ()),)
  assert hlo.source(instrs, done.operands[1]) == (start.name, 1)
  # The source (index 0) is kept alive up to the done.
  assert hlo.source(instrs, done.operands[0]) == (start.name, 0)
  # Every semaphore output of the start is an operand of the done.
  got = [hlo.source(instrs, o) for o in done.operands[2:]]
  assert got == [(start.name, k) for k in sems]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("topology", hlo.TOPOLOGIES)
def test_tpu_compile_dtypes(topology, dtype):
  instrs = _compile(topology, (8,), ("i",), "i", None, 1, dtype, False)
  start, _ = _check_start(instrs)
  (done,) = hlo.ours(instrs, "_done")
  assert start.shape_text.startswith(f"({_hlo_dtype(dtype)}[16,256]")
  assert done.shape_text.startswith(f"{_hlo_dtype(dtype)}[16,256]")


def _hlo_dtype(dtype):
  return {"float32": "f32", "bfloat16": "bf16", "int32": "s32"}[dtype]


def _check_split(topology, read_x):
  instrs = _compile(
    topology,
    (8,),
    ("i",),
    "i",
    [(0, 1), (1, 3), (5, 0)],
    None,
    "int32",
    True,
    read_x,
  )
  start, (send_sem, recv_sem) = _check_start(instrs)
  (send,) = hlo.ours(instrs, "_send_done")
  (recv,) = hlo.ours(instrs, "_recv_done")
  assert hlo.is_mosaic(send) and hlo.is_mosaic(recv)
  # The send wait reads the source without aliasing it (an alias made XLA
  # copy the source when it was also read before the wait); it passes the
  # destination through (its one alias), and the receive wait takes that:
  # ordered after the send wait by data.
  assert send.aliasing == (((1,), 1, ()),)
  assert recv.aliasing == (((), 0, ()),)  # produces the destination
  assert hlo.source(instrs, send.operands[0]) == (start.name, 0)
  assert hlo.source(instrs, send.operands[1]) == (start.name, 1)
  assert [hlo.source(instrs, o) for o in send.operands[2:]] == [
    (start.name, send_sem)
  ]
  assert hlo.source(instrs, recv.operands[0]) == (send.name, 1)
  assert [hlo.source(instrs, o) for o in recv.operands[1:]] == [
    (start.name, recv_sem)
  ]


@pytest.mark.parametrize("topology", hlo.TOPOLOGIES)
def test_tpu_compile_split_waits(topology):
  # Compute on x only after send_done released it.
  _check_split(topology, read_x=False)


@pytest.mark.parametrize("topology", hlo.TOPOLOGIES)
def test_tpu_compile_split_waits_read_in_between(topology):
  # Reading x between start and send_done must not copy the DMA source.
  _check_split(topology, read_x=True)
