"""Stateful API: numerics on 8 CPU devices, hazards, compiled TPU HLO.

Every pattern of :mod:`asyncops.compare._patterns` (the seed design's
"Revenge of the State" section, the scheduling layer's patterns, all-gather
and copy) is written with the value API and the Ref API. On CPU both must
give the same numbers bit for bit, in both emulation modes, and match
``jax.lax``. On TPU (ahead of time, three topologies) the harness must see
no defensive copy, no copy of an in-flight buffer, and compute inside every
Ref start/done window of a pattern that has compute.
"""

import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import asyncops
from asyncops import _jax_compat as jc
from asyncops import stateful as st
from asyncops.compare._patterns import BY_NAME, PATTERNS
from asyncops.futures._future import FutureError, NeverAwaitedWarning
from asyncops.inspect import analyze, tpu_mesh
from asyncops.testing import assert_copy_free, assert_overlapped, cpu_mesh
from tests import util as u

AXES = ("x", "y")
SPEC = P(AXES)
TOPOLOGIES = ("v5e:2x4", "v4:2x2x1", "v6e:2x4")
TPU_SHARD = (1024, 1024)  # f32 per device: 4 MiB, kept in HBM
CPU_SHARD = (16, 128)


@pytest.fixture(autouse=True)
def _quiet_gc_warnings():
  # Futures of traces a test aborts on purpose warn when collected.
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", NeverAwaitedWarning)
    yield


def _cpu_mesh():
  return cpu_mesh((2, 4), AXES)


def _run(fn, n_out, x, w, transfer):
  mesh = _cpu_mesh()
  g = jax.jit(
    jax.shard_map(
      fn, mesh=mesh, in_specs=(SPEC, P()), out_specs=(SPEC,) * n_out
    )
  )
  x = jax.device_put(x, NamedSharding(mesh, SPEC))
  w = jax.device_put(w, NamedSharding(mesh, P()))
  with asyncops.emulation(transfer):
    return [np.asarray(o) for o in g(x, w)]


def _inputs(seed, dtype=jnp.float32):
  kx, kw = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(kx, (8 * CPU_SHARD[0], CPU_SHARD[1]), dtype)
  w = jax.random.normal(kw, (CPU_SHARD[1],) * 2, dtype) / 10
  return x, w


# Numerics --------------------------------------------------------------------


@pytest.mark.parametrize("p", PATTERNS, ids=lambda p: p.name)
def test_ref_equals_value_and_lax(p):
  x, w = _inputs(len(p.name))
  want = _run(p.lax, p.n_out, x, w, "start")
  for transfer in ("start", "done"):
    val = _run(p.value, p.n_out, x, w, transfer)
    ref = _run(p.ref, p.n_out, x, w, transfer)
    for r, v, lx in zip(ref, val, want, strict=True):
      np.testing.assert_array_equal(r, v)  # same numbers as the value API
      np.testing.assert_allclose(r, lx, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32])
@pytest.mark.parametrize(
  "perm", [[(0, 3), (3, 1)], [(i, 3 - i) for i in range(4)]]
)
def test_partial_perm_keeps_destination(dtype, perm):
  # Ref API: untouched destination; value API: zeros (as jax.lax).
  def f(x, w):
    del w
    x_ref, y_ref = jax.new_ref(x), jax.new_ref(-jnp.ones_like(x))
    fut = st.ppermute_start(x_ref, y_ref, "y", perm=perm)
    st.ppermute_done(fut, x_ref, y_ref)
    _, g = asyncops.ppermute_start(x, "y", perm=perm)
    return y_ref[...], asyncops.ppermute_done(g)

  x = jnp.arange(8 * 16, dtype=jnp.float32).reshape(8 * 2, 8).astype(dtype)
  xs = np.asarray(x).reshape(2, 4, 2, 8)
  want_ref = -np.ones_like(xs)
  want_val = np.zeros_like(xs)
  for s, d in perm:
    want_ref[:, d] = want_val[:, d] = xs[:, s]
  for transfer in ("start", "done"):
    got_ref, got_val = _run(f, 2, x, jnp.zeros((1, 1)), transfer)
    np.testing.assert_array_equal(got_ref.reshape(xs.shape), want_ref)
    np.testing.assert_array_equal(got_val.reshape(xs.shape), want_val)


