"""The Ref API's two-way all-gather ring of whole chunks, on CPU.

``asyncops.collective_matmul._ref_whole``, forced at small shapes
(``WHOLE_ACC_BYTES = 0``): numerics and gradients against ``jnp`` over ring
sizes, dtypes, shapes and several weights, the transfers it traces (``2 (n
- 1)`` half-chunk permutes, every source a slot of one Ref over ``x``) and
the hazard check still refusing a read of an in-flight destination or a
write of an in-flight source in this ring's layout. Compiled TPU structure
is in ``tests/test_ref_whole_tpu.py``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import asyncops
from asyncops import _jax_compat as jc
from asyncops import collective_matmul as _cm
from asyncops import stateful
from asyncops.collective_matmul import _gather_rings, _ref_whole
from asyncops.futures._future import FutureError


@pytest.fixture(autouse=True)
def _whole(monkeypatch):
  monkeypatch.setattr(_gather_rings, "WHOLE_ACC_BYTES", 0)


def _mesh(n):
  return Mesh(
    np.array(jax.devices()[:n]),
    ("y",),
    axis_types=(jax.sharding.AxisType.Explicit,),
  )


def _operands(mesh, n, m, k, fs, dtype):
  keys = jax.random.split(jax.random.key(7), 1 + len(fs))
  x = jax.random.normal(keys[0], (m, n * k), jnp.float32).astype(dtype)
  ws = [
    jax.random.normal(kk, (n * k, n * f), jnp.float32).astype(dtype)
    for kk, f in zip(keys[1:], fs, strict=True)
  ]
  put = lambda a: jax.device_put(a, NamedSharding(mesh, P(None, "y")))  # noqa: E731
  return put(x), [put(w) for w in ws]


def _ours(mesh, n_ws):
  def body(x, *ws):
    out = _cm.allgather_matmul(
      x,
      ws if n_ws > 1 else ws[0],
      "y",
      api="ref",
      bidirectional=True,
      method="ring",
    )
    return out if n_ws > 1 else (out,)

  specs = (P(None, "y"),) * (1 + n_ws)
  return jax.jit(
    jax.shard_map(
      body, mesh=mesh, in_specs=specs, out_specs=(P(None, "y"),) * n_ws
    )
  )


# (ring size, rows per device, k per device, output columns per weight,
# dtype): odd and even rings (the even ones send the antipode one way),
# one and two weights, float32 and bfloat16.
CASES = [
  (3, 8, 16, (24,), jnp.float32),
  (4, 8, 16, (24,), jnp.float32),
  (4, 16, 8, (8, 16), jnp.float32),
  (5, 4, 8, (16,), jnp.float32),
  (6, 12, 8, (16,), jnp.bfloat16),
  (8, 8, 16, (8, 8), jnp.float32),
  (8, 16, 32, (32,), jnp.bfloat16),
]


@pytest.mark.parametrize("n,m,k,fs,dtype", CASES)
def test_matches_jnp(n, m, k, fs, dtype):
  mesh = _mesh(n)
  x, ws = _operands(mesh, n, m, k, fs, dtype)
  f = _ours(mesh, len(ws))
  outs = []
  for transfer in ("start", "done"):
    with asyncops.emulation(transfer):
      outs.append(f(x, *ws))
  for a, b in zip(*outs, strict=True):  # both emulation points agree
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  x32 = np.asarray(x, np.float32)
  for got, w in zip(outs[0], ws, strict=True):
    want = x32 @ np.asarray(w, np.float32)
    got = np.asarray(got.astype(jnp.float32))
    if dtype == jnp.float32:
      np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    else:
      scale = np.sqrt(n * k)
      np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * scale)


@pytest.mark.parametrize("n,m,k,fs", [(4, 8, 16, (24,)), (5, 4, 8, (8, 16))])
def test_gradient_matches_jnp(n, m, k, fs):
  mesh = _mesh(n)
  x, ws = _operands(mesh, n, m, k, fs, jnp.float32)
  ours = _ours(mesh, len(ws))

  def loss(f):
    return lambda x, *ws: sum(jnp.sum(jnp.sin(o)) for o in f(x, *ws))

  def plain(x, *ws):
    return tuple(jnp.dot(x, w) for w in ws)

  args = (x, *ws)
  argnums = tuple(range(len(args)))
  with jax.set_mesh(mesh):
    gots = jax.grad(loss(ours), argnums)(*args)
  wants = jax.grad(loss(plain), argnums)(
    *(np.asarray(a, np.float32) for a in args)
  )
  for g, r in zip(gots, wants, strict=True):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), 2e-4, 2e-4)


def _prims(jaxpr):
  for e in jaxpr.eqns:
    yield e
    for sub in jax.core.jaxprs_in_params(e.params):
      yield from _prims(sub)


@pytest.mark.parametrize("n", [3, 4, 7, 8])
def test_traces_half_chunk_permutes_from_x(n):
  """``2 (n - 1)`` permutes (each direction ``n - 1`` half chunks; the
  antipode of an even ring one way), every one of shape ``[M/2, k]``, the
  first two of each piece from a slot of the Ref made of ``x`` itself; no
  Ref of ``x``'s whole shape is made (the former ring's two copies)."""
  m, k = 8, 16
  mesh = _mesh(n)
  x, ws = _operands(mesh, n, m, k, (16,), jnp.float32)
  jaxpr = jax.make_jaxpr(_ours(mesh, 1))(x, *ws).jaxpr
  eqns = list(_prims(jaxpr))
  starts = [e for e in eqns if e.primitive.name == "asyncops_ref_start"]
  assert len(starts) == 2 * (n - 1)
  refs = [e for e in eqns if e.primitive.name in ("new_ref", "mutable_array")]
  shapes = [tuple(e.outvars[0].aval.inner_aval.shape) for e in refs]
  assert (m, k) not in shapes, shapes
  assert (2, m // 2, k) in shapes, shapes  # x as two row-piece slots
  for s in starts:
    assert s.params["spec"].shape == (m // 2, k), s.params["spec"]


def test_applies_only_to_the_ref_two_way_contracting_ring():
  x = jnp.zeros((8, 4))
  ws = (jnp.zeros((16, 4)),)
  base = dict(n=4, api="ref", bidirectional=True, return_gathered=False)
  assert _ref_whole.applies(False, x, ws, tuple(base.items()))
  for change in (
    dict(api="value"),
    dict(bidirectional=False),
    dict(return_gathered=True),
    dict(n=2),
  ):
    opts = tuple({**base, **change}.items())
    assert not _ref_whole.applies(False, x, ws, opts), change
  assert not _ref_whole.applies(True, x, ws, tuple(base.items()))


def _first_step(bad):
  """The ring's first transfer of a piece (``x``'s slot ``j`` both ways
  into the two slots of a piece Ref), with ``bad`` inside the window."""
  mesh = _mesh(4)

  def body(x):
    xr = jax.new_ref(x.reshape(2, x.shape[0] // 2, x.shape[1]))
    dst = jc.empty_ref(jax.ShapeDtypeStruct(xr.shape, x.dtype))
    f1 = stateful.ppermute_start(xr.at[0], dst.at[0], "y", shift=1)
    f2 = stateful.ppermute_start(xr.at[0], dst.at[1], "y", shift=-1)
    y = bad(xr, dst)
    stateful.ppermute_done(f1, xr.at[0], dst.at[0])
    stateful.ppermute_done(f2, xr.at[0], dst.at[1])
    return dst[...].reshape(x.shape) + y

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("y"), out_specs=P("y")))
  x = jax.device_put(jnp.ones((32, 8)), NamedSharding(mesh, P("y")))
  return f(x)


def test_window_reads_of_sources_pass():
  out = _first_step(lambda xr, dst: jnp.sum(xr[...]))
  assert out.shape == (32, 8)


def _write_source(xr, dst):
  xr[0] = jnp.zeros(xr.shape[1:], xr.dtype)
  return 0.0


@pytest.mark.parametrize(
  "bad",
  [
    pytest.param(lambda xr, dst: jnp.sum(dst[0]), id="read_destination"),
    pytest.param(lambda xr, dst: jnp.sum(dst[...]), id="read_whole_dst"),
    pytest.param(_write_source, id="write_source"),
  ],
)
def test_hazards_in_this_layout_are_refused(bad):
  with pytest.raises(
    (FutureError, ValueError),
    match="(reads|writes) the (destination|source) Ref",
  ):
    _first_step(bad)
