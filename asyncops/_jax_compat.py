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

from collections.abc import Callable, Sequence
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
  "user_frame",
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
