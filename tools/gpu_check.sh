#!/usr/bin/env bash
# One prepared device check for a lent GPU machine (see the device tool's README): installs the
# two packages its image lacks from wheels carried in shared/wheels (msgspec, pytest-asyncio for
# Python 3.12), then runs the GPU tests. Prepare the wheels here first (the device has no network):
#   pip download --only-binary :all: --python-version 3.12 --platform manylinux2014_x86_64 \
#       --no-deps -d shared/wheels msgspec pytest-asyncio pytest-timeout
# tests/gpu covers the Triton kernel behind ragged_attention (against the SDPA loop, and greedy
# parity with transformers through it); the image's triton is used, nothing is built.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps shared/wheels/*.whl 2>&1 | tail -2
python3 -m pip install -q --no-deps -e . 2>&1 | tail -2
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
timeout 300 python3 -m pytest -q -m gpu tests/gpu tests/unit/test_transport.py 2>&1 | tee "$OUT/pytest.txt" | tail -20
