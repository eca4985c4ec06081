"""Kernel benchmarks: every hot WGSL kernel of a training step, timed with GPU timestamps, checked against a
float64 reference in the same run, and paired with PyTorch on the same GPU in the same run.

    python3 bench/kernels.py                 # full sizes (small preset: 16 x 1024 tokens), H200: ~1-2 min
    python3 bench/kernels.py --quick         # tiny sizes (lavapipe / CI smoke)
    python3 bench/kernels.py --only matmul,attention --json out.json
    python3 bench/kernels.py --only copy,gemv     # the decoder's matrix-vector products (bench/decode_kernels.py)
    python3 bench/kernels.py --gemv-sweep         # their tunables swept at the Qwen3.8-27B shapes

Per case: warm-up, then N launches recorded into one timestamped recorder (inputs rotating among 2-3 copies
so caches do not flatter), elapsed / N; the best of 7 repeats (the median is in the JSON). The same op in PyTorch (fp32 with TF32 off: the
same-precision peer; bf16 for context) is timed with CUDA events; the torch columns read '-' when torch or
CUDA is missing (`--torch cpu` runs the peer code on the CPU, for testing only).

Correctness: a subsample (rows/columns/heads) of each output is compared with float64 numpy (`ddl_ref`);
the error is max|got - ref| / max|ref| over the sample. Any failed check makes the exit status 1 (after the
table and the JSON are written).

Work counted: matmul 2MNK; causal attention forward 2·B·H·T²·D (two T×T×D products, half masked), backward
2.5× that (five products incl. the score recompute); bandwidth kernels the minimum bytes (each input read
once, each output written once). % peak: of the H200's 66.9 TFLOP/s FP32 or 4.3 TB/s measured copy.
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (puts the repository root on sys.path)
import decode_kernels  # noqa: E402
import numpy as np  # noqa: E402

from ddl_ref import ops as ref  # noqa: E402
from ddl_ref.config import preset  # noqa: E402
from ddl_ref.params import num_params  # noqa: E402
from ddl_wgpu.engine.vocab import head_chunk_rows  # noqa: E402
from ddl_wgpu.ops import adamw as k_adamw  # noqa: E402
from ddl_wgpu.ops import attention as k_attn  # noqa: E402
from ddl_wgpu.ops import crossentropy as k_ce  # noqa: E402
from ddl_wgpu.ops import matmul as k_mm  # noqa: E402
from ddl_wgpu.ops import rmsnorm as k_norm  # noqa: E402
from ddl_wgpu.ops import swiglu as k_swiglu  # noqa: E402
from ddl_wgpu.ops import topk_kl as k_topk  # noqa: E402
from ddl_wgpu.runtime.gpu import Call  # noqa: E402

F32 = 4


Skip = (
    common.Skip
)  # a case that cannot run here (missing launcher, size over a limit): reported, not a failure


# ---------------------------------------------------------------------------------------------------------
# helpers


class Bench:
    def __init__(self, gpu, args, torch, tdev):
        self.gpu, self.args, self.torch, self.tdev = gpu, args, torch, tdev
        self.rng = np.random.default_rng(0)
        self.rot = 1 if args.quick else args.rotate
        self.target = 5.0 if args.quick else 40.0

    def rot_for(self, set_bytes: float) -> int:
        """Input copies to rotate among: beyond 4x the H200's 60 MB L2 one copy already misses the cache."""
        return 1 if set_bytes > 240e6 else self.rot

    def randn(self, *shape, scale=1.0):
        return (self.rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)).astype(np.float32)

    def up(self, a, label=""):
        return self.gpu.upload(np.ascontiguousarray(a, np.float32 if a.dtype.kind == "f" else a.dtype), label)

    def down(self, buf, count, offset_elems=0, dtype=np.float32):
        return self.gpu.download(buf, dtype, count, offset_elems * 4)

    def time_gpu(self, calls):
        return common.gpu_time_ms(self.gpu, calls, self.target, self.args.repeats)

    def time_torch(self, make):
        """make(dtype) -> list of zero-arg callables; returns {'fp32': ..., 'bf16': ...} of timing dicts."""
        out = {}
        if self.torch is None:
            return out
        torch = self.torch
        for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            if name == "bf16" and self.args.no_bf16:
                continue
            try:
                fns = make(dt)
                out[name] = common.torch_time_ms(torch, self.tdev, fns, self.target, self.args.repeats)
                del fns
            except Exception as e:  # a peer that cannot run (e.g. bf16 op missing on CPU) is reported
                out[name] = {"error": f"{e.__class__.__name__}: {e}"[:200]}
            common.torch_free(torch, self.tdev)
        return out

    def tr(self, shape, dt, scale=1.0, grad=False):
        t = self.torch.randn(*shape, device=self.tdev, dtype=self.torch.float32) * scale
        return t.to(dt).requires_grad_(grad)


rel_err = common.rel_err


def sizes(args) -> dict:
    """Shapes of the small preset (or the tiny one with --quick): batch x seq rows."""
    if args.quick:
        cfg = preset("tiny")
        B, T = 2, 64
        mm_big = 256
    else:
        cfg = preset("small")
        B, T = args.batch, args.seq
        mm_big = 4096
    return {"cfg": cfg, "B": B, "T": T, "N": B * T, "big": mm_big}


# ---------------------------------------------------------------------------------------------------------
# matmul


