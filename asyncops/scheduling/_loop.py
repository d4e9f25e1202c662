"""``fori_loop`` that double-buffers loops of asynchronous transfers.

Background. ``jax.lax.fori_loop`` aliases the carry's input and output
buffers. A body that starts a transfer from the carry and returns the
received buffer (a ring), or that carries a future across iterations (a
staggered loop), asks for one buffer to be both source and destination;
XLA's copy insertion then copies every iteration. For a carried future
that copy reads or replaces a buffer a DMA is still using: wrong results
on TPU, not just a slow loop.

Approach. When the carry holds a future, or the body starts or awaits a
transfer, the loop runs two iterations per trip, so consecutive transfers
use two buffers that swap roles and the carry returns to the buffers it
started in. Odd trip counts peel the first iteration out of the loop
(statically, or under ``lax.cond`` when the bounds are traced); trip counts
0 and 1 need no loop at all. Other bodies go to ``jax.lax.fori_loop``
unchanged.

What breaks. A carry that returns one value in two slots while it is part
of a future cannot alternate at any unroll; that raises
:class:`CopyHazardError` at trace time, as does an explicit odd
``unroll``. With traced bounds the odd-count peel is a ``lax.cond``, and
XLA copies a carry through the branch that skips the peeled iteration
(measured on v5e/v4/v6e): for a carry of values that costs two one-time
copies outside the loop (:class:`CopyHazardWarning`); a carried future
would have its in-flight buffers copied, so that raises
:class:`CopyHazardError`.
"""

import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from jax import core as jax_core

from asyncops.scheduling import _inspect_body, _trees
from asyncops.scheduling._errors import CopyHazardError, CopyHazardWarning

Carry = TypeVar("Carry")


def _future_flags(tree: Any) -> list[bool]:
  flags: list[bool] = []
  for node in jax.tree.leaves(tree, is_leaf=_trees.is_future):
    if _trees.is_future(node):
      flags.extend([True] * len(jax.tree.leaves(node)))
    else:
      flags.append(False)
  return flags


def _static_int(v: Any) -> int | None:
  if isinstance(v, jax_core.Tracer) and not jax_core.is_concrete(v):
    return None
  try:
    return int(v)
  except (TypeError, jax.errors.ConcretizationTypeError):
    return None


def _index_dtype(lower: Any, upper: Any):
  for v in (lower, upper):
    if not isinstance(v, int):
      return jnp.result_type(v)
  return jnp.result_type(lower)


def _check_carry(body_fun, index, init_val) -> bool:
  """Traces the body once; returns whether it needs double buffering."""
  jaxpr = _inspect_body.trace_body(body_fun, index, init_val).jaxpr
  carry_has_future = _trees.has_future(init_val)
  flags = _future_flags(init_val)
  if len(flags) == len(jaxpr.outvars):
    for i, j in _inspect_body.repeated_outputs(jaxpr, flags):
      raise CopyHazardError(
        f"fori_loop: the body returns one value in carry leaves {i} and {j}, "
        "and one of them belongs to a future. XLA gives every carry leaf "
        "its own buffer, so it would copy a buffer a transfer is still "
        "using (wrong results on TPU). Carry the future only and read its "
        "value after the done (or keep the returned x out of the carry)."
      )
  return carry_has_future or _inspect_body.uses_async(jaxpr)


