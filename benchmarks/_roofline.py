"""The roofline of one device's share of a collective matmul.

Three floors, each a time no implementation can beat on the chip:

- compute: the device's matmul FLOPs at the chip's peak for the operand
  type (:meth:`Chip.peak_flops`; an f32 matmul at ``HIGHEST`` precision is
  6 bf16 passes, ``HIGH`` 3; int32 is held to the bf16 peak, a loose
  bound).
- HBM: the bytes the device must read and write once (its weight shard, the
  gathered activation, its output) at HBM bandwidth.
- links: the bytes the device must receive (all-gather) or send
  (reduce-scatter) over the links of its ring, at the link bandwidth; a
  float32 all-gather at one MXU pass (``DEFAULT``) counts its gathered
  operand as bfloat16, which the MXU rounds it to anyway (a kernel can
  send it so, as the fused all-gather does; partial sums are not
  rounded: the other families count their own dtype). A
  ring that is a physical cycle gives every device two links (one per
  direction); on an open line (a ring axis laid along a slice edge with
  no wraparound, or a ring of two) an end device has one link to its
  ring, so all ``y - 1`` shards cross it (:func:`ring_links`).

``roofline = max(compute, HBM, links)``: ``max``, not the sum, because an
ideal kernel overlaps all three.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from benchmarks._chips import Chip

_HLO_NAMES = {
  "bfloat16": "bf16",
  "float32": "f32",
  "float16": "f16",
  "int32": "s32",
  "int8": "s8",
}
RING_LINKS = 2  # a ring device receives on two links (one per direction)


def ring_links(rings) -> int:
  """Links the worst-placed device of ``rings`` has to its ring: 2 when
  every ring is a physical cycle of three or more chips, 1 when some
  device has a single ring member next to it (an end of an open line, a
  ring of two).

  Args:
    rings: per ring, its devices' chip coordinates (tuples, one per
      device, in any order; devices of one chip are counted once).

  Example:
    >>> ring_links([[(0, 0), (1, 0), (1, 1), (0, 1)]])  # a 2x2 cycle
    2
    >>> ring_links([[(0, 0), (1, 0), (2, 0), (3, 0)]])  # a line of 4
    1
  """
  worst = RING_LINKS
  for ring in rings:
    chips = sorted(set(map(tuple, ring)))
    if len(chips) < 2:
      continue
    for c in chips:
      near = sum(
        1
        for o in chips
        if sum(abs(a - b) for a, b in zip(c, o, strict=True)) == 1
      )
      worst = min(worst, max(near, 1))
  return worst


@dataclasses.dataclass(frozen=True)
class Roofline:
  """Floors in seconds; ``total_s`` is their maximum."""

  compute_s: float
  hbm_s: float
  links_s: float

  @property
  def total_s(self) -> float:
    return max(self.compute_s, self.hbm_s, self.links_s)


def _passes(dtype: str, precision: str | None) -> int:
  if dtype != "float32":
    return 1
  return {"highest": 6, "high": 3}.get((precision or "").lower(), 1)


def roofline(
  family: str,
  shape: tuple[int, int, int],
  x: int,
  y: int,
  dtype,
  chip: Chip,
  precision: str | None = None,
  links: int = RING_LINKS,
) -> Roofline:
  """The floors of ``family`` at global ``(B, D, F)`` on an ``x`` by ``y``
  mesh (the collective over ``y``); ``links``: how many links the
  worst-placed device has to its ring (:func:`ring_links`; 2 for a
  physical cycle, 1 for an open line).

  Raises:
    ValueError: unknown family.
  """
  b, d, f = shape
  m = b // x
  name = np.dtype(dtype).name
  s = np.dtype(dtype).itemsize
  peak = chip.peak_flops(_HLO_NAMES.get(name, name)) / _passes(name, precision)
  link = links * chip.ici_link_bytes_per_s
  if family == "allgather":
    flops = 2 * m * d * (f // y)
    hbm = s * (d * (f // y) + m * d + m * (f // y))
    # One MXU pass rounds the gathered operand to bfloat16: it may travel so.
    sent = 2 if name == "float32" and _passes(name, precision) == 1 else s
    links = sent * (y - 1) * m * (d // y)
  elif family == "reducescatter":
    flops = 2 * m * (f // y) * d
    hbm = s * ((f // y) * d + m * (f // y) + m * (d // y))
    links = s * (y - 1) * m * (d // y)
  elif family == "allreduce":
    flops = 2 * m * (d // y) * f
    hbm = s * ((d // y) * f + m * (d // y) + m * f)
    links = 2 * s * (y - 1) * m * (f // y)
  elif family == "mlp":
    flops = 4 * m * d * (f // y)
    hbm = s * (2 * d * (f // y) + 2 * m * d + m * (f // y))
    links = 2 * s * (y - 1) * m * (d // y)
  elif family in ("mlp_gated", "mlp_sp_gated"):
    # Three weights (gate, up, down) and one gather for gate and up; the
    # sequence-parallel layout moves the same bytes (m / y tokens of d
    # instead of m tokens of d / y) in the gather and the reduce-scatter.
    flops = 6 * m * d * (f // y)
    hbm = s * (3 * d * (f // y) + 2 * m * d + m * (f // y))
    links = 2 * s * (y - 1) * m * (d // y)
  elif family == "mlp_train":
    # Forward and backward: each of the two matmuls thrice (the product and
    # the gradients of both operands). Weights read twice and their
    # gradients written; the activations and their cotangents likewise.
    # Links: the forward's gather and scatter, the backward's gather of the
    # output cotangent and scatter of the input's (a weight gradient can
    # reuse a gathered input, so its second gather is not counted).
    flops = 12 * m * d * (f // y)
    hbm = s * (6 * d * (f // y) + 4 * m * d + 3 * m * (f // y))
    links = 4 * s * (y - 1) * m * (d // y)
  else:
    raise ValueError(
      f"roofline: unknown family {family!r}; use allgather, reducescatter, "
      "allreduce, mlp, mlp_gated, mlp_sp_gated or mlp_train."
    )
  return Roofline(
    flops / peak, hbm / chip.hbm_bytes_per_s, links / link if y > 1 else 0.0
  )
