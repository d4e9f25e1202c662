"""A jaxpr-level life-cycle check: every start is awaited exactly once.

The trace-time checks on :class:`~asyncops.Future` objects see only Python
objects; they cannot follow a future through ``jax.tree.map``, a loop carry
or a ``jit`` boundary. :func:`check_futures` traces a function to a jaxpr and
follows the *semaphores* instead: each semaphore a start primitive returns
must reach exactly one wait (``done`` or, for the send semaphores,
``send_done``; for the receive ones, ``recv_done``), through ``jit``,
``shard_map``, ``cond``, and the carries of ``while_loop``, ``fori_loop``
and ``scan``. The error names the start's source line.

Rules it enforces (each is a way to corrupt data or hang on TPU):

* a semaphore is awaited (or handed on) exactly once: never dropped, never
  awaited twice (e.g. a future and its ``jax.tree.map`` copy both awaited);
* a semaphore is only waited on, never computed with;
* a future enters a loop only as a carry, never as a captured constant
  (the body would await it on every iteration);
* a loop that carries a future in must carry a future out (await then
  start again), and a future carry must start as a future;
* all branches of a ``cond`` treat the futures alike;
* a future does not escape the checked function (a TPU program cannot hand
  its DMA semaphores to another program).
"""

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend import core as jex

from asyncops import _jax_compat as jc
from asyncops.futures import _primitives as prims
from asyncops.futures._future import FutureError

# Primitives that hand each operand to the same-position output unchanged.
_FORWARDING = frozenset({"pvary", "copy", "copy_p", "optimization_barrier"})


@dataclasses.dataclass(frozen=True)
class _Sem:
  """One semaphore in flight: where it was started and what it waits for."""

  origin: str
  what: str


def _where(sem: _Sem) -> str:
  return f"the future of {sem.what} started at {sem.origin}"


def _fail(msg: str) -> None:
  raise FutureError(f"check_futures: {msg}")


def _open(j) -> Any:
  return j.jaxpr if isinstance(j, jex.ClosedJaxpr) else j


