"""The timeline pictures: the Perfetto trace and the PNG figure."""

import functools
import json
import struct

import pytest

from benchmarks import _chips, _trace, run


@functools.cache
def _timeline():
  mesh = run.make_mesh("v5e:2x4")
  _, tl = run.measure(
    "allgather_matmul",
    mesh,
    (256, 512, 1024),
    run.parse_config("bfloat16"),
    _chips.chip_for("v5e:2x4"),
  )
  return tl


def test_trace_rows_flows_and_args():
  tl = _timeline()
  trace = json.loads(json.dumps(_trace.chrome_trace(tl, "t")))["traceEvents"]
  names = {
    e["tid"]: e["args"]["name"] for e in trace if e["name"] == "thread_name"
  }
  links = [n for n in names.values() if n.startswith("ICI ")]
  # A 4-device ring on each of the two 2x2 squares: 8 directed links.
  assert len(links) == 8 and len(set(links)) == 8
  assert all(" -> " in n for n in links)
  assert "compute" in names.values()
  ici = [e for e in trace if e["ph"] == "X" and names[e["tid"]] in links]
  assert ici
  for e in ici:
    a = e["args"]
    assert a["bytes"] > 0 and a["transfer_bytes"] >= a["bytes"]
    assert a["modelled_us"] == pytest.approx(e["dur"])
    assert a["hlo_op"] == "custom-call" and a["hlo"].startswith("asyncops_")
  compute = [e for e in trace if e["ph"] == "X" and e["cat"] == "compute"]
  assert all("hlo_op" in e["args"] for e in compute)
  # One flow arrow per ring step, from a start to the done waiting on it.
  starts = [e for e in trace if e["ph"] == "s"]
  ends = {e["id"]: e for e in trace if e["ph"] == "f"}
  assert len(starts) == 3 and len(ends) == 3
  for s in starts:
    assert ends[s["id"]]["ts"] > s["ts"]


def test_png_is_a_wide_figure(tmp_path):
  path = tmp_path / "t.png"
  _trace.write_png(_timeline(), path, "allgather_matmul")
  head = path.read_bytes()[:24]
  assert head[:8] == b"\x89PNG\r\n\x1a\n"
  width, height = struct.unpack(">II", head[16:24])
  assert width >= 1600 and height >= 400
  # One lane per link, plus compute (and DMA when XLA prefetches).
  tl = _timeline()
  dma = any(e.track == "dma" for e in tl.events)
  assert _trace.rows(tl)[:1] == ["compute"]
  assert len(_trace.rows(tl)) == 1 + 8 + dma
