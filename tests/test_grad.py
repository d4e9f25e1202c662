"""Gradients, JVPs and linearizations through every start/done, on CPU.

Every value-API op and every Ref-API op is differentiated inside
``shard_map`` on 8 CPU devices, in both emulation modes, and compared with
the same program written with ``jax.lax`` collectives: ``jax.vjp`` with a
random cotangent, ``jax.jvp`` and ``jax.linearize`` with a random tangent.
Permutes and copies must match bit for bit; the all-gather's transpose sums
``n`` slots (in another order than XLA's reduce-scatter), so it matches to
rounding. Loops that carry futures (``scheduling.fori_loop``,
``staggered``), ``jax.checkpoint``, eager ``jax.grad`` and second order are
covered too. The structure of the backward (the reverse transfer started
before the backward compute and awaited after it) is asserted on the
jaxpr here and on the compiled TPU HLO in ``test_grad_tpu.py``.
"""

import functools

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import asyncops
from asyncops import _jax_compat as jc
from asyncops import stateful
from asyncops.scheduling import fori_loop, staggered

TRANSFERS = ("start", "done")
MESHES = {
  "8-i": ((8,), ("i",), "i"),
  "2x4-x": ((2, 4), ("x", "y"), "x"),
  "2x4-y": ((2, 4), ("x", "y"), "y"),
}


@functools.cache
def _mesh(shape, names):
  return jax.make_mesh(shape, names)


def _ring(n, k):
  return [(i, (i + k) % n) for i in range(n)]


def _partial(n):
  """Device 0 sends to the last, the last to 1 (if distinct): some devices
  receive nothing, some send nothing."""
  return [(0, n - 1)] if n == 2 else [(0, n - 1), (n - 1, 1)]


def _window(start, done, x):
  """``done(start(x)) * tanh(x)`` with the tanh inside the window."""
  x1, fut = start(x)
  z, fut = asyncops.overlap(fut, jnp.tanh, x1)
  return done(fut) * z


# Each op: (ours(x, axis), ref(x, axis)), both x -> y per device. ---------


def _pp(perm_of):
  def ours(x, a):
    perm = perm_of(jax.lax.axis_size(a))
    return _window(
      lambda x: asyncops.ppermute_start(x, a, perm),
      asyncops.ppermute_done,
      x,
    )

  def ref(x, a):
    return jax.lax.ppermute(x, a, perm_of(jax.lax.axis_size(a))) * jnp.tanh(x)

  return ours, ref


def _bidirectional():
  def ours(x, a):
    return _window(
      lambda x: asyncops.bidirectional_start(x, a),
      asyncops.bidirectional_done,
      x,
    )

  def ref(x, a):
    n, h = jax.lax.axis_size(a), x.shape[0] // 2
    y = jnp.concatenate(
      [
        jax.lax.ppermute(x[:h], a, _ring(n, 1)),
        jax.lax.ppermute(x[h:], a, _ring(n, -1)),
      ]
    )
    return y * jnp.tanh(x)

  return ours, ref


def _all_gather(axis, tiled):
  def ours(x, a):
    x1, fut = asyncops.all_gather_start(x, a, axis=axis, tiled=tiled)
    z, fut = asyncops.overlap(fut, jnp.tanh, x1)
    y = asyncops.all_gather_done(fut)
    return y * jnp.sum(z)

  def ref(x, a):
    y = jax.lax.all_gather(x, a, axis=axis, tiled=tiled)
    return y * jnp.sum(jnp.tanh(x))

  return ours, ref


def _copy():
  def ours(x, a):
    del a
    return _window(asyncops.copy_start, asyncops.copy_done, x)

  def ref(x, a):
    del a
    return x * jnp.tanh(x)

  return ours, ref


def _split_waits():
  def ours(x, a):
    n = jax.lax.axis_size(a)
    x1, fut = asyncops.ppermute_start(x, a, _ring(n, 1))
    x1, fut = asyncops.send_done(fut)
    return asyncops.recv_done(fut) * jnp.tanh(x1)

  def ref(x, a):
    n = jax.lax.axis_size(a)
    return jax.lax.ppermute(x, a, _ring(n, 1)) * jnp.tanh(x)

  return ours, ref


