"""Training-step throughput: ddl-wgpu's engine against the same model in PyTorch on the same GPU.

    python3 bench/train_step.py                      # small preset, 16 x 1024, baseline and ddl (H200: ~1-2 min)
    python3 bench/train_step.py --quick              # tiny preset, 2 x 64 (lavapipe smoke test)
    python3 bench/train_step.py --variants baseline --batch 8 --json out.json

One step = zero grads, forward, LM head + loss, backward, global grad-norm clip 1.0 (`--clip-mode per-tensor`:
each tensor by its own norm, as `ddl-wgpu train` clips by default), AdamW (lr 3e-4, betas 0.9/0.95, eps 1e-5,
wd 0.1) on every parameter. Both sides start from `ddl_ref.params.init_params(cfg, seed)`
and train on the same random batch. Before timing, the PyTorch model's initial loss must equal the engine's
on that batch (|Δ| <= 1e-3), else the run fails (exit 1).

Reported per variant: steady-state s/step over --steps steps after --warmup steps (the engine reads its loss
back every step, so each step ends synchronised; a final `gpu.wait()`), tokens/s = B·T / (s/step), model
TFLOP/s (6·params + causal attention 6·L·T·H·D per token), the GPU time of one step from timestamps, and
the time Python spends encoding one step (recording every Call into a recorder, not submitted). PyTorch
peers: eager fp32 with TF32 off (fused AdamW) and eager bf16 autocast (context). The torch rows read '-'
when torch or CUDA is missing (`--torch cpu` runs them on the CPU, for testing only).
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (puts the repository root on sys.path)
import numpy as np  # noqa: E402

from ddl_ref.config import ModelVariant, preset  # noqa: E402
from ddl_ref.params import init_params, num_params  # noqa: E402

LOSS_TOL = 1e-3


def flops_per_token(cfg, T: int) -> float:
    return 6.0 * num_params(cfg) + 6.0 * cfg.n_layers * T * cfg.n_heads * cfg.head_dim


def n_steps(args, step_s: float) -> int:
    """Steps to time: --steps, fewer when one step is so slow that --budget-s would be exceeded."""
    return int(max(2, min(args.steps, math.floor(args.budget_s / max(step_s, 1e-9)))))


# ---------------------------------------------------------------------------------------------------------
# ddl-wgpu


def encode_step(net, work, upd, rec) -> None:
    """Record the Calls of one training step exactly as `TrunkWork.step` does (into any recorder)."""
    parts = [("zero", [net.zero_grads_call()]), ("forward", [work._fwd]), ("head+loss", [work._head_train]),
             ("loss sum", [work._sum]), ("backward", [work._bwd]), ("optimizer", [net.optimizer_call(upd)])]  # fmt: skip
    for phase, calls in parts:
        rec.phase = phase  # read by profiler.ProfileRecorder (--profile); a plain Recorder ignores it
        for c in calls:
            c.record(rec)


def profile_step(gpu, net, work, upd) -> dict:
    """GPU ms of one step per (phase, shader family): every dispatch timed alone (`profiler.ProfileRecorder`)."""
    from profiler import ProfileRecorder

    rec = ProfileRecorder(gpu)
    encode_step(net, work, upd(), rec)
    rec.submit()
    out: dict[str, float] = {}
    for key, ms in rec.profile().items():
        phase, kernel = key.split("|", 1)
        family = kernel.split(":")[0].removesuffix(".wgsl")
        out[f"{phase}|{family}"] = out.get(f"{phase}|{family}", 0.0) + ms
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def print_profile(results: list[dict]) -> None:
    """The --profile table: GPU ms per (phase, shader family), one column per engine run."""
    cols = [(r["variant"], name, run["profile_ms"]) for r in results
            for name, run in r["runs"].items() if "profile_ms" in run]  # fmt: skip
    if not cols:
        return
    keys = sorted({k for _, _, p in cols for k in p}, key=lambda k: -max(p.get(k, 0.0) for _, _, p in cols))
    rows = [[*k.split("|", 1), *(common.fmt(p.get(k), ".2f") for _, _, p in cols)] for k in keys]
    rows.append(["all", "", *(common.fmt(sum(p.values()), ".1f") for _, _, p in cols)])
    print(common.table(["phase", "shader", *(f"{v} {n}" for v, n, _ in cols)], rows,
                       "GPU ms per step by phase and shader family (each dispatch timed alone)"))  # fmt: skip


def bench_engine(gpu, cfg, params, ids, args) -> dict:
    """One engine run."""
    from ddl_wgpu.engine.net import Net
    from ddl_wgpu.engine.step import AdamW
    from ddl_wgpu.engine.trunk import TrunkWork

    B, T = ids.shape
    t0 = time.perf_counter()
    net = Net(gpu, cfg, params, work_class=TrunkWork)
    work = net.work(B, T)
    r = {"build_s": time.perf_counter() - t0}
    first = work.step(ids)  # forward + backward, no update: the loss at init
    r["init_loss"] = first.loss
    step = 0

    def upd():
        nonlocal step
        step += 1
        # on the matrix units the step runs as `train --precision mixed` does: the loss scaled by GradScaler's
        # first scale (2^16; a power of two, so the update's bits match any scale that does not overflow)
        scale = 65536.0 if getattr(gpu, "products", "simt") == "matrix" else 1.0
        return AdamW(lr=args.lr, step=step, grad_clip_mode=args.clip_mode, loss_scale=scale)

    for _ in range(args.warmup):
        res = work.step(ids, update=upd())
    gpu.wait()
    t1 = time.perf_counter()
    work.step(ids, update=upd())
    gpu.wait()
    n = n_steps(args, time.perf_counter() - t1)
    losses = []
    t1 = time.perf_counter()
    for _ in range(n):
        res = work.step(ids, update=upd())
        losses.append(res.loss)
    gpu.wait()
    r["s_per_step"] = (time.perf_counter() - t1) / n
    r["steps_timed"] = n
    r["losses"] = losses
    r["finite"] = bool(res.finite and all(np.isfinite(losses)))
    # encoding time: every Call of one step recorded into a throwaway recorder (never submitted)
    enc = []
    for _ in range(5):
        rec = gpu.recorder()
        t2 = time.perf_counter()
        encode_step(net, work, upd(), rec)
        enc.append(time.perf_counter() - t2)
        r["dispatches"] = rec.n_dispatches
        del rec
    r["encode_ms"] = 1e3 * common.median(enc)
    # GPU time of one step's recording, from timestamps (same Calls as Work.step)
    if "timestamp-query" in gpu.features:
        ts = []
        for _ in range(3):
            rec = gpu.recorder(timestamps=True)
            encode_step(net, work, upd(), rec)
            rec.submit()
            ts.append(rec.elapsed_ms())
        r["gpu_ms"] = common.median(ts)
        if args.profile:
            r["profile_ms"] = profile_step(gpu, net, work, upd)
    gpu.wait()
    del work, net
    gc.collect()
    return r


# ---------------------------------------------------------------------------------------------------------
# PyTorch


def torch_loss(torch, tdev, cfg, params, ids) -> float:
    from torch_model import TorchLM

    model = TorchLM(cfg, params, tdev)
    with torch.no_grad():
        loss = float(model(torch.as_tensor(ids, device=tdev)))
    del model
    return loss


def bench_torch(torch, tdev, cfg, params, ids, args, bf16: bool) -> dict:
    from torch_model import TorchLM

    model = TorchLM(cfg, params, tdev)
    idt = torch.as_tensor(ids, device=tdev)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), eps=1e-5, weight_decay=0.1,
                            fused=tdev == "cuda")  # fmt: skip

    def sync():
        if tdev == "cuda":
            torch.cuda.synchronize()

    def step():
        opt.zero_grad(set_to_none=True)
        if bf16:
            with torch.autocast(tdev, dtype=torch.bfloat16):
                loss = model(idt)
        else:
            loss = model(idt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss

    r = {}
    for _ in range(args.warmup):
        step()
    sync()
    t1 = time.perf_counter()
    step()
    sync()
    n = n_steps(args, time.perf_counter() - t1)
    t1 = time.perf_counter()
    losses = [step() for _ in range(n)]
    sync()
    r["s_per_step"] = (time.perf_counter() - t1) / n
    r["steps_timed"] = n
    r["losses"] = [float(x.detach()) for x in losses]
    r["finite"] = bool(all(np.isfinite(r["losses"])))
    if tdev == "cuda":
        r["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return r  # model and optimizer state die with this frame; the caller empties the CUDA cache


# ---------------------------------------------------------------------------------------------------------
# driver


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny preset, 2 x 64 (lavapipe smoke test)")
    ap.add_argument("--preset", default=None, help="model preset (default small; tiny with --quick)")
    ap.add_argument("--variants", default="baseline,ddl")
    ap.add_argument("--batch", type=int, default=None, help="default 16 (2 with --quick)")
    ap.add_argument("--seq", type=int, default=None, help="default 1024 (64 with --quick)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 10; 3 with --quick)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 3; 1 with --quick)")
    ap.add_argument(
        "--budget-s", type=float, default=20.0, help="cap on the timed seconds of one measurement"
    )
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--torch", default="auto", choices=["auto", "cuda", "cpu", "none"])
    ap.add_argument("--no-bf16", action="store_true")
    ap.add_argument("--device", default=None, help="wgpu adapter (index or name substring)")
    ap.add_argument("--profile", action="store_true", help="GPU ms per phase and shader family (timestamps)")
    ap.add_argument(
        "--clip-mode", default="global", choices=["global", "per-tensor"],
        help="the engine's gradient clipping: global (PyTorch's clip_grad_norm_, the default here) or per-tensor "
        "(what `ddl-wgpu train` runs by default); the PyTorch peer always clips globally",
    )  # fmt: skip
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    q = args.quick
    args.preset = args.preset or ("tiny" if q else "small")
    args.batch = args.batch or (2 if q else 16)
    args.seq = args.seq or (64 if q else 1024)
    args.steps = args.steps or (3 if q else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if q else 3)

    t_start = time.perf_counter()
    gpu = common.open_gpu(args.device)
    torch, tdev = common.torch_setup(args.torch)
    print(f"adapter: {common.adapter_line(gpu)}")
    print(f"torch peer: {common.torch_info(torch, tdev) if torch else tdev}")
    base = preset(args.preset)
    B, T = args.batch, args.seq
    results, failed = [], []
    for vname in [s.strip() for s in args.variants.split(",") if s.strip()]:
        cfg = ModelVariant.parse(vname).resolve_config(base)
        params = init_params(cfg, args.seed)
        ids = np.random.default_rng(args.seed + 1).integers(0, cfg.vocab_size, (B, T)).astype(np.int64)
        fpt = flops_per_token(cfg, T)
        entry = {"variant": vname, "params": num_params(cfg), "flops_per_token": fpt, "runs": {}}
        print(f"{vname}: {entry['params'] / 1e6:.1f}M parameters, batch {B} x {T}", flush=True)
        runs = entry["runs"]
        runs["ddl-wgpu"] = common.attempt(bench_engine, gpu, cfg, params, ids, args)
        print(f"  ddl-wgpu: {_brief(runs['ddl-wgpu'])}", flush=True)
        if torch is not None:
            try:
                entry["torch_init_loss"] = torch_loss(torch, tdev, cfg, params, ids)
            except Exception as e:
                entry["torch_init_loss_error"] = f"{e.__class__.__name__}: {e}"
            modes = [("torch fp32", False)] + ([] if args.no_bf16 else [("torch bf16 autocast", True)])
            for name, bf16 in modes:
                runs[name] = common.attempt(bench_torch, torch, tdev, cfg, params, ids, args, bf16)
                print(f"  {name}: {_brief(runs[name])}", flush=True)
                common.torch_free(torch, tdev)
        # the same-run correctness gate: initial losses must agree
        tl = entry.get("torch_init_loss")
        for name in [n for n in runs if n.startswith("ddl-wgpu")]:
            wl = runs[name].get("init_loss")
            if wl is None or tl is None:
                continue
            diff = abs(wl - tl)
            runs[name]["init_loss_diff"], ok = diff, bool(diff <= LOSS_TOL)
            if name == "ddl-wgpu":
                entry["init_loss_diff"], entry["init_loss_ok"] = diff, ok
            print(
                f"  initial loss: {name} {wl:.6f}, torch {tl:.6f}, |diff| {diff:.2e} ({'ok' if ok else 'FAIL'})"
            )
            if not ok:
                failed.append(f"{vname}/{name}: initial loss differs by {diff:.2e}")
        for name, r in runs.items():
            if "error" in r:
                failed.append(f"{vname}/{name}: {r['error'][:120]}")
            elif not r.get("finite", True):
                failed.append(f"{vname}/{name}: non-finite loss")
            else:
                r["tokens_per_s"] = B * T / r["s_per_step"]
                r["model_tflops"] = fpt * r["tokens_per_s"] / 1e12
        ref_ = runs.get("torch fp32", {}).get("tokens_per_s")
        for r in runs.values():
            if ref_ and "tokens_per_s" in r:
                r["vs_torch_fp32"] = r["tokens_per_s"] / ref_
        results.append(entry)
        del params
        gc.collect()

    rows = []
    for e in results:
        for name, r in e["runs"].items():
            if "error" in r:
                rows.append([e["variant"], name, "-", "-", "-", "-", "-", "-", r["error"][:50]])
                continue
            rows.append([
                e["variant"], name, f"{r['s_per_step'] * 1e3:.1f}", f"{r['tokens_per_s'] / 1e3:.2f}K",
                common.fmt(r.get("vs_torch_fp32"), ".2f"), f"{r['model_tflops']:.3g}",
                common.fmt(r.get("gpu_ms"), ".1f"), common.fmt(r.get("encode_ms"), ".2f"),
                common.fmt(r.get("init_loss", e.get("torch_init_loss") if name == "torch fp32" else None), ".5f"),
            ])  # fmt: skip
    headers = ["variant", "implementation", "ms/step", "tokens/s", "vs torch fp32", "model TFLOP/s",
               "GPU ms/step", "encode ms", "init loss"]  # fmt: skip
    data = {
        "bench": "train_step", "date": common.now_iso(),
        "command": " ".join(["python3", "bench/train_step.py", *sys.argv[1:]]),
        "adapter": common.adapter_line(gpu), "adapter_info": gpu.info, "host": common.host_info(),
        "torch": common.torch_info(torch, tdev) if torch else {"skipped": tdev},
        "preset": args.preset, "batch": B, "seq": T, "steps": args.steps, "warmup": args.warmup, "lr": args.lr,
        "clip_mode": args.clip_mode,
        "results": results, "failed": failed, "wall_s": time.perf_counter() - t_start,
    }  # fmt: skip
    common.write_json(common.json_path(args.json, "train_step.json"), data)
    print()
    print_profile(results)
    print(f"adapter: {data['adapter']}")
    print(f"torch: {data['torch']}")
    print(common.table(headers, rows, title=f"training step ({args.preset} preset, {B} x {T} tokens)"))
    print(
        f"total {data['wall_s']:.0f}s; {'all checks passed' if not failed else 'FAILED: ' + '; '.join(failed)}"
    )
    return 1 if failed else 0


def _brief(r: dict) -> str:
    if "error" in r:
        return "ERROR " + r["error"][:200]
    return f"{r['s_per_step'] * 1e3:.1f} ms/step over {r['steps_timed']} steps"


if __name__ == "__main__":
    sys.exit(main())
