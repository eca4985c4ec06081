# The second half of both heal stories (sourced by scripts/heal_story.sh and scripts/heal_story_hybrid.sh, which
# set CLI, DIR, BACKEND, TRAINED, ACCEPT, PROMPT and WHAT, the model's name in the printed lines): measure the
# draft's acceptance on the trained and the compressed model, heal the draft on the compressed trunk, measure
# again, continue the prompt with and without the healed draft (the same greedy text), print the table.
$CLI accept "$TRAINED" $ACCEPT --json > "$DIR/accept_trained.json"
$CLI accept "$DIR/compressed.ddlw" $ACCEPT --json > "$DIR/accept_compressed.json"
$CLI heal "$DIR/compressed.ddlw" --init "$TRAINED" --data stdlib --tokens 40000 --lr 1e-3 --backend "$BACKEND" \
  --force --out "$DIR/healed.ddlw"
$CLI accept "$DIR/healed.ddlw" $ACCEPT --json > "$DIR/accept_healed.json"
echo
echo "the healed $WHAT continues a prompt (greedy, without and with its draft: the same text; the summary"
echo "lines on standard error give the tokens/s and the draft's acceptance):"
printf '%s' "$PROMPT"
echo
for spec in "" "--speculative --depth 3"; do
  echo "--- ${spec:-plain}:"
  $CLI generate "$DIR/healed.ddlw" --prompt "$PROMPT" --max-new-tokens 80 --backend "$BACKEND" $spec
  echo
done
echo
echo "greedy acceptance of the $WHAT's draft chained 3 deep, prefix A_j per depth:"
$CLI accept-table trained="$DIR/accept_trained.json" compressed="$DIR/accept_compressed.json" \
  healed="$DIR/accept_healed.json"
