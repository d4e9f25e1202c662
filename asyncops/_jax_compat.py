"""The one place asyncops touches JAX internals.

Why this module exists: a value-level future must travel through jaxprs as
ordinary arrays on every platform, yet on TPU its semaphores are Pallas
semaphore values. We therefore define our own primitives whose abstract
semaphore outputs are ``int32[]`` (the physical representation of a TPU
semaphore, ``s32[]{:S(2)}`` in HLO) and register one lowering per platform:
the TPU rule re-types those operands as semaphores before tracing the Pallas
kernel. Lowering rules and the rule context are not public API, so every use
of ``jax._src`` is here; a JAX upgrade should be one edit of this file.

Pinned to jax 0.10.2.
"""

import contextlib
import contextvars
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from jax._src import core as _core  # ShapedArray.update with mesh types.
from jax._src.interpreters import mlir as _mlir  # lowering registration.
from jax.experimental.pallas import tpu as _pltpu
from jax.extend.core import Primitive

__all__ = [
  "Primitive",
  "register_lowering",
  "register_effect",
  "module_scope",
  "sem_like",
  "DMA_SEM_AVAL",
  "user_frame",
  "tpu_generation",
]

# Source attribution. JAX records, for every equation, the innermost frame
# that is not its own code ("user frame"); that frame becomes the HLO
# metadata (source_file/source_line) and what error messages point at.
# Registering this package's directory (public API:
# ``jax.extend.source_info_util.register_exclusion``) makes JAX skip our
# frames too, so the compiled HLO names the user's line that called
# ``ppermute_start``, not ``asyncops/futures/_api.py``.
import os as _os  # noqa: E402

from jax.extend import source_info_util as _public_source_info  # noqa: E402

PACKAGE_DIR = _os.path.dirname(_os.path.abspath(__file__)) + _os.sep
_public_source_info.register_exclusion(PACKAGE_DIR)

# The aval a Pallas TPU DMA semaphore has inside a jaxpr.
DMA_SEM_AVAL = _pltpu.SemaphoreType.DMA.get_array_aval()
REGULAR_SEM_AVAL = _pltpu.SemaphoreType.REGULAR.get_array_aval()


def sem_like(aval: Any) -> Any:
  """An ``int32[]`` aval carrying ``aval``'s mesh and varying manual axes.

  Under ``shard_map`` with ``check_vma`` the semaphore outputs must vary over
  the same manual axes as the buffer they belong to.
  """
  sharding = getattr(aval, "sharding", None)
  if sharding is not None and getattr(sharding, "mesh", None) is not None:
    sharding = jax.sharding.NamedSharding(
      sharding.mesh, jax.sharding.PartitionSpec()
    )
    return aval.update(
      shape=(), dtype=jax.numpy.int32, weak_type=False, sharding=sharding
    )
  return _core.ShapedArray((), jax.numpy.int32)


def register_lowering(
  prim: Primitive,
  fn: Callable[..., Any],
  *,
  platform: str | None = None,
  sem_in: Callable[[dict], Sequence[int]] = lambda params: (),
  multiple_results: bool = True,
  prepare: Callable[[dict, dict], dict] | None = None,
) -> None:
  """Registers ``fn`` (a traceable JAX function) as ``prim``'s lowering.

  Args:
    prim: the primitive.
    fn: called as ``fn(*operands, **params)`` under tracing.
    platform: ``None`` for the default rule, or e.g. ``"tpu"``.
    sem_in: given the params, the operand positions that are semaphores; on
      TPU those operands are re-typed from ``int32[]`` to DMA semaphores
      before ``fn`` is traced (their IR type is the same).
    multiple_results: whether ``fn`` returns a sequence.
    prepare: optional ``prepare(scope, params) -> params`` run before
      tracing ``fn``; ``scope`` is a dict that lives as long as the module
      being lowered (see :func:`module_scope`).
  """
  lowered = _mlir.lower_fun(fn, multiple_results=multiple_results)

  def rule(ctx, *args, **params):
    positions = tuple(sem_in(params)) if platform == "tpu" else ()
    if positions:
      avals = list(ctx.avals_in)
      for i in positions:
        avals[i] = DMA_SEM_AVAL
      ctx = ctx.replace(avals_in=avals)
    if prepare is not None:
      params = prepare(module_scope(ctx), params)
    with _lowering_for(ctx):
      return lowered(ctx, *args, **params)

  if platform is None:
    _mlir.register_lowering(prim, rule)
  else:
    _mlir.register_lowering(prim, rule, platform=platform)