def test_run_state():
  # pl.run_state scopes the Refs; the ops work inside it unchanged.
  def f(x, w):
    del w

    def body(refs):
      x_ref, y_ref = refs
      fut = st.ppermute_start(x_ref, y_ref, "y", shift=1)
      z = jnp.sin(x)
      st.ppermute_done(fut, x_ref, y_ref)
      y_ref[...] += z

    _, y = pl.run_state(body)((x, jnp.zeros_like(x)))
    return (y,)

  def want(x, w):
    del w
    return (
      jax.lax.ppermute(x, "y", [(i, (i + 1) % 4) for i in range(4)])
      + jnp.sin(x),
    )

  x, w = _inputs(3)
  (expected,) = _run(want, 1, x, w, "start")
  for transfer in ("start", "done"):
    (got,) = _run(f, 1, x, w, transfer)
    np.testing.assert_array_equal(got, expected)


def test_run_state_start_never_awaited():
  def f(x, w):
    del w

    def body(refs):
      st.ppermute_start(*refs, "y", shift=1)

    return (pl.run_state(body)((x, jnp.zeros_like(x)))[1],)

  with pytest.raises(FutureError, match="never awaited"):
    _run(f, 1, *_inputs(0), "start")


# Hazards ---------------------------------------------------------------------


def _lower(fn):
  """Traces and lowers ``fn(x)`` on the CPU mesh (discharge included)."""
  mesh = _cpu_mesh()
  g = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=SPEC, out_specs=SPEC))
  x = jax.ShapeDtypeStruct(
    (8 * 4, 128), jnp.float32, sharding=NamedSharding(mesh, SPEC)
  )
  return g.trace(x).lower()


def _refs(x):
  return jax.new_ref(x), jax.new_ref(jnp.zeros_like(x))


def test_hazard_seed_write_source():
  # The seed's example, x_ref[...] += 1 between start and done, races with
  # the DMA reading x_ref: rejected, naming both lines.
  def f(x):
    x_ref, y_ref = _refs(x)
    fut = st.ppermute_start(x_ref, y_ref, "y", shift=1)
    x_ref[...] += 1
    st.ppermute_done(fut, x_ref, y_ref)
    return y_ref[...]

  with pytest.raises(FutureError) as e:
    _lower(f)
  msg = str(e.value)
  assert "writes the source Ref" in msg
  assert len(re.findall(r"test_stateful.py:\d+", msg)) >= 2
  assert "started at" in msg and "in f" in msg


@pytest.mark.parametrize("op", ["read", "write"])
def test_hazard_destination(op):
  def f(x):
    a, b = _refs(x)
    fut = st.ppermute_start(a, b, "y", shift=1)
    if op == "read":
      y = b[...] * 2
    else:
      b[...] = x
      y = x
    st.ppermute_done(fut, a, b)
    return b[...] + y

  with pytest.raises(FutureError, match=f"{op}s the destination Ref"):
    _lower(f)


def test_reading_source_is_fine():
  def f(x):
    a, b = _refs(x)
    fut = st.ppermute_start(a, b, "y", shift=1)
    y = a[...] * 2
    st.ppermute_done(fut, a, b)
    return b[...] + y

  _lower(f)


def test_hazard_double_buffer_receive_slot():
  def f(x):
    buf = st.double_buffer(x)
    i = jnp.int32(0)
    fut = st.ppermute_start(buf.send_slot(i), buf.recv_slot(i), "y", shift=1)
    buf.recv_slot(i)[...] = x
    st.ppermute_done(fut, buf.send_slot(i), buf.recv_slot(i))
    return buf.read(1)

  with pytest.raises(FutureError, match="writes the destination Ref"):
    _lower(f)


def test_done_twice():
  def f(x):
    a, b = _refs(x)
    fut = st.ppermute_start(a, b, "y", shift=1)
    st.ppermute_done(fut, a, b)
    st.ppermute_done(fut, a, b)
    return b[...]

  with pytest.raises(FutureError, match="already awaited at .*awaited again"):
    _lower(f)


def test_done_without_start():
  def f(x):
    a, b = _refs(x)
    c, d = _refs(x)
    fut = st.ppermute_start(a, b, "y", shift=1)
    st.ppermute_done(fut, c, d)
    return b[...]

  with pytest.raises(FutureError, match="done without a start"):
    _lower(f)


def test_done_of_other_kind():
  def f(x):
    a, b = _refs(x)
    fut = st.copy_start(a, b)
    st.ppermute_done(fut, a, b)
    return b[...]

  with pytest.raises(FutureError, match="await it with copy_done"):
    _lower(f)


