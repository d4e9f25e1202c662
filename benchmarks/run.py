"""Modelled TPU step times of the collective-matmul variants.

Usage::

  python -m benchmarks.run                       # the default tables
  python -m benchmarks.run --json rows.json      # also every row as JSON
  python -m benchmarks.run --json                # the rows on stdout
  python -m benchmarks.run --families allgather,reducescatter,allreduce,mlp
  python -m benchmarks.run --families mlp_gated,mlp_sp_gated  # SwiGLU MLPs
  python -m benchmarks.run --no-llama            # without the Llama table
  python -m benchmarks.run --xla-configs         # one row per XLA config
  python -m benchmarks.run --sensitivity         # latency constants x0.5, x2
  python -m benchmarks.run --sweep llama         # Llama-3-70B MLP sweep
  python -m benchmarks.run --variants allgather_matmul_auto,\
    allgather_matmul_auto_jit                    # auto, memory="jit" too
  python -m benchmarks.run --calibration         # against measured times

Compiles every variant ahead of time for the topology (no TPU needed),
models its scheduled HLO with :mod:`benchmarks._timeline` and prints one
markdown table per family, dtype, shape and topology. Each table gives:

- ``bound``: the per-device matmul without communication (unsharded);
- ``roofline``: FLOPs at peak, HBM bytes at HBM bandwidth, ring bytes at
  link bandwidth, whichever is largest (:mod:`benchmarks._roofline`);
- ``jit``, ``xla_best`` (the fastest of :data:`xla_configs.CONFIGS`, its
  configuration named), the chapter's ``ppermute`` ring, ours (one-way,
  two-way, ``auto`` when the library has it);
- after the family tables (unless ``--no-llama``): the Llama-3-70B MLP
  shard, SwiGLU in sequence-parallel layout (``mlp_sp_gated``, bf16,
  :data:`LLAMA`: 4096 tokens, D 8192, F 28672) on each topology;
- per row: step time (XLA's weight prefetch free, and charged), exposed
  communication, ratios to the bound, the roofline and ``xla_best``,
  defensive copies, peak temporary memory (as XLA reports it, and the HBM
  bytes the buffer assignment reserves, which the memory target uses), and
  flags for rows the model cannot cost fully (``!``).

Compiled HLO is cached (:mod:`benchmarks._measure`), so a second run, or
``--sensitivity``, only re-models. Exit status: 0, or 1 when a row is
modelled below its roofline (a model bug: a ``finding:`` line after the
tables, and ``"below its roofline"`` in the row's ``flags``), 2 for a
usage error. ``--json FILE`` writes the rows to FILE (the tables stay on
stdout); ``--json`` alone or ``--json -`` prints them on stdout (the
tables then on stderr).
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import re
import sys
import time

import jax.numpy as jnp

from asyncops import _cli
from benchmarks import _chips, _measure, _mesh, _roofline, _trace, _variants
from benchmarks import xla_configs as _xc

make_mesh = _mesh.make_mesh
mesh_rings = _mesh.mesh_rings
peak_temp_bytes = _measure.peak_temp_bytes
defensive_copies = _measure.defensive_copies

CHAPTER = (1024, 2048, 8192)
PREFILL = (2048, 8192, 28672)
LLAMA_D, LLAMA_F = 8192, 28672
# The default Llama table: (tokens, D, F) of one step's MLP shard.
LLAMA = (4096, LLAMA_D, LLAMA_F)
# The chapter's measurements on a TPU v5e-8 (int32, mesh 2x4).
MEASURED = {"unsharded": 224.0, "jit": 311.0, "ppermute": 244.0}


def parse_config(text: str):
  dtype, _, precision = text.partition(":")
  return jnp.dtype(dtype), (precision or None)


def measure(variant, mesh, shape, config, chip, prefetch="free"):
  """Compiles and models one variant on ``mesh``; ``(row, timeline)``.

  The simple entry point (examples use it); tables go through
  :func:`benchmarks._measure.measure`, which caches. The row's memory is
  both XLA's figure (``temp_mib``, :func:`peak_temp_bytes`) and the buffer
  assignment's HBM temporaries (``alloc_mib``,
  :func:`benchmarks._measure.peak_alloc_bytes`), the measure the tables'
  memory target reads.
  """
  from benchmarks import _hlo, _timeline  # noqa: PLC0415

  dtype, precision = config
  fn = _variants.build(variant, mesh, precision=precision)
  args = _variants.abstract_args(variant, mesh, shape, dtype)
  t0 = time.perf_counter()
  with _mesh.quiet_fd2():
    lowered = fn.trace(*args).lower()
  compiled, assignment = _measure.compile_with_assignment(lowered)
  compile_s = time.perf_counter() - t0
  text = compiled.as_text()
  tl = _timeline.simulate(
    _hlo.parse(text),
    chip,
    coords=_mesh.coords(mesh),
    rings=mesh_rings(mesh),
    axis_rings=_mesh.axis_rings(mesh),
    prefetch=prefetch,
  )
  return {
    "variant": variant,
    "step_us": tl.step_s * 1e6,
    "exposed_us": tl.exposed_comm_s * 1e6,
    "copies": defensive_copies(text),
    "temp_mib": peak_temp_bytes(compiled.memory_analysis()) / 2**20,
    "alloc_mib": _measure.peak_alloc_bytes(
      _measure.assignment_temps(assignment)
    )
    / 2**20,
    "compile_s": compile_s,
    "unmodelled": len(tl.unmodelled) + len(tl.flags),
  }, tl


def table(rows, bound_us) -> str:
  """A short table of :func:`measure` rows (the examples print it)."""
  lines = [
    "| variant | step (us) | exposed comm (us) | / unsharded | defensive "
    "copies | peak temp (MiB) | HBM temp alloc (MiB) |",
    "|---|---:|---:|---:|---:|---:|---:|",
  ]
  for r in rows:
    flag = " (!)" if r["unmodelled"] else ""
    lines.append(
      f"| {r['variant']}{flag} | {r['step_us']:.1f} | {r['exposed_us']:.1f}"
      f" | {r['step_us'] / bound_us:.3f} | {r['copies']} | "
      f"{r['temp_mib']:.1f} | {r['alloc_mib']:.1f} |"
    )
  return "\n".join(lines)


# Tables -------------------------------------------------------------------


def _name(family: str, kind: str) -> str:
  """Today's variant names: bare for the all-gather family."""
  if family != "allgather":
    return f"{family}:{kind}"
  return {
    "asyncops": "allgather_matmul",
    "asyncops_bidi": "allgather_matmul_bidi",
    "asyncops_auto": "allgather_matmul_auto",
    "asyncops_ref": "allgather_matmul_ref",
  }.get(kind, kind)


