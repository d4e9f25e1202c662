"""Matmul reduce-scatter rings on the canonical shapes.

The chapter's Problem 3.2, "permute the result as you accumulate it".
Every device holds a full-sized ``lhs @ rhs`` contribution split into ``n``
blocks; device ``i`` must end with block ``i`` of the sum over devices. A
partial sum of one block travels around the ring: at step ``s`` device
``i`` computes its contribution to block ``(i - s - 1) mod n`` while the
partial sum of that block, begun by the previous device, is in flight
towards it; after the done it adds the two and sends the sum on. After
``n - 1`` transfers device ``i`` holds the full sum of block ``i``. The
first block's matmul has no transfer to hide behind; each of the other
``n - 1`` sits inside one transfer's window. Only partial sums move, never
``lhs`` or ``rhs``.

:func:`columns`: ``x [M, k] @ w [k, n c]``, block ``b`` is the column block
``w[:, b c:(b + 1) c]`` (the chapter's down projection).

:func:`rows`: ``x [P, n R, k] @ w [k, f]``, block ``b`` is the row block
``x[:, b R:(b + 1) R]`` (sequence parallelism: the tokens are scattered
back after the down projection). ``P`` outer batches, usually 1.

Bidirectional: each block is split in two halves whose partial sums travel
in opposite directions (the first to ``i + 1``, the second to ``i - 1``),
halving the bytes per link per step (the chapter's Problem 4). With
``api="value"`` one accumulator moves with one ``bidirectional_start``
kernel per step (its first half of axis 0 each way); the two half partial
sums are added by one elementwise fusion that reads both where they are.
The Ref API moves two half accumulators with two permutes.

Limits. One mesh axis; ``n`` static (the loop is unrolled). The travelling
partial sums have the input dtype, as in XLA's reduce-scatter, so bfloat16
results round once per hop (within bfloat16 tolerance).
"""

import jax
import jax.numpy as jnp

from asyncops.collective_matmul import _layout, _ring


def blocks(me, s: int, n: int, bidirectional: bool):
  """Block worked on at step ``s`` by each travelling partial sum."""
  first = jax.lax.rem(me + 2 * n - s - 1, n)
  if not bidirectional:
    return (first,)
  return first, jax.lax.rem(me + s + 1, n)


def _add(acc, y):
  return acc + y.astype(acc.dtype)


def run(partials, join, bidirectional, axis_name, n, api, *operands):
  """Runs a reduce-scatter ring.

  Args:
    partials: ``partials(s, *operands)``: a tuple with this device's
      contribution to the block of each travelling partial sum at step
      ``s`` (one, or two halves).
    join: ``join(ys)``: a bidirectional value ring's two halves as the one
      buffer its kernel moves (halves along axis 0).
    bidirectional, axis_name, n, api: the ring.
    *operands: the inputs of ``partials`` (they pass the ring's barriers).

  Returns:
    The travelling buffers after the last step: one array (unidirectional,
    or joined halves) or two halves (bidirectional Ref ring).
  """
  one_kernel = bidirectional and api == "value"
  if not bidirectional:
    shifts = (1,)
  elif one_kernel:
    shifts = ("both",)
  else:
    shifts = (1, -1)
  with jax.named_scope("chunk0"):
    ys = partials(0, *operands)
    acc = (join(ys),) if one_kernel else ys
  ring = _ring.Ring(acc, shifts, axis_name, api)
  for s in range(1, n):

    def compute(sent, *operands, s=s):
      del sent
      return partials(s, *operands)

    with jax.named_scope(f"chunk{s}"):
      ys = ring.step(compute, *operands)
      cur = ring.values()
      if one_kernel:
        # One fusion reads both halves where they are (the join is fused
        # into the add).
        ring.set((_add(cur[0], join(ys)),))
      else:
        ring.set(tuple(_add(a, y) for a, y in zip(cur, ys, strict=True)))
  return ring.values()


def _cols(w, b, c: int):
  return jax.lax.dynamic_slice_in_dim(w, b * c, c, axis=1)


def columns(x, w, axis_name: str, *, n: int, api: str, bidirectional: bool):
  """``psum_scatter(x @ w, scatter_dimension=1, tiled=True)`` on a ring.

  Args:
    x: ``[M, k]`` (``M`` even if bidirectional).
    w: ``[k, n c]``, dtype of ``x``.
    axis_name: the ring axis (size ``n`` > 1).
    n: its size.
    api: ``"value"`` or ``"ref"``.
    bidirectional: the partial sums of half the rows travel each way.

  Returns:
    ``[M, c]`` in ``x.dtype``.
  """
  m, c = x.shape[0], w.shape[1] // n
  h = m // 2
  me = jax.lax.axis_index(axis_name)
  dt = x.dtype

  def partials(s, x, w):
    bs = blocks(me, s, n, bidirectional)
    xs = (x[:h], x[h:]) if bidirectional else (x,)
    return tuple(
      jnp.dot(xj, _cols(w, b, c), preferred_element_type=dt)
      for xj, b in zip(xs, bs, strict=True)
    )

  def join(ys):
    return jnp.concatenate(ys, axis=0)

  out = run(partials, join, bidirectional, axis_name, n, api, x, w)
  return out[0] if len(out) == 1 else join(out)


def rows(x, w, axis_name: str, *, n: int, api: str, bidirectional: bool):
  """``psum_scatter(x @ w, scatter_dimension=1, tiled=True)`` for 3-D x.

  Args:
    x: ``[P, n R, k]``: ``n`` blocks of ``R`` rows of each of ``P`` outer
      batches (``P`` or ``R`` even if bidirectional).
    w: ``[k, f]``, dtype of ``x``.
    axis_name: the ring axis (size ``n`` > 1).
    n: its size.
    api: ``"value"`` or ``"ref"``.
    bidirectional: the partial sums of half of every block travel each way.

  Returns:
    ``[P, R, f]`` in ``x.dtype``.
  """
  p, nr, k = x.shape
  r = nr // n
  lay = _layout.RowSplit(p, r, n, _layout.choose_split(p, r, bidirectional))
  me = jax.lax.axis_index(axis_name)
  dt = x.dtype
  xe = x.reshape(lay.expanded(k))

  def partials(s, xe, w):
    # Per direction, one dot per contiguous [R', k] piece, stacked into the
    # travelling [P', R', f] (the stack is fused into the add).
    h = lay.half_shape(k)[0]
    return tuple(
      jnp.stack(
        [
          jnp.dot(lay.read(xe, j, i, b), w, preferred_element_type=dt)
          for i in range(h)
        ]
      )
      for j, b in enumerate(blocks(me, s, n, bidirectional))
    )

  def join(ys):
    return jnp.stack(ys)

  out = run(partials, join, bidirectional, axis_name, n, api, xe, w)
  if not bidirectional:
    return out[0]
  return lay.join(out[0] if len(out) == 1 else join(out))
