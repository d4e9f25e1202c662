"""asyncops' pytest plugin: meshes and copy/overlap assertions.

Installed with asyncops and registered through the ``pytest11`` entry
point, so a project's tests get it without a ``conftest.py``:

* the CPU backend gets 8 devices before JAX starts (ini option
  ``asyncops_cpu_devices``; ``0`` leaves the device count alone);
* fixture ``asyncops_mesh``: a mesh of 8 CPU devices with axis ``"x"``;
  other shapes with ``@pytest.mark.asyncops_mesh((2, 4), ("x", "y"))`` or
  ``@pytest.mark.parametrize("asyncops_mesh", [((2, 4), ("x", "y"))],
  indirect=True)``;
* fixture ``asyncops_tpu_mesh``: a factory, ``asyncops_tpu_mesh("v5e:2x4")``
  (optionally a shape and axis names), over the ahead-of-time devices of a
  TPU topology (needs ``asyncops[tpu]``; no TPU needed);
* :func:`assert_copy_free` and :func:`assert_overlapped`: compile for TPU
  and raise ``AssertionError`` with the harness's explanation.

Example test::

  import jax, jax.numpy as jnp
  import asyncops
  from asyncops.testing import assert_copy_free, assert_overlapped

  def test_ring(asyncops_tpu_mesh):
    mesh = asyncops_tpu_mesh("v5e:2x4")
    ...
    assert_copy_free(jitted, x)
    assert_overlapped(jitted, x)

Disable with ``pytest -p no:asyncops``.
"""

from asyncops.testing._assertions import (
  assert_copy_free as assert_copy_free,
)
from asyncops.testing._assertions import (
  assert_overlapped as assert_overlapped,
)
from asyncops.testing._assertions import copy_hazards as copy_hazards
from asyncops.testing._plugin import asyncops_mesh as asyncops_mesh
from asyncops.testing._plugin import asyncops_tpu_mesh as asyncops_tpu_mesh
from asyncops.testing._plugin import cpu_mesh as cpu_mesh
from asyncops.testing._plugin import pytest_addoption as pytest_addoption
from asyncops.testing._plugin import pytest_configure as pytest_configure
