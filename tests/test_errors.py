"""Bad input and life-cycle misuse: each error names the argument and fix."""

import gc
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import asyncops
from asyncops.futures import check_futures
from asyncops.testing import cpu_mesh

N = 8


def _mesh():
  return cpu_mesh((N,), ("i",))


def _trace(body, dtype=jnp.float32, shape=(N * 2, 4)):
  """Traces ``body`` under shard_map over axis ``i`` (nothing runs)."""
  mesh = _mesh()
  x = jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P("i")))
  f = jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i"))
  return jax.make_jaxpr(f)(x)


@pytest.fixture
def x64():
  before = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", True)
  yield
  jax.config.update("jax_enable_x64", before)


def test_unbound_axis_name():
  with pytest.raises(NameError, match=r"axis_name 'j' is not bound.*shard_map"):
    _trace(
      lambda x: asyncops.ppermute_done(
        asyncops.ppermute_start(x, "j", shift=1)[1]
      )
    )


@pytest.mark.parametrize(
  "perm,exc,pattern",
  [
    ([(0, 1), (0, 2)], ValueError, r"perm has duplicate source 0.*Split"),
    ([(0, 1), (2, 1)], ValueError, r"perm has duplicate destination 1"),
    ([(0, 8)], ValueError, r"perm destination index 8.*out of range.*\[0, 8\)"),
    ([(-1, 0)], ValueError, r"perm source index -1.*out of range"),
    ([(0, 1, 2)], TypeError, r"perm entries must be pairs"),
    ([0, 1], TypeError, r"perm entries must be pairs"),
    ("01", TypeError, r"perm must be a sequence of \(source, destination\)"),
  ],
)
def test_invalid_perm(perm, exc, pattern):
  with pytest.raises(exc, match=pattern):
    _trace(lambda x: asyncops.ppermute_start(x, "i", perm)[0])


@pytest.mark.parametrize("kw", [{}, {"perm": [(0, 1)], "shift": 1}])
def test_perm_and_shift_exactly_one(kw):
  with pytest.raises(TypeError, match=r"exactly one of perm=.*or shift="):
    _trace(lambda x: asyncops.ppermute_start(x, "i", **kw)[0])


def test_shift_not_int():
  with pytest.raises(TypeError, match=r"shift must be a Python int"):
    _trace(lambda x: asyncops.ppermute_start(x, "i", shift=1.5)[0])


def test_bidirectional_odd_split():
  with pytest.raises(ValueError, match=r"x.shape\[0\] = 3 is odd.*Pad x"):
    _trace(lambda x: asyncops.bidirectional_start(x, "i")[0], shape=(N * 3, 4))


@pytest.mark.parametrize("dtype", ["float64", "int64", "complex128"])
def test_dtype_not_movable(dtype, x64):
  with pytest.raises(TypeError, match=rf"x has dtype {dtype}.*Cast x first"):
    _trace(lambda x: asyncops.ppermute_start(x, "i", shift=1)[0], dtype=dtype)


def test_x64_fixture_restored():
  assert not jax.config.jax_enable_x64


@pytest.mark.filterwarnings("ignore::asyncops.NeverAwaitedWarning")
def test_future_to_wrong_done():
  def body(x):
    x, fut = asyncops.ppermute_start(x, "i", shift=1)
    fake = asyncops.Future(
      fut.sems,
      fut.src,
      fut.dst,
      fut.spec.__class__(**{**fut.spec.__dict__, "kind": "all_gather"}),
    )
    asyncops.ppermute_done(fut)
    return asyncops.ppermute_done(fake)

  with pytest.raises(
    asyncops.FutureError, match=r"comes from all_gather_start.*all_gather_done"
  ):
    _trace(body)


@pytest.mark.filterwarnings("ignore::asyncops.NeverAwaitedWarning")
def test_ppermute_future_to_copy_done():
  def body(x):
    x, fut = asyncops.ppermute_start(x, "i", shift=1)
    return asyncops.copy_done(fut)

  with pytest.raises(
    asyncops.FutureError,
    match=r"comes from ppermute_start.*await it with "
    r"ppermute_done",
  ):
    _trace(body)


