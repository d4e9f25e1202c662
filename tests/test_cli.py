"""The command lines, called as a user calls them.

One convention (``asyncops._cli``): ``--help``, ``--json``, exit 0 clean /
1 finding / 2 usage error with one line on stderr and no traceback.
Subprocesses run the real ``python -m ...``; the argument checks run
in-process (each would otherwise start JAX again).
"""

import json
import pathlib

import pytest

from asyncops import _cli
from asyncops.compare import __main__ as compare_cli
from asyncops.inspect import __main__ as inspect_cli
from tests import util as u

ROOT = pathlib.Path(__file__).resolve().parent.parent


_run = u.run_python


@pytest.mark.parametrize(
  "module",
  [
    "asyncops.inspect",
    "asyncops.compare",
    "benchmarks.run",
    "benchmarks.cpu_walltime",
    "benchmarks.edge_copies",
    "examples/collective_matmul.py",
    "examples/demo.py",
    "examples/mlp_block.py",
    "examples/futures_layout.py",
  ],
)
def test_help(module):
  args = [module] if module.endswith(".py") else ["-m", module]
  r = _run(*args, "--help")
  assert r.returncode == 0, r.stderr
  assert "usage:" in r.stdout and "--json" in r.stdout


def _usage_error(main, argv, prog, capsys) -> str:
  assert _cli.run(main, argv, prog=prog) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1, err
  assert err.startswith(f"{prog}: error: ")
  assert "Traceback" not in err
  return err


@pytest.mark.parametrize(
  "target, words",
  [
    ("no_colon", "expected MODULE:FUNCTION"),
    ("no_such_module:f", "no module named 'no_such_module'"),
    ("tests.util:no_such_function", "has no function 'no_such_function'"),
    ("tests/nope.py:f", "no such file"),
    ("tests.util:SHAPE", "is not a function"),
    ("tests.util:compute", "tests.util:compute failed: TypeError"),
  ],
)
def test_inspect_usage_errors(target, words, capsys):
  err = _usage_error(inspect_cli.main, [target], inspect_cli.PROG, capsys)
  assert words in err


def test_inspect_bad_return(tmp_path, monkeypatch, capsys):
  (tmp_path / "bad.py").write_text("def program():\n  return 3\n")
  monkeypatch.chdir(tmp_path)
  err = _usage_error(
    inspect_cli.main, ["bad.py:program"], inspect_cli.PROG, capsys
  )
  assert "must return (jitted, args)" in err


def test_inspect_bad_topology(capsys):
  err = _usage_error(
    inspect_cli.main,
    ["tests.util:pattern_staggered_unroll2", "--topology", "v9:2x2"],
    inspect_cli.PROG,
    capsys,
  )
  assert "--topology: cannot build TPU topology 'v9:2x2'" in err


def test_compare_usage_errors(capsys):
  err = _usage_error(
    compare_cli.main, ["--patterns", "nope"], compare_cli.PROG, capsys
  )
  assert "--patterns: unknown pattern 'nope'" in err
  err = _usage_error(
    compare_cli.main, ["--topology", "v5e:2x2"], compare_cli.PROG, capsys
  )
  assert "has 4 devices; the patterns need 8" in err


def test_edge_copies_usage_errors(capsys):
  from benchmarks import edge_copies

  prog = "python -m benchmarks.edge_copies"
  err = _usage_error(edge_copies.main, ["--xla-flag", "nope"], prog, capsys)
  assert "--xla-flag: expected NAME=VALUE, got 'nope'" in err
  err = _usage_error(edge_copies.main, ["--topology", "v9:1"], prog, capsys)
  assert "--topology: cannot build TPU topology 'v9:1'" in err


def test_inspect_json_hazard_exits_1():
  r = _run(
    "-m", "asyncops.inspect", "tests.util:pattern_staggered_unroll1", "--json"
  )
  assert r.returncode == 1, r.stderr
  d = json.loads(r.stdout)
  assert d["counts"]["inflight"] >= 1
  assert d["inflight_copies"] and d["findings"]
  c = d["inflight_copies"][0]
  assert c["inflight"] and c["kind"] and c["shape"]
  (pair, *_) = [p for p in d["pairs"] if p["kind"] == "kernel"]
  assert pair["window"]["ops"] is not None
  assert "overlapped" in pair["window"]
  # Source lines name the user's file (tests/util.py), not asyncops'.
  assert "util.py:" in pair["start_source"]
  files = {f["file"] for f in pair["start_stack"]}
  assert any(f.endswith("tests/util.py") for f in files)
  assert not any("/asyncops/" in f for f in files)


def test_inspect_clean_exits_0_and_writes_hlo(tmp_path):
  hlo = tmp_path / "p.hlo"
  r = _run(
    "-m",
    "asyncops.inspect",
    "tests.util:pattern_staggered_unroll2",
    "--hlo",
    str(hlo),
    env={"ASYNCOPS_PROGRESS": "1"},
  )
  assert r.returncode == 0, r.stdout + r.stderr
  assert "0 finding(s)" in r.stdout
  assert "is_scheduled=true" in hlo.read_text()
  assert "inspect tests.util:pattern_staggered_unroll2" in r.stderr  # bar


def test_inspect_refused_program_exits_1(tmp_path):
  (tmp_path / "prog.py").write_text(
    "import jax, jax.numpy as jnp\n"
    "import asyncops\n"
    "from asyncops.inspect import tpu_mesh\n"
    "from jax.sharding import NamedSharding, PartitionSpec as P\n"
    "def f(x):\n"
    "  x, fut = asyncops.ppermute_start(x, 'x', shift=1)\n"
    "  asyncops.ppermute_done(fut)\n"
    "  return asyncops.ppermute_done(fut)  # awaited twice\n"
    "def program(topology):\n"
    "  mesh = tpu_mesh(topology, (8,), ('x',))\n"
    "  g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P('x'),"
    " out_specs=P('x')))\n"
    "  x = jax.ShapeDtypeStruct((64, 128), jnp.float32,"
    " sharding=NamedSharding(mesh, P('x')))\n"
    "  return g, (x,)\n"
  )
  r = _run("-m", "asyncops.inspect", "prog.py:program", cwd=tmp_path)
  assert r.returncode == 1, r.stdout + r.stderr
  assert "refused by asyncops: FutureError" in r.stderr
  assert "prog.py:6 in f" in r.stderr  # the user's line of the start
  assert "Traceback" not in r.stderr
