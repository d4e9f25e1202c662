"""Collective matmuls three ways: plain jit, the chapter's ppermute, asyncops.

Runs on 8 CPU devices (numerics) and, with ``--hlo``, compiles each version
ahead of time for a TPU topology and prints what overlaps::

  python examples/collective_matmul.py
  python examples/collective_matmul.py --hlo v5e:2x4

The chapter's shape (B, D, F) = (1024, 2048, 8192) on a 2x4 mesh: lhs
``A[B_X, D_Y]``, rhs ``W[D, F_Y]`` (all-gather), ``W2[F_Y, D]``
(reduce-scatter, all-reduce). The functions here are importable (the
benchmarks use them as baselines).
"""

import functools
import os
import sys

if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8"
  )
  sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from asyncops import _cli
from asyncops import _jax_compat as jc
from asyncops import collective_matmul as cm

AXIS = "y"
# variant -> (in_specs, out_spec, rhs shape as a function of (B, D, F)).
SPECS = {
  "allgather": ((P("x", "y"), P(None, "y")), P("x", "y")),
  "reducescatter": ((P("x", "y"), P("y", None)), P("x", "y")),
  "allreduce": ((P("x", "y"), P("y", None)), P("x", None)),
}


def shapes(variant, b, d, f):
  """Global (lhs, rhs) shapes of a variant at the chapter's (B, D, F)."""
  if variant == "allgather":
    return (b, d), (d, f)
  return (b, f), (f, d)


# 1. Plain XLA: a global matmul under jit; XLA picks the collectives.
def jit_matmul(lhs, rhs):
  return lhs @ rhs


# 2. The chapter's shard_map + lax.ppermute versions (blocking permutes;
#    XLA's scheduler decides what overlaps).
def chapter_allgather(lhs, rhs):
  n, me, k = jax.lax.axis_size(AXIS), jax.lax.axis_index(AXIS), lhs.shape[1]
  acc = jnp.zeros((lhs.shape[0], rhs.shape[1]), jnp.float32)
  for i in range(n):
    rows = jax.lax.dynamic_slice_in_dim(rhs, (me + i) % n * k, k)
    acc = acc + jnp.dot(lhs, rows, preferred_element_type=jnp.float32)
    if i < n - 1:
      perm = [(j, (j - 1) % n) for j in range(n)]
      lhs = jax.lax.ppermute(lhs, AXIS, perm)
  return acc.astype(lhs.dtype)


def chapter_reducescatter(lhs, rhs):
  n, me = jax.lax.axis_size(AXIS), jax.lax.axis_index(AXIS)
  c = rhs.shape[1] // n
  acc = None
  for s in range(n):
    cols = jax.lax.dynamic_slice_in_dim(rhs, (me - s - 1) % n * c, c, axis=1)
    y = jnp.dot(lhs, cols, preferred_element_type=lhs.dtype)
    if acc is None:
      acc = y
    else:
      acc = jax.lax.ppermute(acc, AXIS, [(j, (j + 1) % n) for j in range(n)])
      acc = acc + y
  return acc


def chapter_allreduce(lhs, rhs):
  block = chapter_reducescatter(lhs, rhs)
  return jc.all_gather_invariant(block, AXIS, axis=1, tiled=True)


CHAPTER = {
  "allgather": chapter_allgather,
  "reducescatter": chapter_reducescatter,
  "allreduce": chapter_allreduce,
}

# 3. asyncops: every ring transfer hides one chunk matmul, by construction.
ASYNCOPS = {
  "allgather": cm.allgather_matmul,
  "reducescatter": cm.matmul_reducescatter,
  "allreduce": cm.matmul_allreduce,
}


def programs(mesh, variant, *, bidirectional=False, api="value"):
  """The three jitted programs of a variant: name -> function."""
  in_specs, out_spec = SPECS[variant]

  def shmap(fn):
    return jax.jit(
      jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_spec)
    )

  # The ring (method="ring"); the default, "auto", may run XLA's
  # collective or the fused kernel instead.
  ours = functools.partial(
    ASYNCOPS[variant],
    axis_name=AXIS,
    bidirectional=bidirectional,
    api=api,
    method="ring",
  )
  return {
    "jit": jax.jit(jit_matmul, out_shardings=NamedSharding(mesh, out_spec)),
    "chapter": shmap(CHAPTER[variant]),
    "asyncops": shmap(ours),
  }


