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

from asyncops import _cli
from asyncops.collective_matmul import mlp_block

IN_SPECS = (P("x", "y"), P(None, "y"), P("y", None))
OUT_SPEC = P("x", "y")


def jit_mlp(x, w_in, w_out):
  return jax.nn.gelu(x @ w_in) @ w_out


def chapter_mlp(x, w_in, w_out):
  from collective_matmul import chapter_allgather, chapter_reducescatter

  return chapter_reducescatter(jax.nn.gelu(chapter_allgather(x, w_in)), w_out)


SP_SPECS = (P(("x", "y")), P(None, "y"), P("y", None), P(None, "y"))


def jit_llama_mlp(x, w_up, w_down, w_gate):
  return (jax.nn.silu(x @ w_gate) * (x @ w_up)) @ w_down


def llama_errors(mesh, s, d, f) -> dict[str, float]:
  """Max |error| of the gated sequence-parallel mlp_block against jit."""
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
  errors = {}
  for bidirectional in (False, True):
    ours = functools.partial(
      mlp_block,
      axis_name="y",
      activation=jax.nn.silu,
      sequence_parallel=True,
      bidirectional=bidirectional,
    )

    def gated(x, w_up, w_down, w_gate, ours=ours):
      return ours(x, w_up, w_down, w_gate=w_gate)

    fn = jax.jit(
      jax.shard_map(gated, mesh=mesh, in_specs=SP_SPECS, out_specs=SP_SPECS[0])
    )
    name = "gated SP" + ("/bidi" if bidirectional else "")
    errors[name] = float(jnp.max(jnp.abs(fn(*args) - want)))
  return errors


def main(argv=None) -> int:
  p = _cli.parser("python examples/mlp_block.py", __doc__.split("\n")[0])
  p.add_argument("--shape", default="64,256,512", help="B,D,F (global)")
  a = p.parse_args(argv)
  b, d, f = _cli.parse_ints(a.shape, 3, flag="--shape")
  if b % 8 or d % 4 or f % 4:
    raise _cli.UsageError(
      f"--shape: B must divide by 8 and D, F by 4 (a 2x4 mesh), got {a.shape}"
    )
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

  errors = {}
  for name, fn in {
    "chapter": chapter_mlp,
    "asyncops": functools.partial(mlp_block, axis_name="y"),
    "asyncops/bidi": functools.partial(
      mlp_block, axis_name="y", bidirectional=True
    ),
  }.items():
    errors[name] = float(jnp.max(jnp.abs(shmap(fn)(*args) - want)))
  # The Llama-style gated MLP, sequence parallel: B tokens, same D and F.
  errors.update(llama_errors(mesh, b, d, f))
  if not _cli.json_to_stdout(a.json):
    for name, err in errors.items():
      print(f"{name:14s} max |err| vs jit = {err:.2e}")
  bad = [n for n, e in errors.items() if not e < 1e-4]
  _cli.write_json(a.json, {"max_abs_err_vs_jit": errors, "bad": bad})
  return _cli.print_findings(
    [f"{n} differs from jit by {errors[n]:.2e}" for n in bad], a.json
  )


if __name__ == "__main__":
  sys.exit(_cli.run(main, prog="python examples/mlp_block.py"))
