"""The one place asyncops touches JAX internals.

Why this module exists: a value-level future must travel through jaxprs as
ordinary arrays on every platform, yet on TPU its semaphores are Pallas
semaphore values. We therefore define our own primitives whose abstract
semaphore outputs are ``int32[]`` (the physical representation of a TPU
semaphore, ``s32[]{:S(2)}`` in HLO) and register one lowering per platform:
the TPU rule re-types those operands as semaphores before tracing the Pallas
kernel. Lowering rules and the rule context are not public API, so every use
of ``jax._src`` is here; a JAX upgrade should be one edit of this file.

Supported: jax 0.9.0 to 0.10.x (``pyproject.toml``); CI runs the suite on
the oldest and the newest. The differences between them, and the renames
jax 0.11 makes, are in the "Versions" section below: every other module
uses the names defined there.
"""

import contextlib
import contextvars
import functools as _functools
import inspect as _inspect
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from jax._src import core as _core  # ShapedArray.update with mesh types.
from jax._src.interpreters import mlir as _mlir  # lowering registration.
from jax.experimental.pallas import tpu as _pltpu
from jax.extend.core import Primitive

__all__ = [
  "JAX_VERSION",
  "shape_like",
  "manual_axes_kwargs",
  "jaxprs_in_params",
  "is_drop_var",
  "all_gather_invariant",
  "ANY",
  "SEMAPHORE",
  "DeviceIdType",
  "semaphore_signal",
  "semaphore_wait",
  "get_barrier_semaphore",
  "tpu_compiler_params",
  "user_source_frame",
  "Primitive",
  "register_lowering",
  "register_effect",
  "module_scope",
  "sem_like",
  "DMA_SEM_AVAL",
  "user_frame",
  "tpu_generation",
  "tpu_device_kind",
  "trace_device_kind",
  "trace_concrete_mesh",
]

# Versions -------------------------------------------------------------------
#
# What differs between the supported jax versions, and what jax 0.11
# renames, each in one place. Facts from jax's CHANGELOG.md and
# docs/pallas/CHANGELOG.md:
# - 0.10.0 replaced ``ShapedArray.vma`` / ``ShapeDtypeStruct(vma=)`` with
#   ``manual_axis_type`` (``.manual_axis_type.varying``).
# - 0.10.0 moved ``semaphore_signal/_wait/_read``, ``DeviceIdType`` and
#   ``semaphore`` from ``pallas.tpu`` to ``pallas`` (both exist in 0.9.x
#   and 0.10.x; 0.11.0 removes the ``pallas.tpu`` ones) and removed
#   ``pltpu.ANY`` (use ``pl.ANY``, present since before 0.9.0).
# - 0.10.2 added ``jax.ShapeDtypeStruct.like``.
# - 0.11.0 adds ``jax_pallas_auto_assign_collective_ids`` ("no" by
#   default: our explicit ids stand) and makes ``pl.kernel`` alias only
#   written Refs (we alias explicitly with ``pallas_call``'s
#   ``input_output_aliases``, unaffected).
# - (measured, not in the changelogs) 0.9's Pallas types a kernel's refs
#   with their operands' varying manual axes, 0.10's with none; an output
#   declared by memory space (``pltpu.VMEM(shape, dtype)``, ``HBM``)
#   varies over none in both (``kernels._common.vary_like`` types it as
#   its input varies: a ``lax.cond`` between reads of both then
#   type-checks on 0.9).
# - jax.extend.core gained ``jaxprs_in_params`` in 0.10.0; state effects
#   name their operand ``input`` (0.10) or ``input_index`` (0.9).

from jax.experimental import pallas as _pl  # noqa: E402


def _version(text: str) -> tuple[int, ...]:
  return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


JAX_VERSION = _version(jax.__version__)

# A RefFuture awaited in ``lax.cond`` branches that close over it is tied in
# the start's frame (``tie_window``) from jax 0.10 on. jax 0.9's libtpu
# prefetches the cond's source operand into VMEM once the compute sits in
# the window and hands the branch's done that copy (v5e, `source not live`:
# the original freed while the DMA reads it; design/inspect.md); untied,
# v5e compiles it clean and v6e is refused by the guard as before.
CAPTURED_WINDOW_TIE = JAX_VERSION >= (0, 10)

# jax 0.9 transposes a program over ``jax.Ref``s with cotangents that lost
# their varying manual axes ("expected cotangent type f32[...]{V:(x,y)}"
# inside shard_map): reverse mode through the Ref API's primitives needs
# jax 0.10 (``asyncops.stateful._ad`` refuses it earlier, with the fix).
REF_REVERSE_MODE = JAX_VERSION >= (0, 10)

# A ``jax.Ref`` made outside a ``shard_map`` and passed in as an argument:
# jax 0.10 traces it (one Ref passed twice too: each name its own copy,
# refused by the hazard check when a transfer uses it); jax 0.9 fails
# inside JAX (``reshard`` asserts a ShapedArray).
REF_INTO_SHARD_MAP = JAX_VERSION >= (0, 10)

# The libtpu of jax 0.9 (0.0.34) aborts the whole process (a failed CHECK
# in memory-space assignment, "Conflicting pending required assignment")
# compiling programs whose kernels move 8-bit floats or 4-bit types; the
# libtpu of jax 0.10 (0.0.42) compiles them (tests/test_dtypes_tpu.py).
# Older jax refuses those dtypes at trace time, naming the fix.
NARROW_DMA = JAX_VERSION >= (0, 10)

# (measured) The libtpu of jax 0.9 (0.0.34) leaves a few ring windows
# empty that the libtpu of jax 0.10 fills, from the same traced window
# (start, barrier, compute, barrier, done); nothing is copied, the
# transfer is exposed (design/README.md "Branch h-suite09"), on v5e and
# v6e alike:
# - under ``jax.grad``, the forward's second transfer of the long-prefill
#   two-way ring of whole chunks (``_gather_rings._whole_pieces``: piece
#   1's first, 256 rows of x each way at the chapter shape): its done
#   right after its start, the step's dot after both
#   (tests/test_collective_matmul_tpu.py);
# - the torus all-gather matmul's step 2 (both axes' transfers,
#   tests/test_torus_matmul.py).
ALL_WINDOWS_KEPT = JAX_VERSION >= (0, 10)

