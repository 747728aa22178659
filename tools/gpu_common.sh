# Sourced by the device scripts (tools/gpu_check.sh, tools/gpu_sched.sh) from the repository
# root: the wheels of .whl on PYTHONPATH, the machine in $OUT/env.txt, and step().
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

