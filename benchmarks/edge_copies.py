"""Copies at a program's edge: which kernel attribute makes XLA copy.

Usage::

  python -m benchmarks.edge_copies [--topology v5p:2x2x2,v5e:2x4]
      [--xla-flag NAME=VALUE ...] [--variant NAME ...] [--json [FILE]]

Compiles one minimal program per variant ahead of time for each topology
and prints one markdown table of the copies XLA scheduled (the harness's
kind, memory spaces and bytes). The program is a start/done pair written
with plain Pallas: a start kernel DMAs the parameter ``x`` (f32[1024,1024]
per device, 8 devices) into a new buffer, locally or to the next device,
and a wait kernel aliases that buffer to its output, which is returned.
Each variant changes one thing: the DMA, the start's alias of ``x``,
donation, memory-space constraints, side effects, what is returned; two
rows are XLA's own ``jax.lax.ppermute`` and ``all_gather``. The evidence
of design/scheduling.md section 4.

Most rows show copies on purpose: the variants asyncops did not choose, a
donated or non-aliasing start the copy guard refuses, XLA's collectives.
Exit status: 0 clean; 1 a finding: a copy the library promises not to make
(a defensive copy, a copy of a buffer in flight, or any other hazard of
the copy guard, ``asyncops.inspect.hazards``) in a row of asyncops' own
start (:data:`CLEAN`: the start returned as is, and with a computed
result). Copies at the program's edge (kinds ``boundary`` and
``memory_space``) are expected there (design/scheduling.md section 4) and
no finding. 2 a usage error.
"""

import dataclasses
import sys

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from asyncops import _cli
from asyncops.inspect import analyze_module, hazards, parse_module, tpu_mesh
from asyncops.inspect._report import mib
from benchmarks._findings import copy_findings

TOPOLOGIES = ("v5p:2x2x2", "v5e:2x4")
SHARD = (1024, 1024)  # f32 per device
_ANY = pl.BlockSpec(memory_space=pl.ANY)
_SEM = pl.BlockSpec(memory_space=pltpu.SEMAPHORE)


@dataclasses.dataclass(frozen=True)
class Variant:
  """One minimal program (see the module docstring)."""

  remote: bool = True  # a remote DMA (has_communication) or a local one
  alias: bool = True  # the start aliases x to its first output
  donate: bool = False  # donate_argnums=(0,)
  out_hbm: bool = False  # the start's outputs typed pltpu.HBM
  in_hbm: bool = False  # x constrained to HBM at the start (and the done)
  side_effects: bool = True  # CompilerParams(has_side_effects=...)
  wait_alias: bool = True  # the wait kernel aliases the received buffer
  plus_one: bool = False  # return the received buffer + 1 (computed)
  xla: str = ""  # "ppermute" / "all_gather": XLA's own collective instead
  computed_x: bool = False  # the start sends 2 x (a computed source)
  wait_reads_x: bool = True  # without alias: the wait kernel takes x too


VARIANTS = {
  "local DMA, x aliased": Variant(remote=False),
  "local DMA, x aliased, donated": Variant(remote=False, donate=True),
  "local DMA, x not aliased": Variant(remote=False, alias=False),
  "remote DMA, x aliased (asyncops' start)": Variant(),
  "remote, x aliased, donated": Variant(donate=True),
  "remote, x not aliased (the done reads x)": Variant(alias=False),
  "remote, x not aliased, x pinned to HBM": Variant(alias=False, in_hbm=True),
  "remote, outputs typed HBM": Variant(out_hbm=True),
  "remote, x pinned to HBM": Variant(in_hbm=True),
  "remote, has_side_effects=False": Variant(side_effects=False),
  "remote, wait does not alias (wrong output)": Variant(wait_alias=False),
  "remote, received + 1 returned": Variant(plus_one=True),
  "jax.lax.ppermute returned": Variant(xla="ppermute"),
  "jax.lax.all_gather returned": Variant(xla="all_gather"),
}
# The rows of asyncops' own start: a copy the guard refuses is a finding.
CLEAN = (
  "remote DMA, x aliased (asyncops' start)",
  "remote, received + 1 returned",
)


