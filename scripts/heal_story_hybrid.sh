#!/usr/bin/env bash
# The heal story on a hybrid (Qwen3.5-family) model, on the embedded corpus: train a small byte-level hybrid
# (--arch qwen3_5: two Gated DeltaNet layers, then a gated full-attention layer with partial RoPE; zero-centred
# norms) with a jointly trained MTP draft (--mtp: one gated full-attention block with partial RoPE), compress
# its trunk, measure the draft's greedy acceptance (it drops: the trunk changed under it), heal the draft on the
# compressed trunk's own predictions, measure again (it recovers). The healed model then continues a Python
# prompt with and without speculative decoding through its draft (the same text: the decoder's cache keeps each
# Gated DeltaNet layer's conv window and delta-rule state, and after a partial acceptance the state of the last
# accepted token); then the table, and last the export (`export-hf`, whose summary says whether vLLM and SGLang
# build every written mtp.* tensor at its shape). The trunk's loss before and after compress is printed too, to
# show what changed under the draft. The draft is in Qwen3.5's layout, so compress narrows it with the trunk and
# heal narrows the trained draft to the compressed width and trains stacked, as vLLM and SGLang build and run
# it (docs/heal.md#which-runtime-serves-the-draft).
#
# Why these settings (3 blocks, 300 steps at lr 2e-2, --ffn-keep 0.5, heal as in the transformer story, the
# prompt) and what else was tried: docs/experiments.md#how-the-demos-heal-stories-got-their-settings; what the
# story prints: docs/demo.md.
#
#   scripts/heal_story_hybrid.sh [CLI] [DIR] [BACKEND]   CLI defaults to .venv/bin/ddl-wgpu, DIR to
#                                                        runs/demo/heal-hybrid, BACKEND (auto, ref, wgpu) to auto
set -euo pipefail
CLI=${1:-.venv/bin/ddl-wgpu}
DIR=${2:-runs/demo/heal-hybrid}
BACKEND=${3:-auto}
TRAINED=$DIR/train/baseline/checkpoint.ddlw
ACCEPT="--data stdlib --depth 3 --tokens 20000 --backend $BACKEND"
EVAL="--data stdlib --max-tokens 20000 --backend $BACKEND"
WHAT=hybrid
PROMPT='    def __init__(self, '

$CLI train --data stdlib --arch qwen3_5 --variants baseline --preset tiny --n-layers 3 --mtp --mtp-weight 0.3 \
  --max-steps 300 --eval-interval 100 --eval-batches 4 --batch-size 8 --seq-len 128 --learning-rate 2e-2 \
  --warmup-steps 30 --max-tokens 400000 --no-plots --backend "$BACKEND" --overwrite --out "$DIR/train"
$CLI inspect "$TRAINED" | grep '^layers'
$CLI compress "$TRAINED" --ffn-keep 0.5 --force --out "$DIR/compressed.ddlw"
echo "the trunk's loss on the first 20k bytes, trained and compressed:"
$CLI eval "$TRAINED" $EVAL
$CLI eval "$DIR/compressed.ddlw" $EVAL
source "$(dirname "$0")/heal_and_show.sh"
echo
echo "the healed $WHAT exported as a Hugging Face folder; its mtp.* checked against what vLLM and SGLang build:"
$CLI export-hf "$DIR/healed.ddlw" "$DIR/hf" --force | grep -E '^(architecture|mtp):'
