"""All-gather matmul over a 2-D torus: all four links of every chip.

``all_gather(lhs, (x, y), axis=1, tiled=True) @ rhs`` where ``lhs [M, k]``
is this device's slice of the contracting dimension, sharded over both
mesh axes (``P(None, ("x", "y"))``: chunk ``c = ix * ny + iy``), and
``rhs [nx ny k, f]`` holds every contracting row.

Algorithm (dimension-ordered, two halves). The rows of ``lhs`` are split in
two halves that travel in opposite dimension orders, each half moving with
a ``bidirectional_start`` (its first half of rows one way round the ring,
its second half the other way), so every step keeps the +x, -x, +y and -y
links busy:

- half ``A`` (rows ``[0, M/2)``) goes around the x ring for ``nx - 1``
  steps, collecting the x column's chunks into ``GA [2, nx, M/4, k]``;
  then ``GA`` goes around the y ring for ``ny - 1`` steps;
- half ``B`` (rows ``[M/2, M)``) goes around y first (collecting
  ``GB [2, ny, M/4, k]``), then ``GB`` around x.

Both halves take ``(nx - 1) + (ny - 1)`` transfers (6 on a 4x4 torus,
against 15 on a 16-device ring). Every block is multiplied by its rows of
``rhs`` inside the window of the next transfer (the second phase's first
window holds the first phase's last products), accumulating in float32
``[4, M/4, f]`` (row quarters), one rounding at the end. Phase-two
transfers carry ``n`` chunk quarters each, and their windows ``n``
matmuls: bytes and compute grow together.

Limits. Two mesh axes of size >= 2; ``M`` divisible by 4; value API only;
no gradient rule (use the one-axis :func:`allgather_matmul` to train). When
``nx != ny`` both halves use the same axis on some steps (correct, but not
four links). The weights' rows of one phase-two block are strided in
``rhs``, so each block is ``n`` separate chunk matmuls.
"""

import jax
import jax.numpy as jnp

from asyncops.collective_matmul import _gather_rings, _ring, _validate
from asyncops.futures import _api as futures


def _step(sends, compute, *operands):
  """Starts every ``(buffer, axis)`` bidirectional transfer, runs
  ``compute(sent, *operands)`` between the starts and the dones (two
  barriers, ``_ring.window``), waits; returns ``(received, out)``."""
  with jax.named_scope("torus_step"):
    started = []
    for b, ax in sends:
      # The axis in the op name: tools reading the compiled HLO
      # (benchmarks/_timeline) route the transfer by it.
      with jax.named_scope(f"ring_axis_{ax}"):
        started.append(futures.bidirectional_start(b, ax))
    return _ring.window(started, compute, *operands)


def _rows(w, c, k):
  return jax.lax.dynamic_slice_in_dim(w, c * k, k, axis=0)


def torus(x, w, axes: tuple[str, str], nx: int, ny: int):
  """The algorithm above on canonical ``x [M, k]``, ``w [nx ny k, f]``."""
  m, k = x.shape
  q = m // 4
  xa, ya = axes
  ix = jax.lax.axis_index(xa)
  iy = jax.lax.axis_index(ya)
  acc_dt = _gather_rings.accumulator_dtype(x.dtype)
  sizes = {xa: nx, ya: ny}
  me = {xa: ix, ya: iy}

  def chunk(cx, cy):
    return jax.lax.rem(cx + nx, nx) * ny + jax.lax.rem(cy + ny, ny)

  # Work items: (kind, step, buffer-or-None): None = read the sent buffer.
  def products(item, buf, w, acc):
    half, kind, s = item
    if kind == "p1":
      # buf [M/2, k]: first quarter came from index - s, second from + s
      # along the half's first axis.
      for j, d in enumerate((-s, s)):
        piece = buf[j * q : (j + 1) * q]
        c = chunk(ix + d, iy) if half == "A" else chunk(ix, iy + d)
        y = jnp.dot(piece, _rows(w, c, k), preferred_element_type=acc_dt)
        acc = acc.at[2 * (half == "B") + j].add(y)
      return acc
    # p2: buf [2, n, M/4, k]; the whole block came from index -+ s along
    # the half's second axis; its n chunks span the first axis.
    n = nx if half == "A" else ny
    for j, d in enumerate((-s, s)):
      for i in range(n):
        c = chunk(i, iy + d) if half == "A" else chunk(ix + d, i)
        y = jnp.dot(buf[j, i], _rows(w, c, k), preferred_element_type=acc_dt)
        acc = acc.at[2 * (half == "B") + j].add(y)
    return acc

  def store(g, buf, s, axis):
    n = sizes[axis]
    for j, d in enumerate((-s, s)):
      slot = jax.lax.rem(me[axis] + d + n, n)
      g = jax.lax.dynamic_update_slice(
        g, buf[None, None, j * q : (j + 1) * q], (j, slot, 0, 0)
      )
    return g

  order = {"A": (xa, ya), "B": (ya, xa)}
  cur = {"A": x[: 2 * q], "B": x[2 * q :]}
  gath = {
    h: jax.lax.empty((2, sizes[order[h][0]], q, k), x.dtype) for h in "AB"
  }
  work = {h: (h, "p1", 0) for h in "AB"}  # the held buffer is cur
  held = {h: None for h in "AB"}  # a work buffer that is not cur
  acc = jnp.zeros((4, q, w.shape[1]), acc_dt)
  p1 = {"A": nx - 1, "B": ny - 1}
  total = (nx - 1) + (ny - 1)
  for j in range(total):
    sends = []
    for h in "AB":
      first, second = order[h]
      if j < p1[h]:
        if j == 0:
          gath[h] = store(gath[h], cur[h], 0, first)
        sends.append((cur[h], first))
      else:
        if j == p1[h]:  # phase two: send the gathered block
          held[h] = cur[h]
          cur[h] = gath[h]
        sends.append((cur[h], second))

    def compute(sent, held_bufs, w, acc):
      for i, h in enumerate("AB"):
        buf = sent[i] if held_bufs[i] is None else held_bufs[i]
        if work[h] is not None:
          acc = products(work[h], buf, w, acc)
      return acc

    with jax.named_scope(f"torus{j}"):
      received, acc = _step(
        tuple(sends), compute, (held["A"], held["B"]), w, acc
      )
    for i, h in enumerate("AB"):
      first, _ = order[h]
      cur[h], held[h] = received[i], None
      if j < p1[h]:
        gath[h] = store(gath[h], cur[h], j + 1, first)
        work[h] = (h, "p1", j + 1)
      else:
        work[h] = (h, "p2", j - p1[h] + 1)
  with jax.named_scope(f"torus{total}"):
    for h in "AB":
      acc = products(work[h], cur[h], w, acc)
  return acc.reshape(m, w.shape[1]).astype(x.dtype)


