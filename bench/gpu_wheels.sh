#!/usr/bin/env bash
# Wheels for bench/gpu_checks.sh on a GPU machine without network whose image has torch,
# triton, pyarrow, sentencepiece and tensorboard but not DeepSpeed: DeepSpeed (published as
# source only, so built here into a pure-Python wheel) and the packages it needs that such
# images lack (pydantic and its parts, hjson), and pytest (the GPU checks are tests), for that
# machine's Python.
#   bash bench/gpu_wheels.sh [DIR] [PYTHON_VERSION]        (defaults: .whl 3.12)
set -euo pipefail
dir=${1:-.whl}
python_version=${2:-3.12}
deepspeed_version=$(python3 -c "import importlib.metadata as m; print(m.version('deepspeed'))" \
    2>/dev/null || echo 0.19.8)
mkdir -p "$dir"
python3 -m pip wheel -q --no-deps "deepspeed==$deepspeed_version" -w "$dir"
python3 -m pip download -q --only-binary=:all: --python-version "$python_version" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$dir" pydantic hjson pytest
ls -1 "$dir"
