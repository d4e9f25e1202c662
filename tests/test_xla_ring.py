"""XLA's flagged all-gather matmul decompositions emitted with ``jax.lax``
(``collective_matmul._xla_ring``): numerics, gradient and vmap on CPU;
the compiled TPU HLO (v5e and v5p): asynchronous collective-permutes,
each with a dot in its window, no copies."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from asyncops.collective_matmul import _xla_ring
from asyncops.inspect import analyze
from tests import util as u

IN_SPECS = (P(None, "y"), P(None, "y"))


def _ring(n, directions, acc="float32"):
  def fn(x, w):
    return _xla_ring.allgather(x, w, "y", n, directions=directions, acc=acc)

  return fn


def _case(n, m, k, f, dtype):
  x = u.normal((m, n * k), dtype, 0)
  w = u.normal((n * k, n * f), dtype, 1, 1 / np.sqrt(n * k))
  return x, w


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int8])
@pytest.mark.parametrize("directions", [1, 2])
@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("mkf", [(8, 16, 24), (6, 32, 8)])
def test_numerics(n, directions, dtype, mkf):
  """Equals ``x @ w`` (float32: to rounding; bfloat16: the library's ring
  tolerance; int8: exactly, in int32 then wrapped to int8 as the rings)."""
  m, k, f = mkf
  mesh = u.cpu_mesh((1, n))
  if dtype == jnp.int8:
    x = jax.random.randint(jax.random.key(0), (m, n * k), -3, 4, jnp.int8)
    w = jax.random.randint(jax.random.key(1), (n * k, n * f), -3, 4, jnp.int8)
  else:
    x, w = _case(n, m, k, f, dtype)
  got = u.run_sharded(_ring(n, directions), mesh, IN_SPECS, P(None, "y"), x, w)
  want = jnp.dot(x, w, preferred_element_type=jnp.float32)
  if dtype == jnp.int8:
    want = jnp.dot(x, w, preferred_element_type=jnp.int32).astype(jnp.int8)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    return
  u.assert_close_ring(got, want.astype(dtype), jnp.dtype(dtype).name, n * k)


def test_output_accumulator_is_xla_numerics():
  """``acc="output"`` rounds at every step (XLA's flagged programs): within
  the bfloat16 tolerance at n = 8, but further from the float32 product
  than the library's float32 accumulator."""
  n, m, k, f = 8, 16, 64, 16
  mesh = u.cpu_mesh((1, n))
  x, w = _case(n, m, k, f, jnp.bfloat16)
  exact = np.asarray(jnp.dot(x, w, preferred_element_type=jnp.float32))
  errs = {}
  for acc in ("float32", "output"):
    fn = _ring(n, 1, acc)
    got = u.run_sharded(fn, mesh, IN_SPECS, P(None, "y"), x, w)
    u.assert_close_ring(got, exact.astype(jnp.bfloat16), "bfloat16", n * k)
    errs[acc] = float(np.max(np.abs(np.asarray(got, np.float64) - exact)))
  assert errs["float32"] < errs["output"], errs


def test_bad_arguments():
  mesh = u.cpu_mesh((1, 4))
  x, w = _case(4, 3, 8, 8, jnp.float32)
  with pytest.raises(ValueError, match="odd number"):
    u.run_sharded(_ring(4, 2), mesh, IN_SPECS, P(None, "y"), x, w)
  with pytest.raises(ValueError, match="directions must be 1 or 2"):
    u.run_sharded(_ring(4, 3), mesh, IN_SPECS, P(None, "y"), x, w)


@pytest.mark.parametrize("directions", [1, 2])
@pytest.mark.parametrize("n", [4, 8])
def test_gradient_matches_jnp(n, directions):
  """``jax.grad`` through the ring (``ppermute``'s transpose) equals the
  gradient of ``x @ w``."""
  mesh = u.cpu_mesh((1, n))
  x, w = _case(n, 8, 16, 8, jnp.float32)
  f = jax.jit(
    jax.shard_map(
      _ring(n, directions), mesh=mesh, in_specs=IN_SPECS, out_specs=P(None, "y")
    )
  )

  def loss(fn, x, w):
    return jnp.sum(jnp.sin(fn(x, w)))

  want = jax.grad(functools.partial(loss, jnp.dot), (0, 1))(x, w)
  with jax.set_mesh(mesh):
    xs, ws = (
      jax.device_put(a, NamedSharding(mesh, s))
      for a, s in zip((x, w), IN_SPECS, strict=True)
    )
    got = jax.grad(functools.partial(loss, f), (0, 1))(xs, ws)
  for g, r in zip(got, want, strict=True):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), 2e-4, 2e-4)


@pytest.mark.parametrize("directions", [1, 2])
def test_vmap(directions):
  """A batch of ``x`` over the same ``w``: each equals its ``x @ w``."""
  n = 4
  mesh = u.cpu_mesh((1, n))
  x, w = _case(n, 8, 16, 8, jnp.float32)
  xs = jnp.stack([x, 2 * x, -x])
  fn = jax.vmap(_ring(n, directions), in_axes=(0, None))
  got = u.run_sharded(
    fn, mesh, (P(None, None, "y"), P(None, "y")), P(None, None, "y"), xs, w
  )
  np.testing.assert_allclose(
    np.asarray(got), np.asarray(jnp.einsum("bmk,kf->bmf", xs, w)), 2e-5, 2e-5
  )


# TPU HLO (ahead of time) ---------------------------------------------------


def _permute_pairs(report):
  return [
    p
    for p in report.pairs
    if report.module.instr(p.start).opcode == "collective-permute-start"
  ]


@pytest.mark.parametrize("topology", ["v5e:2x4", "v5p:2x2x2"])
@pytest.mark.parametrize("directions", [1, 2])
def test_tpu_permutes_overlap_dots(topology, directions):
  """At the Llama-3-70B shard, tp 8, M = 1024 (per device x [1024, 1024],
  w [8192, 3584]): every transfer is an asynchronous collective-permute
  with a dot (a convolution fusion) scheduled in its window, and no
  copies. One-way: 7 permutes; two-way: 2 per step for 3 steps and the
  antipode's two halves."""
  n = 8
  jitted, args = u.aot_sharded(
    topology,
    _ring(n, directions),
    ((1024, 8192), (8192, 28672)),
    IN_SPECS,
    P(None, "y"),
    jnp.bfloat16,
    mesh=(1, 8),
  )
  report = analyze(jitted, *args)
  report.assert_no_defensive_copies()
  pairs = _permute_pairs(report)
  assert len(pairs) == (n - 1 if directions == 1 else n), len(pairs)
  dots = 0
  for p in pairs:
    assert not p.crossing and p.overlapped, p
    conv = [
      i
      for i in p.between
      if i.opcode in ("fusion", "convolution") and "dot_general" in i.op_name
    ]
    dots += bool(conv)
  # Every window holds compute; all but one (one-way) or one step's two
  # (two-way: XLA may run the stacking of the first pair's rows of w under
  # the first transfers, the local dot under the next) hold a dot.
  assert dots >= len(pairs) - directions, (dots, len(pairs))