def _start_kernel(v: Variant):
  def kernel(x_ref, *refs):
    y_ref, send, recv = refs[1:] if v.alias else refs
    if v.remote:
      me = jax.lax.axis_index("i")
      pltpu.make_async_remote_copy(
        x_ref,
        y_ref,
        send,
        recv,
        device_id=(jax.lax.rem(me + 1, 8),),
        device_id_type=pl.DeviceIdType.MESH,
      ).start()
    else:
      pltpu.make_async_copy(x_ref, y_ref, send).start()

  return kernel


def _wait_kernel(v: Variant):
  def kernel(*refs):
    # A wait that does not take x waits for the send on y (the same size).
    reads_x = v.alias or v.wait_reads_x
    x_ref, y_ref, send, recv, o_ref = refs if reads_x else refs[:1] + refs
    del o_ref
    pltpu.make_async_copy(x_ref, x_ref, send).wait()
    if v.remote:
      pltpu.make_async_copy(y_ref, y_ref, recv).wait()

  return kernel


def program(v: Variant):
  """The per-device function of variant ``v``."""
  ring = [(j, (j + 1) % 8) for j in range(8)]

  def f(x):
    if v.xla == "ppermute":
      return jax.lax.ppermute(x, "i", ring)
    if v.xla == "all_gather":
      return jax.lax.all_gather(x[: SHARD[0] // 8], "i", tiled=True)
    if v.computed_x:
      x = x * 2.0
    sd = jax.ShapeDtypeStruct(x.shape, x.dtype)
    out = pltpu.HBM(x.shape, x.dtype) if v.out_hbm else sd
    sem = pltpu.SemaphoreType.DMA(())
    shapes = ((out,) if v.alias else ()) + (out, sem, sem)
    pin = (
      (lambda a: pltpu.with_memory_space_constraint(a, pltpu.HBM))
      if v.in_hbm
      else (lambda a: a)
    )
    params = pltpu.CompilerParams(has_side_effects=v.side_effects)
    res = pl.pallas_call(
      _start_kernel(v),
      out_shape=shapes,
      in_specs=[_ANY],
      out_specs=(_ANY,) * (len(shapes) - 2) + (_SEM, _SEM),
      input_output_aliases={0: 0} if v.alias else {},
      compiler_params=params,
    )(pin(x))
    if v.alias:
      x, y, s, r = res
    else:
      (y, s, r), x = res, pin(x)
    ins = (x, y, s, r) if v.alias or v.wait_reads_x else (y, s, r)
    got = pl.pallas_call(
      _wait_kernel(v),
      out_shape=out,
      in_specs=[_ANY] * (len(ins) - 2) + [_SEM, _SEM],
      out_specs=_ANY,
      input_output_aliases={len(ins) - 3: 0} if v.wait_alias else {},
      compiler_params=params,
    )(*ins)
    return got + 1.0 if v.plus_one else got

  return f


def measure(topology: str, name: str, flags: dict) -> dict:
  v = VARIANTS[name]
  mesh = tpu_mesh(topology, (8,), ("i",))
  jitted = jax.jit(
    jax.shard_map(
      program(v), mesh=mesh, in_specs=P("i"), out_specs=P("i"), check_vma=False
    ),
    donate_argnums=(0,) if v.donate else (),
  )
  x = jax.ShapeDtypeStruct(
    (8 * SHARD[0], SHARD[1]), jnp.float32, sharding=NamedSharding(mesh, P("i"))
  )
  try:
    text = jitted.lower(x).compile(compiler_options=flags).as_text()
  except Exception as e:  # noqa: BLE001 - a variant XLA refuses is a result
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e)
    return {"topology": topology, "variant": name, "error": str(first)}
  report = analyze_module(parse_module(text), text)
  found = hazards(report)
  copies = [
    {
      "name": c.name,
      "kind": c.kind,
      "operand": c.operand,
      "spaces": list(c.spaces),
      "bytes": c.nbytes,
      "root": c.instr.is_root,
    }
    for c in report.copies
    if c.kind != "scalar"
  ]
  bad = copy_findings(
    report, found, lambda c: f"{c.spaces[0]}->{c.spaces[1]} {mib(c.nbytes)}"
  )
  promised = name in CLEAN
  return {
    "topology": topology,
    "variant": name,
    "copies": copies,
    "bytes": sum(c["bytes"] for c in copies),
    "hazards": [f"{h.kind} %{h.instr}" for h in found],
    "promised_clean": promised,
    "findings": [f"{name} on {topology}: {b}" for b in bad] if promised else [],
  }


def findings(rows) -> list[str]:
  """The findings of ``rows`` (see the module docstring); a row XLA
  refused to compile is one when it is a row of :data:`CLEAN`."""
  out = []
  for r in rows:
    if "error" in r and r["variant"] in CLEAN:
      out.append(f"{r['variant']} on {r['topology']}: refused: {r['error']}")
    out += r.get("findings", [])
  return out


def _cell(row: dict) -> str:
  if "error" in row:
    return f"refused: {row['error'][:80]}"
  if not row["copies"]:
    return "none"
  return "; ".join(
    f"{'ROOT ' if c['root'] else ''}%{c['name']} of %{c['operand']} "
    f"[{c['kind']}] {c['spaces'][0]}->{c['spaces'][1]} {mib(c['bytes'])}"
    for c in row["copies"]
  )


def _table(rows) -> str:
  out = ["| variant | topology | copies (non-scalar) | bytes |"]
  out.append("| --- | --- | --- | --- |")
  for r in rows:
    nbytes = mib(r["bytes"]) if "bytes" in r else "-"
    out.append(f"| {r['variant']} | {r['topology']} | {_cell(r)} | {nbytes} |")
  return "\n".join(out)


def _flags(items) -> dict:
  out = {}
  for item in items:
    name, eq, value = item.partition("=")
    if not eq or not name:
      raise _cli.UsageError(
        f"--xla-flag: expected NAME=VALUE, got {item!r} "
        "(e.g. --xla-flag xla_tpu_enable_copy_fusion=false)"
      )
    low = value.lower()
    out[name] = (
      low == "true" if low in ("true", "false") else _number(value) or value
    )
  return out


def _number(text: str):
  for kind in (int, float):
    try:
      return kind(text)
    except ValueError:
      continue
  return None


def main(argv=None) -> int:
  p = _cli.parser("python -m benchmarks.edge_copies", __doc__)
  p.add_argument(
    "--topology",
    default=",".join(TOPOLOGIES),
    help="comma-separated TPU topologies (default: %(default)s)",
  )
  p.add_argument(
    "--xla-flag",
    action="append",
    default=[],
    metavar="NAME=VALUE",
    help="an XLA option for every compile (repeatable)",
  )
  p.add_argument(
    "--variant",
    action="append",
    default=[],
    metavar="NAME",
    help="only this variant (repeatable; default: all): " + "; ".join(VARIANTS),
  )
  a = p.parse_args(argv)
  for n in a.variant:
    if n not in VARIANTS:
      raise _cli.UsageError(
        f"--variant: unknown variant {n!r}; choose from {'; '.join(VARIANTS)}"
      )
  topologies = [t for t in a.topology.split(",") if t]
  for t in topologies:
    _cli.check_topology(t)
  flags = _flags(a.xla_flag)
  jobs = [(n, t) for n in a.variant or VARIANTS for t in topologies]
  rows = [
    measure(t, n, flags)
    for n, t in _cli.progress(jobs, "edge_copies", unit="compile")
  ]
  _cli.write_json(a.json, rows)
  if not _cli.json_to_stdout(a.json):
    print(_table(rows))
  return _cli.print_findings(findings(rows), a.json)


if __name__ == "__main__":
  sys.exit(_cli.run(main, prog="python -m benchmarks.edge_copies"))
