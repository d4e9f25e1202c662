"""Differentiation of the value API: the backward of a transfer is a transfer.

Semantics. A start/done pair computes ``T(x)`` into the raw destination
(``finalize``, applied after the done, is ordinary JAX code and is
differentiated by JAX). ``T`` is linear in the data: a permute, a
bidirectional permute, an all-gather's slots, an all-to-all of slots, a
copy. The semaphores are integers: their tangents are ``float0`` zeros and
their cotangents symbolic zeros, and nothing ever flows through them.

Tangents (``jax.jvp``, ``jax.linearize``). The start's tangent program is
``lin_start(t) = T(t)``, a complete transfer (our start and done kernels
back to back); the done's is ``lin_done(t) = t``. Forward-mode tangents
therefore move synchronously, at the start.

Cotangents (``jax.grad``, ``jax.vjp``). ``T``'s transpose ``T^T`` is again
one of our transfers (:func:`reverse`): a permute's is the inverse permute,
a bidirectional permute's the reversed bidirectional permute, an
all-gather's an all-to-all of the cotangent's slots followed by a local sum
(a reduce-scatter), an all-to-all's itself, a copy's a copy. The backward
runs the program in reverse, so

- ``lin_done``'s transpose **starts** ``T^T`` on the done's cotangent and
  passes the reverse transfer's source on as the destination's cotangent;
  every optimization barrier the forward placed around the window
  transposes to a barrier over that cotangent and the compute's cotangents,
  so the backward compute lands inside the reverse window too;
- ``lin_start``'s transpose **waits** for it and returns the data.

The two transposes meet through a :class:`Pair` (a static parameter of both
equations) in the trace they run in. They are paired when the done's
tangent destination comes from the start's ``lin_start`` through
optimization barriers only, in one tangent jaxpr, and the start's tangent
depends on the jaxpr's inputs (so JAX transposes it rather than evaluating
it). Otherwise (a future carried across a loop iteration, returned from a
``jit``, or linearized by ``jax.jvp``/``jax.checkpoint``'s rule) the done's
transpose passes the cotangent on and the start's transpose runs ``T^T``
synchronously: still our kernels, still exact, without a window.
"""

import dataclasses
import itertools
from typing import Any

import jax
import jax.numpy as jnp
from jax.interpreters import ad

from asyncops import _jax_compat as jc
from asyncops.futures import _primitives as prims
from asyncops.kernels import _registry
from asyncops.kernels._spec import OpSpec

MISSING = object()  # what ``TracePending.pop`` finds when nothing waits


class TracePending:
  """What one transpose leaves for a later one, per trace.

  JAX transposes a backward one equation at a time, in reverse; a
  transpose that starts a transfer ``push``es its future here, and a
  later transpose in the same trace ``pop``s it (the latest first), or
  finds :data:`MISSING` when none ran there (another trace, a
  differentiated backward). Used as a static primitive parameter, so it is
  hashed by identity.
  """

  def __init__(self):
    self.pending: list[tuple[Any, Any]] = []

  def push(self, entry: Any) -> None:
    self.pending.append((jc.current_trace(), entry))

  def pop(self) -> Any:
    trace = jc.current_trace()
    for k in range(len(self.pending) - 1, -1, -1):
      if self.pending[k][0] is trace:
        return self.pending.pop(k)[1]
    return MISSING


class Pair(TracePending):
  """Links one start's tangent transfer to its done, through the transpose.

  Hashed by identity (a primitive parameter). ``claimed`` is set when a done
  pairs with it (one done per start); ``pending`` holds the reverse
  transfers started by the done's transpose, per trace, until the start's
  transpose awaits them.
  """

  _ids = itertools.count()

  def __init__(self, spec: OpSpec):
    super().__init__()
    self.id = next(self._ids)
    self.spec = spec
    self.claimed = False
    # Tie the backward compute into the reverse window (the Ref API, whose
    # forward has no barriers of its own to transpose).
    self.tie = False

  def __repr__(self):
    return f"pair{self.id}"


# The reverse transfer --------------------------------------------------------


def reverse(spec: OpSpec) -> OpSpec:
  """The spec of ``T^T``, moving a cotangent of the raw destination back."""
  base = dataclasses.replace(
    spec, shape=prims.dst_shape(spec), collective_id=None
  )
  n = spec.axis_size
  if spec.kind == "ppermute":
    return dataclasses.replace(
      base, perm=tuple(sorted((d, s) for s, d in spec.perm))
    )
  if spec.kind == "bidirectional":
    from asyncops.kernels import _bidirectional

    d = -_bidirectional.direction(spec)
    return dataclasses.replace(
      base,
      perm=tuple((i, (i + d) % n) for i in range(n)),
      whole=False,
      rows=None,
    )
  if spec.kind == "all_gather":
    return dataclasses.replace(
      base, kind="all_to_all", gather_axis=0, tiled=False
    )
  if spec.kind == "copy":
    return dataclasses.replace(base, memory_space="any")
  if spec.kind == "all_to_all":
    return base
  raise NotImplementedError(
    f"asyncops: no transpose for a {spec.kind!r} transfer ({spec.short()})."
  )


