"""Fused collective matmuls: one Pallas ring kernel, accumulator in VMEM.

Each op here is one JAX primitive lowered per platform. On TPU (including
ahead-of-time compiles from a CPU host) it becomes the start / compute /
done kernels of ``asyncops.kernels._allgather_matmul`` (or the
reduce-scatter ones), with the block size, the number of ring directions
and the row panels chosen from the shape and the chip; everywhere else it
is the ``jax.lax`` collective plus ``jnp.dot`` it equals.

Canonical 2-D forms (per device, inside ``shard_map``):

- all-gather matmul: ``x [m, k] @ w [n k, f] -> [m, f]``, equal to
  ``all_gather(x, axis, axis=1, tiled=True) @ w``.
- matmul-reduce-scatter: ``x [m, k] @ w [k, n c] -> [m, c]``, equal to
  ``psum_scatter(x @ w, axis, scatter_dimension=1, tiled=True)``.

Numerics on TPU follow XLA's: floating inputs accumulate in float32 and
round once; at ``Precision.DEFAULT`` a float32 matmul runs on the MXU in one
bfloat16 pass, so float32 chunks travel as bfloat16 (what XLA's own
all-gather matmul does: it converts before gathering), at ``HIGHEST`` they
travel and multiply in float32. int8 accumulates in int32 and wraps to int8
like ``jnp.dot``.

Row panels: the all-gather's accumulator ``[m, f]`` float32 lives in VMEM
(the reduce-scatter's products, received and sent partial sums too). When
it (plus the chunk buffers and ``w`` blocks) exceeds the chip's budget, the
rows are split in panels and each panel runs its own ring, one after the
other (``_by_panels``); each panel's kernels read their rows of the whole
``x``, and the kernel that writes the result (the all-gather's compute
kernel, the reduce-scatter's finish) takes the previous panel's result
(aliased) and writes its rows of it in place: neither is ``x`` sliced nor
the result concatenated. XLA copied both, 8.5 and 21.2 us for the
all-gather at the Llama-3-70B shard's tp 8, M = 4096, on v5p; 24.9 and
25.0 us for the reduce-scatter there, whose row panels' result is pinned
to HBM (v5e kept it in VMEM and copied it out).

The all-gather's receive slots (``n - 1`` chunks, live for the whole
ring): the result's own rows where they fit (``_in_out``), else a VMEM
buffer where it fits the chip's budget in one panel (``_in_vmem``), else
an HBM buffer (on v5e and v6e over issue 15's memory target, jit's
temporaries plus one chunk's two buffers, wherever ``n > 3``).
"""

import dataclasses
import math

import jax
import jax.numpy as jnp

from asyncops import _jax_compat as jc
from asyncops.collective_matmul import _chips, _vmem, _wiring
from asyncops.kernels import _allgather_matmul as agk
from asyncops.kernels import _common
from asyncops.kernels import _reducescatter_matmul as rsk

# VMEM per TensorCore (jax's pallas tpu_info table); kernels use at most
# ``_VMEM_SHARE`` of it so XLA's own buffers keep room.
_VMEM_BYTES = {
  4: 16 * 2**20,
  5: 128 * 2**20,  # v5e; v5p has 64 MiB, see _vmem_capacity
  6: 128 * 2**20,
}
_VMEM_SHARE = 0.6
_W_BLOCK_BYTES = 4 * 2**20  # both halves of one w block
# The reduce-scatter's sent partial sums are a VMEM output that must stay
# resident until the done (the remote DMAs read it). The done takes it in
# VMEM with its scoped limit raised to hold it; above 16 MiB rows are split
# into more panels (29 MiB failed to compile at XLA's default limit, v5e,
# m 4096, tp 8, "CompileTimeScopedVmemOom"; 12 MiB, the prefill shape's
# one panel, compiles on v5e and v6e).
_SENT_BYTES = 16 * 2**20
# The all-gather's receive buffer in VMEM (``AgSpec.recv_vmem``) up to this
# size, as the reduce-scatter's sent partial sums (``_SENT_BYTES``): the
# Llama-3-70B shard's tp 8 buffers at M = 16 to 1024 (0.22 to 14 MiB) and
# the issue's float32 prefill row (12 MiB of bf16 chunks) take it.
_RECV_VMEM_BYTES = 16 * 2**20
# The reduce-scatter's receive buffer goes to VMEM (``RsSpec.recv_vmem``)
# where the VMEM in use while its steps kernel runs (the scoped limit and
# the sent partial sums, own products and receive buffer XLA places beside
# it, ``rsk.resident_vmem_bytes``) stays within this share of the chip's
# VMEM, else HBM. XLA refuses a program over all of it (v5e, tp 4, m 1024
# of the Llama-3-70B shard: 129.25 MiB of 128 failed, 127.25 compiled);
# the rest is room for XLA's own VMEM buffers beside the kernels'. With
# the scoped limit counting the VMEM outputs too (before branch h-rsvmem)
# the Llama shard's tp 4 m >= 1024 plans came to 117.25 MiB; at 0.92
# they fit, and the MLP around them lost time (v5e prefill: mlp 1349.6 ->
# 1367.5 us, mlp_gated 2197.1 -> 2234.9; XLA's own buffers moved to HBM).
# Since branch h-rsvmem a plan whose buffer does not fit so takes the
# tight limit, the scoped area alone (``_rs_recv_space``): every Llama
# sweep plan fits, on v5e and v6e tp 8 with the roomy limit (91.0 MiB)
# and tp 4 m >= 1024 with the tight one (87.25); on v5p (64 MiB) tp 8
# roomy (51.9) and tp 4 m >= 512 tight (50.0).
_RECV_VMEM_SHARE = 0.85


