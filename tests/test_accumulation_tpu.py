"""``allgather_matmul(accumulation="output")`` on compiled TPU HLO (ahead
of time, no TPU), v5e and v5p.

At the chapter's shape (B, D, F) = (1024, 2048, 8192), bf16, the value
rings one- and two-way and the Ref ring: with ``"output"`` no float32
buffer of the accumulator's size (``[M, f]`` or its halves ``[2, M/2,
f]``, per device ``M`` = 512, ``f`` = 2048) is anywhere in the scheduled
program, the chunk dots produce bf16 of that size, the program is still
copy-free and every transfer still hides its own step's chunk matmul (but
for the two-way Ref ring: an in-flight memory-space copy, marked); with
the default (``"float32"``) the float32 accumulator is there (so the check
can fail), and the program is the one without the keyword.
"""

import functools
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from asyncops import collective_matmul as _cm
from asyncops.inspect import analyze, tpu_mesh
from tests.test_collective_matmul_tpu import check_overlap

B, D, F = 1024, 2048, 8192
TOPOLOGIES = {"v5e:2x4": (2, 4), "v5p:2x2x2": (2, 4)}
M, N = B // 2, 4
FL = F // N  # f per device
SPECS = (P("x", "y"), P(None, "y"))


def _report(topology, accumulation, bidirectional, api="value"):
  mesh = tpu_mesh(topology, TOPOLOGIES[topology], ("x", "y"))
  args = [
    jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=NamedSharding(mesh, spec))
    for s, spec in zip(((B, D), (D, F)), SPECS, strict=True)
  ]
  kw = {} if accumulation is None else {"accumulation": accumulation}
  body = functools.partial(
    _cm.allgather_matmul,
    axis_name="y",
    method="ring",
    api=api,
    bidirectional=bidirectional,
    **kw,
  )
  f = jax.jit(
    jax.shard_map(body, mesh=mesh, in_specs=SPECS, out_specs=P("x", "y"))
  )
  return analyze(f, *args)


def _acc_shapes(report, dtype: str) -> list[str]:
  """Buffers of the accumulator's size in ``dtype``: the results (in a
  tuple or alone) ``[M, f]`` or ``[2, M/2, f]`` of the instructions
  outside fusion bodies (inside, XLA adds bfloat16 in float32 registers
  and rounds; that is no buffer in HBM)."""
  pat = re.compile(rf"\b{dtype}\[(?:{M},{FL}|2,{M // 2},{FL})\]")
  return [
    f"{i.name} = {i.shape_text}"
    for comp, instrs in report.schedule.items()
    if not comp.startswith(("fused_computation", "bitcast_fusion"))
    for i in instrs
    if pat.search(i.shape_text)
  ]


# The two-way Ref ring of halves keeps float32 with "output": with a
# bfloat16 accumulator (2 MiB here, 4 in float32) XLA prefetches a
# received half into VMEM while it is the source of the next transfer (a
# read-only copy the guard accepts), and the ring is slower on v5e (and
# v6e at the prefill shape; ``_gather_rings.contracting``).
CASES = [(False, "value"), (True, "value"), (False, "ref")]


@pytest.mark.parametrize("bidi,api", CASES)
@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_output_accumulator_is_bf16_and_copy_free(topology, bidi, api):
  r = _report(topology, "output", bidi, api)
  assert not _acc_shapes(r, "f32"), _acc_shapes(r, "f32")
  assert _acc_shapes(r, "bf16")
  directions = 2 if bidi else 1
  kernels = 1 if bidi and api == "value" else None
  check_overlap(r, N, directions, 1, kernels)  # copy-free, overlapped


@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_ref_two_way_ring_keeps_float32_and_is_copy_free(topology):
  r = _report(topology, "output", True, "ref")
  assert _acc_shapes(r, "f32")
  assert _program(r) == _program(_report(topology, "float32", True, "ref"))
  check_overlap(r, N, 2, 1, None)  # copy-free, overlapped


@pytest.mark.parametrize("bidi", [False, True])
def test_default_keeps_the_float32_accumulator(bidi):
  r = _report("v5e:2x4", None, bidi)
  assert _acc_shapes(r, "f32")
  same = _report("v5e:2x4", "float32", bidi)
  assert _program(same) == _program(r)


def _program(report):
  """The scheduled instructions (their metadata, source columns, aside)."""
  return [
    (c, i.name, i.opcode, i.shape_text, tuple(i.operands))
    for c, instrs in report.schedule.items()
    for i in instrs
  ]
