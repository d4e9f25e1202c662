"""All-gather collective matmul: ``all_gather(lhs, gather_dim) @ rhs``.

The public function validates, picks a method (``_auto``: the fused ring
kernel, XLA's collective, or the value/Ref-API ring), folds ``lhs`` into
one of two canonical shapes (``_layout``: gathering the contracting
dimension, or gathering a row dimension) and runs the matching ring
(``_gather_rings``) or kernel (``_fused``); the results are unfolded by
reshapes. See those modules for the algorithms.
"""

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from asyncops.collective_matmul import (
  _auto,
  _fused,
  _gather_rings,
  _layout,
  _quantized,
  _validate,
  _vjp,
)


def allgather_matmul(
  lhs,
  rhs,
  axis_name: str,
  *,
  gather_dim: int = -1,
  return_gathered: bool = False,
  api: _validate.Api = "value",
  bidirectional: bool = False,
  transfer: _quantized.Transfer = "native",
  method: _auto.Method = "auto",
  accumulation: _validate.Accumulation = "float32",
  memory: _validate.Memory = "fastest",
):
  """All-gathers ``lhs`` along ``gather_dim`` and multiplies by ``rhs``.

  Equals ``[jax.lax.all_gather(lhs, axis_name, axis=gather_dim,
  tiled=True) @ w for w in rhs]``, with the gather hidden behind the chunk
  matmuls: each of the ``n - 1`` ring transfers runs while the previous
  chunk is multiplied, and nothing is gathered in full.

  Two forms, chosen by ``gather_dim``:

  - ``-1`` (default), the contracting dimension: the chapter's
    ``A[B_X, D_Y] * W[D, F_Y] -> Out[B_X, F_Y]``; ``rhs`` holds every
    contracting row (``[n k, f]``) and the chunk products accumulate.
  - a leading (row, token) dimension, e.g. ``0`` for ``[s/n, d]`` or ``1``
    for ``[b, s/n, d]``: sequence parallelism,
    ``X[S_Y, D] * W[D, F_Y] -> Out[S, F_Y]``; ``rhs`` is whole along the
    contracting dimension (``[k, f]``) and every arriving chunk produces
    its own output rows.

  Several weights share one ring (one gather for all): pass a list, e.g.
  ``(w_q, w_k, w_v)`` or ``(w_gate, w_up)``.

  Call it inside ``jax.shard_map`` (manual over every mesh axis); shapes
  are per device.

  Args:
    lhs: ``[..., k]``, any rank >= 1, contracting dimension last; this
      device's slice along ``gather_dim``.
    rhs: a weight matrix or a non-empty list/tuple of them, each
      ``[n * k, f_i]`` (``gather_dim`` is the contracting one) or
      ``[k, f_i]`` (a row dimension), where ``n`` is the size of
      ``axis_name``. Same dtype as ``lhs``.
    axis_name: the mesh axis ``lhs`` is sharded over along ``gather_dim``.
    gather_dim: the dimension of ``lhs`` to gather (negative counts from
      the end). The default ``-1`` is the contracting dimension.
    return_gathered: also return the gathered ``lhs``
      (``all_gather(lhs, axis=gather_dim, tiled=True)``), assembled from
      the chunks as they pass, without a second gather (for a backward
      pass, or a residual).
    api: ``"value"`` (futures) or ``"ref"`` (double-buffered Refs,
      ``asyncops.stateful``); same result and schedule.
    bidirectional: send half of every chunk each way around the ring;
      halves the bytes per link per step. The contracting form halves the
      rows (their number must be even); a row form halves the dimensions
      before ``gather_dim`` if even, else the rows of a chunk.
    transfer: how chunks travel. ``"native"``: in ``lhs.dtype``.
      ``"int8"`` or ``"float8_e4m3fn"``: each row of a chunk as 1-byte
      codes with one float32 scale (``max|row| / 127`` or ``/ 448``),
      about half of bfloat16's bytes; **the result is then that of the
      dequantized lhs** (``all_gather(q * s) @ w``, ``_quantized``), not
      the exact product. Floating ``lhs`` and ``return_gathered=False``
      only, either form; it always runs the ring (``method`` ``"auto"``
      or ``"ring"``). **Derivatives are straight-through the quantizer**
      (``d lhs`` as for ``transfer="native"``, ``d rhs`` of the
      dequantized lhs).
    method: how (``asyncops.collective_matmul._auto``): ``"auto"``
      (default) picks from the per-device shapes, dtype, ring size and chip
      between the fused ring kernel (``"fused"``: one Pallas kernel, the
      accumulator in VMEM, both ring directions; the contracting form with
      one weight and no ``return_gathered``; ``"auto"`` may run it with
      the antipode's halves relayed, ``forward=True``, on a ring of 4
      where that is estimated faster), XLA's collective then
      ``jnp.dot`` (``"xla"``: where the matmul is bound by reading the
      weights, decode-size rows, or the fused kernel is not faster) and,
      for the forms the fused kernel does not run, the ring of
      ``start``/``done`` futures around XLA's chunk matmuls (``"ring"``).
      **``api="ref"`` and ``bidirectional=True`` configure the ring**:
      with ``"auto"`` they run it, with ``"fused"`` or ``"xla"`` they are
      an error. Every method differentiates (the fused kernel with the
      ring's backward).
      **The ring copies an ``lhs`` that is a parameter of the jitted
      function** once before its first transfer (its start kernel aliases
      the buffer it sends; donating does not help): 16 MiB, 41 us of a
      2743 us step at the Llama-3-70B MLP shard (v5e, ring of 4, 4096
      rows). A computed ``lhs`` (a model's activation) is sent in place;
      the fused kernel and ``"xla"`` do not copy it.
    accumulation: what the chunk products add up in (the contracting
      form, ``gather_dim=-1``; a row form has nothing to accumulate).
      ``"float32"`` (default): a float32 accumulator for floating
      ``lhs``, rounded once to ``lhs.dtype`` at the end. ``"output"``:
      XLA's windowed einsum's numerics, opt-in: each chunk's dot
      produces ``lhs.dtype`` and is added into an accumulator of
      ``lhs.dtype``, so with bfloat16 ``lhs`` the ring's accumulator is
      bfloat16 (half the bytes through HBM at every step, faster where
      that pass is what a step costs) and **rounds at every step**: an
      error that grows with the ring size (a few bfloat16 ulps at 8).
      It permits, does not require, that rounding: the fused kernel
      (its accumulator stays in VMEM in float32), ``method="xla"`` (one
      dot) and the two-way ring when ``method="auto"`` picks it (it was
      slower with a bfloat16 accumulator at some shapes) and the
      ``api="ref"`` two-way ring of halves (its accumulator halves sit
      in VMEM; in bfloat16 it is slower on v5e, and on v6e at the
      prefill shape) still round once; ``method="ring"`` rings (one- or two-way)
      and auto's one-way ring, whose estimate then charges the narrower
      accumulator, use it. float32 and integer ``lhs`` are unchanged
      (their accumulator is already ``lhs.dtype``: integers add exactly,
      wrapping as ``jnp.dot`` does); quantized ``transfer`` and the
      backward pass (gradients) keep float32.
    memory: what ``method="auto"`` weighs besides time. ``"fastest"``
      (default): the fastest candidate by estimate. ``"jit"``: also the
      fused kernels' HBM receive slots against the memory target, peak
      temporaries within ``jax.jit``'s (XLA's own program) plus one
      chunk's send and receive buffers; where a fused pick is over it,
      auto runs XLA's program or a value ring instead (XLA's program
      where the matmul is bound by its weight read). The fused kernels
      keep their receive slots in VMEM where they fit, so the default
      meets the target at all 72 points of the benchmark's Llama-3-70B
      MLP sweep (v5e, v6e, v5p) and ``"jit"`` moves a pick only where
      the slots stay in HBM (row panels, larger rows). **There it costs
      speed**: before
      the VMEM slots, ``"jit"`` took auto at 20 sweep points from
      0.48x-0.95x of the best XLA program's time to 0.74x-1.00x. Other
      methods ignore it. **VMEM of your own**: the slots in VMEM (up to
      14 MiB per device at the Llama shard's tp 8, 1024 rows) stay
      there across the kernels; a program that keeps a large buffer of
      its own in VMEM across this call (a Pallas kernel's VMEM output
      read after it) can then be refused by XLA (``RESOURCE_EXHAUSTED:
      ... CompileTimeScopedVmemOom``, e.g. 64 MiB of 128 on v5e, 72 on
      v6e, at that shape) where HBM slots compiled. Lower it inside
      :func:`fused_vmem` with ``recv_max_bytes=0`` (slots in HBM, same
      results), or compile with ``asyncops.jit``, which retries so with
      a :class:`FusedVmemWarning`.

  Returns:
    One array per weight, ``lhs.shape`` with ``gather_dim`` multiplied by
    ``n`` (row form) and the last dimension replaced by ``f_i``, in
    ``lhs.dtype``: a single array if ``rhs`` is one, else a tuple. With
    ``return_gathered=True``, ``(result, gathered_lhs)``. With an axis of
    size 1, plain local matmuls.

  Raises:
    ValueError: ``rhs`` is not rank 2, the contracting sizes disagree (the
      message says which form ``gather_dim`` selected), ``gather_dim`` is
      not an axis of ``lhs``, the halves are impossible with
      ``bidirectional=True``, an empty ``rhs`` list, an unknown ``api``,
      ``method``, ``transfer``, ``accumulation`` or ``memory``; ring
      options with ``method="fused"``/``"xla"``, ``method="fused"`` for a
      form it does not run; a quantized ``transfer`` with ``return_gathered`` or
      ``method="fused"``/``"xla"``.
    TypeError: mismatched or non-movable dtypes; a quantized
      ``transfer`` of an integer ``lhs``.
    NameError: ``axis_name`` is not bound.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import AxisType, PartitionSpec as P
    >>> from asyncops.collective_matmul import allgather_matmul
    >>> mesh = jax.make_mesh((8,), ("y",), axis_types=(AxisType.Auto,))
    >>> # Sequence parallel, gated: x [s/n, d], w_gate and w_up [d, f/n].
    >>> @jax.jit
    ... @jax.shard_map(mesh=mesh, in_specs=(P("y"), P(None, "y"),
    ...                P(None, "y")), out_specs=P(None, "y"))
    ... def f(x, w_gate, w_up):
    ...   g, u = allgather_matmul(x, (w_gate, w_up), "y", gather_dim=0)
    ...   return jax.nn.silu(g) * u
    >>> x = jnp.arange(16.0 * 8).reshape(16, 8) % 5
    >>> w_gate = jnp.ones((8, 16)) / 8
    >>> w_up = jnp.arange(8.0 * 16).reshape(8, 16)
    >>> want = jax.nn.silu(x @ w_gate) * (x @ w_up)
    >>> bool(jnp.allclose(f(x, w_gate, w_up), want))
    True
  """
  fn = "allgather_matmul"
  _validate.api(api, fn)
  accumulation = _validate.accumulation(accumulation, fn)
  memory = _validate.memory(memory, fn)
  _validate.operand(lhs, fn, "lhs", matrix=False)
  if _gather_rings.accumulator_dtype(
    lhs.dtype, accumulation
  ) == _gather_rings.accumulator_dtype(lhs.dtype):
    accumulation = "float32"  # float32, integers: the same accumulator
  ws, names, single = _validate.weights(rhs, lhs, fn)
  n = _validate.axis(axis_name, fn)
  rank = len(lhs.shape)
  dim = _validate.dim(
    gather_dim,
    rank,
    fn,
    "gather_dim",
    "Use -1 for the contracting dimension (the default) or the row/token "
    "dimension lhs is sharded along (e.g. 0 for [s/n, d]).",
  )
  fold = _layout.Fold(tuple(lhs.shape), dim, n)
  _check_weights(lhs, ws, names, fold, fn)
  if bidirectional:
    if fold.rows_form:
      _validate.halvable(fold.p, fold.r, fn, "lhs", f"gather_dim={dim}")
    else:
      _validate.even_rows(fold.m, fn, "lhs")
  bidirectional = bool(bidirectional)
  transfer = _quantized.check(
    transfer,
    fn,
    lhs,
    rows_form=fold.rows_form,
    return_gathered=return_gathered,
  )
  if transfer != "native":
    _quantized.require_ring(transfer, method, fn)
    return _quantized_path(
      lhs, ws, single, fold, axis_name, n, api, bidirectional, transfer
    )
  run = _auto.pick(
    method,
    fn,
    ring_options=_auto.ring_options(api, bidirectional),
    unfused=_unfused(fold, ws, return_gathered),
    explain=lambda: _auto.explain_allgather(
      fold.m,
      fold.k,
      ws[0].shape[1],
      n,
      lhs.dtype,
      precision=_fused.precision_name(),
      device_kind=_auto.device_kind(),
      wiring=_auto.wiring(axis_name),
      accumulation=accumulation,
      memory=memory,
    ),
    explain_unfused=lambda why: _auto.explain_ring(
      2 * n * lhs.size * sum(w.shape[1] for w in ws),
      sum(w.size for w in ws) * jnp.dtype(lhs.dtype).itemsize,
      lhs.dtype,
      precision=_fused.precision_name(),
      device_kind=_auto.device_kind(),
      why=why,
    ),
  )
  if run == "ring_bidi":  # auto's two-way ring (even rows, checked)
    run, bidirectional = "ring", True
    # Auto's two-way ring keeps float32: with a bfloat16 accumulator it
    # was slower at points auto takes it (v5e tp 8, M = 1024: 437.8 us
    # against 362.0; v6e tp 8, M = 4096: 738.2 against 444.7;
    # design/benchmarks.md). "output" permits the rounding, it does not
    # require it; method="ring" runs the two-way ring as asked.
    accumulation = "float32"
  if n == 1:
    outs = tuple(jnp.dot(lhs, w, preferred_element_type=lhs.dtype) for w in ws)
    gathered = lhs
  elif run == "xla":
    with jax.named_scope(fn), jax.named_scope("method_xla"):
      if jnp.issubdtype(lhs.dtype, jnp.inexact):
        # JAX's gradient, reordered so the weights' data-parallel
        # all-reduce overlaps the input gradient (_vjp.xla_allgather).
        outs, gathered = _vjp.xla_allgather(
          lhs, tuple(ws), axis_name, dim % len(lhs.shape)
        )
      else:
        gathered = jax.lax.all_gather(lhs, axis_name, axis=dim, tiled=True)
        outs = tuple(_auto.dot(gathered, w) for w in ws)
  elif run in ("fused", "fused_fwd"):  # auto's relay: fused_fwd
    kernel = {
      "fused": _vjp.fused_allgather,
      "fused_fwd": _vjp.fused_allgather_fwd,
    }[run]
    with jax.named_scope(fn), jax.named_scope(f"method_{run}"):
      out = kernel(fold.fold(lhs), ws[0], axis_name, n)
      outs, gathered = (fold.unfold(out, ws[0].shape[1]),), None
  else:
    with jax.named_scope(fn):
      outs, gathered = canonical(
        fold.rows_form,
        fold.fold(lhs),
        ws,
        axis_name,
        n=n,
        api=api,
        bidirectional=bidirectional,
        return_gathered=return_gathered,
        accumulation=accumulation,
      )
      outs = tuple(
        fold.unfold(o, w.shape[1]) for o, w in zip(outs, ws, strict=True)
      )
      if gathered is not None:
        gathered = fold.unfold(gathered, gathered.shape[-1])
  result = outs[0] if single else outs
  return (result, gathered) if return_gathered else result


