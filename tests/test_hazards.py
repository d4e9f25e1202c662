"""Misuse corpus: every way found to race a DMA or lose a future.

Each program here broke a check once (issue 14) or probes the edge of what
the checks prove. All are refused at trace time with a message naming the
user's lines, or, where that is the right answer, run and match
``jax.lax`` in both emulation modes. Hypothesis generates slot index
arithmetic and ``cond`` shapes; the oracle is Python evaluating the same
arithmetic for every residue of the loop index.
"""

import re
import warnings

import hypothesis
import hypothesis.strategies as hs
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import asyncops
from asyncops import _jax_compat as jc
from asyncops import stateful as st
from asyncops.futures._future import FutureError, NeverAwaitedWarning

N = 8
SHIFT = [(i, (i + 1) % N) for i in range(N)]


@pytest.fixture(autouse=True)
def _quiet():
  # Futures of traces a test aborts on purpose warn when collected.
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", NeverAwaitedWarning)
    yield


def _mesh():
  return jax.make_mesh((N,), ("i",))


def _jit(body):
  mesh = _mesh()
  return jax.jit(
    jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i"))
  )


def _spec(shape=(N * 2, 128)):
  return jax.ShapeDtypeStruct(
    shape, jnp.float32, sharding=NamedSharding(_mesh(), P("i"))
  )


def _trace(body):
  return _jit(body).trace(_spec())


def _run(body, mode):
  x = jnp.arange(N * 2 * 128, dtype=jnp.float32).reshape(N * 2, 128)
  x = jax.device_put(x, NamedSharding(_mesh(), P("i")))
  with asyncops.emulation(mode):
    return np.asarray(_jit(body)(x))


def _lines(msg: str) -> list[str]:
  return re.findall(r"test_hazards\.py:\d+", msg)


def _buf(x):
  return jax.new_ref(jnp.stack([x, jnp.zeros_like(x)]))


# Ref API: traced slot indices (the first hole) -----------------------


@pytest.mark.parametrize(
  "index,role",
  [
    (lambda i: i % 1, "writes the source Ref"),  # always slot 0, sent
    (lambda i: 1 + i % 1, "writes the destination Ref"),  # always slot 1
    (lambda i: i, "writes the source Ref"),  # unbounded: any slot
    (lambda i: jax.lax.axis_index("i") % 2, "writes the source Ref"),
  ],
  ids=["i%1", "1+i%1", "i", "axis_index%2"],
)
def test_traced_index_write_in_window(index, role):
  def body(x):
    buf = _buf(x)

    def step(i, c):
      fut = st.ppermute_start(buf.at[0], buf.at[1], "i", shift=1)
      buf[index(i)] = jnp.ones_like(x)
      st.ppermute_done(fut, buf.at[0], buf.at[1])
      return c

    jax.lax.fori_loop(0, 3, step, 0)
    return buf[1]

  with pytest.raises(FutureError, match=role) as e:
    _trace(body)
  msg = str(e.value)
  # The access, the start and the done, all in this file.
  assert len(_lines(msg)) >= 3, msg
  assert "before its done at" in msg


def test_traced_index_read_of_destination():
  def body(x):
    buf = _buf(x)

    def step(i, c):
      fut = st.ppermute_start(buf.at[0], buf.at[1], "i", shift=1)
      y = buf[(i + 1) % 2] * 2  # slot 1 for even i: the destination
      st.ppermute_done(fut, buf.at[0], buf.at[1])
      return c + y

    return jax.lax.fori_loop(0, 3, step, jnp.zeros_like(x))

  with pytest.raises(FutureError, match="reads the destination Ref"):
    _trace(body)


def test_reading_the_source_through_a_traced_index_is_fine():
  def body(x):
    buf = _buf(x)

    def step(i, c):
      fut = st.ppermute_start(buf.at[0], buf.at[1], "i", shift=1)
      y = buf[i % 1] * 2  # slot 0: reading the source is no race
      st.ppermute_done(fut, buf.at[0], buf.at[1])
      buf[0] = buf[1]
      return c + y

    return jax.lax.fori_loop(0, 3, step, jnp.zeros_like(x))

  want = np.zeros((N * 2, 128), np.float32)
  x = np.arange(N * 2 * 128, dtype=np.float32).reshape(N, 2, 128)
  for _ in range(3):
    want += 2 * x.reshape(N * 2, 128)
    x = np.roll(x, 1, axis=0)
  for mode in ("start", "done"):
    np.testing.assert_array_equal(_run(body, mode), want)


