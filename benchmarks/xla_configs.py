"""XLA's configurations for collective matmuls, and a scan for new ones.

``xla_best`` (the baseline of every table) compiles a family's plain
``jax.jit`` program once per entry of :data:`CONFIGS` through
``.compile(compiler_options=...)``, models each, and keeps the fastest.
Configurations that print the same HLO as one already tried are skipped.

:data:`CANDIDATES` lists libtpu flags that could change how a collective
matmul compiles (names from libtpu's own flag table, values from its enum
errors). ``python -m benchmarks.xla_configs`` compiles each against the
default on a few shapes and prints which ones change the scheduled HLO and
the modelled step time; :data:`CONFIGS` holds the ones that do.

Usage::

  python -m benchmarks.xla_configs [--topology v5e:2x4] [--json [FILE]]

Exit status: 0 clean; 1 a finding: a flag of :data:`CANDIDATES` that libtpu
refuses (the list is stale: the flag was renamed or removed, or a value
left its enum), each named on a ``finding:`` line and in the JSON (its
row's ``"error"``); 2 a usage error. A flag that changes the HLO is a
result of the scan, not a finding. ``--json FILE`` writes the rows to FILE
(the scan's lines stay on stdout); ``--json`` alone or ``--json -`` prints
them on stdout (the lines then on stderr).
"""

from __future__ import annotations

import hashlib
import re
import sys

# Every configuration xla_best tries: name -> compiler options.
AG, RS = "all_gather", "reduce_scatter"
CONFIGS: dict[str, dict[str, object]] = {
  "default": {},
  # = collective_matmul_mode none / post_spmd_conservative (same HLO).
  "windowed_einsum_off": {
    f"xla_tpu_enable_windowed_einsum_for_{AG}": False,
    f"xla_tpu_enable_windowed_einsum_for_{RS}": False,
  },
  "collective_matmul_post_spmd": {
    f"xla_tpu_{AG}_collective_matmul_mode": "post_spmd",
    f"xla_tpu_{RS}_collective_matmul_mode": "post_spmd",
  },
  "windowed_einsum_unidirectional": {
    "xla_tpu_spmd_bidirectional_windowed_einsum": False,
  },
  "windowed_einsum_unrolled": {
    "xla_tpu_spmd_unroll_windowed_einsum": True,
  },
  # Changes f32 reduce-scatter (no all-reduce-scatter custom fusion).
  "all_reduce_scatter_fusion_off": {
    "xla_tpu_enable_all_reduce_scatter_fusion": False,
  },
}

# Flags (and values) the scan tries one at a time against the default.
CANDIDATES: dict[str, tuple[object, ...]] = {
  f"xla_tpu_enable_windowed_einsum_for_{AG}": (False, True),
  f"xla_tpu_enable_windowed_einsum_for_{RS}": (False, True),
  f"xla_tpu_{AG}_collective_matmul_mode": (
    "post_spmd",
    "pre_spmd",
    "post_spmd_conservative",
    "none",
  ),
  f"xla_tpu_{RS}_collective_matmul_mode": (
    "post_spmd",
    "pre_spmd",
    "post_spmd_conservative",
    "none",
  ),
  "xla_tpu_spmd_bidirectional_windowed_einsum": (False, True),
  "xla_tpu_spmd_unroll_windowed_einsum": (True, False),
  "xla_tpu_enable_all_reduce_scatter_fusion": (False,),
  "xla_tpu_enable_async_collective_fusion": (True,),
  "xla_tpu_overlap_compute_collective_tc": (True,),
  "xla_tpu_decompose_all_gather_einsum": (True,),
  "xla_tpu_decompose_einsum_reduce_scatter": (True,),
  "xla_tpu_prefer_einsum_reduce_scatter": (True,),
  "xla_tpu_use_separate_matmuls_in_collective_matmul_body": (True,),
  "xla_tpu_choose_faster_windowed_einsum_over_mem": (True,),
  "xla_tpu_prefer_async_allgather_to_allreduce": (True,),
}

_NOISE = re.compile(r", metadata=\{[^}]*\}|, frontend_attributes=\{[^}]*\}")