OPS = {
  "ppermute_ring": (_pp(lambda n: _ring(n, 1)), True),
  "ppermute_back": (_pp(lambda n: _ring(n, -1)), True),
  "ppermute_partial": (_pp(_partial), True),
  "bidirectional": (_bidirectional(), True),
  "all_gather_stacked": (_all_gather(0, False), False),
  "all_gather_tiled_1": (_all_gather(1, True), False),
  "all_gather_stacked_2": (_all_gather(2, False), False),
  "copy": (_copy(), True),
  "send_recv": (_split_waits(), True),
}


def _data(key, shape, dtype):
  return jax.random.normal(jax.random.key(key), shape, jnp.float32).astype(
    dtype
  )


def _assert_close(got, want, exact):
  got = np.asarray(jnp.asarray(got, jnp.float32))
  want = np.asarray(jnp.asarray(want, jnp.float32))
  assert got.shape == want.shape
  scale = max(float(np.abs(want).max()), 1.0)
  # f32: the cotangents of a value used twice are summed in another order
  # than in the reference (last-bit differences); bf16 rounds every step.
  tol = 1e-6 if exact else 2e-2
  np.testing.assert_allclose(got, want, rtol=tol, atol=tol * scale)


def _differentiate(op, mesh_key, shape, dtype, transfer, seed=0):
  """Runs vjp, jvp and linearize of ``op`` and its reference per device."""
  (ours, ref), exact = OPS[op]
  mesh_shape, names, axis = MESHES[mesh_key]
  mesh = _mesh(mesh_shape, names)
  spec = P(names)
  n_dev = int(np.prod(mesh_shape))
  full = (n_dev * shape[0], *shape[1:])
  x, t = _data(seed, full, dtype), _data(seed + 1, full, dtype)

  def body(x, t):
    f, g = (functools.partial(h, a=axis) for h in (ours, ref))
    y, vjp = jax.vjp(f, x)
    ct = jnp.cos(y * 3).astype(y.dtype)  # a cotangent that varies
    y_ref, vjp_ref = jax.vjp(g, x)
    _, jvp = jax.jvp(f, (x,), (t,))
    _, jvp_ref = jax.jvp(g, (x,), (t,))
    _, lin = jax.linearize(f, x)
    outs = (y, vjp(ct)[0], jvp, lin(t))
    refs = (y_ref, vjp_ref(ct)[0], jvp_ref, jvp_ref)
    return tuple(o[None] for o in outs), tuple(r[None] for r in refs)

  sharded = jax.NamedSharding(mesh, spec)
  out_spec = P(names)
  with asyncops.emulation(transfer):
    got, want = jax.jit(
      jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(spec, spec),
        out_specs=((out_spec,) * 4, (out_spec,) * 4),
      )
    )(jax.device_put(x, sharded), jax.device_put(t, sharded))
  exact = exact and dtype == "float32"
  for name, g, w in zip(
    ("value", "vjp", "jvp", "linearize"), got, want, strict=True
  ):
    try:
      _assert_close(g, w, exact)
    except AssertionError as e:
      raise AssertionError(f"{op} {name} ({transfer}): {e}") from None


@pytest.mark.parametrize("transfer", TRANSFERS)
@pytest.mark.parametrize("op", sorted(OPS))
def test_every_op_f32(op, transfer):
  _differentiate(op, "2x4-y", (4, 128), "float32", transfer)


@hypothesis.settings(max_examples=12, deadline=None, derandomize=True)
@hypothesis.given(
  op=st.sampled_from(sorted(OPS)),
  mesh_key=st.sampled_from(sorted(MESHES)),
  rows=st.sampled_from([2, 4, 8]),
  cols=st.sampled_from([8, 128, 136]),
  dtype=st.sampled_from(["float32", "bfloat16"]),
  transfer=st.sampled_from(TRANSFERS),
)
def test_ops_hypothesis(op, mesh_key, rows, cols, dtype, transfer):
  _differentiate(op, mesh_key, (rows, cols), dtype, transfer, seed=rows + cols)


# The backward's structure on the jaxpr ------------------------------------


def _backward_eqns(fn, *args):
  jaxpr = jax.make_jaxpr(fn)(*args)
  eqns = []

  def walk(j):
    for e in j.eqns:
      eqns.append(e)
      for sub in jc.jaxprs_in_params(e.params):
        walk(sub)

  walk(jaxpr.jaxpr)
  return eqns


