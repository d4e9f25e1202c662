"""Backward passes of the collective matmuls, on the same overlapped rings.

Each canonical ring (``_gather_rings``, ``_scatter_rings``) is a
``jax.custom_jvp`` whose tangent is a linear map (``_linear.call``: the
tangent rings, for ``jax.jvp``/``jax.linearize``) transposed by a backward
of two more rings of our own kernels (for ``jax.grad``): the
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
:func:`fused_reducescatter` wrap them in a ``custom_jvp`` whose backward is
the value-API one-way ring backward of the same canonical form above, so
the default ``method="auto"`` differentiates whatever it picks. XLA's
collective, the other choice, gets JAX's formulas in our order
(:func:`xla_allgather`; its reduce-scatter keeps JAX's rules). Every
backward computes the weight gradients first and sums them over the
data-parallel axes with our exchanges (``_dp_reduce``, ``_dp_window``)
while the rest of the backward runs.
"""

import functools

import jax
import jax.numpy as jnp

from asyncops import _jax_compat as jc
from asyncops.collective_matmul import (
  _auto,
  _bwd_rings,
  _dp_reduce,
  _fused,
  _gather_rings,
  _layout,
  _linear,
  _ref_whole,
  _scatter_rings,
)


def _t(x):
  return jnp.swapaxes(x, -1, -2)


def _like(ct, primal):
  """``ct`` with the manual axes ``primal`` varies over.

  A weight replicated over other mesh axes (``w_in`` over the data axis)
  meets, inside the forward, activations that vary over them; outside a
  custom rule JAX would sum its cotangent over those axes (the data
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


def _zero(t) -> bool:
  """Whether a ``custom_jvp`` tangent (``symbolic_zeros=True``) is zero."""
  return isinstance(t, jax.custom_derivatives.SymbolicZero)


def _inst(t, primal):
  """A tangent, zeros instantiated (for a weight whose tangent is zero
  while another's is not)."""
  return jnp.zeros_like(primal) if _zero(t) else t


def _unsent(rows_form, sent, x_shape, opts):
  """``x`` back from the buffers its ring's first start saw."""
  if not opts["bidirectional"]:
    return sent[0]
  if not rows_form:  # one kernel halves axis 0 (value), or two halves (ref)
    return sent[0] if len(sent) == 1 else jnp.concatenate(sent, axis=0)
  p, r, _ = x_shape
  lay = _layout.RowSplit(p, r, opts["n"], _layout.choose_split(p, r, True))
  return lay.join(sent[0] if len(sent) == 1 else jnp.stack(sent))


def _gathered_zeros(rows_form, x_shape, sent, n):
  """The tangent of ``return_gathered``'s operand when ``x``'s is zero."""
  shape = list(x_shape)
  shape[1 if rows_form else -1] *= n
  return (
    jax.lax.pcast(
      jnp.zeros(shape, sent[0].dtype),
      tuple(jc.varying_axes(sent[0])),
      to="varying",
    )
    if jc.varying_axes(sent[0])
    else jnp.zeros(shape, sent[0].dtype)
  )


def _raw_gather(rows_form, x, ws, axis_name, options, stash=None):
  if _ref_whole.applies(rows_form, x, ws, options):
    o = dict(options)
    outs = _ref_whole.contracting(
      x,
      tuple(ws),
      axis_name,
      n=o["n"],
      stash=stash,
      accumulation=o.get("accumulation", "float32"),
    )
    return outs, None
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


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 3, 4))
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


