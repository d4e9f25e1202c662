"""Forward mode through the collective matmuls and ``mlp_block``.

They are ``jax.custom_jvp`` functions whose tangent map is linear and
transposed by the overlapped backward rings (``collective_matmul._vjp``,
``_linear``): ``jax.jvp`` and ``jax.linearize`` run the tangent rings and
must equal JAX's derivatives of the ``jax.lax`` programs, on 8 CPU devices,
both APIs, one- and two-way rings, float32 and bfloat16. Also: tangents of
some arguments only (symbolic zeros), ``vmap`` of the tangent map and
``grad`` of ``vmap`` (the batching rule keeps the custom transpose),
forward-over-reverse, and the Ref API's reverse mode on the oldest jax.
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

import asyncops
from asyncops import _jax_compat as jc
from asyncops import collective_matmul as _cm
from tests import util as u

# These tests are about the rings (value and Ref APIs): method="ring", also
# in the cases of tests/util.py. The default, method="auto", is checked by
# test_default_method_forward_mode.
allgather_matmul = functools.partial(_cm.allgather_matmul, method="ring")

RINGS = u.RINGS
ALL = P(("x", "y"))


@functools.cache
def _mesh():
  return jax.make_mesh((2, 4), ("x", "y"))


_data = u.normal


def _stack(tree):
  """Every device's value, stacked along a new axis 0 (``out_specs`` ALL)."""

  def one(y):
    missing = tuple(a for a in ("x", "y") if a not in jc.varying_axes(y))
    if missing:
      y = jax.lax.pcast(y, missing, to="varying")
    return y[None]

  return jax.tree.map(one, tree)


def _modes(f, specs, fixed):
  """``f``'s value and tangent by ``jax.jvp``, and its tangent by
  ``jax.linearize`` (both taken outside the ``shard_map``), in one program.
  ``fixed``: arguments (by position) held constant, so their tangents are
  symbolic zeros."""
  mesh = _mesh()
  sm = jax.shard_map(
    lambda *a: _stack(f(*a)), mesh=mesh, in_specs=specs, out_specs=ALL
  )

  def of_live(*live):
    it = iter(live)
    return sm(
      *[fixed[i] if i in fixed else next(it) for i in range(len(specs))]
    )

  def run(primals, tangents):
    y, ty = jax.jvp(of_live, primals, tangents)
    _, lin = jax.linearize(of_live, *primals)
    return y, ty, lin(*tangents)

  return jax.jit(run)


def _put(args, specs):
  mesh = _mesh()
  return tuple(
    jax.device_put(a, NamedSharding(mesh, s))
    for a, s in zip(args, specs, strict=True)
  )


def _check(ours, ref, shapes, specs, dtype, fan_in, zero=()):
  """Compares ``jax.jvp`` and ``jax.linearize`` of ``ours`` with
  ``jax.jvp`` of ``ref``; arguments in ``zero`` get symbolic-zero
  tangents (forward mode of a function of the others)."""
  args = u.ring_args(shapes, dtype)
  tans = [_data(s, dtype, 10 + k, 0.5) for k, s in enumerate(shapes)]
  args, tans = _put(args, specs), _put(tans, specs)
  live = [i for i in range(len(args)) if i not in zero]
  fixed = {i: args[i] for i in zero}
  p = tuple(args[i] for i in live)
  t = tuple(tans[i] for i in live)
  y, ty, ly = _modes(ours, specs, fixed)(p, t)
  y_ref, ty_ref, _ = _modes(ref, specs, fixed)(p, t)
  u.assert_close_ring((y, ty, ly), (y_ref, ty_ref, ty_ref), dtype, fan_in)


# All-gather matmul ------------------------------------------------------------


def _allgather_case(form, api, bidi, dtype, zero=()):
  c = u.allgather_ring_case(*u.AG_FORMS[form], api, bidi)
  _check(c.ours, c.ref, c.shapes, c.specs, dtype, c.fan_in, zero)


