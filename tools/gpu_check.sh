#!/usr/bin/env bash
# One prepared device check for a lent GPU machine (the device tool's README): at most ~9
# minutes (the whole check took 5.6 on an H200 in session 38), every step bounded, each step's
# output kept in $OUT whatever the others do. Run it with the device tool's timeout at 600 s.
#
# The image has torch, triton, transformers, cupy, aiohttp, uvloop and pytest but not msgspec
# or pytest-asyncio, and no network. Fetch their Python 3.12 wheels here first, into .whl/
# (ignored by .git/info/exclude), and carry that folder:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux2014_x86_64 -d .whl \
#       msgspec==0.23.0 pytest-asyncio==1.5.0
# and the ShareGPT lengths the Mixed workload draws from (../shared/data does not travel):
#   mkdir -p .gpudata && cp ../shared/data/sharegpt_8k_llama2_tokens.csv .gpudata/
#   echo /.gpudata/ >> .git/info/exclude
# then: device run, carry [".whl", ".gpudata"], command "bash tools/gpu_check.sh".
#
# Steps:
#  1. pytest -m gpu: the Triton kernels (ragged_attention against the SDPA loop, with a sliding
#     window too; the small layer ops and the KV write against their references) in fp32, bf16
#     and fp16, greedy parity with transformers on CUDA (llama, opt; coupled and
#     coupled-chunked), CUDA graphs against eager, KV blocks across processes over CUDA IPC, a
#     disaggregated cluster over CUDA IPC, and `tetri-server serve` with 1 prefill + 1 decode
#     worker on the one GPU streaming the text transformers gives.
#  2. tools/bench_gpu.py: the decode step at batch 64 of a ~1B Llama in bf16 (hidden 2048 x 16
#     layers), CUDA graphs on and off, each with the small layer ops as Triton kernels and as
#     eager PyTorch, and with the attention kernel's programs per query head (all
#     interleaved), against its weight + KV bytes bandwidth bound, with a profile of 5 steps
#     of each; prefill steps (512, 2048, 4 x 1024) against the bf16 matmul peak measured in
#     the same run, with the Triton layer ops and the eager ones interleaved, and a profile
#     of the 4 x 1024 step (where prefill, 8-36% of the peak in session 38, spends its time).
#  3. A served Mixed workload (real ShareGPT lengths, Poisson) on that 1B model: coupled
#     (2 workers) against disaggregated (1 prefill + 1 decode), both on the one GPU.
#  4. tools/bench_gpu.py on the bench model's shape in fp32 (decode and prefill).
#  5. tools/bench_handoff.py: KV hand-off over CUDA IPC against a device memcpy.
set -uo pipefail
cd "$(dirname "$0")/.."
source tools/gpu_common.sh

step pytest 200 python3 -m pytest -q -rfE -p no:cacheprovider --timeout 120 -m gpu \
    tests/gpu tests/unit/test_transport.py
step bench_gpu_1b 100 python3 tools/bench_gpu.py --batch 64 --ctx 512 --profile 5 \
    --out /tmp/gpu-1b
[ -d .gpudata ] && export TETRI_DATA_DIR=$PWD/.gpudata
step serve_mixed 150 python3 -m tetri_server bench compare --no-vllm --modes coupled,disaggregated \
    --model /tmp/gpu-1b --max-model-len 2048 --workload Mixed --rate 12 --num-requests 240 \
    --set cluster.device=cuda --no-progress --no-plots --out "$OUT/serve-mixed"
step bench_gpu_bench 40 python3 tools/bench_gpu.py --hidden 512 --layers 8 --heads 8 \
    --kv-heads 8 --intermediate 1408 --dtype float32 --batch 32 --ctx 128
step bench_handoff 30 python3 tools/bench_handoff.py --reps 20
