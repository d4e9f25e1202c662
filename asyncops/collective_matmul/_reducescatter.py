"""Reduce-scatter collective matmul: ``psum_scatter(lhs @ rhs, 1, tiled)``.

Algorithm (the chapter's Problem 3.2, "permute the result as you
accumulate it"). Inside ``shard_map`` over a ring of ``n`` devices each
device holds ``lhs`` ``[m, k]`` and ``rhs`` ``[k, n * c]``; the result on
device ``i`` is column block ``i`` of the sum over devices of ``lhs @ rhs``.
A partial accumulator for one column block travels around the ring: at
step ``s`` device ``i`` computes its contribution to block
``(i - s - 1) mod n`` while the accumulator of that block, begun by the
previous device, is in flight towards it; after the done it adds the two
and sends the sum on. After ``n - 1`` transfers device ``i`` holds the full
sum of block ``i``. The first chunk matmul has no transfer to hide behind;
each of the other ``n - 1`` sits inside one transfer's window. Only the
partial sums move (``[m, c]`` per step), never ``lhs`` or ``rhs``.

Bidirectional: the rows are split in two halves whose accumulators travel
in opposite directions (top half to ``i + 1``, bottom half to ``i - 1``),
halving the bytes per link per step (the chapter's Problem 4). With the
value API one ``[m, c]`` accumulator moves with one ``bidirectional_start``
kernel per step (its first half of rows to ``i + 1``, the second to
``i - 1``) and each half's partial sum is added to its half in place: no
slicing of the accumulator and no concatenation. The Ref API moves two half
accumulators as two permutes and concatenates them at the end.

Limits. One mesh axis; ``rhs.shape[1]`` must be divisible by ``n``. The
travelling partial sums have the input dtype, as in XLA's reduce-scatter,
so bfloat16 results round once per hop (within bfloat16 tolerance).
"""

import functools

import jax
import jax.numpy as jnp

from asyncops.collective_matmul import _ring, _validate


def _cols(rhs, chunk, c: int):
  return jax.lax.dynamic_slice_in_dim(rhs, chunk * c, c, axis=1)


def _partial(x, w, out_dtype):
  return jnp.dot(x, w, preferred_element_type=out_dtype)


def _add(acc, y):
  return acc + y.astype(acc.dtype)


def _unidirectional(lhs, rhs, axis_name: str, n: int, api: str):
  c = rhs.shape[1] // n
  me = jax.lax.axis_index(axis_name)

  def block(s):
    return jax.lax.rem(me + 2 * n - s - 1, n)

  with jax.named_scope("chunk0"):
    acc = _partial(lhs, _cols(rhs, block(0), c), lhs.dtype)
  ring = _ring.Ring((acc,), (1,), axis_name, api)
  for s in range(1, n):

    def compute(sent, lhs, rhs, s=s):
      del sent
      return _partial(lhs, _cols(rhs, block(s), c), lhs.dtype)

    with jax.named_scope(f"chunk{s}"):
      y = ring.step(compute, lhs, rhs)
      (acc,) = ring.values()
      ring.set((_add(acc, y),))
  return ring.values()[0]


def _blocks(me, s: int, n: int):
  """Blocks worked on at step ``s``: top half ``me - s - 1``, bottom
  ``me + s + 1`` (the top accumulator travels to ``index + 1``, the bottom
  one to ``index - 1``; both end on the device that owns their block)."""
  return jax.lax.rem(me + 2 * n - s - 1, n), jax.lax.rem(me + s + 1, n)


def _half_partials(lhs, rhs, blocks, c: int):
  """``(top @ cols(blocks[0]), bottom @ cols(blocks[1]))``."""
  h = lhs.shape[0] // 2
  halves = (lhs[:h], lhs[h:])
  return tuple(
    _partial(x, _cols(rhs, b, c), lhs.dtype)
    for x, b in zip(halves, blocks, strict=True)
  )


def _add_halves(acc, ys):
  """``acc + [ys[0]; ys[1]]``: one elementwise fusion that reads the two
  halves where they are (the row concatenation is fused into the add)."""
  y = jnp.concatenate(ys, axis=0)
  return y if acc is None else _add(acc, y)


def _bidirectional(lhs, rhs, axis_name: str, n: int, api: str):
  if api == "value":
    return _bidirectional_one_kernel(lhs, rhs, axis_name, n)
  return _bidirectional_halves(lhs, rhs, axis_name, n, api)