def module_scope(ctx) -> dict:
  """A dict private to asyncops, shared by every rule of one lowered module.

  Why: barrier-semaphore ids must differ between communication patterns
  within one program, but may be reused across programs; allocating them per
  module keeps a long process (a test session, a server compiling many
  programs) from running out. The rule context's ``module_context`` is
  internal; its ``cached_primitive_lowerings`` dict is one object per module
  (``replace`` shares it), so we keep our scope under a private key there.
  """
  cache = ctx.module_context.cached_primitive_lowerings
  return cache.setdefault(("asyncops", "module_scope"), {})


def register_effect(effect_type: type) -> None:
  """Allows an effect type inside control flow (loops, cond)."""
  from jax._src import effects as _effects  # effect registries.

  _effects.control_flow_allowed_effects.add_type(effect_type)
  _effects.lowerable_effects.add_type(effect_type)
  _effects.custom_derivatives_allowed_effects.add_type(effect_type)
  _effects.remat_allowed_effects.add_type(effect_type)


def user_frame(eqn: Any, skip: Sequence[str] = ("/asyncops/",)) -> str:
  """``file:line (function)`` of the user code that created ``eqn``.

  A jaxpr equation's ``source_info`` is not public API; its traceback lists
  frames innermost first. We return the first frame outside JAX, asyncops
  (``skip``) and ``contextlib``.
  """
  tb = getattr(getattr(eqn, "source_info", None), "traceback", None)
  if tb is None:
    return "<unknown>"
  for fr in tb.frames:
    f = fr.file_name
    if "/jax/" in f or "/jaxlib/" in f or "contextlib" in f:
      continue
    if any(s in f for s in skip):
      continue
    return f"{f}:{fr.line_num} ({fr.function_name})"
  return "<unknown>"


# Stateful API (asyncops.stateful) --------------------------------------------
#
# Why: the Ref API defines primitives whose operands are ``jax.Ref``s. They
# need (1) state effects on those operands, so JAX orders them against every
# other read and write of the same Refs and never drops them, (2) a discharge
# rule, which turns them into our value-level primitives when JAX removes
# state before lowering, and (3) a look at the equations traced since a
# start, for the trace-time hazard check and to keep compute written
# between a start and its done there. None of this is public API in 0.10.2.

from jax._src import effects as _effects  # noqa: E402 (Effect base class).
from jax._src import source_info_util as _source_info  # noqa: E402
from jax._src.interpreters import partial_eval as _pe  # noqa: E402
from jax._src.state import discharge as _discharge  # noqa: E402
from jax._src.state import types as _state  # noqa: E402

Effect = _effects.Effect
TransformedRef = _state.TransformedRef


def ref_effects(reads: Sequence[int], writes: Sequence[int]) -> set:
  """Read/Write effects on the Ref operands at the given positions."""
  return {_state.ReadEffect(i) for i in reads} | {
    _state.WriteEffect(i) for i in writes
  }


def is_ref(x: Any) -> bool:
  """Whether ``x`` is a (traced) ``jax.Ref`` or a transformed one."""
  return (
    isinstance(x, TransformedRef)
    or isinstance(getattr(x, "aval", None), _state.AbstractRef)
    or isinstance(x, _core.Ref)
  )


def ref_inner_aval(ref: Any) -> Any:
  """The array aval a Ref holds."""
  return _core.typeof(ref).inner_aval


def register_discharge(prim: Primitive, rule: Callable[..., Any]) -> None:
  """``rule(in_avals, out_avals, *vals, **params) -> (new_ins, outs)``."""
  _discharge.register_discharge_rule(prim)(rule)


def current_frame(x: Any) -> Any:
  """The jaxpr frame ``x`` (a tracer) is being traced into, or None."""
  trace = getattr(x, "_trace", None)
  return (
    getattr(trace, "frame", None)
    if isinstance(trace, _pe.DynamicJaxprTrace)
    else None
  )


