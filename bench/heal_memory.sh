#!/usr/bin/env bash
# Issue 30's GPU measurements in one command (about 8 minutes on the H200): heal's trunk pass of the Qwen3.8-27B
# shape resident and streamed within 16 GB (bench/heal.py --gpu-memory: peak GPU memory by the engine's count and
# nvidia-smi's, tokens/s, the draft's steps, the 1M-token epoch estimate), then an end-to-end `ddl-wgpu heal` of
# the 40-layer cut written to disk (bench/heal_e2e.py: wall time, peak GPU memory, peak host RSS).
#   bench/heal_memory.sh [OUTDIR]        (default $OUT, else bench/results)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-bench/results}}"
mkdir -p "$out"
python3 bench/heal.py --shape qwen38-27b --trunk-dtype f16 --gpu-memory 16GB --json "$out/heal_gpu_memory.json"
python3 bench/heal_e2e.py --shape qwen38-14b --gpu-memory 16GB --tokens 20000 --json "$out/heal_e2e.json"
