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

**The same analysis runs by default** on every program asyncops traces
something into (``default_check``, run when JAX finishes tracing a jaxpr):
a start never awaited, awaited twice, awaited in only some branches of a
``cond``, dropped in a loop body or captured by one raises at trace time.
That check is lenient where a jaxpr cannot know the whole story: futures
that come in from an enclosing trace are checked by the enclosing trace,
and futures may be returned (the enclosing trace follows them). Only
:func:`check_futures` requires that nothing escapes the checked function
and that semaphores are never used by other primitives.
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
_FORWARDING = frozenset(
  {"pvary", "copy", "copy_p", "optimization_barrier", "asyncops_tie"}
)

# How each primitive takes part: a start defines semaphores (the positions
# of its outputs that are semaphores; where its user code is); a wait
# consumes them (the position of its first semaphore operand and how many
# of them it awaits; the rest are only checked).
_STARTS: dict[Any, Callable[[Any], Sequence[int]]] = {}
_ORIGINS: dict[Any, Callable[[Any], str]] = {}
_WAITS: dict[Any, Callable[[Any], tuple[int, int]]] = {}


def register_start(
  prim, sem_outputs: Callable[[Any], Sequence[int]], origin=None
) -> None:
  """Declares ``prim`` a start: ``sem_outputs(eqn)`` are its semaphores."""
  _STARTS[prim] = sem_outputs
  if origin is not None:
    _ORIGINS[prim] = origin


def register_wait(prim, sems: Callable[[Any], tuple[int, int]]) -> None:
  """Declares ``prim`` a wait: ``sems(eqn) = (first, n_awaited)``."""
  _WAITS[prim] = sems


def _value_done(eqn) -> tuple[int, int]:
  first = 1 if eqn.primitive is prims.recv_done_p else 2
  n = len(eqn.invars) - first
  if eqn.primitive is prims.send_done_p:
    n = prims.n_send(eqn.params["spec"])
  return first, n


register_start(prims.start_p, lambda eqn: range(2, len(eqn.outvars)))
for _p in (prims.done_p, prims.send_done_p, prims.recv_done_p):
  register_wait(_p, _value_done)


@dataclasses.dataclass(frozen=True)
class _Sem:
  """One semaphore in flight: where it was started and what it waits for."""

  origin: str
  what: str


def _where(sem: _Sem) -> str:
  return f"the future of {sem.what} started at {sem.origin}"


def _fail(msg: str, prefix: str = "check_futures") -> None:
  raise FutureError(f"{prefix}: {msg}")


def _open(j) -> Any:
  return j.jaxpr if isinstance(j, jex.ClosedJaxpr) else j


