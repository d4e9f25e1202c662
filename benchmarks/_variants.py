"""The collective-matmul variants the benchmarks compare.

Each variant is ``(lhs, rhs) -> out`` for A[B_X, D_Y] * W[D, F_Y] ->
Out[B_X, F_Y] on a mesh with axes ``("x", "y")``; ``build`` returns the
jitted function. ``precision`` is passed to every matmul.

- ``unsharded``: the bound. One device, A[B/X, D] @ W[D, F/Y] (the
  per-device FLOPs with no sharding on the contracting dimension).
- ``jit``: plain ``jax.jit`` with output sharding; XLA all-gathers A.
- ``ppermute``: the chapter's ``shard_map`` + ``lax.ppermute`` loop.
- ``asyncops_manual``: the same loop with ``asyncops.ppermute_start/_done``
  and ``optimization_barrier`` pinning each chunk matmul between them.
- ``allgather_matmul`` / ``allgather_matmul_bidi``:
  ``asyncops.collective_matmul.allgather_matmul`` when it exists, its ring
  (``method="ring"``); ``allgather_matmul_ref`` /
  ``allgather_matmul_ref_bidi``: ``api="ref"``; ``allgather_matmul_auto``:
  the library's default, ``method="auto"``;
  ``allgather_matmul_int8[_bidi]`` / ``allgather_matmul_fp8[_bidi]``:
  ``transfer="int8"`` / ``"float8_e4m3fn"`` (opt-in with ``--variants``);
  ``allgather_matmul_auto_jit``, ``<family>:asyncops_auto_jit``: auto
  with ``memory="jit"`` (opt-in);
  ``allgather_matmul[_bidi|_auto]_outacc``: ``accumulation="output"``
  (opt-in with ``--variants``).

The rest of the family is named ``<family>:<kind>`` (see
:data:`FAMILIES`), e.g. ``reducescatter:jit``; kinds are ``unsharded``
(the bound), ``jit``, ``ppermute`` (a ``lax.ppermute`` ring in the
chapter's style), ``asyncops``, ``asyncops_bidi``, ``asyncops_ref``, and
for the reduce-scatter ``asyncops_int8[_bidi]`` / ``asyncops_fp8[_bidi]``
(quantized partial sums, opt-in with ``--variants``). With global
``(B, D, F)``:

- ``reducescatter``: Tmp[B_X, F_Y] * W2[F_Y, D] -> Out[B_X, D_Y].
- ``allreduce``: A[B_X, D_Y] * W[D_Y, F] -> Out[B_X, F].
- ``mlp``: In[B_X, D_Y], W_in[D, F_Y], W_out[F_Y, D] -> Out[B_X, D_Y], the
  chapter's Problem 3 (gelu between the two matmuls).
- ``mlp_gated``: the same with a gate, ``silu(In W_gate) * (In W_in)``
  (SwiGLU; the gate and up projections share one gather).
- ``mlp_sp_gated``: the gated MLP in sequence-parallel layout,
  In[B_XY, D] -> Out[B_XY, D] (the tokens are gathered over Y, scattered
  back after the down projection; X is data parallel). At (B, D, F) =
  (4096, 8192, 28672) this is a Llama-3-70B MLP shard (``run.LLAMA``).
- ``mlp_train``: the training step of ``mlp``, forward and backward:
  ``jax.jit(jax.grad(loss))`` with ``loss = sum(out ** 2) / 2`` and the
  gradients of all three arguments, sharded like them. Ours is
  ``mlp_block``'s custom backward (three more rings of our kernels); ``jit``
  is XLA's gradient of the plain program; ``ppermute`` differentiates the
  chapter's ring (JAX transposes each ``lax.ppermute``).
"""

import dataclasses
import functools
import inspect
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import asyncops
from asyncops import _jax_compat as jc

AXIS = "y"


def _mm(precision):
  return functools.partial(jnp.matmul, precision=precision)


