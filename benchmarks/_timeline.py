"""A TPU timeline model driven by XLA's own schedule and cost estimates.

Algorithm. One device runs the entry computation of the scheduled HLO
(SPMD: every device runs the same program, so one simulated device is the
step). Instructions execute in text order on a single compute track; each
costs its ``estimated_cycles`` (XLA's per-op cost model, in
``backend_config``) divided by the chip clock. Ops without an estimate cost
``(operand + result bytes) / HBM bandwidth`` if they move at least 64 KiB,
else nothing (scalar bookkeeping); an op whose estimate XLA marks
``COST_MODEL_TYPE_INVALID`` costs the smaller of that estimate and those
bytes, whatever memory space (HBM or VMEM) its operands and result sit
in. Every op but scalar bookkeeping costs at least its roofline (FLOPs
at peak, HBM bytes at HBM bandwidth). Custom calls without an estimate
(Mosaic kernels other than our start/done) are counted in
``unmodelled``. A stateful kernel (``*_ref_start``) moves one message, not
its whole destination Ref (see ``_ref_message``).

Transfers. An async transfer (our ``asyncops_*_start`` / ``*_done``
custom-call pair, or XLA's ``collective-permute-start/done``,
``all-gather-start/done``, ...) is issued at its start (costing
``Chip.issue_s`` on the compute track) and then runs on the ICI links,
concurrently with compute. Every message is routed over the device grid
(dimension order, no wraparound): a collective-permute sends its operand
along each source-target pair, an all-gather multicasts each shard to its
group (every directed link carries a shard at most once), reduce-scatter is
an all-gather of the output shard, all-reduce twice that. **Each directed
link is a FIFO**: a transfer's bytes on a link start when the link is free,
and the transfer ends when its last link finishes, plus ``hops x hop
latency``. Transfers on disjoint links (the two directions of a ring, or
two rings) therefore run at the same time; transfers sharing a link queue
on it. A done blocks until ``max(now, transfer end)``. Synchronous
collectives are exposed in full. Exposed communication = time blocked in
dones plus synchronous collectives. ``copy-start/done`` and
``slice-start/done`` (HBM <-> VMEM) run on one DMA track at HBM bandwidth,
which they share with the compute ops: a copy in flight while an op moves
its own HBM bytes ends later by that op's share (``_share_hbm``); a
cross-program prefetch moves its bytes on that track from time 0 too.
Charged, its consumer waits for its done (XLA's schedule); free (the
default: XLA may issue it before the step), it never blocks, but the
consumer (the first op reading its result, else the step) ends no
earlier than the copy: an op never finishes before the weight it reads
has crossed HBM once in the step (see ``_stream_end``). A Pallas kernel's
jnp twin (``fill``, :class:`Fill`) is modelled as the kernel reads: its
pipeline fill (what it reads whole, and the first block of what it
streams) first, free only the prefetches of what it streams.

While loops run their body ``known_trip_count`` times (from
``backend_config``); conditionals run their longest branch.

Limits: our kernels' peers are not in the HLO. A ppermute kernel is a ring
shift over ``rings`` (the mesh axis' devices in ring order); the library
writes the shift into the op name (``ring_shift+1``), default ``-1``, and
the axis when it is not the ring axis (``ring_axis_x``: the rings of
``axis_rings["x"]``, e.g. a data-parallel gradient exchange). A
bidirectional kernel sends half its destination's bytes each way (a
``whole=True`` kernel, its whole source). Link sharing is FIFO
per link, not fair sharing, so two transfers on one link finish one after
the other (same last end).
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np

from asyncops.collective_matmul import _wiring
from asyncops.inspect import Instr
from benchmarks._chips import Chip
from benchmarks._hlo import Module

Track = Literal["compute", "ici", "dma"]
_FREE = {
  "parameter",
  "constant",
  "get-tuple-element",
  "tuple",
  "bitcast",
  "opt-barrier",
  "after-all",
  "partition-id",
  "replica-id",
  "add-dependency",
}
_PASS = {"get-tuple-element", "bitcast", "tuple", "opt-barrier", "copy"}
_SYNC_COLLECTIVES = {
  "all-gather",
  "all-reduce",
  "reduce-scatter",
  "all-to-all",
  "collective-permute",
  "collective-broadcast",
}
_SMALL_BYTES = 64 * 1024
# Custom calls that only re-label buffers.
_FREE_TARGETS = {"ConcatBitcast", "AllocateBuffer", "Sharding"}
# A Pallas kernel's pipeline fill (``Fill``): its box's name in a twin's
# timeline, and its ``op`` there and in the kernel's own boxes.
FILL_NAME = "pipeline_fill"
FILL_OP = "pipeline-fill"
# The box of a split send's share of its start's issue (``_launch``).
SPLIT_ISSUE_OP = "split-send-issue"
# The box of the relay's DMA issues (``AgSpec.forward``, ``_relay``).
RELAY_ISSUE_OP = "relay-issue"


@dataclasses.dataclass(frozen=True)
class Event:
  """One box on the timeline (seconds)."""

  track: Track
  name: str
  kind: str  # compute | wait | transfer | collective | dma | overhead
  start: float
  dur: float
  lane: int = 0  # concurrent boxes of one track (ICI transfers) stack
  # Details for pictures (benchmarks/_trace.py): "op" (HLO opcode),
  # "links" ({(from_coords, to_coords): bytes} of an ICI transfer),
  # "awaits" (the start names a done waits on).
  args: dict = dataclasses.field(default_factory=dict, compare=False)


@dataclasses.dataclass
class Timeline:
  """The simulated step of one device.

  Attributes:
    events: every box, in issue order.
    step_s: end of the entry computation.
    exposed_comm_s: time blocked in dones plus synchronous collectives.
    compute_s: sum of compute boxes.
    transfers: number of transfers modelled.
    unmodelled: custom calls without an ``estimated_cycles`` (not ours).
    flags: why the step may not be fully costed (empty when it is): a
      custom call on the bytes model, a loop of unknown trip count, a
      collective without link time.
    floored_s: compute time added where an op's own roofline (FLOPs at
      peak, HBM bytes at HBM bandwidth) exceeds XLA's estimate.
    twin_s: time charged to Pallas kernels from their jnp twins.
    prefetch_s: time added (free prefetch) so that the op reading a
      cross-program prefetch's result ends no earlier than the copy (also
      in ``floored_s``, except at the step's end).
    hbm_shared_s: time DMA copies were delayed by the HBM bytes of the
      ops running beside them (``_share_hbm``).
    flops: matmul FLOPs of every op executed (loop bodies once per trip).
    loops: ``(while name, trips, "known" | "inferred" | "unknown")``.
  """

  events: list[Event]
  step_s: float
  exposed_comm_s: float
  compute_s: float
  transfers: int
  unmodelled: list[str]
  flags: list[str] = dataclasses.field(default_factory=list)
  floored_s: float = 0.0
  twin_s: float = 0.0
  prefetch_s: float = 0.0
  hbm_shared_s: float = 0.0
  flops: float = 0.0
  loops: list[tuple[str, int, str]] = dataclasses.field(default_factory=list)


def _iota_groups(spec: str) -> list[list[int]]:
  m = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", spec)
  if not m:
    return []
  out_shape = [int(x) for x in m.group(1).split(",")]
  dims = [int(x) for x in m.group(2).split(",")]
  ids = np.arange(int(np.prod(dims))).reshape(dims)
  if m.group(3):
    ids = ids.transpose([int(x) for x in m.group(3).split(",")])
  ids = ids.reshape(-1, out_shape[-1])
  return [list(map(int, g)) for g in ids]


_MESH = re.compile(
  r"mesh\[([^\]]*)\](?:,\s*device_ids=\(([^)]*)\))?\s*\{([^}]*)\}"
)
_AXIS = re.compile(r"'?([\w.\-]+)'?(?::\((\d+)\)(\d+))?$")


def _mesh_groups(spec: str) -> list[list[int]]:
  """Groups of the newer spelling ``mesh['a'=2,'b'=4] {'b'}``.

  The mesh lists its axes (major first) and, unless it is an iota, its
  device ids; the braces list the axes a group spans, in the group's order.
  A sub-axis ``'b':(pre)size`` is the ``size`` factor of axis ``b`` after
  its major factor ``pre``. A group is every device that shares the
  coordinates of all the other (sub-)axes.
  """
  m = _MESH.match(spec)
  if not m:
    return []
  names, sizes = [], []
  for item in m.group(1).split(","):
    name, _, size = item.strip().rpartition("=")
    names.append(name.strip("'\""))
    sizes.append(int(size))
  ids = np.arange(int(np.prod(sizes)))
  if m.group(2):
    ids = np.array([int(x) for x in re.findall(r"\d+", m.group(2))])
  refs = []
  for item in filter(None, (x.strip() for x in m.group(3).split(","))):
    a = _AXIS.match(item)
    if not a or a.group(1) not in names:
      return []
    axis = names.index(a.group(1))
    pre, size = (int(a.group(2)), int(a.group(3))) if a.group(2) else (1, 0)
    refs.append((axis, pre, size or sizes[axis]))
  # Split every axis at the cut points of its sub-axes (major first).
  dims, where = [], {}
  for axis, n in enumerate(sizes):
    cuts = {1, n}
    for ax, pre, size in refs:
      if ax == axis:
        cuts |= {pre, pre * size}
    for lo, hi in itertools.pairwise(sorted(cuts)):
      where[(axis, lo)] = len(dims)
      dims.append(hi // lo)
  grouped = []
  for axis, pre, size in refs:
    k = where[(axis, pre)]
    while size > 1:
      grouped.append(k)
      size //= dims[k]
      k += 1
  rest = [d for d in range(len(dims)) if d not in grouped]
  gsize = int(np.prod([dims[d] for d in grouped]))
  arr = ids.reshape(dims).transpose(rest + grouped).reshape(-1, gsize)
  return [list(map(int, g)) for g in arr]


def replica_groups(ins: Instr, n: int) -> list[list[int]]:
  """The device groups of a collective (all devices when absent/empty).

  Three spellings: explicit ``{{0,1},{2,3}}``, iota ``[2,4]<=[8]``, and
  mesh axes ``mesh['axis_0'=2,'axis_1'=4] {'axis_1'}``.

  Raises:
    ValueError: a spelling the model cannot read (never guessed).
  """
  text = ins.attr("replica_groups")
  if not text or text in ("{}", "{{}}"):
    return [list(range(n))]
  at = ins.attrs[ins.attrs.find("replica_groups=") + 15 :]
  if text.startswith("["):
    groups = _iota_groups(at)
  elif text.startswith("mesh"):
    groups = _mesh_groups(at)
  else:
    groups = [
      [int(x) for x in g.split(",") if x.strip()]
      for g in re.findall(r"\{([\d,\s]*)\}", text)
    ]
  if not groups or not all(groups):
    raise ValueError(
      f"{ins.name}: cannot read replica_groups={at[:80]!r}; teach "
      "benchmarks/_timeline.replica_groups this spelling."
    )
  return groups


def source_target_pairs(ins: Instr) -> list[tuple[int, int]]:
  text = ins.attr("source_target_pairs") or ""
  return [(int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", text)]


def _path(a: Sequence[int], b: Sequence[int]):
  """Directed links from ``a`` to ``b``, dimension order, open grid."""
  cur = list(a)
  for d in range(len(cur)):
    step = 1 if b[d] > cur[d] else -1
    while cur[d] != b[d]:
      nxt = list(cur)
      nxt[d] += step
      yield tuple(cur), tuple(nxt)
      cur = nxt


def link_load(
  sends: dict[int, list[int]], nbytes: float, coords: Sequence[Sequence[int]]
) -> tuple[float, int]:
  """Most bytes on one directed link, and most hops, for a set of sends.

  Args:
    sends: source device -> destination devices; one source's message to
      several destinations crosses each link once (multicast).
    nbytes: bytes each source sends.
    coords: grid coordinates per device id.

  Returns:
    ``(max link bytes, max hops)``.
  """
  load, hops = link_loads(sends, nbytes, coords)
  return max(load.values(), default=0.0), hops


def link_loads(
  sends: dict[int, list[int]], nbytes: float, coords: Sequence[Sequence[int]]
) -> tuple[dict[tuple, float], int]:
  """Bytes per directed link, and most hops, for a set of sends.

  Like :func:`link_load`, but keeps every link (the simulator queues each
  link separately, so transfers on disjoint links run concurrently).
  """
  load: dict[tuple, float] = {}
  hops = 0
  for src, dsts in sends.items():
    links = set()
    for dst in dsts:
      p = list(_path(coords[src], coords[dst]))
      if not p and dst != src:  # two cores of one chip: an on-chip copy
        p = [("chip", tuple(coords[src]))]
      hops = max(hops, len(p))
      links.update(p)
    for link in links:
      load[link] = load.get(link, 0.0) + nbytes
  return load, hops


def ring_sends(rings: Sequence[Sequence[int]], shift: int) -> dict:
  """Source -> [destination] for a shift by ``shift`` around each ring."""
  out: dict[int, list[int]] = {}
  for ring in rings:
    n = len(ring)
    for i, dev in enumerate(ring):
      out.setdefault(dev, []).append(ring[(i + shift) % n])
  return out


def _colors(ins: Instr) -> int:
  """Ring directions XLA chose (``StrategyRing{colors:N``), default 1."""
  m = re.search(r"colors:(\d+)", ins.attrs)
  return int(m.group(1)) if m else 1


_X_AXIS = "ring_axis_x/"
_SHIFT = re.compile(r"ring_shift([+-]\d+)")
# asyncops.stateful's op-name labels of a start's message (_ref_message).
_REF_DST_SLOT = "/ref_message_dst_slot/"
_REF_DST_WHOLE = "/ref_message_dst_whole/"
_RING_AXIS = re.compile(r"ring_axis_([^/\s\"]+)")
_HOPS = re.compile(r"ring_hops_([\d-]+)(_split)?(_fwd)?")
# A compute kernel that relays slot 0 at its end (``AgSpec.forward``).
_RELAYS = re.compile(r"ring_steps_[\w-]*_fwd")
# A fused all-gather whose receive slots are rows of its result
# (``AgSpec.recv_in_out``): ``ring_slots_<d>x<n - 1>x<m>x<k/d>x<bytes>``.
_SLOTS = re.compile(r"ring_slots_(\d+)x(\d+)x(\d+)x(\d+)x(\d+)")


def recv_slots(arrays, attrs: str) -> tuple[int, int, float] | None:
  """``(directions, slots per direction, bytes per slot)`` of a fused
  ring kernel's receive buffer (``arrays``: its start's results or its
  compute kernel's operands, ``attrs`` their metadata): the 4-D buffer
  ``[d, n - 1, m, k/d]``, or the slots a ``ring_slots_`` scope names
  (they are rows of the result); None when neither."""
  for a in arrays:
    if len(a.dims) == 4:
      d, n1 = a.dims[0], a.dims[1]
      return d, n1, a.nbytes / d / n1
  found = _SLOTS.search(attrs)
  if found is None:
    return None
  d, n1, m, kh, item = (int(v) for v in found.groups())
  return d, n1, float(m * kh * item)


@dataclasses.dataclass
class _Transfer:
  key: str
  family: str
  start: float
  end: float
  # Fused all-gather starts: arrival of each receive slot (both directions).
  slots: tuple[float, ...] = ()
  # A chained ring's start (the fused reduce-scatter's): it sends nothing;
  # one step's transfer, ``(link load, latency, steps)``, that its steps
  # kernel sends after each step (``KernelSteps.sends``).
  step: tuple | None = None
  # Fused all-gather starts: arrival of each slot's half per direction,
  # ``t * directions + d`` (``KernelSteps.halves``).
  halves: tuple[float, ...] = ()


@dataclasses.dataclass(frozen=True)
class KernelSteps:
  """A kernel's cost step by step, each step gated on the receive slots it
  consumes (a fused ring kernel waits for its chunks inside the kernel).

  Attributes:
    costs: seconds of each step (XLA's estimate of its jnp twin's dot).
    needs: per step, the receive slots of the start it waits for.
    blocks: column blocks per step; a step waits for its successor's
      slots before its last block (after all of them when 1).
    tails: when given, per step the share of it that runs after that wait
      (the kernel's last grid iterations; replaces the last block).
    sends: when given, per step the receive slot it sends once it ends
      (-1: none), on a chained ring (the fused reduce-scatter: partial
      sums exist only after a step): by symmetry every device runs the
      same schedule, so that slot of this device arrives one step's
      transfer later (its start sends nothing, ``_Transfer.step``).
    fill: seconds before the first step (the kernel's pipeline fill: what
      it reads before its first dot, see :class:`Fill`); in ``total``.
    halves: ``needs`` number each slot's half per direction, ``t *
      directions + d`` (a kernel whose steps are half-steps, one
      direction's halves each: ``_Transfer.halves``), not whole slots.
    hbm_bytes: when positive, the HBM bytes the kernel moves, for its
      floor in place of its operands' and results' (a kernel that reads
      some rows of an operand: ``AgSpec.forward``'s compute kernels).
  """

  costs: tuple[float, ...]
  needs: tuple[tuple[int, ...], ...]
  blocks: int = 1
  tails: tuple[float, ...] = ()
  sends: tuple[int, ...] = ()
  fill: float = 0.0
  halves: bool = False
  hbm_bytes: float = 0.0

  @property
  def total(self) -> float:
    return self.fill + sum(self.costs)


@dataclasses.dataclass(frozen=True)
class Fill:
  """What a Pallas kernel reads before its first dot, for its jnp twin's
  program (:func:`simulate`'s ``fill``): the twin is modelled as the kernel
  runs, not as XLA would run that program.

  Attributes:
    whole: the twin's parameter numbers the kernel reads whole before its
      first dot (a ``pl.Buffered(1)`` block). A cross-program prefetch of
      one is that read, inside ``seconds`` (not free, not twice).
    streamed: the twin's parameter numbers the kernel streams under its
      dots (a double-buffered ``BlockSpec``, or chunks it copies into VMEM
      under an earlier step's dots): a prefetch of one stays free (it
      blocks nothing; its reader ends no earlier than its bytes have
      crossed HBM, ``_stream_end``). A prefetch of any other parameter is
      charged: its reader waits for its done.
    seconds: the pipeline fill: the whole reads plus the first block of
      each streamed operand, at HBM bandwidth; a compute-track box before
      the twin's first op (the kernel's first dot waits for it). HBM moves
      nothing else meanwhile: the twin's copies start after it.
    first: ``(parameter, seconds)``: a streamed operand whose first block
      is the end of the fill; its prefetch starts that long before the
      fill ends (the same bytes), the rest of it under the dots.
    parts: ``(parameter, seconds)`` of each part of the fill (the whole
      reads and the first blocks). The first op that reads one of those
      parameters from HBM itself (not prefetched) and is bound by its
      bytes (its HBM bytes at bandwidth at least its FLOPs at peak) has
      them in its estimate already: it is charged that much less, never
      below the rest of its bytes or its FLOPs (``_fill_credit``). A
      compute-bound op keeps its estimate: the fill is before it.
  """

  whole: frozenset = frozenset()
  streamed: frozenset = frozenset()
  seconds: float = 0.0
  first: tuple[tuple[int, float], ...] = ()
  parts: tuple[tuple[int, float], ...] = ()


# Kernel-cost hook: (kernel instruction, module) -> seconds (or a
# KernelSteps), or None when no jnp twin is registered for it (see
# benchmarks/_kernel_costs.py).
KernelCost = Callable[[Instr, Module], "float | KernelSteps | None"]

_CMP = {
  "LT": lambda a, b: a < b,
  "LE": lambda a, b: a <= b,
  "GT": lambda a, b: a > b,
  "GE": lambda a, b: a >= b,
  "NE": lambda a, b: a != b,
}


def _window(attrs: str, rank: int) -> tuple[list[int], ...]:
  """``(stride, pad_lo, pad_hi, lhs_dilate, rhs_dilate)`` per spatial dim."""
  m = re.search(r"window=\{([^}]*)\}", attrs)
  text = m.group(1) if m else ""

  def field(name, default):
    f = re.search(rf"\b{name}=([\dx_]+)", text)
    return [int(v) for v in f.group(1).split("x")] if f else [default] * rank

  pads = re.search(r"\bpad=([\d_x]+)", text)
  lo, hi = [0] * rank, [0] * rank
  if pads:
    for n, p in enumerate(pads.group(1).split("x")):
      lo[n], hi[n] = (int(v) for v in p.split("_"))
  return (
    field("stride", 1),
    lo,
    hi,
    field("lhs_dilate", 1),
    field("rhs_dilate", 1),
  )


def _valid_taps(size, window, out, stride, lo, hi, lhs_dil, rhs_dil) -> float:
  """(output position, window position) pairs that read real input, not
  padding: a convolution XLA pads to place two products side by side does
  half the multiply-adds its window suggests."""
  del hi
  if out * window > 1_000_000:
    return float(out * window)
  span = (size - 1) * lhs_dil + 1
  n = 0
  for o in range(out):
    for w in range(window):
      pos = o * stride + w * rhs_dil - lo
      n += 0 <= pos < span and pos % lhs_dil == 0
  return float(n)


_FLIP = {"LT": "GT", "LE": "GE", "GT": "LT", "GE": "LE", "NE": "NE"}
_MAX_TRIPS = 1_000_000


class _Sim:
  def __init__(
    self,
    m,
    chip,
    coords,
    rings,
    prefetch,
    kernel_cost=None,
    collectives="ring",
    axis_rings=None,
    fill=None,
  ):
    self.m, self.chip, self.coords = m, chip, coords
    self.fill = fill
    # The fill's parts no op has read from HBM yet (``_fill_credit``).
    self.fill_left: dict[int, float] = {}
    for p, s in fill.parts if fill else ():
      self.fill_left[p] = self.fill_left.get(p, 0.0) + s
    self.axis_rings = axis_rings or {}
    self.collectives = collectives
    self._rings: dict = {}
    self.rings, self.prefetch = rings, prefetch
    self.kernel_cost = kernel_cost
    self.ring_size = max(len(r) for r in rings)
    self.events: list[Event] = []
    self.free = {"dma": 0.0}
    self.link_free: dict[tuple, float] = {}
    self.lanes: list[float] = []
    self.pending: dict[str, _Transfer] = {}
    # Free cross-program prefetches: done name -> end of the copy, until
    # an op reads it (``_stream_end``); ``loose``: one that entered a loop
    # or call, owed by the next op there with FLOPs.
    self.streams: dict[str, float] = {}
    self.free_prefetch: set[str] = set()
    self.stream_of: dict[str, str] = {}  # prefetch start -> its done
    # DMA-track copies: [begin, end, start name, event index] (HBM sharing).
    self.dma_q: list[list] = []
    self.hbm_shared_s = 0.0
    self.loose = 0.0
    self.prefetch_s = 0.0
    self.exposed = 0.0
    self.compute = 0.0
    self.floored = 0.0
    self.twin = 0.0
    self.flops = 0.0
    self.transfers = 0
    self.unmodelled: list[str] = []
    self.flags: list[str] = []
    self.loops: list[tuple[str, int, str]] = []
    self.seq = itertools.count()
    self._index: dict = {}

  def _flag(self, text: str) -> None:
    if text not in self.flags:
      self.flags.append(text)

  def _table(self, comp: str) -> dict[str, Instr]:
    table = self._index.get(comp)
    if table is None:
      table = {i.name: i for i in self.m.computations.get(comp, ())}
      self._index[comp] = table
    return table

  # costs -------------------------------------------------------------------

  def _bytes_of(self, comp: str, names) -> int:
    table = self._table(comp)
    return sum(table[n].nbytes for n in names if n in table)

  def _dot_flops(self, comp: str, ins: Instr) -> tuple[float, str]:
    """FLOPs of one ``dot``/``convolution`` and its lhs element type."""
    table = self._table(comp)
    if len(ins.operands) < 2 or not ins.arrays:
      return 0.0, ""
    lhs, rhs = (table.get(n) for n in ins.operands[:2])
    if lhs is None or rhs is None or not lhs.arrays or not rhs.arrays:
      return 0.0, ""
    ldims, rdims = lhs.arrays[0].dims, rhs.arrays[0].dims
    if ins.opcode == "dot":
      m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attrs)
      k = (
        np.prod([ldims[int(i)] for i in m.group(1).split(",") if i]) if m else 1
      )
    else:
      m = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", ins.attrs)
      if not m or "i" not in m.group(2) or len(m.group(2)) != len(rdims):
        return 0.0, ""
      lab_l, lab_r, lab_o = m.groups()
      k = rdims[lab_r.index("i")]
      odims = ins.arrays[0].dims
      spatial = sorted(c for c in lab_r if c.isdigit())
      win = _window(ins.attrs, len(spatial))
      taps = 1.0
      for n, c in enumerate(spatial):
        out_size = odims[lab_o.index(c)] if c in lab_o else 1
        taps *= _valid_taps(
          ldims[lab_l.index(c)] if c in lab_l else 1,
          rdims[lab_r.index(c)],
          out_size,
          *(w[n] for w in win),
        ) / max(out_size, 1)
      k *= taps
    return 2.0 * ins.arrays[0].num_elements * float(k), lhs.arrays[0].dtype

  def _flops_s(self, ins: Instr) -> float:
    return self._flops(ins)[1]

  def _flops(self, ins: Instr) -> tuple[float, float]:
    """The op's matmul FLOPs (fusions too), and their seconds at peak."""
    total, secs, stack, seen = 0.0, 0.0, [(self._comp, ins)], set()
    while stack:
      comp, i = stack.pop()
      if i.opcode in ("dot", "convolution"):
        flops, dtype = self._dot_flops(comp, i)
        total += flops
        secs += flops / self.chip.peak_flops(dtype)
      if i.opcode in ("fusion", "call", "custom-call"):
        for c in i.called:
          if c not in seen and c in self.m.computations:
            seen.add(c)
            stack.extend((c, j) for j in self.m.computations[c])
    return total, secs

  def _param_read(self, fused: str, k: int, nbytes: int, depth=0) -> int:
    """HBM bytes a fusion reads of its operand ``k``: slices read only
    the slice (through bitcasts, pads and nested fusions), an in-place
    dynamic-update-slice reads nothing, anything else reads it all."""
    instrs = self.m.computations.get(fused, ())
    param = next((i for i in instrs if i.parameter_number == k), None)
    if param is None or param.opcode != "parameter" or depth > 8:
      return nbytes
    return min(nbytes, self._reads(fused, instrs, param.name, nbytes, depth))

  def _reads(self, comp, instrs, name, nbytes, depth) -> int:
    users = [i for i in instrs if name in i.operands]
    if not users:
      return nbytes
    total = 0
    for u in users:
      if u.opcode in ("slice", "dynamic-slice"):
        total += u.nbytes
      elif u.opcode == "dynamic-update-slice" and u.operands[0] == name:
        continue
      elif u.opcode == "bitcast" or (
        u.opcode == "pad" and u.operands[0] == name
      ):
        # A pad adds constants: its readers read no more of the operand
        # than of the pad (XLA's windowed einsum pads the weight, then
        # slices one chunk of it per step).
        total += self._reads(comp, instrs, u.name, nbytes, depth + 1)
      elif u.opcode == "fusion" and u.called:
        k = u.operands.index(name)
        total += self._param_read(u.called[0], k, nbytes, depth + 1)
      else:
        return nbytes
    return total

  def _hbm_bytes(self, comp: str, ins: Instr, in_place=False) -> float:
    """Bytes the op must move to or from HBM (memory space 0).

    ``in_place``: leave out each output aliased to an operand
    (``output_to_operand_aliasing``) and that operand (a kernel writing
    blocks of a buffer in place, whose twin charges the blocks)."""
    table = self._table(comp)
    fused = ins.called[0] if ins.opcode == "fusion" and ins.called else None
    outs, skip = list(ins.arrays), set()
    if in_place and ins.aliasing:
      # Output index ``{}`` (one array) or ``{i}`` (leaf ``i``).
      aliased = {o[0] if o else 0 for o, _, _ in ins.aliasing if len(o) <= 1}
      outs = [lf for i, lf in enumerate(outs) if i not in aliased]
      skip = {k for _, k, _ in ins.aliasing}
    out = sum(lf.nbytes for lf in outs if lf.memory_space == 0)
    if fused:
      root = next(
        (i for i in self.m.computations.get(fused, ()) if i.is_root), None
      )
      if root is not None and root.opcode == "dynamic-update-slice":
        upd = self._table(fused).get(root.operands[1])
        out = min(out, upd.nbytes if upd is not None else out)
    reads = 0
    for k, name in enumerate(ins.operands):
      src = table.get(name)
      if src is None or k in skip:
        continue
      nb = sum(lf.nbytes for lf in src.arrays if lf.memory_space == 0)
      if fused and nb:
        nb = self._param_read(fused, k, nb)
      reads += nb
    return float(out + reads)

  def _floor(self, comp: str, ins: Instr, in_place=False) -> float:
    """The op's own roofline: FLOPs at peak, HBM bytes at HBM bandwidth
    (``in_place`` as :meth:`_hbm_bytes` takes it)."""
    hbm = self._hbm_bytes(comp, ins, in_place)
    return max(self._flops_s(ins), hbm / self.chip.hbm_bytes_per_s)

  def _op_cost(self, comp: str, ins: Instr) -> float:
    cycles = ins.estimated_cycles
    # An estimate XLA marks INVALID is no measure of the op: 1.2 to 4.7
    # times its bytes at HBM bandwidth for a convert, copy or add (6272
    # cycles, 4.2 us, for the chapter's float32 convert of x into VMEM;
    # 1.9 us of bytes), 0.03 of them for a VMEM-to-VMEM copy on v6e. Such
    # an op is charged no more than its bytes (operands and result, all at
    # HBM bandwidth, an upper bound for a memory-bound op wherever they
    # sit) and, like every op, no less than its roofline (below): the same
    # work costs the same whether XLA put its result in VMEM or in HBM,
    # in XLA's programs and in our kernels' twins alike. A few-byte op is
    # scalar bookkeeping, free like every small op.
    small = ins.nbytes < _SMALL_BYTES and not ins.estimate_is_valid
    mosaic = ins.opcode == "custom-call" and ins.target == "tpu_custom_call"
    if mosaic:
      # Never the kernel's own figure: its jnp twin, else the bytes model.
      twin = self._twin_cost(ins)
      if twin is not None:
        return twin
      cycles = None
    if cycles is not None and ins.estimate_is_valid and not small:
      base = cycles / self.chip.clock_hz
    else:
      if ins.opcode == "custom-call" and not ins.name.startswith("asyncops_"):
        self.unmodelled.append(ins.name)
        self._flag(f"{ins.name}: custom call without a cost (bytes model)")
      moved = ins.nbytes + self._bytes_of(comp, ins.operands)
      base = (
        0.0 if ins.nbytes < _SMALL_BYTES else moved / self.chip.hbm_bytes_per_s
      )
      if cycles is not None and not small:
        base = min(base, cycles / self.chip.clock_hz)
    if ins.nbytes < _SMALL_BYTES and not ins.called:
      return base  # scalar bookkeeping: no roofline worth the name
    floor = self._floor(comp, ins)
    if floor > base:
      self.floored += floor - base
      return floor
    return base

  def _twin_cost(self, ins: Instr) -> float | None:
    """A Pallas kernel's cost from its registered jnp twin (or None)."""
    if self.kernel_cost is None:
      return None
    cost = self.kernel_cost(ins, self.m)
    if cost is None:
      return None
    moved = 0.0
    if isinstance(cost, KernelSteps):
      cost, moved = cost.total, cost.hbm_bytes
    # A kernel writing blocks of a buffer it aliases (a row panel's rows
    # of one result, ``input_output_aliases``) moves those blocks, which
    # its twin writes; the rest of the buffer is neither read nor written,
    # so it stays out of the floor (as a dynamic-update-slice fusion's
    # update does, above). A kernel that says what it moves
    # (``KernelSteps.hbm_bytes``) is floored at that.
    if moved > 0:
      floor = max(self._flops_s(ins), moved / self.chip.hbm_bytes_per_s)
    else:
      floor = self._floor(self._comp, ins, in_place=True)
    cost = max(cost, floor)
    self.twin += cost
    return cost

  def _stepped(self, comp: str, ins: Instr, t: float) -> float | None:
    """A kernel charged step by step (:class:`KernelSteps`): each step
    starts when the slots it consumes have arrived (the wait, inside the
    kernel, is exposed communication); None if the kernel is not."""
    mosaic = ins.opcode == "custom-call" and ins.target == "tpu_custom_call"
    if not mosaic or self.kernel_cost is None:
      return None
    steps = self.kernel_cost(ins, self.m)
    if not isinstance(steps, KernelSteps):
      return None
    slots: tuple[float, ...] = ()
    chain = None  # the chained ring this kernel sends (steps.sends)
    for name in self._sources(comp, ins):
      tr = self.pending[name]
      slots = slots or (tr.halves if steps.halves else tr.slots)
      if steps.sends and self.pending[name].step is not None:
        chain = chain or self.pending[name]
    arrived: dict[int, float] = {}
    total = self._twin_cost(ins)  # the floor applies to the whole kernel
    extra = total - steps.total
    costs = list(steps.costs)
    costs[-1] += extra
    nb = max(steps.blocks, 1)
    frac = (nb - 1) / nb if nb > 1 else 1.0
    self.flops += self._flops(ins)[0]
    if steps.fill > 0:  # its pipeline fill, before its first dot
      self._emit("compute", ins.name, "compute", t, steps.fill, op=FILL_OP)
      t += steps.fill
    for i, cost in enumerate(costs):
      if i + 1 < len(costs):
        ready = max(
          (slots[u] for u in steps.needs[i + 1] if u < len(slots)), default=0.0
        )
        # The kernel waits for the next step's chunks before this step's
        # last block: the blocks before it run first.
        head = cost * (1 - steps.tails[i] if steps.tails else frac)
        self._emit("compute", ins.name, "compute", t, head, op=ins.opcode)
        t += head
        if ready > t:
          self._emit("compute", ins.name, "wait", t, ready - t)
          self.exposed += ready - t
          t = ready
        self._emit(
          "compute", ins.name, "compute", t, cost - head, op=ins.opcode
        )
        t += cost - head
      else:
        self._emit("compute", ins.name, "compute", t, cost, op=ins.opcode)
        t += cost
      if chain is not None and i < len(steps.sends) and steps.sends[i] >= 0:
        arrived[steps.sends[i]] = self._send_step(ins, chain, t)
        slots = tuple(arrived[u] for u in sorted(arrived))
    if chain is not None and arrived:
      chain.slots = slots
      chain.end = max(chain.end, *arrived.values())
    self.compute += total
    if ins.name.startswith("ring_allgather_matmul_local") and _RELAYS.search(
      ins.attrs
    ):
      t = self._relay(comp, ins, t)
    return t

  def _send_step(self, ins: Instr, chain: _Transfer, t: float) -> float:
    """One step's transfer of a chained ring, sent at ``t``; its arrival."""
    load, latency, _ = chain.step
    begin, end = self._ici_slot(t, load, latency)
    lane = self._lane(begin, end)
    self._emit(
      "ici", ins.name, "transfer", begin, end - begin, lane, links=dict(load)
    )
    self.transfers += 1
    return end

  def _ici(self, sends, nbytes, scale: float = 1.0):
    """An ICI transfer: ``(bytes per directed link, hop latency)``."""
    load, hops = link_loads(sends, nbytes * scale, self.coords)
    return load, hops * self.chip.ici_hop_s

  def _n(self) -> int:
    return len(self.coords)

  def _collective_load(self, op, groups, operand, out, pairs=(), colors=1):
    """``(link load, latency)`` of one collective over ``groups``.

    ``collectives="ring"`` (default): XLA's TPU emitters run a ring
    (``StrategyRing{colors:1 ...}`` in their backend config): the group's
    devices in a physical cycle, ``n - 1`` steps, each step moving one
    shard to the next device, in ``colors`` directions (each carrying
    ``1 / colors`` of every shard). ``"multicast"``: every shard crosses
    each link towards its destinations at most once (a lower bound, the
    model before calibration).
    """
    if op == "collective-permute":
      sends = {}
      for s, t in pairs:
        sends.setdefault(s, []).append(t)
      return self._ici(sends, operand)
    gsize = max(len(g) for g in groups)
    if gsize <= 1:
      return {}, 0.0
    shard = {
      "all-gather": operand,
      "reduce-scatter": out,
      "all-reduce": operand / gsize,
      "all-to-all": operand / gsize,
    }.get(op, operand)
    steps = {"all-reduce": 2 * (gsize - 1)}.get(op, gsize - 1)
    if self.collectives == "multicast":
      multicast = {s: [d for d in g if d != s] for g in groups for s in g}
      load, lat = self._ici(multicast, shard, 2.0 if op == "all-reduce" else 1)
      return load, (2 * lat if op == "all-reduce" else lat)
    rings = [self._ring_order(g) for g in groups]
    load, hops = {}, 0
    directions = (1, -1)[: max(1, min(colors, 2))]
    for shift in directions:
      part, h = link_loads(
        ring_sends(rings, shift), shard * steps / len(directions), self.coords
      )
      hops = max(hops, h)
      for k, v in part.items():
        load[k] = load.get(k, 0.0) + v
    return load, steps * hops * self.chip.ici_hop_s

  def _ring_order(self, group: list[int]) -> list[int]:
    """The group's devices in a physical cycle when one exists (XLA
    reorders its ring: ``has_reordering_map``), else as given."""
    key = tuple(group)
    if key not in self._rings:
      by = {}
      for d in group:
        by.setdefault(tuple(self.coords[d]), []).append(d)
      order = list(group)
      if all(len(v) == 1 for v in by.values()):
        # The rule auto's estimate of XLA's ring uses too: one place.
        order = [by[c][0] for c in _wiring.xla_order(list(by))]
      self._rings[key] = order
    return self._rings[key]

  def _collective_dur(self, op: str, ins: Instr, comp: str):
    # XLA combines collectives (its all-reduce combiner): every operand of
    # a variadic one moves, not only the first.
    data = ins.operands[:1] if op == "collective-permute" else ins.operands
    operand = self._bytes_of(comp, data) or ins.nbytes
    out = ins.arrays[-1].nbytes if ins.arrays else operand
    if ins.opcode == op and len(ins.arrays) > 1:  # synchronous, variadic
      out = sum(a.nbytes for a in ins.arrays)
    groups = (
      [] if op == "collective-permute" else replica_groups(ins, self._n())
    )
    return self._checked(
      ins,
      op,
      self._collective_load(
        op, groups, operand, out, source_target_pairs(ins), _colors(ins)
      ),
      groups,
    )

  def _checked(self, ins, op, cost, groups):
    """Guard: a collective among several devices never moves for free."""
    load, _ = cost
    many = any(len(g) > 1 for g in groups) or op == "collective-permute"
    if (
      many
      and not load
      and (op != "collective-permute" or source_target_pairs(ins))
    ):
      self._flag(f"{ins.name}: {op} with no link time")
    return cost

  def _inner_collective(self, ins: Instr):
    """``(computation, collective)`` inside a fusion, or None."""
    stack, seen = list(ins.called), set()
    while stack:
      c = stack.pop()
      if c in seen or c not in self.m.computations:
        continue
      seen.add(c)
      for i in self.m.computations[c]:
        base = i.opcode.removesuffix("-start")
        if base in _SYNC_COLLECTIVES:
          return c, i
        stack.extend(i.called)
    return None

  def _fused_collective(self, comp: str, ins: Instr, found, t: float) -> float:
    """A fusion around a collective (e.g. XLA's all-reduce-scatter fusion):
    a synchronous collective on the links, never free compute."""
    inner_comp, inner = found
    op = inner.opcode.removesuffix("-start")
    data = inner.operands[:1] if op == "collective-permute" else inner.operands
    operand = self._bytes_of(inner_comp, data) or inner.nbytes
    groups = (
      [] if op == "collective-permute" else replica_groups(inner, self._n())
    )
    out = ins.nbytes
    if op == "all-reduce" and out < operand:
      op = "reduce-scatter"  # all-reduce then keep this device's slice
    cost = self._checked(
      inner,
      op,
      self._collective_load(
        op, groups, operand, out, source_target_pairs(inner), _colors(ins)
      ),
      groups,
    )
    begin, end = self._ici_slot(t, *cost)
    end = max(end, t + self._hbm_bytes(comp, ins) / self.chip.hbm_bytes_per_s)
    lane = self._lane(begin, end)
    self._emit("ici", ins.name, "collective", begin, end - begin, lane)
    self._emit("compute", ins.name, "wait", t, end - t)
    self.exposed += end - t
    self.transfers += 1
    return end

  def _kernel_dur(self, ins: Instr):
    """``(track, bytes per link or DMA seconds, latency)`` of our kernel.

    Our kernels' peers are not in the HLO. ppermute and bidirectional are
    ring shifts over ``rings`` (the library writes the shift into the op
    name as ``ring_shift+1`` / ``ring_shift-1``; default -1). An all-gather
    multicasts over each ring. A bidirectional kernel whose op name holds
    ``ring_axis_x`` (the 2-D torus all-gather matmul's x transfers) runs
    along the mesh's first axis: over the rings' columns.
    """
    kind = ins.name[len("asyncops_") :].split("_start")[0]
    nbytes = ins.arrays[0].nbytes if ins.arrays else 0
    if kind.endswith("_ref"):  # asyncops.stateful: output = the whole dst Ref
      kind, nbytes = kind[: -len("_ref")], self._ref_message(ins, nbytes)
    if kind == "copy":
      return "dma", nbytes / self.chip.hbm_bytes_per_s, 0.0
    if kind == "bidirectional":
      # Half the destination each way: the source's halves, or (a
      # ``whole=True`` kernel, destination twice the source) all of it.
      if len(ins.arrays) > 1:
        nbytes = ins.arrays[1].nbytes
      rings = self.rings
      if _X_AXIS in ins.attrs:  # along mesh axis x: the rings' columns
        rings = [list(c) for c in zip(*self.rings, strict=True)]
      load, lat = self._ici(ring_sends(rings, 1), nbytes / 2)
      back, lat2 = self._ici(ring_sends(rings, -1), nbytes / 2)
      for k, v in back.items():
        load[k] = load.get(k, 0.0) + v
      return "ici", load, max(lat, lat2)
    if kind == "all_gather":
      multicast = {s: [d for d in r if d != s] for r in self.rings for s in r}
      return "ici", *self._ici(multicast, nbytes)
    if kind.startswith("ring_"):
      return "ici", *self._fused_ring(ins)
    if kind == "all_to_all":  # its source (n, ...): slot p goes to peer p
      n = self.ring_size
      load, lat = {}, 0.0
      for k in range(1, n):
        part, lk = self._ici(ring_sends(self.rings, k), nbytes / n)
        lat = max(lat, lk)
        for key, v in part.items():
          load[key] = load.get(key, 0.0) + v
      return "ici", load, lat
    m = _SHIFT.search(ins.attrs)
    shift = int(m.group(1)) if m else -1
    rings = self.rings
    axis = _RING_AXIS.search(ins.attrs)
    if axis:
      if axis.group(1) not in self.axis_rings:
        raise ValueError(
          f"{ins.name} shifts over mesh axis {axis.group(1)!r}, but the "
          f"model knows the rings of {sorted(self.axis_rings)} only; pass "
          "axis_rings."
        )
      rings = self.axis_rings[axis.group(1)]
    return "ici", *self._ici(ring_sends(rings, shift), nbytes)

  def _fused_ring(self, ins: Instr):
    """A fused ring kernel's start (``asyncops_ring_*_start``).

    Its first output is the receive buffer ``[d, n - 1, ...]``: everything
    this device receives during the whole ring, slot ``t`` of direction
    ``c`` (``+1`` for direction 0 of two, else ``-1``).

    - ``ring_allgather``: direct sends. Every device sends each half
      straight to the ``n - 1`` peers ``shift * (t + 1)`` away (slot
      ``t``), each a separate unicast routed over the grid, so a link
      carries one copy per destination that crosses it; latency: the
      longest path.
    - otherwise (``ring_reducescatter``): a ring. Slot ``t`` arrives one
      hop from the neighbour, each device forwarding what it received, so
      the latency is ``n - 1`` hops; the bytes queue on each directed link.
    """
    recv = ins.arrays[0]
    d = recv.dims[0] if recv.dims else 1
    shifts = (1, -1) if d == 2 else (-1,)
    load: dict[tuple, float] = {}
    latency = 0.0
    if ins.name[len("asyncops_") :].startswith("ring_allgather"):
      n1 = recv.dims[1] if len(recv.dims) > 1 else 1
      slot = recv.nbytes / d / n1
      found = recv_slots(ins.arrays[:1], ins.attrs)
      if found is not None:
        d, n1, slot = found
        shifts = (1, -1) if d == 2 else (-1,)
      for sh in shifts:
        for t in range(1, n1 + 1):
          part, lat = self._ici(ring_sends(self.rings, sh * t), slot)
          for k, v in part.items():
            load[k] = load.get(k, 0.0) + v
          latency = max(latency, lat)
      return load, latency
    for sh in shifts:
      part, lat = self._ici(ring_sends(self.rings, sh), recv.nbytes / d)
      for k, v in part.items():
        load[k] = load.get(k, 0.0) + v
      latency = max(latency, lat)
    return load, latency * max(self.ring_size - 1, 1)

  def _allgather_slots(self, ins: Instr) -> list[tuple]:
    """A fused all-gather start's sends, ``(slot, direction, link load,
    latency, piece)`` in the order it issues them (slot ``t`` of each
    direction, nearest peers first; piece 0); empty for every other
    transfer. A start that splits its last send (``ring_hops_.._split``:
    ``AgSpec.split``) sends it as two pieces of half its bytes, one after
    the other on the same links, each with its own hop latency (pieces
    0 and 1)."""
    if not ins.name.startswith("asyncops_ring_allgather") or not ins.arrays:
      return []
    found = recv_slots(ins.arrays[:1], ins.attrs)
    if found is None:
      return []
    d, n1, size = found
    shifts = (1, -1) if d == 2 else (-1,)
    # The peers' distances, slot by slot (``ring_hops_1-3-2`` in the op
    # name; slot t is t + 1 away when absent).
    found = _HOPS.search(ins.attrs)
    hops = [int(a) for a in found.group(1).split("-")] if found else []
    split = bool(found and found.group(2))
    if sorted(hops) != list(range(1, n1 + 1)):
      hops = list(range(1, n1 + 1))
    # ``_fwd`` (``AgSpec.forward``): the antipode's slot (two hops) is not
    # the start's; the local-step kernel relays it (:meth:`_relay`).
    relayed = hops.index(2) if found and found.group(3) and 2 in hops else -1
    out = []
    for t in range(n1):
      if t == relayed:
        continue
      for dd, sh in enumerate(shifts):
        sends = ring_sends(self.rings, sh * hops[t])
        if split and (t, dd) == (n1 - 1, d - 1):
          for piece in (0, 1):
            load, lat = self._ici(sends, size / 2)
            out.append((t, dd, load, lat, piece))
          continue
        load, lat = self._ici(sends, size)
        out.append((t, dd, load, lat, 0))
    return out

  def _relay(self, comp: str, ins: Instr, t: float) -> float:
    """The fused all-gather's relay (``AgSpec.forward``), at the end of
    the local-step kernel (``ring_allgather_matmul_local`` in a ``_fwd``
    scope): it waits for slot ``0`` of each direction (its start's halves
    ``0 .. d - 1``, an exposed wait on the compute track), is charged its
    DMA issues, a share of ``Chip.issue_s`` as a split start's extra
    piece is (``issue_s`` per the start's sends, ``d (n - 2)`` of them:
    the relay's ``d`` cost ``issue_s / (n - 2)``, half of it on a ring of
    4), then sends each of those halves on to the next neighbour the same
    way, queued on each link behind what is already on it (FIFO): that
    neighbour's slot ``2``, which its start did not send. Their arrivals
    become the start's halves ``2 d + dd`` (and slot 2), so the rest
    kernel waits for them, and the start's end (the done waits for the
    sends)."""
    names = [n for n in self._sources(comp, ins) if n in self.pending]
    tr = self.pending[names[0]] if names else None
    recv = next(
      (a for a in self._operand_arrays(comp, ins) if len(a.dims) == 4), None
    )
    if tr is None or recv is None or not tr.halves:
      self.unmodelled.append(ins.name)
      self._flag(f"{ins.name}: relay without its start (not modelled)")
      return t
    nd, n1 = recv.dims[0], recv.dims[1]
    ready = max(tr.halves[:nd])
    if ready > t:
      self._emit("compute", ins.name, "wait", t, ready - t)
      self.exposed += ready - t
      t = ready
    issue = self.chip.issue_s / max(n1 - 1, 1)
    self._emit("compute", ins.name, "overhead", t, issue, op=RELAY_ISSUE_OP)
    t += issue
    size = recv.nbytes / (nd * n1)
    shifts = (1, -1) if nd == 2 else (-1,)
    halves = list(tr.halves)
    for sh in shifts:
      load, lat = self._ici(ring_sends(self.rings, sh), size)
      b, e = self._ici_slot(t, load, lat)
      lane = self._lane(b, e)
      self._emit(
        "ici",
        ins.name,
        "transfer",
        b,
        e - b,
        lane,
        op="relay",
        links=dict(load),
      )
      self.transfers += 1
      halves.append(e)
    tr.halves = tuple(halves)
    tr.slots = (*tr.slots, max(halves[-nd:]))
    tr.end = max(tr.end, *halves[-nd:])
    return t

  def _operand_arrays(self, comp: str, ins: Instr):
    """The arrays of ``ins``'s operands, in order."""
    table = self._table(comp)
    return [a for n in ins.operands if n in table for a in table[n].arrays]

  def _ref_message(self, ins: Instr, dst_bytes: int) -> float:
    """Bytes one stateful (``*_ref_start``) kernel moves.

    Its operands are the Ref buffers (one when source and destination are
    two slots of one Ref, else source then destination) and the slot
    indices; its output is the whole destination buffer. The op name says
    which the message is (``asyncops.stateful`` labels a start
    ``ref_message_dst_slot`` or ``ref_message_dst_whole``): one slot
    (``dst_bytes / leading dim``) or the whole destination. Unlabelled
    (older HLO): one buffer, one slot; two buffers, the smaller of the two
    (two slots of equal-shape Refs then count whole).
    """
    bufs = ins.operands[:-1]
    slot = _REF_DST_SLOT in ins.attrs or len(bufs) == 1
    if slot and ins.arrays and ins.arrays[0].dims:
      return dst_bytes / ins.arrays[0].dims[0]
    if _REF_DST_WHOLE in ins.attrs:
      return dst_bytes
    src = self._bytes_of(self._comp, bufs[:1]) or dst_bytes
    return min(src, dst_bytes)

  # loops -------------------------------------------------------------------

  def _scalar(self, table: dict, name: str):
    """``("const", v)``, ``("gte", index)`` of the loop state, or None."""
    seen = 0
    while name in table and seen < 16:
      i = table[name]
      if name in self.m.constants:
        return "const", self.m.constants[name]
      if i.opcode == "get-tuple-element":
        src = table.get(i.operands[0])
        if src is not None and src.opcode == "parameter":
          return "gte", i.tuple_index
        return None
      if i.opcode not in ("copy", "bitcast", "convert") or not i.operands:
        return None
      name, seen = i.operands[0], seen + 1
    if name in self.m.constants:
      return "const", self.m.constants[name]
    return None

  def _infer_trips(self, comp: str, ins: Instr) -> int | None:
    """Trip count from the loop condition ``i <cmp> limit``, the initial
    ``i`` in the while operand and the body's ``i + step``."""
    cond = self.m.computations.get(ins.condition or "")
    body = self.m.computations.get(ins.body or "")
    if not cond or not body:
      return None
    ctab, btab = self._table(ins.condition), self._table(ins.body)
    root = next(i for i in cond if i.is_root)
    m = re.search(r"direction=(\w+)", root.attrs)
    if root.opcode != "compare" or not m or m.group(1) not in _CMP:
      return None
    a, b = (self._scalar(ctab, o) for o in root.operands[:2])
    direction = m.group(1)
    if a and b and a[0] == "const" and b[0] == "gte":
      a, b, direction = b, a, _FLIP[direction]
    if not (a and b and a[0] == "gte" and b[0] == "const"):
      return None
    idx, limit = a[1], b[1]
    init_t = self._table(comp).get(ins.operands[0])
    if init_t is None or init_t.opcode != "tuple":
      return None
    init = self._scalar(self._table(comp), init_t.operands[idx])
    broot = next(i for i in body if i.is_root)
    if broot.opcode != "tuple" or init is None or init[0] != "const":
      return None
    upd = btab.get(broot.operands[idx])
    while upd is not None and upd.opcode in ("copy", "bitcast"):
      upd = btab.get(upd.operands[0])
    if upd is None or upd.opcode not in ("add", "subtract"):
      return None
    x, y = (self._scalar(btab, o) for o in upd.operands[:2])
    if upd.opcode == "add" and x and x[0] == "const":
      x, y = y, x
    if not (x == ("gte", idx) and y and y[0] == "const") or y[1] == 0:
      return None
    step = y[1] if upd.opcode == "add" else -y[1]
    i, n = init[1], 0
    while _CMP[direction](i, limit) and n < _MAX_TRIPS:
      i, n = i + step, n + 1
    return n if n < _MAX_TRIPS else None

  def _trips(self, comp: str, ins: Instr) -> int:
    known = ins.backend_config.get("known_trip_count", {}).get("n")
    if known is not None:
      self.loops.append((ins.name, int(known), "known"))
      return int(known)
    n = self._infer_trips(comp, ins)
    if n is None:
      self._flag(f"{ins.name}: while loop of unknown trip count (run once)")
      self.loops.append((ins.name, 1, "unknown"))
      return 1
    self.loops.append((ins.name, n, "inferred"))
    return n

  # walking -----------------------------------------------------------------

  def _emit(self, track, name, kind, start, dur, lane=0, **args):
    if dur > 0:
      self.events.append(Event(track, name, kind, start, dur, lane, args))

  def _ici_slot(self, t: float, load: dict, latency: float):
    """Queues a transfer on each directed link it uses; ``(begin, end)``.

    Each link is a FIFO: its share of the bytes starts when the link is
    free. Transfers on disjoint links (e.g. the two directions of a ring)
    run concurrently; transfers sharing a link queue on it. An on-chip
    "link" (two cores of one chip) moves at HBM bandwidth.
    """
    begin, end = None, t
    for link, nbytes in load.items():
      bw = self.chip.ici_link_bytes_per_s
      if link and link[0] == "chip":
        bw = self.chip.hbm_bytes_per_s
      b = max(t, self.link_free.get(link, 0.0))
      self.link_free[link] = b + nbytes / bw
      begin = b if begin is None else min(begin, b)
      end = max(end, b + nbytes / bw)
    begin = t if begin is None else begin
    return begin, end + latency

  def _lane(self, begin: float, end: float) -> int:
    for i, free in enumerate(self.lanes):
      if free <= begin + 1e-12:
        self.lanes[i] = end
        return i
    self.lanes.append(end)
    return len(self.lanes) - 1

  def _launch(self, ins, track, cost, t, family, charge=True) -> float:
    """Issues a transfer; ``cost`` is seconds (DMA) or ``(load, latency)``.

    One ``Chip.issue_s`` per async op, which a fused all-gather start's
    sends share; a start that splits a send (``AgSpec.split``) is charged
    each extra piece's share on top, ``issue_s / sends`` (``sends``: its
    sends before the split, ``d (n - 1)``; 1/6 of ``issue_s`` on a ring of
    4 with two directions), in its own box after the issue."""
    parts = []
    if track == "ici" and ins.opcode == "custom-call":
      parts = self._allgather_slots(ins)
    if charge:
      self._emit("compute", ins.name, "overhead", t, self.chip.issue_s)
      t += self.chip.issue_s
      extra = sum(1 for p in parts if p[4] > 0)
      if extra:
        share = self.chip.issue_s * extra / (len(parts) - extra)
        self._emit("compute", ins.name, "overhead", t, share, op=SPLIT_ISSUE_OP)
        t += share
    args = {"op": ins.opcode}
    slots: tuple[float, ...] = ()
    halves: tuple[float, ...] = ()
    step = self._chain_step(ins, track, cost)
    if step is not None:  # sends nothing: its steps kernel sends each step
      key = f"{ins.name}#{next(self.seq)}"
      self.pending[ins.name] = _Transfer(key, family, t, t, (), step)
      return t
    if track == "ici":
      if parts:  # slot by slot, in the order the start sends them
        ends: dict[int, float] = {}
        half: dict[tuple[int, int], float] = {}
        begin, end = None, t
        n1 = 1 + max(p[0] for p in parts)
        for slot, dd, load, lat, piece in parts:
          b, e = self._ici_slot(t, load, lat)
          ends[slot] = max(ends.get(slot, 0.0), e)
          # A split half's second piece after every half (``t d + d``
          # order): index ``(n - 1) d`` of ``halves``.
          half[(n1, 0) if piece else (slot, dd)] = e
          begin = b if begin is None else min(begin, b)
          end = max(end, e)
        slots = tuple(ends[i] for i in sorted(ends))
        halves = tuple(half[i] for i in sorted(half))
      else:
        begin, end = self._ici_slot(t, *cost)
      lane = self._lane(begin, end)
      args["links"] = dict(cost[0])
    else:
      begin = max(t, self.free[track])
      end = begin + cost
      self.free[track] = end
      lane = 0
    self._emit(
      track,
      ins.name,
      "transfer" if track == "ici" else "dma",
      begin,
      end - begin,
      lane,
      **args,
    )
    key = f"{ins.name}#{next(self.seq)}"
    self.pending[ins.name] = _Transfer(
      key, family, begin, end, slots, halves=halves
    )
    if track == "dma" and end > begin:
      self.dma_q.append([begin, end, ins.name, len(self.events) - 1])
    self.transfers += 1
    return t

  def _chain_step(self, ins: Instr, track: str, cost):
    """``(link load, latency, steps)`` of one step of a chained ring's
    start (the fused reduce-scatter's: a barrier; its steps kernel sends
    each step's partial sums once they exist), or None for every other
    transfer, or when no kernel cost can send them (the start then
    charges the whole ring, as it did)."""
    if (
      track != "ici"
      or self.kernel_cost is None
      or ins.opcode != "custom-call"
      or not ins.name.startswith("asyncops_ring_reducescatter_start")
      or not ins.arrays
      or len(ins.arrays[0].dims) != 4
    ):
      return None
    load, latency = cost
    n1 = max(ins.arrays[0].dims[1], 1)
    per = {k: v / n1 for k, v in load.items()}
    return per, latency / max(self.ring_size - 1, 1), n1

  def _end(self, name: str) -> float:
    """When the pending transfer ``name`` ends (and drops it). A chained
    ring whose steps kernel sent nothing (not charged step by step) is
    charged whole from its start, as a start that sends it would be."""
    tr = self.pending.pop(name)
    if tr.step is not None and not tr.slots:
      load, latency, n1 = tr.step
      whole = {k: v * n1 for k, v in load.items()}
      begin, end = self._ici_slot(tr.start, whole, latency * n1)
      lane = self._lane(begin, end)
      self._emit("ici", name, "transfer", begin, end - begin, lane, links=whole)
      self.transfers += 1
      return end
    return tr.end

  def _sources(self, comp: str, ins: Instr, among=None) -> list[str]:
    """Names in ``among`` (default: the pending transfers) that ``ins``
    reads, through buffer-relabelling ops (``_PASS``)."""
    among = self.pending if among is None else among
    table = self._table(comp)
    found, stack, seen = [], list(ins.operands), set()
    while stack:
      n = stack.pop()
      if n in seen:
        continue
      seen.add(n)
      if n in among:
        found.append(n)
        continue
      src = table.get(n)
      if src is not None and src.opcode in _PASS:
        stack.extend(src.operands)
    return found

  def _wait(self, comp, ins, t, family) -> float:
    names = self._sources(comp, ins)
    if not names:  # crossed a loop/call boundary: oldest of the family.
      same = [k for k, v in self.pending.items() if v.family == family]
      names = same[:1]
    end = max((self._end(n) for n in names), default=t)
    if end > t:
      self._emit("compute", ins.name, "wait", t, end - t)
      self.exposed += end - t
      t = end
    self._emit(
      "compute", ins.name, "overhead", t, self.chip.done_s, awaits=names
    )
    return t + self.chip.done_s

  def _compute(self, comp: str, ins: Instr, t: float) -> float:
    stepped = self._stepped(comp, ins, t)
    if stepped is not None:
      self._share_hbm(comp, ins, t, stepped - t, in_place=True)
      more = self._stream_end(comp, ins, t, stepped - t, 1.0) - (stepped - t)
      self._emit("compute", ins.name, "compute", stepped, more, op=ins.opcode)
      self.compute += max(more, 0.0)
      return stepped + max(more, 0.0)
    cost = self._op_cost(comp, ins)
    cost -= self._fill_credit(comp, ins, cost)
    flops = self._flops(ins)[0]
    hbm = self._share_hbm(comp, ins, t, cost)
    cost = self._stream_end(comp, ins, t, cost, flops)
    self.flops += flops
    self._emit(
      "compute",
      ins.name,
      "compute",
      t,
      cost,
      op=ins.opcode,
      flops=flops,
      hbm=hbm,
    )
    self.compute += cost
    return t + cost

  def _fill_credit(self, comp: str, ins: Instr, cost: float) -> float:
    """What a twin's op bound by its bytes need not charge again: the
    parts of the kernel's fill (``Fill.parts``) it reads from HBM itself
    (an entry parameter, through bitcasts), which the fill has moved
    before it; never below the rest of its bytes or its FLOPs."""
    if not self.fill_left or comp != self.m.entry:
      return 0.0
    table = self._table(comp)
    params, stack = set(), list(ins.operands)
    while stack:
      src = table.get(stack.pop())
      if src is None:
        continue
      if src.opcode == "parameter":
        params.add(src.parameter_number)
      elif src.opcode == "bitcast":
        stack.extend(src.operands)
    got = sum(self.fill_left.pop(p) for p in params if p in self.fill_left)
    hbm = self._hbm_bytes(comp, ins) / self.chip.hbm_bytes_per_s
    flops = self._flops_s(ins)
    if got <= 0 or hbm < flops:
      return 0.0
    return max(0.0, min(got, cost - max(flops, hbm - got)))

  def _share_hbm(self, comp, ins, t, dur, in_place=False) -> float:
    """HBM is one resource: a copy on the DMA track (``copy-start``,
    ``slice-start``, a prefetch, our copy kernel) in flight while an op
    reads or writes HBM gets only what the op leaves of the bandwidth.
    The op, whose charge already covers its own HBM bytes, keeps its
    time; the copies still running during it end later by the op's HBM
    time in proportion to their overlap (``dur`` the op's time, ``t`` its
    start), so a consumer waiting for such a copy's done waits longer:
    two readers of HBM never each move at its full bandwidth at once.
    Returns the op's HBM bytes."""
    nbytes = self._hbm_bytes(comp, ins, in_place)
    if dur <= 0 or not self.dma_q or self.free["dma"] <= t:
      return nbytes
    busy = sum(
      max(0.0, min(e, t + dur) - max(b, t)) for b, e, _, _ in self.dma_q
    )
    hbm = nbytes / self.chip.hbm_bytes_per_s
    delta = min(hbm, dur) * busy / dur
    if delta <= 0:
      return nbytes
    self.hbm_shared_s += delta
    self.free["dma"] += delta
    for q in self.dma_q:
      b, e, name, k = q
      if e <= t:
        continue
      if b > t:
        q[0] = b + delta
      q[1] = e + delta
      if name in self.pending:
        self.pending[name].end = q[1]
      done = self.stream_of.get(name)
      if done in self.streams:
        self.streams[done] = max(self.streams[done], q[1])
      ev = self.events[k]
      self.events[k] = dataclasses.replace(ev, start=q[0], dur=q[1] - q[0])
    if self.loose > t:
      self.loose += delta
    self.dma_q = [q for q in self.dma_q if q[1] > t]
    return nbytes

  def _stream_end(self, comp, ins, t, cost, flops) -> float:
    """``cost`` of an op that reads a free cross-program prefetch's
    result: at least until that copy ends. Free, the prefetch never blocks
    the op's start (XLA may issue it before the step), but its bytes cross
    HBM in the step all the same, so the op reading them (a dot's weight
    moved into VMEM) cannot finish before they have: the time is the
    op's, as if it read the weight from HBM itself, and never below its
    weight read. Charged, the op's start already waits for the copy's
    done (``run``), so nothing is added here."""
    ends = [self.streams.pop(n) for n in self._sources(comp, ins, self.streams)]
    if flops > 0 and self.loose:  # the prefetch entered this loop or call
      ends.append(self.loose)
      self.loose = 0.0
    extra = max(ends, default=0.0) - (t + cost)
    if extra <= 0:
      return cost
    self.prefetch_s += extra
    self.floored += extra
    return cost + extra

  def _prefetch_read(self, comp: str, ins: Instr) -> tuple[str, int | None]:
    """How the kernel a twin stands for reads what the cross-program
    prefetch ``ins`` copies (:class:`Fill`), and the twin's parameter it
    copies: ``"whole"`` (in its fill), ``"streamed"`` (free) or
    ``"charged"`` (waited for); ``"streamed"`` when no ``fill`` is given
    (XLA's own programs: every prefetch free)."""
    if self.fill is None:
      return "streamed", None
    table = self._table(comp)
    src = table.get(ins.operands[0]) if ins.operands else None
    while src is not None and src.opcode in ("bitcast", "copy"):
      src = table.get(src.operands[0]) if src.operands else None
    if src is None or src.opcode != "parameter":
      return "charged", None
    k = src.parameter_number
    if k in self.fill.whole:
      return "whole", k
    return ("streamed" if k in self.fill.streamed else "charged"), k

  def run(self, comp: str, t: float) -> float:
    for ins in self.m.computations[comp]:
      self._comp = comp
      op = ins.opcode
      if op in _FREE:
        continue
      if op in ("while", "call", "conditional"):
        for n in self._sources(comp, ins, self.streams):
          self.loose = max(self.loose, self.streams.pop(n))
      if op == "while":
        for _ in range(self._trips(comp, ins)):
          t = self.run(ins.body, t)
        continue
      if op == "call":
        for c in ins.called:
          t = self.run(c, t)
        continue
      if op == "conditional":
        ends = [self.run(c, t) for c in ins.called]
        t = max(ends, default=t)
        continue
      if ins.name.startswith("asyncops_") and op == "custom-call":
        twin = self._twin_cost(ins)
        if twin is not None:  # a kernel that also computes
          self._share_hbm(comp, ins, t, twin, in_place=True)
          twin = self._stream_end(comp, ins, t, twin, 1.0)
          self.flops += self._flops(ins)[0]
          self._emit("compute", ins.name, "compute", t, twin)
          self.compute += twin
          t += twin
        if "_start" in ins.name:
          track, *cost = self._kernel_dur(ins)
          family = ins.name.split("_start")[0]
          cost = cost[0] if track == "dma" else tuple(cost)
          t = self._launch(ins, track, cost, t, family)
        elif "_done" in ins.name or "_recv" in ins.name or "_send" in ins.name:
          family = ins.name.split("_done")[0].split("_recv")[0]
          family = family.split("_send")[0]
          t = self._wait(comp, ins, t, family)
        continue
      base = op[: -len("-start")] if op.endswith("-start") else ""
      if base and base != "async" and base not in _SYNC_COLLECTIVES:
        # copy-start, slice-start, ...: a local DMA (HBM <-> VMEM).
        sizes = [a.nbytes for a in ins.arrays if a.nbytes > 64]
        dur = min(sizes, default=0) / self.chip.hbm_bytes_per_s
        at = t
        if "cross_program_prefetch" in ins.attrs and self.prefetch == "free":
          read, k = self._prefetch_read(comp, ins)
          if read == "whole":  # the kernel's fill has read it
            dur = 0.0
          elif read == "streamed":
            self.free_prefetch.add(ins.name)  # its done does not block
            # Its first block is the end of the fill: the same bytes.
            at -= dict(self.fill.first if self.fill else ()).get(k, 0.0)
        self._launch(ins, "dma", dur, at, "dma", charge=False)
        continue
      if base:
        if base == "async":
          inner = [
            i.opcode
            for c in ins.called
            for i in self.m.computations.get(c, [])
            if i.opcode in _SYNC_COLLECTIVES
          ]
          base = inner[0] if inner else "all-gather"
        dur = self._collective_dur(base, ins, comp)
        t = self._launch(ins, "ici", dur, t, op)
        continue
      if op.endswith("-done"):
        family = op.replace("-done", "-start")
        if family[: -len("-start")] not in _SYNC_COLLECTIVES | {"async"}:
          names = self._sources(comp, ins)
          end = t
          for n in names:
            done = self.pending.pop(n).end
            if n in self.free_prefetch:  # owed by its reader, not waited
              self.streams[ins.name] = max(self.streams.get(ins.name, 0), done)
              self.stream_of[n] = ins.name
            else:
              end = max(end, done)
          if end > t:
            self._emit("compute", ins.name, "wait", t, end - t)
            t = end
          continue
        t = self._wait(comp, ins, t, family)
        continue
      if op in _SYNC_COLLECTIVES:
        load, latency = self._collective_dur(op, ins, comp)
        begin, end = self._ici_slot(t, load, latency)
        lane = self._lane(begin, end)
        self._emit(
          "ici",
          ins.name,
          "collective",
          begin,
          end - begin,
          lane,
          op=op,
          links=dict(load),
        )
        self._emit("compute", ins.name, "wait", t, end - t)
        self.exposed += end - t
        self.transfers += 1
        t = end
        continue
      if op == "custom-call" and ins.target in _FREE_TARGETS:
        continue
      if op == "fusion":
        found = self._inner_collective(ins)
        if found is not None:
          t = self._fused_collective(comp, ins, found, t)
          continue
      t = self._compute(comp, ins, t)
    return t


def simulate(
  module: Module,
  chip: Chip,
  *,
  coords: Sequence[Sequence[int]] | None = None,
  ring_size: int | None = None,
  rings: Sequence[Sequence[int]] | None = None,
  prefetch: Literal["free", "charged"] = "free",
  kernel_cost: KernelCost | None = None,
  collectives: Literal["ring", "multicast"] = "ring",
  axis_rings: dict[str, Sequence[Sequence[int]]] | None = None,
  fill: Fill | None = None,
) -> Timeline:
  """Simulates one device's step of a scheduled TPU HLO module.

  Args:
    module: from :func:`benchmarks._hlo.parse`.
    chip: the generation's figures.
    coords: grid coordinates per partition id (``mesh.devices.flat[i].
      coords``); default: a line of 8.
    ring_size: devices on the ring our kernels shift over, when ``rings``
      is not given: consecutive partition ids form rings of this size
      (default: ``len(coords)``).
    rings: the partition ids of each ring, in ring order (the mesh axis
      our kernels run over), e.g. ``[[0, 1, 2, 3], [4, 5, 6, 7]]``.
    prefetch: XLA's cross-program prefetch, a copy on the DMA track from
      time 0 either way: ``"charged"``, its consumer waits for its done
      (XLA's schedule); ``"free"``, nothing waits for it (XLA may issue it
      before the step), but the op reading its result ends no earlier
      than the copy (its bytes cross HBM in the step).
    kernel_cost: seconds for a Pallas kernel from its jnp twin (see
      :mod:`benchmarks._kernel_costs`), or None when it has none.
    collectives: how XLA's all-gather, reduce-scatter and all-reduce use
      the links: ``"ring"`` (its emitters' ring, ``n - 1`` steps; the
      calibrated default) or ``"multicast"`` (each shard crosses a link at
      most once; a lower bound).
    axis_rings: the rings along each mesh axis by name, for a ppermute
      kernel whose op name says ``ring_axis_<name>`` (one over another axis
      than ``rings``'); such a kernel with an unknown axis is an error.
    fill: ``module`` is a Pallas kernel's jnp twin (see
      :mod:`benchmarks._kernel_costs`): its pipeline fill runs first, and
      only the prefetches of the parameters the kernel streams are free
      (``prefetch="free"``); see :class:`Fill`. None: XLA's own program.

  Returns:
    The :class:`Timeline`.

  Raises:
    ValueError: ``prefetch`` is not one of the two choices, or a
      collective's replica groups cannot be read.

  Example:
    >>> tl = simulate(_hlo.parse(text), CHIPS["v5e"])  # doctest: +SKIP
    >>> tl.step_s, tl.exposed_comm_s  # doctest: +SKIP
  """
  if prefetch not in ("free", "charged"):
    raise ValueError(f"prefetch must be 'free' or 'charged', got {prefetch!r}")
  coords = [tuple(c) for c in (coords or [(i,) for i in range(8)])]
  if rings is None:
    size = ring_size or len(coords)
    rings = [
      list(range(i, i + size)) for i in range(0, len(coords) - size + 1, size)
    ]
  if collectives not in ("ring", "multicast"):
    raise ValueError(
      f"collectives must be 'ring' or 'multicast', got {collectives!r}"
    )
  sim = _Sim(
    module,
    chip,
    coords,
    [list(r) for r in rings],
    prefetch,
    kernel_cost,
    collectives,
    {k: [list(r) for r in v] for k, v in (axis_rings or {}).items()},
    fill,
  )
  t0 = 0.0
  if fill is not None and fill.seconds > 0:
    # The kernel's first dot waits for its fill; the twin's copies (on the
    # DMA track, issued from t0) wait for it too.
    sim._emit("compute", FILL_NAME, "compute", 0.0, fill.seconds, op=FILL_OP)
    sim.compute += fill.seconds
    t0 = fill.seconds
  step = sim.run(module.entry, t0)
  # A free prefetch nobody read (or that entered a loop without a dot)
  # still crosses HBM in the step.
  owed = max([*sim.streams.values(), sim.loose], default=0.0)
  if owed > step:
    sim.prefetch_s += owed - step
    step = owed
  return Timeline(
    sim.events,
    step,
    sim.exposed,
    sim.compute,
    sim.transfers,
    sim.unmodelled,
    flags=sim.flags,
    floored_s=sim.floored,
    twin_s=sim.twin,
    prefetch_s=sim.prefetch_s,
    hbm_shared_s=sim.hbm_shared_s,
    flops=sim.flops,
    loops=sim.loops,
  )
