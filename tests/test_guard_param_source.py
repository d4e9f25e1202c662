"""A transfer's source that is the caller's buffer (design/inspect.md, "A
parameter is live for the whole program (branch h-srcpin)").

On v6e XLA prefetches the fused all-gather's ``x`` into VMEM for its done
kernel when ``x`` is an entry parameter: the done takes the VMEM copy, and
the DMAs read the parameter in HBM. The guard called that source "not
live" (and, from M = 256 rows, the prefetch an "in-flight copy"), so
``asyncops.jit`` refused the default ``allgather_matmul`` on v6e with a
parameter ``lhs``. An entry parameter the module neither aliases to an
output nor takes as a donor is the caller's buffer, live for the whole
program: the guard now accepts both. A donated ``x`` stays refused (XLA
may hand a donor's buffer to an output), and so does the same HLO with an
``input_output_alias`` on ``x``. Structure on compiled TPU HLO (v6e, where
XLA makes the copy; v5e and v5p, where it does not); numerics on 8 CPU
devices against ``jnp.dot``.

Since branch h-agpin the fused all-gather pins ``x`` to HBM for its three
kernels (``kernels._allgather_matmul.pinned``): XLA no longer makes that
copy, the done takes the parameter itself and a donated ``x`` is accepted
on v6e too. The guard's rules above are tested on the program as it was
compiled before (``unpinned``: the pin undone while lowering), which is
what XLA does to a transfer's source it may place freely.
"""

import functools
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import asyncops
from asyncops.collective_matmul import allgather_matmul
from asyncops.inspect import analyze, hazards, parse_module, tpu_mesh
from asyncops.inspect._hlo import _donated_params
from asyncops.kernels import _allgather_matmul as agk
from tests import util as u

D, F = 8192, 28672
TOPOLOGIES = {"v6e": "v6e:2x4", "v5e": "v5e:2x4", "v5p": "v5p:2x2x2"}


def _step(x, w, *, produced):
  if produced:
    x = x * 2
  return allgather_matmul(x, w, "i", method="fused")


@functools.cache
def _hlo(chip, m, x_input, unpinned=False):
  """Compiled HLO text; ``unpinned``: lowered with ``agk.pinned`` undone
  (the fused all-gather's ``x`` free for XLA to place, as before branch
  h-agpin)."""
  if unpinned:
    with mock.patch.object(agk, "pinned", lambda xs: xs):
      return _compile(chip, m, x_input)
  return _compile(chip, m, x_input)


def _compile(chip, m, x_input):
  mesh = tpu_mesh(TOPOLOGIES[chip], (8,), ("i",))
  spec = P(None, "i")
  fn = jax.jit(
    jax.shard_map(
      functools.partial(_step, produced=x_input == "produced"),
      mesh=mesh,
      in_specs=(spec, spec),
      out_specs=spec,
      check_vma=False,
    ),
    donate_argnums=(0,) if x_input == "donated" else (),
  )
  sh = NamedSharding(mesh, spec)
  x = jax.ShapeDtypeStruct((m, D), jnp.bfloat16, sharding=sh)
  w = jax.ShapeDtypeStruct((D, F), jnp.bfloat16, sharding=sh)
  return fn.lower(x, w).compile().as_text()


def _kinds(text):
  return sorted(h.kind for h in hazards(analyze(text)))


@pytest.mark.parametrize("m", [16, 256, 1024])
def test_v6e_prefetch_of_a_parameter_source_is_accepted(m):
  text = _hlo("v6e", m, "parameter", unpinned=True)
  report = analyze(text)
  start = [p for p in report.kernel_pairs if "allgather_done" in p.done]
  assert start, "no fused all-gather start/done pair"
  # XLA hands the done a VMEM copy of x (the reason for this change) ...
  done = [ln for ln in text.splitlines() if "allgather_done.1 = " in ln]
  assert done and "custom-call(%copy-done" in done[0]
  # ... and the source is still the parameter the DMA reads.
  assert all(p.source_live for p in start)
  assert _kinds(text) == []


