#!/usr/bin/env bash
# Wheels that carry nox to the offline GPU machine (the `run` tool): nox and its dependencies, pinned, for that
# machine's Python (3.12, x86_64; PY_VERSION=3.11 etc. for another), downloaded into .whl/ (ignored by git).
#
#   scripts/fetch-device-wheels.sh          # here, with an index: 12 wheels, about 7 MB
#
# Then on the device (carry ".whl"): install them beside its Python and run nox over the machine's own torch;
# docs/kernel-dev.md has the whole command:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
#   PYTHONPATH=/tmp/site TWINSPARK_TORCH=system TWINSPARK_CUDA_ARCHS=90a python3 -m nox -s kernels parity
set -euo pipefail
cd "$(dirname "$0")/.."
PY_VERSION="${PY_VERSION:-3.12}"
# nox and what it requires on Python >= 3.11 (tomli is for 3.10 only), at the versions tested with this repo.
WHEELS=(
  nox==2026.10.20 argcomplete==3.7.2 attrs==26.1.0 colorlog==6.12.0 dependency-groups==1.3.2 humanize==4.17.0
  packaging==26.4 platformdirs==4.14.9 python-discovery==1.9.7 virtualenv==21.15.13 distlib==0.4.4 filelock==4.3.2
)
if ! [[ "$PY_VERSION" =~ ^3\.[0-9]+$ ]]; then
  echo "fetch-device-wheels.sh: PY_VERSION must look like 3.12, got '$PY_VERSION'" >&2
  exit 2
fi
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "${WHEELS[@]}"
echo "fetch-device-wheels.sh: $(ls .whl/*.whl | wc -l) wheels, $(du -sh .whl | cut -f1) in .whl/ (carry \".whl\")"