@pytest.mark.filterwarnings("ignore::asyncops.NeverAwaitedWarning")
def test_non_future_to_done():
  def body(x):
    x, fut = asyncops.ppermute_start(x, "i", shift=1)
    return asyncops.ppermute_done(x)

  with pytest.raises(TypeError, match=r"expected the Future.*got .*returned x"):
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", asyncops.NeverAwaitedWarning)
      _trace(body)


def test_awaited_twice():
  def body(x):
    x, fut = asyncops.ppermute_start(x, "i", shift=1)
    return asyncops.ppermute_done(fut) + asyncops.ppermute_done(fut)

  with pytest.raises(asyncops.FutureError, match=r"already awaited.*only once"):
    _trace(body)


def test_awaited_twice_through_tree_map_copy():
  def body(x):
    x, fut = asyncops.ppermute_start(x, "i", shift=1)
    copy = jax.tree.map(lambda a: a, fut)
    return asyncops.ppermute_done(fut) + asyncops.ppermute_done(copy)

  with pytest.raises(
    asyncops.FutureError,
    match=r"started at .*test_errors.py.*already awaited through a copy",
  ):
    _trace(body)


@pytest.mark.filterwarnings("ignore::asyncops.NeverAwaitedWarning")
def test_recv_done_before_send_done():
  def body(x):
    x, fut = asyncops.ppermute_start(x, "i", shift=1)
    return asyncops.recv_done(fut)

  with pytest.raises(
    asyncops.FutureError, match=r"Call send_done\(fut\) first"
  ):
    _trace(body)


@pytest.mark.filterwarnings("ignore::asyncops.NeverAwaitedWarning")
def test_never_awaited_raises_at_trace_time():
  def body(x):
    x, fut = asyncops.ppermute_start(x, "i", shift=1)
    return x

  with pytest.raises(
    asyncops.FutureError,
    match=r"started at .*test_errors.py:\d+ .*never awaited",
  ):
    _trace(body)


@pytest.mark.parametrize("loop", ["fori", "while", "jit"])
def test_never_awaited_silent_for_carried_futures(loop):
  def body(x):
    x, fut = asyncops.ppermute_start(x, "i", shift=1)

    def step(fut):
      _, fut = asyncops.ppermute_start(
        asyncops.ppermute_done(fut), "i", shift=1
      )
      return fut

    if loop == "fori":
      fut = jax.lax.fori_loop(0, 3, lambda i, f: step(f), fut)
    elif loop == "while":
      fut = jax.lax.while_loop(
        lambda c: c[0] < 3, lambda c: (c[0] + 1, step(c[1])), (0, fut)
      )[1]
    else:
      fut = jax.jit(step)(fut)
    return asyncops.ppermute_done(fut)

  with warnings.catch_warnings():
    warnings.simplefilter("error", asyncops.NeverAwaitedWarning)
    _trace(body)
    gc.collect()


# check_futures: the jaxpr-level life-cycle check ------------------------------


def _check(body):
  mesh = _mesh()
  x = jax.ShapeDtypeStruct(
    (N * 2, 4), jnp.float32, sharding=NamedSharding(mesh, P("i"))
  )
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i")))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", asyncops.NeverAwaitedWarning)
    check_futures(f, x)


def test_check_dropped_in_loop_body():
  def body(x):
    def step(i, c):
      c, _ = asyncops.ppermute_start(c, "i", shift=1)
      return c

    return jax.lax.fori_loop(0, 3, step, x)

  with pytest.raises(
    asyncops.FutureError,
    match=r"started at .*test_errors.py:\d+.*never awaited",
  ):
    _check(body)


def test_check_awaited_twice_across_jit():
  def body(x):
    x, fut = asyncops.ppermute_start(x, "i", shift=1)
    wait = jax.jit(asyncops.ppermute_done)
    return wait(fut) + wait(fut)

  with pytest.raises(
    asyncops.FutureError,
    match=r"test_errors.py:\d+.*awaited or handed on 2 times",
  ):
    _check(body)


def test_check_future_captured_by_loop():
  def body(x):
    x, fut = asyncops.ppermute_start(x, "i", shift=1)

    def step(i, c):
      return c + asyncops.ppermute_done(jax.tree.map(lambda a: a, fut))

    return jax.lax.fori_loop(0, 3, step, x)

  with pytest.raises(
    asyncops.FutureError, match=r"captured by a scan/fori_loop body.*loop carry"
  ):
    _check(body)


