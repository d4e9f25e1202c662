"""``asyncops.jit``: ``jax.jit`` that refuses programs endangering a transfer.

Every time the program is compiled for TPU (the first call on a TPU with
new argument types, or ahead of time through ``.lower(...).compile()`` /
``.trace(...).lower().compile()``, e.g. for a topology from a CPU host),
the compiled HLO text is read by the copy guard
(:func:`asyncops.inspect.check_hlo`): a copy of a buffer in flight, a
defensive copy of a transfer's buffer, a write into one inside its window,
or a source XLA may free early raises :class:`CopyHazardError` before
anything runs. Programs compiled for other platforms (the CPU emulation)
are not checked: they have no DMA to endanger.

A TPU compile XLA refuses for VMEM (``RESOURCE_EXHAUSTED`` naming
``vmem``, or "Too many buffers are colored in the alternate memory"; e.g.
a user's Pallas kernel holding a large VMEM output across the fused
collective matmuls, whose receive buffers sit in VMEM) is lowered and
compiled once more with those receive buffers in HBM
(:func:`asyncops.collective_matmul.fused_vmem` with ``recv_max_bytes=0``,
the results are the same), with one
:class:`asyncops.collective_matmul.FusedVmemWarning`; where that
changes nothing in the program, or fails too, the first error is raised.
A program the copy guard refuses gets the same second lowering, and runs
in that form if the guard passes it: XLA may move a transfer's buffer to
make room beside receive buffers in VMEM; otherwise the refusal stands.
(The case that made this retry, v6e's fused all-gather ``x`` evicted to
HBM beside a user's 64 MiB VMEM buffer, "source not live", no longer
occurs: its kernels take ``x`` pinned to HBM since branch h-agpin.)

Cost: the check parses the HLO text the compile already produced and walks
it once; it adds no compile. ``Jitted.last_check_seconds`` holds the time
of the last check (``benchmarks/`` and ``design/scheduling.md`` quote it).
"""

import functools
import re
import time
import warnings
from collections.abc import Callable
from typing import Any, Literal

import jax
import numpy as np

from asyncops.collective_matmul import _vmem
from asyncops.inspect import _guard

Check = Literal["raise", "warn", "off"]
_CHECKS = ("raise", "warn", "off")


def _vmem_refused(e: Exception) -> bool:
  """Whether ``e`` is XLA refusing a program for VMEM (a scoped VMEM out
  of memory, or too many buffers colored in the alternate memory)."""
  msg = str(e)
  if "colored in the alternate memory" in msg:  # FAILED_PRECONDITION
    return True
  return "RESOURCE_EXHAUSTED" in msg and "vmem" in msg.lower()


def _first_line(e: Exception) -> str:
  """``e``'s first line (120 characters), with XLA's scoped VMEM sizes."""
  msg = str(e)
  first = msg.strip().splitlines()[0][:120] if msg.strip() else repr(e)
  why = re.search(r"Scoped allocation with size \S+ and limit \S+", msg)
  return first + (f" {why[0]}" if why else "")


# :class:`asyncops.inspect.Hazard` kinds, as the guard's message names them.
_KINDS = (
  "in-flight copy",
  "defensive copy",
  "semaphore copy",
  "in-place write",
  "source not live",
  "destination not live",
  "start with no done",
)


def _kinds(e: Exception) -> str:
  """The hazard kinds a :class:`CopyHazardError` names, or its first line."""
  found = [k for k in _KINDS if k in str(e)]
  return ", ".join(found) if found else _first_line(e)


def _static_positions(kwargs: dict[str, Any]) -> tuple[set[int], set[str]]:
  nums = kwargs.get("static_argnums", ())
  names = kwargs.get("static_argnames", ())
  nums = {nums} if isinstance(nums, int) else set(nums or ())
  names = {names} if isinstance(names, str) else set(names or ())
  return nums, names


def _leaf_key(x: Any) -> Any:
  if isinstance(x, jax.Array):
    return ("a", x.shape, x.dtype, x.sharding, x.weak_type)
  if isinstance(x, np.ndarray | np.generic):
    return ("n", x.shape, x.dtype)
  if isinstance(x, bool | int | float | complex):
    return ("s", type(x))
  return ("o", x)


def _tree_key(tree: Any) -> Any:
  leaves, treedef = jax.tree.flatten(tree)
  return (treedef, tuple(_leaf_key(x) for x in leaves))


def _targets_tpu(args: Any, jit_kwargs: dict[str, Any]) -> bool:
  """Whether a call with ``args`` runs on TPU (committed inputs decide)."""
  for x in jax.tree.leaves(args):
    if isinstance(x, jax.Array) and x.committed:
      return any(d.platform == "tpu" for d in x.sharding.device_set)
  device = jit_kwargs.get("device")
  if device is not None:
    return device.platform == "tpu"
  backend = jit_kwargs.get("backend")
  return (backend or jax.default_backend()) == "tpu"


