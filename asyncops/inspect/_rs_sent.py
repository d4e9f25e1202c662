"""The fused reduce-scatter's sent partial sums: a transfer source the
semaphore trace does not see (branch h-rsrace).

Background. The fused matmul-reduce-scatter
(``kernels._reducescatter_matmul``) runs four kernels per row panel: the
start (a barrier; it returns the receive buffer and the DMA semaphores),
the steps kernel ``ring_reducescatter_matmul`` (every product and every
send), the finish and the done ``asyncops_ring_reducescatter_done``. The
steps kernel starts remote DMAs from its own output ``{0}``, the sent
partial sums (a VMEM buffer), and returns without waiting for the last of
them; the done waits for them and takes that output as an operand only to
keep it alive. The harness pairs the start with the done (the semaphores
go from one to the other) and checks the start's buffers, but the sent
partial sums are an output of a kernel it sees as a user of the
semaphores, so nothing checked them: XLA evicted one panel's sent partial
sums to HBM with copy-start/copy-done right after its steps kernel, gave
the done the copy and the original VMEM to the next panel's steps kernel
while the last sends could still read it (the fused all-reduce at (2048,
8192, 28672), bf16, v5e; ``design/collective_matmul.md``).

Rule. For each steps kernel and the done that waits on its send
semaphores (the same start's semaphore array as operand), the sent
partial sums must reach that done on every path (else ``"source not
live"``), and no copy in the window from the steps kernel to the done may
give the done its result in their place, nor copy them while they are not
live (``"in-flight copy"``). A copy that only reads them while the done
still holds them (a move between memory spaces) is allowed, as it is for
any source.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._analysis import SEM, _Graph, _inflight, _reaches, _resolve, _window

if TYPE_CHECKING:
  from ._hlo import Instr, Module
  from ._report import Report

STEPS = "ring_reducescatter_matmul"
DONE = "asyncops_ring_reducescatter_done"
SENT = (0,)  # the steps kernel's output the sends read


def _base(i: Instr) -> str:
  return i.name.split(".")[0]


def _sem_operands(m: Module, i: Instr) -> set:
  """The values (resolved) of ``i``'s semaphore operands."""
  return {
    _resolve(m, (o, ()))
    for o in i.operands
    if any(lf.memory_space == SEM for lf in m.instr(o).leaves)
  }


def sent_transfers(report: Report):
  """``(steps, done, pair, window)`` for each fused reduce-scatter steps
  kernel and the done that waits for its sends (``pair``: the start/done
  :class:`Pair` of that done; ``window``: the instructions scheduled
  between the steps kernel and the done).

  The done is the one whose semaphore operands are the steps kernel's
  send semaphores (both take the start's outputs); the window follows the
  start/done pair's crossing when the steps kernel is in the start's
  computation, else it is empty (the liveness test still runs)."""
  m = report.module
  dones = [
    (p, m.instr(p.done))
    for p in report.kernel_pairs
    if _base(m.instr(p.done)) == DONE
  ]
  out = []
  for c in m.computations.values():
    for i in c.instrs:
      if i.opcode != "custom-call" or _base(i) != STEPS:
        continue
      if not i.leaves or i.leaf(SENT) is None:
        continue
      sems = _sem_operands(m, i)
      for p, d in dones:
        if not sems & _sem_operands(m, d):
          continue
        same = i.computation == p.computation
        between = _window(m, i, d, p.crossing) if same else []
        out.append((i, d, p, between))
        break
  return out


def sent_hazards(report: Report) -> list[tuple[str, str, str, str]]:
  """``(kind, instr, detail, steps, done)`` for each hazard to a fused
  reduce-scatter's sent partial sums (the module's rule): ``kind`` is
  ``"in-flight copy"`` or ``"source not live"``, ``instr`` the copy or
  the steps kernel, ``steps`` and ``done`` the transfer's kernels."""
  m = report.module
  g = _Graph(m)
  copies = {c.name: c for c in report.copies}
  found = []
  for steps, done, pair, between in sent_transfers(report):
    src = [(steps.name, SENT)]
    sems = [
      (pair.start, lf.index)
      for lf in m.instr(pair.start).leaves
      if lf.memory_space == SEM
    ]
    live = _reaches(g, src, done, sems)
    what = (
      f"%{steps.name} ({STEPS})'s sent partial sums (output {{0}}), "
      f"which its remote DMAs read until %{done.name}"
    )
    touched = _inflight(m, g, steps, done, src, [], between, ("source",))
    for (name, _), why in touched.items():
      if live and not why.startswith("result used"):
        continue  # reads them while the done still holds them
      c = copies.get(name)
      shape = f", {c.shape}, {c.spaces[0]}->{c.spaces[1]}" if c else ""
      opcode = c.opcode if c else m.instr(name).opcode
      operand = c.operand if c else m.instr(name).operands[0]
      found.append(
        (
          "in-flight copy",
          name,
          f"%{name} ({opcode}{shape}) copies %{operand} in "
          f"%{m.instr(name).computation}: the {why} {what}: the done "
          "would hold the copy and XLA may reuse the buffer the sends "
          "still read",
          steps.name,
          done.name,
        )
      )
    if not live:
      found.append(
        (
          "source not live",
          steps.name,
          f"{what}, do not reach it on every path: XLA may free or reuse "
          "them while the last sends are in flight (order each row "
          "panel's done before the next panel's steps kernel)",
          steps.name,
          done.name,
        )
      )
  return found
