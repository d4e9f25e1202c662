"""Quantized transfers for the matmul-reduce-scatter: 1-byte partial sums.

Algorithm. The ring of ``_scatter_rings`` (block ``b``'s partial sum
starts on device ``b + 1``, every hop adds that device's contribution,
device ``b`` ends with the sum), with what travels quantized
(``_quantized``): each row of an outgoing partial sum gets a float32 scale
``max|row| / Q`` (``Q`` = 127 for ``int8``, 448 for ``float8_e4m3fn``) and
1-byte codes, packed with its scale into one ``uint8 [..., c + 4]`` row.
A hop

1. computes its own contribution ``x @ w_b`` in **float32** inside the
   window of the incoming transfer (never rounded to the input dtype),
2. after the done, **dequantizes** the arrived partial sum to float32 and
   adds its contribution,
3. **requantizes** the sum and sends it on, except at the last hop, whose
   float32 sum is the result (rounded once to ``lhs.dtype``).

Where precision is lost, and how much. Only at step 3, ``n - 1`` times per
block, once per hop but the last: the partial sum of ``t + 1``
contributions ``S_t`` leaves as ``S_t + e_t``, each ``|e_t|`` at most
``u max|row of S_t + ...|`` (:data:`_quantized.UNIT_ERROR`: ``u`` =
``1/254`` for int8, half an int8 step; ``2**-4`` for e4m3, its relative
half-ulp). The errors add without growing (each hop adds exact float32
contributions to what arrived), so the result differs from the exact sum
by at most ``u * sum_t max|row of S_t|`` per row (the partial sums'
magnitudes, not the result's: a cancelling reduction keeps its absolute
error) plus the final rounding to ``lhs.dtype``. The contributions and
the additions are float32 throughout, so :func:`reference` (the same
quantization steps, in the same order, by ``jnp``) reproduces the result
exactly up to float32 summation order.

Bytes. A row of a partial sum moves ``c + 4`` bytes instead of ``2 c``
(bfloat16) or ``4 c`` (float32); on TPU ``c + 128`` (the scale bytes take a
lane tile of the ``(32, 128)``-tiled ``uint8`` buffer).

Forms: the output columns (``x [M, k] @ w [k, n c]``, block ``b`` the
columns ``b c:(b + 1) c``) and the rows (``x [P, n R, k] @ w [k, f]``,
block ``b`` the rows ``b R:(b + 1) R``); one- or two-way (the halves'
partial sums travel in opposite directions, so their chains visit the
devices in opposite orders), value or Ref API.

Derivatives (:func:`scatter`) are **straight-through**: every quantizer is
taken as the identity, so ``jax.jvp`` and ``jax.grad`` are those of the
exact ``psum_scatter(x @ w)``, on the native rings (``_vjp``).
"""

import functools
import math

import jax
import jax.numpy as jnp

from asyncops.collective_matmul import (
  _layout,
  _linear,
  _quantized,
  _ring,
  _scatter_rings,
  _vjp,
)


def run(
  partials, join, split, bidirectional, axis_name, n, api, transfer, *ops
):
  """Runs a quantized reduce-scatter ring.

  Args:
    partials: ``partials(s, *ops)``: this device's float32 contributions to
      the block(s) of the travelling partial sums at step ``s`` (one, or two
      halves).
    join, split: a two-way value ring's halves to the one buffer its kernel
      moves, and back.
    bidirectional, axis_name, n, api: the ring.
    transfer: ``"int8"`` or ``"float8_e4m3fn"``.
    *ops: the inputs of ``partials`` (they pass the ring's barriers).

  Returns:
    The float32 sums after the last hop, one per direction.
  """
  one_kernel = bidirectional and api == "value"
  if not bidirectional:
    shifts = (1,)
  elif one_kernel:
    shifts = ("both",)
  else:
    shifts = (1, -1)

  def send(sums):
    with jax.named_scope(f"quantize_{transfer}"):
      bufs = tuple(_quantized.encode(v, transfer) for v in sums)
    if not one_kernel:
      return bufs
    buf = join(bufs)
    _quantized.check_two_way(buf.shape, "matmul_reducescatter", transfer)
    return (buf,)

  with jax.named_scope("chunk0"):
    sums = partials(0, *ops)
    ring = _ring.Ring(send(sums), shifts, axis_name, api)
  for s in range(1, n):

    def compute(sent, *ops, s=s):
      del sent
      return partials(s, *ops)

    with jax.named_scope(f"chunk{s}"):
      ys = ring.step(compute, *ops)
      cur = ring.values()
      cur = split(cur[0]) if one_kernel else cur
      sums = tuple(
        _quantized.decode(b, transfer) + y for b, y in zip(cur, ys, strict=True)
      )
      if s < n - 1:
        ring.set(send(sums))
  return sums


