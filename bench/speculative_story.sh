#!/usr/bin/env bash
# The heal story at a size where the model writes real text, ending in a measured speed-up: train a byte-level
# `small`-width model with its MTP draft on the stdlib corpus, compress it (drop its block 9 of 12), heal the
# draft on the compressed trunk, and measure for the trained and the healed model: the draft's acceptance
# (`accept`), greedy decoding with and without speculation against PyTorch's KV-cache loop
# (`bench/generate.py`, prompted with real stdlib text), and a sample of what each writes (`generate`). Needs a real GPU (BENCHMARKS.md).
#
#   bench/speculative_story.sh [DIR] [CLI]     DIR defaults to runs/speculative, CLI to "python3 -m ddl_wgpu.cli"
#
# Overrides: PYTHON (runs bench/generate.py; python3), STEPS (400), DROP (the blocks compress removes; 9, three
# quarters deep), MODEL (the size flags), TRAIN (the training flags), HEAL (heal's flags; --tokens 60000),
# ACCEPT_TOKENS (30000), PROMPT_TOKENS and NEW_TOKENS (256 each: one long continuation), PROMPTS and SHORT_NEW
# (16 prompts x 64 new tokens), GENERATE_ARGS (more flags for bench/generate.py). A smoke run of every step at
# a tiny size on a CPU:
#   MODEL="--preset tiny" STEPS=4 DROP=1 HEAL="--tokens 2000" ACCEPT_TOKENS=500 PROMPT_TOKENS=8 NEW_TOKENS=8 \
#   TRAIN="--batch-size 2 --seq-len 32 --eval-interval 2 --eval-batches 1" bench/speculative_story.sh /tmp/s
set -euo pipefail
DIR=${1:-runs/speculative}
CLI=${2:-python3 -m ddl_wgpu.cli}
STEPS=${STEPS:-400}
DROP=${DROP:-9}
# `small`'s trunk (d 768, 12 layers, 6 x 128 heads) on bytes: vocab 256 instead of 50304, so the step is the
# transformer and not the LM head, and 1024-byte windows.
MODEL=${MODEL:---preset small --vocab-size 256 --max-seq-len 1024}
TRAIN=${TRAIN:-"--batch-size 16 --seq-len 1024 --learning-rate 1e-3 --warmup-steps 40 --eval-interval 200 --eval-batches 8"}
ACCEPT="--data stdlib --depth 3 --tokens ${ACCEPT_TOKENS:-30000}"
TRAINED=$DIR/train/baseline/checkpoint.ddlw
PROMPT='import os
import sys


def '
mkdir -p "$DIR"

$CLI train --data stdlib --variants baseline $MODEL --mtp --mtp-weight 0.3 --max-steps "$STEPS" $TRAIN \
  --no-plots --overwrite --out "$DIR/train"
$CLI compress "$TRAINED" --drop-layers "$DROP" --force --out "$DIR/compressed.ddlw"
$CLI heal "$DIR/compressed.ddlw" --init "$TRAINED" --data stdlib ${HEAL:---tokens 60000} --force \
  --out "$DIR/healed.ddlw"
for m in trained compressed healed; do
  f=$TRAINED
  [ "$m" = trained ] || f=$DIR/$m.ddlw
  $CLI accept "$f" $ACCEPT --json > "$DIR/accept_$m.json"
done
for m in trained healed; do
  f=$TRAINED
  [ "$m" = trained ] || f=$DIR/$m.ddlw
  ${PYTHON:-python3} bench/generate.py --model "$f" --prompt-data stdlib --prompt ${PROMPT_TOKENS:-256} \
    --new ${NEW_TOKENS:-256} --prompts ${PROMPTS:-16} --short-new ${SHORT_NEW:-64} ${GENERATE_ARGS:-} \
    --json "$DIR/generate_$m.json"
  echo "== $m writes (greedy):"
  $CLI generate "$f" --prompt "$PROMPT" --max-new-tokens 200
done
echo "greedy acceptance of the draft chained 3 deep, prefix A_j per depth:"
$CLI accept-table trained="$DIR/accept_trained.json" compressed="$DIR/accept_compressed.json" \
  healed="$DIR/accept_healed.json"
