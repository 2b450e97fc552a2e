#!/usr/bin/env bash
# The whole path on one CPU machine, from nothing: install, a synthetic multilingual corpus,
# a SentencePiece tokenizer, Arrow shards, and the tiny model trained on 2 processes (gloo).
# A few minutes on 2 cores (the first DeepSpeed run builds a small op, ~90 s, then cached).
# ./demo.sh --quick: a 1 MB corpus and 40 steps, for CI. DEMO_OUT=DIR writes elsewhere.
# Rerunning (after a finished or an interrupted run) continues: each stage whose output exists
# and matches says "already done", the training resumes from its last checkpoint, and nothing
# is overwritten by a stage whose checks would refuse it.
set -euo pipefail
cd "$(dirname "$0")"
OUT=${DEMO_OUT:-demo_out}
MODE=full
SIZE_MB=4
TRAIN_ARGS=()
if [ "${1:-}" = "--quick" ]; then
    MODE=quick
    SIZE_MB=1
    TRAIN_ARGS=(--set train.steps=40 --set train.eval_interval=20 --set train.save_interval=20
                --set train.log_interval=5)
fi
# Every output below depends on the mode: a quick demo and a full one never share a folder.
mkdir -p "$OUT"
if [ -f "$OUT/demo_mode" ] && [ "$(cat "$OUT/demo_mode")" != "$MODE" ]; then
    echo "error: $OUT holds a $(cat "$OUT/demo_mode") demo, this is a $MODE one;" \
         "set DEMO_OUT to another folder or remove $OUT" >&2
    exit 2
fi
echo "$MODE" > "$OUT/demo_mode"

[ -f .venv/bin/activate ] || python3 -m venv .venv
. .venv/bin/activate
pip install -q torch==2.13.0   # pinned: the CPU build; a bare 'torch' would pull a CUDA build
pip install -q -e .

if [ -d "$OUT/corpus" ]; then
    echo "corpus: already done ($OUT/corpus)"
else  # written aside and renamed, so an interrupted run leaves no half corpus behind
    rm -rf "$OUT/corpus.partial"
    rembert-make-demo-corpus --out "$OUT/corpus.partial" --size-mb "$SIZE_MB"
    mv "$OUT/corpus.partial" "$OUT/corpus"
fi
# Reproducible: a rerun finds the same tokenizer and says "already done".
rembert-train-tokenizer --corpus "$OUT/corpus" --out "$OUT/tokenizer/spm" \
    --vocab-size 1000
rembert-preprocess --corpus "$OUT/corpus" --tokenizer "$OUT/tokenizer/spm.model" \
    --out "$OUT/data" --seq-length 64 --valid-fraction 0.02 --no-progress
rembert-inspect-shards "$OUT/data" --verify

STEPS=$(python -c 'import yaml; print(yaml.safe_load(open("configs/demo.yaml"))["train"]["steps"])')
[ "$MODE" = quick ] && STEPS=40
LAST=$(printf 'step_%08d' "$STEPS")
if [ "$(cat "$OUT/checkpoints/latest" 2>/dev/null)" = "$LAST" ]; then
    echo "training: already done ($OUT/checkpoints/$LAST)"
else  # resumes from $OUT/checkpoints/latest if a previous demo run was interrupted
    python -m torch.distributed.run --standalone --nproc_per_node 2 train.py \
        --config configs/demo.yaml \
        --set data.path="$OUT/data" --set data.tokenizer="$OUT/tokenizer/spm.model" \
        --set train.save_dir="$OUT/checkpoints" --set train.log_dir="$OUT/logs" \
        ${TRAIN_ARGS[@]+"${TRAIN_ARGS[@]}"}
fi

python - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
rows = [json.loads(l) for l in open(f"{out}/logs/metrics.jsonl")]
train = [r for r in rows if r["split"] == "train"]
valid = [r for r in rows if r["split"] == "valid"]
print(f"\ntraining loss {train[0]['loss']:.3f} (step {train[0]['step']}) -> "
      f"{train[-1]['loss']:.3f} (step {train[-1]['step']}); "
      f"MLM accuracy {train[0]['mlm_acc']:.1%} -> {train[-1]['mlm_acc']:.1%}")
if valid:
    print(f"validation loss {valid[-1]['loss']:.3f}, accuracy {valid[-1]['mlm_acc']:.1%}")
print(f"""
corpus       {out}/corpus
tokenizer    {out}/tokenizer/spm.model
dataset      {out}/data  (rembert-inspect-shards {out}/data --decode 3 --tokenizer {out}/tokenizer/spm.model)
checkpoints  {out}/checkpoints  (latest: {open(f"{out}/checkpoints/latest").read().strip()})
metrics      {out}/logs/metrics.jsonl
TensorBoard  . .venv/bin/activate && tensorboard --logdir {out}/logs""")
PY