def matmul_cases(S) -> list[tuple]:
    """(label, M, N, K, trans_a, trans_b): the 4096^3 square and the small preset's linear-layer products."""
    cfg, N = S["cfg"], S["N"]
    C, F, HD, KD, V = (
        cfg.d_model,
        cfg.ffn_hidden,
        cfg.n_heads * cfg.head_dim,
        cfg.n_kv_heads * cfg.head_dim,
        cfg.vocab_size,
    )
    chunk = S["head_chunk"]
    big = S["big"]
    cases = [
        (f"square {big}^3", big, big, big, False, False),
        ("fwd q/o: x W^T", N, HD, C, False, True),
        ("fwd k/v: x W^T", N, KD, C, False, True),
        ("fwd gate/up: x W^T", N, F, C, False, True),
        ("fwd down: s W^T", N, C, F, False, True),
        ("bwd dx down: dy W", N, F, C, False, False),
        ("bwd dx gate/up: dy W", N, C, F, False, False),
        ("bwd dW q/o: dy^T x", HD, C, N, True, False),
        ("bwd dW gate/up: dy^T x", F, C, N, True, False),
        ("bwd dW down: dy^T s", C, F, N, True, False),
        ("head fwd chunk: x E^T", chunk, V, C, False, True),
        ("head dx chunk: dz E", chunk, C, V, False, False),
        ("head dE chunk: dz^T x", V, C, chunk, True, False),
    ]
    seen, out = set(), []
    for c in cases:  # drop duplicates (e.g. k/v == q/o without GQA)
        if c[1:] not in seen:
            seen.add(c[1:])
            out.append(c)
    return out


def bench_matmul(b: Bench, label, M, N, K, ta, tb) -> dict:
    rot = b.rot_for(4.0 * (M * K + K * N))
    gpu = b.gpu
    a_shape = (K, M) if ta else (M, K)
    b_shape = (N, K) if tb else (K, N)
    As = [b.randn(*a_shape) for _ in range(rot)]
    Bs = [b.randn(*b_shape) for _ in range(rot)]
    abufs = [b.up(a) for a in As]
    bbufs = [b.up(x) for x in Bs]
    c = gpu.buffer(M * N * F32, label="C")
    calls = [k_mm.matmul(gpu, c, abufs[i], bbufs[i], M, N, K, trans_a=ta, trans_b=tb) for i in range(rot)]
    tile = k_mm.pick_tile(gpu, M, N)
    # check: rotation 0, a few rows x a few columns
    calls[0].run(gpu)
    ri = np.unique(np.r_[0, M - 1, b.rng.integers(0, M, 6)])
    ci = np.unique(np.r_[0, N - 1, b.rng.integers(0, N, 6)])
    opA = As[0].T if ta else As[0]
    opB = Bs[0].T if tb else Bs[0]
    ref_ = opA[ri].astype(np.float64) @ opB[:, ci].astype(np.float64)
    got = np.stack([b.down(c, N, r * N) for r in ri])[:, ci]
    err = rel_err(got, ref_)
    t = b.time_gpu(calls)

    def make(dt):
        torch = b.torch
        xs = [(b.tr(a_shape, dt), b.tr(b_shape, dt)) for _ in range(rot)]
        out = torch.empty(M, N, device=b.tdev, dtype=dt)

        def f(x, w):
            return lambda: torch.matmul(x.T if ta else x, w.T if tb else w, out=out)

        return [f(x, w) for x, w in xs]

    res = {"flop": 2.0 * M * N * K, "gpu": t, "torch": b.time_torch(make), "err": err, "tol": 1e-4}
    parts = k_mm.auto_split_k(b.gpu, M, N, K, 1)
    if parts > 1:  # the launch plan `matmul` follows: K slices of LARGE/SMALL tiles, then the reduction
        ks, full, rest = k_mm.split_k_slices(K, parts)
        tile = k_mm.pick_tile(b.gpu, M, N, full)
        res["note"] = (
            f"split-K {full} x {ks}" + (f" + {rest}" if rest else "") + f", tile {tile.bm}x{tile.bn}"
        )
    else:
        res["note"] = f"tile {tile.bm}x{tile.bn}, {-(-M // tile.bm) * -(-N // tile.bn)} workgroups"
    return res


# ---------------------------------------------------------------------------------------------------------
# attention


def _attn_inputs(b: Bench, B, T, H, K, D):
    qs = [b.randn(B, T, H, D) for _ in range(b.rot)]
    ks = [b.randn(B, T, K, D) for _ in range(b.rot)]
    vs = [b.randn(B, T, K, D) for _ in range(b.rot)]
    return qs, ks, vs


