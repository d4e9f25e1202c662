"""The copies tools' findings: what the copy guard names, and the defensive
or in-flight copies it does not (``edge_copies``, ``loop_copies``)."""

from collections.abc import Callable

from asyncops.inspect import Report


def copy_findings(report: Report, found, where: Callable) -> list[str]:
  """One line per hazard in ``found`` (the guard's, of ``report``) and per
  defensive or in-flight copy no hazard names; ``where(copy)`` ends its
  line (the memory spaces and size, or the computation)."""
  named = {h.instr for h in found}
  bad = [f"{h.kind} %{h.instr}: {h.detail}" for h in found]
  bad += [
    f"{c.kind}{' in-flight' if c.inflight else ''} copy %{c.name} of "
    f"%{c.operand} {where(c)}"
    for c in report.copies
    if (c.kind == "defensive" or c.inflight) and c.name not in named
  ]
  return bad
