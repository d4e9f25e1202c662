"""What a fused all-gather step plan would cost with its accumulator in HBM.

Since branch h-acctwin the fused all-gather kernel is charged XLA's
estimate of one contraction over all its chunks
(:func:`benchmarks._fused_variants.ring_contraction`; its float32
accumulator stays in VMEM for the whole ring), split over the steps of any
plan in proportion to their chunks: plans differ in the model only by
their waits. This prints, for comparison, each plan written as one dot per
step added into an accumulator XLA places (:func:`benchmarks.
_fused_variants.ring_steps`, the twin before that branch), step by step,
next to the contraction and the unsharded local matmul, for one device's
shapes ``x [m, k]`` (``n`` chunks), ``w [n k, f]``.
Each twin is modelled as the coster models it for the two-way kernel
(branch h-xfill): its pipeline fill (the local chunk ``x`` and one ``[k/2,
bn]`` block of ``w``) first, in the total and in no step.

Usage::

  python -m benchmarks.plan_twins --topology v6e:2x4 --dims 4,1024,2048,7168
  python -m benchmarks.plan_twins --topology v5e:2x4 --dims 4,512,512,2048 \\
      --w-dtype float32 --out-dtype float32

Exit status: 0, or 2 for a usage error; a table of modelled costs has no
findings (exit 1 is never used). ``--json FILE`` writes the rows to FILE
(the table stays on stdout); ``--json`` alone or ``--json -`` prints them
on stdout (the table then on stderr).
"""

import argparse
import functools
import sys

import jax
import jax.numpy as jnp

from asyncops import _cli
from benchmarks import (
  _chips,
  _fused_variants,
  _hlo,
  _kernel_costs,
  _measure,
  _timeline,
)

PLANS = ((1, 1, 1, 1), (1, 2, 1), (1, 1, 2), (1, 3), (2, 2), (4,))


def _model(fn, args, chip, fill=None):
  text = jax.jit(fn).trace(*args).lower().compile().as_text()
  module = _hlo.parse(text)
  return module, _timeline.simulate(module, chip, prefetch="free", fill=fill)


