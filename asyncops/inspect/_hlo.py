"""A small parser for XLA's scheduled HLO text.

It reads what the TPU compiler prints after scheduling and buffer
assignment (``compiled.as_text()``): computations in order, instructions in
scheduled order, per-leaf memory spaces from the layouts, custom-call
aliasing, metadata and the stack-frame tables that say which line of user
code an instruction comes from.

Example:

  >>> m = parse_module('''HloModule m, is_scheduled=true
  ... ENTRY %main (p: f32[8]) -> f32[8] {
  ...   %p = f32[8]{0} parameter(0)
  ...   ROOT %c = f32[8]{0:S(1)} copy(%p)
  ... }''')
  >>> m.entry.root.operands
  ('p',)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from typing import Any

# The memory space numbers of TPU layouts (``S(n)``), one table for v4, v5e,
# v5p and v6e. Sources: jax/_src/tpu_custom_call.py (``MemorySpace.color``:
# HBM 0, VMEM 1, semaphores 2, SMEM 4, host 5) and compiles of this
# project's programs for each generation (design/inspect.md):
# - S(1) VMEM: v5e/v5p/v6e put whole buffers there (128/64/128 MiB); v4
#   rejects it for buffers ("Invalid memory space: 1", VMEM is 16 MiB);
# - S(2) semaphores (sync flags): every DMA semaphore;
# - S(3) CMEM, v4's 128 MiB common memory: the same 4 MiB buffers that sit
#   in S(1) on the other chips sit in S(3) on v4, and compiling with
#   ``xla_tpu_cmem_memory_space_assignment=False`` removes every S(3); the
#   other generations have no CMEM (jax/_src/pallas/mosaic/tpu_info.py) and
#   never show S(3);
# - S(6): scalars of the scalar unit (loop counters, slot indices, s32/pred
#   of one element), on every generation.
MEMORY_SPACES = {
  0: "HBM",
  1: "VMEM",
  2: "SEM",
  3: "CMEM",
  4: "SMEM",
  5: "HOST",
  6: "SCALAR",
}

# Bits per element of XLA's array element types; other leaves (``token``,
# ``opaque``) hold no array data.
_BITS = {
  "pred": 8,
  **dict.fromkeys(("s2", "u2"), 2),
  **dict.fromkeys(("s4", "u4", "f4e2m1fn"), 4),
  **dict.fromkeys(("s8", "u8", "f8e5m2", "f8e4m3", "f8e4m3fn"), 8),
  **dict.fromkeys(("f8e4m3b11fnuz", "f8e5m2fnuz", "f8e4m3fnuz"), 8),
  **dict.fromkeys(("f8e3m4", "f8e8m0fnu"), 8),
  **dict.fromkeys(("s16", "u16", "f16", "bf16"), 16),
  **dict.fromkeys(("s32", "u32", "f32"), 32),
  **dict.fromkeys(("s64", "u64", "f64", "c64"), 64),
  "c128": 128,
}


@dataclasses.dataclass(frozen=True)
class Leaf:
  """One array (non-tuple) element of a shape.

  Attributes:
    index: the shape index of the leaf inside its (tuple) shape.
    text: the leaf's shape text, e.g. ``f32[8,128]{1,0:T(8,128)S(1)}``.
    dtype: element type, e.g. ``f32``.
    dims: dimensions.
    memory_space: the ``S(n)`` memory space from the layout (0 if absent).
  """

  index: tuple[int, ...]
  text: str
  dtype: str
  dims: tuple[int, ...]
  memory_space: int

  @property
  def num_elements(self) -> int:
    n = 1
    for d in self.dims:
      n *= d
    return n

  @property
  def is_array(self) -> bool:
    """Whether the leaf holds array data (not a ``token`` or ``opaque``)."""
    return self.dtype in _BITS

  @property
  def nbytes(self) -> int:
    """Bytes of the array data (sub-byte types packed; 0 for non-arrays)."""
    return self.num_elements * _BITS.get(self.dtype, 0) // 8


@dataclasses.dataclass(frozen=True)
class Frame:
  """One frame of user code: file, line and function."""

  file: str
  line: int
  function: str

  def __str__(self) -> str:
    return f"{self.file.rsplit('/', 1)[-1]}:{self.line} in {self.function}"


@dataclasses.dataclass(frozen=True)
class Instr:
  """One HLO instruction, in the scheduled order of its computation.

  Attributes:
    name: instruction name without ``%``.
    opcode: HLO opcode, e.g. ``custom-call``, ``copy``, ``fusion``.
    shape_text: the printed shape.
    leaves: array leaves of the shape, each with its memory space.
    operands: operand instruction names.
    computation: the name of the enclosing computation.
    position: index in the computation's schedule.
    is_root: whether this is the computation's ROOT.
    attrs: the raw attribute text after the operand list.
    target: ``custom_call_target`` if any.
    aliasing: custom-call ``output_to_operand_aliasing`` as
      ``((output_index, operand_number, operand_index), ...)``.
    tuple_index: ``index=`` of a get-tuple-element.
    called: names of called computations (``body``, ``condition``,
      ``calls``, ``to_apply``, branches).
    branches: a ``conditional``'s branch computations, in order: operand
      ``k + 1`` enters branch ``k``'s parameter (``true_computation``
      first for the predicated form).
    estimated_cycles: the compiler's cost estimate, when printed.
    op_name: ``metadata.op_name``.
    stack: user-code frames, innermost first (from ``stack_frame_id``).
    parameter_number: a ``parameter``'s number.

  :meth:`attr` gives one attribute's raw text and :attr:`backend_config`
  the parsed backend config. **A Mosaic kernel's** ``"body"`` **is blanked
  in** ``attrs`` (it is long and opaque).
  """

  name: str
  opcode: str
  shape_text: str
  leaves: tuple[Leaf, ...]
  operands: tuple[str, ...]
  computation: str
  position: int
  is_root: bool
  attrs: str
  target: str | None = None
  aliasing: tuple[tuple[tuple[int, ...], int, tuple[int, ...]], ...] = ()
  tuple_index: int | None = None
  called: tuple[str, ...] = ()
  branches: tuple[str, ...] = ()
  body: str | None = None
  condition: str | None = None
  estimated_cycles: float | None = None
  op_name: str = ""
  stack: tuple[Frame, ...] = ()
  parameter_number: int | None = None

  @property
  def memory_space(self) -> int | None:
    """Memory space of an array result (None for tuples)."""
    if len(self.leaves) == 1 and self.leaves[0].index == ():
      return self.leaves[0].memory_space
    return None

  @property
  def source(self) -> str:
    """Innermost user frame, e.g. ``model.py:42 in f`` ('' if unknown)."""
    return str(self.stack[0]) if self.stack else ""

  @property
  def where(self) -> str:
    """Innermost frame and its caller, e.g. ``k.py:24 in start <- f.py:9``."""
    return " <- ".join(str(f) for f in self.stack[:2])

  @property
  def is_tuple(self) -> bool:
    return self.shape_text.startswith("(")

  def leaf(self, index: tuple[int, ...]) -> Leaf | None:
    for lf in self.leaves:
      if lf.index == index:
        return lf
    return None

  @property
  def arrays(self) -> tuple[Leaf, ...]:
    """The leaves that hold array data (no ``token`` / ``opaque``)."""
    return tuple(lf for lf in self.leaves if lf.is_array)

  @property
  def nbytes(self) -> int:
    """Bytes of the result: the sum over its array leaves."""
    return sum(lf.nbytes for lf in self.leaves)

  def attr(self, key: str) -> str | None:
    """The raw text of attribute ``key=...`` (brackets balanced), or None.

    Example:

      >>> i = parse_module(
      ...   "ENTRY %e (p: f32[8]) -> f32[8] {\\n"
      ...   "  ROOT %a = f32[8]{0} all-gather(%p), replica_groups={{0,1}}\\n"
      ...   "}"
      ... ).instr("a")
      >>> i.attr("replica_groups"), i.attr("channel_id")
      ('{{0,1}}', None)
    """
    m = re.search(rf"\b{re.escape(key)}=", self.attrs)
    if not m:
      return None
    at = m.end()
    if at < len(self.attrs) and self.attrs[at] in _OPEN:
      return self.attrs[at : _balanced_end(self.attrs, at)]
    return re.match(r"[^,\s]*", self.attrs[at:]).group(0)

  @functools.cached_property
  def backend_config(self) -> dict[str, Any]:
    """The parsed ``backend_config`` JSON ({} if absent or not JSON)."""
    text = self.attr("backend_config")
    if not text:
      return {}
    try:
      # Continuation lines keep their newlines: allow them inside strings.
      config = json.loads(text, strict=False)
    except ValueError:
      return {}
    return config if isinstance(config, dict) else {}

  @property
  def estimate_is_valid(self) -> bool:
    """False when XLA marks its cost estimate ``COST_MODEL_TYPE_INVALID``.

    Seen on v5e for standalone converts and broadcasts: e.g. a 4 MiB f32 ->
    bf16 convert carries 35944 cycles (24 us, 3x its HBM traffic).
    """
    return '"cost_model_type":"COST_MODEL_TYPE_INVALID"' not in self.attrs

  @property
  def collective_id(self) -> int | None:
    """A Mosaic kernel's barrier ``collective_id`` (None when it has none)."""
    config = self.backend_config.get("custom_call_config")
    cid = config.get("collective_id") if isinstance(config, dict) else None
    return None if cid is None else int(cid)

  def __str__(self) -> str:
    return f"%{self.name} = {self.opcode}"


