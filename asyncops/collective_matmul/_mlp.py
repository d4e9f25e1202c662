"""A tensor-parallel MLP block with every collective hidden.

Two layouts of the activations over the tensor-parallel axis ``Y``:

- Model-sharded (the chapter's Problem 3.3): ``In[B_X, D_Y] *_D
  W_in[D, F_Y]``, an elementwise nonlinearity, then ``*_F W_out[F_Y, D] ->
  Out[B_X, D_Y]``. The up projection gathers the contracting dimension
  (:func:`allgather_matmul`, ``gather_dim=-1``), the down projection
  scatters the output columns.
- Sequence-parallel (Megatron-style, ``sequence_parallel=True``):
  ``In[S_Y, D]``; the up projection gathers the tokens
  (``gather_dim=sequence_dim``) and the down projection scatters them back:
  ``Out[S_Y, D]``.

Input and output share their sharding in both layouts, so blocks compose.
Gated MLPs (SwiGLU, GeGLU: Llama, Mistral, Gemma) pass ``w_gate``: the gate
and up projections share one gather ring (each arriving chunk is
multiplied by both weights in the same window), so the gate costs no extra
communication.
"""

from collections.abc import Callable

import jax

from asyncops.collective_matmul import (
  _allgather,
  _auto,
  _dp_window,
  _reducescatter,
  _validate,
)


