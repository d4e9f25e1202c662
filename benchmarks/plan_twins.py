"""What the model charges a fused all-gather step plan, before any wait.

The fused all-gather kernel is charged XLA's estimate of its jnp twin, one
dot per step of its plan (:func:`benchmarks._fused_variants.ring_steps`),
each step's share attributed to the dot that reads its chunks
(:mod:`benchmarks._kernel_costs`). This prints that twin's modelled time
for each plan, step by step, next to the unsharded local matmul, for one
device's shapes ``x [m, k]`` (``n`` chunks), ``w [n k, f]``: the floor no
kernel running that plan goes under in the model, whatever its waits.

Usage::

  python -m benchmarks.plan_twins --topology v6e:2x4 --dims 4,1024,2048,7168
  python -m benchmarks.plan_twins --topology v5e:2x4 --dims 4,512,512,2048 \\
      --w-dtype float32 --out-dtype float32
"""

import argparse
import functools

import jax
import jax.numpy as jnp

from benchmarks import (
  _chips,
  _fused_variants,
  _hlo,
  _kernel_costs,
  _measure,
  _timeline,
)

PLANS = ((1, 1, 1, 1), (1, 2, 1), (1, 1, 2), (1, 3), (2, 2), (4,))


def _model(fn, args, chip):
  text = jax.jit(fn).trace(*args).lower().compile().as_text()
  module = _hlo.parse(text)
  return module, _timeline.simulate(module, chip, prefetch="charged")


def plan_costs(topology, n, m, k, f, w_dtype, out_dtype, plans=PLANS):
  """``{plan: (total s, per-step s)}`` and the unsharded dot's seconds
  (its weight prefetch charged, as twins are modelled)."""
  chip = _chips.chip_for(topology)
  device = _measure.mesh_for(topology, "ring", n).devices.flat[0]
  s = jax.sharding.SingleDeviceSharding(device)

  def sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=s)

  w = sds((n * k, f), w_dtype)
  x_dtype = jnp.bfloat16 if jnp.dtype(w_dtype) == jnp.float32 else w_dtype
  out = {}
  for plan in plans:
    fn = functools.partial(
      _fused_variants.ring_steps, plan=plan, out_dtype=out_dtype
    )
    args = (w,) + tuple(sds((m, g * k), x_dtype) for g in plan)
    module, tl = _model(fn, args, chip)
    params = tuple(range(1, len(plan) + 1))
    steps = _kernel_costs.Steps(((),) * len(plan), 1, (), params, plan)
    owners, reads = _kernel_costs._dot_steps(module, params)
    split = _kernel_costs._split(tl, steps, owners, reads)
    out[plan] = (tl.step_s, split.costs)

  def dot(x, w):
    return jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32)

  x = sds((m, n * k), jnp.float32 if x_dtype != w_dtype else x_dtype)
  _, tl = _model(lambda x, w: dot(x, w).astype(out_dtype), (x, w), chip)
  return out, tl.step_s


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--topology", default="v6e:2x4")
  p.add_argument("--dims", default="4,1024,2048,7168", help="n,m,k,f")
  p.add_argument("--w-dtype", default="bfloat16")
  p.add_argument("--out-dtype", default=None, help="default: --w-dtype")
  a = p.parse_args(argv)
  n, m, k, f = (int(v) for v in a.dims.split(","))
  w_dtype = jnp.dtype(a.w_dtype)
  out_dtype = jnp.dtype(a.out_dtype or a.w_dtype)
  costs, local = plan_costs(a.topology, n, m, k, f, w_dtype, out_dtype)
  print(
    f"{a.topology} (n, m, k, f) = ({n}, {m}, {k}, {f}), w {w_dtype.name}: "
    f"unsharded dot {local * 1e6:.1f} us (prefetch charged)"
  )
  print("| plan | twin (us) | per step (us) |")
  print("|---|---:|---|")
  for plan, (total, steps) in costs.items():
    per = ", ".join(f"{c * 1e6:.1f}" for c in steps)
    print(f"| {plan} | {total * 1e6:.1f} | {per} |")


if __name__ == "__main__":
  main()