def live_eqns(frame: Any) -> list[Any]:
  """The frame's equations traced so far, in order (dead ones skipped)."""
  out = []
  for e in frame.tracing_eqns:
    e = e() if callable(e) and not isinstance(e, _pe.TracingEqn) else e
    if e is not None:
      out.append(e)
  return out


def eqn_vals(eqn: Any) -> list[Any]:
  """The ``Var``s an equation reads (its input tracers' values)."""
  return [getattr(t, "val", t) for t in eqn.in_tracers]


def eqn_where(eqn: Any) -> str:
  """``file:line (fn)`` of the user code that traced ``eqn``."""
  return _source_info.summarize(eqn.source_info)


def ref_effect_inputs(eqn: Any) -> tuple[set[int], set[int]]:
  """Operand positions ``eqn`` reads and writes as Refs."""
  reads, writes = set(), set()
  vals = eqn_vals(eqn)
  for eff in eqn.effects:
    if not isinstance(eff, _state.RefEffect):
      continue
    where = eff.input
    if not isinstance(where, int):  # resolved to the Ref's Var
      where = next((i for i, v in enumerate(vals) if v is where), None)
      if where is None:
        continue
    (reads if isinstance(eff, _state.ReadEffect) else writes).add(where)
  return reads, writes


# An optimization barrier without optimization_barrier's check that every
# operand varies over the same manual axes (semaphores and weights differ).
tie_p = Primitive("asyncops_tie")
tie_p.multiple_results = True
tie_p.def_abstract_eval(lambda *avals: list(avals))


def _tie_lowering(ctx, *args):
  del ctx
  from jax._src.lib.mlir.dialects import hlo as _hlo  # the HLO op.

  return _hlo.OptimizationBarrierOp(args).results


_mlir.register_lowering(tie_p, _tie_lowering)


def _tie_nonzero(vals: Sequence[Any]) -> list[Any]:
  """``tie_p`` over the values that are not symbolic zeros."""
  from jax.interpreters import ad

  keep = [i for i, v in enumerate(vals) if type(v) is not ad.Zero]
  out = list(vals)
  if keep:
    tied = tie_p.bind(*(vals[i] for i in keep))
    for i, v in zip(keep, tied, strict=True):
      out[i] = v
  return out


def _tie_jvp(primals, tangents):
  # Tangents (and cotangents) keep the tie among themselves: the backward
  # of compute kept in a window is kept together too. Symbolic zeros stay
  # zeros (a float0 semaphore tangent has nothing to order).
  return tie_p.bind(*primals), _tie_nonzero(tangents)


def _tie_transpose(cts, *primals):
  del primals
  return _tie_nonzero(cts)


def _tie_batch(args, dims):
  return tie_p.bind(*args), dims


def _register_tie_rules() -> None:
  from jax.interpreters import ad, batching

  ad.primitive_jvps[tie_p] = _tie_jvp
  ad.primitive_transposes[tie_p] = _tie_transpose
  batching.primitive_batchers[tie_p] = _tie_batch


_register_tie_rules()


