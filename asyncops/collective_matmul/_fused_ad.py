"""Derivatives of the fused collective matmuls (``_fused``).

Both primitives are bilinear, so their JVP is the primitive on each tangent
(``p(tx, w) + p(x, tw)``) and their transposes are the other fused ring
where the shapes fit it, per device (``n`` the ring, ``g`` the cotangent):

- all-gather matmul ``y = AG_k(x) @ w`` (``x [m, k]``, ``w [n k, f]``):
  ``dx = RS_cols(g @ w^T)``, the **fused matmul-reduce-scatter** of ``g``
  and ``w^T``; ``dw = AG_k(x)^T @ g``, XLA's all-gather and a matmul (the
  fused kernel gathers a contracting dimension, here ``x`` is gathered
  along the output's rows).
- matmul-reduce-scatter ``y = RS_cols(x @ w)`` (``x [m, k]``,
  ``w [k, n c]``): ``dx = AG_c(g) @ w^T``, the **fused all-gather
  matmul**; ``dw = x^T @ AG_c(g)``, XLA's all-gather and a matmul.

``w^T`` is a transpose XLA materialises (the kernels read ``w`` blocks in
one layout). Where the fused kernel cannot take the transposed shapes
(``rs_supported`` / ``ag_supported`` on the traced chip), the transpose is
XLA's collective and ``jnp.dot``. ``transfer="int8"`` is not
differentiable (the quantization's derivative is zero almost everywhere):
refused with a clear error. ``matmul_allreduce`` is the reduce-scatter and
an all-gather, so it differentiates through these rules and JAX's.
"""

import jax
import jax.numpy as jnp
from jax.interpreters import ad

from asyncops import _jax_compat as jc
from asyncops.collective_matmul import _fused
from asyncops.collective_matmul._vjp import _like


def _nonzero(t) -> bool:
  return type(t) is not ad.Zero


def _bilinear_jvp(prim):
  def jvp(primals, tangents, **params):
    if params.get("quantized"):
      raise NotImplementedError(
        "asyncops: allgather_matmul(transfer='int8') is not differentiable "
        "(its int8 quantization has a zero derivative almost everywhere). "
        "Differentiate transfer='native' instead."
      )
    x, w = primals
    tx, tw = tangents
    out = prim.bind(x, w, **params)
    terms = []
    if _nonzero(tx):
      terms.append(prim.bind(tx, w, **params))
    if _nonzero(tw):
      terms.append(prim.bind(x, tw, **params))
    if not terms:
      return out, ad.Zero(jax.typeof(out).to_tangent_aval())
    return out, terms[0] if len(terms) == 1 else terms[0] + terms[1]

  return jvp


def _common(params, dtype):
  """The params of the other fused ring for a transpose."""
  return dict(
    axis_name=params["axis_name"],
    mesh_axes=params["mesh_axes"],
    n=params["n"],
    directions=params["directions"],
    out_dtype=jnp.dtype(dtype).name,
    precision=params["precision"],
    collective_id=None,
  )


def _dot(a, b, ca: int, cb: int, dtype):
  out = jax.lax.dot_general(
    a,
    b,
    (((ca,), (cb,)), ((), ())),
    precision=jax.lax.Precision.HIGHEST,
    preferred_element_type=jnp.float32,
  )
  return out.astype(dtype)


def _typed(ct, primal):
  """``ct`` summed over the mesh axes ``primal`` does not vary over (the
  cotangent of a replicated weight), in its dtype."""
  if ct is None:
    return None
  return _like(ct, primal.aval)


def _ag_transpose(ct, x, w, **params):
  """``y = AG_k(x) @ w``."""
  ax = params["axis_name"]
  ct = ad.instantiate_zeros(ct)
  dx = dw = None
  if ad.is_undefined_primal(x):
    m, k = x.aval.shape
    f = w.shape[1]
    wt = jnp.swapaxes(w, 0, 1)  # [f, n k]
    dt = x.aval.dtype
    why = _fused.rs_supported(
      m, f, k, params["n"], dt, params["directions"], jc.trace_device_kind()
    )
    if why is None:
      dx = _fused.reducescatter_matmul_p.bind(
        ct.astype(dt), wt.astype(dt), **_common(params, dt)
      )
    else:
      dx = jax.lax.psum_scatter(
        _dot(ct, wt, 1, 0, dt), ax, scatter_dimension=1, tiled=True
      )
  if ad.is_undefined_primal(w):
    g = jax.lax.all_gather(x, ax, axis=1, tiled=True)  # [m, n k]
    dw = _dot(g, ct, 0, 0, w.aval.dtype)
  return _typed(dx, x), _typed(dw, w)


def _rs_transpose(ct, x, w, **params):
  """``y = RS_cols(x @ w)``."""
  ax = params["axis_name"]
  ct = ad.instantiate_zeros(ct)
  dx = dw = None
  if ad.is_undefined_primal(x):
    m, k = x.aval.shape
    dt = x.aval.dtype
    wt = jnp.swapaxes(w, 0, 1)  # [n c, k]
    c = ct.shape[1]
    why = _fused.ag_supported(
      m, c, k, params["n"], dt, params["directions"], jc.trace_device_kind()
    )
    if why is None:
      dx = _fused.allgather_matmul_p.bind(
        ct.astype(dt), wt.astype(dt), quantized=False, **_common(params, dt)
      )
    else:
      g = jax.lax.all_gather(ct, ax, axis=1, tiled=True)
      dx = _dot(g, wt, 1, 0, dt)
  if ad.is_undefined_primal(w):
    g = jax.lax.all_gather(ct, ax, axis=1, tiled=True)  # [m, n c]
    dw = _dot(x, g, 0, 0, w.aval.dtype)
  return _typed(dx, x), _typed(dw, w)


ad.primitive_jvps[_fused.allgather_matmul_p] = _bilinear_jvp(
  _fused.allgather_matmul_p
)
ad.primitive_jvps[_fused.reducescatter_matmul_p] = _bilinear_jvp(
  _fused.reducescatter_matmul_p
)
ad.primitive_transposes[_fused.allgather_matmul_p] = _ag_transpose
ad.primitive_transposes[_fused.reducescatter_matmul_p] = _rs_transpose
