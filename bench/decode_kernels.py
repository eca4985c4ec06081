"""The decoder's matrix-vector products for `bench/kernels.py`: the `gemv` group (the Qwen3.8-27B trunk's shapes
in f16 and the `small` preset's in f32, at one x row and at a 4-row verify), a plain buffer copy timed in the
same run (the bandwidth the products are measured against), and the sweep of the kernel's tunables
(`--gemv-sweep`).

    python3 bench/kernels.py --only copy,gemv                # ~1 min on an H200
    python3 bench/kernels.py --gemv-sweep                    # the tunables' grid at the 27B shapes, ~3 min
    python3 bench/kernels.py --gemv-sweep --gemv-grid "reduce=subgroup;rows=0,8,16;rt=1,2,4;unroll=0,2,4,8"

A row's rate is the bytes it must move (weights, x, y) over its GPU time; "% copy" divides that by the copy's
rate (read + write bytes over time: the same convention as the 4.3 TB/s of common.H200_HBM_GBS). The peer is
PyTorch's F.linear on the same shape (bf16 for the f16 rows, fp32 with TF32 off for the f32 rows): cuBLAS's
batch-1 path. Correctness: every row checks a sample of outputs against float64 `ddl_ref`.

The sweep times each shape of `SWEEP_SHAPES` under every tune of the grid (fewer repeats), prints the best
tunes per shape, and ranks the tunes by the per-token time of the 27B trunk's products and of `small`'s (each
shape weighted by how often a decoded token runs it) -- the `DDL_WGPU_GEMV` line to try in
`bench/generate.py`.
"""

from __future__ import annotations

import itertools
import math
import time

import common
import numpy as np

from ddl_ref import ops as ref
from ddl_wgpu.ops import gemv as k_gemv

F32 = 4
# (label, kind, IN, segment rows (swiglu: [F]), dtype, uses per decoded token at the 27B shape)
QWEN27 = dict(C=5120, F=17408, q=2 * 24 * 256, kv=4 * 256, o=24 * 256, qkv=10240, z=6144, hv=48, V=248320)
SMALL = dict(C=768, F=2048, HD=768, V=50304)


