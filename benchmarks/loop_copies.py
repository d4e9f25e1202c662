"""Copies in loops that carry futures, and what the copy guard costs.

Usage::

  python -m benchmarks.loop_copies [--topology v5e:2x4,v4:2x2x1,...]
      [--programs accumulate,two_rings,matmul] [--loops lax,scheduling]
      [--json [FILE]]

Compiles each program ahead of time for each topology twice: with
``jax.lax.fori_loop(..., unroll=2)`` (what the seed design suggests) and
with ``asyncops.scheduling.fori_loop``, then prints one markdown table:
copies by kind, the bytes the ``boundary`` copies move per call (each read
and written once), copies of a buffer in flight, the copy guard's hazards,
the compile time and the guard's time on the compiled HLO text (what
``asyncops.jit`` adds to a TPU compile).

The ``jax.lax.fori_loop`` rows show the seed design's copies for
comparison (defensive copies and copies of buffers in flight are expected
there). Exit status: 0 clean; 1 a finding: a defensive copy, a copy of a
buffer in flight or a copy-guard hazard in a ``scheduling.fori_loop`` row
(the library's loop promises none; ``boundary``, ``memory_space`` and
``layout`` copies are no finding); 2 a usage error.
"""

import functools
import sys
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import asyncops
from asyncops import _cli
from asyncops.inspect import (
  analyze_module,
  compile_tpu,
  hazards,
  parse_module,
  tpu_mesh,
)
from benchmarks._findings import copy_findings

TOPOLOGIES = ("v5e:2x4", "v4:2x2x1", "v6e:2x4", "v5p:2x2x2")
SHARD = (1024, 1024)  # f32 per device
KC = 128


def _start(x, axis="y"):
  return asyncops.ppermute_start(x, axis, shift=1)


def accumulate(loop):
  """The seed design's accumulate loop (6 trips)."""

  def f(x):
    out = jnp.zeros_like(x)
    x, fut = _start(x)
    out = out + x

    def body(i, carry):
      out, fut = carry
      x, fut = _start(asyncops.ppermute_done(fut))
      return out + x, fut

    out, fut = loop(0, 6, body, (out, fut))
    return out, asyncops.ppermute_done(fut)

  return f, 1


def two_rings(loop):
  """Two futures carried at once, on both mesh axes."""

  def f(x):
    a, fa = _start(x)
    b, fb = _start(x * 3.0, "x")
    acc = a + b

    def body(i, carry):
      acc, fa, fb = carry
      a, fa = _start(asyncops.ppermute_done(fa))
      b, fb = _start(asyncops.ppermute_done(fb), "x")
      return acc + a * b, fa, fb

    acc, fa, fb = loop(0, 6, body, (acc, fa, fb))
    return acc + asyncops.ppermute_done(fa) + asyncops.ppermute_done(fb)

  return f, 1


def matmul(loop):
  """A user's collective matmul: done, start, ``acc + x @ w_rows`` (6 trips)."""

  def f(x, w):
    me = jax.lax.axis_index("y")
    rows = lambda j: jax.lax.dynamic_slice_in_dim(w, j * KC, KC, 0)  # noqa: E731
    x, fut = _start(x)
    acc = x @ rows(me)

    def body(i, carry):
      acc, fut = carry
      x, fut = _start(asyncops.ppermute_done(fut))
      return acc + x @ rows((me - i - 1) % 4), fut

    acc, fut = loop(0, 6, body, (acc, fut))
    return acc + asyncops.ppermute_done(fut) @ rows((me - 7) % 4)

  return f, 2


PROGRAMS = {"accumulate": accumulate, "two_rings": two_rings, "matmul": matmul}
LOOPS = {
  "jax.lax.fori_loop(unroll=2)": functools.partial(jax.lax.fori_loop, unroll=2),
  "scheduling.fori_loop": asyncops.scheduling.fori_loop,
}
# --loops' short names.
LOOP_NAMES = {
  "lax": "jax.lax.fori_loop(unroll=2)",
  "scheduling": "scheduling.fori_loop",
}
# The loops that promise no defensive and no in-flight copy.
CLEAN = ("scheduling.fori_loop",)


def _args(mesh, name):
  spec = P(("x", "y"))
  if name != "matmul":
    shape = (8 * SHARD[0], SHARD[1])
    return (
      jax.ShapeDtypeStruct(
        shape, jnp.float32, sharding=NamedSharding(mesh, spec)
      ),
    )
  x = jax.ShapeDtypeStruct(
    (8 * SHARD[0], KC), jnp.float32, sharding=NamedSharding(mesh, spec)
  )
  w = jax.ShapeDtypeStruct(
    (4 * KC, 512), jnp.float32, sharding=NamedSharding(mesh, P())
  )
  return x, w


