"""The stateful API: asynchronous transfers between ``jax.Ref``s."""

from asyncops.stateful._api import all_gather_done as all_gather_done
from asyncops.stateful._api import all_gather_start as all_gather_start
from asyncops.stateful._api import copy_done as copy_done
from asyncops.stateful._api import copy_start as copy_start
from asyncops.stateful._api import ppermute_done as ppermute_done
from asyncops.stateful._api import ppermute_start as ppermute_start
from asyncops.stateful._double_buffer import DoubleBuffer as DoubleBuffer
from asyncops.stateful._double_buffer import double_buffer as double_buffer
from asyncops.stateful._future import RefFuture as RefFuture
from asyncops.stateful._hazards import assume_disjoint as assume_disjoint
