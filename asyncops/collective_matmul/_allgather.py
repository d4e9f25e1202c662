"""All-gather collective matmul: ``all_gather(lhs, axis=1, tiled) @ rhs``.

Algorithm (the scaling book's "collective matmul", Wang et al. 2023). Inside
``shard_map`` over a ring of ``n`` devices, ``lhs`` is sharded along the
contracting dimension (per device ``[m, k]``, the global contracting size is
``n * k``) and ``rhs`` holds every contracting row (``[n * k, f]``). Device
``i`` starts with chunk ``i`` of ``lhs``. For ``s = 0 .. n - 2`` it starts
sending its current chunk to ``i - 1``, multiplies that chunk by the
matching ``k`` rows of ``rhs`` inside the transfer's window, and waits for
chunk ``i + s + 1`` to arrive from ``i + 1``. The last chunk is multiplied
after the last transfer. ``n - 1`` transfers each hide one chunk matmul;
nothing is gathered in full.

Bidirectional: the rows of ``lhs`` are split in two halves; the top half
travels to ``i + 1`` and the bottom half to ``i - 1``, so each link carries
half the bytes per step in each direction (the chapter's Problem 4). With
the value API one ``bidirectional_start`` kernel moves the whole ``[m, k]``
buffer (no slicing), and each step is one batched matmul
``[2, m/2, k] x [2, k, f]`` (the two halves meet different ``rhs`` rows)
into one ``[2, m/2, f]`` accumulator, which is ``[m, f]`` by a free reshape:
no concatenation. The Ref API moves two half buffers.

Limits. One mesh axis. Floating-point chunks accumulate in float32 (as a
``jnp.dot`` does internally) and round once to the input dtype; the result
equals the reference up to summation order.
"""

import functools

import jax
import jax.numpy as jnp

from asyncops.collective_matmul import _ring, _validate


def accumulator_dtype(dtype) -> jnp.dtype:
  """float32 for floating inputs (one rounding at the end), else ``dtype``."""
  dtype = jnp.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.floating):
    return jnp.dtype(jnp.promote_types(dtype, jnp.float32))
  return dtype


def chunk_matmul(x, w, acc):
  """``acc + x @ w`` accumulated in ``acc``'s dtype."""
  y = jnp.dot(x, w, preferred_element_type=acc.dtype)
  return acc + y


def _rows(rhs, chunk, k: int):
  return jax.lax.dynamic_slice_in_dim(rhs, chunk * k, k, axis=0)


def _unidirectional(lhs, rhs, axis_name: str, n: int, api: str):
  k = lhs.shape[1]
  me = jax.lax.axis_index(axis_name)
  acc = jnp.zeros((lhs.shape[0], rhs.shape[1]), accumulator_dtype(lhs.dtype))
  ring = _ring.Ring((lhs,), (-1,), axis_name, api)
  for s in range(n - 1):
    chunk = jax.lax.rem(me + s, n)

    def compute(sent, rhs, acc, chunk=chunk):
      return chunk_matmul(sent[0], _rows(rhs, chunk, k), acc)

    with jax.named_scope(f"chunk{s}"):
      acc = ring.step(compute, rhs, acc)
  with jax.named_scope(f"chunk{n - 1}"):
    (cur,) = ring.values()
    acc = chunk_matmul(cur, _rows(rhs, jax.lax.rem(me + n - 1, n), k), acc)
  return acc.astype(lhs.dtype)


def _bidirectional(lhs, rhs, axis_name: str, n: int, api: str):
  if api == "value":
    return _bidirectional_one_kernel(lhs, rhs, axis_name, n)
  return _bidirectional_halves(lhs, rhs, axis_name, n, api)


def _chunks(me, s: int, n: int):
  """Chunks held at step ``s``: top half ``me - s``, bottom ``me + s``."""
  return jax.lax.rem(me + n - s, n), jax.lax.rem(me + s, n)


def _batched_chunk_matmul(x, rhs, acc, chunks, k: int):
  """``acc[j] += x half j @ rhs rows of chunks[j]``, for ``j`` in 0, 1.

  Two matmuls, each updating its half of ``acc`` in place (no stacked
  copy of the ``rhs`` rows, no concatenation).
  """
  h = x.shape[0] // 2
  for j, c in enumerate(chunks):
    y = jnp.dot(
      x[j * h : (j + 1) * h], _rows(rhs, c, k), preferred_element_type=acc.dtype
    )
    acc = acc.at[j].add(y)
  return acc


