"""The Ref API's two-way all-gather ring of whole chunks, in row pieces.

Background. At long prefill the two-way contracting ring moves whole
chunks both ways (``_gather_rings.whole_chunks``): the ``[M, f]`` float32
accumulator's pass through HBM, not the dot, is what a step costs, and
whole chunks make it ``n / 2 + 1`` passes instead of ``n``. The value API
runs that ring in two row pieces straight from ``x``
(``_gather_rings._whole_pieces``). This is the same ring on the Ref API
(``asyncops.stateful``: transfers between ``jax.Ref``s, ordered by their
state effects, checked for hazards at trace time).

Approach.

- **No copy of x.** ``x`` is viewed as ``[2, M/2, k]`` (a free reshape) in
  one Ref whose slots are the two row pieces; the first transfer of each
  piece reads that slot (``xr.at[j]``) with two permutes, ``+1`` into slot
  0 and ``-1`` into slot 1 of a ``[2, M/2, k]`` Ref. A stateful start never
  aliases its source, and nothing writes ``xr``, so XLA neither copies
  ``x`` nor builds a ``[2 M, k]`` buffer (the former Ref ring made two
  ``new_ref(x)`` of whole chunks).
- **Row pieces.** Each later transfer sends a piece's Ref on, slot 0 to
  ``index + 1`` and slot 1 to ``index - 1``, so after ``s`` transfers it
  holds that piece of chunks ``i - s`` and ``i + s``. The pieces'
  transfers alternate: the window of transfer ``t`` holds the dot of what
  transfer ``t - 1`` brought (the local chunk's dot, over all of ``x``,
  hides the first one), one dot per window over the stacked pair.
- **Three piece buffers**, not two per piece: a buffer is free again once
  its transfer is done (its dot ran in the window before), so the two
  pieces rotate through three ``[2, M/2, k]`` Refs (``jax.empty_ref``: no
  fill).
- **Windows in order.** Consecutive windows touch different Refs, so
  each window's free destination passes through a barrier with what the
  last transfer brought (no copy): its starts follow that done, and no
  window is left empty. A step's stacked rows of ``w`` are made before
  its first window (inside it, the second window read them through the
  barriers and XLA relayouted them).
- **The antipode once.** On an even ring the last transfer's two
  directions carry the same chunk; the Ref API's permutes are separate, so
  only the ``+1`` one runs (``n / 2 - 1`` fewer half-chunk transfers per
  direction than the value ring's bidirectional kernel).
- **Accumulator and output as the value API's**: float32 ``[2, M/2, f]``
  (``x.dtype`` with ``accumulation="output"``)
  started by the local dot (no zero fill), each piece's products added in
  place, the last one added and rounded straight into its rows of the
  output.

What breaks. A dot reading a Ref that an in-flight transfer writes, or a
write to an in-flight source, is refused by the hazard check as anywhere
in the Ref API; this ring reads only sources in flight and buffers whose
transfer is done.
"""

import jax
import jax.numpy as jnp

from asyncops import _jax_compat as jc
from asyncops import stateful
from asyncops.collective_matmul import _gather_rings
from asyncops.collective_matmul._gather_rings import pair_dot, rows_of


def applies(rows_form: bool, x, ws, options) -> bool:
  """Whether ``_vjp``'s gather with ``options`` runs this ring: the Ref
  API's two-way contracting ring where ``whole_chunks`` says so."""
  o = dict(options)
  if rows_form or o["api"] != "ref" or not o["bidirectional"]:
    return False
  if o.get("return_gathered", False) or x.shape[0] % 2:
    return False
  acc_dt = _gather_rings.accumulator_dtype(
    x.dtype, o.get("accumulation", "float32")
  )
  f = sum(w.shape[1] for w in ws)
  return _gather_rings.whole_chunks(x.shape[0], f, acc_dt, o["n"])


