#!/usr/bin/env bash
# The rembert model end to end on CPUs (tp 2 x pp 2, 4 processes, fp32): train, save, resume,
# convert to transformers, export the encoder; per-rank peak memory against --dry-run's estimate.
# See bench/full_scale.py for the stages; --small is the CI variant (2 layers, vocabulary 16,000).
#   bench/full_scale.sh [--small] [--layers N|auto] [--out DIR] [--keep]
set -euo pipefail
cd "$(dirname "$0")/.."
exec python -m bench.full_scale "$@"
