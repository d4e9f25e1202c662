"""Fixtures and hooks of the asyncops pytest plugin.

The CPU device count is a start-up setting of JAX: it is set in
``pytest_configure``, before any test module runs JAX code. If JAX started
earlier (a ``conftest.py`` that computed something at import), the
fixtures say so instead of handing out a smaller mesh.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pytest

DEFAULT_SHAPE = (8,)
DEFAULT_AXES = ("x",)
_INI = "asyncops_cpu_devices"


def pytest_addoption(parser: pytest.Parser) -> None:
  parser.addini(
    _INI,
    "CPU devices JAX gets before it starts (asyncops plugin; 0: untouched)",
    default="8",
  )


def pytest_configure(config: pytest.Config) -> None:
  config.addinivalue_line(
    "markers",
    "asyncops_mesh(shape, axes): the shape and axis names of the "
    "asyncops_mesh fixture's CPU mesh",
  )
  n = int(config.getini(_INI) or 0)
  if n > 0:
    _set_cpu_devices(n)


def _set_cpu_devices(n: int) -> None:
  import os

  import jax

  if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
    return  # the user chose a count
  if jax.config.jax_num_cpu_devices >= n:
    return
  try:
    jax.config.update("jax_num_cpu_devices", n)
  except RuntimeError:
    pass  # JAX already started: the fixtures report the count they find


def cpu_mesh(
  shape: Sequence[int] = DEFAULT_SHAPE, axes: Sequence[str] = DEFAULT_AXES
):
  """A ``jax.sharding.Mesh`` of CPU devices (axis types ``Auto``).

  Raises:
    ValueError: if shape and axes differ in length, or JAX has fewer CPU
      devices than the shape needs (with how to get more).
  """
  import jax

  shape, axes = tuple(shape), tuple(axes)
  if len(shape) != len(axes):
    raise ValueError(
      f"asyncops_mesh: shape {shape} and axes {axes} differ in length"
    )
  need = math.prod(shape)
  devices = jax.devices("cpu")
  if len(devices) < need:
    raise ValueError(
      f"asyncops_mesh: mesh shape {shape} needs {need} CPU devices, JAX "
      f"has {len(devices)}. JAX started before the asyncops plugin could "
      f"set the count (code at import time in a conftest?), or the ini "
      f"option {_INI} is lower: set it to {need}, or set "
      f"XLA_FLAGS=--xla_force_host_platform_device_count={need}"
    )
  return jax.make_mesh(
    shape,
    axes,
    axis_types=(jax.sharding.AxisType.Auto,) * len(axes),
    devices=devices[:need],
  )


def _requested(request: pytest.FixtureRequest) -> tuple[Any, Any]:
  param = getattr(request, "param", None)
  if param is not None:
    shape, axes = param
    return shape, axes
  marker = request.node.get_closest_marker("asyncops_mesh")
  if marker is not None:
    shape = marker.kwargs.get("shape", marker.args[0] if marker.args else None)
    axes = marker.kwargs.get(
      "axes", marker.args[1] if len(marker.args) > 1 else None
    )
    if shape is None:
      shape = DEFAULT_SHAPE
    if axes is None:
      axes = DEFAULT_AXES if len(shape) == 1 else None
    if axes is None:
      raise ValueError(
        f"asyncops_mesh marker: shape {tuple(shape)} needs axis names, "
        f"e.g. @pytest.mark.asyncops_mesh({tuple(shape)}, ('x', 'y'))"
      )
    return shape, axes
  return DEFAULT_SHAPE, DEFAULT_AXES


@pytest.fixture
def asyncops_mesh(request: pytest.FixtureRequest):
  """A CPU mesh: 8 devices, axis ``"x"`` unless asked otherwise.

  Ask for another shape with ``@pytest.mark.asyncops_mesh((2, 4),
  ("x", "y"))`` or indirect parametrization with ``(shape, axes)``.
  """
  shape, axes = _requested(request)
  return cpu_mesh(shape, axes)


@pytest.fixture
def asyncops_tpu_mesh():
  """A factory: ``asyncops_tpu_mesh(topology, shape=None, axes=("x",))``.

  Returns a mesh over the ahead-of-time devices of the TPU ``topology``
  (e.g. ``"v5e:2x4"``): by default one axis ``"x"`` over all of them. Use
  it with abstract arguments and :func:`asyncops.testing.assert_copy_free`
  or :func:`asyncops.inspect.analyze`; nothing runs on a TPU.
  """
  from asyncops.inspect import tpu_mesh, tpu_topology

  def make(
    topology: str,
    shape: Sequence[int] | None = None,
    axes: Sequence[str] | None = None,
  ):
    try:
      n, error = len(tpu_topology(topology).devices), None
    except Exception as e:  # libtpu missing, or it does not know the name
      n, error = 0, f"{type(e).__name__}: {str(e).strip()[:200]}"
    if error is not None:
      pytest.fail(
        f"asyncops_tpu_mesh({topology!r}): no such TPU topology or no TPU "
        f"runtime ({error}). The runtime comes with "
        "`pip install asyncops[tpu]`.",
        pytrace=False,
      )
    if shape is None:
      shape = (n,)
    if axes is None:
      axes = DEFAULT_AXES if len(shape) == 1 else None
    if axes is None:
      raise ValueError(
        f"asyncops_tpu_mesh: shape {tuple(shape)} needs axis names"
      )
    return tpu_mesh(topology, tuple(shape), tuple(axes))

  return make
