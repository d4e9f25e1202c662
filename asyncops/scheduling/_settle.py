"""``settle``: await a carry's futures once everything else in it exists.

The loop helpers never let a transfer cross a loop's back edge. The
staggered order a user writes,

  S0 C0 | D0 S1 C1 | D1 S2 C2 | ... | D(n-1)

(start, compute, and the done at the top of the next iteration) runs in
exactly the order

  S0 C0 D0 | S1 C1 D1 | S2 C2 D2 | ...

so each carried future is awaited at the end of the iteration that started
it, after that iteration's compute, and the next iteration receives a
``"ready"`` future whose done returns the value. The while loop then carries
plain arrays only, never a buffer a DMA is reading or writing, and all that
is left is ordinary double buffering (two iterations per trip).

``settle`` is that end of iteration: one ``optimization_barrier`` over every
array leaf of the carry (future leaves and values, deduplicated by
identity), then the done of each in-flight future. The barrier makes the
dones wait for all the iteration's compute (it stays inside the windows)
and stops XLA from fusing compute across iterations, which would keep a
received buffer alive into the next iteration's transfer and force a copy.
"""

from typing import Any

import jax

from asyncops.futures import Future, done, recv_done
from asyncops.scheduling import _trees
from asyncops.scheduling._overlap import _barrier


def _resolve(node: Any) -> Any:
  if not _trees.is_future(node) or node.state == "ready":
    return node
  origin = getattr(node, "_origin", None)
  if node.state == "sent":
    return Future((), None, recv_done(node), node.spec, "ready", origin=origin)
  src = node.src
  y = done(node)
  return Future((), src, y, node.spec, "ready", origin=origin)


def settle(tree: Any, by: str, seal: bool = True) -> Any:
  """Awaits every future in ``tree`` after all of ``tree``'s arrays exist.

  Args:
    tree: a loop carry (any pytree; may hold futures).
    by: the helper calling, named in life-cycle errors.
    seal: also hand on the barrier's outputs of the values (not only of
      the futures), so no compute fuses across the barrier: the end of a
      loop iteration. Before a loop (``False``) the values pass on as they
      were: XLA merges equal initial values (two ``zeros_like``) into one,
      and one value leaving a barrier into two carry slots is copied.

  Returns:
    ``tree`` with every in-flight (or sent) future replaced by a
    ``"ready"`` one holding the received value.
  """
  leaves, rebuild = _trees.split_futures(tree, by=by)
  if not any(_trees.is_array(x) for x in leaves):
    return rebuild(leaves)
  is_fut = [
    f
    for node in jax.tree.leaves(tree, is_leaf=_trees.is_future)
    for f in (
      [True] * len(jax.tree.leaves(node)) if _trees.is_future(node) else [False]
    )
  ]
  held = _barrier(leaves)
  if not seal:
    held = [h if f else x for h, x, f in zip(held, leaves, is_fut, strict=True)]
  tree = rebuild(held)
  return jax.tree.map(_resolve, tree, is_leaf=_trees.is_future)