def chapter_ppermute(lhs, rhs, *, precision=None):
  """The chapter's collective matmul (``lax.ppermute`` ring, unrolled)."""
  n = jax.lax.axis_size(AXIS)
  idx = jax.lax.axis_index(AXIS)
  cs = lhs.shape[1]
  mm = _mm(precision)
  perm = [(j, (j - 1) % n) for j in range(n)]

  def chunk(i):
    start = (idx + i) % n * cs
    return jax.lax.dynamic_slice_in_dim(rhs, start, cs)

  acc = jnp.zeros((lhs.shape[0], rhs.shape[1]), lhs.dtype)
  acc = jax.lax.pcast(acc, ("x", AXIS), to="varying")
  for i in range(n - 1):
    acc = acc + mm(lhs, chunk(i))
    lhs = jax.lax.ppermute(lhs, AXIS, perm)
  return acc + mm(lhs, chunk(n - 1))


def asyncops_manual(lhs, rhs, *, precision=None):
  """The ring with asyncops futures; barriers pin each chunk's matmul."""
  n = jax.lax.axis_size(AXIS)
  idx = jax.lax.axis_index(AXIS)
  cs = lhs.shape[1]
  mm = _mm(precision)
  acc = jnp.zeros((lhs.shape[0], rhs.shape[1]), lhs.dtype)
  for i in range(n):
    start = (idx + i) % n * cs
    if i < n - 1:
      lhs, fut = asyncops.ppermute_start(lhs, AXIS, shift=-1)
      lhs, acc = jax.lax.optimization_barrier((lhs, acc))
    part = mm(lhs, jax.lax.dynamic_slice_in_dim(rhs, start, cs))
    acc = acc + part
    if i < n - 1:
      acc, fut = jax.lax.optimization_barrier((acc, fut))
      lhs = asyncops.ppermute_done(fut)
  return acc


def _library(name: str):
  cm = getattr(asyncops, "collective_matmul", None)
  if cm is None:
    try:
      from asyncops import collective_matmul as cm  # noqa: PLC0415
    except ImportError:
      return None
  return getattr(cm, name, None)


# Variants other engineers add without touching this file's logic:
# name -> (build(mesh, precision) -> jitted fn, args(mesh, shape, dtype)).
_REGISTERED: dict[str, tuple[Callable, Callable]] = {}

# How every variant's first operand (the activation ``x`` the collective
# moves) enters the program (``run.py --x-input``):
# - ``"parameter"`` (default): an entry parameter, as before;
# - ``"donated"``: the same parameter, donated (``donate_argnums=0``);
# - ``"produced"``: computed inside the program, ``x * 2`` of the
#   parameter, as a model's activation is (the output of a previous op).
# A start kernel aliases the buffer it sends, so XLA copies an entry
# parameter the program sends first (``design/benchmarks.md``, "The copy
# of ``x`` before the first transfer"); every variant gets the same input.
X_INPUTS = ("parameter", "donated", "produced")
X_INPUT = "parameter"


def register(name: str, build_fn: Callable, args_fn: Callable) -> None:
  """Adds variant ``name`` (``<family>:<kind>``, or a bare all-gather name).

  Args:
    name: e.g. ``"rowgather:asyncops"``; it then appears in
      :func:`family_variants` (or :func:`available` without a colon).
    build_fn: ``(mesh, precision) -> jitted function``.
    args_fn: ``(mesh, (B, D, F), dtype) -> ShapeDtypeStructs``.

  Raises:
    ValueError: ``name`` is already a built-in variant.
  """
  if name in ("unsharded", "jit", "ppermute") or name.endswith(
    (":unsharded", ":jit")
  ):
    raise ValueError(f"register: {name!r} is built in; choose another name.")
  _REGISTERED[name] = (build_fn, args_fn)