def family_variants(family: str, ref: bool, extra: list[str]) -> list[str]:
  """The rows of one table after the bound, jit and xla_best."""
  if family == "allgather":
    names = [v for v in _variants.available() if v not in ("unsharded", "jit")]
    names = [v for v in names if v != "asyncops_manual" or "manual" in extra]
    # The fixed step plans (a 4-ring's) are compared on request only.
    names = [v for v in names if not re.fullmatch(r".*_fused_s\d+", v)]
    if ref:
      names += _variants.library_ref()
    return names
  names = _variants.family_variants(family, ref=ref)
  return [n for n in names if not n.endswith((":unsharded", ":jit"))]


def fused_refuses(name: str, dtype) -> str | None:
  """Why the library's fused kernels refuse ``dtype`` in variant ``name``
  (the reason ``asyncops.collective_matmul._fused`` raises), or None."""
  if "_fused" not in name:
    return None
  d = jnp.dtype(dtype)
  if any(q in name for q in ("_int8", "_fp8")) and not jnp.issubdtype(
    d, jnp.floating
  ):
    return "int8 transfers quantize floating inputs only"
  if d not in (jnp.dtype(t) for t in (jnp.bfloat16, jnp.float32, jnp.int8)):
    return f"dtype {d.name} has no MXU path"
  return None


