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

Bidirectional steps move two buffers (the two halves of the rows), one to
``index + 1`` and one to ``index - 1``, as two concurrent permutes, so both
directions of every ICI link carry data.
"""

from collections.abc import Callable
from typing import Any

import jax

from asyncops.futures import _api as futures

Shift = int


def start(x, axis_name: str, shift: Shift):
  """Starts moving ``x`` one hop: ``index -> index + shift``."""
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
    shifts: the ring shift of each buffer (``+1`` or ``-1``).
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
    >>> (nxt,), acc = step((x,), (-1,), "y", lambda s, w: s[0] @ w, w)
    ... # doctest: +SKIP
  """
  with jax.named_scope("ring_step"):
    started = [
      start(x, axis_name, k) for x, k in zip(sends, shifts, strict=True)
    ]
    sent = tuple(x for x, _ in started)
    futs = tuple(f for _, f in started)
    futs, sent, operands = jax.lax.optimization_barrier((futs, sent, operands))
    out = compute(sent, *operands)
    out, futs = jax.lax.optimization_barrier((out, futs))
    received = tuple(futures.ppermute_done(f) for f in futs)
  return received, out