def contracting(
  x,
  ws: tuple,
  axis_name: str,
  *,
  n: int,
  stash=None,
  accumulation: str = "float32",
):
  """``[all_gather(x, axis=1, tiled) @ w for w in ws]`` on the Ref API.

  Args:
    x: ``[M, k]``, ``M`` even.
    ws: weights ``[n k, f_i]``, dtype of ``x``.
    axis_name: the ring axis (size ``n`` > 2).
    n: its size.
    stash: if a list, ``x``'s two row halves are appended (what the Ref
      API's backward ring sends; ``_vjp``).
    accumulation: ``"float32"`` or ``"output"``
      (``_gather_rings.accumulator_dtype``).

  Returns:
    A tuple of ``[M, f_i]`` in ``x.dtype``.
  """
  (m, k), dt = x.shape, x.dtype
  assert m % 2 == 0 and n > 2, (m, n)
  acc_dt = _gather_rings.accumulator_dtype(dt, accumulation)
  me = jax.lax.axis_index(axis_name)
  p, h = 2, m // 2
  last = n // 2  # transfers per piece: ceil((n - 1) / 2)
  order = [(s, j) for s in range(1, last + 1) for j in range(p)]
  work = [(0, None), *order]  # the local chunk, then each arrived piece
  if stash is not None:
    # x is only ever a transfer's source (never aliased): readable later.
    stash.append((x[:h], x[h:]))
  xr = jax.new_ref(x.reshape(p, h, k))
  free = [jc.empty_ref(jax.ShapeDtypeStruct((2, h, k), dt)) for _ in "abc"]
  held = {}  # piece j -> the Ref holding it (chunks i - s, i + s)
  arrived = []  # transfer t -> the Ref it filled
  accs = [None] * len(ws)
  outs = [_gather_rings._empty((p, h, w.shape[1]), dt) for w in ws]
  stacks = {}

  def dot(t):
    s, j = work[t]
    if s == 0:
      for i, w in enumerate(ws):
        y = jnp.dot(x, rows_of(w, me, k), preferred_element_type=acc_dt)
        accs[i] = y.reshape(p, h, y.shape[-1])
      return
    cs = _gather_rings.chunks(me, s, n, True)
    antipode = 2 * s == n
    buf = arrived[t - 1]
    pair = buf[0] if antipode else buf[...]
    for i, w in enumerate(ws):
      if antipode:
        y = jnp.dot(
          pair,
          rows_of(w, cs[0], k),
          preferred_element_type=acc_dt,
        )
      else:
        # Both pieces of step s meet the same stacked rows of w: stacked
        # once, before the first piece's window (stacked inside it, the
        # second piece's dot read it through the window's barriers and XLA
        # relayouted it there: v5e tp 8, M = 16384, 69.5 us a step).
        y = pair_dot(pair, stacks[s, i], acc_dt)
      if s == last:
        outs[i] = outs[i].at[j].set((accs[i][j] + y).astype(dt))
      else:
        accs[i] = accs[i].at[j].add(y)

  for t, (s, j) in enumerate(order):
    ds = work[t][0]
    if ds > 0 and 2 * ds != n and (ds, 0) not in stacks:
      cs = _gather_rings.chunks(me, ds, n, True)
      with jax.named_scope(f"chunk{ds}"):
        for i, w in enumerate(ws):
          stacks[ds, i] = jnp.stack([rows_of(w, c, k) for c in cs])
    src = held.get(j)
    dst = free.pop(0)
    if t:
      # Windows on different Refs share no data, so XLA may start one
      # transfer before another's window (that window then empty): the
      # free destination's buffer passes through a barrier with what the
      # last transfer brought, so this window's starts follow its done.
      v, _ = jax.lax.optimization_barrier((dst[...], arrived[t - 1][...]))
      dst[...] = v
    # The antipode (n even, last transfer) travels one way only.
    dirs = ((0, 1),) if 2 * s == n else ((0, 1), (1, -1))
    with jax.named_scope(f"chunk{work[t][0]}"), jax.named_scope("ring_step"):
      futs = []
      for a, shift in dirs:
        view = xr.at[j] if src is None else src.at[a]
        with jax.named_scope(f"ring_shift{shift:+d}"):
          fut = stateful.ppermute_start(view, dst.at[a], axis_name, shift=shift)
        futs.append((fut, view, dst.at[a]))
      dot(t)
      for fut, view, into in futs:
        stateful.ppermute_done(fut, view, into)
    if src is not None:
      free.append(src)  # its dot ran in an earlier window or this one
    held[j] = dst
    arrived.append(dst)
  with jax.named_scope(f"chunk{last}"):
    for t in range(len(order), len(work)):
      dot(t)
  return tuple(o.reshape(m, o.shape[-1]) for o in outs)