def _allgather_jvp(rows_form, axis_name, options, primals, tangents):
  x, ws = primals
  tx, tws = tangents
  # The first start aliases x in place (the Ref API's first Ref holds it):
  # keeping x for the backward would make XLA copy it. Keep the buffers as
  # that start saw them (the same bytes, laid out as the ring sends them),
  # which the backward's weight-gradient ring sends again.
  stash = []
  out = _raw_gather(rows_form, x, ws, axis_name, options, stash)
  lin = (
    None if _zero(tx) else tx,
    None
    if all(_zero(t) for t in tws)
    else tuple(_inst(t, w) for t, w in zip(tws, ws, strict=True)),
  )
  fwd = functools.partial(
    _allgather_tangent, rows_form, axis_name, options, x.shape
  )
  has = tuple(v is not None for v in lin)
  bwd = functools.partial(
    _allgather_transpose, rows_form, axis_name, options, has
  )
  return out, _linear.call(fwd, bwd, (stash[0], ws), lin, out)


def _allgather_tangent(rows_form, axis_name, options, x_shape, res, lin):
  """``AG(tx) @ w + AG(x) @ tw`` (and ``AG(tx)``): the tangent rings."""
  sent, ws = res
  tx, tws = lin
  opts = dict(options)
  outs = gathered = None
  if tx is not None:
    outs, gathered = _raw_gather(rows_form, tx, ws, axis_name, options)
  if tws is not None:
    x = _unsent(rows_form, sent, x_shape, opts)
    plain = dict(opts, return_gathered=False)
    more, _ = _raw_gather(
      rows_form, x, tws, axis_name, tuple(sorted(plain.items()))
    )
    outs = (
      more
      if outs is None
      else tuple(a + b for a, b in zip(outs, more, strict=True))
    )
  if opts["return_gathered"] and gathered is None:
    gathered = _gathered_zeros(rows_form, x_shape, sent, opts["n"])
  return outs, gathered


def _allgather_transpose(rows_form, axis_name, options, has, res, ct):
  """The backward rings, for the tangents that are there (``has``); the
  other gradient's ring is dead code and goes."""
  dx, dws = _allgather_bwd(rows_form, axis_name, options, res, ct)
  return (dx if has[0] else None, tuple(dws) if has[1] else None)


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
  # The weight gradients first: their data-parallel all-reduce (weights
  # replicated over other mesh axes) then runs while the input gradient's
  # ring does (_dp_reduce).
  if not rows_form:  # x [M, k], w [n k, f]
    with jax.named_scope("d_rhs"):
      dws = _bwd_rings.gather_weights_contracting(x, gs, axis_name, **kw)
    d_lhs = _bwd_rings.scatter_columns_t
  else:  # x [P, R, k], w [k, f]
    with jax.named_scope("d_rhs"):
      dws = _bwd_rings.gather_weights_rows(x, gs, axis_name, **kw)
    d_lhs = _bwd_rings.scatter_rows_t

  def lhs_grad(gs, ws):
    with jax.named_scope("d_lhs"):
      return d_lhs(gs, ws, axis_name, **kw_rs)

  dws, dx = _dp_reduce.overlapped(dws, ws, lhs_grad, gs, ws)
  if g_gathered is not None:
    # The gathered operand's cotangent has no matmul to hide behind.
    dx = dx + jax.lax.psum_scatter(
      g_gathered.astype(dt), axis_name, scatter_dimension=1, tiled=True
    )
  return _like(dx, sent[0]), dws  # sent[0]: x's manual axes


allgather.defjvp(_allgather_jvp, symbolic_zeros=True)


# Matmul-reduce-scatter -------------------------------------------------------


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 3, 4))
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


def _reducescatter_jvp(rows_form, axis_name, options, primals, tangents):
  x, w = primals
  tx, tw = tangents
  out = _raw_scatter(rows_form, x, w, axis_name, options)
  lin = (None if _zero(tx) else tx, None if _zero(tw) else tw)
  has = tuple(v is not None for v in lin)

  def fwd(res, lin):  # RS(tx @ w) + RS(x @ tw)
    (x, w), (tx, tw) = res, lin
    terms = []
    if tx is not None:
      terms.append(_raw_scatter(rows_form, tx, w, axis_name, options))
    if tw is not None:
      terms.append(_raw_scatter(rows_form, x, tw, axis_name, options))
    return functools.reduce(jnp.add, terms)

  def bwd(res, g):
    dx, dw = _reducescatter_bwd(rows_form, axis_name, options, res, g)
    return (dx if has[0] else None, dw if has[1] else None)

  return out, _linear.call(fwd, bwd, (x, w), lin, out)


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