# Every form meets two of the four rings, every ring two forms per op.
CASES = [(f, *RINGS[(f + j) % 4]) for f in range(4) for j in (0, 2)]


@pytest.mark.parametrize("form,api,bidi", CASES)
def test_allgather_matmul(form, api, bidi):
  _allgather_case(form, api, bidi, "float32")


# Matmul-reduce-scatter ------------------------------------------------------


def _reducescatter_case(form, api, bidi, dtype, zero=()):
  c = u.reducescatter_ring_case(*u.RS_FORMS[form], api, bidi)
  _check(c.ours, c.ref, c.shapes, c.specs, dtype, c.fan_in, zero)


@pytest.mark.parametrize("form,api,bidi", CASES)
def test_matmul_reducescatter(form, api, bidi):
  _reducescatter_case(form, api, bidi, "float32")


# All-reduce matmul and mlp_block ----------------------------------------------


@pytest.mark.parametrize("api,bidi", [("value", False), ("ref", True)])
def test_matmul_allreduce(api, bidi):
  c = u.allreduce_ring_case(api, bidi)
  _check(c.ours, c.ref, c.shapes, c.specs, "float32", c.fan_in)


def _mlp_case(sp, gated, api, bidi, dtype, zero=()):
  c = u.mlp_ring_case(sp, gated, api, bidi)
  _check(c.ours, c.ref, c.shapes, c.specs, dtype, c.fan_in, zero)


@pytest.mark.parametrize(
  "sp,gated,api,bidi",
  [
    (False, False, "value", False),
    (True, True, "ref", True),
    (False, True, "ref", False),
    (True, False, "value", True),
  ],
)
def test_mlp_block(sp, gated, api, bidi):
  _mlp_case(sp, gated, api, bidi, "float32")


def test_mlp_block_bf16():
  _mlp_case(False, True, "ref", True, "bfloat16")


@hypothesis.settings(max_examples=6, deadline=None, derandomize=True)
@hypothesis.given(
  which=st.sampled_from(["allgather", "reducescatter", "mlp"]),
  form=st.integers(0, 3),
  ring=st.sampled_from(RINGS),
  dtype=st.sampled_from(["float32", "bfloat16"]),
  zero=st.sampled_from([(), (0,), (1,)]),
)
def test_hypothesis(which, form, ring, dtype, zero):
  """Also tangents of some arguments only (the others' are symbolic
  zeros, and their tangent rings are left out)."""
  api, bidi = ring
  if which == "allgather":
    _allgather_case(form, api, bidi, dtype, zero)
  elif which == "reducescatter":
    _reducescatter_case(form, api, bidi, dtype, zero)
  else:
    _mlp_case(form % 2 == 1, form >= 2, api, bidi, dtype, zero)


# Other transformations -----------------------------------------------------


def _ag_programs():
  mesh = _mesh()
  specs = (P("x", "y"), P(None, "y"))

  def make(fn):
    def f(x, w):
      return jax.lax.psum(jnp.sum(jnp.sin(fn(x, w))), ("x", "y"))

    return jax.shard_map(f, mesh=mesh, in_specs=specs, out_specs=P())

  ours = make(lambda x, w: allgather_matmul(x, w, "y", bidirectional=True))
  ref = make(lambda x, w: jax.lax.all_gather(x, "y", axis=1, tiled=True) @ w)
  xs = jax.device_put(
    _data((3, 8, 16), "float32", 0), NamedSharding(mesh, P(None, "x", "y"))
  )
  w = jax.device_put(
    _data((16, 8), "float32", 1, 0.25), NamedSharding(mesh, P(None, "y"))
  )
  return ours, ref, xs, w


