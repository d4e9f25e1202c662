"""Compile one variant for a TPU topology, model it, make its table row.

Compiling is the slow part (seconds to a minute per program on this
machine), so the scheduled HLO and the memory figures are cached on disk
under ``$ASYNCOPS_BENCH_CACHE`` (default ``out/cache``), keyed by the
variant, shape, dtype, topology, mesh, compiler options, the jax and libtpu
versions and the lowered program's text. Lowering takes a second, so an edit
to the library recompiles only the programs whose lowered text it changes
(never XLA's own baselines). Re-modelling (other latency constants, prefetch
charged) reuses the cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gzip
import hashlib
import json
import os
import pathlib
import re
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from typing import Any

import jax
import jax.numpy as jnp

from benchmarks import _chips, _hlo, _kernel_costs, _mesh, _timeline, _variants
from benchmarks.xla_configs import hlo_key

_ROOT = pathlib.Path(__file__).resolve().parent.parent
# Model options every simulate() call here uses (run.py's flags set them).
MODEL: dict[str, Any] = {"collectives": "ring"}


@dataclasses.dataclass(frozen=True)
class Spec:
  """One program to compile.

  Attributes:
    variant: a :mod:`benchmarks._variants` name (``jit``,
      ``reducescatter:asyncops``, ...).
    topology: e.g. ``"v5e:2x4"``.
    tp: devices on the ``y`` axis (None: the mesh default).
    shape: global ``(B, D, F)``.
    dtype: operand dtype.
    precision: matmul precision (``"highest"``) or None.
    options: XLA compiler options.
    layout: :func:`benchmarks._mesh.make_mesh` layout.
  """

  variant: str
  topology: str
  tp: int | None
  shape: tuple[int, int, int]
  dtype: Any
  precision: str | None = None
  options: dict = dataclasses.field(default_factory=dict)
  layout: str = "ring"

  @property
  def family(self) -> str:
    return (
      self.variant.partition(":")[0] if ":" in self.variant else "allgather"
    )

  @property
  def config(self) -> str:
    name = jnp.dtype(self.dtype).name
    return f"{name}:{self.precision}" if self.precision else name


@dataclasses.dataclass
class Result:
  """A compiled and modelled program."""

  spec: Spec
  row: dict
  timeline: _timeline.Timeline
  text: str
  hlo_key: str


def progress(items: Iterable, desc: str) -> Iterator:
  """A progress bar on the terminal (``asyncops._cli`` when present)."""
  items = list(items)
  try:
    from asyncops._cli import progress as bar  # noqa: PLC0415
  except ImportError:
    bar = None
  if bar is not None:
    yield from bar(items, desc)
    return
  show = sys.stderr.isatty() and os.environ.get("ASYNCOPS_PROGRESS") != "0"
  for i, item in enumerate(items):
    if show:
      print(
        f"\r{desc}: {i}/{len(items)} {str(item)[:50]:50s}",
        end="",
        file=sys.stderr,
        flush=True,
      )
    yield item
  if show:
    print(f"\r{desc}: {len(items)}/{len(items)}{' ' * 52}", file=sys.stderr)


@functools.cache
def _versions_digest() -> str:
  h = hashlib.sha1()
  try:
    import libtpu  # noqa: PLC0415

    h.update(str(getattr(libtpu, "__version__", "")).encode())
  except ImportError:
    pass
  h.update(jax.__version__.encode())
  return h.hexdigest()[:16]


@functools.cache
def mesh_for(topology: str, layout: str, tp: int | None):
  return _mesh.make_mesh(topology, layout, tp)


def _cache_dir() -> pathlib.Path | None:
  where = os.environ.get("ASYNCOPS_BENCH_CACHE", str(_ROOT / "out" / "cache"))
  return None if where in ("", "0", "off") else pathlib.Path(where)


def _key(spec: Spec, lowered_text: str) -> str:
  parts = [
    spec.variant,
    spec.topology,
    str(spec.tp),
    spec.layout,
    ",".join(map(str, spec.shape)),
    spec.config,
    json.dumps(spec.options, sort_keys=True, default=str),
    _versions_digest(),
    hashlib.sha1(lowered_text.encode()).hexdigest(),
  ]
  return hashlib.sha1("|".join(parts).encode()).hexdigest()


_MEM = (
  "peak_memory_in_bytes",
  "argument_size_in_bytes",
  "output_size_in_bytes",
  "alias_size_in_bytes",
  "generated_code_size_in_bytes",
  "temp_size_in_bytes",
)


def compile_spec(spec: Spec) -> tuple[str, dict, float]:
  """``(scheduled HLO text, memory figures, compile seconds)``, cached."""
  mesh = mesh_for(spec.topology, spec.layout, spec.tp)
  fn = _variants.build(spec.variant, mesh, precision=spec.precision)
  args = _variants.abstract_args(spec.variant, mesh, spec.shape, spec.dtype)
  with _mesh.quiet_fd2():
    lowered = fn.trace(*args).lower()
  cache = _cache_dir()
  path = cache / f"{_key(spec, _key_text(lowered))}.json.gz" if cache else None
  if path is not None and path.exists():
    with gzip.open(path, "rt") as f:
      data = json.load(f)
    # Entries cached before the buffer assignment was read lack its
    # temporaries: compile again (the same program) and add them.
    if _ALLOC_KEY in data["mem"]:
      return data["text"], data["mem"], data["compile_s"]
  t0 = time.perf_counter()
  compiled, assignment = compile_with_assignment(lowered, spec.options)
  compile_s = time.perf_counter() - t0
  text = compiled.as_text()
  m = compiled.memory_analysis()
  mem = {k: int(getattr(m, k, 0) or 0) for k in _MEM}
  mem.update(assignment_temps(assignment))
  if path is not None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    with gzip.open(tmp, "wt") as f:
      json.dump({"text": text, "mem": mem, "compile_s": compile_s}, f)
    tmp.replace(path)
  return text, mem, compile_s


# The buffer assignment's temporaries per memory space, in the memory dict
# next to XLA's figures: ``alloc_temp_bytes`` (HBM, color 0) and
# ``alloc_temp_bytes_color<C>`` for the others (1 is VMEM on TPU).
_ALLOC_KEY = "alloc_temp_bytes"
_ALLOCATION = re.compile(r"^allocation (\d+): size (\d+)(.*):$")
_NOT_TEMP = ("parameter ", "constant", "maybe-live-out", "output shape")


def compile_with_assignment(lowered, options: dict | None = None):
  """``(compiled, buffer assignment text)``: compiles ``lowered`` with an
  XLA dump (``xla_dump_to``, text) into a temporary directory and reads the
  entry module's ``*after_optimizations-buffer-assignment.txt``.

  The dump options are debug options: the compiled program is the same as
  without them (``tests/test_bench_memory.py`` checks it). The executable's
  ``serialized_buffer_assignment_proto`` is empty for TPU compiles, hence
  the dump.
  """
  with tempfile.TemporaryDirectory(prefix="asyncops_ba_") as where:
    opts = {
      **(options or {}),
      "xla_dump_to": where,
      "xla_dump_hlo_as_text": True,
    }
    with _mesh.quiet_fd2():
      compiled = lowered.compile(compiler_options=opts)
    found = sorted(
      pathlib.Path(where).glob("*after_optimizations-buffer-assignment.txt")
    )
    if len(found) != 1:
      raise RuntimeError(
        f"expected one buffer assignment in the XLA dump, found {len(found)}"
        f" ({[p.name for p in found]})"
      )
    return compiled, found[0].read_text()


def assignment_temps(text: str) -> dict[str, int]:
  """Temporary bytes per memory space in an XLA buffer assignment.

  Each ``allocation N: size S[, color C], <kinds>:`` line is one buffer the
  executable reserves; values that share it (an aliased custom-call result
  and its operand, buffers reused once dead) are listed under it at their
  offsets and cost nothing more. An allocation is temporary unless it is an
  entry parameter, a constant or a (maybe) live-out output. Returns
  ``alloc_temp_bytes`` (color 0: HBM) and ``alloc_temp_bytes_color<C>``
  for every other color present.
  """
  out: dict[str, int] = {_ALLOC_KEY: 0}
  for line in text.splitlines():
    m = _ALLOCATION.match(line)
    if m is None:
      continue
    kinds = m.group(3)
    if any(k in kinds for k in _NOT_TEMP):
      continue
    color = re.search(r", color (\d+)", kinds)
    key = _ALLOC_KEY if color is None else f"{_ALLOC_KEY}_color{color[1]}"
    out[key] = out.get(key, 0) + int(m.group(2))
  return out


def peak_alloc_bytes(mem) -> int:
  """HBM bytes the executable reserves for temporaries: the buffer
  assignment's color-0 temporary allocations (:func:`assignment_temps`).

  Unlike :func:`peak_temp_bytes` it counts a buffer once however many HLO
  values share it (XLA's ``temp_size_in_bytes`` counts the result of an
  aliasing custom call and its operand apart), counts every buffer that is
  really separate (a DMA's source and destination), and leaves out other
  memory spaces (the weight's VMEM copy that ``peak_memory_in_bytes``
  includes).
  """
  get = mem.get if isinstance(mem, dict) else lambda k, d=0: getattr(mem, k, d)
  return int(get(_ALLOC_KEY, 0))


def _key_text(lowered) -> str:
  """The lowered text the cache keys on: without locations (an edit that
  moves a line recompiles nothing), plus the op-name labels the model reads
  that only locations hold: a stateful start's message
  (``ref_message_dst_slot`` / ``_whole``, ``_timeline._ref_message``).
  Programs without stateful starts keep their keys."""
  text = lowered.as_text()
  if "_ref_start" not in text:
    return text
  debug = lowered.as_text(debug_info=True)
  labels = re.findall(r"ref_message_dst_\w+", debug)
  return text + "\n// model labels: " + ",".join(labels)


def peak_temp_bytes(mem) -> int:
  """Peak bytes live beyond the program's own arguments, outputs and code.

  A compile-only TPU executable reports ``temp_size_in_bytes`` as 0, but its
  ``peak_memory_in_bytes`` counts everything live at the peak, so the
  temporaries are what is left after the arguments, outputs (aliased ones
  counted once) and generated code.
  """
  get = mem.get if isinstance(mem, dict) else lambda k, d=0: getattr(mem, k, d)
  peak = get("peak_memory_in_bytes", 0)
  fixed = (
    get("argument_size_in_bytes", 0)
    + get("output_size_in_bytes", 0)
    - get("alias_size_in_bytes", 0)
    + get("generated_code_size_in_bytes", 0)
  )
  return max(peak - fixed, get("temp_size_in_bytes", 0), 0)


def defensive_copies(text: str) -> int:
  """Defensive copies in the HLO (``asyncops.inspect``'s analysis)."""
  from asyncops.inspect import analyze_module, parse_module  # noqa: PLC0415

  return len(analyze_module(parse_module(text)).defensive_copies)


def simulate(
  text: str,
  spec: Spec,
  chip: _chips.Chip | None = None,
  prefetch: str = "free",
) -> _timeline.Timeline:
  """Models compiled ``text`` on ``spec``'s mesh (its rings, its coords)."""
  mesh = mesh_for(spec.topology, spec.layout, spec.tp)
  chip = chip or _chips.chip_for(spec.topology)
  return _timeline.simulate(
    _hlo.parse(text),
    chip,
    coords=_mesh.coords(mesh),
    rings=_mesh.mesh_rings(mesh),
    axis_rings=_mesh.axis_rings(mesh),
    prefetch=prefetch,
    kernel_cost=_coster(spec.topology, spec.layout, spec.tp, chip),
    **MODEL,
  )


@functools.cache
def _coster(topology, layout, tp, chip):
  mesh = mesh_for(topology, layout, tp)
  return _kernel_costs.KernelCoster(chip, mesh.devices.flat[0])


def measure(spec: Spec, chip: _chips.Chip | None = None) -> Result:
  """Compiles (or loads) and models ``spec``; the row has every column.

  Row keys: ``family``, ``variant``, ``dtype``, ``shape``, ``topology``,
  ``tp``, ``step_us`` (prefetch free), ``step_charged_us`` (XLA's
  cross-program prefetch of the weight charged from t = 0),
  ``exposed_us``, ``peak_temp_mib`` (XLA's figures), ``peak_alloc_mib``
  (HBM temporaries of the buffer assignment), ``vmem_alloc_mib``,
  ``defensive_copies``, ``compile_s``,
  ``floored_us``, ``flags``.
  """
  text, mem, compile_s = compile_spec(spec)
  tl = simulate(text, spec, chip)
  charged = simulate(text, spec, chip, prefetch="charged")
  mesh = mesh_for(spec.topology, spec.layout, spec.tp)
  row = {
    "family": spec.family,
    "variant": spec.variant,
    "dtype": spec.config,
    "shape": list(spec.shape),
    "topology": spec.topology,
    "mesh": dict(mesh.shape),
    "step_us": tl.step_s * 1e6,
    "step_charged_us": charged.step_s * 1e6,
    "exposed_us": tl.exposed_comm_s * 1e6,
    "peak_temp_mib": peak_temp_bytes(mem) / 2**20,
    "peak_alloc_mib": peak_alloc_bytes(mem) / 2**20,
    "vmem_alloc_mib": mem.get(f"{_ALLOC_KEY}_color1", 0) / 2**20,
    "defensive_copies": defensive_copies(text),
    "compile_s": compile_s,
    "floored_us": tl.floored_s * 1e6,
    "flags": list(tl.flags),
    "x_input": _variants.X_INPUT,
  }
  return Result(spec, row, tl, text, hlo_key(text))


@contextlib.contextmanager
def cache_off():
  """Compiles afresh inside the block (tests)."""
  old = os.environ.get("ASYNCOPS_BENCH_CACHE")
  os.environ["ASYNCOPS_BENCH_CACHE"] = "off"
  try:
    yield
  finally:
    if old is None:
      del os.environ["ASYNCOPS_BENCH_CACHE"]
    else:
      os.environ["ASYNCOPS_BENCH_CACHE"] = old
