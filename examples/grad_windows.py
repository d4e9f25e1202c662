"""Prints the evidence in ``design/training.md``: the backward's windows.

For each program, ``jax.jit(jax.grad(loss))`` is compiled ahead of time for
a TPU topology and the harness counts, separately for the forward and the
backward (reverse transfers are labelled ``transpose(...)``), the start/done
pairs and those with compute in their window, plus defensive and in-flight
copies::

  python examples/grad_windows.py --topology v5e:2x4 --topology v6e:2x4

Exit status 0 when every program is copy-free, 1 otherwise, 2 for bad usage.
"""

import functools
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import asyncops  # noqa: E402
from asyncops import _cli, stateful  # noqa: E402
from asyncops.inspect import analyze, tpu_mesh  # noqa: E402
from asyncops.scheduling import fori_loop, staggered  # noqa: E402


def window(start, done):
  """A transfer with a matmul in its window (``overlap``)."""

  def f(x, w):
    x1, fut = start(x)
    z, fut = asyncops.overlap(fut, lambda x1, w: jnp.tanh(x1) @ w, x1, w)
    return jnp.sum(jnp.sin(done(fut))) * jnp.sum(z)

  return f


def ref_window(x, w):
  a, b = jax.new_ref(x), jax.new_ref(jnp.zeros_like(x))
  fut = stateful.ppermute_start(a, b, "y", shift=1)
  z = jnp.tanh(x) @ w
  stateful.ppermute_done(fut, a, b)
  return jnp.sum(jnp.sin(b[...]) * z)


def ring(x, w):
  def body(i, c):
    x, acc = c
    x1, fut = asyncops.ppermute_start(x, "y", shift=1)
    acc, fut = asyncops.overlap(
      fut, lambda x, acc: acc + jnp.tanh(x) @ w, x1, acc
    )
    return asyncops.ppermute_done(fut), acc

  y, acc = fori_loop(0, 4, body, (x, jnp.zeros_like(x)))
  return jnp.sum(jnp.sin(y)) + jnp.sum(acc**2)


def staggered_ring(x, w):
  start = functools.partial(asyncops.ppermute_start, axis_name="y", shift=1)
  y, acc = staggered(
    4, start, lambda i, x, acc: acc + jnp.tanh(x) @ w, x, jnp.zeros_like(x)
  )
  return jnp.sum(jnp.sin(y)) + jnp.sum(acc**2)


PROGRAMS = {
  "ppermute": window(
    lambda x: asyncops.ppermute_start(x, "y", shift=1), asyncops.ppermute_done
  ),
  "bidirectional": window(
    lambda x: asyncops.bidirectional_start(x, "y"), asyncops.bidirectional_done
  ),
  "all_gather": window(
    lambda x: asyncops.all_gather_start(x, "y", tiled=True),
    asyncops.all_gather_done,
  ),
  "copy": window(asyncops.copy_start, asyncops.copy_done),
  "ref ppermute": ref_window,
  "fori_loop ring": ring,
  "staggered": staggered_ring,
}


def sharded_loss(f, mesh):
  """``f``'s loss over the ``(x, y)`` mesh, summed over every device."""
  # x * 2: the first start aliases a computed buffer, not the (undonated)
  # parameter, which XLA would have to copy for any in-place kernel.
  return jax.shard_map(
    lambda x, w: jax.lax.psum(f(x * 2, w), ("x", "y")),
    mesh=mesh,
    in_specs=(P("x", "y"), P()),
    out_specs=P(),
  )


def measure(topology: str, name: str, remat: bool) -> dict:
  mesh = tpu_mesh(topology, (2, 4), ("x", "y"))
  loss = sharded_loss(PROGRAMS[name], mesh)
  if remat:
    loss = jax.checkpoint(loss)
  args = (
    jax.ShapeDtypeStruct((2 * 512, 4 * 512), jnp.float32),
    jax.ShapeDtypeStruct((512, 512), jnp.float32),
  )
  r = analyze(jax.jit(jax.grad(loss, (0, 1))), *args)
  fwd = [p for p in r.kernel_pairs if "transpose(" not in p.kernel]
  bwd = [p for p in r.kernel_pairs if "transpose(" in p.kernel]
  return {
    "topology": topology,
    "program": name + (" (checkpoint)" if remat else ""),
    "fwd_pairs": len(fwd),
    "fwd_overlapped": sum(p.overlapped for p in fwd),
    "bwd_pairs": len(bwd),
    "bwd_overlapped": sum(p.overlapped for p in bwd),
    "defensive": len(r.defensive_copies),
    "inflight": len(r.inflight_copies),
  }


def main(argv=None) -> int:
  p = _cli.parser("python examples/grad_windows.py", __doc__)
  p.add_argument(
    "--topology",
    action="append",
    help="TPU topology, e.g. v5e:2x4 (repeatable; default v5e:2x4)",
  )
  args = p.parse_args(argv)
  topologies = args.topology or ["v5e:2x4"]
  for t in topologies:
    _cli.check_topology(t)
  jobs = [
    (t, name, remat)
    for t in topologies
    for name in PROGRAMS
    for remat in (
      (False, True) if name in ("ppermute", "fori_loop ring") else (False,)
    )
  ]
  rows = [
    measure(t, name, remat)
    for t, name, remat in _cli.progress(jobs, "compiling", unit="program")
  ]
  _cli.write_json(args.json, rows)
  if not _cli.json_to_stdout(args.json):
    print(
      f"{'topology':9s} {'program':28s} {'fwd overlapped':>15s} "
      f"{'bwd overlapped':>15s} {'defensive':>9s} {'in-flight':>9s}"
    )
    for r in rows:
      print(
        f"{r['topology']:9s} {r['program']:28s} "
        f"{r['fwd_overlapped']:>8d}/{r['fwd_pairs']:<6d} "
        f"{r['bwd_overlapped']:>8d}/{r['bwd_pairs']:<6d} "
        f"{r['defensive']:9d} {r['inflight']:9d}"
      )
  return _cli.print_findings(
    [
      f"{r['program']} on {r['topology']}: {r['defensive']} defensive, "
      f"{r['inflight']} in-flight copies"
      for r in rows
      if r["defensive"] or r["inflight"]
    ],
    args.json,
  )


if __name__ == "__main__":
  sys.exit(_cli.run(main, prog="python examples/grad_windows.py"))