@pytest.mark.parametrize("m", [16, 256])
def test_v6e_donated_source_stays_refused(m):
  found = hazards(analyze(_hlo("v6e", m, "donated", unpinned=True)))
  [live] = [h for h in found if h.kind == "source not live"]
  # The message names the argument and the fix.
  assert "argument 0 of the jitted function, donated" in live.detail
  assert "do not donate argument 0 (donate_argnums)" in live.detail


def test_v6e_aliased_parameter_stays_refused():
  text = _hlo("v6e", 256, "parameter", unpinned=True)
  head, rest = text.split("\n", 1)
  aliased = head + ", input_output_alias={ {0}: (0, {}, may-alias) }\n" + rest
  assert _kinds(text) == []
  assert "source not live" in _kinds(aliased)


@pytest.mark.parametrize("chip", ["v6e", "v5e", "v5p"])
@pytest.mark.parametrize("m", [16, 256, 1024])
@pytest.mark.parametrize("x_input", ["parameter", "donated"])
def test_pinned_x_is_the_dones_own(chip, m, x_input):
  """With the pin (branch h-agpin) the start, the compute kernel and the
  done take the parameter itself: no copy of ``x`` on any chip, and a
  donated ``x`` is accepted on v6e too (it lives until the done)."""
  text = _hlo(chip, m, x_input)
  module = parse_module(text)
  kernels = [
    i
    for i in module.instructions.values()
    if i.opcode == "custom-call"
    and i.name.split(".")[0]
    in ("asyncops_ring_allgather_start", "asyncops_ring_allgather_done")
  ]
  assert len(kernels) == 2, [i.name for i in kernels]
  for i in kernels:
    assert module.instr(i.operands[0]).opcode == "parameter", i.name
  assert _kinds(text) == []


@pytest.mark.parametrize("chip", ["v6e", "v5e", "v5p"])
@pytest.mark.parametrize("x_input", ["parameter", "produced"])
def test_no_hazard_for_a_parameter_or_produced_x(chip, x_input):
  assert _kinds(_hlo(chip, 256, x_input)) == []


@pytest.mark.parametrize("chip", ["v5e", "v5p"])
def test_donated_x_without_the_copy_is_accepted(chip):
  # No copy there: the done takes the parameter itself, which reaches it.
  text = _hlo(chip, 256, "donated")
  assert "buffer_donor" in text.split("\n", 1)[0]
  assert _kinds(text) == []


def test_asyncops_jit_compiles_the_default_on_v6e():
  mesh = tpu_mesh("v6e:2x4", (8,), ("i",))
  spec = P(None, "i")

  def step(x, w):
    return allgather_matmul(x, w, "i")

  fn = asyncops.jit(
    jax.shard_map(
      step, mesh=mesh, in_specs=(spec, spec), out_specs=spec, check_vma=False
    )
  )
  sh = NamedSharding(mesh, spec)
  x = jax.ShapeDtypeStruct((256, D), jnp.bfloat16, sharding=sh)
  w = jax.ShapeDtypeStruct((D, F), jnp.bfloat16, sharding=sh)
  text = fn.lower(x, w).compile().as_text()  # raised CopyHazardError on main
  assert "asyncops_ring_allgather_done" in text


@pytest.mark.parametrize(
  "head, want",
  [
    ("HloModule m, is_scheduled=true", []),
    ("HloModule m, buffer_donor={ (0, {}) }", [0]),
    ("HloModule m, input_output_alias={ {0}: (1, {}, may-alias) }", [1]),
    (
      "HloModule m, input_output_alias={ {0}: (2, {}, may-alias), "
      "{1}: (0, {1}, must-alias) }, buffer_donor={ (3, {}) }",
      [0, 2, 3],
    ),
  ],
)
def test_donated_params_from_the_header(head, want):
  assert sorted(_donated_params(head)) == want


def test_numerics_match_jnp_dot():
  mesh = u.cpu_mesh((8,), ("i",))
  spec = P(None, "i")
  x = jax.random.normal(jax.random.key(0), (16, 1024), jnp.float32)
  w = jax.random.normal(jax.random.key(1), (1024, 512), jnp.float32)
  got = u.run_sharded(
    lambda a, b: allgather_matmul(a, b, "i", method="fused"),
    mesh,
    (spec, spec),
    spec,
    x,
    w,
    check_vma=False,
  )
  want = jnp.dot(x, w, precision="highest")
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-2)