def tie_between(start_eqn: Any, sems: list[Any]) -> list[Any]:
  """Keeps pure compute traced after ``start_eqn`` after it and before now.

  Inserts ``optimization_barrier(*inputs, *sems)`` right after the start
  and points the pure equations traced since then at its outputs (so they
  run after the start), then returns ``sems`` passed through a second
  barrier with those equations' results (so the done runs after them); that
  barrier takes over the results' Vars, so later code reads its outputs.
  ``sems`` are the start's semaphore tracers. Without this XLA may hoist the
  compute above the start (measured on v5e). Equations stay in the frame,
  so user tracers of their results remain valid.
  """
  frame = current_frame(sems[0])
  trace = sems[0]._trace
  eqns = live_eqns(frame)
  at = next((i for i, e in enumerate(eqns) if e is start_eqn), None)
  if at is None:
    return sems
  after = eqns[at + 1 :]
  defined = {v for e in after for v in e.outvars}
  between = [e for e in after if not e.effects]
  if not between:
    return sems
  outside: dict[Any, Any] = {}
  used = set()
  for e in between:
    for t in e.in_tracers:
      v = getattr(t, "val", None)
      if isinstance(v, _core.Var):
        used.add(v)
      if isinstance(v, _core.Var) and v not in defined:
        outside.setdefault(v, t)
  if outside:
    ins = list(outside.values())
    n = len(frame.tracing_eqns)
    outs = tie_p.bind(*ins, *sems)
    (barrier,) = frame.tracing_eqns[n:]
    del frame.tracing_eqns[n:]
    pos = next(
      i
      for i, e in enumerate(frame.tracing_eqns)
      if (e if isinstance(e, _pe.TracingEqn) else e()) is start_eqn
    )
    frame.tracing_eqns.insert(pos + 1, barrier)
    new = {t.val: o for t, o in zip(ins, outs[: len(ins)], strict=False)}
    for e in between:
      e.in_tracers = [
        new.get(t.val, t) if isinstance(t.val, _core.Var) else t
        for t in e.in_tracers
      ]
  leaves = [(e, v) for e in between for v in e.outvars if v not in used]
  if not leaves:
    return sems
  tracers = [trace.var_to_tracer(v, e.source_info, e) for e, v in leaves]
  n = len(frame.tracing_eqns)
  outs = tie_p.bind(*tracers, *sems)
  tie = _resolve(frame.tracing_eqns[n])
  # Later uses of a result must read the barrier's output, or XLA may fuse
  # (duplicate) the compute into a consumer after the done, re-reading an
  # in-flight buffer there (measured: a copy of it on v5e). So the barrier
  # takes over the result's Var and the equation gets the barrier's fresh
  # one; results an equation traced since the start already reads keep
  # theirs.
  read = {id(getattr(t, "val", None)) for e in after for t in e.in_tracers}
  for k, (e, v) in enumerate(leaves):
    if id(v) in read:
      continue
    fresh = tie.outvars[k]
    e.outvars = [fresh if o is v else o for o in e.outvars]
    tie.outvars[k] = v
    tie.in_tracers[k] = trace.var_to_tracer(fresh, e.source_info, e)
  return list(outs[len(leaves) :])


def _resolve(entry: Any) -> Any:
  """A frame entry as its ``TracingEqn`` (entries may be weak references)."""
  return entry if isinstance(entry, _pe.TracingEqn) else entry()


# The device kind (e.g. "TPU v4") a TPU rule is lowering for. Kernels that
# only some chips support need it at trace time, and an ahead-of-time
# compile from a CPU host has no TPU default device to ask; the rule context
# knows the target devices. Set around every rule by ``register_lowering``.
_device_kind: contextvars.ContextVar[str | None] = contextvars.ContextVar(
  "asyncops_device_kind", default=None
)


def _kind_of(ctx) -> str | None:
  """The device kind of the devices a lowering rule context targets."""
  # Rule contexts are internal (LoweringRuleContext.module_context). Under
  # shard_map the abstract mesh names the device kind; plain jit may give a
  # ShardingContext with a device assignment, or none (one device), and then
  # the backend (for an ahead-of-time compile, the topology's compile-only
  # client) has the devices.
  module = ctx.module_context
  axis_ctx = getattr(module, "axis_context", None)
  devices = getattr(axis_ctx, "device_assignment", None)
  if devices:
    return devices[0].device_kind
  for m in (getattr(axis_ctx, "mesh", None), jax.sharding.get_abstract_mesh()):
    device = getattr(m, "abstract_device", None)
    if device is not None:
      return device.device_kind
    if isinstance(m, jax.sharding.Mesh) and m.devices.size:
      return m.devices.flat[0].device_kind
  backend = getattr(module, "backend", None)
  try:
    return backend.devices()[0].device_kind
  except Exception:  # no backend, or one without devices: unknown target
    return None


@contextlib.contextmanager
def _lowering_for(ctx) -> Iterator[None]:
  token = _device_kind.set(_kind_of(ctx))
  try:
    yield
  finally:
    _device_kind.reset(token)


def tpu_generation() -> int | None:
  """The TPU generation being lowered for (4 for "TPU v4"), or None.

  Only meaningful inside an asyncops TPU lowering rule; None when the target
  is unknown (callers must then not reject the program).
  """
  kind = _device_kind.get()
  match = re.match(r"TPU ?v?(\d+)", kind or "")
  return int(match.group(1)) if match else None


