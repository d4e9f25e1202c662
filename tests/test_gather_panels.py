"""The two-way all-gather ring of whole chunks in row panels (CPU).

``_gather_rings._whole_pieces`` runs the long-prefill ring once per row
panel (``_gather_rings.whole_panels``) so that its float32 accumulator
holds one panel's rows. Forced here at small shapes (every accumulator
takes the ring of whole chunks, the panel count is set): the result and
its gradient against ``jnp``, for panel counts that divide the rows and
that do not (odd panels run one piece), both dtypes and ring sizes 4 and
8. The compiled TPU program is checked in ``test_gather_panels_tpu.py``.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from asyncops import collective_matmul as _cm
from asyncops.collective_matmul import _gather_rings

MESHES = {"2x4": (2, 4), "1x8": (1, 8)}


def _mesh(name):
  return jax.make_mesh(
    MESHES[name], ("x", "y"), axis_types=(jax.sharding.AxisType.Explicit,) * 2
  )


def _force(monkeypatch, panels):
  monkeypatch.setattr(_gather_rings, "WHOLE_ACC_BYTES", 0)
  monkeypatch.setattr(_gather_rings, "whole_panels", lambda *args: panels)


def _run(mesh_name, b, d, f, dtype):
  mesh = _mesh(mesh_name)
  a = jax.random.normal(jax.random.key(0), (b, d), jnp.float32).astype(dtype)
  w = jax.random.normal(jax.random.key(1), (d, f), jnp.float32).astype(dtype)
  specs = (P("x", "y"), P(None, "y"))
  a = jax.device_put(a, NamedSharding(mesh, specs[0]))
  w = jax.device_put(w, NamedSharding(mesh, specs[1]))
  body = functools.partial(
    _cm.allgather_matmul, axis_name="y", bidirectional=True, method="ring"
  )
  ours = jax.jit(
    jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P("x", "y"))
  )
  return mesh, a, w, ours


# (mesh, global (B, D, F), panels): rows per device M = B / mesh rows.
CASES = [
  ("2x4", (32, 64, 32), 2),  # M = 16: two panels of 8 (two pieces each)
  ("2x4", (32, 64, 32), 4),  # four panels of 4
  ("2x4", (48, 64, 32), 5),  # M = 24: panels of 4 and 5 rows (odd: one piece)
  ("1x8", (24, 64, 48), 3),  # M = 24 on a ring of 8: panels of 8
  ("1x8", (14, 64, 48), 7),  # M = 14, panels of 2 rows (pieces of one row)
  ("2x4", (30, 64, 32), 15),  # M = 15, one row a panel (one piece each)
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("mesh_name,shape,panels", CASES)
def test_panels_match_jnp(monkeypatch, mesh_name, shape, panels, dtype):
  _force(monkeypatch, panels)
  b, d, f = shape
  if (b // MESHES[mesh_name][0]) % 2:
    # The two-way ring halves rows at its public entry (all its forms).
    _, a, w, ours = _run(mesh_name, b, d, f, dtype)
    with pytest.raises(ValueError, match="even"):
      ours(a, w)
    return
  _, a, w, ours = _run(mesh_name, b, d, f, dtype)
  got = np.asarray(ours(a, w).astype(jnp.float32))
  want = np.asarray(a, np.float32) @ np.asarray(w, np.float32)
  if dtype == jnp.float32:
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
  else:
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.sqrt(d))


@pytest.mark.parametrize("mesh_name,shape,panels", CASES[:2] + CASES[3:5])
def test_panels_gradient(monkeypatch, mesh_name, shape, panels):
  """The gradient through the panelled ring (its backward reads ``x`` as
  the last panel's transfer returned it) equals ``jnp``'s."""
  _force(monkeypatch, panels)
  mesh, a, w, ours = _run(mesh_name, *shape, jnp.float32)

  def ref(a, w):
    return a @ w

  def loss(fn):
    return lambda a, w: jnp.sum(jnp.sin(fn(a, w)))

  with jax.set_mesh(mesh):
    got = jax.grad(loss(ours), (0, 1))(a, w)
    want = jax.grad(loss(ref), (0, 1))(a, w)
  for g, r in zip(got, want, strict=True):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), 2e-4, 2e-4)


@pytest.mark.parametrize(
  "m,f,want",
  [
    # The Llama-3-70B shard at M = 16384: tp 4 (448 MiB), tp 8 (224).
    (16384, 7168, 4),
    (16384, 3584, 2),
    # tp 4, M = 4096 (112 MiB), and exactly at the cap: one panel.
    (4096, 7168, 1),
    (8192, 4096, 1),
    # At most M / 2 panels (two rows each).
    (4, 1 << 24, 2),
    (2, 1 << 26, 1),
    # 3 panels' accumulator (320 MiB): 4 panels, each a multiple of 16
    # rows (3 would cut pieces of 2730 rows, 5 of 1638: not 8-aligned).
    (16384, 5120, 4),
    (16384, 7168 * 5 // 4, 8),
    # M not a multiple of 16: the fewest panels, as before.
    (16394, 5120, 3),
  ],
)
def test_whole_panels_rule(m, f, want):
  """The fewest panels whose float32 accumulator is at most
  ``PANEL_ACC_BYTES`` (128 MiB), two rows a panel at least; when ``M`` is
  a multiple of 16, the fewest of those whose panels are too."""
  got = _gather_rings.whole_panels(m, f, jnp.float32)
  assert got == want
  if got < m // 2:
    assert -(-m // got) * f * 4 <= _gather_rings.PANEL_ACC_BYTES
  aligned = m % 16 == 0
  if aligned:
    assert m // got % 16 == 0
  smaller = [q for q in range(1, got) if not aligned or (m // 16) % q == 0]
  for q in smaller:
    assert -(-m // q) * f * 4 > _gather_rings.PANEL_ACC_BYTES


@pytest.mark.parametrize("n,chip,want", [(4, "v5p", 1), (8, "v5p", 2)])
def test_whole_panels_one_panel_chips(n, chip, want):
  """v5p at tp 4 keeps one panel (``ONE_PANEL``: panels cost it more than
  its margin under xla_best); at tp 8 the rule applies."""
  assert _gather_rings.whole_panels(16384, 7168 * 4 // n, jnp.float32, n, chip)
  assert (
    _gather_rings.whole_panels(16384, 28672 // n, jnp.float32, n, chip) == want
  )