def _after_reverse(y, spec: OpSpec, rev: OpSpec):
  """The cotangent of the source, from ``T^T``'s raw destination."""
  y = _registry.get(rev.kind).finalize(y, rev)
  if spec.kind == "all_gather":
    y = jnp.sum(y, axis=0, dtype=y.dtype)  # the reduce of reduce-scatter
  if spec.kind == "bidirectional" and spec.whole:
    a = spec.gather_axis
    lo, hi = jnp.split(y, 2, axis=a)  # the copies' sum
    y = lo + hi
    if spec.rows:  # zero beside the rows that travelled
      pad = [(0, 0)] * y.ndim
      pad[a] = (spec.rows[0], spec.shape[a] - spec.rows[1])
      y = jnp.pad(y, pad)
  return y


def transfer_now(t, spec: OpSpec):
  """``T(t)`` into the raw destination: a start and its done back to back."""
  x, dst, *sems = prims.start_p.bind(t, spec=spec)
  return prims.done_p.bind(x, dst, *sems, spec=spec)


def _as(ct, spec: OpSpec):
  return ct if ct.dtype == spec.np_dtype else ct.astype(spec.np_dtype)


# Tangent primitives ----------------------------------------------------------

lin_start_p = jc.Primitive("asyncops_lin_start")
lin_done_p = jc.Primitive("asyncops_lin_done")


@lin_start_p.def_abstract_eval
def _lin_start_abstract(t, *, spec, pair):
  del pair
  return t.update(shape=prims.dst_shape(spec))


@lin_done_p.def_abstract_eval
def _lin_done_abstract(t, *, spec, pair):
  del spec, pair
  return t


jc.register_lowering(
  lin_start_p,
  lambda t, *, spec, pair: transfer_now(t, spec),
  multiple_results=False,
)
jc.register_lowering(
  lin_done_p, lambda t, *, spec, pair: t, multiple_results=False
)


_TRANSFERS = ("asyncops_start", "asyncops_done")


def _transfers_since(eqn, sem) -> bool:
  """Whether a start or done was traced after ``eqn`` in ``sem``'s jaxpr."""
  frame = jc.current_frame(sem)
  eqns = jc.live_eqns(frame) if frame is not None else []
  at = next((i for i, e in enumerate(eqns) if e is eqn), None)
  if at is None:
    return True
  return any(e.primitive.name in _TRANSFERS for e in eqns[at + 1 :])


def _lin_start_transpose(ct, t, *, spec, pair):
  rev = reverse(spec)
  entry = pair.pop() if pair is not None else MISSING
  if entry is MISSING:  # unpaired: T^T now, where the start was
    if type(ct) is ad.Zero:
      return [ad.Zero(t.aval)]
    return [_after_reverse(transfer_now(_as(ct, spec), rev), spec, rev)]
  if entry is None:  # the done's cotangent was zero
    return [ad.Zero(t.aval)]
  src, dst, sems, eqn = entry
  if eqn is not None and not _transfers_since(eqn, sems[0]):
    # Only a window with no other transfer started or awaited in it: the
    # ties of overlapping windows would sweep each other's transfers in.
    sems = jc.tie_between(eqn, list(sems))
  if type(ct) is not ad.Zero and jc.same_value(ct, src):
    # ``ct`` is the reverse source after every barrier of the backward
    # window: awaiting it (it keeps the source alive, like the forward's
    # done) orders the wait after the backward compute in the window.
    src = ct
  y = prims.done_p.bind(src, dst, *sems, spec=rev)
  return [_after_reverse(y, spec, rev)]


def _lin_done_transpose(ct, t, *, spec, pair):
  if pair is None:
    return [ct]
  if type(ct) is ad.Zero:
    pair.push(None)
    return [ad.Zero(t.aval)]
  src, dst, *sems = prims.start_p.bind(_as(ct, spec), spec=reverse(spec))
  eqn = None
  if pair.tie and (frame := jc.current_frame(sems[0])) is not None:
    eqn = jc.live_eqns(frame)[-1]
  pair.push((src, dst, sems, eqn))
  return [src]


ad.primitive_transposes[lin_start_p] = _lin_start_transpose
ad.primitive_transposes[lin_done_p] = _lin_done_transpose


def _lin_start_jvp(primals, tangents, *, spec, pair):
  (t,), (tt,) = primals, tangents
  out = lin_start_p.bind(t, spec=spec, pair=pair)
  return out, lin_start_p.bind(ad.instantiate_zeros(tt), spec=spec, pair=None)


def _lin_done_jvp(primals, tangents, *, spec, pair):
  (t,), (tt,) = primals, tangents
  return lin_done_p.bind(t, spec=spec, pair=pair), tt


