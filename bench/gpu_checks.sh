#!/usr/bin/env bash
# The GPU acceptance checks in one run, for a machine with torch and triton and no network:
#   1. rembert: tokens/s, TFLOP/s and MFU of the model step (torch + triton) with attention on
#      the flash path, on the masked path and with model.compile (bench/train_throughput.py
#      --gpu-only --compile); each pipeline layer's time and the 1F1B step projected from it
#      for the FLOP-balanced and the parameter-balanced partitions at pp 2/4/8
#      (bench/pipeline_balance.py); then the
#      trainer's step (DeepSpeed, bf16, zero1_bf16.json) with its peak memory against
#      train.py --dry-run's estimate (bench/train_throughput.py --trainer);
#   2. kernels: the Triton kernels against the torch references on CUDA in fp32 and bf16, then
#      their speed (bench/kernels_gpu.py); a rembert Transformer layer eager vs model.compile
#      vs its GEMMs and attention alone, both attention backends, dropout 0 and 0.1
#      (bench/layer_fusion.py);
#   3. training: train.py on one GPU with NCCL, bf16 + ds_configs/zero1_bf16.json, 4
#      micro-batches a step, 20 steps; SIGTERM after step 10 and resume == uninterrupted; tp = 2
#      and pp = 2 on two processes against one process: NCCL on two GPUs; on one GPU tp = 2 on
#      two processes sharing it (gloo over CUDA tensors), pp = 2 skipped (gloo cannot send CUDA
#      tensors between stages) (bench/gpu_train_checks.py).
# The figures come first, so a check that hangs (each has a time limit) costs only itself.
# DeepSpeed and the packages it needs beyond such an image travel as wheels: make them on a
# machine with internet with `bash bench/gpu_wheels.sh .whl`, bring the folder along, and set
# GPU_WHEELS=.whl; they are installed into a temporary folder, nothing else is touched.
# Every check runs even if an earlier one fails; the exit code says whether all passed.
# Usage: [GPU_WHEELS=.whl] bash bench/gpu_checks.sh        (about 9 minutes on one H200)
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
if [[ -z ${cpu:-} ]]; then
    check rembert-model 240 python3 bench/train_throughput.py --gpu-only --compile --steps 5
    check pipeline-balance 120 python3 bench/pipeline_balance.py --pp 2,4,8
    check rembert-trainer 180 python3 bench/train_throughput.py --trainer --steps 5
    check kernels 180 python3 bench/kernels_gpu.py
    check fp8 300 python3 bench/fp8_gpu.py
    check layer-fusion 360 python3 bench/layer_fusion.py
fi
check training 400 python3 bench/gpu_train_checks.py --steps "${GPU_CHECKS_STEPS:-20}" \
    --signal-at "${GPU_CHECKS_SIGNAL_AT:-10}"
echo
if ((${#failed[@]})); then
    echo "FAILED: ${failed[*]}"
    exit 1
fi
echo "all GPU checks passed"
