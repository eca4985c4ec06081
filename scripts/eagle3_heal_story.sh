#!/usr/bin/env bash
# The EAGLE-3 heal story: the story model of scripts/eagle3_story.sh (run first when DIR does not hold its model
# and draft) is compressed by dropping block 2 of its 4 (`compress --drop-layers 2`), which changes the rows the
# EAGLE-3 draft reads (it taps the inputs of blocks 1, 2, 3: block 2 is gone, so its tap moves to the input of the
# next kept block, the same point of the stream; the commands print the mapping). The draft's greedy acceptance
# chained 3 deep drops on the compressed model; `heal --draft` retrains it there by self-distillation from its own
# weights, and the acceptance recovers. The healed draft then decodes a prompt on the compressed model (the same
# greedy text as plain decoding). Last, one table of all. What it printed: docs/eagle3.md#the-heal-story.
#
#   scripts/eagle3_heal_story.sh [CLI] [DIR] [BACKEND]   CLI defaults to .venv/bin/ddl-wgpu, DIR to
#                                                        runs/demo/eagle3, BACKEND to ref
set -euo pipefail
CLI=${1:-.venv/bin/ddl-wgpu}
DIR=${2:-runs/demo/eagle3}
BACKEND=${3:-ref}
TRAINED=$DIR/train/baseline/checkpoint.ddlw
SMALL=$DIR/small.ddlw
ACCEPT="--data stdlib --depth 3 --tokens 20000 --backend $BACKEND"
PROMPT=$'class Context(object):\n    def __init__(self'

if [ ! -f "$TRAINED" ] || [ ! -f "$DIR/eagle3.ddlw" ] || [ ! -f "$DIR/accept_eagle3.json" ]; then
  "$(dirname "$0")/eagle3_story.sh" "$CLI" "$DIR" "$BACKEND"
fi
$CLI compress "$TRAINED" --drop-layers 2 --force --out "$SMALL"
echo "--- the draft on the compressed model, before the heal:"
$CLI accept "$SMALL" --draft "$DIR/eagle3.ddlw" $ACCEPT --json > "$DIR/accept_small_eagle3.json"
# 300 steps of 16 windows of 64 tokens (every tenth window held out), the story's draft settings otherwise, at a
# third of its learning rate: the draft starts trained
$CLI heal "$SMALL" --draft "$DIR/eagle3.ddlw" --data stdlib --tokens 341376 --window 64 --batch 16 --chain 3 \
  --lr 1e-3 --eval-every 100 --backend "$BACKEND" --force --out "$DIR/eagle3_healed.ddlw"
$CLI accept "$SMALL" --draft "$DIR/eagle3_healed.ddlw" $ACCEPT --json > "$DIR/accept_small_healed.json"
echo
echo "the compressed model continues a prompt (greedy: plain, then with the healed EAGLE-3 draft; the same text):"
for spec in "" "--speculative --depth 3 --draft $DIR/eagle3_healed.ddlw"; do
  echo "--- ${spec:-plain}:"
  $CLI generate "$SMALL" --prompt "$PROMPT" --max-new-tokens 80 --backend "$BACKEND" $spec
  echo
done
echo
echo "greedy acceptance of the EAGLE-3 draft chained 3 deep, prefix A_j per depth (the full model, the model"
echo "with block 2 dropped before and after the heal):"
$CLI accept-table full="$DIR/accept_eagle3.json" dropped="$DIR/accept_small_eagle3.json" \
  healed="$DIR/accept_small_healed.json"
