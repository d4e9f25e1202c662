"""Data-parallel gradient reduction, overlapped with the rest of a backward.

A weight replicated over mesh axes that its activations vary over (the
data-parallel axes of a ``shard_map`` over a 2-D mesh) gets its gradient
summed over those axes: JAX does it with a ``psum`` outside a
``custom_vjp``, and our backward passes do it for the weights they return.
That all-reduce moves a whole weight gradient and is the largest transfer
of a training step; a ``psum`` placed where the gradient is ready runs
synchronously, with nothing to hide behind.

Algorithm. :func:`overlapped` starts the reduction of the weight gradients
that are ready with our own kernels, runs the backward work that does not
need them (``fn``) inside the transfers' window
(start, barrier, ``fn``, barrier, done, as
:func:`asyncops.scheduling.overlap` does, with barriers that dead-code
elimination splits when a gradient is unused), then awaits. Over a
data-parallel axis of two devices the all-reduce is one exchange: each
device sends its gradient to the other (a ``ppermute`` of the whole
buffer, both link directions busy at once) and adds what it receives:
the same bytes per link as a ring all-reduce, one window, and the same
rounding as ``psum`` (one add of two values in the weight's dtype).
Over ``n > 2`` devices the window holds the reduce-scatter half: the
gradient split into ``n`` slots along the first dimension ``n`` divides,
an all-to-all of the slots (slot ``p`` to device ``p``, our kernel), then
a local sum of the ``n`` slots received in the weight's dtype; the
all-gather half runs after the window. Where a later window follows (the
exchange :func:`finish_open` awaits), that half is our all-gather, in
flight across the later window; after the last window of a backward it
is XLA's ``all_gather``, exposed.

One exchange in flight at a time. An exchange holds a weight-sized
receive buffer next to the gradient it sends until its done. Before
:func:`overlapped` starts its exchanges it awaits those that earlier
windows of the same backward left in flight (``_dp_window``'s, through
:func:`finish_open`), after the gradients it is about to send are
computed; the sums of the awaited exchanges run in the new window, so
the new transfer follows the old one on the links with no gap. Two
exchanges never hold their buffers at once (the links carry one at a
time anyway): the training step of ``mlp_block`` peaks 6 MiB lower on
v5e and runs 2% faster (``design/training.md``).

Limits. Several data-parallel axes at once, a gradient no dimension of
which ``n`` divides, and a backward that is itself differentiated
(``grad`` of ``grad``) are reduced with ``jax.lax.psum`` after ``fn``:
correct, not overlapped.
The transfer's ring axis is written into the start's op name
(``ring_axis_<name>``) so the benchmarks' timeline model routes it over
that axis' links.
"""

import weakref

import jax
import jax.numpy as jnp
from jax.interpreters import ad, batching

from asyncops import _jax_compat as jc
from asyncops.futures import _api
from asyncops.scheduling import _trees

# ``own + received`` is the same on both devices of the exchange but typed
# as varying; ``psum``'s result is typed invariant. ``agreed_p`` re-types
# it (no HLO). As a linear map it is the mean over the axes' devices (they
# agree), so its transpose hands each device ``ct / n``; through the
# exchange each gradient then gets ``ct`` back, as ``psum``'s transpose.
agreed_p = jc.Primitive("asyncops_agreed")


@agreed_p.def_abstract_eval
def _agreed_abstract(x, *, axes):
  return jc.without_varying(x, axes)


def _agreed_transpose(ct, x, *, axes):
  del x
  n = 1
  for a in axes:
    n *= jax.lax.axis_size(a)
  return [jax.lax.pcast(ct, axes, to="varying") / n]


def _agreed_batch(args, dims, *, axes):
  return agreed_p.bind(args[0], axes=axes), dims[0]


jc.register_identity_lowering(agreed_p)
ad.deflinear2(agreed_p, _agreed_transpose)
batching.primitive_batchers[agreed_p] = _agreed_batch


def agreed(x, axes: tuple[str, ...]):
  """``x``, equal on every device of ``axes``, typed as invariant there."""
  return agreed_p.bind(x, axes=tuple(axes)) if axes else x


def window(futs, keep: list, rest: list):
  """``futs``, ``keep`` (their aliased sources) and ``rest`` through one
  barrier that dead-code elimination splits when the transfers' results
  are unused (``_jax_compat.window_tie``), so an exchange whose gradient
  nobody reads goes away like any dead computation.

  Returns:
    ``(futs, keep, rest)`` as the barrier returns them.
  """
  leaves, rebuild = _trees.split_futures(futs, by="asyncops window")
  index: dict[int, int] = {}
  unique: list = []
  for v in [*leaves, *keep]:
    if _trees.is_array(v) and id(v) not in index:
      index[id(v)] = len(unique)
      unique.append(v)
  tied, rest = jc.window_tie(unique, list(rest))

  def get(v):
    return tied[index[id(v)]] if id(v) in index else v

  return rebuild([get(v) for v in leaves]), [get(v) for v in keep], rest


