"""Finds starts, dones, their windows and the copies XLA inserted.

Values are followed leaf by leaf: a position is ``(instruction, shape
index)``. Starts are traced forward from their semaphore outputs through
get-tuple-element, tuple, bitcast, optimization barriers, calls,
conditionals (operand ``k + 1`` into branch ``k``, branch roots out) and
while loops (into the body, around the back edge, out of the loop) until a
custom call consumes them: that call is a done. Buffers are traced the
same way, and also through custom-call ``output_to_operand_aliasing``, to
decide whether a source reaches its done and which copies (including
fusions that only move a buffer) touch a buffer while a transfer is in
flight.

Example:

  >>> import jax, jax.numpy as jnp
  >>> r = analyze(jax.jit(lambda x: x + 1), jnp.zeros(4))
  >>> r.defensive_copies
  []
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Iterator
from typing import Any

from ._hlo import Instr, Module, parse_module
from ._mesh import compile_tpu
from ._report import Copy, Pair, Report, _space

SEM = 2
Pos = tuple[str, tuple[int, ...]]

_TRIVIAL = {
  "parameter",
  "constant",
  "get-tuple-element",
  "tuple",
  "bitcast",
  "copy",
  "copy-start",
  "copy-done",
  "opt-barrier",
  "after-all",
  "partition-id",
  "replica-id",
  "iota",
  "broadcast",
}
_PASS = {"bitcast", "opt-barrier", "optimization-barrier"}


def _is_kernel_start(i: Instr) -> bool:
  return i.opcode == "custom-call" and any(
    lf.memory_space == SEM for lf in i.leaves
  )


def _is_xla_start(i: Instr) -> bool:
  return i.opcode.endswith("-start")


def _label(i: Instr) -> str:
  parts = [
    p
    for p in i.op_name.split("/")
    if p and not p.startswith("jit(") and p not in ("shard_map",)
  ]
  return "/".join(parts) or i.opcode


@dataclasses.dataclass(frozen=True)
class _Hit:
  user: Instr
  operand: int
  index: tuple[int, ...]
  crossing: tuple[str, ...]


class _Graph:
  """Use lists and callers for forward traces."""

  def __init__(self, module: Module):
    self.m = module
    self.users: dict[str, list[tuple[Instr, int]]] = collections.defaultdict(
      list
    )
    self.callers: dict[str, list[Instr]] = collections.defaultdict(list)
    for c in module.computations.values():
      for i in c.instrs:
        for k, o in enumerate(i.operands):
          self.users[o].append((i, k))
        if i.opcode == "while" and i.body:
          self.callers[i.body].append(i)
        elif i.opcode == "call":
          for name in i.called:
            self.callers[name].append(i)
        elif i.opcode == "conditional":
          for name in dict.fromkeys(i.branches):
            self.callers[name].append(i)

  def param(self, comp: str, number: int) -> Instr | None:
    c = self.m.computations.get(comp)
    if c is None:
      return None
    for p in c.params:
      if p.parameter_number == number:
        return p
    return None

  def trace(
    self,
    starts: list[Pos],
    through_aliasing: bool,
    stop=lambda i: False,
    blocked: frozenset[Pos] | set[Pos] = frozenset(),
    seen: set[Pos] | None = None,
  ) -> Iterator[_Hit]:
    """Yields each non-structural use reached from ``starts``.

    ``blocked``: positions the trace does not enter (a conditional's
    result slot that not every branch fills from ``starts``:
    :func:`_reaches`). ``seen``: filled with every position reached."""
    seen = set() if seen is None else seen
    queue = collections.deque((s, ()) for s in starts)
    while queue:
      (name, idx), crossing = queue.popleft()
      if (name, idx) in seen or (name, idx) in blocked:
        continue
      seen.add((name, idx))
      instr = self.m.instr(name)
      nxt: list[tuple[Pos, tuple[str, ...]]] = []
      for user, k in self.users.get(name, ()):
        op = user.opcode
        if op == "get-tuple-element":
          if idx and idx[0] == user.tuple_index:
            nxt.append(((user.name, idx[1:]), crossing))
        elif op == "tuple":
          nxt.append(((user.name, (k,) + idx), crossing))
        elif op in _PASS:
          nxt.append(((user.name, idx), crossing))
        elif op == "while" and user.body:
          p = self.param(user.body, 0)
          if p is not None:
            nxt.append(((p.name, idx), crossing + (f"into %{user.name}",)))
        elif op == "call" and user.called:
          p = self.param(user.called[0], k)
          if p is not None:
            nxt.append(((p.name, idx), crossing + (f"into %{user.name}",)))
        elif op == "conditional" and 1 <= k <= len(user.branches):
          p = self.param(user.branches[k - 1], 0)
          if p is not None:
            step = f"into branch {k - 1} of %{user.name}"
            nxt.append(((p.name, idx), crossing + (step,)))
        else:
          hit = _Hit(user, k, idx, crossing)
          yield hit
          if stop(user):
            continue
          if through_aliasing and op == "custom-call":
            for out_idx, opnd, opnd_idx in user.aliasing:
              if opnd == k and opnd_idx == idx[: len(opnd_idx)]:
                rest = idx[len(opnd_idx) :]
                nxt.append(((user.name, out_idx + rest), crossing))
      if instr.is_root:
        for caller in self.callers.get(instr.computation, ()):
          if caller.opcode == "while" and caller.body == instr.computation:
            p = self.param(caller.body, 0)
            if p is not None:
              nxt.append(
                (
                  (p.name, idx),
                  crossing + (f"next iteration of %{caller.name}",),
                )
              )
            nxt.append(
              ((caller.name, idx), crossing + (f"out of %{caller.name}",))
            )
          elif caller.opcode in ("call", "conditional"):
            nxt.append(
              ((caller.name, idx), crossing + (f"out of %{caller.name}",))
            )
      queue.extend(nxt)


class _UnionFind:
  def __init__(self):
    self.parent: dict[Pos, Pos] = {}

  def find(self, x: Pos) -> Pos:
    self.parent.setdefault(x, x)
    while self.parent[x] != x:
      self.parent[x] = self.parent[self.parent[x]]
      x = self.parent[x]
    return x

  def union(self, a: Pos, b: Pos):
    ra, rb = self.find(a), self.find(b)
    if ra != rb:
      self.parent[ra] = rb


def _alias_classes(m: Module, g: _Graph) -> _UnionFind:
  """Union of positions that XLA must give the same buffer."""
  uf = _UnionFind()
  for c in m.computations.values():
    for i in c.instrs:
      leaves = [lf.index for lf in i.leaves]
      for idx in leaves:
        uf.find((i.name, idx))
      if i.opcode == "get-tuple-element" and i.operands:
        for idx in leaves:
          uf.union((i.name, idx), (i.operands[0], (i.tuple_index,) + idx))
      elif i.opcode == "tuple":
        for idx in leaves:
          if idx and idx[0] < len(i.operands):
            uf.union((i.name, idx), (i.operands[idx[0]], idx[1:]))
      elif i.opcode in _PASS and i.operands:
        for idx in leaves:
          uf.union((i.name, idx), (i.operands[0], idx))
      elif i.opcode == "custom-call":
        for out_idx, k, opnd_idx in i.aliasing:
          if k < len(i.operands):
            uf.union((i.name, out_idx), (i.operands[k], opnd_idx))
      elif i.opcode == "while" and i.body and i.operands:
        body = m.computations.get(i.body)
        cond = m.computations.get(i.condition or "")
        for idx in leaves:
          uf.union((i.name, idx), (i.operands[0], idx))
          if body is not None:
            bp = g.param(i.body, 0)
            if bp is not None:
              uf.union((i.name, idx), (bp.name, idx))
            uf.union((i.name, idx), (body.root.name, idx))
          if cond is not None:
            cp = g.param(cond.name, 0)
            if cp is not None:
              uf.union((i.name, idx), (cp.name, idx))
      elif i.opcode in ("call", "conditional"):
        # Operands enter the callee's parameters; callee roots and the
        # caller's result share a buffer (each branch root, for a
        # conditional).
        if i.opcode == "call":
          entries = [
            (c, k, k) for c in i.called[:1] for k in range(len(i.operands))
          ]
        else:
          entries = [(c, k + 1, 0) for k, c in enumerate(i.branches)]
        for callee, k, number in entries:
          comp, p = m.computations.get(callee), g.param(callee, number)
          if comp is None or k >= len(i.operands):
            continue
          if p is not None:
            for lf in p.leaves:
              uf.union((p.name, lf.index), (i.operands[k], lf.index))
          for idx in leaves:
            uf.union((i.name, idx), (comp.root.name, idx))
  return uf


def _has_compute(m: Module, instrs, starts_dones: set[str], depth=0) -> bool:
  for i in instrs:
    if i.name in starts_dones or i.opcode in _TRIVIAL:
      continue
    if i.opcode.endswith("-start") or i.opcode.endswith("-done"):
      continue
    if i.opcode in ("while", "call", "conditional"):
      if depth < 4 and any(
        _has_compute(m, m.computations[c].instrs, starts_dones, depth + 1)
        for c in i.called
        if c in m.computations
      ):
        return True
      continue
    if i.opcode in ("fusion", "convolution", "dot", "custom-call"):
      return True
    if any(lf.num_elements > 1 for lf in i.leaves):
      return True
  return False


def _window(m: Module, start: Instr, done: Instr, crossing) -> list[Instr]:
  comp = m.computations[start.computation]
  pos = start.position + 1
  out: list[Instr] = []
  for step in crossing:
    kind, _, name = step.rpartition(" %")
    w = m.instr(name)
    if kind.startswith("into"):
      out.extend(comp.instrs[pos : w.position])
      if w.opcode == "while":
        target = w.body
      elif w.opcode == "conditional":
        target = w.branches[int(kind.split()[2])]  # "into branch K of"
      else:
        target = w.called[0]
      comp, pos = m.computations[target], 0
    elif kind == "next iteration of":
      out.extend(comp.instrs[pos:])
      comp, pos = m.computations[w.body], 0
    else:  # out of
      out.extend(comp.instrs[pos:])
      comp, pos = m.computations[w.computation], w.position + 1
  if comp.name == done.computation:
    out.extend(comp.instrs[pos : done.position])
  return out


def _find_pairs(m: Module, g: _Graph):
  starts = [
    i
    for c in m.computations.values()
    for i in c.instrs
    if _is_kernel_start(i) or _is_xla_start(i)
  ]
  found = []
  dropped: list[tuple[Instr, str]] = []
  unwaited: list[tuple[Instr, tuple[int, ...]]] = []
  for s in starts:
    kernel = _is_kernel_start(s)
    leaves = [
      (s.name, lf.index)
      for lf in s.leaves
      if (lf.memory_space == SEM) or not kernel
    ]
    seen = set()
    reached: set[Pos] = set()
    for hit in g.trace(leaves, through_aliasing=False, seen=reached):
      u = hit.user
      is_done = (
        u.opcode == "custom-call" if kernel else u.opcode.endswith("-done")
      )
      if not is_done or u.name == s.name:
        continue
      key = (u.name, hit.crossing)
      if key in seen:
        continue
      seen.add(key)
      found.append((s, u, hit.crossing, kernel))
    if kernel and seen:
      # Each semaphore on its own: split dones (send_done, recv_done) wait
      # for some of a start's semaphores each, so a start that reaches a
      # done may still leave one semaphore unwaited, everywhere or on a
      # branch (a recv_done on one branch only).
      branches: dict[str, None] = {}
      for pos in leaves:
        leaf_reached: set[Pos] = set()
        crossings = [
          h.crossing
          for h in g.trace([pos], through_aliasing=False, seen=leaf_reached)
          if h.user.opcode == "custom-call" and h.user.name != s.name
        ]
        if not crossings:
          unwaited.append((s, pos[1]))
          continue
        for b in _unawaited_branches(m, g, s, leaf_reached, crossings):
          branches[b] = None
      dropped += [(s, b) for b in branches]
  return starts, found, dropped, unwaited


def _covers(d: Instr) -> tuple[str, ...]:
  """The buffers of a transfer a done kernel ends: a library
  ``send_done`` (``kernels._done.send_done``) waits for the sends only, so
  it ends the source's use and none of the destination's; a
  ``recv_done`` waits for the receives only (the destination). Any other
  done waits for both. The split dones of one start each close the window
  of their own buffer (the source may be reused after ``send_done`` while
  the destination is still being written)."""
  base = d.name.split(".")[0]
  if base.startswith("asyncops_") and base.endswith("_send_done"):
    return ("source",)
  if base.startswith("asyncops_") and base.endswith("_recv_done"):
    return ("destination",)
  return ("source", "destination")


def _unawaited_branches(
  m: Module, g: _Graph, s: Instr, reached, crossings
) -> list[str]:
  """Branches of the conditionals a start's semaphores enter on which no
  done waits for them.

  ``reached``: every position the semaphore trace of start ``s`` reached;
  ``crossings``: the boundaries crossed to each done found. A conditional
  the semaphores enter (some branch's parameter is reached) must lead to a
  done on every branch: traced afresh from that branch's parameter (the
  trace of the start visits each position once, so a second branch that
  passes the semaphores out of the conditional is not seen reaching the
  done), unless a done takes them without entering the conditional at
  all. A branch that does not take them, or drops them, leaves the DMA
  running with nothing waiting for it on that path; XLA sees its buffers
  dead there.
  """
  by_param = collections.defaultdict(list)
  for pos in reached:
    by_param[pos[0]].append(pos)
  out = []
  for c in m.computations.values():
    for i in c.instrs:
      if i.opcode != "conditional":
        continue
      params = [g.param(b, 0) for b in i.branches]
      if not any(p is not None and p.name in by_param for p in params):
        continue
      tag = f" of %{i.name}"
      if _awaited_around(g, i, reached, params):
        continue  # a done waits for them outside this conditional
      for k, p in enumerate(params):
        starts = by_param.get(p.name, []) if p is not None else []
        if not starts or not any(
          h.user.opcode == "custom-call" and h.user.name != s.name
          for h in g.trace(starts, through_aliasing=False)
        ):
          out.append(f"branch {k}{tag}")
  return out


def _awaited_around(g: _Graph, cond: Instr, reached, params) -> bool:
  """Whether a done takes the semaphores that reach ``cond``'s operands
  without passing through ``cond`` (XLA may hand a conditional operands
  no branch uses: the future is awaited after it, around it).

  Traced from the operand values themselves, so a done reached on
  another path (around an enclosing conditional, say) does not count: a
  branch nested in an outer branch that drops the future is still named
  (``design/inspect.md``, "Third audit").
  """
  ops = set(cond.operands[1:])
  seeds = [_resolve(g.m, pos) for pos in reached if pos[0] in ops]
  blocked = {
    (p.name, idx)
    for p in params
    if p is not None
    for idx in [()] + [lf.index for lf in p.leaves]
  }
  for lf_idx in list(blocked):
    name, idx = lf_idx
    for k in range(1, len(idx)):
      blocked.add((name, idx[:k]))
  return any(
    h.user.opcode == "custom-call"
    for h in g.trace(seeds, through_aliasing=False, blocked=blocked)
  )


def _is_ref_kernel(s: Instr) -> bool:
  """A start of the Ref API (``asyncops.stateful``)."""
  return "_ref_start" in s.name or "_ref_start" in (s.op_name or "")


def _buffers(m: Module, s: Instr):
  """Source (operand) and destination positions of a kernel start.

  The destination is the start's outputs that alias no operand; for a Ref
  API start it is the operand it aliases (the Ref's buffer the DMA writes
  in place, ``stateful._kernels``), and its source only the operands it
  does not alias. A Ref API start's slot indices (its ``s32[2]`` operand,
  read into SMEM when the kernel starts, never by the DMA) are not a
  buffer."""
  ref = _is_ref_kernel(s)
  aliased_ops = {k for _, k, _ in s.aliasing} if ref else set()
  srcs: list[Pos] = []
  dsts: list[Pos] = []
  for k, o in enumerate(s.operands):
    for lf in m.instr(o).leaves:
      slot = ref and lf.dtype == "s32" and lf.dims == (2,)
      if lf.memory_space != SEM and lf.num_elements > 1 and not slot:
        (dsts if k in aliased_ops else srcs).append((o, lf.index))
  aliased_outs = {a[0] for a in s.aliasing}
  dsts += [
    (s.name, lf.index)
    for lf in s.leaves
    if lf.memory_space != SEM
    and lf.index not in aliased_outs
    and lf.num_elements > 1
  ]
  return srcs, dsts


def _aliased_role(s: Instr) -> str:
  """What a start's aliased outputs are: a Ref API start aliases its
  destination, a value API start its source."""
  return "destination" if _is_ref_kernel(s) else "source"


def _reaches(
  g: _Graph, positions: list[Pos], done: Instr, sems: list[Pos] = ()
) -> bool:
  """Whether a buffer at ``positions`` is an operand of ``done`` on every
  path.

  Each position is first resolved to the value defining it (through
  get-tuple-element, tuple, bitcast, optimization barriers): a done that
  takes another bitcast of the same value holds the same buffer.

  A conditional's result slot counts only if *every* branch root fills it
  with the traced value (:func:`_partial_merges`). XLA gives the branch
  roots and the result one buffer and takes branches as exclusive: where
  one branch passes the source through and another computes a new value
  into that slot, the other branch writes into the very buffer the DMA
  reads, and on that path the done holds something else (XLA sees the
  source dead there). Any-path reachability called that source live
  (``design/inspect.md``, "Every path").

  ``sems``: the start's semaphore positions. A branch that awaits the
  transfer (the semaphores enter it, end at a done inside it and do not
  leave it) does not count for the merge test: on that path this done is
  not reached, the transfer ends at the branch's own done (whose pair
  checks that the buffer reaches it), and XLA keeps the buffer until that
  done reads it, so the branch may put anything in the slot after it. A
  branch the semaphores bypass (XLA forwards them around the conditional)
  or pass through still counts (``design/inspect.md``, "Third audit")."""
  if not positions:
    return True
  positions = [_resolve(g.m, p) for p in positions]
  awaiting: set[str] = set()
  if sems:
    sem_seen: set[Pos] = set()
    done_comps = {
      h.user.computation
      for h in g.trace(list(sems), through_aliasing=False, seen=sem_seen)
      if h.user.opcode == "custom-call"
    }
    carried = {name for name, _ in sem_seen}
    awaiting = {
      b
      for b, comp in g.m.computations.items()
      if g.param(b, 0) is not None
      and g.param(b, 0).name in carried
      and comp.root.name not in carried
      and done_comps & _under(g.m, b)
    }
  blocked: set[Pos] = set()
  for _ in range(16):
    seen: set[Pos] = set()
    # The whole trace, not up to the first hit on the done: the merge test
    # below needs every position the value reaches (an ``any`` stopped
    # early and called a merge partial whose other branches it had not
    # visited yet; design/inspect.md, "Third audit").
    hits = list(
      g.trace(positions, through_aliasing=True, blocked=blocked, seen=seen)
    )
    hit_done = any(hit.user.name == done.name for hit in hits)
    partial = _partial_merges(g, seen, awaiting) - blocked
    if not partial:
      return hit_done
    blocked |= partial
  return False


def _under(m: Module, comp: str) -> set[str]:
  """``comp`` and every computation it calls, transitively."""
  out, todo = set(), [comp]
  while todo:
    c = todo.pop()
    if c in out or c not in m.computations:
      continue
    out.add(c)
    todo.extend(n for i in m.computations[c].instrs for n in i.called)
  return out


def _partial_merges(
  g: _Graph, seen: set[Pos], awaiting: set[str] = frozenset()
) -> set[Pos]:
  """Conditional result slots some but not all branch roots fill from
  ``seen`` (positions a trace reached, with the branch parameters).

  ``awaiting``: branches that await the transfer (:func:`_reaches`), not
  counted."""
  out: set[Pos] = set()
  m = g.m
  for name, idx in list(seen):
    i = m.instr(name)
    if i.opcode != "conditional":
      continue
    for b in dict.fromkeys(i.branches):
      comp = m.computations.get(b)
      if b in awaiting:
        continue
      if comp is None or _resolve(m, (comp.root.name, idx)) not in seen:
        out.add((name, idx))
        break
  return out


def analyze_module(
  m: Module,
  hlo_text: str = "",
  compile_seconds: float = 0.0,
  memory: dict[str, Any] | None = None,
) -> Report:
  """Builds a :class:`Report` from a parsed module."""
  g = _Graph(m)
  uf = _alias_classes(m, g)
  starts, found, dropped, unwaited = _find_pairs(m, g)
  start_done_names = {s.name for s in starts} | {f[1].name for f in found}

  pairs: list[Pair] = []
  records: dict[tuple[str, tuple[int, ...]], list] = collections.defaultdict(
    list
  )
  inflight: dict[
    tuple[str, tuple[int, ...]], tuple[str, tuple[str, str], bool]
  ] = {}
  for s, d, crossing, kernel in found:
    between = _window(m, s, d, crossing)
    srcs, dsts = _buffers(m, s) if kernel else ([], [])
    covers = _covers(d)
    srcs = srcs if "source" in covers else []
    dsts = dsts if "destination" in covers else []
    sems = [(s.name, lf.index) for lf in s.leaves if lf.memory_space == SEM]
    # A source a loop body passes through unchanged is the loop operand's
    # buffer (:func:`_loop_invariant`): the done may take that operand, and
    # a write into it in the window is a write into the source.
    hoisted = [_loop_invariant(m, g, p) for p in srcs]
    moved = hoisted != [_resolve(m, p) for p in srcs]
    writes = (
      _inplace_writes(
        m,
        g,
        s,
        d,
        srcs + hoisted if moved else srcs,
        dsts,
        between,
        covers,
      )
      if kernel
      else ()
    )
    pairs.append(
      Pair(
        start=s.name,
        done=d.name,
        kind="kernel" if kernel else "xla",
        kernel=_label(s),
        done_kernel=_label(d),
        computation=s.computation,
        done_computation=d.computation,
        crossing=tuple(crossing),
        between=tuple(between),
        between_cycles=float(sum(i.estimated_cycles or 0 for i in between)),
        overlapped=_has_compute(m, between, start_done_names),
        source_live=(
          _reaches(g, srcs, d, sems)
          or _caller_owned(m, srcs)
          or (moved and _reaches(g, hoisted, d, sems))
          if kernel
          else True
        ),
        dest_live=_reaches(g, dsts, d, sems) if kernel else True,
        start_source=s.where,
        done_source=d.where,
        inplace_writes=writes,
      )
    )
    if not kernel:
      continue
    for key, why in _inflight(m, g, s, d, srcs, dsts, between, covers).items():
      records[key].append((s, d, pairs[-1], why))
      hazard = "destination" in why or not pairs[-1].source_live
      if key in inflight and (inflight[key][2] or not hazard):
        continue  # a copy in flight for several transfers: the worst grade
      inflight[key] = (
        f"{why} %{s.name} ({_label(s)}) while in flight to %{d.name}"
        + (f" [{', '.join(crossing)}]" if crossing else ""),
        (s.name, d.name),
        hazard,
      )

  comm = _comm_classes(m, uf, starts)
  xla_comm = _moved(m, uf, g, set(comm) | _xla_comm_classes(m, uf))
  copies = [
    _classify(
      m,
      uf,
      i,
      out_idx,
      k,
      *inflight.get((i.name, out_idx), ("", (), False)),
      comm,
      xla_comm,
    )
    for c in m.computations.values()
    for i in c.instrs
    for out_idx, k in copy_ops(m, i)
  ]
  copies = [
    dataclasses.replace(c, read_only_source=True)
    if c.inflight
    and c.kind == "memory_space"
    and _read_only_source(m, g, c, records[_copy_key(c)])
    else c
    for c in copies
  ]
  feeds = {
    c.name: _feeds_start(m, g, c)
    for c in copies
    if c.kind == "defensive" and not c.inflight
  }
  copies = [
    dataclasses.replace(
      c,
      feeds_source=feeds.get(c.name) == "source",
      feeds_destination=feeds.get(c.name) == "destination",
    )
    for c in copies
  ]
  return Report(
    hlo_text=hlo_text,
    compile_seconds=compile_seconds,
    memory=memory or {},
    module=m,
    copies=tuple(copies),
    pairs=tuple(pairs),
    starts=tuple(starts),
    dones=tuple(dict.fromkeys(m.instr(p.done) for p in pairs)),
    schedule={name: c.instrs for name, c in m.computations.items()},
    unawaited_branches=tuple((st.name, b) for st, b in dropped),
    unawaited_semaphores=tuple((st.name, idx) for st, idx in unwaited),
  )


_MOVES = ("copy", "bitcast")


def copy_ops(m: Module, i: Instr) -> list[tuple[tuple[int, ...], int]]:
  """The whole-buffer copies ``i`` performs, as ``(output index, operand)``.

  A ``copy`` or ``copy-start``; a ``dynamic-update-slice`` whose update
  covers the whole result (a copy of the update); or a ``fusion`` whose
  root (or root tuple element) reaches a fused parameter through copies,
  bitcasts and whole-result dynamic-update-slices only, so all it does is
  move one operand into a new buffer. Results of <= 1 element are only
  reported for ``copy``/``copy-start`` (loop counters, as before). Nothing
  inside a fused computation is a copy: it owns no buffer.

  Args:
    m: the module (for fused computations).
    i: any instruction.

  Returns:
    ``[(output shape index, operand number), ...]``; empty if ``i`` is not a
    copy.

  Example:

    >>> m = parse_module('''HloModule m
    ... ENTRY %e (p: f32[8]) -> f32[8] {
    ...   %p = f32[8]{0} parameter(0)
    ...   ROOT %c = f32[8]{0} copy(%p)
    ... }''')
    >>> copy_ops(m, m.instr("c"))
    [((), 0)]
  """
  if not i.operands or i.computation in _fused(m):
    # Inside a fusion nothing owns a buffer (e.g. XLA's ``bitcast_fusion``
    # operand feeders of a convolution fusion): not a copy.
    return []
  if i.opcode == "copy":
    return [((), 0)]
  if i.opcode == "copy-start":
    return [((0,), 0)]
  if i.opcode == "dynamic-update-slice":
    return [((), 1)] if _whole_update(m, i) else []
  if i.opcode != "fusion" or not i.called:
    return []
  fused = m.computations.get(i.called[0])
  if fused is None:
    return []
  root = fused.root
  outs = (
    [((j,), m.instr(o)) for j, o in enumerate(root.operands)]
    if root.opcode == "tuple"
    else [((), root)]
  )
  found = []
  for out_idx, node in outs:
    leaf = i.leaf(out_idx)
    if leaf is None or leaf.num_elements <= 1:
      continue
    for _ in range(16):
      if node.opcode in _MOVES and node.operands:
        node = m.instr(node.operands[0])
      elif node.opcode == "dynamic-update-slice" and _whole_update(m, node):
        node = m.instr(node.operands[1])
      else:
        break
    if (
      node.opcode == "parameter"
      and node.parameter_number is not None
      and node.parameter_number < len(i.operands)
      and node.leaves
      and node.leaves[0].num_elements == leaf.num_elements
    ):
      found.append((out_idx, node.parameter_number))
  return found


def _fused(m: Module) -> set[str]:
  """Names of fused computations (called by a ``fusion``)."""
  cache = m.__dict__.get("_fused")
  if cache is None:
    cache = {
      c
      for comp in m.computations.values()
      for i in comp.instrs
      if i.opcode == "fusion"
      for c in i.called
    }
    object.__setattr__(m, "_fused", cache)
  return cache


def _whole_update(m: Module, i: Instr) -> bool:
  if len(i.operands) < 2 or not i.leaves:
    return False
  update = m.instr(i.operands[1])
  return bool(update.leaves) and (
    update.leaves[0].num_elements == i.leaves[0].num_elements
  )


def _inflight(
  m: Module,
  g: _Graph,
  s: Instr,
  d: Instr,
  srcs: list[Pos],
  dsts: list[Pos],
  between: list[Instr],
  covers: tuple[str, ...] = ("source", "destination"),
) -> dict[tuple[str, tuple[int, ...]], str]:
  """Copies in the window of ``s -> d`` that touch the transfer's buffers.

  A copy is in flight when it reads a value that *is* the source or the
  destination (traced forward from the start through tuples, loop carries,
  calls and conditional branches, never through a done's aliasing), or when
  its result reaches ``d`` in an operand slot that carries the transfer's
  buffers (so the done would alias a buffer the DMA never touched).
  """
  window = {i.name for i in _nested(m, between)}
  seeds = {
    "source": [_resolve(m, p) for p in srcs],
    "destination": [_resolve(m, p) for p in dsts],
  }
  if _aliased_role(s) in covers:
    seeds[_aliased_role(s)] += [(s.name, out) for out, _, _ in s.aliasing]
  found: dict[tuple[str, tuple[int, ...]], str] = {}
  slots: dict[int, str] = {}
  for role, positions in seeds.items():
    for hit in g.trace(positions, through_aliasing=False):
      u = hit.user
      if u.name == d.name:
        slots.setdefault(hit.operand, role)
      if u.name not in window or hit.index != ():
        continue
      for out_idx, k in copy_ops(m, u):
        if k == hit.operand:
          found.setdefault((u.name, out_idx), f"{role} of")
  for _, k, _ in d.aliasing:
    slots.setdefault(k, "destination")
  for i in between:
    for out_idx, _ in copy_ops(m, i):
      if found.get((i.name, out_idx), "").startswith("destination"):
        continue  # already the worst grade
      result = [(i.name, out_idx)]
      if i.opcode == "copy-start":  # the copy's value is the copy-done's
        result = [
          (u.name, ()) for u, _ in g.users[i.name] if u.opcode == "copy-done"
        ]
      for hit in g.trace(result, through_aliasing=False):
        if hit.user.name == d.name and hit.operand in slots:
          found[(i.name, out_idx)] = (
            f"result used as the {slots[hit.operand]} of"
          )
          break
  return found


_VALUE_STARTS = tuple(
  f"asyncops_{kind}_start"
  for kind in ("ppermute", "all_gather", "all_to_all", "bidirectional", "copy")
)


_FUSED_AG_START = "asyncops_ring_allgather_start"


def _roles(m: Module, s: Instr) -> tuple[set[Pos], set[Pos]] | None:
  """The positions a start kernel's DMA only reads, and those it writes.

  Known from the kernels, not from the HLO (a kernel body is opaque), so
  only for the library's own starts: a value-API start
  (``kernels._common.start_call``, ``_bidirectional``, ``_copy``) aliases
  its one operand, the source, to output ``{0}`` only to keep it alive and
  writes its other outputs; the fused all-gather's start aliases nothing,
  reads its operands and writes its receive outputs (or, with no array
  output, reads operand 0 and its peers write operand 1); a Ref-API start
  (``stateful._kernels.start``)
  aliases the destination operand to output ``{0}`` and only reads its
  operands that are not aliased (not the slot indices). ``None`` for any
  other kernel. Positions are resolved through get-tuple-element, tuple,
  bitcast and optimization barriers (:func:`_resolve`).
  """
  base = s.name.split(".")[0]
  arrays = [
    k
    for k, o in enumerate(s.operands)
    if any(
      lf.memory_space != SEM
      and lf.num_elements > 1
      and not (lf.dtype == "s32" and lf.dims == (2,))
      for lf in m.instr(o).leaves
    )
  ]
  outs = [lf.index for lf in s.leaves if lf.memory_space != SEM]
  if _is_ref_kernel(s) and base.endswith("_ref_start"):
    aliased = {k for _, k, _ in s.aliasing}
    srcs = {
      _resolve(m, (s.operands[k], ())) for k in arrays if k not in aliased
    }
    dsts = {_resolve(m, (s.operands[k], ())) for k in aliased}
    dsts |= {(s.name, out) for out, _, _ in s.aliasing}
    return srcs, dsts
  if base in _VALUE_STARTS and arrays == [0] and s.aliasing == (((0,), 0, ()),):
    srcs = {_resolve(m, (s.operands[0], ())), (s.name, (0,))}
    return srcs, {(s.name, out) for out in outs if out != (0,)}
  if base == _FUSED_AG_START and arrays and not s.aliasing:
    # ``kernels._allgather_matmul.start``: sends ``x`` (and its scales);
    # the peers write its receive outputs, or, with the receive slots in
    # the result's rows, the result buffer it takes as operand 1.
    if outs:
      srcs = {_resolve(m, (s.operands[k], ())) for k in arrays}
      return srcs, {(s.name, out) for out in outs}
    if arrays == [0, 1]:
      return {_resolve(m, (s.operands[0], ()))}, {
        _resolve(m, (s.operands[1], ()))
      }
  return None


def _copy_key(c: Copy) -> tuple[str, tuple[int, ...]]:
  """The ``(name, output index)`` :func:`copy_ops` gave ``c``."""
  return (c.name, (0,) if c.opcode == "copy-start" else c.output_index)


def _read_only_source(m: Module, g: _Graph, copy: Copy, records) -> bool:
  """Whether an in-flight copy only reads sources that stay live.

  ``records``: ``(start, done, pair, why)`` for every kernel pair whose
  buffers the copy ``c`` touches inside the pair's window. For each:

  1. the start is one of the library's (:func:`_roles` knows what its DMA
     reads) and the copy, the start and the done are in one computation,
     in that order, with no loop or branch crossed (``pair.crossing``);
  2. the copy's operand *is* (through get-tuple-element, tuple, bitcast,
     optimization barrier) a buffer the DMA only reads, and no buffer it
     writes;
  3. the pair's source and destination reach its done, nothing in the
     window writes into them (``pair.inplace_writes``), and the done takes
     the source itself as an operand (the same value, not a merge);
  4. the copy's result reaches neither the done nor the start.

  Then both the copy and the DMA only read a buffer no one writes and XLA
  cannot free before the done, and the done never waits on the copy.
  """
  if not records:
    return False
  c = copy.instr
  for s, d, pair, why in records:
    roles = _roles(m, s)
    if roles is None or pair.crossing or not why.startswith("source"):
      return False
    if not (
      c.computation == s.computation == d.computation
      and s.position < c.position < d.position
    ):
      return False
    srcs, dsts = roles
    read = _resolve(m, (copy.operand, ()))
    if read not in srcs or read in dsts:
      return False
    if not (pair.source_live and pair.dest_live) or pair.inplace_writes:
      return False
    if not _caller_owned(m, srcs) and not any(
      _resolve(m, (o, ())) in srcs for o in d.operands
    ):
      return False
    result = [(c.name, ())]
    if c.opcode == "copy-start":
      result = [
        (u.name, ()) for u, _ in g.users[c.name] if u.opcode == "copy-done"
      ]
    # A caller-owned source (an entry parameter) stays live without the
    # done, so the done may take the copy (XLA's VMEM prefetch for it).
    ends = (s.name,) if _caller_owned(m, srcs) else (s.name, d.name)
    for hit in g.trace(result, through_aliasing=False):
      if hit.user.name in ends:
        return False
  return True


def _feeds_start(m: Module, g: _Graph, copy: Copy) -> str:
  """The role of the buffer a copy not in flight makes for a library start:
  ``"source"``, ``"destination"``, or ``""`` (neither: not accepted).

  The copy's value (its ``copy-done`` for a ``copy-start``), through
  get-tuple-element/tuple/bitcast/optimization barriers only, is an operand
  of a start that :func:`_roles` knows, the copy is scheduled before that
  start in the same computation (no loop or branch crossed), and it is
  used by nothing else. Then the copy reads no buffer in flight (else
  ``copy.inflight``) and writes a new buffer, completely, before any DMA
  touches it (the start takes it: data dependence), and no one else ever
  reads or writes that buffer except through the start; from the start on
  it is the start's own buffer, which the pair's checks cover (live until
  the done, no copy or write of it in the window).

  ``"source"``: the operand is one the DMA only reads (a value-API start's
  operand, a Ref-API start's unaliased one). XLA adds such a copy because a
  value-API start aliases its operand to an output, so it must not take a
  value read again afterwards. ``"destination"``: the operand is the one a
  Ref-API start aliases to its output ``{0}`` and the DMA writes in place
  (the destination Ref's buffer); XLA adds such a copy when the Ref's
  initial value is also another value's buffer (``new_ref(v)`` twice, CSE'd
  into one ``v``, or ``v`` read again after the start), so the in-place
  write must not reach ``v``. The copy gives the destination its initial
  value (which a partial permutation, or a slot the DMA does not write,
  keeps), exactly as the program says.
  """
  c = copy.instr
  value = c.name
  if c.opcode == "copy-start":
    done = [u for u, _ in g.users[c.name] if u.opcode == "copy-done"]
    if len(done) != 1:
      return ""
    value = done[0].name
  elif copy.output_index != () or c.opcode != "copy":
    return ""
  users = list(g.trace([(value, ())], through_aliasing=False))
  if len(users) != 1:
    return ""
  s = users[0].user
  if (
    s.computation != c.computation
    or s.position <= m.instr(value).position
    or users[0].crossing
  ):
    return ""
  roles = _roles(m, s) if _is_kernel_start(s) else None
  if roles is None:
    return ""
  srcs, dsts = roles
  k = users[0].operand
  pos = _resolve(m, (s.operands[k], users[0].index))
  if pos != (value, ()):
    return ""
  if pos in srcs and pos not in dsts:
    return "source"
  aliased = {opnd for _, opnd, opnd_idx in s.aliasing if opnd_idx == ()}
  if _is_ref_kernel(s) and pos in dsts and pos not in srcs and k in aliased:
    return "destination"
  return ""


_IN_PLACE = {"dynamic-update-slice": 0, "scatter": 0}


def _writes_operand(m: Module, u: Instr, k: int) -> bool:
  """Whether ``u`` may write its result into operand ``k``'s buffer.

  In-place ops (dynamic-update-slice, scatter), fusions whose root is one
  of them on that operand, and custom calls aliasing it (other than our own
  start and done kernels, which only read the source and wait for the
  destination). XLA may also let an elementwise fusion reuse a dying
  operand's buffer; buffer assignment is not printed, so that is not seen.
  """
  if _IN_PLACE.get(u.opcode) == k:
    return True
  if u.opcode == "custom-call":
    if any(lf.memory_space == SEM for lf in u.leaves) or any(
      lf.memory_space == SEM for o in u.operands for lf in m.instr(o).leaves
    ):
      return False  # a start or done kernel
    return any(opnd == k for _, opnd, _ in u.aliasing)
  if u.opcode != "fusion" or not u.called:
    return False
  fused = m.computations.get(u.called[0])
  if fused is None:
    return False
  root = fused.root
  roots = (
    [m.instr(o) for o in root.operands] if root.opcode == "tuple" else [root]
  )
  for r in roots:
    while r.opcode == "bitcast" and r.operands:
      r = m.instr(r.operands[0])
    slot = _IN_PLACE.get(r.opcode)
    if slot is None or slot >= len(r.operands):
      continue
    p = m.instr(r.operands[slot])
    while p.opcode == "bitcast" and p.operands:
      p = m.instr(p.operands[0])
    if p.opcode == "parameter" and p.parameter_number == k:
      return True
  return False


def _inplace_writes(
  m: Module,
  g: _Graph,
  s: Instr,
  d: Instr,
  srcs: list[Pos],
  dsts: list[Pos],
  between: list[Instr],
  covers: tuple[str, ...] = ("source", "destination"),
) -> tuple[str, ...]:
  """Instructions in the window of ``s -> d`` writing into its buffers.

  The source and destination of :func:`_buffers` and the start's aliased
  output (the source of a value API start, the destination of a Ref API
  start), traced forward through tuples, loop carries and calls, not
  through aliasing.
  """
  window = {i.name for i in _nested(m, between)}
  aliased = [(s.name, out_idx) for out_idx, _, _ in s.aliasing]
  found: dict[str, str] = {}
  seeds = {
    "source": [_resolve(m, p) for p in srcs],
    "destination": [_resolve(m, p) for p in dsts],
  }
  if _aliased_role(s) in covers:
    seeds[_aliased_role(s)] += aliased
  for role, positions in seeds.items():
    for hit in g.trace(positions, through_aliasing=False):
      u = hit.user
      if u.name not in window or hit.index != () or u.name == d.name:
        continue
      if _writes_operand(m, u, hit.operand):
        where = f" at {u.where}" if u.where else ""
        found.setdefault(
          u.name, f"%{u.name} ({u.opcode}) writes into the {role}{where}"
        )
  return tuple(found.values())


def _nested(m: Module, instrs) -> list[Instr]:
  """``instrs`` and everything the computations they call run (a
  conditional or loop inside a window runs its branches there too)."""
  out, todo, seen = [], list(instrs), set()
  while todo:
    i = todo.pop()
    out.append(i)
    if i.computation in _fused(m):
      continue
    for c in i.called:
      if c in m.computations and c not in seen and c not in _fused(m):
        seen.add(c)
        todo.extend(m.computations[c].instrs)
  return out


def _caller_owned(m: Module, positions: list[Pos]) -> bool:
  """Whether every position is an entry parameter the caller owns.

  An entry computation's parameter that the module neither aliases to an
  output nor takes as a donor (``Module.donated_params``) is the caller's
  buffer: XLA never frees, reuses or writes it while the program runs, so
  a DMA reading it needs no done to keep it alive (XLA may hand the done a
  VMEM copy instead, as on v6e for the fused all-gather's ``x``:
  ``design/inspect.md``, "A parameter is live for the whole program").
  A donated parameter is not: XLA may give its buffer to an output.
  """
  if not positions:
    return False
  for pos in positions:
    name, idx = _resolve(m, pos)
    i = m.instr(name)
    if (
      idx
      or i.opcode != "parameter"
      or i.computation != m.entry_name
      or i.parameter_number is None
      or i.parameter_number in m.donated_params
    ):
      return False
  return True


def _loop_invariant(m: Module, g: _Graph, pos: Pos) -> Pos:
  """The outer value a loop-invariant position is, else ``pos`` resolved.

  A ``while`` body's parameter element ``i`` that the body passes through
  unchanged (its ROOT is a tuple whose element ``i`` is exactly
  ``get-tuple-element(param, i)``) holds, on every iteration and after
  the loop, the buffer of the while's operand element ``i``: buffer
  assignment gives the operand, the body parameter, the ROOT element and
  the while's result one value, one allocation (v5e, v6e, v5p, v4), and
  XLA may then hand a use after the loop the operand itself instead of
  the while's result (``design/inspect.md``, "A Ref future carried
  through scan, awaited in a branch"). Followed outward through nested
  loops. Only that exact pattern: a body writing the element, or a copy
  on the way (inside the body or before the loop), stops it, and a
  parameter of a body run by more than one while, or of a branch or a
  call, is left as it is.
  """
  pos = _resolve(m, pos)
  for _ in range(16):
    name, idx = pos
    p = m.instr(name)
    if p.opcode != "parameter" or p.parameter_number != 0 or not idx:
      break
    callers = g.callers.get(p.computation, ())
    if len(callers) != 1 or callers[0].opcode != "while":
      break
    w = callers[0]
    root = m.computations[p.computation].root
    if (
      w.body != p.computation
      or len(w.operands) != 1
      or root.opcode != "tuple"
      or idx[0] >= len(root.operands)
    ):
      break
    e = m.instr(root.operands[idx[0]])
    if (
      e.opcode != "get-tuple-element"
      or list(e.operands) != [name]
      or e.tuple_index != idx[0]
    ):
      break
    pos = _resolve(m, (w.operands[0], idx))
  return pos


def _resolve(m: Module, pos: Pos) -> Pos:
  """Follows get-tuple-element/tuple/bitcast back to the defining value."""
  name, idx = pos
  for _ in range(64):
    i = m.instr(name)
    if i.opcode == "get-tuple-element" and i.operands:
      name, idx = i.operands[0], (i.tuple_index,) + idx
    elif i.opcode == "tuple" and idx and idx[0] < len(i.operands):
      name, idx = i.operands[idx[0]], idx[1:]
    elif i.opcode in _PASS and i.operands:
      name = i.operands[0]
    else:
      break
  return name, idx


def _producer_source(m: Module, name: str, depth: int = 0) -> str:
  i = m.instr(name)
  if i.source or depth > 8:
    return i.where
  if i.opcode in ("get-tuple-element", "bitcast") and i.operands:
    return _producer_source(m, i.operands[0], depth + 1)
  return ""


def _layout(shape_text: str) -> str:
  """The layout of an array shape, without its memory space.

  ``f32[8,128]{0,1:T(8,128)S(1)}`` gives ``0,1:T(8,128)``.
  """
  start = shape_text.find("{")
  if start < 0:
    return ""
  inner = shape_text[start + 1 : shape_text.rfind("}")]
  return re.sub(r"S\(\d+\)", "", inner)


def _comm_classes(m: Module, uf: _UnionFind, starts) -> dict[Pos, str]:
  """Alias classes holding a kernel start's source or destination.

  Maps each class root to the first start (by name) whose buffers are in
  it: the start's array operands and outputs, which XLA joins through the
  start's aliasing, the done's aliasing and loop carries.
  """
  out: dict[Pos, str] = {}
  for s in starts:
    if not _is_kernel_start(s):
      continue
    srcs, _ = _buffers(m, s)
    outs = [
      (s.name, lf.index)
      for lf in s.leaves
      if lf.memory_space != SEM and lf.num_elements > 1
    ]
    for pos in srcs + outs:
      out.setdefault(uf.find(pos), s.name)
  return out


_XLA_COLLECTIVES = (
  "all-gather",
  "all-reduce",
  "reduce-scatter",
  "collective-permute",
  "all-to-all",
)


def _xla_comm_classes(m: Module, uf: _UnionFind) -> set[Pos]:
  """Alias classes holding the result of one of XLA's own collectives."""
  out = set()
  for c in m.computations.values():
    for i in c.instrs:
      op = i.opcode.removesuffix("-done").removesuffix("-start")
      if op in _XLA_COLLECTIVES and not i.opcode.endswith("-start"):
        out.update(uf.find((i.name, lf.index)) for lf in i.leaves)
  return out


def _moved(m: Module, uf: _UnionFind, g: _Graph, classes: set[Pos]) -> set[Pos]:
  """``classes`` and every class one memory-space move away, transitively.

  XLA may copy a parameter HBM->HBM for a start and then move the copy
  into VMEM (or the reverse for a result): the edge copy's result is then
  one move away from the communication buffer.
  """
  moves = []
  for c in m.computations.values():
    for i in c.instrs:
      for out_idx, k in copy_ops(m, i):
        src = uf.find((i.operands[k], ()))
        if i.opcode == "copy-start":
          dsts = [
            uf.find((u.name, ()))
            for u, _ in g.users.get(i.name, ())
            if u.opcode == "copy-done"
          ]
        else:
          dsts = [uf.find((i.name, out_idx))]
        moves += [(src, d) for d in dsts]
  out = set(classes)
  changed = True
  while changed:
    changed = False
    for a, b in moves:
      if (a in out) != (b in out):
        out.update((a, b))
        changed = True
  return out


def _classify(
  m: Module,
  uf: _UnionFind,
  i: Instr,
  out_idx: tuple[int, ...],
  k: int,
  inflight: str,
  pair: tuple[str, str] | tuple[()],
  hazard: bool,
  comm: dict[Pos, str],
  xla_comm: set[Pos] = frozenset(),
) -> Copy:
  """Classifies one copy (``xla_comm``: every class holding a communication
  buffer, ours or XLA's, or one memory-space move away); an in-flight one is
  graded by what it can break: a ``hazard`` when it touches the destination
  or the source's buffer does not live until the done, else a ``cost`` (a
  read of a live source)."""
  operand = i.operands[k]
  src = m.instr(operand)
  out_leaf = i.leaf(out_idx)
  in_space = src.memory_space
  out_space = out_leaf.memory_space if out_leaf else None
  in_class, out_class = uf.find((src.name, ())), uf.find((i.name, out_idx))
  touched = comm.get(in_class) or comm.get(out_class)
  if not pair and touched:
    pair = (touched, "")
  in_leaf = src.leaf(()) if len(src.leaves) == 1 else None
  if out_leaf is not None and out_leaf.num_elements <= 1:
    kind = "scalar"
  elif in_space != out_space:
    kind = "memory_space"
  elif (
    in_leaf is not None
    and out_leaf is not None
    and _layout(in_leaf.text) != _layout(out_leaf.text)
  ):
    kind = "layout"  # a transpose/retiling layout assignment chose
  else:
    entry = m.entry
    params = {uf.find((p.name, ())) for p in entry.params}
    roots = {uf.find((entry.root.name, lf.index)) for lf in entry.root.leaves}
    from_param = in_class in params
    to_output = out_class in roots
    if from_param and to_output:
      kind = "output"
    elif not inflight and (
      (from_param and (out_class in comm or out_class in xla_comm))
      or (to_output and (in_class in comm or in_class in xla_comm))
    ):
      # A communicating kernel's buffers (and XLA's own collectives'
      # results) live in memory XLA allocates; the entry's parameters and
      # outputs do not (design/scheduling.md). Never for a copy made while
      # the buffer is in flight.
      kind = "boundary"
    else:
      kind = "defensive"
  source = _producer_source(m, operand)
  if not source:
    for user in (u for c in m.computations.values() for u in c.instrs):
      if i.name in user.operands and user.source:
        source = f"used by {user.where}"
        break
  return Copy(
    name=i.name,
    kind=kind,
    shape=out_leaf.text if out_leaf else i.shape_text,
    computation=i.computation,
    operand=operand,
    spaces=(_space(in_space), _space(out_space)),
    source=source,
    estimated_cycles=i.estimated_cycles,
    inflight=inflight,
    instr=i,
    opcode=i.opcode,
    output_index=out_idx if i.opcode != "copy-start" else (),
    pair=pair,
    grade=("hazard" if hazard else "cost") if inflight else "",
    nbytes=out_leaf.nbytes if out_leaf else 0,
  )


def _memory(compiled: Any) -> dict[str, Any]:
  try:
    stats = compiled.memory_analysis()
  except Exception:  # noqa: BLE001 - not every backend implements it
    return {}
  if stats is None:
    return {}
  out = {}
  for key in dir(stats):
    if key.endswith("_in_bytes") and not key.startswith("host_"):
      out[key] = getattr(stats, key)
  return out


def analyze(jitted: Any, *abstract_args: Any) -> Report:
  """Compiles ``jitted`` and reports copies, start/done pairs and lifetimes.

  Args:
    jitted: a ``jax.jit`` function (or ``Traced``/``Lowered``), an already
      compiled object (anything with ``as_text()``), or HLO text.
    *abstract_args: arguments for ``jitted.trace`` (``ShapeDtypeStruct``
      with shardings over :func:`tpu_mesh` devices, for TPU HLO).

  Returns:
    A :class:`Report`.

  Example:

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> from asyncops.inspect import tpu_mesh
    >>> mesh = tpu_mesh("v5e:2x4", (8,), ("i",))
    >>> x = jax.ShapeDtypeStruct((8, 128), jnp.float32,
    ...                          sharding=NamedSharding(mesh, P("i")))
    >>> analyze(jax.jit(lambda x: x * 2), x).pairs
    ()
  """
  seconds, memory = 0.0, {}
  if isinstance(jitted, str):
    text = jitted
  elif hasattr(jitted, "as_text") and not hasattr(jitted, "lower"):
    if hasattr(jitted, "compile") and not hasattr(jitted, "memory_analysis"):
      jitted, seconds = compile_tpu(jitted)
    text, memory = jitted.as_text(), _memory(jitted)
  else:
    compiled, seconds = compile_tpu(jitted, *abstract_args)
    text, memory = compiled.as_text(), _memory(compiled)
  return analyze_module(parse_module(text), text, seconds, memory)