@dataclasses.dataclass(frozen=True)
class Computation:
  """A computation: its instructions in scheduled order."""

  name: str
  instrs: tuple[Instr, ...]
  is_entry: bool

  @property
  def root(self) -> Instr:
    for i in self.instrs:
      if i.is_root:
        return i
    return self.instrs[-1]

  @property
  def params(self) -> tuple[Instr, ...]:
    return tuple(i for i in self.instrs if i.opcode == "parameter")


@dataclasses.dataclass(frozen=True)
class Module:
  """A parsed HLO module."""

  name: str
  computations: dict[str, Computation]
  entry_name: str
  is_scheduled: bool
  # Entry parameters XLA may write or hand to an output: named in the
  # header's ``input_output_alias`` or ``buffer_donor`` (a donated
  # argument). The others are the caller's buffers, live for the whole
  # program.
  donated_params: frozenset[int] = frozenset()

  @property
  def entry(self) -> Computation:
    return self.computations[self.entry_name]

  def instr(self, name: str) -> Instr:
    return self._by_name()[name]

  @property
  def instructions(self) -> dict[str, Instr]:
    """Every instruction by name (computations and schedules in order)."""
    return dict(self._by_name())

  def _by_name(self) -> dict[str, Instr]:
    cache = self.__dict__.get("_cache")
    if cache is None:
      cache = {i.name: i for c in self.computations.values() for i in c.instrs}
      object.__setattr__(self, "_cache", cache)
    return cache


