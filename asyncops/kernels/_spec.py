"""Static description of one asynchronous transfer.

An :class:`OpSpec` is the static half of a future: everything a done kernel
needs to know about the transfer its start kernel began (op, axis, perm,
shapes), fixed at trace time. It is hashable, so it can be a primitive
parameter and part of a pytree's static structure (loop carries compare it).
"""

import dataclasses
from typing import Literal

import numpy as np

Kind = Literal["ppermute", "bidirectional", "all_gather", "all_to_all", "copy"]
Transfer = Literal["start", "done"]
MemorySpace = Literal["any", "vmem"]

KINDS: tuple[str, ...] = (
  "ppermute",
  "bidirectional",
  "all_gather",
  "all_to_all",
  "copy",
)


@dataclasses.dataclass(frozen=True)
class OpSpec:
  """What a start kernel began and a done kernel must wait for.

  Attributes:
    kind: the operation.
    shape: the source buffer's shape (per device).
    dtype: the source buffer's dtype name.
    axis_name: the mesh axis communicated over (``None`` for a local copy).
    mesh_axes: every mesh axis name, in mesh order; kernels address devices
      by full mesh coordinates.
    axis_size: the size of ``axis_name`` (1 for a local copy).
    perm: ``(source, destination)`` pairs along ``axis_name``; for
      ``bidirectional`` the ring the first half of the rows travels
      (shift +1 or -1; the second half goes the other way).
    gather_axis: for ``all_gather``, where the new axis goes.
    tiled: for ``all_gather``, concatenate instead of stacking.
    memory_space: where the destination lives (``copy`` only).
    collective_id: the barrier semaphore id the start kernel uses.
    transfer: for the CPU emulation, whether data moves at the start or at
      the (first) done. Both must give the same result.
    view_dtype: the user's dtype when it travels as a carrier
      (``asyncops.futures._bitcast``: ``shape`` and ``dtype`` are then the
      carrier's); ``None`` when it travels as it is.
    whole: for ``bidirectional``, all of the source travels each way (no
      halves): the destination stacks the two copies along the split
      axis, twice the source's size there.
    rows: with ``whole``, the ``[lo, hi)`` range of the split axis that
      travels (``None``: all of it).
  """

  kind: Kind
  shape: tuple[int, ...]
  dtype: str
  axis_name: str | None = None
  mesh_axes: tuple[str, ...] = ()
  axis_size: int = 1
  perm: tuple[tuple[int, int], ...] = ()
  gather_axis: int = 0
  tiled: bool = False
  memory_space: MemorySpace = "any"
  collective_id: int | None = None
  transfer: Transfer = "start"
  view_dtype: str | None = None
  whole: bool = False
  rows: tuple[int, int] | None = None

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
    if self.transfer not in ("start", "done"):
      raise ValueError(f"transfer must be 'start' or 'done': {self.transfer!r}")
    if self.memory_space not in ("any", "vmem"):
      raise ValueError(
        f"memory_space must be 'any' or 'vmem': {self.memory_space!r}"
      )

  @property
  def np_dtype(self) -> np.dtype:
    import jax.numpy as jnp

    return jnp.dtype(self.dtype)

  @property
  def sources(self) -> frozenset[int]:
    return frozenset(s for s, _ in self.perm)

  @property
  def destinations(self) -> frozenset[int]:
    return frozenset(d for _, d in self.perm)

  @property
  def is_full_perm(self) -> bool:
    return len(self.destinations) == self.axis_size

  def short(self) -> str:
    """A one-line description for error messages and reports."""
    parts = [self.kind, f"{self.view_dtype or self.dtype}{list(self.shape)}"]
    if self.axis_name is not None:
      parts.append(f"axis={self.axis_name!r}")
    if self.kind == "ppermute":
      parts.append(f"perm={list(self.perm)}")
    if self.whole:
      parts.append(f"whole rows={list(self.rows)}" if self.rows else "whole")
    return " ".join(parts)
