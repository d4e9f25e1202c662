"""``memory="jit"``: ``method="auto"`` counts the fused kernels' HBM receive
slots against the issue's memory target (jit's temporaries plus one
chunk's send and receive buffers, the benchmark's ``peak_alloc_mib``) and
picks the fastest candidate within it; the default (``"fastest"``) picks
by time as before. Estimates (no compile) at the Llama-3-70B sweep
points, the argument's check, and compiled TPU programs on v5e and v6e
against jit's buffer assignment."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from asyncops.collective_matmul import (
  _auto,
  _fused,
  allgather_matmul,
  matmul_allreduce,
  matmul_reducescatter,
  mlp_block,
)
from benchmarks import _measure, _mesh, _variants
from tests import util as u

CHIP = {"v5e": "TPU v5 lite", "v6e": "TPU v6 lite", "v5p": "TPU v5p"}
FUSED = ("fused", "fused_uni")


def _llama(family, chip, n, m, **kw):
  """auto's explanation for the Llama-3-70B MLP shard (D 8192, F 28672) at
  tp ``n``, ``m`` rows per device, ``"ag"`` or ``"rs"``."""
  kw = dict(precision="DEFAULT", device_kind=CHIP[chip], **kw)
  if family == "ag":
    return _auto.explain_allgather(
      m, 8192 // n, 28672 // n, n, jnp.bfloat16, **kw
    )
  return _auto.explain_reducescatter(
    m, 28672 // n, 8192 // n, n, jnp.bfloat16, **kw
  )


def _slots(family, chip, n, m):
  """The fused kernel's receive slots and chunk (bytes), from its plan."""
  kw = dict(precision="DEFAULT", device_kind=CHIP[chip])
  bf = jnp.bfloat16
  if family == "ag":
    plan = _fused.plan_allgather(
      m, 8192 // n, 28672 // n, n, bf, bf, bf, directions=2, **kw
    )
    return _auto._ag_slots(plan), m * (8192 // n) * 2
  plan = _fused.plan_reducescatter(
    m, 28672 // n, 8192 // n, n, bf, bf, directions=2, **kw
  )
  return _auto._rs_slots(plan), m * (8192 // n) * 2


def _weight_bound(family, chip, n, m):
  """The matmul is bound by its weight read (auto's ``C < M``: its FLOPs
  at the bf16 peak against the bytes it must move at HBM bandwidth)."""
  ch = _auto.CHIPS[chip]
  k, f = (8192 // n, 28672 // n) if family == "ag" else (28672 // n, 8192)
  x = n * m * k if family == "ag" else m * k
  out = m * f if family == "ag" else m * f // n
  flops = 2 * m * k * f * (n if family == "ag" else 1)
  w = n * k * f if family == "ag" else k * f
  return flops / ch.bf16_flops < 2 * (w + x + out) / ch.hbm


# The 20 points where the benchmark (branch h-tables) found auto's fused
# kernel over the target (its receive slots, [2, n - 1, m, k / 2], in HBM;
# jit at 0.13 to 0.27 MiB there). Since branch h-agslots the all-gather's
# six (tp 8, M = 16 to 256) hold their slots in VMEM (``AG_VMEM``), and
# since branch h-rsslots the reduce-scatter's 14 do too (tp 4 M = 1024
# since branch h-rsvmem, ``RsSpec.recv_vmem``): the tests of the rule
# force them into HBM (``_hbm_slots``).
OVER = [
  (chip, fam, n, m)
  for chip in ("v5e", "v6e")
  for fam, n, ms in (
    ("rs", 8, (16, 64, 256, 1024)),
    ("rs", 4, (64, 256, 1024)),
  )
  for m in ms
]
AG_VMEM = [(chip, "ag", 8, m) for chip in ("v5e", "v6e") for m in (16, 64, 256)]


def _hbm_slots(monkeypatch):
  """The reduce-scatter plans with their receive buffer in HBM, as before
  branch h-rsslots (no VMEM share for it)."""
  monkeypatch.setattr(_fused, "_RECV_VMEM_SHARE", 0.0)


@pytest.mark.parametrize("chip,fam,n,m", OVER)
def test_jit_drops_the_fused_kernel_over_the_target(
  chip, fam, n, m, monkeypatch
):
  _hbm_slots(monkeypatch)
  c = _llama(fam, chip, n, m, memory="jit")
  slots, chunk = _slots(fam, chip, n, m)
  assert _auto._slots_over(_auto.CHIPS[chip], n, chunk, slots) is not None
  assert c.method not in FUSED, c
  assert "memory target" in c.reason and "receive slots" in c.reason
  assert c.fused_us is not None  # the estimate is kept, shown
  if _weight_bound(fam, chip, n, m):
    # Dropped for its slots alone and bound by the weight read: XLA's
    # program, not a value ring (h-memrule ran the rings at tp 8 AG M =
    # 256: 1.026x and 1.363x of xla_best).
    assert c.method == "xla", c
    assert "value rings are no candidates" in c.reason, c


@pytest.mark.parametrize("chip,fam,n,m", OVER)
def test_the_default_picks_by_time_there(chip, fam, n, m):
  """The default is speed-first: the fused kernel, as before the option."""
  c = _llama(fam, chip, n, m)
  assert c == _llama(fam, chip, n, m, memory="fastest")
  assert c.method in FUSED, c
  assert "memory target" not in c.reason


# All 14 since branch h-rsvmem (tp 4 M = 1024: 87.25 MiB of VMEM with its
# buffer; 117.25 before, over ``_fused._RECV_VMEM_SHARE``, kept it in HBM).
OVER_RS = [p for p in OVER if p[1] == "rs"]


@pytest.mark.parametrize("chip,fam,n,m", OVER_RS)
def test_jit_keeps_the_fused_reducescatter_with_slots_in_vmem(chip, fam, n, m):
  """Branch h-rsslots: at 12 of the reduce-scatter's 14 points (all 14
  since branch h-rsvmem) the plan holds the receive buffer in VMEM, so no
  HBM slots are counted
  (``_auto._rs_slots``, from the kernel's ``recv_hbm_bytes``) and
  ``"jit"`` keeps the default's fused kernel, estimate and reason."""
  kw = dict(precision="DEFAULT", device_kind=CHIP[chip])
  bf = jnp.bfloat16
  plan = _fused.plan_reducescatter(
    m, 28672 // n, 8192 // n, n, bf, bf, directions=2, **kw
  )
  assert plan.spec.recv_vmem, plan
  slots, chunk = _slots(fam, chip, n, m)
  assert slots == 0
  assert _auto._slots_over(_auto.CHIPS[chip], n, chunk, slots) is None
  c = _llama(fam, chip, n, m, memory="jit")
  assert c.method in FUSED, c
  # The one-way kernel's estimate is dropped where its own plan's slots
  # are in HBM (the next test); nothing else differs.
  fast = _llama(fam, chip, n, m)
  uni = dict(fused_uni_us=None)
  assert dataclasses.replace(c, **uni) == dataclasses.replace(fast, **uni)
  assert "memory target" not in c.reason


def test_jit_drops_a_one_way_kernel_with_hbm_slots(monkeypatch):
  """The one-way kernel's own plan (a wider ``w`` block, more scoped VMEM)
  may keep its receive buffer in HBM where the two-way kernel's is in
  VMEM: at the Llama shard's tp 8, M = 1024 on v5e with the share set
  between the two (66.0 and 69.75 MiB of 128 with their tight scoped
  limits, ``rsk.steps_vmem_limit``), under ``"jit"`` the one-way kernel
  is no candidate (no estimate), the two-way kernel is."""
  monkeypatch.setattr(_fused, "_RECV_VMEM_SHARE", 68 / 128)
  kw = dict(precision="DEFAULT", device_kind=CHIP["v5e"])
  bf = jnp.bfloat16
  args = (1024, 28672 // 8, 8192 // 8, 8, bf, bf)
  two = _fused.plan_reducescatter(*args, directions=2, **kw)
  one = _fused.plan_reducescatter(*args, directions=1, **kw)
  assert two.spec.recv_vmem and not one.spec.recv_vmem
  assert _auto._rs_slots(one) > 4 * 2**20
  fast = _llama("rs", "v5e", 8, 1024)
  assert fast.fused_uni_us is not None
  c = _llama("rs", "v5e", 8, 1024, memory="jit")
  assert c.method == "fused" and c.fused_uni_us is None, c


@pytest.mark.parametrize(
  "chip,fam,n,m",
  AG_VMEM
  + [
    # The all-gather's chunks land in the result (``recv_in_out``): none.
    ("v5e", "ag", 4, 256),
    ("v6e", "ag", 4, 1024),
    # Three slots of 16 rows (0.19 MiB) within jit's 0.09 plus 0.13.
    ("v5e", "rs", 4, 16),
    # Row panels: 4 panels' 7 slots of 1024 rows, 14 MiB within 16.1.
    ("v5e", "rs", 8, 4096),
    # v5p's jit holds its collective's n - 1 chunks (3 to 11 measured).
    ("v5p", "rs", 4, 256),
    ("v5p", "ag", 8, 256),
  ],
)
def test_jit_keeps_the_fused_kernel_within_the_target(chip, fam, n, m):
  c = _llama(fam, chip, n, m, memory="jit")
  slots, chunk = _slots(fam, chip, n, m)
  over = _auto._slots_over(_auto.CHIPS[chip], n, chunk, slots)
  assert over is None
  assert c.method in FUSED, c
  assert c == _llama(fam, chip, n, m)


@pytest.mark.parametrize(
  "chip,fam,n,m",
  [
    # The fused kernel over the target (28 MiB of slots in HBM): the
    # two-way ring by time. (v6e M = 512 and M = 1024, here until branch
    # h-agslots, hold their 7 and 14 MiB of slots in VMEM.)
    ("v5e", "ag", 8, 2048),
    ("v6e", "ag", 8, 2048),
  ],
)
def test_jit_keeps_a_faster_pick_that_is_not_fused(chip, fam, n, m):
  """Only a fused pick over the target moves: a value ring (one chunk's
  buffers) picked by time stays, with its reason."""
  c = _llama(fam, chip, n, m)
  slots, chunk = _slots(fam, chip, n, m)
  assert _auto._slots_over(_auto.CHIPS[chip], n, chunk, slots) is not None
  assert c.method.startswith("ring"), c
  assert _llama(fam, chip, n, m, memory="jit") == c


def test_allreduce_follows_its_reduce_scatter(monkeypatch):
  """v5e tp 8 M = 1024: with its receive buffer in VMEM (the plan's since
  branch h-rsslots) the fused reduce-scatter half is within the target
  and ``"jit"`` keeps the default's pick; forced into HBM it is over:
  XLA's all-reduce, the reason says why."""
  kw = dict(precision="DEFAULT", device_kind=CHIP["v5e"])
  args = (1024, 28672 // 8, 8192, 8, jnp.bfloat16)
  fast = _auto.explain_allreduce(*args, **kw)
  assert _auto.explain_allreduce(*args, memory="jit", **kw) == fast
  _hbm_slots(monkeypatch)
  c = _auto.explain_allreduce(*args, memory="jit", **kw)
  assert c.method == "xla", c
  assert "receive slots" in c.reason, c
  assert "receive slots" not in _auto.explain_allreduce(*args, **kw).reason


def test_slots_reason_names_the_figures():
  why = _auto._slots_over(_auto.CHIPS["v5e"], 8, 2 * 2**20, 14 * 2**20)
  assert "14.00 MiB" in why and "4.09 MiB" in why


def _cpu_mesh():
  return jax.make_mesh((8,), ("y",), axis_types=(jax.sharding.AxisType.Auto,))


CALLS = {
  "allgather_matmul": (
    lambda x, w, mem: allgather_matmul(x, w, "y", memory=mem),
    (P(None, "y"), P(None, "y")),
    ((16, 64), (64, 32)),
  ),
  "matmul_reducescatter": (
    lambda x, w, mem: matmul_reducescatter(x, w, "y", memory=mem),
    (P(None, "y"), P("y", None)),
    ((16, 64), (64, 32)),
  ),
  "matmul_allreduce": (
    lambda x, w, mem: matmul_allreduce(x, w, "y", memory=mem),
    (P(None, "y"), P("y", None)),
    ((16, 64), (64, 32)),
  ),
  "mlp_block": (
    lambda x, w, mem: mlp_block(x, w, w.T, "y", memory=mem),
    (P(None, "y"), P(None, "y")),
    ((16, 64), (64, 64)),
  ),
}


@pytest.mark.parametrize("fn", sorted(CALLS))
@pytest.mark.parametrize("value", ["low", "JIT", None, 1])
def test_unknown_memory_refused(fn, value):
  body, specs, shapes = CALLS[fn]
  mesh = _cpu_mesh()
  f = jax.jit(
    jax.shard_map(
      functools.partial(body, mem=value),
      mesh=mesh,
      in_specs=specs,
      out_specs=P(),
      check_vma=False,
    )
  )
  args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
  with pytest.raises(ValueError, match=r"memory must be one of") as e:
    f.trace(*args)
  assert f"{fn}: memory" in str(e.value)
  assert "'fastest', 'jit'" in str(e.value)


# Compiled: tp 8 at M = 256 rows per device, where the fused kernels held
# 3.55 MiB of receive slots against jit's 0.13 to 0.27 plus a chunk's two
# buffers (1.0 MiB). The reduce-scatter is bound by its weight read there:
# with "jit" XLA's program, not a value ring; the all-gather's slots are in
# VMEM since branch h-agslots (0.05 MiB of HBM temporaries).
SHAPE = (256, 8192, 28672)
TP = 8
CHUNK = 256 * (8192 // TP) * 2
FAMILY = {
  "ag": ("jit", "allgather_matmul_auto"),
  "rs": ("reducescatter:jit", "reducescatter:asyncops_auto"),
}


@functools.cache
def _alloc(family, topology, memory):
  """``(auto's choices, HBM temporary bytes)``; ``memory`` None: jit's."""
  jit_name, auto_name = FAMILY[family]
  mesh = _measure.mesh_for(topology, "ring", TP)
  args = _variants.abstract_args(auto_name, mesh, SHAPE, jnp.bfloat16)
  if memory is None:
    fn = _variants.build(jit_name, mesh)
    args = _variants.abstract_args(jit_name, mesh, SHAPE, jnp.bfloat16)
  elif family == "ag":
    fn = u.allgather_jit(mesh, memory=memory)
  else:
    fam = _variants.FAMILIES["reducescatter"]
    fn = jax.jit(
      jax.shard_map(
        functools.partial(matmul_reducescatter, axis_name="y", memory=memory),
        mesh=mesh,
        in_specs=fam.in_specs,
        out_specs=fam.out_spec,
      )
    )
  with _auto.recording() as choices, _mesh.quiet_fd2():
    lowered = fn.trace(*args).lower()
  _, text = _measure.compile_with_assignment(lowered)
  return choices, _measure.peak_alloc_bytes(_measure.assignment_temps(text))


@pytest.mark.parametrize("family", ["ag", "rs"])
@pytest.mark.parametrize("topology", ["v5e:2x4", "v6e:2x4"])
def test_default_and_jit_within_jit_plus_a_chunk(topology, family):
  """Since branches h-agslots and h-rsslots both fused kernels hold their
  receive slots in VMEM here, so the default's fused kernel is within
  jit's plus a chunk's two buffers (it held 3.55 / 3.56 MiB against 1.13
  to 1.27), and ``"jit"`` runs the same fused kernel."""
  _, jit = _alloc(family, topology, None)
  assert jit < CHUNK  # jit holds no chunks or partial sums here
  for memory in ("fastest", "jit"):
    [(_, c)], alloc = _alloc(family, topology, memory)
    assert c.method in FUSED, (memory, c)
    assert alloc <= jit + 2 * CHUNK, (memory, alloc / 2**20, jit / 2**20)