def _cols(w, b, c: int):
  return jax.lax.dynamic_slice_in_dim(w, b * c, c, axis=1)


def columns(x, w, axis_name, *, n, api, bidirectional, transfer):
  """``psum_scatter(x @ w, 1, tiled)`` with quantized partial sums.

  Args:
    x: ``[M, k]`` floating (``M`` even if bidirectional).
    w: ``[k, n c]``.
    axis_name, n, api, bidirectional: the ring.
    transfer: ``"int8"`` or ``"float8_e4m3fn"``.

  Returns:
    ``[M, c]`` in ``x.dtype``.
  """
  m, c = x.shape[0], w.shape[1] // n
  h = m // 2
  me = jax.lax.axis_index(axis_name)

  def partials(s, x, w):
    bs = _scatter_rings.blocks(me, s, n, bidirectional)
    xs = (x[:h], x[h:]) if bidirectional else (x,)
    return tuple(
      jnp.dot(xj, _cols(w, b, c), preferred_element_type=jnp.float32)
      for xj, b in zip(xs, bs, strict=True)
    )

  def join(bufs):
    return jnp.concatenate(bufs, axis=0)

  def split(buf):
    return buf[:h], buf[h:]

  out = run(
    partials, join, split, bidirectional, axis_name, n, api, transfer, x, w
  )
  return join(out).astype(x.dtype)


def rows(x, w, axis_name, *, n, api, bidirectional, transfer):
  """``psum_scatter(x @ w, 1, tiled)`` for ``x [P, n R, k]`` with quantized
  partial sums; returns ``[P, R, f]`` in ``x.dtype``."""
  p, nr, k = x.shape
  r = nr // n
  lay = _layout.RowSplit(p, r, n, _layout.choose_split(p, r, bidirectional))
  me = jax.lax.axis_index(axis_name)
  xe = x.reshape(lay.expanded(k))

  def partials(s, xe, w):
    pieces = lay.half_shape(k)[0]
    return tuple(
      jnp.stack(
        [
          jnp.dot(lay.read(xe, j, i, b), w, preferred_element_type=jnp.float32)
          for i in range(pieces)
        ]
      )
      for j, b in enumerate(_scatter_rings.blocks(me, s, n, bidirectional))
    )

  def join(bufs):
    return jnp.stack(bufs)

  def split(buf):
    return buf[0], buf[1]

  out = run(
    partials, join, split, bidirectional, axis_name, n, api, transfer, xe, w
  )
  if not bidirectional:
    return out[0].astype(x.dtype)
  return lay.join(join(out)).astype(x.dtype)


def _raw(rows_form, x, w, axis_name, options):
  ring = rows if rows_form else columns
  return ring(x, w, axis_name, **dict(options))


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 3, 4))
def scatter(rows_form, x, w, axis_name, options):
  """The quantized reduce-scatter ring (:func:`columns` or :func:`rows`),
  differentiable **straight through** its quantizers: the tangent and the
  gradients are those of the exact ``psum_scatter(x @ w)`` (the native
  rings and their backward, ``_vjp``).

  Args:
    rows_form: the row form (``x [P, n R, k]``), else the columns.
    x, w: the canonical operands.
    axis_name: the ring axis.
    options: sorted ``(name, value)`` pairs: ``n``, ``api``,
      ``bidirectional``, ``transfer``.
  """
  return _raw(rows_form, x, w, axis_name, options)


