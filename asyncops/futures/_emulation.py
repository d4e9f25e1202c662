"""How the non-TPU emulation moves data: at the start or at the done.

On TPU the data moves while compute runs between start and done. Everywhere
else asyncops emulates the transfer with ``jax.lax`` collectives at one of
two points. A correct program gives the same result for both; a program
whose result depends on the point reads a buffer while it is in flight.
"""

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

from asyncops.futures._spec import Transfer


@dataclasses.dataclass(frozen=True)
class Emulation:
  """Emulation settings.

  Attributes:
    transfer: ``"start"`` moves data when the start runs, ``"done"`` when
      the first wait (``send_done`` or ``done``) runs.
  """

  transfer: Transfer = "start"

  def __post_init__(self):
    if self.transfer not in ("start", "done"):
      raise ValueError(
        f"transfer must be 'start' or 'done', got {self.transfer!r}"
      )


_current: contextvars.ContextVar[Emulation] = contextvars.ContextVar(
  "asyncops_emulation",
  default=Emulation(),  # noqa: B039 (frozen, immutable)
)


def current() -> Emulation:
  """The emulation settings in effect for code traced now."""
  return _current.get()


@contextlib.contextmanager
def emulation(transfer: Transfer = "start") -> Iterator[Emulation]:
  """Sets the emulation's transfer point for ops traced in this block.

  Args:
    transfer: ``"start"`` or ``"done"``.

  Yields:
    The settings in effect.

  Example:
    >>> import asyncops
    >>> with asyncops.emulation("done"):
    ...   pass  # trace (jit) programs here
  """
  token = _current.set(Emulation(transfer))
  try:
    yield _current.get()
  finally:
    _current.reset(token)
