"""The value-level API: ``*_start`` returns ``(x, future)``, ``*_done`` waits.

**Use the returned ``x``**, not the one you passed in: the start kernel
aliases its input, and code that keeps using the pre-start buffer makes XLA
insert a defensive copy (and lets it schedule that code before the start).
"""

import dataclasses

import jax
import jax.numpy as jnp

from asyncops import _jax_compat as jc
from asyncops.futures import _bitcast, _emulation, _primitives, _validate
from asyncops.futures import _check as _lifecycle
from asyncops.futures._future import Future, FutureError, _user_frame
from asyncops.kernels import _registry
from asyncops.kernels._spec import MemorySpace, OpSpec


def _start(x, spec: OpSpec):
  carrier = _bitcast.carrier(spec.dtype)
  if carrier is not None:
    # The future holds the carrier: the start aliases it, the done waits
    # on it, and the user's dtype comes back by conversion (_bitcast).
    x = _bitcast.to_carrier(x, carrier)
    spec = dataclasses.replace(
      spec,
      shape=tuple(x.shape),
      dtype=carrier.dtype,
      view_dtype=spec.dtype,
    )
  _registry.get(spec.kind).validate(spec)
  with jax.named_scope(f"asyncops.{spec.kind}_start"):
    x, dst, *sems = _primitives.start_p.bind(x, spec=spec)
  if sems:
    jc.mark_frame(sems[0])  # the life-cycle check runs when tracing ends
  fut = Future(tuple(sems), x, dst, spec, origin=_user_frame())
  return _view(x, spec), fut


def _view(y, spec: OpSpec):
  """A carrier as the user's dtype (``y`` itself if it travels as is)."""
  if spec.view_dtype is None:
    return y
  return _bitcast.from_carrier(y, spec.view_dtype)


def _check(fut, fn: str, kind: str | None):
  if not isinstance(fut, Future):
    raise TypeError(
      f"{fn}: expected the Future returned by a *_start function, got "
      f"{type(fut).__name__}. (Did you pass the returned x instead of the "
      "future?)"
    )
  if kind is not None and fut.spec.kind != kind:
    raise FutureError(
      f"{fn}: this future comes from {fut.spec.kind}_start "
      f"({fut.spec.short()}); await it with {fut.spec.kind}_done (or the "
      "generic asyncops.done)."
    )


def _finalize(y, spec: OpSpec):
  return _view(_registry.get(spec.kind).finalize(y, spec), spec)


def _wait_all(fut: Future, fn: str, kind: str | None):
  _check(fut, fn, kind)
  fut._consume(fn, fut.sems)
  spec = fut.spec
  if fut.state == "ready":  # awaited by a scheduling helper already
    return fut.dst
  with jax.named_scope(f"asyncops.{spec.kind}_done"):
    if fut.state == "sent":
      y = _primitives.recv_done_p.bind(fut.dst, *fut.sems, spec=spec)
    else:
      y = _primitives.done_p.bind(fut.src, fut.dst, *fut.sems, spec=spec)
  return _finalize(y, spec)


# Importing the life-cycle check installs it on every trace we take part in.
del _lifecycle


def collective_spec(kind, x, axis_name, fn, perm=(), **kw) -> OpSpec:
  """The spec of a collective on ``x`` (an array or a Ref's aval)."""
  _validate.array(x, fn)
  size = _validate.axis(axis_name, fn)
  names = _validate.mesh_axes(axis_name, fn)
  return OpSpec(
    kind=kind,
    shape=tuple(x.shape),
    dtype=jnp.dtype(x.dtype).name,
    axis_name=axis_name,
    mesh_axes=names,
    axis_size=size,
    perm=perm,
    transfer=_emulation.current().transfer,
    **kw,
  )


# ppermute --------------------------------------------------------------------


