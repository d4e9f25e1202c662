"""Gradients of the collective matmuls and ``mlp_block`` on 8 CPU devices.

Their backward passes are custom rules on our own rings
(``asyncops.collective_matmul._vjp``). Every form (contracting and row
gathers, batch dimensions, several weights, ``return_gathered``, the
all-reduce matmul, gated and sequence-parallel MLP blocks), both APIs, one-
and two-way rings, float32 and bfloat16, is differentiated with
``jax.grad`` and compared with ``jax.grad`` of the ``jax.lax`` program it
replaces; weights are replicated over the other mesh axis, so their
cotangents are summed over it as JAX sums them. Also: ``jax.checkpoint``
around them, ``jax.vmap`` of the gradient, second order, and the structure
of the backward jaxpr (our ring kernels, no full gather of an operand).
"""

import functools

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from asyncops import _jax_compat as jc
from asyncops import collective_matmul as _cm
from tests import util as u

# These tests are about the rings (value and Ref APIs): method="ring" (also
# in the cases of tests/util.py).
# The default, method="auto", may run the fused kernel or XLA's
# collective instead (tests/test_fused_matmul*.py, test_auto_default).
allgather_matmul = functools.partial(_cm.allgather_matmul, method="ring")
matmul_allreduce = functools.partial(_cm.matmul_allreduce, method="ring")

RINGS = u.RINGS


@functools.cache
def _mesh(shape=(2, 4)):
  return jax.make_mesh(shape, ("x", "y"))


def _put(mesh, spec, x):
  return jax.device_put(x, NamedSharding(mesh, spec))


_data = u.normal


def _grads(f, args, specs, mesh, wrap=None):
  """``jax.grad`` of ``sum(sin(f(...)))`` over every argument."""

  def per_device(*a):
    out = f(*a)
    leaves = jax.tree.leaves(out)
    local = sum(jnp.sum(jnp.sin(o.astype(jnp.float32))) for o in leaves)
    # Summed over the axes it varies over (a replicated value once).
    axes = tuple(sorted(jc.varying_axes(local)))
    return jax.lax.psum(local, axes) if axes else local

  body = per_device if wrap is None else wrap(per_device)
  loss = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P())
  args = [
    jax.device_put(a, NamedSharding(mesh, s))
    for a, s in zip(args, specs, strict=True)
  ]
  return jax.jit(jax.grad(loss, tuple(range(len(args)))))(*args)


def _check(ours, ref, shapes, specs, dtype, fan_in, mesh=None, wrap=None):
  mesh = mesh or _mesh()
  args = u.ring_args(shapes, dtype)
  got = _grads(ours, args, specs, mesh, wrap)
  want = _grads(ref, args, specs, mesh, wrap)
  u.assert_close_ring(got, want, dtype, fan_in)


# All-gather matmul -----------------------------------------------------------


def _allgather_case(local, dim, fs, gathered, api, bidi, dtype="float32"):
  c = u.allgather_ring_case(local, dim, fs, gathered, api, bidi)
  _check(c.ours, c.ref, c.shapes, c.specs, dtype, c.fan_in)


@pytest.mark.parametrize("api,bidi", RINGS)
@pytest.mark.parametrize("local,dim,fs,gathered", u.AG_FORMS)
def test_allgather_matmul_grad(local, dim, fs, gathered, api, bidi):
  _allgather_case(local, dim, fs, gathered, api, bidi)


# Matmul-reduce-scatter ------------------------------------------------------


def _reducescatter_case(local, dim, f, api, bidi, dtype="float32"):
  c = u.reducescatter_ring_case(local, dim, f, api, bidi)
  _check(c.ours, c.ref, c.shapes, c.specs, dtype, c.fan_in)


@pytest.mark.parametrize("api,bidi", RINGS)
@pytest.mark.parametrize("local,dim,f", u.RS_FORMS)
def test_matmul_reducescatter_grad(local, dim, f, api, bidi):
  _reducescatter_case(local, dim, f, api, bidi)


@pytest.mark.parametrize("api,bidi", [("value", False), ("ref", True)])
def test_matmul_allreduce_grad(api, bidi):
  c = u.allreduce_ring_case(api, bidi)
  _check(c.ours, c.ref, c.shapes, c.specs, "float32", c.fan_in)