# (measured) The gated MLP's one-way up ring keeps its two weights behind
# the step barriers (``_gather_rings.weights_barrier``); the libtpu of jax
# 0.10 then prefetches neither into VMEM across programs, the libtpu of
# jax 0.9 still prefetches one on v5e (a read-only copy of a parameter,
# not a transfer's buffer; the dots reading it tiled slower,
# design/benchmarks.md "The one-way value ring's weight").
# tests/test_collective_matmul_shapes_tpu.py.
WEIGHTS_BARRIER_STOPS_PREFETCH = JAX_VERSION >= (0, 10)

# (measured) The libtpu of jax 0.9 (0.0.34), the separate source of a Ref
# transfer pinned to HBM (``stateful._kernels._pinned``), compiles a
# RefFuture awaited in capturing ``lax.cond`` / ``lax.switch`` branches
# (v6e), or in such branches of a ``lax.scan`` body (v5e, v6e), with the
# source prefetched into VMEM for the conditional (a copy-start after the
# start) and the branch's done handed that copy, not the buffer its DMA
# reads (``source not live``: XLA may free or reuse the source while the
# DMA still reads it). Unpinned (start and done), the same programs get
# one buffer, no copy, on v5e, v6e and v5p: on older jax
# ``stateful._api._unpin_captured`` unpins such a transfer, and refuses at
# trace time a future passed in (a loop carry, an argument: its start is
# not known there; pinned, "source not live" on v5e and v6e). The libtpu
# of jax 0.10 (0.0.42) compiles them clean pinned: nothing changes there
# (tests/test_guard_split.py, tests/test_stateful.py; design/stateful.md
# "jax 0.9: a Ref future awaited in a capturing branch (branch h-jax09)").
CAPTURED_DONE_SOURCE_LIVE = JAX_VERSION >= (0, 10)

# (measured) The Ref API's two-way ring of whole chunks
# (``allgather_matmul(api="ref", bidirectional=True)``, whole chunks) hands
# two Ref-API starts the same zeros broadcast as their destinations'
# initial value. The libtpu of jax 0.9 (0.0.34) gives the first its own
# buffer with a defensive VMEM->VMEM copy (``bf16[2,256,512]``, 512 KiB at
# the chapter shape; 4076 cycles on v5e, 3364 on v6e), before that start
# and outside every window: nothing in flight is copied and the guard
# accepts it (``Copy.feeds_destination``), a cost, not a hazard. The
# libtpu of jax 0.10 (0.0.42) makes no such copy
# (tests/test_ref_whole_tpu.py; design/README.md "h-suite09b").
REF_RING_DESTINATIONS_UNCOPIED = JAX_VERSION >= (0, 10)

# (measured) The fused reduce-scatter's steps kernel: the Mosaic of jax
# 0.10 uses at most ``rsk.scoped_vmem_bytes`` (its blocks and scratch)
# plus 36 KiB of its own; the Mosaic of jax 0.9 uses 1.05 to 4.06 MiB more
# (v5p tp 4 M 256: 17358848 bytes against 16252928; v6e tp 8 M 1024:
# 29421568 against 25165824), still inside the scoped limit the plan
# reserves (``spec.vmem_limit``), so the program compiles as planned; XLA's
# VMEM temporaries equal ``rsk.resident_vmem_bytes`` on both
# (tests/test_fused_matmul_tpu.py; design/README.md "h-suite09b").
MOSAIC_SCOPED_VMEM_AS_PLANNED = JAX_VERSION >= (0, 10)

# Pallas names: the ``pl.*`` spellings exist in every supported version.
ANY = _pl.ANY
SEMAPHORE = _pltpu.SEMAPHORE
# HBM as a memory space; ``HBM(shape, dtype)`` is an output pinned there.
HBM = getattr(_pltpu, "HBM", None) or _pltpu.MemorySpace.HBM


def in_hbm(x: Any) -> Any:
  """``x`` as a ``pallas_call`` operand XLA must keep in HBM.

  A BlockSpec's memory space does not reach XLA for an operand; this does
  (``pltpu.with_memory_space_constraint``, jax 0.9 and 0.10)."""
  return _pltpu.with_memory_space_constraint(x, HBM)


DeviceIdType = _pl.DeviceIdType
semaphore_signal = _pl.semaphore_signal
semaphore_wait = _pl.semaphore_wait
get_barrier_semaphore = _pltpu.get_barrier_semaphore


def tpu_compiler_params(
  *, collective_id: int | None = None, has_side_effects: bool = True
) -> Any:
  """Mosaic compiler parameters of our kernels.

  ``collective_id`` picks the barrier semaphore (None: the kernel uses
  none). Our ids are assigned per lowered module (``module_scope``).
  """
  if collective_id is None:
    return _pltpu.CompilerParams(has_side_effects=has_side_effects)
  return _pltpu.CompilerParams(
    collective_id=collective_id, has_side_effects=has_side_effects
  )


