"""How much VMEM the fused collective matmuls may keep across kernels.

The fused all-gather matmul and matmul-reduce-scatter return their receive
buffer in VMEM where it fits a share of the chip's VMEM
(``AgSpec.recv_vmem``, ``RsSpec.recv_vmem``; ``_fused._in_vmem`` and
``_fused._RECV_VMEM_SHARE``). The share was chosen from this project's
programs; a user program that itself keeps VMEM busy across ours (its own
Pallas kernel's VMEM output read after our kernels ran) can then no longer
compile: XLA moves the user's buffer out of VMEM and the user's kernel
runs out of its scoped VMEM (``RESOURCE_EXHAUSTED: ...
CompileTimeScopedVmemOom``; design/collective_matmul.md, "Branch
h-uservmem"). :func:`fused_vmem` caps the receive buffers in VMEM for the
programs traced and lowered inside it; :func:`asyncops.jit` retries a
program XLA refuses for VMEM with the buffers in HBM.

The setting is a ``jax.make_user_context``: part of jit's cache keys, so
a function traced inside and outside it compiles twice, not once with a
stale plan. It is read when the program is lowered (a call, or
``.lower()``), where the kernels are planned.
"""

import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class FusedVmem:
  """VMEM the fused kernels may keep across kernels.

  Attributes:
    recv_max_bytes: the largest receive buffer (per device, bytes) the
      fused kernels keep in VMEM; a larger one is an HBM buffer, as before
      the VMEM slots. ``None`` (default): the planner's own limits (the
      all-gather's 16 MiB and a 0.6 share of VMEM for its compute kernel,
      the reduce-scatter's 0.85 share). ``0``: every receive buffer in
      HBM. A cap only lowers the planner's limits, never raises them.
  """

  recv_max_bytes: int | None = None

  def __post_init__(self):
    b = self.recv_max_bytes
    if b is None:
      return
    if isinstance(b, bool) or not isinstance(b, int) or b < 0:
      raise ValueError(
        "fused_vmem: recv_max_bytes must be None (the planner's limits) or "
        f"an int >= 0 (bytes; 0 puts every receive buffer in HBM), got "
        f"{b!r}. E.g. fused_vmem(recv_max_bytes=4 * 2**20)."
      )


class FusedVmemWarning(UserWarning):
  """XLA refused a program for VMEM and ``asyncops.jit`` compiled it with
  the fused collective matmuls' receive buffers in HBM
  (``fused_vmem(recv_max_bytes=0)``): same results, slower where they
  were in VMEM."""


DEFAULT = FusedVmem()
_CONTEXT = jax.make_user_context(DEFAULT)


def fused_vmem(
  setting: FusedVmem | None = None, *, recv_max_bytes: int | None = None
):
  """A context in which the fused collective matmuls keep receive buffers
  of at most ``recv_max_bytes`` in VMEM (larger ones in HBM).

  Use it where your own program keeps VMEM busy across ours (e.g. a
  Pallas kernel's VMEM output, ``pltpu.VMEM(...)`` or ``out_specs`` in
  VMEM, read after ``allgather_matmul`` / ``matmul_reducescatter`` /
  ``mlp_block``) and XLA refuses the program for VMEM
  (``RESOURCE_EXHAUSTED`` ... ``vmem``). Results are the same; only where
  the peers' chunks land moves (HBM slots cost time, see the design note).

  Args:
    setting: a :class:`FusedVmem`; or give ``recv_max_bytes`` instead.
    recv_max_bytes: see :class:`FusedVmem`; ``0`` for every buffer in HBM.

  Returns:
    A context manager, in effect for programs traced and lowered in it.

  Example:

    >>> from asyncops.collective_matmul import fused_vmem
    >>> with fused_vmem(recv_max_bytes=0):
    ...   pass  # jax.jit(f).lower(...).compile(), or a call
  """
  if setting is None:
    setting = FusedVmem(recv_max_bytes)
  elif not isinstance(setting, FusedVmem) or recv_max_bytes is not None:
    raise TypeError(
      "fused_vmem: pass a FusedVmem or recv_max_bytes=..., not both, got "
      f"{setting!r} and recv_max_bytes={recv_max_bytes!r}."
    )
  return _CONTEXT(setting)


def current() -> FusedVmem:
  """The setting in effect (:data:`DEFAULT` outside :func:`fused_vmem`)."""
  return _CONTEXT.value


def recv_allowed(nbytes: int) -> bool:
  """Whether a receive buffer of ``nbytes`` may sit in VMEM (the planner's
  own limits checked apart): the hook ``_fused`` asks."""
  cap = current().recv_max_bytes
  return cap is None or nbytes <= cap