class _Flow:
  """Semaphore flow through one jaxpr.

  ``lenient``: the default check on one finished trace. Semaphores that come
  in from an enclosing trace are unknown here (``None``), so waiting on an
  unknown semaphore is not an error, and uses the analysis cannot follow
  (a primitive computing with a semaphore, a scanned input or output) end
  the tracking instead of failing.
  """

  def __init__(
    self,
    jaxpr,
    in_sems: Sequence[_Sem | None],
    lenient: bool = False,
    note: str = "",
  ):
    self.lenient = lenient
    self.note = note
    self.prefix = "asyncops" if lenient else "check_futures"
    self.jaxpr = _open(jaxpr)
    self.sems: dict[Any, _Sem] = {}
    self.uses: dict[Any, int] = {}
    self.local: list[Any] = []
    # Outputs of forwarding primitives (barriers) are the same semaphore:
    # a use of either is a use of the original.
    self.alias: dict[Any, Any] = {}
    for v, s in zip(self.jaxpr.invars, in_sems, strict=True):
      if s is not None:
        self.sems[v] = s
        self.uses[v] = 0

  def sub(self, jaxpr, in_sems) -> "_Flow":
    return _Flow(jaxpr, in_sems, self.lenient, self.note)

  def fail(self, msg: str) -> None:
    _fail(msg, self.prefix)

  def sem_of(self, v) -> _Sem | None:
    if isinstance(v, jex.Literal):
      return None
    return self.sems.get(v)

  def consume(self, v) -> None:
    self.uses[self.alias.get(v, v)] += 1

  def define(self, v, sem: _Sem) -> None:
    if jc.is_drop_var(v):
      self.fail(f"{_where(sem)} is dropped: its semaphores are never awaited.")
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
    return outs, [
      self.uses.get(self.alias.get(v, v), 0) for v in self.jaxpr.invars
    ]

  def check_once(self, v, where: str) -> None:
    n, sem = self.uses[v], self.sems[v]
    if n == 0:
      self.fail(
        f"{_where(sem)} is never awaited{where}{self.note}. Pass it to the "
        "matching *_done (or return it from the loop body as a carry)."
      )
    if n > 1:
      self.fail(
        f"{_where(sem)} is awaited or handed on {n} times{where}. Await "
        "each future exactly once: do not await a future and a copy of it "
        "(jax.tree.map, a second capture), and do not return it twice."
      )

  # Equations ---------------------------------------------------------------

  def eqn(self, eqn) -> None:
    p = eqn.primitive
    in_sems = [self.sem_of(v) for v in eqn.invars]
    if p in _STARTS:
      what = eqn.params["spec"].short()
      origin = _ORIGINS.get(p, jc.user_frame)(eqn)
      sem = _Sem(origin, what)
      for k in _STARTS[p](eqn):
        self.define(eqn.outvars[k], sem)
      return
    if p in _WAITS:
      self.wait(eqn, in_sems)
      return
    name = p.name
    has_sub = any(True for _ in jc.jaxprs_in_params(eqn.params))
    if not any(in_sems) and not has_sub:
      return
    if name in _FORWARDING:
      for v, o, s in zip(eqn.invars, eqn.outvars, in_sems, strict=False):
        if s is not None and not jc.is_drop_var(o):
          self.sems[o] = s
          self.alias[o] = self.alias.get(v, v)
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
      self.untracked(eqn.invars, in_sems, f"used by `{name}`")

  def untracked(self, invars, in_sems, how: str) -> None:
    """Semaphores the analysis cannot follow any further."""
    if self.lenient:
      for v, s in zip(invars, in_sems, strict=True):
        if s is not None:
          self.consume(v)
      return
    sem = next(s for s in in_sems if s is not None)
    self.fail(
      f"{_where(sem)} has its semaphores {how}. Semaphores may only be "
      "awaited (passed to a *_done) or carried; do not compute with a "
      "future's children."
    )

  def wait(self, eqn, in_sems) -> None:
    spec = eqn.params["spec"]
    first, n_consume = _WAITS[eqn.primitive](eqn)
    for k, (v, s) in enumerate(
      zip(eqn.invars[first:], in_sems[first:], strict=True)
    ):
      if s is None:
        if self.lenient:  # from an enclosing trace: it checks this wait
          continue
        self.fail(
          f"a {eqn.primitive.name} of {spec.short()} at "
          f"{jc.user_frame(eqn)} waits on a semaphore no start produced. "
          "Pass the Future a *_start returned; do not build one by hand."
        )
      if k < n_consume:
        self.consume(v)

  def call(self, eqn, jaxpr, in_sems) -> None:
    outs, uses = self.sub(jaxpr, in_sems).run()
    for v, s, n in zip(eqn.invars, in_sems, uses, strict=True):
      if s is not None:
        self.consume(v)
        self.expect(s, n, f" inside `{eqn.primitive.name}`")
    for o, s in zip(eqn.outvars, outs, strict=True):
      if s is not None:
        self.define(o, s)

  def expect(self, sem: _Sem, n: int, where: str) -> None:
    if n == 0:
      self.fail(
        f"{_where(sem)} is never awaited{where}{self.note}. Await it (or "
        "return it) on every path."
      )
    if n > 1:
      self.fail(f"{_where(sem)} is awaited {n} times{where}.")

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

  def unused_consts(self, sems, uses, what: str) -> None:
    """Loop constants may hold futures (JAX hoists untouched carries) only
    if the body never awaits them."""
    for s, n in zip(sems, uses, strict=False):
      if s is not None and n:
        self.fail(
          f"{_where(s)} is captured by a {what} body as a constant: the "
          "body would await it on every iteration. Pass the future in as a "
          "loop carry instead (await it in the body, start the next one, "
          "return it)."
        )

  def loop_body(self, body, const_sems, carry_sems, n_extra_in, what):
    """Analyses a loop body; returns the carry's output semaphores."""
    ins = list(const_sems) + list(carry_sems) + [None] * n_extra_in
    outs, uses = self.sub(body, ins).run()
    n_c = len(const_sems)
    self.unused_consts(const_sems, uses[:n_c], what)
    for k, s in enumerate(carry_sems):
      out = outs[k]
      if s is not None:
        self.expect(s, uses[n_c + k], f" in a {what} body (carry {k})")
        if out is None:
          self.fail(
            f"{_where(s)} is carried into a {what} (carry {k}) but the "
            "body does not carry a future out. Each iteration that awaits "
            "the carried future must start the next one and return it."
          )
      elif out is not None and not self.lenient:
        self.fail(
          f"{_where(out)} is returned as {what} carry {k}, whose initial "
          "value is not a future. Start the first transfer before the loop "
          "and carry its future."
        )
    return outs

  def while_loop(self, eqn, in_sems) -> None:
    nc, nb = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    carry = in_sems[nc + nb :]
    _, cond_uses = self.sub(
      eqn.params["cond_jaxpr"], in_sems[:nc] + carry
    ).run()
    for s, n in zip(in_sems[:nc] + carry, cond_uses, strict=True):
      if s is not None and n:
        self.fail(f"{_where(s)} is used by a while_loop's condition.")
    outs = self.loop_body(
      eqn.params["body_jaxpr"], in_sems[nc : nc + nb], carry, 0, "while_loop"
    )
    self.hand_over(eqn.invars[nc + nb :], eqn.outvars, carry, outs)

  def scan(self, eqn, in_sems) -> None:
    nc, ncarry = eqn.params["num_consts"], eqn.params["num_carry"]
    carry = in_sems[nc : nc + ncarry]
    xs = in_sems[nc + ncarry :]
    if any(xs):
      self.untracked(
        eqn.invars[nc + ncarry :], xs, "passed to a scan as scanned inputs"
      )
    n_xs = len(eqn.invars) - nc - ncarry
    outs = self.loop_body(
      eqn.params["jaxpr"], in_sems[:nc], carry, n_xs, "scan/fori_loop"
    )
    for s in outs[ncarry:]:
      if s is not None and not self.lenient:
        self.fail(
          f"{_where(s)} is returned as a scan output (ys): the stacked "
          "semaphores cannot be awaited. Await it inside the body."
        )
    self.hand_over(
      eqn.invars[nc : nc + ncarry], eqn.outvars, carry, outs[:ncarry]
    )

  def cond(self, eqn, in_sems) -> None:
    branches = eqn.params["branches"]
    ops = in_sems[1:]
    results = [self.sub(b, ops).run() for b in branches]
    # An operand no branch uses is not handed to the cond: JAX forwards a
    # future every branch returns unchanged out of the cond (the result is
    # the operand itself) and keeps the operand, unused by every branch.
    # It stays with this trace, to be awaited once after the cond.
    ops = [
      None if all(r[1][k] == 0 for r in results) else s
      for k, s in enumerate(ops)
    ]

    def hint(i):
      if len(results) != 2:
        return ""
      return f" ({'false_fun' if i == 0 else 'true_fun'} of lax.cond)"

    for k, s in enumerate(ops):
      if s is not None:
        self.passed_on_and_awaited(eqn, k, s, [r[1][k] for r in results], hint)
        for i, (_, uses) in enumerate(results):
          self.expect(s, uses[k], f" in branch {i} of a cond{hint(i)}")
    outs0 = results[0][0]
    for outs, _ in results[1:]:
      if [o is None for o in outs] != [o is None for o in outs0]:
        if self.lenient:  # a branch may return a future from outside
          continue
        self.fail(
          "the branches of a cond return futures in different positions "
          f"(started at {[o.origin for o in outs if o]} vs "
          f"{[o.origin for o in outs0 if o]})."
        )
    outs = [
      next((r[0][k] for r in results if r[0][k] is not None), None)
      for k in range(len(outs0))
    ]
    self.hand_over(eqn.invars[1:], eqn.outvars, ops, outs)

  def passed_on_and_awaited(self, eqn, k, sem, uses, hint) -> None:
    """Refuses a future some branches await while the others pass it on.

    A branch that returns a future unchanged gives it back to the caller;
    when every branch returns it (one of them after awaiting it), JAX
    moves it out of the cond, so the branches that passed it on show no
    use of it and the caller still holds it: "never awaited in branch k"
    named the wrong mistake. The same holds when the caller awaits the
    future after a cond whose other branches ignore it.
    """
    awaited = [i for i, n in enumerate(uses) if n]
    idle = [i for i, n in enumerate(uses) if not n]
    if not awaited or not idle:
      return
    v = eqn.invars[1 + k]
    later = any(
      e is not eqn and any(u is v for u in e.invars) for e in self.jaxpr.eqns
    ) or any(o is v for o in self.jaxpr.outvars)
    if not later:
      return  # dropped in the idle branches: expect() names them
    j, i = awaited[0], idle[0]
    self.fail(
      f"{_where(sem)} is awaited in branch {j} of a cond{hint(j)} but "
      f"passed on from branch {i}{hint(i)} (returned unchanged, or used "
      "again after the cond): after the cond it is still in flight on "
      f"branch {i}'s path and already awaited on branch {j}'s. Await it "
      "in every branch (returning a new future if needed), or in none: "
      "return it from every branch and await it once after the cond."
    )

  def hand_over(self, invars, outvars, in_sems, outs) -> None:
    for v, s in zip(invars, in_sems, strict=True):
      if s is not None:
        self.consume(v)
    for o, s in zip(outvars, outs, strict=False):
      if s is not None:
        self.define(o, s)


