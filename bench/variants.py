"""Every variant at one preset on one GPU: parameters, GPU memory for training at (batch, seq), the evaluation
loss of the freshly initialised model on `stdlib` windows, and the time of a training step.

    python3 bench/variants.py --preset small --batch 8 --seq 1024

Memory is what the engine allocates: parameters, gradients and both AdamW moments (4 × params × 4 B) plus the
activations and scratch of one `Work` (the DDL d_v = 4 state is C × 4 floats per token per saved copy).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from ddl_ref.config import ModelVariant, preset
from ddl_ref.params import init_params
from ddl_wgpu.data import ByteTokenizer, eval_windows
from ddl_wgpu.engine.net import Net
from ddl_wgpu.engine.step import AdamW
from ddl_wgpu.engine.trunk import TrunkWork
from ddl_wgpu.jobs.train import evaluate
from ddl_wgpu.runtime.gpu import Gpu


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--variants", default="all")
    ap.add_argument("--eval-batches", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "bench/results"), "variants.json"))
    a = ap.parse_args()
    gpu = Gpu()
    print(f"adapter: {gpu.name}")
    base = preset(a.preset)
    ds = eval_windows(
        "stdlib",
        tokenizer=ByteTokenizer(),
        seq_len=a.seq,
        batch_size=a.batch,
        max_tokens=a.batch * a.seq * a.eval_batches,
        vocab_size=base.vocab_size,
    )
    variants = (
        list(ModelVariant) if a.variants == "all" else [ModelVariant.parse(v) for v in a.variants.split(",")]
    )
    rows = []
    for v in variants:
        cfg = v.resolve_config(base)
        before = gpu.allocated
        net = Net(gpu, cfg, init_params(cfg, 0), work_class=TrunkWork)
        p_bytes = gpu.allocated - before
        work = net.work(a.batch, a.seq)
        w_bytes = gpu.allocated - before - p_bytes
        ev = evaluate(net, ds, 0, spectral=False)
        b = ds.batch(0)
        work.step(b.ids, b.lengths, AdamW(lr=1e-4, step=1))  # warm-up (pipelines)
        t0 = time.perf_counter()
        for s in range(a.steps):
            r = work.step(b.ids, b.lengths, AdamW(lr=1e-4, step=s + 2))
        dt = (time.perf_counter() - t0) / a.steps
        rows.append(
            {
                "variant": v.slug,
                "params": net.num_params,
                "param_state_gb": p_bytes / 1e9,
                "activations_gb": w_bytes / 1e9,
                "total_gb": (p_bytes + w_bytes) / 1e9,
                "eval_loss": ev["metrics"]["loss"],
                "eval_ppl": ev["metrics"]["perplexity"],
                "s_per_step": dt,
                "tokens_per_s": a.batch * a.seq / dt,
                "last_loss": r.loss,
            }
        )
        print(json.dumps(rows[-1]))
        del work, net
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(
        json.dumps(
            {"adapter": gpu.name, "preset": a.preset, "batch": a.batch, "seq": a.seq, "rows": rows}, indent=2
        )
    )
    print(f"\n{'variant':<13}{'params':>13}{'GPU GB':>9}{'eval loss':>11}{'s/step':>9}{'tok/s':>10}")
    for r in rows:
        print(
            f"{r['variant']:<13}{r['params']:>13,}{r['total_gb']:>9.2f}{r['eval_loss']:>11.4f}"
            f"{r['s_per_step']:>9.3f}{r['tokens_per_s']:>10,.0f}"
        )


if __name__ == "__main__":
    main()
