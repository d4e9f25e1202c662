"""``python -m asyncops.inspect``: the harness's report for one program.

Usage::

  python -m asyncops.inspect MODULE:FUNCTION [--topology v5e:2x4]
      [--json [FILE]] [--hlo FILE] [--require-overlap]

``FUNCTION`` returns ``(jitted, args)``: a ``jax.jit`` function and the
(abstract) arguments to compile it for, with shardings over a TPU mesh
(``asyncops.inspect.tpu_mesh``). It is called with the topology name if it
takes an argument. ``MODULE`` is a dotted module name (importable from the
current directory) or a path to a ``.py`` file.

Exit status: 0 clean; 1 a hazard (a copy of a buffer in flight, a
defensive copy, a transfer buffer that does not live until its done, with
``--require-overlap`` a start/done pair with nothing in its window) or a
program asyncops refused while tracing it; 2 a usage error (bad module,
function, topology or return value), one line on stderr.

``--json`` alone prints the report as JSON on stdout; ``--json FILE``
writes it to FILE and prints the summary. ``--json MODULE:FUNCTION`` (the
target right after the flag) is the target, not a file, as before
``--json`` took one; ``--json=FILE`` is never ambiguous.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
import traceback

from asyncops import _cli

PROG = "python -m asyncops.inspect"


def _load(spec: str):
  """The function ``MODULE:FUNCTION`` names, or a UsageError."""
  mod_name, sep, func_name = spec.rpartition(":")
  if not sep or not mod_name or not func_name:
    raise _cli.UsageError(
      f"target: expected MODULE:FUNCTION (e.g. mymodel:program or "
      f"path/to/file.py:program), got {spec!r}"
    )
  if mod_name.endswith(".py") or os.sep in mod_name:
    path = os.path.abspath(mod_name)
    if not os.path.isfile(path):
      raise _cli.UsageError(f"target: no such file {mod_name!r}")
    sys.path.insert(0, os.path.dirname(path))
    s = importlib.util.spec_from_file_location("_inspected", path)
    module = importlib.util.module_from_spec(s)
    try:
      s.loader.exec_module(module)
    except Exception as e:
      raise _cli.UsageError(
        f"target: importing {mod_name!r} failed: {_one_line(e)}"
      ) from None
  else:
    sys.path.insert(0, os.getcwd())
    try:
      module = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
      if e.name and mod_name.startswith(e.name):
        raise _cli.UsageError(
          f"target: no module named {mod_name!r} (run from the directory "
          "that contains it, or give a path to a .py file)"
        ) from None
      raise _cli.UsageError(
        f"target: importing {mod_name!r} failed: {_one_line(e)}"
      ) from None
    except Exception as e:
      raise _cli.UsageError(
        f"target: importing {mod_name!r} failed: {_one_line(e)}"
      ) from None
  fn = getattr(module, func_name, None)
  if fn is None:
    names = sorted(
      n
      for n, v in vars(module).items()
      if callable(v) and not n.startswith("_") and not inspect.isclass(v)
    )
    hint = f"; it has {', '.join(names[:8])}" if names else ""
    raise _cli.UsageError(
      f"target: module {mod_name!r} has no function {func_name!r}{hint}"
    )
  if not callable(fn):
    raise _cli.UsageError(f"target: {spec} is not a function")
  return fn


def _one_line(e: BaseException) -> str:
  text = str(e).strip().splitlines()
  return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _program(fn, spec: str, topology: str):
  try:
    takes_arg = bool(inspect.signature(fn).parameters)
  except (TypeError, ValueError):
    takes_arg = False
  out = fn(topology) if takes_arg else fn()
  if (
    not isinstance(out, tuple)
    or len(out) != 2
    or not hasattr(out[0], "trace")
    or not isinstance(out[1], (tuple, list))
  ):
    raise _cli.UsageError(
      f"target: {spec} must return (jitted, args): a jax.jit function and "
      f"a tuple of its (abstract) arguments, got {type(out).__name__}"
    )
  return out


def main(argv=None) -> int:
  """Runs the command line; returns the exit status."""
  p = _cli.parser(PROG, __doc__)
  p.add_argument(
    "target", help="MODULE:FUNCTION returning (jitted, abstract_args)"
  )
  p.add_argument(
    "--topology",
    default="v5e:2x4",
    help="TPU topology to compile for (default: v5e:2x4)",
  )
  p.add_argument("--hlo", metavar="FILE", help="also write the scheduled HLO")
  p.add_argument(
    "--require-overlap",
    action="store_true",
    help="also a finding: a kernel start/done pair with no compute between",
  )
  p.add_argument(
    "--traceback",
    action="store_true",
    help="print the full traceback when the program fails to compile",
  )
  a = p.parse_args(argv)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  from asyncops.inspect import _json, analyze

  _cli.check_writable(a.hlo, flag="--hlo")
  with _cli.progress_bar(3, f"inspect {a.target}") as bar:
    bar.set_postfix_str(f"topology {a.topology}")
    _cli.check_topology(a.topology)
    bar.update(1)
    fn = _load(a.target)
    bar.set_postfix_str("tracing and compiling")
    try:
      jitted, args = _program(fn, a.target, a.topology)
      report = analyze(jitted, *args)
    except _cli.UsageError:
      raise
    except Exception as e:
      bar.close()
      if a.traceback:
        traceback.print_exc()
      refused = type(e).__module__.startswith("asyncops")
      tail = "" if a.traceback else " (--traceback for details)"
      if refused:  # a finding: the whole message names the user's lines
        print(
          f"{PROG}: {a.target} refused by asyncops: "
          f"{type(e).__name__}: {str(e).strip()}",
          file=sys.stderr,
        )
      else:
        print(
          f"{PROG}: error: {a.target} failed: {_one_line(e)}{tail}",
          file=sys.stderr,
        )
      return _cli.EXIT_FINDING if refused else _cli.EXIT_USAGE
    bar.update(2)
  if a.hlo:
    with open(a.hlo, "w") as f:
      f.write(report.hlo_text)
  data = _json.report_dict(report)
  findings = list(data["hazards"])
  if a.require_overlap:
    findings += [
      f"%{q['start']} -> %{q['done']}: nothing in the window "
      f"(start at {q['start_source'] or 'unknown'})"
      for q in data["pairs"]
      if q["kind"] == "kernel" and not q["window"]["overlapped"]
    ]
  if a.json:
    data.update(target=a.target, topology=a.topology, findings=findings)
    _cli.write_json(a.json, data, indent=2)
  if not _cli.json_to_stdout(a.json):
    print(f"{a.target} on {a.topology}")
    print(report.summary())
    print(
      f"{len(findings)} finding(s)"
      + "".join(f"\n  {line}" for line in findings)
    )
  return _cli.EXIT_FINDING if findings else _cli.EXIT_OK


if __name__ == "__main__":
  sys.exit(_cli.run(main, prog=PROG))
