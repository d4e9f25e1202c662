"""Collective matmuls: tensor-parallel matmuls with hidden communication."""

from asyncops.collective_matmul._allgather import (
  allgather_matmul as allgather_matmul,
)
