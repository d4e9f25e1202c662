"""Findings by exit code, and one ``--json`` on every command line.

Branch h-clifind (design/README.md): ``benchmarks.edge_copies`` and
``benchmarks.loop_copies`` exit 1 on a copy where the library promises
none (and name it on a ``finding:`` line and in the JSON); ``--json`` alone
prints JSON on stdout and ``--json FILE`` writes FILE on every command
(``asyncops._cli.add_json``), and every command line recorded in
README.md and design/ with ``--json`` still parses to what it meant. The
commands run in-process on the smallest compiles that show the point.
"""

import argparse
import importlib.util
import json
import pathlib
import re
import shlex
import sys

import pytest

from asyncops import _cli
from asyncops.compare import __main__ as compare_cli
from asyncops.inspect import __main__ as inspect_cli
from benchmarks import (
  cpu_walltime,
  edge_copies,
  loop_copies,
  plan_twins,
  xla_configs,
  xla_ring,
)
from benchmarks import run as bench_run
from tests import util as u

ROOT = pathlib.Path(__file__).resolve().parent.parent
V5E = ["--topology", "v5e:2x4"]
DONATED = "remote, x aliased, donated"  # a defensive copy on v5e
OURS = "remote DMA, x aliased (asyncops' start)"


def _example(name: str):
  if str(ROOT / "examples") not in sys.path:  # mlp_block imports a sibling
    sys.path.insert(0, str(ROOT / "examples"))
  spec = importlib.util.spec_from_file_location(
    f"_example_{name}", ROOT / "examples" / f"{name}.py"
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _call(main, argv, capsys, prog="prog"):
  """``(exit status, stdout)`` of ``main(argv)`` run as its ``__main__``."""
  try:
    code = _cli.run(main, argv, prog=prog)
  except SystemExit as e:
    code = e.code
  cap = capsys.readouterr()
  return code, cap.out, cap.err


# The copies tools ---------------------------------------------------------


def test_edge_copies_defensive_copy_is_a_finding_only_where_promised(
  monkeypatch, capsys
):
  """The donated start's defensive copy (v5e) is shown for comparison, no
  finding; the same copy in a row that promises none exits 1, named."""
  argv = [*V5E, "--variant", DONATED]
  code, out, _ = _call(edge_copies.main, [*argv, "--json"], capsys)
  (row,) = json.loads(out)
  assert code == 0
  assert any(c["kind"] == "defensive" for c in row["copies"])
  assert not row["promised_clean"] and row["findings"] == []
  assert row["hazards"] == [h for h in row["hazards"] if "defensive" in h]

  monkeypatch.setattr(edge_copies, "CLEAN", (*edge_copies.CLEAN, DONATED))
  code, out, _ = _call(edge_copies.main, argv, capsys)
  assert code == 1
  (line,) = [ln for ln in out.splitlines() if ln.startswith("finding:")]
  assert line.startswith(f"finding: {DONATED} on v5e:2x4: defensive copy %")
  code, out, err = _call(edge_copies.main, [*argv, "--json"], capsys)
  (row,) = json.loads(out)
  assert code == 1 and row["promised_clean"]
  assert [f"finding: {f}" for f in row["findings"]] == [line]
  assert line in err  # the human line moves to stderr with the JSON


def test_edge_copies_asyncops_start_clean(capsys):
  """asyncops' start on v5e and v5p: edge copies (memory_space, boundary),
  no hazard, exit 0."""
  argv = ["--topology", "v5e:2x4,v5p:2x2x2", "--variant", OURS, "--json"]
  code, out, _ = _call(edge_copies.main, argv, capsys)
  rows = json.loads(out)
  assert code == 0, rows
  assert [r["topology"] for r in rows] == ["v5e:2x4", "v5p:2x2x2"]
  for r in rows:
    assert r["promised_clean"] and r["findings"] == [] and not r["hazards"]
    kinds = {c["kind"] for c in r["copies"]}
    assert kinds and kinds <= {"boundary", "memory_space"}, r


def test_loop_copies_in_flight_copy_is_a_finding_only_where_promised(
  monkeypatch, capsys
):
  """lax.fori_loop(unroll=2)'s accumulate loop copies buffers in flight
  (v5e): the comparison row; in a promised row, exit 1 and named."""
  argv = [*V5E, "--programs", "accumulate", "--loops", "lax"]
  code, out, _ = _call(loop_copies.main, [*argv, "--json"], capsys)
  (row,) = json.loads(out)
  assert code == 0 and row["in_flight"] >= 1 and row["hazards"] >= 1
  assert not row["promised_clean"] and row["findings"] == []

  monkeypatch.setattr(loop_copies, "CLEAN", tuple(loop_copies.LOOPS))
  code, out, _ = _call(loop_copies.main, argv, capsys)
  found = [ln for ln in out.splitlines() if ln.startswith("finding:")]
  assert code == 1
  assert len(found) >= row["in_flight"]
  where = "accumulate on v5e:2x4 with jax.lax.fori_loop(unroll=2)"
  assert all(ln.startswith(f"finding: {where}: ") for ln in found)
  assert any("in-flight copy %" in ln for ln in found)


def test_loop_copies_scheduling_loop_clean(tmp_path, capsys):
  path = tmp_path / "rows.json"
  argv = [*V5E, "--programs", "accumulate", "--loops", "scheduling"]
  code, out, _ = _call(loop_copies.main, [*argv, "--json", str(path)], capsys)
  (row,) = json.loads(path.read_text())
  assert code == 0
  assert row["loop"] == "scheduling.fori_loop" and row["promised_clean"]
  assert row["findings"] == [] and row["in_flight"] == 0
  assert "| accumulate | v5e:2x4 | scheduling.fori_loop |" in out
  assert "finding" not in out


@pytest.mark.parametrize(
  "module, words",
  [
    (edge_copies, "a row of asyncops' own start"),
    (loop_copies, "in a scheduling.fori_loop row"),
    (xla_configs, "that libtpu refuses"),
    (plan_twins, "has no findings"),
    (xla_ring, "has no findings"),
    (cpu_walltime, "differs from the lax.ppermute version"),
  ],
)
def test_help_states_the_finding_rule(module, words, capsys):
  code, out, _ = _call(module.main, ["--help"], capsys)
  assert code == 0
  assert " ".join(words.split()) in " ".join(out.split())
  assert "--json [FILE]" in out


def test_xla_configs_refused_flag_is_a_finding(monkeypatch, capsys):
  """A candidate libtpu does not know (the list gone stale): exit 1."""
  monkeypatch.setattr(
    xla_configs, "_SCAN_SHAPES", (("jit", (64, 256, 512), 4),)
  )
  monkeypatch.setattr(
    xla_configs, "CANDIDATES", {"xla_tpu_no_such_flag_clifind": (True,)}
  )
  code, out, err = _call(xla_configs.main, ["--json"], capsys)
  (row,) = json.loads(out)
  assert code == 1, err
  assert row["flag"] == "xla_tpu_no_such_flag_clifind" and row["error"]
  assert "finding: xla_tpu_no_such_flag_clifind=True (jit" in err


def test_cpu_walltime_wrong_result_is_a_finding(monkeypatch, capsys):
  """A variant whose result differs: exit 1 and named (was a traceback)."""
  monkeypatch.setattr(
    cpu_walltime._variants, "available", lambda: ["allgather_matmul"]
  )
  monkeypatch.setattr(cpu_walltime._variants, "library_ref", lambda: [])

  def differs(*args, **kwargs):
    raise AssertionError("Not equal to tolerance")

  monkeypatch.setattr(cpu_walltime.np.testing, "assert_allclose", differs)
  argv = ["--shape", "16,64,64", "--repeats", "1", "--rounds", "1"]
  code, out, _ = _call(cpu_walltime.main, argv, capsys)
  assert code == 1
  found = [ln for ln in out.splitlines() if ln.startswith("finding:")]
  assert [ln.rsplit(": max |err| ", 1)[0] for ln in found] == [
    f"finding: allgather_matmul (transfer point {point}) differs from "
    "lax.ppermute"
    for point in ("start", "done")
  ]


# --json on every command line ---------------------------------------------

U2 = "tests.util:pattern_staggered_unroll2"
SMALL_RUN = u.BENCH_SMALL


def _cpu_walltime_small(monkeypatch, _):
  monkeypatch.setattr(
    cpu_walltime._variants, "available", lambda: ["allgather_matmul"]
  )
  monkeypatch.setattr(cpu_walltime._variants, "library_ref", lambda: [])
  return ["--shape", "16,64,64", "--repeats", "1", "--rounds", "1"]


def _xla_configs_small(monkeypatch, _):
  monkeypatch.setattr(
    xla_configs, "_SCAN_SHAPES", (("jit", (64, 256, 512), 4),)
  )
  monkeypatch.setattr(
    xla_configs,
    "CANDIDATES",
    {"xla_tpu_spmd_unroll_windowed_einsum": (True,)},
  )
  return []


# name -> (main, argv before --json, positional first?)
COMMANDS = {
  "inspect": (lambda: inspect_cli.main, [U2]),
  "compare": (lambda: compare_cli.main, ["--patterns", "basic"]),
  "run": (lambda: bench_run.main, SMALL_RUN),
  "plan_twins": (
    lambda: plan_twins.main,
    [*V5E, "--dims", "4,64,128,256"],
  ),
  "xla_configs": (lambda: xla_configs.main, _xla_configs_small),
  "xla_ring": (
    lambda: xla_ring.main,
    ["--m", "chapter", "--variants", "xla_ring1_float32"],
  ),
  "cpu_walltime": (lambda: cpu_walltime.main, _cpu_walltime_small),
  "edge_copies": (
    lambda: edge_copies.main,
    [*V5E, "--variant", "local DMA, x not aliased"],
  ),
  "loop_copies": (
    lambda: loop_copies.main,
    [*V5E, "--programs", "accumulate", "--loops", "scheduling"],
  ),
  "examples/demo.py": (
    lambda: _example("demo").main,
    ["--sections", "ring_numerics"],
  ),
  "examples/futures_layout.py": (lambda: _example("futures_layout").main, []),
  "examples/collective_matmul.py": (
    lambda: _example("collective_matmul").main,
    ["--shape", "16,64,64"],
  ),
  "examples/mlp_block.py": (
    lambda: _example("mlp_block").main,
    ["--shape", "16,64,64"],
  ),
  "examples/train_mlp.py": (
    lambda: _example("train_mlp").main,
    ["--steps", "2", "--every", "1"],
  ),
  "examples/grad_windows.py": (
    lambda: _example("grad_windows").main,
    lambda monkeypatch, main: (
      monkeypatch.setitem(  # one program of six
        main.__globals__,
        "PROGRAMS",
        {"copy": main.__globals__["PROGRAMS"]["copy"]},
      )
      or []
    ),
  ),
}


def _argv(name, monkeypatch):
  main, argv = COMMANDS[name]
  main = main()
  argv = argv(monkeypatch, main) if callable(argv) else list(argv)
  return main, argv


@pytest.mark.parametrize("name", list(COMMANDS))
def test_json_on_stdout_and_to_a_file(name, tmp_path, monkeypatch, capsys):
  """``--json``: one JSON document on stdout, the human output elsewhere;
  ``--json FILE``: the same document in FILE, the human output on
  stdout; the same exit status."""
  main, argv = _argv(name, monkeypatch)
  code, out, err = _call(main, [*argv, "--json"], capsys)
  assert code in (0, 1), err
  doc = json.loads(out)
  path = tmp_path / "out.json"
  code2, out2, err2 = _call(main, [*argv, "--json", str(path)], capsys)
  assert code2 == code, err2
  in_file = json.loads(path.read_text())
  assert type(in_file) is type(doc)
  assert len(in_file) == len(doc)
  if isinstance(doc, dict):
    assert in_file.keys() == doc.keys()
  assert out2.strip(), "the human output stays on stdout with --json FILE"
  with pytest.raises(json.JSONDecodeError):
    json.loads(out2)


class _Parsed(Exception):
  pass


def _parse(main, argv, monkeypatch) -> argparse.Namespace:
  """What ``main``'s parser makes of ``argv`` (nothing runs after it)."""
  parse = _cli.ArgumentParser.parse_known_args

  def stop(self, args=None, namespace=None):
    ns, extras = parse(self, args, namespace)
    assert not extras, extras
    raise _Parsed(ns)

  monkeypatch.setattr(_cli.ArgumentParser, "parse_known_args", stop)
  with pytest.raises(_Parsed) as e:
    main(argv)
  return e.value.args[0]


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_parser_reads_json_alike(name, monkeypatch, tmp_path):
  main, argv = _argv(name, monkeypatch)
  out = str(tmp_path / "o.json")
  for flags, want in [
    ([], None),
    (["--json"], "-"),
    (["--json", "-"], "-"),
    (["--json", out], out),
    ([f"--json={out}"], out),
  ]:
    assert _parse(main, [*argv, *flags], monkeypatch).json == want, flags


def test_positional_after_bare_json_is_the_target(monkeypatch, tmp_path):
  """``inspect --json TARGET`` parses as before ``--json`` took a file;
  a word after ``--json`` is a file only when the target is there too."""
  main, out = inspect_cli.main, str(tmp_path / "r.json")
  for argv, want in [
    (["--json", U2], "-"),
    (["--json", U2, "--topology", "v6e:2x4"], "-"),
    ([U2, "--json"], "-"),
    ([U2, "--json", out], out),
    (["--json", out, U2], out),
    ([f"--json={out}", U2], out),
    (["--json", "-", U2], "-"),
  ]:
    ns = _parse(main, argv, monkeypatch)
    assert (ns.target, ns.json) == (U2, want), argv


# Every recorded command line with --json ----------------------------------

# Tools whose --json took a FILE before this branch (run: FILE or none).
FILE_TOOLS = (
  "benchmarks.run",
  "benchmarks.plan_twins",
  "benchmarks.xla_configs",
)
TOOLS = {
  "python -m asyncops.inspect": lambda: inspect_cli.main,
  "python -m asyncops.compare": lambda: compare_cli.main,
  "python -m benchmarks.run": lambda: bench_run.main,
  "python -m benchmarks.plan_twins": lambda: plan_twins.main,
  "python -m benchmarks.xla_configs": lambda: xla_configs.main,
  "python -m benchmarks.xla_ring": lambda: xla_ring.main,
  "python -m benchmarks.cpu_walltime": lambda: cpu_walltime.main,
  "python -m benchmarks.edge_copies": lambda: edge_copies.main,
  "python -m benchmarks.loop_copies": lambda: loop_copies.main,
  **{
    f"examples/{n}.py": (lambda n=n: _example(n).main)
    for n in (
      "demo",
      "futures_layout",
      "collective_matmul",
      "mlp_block",
      "train_mlp",
      "grad_windows",
    )
  },
}
# Prose naming the flag, not a command to run (no target).
NOT_COMMANDS = {"python -m asyncops.inspect --json"}


def _recorded() -> list[tuple[str, str, str]]:
  """``(file, tool, arguments)`` of every command line with ``--json`` in
  README.md and design/*.md: code lines (``\\``-continued lines joined)
  and inline code spans (wrapped lines joined)."""
  found = set()
  for path in [ROOT / "README.md", *sorted((ROOT / "design").glob("*.md"))]:
    text = re.sub(r"\\\n\s*(#\s*)?", " ", path.read_text())
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    spans = [" ".join(s.split()) for s in re.findall(r"`([^`]+)`", prose)]
    lines = [ln for ln in text.splitlines() if "`" not in ln]
    for cand in spans + lines:
      for tool in TOOLS:
        if (
          tool in cand and "--json" in cand and cand.strip() not in NOT_COMMANDS
        ):
          rest = cand[cand.index(tool) + len(tool) :]
          found.add((path.name, tool, rest.strip()))
  # The audit tables of design/README.md: "| TOOL | `ARGS` | ...".
  short = {t.split("/")[-1] if "/" in t else t.split(".")[-1]: t for t in TOOLS}
  table = re.compile(r"^\| ([\w./]+)[^|]* \| ([^|]*) \|")
  for line in (ROOT / "design" / "README.md").read_text().splitlines():
    m = table.match(line)
    name = m and m.group(1).split("/")[-1]
    if name in short:
      for span in re.findall(r"`([^`]*--json[^`]*)`", m.group(2)):
        args = span.replace("FILE", "out.json")
        found.add(("README.md table", short[name], args))
  return sorted(found)


# Shell loop variables of recorded commands whose flag has choices.
SHELL_VARS = {"$L": "line"}


def _tokens(rest: str) -> list[str]:
  """The arguments, up to a ``;``, ``|``, ``>`` or ``&&``; a comma list
  wrapped after a comma (``a, b``, in prose or after a ``\\``) joined."""
  rest = re.sub(r",\s+", ",", rest)
  for var, value in SHELL_VARS.items():
    rest = rest.replace(var, value)
  lex = shlex.shlex(rest, posix=True, punctuation_chars=";|&<>")
  lex.whitespace_split = True
  out = []
  for tok in lex:
    if set(tok) <= set(";|&<>"):
      break
    out.append(tok)
  return out


RECORDED = _recorded()


def test_recorded_commands_found():
  tools = {t for _, t, _ in RECORDED}
  assert len(RECORDED) >= 40
  assert {"python -m benchmarks.run", "python -m asyncops.inspect"} <= tools


@pytest.mark.parametrize(
  "where, tool, rest", RECORDED, ids=[f"{f} {r[:60]}" for f, _, r in RECORDED]
)
def test_recorded_json_command_means_what_it_meant(
  where, tool, rest, monkeypatch
):
  argv = _tokens(rest)
  monkeypatch.setattr(_cli, "check_writable", lambda *a, **k: None)
  ns = _parse(TOOLS[tool](), argv, monkeypatch)
  i = argv.index("--json")
  word = argv[i + 1] if i + 1 < len(argv) else None
  takes_file = tool.endswith(FILE_TOOLS)
  if takes_file and word is not None and not word.startswith("-"):
    assert ns.json == word
  else:  # a flag before: JSON on stdout, the next word (if any) unchanged
    assert ns.json == "-"
