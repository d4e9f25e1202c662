"""``python -m asyncops.compare``: value API versus Ref API, from TPU HLO.

Compiles every pattern of :mod:`asyncops.compare` both ways ahead of time
for a TPU topology (8 devices, a 2x4 mesh) and prints, per side, the
defensive copies, copies of in-flight buffers, start/done pairs with
compute in their window, peak memory and lines of code.

Exit status: 0 clean; 1 a side has a defensive or in-flight copy; 2 a
usage error (one line on stderr).
"""

import os
import sys

from asyncops import _cli

PROG = "python -m asyncops.compare"


def main(argv=None) -> int:
  """Runs the command line; returns the exit status."""
  p = _cli.parser(PROG, __doc__)
  p.add_argument(
    "--topology",
    default="v5e:2x4",
    help="an 8-device TPU topology (default: v5e:2x4; also v6e:2x4, "
    "v4:2x2x1 and v5p:2x2x1 have 8 devices)",
  )
  p.add_argument(
    "--patterns",
    default="",
    help="comma list of pattern names (default: all)",
  )
  a = p.parse_args(argv)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  from asyncops.compare._patterns import BY_NAME, PATTERNS
  from asyncops.compare._table import format_table, rows

  names = [n for n in a.patterns.split(",") if n]
  unknown = [n for n in names if n not in BY_NAME]
  if unknown:
    raise _cli.UsageError(
      f"--patterns: unknown pattern {unknown[0]!r}; choose from "
      + ", ".join(BY_NAME)
    )
  patterns = [BY_NAME[n] for n in names] if names else list(PATTERNS)
  _cli.check_topology(a.topology)
  from asyncops.inspect import tpu_topology

  n = len(tpu_topology(a.topology).devices)
  if n != 8:
    raise _cli.UsageError(
      f"--topology: {a.topology} has {n} devices; the patterns need 8 "
      "(a 2x4 mesh), e.g. v5e:2x4"
    )
  table = rows(a.topology, patterns, progress=_cli.progress)
  bad = [
    f"{r['pattern']} ({side}): {r[side]['defensive']} defensive, "
    f"{r[side]['inflight']} in-flight copies"
    for r in table
    for side in ("value", "ref")
    if r[side]["defensive"] or r[side]["inflight"]
  ]
  _cli.write_json(
    a.json, {"topology": a.topology, "rows": table, "findings": bad}, indent=2
  )
  if not _cli.json_to_stdout(a.json):
    print(format_table(a.topology, table))
  return _cli.print_findings(bad, a.json)


if __name__ == "__main__":
  sys.exit(_cli.run(main, prog=PROG))
