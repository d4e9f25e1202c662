"""All-gather matmul rings on the canonical shapes.

Both rings move the local chunk of ``x`` around a ring of ``n`` devices
(``n - 1`` transfers) and consume every chunk as it arrives, inside the
window of the next transfer; the last chunk is consumed after the last
transfer. Nothing is gathered in full unless ``return_gathered`` asks for
it. Several weights share one ring: each arriving chunk is multiplied by
every weight inside the same window, so a gated MLP's gate and up
projections pay for one gather.

:func:`contracting` (the scaling book's collective matmul, Wang et al.
2023): ``x [M, k]`` is this device's slice of the contracting dimension and
``w [n k, f]`` holds every contracting row. Chunk ``c`` meets rows
``c k:(c + 1) k`` of ``w``; the products **accumulate** in an f32
``[M, f]`` (floating inputs) that rounds once at the end; with
``accumulation="output"`` in ``x.dtype`` instead (each chunk's dot rounds
to it and is added in it, as XLA's windowed einsum does: half the bytes
of every accumulator pass in bfloat16, a rounding at every step).

:func:`rows` (sequence parallelism; the row-gather of vLLM's
tpu-inference kernel): ``x [P, R, k]`` holds ``R`` rows (tokens) of each of
``P`` outer batches and ``w [k, f]`` is whole along ``k``. Chunk ``c``
**produces** output rows ``[:, c R:(c + 1) R]`` of ``[P, n R, f]``:
nothing accumulates, each product is written in place into its block
(``dynamic_update_slice``), and every output row is computed exactly as the
reference computes it.

Direction. Unidirectional rings send to ``index - 1`` and hold chunk
``(index + s) mod n`` at step ``s``. Bidirectional rings split every chunk
in two halves: the first travels to ``index + 1`` (holding chunk
``index - s``), the second to ``index - 1`` (chunk ``index + s``), so each
link carries half the bytes per step in each direction. With ``api="value"``
one ``bidirectional_start`` kernel moves both halves (its first half of axis
0 each way); with ``api="ref"`` two half buffers move with two permutes.
The contracting ring halves ``x``'s rows and accumulates into
``[2, M/2, f]`` (a free reshape of ``[M, f]``); the rows ring halves where
``_layout.RowSplit`` says.

Long prefill (a float32 accumulator of ``WHOLE_ACC_BYTES`` or more): the
two-way contracting ring moves a whole copy of every chunk each way
instead of halves, and adds the two chunks it holds with one dot per step
(:func:`whole_chunks`): the accumulator's pass through HBM, not the dot,
is then what each step costs, and it runs ``n / 2 + 1`` times, not ``n``.
The value API sends ``x`` itself (no buffer of two copies) and moves the
chunks in two row pieces whose transfers alternate (:func:`_whole_pieces`),
in row panels run one after another so that the float32 accumulator holds
one panel's rows (:func:`whole_panels`).

``return_gathered``: each chunk is also written into the gathered ``x``
(read from the transfer's source, which a transfer may read while in
flight), so the caller gets ``all_gather(x)`` without a second gather.

Limits. One mesh axis; ``n`` static (the loop is unrolled).
"""

from contextlib import nullcontext

import jax
import jax.numpy as jnp

from asyncops import _jax_compat as jc
from asyncops.collective_matmul import _chips, _layout, _ring
from asyncops.futures import _api as futures


def accumulator_dtype(dtype, accumulation: str = "float32") -> jnp.dtype:
  """The accumulator's dtype for operands of ``dtype``.

  ``accumulation="float32"`` (the default): float32 for floating inputs
  (one rounding at the end). ``"output"``: ``dtype`` itself (a bfloat16
  accumulator for bfloat16 operands, XLA's windowed einsum's numerics).
  Integer inputs accumulate in ``dtype`` either way.
  """
  dtype = jnp.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.floating) and accumulation != "output":
    return jnp.dtype(jnp.promote_types(dtype, jnp.float32))
  return dtype


def chunks(me, s: int, n: int, bidirectional: bool):
  """The chunk index held by each travelling buffer at step ``s``."""
  if not bidirectional:
    return (jax.lax.rem(me + s, n),)
  return jax.lax.rem(me + n - s, n), jax.lax.rem(me + s, n)


