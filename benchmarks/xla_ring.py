"""XLA's flagged all-gather decompositions emitted with ``jax.lax``
(``asyncops.collective_matmul._xla_ring``), modelled beside ``xla_best``.

Registers the variants ``xla_ring<d>_<acc>`` (``d`` 1: XLA's unrolled
windowed einsum, 2: its ``post_spmd`` collective matmul; ``acc``
``float32``, the library's accumulator, or ``output``, XLA's) and prints
one row per variant at a Llama-3-70B MLP shard point (D 8192, F 28672,
``M`` tokens per device) or the chapter's shape (``--m chapter``).

Usage::

  python -m benchmarks.xla_ring --topology v5e:2x4 --tp 4 --m 4096 \\
    [--variants xla_ring1_float32,...] [--dtype float32] [--json [FILE]]

Exit status: 0, or 2 for a usage error (one line on stderr): a table of
modelled step times has no findings (exit 1 is never used). ``--json
FILE`` writes the rows to FILE (the lines stay on stdout); ``--json``
alone or ``--json -`` prints them on stdout (the lines then on stderr).
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from asyncops import _cli
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


PROG = "python -m benchmarks.xla_ring"


def _mesh(topology: str, tp_text: str):
  """``(tp, mesh)`` for ``--tp`` (an integer or ``mesh``), or a
  UsageError."""
  if tp_text == "mesh":
    tp = None
  else:
    try:
      tp = _cli.positive_int(tp_text)
    except argparse.ArgumentTypeError:
      raise _cli.UsageError(
        f"--tp: expected a positive integer or 'mesh', got {tp_text!r}"
      ) from None
  try:
    return tp, _measure.mesh_for(topology, "ring", tp)
  except ValueError as e:
    raise _cli.UsageError(f"--tp: {e}") from None


def main(argv=None) -> int:
  """Runs the command line; returns the exit status."""
  p = _cli.parser(PROG, __doc__)
  p.add_argument(
    "--topology", default="v5e:2x4", help="TPU topology (default: v5e:2x4)"
  )
  p.add_argument("--tp", default="4", help="ring size, or 'mesh' (default: 4)")
  p.add_argument(
    "--m",
    default="4096",
    help="tokens per device, or 'chapter' for (1024, 2048, 8192) "
    "(default: 4096)",
  )
  p.add_argument(
    "--variants",
    default=",".join(VARIANTS),
    help="comma list (default: %(default)s)",
  )
  p.add_argument(
    "--xla-config",
    default=None,
    choices=list(xla_configs.CONFIGS),
    metavar="CONFIG",
    help="also model jit with this xla_configs.CONFIGS entry: "
    + ", ".join(xla_configs.CONFIGS),
  )
  p.add_argument("--dtype", default="bfloat16", help="(default: bfloat16)")
  p.add_argument(
    "--x-input",
    default="parameter",
    choices=_variants.X_INPUTS,
    help="how x enters every program (benchmarks.run --x-input)",
  )
  a = p.parse_args(argv)
  known = _variants.available()
  variants = [v for v in a.variants.split(",") if v]
  for v in variants:
    if v not in known:
      raise _cli.UsageError(
        f"--variants: unknown variant {v!r}; choose from {', '.join(known)}"
      )
  if not variants and not a.xla_config:
    raise _cli.UsageError("--variants: empty; name at least one variant")
  try:
    dtype = jnp.dtype(a.dtype)
  except TypeError:
    raise _cli.UsageError(
      f"--dtype: unknown dtype {a.dtype!r} (e.g. bfloat16, float32)"
    ) from None
  if a.m != "chapter":
    try:
      m = _cli.positive_int(a.m)
    except argparse.ArgumentTypeError:
      raise _cli.UsageError(
        f"--m: expected a positive integer or 'chapter', got {a.m!r}"
      ) from None
  _cli.check_topology(a.topology)
  _variants.X_INPUT = a.x_input
  tp, mesh = _mesh(a.topology, a.tp)
  if a.m == "chapter":
    shape = (1024, 2048, 8192)
  else:
    shape = (m * mesh.shape["x"], LLAMA_D, LLAMA_F)
  runs = [(v, {}) for v in variants]
  if a.xla_config:
    runs.append(("jit", xla_configs.CONFIGS[a.xla_config]))
  rows = []
  with _cli.human_output(a.json):
    for v, opts in _cli.progress(runs, "xla_ring", unit="variant"):
      spec = _measure.Spec(v, a.topology, tp, shape, dtype, options=opts)
      row = _measure.measure(spec).row
      rows.append(dict(row, xla_config=a.xla_config if opts else None))
      print(
        f"{a.topology} tp {tp or 'mesh'} {shape} {dtype.name} {v}"
        f"{' ' + a.xla_config if opts else ''}: step "
        f"{row['step_us']:.1f} us, exposed {row['exposed_us']:.1f}, peak "
        f"temp {row['peak_temp_mib']:.1f} MiB, copies "
        f"{row['defensive_copies']}",
        flush=True,
      )
  _cli.write_json(a.json, rows)
  return _cli.EXIT_OK


if __name__ == "__main__":
  sys.exit(_cli.run(main, prog=PROG))
