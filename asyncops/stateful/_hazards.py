"""Trace-time hazard check: Ref accesses while a transfer is in flight.

Between a start and its done the DMA reads the source and writes the
destination. Writing the source, or reading or writing the destination, in
that window races with the DMA: on TPU it gives garbage, on CPU the two
emulation transfer points disagree.

What is checked. When JAX finishes tracing a jaxpr that asyncops took part
in, :func:`check_jaxpr` walks it in program order, following every Ref
transfer from its start (by its semaphores) to the done that awaits it:
through ``jit``/``shard_map``/``remat`` calls, ``cond`` branches and loop
carries (a future carried around a loop is in flight across the back edge
and into the next iteration). Every Ref access in a window (``ref[...]``,
``ref[k]``, an accumulate, another transfer's start, anything inside a
sub-jaxpr) is compared with the transfer's buffers: same Ref, and a slot
not proven different (:mod:`asyncops.stateful._slots`), is an error naming
the access, the start and the done. A whole-Ref access always conflicts.

Opt-in. Inside :func:`assume_disjoint`, a slot access conflicts only when
it provably selects the in-flight slot; the user asserts the rest.

Assumptions (documented in ``design/stateful.md``): a future awaited at a
done is in flight on the Refs and slots passed to that done (the start's
Refs are checked against them when both are in one trace); the loop bounds
are not used (slots are compared for every value of a loop index); Refs
are distinct unless they are the same traced Ref. A Ref that enters a
frame (``jax.checkpoint``, ``custom_vjp``, ``shard_map``) under two names
is two copies to JAX there: a transfer on it, or the frame entered so
while a transfer is in flight on it, is refused.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
from collections.abc import Iterator
from typing import Any

import jax
from jax.extend import core as jex

from asyncops import _jax_compat as jc
from asyncops.futures._future import FutureError
from asyncops.stateful import _slots
from asyncops.stateful._layout import Layout, RefView
from asyncops.stateful._slots import Slots

SCOPE = "asyncops_assume_disjoint"
_assumed: contextvars.ContextVar[bool] = contextvars.ContextVar(
  "asyncops_assume_disjoint", default=False
)

# token -> where the start with that token was traced (user code).
origins: dict[int, str] = {}


@contextlib.contextmanager
def assume_disjoint() -> Iterator[None]:
  """Asserts that slot indices traced in this block miss in-flight slots.

  The hazard check proves two traced slot indices different only from
  the arithmetic that computes them (e.g. ``i % 2`` and ``1 - i % 2``).
  Inside this block, an access through a slot index that is *not proven
  equal* to an in-flight slot is allowed, and a start whose source and
  destination slots of one Ref are not proven equal is accepted. Accesses
  to a whole Ref, and slots proven equal, are still errors.

  **You take over the proof**: a wrong assertion is a DMA race on TPU.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from asyncops import stateful
    >>> mesh = jax.make_mesh((8,), ("i",),
    ...                      axis_types=(jax.sharding.AxisType.Auto,))
    >>> @jax.jit
    ... @jax.shard_map(mesh=mesh, in_specs=jax.P("i"), out_specs=jax.P("i"))
    ... def f(x):
    ...   buf = jax.new_ref(jnp.stack([x, jnp.zeros_like(x), x]))
    ...   k = 2 * (jax.lax.axis_index("i") >= 0)  # always 2, not proven
    ...   fut = stateful.ppermute_start(buf.at[0], buf.at[1], "i", shift=1)
    ...   with stateful.assume_disjoint():  # you know k misses slots 0, 1
    ...     buf[k] = buf[k] * 10
    ...   stateful.ppermute_done(fut, buf.at[0], buf.at[1])
    ...   return buf[1] + buf[2]
    >>> x = jnp.arange(8.0)
    >>> bool(jnp.array_equal(f(x), jnp.roll(x, 1) + 10 * x))
    True
  """
  token = _assumed.set(True)
  try:
    with jax.named_scope(SCOPE):
      yield
  finally:
    _assumed.reset(token)


def assumed() -> bool:
  """Whether code traced now is inside :func:`assume_disjoint`."""
  return _assumed.get()


# Trace time: slots of views --------------------------------------------------


def trace_slots(view: RefView) -> Slots | None:
  """The slots ``view`` selects (None: the whole Ref), while tracing."""
  if view.slot is None:
    return None
  n = int(view.base_shape[0])
  slot = view.slot
  frame = jc.current_frame(slot)
  if frame is None:
    return _slots.Evaluator({}, {}).slots(slot, n)
  eqns = jc.live_eqns(frame)
  defs = {v: e for e in eqns for v in e.outvars}
  consts = dict(getattr(frame, "constvar_to_val", {}))
  return _slots.Evaluator(defs, consts).slots(slot.val, n)


def may_alias(a: Slots | None, b: Slots | None) -> bool:
  """Whether two views of one Ref may share a slot (None: whole Ref)."""
  if a is None or b is None:
    return True
  if assumed():
    return _slots.must_overlap(a, b)
  return _slots.may_overlap(a, b)


# Jaxpr time: the walk -------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class _Buf:
  """One buffer of a transfer, as seen from the jaxpr being walked.

  ``ref`` is the Ref's atom there (None when the Ref is not visible);
  ``slots`` the slots in use (None: the whole Ref).
  """

  ref: Any
  slots: Slots | None


@dataclasses.dataclass(frozen=True, eq=False)
class _Transfer:
  what: str
  origin: str
  src: _Buf
  dst: _Buf
  key: object  # identity across translations into and out of sub-jaxprs


@dataclasses.dataclass(frozen=True, eq=False)
class _Alias:
  """One Ref that entered a frame under several names.

  ``key`` identifies the Ref across frames; ``where`` is the frame's call
  (user code), ``frame`` what kind of frame, ``names`` how the Ref is
  named there (``argument 'p'``, ``a value closed over``).
  """

  key: object
  where: str
  frame: str
  names: tuple[str, ...]


# Call-like frames whose arguments JAX does not check for one Ref passed
# twice (jit, cond, switch and the loops refuse it), by primitive name.
_FRAMES = {
  "remat": "jax.checkpoint",
  "remat2": "jax.checkpoint",
  "checkpoint": "jax.checkpoint",
  "custom_vjp_call": "jax.custom_vjp function",
  "custom_vjp_call_jaxpr": "jax.custom_vjp function",
  "custom_jvp_call": "jax.custom_jvp function",
  "shard_map": "shard_map",
}


_REF_PRIMS = ("asyncops_ref_start", "asyncops_ref_done")
_INDEXED = {"get": 1, "swap": 2, "addupdate": 2}
_FORWARD = {"asyncops_tie", "optimization_barrier", "pvary", "copy", "copy_p"}


def check_jaxpr(jaxpr, consts=()) -> None:
  """Raises :class:`FutureError` on a Ref access racing with a transfer."""
  closed = getattr(jaxpr, "jaxpr", jaxpr)
  if not _mentions_refs(closed):
    return
  cmap = dict(zip(closed.constvars, consts, strict=False))
  _Walk(closed, cmap, {}, [], False).run()


def _mentions_refs(jaxpr) -> bool:
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in _REF_PRIMS:
      return True
    for sub in jc.jaxprs_in_params(eqn.params):
      if _mentions_refs(getattr(sub, "jaxpr", sub)):
        return True
  return False


def _is_var(x) -> bool:
  return isinstance(x, jex.Var) and not jc.is_drop_var(x)


class _Walk:
  """Walks one jaxpr with the transfers in flight when it begins.

  Args:
    jaxpr: the (open) jaxpr.
    consts: known constant values of its constvars.
    live: ``invar -> transfer`` for semaphores passed in.
    ambient: transfers in flight whose semaphores are not passed in.
    assumed: inside :func:`assume_disjoint`.
    aliases: ``id(invar) -> _Alias`` for Refs passed in under several
      names (one buffer outside).
  """

  def __init__(self, jaxpr, consts, live, ambient, assumed, aliases=None):
    self.jaxpr = jaxpr
    self.aliases: dict[int, _Alias] = dict(aliases or {})
    self.live: dict[Any, _Transfer] = dict(live)
    self.ambient: list[_Transfer] = list(ambient)
    self.assumed = assumed
    defs = {v: e for e in jaxpr.eqns for v in e.outvars}
    self.ev = _slots.Evaluator(defs, consts)
    self.awaited: set[object] = set()
    self.eqns = jaxpr.eqns
    self.at = 0

  # State ---------------------------------------------------------------------

  def inflight(self) -> list[_Transfer]:
    seen, out = set(), []
    for t in itertools.chain(self.live.values(), self.ambient):
      if t.key not in seen:
        seen.add(t.key)
        out.append(t)
    return out

  def end(self, t: _Transfer) -> None:
    self.awaited.add(t.key)
    for v in [v for v, u in self.live.items() if u.key is t.key]:
      del self.live[v]
    self.ambient = [u for u in self.ambient if u.key is not t.key]

  def run(self) -> list[_Transfer | None]:
    """Walks every equation; returns the transfers of the outputs."""
    for at, eqn in enumerate(self.eqns):
      self.at = at
      self.eqn(eqn)
    return [
      self.live.get(v) if _is_var(v) else None for v in self.jaxpr.outvars
    ]

  # Equations -----------------------------------------------------------------

  def eqn(self, eqn) -> None:
    name = eqn.primitive.name
    scoped = self.assumed or SCOPE in jc.name_stack_of(eqn)
    if name == "asyncops_ref_start":
      t = self.transfer(eqn)
      self.access_transfer(eqn, t, scoped)
      for v in eqn.outvars:
        if _is_var(v):
          self.live[v] = t
      return
    if name == "asyncops_ref_done":
      for v in eqn.invars:
        if _is_var(v) and v in self.live:
          self.end(self.live[v])
          break
      return
    if name in _FORWARD:
      for v, o in zip(eqn.invars, eqn.outvars, strict=False):
        if _is_var(v) and v in self.live and _is_var(o):
          self.live[o] = self.live[v]
      return
    subs = list(jc.jaxprs_in_params(eqn.params))
    if subs:
      if self.inflight() or self.mentions(eqn):
        self.structured(eqn, name, scoped)
      return
    if self.inflight():
      self.access(eqn, scoped)

  def mentions(self, eqn) -> bool:
    return any(
      _mentions_refs(getattr(j, "jaxpr", j))
      for j in jc.jaxprs_in_params(eqn.params)
    )

  def transfer(self, eqn) -> _Transfer:
    layout: Layout = eqn.params["layout"]
    spec = eqn.params["spec"]
    n = layout.n_bufs
    bufs, slot_atoms = eqn.invars[:n], eqn.invars[n : n + 2]
    sides = []
    for i, slotted, atom in (
      (layout.src_i, layout.src_slotted, slot_atoms[0]),
      (layout.dst_i, layout.dst_slotted, slot_atoms[1]),
    ):
      ref = bufs[i]
      slots = self.slots(ref, atom) if slotted else None
      sides.append(_Buf(ref, slots))
    token = eqn.params.get("token")
    origin = origins.get(token) or jc.user_frame(eqn)
    t = _Transfer(spec.short(), origin, sides[0], sides[1], object())
    for role, b in (("source", t.src), ("destination", t.dst)):
      alias = self.aliases.get(id(b.ref)) if b.ref is not None else None
      if alias is not None:
        self.fail_alias(t, role, alias, "uses it")
    return t

  def slots(self, ref, atom) -> Slots:
    shape = getattr(getattr(ref, "aval", None), "inner_aval", None)
    n = int(shape.shape[0]) if shape is not None and shape.shape else 1
    return self.ev.slots(atom, n)

  # Accesses ------------------------------------------------------------------

  def access(self, eqn, scoped: bool) -> None:
    """Checks a plain equation's Ref reads and writes."""
    reads, writes = jc.ref_effect_inputs(eqn)
    for pos in sorted(reads | writes):
      ref = eqn.invars[pos]
      slots = self.access_slots(eqn, pos, ref)
      self.check(eqn, ref, slots, pos in writes, pos in reads, scoped, "")

  def access_transfer(self, eqn, t: _Transfer, scoped: bool) -> None:
    """A start reads its source and writes its destination."""
    how = " (by starting another transfer)"
    self.check(eqn, t.src.ref, t.src.slots, False, True, scoped, how)
    self.check(eqn, t.dst.ref, t.dst.slots, True, False, scoped, how)

  def access_slots(self, eqn, pos: int, ref) -> Slots | None:
    name = eqn.primitive.name
    if name not in _INDEXED or pos != 0 or "tree" not in eqn.params:
      return None
    leaves = eqn.invars[_INDEXED[name] :]
    return _indexer_slots(eqn.params["tree"], leaves, _leading(ref), self.ev)

  def check(self, eqn, ref, slots, write, read, scoped, how) -> None:
    if ref is None:
      return
    for t in self.inflight():
      for buf, role, hit in (
        (t.src, "source", write),
        (t.dst, "destination", write or read),
      ):
        if not hit or buf.ref is None or buf.ref is not ref:
          continue
        if not self.conflict(buf.slots, slots, scoped):
          continue
        verb = "writes" if write else "reads"
        self.fail(eqn, t, f"{verb} the {role} Ref", buf.slots, slots, how)

  @staticmethod
  def conflict(held: Slots | None, acc: Slots | None, scoped: bool) -> bool:
    if held is None or acc is None:
      return True
    if scoped:
      return _slots.must_overlap(held, acc)
    return _slots.may_overlap(held, acc)

  def fail(self, eqn, t: _Transfer, what, held, acc, how) -> None:
    detail = ""
    if held is not None and acc is not None:
      proven = _slots.must_overlap(held, acc)
      detail = (
        f" ({acc.describe()}, in flight: {held.describe()})"
        if proven
        else (
          f" through an index not proven different from the in-flight "
          f"{held.describe()}"
        )
      )
    done = self.done_where(t)
    raise FutureError(
      f"asyncops.stateful: {jc.eqn_where(eqn)} {what}{how}{detail} of the "
      f"{t.what} started at {t.origin}, before its done"
      f"{f' at {done}' if done else ''}: that races with the DMA. Move the "
      "access after the done, or use another Ref or a slot provably "
      "different (e.g. double_buffer's send_slot(i)/recv_slot(i)); if you "
      "know the slots differ, trace the access inside "
      "asyncops.stateful.assume_disjoint()."
    )

  def fail_alias(self, t: _Transfer, role: str, alias: _Alias, how) -> None:
    names = " and ".join(alias.names)
    raise FutureError(
      f"asyncops.stateful: the {role} Ref of the {t.what} started at "
      f"{t.origin} reaches the {alias.frame} called at {alias.where} under "
      f"two names ({names}), and the transfer {how}. Inside such a frame "
      "JAX gives each name its own copy of the buffer (jax.jit, lax.cond "
      "and the loops refuse one Ref passed twice), so a write or read "
      "through the other name misses the buffer the DMA reads or writes, "
      "and a transfer between the two names is a DMA onto its own buffer. "
      "Pass the Ref into the frame once and use that one name for it "
      "(not also as a second argument, a second pytree leaf or a value "
      "closed over), or use a separate Ref."
    )

  def done_where(self, t: _Transfer) -> str:
    sems = {v for v, u in self.live.items() if u.key is t.key}
    for eqn in self.eqns[self.at :]:
      hit = [v in sems for v in eqn.invars if _is_var(v)]
      if not any(hit):
        continue
      name = eqn.primitive.name
      if name == "asyncops_ref_done":
        return jc.eqn_where(eqn)
      if name in _FORWARD:
        for v, o in zip(eqn.invars, eqn.outvars, strict=False):
          if _is_var(v) and v in sems and _is_var(o):
            sems.add(o)
    return ""

  # Structured control flow ---------------------------------------------------

  def structured(self, eqn, name: str, scoped: bool) -> None:
    p = eqn.params
    self.frame_eqn = eqn  # the call being descended into (aliases)
    if name == "while":
      nc, nb = p["cond_nconsts"], p["body_nconsts"]
      self.loop(
        eqn,
        p["body_jaxpr"],
        consts=eqn.invars[nc : nc + nb],
        carry=eqn.invars[nc + nb :],
        xs=[],
        scoped=scoped,
      )
      cond_ops = list(eqn.invars[:nc]) + list(eqn.invars[nc + nb :])
      self.descend(p["cond_jaxpr"], cond_ops, scoped, pass_sems=False)
    elif name == "scan":
      nc, ncarry = p["num_consts"], p["num_carry"]
      self.loop(
        eqn,
        p["jaxpr"],
        consts=eqn.invars[:nc],
        carry=eqn.invars[nc : nc + ncarry],
        xs=eqn.invars[nc + ncarry :],
        scoped=scoped,
      )
    elif name == "cond":
      self.cond(eqn, p["branches"], scoped)
    else:
      call = _call_jaxpr(eqn)
      if call is None:  # unknown structure: its Ref effects, whole Refs
        self.access(eqn, scoped)
        return
      outs, awaited = self.descend(call, eqn.invars, scoped)
      self.settle(awaited)
      self.bind_outputs(eqn.invars, eqn.outvars, outs, call, loop=False)

  def descend(
    self,
    closed,
    ops,
    scoped,
    pass_sems=True,
    live_in=None,
    carried=(),
    known=None,
  ):
    """Walks a sub-jaxpr whose invars receive ``ops``.

    ``known``: the positions of ``ops`` whose values the sub-jaxpr sees
    (all of them, unless given: a loop body sees its carry's first value
    only in its first iteration).

    Returns:
      The transfers of its outputs (translated into it) and the keys of
      the transfers it awaited.
    """
    inner = getattr(closed, "jaxpr", closed)
    consts = dict(
      zip(inner.constvars, getattr(closed, "consts", ()), strict=False)
    )
    into = {}
    for v, o in zip(inner.invars, ops, strict=False):
      if _is_var(o):
        into.setdefault(id(o), v)
    live, passed = {}, set(carried)
    if live_in is not None:
      live = live_in
      passed |= {t.key for t in live_in.values()}
    elif pass_sems:
      for v, o in zip(inner.invars, ops, strict=False):
        if _is_var(o) and o in self.live:
          t = self.live[o]
          live[v] = _translate(t, into)
          passed.add(t.key)
    ambient = [
      _translate(t, into) for t in self.inflight() if t.key not in passed
    ]
    aliases = self.aliases_into(closed, ops)
    walk = _Walk(inner, consts, live, ambient, scoped, aliases)
    for k, (v, o) in enumerate(zip(inner.invars, ops, strict=False)):
      if known is None or k in known:
        walk.ev.memo[id(v)] = self.ev.value(o)
    outs = walk.run()
    return outs, walk.awaited

  def aliases_into(self, closed, ops) -> dict[int, _Alias]:
    """``id(invar) -> _Alias`` for the invars of ``closed`` (receiving
    ``ops``) that name one Ref together (passed twice, or already aliased
    here); raises when a transfer in flight uses such a Ref."""
    inner = getattr(closed, "jaxpr", closed)
    groups: dict[object, list[int]] = {}
    for k, o in enumerate(ops):
      if _is_var(o) and jc.is_ref(o):
        key = self.aliases[id(o)].key if id(o) in self.aliases else o
        groups.setdefault(key, []).append(k)
    eqn = getattr(self, "frame_eqn", None)
    where = jc.eqn_where(eqn) if eqn is not None else "unknown"
    name = eqn.primitive.name if eqn is not None else "frame"
    frame = _FRAMES.get(name, f"{name} frame")
    arg_names = jc.jaxpr_arg_names(closed)
    out: dict[int, _Alias] = {}
    for key, ks in groups.items():
      outer = [
        self.aliases[id(ops[k])] for k in ks if id(ops[k]) in self.aliases
      ]
      if len(ks) < 2 and not outer:
        continue
      if len(ks) < 2:  # one name here, several outside: keep those
        alias = outer[0]
      else:
        names = tuple(_arg_name(arg_names, k) for k in ks)
        alias = _Alias(key, where, frame, names)
        for t in self.inflight():
          for role, b in (("source", t.src), ("destination", t.dst)):
            if b.ref is not None and any(b.ref is ops[k] for k in ks):
              self.fail_alias(t, role, alias, "is in flight on it")
      for k in ks:
        if k < len(inner.invars):
          out[id(inner.invars[k])] = alias
    return out

  def settle(self, awaited) -> None:
    for t in self.inflight():
      if t.key in awaited:
        self.end(t)

  def bind_outputs(self, ins, outvars, outs, closed, loop: bool) -> None:
    """Transfers leaving a sub-jaxpr become this jaxpr's, by position."""
    inner = getattr(closed, "jaxpr", closed)
    back = {}
    for v, o in zip(inner.invars, ins, strict=False):
      back.setdefault(id(v), o)
    by_key = {t.key: t for t in self.inflight()}
    for o, t in zip(outvars, outs, strict=False):
      if t is None or not _is_var(o):
        continue
      outer = by_key.get(t.key)
      self.live[o] = outer or _translate(t, back, opaque_roots=loop)

  def cond(self, eqn, branches, scoped: bool) -> None:
    ops = eqn.invars[1:]
    results = [self.descend(b, ops, scoped) for b in branches]
    # In flight after the cond unless every branch awaited it.
    awaited = set.intersection(*(set(a) for _, a in results))
    self.settle(awaited)
    for k, o in enumerate(eqn.outvars):
      ts = [r[0][k] for r in results if r[0][k] is not None]
      if ts and _is_var(o):
        by_key = {t.key: t for t in self.inflight()}
        outer = by_key.get(ts[0].key)
        self.live[o] = outer or _translate(
          _widen(ts), _invar_map(branches[0], ops), opaque_roots=True
        )

  def loop(self, eqn, body, consts, carry, xs, scoped: bool) -> None:
    """A loop: its first iteration, then any later one until what the body
    carries around the back edge repeats."""
    inner = getattr(body, "jaxpr", body)
    ops = list(consts) + list(carry) + list(xs)
    nc, ncarry = len(consts), len(carry)
    into = {}
    for v, o in zip(inner.invars, ops, strict=False):
      if _is_var(o):
        into.setdefault(id(o), v)
    carried = {}
    for k, o in enumerate(carry):
      if _is_var(o) and o in self.live:
        carried[inner.invars[nc + k]] = _translate(self.live[o], into)
    passed = {self.live[o].key for o in carry if _is_var(o) and o in self.live}
    # Iteration 0: the carry holds its initial values.
    first = set(range(nc + ncarry))
    outs, awaited = self.descend(
      body, ops, scoped, live_in=carried, carried=passed, known=first
    )
    # Transfers passed in as a carry and awaited in the body end here.
    self.settle(awaited)
    # Any later iteration: what an iteration carries out, one step later.
    steps = _increments(inner, nc, ncarry)
    invariant = set(range(nc))
    live, seen = {}, []
    for k in range(ncarry):  # passed through untouched: still in flight
      if outs[k] is not None and outs[k].key in passed:
        live[inner.invars[nc + k]] = carried.get(inner.invars[nc + k])
    live = {v: t for v, t in live.items() if t is not None}
    for _ in range(8):
      outs, _ = self.descend(
        body, ops, scoped, live_in=live, carried=passed, known=invariant
      )
      nxt = {}
      for k in range(ncarry):
        if outs[k] is not None:
          nxt[inner.invars[nc + k]] = _advance(outs[k], inner, nc, steps)
      sig = _signature(nxt, inner)
      if not nxt or sig in seen:
        break
      seen.append(sig)
      live = nxt
    self.bind_outputs(ops, eqn.outvars[:ncarry], outs[:ncarry], body, loop=True)


