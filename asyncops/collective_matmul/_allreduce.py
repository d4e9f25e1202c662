"""All-reduce collective matmul: ``psum(lhs @ rhs)``.

Algorithm (the chapter's Problem 3.1). An all-reduce is a reduce-scatter
followed by an all-gather. The reduce-scatter half runs as the overlapped
ring of :func:`matmul_reducescatter` (every hop hidden behind a chunk
matmul); the all-gather of the ``n`` reduced column blocks follows as one
XLA all-gather, since no matmul is left to hide it behind. The chapter
warns that XLA's fused all-reduce may be as fast; this variant wins when the
matmul is long enough to hide the reduce-scatter half.

``method`` (default ``"auto"``, ``_auto``) may run XLA's ``psum`` of the
local product instead, or the fused reduce-scatter kernel plus XLA's
all-gather: see :func:`asyncops.collective_matmul._auto.explain_allreduce`.

Non-divisible columns fall back correctly: ``rhs`` is padded with zero
columns to a multiple of ``n`` and the padding is sliced off the result.
"""

import functools
import math

import jax
import jax.numpy as jnp

from asyncops import _jax_compat as jc
from asyncops.collective_matmul import (
  _auto,
  _fused,
  _reducescatter,
  _validate,
  _vjp,
)


def matmul_allreduce(
  lhs,
  rhs,
  axis_name: str,
  *,
  api: _validate.Api = "value",
  bidirectional: bool = False,
  method: _auto.Method = "auto",
  memory: _validate.Memory = "fastest",
):
  """Multiplies ``lhs @ rhs`` and sums the products over ``axis_name``.

  Equals ``jax.lax.psum(lhs @ rhs, axis_name)``: the chapter's
  ``A[B_X, D_Y] * W[D_Y, F] -> Out[B_X, F]``. The reduce-scatter half is
  overlapped with the chunk matmuls; the all-gather half is not.

  Args:
    lhs: ``[..., k]``, any rank >= 1, this device's slice of the
      contracting dimension (last); leading dimensions are batch.
    rhs: ``[k, f]``, the matching rows; any ``f`` (padded internally to a
      multiple of the axis size). Same dtype as ``lhs``.
    axis_name: the mesh axis to reduce over.
    api: ``"value"`` (futures) or ``"ref"`` (double-buffered Refs,
      ``asyncops.stateful``); same result and schedule.
    bidirectional: reduce-scatter half the rows each way (``m`` even).
    method: how: ``"auto"`` (default) picks between XLA's ``psum`` of the
      local product (``"xla"``), the fused reduce-scatter kernel plus
      XLA's all-gather (``"fused"``) and the ring (``"ring"``); see
      :func:`allgather_matmul`. **``api="ref"`` and
      ``bidirectional=True`` configure the ring** (``"auto"`` then runs
      it). Every method differentiates.
    memory: ``"fastest"`` (default) or ``"jit"``: with ``"jit"``,
      ``method="auto"`` runs XLA's ``psum`` where the fused
      reduce-scatter's receive slots put the peak temporaries over jit's
      plus one chunk's buffers. **It costs speed**; see
      :func:`allgather_matmul`.

  Returns:
    ``lhs.shape[:-1] + (f,)`` in ``lhs.dtype``, identical on every device
    of the axis.

  Raises:
    ValueError, TypeError, NameError: as
      :func:`matmul_reducescatter`, except that ``f`` need not divide;
      ``method="fused"`` with an ``lhs`` not typed as varying over the
      axis (``shard_map(check_vma=False)``).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import AxisType, PartitionSpec as P
    >>> from asyncops.collective_matmul import matmul_allreduce
    >>> mesh = jax.make_mesh((2, 4), ("x", "y"),
    ...                      axis_types=(AxisType.Auto,) * 2)
    >>> @jax.jit
    ... @jax.shard_map(mesh=mesh, in_specs=(P("x", "y"), P("y", None)),
    ...                out_specs=P("x", None))
    ... def f(a, w):
    ...   return matmul_allreduce(a, w, "y")
    >>> a = jnp.arange(16.0 * 32).reshape(16, 32) % 7
    >>> w = jnp.arange(32.0 * 12).reshape(32, 12) % 3
    >>> bool((f(a, w) == a @ w).all())
    True
  """
  fn = "matmul_allreduce"
  _validate.api(api, fn)
  memory = _validate.memory(memory, fn)
  _validate.operand(lhs, fn, "lhs", matrix=False)
  _validate.operand(rhs, fn, "rhs")
  n = _validate.axis(axis_name, fn)
  varying = n > 1 and axis_name in jc.varying_axes(lhs)
  m, k, f = math.prod(lhs.shape[:-1]), lhs.shape[-1], rhs.shape[1]
  kw = dict(precision=_fused.precision_name(), device_kind=_auto.device_kind())
  run = _auto.pick(
    method,
    fn,
    ring_options=_auto.ring_options(api, bool(bidirectional)),
    # The fused kernel has no rules of its own: it differentiates only
    # inside the custom_vjp below, which needs lhs typed as varying.
    unfused=None
    if varying or n == 1
    else "lhs is not typed as varying over the axis "
    "(shard_map(check_vma=False)), so the fused kernel has no gradient",
    explain=lambda: _auto.explain_allreduce(
      m,
      k,
      f,
      n,
      lhs.dtype,
      wiring=_auto.wiring(axis_name),
      memory=memory,
      **kw,
    ),
    explain_unfused=lambda why: _auto.explain_ring(
      2 * lhs.size * f,
      rhs.size * jnp.dtype(rhs.dtype).itemsize,
      lhs.dtype,
      why=why,
      **kw,
    ),
  )
  forward = functools.partial(
    _forward, api=api, bidirectional=bidirectional, n=n, run=run
  )
  if varying:
    # Differentiable with a local backward (``_vjp.allreduce``), whatever
    # ``run`` is. An lhs that does not vary over the axis
    # (shard_map(check_vma=False) types none) keeps JAX's rules: a ring
    # backward, correct either way.
    return _vjp.allreduce(forward, lhs, rhs, axis_name)
  return forward(lhs, rhs, axis_name)


def _forward(lhs, rhs, axis_name, *, api, bidirectional, n, run="ring"):
  fn = "matmul_allreduce"
  f = rhs.shape[1]
  pad = -f % n
  if n > 1 and run == "xla":
    with jax.named_scope(fn), jax.named_scope("method_xla"):
      return jax.lax.psum(_auto.dot(lhs, rhs), axis_name)
  if n > 1 and run == "fused":
    with jax.named_scope(fn), jax.named_scope("method_fused"):
      out = _fused.matmul_allreduce(
        lhs.reshape(-1, lhs.shape[-1]), rhs, axis_name
      )
      return out.reshape(*lhs.shape[:-1], f)
  with jax.named_scope(fn):
    if pad:
      rhs = jnp.pad(rhs, ((0, 0), (0, pad)))
    block = _reducescatter.matmul_reducescatter(
      lhs, rhs, axis_name, api=api, bidirectional=bidirectional, method="ring"
    )
    if n == 1:
      return block[..., :f]
    # "invarying": the result is the same on every device of the axis (as
    # psum's), so out_specs may leave the axis out.
    out = jc.all_gather_invariant(
      block, axis_name, axis=block.ndim - 1, tiled=True
    )
    return out[..., :f]
