#!/usr/bin/env bash
# The GPU acceptance checks in one run, for a machine with torch and triton and no network. First
# the correctness checks as tests (`pytest -m gpu`: the Triton kernels compiled for this GPU and
# against their references, model.compile's layers against eager ones, the trainer's
# micro-batches under torch.cuda.set_sync_debug_mode("error"), the fp8 GEMMs and fp8 training
# against bf16; tests/bench/test_gpu_checks.py), then the timing benches, ending with ONE TABLE
# (bench.gpu_table): the rembert step's tokens/s, TFLOP/s and MFU (model alone and the trainer
# at gas 8, bf16, and fp8), each part of a step (embedding, layer and its GEMMs alone, head,
# optimizer, engine) and whether a micro-batch syncs with the host, against the goals and the
# figures before this work. The benches, each under a time limit, in order:
#   1. rembert model step: flash, masked and model.compile paths, attention alone
#      (python -m bench.train_throughput --gpu-only --compile);
#   2. the engine: the trainer's step (DeepSpeed, bf16 + zero1_bf16.json) against the bare
#      model + fused AdamW at gas 1 and 8, and the trainer's micro-batches under
#      torch.cuda.set_sync_debug_mode("error") (bench.train_throughput --engine);
#   3. each pipeline layer's time as trained (fp32 main gradients) and the 1F1B step projected
#      from it for pp 2/4/8 (bench.pipeline_balance);
#   4. one Transformer layer eager, compiled and its GEMMs + attention alone
#      (bench.layer_fusion);
#   5. the Triton kernels against the torch references in bf16 (fp32 in the tests), then their
#      speed and the MLM head at 16 x 77 rows per rows-per-chunk and kept logits
#      (bench.kernels_gpu);
#   6. fp8: its GEMMs against plain-torch quantisation, the rembert step fp8 / bf16, the demo
#      model's loss over 300 steps each way (bench.fp8_gpu);
#   7. with GPU_CHECKS_TRAINING=1 (several minutes more): train.py on one GPU with NCCL, bf16 +
#      zero1_bf16.json, SIGTERM and resume == uninterrupted, tp 2 against one process, and the
#      trainer's peak memory against --dry-run (bench.gpu_train_checks,
#      bench.train_throughput --trainer).
# DeepSpeed and the packages it needs beyond such an image travel as wheels: make them on a
# machine with internet with `bash bench/gpu_wheels.sh .whl` (pytest among them), bring the
# folder along, and set
# GPU_WHEELS=.whl; they are installed into a temporary folder, nothing else is touched.
# Every check runs even if an earlier one fails; the exit code says whether all passed. The
# limits of the tests and 1-6 add up to 600 s: the whole run fits one 10-minute command.
# Usage: [GPU_WHEELS=.whl] [GPU_CHECKS_TRAINING=1] bash bench/gpu_checks.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [[ -n ${GPU_WHEELS:-} ]]; then
    site=$(mktemp -d)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
        "$GPU_WHEELS"/*.whl || exit 2
    export PYTHONPATH="$PYTHONPATH:$site"
fi
if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    [[ -n ${GPU_CHECKS_ALLOW_CPU:-} ]] || { echo "no CUDA device: nothing to check"; exit 2; }
    echo "no CUDA device: running the training checks on the CPU (GPU_CHECKS_ALLOW_CPU)"
    cpu=1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || true
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
failed=()
check() {  # check NAME SECONDS COMMAND...: run it under a time limit, remember a failure, go on
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    echo; echo "=== $name: $*"
    timeout --signal=TERM --kill-after=10 "$limit" "$@" || failed+=("$name")
    echo "=== $name: $((SECONDS - start)) s"
}
results=$(mktemp -d)  # each bench's figures as JSON, for the table
if [[ -z ${cpu:-} ]]; then
    check gpu-tests 120 python3 -m pytest -m gpu -q -p no:cacheprovider \
        tests/bench/test_gpu_checks.py tests/kernels/test_aot_compile.py
    check rembert-model 75 python3 -m bench.train_throughput --gpu-only --compile --steps 5 \
        --json "$results/model.json"
    check engine 120 python3 -m bench.train_throughput --engine --engine-gas 1 8 --steps 3 \
        --json "$results/engine.json"
    check pipeline-balance 60 python3 -m bench.pipeline_balance --pp 2,4,8 \
        --json "$results/parts.json"
    check layer-fusion 45 python3 -m bench.layer_fusion --attention-backend sdpa --dropout 0 \
        --json "$results/layer.json"
    check kernels 70 python3 -m bench.kernels_gpu --dtype bf16 --loss-chunks 0 \
        --head-chunks 0,512,2048 --json "$results/head.json"
    check fp8 110 python3 -m bench.fp8_gpu --json "$results/fp8.json"
fi
if [[ -n ${GPU_CHECKS_TRAINING:-} || -n ${cpu:-} ]]; then
    [[ -n ${cpu:-} ]] || check rembert-trainer 180 python3 -m bench.train_throughput --trainer \
        --steps 5
    check training 400 python3 -m bench.gpu_train_checks --steps "${GPU_CHECKS_STEPS:-20}" \
        --signal-at "${GPU_CHECKS_SIGNAL_AT:-10}"
fi
[[ -n ${cpu:-} ]] || python3 -m bench.gpu_table "$results"
echo
if ((${#failed[@]})); then
    echo "FAILED: ${failed[*]}"
    exit 1
fi
echo "all GPU checks passed"
