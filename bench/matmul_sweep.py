"""GEMM sweep: the generated GEMM (`ddl_wgpu/ops/matmul.py`) and its split-K slice counts timed against
PyTorch fp32 (TF32 off) on the `small` preset's training products, in one run.

    python3 bench/matmul_sweep.py --out sweep.json             # H200: about 1-2 minutes
    python3 bench/matmul_sweep.py --quick --out /tmp/sweep.json  # tiny shapes (lavapipe: does it run end to end)

Shapes: `bench/kernels.py`'s matmul cases (4096^3, the forward NT products, the dx NN and dW TN products with
split-K, the LM head's chunk products at the engine's chunk rows, `vocab.head_chunk_rows`). The product runs on
the launcher's tiles (`LARGE_TILE` / `SMALL_TILE`, which `pick_tile` chooses between), split-K plan
included, and for the split-K products (dW, the head's dx) also at explicit slice counts (`--splits`). The tile
options once swept here (vec4 global loads, two shared stages, warp-arranged owners, other k steps) measured
no faster and were removed (docs/experiments.md).

Per case: the product once, a sample of rows x columns checked against float64; then GPU-timestamp timing,
best of `--repeats` (default 3) after the clocks settle (bench/common.py). The sweep stops starting cases
after `--budget-s` seconds (the table and the JSON are still written). Exit status 1 when a check failed.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (puts the repository root on sys.path)
import numpy as np  # noqa: E402
from kernels import matmul_cases, sizes  # noqa: E402

from ddl_wgpu.engine.vocab import head_chunk_rows  # noqa: E402
from ddl_wgpu.ops import matmul as k_mm  # noqa: E402

F32 = 4


def plan_note(gpu, M, N, K, split):
    parts = k_mm.auto_split_k(gpu, M, N, K, 1) if split is None else split
    if parts > 1 and 2 * parts <= K:
        ks, full, rest = k_mm.split_k_slices(K, parts)
        t = k_mm.pick_tile(gpu, M, N, full)
        return f"split {full}x{ks}" + (f"+{rest}" if rest else "") + f" {t.bm}x{t.bn}"
    t = k_mm.pick_tile(gpu, M, N)
    return f"{t.bm}x{t.bn} bk{t.bk}"


class Case:
    """One product's inputs (rotated copies), output buffer and float64 sample reference."""

    def __init__(self, gpu, rng, M, N, K, ta, tb, rotate):
        self.gpu, self.M, self.N, self.K, self.ta, self.tb = gpu, M, N, K, ta, tb
        self.a_shape = (K, M) if ta else (M, K)
        self.b_shape = (N, K) if tb else (K, N)
        rot = 1 if 4.0 * (M * K + K * N) > 240e6 else rotate  # beyond 4x the H200's L2 one copy misses anyway
        self.As = [rng.standard_normal(self.a_shape, dtype=np.float32) for _ in range(rot)]
        self.Bs = [rng.standard_normal(self.b_shape, dtype=np.float32) for _ in range(rot)]
        self.abufs = [gpu.upload(a) for a in self.As]
        self.bbufs = [gpu.upload(b) for b in self.Bs]
        self.c = gpu.buffer(M * N * F32, label="C")
        self.rows = np.unique(np.r_[0, M - 1, rng.integers(0, M, 6)])
        self.cols = np.unique(np.r_[0, N - 1, rng.integers(0, N, 6)])
        opA = self.As[0].T if ta else self.As[0]
        opB = self.Bs[0].T if tb else self.Bs[0]
        self.ref = opA[self.rows].astype(np.float64) @ opB[:, self.cols].astype(np.float64)

    def calls(self, split):
        g = self.gpu
        return [
            k_mm.matmul(
                g, self.c, a, b, self.M, self.N, self.K, trans_a=self.ta, trans_b=self.tb, split_k=split
            )
            for a, b in zip(self.abufs, self.bbufs, strict=True)
        ]

    def sample(self, calls):
        calls[0].run(self.gpu)
        got = np.stack(
            [self.gpu.download(self.c, np.float32, self.N, int(r) * self.N * F32) for r in self.rows]
        )
        return got[:, self.cols]

    def torch_ms(self, torch, dev, target, repeats):
        xs = [
            (torch.from_numpy(a).to(dev), torch.from_numpy(b).to(dev))
            for a, b in zip(self.As, self.Bs, strict=True)
        ]
        out = torch.empty(self.M, self.N, device=dev, dtype=torch.float32)
        ta, tb = self.ta, self.tb
        fns = [lambda x=x, w=w: torch.matmul(x.T if ta else x, w.T if tb else w, out=out) for x, w in xs]
        t = common.torch_time_ms(torch, dev, fns, target, repeats)
        common.torch_free(torch, dev)
        return t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes (lavapipe smoke test)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--splits", default="8,16,24,32", help="explicit split-K counts tried")
    ap.add_argument("--only", default="", help="substring filter on the case labels")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--target-ms", type=float, default=15.0, help="length of one timed repeat")
    ap.add_argument("--rotate", type=int, default=2, help="input copies rotated among (small operands)")
    ap.add_argument("--warm-up-s", type=float, default=2.0, help="GEMMs before the first timed case")
    ap.add_argument("--budget-s", type=float, default=120.0, help="start no case after this many seconds")
    ap.add_argument("--torch", default="auto", choices=["auto", "cuda", "cpu", "none"])
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", "--json", dest="out", default=None)
    args = ap.parse_args(argv)

    t_start = time.perf_counter()
    gpu = common.open_gpu(args.device)
    torch, tdev = common.torch_setup(args.torch)
    print(f"adapter: {common.adapter_line(gpu)}")
    print(f"torch peer: {common.torch_info(torch, tdev) if torch else tdev}")
    S = sizes(argparse.Namespace(quick=args.quick, batch=args.batch, seq=args.seq))
    S["head_chunk"] = head_chunk_rows(gpu, S["N"], S["cfg"].d_model, S["cfg"].vocab_size)
    splits = [int(s) for s in args.splits.split(",") if s]
    rng = np.random.default_rng(0)
    results, over = [], False
    common.warm_up(gpu, 0.0 if args.quick else args.warm_up_s)
    # the LM head's dx (the slowest product against cuBLAS) first, in case the budget runs out
    for label, M, N, K, ta, tb in sorted(matmul_cases(S), key=lambda c: "head dx" not in c[0]):
        if args.only and args.only not in label:
            continue
        if time.perf_counter() - t_start > args.budget_s:
            over = True
            break
        lay = ("T" if ta else "N") + ("T" if tb else "N")
        shape = f"{M}x{N}x{K} {lay}"
        case = Case(gpu, rng, M, N, K, ta, tb, args.rotate)
        runs = [("default", None)]
        if "dW" in label or "head dx" in label:  # the split-K products: slice counts
            runs += [("default", p) for p in splits if 2 * p <= K]
        for v, split in runs:
            if time.perf_counter() - t_start > args.budget_s:
                over = True
                break
            t0 = time.perf_counter()
            e = {"label": label, "shape": shape, "variant": v, "split": split, "flop": 2.0 * M * N * K}
            try:
                e["plan"] = plan_note(gpu, M, N, K, split)
                calls = case.calls(split)
                got = case.sample(calls)
                e["err"] = common.rel_err(got, case.ref)
                e["ok"] = bool(e["err"] <= 1e-4)
                e["gpu"] = common.gpu_time_ms(gpu, calls, args.target_ms, args.repeats)
                e["tflops"] = e["flop"] / e["gpu"]["ms"] / 1e9
                del calls
                status = f"{e['gpu']['ms']:.4g} ms {e['tflops']:.3g} TF/s err {e['err']:.1e}"
                status += "" if e["ok"] else " FAIL"
            except Exception as ex:  # a variant that cannot run here (limits) is reported, not fatal
                e["error"] = f"{ex.__class__.__name__}: {ex}"[:300]
                status = "ERROR " + e["error"][:120]
            e["wall_s"] = time.perf_counter() - t0
            name = v + (f" split {split}" if split else "")
            print(f"  {label:<26} {shape:<22} {name:<18} {status}  [{e['wall_s']:.1f}s]", flush=True)
            results.append(e)
        if torch is not None and not over:
            try:
                t = case.torch_ms(torch, tdev, args.target_ms, args.repeats)
                results.append({"label": label, "shape": shape, "variant": "torch fp32", "gpu": t,
                                "flop": 2.0 * M * N * K, "tflops": 2.0 * M * N * K / t["ms"] / 1e9})  # fmt: skip
            except Exception as ex:
                results.append(
                    {"label": label, "shape": shape, "variant": "torch fp32", "error": str(ex)[:300]}
                )
        del case
        gc.collect()

    failed = [f"{e['label']} {e['variant']} {e.get('split')}" for e in results if e.get("ok") is False]
    data = {
        "bench": "matmul_sweep", "date": common.now_iso(),
        "command": " ".join(["python3", "bench/matmul_sweep.py", *sys.argv[1:]]),
        "adapter": common.adapter_line(gpu), "adapter_info": gpu.info, "host": common.host_info(),
        "torch": common.torch_info(torch, tdev) if torch else {"skipped": tdev},
        "sizes": {"preset": "tiny" if args.quick else "small", "B": S["B"], "T": S["T"], "head_chunk": S["head_chunk"]},
        "tiles": [vars(k_mm.LARGE_TILE), vars(k_mm.SMALL_TILE)],
        "results": results, "failed": failed, "budget_exhausted": over, "wall_s": time.perf_counter() - t_start,
    }  # fmt: skip
    common.write_json(common.json_path(args.out, "matmul_sweep.json"), data)

    # the table: one row per shape, TFLOP/s per variant, the best against torch fp32
    variants = ["default"]
    cols = [*variants, "best split"]
    by = {}
    for e in results:
        by.setdefault((e["label"], e["shape"]), {})
        row = by[(e["label"], e["shape"])]
        if "tflops" not in e:
            continue
        if e["variant"] == "torch fp32":
            row["torch"] = e["tflops"]
        elif e.get("split"):
            if e["tflops"] > row.get("best split", (0, 0))[0]:
                row["best split"] = (e["tflops"], e["split"])
        else:
            row[e["variant"]] = e["tflops"]
            row.setdefault("plan_" + e["variant"], e.get("plan", ""))
    rows = []
    for (label, shape), row in by.items():
        cells = [label, shape, row.get("plan_default", "")]
        for c in cols:
            x = row.get(c)
            cells.append("-" if x is None else (f"{x[0]:.3g} (p{x[1]})" if c == "best split" else f"{x:.3g}"))
        best = max(
            [row[c] for c in variants if c in row] + ([row["best split"][0]] if "best split" in row else []),
            default=None,
        )
        tt = row.get("torch")
        cells += [common.fmt(tt, ".3g"), common.fmt(best / row["default"] if best and row.get("default") else None, ".2f"),
                  common.fmt(best / tt if best and tt else None, ".2f")]  # fmt: skip
        rows.append(cells)
    headers = ["case", "shape", "default plan", *cols, "torch fp32", "best/default", "best/torch"]
    print()
    print(f"adapter: {data['adapter']}")
    print(f"torch: {data['torch']}")
    print(
        common.table(
            headers, rows, title=f"GEMM variants, TFLOP/s (best of {args.repeats}; {data['sizes']['preset']})"
        )
    )
    print(
        f"total {data['wall_s']:.0f}s"
        + ("; budget reached, cases left out" if over else "")
        + ("; all checks passed" if not failed else "; FAILED: " + ", ".join(failed))
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
