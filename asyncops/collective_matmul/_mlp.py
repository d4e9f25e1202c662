"""A tensor-parallel MLP block with every collective hidden.

The chapter's Problem 3.3: ``In[B_X, D_Y] *_D W_in[D, F_Y]``, an
elementwise nonlinearity, then ``*_F W_out[F_Y, D] -> Out[B_X, D_Y]``. The
up projection is an :func:`allgather_matmul` (the activations' contracting
dimension is gathered chunk by chunk), the down projection a
:func:`matmul_reducescatter` (partial sums travel back to the owner of
each ``D`` block). Input and output share the sharding ``P(X, Y)``, so
blocks compose.
"""

from collections.abc import Callable

import jax

from asyncops.collective_matmul import _allgather, _reducescatter, _validate


def mlp_block(
  x,
  w_in,
  w_out,
  axis_name: str,
  *,
  activation: Callable = jax.nn.gelu,
  api: _validate.Api = "value",
  bidirectional: bool = False,
):
  """``reducescatter(activation(allgather(x) @ w_in) @ w_out)``.

  Equals ``psum_scatter(activation(all_gather(x, 1, tiled) @ w_in) @
  w_out, scatter_dimension=1, tiled=True)`` with both collectives
  overlapped.

  Args:
    x: ``[b, d / n]``, activations sharded along the model dimension.
    w_in: ``[d, f / n]``, the up projection, sharded along its outputs.
    w_out: ``[f / n, d]``, the down projection, sharded along its inputs.
    axis_name: the tensor-parallel mesh axis (size ``n``).
    activation: elementwise nonlinearity (default ``jax.nn.gelu``).
    api: ``"value"`` (futures) or ``"ref"`` (the Ref API).
    bidirectional: use both ring directions in both matmuls.

  Returns:
    ``[b, d / n]`` in ``x.dtype``, sharded like ``x``.

  Raises:
    ValueError: ``w_in``/``w_out`` shapes do not match ``x`` (the message
      names the argument), plus the errors of the two matmuls.

  Example:
    >>> @jax.shard_map(mesh=mesh,
    ...                in_specs=(P("x", "y"), P(None, "y"), P("y", None)),
    ...                out_specs=P("x", "y"))
    ... def f(x, w_in, w_out):
    ...   return mlp_block(x, w_in, w_out, "y")  # doctest: +SKIP
  """
  fn = "mlp_block"
  _validate.api(api, fn)
  for name, v in (("x", x), ("w_in", w_in), ("w_out", w_out)):
    _validate.operand(v, fn, name)
  _validate.same_dtype(x, w_in, fn, ("x", "w_in"))
  _validate.same_dtype(x, w_out, fn, ("x", "w_out"))
  n = _validate.axis(axis_name, fn)
  _validate.contracting(x, w_in, fn, n * x.shape[1], ("x", "w_in"))
  if w_out.shape[0] != w_in.shape[1]:
    raise ValueError(
      f"{fn}: w_out.shape[0] = {w_out.shape[0]} must equal w_in.shape[1] = "
      f"{w_in.shape[1]} (this device's slice of the hidden dimension). "
      "Shard w_in as P(None, axis) and w_out as P(axis, None)."
    )
  if w_out.shape[1] != n * x.shape[1]:
    raise ValueError(
      f"{fn}: w_out.shape[1] = {w_out.shape[1]} must be the full model "
      f"dimension n * x.shape[1] = {n * x.shape[1]} so the output is "
      "sharded like x. Check the shard_map in_specs (w_out: P(axis, None))."
    )
  with jax.named_scope(fn):
    with jax.named_scope("up"):
      h = _allgather.allgather_matmul(
        x, w_in, axis_name, api=api, bidirectional=bidirectional
      )
    h = activation(h)
    with jax.named_scope("down"):
      return _reducescatter.matmul_reducescatter(
        h, w_out, axis_name, api=api, bidirectional=bidirectional
      )