class Jitted:
  """A ``jax.jit`` function whose TPU compiles pass the copy guard.

  Calls, ``trace``, ``lower`` and attribute access behave as on the
  wrapped ``jax.jit`` object; ``lower(...).compile()`` and
  ``trace(...).lower().compile()`` run the check.

  Attributes:
    check: ``"raise"``, ``"warn"`` or ``"off"``.
    last_check_seconds: time the last check took (parse and analysis of
      the compiled HLO text), or None before the first TPU compile.
    last_report: the harness report of the last checked program.
  """

  def __init__(self, fun: Callable[..., Any], check: Check, kwargs):
    self.__wrapped_jit__ = jax.jit(fun, **kwargs)
    self.check = check
    self.last_check_seconds: float | None = None
    self.last_report = None
    self._jit_kwargs = kwargs
    self._static = _static_positions(kwargs)
    self._executables: dict[Any, Any] = {}
    functools.update_wrapper(self, fun)

  # The check --------------------------------------------------------------

  def _hazard(self, compiled: Any) -> _guard.CopyHazardError | None:
    """The copy guard's refusal of ``compiled``, or None (also None off
    TPU and with ``check="off"``)."""
    if self.check == "off" or _guard._platform(compiled) != "tpu":
      return None
    t0 = time.perf_counter()
    try:
      self.last_report = _guard.check_hlo(
        compiled.as_text(), f"asyncops.jit({self.__name__})"
      )
    except _guard.CopyHazardError as e:
      return e
    finally:
      self.last_check_seconds = time.perf_counter() - t0
    return None

  def _refuse(self, error: _guard.CopyHazardError) -> None:
    if self.check == "raise":
      raise error
    warnings.warn(str(error), _guard.CopyHazardWarning, stacklevel=4)

  def _key(self, args, kwargs) -> Any:
    nums, names = self._static
    n = len(args)
    parts = tuple(
      ("static", a) if (i in nums or i - n in nums) else _tree_key(a)
      for i, a in enumerate(args)
    ) + tuple(
      (k, ("static", v) if k in names else _tree_key(v))
      for k, v in sorted(kwargs.items())
    )
    try:
      hash(parts)
    except TypeError:
      return None
    return parts

  def compile_checked(self, *args: Any, **kwargs: Any) -> Any:
    """The checked executable a TPU call with these arguments runs.

    What a first call on a TPU does before running: compile once (cached
    per argument types, shardings and static values), check, return the
    ``jax.stages.Compiled``. Arguments may be ``jax.ShapeDtypeStruct``.
    """
    key = self._key(args, kwargs)
    compiled = self._executables.get(key) if key is not None else None
    if compiled is None:
      compiled = self.lower(*args, **kwargs).compile()
      if key is not None:
        self._executables[key] = compiled
    return compiled

  # jax.jit's surface ------------------------------------------------------

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    if self.check == "off" or not _targets_tpu(
      (args, kwargs), self._jit_kwargs
    ):
      return self.__wrapped_jit__(*args, **kwargs)
    nums, names = self._static
    n = len(args)
    dyn_args = [
      a for i, a in enumerate(args) if i not in nums and i - n not in nums
    ]
    dyn_kwargs = {k: v for k, v in kwargs.items() if k not in names}
    return self.compile_checked(*args, **kwargs)(*dyn_args, **dyn_kwargs)

  def trace(self, *args: Any, **kwargs: Any) -> "_Traced":
    return _Traced(self.__wrapped_jit__.trace(*args, **kwargs), self)

  def lower(self, *args: Any, **kwargs: Any) -> "_Lowered":
    return _Lowered(
      self.__wrapped_jit__.lower(*args, **kwargs),
      self,
      lambda: self.__wrapped_jit__.lower(*args, **kwargs),
    )

  def __getattr__(self, name: str) -> Any:
    return getattr(self.__wrapped_jit__, name)

  def __repr__(self) -> str:
    return f"asyncops.jit({self.__name__}, check={self.check!r})"


