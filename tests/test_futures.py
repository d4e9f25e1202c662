"""Futures as pytrees: loop carries, jit, shard_map, and their numerics.

Every program is checked against a ``jax.lax.ppermute`` reference, in both
emulation transfer points, and with :func:`asyncops.futures.check_futures`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import asyncops
from asyncops.futures import check_futures
from asyncops.testing import cpu_mesh

MODES = ("start", "done")
N = 8


def _mesh():
  return cpu_mesh((N,), ("i",))


def _run(body, mode, x):
  mesh = _mesh()

  def traced(x):
    with asyncops.emulation(mode):
      return body(x)

  f = jax.jit(
    jax.shard_map(traced, mesh=mesh, in_specs=P("i"), out_specs=P("i"))
  )
  check_futures(f, x)
  return f(x)


def _x(shape=(N * 2, 128)):
  x = jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape)
  return jax.device_put(x, NamedSharding(_mesh(), P("i")))


def _ring_ref(x, steps, shift=1):
  def body(i, x):
    return jax.lax.ppermute(x, "i", [(j, (j + shift) % N) for j in range(N)])

  return jax.lax.fori_loop(0, steps, body, x)


def _ref(body, x):
  mesh = _mesh()
  return jax.jit(
    jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i"))
  )(x)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("unroll", [1, 2])
def test_ring_loop_fori(mode, unroll):
  def body(x):
    def step(i, x):
      x, fut = asyncops.ppermute_start(x, "i", shift=1)
      return asyncops.ppermute_done(fut)

    return jax.lax.fori_loop(0, 5, step, x, unroll=unroll)

  x = _x()
  np.testing.assert_array_equal(
    _run(body, mode, x), _ref(lambda x: _ring_ref(x, 5), x)
  )


def _staggered(loop):
  """The seed design's staggered loop: the future is the carry."""

  def body(x):
    x, fut = asyncops.ppermute_start(x, "i", shift=1)

    def step(fut):
      y = asyncops.ppermute_done(fut)
      _, fut = asyncops.ppermute_start(y * 2, "i", shift=1)
      return fut

    fut = loop(step, fut)
    return asyncops.ppermute_done(fut)

  return body


def _loop_fori(step, fut):
  return jax.lax.fori_loop(0, 6, lambda i, f: step(f), fut)


def _loop_scan(step, fut):
  return jax.lax.scan(lambda f, _: (step(f), None), fut, length=6)[0]


def _loop_while(step, fut):
  def body(c):
    i, f = c
    return i + 1, step(f)

  return jax.lax.while_loop(lambda c: c[0] < 6, body, (0, fut))[1]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
  "loop", [_loop_fori, _loop_scan, _loop_while], ids=["fori", "scan", "while"]
)
def test_staggered_loop(loop, mode):
  def ref(x):
    x = jax.lax.ppermute(x, "i", [(j, (j + 1) % N) for j in range(N)])
    for _ in range(6):
      x = jax.lax.ppermute(x * 2, "i", [(j, (j + 1) % N) for j in range(N)])
    return x

  x = _x()
  np.testing.assert_array_equal(_run(_staggered(loop), mode, x), _ref(ref, x))


