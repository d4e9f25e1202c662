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

Rule. The steps kernel's entry in :data:`._dma_cover.COVERS` (its output
``{0}``, a source, until the kernel that takes its send semaphores): the
sent partial sums must reach that done on every path (else ``"source not
live"``), and no copy in the window from the steps kernel to the done may
give the done its result in their place, nor copy them while they are not
live (``"in-flight copy"``). A copy that only reads them while the done
still holds them (a move between memory spaces) is allowed, as it is for
any source. Branch h-dmacover moved the rule into that table, which
declares every library kernel's buffers the same way; this module keeps
the steps kernel's view of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._dma_cover import base, cover_hazards, transfers

if TYPE_CHECKING:
  from ._report import Report

STEPS = "ring_reducescatter_matmul"
DONE = "asyncops_ring_reducescatter_done"


def sent_transfers(report: Report):
  """``(steps, done, pair, window)`` for each fused reduce-scatter steps
  kernel and the done that waits for its sends (``pair``: the start/done
  :class:`Pair` of that done, the start being the semaphores' maker;
  ``window``: the instructions scheduled between the steps kernel and the
  done)."""
  pairs = {(p.start, p.done): p for p in report.kernel_pairs}
  out = []
  for t in transfers(report):
    if base(t.kernel) != STEPS or base(t.waiter) != DONE:
      continue
    pair = pairs.get((t.sems[0], t.waiter.name))
    if pair is not None:
      out.append((t.kernel, t.waiter, pair, list(t.window)))
  return out


def sent_hazards(report: Report) -> list[tuple[str, str, str, str, str]]:
  """``(kind, instr, detail, steps, done)`` for each hazard to a fused
  reduce-scatter's sent partial sums: :func:`._dma_cover.cover_hazards`
  for the steps kernels."""
  steps = {
    i.name
    for c in report.module.computations.values()
    for i in c.instrs
    if i.opcode == "custom-call" and base(i) == STEPS
  }
  return [h for h in cover_hazards(report) if h[3] in steps]
