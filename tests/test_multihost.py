"""asyncops across processes, as a multi-host user runs it.

Two processes of 4 CPU devices each join ``jax.distributed`` on loopback
(gloo collectives) and run a ring and an all-gather collective matmul over
mesh axes that cross the process boundary (``tests/_multihost_worker.py``).
"""

import os
import pathlib
import socket
import subprocess
import sys

WORKER = pathlib.Path(__file__).resolve().parent / "_multihost_worker.py"


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_four_devices_each():
  port = _free_port()
  env = {
    k: v
    for k, v in os.environ.items()
    if k not in ("XLA_FLAGS", "JAX_PLATFORMS", "JAX_NUM_CPU_DEVICES")
  }
  env["PYTHONPATH"] = str(WORKER.parent.parent)
  procs = [
    subprocess.Popen(
      [sys.executable, str(WORKER), str(i), "2", str(port)],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for i in range(2)
  ]
  outs = []
  try:
    for p in procs:
      outs.append(p.communicate(timeout=300))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for i, (p, (out, err)) in enumerate(zip(procs, outs, strict=True)):
    assert p.returncode == 0, f"process {i}:\n{out}\n{err[-3000:]}"
    assert f"OK {i}" in out
