"""Reduce-scatter collective matmul: ``psum_scatter(lhs @ rhs, dim)``.

The public function validates, picks a method (``_auto``: the fused ring
kernel, XLA's collective, or the value/Ref-API ring), folds ``lhs`` into
one of two canonical shapes (``_layout``: scattering the output columns,
or scattering a row dimension) and runs the matching ring
(``_scatter_rings``) or kernel (``_fused``); the result is unfolded by a
reshape. See those modules for the algorithms.
"""

import jax
import jax.numpy as jnp

from asyncops.collective_matmul import (
  _auto,
  _fused,
  _layout,
  _quantized,
  _quantized_scatter,
  _validate,
  _vjp,
)


def matmul_reducescatter(
  lhs,
  rhs,
  axis_name: str,
  *,
  scatter_dim: int = -1,
  api: _validate.Api = "value",
  bidirectional: bool = False,
  transfer: _quantized.Transfer = "native",
  method: _auto.Method = "auto",
  memory: _validate.Memory = "fastest",
):
  """Multiplies ``lhs @ rhs`` and reduce-scatters along ``scatter_dim``.

  Equals ``jax.lax.psum_scatter(lhs @ rhs, axis_name,
  scatter_dimension=scatter_dim, tiled=True)``, with each hop of the
  reduce-scatter hidden behind the next chunk matmul. Only partial sums
  move, never ``lhs`` or ``rhs``.

  Two forms, chosen by ``scatter_dim`` (a dimension of the result, which
  has ``lhs``'s rank):

  - ``-1`` (default), the output columns: the chapter's down projection
    ``Tmp[B_X, F_Y] * W2[F_Y, D] -> Out[B_X, D_Y]``.
  - a leading (row, token) dimension, e.g. ``0`` for ``[s, f/n]`` or ``1``
    for ``[b, s, f/n]``: sequence parallelism,
    ``Tmp[S, F_Y] * W2[F_Y, D] -> Out[S_Y, D]``.

  Call it inside ``jax.shard_map`` (manual over every mesh axis); shapes
  are per device.

  Args:
    lhs: ``[..., k]``, any rank >= 1, this device's slice of the
      contracting dimension (last). With a row ``scatter_dim``,
      ``lhs.shape[scatter_dim]`` must be divisible by ``n``, the size of
      ``axis_name``.
    rhs: ``[k, f]``, the matching rows; with ``scatter_dim=-1`` ``f`` must
      be divisible by ``n``. Same dtype as ``lhs``.
    axis_name: the mesh axis to reduce over.
    scatter_dim: the dimension of the result to scatter (negative counts
      from the end). The default ``-1`` is the columns.
    api: ``"value"`` (futures) or ``"ref"`` (double-buffered Refs,
      ``asyncops.stateful``); same result and schedule.
    bidirectional: send the partial sums of half of every block each way
      around the ring. The column form halves the rows (their number must
      be even); a row form halves the dimensions before ``scatter_dim`` if
      even, else the rows of a block.
    method: how: ``"auto"`` (default) picks from the per-device shapes,
      dtype, ring size and chip between the fused ring kernel
      (``"fused"``, the column form only: partial sums leave as they are
      made, the accumulator in VMEM), XLA's matmul then
      ``psum_scatter`` (``"xla"``) and, for the row form, the ring of
      ``start``/``done`` futures (``"ring"``); see
      :func:`allgather_matmul`. ``"auto"`` may also run the fused kernel
      with its partial sums sent one way round the ring (where it is
      estimated faster: v6e at the prefill shape, where XLA prefetches
      ``x`` into VMEM before the two-way kernel only) or the one- or
      two-way ring. **``api="ref"`` and
      ``bidirectional=True`` configure the ring** (``"auto"`` then runs
      it). Every method differentiates.
    memory: ``"fastest"`` (default) or ``"jit"``: with ``"jit"``,
      ``method="auto"`` drops the fused kernel where its receive slots
      in HBM put the peak temporaries over jit's plus one chunk's
      buffers. The fused kernel keeps them in VMEM where they fit (the
      Llama sweep's tp 8 and tp 4 M <= 512 on v5e and v6e), within the
      target, so ``"jit"`` changes nothing there; where they stay in
      HBM (tp 4, M >= 1024) **it costs speed**; see
      :func:`allgather_matmul`. A program keeping VMEM of its own
      across this call (32 MiB of 128 on v5e at the Llama shard's tp 8,
      1024 rows) can be refused by XLA for VMEM: lower it inside
      :func:`fused_vmem` with ``recv_max_bytes=0`` or compile with
      ``asyncops.jit`` (see :func:`allgather_matmul`).

  Returns:
    ``lhs.shape[:-1] + (f,)`` with ``scatter_dim`` divided by ``n``, in
    ``lhs.dtype``: block ``axis_index`` of the sum. With an axis of size
    1, a plain local matmul.

  Raises:
    ValueError: ``rhs`` is not rank 2, the contracting sizes differ, the
      scattered size is not divisible by ``n``, ``scatter_dim`` is not a
      dimension of the result, the halves are impossible with
      ``bidirectional=True``, an unknown ``api``, ``method`` or
      ``memory``, ring
      options with ``method="fused"``/``"xla"``, or ``method="fused"``
      with a row ``scatter_dim``; an unknown ``transfer``, or a quantized
      one with ``method="fused"``/``"xla"``.
    TypeError: mismatched or non-movable dtypes; a quantized ``transfer``
      of an integer ``lhs``.
    NameError: ``axis_name`` is not bound.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import AxisType, PartitionSpec as P
    >>> from asyncops.collective_matmul import matmul_reducescatter
    >>> mesh = jax.make_mesh((8,), ("y",), axis_types=(AxisType.Auto,))
    >>> @jax.jit
    ... @jax.shard_map(mesh=mesh, in_specs=(P(None, "y"), P("y", None)),
    ...                out_specs=P("y", None))
    ... def f(h, w2):  # h [s, f/n] -> [s/n, d]
    ...   return matmul_reducescatter(h, w2, "y", scatter_dim=0)
    >>> h = jnp.arange(16.0 * 32).reshape(16, 32) % 7
    >>> w2 = jnp.arange(32.0 * 8).reshape(32, 8) % 3
    >>> bool((f(h, w2) == h @ w2).all())
    True
  """
  fn = "matmul_reducescatter"
  n = _validate.matmul_operands(lhs, rhs, axis_name, api, fn)
  memory = _validate.memory(memory, fn)
  _validate.contracting(lhs, rhs, fn, lhs.shape[-1])
  rank = len(lhs.shape)
  dim = _validate.dim(
    scatter_dim,
    rank,
    fn,
    "scatter_dim",
    "Use -1 for the output columns (the default) or the row/token "
    "dimension to scatter (e.g. 0 for [s, f/n] -> [s/n, d]).",
  )
  fold = _layout.Fold(tuple(lhs.shape), dim, n, scatter=True)
  if fold.rows_form:
    if lhs.shape[dim] % n:
      raise ValueError(
        f"{fn}: lhs.shape[{dim}] = {lhs.shape[dim]} (scatter_dim={dim}) is "
        f"not divisible by the size {n} of axis {axis_name!r}, so the "
        "result cannot be scattered in equal row blocks (as "
        f"psum_scatter(tiled=True) requires). Pad lhs along dimension {dim} "
        f"to a multiple of {n}."
      )
  elif rhs.shape[1] % n:
    raise ValueError(
      f"{fn}: rhs.shape[1] = {rhs.shape[1]} is not divisible by the size "
      f"{n} of axis {axis_name!r}, so the result cannot be scattered in "
      "equal column blocks (as psum_scatter(tiled=True) requires). Pad "
      f"rhs's columns to a multiple of {n}, or use matmul_allreduce, which "
      "pads for you."
    )
  if bidirectional:
    if fold.rows_form:
      _validate.halvable(fold.p, fold.r, fn, "lhs", f"scatter_dim={dim}")
    else:
      _validate.even_rows(fold.m, fn, "lhs")
  transfer = _quantized.check(transfer, fn, lhs)
  if transfer != "native":
    _quantized.require_ring(transfer, method, fn)
    return _quantized_path(
      lhs, rhs, fold, axis_name, n, api, bool(bidirectional), transfer
    )
  unfused = None
  if fold.rows_form:
    unfused = (
      f"scatter_dim={dim} scatters a row dimension (the fused kernel "
      "scatters the columns, scatter_dim=-1)"
    )
  run = _auto.pick(
    method,
    fn,
    ring_options=_auto.ring_options(api, bool(bidirectional)),
    unfused=unfused,
    explain=lambda: _auto.explain_reducescatter(
      fold.m,
      fold.k,
      rhs.shape[1] // n,
      n,
      lhs.dtype,
      precision=_fused.precision_name(),
      device_kind=_auto.device_kind(),
      wiring=_auto.wiring(axis_name),
      memory=memory,
    ),
    explain_unfused=lambda why: _auto.explain_ring(
      2 * lhs.size * rhs.shape[1],
      rhs.size * jnp.dtype(rhs.dtype).itemsize,
      lhs.dtype,
      precision=_fused.precision_name(),
      device_kind=_auto.device_kind(),
      why=why,
    ),
  )
  if run == "ring_bidi":  # auto's two-way ring (even rows, checked)
    run, bidirectional = "ring", True
  if n == 1:
    return jnp.dot(lhs, rhs, preferred_element_type=lhs.dtype)
  if run == "xla":
    with jax.named_scope(fn), jax.named_scope("method_xla"):
      return jax.lax.psum_scatter(
        _auto.dot(lhs, rhs), axis_name, scatter_dimension=dim, tiled=True
      )
  if run in ("fused", "fused_uni"):  # auto's one-way kernel: fused_uni
    kernel = {
      "fused": _vjp.fused_reducescatter,
      "fused_uni": _vjp.fused_reducescatter_uni,
    }[run]
    with jax.named_scope(fn), jax.named_scope(f"method_{run}"):
      out = kernel(fold.fold(lhs), rhs, axis_name, n)
      return fold.unfold(out, out.shape[-1])
  with jax.named_scope(fn):
    out = canonical(
      fold.rows_form,
      fold.fold(lhs),
      rhs,
      axis_name,
      n=n,
      api=api,
      bidirectional=bool(bidirectional),
    )
    return fold.unfold(out, out.shape[-1])


def _quantized_path(lhs, rhs, fold, axis_name, n, api, bidi, transfer):
  """``transfer="int8"`` / ``"float8_e4m3fn"``: the quantized ring
  (``_quantized_scatter``), differentiable straight through."""
  with jax.named_scope(f"matmul_reducescatter_{transfer}"):
    if n == 1:  # no transfer, nothing to quantize
      return jnp.dot(lhs, rhs, preferred_element_type=lhs.dtype)
    x = fold.fold(lhs)
    options = dict(n=n, api=api, bidirectional=bidi, transfer=transfer)
    out = _quantized_scatter.scatter(
      fold.rows_form, x, rhs, axis_name, tuple(sorted(options.items()))
    )
    return fold.unfold(out, out.shape[-1])


def canonical(rows_form: bool, x, w, axis_name: str, **options):
  """Runs the canonical ring: ``x [P, n R, k]`` (rows) or ``[M, k]``.

  The seam between the public function (validation, folding) and the
  implementations: ``options`` are ``n``, ``api`` and ``bidirectional``.
  """
  # Differentiable with the backward on our own rings (``_vjp``).
  return _vjp.scatter(
    rows_form,
    x,
    w,
    axis_name,
    options["api"],
    options["bidirectional"],
    options["n"],
  )
