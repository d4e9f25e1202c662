"""Writes a :class:`~benchmarks._timeline.Timeline` as pictures.

* a Chrome/Perfetto trace (``traceEvents`` JSON; open it in
  ui.perfetto.dev): one row for the TensorCore (compute, waits, start/done
  overheads), one row per ICI link and direction that a transfer uses
  (``ICI 0,0,0 -> 1,0,0``), one for local DMAs; flow arrows from each start
  to the done that waits for it; per-slice args (bytes, modelled time, HLO
  op);
* a PNG: the same rows as a matplotlib figure (labelled axes, legend, one
  lane per link), 2000 px wide.

What it reads from the timeline: ``Event.track/name/kind/start/dur/lane``
and, when the model provides them, ``Event.args``: ``"op"``, ``"links"``
(``{(from_coords, to_coords): bytes}``) and ``"awaits"`` (the start names
a done waits on). Without ``links`` an ICI transfer goes on one row per
lane; without ``awaits`` there are no arrows.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

from benchmarks._timeline import Event, Timeline

COLORS = {
  "compute": "#4c72b0",
  "wait": "#c44e52",
  "overhead": "#8c8c8c",
  "transfer": "#55a868",
  "collective": "#dd8452",
  "dma": "#8172b3",
}
LABELS = {
  "compute": "compute (XLA's estimated cycles)",
  "wait": "blocked in a done / collective",
  "overhead": "start/done kernel launch",
  "transfer": "async transfer (start -> done) on an ICI link",
  "collective": "XLA collective on an ICI link",
  "dma": "local DMA (HBM <-> VMEM)",
}


def _coords(c: Any) -> str:
  return ",".join(str(v) for v in c) if isinstance(c, (tuple, list)) else str(c)


def _link_name(link: Any) -> str:
  a, b = link
  return f"ICI {_coords(a)} -> {_coords(b)}"


def _args(e: Event) -> dict:
  return getattr(e, "args", None) or {}


def rows(tl: Timeline) -> list[str]:
  """Row names, top to bottom: compute, each ICI link, DMA."""
  links: set = set()
  lanes: set = set()
  for e in tl.events:
    if e.track != "ici":
      continue
    if _args(e).get("links"):
      links.update(_args(e)["links"])
    else:
      lanes.add(e.lane)
  out = ["compute"]
  out += [_link_name(lk) for lk in sorted(links)]
  out += [f"ICI lane {k}" for k in sorted(lanes)]
  if any(e.track == "dma" for e in tl.events):
    out.append("DMA")
  return out


def slices(tl: Timeline) -> list[tuple[str, Event, dict]]:
  """``(row, event, details)`` for every box: ICI transfers once per link."""
  out = []
  for e in tl.events:
    a = _args(e)
    base = {"hlo": e.name, "kind": e.kind, "modelled_us": e.dur * 1e6}
    if a.get("op"):
      base["hlo_op"] = a["op"]
    if e.track == "ici" and a.get("links"):
      total = sum(a["links"].values())
      for link, nbytes in sorted(a["links"].items()):
        d = dict(base, bytes=int(nbytes), transfer_bytes=int(total))
        out.append((_link_name(link), e, d))
    elif e.track == "ici":
      out.append((f"ICI lane {e.lane}", e, base))
    else:
      out.append(("DMA" if e.track == "dma" else "compute", e, base))
  return out


def flows(tl: Timeline) -> list[tuple[Event, Event]]:
  """``(start, done)`` pairs: the start's launch (or its transfer) and the
  done that waits for it."""
  out = []
  for done in tl.events:
    for name in _args(done).get("awaits", ()):
      before = [
        e for e in tl.events if e.name == name and e.start <= done.start
      ]
      launch = [e for e in before if e.track == "compute"] or before
      if launch:
        out.append((max(launch, key=lambda e: e.start), done))
  return out


def chrome_trace(tl: Timeline, title: str) -> dict:
  """The Chrome trace dict (open in ui.perfetto.dev or chrome://tracing).

  Example:
    >>> trace = chrome_trace(tl, "jit")  # doctest: +SKIP
  """
  names = rows(tl)
  tid = {r: i + 1 for i, r in enumerate(names)}
  events: list[dict] = [
    {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": title}}
  ]
  for r, i in tid.items():
    events.append(
      {
        "ph": "M",
        "pid": 1,
        "tid": i,
        "name": "thread_name",
        "args": {"name": r},
      }
    )
    events.append(
      {
        "ph": "M",
        "pid": 1,
        "tid": i,
        "name": "thread_sort_index",
        "args": {"sort_index": i},
      }
    )
  row_of: dict[int, str] = {}
  for row, e, details in slices(tl):
    row_of.setdefault(id(e), row)
    events.append(
      {
        "ph": "X",
        "pid": 1,
        "tid": tid[row],
        "name": e.name,
        "cat": e.kind,
        "ts": e.start * 1e6,
        "dur": e.dur * 1e6,
        "args": details,
      }
    )
  for k, (start, done) in enumerate(flows(tl)):
    common = {"pid": 1, "name": "start -> done", "cat": "flow", "id": k}
    events.append(
      dict(common, ph="s", tid=tid[row_of[id(start)]], ts=start.start * 1e6)
    )
    events.append(
      dict(
        common, ph="f", bp="e", tid=tid[row_of[id(done)]], ts=done.start * 1e6
      )
    )
  return {"traceEvents": events, "displayTimeUnit": "ns"}


def write_png(tl: Timeline, path: pathlib.Path, title: str) -> None:
  """Draws the timeline, one lane per row of :func:`rows`, to ``path``."""
  import matplotlib  # noqa: PLC0415

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  from matplotlib.patches import Patch  # noqa: PLC0415

  names = rows(tl)
  y = {r: i for i, r in enumerate(names)}
  height = 2.2 + 0.42 * len(names)
  fig, ax = plt.subplots(figsize=(20, height), dpi=100)
  kinds = set()
  for row, e, _ in slices(tl):
    kinds.add(e.kind)
    ax.broken_barh(
      [(e.start * 1e6, e.dur * 1e6)],
      (y[row] - 0.38, 0.76),
      facecolors=COLORS.get(e.kind, "#333333"),
      edgecolor="white",
      linewidth=0.2,
    )
  for start, done in flows(tl):
    ax.annotate(
      "",
      xy=(done.start * 1e6, y["compute"] - 0.42),
      xytext=(start.start * 1e6, y["compute"] - 0.42),
      arrowprops=dict(
        arrowstyle="->",
        color="#555555",
        lw=0.6,
        connectionstyle="arc,angleA=90,angleB=90,armA=14,armB=14,rad=3",
      ),
    )
  ax.set_yticks(range(len(names)), names, fontsize=10)
  ax.set_ylim(len(names) - 0.4, -1.1)
  ax.set_xlim(0, max(tl.step_s * 1e6, 1e-3))
  ax.set_xlabel("modelled time on one device (us)", fontsize=11)
  ax.set_ylabel("TensorCore / ICI link (from -> to chip coords) / DMA")
  ax.grid(axis="x", color="#dddddd", linewidth=0.6)
  ax.set_axisbelow(True)
  ax.set_title(
    f"{title}   (step {tl.step_s * 1e6:.1f} us, exposed communication "
    f"{tl.exposed_comm_s * 1e6:.1f} us; arrows: start -> done)",
    fontsize=12,
    pad=22,
  )
  handles = [
    Patch(color=COLORS[k], label=LABELS[k]) for k in COLORS if k in kinds
  ]
  fig.legend(
    handles=handles, fontsize=10, ncol=3, loc="lower center", frameon=False
  )
  fig.tight_layout(rect=(0, 0.75 / height, 1, 1))
  fig.savefig(path)
  plt.close(fig)


def write(tl: Timeline, out_dir: pathlib.Path, stem: str, title: str):
  """Writes ``<stem>.trace.json`` and ``<stem>.png`` under ``out_dir``."""
  out_dir.mkdir(parents=True, exist_ok=True)
  (out_dir / f"{stem}.trace.json").write_text(
    json.dumps(chrome_trace(tl, title))
  )
  write_png(tl, out_dir / f"{stem}.png", title)
