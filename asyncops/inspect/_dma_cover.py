"""Every buffer a DMA touches after its kernel returns (branch h-dmacover).

Background. The harness pairs each start kernel with the kernels its
semaphores reach (the dones) and checks the start's buffers over each
pair's window: the source must reach the done, the destination too, and
no copy in the window may read them or hand the done a copy
(``_analysis``). Three kinds of buffer escaped that: a buffer a kernel
that is *not* a start sends from (the fused reduce-scatter's steps
kernel sends its own output, the sent partial sums, until the done:
branch h-rsrace's race), a destination a start's *send* semaphore
counts (``copy_start``'s local DMA, the all-gather's and all-to-all's
copy into their own slot: ``send_done`` ends the source only, and a
``recv_done`` takes no semaphore of a copy, so no pair checked the
destination until ``send_done``), and the second source of a start that
sends two (the int8 fused all-gather's codes and scales: the pair asked
whether *any* source reached the done).

Rule. :data:`COVERS` declares, for each library kernel by name, which of
its operands and outputs its DMAs read or write after it returns, and
which semaphore (an operand or output of the kernel) the kernel that
ends that use takes. For each declared buffer and each custom call the
semaphore reaches (the waiter; the kernel itself excluded):

- the buffer must reach the waiter, or a kernel scheduled after it (the
  ``recv_done`` that holds a copy future's destination past its
  ``send_done``), or be an entry parameter the caller owns (a source);
  else ``"source not live"`` / ``"destination not live"``;
- no copy in the window from the kernel to the waiter may give the
  waiter its result in the buffer's place, nor copy the buffer while it
  is not live or while DMAs write it (``"in-flight copy"``); a copy that
  only reads a live source is allowed, as for any source;
- nothing in the window writes into it in place (``"in-place write"``).

A new kernel gets coverage by a line in :data:`COVERS`, not a module.
The table is names only: ``inspect`` sits below ``kernels`` and imports
nothing of it (``tests/test_layering.py``); each entry names the kernel
module whose body it describes.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from ._analysis import (
  SEM,
  _caller_owned,
  _Graph,
  _inflight,
  _inplace_writes,
  _reaches,
  _resolve,
  _window,
)

if TYPE_CHECKING:
  from ._hlo import Instr, Module
  from ._report import Report


@dataclasses.dataclass(frozen=True)
class Cover:
  """One buffer a kernel's DMAs use after the kernel returns.

  Attributes:
    buffer: ``"operand K"`` or ``"output K"``: the kernel's ``K``-th
      array operand or output (semaphores not counted), ``"output *"``
      every array output.
    role: ``"source"`` (the DMAs read it) or ``"destination"`` (they,
      or a peer's remote DMAs, write it).
    sems: ``"operand J"`` or ``"output J"``: the kernel's ``J``-th
      semaphore operand or output; the kernel that takes it (the
      waiter) ends the use.
    what: the buffer, in words, for the message.
    when: ``""`` always; ``"array outputs"`` / ``"no array outputs"``
      only when the kernel has some / none; ``"local"`` only when it has
      no barrier ``collective_id`` (an axis of size 1: the transfer is a
      local copy counted on the send semaphores).
  """

  buffer: str
  role: str
  sems: str
  what: str
  when: str = ""


_LOCAL = "destination (its local copy counts on the send semaphore)"

COVERS: dict[str, tuple[Cover, ...]] = {
  # kernels._reducescatter_matmul.steps: sends its output {0} on the send
  # semaphores (the start's, its first semaphore operand) until the done.
  "ring_reducescatter_matmul": (
    Cover("output 0", "source", "operand 0", "sent partial sums"),
  ),
  # kernels._allgather_matmul.compute_local (AgSpec.forward): at its end
  # relays receive slot 0 (its array operand 2, the start's receive
  # buffer) to the next neighbour's slot 2 on the start's send semaphores
  # (its semaphore operand 0) until the done; the peer's relay into this
  # device's slot 2 is the start's destination entry below.
  "ring_allgather_matmul_local": (
    Cover("operand 2", "source", "operand 0", "relayed half (receive slot 0)"),
  ),
  # kernels._allgather_matmul.start: sends x (and the int8 scales) on the
  # send semaphores (output 0) until the done; the peers write its
  # receive outputs, or with recv_in_out the result buffer it takes as
  # operand 1, on the receive semaphores (output 1) until the compute
  # kernel.
  "asyncops_ring_allgather_start": (
    Cover("operand 0", "source", "output 0", "chunk"),
    Cover(
      "operand 1",
      "source",
      "output 0",
      "scales",
      when="array outputs",
    ),
    Cover(
      "operand 1",
      "destination",
      "output 1",
      "result rows (the peers' receive slots)",
      when="no array outputs",
    ),
    Cover("output *", "destination", "output 1", "receive buffer"),
  ),
  # kernels._copy: one local DMA on its one (send) semaphore; recv_done
  # waits for nothing.
  "asyncops_copy_start": (
    Cover("output 1", "destination", "output 0", _LOCAL),
  ),
  # kernels._all_gather, kernels._all_to_all: the copy into the own slot
  # counts on the send semaphore.
  "asyncops_all_gather_start": (
    Cover("output 1", "destination", "output 0", _LOCAL),
  ),
  "asyncops_all_to_all_start": (
    Cover("output 1", "destination", "output 0", _LOCAL),
  ),
  # kernels._ppermute, kernels._bidirectional on an axis of size 1.
  "asyncops_ppermute_start": (
    Cover("output 1", "destination", "output 0", _LOCAL, when="local"),
  ),
  "asyncops_bidirectional_start": (
    Cover("output 1", "destination", "output 0", _LOCAL, when="local"),
    Cover("output 1", "destination", "output 1", _LOCAL, when="local"),
  ),
}


@dataclasses.dataclass(frozen=True)
class Transfer:
  """A declared buffer of ``kernel`` and one kernel that ends its use.

  Attributes:
    kernel: the kernel whose DMAs use the buffer.
    cover: its :data:`COVERS` entry.
    buffer: the buffer's position (resolved).
    label: ``"output {0}"`` / ``"operand 1"``.
    waiter: the custom call that takes the semaphore.
    sems: the semaphore's position (resolved).
    window: the instructions scheduled between the kernel and the
      waiter (empty when the waiter is not reached from the kernel's
      computation in order).
  """

  kernel: Instr
  cover: Cover
  buffer: tuple[str, tuple[int, ...]]
  label: str
  waiter: Instr
  sems: tuple[str, tuple[int, ...]]
  window: tuple[Instr, ...]


def base(i: Instr) -> str:
  """A custom call's name without XLA's ``.N`` suffix."""
  return i.name.split(".")[0]


def _is_sem(m: Module, name: str) -> bool:
  return any(lf.memory_space == SEM for lf in m.instr(name).leaves)


def _array_operands(m: Module, i: Instr) -> list[str]:
  return [
    o
    for o in i.operands
    if not _is_sem(m, o)
    and any(lf.num_elements > 1 for lf in m.instr(o).leaves)
  ]


def _positions(m: Module, i: Instr, spec: str, sems: bool):
  """``[(label, position)]`` for ``"operand K"`` / ``"output K"`` /
  ``"output *"`` among ``i``'s semaphores (``sems``) or arrays."""
  where, _, k = spec.partition(" ")
  if where == "operand":
    ops = (
      [o for o in i.operands if _is_sem(m, o)]
      if sems
      else _array_operands(m, i)
    )
    found = [(f"operand {n}", _resolve(m, (o, ()))) for n, o in enumerate(ops)]
  else:
    leaves = [lf for lf in i.leaves if (lf.memory_space == SEM) == sems]
    found = [
      (f"output {{{','.join(map(str, lf.index))}}}", (i.name, lf.index))
      for lf in leaves
    ]
  if k == "*":
    return found
  return found[int(k) : int(k) + 1]


def _applies(m: Module, i: Instr, c: Cover) -> bool:
  if c.when == "local":
    return i.collective_id is None
  if c.when:
    has = any(lf.memory_space != SEM for lf in i.leaves)
    return has == (c.when == "array outputs")
  return True


def _declared(report: Report):
  """``(kernel, cover, semaphore, ordered, waiters)`` for each entry of
  :data:`COVERS` that applies to a kernel in the module; ``waiters``
  maps each custom call the semaphore reaches (the kernel excluded) to
  the crossing to it."""
  m = report.module
  g = _Graph(m)
  for comp in m.computations.values():
    for i in comp.instrs:
      if i.opcode != "custom-call" or base(i) not in COVERS:
        continue
      for c in COVERS[base(i)]:
        if not _applies(m, i, c):
          continue
        sems = _positions(m, i, c.sems, sems=True)
        if not sems:
          continue
        sem = sems[0][1]
        # Traced from the kernel when it makes the semaphores, else from
        # their definition (crossings are then from that computation).
        origin = m.instr(sem[0])
        ordered = origin.name == i.name or (
          origin.computation == i.computation and origin.position < i.position
        )
        waiters = {}
        for hit in g.trace([sem], through_aliasing=False):
          u = hit.user
          if u.opcode == "custom-call" and u.name != i.name:
            waiters.setdefault(u.name, (u, hit.crossing))
        yield i, c, sem, ordered, waiters


def transfers(report: Report) -> list[Transfer]:
  """Each declared buffer of each library kernel in the module, with each
  kernel that takes the semaphore ending its use."""
  m = report.module
  out = []
  for i, c, sem, ordered, waiters in _declared(report):
    for label, pos in _positions(m, i, c.buffer, sems=False):
      for u, crossing in waiters.values():
        window = _window(m, i, u, crossing) if ordered else []
        out.append(Transfer(i, c, pos, label, u, sem, tuple(window)))
  return out


def unwaited(report: Report) -> list[tuple[Instr, Cover]]:
  """Declared kernels whose semaphore reaches no other kernel: nothing
  waits for the DMAs that use the buffer (the start's own semaphore
  trace counts the kernel itself as their done: the fused
  reduce-scatter's steps kernel takes the start's send semaphores)."""
  return [(i, c) for i, c, _, _, w in _declared(report) if not w]


def _held_after(m: Module, g: _Graph, t: Transfer) -> bool:
  """Whether a custom call other than the kernel takes the buffer where
  it is not known to run before the waiter (another computation, or
  later in the waiter's)."""
  w = t.waiter
  for hit in g.trace([t.buffer], through_aliasing=True):
    u = hit.user
    if u.opcode != "custom-call" or u.name in (t.kernel.name, w.name):
      continue
    if u.computation != w.computation or u.position > w.position:
      return True
  return False


def _before(m: Module, g: _Graph, t: Transfer) -> list[str]:
  """Custom calls taking the buffer scheduled before the waiter."""
  w = t.waiter
  return [
    hit.user.name
    for hit in g.trace([t.buffer], through_aliasing=False)
    if hit.user.opcode == "custom-call"
    and hit.user.name != t.kernel.name
    and hit.user.computation == w.computation
    and hit.user.position < w.position
  ]


def _waits_only(i: Instr) -> bool:
  """A library done kernel (``asyncops_*_done``): it aliases a
  destination to its result and writes nothing into it."""
  b = base(i)
  return (
    i.opcode == "custom-call"
    and b.startswith("asyncops_")
    and (b.endswith("_done"))
  )


def cover_hazards(report: Report) -> list[tuple[str, str, str, str, str]]:
  """``(kind, instr, detail, kernel, waiter)`` for each hazard to a
  declared buffer (the module's rule): ``kind`` is ``"in-flight copy"``,
  ``"in-place write"``, ``"source not live"`` or ``"destination not
  live"``; ``instr`` the copy, the write or the kernel."""
  m = report.module
  g = _Graph(m)
  copies = {c.name: c for c in report.copies}
  found = []
  for t in transfers(report):
    i, w, role = t.kernel, t.waiter, t.cover.role
    sems = [t.sems]
    live = (
      _reaches(g, [t.buffer], w, sems)
      or (role == "source" and _caller_owned(m, [t.buffer]))
      or _held_after(m, g, t)
    )
    verb = "read" if role == "source" else "write"
    what = (
      f"%{i.name} ({base(i)})'s {t.cover.what} ({t.label}), which DMAs "
      f"{verb} until %{w.name} waits for them"
    )
    srcs = [t.buffer] if role == "source" else []
    dsts = [t.buffer] if role == "destination" else []
    window = list(t.window)
    touched = _inflight(m, g, i, w, srcs, dsts, window, (role,))
    for (name, _), why in touched.items():
      if role == "source" and live and not why.startswith("result used"):
        continue  # reads a source while the waiter still holds it
      c = copies.get(name)
      shape = f", {c.shape}, {c.spaces[0]}->{c.spaces[1]}" if c else ""
      opcode = c.opcode if c else m.instr(name).opcode
      operand = c.operand if c else m.instr(name).operands[0]
      found.append(
        (
          "in-flight copy",
          name,
          f"%{name} ({opcode}{shape}) copies %{operand} in "
          f"%{m.instr(name).computation}: the {why} {what}: the waiting "
          "kernel would hold the copy, and XLA may reuse the buffer the "
          "DMAs still use",
          i.name,
          w.name,
        )
      )
    for text in _inplace_writes(m, g, i, w, srcs, dsts, window, (role,)):
      name = text.split()[0].lstrip("%")
      if _waits_only(m.instr(name)):
        continue  # a done aliases the buffer, it does not write it
      found.append(("in-place write", name, text, i.name, w.name))
    if not live:
      held = _before(m, g, t)
      why = (
        f"is held only by %{', %'.join(held)}, scheduled before it"
        if held
        else "does not reach it on every path"
      )
      found.append(
        (
          f"{role} not live",
          i.name,
          f"{what}, {why}: XLA may free, reuse or read it while the DMAs "
          "still use it (a copy on the way, or the kernel holding it run "
          "before the wait)",
          i.name,
          w.name,
        )
      )
  for i, c in unwaited(report):
    found.append(
      (
        "start with no done",
        i.name,
        f"%{i.name} ({base(i)})'s DMAs use its {c.what} after it returns, "
        f"and no kernel takes the semaphore ({c.sems}) that ends them: "
        "nothing waits for them while XLA treats the buffer as free",
        i.name,
        "",
      )
    )
  return found
