"""CPU wall time of the emulated asyncops variants vs the chapter's
``lax.ppermute`` collective matmul, on 8 CPU devices.

Usage::

  python -m benchmarks.cpu_walltime [--shape 512,1024,2048] [--repeats 20]

Each variant is compiled, warmed up twice, then timed ``--repeats`` times
(``block_until_ready``); the table gives the median and the ratio to the
``lax.ppermute`` version. The emulation runs both transfer points
(``asyncops.emulation("start")`` and ``("done")``).
"""

import argparse
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
from benchmarks import _variants  # noqa: E402


def _time(fn, args, repeats: int) -> float:
  for _ in range(2):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--shape", default="512,1024,2048", help="B,D,F (global)")
  p.add_argument("--dtype", default="float32")
  p.add_argument("--repeats", type=int, default=20)
  a = p.parse_args(argv)
  jax.config.update("jax_num_cpu_devices", 8)
  b, d, f = (int(s) for s in a.shape.split(","))
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("x", "y"))
  key_a, key_w = jax.random.split(jax.random.key(0))
  dtype = jnp.dtype(a.dtype)
  lhs = jax.device_put(
    jax.random.normal(key_a, (b, d), dtype),
    NamedSharding(mesh, P("x", "y")),
  )
  rhs = jax.device_put(
    jax.random.normal(key_w, (d, f), dtype),
    NamedSharding(mesh, P(None, "y")),
  )
  names = [v for v in _variants.available() if v not in ("unsharded", "jit")]
  ref = _variants.build("ppermute", mesh)
  expect = ref(lhs, rhs)
  base = _time(ref, (lhs, rhs), a.repeats)
  print(f"# CPU wall time, 8 devices, (B, D, F) = {(b, d, f)} {dtype.name}")
  print(f"median of {a.repeats} after 2 warm-ups\n")
  print("| variant | transfer point | median (ms) | / lax.ppermute |")
  print("|---|---|---:|---:|")
  print(f"| ppermute (lax) | - | {base * 1e3:.2f} | 1.000 |")
  for v in names:
    if v == "ppermute":
      continue
    for point in ("start", "done"):
      with asyncops.emulation(point):
        fn = _variants.build(v, mesh)
        got = fn(lhs, rhs)
        np.testing.assert_allclose(got, expect, rtol=1e-5, atol=1e-3)
        t = _time(fn, (lhs, rhs), a.repeats)
      print(f"| {v} | {point} | {t * 1e3:.2f} | {t / base:.3f} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
