"""A small reader of compiled TPU HLO text, for the futures tests.

The full harness is ``asyncops.inspect`` (branch ``inspect``); this file only
finds our start/done custom calls and follows ``get-tuple-element`` chains,
enough to check the structure the futures promise.
"""

import dataclasses
import functools
import os
import re

import jax
import numpy as np
from jax.experimental import topologies

# Several processes (pytest workers, other users) may compile for TPU at once;
# without this, libtpu refuses the second one ("libtpu multi-process
# lockfile"). Ahead-of-time compiles claim no chip, so sharing is safe.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

TOPOLOGIES = ("v5e:2x4", "v4:2x2x1", "v6e:2x4")


@dataclasses.dataclass(frozen=True)
class Instr:
  """One HLO instruction: ``%name = shape opcode(operands), attrs``."""

  name: str
  shape: str
  opcode: str
  operands: tuple[str, ...]
  attrs: str
  computation: str

  def tuple_shapes(self) -> list[str]:
    """The element shapes of a tuple-shaped instruction."""
    assert self.shape.startswith("("), self.shape
    return _split_top(self.shape[1:-1])

  @property
  def index(self) -> int:
    """For a ``get-tuple-element``: the element index."""
    return int(re.search(r"index=(\d+)", self.attrs).group(1))

  def aliasing(self) -> list[tuple[str, int]]:
    """``output_to_operand_aliasing`` as (output index, operand) pairs."""
    key = "output_to_operand_aliasing="
    at = self.attrs.find(key)
    if at < 0:
      return []
    at += len(key)
    body = self.attrs[at : _matching(self.attrs, at) + 1]
    pairs = re.findall(r"\{([\d,]*)\}: \((\d+), \{\}\)", body)
    return [(out, int(op)) for out, op in pairs]


def _split_top(s: str) -> list[str]:
  """Splits ``s`` at commas outside brackets."""
  out, depth, cur = [], 0, []
  for ch in s:
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    if ch == "," and depth == 0:
      out.append("".join(cur).strip())
      cur = []
    else:
      cur.append(ch)
  if "".join(cur).strip():
    out.append("".join(cur).strip())
  return out


def _matching(s: str, i: int) -> int:
  """The index of the bracket closing the one at ``s[i]``."""
  depth = 0
  for j in range(i, len(s)):
    if s[j] in "([{":
      depth += 1
    elif s[j] in ")]}":
      depth -= 1
      if depth == 0:
        return j
  raise ValueError(f"unbalanced: {s[i : i + 80]}")


_HEAD = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+) = ")
_COMP = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+) .*\{$")


def parse(text: str) -> dict[str, Instr]:
  """All instructions of an HLO module, by name."""
  instrs, comp = {}, ""
  for line in text.splitlines():
    if m := _COMP.match(line):
      comp = m.group(1)
      continue
    m = _HEAD.match(line)
    if not m:
      continue
    rest = line[m.end() :]
    if rest.startswith("("):
      end = _matching(rest, 0)
      shape, rest = rest[: end + 1], rest[end + 2 :]
    else:
      shape, _, rest = rest.partition(" ")
    opcode, _, rest = rest.partition("(")
    end = _matching("(" + rest, 0) - 1
    operands = tuple(re.findall(r"%([\w.\-]+)", rest[:end]))
    instrs[m.group(1)] = Instr(
      m.group(1), shape, opcode, operands, rest[end + 1 :], comp
    )
  return instrs


def ours(instrs: dict[str, Instr], suffix: str) -> list[Instr]:
  """Our custom calls whose name ends in ``suffix`` (e.g. ``_start``)."""
  pat = re.compile(rf"^asyncops_\w+{suffix}(\.\d+)?$")
  return [
    i
    for i in instrs.values()
    if i.opcode == "custom-call" and pat.match(i.name)
  ]


def source(instrs: dict[str, Instr], name: str) -> tuple[str, int | None]:
  """Follows ``get-tuple-element`` back to ``(instruction, tuple index)``."""
  i = instrs[name]
  if i.opcode == "get-tuple-element":
    return i.operands[0], i.index
  return name, None


def is_mosaic(i: Instr) -> bool:
  return 'custom_call_target="tpu_custom_call"' in i.attrs


def sem_indices(start: Instr) -> list[int]:
  """Tuple indices of a start's semaphore outputs (``s32[]`` in ``S(2)``)."""
  return [
    k
    for k, s in enumerate(start.tuple_shapes())
    if s.startswith("s32[]") and "S(2)" in s
  ]


# TPU meshes ------------------------------------------------------------------


@functools.cache
def topology(name: str):
  """The AOT TPU topology; libtpu's start-up chatter on fd 2 is dropped."""
  saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
  try:
    os.dup2(null, 2)
    return topologies.get_topology_desc(name, platform="tpu")
  finally:
    os.dup2(saved, 2)
    os.close(saved)
    os.close(null)


def tpu_mesh(name: str, shape, axis_names) -> jax.sharding.Mesh:
  devices = np.array(topology(name).devices)
  return jax.sharding.Mesh(devices.reshape(shape), tuple(axis_names))


def compile_text(jitted, *args) -> str:
  return jitted.trace(*args).lower().compile().as_text()
