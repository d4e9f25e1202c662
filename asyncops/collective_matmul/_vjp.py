"""Backward passes of the collective matmuls, on the same overlapped rings.

Each canonical ring (``_gather_rings``, ``_scatter_rings``) is a
``jax.custom_vjp`` whose backward is two more rings of our own kernels: the
gradient of an all-gather matmul needs a matmul-reduce-scatter (for the
gathered operand) and an all-gather matmul (for the weights), and the
gradient of a matmul-reduce-scatter needs two all-gather matmuls. Nothing
is gathered in full that the forward did not gather in full: the residuals
are the forward's inputs, and every operand the backward needs from other
devices comes around a ring, a chunk at a time, while the previous chunk is
multiplied. Differentiating the rings themselves (the primitives' rules,
``asyncops.futures._ad``) would also be overlapped, but saves every chunk
that passed through as a residual (the whole gathered operand) and copies
the ring buffers to keep them.

Canonical shapes per device (ring of ``n`` over the axis) and the backward,
``g`` the output cotangent, ``AG``/``RS`` a gather/scatter ring:

- gather contracting, ``x[M,k] w[nk,f] -> [M,f]``:
  ``dx = RS_cols(g @ w^T)``, ``dw = AG_rows(x^T[1,k,M]) @ g``.
- gather rows, ``x[P,R,k] w[k,f] -> [P,nR,f]``:
  ``dx = RS_rows(g @ w^T)``, ``dw = AG_k(x^T[k,PR]) @ g`` (``g``'s rows
  regrouped device-major).
- scatter columns, ``x[M,k] w[k,N] -> [M,N/n]``:
  ``dx = AG_k(g) @ w^T``, ``dw = (AG_rows(g^T[1,N/n,M]) @ x)^T``.
- scatter rows, ``x[P,nR,k] w[k,d] -> [P,R,d]``:
  ``dx = AG_rows(g) @ w^T``, ``dw = (AG_k(g^T[d,PR]) @ x)^T`` (``x``'s
  rows regrouped device-major).

Several weights sharing one gather share the backward rings too: their
input gradients are one scatter ring over the concatenated cotangents, and
their weight gradients one gather ring with several weights. The
cotangent of ``return_gathered``'s gathered operand is reduce-scattered by
XLA (``psum_scatter``), since it has no matmul to hide behind.

The all-reduce matmul's output is the same on every device, so its
cotangent is too: its backward is two local matmuls, no communication.

The bidirectional option carries over to each backward ring whose shape
allows halving (an even number of rows or batches to split), else that ring
runs one way.

The fused kernels (``method="fused"``, or chosen by ``"auto"``) are
primitives without differentiation rules; :func:`fused_allgather` and
:func:`fused_reducescatter` wrap them in a ``custom_vjp`` whose backward is
the value-API ring backward of the same canonical form above (two-way when
the rows halve), so the default ``method="auto"`` differentiates whatever
it picks. (XLA's collective, the other choice, has JAX's own rules.)
"""

import functools

import jax
import jax.numpy as jnp

from asyncops import _jax_compat as jc
from asyncops.collective_matmul import (
  _bwd_rings,
  _fused,
  _gather_rings,
  _scatter_rings,
)


def _t(x):
  return jnp.swapaxes(x, -1, -2)


def _like(ct, primal):
  """``ct`` with the manual axes ``primal`` varies over.

  A weight replicated over other mesh axes (``w_in`` over the data axis)
  meets, inside the forward, activations that vary over them; outside a
  ``custom_vjp`` JAX would sum its cotangent over those axes (the data
  parallel gradient all-reduce). Here we do: ``psum`` over the axes the
  cotangent varies over and the primal does not.
  """
  have, want = jc.varying_axes(ct), jc.varying_axes(primal)
  extra = tuple(sorted(have - want))
  if extra:
    ct = jax.lax.psum(ct, extra)
  missing = tuple(sorted(want - have))
  if missing:
    ct = jax.lax.pcast(ct, missing, to="varying")
  return ct.astype(primal.dtype)


def _raw_gather(rows_form, x, ws, axis_name, options, stash=None):
  ring = _gather_rings.rows if rows_form else _gather_rings.contracting
  return ring(x, tuple(ws), axis_name, stash=stash, **dict(options))


def _raw_scatter(rows_form, x, w, axis_name, options):
  ring = _scatter_rings.rows if rows_form else _scatter_rings.columns
  return ring(x, w, axis_name, **dict(options))


def _halvable(rows_form: bool, x, n: int, scatter: bool) -> bool:
  """Whether a bidirectional ring can split ``x`` (its canonical shape)."""
  if not rows_form:
    return x.shape[0] % 2 == 0
  p, r = x.shape[0], x.shape[1] // (n if scatter else 1)
  return p % 2 == 0 or r % 2 == 0