def run(
  bufs,
  bidirectional: bool,
  axis_name: str,
  n: int,
  api: str,
  consume,
  stash: list | None = None,
  barrier: bool | None = None,
):
  """Runs an all-gather ring.

  Args:
    bufs: the travelling buffer(s): one array (unidirectional, or a
      bidirectional value ring whose axis 0 holds the two halves) or two
      halves (bidirectional Ref ring).
    bidirectional: whether halves travel both ways.
    axis_name, n, api: the ring.
    consume: ``consume(s, sent, carry) -> carry``, the work on the chunks
      held at step ``s`` (``sent``: the buffers as the transfer sees them;
      **read these**, never ``bufs``).
    stash: if a list, ``bufs`` as the first transfer saw them (this
      device's own chunk) are appended to it, for a caller that needs them
      after the ring (a backward pass): reading them there costs no copy,
      reading ``bufs`` would (the start kernel aliases its source in
      place, so XLA copies a source that is read later).
    barrier: whether the operands (the weights) pass each step's barrier
      with the futures (default: only on two-way rings). One-way rings
      close a single weight over so that XLA may prefetch it into VMEM
      across programs; see :func:`weights_barrier`.

  Returns:
    A function ``carry -> carry`` running the ``n`` steps.
  """
  if not bidirectional:
    shifts = (-1,)
  elif api == "value":
    shifts = ("both",)
  else:
    shifts = (1, -1)

  if barrier is None:
    barrier = bidirectional

  def go(operands, carry):
    ring = _ring.Ring(bufs, shifts, axis_name, api, keep=stash is not None)
    for s in range(n - 1):
      # One-way: ``operands`` (the weights) are closed over, not passed
      # through the step's barrier. ``consume`` reads ``sent``, so it runs
      # after the start anyway, and an entry parameter that is an operand
      # of an optimization barrier is no candidate for XLA's cross-program
      # prefetch into VMEM (S(1)). Through the barrier, the Llama-3-70B
      # shard's weight (v5e tp 4, M = 4096) reached VMEM only for step 2
      # and step 1's dot read it from HBM: 991.6 us against 662.1. The
      # two-way ring of halves keeps the barrier: closed over, it was
      # slower at v5e tp 4 M = 1024 (758.3 us against 731.7). Several
      # weights keep it too (``weights_barrier``).
      def compute(sent, operands, carry, s=s):
        return consume(s, sent, operands, carry)

      with jax.named_scope(f"chunk{s}"):
        if barrier:
          carry = ring.step(compute, operands, carry)
        else:
          carry = ring.step(
            lambda sent, carry, c=compute: c(sent, operands, carry), carry
          )
    with jax.named_scope(f"chunk{n - 1}"):
      carry = consume(n - 1, ring.values(), operands, carry)
    if stash is not None:
      stash.append(ring.kept())
    return carry

  return go


def weights_barrier(bidirectional: bool, ws) -> bool:
  """Whether a forward ring's weights ``ws`` pass the step barriers.

  Two-way rings: yes (closed over, the ring of halves was slower). One
  way: a single weight is closed over, so XLA may prefetch it into VMEM
  across programs (v5e tp 4 M = 4096, 3070.0 -> 2742.8 us). Several
  weights (a gated MLP's gate and up projections) pass the barrier:
  closed over, XLA prefetched one of the two into VMEM and tiled the
  step dots slower (the v5e Llama-3-70B gated MLP block, 4522.9 us
  closed over, 4314.4 through the barrier, no prefetch;
  ``design/benchmarks.md``).
  """
  return bidirectional or len(ws) > 1


def _empty(shape, dtype):
  """An uninitialized buffer (``AllocateBuffer`` on TPU, no fill): only
  for buffers whose every element the ring writes before reading."""
  return jax.lax.empty(shape, dtype)


def accumulate(acc, y, s: int, j: int, bidirectional: bool):
  """``acc`` plus step ``s``'s product ``y`` (of half ``j`` if
  ``bidirectional``). Step 0's product initialises it, no zero fill: a
  one-way accumulator is that product; two-way halves are written into an
  uninitialized ``[2, M/2, f]`` buffer."""
  if not bidirectional:
    return y if s == 0 else acc + y
  if s == 0:
    return acc.at[j].set(y)
  return acc.at[j].add(y)


def rows_of(w, c, k: int):
  """Chunk ``c``'s ``k`` rows of ``w``."""
  return jax.lax.dynamic_slice_in_dim(w, c * k, k, axis=0)


