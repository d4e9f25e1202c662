"""Stateful API: numerics on 8 CPU devices, hazards, TPU HLO structure."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import asyncops
from asyncops import stateful as st
from asyncops.compare._patterns import PATTERNS, reference
from asyncops.futures._future import FutureError, NeverAwaitedWarning

N = 8


def _mesh():
  return jax.make_mesh((N,), ("i",))


def _run(fn, x, w, transfer):
  mesh = _mesh()
  g = jax.jit(
    jax.shard_map(
      fn, mesh=mesh, in_specs=(jax.P("i"), jax.P()), out_specs=jax.P("i")
    )
  )
  x = jax.device_put(x, jax.NamedSharding(mesh, jax.P("i")))
  w = jax.device_put(w, jax.NamedSharding(mesh, jax.P()))
  with asyncops.emulation(transfer):
    return np.asarray(g(x, w))


def _bind(p, side, steps):
  fn = p.ref if side == "ref" else p.value
  if side == "lax":
    fn = functools.partial(reference, p.name)
  return functools.partial(fn, n=steps) if p.looped or side == "lax" else fn


@pytest.mark.parametrize("transfer", ["start", "done"])
@pytest.mark.parametrize("p", PATTERNS, ids=lambda p: p.name)
def test_pattern_ref_equals_value_and_lax(p, transfer):
  kx, kw = jax.random.split(jax.random.key(hash(p.name) % 1000))
  x = jax.random.normal(kx, (N * 8, 128), jnp.float32)
  w = jax.random.normal(kw, (128, 128), jnp.float32) / 10
  steps = 5
  ref = _run(_bind(p, "ref", steps), x, w, transfer)
  val = _run(_bind(p, "value", steps), x, w, transfer)
  lax = _run(_bind(p, "lax", steps), x, w, transfer)
  np.testing.assert_allclose(ref, val, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ref, lax, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32])
@pytest.mark.parametrize(
  "perm", [[(0, 3), (3, 5), (5, 0)], [(i, 7 - i) for i in range(8)]]
)
def test_partial_perm_keeps_destination(dtype, perm):
  def f(x, w):
    del w
    x_ref, y_ref = jax.new_ref(x), jax.new_ref(-jnp.ones_like(x))
    fut = st.ppermute_start(x_ref, y_ref, "i", perm=perm)
    st.ppermute_done(fut, x_ref, y_ref)
    return y_ref[...]

  x = jnp.arange(N * 16, dtype=jnp.float32).reshape(N * 2, 8).astype(dtype)
  for transfer in ("start", "done"):
    got = _run(f, x, jnp.zeros((1,)), transfer).reshape(N, 2, 8)
    want = -np.ones((N, 2, 8), np.asarray(x).dtype)
    for s, d in perm:
      want[d] = np.asarray(x).reshape(N, 2, 8)[s]
    np.testing.assert_array_equal(got, want)


# Hazards ---------------------------------------------------------------------


def _trace(fn):
  mesh = _mesh()
  g = jax.jit(
    jax.shard_map(fn, mesh=mesh, in_specs=jax.P("i"), out_specs=jax.P("i"))
  )
  sharding = jax.NamedSharding(mesh, jax.P("i"))
  return g.trace(
    jax.ShapeDtypeStruct((N * 4, 128), jnp.float32, sharding=sharding)
  )


def _refs(x):
  return jax.new_ref(x), jax.new_ref(jnp.zeros_like(x))


def test_hazard_write_source():
  def f(x):
    a, b = _refs(x)
    fut = st.ppermute_start(a, b, "i", shift=1)
    a[...] = x + 1  # HAZARD-LINE
    st.ppermute_done(fut, a, b)
    return b[...]

  with pytest.raises(FutureError) as e:
    _trace(f)
  msg = str(e.value)
  assert "writes the source Ref" in msg
  assert re.search(r"test_stateful.py:\d+", msg)
  assert "started at" in msg and "in f" in msg


@pytest.mark.parametrize("op", ["read", "write"])
def test_hazard_destination(op):
  def f(x):
    a, b = _refs(x)
    fut = st.ppermute_start(a, b, "i", shift=1)
    if op == "read":
      y = b[...] * 2
    else:
      b[...] = x
      y = x
    st.ppermute_done(fut, a, b)
    return b[...] + y

  with pytest.raises(FutureError, match=f"{op}s the destination Ref"):
    _trace(f)


def test_reading_source_is_fine():
  def f(x):
    a, b = _refs(x)
    fut = st.ppermute_start(a, b, "i", shift=1)
    y = a[...] * 2
    st.ppermute_done(fut, a, b)
    return b[...] + y

  _trace(f)


def test_hazard_slot_of_double_buffer():
  def f(x):
    buf = jax.new_ref(jnp.stack([x, x]))
    fut = st.ppermute_start(buf.at[0], buf.at[1], "i", shift=1)
    buf[1] = x
    st.ppermute_done(fut, buf.at[0], buf.at[1])
    return buf[1]

  with pytest.raises(FutureError, match="writes the destination Ref"):
    _trace(f)


def test_done_twice():
  def f(x):
    a, b = _refs(x)
    fut = st.ppermute_start(a, b, "i", shift=1)
    st.ppermute_done(fut, a, b)
    st.ppermute_done(fut, a, b)
    return b[...]

  with pytest.raises(FutureError, match="already awaited at .*awaited again"):
    _trace(f)


def test_done_without_start():
  def f(x):
    a, b = _refs(x)
    c, d = _refs(x)
    fut = st.ppermute_start(a, b, "i", shift=1)
    st.ppermute_done(fut, c, d)
    return b[...]

  with pytest.warns(NeverAwaitedWarning):
    with pytest.raises(FutureError, match="done without a start"):
      _trace(f)
    import gc

    gc.collect()


def test_start_never_awaited_warns():
  def f(x):
    a, b = _refs(x)
    st.ppermute_start(a, b, "i", shift=1)
    return b[...]

  with pytest.warns(NeverAwaitedWarning, match="never awaited"):
    _trace(f)
    import gc

    gc.collect()


def test_same_buffer_rejected():
  def f(x):
    a = jax.new_ref(x)
    st.ppermute_start(a, a, "i", shift=1)
    return x

  with pytest.raises(ValueError, match="separate receive buffer"):
    _trace(f)


def test_not_a_ref():
  def f(x):
    st.ppermute_start(x, x, "i", shift=1)
    return x

  with pytest.raises(TypeError, match="must be a jax.Ref"):
    _trace(f)


def test_compute_between_is_tied():
  def f(x):
    a, b = _refs(x)
    fut = st.ppermute_start(a, b, "i", shift=1)
    z = jnp.sin(x)
    st.ppermute_done(fut, a, b)
    return b[...] + z

  jaxpr = str(_trace(f).jaxpr)
  order = [
    m.group(0)
    for m in re.finditer(
      r"asyncops_ref_start|asyncops_tie|sin|asyncops_ref_done", jaxpr
    )
  ]
  assert order == [
    "asyncops_ref_start",
    "asyncops_tie",
    "sin",
    "asyncops_tie",
    "asyncops_ref_done",
  ]


# TPU compiles ----------------------------------------------------------------


def _tpu_hlo(topology, fn, looped):
  import os

  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from jax.experimental import topologies

  devs = topologies.get_topology_desc(topology, platform="tpu").devices
  n = len(devs)
  mesh = jax.sharding.Mesh(np.array(devs).reshape(-1), ("i",))
  f = functools.partial(fn, n=n) if looped else fn
  g = jax.jit(
    jax.shard_map(
      f, mesh=mesh, in_specs=(jax.P("i"), jax.P()), out_specs=jax.P("i")
    )
  )
  S = jax.NamedSharding
  x = jax.ShapeDtypeStruct(
    (n * 256, 512), jnp.float32, sharding=S(mesh, jax.P("i"))
  )
  w = jax.ShapeDtypeStruct((512, 512), jnp.float32, sharding=S(mesh, jax.P()))
  return g.trace(x, w).lower().compile().as_text()


def big_copies(hlo):
  """Copies of f32 buffers (not scalars, not memory-space prefetches)."""
  return [
    line
    for line in hlo.splitlines()
    if re.search(r"= f32\[[^\]]*\]\S* copy\(", line)
  ]


@pytest.mark.parametrize("topology", ["v5e:2x4", "v4:2x2x1", "v6e:2x4"])
@pytest.mark.parametrize("p", PATTERNS, ids=lambda p: p.name)
def test_tpu_ref_patterns(p, topology):
  hlo = _tpu_hlo(topology, p.ref, p.looped)
  assert "asyncops_ppermute_ref_start" in hlo
  assert "asyncops_ppermute_ref_done" in hlo
  assert big_copies(hlo) == []
