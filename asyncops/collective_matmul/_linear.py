"""A linear function with a transpose of our own: the collective matmuls'
tangent maps.

``call(fwd, bwd, res, lin, out)`` returns ``fwd(res, lin)``, a function
linear in ``lin`` (``res`` are residuals: weights, the chunk the forward
ring sent). It binds one primitive, ``asyncops_linear``, whose rules are:

- **transpose**: ``bwd(res, ct)``, evaluated in place (its rings' start and
  done kernels land in the backward jaxpr as they are, so they are
  overlapped, dead-code eliminated and differentiated again like any
  other);
- **JVP**: itself on the tangents of ``lin``, plus JAX's derivative of
  ``fwd`` in ``res`` (forward mode of the rings' primitives) when the
  residuals have tangents (second order);
- **batching**: the batch becomes a level of ``jax.vmap`` around ``fwd``
  and ``bwd`` (every linear operand and output batched at axis 0), so a
  batched tangent map still transposes with ``bwd``;
- **lowering**: ``fwd`` traced and lowered where it stands (``jax.jvp`` of
  a collective matmul runs its tangent rings).

It is ``jax.custom_derivatives.linear_call`` with a batching rule and an
inline transpose; ``linear_call`` has no batching rule (``vmap`` of its
transpose fails) and stages its transpose as an opaque call.

The collective matmuls are ``jax.custom_jvp`` functions whose tangent is
one such call (``_vjp``): ``jax.jvp`` runs ``fwd`` (the tangent rings),
``jax.grad`` transposes it with ``bwd`` (the backward rings).
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.interpreters import ad, batching

from asyncops import _jax_compat as jc

linear_p = jc.Primitive("asyncops_linear")
linear_p.multiple_results = True


def call(fwd: Callable, bwd: Callable, res: Any, lin: Any, out: Any) -> Any:
  """``fwd(res, lin)``, linear in ``lin``, transposed by ``bwd``.

  Args:
    fwd: ``fwd(res, lin) -> out`` (pytrees), linear in ``lin``.
    bwd: ``bwd(res, ct) -> lin``-shaped cotangents (``None`` leaves for
      absent operands; a pytree like ``lin``).
    res: residuals (pytree of arrays).
    lin: linear operands (pytree of arrays; ``None`` leaves are absent).
    out: a pytree like ``fwd``'s result whose leaves have its avals (the
      primal outputs).

  Returns:
    ``fwd(res, lin)``.
  """
  res_flat, res_tree = jax.tree.flatten(res)
  lin_flat, lin_tree = jax.tree.flatten(lin)
  out_flat, out_tree = jax.tree.flatten(out)

  def fwd_flat(r, x):
    y = fwd(jax.tree.unflatten(res_tree, r), jax.tree.unflatten(lin_tree, x))
    return jax.tree.leaves(y)

  def bwd_flat(r, ct):
    y = bwd(jax.tree.unflatten(res_tree, r), jax.tree.unflatten(out_tree, ct))
    flat, tree = jax.tree.flatten(y)
    if tree != lin_tree:
      raise TypeError(
        f"asyncops: a transpose returned {tree}, expected {lin_tree}"
      )
    return flat

  avals = tuple(jax.typeof(o) for o in out_flat)
  outs = linear_p.bind(
    *res_flat,
    *lin_flat,
    fwd=fwd_flat,
    bwd=bwd_flat,
    num_res=len(res_flat),
    out_avals=avals,
    batch=(),
  )
  return jax.tree.unflatten(out_tree, outs)


def _apply(fn, batch, res, lin):
  """``fn(res, lin)`` under the ``jax.vmap`` levels of ``batch``."""
  g = fn
  for _, res_axes in batch:  # innermost first
    g = jax.vmap(g, in_axes=(list(res_axes), 0), out_axes=0)
  return list(g(list(res), list(lin)))


def _impl(*args, fwd, bwd, num_res, out_avals, batch):
  del bwd, out_avals
  return _apply(fwd, batch, args[:num_res], args[num_res:])


def _batched_avals(out_avals, batch):
  prefix = tuple(size for size, _ in reversed(batch))
  return [a.update(shape=prefix + tuple(a.shape)) for a in out_avals]


def _abstract(*args, fwd, bwd, num_res, out_avals, batch):
  del args, fwd, bwd, num_res
  return _batched_avals(out_avals, batch)


linear_p.def_impl(_impl)
linear_p.def_abstract_eval(_abstract)
jc.register_lowering(linear_p, _impl)


def _jvp(primals, tangents, **params):
  n = params["num_res"]
  res, lin = primals[:n], primals[n:]
  t_res, t_lin = tangents[:n], tangents[n:]
  out = linear_p.bind(*primals, **params)
  t_out = None
  if any(type(t) is not ad.Zero for t in t_lin):
    t_lin = [ad.instantiate_zeros(t) for t in t_lin]
    t_out = linear_p.bind(*res, *t_lin, **params)
  if any(type(t) is not ad.Zero for t in t_res):
    # Second order: the map's derivative in its residuals, by JAX's rules
    # for the rings' own primitives.
    t_res = [ad.instantiate_zeros(t) for t in t_res]

    def of_res(*r):
      return _apply(params["fwd"], params["batch"], r, lin)

    _, t2 = jax.jvp(of_res, tuple(res), tuple(t_res))
    t_out = (
      t2 if t_out is None else [a + b for a, b in zip(t_out, t2, strict=True)]
    )
  if t_out is None:
    return out, [ad.Zero(jax.typeof(o).to_tangent_aval()) for o in out]
  return out, t_out


def _transpose(cts, *args, fwd, bwd, num_res, out_avals, batch):
  del fwd
  res, lin = args[:num_res], args[num_res:]
  if any(ad.is_undefined_primal(r) for r in res):
    raise NotImplementedError(
      "asyncops: a collective matmul's tangent map is linear in the "
      "tangents only; its residuals (weights, the sent chunk) cannot be "
      "transposed."
    )
  del out_avals
  cts = [ad.instantiate_zeros(ct) for ct in cts]
  outs = _apply(bwd, batch, res, cts)
  return [None] * num_res + [
    o if ad.is_undefined_primal(x) else None
    for o, x in zip(outs, lin, strict=True)
  ]


def _batch(args, dims, *, fwd, bwd, num_res, out_avals, batch):
  size = next(
    a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None
  )
  res, lin = args[:num_res], args[num_res:]
  res_dims, lin_dims = dims[:num_res], dims[num_res:]
  res = [
    r if d is None else jnp.moveaxis(r, d, 0)
    for r, d in zip(res, res_dims, strict=True)
  ]
  # Every linear operand batched at 0 (a broadcast is linear), so the
  # transposed map's outputs are all batched at 0 too.
  lin = [
    jnp.broadcast_to(x, (size, *x.shape))
    if d is None
    else jnp.moveaxis(x, d, 0)
    for x, d in zip(lin, lin_dims, strict=True)
  ]
  level = (size, tuple(None if d is None else 0 for d in res_dims))
  outs = linear_p.bind(
    *res,
    *lin,
    fwd=fwd,
    bwd=bwd,
    num_res=num_res,
    out_avals=out_avals,
    batch=batch + (level,),
  )
  return outs, [0] * len(outs)


ad.primitive_jvps[linear_p] = _jvp
ad.primitive_transposes[linear_p] = _transpose
batching.primitive_batchers[linear_p] = _batch
