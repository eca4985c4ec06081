#!/usr/bin/env bash
# The heal story on the embedded corpus: train a small byte-level model with a jointly trained MTP draft
# (--mtp), compress it (keep 3/4 of each SwiGLU's channels), measure the draft's greedy acceptance (it drops:
# the trunk changed under it), heal the draft on the compressed trunk's own predictions, measure again (it
# recovers). The healed model then writes a continuation of a Python prompt with and without speculative
# decoding through its draft (the same text); last, the table.
#
# Why these settings (measured on the numpy backend of the 2-core development machine, OPENBLAS_NUM_THREADS=1;
# the README quotes the output): with the `tiny` preset's 2 blocks and 150 steps at lr 3e-3 (train loss 2.4)
# the compressed model wrote `innnnnnnnnttttt...`. What makes the text readable within about two minutes of
# numpy training:
# - a third block (--n-layers 3, 173k parameters) and 1000 steps (1M tokens) at lr 2e-2: train loss 1.24
#   (2 blocks at 1e-2: 1.30; 3 blocks at 1e-2: 1.29, at 6e-3 and 600 steps: 2.07; lr 3e-3 and 1000 steps with
#   2 blocks: 1.74, greedy text all underscores); 1300 steps reach 1.11 and a slightly better text
#   (`, context=self):` / `"""Return self is None:` / `return self._is_special`) for about 45 s more;
# - compress --ffn-keep 0.75 instead of dropping a block: dropping either block of 2, or the middle or last of
#   3, left greedy text like `__slf_(slfarselt, 'dinty=Nonyale):`, `retuppen ()` or spaces, while keeping 3/4
#   of the SwiGLU channels keeps real identifiers and still moves the trunk enough that the draft's
#   acceptance drops (τ 2.17 -> 2.11);
# - heal --lr 1e-3 (the reference heal tool's 5e-5 is for large models): τ 2.11 -> 2.23 after heal, against
#   2.14 at 5e-5 (the trained model's: 2.17), at the same 40k tokens (about 10 s);
# - the prompt: a real stdlib class head (from _pydecimal.py, most of the 400k bytes read); 80 new tokens
#   fill the 128-token context.
# The whole script took 2 min 8 s there (about 100 s of it training); `make demo` 3 min 2 s on a fresh clone
# (3 min 13 s on a later commit, under load).
# `heal` otherwise runs with the reference heal tool's defaults except its token budget (40k instead of 200k:
# on the numpy backend a refresh of 200k tokens' chain inputs takes minutes). The training run caps its
# evaluations at 4 batches (--eval-batches): the story needs the draft, not exact training metrics.
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
