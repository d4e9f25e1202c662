"""A TPU timeline model driven by XLA's own schedule and cost estimates.

Algorithm. One device runs the entry computation of the scheduled HLO
(SPMD: every device runs the same program, so one simulated device is the
step). Instructions execute in text order on a single compute track; each
costs its ``estimated_cycles`` (XLA's per-op cost model, in
``backend_config``) divided by the chip clock. Ops without an estimate cost
``(operand + result bytes) / HBM bandwidth`` if they move at least 64 KiB,
else nothing (scalar bookkeeping); so do ops writing HBM, or under 64 KiB,
whose estimate XLA marks ``COST_MODEL_TYPE_INVALID``; custom calls without
an estimate (Mosaic kernels other than our start/done) are counted in
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
``slice-start/done`` (HBM <-> VMEM) run on one DMA track at HBM bandwidth;
a cross-program prefetch is free by default (XLA issues it before the
step), or charged from time 0.

While loops run their body ``known_trip_count`` times (from
``backend_config``); conditionals run their longest branch.

Limits: our kernels' peers are not in the HLO. A ppermute kernel is a ring
shift over ``rings`` (the mesh axis' devices in ring order); the library
writes the shift into the op name (``ring_shift+1``), default ``-1``. A
bidirectional kernel sends half its bytes each way. Link sharing is FIFO
per link, not fair sharing, so two transfers on one link finish one after
the other (same last end).
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Sequence
from typing import Literal

import numpy as np

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
  """

  events: list[Event]
  step_s: float
  exposed_comm_s: float
  compute_s: float
  transfers: int
  unmodelled: list[str]


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


def replica_groups(ins: Instr, n: int) -> list[list[int]]:
  """The device groups of a collective (all devices when absent/empty)."""
  text = ins.attr("replica_groups")
  if not text or text in ("{}", "{{}}"):
    return [list(range(n))]
  if text.startswith("["):
    return _iota_groups(ins.attrs[ins.attrs.find("replica_groups=") + 15 :])
  return [
    [int(x) for x in g.split(",") if x.strip()]
    for g in re.findall(r"\{([\d,\s]*)\}", text)
  ]


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


_SHIFT = re.compile(r"ring_shift([+-]\d+)")


@dataclasses.dataclass
class _Transfer:
  key: str
  family: str
  start: float
  end: float


