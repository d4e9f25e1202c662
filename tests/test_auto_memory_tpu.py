"""Auto's memory rule for the all-gather matmul, on compiled TPU programs
(ahead of time, v5e and v5p; no wall time).

Where the value rings hold a float32 accumulator of 64 MiB or more in one
panel, over the memory target (jit's temporaries plus one chunk's send and
receive buffers, in the buffer assignment's HBM bytes), ``method="auto"``
runs the fused kernel if it is estimated 3% under XLA's program, though a
ring is estimated faster (``_auto._ag_memory``). On a ring of 4, per
device ``x [4096, 1024]``, ``w [4096, 7168]`` on v5e (a 112 MiB
accumulator, 8 MiB chunks; the one-way ring estimated 1442 us against the
fused kernel's 1504 until branch h-agrefit, 1291 since: time picks it
there now) and ``x [4096, 2048]``, ``w [8192, 4096]`` on v5p
(64 MiB, 16 MiB chunks; the two-way ring 685 against 981), the rule takes
the fused kernel: its program holds no value-ring transfer and its HBM
temporaries are at most its ``n - 1`` received chunks, within the rule's
limit (``n + 1`` chunks: jit's all-gather's ``n - 1`` and one chunk's two
buffers), where the two-way ring's hold the accumulator. The rule's
premise is XLA's memory-space assignment's: at smaller weights it keeps
the rings' accumulator in VMEM (per device ``x [8192, 512]``, ``w [2048,
2048]``, 64 MiB: the two-way ring 0.08 MiB of HBM temporaries on v5e, the
fused kernel 24.1, jit 0.0), as on v6e at the sizes measured
(``Cal.ring_acc_hbm``, off there).
"""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from asyncops.collective_matmul import _auto, allgather_matmul
from benchmarks import _measure, _mesh

# topology -> per device (M, K, F): x [M, K], w [N K, F].
SHAPES = {"v5e:2x4": (4096, 1024, 7168), "v5p:2x2x2": (4096, 2048, 4096)}
N = 4


def _sizes(topology, shape=None):
  """One chunk of ``x`` (bf16) and the rings' float32 accumulator."""
  m, k, f = shape or SHAPES[topology]
  return m * k * 2, m * f * 4


def _lowered(topology, body, shape=None):
  m, k, f = shape or SHAPES[topology]
  mesh = _measure.mesh_for(topology, "ring", N)
  specs = (P(None, "y"), P(None, "y"))
  args = (
    jax.ShapeDtypeStruct(
      (m, N * k), jnp.bfloat16, sharding=NamedSharding(mesh, specs[0])
    ),
    jax.ShapeDtypeStruct(
      (N * k, N * f), jnp.bfloat16, sharding=NamedSharding(mesh, specs[1])
    ),
  )
  fn = jax.jit(
    jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(None, "y"))
  )
  with _auto.recording() as choices, _mesh.quiet_fd2():
    lowered = fn.trace(*args).lower()
  return lowered, choices


@functools.cache
def _compile(topology, method, shape=None):
  """``(choices, HLO text, HBM temporary bytes)`` of one program (at
  ``shape``, per device ``(M, K, F)``; default ``SHAPES[topology]``)."""
  body = functools.partial(
    allgather_matmul,
    axis_name="y",
    method=method,
    bidirectional=method == "ring",
  )
  lowered, choices = _lowered(topology, body, shape)
  compiled, assignment = _measure.compile_with_assignment(lowered)
  alloc = _measure.peak_alloc_bytes(_measure.assignment_temps(assignment))
  return choices, compiled.as_text(), alloc


@pytest.fixture(scope="module", params=sorted(SHAPES))
def topology(request):
  return request.param