def test_allreduce_backward_has_no_communication():
  """The all-reduce matmul's cotangent is the same on every device: its
  backward is two local matmuls."""
  mesh = _mesh()

  def loss(x, w):
    y = matmul_allreduce(x, w, "y")
    return jax.lax.psum(jnp.sum(jnp.sin(y)), "x")

  f = jax.shard_map(
    loss, mesh=mesh, in_specs=(P("x", "y"), P("y")), out_specs=P()
  )
  args = (
    _put(mesh, P("x", "y"), jnp.ones((8, 32))),
    _put(mesh, P("y"), jnp.ones((32, 16))),
  )
  fwd = str(jax.make_jaxpr(f)(*args))
  text = str(jax.make_jaxpr(jax.grad(f, (0, 1)))(*args))
  for prim in ("asyncops_start", "all_gather"):
    assert text.count(prim) == fwd.count(prim) > 0, prim
  assert "psum_scatter" not in text and "reduce_scatter" not in text


# method="auto" (the default), "fused" and "xla" -------------------------------

# name -> (global shapes, specs, reference); f32, small.
_METHOD_CASES = {
  "allgather_matmul": (
    [(16, 64), (64, 32)],
    (P("x", "y"), P(None, "y")),
    lambda x, w: jax.lax.all_gather(x, "y", axis=1, tiled=True) @ w,
  ),
  "matmul_reducescatter": (
    [(16, 64), (64, 32)],
    (P("x", "y"), P("y", None)),
    lambda x, w: jax.lax.psum_scatter(
      x @ w, "y", scatter_dimension=1, tiled=True
    ),
  ),
  "matmul_allreduce": (
    [(16, 64), (64, 32)],
    (P("x", "y"), P("y", None)),
    lambda x, w: jax.lax.psum(x @ w, "y"),
  ),
}


@pytest.mark.parametrize("method", ["auto", "fused", "xla"])
@pytest.mark.parametrize("name", sorted(_METHOD_CASES))
def test_every_method_differentiates(name, method):
  """The fused kernels (primitives without rules of their own) through
  their ``custom_vjp`` (the ring backward), XLA's collective through JAX's
  rules; ``auto`` picks one of them (here XLA: small rows)."""
  shapes, specs, ref = _METHOD_CASES[name]
  fn = getattr(_cm, name)

  def ours(x, w):
    return fn(x, w, "y", method=method)

  _check(ours, ref, shapes, specs, "float32", shapes[0][1])


@pytest.mark.parametrize("name", ["allgather_matmul", "matmul_reducescatter"])
def test_auto_picks_fused_and_differentiates(name):
  """Rows enough that the default picks the fused kernel (v5e figures, the
  chip assumed off TPU); its gradient is the ring backward's."""
  from asyncops.collective_matmul import _auto  # noqa: PLC0415

  mesh = _mesh()
  if name == "allgather_matmul":
    shapes, specs = [(1024, 1024), (1024, 4096)], (P("x", "y"), P(None, "y"))
    ref = _METHOD_CASES[name][2]
  else:
    shapes, specs = [(512, 1024), (1024, 4096)], (P("x", "y"), P("y", None))
    ref = _METHOD_CASES[name][2]
  fn = getattr(_cm, name)

  def ours(x, w):
    return fn(x, w, "y")

  with _auto.recording() as choices:
    _check(ours, ref, shapes, specs, "float32", shapes[0][1], mesh=mesh)
  assert choices and {c.method for _, c in choices} == {"fused"}


def test_one_way_fused_reducescatter_differentiates(monkeypatch):
  """Auto's one-way fused reduce-scatter (``"fused_uni"``, forced here:
  off TPU auto assumes a v5e, where it is never picked) differentiates
  like the two-way kernel: the same one-way ring backward, against
  ``jax.grad`` of ``psum_scatter(x @ w)``; forward mode runs the one-way
  kernel on the tangents (``jax.jvp``)."""
  from asyncops.collective_matmul import _auto  # noqa: PLC0415

  pick = _auto.Choice("fused_uni", "forced", 1.0, 2.0, "v6e", fused_uni_us=0.9)
  monkeypatch.setattr(_auto, "explain_reducescatter", lambda *a, **k: pick)
  shapes, specs, ref = _METHOD_CASES["matmul_reducescatter"]

  def ours(x, w):
    return _cm.matmul_reducescatter(x, w, "y")

  with _auto.recording() as choices:
    _check(ours, ref, shapes, specs, "float32", shapes[0][1])
    _check(ours, ref, shapes, specs, "bfloat16", shapes[0][1])
  assert choices and {c.method for _, c in choices} == {"fused_uni"}
  mesh = _mesh()
  args = [
    _put(mesh, s, a)
    for s, a in zip(specs, u.ring_args(shapes, "float32"), strict=True)
  ]

  def jvp(f):
    g = jax.shard_map(f, mesh=mesh, in_specs=specs, out_specs=P("x", "y"))
    return jax.jit(lambda x, w: jax.jvp(g, (x, w), (x + 1, w * 2)))(*args)

  (out, tan), (out_r, tan_r) = jvp(ours), jvp(ref)
  np.testing.assert_allclose(
    np.asarray(out), np.asarray(out_r), rtol=1e-5, atol=1e-4
  )
  np.testing.assert_allclose(
    np.asarray(tan), np.asarray(tan_r), rtol=1e-5, atol=1e-4
  )