def _arg_name(names, k: int) -> str:
  if names is None or k >= len(names):
    return f"operand {k}"
  return f"argument {names[k]!r}" if names[k] else "a value closed over"


def _call_jaxpr(eqn):
  found = []
  for val in eqn.params.values():
    if isinstance(val, jex.ClosedJaxpr | jex.Jaxpr):
      j = getattr(val, "jaxpr", val)
      if len(j.invars) == len(eqn.invars):
        found.append(val)
  return found[0] if len(found) == 1 else None


def _invar_map(closed, ops) -> dict[int, Any]:
  inner = getattr(closed, "jaxpr", closed)
  return {id(v): o for v, o in zip(inner.invars, ops, strict=False)}


def _translate(t: _Transfer, mapping: dict[int, Any], opaque_roots=False):
  """``t`` seen through a change of scope (``id(atom) -> new atom``)."""

  def buf(b: _Buf) -> _Buf:
    ref = mapping.get(id(b.ref)) if b.ref is not None else None
    return _Buf(ref, _move_slots(b.slots, mapping, opaque_roots))

  return _Transfer(t.what, t.origin, buf(t.src), buf(t.dst), t.key)


def _move_slots(s: Slots | None, mapping, opaque_roots: bool):
  if s is None or s.root is None:
    return s
  new = mapping.get(id(s.root))
  if new is not None and not opaque_roots:
    return Slots(new, s.table)
  if opaque_roots:
    return Slots(None, (s.union,))  # varies in there: any slot it takes
  return s  # an opaque root: fixed, unknown