_OPEN = "([{"
_CLOSE = ")]}"


def _balanced_end(text: str, start: int) -> int:
  """Index just past the bracket group opening at ``text[start]``."""
  depth = 0
  in_str = False
  i = start
  while i < len(text):
    ch = text[i]
    if in_str:
      if ch == "\\":
        i += 1
      elif ch == '"':
        in_str = False
    elif ch == '"':
      in_str = True
    elif ch in _OPEN:
      depth += 1
    elif ch in _CLOSE:
      depth -= 1
      if depth == 0:
        return i + 1
    i += 1
  raise ValueError(f"unbalanced brackets in {text[start : start + 80]!r}")


def _split_top(text: str) -> list[str]:
  """Splits on commas that are not nested inside brackets."""
  parts, depth, cur = [], 0, []
  for ch in text:
    if ch in _OPEN:
      depth += 1
    elif ch in _CLOSE:
      depth -= 1
    if ch == "," and depth == 0:
      parts.append("".join(cur))
      cur = []
    else:
      cur.append(ch)
  if "".join(cur).strip():
    parts.append("".join(cur))
  return parts


_COMMENT = re.compile(r"/\*.*?\*/")
_ARRAY = re.compile(r"^([a-z][a-z0-9]*)\[([0-9,]*)\](\{.*\})?$")
_SPACE = re.compile(r"S\((\d+)\)")


def parse_shape(text: str, index: tuple[int, ...] = ()) -> tuple[Leaf, ...]:
  """Array leaves of a shape text, with their shape indices.

  Args:
    text: e.g. ``(f32[8]{0:S(1)}, s32[]{:S(2)})``.
    index: the shape index of ``text`` inside an enclosing shape.

  Returns:
    The array leaves, in order.

  Example:

    >>> [lf.memory_space for lf in parse_shape("(f32[8]{0}, s32[]{:S(2)})")]
    [0, 2]
  """
  text = _COMMENT.sub("", text).strip()
  if text.startswith("("):
    inner = text[1:-1]
    leaves: list[Leaf] = []
    for k, part in enumerate(_split_top(inner)):
      leaves.extend(parse_shape(part, index + (k,)))
    return tuple(leaves)
  m = _ARRAY.match(text)
  if not m:
    return (Leaf(index, text, text, (), 0),)
  dims = tuple(int(d) for d in m.group(2).split(",") if d)
  layout = m.group(3) or ""
  sm = _SPACE.search(layout.split(":", 1)[1] if ":" in layout else "")
  return (Leaf(index, text, m.group(1), dims, int(sm.group(1)) if sm else 0),)


