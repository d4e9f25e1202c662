"""Normalization: any public shape to a few canonical ring shapes.

Every collective matmul here reduces to one of four canonical forms on
which the rings (``_gather_rings``, ``_scatter_rings``) are written:

=================  ==========================  ==========================
form               per device in               per device out
=================  ==========================  ==========================
gather contracting ``x [M, k]``, ``w [n k, f]``  ``[M, f]``
gather rows        ``x [P, R, k]``, ``w [k, f]`` ``[P, n R, f]``
scatter columns    ``x [M, k]``, ``w [k, n c]``  ``[M, c]``
scatter rows       ``x [P, n R, k]``, ``w [k, f]`` ``[P, R, f]``
=================  ==========================  ==========================

A user's ``lhs`` of shape ``S = (d_0, ..., d_{r-1})`` (contracting
dimension last) folds into these by **reshapes only**: no transpose, so no
copy (on TPU a reshape that merges or splits leading dimensions is a
bitcast when the second-minor dimension stays tile aligned).

- Gathering or scattering the last dimension (the contracting one for a
  gather, the output columns for a scatter): every leading dimension folds
  into the rows, ``M = d_0 * ... * d_{r-2}``.
- Gathering or scattering dimension ``g < r - 1`` (a row, token or batch
  dimension): ``P = d_0 * ... * d_{g-1}`` (the dimensions before ``g``,
  usually 1) and ``R = d_g * ... * d_{r-2}`` (``d_g`` and everything after
  it up to the contracting dimension). Device chunk ``c`` of the gathered
  ``[P, n R]`` is ``[:, c R:(c + 1) R]``, which is tiled gathering along
  ``g``: ``[P, n, d_g, Q]`` and ``[P, n d_g, Q]`` are the same bytes.

Bidirectional row forms send half of every chunk each way. The halves are
taken where a reshape gives them for free: along ``P`` when ``P`` is even
(``"outer"``), else along the rows ``R`` (``"rows"``; free when ``P`` is
1, a transpose of ``lhs`` (gather) or of the result (scatter) when ``P`` is
odd and above 1).
"""

import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp

Split = Literal["none", "outer", "rows"]


@dataclasses.dataclass(frozen=True)
class Fold:
  """How a public ``lhs`` folds into a canonical form.

  Attributes:
    shape: ``lhs``'s per-device shape.
    dim: the gathered/scattered dimension, normalized to ``[0, rank)``.
    n: the ring size.
    scatter: True for a reduce-scatter (``dim`` is a dimension of the
      output, whose size is ``shape[dim] // n`` there).
  """

  shape: tuple[int, ...]
  dim: int
  n: int
  scatter: bool = False

  @property
  def rows_form(self) -> bool:
    """Gathers or scatters a leading (row) dimension, not the last one."""
    return self.dim < len(self.shape) - 1

  @property
  def k(self) -> int:
    return self.shape[-1]

  @property
  def m(self) -> int:
    """Rows of the contracting/columns form."""
    return math.prod(self.shape[:-1])

  @property
  def p(self) -> int:
    """Rows form: the dimensions before ``dim``, folded."""
    return math.prod(self.shape[: self.dim])

  @property
  def r(self) -> int:
    """Rows form: the rows of one chunk (gather) or one block (scatter)."""
    r = math.prod(self.shape[self.dim : -1])
    return r // self.n if self.scatter else r

  def fold(self, x):
    """``lhs`` in its canonical shape (a reshape)."""
    if not self.rows_form:
      return x.reshape(self.m, self.k)
    n_r = self.r * self.n if self.scatter else self.r
    return x.reshape(self.p, n_r, self.k)

  def unfold(self, y, tail: int):
    """A canonical result back in ``lhs``'s leading dimensions.

    Args:
      y: ``[M, tail]`` (contracting/columns form) or ``[P, rows, tail]``.
      tail: the result's last dimension.
    """
    lead = list(self.shape[:-1])
    if self.rows_form:
      lead[self.dim] = (
        lead[self.dim] // self.n if self.scatter else lead[self.dim] * self.n
      )
    return y.reshape(*lead, tail)


