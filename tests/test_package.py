"""The installed package: metadata, layout, API reference, version shims."""

import ast
import importlib.metadata as md
import pathlib
import subprocess
import sys

import pytest

import asyncops

ROOT = pathlib.Path(__file__).resolve().parent.parent
PKG = ROOT / "asyncops"


def test_version_from_metadata():
  assert asyncops.__version__ == md.version("asyncops")
  assert asyncops.__version__[0].isdigit()


def test_metadata():
  meta = md.metadata("asyncops")
  assert meta["License-Expression"] == "Apache-2.0"
  assert "Typing :: Typed" in meta.get_all("Classifier")
  assert "Framework :: Pytest" in meta.get_all("Classifier")
  reqs = md.requires("asyncops")
  jax_req = [r for r in reqs if r.startswith("jax") and "extra" not in r]
  # A range, never a pin: installing asyncops keeps a supported jax.
  assert jax_req == ["jax<0.11,>=0.9.0"], jax_req
  assert any('extra == "tpu"' in r and r.startswith("jax[tpu]") for r in reqs)
  assert not any(r.startswith("libtpu") and "extra" not in r for r in reqs)
  eps = md.entry_points(group="pytest11")
  assert [e.value for e in eps if e.name == "asyncops"] == ["asyncops.testing"]


def test_files_shipped():
  assert (PKG / "py.typed").exists()
  text = (ROOT / "LICENSE").read_text()
  assert "Apache License" in text and "Version 2.0" in text


def test_benchmarks_are_repo_only():
  # The wheel packages asyncops* only; benchmarks/ is a repo tool.
  toml = (ROOT / "pyproject.toml").read_text()
  assert 'include = ["asyncops*"]' in toml
  assert "repo-only" in (ROOT / "benchmarks" / "__init__.py").read_text()


@pytest.mark.parametrize(
  "name",
  [
    "futures",
    "scheduling",
    "stateful",
    "inspect",
    "collective_matmul",
    "compare",
    "kernels",
  ],
)
def test_subpackages_are_attributes(name):
  code = f"import asyncops; print(asyncops.{name}.__name__)"
  r = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
  )
  assert r.returncode == 0, r.stderr
  assert r.stdout.strip() == f"asyncops.{name}"


def test_testing_is_loaded_on_demand():
  assert asyncops.testing.assert_copy_free is not None
  with pytest.raises(AttributeError, match="no attribute 'nope'"):
    asyncops.nope  # noqa: B018


# Version shims ---------------------------------------------------------------

# Names jax 0.11 removes from jax.experimental.pallas.tpu (moved to pallas
# in 0.10.0): using them anywhere would break on 0.11.
REMOVED_IN_0_11 = {
  "semaphore",
  "semaphore_signal",
  "semaphore_wait",
  "semaphore_read",
  "DeviceIdType",
  "ANY",
}


def _sources():
  for d in ("asyncops", "tests", "benchmarks", "examples"):
    yield from (ROOT / d).rglob("*.py")


def test_no_pallas_tpu_names_removed_in_0_11():
  bad = []
  for f in _sources():
    for node in ast.walk(ast.parse(f.read_text())):
      if (
        isinstance(node, ast.Attribute)
        and node.attr in REMOVED_IN_0_11
        and isinstance(node.value, ast.Name)
        and node.value.id == "pltpu"
      ):
        bad.append(f"{f.relative_to(ROOT)}:{node.lineno} pltpu.{node.attr}")
  assert not bad, bad


def test_jax_src_only_in_jax_compat():
  bad = []
  for f in (ROOT / "asyncops").rglob("*.py"):
    if f.name == "_jax_compat.py":
      continue
    for node in ast.walk(ast.parse(f.read_text())):
      if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
        "jax._src"
      ):
        bad.append(f"{f.relative_to(ROOT)}:{node.lineno}")
      if isinstance(node, ast.Import) and any(
        a.name.startswith("jax._src") for a in node.names
      ):
        bad.append(f"{f.relative_to(ROOT)}:{node.lineno}")
  assert not bad, bad


def test_version_shims():
  import jax

  from asyncops import _jax_compat as jc

  assert jc.JAX_VERSION[:2] in ((0, 9), (0, 10))
  x = jax.ShapeDtypeStruct((4, 8), jax.numpy.float32)
  s = jc.shape_like(x, shape=(2, 8))
  assert (s.shape, s.dtype) == ((2, 8), jax.numpy.float32)
  assert jc.shape_like(x).shape == (4, 8)
  assert jc.tpu_compiler_params(collective_id=3).collective_id == 3
  assert jc.tpu_compiler_params().collective_id is None


def test_api_reference_builds(tmp_path):
  r = subprocess.run(
    [sys.executable, "-m", "pdoc", "-o", str(tmp_path), "asyncops"],
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert r.returncode == 0, r.stderr[-2000:]
  page = (tmp_path / "asyncops.html").read_text()
  assert "ppermute_start" in page
  assert (tmp_path / "asyncops" / "testing.html").exists()
  assert (tmp_path / "asyncops" / "inspect.html").exists()