reducescatter.defjvp(_reducescatter_jvp, symbolic_zeros=True)


# All-reduce matmul -----------------------------------------------------------


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 3))
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


def _allreduce_jvp(forward, axis_name, primals, tangents):
  lhs, rhs = primals
  tl, tr = tangents
  out = forward(lhs, rhs, axis_name)
  lin = (None if _zero(tl) else tl, None if _zero(tr) else tr)
  has = tuple(v is not None for v in lin)

  def fwd(res, lin):  # forward(tl, rhs) + forward(lhs, tr)
    (lhs, rhs), (tl, tr) = res, lin
    terms = []
    if tl is not None:
      terms.append(forward(tl, rhs, axis_name))
    if tr is not None:
      terms.append(forward(lhs, tr, axis_name))
    return functools.reduce(jnp.add, terms)

  def bwd(res, g):
    dl, dr = _allreduce_bwd(forward, axis_name, res, g)
    return (dl if has[0] else None, dr if has[1] else None)

  return out, _linear.call(fwd, bwd, (lhs, rhs), lin, out)


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


allreduce.defjvp(_allreduce_jvp, symbolic_zeros=True)


# The fused kernels --------------------------------------------------------


def _bilinear_jvp(f, bwd, primals, tangents):
  """The JVP of ``f(x, w)``, bilinear in ``(x, w)``: ``f(x, w)`` and the
  tangent ``f(tx, w) + f(x, tw)`` as a linear map (``_linear.call``) whose
  transpose is ``bwd(res, g) -> (dx, dw)``."""
  x, w = primals
  tx, tw = tangents
  out = f(x, w)
  lin = (None if _zero(tx) else tx, None if _zero(tw) else tw)
  has = tuple(v is not None for v in lin)

  def fwd(res, lin):
    (x, w), (tx, tw) = res, lin
    terms = []
    if tx is not None:
      terms.append(f(tx, w))
    if tw is not None:
      terms.append(f(x, tw))
    return functools.reduce(jnp.add, terms)

  def transpose(res, g):
    dx, dw = bwd(res, g)
    return (dx if has[0] else None, dw if has[1] else None)

  return out, _linear.call(fwd, transpose, (x, w), lin, out)


def _fused_custom_jvp(name, kernel, bwd, doc):
  """``kernel(x, w, axis_name)`` (a fused kernel of ``_fused``) as a
  ``custom_jvp`` ``name(x, w, axis_name, n)``: forward mode runs the kernel
  on the tangents (``_bilinear_jvp``); the transpose is
  ``bwd(axis_name, n, (x, w), g)``."""

  def fused(x, w, axis_name, n):
    del n
    return kernel(x, w, axis_name)

  fused.__name__ = fused.__qualname__ = name
  fused.__doc__ = doc
  fused = jax.custom_jvp(fused, nondiff_argnums=(2, 3))

  def jvp(axis_name, n, primals, tangents):
    return _bilinear_jvp(
      lambda x, w: kernel(x, w, axis_name),
      functools.partial(bwd, axis_name, n),
      primals,
      tangents,
    )

  fused.defjvp(jvp, symbolic_zeros=True)
  return fused


