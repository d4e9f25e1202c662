"""Trains a tensor-parallel two-layer MLP with asyncops, checked against lax.

A student ``mlp_block`` (``x @ w_in -> gelu -> @ w_out``, the up projection
an all-gather matmul and the down projection a matmul-reduce-scatter, both
overlapped) learns a random teacher MLP by SGD on 8 CPU devices (mesh 2x4:
data over ``x``, the model over ``y``). The same training with the plain
``jax.lax`` program (``all_gather`` and ``psum_scatter`` around ordinary
matmuls) runs alongside; every step's loss must match. The weights are
replicated over ``x``: ``mlp_block``'s backward sums their gradients over
it with its own exchange kernels, in flight behind the rest of the
backward (the ``ring_axis_x`` pairs of the ``--hlo`` report), nothing to
write in the train step.

With ``--hlo TOPOLOGY`` the jitted train step (forward, backward, update)
is compiled ahead of time for that TPU topology instead, and the harness
report is printed: start/done pairs and their windows, forward and
backward, and any defensive or in-flight copy.

Usage::

  python examples/train_mlp.py
  python examples/train_mlp.py --steps 300 --api ref --bidirectional
  python examples/train_mlp.py --hlo v5e:2x4 --shape 1024,2048,8192

Exit status 0 when the losses match (or the compiled step is copy-free), 1
otherwise, 2 for bad usage.
"""

import functools
import os
import sys

if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  if "xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""
  ):
    os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "")
      + " --xla_force_host_platform_device_count=8"
    )
  sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  )

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from asyncops import _cli  # noqa: E402
from asyncops.collective_matmul import mlp_block  # noqa: E402

AXES = ("x", "y")
SPECS = (P("x", "y"), P(None, "y"), P("y", None))  # x, w_in, w_out


def lax_mlp(x, w_in, w_out):
  """The plain program: gather, matmul, gelu, matmul, reduce-scatter."""
  h = jax.lax.all_gather(x, "y", axis=1, tiled=True) @ w_in
  y = jax.nn.gelu(h) @ w_out
  return jax.lax.psum_scatter(y, "y", scatter_dimension=1, tiled=True)


def model(block, mesh):
  return jax.shard_map(block, mesh=mesh, in_specs=SPECS, out_specs=P("x", "y"))


def train_step(block, mesh, lr):
  forward = model(block, mesh)

  def loss_fn(params, x, target):
    y = forward(x, *params)
    return jnp.mean((y.astype(jnp.float32) - target) ** 2)

  @jax.jit
  def step(params, x, target):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, target)
    params = jax.tree.map(
      lambda p, g: (p - lr * g.astype(jnp.float32)).astype(p.dtype),
      params,
      grads,
    )
    return params, loss

  return step


def _blocks(api, bidirectional):
  # The rings, forward and backward (method="ring"; the default, "auto",
  # may run XLA's collectives or the fused kernels instead).
  ours = functools.partial(
    mlp_block,
    axis_name="y",
    api=api,
    bidirectional=bidirectional,
    method="ring",
  )
  return {"asyncops": ours, "lax": lax_mlp}


def _init(key, b, d, f, dtype, mesh):
  k_in, k_out = jax.random.split(key)
  put = [NamedSharding(mesh, s) for s in SPECS[1:]]
  w_in = jax.random.normal(k_in, (d, f), jnp.float32) / np.sqrt(d)
  w_out = jax.random.normal(k_out, (f, d), jnp.float32) / np.sqrt(f)
  return tuple(
    jax.device_put(w.astype(dtype), s)
    for w, s in zip((w_in, w_out), put, strict=True)
  )


def train(args, b, d, f) -> int:
  mesh = jax.make_mesh(
    (2, 4), AXES, axis_types=(jax.sharding.AxisType.Auto,) * 2
  )
  dtype = jnp.dtype(args.dtype)
  teacher = _init(jax.random.key(1), b, d, f, jnp.float32, mesh)
  start = _init(jax.random.key(2), b, d, f, dtype, mesh)
  teach = jax.jit(model(lax_mlp, mesh))
  x_sharding = NamedSharding(mesh, SPECS[0])
  steps = {
    name: train_step(blk, mesh, args.lr)
    for name, blk in _blocks(args.api, args.bidirectional).items()
  }
  params = {name: start for name in steps}
  history = {name: [] for name in steps}
  for i in _cli.progress(range(args.steps), "training"):
    x = jax.random.normal(jax.random.fold_in(jax.random.key(3), i), (b, d))
    x = jax.device_put(x, x_sharding)
    target = teach(x, *teacher)
    for name, step in steps.items():
      params[name], loss = step(params[name], x.astype(dtype), target)
      history[name].append(float(loss))
    if not _cli.json_to_stdout(args.json) and (
      i % args.every == 0 or i == args.steps - 1
    ):
      print(
        f"step {i:4d}  loss asyncops {history['asyncops'][-1]:.6f}  "
        f"lax {history['lax'][-1]:.6f}"
      )
  ours, ref = np.array(history["asyncops"]), np.array(history["lax"])
  rel = float(np.max(np.abs(ours - ref) / np.maximum(np.abs(ref), 1e-12)))
  tol = 1e-4 if dtype == jnp.float32 else 3e-2
  fell = ours[-1] < 0.5 * ours[0]
  bad = ["the loss did not halve"] if not fell else []
  if rel > tol:
    bad.append("losses differ from the lax program")
  _cli.write_json(
    args.json,
    {
      "losses": history,
      "max_rel_diff": rel,
      "tolerance": tol,
      "loss_fell": bool(fell),
      "findings": bad,
    },
  )
  if not _cli.json_to_stdout(args.json):
    print(
      f"loss {ours[0]:.6f} -> {ours[-1]:.6f} in {args.steps} steps; "
      f"max relative difference from the lax program {rel:.2e} "
      f"(tolerance {tol:.0e})"
    )
  return _cli.print_findings(bad, args.json)


