"""The command-line convention shared by asyncops' tools.

Every command (``python -m asyncops.inspect``, ``python -m
asyncops.compare``, ``python -m benchmarks.run``, the examples) is an
``argparse`` parser with ``--help`` and ``--json`` and exits with

* 0: ran, nothing to report;
* 1: ran and found something (a hazard, a refused program), each finding
  named on a ``finding: ...`` line of the human output and in the JSON;
* 2: a usage error: one line on stderr naming the bad argument and the fix,
  never a traceback.

``--json`` (:func:`add_json`) means the same everywhere: alone (or
``--json -``) the JSON document goes to stdout and the human output to
stderr; ``--json FILE`` writes FILE and leaves the human output on stdout.
On a command with a positional argument, ``--json`` followed by a word is
read as ``--json FILE`` only when the positionals are still complete
without that word (``inspect TARGET --json out.json``, ``inspect --json
out.json TARGET``); otherwise the word is the positional and the JSON goes
to stdout (``inspect --json TARGET``, as before ``--json`` took a file).
``--json=FILE`` is never ambiguous.

Long commands show a ``tqdm`` progress bar on the terminal (stderr, so
``--json`` output on stdout stays clean). ``ASYNCOPS_PROGRESS=0`` hides it,
``=1`` shows it even when stderr is not a terminal.

Example:

  >>> def main(argv):
  ...   raise UsageError("--topology: unknown topology 'v9'")
  >>> run(main, [], prog="demo")  # stderr: demo: error: --topology: ...
  2
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

T = TypeVar("T")

EXIT_OK, EXIT_FINDING, EXIT_USAGE = 0, 1, 2


JSON_STDOUT = "-"


class UsageError(Exception):
  """A user mistake: the message names the argument and the fix."""


class _TrialError(Exception):
  """An argparse error while trying one reading of ``--json WORD``."""


def describe(doc: str) -> str:
  """A module docstring for ``--help``: without its ``Usage::`` block
  (argparse prints the usage) and without RST double backquotes."""
  paras = [
    p.strip("\n")
    for p in doc.split("\n\n")
    if p.strip() and not p.strip().startswith(("Usage::", "python "))
  ]
  return "\n\n".join(paras).replace("``", "")


class ArgumentParser(argparse.ArgumentParser):
  """An ``argparse.ArgumentParser`` whose usage errors are one line.

  argparse prints the whole usage (many lines for a command with many
  flags) before its error; this prints only ``PROG: error: MESSAGE (see
  --help)`` and exits 2, as :func:`run` does for a :class:`UsageError`.
  """

  _trial = False

  def error(self, message: str):  # noqa: D102 - argparse's hook
    if self._trial:
      raise _TrialError(message)
    one = " ".join(str(message).split())
    self.exit(EXIT_USAGE, f"{self.prog}: error: {one} (see --help)\n")

  def parse_known_args(self, args=None, namespace=None):  # noqa: D102
    args = list(sys.argv[1:] if args is None else args)
    flag = _json_action(self)
    if flag is not None:
      args = self._read_bare_json(args, namespace)
    ns, extras = super().parse_known_args(args, namespace)
    if flag is not None:
      dest = getattr(ns, flag.dest, None)
      if dest == "":
        self.error("--json: empty file name; give FILE, or '-' for stdout")
      try:
        check_writable(dest)
      except UsageError as e:
        self.error(str(e))
    return ns, extras

  def _read_bare_json(self, args: list[str], namespace) -> list[str]:
    """``--json WORD`` on a parser with positionals: ``--json=-`` and the
    positional WORD unless the positionals are complete without WORD."""
    if not any(not a.option_strings for a in self._actions):
      return args
    out = list(args)
    for i, tok in enumerate(out[:-1]):
      if tok == "--":
        break
      nxt = out[i + 1]
      if tok != "--json" or (nxt.startswith("-") and nxt != JSON_STDOUT):
        continue
      if not self._parses(out, namespace):
        out[i] = f"--json={JSON_STDOUT}"
    return out

  def _parses(self, args: list[str], namespace) -> bool:
    self._trial = True
    try:
      _, extras = super().parse_known_args(list(args), copy.deepcopy(namespace))
    except _TrialError:
      return False
    finally:
      self._trial = False
    return not extras


def _json_action(p: argparse.ArgumentParser) -> argparse.Action | None:
  for a in p._actions:  # noqa: SLF001 - argparse has no public listing
    if "--json" in a.option_strings and a.nargs == "?":
      return a
  return None


def add_json(
  p: argparse.ArgumentParser, what: str = "the result"
) -> argparse.Action:
  """Adds the shared ``--json [FILE]`` (see the module docstring); the
  parsed value is ``None`` (not given), ``"-"`` (stdout) or a path."""
  return p.add_argument(
    "--json",
    nargs="?",
    const=JSON_STDOUT,
    default=None,
    metavar="FILE",
    help=f"write {what} as JSON to FILE; without FILE (or with '-') on "
    "stdout, the human output then on stderr (progress stays on stderr)",
  )


def parser(
  prog: str, description: str, epilog: str | None = None
) -> argparse.ArgumentParser:
  """An :class:`ArgumentParser` with the shared ``--json [FILE]``."""
  p = ArgumentParser(
    prog=prog,
    description=describe(description),
    epilog=epilog,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  add_json(p)
  return p


def json_to_stdout(dest: str | bool | None) -> bool:
  """Whether ``--json``'s value sends the JSON document to stdout."""
  return dest is True or dest == JSON_STDOUT