def _has_method(name: str) -> bool:
  """Whether the library's ``name`` takes ``method=`` (auto dispatch)."""
  fn = _library(name)
  if fn is None:
    return False
  try:
    return "method" in inspect.signature(fn).parameters
  except (TypeError, ValueError):
    return False


def available() -> list[str]:
  """Variant names of the flagship (all-gather) runnable here."""
  out = ["unsharded", "jit", "ppermute", "asyncops_manual"]
  if _library("allgather_matmul") is not None:
    out += ["allgather_matmul", "allgather_matmul_bidi"]
  if _has_method("allgather_matmul"):
    out.append("allgather_matmul_auto")
  out += [n for n in _REGISTERED if ":" not in n and n not in out]
  return out


def _flagship_takes(param: str) -> bool:
  """Whether the library's ``allgather_matmul`` has keyword ``param``."""
  return _takes("allgather_matmul", param)


def auto_xla() -> list[str]:
  """Auto's XLA candidate (``method="xla"``: XLA's collective and
  ``jnp.dot`` inside ``shard_map``, what ``_auto``'s XLA estimate stands
  for), per family; opt-in (``--variants``)."""
  out = []
  if _has_method("allgather_matmul"):
    out.append("allgather_matmul_xla")
  for family, fam in FAMILIES.items():
    if _has_method(fam.library):
      out.append(f"{family}:asyncops_xla")
  return out


def _takes(name: str, param: str) -> bool:
  """Whether the library's ``name`` has keyword ``param``."""
  fn = _library(name)
  try:
    return fn is not None and param in inspect.signature(fn).parameters
  except (TypeError, ValueError):
    return False


def auto_jit() -> list[str]:
  """Auto with ``memory="jit"`` (``method="auto"`` leaves out a fused
  pick whose receive slots exceed jit's temporaries plus one chunk's
  buffers), per library function that takes ``memory=``; opt-in
  (``--variants``): the default tables run ``memory="fastest"``."""
  out = []
  if _takes("allgather_matmul", "memory"):
    out.append("allgather_matmul_auto_jit")
  for family, fam in FAMILIES.items():
    if _has_method(fam.library) and _takes(fam.library, "memory"):
      out.append(f"{family}:asyncops_auto_jit")
  return out


def auto_memory(name: str) -> str | None:
  """The memory target of auto variant ``name`` (``"fastest"`` or
  ``"jit"``), ``None`` for a variant that is not auto."""
  if name.endswith("_auto_jit"):
    return "jit"
  if name.endswith(("_auto", "_auto_outacc")):
    return "fastest"
  return None


def library_quantized() -> list[str]:
  """The flagship with quantized transfers (``transfer="int8"`` /
  ``"float8_e4m3fn"``), one- and two-way; opt-in (``--variants``): they
  compute the dequantized product, not the exact one."""
  if not _flagship_takes("transfer"):
    return []
  return [
    "allgather_matmul_int8",
    "allgather_matmul_int8_bidi",
    "allgather_matmul_fp8",
    "allgather_matmul_fp8_bidi",
  ]


def library_outacc() -> list[str]:
  """The flagship with ``accumulation="output"`` (the chunk products added
  in the output dtype, XLA's windowed einsum's numerics): the one- and
  two-way rings and auto. Opt-in (``--variants``): they round at every
  step, so they are not the default tables' numerics."""
  if not _flagship_takes("accumulation"):
    return []
  return [
    "allgather_matmul_outacc",
    "allgather_matmul_bidi_outacc",
    "allgather_matmul_auto_outacc",
  ]


TORUS = ("allgather_matmul_torus", "jit_torus")


