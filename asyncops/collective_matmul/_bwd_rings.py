"""The rings of the collective matmuls' backward passes.

Each is a ring of the forward's runners (``_gather_rings.run``,
``_scatter_rings.run``: the same kernels, the same windows) with other
chunk work: ``jax.lax.dot_general`` contracting whichever dimensions the
gradient needs, so no operand is ever transposed (a transpose is a copy of
a whole buffer, and of a weight at that). ``g`` is the output cotangent,
per device; ``n`` the ring size; canonical shapes as in ``_vjp``.

- :func:`scatter_columns_t`: ``RS_cols(sum_i g_i @ w_i^T)`` for weights
  ``[n k, f_i]``: the input gradient of the gather-contracting matmul.
- :func:`scatter_rows_t`: ``RS_rows(sum_i g_i @ w_i^T)``: of the
  gather-rows matmul.
- :func:`gather_weights_contracting`: ``AG_k(x)^T @ g_i``: its weight
  gradients; ``x [M, k]`` travels and chunk ``c`` writes rows ``c`` of
  each ``[n k, f_i]``.
- :func:`gather_weights_rows`: ``sum_p AG_R(x)[p]^T @ g_i[p]``: the
  gather-rows matmul's weight gradients; ``x [P, R, k]`` travels and every
  chunk adds to ``[k, f_i]``.
- :func:`gather_columns_both`: the matmul-reduce-scatter (columns): ``g``
  travels once; each chunk gives ``dx += g_c @ w[:, c]^T`` in its window
  and (value API) is kept, a small ``[M, n c]`` buffer, for ``dw = x^T @
  AG(g)``, one product after the ring (Ref API: ``dw[:, c] = x^T @ g_c``
  in the window, a column update each).
- :func:`gather_rows_both`: the same for the row form.

Bidirectional rings halve what travels as the forward does; a weight
gradient block then receives two half contributions and starts from
zeros. Products accumulate in float32 (floating inputs) and round once.
"""

import jax
import jax.numpy as jnp

from asyncops.collective_matmul import _gather_rings, _layout, _scatter_rings

_acc = _gather_rings.accumulator_dtype


def _dot(a, b, ca: int, cb: int, dt):
  """``a`` contracted with ``b`` over ``a``'s dim ``ca``, ``b``'s ``cb``."""
  return jax.lax.dot_general(
    a, b, (((ca,), (cb,)), ((), ())), preferred_element_type=dt
  )


def _slice(x, start, size: int, axis: int):
  return jax.lax.dynamic_slice_in_dim(x, start * size, size, axis=axis)


def _add_block(buf, y, starts):
  """``buf`` with ``y`` added into the block at ``starts`` (in place)."""
  old = jax.lax.dynamic_slice(buf, starts, y.shape)
  return jax.lax.dynamic_update_slice(buf, old + y, starts)


def _row_bufs(x, bidirectional, api, lay):
  """A row-form chunk as the rows ring sends it."""
  if not bidirectional:
    return (x,)
  b = lay.halves(x)
  return (b,) if api == "value" else (b[0], b[1])


def _row_sent(sent, bidirectional):
  if bidirectional and len(sent) == 1:
    return (sent[0][0], sent[0][1])
  return sent


def _flat_bufs(x, bidirectional, api):
  """A ``[M, t]`` chunk as the contracting ring sends it: whole (one
  bidirectional kernel halves axis 0), or two row halves (Ref API)."""
  if bidirectional and api != "value":
    h = x.shape[0] // 2
    return (x[:h], x[h:])
  return (x,)


def _flat_sent(sent, bidirectional):
  if bidirectional and len(sent) == 1:
    h = sent[0].shape[0] // 2
    return (sent[0][:h], sent[0][h:])
  return sent


# Scatter rings (input gradients of the all-gather matmuls) ----------------


def scatter_columns_t(gs, ws, axis_name, *, n, api, bidirectional):
  """``psum_scatter(sum_i g_i @ w_i^T, 1, tiled)``; ``w_i [n k, f_i]``."""
  m, k = gs[0].shape[0], ws[0].shape[0] // n
  h = m // 2
  me = jax.lax.axis_index(axis_name)
  dt = gs[0].dtype

  def partials(s, gs, ws):
    out = []
    for j, b in enumerate(_scatter_rings.blocks(me, s, n, bidirectional)):
      y = None
      for g, w in zip(gs, ws, strict=True):
        gj = (g[:h], g[h:])[j] if bidirectional else g
        t = _dot(gj, _slice(w, b, k, 0), 1, 1, _acc(dt))
        y = t if y is None else y + t
      out.append(y.astype(dt))
    return tuple(out)

  def join(ys):
    return jnp.concatenate(ys, axis=0)

  out = _scatter_rings.run(
    partials, join, bidirectional, axis_name, n, api, tuple(gs), tuple(ws)
  )
  return out[0] if len(out) == 1 else join(out)


