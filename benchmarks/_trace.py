"""Writes a :class:`~benchmarks._timeline.Timeline` as a Chrome/Perfetto
trace (``traceEvents`` JSON, one thread per track) and as a PNG picture.
"""

import json
import pathlib

from benchmarks._timeline import Timeline

_TID = {"compute": 1, "ici": 2, "dma": 3}
_COLORS = {
  "compute": "#4c72b0",
  "wait": "#c44e52",
  "overhead": "#8c8c8c",
  "transfer": "#55a868",
  "collective": "#dd8452",
  "dma": "#8172b3",
}


def chrome_trace(tl: Timeline, title: str) -> dict:
  """The Chrome trace dict (open in ui.perfetto.dev or chrome://tracing).

  Example:
    >>> trace = chrome_trace(tl, "jit")  # doctest: +SKIP
  """
  events = [
    {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": title}}
  ]
  for track, tid in _TID.items():
    events.append(
      {
        "ph": "M",
        "pid": 1,
        "tid": tid,
        "name": "thread_name",
        "args": {"name": track},
      }
    )
  for e in tl.events:
    events.append(
      {
        "ph": "X",
        "pid": 1,
        "tid": _TID[e.track],
        "name": e.name,
        "cat": e.kind,
        "ts": e.start * 1e6,
        "dur": e.dur * 1e6,
      }
    )
  return {"traceEvents": events, "displayTimeUnit": "ns"}


def write_png(tl: Timeline, path: pathlib.Path, title: str) -> None:
  """Draws the timeline (compute / ICI / DMA rows) to ``path``."""
  import matplotlib  # noqa: PLC0415

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  tracks = [t for t in _TID if any(e.track == t for e in tl.events)]
  fig, ax = plt.subplots(figsize=(9, 0.6 + 0.45 * len(tracks)), dpi=80)
  for row, track in enumerate(tracks):
    for e in tl.events:
      if e.track == track:
        ax.broken_barh(
          [(e.start * 1e6, e.dur * 1e6)],
          (row - 0.4, 0.8),
          facecolors=_COLORS[e.kind],
          edgecolor="white",
          linewidth=0.3,
        )
  ax.set_yticks(range(len(tracks)), tracks)
  ax.set_ylim(len(tracks) - 0.5, -0.5)
  ax.set_xlabel("modelled time (us)")
  ax.set_title(title, fontsize=9)
  handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLORS.values()]
  ax.legend(handles, list(_COLORS), fontsize=6, ncol=6, loc="lower right")
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)


def write(tl: Timeline, out_dir: pathlib.Path, stem: str, title: str):
  """Writes ``<stem>.trace.json`` and ``<stem>.png`` under ``out_dir``."""
  out_dir.mkdir(parents=True, exist_ok=True)
  (out_dir / f"{stem}.trace.json").write_text(
    json.dumps(chrome_trace(tl, title))
  )
  write_png(tl, out_dir / f"{stem}.png", title)