def _build_torus(name, mesh, precision):
  """A[B, D_XY] * W[D, F_XY] -> Out[B, F_XY]: the all-gather over both
  mesh axes (a 2-D torus). ``jit_torus``: XLA's program for the same
  shardings; ``allgather_matmul_torus``: ``torus_allgather_matmul``.
  Opt-in (``--variants``); compare with a ``--tp 16`` ring row."""
  xy = P(None, ("x", AXIS))
  if name == "jit_torus":
    return jax.jit(_mm(precision), out_shardings=NamedSharding(mesh, xy))
  from asyncops.collective_matmul import torus_allgather_matmul

  def fn(a, w):
    with jax.default_matmul_precision(precision or "default"):
      return torus_allgather_matmul(a, w, ("x", AXIS))

  return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(xy, xy), out_specs=xy))


def library_ref() -> list[str]:
  """The flagship's ``api="ref"`` variants."""
  return ["allgather_matmul_ref", "allgather_matmul_ref_bidi"]


# The chapter-style lax.ppermute rings of the rest of the family -----------


def _ppermute_reducescatter(lhs, rhs, *, precision=None):
  """Partial sums travel to index + 1; block b ends on device b."""
  n, idx = jax.lax.axis_size(AXIS), jax.lax.axis_index(AXIS)
  c = rhs.shape[1] // n
  mm = _mm(precision)
  perm = [(j, (j + 1) % n) for j in range(n)]

  def part(s):
    block = (idx + 2 * n - s - 1) % n
    return mm(lhs, jax.lax.dynamic_slice_in_dim(rhs, block * c, c, axis=1))

  acc = part(0)
  for s in range(1, n):
    acc = jax.lax.ppermute(acc, AXIS, perm) + part(s)
  return acc


def _ppermute_allreduce(lhs, rhs, *, precision=None):
  block = _ppermute_reducescatter(lhs, rhs, precision=precision)
  return jc.all_gather_invariant(block, AXIS, axis=1, tiled=True)


def _ppermute_mlp(x, w_in, w_out, *, precision=None):
  h = jax.nn.gelu(chapter_ppermute(x, w_in, precision=precision))
  return _ppermute_reducescatter(h, w_out, precision=precision)


def _ppermute_row_gather(x, ws, *, precision=None):
  """Row all-gather matmuls as a ``lax.ppermute`` ring (chapter style)."""
  n, idx = jax.lax.axis_size(AXIS), jax.lax.axis_index(AXIS)
  m, mm = x.shape[0], _mm(precision)
  perm = [(j, (j - 1) % n) for j in range(n)]
  outs = [jnp.zeros((n * m, w.shape[1]), x.dtype) for w in ws]
  for i in range(n):
    row = (idx + i) % n * m
    outs = [
      jax.lax.dynamic_update_slice_in_dim(o, mm(x, w), row, 0)
      for o, w in zip(outs, ws, strict=True)
    ]
    if i < n - 1:
      x = jax.lax.ppermute(x, AXIS, perm)
  return outs


def _ppermute_row_scatter(h, w, *, precision=None):
  """Row reduce-scatter matmul: partial sums of row blocks to index + 1."""
  n, idx = jax.lax.axis_size(AXIS), jax.lax.axis_index(AXIS)
  m, mm = h.shape[0] // n, _mm(precision)
  perm = [(j, (j + 1) % n) for j in range(n)]

  def part(s):
    block = (idx + 2 * n - s - 1) % n
    return mm(jax.lax.dynamic_slice_in_dim(h, block * m, m), w)

  acc = part(0)
  for s in range(1, n):
    acc = jax.lax.ppermute(acc, AXIS, perm) + part(s)
  return acc


def _ppermute_mlp_sp_gated(x, w_in, w_out, w_gate, *, precision=None):
  g, u = _ppermute_row_gather(x, (w_gate, w_in), precision=precision)
  return _ppermute_row_scatter(jax.nn.silu(g) * u, w_out, precision=precision)


def _ppermute_mlp_gated(x, w_in, w_out, w_gate, *, precision=None):
  g = chapter_ppermute(x, w_gate, precision=precision)
  u = chapter_ppermute(x, w_in, precision=precision)
  h = jax.nn.silu(g) * u
  return _ppermute_reducescatter(h, w_out, precision=precision)


