"""Value API versus Ref API on the same patterns, from compiled TPU HLO.

For each pattern of :mod:`asyncops.compare._patterns`, compiles both sides
ahead of time for a TPU topology and prints: copies of whole buffers
(defensive or in flight: any ``copy`` of a non-scalar array), peak temporary
memory (``compiled.memory_analysis().temp_size_in_bytes``), whether the
compute (the matmul or the add) sits between the start and the done in the
schedule, and the lines of user code of each side.
"""

import functools
import inspect
import os
import re

import jax
import jax.numpy as jnp
import numpy as np

from asyncops.compare._patterns import PATTERNS


def _compile(topology, fn, looped):
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from jax.experimental import topologies

  devs = topologies.get_topology_desc(topology, platform="tpu").devices
  n = len(devs)
  mesh = jax.sharding.Mesh(np.array(devs).reshape(-1), ("i",))
  f = functools.partial(fn, n=n) if looped else fn
  g = jax.jit(
    jax.shard_map(
      f, mesh=mesh, in_specs=(jax.P("i"), jax.P()), out_specs=jax.P("i")
    )
  )
  s = jax.NamedSharding
  x = jax.ShapeDtypeStruct(
    (n * 256, 512), jnp.float32, sharding=s(mesh, jax.P("i"))
  )
  w = jax.ShapeDtypeStruct((512, 512), jnp.float32, sharding=s(mesh, jax.P()))
  return g.trace(x, w).lower().compile()


def _copies(hlo: str) -> int:
  return len(re.findall(r"= [a-z0-9]+\[\d[^\]]*\]\S* copy\(", hlo))


def _overlapped(hlo: str) -> bool:
  """Some compute (fusion/convolution/add) sits between a start and done."""
  for comp in hlo.split("\n\n"):
    lines = comp.splitlines()
    starts = [
      i for i, s in enumerate(lines) if "_start" in s and "custom-call(" in s
    ]
    dones = [
      i for i, s in enumerate(lines) if "_done" in s and "custom-call(" in s
    ]
    for a in starts:
      for b in dones:
        if b > a and any(
          re.search(r"(fusion|convolution|add)\(", s) for s in lines[a + 1 : b]
        ):
          return True
  return False


def _loc(fn) -> int:
  src = inspect.getsource(fn).splitlines()
  return sum(1 for s in src[1:] if s.strip() and not s.strip().startswith("#"))


def rows(topology: str = "v5e:2x4"):
  out = []
  for p in PATTERNS:
    row = {"pattern": p.name}
    for side in ("value", "ref"):
      c = _compile(topology, getattr(p, side), p.looped)
      hlo = c.as_text()
      mem = c.memory_analysis()
      row[side] = dict(
        copies=_copies(hlo),
        temp_kib=int(getattr(mem, "temp_size_in_bytes", -1)) // 1024,
        overlapped=_overlapped(hlo),
        loc=_loc(getattr(p, side)),
      )
    out.append(row)
  return out


def main(topology: str = "v5e:2x4") -> None:
  print(
    f"value API vs Ref API, compiled for {topology} (x: 256x512 f32/device)"
  )
  head = (
    f"{'pattern':<11} | {'copies':>9} | {'temp KiB':>13} | "
    f"{'overlapped':>11} | {'lines':>7}"
  )
  print(head)
  print(
    f"{'':<11} | {'val  ref':>9} | {'val    ref':>13} | "
    f"{'val   ref':>11} | {'val ref':>7}"
  )
  print("-" * len(head))
  for r in rows(topology):
    v, f = r["value"], r["ref"]
    print(
      f"{r['pattern']:<11} | {v['copies']:>4} {f['copies']:>4} | "
      f"{v['temp_kib']:>6} {f['temp_kib']:>6} | "
      f"{str(v['overlapped']):>5} {str(f['overlapped']):>5} | "
      f"{v['loc']:>3} {f['loc']:>3}"
    )
