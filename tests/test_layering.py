"""The package's layers point one way (the developers' guide):

  collective_matmul, compare -> scheduling, stateful -> futures -> kernels
  -> inspect, _jax_compat

A module may import from its own part of the package and from any lower
layer; parts that share a layer stay independent of each other. The top
(the package ``__init__``, ``asyncops.jit``, the command-line helpers,
``__main__`` modules and the pytest plugin) may import anything. Nothing in
the package imports ``benchmarks``, ``examples`` or ``tests``. Every import
counts, also one inside a function: it is an arrow all the same.

Parsed with ``ast``, nothing is imported.
"""

import ast
import pathlib
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "asyncops"
TOP = 5
LAYERS = {
  "_jax_compat": 0,
  "inspect": 0,
  "kernels": 1,
  "futures": 2,
  "scheduling": 3,
  "stateful": 3,
  "collective_matmul": 4,
  "compare": 4,
  "__init__": TOP,
  "_jit": TOP,
  "_cli": TOP,
  "testing": TOP,
}
OUTSIDE = ("benchmarks", "examples", "tests")


def _module(path: pathlib.Path) -> str:
  parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _exists(module: str) -> bool:
  rel = pathlib.Path(*module.split("."))
  base = PACKAGE.parent
  return (base / rel).with_suffix(".py").exists() or (base / rel).is_dir()


def _imports(path: pathlib.Path):
  """``(line, imported module)`` of every import in ``path``."""
  module = _module(path)
  package = module if path.name == "__init__.py" else module.rpartition(".")[0]
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      for a in node.names:
        yield node.lineno, a.name
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        up = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(up + ([node.module] if node.module else []))
      for a in node.names:
        sub = f"{base}.{a.name}"
        yield node.lineno, sub if _exists(sub) else base


def _part(module: str) -> str:
  parts = module.split(".")
  return "__init__" if len(parts) == 1 else parts[1]


def _rank(module: str) -> int:
  if module.split(".")[-1] == "__main__":
    return TOP
  return LAYERS[_part(module)]


FILES = sorted(PACKAGE.rglob("*.py"))


def test_every_part_of_the_package_has_a_layer():
  parts = {_part(_module(p)) for p in FILES}
  missing = parts - set(LAYERS)
  assert not missing, f"give {sorted(missing)} a layer in LAYERS"


def test_imports_point_down():
  wrong = []
  for path in FILES:
    me = _module(path)
    for line, target in _imports(path):
      where = f"{path.relative_to(PACKAGE.parent)}:{line}"
      if target.split(".")[0] in OUTSIDE:
        wrong.append(f"{where}: {me} imports {target}")
      if not target.startswith("asyncops") or _part(target) == _part(me):
        continue
      mine, theirs = _rank(me), _rank(target)
      if mine < theirs or (mine == theirs and mine != TOP):
        wrong.append(f"{where}: {me} imports {target} (a higher layer)")
  assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(
  "source,target",
  [
    ("from asyncops.futures._spec import OpSpec", "asyncops.futures._spec"),
    ("from asyncops import futures", "asyncops.futures"),
    ("import asyncops", "asyncops"),
  ],
)
def test_the_parser_sees_arrows(tmp_path, monkeypatch, source, target):
  """The check can fail: a kernel module that imports upwards is found."""
  fake = tmp_path / "asyncops" / "kernels" / "_fake.py"
  fake.parent.mkdir(parents=True)
  fake.write_text(f"def f():\n  {source}\n")
  (tmp_path / "asyncops" / "futures").mkdir()
  (tmp_path / "asyncops" / "futures" / "_spec.py").write_text("")
  monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path / "asyncops")
  ((line, got),) = list(_imports(fake))
  assert (line, got) == (2, target)
  assert _rank(got) > _rank(_module(fake))