# mlp_block -------------------------------------------------------------------


def _mlp_case(sp, gated, api, bidi, dtype="float32", wrap=None):
  c = u.mlp_ring_case(sp, gated, api, bidi)
  _check(c.ours, c.ref, c.shapes, c.specs, dtype, c.fan_in, wrap=wrap)


@pytest.mark.parametrize("api,bidi", RINGS)
@pytest.mark.parametrize("sp,gated", [(False, False), (True, True)])
def test_mlp_block_grad(sp, gated, api, bidi):
  _mlp_case(sp, gated, api, bidi)


@pytest.mark.parametrize("api", ["value", "ref"])
def test_mlp_block_grad_bf16(api):
  _mlp_case(False, True, api, True, "bfloat16")


@pytest.mark.parametrize(
  "policy",
  [None, jax.checkpoint_policies.nothing_saveable],
  ids=["default", "nothing_saveable"],
)
def test_checkpoint(policy):
  """``jax.checkpoint`` around the block: the forward rings run again in the
  backward, the gradients do not change."""
  _mlp_case(
    True,
    False,
    "value",
    True,
    wrap=lambda f: jax.checkpoint(f, policy=policy),
  )


@hypothesis.settings(max_examples=8, deadline=None, derandomize=True)
@hypothesis.given(
  which=st.sampled_from(["allgather", "reducescatter"]),
  form=st.integers(0, 3),
  ring=st.sampled_from(RINGS),
  dtype=st.sampled_from(["float32", "bfloat16"]),
)
def test_hypothesis(which, form, ring, dtype):
  api, bidi = ring
  if which == "allgather":
    local, dim, fs, gathered = u.AG_FORMS[form]
    _allgather_case(local, dim, fs, gathered, api, bidi, dtype)
  else:
    local, dim, f = u.RS_FORMS[form]
    _reducescatter_case(local, dim, f, api, bidi, dtype)


# Other transformations and structure ---------------------------------------


def test_vmap_of_grad_and_second_order():
  """``vmap`` batches the custom backward; ``grad`` of a gradient runs
  through the backward rings' own rules."""
  mesh = _mesh()
  specs = (P("x", "y"), P(None, "y"))

  def make(fn):
    def loss(x, w):
      y = fn(x, w)
      return jax.lax.psum(jnp.sum(jnp.sin(y)), ("x", "y"))

    return jax.shard_map(loss, mesh=mesh, in_specs=specs, out_specs=P())

  ours = make(lambda x, w: allgather_matmul(x, w, "y"))
  ref = make(
    lambda x, w: jax.lax.all_gather(x, "y", axis=x.ndim - 1, tiled=True) @ w
  )
  xs = _put(mesh, P(None, "x", "y"), _data((3, 8, 16), "float32", 0))
  w = _put(mesh, P(None, "y"), _data((16, 8), "float32", 1, 0.25))
  got = jax.jit(jax.vmap(jax.grad(ours), (0, None)))(xs, w)
  want = jax.jit(jax.vmap(jax.grad(ref), (0, None)))(xs, w)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)

  def second(f):
    return jax.jit(jax.grad(lambda x, w: jnp.sum(jax.grad(f, 1)(x, w) ** 2)))

  np.testing.assert_allclose(
    second(ours)(xs[0], w), second(ref)(xs[0], w), rtol=1e-4, atol=1e-5
  )


def test_backward_is_our_rings():
  """The backward jaxpr of ``mlp_block`` runs our start/done kernels (at
  least as many transfers as the forward) and gathers nothing in full."""
  f, args = u.mlp_loss(_mesh())
  fwd = str(jax.make_jaxpr(f)(*args))
  both = str(jax.make_jaxpr(jax.grad(f, (0, 1, 2)))(*args))
  n_fwd = fwd.count("asyncops_start[")
  assert n_fwd == 6  # two rings of n - 1 = 3 transfers
  # Three backward rings: the up projection's scatter (dx) and gather
  # (dw_in); the down projection's one gather of g feeding dh and dw_out.
  # Plus the data-parallel all-reduce of each weight gradient over x (one
  # exchange each: x has two devices).
  assert both.count("asyncops_start[") == n_fwd + 9 + 2
  assert both.count("axis_name=x") >= 2 or "'x'" in both
  for collective in ("all_gather[", "psum_scatter[", "reduce_scatter["):
    assert collective not in both, collective