def test_assume_disjoint_opt_in():
  # k is a slot the program cannot prove different; the user asserts it.
  def body(x, opt_in):
    buf = jax.new_ref(jnp.stack([x, jnp.zeros_like(x), x * 3]))
    k = 2 * (jax.lax.axis_index("i") >= 0)  # always 2, not proven
    fut = st.ppermute_start(buf.at[0], buf.at[1], "i", shift=1)
    if opt_in:
      with st.assume_disjoint():
        y = buf[k] + 1
    else:
      y = buf[k] + 1
    st.ppermute_done(fut, buf.at[0], buf.at[1])
    return buf[1] + y

  with pytest.raises(FutureError, match="not proven different"):
    _trace(lambda x: body(x, False))
  x = np.arange(N * 2 * 128, dtype=np.float32).reshape(N, 2, 128)
  want = np.roll(x, 1, axis=0) + 3 * x + 1
  for mode in ("start", "done"):
    got = _run(lambda x: body(x, True), mode)
    np.testing.assert_array_equal(got, want.reshape(N * 2, 128))


def test_assume_disjoint_still_refuses_proven_hits_and_whole_refs():
  def hit(x):
    buf = _buf(x)
    fut = st.ppermute_start(buf.at[0], buf.at[1], "i", shift=1)
    with st.assume_disjoint():
      buf[1] = x  # slot 1 is the destination, proven
    st.ppermute_done(fut, buf.at[0], buf.at[1])
    return buf[1]

  def whole(x):
    buf = _buf(x)
    fut = st.ppermute_start(buf.at[0], buf.at[1], "i", shift=1)
    with st.assume_disjoint():
      y = buf[...].sum(0)
    st.ppermute_done(fut, buf.at[0], buf.at[1])
    return buf[1] + y

  with pytest.raises(FutureError, match=r"writes the destination Ref \(slot 1"):
    _trace(hit)
  with pytest.raises(FutureError, match="reads the destination Ref"):
    _trace(whole)


@pytest.mark.parametrize(
  "sl,ok", [(slice(0, 1), True), (slice(1, 2), False), (slice(0, 2), False)]
)
def test_static_slices_of_the_leading_axis(sl, ok):
  def body(x):
    buf = _buf(x)
    fut = st.ppermute_start(buf.at[0], buf.at[1], "i", shift=1)
    y = buf[sl].sum(0)
    st.ppermute_done(fut, buf.at[0], buf.at[1])
    return buf[1] + y

  if ok:
    _trace(body)
  else:
    with pytest.raises(FutureError, match="reads the destination Ref"):
      _trace(body)


# Ref API: source and destination that may alias ------------------------------


def test_same_slot_as_source_and_destination():
  def body(x):
    buf = _buf(x)
    fut = st.ppermute_start(buf.at[0], buf.at[0], "i", shift=1)
    st.ppermute_done(fut, buf.at[0], buf.at[0])
    return buf[1]

  with pytest.raises(ValueError, match="the same slot 0 of one Ref"):
    _trace(body)


@pytest.mark.parametrize(
  "src,dst",
  [
    (lambda i: i % 2, lambda i: i % 2),
    (lambda i: i % 2, lambda i: (i + 2) % 2),
    (lambda i: i, lambda i: i + 1),  # unbounded: not proven
    (lambda i: i % 2, lambda i: jax.lax.axis_index("i") % 2),
  ],
  ids=["same", "i+2", "unbounded", "other-root"],
)
def test_slots_that_may_alias_are_refused(src, dst):
  def body(x):
    buf = _buf(x)

    def step(i, c):
      fut = st.ppermute_start(buf.at[src(i)], buf.at[dst(i)], "i", shift=1)
      st.ppermute_done(fut, buf.at[src(i)], buf.at[dst(i)])
      return c

    jax.lax.fori_loop(0, 2, step, 0)
    return buf[1]

  with pytest.raises(ValueError, match="separate receive buffer"):
    _trace(body)