def test_backward_starts_at_the_done_and_waits_at_the_start():
  """jit(grad): the reverse permute (inverse perm) starts before the
  backward matmul and is awaited after it, inside the barriers."""
  mesh = _mesh((8,), ("i",))

  def f(x, w):
    x1, fut = asyncops.ppermute_start(x, "i", shift=1)
    z, fut = asyncops.overlap(fut, lambda x1, w: jnp.tanh(x1) @ w, x1, w)
    return jax.lax.psum(jnp.sum(asyncops.ppermute_done(fut) * z), "i")

  loss = jax.shard_map(f, mesh=mesh, in_specs=(P("i"), P()), out_specs=P())
  x = jax.device_put(jnp.ones((64, 16)), jax.NamedSharding(mesh, P("i")))
  w = jnp.ones((16, 16))
  eqns = _backward_eqns(jax.grad(loss, (0, 1)), x, w)
  names = [e.primitive.name for e in eqns]
  starts = [k for k, n in enumerate(names) if n == "asyncops_start"]
  dones = [k for k, n in enumerate(names) if n == "asyncops_done"]
  assert len(starts) == len(dones) == 2  # forward and reverse
  rev_start, rev_done = starts[1], dones[1]
  perm = eqns[rev_start].params["spec"].perm
  assert perm == tuple(sorted((d, s) for s, d in _ring(8, 1)))
  between = names[rev_start:rev_done]
  assert "dot_general" in between  # the backward matmul is in the window
  assert "optimization_barrier" in between


def test_unpaired_transfers_are_synchronous_but_exact():
  """A future crossing a jit boundary is not paired: the reverse transfer
  runs at the start's transpose, and the gradient is still exact."""
  mesh = _mesh((8,), ("i",))

  def f(x):
    x1, fut = asyncops.ppermute_start(x, "i", shift=1)
    y = jax.jit(asyncops.ppermute_done)(fut)
    return jax.lax.psum(jnp.sum(jnp.sin(y) * x1), "i")

  def g(x):
    y = jax.lax.ppermute(x, "i", _ring(8, 1))
    return jax.lax.psum(jnp.sum(jnp.sin(y) * x), "i")

  x = jax.device_put(
    _data(3, (64, 16), "float32"), jax.NamedSharding(mesh, P("i"))
  )
  run = lambda h: jax.jit(  # noqa: E731
    jax.grad(jax.shard_map(h, mesh=mesh, in_specs=P("i"), out_specs=P()))
  )(x)
  np.testing.assert_array_equal(run(f), run(g))


# Loops, checkpoint, eager, second order ----------------------------------


def _loop_programs(n):
  start = functools.partial(asyncops.ppermute_start, axis_name="y", shift=1)

  def staggered_ours(x, w):
    zero = jnp.zeros((x.shape[0], w.shape[1]))
    y, acc = staggered(
      n, start, lambda i, x, acc: acc + jnp.tanh(x) @ w, x, zero
    )
    return jnp.sum(jnp.sin(y)) + jnp.sum(acc**2)

  def ring_ours(x, w):
    def body(i, c):
      x, acc = c
      x1, fut = start(x)
      acc, fut = asyncops.overlap(
        fut, lambda x, acc: acc + jnp.tanh(x) @ w, x1, acc
      )
      return asyncops.ppermute_done(fut), acc

    zero = jnp.zeros((x.shape[0], w.shape[1]))
    y, acc = fori_loop(0, n + 1, body, (x, zero))
    return jnp.sum(jnp.sin(y)) + jnp.sum(acc**2)

  def reference(steps):
    def ref(x, w):
      acc = jnp.zeros((x.shape[0], w.shape[1]))
      for _ in range(steps):
        acc = acc + jnp.tanh(x) @ w
        x = jax.lax.ppermute(x, "y", _ring(4, 1))
      return jnp.sum(jnp.sin(x)) + jnp.sum(acc**2)

    return ref

  return {
    "staggered": (staggered_ours, reference(n)),
    "fori_loop": (ring_ours, reference(n + 1)),
  }


