"""The pytest plugin, used as a project outside this repo would use it.

The user's test file runs in a fresh pytest process in a temporary
directory, with only the installed ``asyncops`` (the plugin comes through
the ``pytest11`` entry point, no conftest), so JAX starts after the plugin
set the CPU device count.
"""

import textwrap

import pytest

import asyncops
from asyncops.testing import assert_copy_free, assert_overlapped, cpu_mesh

USER_TESTS = textwrap.dedent(
  """
  import jax, jax.numpy as jnp, pytest
  from jax.sharding import NamedSharding, PartitionSpec as P
  import asyncops
  from asyncops.testing import assert_copy_free, assert_overlapped


  def test_default_mesh(asyncops_mesh):
    assert dict(asyncops_mesh.shape) == {"x": 8}
    assert jax.device_count() == 8


  @pytest.mark.asyncops_mesh((2, 4), ("x", "y"))
  def test_marker_mesh(asyncops_mesh):
    assert dict(asyncops_mesh.shape) == {"x": 2, "y": 4}


  @pytest.mark.parametrize(
    "asyncops_mesh", [((4, 2), ("a", "b"))], indirect=True
  )
  def test_indirect_mesh(asyncops_mesh):
    assert dict(asyncops_mesh.shape) == {"a": 4, "b": 2}


  def _program(mesh, body):
    f = jax.jit(
      jax.shard_map(
        body, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x")
      )
    )
    x = jax.ShapeDtypeStruct(
      (8 * 512, 512), jnp.float32, sharding=NamedSharding(mesh, P("x"))
    )
    w = jax.ShapeDtypeStruct(
      (512, 512), jnp.float32, sharding=NamedSharding(mesh, P())
    )
    return f, x, w


  def overlapped(x, w):
    x, fut = asyncops.ppermute_start(x, "x", shift=1)
    z, fut = asyncops.scheduling.overlap(fut, jnp.dot, x, w)
    return asyncops.ppermute_done(fut) + z


  def lax_ring(x, w):  # jax.lax.fori_loop at unroll=1 copies every trip
    def body(i, x):
      x, fut = asyncops.ppermute_start(x, "x", shift=1)
      return asyncops.ppermute_done(fut)

    return jax.lax.fori_loop(0, 4, body, x)


  def nothing_between(x, w):
    x, fut = asyncops.ppermute_start(x, "x", shift=1)
    return asyncops.ppermute_done(fut)


  def test_clean(asyncops_tpu_mesh):
    mesh = asyncops_tpu_mesh("v5e:2x4")
    assert dict(mesh.shape) == {"x": 8}
    assert_copy_free(*_program(mesh, overlapped))
    assert_overlapped(*_program(mesh, overlapped))


  def test_copy_named(asyncops_tpu_mesh):
    assert_copy_free(*_program(asyncops_tpu_mesh("v5e:2x4"), lax_ring))


  def test_empty_window(asyncops_tpu_mesh):
    mesh = asyncops_tpu_mesh("v6e:2x4", (2, 4), ("x", "y"))
    assert_overlapped(*_program(mesh, nothing_between))


  def test_unknown_topology(asyncops_tpu_mesh):
    asyncops_tpu_mesh("v9z:1x1")
  """
)


def test_plugin_is_registered_by_entry_point(pytestconfig):
  assert pytestconfig.pluginmanager.get_plugin("asyncops") is asyncops.testing


def test_user_project(pytester):
  pytester.makepyfile(test_user=USER_TESTS)
  result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rf")
  result.assert_outcomes(passed=4, failed=3)
  out = result.stdout.str()
  # The copy assertion names the copy, XLA's reason and the user's lines.
  assert "FAILED test_user.py::test_copy_named" in out
  # (the copy guard's own message: asyncops.inspect.check_report)
  assert "endangers a transfer" in out or "asyncops refused" in out
  assert "copy: %" in out and "breaks the transfer" in out
  assert "test_user.py:" in out
  # The overlap assertion shows the empty window.
  assert "no compute between start and done" in out
  assert "window: " in out
  # A bad topology is one clear failure, not a traceback from libtpu.
  assert "asyncops_tpu_mesh('v9z:1x1'): no such TPU topology" in out
  assert "During handling" not in out


def test_assertions_in_process():
  # Our own fixtures' devices (8, set by the plugin for this session).
  mesh = cpu_mesh((2, 4), ("x", "y"))
  assert mesh.devices.size == 8
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from asyncops.inspect import tpu_mesh

  tmesh = tpu_mesh("v5e:2x4", (8,), ("x",))
  x = jax.ShapeDtypeStruct(
    (64, 128), jnp.float32, sharding=NamedSharding(tmesh, P("x"))
  )
  r = assert_copy_free(jax.jit(lambda x: x * 2), x)
  assert assert_copy_free(r) is r  # a Report is accepted as it is
  with pytest.raises(AssertionError, match="expected >= 1 start/done pairs"):
    assert_overlapped(r)
  with pytest.raises(TypeError, match="either a Report"):
    assert_copy_free(r, x)


def test_mesh_errors_name_the_fix():
  with pytest.raises(ValueError, match="needs 16 CPU devices, JAX has 8"):
    cpu_mesh((4, 4), ("x", "y"))
  with pytest.raises(ValueError, match="differ in length"):
    cpu_mesh((8,), ("x", "y"))
