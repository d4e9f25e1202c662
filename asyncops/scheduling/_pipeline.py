"""``staggered``: a transfer per step, overlapped with that step's compute.

The pattern of the design's "Putting it all together": start the first
transfer in a prologue; in each loop step await the previous transfer,
start the next one from the received buffer and compute on that buffer
while the transfer runs; await the last transfer in an epilogue::

  x, fut = start(x)                    # prologue
  carry = compute(0, x, carry)
  for i in 1 .. steps-1:               # body: done, start, compute
    x = done(fut)
    x, fut = start(x)
    carry = compute(i, x, carry)
  y = done(fut)                        # epilogue

Each ``compute`` runs through :func:`overlap` (so it sits inside its
transfer's window even inside a loop body unrolled by two, where no loop
boundary separates the halves) and the loop is :func:`fori_loop` (so the
carried future's buffers alternate and nothing in flight is copied).

Limits. ``steps`` must be a static int: it decides whether the prologue's
transfer exists at all. For a trip count known only at run time write the
loop with :func:`fori_loop` (traced bounds work there, at the cost of a
copy of the carry).
"""

from collections.abc import Callable
from typing import Any

import jax

from asyncops.futures import done as _done
from asyncops.scheduling._loop import fori_loop
from asyncops.scheduling._overlap import overlap


def staggered(
  steps: Any,
  start: Callable[[Any], tuple[Any, Any]],
  compute: Callable[[Any, Any, Any], Any],
  x: Any,
  carry: Any = None,
  *,
  done: Callable[[Any], Any] = _done,
) -> tuple[Any, Any]:
  """Runs ``steps`` transfers in a chain, each overlapped with compute.

  Transfer ``i`` sends what transfer ``i - 1`` received (transfer 0 sends
  ``x``); while it runs, ``compute(i, x_i, carry)`` updates ``carry`` with
  the buffer being sent. Equivalent to::

    for i in range(steps):
      carry = compute(i, x, carry)
      x = done(start(x)[1])

  Args:
    steps: number of transfers (a static int >= 0).
    start: ``x -> (x, future)``, e.g.
      ``functools.partial(asyncops.ppermute_start, axis_name="i", shift=1)``.
    compute: ``(i, x, carry) -> carry``, overlapped with transfer ``i``.
    x: the first buffer to send.
    carry: the initial compute state (any pytree of arrays, or None).
    done: how to await a future (default :func:`asyncops.done`).

  Returns:
    ``(y, carry)``: what the last transfer received and the final carry.

  Raises:
    ValueError: ``steps`` is not a static int >= 0.

  Example:
    >>> import functools
    >>> import jax, jax.numpy as jnp, asyncops
    >>> from jax.sharding import AxisType, PartitionSpec as P
    >>> from asyncops.scheduling import staggered
    >>> mesh = jax.make_mesh((8,), ("i",), axis_types=(AxisType.Auto,))
    >>> start = functools.partial(asyncops.ppermute_start, axis_name="i",
    ...                           shift=1)
    >>> acc = lambda i, x, out: out + x
    >>> @jax.jit
    ... @jax.shard_map(mesh=mesh, in_specs=P("i"), out_specs=P("i"))
    ... def f(x):
    ...   return staggered(8, start, acc, x, jnp.zeros_like(x))
    >>> y, out = f(jnp.arange(8.0))
    >>> out.tolist()  # every device added up all eight values
    [28.0, 28.0, 28.0, 28.0, 28.0, 28.0, 28.0, 28.0]
  """
  if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
    raise ValueError(
      f"staggered: steps must be a static int >= 0, got {steps!r}: it "
      "decides whether the first transfer starts at all. Bound it "
      "statically (e.g. the axis size), or write the loop with "
      "asyncops.scheduling.fori_loop, which takes traced bounds."
    )
  if steps == 0:
    return x, carry

  def step(i, x, fut, carry):
    carry, fut = overlap(fut, lambda x, c: compute(i, x, c), x, carry)
    return fut, carry

  with jax.named_scope("asyncops.staggered"):
    x, fut = start(x)
    fut, carry = step(0, x, fut, carry)

    def body(i, state):
      fut, carry = state
      x, fut = start(done(fut))
      return step(i, x, fut, carry)

    fut, carry = fori_loop(1, steps, body, (fut, carry))
    return done(fut), carry
