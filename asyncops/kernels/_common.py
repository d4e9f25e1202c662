"""Building blocks shared by the start/done kernels.

Device addressing: kernels address peers by full mesh coordinates. The axis
we communicate over gets the peer's index; every other mesh axis keeps this
device's own index. (Passing a dict with only the communicated axis makes
Pallas fill the others with an ``axis_index`` that fails to lower in jax
0.10.2, so we always spell all coordinates out.)

Barriers: before a device writes into a peer's destination buffer it must
know the peer has entered the matching start kernel (so nothing else still
uses that buffer). Each receiver signals the global barrier semaphore of each
device that sends to it, and each sender waits for as many signals as it has
receivers. When a device waits for signals from two or more peers, one fast
peer re-entering the next kernel with the same ``collective_id`` could
satisfy the wait on its own (jax-ml/jax PR #27963); such kernels add a second
barrier on a kernel-local semaphore.

Collective ids: kernels that synchronise with different peer patterns must
not share a barrier semaphore, so every distinct pattern gets its own id. Ids
are allocated when the start is lowered, per program (a TPU has few barrier
semaphores; separately compiled programs may reuse them).
"""

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from asyncops import _jax_compat as jc

# Dtypes a TPU DMA moves as-is: a DMA copies bytes, and Mosaic takes the
# 8-bit floats and 4-bit types too (every op compiles with them for v5e and
# v6e, tests/test_dtypes_tpu.py). Mosaic refuses bool ("DMAs with bool dtypes
# are not supported") and XLA's TPU compiler complex64 in a Mosaic call; the
# value API moves those as a carrier (asyncops.futures._bitcast). 64-bit
# types are not DMA-able.
# The 8-bit floats and 4-bit types move on jax >= 0.10 only
# (``_jax_compat.NARROW_DMA``).
NARROW_DTYPES = (
  "float8_e4m3fn",
  "float8_e5m2",
  "int4",
  "uint4",
  "float4_e2m1fn",
)
MOVABLE_DTYPES = (
  "float32",
  "bfloat16",
  "float16",
  "int32",
  "uint32",
  "int16",
  "uint16",
  "int8",
  "uint8",
) + (NARROW_DTYPES if jc.NARROW_DMA else ())

# A TPU has a small, fixed number of barrier semaphores (tens).
MAX_COLLECTIVE_IDS = 16


def collective_id(scope: dict, pattern: tuple) -> int:
  """A barrier-semaphore id for one communication pattern in one program.

  Args:
    scope: per-program storage (``_jax_compat.module_scope``).
    pattern: hashable description of who synchronises with whom (op kind,
      mesh axis, the pairs, the axis size).

  Returns:
    The id: equal for equal patterns, distinct for distinct ones, within the
    program being lowered.

  Raises:
    RuntimeError: when one program uses more distinct patterns than there
      are barrier semaphores.
  """
  ids = scope.setdefault("collective_ids", {})
  if pattern not in ids:
    if len(ids) >= MAX_COLLECTIVE_IDS:
      raise RuntimeError(
        f"asyncops: more than {MAX_COLLECTIVE_IDS} distinct communication "
        "patterns in one program; a TPU has only a few barrier semaphores. "
        "Reuse perms (e.g. express rings with shift=) to share ids."
      )
    ids[pattern] = len(ids)
  return ids[pattern]


def assign_collective_id(scope: dict, params: dict) -> dict:
  """Lowering hook: gives ``params["spec"]`` its program-wide barrier id."""
  spec = params["spec"]
  if spec.axis_name is None or spec.collective_id is not None:
    return params
  pattern = (spec.kind, spec.axis_name, spec.perm, spec.axis_size)
  spec = dataclasses.replace(spec, collective_id=collective_id(scope, pattern))
  return {**params, "spec": spec}


def peer(
  mesh_axes: Sequence[str], axis_name: str, index: jax.Array
) -> tuple[jax.Array, ...]:
  """Full mesh coordinates of the peer at ``index`` along ``axis_name``."""
  return tuple(
    index if a == axis_name else jax.lax.axis_index(a) for a in mesh_axes
  )


def lookup(me: jax.Array, table: dict[int, int]) -> jax.Array:
  """``table[me]`` for a traced scalar ``me``; -1 where ``me`` is absent."""
  out = jnp.int32(-1)
  for k, v in sorted(table.items()):
    out = jnp.where(me == k, jnp.int32(v), out)
  return out


def signal(sem, mesh_axes, axis_name, index) -> None:
  pl.semaphore_signal(
    sem,
    1,
    device_id=peer(mesh_axes, axis_name, index),
    device_id_type=pl.DeviceIdType.MESH,
  )


def second_barrier(mesh_axes, axis_name, peers_to_signal, count) -> None:
  """A kernel-local barrier run after the global one (PR #27963)."""

  def body(sem):
    for index, cond in peers_to_signal:

      @pl.when(cond)
      def _(index=index):
        signal(sem, mesh_axes, axis_name, index)

    pl.semaphore_wait(sem, count)

  pl.run_scoped(body, pltpu.SemaphoreType.REGULAR)


def ring_peer(spec, me: jax.Array, shift: int) -> tuple[jax.Array, ...]:
  """Mesh coordinates of the device ``shift`` hops from ``me`` on the ring
  of ``spec`` (any spec with ``mesh_axes``, ``axis_name`` and ``n``)."""
  return peer(
    spec.mesh_axes, spec.axis_name, jax.lax.rem(me + shift + spec.n, spec.n)
  )