def _fused_allgather_bwd(axis_name, n, res, g):
  x, w = res
  g = g.astype(x.dtype)
  # One-way rings: the two-way backward adds each weight-gradient block
  # from two half products in float32 (modelled slower, design/training.md).
  kw = dict(n=n, api="value", bidirectional=False)
  # The weight gradient first: its data-parallel all-reduce then runs
  # while the input gradient's ring does (_dp_reduce), as in the ring's
  # backward (_allgather_bwd).
  with jax.named_scope("d_rhs"):
    dws = _bwd_rings.gather_weights_contracting(x, (g,), axis_name, **kw)

  def lhs_grad(g, w):
    with jax.named_scope("d_lhs"):
      return _bwd_rings.scatter_columns_t((g,), (w,), axis_name, **kw)

  (dw,), dx = _dp_reduce.overlapped(dws, (w,), lhs_grad, g, w)
  return _like(dx, x), dw


def _fused_reducescatter_bwd(axis_name, n, res, g):
  x, w = res
  options = _options(False, x, n, True, "value", False)  # one-way, as above
  return _reducescatter_bwd(False, axis_name, options, (x, w), g)


fused_allgather = _fused_custom_jvp(
  "fused_allgather",
  lambda x, w, axis_name: _fused.allgather_matmul(x, w, axis_name),
  _fused_allgather_bwd,
  """``_fused.allgather_matmul(x [M, k], w [n k, f])``, differentiable:
  forward mode runs the fused kernel on the tangents; the backward is the
  contracting gather's ring backward (``_bwd_rings``).""",
)
fused_allgather_fwd = _fused_custom_jvp(
  "fused_allgather_fwd",
  lambda x, w, axis_name: _fused.allgather_matmul(
    x, w, axis_name, forward=True
  ),
  _fused_allgather_bwd,
  """``fused_allgather`` with the antipode's halves relayed by the
  neighbours (``forward=True``, ``AgSpec.forward``; auto's
  ``"fused_fwd"``), differentiable the same way.""",
)
fused_reducescatter = _fused_custom_jvp(
  "fused_reducescatter",
  lambda x, w, axis_name: _fused.matmul_reducescatter(x, w, axis_name),
  _fused_reducescatter_bwd,
  """``_fused.matmul_reducescatter(x [M, k], w [k, n c])``, differentiable:
  forward mode runs the fused kernel on the tangents; the backward is the
  scatter-columns ring backward (``_bwd_rings``).""",
)
fused_reducescatter_uni = _fused_custom_jvp(
  "fused_reducescatter_uni",
  lambda x, w, axis_name: _fused.matmul_reducescatter(
    x, w, axis_name, directions=1
  ),
  _fused_reducescatter_bwd,
  """``fused_reducescatter`` with the partial sums sent one way round the
  ring (``directions=1``: whole blocks, ``n - 1`` hops), differentiable
  the same way (forward mode runs this kernel on the tangents; the
  backward is the same one-way scatter-columns ring backward).""",
)


# XLA's collective ---------------------------------------------------------


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
def xla_allgather(x, ws, axis_name, dim):
  """``all_gather(x, dim) @ w`` for each ``w`` of ``ws`` with XLA's
  collective (``method="xla"``), differentiable with JAX's own formulas
  in an order of ours: the weight gradients first, so that their
  data-parallel all-reduce (``_dp_reduce``) runs while the input
  gradient's matmul and reduce-scatter do. (JAX's rules would ``psum``
  each weight gradient where it is ready, with nothing to hide behind.)

  Args:
    x: the local operand, sharded along ``dim`` over ``axis_name``.
    ws: a tuple of weights ``[k, f_i]`` (``k`` the gathered contracting
      size when ``dim`` is the last dimension).
    axis_name: the gathered mesh axis.
    dim: the gathered dimension of ``x`` (non-negative).

  Returns:
    ``(outs, gathered)``: a tuple of products and ``x`` gathered.
  """
  return _xla_allgather(x, ws, axis_name, dim)


def _xla_allgather(x, ws, axis_name, dim):
  gathered = jax.lax.all_gather(x, axis_name, axis=dim, tiled=True)
  return tuple(_auto.dot(gathered, w) for w in ws), gathered


