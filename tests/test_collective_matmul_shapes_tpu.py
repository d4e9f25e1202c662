"""The model-shaped collective matmuls on compiled TPU HLO (no TPU needed).

The issue's target first: a Llama-3-70B MLP shard (D 8192, F 28672,
SwiGLU) in sequence-parallel layout, inside its transformer sublayer
(``x + mlp_block(rms_norm(x))``), on v5e and v6e, both ring directions,
both APIs. Then the other new forms (row gathers with batch dimensions,
several weights and the gathered ``lhs``; contracting gathers with batch
dimensions; row scatters). Every program must have no defensive copy, no
copy of an in-flight buffer, no transpose, the expected number of
transfers, and every chunk matmul of a ring step inside the window of that
step's transfer.
"""

import collections
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from asyncops import _jax_compat as jc
from asyncops import collective_matmul as _cm
from asyncops.inspect import analyze, hazards, tpu_mesh
from tests.test_collective_matmul_tpu import MATMUL_OPS, chunk_scope

# These tests are about the rings (value and Ref APIs): method="ring".
# The default, method="auto", may run the fused kernel or XLA's
# collective instead (tests/test_fused_matmul*.py, test_auto_default).
allgather_matmul = functools.partial(_cm.allgather_matmul, method="ring")
matmul_reducescatter = functools.partial(
  _cm.matmul_reducescatter, method="ring"
)
mlp_block = functools.partial(_cm.mlp_block, method="ring")

N = 4  # the ring axis "y" of a 2x4 mesh
S, D, F = 4096, 8192, 28672  # tokens in a step; Llama-3-70B's D and F
BF16 = jnp.bfloat16


def _rms_norm(x):
  ms = jnp.mean(jnp.square(x.astype(jnp.float32)), -1, keepdims=True)
  return x * jax.lax.rsqrt(ms + 1e-6).astype(x.dtype)


def _llama(api, bidirectional):
  def f(x, w_up, w_down, w_gate):
    return x + mlp_block(
      _rms_norm(x),
      w_up,
      w_down,
      "y",
      w_gate=w_gate,
      activation=jax.nn.silu,
      sequence_parallel=True,
      api=api,
      bidirectional=bidirectional,
    )

  shapes = ((S, D), (D, F), (F, D), (D, F))
  in_specs = (P(("x", "y")), P(None, "y"), P("y", None), P(None, "y"))
  return f, shapes, in_specs, P(("x", "y"))


def _ag_rows(api, bidirectional):
  """[b, s/n, d], gather_dim=1, two weights and the gathered lhs."""

  def f(x, w1, w2):
    (a, b), g = allgather_matmul(
      x * 2,  # an intermediate, as in a model (see the design note)
      (w1, w2),
      "y",
      gather_dim=1,
      return_gathered=True,
      api=api,
      bidirectional=bidirectional,
    )
    return a, b, g[None]

  shapes = ((4, 2048, 2048), (2048, 8192), (2048, 8192))
  in_specs = (P("x", "y"), P(None, "y"), P(None, "y"))
  out = (P("x", None, "y"), P("x", None, "y"), P("y", "x"))
  return f, shapes, in_specs, out


def _ag_contracting(api, bidirectional):
  """[b, s, d/n], the contracting dimension, two weights, gathered lhs."""

  def f(x, w1, w2):
    (a, b), g = allgather_matmul(
      x * 2,
      (w1, w2),
      "y",
      return_gathered=True,
      api=api,
      bidirectional=bidirectional,
    )
    return a, b, g

  shapes = ((2, 1024, 2048), (2048, 8192), (2048, 8192))
  in_specs = (P(None, "x", "y"), P(None, "y"), P(None, "y"))
  return f, shapes, in_specs, (P(None, "x", "y"),) * 3


def _rs_rows(api, bidirectional):
  """[b, s, f/n] -> [b, s/n, d], scatter_dim=1."""

  def f(h, w):
    return matmul_reducescatter(
      h, w, "y", scatter_dim=1, api=api, bidirectional=bidirectional
    )

  shapes = ((4, 2048, 8192), (8192, 2048))
  in_specs = (P("x", None, "y"), P("y", None))
  return f, shapes, in_specs, P("x", "y")