def ppermute_start(x, axis_name: str, perm=None, *, shift: int | None = None):
  """Starts a collective permute of ``x`` along ``axis_name``.

  Same semantics as ``jax.lax.ppermute(x, axis_name, perm)``: device
  ``src`` sends ``x`` to device ``dst`` for each pair; a device nobody sends
  to receives zeros. ``shift=k`` is shorthand for the ring
  ``[(i, (i + k) % n) for i in range(n)]``.

  Args:
    x: the array to send (per device, inside ``shard_map``).
    axis_name: the mesh axis to permute over.
    perm: ``(source, destination)`` index pairs along ``axis_name``.
    shift: ring shift, instead of ``perm``.

  Returns:
    ``(x, future)``: ``x`` aliased through the start kernel (**use it, not
    the original, for any compute before the done**) and the future to
    pass to :func:`ppermute_done`.

    **An entry parameter is copied once**: the start aliases ``x``, so
    when ``x`` is a parameter of the jitted function XLA copies it before
    the start (donated or not; ``asyncops.inspect`` calls it a
    ``boundary`` copy, or ``memory_space`` when the copy lands in VMEM). A
    computed ``x`` is sent in place.

  Raises:
    NameError: ``axis_name`` is not bound by an enclosing ``shard_map``.
    TypeError: both or neither of ``perm``/``shift``; a dtype a DMA cannot
      move.
    ValueError: a perm index out of range or a duplicate source/destination.

  Example:
    >>> import jax, jax.numpy as jnp, asyncops
    >>> from jax.sharding import AxisType, PartitionSpec as P
    >>> mesh = jax.make_mesh((8,), ("i",), axis_types=(AxisType.Auto,))
    >>> @jax.jit
    ... @jax.shard_map(mesh=mesh, in_specs=(P("i"), P()), out_specs=P("i"))
    ... def f(x, w):
    ...   x, fut = asyncops.ppermute_start(x, "i", shift=1)
    ...   z = x @ w  # overlaps the transfer
    ...   return asyncops.ppermute_done(fut) + z
    >>> x, w = jnp.arange(32.0).reshape(8, 4), jnp.eye(4)
    >>> bool(jnp.allclose(f(x, w), jnp.roll(x, 1, axis=0) + x @ w))
    True
  """
  fn = "ppermute_start"
  _validate.array(x, fn)
  size = _validate.axis(axis_name, fn)
  pairs = _validate.perm(perm, shift, size, fn)
  return _start(x, collective_spec("ppermute", x, axis_name, fn, pairs))


def ppermute_done(fut: Future):
  """Waits for a :func:`ppermute_start` and returns the received array.

  Args:
    fut: the future from :func:`ppermute_start`, awaited exactly once.

  Returns:
    The permuted array (zeros on devices that receive from no one).

  Raises:
    FutureError: ``fut`` is from another op, or was already awaited.
  """
  return _wait_all(fut, "ppermute_done", "ppermute")


# bidirectional ring ----------------------------------------------------------


