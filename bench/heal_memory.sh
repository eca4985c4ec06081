#!/usr/bin/env bash
# Issue 30's GPU measurements in one command (about 9 minutes on the H200: 168 s, then the model's write, 99 s,
# and the heal, 252 s), each part under its own `timeout` so that one overrunning leaves the other's output: heal's trunk pass of the Qwen3.8-27B shape resident and streamed
# within 16 GB, then the draft's phase, with heal's default chain attention for this layout, stacked
# (bench/heal.py --gpu-memory: peak GPU memory by the engine's count and nvidia-smi's beside the plan's, tokens/s,
# the draft's steps, the 1M-token epoch estimate); then an end-to-end `ddl-wgpu heal` of the 40-layer cut written
# to disk, 36 GB (bench/heal_e2e.py: the write's time, wall time, peak GPU memory per phase, peak host RSS).
#   bench/heal_memory.sh [OUTDIR]        (default $OUT, else bench/results): logs and JSON there
# HEAL_MEMORY_T1 / HEAL_MEMORY_T2: the parts' limits in seconds (default 300 and 500).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-bench/results}}"
mkdir -p "$out"
(nvidia-smi; df -h . /dev/shm; free -g) >"$out/heal_memory_machine.txt" 2>&1
timeout -k 20 "${HEAL_MEMORY_T1:-300}" python3 bench/heal.py --shape qwen38-27b --trunk-dtype f16 --gpu-memory 16GB \
    --chain-attention stacked --pass-windows 309 --steps 3 --json "$out/heal_gpu_memory.json" 2>&1 |
    tee "$out/heal_gpu_memory.log"
echo "bench/heal.py exit ${PIPESTATUS[0]}" | tee -a "$out/heal_gpu_memory.log"
timeout -k 20 "${HEAL_MEMORY_T2:-500}" python3 bench/heal_e2e.py --shape qwen38-14b --gpu-memory 16GB --tokens 20000 \
    --json "$out/heal_e2e.json" 2>&1 | tee "$out/heal_e2e.log"
echo "bench/heal_e2e.py exit ${PIPESTATUS[0]}" | tee -a "$out/heal_e2e.log"