def half_dma_problem(shape: Sequence[int], dtype: Any) -> str | None:
  """Why Mosaic cannot DMA the halves ``x[:h]``, ``x[h:]`` (``h`` = half
  of axis 0) of an array of ``shape`` and ``dtype`` (None: it can).

  Measured on AOT TPU compiles (v5e) of a bidirectional transfer:
  - jax 0.10: a 1-D half must start on a 128-element tile and span a
    multiple of 512 bytes ("contiguous inner slice ... divisible by 512
    bytes"); 2-D halves of any row count compile.
  - jax 0.9: a 1-D array of 2048 or more elements is tiled by 1024 (a
    shorter one by its own padded length, so its halves never align):
    halves must be multiples of 1024 elements; a half of 2 or more
    dimensions must span whole 128-lane tiles (its last dimension a
    multiple of 128; rank 4, the quantized row form's u8[2, 1, 256, 516]:
    "Slice shape along dimension 3 must be aligned to tiling (128)").

  Consulted by the bidirectional kernel's TPU lowering
  (``kernels._bidirectional.check_tpu_halves``) and, at trace time on a
  TPU mesh, by the two-way quantized rings (``collective_matmul.
  _quantized.check_two_way``: the fix is ``bidirectional=False``).
  """
  if not shape:
    return None
  h = shape[0] // 2
  itemsize = jax.numpy.dtype(dtype).itemsize
  if len(shape) == 1:
    if JAX_VERSION < (0, 10):
      if h % 1024:
        return f"a 1-D half of {h} elements is not a multiple of 1024"
      return None
    if h % 128 or (h * itemsize) % 512:
      unit = max(128, 512 // itemsize)
      return (
        f"a 1-D half of {h} elements is not a multiple of {unit} "
        f"({itemsize}-byte elements: 128-element tiles, 512-byte DMAs)"
      )
    return None
  if JAX_VERSION < (0, 10) and shape[-1] % 128:
    return f"the last dimension {shape[-1]} is not a multiple of 128 lanes"
  return None


def manual_axes_kwargs(aval: Any) -> dict[str, Any]:
  """``ShapeDtypeStruct`` keywords carrying ``aval``'s varying manual axes."""
  if hasattr(aval, "manual_axis_type"):  # jax >= 0.10
    return {"manual_axis_type": aval.manual_axis_type}
  return {"vma": getattr(aval, "vma", frozenset())}  # jax 0.9


def varying_axes(x: Any) -> frozenset:
  """The manual mesh axes ``x`` (a value or an aval) varies over."""
  aval = x if isinstance(x, _core.AbstractValue) else jax.typeof(x)
  mat = getattr(aval, "manual_axis_type", None)
  if mat is not None:  # jax >= 0.10
    return frozenset(getattr(mat, "varying", ()) or ())
  return frozenset(getattr(aval, "vma", ()) or ())  # jax 0.9


def joint_manual_axes_kwargs(avals: Sequence[Any]) -> dict[str, Any]:
  """``ShapeDtypeStruct`` keywords varying over every manual axis any of
  ``avals`` varies over (a matmul's result varies where either operand
  does)."""
  if hasattr(avals[0], "manual_axis_type"):  # jax >= 0.10
    mats = [a.manual_axis_type for a in avals]
    first = mats[0]
    joint = type(first)(
      varying=frozenset().union(*(m.varying for m in mats)),
      unreduced=first.unreduced,
      reduced=first.reduced,
    )
    return {"manual_axis_type": joint}
  return {"vma": frozenset().union(*(getattr(a, "vma", ()) for a in avals))}


def shape_like(x: Any, shape=None, dtype=None) -> jax.ShapeDtypeStruct:
  """``jax.ShapeDtypeStruct.like(x)``, optionally with another shape/dtype.

  Keeps the manual axes ``x`` varies over (a Pallas output inside
  ``shard_map`` must vary like its input).
  """
  if shape is None and dtype is None and hasattr(jax.ShapeDtypeStruct, "like"):
    return jax.ShapeDtypeStruct.like(x)  # jax >= 0.10.2
  aval = jax.typeof(x)
  return jax.ShapeDtypeStruct(
    aval.shape if shape is None else tuple(shape),
    aval.dtype if dtype is None else dtype,
    weak_type=getattr(aval, "weak_type", False) and shape is dtype is None,
    **manual_axes_kwargs(aval),
  )


def jaxprs_in_params(params: Any) -> Iterator[Any]:
  """The jaxprs an equation's params hold (sub-computations)."""
  from jax.extend import core as _jex

  fn = getattr(_jex, "jaxprs_in_params", None)
  if fn is None:  # jax 0.9: not yet in jax.extend
    fn = _core.jaxprs_in_params
  return fn(params)


def all_gather_invariant(x: Any, axis_name: Any, *, axis: int, tiled: bool):
  """``jax.lax.all_gather(..., to="invarying")``: the result is the same on
  every device of the axis (so ``out_specs`` may leave the axis out).

  jax 0.9 spells it ``all_gather_invariant``, not public there.
  """
  if JAX_VERSION >= (0, 10):
    return jax.lax.all_gather(
      x, axis_name, axis=axis, tiled=tiled, to="invarying"
    )
  from jax._src.lax import parallel as _parallel  # jax 0.9 only

  return _parallel.all_gather_invariant(x, axis_name, axis=axis, tiled=tiled)


def without_varying(aval: Any, axes: Sequence[str], add: bool = False) -> Any:
  """``aval`` typed as no longer varying over ``axes`` (``add``: varying).

  For a value an exchange made equal on every device of ``axes`` (a sum of
  a device's own buffer and what its only peer sent): JAX offers no cast
  from varying to invariant without a collective. jax >= 0.10 keeps the
  axes in ``manual_axis_type``, jax 0.9 in ``vma``.
  """
  axes = frozenset(axes)

  def new(varying):
    return frozenset(varying) | axes if add else frozenset(varying) - axes

  mat = getattr(aval, "manual_axis_type", None)
  if mat is not None:  # jax >= 0.10
    return aval.update(
      manual_axis_type=type(mat)(
        varying=new(mat.varying),
        unreduced=mat.unreduced,
        reduced=mat.reduced,
      )
    )
  return aval.update(vma=new(aval.vma))  # jax 0.9


def register_identity_lowering(prim: Primitive) -> None:
  """Lowers ``prim(*xs, **params)`` to ``xs`` themselves (a type-only or
  marker primitive)."""
  _mlir.register_lowering(prim, lambda ctx, *xs, **params: list(xs))


def is_drop_var(v: Any) -> bool:
  """Whether a jaxpr output variable is ``_`` (a result nobody reads)."""
  from jax.extend import core as _jex

  cls = getattr(_jex, "DropVar", None) or _core.DropVar  # 0.9: not public
  return isinstance(v, cls)


def _effect_input(eff: Any) -> Any:
  """The operand (index or Var) a state effect is about."""
  return eff.input if hasattr(eff, "input") else eff.input_index


# Settings that change what a function traces to. ``asyncops.emulation``
# picks where the non-TPU emulation moves data; the choice is baked into the
# traced program. A plain context variable is invisible to ``jax.jit``'s
# caches, so a function traced under one mode silently ran that program
# under the other. A JAX config state with ``include_in_jit_key`` (the C++
# dispatch cache) and ``include_in_trace_context`` (the Python tracing
# cache) makes a mode change retrace; both are needed (measured: either
# alone leaves one cache stale). Config states are internal in 0.10.2.
from jax._src import config as _config  # noqa: E402


def traced_setting(name: str, values: Sequence[str], default: str, help: str):
  """A thread-local string setting that ``jax.jit`` traces for.

  Returns a JAX config state: ``state.value`` reads it, ``with
  state(value):`` sets it for a block; a jitted function retraces when it
  changes. The environment variable ``name.upper()`` sets the default.
  """
  existing = _config.config_states.get(name)
  if existing is not None:  # module re-imported
    return existing
  return _config.enum_state(
    name,
    list(values),
    default,
    help=help,
    include_in_jit_key=True,
    include_in_trace_context=True,
  )


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


# ``cacheable`` is a keyword of ``mlir.register_lowering`` since the
# per-module lowering cache exists; older versions lower inline anyway.
_UNCACHED = (
  {"cacheable": False}
  if "cacheable" in _inspect.signature(_mlir.register_lowering).parameters
  else {}
)


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

  # ``cacheable=False``: JAX's per-module lowering cache would emit the
  # first equation's lowering (with that equation's source location) as a
  # function and call it for every equal equation, so a start in a loop
  # body would be attributed to the prologue's start line in the HLO
  # metadata. Lowering each equation inline keeps its own call site.
  _mlir.register_lowering(prim, rule, platform=platform, **_UNCACHED)


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


_SUMMARY = re.compile(r"^(?P<file>.+?):(?P<line>\d+)(?::\d+)? \((?P<fn>.*)\)$")


def _frame_of(source_info: Any) -> tuple[str, int, str] | None:
  """``(file, line, function)`` of the user frame of a ``SourceInfo``.

  Public API only: ``source_info_util.summarize`` names the innermost
  frame that is neither JAX's, the standard library's nor asyncops' (the
  package directory is registered as an exclusion above), as
  ``file:line[:column] (function)``.
  """
  if source_info is None or getattr(source_info, "traceback", None) is None:
    return None
  text = _public_source_info.summarize(source_info)
  match = _SUMMARY.match(text.strip())
  if match is None:
    return None
  # A qualified name (``test.<locals>.body``): the function's own name.
  return match["file"], int(match["line"]), match["fn"].rsplit(".", 1)[-1]


def user_source_frame() -> str:
  """``file:line in function`` of the user code calling into asyncops now.

  Used at trace time (a start records where it was called, so errors about
  its future name the user's line, not the library's).
  """
  frame = _frame_of(_public_source_info.current())
  return "<unknown>" if frame is None else "{}:{} in {}".format(*frame)


def user_frame(eqn: Any) -> str:
  """``file:line (function)`` of the user code that created ``eqn``."""
  frame = _frame_of(getattr(eqn, "source_info", None))
  return "<unknown>" if frame is None else "{}:{} ({})".format(*frame)


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


def jaxpr_arg_names(jaxpr: Any) -> tuple[str, ...] | None:
  """The Python names of a traced function's arguments, one per invar of
  ``jaxpr`` (``""`` for a value closed over), when JAX recorded them."""
  info = getattr(getattr(jaxpr, "jaxpr", jaxpr), "debug_info", None)
  names = getattr(info, "arg_names", None)
  return tuple(names) if names is not None else None


# ``jax.empty_ref`` (a Ref with no fill) is new in jax 0.10; on 0.9 a Ref of
# zeros stands in (one fill of the buffer, same values never read).
def empty_ref(like: Any) -> Any:
  """A ``jax.Ref`` of ``like``'s shape and dtype whose contents are unset."""
  if hasattr(jax, "empty_ref"):
    return jax.empty_ref(like)
  return jax.new_ref(jax.numpy.zeros(like.shape, like.dtype))


def ref_inner_aval(ref: Any) -> Any:
  """The array aval a Ref holds."""
  return _core.typeof(ref).inner_aval


def register_discharge(prim: Primitive, rule: Callable[..., Any]) -> None:
  """``rule(in_avals, out_avals, *vals, **params) -> (new_ins, outs)``."""
  _discharge.register_discharge_rule(prim)(rule)


# The collective matmuls are ``jax.custom_jvp`` functions; with
# ``api="ref"`` their body makes Refs. Outside differentiation a
# ``custom_jvp_call`` stays in the jaxpr until lowering, and JAX removes
# state before that, but only ``custom_vjp_call`` has a discharge rule in
# jax 0.9 and 0.10 ("No state discharge rule implemented for primitive:
# custom_jvp_call"). Discharge happens after every transformation, so the
# rule evaluates the discharged body and drops the JVP rule, as JAX's own
# rule for ``custom_vjp_call`` does. Registered only where JAX has none.
def _discharged(closed: Any) -> Any:
  if JAX_VERSION >= (0, 10):
    return _discharge.discharge_state(closed)
  jaxpr, consts = _discharge.discharge_state(closed.jaxpr, closed.consts)
  return _core.ClosedJaxpr(jaxpr, consts)


def _custom_jvp_call_discharge(in_avals, out_avals, *args, **params):
  del out_avals
  call = params["call_jaxpr"]
  dis = _discharged(call)
  outs = _core.eval_jaxpr(dis.jaxpr, dis.consts, *args)
  vals, refs = outs[: len(call.out_avals)], iter(outs[len(call.out_avals) :])
  new_ins = [
    next(refs) if isinstance(a, _state.AbstractRef) else None for a in in_avals
  ]
  return new_ins, vals


def _register_custom_jvp_discharge() -> None:
  from jax._src import custom_derivatives as _cd  # the primitive

  if _cd.custom_jvp_call_p not in _discharge._discharge_rules:
    register_discharge(_cd.custom_jvp_call_p, _custom_jvp_call_discharge)


_register_custom_jvp_discharge()


def current_frame(x: Any) -> Any:
  """The jaxpr frame ``x`` (a tracer) is being traced into, or None."""
  trace = getattr(x, "_trace", None)
  return (
    getattr(trace, "frame", None)
    if isinstance(trace, _pe.DynamicJaxprTrace)
    else None
  )


def captured(x: Any) -> bool:
  """Whether ``x`` is a tracer of an enclosing jaxpr trace, closed over by
  the one tracing now (a ``lax.cond`` branch, a loop body, a ``jit``)."""
  trace = getattr(x, "_trace", None)
  now = current_trace()
  return (
    isinstance(trace, _pe.DynamicJaxprTrace)
    and isinstance(now, _pe.DynamicJaxprTrace)
    and trace is not now
  )


def branch_between(x: Any) -> str | None:
  """``"cond"`` or ``"switch"`` when a branch of that ``lax`` op is traced
  between the trace of ``x`` (a tracer) and the current one (the branch
  closes over ``x``, perhaps through a nested ``jit`` or loop); else None."""
  home = getattr(x, "_trace", None)
  t = current_trace()
  while t is not None and t is not home:
    frame = getattr(t, "frame", None)
    kind = getattr(getattr(frame, "debug_info", None), "traced_for", None)
    if kind in ("cond", "switch"):
      return kind
    t = getattr(t, "parent_trace", None)
  return None


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
  """Operand positions ``eqn`` reads and writes (or accumulates) as Refs.

  Works on equations being traced and on finished ones.
  """
  reads, writes = set(), set()
  vals = eqn_invals(eqn)
  for eff in eqn.effects:
    if not isinstance(eff, _state.RefEffect):
      continue
    where = _effect_input(eff)
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


# A window's barrier: ``tie_p`` whose first ``n_window`` operands are a
# transfer's (its future's leaves, its aliased source). When nothing reads
# those any more (the transfer's result is dead code), dead-code
# elimination drops them from the barrier, so the start's own rule can
# remove the transfer; the other operands keep their barrier while their
# outputs are used. A plain barrier keeps every operand while any output
# is used, which would keep a start whose done was removed (or a dead
# computation tied into a live window).
window_tie_p = Primitive("asyncops_window_tie")
window_tie_p.multiple_results = True
window_tie_p.def_abstract_eval(lambda *avals, n_window: list(avals))
_mlir.register_lowering(
  window_tie_p, lambda ctx, *args, n_window: _tie_lowering(ctx, *args)
)


def _window_tie_dce(used_outs, eqn):
  # The window part stays whole while any of it is used; every other
  # operand stays only while its output is used (dead compute in a window
  # goes, as anywhere).
  n = eqn.params["n_window"]
  window = any(used_outs[:n])
  keep = [
    i
    for i in range(len(used_outs))
    if (window and i < n) or (i >= n and used_outs[i])
  ]
  used = [i in keep for i in range(len(used_outs))]
  if not keep:
    return used, None
  if len(keep) == len(used_outs):
    return used, eqn
  new = _pe.new_jaxpr_eqn(
    [eqn.invars[i] for i in keep],
    [eqn.outvars[i] for i in keep],
    window_tie_p if window else tie_p,
    {"n_window": n} if window else {},
    set(),
    eqn.source_info,
    eqn.ctx,
  )
  return used, new


def _window_tie_nonzero(vals: Sequence[Any], n: int) -> list[Any]:
  """``window_tie_p`` over the values that are not symbolic zeros (the
  tangents or cotangents of a window keep its dead-code splitting)."""
  from jax.interpreters import ad

  keep = [i for i, v in enumerate(vals) if type(v) is not ad.Zero]
  out = list(vals)
  if keep:
    tied = window_tie_p.bind(
      *(vals[i] for i in keep), n_window=sum(i < n for i in keep)
    )
    for i, v in zip(keep, tied, strict=True):
      out[i] = v
  return out


def _register_window_tie_rules() -> None:
  from jax.interpreters import ad, batching

  ad.primitive_jvps[window_tie_p] = lambda p, t, n_window: (
    window_tie_p.bind(*p, n_window=n_window),
    _window_tie_nonzero(t, n_window),
  )
  ad.primitive_transposes[window_tie_p] = lambda cts, *p, n_window: (
    _window_tie_nonzero(cts, n_window)
  )
  batching.primitive_batchers[window_tie_p] = lambda a, d, n_window: (
    window_tie_p.bind(*a, n_window=n_window),
    d,
  )
  _pe.dce_rules[window_tie_p] = _window_tie_dce


_register_window_tie_rules()


def window_tie(window: Sequence[Any], rest: Sequence[Any]):
  """``(window, rest)`` through one barrier (see ``window_tie_p``)."""
  out = window_tie_p.bind(*window, *rest, n_window=len(window))
  return list(out[: len(window)]), list(out[len(window) :])


def tie_between(
  start_eqn: Any,
  sems: list[Any],
  tie_read: Callable[[Any], bool] | None = None,
) -> list[Any]:
  """``tie_window(start_eqn, sems, tie_read)``'s semaphores, for a done
  traced in the start's own trace (a captured future is left untied)."""
  if captured(sems[0]):
    return sems
  return tie_window(start_eqn, sems, tie_read)[0]


def reads_idle_local_ref(eqn: Any, sems: list[Any], busy: str) -> bool:
  """Whether ``eqn`` (a ``get``, traced in ``sems``' frame) reads a Ref
  that ``jax.new_ref`` made in that frame and that no equation of the
  frame named ``busy`` (a transfer's start) takes as an operand.

  Such a read is of a buffer no transfer started in the frame uses. A Ref
  closed over from an enclosing frame or passed in as an argument (which
  may be a buffer in flight there) is not one.
  """
  frame = current_frame(sems[0])
  t = eqn.in_tracers[0] if eqn.in_tracers else None
  if frame is None or current_frame(t) is not frame:
    return False
  v = getattr(t, "val", None)
  if not isinstance(v, _core.Var) or v in getattr(frame, "constvar_to_val", {}):
    return False
  eqns = live_eqns(frame)
  if not any(e.primitive.name == "new_ref" and v in e.outvars for e in eqns):
    return False
  return not any(e.primitive.name == busy and v in eqn_vals(e) for e in eqns)


def tie_window(
  start_eqn: Any,
  sems: list[Any],
  tie_read: Callable[[Any], bool] | None = None,
) -> tuple[list[Any], Any]:
  """Keeps pure compute traced after ``start_eqn`` after it and before now.

  Inserts ``optimization_barrier(*inputs, *sems)`` right after the start
  and points the pure equations traced since then at its outputs (so they
  run after the start), then returns ``sems`` passed through a second
  barrier with those equations' results (so the done runs after them); that
  barrier takes over the results' Vars, so later code reads its outputs.
  ``sems`` are the start's semaphore tracers. Without this XLA may hoist the
  compute above the start (measured on v5e). Equations stay in the frame,
  so user tracers of their results remain valid.

  Everything happens in the frame of the start (``sems``' trace), also
  when the done is being traced in a nested one: a ``lax.cond`` branch
  that closes over the future. Then the barriers are bound in the start's
  trace (``set_current_trace``: ``bind`` would stage them into the
  branch) and the returned semaphores are that trace's tracers, which the
  branch closes over in turn: the cond, bound after its branches are
  traced, takes them as operands, so it runs after the compute (measured:
  without this XLA hoists the compute above the start, v5e and v6e).

  ``tie_read(eqn)``: whether a Ref read (``get``) traced since the start
  is tied too, its results passed with ``sems`` through a barrier right
  after it, so the compute reading them runs after the start. Without it a
  window's compute that reads only such results is tied to nothing before
  it (a read is not an input of the first barrier) and XLA may hoist it
  above the start (measured: a traced other slot of the source, v5e, v6e,
  v5p).

  Returns the semaphores to await and the last barrier (``start_eqn`` when
  nothing was tied): compute traced later in the same frame belongs after
  it (a second done of the future, in another branch).
  """
  frame = current_frame(sems[0])
  trace = sems[0]._trace
  eqns = live_eqns(frame)
  at = next((i for i, e in enumerate(eqns) if e is start_eqn), None)
  if at is None:
    return sems, start_eqn
  after = eqns[at + 1 :]
  defined = {v for e in after for v in e.outvars}
  between = [e for e in after if not e.effects]
  if not between:
    return sems, start_eqn
  reads = [
    e
    for e in after
    if e.effects and e.primitive.name == "get" and tie_read and tie_read(e)
  ]
  # The barriers go into the start's frame even from a nested trace (a
  # cond branch closing over the future): jax._src.core's
  # set_current_trace is how a primitive is staged into a given trace.
  with _core.set_current_trace(trace):
    return _tie_window(
      frame, trace, start_eqn, sems, after, defined, between, reads
    )


def window_reads_ref(
  start_eqn: Any,
  sems: list[Any],
  ref: Any,
  other_slot: Callable[[Any], bool] = lambda eqn: False,
) -> bool:
  """Whether pure compute traced after ``start_eqn`` (in ``sems``' frame)
  may read ``ref``'s buffer as a value: the value ``jax.new_ref`` made it
  of, a value written whole into it, or a read of it (discharged, each is
  the buffer itself), in any frame.

  A Ref made in an enclosing frame (closed over) is looked through: a
  value closed over is followed to the enclosing trace's ``Var``
  (``constvar_to_val``), so the Ref's reads and its ``new_ref`` there
  count as here. What no trace records, an argument of a nested frame
  (a ``jit``'s, a loop's carry) of the Ref's whole type, may be its
  buffer when the Ref was not made in that frame: counted (conservative).

  ``other_slot(eqn)``: whether a ``get`` of the Ref reads only slots the
  transfer does not (that read is a slice, not the in-flight buffer).
  """
  frame = current_frame(sems[0])
  rframe = current_frame(ref)
  if frame is None or rframe is None or not isinstance(ref.val, _core.Var):
    return False
  eqns = live_eqns(frame)
  at = next((i for i, e in enumerate(eqns) if e is start_eqn), None)
  if at is None:
    return False
  rframe, rvar = _root(rframe, ref.val)
  roots = [
    _root(frame, v)
    for e in eqns[at + 1 :]
    if not e.effects
    for v in eqn_vals(e)
    if isinstance(v, _core.Var)
  ]
  frames = {id(f): f for f in [frame, rframe] + [f for f, _ in roots]}
  buffer, made = set(), False
  for f in frames.values():
    for e in live_eqns(f):
      vals = [_root(f, v)[1] for v in eqn_vals(e)]
      name = e.primitive.name
      if name == "new_ref" and rvar in e.outvars:
        made = True
        buffer.update(v for v in vals if isinstance(v, _core.Var))
      elif not vals or vals[0] is not rvar:
        continue
      elif name == "get" and not other_slot(e):
        buffer.update(e.outvars)
      elif name == "swap" and len(vals) == 2:  # a whole write
        buffer.add(vals[1])
  if any(v in buffer for _, v in roots):
    return True
  whole = ref_inner_aval(ref)
  return any(
    (f is not rframe or not made)
    and v in f.invars
    and tuple(getattr(v.aval, "shape", ())) == tuple(whole.shape)
    and getattr(v.aval, "dtype", None) == whole.dtype
    for f, v in roots
  )


def reads_ref(eqn: Any, ref: Any) -> bool:
  """Whether ``eqn`` (being traced) takes ``ref`` (a Ref tracer) as its
  first operand, also as a constant closed over from ``ref``'s trace."""
  t = eqn.in_tracers[0] if eqn.in_tracers else None
  f, rf = current_frame(t), current_frame(ref)
  if f is None or rf is None:
    return False
  return _root(f, t.val)[1] is _root(rf, ref.val)[1]


def _root(frame: Any, v: Any) -> tuple[Any, Any]:
  """``(frame, v)`` followed out through constants closed over from an
  enclosing trace, to the frame and ``Var`` the value was traced as."""
  for _ in range(64):
    consts = getattr(frame, "constvar_to_val", {})
    c = consts.get(v) if isinstance(v, _core.Var) else None
    f = current_frame(c)
    if f is None or not isinstance(getattr(c, "val", None), _core.Var):
      break
    frame, v = f, c.val
  return frame, v


def _tie_window(frame, trace, start_eqn, sems, after, defined, between, reads):
  """``tie_window`` once the frame's window is found (current trace: the
  start's)."""
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
    _barrier_after(
      frame, start_eqn, list(outside), list(outside.values()), sems, between
    )
  for g in reads:
    _tie_read(frame, trace, g, sems, between)
  leaves = [(e, v) for e in between for v in e.outvars if v not in used]
  if not leaves:
    return sems, start_eqn
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
  return list(outs[len(leaves) :]), tie


def _tie_read(frame, trace, g, sems, between) -> None:
  """Passes the results of ``g`` (a Ref read) that ``between`` reads, with
  ``sems``, through a barrier right after ``g``; ``between`` reads its
  outputs."""
  outs = [
    v
    for v in g.outvars
    if any(getattr(t, "val", None) is v for e in between for t in e.in_tracers)
  ]
  if not outs:
    return
  tracers = [trace.var_to_tracer(v, g.source_info, g) for v in outs]
  _barrier_after(frame, g, outs, tracers, sems, between)


def _barrier_after(frame, anchor, keys, tracers, sems, between) -> None:
  """Binds ``optimization_barrier(*tracers, *sems)``, moves it right after
  ``anchor`` in ``frame``, and makes ``between`` read its outputs where it
  read ``keys`` (the ``Var`` of each tracer)."""
  n = len(frame.tracing_eqns)
  tied = tie_p.bind(*tracers, *sems)
  (barrier,) = frame.tracing_eqns[n:]
  del frame.tracing_eqns[n:]
  pos = next(
    i for i, e in enumerate(frame.tracing_eqns) if _resolve(e) is anchor
  )
  frame.tracing_eqns.insert(pos + 1, barrier)
  new = dict(zip(keys, tied[: len(keys)], strict=True))
  for e in between:
    e.in_tracers = [
      new.get(t.val, t) if isinstance(t.val, _core.Var) else t
      for t in e.in_tracers
    ]


# Checks on every finished trace ---------------------------------------------
#
# Why: a future's life cycle (awaited exactly once on every path) and the
# Ref API's hazards (no access to a buffer a DMA is using) can only be
# decided on the whole traced program: a cond branch that drops a future, a
# loop body that touches a slot in flight across the back edge. JAX has no
# public hook for "a jaxpr was traced", so we wrap the internal
# ``JaxprStackFrame.to_jaxpr``, which every ``jit``, ``make_jaxpr``,
# ``shard_map``, ``cond`` and loop trace ends with. Only frames where
# asyncops traced something (``mark_frame``) are checked, and a checked
# frame marks its parent, which sees the sub-jaxpr in context.

_marked: dict[int, Any] = {}  # True, or _ORPHAN
_jaxpr_checks: list[Callable[[Any, Sequence[Any]], None]] = []


def mark_frame(x: Any, orphan: bool = False) -> None:
  """Marks the jaxpr ``x`` (a tracer) is traced into for the checks.

  ``orphan``: also when that jaxpr (or one enclosing it) is traced under
  no enclosing jaxpr trace (a ``custom_vjp`` function), check the frame
  its call is bound into when that ends (see ``_orphans``).
  """
  frame = current_frame(x)
  if frame is not None:
    _marked[id(frame)] = _ORPHAN if orphan else _marked.get(id(frame), True)


def on_jaxpr_traced(check: Callable[[Any, Sequence[Any]], None]) -> None:
  """Runs ``check(jaxpr, consts)`` on every marked jaxpr when traced.

  ``check`` may raise; the error ends the trace (e.g. ``jax.jit``'s).
  """
  _install_finish_hook()
  if check not in _jaxpr_checks:
    _jaxpr_checks.append(check)


# A checked frame traced under no enclosing jaxpr trace (jax 0.10's
# ``custom_vjp``/``custom_jvp`` trace their function with an eval parent)
# cannot mark the frame it is later bound into. It is remembered by its
# first equation, which the call's sub-jaxpr shares, and the frame that
# holds that sub-jaxpr is checked when it ends (its arguments, e.g. one
# Ref passed twice, are only visible there). The outermost frame of a
# program is remembered too and never found: the table is bounded.
_orphans: dict[int, Any] = {}
_MAX_ORPHANS = 64
_ORPHAN = "orphan"  # a mark that follows a frame out of such a trace


def _add_orphan(jaxpr: Any) -> None:
  eqns = getattr(jaxpr, "eqns", None)
  if not eqns:
    return
  if len(_orphans) >= _MAX_ORPHANS:
    _orphans.pop(next(iter(_orphans)))
  _orphans[id(eqns[0])] = eqns[0]


def _holds_orphan(jaxpr: Any) -> Any:
  if not _orphans:
    return False
  found: Any = False
  for e in jaxpr.eqns:
    for sub in jaxprs_in_params(e.params):
      inner = getattr(sub, "jaxpr", sub)
      first = inner.eqns[0] if getattr(inner, "eqns", None) else None
      if first is not None and _orphans.get(id(first)) is first:
        del _orphans[id(first)]
        found = _ORPHAN
  return found


def _install_finish_hook() -> None:
  frame_cls = _pe.JaxprStackFrame
  original = frame_cls.to_jaxpr
  if getattr(original, "_asyncops_hook", False):
    return

  def to_jaxpr(self, trace, *args, **kwargs):
    jaxpr, consts = original(self, trace, *args, **kwargs)
    mark = _marked.pop(id(self), False) or _holds_orphan(jaxpr)
    if mark:
      parent = getattr(trace, "parent_trace", None)
      if isinstance(parent, _pe.DynamicJaxprTrace):
        key = id(parent.frame)
        _marked[key] = _ORPHAN if _ORPHAN in (mark, _marked.get(key)) else True
      elif mark == _ORPHAN:
        _add_orphan(jaxpr)
      for check in list(_jaxpr_checks):
        check(jaxpr, consts)
    return jaxpr, consts

  to_jaxpr._asyncops_hook = True
  to_jaxpr.__wrapped__ = original
  frame_cls.to_jaxpr = to_jaxpr


def register_dce_rule(prim: Any, rule: Any) -> None:
  """Registers ``rule(used_outputs, eqn) -> (used_inputs, eqn | None)``
  for ``prim`` with JAX's dead-code elimination (``pe.dce_rules``,
  internal: the only hook that sees which outputs of an equation are
  used)."""
  _pe.dce_rules[prim] = rule


def dce_rules() -> dict:
  """JAX's table of dead-code rules (for tests that switch one off)."""
  return _pe.dce_rules


def identity_eqn(eqn: Any, invar: Any, outvar: Any) -> Any:
  """An equation ``outvar = invar`` (``copy_p``, which lowers to nothing)
  in place of ``eqn``: for dead-code rules, which cannot rename
  variables."""
  from jax._src.lax import lax as _lax  # copy_p: not public.

  return _pe.new_jaxpr_eqn(
    [invar], [outvar], _lax.copy_p, {}, set(), eqn.source_info, eqn.ctx
  )


def without_dead_code(jaxpr: Any) -> Any:
  """``jaxpr`` as lowering sees it: equations nothing uses removed.

  Why: a value-level done whose result is never used is dead code, and
  JAX drops it before compiling (``pe.dce_jaxpr``, internal), so the
  compiled program starts a DMA it never waits for. The life-cycle check
  runs on this view too.
  """
  if jaxpr.constvars:
    jaxpr = _pe.convert_constvars_jaxpr(jaxpr)
  out, _ = _pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars), True)
  return out


