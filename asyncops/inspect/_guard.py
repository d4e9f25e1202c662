"""The copy guard: refuse a compiled program that endangers a transfer.

Background. A transfer's buffers are only safe if, between the start and
the done, nothing but the DMA touches them: XLA must not copy them (a copy
of the destination reads a partial value, and a copy the done waits on is
not the buffer the DMA writes), must not write into them, and must keep
the source alive. The scheduling helpers build programs that satisfy this
by construction; programs written with ``jax.lax`` directly, or a new XLA,
may not. This module reads the compiled HLO (the harness,
:func:`analyze_module`) and turns what it finds into
:class:`CopyHazardError`.

What is refused (each a *hazard*):

- a copy of a buffer a transfer is reading or writing (in flight);
- a defensive copy (copy insertion) of a transfer's source or destination,
  anywhere in the program: a full read and write XLA added because the
  buffers could not alternate;
- an instruction inside a window that writes in place into the transfer's
  source or destination;
- a start whose source or destination does not reach its done (XLA may
  free or reuse it while the DMA uses it; a source a loop body passes
  through unchanged is the loop operand's buffer, which the done may take
  instead of the loop's result);
- a start that reaches no done at all (its DMA is never waited for), or
  none on some branch of a conditional its semaphores enter, or none for
  one of its semaphores (a ``send_done`` never followed by ``recv_done``),
  and
  any copy of a DMA semaphore (a done waiting on the copy waits on a
  semaphore the DMA never signals; the start then reaches no done).

Not refused: a move between memory spaces that only reads the source of
the transfers in flight around it, which each of their dones still holds
(``Copy.read_only_source``; the argument is in ``design/inspect.md``), a
copy outside every window whose only reader is the start that then sends
it (``Copy.feeds_source``: copy insertion giving the start its own
buffer), or whose only reader is the Ref-API start that then writes it in
place as its destination (``Copy.feeds_destination``: the destination
Ref's initial value given a buffer of its own, h-guardfp),
copies between memory spaces (HBM <-> VMEM) outside windows, scalar copies,
and ``boundary`` copies at the program's edge (a parameter copied before it
is sent, a received buffer copied before it is returned: TPU XLA keeps a
communicating kernel's buffers in memory it allocates): the last three
touch no buffer in flight.

Example:
  >>> import jax, jax.numpy as jnp, asyncops
  >>> from jax.sharding import AxisType, PartitionSpec as P
  >>> from asyncops.inspect import assert_copy_free
  >>> mesh = jax.make_mesh((8,), ("i",), axis_types=(AxisType.Auto,))
  >>> def hop(x):
  ...   x, fut = asyncops.ppermute_start(x, "i", shift=1)
  ...   return asyncops.ppermute_done(fut) + x
  >>> f = jax.jit(jax.shard_map(hop, in_specs=P("i"), out_specs=P("i")))
  >>> x = jax.device_put(jnp.zeros((64, 128)), jax.NamedSharding(mesh, P("i")))
  >>> len(assert_copy_free(f, x, topology="v5e:2x4").kernel_pairs)
  1
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax

from ._analysis import _is_ref_kernel, _resolve, analyze_module
from ._dma_cover import cover_hazards
from ._hlo import parse_module
from ._mesh import compile_tpu, tpu_mesh
from ._report import Report


class CopyHazardError(ValueError):
  """A program that would copy, overwrite or free a buffer in flight.

  Raised at trace time by the scheduling helpers when they can tell XLA
  could only compile a program with such a copy, and at compile time by
  :func:`assert_copy_free` and ``asyncops.jit`` when the compiled TPU
  program has one. The message names the copy (or write), the start/done
  pair and the user's source line of the start, and what to change.
  """


class CopyHazardWarning(UserWarning):
  """A copy hazard reported instead of raised (``check="warn"``), or a
  program the helpers compile with a safe but wasted copy."""


@dataclasses.dataclass(frozen=True)
class Hazard:
  """One thing in a compiled program that endangers a transfer.

  Attributes:
    kind: ``"in-flight copy"``, ``"defensive copy"``, ``"semaphore
      copy"``, ``"in-place write"``, ``"source not live"`` /
      ``"destination not live"``, ``"start with no done"`` (also for one
      semaphore of a start that no done waits for) or ``"start with no
      done on a branch"``.
    instr: the offending instruction (the copy, the write, or the start).
    detail: one line on what it does.
    start: the start instruction of the transfer it concerns.
    done: its done (``""`` if not known).
    start_line: the user's ``file:line in function`` that called the start.
    start_stack: that line and its caller, as the harness prints them.
  """

  kind: str
  instr: str
  detail: str
  start: str
  done: str
  start_line: str
  start_stack: str

  def to_dict(self) -> dict[str, str]:
    """The fields as JSON-ready data."""
    return dataclasses.asdict(self)

  def __str__(self) -> str:
    pair = f"%{self.start} -> %{self.done}" if self.done else f"%{self.start}"
    where = self.start_line or "an unknown line"
    return (
      f"{self.kind}: {self.detail}\n"
      f"    breaks the transfer {pair} started at {where}"
      + (
        f" (called from {self.start_stack.split(' <- ', 1)[1]})"
        if " <- " in self.start_stack
        else ""
      )
    )


def _start_info(report: Report, name: str) -> tuple[str, str]:
  if not name:
    return "", ""
  i = report.module.instr(name)
  return i.source, i.where


def _destination_value(report: Report, c, start: str) -> bool:
  """Whether copy ``c`` reads, or makes, the value a Ref-API ``start``
  takes as its destination (the operand it aliases and writes)."""
  if not start:
    return False
  m = report.module
  s = m.instr(start)
  if not _is_ref_kernel(s):
    return False
  i = c.instr
  if i.computation != s.computation or i.position > s.position:
    return False
  dsts = {_resolve(m, (s.operands[k], ())) for _, k, _ in s.aliasing}
  result = c.name if c.opcode != "copy-start" else ""
  return _resolve(m, (c.operand, ())) in dsts or (result, ()) in dsts


def _donated_operand(report: Report, start: str) -> int | None:
  """The entry parameter number a start's operand is, when the module
  donates or aliases it (``Module.donated_params``), else ``None``."""
  m = report.module
  for o in m.instr(start).operands:
    i = m.instr(_resolve(m, (o, ()))[0])
    if (
      i.opcode == "parameter"
      and i.computation == m.entry_name
      and i.parameter_number in m.donated_params
    ):
      return i.parameter_number
  return None


def _semaphore_maker(report: Report, value: str) -> str:
  """The kernel whose semaphore output ``value`` is (through
  get-tuple-element, tuple, bitcast), or ``""``: a semaphore copy's
  transfer, so its refusal names the user's line of that start."""
  m = report.module
  name, _ = _resolve(m, (value, ()))
  return name if m.instr(name).opcode == "custom-call" else ""


