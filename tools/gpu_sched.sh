#!/usr/bin/env bash
# Issue 14 on a lent GPU (the second device script; tools/gpu_check.sh is the first): SLO
# goodput by a rate sweep (`tetri-server bench sweep`), coupled (2 workers) against the
# disaggregated default (1 prefill + 1 decode; on cuda the strict split, cluster.elastic =
# auto), both on the one GPU, on the ~1B Llama in bf16 that tools/bench_gpu.py measures, for
# Mixed (real ShareGPT lengths) and LPHD. At most ~9 minutes, every step bounded; run it with
# the device tool's timeout at 600 s, carrying [".whl", ".gpudata"] (see gpu_check.sh's
# header for how to make them).
#
# The rates span what session 38 saw (coupled and the split both served Mixed at 12 req/s
# on an H200 with the 1B model); the sweep's SLOs come from coupled's unloaded latencies
# (TTFT <= 5x its unloaded prefill of the prompt, TPOT <= 3x its unloaded step).
set -uo pipefail
cd "$(dirname "$0")/.."
source tools/gpu_common.sh

MODEL=/tmp/gpu-1b
if [ ! -f "$MODEL/config.json" ]; then  # the shape of tools/bench_gpu.py's default
    step make_model 120 python3 tools/make_model.py --family llama --size bench --out "$MODEL" \
        --config '{"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "intermediate_size": 5632,
                   "max_position_embeddings": 4096}'
fi
[ -d .gpudata ] && export TETRI_DATA_DIR=$PWD/.gpudata
S="python3 -m tetri_server bench sweep --modes coupled,disaggregated --model $MODEL
   --max-model-len 2048 --set cluster.device=cuda --no-progress --no-plots"
step sweep_mixed 230 $S --workload Mixed --rates 8,16,24,32 --num-requests 160 \
    --out "$OUT/sweep-mixed"
step sweep_lphd 230 $S --workload LPHD --rates 4,8,16,24 --num-requests 96 \
    --out "$OUT/sweep-lphd"