def bidirectional_start(
  x, axis_name: str, *, whole: bool = False, rows: tuple | None = None
):
  """Starts a bidirectional ring permute: half of ``x`` each way.

  The first half of ``x`` along axis 0 goes to index + 1, the second half
  to index - 1 (modulo the axis size), so both ICI directions carry data.
  The result on device ``i`` is ``concat(x_{i-1}[:h], x_{i+1}[h:])``.

  Args:
    x: the array; ``x.shape[0]`` must be even unless ``whole``.
    axis_name: the ring's mesh axis.
    whole: send all of ``x`` each way instead: the result on device ``i``
      is ``concat(x_{i-1}, x_{i+1})`` (twice ``x``'s rows), read from the
      one source (no buffer of two copies of ``x`` to send).
    rows: with ``whole``, send only ``x[lo:hi]`` (``rows = (lo, hi)``)
      each way: the result is ``concat(x_{i-1}[lo:hi], x_{i+1}[lo:hi])``.

  Returns:
    ``(x, future)`` for :func:`bidirectional_done`.

  Raises:
    TypeError: ``whole`` is not a bool.
    ValueError: ``x.shape[0]`` is odd (and not ``whole``); ``rows``
      without ``whole``, or not a range ``0 <= lo < hi <= x.shape[0]``.
  """
  fn = "bidirectional_start"
  _validate.array(x, fn)
  if not isinstance(whole, bool):
    raise TypeError(f"{fn}: whole must be a bool, got {whole!r}.")
  if rows is not None:
    ok = (
      whole
      and len(rows) == 2
      and all(isinstance(r, int) for r in rows)
      and 0 <= rows[0] < rows[1] <= x.shape[0]
    )
    if not ok:
      raise ValueError(
        f"{fn}: rows = {rows!r} with whole = {whole} and x.shape[0] = "
        f"{x.shape[0]}; rows is a range (lo, hi) of axis 0, 0 <= lo < hi "
        "<= x.shape[0], sent with whole=True. Pass whole=True, or fix the "
        "range."
      )
    rows = tuple(rows)
  if x.shape[0] % 2 and not whole:
    raise ValueError(
      f"{fn}: x.shape[0] = {x.shape[0]} is odd; the bidirectional permute "
      "sends half of axis 0 each way. Pad x to an even leading dimension, "
      "or use ppermute_start."
    )
  size = _validate.axis(axis_name, fn)
  pairs = tuple((i, (i + 1) % size) for i in range(size))
  return _start(
    x,
    collective_spec(
      "bidirectional", x, axis_name, fn, pairs, whole=whole, rows=rows
    ),
  )


def bidirectional_done(fut: Future):
  """Waits for a :func:`bidirectional_start`; returns the received array."""
  return _wait_all(fut, "bidirectional_done", "bidirectional")


# all-gather ------------------------------------------------------------------


def all_gather_start(x, axis_name: str, *, axis: int = 0, tiled: bool = False):
  """Starts an all-gather of ``x`` along ``axis_name``.

  Same result as ``jax.lax.all_gather(x, axis_name, axis=axis,
  tiled=tiled)``.

  Args:
    x: this device's shard.
    axis_name: the mesh axis to gather over.
    axis: where the gathered axis goes in the result.
    tiled: concatenate along ``axis`` instead of stacking a new axis.

  Returns:
    ``(x, future)`` for :func:`all_gather_done`.

  Raises:
    TypeError: ``axis`` is not an int, or ``tiled`` not a bool.
    ValueError: ``axis`` out of range.
  """
  fn = "all_gather_start"
  _validate.array(x, fn)
  axis = _validate.integer(axis, fn, "axis")
  tiled = _validate.boolean(tiled, fn, "tiled")
  ndim = len(x.shape) if tiled else len(x.shape) + 1
  if not -ndim <= axis < ndim:
    raise ValueError(
      f"{fn}: axis={axis!r} is out of range for a result of rank {ndim}; "
      f"pass an int in [{-ndim}, {ndim})."
    )
  carrier = _bitcast.carrier(x.dtype)
  if (
    carrier is not None
    and carrier.reshapes
    and not tiled
    and (axis % ndim == ndim - 1)
  ):
    raise ValueError(
      f"{fn}: axis={axis!r} stacks the gathered axis last, which a "
      f"{jnp.dtype(x.dtype).name} all-gather cannot do: it travels as "
      f"{carrier.dtype} with the last dimension doubled. Gather along "
      "another axis (e.g. axis=0) and move it with jnp.moveaxis, or pass "
      "tiled=True."
    )
  size = _validate.axis(axis_name, fn)
  pairs = tuple((i, j) for i in range(size) for j in range(size) if i != j)
  return _start(
    x,
    collective_spec(
      "all_gather",
      x,
      axis_name,
      fn,
      pairs,
      gather_axis=axis % ndim,
      tiled=bool(tiled),
    ),
  )


def all_gather_done(fut: Future):
  """Waits for an :func:`all_gather_start`; returns the gathered array."""
  return _wait_all(fut, "all_gather_done", "all_gather")


