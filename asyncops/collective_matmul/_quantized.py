"""Quantized transfers for the all-gather matmul: fewer bytes on the ring.

Algorithm. Before the ring, every row of this device's chunk (``x [M, k]``
in the contracting form, ``x [P, R, k]`` in the row form: a row is a
token) is quantized with its own float32 scale ``s = max|row| / Q`` (``Q``
= 127 for ``int8``, 448 for ``float8_e4m3fn``; 1 for an all-zero row):
codes ``q = round(row / s)`` (int8, clipped to +-127) or
``float8(row / s)``. Codes and scales travel as one ``uint8 [..., k + 4]``
buffer (the 4 bytes of each row's scale after its codes), around the same
rings as the native all-gather matmul (``_gather_rings.run``, one- or
two-way, value or Ref API). Each arriving chunk ``c`` is multiplied as
``(q_c @ w_c) * s_c``: the codes are exact in ``w``'s dtype (int8 and e4m3
values fit bfloat16's 8-bit significand), the product accumulates in
float32 (contracting form) or is written as its own output rows (row
form), and a per-row scale commutes with the matmul, so the result equals
the **dequantize-then-matmul reference** ``all_gather(q * s) @ w`` up to
float32 summation order (:func:`reference`).

Bytes. A row moves ``k + 4`` bytes instead of ``2 k`` (bfloat16) or ``4 k``
(float32). On TPU the ``uint8`` buffer is tiled ``(32, 128)``, so the four
scale bytes occupy a 128-byte lane tile: ``k + 128`` bytes per row moved,
e.g. 1.6x fewer than bfloat16 at ``k = 512``, 1.88x at ``k = 2048``.

Derivatives (:func:`gather`) are **straight-through**: the quantizer is
taken as the identity for ``x``'s tangent and its output is held fixed for
the weights', so ``jax.grad`` gives ``dx = RS(g @ w^T)`` (the native
input gradient) and ``dw = AG(x')^T @ g`` with ``x' = dequantize(
quantize(x))`` (the exact weight gradient of the quantized forward), on
the native backward rings. Only the forward's transfers are quantized.

Limits. Floating ``lhs``; no ``return_gathered`` (the gathered ``lhs``
would be the dequantized one, not ``lhs``). The matmul-reduce-scatter's
quantized ring, which requantizes at every hop, is
``_quantized_scatter``; the codec here is shared.
"""

import functools
from typing import Literal

import jax
import jax.numpy as jnp

from asyncops import _jax_compat as jc
from asyncops.collective_matmul import (
  _bwd_rings,
  _gather_rings,
  _layout,
  _linear,
  _vjp,
)

Transfer = Literal["native", "int8", "float8_e4m3fn"]
TRANSFERS: tuple[str, ...] = ("native", "int8", "float8_e4m3fn")
_QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0}
_SCALE_BYTES = 4
# The largest error of one quantization, as a fraction of the largest
# magnitude of its row: int8 rounds to the nearest of 255 steps of
# max|row| / 127 (half a step); e4m3 keeps 3 significand bits (a relative
# half-ulp of 2**-4; its subnormals, below 2**-6 of the scaled range, err
# by at most 2**-10 of a scale, far less).
UNIT_ERROR = {"int8": 1.0 / 254.0, "float8_e4m3fn": 2.0**-4}


def require_ring(transfer: str, method: str, fn: str) -> None:
  """Refuses a quantized ``transfer`` with a method other than the ring's.

  Raises:
    ValueError: ``method`` is neither ``"auto"`` nor ``"ring"``.
  """
  if method not in ("auto", "ring"):
    raise ValueError(
      f"{fn}: transfer={transfer!r} runs the quantized ring, but "
      f"method={method!r}. Pass method='auto' (the default) or 'ring', "
      "or transfer='native'."
    )


def check(
  transfer, fn: str, lhs, *, rows_form: bool = False, return_gathered=False
) -> str:
  """Validates ``transfer=`` and what it needs; returns it."""
  if not isinstance(transfer, str) or transfer not in TRANSFERS:
    raise ValueError(
      f"{fn}: transfer must be one of {TRANSFERS}, got {transfer!r}. "
      "'int8' and 'float8_e4m3fn' send 1-byte codes with one float32 scale "
      "per row; 'native' sends lhs.dtype."
    )
  if transfer == "native":
    return transfer
  del rows_form  # both forms quantize rows
  if not jnp.issubdtype(lhs.dtype, jnp.floating):
    raise TypeError(
      f"{fn}: transfer={transfer!r} quantizes a floating lhs, got "
      f"{jnp.dtype(lhs.dtype).name}. Use transfer='native' for integer "
      "operands."
    )
  if return_gathered:
    raise ValueError(
      f"{fn}: transfer={transfer!r} cannot return_gathered=True (the "
      "gathered lhs would be the dequantized one). Pass "
      "return_gathered=False, or transfer='native'."
    )
  return transfer


