"""Forward mode through ``mlp_block`` on the compiled TPU HLO.

``jax.jvp`` runs the forward's two rings and four tangent rings (the up
projection's ``AG(tx) @ w`` and ``AG(x) @ tw``, the down projection's
``RS(th @ w)`` and ``RS(h @ tw)``): every transfer a start/done pair with
compute in its window, no defensive or in-flight copy
(``design/training.md``, forward mode).
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from asyncops.collective_matmul import mlp_block
from asyncops.inspect import analyze
from tests._hlo_util import tpu_mesh


@pytest.mark.parametrize("topology", ["v5e:2x4", "v6e:2x4"])
def test_mlp_block_jvp_overlapped_and_copy_free(topology):
  mesh = tpu_mesh(topology, (2, 4), ("x", "y"))
  f = jax.shard_map(
    lambda x, w_in, w_out: mlp_block(x * 2, w_in, w_out, "y", method="ring"),
    mesh=mesh,
    in_specs=(P("x", "y"), P(None, "y"), P("y", None)),
    out_specs=P("x", "y"),
  )
  b, d, ff = 1024, 2048, 8192
  args = (
    jax.ShapeDtypeStruct((b, d), jnp.bfloat16),
    jax.ShapeDtypeStruct((d, ff), jnp.bfloat16),
    jax.ShapeDtypeStruct((ff, d), jnp.bfloat16),
  )
  report = analyze(jax.jit(lambda p, t: jax.jvp(f, p, t)), args, args)
  report.assert_no_defensive_copies()
  report.assert_no_inflight_copies()
  pairs = report.kernel_pairs
  assert len(pairs) == 6 * (4 - 1)  # six rings of n - 1 transfers
  assert all(p.overlapped for p in pairs)