def fori_loop(
  lower: Any,
  upper: Any,
  body_fun: Callable[[Any, Carry], Carry],
  init_val: Carry,
  *,
  unroll: int | bool | None = None,
) -> Carry:
  """``jax.lax.fori_loop`` that never copies a buffer a transfer uses.

  Same signature and result as ``jax.lax.fori_loop``. When ``init_val``
  holds a future, or ``body_fun`` starts or awaits a transfer, two
  iterations run per trip (one is peeled for odd trip counts) so the
  transfer buffers alternate and XLA inserts no copy; otherwise this is
  ``jax.lax.fori_loop``.

  Args:
    lower: first index (int or int scalar; may be traced).
    upper: end index, exclusive (may be traced).
    body_fun: ``(i, carry) -> carry``.
    init_val: the initial carry; may hold futures.
    unroll: as for ``jax.lax.fori_loop``. For loops with transfers,
      ``None`` means 2; an explicit value must be even (or ``True``).

  Returns:
    The final carry.

  Raises:
    CopyHazardError: an odd ``unroll`` for a loop with transfers, or a
      carry that returns one value in two slots, one of them in a future.

  Example:
    >>> def body(i, x):  # doctest: +SKIP
    ...   x, fut = asyncops.ppermute_start(x, "i", shift=1)
    ...   return asyncops.ppermute_done(fut)
    >>> y = asyncops.scheduling.fori_loop(0, 7, body, x)  # doctest: +SKIP
  """
  if not callable(body_fun):
    raise TypeError(
      f"fori_loop: body_fun must be callable, got {type(body_fun).__name__}"
    )
  dtype = _index_dtype(lower, upper)
  lo, hi = _static_int(lower), _static_int(upper)
  probe = jnp.zeros((), dtype) if lo is None else jnp.asarray(lo, dtype)
  if not _check_carry(body_fun, probe, init_val):
    return jax.lax.fori_loop(lower, upper, body_fun, init_val, unroll=unroll)
  if (
    unroll is not None
    and unroll is not True
    and (unroll is False or int(unroll) % 2)
  ):
    raise CopyHazardError(
      f"fori_loop: unroll={unroll!r} for a loop that starts or awaits "
      "transfers (or carries a future). With an odd unroll the carry "
      "returns the buffer it received into the slot it sent from, and XLA "
      "copies it every trip (a copy of an in-flight buffer when a future "
      "is carried). Leave unroll=None (2) or pass an even number."
    )
  if unroll is True and lo is not None and hi is not None:
    return jax.lax.fori_loop(lo, hi, body_fun, init_val, unroll=True)
  k = 2 if unroll in (None, True) else int(unroll)
  with jax.named_scope("asyncops.fori_loop"):
    if lo is not None and hi is not None:
      return _static(lo, hi, body_fun, init_val, k, dtype)
    _check_dynamic(init_val)
    return _dynamic(lower, upper, body_fun, init_val, k, dtype)


def _check_dynamic(init_val) -> None:
  if _trees.has_future(init_val):
    raise CopyHazardError(
      "fori_loop: traced loop bounds with a future in the carry. An odd "
      "trip count is peeled under lax.cond, and XLA copies the carry "
      "through the branch that skips it: a copy of buffers a transfer is "
      "still using (wrong results on TPU). Make the bounds static Python "
      "ints, or await the future before the loop and start inside it."
    )
  warnings.warn(
    "asyncops.scheduling.fori_loop: traced loop bounds. The odd-trip-count "
    "peel is a lax.cond, and XLA copies the carry once before and once "
    "after the loop (no buffer in flight; results are exact). Use static "
    "bounds to avoid the copies.",
    CopyHazardWarning,
    stacklevel=3,
  )


def _static(lo, hi, body_fun, carry, k, dtype):
  n = max(hi - lo, 0)
  peel = n % k
  for i in range(lo, lo + peel):
    carry = body_fun(jnp.asarray(i, dtype), carry)
  if n - peel == 0:
    return carry
  return jax.lax.fori_loop(lo + peel, hi, body_fun, carry, unroll=k)


def _dynamic(lower, upper, body_fun, carry, k, dtype):
  lower = jnp.asarray(lower, dtype)
  upper = jnp.asarray(upper, dtype)
  n = jnp.maximum(upper - lower, 0)
  peel = n % k
  for r in range(1, k):
    # Peel up to k-1 leading iterations so the loop runs whole groups.
    carry = jax.lax.cond(
      peel >= r,
      lambda c, r=r: body_fun(lower + (r - 1), c),
      lambda c: c,
      carry,
    )
  start = lower + peel

  def group(j, c):
    base = start + j * k
    for r in range(k):
      c = body_fun(base + r, c)
    return c

  return jax.lax.fori_loop(0, n // k, group, carry)
