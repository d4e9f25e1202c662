"""One process of the multi-host test (``tests/test_multihost.py``).

Usage: ``python tests/_multihost_worker.py PROCESS_ID NUM_PROCESSES PORT``.
Joins ``jax.distributed`` on loopback with 4 CPU devices and gloo
collectives, then runs, over the 8 global devices, an asyncops ring
(``scheduling.fori_loop`` of ``ppermute_start``/``_done``) and an
all-gather collective matmul, both on mesh axes that cross processes, and
checks every local shard against ``jax.lax``/numpy. Prints ``OK <id>``.
"""

import sys

import jax

PID, NPROC, PORT = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(
  coordinator_address=f"127.0.0.1:{PORT}",
  num_processes=NPROC,
  process_id=PID,
  initialization_timeout=120,
)

import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import asyncops  # noqa: E402
from asyncops import scheduling  # noqa: E402
from asyncops.collective_matmul import allgather_matmul  # noqa: E402

assert jax.process_count() == NPROC and jax.device_count() == 4 * NPROC
devices = np.array(jax.devices())  # process-major: 0-3 here, 4-7 there


def global_array(value: np.ndarray, sharding) -> jax.Array:
  return jax.make_array_from_callback(
    value.shape, sharding, lambda idx: value[idx]
  )


def check(got: jax.Array, want: np.ndarray, what: str) -> None:
  for shard in got.addressable_shards:
    np.testing.assert_allclose(
      np.asarray(shard.data),
      want[shard.index],
      rtol=1e-5,
      atol=1e-4,
      err_msg=what,
    )


# A ring over all 8 devices (one hop crosses to the other process).
ring_mesh = Mesh(devices, ("i",))
n, steps = devices.size, 3


def ring(x):
  def body(i, x):
    x, fut = asyncops.ppermute_start(x, "i", shift=1)
    return asyncops.ppermute_done(fut)

  return scheduling.fori_loop(0, steps, body, x)


x = np.arange(n * 8 * 128, dtype=np.float32).reshape(n * 8, 128)
spec = NamedSharding(ring_mesh, P("i"))
f = jax.jit(
  jax.shard_map(ring, mesh=ring_mesh, in_specs=P("i"), out_specs=P("i"))
)
want = np.roll(x.reshape(n, 8, 128), steps, axis=0).reshape(x.shape)
check(f(global_array(x, spec)), want, "ring")

# All-gather matmul on a 2x4 mesh whose "y" axis crosses processes.
mesh = Mesh(devices.reshape(4, 2).T, ("x", "y"))
b, d, ff = 16, 64, 32
rng = np.random.default_rng(0)
lhs = rng.standard_normal((b, d), dtype=np.float32)
rhs = rng.standard_normal((d, ff), dtype=np.float32)
g = jax.jit(
  jax.shard_map(
    lambda a, w: allgather_matmul(a, w, "y", method="ring"),
    mesh=mesh,
    in_specs=(P("x", "y"), P(None, "y")),
    out_specs=P("x", "y"),
  )
)
out = g(
  global_array(lhs, NamedSharding(mesh, P("x", "y"))),
  global_array(rhs, NamedSharding(mesh, P(None, "y"))),
)
check(out, lhs @ rhs, "allgather_matmul")
jax.distributed.shutdown()
print(f"OK {PID}", flush=True)