def test_vmap_of_jvp_and_grad_of_vmap():
  """``vmap`` of the tangent map batches it (one batched ring); ``grad``
  of a ``vmap`` transposes the batched map with the batched backward."""
  ours, ref, xs, w = _ag_programs()

  def tangents(f):
    return jax.jit(jax.vmap(lambda x, t: jax.jvp(f, (x, w), (t, w))[1], (0, 0)))

  np.testing.assert_allclose(
    tangents(ours)(xs, xs * 0.5), tangents(ref)(xs, xs * 0.5), rtol=2e-5
  )

  def grad_of_vmap(f):
    return jax.jit(
      jax.grad(lambda xs, w: jnp.sum(jax.vmap(f, (0, None))(xs, w)), (0, 1))
    )

  for g, r in zip(
    grad_of_vmap(ours)(xs, w), grad_of_vmap(ref)(xs, w), strict=True
  ):
    np.testing.assert_allclose(g, r, rtol=2e-5, atol=2e-5)


def test_forward_over_reverse():
  """``jax.jvp`` of ``jax.grad`` (a Hessian-vector product): the backward
  rings' primitives differentiate forward again."""
  ours, ref, xs, w = _ag_programs()
  x = xs[0]

  def hvp(f):
    return jax.jit(
      lambda x, w: jax.jvp(jax.grad(f, (0, 1)), (x, w), (jnp.cos(x), w))[1]
    )

  for g, r in zip(hvp(ours)(x, w), hvp(ref)(x, w), strict=True):
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)


def test_grad_is_still_the_backward_rings():
  """``jax.grad`` transposes the tangent map with the backward rings: the
  same transfers as before forward mode existed (two forward rings and
  three backward rings of ``n - 1``, and the two weight gradients'
  exchanges over the data axis ``x``, ``_dp_reduce``), no ``all_gather``
  or ``psum_scatter``, and nothing of the tangent rings."""
  f, args = u.mlp_loss(_mesh())
  text = str(jax.make_jaxpr(jax.grad(f, (0, 1, 2)))(*args))
  assert text.count("asyncops_start[") == 6 + 9 + 2
  assert "asyncops_linear" not in text
  for collective in ("all_gather[", "psum_scatter[", "reduce_scatter["):
    assert collective not in text, collective


# The Ref API's own primitives: reverse mode needs jax >= 0.10 -----------


def test_ref_api_reverse_mode_needs_jax_0_10():
  """On jax >= 0.10 ``jax.grad`` through the Ref API's primitives works
  (it equals the value API's); on older jax it is refused at trace time,
  naming the fix."""
  mesh = _mesh()
  spec = P(("x", "y"))

  def ref_shift(x):
    src, dst = jax.new_ref(x), jax.new_ref(jnp.zeros_like(x))
    fut = asyncops.stateful.ppermute_start(src, dst, "y", shift=1)
    asyncops.stateful.ppermute_done(fut, src, dst)
    return jnp.sum(jnp.sin(dst[...]))

  def value_shift(x):
    _, fut = asyncops.futures.ppermute_start(x, "y", shift=1)
    y = asyncops.futures.ppermute_done(fut)
    return jnp.sum(jnp.sin(y))

  def grad_of(f):
    body = jax.shard_map(
      lambda x: jax.lax.psum(f(x), ("x", "y")),
      mesh=mesh,
      in_specs=spec,
      out_specs=P(),
    )
    return jax.jit(jax.grad(body))

  x = jax.device_put(_data((64, 128), "float32", 0), NamedSharding(mesh, spec))
  if jc.REF_REVERSE_MODE:
    np.testing.assert_allclose(
      grad_of(ref_shift)(x), grad_of(value_shift)(x), rtol=1e-6
    )
  else:
    with pytest.raises(NotImplementedError, match=r"jax >= 0\.10.*Fix"):
      grad_of(ref_shift).trace(x)


# The fused ring kernels (collective_matmul._fused) ---------------------------