# Windows (``_dp_window.Window``) whose exchanges may be in flight; each
# has ``finish(values) -> values``. Kept here, not imported, since
# ``_dp_window`` builds on this module.
_open_windows: "weakref.WeakSet" = weakref.WeakSet()


def track(window) -> None:
  """Lets :func:`finish_open` await ``window``'s exchanges."""
  _open_windows.add(window)


def finish_open(values: list) -> tuple[list, list]:
  """Awaits the exchanges open windows left in flight in this trace.

  Each done runs after ``values`` are computed (the backward between the
  window's start and here stays in its window); ``values`` come back tied
  after the dones, so an exchange started from them runs after: one
  weight-sized receive buffer is live at a time, not one per weight. The
  links carry one exchange at a time either way.

  Returns:
    ``(values, later)``: ``later`` are the awaited exchanges; pass each
    one's ``arrays`` through the next window's barrier and call its
    ``settle`` with them, so the sums run after the next start, not
    between the done and it.
  """
  later = []
  for w in list(_open_windows):
    values, more = w.finish(values)
    later += more
  return values, later


def _extra_axes(ct, primal) -> tuple[str, ...]:
  """Axes ``ct`` varies over and ``primal`` does not (sorted)."""
  return tuple(sorted(jc.varying_axes(ct) - jc.varying_axes(primal)))


def _finish(ct, primal, extra: tuple[str, ...]):
  """``ct`` summed over ``extra`` (``psum``), typed and cast like
  ``primal``."""
  if extra:
    ct = jax.lax.psum(ct, extra)
  missing = tuple(sorted(jc.varying_axes(primal) - jc.varying_axes(ct)))
  if missing:
    ct = jax.lax.pcast(ct, missing, to="varying")
  return ct.astype(primal.dtype)


def _slot_dim(shape, n: int) -> int | None:
  """The first dimension of ``shape`` that ``n`` slots split evenly."""
  return next((d for d, s in enumerate(shape) if s % n == 0), None)


def exchangeable(shape, axis: str) -> bool:
  """Whether :func:`exchange_start` reduces a gradient of ``shape`` over
  ``axis``: two devices, or more and a dimension they split evenly."""
  n = jax.lax.axis_size(axis)
  return n == 2 or (n > 2 and _slot_dim(shape, n) is not None)


