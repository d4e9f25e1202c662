"""The stateful API: start and done over ``jax.Ref``s.

A start reads the source Ref and writes the destination Ref; the done waits.
Ordering comes from state effects: any access to those Refs written after
the start stays after it, any written after the done stays after the done.
Compute written between a start and its done that touches neither Ref is
kept between them too (two optimization barriers tie it to the start's
semaphores), so it overlaps the DMA on TPU.

**Between a start and its done, do not write the source or touch the
destination**: the trace-time hazard check raises if you do, also through
a traced slot index it cannot prove different, and across loop carries.
"""

import dataclasses

import jax
import jax.numpy as jnp

from asyncops import _jax_compat as jc
from asyncops.futures import _api as _futures_api
from asyncops.futures import _check, _emulation, _validate
from asyncops.futures._future import FutureError, _user_frame
from asyncops.kernels import _registry
from asyncops.kernels._spec import OpSpec
from asyncops.stateful import _future, _hazards, _slots
from asyncops.stateful._future import RefFuture
from asyncops.stateful._layout import Layout, RefView, same_base, view
from asyncops.stateful._primitives import n_sems, ref_done_p, ref_start_p

# The life-cycle check follows Ref futures too; the hazard check runs on
# every finished trace that holds a Ref transfer.
_check.register_start(
  ref_start_p,
  lambda eqn: range(len(eqn.outvars)),
  origin=lambda eqn: (
    _hazards.origins.get(eqn.params["token"]) or jc.user_frame(eqn)
  ),
)
_check.register_wait(
  ref_done_p,
  lambda eqn: (
    eqn.params["layout"].n_bufs + 2,
    n_sems(eqn.params["spec"]),
  ),
)
jc.on_jaxpr_traced(_hazards.check_jaxpr)


# Op-name scopes of a start: it moves one slot of the destination Ref, or
# the whole destination.
MSG_SLOT = "ref_message_dst_slot"
MSG_WHOLE = "ref_message_dst_whole"


def _operands(src: RefView, dst: RefView):
  zero = jnp.int32(0)
  slots = (
    zero if src.slot is None else src.slot,
    zero if dst.slot is None else dst.slot,
  )
  if same_base(src, dst):
    return (src.base,) + slots, Layout(1, True, True)
  layout = Layout(2, src.slot is not None, dst.slot is not None)
  return (src.base, dst.base) + slots, layout


def _check_dst(src: RefView, dst: RefView, spec: OpSpec, fn: str):
  want = tuple(_registry.get(spec.kind).dst_shape(spec))
  got = dst.aval
  if tuple(got.shape) != want or got.dtype != src.aval.dtype:
    raise ValueError(
      f"{fn}: dst_ref holds {got.dtype}{list(got.shape)} but this transfer "
      f"writes {src.aval.dtype}{list(want)}. Make it with "
      f"jax.empty_ref(jax.ShapeDtypeStruct({want}, {src.aval.dtype}))."
    )
  if not same_base(src, dst):
    return
  if dst.slot is None or src.slot is None:
    raise ValueError(
      f"{fn}: src_ref and dst_ref are the same Ref; a DMA needs a "
      "separate receive buffer (see asyncops.stateful.double_buffer)."
    )
  a, b = _hazards.trace_slots(src), _hazards.trace_slots(dst)
  if _hazards.may_alias(a, b):
    same = _slots.must_overlap(a, b)
    raise ValueError(
      f"{fn}: src_ref and dst_ref are "
      + (
        f"the same {a.describe()} of one Ref"
        if same
        else (
          "slots of one Ref whose indices are not proven different "
          f"(source {a.describe()}, destination {b.describe()})"
        )
      )
      + "; a DMA needs a separate receive buffer. Use two slots the "
      "program proves different, e.g. buf.at[i % 2] and buf.at[1 - i % 2] "
      "(asyncops.stateful.double_buffer), or, if you know they differ, "
      "start the transfer inside asyncops.stateful.assume_disjoint()."
    )