def write_json(dest: str | bool | None, data: Any, *, indent: int = 1) -> None:
  """Writes ``data`` where ``--json``'s value says: nowhere (``None``),
  stdout (``"-"``) or the file ``dest``."""
  if dest is None or dest is False:
    return
  text = json.dumps(data, indent=indent, default=str)
  if json_to_stdout(dest):
    print(text, flush=True)
  else:
    with open(dest, "w") as f:
      f.write(text + "\n")


def print_findings(findings: Sequence[str], dest: str | bool | None) -> int:
  """Prints one ``finding: ...`` line per finding with the human output
  (stdout; stderr when the JSON goes to stdout) and returns the exit
  status: 1 with a finding, else 0."""
  stream = sys.stderr if json_to_stdout(dest) else sys.stdout
  for f in findings:
    print(f"finding: {f}", file=stream, flush=True)
  return EXIT_FINDING if findings else EXIT_OK


def run(
  main: Callable[[Sequence[str] | None], int | None],
  argv: Sequence[str] | None = None,
  *,
  prog: str,
) -> int:
  """Calls ``main(argv)`` and turns a :class:`UsageError` into exit 2.

  ``argparse`` already exits 2 with a one-line message for a bad flag; this
  does the same for mistakes found later (a topology libtpu does not know,
  a module that does not import), so the user never sees a traceback for
  them.
  """
  try:
    code = main(argv)
  except UsageError as e:
    print(f"{prog}: error: {e}", file=sys.stderr)
    return EXIT_USAGE
  except KeyboardInterrupt:
    print(f"{prog}: interrupted", file=sys.stderr)
    return 130
  return EXIT_OK if code is None else int(code)


def check_topology(topology: str, *, flag: str = "--topology") -> None:
  """Raises :class:`UsageError` unless libtpu knows ``topology``."""
  from asyncops.inspect import tpu_topology

  try:
    tpu_topology(topology)
  except Exception as e:  # libtpu raises plain RuntimeErrors/XlaErrors
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e)
    raise UsageError(
      f"{flag}: cannot build TPU topology {topology!r} ({first}); "
      "expected e.g. v5e:2x4, v4:2x2x1, v5p:2x2x1, v6e:2x4"
    ) from None


def parse_ints(text: str, n: int, *, flag: str) -> tuple[int, ...]:
  """``"1024,2048,8192"`` -> ``(1024, 2048, 8192)``, or a UsageError."""
  try:
    out = tuple(int(s) for s in text.split(","))
  except ValueError:
    out = ()
  if len(out) != n or any(v <= 0 for v in out):
    raise UsageError(
      f"{flag}: expected {n} positive integers separated by commas, "
      f"got {text!r}"
    )
  return out


