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
# Decode step with CUDA graphs on and off against its bandwidth bound: a ~1B Llama in bf16
# (hidden 2048 x 16 layers, batch 64) and the bench shape in fp32.
timeout 150 python3 tools/bench_gpu.py --batch 64 --ctx 512 2>&1 | tee "$OUT/bench_gpu_1b.md" | tail -8
timeout 90 python3 tools/bench_gpu.py --hidden 512 --layers 8 --heads 8 --kv-heads 8 \
    --intermediate 1408 --dtype float32 --batch 32 --ctx 128 2>&1 | tee "$OUT/bench_gpu_bench.md" | tail -8
