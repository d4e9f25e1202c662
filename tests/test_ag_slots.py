"""The fused all-gather's receive buffer in VMEM (``AgSpec.recv_vmem``),
in Pallas's TPU interpreter on CPU devices: the peers' chunks land in a
VMEM output of the start and the compute kernel reads each unit's half
in place (no copy into a chunk buffer). Exact against ``jnp.dot`` (the
dequantized product for int8 transfers), every DMA waited for, no race;
and where ``_fused.plan_allgather`` chooses it. The compiled TPU program
is in ``test_ag_slots_tpu.py``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from asyncops import _jax_compat as jc
from asyncops.collective_matmul import _fused
from asyncops.kernels import _allgather_matmul as agk
from tests import test_fused_matmul as tf
from tests import util as u


@pytest.mark.parametrize(
  "mesh_shape,directions,dtype,steps,tail,bn,split",
  [
    ((1, 4), 2, "bfloat16", None, None, 128, False),
    ((1, 4), 2, "float32", (1, 2, 1), 1, 128, False),
    ((2, 3), 1, "bfloat16", (1, 2), None, 128, False),
    ((1, 4), 2, "bfloat16", (1, 1, 2), 1, 256, False),
    # The split last half: its second piece waited for in place.
    ((1, 4), 2, "bfloat16", None, 1, 256, True),
    ((1, 4), 1, "bfloat16", (1, 2, 1), 3, 256, True),
  ],
)
def test_units_read_in_the_vmem_receive_buffer(
  mesh_shape, directions, dtype, steps, tail, bn, split, capfd
):
  x_n, n = mesh_shape
  dtype = jnp.dtype(dtype)
  a = tf._ints((32 * x_n, n * 256), dtype, 20)
  w = tf._ints((n * 256, n * 128 * 4), dtype, 21)

  def body(x, y):
    name = dtype.name
    spec = tf._ag_spec(
      n,
      x,
      y,
      name,
      name,
      name,
      directions,
      steps=steps,
      tail=tail,
      bn=bn,
      split=split,
      recv_vmem=True,
    )
    return tf._one_kernel(agk, x, y, spec, y.shape[1], dtype)

  tf._assert_panels_equal_dot(body, a, w, n, capfd, mesh_shape)


def test_int8_units_and_scales_read_in_vmem(capfd):
  """int8 chunks and their per-row scales both land in VMEM: the product
  equals the dequantize-then-matmul reference."""
  n, directions = 4, 2
  rng = np.random.default_rng(22)
  a = jnp.asarray(rng.normal(size=(16, n * 256)), jnp.float32)
  w = tf._ints((n * 256, n * 256), jnp.bfloat16, 23)

  def body(x, y):
    spec = tf._ag_spec(
      n,
      x,
      y,
      "int8",
      "bfloat16",
      "float32",
      directions,
      quantized=True,
      recv_vmem=True,
    )
    q, scales = _fused.quantize(x, directions)
    return tf._one_kernel(
      agk, q, y, spec, y.shape[1], jnp.float32, scales=scales
    )

  def reference(x, y):
    deq = _fused.dequantize(*_fused.quantize(x, directions))
    g = jax.lax.all_gather(deq, "y", axis=1, tiled=True)
    return jnp.dot(
      g, y.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
    )

  def run(fn):
    return u.run_sharded(
      fn,
      u.cpu_mesh((1, n)),
      (P("x", "y"), P(None, "y")),
      P("x", "y"),
      a,
      w,
      check_vma=False,
    )

  got, want = np.asarray(run(body)), np.asarray(run(reference))
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-3)
  tf._check_interpreter_output(capfd)


def test_vmem_buffer_replaces_the_chunk_buffers():
  """``vmem_bytes`` counts the receive buffer in place of the chunk double
  buffer; the VMEM form refuses ``recv_in_out`` (the slots are one or the
  other)."""
  kw = dict(directions=2, bn=512, steps=(1,) * 8)
  s = agk.AgSpec(
    "y", ("y",), 8, 256, 1024, 3584, "bfloat16", "bfloat16", "bfloat16", **kw
  )
  vm = agk.AgSpec(
    "y",
    ("y",),
    8,
    256,
    1024,
    3584,
    "bfloat16",
    "bfloat16",
    "bfloat16",
    recv_vmem=True,
    **kw,
  )
  chunks = 2 * 1 * 256 * 1024 * 2
  assert agk.recv_bytes(vm) == 7 * 256 * 1024 * 2
  assert agk.vmem_bytes(vm) - agk.vmem_bytes(s) == agk.recv_bytes(vm) - chunks
  assert agk.recv_vmem_limit(vm) is None  # 3.5 MiB: XLA's default limit
  with pytest.raises(ValueError, match="recv_vmem and recv_in_out"):
    agk.AgSpec(
      "y",
      ("y",),
      4,
      16,
      256,
      1024,
      "bfloat16",
      "bfloat16",
      "bfloat16",
      recv_vmem=True,
      recv_in_out=True,
    )


CHIP = {"v5e": "TPU v5 lite", "v6e": "TPU v6 lite", "v5p": "TPU v5p"}


def _llama_plan(chip, n, m):
  bf = jnp.bfloat16
  return _fused.plan_allgather(
    m,
    8192 // n,
    28672 // n,
    n,
    bf,
    bf,
    bf,
    directions=2,
    precision="DEFAULT",
    device_kind=CHIP[chip],
  )


@pytest.mark.parametrize("chip", ["v5e", "v6e", "v5p"])
@pytest.mark.parametrize("m", [16, 64, 256, 1024])
def test_plan_puts_the_llama_tp8_buffer_in_vmem(chip, m):
  """The Llama-3-70B shard at tp 8 (``(n - 1) k`` wider than ``f``: the
  slots cannot be the result's rows): one panel, the buffer in VMEM, the
  compute kernel's limit covering it."""
  plan = _llama_plan(chip, 8, m)
  assert plan.panels == 1 and plan.spec.recv_vmem
  assert not plan.spec.recv_in_out
  assert plan.spec.vmem_limit >= agk.vmem_bytes(plan.spec)


@pytest.mark.parametrize(
  "chip,n,m,why",
  [
    ("v5e", 8, 2048, "over _RECV_VMEM_BYTES (28 MiB)"),
    ("v6e", 8, 4096, "row panels"),
    ("v5e", 4, 256, "recv_in_out"),
    ("v6e", 4, 1024, "recv_in_out"),
  ],
)
def test_plan_keeps_the_hbm_buffer_elsewhere(chip, n, m, why):
  plan = _llama_plan(chip, n, m)
  assert not plan.spec.recv_vmem, why


def test_plan_keeps_the_hbm_buffer_over_the_vmem_share():
  """v4 (16 MiB of VMEM): the Llama tp 8 M = 256 buffer (3.5 MiB) in place
  of the chunk buffers would take the compute kernel over the chip's
  share, so the buffer stays in HBM."""
  bf = jnp.bfloat16
  plan = _fused.plan_allgather(
    256,
    1024,
    3584,
    8,
    bf,
    bf,
    bf,
    directions=2,
    precision="DEFAULT",
    device_kind="TPU v4",
  )
  vm = agk.AgSpec(**{**plan.spec.__dict__, "recv_vmem": True})
  share = _fused.vmem_capacity("TPU v4") * _fused._VMEM_SHARE
  assert agk.vmem_bytes(plan.spec) <= share < agk.vmem_bytes(vm)
  assert not plan.spec.recv_vmem


@pytest.mark.parametrize("recv_vmem", [True, False])
def test_start_types_its_receive_buffers_as_x_varies(recv_vmem):
  """The start's receive outputs, declared by memory space
  (``pltpu.VMEM`` or HBM: no manual axes), leave it typed as varying over
  ``x``'s manual axes (``_common.vary_like``, branch h-ag09). jax 0.9
  types the compute kernel's refs by their operands' axes: untyped, its
  ``lax.cond`` between a read of ``x`` and one of the VMEM buffer failed
  there ("cond branches must have equal output types"), and the buffer
  was kept in HBM on 0.9."""
  mesh = u.cpu_mesh((2, 4))
  bf = "bfloat16"
  spec = agk.AgSpec(
    "y", ("x", "y"), 4, 16, 256, 512, bf, bf, bf, recv_vmem=recv_vmem
  )
  seen = {}

  def body(x):
    recvs, _, _ = agk.start((x,), spec=spec)
    seen["x"] = jc.varying_axes(x)
    seen["recv"] = [jc.varying_axes(r) for r in recvs]
    return x

  x = jax.ShapeDtypeStruct(
    (32, 1024), jnp.bfloat16, sharding=jax.NamedSharding(mesh, P("x", "y"))
  )
  jax.jit(
    jax.shard_map(body, mesh=mesh, in_specs=P("x", "y"), out_specs=P("x", "y"))
  ).trace(x)
  assert seen["x"] == {"x", "y"}
  assert seen["recv"] == [{"x", "y"}]