# program -> (builder, chunk matmuls per ring step, keyed by a substring
# of the step's scope, for (unidirectional, bidirectional value,
# bidirectional ref) rings). A row-gather step multiplies each contiguous
# piece (one per outer batch and half) by each weight; contracting gathers
# and row scatters multiply each half and each outer batch separately. The
# Llama up ring has two weights and P = 1, the down ring one weight; the
# batched row gather holds P = 2 batches per device (split in two halves
# when bidirectional), two weights.
PROGRAMS = {
  "llama": (_llama, {"/up/": (2, 4, 4), "/down/": (1, 2, 2)}),
  "ag_rows": (_ag_rows, {"": (4, 4, 4)}),
  "ag_contracting": (_ag_contracting, {"": (2, 4, 4)}),
  "rs_rows": (_rs_rows, {"": (2, 2, 2)}),
}


@functools.cache  # the negative test reuses a compiled program
def _report(topology, program, api, bidirectional):
  build, _ = PROGRAMS[program]
  fn, shapes, in_specs, out_specs = build(api, bidirectional)
  mesh = tpu_mesh(topology, (2, N), ("x", "y"))
  args = [
    jax.ShapeDtypeStruct(s, BF16, sharding=NamedSharding(mesh, spec))
    for s, spec in zip(shapes, in_specs, strict=True)
  ]
  f = jax.jit(
    jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
  )
  return analyze(f, *args)


def check(report, program, api, bidirectional, topology=""):
  """Copy-free, transpose-free, and every ring matmul in its window.

  Copy-free as the guard reads it: XLA may prefetch a chunk into VMEM for
  the matmul while it is sent on (the Ref rings, whose sources are pinned
  to HBM for start and done), a read-only move of a source the done still
  holds (``Copy.read_only_source``, ``design/inspect.md``); any other copy
  of a buffer in flight fails."""
  _, per_step = PROGRAMS[program]
  report.assert_no_defensive_copies()
  report.assert_no_hazards()
  assert hazards(report) == [], [str(h) for h in hazards(report)]
  other = [c for c in report.inflight_copies if not c.read_only_source]
  assert not other, other
  instrs = [i for c in report.schedule.values() for i in c]
  assert "transpose" not in {i.opcode for i in instrs}
  pairs = report.pairs_for("asyncops.ppermute") + report.pairs_for(
    "asyncops.bidirectional"
  )
  kernels = 2 if bidirectional and api == "ref" else 1
  assert len(pairs) == len(per_step) * kernels * (N - 1)
  if bidirectional and api == "value":
    assert not report.pairs_for("asyncops.ppermute")
  # The chunk matmuls of every ring step, by step scope.
  steps = collections.defaultdict(set)
  for i in instrs:
    scope = chunk_scope(i.op_name)
    if (
      scope
      and i.opcode in MATMUL_OPS
      and "dot_general" in i.op_name
      and not i.computation.startswith("fused")
    ):
      steps[scope].add(i.name)
  assert len(steps) == len(per_step) * (N - 1), sorted(steps)
  covered = set()
  for p in pairs:
    start = report.module.instr(p.start)
    scope = chunk_scope(start.op_name)
    assert scope in steps, (p.start, scope)
    window = {i.name for i in p.between}
    assert steps[scope] <= window, (
      f"%{p.start}: chunk matmuls {sorted(steps[scope] - window)} of its "
      "own step are outside its window"
    )
    covered.add(scope)
    ring = 0 if not bidirectional else 1 if api == "value" else 2
    (want,) = [v[ring] for k, v in per_step.items() if k in scope]
    assert len(steps[scope]) == want, (scope, sorted(steps[scope]))
  assert covered == set(steps)


