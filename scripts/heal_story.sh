#!/usr/bin/env bash
# The heal story on the embedded corpus: train a small byte-level model with a jointly trained MTP draft
# (--mtp), compress it (keep 3/4 of each SwiGLU's channels), measure the draft's greedy acceptance (it drops:
# the trunk changed under it), heal the draft on the compressed trunk's own predictions, measure again (it
# recovers). The healed model then writes a continuation of a Python prompt with and without speculative
# decoding through its draft (the same text); last, the table.
#
# Why these settings (3 blocks, 1000 steps at lr 2e-2, --ffn-keep 0.75, heal at lr 1e-3 on 40k tokens, the
# prompt) and what else was tried: docs/experiments.md#how-the-demos-heal-stories-got-their-settings; what the
# story prints: docs/demo.md.
#
#   scripts/heal_story.sh [CLI] [DIR] [BACKEND]   CLI defaults to .venv/bin/ddl-wgpu, DIR to runs/demo/heal,
#                                                 BACKEND (auto, ref or wgpu) to auto
set -euo pipefail
CLI=${1:-.venv/bin/ddl-wgpu}
DIR=${2:-runs/demo/heal}
BACKEND=${3:-auto}
TRAINED=$DIR/train/baseline/checkpoint.ddlw
ACCEPT="--data stdlib --depth 3 --tokens 20000 --backend $BACKEND"
WHAT=model
PROMPT=$'class Context(object):\n    def __init__(self'

$CLI train --data stdlib --variants baseline --preset tiny --n-layers 3 --mtp --mtp-weight 0.3 --max-steps 1000 \
  --eval-interval 250 --eval-batches 4 --batch-size 8 --seq-len 128 --learning-rate 2e-2 --warmup-steps 30 \
  --max-tokens 400000 --no-plots --backend "$BACKEND" --overwrite --out "$DIR/train"
$CLI compress "$TRAINED" --ffn-keep 0.75 --force --out "$DIR/compressed.ddlw"
source "$(dirname "$0")/heal_and_show.sh"
