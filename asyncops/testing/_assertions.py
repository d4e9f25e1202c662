"""Assertions on the compiled TPU HLO, for users' tests.

Both compile ``jitted`` for its arguments' shardings (abstract
``jax.ShapeDtypeStruct``s over a TPU mesh, e.g. from the
``asyncops_tpu_mesh`` fixture) with :func:`asyncops.inspect.analyze` and
raise ``AssertionError`` carrying the harness's report, which names the
copies, why XLA made them, and the user's source lines.

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

from asyncops.inspect import Report, analyze
from asyncops.inspect._json import copy_hazards


def _report(jitted: Any, args: tuple) -> Report:
  if isinstance(jitted, Report):
    if args:
      raise TypeError("pass either a Report or (jitted, *args), not both")
    return jitted
  from asyncops.scheduling import CopyHazardError

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


def assert_copy_free(jitted: Any, *args: Any) -> Report:
  """Asserts the compiled program has no defensive or in-flight copy.

  Args:
    jitted: a ``jax.jit`` function (or its ``Traced``/``Lowered`` stage),
      or a :class:`~asyncops.inspect.Report` already made (then no args).
    *args: its arguments, abstract (``jax.ShapeDtypeStruct``) with TPU
      shardings, as :func:`asyncops.inspect.analyze` takes them.

  Returns:
    The :class:`~asyncops.inspect.Report`, for further checks.

  Raises:
    AssertionError: listing each copy, its source line, and the report.
  """
  # One place to delegate to asyncops.inspect's own copy check once it
  # exists; the findings and the message stay the same.
  report = _report(jitted, args)
  found = copy_hazards(report)
  if found:
    head = f"{len(found)} copy hazard(s) in the compiled program:"
    _fail(head, found, report)
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