def _scatter_jvp(rows_form, axis_name, options, primals, tangents):
  x, w = primals
  tx, tw = tangents
  out = _raw(rows_form, x, w, axis_name, options)
  o = dict(options)
  native = _vjp._options(
    rows_form, x, o["n"], True, o["api"], o["bidirectional"]
  )
  zero = _vjp._zero
  lin = (None if zero(tx) else tx, None if zero(tw) else tw)
  has = tuple(v is not None for v in lin)

  def fwd(res, lin):  # RS(tx @ w) + RS(x @ tw), exact
    (x, w), (tx, tw) = res, lin
    terms = []
    if tx is not None:
      terms.append(_vjp._raw_scatter(rows_form, tx, w, axis_name, native))
    if tw is not None:
      terms.append(_vjp._raw_scatter(rows_form, x, tw, axis_name, native))
    return functools.reduce(jnp.add, terms)

  def bwd(res, g):
    dx, dw = _vjp._reducescatter_bwd(rows_form, axis_name, native, res, g)
    return (dx if has[0] else None, dw if has[1] else None)

  return out, _linear.call(fwd, bwd, (x, w), lin, out)


scatter.defjvp(_scatter_jvp, symbolic_zeros=True)


@functools.partial(jax.custom_jvp, nondiff_argnums=(3, 4, 5))
def reference(x, w, mask, axis_name: str, transfer: str, scatter_dim: int):
  """The quantized reduce-scatter by ``jnp``, for tests: the same
  quantization steps in the same order as the ring, written as chains.

  Every device computes its float32 contribution ``x @ w``; block ``b``'s
  contributions are all-gathered to device ``b``, which walks them in the
  ring's order (devices ``b + 1, b + 2, ..., b``; ``b - 1, b - 2, ...,
  b`` for the rows of a two-way ring's second half, where ``mask`` is
  True), requantizing after each addition but the last. Its derivative is
  the exact ``psum_scatter(x @ w)``'s (straight-through).

  Args:
    x: this device's ``lhs`` (any rank, contracting dimension last).
    w: ``[k, f]``.
    mask: bool, the result's shape without its last dimension: the rows
      whose partial sums travel towards ``index - 1``.
    axis_name: the ring axis.
    transfer: ``"int8"`` or ``"float8_e4m3fn"``.
    scatter_dim: the dimension of the result scattered.

  Returns:
    The result, ``psum_scatter``'s shape, in ``x.dtype``.
  """
  n = jax.lax.axis_size(axis_name)
  me = jax.lax.axis_index(axis_name)
  dim = scatter_dim % x.ndim
  y = jnp.dot(x, w, preferred_element_type=jnp.float32)
  blocks = jnp.stack(jnp.split(y, n, axis=dim))  # [n, ...block]
  # parts[d] = device d's contribution to my block.
  parts = jax.lax.all_to_all(blocks, axis_name, 0, 0, tiled=False)

  def chain(step):
    acc = None
    for t in range(n):
      part = parts[jax.lax.rem(me + n + step * (t + 1), n)]
      acc = (
        part if acc is None else _quantized.ste_dequantize(acc, transfer) + part
      )
    return acc

  out = jnp.where(mask[..., None], chain(-1), chain(1))
  return out.astype(x.dtype)


@reference.defjvp
def _reference_jvp(axis_name, transfer, scatter_dim, primals, tangents):
  x, w, mask = primals
  tx, tw, _ = tangents
  out = reference(x, w, mask, axis_name, transfer, scatter_dim)

  def exact(x, w):
    return jax.lax.psum_scatter(
      jnp.dot(x, w, preferred_element_type=jnp.float32),
      axis_name,
      scatter_dimension=scatter_dim % x.ndim,
      tiled=True,
    ).astype(x.dtype)

  _, t = jax.jvp(exact, (x, w), (tx, tw))
  return out, t


def reversed_rows(out_shape, scatter_dim: int, n: int, bidirectional: bool):
  """Which rows of a result travel towards ``index - 1`` (the second half
  of a two-way ring), as a bool array of ``out_shape[:-1]``: the ``mask``
  of :func:`reference`."""
  lead = tuple(out_shape[:-1])
  dim = scatter_dim % len(out_shape)
  if not bidirectional:
    return jnp.zeros(lead, bool)
  if dim == len(out_shape) - 1:  # the columns form halves the rows
    m = math.prod(lead)
    return (jnp.arange(m) >= m // 2).reshape(lead)
  p, r = math.prod(lead[:dim]), math.prod(lead[dim:])
  split = _layout.choose_split(p, r, True)
  if split == "outer":
    mask = jnp.broadcast_to((jnp.arange(p) >= p // 2)[:, None], (p, r))
  else:
    mask = jnp.broadcast_to((jnp.arange(r) >= r // 2)[None, :], (p, r))
  del n
  return mask.reshape(lead)
