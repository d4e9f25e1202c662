"""A data-parallel gradient all-reduce in flight across a block's backward.

Background. A weight replicated over a data-parallel mesh axis gets its
gradient summed over that axis. In ``mlp_block`` the down projection's
weight gradient is ready first (the backward runs the block in reverse)
and the up projection's whole backward does not need it, so its
all-reduce could run behind all of that compute. But the backward of a
``custom_vjp`` must return finished cotangents, and a future's semaphores
cannot travel as cotangents (``design/training.md``), so no single
backward rule can start the transfer and leave it in flight.

Approach. Two identity primitives mark the window in the forward, and
their transposes (JAX runs the backward one equation at a time, in
reverse) open and close it:

- ``open_p`` at the block's entry passes ``x`` and the weights through and
  types the weights to reduce as *varying* over the data-parallel axis
  (a ``pvary``), so the backward rules between the marks return their
  gradients unreduced (``_vjp._like`` sums nothing);
- ``mark_p`` just before the weight's use (the down projection) passes it
  and the activations through.

``mark_p``'s transpose runs first: it **starts** the exchange of the
weight gradient (``ppermute`` over an axis of two devices, an all-to-all
of slots over more; see ``_dp_reduce``), ties the activations'
cotangent to the start with an optimization barrier (so the rest of the
backward runs after it), and
parks the future on the :class:`Window` (a static parameter of both
equations), keyed by the trace it runs in. ``open_p``'s transpose runs
last: it ties the done after the cotangents of ``x`` and the other
weights (the whole rest of the block's backward), **awaits**, and returns
``own + received`` typed invariant, as ``psum``'s transpose would. When
another exchange starts before that (the up projection's weight gradient,
``_dp_reduce.overlapped``), it awaits this one first
(:meth:`Window.finish`): one exchange's buffers live at a time, and
``open_p``'s transpose takes the sum as it is.

Both are linear identities: ``jax.jvp``/``jax.linearize`` pass tangents
through, ``jax.vmap`` keeps batch dimensions. A weight whose gradient is
not asked for is never started; when the transposes do not meet in one
trace, or the backward is itself differentiated, ``open_p``'s transpose
reduces with ``psum`` (correct, not overlapped).
"""

import itertools

import jax
from jax.interpreters import ad, batching

from asyncops import _jax_compat as jc
from asyncops.collective_matmul import _dp_reduce
from asyncops.futures import _ad


class Window(_ad.TracePending):
  """The data-parallel axis of one block and its in-flight exchanges.

  Hashed by identity (a primitive parameter); ``pending`` holds, per
  trace, what ``mark_p``'s transpose started until ``open_p``'s awaits.
  """

  _ids = itertools.count()

  def __init__(self, axis: str):
    super().__init__()
    self.id = next(self._ids)
    self.axis = axis

  def __repr__(self):
    return f"dp_window{self.id}[{self.axis}]"

  def finish(self, values: list) -> tuple[list, list]:
    """Awaits this window's exchanges in flight in the current trace,
    after ``values``; returns ``values`` tied after the dones and the
    awaited exchanges, whose sums wait for :meth:`_Done.settle` (see
    ``_dp_reduce.finish_open``). ``open_p``'s transpose then takes the
    sums as they are."""
    trace = jc.current_trace()
    later = []
    for k, (t, entry) in enumerate(self.pending):
      if t is not trace or not entry:
        continue
      live = [j for j, e in enumerate(entry) if isinstance(e, tuple)]
      if not live:
        continue
      futs, own, values = _dp_reduce.window(
        tuple(entry[j][1] for j in live),
        [entry[j][0] for j in live],
        list(values),
      )
      # What reads values (the next start) waits for the transfers, not
      # for the sums: those run in the next window (settle).
      got, values = jc.window_tie(
        [_dp_reduce.exchange_wait(f) for f in futs], list(values)
      )
      done = list(entry)
      for j, o, g in zip(live, own, got, strict=True):
        done[j] = _Done(self.axis, o, g, entry[j][2])
        later.append(done[j])
      self.pending[k] = (t, done)
    return values, later


