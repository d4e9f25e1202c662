"""Differentiation of the Ref API: tangent Refs, and a reverse transfer.

JAX differentiates a program over ``jax.Ref``s by giving every Ref a tangent
Ref (``jax.new_ref`` of a value gets one holding that value's tangent) and
turning reads and writes into reads and writes of the tangent Refs. A
transfer ``dst_ref <- T(src_ref)`` therefore has the tangent ``t_dst <-
T(t_src)``:

- at the start, the tangent source is read and handed to the value API's
  tangent transfer ``lin_start`` (:mod:`asyncops.futures._ad`);
- at the done, ``lin_done`` of it is written into the tangent destination
  (for a partial permute, devices nobody sends to keep their tangent, as
  they keep their data).

Transposed, the write becomes a read of the destination's cotangent, which
``lin_done``'s transpose starts sending back (``T^T``), and the read of the
source becomes an accumulation into its cotangent once ``lin_start``'s
transpose has awaited the reverse transfer. The start and the done find
each other through the start's semaphores (the done receives the very
tracers the start returned unless a loop carry or a ``jit`` boundary lies
between them; then the done transfers synchronously). The backward compute
between them is tied into the reverse window the way the forward's is
(``_jax_compat.tie_between``).

The semaphores are integers: ``float0`` tangents, zero cotangents.
"""

import weakref
from typing import Any

import jax
import jax.numpy as jnp
from jax.interpreters import ad

from asyncops import _jax_compat as jc
from asyncops.futures import _ad as fad
from asyncops.kernels._spec import OpSpec
from asyncops.stateful._layout import Layout
from asyncops.stateful._primitives import ref_done_p, ref_start_p

# The tangent transfer a start began, by its first semaphore tracer:
# id -> (semaphore, tangent destination value, pair).
_started: dict[int, tuple[Any, Any, Any]] = {}


def _remember(sems, d, pair) -> None:
  if not sems:
    return
  key = id(sems[0])
  _started[key] = (sems[0], d, pair)
  try:
    weakref.finalize(sems[0], _started.pop, key, None)
  except TypeError:  # not weakly referenceable: dropped when the done looks
    pass


def _recall(sems):
  if not sems:
    return None
  # The done may get the semaphores through the optimization barriers that
  # keep the window's compute in place (``_jax_compat.tie_between``).
  sem = jc.unforwarded(sems[0])
  entry = _started.get(id(sem))
  if entry is None or entry[0] is not sem:
    return None
  del _started[id(sem)]
  return entry[1], entry[2]


def _read(ref, slot, slotted):
  return ref[slot] if slotted else ref[...]


def _write(ref, slot, slotted, value):
  if slotted:
    ref[slot] = value
  else:
    ref[...] = value


def _receives(spec: OpSpec):
  """Whether this device receives (False only for partial permutes)."""
  me = jax.lax.axis_index(spec.axis_name)
  return jnp.isin(me, jnp.array(sorted(spec.destinations), jnp.int32))


def _sem_zeros(sems):
  return [ad.Zero(jax.typeof(s).to_tangent_aval()) for s in sems]


def _tangent_start(t_src, slot, layout: Layout, spec: OpSpec, sems, pairing):
  """Reads the tangent source and starts its transfer; remembers it."""
  if type(t_src) is ad.Zero:
    return
  v = _read(t_src, slot, layout.src_slotted)
  pair = None
  if pairing and jc.reaches_inputs(v):
    pair = fad.Pair(spec)
    pair.tie = True
  _remember(sems, fad.lin_start_p.bind(v, spec=spec, pair=pair), pair)


