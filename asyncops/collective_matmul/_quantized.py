"""Quantized transfers for the all-gather matmul: fewer bytes on the ring.

Algorithm. Before the ring, every row of this device's chunk ``x [M, k]``
is quantized with its own float32 scale ``s = max|row| / Q`` (``Q`` = 127
for ``int8``, 448 for ``float8_e4m3fn``; 1 for an all-zero row): codes
``q = round(row / s)`` (int8, clipped to +-127) or ``float8(row / s)``.
Codes and scales travel as one ``uint8 [M, k + 4]`` buffer (the 4 bytes of
each row's scale after its codes), around the same ring as the native
all-gather matmul (``_gather_rings.run``, one- or two-way, value or Ref
API). Each arriving chunk ``c`` is multiplied as ``(q_c @ w_c) * s_c``: the
codes are exact in ``w``'s dtype (int8 and e4m3 values fit bfloat16's 8-bit
significand), the product accumulates in float32, and a per-row scale
commutes with the matmul, so the result equals the **dequantize-then-
matmul reference** ``all_gather(q * s) @ w`` up to float32 summation order
(:func:`reference`).

Bytes. A row moves ``k + 4`` bytes instead of ``2 k`` (bfloat16) or ``4 k``
(float32). On TPU the ``uint8`` buffer is tiled ``(32, 128)``, so the four
scale bytes occupy a 128-byte lane tile: ``k + 128`` bytes per row moved,
e.g. 1.6x fewer than bfloat16 at ``k = 512``, 1.88x at ``k = 2048``.

Limits. The contracting form only (``gather_dim=-1``: the chunk is the
contracting slice; a row form would quantize tokens, which is the same
code, left for later), floating ``lhs``, no ``return_gathered`` (the
gathered ``lhs`` would be the dequantized one, not ``lhs``). The matmul-
reduce-scatter has no quantized form: its ring moves partial sums that
every hop adds to, so each hop would requantize and the error would grow
with the ring, and the reference would no longer be a simple
dequantize-then-reduce.
"""

from typing import Literal

import jax
import jax.numpy as jnp

from asyncops.collective_matmul import _gather_rings

Transfer = Literal["native", "int8", "float8_e4m3fn"]
TRANSFERS: tuple[str, ...] = ("native", "int8", "float8_e4m3fn")
_QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0}
_SCALE_BYTES = 4


def check(transfer, fn: str, lhs, *, rows_form: bool, return_gathered) -> str:
  """Validates ``transfer=`` and what it needs; returns it."""
  if not isinstance(transfer, str) or transfer not in TRANSFERS:
    raise ValueError(
      f"{fn}: transfer must be one of {TRANSFERS}, got {transfer!r}. "
      "'int8' and 'float8_e4m3fn' send each chunk as 1-byte codes with one "
      "float32 scale per row; 'native' sends it in lhs.dtype."
    )
  if transfer == "native":
    return transfer
  if not jnp.issubdtype(lhs.dtype, jnp.floating):
    raise TypeError(
      f"{fn}: transfer={transfer!r} quantizes a floating lhs, got "
      f"{jnp.dtype(lhs.dtype).name}. Use transfer='native' for integer "
      "operands."
    )
  if rows_form:
    raise ValueError(
      f"{fn}: transfer={transfer!r} needs gather_dim=-1 (the contracting "
      "dimension); gathering rows runs with transfer='native'."
    )
  if return_gathered:
    raise ValueError(
      f"{fn}: transfer={transfer!r} cannot return_gathered=True (the "
      "gathered lhs would be the dequantized one). Pass "
      "return_gathered=False, or transfer='native'."
    )
  return transfer


def quantize(x, transfer: str):
  """``(codes [M, k], scales f32 [M])`` with ``x ~ codes * scales[:, None]``."""
  xf = x.astype(jnp.float32)
  top = jnp.max(jnp.abs(xf), axis=-1)
  scale = jnp.where(top > 0, top / _QMAX[transfer], 1.0)
  y = xf / scale[:, None]
  if transfer == "int8":
    return jnp.clip(jnp.round(y), -127, 127).astype(jnp.int8), scale
  return y.astype(jnp.float8_e4m3fn), scale


def dequantize(codes, scales):
  """float32 ``codes * scales`` per row."""
  return codes.astype(jnp.float32) * scales[:, None]


def pack(codes, scales):
  """One ``uint8 [M, k + 4]`` buffer: each row's codes, then its scale."""
  c = jax.lax.bitcast_convert_type(codes, jnp.uint8)
  s = jax.lax.bitcast_convert_type(scales, jnp.uint8)  # [M, 4]
  return jnp.concatenate([c, s], axis=1)


def unpack(buf, transfer: str):
  """The inverse of :func:`pack`."""
  k = buf.shape[1] - _SCALE_BYTES
  dtype = jnp.int8 if transfer == "int8" else jnp.float8_e4m3fn
  codes = jax.lax.bitcast_convert_type(buf[:, :k], dtype)
  scales = jax.lax.bitcast_convert_type(buf[:, k:], jnp.float32)
  return codes, scales


def _chunk_product(codes, scales, w):
  """``dequantize(codes, scales) @ w`` as ``(codes @ w) * scales``, f32."""
  dt = w.dtype if jnp.issubdtype(w.dtype, jnp.floating) else jnp.float32
  y = jnp.dot(
    codes.astype(dt),
    w.astype(dt),
    preferred_element_type=jnp.float32,
    precision=jax.lax.Precision.HIGHEST,
  )
  return y * scales[:, None]


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
    buf = pack(*quantize(x, transfer))
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


def local(x, ws: tuple, transfer: str):
  """The one-device case: the same quantization, no ring."""
  codes, scales = quantize(x, transfer)
  return tuple(_chunk_product(codes, scales, w).astype(x.dtype) for w in ws)


def reference(x, w, axis_name: str, transfer: str):
  """``all_gather(dequantize(quantize(x)), axis=-1, tiled) @ w``, float32
  at ``HIGHEST`` precision, in ``x.dtype`` (for tests)."""
  g = jax.lax.all_gather(
    dequantize(*quantize(x, transfer)), axis_name, axis=1, tiled=True
  )
  y = jnp.dot(g, w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
  return y.astype(x.dtype)
