"""Every command line's usage errors, as a demanding user meets them.

The audit of branch h-cliaudit (design/README.md, "Command lines
audited"): a bad value (an unknown topology, a malformed shape, a zero or
negative count, an unwritable output path, two flags that contradict each
other) exits 2 with ONE line on stderr that names the argument, before any
compile and never with a traceback; ``--json`` writes a document that
parses; ``make`` alone lists the targets. The argument checks run
in-process (each subprocess would start JAX again); a few run the real
``python -m ...``.
"""

import json
import os
import pathlib
import subprocess

import pytest

from asyncops import _cli
from asyncops.inspect import __main__ as inspect_cli
from benchmarks import cpu_walltime, plan_twins, xla_configs, xla_ring
from benchmarks import run as bench_run
from tests import util as u

ROOT = pathlib.Path(__file__).resolve().parent.parent
MISSING = "/nonexistent/x.json"
SMALL = u.BENCH_SMALL
PLAN = ["--topology", "v5e:2x4", "--dims", "4,64,128,256"]


_run = u.run_python


def _one_line_exit_2(main, argv, prog, capsys) -> str:
  """Runs ``main(argv)`` as its ``__main__`` does; asserts exit 2 and one
  line on stderr without a traceback; returns the line."""
  try:
    code = _cli.run(main, argv, prog=prog)
  except SystemExit as e:  # argparse's own errors
    code = e.code
  err = capsys.readouterr().err.strip()
  assert code == 2, err
  assert len(err.splitlines()) == 1, err
  assert err.startswith(f"{prog}: error: "), err
  assert "Traceback" not in err
  return err


RUN = "python -m benchmarks.run"
PT = "python -m benchmarks.plan_twins"
XC = "python -m benchmarks.xla_configs"
XR = "python -m benchmarks.xla_ring"
CW = "python -m benchmarks.cpu_walltime"
INSPECT = inspect_cli.PROG
U2 = "tests.util:pattern_staggered_unroll2"


USAGE_ERRORS = [
  # argparse's errors: one line, not the 16-line usage first.
  (bench_run.main, RUN, ["--shape", "1,2"], "--shape: expected B,D,F"),
  (bench_run.main, RUN, ["--topology", "v9x:2x4"], "unknown TPU generation"),
  (inspect_cli.main, INSPECT, [], "required: target"),
  (plan_twins.main, PT, ["--dims", "1,2"], "--dims '1,2'"),
  # Counts: zero, negative, not a number.
  (bench_run.main, RUN, ["--tp", "0"], "--tp: expected a positive"),
  (bench_run.main, RUN, ["--tp", "-1"], "--tp: expected a positive"),
  (bench_run.main, RUN, ["--tp", "3"], "--tp: tp=3 does not divide the 8"),
  (
    bench_run.main,
    RUN,
    ["--sweep", "llama", "--sweep-m", "-5"],
    "--sweep-m: expected positive integers",
  ),
  (
    bench_run.main,
    RUN,
    ["--sweep", "llama", "--sweep-m", "abc"],
    "--sweep-m: expected positive integers",
  ),
  (
    bench_run.main,
    RUN,
    ["--sweep", "llama", "--sweep-tp", "0"],
    "--sweep-tp: expected positive integers",
  ),
  (
    bench_run.main,
    RUN,
    ["--sweep", "llama", "--sweep-tp", "3"],
    "--sweep-tp: tp=3 does not divide",
  ),
  (
    bench_run.main,
    RUN,
    ["--sweep", "llama", "--sweep-topologies", "v9x:2x4"],
    "--sweep-topologies: topology 'v9x:2x4'",
  ),
  # A generation the model knows, a layout libtpu does not build.
  (
    bench_run.main,
    RUN,
    ["--topology", "v5e:2x3"],
    "--topology: cannot build TPU topology 'v5e:2x3'",
  ),
  (
    plan_twins.main,
    PT,
    ["--topology", "v5e:2x3"],
    "--topology: cannot build TPU topology 'v5e:2x3'",
  ),
  # Flags another flag would silently override.
  (
    bench_run.main,
    RUN,
    ["--preset", "issue15", "--shape", "64,128,256"],
    "--preset issue15 sets --shape",
  ),
  (
    bench_run.main,
    RUN,
    ["--calibration", "--sweep", "llama"],
    "--calibration and --sweep",
  ),
  (
    bench_run.main,
    RUN,
    ["--sweep", "llama", "--topology", "v6e:2x4"],
    "--sweep llama ignores --topology",
  ),
  # An output path that cannot be written: before the run, not after it.
  (bench_run.main, RUN, ["--json", MISSING, *SMALL], "--json: directory"),
  (plan_twins.main, PT, ["--json", MISSING, *PLAN], "--json: directory"),
  (
    xla_configs.main,
    XC,
    ["--json", MISSING, "--topology", "v9x:2x4"],
    "--json: directory",
  ),
  (inspect_cli.main, INSPECT, [U2, "--hlo", MISSING], "--hlo: directory"),
  # xla_configs recorded an unknown topology as a finding and exited 0.
  (
    xla_configs.main,
    XC,
    ["--topology", "v9x:2x4"],
    "--topology: cannot build TPU topology 'v9x:2x4'",
  ),
  # xla_ring: every bad value was a traceback.
  (xla_ring.main, XR, ["--tp", "x"], "--tp: expected a positive integer"),
  (xla_ring.main, XR, ["--tp", "3"], "--tp: tp=3 does not divide"),
  (xla_ring.main, XR, ["--m", "x"], "--m: expected a positive integer"),
  (xla_ring.main, XR, ["--m", "-4"], "--m: expected a positive integer"),
  (xla_ring.main, XR, ["--variants", "nope"], "unknown variant 'nope'"),
  (xla_ring.main, XR, ["--dtype", "nope"], "--dtype: unknown dtype"),
  (xla_ring.main, XR, ["--xla-config", "nope"], "--xla-config"),
  (
    xla_ring.main,
    XR,
    ["--topology", "v9x:2x4"],
    "--topology: cannot build TPU topology 'v9x:2x4'",
  ),
  # cpu_walltime: zero counts, a shape the 2x4 mesh cannot shard, ints.
  (cpu_walltime.main, CW, ["--repeats", "0"], "--repeats: expected"),
  (cpu_walltime.main, CW, ["--rounds", "0"], "--rounds: expected"),
  (cpu_walltime.main, CW, ["--shape", "3,5,7"], "--shape: B must divide"),
  (cpu_walltime.main, CW, ["--dtype", "int8"], "expected a floating dtype"),
]