def quantize(x, transfer: str):
  """``(codes [..., k], scales f32 [...])`` with ``x ~ codes * scales``,
  one scale per row (the last axis)."""
  xf = x.astype(jnp.float32)
  top = jnp.max(jnp.abs(xf), axis=-1)
  scale = jnp.where(top > 0, top / _QMAX[transfer], 1.0)
  y = xf / scale[..., None]
  if transfer == "int8":
    return jnp.clip(jnp.round(y), -127, 127).astype(jnp.int8), scale
  return y.astype(jnp.float8_e4m3fn), scale


def dequantize(codes, scales):
  """float32 ``codes * scales`` per row."""
  return codes.astype(jnp.float32) * scales[..., None]


def pack(codes, scales):
  """One ``uint8 [..., k + 4]`` buffer: each row's codes, then its scale."""
  c = jax.lax.bitcast_convert_type(codes, jnp.uint8)
  s = jax.lax.bitcast_convert_type(scales, jnp.uint8)  # [..., 4]
  return jnp.concatenate([c, s], axis=-1)


def unpack(buf, transfer: str):
  """The inverse of :func:`pack`."""
  k = buf.shape[-1] - _SCALE_BYTES
  dtype = jnp.int8 if transfer == "int8" else jnp.float8_e4m3fn
  codes = jax.lax.bitcast_convert_type(buf[..., :k], dtype)
  scales = jax.lax.bitcast_convert_type(buf[..., k:], jnp.float32)
  return codes, scales


def check_two_way(shape, op: str, transfer: str) -> None:
  """Refuses, at trace time on TPU, a two-way value-API ring whose one
  ``uint8`` buffer of ``shape`` (codes and scales) has halves Mosaic
  cannot DMA (jax 0.9: a half's last dimension, ``k + 4`` bytes, must be
  whole 128-lane tiles; ``_jax_compat.half_dma_problem``). Naming the
  argument that avoids it, where the kernel's lowering would name only
  the kernel's fixes."""
  problem = jc.half_dma_problem(shape, jnp.uint8)
  kind = jc.trace_device_kind()
  if problem is None or kind is None or "TPU" not in kind:
    return
  raise ValueError(
    f"{op}(transfer={transfer!r}, bidirectional=True): the two-way ring "
    f"moves the quantized rows (codes + 4 scale bytes) as one "
    f"uint8{list(shape)} buffer, each half of axis 0 one DMA, and "
    f"{problem}: jax {jax.__version__}'s Mosaic cannot DMA such a half on "
    "TPU. Pass bidirectional=False (the one-way ring moves the whole "
    "buffer), or pip install 'jax[tpu]>=0.10'."
  )


def encode(x, transfer: str):
  """``x`` quantized and packed: what travels."""
  return pack(*quantize(x, transfer))


def decode(buf, transfer: str):
  """A travelling buffer back to float32 (``dequantize(unpack(buf))``)."""
  return dequantize(*unpack(buf, transfer))


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def ste_dequantize(x, transfer: str):
  """``dequantize(quantize(x))`` in float32, with the straight-through
  derivative (the identity: the tangent of ``x``, in float32)."""
  return dequantize(*quantize(x, transfer))


@ste_dequantize.defjvp
def _ste_jvp(transfer, primals, tangents):
  (x,), (tx,) = primals, tangents
  return ste_dequantize(x, transfer), tx.astype(jnp.float32)


def _chunk_product(codes, scales, w):
  """``dequantize(codes, scales) @ w`` as ``(codes @ w) * scales``, f32."""
  dt = w.dtype if jnp.issubdtype(w.dtype, jnp.floating) else jnp.float32
  y = jnp.dot(
    codes.astype(dt),
    w.astype(dt),
    preferred_element_type=jnp.float32,
    precision=jax.lax.Precision.HIGHEST,
  )
  return y * scales[..., None]