def bench_attention(b: Bench, S, backward: bool, impl: str) -> dict:
    gpu, cfg = b.gpu, S["cfg"]
    B, T, H, K, D = S["B"], S["T"], cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    qs, ks, vs = _attn_inputs(b, B, T, H, K, D)
    bufs = [(b.up(q), b.up(k), b.up(v)) for q, k, v in zip(qs, ks, vs, strict=True)]
    outs = [(gpu.buffer(B * T * H * D * F32), gpu.buffer(B * H * T * F32)) for _ in range(b.rot)]
    fw = [
        k_attn.attention_forward(gpu, o, l, q, k, v, B, T, H, K, D, impl=impl)
        for (q, k, v), (o, l) in zip(bufs, outs, strict=True)
    ]
    # reference on two batch rows (all heads, full T)
    fw[0].run(gpu)
    sel = sorted({0, B - 1})
    q64, k64, v64 = (x[sel].astype(np.float64) for x in (qs[0], ks[0], vs[0]))
    out_ref, cache = ref.attention_forward(q64, k64, v64)
    per = T * H * D
    got_o = np.stack([b.down(outs[0][0], per, i * per) for i in sel]).reshape(out_ref.shape)
    got_l = np.stack([b.down(outs[0][1], H * T, i * H * T) for i in sel]).reshape(len(sel), H, T)
    flop_fw = 2.0 * B * H * T * T * D  # 4·B·H·T²·D / 2 (causal)
    if not backward:
        err = max(rel_err(got_o, out_ref), rel_err(got_l, cache[4]))
        t = b.time_gpu(fw)

        def make(dt):
            torch = b.torch
            F = torch.nn.functional
            xs = [
                (b.tr((B, H, T, D), dt), b.tr((B, K, T, D), dt), b.tr((B, K, T, D), dt)) for _ in range(b.rot)
            ]
            rep = H // K
            fns = []
            for q, k, v in xs:
                if rep > 1:
                    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
                fns.append(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, is_causal=True))
            return fns

        tiles = k_attn.tile_config(D, int(gpu.limits.get("max-compute-workgroup-storage-size", 16384)))
        note = f"tiles {tiles}" if impl == "flash" else "GEMMs over materialised scores"
        return {"flop": flop_fw, "gpu": t, "torch": b.time_torch(make), "err": err, "tol": 1e-4, "note": note}
    douts = [b.randn(B, T, H, D) for _ in range(b.rot)]
    dbufs = [b.up(d) for d in douts]
    for c in fw:
        c.run(gpu)
    grads = [(gpu.buffer(B * T * H * D * F32), gpu.buffer(B * T * K * D * F32), gpu.buffer(B * T * K * D * F32))
             for _ in range(b.rot)]  # fmt: skip
    scratch = [gpu.buffer(B * H * T * F32) for _ in range(b.rot)]
    bw = [
        k_attn.attention_backward(gpu, *grads[i], dbufs[i], outs[i][0], outs[i][1], *bufs[i], B, T, H, K, D,
                                  scratch=scratch[i], impl=impl)
        for i in range(b.rot)
    ]  # fmt: skip
    bw[0].run(gpu)
    dq, dk, dv = ref.attention_backward(douts[0][sel].astype(np.float64), cache)
    got = []
    for buf, heads in zip(grads[0], (H, K, K), strict=True):
        n = T * heads * D
        got.append(np.stack([b.down(buf, n, i * n) for i in sel]))
    err = max(rel_err(got[0].reshape(dq.shape), dq), rel_err(got[1].reshape(dk.shape), dk),
              rel_err(got[2].reshape(dv.shape), dv))  # fmt: skip
    t = b.time_gpu(bw)

    def make(dt):
        torch = b.torch
        F = torch.nn.functional
        rep = H // K
        fns = []
        for _ in range(b.rot):
            q, k, v = (
                b.tr((B, H, T, D), dt, grad=True),
                b.tr((B, K, T, D), dt, grad=True),
                b.tr((B, K, T, D), dt, grad=True),
            )
            kk, vv = (k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)) if rep > 1 else (k, v)
            o = F.scaled_dot_product_attention(q, kk, vv, is_causal=True)
            g = torch.randn_like(o)
            fns.append(
                lambda o=o, q=q, k=k, v=v, g=g: torch.autograd.grad(o, (q, k, v), g, retain_graph=True)
            )
        return fns

    return {"flop": 2.5 * flop_fw, "gpu": t, "torch": b.time_torch(make), "err": err, "tol": 1e-4,
            "note": "3 passes: delta, dq, dk/dv" if impl == "flash" else "delta + 5 GEMMs + 1 row pass"}  # fmt: skip


# ---------------------------------------------------------------------------------------------------------
# RMSNorm, SwiGLU


def bench_rmsnorm(b: Bench, rows, C, backward: bool) -> dict:
    gpu, eps = b.gpu, 1e-5
    xs = [b.randn(rows, C) for _ in range(b.rot)]
    w = 1.0 + 0.1 * b.randn(C)
    xb = [b.up(x) for x in xs]
    wb = b.up(w)
    outs = [(gpu.buffer(rows * C * F32), gpu.buffer(rows * F32)) for _ in range(b.rot)]
    fw = [k_norm.rmsnorm_forward(gpu, o, r, x, wb, rows, C, eps) for x, (o, r) in zip(xb, outs, strict=True)]
    for c in fw:
        c.run(gpu)
    ri = np.unique(np.r_[0, rows - 1, b.rng.integers(0, rows, 6)])
    x64 = xs[0][ri].astype(np.float64)
    o_ref, cache = ref.rmsnorm_forward(x64, w.astype(np.float64), eps)
    if not backward:
        got = np.stack([b.down(outs[0][0], C, r * C) for r in ri])
        err = rel_err(got, o_ref)
        t = b.time_gpu(fw)

        def make(dt):
            F = b.torch.nn.functional
            xt = [b.tr((rows, C), dt) for _ in range(b.rot)]
            wt = b.tr((C,), dt)
            return [lambda x=x: F.rms_norm(x, (C,), wt, eps) for x in xt]

        return {"bytes": 2.0 * rows * C * F32, "gpu": t, "torch": b.time_torch(make), "err": err, "tol": 1e-5}
    gs = [b.randn(rows, C) for _ in range(b.rot)]
    gb = [b.up(g) for g in gs]
    dxs = [gpu.buffer(rows * C * F32) for _ in range(b.rot)]
    dws = [gpu.buffer(C * F32) for _ in range(b.rot)]
    bw = [
        k_norm.rmsnorm_backward(
            gpu, dxs[i], dws[i], gb[i], xb[i], wb, outs[i][1], rows, C, accumulate_dw=False
        )
        for i in range(b.rot)
    ]
    bw[0].run(gpu)
    dx_ref, _ = ref.rmsnorm_backward(gs[0][ri].astype(np.float64), cache)
    got_dx = np.stack([b.down(dxs[0], C, r * C) for r in ri])
    x_all = xs[0].astype(np.float64)
    xhat = x_all / np.sqrt(np.mean(x_all * x_all, axis=-1, keepdims=True) + eps)
    dw_ref = np.sum(gs[0].astype(np.float64) * xhat, axis=0)
    err = max(rel_err(got_dx, dx_ref), rel_err(b.down(dws[0], C), dw_ref))
    t = b.time_gpu(bw)

    def make(dt):
        torch = b.torch
        F = torch.nn.functional
        fns = []
        wt = b.tr((C,), dt, grad=True)
        for _ in range(b.rot):
            x = b.tr((rows, C), dt, grad=True)
            o = F.rms_norm(x, (C,), wt, eps)
            g = torch.randn_like(o)
            fns.append(lambda o=o, x=x, g=g: torch.autograd.grad(o, (x, wt), g, retain_graph=True))
        return fns

    # minimum traffic: read dout, x, write dx (rstd and w are tiny)
    return {"bytes": 3.0 * rows * C * F32, "gpu": t, "torch": b.time_torch(make), "err": err, "tol": 1e-4,
            "note": "one pass: dx + per-block dw partials; fixed-order dw reduce"}  # fmt: skip