def test_start_never_awaited_raises():
  def f(x):
    a, b = _refs(x)
    st.ppermute_start(a, b, "y", shift=1)
    return b[...]

  with pytest.raises(FutureError, match="never awaited") as e:
    _lower(f)
  assert re.search(r"started at .*test_stateful.py:\d+ in f", str(e.value))


def test_start_never_awaited_raises_at_trace_time():
  # Tracing alone (no lowering, no discharge) already finds it.
  def f(x):
    a, b = _refs(x)
    st.ppermute_start(a, b, "y", shift=1)
    return b[...]

  mesh = _cpu_mesh()
  g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=SPEC, out_specs=SPEC))
  x = jax.ShapeDtypeStruct(
    (32, 128), jnp.float32, sharding=NamedSharding(mesh, SPEC)
  )
  with pytest.raises(FutureError, match=r"test_stateful.py:\d+.*never"):
    g.trace(x)


def test_carried_future_is_not_never_awaited():
  # A future passed out as a loop carry is awaited elsewhere: no error.
  p = BY_NAME["staggered_7"]
  mesh = _cpu_mesh()
  g = jax.jit(
    jax.shard_map(
      p.ref, mesh=mesh, in_specs=(SPEC, P()), out_specs=(SPEC, SPEC)
    )
  )
  x = jax.ShapeDtypeStruct(
    (32, 128), jnp.float32, sharding=NamedSharding(mesh, SPEC)
  )
  w = jax.ShapeDtypeStruct((128, 128), jnp.float32)
  g.trace(x, w).lower()


def test_same_buffer_rejected():
  def f(x):
    a = jax.new_ref(x)
    fut = st.ppermute_start(a, a, "y", shift=1)
    st.ppermute_done(fut, a, a)
    return x

  with pytest.raises(ValueError, match="separate receive buffer"):
    _lower(f)


def test_not_a_ref():
  def f(x):
    st.ppermute_start(x, x, "y", shift=1)
    return x

  with pytest.raises(TypeError, match="must be a jax.Ref"):
    _lower(f)


def test_double_buffer_needs_two_slots():
  def f(x):
    st.double_buffer(jax.new_ref(jnp.stack([x, x, x])))
    return x

  with pytest.raises(ValueError, match="leading dimension of 2"):
    _lower(f)


def test_compute_between_is_tied():
  def f(x):
    a, b = _refs(x)
    fut = st.ppermute_start(a, b, "y", shift=1)
    z = jnp.sin(x)
    st.ppermute_done(fut, a, b)
    return b[...] + z

  mesh = _cpu_mesh()
  g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=SPEC, out_specs=SPEC))
  jaxpr = str(
    g.trace(
      jax.ShapeDtypeStruct(
        (32, 128), jnp.float32, sharding=NamedSharding(mesh, SPEC)
      )
    ).jaxpr
  )
  order = re.findall(
    r"asyncops_ref_start|asyncops_tie|sin|asyncops_ref_done|add", jaxpr
  )
  # The add after the done reads the second barrier's output, not sin's.
  assert order == [
    "asyncops_ref_start",
    "asyncops_tie",
    "sin",
    "asyncops_tie",
    "asyncops_ref_done",
    "add",
  ]


# TPU: compiled HLO -----------------------------------------------------------


@functools.cache
def _report(name, side, topology):
  p = BY_NAME[name]
  mesh = tpu_mesh(topology, (2, 4), AXES)
  g = jax.jit(
    jax.shard_map(
      getattr(p, side),
      mesh=mesh,
      in_specs=(SPEC, P()),
      out_specs=(SPEC,) * p.n_out,
    )
  )
  x = jax.ShapeDtypeStruct(
    (8 * TPU_SHARD[0], TPU_SHARD[1]),
    jnp.float32,
    sharding=NamedSharding(mesh, SPEC),
  )
  w = jax.ShapeDtypeStruct(
    (TPU_SHARD[1],) * 2, jnp.float32, sharding=NamedSharding(mesh, P())
  )
  return analyze(g, x, w)


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("p", PATTERNS, ids=lambda p: p.name)
def test_tpu_ref_clean_and_overlapped(p, topology):
  r = assert_copy_free(_report(p.name, "ref", topology))
  op = f"asyncops_{p.op}_ref_start"
  assert r.pairs_for(op), "the Ref kernels were removed"
  assert all(pair.source_live for pair in r.pairs_for(op))
  if p.overlapped:
    assert_overlapped(r, min_pairs=p.overlapped, op=op)


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_tpu_matmul_scheduled_inside_window(topology):
  # The seed's measured problem: a matmul written between a naive stateful
  # start and done ran before the start. Here it is in the window.
  r = _report("matmul", "ref", topology)
  r.assert_overlapped(min_pairs=1, op="asyncops_ppermute_ref_start")
  (pair,) = r.pairs_for("asyncops_ppermute_ref_start")
  ops = [f"{i.opcode} {i.op_name}" for i in pair.between]
  assert any(re.search(r"convolution|dot_general", o) for o in ops), ops


