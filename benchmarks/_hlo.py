"""The timeline model's view of scheduled HLO text.

Parsing is :mod:`asyncops.inspect`'s (``parse_module``: instructions with
result leaves and bytes, operands, called computations, ``backend_config``,
XLA's cost estimates). The model walks computations by name, so this module
only reshapes the parsed module into ``computation name -> scheduled
instructions`` plus the entry's name.
"""

import dataclasses
import re

from asyncops.inspect import Instr, parse_module

# A scalar literal: ``%c = u32[]{:T(128)} constant(4)``. The inspect parser
# keeps no literal values; the model needs scalar ones for loop bounds.
_SCALAR = re.compile(
  r"%([\w.\-]+) = [a-z]+\d*\[\][^ ]* constant\((-?[\d.]+|true|false)\)"
)


@dataclasses.dataclass(frozen=True)
class Module:
  """Computations in text order, each its instructions in schedule order.

  Attributes:
    computations: computation name -> its instructions.
    entry: the name of the ENTRY computation.
    constants: scalar constant instruction name -> its value (instruction
      names are unique in a module).
  """

  computations: dict[str, tuple[Instr, ...]]
  entry: str
  constants: dict[str, float] = dataclasses.field(default_factory=dict)


def parse(text: str) -> Module:
  """Parses ``compiled.as_text()`` into a :class:`Module`.

  Args:
    text: scheduled HLO text with an ENTRY computation.

  Returns:
    The module, as the timeline model walks it.

  Raises:
    ValueError: if the text has no ENTRY computation or an instruction
      cannot be parsed.

  Example:
    >>> m = parse(compiled.as_text())  # doctest: +SKIP
    >>> [i.opcode for i in m.computations[m.entry]]  # doctest: +SKIP
  """
  module = parse_module(text)
  if not module.entry.is_entry:
    raise ValueError("parse: no ENTRY computation in the HLO text.")
  constants = {
    name: float({"true": 1, "false": 0}.get(value, value))
    for name, value in _SCALAR.findall(text)
  }
  return Module(
    {name: c.instrs for name, c in module.computations.items()},
    module.entry_name,
    constants,
  )
