"""Test set-up: CPU platform, quiet libtpu.

The 8 CPU devices come from asyncops' own pytest plugin
(``asyncops.testing``, registered through the ``pytest11`` entry point when
the project is installed), as they do for our users.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# Several processes (parallel engineers, CI) may load libtpu for AOT compiles.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
pytest_plugins = ["pytester"]
