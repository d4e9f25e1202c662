"""Trace-time hazard check: Ref accesses between a start and its done.

Between a start and its done the DMA reads the source and writes the
destination. Writing the source, or reading or writing the destination, in
that window races with the DMA; on TPU it gives garbage, on CPU the two
emulation transfer points disagree. At the done we scan the equations traced
since the start (same jaxpr) for state effects on those Refs, and raise an
error naming the start and the offending access in the user's code.

Slots: an access to one slot ``buf.at[i]`` conflicts with a slot ``j`` when
``i`` and ``j`` are the same traced value or equal constants; slots the
double buffer hands out (``send``/``recv`` of one step) are known distinct;
other pairs of traced slots are assumed distinct (not checked).
"""

import jax

from asyncops import _jax_compat as jc
from asyncops.futures._future import FutureError
from asyncops.stateful._layout import RefView

# Pairs of slot Vars known to differ (the double buffer's send/recv).
_distinct: set[tuple[int, int]] = set()


def mark_distinct(a, b) -> None:
  va, vb = getattr(a, "val", a), getattr(b, "val", b)
  _distinct.add((id(va), id(vb)))
  _distinct.add((id(vb), id(va)))


def _static(x):
  v = getattr(x, "val", x)
  v = getattr(v, "val", v)  # a Literal's value
  try:
    return int(v)
  except Exception:  # noqa: BLE001 (traced)
    return None


def _same_slot(a, b) -> bool:
  """Whether slot accesses ``a`` and ``b`` may touch the same slot."""
  if a is None or b is None:
    return True
  va, vb = getattr(a, "val", a), getattr(b, "val", b)
  if va is vb:
    return True
  sa, sb = _static(a), _static(b)
  if sa is not None and sb is not None:
    return sa == sb
  return False


def maybe_same_slot(a, b) -> bool:
  """False only when slots ``a`` and ``b`` provably differ."""
  if a is None or b is None:
    return True
  va, vb = getattr(a, "val", a), getattr(b, "val", b)
  if va is vb:
    return True
  if (id(va), id(vb)) in _distinct:
    return False
  sa, sb = _static(a), _static(b)
  return sa is None or sb is None or sa == sb


_N_VALS = {"get": 1, "swap": 2, "addupdate": 2}


def _access_slot(eqn, pos):
  """The leading-axis slot an access touches, or None for all of it."""
  name = eqn.primitive.name
  if name not in _N_VALS or pos != 0 or "tree" not in eqn.params:
    return None
  leaves = eqn.in_tracers[_N_VALS[name] :]
  transforms = jax.tree_util.tree_unflatten(eqn.params["tree"], leaves)
  if not transforms:
    return None
  first = getattr(transforms[0], "indices", (None,))[0]
  if first is None or hasattr(first, "stride"):
    return None
  return first


def _hits(eqn, pos, view: RefView) -> bool:
  t = eqn.in_tracers[pos]
  if getattr(t, "val", None) is not getattr(view.base, "val", view.base):
    return False
  if view.slot is None:
    return True
  return _same_slot(_access_slot(eqn, pos), view.slot)


def check(fut, fn: str, here: str) -> None:
  """Raises if an access since ``fut``'s start races with its DMA."""
  start_eqn, src, dst = fut._track
  frame = jc.current_frame(fut.sems[0]) if fut.sems else None
  if frame is None:
    return
  eqns = jc.live_eqns(frame)
  at = next((i for i, e in enumerate(eqns) if e is start_eqn), None)
  if at is None:
    return
  for eqn in eqns[at + 1 :]:
    reads, writes = jc.ref_effect_inputs(eqn)
    for pos in sorted(reads | writes):
      what = None
      if pos in writes and _hits(eqn, pos, src):
        what = "writes the source Ref"
      elif _hits(eqn, pos, dst):
        what = ("writes" if pos in writes else "reads") + (
          " the destination Ref"
        )
      if what is not None:
        raise FutureError(
          f"asyncops.stateful.{fn}: {jc.eqn_where(eqn)} {what} of the "
          f"{fut.spec.short()} started at {fut._origin}, before its done at "
          f"{here}: that races with the DMA. Move the access after the "
          "done, or use another Ref (e.g. the other slot of a "
          "double_buffer)."
        )
