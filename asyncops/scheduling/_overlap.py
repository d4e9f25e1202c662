"""``overlap``: run a function inside a transfer's start/done window.

XLA schedules by data dependence only, so compute written between a start
and its done may run before the start or after the done. ``overlap`` adds
the two missing edges with ``jax.lax.optimization_barrier``:

1. the future's leaves and ``fn``'s arguments go through one barrier, so
   ``fn`` reads values that exist only after the start;
2. the future's leaves and ``fn``'s results go through a second barrier, so
   the done (which consumes the future) waits for ``fn``.

Leaves are deduplicated by identity before each barrier: when an argument
*is* the future's source (the aliased ``x`` a start returned), ``fn`` gets
the barrier's output of that one value. Passing it twice would give XLA
two names for one aliased buffer, which is how barriers get defeated by
inserted copies (jax-ml/jax#25399, openxla/xla#20440).

Limits. The barriers order ``fn`` against the start and done of the
futures passed in, nothing else. They do not make XLA keep a buffer in
HBM or VMEM, and they cannot stop a copy the program needs for other
reasons (e.g. using the pre-start ``x``; the harness reports those).
"""

from collections.abc import Callable
from typing import Any

import jax

from asyncops.scheduling import _trees


def _barrier(leaves: list[Any]) -> list[Any]:
  """``optimization_barrier`` over the unique array leaves, by identity."""
  index: dict[int, int] = {}
  unique: list[Any] = []
  for leaf in leaves:
    if _trees.is_array(leaf) and id(leaf) not in index:
      index[id(leaf)] = len(unique)
      unique.append(leaf)
  if not unique:
    return list(leaves)
  out = jax.lax.optimization_barrier(unique)
  return [out[index[id(x)]] if id(x) in index else x for x in leaves]


def overlap(fut: Any, fn: Callable[..., Any], *args: Any) -> tuple[Any, Any]:
  """Runs ``fn(*args)`` between the start and the done of ``fut``.

  Args:
    fut: a :class:`asyncops.Future`, or any pytree of futures (several
      transfers in flight: ``fn`` runs inside all of their windows).
    fn: the compute to overlap; any traceable function.
    *args: its arguments. Pass the ``x`` the start returned, not the one
      you started from; ``fn`` receives the barriered value.

  Returns:
    ``(out, fut)``: ``fn``'s result and the future(s) to await instead of
    ``fut``. **Await the returned future**: the one passed in is consumed,
    and awaiting it raises :class:`asyncops.FutureError`.

  Raises:
    TypeError: ``fut`` holds no future, or ``fn`` is not callable.

  Example:
    >>> import jax, jax.numpy as jnp, asyncops
    >>> from jax.sharding import AxisType, PartitionSpec as P
    >>> mesh = jax.make_mesh((8,), ("i",), axis_types=(AxisType.Auto,))
    >>> @jax.jit
    ... @jax.shard_map(mesh=mesh, in_specs=P("i"), out_specs=P("i"))
    ... def f(x):
    ...   x, fut = asyncops.ppermute_start(x, "i", shift=1)
    ...   z, fut = asyncops.scheduling.overlap(fut, jnp.sin, x)
    ...   return asyncops.ppermute_done(fut) + z
    >>> x = jnp.arange(8.0)
    >>> bool(jnp.allclose(f(x), jnp.roll(x, 1) + jnp.sin(x)))
    True
  """
  if not callable(fn):
    raise TypeError(
      f"overlap: fn must be callable, got {type(fn).__name__}. The call is "
      "overlap(fut, fn, *args)."
    )
  if not _trees.has_future(fut):
    raise TypeError(
      "overlap: fut holds no asyncops.Future (got "
      f"{type(fut).__name__}). Pass the future a *_start function returned "
      "(or a tuple of them) as the first argument."
    )
  fut_leaves, rebuild = _trees.split_futures(fut)
  arg_leaves, arg_def = jax.tree.flatten(args)
  n = len(fut_leaves)
  with jax.named_scope("asyncops.overlap"):
    leaves = _barrier(fut_leaves + arg_leaves)
    fut_leaves = leaves[:n]
    args = jax.tree.unflatten(arg_def, leaves[n:])
    out = fn(*args)
    out_leaves, out_def = jax.tree.flatten(out)
    leaves = _barrier(fut_leaves + out_leaves)
  out = jax.tree.unflatten(out_def, leaves[n:])
  return out, rebuild(leaves[:n])