def name_stack_of(eqn: Any) -> str:
  """The named scopes an equation was traced in (``a/b/c``)."""
  return str(getattr(getattr(eqn, "source_info", None), "name_stack", ""))


def eqn_invals(eqn: Any) -> list[Any]:
  """An equation's input atoms (``Var``/``Literal``), traced or finished."""
  if getattr(eqn, "in_tracers", None) is not None:  # being traced
    return eqn_vals(eqn)
  return list(eqn.invars)


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
  nonzeros_out, residuals, linearized)``, as for ``jax.lax.sin``.

  jax 0.9 calls linearization rules without ``is_vjp`` (added in 0.10);
  there the rule sees ``is_vjp=False``."""
  if _LIN_HAS_IS_VJP:
    _ad.primitive_linearizations[prim] = rule
  else:
    _ad.primitive_linearizations[prim] = _functools.partial(rule, False)


_LIN_HAS_IS_VJP = (
  "is_vjp" in _inspect.signature(_ad.LinearizeTrace.__init__).parameters
)


def current_trace() -> Any:
  """The trace that binds primitives now (a transpose's output trace)."""
  return _core.unsafe_get_current_trace()


def differentiating() -> bool:
  """Whether the code being traced is itself being differentiated (a
  backward rule under a second ``jax.grad``: the current trace is a JVP or
  linearize trace, whose class names are not public)."""
  return type(current_trace()).__name__ in ("JVPTrace", "LinearizeTrace")


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


def tpu_device_kind() -> str | None:
  """The device kind being lowered for (e.g. ``"TPU v5 lite"``), or None.

  Same source and limits as :func:`tpu_generation`; kernels that size VMEM
  buffers need the chip, not only the generation (v5e and v5p differ).
  """
  return _device_kind.get()


def trace_device_kind() -> str | None:
  """The device kind of the mesh being traced over (inside ``shard_map``),
  e.g. ``"TPU v5 lite"``; None when the abstract mesh names no device.

  ``AbstractMesh.abstract_device`` is public but only set when the mesh was
  built from concrete devices (it is for ahead-of-time TPU topologies).
  """
  device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  return getattr(device, "device_kind", None)


def _same_shape(mesh, want) -> bool:
  return (
    isinstance(mesh, jax.sharding.Mesh)
    and not mesh.empty
    and dict(mesh.shape) == want
  )


def trace_concrete_mesh() -> "jax.sharding.Mesh | None":
  """The concrete mesh (its devices) of the ``shard_map`` being traced, or
  None when it is not in sight.

  Inside ``shard_map`` only the abstract mesh is public
  (``jax.sharding.get_abstract_mesh()``: axis names, sizes and device
  kind, no devices). The concrete mesh is found, first, as the context
  mesh (``jax.set_mesh``; ``jax._src.mesh.get_concrete_mesh``, jax 0.9
  and 0.10), then as the ``mesh`` argument of the ``shard_map`` staging
  frame that is tracing us (``jax/_src/shard_map.py``, both versions: no
  public hook exposes it). Either must match the abstract mesh's axes;
  anything else gives None (callers then assume an ideal ring).
  """
  import sys  # noqa: PLC0415

  from jax._src import mesh as _mesh_lib  # noqa: PLC0415 (see above)

  abstract = jax.sharding.get_abstract_mesh()
  if abstract is None or getattr(abstract, "empty", True):
    return None
  want = dict(abstract.shape)
  try:
    mesh = _mesh_lib.get_concrete_mesh()
  except Exception:  # noqa: BLE001 (absent or renamed: fall through)
    mesh = None
  if _same_shape(mesh, want):
    return mesh
  frame = sys._getframe(1)
  while frame is not None:
    if frame.f_code.co_filename.endswith("shard_map.py"):
      mesh = frame.f_locals.get("mesh")
      if _same_shape(mesh, want):
        return mesh
    frame = frame.f_back
  return None