def _lib_fn(name: str, precision, lib_kw=(), kw_args=(), **kw):
  lib = _library(name)
  kw = {**dict(lib_kw), **kw}
  if "method" not in kw and _has_method(name):
    # The library's rows are its ring; ``asyncops_auto`` is the default.
    kw["method"] = "ring"

  def f(*args):
    # The last len(kw_args) arguments are passed by keyword (e.g. w_gate).
    pos = args[: len(args) - len(kw_args)]
    named = dict(zip(kw_args, args[len(pos) :], strict=True))
    with jax.default_matmul_precision(precision or "default"):
      return lib(*pos, AXIS, **named, **kw)

  return f


@dataclasses.dataclass(frozen=True)
class Family:
  """One collective matmul: shardings, shapes and its implementations.

  Attributes:
    in_specs: per-argument ``PartitionSpec`` on the ``("x", "y")`` mesh.
    out_spec: the output's spec.
    shapes: global ``(B, D, F) ->`` argument shapes.
    bound_shapes: ``(B, D, F, X, Y) ->`` one device's unsharded shapes.
    local: the per-device math without communication (the bound; also the
      ``jit`` baseline on global arrays).
    ppermute: the chapter-style ``lax.ppermute`` ring.
    library: the ``asyncops.collective_matmul`` function name.
    lib_kw: keyword options of the library call.
    kw_args: names of the trailing arguments passed by keyword.
  """

  in_specs: tuple
  out_spec: P
  shapes: Callable
  bound_shapes: Callable
  local: Callable
  ppermute: Callable
  library: str
  lib_kw: tuple = ()
  kw_args: tuple = ()


def _mlp_local(x, w_in, w_out, *, precision=None):
  mm = _mm(precision)
  return mm(jax.nn.gelu(mm(x, w_in)), w_out)


