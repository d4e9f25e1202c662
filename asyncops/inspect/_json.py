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

from ._guard import hazards
from ._hlo import Frame, Instr
from ._report import COPY_KINDS, Copy, Pair, Report

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
    "bytes": c.nbytes,
    "estimated_cycles": c.estimated_cycles,
    "inflight": c.inflight or None,
    # Why the guard accepts a copy it would otherwise refuse.
    "accepted": next(
      (
        k
        for k in ("read_only_source", "feeds_source", "feeds_destination")
        if getattr(c, k)
      ),
      None,
    ),
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


def report_dict(r: Report) -> dict[str, Any]:
  """The whole report: copies, in-flight copies, pairs, memory, hazards."""
  copies = [copy_dict(c) for c in r.copies]
  found = hazards(r)
  return {
    "module": r.module.name,
    "compile_seconds": r.compile_seconds,
    "counts": {
      "copies": len(r.copies),
      "defensive": len(r.defensive_copies),
      "boundary": len(r.boundary_copies),
      "inflight": len(r.inflight_copies),
      "kernel_pairs": len(r.kernel_pairs),
      "pairs": len(r.pairs),
      "overlapped_kernel_pairs": sum(p.overlapped for p in r.kernel_pairs),
    },
    "copied_bytes": {
      k: r.copied_bytes(k) for k in COPY_KINDS if r.copied_bytes(k)
    },
    "copies": copies,
    "inflight_copies": [c for c in copies if c["inflight"]],
    "pairs": [pair_dict(r, p) for p in r.pairs],
    "memory": {k: int(v) for k, v in r.memory.items()},
    # The copy guard's findings (asyncops.inspect.hazards): in-flight and
    # defensive copies, in-place writes in a window, buffers not live.
    "hazards": [str(h) for h in found],
    "hazard_details": [h.to_dict() for h in found],
  }
