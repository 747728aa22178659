#!/usr/bin/env bash
# One prepared device check for a lent GPU machine (the device tool's README): at most ~9
# minutes (about 3 on an H200 in session 38), every step bounded, each step's output kept in
# $OUT whatever the others do.
#
# The image has torch, triton, transformers, cupy, aiohttp, uvloop and pytest but not msgspec
# or pytest-asyncio, and no network. Fetch their Python 3.12 wheels here first, into .whl/
# (ignored by .git/info/exclude), and carry that folder:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux2014_x86_64 -d .whl \
#       msgspec==0.23.0 pytest-asyncio==1.5.0
# then: device run, carry [".whl"], command "bash tools/gpu_check.sh".
#
# Steps:
#  1. pytest -m gpu: the Triton kernel behind ragged_attention against the SDPA loop (fp32,
#     bf16, fp16, sliding window), greedy parity with transformers on CUDA (llama, opt; coupled
#     and coupled-chunked), CUDA graphs against eager, KV blocks across processes over CUDA IPC,
#     a disaggregated cluster over CUDA IPC, and `tetri-server serve` with 1 prefill + 1 decode
#     worker on the one GPU streaming the text transformers gives.
#  2. tools/bench_gpu.py: the decode step at batch 64 of a ~1B Llama in bf16 (hidden 2048 x 16
#     layers), CUDA graphs on and off, against its weight + KV bytes bandwidth bound, with a
#     profile of 5 steps of each; prefill steps (512, 2048, 4 x 1024) against the bf16 matmul
#     peak measured in the same run; then the decode step again with the attention kernel's
#     programs per KV head group (triton_attention.PACK_GROUPS), for an A/B.
#  3. tools/bench_handoff.py: KV hand-off over CUDA IPC against a device memcpy.
#  4. tools/bench_gpu.py on the bench model's shape in fp32 (decode and prefill).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import sys, torch, triton, transformers, msgspec, pytest; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'pytest', pytest.__version__)"
    nproc
} 2>&1 | tee "$OUT/env.txt"

step() {  # step NAME SECONDS CMD...: run CMD bounded, output to $OUT/NAME.txt, say how it ended
    local name=$1 secs=$2
    shift 2
    local t0=$SECONDS
    timeout -k 10 "$secs" "$@" >"$OUT/$name.txt" 2>&1
    local rc=$?
    echo "== $name: rc $rc in $((SECONDS - t0)) s" | tee -a "$OUT/steps.txt"
    tail -25 "$OUT/$name.txt"
}

step pytest 240 python3 -m pytest -q -rfE -p no:cacheprovider --timeout 150 -m gpu \
    tests/gpu tests/unit/test_transport.py
step bench_gpu_1b 120 python3 tools/bench_gpu.py --batch 64 --ctx 512 --profile 5
step bench_gpu_1b_grouped 70 python3 tools/bench_gpu.py --batch 64 --ctx 512 --prefill '' \
    --grouped-attention
step bench_handoff 40 python3 tools/bench_handoff.py --reps 20
step bench_gpu_bench 50 python3 tools/bench_gpu.py --hidden 512 --layers 8 --heads 8 \
    --kv-heads 8 --intermediate 1408 --dtype float32 --batch 32 --ctx 128