def torus_allgather_matmul(lhs, rhs, axis_names: tuple[str, str]):
  """All-gathers ``lhs`` over two mesh axes (a 2-D torus) and multiplies.

  Equals ``jax.lax.all_gather(lhs, axis_names, axis=lhs.ndim - 1,
  tiled=True) @ rhs``: ``lhs`` is this device's slice of the contracting
  dimension, sharded over both axes in mesh order (``P(None, ("x",
  "y"))``). Chunks travel on all four links of every chip (see the module
  docstring), each multiplied inside the next transfer's window.

  Args:
    lhs: ``[..., k]``, the leading dimensions' product divisible by 4.
    rhs: ``[nx * ny * k, f]``, same dtype.
    axis_names: the two mesh axes, each of size >= 2.

  Returns:
    ``[..., f]`` in ``lhs.dtype``.

  Raises:
    ValueError: not two distinct axes, an axis of size 1, shapes that
      disagree, or rows not divisible by 4.
    TypeError: mismatched or non-movable dtypes.
    NameError: an axis is not bound.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import AxisType, PartitionSpec as P
    >>> from asyncops.collective_matmul import torus_allgather_matmul
    >>> auto = (AxisType.Auto,) * 2
    >>> mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=auto)
    >>> @jax.jit
    ... @jax.shard_map(mesh=mesh, in_specs=(P(None, ("x", "y")),
    ...                P(None, ("x", "y"))), out_specs=P(None, ("x", "y")))
    ... def f(a, w):
    ...   return torus_allgather_matmul(a, w, ("x", "y"))
    >>> a = jnp.arange(8.0 * 16).reshape(8, 16) % 7
    >>> w = jnp.arange(16.0 * 8).reshape(16, 8) / 16
    >>> bool(jnp.allclose(f(a, w), a @ w))
    True
  """
  fn = "torus_allgather_matmul"
  if (
    not isinstance(axis_names, tuple | list)
    or len(axis_names) != 2
    or len(set(axis_names)) != 2
  ):
    raise ValueError(
      f"{fn}: axis_names must be two distinct mesh axis names, e.g. "
      f"('x', 'y'), got {axis_names!r}. For one axis use allgather_matmul."
    )
  _validate.operand(lhs, fn, "lhs", matrix=False)
  _validate.operand(rhs, fn, "rhs", matrix=True)
  _validate.same_dtype(lhs, rhs, fn)
  nx, ny = (_validate.axis(a, fn) for a in axis_names)
  if nx < 2 or ny < 2:
    raise ValueError(
      f"{fn}: axes {tuple(axis_names)} have sizes ({nx}, {ny}); both must "
      "be >= 2. Over one axis use allgather_matmul."
    )
  k = lhs.shape[-1]
  if rhs.shape[0] != nx * ny * k:
    raise ValueError(
      f"{fn}: rhs has {rhs.shape[0]} rows but the gathered lhs has "
      f"{nx} * {ny} * {k} = {nx * ny * k} columns; rhs must be "
      f"[{nx * ny * k}, f] (every contracting row)."
    )
  m = 1
  for d in lhs.shape[:-1]:
    m *= d
  if m % 4:
    raise ValueError(
      f"{fn}: lhs has {m} rows (the product of its leading dimensions); "
      "the torus splits them in four quarters (two halves, each sent both "
      "ways). Pad lhs to a multiple of 4 rows."
    )
  with jax.named_scope(fn):
    y = torus(lhs.reshape(m, k), rhs, tuple(axis_names), nx, ny)
  return y.reshape(lhs.shape[:-1] + (rhs.shape[1],))