class _Sim:
  def __init__(self, m, chip, coords, rings, prefetch):
    self.m, self.chip, self.coords = m, chip, coords
    self.rings, self.prefetch = rings, prefetch
    self.ring_size = max(len(r) for r in rings)
    self.events: list[Event] = []
    self.free = {"dma": 0.0}
    self.link_free: dict[tuple, float] = {}
    self.lanes: list[float] = []
    self.pending: dict[str, _Transfer] = {}
    self.exposed = 0.0
    self.compute = 0.0
    self.transfers = 0
    self.unmodelled: list[str] = []
    self.seq = itertools.count()

  # costs -------------------------------------------------------------------

  def _bytes_of(self, comp: str, names: list[str]) -> int:
    table = self._index.setdefault(
      comp, {i.name: i for i in self.m.computations[comp]}
    )
    return sum(table[n].nbytes for n in names if n in table)

  _index: dict = {}

  def _op_cost(self, comp: str, ins: Instr) -> float:
    cycles = ins.estimated_cycles
    in_vmem = any(a.memory_space == 1 for a in ins.arrays)
    # An INVALID estimate on a few-byte op is a fixed 1824 cycles on v5e
    # (s32[2] iota or broadcast: a stateful kernel's slot indices); such
    # ops are scalar bookkeeping, free like every small op.
    small = ins.nbytes < _SMALL_BYTES and not ins.estimate_is_valid
    if cycles is not None and (ins.estimate_is_valid or in_vmem) and not small:
      return cycles / self.chip.clock_hz
    if ins.opcode == "custom-call" and not ins.name.startswith("asyncops_"):
      self.unmodelled.append(ins.name)
    moved = ins.nbytes + self._bytes_of(comp, ins.operands)
    if ins.nbytes < _SMALL_BYTES:
      return 0.0
    return moved / self.chip.hbm_bytes_per_s

  def _ici(self, sends, nbytes, scale: float = 1.0):
    """An ICI transfer: ``(bytes per directed link, hop latency)``."""
    load, hops = link_loads(sends, nbytes * scale, self.coords)
    return load, hops * self.chip.ici_hop_s

  def _n(self) -> int:
    return len(self.coords)

  def _collective_dur(self, op: str, ins: Instr, comp: str):
    n = self._n()
    arrays = ins.arrays
    operand = self._bytes_of(comp, ins.operands[:1]) or ins.nbytes
    if op == "collective-permute":
      sends = {}
      for s, t in source_target_pairs(ins):
        sends.setdefault(s, []).append(t)
      return self._ici(sends, operand)
    groups = replica_groups(ins, n)
    gsize = max(len(g) for g in groups)
    multicast = {s: [d for d in g if d != s] for g in groups for s in g}
    if op == "all-gather":
      return self._ici(multicast, operand)
    out = arrays[-1].nbytes if arrays else operand
    if op == "reduce-scatter":
      return self._ici(multicast, out)
    if op == "all-reduce":
      load, lat = self._ici(multicast, operand / gsize, 2.0)
      return load, 2 * lat
    if op == "all-to-all":
      return self._ici(multicast, operand / gsize, gsize - 1.0)
    return self._ici(multicast, operand)

  def _kernel_dur(self, ins: Instr):
    """``(track, bytes per link or DMA seconds, latency)`` of our kernel.

    Our kernels' peers are not in the HLO. ppermute and bidirectional are
    ring shifts over ``rings`` (the library writes the shift into the op
    name as ``ring_shift+1`` / ``ring_shift-1``; default -1). An all-gather
    multicasts over each ring.
    """
    kind = ins.name[len("asyncops_") :].split("_start")[0]
    nbytes = ins.arrays[0].nbytes if ins.arrays else 0
    if kind.endswith("_ref"):  # asyncops.stateful: output = the whole dst Ref
      kind, nbytes = kind[: -len("_ref")], self._ref_message(ins, nbytes)
    if kind == "copy":
      return "dma", nbytes / self.chip.hbm_bytes_per_s, 0.0
    if kind == "bidirectional":
      load, lat = self._ici(ring_sends(self.rings, 1), nbytes / 2)
      back, lat2 = self._ici(ring_sends(self.rings, -1), nbytes / 2)
      for k, v in back.items():
        load[k] = load.get(k, 0.0) + v
      return "ici", load, max(lat, lat2)
    if kind == "all_gather":
      multicast = {s: [d for d in r if d != s] for r in self.rings for s in r}
      return "ici", *self._ici(multicast, nbytes)
    m = _SHIFT.search(ins.attrs)
    shift = int(m.group(1)) if m else -1
    return "ici", *self._ici(ring_sends(self.rings, shift), nbytes)

  def _ref_message(self, ins: Instr, dst_bytes: int) -> float:
    """Bytes one stateful (``*_ref_start``) kernel moves.

    Its operands are the Ref buffers (one when source and destination are
    two slots of one Ref, else source then destination) and the slot
    indices; its output is the whole destination buffer. One buffer: the
    message is one slot (``dst_bytes / leading dim``). Two buffers: the
    smaller of the two (a slot of one and the whole other); two slots of
    equal-shape Refs are counted whole (not distinguishable here).
    """
    bufs = ins.operands[:-1]
    if len(bufs) == 1 and ins.arrays and ins.arrays[0].dims:
      return dst_bytes / ins.arrays[0].dims[0]
    src = self._bytes_of(self._comp, bufs[:1]) or dst_bytes
    return min(src, dst_bytes)

  # walking -----------------------------------------------------------------

  def _emit(self, track, name, kind, start, dur, lane=0, **args):
    if dur > 0:
      self.events.append(Event(track, name, kind, start, dur, lane, args))

  def _ici_slot(self, t: float, load: dict, latency: float):
    """Queues a transfer on each directed link it uses; ``(begin, end)``.

    Each link is a FIFO: its share of the bytes starts when the link is
    free. Transfers on disjoint links (e.g. the two directions of a ring)
    run concurrently; transfers sharing a link queue on it.
    """
    bw = self.chip.ici_link_bytes_per_s
    begin, end = None, t
    for link, nbytes in load.items():
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
    """Issues a transfer; ``cost`` is seconds (DMA) or ``(load, latency)``."""
    if charge:
      self._emit("compute", ins.name, "overhead", t, self.chip.issue_s)
      t += self.chip.issue_s
    args = {"op": ins.opcode}
    if track == "ici":
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
    self.pending[ins.name] = _Transfer(key, family, begin, end)
    self.transfers += 1
    return t

  def _sources(self, comp: str, ins: Instr) -> list[str]:
    table = self._index.setdefault(
      comp, {i.name: i for i in self.m.computations[comp]}
    )
    found, stack, seen = [], list(ins.operands), set()
    while stack:
      n = stack.pop()
      if n in seen:
        continue
      seen.add(n)
      if n in self.pending:
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
    end = max((self.pending.pop(n).end for n in names), default=t)
    if end > t:
      self._emit("compute", ins.name, "wait", t, end - t)
      self.exposed += end - t
      t = end
    self._emit(
      "compute", ins.name, "overhead", t, self.chip.done_s, awaits=names
    )
    return t + self.chip.done_s

  def run(self, comp: str, t: float) -> float:
    for ins in self.m.computations[comp]:
      self._comp = comp
      op = ins.opcode
      if op in _FREE:
        continue
      if op == "while":
        cfg = ins.backend_config.get("known_trip_count", {})
        trips = int(cfg.get("n", 1))
        body = re.search(r"body=%?([\w.\-]+)", ins.attrs).group(1)
        for _ in range(trips):
          t = self.run(body, t)
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
        if "_start" in ins.name:
          track, *cost = self._kernel_dur(ins)
          family = ins.name.split("_start")[0]
          cost = cost[0] if track == "dma" else tuple(cost)
          t = self._launch(ins, track, cost, t, family)
        else:
          family = ins.name.split("_done")[0].split("_recv")[0]
          family = family.split("_send")[0]
          t = self._wait(comp, ins, t, family)
        continue
      base = op[: -len("-start")] if op.endswith("-start") else ""
      if base and base != "async" and base not in _SYNC_COLLECTIVES:
        # copy-start, slice-start, ...: a local DMA (HBM <-> VMEM).
        sizes = [a.nbytes for a in ins.arrays if a.nbytes > 64]
        dur = min(sizes, default=0) / self.chip.hbm_bytes_per_s
        if "cross_program_prefetch" in ins.attrs and self.prefetch == "free":
          dur = 0.0
        t = self._launch(ins, "dma", dur, t, "dma", charge=False)
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
          end = max((self.pending.pop(n).end for n in names), default=t)
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
      target = ins.attr("custom_call_target") or ""
      if op == "custom-call" and target.strip('"') in _FREE_TARGETS:
        continue
      cost = self._op_cost(comp, ins)
      self._emit("compute", ins.name, "compute", t, cost, op=op)
      self.compute += cost
      t += cost
    return t


def simulate(
  module: Module,
  chip: Chip,
  *,
  coords: Sequence[Sequence[int]] | None = None,
  ring_size: int | None = None,
  rings: Sequence[Sequence[int]] | None = None,
  prefetch: Literal["free", "charged"] = "free",
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
    prefetch: whether XLA's cross-program prefetch is ``"free"`` (issued
      before the step) or ``"charged"`` from time 0.

  Returns:
    The :class:`Timeline`.

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
  sim = _Sim(module, chip, coords, [list(r) for r in rings], prefetch)
  sim._index = {}
  step = sim.run(module.entry, 0.0)
  return Timeline(
    sim.events, step, sim.exposed, sim.compute, sim.transfers, sim.unmodelled
  )