def mlp_block(
  x,
  w_in,
  w_out,
  axis_name: str,
  *,
  w_gate=None,
  activation: Callable = jax.nn.gelu,
  sequence_parallel: bool = False,
  sequence_dim: int = -2,
  api: _validate.Api = "value",
  bidirectional: bool = False,
  method: _auto.Method = "auto",
  memory: _validate.Memory = "fastest",
):
  """``reducescatter(activation(allgather(x) @ w_in) @ w_out)``, or gated.

  Without ``w_gate``: ``h = activation(X @ w_in)``; with it:
  ``h = activation(X @ w_gate) * (X @ w_in)``; the result is
  ``h @ w_out`` reduce-scattered, where ``X`` is ``x`` all-gathered over
  ``axis_name``. Equals (model-sharded layout)::

    X = all_gather(x, axis_name, axis=-1, tiled=True)
    psum_scatter(h @ w_out, axis_name, scatter_dimension=-1, tiled=True)

  and (``sequence_parallel=True``, ``d = sequence_dim``)::

    X = all_gather(x, axis_name, axis=d, tiled=True)
    psum_scatter(h @ w_out, axis_name, scatter_dimension=d, tiled=True)

  with both collectives overlapped with the matmuls.

  Args:
    x: model-sharded: ``[..., d / n]``; sequence-parallel: ``[..., d]``
      sharded along ``sequence_dim`` (e.g. ``[s / n, d]`` or
      ``[b, s / n, d]``). Leading dimensions are batch.
    w_in: ``[d, f / n]``, the up projection, sharded along its outputs.
    w_out: ``[f / n, d]``, the down projection, sharded along its inputs.
    axis_name: the tensor-parallel mesh axis (size ``n``).
    w_gate: optional ``[d, f / n]`` gate projection, sharded like ``w_in``.
    activation: elementwise nonlinearity (default ``jax.nn.gelu``; **pass
      ``jax.nn.silu`` for SwiGLU**, as in Llama and Mistral).
    sequence_parallel: ``x`` and the result are sharded along
      ``sequence_dim`` (the tokens) instead of the model dimension.
    sequence_dim: the dimension of ``x`` sharded over ``axis_name`` when
      ``sequence_parallel=True`` (default ``-2``: the rows just before the
      model dimension; use 0 for ``[s, b, d]``). Ignored otherwise.
    api: ``"value"`` (futures) or ``"ref"`` (the Ref API).
    bidirectional: use both ring directions in both matmuls.
    method: how each of the two collective matmuls runs (default
      ``"auto"``: chosen per matmul from its shapes and the chip; see
      :func:`allgather_matmul`). The gated up projection (two weights on
      one gather) and the sequence-parallel layout have no fused kernel:
      ``"auto"`` picks the ring or XLA's collective there, and
      ``"fused"`` is refused. **``api="ref"`` and ``bidirectional=True``
      configure the ring** (``"auto"`` then runs it).
    memory: ``"fastest"`` (default) or ``"jit"``, for both matmuls' auto
      choice (:func:`allgather_matmul`). With the fused kernels' receive
      slots in VMEM the chapter's training step meets the target by
      default (v5e and v6e 2x4 meshes); where slots stay in HBM
      **``"jit"`` costs speed** (before the VMEM slots, that step ran
      1.007x of the best XLA program's time against 0.934x). VMEM of
      your own kept across the block: :func:`fused_vmem`, see
      :func:`allgather_matmul`.

  Returns:
    An array shaped and sharded like ``x``, in ``x.dtype``.

  Raises:
    ValueError: a weight's shape does not match ``x`` (the message names
      the argument), ``sequence_dim`` is not a row dimension of ``x``, plus
      the errors of :func:`allgather_matmul` and
      :func:`matmul_reducescatter`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import AxisType, PartitionSpec as P
    >>> from asyncops.collective_matmul import mlp_block
    >>> mesh = jax.make_mesh((8,), ("y",), axis_types=(AxisType.Auto,))
    >>> # Llama-style SwiGLU in sequence-parallel layout: x [s/n, d].
    >>> @jax.jit
    ... @jax.shard_map(mesh=mesh,
    ...   in_specs=(P("y"), P(None, "y"), P("y", None), P(None, "y")),
    ...   out_specs=P("y"))
    ... def f(x, w_up, w_down, w_gate):
    ...   return mlp_block(x, w_up, w_down, "y", w_gate=w_gate,
    ...                    activation=jax.nn.silu, sequence_parallel=True)
    >>> x = jnp.arange(16.0 * 8).reshape(16, 8) % 5 / 5
    >>> w_up = w_gate = jnp.ones((8, 16)) / 8
    >>> w_down = jnp.ones((16, 8)) / 16
    >>> want = (jax.nn.silu(x @ w_gate) * (x @ w_up)) @ w_down
    >>> bool(jnp.allclose(f(x, w_up, w_down, w_gate), want))
    True
  """
  fn = "mlp_block"
  _validate.api(api, fn)
  memory = _validate.memory(memory, fn)
  _validate.operand(x, fn, "x", matrix=False)
  weights = (("w_in", w_in), ("w_out", w_out))
  if w_gate is not None:
    weights += (("w_gate", w_gate),)
  for name, v in weights:
    _validate.operand(v, fn, name)
    _validate.same_dtype(x, v, fn, ("x", name))
  n = _validate.axis(axis_name, fn)
  if sequence_parallel:
    dim = _validate.dim(
      sequence_dim,
      len(x.shape),
      fn,
      "sequence_dim",
      "It is the dimension of x sharded over the axis (e.g. -2 for "
      "[b, s/n, d], 0 for [s/n, b, d]).",
    )
    if dim == len(x.shape) - 1:
      raise ValueError(
        f"{fn}: sequence_dim = {sequence_dim} is the model dimension of x "
        f"{tuple(x.shape)}; with sequence_parallel=True x is sharded along "
        "a row (token) dimension. Pass that dimension, or use "
        "sequence_parallel=False for model-sharded x."
      )
    d = x.shape[-1]
    layout = "x.shape[-1] (the model dimension, whole per device)"
  else:
    dim = -1
    d = n * x.shape[-1]
    layout = "n * x.shape[-1] (the full model dimension)"
  _check_shapes(w_in, w_out, w_gate, d, layout, fn)
  # Data parallel: w_out's gradient all-reduce runs behind the up
  # projection's backward (_dp_window); w_in's behind its input gradient.
  window = _dp_window.plan(x, w_out, axis_name)
  if window is not None:
    ops = (x, w_in, w_out) + (() if w_gate is None else (w_gate,))
    x, w_in, w_out, *rest = _dp_window.open_(
      window, ops, [i == 2 for i in range(len(ops))]
    )
    w_gate = rest[0] if rest else None
  with jax.named_scope(fn):
    with jax.named_scope("up"):
      ws = (w_in,) if w_gate is None else (w_gate, w_in)
      hs = _allgather.allgather_matmul(
        x,
        ws,
        axis_name,
        gather_dim=dim,
        api=api,
        bidirectional=bidirectional,
        method=method,
        memory=memory,
      )
    h = activation(hs[0]) if w_gate is None else activation(hs[0]) * hs[1]
    if window is not None:
      h, w_out = _dp_window.mark(window, (h, w_out), (False, True))
    with jax.named_scope("down"):
      return _reducescatter.matmul_reducescatter(
        h,
        w_out,
        axis_name,
        scatter_dim=dim,
        api=api,
        bidirectional=bidirectional,
        method=method,
        memory=memory,
      )


def _check_shapes(w_in, w_out, w_gate, d: int, layout: str, fn: str) -> None:
  specs = "Shard w_in and w_gate as P(None, axis) and w_out as P(axis, None)."
  if w_in.shape[0] != d:
    raise ValueError(
      f"{fn}: w_in.shape[0] = {w_in.shape[0]} must be the model dimension "
      f"{d} = {layout}. {specs}"
    )
  if w_gate is not None and tuple(w_gate.shape) != tuple(w_in.shape):
    raise ValueError(
      f"{fn}: w_gate has shape {tuple(w_gate.shape)} but w_in has "
      f"{tuple(w_in.shape)}; the gate and up projections must match. "
      f"{specs}"
    )
  if w_out.shape[0] != w_in.shape[1]:
    raise ValueError(
      f"{fn}: w_out.shape[0] = {w_out.shape[0]} must equal w_in.shape[1] = "
      f"{w_in.shape[1]} (this device's slice of the hidden dimension). "
      f"{specs}"
    )
  if w_out.shape[1] != d:
    raise ValueError(
      f"{fn}: w_out.shape[1] = {w_out.shape[1]} must be the model "
      f"dimension {d} = {layout}, so the output is sharded like x. {specs}"
    )
