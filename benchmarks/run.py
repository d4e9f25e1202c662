"""Modelled TPU step times of the collective-matmul variants.

Usage::

  python -m benchmarks.run [--topology v5e:2x4[,v4:2x2x1,...]]
      [--shape 1024,2048,8192] [--layout ring|line]
      [--configs int32,float32:highest,float32,bfloat16]
      [--variants unsharded,jit,ppermute,...] [--ref]
      [--families reducescatter,allreduce,mlp] [--out out/bench]
      [--prefetch free|charged]

The default run (flagship on v5e:2x4, four configs) takes about 1-2 min;
``--families``, ``--ref`` and more topologies add tables.

Compiles every variant ahead of time for the topology (no TPU needed),
simulates its scheduled HLO with :mod:`benchmarks._timeline` and prints one
markdown table per shape and config. Traces and PNGs go to ``--out``.
"""

import contextlib
import json
import math
import os
import pathlib
import sys
import time
from typing import Literal

import jax.numpy as jnp
import numpy as np

from asyncops import _cli
from benchmarks import _chips, _hlo, _timeline, _trace, _variants


@contextlib.contextmanager
def _quiet_fd2():
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


Layout = Literal["ring", "line"]


def _cycle(devs):
  """Four devices of a 2x2 square in cycle order (every hop one link)."""
  cx = sum(d.coords[0] for d in devs) / 4
  cy = sum(d.coords[1] for d in devs) / 4
  return sorted(
    devs, key=lambda d: math.atan2(d.coords[1] - cy, d.coords[0] - cx)
  )


