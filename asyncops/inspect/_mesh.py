"""Ahead-of-time TPU meshes and compilation on a host without TPUs.

Example:

  >>> mesh = tpu_mesh("v5e:2x4", (2, 4), ("x", "y"))
  >>> mesh.devices.shape
  (2, 4)
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import topologies


@contextlib.contextmanager
def quiet_stderr():
  """Sends fd 2 to /dev/null (C++ logging included), then restores it."""
  try:
    saved = os.dup(2)
  except OSError:
    yield
    return
  devnull = os.open(os.devnull, os.O_WRONLY)
  try:
    os.dup2(devnull, 2)
    yield
  finally:
    os.dup2(saved, 2)
    os.close(saved)
    os.close(devnull)


@functools.cache
def tpu_topology(topology: str):
  """The (cached) AOT TPU topology description, e.g. for ``"v5e:2x4"``.

  libtpu's start-up warnings are kept off the terminal.

  Args:
    topology: a TPU topology name such as ``"v5e:2x4"`` or ``"v4:2x2x1"``.

  Returns:
    The ``TopologyDescription`` from ``jax.experimental.topologies``.
  """
  # Several processes (other test runs, the CLI) may compile concurrently on
  # one host; without this libtpu refuses to load a second time.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  with quiet_stderr():
    return topologies.get_topology_desc(topology, platform="tpu")


@functools.cache
def _mesh(
  topology: str, axis_shapes: tuple[int, ...], axis_names: tuple[str, ...]
) -> jax.sharding.Mesh:
  devices = np.array(tpu_topology(topology).devices)
  if devices.size != int(np.prod(axis_shapes)):
    raise ValueError(
      f"topology {topology} has {devices.size} devices; mesh shape "
      f"{axis_shapes} needs {int(np.prod(axis_shapes))}"
    )
  return jax.sharding.Mesh(devices.reshape(axis_shapes), axis_names)


def tpu_mesh(
  topology: str, axis_shapes: Sequence[int], axis_names: Sequence[str]
) -> jax.sharding.Mesh:
  """A mesh over the AOT TPU devices of ``topology`` (cached and quiet).

  Args:
    topology: e.g. ``"v5e:2x4"``, ``"v4:2x2x1"``, ``"v5p:2x2x1"``,
      ``"v6e:2x4"``.
    axis_shapes: mesh shape; its product must equal the device count.
    axis_names: one name per mesh axis.

  Returns:
    A ``jax.sharding.Mesh`` usable for ``jax.jit(...).trace(...)``.

  Raises:
    ValueError: if the shape does not match the topology's device count.

  Example:

    >>> tpu_mesh("v5e:2x4", (8,), ("i",)).shape["i"]
    8
  """
  if len(axis_shapes) != len(axis_names):
    raise ValueError("axis_shapes and axis_names differ in length")
  return _mesh(topology, tuple(axis_shapes), tuple(axis_names))


def compile_tpu(jitted: Any, *abstract_args: Any) -> tuple[Any, float]:
  """Compiles ``jitted`` for the abstract arguments' (TPU) shardings.

  Args:
    jitted: a ``jax.jit`` function, a ``Traced`` or a ``Lowered`` object.
    *abstract_args: ``jax.ShapeDtypeStruct`` (with TPU shardings) or
      arrays, as ``jitted.trace`` accepts them.

  Returns:
    ``(compiled, seconds)``: the ``jax.stages.Compiled`` and the time spent
    lowering and compiling.

  Example:

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = tpu_mesh("v5e:2x4", (8,), ("i",))
    >>> x = jax.ShapeDtypeStruct((8, 128), jnp.float32,
    ...                          sharding=NamedSharding(mesh, P("i")))
    >>> compiled, _ = compile_tpu(jax.jit(lambda x: x * 2), x)
    >>> "is_scheduled=true" in compiled.as_text()
    True
  """
  t0 = time.perf_counter()
  stage = jitted
  if hasattr(stage, "trace"):
    stage = stage.trace(*abstract_args)
  if not hasattr(stage, "compile"):
    stage = stage.lower()
  compiled = stage.compile()
  return compiled, time.perf_counter() - t0
