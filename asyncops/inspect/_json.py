"""A :class:`~asyncops.inspect.Report` as plain JSON-ready data.

Example:

  >>> import jax, jax.numpy as jnp
  >>> from asyncops.inspect import analyze
  >>> d = report_dict(analyze(jax.jit(lambda x: x + 1), jnp.zeros(4)))
  >>> d["hazards"], d["counts"]["inflight"]
  ([], 0)
"""

from __future__ import annotations

from typing import Any

from ._hlo import Frame, Instr
from ._report import Copy, Pair, Report

# Instructions that only re-label values: left out of a window's op list.
_PLUMBING = ("get-tuple-element", "tuple", "bitcast", "parameter", "constant")


def _frames(stack: tuple[Frame, ...]) -> list[dict[str, Any]]:
  return [
    {"file": f.file, "line": f.line, "function": f.function} for f in stack
  ]


def _op(i: Instr) -> dict[str, Any]:
  return {
    "name": i.name,
    "opcode": i.opcode,
    "shape": i.shape_text,
    "estimated_cycles": i.estimated_cycles,
    "source": i.source,
  }


def copy_dict(c: Copy) -> dict[str, Any]:
  """One copy: what, where from, and whether a transfer is touching it."""
  return {
    "name": c.name,
    "kind": c.kind,
    "opcode": c.opcode,
    "shape": c.shape,
    "computation": c.computation,
    "operand": c.operand,
    "memory_spaces": list(c.spaces),
    "estimated_cycles": c.estimated_cycles,
    "inflight": c.inflight or None,
    "source": c.source,
    "stack": _frames(c.instr.stack),
  }


def pair_dict(r: Report, p: Pair) -> dict[str, Any]:
  """One start/done pair with its window and the user lines of both."""
  start, done = r.module.instr(p.start), r.module.instr(p.done)
  ops = [i for i in p.between if i.opcode not in _PLUMBING]
  return {
    "start": p.start,
    "done": p.done,
    "kind": p.kind,
    "kernel": p.kernel,
    "done_kernel": p.done_kernel,
    "computation": p.computation,
    "done_computation": p.done_computation,
    "crossing": list(p.crossing),
    "window": {
      "ops": [_op(i) for i in ops],
      "n_instructions": len(p.between),
      "estimated_cycles": p.between_cycles,
      "overlapped": p.overlapped,
    },
    "source_live": p.source_live,
    "dest_live": p.dest_live,
    "start_source": p.start_source,
    "done_source": p.done_source,
    "start_stack": _frames(start.stack),
    "done_stack": _frames(done.stack),
  }


def copy_hazards(r: Report) -> list[str]:
  """One line per copy a program must not have: in-flight or defensive.

  A copy of a buffer a transfer is reading or writing gives wrong results;
  a defensive copy is a full read and write that XLA added because the
  program kept an old value alive (on a start's input, usually code that
  uses the ``x`` passed to a start instead of the one it returned).
  """
  out = []
  for c in r.copies:
    where = f" from {c.source}" if c.source else ""
    if c.inflight:
      out.append(f"in-flight copy %{c.name}{where}: {c.inflight}")
    elif c.kind == "defensive":
      out.append(f"defensive copy %{c.name} of %{c.operand}{where}")
  return out


def hazards(r: Report) -> list[str]:
  """:func:`copy_hazards`, and kernel transfers whose source or
  destination buffer does not live until the done (XLA may reuse it while
  the DMA runs)."""
  out = copy_hazards(r)
  for p in r.kernel_pairs:
    for what, live in (("source", p.source_live), ("destination", p.dest_live)):
      if not live:
        out.append(
          f"%{p.start} -> %{p.done}: {what} buffer not live until the done"
          f" (start at {p.start_source or 'unknown'})"
        )
  return out


def report_dict(r: Report) -> dict[str, Any]:
  """The whole report: copies, in-flight copies, pairs, memory, hazards."""
  copies = [copy_dict(c) for c in r.copies]
  return {
    "module": r.module.name,
    "compile_seconds": r.compile_seconds,
    "counts": {
      "copies": len(r.copies),
      "defensive": len(r.defensive_copies),
      "inflight": len(r.inflight_copies),
      "kernel_pairs": len(r.kernel_pairs),
      "pairs": len(r.pairs),
      "overlapped_kernel_pairs": sum(p.overlapped for p in r.kernel_pairs),
    },
    "copies": copies,
    "inflight_copies": [c for c in copies if c["inflight"]],
    "pairs": [pair_dict(r, p) for p in r.pairs],
    "memory": {k: int(v) for k, v in r.memory.items()},
    "hazards": hazards(r),
  }
