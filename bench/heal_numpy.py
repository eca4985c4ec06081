"""heal's numpy draft (`RefDraft`, what heal runs without a GPU): seconds per draft step and per held-out
evaluation forward at one chain step, per-step or stacked, on random weights.

    python3 bench/heal_numpy.py [--d-model 256 --vocab 16384 --batch 4 --seq 128 --chain 3 --stacked]

The rows of the timed chain step carry the loss (weight 1); in a stacked step the earlier steps' rows, weight
0, only feed the attention. Each figure is the median of --repeats calls after one untimed call.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402,F401  (puts the repository root on sys.path)

from ddl_ref.config import ModelConfig, MtpConfig  # noqa: E402
from ddl_ref.params import init_params  # noqa: E402
from ddl_wgpu.engine.refnet import RefDraft  # noqa: E402


def median_s(call, repeats: int) -> float:
    call()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128, help="window tokens")
    ap.add_argument("--chain", type=int, default=3, help="the chain step timed")
    ap.add_argument("--stacked", action="store_true", help="stacked chain attention (default: per-step)")
    ap.add_argument("--topk", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    d = args.d_model
    cfg = ModelConfig(vocab_size=args.vocab, d_model=d, n_layers=1, n_heads=max(1, d // 64), n_kv_heads=max(1, d // 128),
                      head_dim=64, ffn_hidden=3 * d, max_seq_len=args.seq * args.chain, mtp=MtpConfig())  # fmt: skip
    params = {n: np.asarray(a, np.float32) for n, a in init_params(cfg, np.random.default_rng(0)).items()}
    draft = RefDraft(params, cfg)
    rng = np.random.default_rng(1)
    B, W, j, k = args.batch, args.seq, args.chain, args.topk
    T = j * W if args.stacked else W
    x = rng.standard_normal((B, T, d)).astype(np.float32)
    tid = rng.integers(0, args.vocab, (B, T, k))
    tp = rng.random((B, T, k)).astype(np.float32)
    w = np.zeros((B, T), np.float32)
    w[:, -W:] = 1.0
    kw = {"chain": j} if args.stacked else {}
    n = iter(range(1, 1 << 30))
    step = median_s(lambda: draft.step(x, tid, tp, w, 1e-3, next(n), 1.0, **kw), args.repeats)
    ev = median_s(lambda: draft.loss_sum(x, tid, tp, w, **kw), args.repeats)
    form = f"stacked ({j} x {W} rows)" if args.stacked else f"per-step ({W} rows)"
    print(f"numpy draft, d {d}, vocab {args.vocab}, {B} windows, chain step {j} {form}: "
          f"step {step:.3f} s, evaluation forward {ev:.3f} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
