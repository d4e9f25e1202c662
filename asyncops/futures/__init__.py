"""Value-level futures: start returns ``(x, future)``, done waits."""

from asyncops.futures._api import all_gather_done as all_gather_done
from asyncops.futures._api import all_gather_start as all_gather_start
from asyncops.futures._api import bidirectional_done as bidirectional_done
from asyncops.futures._api import bidirectional_start as bidirectional_start
from asyncops.futures._api import copy_done as copy_done
from asyncops.futures._api import copy_start as copy_start
from asyncops.futures._api import done as done
from asyncops.futures._api import ppermute_done as ppermute_done
from asyncops.futures._api import ppermute_start as ppermute_start
from asyncops.futures._api import recv_done as recv_done
from asyncops.futures._api import send_done as send_done
from asyncops.futures._check import check_futures as check_futures
from asyncops.futures._emulation import Emulation as Emulation
from asyncops.futures._emulation import emulation as emulation
from asyncops.futures._future import Future as Future
from asyncops.futures._future import FutureError as FutureError
from asyncops.futures._future import NeverAwaitedWarning as NeverAwaitedWarning
from asyncops.kernels._spec import OpSpec as OpSpec