def contracting(
  x,
  ws: tuple,
  axis_name: str,
  *,
  n: int,
  api: str,
  bidirectional: bool,
  transfer: str,
):
  """``[all_gather(dequantize(quantize(x)), axis=1, tiled) @ w]`` on a ring.

  Args:
    x: ``[M, k]`` floating (``M`` even if bidirectional).
    ws: weights ``[n k, f_i]``.
    axis_name, n, api, bidirectional: the ring (``_gather_rings.run``).
    transfer: ``"int8"`` or ``"float8_e4m3fn"``.

  Returns:
    A tuple of ``[M, f_i]`` in ``x.dtype``.
  """
  (m, k), dt = x.shape, x.dtype
  me = jax.lax.axis_index(axis_name)
  h = m // 2
  with jax.named_scope(f"quantize_{transfer}"):
    buf = encode(x, transfer)
  if bidirectional and api == "value":
    check_two_way(buf.shape, "allgather_matmul", transfer)
  if bidirectional:
    bufs = (buf,) if api == "value" else (buf[:h], buf[h:])
  else:
    bufs = (buf,)
  # As in the native ring: the first products initialise the accumulators
  # (no zero fill; two-way halves go into an uninitialized [2, M/2, f]).
  accs = tuple(
    jax.lax.empty((2, h, w.shape[1]), jnp.float32) if bidirectional else None
    for w in ws
  )

  def consume(s, sent, ws, accs):
    accs = list(accs)
    if bidirectional and len(sent) == 1:
      sent = (sent[0][:h], sent[0][h:])
    chunks = _gather_rings.chunks(me, s, n, bidirectional)
    for j, (bj, c) in enumerate(zip(sent, chunks, strict=True)):
      codes, scales = unpack(bj, transfer)
      for i, w in enumerate(ws):
        rows = jax.lax.dynamic_slice_in_dim(w, c * k, k, axis=0)
        y = _chunk_product(codes, scales, rows)
        accs[i] = _gather_rings.accumulate(accs[i], y, s, j, bidirectional)
    return tuple(accs)

  accs = _gather_rings.run(bufs, bidirectional, axis_name, n, api, consume)(
    ws, accs
  )
  return tuple(a.reshape(m, a.shape[-1]).astype(dt) for a in accs)


def rows(
  x,
  ws: tuple,
  axis_name: str,
  *,
  n: int,
  api: str,
  bidirectional: bool,
  transfer: str,
):
  """``[all_gather(dequantize(quantize(x)), axis=1, tiled) @ w]`` for
  ``x [P, R, k]`` (the row form: each row is a token; every arriving chunk
  produces its own output rows, as ``_gather_rings.rows``).

  Args:
    x: ``[P, R, k]`` floating (``P`` or ``R`` even if bidirectional).
    ws: weights ``[k, f_i]``.
    axis_name, n, api, bidirectional: the ring.
    transfer: ``"int8"`` or ``"float8_e4m3fn"``.

  Returns:
    A tuple of ``[P, n R, f_i]`` in ``x.dtype``.
  """
  p, r, _ = x.shape
  dt = x.dtype
  lay = _layout.RowSplit(p, r, n, _layout.choose_split(p, r, bidirectional))
  me = jax.lax.axis_index(axis_name)
  with jax.named_scope(f"quantize_{transfer}"):
    buf = encode(x, transfer)  # [P, R, k + 4]
  # Every block is written once: no zero fill.
  outs = tuple(jax.lax.empty(lay.expanded(w.shape[1]), dt) for w in ws)
  if bidirectional:
    b = lay.halves(buf)
    if api == "value":
      check_two_way(b.shape, "allgather_matmul", transfer)
    bufs = (b,) if api == "value" else (b[0], b[1])
  else:
    bufs = (buf,)

  def consume(s, sent, ws, outs):
    outs = list(outs)
    cs = _gather_rings.chunks(me, s, n, bidirectional)
    if bidirectional and len(sent) == 1:
      sent = (sent[0][0], sent[0][1])
    for j, bj in enumerate(sent):  # [P', R', k + 4]
      for i in range(bj.shape[0]):
        codes, scales = unpack(bj[i], transfer)
        for o, w in enumerate(ws):
          y = _chunk_product(codes, scales, w).astype(dt)
          outs[o] = lay.write(outs[o], y, j, i, cs[j])
    return tuple(outs)

  outs = _gather_rings.run(bufs, bidirectional, axis_name, n, api, consume)(
    ws, outs
  )
  return tuple(o.reshape(p, n * r, o.shape[-1]) for o in outs)


