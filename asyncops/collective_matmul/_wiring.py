"""Which ICI links a ring along a mesh axis loads: what ``method="auto"``
charges each candidate's transfers.

A ring of ``n`` devices is only a ring of links when consecutive devices
(the last and the first included) are neighbours. Sub-pod v5e and v6e
slices are meshes, not tori (their wraparound links exist only across a
full 16-chip dimension of the 16x16 pod), and v4 and v5p slices have
wraparound only from one full 4x4x4 cube up. So a ring along ``y`` of a
``2x4`` v5e mesh whose four devices sit in a row is a line: its wrapping
message crosses three links, and a two-way ring puts both directions'
halves on every link (one chunk per link per step, the one-way ring's
load). Messages go in dimension order (the benchmark model,
``benchmarks/_timeline.py``, routes them the same way).

:func:`for_axis` reads the devices of the mesh being traced over (inside
``shard_map``; ``jax.Device.coords`` of TPU devices, the ahead-of-time ones
included) and returns a :class:`Wiring`: for each transfer pattern the
candidates use, the most messages one directed link carries and the most
links one message crosses. Without coordinates (CPU, or no concrete mesh in
sight) it returns None and the estimates assume :func:`ideal`, a ring whose
every hop is one link.

Two orders. Our kernels and the value rings send to the neighbours in the
mesh axis's index order (``kernels/_common.ring_peer``: ``axis_index +-
1`` as mesh coordinates), so their loads are the mesh's. XLA's
collectives (all-gather, reduce-scatter, all-reduce over replica groups)
reorder their ring onto a physical cycle of the group's chips when one
exists (``has_reordering_map`` in the compiled HLO's backend config;
:func:`xla_order`, the benchmark model's rule too): :attr:`Wiring.xla`
holds that ring's loads. On ``tpu_mesh``'s ``y`` rows of a 2x4 v5e/v6e
slice (2x2 squares in device order, two hops of 2 links) XLA's ring is
the square's cycle, every hop one link.

Example:
  >>> w = from_coords([[(0, 0, 0), (1, 0, 0), (2, 0, 0), (3, 0, 0)]],
  ...                 wrap=(False, False, False))
  >>> w.shift_hops, w.bidi_load, w.direct_load    # a line of 4
  (3, 1.0, 4.0)
  >>> ideal(4).bidi_load, ideal(4).direct_load     # a ring of 4
  (0.5, 2.0)
"""

import dataclasses
from collections.abc import Sequence

import numpy as np

from asyncops import _jax_compat as jc


@dataclasses.dataclass(frozen=True)
class Wiring:
  """How the rings along one mesh axis load the links (all rings at once).

  Loads count messages (chunks) on the busiest directed link; hops count
  the links the longest message crosses.

  Attributes:
    n: devices per ring.
    shift_load: a one-way ring step (each device sends to the next).
    shift_hops: its longest message.
    bidi_load: a two-way ring step (half a chunk to each neighbour), in
      chunks.
    bidi_hops: its longest message.
    direct_load: every device sends its chunk to every other device of
      its ring (the fused all-gather's direct sends).
    direct_hops: its longest message.
    source: ``"coords"`` (the devices' coordinates) or ``"ideal"``.
    xla_order: the wiring of XLA's collectives over the same groups (the
      rings reordered onto a physical cycle, :func:`xla_order`) where that
      differs; None: the same as this one (see :attr:`xla`).
  """

  n: int
  shift_load: float
  shift_hops: int
  bidi_load: float
  bidi_hops: int
  direct_load: float
  direct_hops: int
  source: str = "coords"
  xla_order: "Wiring | None" = dataclasses.field(
    default=None, compare=False, repr=False
  )

  @property
  def xla(self) -> "Wiring":
    """The wiring XLA's collectives load: its ring order's."""
    return self.xla_order if self.xla_order is not None else self

  @property
  def is_ideal(self) -> bool:
    """Every ring hop one link, loads as a ring's."""
    i = ideal(self.n)
    return (self.shift_load, self.shift_hops, self.bidi_load) == (
      i.shift_load,
      i.shift_hops,
      i.bidi_load,
    ) and self.direct_load <= i.direct_load

  def describe(self) -> str:
    """One phrase for auto's reasons."""
    if self.is_ideal:
      return f"a ring of {self.n}"
    out = [f"a ring of {self.n}"]
    if self.shift_hops > 1:
      out.append(f"whose longest hop crosses {self.shift_hops} links")
    if self.bidi_load > ideal(self.n).bidi_load:
      out.append("with both directions of a two-way step on one link")
    if self.direct_load > ideal(self.n).direct_load:
      out.append(
        f"its direct sends {self.direct_load:g} chunks on the busiest "
        f"link (a ring's {ideal(self.n).direct_load:g})"
      )
    return ", ".join([" ".join(out[:2])] + out[2:])