def hazards(report: Report) -> list[Hazard]:
  """The hazards in a harness report (empty for a safe program)."""
  out: list[Hazard] = []
  for c in report.copies:
    if "SEM" in c.spaces:
      kind = "semaphore copy"
    elif c.read_only_source or c.feeds_source or c.feeds_destination:
      continue  # reads a live source / makes one or a destination
    elif c.inflight:
      kind = "in-flight copy"
    elif c.kind == "defensive" and c.pair:
      kind = "defensive copy"
    else:
      continue
    start, done = (tuple(c.pair) + ("", ""))[:2]
    if not start and kind == "semaphore copy":
      start = _semaphore_maker(report, c.operand)
    line, stack = _start_info(report, start)
    what = (
      f"%{c.name} ({c.opcode}, {c.shape}, {c.spaces[0]}->{c.spaces[1]}) "
      f"copies %{c.operand} in %{c.computation}"
    )
    if c.inflight:
      what += f": the {c.inflight}"
    elif kind == "defensive copy" and _destination_value(report, c, start):
      what += (
        ": the destination Ref's value before the start, kept apart from "
        "the buffer the DMA writes because another value uses it too. If "
        "the destination Ref was made of a value used elsewhere (another "
        "Ref made of the same computation, which XLA makes one value, or a "
        "read of the destination after the start), give it a value of its "
        "own (jax.empty_ref, or zeros) or read that value before the start"
      )
    elif kind == "semaphore copy":
      what += (
        ": a DMA semaphore; the done would wait on a copy the DMA never signals"
      )
    out.append(Hazard(kind, c.name, what, start, done, line, stack))
  for s in report.unawaited_starts:
    line, stack = _start_info(report, s.name)
    out.append(
      Hazard(
        "start with no done",
        s.name,
        f"%{s.name} reaches no done kernel: its DMA is never waited for "
        "(or XLA copied its semaphores, so no done waits on the ones it "
        "signals)",
        s.name,
        "",
        line,
        stack,
      )
    )
  for name, branch in report.unawaited_branches:
    line, stack = _start_info(report, name)
    out.append(
      Hazard(
        "start with no done on a branch",
        name,
        f"%{name}'s semaphores enter a conditional, and on {branch} no "
        "done waits for them: on that path the DMA runs on while XLA "
        "treats its buffers as dead (await the future in every branch, or "
        "after the lax.cond/switch)",
        name,
        "",
        line,
        stack,
      )
    )
  for name, idx in report.unawaited_semaphores:
    line, stack = _start_info(report, name)
    out.append(
      Hazard(
        "start with no done",
        name,
        f"%{name}'s DMA semaphore (output {{{','.join(map(str, idx))}}}) "
        "reaches no done kernel, though another of its semaphores does "
        "(e.g. a send_done whose future never reaches recv_done): that "
        "part of the DMA runs on while XLA treats its buffer as dead "
        "(pass the future send_done returns to recv_done)",
        name,
        "",
        line,
        stack,
      )
    )
  for p in report.kernel_pairs:
    line, stack = _start_info(report, p.start)
    for w in p.inplace_writes:
      name = w.split()[0].lstrip("%")
      out.append(
        Hazard("in-place write", name, w, p.start, p.done, line, stack)
      )
    for live, role in ((p.source_live, "source"), (p.dest_live, "destination")):
      if not live:
        donated = None
        if role == "source":
          donated = _donated_operand(report, p.start)
        hint = (
          ""
          if donated is None
          else f"; it is argument {donated} of the jitted function, "
          "donated: XLA may give a donated buffer to an output while the "
          f"DMA reads it; do not donate argument {donated} "
          "(donate_argnums) when you send it"
        )
        out.append(
          Hazard(
            f"{role} not live",
            p.start,
            f"the {role} buffer of %{p.start} does not reach %{p.done} "
            "on every path: XLA may free or reuse it while the DMA uses "
            "it (a copy on the way, or a lax.cond/switch branch that "
            "replaces it: XLA computes that branch's value into the very "
            "buffer; pass the future through every branch unchanged, or "
            f"await it before the branch){hint}",
            p.start,
            p.done,
            line,
            stack,
          )
        )
  out += _cover_hazards(report, out)
  return out


