#!/usr/bin/env bash
# The heal story on the embedded corpus: train a tiny model with a jointly trained MTP draft
# (--mtp), compress it (drop its last block), measure the draft's greedy acceptance (it drops: the trunk
# changed under it), heal the draft on the compressed trunk's own predictions, measure again (it recovers).
# The healed model then generates with and without speculative decoding through its draft; last, the table.
# `heal` runs with the reference heal tool's defaults except its token budget (40k instead of 200k: on the
# numpy backend a refresh of 200k tokens' chain inputs takes minutes, and 40k recovers the acceptance). The
# training run caps its evaluations at 4 batches (--eval-batches): the story needs the draft, not exact
# training metrics, and whole-split evaluations of 400k tokens cost more than the training on numpy.
#
#   scripts/heal_story.sh [CLI] [DIR] [BACKEND]   CLI defaults to .venv/bin/ddl-wgpu, DIR to runs/demo/heal,
#                                                 BACKEND (auto, ref or wgpu) to auto
set -euo pipefail
CLI=${1:-.venv/bin/ddl-wgpu}
DIR=${2:-runs/demo/heal}
BACKEND=${3:-auto}
TRAINED=$DIR/train/baseline/checkpoint.ddlw
ACCEPT="--data stdlib --depth 3 --tokens 20000 --backend $BACKEND"

$CLI train --data stdlib --variants baseline --preset tiny --mtp --mtp-weight 0.3 --max-steps 150 \
  --eval-interval 50 --eval-batches 4 --batch-size 8 --seq-len 128 --learning-rate 3e-3 --warmup-steps 10 \
  --max-tokens 400000 --no-plots --backend "$BACKEND" --overwrite --out "$DIR/train"
$CLI compress "$TRAINED" --drop-layers 1 --out "$DIR/compressed.ddlw"
$CLI accept "$TRAINED" $ACCEPT --json > "$DIR/accept_trained.json"
$CLI accept "$DIR/compressed.ddlw" $ACCEPT --json > "$DIR/accept_compressed.json"
$CLI heal "$DIR/compressed.ddlw" --init "$TRAINED" --data stdlib --tokens 40000 --backend "$BACKEND" \
  --out "$DIR/healed.ddlw"
$CLI accept "$DIR/healed.ddlw" $ACCEPT --json > "$DIR/accept_healed.json"
echo
echo "the healed model writes (greedy, without and with its draft: the same text; the summary lines on"
echo "standard error give the tokens/s and the draft's acceptance):"
for spec in "" "--speculative --depth 3"; do
  $CLI generate "$DIR/healed.ddlw" --prompt "def " --max-new-tokens 64 --backend "$BACKEND" $spec
  echo
done
echo
echo "greedy acceptance of the draft chained 3 deep, prefix A_j per depth:"
$CLI accept-table trained="$DIR/accept_trained.json" compressed="$DIR/accept_compressed.json" \
  healed="$DIR/accept_healed.json"
