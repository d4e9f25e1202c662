"""asyncops: asynchronous collectives for Pallas TPU kernels.

Start a transfer, compute while it runs, wait for it. The compute must be
pinned inside the window (``scheduling.overlap``), or XLA may schedule it
before the start or after the done::

  x, fut = asyncops.ppermute_start(x, "i", shift=1)   # use the returned x
  z, fut = asyncops.scheduling.overlap(fut, jnp.dot, x, w)  # in the window
  y = asyncops.ppermute_done(fut)

Subpackages (all available after ``import asyncops``): ``futures`` (the
value API re-exported here), ``scheduling``, ``stateful`` (the same ops
over ``jax.Ref``), ``inspect`` (the compiled-HLO harness),
``collective_matmul``, ``compare``, ``kernels``; ``asyncops.testing`` is
the pytest plugin (imported on first use, it needs pytest).
"""

import importlib as _importlib
import importlib.metadata as _metadata

from asyncops import collective_matmul as collective_matmul
from asyncops import compare as compare
from asyncops import futures as futures
from asyncops import inspect as inspect
from asyncops import kernels as kernels
from asyncops import scheduling as scheduling
from asyncops import stateful as stateful
from asyncops._jit import jit as jit
from asyncops.futures import Emulation as Emulation
from asyncops.futures import Future as Future
from asyncops.futures import FutureError as FutureError
from asyncops.futures import NeverAwaitedWarning as NeverAwaitedWarning
from asyncops.futures import all_gather_done as all_gather_done
from asyncops.futures import all_gather_start as all_gather_start
from asyncops.futures import bidirectional_done as bidirectional_done
from asyncops.futures import bidirectional_start as bidirectional_start
from asyncops.futures import check_futures as check_futures
from asyncops.futures import copy_done as copy_done
from asyncops.futures import copy_start as copy_start
from asyncops.futures import done as done
from asyncops.futures import emulation as emulation
from asyncops.futures import ppermute_done as ppermute_done
from asyncops.futures import ppermute_start as ppermute_start
from asyncops.futures import recv_done as recv_done
from asyncops.futures import send_done as send_done
from asyncops.scheduling import overlap as overlap

try:
  __version__ = _metadata.version("asyncops")
except _metadata.PackageNotFoundError:  # a source tree, not installed
  __version__ = "0+unknown"


def __getattr__(name: str):
  # ``asyncops.testing`` imports pytest: load it only when asked for.
  if name == "testing":
    return _importlib.import_module("asyncops.testing")
  raise AttributeError(f"module 'asyncops' has no attribute {name!r}")
