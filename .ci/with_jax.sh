#!/usr/bin/env bash
# Usage: .ci/with_jax.sh JAX_VERSION VENV PYTEST_ARGS...
#
# A fresh virtualenv with jax==JAX_VERSION installed first, as a user has
# it; then asyncops from this checkout (with the tpu, test, bench and docs
# extras: the suite draws the timeline and builds the API reference). Fails
# if installing asyncops changed jax, then runs pytest there.
set -euo pipefail
version=$1 venv=$2
shift 2
rm -rf "$venv"
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --upgrade pip
"$venv/bin/pip" install --quiet "jax==$version"
"$venv/bin/pip" install --quiet ".[tpu,test,bench,docs]"
got=$("$venv/bin/python" -c "import jax; print(jax.__version__)")
if [ "$got" != "$version" ]; then
  echo "installing asyncops changed jax $version into $got" >&2
  exit 1
fi
echo "jax $got kept after installing asyncops into $venv"
"$venv/bin/python" -m pytest -p no:cacheprovider "$@"