class _Done:
  """An exchange :meth:`Window.finish` awaited: what was sent and what
  arrived (``arrays``) until :meth:`settle` sums them into ``total``, and
  the gradient passed on at the start (``open_p``'s transpose checks
  it)."""

  def __init__(self, axis: str, own, got, passed):
    self.axis = axis
    self.arrays = [own, got]
    self.passed = passed
    self.total = None
    self.fut = self.block = None

  def settle(self, arrays: list) -> None:
    """The sum, of ``arrays`` (``self.arrays`` through a barrier); over
    more than two devices, the start of its all-gather half (``fut``;
    ``_dp_reduce.overlapped`` awaits it into ``total``)."""
    own, got = arrays
    if jax.lax.axis_size(self.axis) == 2:
      self.total = _dp_reduce.exchange_sum(
        own, got, self.axis, self.passed.shape
      )
    else:
      self.block, self.fut = _dp_reduce.gather_start(
        got, self.axis, self.passed.shape
      )


open_p = jc.Primitive("asyncops_dp_open")
open_p.multiple_results = True
mark_p = jc.Primitive("asyncops_dp_mark")
mark_p.multiple_results = True


@open_p.def_abstract_eval
def _open_abstract(*xs, window, reduce):
  return [
    jc.without_varying(x, (window.axis,), add=True) if r else x
    for x, r in zip(xs, reduce, strict=True)
  ]


@mark_p.def_abstract_eval
def _mark_abstract(*xs, window, start):
  del window, start
  return list(xs)


def _jvp(prim, flags: str):
  """Identity per operand: zero tangents stay symbolic (so a weight whose
  gradient nobody asks for never starts an exchange), the others go
  through one ``prim`` with the matching flags."""

  def rule(primals, tangents, **params):
    out = prim.bind(*primals, **params)
    live = [i for i, t in enumerate(tangents) if type(t) is not ad.Zero]
    touts = [ad.Zero(jax.typeof(o).to_tangent_aval()) for o in out]
    if live:
      sub = dict(params, **{flags: tuple(params[flags][i] for i in live)})
      for i, t in zip(
        live, prim.bind(*(tangents[i] for i in live), **sub), strict=True
      ):
        touts[i] = t
    return out, touts

  return rule


def _batch(prim):
  def rule(args, dims, **params):
    return prim.bind(*args, **params), list(dims)

  return rule


def _linear(xs, cts):
  """The cotangents of the linear inputs, None for the others."""
  return [
    c if ad.is_undefined_primal(x) else None
    for x, c in zip(xs, cts, strict=True)
  ]


def _nonzero(c) -> bool:
  return c is not None and type(c) is not ad.Zero


def _tie(futs, keep: list, others: list):
  """``keep`` and the non-zero ``others`` through one window barrier with
  ``futs``: at a start, whatever reads ``others`` runs after the start; at
  a done, the done waits until ``others`` are computed. (Tying a scalar
  slice of each would not do: XLA pushes the slice into the producer.)
  """
  idx = [i for i, c in enumerate(others) if _nonzero(c)]
  futs, keep, live = _dp_reduce.window(futs, keep, [others[i] for i in idx])
  others = list(others)
  for i, c in zip(idx, live, strict=True):
    others[i] = c
  return futs, keep, others


def _mark_transpose(cts, *xs, window, start):
  out = _linear(xs, cts)
  marked = [i for i, s in enumerate(start) if s]
  todo = [i for i in marked if _nonzero(out[i])]
  if jc.differentiating():  # second order: open_p's transpose uses psum
    todo = []
  if not todo:
    if marked:  # open_p's transpose expects an entry
      window.push(None)
    return out
  own, futs = [], []
  for i in todo:
    o, f = _dp_reduce.exchange_start(out[i], window.axis)
    own.append(o)
    futs.append(f)
  others = [None if i in todo else c for i, c in enumerate(out)]
  futs, own, others = _tie(tuple(futs), own, others)
  # Passed on as the weights' cotangents (open_p's transpose only checks
  # that nothing was added): two devices, the aliased buffer itself
  # (the gradient is in flight); more, the gradient (the slots sent are
  # a reshape of it).
  passed = [
    o if o.shape == out[i].shape else out[i]
    for i, o in zip(todo, own, strict=True)
  ]
  # The k-th marked weight is the k-th weight open_p reduces.
  _dp_reduce.track(window)
  window.push(
    [
      (own[todo.index(i)], futs[todo.index(i)], passed[todo.index(i)])
      if i in todo
      else None
      for i in marked
    ]
  )
  for i, p in zip(todo, passed, strict=True):
    others[i] = p
  return others