def bench_swiglu(b: Bench, n, backward: bool) -> dict:
    rot = b.rot_for(4.0 * 3 * n)
    gpu = b.gpu
    gs = [b.randn(n, scale=2.0) for _ in range(rot)]
    us = [b.randn(n) for _ in range(rot)]
    gb, ub = [b.up(x) for x in gs], [b.up(x) for x in us]
    head = min(n, 1 << 20)
    idx = np.unique(np.r_[0, head - 1, b.rng.integers(0, head, 4096)])
    g64, u64 = gs[0][idx].astype(np.float64), us[0][idx].astype(np.float64)
    if not backward:
        outs = [gpu.buffer(n * F32) for _ in range(rot)]
        calls = [k_swiglu.swiglu_forward(gpu, outs[i], gb[i], ub[i], n) for i in range(rot)]
        calls[0].run(gpu)
        err = rel_err(b.down(outs[0], head)[idx], ref.swiglu_forward(g64, u64))
        t = b.time_gpu(calls)

        def make(dt):
            F = b.torch.nn.functional
            xs = [(b.tr((n,), dt), b.tr((n,), dt)) for _ in range(rot)]
            return [lambda g=g, u=u: F.silu(g) * u for g, u in xs]

        return {"bytes": 3.0 * n * F32, "gpu": t, "torch": b.time_torch(make), "err": err, "tol": 1e-5}
    ds = [b.randn(n) for _ in range(rot)]
    db = [b.up(x) for x in ds]
    dg = [gpu.buffer(n * F32) for _ in range(rot)]
    du = [gpu.buffer(n * F32) for _ in range(rot)]
    calls = [k_swiglu.swiglu_backward(gpu, dg[i], du[i], db[i], gb[i], ub[i], n) for i in range(rot)]
    calls[0].run(gpu)
    rg, ru = ref.swiglu_backward(ds[0][idx].astype(np.float64), g64, u64)
    err = max(rel_err(b.down(dg[0], head)[idx], rg), rel_err(b.down(du[0], head)[idx], ru))
    t = b.time_gpu(calls)

    def make(dt):
        torch = b.torch
        F = torch.nn.functional
        fns = []
        for _ in range(rot):
            g, u = b.tr((n,), dt, grad=True), b.tr((n,), dt, grad=True)
            o = F.silu(g) * u
            d = torch.randn_like(o)
            fns.append(lambda o=o, g=g, u=u, d=d: torch.autograd.grad(o, (g, u), d, retain_graph=True))
        return fns

    return {"bytes": 5.0 * n * F32, "gpu": t, "torch": b.time_torch(make), "err": err, "tol": 1e-5}


# ---------------------------------------------------------------------------------------------------------
# the Delta update (DDL d_v = 1); ops/delta.py may be absent in a checkout: the case is skipped then


def bench_delta(b: Bench, N, C, backward: bool) -> dict:
    try:
        from ddl_wgpu.ops import delta as k_delta
    except Exception as e:
        raise Skip(f"ddl_wgpu.ops.delta not importable ({e.__class__.__name__})") from e
    from ddl_ref import delta as ref_delta

    gpu, dv, k_eps, v_scale = b.gpu, 1, 1e-5, 4.0
    Xs = [b.randn(N, C) for _ in range(b.rot)]
    Us = [b.randn(N, C, scale=0.3) for _ in range(b.rot)]
    Cs = [b.randn(N, C) for _ in range(b.rot)]
    wb_, bb_ = b.randn(C, scale=0.5 / math.sqrt(C)), np.zeros(1, np.float32)
    Wv, bv = b.randn(dv, C, scale=0.5 / math.sqrt(C)), b.randn(dv, scale=0.03)
    Xb, Ub, Cb = [b.up(x) for x in Xs], [b.up(x) for x in Us], [b.up(x) for x in Cs]
    P = [b.up(x) for x in (wb_, bb_, Wv, bv)]
    st = k_delta.stats_size(dv)
    outs = [gpu.buffer(N * C * F32) for _ in range(b.rot)]
    stats = [gpu.buffer(N * st * F32) for _ in range(b.rot)]
    fw = [
        k_delta.delta_forward(
            gpu, outs[i], stats[i], Xb[i], Ub[i], Cb[i], Xb[i], *P, N, C, dv, k_eps, v_scale
        )
        for i in range(b.rot)
    ]
    for c in fw:
        c.run(gpu)
    ri = np.unique(np.r_[0, N - 1, b.rng.integers(0, N, 6)])
    x64 = Xs[0][ri].astype(np.float64)
    args64 = [a.astype(np.float64) for a in (wb_, bb_, Wv, bv)]
    X_new, cache = ref_delta.delta_forward(x64[..., None], Us[0][ri].astype(np.float64), Cs[0][ri].astype(np.float64),
                                           x64, *args64, k_eps, v_scale)  # fmt: skip
    if not backward:
        got = np.stack([b.down(outs[0], C, r * C) for r in ri])
        err = rel_err(got, X_new[..., 0])
        t = b.time_gpu(fw)
        make = _delta_torch(b, N, C, k_eps, v_scale, backward=False)
        return {"bytes": 4.0 * N * C * F32, "gpu": t, "torch": b.time_torch(make), "err": err, "tol": 1e-4,
                "note": "reads X, u, c; writes X_new"}  # fmt: skip
    Gs = [b.randn(N, C) for _ in range(b.rot)]
    Gb = [b.up(g) for g in Gs]
    dX = [gpu.buffer(N * C * F32) for _ in range(b.rot)]
    du = [gpu.buffer(N * C * F32) for _ in range(b.rot)]
    dbeta = [gpu.buffer(N * F32) for _ in range(b.rot)]
    dz = [gpu.buffer(N * dv * F32) for _ in range(b.rot)]
    dc = [gpu.buffer(N * C * F32) for _ in range(b.rot)]
    dxv = [gpu.buffer(N * C * F32) for _ in range(b.rot)]
    bw = [
        k_delta.delta_backward(gpu, dX[i], du[i], dbeta[i], dz[i], dc[i], dxv[i], Gb[i], Xb[i], Ub[i], stats[i],
                               P[0], P[2], N, C, dv, v_scale, accumulate_dc=False, accumulate_dx_v=False)
        for i in range(b.rot)
    ]  # fmt: skip
    bw[0].run(gpu)
    r_dX, r_du, r_dc, r_dxv, *_ = ref_delta.delta_backward(Gs[0][ri].astype(np.float64)[..., None], cache)
    err = max(
        rel_err(np.stack([b.down(dX[0], C, r * C) for r in ri]), r_dX[..., 0]),
        rel_err(np.stack([b.down(du[0], C, r * C) for r in ri]), r_du),
        rel_err(np.stack([b.down(dc[0], C, r * C) for r in ri]), r_dc),
        rel_err(np.stack([b.down(dxv[0], C, r * C) for r in ri]), r_dxv),
    )
    t = b.time_gpu(bw)
    make = _delta_torch(b, N, C, k_eps, v_scale, backward=True)
    return {"bytes": 7.0 * N * C * F32, "gpu": t, "torch": b.time_torch(make), "err": err, "tol": 1e-4,
            "note": "reads dX_new, X, u; writes dX, du, dc, dx_v (param grads: separate kernel)"}  # fmt: skip