class _Flow:
  """Semaphore flow through one jaxpr."""

  def __init__(self, jaxpr, in_sems: Sequence[_Sem | None]):
    self.jaxpr = _open(jaxpr)
    self.sems: dict[Any, _Sem] = {}
    self.uses: dict[Any, int] = {}
    self.local: list[Any] = []
    for v, s in zip(self.jaxpr.invars, in_sems, strict=True):
      if s is not None:
        self.sems[v] = s
        self.uses[v] = 0

  def sem_of(self, v) -> _Sem | None:
    if isinstance(v, jex.Literal):
      return None
    return self.sems.get(v)

  def consume(self, v) -> None:
    self.uses[v] += 1

  def define(self, v, sem: _Sem) -> None:
    if jc.is_drop_var(v):
      _fail(f"{_where(sem)} is dropped: its semaphores are never awaited.")
    self.sems[v] = sem
    self.uses[v] = 0
    self.local.append(v)

  def run(self) -> tuple[list[_Sem | None], list[int]]:
    """Returns the semaphores among the outputs and the inputs' use counts."""
    for eqn in self.jaxpr.eqns:
      self.eqn(eqn)
    outs = []
    for v in self.jaxpr.outvars:
      s = self.sem_of(v)
      if s is not None:
        self.consume(v)
      outs.append(s)
    for v in self.local:
      self.check_once(v, "")
    return outs, [self.uses.get(v, 0) for v in self.jaxpr.invars]

  def check_once(self, v, where: str) -> None:
    n, sem = self.uses[v], self.sems[v]
    if n == 0:
      _fail(
        f"{_where(sem)} is never awaited{where}. Pass it to the matching "
        "*_done (or return it from the loop body as a carry)."
      )
    if n > 1:
      _fail(
        f"{_where(sem)} is awaited or handed on {n} times{where}. Await "
        "each future exactly once: do not await a future and a copy of it "
        "(jax.tree.map, a second capture), and do not return it twice."
      )

  # Equations ---------------------------------------------------------------

  def eqn(self, eqn) -> None:
    p = eqn.primitive
    in_sems = [self.sem_of(v) for v in eqn.invars]
    if p is prims.start_p:
      spec = eqn.params["spec"]
      sem = _Sem(jc.user_frame(eqn), spec.short())
      for v in eqn.outvars[2:]:
        self.define(v, sem)
      return
    if p in (prims.done_p, prims.send_done_p, prims.recv_done_p):
      self.wait(eqn, in_sems)
      return
    name = p.name
    has_sub = any(True for _ in jc.jaxprs_in_params(eqn.params))
    if not any(in_sems) and not has_sub:
      return
    if name in _FORWARDING:
      for v, o, s in zip(eqn.invars, eqn.outvars, in_sems, strict=False):
        if s is not None:
          self.consume(v)
          self.define(o, s)
      return
    if name == "while":
      self.while_loop(eqn, in_sems)
    elif name == "scan":
      self.scan(eqn, in_sems)
    elif name == "cond":
      self.cond(eqn, in_sems)
    elif (call := self.call_jaxpr(eqn)) is not None:
      self.call(eqn, call, in_sems)
    elif any(in_sems):
      sem = next(s for s in in_sems if s is not None)
      _fail(
        f"{_where(sem)} has its semaphores used by `{name}`. Semaphores "
        "may only be awaited (passed to a *_done) or carried; do not "
        "compute with a future's children."
      )

  def wait(self, eqn, in_sems) -> None:
    spec = eqn.params["spec"]
    first = 1 if eqn.primitive is prims.recv_done_p else 2
    n_consume = len(eqn.invars) - first
    if eqn.primitive is prims.send_done_p:
      n_consume = prims.n_send(spec)
    for k, (v, s) in enumerate(
      zip(eqn.invars[first:], in_sems[first:], strict=True)
    ):
      if s is None:
        _fail(
          f"a {eqn.primitive.name} of {spec.short()} at "
          f"{jc.user_frame(eqn)} waits on a semaphore no start produced. "
          "Pass the Future a *_start returned; do not build one by hand."
        )
      if k < n_consume:
        self.consume(v)

  def call(self, eqn, jaxpr, in_sems) -> None:
    outs, uses = _Flow(jaxpr, in_sems).run()
    for v, s, n in zip(eqn.invars, in_sems, uses, strict=True):
      if s is not None:
        self.consume(v)
        self.expect(s, n, f" inside `{eqn.primitive.name}`")
    for o, s in zip(eqn.outvars, outs, strict=True):
      if s is not None:
        self.define(o, s)

  @staticmethod
  def expect(sem: _Sem, n: int, where: str) -> None:
    if n == 0:
      _fail(f"{_where(sem)} is never awaited{where}.")
    if n > 1:
      _fail(f"{_where(sem)} is awaited {n} times{where}.")

  @staticmethod
  def call_jaxpr(eqn):
    """The sub-jaxpr of a call-like primitive (jit, shard_map, remat...)."""
    found = []
    for val in eqn.params.values():
      if isinstance(val, jex.ClosedJaxpr | jex.Jaxpr):
        j = _open(val)
        if len(j.invars) == len(eqn.invars) and len(j.outvars) == len(
          eqn.outvars
        ):
          found.append(val)
    return found[0] if len(found) == 1 else None

  @staticmethod
  def unused_consts(sems, uses, what: str) -> None:
    """Loop constants may hold futures (JAX hoists untouched carries) only
    if the body never awaits them."""
    for s, n in zip(sems, uses, strict=False):
      if s is not None and n:
        _fail(
          f"{_where(s)} is captured by a {what} body as a constant: the "
          "body would await it on every iteration. Pass the future in as a "
          "loop carry instead (await it in the body, start the next one, "
          "return it)."
        )

  def loop_body(self, body, const_sems, carry_sems, n_extra_in, what):
    """Analyses a loop body; returns the carry's output semaphores."""
    ins = list(const_sems) + list(carry_sems) + [None] * n_extra_in
    outs, uses = _Flow(body, ins).run()
    n_c = len(const_sems)
    self.unused_consts(const_sems, uses[:n_c], what)
    for k, s in enumerate(carry_sems):
      out = outs[k]
      if s is not None:
        self.expect(s, uses[n_c + k], f" in a {what} body (carry {k})")
        if out is None:
          _fail(
            f"{_where(s)} is carried into a {what} (carry {k}) but the "
            "body does not carry a future out. Each iteration that awaits "
            "the carried future must start the next one and return it."
          )
      elif out is not None:
        _fail(
          f"{_where(out)} is returned as {what} carry {k}, whose initial "
          "value is not a future. Start the first transfer before the loop "
          "and carry its future."
        )
    return outs

  def while_loop(self, eqn, in_sems) -> None:
    nc, nb = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    carry = in_sems[nc + nb :]
    _, cond_uses = _Flow(eqn.params["cond_jaxpr"], in_sems[:nc] + carry).run()
    for s, n in zip(in_sems[:nc] + carry, cond_uses, strict=True):
      if s is not None and n:
        _fail(f"{_where(s)} is used by a while_loop's condition.")
    outs = self.loop_body(
      eqn.params["body_jaxpr"], in_sems[nc : nc + nb], carry, 0, "while_loop"
    )
    self.hand_over(eqn.invars[nc + nb :], eqn.outvars, carry, outs)

  def scan(self, eqn, in_sems) -> None:
    nc, ncarry = eqn.params["num_consts"], eqn.params["num_carry"]
    carry = in_sems[nc : nc + ncarry]
    for s in in_sems[nc + ncarry :]:
      if s is not None:
        _fail(f"{_where(s)} is passed to a scan as a scanned input (xs).")
    n_xs = len(eqn.invars) - nc - ncarry
    outs = self.loop_body(
      eqn.params["jaxpr"], in_sems[:nc], carry, n_xs, "scan/fori_loop"
    )
    for s in outs[ncarry:]:
      if s is not None:
        _fail(
          f"{_where(s)} is returned as a scan output (ys): the stacked "
          "semaphores cannot be awaited. Await it inside the body."
        )
    self.hand_over(
      eqn.invars[nc : nc + ncarry], eqn.outvars, carry, outs[:ncarry]
    )

  def cond(self, eqn, in_sems) -> None:
    branches = eqn.params["branches"]
    ops = in_sems[1:]
    results = [_Flow(b, ops).run() for b in branches]
    for k, s in enumerate(ops):
      if s is not None:
        for i, (_, uses) in enumerate(results):
          self.expect(s, uses[k], f" in branch {i} of a cond")
    outs0 = results[0][0]
    for outs, _ in results[1:]:
      if [o is None for o in outs] != [o is None for o in outs0]:
        _fail(
          "the branches of a cond return futures in different positions "
          f"(started at {[o.origin for o in outs if o]} vs "
          f"{[o.origin for o in outs0 if o]})."
        )
    self.hand_over(eqn.invars, eqn.outvars, in_sems, outs0)

  def hand_over(self, invars, outvars, in_sems, outs) -> None:
    for v, s in zip(invars, in_sems, strict=True):
      if s is not None:
        self.consume(v)
    for o, s in zip(outvars, outs, strict=False):
      if s is not None:
        self.define(o, s)


