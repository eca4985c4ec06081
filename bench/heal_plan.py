"""heal's GPU memory plan at a shape, counted on this machine without a GPU's work: the trunk's phase and the draft's
(`heal_gpu.plan_trunk_job`, the count `ddl-wgpu heal --gpu-memory` plans by, on a `gpumem.DryGpu`), for each chain
attention, and the draft phase's buffers by label.

    python3 bench/heal_plan.py --shape qwen38-27b --trunk-dtype f16 --gpu-memory 16GB --limits h200
    python3 bench/heal_plan.py --shape qwen38-14b --trunk-dtype f16 --gpu-memory 12GB --limits h200
    python3 bench/heal_plan.py --shape quick-hybrid --gpu-memory 4MB        # this machine's adapter (a test)

The count depends on the adapter's limits (how tensors are split into buffers and bindings): `--limits h200` plans
with the H200's (docs/wgpu-notes.md: max-buffer-size 4 292 870 144, max-storage-buffer-binding-size 2 147 483 644,
48 KiB of workgroup storage) on a stand-in of the local adapter, which nothing runs on; `--limits adapter` with the
local adapter's own (lavapipe's 2 GiB buffer cannot hold the 27B's f16 embedding). Heal's defaults (window 128,
batch 4, top-k 32, chain 3) unless given; --windows the trunk pass's (default 1 M tokens' worth).
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (puts the repository root on sys.path)
from heal import SHAPES, shape_config  # noqa: E402

from ddl_wgpu import backend
from ddl_wgpu.engine import gpumem, heal_gpu
from ddl_wgpu.jobs import heal

H200 = {"max-buffer-size": 4292870144, "max-storage-buffer-binding-size": 2147483644,
        "max-compute-workgroup-storage-size": 48 << 10}  # fmt: skip


def device(limits: str):
    """The adapter the plan is counted for: this machine's, or a stand-in of it with the H200's limits."""
    real = backend.open_gpu(None)
    if limits == "adapter":
        return real
    return SimpleNamespace(limits={**real.limits, **H200}, features=real.features, info=real.info,
                           max_binding=H200["max-storage-buffer-binding-size"], max_buffer=H200["max-buffer-size"],
                           align=real.align, limits_mode="adapter", name="H200 limits (stand-in)")  # fmt: skip


def draft_labels(gpu, cfg, dtype: str, batch: int, T: int, spec: dict, top: int = 12) -> list:
    """The draft phase's live buffers at its peak, summed by label, largest first: [(label, bytes)]."""
    live: collections.Counter = collections.Counter()

    class Labelled(gpumem.DryGpu):
        def buffer(self, nbytes, label="", usage=None):
            b = super().buffer(nbytes, label)
            live[label] += b.size
            return b

        def release(self, *bufs):
            for b in bufs:
                live[b.label] -= b.size
            super().release(*bufs)

    heal_gpu.draft_phase(Labelled(gpu), cfg, dtype, batch, T, spec)
    return [(label, n) for label, n in live.most_common(top) if n]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen38-27b", choices=SHAPES)
    ap.add_argument("--trunk-dtype", default="f16", choices=heal.TRUNK_DTYPES)
    ap.add_argument("--gpu-memory", default="16GB")
    ap.add_argument("--limits", default="h200", choices=("h200", "adapter"))
    ap.add_argument("--window", type=int, default=heal.HealConfig.window)
    ap.add_argument("--batch", type=int, default=heal.HealConfig.batch)
    ap.add_argument("--topk", type=int, default=heal.HealConfig.topk)
    ap.add_argument("--chain", type=int, default=heal.HealConfig.chain)
    ap.add_argument("--windows", type=int, default=None, help="the trunk pass's windows (default 1 M tokens)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cfg = shape_config(args.shape, args.window)
    gpu, budget = device(args.limits), gpumem.parse_size(args.gpu_memory)
    windows, k = args.windows or -(-1_000_000 // args.window), min(args.topk, cfg.vocab_size)
    rows = []
    for mode in heal.CHAIN_ATTENTION:
        spec = {"k": k, "chain": args.chain, "stacked": mode == "stacked", "kl_form": "full"}
        t0 = time.perf_counter()
        try:
            plan = heal_gpu.plan_trunk_job(gpu, "heal", cfg, args.trunk_dtype, windows, args.window, args.batch,
                                           budget, k, draft=spec)  # fmt: skip
            line, out = plan.line(), plan.to_dict()
        except gpumem.GpuBudgetError as e:
            line, out = f"refused: {e}", {"refused": str(e)}
        labels = draft_labels(gpu, cfg, args.trunk_dtype, args.batch, args.window, spec)
        rows.append(
            {"chain_attention": mode, "plan": out, "draft_labels": labels, "s": time.perf_counter() - t0}
        )
        print(f"{mode}: {line} ({rows[-1]['s']:.1f} s)")
        print("  draft phase at its peak: " + ", ".join(f"{label} {gpumem.gib(n)}" for label, n in labels))
    data = {"bench": "heal_plan", "date": common.now_iso(), "host": common.host_info(), "args": vars(args),
            "limits": args.limits, "model": cfg.to_dict(), "rows": rows}  # fmt: skip
    common.write_json(common.json_path(args.json, "heal_plan.json"), data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
