"""asyncops demo: an overlapped ring permute, on CPU and compiled for TPU.

Sections (one function each; later demos add their own):

1. ``ring_numerics``: the ring on 8 CPU devices, checked against
   ``jax.lax.ppermute`` in both emulation transfer points.
2. ``ring_tpu_hlo``: the same program compiled ahead of time for TPU
   ``v5e:2x4``; prints our start/done custom calls and what XLA scheduled
   between them.

Run with ``make demo``.
"""

import os
import re
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
if "xla_force_host_platform_device_count" not in os.environ.get(
  "XLA_FLAGS", ""
):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8"
  )

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import asyncops  # noqa: E402
from asyncops.futures import check_futures  # noqa: E402

N = 8
STEPS = N - 1


def ring(x, w):
  """Accumulates ``x_j @ w`` over every shard ``x_j`` of the ring.

  The next shard travels while the current one is multiplied: the staggered
  loop of the design, with the future as a loop carry.
  """
  x, fut = asyncops.ppermute_start(x, "i", shift=1)

  def step(i, carry):
    acc, x, fut = carry
    acc = acc + x @ w  # overlaps the transfer on TPU
    nxt = asyncops.ppermute_done(fut)
    nxt, fut = asyncops.ppermute_start(nxt, "i", shift=1)
    return acc, nxt, fut

  acc0 = jnp.zeros_like(x @ w)
  acc, x, fut = jax.lax.fori_loop(0, STEPS - 1, step, (acc0, x, fut))
  acc = acc + x @ w
  return acc + asyncops.ppermute_done(fut) @ w


def ring_reference(x, w):
  acc = jnp.zeros_like(x @ w)
  for _ in range(N):
    acc = acc + x @ w
    x = jax.lax.ppermute(x, "i", [(j, (j + 1) % N) for j in range(N)])
  return acc


def program(mesh, fn):
  return jax.jit(
    jax.shard_map(fn, mesh=mesh, in_specs=(P("i"), P()), out_specs=P("i"))
  )


def ring_numerics() -> None:
  print("== 1. overlapped ring permute on 8 CPU devices ==")
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
  ref = program(mesh, ring_reference)(x, w)
  check_futures(program(mesh, ring), x, w)
  print("   check_futures: every start awaited exactly once")
  for mode in ("start", "done"):
    with asyncops.emulation(mode):
      got = program(mesh, ring)(x, w)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    print(f"   emulation transfer={mode!r}: equal to lax.ppermute ring  OK")


def quiet_topology(name: str):
  """The AOT TPU topology, with libtpu's start-up chatter on fd 2 dropped."""
  saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
  try:
    os.dup2(null, 2)
    return topologies.get_topology_desc(name, platform="tpu")
  finally:
    os.dup2(saved, 2)
    os.close(saved)
    os.close(null)


_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\(.*?\)|\S+) ([\w\-]+)\(")


def ring_tpu_hlo(topology: str = "v5e:2x4") -> None:
  print(f"== 2. the same program compiled for TPU {topology} ==")
  devices = np.array(quiet_topology(topology).devices)
  mesh = jax.sharding.Mesh(devices.reshape(N), ("i",))
  x = jax.ShapeDtypeStruct(
    (N * 256, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P("i"))
  )
  w = jax.ShapeDtypeStruct(
    (512, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P())
  )
  text = program(mesh, ring).trace(x, w).lower().compile().as_text()
  comps: dict[str, list[tuple[str, str]]] = {}
  comp = None
  for line in text.splitlines():
    if line.endswith("{") and line.startswith(("%", "ENTRY")):
      comp = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
      comps[comp] = []
    elif comp and (m := _INSTR.match(line)):
      comps[comp].append((m.group(1), m.group(3)))
  for name, instrs in comps.items():
    names = [n for n, _ in instrs]
    marks = [k for k, n in enumerate(names) if n.startswith("asyncops_")]
    if not marks:
      continue
    print(f"   computation {name}:")
    for a, b in zip(marks, marks[1:] + [None], strict=False):
      print(f"     {names[a]}  (Mosaic custom call)")
      if b is None:
        break
      between = [
        f"{n}:{op}"
        for n, op in instrs[a + 1 : b]
        if op not in ("get-tuple-element", "constant", "bitcast", "tuple")
      ]
      print(f"       between: {', '.join(between) or '(nothing)'}")


def main() -> None:
  ring_numerics()
  ring_tpu_hlo()


if __name__ == "__main__":
  main()