def _delta_torch(b: Bench, N, C, k_eps, v_scale, backward: bool):
    def make(dt):
        torch = b.torch
        wb = b.tr((C,), dt, 0.02, grad=backward)
        bb = b.tr((1,), dt, 0.0, grad=backward)
        wv = b.tr((1, C), dt, 0.02, grad=backward)
        bv = b.tr((1,), dt, 0.03, grad=backward)
        fns = []
        for _ in range(b.rot):
            x, u, c = (b.tr((N, C), dt, grad=backward) for _ in range(3))

            def fwd(x=x, u=u, c=c):
                k = u * torch.rsqrt((u * u).sum(-1, keepdim=True) + k_eps * k_eps)
                beta = 2.0 * torch.sigmoid(c @ wb + bb)
                v = v_scale * torch.sigmoid(x @ wv.T + bv)[:, 0]
                p = (x * k).sum(-1)
                return x + k * (beta * (v - p))[:, None]

            if not backward:
                fns.append(fwd)
                continue
            o = fwd()
            g = torch.randn_like(o)
            fns.append(
                lambda o=o, x=x, u=u, c=c, g=g: torch.autograd.grad(o, (x, u, c), g, retain_graph=True)
            )
        return fns

    return make


# ---------------------------------------------------------------------------------------------------------
# AdamW


def bench_adamw(b: Bench, n) -> dict:
    gpu = b.gpu
    tile = min(n, 1 << 22)  # a random tile repeated through each buffer (cheap to make at 1e8 elements)

    def filled(scale, positive=False):
        t = b.randn(tile, scale=scale)
        if positive:
            t = np.abs(t)
        buf = gpu.buffer(n * F32)
        for off in range(0, n, tile):
            m = min(tile, n - off)
            gpu.write(buf, t[:m], off * F32)
        return buf, t

    rot = b.rot_for(16.0 * n)
    sets = [[filled(1.0), filled(0.01), filled(0.01), filled(1e-4, positive=True)] for _ in range(rot)]
    scalars = b.up(np.array([1.0, 1.0, 1.0, 1.0], np.float32))  # norm, clip multiplier 1, finite, sumsq
    lr, b1, b2, eps, wd = 1e-3, 0.9, 0.95, 1e-5, 0.1
    hyper = k_adamw.adamw_hyper(gpu, lr, 10, b1, b2, eps, wd)
    calls = [k_adamw.adamw(gpu, s[0][0], s[1][0], s[2][0], s[3][0], scalars, n, hyper) for s in sets]
    calls[0].run(gpu)
    head = min(n, 1 << 20)  # checked prefix (downloading 1e8 floats three times would dominate the run)
    idx = np.unique(np.r_[0, head - 1, b.rng.integers(0, head, 4096)])
    p, g, m, v = (s[1][idx % tile].astype(np.float64) for s in sets[0])
    bc1, bc2 = 1 - b1**10, 1 - b2**10
    p = p * (1 - lr * wd)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    p = p - lr * (m / bc1) / (np.sqrt(v / bc2) + eps)
    got = [b.down(s[0], head)[idx] for s in sets[0][:1] + sets[0][2:]]
    err = max(rel_err(got[0], p), rel_err(got[1], m), rel_err(got[2], v))
    t = b.time_gpu(calls)

    def make(dt):
        torch = b.torch
        if dt != torch.float32:
            raise Skip("fp32 optimizer state only")
        fns = []
        for _ in range(rot):
            w = torch.nn.Parameter(torch.randn(n, device=b.tdev))
            w.grad = torch.randn(n, device=b.tdev) * 0.01
            opt = torch.optim.AdamW([w], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd,
                                    fused=b.tdev == "cuda")  # fmt: skip
            opt.step()  # state allocated
            fns.append(opt.step)
        return fns

    return {"bytes": 7.0 * n * F32, "gpu": t, "torch": b.time_torch(make), "err": err, "tol": 1e-5,
            "note": "read p,g,m,v; write p,m,v; torch: fused AdamW"}  # fmt: skip


# ---------------------------------------------------------------------------------------------------------
# LM head + cross-entropy (chunked as in the engine), cross-entropy alone, top-k KL


