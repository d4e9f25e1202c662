"""All-reduce collective matmul: ``psum(lhs @ rhs)``.

Algorithm (the chapter's Problem 3.1). An all-reduce is a reduce-scatter
followed by an all-gather. The reduce-scatter half runs as the overlapped
ring of :func:`matmul_reducescatter` (every hop hidden behind a chunk
matmul); the all-gather of the ``n`` reduced column blocks follows as one
XLA all-gather, since no matmul is left to hide it behind. The chapter
warns that XLA's fused all-reduce may be as fast; this variant wins when the
matmul is long enough to hide the reduce-scatter half.

Non-divisible columns fall back correctly: ``rhs`` is padded with zero
columns to a multiple of ``n`` and the padding is sliced off the result.
"""

import functools

import jax
import jax.numpy as jnp

from asyncops import _jax_compat as jc
from asyncops.collective_matmul import _reducescatter, _validate, _vjp


def matmul_allreduce(
  lhs,
  rhs,
  axis_name: str,
  *,
  api: _validate.Api = "value",
  bidirectional: bool = False,
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

  Returns:
    ``lhs.shape[:-1] + (f,)`` in ``lhs.dtype``, identical on every device
    of the axis.

  Raises:
    ValueError, TypeError, NameError: as
      :func:`matmul_reducescatter`, except that ``f`` need not divide.

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
  _validate.operand(lhs, fn, "lhs", matrix=False)
  _validate.operand(rhs, fn, "rhs")
  n = _validate.axis(axis_name, fn)
  if n > 1 and axis_name in jc.varying_axes(lhs):
    # Differentiable with a local backward (``_vjp.allreduce``). An lhs
    # that does not vary over the axis (shard_map(check_vma=False) types
    # none) keeps JAX's rules: a ring backward, correct either way.
    return _vjp.allreduce(
      functools.partial(_forward, api=api, bidirectional=bidirectional, n=n),
      lhs,
      rhs,
      axis_name,
    )
  return _forward(
    lhs, rhs, axis_name, api=api, bidirectional=bidirectional, n=n
  )


def _forward(lhs, rhs, axis_name, *, api, bidirectional, n):
  fn = "matmul_allreduce"
  f = rhs.shape[1]
  pad = -f % n
  with jax.named_scope(fn):
    if pad:
      rhs = jnp.pad(rhs, ((0, 0), (0, pad)))
    block = _reducescatter.matmul_reducescatter(
      lhs, rhs, axis_name, api=api, bidirectional=bidirectional
    )
    if n == 1:
      return block[..., :f]
    # "invarying": the result is the same on every device of the axis (as
    # psum's), so out_specs may leave the axis out.
    out = jc.all_gather_invariant(
      block, axis_name, axis=block.ndim - 1, tiled=True
    )
    return out[..., :f]