@pytest.mark.parametrize(
  "main, prog, argv, words",
  USAGE_ERRORS,
  ids=[f"{c[1].split('.')[-1]} {' '.join(c[2])}" for c in USAGE_ERRORS],
)
def test_usage_error_is_one_line(main, prog, argv, words, capsys):
  err = _one_line_exit_2(main, argv, prog, capsys)
  assert words in err, err


@pytest.mark.parametrize(
  "path, words",
  [
    (None, None),
    ("-", None),
    ("{tmp}/out.json", None),
    ("/nonexistent/x.json", "directory '/nonexistent' does not exist"),
    ("{tmp}", "is a directory"),
  ],
)
def test_check_writable(path, words, tmp_path):
  path = path and path.format(tmp=tmp_path)
  if words is None:
    _cli.check_writable(path)
    assert not (path and os.path.isfile(path))  # nothing created
  else:
    with pytest.raises(_cli.UsageError, match=words):
      _cli.check_writable(path, flag="--json")


def test_usage_error_subprocess_one_line():
  """The real command: argparse used to print the whole usage first."""
  r = _run("-m", "benchmarks.run", "--shape", "1,2")
  assert r.returncode == 2
  assert r.stderr.strip() == (
    "python -m benchmarks.run: error: --shape: expected B,D,F positive "
    "integers, got '1,2' (see --help)"
  )


@pytest.mark.parametrize(
  "module, words",
  [
    ("benchmarks.plan_twins", "fused all-gather step plan"),
    ("benchmarks.xla_configs", "libtpu flags"),
    ("benchmarks.xla_ring", "decompositions"),
    ("benchmarks.loop_copies", "Copies in loops"),
  ],
)
def test_help_says_what_it_does(module, words):
  r = _run("-m", module, "--help")
  assert r.returncode == 0, r.stderr
  assert f"usage: python -m {module}" in r.stdout
  assert words in r.stdout and "--json" in r.stdout


def test_xla_ring_json_and_progress():
  """xla_ring had no --json and no progress bar."""
  r = _run(
    "-m",
    "benchmarks.xla_ring",
    "--m",
    "chapter",
    "--variants",
    "xla_ring1_float32",
    "--json",
    env={"ASYNCOPS_PROGRESS": "1"},
  )
  assert r.returncode == 0, r.stderr
  (row,) = json.loads(r.stdout)
  assert row["variant"] == "xla_ring1_float32"
  assert row["step_us"] > 0 and row["xla_config"] is None
  assert "xla_ring" in r.stderr  # the bar, and the human line
  assert "Traceback" not in r.stderr


def test_plan_twins_json_file(tmp_path, capsys):
  out = tmp_path / "rows.json"
  assert _cli.run(plan_twins.main, [*PLAN, "--json", str(out)], prog=PT) == 0
  rows = json.loads(out.read_text())
  assert rows and all(r["dims"] == [4, 64, 128, 256] for r in rows)
  assert all(r["twin_us"] > 0 for r in rows)


@pytest.mark.parametrize("args", [[], ["help"]])
def test_make_lists_targets(args):
  """``make`` alone created .venv/ and stopped; now it lists the targets
  (and installs nothing)."""
  r = subprocess.run(
    ["make", "-C", str(ROOT), "--no-print-directory", *args],
    capture_output=True,
    text=True,
    timeout=60,
  )
  assert r.returncode == 0, r.stderr
  for target in ("demo", "test", "bench", "lint", "clean"):
    assert f"make {target}" in r.stdout
  assert "pip" not in r.stdout