_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_OPCODE = re.compile(r"\s*([a-z][\w\-]*)\(")
_ALIAS = re.compile(r"\{([\d,\s]*)\}:\s*\((\d+),\s*\{([\d,\s]*)\}\)")
_CYCLES = re.compile(r'"estimated_cycles":"?([\d.]+)')
_OPNAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_FRAME_ID = re.compile(r"stack_frame_id=(\d+)")
_NAMES = re.compile(r"%([\w.\-]+)")


def _ints(text: str) -> tuple[int, ...]:
  return tuple(int(x) for x in text.replace(" ", "").split(",") if x)


def _attr_names(attrs: str, key: str) -> tuple[str, ...]:
  m = re.search(rf"\b{key}=(\{{[^}}]*\}}|%?[\w.\-]+)", attrs)
  if not m:
    return ()
  return tuple(n.lstrip("%") for n in re.findall(r"%?[\w.\-]+", m.group(1)))


def _parse_tables(lines: list[str]) -> dict[int, tuple[Frame, ...]]:
  """Reads FileNames/FunctionNames/FileLocations/StackFrames tables."""
  tables: dict[str, dict[int, str]] = {}
  current = None
  for line in lines:
    s = line.strip()
    if s in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
      current = tables.setdefault(s, {})
      continue
    if current is None:
      continue
    m = re.match(r"^(\d+)\s+(.*)$", s)
    if m:
      current[int(m.group(1))] = m.group(2)
    elif s == "" or s.startswith("%") or s.startswith("ENTRY"):
      current = None
  files = {k: v.strip('"') for k, v in tables.get("FileNames", {}).items()}
  funcs = {k: v.strip('"') for k, v in tables.get("FunctionNames", {}).items()}

  def field(text: str, key: str) -> int:
    m = re.search(rf"\b{key}=(\d+)", text)
    return int(m.group(1)) if m else 0

  locs = {}
  for k, v in tables.get("FileLocations", {}).items():
    locs[k] = Frame(
      files.get(field(v, "file_name_id"), "?"),
      field(v, "line"),
      funcs.get(field(v, "function_name_id"), "?"),
    )
  # XLA prints each frame's parent as ``parent_frame_id = key + 1`` (the
  # proto's 1-based id, 0 meaning none) while the table keys start at 1.
  raw = {
    k: (field(v, "file_location_id"), field(v, "parent_frame_id") - 1)
    for k, v in tables.get("StackFrames", {}).items()
  }
  stacks: dict[int, tuple[Frame, ...]] = {}
  for fid in raw:
    frames, seen, cur = [], set(), fid
    while cur in raw and cur not in seen:
      seen.add(cur)
      loc, parent = raw[cur]
      if loc in locs and (not frames or frames[-1] != locs[loc]):
        frames.append(locs[loc])
      cur = parent
    stacks[fid] = tuple(frames)
  return stacks


