"""One ring step: start a transfer, compute inside its window, wait.

Every collective matmul here is a ring of such steps. A step

1. starts moving a buffer one hop around the ring (``ppermute_start``),
2. computes one chunk matmul **between** the start and the done,
3. waits (``ppermute_done``) and returns what arrived plus the chunk.

Step 2 must land inside the window on the compiled TPU schedule. Data
dependencies alone do not force that: the chunk matmul of a reduce-scatter
does not read the buffer in flight, so XLA may schedule it before the start,
and nothing stops it from scheduling any matmul after the done. Two
``jax.lax.optimization_barrier`` calls pin it: the compute operands pass
through a barrier together with the future (so they exist only after the
start), and the compute result passes through a barrier together with the
future before the done (so the done waits for it). A future is a pytree of
arrays, so it travels through the barriers unchanged.

With ``api="ref"`` the same step runs on the Ref API
(``asyncops.stateful``): each travelling buffer is a double-buffered Ref
``[2, ...]``; a step sends slot ``s`` into the peer's slot ``1 - s``, reads
slot ``s`` for the compute (reading a source is allowed while it is in
flight) and flips the slot after the done. :class:`Ring` hides which API
runs.

Bidirectional steps (value API) move one buffer with one
``bidirectional_start`` kernel (shift ``"both"``): its first half of rows
goes to ``index + 1`` and its second half to ``index - 1``, so both
directions of every ring link carry data and no half is ever sliced out or
concatenated. The Ref API has no bidirectional kernel; there a bidirectional
ring moves two half buffers as two permutes (shifts ``+1`` and ``-1``).
"""

from collections.abc import Callable
from typing import Any, Literal

import jax

from asyncops.futures import _api as futures

Shift = int | Literal["both"]


def start(x, axis_name: str, shift: Shift):
  """Starts moving ``x`` one hop: ``index -> index + shift``.

  ``shift="both"``: one bidirectional kernel, the first half of ``x``'s
  rows to ``index + 1``, the second half to ``index - 1``. A numeric shift
  is written into the op name (``ring_shift+1``) so tools that read the
  compiled HLO (``benchmarks/``) can route the transfer.
  """
  if shift == "both":
    return futures.bidirectional_start(x, axis_name)
  with jax.named_scope(f"ring_shift{shift:+d}"):
    return futures.ppermute_start(x, axis_name, shift=shift)


def step(
  sends: tuple[Any, ...],
  shifts: tuple[Shift, ...],
  axis_name: str,
  compute: Callable[..., Any],
  *operands: Any,
) -> tuple[tuple[Any, ...], Any]:
  """One overlapped ring step.

  Args:
    sends: the buffers to move, one per direction.
    shifts: the ring shift of each buffer (``+1``, ``-1`` or ``"both"``).
    axis_name: the ring's mesh axis.
    compute: the chunk work, ``compute(sent, *operands)`` where ``sent``
      are the start kernels' aliased outputs (**read these, never the
      pre-start buffers**, or XLA inserts a defensive copy).
    *operands: the other inputs of ``compute``; they pass through a barrier
      with the futures so ``compute`` cannot run before the starts.

  Returns:
    ``(received, out)``: the buffers that arrived (same order as
    ``sends``) and ``compute``'s result.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import AxisType, PartitionSpec as P
    >>> mesh = jax.make_mesh((8,), ("y",), axis_types=(AxisType.Auto,))
    >>> @jax.jit
    ... @jax.shard_map(mesh=mesh, in_specs=(P("y"), P()), out_specs=P("y"))
    ... def f(x, w):
    ...   (nxt,), acc = step((x,), (-1,), "y", lambda s, w: s[0] @ w, w)
    ...   return nxt, acc
    >>> nxt, acc = f(jnp.arange(8.0).reshape(8, 1), jnp.full((1, 1), 2.0))
    >>> nxt.ravel().tolist()  # from the next device
    [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 0.0]
    >>> acc.ravel().tolist()  # this device's x @ w
    [0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0]
  """
  with jax.named_scope("ring_step"):
    started = [
      start(x, axis_name, k) for x, k in zip(sends, shifts, strict=True)
    ]
    return window(started, compute, *operands)


