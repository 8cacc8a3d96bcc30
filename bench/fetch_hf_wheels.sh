#!/usr/bin/env bash
# Download transformers and its dependencies as wheels for a machine without network:
# CPython 3.12, Linux x86_64 (manylinux), into .wheels/ at the repository root (git-ignored).
#
#   bash bench/fetch_hf_wheels.sh            # here, with network
#   # on the offline machine, from the repository root (it already has torch, triton and numpy):
#   pip install --no-index --find-links .wheels "transformers==5.23.0"
#
# numpy is left out (flashtile already needs it, so the target has it; its wheel is ~16 MB), and so
# is torch (transformers does not depend on it). Everything else transformers requires is fetched,
# pure-Python wheels included, so the install needs nothing else.
set -euo pipefail

TRANSFORMERS_VERSION="${TRANSFORMERS_VERSION:-5.23.0}"
PYTHON_VERSION="${PYTHON_VERSION:-3.12}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="$ROOT/.wheels"
mkdir -p "$DEST"

# manylinux_2_28 takes in the older manylinux tags too (pip expands a manylinux platform to every
# glibc version below it); 2_28 covers any current distribution with CUDA 13.
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64)

# Resolve the full dependency set for the target, then keep the wheels except numpy's.
pip download --only-binary=:all: --python-version "$PYTHON_VERSION" --implementation cp \
    "${platforms[@]}" --dest "$DEST" --quiet "transformers==$TRANSFORMERS_VERSION"
rm -f "$DEST"/numpy-*.whl

echo "wheels in $DEST:"
ls -1 "$DEST"
du -sh "$DEST"
echo "offline install: pip install --no-index --find-links .wheels \"transformers==$TRANSFORMERS_VERSION\""
