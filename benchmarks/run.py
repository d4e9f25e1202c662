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

import argparse
import pathlib
import sys
import time

import jax.numpy as jnp

from benchmarks import _chips, _hlo, _mesh, _timeline, _trace, _variants

_quiet_fd2 = _mesh.quiet_fd2
make_mesh = _mesh.make_mesh
mesh_rings = _mesh.mesh_rings


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
  for v in variants:
    row, tl = measure(v, mesh, shape, config, chip, a.prefetch)
    rows.append(row)
    stem = f"{v.replace(':', '_')}_{text.replace(':', '-')}_{a_topo(a)}"
    _trace.write(
      tl, out, stem, f"{v} {text} {a.current}: {row['step_us']:.1f} us"
    )
  print(f"## {label} {text}\n\n{table(rows, rows[0]['step_us'])}\n", flush=True)


def a_topo(a) -> str:
  return a.current.replace(":", "_")


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
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
  shape = tuple(int(s) for s in a.shape.split(","))
  out = pathlib.Path(a.out)
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
  return 0


if __name__ == "__main__":
  sys.exit(main())
