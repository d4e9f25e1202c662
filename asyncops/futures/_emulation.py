"""How the non-TPU emulation moves data: at the start or at the done.

On TPU the data moves while compute runs between start and done. Everywhere
else asyncops emulates the transfer with ``jax.lax`` collectives at one of
two points. A correct program gives the same result for both; a program
whose result depends on the point reads a buffer while it is in flight.

The mode is part of what a jitted function is traced for: calling it under
another mode retraces (it is a JAX config state in the jit cache key,
``asyncops_emulation``; the environment variable ``ASYNCOPS_EMULATION``
sets the default).
"""

import contextlib
import dataclasses
from collections.abc import Iterator

from asyncops import _jax_compat as jc
from asyncops.kernels._spec import Transfer

_TRANSFERS = ("start", "done")

_state = jc.traced_setting(
  "asyncops_emulation",
  _TRANSFERS,
  "start",
  help=(
    "Where asyncops' non-TPU emulation moves data: 'start' or 'done'. "
    "Part of the jit cache key."
  ),
)


@dataclasses.dataclass(frozen=True)
class Emulation:
  """Emulation settings.

  Attributes:
    transfer: ``"start"`` moves data when the start runs, ``"done"`` when
      the first wait (``send_done`` or ``done``) runs.
  """

  transfer: Transfer = "start"

  def __post_init__(self):
    if self.transfer not in _TRANSFERS:
      raise ValueError(
        f"asyncops.emulation: transfer must be 'start' or 'done', got "
        f"{self.transfer!r}."
      )


def current() -> Emulation:
  """The emulation settings in effect for code traced now."""
  return Emulation(_state.value)


@contextlib.contextmanager
def emulation(transfer: Transfer = "start") -> Iterator[Emulation]:
  """Sets the emulation's transfer point for ops traced in this block.

  The mode is part of ``jax.jit``'s cache key: a jitted function called in
  this block is traced (again) for this mode, never run with the program
  traced for the other one.

  Args:
    transfer: ``"start"`` or ``"done"``.

  Yields:
    The settings in effect.

  Raises:
    ValueError: ``transfer`` is neither ``"start"`` nor ``"done"``.

  Example:
    >>> import asyncops
    >>> with asyncops.emulation("done"):
    ...   pass  # trace (jit) or call jitted programs here
  """
  settings = Emulation(transfer)
  with _state(settings.transfer):
    yield settings