def bench_head(b: Bench, N, C, V) -> dict:
    """The engine's LM head for one step: per row chunk, logits = x E^T, cross-entropy in place (logits
    become dlogits), dx = dlogits E, dE += dlogits^T x. Full logits never exist."""
    gpu = b.gpu
    chunk = head_chunk_rows(gpu, N, C, V)
    x = b.randn(N, C)
    E = b.randn(V, C, scale=0.02 * math.sqrt(C))  # logits ~ N(0, 0.4)
    targets = b.rng.integers(0, V, N).astype(np.uint32)
    xb, Eb = b.up(x), b.up(E)
    tb, wb = b.up(targets), b.up(np.ones(N, np.float32))
    scale = b.up(np.array([1.0 / N], np.float32))
    row_loss, logits = gpu.buffer(N * F32), gpu.buffer(chunk * V * F32)
    dx, dE = gpu.buffer(N * C * F32), gpu.buffer(V * C * F32)
    call = Call()
    for r0 in range(0, N, chunk):
        n = min(chunk, N - r0)
        xs = (xb, r0 * C * F32, n * C * F32)
        lg = (logits, 0, n * V * F32)
        call += k_mm.matmul(gpu, lg, xs, Eb, n, V, C, trans_b=True)
        call += k_ce.cross_entropy(gpu, row_loss, lg, tb, wb, n, V, scale, row_offset=r0)
        call += k_mm.matmul(gpu, (dx, r0 * C * F32, n * C * F32), lg, Eb, n, C, V)
        call += k_mm.matmul(gpu, dE, lg, xs, V, C, n, trans_a=True, accumulate=True)
    call.run(gpu)
    ri = np.unique(np.r_[0, N - 1, b.rng.integers(0, N, 4)])
    z = x[ri].astype(np.float64) @ E.T.astype(np.float64)
    lse = ref.logsumexp(z)
    loss_ref = lse - z[np.arange(len(ri)), targets[ri]]
    dz = ref.softmax(z)
    dz[np.arange(len(ri)), targets[ri]] -= 1.0
    dx_ref = (dz / N) @ E.astype(np.float64)
    got_loss = b.down(row_loss, N)[ri]
    got_dx = np.stack([b.down(dx, C, r * C) for r in ri])
    err = max(rel_err(got_loss, loss_ref), rel_err(got_dx, dx_ref))
    t = b.time_gpu([call])

    def make(dt):
        torch = b.torch
        F = torch.nn.functional
        xt = b.tr((N, C), torch.float32, grad=True)
        Et = b.tr((V, C), torch.float32, 0.02 * math.sqrt(C), grad=True)
        tt = torch.randint(0, V, (N,), device=b.tdev)

        def f():
            if dt == torch.float32:
                loss = F.cross_entropy(xt @ Et.T, tt)
            else:
                with torch.autocast(b.tdev, dtype=dt):
                    loss = F.cross_entropy(xt @ Et.T, tt)
            return torch.autograd.grad(loss, (xt, Et))

        return [f]

    return {"flop": 6.0 * N * V * C, "gpu": t, "torch": b.time_torch(make), "err": err, "tol": 1e-4,
            "note": f"{-(-N // chunk)} chunks of {chunk} rows; torch: full logits, F.cross_entropy"}  # fmt: skip


def bench_cross_entropy(b: Bench, rows, V) -> dict:
    gpu = b.gpu
    zs = [b.randn(rows, V) for _ in range(b.rot)]
    zb = [b.up(z) for z in zs]
    targets = b.rng.integers(0, V, rows).astype(np.uint32)
    tb, wb = b.up(targets), b.up(np.ones(rows, np.float32))
    scale, row_loss = b.up(np.array([1.0], np.float32)), gpu.buffer(rows * F32)
    calls = [k_ce.cross_entropy(gpu, row_loss, z, tb, wb, rows, V, scale) for z in zb]
    calls[0].run(gpu)
    ri = np.unique(np.r_[0, rows - 1, b.rng.integers(0, rows, 4)])
    _, dref = ref.cross_entropy_rows(zs[0][ri].astype(np.float64), targets[ri], np.ones(len(ri)))
    lref = ref.logsumexp(zs[0][ri].astype(np.float64)) - zs[0][ri, targets[ri]]
    got_d = np.stack([b.down(zb[0], V, r * V) for r in ri])
    err = max(rel_err(got_d, dref), rel_err(b.down(row_loss, rows)[ri], lref))
    t = b.time_gpu(calls)

    def make(dt):
        torch = b.torch
        F = torch.nn.functional
        fns = []
        tt = torch.randint(0, V, (rows,), device=b.tdev)
        for _ in range(b.rot):
            z = b.tr((rows, V), dt, grad=True)
            loss = F.cross_entropy(z, tt, reduction="sum")
            fns.append(lambda loss=loss, z=z: torch.autograd.grad(loss, z, retain_graph=True))
        return fns

    return {"bytes": 2.0 * rows * V * F32, "gpu": t, "torch": b.time_torch(make), "err": err, "tol": 1e-5,
            "note": "in place: logits -> dlogits, + row loss"}  # fmt: skip