@pytest.mark.parametrize("mode", MODES)
def test_accumulating_ring(mode):
  """Overlap: accumulate the buffer in hand while the next one travels."""

  def body(x):
    x, fut = asyncops.ppermute_start(x, "i", shift=1)

    def step(i, c):
      acc, x, fut = c
      acc = acc + jnp.sin(x)  # compute on the in-hand buffer
      y = asyncops.ppermute_done(fut)
      y, fut = asyncops.ppermute_start(y, "i", shift=1)
      return acc, y, fut

    acc, x, fut = jax.lax.fori_loop(0, N - 1, step, (jnp.zeros_like(x), x, fut))
    return acc + jnp.sin(x) + 0 * asyncops.ppermute_done(fut)

  def ref(x):
    acc = jnp.zeros_like(x)
    for _ in range(N):
      acc = acc + jnp.sin(x)
      x = jax.lax.ppermute(x, "i", [(j, (j + 1) % N) for j in range(N)])
    return acc

  x = _x()
  np.testing.assert_allclose(_run(body, mode, x), _ref(ref, x), rtol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_future_through_jit_boundaries(mode):
  """A future returned by an inner jit and awaited by another."""

  @jax.jit
  def start(x):
    return asyncops.ppermute_start(x, "i", perm=[(0, 3), (3, 0), (5, 6)])

  @jax.jit
  def finish(fut):
    return asyncops.ppermute_done(fut)

  def body(x):
    x, fut = start(x)
    return finish(fut) + x

  def ref(x):
    return jax.lax.ppermute(x, "i", [(0, 3), (3, 0), (5, 6)]) + x

  x = _x()
  np.testing.assert_array_equal(_run(body, mode, x), _ref(ref, x))


@pytest.mark.parametrize("mode", MODES)
def test_future_through_cond(mode):
  def body(x):
    x, fut = asyncops.ppermute_start(x, "i", shift=-3)
    pred = jax.lax.axis_index("i") % 2 == 0
    return jax.lax.cond(
      pred,
      lambda f: asyncops.ppermute_done(f) * 2,
      lambda f: asyncops.ppermute_done(f) - 1,
      fut,
    )

  def ref(x):
    y = jax.lax.ppermute(x, "i", [(j, (j - 3) % N) for j in range(N)])
    return jnp.where(jax.lax.axis_index("i") % 2 == 0, y * 2, y - 1)

  x = _x()
  np.testing.assert_array_equal(_run(body, mode, x), _ref(ref, x))


# Pytree behaviour ------------------------------------------------------------


def _abstract(shape, dtype):
  return jax.ShapeDtypeStruct(
    shape, dtype, sharding=NamedSharding(_mesh(), P("i"))
  )


def _traced_future(fn):
  """Runs ``fn(fut)`` on a future traced inside shard_map; returns fn's."""
  out = []

  def body(x):
    x, fut = asyncops.ppermute_start(x, "i", shift=1)
    out.append(fn(fut))
    return asyncops.ppermute_done(fut)

  mesh = _mesh()
  jax.eval_shape(
    jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i")),
    _abstract((N * 2, 4), jnp.bfloat16),
  )
  return out[0]


def test_flatten_children_and_static_parts():
  def fn(fut):
    leaves, treedef = jax.tree.flatten(fut)
    return fut.spec, leaves, treedef, fut

  spec, leaves, treedef, fut = _traced_future(fn)
  # Children: two semaphores, the aliased source, the destination.
  assert len(leaves) == 4
  assert [jnp.dtype(v.dtype) for v in leaves[:2]] == [jnp.int32] * 2
  assert [v.shape for v in leaves[:2]] == [(), ()]
  assert [v.shape for v in leaves[2:]] == [(2, 4)] * 2
  assert [jnp.dtype(v.dtype) for v in leaves[2:]] == [jnp.bfloat16] * 2
  # Static part: the spec and the state.
  assert spec.kind == "ppermute" and spec.perm == tuple(
    (j, (j + 1) % N) for j in range(N)
  )
  rebuilt = jax.tree.unflatten(treedef, leaves)
  assert isinstance(rebuilt, asyncops.Future)
  assert rebuilt.spec == fut.spec and rebuilt.state == "inflight"
  assert jax.tree.structure(rebuilt) == treedef


def test_treedef_equal_across_loop_iterations():
  seen = []

  def body(x):
    x, fut = asyncops.ppermute_start(x, "i", shift=1)
    seen.append(jax.tree.structure(fut))

    def step(i, fut):
      seen.append(jax.tree.structure(fut))
      _, fut = asyncops.ppermute_start(
        asyncops.ppermute_done(fut), "i", shift=1
      )
      seen.append(jax.tree.structure(fut))
      return fut

    return asyncops.ppermute_done(jax.lax.fori_loop(0, 3, step, fut))

  mesh = _mesh()
  jax.eval_shape(
    jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i")),
    _abstract((N, 4), jnp.float32),
  )
  assert len(seen) >= 3
  assert all(t == seen[0] for t in seen)


def test_treedef_differs_for_other_state_or_perm():
  seen = []

  def body(x):
    x, fut = asyncops.ppermute_start(x, "i", shift=1)
    x2, fut2 = asyncops.ppermute_start(x, "i", shift=2)
    seen.append(jax.tree.structure(fut))
    seen.append(jax.tree.structure(fut2))
    _, fut = asyncops.send_done(fut)
    seen.append(jax.tree.structure(fut))
    return asyncops.recv_done(fut) + asyncops.ppermute_done(fut2)

  jax.eval_shape(
    jax.shard_map(body, mesh=_mesh(), in_specs=P("i"), out_specs=P("i")),
    _abstract((N, 4), jnp.float32),
  )
  inflight, other_perm, sent = seen
  assert inflight != other_perm
  assert inflight != sent


def test_loop_rejects_future_with_changed_perm():
  def body(x):
    x, fut = asyncops.ppermute_start(x, "i", shift=1)

    def step(i, fut):
      _, fut = asyncops.ppermute_start(
        asyncops.ppermute_done(fut), "i", shift=2
      )
      return fut

    return asyncops.ppermute_done(jax.lax.fori_loop(0, 3, step, fut))

  mesh = _mesh()
  with pytest.raises(TypeError, match="carry"):
    jax.eval_shape(
      jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i")),
      _abstract((N, 4), jnp.float32),
    )