def _widen(ts: list[_Transfer]) -> _Transfer:
  """One transfer standing for several branches' (union of their slots)."""
  t0 = ts[0]

  def merge(bufs: list[_Buf]) -> _Buf:
    if any(b.slots is None for b in bufs):
      return _Buf(bufs[0].ref, None)
    union = frozenset().union(*(b.slots.union for b in bufs))
    return _Buf(bufs[0].ref, Slots(None, (union,)))

  return _Transfer(
    t0.what,
    t0.origin,
    merge([t.src for t in ts]),
    merge([t.dst for t in ts]),
    object(),
  )


def _increments(body, nc: int, ncarry: int) -> dict[int, int | None]:
  """Per carry invar: ``c`` when the body returns it plus ``c``, else None."""
  defs = {v: e for e in body.eqns for v in e.outvars}
  ev = _slots.Evaluator(defs, {})
  out = {}
  for k in range(ncarry):
    invar, outvar = body.invars[nc + k], body.outvars[k]
    val = ev.value(outvar)
    if isinstance(val, _slots._Lin) and val.root is invar and val.a == 1:
      out[id(invar)] = val.b
    else:
      out[id(invar)] = None
  return out


def _advance(t: _Transfer, body, nc: int, steps) -> _Transfer:
  """A transfer carried out of the body, seen at the next iteration."""
  consts = {id(v) for v in body.invars[:nc]}

  def buf(b: _Buf) -> _Buf:
    s = b.slots
    if s is None or s.root is None or id(s.root) in consts:
      return b
    step = steps.get(id(s.root))
    if step is None:
      if any(s.root is v for v in body.invars) or _defined_in(s.root, body):
        return _Buf(b.ref, Slots(None, (s.union,)))
      return b  # an opaque root from outside: loop-invariant
    p = len(s.table)
    table = tuple(s.table[(r - step) % p] for r in range(p))
    return _Buf(b.ref, Slots(s.root, table))

  return _Transfer(t.what, t.origin, buf(t.src), buf(t.dst), t.key)


