"""Helpers over compiled TPU HLO for the futures tests.

Parsing and AOT meshes are ``asyncops.inspect``'s (``parse_module``,
``tpu_mesh``); this file finds our start/done custom calls and follows
``get-tuple-element`` chains, enough to check the structure the futures
promise.
"""

import re

from asyncops.inspect import Instr, Module, parse_module
from asyncops.inspect import tpu_mesh as tpu_mesh

TOPOLOGIES = ("v5e:2x4", "v4:2x2x1", "v6e:2x4", "v5p:2x2x2")


def compile_hlo(jitted, *args) -> Module:
  """The parsed compiled HLO of ``jitted`` for the abstract ``args``."""
  return parse_module(jitted.trace(*args).lower().compile().as_text())


def ours(module: Module, suffix: str) -> list[Instr]:
  """Our custom calls whose name ends in ``suffix`` (e.g. ``_start``)."""
  pat = re.compile(rf"^asyncops_\w+{suffix}(\.\d+)?$")
  return [
    i
    for i in module.instructions.values()
    if i.opcode == "custom-call" and pat.match(i.name)
  ]


def source(module: Module, name: str) -> tuple[str, int | None]:
  """Follows ``get-tuple-element`` back to ``(instruction, tuple index)``."""
  i = module.instr(name)
  if i.opcode == "get-tuple-element":
    return i.operands[0], i.tuple_index
  return name, None


def is_mosaic(i: Instr) -> bool:
  return i.target == "tpu_custom_call"


def sem_indices(start: Instr) -> list[int]:
  """Tuple indices of a start's semaphore outputs (``s32[]`` in ``S(2)``)."""
  assert start.is_tuple, start.shape_text
  return [
    lf.index[0]
    for lf in start.leaves
    if len(lf.index) == 1
    and (lf.dtype, lf.dims, lf.memory_space) == ("s32", (), 2)
  ]
