"""The table from an op kind to its kernels and its emulation.

Each kernel module registers one :class:`KernelSet`. The future primitives
(``asyncops.futures``) look kernels up here when they lower, so adding an op
is adding one module.
"""

import dataclasses
from collections.abc import Callable

from asyncops.kernels._spec import OpSpec


def _identity(dst, spec):
  del spec
  return dst


@dataclasses.dataclass(frozen=True)
class KernelSet:
  """Kernels and emulation of one asynchronous op.

  Attributes:
    send_sems: number of semaphores the source side waits on.
    recv_sems: number of semaphores the destination side waits on. A start
      returns ``send_sems + recv_sems`` semaphores, send ones first.
    dst_shape: the destination buffer's shape for a spec.
    start: TPU start, ``start(x, *, spec) -> (x, dst, *sems)``.
    wait_send: kernel body waiting for the sends,
      ``wait_send(x_ref, send_sems, *, spec)``.
    wait_recv: kernel body waiting for the receives,
      ``wait_recv(dst_ref, recv_sems, *, spec)``.
    emulate: the transfer with ``jax.lax`` semantics, ``(x, *, spec) ->
      dst``, used on every platform but TPU.
    finalize: turns the raw destination into the user-facing result, on
      every platform (e.g. zeros for devices nobody sends to, the tiled
      layout of an all-gather).
    validate: raises a clear error for a spec the kernel cannot run.
  """

  send_sems: Callable[[OpSpec], int]
  recv_sems: Callable[[OpSpec], int]
  dst_shape: Callable[[OpSpec], tuple[int, ...]]
  start: Callable
  wait_send: Callable
  wait_recv: Callable
  emulate: Callable
  finalize: Callable = _identity
  validate: Callable[[OpSpec], None] = lambda spec: None
  dst_memory: Callable[[OpSpec], str] = lambda spec: "any"


_KERNELS: dict[str, KernelSet] = {}


def register(kind: str, kernels: KernelSet) -> None:
  _KERNELS[kind] = kernels


def get(kind: str) -> KernelSet:
  _load_all()
  try:
    return _KERNELS[kind]
  except KeyError:
    raise NotImplementedError(f"asyncops: no kernels for {kind!r}") from None


def _load_all() -> None:
  # Kernel modules register themselves on import.
  from asyncops.kernels import _ppermute  # noqa: F401

  try:
    from asyncops.kernels import _bidirectional  # noqa: F401
  except ImportError:
    pass
  try:
    from asyncops.kernels import _all_gather  # noqa: F401
  except ImportError:
    pass
  try:
    from asyncops.kernels import _copy  # noqa: F401
  except ImportError:
    pass
  try:
    from asyncops.kernels import _all_to_all  # noqa: F401
  except ImportError:
    pass
