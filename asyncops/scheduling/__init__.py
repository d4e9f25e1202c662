"""Scheduling helpers: overlap without copies, by construction.

``overlap`` pins compute inside a start/done window, ``fori_loop``
double-buffers loops of transfers, ``staggered`` runs the prologue / body /
epilogue pipeline, and :class:`CopyHazardError` is raised at trace time for
programs XLA could only compile with a copy. See ``design/scheduling.md``.
"""

from asyncops.scheduling._errors import CopyHazardError as CopyHazardError
from asyncops.scheduling._errors import (
  CopyHazardWarning as CopyHazardWarning,
)
from asyncops.scheduling._loop import fori_loop as fori_loop
from asyncops.scheduling._overlap import overlap as overlap
from asyncops.scheduling._pipeline import staggered as staggered
