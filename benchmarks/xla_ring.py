"""XLA's flagged all-gather decompositions emitted with ``jax.lax``
(``asyncops.collective_matmul._xla_ring``), modelled beside ``xla_best``.

Registers the variants ``xla_ring<d>_<acc>`` (``d`` 1: XLA's unrolled
windowed einsum, 2: its ``post_spmd`` collective matmul; ``acc``
``float32``, the library's accumulator, or ``output``, XLA's) and prints
one row per variant at a Llama-3-70B MLP shard point (D 8192, F 28672,
``M`` tokens per device) or the chapter's shape (``--m chapter``).

Usage::

  python -m benchmarks.xla_ring --topology v5e:2x4 --tp 4 --m 4096 \\
    [--variants xla_ring1_float32,...] [--dtype float32]
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from benchmarks import _measure, _variants, xla_configs

LLAMA_D, LLAMA_F = 8192, 28672
VARIANTS = tuple(
  f"xla_ring{d}_{acc}" for d in (1, 2) for acc in ("float32", "output")
)


def _build(d, acc, mesh, precision):
  from asyncops.collective_matmul import _xla_ring  # noqa: PLC0415

  n = mesh.shape["y"]

  def fn(a, w):
    with jax.default_matmul_precision(precision or "default"):
      return _xla_ring.allgather(a, w, "y", n, directions=d, acc=acc)

  spec = (P("x", "y"), P(None, "y"))
  return jax.jit(
    jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=P("x", "y"))
  )


def _args(mesh, shape, dtype):
  return _variants.abstract_args("jit", mesh, shape, dtype)


for _name in VARIANTS:
  _d, _acc = int(_name[8]), _name.rpartition("_")[2]
  _variants.register(_name, functools.partial(_build, _d, _acc), _args)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m benchmarks.xla_ring")
  p.add_argument("--topology", default="v5e:2x4")
  p.add_argument("--tp", default="4", help="ring size, or 'mesh'")
  p.add_argument("--m", default="4096", help="tokens per device, or chapter")
  p.add_argument("--variants", default=",".join(VARIANTS))
  p.add_argument(
    "--xla-config",
    default=None,
    help="also model jit with this xla_configs.CONFIGS entry",
  )
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument(
    "--x-input",
    default="parameter",
    choices=_variants.X_INPUTS,
    help="how x enters every program (benchmarks.run --x-input)",
  )
  a = p.parse_args(argv)
  _variants.X_INPUT = a.x_input
  tp = None if a.tp == "mesh" else int(a.tp)
  mesh = _measure.mesh_for(a.topology, "ring", tp)
  if a.m == "chapter":
    shape = (1024, 2048, 8192)
  else:
    shape = (int(a.m) * mesh.shape["x"], LLAMA_D, LLAMA_F)
  dtype = jnp.dtype(a.dtype)
  runs = [(v, {}) for v in a.variants.split(",") if v]
  if a.xla_config:
    runs.append(("jit", xla_configs.CONFIGS[a.xla_config]))
  for v, opts in runs:
    spec = _measure.Spec(v, a.topology, tp, shape, dtype, options=opts)
    row = _measure.measure(spec).row
    print(
      f"{a.topology} tp {tp or 'mesh'} {shape} {dtype.name} {v}"
      f"{' ' + a.xla_config if opts else ''}: step {row['step_us']:.1f} us, "
      f"exposed {row['exposed_us']:.1f}, peak temp "
      f"{row['peak_temp_mib']:.1f} MiB, copies {row['defensive_copies']}",
      flush=True,
    )
  return 0


if __name__ == "__main__":
  sys.exit(main())