def _bidirectional_one_kernel(lhs, rhs, axis_name: str, n: int):
  """One ``[m, c]`` accumulator moved by one bidirectional kernel per step;
  each half's partial sum is added to its half in place."""
  c = rhs.shape[1] // n
  me = jax.lax.axis_index(axis_name)
  with jax.named_scope("chunk0"):
    acc = _add_halves(None, _half_partials(lhs, rhs, _blocks(me, 0, n), c))
  ring = _ring.Ring((acc,), ("both",), axis_name, "value")
  for s in range(1, n):

    def compute(sent, lhs, rhs, s=s):
      del sent
      return _half_partials(lhs, rhs, _blocks(me, s, n), c)

    with jax.named_scope(f"chunk{s}"):
      ys = ring.step(compute, lhs, rhs)
      (acc,) = ring.values()
      ring.set((_add_halves(acc, ys),))
  return ring.values()[0]


def _bidirectional_halves(lhs, rhs, axis_name: str, n: int, api: str):
  """Two half accumulators as two permutes (the Ref API has no
  bidirectional kernel), concatenated at the end."""
  c = rhs.shape[1] // n
  me = jax.lax.axis_index(axis_name)

  def both(sent, lhs, rhs, s):
    del sent
    return _half_partials(lhs, rhs, _blocks(me, s, n), c)

  with jax.named_scope("chunk0"):
    acc = both((), lhs, rhs, 0)
  ring = _ring.Ring(acc, (1, -1), axis_name, api)
  for s in range(1, n):
    with jax.named_scope(f"chunk{s}"):
      y = ring.step(functools.partial(both, s=s), lhs, rhs)
      acc = ring.values()
      ring.set((_add(acc[0], y[0]), _add(acc[1], y[1])))
  return jnp.concatenate(ring.values(), axis=0)


def matmul_reducescatter(
  lhs,
  rhs,
  axis_name: str,
  *,
  api: _validate.Api = "value",
  bidirectional: bool = False,
):
  """Multiplies ``lhs @ rhs`` and reduce-scatters the columns.

  Equals ``jax.lax.psum_scatter(lhs @ rhs, axis_name, scatter_dimension=1,
  tiled=True)``, with each hop of the reduce-scatter hidden behind the next
  chunk matmul. This is the chapter's down projection
  ``Tmp[B_X, F_Y] * W2[F_Y, D] -> Out[B_X, D_Y]``.

  Call it inside ``jax.shard_map`` (manual over every mesh axis); shapes
  are per device.

  Args:
    lhs: ``[m, k]``, this device's slice of the contracting dimension.
    rhs: ``[k, f]``, the matching rows; ``f`` must be divisible by the size
      ``n`` of ``axis_name``. Same dtype as ``lhs``.
    axis_name: the mesh axis to reduce over.
    api: ``"value"`` (futures) or ``"ref"`` (double-buffered Refs,
      ``asyncops.stateful``); same result and schedule.
    bidirectional: send the partial sums of half the rows each way around
      the ring (``m`` must be even).

  Returns:
    ``[m, f // n]`` in ``lhs.dtype``: column block ``axis_index`` of the
    sum. With an axis of size 1, a plain local matmul.

  Raises:
    ValueError: ranks are not 2, the contracting sizes differ, ``f`` is not
      divisible by ``n``, ``m`` is odd with ``bidirectional=True``, or an
      unknown ``api``.
    TypeError: mismatched or non-movable dtypes.
    NameError: ``axis_name`` is not bound.

  Example:
    >>> @jax.shard_map(mesh=mesh, in_specs=(P("x", "y"), P("y", None)),
    ...                out_specs=P("x", "y"))
    ... def f(h, w2):
    ...   return matmul_reducescatter(h, w2, "y")  # doctest: +SKIP
  """
  fn = "matmul_reducescatter"
  n = _validate.matmul_operands(lhs, rhs, axis_name, api, fn)
  _validate.contracting(lhs, rhs, fn, lhs.shape[1])
  if rhs.shape[1] % n:
    raise ValueError(
      f"{fn}: rhs.shape[1] = {rhs.shape[1]} is not divisible by the size "
      f"{n} of axis {axis_name!r}, so the result cannot be scattered in "
      "equal column blocks (as psum_scatter(tiled=True) requires). Pad "
      f"rhs's columns to a multiple of {n}, or use matmul_allreduce, which "
      "pads for you."
    )
  if bidirectional:
    _validate.even_rows(lhs, fn, "lhs")
  if n == 1:
    return jnp.dot(lhs, rhs, preferred_element_type=lhs.dtype)
  with jax.named_scope(fn):
    if bidirectional:
      return _bidirectional(lhs, rhs, axis_name, n, api)
    return _unidirectional(lhs, rhs, axis_name, n, api)
