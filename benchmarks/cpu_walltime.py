"""CPU wall time of the emulated asyncops variants vs the chapter's
``lax.ppermute`` collective matmul, on 8 CPU devices.

Usage::

  python -m benchmarks.cpu_walltime [--shape 512,1024,2048] [--repeats 20]

Every variant is compiled and warmed up twice; then ``--rounds`` rounds
each time every variant ``--repeats`` times, in a rotated order (so a busy
neighbour slows all variants alike, not one). The table gives the minimum
and the median over all timings and both ratios to the ``lax.ppermute``
version; on a shared machine the minimum is the robust figure. The
emulation runs both transfer points (``asyncops.emulation("start")`` and
``("done")``).

Exit status: 0 clean; 1 a finding: a variant whose result differs from
the ``lax.ppermute`` version's (rtol 1e-5, atol 1e-3), named on a
``finding:`` line and in the JSON's ``"findings"`` (the variant is still
timed); 2 a usage error. ``--json FILE`` writes the timings to FILE (the
table stays on stdout); ``--json`` alone or ``--json -`` prints them on
stdout (the table then on stderr).
"""

import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  os.environ["XLA_FLAGS"] = (
    _flags + " --xla_force_host_platform_device_count=8"
  ).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import asyncops  # noqa: E402
from asyncops import _cli  # noqa: E402
from benchmarks import _variants  # noqa: E402


def _once(fn, args) -> float:
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  return time.perf_counter() - t0


def main(argv=None) -> int:
  p = _cli.parser(
    "python -m benchmarks.cpu_walltime",
    __doc__.split("\n")[0],
    epilog=_cli.describe(__doc__.rsplit("\n\n", 1)[1]),
  )
  p.add_argument("--shape", default="512,1024,2048", help="B,D,F (global)")
  p.add_argument("--dtype", default="float32", help="(default: float32)")
  p.add_argument(
    "--repeats",
    type=_cli.positive_int,
    default=5,
    help="timings per variant per round (default: 5)",
  )
  p.add_argument(
    "--rounds",
    type=_cli.positive_int,
    default=6,
    help="interleaved rounds (default: 6)",
  )
  a = p.parse_args(argv)
  b, d, f = _cli.parse_ints(a.shape, 3, flag="--shape")
  if b % 2 or d % 8 or f % 8:
    raise _cli.UsageError(
      f"--shape: B must divide by 2 and D, F by 8 (a 2x4 mesh), got {a.shape}"
    )
  try:
    dtype = jnp.dtype(a.dtype)
  except TypeError:
    raise _cli.UsageError(f"--dtype: unknown dtype {a.dtype!r}") from None
  if not jnp.issubdtype(dtype, jnp.floating):
    raise _cli.UsageError(
      f"--dtype: expected a floating dtype (e.g. float32, bfloat16), got "
      f"{a.dtype!r}"
    )
  jax.config.update("jax_num_cpu_devices", 8)
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("x", "y"))
  key_a, key_w = jax.random.split(jax.random.key(0))
  lhs = jax.device_put(
    jax.random.normal(key_a, (b, d), dtype),
    NamedSharding(mesh, P("x", "y")),
  )
  rhs = jax.device_put(
    jax.random.normal(key_w, (d, f), dtype),
    NamedSharding(mesh, P(None, "y")),
  )
  names = [
    v
    for v in _variants.available() + _variants.library_ref()
    if v not in ("unsharded", "jit", "ppermute")
  ]
  ref = _variants.build("ppermute", mesh)
  expect = ref(lhs, rhs)
  # Each emulated variant is traced under its transfer point; the compiled
  # executable keeps it.
  runs = {("ppermute (lax)", "-"): ref}
  bad = []
  for v in _cli.progress(names, "compile"):
    for point in ("start", "done"):
      with asyncops.emulation(point):
        fn = _variants.build(v, mesh).trace(lhs, rhs).lower().compile()
      got = fn(lhs, rhs)
      try:
        np.testing.assert_allclose(got, expect, rtol=1e-5, atol=1e-3)
      except AssertionError:
        err = float(jnp.max(jnp.abs(got - expect)))
        bad.append(
          f"{v} (transfer point {point}) differs from lax.ppermute: max "
          f"|err| {err:.3g}"
        )
      runs[(v, point)] = fn
  times = {k: [] for k in runs}
  for fn in runs.values():
    for _ in range(2):
      jax.block_until_ready(fn(lhs, rhs))
  keys = list(runs)
  for r in _cli.progress(range(a.rounds), "time rounds"):
    order = keys[r % len(keys) :] + keys[: r % len(keys)]
    for k in order:
      times[k] += [_once(runs[k], (lhs, rhs)) for _ in range(a.repeats)]
  with _cli.human_output(a.json):
    _table(a, times, keys, (b, d, f), dtype)
  rows = [
    {"variant": v, "point": pt, "times_s": ts} for (v, pt), ts in times.items()
  ]
  _cli.write_json(
    a.json,
    {"shape": [b, d, f], "dtype": dtype.name, "rows": rows, "findings": bad},
    indent=None,
  )
  return _cli.print_findings(bad, a.json)


def _table(a, times, keys, shape, dtype) -> None:
  b, d, f = shape
  base = times[keys[0]]
  bmin, bmed = min(base), statistics.median(base)
  total = a.rounds * a.repeats
  print(f"# CPU wall time, 8 devices, (B, D, F) = {(b, d, f)} {dtype.name}")
  print(
    f"{total} timings per variant ({a.rounds} interleaved rounds of "
    f"{a.repeats}) after 2 warm-ups\n"
  )
  print(
    "| variant | transfer point | min (ms) | median (ms) | min / lax | "
    "median / lax |"
  )
  print("|---|---|---:|---:|---:|---:|")
  for (v, point), ts in times.items():
    tmin, tmed = min(ts), statistics.median(ts)
    print(
      f"| {v} | {point} | {tmin * 1e3:.2f} | {tmed * 1e3:.2f} | "
      f"{tmin / bmin:.3f} | {tmed / bmed:.3f} |"
    )


if __name__ == "__main__":
  sys.exit(_cli.run(main, prog="python -m benchmarks.cpu_walltime"))