def hlo(args, b, d, f) -> int:
  from asyncops.inspect import analyze, tpu_mesh

  _cli.check_topology(args.hlo, flag="--hlo")
  mesh = tpu_mesh(args.hlo, (2, 4), AXES)
  block = _blocks(args.api, args.bidirectional)["asyncops"]
  step = train_step(block, mesh, args.lr)
  dtype = jnp.dtype(args.dtype)

  def abstract(shape, spec, dt):
    return jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, spec))

  params = (
    abstract((d, f), SPECS[1], dtype),
    abstract((f, d), SPECS[2], dtype),
  )
  x = abstract((b, d), SPECS[0], dtype)
  target = abstract((b, d), SPECS[0], jnp.float32)
  with _cli.human_output(args.json):
    report = analyze(step, params, x, target)
  fwd = [p for p in report.kernel_pairs if "transpose(" not in p.kernel]
  bwd = [p for p in report.kernel_pairs if "transpose(" in p.kernel]
  counts = {
    "forward_pairs": len(fwd),
    "forward_overlapped": sum(p.overlapped for p in fwd),
    "backward_pairs": len(bwd),
    "backward_overlapped": sum(p.overlapped for p in bwd),
    "defensive_copies": len(report.defensive_copies),
    "inflight_copies": len(report.inflight_copies),
  }
  bad = [
    f"train step on {args.hlo}: {counts['defensive_copies']} defensive, "
    f"{counts['inflight_copies']} in-flight copies"
  ]
  bad = bad if counts["defensive_copies"] or counts["inflight_copies"] else []
  _cli.write_json(args.json, {"topology": args.hlo, **counts, "findings": bad})
  if not _cli.json_to_stdout(args.json):
    print(report.summary())
    print(
      f"train step on {args.hlo} ({args.dtype}, B,D,F = {b},{d},{f}, "
      f"api={args.api}, bidirectional={args.bidirectional}): forward "
      f"{counts['forward_overlapped']}/{counts['forward_pairs']} pairs "
      f"overlapped, backward {counts['backward_overlapped']}/"
      f"{counts['backward_pairs']}; {counts['defensive_copies']} defensive, "
      f"{counts['inflight_copies']} in-flight copies"
    )
  return _cli.print_findings(bad, args.json)


def main(argv=None) -> int:
  p = _cli.parser("python examples/train_mlp.py", __doc__)
  p.add_argument("--steps", type=int, default=300, help="SGD steps (300)")
  p.add_argument("--lr", type=float, default=1.0, help="learning rate (1.0)")
  p.add_argument(
    "--shape",
    default=None,
    help="B,D,F global (64,128,256; --hlo: 1024,2048,8192)",
  )
  p.add_argument("--dtype", default=None, choices=("float32", "bfloat16"))
  p.add_argument("--api", default="value", choices=("value", "ref"))
  p.add_argument("--bidirectional", action="store_true")
  p.add_argument("--every", type=int, default=25, help="print every N steps")
  p.add_argument(
    "--hlo", metavar="TOPOLOGY", help="compile the train step for TPU instead"
  )
  args = p.parse_args(argv)
  default_shape = "1024,2048,8192" if args.hlo else "64,128,256"
  b, d, f = _cli.parse_ints(args.shape or default_shape, 3, flag="--shape")
  if b % 2 or d % 4 or f % 4:
    raise _cli.UsageError(
      f"--shape: B must divide by 2 and D, F by 4 (a 2x4 mesh), got {b},{d},{f}"
    )
  if args.bidirectional and (b // 2) % 2:
    raise _cli.UsageError(
      "--bidirectional: B/2 (rows per device) must be even; pass a B that "
      "divides by 4"
    )
  if args.steps < 1 or args.every < 1:
    raise _cli.UsageError("--steps and --every must be at least 1")
  args.dtype = args.dtype or ("bfloat16" if args.hlo else "float32")
  if args.hlo:
    return hlo(args, b, d, f)
  return train(args, b, d, f)


if __name__ == "__main__":
  sys.exit(_cli.run(main, prog="python examples/train_mlp.py"))