ad.primitive_jvps[lin_start_p] = _lin_start_jvp
ad.primitive_jvps[lin_done_p] = _lin_done_jvp


# Rules of the primitives -----------------------------------------------------


def _sem_zeros(x, spec: OpSpec) -> list[ad.Zero]:
  return [ad.Zero(jc.sem_like(x).to_tangent_aval())] * prims.n_sems(spec)


def _claim(t_dst, spec: OpSpec) -> Pair | None:
  """The start's :class:`Pair` if ``t_dst`` comes from its ``lin_start``."""
  found = jc.forwarded_from(t_dst, lin_start_p)
  if found is None:
    return None
  pair = found[0]["pair"]
  if pair is None or pair.claimed or pair.spec != spec:
    return None
  pair.claimed = True
  return pair


def _wait_tangent(tx, tdst, dst, spec: OpSpec, pair):
  """The done's output tangent: ``tdst``, or ``T(tx)`` if only ``tx`` has
  one (the transfer="done" reading of the pair)."""
  if type(tdst) is not ad.Zero:
    return lin_done_p.bind(tdst, spec=spec, pair=pair)
  if type(tx) is not ad.Zero:
    return lin_start_p.bind(tx, spec=spec, pair=None)
  return ad.Zero(jax.typeof(dst).to_tangent_aval())


# jvp rules (jax.jvp; jax.checkpoint and other rules linearized through jvp).


def _start_jvp(primals, tangents, *, spec):
  (x,), (t,) = primals, tangents
  outs = prims.start_p.bind(x, spec=spec)
  t = ad.instantiate_zeros(t)
  t_dst = lin_start_p.bind(t, spec=spec, pair=None)
  return outs, [t, t_dst, *_sem_zeros(x, spec)]


def _done_jvp(primals, tangents, *, spec):
  y = prims.done_p.bind(*primals, spec=spec)
  return y, _wait_tangent(tangents[0], tangents[1], primals[1], spec, None)


def _send_done_jvp(primals, tangents, *, spec):
  outs = prims.send_done_p.bind(*primals, spec=spec)
  return outs, list(tangents[:2])


def _recv_done_jvp(primals, tangents, *, spec):
  y = prims.recv_done_p.bind(*primals, spec=spec)
  tdst = tangents[0]
  if type(tdst) is ad.Zero:
    return y, tdst
  return y, lin_done_p.bind(tdst, spec=spec, pair=None)


ad.primitive_jvps[prims.start_p] = _start_jvp
ad.primitive_jvps[prims.done_p] = _done_jvp
ad.primitive_jvps[prims.send_done_p] = _send_done_jvp
ad.primitive_jvps[prims.recv_done_p] = _recv_done_jvp


# Linearization rules (jax.grad, jax.vjp, jax.linearize): these see the
# tangent jaxpr being built, so a done can find its start.


def _start_lin(is_vjp, nzs, x, *, spec):
  del is_vjp
  outs = prims.start_p.bind(x, spec=spec)
  (nz,) = nzs

  def linearized(residuals, t):
    del residuals
    pair = Pair(spec) if jc.reaches_inputs(t) else None
    t_dst = lin_start_p.bind(t, spec=spec, pair=pair)
    return [t, t_dst, *_sem_zeros(x, spec)]

  return outs, [nz, nz] + [False] * prims.n_sems(spec), [], linearized


def _done_lin(is_vjp, nzs, x, dst, *sems, spec):
  del is_vjp
  y = prims.done_p.bind(x, dst, *sems, spec=spec)

  def linearized(residuals, tx, tdst, *tsems):
    del residuals, tsems
    pair = None if type(tdst) is ad.Zero else _claim(tdst, spec)
    return _wait_tangent(tx, tdst, dst, spec, pair)

  return y, bool(nzs[0] or nzs[1]), [], linearized


def _send_done_lin(is_vjp, nzs, x, dst, *sems, spec):
  del is_vjp
  outs = prims.send_done_p.bind(x, dst, *sems, spec=spec)

  def linearized(residuals, tx, tdst, *tsems):
    del residuals, tsems
    return [tx, tdst]

  return outs, [nzs[0], nzs[1]], [], linearized


def _recv_done_lin(is_vjp, nzs, dst, *sems, spec):
  del is_vjp
  y = prims.recv_done_p.bind(dst, *sems, spec=spec)

  def linearized(residuals, tdst, *tsems):
    del residuals, tsems
    if type(tdst) is ad.Zero:
      return tdst
    return lin_done_p.bind(tdst, spec=spec, pair=_claim(tdst, spec))

  return y, nzs[0], [], linearized


jc.register_linearization(prims.start_p, _start_lin)
jc.register_linearization(prims.done_p, _done_lin)
jc.register_linearization(prims.send_done_p, _send_done_lin)
jc.register_linearization(prims.recv_done_p, _recv_done_lin)