def _start(src_ref, dst_ref, fn: str, make_spec) -> RefFuture:
  src = view(src_ref, fn, "src_ref")
  dst = view(dst_ref, fn, "dst_ref")
  _validate.array(src.aval, fn, "src_ref", carriers=False)
  spec = make_spec(src.aval)
  _registry.get(spec.kind).validate(spec)
  _check_dst(src, dst, spec, fn)
  operands, layout = _operands(src, dst)
  origin = _user_frame()
  token = _future.new_token()
  _hazards.origins[token] = origin
  # The message is one slot of the destination or all of it; the compiled
  # kernel's output is the whole destination buffer either way, so the
  # op name says which (benchmarks/_timeline reads it).
  msg = MSG_SLOT if dst.slot is not None else MSG_WHOLE
  with jax.named_scope(f"asyncops.{spec.kind}_ref_start"), jax.named_scope(msg):
    sems = ref_start_p.bind(*operands, spec=spec, layout=layout, token=token)
  fut = RefFuture(sems, spec, layout, origin=origin, token=token)
  frame = jc.current_frame(sems[0]) if sems else None
  if frame is not None:
    # The checks run when this trace ends, and in the frame a custom_vjp
    # function holding it is called from (a Ref passed in twice).
    jc.mark_frame(sems[0], orphan=True)
    fut._track = (jc.live_eqns(frame)[-1], src, dst)
  return fut


def _done(fut, src_ref, dst_ref, fn: str, kind: str) -> None:
  if not isinstance(fut, RefFuture):
    raise TypeError(
      f"{fn}: expected the RefFuture returned by a stateful *_start, got "
      f"{type(fut).__name__}."
    )
  if fut.spec.kind != kind:
    raise FutureError(
      f"{fn}: this future comes from {fut.spec.kind}_start "
      f"({fut.spec.short()}); await it with {fut.spec.kind}_done."
    )
  here = _user_frame()
  src = view(src_ref, fn, "src_ref")
  dst = view(dst_ref, fn, "dst_ref")
  operands, layout = _operands(src, dst)
  if fut._track is not None:
    _, s0, d0 = fut._track
    if not (
      same_base(s0, src)
      and same_base(d0, dst)
      and _same_slots(s0, src)
      and _same_slots(d0, dst)
    ):
      raise FutureError(
        f"asyncops.stateful.{fn}: done without a start: no transfer "
        f"between these Refs is in flight at {here}. The future was started "
        f"at {fut._origin} on other Refs; pass the same src_ref and dst_ref "
        "to the done as to the start."
      )
  if layout != fut.layout:
    raise FutureError(
      f"asyncops.stateful.{fn}: done without a start: the Refs at {here} "
      f"are laid out as {layout}, but the future (started at "
      f"{fut._origin}) is for {fut.layout}. Pass the start's Refs."
    )
  # A future a cond branch closes over: its start is in an enclosing trace
  # (awaited once per branch, each branch its own trace).
  nested = jc.current_trace() if fut.sems and jc.captured(fut.sems[0]) else None
  if nested is not None and not jc.CAPTURED_DONE_SOURCE_LIVE:
    layout = _unpin_captured(fut, layout, fn, here)
  fut.consume(fn, here, nested)
  sems = list(fut.sems)
  if fut._track is not None and nested is None:
    # A window whose compute reads only another Ref's reads has no input
    # through the first barrier; XLA hoisted it above the start (v5e, v6e,
    # v5p: design/inspect.md, h-topread). Such a read is tied too, under
    # the captured path's rule (not when the window reads the source's
    # buffer), and only of a Ref made here that no transfer started here
    # uses. Not a read of the source, also of another slot: here those
    # stayed in the window untied, and tying a traced slot's read split
    # its dynamic slice out of the matmul (a longer window, v5e 16640 ->
    # 38352 cycles).
    #
    # A read of a Ref whose buffer is the destination's value to XLA
    # (new_ref of one computation, CSE'd; a read of it) is tied too: XLA
    # then copies that value before the start to make the destination
    # (v5e, v6e: 272 cycles in VMEM; v5p a move into HBM), which the guard
    # accepts (Copy.feeds_destination). Untied (h-alias), the compute ran
    # before the start: 12-17% longer steps (design/inspect.md, h-guardfp).
    src = fut._track[1]
    tie_read = None
    if not jc.window_reads_ref(fut._track[0], sems, src.base, _other_slot(src)):

      def tie_read(eqn):
        return not jc.reads_ref(eqn, src.base) and jc.reads_idle_local_ref(
          eqn, sems, ref_start_p.name
        )

    sems = jc.tie_between(fut._track[0], sems, tie_read)
  elif (
    fut._track is not None
    and jc.CAPTURED_WINDOW_TIE
    and not jc.window_reads_ref(
      fut._track[0], sems, fut._track[1].base, _other_slot(fut._track[1])
    )
  ):
    # Tied in the start's frame (``jc.tie_window``); the branch closes over
    # the barrier's semaphores, so the cond waits for the compute. A later
    # branch ties only what the start's frame traced since. Not when the
    # compute reads the source's buffer: XLA then prefetches it into VMEM
    # for the compute and hands the cond that copy, the branch's done an
    # HBM copy of it, not the buffer the DMA reads (v5e, v6e, v5p; the
    # guard refuses it): untied, XLA runs that compute before the start.
    # A Ref made in an enclosing frame is looked through (its new_ref and
    # reads there; an argument of its type of a nested frame counts). A
    # read of a slot proved different from the one in flight is not the
    # buffer; it is tied too (its own barrier with the semaphores, after
    # the read), so the compute reading only it stays after the start.
    anchor, base = fut._window or (fut._track[0], sems)
    sems, anchor = jc.tie_window(anchor, list(base), _other_slot(fut._track[1]))
    fut._window = (anchor, sems)
  with jax.named_scope(f"asyncops.{fut.spec.kind}_ref_done"):
    ref_done_p.bind(*operands, *sems, spec=fut.spec, layout=layout)