def local(x, ws: tuple, transfer: str):
  """The one-device case: the same quantization, no ring; differentiable
  (straight through the quantizer, :func:`ste_dequantize`)."""
  xq = ste_dequantize(x, transfer)
  return tuple(
    jnp.dot(
      xq, w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
    ).astype(x.dtype)
    for w in ws
  )


def _raw(rows_form, x, ws, axis_name, options):
  ring = rows if rows_form else contracting
  return ring(x, tuple(ws), axis_name, **dict(options))


def _native_options(rows_form, x, options):
  """The native rings' options for the same ring (tangent and backward)."""
  o = dict(options)
  return _vjp._options(
    rows_form,
    x,
    o["n"],
    False,
    o["api"],
    o["bidirectional"],
    return_gathered=False,
  )


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 3, 4))
def gather(rows_form, x, ws, axis_name, options):
  """The quantized all-gather ring (:func:`contracting` or :func:`rows`),
  differentiable.

  **Derivatives are straight-through the quantizer**: the tangent is that
  of ``all_gather(x') @ w`` with ``x' = dequantize(quantize(x))`` held
  fixed for ``w`` and replaced by ``x`` for ``x``'s own tangent, i.e.
  ``AG(tx) @ w + AG(x') @ tw``. It runs on the native rings (``jax.jvp``)
  and transposes to the native backward rings (``jax.grad``: ``dx =
  RS(g @ w^T)``, ``dw = AG(x')^T @ g``, ``_vjp``), with ``x'`` rounded to
  ``x.dtype``: only the forward's transfers are quantized.

  Args:
    rows_form: the row form (``x [P, R, k]``), else contracting.
    x, ws: the canonical operands.
    axis_name: the ring axis.
    options: sorted ``(name, value)`` pairs: ``n``, ``api``,
      ``bidirectional``, ``transfer``.
  """
  return _raw(rows_form, x, ws, axis_name, options)


def _gather_jvp(rows_form, axis_name, options, primals, tangents):
  x, ws = primals
  tx, tws = tangents
  out = _raw(rows_form, x, ws, axis_name, options)
  native = _native_options(rows_form, x, options)
  opts = dict(native)
  xq = ste_dequantize(x, dict(options)["transfer"]).astype(x.dtype)
  zero = _vjp._zero
  lin = (
    None if zero(tx) else tx,
    None
    if all(zero(t) for t in tws)
    else tuple(_vjp._inst(t, w) for t, w in zip(tws, ws, strict=True)),
  )
  has = tuple(v is not None for v in lin)

  def fwd(res, lin):  # AG(tx) @ w + AG(x') @ tw
    xq, ws = res
    tx, tws = lin
    terms = []
    if tx is not None:
      terms.append(_vjp._raw_gather(rows_form, tx, ws, axis_name, native)[0])
    if tws is not None:
      terms.append(_vjp._raw_gather(rows_form, xq, tws, axis_name, native)[0])
    return functools.reduce(
      lambda a, b: tuple(u + v for u, v in zip(a, b, strict=True)), terms
    )

  def bwd(res, ct):
    xq, ws = res
    if rows_form:
      p, r, _ = xq.shape
      split = _layout.choose_split(p, r, opts["bidirectional"])
      lay = _layout.RowSplit(p, r, opts["n"], split)
      sent = _bwd_rings._row_bufs(xq, opts["bidirectional"], opts["api"], lay)
    else:
      sent = _bwd_rings._flat_bufs(xq, opts["bidirectional"], opts["api"])
    dx, dws = _vjp._allgather_bwd(
      rows_form, axis_name, native, (sent, ws), (tuple(ct), None)
    )
    return (dx if has[0] else None, tuple(dws) if has[1] else None)

  return out, _linear.call(fwd, bwd, (xq, tuple(ws)), lin, out)


gather.defjvp(_gather_jvp, symbolic_zeros=True)


def reference(x, w, axis_name: str, transfer: str, gather_dim: int = -1):
  """``all_gather(dequantize(quantize(x)), gather_dim, tiled) @ w``, float32
  at ``HIGHEST`` precision, in ``x.dtype`` (for tests). Its derivative is
  straight-through (:func:`ste_dequantize`), as :func:`gather`'s."""
  g = jax.lax.all_gather(
    ste_dequantize(x, transfer),
    axis_name,
    axis=gather_dim % x.ndim,
    tiled=True,
  )
  y = jnp.dot(g, w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
  return y.astype(x.dtype)