@pytest.mark.parametrize("transfer", TRANSFERS)
@pytest.mark.parametrize("program", ["staggered", "fori_loop"])
def test_loops_carrying_futures(program, transfer):
  mesh = _mesh((2, 4), ("x", "y"))
  ours, ref = _loop_programs(4)[program]

  def loss(h):
    return jax.shard_map(
      lambda x, w: jax.lax.psum(h(x, w), ("x", "y")),
      mesh=mesh,
      in_specs=(P("x", "y"), P()),
      out_specs=P(),
    )

  x = jax.device_put(
    _data(0, (16, 32), "float32"), jax.NamedSharding(mesh, P("x", "y"))
  )
  w = _data(1, (8, 8), "float32") * 0.3
  want = jax.jit(jax.grad(loss(ref), (0, 1)))(x, w)
  with asyncops.emulation(transfer):
    jitted = jax.jit(jax.grad(loss(ours), (0, 1)))(x, w)
    remat = jax.jit(jax.grad(jax.checkpoint(loss(ours)), (0, 1)))(x, w)
    with jax.set_mesh(mesh):
      eager = jax.grad(loss(ours), (0, 1))(x, w)
  for got in (jitted, remat, eager):
    for g, r in zip(got, want, strict=True):
      np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


def test_second_order():
  """Hessian-vector product through a permute and an all-gather."""
  mesh = _mesh((8,), ("i",))

  def ours(x):
    x1, fut = asyncops.ppermute_start(x, "i", shift=1)
    y = asyncops.ppermute_done(fut)
    x2, fut = asyncops.all_gather_start(y * x1, "i")
    g = asyncops.all_gather_done(fut)
    return jax.lax.psum(jnp.sum(jnp.sin(g)) * jnp.sum(x2), "i")

  def ref(x):
    y = jax.lax.ppermute(x, "i", _ring(8, 1))
    g = jax.lax.all_gather(y * x, "i")
    return jax.lax.psum(jnp.sum(jnp.sin(g)) * jnp.sum(y * x), "i")

  def hvp(f):
    loss = jax.shard_map(f, mesh=mesh, in_specs=P("i"), out_specs=P())
    return jax.jit(lambda x, v: jax.jvp(jax.grad(loss), (x,), (v,))[1])

  x, v = (
    jax.device_put(
      _data(k, (16, 8), "float32"), jax.NamedSharding(mesh, P("i"))
    )
    for k in (0, 1)
  )
  np.testing.assert_allclose(hvp(ours)(x, v), hvp(ref)(x, v), rtol=1e-4)


# The Ref API ---------------------------------------------------------------


def _ref_programs():
  def pp(perm_of):
    def ours(x, a):
      n = jax.lax.axis_size(a)
      src, dst = jax.new_ref(x), jax.new_ref(jnp.zeros_like(x))
      fut = stateful.ppermute_start(src, dst, a, perm_of(n))
      z = jnp.tanh(x)
      stateful.ppermute_done(fut, src, dst)
      return dst[...] * z

    def ref(x, a):
      n = jax.lax.axis_size(a)
      perm = perm_of(n)
      y = jax.lax.ppermute(x, a, perm)
      me = jax.lax.axis_index(a)
      receives = jnp.isin(me, jnp.array([d for _, d in perm]))
      return jnp.where(receives, y, 0) * jnp.tanh(x)

    return ours, ref

  def all_gather():
    def ours(x, a):
      n = jax.lax.axis_size(a)
      src = jax.new_ref(x)
      # Varying like x (a plain jnp.zeros would not be, under shard_map).
      dst = jax.new_ref(jnp.broadcast_to(jnp.zeros_like(x), (n, *x.shape)))
      fut = stateful.all_gather_start(src, dst, a)
      z = jnp.sum(jnp.tanh(x))
      stateful.all_gather_done(fut, src, dst)
      return dst[...] * z

    def ref(x, a):
      return jax.lax.all_gather(x, a) * jnp.sum(jnp.tanh(x))

    return ours, ref

  def copy():
    def ours(x, a):
      del a
      src, dst = jax.new_ref(x), jax.new_ref(jnp.zeros_like(x))
      fut = stateful.copy_start(src, dst)
      stateful.copy_done(fut, src, dst)
      return dst[...] * jnp.tanh(x)

    return ours, lambda x, a: x * jnp.tanh(x)

  def double_buffer_ring():
    def ours(x, a):
      n = jax.lax.axis_size(a)
      buf = stateful.double_buffer(x)

      def body(i, acc):
        fut = stateful.ppermute_start(
          buf.send_slot(i), buf.recv_slot(i), a, shift=1
        )
        acc = acc + jnp.tanh(buf.send_slot(i)[...])
        stateful.ppermute_done(fut, buf.send_slot(i), buf.recv_slot(i))
        return acc

      acc = jax.lax.fori_loop(0, n, body, jnp.zeros_like(x))
      return buf.read(n) * acc

    def ref(x, a):
      n = jax.lax.axis_size(a)
      acc = jnp.zeros_like(x)
      for _ in range(n):
        acc = acc + jnp.tanh(x)
        x = jax.lax.ppermute(x, a, _ring(n, 1))
      return x * acc

    return ours, ref

  return {
    "ppermute": pp(lambda n: _ring(n, 1)),
    "ppermute_partial": pp(_partial),
    "all_gather": all_gather(),
    "copy": copy(),
    "double_buffer_ring": double_buffer_ring(),
  }