def all_to_all_start(x, axis_name: str):
  """Starts an all-to-all of ``x``'s slots along ``axis_name``: slot ``p``
  (``x[p]``, ``x.shape[0]`` the axis size) goes to device ``p``, which
  stores it in slot ``me``; the same result as ``jax.lax.all_to_all(x,
  axis_name, 0, 0, tiled=True)``. With a local sum over the slots it is
  the asynchronous half of a reduce-scatter (the all-gather's reverse).

  Returns:
    ``(x, future)`` for :func:`done`.

  Raises:
    ValueError: ``x.shape[0]`` is not the axis size.
  """
  fn = "all_to_all_start"
  _validate.array(x, fn)
  size = _validate.axis(axis_name, fn)
  pairs = tuple((i, j) for i in range(size) for j in range(size) if i != j)
  return _start(
    x,
    collective_spec(
      "all_to_all", x, axis_name, fn, pairs, gather_axis=0, tiled=False
    ),
  )


# local copy ------------------------------------------------------------------


def copy_start(x, *, memory_space: MemorySpace = "any"):
  """Starts a local asynchronous copy of ``x`` (HBM to HBM, or to VMEM).

  Args:
    x: the array to copy.
    memory_space: ``"any"`` (let XLA place it, normally HBM) or ``"vmem"``
      (TPU v5 and later).

  Returns:
    ``(x, future)`` for :func:`copy_done`.
  """
  fn = "copy_start"
  _validate.array(x, fn)
  if memory_space not in ("any", "vmem"):
    raise ValueError(
      f"{fn}: memory_space must be 'any' or 'vmem', got {memory_space!r}."
    )
  spec = OpSpec(
    kind="copy",
    shape=tuple(x.shape),
    dtype=jnp.dtype(x.dtype).name,
    memory_space=memory_space,
    transfer=_emulation.current().transfer,
  )
  return _start(x, spec)


def copy_done(fut: Future):
  """Waits for a :func:`copy_start`; returns the copy."""
  return _wait_all(fut, "copy_done", "copy")


# generic waits ---------------------------------------------------------------


def done(fut: Future):
  """Waits for any future (sends and receives); returns the result."""
  return _wait_all(fut, "done", None)


def send_done(fut: Future):
  """Waits for the sends only, releasing the source early.

  Args:
    fut: an in-flight future.

  Returns:
    ``(x, future)``: the source, now free to reuse or overwrite, and a
    future that only awaits the receives; pass it to :func:`recv_done`.

  Raises:
    FutureError: the sends were already awaited.
  """
  fn = "send_done"
  _check(fut, fn, None)
  if fut.state == "ready" and fut.src is not None:
    fut._consume(fn, ())
    nxt = Future((), None, fut.dst, fut.spec, "ready", origin=fut._origin)
    return _view(fut.src, fut.spec), nxt
  if fut.state != "inflight":
    raise FutureError(f"{fn}: the sends of this future were already awaited.")
  spec = fut.spec
  fut._consume(fn, fut.sems[: _primitives.n_send(spec)])
  with jax.named_scope(f"asyncops.{spec.kind}_send_done"):
    x, dst = _primitives.send_done_p.bind(
      fut.src, fut.dst, *fut.sems, spec=spec
    )
  recv = fut.sems[_primitives.n_send(spec) :]
  nxt = Future(recv, None, dst, spec, "sent", origin=fut._origin)
  return _view(x, spec), nxt


def recv_done(fut: Future):
  """Waits for the receives of a future whose sends were awaited.

  Args:
    fut: the future returned by :func:`send_done`.

  Returns:
    The received array.

  Raises:
    FutureError: the sends were not awaited yet (call :func:`send_done`
      first, or :func:`done` for both).
  """
  fn = "recv_done"
  _check(fut, fn, None)
  if fut.state not in ("sent", "ready"):
    raise FutureError(
      f"{fn}: the sends of this future are still in flight. Call "
      "send_done(fut) first (it returns the future to pass here), or "
      "done(fut) to wait for both."
    )
  return _wait_all(fut, fn, None)
