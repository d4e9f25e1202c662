"""Scheduling helpers: the seed design's patterns, clean on TPU, exact on CPU.

Every pattern is written twice: with ``asyncops`` and the helpers, and as a
``jax.lax`` reference. On TPU (ahead of time, up to four generations) the
harness must report no defensive copy, no copy of an in-flight buffer, no
hazard for the copy guard, and compute inside every loop window. On 8 CPU
devices the helper version must equal the reference bit for bit in both
emulation modes.
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
from asyncops.inspect import analyze, hazards, tpu_mesh

AXES = ("x", "y")
MESH_SHAPE = (2, 4)
SPEC = P(AXES)
V5E, V4, V6E, V5P = "v5e:2x4", "v4:2x2x1", "v6e:2x4", "v5p:2x2x2"
ALL = (V5E, V4, V6E, V5P)
TPU_SHARD = (1024, 1024)  # f32 per device: 4 MiB, HBM-sized
CPU_SHARD = (16, 128)
KC = 128  # contraction rows per device in the matmul pattern (CPU and TPU)


def start_y(x, shift=1):
  return asyncops.ppermute_start(x, "y", shift=shift)


def start_x(x):
  return asyncops.ppermute_start(x, "x", shift=1)


def ref_y(x, shift=1):
  n = jax.lax.axis_size("y")
  return jax.lax.ppermute(x, "y", [(i, (i + shift) % n) for i in range(n)])


def ref_x(x, shift=1):
  n = jax.lax.axis_size("x")
  return jax.lax.ppermute(x, "x", [(i, (i + shift) % n) for i in range(n)])


def work(x):
  """Compute worth overlapping (elementwise, so it is exact on CPU)."""
  return jnp.sin(x) * 2.0 + 1.0


# Patterns ---------------------------------------------------------------------
#
# Each is ``(helper version, jax.lax reference, outputs, loop pairs,
# topologies)``: the program takes one sharded array (two for the matmul);
# ``loop pairs`` is how many start/done pairs the compiled program has
# inside ``asyncops.fori_loop`` (each must have compute in its window);
# ``topologies`` are the TPU generations its HLO is checked on (the loops the
# issue names on all four).


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
  x2, f2 = start_x(x * 3.0)
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
  # "Putting it all together" through the ``staggered`` helper.
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


def seed_accumulate(n, loop=None):
  # The seed design's "Putting it all together", exactly as a user writes
  # it (issue 10): the future is carried, awaited at the top of the body.
  loop = loop or sch.fori_loop

  def f(x):
    out = jnp.zeros_like(x)
    x, fut = start_y(x)
    out = out + x

    def body(i, carry):
      out, fut = carry
      x = asyncops.ppermute_done(fut)
      x, fut = start_y(x)
      return out + x, fut

    out, fut = loop(0, n, body, (out, fut))
    last = asyncops.ppermute_done(fut)
    return out, last

  return f


def seed_accumulate_ref(n):
  def f(x):
    def body(i, carry):
      out, x = carry
      x = ref_y(x)
      return out + x, x

    out, x = jax.lax.fori_loop(0, n, body, (jnp.zeros_like(x) + x, x))
    return out, ref_y(x)

  return f


def two_rings(n):
  # Two futures carried at once, on two mesh axes.
  def f(x):
    a, fa = start_y(x)
    b, fb = start_x(x * 3.0)
    acc = a + b

    def body(i, carry):
      acc, fa, fb = carry
      a, fa = start_y(asyncops.ppermute_done(fa))
      b, fb = start_x(asyncops.ppermute_done(fb))
      return acc + a * b, fa, fb

    acc, fa, fb = sch.fori_loop(0, n, body, (acc, fa, fb))
    return acc + asyncops.ppermute_done(fa) + asyncops.ppermute_done(fb)

  return f


def two_rings_ref(n):
  def f(x):
    a, b = x, x * 3.0

    def body(i, carry):
      acc, a, b = carry
      a, b = ref_y(a), ref_x(b)
      return acc + a * b, a, b

    acc, a, b = jax.lax.fori_loop(0, n, body, (a + b, a, b))
    return acc + ref_y(a) + ref_x(b)

  return f


def bidirectional(n):
  def f(x):
    x, fut = asyncops.bidirectional_start(x, "y")
    acc = jnp.sin(x)

    def body(i, carry):
      acc, fut = carry
      y = asyncops.bidirectional_done(fut)
      x, fut = asyncops.bidirectional_start(y, "y")
      return acc + jnp.sin(x), fut

    acc, fut = sch.fori_loop(0, n, body, (acc, fut))
    return acc, asyncops.bidirectional_done(fut)

  return f


def _ref_bidirectional(x):
  h = x.shape[0] // 2
  return jnp.concatenate([ref_y(x[:h], 1), ref_y(x[h:], -1)])


def bidirectional_ref(n):
  def f(x):
    def body(i, carry):
      acc, x = carry
      x = _ref_bidirectional(x)
      return acc + jnp.sin(x), x

    acc, x = jax.lax.fori_loop(0, n, body, (jnp.sin(x), x))
    return acc, _ref_bidirectional(x)

  return f


def ppermute_and_copy(n):
  # A ring permute and a local copy in flight together across iterations.
  def f(x):
    a, fa = start_y(x)
    b, fb = asyncops.copy_start(x * 2.0)
    acc = a + b

    def body(i, carry):
      acc, fa, fb = carry
      a, fa = start_y(asyncops.ppermute_done(fa))
      b, fb = asyncops.copy_start(asyncops.copy_done(fb) + 1.0)
      return acc + a + b, fa, fb

    acc, fa, fb = sch.fori_loop(0, n, body, (acc, fa, fb))
    return acc + asyncops.ppermute_done(fa) + asyncops.copy_done(fb)

  return f


def ppermute_and_copy_ref(n):
  def f(x):
    def body(i, carry):
      acc, a, b = carry
      a, b = ref_y(a), b + 1.0
      return acc + a + b, a, b

    b = x * 2.0
    acc, a, b = jax.lax.fori_loop(0, n, body, (x + b, x, b))
    return acc + ref_y(a) + b

  return f


def _rows(w, j):
  return jax.lax.dynamic_slice_in_dim(w, j * KC, KC, 0)


def matmul_acc(n):
  # A collective matmul as a user writes it: done, start, acc + x @ w_rows.
  # The contraction dimension is sharded; chunk j of x multiplies rows j of
  # the replicated w, and the chunks travel around the ring.
  def f(x, w):
    me = jax.lax.axis_index("y")
    size = jax.lax.axis_size("y")
    x, fut = start_y(x)
    acc = x @ _rows(w, me)

    def body(i, carry):
      acc, fut = carry
      x = asyncops.ppermute_done(fut)
      x, fut = start_y(x)
      return acc + x @ _rows(w, (me - i - 1) % size), fut

    acc, fut = sch.fori_loop(0, n, body, (acc, fut))
    x = asyncops.ppermute_done(fut)
    return acc + x @ _rows(w, (me - n - 1) % size)

  return f


def matmul_acc_ref(n):
  def f(x, w):
    me = jax.lax.axis_index("y")
    size = jax.lax.axis_size("y")

    def body(i, carry):
      acc, x = carry
      x = ref_y(x)
      return acc + x @ _rows(w, (me - i - 1) % size), x

    acc, x = jax.lax.fori_loop(0, n, body, (x @ _rows(w, me), x))
    x = ref_y(x)
    return acc + x @ _rows(w, (me - n - 1) % size)

  return f


def all_gather_body(n):
  def f(x):
    def body(i, x):
      x, fut = asyncops.all_gather_start(x, "y")
      z, fut = sch.overlap(fut, work, x)
      return asyncops.all_gather_done(fut).sum(0) * 0.25 + z

    return sch.fori_loop(0, n, body, x)

  return f


def all_gather_body_ref(n):
  def f(x):
    def body(i, x):
      return jax.lax.all_gather(x, "y").sum(0) * 0.25 + work(x)

    return jax.lax.fori_loop(0, n, body, x)

  return f


PATTERNS = {
  "between": (between, between_ref, 2, 0, (V5E, V5P)),
  "arg_used_after_done": (
    arg_used_after_done,
    arg_used_after_done_ref,
    2,
    0,
    (V4, V6E),
  ),
  "two_in_flight": (two_in_flight, two_in_flight_ref, 2, 0, (V5E, V5P)),
  "ring_7": (ring(7), ring_ref(7), 1, 3, (V5E, V5P)),
  "ring_8": (ring(8), ring_ref(8), 1, 2, (V4, V6E)),
  "staggered_7": (staggered_loop(7), staggered_loop_ref(7), 2, 3, (V4, V6E)),
  "staggered_8": (staggered_loop(8), staggered_loop_ref(8), 2, 2, (V5E, V5P)),
  "accumulate_7": (accumulate(7), accumulate_ref(7), 2, 2, (V5E, V6E)),
  "accumulate_8": (accumulate(8), accumulate_ref(8), 2, 3, (V4, V5P)),
  "seed_accumulate_5": (
    seed_accumulate(5),
    seed_accumulate_ref(5),
    2,
    3,
    (V4, V5P),
  ),
  "seed_accumulate_6": (
    seed_accumulate(6),
    seed_accumulate_ref(6),
    2,
    2,
    ALL,
  ),
  "two_rings_6": (two_rings(6), two_rings_ref(6), 1, 4, ALL),
  "bidirectional_6": (bidirectional(6), bidirectional_ref(6), 2, 2, (V5E,)),
  "ppermute_and_copy_5": (
    ppermute_and_copy(5),
    ppermute_and_copy_ref(5),
    1,
    6,
    (V6E, V5P),
  ),
  "matmul_acc_6": (matmul_acc(6), matmul_acc_ref(6), 1, 2, ALL),
  "all_gather_body_3": (
    all_gather_body(3),
    all_gather_body_ref(3),
    1,
    3,
    (V4, V5E),
  ),
}

TWO_ARGS = {"matmul_acc_6"}


def _smap(f, mesh, nout, nargs=1):
  out = SPEC if nout == 1 else (SPEC,) * nout
  ins = (SPEC, P()) if nargs == 2 else SPEC
  return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=ins, out_specs=out))


def _global(shard):
  return (MESH_SHAPE[0] * MESH_SHAPE[1] * shard[0],) + shard[1:]


def _tpu_args(name, mesh):
  shard = (TPU_SHARD[0], KC) if name in TWO_ARGS else TPU_SHARD
  x = jax.ShapeDtypeStruct(
    _global(shard), jnp.float32, sharding=NamedSharding(mesh, SPEC)
  )
  if name not in TWO_ARGS:
    return (x,)
  w = jax.ShapeDtypeStruct(
    (MESH_SHAPE[1] * KC, 512), jnp.float32, sharding=NamedSharding(mesh, P())
  )
  return x, w


@functools.cache
def _report(name, topology):
  f, _, nout, _, _ = PATTERNS[name]
  mesh = tpu_mesh(topology, MESH_SHAPE, AXES)
  args = _tpu_args(name, mesh)
  return analyze(_smap(f, mesh, nout, len(args)), *args)


def _assert_clean(r, loop_pairs=0):
  r.assert_no_defensive_copies()
  r.assert_no_inflight_copies()
  assert hazards(r) == []
  assert all(p.source_live and p.dest_live for p in r.kernel_pairs)
  if loop_pairs:
    r.assert_overlapped(min_pairs=loop_pairs, op="asyncops.fori_loop")
  else:
    r.assert_overlapped(min_pairs=1)


# TPU structure ---------------------------------------------------------------


@pytest.mark.parametrize(
  "name,topology",
  [(n, t) for n, p in PATTERNS.items() for t in p[4]],
)
def test_compiles_clean_and_overlapped(name, topology):
  _assert_clean(_report(name, topology), PATTERNS[name][3])


def test_no_transfer_crosses_the_back_edge():
  # The loop carries plain arrays: every pair starts and ends in one
  # computation, and the while loop's carry has no semaphore.
  r = _report("seed_accumulate_6", V5E)
  assert r.kernel_pairs and not any(p.crossing for p in r.kernel_pairs)
  (loop,) = [i for i in r.module.instructions.values() if i.opcode == "while"]
  assert not any(lf.memory_space == 2 for lf in loop.leaves)


def test_v5p_copies_only_at_the_program_edge():
  # v5p keeps a communicating kernel's buffers in HBM, so the parameter
  # sent first and the received buffer returned are copied HBM->HBM; the
  # harness labels them ``boundary`` (they touch no buffer in flight).
  r = _report("seed_accumulate_6", V5P)
  edges = [c for c in r.copies if c.kind == "boundary"]
  assert edges and all(c.spaces == ("HBM", "HBM") for c in edges)
  assert all(c.computation == r.module.entry.name for c in edges)
  assert all(c.pair and not c.inflight for c in edges)


def _baseline(f, nout, topology=V5E):
  mesh = tpu_mesh(topology, MESH_SHAPE, AXES)
  return analyze(_smap(f, mesh, nout), *_tpu_args("", mesh))


def test_without_overlap_compute_leaves_the_window():
  # The scheduling problem the helper solves: same program, no barriers.
  def f(x):
    x, fut = start_y(x)
    z = work(x)
    return asyncops.ppermute_done(fut), z

  r = _baseline(f, 2)
  assert not any(p.overlapped for p in r.pairs_for("ppermute_start"))
  assert _report("between", V5E).pairs_for("ppermute_start")[0].overlapped


def test_lax_fori_loop_copies_in_flight_buffers_where_ours_does_not():
  # The loop with jax.lax.fori_loop, even at unroll=2: XLA copies
  # the destination of the carried start (in the body) and the prologue's
  # source (in the entry computation), both while in flight.
  lax2 = functools.partial(jax.lax.fori_loop, unroll=2)
  r = _baseline(seed_accumulate(6, loop=lax2), 2)
  roles = sorted(c.inflight.split(" ")[0] for c in r.inflight_copies)
  assert roles == ["destination", "source"]
  assert {h.kind for h in hazards(r)} >= {"in-flight copy"}
  _assert_clean(_report("seed_accumulate_6", V5E), 2)


def test_lax_ring_copies_every_trip():
  def ring_lax(x):
    def body(i, x):
      x, fut = start_y(x)
      return asyncops.ppermute_done(fut)

    return jax.lax.fori_loop(0, 8, body, x)

  r = _baseline(ring_lax, 1)
  assert r.defensive_copies and not r.inflight_copies


@pytest.mark.parametrize("topology", [V5E, V6E])
@pytest.mark.parametrize("n", [0, 1, 2])  # 5 and 6 above; 0-9 on CPU
def test_static_trip_counts_compile_clean(n, topology):
  r = _baseline(seed_accumulate(n), 2, topology)
  r.assert_no_defensive_copies()
  assert hazards(r) == []
  # The prologue's pair, one per peeled iteration, two in the loop body.
  assert len(r.kernel_pairs) == 1 + n % 2 + (2 if n >= 2 else 0)
  assert not any(p.crossing for p in r.kernel_pairs)


@pytest.mark.parametrize("topology", [V5E, V5P])
def test_traced_bounds_copy_no_buffer_in_flight(topology):
  # Traced bounds: every future is awaited before the odd iteration's
  # lax.cond, so whatever XLA copies through it is not in flight, and the
  # loop body itself stays copy-free.
  mesh = tpu_mesh(topology, MESH_SHAPE, AXES)
  (x,) = _tpu_args("", mesh)
  b = jax.ShapeDtypeStruct((2,), jnp.int32, sharding=NamedSharding(mesh, P()))
  with pytest.warns(sch.CopyHazardWarning, match="traced loop bounds"):
    r = analyze(_dyn(seed_accumulate_dyn, mesh, 2), x, b)
  r.assert_no_inflight_copies()
  assert {h.kind for h in hazards(r)} <= {"defensive copy"}
  assert all(p.source_live and p.dest_live for p in r.kernel_pairs)
  bodies = {i.body for i in r.module.instructions.values() if i.body}
  assert not [c for c in r.defensive_copies if c.computation in bodies]
  r.assert_overlapped(min_pairs=3, op="asyncops.fori_loop")


# CPU numerics ----------------------------------------------------------------


@functools.cache
def _cpu_mesh():
  devices = np.array(jax.devices("cpu")[:8]).reshape(MESH_SHAPE)
  return jax.sharding.Mesh(devices, AXES)


def _cpu_input(seed=0, shard=CPU_SHARD):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal(_global(shard)), jnp.float32)
  return jax.device_put(x, NamedSharding(_cpu_mesh(), SPEC))


def _cpu_args(name, seed=0):
  if name not in TWO_ARGS:
    return (_cpu_input(seed),)
  rng = np.random.default_rng(seed + 100)
  w = jnp.asarray(rng.standard_normal((MESH_SHAPE[1] * KC, 64)), jnp.float32)
  return _cpu_input(seed, (CPU_SHARD[0], KC)), w


def _assert_bitwise(a, b):
  for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


@pytest.mark.parametrize("transfer", ["start", "done"])
@pytest.mark.parametrize("name", list(PATTERNS))
def test_matches_lax_bit_for_bit(name, transfer):
  f, ref, nout, _, _ = PATTERNS[name]
  mesh = _cpu_mesh()
  args = _cpu_args(name)
  with asyncops.emulation(transfer):
    got = _smap(f, mesh, nout, len(args))(*args)
  _assert_bitwise(got, _smap(ref, mesh, nout, len(args))(*args))


@pytest.mark.parametrize("n", range(10))
def test_static_trip_counts_0_to_9(n):
  mesh = _cpu_mesh()
  x = _cpu_input(1)

  def both(*fs):
    return lambda x: tuple(jax.tree.leaves([f(x) for f in fs]))

  got = both(ring(n), staggered_loop(n), seed_accumulate(n), two_rings(n))
  ref = both(
    ring_ref(n), staggered_loop_ref(n), seed_accumulate_ref(n), two_rings_ref(n)
  )
  _assert_bitwise(_smap(got, mesh, 6)(x), _smap(ref, mesh, 6)(x))


def seed_accumulate_dyn(x, bounds):
  out = jnp.zeros_like(x)
  x, fut = start_y(x)
  out = out + x

  def body(i, carry):
    out, fut = carry
    x = asyncops.ppermute_done(fut)
    x, fut = start_y(x)
    return out + x * i.astype(x.dtype), fut

  out, fut = sch.fori_loop(bounds[0], bounds[1], body, (out, fut))
  return out, asyncops.ppermute_done(fut)


def seed_accumulate_dyn_ref(x, bounds):
  def body(i, carry):
    out, x = carry
    x = ref_y(x)
    return out + x * i.astype(x.dtype), x

  init = (jnp.zeros_like(x) + x, x)
  out, x = jax.lax.fori_loop(bounds[0], bounds[1], body, init)
  return out, ref_y(x)


def _dyn(f, mesh, nout):
  out = SPEC if nout == 1 else (SPEC,) * nout
  return jax.jit(
    jax.shard_map(f, mesh=mesh, in_specs=(SPEC, P()), out_specs=out)
  )


@pytest.mark.parametrize("transfer", ["start", "done"])
def test_traced_bounds_match_lax(transfer):
  mesh = _cpu_mesh()
  x = _cpu_input(2)
  with asyncops.emulation(transfer), pytest.warns(sch.CopyHazardWarning):
    f = (
      _dyn(seed_accumulate_dyn, mesh, 2)
      .trace(x, jnp.zeros(2, jnp.int32))
      .lower()
      .compile()
    )
  ref = _dyn(seed_accumulate_dyn_ref, mesh, 2)
  for lo, hi in [(0, 0), (3, 1), (2, 3), (1, 5), (0, 6), (5, 12)]:
    b = jnp.array([lo, hi], jnp.int32)
    _assert_bitwise(f(x, b), ref(x, b))


def test_plain_loops_are_jax_fori_loop():
  body = lambda i, c: c * 2.0 + i  # noqa: E731
  a = sch.fori_loop(0, 5, body, jnp.float32(1.0))
  assert a == jax.lax.fori_loop(0, 5, body, jnp.float32(1.0))
  j1 = jax.make_jaxpr(lambda c: sch.fori_loop(0, 5, body, c))(1.0)
  j2 = jax.make_jaxpr(lambda c: jax.lax.fori_loop(0, 5, body, c))(1.0)
  assert str(j1) == str(j2)


def test_loop_returns_resolved_futures_every_done_accepts():
  # The futures a loop returns were awaited at the end of their iteration:
  # ppermute_done, done, and send_done + recv_done all return the value.
  mesh = _cpu_mesh()
  x = _cpu_input(3)

  def f(x, how):
    x, fut = start_y(x)

    def body(i, fut):
      return start_y(asyncops.ppermute_done(fut))[1]

    fut = sch.fori_loop(0, 4, body, fut)
    assert fut.state == "ready"
    if how == "split":
      src, fut = asyncops.send_done(fut)
      return asyncops.recv_done(fut) + 0.0 * src
    return {"ppermute": asyncops.ppermute_done, "any": asyncops.done}[how](fut)

  def ref(x):
    for _ in range(5):
      x = ref_y(x)
    return x

  for how in ("ppermute", "any", "split"):
    got = _smap(functools.partial(f, how=how), mesh, 1)(x)
    _assert_bitwise(got, _smap(ref, mesh, 1)(x))


def test_body_with_send_done_and_recv_done():
  # send_done releases the source early; the carried future is "sent".
  mesh = _cpu_mesh()
  x = _cpu_input(4)

  def f(x):
    x, fut = start_y(x)
    src, fut = asyncops.send_done(fut)

    def body(i, carry):
      acc, fut = carry
      y = asyncops.recv_done(fut)
      y, fut = start_y(y)
      src, fut = asyncops.send_done(fut)
      return acc + src, fut

    acc, fut = sch.fori_loop(0, 4, body, (src, fut))
    return acc + asyncops.recv_done(fut)

  def ref(x):
    acc = x
    for _ in range(4):
      x = ref_y(x)
      acc = acc + x
    return acc + ref_y(x)

  _assert_bitwise(_smap(f, mesh, 1)(x), _smap(ref, mesh, 1)(x))


# Errors ----------------------------------------------------------------------


def _trace(f):
  mesh = _cpu_mesh()
  return _smap(f, mesh, 1).trace(_cpu_input())


_ABANDONED = "ignore::asyncops.NeverAwaitedWarning"  # the refused loop's future


def _stag(unroll):
  def f(x):
    x, fut = start_y(x)

    def body(i, fut):
      return start_y(asyncops.ppermute_done(fut))[1]

    return asyncops.ppermute_done(sch.fori_loop(0, 4, body, fut, unroll=unroll))

  return f


@pytest.mark.filterwarnings(_ABANDONED)
def test_odd_unroll_is_refused():
  with pytest.raises(sch.CopyHazardError, match="unroll=1"):
    _trace(_stag(1))


@pytest.mark.filterwarnings(_ABANDONED)
@pytest.mark.parametrize("unroll", [0, -2])
def test_unroll_must_be_positive(unroll):
  with pytest.raises(ValueError, match=f"unroll={unroll}.*positive"):
    _trace(_stag(unroll))


@pytest.mark.filterwarnings(_ABANDONED)
def test_unroll_must_be_an_int():
  with pytest.raises(TypeError, match="unroll must be"):
    _trace(_stag(2.5))


def carry_source_twice(x):
  # The body returns the in-flight x next to its future: with every future
  # awaited at the end of its iteration, both slots hold plain arrays.
  x, fut = start_y(x)

  def body(i, carry):
    fut, _ = carry
    x, fut = start_y(asyncops.ppermute_done(fut))
    return fut, x

  fut, x = sch.fori_loop(0, 4, body, (fut, x))
  return asyncops.ppermute_done(fut) + x


def test_carrying_the_source_next_to_its_future():
  r = _baseline(carry_source_twice, 1, V5P)
  r.assert_no_defensive_copies()
  assert hazards(r) == []

  def ref(x):
    for _ in range(4):
      x = ref_y(x)
    return ref_y(x) + x

  mesh, x = _cpu_mesh(), _cpu_input(5)
  _assert_bitwise(_smap(carry_source_twice, mesh, 1)(x), _smap(ref, mesh, 1)(x))


def test_staggered_needs_a_static_count():
  with pytest.raises(ValueError, match="static int"):
    sch.staggered(jnp.int32(3), start_y, lambda i, x, c: c, None)


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