def scatter_rows_t(gs, ws, axis_name, *, n, api, bidirectional):
  """``psum_scatter(sum_i g_i @ w_i^T, 1, tiled)`` for ``g_i [P, n R, f_i]``
  and ``w_i [k, f_i]``; returns ``[P, R, k]``."""
  p, nr, _ = gs[0].shape
  r, k = nr // n, ws[0].shape[0]
  lay = _layout.RowSplit(p, r, n, _layout.choose_split(p, r, bidirectional))
  me = jax.lax.axis_index(axis_name)
  dt = gs[0].dtype
  ges = tuple(g.reshape(lay.expanded(g.shape[-1])) for g in gs)

  def partials(s, ges, ws):
    pieces = lay.half_shape(k)[0]
    out = []
    for j, b in enumerate(_scatter_rings.blocks(me, s, n, bidirectional)):
      rows = []
      for i in range(pieces):
        y = None
        for ge, w in zip(ges, ws, strict=True):
          t = _dot(lay.read(ge, j, i, b), w, 1, 1, _acc(dt))
          y = t if y is None else y + t
        rows.append(y.astype(dt))
      out.append(jnp.stack(rows))
    return tuple(out)

  def join(ys):
    return jnp.stack(ys)

  out = _scatter_rings.run(
    partials, join, bidirectional, axis_name, n, api, ges, tuple(ws)
  )
  if not bidirectional:
    return out[0]
  return lay.join(out[0] if len(out) == 1 else join(out))


# Gather rings ------------------------------------------------------------


def gather_weights_contracting(
  x, gs, axis_name, *, n, api, bidirectional, bufs=None
):
  """``[AG_k(x)^T @ g_i]`` for ``x [M, k]``, ``g_i [M, f_i]``: each
  ``[n k, f_i]`` in ``x.dtype``. ``bufs``: ``x`` as the forward ring sent
  it (then ``x`` may be a ``jax.ShapeDtypeStruct``)."""
  m, k = x.shape
  h = m // 2
  me = jax.lax.axis_index(axis_name)
  acc_dt = _acc(x.dtype)
  # One-way, every block is one whole product (x.dtype, one rounding);
  # two-way, two halves add in acc_dt.
  if bidirectional:
    dws = tuple(jnp.zeros((n, k, g.shape[1]), acc_dt) for g in gs)
  else:
    dws = tuple(_gather_rings._empty((n, k, g.shape[1]), x.dtype) for g in gs)

  def consume(s, sent, gs, dws):
    sent = _flat_sent(sent, bidirectional)
    dws = list(dws)
    for j, (xj, c) in enumerate(
      zip(sent, _gather_rings.chunks(me, s, n, bidirectional), strict=True)
    ):
      for o, g in enumerate(gs):
        gj = (g[:h], g[h:])[j] if bidirectional else g
        y = _dot(xj, gj, 0, 0, acc_dt)[None]
        at = (jnp.asarray(c, jnp.int32), jnp.int32(0), jnp.int32(0))
        if bidirectional:
          dws[o] = _add_block(dws[o], y, at)
        else:
          dws[o] = jax.lax.dynamic_update_slice(dws[o], y.astype(x.dtype), at)
    return tuple(dws)

  bufs = bufs or _flat_bufs(x, bidirectional, api)
  dws = _gather_rings.run(bufs, bidirectional, axis_name, n, api, consume)(
    tuple(gs), dws
  )
  return tuple(d.reshape(n * k, d.shape[-1]).astype(x.dtype) for d in dws)


def gather_weights_rows(x, gs, axis_name, *, n, api, bidirectional, bufs=None):
  """``[sum_p AG_R(x)[p]^T @ g_i[p]]`` for ``x [P, R, k]``, ``g_i [P, n R,
  f_i]``: each ``[k, f_i]`` in ``x.dtype``. ``bufs``: as
  :func:`gather_weights_contracting`."""
  p, r, k = x.shape
  lay = _layout.RowSplit(p, r, n, _layout.choose_split(p, r, bidirectional))
  me = jax.lax.axis_index(axis_name)
  acc_dt = _acc(x.dtype)
  ges = tuple(g.reshape(lay.expanded(g.shape[-1])) for g in gs)

  def consume(s, sent, ges, dws):
    sent = _row_sent(sent, bidirectional)
    dws = list(dws)
    for j, (xj, c) in enumerate(
      zip(sent, _gather_rings.chunks(me, s, n, bidirectional), strict=True)
    ):
      for i in range(xj.shape[0]):
        for o, ge in enumerate(ges):
          y = _dot(xj[i], lay.read(ge, j, i, c), 0, 0, acc_dt)
          dws[o] = y if dws[o] is None else dws[o] + y
    return tuple(dws)

  bufs = bufs or _row_bufs(x, bidirectional, api, lay)
  dws = _gather_rings.run(bufs, bidirectional, axis_name, n, api, consume)(
    ges, tuple(None for _ in gs)
  )
  return tuple(d.astype(x.dtype) for d in dws)