def _ring_rows(devs):
  """Two rows of four forming physical rings, or None if impossible."""
  chips = sorted({tuple(d.coords) for d in devs})
  if len(devs) != 8:
    return None
  if len(chips) == 4:  # 2 cores per chip: x = core, y = the 2x2 chips
    rows = [[d for d in devs if d.core_on_chip == c] for c in (0, 1)]
  elif len(chips) == 8:  # 2x4: x = which 2x2 square along the long axis
    long = max(range(3), key=lambda a: len({c[a] for c in chips}))
    rows = [[d for d in devs if d.coords[long] // 2 == h] for h in (0, 1)]
  else:
    return None
  if any(len({c for d in r for c in [tuple(d.coords)]}) != 4 for r in rows):
    return None
  return [_cycle(r) for r in rows]


def make_mesh(topology: str, layout: Layout = "ring"):
  """A ``("x", "y")`` mesh of the topology's devices.

  Args:
    topology: e.g. ``"v5e:2x4"``.
    layout: ``"ring"``: each ``y`` row is a physical cycle (a 2x2 square
      of chips, every ring hop one ICI link, both directions usable);
      ``"line"``: ``y`` runs along the longest physical axis (an open line:
      the ring's wrap-around message crosses ``n - 1`` links).

  Returns:
    The mesh (``x`` of size 2 when there are more than 2 devices).
  """
  from jax.experimental import topologies  # noqa: PLC0415
  from jax.sharding import Mesh  # noqa: PLC0415

  if layout not in ("ring", "line"):
    raise ValueError(f"layout must be 'ring' or 'line', got {layout!r}")
  # Several processes (tests, benchmarks) may compile for TPU at once.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  with _quiet_fd2():
    topo = topologies.get_topology_desc(topology, platform="tpu")
  devs = sorted(
    topo.devices,
    key=lambda d: (*reversed(d.coords), getattr(d, "core_on_chip", 0)),
  )
  rows = _ring_rows(devs) if layout == "ring" else None
  if rows is not None:
    return Mesh(np.array(rows), ("x", "y"))
  n = len(devs)
  x = 2 if n % 2 == 0 and n > 2 else 1
  return Mesh(np.array(devs).reshape(n // x, x).T, ("x", "y"))


def mesh_rings(mesh) -> list[list[int]]:
  """Partition ids of each ``y`` ring (partition id = flat mesh index)."""
  ids = np.arange(mesh.devices.size).reshape(mesh.devices.shape)
  return [list(map(int, r)) for r in ids]


def defensive_copies(text: str) -> int:
  """Defensive copies in the HLO, from ``asyncops.inspect`` when present.

  Fallback (no harness on this branch): ``copy`` ops that keep their
  operand's memory space (a memory-space move HBM <-> VMEM is not
  defensive).
  """
  try:
    from asyncops.inspect import analyze_module, parse_module  # noqa: PLC0415

    return len(analyze_module(parse_module(text)).defensive_copies)
  except ImportError:
    pass
  m = _hlo.parse(text)
  n = 0
  for instrs in m.computations.values():
    table = {i.name: i for i in instrs}
    for i in instrs:
      if i.opcode != "copy" or not i.arrays:
        continue
      src = table.get(i.operands[0]) if i.operands else None
      if src is None or not src.arrays:
        continue
      if src.arrays[0].memory_space == i.arrays[0].memory_space:
        n += 1
  return n


def peak_temp_bytes(mem) -> int:
  """Peak bytes live beyond the program's own arguments, outputs and code.

  A compile-only TPU executable reports ``temp_size_in_bytes`` as 0, but its
  ``peak_memory_in_bytes`` counts everything live at the peak, so the
  temporaries are what is left after the arguments, outputs (aliased ones
  counted once) and generated code.
  """
  peak = getattr(mem, "peak_memory_in_bytes", 0)
  fixed = (
    getattr(mem, "argument_size_in_bytes", 0)
    + getattr(mem, "output_size_in_bytes", 0)
    - getattr(mem, "alias_size_in_bytes", 0)
    + getattr(mem, "generated_code_size_in_bytes", 0)
  )
  return max(peak - fixed, getattr(mem, "temp_size_in_bytes", 0), 0)


def parse_config(text: str):
  dtype, _, precision = text.partition(":")
  return jnp.dtype(dtype), (precision or None)


def measure(variant, mesh, shape, config, chip, prefetch="free"):
  """Compiles and simulates one variant; returns (row dict, timeline)."""
  dtype, precision = config
  fn = _variants.build(variant, mesh, precision=precision)
  args = _variants.abstract_args(variant, mesh, shape, dtype)
  t0 = time.perf_counter()
  with _quiet_fd2():
    compiled = fn.trace(*args).lower().compile()
  compile_s = time.perf_counter() - t0
  text = compiled.as_text()
  coords = [d.coords for d in mesh.devices.flat]
  tl = _timeline.simulate(
    _hlo.parse(text),
    chip,
    coords=coords,
    rings=mesh_rings(mesh),
    prefetch=prefetch,
  )
  mem = compiled.memory_analysis()
  return {
    "variant": variant,
    "step_us": tl.step_s * 1e6,
    "exposed_us": tl.exposed_comm_s * 1e6,
    "copies": defensive_copies(text),
    "temp_mib": peak_temp_bytes(mem) / 2**20,
    "compile_s": compile_s,
    "unmodelled": len(tl.unmodelled),
  }, tl


def table(rows, bound_us) -> str:
  lines = [
    "| variant | step (us) | exposed comm (us) | / unsharded | defensive "
    "copies | peak temp (MiB) | compile (s) |",
    "|---|---:|---:|---:|---:|---:|---:|",
  ]
  for r in rows:
    flag = " (*)" if r["unmodelled"] else ""
    lines.append(
      f"| {r['variant']}{flag} | {r['step_us']:.1f} | {r['exposed_us']:.1f}"
      f" | {r['step_us'] / bound_us:.3f} | {r['copies']} | "
      f"{r['temp_mib']:.1f} | {r['compile_s']:.1f} |"
    )
  return "\n".join(lines)


def _run_table(label, variants, mesh, shape, config, text, chip, a, out):
  rows = []
  for v in _cli.progress(variants, f"{a.current} {label} {text}"):
    row, tl = measure(v, mesh, shape, config, chip, a.prefetch)
    rows.append(row)
    stem = f"{v.replace(':', '_')}_{text.replace(':', '-')}_{a_topo(a)}"
    _trace.write(
      tl, out, stem, f"{v} {text} {a.current}: {row['step_us']:.1f} us"
    )
  print(f"## {label} {text}\n\n{table(rows, rows[0]['step_us'])}\n", flush=True)
  a.results.append(
    dict(topology=a.current, family=label, config=text, rows=rows)
  )


def a_topo(a) -> str:
  return a.current.replace(":", "_")


def main(argv=None) -> int:
  p = _cli.parser("python -m benchmarks.run", __doc__.split("\n")[0])
  p.add_argument("--topology", default="v5e:2x4", help="comma list")
  p.add_argument("--shape", default="1024,2048,8192", help="B,D,F (global)")
  p.add_argument(
    "--configs",
    default="int32,float32:highest,float32,bfloat16",
    help="dtype[:precision] list",
  )
  p.add_argument("--variants", default=",".join(_variants.available()))
  p.add_argument("--ref", action="store_true", help="add api='ref' rows")
  p.add_argument(
    "--families",
    default="",
    help="also benchmark: reducescatter,allreduce,mlp (comma list)",
  )
  p.add_argument("--layout", default="ring", choices=("ring", "line"))
  p.add_argument("--out", default="out/bench")
  p.add_argument("--prefetch", default="free", choices=("free", "charged"))
  a = p.parse_args(argv)
  shape = _cli.parse_ints(a.shape, 3, flag="--shape")
  out, a.results = pathlib.Path(a.out), []
  for topology in a.topology.split(","):
    _cli.check_topology(topology)
  with contextlib.redirect_stdout(sys.stderr if a.json else sys.stdout):
    _tables(a, shape, out)
  if a.json:
    print(json.dumps(a.results, indent=1))
  return 0


def _tables(a, shape, out) -> None:
  for topology in a.topology.split(","):
    a.current = topology
    chip = _chips.chip_for(topology)
    mesh = make_mesh(topology, a.layout)
    variants = [v for v in a.variants.split(",") if v]
    if a.ref:
      variants += _variants.library_ref()
    if "unsharded" not in variants:
      variants = ["unsharded", *variants]
    rings = [[tuple(d.coords) for d in r] for r in mesh.devices]
    print(f"# {topology} mesh {dict(mesh.shape)}, (B, D, F) = {shape}")
    print(f"layout {a.layout}: y rings (chip coords) {rings}")
    print(
      f"chip {chip.name}: clock {chip.clock_hz / 1e9:.2f} GHz, ICI link "
      f"{chip.ici_link_bytes_per_s / 1e9:.0f} GB/s one-way, HBM "
      f"{chip.hbm_bytes_per_s / 1e9:.0f} GB/s, prefetch {a.prefetch}\n"
    )
    for text in a.configs.split(","):
      config = parse_config(text)
      _run_table("allgather", variants, mesh, shape, config, text, chip, a, out)
      for fam in filter(None, a.families.split(",")):
        if fam == "mlp" and not jnp.issubdtype(config[0], jnp.floating):
          print(f"## mlp {text}: skipped (gelu needs a floating dtype)\n")
          continue
        fv = _variants.family_variants(fam, ref=a.ref)
        _run_table(fam, fv, mesh, shape, config, text, chip, a, out)
  print("(*) contains custom calls without estimated_cycles (bytes model).")
  print(f"traces and PNGs: {out}/")


if __name__ == "__main__":
  sys.exit(_cli.run(main, prog="python -m benchmarks.run"))