def test_check_loop_awaits_carry_without_restarting():
  def body(x):
    x, fut = asyncops.ppermute_start(x, "i", shift=1)

    def step(c):
      i, f, acc = c
      return i + 1, f, acc + 1

    _, fut, acc = jax.lax.while_loop(lambda c: c[0] < 3, step, (0, fut, x))
    return asyncops.ppermute_done(fut) + acc

  _check(body)  # a carry passed through untouched is fine


def test_check_computing_with_semaphores():
  def body(x):
    x, fut = asyncops.ppermute_start(x, "i", shift=1)
    fut = jax.tree.map(lambda a: a + 0, fut)
    return asyncops.ppermute_done(fut)

  with pytest.raises(asyncops.FutureError, match=r"used by `add`"):
    _check(body)


def test_check_accepts_good_program():
  def body(x):
    x, fut = asyncops.ppermute_start(x, "i", shift=1)
    x2, fut = asyncops.send_done(fut)
    return asyncops.recv_done(fut) + np.float32(2) * x2

  _check(body)


# Argument types: each refused with the argument named ------------------------


@pytest.mark.parametrize(
  "start",
  [
    lambda r: asyncops.ppermute_start(r, "i", shift=1),
    lambda r: asyncops.all_gather_start(r, "i"),
    lambda r: asyncops.copy_start(r),
    lambda r: asyncops.bidirectional_start(r, "i"),
  ],
  ids=["ppermute", "all_gather", "copy", "bidirectional"],
)
def test_ref_passed_to_the_value_api(start):
  def body(x):
    start(jax.new_ref(x))
    return x

  with pytest.raises(
    TypeError, match=r"x is a jax.Ref.*asyncops.stateful\.\w+_start"
  ):
    _trace(body)


@pytest.mark.parametrize(
  "kw,pattern",
  [
    ({"axis": "0"}, r"axis must be an int, got '0'"),
    ({"axis": True}, r"axis must be an int, got True"),
    ({"axis": 1.0}, r"axis must be an int, got 1.0"),
    ({"tiled": "yes"}, r"tiled must be True or False, got 'yes'"),
    ({"tiled": 1}, r"tiled must be True or False, got 1"),
  ],
)
def test_all_gather_argument_types(kw, pattern):
  with pytest.raises(TypeError, match=pattern):
    _trace(lambda x: asyncops.all_gather_start(x, "i", **kw)[0])


def test_all_gather_axis_out_of_range_names_the_range():
  with pytest.raises(ValueError, match=r"axis=5 is out of range.*\[-3, 3\)"):
    _trace(lambda x: asyncops.all_gather_start(x, "i", axis=5)[0])


@pytest.mark.parametrize("shift", [True, False, 1.0, "1"])
def test_shift_must_be_int_not_bool(shift):
  with pytest.raises(TypeError, match=r"shift must be a Python int"):
    _trace(lambda x: asyncops.ppermute_start(x, "i", shift=shift)[0])


def test_perm_entries_must_not_be_bools():
  with pytest.raises(TypeError, match=r"perm entries must be pairs of ints"):
    _trace(lambda x: asyncops.ppermute_start(x, "i", perm=[(True, 0)])[0])


def test_numpy_ints_are_accepted():
  def body(x):
    x, fut = asyncops.all_gather_start(x, "i", axis=np.int64(0))
    y = asyncops.all_gather_done(fut)
    x, fut = asyncops.ppermute_start(x, "i", shift=np.int32(1))
    return asyncops.ppermute_done(fut) + 0 * y.sum()

  _trace(body)


def test_never_awaited_warning_without_an_origin_names_no_none():
  """A future whose start line is unknown (made by hand, not by a start)
  warns "started at an unknown line", never "started at None"."""
  from asyncops.futures._future import Future  # noqa: PLC0415
  from asyncops.kernels._spec import OpSpec  # noqa: PLC0415

  spec = OpSpec(
    kind="ppermute",
    shape=(8,),
    dtype="float32",
    axis_name="i",
    mesh_axes=("i",),
    axis_size=2,
    perm=((0, 1), (1, 0)),
    collective_id=0,
  )
  fut = Future((), None, None, spec)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always", asyncops.NeverAwaitedWarning)
    del fut
    gc.collect()
  msgs = [str(w.message) for w in caught]
  assert any("started at an unknown line" in m for m in msgs), msgs
  assert not any("started at None" in m for m in msgs), msgs
