"""``jax.vmap`` over every start/done, on 8 CPU devices.

A vmapped transfer is one transfer of the whole batch (its spec grows a
batch axis); its values must equal the vmapped ``jax.lax`` program for every
op, batch axis and emulation mode, also composed with ``jax.grad`` in both
orders. A batch axis moved while a buffer is in flight (``vmap`` of a loop
that carries a future) is refused. That the batch is one kernel on TPU is
checked in ``test_grad_tpu.py``.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import asyncops
from tests.test_grad import OPS, TRANSFERS, _assert_close, _data, _mesh

BATCH = 3


def _vmapped(op, in_axis, transfer):
  (ours, ref), exact = OPS[op]
  mesh = _mesh((2, 4), ("x", "y"))
  # The rows (the unbatched axis 0) are sharded over the devices.
  spec = P(None, ("x", "y")) if in_axis == 0 else P(("x", "y"))
  shape = [64, 128]
  shape.insert(in_axis, BATCH)
  x = jax.device_put(
    _data(0, tuple(shape), "float32"), jax.NamedSharding(mesh, spec)
  )

  def run(f):
    g = jax.vmap(functools.partial(f, a="y"), in_axes=in_axis, out_axes=0)
    out = P(None, ("x", "y"))
    return jax.jit(jax.shard_map(g, mesh=mesh, in_specs=spec, out_specs=out))

  want = run(ref)(x)
  with asyncops.emulation(transfer):
    got = run(ours)(x)
  _assert_close(got, want, exact)


@pytest.mark.parametrize("transfer", TRANSFERS)
@pytest.mark.parametrize("in_axis", [0, 1])
@pytest.mark.parametrize("op", sorted(OPS))
def test_every_op(op, in_axis, transfer):
  _vmapped(op, in_axis, transfer)


@pytest.mark.parametrize("order", ["vmap_of_grad", "grad_of_vmap"])
@pytest.mark.parametrize(
  "op", ["ppermute_ring", "bidirectional", "all_gather_tiled_1", "copy"]
)
def test_with_grad(op, order):
  (ours, ref), _ = OPS[op]
  mesh = _mesh((2, 4), ("x", "y"))
  spec = P(None, ("x", "y"))
  x = jax.device_put(
    _data(1, (BATCH, 64, 128), "float32"), jax.NamedSharding(mesh, spec)
  )

  def transform(f):
    f = functools.partial(f, a="y")
    if order == "vmap_of_grad":
      return jax.vmap(jax.grad(lambda x: jnp.sum(jnp.sin(f(x)))))
    return jax.grad(lambda x: jnp.sum(jnp.sin(jax.vmap(f)(x))))

  def run(f):
    return jax.jit(
      jax.shard_map(transform(f), mesh=mesh, in_specs=spec, out_specs=spec)
    )

  _assert_close(run(ours)(x), run(ref)(x), exact=True)


def test_batch_axis_moved_in_flight_is_refused():
  """vmap of a loop carrying an all-gather future: the loop would move the
  destination's batch axis (1) to 0 while the gather is in flight."""
  mesh = _mesh((8,), ("i",))

  def f(x):
    _, fut = asyncops.all_gather_start(x, "i")

    def body(i, c):
      fut, acc = c
      acc = acc + jnp.sum(asyncops.all_gather_done(fut), 0)
      _, fut = asyncops.all_gather_start(x, "i")
      return fut, acc

    # jax.lax's loop: scheduling.fori_loop settles every future at the
    # back edge, so none is in flight when the carries are batched.
    fut, acc = jax.lax.fori_loop(0, 2, body, (fut, jnp.zeros_like(x)))
    return acc + jnp.sum(asyncops.all_gather_done(fut), 0)

  g = jax.jit(
    jax.shard_map(
      jax.vmap(f), mesh=mesh, in_specs=P(None, "i"), out_specs=P(None, "i")
    )
  )
  x = jax.device_put(
    jnp.ones((BATCH, 16, 128)), jax.NamedSharding(mesh, P(None, "i"))
  )
  with pytest.raises(asyncops.FutureError, match="batch axis"):
    g(x)


def test_vmapped_values_one_transfer():
  """The jaxpr of a vmapped ppermute holds one start with the batch in its
  spec's shape, not one per batch element."""
  mesh = _mesh((8,), ("i",))

  def f(x):
    x1, fut = asyncops.ppermute_start(x, "i", shift=1)
    return asyncops.ppermute_done(fut)

  g = jax.shard_map(
    jax.vmap(f), mesh=mesh, in_specs=P(None, "i"), out_specs=P(None, "i")
  )
  x = jax.device_put(
    jnp.ones((BATCH, 16, 128)), jax.NamedSharding(mesh, P(None, "i"))
  )
  jaxpr = str(jax.make_jaxpr(g)(x))
  assert jaxpr.count("asyncops_start") == 1
  assert f"shape=({BATCH}, 2, 128)" in jaxpr
  np.testing.assert_array_equal(jax.jit(g)(x), jnp.ones((BATCH, 16, 128)))
