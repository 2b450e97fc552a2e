#!/usr/bin/env bash
# Every GPU check in one run, for a machine with only torch and triton installed:
#   1. the Triton kernels against the torch references, then their speed (bench/kernels_gpu.py);
#   2. tokens/s, TFLOP/s and MFU of the rembert preset (bench/train_throughput.py --gpu-only).
# Usage: bash bench/gpu_checks.sh   (about 5 minutes on one H100)
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python bench/kernels_gpu.py --dtype bf16
python bench/train_throughput.py --gpu-only --steps 5
