"""Raw Pallas start/done kernels and the seed design's patterns.

Each ``pattern_*`` function takes a topology name and returns
``(jitted, abstract_args)`` for :func:`asyncops.inspect.analyze`, so it is
also usable from the command line::

  python -m asyncops.inspect tests.util:pattern_staggered_unroll1
"""

import functools
import os
import pathlib
import subprocess
import sys
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import asyncops
from asyncops import _jax_compat as jc
from asyncops.inspect import analyze, tpu_mesh, tpu_topology

MESH_AXES = ("x", "y")
SHAPE = (1024, 1024)  # per device


def ppermute_start(x, axis_name="y", shift=1):
  """Starts a ring ppermute; returns (aliased x, future)."""

  def kernel(x_ref, aliased_x_ref, o_ref, send_sem, recv_sem):
    del aliased_x_ref
    n = jax.lax.axis_size(axis_name)
    me = jax.lax.axis_index(axis_name)
    dst = jax.lax.rem(me + shift + n, n)
    src = jax.lax.rem(me - shift + n, n)

    def dev(i):  # full mesh coordinates (0.10.2 pvary lowering bug)
      return tuple(
        i if a == axis_name else jax.lax.axis_index(a) for a in MESH_AXES
      )

    b = pltpu.get_barrier_semaphore()
    pl.semaphore_signal(
      b, device_id=dev(src), device_id_type=pl.DeviceIdType.MESH
    )
    pl.semaphore_wait(b, 1)
    pltpu.make_async_remote_copy(
      x_ref,
      o_ref,
      send_sem,
      recv_sem,
      device_id=dev(dst),
      device_id_type=pl.DeviceIdType.MESH,
    ).start()

  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  sem_spec = pl.BlockSpec(memory_space=pltpu.SEMAPHORE)
  x, out, s, r = pl.pallas_call(
    kernel,
    out_shape=(
      jc.shape_like(x),
      jc.shape_like(x),
      pltpu.SemaphoreType.DMA(()),
      pltpu.SemaphoreType.DMA(()),
    ),
    in_specs=[any_spec],
    out_specs=(any_spec, any_spec, sem_spec, sem_spec),
    input_output_aliases={0: 0},
    compiler_params=pltpu.CompilerParams(
      collective_id=0, has_side_effects=True
    ),
  )(x)
  return x, (s, r, x, out)


def ppermute_done(fut):
  """Waits on a future from :func:`ppermute_start`; returns the result."""
  s, r, x, out = fut

  def kernel(x_ref, o_ref, s, r, aliased_o_ref):
    del aliased_o_ref
    pltpu.make_async_copy(x_ref, x_ref, s).wait()
    pltpu.make_async_copy(o_ref, o_ref, r).wait()

  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  sem_spec = pl.BlockSpec(memory_space=pltpu.SEMAPHORE)
  return pl.pallas_call(
    kernel,
    out_shape=jc.shape_like(out),
    in_specs=[any_spec, any_spec, sem_spec, sem_spec],
    out_specs=any_spec,
    input_output_aliases={1: 0},
    compiler_params=pltpu.CompilerParams(has_side_effects=True),
  )(x, out, s, r)


def compute(x):
  """Some real work (a matmul) to overlap with the transfer."""
  return jnp.tanh(x) @ x


def use_pre_start_x(x):
  """Computes on the pre-start ``x`` (seed: 'Defensive copies')."""
  _, fut = ppermute_start(x)
  z = compute(x)
  return ppermute_done(fut), z


def use_aliased_x(x):
  """Computes on the start's aliased ``x`` (the seed's fix)."""
  x2, fut = ppermute_start(x)
  z = compute(x2)
  return ppermute_done(fut), z


def with_barriers(x):
  """Optimization barriers pin the compute inside the window."""
  x2, fut = ppermute_start(x)
  x2, fut = jax.lax.optimization_barrier((x2, fut))
  z = compute(x2)
  z, fut = jax.lax.optimization_barrier((z, fut))
  return ppermute_done(fut), z


def barrier_on_pre_start_x(x):
  """Barriers, but the compute reads the pre-start ``x`` (jax#25399)."""
  _, fut = ppermute_start(x)
  x, fut = jax.lax.optimization_barrier((x, fut))
  z = compute(x)
  z, fut = jax.lax.optimization_barrier((z, fut))
  return ppermute_done(fut), z