def _quantized_path(lhs, ws, single, fold, axis_name, n, api, bidi, transfer):
  """``transfer="int8"`` / ``"float8_e4m3fn"``: the quantized ring
  (``_quantized``), differentiable straight through the quantizer."""
  x = fold.fold(lhs)
  with jax.named_scope(f"allgather_matmul_{transfer}"):
    if n == 1:
      outs = _quantized.local(x, ws, transfer)
    else:
      options = dict(n=n, api=api, bidirectional=bidi, transfer=transfer)
      outs = _quantized.gather(
        fold.rows_form, x, tuple(ws), axis_name, tuple(sorted(options.items()))
      )
  outs = tuple(
    fold.unfold(o, w.shape[1]) for o, w in zip(outs, ws, strict=True)
  )
  return outs[0] if single else outs


def _unfused(fold: _layout.Fold, ws: tuple, return_gathered: bool):
  """Why the fused kernel cannot run this call (None: it can)."""
  if fold.rows_form:
    return (
      f"gather_dim={fold.dim} gathers a row dimension (the fused kernel "
      "gathers the contracting one, gather_dim=-1)"
    )
  if len(ws) > 1:
    return f"{len(ws)} weights share one gather (the fused kernel takes one)"
  if return_gathered:
    return "return_gathered=True (the fused kernel keeps no gathered lhs)"
  return None