def default_check(jaxpr, consts=()) -> None:
  """The life-cycle check run on every finished trace asyncops is part of.

  Raises:
    FutureError: a start never awaited or awaited twice on some path, in
      this jaxpr (futures from an enclosing trace are checked there).
  """
  del consts
  jaxpr = _open(jaxpr)
  _Flow(jaxpr, [None] * len(jaxpr.invars), lenient=True).run()
  # What is compiled: a done whose result nothing uses is dead code.
  live = jc.without_dead_code(jaxpr)
  _Flow(live, [None] * len(live.invars), lenient=True, note=_DEAD).run()


# A done whose result is unused is removed with its whole transfer
# (``_primitives._start_dce``); what is left is a split wait (``send_done``
# kept, ``recv_done`` dropped, or the reverse), whose start must stay.
_DEAD = (
  " in the compiled program: one of its split waits (send_done / "
  "recv_done) has a result nothing uses, so JAX removes that wait as dead "
  "code and that half of the DMA is never waited for. Use its result, or "
  "await with the op's done"
)


jc.on_jaxpr_traced(default_check)


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
    >>> import jax, jax.numpy as jnp, asyncops
    >>> from jax.sharding import AxisType, PartitionSpec as P
    >>> mesh = jax.make_mesh((8,), ("i",), axis_types=(AxisType.Auto,))
    >>> wait = jax.jit(asyncops.ppermute_done)
    >>> @jax.jit
    ... @jax.shard_map(mesh=mesh, in_specs=P("i"), out_specs=P("i"))
    ... def f(x):
    ...   x, fut = asyncops.ppermute_start(x, "i", shift=1)
    ...   return wait(fut) + wait(fut)  # awaited twice
    >>> x = jax.ShapeDtypeStruct((8, 128), jnp.float32)
    >>> try:
    ...   asyncops.futures.check_futures(f, x)
    ... except asyncops.FutureError as e:
    ...   print("awaited or handed on 2 times" in str(e))
    True
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
