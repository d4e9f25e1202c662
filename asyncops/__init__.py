"""asyncops: asynchronous collectives for Pallas TPU kernels.

Start a transfer, compute while it runs, wait for it::

  x, fut = asyncops.ppermute_start(x, "i", shift=1)
  z = x @ w                      # overlaps the DMA on TPU
  y = asyncops.ppermute_done(fut)
"""

from asyncops import collective_matmul as collective_matmul
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