def pair_dot(pair, stack, acc_dt):
  """A step's two row pieces ``[2, h, k]`` against its two chunks' rows of
  ``w`` stacked ``[2, k, f]``: one dot contracting both, ``[h, f]``."""
  return jax.lax.dot_general(
    pair, stack, (((0, 2), (0, 1)), ((), ())), preferred_element_type=acc_dt
  )


# A two-way ring whose float32 accumulator is at least this large moves
# whole chunks both ways (see :func:`whole_chunks`).
WHOLE_ACC_BYTES = 64 << 20


def whole_chunks(m: int, f: int, acc_dtype, n: int) -> bool:
  """Whether a two-way contracting ring moves whole chunks each way.

  Each chunk's product is added into the ``[M, f]`` accumulator, a read
  and a write of it in HBM (8 bytes per element in float32). At long
  prefill that pass costs more than the chunk's dot (tp 8, M = 16384:
  286 us against 131 on v6e), and a ring of half-row chunks makes it
  ``n`` times. Moving a whole copy of each chunk both ways (XLA's
  bidirectional windowed einsum does the same) gives every step the two
  chunks ``i - s`` and ``i + s`` over all rows, met in one dot over the
  stacked pair: ``n / 2 + 1`` passes and ``n / 2`` transfers of a whole
  chunk per direction (the two-way ring of halves: ``n - 1`` of half a
  chunk; the same bytes, bar the antipode's second copy). The value API
  sends them in two row pieces, ``n`` transfers of half a chunk each way.
  """
  return n > 2 and m * f * jnp.dtype(acc_dtype).itemsize >= WHOLE_ACC_BYTES


def _whole(x, ws: tuple, axis_name: str, n: int, acc_dt, stash):
  """The two-way contracting ring of whole chunks (:func:`whole_chunks`),
  value API, in row panels (:func:`whole_panels`) of row pieces
  (:func:`_whole_pieces`).

  Each row piece of ``x`` (half its rows) goes whole both ways straight
  from ``x`` (one ``bidirectional_start(whole=True, rows=...)`` kernel,
  both DMAs reading ``x``) into a ``[2 M/2, k]`` buffer holding that
  piece of chunks ``i - 1`` and ``i + 1``; each later transfer sends a
  piece's buffer on, its first half to ``index + 1`` and the rest to
  ``index - 1`` (the default kernel), so after ``s`` transfers of a piece
  it holds chunks ``i - s`` and ``i + s``. No buffer ever holds two
  copies of ``x``. The Ref API's ring of whole chunks is
  ``_ref_whole`` (``_vjp`` routes it there).

  Step 0, the local chunk's dot, runs inside the window of the first
  transfer (reading ``x`` as that transfer sees it); step ``s`` (``1 <= s
  < n / 2``) adds both chunks' products with one dot over the stacked pair
  inside the window of transfer ``s + 1``; after ``ceil((n - 1) / 2)``
  transfers the last step takes the antipode once (``n`` even) or both
  chunks (``n`` odd).
  """
  m = x.shape[0]
  me = jax.lax.axis_index(axis_name)
  last = n // 2  # transfers: ceil((n - 1) / 2)
  f = sum(w.shape[1] for w in ws)
  chip = _chips.chip_for(jc.trace_device_kind()).name
  panels = whole_panels(m, f, acc_dt, n, chip)
  sliced = antipode_sliced(panels, chip)
  return _whole_pieces(
    x, ws, axis_name, n, acc_dt, stash, me, last, panels, sliced
  )


# Chips whose ring of whole chunks in one panel slices the antipode's rows
# of w up front (in panels every chip does; :func:`_whole_pieces`). In one
# panel at tp 4, M = 4096, the model: v5p 1436.6 -> 1323.9 us; v6e 866.2
# -> 883.9 (the slice, 71.2 us, over the dots' gain, 53.5); v5e 3152.1 ->
# 4081.1 (its pieces' dots 1289.6 -> 2021.4 us).
ONE_PANEL_SLICED = frozenset({"v5p"})


def antipode_sliced(panels: int, chip: str | None) -> bool:
  """Whether the ring of whole chunks in ``panels`` row panels on
  ``chip`` slices its antipode's rows of ``w`` up front (in row panels,
  or in one on the chips of :data:`ONE_PANEL_SLICED`), else inside the
  antipode's dot fusions."""
  return panels > 1 or chip in ONE_PANEL_SLICED


