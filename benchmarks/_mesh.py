"""Meshes of ahead-of-time TPU devices laid out as physical rings.

The benchmarks run every variant on a mesh with axes ``("x", "y")``; the
collective runs over ``y``. Small v5e/v6e/v5p slices have no wraparound
links, so which chips form a ``y`` ring decides whether each ring hop is
one ICI link:

- ``layout="ring"`` (default): every ``y`` ring is a physical cycle of
  chips (each hop one link, both directions free for a bidirectional
  ring). ``tp`` chooses the ring size: ``tp=4`` on 8 chips gives two 2x2
  squares (``x = 2``); ``tp=8`` one cycle through all 8 chips (``x = 1``).
- ``layout="line"``: ``y`` runs along the longest physical axis (an open
  line; the ring's wrap-around message crosses ``n - 1`` links).
- ``layout="chapter"``: ``jax.make_mesh((2, 4), ...)``'s own device order,
  the mesh the chapter measured on.
"""

import contextlib
import os
import sys
from typing import Literal

import numpy as np

from asyncops.collective_matmul import _wiring

Layout = Literal["ring", "line", "chapter"]


@contextlib.contextmanager
def quiet_fd2():
  """libtpu prints start-up warnings to fd 2; keep them off the terminal."""
  sys.stderr.flush()
  saved = os.dup(2)
  with open(os.devnull, "w") as null:
    os.dup2(null.fileno(), 2)
    try:
      yield
    finally:
      os.dup2(saved, 2)
      os.close(saved)


def make_mesh(topology: str, layout: Layout = "ring", tp: int | None = None):
  """A ``("x", "y")`` mesh of the topology's devices.

  Args:
    topology: e.g. ``"v5e:2x4"``.
    layout: ``"ring"``, ``"line"`` or ``"chapter"`` (module docstring).
    tp: devices on ``y`` (the tensor-parallel degree); default 4 when the
      slice has 8 devices, else half of them. ``x`` gets the rest.

  Returns:
    The mesh.

  Raises:
    ValueError: unknown layout, or ``tp`` does not divide the devices.
  """
  from jax.experimental import topologies  # noqa: PLC0415
  from jax.sharding import Mesh  # noqa: PLC0415

  if layout not in ("ring", "line", "chapter"):
    raise ValueError(
      f"layout must be 'ring', 'line' or 'chapter', got {layout!r}"
    )
  # Several processes (tests, benchmarks) may compile for TPU at once.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  with quiet_fd2():
    topo = topologies.get_topology_desc(topology, platform="tpu")
  devs = sorted(
    topo.devices,
    key=lambda d: (*reversed(d.coords), getattr(d, "core_on_chip", 0)),
  )
  n = len(devs)
  tp = tp or (n // 2 if n > 2 else n)
  if tp < 1 or n % tp:
    raise ValueError(
      f"tp={tp} does not divide the {n} devices of {topology!r}; use one "
      f"of {[d for d in range(1, n + 1) if n % d == 0]}."
    )
  if layout == "chapter":
    import jax  # noqa: PLC0415

    return jax.make_mesh((n // tp, tp), ("x", "y"), devices=devs)
  if layout == "ring":
    rows = _ring_rows(devs, tp)
    if rows is not None:
      return Mesh(np.array(rows), ("x", "y"))
  x = n // tp
  return Mesh(np.array(devs).reshape(tp, x).T, ("x", "y"))


def _ring_rows(devs, tp):
  """``n // tp`` rows of ``tp`` devices, each a physical cycle, or None."""
  chips = sorted({tuple(d.coords) for d in devs})
  by_chip: dict[tuple, list] = {}
  for d in devs:
    by_chip.setdefault(tuple(d.coords), []).append(d)
  per_chip = len(devs) // len(chips)
  if per_chip > 1:  # several cores per chip: x = the core, y = the chips
    if tp != len(chips):
      return None
    cycle = _wiring.cycles(chips, tp)
    if cycle is None:
      return None
    return [[by_chip[c][core] for c in cycle[0]] for core in range(per_chip)]
  cycles = _wiring.cycles(chips, tp)
  if cycles is None:
    return None
  return [[by_chip[c][0] for c in cyc] for cyc in cycles]


def mesh_rings(mesh) -> list[list[int]]:
  """Partition ids of each ``y`` ring (partition id = flat mesh index)."""
  ids = np.arange(mesh.devices.size).reshape(mesh.devices.shape)
  return [list(map(int, r)) for r in ids]


def axis_rings(mesh) -> dict[str, list[list[int]]]:
  """Partition ids of the rings along each mesh axis (``x``: columns)."""
  ids = np.arange(mesh.devices.size).reshape(mesh.devices.shape)
  return {
    name: [
      list(map(int, r))
      for r in np.moveaxis(ids, i, -1).reshape(-1, ids.shape[i])
    ]
    for i, name in enumerate(mesh.axis_names)
  }


def coords(mesh) -> list[tuple]:
  """Chip coordinates per partition id."""
  return [tuple(d.coords) for d in mesh.devices.flat]