def _xla_allgather_jvp(axis_name, dim, primals, tangents):
  x, ws = primals
  tx, tws = tangents
  outs, gathered = _xla_allgather(x, ws, axis_name, dim)
  lin = (
    None if _zero(tx) else tx,
    None
    if all(_zero(t) for t in tws)
    else tuple(_inst(t, w) for t, w in zip(tws, ws, strict=True)),
  )
  has = tuple(v is not None for v in lin)

  x_aval = jax.typeof(x)  # for the cotangent's type, not kept

  def fwd(res, lin):  # AG(tx) @ w + AG(x) @ tw, and AG(tx)
    (gathered, ws), (tx, tws) = res, lin
    touts = tgathered = None
    if tx is not None:
      touts, tgathered = _xla_allgather(tx, ws, axis_name, dim)
    if tws is not None:
      more = tuple(_auto.dot(gathered, t) for t in tws)
      touts = (
        more
        if touts is None
        else tuple(a + b for a, b in zip(touts, more, strict=True))
      )
    if tgathered is None:
      tgathered = jnp.zeros(gathered.shape, gathered.dtype)
      vary = tuple(sorted(jc.varying_axes(gathered)))
      if vary:
        tgathered = jax.lax.pcast(tgathered, vary, to="varying")
    return touts, tgathered

  def transpose(res, ct):
    dx, dws = _xla_allgather_bwd(axis_name, dim, x_aval, res, ct)
    return (dx if has[0] else None, tuple(dws) if has[1] else None)

  return (outs, gathered), _linear.call(
    fwd, transpose, (gathered, ws), lin, (outs, gathered)
  )


def _xla_allgather_bwd(axis_name, dim, x, res, ct):
  gathered, ws = res
  g_outs, g_gathered = ct
  dt = gathered.dtype
  gs = tuple(g.astype(dt) for g in g_outs)
  batch = tuple(range(gathered.ndim - 1))
  with jax.named_scope("d_rhs"):
    dws = tuple(
      jax.lax.dot_general(gathered, g, ((batch, batch), ((), ()))) for g in gs
    )

  def lhs_grad(gs, ws, g_gathered):
    with jax.named_scope("d_lhs"):
      dg = functools.reduce(
        jnp.add,
        [
          jax.lax.dot_general(g, w, (((g.ndim - 1,), (1,)), ((), ())))
          for g, w in zip(gs, ws, strict=True)
        ],
      )
      dg = dg + g_gathered.astype(dt)
      return jax.lax.psum_scatter(
        dg, axis_name, scatter_dimension=dim, tiled=True
      )

  dws, dx = _dp_reduce.overlapped(dws, ws, lhs_grad, gs, ws, g_gathered)
  return _like(dx, x), dws


xla_allgather.defjvp(_xla_allgather_jvp, symbolic_zeros=True)


# The seams the public functions call --------------------------------------


def gather(
  rows_form,
  x,
  ws,
  axis_name,
  api,
  bidirectional,
  n,
  return_gathered=False,
  accumulation="float32",
):
  """A differentiable gather ring; ``bidirectional`` only where it fits.

  ``accumulation="output"`` reaches the forward and tangent rings (the
  contracting form's accumulator, ``_gather_rings.accumulator_dtype``);
  the backward rings keep float32. The default adds no option (the
  options, and so the program, are those of before the setting).
  """
  extra = {} if accumulation == "float32" else {"accumulation": accumulation}
  options = _options(
    rows_form,
    x,
    n,
    False,
    api,
    bidirectional,
    return_gathered=return_gathered,
    **extra,
  )
  return allgather(bool(rows_form), x, tuple(ws), axis_name, options)


def scatter(rows_form, x, w, axis_name, api, bidirectional, n):
  """A differentiable scatter ring; ``bidirectional`` only where it fits."""
  options = _options(rows_form, x, n, True, api, bidirectional)
  return reducescatter(bool(rows_form), x, w, axis_name, options)
