"""Public per-generation TPU figures used by the timeline model.

Every number is per chip and comes from Google's Cloud TPU documentation
(``cloud.google.com/tpu/docs/{v4,v5e,v5p,v6e}``) unless marked otherwise:

====  ========  ========  ===========  =========  ======================  =====
gen   bf16 TF/s int8 TOPS HBM GB/s     ICI ports  ICI GB/s bidi per chip  clock
====  ========  ========  ===========  =========  ======================  =====
v4    275       275       1200         6 (3D)     (not in docs; 45/link)  1.05
v5e   197       394       819          4 (2D)     400                     1.50
v5p   459       918       2765         6 (3D)     1200                    1.75
v6e   918       1836      1640         4 (2D)     800                     1.75
====  ========  ========  ===========  =========  ======================  =====

The per-link one-way bandwidth is the bidirectional per-chip figure divided
by (2 x ports): v5e 50 GB/s, v5p 100 GB/s, v6e 100 GB/s nominal, times
``LINK_EFFICIENCY`` (0.92: a public Pallas study measured about 92 GB/s
per link with pipelined remote DMAs on a 2x2 v5p): v5e 46, v5p 92, v6e 92,
v4 41.4 GB/s used. The v4 docs give no
ICI figure; we use 45 GB/s one-way per link, the value "How to Scale Your
Model" (the book the chapter belongs to) tabulates for v4 (it tabulates
45 GB/s for v5e too, 10% under the Cloud figure we use).

The clock is not published; it is derived as peak / (2 x MXUs x MXU
cells): v5e 4 MXUs of 128x128 -> 1.50 GHz; v4 and v5p 2 TensorCores x 4
MXUs of 128x128 -> 1.05 / 1.75 GHz; v6e 4 MXUs of 256x256 -> 1.75 GHz. XLA's
``estimated_cycles`` are converted to seconds with it; ``tests/
test_timeline.py`` checks the result against the FLOP roofline of a large
matmul, which validates clock and cost model together.

Links are routed as an open grid (no wraparound): true for v5e/v6e slices
smaller than 16 along an axis and for v4/v5p slices smaller than a cube.

Latencies are assumptions (no public figure): 1 us per ICI hop, 1 us to
issue an async transfer (start kernel or XLA ``*-start``), 0.5 us for a done
that finds its transfer complete.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Chip:
  """Figures of one TPU generation (per chip).

  Attributes:
    name: generation, e.g. ``"v5e"``.
    clock_hz: TensorCore clock, converts ``estimated_cycles`` to seconds.
    bf16_flops: peak bf16 FLOP/s.
    hbm_bytes_per_s: HBM bandwidth.
    ici_link_bytes_per_s: one ICI link, one direction.
    ici_hop_s: latency added per hop a transfer crosses.
    issue_s: cost of issuing an async transfer (on the compute track).
    done_s: cost of a done whose transfer has completed.

  Example:
    >>> CHIPS["v5e"].ici_link_bytes_per_s
    46000000000.0
  """

  name: str
  clock_hz: float
  bf16_flops: float
  hbm_bytes_per_s: float
  ici_link_bytes_per_s: float
  int8_flops: float = 0.0
  ici_hop_s: float = 1e-6
  issue_s: float = 1e-6
  done_s: float = 0.5e-6

  def peak_flops(self, dtype: str) -> float:
    """Peak FLOP/s for matmul operands of ``dtype`` (HLO name, e.g. bf16).

    8-bit integer and float operands run at the int8 peak where the chip
    has one; every other type at the bf16 peak, a loose but valid upper
    bound (f32 and int32 matmuls are several bf16 passes or not on the
    MXU at all).
    """
    if dtype in ("s8", "u8", "f8e4m3fn", "f8e5m2") and self.int8_flops:
      return self.int8_flops
    return self.bf16_flops

  def scaled_latency(self, factor: float) -> "Chip":
    """This chip with hop, issue and done latencies times ``factor``."""
    return dataclasses.replace(
      self,
      ici_hop_s=self.ici_hop_s * factor,
      issue_s=self.issue_s * factor,
      done_s=self.done_s * factor,
    )

  def __post_init__(self):
    for f in ("clock_hz", "bf16_flops", "hbm_bytes_per_s"):
      if getattr(self, f) <= 0:
        raise ValueError(f"Chip.{f} must be positive, got {getattr(self, f)}")
    if self.ici_link_bytes_per_s <= 0:
      raise ValueError("Chip.ici_link_bytes_per_s must be positive.")


# Achievable over nominal link bandwidth: a public Pallas study measured
# about 92 GB/s per link with pipelined remote DMAs on v5p (nominal 100).
LINK_EFFICIENCY = 0.92
_E = LINK_EFFICIENCY

CHIPS: dict[str, Chip] = {
  "v4": Chip("v4", 1.05e9, 275e12, 1200e9, _E * 45e9, int8_flops=275e12),
  "v5e": Chip("v5e", 1.5e9, 197e12, 819e9, _E * 400e9 / 8, int8_flops=394e12),
  "v5p": Chip(
    "v5p", 1.75e9, 459e12, 2765e9, _E * 1200e9 / 12, int8_flops=918e12
  ),
  "v6e": Chip(
    "v6e", 1.75e9, 918e12, 1640e9, _E * 800e9 / 8, int8_flops=1836e12
  ),
}


def chip_for(topology: str) -> Chip:
  """The :class:`Chip` for a topology string such as ``"v5e:2x4"``.

  Raises:
    ValueError: unknown generation; names the ones we know.
  """
  gen = topology.split(":")[0].lower().replace("lite", "e")
  if gen not in CHIPS:
    raise ValueError(
      f"topology {topology!r}: unknown TPU generation {gen!r}; use one of "
      f"{sorted(CHIPS)} (e.g. 'v5e:2x4')."
    )
  return CHIPS[gen]