# Differentiation and batching (asyncops.futures._ad, _batching) --------------
#
# Why: the backward of a start/done pair is a transfer started at the done's
# transpose and awaited at the start's transpose, but JAX transposes one
# equation at a time and a future's semaphores are integers (float0
# cotangents), so the reverse transfer's future cannot travel as a
# cotangent. The rules pair a done with its start when both are linearized
# in one tangent jaxpr: that needs JAX's per-primitive linearization hook
# (``primitive_linearizations``, used by ``jax.grad``/``vjp``/``linearize``
# in 0.10) and a look at which equation produced a tangent tracer (to follow
# it back through optimization barriers to its start). The transposes meet
# in the trace they run in. None of this is public API in 0.10.2.

from jax._src.interpreters import ad as _ad  # noqa: E402 (linearization hook)


def register_linearization(prim: Primitive, rule: Callable[..., Any]) -> None:
  """``rule(is_vjp, nonzeros, *primals, **params) -> (primal_out,
  nonzeros_out, residuals, linearized)``, as for ``jax.lax.sin``."""
  _ad.primitive_linearizations[prim] = rule


def current_trace() -> Any:
  """The trace that binds primitives now (a transpose's output trace)."""
  return _core.unsafe_get_current_trace()


_FORWARDING = ("optimization_barrier", "asyncops_tie")


def _producer(t: Any) -> tuple[Any, int] | None:
  eqn = (
    getattr(t, "parent", None)
    if isinstance(t, _pe.DynamicJaxprTracer)
    else None
  )
  if eqn is None:
    return None
  for i, o in enumerate(eqn.outvars):
    if o is t.val:
      return eqn, i
  return None


def forwarded_from(t: Any, prim: Primitive) -> tuple[dict, Any] | None:
  """``(params, input tracer)`` of the ``prim`` equation that made ``t``.

  Follows ``t`` back through optimization barriers (an output is its
  operand at the same position) within ``t``'s jaxpr; None when ``t`` was
  made by anything else, or is an input of the jaxpr being traced.
  """
  seen = 0
  while seen < 10_000:
    seen += 1
    found = _producer(t)
    if found is None:
      return None
    eqn, i = found
    if eqn.primitive is prim:
      return eqn.params, eqn.in_tracers[0]
    if eqn.primitive.name not in _FORWARDING:
      return None
    t = eqn.in_tracers[i]
  return None


def unforwarded(t: Any) -> Any:
  """``t`` before the optimization barriers it passed through (its jaxpr)."""
  for _ in range(10_000):
    found = _producer(t)
    if found is None or found[0].primitive.name not in _FORWARDING:
      return t
    t = found[0].in_tracers[found[1]]
  return t


def same_value(t: Any, u: Any) -> bool:
  """Whether ``t`` is ``u`` passed through optimization barriers only."""
  if t is u:
    return True
  target = getattr(u, "val", None)
  for _ in range(10_000):
    if target is not None and getattr(t, "val", None) is target:
      return True
    found = _producer(t)
    if found is None or found[0].primitive.name not in _FORWARDING:
      return False
    t = found[0].in_tracers[found[1]]
  return False


def reaches_inputs(t: Any) -> bool:
  """Whether tracer ``t`` depends on an input of the jaxpr it is traced in.

  In a tangent jaxpr the inputs are the tangents; a value that depends on
  none of them (an instantiated zero, a function of residuals only) is a
  constant, which JAX evaluates rather than transposes.
  """
  if not isinstance(t, _pe.DynamicJaxprTracer):
    return False
  frame = getattr(t._trace, "frame", None)
  if frame is None:
    return False
  inputs = {id(v) for v in frame.invars}
  stack, seen = [t], set()
  while stack:
    u = stack.pop()
    if id(u) in seen:
      continue
    seen.add(id(u))
    if id(getattr(u, "val", None)) in inputs:
      return True
    eqn = getattr(u, "parent", None)
    if eqn is not None and getattr(eqn.primitive, "ref_primitive", False):
      return True  # a new Ref: JAX transposes everything that reads it
    if eqn is not None:
      stack.extend(
        x for x in eqn.in_tracers if isinstance(x, _pe.DynamicJaxprTracer)
      )
  return False