@pytest.mark.parametrize(
  "dst",
  [lambda i: 1 - i % 2, lambda i: (i + 1) % 2, lambda i: (i + 3) % 2],
  ids=["1-i%2", "(i+1)%2", "(i+3)%2"],
)
def test_slots_proven_different_run_like_lax(dst):
  def body(x):
    buf = _buf(x)

    def step(i, c):
      s, d = buf.at[i % 2], buf.at[dst(i)]
      fut = st.ppermute_start(s, d, "i", shift=1)
      st.ppermute_done(fut, s, d)
      return c

    jax.lax.fori_loop(0, 3, step, 0)
    return buf[1]

  x = np.arange(N * 2 * 128, dtype=np.float32).reshape(N, 2, 128)
  # Three hops ping-pong 0->1->0->1: slot 1 holds x shifted three times.
  want = np.roll(x, 3, axis=0).reshape(N * 2, 128)
  for mode in ("start", "done"):
    np.testing.assert_array_equal(_run(body, mode), want)


def test_start_with_unproven_slots_inside_assume_disjoint():
  def body(x):
    buf = _buf(x)
    k = jnp.where(jax.lax.axis_index("i") >= 0, 1, 0)  # 1, not proven
    with st.assume_disjoint():
      fut = st.ppermute_start(buf.at[0], buf.at[k], "i", shift=1)
    st.ppermute_done(fut, buf.at[0], buf.at[k])
    return buf[1]

  x = np.arange(N * 2 * 128, dtype=np.float32).reshape(N, 2, 128)
  for mode in ("start", "done"):
    got = _run(body, mode)
    np.testing.assert_array_equal(got, np.roll(x, 1, axis=0).reshape(-1, 128))


# Ref API: windows across scopes ----------------------------------------------


def _staggered(before_done):
  """A future carried around a loop; ``before_done(buf, i)`` runs in the
  window of the transfer carried into iteration ``i``."""

  def body(x):
    buf = st.double_buffer(x)
    fut = st.ppermute_start(buf.send_slot(0), buf.recv_slot(0), "i", shift=1)

    def step(i, carry):
      fut, acc = carry
      acc = acc + before_done(buf, i)
      st.ppermute_done(fut, buf.send_slot(i), buf.recv_slot(i))
      j = i + 1
      fut = st.ppermute_start(buf.send_slot(j), buf.recv_slot(j), "i", shift=1)
      return fut, acc

    fut, acc = jax.lax.fori_loop(0, 3, step, (fut, jnp.zeros_like(x)))
    st.ppermute_done(fut, buf.send_slot(3), buf.recv_slot(3))
    return buf.read(4) + acc

  return body


def test_carried_window_reading_the_source_runs_like_lax():
  body = _staggered(lambda buf, i: buf.send_slot(i)[...])
  x = np.arange(N * 2 * 128, dtype=np.float32).reshape(N, 2, 128)
  want = np.zeros_like(x)
  for k in range(3):
    want += np.roll(x, k, axis=0)
  want += np.roll(x, 4, axis=0)
  for mode in ("start", "done"):
    np.testing.assert_array_equal(_run(body, mode), want.reshape(-1, 128))


@pytest.mark.parametrize(
  "access,what",
  [
    (lambda buf, i: buf.recv_slot(i)[...], "reads the destination Ref"),
    (lambda buf, i: buf.ref[(i + 1) % 2], "reads the destination Ref"),
  ],
  ids=["recv_slot", "(i+1)%2"],
)
def test_carried_window_hazard_across_the_back_edge(access, what):
  with pytest.raises(FutureError, match=what) as e:
    _trace(_staggered(access))
  assert len(_lines(str(e.value))) >= 2


def test_carried_window_write_of_the_source():
  def write(buf, i):
    buf.send_slot(i)[...] = jnp.zeros(buf.ref.shape[1:])
    return 0.0

  with pytest.raises(FutureError, match="writes the source Ref"):
    _trace(_staggered(write))


def test_access_after_the_loop_before_the_last_done():
  def body(x):
    buf = st.double_buffer(x)
    fut = st.ppermute_start(buf.send_slot(0), buf.recv_slot(0), "i", shift=1)

    def step(i, fut):
      st.ppermute_done(fut, buf.send_slot(i), buf.recv_slot(i))
      j = i + 1
      return st.ppermute_start(buf.send_slot(j), buf.recv_slot(j), "i", shift=1)

    fut = jax.lax.fori_loop(0, 3, step, fut)
    y = buf.ref[1] * 2  # slot 1 is in flight (slots unknown after the loop)
    st.ppermute_done(fut, buf.send_slot(3), buf.recv_slot(3))
    return buf.read(4) + y

  with pytest.raises(FutureError, match="reads the destination Ref"):
    _trace(body)