def _options(rows_form, x, n, scatter, api, bidirectional, **extra):
  bidi = bool(bidirectional) and _halvable(rows_form, x, n, scatter)
  return tuple(sorted(dict(n=n, api=api, bidirectional=bidi, **extra).items()))


# All-gather matmul ---------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3, 4))
def allgather(rows_form, x, ws, axis_name, options):
  """A canonical all-gather ring (``_gather_rings``), differentiable.

  Args:
    rows_form: the gather-rows ring, else the gather-contracting ring.
    x: ``[P, R, k]`` or ``[M, k]``.
    ws: a tuple of weights.
    axis_name: the ring's mesh axis.
    options: the ring's keyword options as a sorted tuple of pairs
      (``n``, ``api``, ``bidirectional``, ``return_gathered``).

  Returns:
    ``(outs, gathered)`` as the ring returns them.
  """
  return _raw_gather(rows_form, x, ws, axis_name, options)


def _allgather_fwd(rows_form, x, ws, axis_name, options):
  # The first start aliases x in place (the Ref API's first Ref holds it):
  # keeping x for the backward would make XLA copy it. Keep the buffers as
  # that start saw them (the same bytes, laid out as the ring sends them),
  # which the backward's weight-gradient ring sends again.
  stash = []
  out = _raw_gather(rows_form, x, ws, axis_name, options, stash)
  return out, (stash[0], ws)