def ideal(n: int) -> Wiring:
  """A ring of ``n`` whose every hop is one link (both directions free)."""
  direct = sum(min(d, n - d) for d in range(1, n)) / 2
  return Wiring(
    n,
    1.0,
    1 if n > 1 else 0,
    0.5,
    1 if n > 1 else 0,
    direct,
    n // 2,
    "ideal",
  )


def _path(a, b, extent, wrap):
  """Directed links from ``a`` to ``b`` in dimension order (the shorter
  way round a wrapping dimension)."""
  cur = list(a)
  for d in range(len(cur)):
    diff = b[d] - cur[d]
    if wrap[d] and extent[d] > 2:
      diff = (diff + extent[d] // 2) % extent[d] - extent[d] // 2
      if diff == -(extent[d] // 2) and extent[d] % 2 == 0 and a[d] % 2 == 0:
        diff = -diff  # ties alternate: half of them go the positive way
    step = 1 if diff > 0 else -1
    for _ in range(abs(diff)):
      nxt = list(cur)
      nxt[d] = (nxt[d] + step) % extent[d] if wrap[d] else nxt[d] + step
      yield tuple(cur), tuple(nxt)
      cur = nxt


def _loads(pairs, extent, wrap) -> tuple[float, int]:
  """(most messages on a directed link, most links a message crosses)."""
  load: dict = {}
  hops = 0
  for a, b in pairs:
    p = list(_path(a, b, extent, wrap))
    if not p and a != b:
      p = [("chip", a)]  # two cores of one chip
    hops = max(hops, len(p))
    for link in p:
      load[link] = load.get(link, 0) + 1
  return float(max(load.values(), default=0)), hops


def adjacent(a, b) -> bool:
  """Whether chips ``a`` and ``b`` are one link apart (no wraparound)."""
  return sum(abs(x - y) for x, y in zip(a, b, strict=True)) == 1


def cycles(chips: list[tuple], size: int) -> list[list[tuple]] | None:
  """Partitions ``chips`` into cycles of ``size`` neighbouring chips.

  Depth-first search (slices here have at most 16 chips); every cycle
  closes (its last chip neighbours its first). None when impossible. (The
  benchmarks' meshes, ``benchmarks/_mesh.py``, and the benchmark model's
  ring order, ``benchmarks/_timeline.py``, use this one.)
  """
  if size == 1:
    return [[c] for c in chips]
  if len(chips) % size:
    return None

  def extend(path, left):
    if len(path) == size:
      if size > 2 and not adjacent(path[-1], path[0]):
        return None
      rest = solve(left)
      return None if rest is None else [path, *rest]
    for c in sorted(left):
      if adjacent(path[-1], c):
        found = extend([*path, c], left - {c})
        if found is not None:
          return found
    return None

  def solve(left):
    if not left:
      return []
    first = min(left)
    return extend([first], left - {first})

  return solve(frozenset(chips))


def xla_order(ring: Sequence[tuple]) -> list[tuple]:
  """The order XLA runs its ring over the chips ``ring`` (coordinates in
  mesh order): a physical cycle through them when one exists and every
  device is a chip of its own (more than two), else as given.

  XLA's TPU collectives reorder their ring (``has_reordering_map``); the
  benchmark model (``benchmarks/_timeline.py``, ``_ring_order``) applies
  this rule to every replica group.

  Example:
    >>> xla_order([(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)])
    [(0, 0, 0), (0, 1, 0), (1, 1, 0), (1, 0, 0)]
  """
  ring = [tuple(c) for c in ring]
  if len(set(ring)) != len(ring) or len(ring) <= 2:
    return ring
  found = cycles(sorted(ring), len(ring))
  return found[0] if found else ring


def from_coords(
  rings: Sequence[Sequence[tuple]], wrap: Sequence[bool]
) -> Wiring:
  """The wiring of ``rings`` (device coordinates in ring order, all rings
  of the axis, running at once) on a slice whose dimensions wrap as
  ``wrap`` says; its :attr:`Wiring.xla` is the wiring of the same rings
  in XLA's order (:func:`xla_order`)."""
  rings = [[tuple(int(v) for v in c) for c in r] for r in rings]
  reordered = [xla_order(r) for r in rings]
  xla = None
  if reordered != rings:
    xla = _from_rings(reordered, wrap)
  return dataclasses.replace(_from_rings(rings, wrap), xla_order=xla)


def _from_rings(rings, wrap) -> Wiring:
  """:func:`from_coords` in the given order only."""
  n = len(rings[0])
  dims = len(rings[0][0])
  extent = [1 + max(c[d] for r in rings for c in r) for d in range(dims)]
  wrap = [bool(w) for w in wrap]

  def shift(s):
    return [(r[i], r[(i + s) % n]) for r in rings for i in range(n)]

  one, h1 = _loads(shift(1), extent, wrap)
  two, h2 = _loads(shift(1) + shift(-1), extent, wrap)
  direct = [
    (r[i], r[j]) for r in rings for i in range(n) for j in range(n) if i != j
  ]
  dl, dh = _loads(direct, extent, wrap)
  return Wiring(n, one, h1, two / 2, h2, dl, dh)


def wraps(device_kind: str | None, extent: Sequence[int]) -> tuple[bool, ...]:
  """Which dimensions of a slice of ``extent`` chips have wraparound links.

  v5e and v6e: a dimension of 16 (the 16x16 pod's); v4 and v5p: all of
  them once every dimension is a multiple of 4 (one 4x4x4 cube and up;
  Cloud TPU docs: smaller v5p slices "don't have wrap-around links").
  """
  kind = (device_kind or "").lower()
  if "v4" in kind or (
    "v5" in kind and "lite" not in kind and "v5e" not in kind
  ):
    cube = all(e % 4 == 0 for e in extent)
    return tuple(cube and e > 2 for e in extent)
  return tuple(e == 16 for e in extent)


def for_axis(axis_name) -> Wiring | None:
  """The wiring of the rings along ``axis_name`` (a name or a tuple of
  names) of the mesh being traced over, from its devices' coordinates;
  None when they are not known (no concrete mesh in sight, or devices
  without ``coords``, e.g. CPU)."""
  mesh = jc.trace_concrete_mesh()
  if mesh is None:
    return None
  names = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
  if not names or any(a not in mesh.axis_names for a in names):
    return None
  devs = np.asarray(mesh.devices)
  axes = [mesh.axis_names.index(a) for a in names]
  rest = [i for i in range(devs.ndim) if i not in axes]
  n = int(np.prod([devs.shape[i] for i in axes]))
  rows = np.transpose(devs, rest + axes).reshape(-1, n)
  coords = [[getattr(d, "coords", None) for d in r] for r in rows]
  if any(c is None for r in coords for c in r):
    return None
  flat = [tuple(c) for r in coords for c in r]
  extent = [1 + max(c[d] for c in flat) for d in range(len(flat[0]))]
  kind = getattr(devs.flat[0], "device_kind", None)
  return from_coords(coords, wraps(kind, extent))