def test_future_passed_through_a_loop_that_touches_the_destination():
  def body(x):
    a, b = jax.new_ref(x), jax.new_ref(jnp.zeros_like(x))
    fut = st.ppermute_start(a, b, "i", shift=1)

    def step(i, fut):
      b[...] = x  # the transfer is still in flight here
      return fut

    fut = jax.lax.fori_loop(0, 2, step, fut)
    st.ppermute_done(fut, a, b)
    return b[...]

  with pytest.raises(FutureError, match="writes the destination Ref"):
    _trace(body)


@pytest.mark.parametrize("where", ["cond", "jit", "loop"])
def test_hazard_inside_a_sub_jaxpr_in_the_window(where):
  def body(x):
    a, b = jax.new_ref(x), jax.new_ref(jnp.zeros_like(x))
    fut = st.ppermute_start(a, b, "i", shift=1)

    def touch():
      a[...] = a[...] * 2  # writes the source in flight

    if where == "cond":
      jax.lax.cond(jax.lax.axis_index("i") > 3, touch, lambda: None)
    elif where == "jit":
      jax.jit(touch)()
    else:
      jax.lax.fori_loop(0, 2, lambda i, c: (touch(), c)[1], 0)
    st.ppermute_done(fut, a, b)
    return b[...]

  with pytest.raises(FutureError, match="writes the source Ref"):
    _trace(body)


def test_second_transfer_into_an_inflight_destination():
  def body(x):
    a, b = jax.new_ref(x), jax.new_ref(jnp.zeros_like(x))
    c = jax.new_ref(x * 2)
    f1 = st.ppermute_start(a, b, "i", shift=1)
    f2 = st.copy_start(c, b)  # b is being written by f1
    st.copy_done(f2, c, b)
    st.ppermute_done(f1, a, b)
    return b[...]

  with pytest.raises(
    FutureError, match="writes the destination Ref .by starting another"
  ):
    _trace(body)


# Life cycle: every start awaited once on every path --------------------------


@pytest.mark.parametrize("api", ["value", "ref"])
def test_awaited_in_only_one_branch_of_cond(api):
  def body(x):
    pred = jax.lax.axis_index("i") == 0
    if api == "value":
      x2, fut = asyncops.ppermute_start(x, "i", shift=1)
      return jax.lax.cond(
        pred, lambda f: asyncops.ppermute_done(f), lambda f: x2, fut
      )
    a, b = jax.new_ref(x), jax.new_ref(jnp.zeros_like(x))
    fut = st.ppermute_start(a, b, "i", shift=1)

    def wait(f):
      st.ppermute_done(f, a, b)

    jax.lax.cond(pred, wait, lambda f: None, fut)
    return b[...]

  with pytest.raises(
    FutureError,
    match=r"test_hazards.py:\d+.*never awaited in branch 0 of a cond "
    r"\(false_fun of lax.cond\)",
  ):
    _trace(body)


@hypothesis.settings(max_examples=12, deadline=None)
@hypothesis.given(awaits=hs.lists(hs.booleans(), min_size=2, max_size=4))
def test_switch_branches_all_await_or_it_is_refused(awaits):
  def body(x):
    x2, fut = asyncops.ppermute_start(x, "i", shift=1)
    branches = [
      (lambda f: asyncops.ppermute_done(f))
      if a
      else (lambda f, x2=x2: x2 * 1.0)
      for a in awaits
    ]
    k = jax.lax.axis_index("i") % len(awaits)
    return jax.lax.switch(k, branches, fut)

  if all(awaits):
    _trace(body)
  elif not any(awaits):  # no branch takes it: dropped before the switch
    with pytest.raises(FutureError, match=r"is never awaited\. "):
      _trace(body)
  else:
    bad = awaits.index(False)
    with pytest.raises(FutureError, match=f"never awaited in branch {bad}"):
      _trace(body)