def _parse_instr(
  text: str, comp: str, position: int, stacks: dict[int, tuple[Frame, ...]]
) -> Instr:
  m = _INSTR.match(text)
  assert m, text
  is_root, name = bool(m.group(1)), m.group(2)
  pos = m.end()
  if text[pos] == "(":
    end = _balanced_end(text, pos)
  else:
    end = pos
    depth = 0
    while end < len(text):
      ch = text[end]
      if ch in _OPEN:
        depth += 1
      elif ch in _CLOSE:
        depth -= 1
      elif ch == " " and depth == 0:
        break
      end += 1
  shape_text = text[pos:end]
  om = _OPCODE.match(text, end)
  if not om:
    raise ValueError(f"cannot parse instruction: {text[:200]}")
  opcode = om.group(1)
  paren = om.end() - 1
  close = _balanced_end(text, paren)
  operand_text = text[paren + 1 : close - 1]
  operands = tuple(_NAMES.findall(operand_text))
  attrs = text[close:]
  # Drop the (long, opaque) kernel body before searching attributes.
  attrs_s = re.sub(r'"body":"[^"]*"', '"body":""', attrs)
  target = re.search(r'custom_call_target="([^"]+)"', attrs_s)
  aliasing: tuple = ()
  key = "output_to_operand_aliasing="
  at = attrs_s.find(key)
  if at >= 0:
    group = attrs_s[at + len(key) : _balanced_end(attrs_s, at + len(key))]
    aliasing = tuple(
      (_ints(a), int(b), _ints(c)) for a, b, c in _ALIAS.findall(group)
    )
  ti = re.search(r"\bindex=(\d+)", attrs_s)
  called: list[str] = []
  for key in ("calls", "to_apply", "body", "condition"):
    called.extend(_attr_names(attrs_s, key))
  branches: tuple[str, ...] = ()
  if opcode == "conditional":
    branches = _attr_names(attrs_s, "branch_computations") or (
      _attr_names(attrs_s, "true_computation")
      + _attr_names(attrs_s, "false_computation")
    )
    called.extend(branches)
  body = _attr_names(attrs_s, "body")
  cond = _attr_names(attrs_s, "condition")
  cyc = _CYCLES.search(attrs_s)
  opn = _OPNAME.search(attrs_s)
  fid = _FRAME_ID.search(attrs_s)
  return Instr(
    name=name,
    opcode=opcode,
    shape_text=shape_text,
    leaves=parse_shape(shape_text),
    operands=operands,
    computation=comp,
    position=position,
    is_root=is_root,
    attrs=attrs_s,
    target=target.group(1) if target else None,
    aliasing=aliasing,
    tuple_index=int(ti.group(1))
    if ti and opcode == "get-tuple-element"
    else None,
    called=tuple(called),
    branches=branches,
    body=body[0] if body and opcode == "while" else None,
    condition=cond[0] if cond and opcode == "while" else None,
    estimated_cycles=float(cyc.group(1)) if cyc else None,
    op_name=opn.group(1) if opn else "",
    stack=stacks.get(int(fid.group(1)), ()) if fid else (),
    parameter_number=int(operand_text)
    if opcode == "parameter" and operand_text.strip().isdigit()
    else None,
  )


def parse_module(text: str) -> Module:
  """Parses HLO text (scheduled or not) into a :class:`Module`.

  Args:
    text: the output of ``compiled.as_text()`` or a handwritten snippet.

  Returns:
    The parsed module.

  Raises:
    ValueError: if an instruction cannot be parsed or no computation is
      found.
  """
  lines = text.splitlines()
  stacks = _parse_tables(lines)
  head = lines[0] if lines else ""
  mname = re.match(r"HloModule\s+([\w.\-]+)", head)
  comps: dict[str, Computation] = {}
  entry = None
  cur_name, cur_entry, cur_lines = None, False, []

  def flush():
    instrs = []
    for pos, t in enumerate(cur_lines):
      instrs.append(_parse_instr(t, cur_name, pos, stacks))
    comps[cur_name] = Computation(cur_name, tuple(instrs), cur_entry)

  for line in lines:
    if cur_name is None:
      hm = _HEADER.match(line)
      if hm and not line.startswith("HloModule"):
        cur_name, cur_entry, cur_lines = hm.group(2), bool(hm.group(1)), []
        if cur_entry:
          entry = cur_name
      continue
    if line.strip() == "}":
      flush()
      cur_name = None
      continue
    if _INSTR.match(line):
      cur_lines.append(line.strip())
    elif cur_lines:
      cur_lines[-1] += "\n" + line
  if not comps:
    raise ValueError("no HLO computation found")
  if entry is None:
    entry = list(comps)[-1]
  return Module(
    name=mname.group(1) if mname else "",
    computations=comps,
    entry_name=entry,
    is_scheduled="is_scheduled=true" in head,
    donated_params=_donated_params(head),
  )


def _header_field(head: str, key: str) -> str:
  """The brace-balanced value of ``key={...}`` in a module header."""
  at = head.find(key + "={")
  if at < 0:
    return ""
  i = at + len(key) + 1
  depth = 0
  for j in range(i, len(head)):
    depth += {"{": 1, "}": -1}.get(head[j], 0)
    if depth == 0:
      return head[i : j + 1]
  return head[i:]


def _donated_params(head: str) -> frozenset[int]:
  """Entry parameter numbers the header aliases to outputs or donates.

  >>> sorted(_donated_params(
  ...   "HloModule m, input_output_alias={ {0}: (1, {}, may-alias) }, "
  ...   "buffer_donor={ (2, {}) }"))
  [1, 2]
  """
  aliases = _header_field(head, "input_output_alias")
  aliased = re.findall(r":\s*\((\d+),", aliases)
  donors = re.findall(r"\((\d+),", _header_field(head, "buffer_donor"))
  return frozenset(int(k) for k in aliased + donors)
