#!/usr/bin/env bash
# The EAGLE-3 story on the embedded corpus: train a small byte-level model with a jointly trained MTP draft
# (--mtp, as scripts/heal_story.sh, with 4 blocks since an EAGLE-3 draft reads three of them), then train an
# EAGLE-3 draft for it (`ddl-wgpu draft`) on as many tokens as the MTP draft saw, measure both drafts' greedy acceptance chained 3 deep on the same windows (`accept`, then
# `accept-table`), and decode the same prompt plain, with the MTP draft and with the EAGLE-3 draft (the same
# greedy text; the summary lines on standard error give each one's tokens/s); last, export the draft as the
# folder vLLM and SGLang load. What it printed and why these settings: docs/eagle3.md#the-story.
#
#   scripts/eagle3_story.sh [CLI] [DIR] [BACKEND]   CLI defaults to .venv/bin/ddl-wgpu, DIR to runs/demo/eagle3,
#                                                   BACKEND to ref (EAGLE-3 drafts run on the numpy engine)
set -euo pipefail
# SKIP_TRAIN=1 reuses the model DIR already holds (training is deterministic: the same model again)
CLI=${1:-.venv/bin/ddl-wgpu}
DIR=${2:-runs/demo/eagle3}
BACKEND=${3:-ref}
TRAINED=$DIR/train/baseline/checkpoint.ddlw
ACCEPT="--data stdlib --depth 3 --tokens 20000 --backend $BACKEND"
PROMPT=$'class Context(object):\n    def __init__(self'

[ -f "$TRAINED" ] && [ -n "${SKIP_TRAIN:-}" ] || $CLI train --data stdlib --variants baseline --preset tiny --n-layers 4 --mtp --mtp-weight 0.3 --max-steps 1000 \
  --eval-interval 250 --eval-batches 4 --batch-size 8 --seq-len 128 --learning-rate 2e-2 --warmup-steps 30 \
  --max-tokens 400000 --no-plots --backend "$BACKEND" --overwrite --out "$DIR/train"
# As many tokens as the MTP draft saw (1000 steps x 8 windows x 128 tokens): about 1000 steps of 16 windows of
# 64 tokens (every tenth window held out). --ttt 3 (not SpecForge's 7: on the numpy engine a 7-deep unroll of
# 128-token windows takes seconds a step on this 2-core machine; 3 is the depth accept measures) and 64-token
# windows keep it to a few minutes. --aux-layers 1,2,3: the inputs of the three upper blocks (the default
# (2, L//2, L-3) of a 4-block target names layer 2 twice).
$CLI draft "$TRAINED" --data stdlib --tokens 1137920 --seq-len 64 --batch-size 16 --ttt 3 --learning-rate 3e-3 \
  --aux-layers 1,2,3 --eval-interval 250 --backend "$BACKEND" --force --out "$DIR/eagle3.ddlw"
$CLI accept "$TRAINED" $ACCEPT --json > "$DIR/accept_mtp.json"
$CLI accept "$TRAINED" --draft "$DIR/eagle3.ddlw" $ACCEPT --json > "$DIR/accept_eagle3.json"
echo
echo "the model continues a prompt (greedy: plain, with its MTP draft, with the EAGLE-3 draft; the same text,"
echo "the summary lines on standard error give the decode tokens/s and each draft's acceptance):"
printf '%s' "$PROMPT"
echo
for spec in "" "--speculative --depth 3" "--speculative --depth 3 --draft $DIR/eagle3.ddlw"; do
  echo "--- ${spec:-plain}:"
  $CLI generate "$TRAINED" --prompt "$PROMPT" --max-new-tokens 80 --backend "$BACKEND" $spec
  echo
done
$CLI export-hf "$DIR/eagle3.ddlw" "$DIR/eagle3-hf" --force
echo
echo "greedy acceptance of each draft chained 3 deep, prefix A_j per depth:"
$CLI accept-table mtp="$DIR/accept_mtp.json" eagle3="$DIR/accept_eagle3.json"