def _unpin_captured(fut: RefFuture, layout: Layout, fn: str, here: str):
  """``layout`` for a done on jax < 0.10: unpinned (its start too) when a
  ``lax.cond`` / ``lax.switch`` branch closes over the future.

  That jax's libtpu (0.0.34) compiled such a done, the source pinned to
  HBM, with a VMEM copy of the source the conditional was handed, not the
  buffer the DMA reads (v6e; in a ``lax.scan`` body v5e too: the buffer
  may be freed in flight). Unpinned, start and done get the one buffer
  (v5e, v6e, v5p; ``_jax_compat.CAPTURED_DONE_SOURCE_LIVE``). A future
  whose start is not known here (a loop carry, an argument) is refused.
  """
  kind = jc.branch_between(fut.sems[0])
  if kind is None:
    return layout
  if fut._token is None:
    raise NotImplementedError(
      f"asyncops.stateful.{fn} at {here}: a {fut.spec.kind} future passed "
      f"in (a loop carry or an argument) is awaited inside a lax.{kind} "
      f"branch that closes over it; jax {jax.__version__}'s libtpu may "
      "compile that done with a copy of the source, not the buffer the "
      f"DMA reads. Fix: await it outside the lax.{kind}, start it in the "
      "same function that awaits it, or pip install 'jax[tpu]>=0.10'."
    )
  _future.unpinned.add(fut._token)
  return dataclasses.replace(layout, pin_source=False)


def _other_slot(src: RefView):
  """``eqn -> bool``: whether ``eqn`` reads only slots of ``src``'s Ref
  that the program proves different from ``src``'s (never for a whole
  source). Such a read is a slice, not the in-flight buffer: tied clean
  on v5e, v6e and v5p (design/inspect.md). A read of the in-flight slot,
  of the whole Ref, or of a slot not proven different is not."""
  in_flight = _hazards.trace_slots(src)
  aval = jc.ref_inner_aval(src.base)

  def other_slot(eqn) -> bool:
    if in_flight is None or eqn.primitive.name != "get":
      return False
    if not jc.reads_ref(eqn, src.base):
      return False
    read = _hazards.trace_read_slots(eqn, aval)
    return read is not None and not _slots.may_overlap(in_flight, read)

  return other_slot


def _same_slots(a: RefView, b: RefView) -> bool:
  """False when the two views provably select different slots."""
  if (a.slot is None) != (b.slot is None):
    return False
  if a.slot is None:
    return True
  sa, sb = _hazards.trace_slots(a), _hazards.trace_slots(b)
  return _slots.may_overlap(sa, sb)


def _collective(kind, aval, axis_name, fn, perm=(), **kw) -> OpSpec:
  # The same spec as the value API's: same kernels, same emulation.
  return _futures_api.collective_spec(kind, aval, axis_name, fn, perm, **kw)