def _allgather_bwd(rows_form, axis_name, options, res, ct):
  sent, ws = res
  opts = dict(options)
  n, api, bidi = opts["n"], opts["api"], opts["bidirectional"]
  g_outs, g_gathered = ct
  dt = ws[0].dtype  # x's (validated)
  gs = tuple(g.astype(dt) for g in g_outs)
  # x itself is not kept (``sent`` holds its bytes): its shape.
  g0 = gs[0]
  shape = (
    (g0.shape[0], g0.shape[1] // n, ws[0].shape[0])
    if rows_form
    else (g0.shape[0], ws[0].shape[0] // n)
  )
  x = jax.ShapeDtypeStruct(shape, dt)
  kw = dict(n=n, api=api, bidirectional=bidi, bufs=sent)
  kw_rs = dict(n=n, api=api, bidirectional=bidi)
  if not rows_form:  # x [M, k], w [n k, f]
    with jax.named_scope("d_lhs"):
      dx = _bwd_rings.scatter_columns_t(gs, ws, axis_name, **kw_rs)
    with jax.named_scope("d_rhs"):
      dws = _bwd_rings.gather_weights_contracting(x, gs, axis_name, **kw)
  else:  # x [P, R, k], w [k, f]
    with jax.named_scope("d_lhs"):
      dx = _bwd_rings.scatter_rows_t(gs, ws, axis_name, **kw_rs)
    with jax.named_scope("d_rhs"):
      dws = _bwd_rings.gather_weights_rows(x, gs, axis_name, **kw)
  if g_gathered is not None:
    # The gathered operand's cotangent has no matmul to hide behind.
    dx = dx + jax.lax.psum_scatter(
      g_gathered.astype(dt), axis_name, scatter_dimension=1, tiled=True
    )
  dws = tuple(_like(d, w) for d, w in zip(dws, ws, strict=True))
  return _like(dx, sent[0]), dws  # sent[0]: x's manual axes


allgather.defvjp(_allgather_fwd, _allgather_bwd)


# Matmul-reduce-scatter -------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3, 4))
def reducescatter(rows_form, x, w, axis_name, options):
  """A canonical reduce-scatter ring (``_scatter_rings``), differentiable.

  Args:
    rows_form: the scatter-rows ring, else the scatter-columns ring.
    x: ``[P, n R, k]`` or ``[M, k]``.
    w: ``[k, f]``.
    axis_name: the ring's mesh axis.
    options: ``n``, ``api``, ``bidirectional`` as a sorted tuple of pairs.
  """
  return _raw_scatter(rows_form, x, w, axis_name, options)


def _reducescatter_fwd(rows_form, x, w, axis_name, options):
  return reducescatter(rows_form, x, w, axis_name, options), (x, w)


def _reducescatter_bwd(rows_form, axis_name, options, res, g):
  x, w = res
  opts = dict(options)
  kw = dict(n=opts["n"], api=opts["api"], bidirectional=opts["bidirectional"])
  g = g.astype(x.dtype)
  # One ring of the cotangent's chunks feeds both gradients.
  with jax.named_scope("d_lhs_rhs"):
    if not rows_form:  # x [M, k], w [k, N], g [M, N/n]
      dx, dw = _bwd_rings.gather_columns_both(g, x, w, axis_name, **kw)
    else:  # x [P, n R, k], w [k, d], g [P, R, d]
      dx, dw = _bwd_rings.gather_rows_both(g, x, w, axis_name, **kw)
  return _like(dx, x), _like(dw, w)


reducescatter.defvjp(_reducescatter_fwd, _reducescatter_bwd)


# All-reduce matmul -----------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def allreduce(forward, lhs, rhs, axis_name):
  """``forward(lhs, rhs, axis_name)`` (``psum(lhs @ rhs)`` on our rings),
  with a backward of two local matmuls.

  Its output is the same on every device of ``axis_name`` (invarying), so
  its cotangent is too: ``d lhs = g @ rhs^T`` and ``d rhs = lhs^T @ g``
  need nothing from other devices. (Differentiating the forward instead
  would slice ``g``'s column block and gather it back around a ring.)
  Only for an ``lhs`` typed as varying over the axis: under
  ``shard_map(check_vma=False)`` JAX hands each device ``g / n``.
  """
  return forward(lhs, rhs, axis_name)


def _allreduce_fwd(forward, lhs, rhs, axis_name):
  return forward(lhs, rhs, axis_name), (lhs, rhs)


def _allreduce_bwd(forward, axis_name, res, g):
  del forward, axis_name
  lhs, rhs = res
  acc = _gather_rings.accumulator_dtype(lhs.dtype)
  g = g.astype(lhs.dtype)
  with jax.named_scope("d_lhs"):
    dl = jax.lax.dot_general(
      g, rhs, (((g.ndim - 1,), (1,)), ((), ())), preferred_element_type=acc
    )
  with jax.named_scope("d_rhs"):
    batch = tuple(range(lhs.ndim - 1))
    dr = jax.lax.dot_general(
      lhs, g, ((batch, batch), ((), ())), preferred_element_type=acc
    )
  return _like(dl, lhs), _like(dr, rhs)


allreduce.defvjp(_allreduce_fwd, _allreduce_bwd)


# The fused kernels --------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def fused_allgather(x, w, axis_name, n):
  """``_fused.allgather_matmul(x [M, k], w [n k, f])``, differentiable: the
  backward is the contracting gather's ring backward (``_bwd_rings``)."""
  del n
  return _fused.allgather_matmul(x, w, axis_name)


def _fused_allgather_fwd(x, w, axis_name, n):
  return fused_allgather(x, w, axis_name, n), (x, w)


def _fused_allgather_bwd(axis_name, n, res, g):
  x, w = res
  g = g.astype(x.dtype)
  kw = dict(n=n, api="value", bidirectional=x.shape[0] % 2 == 0)
  with jax.named_scope("d_lhs"):
    dx = _bwd_rings.scatter_columns_t((g,), (w,), axis_name, **kw)
  with jax.named_scope("d_rhs"):
    (dw,) = _bwd_rings.gather_weights_contracting(x, (g,), axis_name, **kw)
  return _like(dx, x), _like(dw, w)


fused_allgather.defvjp(_fused_allgather_fwd, _fused_allgather_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def fused_reducescatter(x, w, axis_name, n):
  """``_fused.matmul_reducescatter(x [M, k], w [k, n c])``, differentiable:
  the backward is the scatter-columns ring backward (``_bwd_rings``)."""
  del n
  return _fused.matmul_reducescatter(x, w, axis_name)


def _fused_reducescatter_fwd(x, w, axis_name, n):
  return fused_reducescatter(x, w, axis_name, n), (x, w)


def _fused_reducescatter_bwd(axis_name, n, res, g):
  x, w = res
  options = _options(False, x, n, True, "value", True)
  return _reducescatter_bwd(False, axis_name, options, (x, w), g)


fused_reducescatter.defvjp(_fused_reducescatter_fwd, _fused_reducescatter_bwd)


# The seams the public functions call --------------------------------------


def gather(
  rows_form, x, ws, axis_name, api, bidirectional, n, return_gathered=False
):
  """A differentiable gather ring; ``bidirectional`` only where it fits."""
  options = _options(
    rows_form, x, n, False, api, bidirectional, return_gathered=return_gathered
  )
  return allgather(bool(rows_form), x, tuple(ws), axis_name, options)


def scatter(rows_form, x, w, axis_name, api, bidirectional, n):
  """A differentiable scatter ring; ``bidirectional`` only where it fits."""
  options = _options(rows_form, x, n, True, api, bidirectional)
  return reducescatter(bool(rows_form), x, w, axis_name, options)