def bench_topk_kl(b: Bench, rows, V, k) -> dict:
    gpu = b.gpu
    zs = [b.randn(rows, V) for _ in range(b.rot)]
    zb = [b.up(z) for z in zs]
    ids = np.stack([b.rng.choice(V, k, replace=False) for _ in range(rows)]).astype(np.uint32)
    probs = np.abs(b.randn(rows, k)) + np.float32(1e-3)
    probs = (probs / probs.sum(-1, keepdims=True) * 0.9).astype(np.float32)
    ib, pb, wb = b.up(ids), b.up(probs), b.up(np.ones(rows, np.float32))
    scale, row_loss = b.up(np.array([1.0], np.float32)), gpu.buffer(rows * F32)
    calls = [k_topk.topk_kl(gpu, row_loss, z, ib, pb, wb, rows, V, k, scale) for z in zb]
    calls[0].run(gpu)
    ri = np.unique(np.r_[0, rows - 1, b.rng.integers(0, rows, 4)])
    z64 = zs[0][ri].astype(np.float64)
    _, cache = ref.topk_kl_forward(z64, ids[ri], probs[ri].astype(np.float64), np.ones(len(ri)))
    dref = ref.topk_kl_backward(cache)
    # the row losses: the reference's sum over one row at a time
    lref = np.array([ref.topk_kl_forward(z64[i : i + 1], ids[r : r + 1], probs[r : r + 1].astype(np.float64),
                                         np.ones(1))[0] for i, r in enumerate(ri)])  # fmt: skip
    got_d = np.stack([b.down(zb[0], V, r * V) for r in ri])
    err = max(rel_err(got_d, dref), rel_err(b.down(row_loss, rows)[ri], lref))
    t = b.time_gpu(calls)

    def make(dt):
        torch = b.torch
        fns = []
        it = torch.as_tensor(ids.astype(np.int64), device=b.tdev)
        pt = torch.as_tensor(probs, device=b.tdev).to(dt)
        for _ in range(b.rot):
            z = b.tr((rows, V), dt)

            def f(z=z):  # the kernel's default form: the full-vocabulary log-softmax at the teacher's ids
                p = pt.float() / pt.float().sum(-1, keepdim=True)
                logq_all = torch.log_softmax(z.float(), -1)
                loss = (p * (torch.log(p) - logq_all.gather(1, it))).sum(-1)
                g = logq_all.exp().scatter_add_(1, it, -p).to(z.dtype)
                return loss, g

            fns.append(f)
        return fns

    return {"bytes": rows * V * F32 + 3.0 * rows * k * F32, "gpu": t, "torch": b.time_torch(make), "err": err,
            "tol": 1e-5, "note": f"k={k}; full form; writes the full gradient row"}  # fmt: skip


# ---------------------------------------------------------------------------------------------------------
# driver


def plan(S, args) -> list[tuple[str, str, str, object]]:
    """(group, name, shape, thunk(b) -> result dict)."""
    cfg, B, T, N = S["cfg"], S["B"], S["T"], S["N"]
    C, F, V, H, K, D = cfg.d_model, cfg.ffn_hidden, cfg.vocab_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    P = []
    for label, M, Nn, Kk, ta, tb in matmul_cases(S):
        lay = ("T" if ta else "N") + ("T" if tb else "N")
        P.append(("matmul", f"matmul {label}", f"{M}x{Nn}x{Kk} {lay}",
                  lambda b, a=(label, M, Nn, Kk, ta, tb): bench_matmul(b, *a)))  # fmt: skip
    att = f"B{B} T{T} H{H}/{K}x{D}"
    for impl in args.attention.split(","):
        P.append(
            ("attention", f"attention fwd {impl}", att, lambda b, i=impl: bench_attention(b, S, False, i))
        )
        P.append(
            ("attention", f"attention bwd {impl}", att, lambda b, i=impl: bench_attention(b, S, True, i))
        )
    P.append(("rmsnorm", "rmsnorm fwd", f"{N}x{C}", lambda b: bench_rmsnorm(b, N, C, False)))
    P.append(("rmsnorm", "rmsnorm bwd", f"{N}x{C}", lambda b: bench_rmsnorm(b, N, C, True)))
    P.append(
        ("rmsnorm", "q-norm fwd (per head)", f"{N * H}x{D}", lambda b: bench_rmsnorm(b, N * H, D, False))
    )
    P.append(("swiglu", "swiglu fwd", f"{N}x{F}", lambda b: bench_swiglu(b, N * F, False)))
    P.append(("swiglu", "swiglu bwd", f"{N}x{F}", lambda b: bench_swiglu(b, N * F, True)))
    P.append(("delta", "delta fwd (d_v=1)", f"{N}x{C}", lambda b: bench_delta(b, N, C, False)))
    P.append(("delta", "delta bwd (d_v=1)", f"{N}x{C}", lambda b: bench_delta(b, N, C, True)))
    n_par = num_params(cfg)
    P.append(("adamw", "adamw", f"{n_par / 1e6:.1f}M params", lambda b: bench_adamw(b, n_par)))
    P.append(("head", "LM head + CE fwd+bwd", f"{N}x{V}x{C}", lambda b: bench_head(b, N, C, V)))
    ce_rows = min(N, 64 if args.quick else 2048)
    P.append(
        (
            "crossentropy",
            "cross-entropy (in place)",
            f"{ce_rows}x{V}",
            lambda b: bench_cross_entropy(b, ce_rows, V),
        )
    )
    kk = min(32, V)
    P.append(
        ("topk_kl", "top-k KL (in place)", f"{ce_rows}x{V} k{kk}", lambda b: bench_topk_kl(b, ce_rows, V, kk))
    )
    return P + decode_kernels.plan(args, S["max_binding"])


