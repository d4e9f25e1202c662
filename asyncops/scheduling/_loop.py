"""``fori_loop`` that never lets XLA copy a buffer a transfer uses.

Background. ``jax.lax.fori_loop`` aliases the carry's input and output
buffers. A ring body (start a transfer from the carry, return what arrived)
asks for one buffer to be both source and destination, and XLA's copy
insertion copies it every trip. A staggered body (the carry holds a future,
awaited at the top of the next iteration) is worse: the while loop then
carries buffers a DMA is still reading and writing, and XLA copies those
(wrong results on TPU). Two more XLA behaviours add copies around such a
loop: the algebraic simplifier turns a prologue's ``zeros_like(x) + x``
into ``x``, so one value fills two carry slots (one of them in flight),
and the fusion pass merges the accumulating adds of consecutive iterations,
which keeps a received buffer alive into the next transfer.

Approach (see ``design/scheduling.md`` for the HLO evidence).

1. No transfer crosses the back edge. A carried future is awaited at the
   end of the iteration that started it (``settle``: a barrier over the
   whole carry, then the dones), and the next iteration gets a ``"ready"``
   future whose done returns the value. The order of starts, compute and
   dones is the one the user wrote; the while loop carries plain arrays.
2. Two iterations per trip, each sealed by ``settle``'s barrier, so
   consecutive transfers alternate between two buffers and no compute is
   fused across iterations: the carry returns to the buffers it entered
   with, and copy insertion has nothing to copy.
3. Static trip counts peel ``n % 2`` iterations inline before the loop
   (their futures stay in flight: straight-line code has no back edge);
   counts below two trips run inline entirely.

What breaks. Traced bounds: the odd iteration is peeled under
``lax.cond`` after every future was awaited, and XLA copies the carry
through the conditional (never a buffer in flight; a one-time copy, which
on some TPUs is a defensive copy the copy guard refuses). That warns
(:class:`CopyHazardWarning`); static bounds are copy-free. An odd
``unroll`` recreates the per-trip copy and raises :class:`CopyHazardError`.

Bodies that neither carry a future nor start or await a transfer go to
``jax.lax.fori_loop`` unchanged.
"""

import operator
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp

from asyncops.scheduling import _inspect_body, _trees
from asyncops.scheduling._errors import CopyHazardError, CopyHazardWarning
from asyncops.scheduling._settle import settle

Carry = TypeVar("Carry")

_BY = "asyncops.scheduling.fori_loop"


def _static_int(v: Any) -> int | None:
  """``v`` as a Python int, or None when it is only known at run time."""
  if isinstance(v, bool):
    return int(v)
  try:
    return operator.index(v)
  except TypeError:  # includes jax's TracerIntegerConversionError
    pass
  try:
    return int(v)
  except (TypeError, jax.errors.ConcretizationTypeError):
    return None


def _index_dtype(lower: Any, upper: Any):
  for v in (lower, upper):
    if not isinstance(v, int):
      return jnp.result_type(v)
  return jnp.result_type(lower)


def _check_unroll(unroll: Any) -> None:
  if unroll is None or isinstance(unroll, bool):
    return
  try:
    k = operator.index(unroll)
  except TypeError:
    raise TypeError(
      f"fori_loop: unroll must be None, a bool or a positive int, got "
      f"{type(unroll).__name__} {unroll!r}."
    ) from None
  if k < 1:
    raise ValueError(
      f"fori_loop: unroll={unroll!r}; it must be a positive int (iterations "
      "per trip). Leave unroll=None for loops with transfers (2 per trip), "
      "or pass an even number."
    )