def test_unused_gradient_ring_is_removed():
  """Gradients of the weights only: the up projection's input-gradient
  ring is dead code and goes entirely (its starts too, see
  ``futures._primitives._start_dce``; the window it shares with w_in's
  exchange lets it go, ``_jax_compat.window_tie_p``), leaving two backward
  rings."""
  f, args = u.mlp_loss(_mesh())
  traced = jax.jit(jax.grad(f, (1, 2))).trace(*args).jaxpr
  live = str(jc.without_dead_code(traced.jaxpr))
  # Plus the two weight gradients' exchanges over x (data parallel).
  assert live.count("asyncops_start[") == 6 + 6 + 2
  assert live.count("asyncops_done[") == 6 + 6 + 2


# The data-parallel exchange, whatever runs the matmuls ----------------------


def _eqns(jaxpr):
  out = []
  for e in jaxpr.eqns:
    out.append(e)
    for sub in jc.jaxprs_in_params(e.params):
      out.extend(_eqns(sub))
  return out


@pytest.mark.parametrize(
  "method,mesh_shape",
  [("fused", (2, 4)), ("xla", (2, 4)), ("auto", (4, 2)), ("ring", (4, 2))],
)
def test_mlp_block_data_parallel_exchange(method, mesh_shape):
  """``mlp_block``'s weight gradients are summed over the data axis ``x``
  by our exchanges, not ``psum``, whichever method runs the matmuls (the
  fused kernels and XLA's collective too: ``auto`` picks XLA's here), and
  over a data axis of four devices as well (an all-to-all of slots, then
  XLA's all-gather); the gradients equal ``jax.lax``'s."""
  mesh = _mesh(mesh_shape)
  dp, n = mesh_shape
  d = f = 64
  shapes = [(8 * dp, d), (d, f), (f, d)]
  specs = (P("x", "y"), P(None, "y"), P("y", None))

  def ours(x, w_in, w_out):
    return _cm.mlp_block(x, w_in, w_out, "y", method=method)

  _check(ours, u.mlp_ref, shapes, specs, "float32", d, mesh=mesh)

  def loss(x, w_in, w_out):
    return jax.lax.psum(jnp.sum(jnp.sin(ours(x, w_in, w_out))), ("x", "y"))

  args = [
    jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(mesh, p))
    for s, p in zip(shapes, specs, strict=True)
  ]
  f_loss = jax.shard_map(loss, mesh=mesh, in_specs=specs, out_specs=P())
  eqns = _eqns(jax.make_jaxpr(jax.grad(f_loss, (0, 1, 2)))(*args).jaxpr)
  kind = "ppermute" if dp == 2 else "all_to_all"
  exchanges = [
    e
    for e in eqns
    if e.primitive.name == "asyncops_start"
    and e.params["spec"].axis_name == "x"
  ]
  # Four devices: the first exchange's all-gather half runs in flight.
  gather = [] if dp == 2 else ["all_gather"]
  assert [e.params["spec"].kind for e in exchanges] == [kind, kind, *gather]
  psums_over_x = [
    e
    for e in eqns
    if e.primitive.name.startswith("psum")
    and "x" in e.params.get("axes", ())
    and "y" not in e.params.get("axes", ())
  ]
  assert not psums_over_x


def test_xla_allgather_forward_mode_and_vmap_of_grad():
  """``method="xla"``'s reordered gradient (``_vjp.xla_allgather``) keeps
  forward mode (``jax.jvp``) and ``vmap`` of ``grad`` equal to
  ``jax.lax``'s."""
  mesh = _mesh()
  specs = (P("x", "y"), P(None, "y"))
  x = _put(mesh, specs[0], _data((16, 64), "float32", 0))
  w = _put(mesh, specs[1], _data((64, 32), "float32", 1, 1 / 8))

  def make(fn):
    return jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=P("x", "y"))

  ours = make(lambda x, w: _cm.allgather_matmul(x, w, "y", method="xla"))
  ref = make(
    lambda x, w: jax.lax.all_gather(x, "y", axis=x.ndim - 1, tiled=True) @ w
  )
  t = (jnp.cos(x), jnp.sin(w))
  got = jax.jit(lambda p, t: jax.jvp(ours, p, t))((x, w), t)
  want = jax.jit(lambda p, t: jax.jvp(ref, p, t))((x, w), t)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)

  def vgrad(f):
    g = jax.grad(lambda x, w: jnp.sum(jnp.sin(f(x, w))))
    return jax.jit(jax.vmap(g, (None, 0)))(x, jnp.stack([w, 2 * w]))

  np.testing.assert_allclose(vgrad(ours), vgrad(ref), rtol=1e-5, atol=1e-5)