CASES = [
  # The "done when": Llama MLP, both directions, v5e and v6e.
  ("v5e:2x4", "llama", "value", False),
  ("v5e:2x4", "llama", "value", True),
  ("v6e:2x4", "llama", "value", False),
  ("v6e:2x4", "llama", "value", True),
  ("v5e:2x4", "llama", "ref", False),
  # Here XLA once prefetched the down ring's last in-flight source into
  # VMEM for the Ref done kernel and let the original go while its DMA ran:
  # the stateful kernels now pin a separate source to HBM.
  ("v5e:2x4", "llama", "ref", True),
  # The other new forms.
  ("v5e:2x4", "ag_rows", "value", False),
  ("v5e:2x4", "ag_rows", "value", True),
  ("v5e:2x4", "ag_rows", "ref", True),
  ("v6e:2x4", "ag_rows", "value", True),
  ("v5e:2x4", "ag_contracting", "value", True),
  ("v6e:2x4", "ag_contracting", "ref", False),
  ("v5e:2x4", "rs_rows", "value", False),
  ("v5e:2x4", "rs_rows", "ref", True),
  ("v6e:2x4", "rs_rows", "value", True),
]


@pytest.mark.parametrize("topology,program,api,bidirectional", CASES)
def test_copy_free_and_overlapped(topology, program, api, bidirectional):
  r = _report(topology, program, api, bidirectional)
  check(r, program, api, bidirectional, topology)


@pytest.mark.parametrize("topology", ["v5e:2x4", "v6e:2x4"])
def test_llama_up_weights_pass_the_barrier(topology):
  """The gated MLP's one-way up ring keeps its two weights (gate and up,
  per device ``[D, F / 4]``) behind the step barriers
  (``_gather_rings.weights_barrier``): XLA prefetches neither into VMEM
  across programs and every up-projection chunk dot reads a weight's
  entry parameter (not a VMEM copy). Closed over (a single weight's
  form), v5e prefetched one of the two and tiled the step dots slower
  (4522.9 against 4314.4 us, ``design/benchmarks.md``, "The one-way value
  ring's weight")."""
  r = _report(topology, "llama", "value", False)
  entry = r.hlo_text[r.hlo_text.index("\nENTRY") :]
  params = re.findall(r"%(param\S*) = bf16\[(\d+),(\d+)\]", entry)
  ws = {p for p, a, b in params if (int(a), int(b)) == (D, F // N)}
  assert len(ws) == 2, params
  prefetch = dict(
    re.findall(
      r"%(\S+) = .*copy-start\(%(\S+)\), cross_program_prefetch_index", entry
    )
  )
  prefetched = set(prefetch.values())
  if jc.WEIGHTS_BARRIER_STOPS_PREFETCH or topology != "v5e:2x4":
    assert not prefetched & ws, f"cross-program prefetched: {prefetched & ws}"
  else:
    # jax 0.9's libtpu on v5e: one of the two prefetched (_jax_compat);
    # its dots read that read-only copy.
    assert len(prefetched & ws) == 1, prefetched & ws
  reads = {f"%{w}," for w in ws - prefetched} | {
    f"%{d},"
    for start, w in prefetch.items()
    if w in ws
    for d in re.findall(rf"%(\S+) = \S+ copy-done\(%{start}\)", entry)
  }
  dots = [
    line
    for line in entry.splitlines()
    if " fusion(" in line
    and "dot_general" in line
    and "/up/" in line
    and "chunk" in line
  ]
  assert len(dots) >= 2 * (N - 1), len(dots)
  for line in dots:
    operands = line.split(" fusion(", 1)[1].split(")", 1)[0] + ","
    assert any(r in operands for r in reads), line[:300]
  check(r, "llama", "value", False, topology)


def test_check_catches_a_matmul_outside_its_window():
  """The checker fails when one step's matmul misses its window."""
  r = _report("v5e:2x4", "rs_rows", "value", False)
  pairs = r.pairs_for("asyncops.ppermute")
  # Empty the window of one pair: the check must notice.
  broken = dataclasses.replace(pairs[0], between=())
  fake = dataclasses.replace(
    r, pairs=tuple(broken if p is pairs[0] else p for p in r.pairs)
  )
  with pytest.raises(AssertionError, match="outside its window"):
    check(fake, "rs_rows", "value", False)