def choose_split(p: int, r: int, bidirectional: bool) -> Split | None:
  """Where a bidirectional row form halves its chunks (None: impossible)."""
  if not bidirectional:
    return "none"
  if p % 2 == 0:
    return "outer"
  if r % 2 == 0:
    return "rows"
  return None


@dataclasses.dataclass(frozen=True)
class RowSplit:
  """Chunk, half and piece addressing of a row form.

  A row-form array with a trailing dimension ``t`` (``[P, n R, t]``: the
  gathered result, or the reduce-scatter's ``lhs``) is viewed, by a
  reshape, as ``[P, n, R, t]`` (``"none"``, ``"outer"``) or
  ``[P, n, 2, R/2, t]`` (``"rows"``). One chunk (or block) ``c`` of it is
  a list of **pieces**, each a contiguous ``[R', t]`` slab: one per outer
  batch ``p``, and per half with ``"rows"``. The rings multiply piece by
  piece, so no dynamic slice or update is ever strided across ``P`` (XLA
  answers a strided dynamic slice of a barrier operand with a layout
  changing copy per step).

  What travels (or is added up) is one ``[P', R', t]`` array per
  direction (``half_shape``), whose piece ``i`` is row ``i``:

  - ``"none"``: ``[P, R, t]``, piece ``i`` is batch ``i``;
  - ``"outer"``: half ``j`` is ``[P/2, R, t]``, piece ``i`` is batch
    ``j P/2 + i``;
  - ``"rows"``: half ``j`` is ``[P, R/2, t]``, piece ``i`` is rows
    ``j R/2:(j + 1) R/2`` of batch ``i``.
  """

  p: int
  r: int
  n: int
  split: Split

  def expanded(self, t: int) -> tuple[int, ...]:
    p, r, n = self.p, self.r, self.n
    if self.split == "rows":
      return (p, n, 2, r // 2, t)
    return (p, n, r, t)

  def half_shape(self, t: int) -> tuple[int, ...]:
    p, r = self.p, self.r
    return {
      "none": (p, r, t),
      "outer": (p // 2, r, t),
      "rows": (p, r // 2, t),
    }[self.split]

  def batch(self, j: int, i: int) -> int:
    """The outer batch of piece ``i`` of half ``j``."""
    return j * (self.p // 2) + i if self.split == "outer" else i

  def _starts(self, j: int, i: int, c):
    p = jnp.int32(self.batch(j, i))
    zero = jnp.int32(0)
    c = jnp.asarray(c, jnp.int32)
    if self.split == "rows":
      return (p, c, jnp.int32(j), zero, zero)
    return (p, c, zero, zero)

  def _sizes(self, t: int) -> tuple[int, ...]:
    if self.split == "rows":
      return (1, 1, 1, self.r // 2, t)
    return (1, 1, self.r, t)

  def read(self, x, j: int, i: int, c):
    """Piece ``i`` of half ``j`` (0 for ``"none"``) of chunk ``c`` of an
    expanded array, as ``[R', t]``."""
    t = x.shape[-1]
    y = jax.lax.dynamic_slice(x, self._starts(j, i, c), self._sizes(t))
    return y.reshape(self.half_shape(t)[1:])

  def write(self, x, y, j: int, i: int, c):
    """``x`` with piece ``i`` of half ``j`` of chunk ``c`` replaced by the
    ``[R', t]`` array ``y`` (in place)."""
    t = x.shape[-1]
    y = y.reshape(self._sizes(t))
    return jax.lax.dynamic_update_slice(x, y, self._starts(j, i, c))

  def halves(self, x):
    """A ``[P, R, t]`` chunk as ``[2, *half_shape]`` (bidirectional)."""
    p, r, t = x.shape
    if self.split == "outer":
      return x.reshape(2, p // 2, r, t)
    if p == 1:
      return x.reshape(2, 1, r // 2, t)
    # P odd above 1: the halves of every batch's rows, a transpose (copy).
    return jnp.swapaxes(x.reshape(p, 2, r // 2, t), 0, 1)

  def join(self, x):
    """Inverse of :meth:`halves`: ``[2, *half_shape]`` to ``[P, R, t]``."""
    t = x.shape[-1]
    if self.split == "rows" and self.p > 1:
      x = jnp.swapaxes(x, 0, 1)
    return x.reshape(self.p, self.r, t)