def check_futures(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
  """Checks every future ``fn`` starts is awaited exactly once.

  Traces ``fn(*args, **kwargs)`` to a jaxpr (nothing runs; ``args`` may be
  ``jax.ShapeDtypeStruct``) and follows each start's semaphores through
  ``jit``, ``shard_map``, ``cond`` and loop carries to the waits.

  **This is stronger than the trace-time checks**: a future awaited twice
  through a ``jax.tree.map`` copy, dropped inside a loop body, or captured
  by a loop body as a constant is found here.

  Args:
    fn: the function to check, e.g. a ``jax.jit`` or ``shard_map``-wrapped
      function.
    *args: its arguments (arrays or ``jax.ShapeDtypeStruct``).
    **kwargs: its keyword arguments.

  Raises:
    FutureError: naming the start's source line and the rule broken.

  Example:
    >>> asyncops.futures.check_futures(f, x)  # doctest: +SKIP
  """
  closed = jax.make_jaxpr(fn)(*args, **kwargs)
  outs, _ = _Flow(closed.jaxpr, [None] * len(closed.jaxpr.invars)).run()
  for s in outs:
    if s is not None:
      _fail(
        f"{_where(s)} is returned from the checked function: a TPU "
        "program cannot hand its DMA semaphores to another program. Await "
        "it inside and return the result."
      )
