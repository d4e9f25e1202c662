"""The README's example runs and computes what it says (8 CPU devices)."""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_example_runs_and_matches_lax():
  (code,) = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
  scope: dict = {}
  exec(compile(code, str(README), "exec"), scope)  # noqa: S102
  x, w = jnp.ones((64, 128)), jnp.eye(128)
  shifted = np.roll(np.asarray(x).reshape(8, 8, 128), 1, axis=0)
  want = shifted.reshape(64, 128) + np.asarray(x) @ np.asarray(w)
  np.testing.assert_array_equal(np.asarray(scope["y"]), want)
  assert jax.device_count() == 8