def _tangent_done(t_src, t_dst, slots, layout: Layout, spec: OpSpec, sems):
  """Writes the tangent destination: the transfer's tangent, at the done."""
  if type(t_dst) is ad.Zero:
    return
  s_src, s_dst = slots
  found = _recall(sems)
  if found is not None:
    d, pair = found
    if pair is not None and pair.claimed:
      pair = None
    if pair is not None:
      pair.claimed = True
    w = fad.lin_done_p.bind(d, spec=spec, pair=pair)
  elif type(t_src) is not ad.Zero:
    v = _read(t_src, s_src, layout.src_slotted)
    w = fad.lin_start_p.bind(v, spec=spec, pair=None)
  else:
    w = jnp.zeros(fad.prims.dst_shape(spec), spec.np_dtype)
  if spec.kind == "ppermute" and not spec.is_full_perm:
    old = _read(t_dst, s_dst, layout.dst_slotted)
    w = jnp.where(_receives(spec), w, old)
  _write(
    t_dst,
    s_dst,
    layout.dst_slotted,
    w.reshape(_read_shape(t_dst, layout.dst_slotted)),
  )


def _read_shape(ref, slotted):
  shape = jax.typeof(ref).inner_aval.shape
  return shape[1:] if slotted else shape


def _split(args, layout: Layout):
  n = layout.n_bufs
  return args[:n], args[n : n + 2], args[n + 2 :]


# Linearization (jax.grad, jax.vjp, jax.linearize) ------------------------


def _require_reverse_mode(spec: OpSpec) -> None:
  """Refuses reverse mode on a jax that cannot transpose Ref programs."""
  if jc.REF_REVERSE_MODE:
    return
  raise NotImplementedError(
    f"asyncops: jax.grad / jax.vjp / jax.linearize through the Ref API "
    f"({spec.kind} over {spec.axis_name!r}) needs jax >= 0.10; this is jax "
    f"{jax.__version__}, which transposes Ref programs with cotangents "
    "that lost their varying mesh axes. Fix: pip install 'jax>=0.10', or "
    "use the value API (asyncops.futures, api='value'), whose gradients "
    "work on this jax. (jax.jvp works here.)"
  )


def _ref_start_lin(is_vjp, nzs, *args, spec, layout, token):
  del is_vjp, nzs
  _require_reverse_mode(spec)
  sems = ref_start_p.bind(*args, spec=spec, layout=layout, token=token)
  _, slots, _ = _split(args, layout)

  def linearized(residuals, *tangents):
    _tangent_start(
      tangents[layout.src_i], residuals[0], layout, spec, sems, pairing=True
    )
    return _sem_zeros(sems)

  return sems, [False] * len(sems), list(slots), linearized


def _ref_done_lin(is_vjp, nzs, *args, spec, layout):
  del is_vjp, nzs
  _require_reverse_mode(spec)
  ref_done_p.bind(*args, spec=spec, layout=layout)
  _, slots, sems = _split(args, layout)

  def linearized(residuals, *tangents):
    _tangent_done(
      tangents[layout.src_i],
      tangents[layout.dst_i],
      residuals,
      layout,
      spec,
      sems,
    )
    return []

  return [], [], list(slots), linearized


# jvp (jax.jvp; rules linearized through jvp, e.g. jax.checkpoint) --------


def _ref_start_jvp(primals, tangents, *, spec, layout, token):
  sems = ref_start_p.bind(*primals, spec=spec, layout=layout, token=token)
  _, slots, _ = _split(primals, layout)
  _tangent_start(
    tangents[layout.src_i], slots[0], layout, spec, sems, pairing=False
  )
  return sems, _sem_zeros(sems)


def _ref_done_jvp(primals, tangents, *, spec, layout):
  ref_done_p.bind(*primals, spec=spec, layout=layout)
  _, slots, sems = _split(primals, layout)
  _tangent_done(
    tangents[layout.src_i], tangents[layout.dst_i], slots, layout, spec, sems
  )
  return [], []


jc.register_linearization(ref_start_p, _ref_start_lin)
jc.register_linearization(ref_done_p, _ref_done_lin)
ad.primitive_jvps[ref_start_p] = _ref_start_jvp
ad.primitive_jvps[ref_done_p] = _ref_done_jvp
