"""Test set-up: 8 virtual CPU devices, configured before JAX initialises."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# Several processes (parallel engineers, CI) may load libtpu for AOT compiles.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  os.environ["XLA_FLAGS"] = (
    _flags + " --xla_force_host_platform_device_count=8"
  ).strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