# The largest float32 accumulator one row panel of the ring of whole
# chunks holds (see :func:`whole_panels`).
PANEL_ACC_BYTES = 128 << 20


# (chip, ring size) where the value ring of whole chunks keeps one panel:
# v5p at tp 4, M = 16384, steps 6222.0 us in 4 panels (376.5 MiB) and
# 5985.5 in 2 (568.3), over xla_best's 5484.3, where one panel is 5292.8
# (796.2 MiB): panels there cost more than the time it has to spare.
ONE_PANEL = frozenset({("v5p", 4)})


def whole_panels(
  m: int, f: int, acc_dtype, n: int | None = None, chip: str | None = None
) -> int:
  """Row panels of the value ring of whole chunks (:func:`_whole_pieces`).

  The ring's float32 accumulator ``[M, f]`` is what puts its peak
  temporary memory over jit's (Llama-3-70B shard, M = 16384: 448 MiB at
  tp 4, 224 at tp 8, against jit's 192 to 240). Run per row panel, the
  accumulator is one panel's; each panel is a ring of its own (its first
  transfer under its local dot, so nothing more is exposed) and reads
  ``w`` again. The rule: the fewest panels whose accumulator is at most
  ``PANEL_ACC_BYTES`` (128 MiB), at most ``M / 2`` (two rows a panel).
  On the sweep's points that is the fewest panels under jit's plus one
  chunk's send and receive buffers (v5e: tp 4, 4 panels, 256.6 MiB
  against 320.2, 2 panels would hold about 440; tp 8, 2 panels, 235.1
  against 272.2), and the fastest (v5e tp 8: 5912.3 us in 2 panels,
  6004.0 in 1, 7025.7 in 4). One panel on the ``(chip, n)`` of
  ``ONE_PANEL`` (v5p at tp 4).

  When ``M`` is a multiple of 16 the count is rounded up to one whose
  panels are too (each piece a multiple of 8 rows): the start kernel's
  slice of ``x`` (``bidirectional_start(whole=True, rows=...)``) must be
  a multiple of 8 rows on TPU, and 5 panels of 16384 rows (pieces of
  1638) fail to compile ("Slice sizes along tiled dimensions must be
  aligned to tiles"). M = 16384 and an accumulator of 3 panels' size
  runs 4.
  """
  if (chip, n) in ONE_PANEL:
    return 1
  acc = m * f * jnp.dtype(acc_dtype).itemsize
  p = max(1, min(-(-acc // PANEL_ACC_BYTES), m // 2))
  if p > 1 and m % 16 == 0:
    tiles = m // 16
    p = next(q for q in range(p, tiles + 1) if tiles % q == 0)
  return p


def _whole_pieces(
  x, ws, axis_name, n, acc_dt, stash, me, last, panels=1, sliced=True
):
  """The value API's ring of whole chunks, in row panels of two pieces.

  ``x``'s rows are cut into ``panels`` row panels (:func:`whole_panels`),
  run one after the other (each starts after the last one's output is
  written, so their buffers never coexist); each is the ring below on
  its rows, its float32 accumulator holds only its rows, and each
  piece's last product is added and rounded straight into its rows of
  the one ``[M, f]`` output.

  In a panel each transfer moves one piece (half of the panel's rows, or
  all of them when odd) of the two chunks it carries, and the pieces'
  transfers alternate: the window of piece 1's transfer at step ``s``
  holds the dot of piece 0's chunks that arrived at step ``s``, and the
  window of piece 0's transfer at step ``s + 1`` the dot of piece 1's.
  So every transfer is half a chunk each way, and the first one (the
  piece's rows of ``x``, sent with ``bidirectional_start(whole=True,
  rows=...)`` straight from ``x``) hides under the local chunk's dot,
  where a whole chunk each way did not (v5e, v6e: 102 and 132 us exposed
  at tp 8, M = 16384). A buffer a dot reads that a later transfer sends
  passes through optimization barriers after that dot, so the transfer's
  in-place start is ordered after it (no copy).

  With ``sliced`` (on an even ring) the antipode's rows of ``w`` are
  sliced up front into a buffer of their own (an optimization barrier):
  sliced inside the antipode's dot fusions, beside the accumulator's read
  and the output's write, XLA tiles those dots far below the MXU's rate
  (v5p tp 4, M = 16384: 1589.4 us against 1085.8 and a 46.4 us slice;
  ``design/benchmarks.md``, "The two-way ring's antipode step").

  Returns:
    The outputs ``[M, f_i]``, in ``x.dtype``.
  """
  (m, k) = x.shape
  bounds = [q * m // panels for q in range(panels + 1)]
  # Pieces of equal rows write blocks of [pieces, h, f] (a free reshape
  # of [M, f]; as fast as before panels at one panel), else rows of [M, f].
  even = m % (2 * panels) == 0
  shape = (2 * panels, m // panels // 2) if even else (m,)
  outs = [_empty((*shape, w.shape[1]), x.dtype) for w in ws]
  xs = x
  # A step's stacked rows of w, shared by every panel: with panels,
  # stacked once up front and materialized (a barrier), else XLA fuses
  # the stacking into each panel's first dot of the step (819 us against
  # 635 on v5e, tp 4, M = 16384 in 4 panels).
  stacks = {}
  if panels > 1:
    for s in range(1, last + 1):
      if 2 * s != n:
        for i, w in enumerate(ws):
          cs = chunks(me, s, n, True)
          stacks[s, i] = jnp.stack([rows_of(w, c, k) for c in cs])
  if sliced and n % 2 == 0:
    # The antipode's rows of w, in a buffer of their own (above).
    for i, w in enumerate(ws):
      stacks[last, i] = rows_of(w, chunks(me, last, n, True)[0], k)
  if stacks:
    stacks = jax.lax.optimization_barrier(stacks)
  for q in range(panels):
    if q:
      # Panel q starts after panel q - 1's output is written.
      xs, outs = jax.lax.optimization_barrier((xs, outs))
    with jax.named_scope(f"panel{q}") if panels > 1 else nullcontext():
      xs, outs = _whole_panel(
        xs, ws, axis_name, n, acc_dt, me, last, outs, stacks, bounds[q : q + 2]
      )
  if stash is not None:
    stash.append((xs,))
  return tuple(o.reshape(m, o.shape[-1]) for o in outs)


def _whole_panel(x, ws, axis_name, n, acc_dt, me, last, outs, stacks, rows):
  """One row panel ``x[lo:hi]`` of :func:`_whole_pieces`: returns ``x``
  as its last transfer returned it, and ``outs`` with the panel's rows."""
  k = x.shape[1]
  lo, hi = rows
  r = hi - lo
  p = 2 if r % 2 == 0 else 1
  h = r // p
  order = [(s, j) for s in range(1, last + 1) for j in range(p)]
  work = [(0, None), *order]  # the local chunk, then each arrived piece
  state = {"x": x}  # buffers to send later: x's chain, then each piece's
  accs = [None] * len(ws)
  outs = list(outs)
  xs_out = [x]

  def dot(t, ws, bufs, sent_key, sent):
    """Work item ``t`` on the buffers (``sent`` for the one in flight)."""
    s, j = work[t]

    def src(key):
      return sent if key == sent_key else bufs[key]

    if s == 0:
      xs = src("x")
      if r != xs.shape[0]:
        xs = jax.lax.slice_in_dim(xs, lo, hi, axis=0)
      for i, w in enumerate(ws):
        y = jnp.dot(xs, rows_of(w, me, k), preferred_element_type=acc_dt)
        accs[i] = y.reshape(p, h, y.shape[-1])
      return
    pair = src(f"p{j}").reshape(2, h, k)
    cs = chunks(me, s, n, True)
    use = 1 if 2 * s == n else 2
    for i, w in enumerate(ws):
      if use == 1:
        rw = stacks[s, i] if (s, i) in stacks else rows_of(w, cs[0], k)
        y = jnp.dot(pair[0], rw, preferred_element_type=acc_dt)
      else:
        # Both pieces of step s meet the same stacked rows of w: stacked
        # once, in the first piece's window (not carried through the
        # barriers: that cost the second piece's dot a relayout).
        if (s, i) not in stacks:
          stacks[s, i] = jnp.stack([rows_of(w, c, k) for c in cs])
        y = pair_dot(pair, stacks[s, i], acc_dt)
      if s == last:
        out = (accs[i][j] + y).astype(x.dtype)
        if outs[i].ndim == 3:  # block lo // h + j of [pieces, h, f]
          outs[i] = outs[i].at[lo // h + j].set(out)
        else:
          outs[i] = jax.lax.dynamic_update_slice_in_dim(
            outs[i], out, lo + j * h, axis=0
          )
      else:
        accs[i] = accs[i].at[j].add(y)

  for t, (s, j) in enumerate(order):
    key = "x" if s == 1 else f"p{j}"
    src = state.pop(key)
    with jax.named_scope(f"chunk{work[t][0]}"), jax.named_scope("ring_step"):
      if s == 1:
        sent, fut = futures.bidirectional_start(
          src, axis_name, whole=True, rows=(lo + j * h, lo + (j + 1) * h)
        )
      else:
        sent, fut = futures.bidirectional_start(src, axis_name)
      fut, sent, state, wsb, acc_in, out_in = jax.lax.optimization_barrier(
        (fut, sent, state, ws, tuple(accs), tuple(outs))
      )
      accs[:], outs[:] = acc_in, out_in
      dot(t, wsb, state, key, sent)
      acc_out, out_out, fut, state = jax.lax.optimization_barrier(
        (tuple(accs), tuple(outs), fut, state)
      )
      accs[:], outs[:] = acc_out, out_out
      recv = futures.done(fut)
      # The aliased x goes on to x's next piece (its last alias is what
      # the panel's last first transfer saw, readable later at no copy).
      if key == "x":
        if j == p - 1:
          xs_out[0] = sent
        else:
          state["x"] = sent
      state, recv = jax.lax.optimization_barrier((state, recv))
      state[f"p{j}"] = recv
  with jax.named_scope(f"chunk{last}"):
    for t in range(len(order), len(work)):
      dot(t, ws, state, None, None)
  return xs_out[0], tuple(outs)


def contracting(
  x,
  ws: tuple,
  axis_name: str,
  *,
  n: int,
  api: str,
  bidirectional: bool,
  return_gathered: bool,
  stash: list | None = None,
  accumulation: str = "float32",
):
  """``[all_gather(x, axis=1, tiled) @ w for w in ws]`` on a ring.

  Args:
    x: ``[M, k]`` (``M`` even if bidirectional).
    ws: weights ``[n k, f_i]``, dtype of ``x``.
    axis_name: the ring axis (size ``n`` > 1).
    n: its size.
    api: ``"value"`` or ``"ref"``.
    bidirectional: halves of ``x``'s rows travel both ways.
    return_gathered: also build ``all_gather(x, axis=1, tiled)``.
    stash: see :func:`run`.
    accumulation: ``"float32"`` or ``"output"`` (:func:`accumulator_dtype`):
      the dtype every chunk's dot produces and the accumulator adds in,
      in every form of this ring (halves, whole chunks, panels), but the
      Ref API's two-way ring of halves, which keeps float32: its
      accumulator halves sit in VMEM, and in bfloat16 XLA's dot fusions
      are slower on v5e (chapter shape 58.2 -> 86.0 us, prefill 772.1 ->
      852.7) and v6e at the prefill shape (272.9 -> 291.2); the guard
      accepts that program (its in-flight copies only read a held
      source). ``"output"`` permits the rounding, it does not require it
      (``design/benchmarks.md``, "Opt-in output-dtype accumulation").

  Returns:
    ``(outs, gathered)``: a tuple of ``[M, f_i]`` in ``x.dtype``, and
    ``[M, n k]`` or None.
  """
  (m, k), dt = x.shape, x.dtype
  if api == "ref" and bidirectional:
    accumulation = "float32"  # faster (above)
  acc_dt = accumulator_dtype(dt, accumulation)
  f = sum(w.shape[1] for w in ws)
  if (
    bidirectional
    and not return_gathered
    and api == "value"
    and whole_chunks(m, f, acc_dt, n)
  ):
    return _whole(x, ws, axis_name, n, acc_dt, stash), None
  me = jax.lax.axis_index(axis_name)
  h = m // 2
  # Accumulators start at the first chunk's product: no zero fill (a
  # unidirectional one is that product; bidirectional halves are written
  # into an uninitialized [2, M/2, f] buffer).
  if bidirectional:
    accs = tuple(_empty((2, h, w.shape[1]), acc_dt) for w in ws)
    g = _empty((2, h, n * k), dt) if return_gathered else None
    bufs = (x,) if api == "value" else (x[:h], x[h:])
  else:
    accs = tuple(None for _ in ws)
    g = _empty((m, n * k), dt) if return_gathered else None
    bufs = (x,)

  def consume(s, sent, ws, carry):
    accs, g = carry
    accs = list(accs)
    if bidirectional and len(sent) == 1:
      sent = (sent[0][:h], sent[0][h:])
    for j, (xj, c) in enumerate(
      zip(sent, chunks(me, s, n, bidirectional), strict=True)
    ):
      for i, w in enumerate(ws):
        y = jnp.dot(xj, rows_of(w, c, k), preferred_element_type=acc_dt)
        accs[i] = accumulate(accs[i], y, s, j, bidirectional)
      if g is not None:
        if bidirectional:
          g = jax.lax.dynamic_update_slice(
            g, xj[None], (jnp.int32(j), jnp.int32(0), c * k)
          )
        else:
          g = jax.lax.dynamic_update_slice(g, xj, (jnp.int32(0), c * k))
    return tuple(accs), g

  accs, g = run(
    bufs,
    bidirectional,
    axis_name,
    n,
    api,
    consume,
    stash,
    barrier=weights_barrier(bidirectional, ws),
  )(ws, (accs, g))
  outs = tuple(a.reshape(m, a.shape[-1]).astype(dt) for a in accs)
  return outs, (None if g is None else g.reshape(m, n * k))


def rows(
  x,
  ws: tuple,
  axis_name: str,
  *,
  n: int,
  api: str,
  bidirectional: bool,
  return_gathered: bool,
  stash: list | None = None,
  accumulation: str = "float32",
):
  """``[all_gather(x, axis=1, tiled) @ w for w in ws]`` for ``x [P, R, k]``.

  Args:
    x: ``[P, R, k]``: ``R`` rows of each of ``P`` outer batches (``P`` or
      ``R`` even if bidirectional).
    ws: weights ``[k, f_i]``, dtype of ``x``.
    axis_name: the ring axis (size ``n`` > 1).
    n: its size.
    api: ``"value"`` or ``"ref"``.
    bidirectional: halves of every chunk travel both ways.
    return_gathered: also build ``all_gather(x, axis=1, tiled)``.
    stash: see :func:`run`.
    accumulation: ignored: nothing accumulates here (every output row is
      one dot, in ``x.dtype``, whichever the setting).

  Returns:
    ``(outs, gathered)``: a tuple of ``[P, n R, f_i]`` in ``x.dtype``, and
    ``[P, n R, k]`` or None.
  """
  del accumulation
  p, r, k = x.shape
  dt = x.dtype
  split = _layout.choose_split(p, r, bidirectional)
  lay = _layout.RowSplit(p, r, n, split)
  me = jax.lax.axis_index(axis_name)
  # Every block is written once: no zero fill.
  outs = tuple(_empty(lay.expanded(w.shape[1]), dt) for w in ws)
  g = _empty(lay.expanded(k), dt) if return_gathered else None
  if bidirectional:
    b = lay.halves(x)
    bufs = (b,) if api == "value" else (b[0], b[1])
  else:
    bufs = (x,)

  def consume(s, sent, ws, carry):
    outs, g = carry
    outs = list(outs)
    cs = chunks(me, s, n, bidirectional)
    # One product per contiguous [R', k] piece and weight, each written in
    # place by its own fused dynamic-update-slice. (One product per weight
    # over everything that arrived reads each weight once per step, but
    # its pieces go to blocks that are not adjacent, so every piece costs
    # an extra pass over HBM; on the Llama-3-70B shard that is slower.)
    if bidirectional and len(sent) == 1:
      groups = [(sent[0], (0, 1))]  # [2, P', R', k]
    else:
      groups = [(x[None], (j,)) for j, x in enumerate(sent)]
    for x, halves in groups:
      for a, j in enumerate(halves):
        for i in range(x.shape[1]):
          piece = x[a, i]  # a contiguous [R', k] piece
          for o, w in enumerate(ws):
            y = jnp.dot(piece, w, preferred_element_type=dt)
            outs[o] = lay.write(outs[o], y, j, i, cs[j])
      if g is not None:
        for a, j in enumerate(halves):
          for i in range(x.shape[1]):
            g = lay.write(g, x[a, i], j, i, cs[j])
    return tuple(outs), g

  outs, g = run(
    bufs,
    bidirectional,
    axis_name,
    n,
    api,
    consume,
    stash,
    barrier=weights_barrier(bidirectional, ws),
  )(ws, (outs, g))
  outs = tuple(o.reshape(p, n * r, o.shape[-1]) for o in outs)
  return outs, (None if g is None else g.reshape(p, n * r, k))