def hlo_key(text: str) -> str:
  """A digest of scheduled HLO without metadata (equal programs, equal
  keys)."""
  body = text[text.find("\n") :]  # the HloModule line names the config
  return hashlib.sha1(_NOISE.sub("", body).encode()).hexdigest()


def describe(name: str) -> str:
  """``name (flag=value, ...)`` for tables and JSON."""
  opts = CONFIGS[name]
  inner = ", ".join(f"{k}={v}" for k, v in opts.items())
  return f"{name} ({inner})" if inner else name


# The scan -----------------------------------------------------------------

_SCAN_SHAPES = (
  # (family variant, (B, D, F), tp)
  ("jit", (1024, 2048, 8192), 4),
  ("reducescatter:jit", (1024, 2048, 8192), 4),
  ("allreduce:jit", (1024, 2048, 8192), 4),
  ("jit", (1024, 8192, 28672), 8),
  ("reducescatter:jit", (1024, 8192, 28672), 8),
)


PROG = "python -m benchmarks.xla_configs"


def main(argv=None) -> int:
  """Runs the command line; returns the exit status."""
  import argparse  # noqa: PLC0415

  from asyncops import _cli  # noqa: PLC0415

  p = _cli.ArgumentParser(
    prog=PROG,
    description="Which libtpu flags change a collective matmul's HLO.",
    epilog=_cli.describe(__doc__.rsplit("\n\n", 1)[1]),
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  p.add_argument(
    "--topology", default="v5e:2x4", help="TPU topology (default: v5e:2x4)"
  )
  _cli.add_json(p, "every row of the scan (a JSON list)")
  a = p.parse_args(argv)
  # Checked first: the scan records a flag libtpu refuses as a finding, so
  # a topology it does not know would otherwise end in a file of errors.
  _cli.check_topology(a.topology)
  jobs = [
    (v, shape, tp, flag, value)
    for v, shape, tp in _SCAN_SHAPES
    for flag, values in [(None, (None,)), *CANDIDATES.items()]
    for value in values
  ]
  with _cli.human_output(a.json):
    found = _scan(jobs, a.topology)
  _cli.write_json(a.json, found)
  return _cli.print_findings(
    [
      f"{r['flag']}={r['value']} ({r['variant']} {r['shape']} tp{r['tp']}): "
      f"libtpu refuses it: {r['error']}"
      for r in found
      if "error" in r
    ],
    a.json,
  )


def _scan(jobs, topology) -> list[dict]:
  """Compiles and models every job; prints one line per flag; returns the
  rows."""
  import jax.numpy as jnp  # noqa: PLC0415

  from benchmarks import _measure  # noqa: PLC0415

  found, base = [], {}
  for v, shape, tp, flag, value in _measure.progress(jobs, "scan"):
    opts = {} if flag is None else {flag: value}
    spec = _measure.Spec(v, topology, tp, shape, jnp.bfloat16, options=opts)
    try:
      res = _measure.measure(spec)
    except Exception as e:  # noqa: BLE001 - report a flag libtpu refuses
      found.append(
        dict(
          variant=v,
          shape=shape,
          tp=tp,
          flag=flag,
          value=value,
          error=str(e).splitlines()[0][:200],
        )
      )
      continue
    key = (v, shape, tp)
    if flag is None:
      base[key] = res
      continue
    ref = base[key]
    row = dict(
      variant=v,
      shape=shape,
      tp=tp,
      flag=flag,
      value=value,
      changes_hlo=res.hlo_key != ref.hlo_key,
      step_us=res.row["step_us"],
      default_us=ref.row["step_us"],
    )
    found.append(row)
    mark = "CHANGES" if row["changes_hlo"] else "same"
    print(
      f"{v:20s} {str(shape):20s} tp{tp} {flag}={value}: {mark} "
      f"{row['step_us']:.1f} us (default {row['default_us']:.1f})",
      flush=True,
    )
  return found


if __name__ == "__main__":
  from asyncops import _cli

  sys.exit(_cli.run(main, prog=PROG))
