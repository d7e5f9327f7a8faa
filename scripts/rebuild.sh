#!/usr/bin/env bash
# Rebuild the extension into the development venv (editable install), one build at a time: several people or
# agents may share this checkout, and two concurrent CMake runs on one build/ directory corrupt it.
# TWINSPARK_CUDA_ARCHS=121a (one target) or TWINSPARK_NO_CUDA=1 make a quicker build while iterating.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${TWINSPARK_DEV_VENV:-/work/devvenv}"
exec 9>/tmp/twinspark-build.lock
flock 9
"$VENV/bin/python" -m pip install -q --no-build-isolation --no-deps -e . \
  -Cbuild-dir="build/dev-{wheel_tag}" "$@"
"$VENV/bin/python" -c "import twinspark._C as C; print('twinspark._C built for', C.built_archs() or 'CPU only')"
