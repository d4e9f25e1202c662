"""Which slots of a Ref's leading axis an index may select, at trace time.

The hazard check must decide whether an access ``buf[k]`` can touch a slot
a DMA is using, ``buf.at[j]``, when ``j`` and ``k`` are traced. It proves
two indices different only from what the program says about them:

- a constant is itself;
- an integer scalar the analysis cannot see into (a loop index, a value
  read from memory, ``axis_index``) is a *root* ``x``, unbounded;
- ``a * x + b`` (``add``, ``sub``, ``mul``, ``neg`` with constants) stays
  a linear function of its root, still unbounded;
- ``(a * x + b) % m`` (``jnp.remainder``/``%``, floor semantics) depends
  only on ``x mod m``: it becomes a *table* of ``m`` values, one per
  residue, and any elementwise integer arithmetic, comparison or
  ``select`` of tables of one root (or of constants) is again a table.

An index then selects, per residue of its root, one slot if its value is
in ``[0, n)`` and, **conservatively, every slot otherwise** (JAX clamps or
wraps out-of-range indices, the TPU reads out of bounds: anything may be
hit). Two indices are *disjoint* when no residue (of their common root)
gives a common slot, or, for different roots, when the unions of their
slots do not meet. Everything the analysis cannot read is "every slot".

So ``i % 2`` and ``1 - i % 2`` (the double buffer's send and receive
slots) are proven disjoint for every ``i``; ``i % 1`` is always 0, so it
hits slot 0; ``i`` and ``i + 1`` are not proven disjoint (both unbounded).
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

_MAX_PERIOD = 64


@dataclasses.dataclass(frozen=True)
class Slots:
  """The slots an index may select, per residue of its root.

  Attributes:
    root: what the index depends on (a jaxpr ``Var`` or an opaque token),
      or None when it does not vary.
    table: ``table[r]`` is the set of slots selected when ``root mod
      len(table) == r``.
  """

  root: Any
  table: tuple[frozenset[int], ...]

  @property
  def union(self) -> frozenset[int]:
    return frozenset().union(*self.table)

  def describe(self) -> str:
    u = sorted(self.union)
    if len(self.table) == 1 and len(u) == 1:
      return f"slot {u[0]}"
    return "slots " + ", ".join(map(str, u))


def every(n: int) -> Slots:
  return Slots(None, (frozenset(range(max(n, 1))),))


def const(k: int, n: int) -> Slots:
  return Slots(None, (_select(k, n),))


def _select(v, n: int) -> frozenset[int]:
  if v is not None and 0 <= v < n:
    return frozenset((int(v),))
  return frozenset(range(max(n, 1)))


def _period(a: Slots, b: Slots) -> int | None:
  p = math.lcm(len(a.table), len(b.table))
  return p if p <= _MAX_PERIOD else None


def may_overlap(a: Slots, b: Slots) -> bool:
  """False only when ``a`` and ``b`` provably select different slots."""
  if a.root is not None and a.root is b.root:
    p = _period(a, b)
    if p is not None:
      return any(
        a.table[r % len(a.table)] & b.table[r % len(b.table)] for r in range(p)
      )
  return bool(a.union & b.union)


def must_overlap(a: Slots, b: Slots) -> bool:
  """True only when ``a`` and ``b`` provably select the same one slot."""
  if a.root is not None and a.root is b.root:
    p = _period(a, b)
    if p is not None:
      return all(
        len(x := a.table[r % len(a.table)]) == 1
        and x == b.table[r % len(b.table)]
        for r in range(p)
      )
  ua, ub = a.union, b.union
  return len(ua) == 1 and ua == ub


# Abstract integer values ----------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Lin:
  """``a * root + b``; ``a`` nonzero."""

  root: Any
  a: int
  b: int


@dataclasses.dataclass(frozen=True)
class _Table:
  """``values[root mod len(values)]``; ``root`` None for a constant."""

  root: Any
  values: tuple[int, ...]


_UNKNOWN = None


def _const(c) -> _Table:
  return _Table(None, (int(c),))


def _as_table(v):
  if isinstance(v, _Table):
    return v
  return _UNKNOWN


def _zip(x: _Table, y: _Table, f) -> Any:
  if x.root is not None and y.root is not None and x.root is not y.root:
    return _UNKNOWN
  p = math.lcm(len(x.values), len(y.values))
  if p > _MAX_PERIOD:
    return _UNKNOWN
  try:
    vals = tuple(
      int(f(x.values[r % len(x.values)], y.values[r % len(y.values)]))
      for r in range(p)
    )
  except (ZeroDivisionError, ValueError, OverflowError):
    return _UNKNOWN
  root = x.root if x.root is not None else y.root
  return _norm(_Table(root, vals))


def _norm(t: _Table) -> _Table:
  if len(set(t.values)) == 1:
    return _const(t.values[0])
  return t


def _c_div(a: int, b: int) -> int:
  q = abs(a) // abs(b)
  return q if (a >= 0) == (b > 0) else -q


def _c_rem(a: int, b: int) -> int:
  return a - b * _c_div(a, b)


_BINARY: dict[str, Callable[[int, int], int]] = {
  "add": operator.add,
  "sub": operator.sub,
  "mul": operator.mul,
  "div": _c_div,
  "rem": _c_rem,
  "max": max,
  "min": min,
  "eq": operator.eq,
  "ne": operator.ne,
  "lt": operator.lt,
  "le": operator.le,
  "gt": operator.gt,
  "ge": operator.ge,
  "and": operator.and_,
  "or": operator.or_,
  "xor": operator.xor,
}
# jnp functions that trace to a call of a small jaxpr, with floor semantics.
_CALLS: dict[str, Callable[[int, int], int]] = {
  "remainder": operator.mod,
  "mod": operator.mod,
  "floor_divide": operator.floordiv,
}
_UNARY: dict[str, Callable[[int], int]] = {
  "neg": operator.neg,
  "not": operator.invert,
  "abs": abs,
  "sign": lambda v: (v > 0) - (v < 0),
}
_PASS = ("convert_element_type", "pvary", "copy", "copy_p", "squeeze")
_BARRIERS = ("asyncops_tie", "optimization_barrier")


def _binary(name: str, x, y):
  if x is _UNKNOWN or y is _UNKNOWN:
    return _UNKNOWN
  if isinstance(x, _Lin) or isinstance(y, _Lin):
    return _linear(name, x, y)
  return _zip(x, y, _BINARY.get(name) or _CALLS[name])


def _linear(name: str, x, y):
  """Linear arithmetic on roots; ``% m`` of a linear value is a table."""
  cx = x.values[0] if isinstance(x, _Table) and x.root is None else None
  cy = y.values[0] if isinstance(y, _Table) and y.root is None else None
  if name in ("remainder", "mod") and isinstance(x, _Lin) and cy:
    if cy < 0 or cy > _MAX_PERIOD:
      return _UNKNOWN
    return _norm(_Table(x.root, tuple((x.a * r + x.b) % cy for r in range(cy))))
  if name in ("add", "sub"):
    sign = 1 if name == "add" else -1
    if isinstance(x, _Lin) and cy is not None:
      return _Lin(x.root, x.a, x.b + sign * cy)
    if isinstance(y, _Lin) and cx is not None:
      return _mk_lin(y.root, sign * y.a, cx + sign * y.b)
    if isinstance(x, _Lin) and isinstance(y, _Lin) and x.root is y.root:
      return _mk_lin(x.root, x.a + sign * y.a, x.b + sign * y.b)
  if name == "mul":
    if isinstance(x, _Lin) and cy is not None:
      return _mk_lin(x.root, x.a * cy, x.b * cy)
    if isinstance(y, _Lin) and cx is not None:
      return _mk_lin(y.root, y.a * cx, y.b * cx)
  return _UNKNOWN


def _mk_lin(root, a: int, b: int):
  return _const(b) if a == 0 else _Lin(root, a, b)


class Evaluator:
  """Abstract values of integer scalars in one jaxpr (or one trace).

  Args:
    defs: ``Var -> equation`` for the equations of this jaxpr (anything
      with ``primitive``, ``params`` and ``invars`` or ``in_tracers``).
    consts: ``Var -> value`` for constants known at trace time.
  """

  def __init__(self, defs: Mapping[Any, Any], consts: Mapping[Any, Any]):
    self.defs = defs
    self.consts = consts
    self.memo: dict[int, Any] = {}

  def value(self, atom, depth: int = 0):
    """The abstract value of ``atom`` (a Var, Literal or concrete value)."""
    concrete = _concrete_int(atom)
    if concrete is not None:
      return _const(concrete)
    if not _is_int_scalar(atom):
      return _UNKNOWN
    key = id(atom)
    if key in self.memo:
      return self.memo[key]
    self.memo[key] = _Lin(atom, 1, 0)  # recursion guard
    if not _is_var(atom):  # e.g. a tracer of an enclosing trace: opaque
      return self.memo[key]
    if atom in self.consts:
      out = self.value(self.consts[atom], depth + 1)
    else:
      eqn = self.defs.get(atom)
      out = _Lin(atom, 1, 0) if eqn is None else self._eqn(eqn, atom, depth)
      if out is _UNKNOWN:
        out = _Lin(atom, 1, 0)  # opaque: a root of its own
    self.memo[key] = out
    return out

  def _eqn(self, eqn, out, depth: int):
    if depth > 64:
      return _UNKNOWN
    name = eqn.primitive.name
    ins = _invals(eqn)
    vals = [self.value(v, depth + 1) for v in ins]
    if name in _PASS and len(vals) == 1:
      return vals[0]
    if name in _BARRIERS:  # value-preserving, position by position
      return vals[list(eqn.outvars).index(out)]
    if name in _UNARY and len(vals) == 1:
      v = _as_table(vals[0])
      if isinstance(vals[0], _Lin) and name == "neg":
        return _Lin(vals[0].root, -vals[0].a, -vals[0].b)
      if v is _UNKNOWN:
        return _UNKNOWN
      f = _UNARY[name]
      if name == "not" and _is_bool(out):
        f = lambda x: 1 - x  # noqa: E731
      return _norm(_Table(v.root, tuple(f(x) for x in v.values)))
    if name in _BINARY and len(vals) == 2:
      return _binary(name, *vals)
    if name == "select_n":
      tables = [_as_table(v) for v in vals]
      if any(t is _UNKNOWN for t in tables):
        return _UNKNOWN
      pred, cases = tables[0], tables[1:]
      result = cases[0]
      for k, case in enumerate(cases[1:], start=1):
        result = _zip3(pred, result, case, k)
        if result is _UNKNOWN:
          return _UNKNOWN
      return result
    if name == "clamp" and len(vals) == 3:
      lo, x, hi = vals
      return _binary("min", _binary("max", x, lo), hi)
    if name in ("pjit", "jit", "closed_call", "core_call"):
      fname = eqn.params.get("name", "")
      if fname in _CALLS and len(vals) == 2:
        return _binary(fname, *vals)
      return self._call(eqn, vals, out, depth)
    return _UNKNOWN

  def _call(self, eqn, vals, out, depth: int):
    jaxpr = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
    if jaxpr is None:
      return _UNKNOWN
    inner = getattr(jaxpr, "jaxpr", jaxpr)
    consts = dict(
      zip(inner.constvars, getattr(jaxpr, "consts", ()), strict=False)
    )
    k = list(eqn.outvars).index(out)
    defs = {v: e for e in inner.eqns for v in e.outvars}
    sub = Evaluator(defs, consts)
    for v, val in zip(inner.invars, vals, strict=False):
      sub.memo[id(v)] = val if val is not _UNKNOWN else _Lin(object(), 1, 0)
    res = sub.value(inner.outvars[k], depth + 1)
    return _UNKNOWN if _is_inner_root(res, inner) else res

  def slots(self, atom, n: int) -> Slots:
    """The slots of a leading axis of size ``n`` that index ``atom`` hits."""
    v = self.value(atom)
    if isinstance(v, _Table):
      return Slots(v.root, tuple(_select(x, n) for x in v.values))
    return every(n)


def _zip3(pred: _Table, a: _Table, b: _Table, k: int):
  """``b`` where ``pred == k``, else ``a`` (one step of ``select_n``)."""
  roots = {t.root for t in (pred, a, b) if t.root is not None}
  if len(roots) > 1:
    return _UNKNOWN
  p = math.lcm(len(pred.values), len(a.values), len(b.values))
  if p > _MAX_PERIOD:
    return _UNKNOWN
  vals = tuple(
    b.values[r % len(b.values)]
    if pred.values[r % len(pred.values)] == k
    else a.values[r % len(a.values)]
    for r in range(p)
  )
  return _norm(_Table(next(iter(roots), None), vals))


def _is_inner_root(v, jaxpr) -> bool:
  root = getattr(v, "root", None)
  if root is None:
    return False
  inner = {id(x) for x in (*jaxpr.invars, *jaxpr.constvars)}
  inner |= {id(x) for e in jaxpr.eqns for x in e.outvars}
  return id(root) in inner


def _invals(eqn) -> list[Any]:
  tracers = getattr(eqn, "in_tracers", None)  # an equation being traced
  if tracers is not None:
    return [getattr(t, "val", t) for t in tracers]
  return list(eqn.invars)


def _is_var(atom) -> bool:
  return type(atom).__name__ == "Var"


def _aval(atom):
  return getattr(atom, "aval", None)


def _is_int_scalar(atom) -> bool:
  aval = _aval(atom)
  shape = getattr(aval, "shape", None)
  dtype = getattr(aval, "dtype", None)
  if shape is None or dtype is None or math.prod(shape) != 1:
    return False
  try:
    return np.issubdtype(np.dtype(dtype), np.integer) or np.dtype(
      dtype
    ) == np.dtype(bool)
  except TypeError:
    return False


def _is_bool(atom) -> bool:
  dtype = getattr(_aval(atom), "dtype", None)
  return dtype is not None and np.dtype(dtype) == np.dtype(bool)


def _concrete_int(atom) -> int | None:
  """``atom``'s value if it is a known integer scalar, else None."""
  val = getattr(atom, "val", atom)  # a Literal's value
  if type(atom).__name__ in ("Var", "DropVar"):
    return None
  if hasattr(val, "_trace") or type(val).__name__.endswith("Tracer"):
    return None
  try:
    arr = np.asarray(val)
  except Exception:  # noqa: BLE001 (a tracer or an abstract value)
    return None
  if arr.size != 1 or not (
    np.issubdtype(arr.dtype, np.integer) or arr.dtype == np.bool_
  ):
    return None
  return int(arr.reshape(()))
