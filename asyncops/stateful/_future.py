"""The stateful future: semaphores and static metadata only.

A :class:`RefFuture` has the start's DMA semaphores as pytree children and
the static :class:`OpSpec` and :class:`Layout` as structure, so it can be a
loop carry. The buffers are the Refs themselves: the caller passes them again
to the done. At trace time the future also remembers (not as pytree data)
where it was started and on which Refs, for the hazard check.
"""

import warnings

import jax

from asyncops.futures._future import FutureError, NeverAwaitedWarning
from asyncops.futures._spec import OpSpec
from asyncops.stateful._layout import Layout


@jax.tree_util.register_pytree_node_class
class RefFuture:
  """A transfer between Refs in flight; await it once with the done.

  Example:
    >>> fut = asyncops.stateful.ppermute_start(x_ref, y_ref, "i", shift=1)
    >>> asyncops.stateful.ppermute_done(fut, x_ref, y_ref)  # doctest: +SKIP
  """

  __slots__ = (
    "sems",
    "spec",
    "layout",
    "_origin",
    "_status",
    "_track",
    "_awaited_at",
  )

  def __init__(self, sems, spec: OpSpec, layout: Layout, *, origin=None):
    self.sems = tuple(sems)
    self.spec = spec
    self.layout = layout
    self._origin = origin
    self._status = "fresh"  # fresh | awaited | handed_off
    self._track = None  # (start_eqn, src_view, dst_view) while tracing
    self._awaited_at = "unknown"

  def tree_flatten(self):
    if self._status == "fresh":
      self._status = "handed_off"
    return (self.sems,), (self.spec, self.layout)

  @classmethod
  def tree_unflatten(cls, aux, children):
    fut = cls(children[0], *aux)
    fut._status = "handed_off"
    return fut

  def consume(self, fn: str, where: str) -> None:
    if self._status == "awaited":
      raise FutureError(
        f"asyncops.stateful.{fn}: the {self.spec.short()} started at "
        f"{self._origin or 'unknown'} was already awaited at "
        f"{self._awaited_at}; awaited again at {where}. A start is awaited "
        "exactly once: start a new transfer instead."
      )
    self._status = "awaited"
    self._awaited_at = where

  def __del__(self):
    if getattr(self, "_status", None) == "fresh":
      warnings.warn(
        f"asyncops.stateful: {self.spec.short()} started at "
        f"{self._origin} was never awaited: its destination Ref is still "
        "being written. Pass the future to the matching *_done.",
        NeverAwaitedWarning,
        stacklevel=2,
      )

  def __repr__(self):
    return f"RefFuture({self.spec.short()})"