def _bidirectional_one_kernel(lhs, rhs, axis_name: str, n: int):
  m, k = lhs.shape
  me = jax.lax.axis_index(axis_name)
  acc = jnp.zeros((2, m // 2, rhs.shape[1]), accumulator_dtype(lhs.dtype))
  ring = _ring.Ring((lhs,), ("both",), axis_name, "value")
  for s in range(n - 1):

    def compute(sent, rhs, acc, s=s):
      return _batched_chunk_matmul(sent[0], rhs, acc, _chunks(me, s, n), k)

    with jax.named_scope(f"chunk{s}"):
      acc = ring.step(compute, rhs, acc)
  with jax.named_scope(f"chunk{n - 1}"):
    (cur,) = ring.values()
    acc = _batched_chunk_matmul(cur, rhs, acc, _chunks(me, n - 1, n), k)
  return acc.reshape(m, rhs.shape[1]).astype(lhs.dtype)


def _bidirectional_halves(lhs, rhs, axis_name: str, n: int, api: str):
  """Two half buffers as two permutes (the Ref API has no bidirectional
  kernel); the accumulator is ``[2, m/2, f]`` as in the one-kernel form."""
  (m, k), h = lhs.shape, lhs.shape[0] // 2
  me = jax.lax.axis_index(axis_name)
  ring = _ring.Ring((lhs[:h], lhs[h:]), (1, -1), axis_name, api)
  acc = jnp.zeros((2, h, rhs.shape[1]), accumulator_dtype(lhs.dtype))

  def both(sent, rhs, acc, s):
    for j, c in enumerate(_chunks(me, s, n)):
      y = jnp.dot(sent[j], _rows(rhs, c, k), preferred_element_type=acc.dtype)
      acc = acc.at[j].add(y)
    return acc

  for s in range(n - 1):
    with jax.named_scope(f"chunk{s}"):
      acc = ring.step(functools.partial(both, s=s), rhs, acc)
  with jax.named_scope(f"chunk{n - 1}"):
    acc = both(ring.values(), rhs, acc, n - 1)
  return acc.reshape(m, rhs.shape[1]).astype(lhs.dtype)


def allgather_matmul(
  lhs,
  rhs,
  axis_name: str,
  *,
  api: _validate.Api = "value",
  bidirectional: bool = False,
):
  """All-gathers ``lhs`` along its columns and multiplies by ``rhs``.

  Equals ``jax.lax.all_gather(lhs, axis_name, axis=1, tiled=True) @ rhs``,
  with the gather hidden behind the chunk matmuls: each of the ``n - 1``
  ring transfers runs while the previous chunk is multiplied. This is the
  chapter's ``A[B_X, D_Y] * W[D, F_Y] -> Out[B_X, F_Y]``.

  Call it inside ``jax.shard_map`` (manual over every mesh axis); shapes
  are per device.

  Args:
    lhs: ``[m, k]``, this device's slice of the contracting dimension.
    rhs: ``[n * k, f]``, every contracting row, where ``n`` is the size of
      ``axis_name``. Same dtype as ``lhs``.
    axis_name: the mesh axis ``lhs``'s contracting dimension is sharded
      over.
    api: ``"value"`` (futures) or ``"ref"`` (double-buffered Refs,
      ``asyncops.stateful``); same result and schedule.
    bidirectional: send half of ``lhs``'s rows each way around the ring
      (``m`` must be even); halves the bytes per link per step.

  Returns:
    ``[m, f]`` in ``lhs.dtype``. With an axis of size 1, a plain local
    matmul.

  Raises:
    ValueError: ranks are not 2, ``rhs.shape[0] != n * lhs.shape[1]``,
      ``m`` is odd with ``bidirectional=True``, or an unknown ``api``.
    TypeError: mismatched or non-movable dtypes.
    NameError: ``axis_name`` is not bound.

  Example:
    >>> @jax.shard_map(mesh=mesh, in_specs=(P("x", "y"), P(None, "y")),
    ...                out_specs=P("x", "y"))
    ... def f(a, w):
    ...   return allgather_matmul(a, w, "y")  # doctest: +SKIP
  """
  fn = "allgather_matmul"
  n = _validate.matmul_operands(lhs, rhs, axis_name, api, fn)
  _validate.contracting(lhs, rhs, fn, n * lhs.shape[1])
  if bidirectional:
    _validate.even_rows(lhs, fn, "lhs")
  if n == 1:
    return jnp.dot(lhs, rhs, preferred_element_type=lhs.dtype)
  with jax.named_scope(fn):
    if bidirectional:
      return _bidirectional(lhs, rhs, axis_name, n, api)
    return _unidirectional(lhs, rhs, axis_name, n, api)