def ring_barrier(spec, me: jax.Array) -> None:
  """The ring kernels' two-round barrier with the devices that send to
  ``me`` (one per shift in ``spec.shifts``); the second round runs on a
  kernel-local semaphore when there are two senders (PR #27963)."""
  n = spec.n
  barrier = pltpu.get_barrier_semaphore()
  # Each device tells the peers that send to it that it has entered.
  senders = [jax.lax.rem(me - sh + n, n) for sh in spec.shifts]
  for src in senders:
    signal(barrier, spec.mesh_axes, spec.axis_name, src)
  pl.semaphore_wait(barrier, len(senders))
  if len(senders) > 1:
    second_barrier(
      spec.mesh_axes,
      spec.axis_name,
      [(src, True) for src in senders],
      len(senders),
    )


def all_peers_barrier(spec, me: jax.Array) -> list[jax.Array]:
  """The barrier of kernels where every device sends to every other on
  ``spec.axis_name`` (``axis_size >= 2``), then a second round on a
  kernel-local semaphore (PR #27963). Returns the peers,
  ``(me + k) % n`` for ``k`` in ``1 .. n - 1``."""
  n, axes, name = spec.axis_size, spec.mesh_axes, spec.axis_name
  peers = [jax.lax.rem(me + k, n) for k in range(1, n)]
  with jax.named_scope("barrier"):
    barrier = pltpu.get_barrier_semaphore()
    for p in peers:
      signal(barrier, axes, name, p)
    pl.semaphore_wait(barrier, n - 1)
    second_barrier(axes, name, [(p, True) for p in peers], n - 1)
  return peers


def check_ring(directions: int, n: int) -> None:
  """Validates a ring spec's ``directions`` and ring size ``n``."""
  if directions not in (1, 2):
    raise ValueError(f"directions must be 1 or 2, got {directions}")
  if n < 2:
    raise ValueError(f"the ring needs n >= 2 devices, got {n}")


def wait_dma(ref, sem) -> None:
  """Waits until ``sem`` has seen a transfer the size of ``ref``."""
  pltpu.make_async_copy(ref, ref, sem).wait()


def wait_recv_slots(o_ref, sems, *, spec) -> None:
  """Waits for the ``axis_size - 1`` slots of ``o_ref`` the peers write
  (one receive semaphore, one slot-sized DMA per peer)."""
  (recv_sem,) = sems
  for _ in range(spec.axis_size - 1):
    wait_dma(o_ref.at[0], recv_sem)


ANY = pl.BlockSpec(memory_space=jc.ANY)
# Buffers that must stay in HBM (XLA would otherwise move small ones to VMEM
# and copy them back).
HBM = pl.BlockSpec(memory_space=jc.HBM)
SEM = pl.BlockSpec(memory_space=jc.SEMAPHORE)
DMA = pltpu.SemaphoreType.DMA(())


def scoped_limit(need: int, cap: int | None = None) -> int:
  """A kernel's scoped VMEM limit for ``need`` bytes: a quarter more and
  4 MiB of room, at most 90% of the chip's ``cap`` bytes where given."""
  limit = need + need // 4 + 2**22
  return limit if cap is None else min(int(cap * 0.9), limit)


def params(*, collective_id: int | None = None) -> pltpu.CompilerParams:
  """Compiler params: kernels are never dead code, they move data."""
  return jc.tpu_compiler_params(collective_id=collective_id)


def start_call(kernel, x, out_shapes, *, spec, name: str):
  """Calls a start kernel that sends one buffer ``x``.

  ``kernel(x_ref, aliased_x_ref, o_ref, send_sem, recv_sem, *, spec)``
  returns ``x`` aliased (so XLA keeps the source alive until the done), the
  destination buffer and the send and receive DMA semaphores.
  ``out_shapes`` is ``(source shape, destination shape)``.
  """
  return pl.pallas_call(
    functools.partial(kernel, spec=spec),
    out_shape=(*out_shapes, DMA, DMA),
    in_specs=[ANY],
    out_specs=(ANY, ANY, SEM, SEM),
    input_output_aliases={0: 0},
    compiler_params=params(
      collective_id=None if spec.axis_size == 1 else spec.collective_id
    ),
    name=name,
  )(x)


def shape_like(x, shape=None, dtype=None) -> jax.ShapeDtypeStruct:
  """An output shape that varies over the same manual axes as ``x``."""
  aval = jax.typeof(x)
  return jax.ShapeDtypeStruct(
    aval.shape if shape is None else tuple(shape),
    aval.dtype if dtype is None else dtype,
    **jc.manual_axes_kwargs(aval),
  )


def vary_like(y, x):
  """``y`` typed as varying over every manual axis ``x`` varies over too
  (``lax.pcast``: no HLO; ``y`` as it is where it already does).

  An output declared by memory space (``pltpu.VMEM(shape, dtype)``,
  :func:`hbm_like`) varies over no manual axis; a kernel that takes it
  beside ``x`` gets, on jax 0.9, refs of different types (its Pallas types
  a kernel's refs with their operands' varying axes; 0.10's with none),
  and a ``lax.cond`` between a read of each fails there."""
  axes = jc.varying_axes(x) - jc.varying_axes(y)
  if not axes:
    return y
  return jax.lax.pcast(y, tuple(sorted(axes)), to="varying")


def shape_joint(shape, dtype, *xs) -> jax.ShapeDtypeStruct:
  """An output shape that varies over every manual axis any of ``xs`` does
  (a matmul's result varies wherever either operand does)."""
  avals = [
    x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x) for x in xs
  ]
  return jax.ShapeDtypeStruct(
    tuple(shape), dtype, **jc.joint_manual_axes_kwargs(avals)
  )


def hbm_like(x):
  """An output shape pinned to HBM (a kernel's DMAs and the next kernel
  address it there; XLA would otherwise keep a small one in VMEM and copy
  it out at the end)."""
  return jc.HBM(tuple(x.shape), x.dtype)