def loop(x, unroll=1):
  """fori_loop with start and done in the body (seed: 'Loop aliasing')."""

  def body(i, x):
    _, fut = ppermute_start(x)
    return ppermute_done(fut)

  return jax.lax.fori_loop(0, 8, body, x, unroll=unroll)


def staggered(x, unroll=1):
  """A future carried across iterations (seed: 'Passing futures...')."""
  _, fut = ppermute_start(x)

  def body(i, fut):
    y = ppermute_done(fut)
    _, fut = ppermute_start(y)
    return fut

  fut = jax.lax.fori_loop(0, 7, body, fut, unroll=unroll)
  return ppermute_done(fut)


def staggered_cond(x, n):
  """A carried future through ``lax.cond`` and a loop with traced bounds.

  What ``asyncops.scheduling.fori_loop`` did for traced bounds before it
  refused futures in the carry: peel an odd iteration under ``lax.cond``,
  then run pairs of iterations. XLA copies the branch's in-flight buffers
  into the conditional's result (issue 3 follow-up).
  """
  n = n[0, 0]

  def body(fut):
    y = asyncops.ppermute_done(fut)
    return asyncops.ppermute_start(y, "y", shift=1)[1]

  _, fut = asyncops.ppermute_start(x, "y", shift=1)
  fut = jax.lax.cond(n % 2 == 1, body, lambda f: f, fut)
  fut = jax.lax.fori_loop(0, n // 2, lambda i, f: body(body(f)), fut)
  return asyncops.ppermute_done(fut)


staggered_cond.takes_count = True


def build(f, topology="v5e:2x4", shape=SHAPE, dtype=jnp.float32):
  """Jits ``f`` under shard_map on a 2-D AOT TPU mesh of ``topology``.

  ``f(x)``, or ``f(x, n)`` with a traced per-device int32 ``n`` of shape
  ``(1, 1)`` when ``f.takes_count`` is set.
  """
  devices = len(tpu_topology(topology).devices)
  rows = 2 if devices == 8 else 1
  mesh = tpu_mesh(topology, (rows, devices // rows), MESH_AXES)
  spec = P("x", "y")
  args = (
    jax.ShapeDtypeStruct(
      (rows * shape[0], devices // rows * shape[1]),
      dtype,
      sharding=NamedSharding(mesh, spec),
    ),
  )
  if getattr(f, "takes_count", False):
    args += (
      jax.ShapeDtypeStruct(
        (rows, devices // rows), jnp.int32, sharding=NamedSharding(mesh, spec)
      ),
    )
  jitted = jax.jit(
    jax.shard_map(f, mesh=mesh, in_specs=(spec,) * len(args), out_specs=spec)
  )
  return jitted, args


def _pattern(f):
  return lambda topology="v5e:2x4": build(f, topology)


PATTERNS = {
  "pre_start_x": use_pre_start_x,
  "aliased_x": use_aliased_x,
  "barriers": with_barriers,
  "barrier_on_pre_start_x": barrier_on_pre_start_x,
  "loop_unroll1": functools.partial(loop, unroll=1),
  "loop_unroll2": functools.partial(loop, unroll=2),
  "staggered_unroll1": functools.partial(staggered, unroll=1),
  "staggered_unroll2": functools.partial(staggered, unroll=2),
  "staggered_cond": staggered_cond,
}
for _name, _f in PATTERNS.items():
  globals()[f"pattern_{_name}"] = _pattern(_f)


@functools.cache
def pattern_report(name, topology="v5e:2x4", **kw):
  """``analyze`` of pattern ``name`` compiled for ``topology`` (keywords of
  :func:`build`), once per process: the test files share the compiled
  program. Read the report, never change it."""
  jitted, args = build(PATTERNS[name], topology, **kw)
  return analyze(jitted, *args)


# Sharded programs on CPU and on AOT TPU meshes --------------------------------

# plan_*/explain_* keywords for a v5e at default precision.
V5E_PLAN = {"precision": "DEFAULT", "device_kind": "TPU v5 lite"}


def cpu_mesh(shape, names=MESH_AXES):
  """A mesh over the first ``prod(shape)`` CPU devices."""
  n = int(np.prod(shape))
  return jax.make_mesh(shape, names, devices=jax.devices()[:n])


def run_sharded(fn, mesh, in_specs, out_specs, *args, check_vma=True):
  """``jit(shard_map(fn))`` of ``args``, each placed by its ``in_specs``."""
  f = jax.jit(
    jax.shard_map(
      fn,
      mesh=mesh,
      in_specs=in_specs,
      out_specs=out_specs,
      check_vma=check_vma,
    )
  )
  placed = [
    jax.device_put(a, NamedSharding(mesh, s))
    for a, s in zip(args, in_specs, strict=True)
  ]
  return f(*placed)


def sharded_sds(mesh, shape, spec, dtype):
  """An abstract global array sharded by ``spec`` over ``mesh``."""
  return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def aot_sharded(topology, fn, shapes, in_specs, out_specs, dtype, mesh=(2, 4)):
  """``(jitted, abstract args)`` of ``shard_map(fn)`` on an AOT TPU mesh of
  ``topology`` with axes ``("x", "y")``, one argument per shape."""
  mesh = tpu_mesh(topology, mesh, MESH_AXES)
  jitted = jax.jit(
    jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
  )
  args = tuple(
    sharded_sds(mesh, s, p, dtype)
    for s, p in zip(shapes, in_specs, strict=True)
  )
  return jitted, args


# Collective matmul cases (tests/test_grad_* and test_jvp_collective_matmul) ---

# The rings: (api, bidirectional).
RINGS = [("value", False), ("value", True), ("ref", False), ("ref", True)]

# (per-device lhs, gather_dim, weight widths, return_gathered)
AG_FORMS = [
  ((8, 16), -1, (24,), False),  # contracting
  ((2, 4, 16), -1, (8, 16), True),  # batch dims, two weights, gathered
  ((8, 32), 0, (16,), False),  # rows (sequence parallel)
  ((2, 4, 32), 1, (8, 16), True),  # batch + rows, two weights, gathered
]

# (per-device lhs, scatter_dim, f)
RS_FORMS = [
  ((8, 16), -1, 32),  # columns
  ((2, 4, 16), -1, 16),  # batch dims
  ((16, 8), 0, 8),  # rows (sequence parallel)
  ((2, 8, 16), 1, 8),  # batch + rows
]


class RingCase(NamedTuple):
  """A ring program over mesh axis ``"y"`` and its ``jax.lax`` reference:
  per-device functions of the global arguments ``shapes`` placed by
  ``specs``; ``fan_in`` is the contraction length (for tolerances)."""

  ours: Callable
  ref: Callable
  shapes: list
  specs: tuple
  fan_in: int


def axis_spec(rank, dim, axis="y"):
  """A ``PartitionSpec`` of ``rank`` sharding dimension ``dim`` on ``axis``."""
  return P(*[(axis if i == dim else None) for i in range(rank)])


def allgather_ring_case(local, dim, fs, gathered, api, bidi, n=4):
  """``allgather_matmul(method="ring")`` of form ``AG_FORMS``' ``(local,
  dim, fs, gathered)`` over ``n`` devices along ``"y"``."""
  rank = len(local)
  d = dim % rank
  k = local[-1] * (n if d == rank - 1 else 1)
  glob = tuple(s * n if i == d else s for i, s in enumerate(local))
  shapes = [glob] + [(k, f) for f in fs]
  specs = (axis_spec(rank, d),) + (P(),) * len(fs)

  def ours(x, *ws):
    return asyncops.collective_matmul.allgather_matmul(
      x,
      ws if len(ws) > 1 else ws[0],
      "y",
      gather_dim=dim,
      return_gathered=gathered,
      api=api,
      bidirectional=bidi,
      method="ring",
    )

  def ref(x, *ws):
    g = jax.lax.all_gather(x, "y", axis=d, tiled=True)
    outs = tuple(g @ w for w in ws)
    result = outs if len(ws) > 1 else outs[0]
    return (result, g) if gathered else result

  return RingCase(ours, ref, shapes, specs, k)


def reducescatter_ring_case(local, dim, f, api, bidi, n=4):
  """``matmul_reducescatter(method="ring")`` of form ``RS_FORMS``' ``(local,
  dim, f)``; the lhs is sharded over ``"y"`` along its contracting
  dimension (``local[-1]`` per device)."""
  rank = len(local)
  d = dim % rank
  k = local[-1]
  shapes = [local[:-1] + (k * n,), (k * n, f)]
  specs = (axis_spec(rank, rank - 1), P("y", None))

  def ours(x, w):
    return asyncops.collective_matmul.matmul_reducescatter(
      x, w, "y", scatter_dim=dim, api=api, bidirectional=bidi, method="ring"
    )

  def ref(x, w):
    return jax.lax.psum_scatter(x @ w, "y", scatter_dimension=d, tiled=True)

  return RingCase(ours, ref, shapes, specs, k)


def normal(shape, dtype, seed, scale=1.0):
  """Standard normal data (drawn in float32) times ``scale``, in ``dtype``."""
  x = jax.random.normal(jax.random.key(seed), shape, jnp.float32) * scale
  return x.astype(dtype)


def ring_args(shapes, dtype):
  """A case's arguments: the lhs of order one, weights scaled by
  ``1/sqrt(fan-in)`` (outputs of order one)."""
  return [
    normal(s, dtype, k, 1.0 if k == 0 else 1.0 / np.sqrt(s[0]))
    for k, s in enumerate(shapes)
  ]


def assert_close_ring(got, want, dtype, fan_in):
  """Leaf by leaf, ``got`` equals ``want`` (same shapes and dtypes): to
  float32 rounding, or for bfloat16 within products of ``fan_in`` terms
  rounded in other orders."""
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert g.shape == w.shape and g.dtype == w.dtype
    g = np.asarray(g, np.float64)
    w = np.asarray(w, np.float64)
    scale = float(np.max(np.abs(w))) or 1.0
    if dtype == "float32":
      np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5 * scale)
    else:  # bf16 products, rounded in other orders
      tol = 2e-2 * np.sqrt(fan_in) * scale / 4
      np.testing.assert_allclose(g, w, rtol=3e-2, atol=tol)


def allreduce_ring_case(api, bidi):
  """``matmul_allreduce(method="ring")`` of ``x [2, 4, 64]`` sharded along
  its contracting dimension; f = 30 does not divide by 4: padded columns
  (which get no gradient)."""

  def ours(x, w):
    return asyncops.collective_matmul.matmul_allreduce(
      x, w, "y", api=api, bidirectional=bidi, method="ring"
    )

  def ref(x, w):
    return jax.lax.psum(x @ w, "y")

  shapes = [(2, 4, 64), (64, 30)]
  return RingCase(ours, ref, shapes, (P(None, None, "y"), P("y")), 16)


def mlp_ref(x, w_in, w_out, w_gate=None, *, dim=-1, act=jax.nn.gelu):
  """``mlp_block``'s ``jax.lax`` program over mesh axis ``"y"``."""
  d = dim % x.ndim
  g = jax.lax.all_gather(x, "y", axis=d, tiled=True)
  h = act(g @ w_in) if w_gate is None else act(g @ w_gate) * (g @ w_in)
  return jax.lax.psum_scatter(h @ w_out, "y", scatter_dimension=d, tiled=True)


def mlp_ring_case(sp, gated, api, bidi, n=4):
  """``mlp_block(method="ring")``: sequence parallel (``sp``, x ``[b, s/n,
  d]``) or not (x ``[m, d/n]``, data over ``"x"`` too), gated (silu) or
  not (gelu)."""
  d, f = 64, 64
  if sp:
    glob, xspec, dim = (2, 8 * n, d), P(None, "y", None), 1
  else:
    glob, xspec, dim = (8, d), P("x", "y"), -1
  shapes = [glob, (d, f), (f, d)] + ([(d, f)] if gated else [])
  specs = (xspec, P(None, "y"), P("y", None)) + (
    (P(None, "y"),) if gated else ()
  )
  act = jax.nn.silu if gated else jax.nn.gelu

  def ours(x, w_in, w_out, *g):
    return asyncops.collective_matmul.mlp_block(
      x,
      w_in,
      w_out,
      "y",
      w_gate=g[0] if g else None,
      activation=act,
      sequence_parallel=sp,
      sequence_dim=dim,
      api=api,
      bidirectional=bidi,
      method="ring",
    )

  def ref(x, w_in, w_out, *g):
    return mlp_ref(x, w_in, w_out, *g, dim=dim, act=act)

  return RingCase(ours, ref, shapes, specs, d)


def mlp_loss(mesh):
  """``sum(sin(mlp_block(x, w_in, w_out, "y", method="ring")))`` over the
  whole ``mesh`` (``("x", "y")``) as a ``shard_map``, and its arguments
  (ones: ``x [8, 64]`` over both axes, the weights ``[64, 64]`` over
  ``"y"``)."""
  specs = (P("x", "y"), P(None, "y"), P("y", None))

  def loss(x, w_in, w_out):
    y = asyncops.collective_matmul.mlp_block(x, w_in, w_out, "y", method="ring")
    return jax.lax.psum(jnp.sum(jnp.sin(y)), ("x", "y"))

  f = jax.shard_map(loss, mesh=mesh, in_specs=specs, out_specs=P())
  args = tuple(
    jax.device_put(jnp.ones(s), NamedSharding(mesh, p))
    for p, s in zip(specs, [(8, 64), (64, 64), (64, 64)], strict=True)
  )
  return f, args


def marker_line(path, marker: str) -> int:
  """The 1-based line of the file at ``path`` that ends in ``# marker``
  (the user's line a guard error must name)."""
  import pathlib  # noqa: PLC0415

  for n, text in enumerate(pathlib.Path(path).read_text().splitlines()):
    if text.rstrip().endswith(f"# {marker}"):
      return n + 1
  raise AssertionError(marker)


@functools.cache
def ring_mesh(topology):
  """A 1-D mesh ``i`` over the 8 devices of ``topology``."""
  return tpu_mesh(topology, (8,), ("i",))


def ring_program(fn, topology, shard):
  """``(jitted shard_map of fn over ring_mesh, its float32 argument)``,
  each device holding a ``shard`` of rows."""
  mesh = ring_mesh(topology)
  x = jax.ShapeDtypeStruct(
    (8 * shard[0], shard[1]), jnp.float32, sharding=NamedSharding(mesh, P("i"))
  )
  f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("i"), out_specs=P("i")))
  return f, x


# A Ref future awaited in lax.cond branches that close over it, with the
# window's compute reading the source Ref (design/inspect.md, "Overlap of a
# captured Ref future": what is tied). Each maps a case to whether the
# branches' done ties the start's frame (jax >= 0.10).
CAPTURED_READS = {
  "other slot": True,
  "other slot, traced": True,
  "in-flight slot": False,
  "in-flight slot, traced": False,
  "outer Ref, other value": True,
  "outer Ref, source value": False,
  "outer Ref, other slot": True,
  "outer Ref, in-flight slot": False,
  "outer Ref as jit argument": False,
  "outer Ref, loop carry": False,
}


# A Ref future awaited at top level (no cond) whose window's compute reads
# only a Ref read (design/inspect.md, "Top-level windows of Ref reads
# (h-topread)"). Each maps a case to whether the read is tied, so the
# compute stays in the window: another Ref made here; not the source (its
# buffer is in flight), nor another slot of it (in the window untied).
TOP_READS = {
  "other Ref": True,
  "other Ref of the source's value": True,
  "other slot": False,
  "other slot, traced": False,
  "in-flight slot": False,
  "in-flight slot, traced": False,
  "source": False,
}


def top_reads(case: str, axis: str):
  """``body(x) -> (rolled source + z)`` for a ``TOP_READS`` case: a
  ``ppermute_start``, ``z = tanh(y) @ y`` for ``y`` a Ref read, the done,
  all at top level. The source is ``a = new_ref(2x)`` (``y`` the read of
  ``c = new_ref(3x)``, or of ``c = new_ref(a[...])`` for "the source's
  value", or of ``a`` for "source") or slot ``k`` (0, or
  traced: the device's parity) of ``s = new_ref(stack([2x, 3x]))``.
  """
  from asyncops import stateful

  def body(x):
    b = jax.new_ref(jnp.zeros_like(x))
    if "slot" in case:
      s = jax.new_ref(jnp.stack([x * 2.0, x * 3.0]))
      k = jax.lax.axis_index(axis) % 2 if "traced" in case else 0
      src, read = s.at[k], (lambda: s[k if "in-flight" in case else 1 - k])
    else:
      a = jax.new_ref(x * 2.0)
      c = jax.new_ref(a[...] if "value" in case else x * 3.0)
      src, read = a, (lambda: (a if case == "source" else c)[...])
    f = stateful.ppermute_start(src, b, axis, shift=1)
    y = read()
    z = jnp.tanh(y) @ y
    stateful.ppermute_done(f, src, b)
    return b[...] + z

  return body


def captured_reads(case: str, axis: str):
  """``body(x) -> (rolled source + z)`` for a ``CAPTURED_READS`` case.

  The source is ``a`` (made of ``x``) or slot ``k`` (0, or traced: the
  device's parity) of ``s = new_ref(stack([2x, 3x]))``; ``z = tanh(y) @ y``
  for ``y`` the value the case reads, between the start and a done in both
  branches of a ``lax.cond``. "outer Ref": the Refs (and ``x``) are made
  outside a nested ``jax.jit`` that closes over them and starts, computes
  and awaits; "as jit argument" passes them in; "loop carry": a
  ``lax.scan`` body closes over the Refs and computes on its carry, which
  starts as ``x`` and passes through.
  """
  from asyncops import stateful

  def window(src, dst, y):
    f = stateful.ppermute_start(src, dst, axis, shift=1)
    z = jnp.tanh(y()) @ y()
    i = jax.lax.axis_index(axis)
    done = lambda: stateful.ppermute_done(f, src, dst)  # noqa: E731
    jax.lax.cond(i == 0, done, done)
    return z

  def body(x):
    b = jax.new_ref(jnp.zeros_like(x))
    if "slot" in case:
      s = jax.new_ref(jnp.stack([x * 2.0, x * 3.0]))
      k = jax.lax.axis_index(axis) % 2 if "traced" in case else 0
      read = k if "in-flight" in case else 1 - k
      run = lambda: window(s.at[k], b, lambda: s[read])  # noqa: E731
    else:
      a = jax.new_ref(x if "source" in case or "jit" in case else x * 2.0)
      if "loop" in case:
        a = jax.new_ref(x)
      run = lambda: window(a, b, lambda: x)  # noqa: E731
    if case.startswith("outer Ref,") and "loop" not in case:
      z = jax.jit(run)()
    elif "jit argument" in case:
      z = jax.jit(lambda a, b, x: window(a, b, lambda: x))(a, b, x)
    elif "loop" in case:

      def step(c, _):
        return c, window(a, b, lambda: c)

      _, zs = jax.lax.scan(step, x, None, 2)
      z = zs[0]
    else:
      z = run()
    return b[...] + z

  return body


def count_ties(jaxpr) -> int:
  """How many ``asyncops_tie`` equations ``jaxpr`` holds, nested jaxprs
  (``pjit``, ``shard_map``, checkpoint, custom rules) included."""
  n = 0
  for e in jaxpr.eqns:
    n += e.primitive.name == "asyncops_tie"
    for p in jax.tree_util.tree_leaves(e.params):
      sub = getattr(p, "jaxpr", p)
      if hasattr(sub, "eqns"):
        n += count_ties(sub)
  return n


def allgather_jit(mesh, **kw):
  """``jax.jit`` of ``allgather_matmul(x, w, "y", **kw)`` in ``shard_map``
  over the benchmark's ring layout (``x`` rows over ``"x"``, its
  contracting columns and ``w``'s output columns over ``"y"``)."""
  from asyncops.collective_matmul import allgather_matmul

  return jax.jit(
    jax.shard_map(
      functools.partial(allgather_matmul, axis_name="y", **kw),
      mesh=mesh,
      in_specs=(P("x", "y"), P(None, "y")),
      out_specs=P("x", "y"),
    )
  )


# A small run of ``benchmarks.run`` (compiled in a second or two), shared
# by the command-line tests.
BENCH_SMALL = [
  "--topology",
  "v5e:2x4",
  "--shape",
  "64,256,512",
  "--families",
  "allgather",
  "--variants",
  "allgather_matmul",
  "--no-llama",
]


ROOT = pathlib.Path(__file__).resolve().parent.parent


def run_python(*args, cwd=ROOT, env=None):
  """``python *args`` in a subprocess (CPU JAX, quiet), as a user runs a
  command line; the completed process, output captured as text."""
  e = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")
  e.update(env or {})
  return subprocess.run(
    [sys.executable, *args],
    cwd=cwd,
    env=e,
    capture_output=True,
    text=True,
    timeout=600,
  )


def chapter_ag_plan(device_kind, n=4, **kw):
  """The fused all-gather's plan at the chapter's shard (per device ``x``
  [512, 512], ``w`` [n 512, 2048], bf16, both ring directions) on
  ``device_kind``; ``kw`` as ``plan_allgather`` takes them (``forward``,
  ``quantized``, ...)."""
  from asyncops.collective_matmul import _fused

  return _fused.plan_allgather(
    512,
    512,
    2048,
    n,
    jnp.bfloat16,
    jnp.bfloat16,
    jnp.bfloat16,
    directions=2,
    precision="DEFAULT",
    device_kind=device_kind,
    **kw,
  )
