"""asyncops demo: overlapped collectives on CPU, proven on compiled TPU HLO.

Sections (one function each):

1. ``ring_numerics``: an overlapped ring permute on 8 CPU devices, checked
   against ``jax.lax.ppermute`` at both emulation transfer points.
2. ``ring_on_tpu``: the same program compiled ahead of time for TPU
   ``v5e:2x4``; the inspection harness shows the start/done pairs and what
   the schedule put between them.
3. ``flagship_numerics``: the all-gather collective matmul at the chapter's
   shape (B, D, F) = (1024, 2048, 8192) on a 2x4 CPU mesh, value and Ref
   APIs, against ``jnp.dot``.
4. ``flagship_on_tpu``: its TPU compile with the inspection report: zero
   defensive and in-flight copies, every chunk matmul inside its window.
5. ``value_versus_ref``: the two APIs on the same patterns.
6. ``timeline``: modelled v5e step times (XLA's cost model + ICI
   bandwidth) against ``jax.jit`` and the chapter's ``lax.ppermute``
   version, and the flagship's timeline picture.

Run with ``make demo`` (no TPU needed).

Exit status: 0 when every section's check holds; 1 a finding: a section
whose check fails (numerics differ from JAX's, a copy or an empty window
in the TPU HLO), named on a ``finding:`` line and in the JSON's
``"findings"``; 2 a usage error.
"""

import os
import pathlib
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
if "xla_force_host_platform_device_count" not in os.environ.get(
  "XLA_FLAGS", ""
):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8"
  )

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import asyncops  # noqa: E402
from asyncops import _cli, inspect  # noqa: E402
from asyncops import collective_matmul as cm  # noqa: E402
from asyncops.futures import check_futures  # noqa: E402

N = 8
STEPS = N - 1
B, D, F = 1024, 2048, 8192  # the chapter's collective matmul shape
OUT = ROOT / "out" / "demo"


def section(title: str) -> None:
  print(f"\n== {title} ==", flush=True)


# 1-2. A ring of matmuls while the next shard travels -------------------------


def ring(x, w):
  """Accumulates ``x_j @ w`` over every shard ``x_j`` of the ring.

  The next shard travels while the current one is multiplied: the staggered
  pipeline of the design, written with the scheduling helper.
  """

  def compute(i, x, acc):
    del i
    return acc + x @ w

  acc0 = jnp.zeros((x.shape[0], w.shape[1]), x.dtype)
  y, acc = asyncops.scheduling.staggered(
    STEPS,
    lambda x: asyncops.ppermute_start(x, "i", shift=1),
    compute,
    x,
    acc0,
  )
  return acc + y @ w


def ring_reference(x, w):
  acc = jnp.zeros((x.shape[0], w.shape[1]), x.dtype)
  for _ in range(N):
    acc = acc + x @ w
    x = jax.lax.ppermute(x, "i", [(j, (j + 1) % N) for j in range(N)])
  return acc


def ring_program(mesh, fn):
  return jax.jit(
    jax.shard_map(fn, mesh=mesh, in_specs=(P("i"), P()), out_specs=P("i"))
  )


def ring_numerics() -> None:
  section("1. overlapped ring permute on 8 CPU devices")
  mesh = jax.make_mesh((N,), ("i",))
  rng = np.random.default_rng(0)
  x = jax.device_put(
    jnp.asarray(rng.integers(-4, 4, (N * 8, 128)), jnp.float32),
    NamedSharding(mesh, P("i")),
  )
  w = jax.device_put(
    jnp.asarray(rng.integers(-4, 4, (128, 128)), jnp.float32),
    NamedSharding(mesh, P()),
  )
  ref = ring_program(mesh, ring_reference)(x, w)
  check_futures(ring_program(mesh, ring), x, w)
  print("   check_futures: every start is awaited exactly once")
  for mode in ("start", "done"):
    with asyncops.emulation(mode):
      got = ring_program(mesh, ring)(x, w)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    print(f"   emulation transfer={mode!r}: equal to the lax.ppermute ring  OK")


def print_pairs(report, limit: int = 8) -> None:
  kernel_pairs = [p for p in report.pairs if p.kind == "kernel"]
  for p in kernel_pairs[:limit]:
    work = [
      i.name
      for i in p.between
      if i.opcode in ("fusion", "convolution", "dot", "custom-call")
    ]
    print(
      f"   {p.start} -> {p.done}: {len(work)} compute op(s), "
      f"{p.between_cycles:,.0f} est. cycles inside"
      + ("" if p.overlapped else "  (NOT overlapped)")
    )
  if len(kernel_pairs) > limit:
    print(f"   ... and {len(kernel_pairs) - limit} more pairs")


def print_verdict(report) -> None:
  print(
    f"   defensive copies: {len(report.defensive_copies)}, copies of "
    f"in-flight buffers: {len(report.inflight_copies)}, compiled in "
    f"{report.compile_seconds:.1f}s"
  )
  report.assert_no_defensive_copies()
  report.assert_no_inflight_copies()
  report.assert_overlapped()
  print("   => no defensive copy, nothing copied in flight, all overlapped")


def ring_on_tpu(topology: str = "v5e:2x4") -> None:
  section(f"2. the same ring compiled for TPU {topology} (ahead of time)")
  mesh = inspect.tpu_mesh(topology, (N,), ("i",))
  x = jax.ShapeDtypeStruct(
    (N * 1024, 1024), jnp.float32, sharding=NamedSharding(mesh, P("i"))
  )
  w = jax.ShapeDtypeStruct(
    (1024, 1024), jnp.float32, sharding=NamedSharding(mesh, P())
  )
  report = inspect.analyze(ring_program(mesh, ring), x, w)
  print_pairs(report)
  print_verdict(report)