def exchange_start(ct, axis: str):
  """Starts the all-reduce of ``ct`` over ``axis`` with our kernels.

  Two devices: each sends its whole gradient to the other (``ppermute``).
  More: the reduce-scatter half, an all-to-all of ``n`` slots (slot ``p``
  to device ``p``, split along the first dimension ``n`` divides).

  Returns:
    ``(sent, fut)``: the start's aliased source and the future, for
    :func:`exchange_done`.
  """
  n = jax.lax.axis_size(axis)
  with jax.named_scope(f"ring_axis_{axis}"):
    if n == 2:
      with jax.named_scope("ring_shift+1"):
        return _api.ppermute_start(ct, axis, shift=1)
    d = _slot_dim(ct.shape, n)
    shape = ct.shape[:d] + (n, ct.shape[d] // n) + ct.shape[d + 1 :]
    slots = jnp.moveaxis(ct.reshape(shape), d, 0)
    return _api.all_to_all_start(slots, axis)


def exchange_done(sent, fut, axis: str, shape):
  """Awaits :func:`exchange_start`; returns the sum over ``axis`` (typed
  varying, as ``sent``).

  Two devices: ``own + received``, ``psum``'s value and rounding. More:
  the slots received summed in the gradient's dtype (this device's block
  of the sum), then gathered back by XLA's all-gather (after the window:
  this half is exposed; :func:`gather_start` runs it in flight).
  """
  return exchange_sum(sent, exchange_wait(fut), axis, shape)


def exchange_wait(fut):
  """Awaits :func:`exchange_start`'s transfer; returns what arrived (the
  partner's gradient, or ``[n, ...]``: slot ``j`` from device ``j``)."""
  return _api.done(fut)


def exchange_sum(sent, got, axis: str, shape):
  """:func:`exchange_done`'s sum of what :func:`exchange_wait` returned."""
  n = jax.lax.axis_size(axis)
  if n == 2:
    return sent + got
  block = jnp.sum(got, axis=0, dtype=got.dtype)
  d = _slot_dim(shape, n)
  with jax.named_scope(f"dp_allgather_axis_{axis}"):
    return jax.lax.all_gather(block, axis, axis=d, tiled=True)


def gather_start(got, axis: str, shape):
  """Over ``n > 2`` devices, the all-gather half in flight: this device's
  block of the sum (the slots that arrived, summed in the gradient's
  dtype) and the start of its all-gather with our kernel.

  Returns:
    ``(block, fut)``: the start's aliased source and the future, for
    :func:`gather_done`.
  """
  n = jax.lax.axis_size(axis)
  block = jnp.sum(got, axis=0, dtype=got.dtype)
  d = _slot_dim(shape, n)
  with jax.named_scope(f"ring_axis_{axis}"):
    with jax.named_scope("dp_allgather"):
      return _api.all_gather_start(block, axis, axis=d, tiled=True)


def gather_done(fut):
  """Awaits :func:`gather_start`: the whole sum over the axis."""
  return _api.all_gather_done(fut)


def _swappable(extra: tuple[str, ...], shape) -> bool:
  return len(extra) == 1 and exchangeable(shape, extra[0])


def overlapped(cts, primals, fn, *args):
  """Reduces ``cts`` over their data-parallel axes while ``fn(*args)`` runs.

  Args:
    cts: weight gradients (a tuple), each varying over at least the mesh
      axes its primal varies over.
    primals: the weights (a tuple, same length): their manual axes and
      dtype are the targets.
    fn: the rest of the backward, independent of ``cts``.
    *args: ``fn``'s arguments; they pass through the window's first
      barrier, so ``fn`` runs after the starts.

  Returns:
    ``(reduced, out)``: each gradient summed over the axes it varies over
    and its primal does not, in the primal's dtype; and ``fn(*args)``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import AxisType, PartitionSpec as P
    >>> from asyncops.collective_matmul._dp_reduce import overlapped
    >>> mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))
    >>> @jax.jit
    ... @jax.shard_map(
    ...   mesh=mesh, in_specs=(P("d"), P(), P("d")), out_specs=(P(), P("d"))
    ... )
    ... def f(g, w, x):
    ...   (dw,), y = overlapped((g,), (w,), jnp.sin, x)
    ...   return dw, y
    >>> g, w = jnp.ones((8 * 256, 512)), jnp.zeros((256, 512))
    >>> x = jnp.arange(8.0)
    >>> dw, y = f(g, w, x)
    >>> dw.shape, bool(jnp.all(dw == 8.0)), bool(jnp.allclose(y, jnp.sin(x)))
    ((256, 512), True, True)
  """
  extras = [_extra_axes(c, p) for c, p in zip(cts, primals, strict=True)]
  # A backward being differentiated again (second order) reduces with psum:
  # the window would tie the derivative's dead rings to live ones.
  swap = (
    []
    if jc.differentiating()
    else [
      i
      for i, (e, c) in enumerate(zip(extras, cts, strict=True))
      if _swappable(e, c.shape)
    ]
  )
  if not swap:
    out = fn(*args)
    reduced = tuple(
      _finish(c, p, e) for c, p, e in zip(cts, primals, extras, strict=True)
    )
    return reduced, out
  ready, later = finish_open([cts[i].astype(primals[i].dtype) for i in swap])
  sent, futs = [], []
  for i, c in zip(swap, ready, strict=True):
    (axis,) = extras[i]
    ct, fut = exchange_start(c, axis)
    sent.append(ct)
    futs.append(fut)

  # fn's arguments after the starts, the dones after fn's results.
  leaves, tree = jax.tree.flatten(args)
  settled = [a for e in later for a in e.arrays]
  futs, sent, leaves = window(tuple(futs), sent, leaves + settled)
  leaves, settled = leaves[: tree.num_leaves], leaves[tree.num_leaves :]
  for k, e in enumerate(later):
    e.settle(settled[2 * k : 2 * k + 2])
  # Over n > 2 devices an awaited exchange's all-gather half starts here
  # and runs in this window too.
  gathers = [e for e in later if e.fut is not None]
  if gathers:
    g, keep, leaves = window(
      tuple(e.fut for e in gathers), [e.block for e in gathers], leaves
    )
    for e, f, b in zip(gathers, g, keep, strict=True):
      e.fut, e.block = f, b
  out = fn(*jax.tree.unflatten(tree, leaves))
  leaves, tree = jax.tree.flatten(out)
  futs, sent, leaves = window(futs, sent, leaves)
  if gathers:
    g, keep, leaves = window(
      tuple(e.fut for e in gathers), [e.block for e in gathers], leaves
    )
    for e, f in zip(gathers, g, strict=True):
      e.total = gather_done(f)
  out = jax.tree.unflatten(tree, leaves)
  reduced = list(cts)
  for i, own, fut in zip(swap, sent, futs, strict=True):
    total = exchange_done(own, fut, extras[i][0], cts[i].shape)
    reduced[i] = agreed(total, extras[i])
  reduced = tuple(
    _finish(c, p, () if i in swap else e)
    for i, (c, p, e) in enumerate(zip(reduced, primals, extras, strict=True))
  )
  return reduced, out