def _fused_case(which):
  from asyncops.collective_matmul import _fused  # noqa: PLC0415

  if which == "allgather":
    ours = functools.partial(_fused.allgather_matmul, axis_name="y")

    def ref(x, w):
      return jax.lax.all_gather(x, "y", axis=1, tiled=True) @ w

    return (
      ours,
      ref,
      P(),
      P("x", "y"),
      (1024, 256),
      _fused.reducescatter_matmul_p,
    )
  if which == "reducescatter":
    ours = functools.partial(_fused.matmul_reducescatter, axis_name="y")

    def ref(x, w):
      return jax.lax.psum_scatter(x @ w, "y", scatter_dimension=1, tiled=True)

    return (
      ours,
      ref,
      P("y"),
      P("x", "y"),
      (1024, 1024),
      _fused.allgather_matmul_p,
    )
  ours = functools.partial(_fused.matmul_allreduce, axis_name="y")

  def ref(x, w):
    return jax.lax.psum(x @ w, "y")

  return ours, ref, P("y"), P("x"), (1024, 1024), _fused.allgather_matmul_p


def _fused_matches(which, ours, ref):
  """On ``_fused_case(which)``'s arguments, ``jax.grad`` of
  ``sum(sin(shard_map(ours)))`` and ``jax.jvp`` of the ``shard_map`` equal
  ``ref``'s (at highest precision); returns the jaxprs of ``ours``' gradient
  and JVP."""
  _, _, wspec, ospec, wshape, _ = _fused_case(which)
  mesh = _mesh()
  specs = (P("x", "y"), wspec)
  x, w = _put(
    [_data((16, 1024), "float32", 0), _data(wshape, "float32", 1, 1 / 32)],
    specs,
  )

  def programs(fn):
    sm = jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=ospec)

    def loss(x, w):
      return jnp.sum(jnp.sin(sm(x, w)))

    return jax.grad(loss, (0, 1)), lambda p, t: jax.jvp(sm, p, t)

  with jax.default_matmul_precision("highest"):
    g, j = programs(ours)
    gr, jr = programs(ref)
    t = (jnp.cos(x), w)
    got = (*jax.jit(g)(x, w), *jax.jit(j)((x, w), t))
    want = (*jax.jit(gr)(x, w), *jax.jit(jr)((x, w), t))
    for a, b in zip(got, want, strict=True):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    return str(jax.make_jaxpr(g)(x, w)), str(jax.make_jaxpr(j)((x, w), t))


@pytest.mark.parametrize("which", ["allgather", "reducescatter", "allreduce"])
def test_fused_kernels_grad_and_jvp(which):
  """The fused primitives' rules: gradients and JVPs equal the ``jax.lax``
  program's, and each backward uses the other fused ring for ``d lhs``."""
  ours, ref, _, _, _, other = _fused_case(which)
  grad_text, _ = _fused_matches(which, ours, ref)
  assert other.name in grad_text


def test_fused_int8_transfer_is_not_differentiable():
  from asyncops.collective_matmul import _fused  # noqa: PLC0415

  mesh = _mesh()
  f = jax.shard_map(
    lambda x, w: _fused.allgather_matmul(x, w, "y", transfer="int8"),
    mesh=mesh,
    in_specs=(P("x", "y"), P()),
    out_specs=P("x", "y"),
  )
  x, w = _put([jnp.ones((16, 512)), jnp.ones((512, 256))], (P("x", "y"), P()))
  with pytest.raises(NotImplementedError, match="transfer='native'"):
    jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, w)))).trace(x, w)


@pytest.mark.parametrize("which", ["allgather", "reducescatter"])
def test_default_method_forward_mode(which):
  """The public functions with the fused kernel (what ``method="auto"``
  picks at large shapes): ``jax.jvp`` runs the fused kernel on the
  tangents, ``jax.grad`` the ring backward; both equal ``jax.lax``'s."""
  _, ref, _, _, _, _ = _fused_case(which)
  public = {
    "allgather": _cm.allgather_matmul,
    "reducescatter": _cm.matmul_reducescatter,
  }[which]
  grad_text, jvp_text = _fused_matches(
    which, lambda x, w: public(x, w, "y", method="fused"), ref
  )
  assert "asyncops_start[" in grad_text  # the ring backward
  fused = f"asyncops_fused_{which}_matmul["
  # The primal product, and the tangent map (the fused kernel on the
  # tangents, run when lowered) as one linear call.
  assert fused in jvp_text and "asyncops_linear" in jvp_text