def measure(topology: str, name: str, loop_name: str) -> dict:
  mesh = tpu_mesh(topology, (2, 4), ("x", "y"))
  f, nargs = PROGRAMS[name](LOOPS[loop_name])
  nout = 2 if name == "accumulate" else 1
  spec = P(("x", "y"))
  jitted = jax.jit(
    jax.shard_map(
      f,
      mesh=mesh,
      in_specs=(spec, P()) if nargs == 2 else spec,
      out_specs=(spec,) * nout if nout > 1 else spec,
    )
  )
  compiled, seconds = compile_tpu(jitted, *_args(mesh, name))
  t0 = time.perf_counter()
  text = compiled.as_text()
  report = analyze_module(parse_module(text), text)
  found = hazards(report)
  check = time.perf_counter() - t0
  kinds = {}
  for c in report.copies:
    kinds[c.kind] = kinds.get(c.kind, 0) + 1
  bad = copy_findings(report, found, lambda c: f"in %{c.computation}")
  where = f"{name} on {topology} with {loop_name}"
  return {
    "topology": topology,
    "program": name,
    "loop": loop_name,
    "copies": kinds,
    "boundary_bytes": report.copied_bytes("boundary"),
    "in_flight": len(report.inflight_copies),
    "hazards": len(found),
    "compile_s": round(seconds, 2),
    "check_s": round(check, 3),
    "promised_clean": loop_name in CLEAN,
    "findings": [f"{where}: {b}" for b in bad] if loop_name in CLEAN else [],
  }


def _table(rows) -> str:
  kinds = ("defensive", "layout", "boundary", "memory_space")
  head = (
    "| program | topology | loop | "
    + " | ".join(kinds)
    + " | boundary MiB | in flight | hazards | compile s | guard s |"
  )
  out = [head, "|" + " --- |" * (head.count("|") - 1)]
  for r in rows:
    cells = [r["program"], r["topology"], r["loop"]]
    cells += [str(r["copies"].get(k, 0)) for k in kinds]
    cells += [f"{r['boundary_bytes'] / 2**20:g}"]
    cells += [str(r["in_flight"]), str(r["hazards"])]
    cells += [f"{r['compile_s']:.2f}", f"{r['check_s']:.3f}"]
    out.append("| " + " | ".join(cells) + " |")
  return "\n".join(out)


def main(argv=None) -> int:
  p = _cli.parser("python -m benchmarks.loop_copies", __doc__)
  p.add_argument(
    "--topology",
    default=",".join(TOPOLOGIES),
    help="comma-separated TPU topologies (default: %(default)s)",
  )
  p.add_argument(
    "--programs",
    default=",".join(PROGRAMS),
    help="comma-separated programs (default: %(default)s)",
  )
  p.add_argument(
    "--loops",
    default=",".join(LOOP_NAMES),
    help="comma-separated loops: lax (jax.lax.fori_loop(unroll=2)), "
    "scheduling (asyncops.scheduling.fori_loop) (default: %(default)s)",
  )
  a = p.parse_args(argv)
  topologies = [t for t in a.topology.split(",") if t]
  names = [n for n in a.programs.split(",") if n]
  for n in names:
    if n not in PROGRAMS:
      p.error(
        f"--programs: unknown program {n!r}; choose from {', '.join(PROGRAMS)}"
      )
  loops = [lp for lp in a.loops.split(",") if lp]
  for lp in loops:
    if lp not in LOOP_NAMES:
      p.error(
        f"--loops: unknown loop {lp!r}; choose from {', '.join(LOOP_NAMES)}"
      )
  for t in topologies:
    _cli.check_topology(t)
  jobs = [
    (t, n, lp)
    for n in names
    for t in topologies
    for lp in LOOPS
    if lp in {LOOP_NAMES[k] for k in loops}
  ]
  rows = [
    measure(t, n, lp)
    for t, n, lp in _cli.progress(jobs, "loop_copies", unit="compile")
  ]
  _cli.write_json(a.json, rows)
  if not _cli.json_to_stdout(a.json):
    print(_table(rows))
  return _cli.print_findings([f for r in rows for f in r["findings"]], a.json)


if __name__ == "__main__":
  sys.exit(_cli.run(main, prog="python -m benchmarks.loop_copies"))