FAMILIES: dict[str, Family] = {
  "reducescatter": Family(
    (P("x", AXIS), P(AXIS, None)),
    P("x", AXIS),
    lambda b, d, f: ((b, f), (f, d)),
    lambda b, d, f, x, y: ((b // x, f // y), (f // y, d)),
    lambda a, w, precision=None: _mm(precision)(a, w),
    _ppermute_reducescatter,
    "matmul_reducescatter",
  ),
  "allreduce": Family(
    (P("x", AXIS), P(AXIS, None)),
    P("x", None),
    lambda b, d, f: ((b, d), (d, f)),
    lambda b, d, f, x, y: ((b // x, d // y), (d // y, f)),
    lambda a, w, precision=None: _mm(precision)(a, w),
    _ppermute_allreduce,
    "matmul_allreduce",
  ),
  "mlp": Family(
    (P("x", AXIS), P(None, AXIS), P(AXIS, None)),
    P("x", AXIS),
    lambda b, d, f: ((b, d), (d, f), (f, d)),
    lambda b, d, f, x, y: ((b // x, d), (d, f // y), (f // y, d)),
    _mlp_local,
    _ppermute_mlp,
    "mlp_block",
  ),
}


def _mlp_gated_local(x, w_in, w_out, w_gate, *, precision=None):
  mm = _mm(precision)
  return mm(jax.nn.silu(mm(x, w_gate)) * mm(x, w_in), w_out)


_GATED = dict(
  shapes=lambda b, d, f: ((b, d), (d, f), (f, d), (d, f)),
  local=_mlp_gated_local,
  library="mlp_block",
  kw_args=("w_gate",),
)
_WEIGHT_SPECS = (P(None, AXIS), P(AXIS, None), P(None, AXIS))
FAMILIES["mlp_gated"] = Family(
  in_specs=(P("x", AXIS), *_WEIGHT_SPECS),
  out_spec=P("x", AXIS),
  bound_shapes=lambda b, d, f, x, y: (
    (b // x, d),
    (d, f // y),
    (f // y, d),
    (d, f // y),
  ),
  ppermute=_ppermute_mlp_gated,
  lib_kw=(("activation", jax.nn.silu),),
  **_GATED,
)
FAMILIES["mlp_sp_gated"] = Family(
  in_specs=(P(("x", AXIS), None), *_WEIGHT_SPECS),
  out_spec=P(("x", AXIS), None),
  # Per device: its data-parallel group's B / X tokens, gathered.
  bound_shapes=FAMILIES["mlp_gated"].bound_shapes,
  ppermute=_ppermute_mlp_sp_gated,
  lib_kw=(("activation", jax.nn.silu), ("sequence_parallel", True)),
  **_GATED,
)
# Training steps: jit(grad) of a forward family (same shapes and shardings).
TRAIN = {"mlp_train": "mlp"}
FAMILIES.update({k: FAMILIES[v] for k, v in TRAIN.items()})
KINDS = ("unsharded", "jit", "ppermute", "asyncops", "asyncops_bidi")
KINDS_REF = ("asyncops_ref",)


QUANTIZED_KINDS = {
  "asyncops_int8": dict(transfer="int8"),
  "asyncops_int8_bidi": dict(transfer="int8", bidirectional=True),
  "asyncops_fp8": dict(transfer="float8_e4m3fn"),
  "asyncops_fp8_bidi": dict(transfer="float8_e4m3fn", bidirectional=True),
}


def family_quantized(family: str) -> list[str]:
  """``<family>:asyncops_int8[_bidi]`` / ``..._fp8[_bidi]`` for a family
  whose library function takes ``transfer=`` (the matmul-reduce-scatter's
  quantized partial sums); opt-in (``--variants``): they compute a
  requantized sum, not the exact one."""
  fam = FAMILIES.get(family)
  fn = _library(fam.library) if fam else None
  try:
    if fn is None or "transfer" not in inspect.signature(fn).parameters:
      return []
  except (TypeError, ValueError):
    return []
  return [f"{family}:{k}" for k in QUANTIZED_KINDS]


def family_variants(family: str, ref: bool = False) -> list[str]:
  """``<family>:<kind>`` names (the bound first), registered ones last."""
  kinds = KINDS + (KINDS_REF if ref else ())
  if family in FAMILIES and _has_method(FAMILIES[family].library):
    kinds += ("asyncops_auto",)
  out = [f"{family}:{k}" for k in kinds] if family in FAMILIES else []
  return out + [n for n in _REGISTERED if n.startswith(f"{family}:")]


def _explicit(mesh) -> bool:
  """Whether any axis of ``mesh`` is ``AxisType.Explicit``."""
  types = getattr(mesh, "axis_types", ())
  return any(t == jax.sharding.AxisType.Explicit for t in types)


def _build_family(name: str, mesh, precision):
  family, _, kind = name.partition(":")
  fam = FAMILIES[family]
  local = functools.partial(fam.local, precision=precision)
  train = family in TRAIN
  if train:
    out_shardings = tuple(NamedSharding(mesh, s) for s in fam.in_specs)
  else:
    out_shardings = NamedSharding(mesh, fam.out_spec)
  if kind == "unsharded":
    return jax.jit(_grad(local) if train else local)
  if kind == "jit":
    fn = _grad(local) if train else local
    if _explicit(mesh):
      # The chapter's mesh has Explicit axes, where a dot contracting a
      # sharded dimension (the reduce-scatter and all-reduce families)
      # must name its output's sharding: give the whole step to XLA's
      # partitioner, as on the other layouts' Auto meshes.
      fn = jax.sharding.auto_axes(fn, out_sharding=out_shardings)
    return jax.jit(fn, out_shardings=out_shardings)
  fns = {
    "ppermute": functools.partial(fam.ppermute, precision=precision),
    "asyncops": _lib_fn(fam.library, precision, fam.lib_kw, fam.kw_args),
    "asyncops_bidi": _lib_fn(
      fam.library, precision, fam.lib_kw, fam.kw_args, bidirectional=True
    ),
    "asyncops_ref": _lib_fn(
      fam.library, precision, fam.lib_kw, fam.kw_args, api="ref"
    ),
    "asyncops_auto": _lib_fn(
      fam.library, precision, fam.lib_kw, fam.kw_args, method="auto"
    ),
  }
  if _has_method(fam.library):
    # Auto's XLA candidate (``method="xla"``), opt-in (``--variants``):
    # what ``_auto``'s XLA estimate stands for.
    fns["asyncops_xla"] = _lib_fn(
      fam.library, precision, fam.lib_kw, fam.kw_args, method="xla"
    )
  if name in auto_jit():
    fns[kind] = _lib_fn(
      fam.library,
      precision,
      fam.lib_kw,
      fam.kw_args,
      method="auto",
      memory="jit",
    )
  if name in family_quantized(family):
    fns[kind] = _lib_fn(
      fam.library, precision, fam.lib_kw, fam.kw_args, **QUANTIZED_KINDS[kind]
    )
  if kind not in fns:
    raise ValueError(
      f"variant {name!r}: unknown kind {kind!r}; choose from "
      f"{KINDS + KINDS_REF}."
    )
  fn = jax.shard_map(
    fns[kind], mesh=mesh, in_specs=fam.in_specs, out_specs=fam.out_spec
  )
  if train:
    return jax.jit(_grad(fn), out_shardings=out_shardings)
  return jax.jit(fn)


def _grad(fn):
  """The training step of ``fn``: gradients of ``sum(fn(...) ** 2) / 2``
  with respect to every argument (float32 loss)."""

  def loss(*args):
    y = fn(*args).astype(jnp.float32)
    return 0.5 * jnp.sum(y * y)

  def step(*args):
    return jax.grad(loss, tuple(range(len(args))))(*args)

  return step


def build(name: str, mesh, *, precision=None):
  """The jitted function for variant ``name`` on ``mesh`` (axes x, y), its
  first operand entered as :data:`X_INPUT` says.

  Raises:
    ValueError: unknown variant; lists the available ones.
  """
  return with_x_input(_build(name, mesh, precision=precision), X_INPUT)


def with_x_input(fn, how: str):
  """``fn`` with its first operand entered ``how`` (:data:`X_INPUTS`).

  Raises:
    ValueError: ``how`` is not one of :data:`X_INPUTS`.
  """
  if how == "parameter":
    return fn
  if how == "donated":
    return jax.jit(lambda x, *rest: fn(x, *rest), donate_argnums=0)
  if how == "produced":
    return jax.jit(lambda x, *rest: fn(x * 2, *rest))
  raise ValueError(f"x input {how!r}: choose from {', '.join(X_INPUTS)}.")


def _build(name: str, mesh, *, precision=None):
  if name in _REGISTERED:
    return _REGISTERED[name][0](mesh, precision)
  if ":" in name:
    return _build_family(name, mesh, precision)
  if name in ("allgather_matmul_torus", "jit_torus"):
    return _build_torus(name, mesh, precision)
  in_specs = (P("x", AXIS), P(None, AXIS))
  out_spec = P("x", AXIS)
  if name == "unsharded":
    return jax.jit(_mm(precision))
  if name == "jit":
    return jax.jit(_mm(precision), out_shardings=NamedSharding(mesh, out_spec))
  fns = {
    "ppermute": functools.partial(chapter_ppermute, precision=precision),
    "asyncops_manual": functools.partial(asyncops_manual, precision=precision),
  }
  lib = _library("allgather_matmul")
  if lib is not None:
    # The library takes no precision argument; set the default at trace.
    ring = {"method": "ring"} if _has_method("allgather_matmul") else {}

    def _lib(a, w, **kw):
      kw = {**ring, **kw}
      with jax.default_matmul_precision(precision or "default"):
        return lib(a, w, AXIS, **kw)

    fns["allgather_matmul"] = _lib
    fns["allgather_matmul_bidi"] = functools.partial(_lib, bidirectional=True)
    fns["allgather_matmul_ref"] = functools.partial(_lib, api="ref")
    fns["allgather_matmul_ref_bidi"] = functools.partial(
      _lib, api="ref", bidirectional=True
    )
    fns["allgather_matmul_auto"] = functools.partial(_lib, method="auto")
    if _has_method("allgather_matmul"):
      # Auto's XLA candidate, opt-in (``--variants``).
      fns["allgather_matmul_xla"] = functools.partial(_lib, method="xla")
    if "allgather_matmul_auto_jit" in auto_jit():
      fns["allgather_matmul_auto_jit"] = functools.partial(
        _lib, method="auto", memory="jit"
      )
    outacc = functools.partial(_lib, accumulation="output")
    for v in library_outacc():
      fns[v] = {
        "allgather_matmul_outacc": outacc,
        "allgather_matmul_bidi_outacc": functools.partial(
          outacc, bidirectional=True
        ),
        "allgather_matmul_auto_outacc": functools.partial(
          outacc, method="auto"
        ),
      }[v]
    for q in library_quantized():
      fns[q] = functools.partial(
        _lib,
        transfer="int8" if "int8" in q else "float8_e4m3fn",
        bidirectional=q.endswith("_bidi"),
      )
  if name not in fns:
    raise ValueError(
      f"variant {name!r} is not available; choose from {available()}."
    )
  return jax.jit(
    jax.shard_map(fns[name], mesh=mesh, in_specs=in_specs, out_specs=out_spec)
  )


def abstract_args(name, mesh, shape, dtype):
  """ShapeDtypeStructs for variant ``name`` at global shape ``(B, D, F)``."""
  if name in _REGISTERED:
    return _REGISTERED[name][1](mesh, shape, dtype)
  b, d, f = shape
  if name in ("allgather_matmul_torus", "jit_torus"):
    xy = NamedSharding(mesh, P(None, ("x", AXIS)))
    return (
      jax.ShapeDtypeStruct((b, d), dtype, sharding=xy),
      jax.ShapeDtypeStruct((d, f), dtype, sharding=xy),
    )
  x, y = mesh.shape["x"], mesh.shape[AXIS]
  if ":" in name:
    family, _, kind = name.partition(":")
    fam = FAMILIES[family]
    if kind == "unsharded":
      s = jax.sharding.SingleDeviceSharding(mesh.devices.flat[0])
      return tuple(
        jax.ShapeDtypeStruct(sh, dtype, sharding=s)
        for sh in fam.bound_shapes(b, d, f, x, y)
      )
    return tuple(
      jax.ShapeDtypeStruct(sh, dtype, sharding=NamedSharding(mesh, spec))
      for sh, spec in zip(fam.shapes(b, d, f), fam.in_specs, strict=True)
    )
  if name == "unsharded":
    dev = mesh.devices.flat[0]
    s = jax.sharding.SingleDeviceSharding(dev)
    return (
      jax.ShapeDtypeStruct((b // x, d), dtype, sharding=s),
      jax.ShapeDtypeStruct((d, f // y), dtype, sharding=s),
    )
  return (
    jax.ShapeDtypeStruct(
      (b, d), dtype, sharding=NamedSharding(mesh, P("x", AXIS))
    ),
    jax.ShapeDtypeStruct(
      (d, f), dtype, sharding=NamedSharding(mesh, P(None, AXIS))
    ),
  )


# The fused ring kernels' variants and jnp twins (their own module).
from benchmarks import _fused_variants  # noqa: E402, F401