def run_cpu(b, d, f) -> list[dict]:
  rows = []
  mesh = jax.make_mesh(
    (2, 4), ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2
  )
  for variant in _cli.progress(list(SPECS), "numerics"):
    (in_specs, _), (ls, rs) = SPECS[variant], shapes(variant, b, d, f)
    lhs = jax.random.randint(jax.random.key(0), ls, -2, 3).astype(jnp.float32)
    rhs = jax.random.randint(jax.random.key(1), rs, -2, 3).astype(jnp.float32)
    lhs = jax.device_put(lhs, NamedSharding(mesh, in_specs[0]))
    rhs = jax.device_put(rhs, NamedSharding(mesh, in_specs[1]))
    want = np.asarray(lhs) @ np.asarray(rhs)
    for bidi in (False, True):
      for name, fn in programs(mesh, variant, bidirectional=bidi).items():
        if bidi and name != "asyncops":
          continue
        got = np.asarray(fn(lhs, rhs))
        ok = np.array_equal(got, want)
        tag = f"{name}{' (bidirectional)' if bidi else ''}"
        print(f"{variant:14s} {tag:26s} exact={ok}")
        rows.append({"variant": variant, "program": tag, "exact": bool(ok)})
  return rows


def run_hlo(topology, b, d, f) -> list[dict]:
  from asyncops.inspect import analyze, tpu_mesh

  mesh = tpu_mesh(topology, (2, 4), ("x", "y"))
  print(
    f"{'variant':14s} {'program':22s} {'windows':>7s} {'overlapped':>10s}"
    f" {'defensive':>9s} {'sum est. cycles*':>16s}"
  )
  rows = []
  for variant in _cli.progress(list(SPECS), f"compile for {topology}"):
    (in_specs, _), (ls, rs) = SPECS[variant], shapes(variant, b, d, f)
    args = [
      jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=NamedSharding(mesh, sp))
      for s, sp in zip((ls, rs), in_specs, strict=True)
    ]
    for bidi in (False, True):
      for name, fn in programs(mesh, variant, bidirectional=bidi).items():
        if bidi and name != "asyncops":
          continue
        r = analyze(fn, *args)
        pairs = r.pairs_for("asyncops.ppermute") + r.pairs_for(
          "asyncops.bidirectional"
        )
        cycles = sum(
          i.estimated_cycles or 0
          for c, instrs in r.schedule.items()
          if not c.startswith("fused")
          for i in instrs
        )
        tag = name + ("/bidi" if bidi else "")
        print(
          f"{variant:14s} {tag:22s} {len(pairs):7d} "
          f"{sum(p.overlapped for p in pairs):10d} "
          f"{len(r.defensive_copies):9d} {cycles:16.0f}"
        )
        rows.append(
          dict(
            variant=variant,
            program=tag,
            windows=len(pairs),
            overlapped=sum(p.overlapped for p in pairs),
            defensive=len(r.defensive_copies),
            inflight=len(r.inflight_copies),
            est_cycles=cycles,
          )
        )

  print(
    "* sum of XLA's per-instruction cycle estimates of the entry schedule: "
    "compute only, transfers not timed (see benchmarks/ for step times)."
  )
  return rows


def main(argv=None) -> int:
  p = _cli.parser(
    "python examples/collective_matmul.py", __doc__.splitlines()[0]
  )
  p.add_argument("--hlo", metavar="TOPOLOGY", help="e.g. v5e:2x4")
  p.add_argument("--shape", default="1024,2048,8192", help="B,D,F")
  args = p.parse_args(argv)
  b, d, f = _cli.parse_ints(args.shape, 3, flag="--shape")
  if b % 2 or d % 8 or f % 8:
    raise _cli.UsageError(
      f"--shape: B must divide by 2 and D, F by 8 (a 2x4 mesh), "
      f"got {args.shape}"
    )
  if args.hlo:
    _cli.check_topology(args.hlo, flag="--hlo")
  with _cli.human_output(args.json):
    rows = run_hlo(args.hlo, b, d, f) if args.hlo else run_cpu(b, d, f)
  if args.hlo:
    # Findings are about asyncops' programs; the baselines are references.
    bad = [
      r
      for r in rows
      if r["program"].startswith("asyncops")
      and (r["defensive"] or r["inflight"])
    ]
  else:
    bad = [r for r in rows if not r["exact"]]
  _cli.write_json(args.json, {"rows": rows, "findings": bad})
  return _cli.print_findings([str(r) for r in bad], args.json)


if __name__ == "__main__":
  sys.exit(_cli.run(main, prog="python examples/collective_matmul.py"))