def _cover_hazards(report: Report, known: Sequence[Hazard]) -> list[Hazard]:
  """Hazards to the buffers each library kernel declares its DMAs use
  after it returns (:mod:`asyncops.inspect._dma_cover`: the fused
  reduce-scatter's sent partial sums, a copy future's destination until
  ``send_done``, each source of the fused all-gather), less those the
  pair rules above already name (the same copy or write, or the same
  transfer not live)."""
  seen = {(h.kind, h.instr) for h in known}
  seen |= {(h.kind, h.start, h.done) for h in known if "not live" in h.kind}
  out = []
  for kind, instr, detail, kernel, waiter in cover_hazards(report):
    key = (kind, kernel, waiter) if "not live" in kind else (kind, instr)
    if key in seen:
      continue
    seen.add(key)
    line, stack = _start_info(report, kernel)
    out.append(Hazard(kind, instr, detail, kernel, waiter, line, stack))
  return out


_FIX = (
  "How to fix: write loops that carry futures with "
  "asyncops.scheduling.fori_loop (or staggered), which alternates buffers "
  "and never lets a transfer cross the loop's back edge; compute on the x "
  "a start returns, never on the buffer you passed in; keep the received "
  "value and the future out of two carry slots; do not write into a "
  "buffer before its done. design/scheduling.md explains each case."
)


def hazard_message(found: Sequence[Hazard], what: str = "") -> str:
  """The :class:`CopyHazardError` message for ``found``."""
  head = (
    f"{what}: " if what else ""
  ) + f"the compiled TPU program endangers a transfer ({len(found)} hazard"
  head += "s):" if len(found) != 1 else "):"
  body = "\n".join(f"  {h}" for h in found)
  return f"{head}\n{body}\n{_FIX}"


def check_hlo(hlo_text: str, what: str = "") -> Report:
  """Analyzes compiled HLO text; raises on a hazard.

  Args:
    hlo_text: the scheduled HLO of a compiled TPU program
      (``compiled.as_text()``).
    what: the program's name, for the message.

  Returns:
    The harness :class:`Report` (when there is no hazard).

  Raises:
    CopyHazardError: naming each hazard, its transfer and the user's line.
  """
  return check_report(analyze_module(parse_module(hlo_text), hlo_text), what)


def check_report(report: Report, what: str = "") -> Report:
  """Raises :class:`CopyHazardError` if ``report`` has a hazard.

  Args:
    report: a harness report (:func:`asyncops.inspect.analyze`).
    what: the program's name, for the message.

  Returns:
    ``report``, when it has no hazard.

  Raises:
    CopyHazardError: naming each hazard, its transfer and the user's line.
  """
  found = hazards(report)
  if found:
    raise CopyHazardError(hazard_message(found, what))
  return report


def _platform(compiled: Any) -> str | None:
  """The platform a ``jax.stages.Compiled`` runs on (None if unknown)."""
  for shardings in (compiled.input_shardings, compiled.output_shardings):
    for s in jax.tree.leaves(shardings):
      devices = getattr(s, "device_set", None)
      if devices:
        return next(iter(devices)).platform
  return None


