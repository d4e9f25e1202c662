"""Collective matmuls: tensor-parallel matmuls with hidden communication."""

from asyncops.collective_matmul._allgather import (
  allgather_matmul as allgather_matmul,
)
from asyncops.collective_matmul._allreduce import (
  matmul_allreduce as matmul_allreduce,
)
from asyncops.collective_matmul._mlp import mlp_block as mlp_block
from asyncops.collective_matmul._reducescatter import (
  matmul_reducescatter as matmul_reducescatter,
)
from asyncops.collective_matmul._torus import (
  torus_allgather_matmul as torus_allgather_matmul,
)
from asyncops.collective_matmul._vmem import FusedVmem as FusedVmem
from asyncops.collective_matmul._vmem import (
  FusedVmemWarning as FusedVmemWarning,
)
from asyncops.collective_matmul._vmem import fused_vmem as fused_vmem