# A future every branch passes through unchanged: JAX forwards the output
# out of the cond (it *is* the operand) and keeps the operand, unused.
_BRANCHES = [("cond", 2), ("switch", 2), ("switch", 3)]


def _branch_op(op, n, branches, *args):
  if op == "cond":
    # branches[k] on device k % 2, as the switch: index k is branch k
    pred = jax.lax.axis_index("i") % 2 == 1
    return jax.lax.cond(pred, branches[1], branches[0], *args)
  return jax.lax.switch(jax.lax.axis_index("i") % n, branches, *args)


def _eqns(jaxpr):
  for e in jaxpr.eqns:
    yield e
    for sub in jc.jaxprs_in_params(e.params):
      yield from _eqns(getattr(sub, "jaxpr", sub))


def _branch(how, k):
  """Branch ``k`` of a cond taking ``(future, z)``; ``how`` it treats it."""

  def run(f, z):
    if how == "through":  # returns the future unchanged
      return f, z * (k + 1)
    if how == "await_and_pass" and k == 0:
      return f, z + asyncops.ppermute_done(f)
    if how == "await_and_pass":
      return f, z * (k + 1)
    if how == "await_one" and k == 0:
      return asyncops.ppermute_done(f) + z
    return z * (k + 1)  # ignores the future

  return run


@pytest.mark.parametrize(("op", "n"), _BRANCHES)
@pytest.mark.parametrize("mode", ["start", "done"])
def test_future_through_every_branch_unchanged(op, n, mode):
  def body(x):
    _, fut = asyncops.ppermute_start(x * 2.0, "i", shift=1)
    branches = [_branch("through", k) for k in range(n)]
    fut, z = _branch_op(op, n, branches, fut, x)
    return asyncops.ppermute_done(fut) + z

  # The case this is about: JAX takes the future out of the cond, so the
  # cond returns z only and its branches never touch the semaphores.
  (cond,) = [
    e for e in _eqns(_trace(body).jaxpr.jaxpr) if e.primitive.name == "cond"
  ]
  assert len(cond.outvars) == 1
  asyncops.futures.check_futures(_jit(body), _spec())  # the strict form

  def lax(x):
    k = jax.lax.axis_index("i")
    return jax.lax.ppermute(x * 2.0, "i", SHIFT) + x * (k % n + 1)

  x = jnp.arange(N * 2 * 128, dtype=jnp.float32).reshape(N * 2, 128)
  want = np.asarray(
    _jit(lax)(jax.device_put(x, NamedSharding(_mesh(), P("i"))))
  )
  np.testing.assert_array_equal(_run(body, mode), want)


@pytest.mark.parametrize(("op", "n"), _BRANCHES)
@pytest.mark.parametrize(
  ("how", "match"),
  [
    # branch 0 awaits it, the others ignore it
    ("await_one", r"never awaited in branch 1"),
    # ... and it is awaited again after the cond
    (
      "await_one_and_after",
      r"is awaited in branch 0 of a cond.* but passed on from branch 1",
    ),
    # every branch ignores it and nothing awaits it after the cond
    ("ignore", r"test_hazards.py:\d+.*is never awaited\. "),
    # every branch passes it on and it is awaited twice after the cond
    ("twice", r"awaited or handed on 2 times"),
    # every branch passes it on, branch 0 also awaits it (JAX moves the
    # future out of the cond, so branch 1 shows no use of it): the message
    # names the await and the pass, not a branch that "never awaits"
    (
      "await_and_pass",
      r"is awaited in branch 0 of a cond.* but passed on from branch 1"
      r".*\(returned unchanged, or used again after the cond\)",
    ),
  ],
)
def test_future_through_branches_misused_is_refused(op, n, how, match):
  def body(x):
    _, fut = asyncops.ppermute_start(x * 2.0, "i", shift=1)
    kind = {"await_one_and_after": "await_one", "twice": "through"}
    branches = [_branch(kind.get(how, how), k) for k in range(n)]
    if how in ("twice", "await_and_pass"):
      fut, z = _branch_op(op, n, branches, fut, x)
    else:
      z = _branch_op(op, n, branches, fut, x)
    if how == "twice":
      wait = jax.jit(asyncops.ppermute_done)  # past the Python-side check
      return wait(fut) + wait(fut) + z
    if how in ("await_and_pass", "await_one_and_after"):
      return asyncops.ppermute_done(fut) + z
    return z

  with pytest.raises(FutureError, match=match):
    _trace(body)


