"""Assertions on the compiled TPU HLO, for users' tests.

Both compile ``jitted`` for its arguments' shardings (abstract
``jax.ShapeDtypeStruct``s over a TPU mesh, e.g. from the
``asyncops_tpu_mesh`` fixture) with :func:`asyncops.inspect.analyze` and
raise ``AssertionError`` carrying the harness's report, which names the
copies, why XLA made them, and the user's source lines.
:func:`assert_copy_free` is the copy guard's check
(:func:`asyncops.inspect.check_report`, the one behind
``asyncops.inspect.assert_copy_free`` and ``asyncops.jit``) with its
``CopyHazardError`` turned into the ``AssertionError`` a test expects.

Example:

  >>> import jax, jax.numpy as jnp
  >>> from asyncops.inspect import tpu_mesh
  >>> from jax.sharding import NamedSharding, PartitionSpec as P
  >>> mesh = tpu_mesh("v5e:2x4", (8,), ("x",))
  >>> x = jax.ShapeDtypeStruct((64, 128), jnp.float32,
  ...                          sharding=NamedSharding(mesh, P("x")))
  >>> report = assert_copy_free(jax.jit(lambda x: x * 2), x)
  >>> report.inflight_copies
  []
"""

from __future__ import annotations

from typing import Any

from asyncops.inspect import Report, analyze, check_report, hazards
from asyncops.inspect._guard import CopyHazardError


def _report(jitted: Any, args: tuple) -> Report:
  if isinstance(jitted, Report):
    if args:
      raise TypeError("pass either a Report or (jitted, *args), not both")
    return jitted
  try:
    return analyze(jitted, *args)
  except CopyHazardError as e:
    # asyncops refused the program while tracing it: the same finding,
    # made before XLA ran.
    refused = e
  raise AssertionError(f"asyncops refused the program: {refused}")


def _fail(headline: str, findings: list[str], report: Report) -> None:
  lines = [headline, *(f"  {f}" for f in findings), "", report.summary()]
  raise AssertionError("\n".join(lines))


def copy_hazards(report: Report) -> list[str]:
  """What :func:`assert_copy_free` refuses in ``report``, one entry each.

  The copy guard's hazards (:func:`asyncops.inspect.hazards`: copies of a
  buffer in flight, defensive copies of a transfer's buffers, in-place
  writes inside a window, buffers that do not live until the done), then
  defensive copies of any other buffer (a test that asserts "copy free"
  means no copy insertion at all).
  """
  found = [str(h) for h in hazards(report)]
  found += [_other_defensive(c) for c in _other_defensives(report)]
  return found


def _other_defensives(report: Report) -> list:
  return [c for c in report.defensive_copies if not c.pair]


def _other_defensive(c) -> str:
  where = f" from {c.source}" if c.source else ""
  return (
    f"defensive copy: %{c.name} of %{c.operand}{where} in %{c.computation} "
    "(copy insertion; no transfer's buffer)"
  )


def assert_copy_free(jitted: Any, *args: Any) -> Report:
  """Asserts the compiled program has no defensive or in-flight copy.

  Runs the copy guard (:func:`asyncops.inspect.check_report`) and also
  refuses defensive copies of buffers no transfer uses.

  Args:
    jitted: a ``jax.jit`` function (or its ``Traced``/``Lowered`` stage),
      or a :class:`~asyncops.inspect.Report` already made (then no args).
    *args: its arguments, abstract (``jax.ShapeDtypeStruct``) with TPU
      shardings, as :func:`asyncops.inspect.analyze` takes them.

  Returns:
    The :class:`~asyncops.inspect.Report`, for further checks.

  Raises:
    AssertionError: the guard's message (each copy, the transfer it
      breaks, the user's source line), then the report.
  """
  report = _report(jitted, args)
  try:
    check_report(report, getattr(jitted, "__name__", ""))
  except CopyHazardError as e:
    raise AssertionError(f"{e}\n\n{report.summary()}") from None
  other = _other_defensives(report)
  if other:
    head = f"{len(other)} defensive copy(ies) in the compiled program:"
    _fail(head, [_other_defensive(c) for c in other], report)
  return report


def assert_overlapped(
  jitted: Any, *args: Any, min_pairs: int = 1, op: str | None = None
) -> Report:
  """Asserts every asyncops start/done pair has compute in its window.

  Args:
    jitted: a ``jax.jit`` function (or its ``Traced``/``Lowered`` stage),
      or a :class:`~asyncops.inspect.Report` already made (then no args).
    *args: abstract arguments with TPU shardings.
    min_pairs: at least this many kernel start/done pairs must exist.
    op: only pairs whose start label contains this (e.g.
      ``"asyncops.ppermute_start"``); None for all.

  Returns:
    The :class:`~asyncops.inspect.Report`.

  Raises:
    AssertionError: too few pairs, or pairs with nothing between start
      and done (the report shows each window).
  """
  report = _report(jitted, args)
  try:
    report.assert_overlapped(min_pairs=min_pairs, op=op)
    lines = []
  except AssertionError as e:
    lines = str(e).splitlines()
  if lines:
    _fail(lines[0], lines[1:], report)
  return report
