"""The value-level future: a pytree from a start to its done.

Layout. A :class:`Future` holds, as pytree children:

- ``sems``: the DMA semaphores the start kernel returned (``int32[]`` values;
  on TPU they are ``s32[]`` in semaphore memory, ``S(2)``),
- ``src``: the source buffer, aliased through the start kernel, so passing
  the future to the done keeps the source alive until the data has left
  (``None`` once ``send_done`` released it),
- ``dst``: the destination buffer the DMA writes into,

and as static structure the :class:`OpSpec` (op, axis, perm, shapes) and its
life-cycle state (``"inflight"``, ``"sent"``, or ``"ready"``). Futures
therefore travel through ``jit``, ``shard_map`` and loop carries like any
pytree.

A ``"ready"`` future holds no semaphores: a scheduling helper already
waited for its transfer (``asyncops.scheduling.fori_loop`` awaits each
carried future at the end of the iteration that started it, so no transfer
crosses a loop's back edge). ``dst`` is then the finalized result, which
every done returns as is; ``src`` is the source (``None`` if its sends were
awaited separately), which ``send_done`` returns.

Life cycle: start, then done exactly once. Awaiting a future twice is an
error at trace time; a future dropped without being awaited (and without
being handed to a transformation, e.g. as a loop carry) warns when it is
garbage collected.
"""

import warnings
import weakref
from typing import Any, Literal

import jax

from asyncops import _jax_compat as jc
from asyncops.kernels._spec import OpSpec

State = Literal["inflight", "sent", "ready"]


# The semaphores already awaited, by identity, while their tracers live: a
# future copied by ``jax.tree.map`` (or rebuilt from its children) is a new
# Python object holding the same semaphores, and must not be awaited again.
_awaited: "weakref.WeakValueDictionary[int, Any]" = (
  weakref.WeakValueDictionary()
)


# Where each live semaphore was started, so copies of a future report it.
_origins: dict[int, str] = {}


def _remember_origin(sems: tuple[Any, ...], origin: str) -> None:
  for s in sems:
    try:
      weakref.finalize(s, _origins.pop, id(s), None)
    except TypeError:
      continue
    _origins[id(s)] = origin


class FutureError(ValueError):
  """A future was used against its life cycle."""


class NeverAwaitedWarning(RuntimeWarning):
  """A future was dropped without being awaited."""


def _user_frame() -> str:
  """``file:line in fn`` of the user code calling asyncops (not our frames)."""
  return jc.user_source_frame()


@jax.tree_util.register_pytree_node_class
class Future:
  """An asynchronous transfer in flight.

  Create with a ``*_start`` function; consume exactly once with the
  matching ``*_done`` (or ``send_done`` then ``recv_done``).

  Example:
    >>> import asyncops, jax, jax.numpy as jnp
    >>> mesh = jax.make_mesh((8,), ("i",),
    ...                      axis_types=(jax.sharding.AxisType.Auto,))
    >>> @jax.jit
    ... @jax.shard_map(mesh=mesh, in_specs=jax.P("i"), out_specs=jax.P("i"))
    ... def f(x):
    ...   x, fut = asyncops.ppermute_start(x, "i", shift=1)
    ...   # pinned between start and done: overlaps the transfer on TPU
    ...   z, fut = asyncops.scheduling.overlap(fut, lambda x: x * 2, x)
    ...   return asyncops.ppermute_done(fut) + z
    >>> f(jnp.arange(8.0))
    Array([ 7.,  2.,  5.,  8., 11., 14., 17., 20.], dtype=float32)
  """

  __slots__ = (
    "sems",
    "src",
    "dst",
    "spec",
    "state",
    "_origin",
    "_status",
    "_successor_of",
  )

  def __init__(
    self,
    sems: tuple[Any, ...],
    src: Any,
    dst: Any,
    spec: OpSpec,
    state: State = "inflight",
    *,
    origin: str | None = None,
  ):
    self.sems = tuple(sems)
    self.src = src
    self.dst = dst
    self.spec = spec
    self.state = state
    if origin is None and self.sems:
      origin = _origins.get(id(self.sems[0]))
    elif origin is not None and state == "inflight":
      _remember_origin(self.sems, origin)
    self._origin = origin
    # "fresh": nobody consumed it; "awaited": a done consumed it;
    # "handed_off": flattened into a transformation that owns it now.
    self._status = "fresh"
    self._successor_of = None  # who replaced this future, once superseded

  # Pytree protocol ---------------------------------------------------------

  def tree_flatten(self):
    if self._status == "fresh":
      self._status = "handed_off"
    return (self.sems, self.src, self.dst), (self.spec, self.state)

  @classmethod
  def tree_unflatten(cls, aux, children):
    spec, state = aux
    sems, src, dst = children
    if sems:  # a future enters a trace: check that trace when it ends
      jc.mark_frame(sems[0])
    fut = cls(sems, src, dst, spec, state)
    # Futures made by transformations (loop bodies, jit) are tracked from
    # here on but never warn: their origin owns the obligation to await.
    fut._status = "handed_off"
    return fut

  # Life cycle --------------------------------------------------------------

  def _consume(self, by: str, sems: tuple[Any, ...]) -> None:
    """Marks this future and ``sems`` (the ones ``by`` waits on) awaited.

    Raises:
      FutureError: this future, or another holding one of ``sems`` (a
        ``jax.tree.map`` copy, a second capture), was already awaited.
    """
    if self._status == "superseded":
      raise FutureError(
        f"asyncops: future of {self.spec.short()} (started at "
        f"{self._origin or 'unknown'}) was passed to {self._successor_of}, "
        f"which returned a new future; {by} must wait on that one instead."
      )
    copy = any(_awaited.get(id(s)) is s for s in sems)
    if self._status == "awaited" or copy:
      how = " through a copy of it" if self._status != "awaited" else ""
      raise FutureError(
        f"asyncops: future of {self.spec.short()} (started at "
        f"{self._origin or 'unknown'}) was already awaited{how}; {by} may "
        "wait on it only once. Await each future once (not also a copy "
        "made by jax.tree.map), or start a new transfer."
      )
    self._status = "awaited"
    for s in sems:
      try:
        _awaited[id(s)] = s
      except TypeError:  # not weakly referenceable (e.g. a Python int)
        pass

  def _supersede(self, by: str) -> None:
    """Hands this future's obligation to a new future returned by ``by``.

    Raises:
      FutureError: this future was already awaited or superseded.
    """
    if self._status in ("awaited", "superseded"):
      self._consume(by, ())  # raises with the right message
    self._status = "superseded"
    self._successor_of = by

  def __del__(self):
    if getattr(self, "_status", None) == "fresh":
      warnings.warn(
        f"asyncops: future of {self.spec.short()} started at "
        f"{self._origin or 'an unknown line'} was never awaited: its DMA "
        "semaphores are left signalled. Pass it to the matching *_done.",
        NeverAwaitedWarning,
        stacklevel=2,
      )

  def __repr__(self):
    return f"Future({self.spec.short()}, state={self.state!r})"
