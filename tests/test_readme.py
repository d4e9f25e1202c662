"""The README's code, run as a user pastes it (fresh processes).

Every ```python block runs in its own interpreter, in a temporary
directory, with none of the test session's JAX set-up (no XLA_FLAGS, no
device count): the README must set up its 8 CPU devices itself. A block
whose first line is ``# name.py`` is a file the user writes: ``test_*.py``
files run under pytest (with the installed plugin), others are imported
by the commands of the ```sh blocks, of which the ``python -m
asyncops.inspect`` ones run; every other ``python -m`` command there must
at least answer ``--help``.
"""

import functools
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def _blocks(lang: str) -> list[str]:
  return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), re.S)


def _file_name(code: str) -> str | None:
  m = re.match(r"# (\w+\.py)\n", code)
  return m.group(1) if m else None


def _env() -> dict:
  env = {
    k: v
    for k, v in os.environ.items()
    if k not in ("XLA_FLAGS", "JAX_PLATFORMS", "JAX_NUM_CPU_DEVICES")
    and not k.startswith("PYTEST")
  }
  env["TF_CPP_MIN_LOG_LEVEL"] = "3"
  return env


def _run(cmd, cwd, shell=False):
  r = subprocess.run(
    cmd,
    cwd=cwd,
    env=_env(),
    capture_output=True,
    text=True,
    timeout=900,
    shell=shell,
  )
  return r


SCRIPTS = [c for c in _blocks("python") if _file_name(c) is None]


@functools.cache
def _files(tmp: str) -> str:
  for code in _blocks("python"):
    name = _file_name(code)
    if name:
      (pathlib.Path(tmp) / name).write_text(code)
  return tmp


@pytest.mark.parametrize("i", range(len(SCRIPTS)))
def test_python_block_runs_as_pasted(i, tmp_path):
  script = tmp_path / "pasted.py"
  script.write_text(SCRIPTS[i])
  r = _run([sys.executable, str(script)], tmp_path)
  assert r.returncode == 0, r.stdout + r.stderr


def test_first_block_sets_up_8_cpu_devices_itself():
  code = SCRIPTS[0]
  assert 'jax_num_cpu_devices", 8' in code
  assert code.index("jax_num_cpu_devices") < code.index("make_mesh")


def test_test_file_block_passes_under_pytest(tmp_path):
  _files(str(tmp_path))
  tests = [_file_name(c) for c in _blocks("python")]
  tests = [t for t in tests if t and t.startswith("test_")]
  assert tests, "the README shows a test file"
  r = _run(
    [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
    tmp_path,
  )
  assert r.returncode == 0, r.stdout + r.stderr
  assert re.search(r"\b4 passed\b", r.stdout), r.stdout


def _commands() -> list[str]:
  out = []
  for block in _blocks("sh"):
    for line in block.splitlines():
      line = line.split("  #")[0].strip()
      if line.startswith("python -m "):
        out.append(line)
  return out


def test_inspect_commands_run(tmp_path):
  _files(str(tmp_path))
  cmds = [c for c in _commands() if c.startswith("python -m asyncops.inspect")]
  assert len(cmds) >= 2
  for cmd in cmds:
    cmd = cmd.replace("python", shlex.quote(sys.executable), 1)
    r = _run(cmd, tmp_path, shell=True)
    assert r.returncode == 0, cmd + "\n" + r.stdout + r.stderr
  report = json.loads((tmp_path / "report.json").read_text())
  assert report["counts"]["inflight"] == 0
  (pair,) = [p for p in report["pairs"] if p["kind"] == "kernel"]
  assert pair["window"]["overlapped"]
  assert "mymodule.py:" in pair["start_source"]


@pytest.mark.parametrize(
  "cmd",
  [c for c in _commands() if not c.startswith("python -m asyncops.inspect")],
)
def test_other_commands_answer_help(cmd):
  module = cmd.split()[2]
  root = README.parent
  r = _run([sys.executable, "-m", module, "--help"], root)
  assert r.returncode == 0, r.stderr
  for flag in re.findall(r"(--[\w-]+)", cmd):
    assert flag in r.stdout, (cmd, flag)


def test_opens_with_the_two_setup_commands():
  """The first command block is `make demo` and `make test`, both of which
  create .venv/ when it is missing (the Makefile's stamp rule)."""
  first = _blocks("sh")[0]
  assert [ln.split()[:2] for ln in first.splitlines()] == [
    ["make", "demo"],
    ["make", "test"],
  ]
  makefile = (README.parent / "Makefile").read_text()
  for target in ("demo", "test"):
    assert re.search(rf"^{target}: \$\(STAMP\)", makefile, re.M), target
