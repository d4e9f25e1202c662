"""Value API versus Ref API on the same patterns, from compiled TPU HLO.

For each pattern of :mod:`asyncops.compare._patterns`, compiles both sides
ahead of time for a TPU topology (``x``: 1024x1024 f32 per device, in HBM)
and reports, from :func:`asyncops.inspect.analyze`: defensive copies,
copies of in-flight buffers, start/done pairs of the pattern's op with
compute in their window (``overlapped/pairs``), the peak memory
(``compiled.memory_analysis().peak_memory_in_bytes``: arguments, outputs
and temporaries; ``temp_size_in_bytes`` reads 0 for every TPU compile-only
executable, so it says nothing), and the lines of user code of each side.
"""

import inspect

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from asyncops.compare._patterns import PATTERNS
from asyncops.inspect import analyze, tpu_mesh

AXES = ("x", "y")
SHARD = (1024, 1024)


def _report(topology, p, side):
  mesh = tpu_mesh(topology, (2, 4), AXES)
  spec = P(AXES)
  g = jax.jit(
    jax.shard_map(
      getattr(p, side),
      mesh=mesh,
      in_specs=(spec, P()),
      out_specs=(spec,) * p.n_out,
    )
  )
  x = jax.ShapeDtypeStruct(
    (8 * SHARD[0], SHARD[1]), jnp.float32, sharding=NamedSharding(mesh, spec)
  )
  w = jax.ShapeDtypeStruct(
    (SHARD[1],) * 2, jnp.float32, sharding=NamedSharding(mesh, P())
  )
  return analyze(g, x, w)


def lines_of_code(fn) -> int:
  """Non-blank, non-comment lines of ``fn``'s body."""
  src = inspect.getsource(fn).splitlines()
  return sum(1 for s in src[1:] if s.strip() and not s.strip().startswith("#"))


def row(topology: str, p) -> dict:
  """``{"pattern", "value": {...}, "ref": {...}}`` for one pattern."""
  out = {"pattern": p.name}
  for side in ("value", "ref"):
    r = _report(topology, p, side)
    pairs = r.pairs_for(f"asyncops_{p.op}_")
    out[side] = dict(
      defensive=len(r.defensive_copies),
      inflight=len(r.inflight_copies),
      overlapped=f"{sum(q.overlapped for q in pairs)}/{len(pairs)}",
      peak_mib=r.memory.get("peak_memory_in_bytes", -1) / 2**20,
      loc=lines_of_code(getattr(p, side)),
    )
  return out


def rows(topology: str = "v5e:2x4", patterns=None, progress=None):
  """One dict per pattern: ``{"pattern", "value": {...}, "ref": {...}}``.

  Args:
    topology: the TPU topology to compile for (8 devices, a 2x4 mesh).
    patterns: the patterns to compare (default: all of ``PATTERNS``).
    progress: optional ``progress(iterable, desc)`` wrapper (a bar).
  """
  ps = list(PATTERNS if patterns is None else patterns)
  it = progress(ps, "compare") if progress else ps
  return [row(topology, p) for p in it]


def format_table(topology: str, table: list[dict]) -> str:
  """The rows as the text table ``python -m asyncops.compare`` prints."""
  out = [
    f"value API (scheduling helpers) vs Ref API, {topology}, mesh 2x4, "
    f"x: {SHARD[0]}x{SHARD[1]} f32 per device"
  ]
  cols = ("defensive", "in-flight", "overlapped", "peak MiB", "lines")
  head = f"{'pattern':<18}|" + "|".join(f"{c:^15}" for c in cols)
  out.append(head)
  out.append(f"{'':<18}|" + "|".join(f"{'val':>7}{'ref':>7} " for _ in cols))
  out.append("-" * len(head))
  for r in table:
    v, f = r["value"], r["ref"]
    cells = [
      (v["defensive"], f["defensive"]),
      (v["inflight"], f["inflight"]),
      (v["overlapped"], f["overlapped"]),
      (f"{v['peak_mib']:.1f}", f"{f['peak_mib']:.1f}"),
      (v["loc"], f["loc"]),
    ]
    out.append(
      f"{r['pattern']:<18}|" + "|".join(f"{a!s:>7}{b!s:>7} " for a, b in cells)
    )
  return "\n".join(out)