def _retarget(args: Sequence[Any], topology: str):
  """``args`` as ShapeDtypeStructs over ``topology``'s devices, and the mesh.

  Each argument keeps its shape, dtype and partition spec; its mesh becomes
  a TPU mesh of the same axis names and sizes.
  """
  meshes: dict[tuple, jax.sharding.Mesh] = {}

  def tpu_of(mesh) -> jax.sharding.Mesh:
    key = (tuple(mesh.axis_names), tuple(mesh.axis_sizes))
    if key not in meshes:
      meshes[key] = tpu_mesh(topology, key[1], key[0])
    return meshes[key]

  def one(a):
    if not hasattr(a, "shape") or not hasattr(a, "dtype"):
      return a
    sharding = getattr(a, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
      sharding = jax.sharding.NamedSharding(
        tpu_of(sharding.mesh), sharding.spec
      )
    else:
      sharding = None
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)

  out = jax.tree.map(one, tuple(args))
  mesh = next(iter(meshes.values())) if len(meshes) == 1 else None
  return out, mesh


def compile_for_check(jitted: Any, args: Sequence[Any], topology=None):
  """Compiles ``jitted`` for TPU: the arguments' devices, or ``topology``.

  Returns:
    The ``jax.stages.Compiled``.

  Raises:
    ValueError: the arguments are not on TPU devices and no topology was
      named, or the function cannot be re-targeted to the topology.
  """
  if topology is None:
    compiled, _ = compile_tpu(jitted, *args)
    platform = _platform(compiled)
    if platform not in (None, "tpu"):
      raise ValueError(
        f"assert_copy_free: the arguments are on {platform} devices, so "
        "the program was compiled for that platform, not TPU (the CPU "
        'emulation has no copies to check). Pass topology="v5e:2x4" (or '
        "another TPU topology), or arguments sharded over "
        "asyncops.inspect.tpu_mesh(...)."
      )
    return compiled
  targs, mesh = _retarget(args, topology)
  try:
    if mesh is not None:
      with jax.set_mesh(mesh):
        compiled, _ = compile_tpu(jitted, *targs)
    else:
      compiled, _ = compile_tpu(jitted, *targs)
  except (ValueError, TypeError) as e:
    raise ValueError(
      f"assert_copy_free(topology={topology!r}): could not compile the "
      "program for that topology. The arguments were moved to a TPU mesh "
      "of the same axis names and sizes, set as the context mesh; a "
      "function that closes over a concrete (CPU) mesh, e.g. "
      "shard_map(..., mesh=cpu_mesh), cannot follow. Build it with "
      "shard_map(...) without mesh= (it then takes jax.set_mesh's mesh), "
      "or pass arguments sharded over asyncops.inspect.tpu_mesh(...) and "
      f"no topology. JAX said: {e}"
    ) from e
  return compiled


def assert_copy_free(jitted: Any, *args: Any, topology: str | None = None):
  """Compiles ``jitted`` for TPU and refuses it if it endangers a transfer.

  A copy of a buffer a transfer is reading or writing, a defensive copy of
  a transfer's source or destination, a write into one inside its window,
  or a source XLA may free early: each is a :class:`CopyHazardError`.
  Copies between memory spaces and at the program's edge are allowed (see
  :mod:`asyncops.inspect._guard`).

  Args:
    jitted: a ``jax.jit`` (or ``asyncops.jit``) function.
    *args: its arguments: arrays or ``jax.ShapeDtypeStruct``, sharded over
      TPU devices (``asyncops.inspect.tpu_mesh``), or over any mesh when
      ``topology`` is given.
    topology: e.g. ``"v5e:2x4"``: compile for this TPU topology instead,
      on a mesh with the arguments' axis names and sizes (set as the
      context mesh, for ``shard_map`` without ``mesh=``).

  Returns:
    The harness :class:`Report` of the clean program.

  Raises:
    CopyHazardError: naming each hazard, the start/done pair it breaks and
      the user's ``file:line`` of that start.
    ValueError: the program was not compiled for TPU.

  Example:
    >>> import jax, jax.numpy as jnp, asyncops
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = tpu_mesh("v5e:2x4", (8,), ("i",))
    >>> def hop(x):
    ...   x, fut = asyncops.ppermute_start(x, "i", shift=1)
    ...   return asyncops.ppermute_done(fut) + x
    >>> f = jax.shard_map(hop, mesh=mesh, in_specs=P("i"), out_specs=P("i"))
    >>> x = jax.ShapeDtypeStruct((64, 128), jnp.float32,
    ...                          sharding=NamedSharding(mesh, P("i")))
    >>> r = assert_copy_free(jax.jit(f), x)  # raises on a hazard
    >>> len(r.kernel_pairs), r.kernel_pairs[0].kind
    (1, 'kernel')
  """
  jitted = getattr(jitted, "__wrapped_jit__", jitted)
  compiled = compile_for_check(jitted, args, topology)
  return check_hlo(compiled.as_text(), getattr(jitted, "__name__", ""))