def _open_transpose(cts, *xs, window, reduce):
  out = _linear(xs, cts)
  reduced = [i for i, r in enumerate(reduce) if r]
  entry = window.pop() if reduced else None
  started = {}
  if entry not in (None, _ad.MISSING):
    if len(entry) != len(reduced):
      raise AssertionError(f"{window}: {len(entry)} marked, {len(reduced)}")
    started = {
      i: e for i, e in zip(reduced, entry, strict=True) if e is not None
    }
  if started:
    # In flight still, or awaited already (Window.finish).
    todo = [i for i, e in started.items() if not isinstance(e, _Done)]
    others = [None if i in started else c for i, c in enumerate(out)]
    for e in started.values():
      if isinstance(e, _Done) and e.total is None:  # never settled
        e.total = _dp_reduce.exchange_sum(*e.arrays, e.axis, e.passed.shape)
    totals = {i: e.total for i, e in started.items() if isinstance(e, _Done)}
    if todo:
      futs, barriered, others = _tie(
        tuple(started[i][1] for i in todo),
        [started[i][0] for i in todo],
        others,
      )
      for k, i in enumerate(todo):
        totals[i] = _dp_reduce.exchange_done(
          barriered[k], futs[k], window.axis, started[i][2].shape
        )
    for i, e in started.items():
      passed = e.passed if isinstance(e, _Done) else e[2]
      total = totals[i]
      if _nonzero(out[i]) and not jc.same_value(out[i], passed):
        # Something else added to the cotangent after the start.
        total = total + jax.lax.psum(out[i] - passed, window.axis)
      others[i] = _dp_reduce.agreed(total, (window.axis,))
    out = others
  for i in reduced:
    if i in started or out[i] is None:
      continue
    if _nonzero(out[i]):  # not started (no pairing): reduce here
      out[i] = jax.lax.psum(out[i], window.axis)
    else:
      out[i] = ad.Zero(xs[i].aval.to_tangent_aval())
  return out


def _open_batch(args, dims, *, window, reduce):
  return open_p.bind(*args, window=window, reduce=reduce), list(dims)


jc.register_identity_lowering(open_p)
jc.register_identity_lowering(mark_p)
ad.primitive_jvps[open_p] = _jvp(open_p, "reduce")
ad.primitive_jvps[mark_p] = _jvp(mark_p, "start")
ad.primitive_transposes[open_p] = _open_transpose
ad.primitive_transposes[mark_p] = _mark_transpose
batching.primitive_batchers[open_p] = _open_batch
batching.primitive_batchers[mark_p] = _batch(mark_p)


def plan(x, w, axis_name: str) -> Window | None:
  """A window for ``w``'s gradient, or None when there is nothing to
  overlap: ``w`` is not replicated over exactly one axis ``x`` varies
  over, or that axis has more than two devices and no dimension of ``w``
  splits into as many slots (``psum`` then)."""
  extra = tuple(sorted(jc.varying_axes(x) - jc.varying_axes(w) - {axis_name}))
  if len(extra) != 1 or not _dp_reduce.exchangeable(w.shape, extra[0]):
    return None
  return Window(extra[0])


def open_(window: Window, xs, reduce):
  """``xs`` unchanged; those with ``reduce`` typed varying over the axis."""
  return open_p.bind(*xs, window=window, reduce=tuple(reduce))


def mark(window: Window, xs, start):
  """``xs`` unchanged; the gradients of those with ``start`` start their
  exchange in the backward here."""
  return mark_p.bind(*xs, window=window, start=tuple(start))
