"""XLA's flagged all-gather matmul decompositions, emitted with ``jax.lax``.

Auto cannot set compiler options (they belong to the whole program), but
it can emit, inside ``shard_map``, the program two of them make XLA write
for ``all_gather(x) @ w`` (the contracting dimension gathered), so that a
default compile schedules about the same:

- ``directions=1``, XLA's unrolled windowed einsum
  (``xla_tpu_spmd_unroll_windowed_einsum``): ``n - 1`` transfers of the
  whole chunk to ``index - 1`` (``lax.ppermute``); at step ``s`` the
  device holds chunk ``(index + s) mod n``, multiplies it by its rows of
  ``w`` and adds the product into the accumulator in the dot's own
  output fusion; the next transfer runs under that dot.
- ``directions=2``, XLA's collective matmul
  (``xla_tpu_all_gather_collective_matmul_mode=post_spmd``): whole
  chunks both ways, to ``index + 1`` (holding ``index - s``) and to
  ``index - 1`` (holding ``index + s``); every step meets the two chunks
  it holds with **one** dot over the stacked pair (a contraction of
  ``2 k``) and one accumulator pass: ``n / 2 + 1`` passes, ``n / 2``
  transfers. On an even ring the antipode arrives at step ``n / 2`` from
  one side, its rows split: half each way.

Accumulation. XLA's flagged programs accumulate in the **output dtype**
(a bfloat16 ``[M, f]`` for bfloat16 operands, rounded at every step),
which halves each accumulator pass against the library's float32
accumulator. ``acc="float32"`` (the default, the library's numerics:
float32 for floating inputs, int32 for int8, one rounding at the end)
keeps the library's precision; ``acc="output"`` is XLA's numerics, for
measurement only (``tests/test_xla_ring.py`` bounds its error: at
``n = 8`` a few bfloat16 ulps of the result beyond the reference's).

Status: not an ``method="auto"`` candidate. In the benchmark model
(``design/benchmarks.md``, "XLA's flagged decompositions, emitted with
``jax.lax``") the float32 two-way program reaches ``xla_best`` only at
the Llama-3-70B shard, v5p tp 8 M = 1024 (214.4 us against 216.1), 1.9%
under the fused kernel, inside auto's margin for it; elsewhere XLA's
default scheduler may run the ``ppermute``s back to back (v5p tp 8
M = 4096: 272.5 us exposed), which no estimate from the shape sees.
``benchmarks/xla_ring.py`` models it.

Limits. The contracting form with one weight; ``n`` static (the loop is
unrolled); the two-way form needs an even number of rows when ``n`` is
even (the antipode's halves). Differentiates and vmaps as ``jax.lax``
does (``ppermute``'s transpose is the reverse ``ppermute``).
"""

from typing import Literal

import jax
import jax.numpy as jnp

Acc = Literal["float32", "output"]


def accumulator_dtype(dtype, acc: Acc = "float32") -> jnp.dtype:
  """The accumulator's dtype for operands of ``dtype``."""
  dtype = jnp.dtype(dtype)
  if acc == "output":
    return dtype
  if jnp.issubdtype(dtype, jnp.floating):
    return jnp.dtype(jnp.promote_types(dtype, jnp.float32))
  if dtype == jnp.int8:
    return jnp.dtype(jnp.int32)
  return dtype


def _rows(w, c, k: int):
  return jax.lax.dynamic_slice_in_dim(w, c * k, k, axis=0)


def _add(acc, x, w, acc_dt):
  """``acc + x @ w`` (``x`` and ``w`` may hold a stacked pair: ``[2, m,
  k]`` and ``[2, k, f]``, contracted over both), one rounding."""
  if x.ndim == 3:
    y = jnp.einsum("smk,skf->mf", x, w, preferred_element_type=acc_dt)
  else:
    y = jnp.dot(x, w, preferred_element_type=acc_dt)
  return y if acc is None else acc + y


def allgather(
  x, w, axis_name: str, n: int, *, directions: int = 1, acc: Acc = "float32"
):
  """``all_gather(x, axis=1, tiled=True) @ w`` as XLA's flagged program.

  Args:
    x: ``[m, k]``, this device's slice of the contracting dimension.
    w: ``[n k, f]``, every contracting row.
    axis_name: the ring's mesh axis (inside ``shard_map``).
    n: its size.
    directions: 1 (XLA's unrolled windowed einsum) or 2 (its collective
      matmul, ``post_spmd``).
    acc: ``"float32"`` (the library's accumulator) or ``"output"``
      (XLA's: ``x.dtype``, rounded every step).

  Returns:
    ``[m, f]`` in ``x.dtype``.

  Raises:
    ValueError: ``directions`` not 1 or 2, or the antipode's rows cannot
      be halved.
  """
  if directions not in (1, 2):
    raise ValueError(f"directions must be 1 or 2, got {directions!r}.")
  m, k = x.shape
  if directions == 2 and n % 2 == 0 and n > 2 and m % 2:
    raise ValueError(
      f"the two-way ring splits the antipode's rows in halves: x has "
      f"{m} rows, an odd number; use directions=1."
    )
  acc_dt = accumulator_dtype(x.dtype, acc)
  me = jax.lax.axis_index(axis_name)
  down = [(j, (j - 1) % n) for j in range(n)]  # holds index + s
  up = [(j, (j + 1) % n) for j in range(n)]  # holds index - s
  if n == 1:
    return jnp.dot(x, w, preferred_element_type=acc_dt).astype(x.dtype)
  if directions == 1 or n == 2:
    out, cur = None, x
    for s in range(n):
      nxt = jax.lax.ppermute(cur, axis_name, down) if s < n - 1 else None
      c = jax.lax.rem(me + s, n)
      out = _add(out, cur, _rows(w, c, k), acc_dt)
      cur = nxt
    return out.astype(x.dtype)
  a, b = x, x  # a: index - s (from below), b: index + s (from above)
  half = (n - 1) // 2  # steps holding two distinct chunks
  out = None
  for s in range(half + 1):
    if s < half:
      na = jax.lax.ppermute(a, axis_name, up)
      nb = jax.lax.ppermute(b, axis_name, down)
    elif n % 2 == 0:
      # The antipode: its first rows arrive from below, the rest from
      # above (half a chunk on each link).
      h = m // 2
      na = jax.lax.ppermute(a[:h], axis_name, up)
      nb = jax.lax.ppermute(b[h:], axis_name, down)
    if s == 0:
      out = _add(out, x, _rows(w, me, k), acc_dt)
    else:
      ca, cb = jax.lax.rem(me + n - s, n), jax.lax.rem(me + s, n)
      pair = jnp.stack([a, b])
      rows = jnp.stack([_rows(w, ca, k), _rows(w, cb, k)])
      out = _add(out, pair, rows, acc_dt)
    a, b = na, nb
  if n % 2 == 0:
    c = jax.lax.rem(me + n // 2, n)
    anti = jnp.concatenate([a, b], axis=0)
    out = _add(out, anti, _rows(w, c, k), acc_dt)
  return out.astype(x.dtype)