def summarize(r: dict) -> dict:
    """Derived rates: TFLOP/s or GB/s, % of the H200 peak, speed relative to torch (torch ms / wgpu ms)."""
    ms = r["gpu"]["ms"]
    if "flop" in r:
        r["tflops"] = r["flop"] / ms / 1e9
        r["pct_h200"] = 100.0 * r["tflops"] / common.H200_FP32_TFLOPS
    else:
        r["gbs"] = r["bytes"] / ms / 1e6
        r["pct_h200"] = 100.0 * r["gbs"] / common.H200_HBM_GBS
    for k, v in r.get("torch", {}).items():
        if "ms" in v:
            r[f"vs_torch_{k}"] = v["ms"] / ms
    r["ok"] = bool(r["err"] <= r["tol"])
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (lavapipe smoke test)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--attention", default="scores,flash", help="attention implementations to time")
    ap.add_argument("--only", default="", help="comma list of groups: matmul,attention,rmsnorm,swiglu,delta,"
                    "adamw,head,crossentropy,topk_kl,copy,gemv")  # fmt: skip
    ap.add_argument(
        "--gemv-sweep",
        action="store_true",
        help="sweep the gemv kernel's tunables at the 27B shapes instead (bench/decode_kernels.py)",
    )
    ap.add_argument("--gemv-grid", default=decode_kernels.DEFAULT_GRID,
                    help="the sweep's grid: 'key=v1,v2;key=...' over GemvTune's fields")  # fmt: skip
    ap.add_argument("--repeats", type=int, default=common.REPEATS)
    ap.add_argument("--rotate", type=int, default=3, help="input copies rotated among (full size)")
    ap.add_argument("--torch", default="auto", choices=["auto", "cuda", "cpu", "none"])
    ap.add_argument("--no-bf16", action="store_true")
    ap.add_argument("--device", default=None, help="wgpu adapter (index or name substring)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    t_start = time.perf_counter()
    gpu = common.open_gpu(args.device)
    torch, tdev = common.torch_setup(args.torch)
    print(f"adapter: {common.adapter_line(gpu)}")
    print(f"torch peer: {common.torch_info(torch, tdev) if torch else tdev}")
    S = sizes(args)
    cfg = S["cfg"]
    S["head_chunk"] = head_chunk_rows(gpu, S["N"], cfg.d_model, cfg.vocab_size)  # the engine's row chunk
    S["max_binding"] = gpu.max_binding
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    b = Bench(gpu, args, torch, tdev)
    if args.gemv_sweep:
        data = {"bench": "kernels --gemv-sweep", "date": common.now_iso(),
                "command": " ".join(["python3", "bench/kernels.py", *sys.argv[1:]]),
                "adapter": common.adapter_line(gpu), "host": common.host_info(),
                "sweep": decode_kernels.sweep(b, args.gemv_grid, args.quick),
                "wall_s": time.perf_counter() - t_start}  # fmt: skip
        common.write_json(common.json_path(args.json, "gemv_sweep.json"), data)
        failed = [r for r in data["sweep"]["results"] if r.get("ok") is False]
        return 1 if failed or not data["sweep"]["best"] else 0
    results = []
    for group, name, shape, thunk in plan(S, args):
        if only and group not in only:
            continue
        t0 = time.perf_counter()
        entry = {"group": group, "name": name, "shape": shape}
        try:
            entry.update(summarize(thunk(b)))
            status = "ok" if entry["ok"] else f"FAIL (err {entry['err']:.2e} > {entry['tol']:.0e})"
        except Skip as e:
            entry["skipped"] = str(e)
            status = f"skipped: {e}"
        except Exception as e:
            entry["error"] = f"{e.__class__.__name__}: {e}"
            entry["traceback"] = traceback.format_exc()[-2000:]
            status = f"ERROR {entry['error'][:160]}"
        entry["wall_s"] = time.perf_counter() - t0
        print(f"  {name:<28} {shape:<22} {status}  [{entry['wall_s']:.1f}s]", flush=True)
        results.append(entry)
        gc.collect()
        common.torch_free(torch, tdev)

    decode_kernels.with_copy_share(results)
    rows = []
    for e in results:
        if "gpu" not in e:
            rows.append(
                [
                    e["name"],
                    e["shape"],
                    "-",
                    "-",
                    "-",
                    "-",
                    "-",
                    "-",
                    "-",
                    "-",
                    e.get("skipped") or e.get("error", "")[:40],
                ]
            )
            continue
        rate = f"{e['tflops']:.3g} TF/s" if "tflops" in e else f"{e['gbs']:.3g} GB/s"
        tt = e.get("torch", {})
        t32, t16 = tt.get("fp32", {}).get("ms"), tt.get("bf16", {}).get("ms")
        rows.append([
            e["name"], e["shape"], common.fmt(e["gpu"]["ms"], ".4g"), rate, f"{e['pct_h200']:.1f}%",
            common.fmt(e.get("pct_copy"), ".0f"),
            common.fmt(t32, ".4g"), common.fmt(e.get("vs_torch_fp32"), ".2f"), common.fmt(t16, ".4g"),
            f"{e['err']:.1e}", "ok" if e["ok"] else "FAIL",
        ])  # fmt: skip
    headers = ["kernel", "shape", "wgpu ms", "rate", "% H200 peak", "% copy", "torch fp32 ms", "speed vs fp32",
               "torch bf16 ms", "rel err", "check"]  # fmt: skip
    failed = [e["name"] for e in results if e.get("ok") is False or "error" in e]
    data = {
        "bench": "kernels", "date": common.now_iso(), "command": " ".join(["python3", "bench/kernels.py", *sys.argv[1:]]),
        "adapter": common.adapter_line(gpu), "adapter_info": gpu.info, "host": common.host_info(),
        "torch": common.torch_info(torch, tdev) if torch else {"skipped": tdev},
        "sizes": {"preset": "tiny" if args.quick else "small", "B": S["B"], "T": S["T"]},
        "peaks": {"fp32_tflops": common.H200_FP32_TFLOPS, "hbm_gbs": common.H200_HBM_GBS},
        "results": results, "failed": failed, "wall_s": time.perf_counter() - t_start,
    }  # fmt: skip
    path = common.json_path(args.json, "kernels.json")
    common.write_json(path, data)
    print()
    print(f"adapter: {data['adapter']}")
    print(f"torch: {data['torch']}")
    print(
        "speed vs fp32 = torch fp32 ms / wgpu ms (>1: wgpu faster); % H200 peak of 66.9 TFLOP/s or 4.3 TB/s; "
        "% copy: of the buffer copy measured in this run"
    )
    print(
        common.table(
            headers, rows, title=f"kernels ({data['sizes']['preset']} preset, B={S['B']} T={S['T']})"
        )
    )
    print(
        f"total {data['wall_s']:.0f}s; {'all checks passed' if not failed else 'FAILED: ' + ', '.join(failed)}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