def ppermute_start(src_ref, dst_ref, axis_name: str, perm=None, *, shift=None):
  """Starts a collective permute from ``src_ref`` into ``dst_ref``.

  Device ``s`` sends its ``src_ref`` into device ``d``'s ``dst_ref`` for
  each pair ``(s, d)`` of ``perm`` (as ``jax.lax.ppermute``). ``shift=k``
  is the ring ``[(i, (i + k) % n)]``. **With a partial perm, a device
  nobody sends to keeps its ``dst_ref`` contents unchanged** (no DMA writes
  it), where the value API and ``jax.lax.ppermute`` give zeros.

  Args:
    src_ref: a ``jax.Ref`` (or one slot ``ref.at[i]``) to send.
    dst_ref: a Ref (or slot) of the same shape and dtype to receive into;
      **not the same buffer as src_ref**.
    axis_name: the mesh axis (inside ``shard_map``).
    perm: ``(source, destination)`` pairs along ``axis_name``.
    shift: ring shift, instead of ``perm``.

  Returns:
    A :class:`RefFuture` (semaphores only) for :func:`ppermute_done`.

  Raises:
    TypeError: not Refs; both or neither of ``perm``/``shift``.
    ValueError: shapes differ; source and destination are one buffer.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from asyncops import stateful
    >>> mesh = jax.make_mesh((8,), ("i",),
    ...                      axis_types=(jax.sharding.AxisType.Auto,))
    >>> @jax.jit
    ... @jax.shard_map(mesh=mesh, in_specs=jax.P("i"), out_specs=jax.P("i"))
    ... def shift(x):
    ...   x_ref, y_ref = jax.new_ref(x), jax.new_ref(jnp.zeros_like(x))
    ...   fut = stateful.ppermute_start(x_ref, y_ref, "i", shift=1)
    ...   stateful.ppermute_done(fut, x_ref, y_ref)
    ...   return y_ref[...]
    >>> shift(jnp.arange(8.0))
    Array([7., 0., 1., 2., 3., 4., 5., 6.], dtype=float32)
  """
  fn = "ppermute_start"

  def spec(aval):
    pairs = _validate.perm(perm, shift, _validate.axis(axis_name, fn), fn)
    return _collective("ppermute", aval, axis_name, fn, pairs)

  return _start(src_ref, dst_ref, fn, spec)


def ppermute_done(fut: RefFuture, src_ref, dst_ref) -> None:
  """Waits for :func:`ppermute_start`; ``dst_ref`` then holds the data.

  Args:
    fut: the future from the start, awaited exactly once.
    src_ref: the start's source Ref (kept alive until now).
    dst_ref: the start's destination Ref.

  Raises:
    FutureError: awaited twice, other Refs than the start's, or a hazard
      (the source written, or the destination touched, since the start).
  """
  _done(fut, src_ref, dst_ref, "ppermute_done", "ppermute")


def all_gather_start(src_ref, dst_ref, axis_name: str) -> RefFuture:
  """Starts an all-gather: ``dst_ref[j]`` receives device ``j``'s source.

  Args:
    src_ref: this device's shard (a Ref or slot).
    dst_ref: a Ref of shape ``(axis_size, *src.shape)`` (stacked layout, as
      ``jax.lax.all_gather(x, axis_name)``).
    axis_name: the mesh axis.

  Returns:
    A :class:`RefFuture` for :func:`all_gather_done`.
  """
  fn = "all_gather_start"
  return _start(
    src_ref,
    dst_ref,
    fn,
    lambda aval: _collective(
      "all_gather",
      aval,
      axis_name,
      fn,
      tuple(
        (i, j)
        for n in [_validate.axis(axis_name, fn)]
        for i in range(n)
        for j in range(n)
        if i != j
      ),
      gather_axis=0,
      tiled=False,
    ),
  )


def all_gather_done(fut: RefFuture, src_ref, dst_ref) -> None:
  """Waits for :func:`all_gather_start`."""
  _done(fut, src_ref, dst_ref, "all_gather_done", "all_gather")


def copy_start(src_ref, dst_ref) -> RefFuture:
  """Starts a local asynchronous copy from ``src_ref`` into ``dst_ref``.

  Args:
    src_ref: the Ref (or slot) to copy.
    dst_ref: a Ref (or slot) of the same shape and dtype.

  Returns:
    A :class:`RefFuture` for :func:`copy_done`.
  """
  fn = "copy_start"
  return _start(
    src_ref,
    dst_ref,
    fn,
    lambda aval: OpSpec(
      kind="copy",
      shape=tuple(aval.shape),
      dtype=jnp.dtype(aval.dtype).name,
      transfer=_emulation.current().transfer,
    ),
  )


def copy_done(fut: RefFuture, src_ref, dst_ref) -> None:
  """Waits for :func:`copy_start`."""
  _done(fut, src_ref, dst_ref, "copy_done", "copy")