def auto_choice(variant, mesh, shape, config):
  """What ``method="auto"`` runs in ``variant`` on ``mesh``'s chip, and
  why: ``(methods, reasons)``, one per collective matmul (an MLP has two),
  recorded while tracing (:func:`asyncops.collective_matmul._auto.
  recording`; tracing is cheap, the compile is cached separately)."""
  from asyncops.collective_matmul import _auto  # noqa: PLC0415

  dtype, precision = config
  fn = _variants.build(variant, mesh, precision=precision)
  args = _variants.abstract_args(variant, mesh, shape, dtype)
  with _auto.recording() as choices, _mesh.quiet_fd2():
    fn.trace(*args)
  methods = ", ".join(c.method for _, c in choices) or "n/a"
  reasons = "; ".join(f"{f}: {c}" for f, c in choices) or "no auto choice"
  return methods, reasons


class Bench:
  """Measures tables and keeps every row for ``--json``."""

  def __init__(self, a):
    self.a = a
    self.rows: list[dict] = []
    self.below_roofline: list[str] = []

  def spec(self, variant, topology, tp, shape, config, **kw):
    dtype, precision = config
    return _measure.Spec(
      variant,
      topology,
      tp,
      tuple(shape),
      dtype,
      precision,
      layout=kw.get("layout", self.a.layout),
      options=kw.get("options", {}),
    )

  @staticmethod
  def guard(res, floor_us: float):
    """XLA's cross-program prefetch is free only while that leaves the
    program at or above its roofline: a weight too big to stay on chip is
    read from HBM every step. Otherwise the row charges it (and says so)."""
    row = res.row
    res.prefetch = "free"
    below = row["step_us"] < floor_us * (1 - 1e-6)
    if below and row["step_charged_us"] > row["step_us"]:
      row["step_free_us"] = row["step_us"]
      row["step_us"] = row["step_charged_us"]
      row["flags"] = [
        *row["flags"],
        f"prefetch charged (free: {row['step_free_us']:.1f} us, below "
        "the roofline)",
      ]
      res.prefetch = "charged"
    return res

  def xla_best(self, family, topology, tp, shape, config, per_config, floor):
    """``(best result, name, [all results])`` over the XLA configs."""
    seen, results = {}, []
    for cname, opts in _xc.CONFIGS.items():
      spec = self.spec(
        _name(family, "jit"), topology, tp, shape, config, options=opts
      )
      try:
        res = _measure.measure(spec)
      except Exception as e:  # noqa: BLE001 - a config libtpu refuses
        print(f"  ({cname}: not compiled: {str(e).splitlines()[0][:120]})")
        continue
      if res.hlo_key in seen:
        continue
      self.guard(res, floor)
      seen[res.hlo_key] = cname
      results.append((cname, res))
    best_name, best = min(results, key=lambda r: r[1].row["step_us"])
    return best, best_name, results if per_config else []

  def one_table(self, family, topology, tp, shape, config, variants=None):
    a = self.a
    chip = _chips.chip_for(topology)
    mesh = _measure.mesh_for(topology, a.layout, tp)
    x, y = mesh.shape["x"], mesh.shape["y"]
    dtype, precision = config
    rings = [[d.coords for d in row] for row in mesh.devices]
    roof = _roofline.roofline(
      family, shape, x, y, dtype, chip, precision, _roofline.ring_links(rings)
    )
    floor = roof.total_s * 1e6
    bound = self.guard(
      _measure.measure(
        self.spec(_name(family, "unsharded"), topology, tp, shape, config)
      ),
      max(roof.compute_s, roof.hbm_s) * 1e6,
    )
    jit = self.guard(
      _measure.measure(
        self.spec(_name(family, "jit"), topology, tp, shape, config)
      ),
      floor,
    )
    best, best_name, per = self.xla_best(
      family, topology, tp, shape, config, a.xla_configs, floor
    )
    rows = [(bound, None), (jit, None), (best, best_name)]
    rows += [(r, n) for n, r in per]
    names = variants or family_variants(family, a.ref, a.extra)
    # The default rows leave out what the fused kernels refuse (they
    # raise); a variant asked for by name still runs, and fails.
    left_out = (
      {}
      if variants
      else {v: why for v in names if (why := fused_refuses(v, dtype))}
    )
    names = [v for v in names if v not in left_out]
    for v in _measure.progress(names, f"{topology} {family} {config}"):
      res = _measure.measure(self.spec(v, topology, tp, shape, config))
      if memory := _variants.auto_memory(v):
        methods, reasons = auto_choice(v, mesh, shape, config)
        res.row["auto_choice"] = methods
        res.row["auto_reason"] = reasons
        res.row["memory"] = memory
      rows.append((self.guard(res, floor), None))
    bound_us = bound.row["step_us"]
    best_us = best.row["step_us"]
    out = []
    for k, (res, cname) in enumerate(rows):
      row = dict(res.row)
      if k == 2:
        row["variant"] = _name(family, "xla_best")
      elif cname is not None:
        row["variant"] = f"{row['variant']}[{cname}]"
      row.update(
        tp=tp,
        bound_us=bound_us,
        roofline_us=roof.total_s * 1e6,
        roofline={
          "compute_us": roof.compute_s * 1e6,
          "hbm_us": roof.hbm_s * 1e6,
          "links_us": roof.links_s * 1e6,
        },
        xla_best_us=best_us,
        vs_xla_best=row["step_us"] / best_us,
        xla_config=(_xc.describe(cname) if cname else None),
      )
      if k == 0:
        row["variant"] = _name(family, "unsharded")
      row_floor = roof.total_s if k else max(roof.compute_s, roof.hbm_s)
      if row["step_us"] < row_floor * 1e6 * (1 - 1e-6):
        self.below_roofline.append(f"{topology} {family} {row['variant']}")
        row["flags"] = [*row["flags"], "below its roofline"]
      ours = (
        row["variant"]
        .split(":")[-1]
        .startswith(("allgather_matmul", "asyncops"))
      )
      # Ours may hold one chunk's buffers (send and receive) beyond jit,
      # in HBM bytes the executables reserve (the buffer assignment's
      # temporaries, _measure.peak_alloc_bytes; design/benchmarks.md,
      # "The memory column").
      chunk = 2 * (shape[0] // x) * (shape[1] // y) * dtype.itemsize / 2**20
      limit = jit.row["peak_alloc_mib"] + chunk
      if ours and row["peak_alloc_mib"] > limit + 1e-6:
        row["flags"] = [
          *row["flags"],
          f"peak alloc {row['peak_alloc_mib']:.1f} MiB > jit's "
          f"{jit.row['peak_alloc_mib']:.1f} + one chunk's buffers "
          f"{chunk:.1f}",
        ]
      if a.sensitivity:
        for f in (0.5, 2.0):
          tl = _measure.simulate(
            res.text, res.spec, chip.scaled_latency(f), prefetch=res.prefetch
          )
          row[f"step_latency_x{f:g}_us"] = tl.step_s * 1e6
      out.append(row)
      if a.pictures and k >= 1:
        stem = "_".join(
          [
            row["variant"].replace(":", "_").replace("[", "_").rstrip("]"),
            row["dtype"].replace(":", "-"),
            topology.replace(":", "_"),
            "x".join(map(str, shape)),
          ]
        )
        _trace.write(
          res.timeline,
          pathlib.Path(a.out),
          stem,
          f"{row['variant']} {row['dtype']} {topology}: "
          f"{row['step_us']:.1f} us",
        )
    self.rows.extend(out)
    self.print_table(
      family, topology, mesh, shape, config, roof, out, best_name
    )
    if left_out:
      print(
        "left out (the fused kernels refuse them): "
        + "; ".join(f"{v} ({why})" for v, why in left_out.items())
        + "\n",
        flush=True,
      )
    return out

  def print_table(
    self, family, topology, mesh, shape, config, roof, rows, best_name
  ):
    dtype, precision = config
    cfg = f"{jnp.dtype(dtype).name}" + (f":{precision}" if precision else "")
    print(
      f"### {family} {cfg} (B, D, F) = {tuple(shape)} on {topology} "
      f"mesh {dict(mesh.shape)}\n"
    )
    print(
      f"roofline {roof.total_s * 1e6:.1f} us = max(compute "
      f"{roof.compute_s * 1e6:.1f}, HBM {roof.hbm_s * 1e6:.1f}, links "
      f"{roof.links_s * 1e6:.1f}); xla_best = {_xc.describe(best_name)}\n"
    )
    sens = self.a.sensitivity
    head = (
      "| variant | step (us) | prefetch charged | exposed comm | / bound | "
      "/ roofline | / xla_best | copies | peak temp (MiB) | HBM alloc "
      "(MiB) |"
    )
    rule = "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    if sens:
      head += " latency x0.5 | latency x2 |"
      rule += "---:|---:|"
    lines = [head, rule]
    for r in rows:
      flag = " !" if r["flags"] else ""
      line = (
        f"| {r['variant']}{flag} | {r['step_us']:.1f} | "
        f"{r['step_charged_us']:.1f} | {r['exposed_us']:.1f} | "
        f"{r['step_us'] / r['bound_us']:.3f} | "
        f"{r['step_us'] / r['roofline_us']:.3f} | {r['vs_xla_best']:.3f} | "
        f"{r['defensive_copies']} | {r['peak_temp_mib']:.1f} | "
        f"{r['peak_alloc_mib']:.1f} |"
      )
      if sens:
        line += (
          f" {r['step_latency_x0.5_us']:.1f} | {r['step_latency_x2_us']:.1f} |"
        )
      lines.append(line)
    print("\n".join(lines))
    notes = [
      f"- {r['variant']}: {'; '.join(r['flags'])}" for r in rows if r["flags"]
    ]
    for r in rows:
      if "auto_reason" in r:
        print(f"\n{r['variant']} chose {r['auto_reason']}")
    if notes:
      print(
        "\n! notes (not fully costed, prefetch charged, memory):\n"
        + "\n".join(notes)
      )
    print(flush=True)


# Sweeps -------------------------------------------------------------------


def llama_sweep(bench: Bench, a) -> None:
  """The Llama-3-70B MLP shard (D 8192, F 28672) at M tokens per device."""
  ms = _cli.parse_int_list(a.sweep_m, flag="--sweep-m")
  for topology in a.sweep_topologies.split(","):
    for tp in _cli.parse_int_list(a.sweep_tp, flag="--sweep-tp"):
      n = len(_measure.mesh_for(topology, a.layout, None).devices.flat)
      x = n // tp
      for family in a.sweep_families.split(","):
        summary = []
        variants = [
          v
          for v in a.variants.split(",")
          if v
          and ((family == "allgather") == (":" not in v))
          and (":" not in v or v.startswith(f"{family}:"))
        ] or None
        for m in ms:
          rows = bench.one_table(
            family,
            topology,
            tp,
            (m * x, LLAMA_D, LLAMA_F),
            (jnp.dtype(jnp.bfloat16), None),
            variants,
          )
          summary.append((m, rows))
        _print_sweep(family, topology, tp, summary)


def _print_sweep(family, topology, tp, summary) -> None:
  print(
    f"### sweep {family} bf16 Llama-3-70B MLP shard, {topology}, "
    f"tp {tp}: step (us) per tokens/device M\n"
  )
  kinds = [r["variant"] for r in summary[0][1]]
  kinds = [k for k in kinds if "[" not in k]
  print(
    "| M | roofline | "
    + " | ".join(kinds)
    + " | best ours / xla_best | auto / xla_best | auto chose |"
  )
  print("|---:|---:|" + "---:|" * len(kinds) + "---:|---:|---|")
  pays = []
  ran_ours = False
  for m, rows in summary:
    by = {r["variant"]: r for r in rows}
    ours = [
      r["step_us"]
      for r in rows
      if r["variant"]
      .split(":")[-1]
      .startswith(("allgather_matmul", "asyncops"))
    ]
    best = by[_name(family, "xla_best")]["step_us"]
    ran_ours |= bool(ours)
    ratio = f"{min(ours) / best:.3f}" if ours else "n/a"
    if ours and min(ours) < best:
      pays.append(m)
    cells = " | ".join(f"{by[k]['step_us']:.1f}" for k in kinds)
    auto = next((r for r in rows if r.get("memory") == "fastest"), None)
    auto_cells = (
      f"{auto['step_us'] / best:.3f} | {auto['auto_choice']}"
      if auto
      else "n/a | n/a"
    )
    print(
      f"| {m} | {rows[0]['roofline_us']:.1f} | {cells} | {ratio} | "
      f"{auto_cells} |"
    )
  if not ran_ours:
    print("\n(no variant of ours in this run)\n", flush=True)
    return
  where = ", ".join(map(str, pays)) if pays else "no M of the sweep"
  print(f"\nours (best variant) beats xla_best at M = {where}\n", flush=True)


def calibration(bench: Bench, a) -> None:
  """The chapter's program on the chapter's mesh against its measurements."""
  config = (jnp.dtype(jnp.int32), None)
  print("### calibration: the chapter's int32 (1024, 2048, 8192) on v5e:2x4\n")
  print("| mesh | prefetch | unsharded | jit | ppermute | jit / ppermute |")
  print("|---|---|---:|---:|---:|---:|")
  print(
    f"| measured (chapter) | - | {MEASURED['unsharded']:.0f} | "
    f"{MEASURED['jit']:.0f} | {MEASURED['ppermute']:.0f} | "
    f"{MEASURED['jit'] / MEASURED['ppermute']:.3f} |"
  )
  for layout in ("chapter", "ring", "line"):
    res = {}
    for v in ("unsharded", "jit", "ppermute"):
      res[v] = _measure.measure(
        bench.spec(v, "v5e:2x4", 4, CHAPTER, config, layout=layout)
      )
    for pf in ("step_us", "step_charged_us"):
      r = {v: res[v].row[pf] for v in res}
      name = "free" if pf == "step_us" else "charged"
      print(
        f"| {layout} | {name} | {r['unsharded']:.1f} | {r['jit']:.1f} | "
        f"{r['ppermute']:.1f} | {r['jit'] / r['ppermute']:.3f} |"
      )
      for v in r:
        bench.rows.append(
          dict(
            res[v].row,
            layout=layout,
            prefetch=name,
            measured_us=MEASURED[v],
            calibration=True,
          )
        )
  print(flush=True)


# Command line -------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
  p = _cli.ArgumentParser(
    prog="python -m benchmarks.run",
    description=__doc__.split("\n")[0],
    formatter_class=argparse.RawDescriptionHelpFormatter,
    epilog=__doc__.split("\n", 1)[1],
  )
  p.add_argument("--topology", default="v5e:2x4", help="comma list")
  p.add_argument(
    "--shape",
    default="1024,2048,8192",
    help="B,D,F global; ';' separates several",
  )
  p.add_argument(
    "--tp",
    type=_cli.positive_int,
    default=None,
    help="devices on the ring (default 4 of 8)",
  )
  p.add_argument(
    "--configs",
    default="bfloat16",
    help="dtype[:precision] comma list, e.g. float32:highest",
  )
  p.add_argument(
    "--preset",
    choices=("issue15",),
    help="issue15: v5e and v6e, the chapter and prefill shapes, bf16 and "
    "f32, all-gather, reduce-scatter and all-reduce",
  )
  p.add_argument(
    "--families",
    default="allgather,reducescatter,mlp_train",
    help="allgather,reducescatter,allreduce,mlp,mlp_gated,mlp_sp_gated,"
    "mlp_train (the forward and backward step of mlp)",
  )
  p.add_argument(
    "--llama",
    action=argparse.BooleanOptionalAction,
    default=None,
    help="end with the Llama-3-70B MLP shard table (SwiGLU, sequence "
    f"parallel, bfloat16, (tokens, D, F) = {LLAMA}); default: on when "
    "--shape, --families, --variants and --preset are not given",
  )
  p.add_argument(
    "--variants",
    default="",
    help="only these (besides bound, jit, xla_best); sweeps too. "
    "Opt-in names include allgather_matmul_auto_jit and "
    "<family>:asyncops_auto_jit: method='auto' with memory='jit'",
  )
  p.add_argument("--ref", action="store_true", help="add api='ref' rows")
  p.add_argument(
    "--manual",
    dest="extra",
    action="append_const",
    const="manual",
    help="add the hand-written asyncops ring",
  )
  p.add_argument(
    "--xla-configs",
    action="store_true",
    help="one row per XLA configuration tried for xla_best",
  )
  p.add_argument(
    "--sensitivity",
    action="store_true",
    help="also model every row with latencies x0.5 and x2",
  )
  p.add_argument("--sweep", choices=("llama",), help="run a sweep instead")
  p.add_argument("--sweep-m", default="16,64,256,1024,4096,16384")
  p.add_argument("--sweep-tp", default="8,4")
  p.add_argument("--sweep-topologies", default="v5e:2x4,v6e:2x4,v5p:2x2x2")
  p.add_argument("--sweep-families", default="allgather,reducescatter")
  p.add_argument(
    "--calibration",
    action="store_true",
    help="the chapter's measured times against the model",
  )
  p.add_argument(
    "--collectives",
    default="ring",
    choices=("ring", "multicast"),
    help="how XLA's collectives use the links (see benchmarks/_timeline)",
  )
  p.add_argument(
    "--layout", default="ring", choices=("ring", "line", "chapter")
  )
  _cli.add_json(p, "every row (a JSON list)")
  p.add_argument(
    "--pictures",
    action="store_true",
    help="write a trace and a PNG per row to --out",
  )
  p.add_argument(
    "--x-input",
    default="parameter",
    choices=_variants.X_INPUTS,
    help="how every variant's x enters the program: an entry parameter, "
    "donated, or produced in the program (x * 2, as a model's activation)",
  )
  p.add_argument("--out", default="out/bench")
  return p


def _check_conflicts(p: argparse.ArgumentParser, a) -> None:
  """Flags that another flag would silently override: a usage error."""

  def given(*names):
    return [
      "--" + k.replace("_", "-")
      for k in names
      if getattr(a, k) != p.get_default(k)
    ]

  if a.calibration and a.sweep:
    p.error("--calibration and --sweep are two runs; give one of them")
  if a.preset and (clash := given("topology", "shape", "configs", "families")):
    p.error(
      f"--preset {a.preset} sets {', '.join(clash)}; drop "
      f"{'it' if len(clash) == 1 else 'them'} or drop --preset"
    )
  if a.sweep and (clash := given("topology", "tp", "shape")):
    p.error(
      f"--sweep {a.sweep} ignores {', '.join(clash)}; use --sweep-topologies, "
      "--sweep-tp and --sweep-m"
    )


def _check_meshes(p: argparse.ArgumentParser, a, flag, topologies, tps):
  """Every topology libtpu knows, every ``tp`` dividing its devices."""
  for topo in topologies:
    try:
      _chips.chip_for(topo)
    except ValueError as e:
      p.error(f"{flag}: {e}")
    try:
      _cli.check_topology(topo, flag=flag)
    except _cli.UsageError as e:
      p.error(str(e))
    for tp in tps:
      try:
        _mesh.make_mesh(topo, a.layout, tp)
      except ValueError as e:
        p.error(f"--{'sweep-' if a.sweep else ''}tp: {e}")


def main(argv=None) -> int:
  p = _parser()
  a = p.parse_args(argv)
  a.extra = a.extra or []
  _check_conflicts(p, a)
  if a.llama is None:
    a.llama = (
      not a.preset
      and not a.variants
      and all(getattr(a, k) == p.get_default(k) for k in ("shape", "families"))
    )
  if a.preset == "issue15":
    a.topology = "v5e:2x4,v6e:2x4"
    a.shape = "1024,2048,8192;2048,8192,28672"
    a.configs = "bfloat16,float32"
    a.families = "allgather,reducescatter,allreduce"
  try:
    shapes = [
      tuple(int(v) for v in s.split(",")) for s in a.shape.split(";") if s
    ]
    if any(len(s) != 3 or min(s) <= 0 for s in shapes):
      raise ValueError
  except ValueError:
    p.error(f"--shape: expected B,D,F positive integers, got {a.shape!r}")
  try:
    configs = [parse_config(c) for c in a.configs.split(",") if c]
  except TypeError:
    p.error(f"--configs: unknown dtype in {a.configs!r} (e.g. bfloat16)")
  for fam in a.families.split(",") + a.sweep_families.split(","):
    if fam not in ("allgather", *_variants.FAMILIES):
      p.error(
        f"--families: unknown family {fam!r}; choose from allgather, "
        f"{', '.join(_variants.FAMILIES)}"
      )
  known = set(_variants.available()) | set(_variants.library_ref())
  known |= set(_variants.library_quantized()) | set(_variants.TORUS)
  known |= set(_variants.library_outacc())
  known |= set(_variants.auto_xla())
  known |= set(_variants.auto_jit())
  for fam in _variants.FAMILIES:
    known |= set(_variants.family_variants(fam, ref=True))
    known |= set(_variants.family_quantized(fam))
  for v in (v for v in a.variants.split(",") if v):
    if v not in known:
      p.error(
        f"--variants: unknown variant {v!r}; choose from "
        f"{', '.join(sorted(known))}"
      )
  if a.sweep:
    try:
      tps = _cli.parse_int_list(a.sweep_tp, flag="--sweep-tp")
      _cli.parse_int_list(a.sweep_m, flag="--sweep-m")
    except _cli.UsageError as e:
      p.error(str(e))
    topologies = a.sweep_topologies.split(",")
    _check_meshes(p, a, "--sweep-topologies", topologies, tps)
  elif not a.calibration:
    _check_meshes(p, a, "--topology", a.topology.split(","), [a.tp])
  _measure.MODEL["collectives"] = a.collectives
  _variants.X_INPUT = a.x_input
  bench = Bench(a)
  sink = sys.stderr if _cli.json_to_stdout(a.json) else sys.stdout
  t0 = time.perf_counter()
  with contextlib.redirect_stdout(sink):
    if a.calibration:
      calibration(bench, a)
    elif a.sweep == "llama":
      llama_sweep(bench, a)
    else:
      variants = [v for v in a.variants.split(",") if v] or None
      for topology in a.topology.split(","):
        for shape in shapes:
          for config in configs:
            for family in a.families.split(","):
              if family.startswith("mlp") and not jnp.issubdtype(
                config[0], jnp.floating
              ):
                continue
              fam_variants = variants and [
                v
                for v in variants
                if (family == "allgather" and ":" not in v)
                or v.startswith(f"{family}:")
              ]
              bench.one_table(
                family, topology, a.tp, shape, config, fam_variants
              )
        if a.llama:
          llama_variants = variants and [
            v for v in variants if v.startswith("mlp_sp_gated:")
          ]
          bench.one_table(
            "mlp_sp_gated",
            topology,
            a.tp,
            LLAMA,
            (jnp.dtype(jnp.bfloat16), None),
            llama_variants,
          )
    print(
      f"({len(bench.rows)} rows in {time.perf_counter() - t0:.0f} s; "
      "! = see the notes under its table)"
    )
  _cli.write_json(a.json, bench.rows)
  return _cli.print_findings(
    [f"{r}: modelled below its roofline" for r in bench.below_roofline],
    a.json,
  )


if __name__ == "__main__":
  sys.exit(_cli.run(main, prog="python -m benchmarks.run"))
