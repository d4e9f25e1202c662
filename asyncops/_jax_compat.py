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
  "sem_like",
  "DMA_SEM_AVAL",
  "tpu_generation",
]

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
  """
  lowered = _mlir.lower_fun(fn, multiple_results=multiple_results)

  def rule(ctx, *args, **params):
    positions = tuple(sem_in(params)) if platform == "tpu" else ()
    if positions:
      avals = list(ctx.avals_in)
      for i in positions:
        avals[i] = DMA_SEM_AVAL
      ctx = ctx.replace(avals_in=avals)
    with _lowering_for(ctx):
      return lowered(ctx, *args, **params)

  if platform is None:
    _mlir.register_lowering(prim, rule)
  else:
    _mlir.register_lowering(prim, rule, platform=platform)


def register_effect(effect_type: type) -> None:
  """Allows an effect type inside control flow (loops, cond)."""
  from jax._src import effects as _effects  # effect registries.

  _effects.control_flow_allowed_effects.add_type(effect_type)
  _effects.lowerable_effects.add_type(effect_type)
  _effects.custom_derivatives_allowed_effects.add_type(effect_type)
  _effects.remat_allowed_effects.add_type(effect_type)


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