def _needs_buffers(body_fun, index, init_val) -> bool:
  """Traces the body once: does it carry a future or start/await one?"""
  if _trees.has_future(init_val):
    return True
  jaxpr = _inspect_body.trace_body(body_fun, index, init_val).jaxpr
  return _inspect_body.uses_async(jaxpr)


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
  holds a future, or ``body_fun`` starts or awaits a transfer:

  - each future the body returns is awaited at the end of its iteration,
    after everything else the body computes (so that compute stays inside
    the transfer's window), and the next iteration receives it already
    resolved: **a future never crosses the loop's back edge**, and the
    futures in the returned carry are resolved (their done returns the
    value without waiting);
  - two iterations run per trip so the transfer buffers alternate.

  Otherwise this is ``jax.lax.fori_loop``.

  **Compute the body does before awaiting the carried future runs after
  that transfer completed** (it is in the next iteration); put it after
  the next start to overlap it. Static bounds give a copy-free loop; traced
  bounds work but cost a copy of the carry (a warning says so).

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
    CopyHazardError: an odd ``unroll`` for a loop with transfers.
    CopyHazardWarning: (warned) traced bounds for a loop with transfers.
    ValueError: ``unroll`` is 0 or negative.
    TypeError: ``body_fun`` is not callable, or ``unroll`` is not an int.

  Example:
    >>> import jax, jax.numpy as jnp, asyncops
    >>> from jax.sharding import AxisType, PartitionSpec as P
    >>> mesh = jax.make_mesh((8,), ("i",), axis_types=(AxisType.Auto,))
    >>> def body(i, x):
    ...   x, fut = asyncops.ppermute_start(x, "i", shift=1)
    ...   return asyncops.ppermute_done(fut)
    >>> @jax.jit
    ... @jax.shard_map(mesh=mesh, in_specs=P("i"), out_specs=P("i"))
    ... def f(x):
    ...   return asyncops.scheduling.fori_loop(0, 7, body, x)
    >>> f(jnp.arange(8.0)).tolist()  # seven hops right: one hop left
    [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 0.0]
  """
  if not callable(body_fun):
    raise TypeError(
      f"fori_loop: body_fun must be callable, got {type(body_fun).__name__}"
    )
  _check_unroll(unroll)
  dtype = _index_dtype(lower, upper)
  lo, hi = _static_int(lower), _static_int(upper)
  probe = jnp.zeros((), dtype) if lo is None else jnp.asarray(lo, dtype)
  if not _needs_buffers(body_fun, probe, init_val):
    return jax.lax.fori_loop(lower, upper, body_fun, init_val, unroll=unroll)
  if unroll is False or (
    unroll is not None and unroll is not True and int(unroll) % 2
  ):
    raise CopyHazardError(
      f"fori_loop: unroll={unroll!r} for a loop that starts or awaits "
      "transfers (or carries a future). With an odd unroll the carry "
      "returns the buffer it received into the slot it sent from, and XLA "
      "copies it every trip. Leave unroll=None (2) or pass an even number."
    )
  if unroll is True and lo is not None and hi is not None:
    return jax.lax.fori_loop(lo, hi, body_fun, init_val, unroll=True)
  k = 2 if unroll in (None, True) else int(unroll)
  with jax.named_scope("asyncops.fori_loop"):
    if lo is not None and hi is not None:
      return _static(lo, hi, body_fun, init_val, k, dtype)
    warnings.warn(
      "asyncops.scheduling.fori_loop: traced loop bounds. An odd trip count "
      "is peeled under lax.cond (after every future was awaited), and XLA "
      "copies the carry through it: a one-time copy of buffers no transfer "
      "is using, which asyncops.jit may still refuse as a defensive copy on "
      "some TPUs. Use static bounds for a copy-free loop.",
      CopyHazardWarning,
      stacklevel=2,
    )
    return _dynamic(lower, upper, body_fun, init_val, k, dtype)


def _sealed(body_fun):
  """The body followed by ``settle``: nothing in flight leaves it."""
  return lambda i, c: settle(body_fun(i, c), _BY)


def _static(lo, hi, body_fun, carry, k, dtype):
  n = max(hi - lo, 0)
  # Fewer than two trips of k would leave no while loop (JAX unrolls a
  # single trip): straight-line code has no back edge, so the futures stay
  # in flight from one iteration to the next and nothing is settled.
  peel = n if n < 2 * k else n % k
  for i in range(lo, lo + peel):
    carry = body_fun(jnp.asarray(i, dtype), carry)
  if n - peel == 0:
    return carry
  carry = settle(carry, _BY, seal=False)
  return jax.lax.fori_loop(lo + peel, hi, _sealed(body_fun), carry, unroll=k)


def _dynamic(lower, upper, body_fun, carry, k, dtype):
  lower = jnp.asarray(lower, dtype)
  upper = jnp.asarray(upper, dtype)
  n = jnp.maximum(upper - lower, 0)
  body = _sealed(body_fun)
  carry = settle(carry, _BY, seal=False)  # nothing in flight enters conds
  peel = n % k
  for r in range(1, k):
    # Peel up to k-1 leading iterations so the loop runs whole groups.
    carry = jax.lax.cond(
      peel >= r,
      lambda c, r=r: body(lower + (r - 1), c),
      lambda c: c,
      carry,
    )
  start = lower + peel

  def group(j, c):
    base = start + j * k
    for r in range(k):
      c = body(base + r, c)
    return c

  return jax.lax.fori_loop(0, n // k, group, carry)
