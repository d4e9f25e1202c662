"""Every dtype a DMA can carry: exact ``jax.lax`` results on CPU.

8-bit floats and 4-bit types move as they are; ``bool`` and ``complex64``
travel as a carrier (``asyncops.futures._bitcast``). Results are compared
bit for bit (NaNs included) against ``jax.lax``, under both emulation
transfer points. The Ref API takes the directly movable dtypes and refuses
carriers with the fix.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import asyncops
from asyncops import _jax_compat as jc
from asyncops import stateful as st
from asyncops.kernels import _common
from asyncops.testing import cpu_mesh

N = 8
# The 8-bit floats and 4-bit types move on jax >= 0.10 only (the older
# libtpu aborts compiling them): test_narrow_dtypes_need_jax_0_10.
NARROW = _common.NARROW_DTYPES if jc.NARROW_DMA else ()
DTYPES = NARROW + ("bool", "complex64")


def _data(dtype: str, shape=(N * 4, 8)):
  rng = np.random.default_rng(len(dtype))
  if dtype == "bool":
    return jnp.asarray(rng.random(shape) < 0.5)
  if dtype == "complex64":
    z = rng.normal(size=shape) + 1j * rng.normal(size=shape)
    return jnp.asarray(z.astype(np.complex64))
  if dtype in ("int4", "uint4"):
    lo = -8 if dtype == "int4" else 0
    return jnp.asarray(rng.integers(lo, lo + 16, shape), dtype)
  x = jnp.asarray(rng.normal(size=shape) * 4, jnp.float32).astype(dtype)
  if dtype.startswith("float8"):  # a NaN must travel too
    x = x.at[0, 0].set(jnp.nan)
  return x


def _bits(x):
  """The bytes of ``x`` (4-bit values widened), for exact comparison."""
  x = np.asarray(x)
  if x.dtype.itemsize == 1 and x.dtype.name in ("int4", "uint4"):
    return x.astype(np.int8)
  if x.dtype.name == "float4_e2m1fn":
    return x.astype(np.float32)
  return x.view(np.uint8)


def _ring(n):
  return [(i, (i + 1) % n) for i in range(n)]


OPS = {
  "ppermute": (
    lambda x: asyncops.ppermute_done(
      asyncops.ppermute_start(x, "i", shift=1)[1]
    ),
    lambda x: jax.lax.ppermute(x, "i", _ring(N)),
  ),
  "bidirectional": (
    lambda x: asyncops.bidirectional_done(
      asyncops.bidirectional_start(x, "i")[1]
    ),
    lambda x: jnp.concatenate(
      [
        jax.lax.ppermute(x[: x.shape[0] // 2], "i", _ring(N)),
        jax.lax.ppermute(
          x[x.shape[0] // 2 :], "i", [(d, s) for s, d in _ring(N)]
        ),
      ]
    ),
  ),
  "all_gather_tiled_last": (
    lambda x: asyncops.all_gather_done(
      asyncops.all_gather_start(x, "i", axis=1, tiled=True)[1]
    ),
    lambda x: jax.lax.all_gather(x, "i", axis=1, tiled=True),
  ),
  "all_gather_stacked": (
    lambda x: asyncops.all_gather_done(
      asyncops.all_gather_start(x, "i", axis=0)[1]
    ),
    lambda x: jax.lax.all_gather(x, "i", axis=0),
  ),
  "copy": (
    lambda x: asyncops.copy_done(asyncops.copy_start(x)[1]),
    lambda x: x,
  ),
  # send_done/recv_done and the x a start returns (used in the window).
  "split_waits": (
    lambda x: _split_waits(x),
    lambda x: (x, jax.lax.ppermute(x, "i", _ring(N))),
  ),
}


def _split_waits(x):
  x, fut = asyncops.ppermute_start(x, "i", shift=1)
  seen = x  # read while in flight: the aliased source, user dtype
  x, fut = asyncops.send_done(fut)
  assert x.dtype == seen.dtype
  return seen, asyncops.recv_done(fut)


@pytest.fixture(scope="module")
def mesh():
  return cpu_mesh((N,), ("i",))


def _shard(f, mesh):
  return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("i"), out_specs=P("i")))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transfer", ["start", "done"])
def test_value_api_matches_lax(mesh, dtype, transfer):
  x = _data(dtype)
  for name, (ours, ref) in OPS.items():
    with asyncops.emulation(transfer):
      got = _shard(ours, mesh)(x)
    want = _shard(ref, mesh)(x)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      assert g.dtype == w.dtype == jnp.dtype(dtype), name
      assert g.shape == w.shape, name
      np.testing.assert_array_equal(_bits(g), _bits(w), err_msg=name)


def test_complex_gradient_through_carrier(mesh):
  x = _data("complex64")

  def loss(x):
    y = _shard(OPS["ppermute"][0], mesh)(x)
    return jnp.sum(jnp.abs(y * (1 + 2j)) ** 2)

  def ref(x):
    y = _shard(OPS["ppermute"][1], mesh)(x)
    return jnp.sum(jnp.abs(y * (1 + 2j)) ** 2)

  np.testing.assert_allclose(
    jax.grad(loss)(x), jax.grad(ref)(x), rtol=1e-6, atol=1e-6
  )


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "int4"])
def test_ref_api_moves_narrow_dtypes(mesh, dtype):
  x = _data(dtype)

  def f(x):
    src, dst = jax.new_ref(x), jax.new_ref(jnp.zeros_like(x))
    fut = st.ppermute_start(src, dst, "i", shift=1)
    st.ppermute_done(fut, src, dst)
    return dst[...]

  if not jc.NARROW_DMA:  # jax < 0.10: refused (see below)
    with pytest.raises(TypeError, match=r"jax >= 0.10 only"):
      _shard(f, mesh)(x)
    return
  got = _shard(f, mesh)(x)
  want = _shard(OPS["ppermute"][1], mesh)(x)
  assert got.dtype == jnp.dtype(dtype)
  np.testing.assert_array_equal(_bits(got), _bits(want))


@pytest.mark.parametrize("dtype", ["bool", "complex64"])
def test_ref_api_refuses_carriers(mesh, dtype):
  x = _data(dtype)

  def f(x):
    src, dst = jax.new_ref(x), jax.new_ref(jnp.zeros_like(x))
    st.ppermute_start(src, dst, "i", shift=1)
    return x

  with pytest.raises(TypeError, match=r"src_ref holds .*Ref.*value API"):
    _shard(f, mesh)(x)


def test_complex_gather_stacked_last_refused(mesh):
  def f(x):
    return asyncops.all_gather_done(
      asyncops.all_gather_start(x, "i", axis=2)[1]
    )

  with pytest.raises(ValueError, match=r"axis=2 .*tiled=True"):
    _shard(f, mesh)(_data("complex64"))


def test_64_bit_refused_with_fix(mesh):
  def f(x):
    return asyncops.ppermute_start(x.astype(jnp.uint64), "i", shift=1)[0]

  with (
    jax.enable_x64(True),
    pytest.raises(TypeError, match=r"x has dtype uint64.*bitcast_convert_type"),
  ):
    _shard(f, mesh)(jnp.zeros((N, 4), jnp.uint32))


def test_carrier_future_as_loop_carry(mesh):
  """A bool future (a uint8 carrier) crosses loop iterations."""

  def ours(x):
    x, fut = asyncops.ppermute_start(x, "i", shift=1)

    def body(i, carry):
      acc, fut = carry
      y = asyncops.ppermute_done(fut)
      y, fut = asyncops.ppermute_start(y, "i", shift=1)
      return acc ^ y, fut

    acc, fut = asyncops.scheduling.fori_loop(0, 4, body, (x, fut), unroll=2)
    return acc ^ asyncops.ppermute_done(fut)

  def ref(x):
    y, acc = jax.lax.ppermute(x, "i", _ring(N)), x
    for _ in range(4):
      acc, y = acc ^ y, jax.lax.ppermute(y, "i", _ring(N))
    return acc ^ y

  x = _data("bool")
  got = _shard(ours, mesh)(x)
  assert got.dtype == jnp.bool_
  np.testing.assert_array_equal(got, _shard(ref, mesh)(x))


@pytest.mark.parametrize("dtype", _common.NARROW_DTYPES)
def test_narrow_dtypes_need_jax_0_10(mesh, dtype):
  """On jax >= 0.10 an 8-bit float or 4-bit type moves as it is; older jax
  refuses it at trace time, naming the fix (its libtpu would abort the
  process compiling the transfer)."""
  x = _data(dtype)

  def f(x):
    return asyncops.ppermute_done(asyncops.ppermute_start(x, "i", shift=1)[1])

  if jc.NARROW_DMA:
    assert _shard(f, mesh)(x).dtype == jnp.dtype(dtype)
  else:
    with pytest.raises(TypeError, match=r"jax >= 0.10 only.*jax\[tpu\]>=0.10"):
      _shard(f, mesh)(x)
