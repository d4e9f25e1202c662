"""Auto's relay pick (``"fused_fwd"``, ``AgSpec.forward``; branch
h-fwdauto) on compiled TPU programs (ahead of time, no TPU).

The relay is estimated (``_auto._fused_fwd_ag_s``) where its plan runs
one (``_fused._forwarded``) and the chip's calibration admits it
(``Cal.fused_relay``, v6e). The model (design/benchmarks.md, "Auto's
relay pick"): at the chapter's shard on v6e:2x4 (``[512, 512] x [2048,
2048]`` a device, a ring of 4) the relay is faster, 16.98 -> 14.53 us in
bf16 and 18.32 -> 17.38 in f32; on v5e:2x4 slower (30.40 -> 31.69); at
the Llama-3-70B shard at tp 4 slower on v5e and v6e (v6e M = 256 91.4
-> 95.8).
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from asyncops import collective_matmul as cm
from asyncops.collective_matmul import _auto, _fused, _wiring
from asyncops.inspect import analyze, check_hlo, parse_module
from asyncops.kernels import _allgather_matmul as agk
from tests import util as u

B, D, F = 1024, 2048, 8192
KINDS = {"v5e": "TPU v5 lite", "v6e": "TPU v6 lite", "v5p": "TPU v5p"}


def _explain(chip, m, k, f, dtype=jnp.bfloat16, **kw):
  return _auto.explain_allgather(
    m, k, f, 4, dtype, precision="DEFAULT", device_kind=KINDS[chip], **kw
  )


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_auto_relays_at_the_v6e_chapter_shard_only(dtype):
  """The chapter's shard: v6e relays (its estimate 3% under the plain
  kernel's), v5e does not (no candidate), and the reason says so."""
  m, k, f = B // 2, D // 4, F // 4
  v6e = _explain("v6e", m, k, f, dtype)
  assert v6e.method == "fused_fwd", str(v6e)
  assert v6e.fused_fwd_us < 0.97 * v6e.fused_us, str(v6e)
  assert "relay" in v6e.reason and "relayed" in str(v6e)
  v5e = _explain("v5e", m, k, f, dtype)
  assert v5e.method == "fused" and v5e.fused_fwd_us is None, str(v5e)


@pytest.mark.parametrize("chip", ["v5e", "v6e", "v5p"])
@pytest.mark.parametrize("m", [16, 64, 256, 512, 1024, 4096, 16384])
def test_auto_does_not_relay_at_the_llama_tp4_shard(chip, m):
  """The Llama-3-70B shard at tp 4 (a ring of 4): the relay is never
  picked (the model: slower where its plan runs it); where the plan
  runs one and the chip admits it (v6e, M <= 512), it is estimated and
  slower than the plain kernel."""
  c = _explain(chip, m, 8192 // 4, 28672 // 4)
  assert c.method != "fused_fwd", str(c)
  if chip == "v6e" and m <= 512:
    assert c.fused_fwd_us is not None and c.fused_fwd_us > c.fused_us
  if chip != "v6e" or m >= 1024:
    assert c.fused_fwd_us is None, str(c)


def test_relay_memory_jit():
  """``memory="jit"``: the relay's plan holds its receive buffer in VMEM
  (no HBM slots) and its second float32 accumulator (the local step's,
  a VMEM output) within ``_forwarded``'s VMEM share; auto keeps it."""
  m, k, f = B // 2, D // 4, F // 4
  c = _explain("v6e", m, k, f, memory="jit")
  assert c.method == "fused_fwd", str(c)
  kw = dict(directions=2, precision="DEFAULT", device_kind=KINDS["v6e"])
  bf = jnp.bfloat16
  plan = _fused.plan_allgather(m, k, f, 4, bf, bf, bf, **kw, forward=True)
  s = plan.spec
  assert s.forward and s.recv_vmem and plan.panels == 1
  assert _auto._ag_slots(plan) == 0
  one = agk.vmem_bytes(s.__class__(**{**s.__dict__, "forward": False}))
  assert agk.vmem_bytes(s) - one == m * f * 4  # the second accumulator
  assert agk.vmem_bytes(s) <= s.vmem_limit


def _program(topology):
  from benchmarks import _mesh  # noqa: PLC0415

  mesh = _mesh.make_mesh(topology, "ring", 4)
  specs = (P("x", "y"), P(None, "y"))
  g = jax.jit(
    jax.shard_map(
      lambda a, w: cm.allgather_matmul(a, w, "y"),
      mesh=mesh,
      in_specs=specs,
      out_specs=P("x", "y"),
    )
  )
  args = (
    u.sharded_sds(mesh, (B, D), specs[0], jnp.bfloat16),
    u.sharded_sds(mesh, (D, F), specs[1], jnp.bfloat16),
  )
  with _auto.recording() as choices:
    text = g.trace(*args).lower().compile().as_text()
  return [c.method for _, c in choices], text


def _kernels(text):
  return {
    i.name.split(".")[0]
    for i in parse_module(text).entry.instrs
    if i.opcode == "custom-call"
  }


@pytest.mark.parametrize(
  ("topology", "relayed"), [("v6e:2x4", True), ("v5e:2x4", False)]
)
def test_auto_program_runs_the_relay_it_picks(topology, relayed):
  """On the benchmark's meshes at the chapter's shape: v6e compiles the
  relay (the local-step kernel ``ring_allgather_matmul_local`` and the
  rest), v5e the one kernel; no hazard, no defensive copy."""
  methods, text = _program(topology)
  assert methods == ["fused_fwd" if relayed else "fused"], methods
  k = _kernels(text)
  assert ("ring_allgather_matmul_local" in k) == relayed, sorted(k)
  assert ("ring_allgather_matmul_rest" in k) == relayed, sorted(k)
  assert ("ring_allgather_matmul" in k) != relayed, sorted(k)
  assert ("method_fused_fwd" in text) == relayed
  assert analyze(text).defensive_copies == []
  check_hlo(text)


def test_relay_must_win_with_longer_steps():
  """On a line of 4 (``--layout line``) at v6e's Llama shard, tp 4, M =
  512, the relay's estimate is under the one kernel's (95.9 against
  109.0 us) but not with both kernels' steps ``_RELAY_STEPS`` longer;
  the model has it 1% slower (110.9 against 109.7): no relay. At ``[256,
  2048] x [8192, 2048]`` on the same line it wins both ways (the model
  53.3 -> 42.9 us in bf16): the relay."""
  line = _wiring.from_coords([[(i, 0, 0) for i in range(4)]], (False,) * 3)
  c = _explain("v6e", 512, 8192 // 4, 28672 // 4, wiring=line)
  assert c.method == "fused" and c.fused_fwd_us < c.fused_us, str(c)
  c = _explain("v6e", 256, 2048, 2048, wiring=line)
  assert c.method == "fused_fwd", str(c)
