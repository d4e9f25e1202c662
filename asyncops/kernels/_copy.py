"""Local asynchronous copy: one DMA on this device, HBM to HBM or to VMEM.

Algorithm. The start kernel starts ``make_async_copy(x_ref, o_ref, sem)``
and returns the aliased source, the destination and the one DMA semaphore.
There is no communication, so no barrier and no ``collective_id``; the copy
also works outside ``shard_map`` (under plain ``jax.jit``).

The semaphore counts as a *send* semaphore (``send_sems = 1``,
``recv_sems = 0``): a local copy's semaphore is signalled once the data has
been read and written, and the source must stay alive until it has been
read, so ``send_done`` waits on it. ``recv_done`` (which always follows
``send_done``) then has nothing left to wait for.

Destination memory. ``memory_space="any"`` leaves the placement to XLA
(normally HBM, or VMEM for small buffers on chips where XLA chooses so);
``"vmem"`` asks for a VMEM destination, and the done kernels keep it there
(``KernelSet.dst_memory``).

Limits. A VMEM destination needs a TPU v5 or later: jax's own tests skip
async copies into VMEM before v5, and TPU v4 fails to compile them. The
start checks the target chip while lowering (``_jax_compat.tpu_chip``) and
raises a clear error instead. The destination must fit in VMEM, which is
tens of MiB shared with the program's other VMEM buffers.
"""

import functools

from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from asyncops import _jax_compat as jc
from asyncops.kernels import _common as c
from asyncops.kernels import _registry
from asyncops.kernels._spec import OpSpec

# TPU generations whose DMA engines can target VMEM from a kernel.
MIN_VMEM_GENERATION = 5


def copy_start_kernel(x_ref, aliased_x_ref, o_ref, sem, *, spec: OpSpec):
  del aliased_x_ref, spec
  pltpu.make_async_copy(x_ref, o_ref, sem).start()


def wait_send(x_ref, sems, *, spec: OpSpec):
  del spec
  (sem,) = sems
  c.wait_dma(x_ref, sem)


def wait_recv(o_ref, sems, *, spec: OpSpec):
  del o_ref, sems, spec  # The send semaphore covered the whole copy.


def _check_vmem_target(spec: OpSpec) -> None:
  generation = jc.tpu_generation()
  if generation is not None and generation < MIN_VMEM_GENERATION:
    raise NotImplementedError(
      f"copy_start: memory_space='vmem' needs TPU v{MIN_VMEM_GENERATION} or "
      f"later, but this program is compiled for TPU v{generation}, whose "
      "DMA engines cannot copy into VMEM from a kernel. Use "
      "memory_space='any' (XLA may still place a small destination in "
      f"VMEM). ({spec.short()})"
    )


def start(x, *, spec: OpSpec):
  if spec.memory_space == "vmem":
    _check_vmem_target(spec)
    dst_shape = pltpu.VMEM(x.shape, x.dtype)
    dst_spec = pl.BlockSpec(memory_space=pltpu.VMEM)
  else:
    dst_shape = c.shape_like(x)
    dst_spec = c.ANY
  return pl.pallas_call(
    functools.partial(copy_start_kernel, spec=spec),
    out_shape=(jc.shape_like(x), dst_shape, c.DMA),
    in_specs=[c.ANY],
    out_specs=(c.ANY, dst_spec, c.SEM),
    input_output_aliases={0: 0},
    compiler_params=c.params(),
    name="asyncops_copy_start",
  )(x)


def emulate(x, *, spec: OpSpec):
  del spec
  return x


_registry.register(
  "copy",
  _registry.KernelSet(
    send_sems=lambda spec: 1,
    recv_sems=lambda spec: 0,
    dst_shape=lambda spec: spec.shape,
    start=start,
    wait_send=wait_send,
    wait_recv=wait_recv,
    emulate=emulate,
    dst_memory=lambda spec: spec.memory_space,
  ),
)
