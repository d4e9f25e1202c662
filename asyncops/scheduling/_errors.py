"""Errors for programs that XLA could only compile with a buffer copy.

The classes live in :mod:`asyncops.inspect` (the layer below), whose guard
raises them on compiled programs; the scheduling helpers raise the same
classes at trace time.
"""

from asyncops.inspect._guard import CopyHazardError as CopyHazardError
from asyncops.inspect._guard import CopyHazardWarning as CopyHazardWarning