# A future a lax.cond branch closes over ---------------------------------------


def _captured(case):
  """A Ref future captured (closed over) by ``lax.cond`` branches."""

  def f(x, w):
    a, b = jax.new_ref(x * 2.0), jax.new_ref(jnp.zeros_like(x))
    fut = st.ppermute_start(a, b, "y", shift=1)
    y = x @ w  # compute between the start and the cond
    p = jax.lax.axis_index("y") % 2 == 0

    def wait(scale):
      def run():
        st.ppermute_done(fut, a, b)
        a[...] = a[...] * scale  # after the done: no hazard

      return run

    if case == "every branch":
      jax.lax.cond(p, wait(3.0), wait(5.0))
    elif case == "one branch":
      jax.lax.cond(p, wait(3.0), lambda: None)
    elif case == "and after":
      jax.lax.cond(p, wait(3.0), wait(5.0))
      st.ppermute_done(fut, a, b)
    elif case == "twice in a branch":
      jax.lax.cond(p, wait(3.0), lambda: (wait(5.0)(), wait(5.0)())[0])
    elif case == "source written in a branch":
      jax.lax.cond(
        p, wait(3.0), lambda: (a.__setitem__(..., y), wait(5.0)())[1]
      )
    elif case == "loop body":
      jax.lax.fori_loop(0, 2, lambda i, c: (wait(3.0)(), c)[1], 0)
    elif case == "two jits":
      jax.jit(wait(3.0))()
      jax.jit(wait(5.0))()
    return (b[...] + a[...] + y,)

  return f


def test_done_in_every_branch_on_a_captured_future():
  # Crashed in tie_between before (IndexError, or ValueError with compute
  # reading outer values in the window): the done, traced in the
  # branch, looked for the start among the branch's equations.
  def lax(x, w):
    b = jax.lax.ppermute(x * 2.0, "y", [(i, (i + 1) % 4) for i in range(4)])
    even = jax.lax.axis_index("y") % 2 == 0
    return (b + x * 2.0 * jnp.where(even, 3.0, 5.0) + x @ w,)

  x, w = _inputs(7)
  (want,) = _run(lax, 1, x, w, "start")
  for transfer in ("start", "done"):
    (got,) = _run(_captured("every branch"), 1, x, w, transfer)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
  "case", ["nested", "switch", "reads the source", "result in a branch"]
)
def test_captured_future_tied_in_the_start_frame_keeps_the_numbers(case):
  # The done in a branch ties the start's frame (jc.tie_window): the
  # window's compute goes through barriers there, and its result may be
  # read in a branch before or after the done.
  def ref(x, w):
    src = x if case == "reads the source" else x * 2.0
    a, b = jax.new_ref(src), jax.new_ref(jnp.zeros_like(x))
    fut = st.ppermute_start(a, b, "y", shift=1)
    y = (x if case == "reads the source" else jnp.tanh(x)) @ w
    i = jax.lax.axis_index("y")
    done = lambda: st.ppermute_done(fut, a, b)  # noqa: E731

    def add_y():
      done()
      b[...] = b[...] + y

    if case == "nested":
      jax.lax.cond(i == 0, lambda: jax.lax.cond(i == 1, done, done), done)
    elif case == "switch":
      jax.lax.switch(i % 3, [done, add_y, done])
    else:
      jax.lax.cond(i % 2 == 0, add_y, done)
    return (b[...] + y,)

  def lax(x, w):
    src = x if case == "reads the source" else x * 2.0
    b = jax.lax.ppermute(src, "y", [(i, (i + 1) % 4) for i in range(4)])
    y = (x if case == "reads the source" else jnp.tanh(x)) @ w
    i = jax.lax.axis_index("y")
    if case == "nested":
      once = False
    elif case == "switch":
      once = i % 3 == 1
    else:
      once = i % 2 == 0
    return (b + y + jnp.where(once, y, 0.0),)

  x, w = _inputs(11)
  (want,) = _run(lax, 1, x, w, "start")
  for transfer in ("start", "done"):
    (got,) = _run(ref, 1, x, w, transfer)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
  ("case", "match"),
  [
    ("one branch", r"never awaited in branch 0 of a cond"),
    ("and after", r"was already awaited at .*test_stateful.py:\d+"),
    ("twice in a branch", r"was already awaited at .*test_stateful.py:\d+"),
    ("two jits", r"awaited or handed on 2 times"),
    ("source written in a branch", r"writes the source Ref"),
    ("loop body", r"captured by a scan/fori_loop body as a constant"),
  ],
)
def test_captured_future_misused_is_refused(case, match):
  x, w = _inputs(7)
  with pytest.raises(FutureError, match=match):
    _run(_captured(case), 1, x, w, "start")