def test_start_dropped_in_a_loop_body():
  def body(x):
    def step(i, c):
      c, _ = asyncops.ppermute_start(c, "i", shift=1)
      return c

    return jax.lax.fori_loop(0, 3, step, x)

  with pytest.raises(FutureError, match=r"test_hazards.py:\d+.*never awaited"):
    _trace(body)


def test_start_in_an_overlap_body_never_awaited():
  def body(x):
    x, fut = asyncops.ppermute_start(x, "i", shift=1)

    def compute(a):
      b, _ = asyncops.ppermute_start(a * 2, "i", shift=2)  # dropped
      return b

    out, fut = asyncops.overlap(fut, compute, x)
    return asyncops.ppermute_done(fut) + out

  with pytest.raises(FutureError, match=r"test_hazards.py:\d+.*never awaited"):
    _trace(body)


def test_done_whose_result_is_unused_removes_the_transfer():
  """JAX removes a done whose result nothing reads; the start (whose
  aliased source is used) then becomes the identity, so the compiled
  program starts no DMA it never waits for. No trace-time refusal."""

  def body(x):
    x2, fut = asyncops.ppermute_start(x, "i", shift=1)
    asyncops.ppermute_done(fut)
    return x2 * 2

  jaxpr = _trace(body).jaxpr
  live = str(jc.without_dead_code(jaxpr.jaxpr))
  assert "asyncops_start" not in live and "asyncops_done" not in live
  assert "asyncops_start" in str(jaxpr)  # as traced
  for mode in ("start", "done"):
    x = np.arange(N * 2 * 128, dtype=np.float32).reshape(N * 2, 128)
    np.testing.assert_array_equal(_run(body, mode), x * 2)


def test_awaited_twice_across_jit_by_default():
  def body(x):
    x, fut = asyncops.ppermute_start(x, "i", shift=1)
    wait = jax.jit(asyncops.ppermute_done)
    return wait(fut) + wait(fut)

  with pytest.raises(FutureError, match="awaited or handed on 2 times"):
    _trace(body)


def test_good_programs_pass_the_default_checks():
  def body(x):
    x, fut = asyncops.ppermute_start(x, "i", shift=1)
    pred = jax.lax.axis_index("i") % 2 == 0
    y = jax.lax.cond(
      pred,
      lambda f: asyncops.ppermute_done(f) * 2,
      lambda f: asyncops.ppermute_done(f) - 1,
      fut,
    )

    def step(i, f):
      return asyncops.ppermute_start(asyncops.ppermute_done(f), "i", shift=1)[1]

    _, g = asyncops.ppermute_start(y, "i", shift=1)
    g = jax.lax.fori_loop(0, 3, step, g)
    return asyncops.ppermute_done(g)

  def lax(x):
    y = jax.lax.ppermute(x, "i", SHIFT)
    y = jnp.where(jax.lax.axis_index("i") % 2 == 0, y * 2, y - 1)
    for _ in range(4):
      y = jax.lax.ppermute(y, "i", SHIFT)
    return y

  x = jnp.arange(N * 2 * 128, dtype=jnp.float32).reshape(N * 2, 128)
  want = np.asarray(
    _jit(lax)(jax.device_put(x, NamedSharding(_mesh(), P("i"))))
  )
  for mode in ("start", "done"):
    np.testing.assert_array_equal(_run(body, mode), want)


# Emulation mode is part of what a jitted function is traced for --------------


def test_emulation_mode_change_retraces():
  traces = []

  @_jit
  def peek(x):
    traces.append(1)
    x2, fut = asyncops.ppermute_start(x, "i", shift=1)
    inflight = fut.dst  # the destination, read while in flight
    return asyncops.ppermute_done(fut) + 0 * x2 + inflight

  x = jnp.arange(N * 2 * 128, dtype=jnp.float32).reshape(N * 2, 128)
  x = jax.device_put(x, NamedSharding(_mesh(), P("i")))
  a = np.asarray(peek(x))
  with asyncops.emulation("done"):
    b = np.asarray(peek(x))
  c = np.asarray(peek(x))
  assert len(traces) == 2  # one per mode; back to "start" hits the cache
  y = np.roll(np.asarray(x).reshape(N, 2, 128), 1, axis=0).reshape(-1, 128)
  np.testing.assert_array_equal(a, 2 * y)  # data moved at the start
  np.testing.assert_array_equal(b, y)  # in flight: zeros read
  np.testing.assert_array_equal(c, a)