def vmem_capacity(device_kind: str | None) -> int:
  """VMEM bytes of one TensorCore of ``device_kind`` (64 MiB if unknown)."""
  kind = (device_kind or "").lower()
  if "v5" in kind and "lite" not in kind and "v5e" not in kind:
    return 64 * 2**20  # v5p
  for gen, size in _VMEM_BYTES.items():
    if f"v{gen}" in kind:
      return size
  return 64 * 2**20


def precision_name() -> str:
  """The in-kernel precision for the current ``default_matmul_precision``."""
  p = jax.config.jax_default_matmul_precision
  p = str(p).lower() if p is not None else "default"
  if p in ("highest", "float32", "high", "bfloat16_3x", "tensorfloat32"):
    return "HIGHEST"
  return "DEFAULT"


def transfer_dtype(dtype, precision: str) -> str:
  """The dtype chunks travel in: bfloat16 for float32 at DEFAULT."""
  dtype = jnp.dtype(dtype)
  if dtype == jnp.float32 and precision == "DEFAULT":
    return "bfloat16"
  return dtype.name


_SUBLANES = {1: 32, 2: 16, 4: 8}


def _sublanes(dtype) -> int:
  return _SUBLANES.get(jnp.dtype(dtype).itemsize, 8)


def _block_cols(f: int, k: int, itemsize: int) -> int | None:
  """The widest ``bn`` dividing ``f`` whose ``w`` block fits the budget,
  preferring at least two blocks per step (so a chunk copy can overlap the
  last block)."""
  fits = [
    bn
    for bn in (2048, 1536, 1024, 768, 512, 384, 256, 128)
    if f % bn == 0 and k * bn * itemsize <= _W_BLOCK_BYTES
  ]
  two = [bn for bn in fits if f // bn >= 2]
  if two:
    return two[0]
  if fits:
    return fits[0]
  if k * f * itemsize <= _W_BLOCK_BYTES:
    return f
  return None


def choose_steps(
  n: int,
  m: int,
  k: int,
  f: int,
  w_dtype,
  device_kind: str | None = None,
  t_dtype="bfloat16",
) -> tuple[int, ...]:
  """Chunks per step of the all-gather kernel for ``[m, k] @ [n k, f]``.

  Two plans: one chunk per step, or the two sides paired (``(1, 2, ...,
  2[, 1])``: the local chunk, then the units at each distance from both
  sides at once, which arrive together). A step fewer saves one pass over
  the float32 accumulator, but a paired step cannot start before both its
  units are in. The benchmark model (XLA's estimates of the steps' dots,
  each step waiting for its slots; ``design/benchmarks.md``) favours
  pairs only for large bfloat16 chunks (``k >= 2048`` rows of a 2-byte
  ``w``) that cross a link faster than the MXU multiplies them (v5e at
  prefill); elsewhere (the chapter's ``k = 512``, float32 weights, v6e's
  fast MXU) one chunk per step is as fast or faster, but on v5p: there
  XLA's estimate of a one-chunk step dot carries a large fixed part (the
  Llama-3-70B shard at tp 8, ``[1024, 1024] @ [1024, 3584]``: 22.7 us
  for 16.4 us of FLOPs; a two-chunk step 34.6 for 32.8), so from a ring
  of 4 on, bfloat16 weights take the local chunk and the first unit
  alone (their dots cover the second unit's transfer) and then pairs
  (``(1, 1, 2, 2, 2)`` at ``n = 8``: 178.9 us against 218.5 one chunk
  per step, and faster at every M of that sweep; ``design/benchmarks.md``,
  "v5p tp 8: two chunks per step"). On v6e, where a step's dot is bound
  by reading its rows of ``w`` (decode sizes) and every direct send
  (``_wiring.ideal(n).direct_load`` chunks on a link) takes less than
  one such read, the local step covers them all and the rest is one
  step, ``(1, n - 1)`` (tp 4 of that shard, M = 64: 92.6 us against 96.2).

  Example:
    >>> choose_steps(4, 1024, 2048, 7168, "bfloat16", "TPU v5 lite")
    (1, 2, 1)
    >>> choose_steps(4, 1024, 2048, 7168, "bfloat16", "TPU v6 lite")
    (1, 1, 1, 1)
    >>> choose_steps(8, 1024, 1024, 3584, "bfloat16", "TPU v5p")
    (1, 1, 2, 2, 2)
    >>> choose_steps(4, 64, 2048, 7168, "bfloat16", "TPU v6 lite")
    (1, 3)
  """
  chip = _chips.chip_for(device_kind)
  link_s = m * k * jnp.dtype(t_dtype).itemsize / chip.link
  mxu_s = 2 * m * k * f / chip.bf16_flops
  bf16_w = jnp.dtype(w_dtype).itemsize == 2
  big = k >= 2048 and bf16_w
  if n >= 3 and big and link_s <= 0.75 * mxu_s:
    return (1,) + (2,) * ((n - 1) // 2) + (1,) * ((n - 1) % 2)
  w_read_s = k * f * jnp.dtype(w_dtype).itemsize / chip.hbm
  sends_s = _wiring.ideal(n).direct_load * link_s
  if chip.name == "v6e" and bf16_w and mxu_s < w_read_s and sends_s < w_read_s:
    # Each step reads its rows of w: the local step's read covers every
    # direct send, so the rest is one step.
    return (1, n - 1)
  if n >= 4 and bf16_w and chip.name == "v5p":
    # The local unit and the first one alone (their dots cover the
    # second unit's transfer), then pairs.
    return (1, 1) + (2,) * ((n - 2) // 2) + (1,) * ((n - 2) % 2)
  return (1,) * n


def choose_tail(spec: agk.AgSpec, device_kind: str | None) -> int | None:
  """Parts of grid iterations (``AgSpec.parts``: each iteration's block
  in two column parts where ``bn / 2`` is a multiple of 128) at the end
  of a half-step that the copies of the next half-step's halves overlap
  (``AgSpec.tail``), or None for the last column block.

  A half-step (one direction's halves of a step's units,
  ``_allgather_matmul.half_steps``) waits for its successor's halves,
  then copies them from their receive slots into VMEM while its last
  parts run. The fewest parts whose matmuls, at the chip's peak, cover
  that copy and their own ``w`` blocks at HBM bandwidth wait latest (a
  late half stalls less); None when that is not fewer than the last
  block's of the largest step (or a part's ``w`` block alone fills HBM:
  float32 weights).

  Example:
    >>> from asyncops.kernels._allgather_matmul import AgSpec
    >>> s = AgSpec("y", ("x", "y"), 4, 512, 512, 2048, "bfloat16",
    ...            "bfloat16", "bfloat16", bn=1024, steps=(1, 2, 1))
    >>> choose_tail(s, "TPU v5 lite"), choose_tail(s, "TPU v6 lite")
    (2, None)
    >>> import dataclasses  # one unit a step: half an iteration
    >>> choose_tail(dataclasses.replace(s, steps=None), "TPU v5 lite")
    1
  """
  from asyncops.collective_matmul import _auto  # noqa: PLC0415 (cycle)

  chip = _auto.chip_for(device_kind)
  plan = spec.plan
  if spec.nf < 2 or len(plan) < 2:
    return None
  parts = dataclasses.replace(spec, tail=1).parts
  it_s = 2 * spec.m * spec.kh * spec.bn / chip.bf16_flops / parts
  w_s = spec.kh * spec.bn * jnp.dtype(spec.w_dtype).itemsize / chip.hbm / parts
  if it_s <= w_s:
    return None
  half = spec.m * spec.kh * jnp.dtype(spec.dtype).itemsize
  need = max(math.ceil(g * half / chip.hbm / (it_s - w_s)) for g in plan[1:])
  if need >= parts * max(plan):
    return None
  return need


def choose_split(spec: agk.AgSpec, device_kind: str | None) -> bool:
  """Whether to send the last half to arrive in two row pieces and read
  ``x`` by halves (``AgSpec.split``): where the last half's wait is
  exposed, by a rough estimate.

  The start's sends cross the busiest directed link one after the other
  (``_wiring.ideal(n).direct_load`` chunks, ``directions`` halves each,
  after the start's issue), the last half then ``n / 2`` hops; the
  kernel needs it before the tail of the half-step before the last, after
  its fill (``x`` and a ``w`` block at HBM bandwidth) and the half-steps
  before (the contraction at the chip's peak, in chunks' shares). Where
  it arrives later the wait is exposed and splitting it pays: the last
  half-step then waits for the second piece only before its first
  iteration's second part, and the fill shrinks by half of ``x``. Where
  it is hidden the extra send is pure cost. Only with a tail
  (``choose_tail``: iterations that cover their copies), two directions,
  one unit in the last step (with two, the last half-step also waits for
  the other unit's half, which the split does not bring in earlier: the
  Llama-3-70B shard on v5p at tp 8, plan ``(1, 1, 2, 2, 2)``, only paid
  the extra send's charge, 0.07 to 1.14 us a row) and pieces of whole
  sublane tiles.

  Example:
    >>> from asyncops.kernels._allgather_matmul import AgSpec
    >>> s = AgSpec("y", ("x", "y"), 4, 512, 512, 2048, "bfloat16",
    ...            "bfloat16", "bfloat16", bn=1024, tail=1)
    >>> choose_split(s, "TPU v5 lite")  # the chapter's shape: link bound
    True
    >>> big = AgSpec("y", ("x", "y"), 4, 1024, 2048, 7168, "bfloat16",
    ...              "bfloat16", "bfloat16", bn=1024, steps=(1, 2, 1),
    ...              tail=2)
    >>> choose_split(big, "TPU v5 lite")  # prefill: the sends are hidden
    False
  """
  from asyncops.collective_matmul import _auto  # noqa: PLC0415 (cycle)

  if (
    spec.tail is None
    or spec.quantized
    or spec.directions != 2
    or spec.plan[-1] != 1
    or spec.m % (2 * _sublanes(spec.dtype))
  ):
    return False
  chip = _auto.chip_for(device_kind)
  n, nd = spec.n, spec.directions
  t = jnp.dtype(spec.dtype).itemsize
  issue = 1e-6  # the start's barrier and issue (``_timeline``'s issue)
  chunk = spec.m * spec.k * t
  arrive = (
    issue
    + _wiring.ideal(n).direct_load * chunk / chip.link
    + (n // 2) * _auto._HOP_S
  )
  compute = 2 * spec.m * n * spec.k * spec.f / chip.bf16_flops
  w_block = spec.kh * spec.bn * jnp.dtype(spec.w_dtype).itemsize
  fill = (spec.m * spec.k * t + w_block) / chip.hbm
  # The half-step before the last (half 0 of the last step, one unit).
  tail = compute / (n * nd) * spec.tail / (spec.parts * spec.nf)
  need = issue + fill + compute * (1 - 1 / (n * nd)) - tail
  return arrive > need


@dataclasses.dataclass(frozen=True)
class AgPlan:
  """How one all-gather matmul runs: kernel spec and row panels."""

  spec: agk.AgSpec | None
  panels: int
  reason: str = ""


def plan_allgather(
  m: int,
  k: int,
  f: int,
  n: int,
  dtype,
  w_dtype,
  out_dtype,
  *,
  directions: int,
  precision: str,
  device_kind: str | None,
  axis_name: str = "",
  mesh_axes: tuple[str, ...] = (),
  collective_id: int | None = None,
  quantized: bool = False,
  steps: tuple[int, ...] | None = None,
  forward: bool = False,
) -> AgPlan:
  """Block size, directions, step plan and panels for ``[m, k] @ [n k, f]``.

  ``steps``: chunks per ring step (``AgSpec.steps``); None chooses them
  (:func:`choose_steps`). ``forward``: relay the antipode's halves
  (``AgSpec.forward``) where the kernel can (:func:`_forwarded`).

  Returns a plan with ``spec=None`` and a ``reason`` when the fused kernel
  cannot run this shape (the caller falls back).
  """
  if quantized and not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
    return AgPlan(None, 0, "int8 transfers quantize floating inputs only")
  t = "int8" if quantized else transfer_dtype(dtype, precision)
  if jnp.dtype(t) not in (
    jnp.dtype(jnp.bfloat16),
    jnp.dtype(jnp.float32),
    jnp.dtype(jnp.int8),
  ):
    return AgPlan(None, 0, f"dtype {jnp.dtype(dtype).name} has no MXU path")
  if n < 2:
    return AgPlan(None, 0, "axis of size 1")
  if directions == 2 and (k % 2 or (k // 2) % 128):
    return AgPlan(None, 0, f"k/2 = {k / 2} is not a multiple of 128")
  if k % _sublanes(t):
    return AgPlan(None, 0, f"k = {k} is not a multiple of the sublane tile")
  bn = _block_cols(f, k, jnp.dtype(w_dtype).itemsize)
  if bn is None:
    return AgPlan(None, 0, f"no w block of k = {k} rows fits VMEM")
  budget = int(vmem_capacity(device_kind) * _VMEM_SHARE)

  def spec_for(rows, steps=steps, bn=bn):
    s = agk.AgSpec(
      axis_name=axis_name,
      mesh_axes=mesh_axes,
      n=n,
      m=rows,
      k=k,
      f=f,
      dtype=t,
      w_dtype=jnp.dtype(w_dtype).name,
      out_dtype=jnp.dtype(out_dtype).name,
      directions=directions,
      bn=bn,
      precision=precision,
      collective_id=collective_id,
      quantized=quantized,
      steps=steps
      if steps is not None
      else choose_steps(n, rows, k, f, w_dtype, device_kind, t),
    )
    s = dataclasses.replace(s, tail=choose_tail(s, device_kind))
    s = dataclasses.replace(s, split=choose_split(s, device_kind))
    need = agk.vmem_bytes(s)
    return dataclasses.replace(s, vmem_limit=_limit(need, device_kind)), need

  sub = _sublanes(t)
  one = _chips.CAL.get(_chips.chip_for(device_kind).name)
  one = one.fused_one_panel_vmem if one is not None else 0.0
  for panels in range(1, m + 1):
    if m % panels:
      continue
    rows = m // panels
    if rows % sub and panels > 1:
      continue
    spec, need = spec_for(rows)
    if need <= budget:
      if forward:
        fwd = _forwarded(
          _in_vmem(AgPlan(spec, panels), device_kind), device_kind
        )
        if fwd is not None:
          return fwd
      return _in_vmem(_in_out(AgPlan(spec, panels)), device_kind)
    if panels == 1 and steps is None and one and spec.g > 1:
      # One chunk per step holds half the chunk buffers (and narrower w
      # blocks less): one panel where the chip's share allows it
      # (``Cal.fused_one_panel_vmem``). Mosaic takes some MiB beyond
      # ``vmem_bytes`` (v5p, one direction, 1024-column blocks: 59.5 MiB
      # for 56 counted, over the 57.6 limit), hence the share's margin.
      for cols in (bn, bn // 2):
        if cols % 128 or f % cols:
          continue
        spec, need = spec_for(rows, (1,) * n, cols)
        if need <= one * vmem_capacity(device_kind):
          return _in_vmem(_in_out(AgPlan(spec, 1)), device_kind)
    if rows <= sub:
      break
  return AgPlan(None, 0, f"the accumulator of {m} x {f} does not fit VMEM")


def _limit(need: int, device_kind: str | None) -> int:
  """The compute kernel's scoped VMEM limit for ``need`` bytes."""
  return _common.scoped_limit(need, vmem_capacity(device_kind))


def _in_vmem(plan: AgPlan, device_kind: str | None) -> AgPlan:
  """``plan`` with its receive buffer in VMEM (``AgSpec.recv_vmem``: the
  peers' chunks land in VMEM, the compute kernel reads them in place, no
  receive buffer in HBM) where its chunks do not land in the result
  (``recv_in_out``), it runs one row panel, the buffer is at most
  ``_RECV_VMEM_BYTES`` and the compute kernel's VMEM, the buffer in
  place of its chunk double buffer, fits the chip's share
  (``_VMEM_SHARE``) and the user's cap allows it (``_vmem.fused_vmem``).
  Elsewhere the HBM buffer stays."""
  spec = plan.spec
  if spec.recv_in_out or plan.panels > 1:
    return plan
  vm = dataclasses.replace(spec, recv_vmem=True)
  need = agk.vmem_bytes(vm)
  budget = int(vmem_capacity(device_kind) * _VMEM_SHARE)
  recv = agk.recv_bytes(vm)
  if need > budget or recv > _RECV_VMEM_BYTES or not _vmem.recv_allowed(recv):
    return plan
  vm = dataclasses.replace(vm, vmem_limit=_limit(need, device_kind))
  return dataclasses.replace(plan, spec=vm)


def _forwarded(plan: AgPlan, device_kind: str | None) -> AgPlan | None:
  """``plan`` with the antipode's halves relayed (``AgSpec.forward``:
  a 4-cycle, two directions, the receive buffer in VMEM, one panel,
  unquantized; not :func:`choose_split`'s pieces) where the compute
  kernel's VMEM, a second float32
  accumulator (the local step's, which the rest takes) included, fits
  the chip's share; None elsewhere."""
  s = plan.spec
  if not (
    plan.panels == 1
    and s.recv_vmem
    and s.n == 4
    and s.directions == 2
    and not s.quantized
  ):
    return None
  # The last half in pieces (``AgSpec.split``) is the start's last send;
  # relayed, it is not the start's: the relay goes whole.
  fwd = dataclasses.replace(s, forward=True, split=False)
  need = agk.vmem_bytes(fwd)
  if need > int(vmem_capacity(device_kind) * _VMEM_SHARE):
    return None
  fwd = dataclasses.replace(fwd, vmem_limit=_limit(need, device_kind))
  return dataclasses.replace(plan, spec=fwd)


def _in_out(plan: AgPlan) -> AgPlan:
  """``plan`` with its chunks landing in the result's own rows
  (``AgSpec.recv_in_out``: no receive buffer in HBM) where they fit and
  it runs one row panel. In panels the separate buffer stays: each
  panel's is ``1 / panels`` of it, within the memory target at every
  point of the Llama-3-70B sweep, and on v6e the form cost 10.3 us at tp
  4, M = 4096 in 4 panels (761.7 against 751.4: XLA prefetches ``x``
  into VMEM for each panel's start, which waits for it; 2.5 us at M =
  1024, one panel, 190.4 against 187.9, where it takes the 12.1 MiB
  buffer out of the HBM temporaries, over the target)."""
  spec = plan.spec
  rio = plan.panels == 1 and agk.recv_fits_out(spec)
  return dataclasses.replace(
    plan, spec=dataclasses.replace(spec, recv_in_out=rio)
  )


# The primitive -------------------------------------------------------------

allgather_matmul_p = jc.Primitive("asyncops_fused_allgather_matmul")


@allgather_matmul_p.def_abstract_eval
def _ag_abstract(x, w, **params):
  return x.update(
    shape=(x.shape[0], w.shape[1]),
    dtype=jnp.dtype(params["out_dtype"]),
    **jc.joint_manual_axes_kwargs([x, w]),
  )


def quantize(x, directions: int):
  """int8 codes and per-row scales of each half of ``x``'s columns.

  Returns:
    ``(q [m, k] int8, scales [d, m, 128] float32)``: for half ``c``,
    ``x[:, half c] ~ q[:, half c] * scales[c, :, 0:1]``, the scale being
    the row's largest magnitude over 127 (1 for an all-zero row). Halves
    are static column slices (a ``[m, d, k/d]`` reshape gives XLA a
    2-sublane layout it copies).
  """
  m, k = x.shape
  kh = k // directions
  codes, scales = [], []
  for c in range(directions):
    half = x[:, c * kh : (c + 1) * kh].astype(jnp.float32)
    top = jnp.max(jnp.abs(half), axis=1)
    scale = jnp.where(top > 0, top / 127, 1.0)
    q = jnp.clip(jnp.round(half * (1 / scale)[:, None]), -127, 127)
    codes.append(q.astype(jnp.int8))
    scales.append(jnp.broadcast_to(scale[:, None], (m, agk.SCALE_LANES)))
  q = codes[0] if directions == 1 else jnp.concatenate(codes, axis=1)
  return q, jnp.stack(scales)


def dequantize(q, scales):
  """``q * scale`` per row and half, float32 (the inverse of
  :func:`quantize` up to rounding)."""
  directions = scales.shape[0]
  kh = q.shape[1] // directions
  halves = [
    q[:, c * kh : (c + 1) * kh].astype(jnp.float32) * scales[c, :, :1]
    for c in range(directions)
  ]
  return halves[0] if directions == 1 else jnp.concatenate(halves, axis=1)


def _ag_reference(x, w, *, axis_name, out_dtype, precision, **params):
  """Every platform but TPU: ``all_gather(x) @ w`` with ``jnp.dot`` (for
  int8 transfers, of the dequantized chunks)."""
  if params.get("quantized"):
    x = dequantize(*quantize(x, params["directions"]))
    g = jax.lax.all_gather(x, axis_name, axis=1, tiled=True)
    y = jnp.dot(g, w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return y.astype(out_dtype)
  g = jax.lax.all_gather(x, axis_name, axis=1, tiled=True)
  acc = jnp.int32 if jnp.dtype(x.dtype) == jnp.int8 else None
  y = jnp.dot(
    g, w, preferred_element_type=acc, precision=jax.lax.Precision[precision]
  )
  return y.astype(out_dtype)


def _ag_tpu(
  x,
  w,
  *,
  axis_name,
  mesh_axes,
  n,
  directions,
  out_dtype,
  precision,
  collective_id,
  quantized=False,
  steps=None,
  forward=False,
):
  m, k = x.shape
  plan = plan_allgather(
    m,
    k,
    w.shape[1],
    n,
    x.dtype,
    w.dtype,
    out_dtype,
    directions=directions,
    precision=precision,
    device_kind=jc.tpu_device_kind(),
    axis_name=axis_name,
    mesh_axes=mesh_axes,
    collective_id=collective_id,
    quantized=quantized,
    steps=steps,
    forward=forward,
  )
  spec = _planned(plan, "allgather_matmul")
  scales = None
  if quantized:
    x, scales = quantize(x, spec.directions)
  x = x.astype(spec.dtype)

  def run(me, sp, shape, into):
    return agk.run(me, x, w, spec=sp, out_shape=shape, scales=scales, into=into)

  return _by_panels(run, plan, x, w, spec.f, out_dtype, axis_name)


def _planned(plan, fn: str):
  """``plan``'s kernel spec; a ``ValueError`` with its reason if none."""
  if plan.spec is None:
    raise ValueError(f"{fn}(method='fused'): {plan.reason}")
  return plan.spec


def _by_panels(run, plan, x, w, cols, out_dtype, axis_name):
  """``run(me, spec, out_shape, into)`` for each row panel of ``plan``, one
  after the other (each in a ``panel<p>`` scope), with ``spec.panel = p``:
  panel ``p``'s kernels read rows ``p m ..`` of the whole ``x`` and write
  its rows of one result ``[x rows, cols]``, taking the previous panel's
  result (``into``, aliased) and returning it written on. Neither is ``x``
  sliced nor the result concatenated."""
  me = jax.lax.axis_index(axis_name).astype(jnp.int32).reshape(1)
  shape = _common.shape_joint((x.shape[0], cols), jnp.dtype(out_dtype), x, w)
  out = None
  for p in range(plan.panels):
    with jax.named_scope(f"panel{p}"):
      out = run(me, dataclasses.replace(plan.spec, panel=p), shape, out)
  return out


def _assign_id(scope, params):
  pattern = ("ring_matmul", params["axis_name"], params["directions"])
  # Every fused ring kernel barriers with the same neighbours, so one id
  # per (axis, directions) is enough; they never run concurrently.
  cid = _common.collective_id(scope, pattern)
  return {**params, "collective_id": cid}


jc.register_lowering(allgather_matmul_p, _ag_reference, multiple_results=False)
jc.register_lowering(
  allgather_matmul_p,
  _ag_tpu,
  platform="tpu",
  multiple_results=False,
  prepare=_assign_id,
)


def allgather_matmul(
  lhs,
  rhs,
  axis_name: str,
  *,
  directions: int = 2,
  transfer: str = "native",
  steps: tuple[int, ...] | None = None,
  forward: bool = False,
):
  """``all_gather(lhs, axis_name, axis=1, tiled=True) @ rhs``, fused.

  Args:
    lhs: ``[m, k]`` per device.
    rhs: ``[n k, f]``.
    axis_name: the ring's mesh axis (size ``n >= 2``).
    directions: 2 (halves of each chunk travel both ways) or 1.
    transfer: ``"native"`` (chunks travel in their dtype; float32 at
      DEFAULT precision as bfloat16) or ``"int8"``: each half of each row
      of a chunk travels as int8 codes with one float32 scale (its largest
      magnitude / 127), a quarter of float32's bytes and half of
      bfloat16's. The result then equals ``all_gather(dequantize(
      quantize(lhs))) @ rhs``, not the exact product.
    steps: chunks the kernel multiplies per step, e.g. ``(1, 2, 1)`` on a
      ring of 4: the local chunk, then both neighbours' at once, then the
      antipode's (positive, summing to the ring size, the first 1). None
      (default) chooses from the shape (:func:`choose_steps`).
    forward: on a ring of 4, the neighbours relay the antipode's halves
      (``AgSpec.forward``: three halves on the busiest link, not four)
      where the kernel can; elsewhere ignored. Off by default.

  Returns:
    ``[m, f]`` in ``lhs.dtype``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import AxisType, PartitionSpec as P
    >>> mesh = jax.make_mesh((8,), ("y",), axis_types=(AxisType.Auto,))
    >>> @jax.jit
    ... @jax.shard_map(mesh=mesh, in_specs=(P(None, "y"), P(None, "y")),
    ...                out_specs=P(None, "y"))
    ... def f(a, w):
    ...   return allgather_matmul(a, w, "y")
    >>> a = jnp.arange(8.0 * 16).reshape(8, 16) % 5
    >>> w = jnp.arange(16.0 * 8).reshape(16, 8) % 3
    >>> bool((f(a, w) == a @ w).all())
    True
  """
  quantized = _transfer(transfer)
  n = int(jax.lax.axis_size(axis_name))
  steps = _steps_arg(steps, n)
  mesh = jax.sharding.get_abstract_mesh()
  return allgather_matmul_p.bind(
    lhs,
    rhs,
    axis_name=axis_name,
    mesh_axes=tuple(mesh.axis_names),
    n=n,
    directions=directions,
    out_dtype=jnp.dtype(lhs.dtype).name,
    precision=precision_name(),
    collective_id=None,
    quantized=quantized,
    steps=steps,
    forward=bool(forward),
  )


def _steps_arg(steps, n: int) -> tuple[int, ...] | None:
  """``steps`` checked against the ring size (a clear error, not a wrong
  result)."""
  if steps is None:
    return None
  try:
    st = tuple(int(g) for g in steps)
  except (TypeError, ValueError):
    st = ()
  if not st or sum(st) != n or st[0] != 1 or min(st) < 1:
    raise ValueError(
      f"allgather_matmul: steps must be positive ints summing to the ring "
      f"size {n}, the first 1 (the local chunk), got {steps!r}; e.g. "
      f"{(1,) * n} or {(1, n - 1)}, or None to choose from the shape."
    )
  return st


def _transfer(transfer) -> bool:
  if transfer not in ("native", "int8"):
    raise ValueError(
      f"allgather_matmul: transfer must be 'native' or 'int8', got "
      f"{transfer!r} ('int8': chunks travel as int8 with per-row "
      "scales)."
    )
  return transfer == "int8"


def ag_supported(
  m: int, k: int, f: int, n: int, dtype, directions: int, device_kind=None
):
  """``None`` if the fused all-gather matmul can run, else the reason."""
  plan = plan_allgather(
    m,
    k,
    f,
    n,
    dtype,
    dtype,
    dtype,
    directions=directions,
    precision=precision_name(),
    device_kind=device_kind,
  )
  return None if plan.spec is not None else plan.reason


# Reduce-scatter ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RsPlan:
  """How one matmul-reduce-scatter runs: kernel spec and row panels."""

  spec: rsk.RsSpec | None
  panels: int
  reason: str = ""


def plan_reducescatter(
  m: int,
  k: int,
  c: int,
  n: int,
  dtype,
  out_dtype,
  *,
  directions: int,
  precision: str,
  device_kind: str | None,
  axis_name: str = "",
  mesh_axes: tuple[str, ...] = (),
  collective_id: int | None = None,
) -> RsPlan:
  """Block size, panels and the receive buffer's memory space
  (``RsSpec.recv_vmem``, :data:`_RECV_VMEM_SHARE`) for ``[m, k] @ [k, n
  c] -> [m, c]``."""
  t = transfer_dtype(dtype, precision)
  if jnp.dtype(t) not in (
    jnp.dtype(jnp.bfloat16),
    jnp.dtype(jnp.float32),
    jnp.dtype(jnp.int8),
  ):
    return RsPlan(None, 0, f"dtype {jnp.dtype(dtype).name} has no MXU path")
  if n < 2:
    return RsPlan(None, 0, "axis of size 1")
  if c % directions or (c // directions) % 128:
    return RsPlan(
      None, 0, f"c/{directions} = {c / directions} is not a multiple of 128"
    )
  ch = c // directions
  bn = next(
    (
      b
      for b in (2048, 1536, 1024, 768, 512, 384, 256, 128)
      if ch % b == 0 and k * b * jnp.dtype(t).itemsize <= _W_BLOCK_BYTES
    ),
    None,
  )
  if bn is None:
    return RsPlan(None, 0, f"no w block of k = {k} rows fits VMEM")
  cap = vmem_capacity(device_kind)
  budget = int(cap * _VMEM_SHARE)
  sub = _sublanes(t)
  for panels in range(1, m + 1):
    if m % panels:
      continue
    rows = m // panels
    if rows % sub and panels > 1:
      continue
    spec = rsk.RsSpec(
      axis_name=axis_name,
      mesh_axes=mesh_axes,
      n=n,
      m=rows,
      k=k,
      c=c,
      dtype=t,
      out_dtype=jnp.dtype(out_dtype).name,
      directions=directions,
      bn=bn,
      precision=precision,
      collective_id=collective_id,
    )
    need = rsk.vmem_bytes(spec)
    sent = (n - 1) * directions * rows * ch * jnp.dtype(t).itemsize
    if need <= budget and sent <= _SENT_BYTES:
      return RsPlan(_rs_recv_space(spec, cap), panels)
    if rows <= sub:
      break
  return RsPlan(None, 0, f"x rows of {k} columns do not fit VMEM")


def _rs_recv_space(spec: rsk.RsSpec, cap: int) -> rsk.RsSpec:
  """``spec`` with its steps kernel's scoped limit and its receive
  buffer's memory space: in VMEM with the roomy limit
  (``rsk.steps_vmem_limit``) where the VMEM in use then is within
  :data:`_RECV_VMEM_SHARE` of ``cap``, else with the tight limit (the
  scoped area alone) where that fits (branch h-rsvmem: the Llama-3-70B
  shard's tp 4, M >= 1024 on v5e and v6e, 117.25 -> 87.25 MiB of 128;
  M >= 512 on v5p, 65.0 -> 50.0 of 64), else in HBM with the roomy
  limit; in HBM too where the user's cap does not allow it
  (``_vmem.fused_vmem``)."""
  allowed = _vmem.recv_allowed(rsk.recv_bytes(spec))
  for room in (True, False):
    limit = rsk.steps_vmem_limit(spec, cap, room=room)
    s = dataclasses.replace(spec, vmem_limit=limit)
    fits = rsk.resident_vmem_bytes(s, recv_vmem=True) <= _RECV_VMEM_SHARE * cap
    if fits and allowed:
      return dataclasses.replace(s, recv_vmem=True)
  roomy = rsk.steps_vmem_limit(spec, cap)
  return dataclasses.replace(spec, vmem_limit=roomy, recv_vmem=False)


reducescatter_matmul_p = jc.Primitive("asyncops_fused_reducescatter_matmul")


@reducescatter_matmul_p.def_abstract_eval
def _rs_abstract(x, w, **params):
  cols = w.shape[1] // params["n"]
  return x.update(
    shape=(x.shape[0], cols),
    dtype=jnp.dtype(params["out_dtype"]),
    **jc.joint_manual_axes_kwargs([x, w]),
  )


def _rs_reference(x, w, *, axis_name, out_dtype, precision, **_):
  """Every platform but TPU: ``psum_scatter(x @ w)`` with ``jnp.dot``."""
  acc = jnp.int32 if jnp.dtype(x.dtype) == jnp.int8 else None
  y = jnp.dot(
    x, w, preferred_element_type=acc, precision=jax.lax.Precision[precision]
  )
  y = jax.lax.psum_scatter(y, axis_name, scatter_dimension=1, tiled=True)
  return y.astype(out_dtype)


def _rs_tpu(
  x,
  w,
  *,
  axis_name,
  mesh_axes,
  n,
  directions,
  out_dtype,
  precision,
  collective_id,
):
  m, k = x.shape
  plan = plan_reducescatter(
    m,
    k,
    w.shape[1] // n,
    n,
    x.dtype,
    out_dtype,
    directions=directions,
    precision=precision,
    device_kind=jc.tpu_device_kind(),
    axis_name=axis_name,
    mesh_axes=mesh_axes,
    collective_id=collective_id,
  )
  spec = _planned(plan, "matmul_reducescatter")
  x = x.astype(spec.dtype)

  after = [None]  # the previous row panel's done token

  def run(me, sp, shape, into):
    if plan.panels > 1:
      # Pinned to HBM: XLA otherwise kept the panels' result in VMEM
      # where it fits (v5e, 16 MiB at the Llama-3-70B shard's tp 4, M =
      # 4096) and copied it out after the last panel.
      shape = _common.hbm_like(shape)
    # Each panel's start after the previous panel's done: else XLA gave a
    # panel's sent partial sums' VMEM to the next panel while its last
    # sends were in flight (branch h-rsrace).
    out, after[0] = rsk.run(
      me, x, w, spec=sp, out_shape=shape, into=into, after=after[0]
    )
    return out

  return _by_panels(run, plan, x, w, spec.c, out_dtype, axis_name)


jc.register_lowering(
  reducescatter_matmul_p, _rs_reference, multiple_results=False
)
jc.register_lowering(
  reducescatter_matmul_p,
  _rs_tpu,
  platform="tpu",
  multiple_results=False,
  prepare=_assign_id,
)


def matmul_reducescatter(lhs, rhs, axis_name: str, *, directions: int = 2):
  """``psum_scatter(lhs @ rhs, axis_name, scatter_dimension=1, tiled=True)``,
  fused.

  Args:
    lhs: ``[m, k]`` per device.
    rhs: ``[k, n c]``.
    axis_name: the ring's mesh axis (size ``n >= 2``).
    directions: 2 (halves of each block travel both ways) or 1.

  Returns:
    ``[m, c]`` in ``lhs.dtype``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import AxisType, PartitionSpec as P
    >>> mesh = jax.make_mesh((8,), ("y",), axis_types=(AxisType.Auto,))
    >>> @jax.jit
    ... @jax.shard_map(mesh=mesh, in_specs=(P(None, "y"), P("y", None)),
    ...                out_specs=P(None, "y"))
    ... def f(h, w2):
    ...   return matmul_reducescatter(h, w2, "y")
    >>> h = jnp.arange(8.0 * 16).reshape(8, 16) % 5
    >>> w2 = jnp.arange(16.0 * 8).reshape(16, 8) % 3
    >>> bool((f(h, w2) == h @ w2).all())
    True
  """
  n = int(jax.lax.axis_size(axis_name))
  mesh = jax.sharding.get_abstract_mesh()
  return reducescatter_matmul_p.bind(
    lhs,
    rhs,
    axis_name=axis_name,
    mesh_axes=tuple(mesh.axis_names),
    n=n,
    directions=directions,
    out_dtype=jnp.dtype(lhs.dtype).name,
    precision=precision_name(),
    collective_id=None,
  )


def matmul_allreduce(lhs, rhs, axis_name: str, *, directions: int = 2):
  """``psum(lhs @ rhs, axis_name)``: the fused matmul-reduce-scatter, then
  XLA's all-gather of the reduced column blocks (no matmul is left to hide
  it behind). Columns that do not divide the axis size are padded.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import AxisType, PartitionSpec as P
    >>> mesh = jax.make_mesh((8,), ("y",), axis_types=(AxisType.Auto,))
    >>> @jax.jit
    ... @jax.shard_map(mesh=mesh, in_specs=(P(None, "y"), P("y", None)),
    ...                out_specs=P())
    ... def f(a, w):
    ...   return matmul_allreduce(a, w, "y")
    >>> a = jnp.arange(8.0 * 16).reshape(8, 16) % 5
    >>> w = jnp.arange(16.0 * 12).reshape(16, 12) % 3  # 12: padded to 16
    >>> bool((f(a, w) == a @ w).all())
    True
  """
  n = int(jax.lax.axis_size(axis_name))
  f = rhs.shape[1]
  pad = -f % n
  if pad:
    rhs = jnp.pad(rhs, ((0, 0), (0, pad)))
  block = matmul_reducescatter(lhs, rhs, axis_name, directions=directions)
  out = jc.all_gather_invariant(block, axis_name, axis=1, tiled=True)
  return out[:, :f] if pad else out


def rs_supported(
  m: int, k: int, c: int, n: int, dtype, directions: int, device_kind=None
):
  """``None`` if the fused matmul-reduce-scatter can run, else the reason."""
  plan = plan_reducescatter(
    m,
    k,
    c,
    n,
    dtype,
    dtype,
    directions=directions,
    precision=precision_name(),
    device_kind=device_kind,
  )
  return None if plan.spec is not None else plan.reason


# Their JVP and transpose rules (a module of their own; needs the above).
from asyncops.collective_matmul import _fused_ad  # noqa: E402, F401

__all__ = [
  "rs_supported",
  "allgather_matmul",
  "matmul_allreduce",
  "matmul_reducescatter",
  "plan_allgather",
  "plan_reducescatter",
  "ag_supported",
]