@pytest.mark.parametrize("topology", ["v5e:2x4", "v6e:2x4"])
def test_captured_future_awaited_in_every_branch_on_tpu(topology):
  mesh = tpu_mesh(topology, (2, 4), AXES)
  x = jax.ShapeDtypeStruct(
    (8 * TPU_SHARD[0], TPU_SHARD[1]),
    jnp.float32,
    sharding=NamedSharding(mesh, SPEC),
  )
  w = jax.ShapeDtypeStruct(
    (TPU_SHARD[1],) * 2, jnp.float32, sharding=NamedSharding(mesh, P())
  )
  f = jax.jit(
    jax.shard_map(
      _captured("every branch"),
      mesh=mesh,
      in_specs=(SPEC, P()),
      out_specs=(SPEC,),
    )
  )
  r = analyze(f, x, w)
  assert len(r.kernel_pairs) == 2  # one done per branch
  assert not r.unawaited_branches
  r.assert_no_hazards()


def _count_eqns(jaxpr, name: str) -> int:
  """Equations of primitive ``name`` in ``jaxpr`` and its sub-jaxprs."""
  n = 0
  for e in jaxpr.eqns:
    n += e.primitive.name == name
    for p in jax.tree_util.tree_leaves(e.params):
      sub = getattr(p, "jaxpr", p)
      if hasattr(sub, "eqns"):
        n += _count_eqns(sub, name)
  return n


def _window_numbers_and_ties(ref, lax) -> int:
  """``ref`` (a Ref program) gives ``lax``'s numbers (transfer at the start
  and at the done); returns its ``asyncops_tie`` barriers."""
  x = jax.random.normal(jax.random.key(3), (8 * 128, 128)) / 4
  w = jnp.zeros((128, 128))
  (want,) = _run(lax, 1, x, w, "start")
  for transfer in ("start", "done"):
    (got,) = _run(ref, 1, x, w, transfer)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  g = jax.shard_map(
    ref, mesh=_cpu_mesh(), in_specs=(SPEC, P()), out_specs=(SPEC,)
  )
  return _count_eqns(jax.make_jaxpr(g)(x, w).jaxpr, "asyncops_tie")


@pytest.mark.parametrize("case", list(u.CAPTURED_READS))
def test_captured_window_source_reads_keep_the_numbers(case):
  # A captured done's window reading the source Ref (u.captured_reads;
  # structure on TPU in test_guard_split.py): the numbers of jax.lax, and
  # the start's frame tied (an asyncops_tie barrier) per u.CAPTURED_READS
  # on jax >= 0.10; on jax 0.9 (jc.CAPTURED_WINDOW_TIE off) never.
  body = u.captured_reads(case, "y")
  slot = "slot" in case
  made_of_x = any(k in case for k in ("source", "jit argument", "loop"))

  def ref(x, w):
    return (body(x),)

  def lax(x, w):
    k = jax.lax.axis_index("y") % 2 if "traced" in case else 0
    if slot:
      src = jnp.where(k == 0, x * 2.0, x * 3.0)
      y = src if "in-flight" in case else jnp.where(k == 0, x * 3.0, x * 2.0)
    else:
      src, y = (x if made_of_x else x * 2.0), x
    b = jax.lax.ppermute(src, "y", [(i, (i + 1) % 4) for i in range(4)])
    return (b + jnp.tanh(y) @ y,)

  ties = _window_numbers_and_ties(ref, lax)
  want_tied = jc.CAPTURED_WINDOW_TIE and u.CAPTURED_READS[case]
  assert (ties > 0) == want_tied, ties


