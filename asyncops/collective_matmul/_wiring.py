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
  """

  n: int
  shift_load: float
  shift_hops: int
  bidi_load: float
  bidi_hops: int
  direct_load: float
  direct_hops: int
  source: str = "coords"

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


def from_coords(
  rings: Sequence[Sequence[tuple]], wrap: Sequence[bool]
) -> Wiring:
  """The wiring of ``rings`` (device coordinates in ring order, all rings
  of the axis, running at once) on a slice whose dimensions wrap as
  ``wrap`` says."""
  rings = [[tuple(int(v) for v in c) for c in r] for r in rings]
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
