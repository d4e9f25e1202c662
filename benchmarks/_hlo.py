"""A small reader for scheduled HLO text (``compiled.as_text()``).

Only what the timeline model needs: computations in order, each
instruction's name, opcode, result shapes, operand names, called
computations and parsed ``backend_config``. Instructions may span lines
(``frontend_attributes`` with newlines); a statement ends when its brackets
balance outside string literals.
"""

import dataclasses
import json
import math
import re
from typing import Any

_DTYPE_BYTES = {
  "pred": 1,
  "s4": 0.5,
  "u4": 0.5,
  "s8": 1,
  "u8": 1,
  "f8e4m3fn": 1,
  "f8e5m2": 1,
  "s16": 2,
  "u16": 2,
  "f16": 2,
  "bf16": 2,
  "s32": 4,
  "u32": 4,
  "f32": 4,
  "s64": 8,
  "u64": 8,
  "f64": 8,
  "c64": 8,
  "c128": 16,
}
_ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\](\{[^}]*\})?")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLS = re.compile(
  r"\b(calls|body|condition|to_apply|true_computation|false_computation)="
  r"%([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


@dataclasses.dataclass(frozen=True)
class Array:
  """One array leaf of a result shape."""

  dtype: str
  dims: tuple[int, ...]
  layout: str

  @property
  def nbytes(self) -> int:
    return int(math.prod(self.dims) * _DTYPE_BYTES.get(self.dtype, 4))

  @property
  def memory_space(self) -> int:
    m = re.search(r"S\((\d+)\)", self.layout)
    return int(m.group(1)) if m else 0


@dataclasses.dataclass
class Instr:
  """One HLO instruction."""

  name: str
  opcode: str
  shape: str
  operands: list[str]
  attrs: str
  is_root: bool = False

  @property
  def arrays(self) -> list[Array]:
    return [
      Array(d, tuple(int(x) for x in s.split(",") if x), lay or "")
      for d, s, lay in _ARRAY.findall(self.shape)
      if d in _DTYPE_BYTES
    ]

  @property
  def nbytes(self) -> int:
    return sum(a.nbytes for a in self.arrays)

  @property
  def backend_config(self) -> dict[str, Any]:
    i = self.attrs.find("backend_config=")
    if i < 0:
      return {}
    text = _balanced(self.attrs, i + len("backend_config="))
    try:
      return json.loads(text)
    except ValueError:
      return {}

  @property
  def estimated_cycles(self) -> int | None:
    """XLA's per-op cost estimate, when the backend wrote one."""
    cfg = self.backend_config
    for key in ("window_config", "fusion_config", "custom_call_config"):
      v = cfg.get(key, {}).get("estimated_cycles") if key in cfg else None
      if v is not None:
        return int(v)
    m = re.search(r'"estimated_cycles":"?(\d+)', self.attrs)
    return int(m.group(1)) if m else None

  @property
  def estimate_is_valid(self) -> bool:
    """False when XLA marks its estimate ``COST_MODEL_TYPE_INVALID``.

    Seen on v5e for standalone converts and broadcasts: e.g. a 4 MiB f32 ->
    bf16 convert carries 35944 cycles (24 us, 3x its HBM traffic).
    """
    return '"cost_model_type":"COST_MODEL_TYPE_INVALID"' not in self.attrs

  @property
  def called(self) -> list[str]:
    out = [m.group(2) for m in _CALLS.finditer(self.attrs)]
    for m in _BRANCHES.finditer(self.attrs):
      out += [c.strip().lstrip("%") for c in m.group(1).split(",")]
    return out

  def attr(self, key: str) -> str | None:
    """The raw text of ``key=...`` (braces balanced), or ``None``."""
    m = re.search(r"\b" + re.escape(key) + "=", self.attrs)
    if not m:
      return None
    return _balanced(self.attrs, m.end())


@dataclasses.dataclass
class Module:
  """A parsed HLO module: computations in text order, entry name."""

  computations: dict[str, list[Instr]]
  entry: str

  def instr(self, comp: str, name: str) -> Instr | None:
    for i in self.computations[comp]:
      if i.name == name:
        return i
    return None


def _balanced(text: str, i: int) -> str:
  """The bracketed (or plain) token starting at ``text[i]``."""
  if i >= len(text) or text[i] not in "{[(":
    m = re.match(r"[^,\s]*", text[i:])
    return m.group(0) if m else ""
  depth, j, quote = 0, i, False
  while j < len(text):
    c = text[j]
    if quote:
      if c == "\\":
        j += 1
      elif c == '"':
        quote = False
    elif c == '"':
      quote = True
    elif c in "{[(":
      depth += 1
    elif c in "}])":
      depth -= 1
      if depth == 0:
        return text[i : j + 1]
    j += 1
  return text[i:]


def _depth(line: str, quote: bool) -> tuple[int, bool]:
  d, j = 0, 0
  while j < len(line):
    c = line[j]
    if quote:
      if c == "\\":
        j += 1
      elif c == '"':
        quote = False
    elif c == '"':
      quote = True
    elif c in "{[(":
      d += 1
    elif c in "}])":
      d -= 1
    j += 1
  return d, quote


def _statements(lines: list[str]):
  buf, depth, quote = [], 0, False
  for line in lines:
    buf.append(line.strip())
    d, quote = _depth(line, quote)
    depth += d
    if depth <= 0 and not quote:
      yield " ".join(buf)
      buf, depth = [], 0


def _parse_instr(stmt: str) -> Instr | None:
  root = stmt.startswith("ROOT ")
  if root:
    stmt = stmt[5:]
  m = re.match(r"%?([\w.\-]+)\s*=\s*", stmt)
  if not m:
    return None
  rest = stmt[m.end() :]
  shape = _balanced(rest, 0) if rest.startswith("(") else rest.split(" ")[0]
  rest = rest[len(shape) :].lstrip()
  op = re.match(r"([\w\-]+)", rest)
  if not op:
    return None
  rest = rest[op.end() :]
  args = _balanced(rest, 0) if rest.startswith("(") else "()"
  attrs = rest[len(args) :].lstrip(", ")
  operands = re.findall(r"%([\w.\-]+)", args)
  return Instr(m.group(1), op.group(1), shape, operands, attrs, root)


def parse(text: str) -> Module:
  """Parses ``compiled.as_text()`` into a :class:`Module`.

  Example:
    >>> m = parse(compiled.as_text())  # doctest: +SKIP
    >>> [i.opcode for i in m.computations[m.entry]]  # doctest: +SKIP
  """
  comps: dict[str, list[Instr]] = {}
  entry = ""
  lines = text.splitlines()
  i = 0
  while i < len(lines):
    h = _HEADER.match(lines[i])
    if not h or lines[i].startswith(("HloModule", " ")):
      i += 1
      continue
    name = h.group(2)
    if h.group(1):
      entry = name
    body = []
    i += 1
    while i < len(lines) and lines[i].rstrip() != "}":
      body.append(lines[i])
      i += 1
    comps[name] = [x for x in (_parse_instr(s) for s in _statements(body)) if x]
    i += 1
  if not entry:
    raise ValueError("parse: no ENTRY computation in the HLO text.")
  return Module(comps, entry)
