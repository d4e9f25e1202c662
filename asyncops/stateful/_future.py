"""The stateful future: semaphores and static metadata only.

A :class:`RefFuture` has the start's DMA semaphores as pytree children and
the static :class:`OpSpec` and :class:`Layout` as structure, so it can be a
loop carry. The buffers are the Refs themselves: the caller passes them again
to the done. At trace time the future also remembers (not as pytree data)
where it was started and on which Refs, for the hazard check.

"Start never awaited" is an error, raised when the program is discharged
(at ``jit`` lowering, or by ``pl.run_state``'s discharge), when tracing is
over: each start carries a static ``token``; a future still fresh then
(neither awaited nor passed on as a pytree, e.g. a loop carry) was dropped.
"""

import itertools
import warnings

import jax

from asyncops import _jax_compat as jc
from asyncops.futures._future import FutureError, NeverAwaitedWarning
from asyncops.kernels._spec import OpSpec
from asyncops.stateful._layout import Layout

# token -> where a start whose future is still fresh was traced.
_pending: dict[int, str] = {}
_tokens = itertools.count(1)


# Tokens of starts whose source the kernels leave unpinned: on jax < 0.10,
# starts awaited in a capturing ``lax.cond`` / ``lax.switch`` branch
# (``stateful._api._unpin_captured``). Read when the start is discharged,
# after every branch was traced; kept for later lowerings of the same trace.
unpinned: set[int] = set()


def new_token() -> int:
  return next(_tokens)


def check_awaited(token: int, spec: OpSpec) -> None:
  """Raises if the future of the start with ``token`` was never awaited."""
  origin = _pending.get(token)
  if origin is not None:
    raise FutureError(
      f"asyncops.stateful: start never awaited: the {spec.short()} started "
      f"at {origin} has no done, so its destination Ref is still being "
      f"written when the program reads it or ends. Call "
      f"asyncops.stateful.{spec.kind}_done(fut, src_ref, dst_ref) before "
      "reading the destination."
    )


@jax.tree_util.register_pytree_node_class
class RefFuture:
  """A transfer between Refs in flight; await it once with the done.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from asyncops import stateful
    >>> mesh = jax.make_mesh((8,), ("i",),
    ...                      axis_types=(jax.sharding.AxisType.Auto,))
    >>> @jax.jit
    ... @jax.shard_map(mesh=mesh, in_specs=jax.P("i"), out_specs=jax.P("i"))
    ... def f(x):
    ...   x_ref, y_ref = jax.new_ref(x), jax.new_ref(jnp.zeros_like(x))
    ...   fut = stateful.ppermute_start(x_ref, y_ref, "i", shift=1)
    ...   print(type(fut).__name__, fut.spec.kind)
    ...   stateful.ppermute_done(fut, x_ref, y_ref)
    ...   return y_ref[...]
    >>> _ = f(jnp.arange(8.0))
    RefFuture ppermute
  """

  __slots__ = (
    "sems",
    "spec",
    "layout",
    "_origin",
    "_status",
    "_track",
    "_window",
    "_awaited_at",
    "_awaited_in",
    "_token",
  )

  def __init__(
    self, sems, spec: OpSpec, layout: Layout, *, origin=None, token=None
  ):
    self.sems = tuple(sems)
    self.spec = spec
    self.layout = layout
    self._origin = origin
    self._status = "fresh"  # fresh | awaited | handed_off
    self._track = None  # (start_eqn, src_view, dst_view) while tracing
    # (last barrier, tied semaphores) once a nested trace (a cond branch
    # closing over the future) awaited it: the start's frame is tied once,
    # every branch awaits the same semaphores.
    self._window = None
    self._awaited_at = "unknown"
    self._awaited_in = []  # the nested traces that awaited it (captured)
    self._token = token
    if token is not None:
      _pending[token] = origin or "unknown"

  def _settle(self, status: str) -> None:
    self._status = status
    if self._token is not None:
      _pending.pop(self._token, None)

  def tree_flatten(self):
    if self._status == "fresh":
      self._settle("handed_off")
    return (self.sems,), (self.spec, self.layout)

  @classmethod
  def tree_unflatten(cls, aux, children):
    if children[0]:  # entering a trace: check it when it ends
      jc.mark_frame(children[0][0])
    fut = cls(children[0], *aux)
    fut._status = "handed_off"
    return fut

  def consume(self, fn: str, where: str, nested=None) -> None:
    """Marks the future awaited (once).

    ``nested``: the trace awaiting it, when that is a ``lax.cond`` branch
    (or a ``jit``) closing over the future. Each branch traces its own
    await, so an await in another such trace is not refused here; the
    jaxpr check counts the awaits on every path (twice after a ``jit``,
    once per branch of a ``cond``).
    """
    if self._status == "awaited":
      known = any(t is nested for t in self._awaited_in)
      if nested is not None and self._awaited_in and not known:
        self._awaited_in.append(nested)
        return
      raise FutureError(
        f"asyncops.stateful.{fn}: the {self.spec.short()} started at "
        f"{self._origin or 'unknown'} was already awaited at "
        f"{self._awaited_at}; awaited again at {where}. A start is awaited "
        "exactly once: start a new transfer instead."
      )
    self._settle("awaited")
    self._awaited_at = where
    self._awaited_in = [nested] if nested is not None else []

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
