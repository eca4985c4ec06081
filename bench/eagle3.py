"""EAGLE-3 draft training throughput on the GPU at the Llama-3.1-8B shape (random weights).

    python3 bench/eagle3.py                          # Llama-3.1-8B, f16 target resident, 1 x 2048, ttt 7
    python3 bench/eagle3.py --gpu-memory 16GB        # the target streamed layer by layer (two slots)
    python3 bench/eagle3.py --batch 2 --seq 1024 --ttt 3 --steps 5
    python3 bench/eagle3.py --quick                  # a tiny target on lavapipe: runs end to end

The target: hidden 4096, 32 layers, 32 heads over 8 kv heads of 128, SwiGLU 14336, vocabulary 128256, untied,
RoPE theta 500000, no q/k norm; its weights `common.RandomWeights` (one random tensor per shape, the layers'
matrices in f16 with --trunk-dtype f16, as bench/heal.py loads the 27B), the aux layers (2, 16, 29). The
draft: one Llama layer of the same width, a draft vocabulary of 32000 (the first 32000 ids: timing does not
depend on which), `init_eagle3`. The classes are those `ddl-wgpu draft --backend wgpu` runs
(`ddl_wgpu.engine.eagle3`): per step the teacher (`WgpuEagle3Target`: the target's forward with the aux taps,
the draft-vocabulary head and its top-k, the full top-1) and the draft's step (`WgpuEagle3Draft.step`: the
unrolled TTT forward, top-k KL, backward, clip, AdamW), on one batch of random tokens.

Printed: seconds per training step (median of --steps after --warmup) split into the teacher and the draft,
draft training tokens/s = B·T / (teacher + draft s), the engine's GPU memory peak (`Gpu.peak`: every buffer
the library allocated, the upload staging a streamed target counts) beside the draft job's memory plan for the
same run (`engine.eagle3_plan.eagle3_count`, counted before anything is allocated: a GPU run checks the count) and
nvidia-smi's used memory where nvidia-smi exists. JSON as docs/benchmarks.md says (--json, else
$OUT/eagle3.json, else bench/results/).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from common import RandomWeights, adapter_line, json_path, median, now_iso, open_gpu  # noqa: E402

from ddl_ref import eagle3 as e3  # noqa: E402
from ddl_ref.config import ModelConfig  # noqa: E402
from ddl_wgpu.engine import eagle3 as ge3  # noqa: E402
from ddl_wgpu.engine import eagle3_plan as e3plan  # noqa: E402
from ddl_wgpu.engine.gpumem import parse_size  # noqa: E402
from ddl_wgpu.engine.stream import WeightSource  # noqa: E402

LLAMA_8B = dict(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                ffn_hidden=14336, max_seq_len=8192, rope_theta=500000.0, tie_embeddings=False,
                qk_norm="none")  # fmt: skip
QUICK = dict(vocab_size=256, d_model=32, n_layers=4, n_heads=2, n_kv_heads=1, head_dim=16, ffn_hidden=64,
             max_seq_len=64, rope_theta=10000.0, tie_embeddings=False, qk_norm="none")  # fmt: skip


def nvidia_smi_used() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)  # fmt: skip
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a tiny target (lavapipe smoke run)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--k", type=int, default=64, help="the teacher's top-k over the draft vocabulary")
    ap.add_argument("--trunk-dtype", default="f16", choices=("f16", "f32"))
    ap.add_argument("--gpu-memory", default=None, help="with a budget the target streams its layers")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.quick:
        a.batch, a.seq, a.ttt, a.draft_vocab, a.k, a.trunk_dtype = 2, 16, 3, 48, 8, "f32"
        a.steps, a.warmup = min(a.steps, 2), 1
    cfg = ModelConfig(**(QUICK if a.quick else LLAMA_8B))
    gpu = open_gpu(a.device)
    print(adapter_line(gpu))
    streamed = a.gpu_memory is not None
    budget = parse_size(a.gpu_memory) if streamed else None
    aux = e3.default_aux_layers(cfg.n_layers)
    Vd = min(a.draft_vocab, cfg.vocab_size)
    counts = np.zeros(cfg.vocab_size, np.int64)
    counts[:Vd] = 1
    d2t, t2d = e3.draft_vocab(counts, Vd)
    ecfg = e3.Eagle3Config(hidden=cfg.d_model, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                           intermediate=cfg.ffn_hidden, vocab=cfg.vocab_size, draft_vocab=Vd, aux_layers=aux,
                           rope_theta=cfg.rope_theta, rms_eps=cfg.rms_eps, ttt=a.ttt)  # fmt: skip
    # the draft job's memory plan (`plan_eagle3`, counted without allocating) for this run, printed beside the
    # engine's measured peak: a GPU run checks the count (the bench's teacher top-k is --k; no greedy chain)
    plan = e3plan.eagle3_count(gpu, cfg, ecfg, a.batch, a.seq, a.k, a.trunk_dtype, streamed)
    plan = dataclasses.replace(plan, budget_bytes=budget)
    print(plan.line())
    weights = RandomWeights(cfg, 0, f16=a.trunk_dtype == "f16")
    t0 = time.perf_counter()
    target = ge3.WgpuEagle3Target(gpu, weights, cfg, aux, d2t, a.k, a.batch, a.trunk_dtype, streamed,
                                  WeightSource(weights))  # fmt: skip
    load_s = time.perf_counter() - t0
    draft = ge3.WgpuEagle3Draft(target, e3.init_eagle3(ecfg, 0), ecfg, d2t, t2d, a.batch, a.k)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab_size, size=(a.batch, a.seq))
    mask = e3.loss_mask_from_lengths(np.full(a.batch, a.seq), a.seq)
    teach, step, losses = [], [], []
    for i in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        batch = target(ids)
        t1 = time.perf_counter()
        loss, norm, finite = draft.step(batch, ids, mask, 1e-4, i + 1)
        t2 = time.perf_counter()
        if i >= a.warmup:
            teach.append(t1 - t0)
            step.append(t2 - t1)
        losses.append(loss)
        print(f"  step {i + 1}: loss {loss:.4f}, grad norm {norm:.4g}, finite {finite}, teacher {t1 - t0:.3f} s, "
              f"draft {t2 - t1:.3f} s", flush=True)  # fmt: skip
    tm, dm = median(teach), median(step)
    tokens = a.batch * a.seq
    out = {
        "time": now_iso(),
        "adapter": adapter_line(gpu),
        "shape": "quick" if a.quick else "llama-3.1-8b",
        "batch": a.batch,
        "seq": a.seq,
        "ttt": a.ttt,
        "draft_vocab": Vd,
        "k": a.k,
        "trunk_dtype": a.trunk_dtype,
        "streamed": streamed,
        "gpu_memory_budget": budget,
        "target_load_s": load_s,
        "teacher_s": tm,
        "draft_step_s": dm,
        "tokens_per_s": tokens / (tm + dm),
        "draft_only_tokens_per_s": tokens / dm,
        "engine_peak_bytes": gpu.peak,
        "plan": plan.to_dict(),
        "nvidia_smi_used": nvidia_smi_used(),
        "losses": losses,
    }
    print(f"teacher {tm:.3f} s + draft step {dm:.3f} s per step of {a.batch} x {a.seq} tokens (ttt {a.ttt}): "
          f"{out['tokens_per_s']:.1f} draft training tokens/s ({out['draft_only_tokens_per_s']:.1f} the draft "
          f"alone); GPU memory peak {gpu.peak / 2**20:.2f} MiB (engine count; the plan counted "
          f"{plan.peak_bytes / 2**20:.2f} MiB), nvidia-smi "
          f"{out['nvidia_smi_used'] or '-'}; target {'streamed' if streamed else 'resident'}, loaded in "
          f"{load_s:.1f} s")  # fmt: skip
    if not all(np.isfinite(losses)):
        print("error: a non-finite loss", file=sys.stderr)
        return 1
    path = json_path(a.json, "eagle3")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
