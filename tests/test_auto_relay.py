"""Auto's relay pick (``"fused_fwd"``) runs the fused all-gather with
``forward=True`` (branch h-fwdauto), forced here on the CPU devices:
values and gradients as ``all_gather(a) @ w``."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from asyncops import collective_matmul as cm
from asyncops.collective_matmul import _auto
from tests import util as u

_SPECS = (P(None, "y"), P(None, "y"))


def _ints(shape, seed):
  k = jax.random.PRNGKey(seed)
  return jax.random.randint(k, shape, -3, 4).astype(jnp.float32)


def test_auto_runs_the_relay_it_picks(monkeypatch):
  pick = _auto.Choice("fused_fwd", "forced", 1.0, 2.0, "v6e", fused_fwd_us=0.9)
  monkeypatch.setattr(_auto, "explain_allgather", lambda *a, **k: pick)
  a, w = _ints((16, 128 * 4), 1), _ints((128 * 4, 32 * 4), 2)
  mesh = u.cpu_mesh((2, 4))
  f = jax.jit(
    jax.shard_map(
      lambda x, y: cm.allgather_matmul(x, y, "y"),
      mesh=mesh,
      in_specs=_SPECS,
      out_specs=P(None, "y"),
    )
  )
  ra, rw = jax.grad(lambda x, y: jnp.sum((x @ y) ** 2), (0, 1))(a, w)
  want = a @ w
  a, w = (
    jax.device_put(v, NamedSharding(mesh, s))
    for v, s in zip((a, w), _SPECS, strict=True)
  )
  with _auto.recording() as choices:
    got = f(a, w)
    jaxpr = str(f.trace(a, w).jaxpr)
  assert {c.method for _, c in choices} == {"fused_fwd"}
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert "forward=True" in jaxpr and "forward=False" not in jaxpr

  def loss(x, y):
    return jnp.sum(f(x, y) ** 2)

  ga, gw = jax.jit(jax.grad(loss, (0, 1)))(a, w)
  np.testing.assert_allclose(np.asarray(ga), np.asarray(ra), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(gw), np.asarray(rw), rtol=1e-6)
