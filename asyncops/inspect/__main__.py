"""Command line: print the harness's report for a program.

Usage::

  python -m asyncops.inspect MODULE:FUNCTION [--topology v5e:2x4] [--hlo F]

``FUNCTION`` returns ``(jitted, abstract_args)``; it is called with the
topology name if it accepts an argument. ``MODULE`` is a dotted module name
(importable from the current directory) or a path to a ``.py`` file.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import os
import sys

from ._analysis import analyze
from ._mesh import tpu_topology


def _load(spec: str):
  if ":" not in spec:
    raise SystemExit(f"expected MODULE:FUNCTION, got {spec!r}")
  mod_name, func_name = spec.rsplit(":", 1)
  if mod_name.endswith(".py") or os.sep in mod_name:
    path = os.path.abspath(mod_name)
    sys.path.insert(0, os.path.dirname(path))
    s = importlib.util.spec_from_file_location("_inspected", path)
    module = importlib.util.module_from_spec(s)
    s.loader.exec_module(module)
  else:
    sys.path.insert(0, os.getcwd())
    module = importlib.import_module(mod_name)
  return getattr(module, func_name)


def main(argv=None) -> int:
  """Runs the command line; returns the exit status."""
  p = argparse.ArgumentParser(prog="python -m asyncops.inspect")
  p.add_argument("target", help="MODULE:FUNCTION returning (jitted, args)")
  p.add_argument("--topology", default="v5e:2x4")
  p.add_argument("--hlo", help="also write the scheduled HLO to this file")
  a = p.parse_args(argv)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  tpu_topology(a.topology)  # quiet libtpu start-up
  fn = _load(a.target)
  try:
    takes_arg = bool(inspect.signature(fn).parameters)
  except (TypeError, ValueError):
    takes_arg = False
  jitted, args = fn(a.topology) if takes_arg else fn()
  report = analyze(jitted, *args)
  if a.hlo:
    with open(a.hlo, "w") as f:
      f.write(report.hlo_text)
  print(f"{a.target} on {a.topology}")
  print(report.summary())
  return 0


if __name__ == "__main__":
  sys.exit(main())