@pytest.mark.parametrize("transfer", TRANSFERS)
@pytest.mark.parametrize(
  "program",
  ["ppermute", "ppermute_partial", "all_gather", "copy", "double_buffer_ring"],
)
def test_ref_api(program, transfer):
  ours, ref = _ref_programs()[program]
  mesh = _mesh((2, 4), ("x", "y"))
  spec = P(("x", "y"))
  x = jax.device_put(
    _data(0, (64, 128), "float32"), jax.NamedSharding(mesh, spec)
  )
  t = jax.device_put(
    _data(1, (64, 128), "float32"), jax.NamedSharding(mesh, spec)
  )

  def body(f, reverse=jc.REF_REVERSE_MODE):
    def run(x, t):
      f1 = functools.partial(f, a="y")
      _, jvp = jax.jvp(f1, (x,), (t,))
      if not reverse:  # jax 0.9: the value and jvp only
        return f1(x), jvp
      y, vjp = jax.vjp(f1, x)
      return y, vjp(jnp.cos(3 * y))[0], jvp

    n = 3 if reverse else 2
    return jax.jit(
      jax.shard_map(
        run, mesh=mesh, in_specs=(spec, spec), out_specs=(spec,) * n
      )
    )

  names = ("value", "vjp", "jvp") if jc.REF_REVERSE_MODE else ("value", "jvp")
  if not jc.REF_REVERSE_MODE:
    # jax 0.9: reverse mode through the Ref API is refused while tracing,
    # naming the fix (_jax_compat.REF_REVERSE_MODE).
    with (
      pytest.raises(NotImplementedError, match=r"jax >= 0\.10.*api='value'"),
      asyncops.emulation(transfer),
    ):
      body(ours, reverse=True).trace(x, t)
  want = body(ref)(x, t)
  with asyncops.emulation(transfer):
    got = body(ours)(x, t)
  exact = program != "all_gather"
  for name, g, w in zip(names, got, want, strict=True):
    try:
      _assert_close(g, w, exact)
    except AssertionError as e:
      raise AssertionError(f"{program} {name}: {e}") from None


# The all-to-all kernel (the all-gather's transpose), interpreted ----------


def _all_to_all_fused(x_ref, o_ref, send, recv, *, spec):
  from asyncops.kernels import _all_to_all

  _all_to_all.all_to_all_start_kernel(
    x_ref, x_ref, o_ref, send, recv, spec=spec
  )
  _all_to_all.wait_send(x_ref, (send,), spec=spec)
  _all_to_all.wait_recv(o_ref, (recv,), spec=spec)


