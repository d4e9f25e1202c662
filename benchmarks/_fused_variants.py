"""The fused ring kernels' variants and their jnp twins.

Variants (registered with :func:`benchmarks._variants.register`):

- ``allgather_matmul_fused`` / ``allgather_matmul_fused_uni``:
  ``asyncops.collective_matmul``'s fused ring all-gather matmul (two ring
  directions / one), the flagship's ``A[B_X, D_Y] W[D, F_Y]``;
  ``allgather_matmul_fused_int8``: its chunks travel as int8 with per-row
  scales (the result is the dequantized chunks' product);
  ``allgather_matmul_fused_s<plan>`` (``s1111``, ``s121``, ``s112``,
  ``s13`` on a 4-ring; ``s12221``, ``s11222``, ``s1223``, ``s1241``,
  ``s134`` on an 8-ring): a fixed step plan, to compare plans.
- ``reducescatter:asyncops_fused`` / ``..._fused_uni``: the fused ring
  matmul-reduce-scatter.
- ``allreduce:asyncops_fused``: the fused matmul-reduce-scatter, then XLA's
  all-gather.

Twins (:mod:`benchmarks._kernel_costs`): what each computing kernel of
``asyncops/kernels/_allgather_matmul.py`` and ``_reducescatter_matmul.py``
does, written with ``jnp`` ops of the same shapes:

- ``ring_allgather_matmul``: one contraction over every chunk the kernel
  holds, ``x [n, m, k]`` (the chunks stacked, as its local chunk and
  receive slots are) by ``w`` as ``[n, k, f]``, accumulated in float32
  inside the contraction and cast once (:func:`ring_contraction`): the
  kernel keeps its ``[m, f]`` accumulator in VMEM for the whole ring and
  writes it to HBM once, so its twin makes no accumulator pass through
  HBM between steps. Each step of the kernel's plan (read from its
  ``ring_steps_<plan>_nf<blocks>`` scope) waits for the receive slots it
  consumes and is charged the contraction's time in proportion to its
  chunks (:class:`_kernel_costs.Steps`, ``_kernel_costs._split``). (Before
  branch h-acctwin: one dot per step added into an accumulator XLA placed
  in HBM, :func:`ring_steps`, kept to compare.)
- ``ring_reducescatter_matmul``: every step's product plus the partial
  sums received, cast: ``x [m, k] @ w [k, n c] + r [m, n c]`` (it writes
  ``n - 1`` sent blocks and keeps its own product: ``n c`` columns);
  ``ring_reducescatter_finish`` (no remote DMA): the last partial sums
  added to the own product, ``p [m, c] + r [m, c]``.
"""

import dataclasses
import functools
import re
import types

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from benchmarks import _kernel_costs, _timeline, _variants

AXIS = _variants.AXIS
_F32 = jnp.float32


def _sds(shape, dtype):
  return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _dt(leaf):
  return _kernel_costs._DTYPES.get(leaf.dtype, _F32)


def _acc(dtype):
  return jnp.int32 if jnp.dtype(dtype) == jnp.int8 else _F32


def _matmul_cast(x, w, out_dtype):
  if jnp.dtype(x.dtype) == jnp.int8 and jnp.issubdtype(w.dtype, jnp.floating):
    # Quantized chunks: the kernel multiplies the int8 codes as bf16 and
    # scales the rows (one multiply per output element, negligible).
    x = x.astype(jnp.bfloat16)
  return jnp.dot(
    x, w.astype(x.dtype), preferred_element_type=_acc(x.dtype)
  ).astype(out_dtype)


def _mxu_operands(x, w):
  """``(x, w, precision)`` as the kernel's dots see them: quantized int8
  codes meet the MXU as bfloat16 (exact); the kernel reads a wider ``w``
  as stored and rounds it in VMEM, the same work as a dot in ``w``'s
  dtype at DEFAULT precision (one bfloat16 pass); float32 chunks travel
  only at HIGHEST precision (``_fused``)."""
  floating = jnp.issubdtype(w.dtype, jnp.floating)
  highest = jnp.dtype(x.dtype) == jnp.float32
  if jnp.dtype(x.dtype) == jnp.int8 and floating:
    x = x.astype(jnp.bfloat16)
  if floating and jnp.dtype(w.dtype).itemsize > jnp.dtype(x.dtype).itemsize:
    x = x.astype(w.dtype)
  precision = jax.lax.Precision.HIGHEST if highest else None
  return x, w.astype(x.dtype), precision