def canonical(rows_form: bool, x, ws: tuple, axis_name: str, **options):
  """Runs the canonical ring: ``x [P, R, k]`` (rows) or ``[M, k]``.

  The seam between the public function (validation, folding) and the
  implementations: ``options`` are ``n``, ``api``, ``bidirectional``,
  ``return_gathered`` and ``accumulation``; returns ``(outs, gathered)``
  as the rings do.
  """
  # Differentiable with the backward on our own rings (``_vjp``).
  return _vjp.gather(
    rows_form,
    x,
    ws,
    axis_name,
    options["api"],
    options["bidirectional"],
    options["n"],
    options.get("return_gathered", False),
    options.get("accumulation", "float32"),
  )


def _check_weights(lhs, ws: Sequence, names, fold: _layout.Fold, fn: str):
  """Every weight's rows match the contracting size of ``fold``'s form."""
  k, n = fold.k, fold.n
  for w, name in zip(ws, names, strict=True):
    if fold.rows_form:
      if w.shape[0] == k:
        continue
      why = (
        f"with gather_dim={fold.dim} (a row dimension) lhs's contracting "
        f"dimension is whole on every device, so {name} needs k = {k} rows"
      )
      if w.shape[0] == n * k:
        why += " (it has n * k: did you mean gather_dim=-1?)"
    else:
      if w.shape[0] == n * k:
        continue
      why = (
        f"with gather_dim={fold.dim} (the contracting dimension) {name} "
        f"needs every contracting row, {name}.shape[0] = n * k = {n * k}"
      )
      if w.shape[0] == k and len(fold.shape) > 1:
        why += (
          " (it has k: to gather rows instead, pass the row dimension, "
          "e.g. gather_dim=0)"
        )
    raise ValueError(
      f"{fn}: {name}.shape[0] = {w.shape[0]} does not match lhs "
      f"{tuple(lhs.shape)}: {why}. Check the shard_map in_specs."
    )