def cases(quick: bool, max_binding: int) -> list[tuple]:
    """(label, kind "plain"|"stacked"|"swiglu", IN, rows list, dtype, n x rows, uses per 27B token)."""
    if quick:
        return [("tiny gate+up+swiglu", "swiglu", 64, [128], "f32", 1, 0),
                ("tiny down", "plain", 128, [64], "f16", 1, 0),
                ("tiny qkv stacked", "stacked", 64, [64, 32, 32], "f16", 2, 0)]  # fmt: skip
    q = QWEN27
    C = q["C"]
    head = min(q["V"], max_binding // (2 * C) // 64 * 64)  # the engine's first vocabulary chunk
    s = SMALL
    return [
        ("27B gate+up+swiglu", "swiglu", C, [q["F"]], "f16", 1, 64),
        ("27B down_proj", "plain", q["F"], [C], "f16", 1, 64),
        ("27B gdn in_proj qkv|z|b|a", "stacked", C, [q["qkv"], q["z"], q["hv"], q["hv"]], "f16", 1, 48),
        ("27B gdn out / attn o_proj", "plain", q["o"], [C], "f16", 1, 64),
        ("27B attn q(gate)|k|v", "stacked", C, [q["q"], q["kv"], q["kv"]], "f16", 1, 16),
        (f"27B lm_head chunk ({head} rows)", "plain", C, [head], "f16", 1, q["V"] / head),
        ("27B gate+up+swiglu, 4-row verify", "swiglu", C, [q["F"]], "f16", 4, 0),
        ("small gate+up+swiglu", "swiglu", s["C"], [s["F"]], "f32", 1, 0),
        ("small down_proj", "plain", s["F"], [s["C"]], "f32", 1, 0),
        ("small q|k|v", "stacked", s["C"], [s["HD"]] * 3, "f32", 1, 0),
        ("small o_proj", "plain", s["HD"], [s["C"]], "f32", 1, 0),
        ("small lm_head", "plain", s["C"], [s["V"]], "f32", 1, 0),
    ]


SWEEP_SHAPES = (
    "27B gate+up+swiglu",
    "27B down_proj",
    "27B gdn in_proj qkv|z|b|a",
    "27B gdn out / attn o_proj",
    "small gate+up+swiglu",
    "small down_proj",
    "small q|k|v",
    "small o_proj",
)
SMALL_USES = {"small gate+up+swiglu": 12, "small down_proj": 12, "small q|k|v": 12, "small o_proj": 12}
DEFAULT_GRID = "reduce=subgroup,shared;wg=256;rows=0,4,8,16;rt=1,2,4;unroll=0,1,2,4,8;f16_vec=8"


def _weights(b, rows: int, IN: int, dtype: str) -> np.ndarray:
    """A (rows, IN) matrix of a repeated random block (drawing a 2 GB head takes most of a minute)."""
    block = b.randn(min(rows, max(1, (1 << 22) // IN)), IN, scale=1.0 / math.sqrt(IN))
    return np.resize(block.astype(np.float16) if dtype == "f16" else block, (rows, IN))


class GemvCase:
    """One shape's buffers (weights at 256-aligned offsets of one arena, as in a Net), its Call per tune,
    and its check."""

    def __init__(self, b, kind: str, IN: int, rows: list[int], dtype: str, n: int):
        self.b, self.kind, self.IN, self.rows, self.dtype, self.n = b, kind, IN, rows, dtype, n
        gpu = b.gpu
        item = 2 if dtype == "f16" else 4
        mats = rows * 2 if kind == "swiglu" else rows
        if max(mats) * IN * item > gpu.max_binding:
            raise common.Skip(
                f"a {max(mats)}x{IN} {dtype} matrix exceeds the binding limit {gpu.max_binding}"
            )
        self.ws, offs, end = [], [], 0
        for r in mats:
            offs.append(end)
            end += -(-r * IN * item // 256) * 256
        self.arena = gpu.buffer(end, label="gemv_weights")
        for r, off in zip(mats, offs, strict=True):
            w = _weights(b, r, IN, dtype)
            gpu.write(self.arena, w, off)
            self.ws.append(w)
        self.views = [
            (self.arena, off, -(-r * IN * item // 4) * 4) for r, off in zip(mats, offs, strict=True)
        ]
        self.x = b.randn(n, IN)
        self.xb = b.up(self.x)
        self.out_rows = rows[0] if kind == "swiglu" else sum(rows)
        self.y = gpu.buffer(n * self.out_rows * F32, label="gemv_y")
        self.bytes = end + n * (IN + self.out_rows) * F32

    def fit(self, tune):
        """`tune` made concrete for this shape (rows and unroll per shape where 0), as the launchers do."""
        items = k_gemv.row_items(self.dtype, self.IN, tune)
        return k_gemv.fit_tune(self.b.gpu, tune, self.n, self.kind == "swiglu", self.out_rows, items=items)

    def call(self, tune):
        gpu, n, IN, dt = self.b.gpu, self.n, self.IN, self.dtype
        if self.kind == "swiglu":
            F = self.rows[0]
            return k_gemv.gemv_swiglu(
                gpu, self.y, self.xb, self.views[0], self.views[1], n, F, IN, dt, tune=tune
            )
        segs, col = [], 0
        for r, v in zip(self.rows, self.views, strict=True):
            segs.append(k_gemv.Segment((self.y, col * n * F32, n * r * F32), v, r))
            col += r
        return k_gemv.gemv_stacked(gpu, self.xb, segs, n, IN, dt, tune=tune)

    def check(self) -> float:
        """max|got − ref| / max|ref| over a sample of outputs (each segment's first, last and random rows)."""
        n, b = self.n, self.b
        got_all = b.down(self.y, n * self.out_rows)
        x64 = self.x.astype(np.float64)
        errs, col = [], 0
        mats = [(self.ws[0], self.ws[1])] if self.kind == "swiglu" else [(w, None) for w in self.ws]
        for w, up in mats:
            r = w.shape[0]
            idx = np.unique(np.r_[0, r - 1, b.rng.integers(0, r, 32)])
            want = ref.linear_forward(x64, w[idx].astype(np.float64))
            if up is not None:
                want = ref.swiglu_forward(want, ref.linear_forward(x64, up[idx].astype(np.float64)))
            got = got_all[col * n : (col + r) * n].reshape(n, r)[:, idx]
            errs.append(common.rel_err(got, want))
            col += r
        return max(errs)


def bench_gemv(b, kind, IN, rows, dtype, n) -> dict:
    """One shape under the default tune, its check and the PyTorch peer."""
    case = GemvCase(b, kind, IN, rows, dtype, n)
    tune = case.fit(k_gemv.default_tune(b.gpu))
    call = case.call(tune)
    call.run(b.gpu)
    err = case.check()
    t = b.time_gpu([call])
    res = {"bytes": float(case.bytes), "gpu": t, "err": err, "tol": 2e-3 if dtype == "f16" else 1e-4,
           "note": f"{len(call.dispatches)} dispatch(es), {tune.label()}"}  # fmt: skip
    res["torch"] = _torch_peer(b, kind, IN, rows, dtype, n)
    return res


def _torch_peer(b, kind, IN, rows, dtype, n) -> dict:
    if b.torch is None:
        return {}
    torch = b.torch
    F = torch.nn.functional
    name, dt = ("bf16", torch.bfloat16) if dtype == "f16" else ("fp32", torch.float32)
    try:
        x = b.tr((n, IN), dt)
        ws = [b.tr((r, IN), dt, 1.0 / math.sqrt(IN)) for r in (rows * 2 if kind == "swiglu" else rows)]
        if kind == "swiglu":
            fns = [lambda: F.silu(F.linear(x, ws[0])) * F.linear(x, ws[1])]
        elif len(ws) > 1:
            cat = torch.cat(ws)  # one product, as an engine with fused q/k/v weights would
            fns = [lambda: F.linear(x, cat)]
        else:
            fns = [lambda: F.linear(x, ws[0])]
        return {name: common.torch_time_ms(torch, b.tdev, fns, b.target, b.args.repeats)}
    except Exception as e:
        return {name: {"error": f"{e.__class__.__name__}: {e}"[:200]}}


def bench_copy(b, nbytes: int) -> dict:
    """A plain buffer-to-buffer copy of `nbytes`: the bandwidth the products are measured against (bytes
    read + written over GPU time, timestamps around the copies)."""
    import wgpu

    gpu = b.gpu
    src, dst = gpu.buffer(nbytes, label="copy_src"), gpu.buffer(nbytes, label="copy_dst")
    gpu.write(src, np.arange(nbytes // 4, dtype=np.uint32))
    timed = "timestamp-query" in gpu.features

    def once(reps: int) -> float:
        enc = gpu.device.create_command_encoder()
        if timed:
            qs = gpu.device.create_query_set(type=wgpu.QueryType.timestamp, count=2)
            usage = wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC
            qbuf = gpu.device.create_buffer(size=16, usage=usage)
            enc.begin_compute_pass(
                timestamp_writes={"query_set": qs, "beginning_of_pass_write_index": 0}
            ).end()
        for _ in range(reps):
            enc.copy_buffer_to_buffer(src, 0, dst, 0, nbytes)
        if timed:
            enc.begin_compute_pass(timestamp_writes={"query_set": qs, "end_of_pass_write_index": 1}).end()
            enc.resolve_query_set(qs, 0, 2, qbuf, 0)
        t0 = time.perf_counter()
        gpu.queue.submit([enc.finish()])
        if not timed:  # wall clock around a wait
            gpu.wait()
            return (time.perf_counter() - t0) * 1e3 / reps
        t = gpu.download(qbuf, np.uint64, 2)
        return float(t[1] - t[0]) * gpu.timestamp_period_ns() / 1e6 / reps

    once(2)
    reps = max(2, min(50, int(b.target / max(once(2), 1e-3))))
    common.settle(once, reps)
    times = [once(reps) for _ in range(b.args.repeats)]
    ok = bool(np.array_equal(gpu.download(dst, np.uint32, 1024), np.arange(1024, dtype=np.uint32)))
    t = {"ms": min(times), "median_ms": sorted(times)[len(times) // 2], "n_per_repeat": reps,
         "repeats": len(times), "timestamps": timed}  # fmt: skip
    return {"bytes": 2.0 * nbytes, "gpu": t, "err": 0.0 if ok else 1.0, "tol": 0.0,
            "note": f"{nbytes / (1 << 20):.4g} MiB buffer to buffer; read + write bytes"}  # fmt: skip


COPY_BYTES, COPY_BYTES_QUICK = 1 << 30, 16 << 20


def copy_bytes(max_binding: int, quick: bool) -> int:
    """The buffer copy's size: 1 GiB (--quick: 16 MiB), at most half the binding limit, a whole number of
    256-byte blocks (a copy's size must be a multiple of 4: the H200's limit of 2^31 − 1 bytes halves to an
    odd count). The full run and --quick share this arithmetic, so a smoke run under an odd
    DDL_WGPU_MAX_BINDING exercises it (tests/test_bench_decode.py)."""
    return min(COPY_BYTES_QUICK if quick else COPY_BYTES, max_binding // 2) // 256 * 256


def plan(args, max_binding: int) -> list[tuple]:
    """The `copy` and `gemv` groups' entries for bench/kernels.py's plan."""
    nbytes = copy_bytes(max_binding, args.quick)
    P = [("copy", "buffer copy", f"{nbytes / (1 << 20):.4g} MiB", lambda b: bench_copy(b, nbytes))]
    for label, kind, IN, rows, dtype, n, _uses in cases(args.quick, max_binding):
        shape = f"{'+'.join(map(str, rows))}x{IN} {dtype} n{n}"
        P.append(("gemv", f"gemv {label}", shape,
                  lambda b, a=(kind, IN, rows, dtype, n): bench_gemv(b, *a)))  # fmt: skip
    return P


def with_copy_share(results: list[dict]) -> None:
    """Each gemv row's rate as a share of the copy's measured in the same run ("pct_copy")."""
    copy = next((r for r in results if r.get("group") == "copy" and "gbs" in r), None)
    for r in results:
        if copy and r.get("group") == "gemv" and "gbs" in r:
            r["pct_copy"] = 100.0 * r["gbs"] / copy["gbs"]
            r["note"] = f"{r['pct_copy']:.0f}% of copy; " + r.get("note", "")


# ---------------------------------------------------------------------------------------------------------
# the sweep


def parse_grid(text: str) -> list[k_gemv.GemvTune]:
    """'key=v1,v2;key=v3' -> every GemvTune of the product."""
    axes = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        key, _, values = part.partition("=")
        axes.append([f"{key.strip()}={v.strip()}" for v in values.split(",") if v.strip()])
    return [k_gemv.GemvTune.parse(",".join(combo)) for combo in itertools.product(*axes)]


def sweep(b, grid_text: str, quick: bool) -> dict:
    """Every tune of the grid on each sweep shape: GB/s, % of the copy, a check; the ranking (module
    docstring). -> the JSON's "sweep" entry; prints two short tables."""
    gpu = b.gpu
    copy = bench_copy(b, copy_bytes(gpu.max_binding, quick))
    copy_gbs = copy["bytes"] / copy["gpu"]["ms"] / 1e6
    tunes = parse_grid(grid_text)
    shapes = [c for c in cases(quick, gpu.max_binding) if quick or c[0] in SWEEP_SHAPES]
    rows, per_tune = [], {"27B": {}, "small": {}}
    t0 = time.perf_counter()
    for label, kind, IN, segs, dtype, n, uses in shapes:
        try:
            case = GemvCase(b, kind, IN, segs, dtype, n)
        except common.Skip as e:
            print(f"  skipped {label}: {e}")
            continue
        for tune in tunes:
            key = tune.spec()
            try:
                fitted = case.fit(tune)
                call = case.call(fitted)
                call.run(gpu)
                err = case.check()
                t = common.gpu_time_ms(gpu, [call], 10.0 if quick else 20.0, 3)
                gbs = case.bytes / t["ms"] / 1e6
                entry = {"shape": label, "tune": key, "fitted": fitted.label(), "ms": t["ms"], "gbs": gbs,
                         "pct_copy": 100 * gbs / copy_gbs, "err": err, "ok": err <= 2e-3}  # fmt: skip
            except Exception as e:
                entry = {"shape": label, "tune": key, "error": f"{e.__class__.__name__}: {e}"[:200]}
            rows.append(entry)
            model = "small" if label.startswith("small") else "27B"
            if "ms" in entry and entry["ok"]:
                weight = SMALL_USES.get(label, 1) if model == "small" else (uses or 1)
                per_tune[model].setdefault(key, {})[label] = entry["ms"] * weight
        del case
        print(f"  swept {label}: {len(tunes)} tunes [{time.perf_counter() - t0:.0f}s]", flush=True)
    rankings = {}
    for model, tunes_ms in per_tune.items():
        n_shapes = sum(1 for c in shapes if ("small" if c[0].startswith("small") else "27B") == model)
        complete = {k: sum(v.values()) for k, v in tunes_ms.items() if len(v) == n_shapes}
        rankings[model] = sorted(complete.items(), key=lambda kv: kv[1])
    for label, *_ in shapes:
        best = sorted((r for r in rows if r["shape"] == label and r.get("ok")), key=lambda r: r["ms"])[:5]
        print(common.table(["tune", "ms", "GB/s", "% copy"],
                           [[r["tune"], f"{r['ms']:.4g}", f"{r['gbs']:.0f}", f"{r['pct_copy']:.0f}%"] for r in best],
                           f"gemv {label}: best of {len(tunes)} tunes (copy {copy_gbs:.0f} GB/s)"))  # fmt: skip
    for model, ranking in rankings.items():
        if ranking:
            print(common.table(["tune", f"ms per {model} token (these shapes)"], [[k, f"{v:.4g}"] for k, v in ranking[:8]],
                               f"gemv tunes ranked by a decoded {model} token's products"))  # fmt: skip
            print(f"best over the {model} shapes: DDL_WGPU_GEMV={ranking[0][0]}")
    best = {model: ranking[0][0] for model, ranking in rankings.items() if ranking}
    return {"copy_gbs": copy_gbs, "grid": grid_text, "results": rows, "ranking": rankings, "best": best}