@pytest.mark.parametrize("mesh_shape", [(2, 4), (4, 2), (8, 1)])
def test_all_to_all_kernel_interpreted(mesh_shape, capfd):
  """The Mosaic body in Pallas's TPU interpreter (remote DMAs, semaphores,
  barriers, race detection) equals ``jax.lax.all_to_all``; the emulation
  too."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import tpu as pltpu

  from asyncops.kernels import _common, _registry
  from asyncops.kernels._spec import OpSpec

  n = mesh_shape[1]
  mesh = _mesh(mesh_shape, ("x", "y"))
  spec_p = P(("x", "y"))

  def body(x):
    x = x.reshape(n, -1, x.shape[-1])
    spec = OpSpec(
      kind="all_to_all",
      shape=tuple(x.shape),
      dtype="float32",
      axis_name="y",
      mesh_axes=("x", "y"),
      axis_size=n,
      perm=tuple((i, j) for i in range(n) for j in range(n) if i != j),
      collective_id=0,
    )
    got = pl.pallas_call(
      functools.partial(_all_to_all_fused, spec=spec),
      out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
      in_specs=[_common.ANY],
      out_specs=_common.ANY,
      scratch_shapes=[pltpu.SemaphoreType.DMA] * 2,
      compiler_params=_common.params(collective_id=0),
      interpret=pltpu.InterpretParams(detect_races=True),
    )(x)
    emulated = _registry.get("all_to_all").emulate(x, spec=spec)
    want = jax.lax.all_to_all(x, "y", 0, 0, tiled=True)
    return got[None], emulated[None], want[None]

  x = _data(5, (8 * n * 8, 128), "float32")
  got, emulated, want = jax.jit(
    jax.shard_map(
      body,
      mesh=mesh,
      in_specs=spec_p,
      out_specs=(spec_p,) * 3,
      check_vma=False,
    )
  )(jax.device_put(x, jax.NamedSharding(mesh, spec_p)))
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(emulated, want)
  printed = capfd.readouterr().out
  assert "RACE DETECTED" not in printed
  assert "non-zero count" not in printed


# Collective matmuls ---------------------------------------------------------


def _cm_programs():
  from asyncops import collective_matmul as cm

  def ag(api, bidi):
    def ours(x, w):
      return cm.allgather_matmul(
        x, w, "y", api=api, bidirectional=bidi, method="ring"
      )

    def ref(x, w):
      return jax.lax.all_gather(x, "y", axis=1, tiled=True) @ w

    return ours, ref, ((8, 16), (16, 24)), (P("x", "y"), P(None, "y"))

  def rs(api, bidi):
    def ours(x, w):
      return cm.matmul_reducescatter(
        x, w, "y", api=api, bidirectional=bidi, method="ring"
      )

    def ref(x, w):
      return jax.lax.psum_scatter(x @ w, "y", scatter_dimension=1, tiled=True)

    return ours, ref, ((8, 64), (64, 32)), (P("x", "y"), P("y", None))

  def mlp(api, bidi):
    def ours(x, w_in, w_out):
      return cm.mlp_block(
        x, w_in, w_out, "y", api=api, bidirectional=bidi, method="ring"
      )

    def ref(x, w_in, w_out):
      h = jax.lax.all_gather(x, "y", axis=1, tiled=True) @ w_in
      y = jax.nn.gelu(h) @ w_out
      return jax.lax.psum_scatter(y, "y", scatter_dimension=1, tiled=True)

    return (
      ours,
      ref,
      ((8, 64), (64, 32), (32, 64)),
      (P("x", "y"), P(None, "y"), P("y", None)),
    )

  return {"allgather_matmul": ag, "matmul_reducescatter": rs, "mlp_block": mlp}


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("api", ["value", "ref"])
@pytest.mark.parametrize(
  "fn", ["allgather_matmul", "matmul_reducescatter", "mlp_block"]
)
def test_collective_matmul_grads(fn, api, bidirectional):
  ours, ref, shapes, specs = _cm_programs()[fn](api, bidirectional)
  mesh = _mesh((2, 4), ("x", "y"))
  # Weights scaled by 1/sqrt(fan-in): outputs of order one, so rounding
  # differences of the chunked sums stay at float32 epsilon.
  args = [
    jax.device_put(
      _data(k, s, "float32") / (np.sqrt(s[0]) if k else 1.0),
      jax.NamedSharding(mesh, p),
    )
    for k, (s, p) in enumerate(zip(shapes, specs, strict=True))
  ]

  def grads(f):
    def loss(*a):
      y = jax.shard_map(f, mesh=mesh, in_specs=specs, out_specs=specs[0])(*a)
      return jnp.sum(jnp.sin(y))

    argnums = tuple(range(len(args)))
    return jax.jit(jax.grad(loss, argnums))(*args)

  for g, r in zip(grads(ours), grads(ref), strict=True):
    scale = float(jnp.max(jnp.abs(r)))
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5 * scale)
