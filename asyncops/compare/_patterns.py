"""The same patterns written three ways: value API, Ref API, ``jax.lax``.

Each pattern is a set of per-device functions ``f(x, w) -> tuple`` for
``shard_map`` over a ``("x", "y")`` mesh (``x`` sharded over both axes,
``w`` replicated); all three must compute the same numbers. The value side
is the best value-API code: :mod:`asyncops.scheduling` helpers (``overlap``,
``fori_loop``, ``staggered``). The Ref side is :mod:`asyncops.stateful` with
plain ``jax.lax.fori_loop`` at ``unroll=1`` and a
:func:`~asyncops.stateful.double_buffer` where a loop forwards what it
received. The patterns are the seed design's "Revenge of the State" section
(``revenge_*``) and the scheduling layer's (``tests/test_scheduling.py``),
plus all-gather and local copy.
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from asyncops import futures
from asyncops import scheduling as sch
from asyncops import stateful as st

Y, X = "y", "x"


def work(x):
  """Compute worth overlapping (elementwise, so it is exact on CPU)."""
  return jnp.sin(x) * 2.0 + 1.0


def _start_y(x, shift=1):
  return futures.ppermute_start(x, Y, shift=shift)


def _roll(x, axis=Y, k=1):
  n = jax.lax.axis_size(axis)
  return jax.lax.ppermute(x, axis, [(j, (j + k) % n) for j in range(n)])


def _empty(x):
  """A Ref for a transfer's result, varying like ``x`` (not empty_ref:
  under shard_map it loses the varying axes in jax 0.10.2)."""
  return jax.new_ref(jnp.zeros_like(x))


# Revenge of the State ------------------------------------------------------


def basic_value(x, w):
  del w
  x, fut = _start_y(x)
  return (futures.ppermute_done(fut),)


def basic_ref(x, w):
  del w
  x_ref, y_ref = jax.new_ref(x), _empty(x)
  fut = st.ppermute_start(x_ref, y_ref, Y, shift=1)
  st.ppermute_done(fut, x_ref, y_ref)
  return (y_ref[...],)


def basic_lax(x, w):
  del w
  return (_roll(x),)


# The seed's ``x_ref[...] += 1`` between start and done writes the source
# while the DMA reads it (a hazard the check rejects): the race-free Ref
# program writes the sum to another Ref.
def op_between_value(x, w):
  del w
  x, fut = _start_y(x)
  z, fut = sch.overlap(fut, lambda x: x + 1.0, x)
  return futures.ppermute_done(fut), z


def op_between_ref(x, w):
  del w
  x_ref, y_ref, z_ref = jax.new_ref(x), _empty(x), _empty(x)
  fut = st.ppermute_start(x_ref, y_ref, Y, shift=1)
  z_ref[...] = x_ref[...] + 1.0
  st.ppermute_done(fut, x_ref, y_ref)
  return y_ref[...], z_ref[...]


def op_between_lax(x, w):
  del w
  return _roll(x), x + 1.0


def unrolled_value(n):
  def f(x, w):
    del w

    def body(i, x):
      return futures.ppermute_done(_start_y(x)[1])

    return (sch.fori_loop(0, n, body, x),)

  return f


def unrolled_ref(n):
  # The seed's loop: two Refs, x -> y then y -> x, unrolled by hand.
  def f(x, w):
    del w
    x_ref, y_ref = jax.new_ref(x), _empty(x)

    def body(i, c):
      fut = st.ppermute_start(x_ref, y_ref, Y, shift=1)
      st.ppermute_done(fut, x_ref, y_ref)
      fut = st.ppermute_start(y_ref, x_ref, Y, shift=1)
      st.ppermute_done(fut, y_ref, x_ref)
      return c

    jax.lax.fori_loop(0, n // 2, body, 0)
    return (x_ref[...],)

  return f


def double_buffered_ref(n):
  # The seed's scratch buffer with a leading 2: no manual unrolling.
  def f(x, w):
    del w
    buf = st.double_buffer(x)

    def body(i, c):
      fut = st.ppermute_start(buf.send_slot(i), buf.recv_slot(i), Y, shift=1)
      st.ppermute_done(fut, buf.send_slot(i), buf.recv_slot(i))
      return c

    jax.lax.fori_loop(0, n, body, 0)
    return (buf.read(n),)

  return f


def roll_n_lax(n):
  def f(x, w):
    del w
    return (jax.lax.fori_loop(0, n, lambda i, x: _roll(x), x),)

  return f


# Scheduling layer ------------------------------------------------------------


def between_value(x, w):
  del w
  x, fut = _start_y(x)
  z, fut = sch.overlap(fut, work, x)
  return futures.ppermute_done(fut), z


def between_ref(x, w):
  del w
  x_ref, y_ref = jax.new_ref(x), _empty(x)
  fut = st.ppermute_start(x_ref, y_ref, Y, shift=1)
  z = work(x)
  st.ppermute_done(fut, x_ref, y_ref)
  return y_ref[...], z


def between_lax(x, w):
  del w
  return _roll(x), work(x)


def matmul_value(x, w):
  x, fut = _start_y(x)
  z, fut = sch.overlap(fut, lambda x, w: x @ w, x, w)
  return futures.ppermute_done(fut), z


def matmul_ref(x, w):
  x_ref, y_ref = jax.new_ref(x), _empty(x)
  fut = st.ppermute_start(x_ref, y_ref, Y, shift=1)
  z = x @ w
  st.ppermute_done(fut, x_ref, y_ref)
  return y_ref[...], z


def matmul_lax(x, w):
  return _roll(x), x @ w


def two_in_flight_value(x, w):
  del w
  x1, f1 = _start_y(x)
  x2, f2 = futures.ppermute_start(x * 3.0, X, shift=1)
  z, (f1, f2) = sch.overlap((f1, f2), lambda a, b: work(a) * b, x1, x2)
  return futures.ppermute_done(f1) + futures.ppermute_done(f2), z


def two_in_flight_ref(x, w):
  del w
  a_ref, b_ref = jax.new_ref(x), jax.new_ref(x * 3.0)
  ya_ref, yb_ref = _empty(x), _empty(x)
  f1 = st.ppermute_start(a_ref, ya_ref, Y, shift=1)
  f2 = st.ppermute_start(b_ref, yb_ref, X, shift=1)
  z = work(x) * (x * 3.0)
  st.ppermute_done(f1, a_ref, ya_ref)
  st.ppermute_done(f2, b_ref, yb_ref)
  return ya_ref[...] + yb_ref[...], z


def two_in_flight_lax(x, w):
  del w
  return _roll(x) + _roll(x * 3.0, X), work(x) * (x * 3.0)


def ring_value(n):
  def f(x, w):
    del w

    def body(i, x):
      x, fut = _start_y(x)
      z, fut = sch.overlap(fut, work, x)
      return futures.ppermute_done(fut) + z

    return (sch.fori_loop(0, n, body, x),)

  return f


def ring_ref(n):
  def f(x, w):
    del w
    buf = st.double_buffer(x)

    def body(i, c):
      send, recv = buf.send_slot(i), buf.recv_slot(i)
      fut = st.ppermute_start(send, recv, Y, shift=1)
      z = work(send[...])
      st.ppermute_done(fut, send, recv)
      recv[...] += z
      return c

    jax.lax.fori_loop(0, n, body, 0)
    return (buf.read(n),)

  return f


def ring_lax(n):
  def f(x, w):
    del w
    return (jax.lax.fori_loop(0, n, lambda i, x: _roll(x) + work(x), x),)

  return f


def staggered_value(n):
  def f(x, w):
    del w
    x, fut = _start_y(x)
    acc, fut = sch.overlap(fut, work, x)

    def body(i, carry):
      fut, acc = carry
      x, fut = _start_y(futures.ppermute_done(fut))
      acc, fut = sch.overlap(fut, lambda x, a: a + work(x), x, acc)
      return fut, acc

    fut, acc = sch.fori_loop(0, n, body, (fut, acc))
    return futures.ppermute_done(fut), acc

  return f


def staggered_ref(n):
  # The future is the loop carry: each transfer's done is in the next trip.
  def f(x, w):
    del w
    buf = st.double_buffer(x)
    acc = jax.new_ref(work(x))
    fut = st.ppermute_start(buf.send_slot(0), buf.recv_slot(0), Y, shift=1)

    def body(i, fut):
      st.ppermute_done(fut, buf.send_slot(i), buf.recv_slot(i))
      j = i + 1
      fut = st.ppermute_start(buf.send_slot(j), buf.recv_slot(j), Y, shift=1)
      acc[...] += work(buf.send_slot(j)[...])
      return fut

    fut = jax.lax.fori_loop(0, n, body, fut)
    st.ppermute_done(fut, buf.send_slot(n), buf.recv_slot(n))
    return buf.read(n + 1), acc[...]

  return f


def staggered_lax(n):
  def f(x, w):
    del w

    def body(i, carry):
      x, acc = carry
      x = _roll(x)
      return x, acc + work(x)

    x, acc = jax.lax.fori_loop(0, n, body, (x, work(x)))
    return _roll(x), acc

  return f


def accumulate_value(n):
  def f(x, w):
    del w
    y, out = sch.staggered(
      n, _start_y, lambda i, x, out: out + x, x, jnp.zeros_like(x)
    )
    return out, y

  return f


def accumulate_ref(n):
  def f(x, w):
    del w
    buf, out = st.double_buffer(x), _empty(x)

    def body(i, c):
      send, recv = buf.send_slot(i), buf.recv_slot(i)
      fut = st.ppermute_start(send, recv, Y, shift=1)
      out[...] += send[...]
      st.ppermute_done(fut, send, recv)
      return c

    jax.lax.fori_loop(0, n, body, 0)
    return out[...], buf.read(n)

  return f


def accumulate_lax(n):
  def f(x, w):
    del w

    def body(i, carry):
      out, x = carry
      return out + x, _roll(x)

    return jax.lax.fori_loop(0, n, body, (jnp.zeros_like(x), x))

  return f


# All-gather and local copy ---------------------------------------------------


def all_gather_value(x, w):
  x, fut = futures.all_gather_start(x, Y)
  z, fut = sch.overlap(fut, lambda x, w: x @ w, x, w)
  return futures.all_gather_done(fut), z


def all_gather_ref(x, w):
  n = jax.lax.axis_size(Y)
  x_ref = jax.new_ref(x)
  g_ref = jax.new_ref(jnp.broadcast_to(jnp.zeros_like(x), (n, *x.shape)))
  fut = st.all_gather_start(x_ref, g_ref, Y)
  z = x @ w
  st.all_gather_done(fut, x_ref, g_ref)
  return g_ref[...], z


def all_gather_lax(x, w):
  return jax.lax.all_gather(x, Y), x @ w


def copy_value(x, w):
  del w
  x, fut = futures.copy_start(x)
  z, fut = sch.overlap(fut, work, x)
  return futures.copy_done(fut), z


def copy_ref(x, w):
  del w
  x_ref, y_ref = jax.new_ref(x), _empty(x)
  fut = st.copy_start(x_ref, y_ref)
  z = work(x)
  st.copy_done(fut, x_ref, y_ref)
  return y_ref[...], z


def copy_lax(x, w):
  del w
  return x, work(x)


@dataclasses.dataclass(frozen=True)
class Pattern:
  """One pattern written with both APIs, and its ``jax.lax`` reference.

  Attributes:
    name: short name.
    value: value-API function ``f(x, w) -> tuple``.
    ref: Ref-API function.
    lax: the ``jax.lax`` reference.
    op: the start's op name in TPU HLO (``ppermute``, ``all_gather``...).
    overlapped: how many start/done pairs of the Ref side must have
      compute in their window on TPU (0: the pattern has no compute).
    n_out: how many arrays the functions return.
  """

  name: str
  value: Callable
  ref: Callable
  lax: Callable
  op: str = "ppermute"
  overlapped: int = 1
  n_out: int = 2


def _patterns() -> tuple[Pattern, ...]:
  out = [
    Pattern("basic", basic_value, basic_ref, basic_lax, overlapped=0, n_out=1),
    Pattern("op_between", op_between_value, op_between_ref, op_between_lax),
    Pattern(
      "unrolled_8",
      unrolled_value(8),
      unrolled_ref(8),
      roll_n_lax(8),
      overlapped=0,
      n_out=1,
    ),
    Pattern(
      "double_buffered_7",
      unrolled_value(7),
      double_buffered_ref(7),
      roll_n_lax(7),
      overlapped=0,
      n_out=1,
    ),
    Pattern("between", between_value, between_ref, between_lax),
    Pattern("matmul", matmul_value, matmul_ref, matmul_lax),
    Pattern(
      "two_in_flight",
      two_in_flight_value,
      two_in_flight_ref,
      two_in_flight_lax,
      overlapped=2,
    ),
  ]
  for n in (7, 8):
    out += [
      Pattern(f"ring_{n}", ring_value(n), ring_ref(n), ring_lax(n), n_out=1),
      Pattern(
        f"staggered_{n}", staggered_value(n), staggered_ref(n), staggered_lax(n)
      ),
      Pattern(
        f"accumulate_{n}",
        accumulate_value(n),
        accumulate_ref(n),
        accumulate_lax(n),
      ),
    ]
  out += [
    Pattern(
      "all_gather",
      all_gather_value,
      all_gather_ref,
      all_gather_lax,
      op="all_gather",
    ),
    Pattern("copy", copy_value, copy_ref, copy_lax, op="copy"),
  ]
  return tuple(out)


PATTERNS = _patterns()
BY_NAME = {p.name: p for p in PATTERNS}