def test_emulation_rejects_unknown_mode():
  with pytest.raises(ValueError, match="'start' or 'done'"):
    with asyncops.emulation("later"):
      pass


# No JAX deprecation from our code ---------------------------------------------


def test_ref_api_trace_emits_no_deprecation_warning():
  def body(x):
    buf = st.double_buffer(x)

    def step(i, c):
      s, r = buf.send_slot(i), buf.recv_slot(i)
      fut = st.ppermute_start(s, r, "i", shift=1)
      st.ppermute_done(fut, s, r)
      return c

    jax.lax.fori_loop(0, 2, step, 0)
    return buf.read(2)

  with warnings.catch_warnings():
    warnings.simplefilter("error", DeprecationWarning)
    _trace(body).lower()


# Hypothesis: slot arithmetic, checked against Python -------------------------


def _expr():
  """Index expressions over a loop index ``i``: (text, jax fn, py fn)."""

  def const(c):
    return (str(c), lambda i: c, lambda i: c)

  leaf = hs.sampled_from(
    [("i", lambda i: i, lambda i: i)] + [const(c) for c in range(3)]
  )

  def extend(inner):
    c = hs.integers(-3, 3)
    m = hs.integers(1, 4)
    return hs.one_of(
      hs.tuples(inner, c).map(
        lambda t: (
          f"({t[0][0]} + {t[1]})",
          lambda i, f=t[0][1], k=t[1]: f(i) + k,
          lambda i, f=t[0][2], k=t[1]: f(i) + k,
        )
      ),
      hs.tuples(inner, c).map(
        lambda t: (
          f"({t[1]} - {t[0][0]})",
          lambda i, f=t[0][1], k=t[1]: k - f(i),
          lambda i, f=t[0][2], k=t[1]: k - f(i),
        )
      ),
      hs.tuples(inner, c).map(
        lambda t: (
          f"({t[0][0]} * {t[1]})",
          lambda i, f=t[0][1], k=t[1]: f(i) * k,
          lambda i, f=t[0][2], k=t[1]: f(i) * k,
        )
      ),
      hs.tuples(inner, m).map(
        lambda t: (
          f"({t[0][0]} % {t[1]})",
          lambda i, f=t[0][1], k=t[1]: f(i) % k,
          lambda i, f=t[0][2], k=t[1]: f(i) % k,
        )
      ),
    )

  return hs.recursive(leaf, extend, max_leaves=4)


def _slot_of(v, n):
  """Slots index ``v`` may select in an axis of ``n`` (out of range: all)."""
  return {v} if 0 <= v < n else set(range(n))


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(
  held=_expr(), acc=_expr(), write=hs.booleans(), n=hs.integers(2, 3)
)
def test_slot_arithmetic_against_python(held, acc, write, n):
  """An access is refused iff some loop index may make it hit the in-flight
  destination slot (expressions are taken modulo ``n`` by Python first, so
  every one is in range and periodic; residues up to 144 cover them)."""
  h_text, h_jax, h_py = held
  a_text, a_jax, a_py = acc

  def body(x):
    buf = jax.new_ref(jnp.stack([x] * (n + 1)))

    def step(i, c):
      d = h_jax(i) % n + 1  # destination among slots 1..n, source slot 0
      fut = st.ppermute_start(buf.at[0], buf.at[d], "i", shift=1)
      k = a_jax(i) % n + 1
      if write:
        buf[k] = x
        y = x
      else:
        y = buf[k]
      st.ppermute_done(fut, buf.at[0], buf.at[d])
      return c + y

    return jax.lax.fori_loop(0, 2, step, jnp.zeros_like(x))

  collide = any(h_py(i) % n == a_py(i) % n for i in range(-144, 144))
  hypothesis.note(f"held={h_text} % {n}, access={a_text} % {n}")
  if collide:
    with pytest.raises(FutureError, match="the destination Ref"):
      _trace(body)
  else:
    _trace(body)
