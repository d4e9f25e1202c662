"""Pytree plumbing shared by the helpers: futures inside arbitrary trees.

A user's "future" argument may be one :class:`asyncops.Future` or any
pytree holding several (several transfers in flight at once). The helpers
need the array leaves of all of them, and new futures built from barriered
leaves that keep the originals' life-cycle bookkeeping.
"""

from typing import Any

import jax

from asyncops.futures import Future


def is_future(x: Any) -> bool:
  return isinstance(x, Future)


def futures_in(tree: Any) -> list[Future]:
  """The :class:`Future` objects in ``tree`` (depth first)."""
  leaves = jax.tree.leaves(tree, is_leaf=is_future)
  return [f for f in leaves if is_future(f)]


def has_future(tree: Any) -> bool:
  return bool(futures_in(tree))


def is_array(x: Any) -> bool:
  return isinstance(x, jax.Array)


def split_futures(tree: Any, by: str = "asyncops.scheduling.overlap"):
  """Flattens ``tree`` to ``(leaves, rebuild)`` through its futures.

  ``rebuild(new_leaves)`` returns the same structure with every future
  replaced by a fresh :class:`Future` (same op, state and origin) holding
  the new leaves. The old futures are marked consumed, so awaiting one of
  them afterwards raises instead of waiting twice on the same semaphores.

  Args:
    tree: a pytree that may hold futures.
    by: the helper that supersedes them (named in life-cycle errors).

  Returns:
    ``(leaves, rebuild)``.
  """
  outer, outer_def = jax.tree.flatten(tree, is_leaf=is_future)
  leaves: list[Any] = []
  parts = []
  for node in outer:
    if is_future(node):
      children = (node.sems, node.src, node.dst)
      kids, kdef = jax.tree.flatten(children)
      parts.append((node, kdef, len(kids)))
      leaves.extend(kids)
    else:
      parts.append((None, None, 1))
      leaves.append(node)

  def rebuild(new_leaves):
    new_leaves = list(new_leaves)
    out, pos = [], 0
    for node, kdef, n in parts:
      chunk = new_leaves[pos : pos + n]
      pos += n
      if node is None:
        out.append(chunk[0])
        continue
      sems, src, dst = jax.tree.unflatten(kdef, chunk)
      origin = getattr(node, "_origin", None)
      node._supersede(by)
      out.append(Future(sems, src, dst, node.spec, node.state, origin=origin))
    return jax.tree.unflatten(outer_def, out)

  return leaves, rebuild