def _reads(k, f, w_dtype, plan) -> _kernel_costs.Reads:
  """The two-way kernel's reads (``_fused_variants._ag_reads``): ``x``
  whole, ``w`` and the later steps' chunks streamed, one ``[k/2, bn]``
  block of ``w`` in the fill (``bn`` as the library plans it)."""
  from asyncops.collective_matmul import _fused as lib  # noqa: PLC0415

  item = jnp.dtype(w_dtype).itemsize
  bn = lib._block_cols(f, k, item) or f
  return _kernel_costs.Reads(
    whole=(1,),
    streamed=(0, *range(2, len(plan) + 1)),
    first=((0, k // 2 * bn * item),),
  )


def _contraction_reads(m, k, f, w_dtype, x_dtype) -> _kernel_costs.Reads:
  """The same reads for the contraction twin (``w``, the stacked chunks):
  both streamed, their first blocks (one ``w`` block, the local chunk) in
  the fill."""
  from asyncops.collective_matmul import _fused as lib  # noqa: PLC0415

  item = jnp.dtype(w_dtype).itemsize
  bn = lib._block_cols(f, k, item) or f
  return _kernel_costs.Reads(
    streamed=(0, 1),
    first=((0, k // 2 * bn * item), (1, m * k * jnp.dtype(x_dtype).itemsize)),
  )


def plan_costs(topology, n, m, k, f, w_dtype, out_dtype, plans=PLANS):
  """``{plan: (total s, per-step s)}`` (the totals with the kernel's
  fill; and ``"contraction"``: the charged twin) and the unsharded dot's
  seconds (XLA's program: its prefetch free)."""
  chip = _chips.chip_for(topology)
  device = _measure.mesh_for(topology, "ring", n).devices.flat[0]
  s = jax.sharding.SingleDeviceSharding(device)

  def sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=s)

  w = sds((n * k, f), w_dtype)
  x_dtype = jnp.bfloat16 if jnp.dtype(w_dtype) == jnp.float32 else w_dtype
  out = {}
  for plan in _measure.progress(plans, f"{topology} step plans"):
    fn = functools.partial(
      _fused_variants.ring_steps, plan=plan, out_dtype=out_dtype
    )
    args = (w,) + tuple(sds((m, g * k), x_dtype) for g in plan)
    fill = _kernel_costs.fill_of(_reads(k, f, w_dtype, plan), args, chip)
    module, tl = _model(fn, args, chip, fill)
    params = tuple(range(1, len(plan) + 1))
    steps = _kernel_costs.Steps(((),) * len(plan), 1, (), params, plan)
    split = _kernel_costs.step_costs(module, tl, steps, fill.seconds)
    out[plan] = (tl.step_s, split.costs)

  one = functools.partial(_fused_variants.ring_contraction, out_dtype=out_dtype)
  args = (w, sds((n, m, k), x_dtype))
  fill = _kernel_costs.fill_of(
    _contraction_reads(m, k, f, w_dtype, x_dtype), args, chip
  )
  _, tl = _model(one, args, chip, fill)
  out["contraction"] = (tl.step_s, (tl.step_s,))

  def dot(x, w):
    return jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32)

  x = sds((m, n * k), jnp.float32 if x_dtype != w_dtype else x_dtype)
  _, tl = _model(lambda x, w: dot(x, w).astype(out_dtype), (x, w), chip)
  return out, tl.step_s


PROG = "python -m benchmarks.plan_twins"


def main(argv=None) -> int:
  p = _cli.ArgumentParser(
    prog=PROG,
    description=__doc__.split("\n\n")[0],
    epilog=_cli.describe(__doc__.rsplit("\n\n", 1)[1]),
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  p.add_argument("--topology", default="v6e:2x4")
  p.add_argument("--dims", default="4,1024,2048,7168", help="n,m,k,f")
  p.add_argument("--w-dtype", default="bfloat16")
  p.add_argument("--out-dtype", default=None, help="default: --w-dtype")
  _cli.add_json(p, "the rows (a JSON list)")
  a = p.parse_args(argv)
  try:
    n, m, k, f = (int(v) for v in a.dims.split(","))
  except ValueError:
    p.error(f"--dims {a.dims!r}: four integers n,m,k,f, e.g. 4,1024,2048,7168")
  if min(n, m, k, f) < 1:
    p.error(f"--dims {a.dims!r}: every dimension must be at least 1")
  if n != sum(PLANS[0]):
    p.error(
      f"--dims {a.dims!r}: n = {n}, but the plans cover {sum(PLANS[0])} "
      f"chunks; pass n = {sum(PLANS[0])}"
    )
  try:
    w_dtype = jnp.dtype(a.w_dtype)
    out_dtype = jnp.dtype(a.out_dtype or a.w_dtype)
  except TypeError as e:
    p.error(f"--w-dtype/--out-dtype: {e}; e.g. bfloat16 or float32")
  try:
    _chips.chip_for(a.topology)
  except (KeyError, ValueError) as e:
    p.error(f"--topology: {e}")
  try:
    _cli.check_topology(a.topology)
  except _cli.UsageError as e:
    p.error(str(e))
  costs, local = plan_costs(a.topology, n, m, k, f, w_dtype, out_dtype)
  with _cli.human_output(a.json):
    rows = _print(a.topology, (n, m, k, f), w_dtype, costs, local)
  _cli.write_json(a.json, rows)
  return _cli.EXIT_OK


def _print(topology, dims, w_dtype, costs, local) -> list[dict]:
  """Prints the table; returns its rows."""
  n, m, k, f = dims
  print(
    f"{topology} (n, m, k, f) = ({n}, {m}, {k}, {f}), w {w_dtype.name}: "
    f"unsharded dot {local * 1e6:.1f} us (prefetch free)"
  )
  print("| plan | twin (us) | per step (us) |")
  print("|---|---:|---|")
  rows = []
  for plan, (total, steps) in costs.items():
    per = ", ".join(f"{c * 1e6:.1f}" for c in steps)
    print(f"| {plan} | {total * 1e6:.1f} | {per} |")
    rows.append(
      {
        "topology": topology,
        "dims": [n, m, k, f],
        "w_dtype": w_dtype.name,
        "plan": plan if isinstance(plan, str) else list(plan),
        "twin_us": total * 1e6,
        "step_us": [c * 1e6 for c in steps],
        "unsharded_us": local * 1e6,
      }
    )
  return rows


if __name__ == "__main__":
  sys.exit(_cli.run(main, prog=PROG))
