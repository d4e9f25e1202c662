"""Prints the evidence in ``design/futures.md``: a future's layout.

The treedef of a ppermute future, the jaxpr of start/done, and the start and
done custom calls in the TPU ``v5e:2x4`` HLO of the same program::

  python examples/futures_layout.py

Exit status: 0, or 2 for a usage error: it prints evidence and has no
findings (exit 1 is never used).
"""

import os
import re
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get(
  "XLA_FLAGS", ""
):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8"
  )
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import asyncops  # noqa: E402
from asyncops import (
  _cli,  # noqa: E402
  inspect,  # noqa: E402
)


def f(x):
  x, fut = asyncops.ppermute_start(x, "i", shift=1)
  print("treedef:", jax.tree.structure(fut))
  return asyncops.ppermute_done(fut)


def program(mesh):
  return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("i"), out_specs=P("i")))


def main(argv=None) -> int:
  p = _cli.parser(
    "python examples/futures_layout.py",
    __doc__.split("\n")[0],
    epilog=_cli.describe(__doc__.rsplit("\n\n", 1)[1]),
  )
  a = p.parse_args(argv)
  with _cli.human_output(a.json):
    lines = _show()
  _cli.write_json(a.json, {"kernels": lines})
  return _cli.EXIT_OK


def _show() -> list[str]:
  mesh = jax.make_mesh((8,), ("i",), axis_types=(jax.sharding.AxisType.Auto,))
  x = jax.ShapeDtypeStruct((16, 128), jnp.float32)
  print(jax.make_jaxpr(program(mesh))(x))
  tpu = inspect.tpu_mesh("v5e:2x4", (8,), ("i",))
  xs = jax.ShapeDtypeStruct(
    (64, 128), jnp.float32, sharding=NamedSharding(tpu, P("i"))
  )
  text = inspect.analyze(program(tpu), xs).hlo_text
  lines = [
    re.sub(
      r", (metadata|backend_config|frontend_attributes)=.*", "", line.strip()
    )
    for line in text.splitlines()
    if re.search(r"%asyncops_[\w.]+ = ", line)
  ]
  for line in lines:
    print(line)
  return lines


if __name__ == "__main__":
  sys.exit(_cli.run(main, prog="python examples/futures_layout.py"))