def _defined_in(v, jaxpr) -> bool:
  return any(v is o for e in jaxpr.eqns for o in e.outvars)


def _signature(live, body) -> tuple:
  out = []
  for v in body.invars:
    t = live.get(v)
    if t is None:
      out.append(None)
      continue
    out.append(tuple((id(b.ref), _slot_sig(b.slots)) for b in (t.src, t.dst)))
  return tuple(out)


def _indexer_slots(tree, leaves, n: int, ev) -> Slots | None:
  """The leading-axis slots an indexed Ref access selects (None: the whole
  Ref, or an indexer not understood: any slot)."""
  try:
    transforms = jax.tree_util.tree_unflatten(tree, leaves)
  except Exception:  # noqa: BLE001 (an indexer we do not know)
    return None
  if not transforms:
    return None
  indices = getattr(transforms[0], "indices", None)
  if not indices:
    return None
  first = indices[0]
  if hasattr(first, "stride"):  # a Slice of the leading axis
    start, size, stride = (
      _slots._concrete_int(first.start),
      first.size,
      first.stride,
    )
    if start is None or not isinstance(size, int) or size <= 0:
      return None
    picked = {start + k * stride for k in range(size)}
    if all(0 <= p < n for p in picked):
      return Slots(None, (frozenset(picked),))
    return None
  if getattr(getattr(first, "aval", None), "shape", ()) not in ((), None):
    return None  # an array of indices: any slot
  return ev.slots(first, n)


def trace_read_slots(eqn: Any, ref_aval: Any) -> Slots | None:
  """The leading-axis slots of a Ref that ``eqn``, a ``get`` being traced,
  reads (None: the whole Ref, or not known: any slot).

  ``ref_aval`` is the Ref's inner aval (its leading axis holds the slots).
  """
  if eqn.primitive.name != "get" or "tree" not in eqn.params:
    return None
  frame = jc.current_frame(eqn.in_tracers[0])
  if frame is None:
    return None
  eqns = jc.live_eqns(frame)
  defs = {v: e for e in eqns for v in e.outvars}
  consts = dict(getattr(frame, "constvar_to_val", {}))
  ev = _slots.Evaluator(defs, consts)
  leaves = jc.eqn_vals(eqn)[_INDEXED["get"] :]
  n = int(ref_aval.shape[0]) if ref_aval.shape else 1
  return _indexer_slots(eqn.params["tree"], leaves, n, ev)


def _leading(ref) -> int:
  inner = getattr(getattr(ref, "aval", None), "inner_aval", None)
  shape = getattr(inner, "shape", ())
  return int(shape[0]) if shape else 1


def _slot_sig(s: Slots | None):
  return None if s is None else (id(s.root), s.table)