def window(started, compute: Callable[..., Any], *operands):
  """Runs ``compute(sent, *operands)`` between started transfers and their
  dones: the futures, aliased buffers and ``operands`` pass through one
  optimization barrier before ``compute``, its result and the futures
  through another after it, then every future is awaited.

  Args:
    started: ``(aliased buffer, future)`` pairs, as the start functions
      return them.
    compute: reads ``sent``, the aliased buffers (**never the pre-start
      ones**, or XLA inserts a defensive copy).
    *operands: the other inputs of ``compute``.

  Returns:
    ``(received, out)``: the buffers that arrived (same order as
    ``started``) and ``compute``'s result.
  """
  sent = tuple(x for x, _ in started)
  futs = tuple(f for _, f in started)
  futs, sent, operands = jax.lax.optimization_barrier((futs, sent, operands))
  out = compute(sent, *operands)
  out, futs = jax.lax.optimization_barrier((out, futs))
  received = tuple(futures.done(f) for f in futs)
  return received, out


class Ring:
  """The buffers travelling around a ring, on either API.

  Args:
    sends: the initial buffers, one per direction.
    shifts: the ring shift of each buffer.
    axis_name: the ring's mesh axis.
    api: ``"value"`` (futures) or ``"ref"`` (double-buffered Refs).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import AxisType, PartitionSpec as P
    >>> mesh = jax.make_mesh((8,), ("y",), axis_types=(AxisType.Auto,))
    >>> @jax.jit
    ... @jax.shard_map(mesh=mesh, in_specs=(P("y"), P()), out_specs=P("y"))
    ... def f(x, w):
    ...   ring = Ring((x,), (-1,), "y", "value")
    ...   out = ring.step(lambda s, w: s[0] @ w, w)
    ...   x_next, = ring.values()
    ...   return x_next + out
    >>> f(jnp.arange(8.0).reshape(8, 1), jnp.full((1, 1), 2.0)).ravel().tolist()
    [1.0, 4.0, 7.0, 10.0, 13.0, 16.0, 19.0, 14.0]
  """

  def __init__(self, sends, shifts, axis_name: str, api: str, keep=False):
    self.shifts, self.axis_name, self.api = tuple(shifts), axis_name, api
    self.first = None
    if api == "ref":
      # Two Refs per buffer, alternating as source and destination (the
      # loop is unrolled, so which is which is static): no stacked [2, ...]
      # copy of the initial value and no slot arithmetic. ``keep``: the
      # initial value gets a Ref of its own that is only ever a source, so
      # it can be read after the ring without a copy (two more Refs
      # alternate as destinations).
      zeros = jax.numpy.zeros_like
      self.bufs = tuple(
        (jax.new_ref(x), jax.new_ref(zeros(x)))
        + ((jax.new_ref(zeros(x)),) if keep else ())
        for x in sends
      )
      self.order = [0, 1] if not keep else [0, 1, 2]
      self.slot = 0
    else:
      self.current = tuple(sends)
    self.keep = keep

  def _next(self, slot: int) -> int:
    if len(self.order) == 2:
      return 1 - slot
    return 2 if slot == 1 else 1  # 0 -> 1 -> 2 -> 1 -> ...

  def values(self) -> tuple[Any, ...]:
    """The buffers held now (what the last step received)."""
    if self.api == "ref":
      return tuple(b[self.slot][...] for b in self.bufs)
    return self.current

  def kept(self) -> tuple[Any, ...]:
    """The initial buffers as the first transfer saw them (``keep=True``):
    readable after the ring at no copy, since nothing wrote them."""
    assert self.keep
    if self.api == "ref":
      return tuple(b[0][...] for b in self.bufs)
    return self.first

  def set(self, values) -> None:
    """Replaces the buffers to send next (e.g. an updated partial sum)."""
    if self.api == "ref":
      for b, v in zip(self.bufs, values, strict=True):
        b[self.slot][...] = v
    else:
      self.current = tuple(values)

  def step(self, compute: Callable[..., Any], *operands: Any) -> Any:
    """One overlapped step; returns ``compute(sent, *operands)``."""
    if self.api == "value":
      if self.keep and self.first is None:
        inner = compute

        def compute(sent, *operands):
          self.first = tuple(sent)
          return inner(sent, *operands)

      self.current, out = step(
        self.current, self.shifts, self.axis_name, compute, *operands
      )
      return out
    from asyncops import stateful

    s, d = self.slot, self._next(self.slot)
    with jax.named_scope("ring_step"):
      futs = []
      for b, k in zip(self.bufs, self.shifts, strict=True):
        with jax.named_scope(f"ring_shift{k:+d}"):
          futs.append(
            stateful.ppermute_start(b[s], b[d], self.axis_name, shift=k)
          )
      out = compute(tuple(b[s][...] for b in self.bufs), *operands)
      for f, b in zip(futs, self.bufs, strict=True):
        stateful.ppermute_done(f, b[s], b[d])
    self.slot = d
    return out
