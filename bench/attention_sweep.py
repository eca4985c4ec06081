"""Causal attention implementations against each other and PyTorch SDPA fp32, forward and backward, in one run:
every tile of the fused kernels (`ddl_wgpu/ops/attention_fused.py`) that fits the adapter, the scores path
(`attention_scores.py`), the old flash kernels (`attention.wgsl`) and `torch.nn.functional.
scaled_dot_product_attention` (fp32, TF32 off; when torch with CUDA is importable).

    python3 bench/attention_sweep.py --out attention_sweep.json            # H200: B 16 T 1024, B 4 T 4096
    python3 bench/attention_sweep.py --shapes 1x40x2x1x16 --torch none     # a smoke test on lavapipe

Each case is checked against float64 numpy (`ddl_ref`) on a sample (batch rows 0 and B-1, the query heads of
kv head 0) as max|diff| / max|ref|; the backward of each forward consumes that forward's out and lse. The
fused kernels are compiled trusted like the engine's (`gpu.TRUSTED_FILES`: no naga bounds checks, their indices
are guarded by construction). A 2 s GEMM warm-up runs first (`common.warm_up`). Prints a short table
last; JSON to --out.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
from common import (
    adapter_line,
    fmt,
    gpu_time_ms,
    host_info,
    json_path,
    now_iso,
    rel_err,
    table,
    torch_free,
    torch_info,
    torch_setup,
    torch_time_ms,
    warm_up,
    write_json,
)

from ddl_ref import ops as ref  # noqa: E402
from ddl_wgpu.gpu import Call  # noqa: E402
from ddl_wgpu.ops import attention, attention_fused  # noqa: E402

F32 = 4


def _sample(B, H, K, arrays):
    """The checked sample of (B,T,heads,D) arrays: batch rows 0 and B-1; q-like arrays (H heads) keep the
    G query heads of kv head 0, k-like ones kv head 0."""
    G, sel = H // K, sorted({0, B - 1})
    return [a[sel][:, :, : (G if a.shape[2] == H else 1)].astype(np.float64) for a in arrays]


def _down(gpu, buf, B, T, heads, D, sel, keep):
    per = T * heads * D
    rows = [gpu.download(buf, count=per, offset=i * per * F32).reshape(T, heads, D)[:, :keep] for i in sel]
    return np.stack(rows)


def _down_lse(gpu, buf, H, T, sel, keep):
    return np.stack(
        [gpu.download(buf, count=H * T, offset=i * H * T * F32).reshape(H, T)[:keep] for i in sel]
    )


def run_shape(gpu, shape, args, tpeer, budget_s: float) -> list[dict]:
    """Every case of one shape: SDPA, scores, flash, then the fused tiles while `budget_s` lasts."""
    t_start = time.perf_counter()
    B, T, H, K, D = shape
    G, sel = H // K, sorted({0, B - 1})
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, T, H, D), dtype=np.float32)
    k = rng.standard_normal((B, T, K, D), dtype=np.float32)
    v = rng.standard_normal((B, T, K, D), dtype=np.float32)
    dout = rng.standard_normal((B, T, H, D), dtype=np.float32)
    bq, bk, bv, bdo = (gpu.upload(a) for a in (q, k, v, dout))
    out, lse = gpu.buffer(q.nbytes), gpu.buffer(B * H * T * F32)
    dq, dk, dv = gpu.buffer(q.nbytes), gpu.buffer(k.nbytes), gpu.buffer(v.nbytes)
    delta = gpu.buffer(B * H * T * F32)
    q64, k64, v64, do64 = _sample(B, H, K, (q, k, v, dout))
    want_out, cache = ref.attention_forward(q64, k64, v64)
    want_dq, want_dk, want_dv = ref.attention_backward(do64, cache) if args.backward else (None, None, None)
    flop = 2.0 * B * H * T * T * D  # causal: half of 4·B·H·T²·D
    label = f"B{B} T{T} H{H}/{K}x{D}"
    rows = torch_rows(tpeer, shape, label, flop, args) if tpeer[0] is not None else []

    def time_it(call):
        return gpu_time_ms(gpu, [call], target_ms=args.target_ms, repeats=args.repeats)["ms"]

    cases = [("scores", "scores", None), ("flash", "flash", None)]
    # the forward's and the backward's candidates taken in turn, so a budget cut drops the least promising of both
    fwd, bwd = attention_fused.fitting_tiles(gpu, D), attention_fused.fitting_tiles(gpu, D, backward=True)
    tiles = list(dict.fromkeys(t for pair in zip(fwd, bwd, strict=True) for t in pair))
    cases += [
        (f"fused {t.label()}", "fused", t)
        for t in (list(dict.fromkeys([fwd[0], bwd[0]])) if args.tiles == "first" else tiles)
    ]
    for name, impl, tile in cases:
        if impl not in args.impls:
            continue
        if impl == "scores" and not attention.attention_scores.fits(gpu, H, K, T):
            continue
        if impl == "fused" and time.perf_counter() - t_start > budget_s:
            print(f"{label}: {name} left out (over this shape's {budget_s:.0f} s)", flush=True)
            rows.append(
                {"shape": label, "pass": "fwd", "impl": name, "ms": None, "tflops": None, "err": None}
            )
            continue
        t0 = time.perf_counter()
        if impl == "fused":
            fw = attention_fused.attention_fused_forward(gpu, out, lse, bq, bk, bv, B, T, H, K, D, tile=tile)
        else:
            fw = attention.attention_forward(gpu, out, lse, bq, bk, bv, B, T, H, K, D, impl=impl)
        fw.run(gpu)
        err = max(rel_err(_down(gpu, out, B, T, H, D, sel, G), want_out),
                  rel_err(_down_lse(gpu, lse, H, T, sel, G), cache[4]))  # fmt: skip
        ms = time_it(fw)
        rows.append(
            {"shape": label, "pass": "fwd", "impl": name, "ms": ms, "tflops": flop / ms / 1e9, "err": err}
        )
        print(
            f"{label} fwd {name}: {ms:.3f} ms, err {err:.1e} ({time.perf_counter() - t0:.1f} s)", flush=True
        )
        if not args.backward:
            continue
        # each backward after its own forward (it reads that forward's out and lse); delta pass included
        bw = attention.attention_backward(gpu, dq, dk, dv, bdo, out, lse, bq, bk, bv, B, T, H, K, D, scratch=delta,
                                          impl=impl)  # fmt: skip
        if impl == "fused":  # this tile's kernels after the delta pass
            bw = Call(bw.dispatches[:1], bw.uniforms) + attention_fused.attention_fused_backward(
                gpu, dq, dk, dv, bdo, lse, delta, bq, bk, bv, B, T, H, K, D, tile=tile
            )
        bw.run(gpu)
        err = max(rel_err(_down(gpu, dq, B, T, H, D, sel, G), want_dq),
                  rel_err(_down(gpu, dk, B, T, K, D, sel, 1), want_dk),
                  rel_err(_down(gpu, dv, B, T, K, D, sel, 1), want_dv))  # fmt: skip
        ms = time_it(bw)
        rows.append({"shape": label, "pass": "bwd", "impl": name, "ms": ms, "tflops": 2.5 * flop / ms / 1e9,
                     "err": err})  # fmt: skip
        print(f"{label} bwd {name}: {ms:.3f} ms, err {err:.1e}", flush=True)
    return rows


def torch_rows(tpeer, shape, label, flop, args) -> list[dict]:
    torch, dev = tpeer
    B, T, H, K, D = shape
    F = torch.nn.functional
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn((B, H, T, D), device=dev, generator=g, requires_grad=True)
    k = torch.randn((B, K, T, D), device=dev, generator=g, requires_grad=True)
    v = torch.randn((B, K, T, D), device=dev, generator=g, requires_grad=True)
    rep = H // K
    kk, vv = (k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)) if rep > 1 else (k, v)

    def forward(q=q, kk=kk, vv=vv):
        return F.scaled_dot_product_attention(q, kk, vv, is_causal=True)

    with torch.no_grad():
        fwd = torch_time_ms(torch, dev, [forward], target_ms=args.target_ms, repeats=args.repeats)["ms"]
    rows = [{"shape": label, "pass": "fwd", "impl": "torch sdpa fp32", "ms": fwd, "tflops": flop / fwd / 1e9}]
    if args.backward:
        o = F.scaled_dot_product_attention(q, kk, vv, is_causal=True)
        go = torch.randn_like(o)
        ins = (q, k, v)

        def backward(o=o, go=go, ins=ins):
            return torch.autograd.grad(o, ins, go, retain_graph=True)

        bwd = torch_time_ms(torch, dev, [backward], target_ms=args.target_ms, repeats=args.repeats)["ms"]
        rows.append({"shape": label, "pass": "bwd", "impl": "torch sdpa fp32", "ms": bwd,
                     "tflops": 2.5 * flop / bwd / 1e9})  # fmt: skip
        del o, go, ins
    del q, k, v, kk, vv
    torch_free(torch, dev)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="16x1024x6x6x128,4x4096x6x6x128", help="BxTxHxKxD, comma-separated")
    ap.add_argument("--impls", default="fused,scores,flash")
    ap.add_argument(
        "--tiles", choices=("all", "first"), default="all", help="fused tiles timed (first: the defaults)"
    )
    ap.add_argument("--no-backward", dest="backward", action="store_false")
    ap.add_argument("--torch", choices=("auto", "cuda", "cpu", "none"), default="auto")
    ap.add_argument("--target-ms", type=float, default=25.0, help="GPU time per timed repeat")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warm-up-s", type=float, default=2.0, help="GEMMs before the first timed case")
    ap.add_argument("--budget-s", type=float, default=150.0, help="fused tiles stop being started after this")
    ap.add_argument("--out", default=None, help="JSON path (default $OUT/attention_sweep.json)")
    args = ap.parse_args(argv)
    args.impls = set(args.impls.split(","))
    from common import open_gpu

    gpu = open_gpu()
    print(adapter_line(gpu), flush=True)
    tpeer = torch_setup(args.torch)
    warm_up(gpu, args.warm_up_s)
    rows, shapes = [], args.shapes.split(",")
    t0 = time.perf_counter()
    for i, s in enumerate(shapes):  # each shape gets an even share of what is left of the budget
        share = (args.budget_s - (time.perf_counter() - t0)) / (len(shapes) - i)
        rows += run_shape(gpu, tuple(int(x) for x in s.split("x")), args, tpeer, share)
    # ratio to SDPA of the same shape and pass
    peer = {(r["shape"], r["pass"]): r["ms"] for r in rows if r["impl"] == "torch sdpa fp32"}
    for r in rows:
        p = peer.get((r["shape"], r["pass"]))
        r["vs_sdpa"] = p / r["ms"] if p and r["ms"] else None
    data = {"when": now_iso(), "adapter": adapter_line(gpu), "host": host_info(), "rows": rows,
            "trusted": os.environ.get("DDL_WGPU_TRUSTED"),
            "torch": torch_info(*tpeer) if tpeer[0] is not None else tpeer[1]}  # fmt: skip
    write_json(json_path(args.out, "attention_sweep.json"), data)
    body = [[r["shape"], r["pass"], r["impl"], fmt(r["ms"], ".3f"), fmt(r["tflops"], ".1f"), fmt(r["vs_sdpa"], ".2f"),
             fmt(r.get("err"), ".1e")] for r in rows]  # fmt: skip
    print(table(["shape", "pass", "impl", "ms", "TFLOP/s", "x SDPA", "err"], body, "attention sweep"))
    # the short summary, last: per shape and pass, the peers and the best fused tile
    summary = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        for pas in ("fwd", "bwd"):
            here = [r for r in rows if r["shape"] == shape and r["pass"] == pas and r["ms"]]
            if not here:
                continue
            ms = {r["impl"]: r["ms"] for r in here}
            fused = min(
                (r for r in here if r["impl"].startswith("fused")), key=lambda r: r["ms"], default=None
            )
            sdpa = ms.get("torch sdpa fp32")
            summary.append([shape, pas, fmt(sdpa, ".3f"), fmt(ms.get("scores"), ".3f"), fmt(ms.get("flash"), ".3f"),
                            fused["impl"].removeprefix("fused ") if fused else "-", fmt(fused and fused["ms"], ".3f"),
                            fmt(sdpa / fused["ms"] if fused and sdpa else None, ".2f"),
                            fmt(ms["scores"] / fused["ms"] if fused and "scores" in ms else None, ".2f")])  # fmt: skip
    print(table(["shape", "pass", "SDPA ms", "scores ms", "flash ms", "best fused tile", "ms", "x SDPA", "x scores"],
                summary, "best fused tile per shape"))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