def ring_contraction(w, x, *, out_dtype):
  """The all-gather kernel's work: ``w [n k, f]`` (every row, as stored)
  by the ``n`` chunks ``x [n, m, k]`` it multiplies (its local chunk and
  receive slots, stacked), one contraction over the chunks and their
  columns, ``sum_s x[s] @ w[s k : (s + 1) k]``, in float32 (int32 for
  int8) and cast once. The kernel accumulates every step's product into
  an ``[m, f]`` accumulator that stays in VMEM for the whole ring and is
  written to HBM once; here the accumulation is inside the contraction,
  so XLA's estimate has no pass of it through HBM either. (``w`` as
  ``[n, k, f]`` is a bitcast; XLA compiles this to one convolution
  fusion of the two parameters, no copy or transpose.)"""
  n, m, k = x.shape
  x, w, precision = _mxu_operands(x, w)
  y = jnp.einsum(
    "smk,skf->mf",
    x,
    w.reshape(n, k, w.shape[1]),
    preferred_element_type=_acc(x.dtype),
    precision=precision,
  )
  return y.astype(out_dtype)


def ring_steps(w, *xs, plan=None, out_dtype):
  """One dot per step of a plan, added into an accumulator that XLA
  places (in HBM at the shapes that matter): the all-gather kernel's
  twin before branch h-acctwin, kept to compare (``benchmarks.
  plan_twins``). ``w [n k, f]`` (every row, as stored), ``xs[s] [m, g_s
  k]`` (the ``g_s`` chunks step ``s`` holds; ``plan`` = ``(g_0, g_1,
  ...)``, default one chunk per step). Step ``s`` adds ``xs[s] @ w_s``
  (its ``g_s k`` rows of ``w``) into a float32 (int32 for int8)
  accumulator, cast once at the end."""
  k = xs[0].shape[1] // (plan[0] if plan else 1)
  plan = plan or tuple(x.shape[1] // k for x in xs)
  acc = None
  row = 0
  for xs_, g in zip(xs, plan, strict=True):
    ws = w[row * k : (row + g) * k]
    row += g
    xs_, ws, precision = _mxu_operands(xs_, ws)
    y = jnp.dot(
      xs_, ws, preferred_element_type=_acc(xs_.dtype), precision=precision
    )
    acc = y if acc is None else acc + y
  return acc.astype(out_dtype)


_STEPS = re.compile(
  r"ring_steps_([\d-]+)_nf(\d+)(?:_t(\d+)(?:p(\d+))?)?(_halves)?(_split)?"
)


def step_plan(attrs: str, n: int) -> tuple[tuple[int, ...], int]:
  """``(chunks per step, column blocks)`` of an all-gather compute kernel,
  from the ``ring_steps_<g0-g1-..>_nf<blocks>[_t<tail>]`` scope it runs in
  (one chunk per step and one block when absent)."""
  found = _STEPS.search(attrs)
  if not found:
    return (1,) * n, 1
  plan = tuple(int(g) for g in found.group(1).split("-"))
  if sum(plan) != n:
    raise ValueError(f"ring_steps plan {plan} does not cover a ring of {n}")
  return plan, int(found.group(2))


def step_halves(attrs: str) -> bool:
  """Whether the kernel runs each step as one half-step per direction
  (``_halves`` in its scope: ``_allgather_matmul.half_steps``), waiting
  for each direction's halves on their own."""
  found = _STEPS.search(attrs)
  return bool(found and found.group(5))


def step_split(attrs: str) -> bool:
  """Whether the kernel's last half arrives in two row pieces and it
  reads ``x`` by halves (``_split`` in its scope: ``AgSpec.split``)."""
  found = _STEPS.search(attrs)
  return bool(found and found.group(6))


def step_parts(attrs: str) -> int:
  """Column parts of each grid iteration (``AgSpec.parts``, the unit of
  its tail), from the kernel's scope (``_t<tail>p<parts>``); 1 when
  absent."""
  found = _STEPS.search(attrs)
  return int(found.group(4)) if found and found.group(4) else 1


def step_tail(attrs: str) -> int | None:
  """The kernel's ``AgSpec.tail`` (grid iterations a step's successor's
  copies overlap), from its scope; None when it waits before its last
  block."""
  found = _STEPS.search(attrs)
  return int(found.group(3)) if found and found.group(3) else None


def _ag_layout(operands, attrs):
  """``(x, w, rest, d, n, m)`` of an all-gather compute kernel's operands
  (me, x, [x scales [d, m, 128]], w, recv, [recv scales], sems): its ring
  directions ``d``, ring size ``n`` and rows ``m`` per panel, from the
  receive buffer ``[d, n - 1, m, k / d]`` (a row panel's kernel may read
  all of x: its rows are the buffer's) or, when the slots are rows of the
  result (``AgSpec.recv_in_out``), from its ``ring_slots_`` scope."""
  _, x, *rest = operands
  w = next(o for o in rest if len(o.dims) == 2)
  recv = next((o for o in rest if len(o.dims) == 4), None)
  if recv is not None:
    return x, w, rest, recv.dims[0], recv.dims[1] + 1, recv.dims[2]
  found = _timeline._SLOTS.search(attrs)
  if found is None:
    raise ValueError("ring_allgather_matmul: no receive buffer or slots")
  nd, n1, m, _, _ = (int(v) for v in found.groups())
  return x, w, rest, nd, n1 + 1, m


def _ag_twin(operands, results, attrs=""):
  """One contraction over the kernel's ``n`` chunks with the accumulation
  inside it (:func:`ring_contraction`): the kernel's work, its float32
  accumulator in VMEM for the whole ring. Each step of the kernel's plan
  (``g`` chunks) waits for its chunks' receive slots and is charged
  ``g / n`` of the contraction (``Steps.units``; no chunk parameter per
  step, so ``_kernel_costs._split`` splits in proportion); a kernel that
  runs half-steps (``_halves`` in its scope) is charged per half-step,
  ``g / (d n)``, each waiting for its own direction's halves
  (``Steps.halves``)."""
  x, w, _, nd, n, m = _ag_layout(operands, attrs)
  k, f = x.dims[1], w.dims[1]
  plan, blocks = step_plan(attrs, n)
  tail = step_tail(attrs)
  fn = functools.partial(ring_contraction, out_dtype=_dt(results[0]))
  args = (_sds((n * k, f), _dt(w)), _sds((n, m, k), _dt(x)))
  if step_halves(attrs):
    # Half-steps: step s's units, half d each (``half_steps``), waiting
    # for slot t's half d (``t nd + d``); a tail of ``t`` parts of
    # iterations (``AgSpec.parts`` each) is ``t / (parts blocks g)`` of a
    # half-step of ``g`` units.
    needs, sizes, unit = [], [], 0
    for g in plan:
      for d in range(nd):
        units = range(unit, unit + g)
        needs.append(tuple((u - 1) * nd + d for u in units if u > 0))
        sizes.append(g)
      unit += g
    parts = step_parts(attrs)
    tails = (
      [min(1.0, tail / (parts * blocks * g)) for g in sizes] if tail else []
    )
    if step_split(attrs):
      # The last half-step as two steps: its first iteration's first
      # (row) part, waiting for the split half's first piece (where the
      # whole half was waited for), then the rest, waiting for the second
      # piece (slot ``(n - 1) d`` of the halves, ``_Transfer.halves``)
      # before all of the first (its tail 1.0: the piece's copy runs
      # under that part).
      g = sizes.pop()
      first = 1 / (parts * blocks)  # one part: units of the half-step
      sizes += [first, g - first]
      needs.append(((n - 1) * nd,))
      if not tails:  # no tail: a step waits before its last block
        tails = [1 / blocks if blocks > 1 else 0.0] * (len(sizes) - 1)
      tails[-1:] = [1.0, 1.0]
    steps = _kernel_costs.Steps(
      tuple(needs), blocks, tuple(tails), (), tuple(sizes), halves=True
    )
    return fn, args, steps
  # A tail of ``t`` grid iterations (each ``[m, k/d] @ [k/d, bn]``) is
  # ``t / (blocks g d)`` of a step of ``g`` chunks.
  tails = (
    tuple(min(1.0, tail / (blocks * g * nd)) for g in plan) if tail else ()
  )
  needs, unit = [], 0
  for g in plan:
    needs.append(tuple(u - 1 for u in range(unit, unit + g) if u > 0))
    unit += g
  return (
    fn,
    args,
    _kernel_costs.Steps(tuple(needs), blocks, tails, (), plan),
  )


def rs_blocks(k: int, ch: int, itemsize: int) -> int:
  """``w`` blocks per half block of the fused reduce-scatter's steps
  kernel (``RsSpec.nb``): ``ch`` columns a half, ``bn`` the widest block
  dividing it that fits the library's ``w`` block budget
  (``_fused.plan_reducescatter``); one when none does."""
  from asyncops.collective_matmul import _fused as lib  # noqa: PLC0415

  budget = lib._W_BLOCK_BYTES
  bn = next(
    (
      b
      for b in (2048, 1536, 1024, 768, 512, 384, 256, 128)
      if ch % b == 0 and k * b * itemsize <= budget
    ),
    ch,
  )
  return max(ch // bn, 1)


def rs_steps(n: int, directions: int, blocks: int) -> _kernel_costs.Steps:
  """The fused reduce-scatter steps kernel's chain on a ring of ``n``.

  Step ``s < n - 1`` sends slot ``s`` (its partial sums) once it ends;
  step ``1 <= s <= n - 2`` waits for slot ``s - 1`` (the neighbour's
  partial sums of its block; ``KernelSteps`` waits for ``needs[s + 1]``
  inside step ``s``); the last step (the own product) waits for nothing.
  The two halves of a two-way step count as one slot, sent at the step's
  end, as the second half's is: each half waits before its last of
  ``blocks`` blocks (``RsSpec.nb``), so ``1 / (directions blocks)`` of the
  step runs after the wait, none when a half is one block (it waits after
  its dot). The twin's one dot is split evenly over the ``n`` steps."""
  needs = ((),) + tuple((s - 1,) if s >= 1 else () for s in range(n - 1))
  sends = tuple(range(n - 1)) + (-1,)
  tail = 1 / (directions * blocks) if blocks > 1 else 0.0
  return _kernel_costs.Steps(
    needs, blocks, (tail,) * n, units=(1,) * n, sends=sends
  )


def _rs_twin(operands, results, attrs=""):
  """Every step's product plus the partial sums received: one ``x [m, k]
  @ w [k, n c] + r [m, n c]``, cast to the sent dtype, split evenly over
  the kernel's steps, each sending its partial sums and waiting for its
  neighbour's (:func:`rs_steps`)."""
  del attrs
  _, x, w, recv = operands[:4]
  # A row panel's kernel may read all of x: its rows are the receive
  # buffer's (``[d, n - 1, m, c / d]``).
  m, k, cols = recv.dims[2], x.dims[1], w.dims[1]
  d, n, ch = recv.dims[0], recv.dims[1] + 1, recv.dims[3]
  item = jnp.dtype(_dt(recv)).itemsize

  def fn(x, w, r):
    y = jnp.dot(x, w.astype(x.dtype), preferred_element_type=_acc(x.dtype))
    return (y + r.astype(y.dtype)).astype(r.dtype)

  return (
    fn,
    (
      _sds((m, k), _dt(x)),
      _sds(w.dims, _dt(w)),
      _sds((m, cols), _dt(recv)),
    ),
    rs_steps(n, d, rs_blocks(k, ch, item)),
  )


def _rs_finish_twin(operands, results, attrs=""):
  """The last partial sums added to the own products: ``p [m, c] + r [m,
  c]`` (float32 plus the sent dtype), cast to the result's dtype. It
  waits for the last slot (``n - 2``) before it adds: a first step of no
  cost whose wait is that slot's."""
  del attrs
  own, recv = operands[:2]
  d, m, ch = own.dims
  out = _dt(results[0])

  def fn(p, r):
    return (p + r.astype(p.dtype)).astype(out)

  last = recv.dims[1] - 1 if len(recv.dims) == 4 else -1
  steps = _kernel_costs.Steps(((), (last,)), units=(0, 1))
  return (
    fn,
    (_sds((m, d * ch), _dt(own)), _sds((m, d * ch), _dt(recv))),
    *((steps,) if last >= 0 else ()),
  )


def _leaf(dims, dtype, memory_space=0):
  """An operand-like leaf (``dims``, ``dtype`` as HLO spells it)."""
  return types.SimpleNamespace(
    dims=tuple(dims), dtype=dtype, memory_space=memory_space
  )


def _rest_layout(operands):
  """``(w, recv, d, n, m, k)`` of ``ring_allgather_matmul_rest``'s
  operands (me, w, recv ``[d, n - 1, m, k/d]``, sems, acc, token)."""
  w = next(o for o in operands[1:] if len(o.dims) == 2)
  recv = next(o for o in operands if len(o.dims) == 4)
  d, n1, m, kh = recv.dims
  return w, recv, d, n1 + 1, m, kh * d


def _itemsize(leaf) -> int:
  return jnp.dtype(_dt(leaf)).itemsize


def _ag_local_twin(operands, results, attrs=""):
  """``AgSpec.forward``'s first compute kernel (``ring_allgather_matmul_
  local``): the one-kernel twin (:func:`_ag_twin`, the same contraction,
  cast to ``x``'s dtype as the one kernel's result is) of which it runs
  the local step's half-steps (``Steps.keep``): the same grid iterations
  as the one kernel's first step, charged as they are there. Its floor
  counts what it reads from HBM, ``x`` and the local chunk's ``k`` rows
  of ``w`` (``Steps.hbm_bytes``; its accumulator is a VMEM output)."""
  x, w, _, nd, n, _ = _ag_layout(operands, attrs)
  plan, _ = step_plan(attrs, n)
  fn, args, steps = _ag_twin(operands, [_leaf((), x.dtype)], attrs)
  k, f = x.dims[1], w.dims[1]
  read = _bytes(x.dims, x) + k * f * _itemsize(w)
  keep = (0, plan[0] * nd)
  return fn, args, dataclasses.replace(steps, keep=keep, hbm_bytes=read)


def _ag_rest_twin(operands, results, attrs=""):
  """``AgSpec.forward``'s second compute kernel (``ring_allgather_matmul_
  rest``): the one-kernel twin (:func:`_ag_twin`, ``x`` taken from the
  receive buffer's shape) of which it runs the half-steps after the
  local step (``Steps.keep``; a first step of no cost waits for its
  first half-step's halves, as the kernel does as it begins). Its floor
  counts the ``(n - 1) k`` rows of ``w`` it reads and the result it
  writes (``Steps.hbm_bytes``)."""
  w, recv, nd, n, m, k = _rest_layout(operands)
  plan, _ = step_plan(attrs, n)
  x = _leaf((m, k), recv.dtype, 1)
  ops = [operands[0], x, w, recv]
  fn, args, steps = _ag_twin(ops, results, attrs)
  f = w.dims[1]
  read = (n - plan[0]) * k * f * _itemsize(w) + _bytes(
    results[0].dims, results[0]
  )
  keep = (plan[0] * nd, len(steps.needs))
  return fn, args, dataclasses.replace(steps, keep=keep, hbm_bytes=read)


# Longer names first: the coster takes the first registered prefix.
_kernel_costs.register("ring_allgather_matmul_local", _ag_local_twin)
_kernel_costs.register("ring_allgather_matmul_rest", _ag_rest_twin)
_kernel_costs.register("ring_allgather_matmul", _ag_twin)
_kernel_costs.register("ring_reducescatter_matmul", _rs_twin)
_kernel_costs.register("ring_reducescatter_finish", _rs_finish_twin)


# What each kernel reads before its first dot (its BlockSpecs), numbered
# as its twin's parameters (``_kernel_costs.Reads``). Keep these in step
# with the twins' arguments above and the kernels' ``_in_specs``.


def _bytes(dims, leaf) -> int:
  n = 1
  for v in dims:
    n *= v
  return n * jnp.dtype(_dt(leaf)).itemsize


def _in_vmem(leaf) -> bool:
  """Whether XLA placed the kernel's operand in VMEM (its copy before the
  kernel, if any, is on the program's timeline): the kernel reads it
  there, not from HBM."""
  return getattr(leaf, "memory_space", 0) == 1


def _reads(whole, w_param, w_block, streamed, x, w, extra=0):
  """``Reads`` of a kernel that reads ``x`` (twin parameter ``whole``)
  whole and streams ``w`` (``w_param``, first block ``w_block`` bytes):
  an operand XLA already put in VMEM is read there (no fill; a prefetch
  of it in the twin free)."""
  x_vmem, w_vmem = _in_vmem(x), _in_vmem(w)
  return _kernel_costs.Reads(
    whole=() if x_vmem else (whole,),
    streamed=tuple(sorted({*streamed, *((whole,) if x_vmem else ())})),
    first=() if w_vmem else ((w_param, w_block),),
    extra_bytes=extra,
  )


def _ag_reads(operands, results, attrs=""):
  """The all-gather compute kernel (``_allgather_matmul._in_specs``) reads
  ``x``, its local chunk, and a quantized chunk's scales whole
  (``pl.Buffered(1)``) and streams ``w`` (twin parameter 0) in ``[k/d,
  bn]`` blocks (``bn = f / nf``, its ``ring_steps_.._nf<nf>`` scope); it
  copies each later step's chunks into VMEM under the step before's last
  block (the model charges their arrival, ``KernelSteps.needs``). In the
  contraction twin (:func:`ring_contraction`) every chunk is one stacked
  parameter (1) whose first block is the local chunk: both parameters are
  streamed, and the fill is their first blocks, one ``w`` block and the
  local chunk ``[m, k]``, or its first half ``[m, k/d]`` where the kernel
  reads ``x`` by halves (``_split``; an operand XLA placed in VMEM is
  read there: no fill)."""
  del results
  x, w, rest, nd, n, m = _ag_layout(operands, attrs)
  _, blocks = step_plan(attrs, n)
  k, f = x.dims[1], w.dims[1]
  scales = [o for o in rest if len(o.dims) == 3]  # [d, rows, 128] float32
  extra = sum(
    _bytes((o.dims[0], m, o.dims[2]), o) for o in scales[:1] if not _in_vmem(o)
  )
  first = ()
  if not _in_vmem(w):
    first += ((0, _bytes((k // nd, f // blocks), w)),)
  if not _in_vmem(x):
    # ``x`` whole, or by halves (``_split`` in its scope: the pipeline
    # fetches half 1 under the first half-step, ``AgSpec.split``).
    cols = k // nd if step_split(attrs) else k
    first += ((1, _bytes((m, cols), x)),)
  return _kernel_costs.Reads(
    whole=(), streamed=(0, 1), first=first, extra_bytes=extra
  )


def _rs_reads(operands, results, attrs=""):
  """The reduce-scatter steps kernel (``_reducescatter_matmul._in_specs``)
  reads ``x`` (twin parameter 0) whole (``pl.Buffered(1)``) and streams
  ``w`` (parameter 1) in ``[k, bn]`` blocks (:func:`rs_blocks`): its fill
  is ``x`` and one ``w`` block. Each step's received partial sums (in
  parameter 2) it copies into VMEM under the step's last block: streamed
  when a half has two blocks or more; after its dot (one block) it waits
  for the copy, so a prefetch of them is charged. An operand XLA placed
  in VMEM is read there (no fill)."""
  del results, attrs
  _, x, w, recv = operands[:4]
  k, ch = x.dims[1], recv.dims[3]
  nb = rs_blocks(k, ch, jnp.dtype(_dt(recv)).itemsize)
  streamed = (1, 2) if nb > 1 else (1,)
  return _reads(0, 1, _bytes((k, ch // nb), w), streamed, x, w)


def _rs_finish_reads(operands, results, attrs=""):
  """The finish reads its own products (twin parameter 0) from VMEM (the
  steps kernel's VMEM output): nothing to fill, a prefetch of them free.
  It copies the last partial sums (parameter 1) from HBM after it has
  waited for them, before it adds: a prefetch of them is charged."""
  del operands, results, attrs
  return _kernel_costs.Reads(streamed=(0,))


def _ag_rest_reads(operands, results, attrs=""):
  """The rest kernel streams ``w`` (twin parameter 0; its fill, one
  ``[k/d, bn]`` block) and reads the received chunks (parameter 1) in
  place in the VMEM receive buffer and the accumulator in VMEM: no fill
  of them."""
  del results
  w, _, nd, n, _, k = _rest_layout(operands)
  _, blocks = step_plan(attrs, n)
  first = (
    () if _in_vmem(w) else ((0, _bytes((k // nd, w.dims[1] // blocks), w)),)
  )
  return _kernel_costs.Reads(whole=(), streamed=(0, 1), first=first)


_kernel_costs.register_reads("ring_allgather_matmul_local", _ag_reads)
_kernel_costs.register_reads("ring_allgather_matmul_rest", _ag_rest_reads)
_kernel_costs.register_reads("ring_allgather_matmul", _ag_reads)
_kernel_costs.register_reads("ring_reducescatter_matmul", _rs_reads)
_kernel_costs.register_reads("ring_reducescatter_finish", _rs_finish_reads)


# Variants ------------------------------------------------------------------


def _fused(name: str, module: str = "_fused", **kw):
  import importlib  # noqa: PLC0415

  mod = importlib.import_module(f"asyncops.collective_matmul.{module}")
  fn = getattr(mod, name)

  def body(*args, precision=None):
    with jax.default_matmul_precision(precision or "default"):
      return fn(*args, AXIS, **kw)

  return body


def _flagship(**kw):
  def build(mesh, precision):
    f = functools.partial(_fused("allgather_matmul", **kw), precision=precision)
    return jax.jit(
      jax.shard_map(
        f,
        mesh=mesh,
        in_specs=(P("x", AXIS), P(None, AXIS)),
        out_specs=P("x", AXIS),
      )
    )

  return build


def _family(family, library, **kw):
  fam = _variants.FAMILIES[family]

  def build(mesh, precision):
    f = functools.partial(_fused(library, **kw), precision=precision)
    return jax.jit(
      jax.shard_map(f, mesh=mesh, in_specs=fam.in_specs, out_specs=fam.out_spec)
    )

  return build


def _args(as_name):
  return lambda mesh, shape, dtype: _variants.abstract_args(
    as_name, mesh, shape, dtype
  )


_variants.register(
  "allgather_matmul_fused", _flagship(directions=2), _args("jit")
)
_variants.register(
  "allgather_matmul_fused_uni", _flagship(directions=1), _args("jit")
)
# Fixed step plans of the fused all-gather (a 4-ring, then an 8-ring), to
# compare plans.
for _plan in (
  (1, 1, 1, 1),
  (1, 2, 1),
  (1, 1, 2),
  (1, 3),
  (1, 2, 2, 2, 1),
  (1, 1, 2, 2, 2),
  (1, 2, 2, 3),
  (1, 2, 4, 1),
  (1, 3, 4),
):
  _variants.register(
    "allgather_matmul_fused_s" + "".join(map(str, _plan)),
    _flagship(directions=2, steps=_plan),
    _args("jit"),
  )
# The antipode's halves relayed by the neighbours (``AgSpec.forward``).
_variants.register(
  "allgather_matmul_fused_fwd",
  _flagship(directions=2, forward=True),
  _args("jit"),
)
_variants.register(
  "allgather_matmul_fused_int8",
  _flagship(directions=2, transfer="int8"),
  _args("jit"),
)
_variants.register(
  "reducescatter:asyncops_fused",
  _family("reducescatter", "matmul_reducescatter", directions=2),
  _args("reducescatter:jit"),
)
_variants.register(
  "reducescatter:asyncops_fused_uni",
  _family("reducescatter", "matmul_reducescatter", directions=1),
  _args("reducescatter:jit"),
)
_variants.register(
  "allreduce:asyncops_fused",
  _family("allreduce", "matmul_allreduce", directions=2),
  _args("allreduce:jit"),
)

# method="auto" rows (``allgather_matmul_auto``, ``<family>:asyncops_auto``)
# are the public functions' default; ``benchmarks._variants`` builds them.