class _Lowered:
  """``jax.stages.Lowered`` whose ``compile()`` runs the copy guard and
  retries a program XLA refuses for VMEM with the fused collective
  matmuls' receive buffers in HBM (``relower``: the same lowering, redone
  inside ``fused_vmem(recv_max_bytes=0)``)."""

  def __init__(self, lowered: Any, owner: Jitted, relower: Callable[[], Any]):
    self._lowered = lowered
    self._owner = owner
    self._relower = relower

  def compile(self, *args: Any, **kwargs: Any) -> Any:
    owner = self._owner
    try:
      compiled = self._lowered.compile(*args, **kwargs)
    except Exception as e:
      if not _vmem_refused(e):
        raise
      retry = self._recv_in_hbm(args, kwargs)
      if retry is None:
        raise e from None
      self._warn(f"XLA refused the program for VMEM ({_first_line(e)})")
      self._lowered, compiled = retry
      hazard = owner._hazard(compiled)
      if hazard is not None:
        owner._refuse(hazard)
      return compiled
    hazard = owner._hazard(compiled)
    if hazard is None:
      return compiled
    # XLA may move a buffer of ours out of its place to make room beside
    # receive buffers in VMEM (the fused all-gather's ``x`` evicted to
    # HBM beside a user's 64 MiB VMEM buffer, v6e: "source not live",
    # until its kernels pinned ``x`` to HBM, branch h-agpin): the program
    # with them in HBM, if the guard passes it, is as good.
    retry = self._recv_in_hbm(args, kwargs)
    if retry is not None and owner._hazard(retry[1]) is None:
      self._warn(
        "the copy guard refused the program with the fused collective "
        f"matmuls' receive buffers in VMEM ({_kinds(hazard)})"
      )
      self._lowered, compiled = retry
      return compiled
    owner._refuse(hazard)
    return compiled

  def _recv_in_hbm(self, args, kwargs) -> tuple[Any, Any] | None:
    """``(lowered, compiled)``: the program lowered again with every
    receive buffer in HBM; None where that is the same program (nothing
    of ours in VMEM) or XLA refuses it too."""
    with _vmem.fused_vmem(recv_max_bytes=0):
      lowered = self._relower()
    if lowered.as_text() == self._lowered.as_text():
      return None
    try:
      return lowered, lowered.compile(*args, **kwargs)
    except Exception:
      return None

  def _warn(self, why: str) -> None:
    warnings.warn(
      f"asyncops.jit({self._owner.__name__}): {why}; compiled it with the "
      "fused collective matmuls' receive buffers in HBM instead (same "
      "results, slower where they were in VMEM). To choose this up front "
      "and skip the failed compile, call or lower inside "
      "asyncops.collective_matmul.fused_vmem(recv_max_bytes=0), or give "
      "your own kernels less VMEM.",
      _vmem.FusedVmemWarning,
      stacklevel=4,
    )

  def __getattr__(self, name: str) -> Any:
    return getattr(self._lowered, name)


class _Traced:
  """``jax.stages.Traced`` whose ``lower()`` keeps the copy guard."""

  def __init__(self, traced: Any, owner: Jitted):
    self._traced = traced
    self._owner = owner

  def lower(self, *args: Any, **kwargs: Any) -> _Lowered:
    return _Lowered(
      self._traced.lower(*args, **kwargs),
      self._owner,
      lambda: self._traced.lower(*args, **kwargs),
    )

  def __getattr__(self, name: str) -> Any:
    return getattr(self._traced, name)


def jit(
  fun: Callable[..., Any] | None = None,
  *,
  check: Check = "raise",
  **jit_kwargs: Any,
) -> Any:
  """``jax.jit`` that checks every TPU compile with the copy guard.

  A drop-in for ``jax.jit`` (same keyword arguments). When the program is
  compiled for TPU, at its first call on a TPU or ahead of time through
  ``.lower(...).compile()``, the compiled HLO is checked: **a copy of a
  buffer in flight, a defensive copy of a transfer's buffer, a write into
  one inside its window, or a source XLA may free early is refused before
  anything runs**, with the user's source line of the start. A TPU
  compile XLA refuses for VMEM is retried once with the fused collective
  matmuls' receive buffers in HBM
  (``asyncops.collective_matmul.fused_vmem(recv_max_bytes=0)``: same
  results), with a ``FusedVmemWarning``; plain ``jax.jit`` raises XLA's
  error (``RESOURCE_EXHAUSTED: ... vmem``) and the fix is that context.
  So is a program the guard refuses, where the receive buffers in HBM
  make it pass (XLA evicting a transfer's source to make room in VMEM;
  the fused all-gather's ``x``, the one case seen, is pinned to HBM since
  branch h-agpin, so plain ``jax.jit`` gets a sound program there too).
  Plain ``jax.jit`` runs no guard: a program the guard would refuse runs
  unchecked there.

  Args:
    fun: the function; omit it to use ``jit(check=...)`` as a decorator.
    check: ``"raise"`` (default): raise :class:`CopyHazardError`;
      ``"warn"``: warn (:class:`CopyHazardWarning`) and run; ``"off"``:
      plain ``jax.jit``.
    **jit_kwargs: passed to ``jax.jit``.

  Returns:
    A :class:`Jitted` function.

  Raises:
    ValueError: ``check`` is not one of the three modes.

  Example:
    >>> import asyncops, jax.numpy as jnp
    >>> f = asyncops.jit(lambda x: x * 2)
    >>> f(jnp.ones(2)).tolist()
    [2.0, 2.0]
  """
  if check not in _CHECKS:
    raise ValueError(
      f"asyncops.jit: check={check!r}; use 'raise' (refuse a program that "
      "endangers a transfer), 'warn' (warn and run) or 'off'."
    )
  if fun is None:
    return functools.partial(jit, check=check, **jit_kwargs)
  if not callable(fun):
    raise TypeError(
      f"asyncops.jit: fun must be callable, got {type(fun).__name__}."
    )
  return Jitted(fun, check, jit_kwargs)
