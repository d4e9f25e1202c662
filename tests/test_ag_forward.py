"""The fused all-gather's relay of the antipode's halves
(``AgSpec.forward``), in Pallas's TPU interpreter on CPU devices: the
start sends each half to both neighbours only, and after the local step
each device sends slot 0 of each direction on to the next neighbour (its
slot 2). Exact against ``jnp.dot``, every DMA waited for (the relay's
sends too), no race. The compiled TPU program is in
``test_ag_forward_tpu.py``."""

import dataclasses

import jax.numpy as jnp
import pytest

from asyncops.kernels import _allgather_matmul as agk
from tests import test_fused_matmul as tf
from tests import util as u


@pytest.mark.parametrize(
  "dtype,steps,tail,bn",
  [
    ("bfloat16", None, None, 128),
    ("float32", (1, 2, 1), 1, 128),
    ("bfloat16", (1, 1, 2), 1, 256),
    ("bfloat16", (1, 3), None, 128),
  ],
)
def test_relayed_antipode_halves(dtype, steps, tail, bn, capfd):
  n = 4
  dtype = jnp.dtype(dtype)
  a = tf._ints((32, n * 256), dtype, 30)
  w = tf._ints((n * 256, n * 128 * 4), dtype, 31)

  def body(x, y):
    name = dtype.name
    spec = tf._ag_spec(
      n,
      x,
      y,
      name,
      name,
      name,
      2,
      steps=steps,
      tail=tail,
      bn=bn,
      recv_vmem=True,
      forward=True,
    )
    assert spec.fwd_slot == 2 and spec.hops == (1, 3, 2)
    assert spec.scope.endswith("_fwd") and spec.hops_scope.endswith("_fwd")
    return tf._one_kernel(agk, x, y, spec, y.shape[1], dtype)

  tf._assert_panels_equal_dot(body, a, w, n, capfd)


@pytest.mark.parametrize(
  "kw",
  [
    dict(n=8),
    dict(directions=1),
    dict(recv_vmem=False),
    dict(split=True, tail=1),
  ],
)
def test_forward_refuses_other_rings(kw):
  base = dict(
    axis_name="y",
    mesh_axes=("y",),
    n=4,
    m=16,
    k=256,
    f=512,
    dtype="bfloat16",
    w_dtype="bfloat16",
    out_dtype="bfloat16",
    bn=128,
    recv_vmem=True,
    forward=True,
  )
  with pytest.raises(ValueError, match="forward"):
    agk.AgSpec(**{**base, **kw})
  assert agk.AgSpec(**{**base, "forward": False, **kw}).fwd_slot == -1


@pytest.mark.parametrize("device_kind", ["TPU v5 lite", "TPU v6 lite"])
def test_plan_relays_where_asked_and_it_applies(device_kind):
  """``plan_allgather(forward=True)`` relays at the chapter's shard (a
  4-ring, one panel, the buffer in VMEM, no split; the accumulator
  counted twice), and leaves an 8-ring, int8 transfers and an unasked
  plan as they were."""

  def plan(n=4, forward=True, **kw):
    return u.chapter_ag_plan(device_kind, n, forward=forward, **kw).spec

  fwd, base = plan(), plan(forward=False)
  assert fwd.forward and fwd.recv_vmem and not (fwd.split or fwd.recv_in_out)
  assert not base.forward
  one = dataclasses.replace(fwd, forward=False)
  assert agk.vmem_bytes(fwd) - agk.vmem_bytes(one) == 512 * 2048 * 4
  assert not plan(n=8).forward
  assert not plan(quantized=True).forward
