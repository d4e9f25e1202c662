"""MLP blocks with hidden collectives: jit vs chapter ppermute vs asyncops.

1. The chapter's Problem 3, model-sharded activations:
   ``In[B_X, D_Y] * W_in[D, F_Y] -> gelu -> * W_out[F_Y, D] -> Out[B_X, D_Y]``.
2. A Llama-style gated MLP (SwiGLU) in sequence-parallel layout:
   ``In[S_XY, D] -> silu(In W_gate) * (In W_up) -> * W_down -> Out[S_XY, D]``
   (the tokens are gathered over ``y`` once for both projections and
   scattered back after the down projection).

On 8 CPU devices (2x4 mesh)::

  python examples/mlp_block.py
"""

import os
import sys

if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8"
  )
  sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
  sys.path.insert(0, os.path.dirname(__file__))

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from asyncops.collective_matmul import mlp_block

IN_SPECS = (P("x", "y"), P(None, "y"), P("y", None))
OUT_SPEC = P("x", "y")


def jit_mlp(x, w_in, w_out):
  return jax.nn.gelu(x @ w_in) @ w_out


def chapter_mlp(x, w_in, w_out):
  from collective_matmul import chapter_allgather, chapter_reducescatter

  return chapter_reducescatter(jax.nn.gelu(chapter_allgather(x, w_in)), w_out)


def main():
  b, d, f = 64, 256, 512
  mesh = jax.make_mesh(
    (2, 4), ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2
  )
  keys = jax.random.split(jax.random.key(0), 3)
  args = [
    jax.device_put(
      jax.random.normal(k, s, jnp.float32) / np.sqrt(s[0]),
      NamedSharding(mesh, spec),
    )
    for k, s, spec in zip(keys, ((b, d), (d, f), (f, d)), IN_SPECS, strict=True)
  ]
  want = jax.jit(jit_mlp, out_shardings=NamedSharding(mesh, OUT_SPEC))(*args)

  def shmap(fn):
    return jax.jit(
      jax.shard_map(fn, mesh=mesh, in_specs=IN_SPECS, out_specs=OUT_SPEC)
    )

  for name, fn in {
    "chapter": chapter_mlp,
    "asyncops": functools.partial(mlp_block, axis_name="y"),
    "asyncops/bidi": functools.partial(
      mlp_block, axis_name="y", bidirectional=True
    ),
  }.items():
    err = float(jnp.max(jnp.abs(shmap(fn)(*args) - want)))
    print(f"{name:14s} max |err| vs jit = {err:.2e}")
    assert err < 1e-4, name


SP_SPECS = (P(("x", "y")), P(None, "y"), P("y", None), P(None, "y"))


def jit_llama_mlp(x, w_up, w_down, w_gate):
  return (jax.nn.silu(x @ w_gate) * (x @ w_up)) @ w_down


def main_llama():
  s, d, f = 128, 64, 256
  mesh = jax.make_mesh(
    (2, 4), ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2
  )
  keys = jax.random.split(jax.random.key(1), 4)
  shapes = ((s, d), (d, f), (f, d), (d, f))
  args = [
    jax.device_put(
      jax.random.normal(k, sh, jnp.float32) / np.sqrt(sh[0]),
      NamedSharding(mesh, spec),
    )
    for k, sh, spec in zip(keys, shapes, SP_SPECS, strict=True)
  ]
  out = NamedSharding(mesh, SP_SPECS[0])
  want = jax.jit(jit_llama_mlp, out_shardings=out)(*args)
  for bidirectional in (False, True):

    def ours(x, w_up, w_down, w_gate, bidirectional=bidirectional):
      return mlp_block(
        x,
        w_up,
        w_down,
        "y",
        w_gate=w_gate,
        activation=jax.nn.silu,
        sequence_parallel=True,
        bidirectional=bidirectional,
      )

    f = jax.jit(
      jax.shard_map(ours, mesh=mesh, in_specs=SP_SPECS, out_specs=SP_SPECS[0])
    )
    err = float(jnp.max(jnp.abs(f(*args) - want)))
    name = "gated SP" + ("/bidi" if bidirectional else "")
    print(f"{name:14s} max |err| vs jit = {err:.2e}")
    assert err < 1e-4, name


if __name__ == "__main__":
  main()
  main_llama()
