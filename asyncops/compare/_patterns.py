"""The seed design's patterns, written with the value API and the Ref API.

Each pattern is a pair of per-device functions ``f(x, w) -> y`` for use
under ``shard_map`` over one axis ``"i"`` of size ``n``; both must compute
the same numbers. The value side follows the seed design's rules (use the
returned ``x``, ``optimization_barrier`` around compute, ``unroll=2``); the
Ref side writes the same thing over ``jax.Ref``s.
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

import asyncops
from asyncops import stateful as st

AX = "i"


def _ob(*xs):
  return jax.lax.optimization_barrier(xs)


# 1. One transfer overlapping a matmul ---------------------------------------


def overlap_value(x, w):
  x, fut = asyncops.ppermute_start(x, AX, shift=1)
  x, w, fut = _ob(x, w, fut)
  z = x @ w
  z, fut = _ob(z, fut)
  return asyncops.ppermute_done(fut) + z


def overlap_ref(x, w):
  x_ref, y_ref = jax.new_ref(x), jax.new_ref(jnp.zeros_like(x))
  fut = st.ppermute_start(x_ref, y_ref, AX, shift=1)
  z = x @ w
  st.ppermute_done(fut, x_ref, y_ref)
  return y_ref[...] + z


# 2. A ring of start/done pairs (the seed's loop) ----------------------------


def ring_value(x, w, n):
  del w

  def body(i, x):
    x, fut = asyncops.ppermute_start(x, AX, shift=1)
    return asyncops.ppermute_done(fut)

  return jax.lax.fori_loop(0, n, body, x, unroll=2)


def ring_ref(x, w, n):
  del w
  buf = jax.new_ref(jnp.stack([x, jnp.zeros_like(x)]))

  def body(i, c):
    s, r = i % 2, (i + 1) % 2
    fut = st.ppermute_start(buf.at[s], buf.at[r], AX, shift=1)
    st.ppermute_done(fut, buf.at[s], buf.at[r])
    return c

  jax.lax.fori_loop(0, n, body, 0)
  return buf[n % 2]


# 3. Futures across loop boundaries (staggered) ------------------------------


def staggered_value(x, w, n):
  del w
  x, fut = asyncops.ppermute_start(x, AX, shift=1)

  def body(i, fut):
    x = asyncops.ppermute_done(fut)
    return asyncops.ppermute_start(x, AX, shift=1)[1]

  fut = jax.lax.fori_loop(0, n - 1, body, fut, unroll=2)
  return asyncops.ppermute_done(fut)


def staggered_ref(x, w, n):
  del w
  buf = jax.new_ref(jnp.stack([x, jnp.zeros_like(x)]))
  fut = st.ppermute_start(buf.at[0], buf.at[1], AX, shift=1)

  def body(i, fut):
    s, r = i % 2, (i + 1) % 2
    st.ppermute_done(fut, buf.at[s], buf.at[r])
    return st.ppermute_start(buf.at[r], buf.at[s], AX, shift=1)

  fut = jax.lax.fori_loop(0, n - 1, body, fut)
  s = (n - 1) % 2
  st.ppermute_done(fut, buf.at[s], buf.at[1 - s])
  return buf[n % 2]


# 4. Accumulate while the ring turns (the seed's "all together") ------------


def accumulate_value(x, w, n):
  del w
  out = jnp.zeros_like(x)

  def body(i, carry):
    out, x = carry
    x, fut = asyncops.ppermute_start(x, AX, shift=1)
    x, out, fut = _ob(x, out, fut)
    out = out + x
    out, fut = _ob(out, fut)
    return out, asyncops.ppermute_done(fut)

  out, _ = jax.lax.fori_loop(0, n, body, (out, x), unroll=2)
  return out


def accumulate_ref(x, w, n):
  del w
  buf = jax.new_ref(jnp.stack([x, jnp.zeros_like(x)]))
  out = jax.new_ref(jnp.zeros_like(x))

  def body(i, c):
    s, r = i % 2, (i + 1) % 2
    fut = st.ppermute_start(buf.at[s], buf.at[r], AX, shift=1)
    out[...] += buf[s]
    st.ppermute_done(fut, buf.at[s], buf.at[r])
    return c

  jax.lax.fori_loop(0, n, body, 0)
  return out[...]


# 5. All-gather matmul over a ring -------------------------------------------


def _zeros_out(x, w):
  z = jnp.zeros((x.shape[0], w.shape[1]), x.dtype)
  return jax.lax.pcast(z, (AX,), to="varying")


def ag_matmul_value(x, w, n):
  out = _zeros_out(x, w)

  def body(i, carry):
    out, x = carry
    x, fut = asyncops.ppermute_start(x, AX, shift=1)
    x, w2, out, fut = _ob(x, w, out, fut)
    out = out + jnp.tanh(x @ w2)
    out, fut = _ob(out, fut)
    return out, asyncops.ppermute_done(fut)

  out, _ = jax.lax.fori_loop(0, n, body, (out, x), unroll=2)
  return out


def ag_matmul_ref(x, w, n):
  buf = jax.new_ref(jnp.stack([x, jnp.zeros_like(x)]))
  out = jax.new_ref(_zeros_out(x, w))

  def body(i, c):
    s, r = i % 2, (i + 1) % 2
    fut = st.ppermute_start(buf.at[s], buf.at[r], AX, shift=1)
    out[...] += jnp.tanh(buf[s] @ w)
    st.ppermute_done(fut, buf.at[s], buf.at[r])
    return c

  jax.lax.fori_loop(0, n, body, 0)
  return out[...]


# 6. Two transfers in flight, both directions --------------------------------


def two_way_value(x, w):
  x, f1 = asyncops.ppermute_start(x, AX, shift=1)
  x, f2 = asyncops.ppermute_start(x, AX, shift=-1)
  x, w, f1, f2 = _ob(x, w, f1, f2)
  z = x @ w
  z, f1, f2 = _ob(z, f1, f2)
  return asyncops.ppermute_done(f1) - asyncops.ppermute_done(f2) + z


def two_way_ref(x, w):
  x_ref = jax.new_ref(x)
  a_ref, b_ref = jax.new_ref(jnp.zeros_like(x)), jax.new_ref(jnp.zeros_like(x))
  f1 = st.ppermute_start(x_ref, a_ref, AX, shift=1)
  f2 = st.ppermute_start(x_ref, b_ref, AX, shift=-1)
  z = x @ w
  st.ppermute_done(f1, x_ref, a_ref)
  st.ppermute_done(f2, x_ref, b_ref)
  return a_ref[...] - b_ref[...] + z


@dataclasses.dataclass(frozen=True)
class Pattern:
  """A pattern written both ways, and its ``jax.lax`` reference."""

  name: str
  value: Callable
  ref: Callable
  looped: bool


def _roll(x, k):
  n = jax.lax.axis_size(AX)
  return jax.lax.ppermute(x, AX, [(j, (j + k) % n) for j in range(n)])


def reference(name: str, x, w, n):
  """The pattern's result with ``jax.lax`` collectives only."""
  if name == "overlap":
    return _roll(x, 1) + x @ w
  if name in ("ring", "staggered"):
    return _roll(x, n % jax.lax.axis_size(AX))
  if name == "accumulate":
    return sum(_roll(x, k) for k in range(n))
  if name == "ag_matmul":
    return sum(jnp.tanh(_roll(x, k) @ w) for k in range(n))
  if name == "two_way":
    return _roll(x, 1) - _roll(x, -1) + x @ w
  raise KeyError(name)


PATTERNS = (
  Pattern("overlap", overlap_value, overlap_ref, False),
  Pattern("ring", ring_value, ring_ref, True),
  Pattern("staggered", staggered_value, staggered_ref, True),
  Pattern("accumulate", accumulate_value, accumulate_ref, True),
  Pattern("ag_matmul", ag_matmul_value, ag_matmul_ref, True),
  Pattern("two_way", two_way_value, two_way_ref, False),
)