def test_auto_takes_the_fused_kernel_for_memory(topology):
  choices, text, alloc = _compile(topology, "auto")
  [(_, c)] = choices
  assert c.method == "fused", str(c)
  if topology == "v5e:2x4":
    # Since branch h-agrefit (no accumulator pass in the fused estimate)
    # the fused kernel is estimated the fastest here (1291.4 us against
    # the one-way ring's 1442.0), as the benchmark model has it (1350.8
    # against 1550.9 and the two-way ring's 1543.3: `--topology v5e:2x4
    # --shape 8192,4096,28672 --configs bfloat16 --families allgather`),
    # so time picks it, not the memory rule.
    assert c.fused_us < min(c.ring_us, c.ring_bidi_us), str(c)
  elif min(c.ring_us, c.ring_bidi_us) < c.fused_us:
    # A ring estimated faster: the memory rule takes the fused kernel.
    assert "within the memory target" in c.reason, str(c)
  else:
    # Since branch h-agest (the fused estimate charges the last half-step
    # only after the last arrival) v5p's fused kernel is estimated the
    # fastest here (712.2 us against the two-way ring's 757.6), so time
    # picks it and the rule has nothing to overrule.
    assert "memory" not in c.reason, str(c)
  assert c.fused_us < 0.97 * c.xla_us, str(c)
  # The fused kernel's program: its ring kernels, no value-ring transfer.
  assert "allgather_matmul" in text
  assert "asyncops_bidirectional_start" not in text
  assert "asyncops_ppermute_start" not in text
  # Within the rule's limit, n + 1 chunks (jit's all-gather's n - 1 in
  # HBM, two more): at most the n - 1 received chunks.
  chunk, _ = _sizes(topology)
  assert alloc <= (N - 1) * chunk + 2**20, alloc


def test_the_two_way_ring_is_over_the_target(topology):
  # What the rule avoids: the two-way ring holds its accumulator in HBM.
  _, text, alloc = _compile(topology, "ring")
  assert "asyncops_bidirectional_start" in text
  chunk, acc = _sizes(topology)
  assert alloc >= acc, alloc
  assert alloc > (N + 1) * chunk + acc / 2, alloc


# Where the rule overrules time (branch h-agslots: at ``SHAPES`` time picks
# the fused kernel on both chips since h-agrefit / h-agest, so the rule
# fired at no compiled shape): v5p, per device ``x [8192, 1024]``, ``w
# [4096, 2048]`` (a 64 MiB accumulator, 16 MiB chunks; estimated: the
# two-way ring 413.1 us, the fused kernel 633.6, XLA's program 856.6).
SPILL = ("v5p:2x2x2", (8192, 1024, 2048))


def test_the_rule_overrules_a_faster_ring():
  topology, shape = SPILL
  [(_, c)], text, alloc = _compile(topology, "auto", shape)
  assert c.method == "fused", str(c)
  assert min(c.ring_us, c.ring_bidi_us) < c.fused_us, str(c)
  assert "within the memory target" in c.reason, str(c)
  assert "asyncops_bidirectional_start" not in text
  chunk, acc = _sizes(topology, shape)
  # Within the rule's limit (n + 1 chunks); the two-way ring is over it.
  assert alloc <= (N + 1) * chunk, alloc / 2**20
  _, ring_text, ring = _compile(topology, "ring", shape)
  assert "asyncops_bidirectional_start" in ring_text
  assert ring > (N + 1) * chunk, ring / 2**20
  # The benchmark model agrees with the rule's premise (the ring it drops
  # is faster) but prices the trade at 8.8%, not the estimates' 55%
  # (fused 488.5 us against the two-way ring's 448.9; design/benchmarks.md,
  # "The model's answer"): the rule must not cost more than 15%.
  fused_us, ring_us = (_modelled(topology, t) for t in (text, ring_text))
  assert ring_us < fused_us < 1.15 * ring_us, (fused_us, ring_us)


def _modelled(topology, text):
  """The benchmark model's step time (us) of a program on the ring."""
  spec = _measure.Spec("model", topology, N, (0, 0, 0), jnp.bfloat16)
  return _measure.simulate(text, spec).step_s * 1e6
