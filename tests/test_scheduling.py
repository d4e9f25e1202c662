"""Scheduling helpers: the seed design's patterns, clean on TPU, exact on CPU.

Every pattern is written twice: with ``asyncops`` and the helpers, and as a
``jax.lax.ppermute`` reference. On TPU (ahead-of-time, three topologies)
the harness must report no defensive copy, no copy of an in-flight buffer,
and compute inside every start/done window. On 8 CPU devices the helper
version must equal the reference bit for bit in both emulation modes.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import asyncops
from asyncops import scheduling as sch
from asyncops.inspect import analyze, tpu_mesh
from asyncops.testing import assert_copy_free, assert_overlapped

AXES = ("x", "y")
MESH_SHAPE = (2, 4)
SPEC = P(AXES)
TOPOLOGIES = ("v5e:2x4", "v4:2x2x1", "v6e:2x4")
TPU_SHARD = (1024, 1024)  # f32 per device: 4 MiB, HBM-sized
CPU_SHARD = (16, 128)


def start_y(x, shift=1):
  return asyncops.ppermute_start(x, "y", shift=shift)


def ref_y(x, shift=1):
  n = jax.lax.axis_size("y")
  return jax.lax.ppermute(x, "y", [(i, (i + shift) % n) for i in range(n)])


def ref_x(x, shift=1):
  n = jax.lax.axis_size("x")
  return jax.lax.ppermute(x, "x", [(i, (i + shift) % n) for i in range(n)])


def work(x):
  """Compute worth overlapping (elementwise, so it is exact on CPU)."""
  return jnp.sin(x) * 2.0 + 1.0


# Patterns: (with helpers, jax.lax reference, number of outputs, pairs).
# ``pairs`` is how many kernel start/done pairs the compiled program must
# have, each with compute in its window.


def between(x):
  x, fut = start_y(x)
  z, fut = sch.overlap(fut, work, x)
  return asyncops.ppermute_done(fut), z


def between_ref(x):
  return ref_y(x), work(x)


def arg_used_after_done(x):
  # fn's argument is the future's own source, and is used after the done.
  x, fut = start_y(x)
  z, fut = sch.overlap(fut, work, fut.src)
  y = asyncops.ppermute_done(fut)
  return y + x, z


def arg_used_after_done_ref(x):
  return ref_y(x) + x, work(x)


def two_in_flight(x):
  x1, f1 = start_y(x)
  x2, f2 = asyncops.ppermute_start(x * 3.0, "x", shift=1)
  z, (f1, f2) = sch.overlap((f1, f2), lambda a, b: work(a) * b, x1, x2)
  return asyncops.ppermute_done(f1) + asyncops.ppermute_done(f2), z


def two_in_flight_ref(x):
  return ref_y(x) + ref_x(x * 3.0), work(x) * (x * 3.0)


def ring(n):
  def f(x):
    def body(i, x):
      x, fut = start_y(x)
      z, fut = sch.overlap(fut, work, x)
      return asyncops.ppermute_done(fut) + z

    return sch.fori_loop(0, n, body, x)

  return f


def ring_ref(n):
  def f(x):
    return jax.lax.fori_loop(0, n, lambda i, x: ref_y(x) + work(x), x)

  return f


def staggered_loop(n):
  # The design's staggered loop, with compute overlapping each transfer.
  def f(x):
    x, fut = start_y(x)
    acc, fut = sch.overlap(fut, work, x)

    def body(i, carry):
      fut, acc = carry
      x, fut = start_y(asyncops.ppermute_done(fut))
      acc, fut = sch.overlap(fut, lambda x, a: a + work(x), x, acc)
      return fut, acc

    fut, acc = sch.fori_loop(0, n, body, (fut, acc))
    return asyncops.ppermute_done(fut), acc

  return f


def staggered_loop_ref(n):
  def f(x):
    acc = work(x)

    def body(i, carry):
      x, acc = carry
      x = ref_y(x)
      return x, acc + work(x)

    x, acc = jax.lax.fori_loop(0, n, body, (x, acc))
    return ref_y(x), acc

  return f


def accumulate(n):
  # "Putting it all together": accumulate while permuting, n transfers.
  def f(x):
    y, out = sch.staggered(
      n, start_y, lambda i, x, out: out + x, x, jnp.zeros_like(x)
    )
    return out, y

  return f


def accumulate_ref(n):
  def f(x):
    def body(i, carry):
      out, x = carry
      return out + x, ref_y(x)

    return jax.lax.fori_loop(0, n, body, (jnp.zeros_like(x), x))

  return f


PATTERNS = {
  "between": (between, between_ref, 2, 1),
  "arg_used_after_done": (arg_used_after_done, arg_used_after_done_ref, 2, 1),
  "two_in_flight": (two_in_flight, two_in_flight_ref, 2, 2),
}
for _n in (7, 8):
  PATTERNS[f"ring_{_n}"] = (ring(_n), ring_ref(_n), 1, 2)
  PATTERNS[f"staggered_{_n}"] = (
    staggered_loop(_n),
    staggered_loop_ref(_n),
    2,
    4,
  )
  PATTERNS[f"accumulate_{_n}"] = (accumulate(_n), accumulate_ref(_n), 2, 4)


def _smap(f, mesh, nout):
  out = SPEC if nout == 1 else (SPEC,) * nout
  return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=SPEC, out_specs=out))


def _global(shard):
  return (MESH_SHAPE[0] * MESH_SHAPE[1] * shard[0],) + shard[1:]


@functools.cache
def _report(name, topology):
  f, _, nout, _ = PATTERNS[name]
  mesh = tpu_mesh(topology, MESH_SHAPE, AXES)
  x = jax.ShapeDtypeStruct(
    _global(TPU_SHARD), jnp.float32, sharding=NamedSharding(mesh, SPEC)
  )
  return analyze(_smap(f, mesh, nout), x)


# TPU structure ---------------------------------------------------------------


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("name", list(PATTERNS))
def test_compiles_clean_and_overlapped(name, topology):
  r = assert_copy_free(_report(name, topology))
  pairs = PATTERNS[name][3]
  assert_overlapped(r, min_pairs=pairs, op="asyncops.ppermute_start")
  assert all(p.source_live for p in r.pairs_for("asyncops.ppermute_start"))


def _baseline(f, nout, topology="v5e:2x4"):
  mesh = tpu_mesh(topology, MESH_SHAPE, AXES)
  x = jax.ShapeDtypeStruct(
    _global(TPU_SHARD), jnp.float32, sharding=NamedSharding(mesh, SPEC)
  )
  return analyze(_smap(f, mesh, nout), x)


def test_without_overlap_compute_leaves_the_window():
  # The scheduling problem the helper solves: same program, no barriers.
  def f(x):
    x, fut = start_y(x)
    z = work(x)
    return asyncops.ppermute_done(fut), z

  r = _baseline(f, 2)
  assert not any(p.overlapped for p in r.pairs_for("ppermute_start"))
  assert _report("between", "v5e:2x4").pairs_for("ppermute_start")[0].overlapped


@pytest.mark.parametrize("staggered", [False, True])
def test_lax_fori_loop_copies_where_ours_does_not(staggered):
  # The defensive-copy problem: jax.lax.fori_loop at unroll=1 copies every
  # trip; for a carried future it copies buffers in flight.
  def ring_lax(x):
    def body(i, x):
      x, fut = start_y(x)
      return asyncops.ppermute_done(fut)

    return jax.lax.fori_loop(0, 8, body, x)

  def stag_lax(x):
    x, fut = start_y(x)

    def body(i, fut):
      return start_y(asyncops.ppermute_done(fut))[1]

    return asyncops.ppermute_done(jax.lax.fori_loop(0, 8, body, fut))

  f = stag_lax if staggered else ring_lax
  assert _baseline(f, 1).defensive_copies
  assert bool(_baseline(f, 1).inflight_copies) == staggered
  g = staggered_loop(8) if staggered else ring(8)
  nout = 2 if staggered else 1
  r = _baseline(g, nout)
  assert not r.defensive_copies and not r.inflight_copies


# CPU numerics ----------------------------------------------------------------


@functools.cache
def _cpu_mesh():
  devices = np.array(jax.devices("cpu")[:8]).reshape(MESH_SHAPE)
  return jax.sharding.Mesh(devices, AXES)


def _cpu_input(seed=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal(_global(CPU_SHARD)), jnp.float32)
  return jax.device_put(x, NamedSharding(_cpu_mesh(), SPEC))


def _assert_bitwise(a, b):
  for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


@pytest.mark.parametrize("transfer", ["start", "done"])
@pytest.mark.parametrize("name", list(PATTERNS))
def test_matches_lax_bit_for_bit(name, transfer):
  f, ref, nout, _ = PATTERNS[name]
  mesh = _cpu_mesh()
  x = _cpu_input()
  with asyncops.emulation(transfer):
    got = _smap(f, mesh, nout)(x)
  _assert_bitwise(got, _smap(ref, mesh, nout)(x))


@pytest.mark.parametrize("n", [0, 1, 2, 3])
def test_short_static_loops(n):
  mesh = _cpu_mesh()
  x = _cpu_input(1)
  for f, ref, nout in [
    (ring(n), ring_ref(n), 1),
    (staggered_loop(n), staggered_loop_ref(n), 2),
    (accumulate(n), accumulate_ref(n), 2),
  ]:
    _assert_bitwise(_smap(f, mesh, nout)(x), _smap(ref, mesh, nout)(x))


def _dyn(f, mesh, nout):
  out = SPEC if nout == 1 else (SPEC,) * nout
  return jax.jit(
    jax.shard_map(f, mesh=mesh, in_specs=(SPEC, P()), out_specs=out)
  )


@pytest.mark.parametrize("transfer", ["start", "done"])
def test_dynamic_bounds_values(transfer):
  def lo_hi(x, bounds):
    def body(i, carry):
      x, fut = start_y(carry)
      z, fut = sch.overlap(fut, lambda x: x * i.astype(x.dtype), x)
      return asyncops.ppermute_done(fut) + z

    return sch.fori_loop(bounds[0], bounds[1], body, x)

  def lo_hi_ref(x, bounds):
    def body(i, x):
      return ref_y(x) + x * i.astype(x.dtype)

    return jax.lax.fori_loop(bounds[0], bounds[1], body, x)

  mesh = _cpu_mesh()
  x = _cpu_input(2)
  with asyncops.emulation(transfer):
    with pytest.warns(sch.CopyHazardWarning, match="traced loop bounds"):
      f = (
        _dyn(lo_hi, mesh, 1).trace(x, jnp.zeros(2, jnp.int32)).lower().compile()
      )
    for lo, hi in [(0, 0), (3, 1), (2, 3), (1, 5), (0, 6), (5, 12)]:
      b = jnp.array([lo, hi], jnp.int32)
      _assert_bitwise(f(x, b), _dyn(lo_hi_ref, mesh, 1)(x, b))


def test_dynamic_bounds_with_a_carried_future_are_refused():
  def stag(x, bounds):
    x, fut = start_y(x)

    def body(i, fut):
      return start_y(asyncops.ppermute_done(fut))[1]

    fut = sch.fori_loop(bounds[0], bounds[1], body, fut)
    return asyncops.ppermute_done(fut)

  with pytest.raises(sch.CopyHazardError, match="traced loop bounds"):
    _dyn(stag, _cpu_mesh(), 1).trace(_cpu_input(), jnp.zeros(2, jnp.int32))
  with pytest.raises(ValueError, match="static int"):
    sch.staggered(jnp.int32(3), start_y, lambda i, x, c: c, None)


def test_plain_loops_are_jax_fori_loop():
  body = lambda i, c: c * 2.0 + i  # noqa: E731
  a = sch.fori_loop(0, 5, body, jnp.float32(1.0))
  assert a == jax.lax.fori_loop(0, 5, body, jnp.float32(1.0))
  j1 = jax.make_jaxpr(lambda c: sch.fori_loop(0, 5, body, c))(1.0)
  j2 = jax.make_jaxpr(lambda c: jax.lax.fori_loop(0, 5, body, c))(1.0)
  assert str(j1) == str(j2)


# Errors ----------------------------------------------------------------------


def _trace(f):
  mesh = _cpu_mesh()
  return _smap(f, mesh, 1).trace(_cpu_input())


def test_odd_unroll_is_refused():
  def f(x):
    x, fut = start_y(x)

    def body(i, fut):
      return start_y(asyncops.ppermute_done(fut))[1]

    return asyncops.ppermute_done(sch.fori_loop(0, 4, body, fut, unroll=1))

  with pytest.raises(sch.CopyHazardError, match="unroll=1"):
    _trace(f)


def test_carrying_an_inflight_buffer_twice_is_refused():
  def f(x):
    x, fut = start_y(x)

    def body(i, carry):
      fut, _ = carry
      x, fut = start_y(asyncops.ppermute_done(fut))
      return fut, x  # x is fut.src: one buffer in two carry slots

    fut, _ = sch.fori_loop(0, 4, body, (fut, x))
    return asyncops.ppermute_done(fut)

  with pytest.raises(sch.CopyHazardError, match="carry leaves"):
    _trace(f)


def test_overlap_consumes_the_future_it_was_given():
  def f(x):
    x, fut = start_y(x)
    _, new = sch.overlap(fut, work, x)
    asyncops.ppermute_done(new)
    return asyncops.ppermute_done(fut)

  with pytest.raises(asyncops.FutureError, match="returned a new future"):
    _trace(f)


def test_overlap_needs_a_future():
  def f(x):
    return sch.overlap(x, work, x)[0]

  with pytest.raises(TypeError, match="holds no asyncops.Future"):
    _trace(f)