# 3-4. The flagship: the all-gather collective matmul ------------------------


def matmul_program(mesh, **kw):
  def body(lhs, rhs):
    # The ring of start/done futures (the default, method="auto", may
    # run XLA's collective or the fused kernel instead).
    return cm.allgather_matmul(lhs, rhs, "y", **{"method": "ring", **kw})

  return jax.jit(
    jax.shard_map(
      body,
      mesh=mesh,
      in_specs=(P("x", "y"), P(None, "y")),
      out_specs=P("x", "y"),
    )
  )


def flagship_numerics() -> None:
  section(
    f"3. all-gather collective matmul, (B, D, F) = ({B}, {D}, {F}), "
    "2x4 CPU mesh"
  )
  mesh = jax.make_mesh(
    (2, 4), ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2
  )
  rng = np.random.default_rng(1)
  # Small integers in f32: every partial sum is exact, so any summation
  # order gives the same bits.
  a = rng.integers(-3, 4, (B, D)).astype(np.float32)
  w = rng.integers(-3, 4, (D, F)).astype(np.float32)
  want = a @ w
  lhs = jax.device_put(a, NamedSharding(mesh, P("x", "y")))
  rhs = jax.device_put(w, NamedSharding(mesh, P(None, "y")))
  for kw in (
    {"api": "value"},
    {"api": "value", "bidirectional": True},
    {"api": "ref"},
  ):
    for mode in ("start", "done"):
      with asyncops.emulation(mode):
        t0 = time.perf_counter()
        got = np.asarray(matmul_program(mesh, **kw)(lhs, rhs))
        dt = time.perf_counter() - t0
      np.testing.assert_array_equal(got, want)
      print(f"   {kw} transfer={mode!r}: equal to A @ W  OK ({dt:.1f}s)")


def flagship_on_tpu(topology: str = "v5e:2x4") -> None:
  section(f"4. all-gather collective matmul compiled for TPU {topology}")
  mesh = inspect.tpu_mesh(topology, (2, 4), ("x", "y"))
  lhs = jax.ShapeDtypeStruct(
    (B, D), jnp.bfloat16, sharding=NamedSharding(mesh, P("x", "y"))
  )
  rhs = jax.ShapeDtypeStruct(
    (D, F), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "y"))
  )
  report = inspect.analyze(matmul_program(mesh), lhs, rhs)
  print_pairs(report)
  print_verdict(report)


# 5. Value API versus Ref API ------------------------------------------------


def value_versus_ref() -> None:
  section("5. value API versus Ref API on the same patterns (v5e:2x4)")
  from asyncops.compare import _table  # noqa: PLC0415

  print(_table.format_table("v5e:2x4", _table.rows("v5e:2x4")))


# 6. Modelled timeline -------------------------------------------------------


def timeline(topology: str = "v5e:2x4") -> None:
  section(f"6. modelled step time on {topology} at the chapter's shape")
  from benchmarks import _chips, _trace, run  # noqa: PLC0415

  chip = _chips.chip_for(topology)
  mesh = run.make_mesh(topology)
  png = OUT / "allgather_matmul.png"
  # int32 is what the chapter measured (its arrays come from jnp.arange);
  # bf16 is what a transformer would use.
  for dtype, variants in (
    ("int32", ("unsharded", "jit", "ppermute", "allgather_matmul")),
    ("bfloat16", ("unsharded", "jit", "ppermute", "allgather_matmul_bidi")),
  ):
    rows = []
    for variant in variants:
      row, tl = run.measure(
        variant, mesh, (B, D, F), run.parse_config(dtype), chip
      )
      rows.append(row)
      if variant == "allgather_matmul":
        _trace.write(tl, OUT, variant, f"{variant} {dtype} {topology}")
    print(f"\n   {dtype}:\n{run.table(rows, rows[0]['step_us'])}")
  print(
    "\n   chapter, measured on a real v5e-8 (int32): jit 311 us, "
    "lax.ppermute 244 us, unsharded 224 us"
  )
  print(f"   timeline picture: {png} (Perfetto trace beside it)")


SECTIONS = (
  "ring_numerics",
  "ring_on_tpu",
  "flagship_numerics",
  "flagship_on_tpu",
  "value_versus_ref",
  "timeline",
)


def main(argv=None) -> int:
  p = _cli.parser("python examples/demo.py", __doc__.split("\n")[0])
  p.add_argument(
    "--sections",
    default=",".join(SECTIONS),
    help="comma list of sections to run (default: all, in order)",
  )
  a = p.parse_args(argv)
  names = [s for s in a.sections.split(",") if s]
  for s in names:
    if s not in SECTIONS:
      raise _cli.UsageError(
        f"--sections: unknown section {s!r}; choose from {', '.join(SECTIONS)}"
      )
  bad = []
  with _cli.human_output(a.json):
    for s in _cli.progress(names, "demo", unit="section"):
      try:
        globals()[s]()
      except AssertionError as e:
        first = str(e).strip().splitlines() or ["AssertionError"]
        bad.append(f"{s}: {first[0]}")
  _cli.write_json(a.json, {"sections": names, "ok": not bad, "findings": bad})
  return _cli.print_findings(bad, a.json)


if __name__ == "__main__":
  sys.exit(_cli.run(main, prog="python examples/demo.py"))