def positive_int(text: str) -> int:
  """An argparse ``type=``: an integer of at least 1."""
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(
      f"expected a positive integer, got {text!r}"
    ) from None
  if value < 1:
    raise argparse.ArgumentTypeError(
      f"expected a positive integer, got {text!r}"
    )
  return value


def parse_int_list(text: str, *, flag: str) -> list[int]:
  """``"16,64,256"`` -> ``[16, 64, 256]`` (any count, each >= 1), or a
  UsageError."""
  try:
    out = [int(s) for s in text.split(",") if s.strip()]
  except ValueError:
    out = []
  if not out or any(v <= 0 for v in out):
    raise UsageError(
      f"{flag}: expected positive integers separated by commas, got {text!r}"
    )
  return out


def check_writable(path: str | None, *, flag: str = "--json") -> None:
  """Raises :class:`UsageError` unless a file can be written at ``path``
  (``None`` and ``"-"``, stdout, pass), before a long run that writes it
  at the end."""
  if path in (None, "-"):
    return
  where = os.path.dirname(os.path.abspath(path))
  if os.path.isdir(path):
    raise UsageError(f"{flag}: {path!r} is a directory; give a file name")
  if not os.path.isdir(where):
    raise UsageError(
      f"{flag}: directory {where!r} does not exist; create it or give "
      "another path"
    )
  if not os.access(where, os.W_OK) or (
    os.path.exists(path) and not os.access(path, os.W_OK)
  ):
    raise UsageError(f"{flag}: cannot write {path!r} (permission denied)")


@contextlib.contextmanager
def human_output(dest: str | bool | None) -> Iterator[None]:
  """When ``--json`` sends the JSON to stdout, sends the human-readable
  prints to stderr, so stdout carries only the JSON document (with
  ``--json FILE`` they stay on stdout)."""
  if not json_to_stdout(dest):
    yield
    return
  with contextlib.redirect_stdout(sys.stderr):
    yield


def print_json(data: Any) -> None:
  """Prints ``data`` as one JSON document on stdout."""
  print(json.dumps(data, indent=1, default=str))


def _progress_enabled(stream: Any) -> bool:
  forced = os.environ.get("ASYNCOPS_PROGRESS", "")
  if forced in ("0", "1"):
    return forced == "1"
  isatty = getattr(stream, "isatty", None)
  return bool(isatty and isatty())


@contextlib.contextmanager
def _terminal() -> Iterator[io.TextIOBase]:
  """A stream on a duplicate of fd 2, so the bar survives libtpu's
  start-up, which sends fd 2 to /dev/null for a moment."""
  try:
    fd = os.dup(sys.stderr.fileno())
  except (OSError, ValueError, AttributeError):  # no real fd (captured)
    yield sys.stderr
    return
  stream = os.fdopen(fd, "w", buffering=1)
  try:
    yield stream
  finally:
    stream.close()


@contextlib.contextmanager
def progress_bar(total: int | None, desc: str, unit: str = "step"):
  """A ``tqdm`` bar on the terminal (or a no-op object when hidden).

  Yields an object with ``update(n=1)`` and ``set_postfix_str(text)``.
  """
  from tqdm import tqdm

  with _terminal() as stream:
    bar = tqdm(
      total=total,
      desc=desc,
      unit=unit,
      file=stream,
      disable=not _progress_enabled(stream),
      leave=False,
      dynamic_ncols=True,
    )
    try:
      yield bar
    finally:
      bar.close()


def progress(
  items: Iterable[T], desc: str, total: int | None = None, unit: str = "step"
) -> Iterator[T]:
  """Iterates ``items`` with a progress bar on the terminal.

  Example:

    >>> [x for x in progress(range(3), "demo")]
    [0, 1, 2]
  """
  if total is None and hasattr(items, "__len__"):
    total = len(items)  # type: ignore[arg-type]
  with progress_bar(total, desc, unit) as bar:
    for item in items:
      bar.set_postfix_str(str(item)[:40], refresh=False)
      yield item
      bar.update(1)