def _carried_then_branch(x, w):
  """A Ref future carried through a ``lax.scan`` and awaited in both
  branches of a ``lax.cond`` in its body, then restarted."""
  del w
  a, b = jax.new_ref(x * 2.0), jax.new_ref(jnp.zeros_like(x))
  i = jax.lax.axis_index("y")

  def step(fut, _):
    done = lambda: st.ppermute_done(fut, a, b)  # noqa: E731  # CARRIED
    jax.lax.cond(i == 0, done, done)
    return st.ppermute_start(a, b, "y", shift=1), None

  fut, _ = jax.lax.scan(step, st.ppermute_start(a, b, "y", shift=1), None, 2)
  st.ppermute_done(fut, a, b)
  return (b[...],)


def test_carried_ref_future_awaited_in_a_branch():
  # jax >= 0.10: the numbers of jax.lax (the compiled TPU program passes
  # the guard, tests/test_guard_carried.py). jax 0.9: refused at trace time
  # naming the done's line (stateful._api._unpin_captured: its start is
  # not known there, so its source cannot be unpinned; pinned, that
  # libtpu compiled the first done with a copy of the source, v5e, v6e).
  x, w = _inputs(11)
  if not jc.CAPTURED_DONE_SOURCE_LIVE:
    line = u.marker_line(__file__, "CARRIED")
    with pytest.raises(
      NotImplementedError,
      match=rf"ppermute_done at \S*test_stateful.py:{line} .*lax\.cond "
      r"branch.*jax 0\.9.*pip install 'jax\[tpu\]>=0\.10'",
    ):
      _run(_carried_then_branch, 1, x, w, "start")
    return

  def lax(x, w):
    del w
    return (
      jax.lax.ppermute(x * 2.0, "y", [(j, (j + 1) % 4) for j in range(4)]),
    )

  (want,) = _run(lax, 1, x, w, "start")
  for transfer in ("start", "done"):
    (got,) = _run(_carried_then_branch, 1, x, w, transfer)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("case", list(u.TOP_READS))
def test_top_level_window_ref_reads_keep_the_numbers(case):
  # A top-level done's window reading only a Ref read (u.top_reads;
  # structure on TPU in test_guard_split.py): the numbers of jax.lax, and
  # asyncops_tie barriers: the one after the compute, one for the read
  # when u.TOP_READS ties it, one before the traced other slot's 1 - k
  # (its read itself untied).
  body = u.top_reads(case, "y")

  def ref(x, w):
    return (body(x),)

  def lax(x, w):
    k = jax.lax.axis_index("y") % 2 if "traced" in case else 0
    if "slot" in case:
      src = jnp.where(k == 0, x * 2.0, x * 3.0)
      y = src if "in-flight" in case else jnp.where(k == 0, x * 3.0, x * 2.0)
    else:
      src = x * 2.0
      y = x * 3.0 if case == "other Ref" else src
    b = jax.lax.ppermute(src, "y", [(i, (i + 1) % 4) for i in range(4)])
    return (b + jnp.tanh(y) @ y,)

  ties = _window_numbers_and_ties(ref, lax)
  tied = u.TOP_READS[case]
  assert ties == 1 + tied + (case == "other slot, traced"), ties


@pytest.mark.parametrize(
  "case", ["other slot, traced", "outer Ref, other slot"]
)
def test_captured_window_other_slot_grad(case):
  # jax.grad through a tied other-slot read (its own barrier with the
  # semaphores, jc._tie_read): the lax reference's gradient; on jax 0.9
  # reverse mode through the Ref API is refused with the fix.
  body = u.captured_reads(case, "y")

  def lax(x):
    k = jax.lax.axis_index("y") % 2 if "traced" in case else 0
    src = jnp.where(k == 0, x * 2.0, x * 3.0)
    y = jnp.where(k == 0, x * 3.0, x * 2.0)
    b = jax.lax.ppermute(src, "y", [(i, (i + 1) % 4) for i in range(4)])
    return b + jnp.tanh(y) @ y

  def grad_of(f):
    g = jax.shard_map(f, mesh=_cpu_mesh(), in_specs=SPEC, out_specs=SPEC)
    return jax.jit(jax.grad(lambda x: (g(x) ** 2).sum()))

  x = jax.random.normal(jax.random.key(5), (8 * 128, 128)) / 4
  if jc.REF_REVERSE_MODE:
    np.testing.assert_allclose(
      grad_of(body)(x), grad_of(lax)(x), rtol=1e-5, atol=1e-3
    )
  else:
    with pytest.raises(NotImplementedError, match=r"jax >= 0\.10.*Fix"):
      grad_of(body).trace(x)
