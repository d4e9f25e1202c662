"""Modelled TPU step times of the collective-matmul variants.

Usage::

  python -m benchmarks.run [--topology v5e:2x4] [--shape 1024,2048,8192]
      [--configs int32,float32:highest,float32,bfloat16]
      [--variants unsharded,jit,ppermute,...] [--out out/bench]
      [--prefetch free|charged]

Compiles every variant ahead of time for the topology (no TPU needed),
simulates its scheduled HLO with :mod:`benchmarks._timeline` and prints one
markdown table per shape and config. Traces and PNGs go to ``--out``.
"""

import argparse
import contextlib
import os
import pathlib
import sys
import time

import jax.numpy as jnp
import numpy as np

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


def make_mesh(topology: str):
  """A ``("x", "y")`` mesh of the topology's devices, y the longer axis."""
  from jax.experimental import topologies  # noqa: PLC0415
  from jax.sharding import Mesh  # noqa: PLC0415

  # Several processes (tests, benchmarks) may compile for TPU at once.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  with _quiet_fd2():
    topo = topologies.get_topology_desc(topology, platform="tpu")
  devs = sorted(topo.devices, key=lambda d: tuple(reversed(d.coords)))
  n = len(devs)
  x = 2 if n % 2 == 0 and n > 2 else 1
  return Mesh(np.array(devs).reshape(n // x, x).T, ("x", "y"))


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
    ring_size=mesh.shape["y"],
    prefetch=prefetch,
  )
  mem = compiled.memory_analysis()
  return {
    "variant": variant,
    "step_us": tl.step_s * 1e6,
    "exposed_us": tl.exposed_comm_s * 1e6,
    "copies": defensive_copies(text),
    "temp_mib": getattr(mem, "temp_size_in_bytes", 0) / 2**20,
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


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--topology", default="v5e:2x4")
  p.add_argument("--shape", default="1024,2048,8192", help="B,D,F (global)")
  p.add_argument(
    "--configs",
    default="int32,float32:highest,float32,bfloat16",
    help="dtype[:precision] list",
  )
  p.add_argument("--variants", default=",".join(_variants.available()))
  p.add_argument("--out", default="out/bench")
  p.add_argument("--prefetch", default="free", choices=("free", "charged"))
  a = p.parse_args(argv)
  chip = _chips.chip_for(a.topology)
  mesh = make_mesh(a.topology)
  shape = tuple(int(s) for s in a.shape.split(","))
  variants = a.variants.split(",")
  if "unsharded" not in variants:
    variants = ["unsharded", *variants]
  out = pathlib.Path(a.out)
  print(f"# {a.topology} mesh {dict(mesh.shape)}, (B, D, F) = {shape}")
  print(
    f"chip {chip.name}: clock {chip.clock_hz / 1e9:.2f} GHz, ICI link "
    f"{chip.ici_link_bytes_per_s / 1e9:.0f} GB/s one-way, HBM "
    f"{chip.hbm_bytes_per_s / 1e9:.0f} GB/s, prefetch {a.prefetch}\n"
  )
  for text in a.configs.split(","):
    config = parse_config(text)
    rows = []
    for v in variants:
      row, tl = measure(v, mesh, shape, config, chip, a.prefetch)
      rows.append(row)
      stem = f"{v}_{text.replace(':', '-')}_{a.topology.replace(':', '_')}"
      _trace.write(
        tl, out, stem, f"{v} {text} {a.topology}: {row['step_us']:.1f} us"
      )
    bound = rows[0]["step_us"]
    print(f"## {text}\n\n{table(rows, bound)}\n", flush=True)
  print("(*) contains custom calls without estimated_cycles (bytes model).")
  print(f"traces and PNGs: {out}/")
  return 0


if __name__ == "__main__":
  sys.exit(main())