def gather_columns_both(g, x, w, axis_name, *, n, api, bidirectional):
  """The scatter-columns matmul's ``(dx, dw)``: ``g [M, c]`` travels;
  ``x [M, k]``, ``w [k, n c]``."""
  m, c = g.shape
  k = x.shape[1]
  h = m // 2
  me = jax.lax.axis_index(axis_name)
  acc_dt = _acc(g.dtype)
  # dw [k, n c] = x^T @ AG(g): block b is columns b c:(b + 1) c. Writing
  # each block's product into a [k, n c] buffer costs a separate update of
  # the weight-sized buffer per step (XLA does not fuse a column block into
  # the dot). Value API: the ring keeps the chunks of g it receives
  # (columns of a small [M, n c] buffer, the size of one activation) and
  # dw is one product after the ring. Ref API: the blocks are written as
  # they come (keeping a received Ref slot makes XLA stage it in VMEM while
  # the next transfer sends it: a copy of a buffer in flight).
  keep = api == "value"
  if keep:
    dw = _gather_rings._empty((m, n * c), g.dtype)  # AG(g)
  elif bidirectional:
    dw = jnp.zeros((k, n * c), acc_dt)
  else:
    dw = _gather_rings._empty((k, n * c), w.dtype)
  dx = None if not bidirectional else _gather_rings._empty((2, h, k), acc_dt)

  def consume(s, sent, operands, carry):
    x, w = operands
    dx, dw = carry
    sent = _flat_sent(sent, bidirectional)
    for j, (gj, b) in enumerate(
      zip(sent, _gather_rings.chunks(me, s, n, bidirectional), strict=True)
    ):
      y = _dot(gj, _slice(w, b, c, 1), 1, 1, acc_dt)  # [M', k]
      if not bidirectional:
        dx = y if s == 0 else dx + y
      elif s == 0:
        dx = dx.at[j].set(y)
      else:
        dx = dx.at[j].add(y)
      col = jnp.asarray(b, jnp.int32) * c
      if keep:
        dw = jax.lax.dynamic_update_slice(dw, gj, (jnp.int32(j * h), col))
        continue
      xj = (x[:h], x[h:])[j] if bidirectional else x
      z = _dot(xj, gj, 0, 0, acc_dt)  # [k, c]
      if bidirectional:
        dw = _add_block(dw, z, (jnp.int32(0), col))
      else:
        dw = jax.lax.dynamic_update_slice(
          dw, z.astype(dw.dtype), (jnp.int32(0), col)
        )
    return dx, dw

  bufs = _flat_bufs(g, bidirectional, api)
  dx, dw = _gather_rings.run(bufs, bidirectional, axis_name, n, api, consume)(
    (x, w), (dx, dw)
  )
  if keep:
    dw = _dot(x, dw, 0, 0, acc_dt)  # [k, n c]
  return dx.reshape(m, k).astype(x.dtype), dw.astype(w.dtype)


def gather_rows_both(g, x, w, axis_name, *, n, api, bidirectional):
  """The scatter-rows matmul's ``(dx, dw)``: ``g [P, R, d]`` travels;
  ``x [P, n R, k]``, ``w [k, d]``."""
  p, r, d = g.shape
  k = x.shape[-1]
  lay = _layout.RowSplit(p, r, n, _layout.choose_split(p, r, bidirectional))
  me = jax.lax.axis_index(axis_name)
  acc_dt = _acc(g.dtype)
  xe = x.reshape(lay.expanded(k))
  dx = _gather_rings._empty(lay.expanded(k), x.dtype)  # each piece once

  def consume(s, sent, operands, carry):
    xe, w = operands
    dx, dw = carry
    sent = _row_sent(sent, bidirectional)
    for j, (gj, c) in enumerate(
      zip(sent, _gather_rings.chunks(me, s, n, bidirectional), strict=True)
    ):
      for i in range(gj.shape[0]):
        piece = gj[i]  # [R', d]
        y = _dot(piece, w, 1, 1, acc_dt).astype(x.dtype)  # [R', k]
        dx = lay.write(dx, y, j, i, c)
        z = _dot(lay.read(xe, j, i, c), piece, 0, 0, acc_dt)  # [k, d]
        dw = z if dw is None else dw + z
    return dx, dw

  bufs = _row_bufs(g, bidirectional, api, lay)
  dx, dw = _gather_rings.run(bufs, bidirectional, axis_name, n, api, consume)(
    (xe, w), (dx, None)
  )
  return dx.reshape(p, n * r, k), dw.astype(w.dtype)
