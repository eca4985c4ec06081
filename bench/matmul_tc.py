"""The subgroup-matrix GEMM (`shaders/matmul_tc.wgsl`) on Dawn: its adapter's configurations, each tile of a
sweep checked against numpy and timed at the Qwen3.8-27B products, beside PyTorch bf16 in the same run.

    python3 bench/matmul_tc.py [--tiles 4x2sg-4x4-k32,...] [--simt] [--operands f16,f16] [--configs first]
        [--shapes all|N|draft] [--only TEXT] [--orders auto|cols,rows] [--accumulate] [--json PATH]
    python3 bench/matmul_tc.py --split-slots 132,264 [--shapes draft] [--operands f32,f16]

Dawn is started with the toggles the engine uses: allow_unsafe_apis (the subgroup-matrix feature),
vulkan_enable_f16_on_nvidia (f16 on NVIDIA's Vulkan driver) and disable_robustness (no bounds checks, as
wgpu-native's trusted modules). Every tile is first checked at an odd shape in the three layouts of a linear
layer (forward NT, dx NN, dW TN) against a float64 product of the same f16-rounded operands: a tile whose error
passes the f16 tolerance is timed, one that fails is reported and dropped. Timing: `reps` dispatches in one
pass, waited for by reading 16 bytes back, best of 3. `--accumulate` times C += op(A) op(B), as every dW and
the residual's products run in the engine.

`--split-slots` times the shapes as the engine launches them instead (`ops.matmul.matmul` on a `Gpu`, its
products on the matrix units, a long K over few blocks of C sliced by `auto_split_k_tc`), once for each count
of resident workgroups that the slicing assumes (`ops.matmul.TC_SPLIT_SLOTS`), printing the slices each chose.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402,F401  (puts the repository root on sys.path)

from ddl_wgpu.ops import matmul_tc as tc  # noqa: E402
from ddl_wgpu.runtime.shader_files import shader_source  # noqa: E402

TOGGLES = ["allow_unsafe_apis", "vulkan_enable_f16_on_nvidia", "disable_robustness"]
# (name, M, N, K, trans_a, trans_b): the 27B's products at 16 x 1024 rows (forward x W^T is NT, dx = dy W is
# NN, dW = dy^T x is TN)
SHAPES = (
    ("mlp gate/up fwd", 16384, 17408, 5120, False, True),
    ("mlp down fwd", 16384, 5120, 17408, False, True),
    ("attn q+gate fwd", 16384, 12288, 5120, False, True),
    ("mlp up dx", 16384, 5120, 17408, False, False),
    ("mlp up dW", 17408, 5120, 16384, True, False),
)
# heal's 27B draft (`--shapes draft`): 4 windows x 128 rows of a chain step against the 248 K-row head (its
# first chunk, as the engine binds it) and the block's weights, and a stacked step 3's 1,536 rows through
# q+gate; the order of C's blocks matters here (`ops/matmul_tc.py` `rows_first`, `--orders cols,rows`)
DRAFT_SHAPES = (
    ("draft head fwd", 512, 209664, 5120, False, True),  # the head's first chunk: 2 GiB of f16 rows at most
    ("draft gate/up fwd", 512, 17408, 5120, False, True),
    ("draft down fwd", 512, 5120, 17408, False, True),
    ("draft q+gate fwd x3", 1536, 12288, 5120, False, True),
    ("draft head dx", 512, 5120, 209664, False, False),  # dx from the first chunk's logits: 160 blocks of C
    ("draft gate/up dW", 17408, 5120, 512, True, False),  # 512 rows: 16 k steps per block (`--accumulate`)
    ("draft q+gate dW", 12288, 5120, 512, True, False),
)
DEFAULT_TILES = ("2x2sg-4x4-k32", "4x2sg-4x4-k32", "2x2sg-4x4-k32-np", "2x4sg-4x4-k32", "2x2sg-4x4-k16",
                 "4x2sg-4x4-k32-v1-np")  # fmt: skip


parse_tile = tc.parse_tile  # the names the sweep takes and prints (`TcTile.name`)


def dawn_device():
    import wgpudawn as wgpu
    from wgpudawn.backends.dawn import extras

    extras.set_instance_extras(enable_toggles=TOGGLES)
    ad = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
    props = extras.get_adapter_properties(ad)
    want = [f for f in ("shader-f16", "subgroups", "chromium-experimental-subgroup-matrix", "timestamp-query")
            if f in ad.features]  # fmt: skip
    dev = ad.request_device_sync(required_features=want, required_limits={
        "max-storage-buffer-binding-size": ad.limits["max-storage-buffer-binding-size"],
        "max-buffer-size": ad.limits["max-buffer-size"],
        "max-compute-workgroup-storage-size": ad.limits["max-compute-workgroup-storage-size"],
        "max-compute-invocations-per-workgroup": ad.limits["max-compute-invocations-per-workgroup"],
        "max-compute-workgroup-size-x": ad.limits["max-compute-workgroup-size-x"]})  # fmt: skip
    return wgpu, ad, dev, props


class Runner:
    def __init__(self, wgpu, dev, sg: int):
        self.wgpu, self.dev, self.sg = wgpu, dev, sg
        self.cache = {}

    def buffer(self, array: np.ndarray):
        U = self.wgpu.BufferUsage
        return self.dev.create_buffer_with_data(data=np.ascontiguousarray(array),
                                                usage=U.STORAGE | U.COPY_SRC | U.COPY_DST)  # fmt: skip

    def pipeline(self, tile, cfg, ta, tb, adt, bdt, widths=(1, 1)):
        key = (tile, cfg, ta, tb, adt, bdt, widths)
        if key not in self.cache:
            src = shader_source(tc.SHADER, {**tc.templates(tile, cfg, self.sg, ta, tb, adt, bdt, widths),
                                            "struct TcParams": tc.PARAMS.wgsl()})  # fmt: skip
            if os.environ.get("TC_ENABLE_SUBGROUPS", "1") == "1":  # Tint wants it before a subgroup builtin
                src = src.replace("enable f16;", "enable f16;\nenable subgroups;", 1)
            mod = self.dev.create_shader_module(code=src)
            self.cache[key] = self.dev.create_compute_pipeline(
                layout="auto", compute={"module": mod, "entry_point": "matmul_tc"}
            )
        return self.cache[key]

    def run(self, tile, cfg, A, B, C, M, N, K, ta, tb, adt="f32", bdt="f32", reps=1, accumulate=0, alpha=1.0,
            order=None):  # fmt: skip
        """One product, `reps` times in one pass; `order` True/False puts the grid's block rows first or not,
        None as the engine chooses (`matmul_tc.rows_first`)."""
        lda = M if ta else K
        ldb = K if tb else N
        widths = tc.load_widths(tile, M, N, K, ta, tb, (lda, ldb), (0, 0), (0, 0), (0, 0))
        if order is None:
            order = tc.rows_first(tile, cfg, M, N, K, 1, tc.OPERANDS[adt])
        pipe = self.pipeline(tile, cfg, ta, tb, adt, bdt, widths)
        params = tc.PARAMS.pack(M=M, N=N, K=K, lda=lda, ldb=ldb, ldc=N, off_a=0, off_b=0, off_c=0, stride_a=0,
                                stride_b=0, stride_c=0, accumulate=accumulate, alpha=alpha, inner=1, div_a=1,
                                div_b=1, istride_a=0, istride_b=0, istride_c=0, causal=0,
                                rows_first=int(order))  # fmt: skip
        U = self.wgpu.BufferUsage
        ub = self.dev.create_buffer_with_data(data=params, usage=U.UNIFORM)
        bg = self.dev.create_bind_group(layout=pipe.get_bind_group_layout(0), entries=[
            {"binding": i, "resource": {"buffer": b}} for i, b in enumerate((A, B, C, ub))])  # fmt: skip
        g = tc.groups(tile, cfg, M, N, 1, order)
        enc = self.dev.create_command_encoder()
        p = enc.begin_compute_pass()
        p.set_pipeline(pipe)
        p.set_bind_group(0, bg)
        for _ in range(reps):
            p.dispatch_workgroups(*g)
        p.end()
        self.dev.queue.submit([enc.finish()])
        self.dev.queue.read_buffer(C, 0, 16)


def check(r: Runner, tile, cfg, rng) -> float:
    """The largest error of the three layouts at an odd shape, relative to the largest |C|, with f32 and f16
    operands in storage, accumulating with alpha 0.5 and 1: odd sizes (scalar loads, every edge) and multiples
    of 4 with whole blocks (vec4)."""
    worst = 0.0
    for (M, N, K), alpha, ta, tb in ((shape, alpha, ta, tb) for shape, alpha in (((201, 263, 329), 0.5),
                                     ((520, 264, 328), 1.0)) for ta, tb in ((False, True), (False, False),
                                     (True, False))):  # fmt: skip
        for adt, bdt in (("f32", "f32"), ("f32", "f16"), ("f16", "f16")):
            a = rng.standard_normal((K, M) if ta else (M, K)).astype(np.float32)
            b = rng.standard_normal((N, K) if tb else (K, N)).astype(np.float32)
            c0 = rng.standard_normal((M, N)).astype(np.float32)
            a16, b16 = a.astype(np.float16), b.astype(np.float16)
            want = (
                alpha
                * ((a16.T if ta else a16).astype(np.float64) @ (b16.T if tb else b16).astype(np.float64))
                + c0
            )
            A = r.buffer(a16 if adt == "f16" else a)
            B = r.buffer(b16 if bdt == "f16" else b)
            C = r.buffer(c0)
            r.run(tile, cfg, A, B, C, M, N, K, ta, tb, adt, bdt, accumulate=1, alpha=alpha)
            got = np.frombuffer(r.dev.queue.read_buffer(C), np.float32).reshape(M, N)
            worst = max(worst, float(np.abs(got - want).max() / np.abs(want).max()))
    return worst


def time_shape(
    r: Runner, tile, cfg, shape, rng, reps=10, operands=("f16", "f16"), order=None, accumulate=0
) -> float:
    name, M, N, K, ta, tb = shape
    host = {"f16": np.float16, "f32": np.float32}
    a = rng.standard_normal((K, M) if ta else (M, K)).astype(host[operands[0]])
    b = rng.standard_normal((N, K) if tb else (K, N)).astype(host[operands[1]])
    A, B = r.buffer(a), r.buffer(b)
    C = r.buffer(np.zeros((M, N), np.float32))
    run = dict(order=order, accumulate=accumulate)
    r.run(tile, cfg, A, B, C, M, N, K, ta, tb, *operands, reps=1, **run)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        r.run(tile, cfg, A, B, C, M, N, K, ta, tb, *operands, reps=reps, **run)
        best = min(best, (time.perf_counter() - t) / reps)
    for buf in (A, B, C):
        buf.destroy()
    return 2 * M * N * K / best / 1e12


def torch_tflops(shape, reps=10) -> float | None:
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    _, M, N, K, ta, tb = shape
    a = torch.randn((K, M) if ta else (M, K), device="cuda", dtype=torch.bfloat16)
    b = torch.randn((N, K) if tb else (K, N), device="cuda", dtype=torch.bfloat16)
    x, y = (a.t() if ta else a), (b.t() if tb else b)
    f = lambda: x @ y  # noqa: E731
    f()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(reps):
            f()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t) / reps)
    torch.cuda.empty_cache()
    return 2 * M * N * K / best / 1e12


def _engine_tflops(gpu, shapes, b_dtype, reps=5, accumulate=False) -> dict:
    """Each shape through `ops.matmul.matmul` on `gpu` as the engine launches it, f32 activations (A) and B
    in `b_dtype(shape)`: {name: TFLOP/s}, best of 3 passes of `reps` launches."""
    from ddl_wgpu.ops import matmul as mm

    out = {}
    for name, M, N, K, ta, tb in shapes:
        bdt = b_dtype(ta, tb)
        a = gpu.buffer(4 * M * K, label="a")
        b = gpu.buffer((2 if bdt == "f16" else 4) * N * K, label="b")
        c = gpu.buffer(4 * M * N, label="c")
        call = mm.matmul(gpu, c, a, b, M, N, K, trans_a=ta, trans_b=tb, b_dtype=bdt, accumulate=accumulate)
        call.run(gpu)
        gpu.wait()
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            for _ in range(reps):
                call.run(gpu)
            gpu.wait()
            best = min(best, (time.perf_counter() - t) / reps)
        out[name] = 2 * M * N * K / best / 1e12
        gpu.release(a, b, c)
    return out


def simt_tflops(shapes, reps=5) -> dict:
    """Today's SIMT GEMM (`ops.matmul`, wgpu-native) at the same shapes: f32 activations, f16 weights where
    the f16 trunk has them (the forward's B), f32 otherwise; in a subprocess-free second device."""
    from ddl_wgpu.runtime.gpu import Gpu

    return _engine_tflops(Gpu(), shapes, lambda ta, tb: "f16" if tb else "f32", reps)


def split_slots(shapes, counts, b_dtype: str, accumulate: bool) -> dict:
    """The shapes through the engine's launcher on the matrix units (the runtime DDL_WGPU_RUNTIME picks,
    Dawn where the adapter lists a configuration), with `ops.matmul.TC_SPLIT_SLOTS` set to each count in
    turn: {count: {name: {"slices": p, "tflops": x}}}."""
    from ddl_wgpu.ops import matmul as mm
    from ddl_wgpu.ops import matmul_tc as k_tc
    from ddl_wgpu.runtime.gpu import Gpu

    gpu = Gpu()
    if not gpu.matrix_configs:
        raise SystemExit(f"--split-slots: {gpu.name} ({gpu.runtime_name}) lists no subgroup matrix")
    gpu.products = "matrix"
    cfg = k_tc.usable_config(gpu)
    tile = k_tc.pick_tile(gpu, cfg)
    print("adapter:", gpu.name, "| runtime", gpu.runtime_name, "| tile", tile.name(), flush=True)
    saved, out = mm.TC_SPLIT_SLOTS, {}
    try:
        for n in counts:
            mm.TC_SPLIT_SLOTS = n
            speeds = _engine_tflops(gpu, shapes, lambda ta, tb: b_dtype, accumulate=accumulate)
            out[n] = {s[0]: {"slices": mm.auto_split_k_tc(gpu, cfg, tile, *s[1:4]), "tflops": speeds[s[0]]}
                      for s in shapes}  # fmt: skip
            print(f"TC_SPLIT_SLOTS={n}: " + " ".join(f"{k}={v['tflops']:.1f} ({v['slices']} slices)"
                                                     for k, v in out[n].items()), flush=True)  # fmt: skip
    finally:
        mm.TC_SPLIT_SLOTS = saved
    return out


def save(path, results: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(results, indent=1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiles", default=",".join(DEFAULT_TILES))
    ap.add_argument("--shapes", default="all", help="all, the first N of SHAPES, or draft (DRAFT_SHAPES)")
    ap.add_argument("--only", default="", help="time only the shapes whose name contains this text")
    ap.add_argument("--orders", default="auto",
                    help="the grid's order of C's blocks, timed each: auto (`rows_first`), or cols,rows")  # fmt: skip
    ap.add_argument("--json", default=None)
    ap.add_argument("--simt", action="store_true", help="also time today's SIMT GEMM (wgpu-native)")
    ap.add_argument("--configs", default="first",
                    help="first (the configuration the engine routes products to), all, or MxNxK,...")  # fmt: skip
    ap.add_argument("--operands", default="f16,f16",
                    help="A,B types in storage for the timings: f16,f16, or f32,f16 as the f16 trunk's forward "
                         "(f32 activations), or f32,f32 as mixed-precision training")  # fmt: skip
    ap.add_argument("--accumulate", action="store_true", help="time C += op(A) op(B) (dW, the residual's)")
    ap.add_argument("--split-slots", default=None,
                    help="N,M,...: time the shapes through the engine's launcher with TC_SPLIT_SLOTS at each")  # fmt: skip
    args = ap.parse_args(argv)
    operands = tuple(args.operands.split(","))
    if len(operands) != 2 or not set(operands) <= {"f16", "f32"}:
        raise SystemExit(f"--operands {args.operands!r}: two of f16, f32, comma-separated")
    shapes = {"all": SHAPES, "draft": DRAFT_SHAPES}.get(args.shapes) or SHAPES[: int(args.shapes)]
    shapes = [s for s in shapes if args.only in s[0]]
    if args.split_slots:
        counts = [int(n) for n in args.split_slots.split(",")]
        results = {"operands": operands, "accumulate": args.accumulate,
                   "split_slots": split_slots(shapes, counts, operands[1], args.accumulate)}  # fmt: skip
        save(args.json, results)
        return 0
    wgpu, ad, dev, props = dawn_device()
    cfgs = props.get("subgroup_matrix_configs", [])
    print("adapter:", ad.summary)
    print("toggles:", TOGGLES)
    print("subgroup_matrix_configs:", cfgs)
    sg = ad.limits.get("max-subgroup-size", 32) or 32
    usable = [tc.Config(c["m"], c["n"], c["k"]) for c in cfgs
              if c["component_type"] == "f16" and c["result_component_type"] == "f32"]  # fmt: skip
    if not usable:
        print("no f16 -> f32 subgroup-matrix configuration on this adapter")
        return 1
    usable.sort(key=lambda c: (c != tc.Config(16, 16, 16), -c.m * c.n * c.k))  # usable_config's order
    if args.configs == "first":
        usable = usable[:1]
    elif args.configs != "all":
        usable = [c for c in usable if f"{c.m}x{c.n}x{c.k}" in args.configs.split(",")]
    r = Runner(wgpu, dev, sg)
    rng = np.random.default_rng(0)
    orders = args.orders.split(",")
    if not set(orders) <= {"auto", "cols", "rows"}:
        raise SystemExit(f"--orders {args.orders!r}: auto, or some of cols, rows")
    results = {"adapter": ad.summary, "configs": cfgs, "toggles": TOGGLES, "operands": operands,
               "accumulate": args.accumulate, "rows": []}  # fmt: skip
    peers = {s[0]: torch_tflops(s) for s in shapes}
    results["pytorch_bf16"] = peers
    print("pytorch bf16:", {k: (round(v, 1) if v else v) for k, v in peers.items()}, flush=True)
    if args.simt:
        results["simt"] = simt_tflops(shapes)
        print("simt (wgpu-native):", {k: round(v, 1) for k, v in results["simt"].items()}, flush=True)
    limit = ad.limits["max-compute-workgroup-storage-size"]
    for cfg in usable:
        for text in args.tiles.split(","):
            tile = parse_tile(text)
            if tile.bk % cfg.k or tc.workgroup_bytes(tile, cfg) > limit:
                continue
            label = f"{cfg.m}x{cfg.n}x{cfg.k} {tile.name()}"
            try:
                err = check(r, tile, cfg, rng)
            except Exception as e:  # a compile failure is an answer for this tile
                print(f"{label}: failed: {str(e)[:600]}", flush=True)
                continue
            row = {"config": [cfg.m, cfg.n, cfg.k], "tile": tile.name(), "max_rel_err": err, "tflops": {}}
            if err > 2e-3:
                print(f"{label}: WRONG, max rel err {err:.2e}", flush=True)
                results["rows"].append(row)
                continue
            for order in orders:
                first = {"auto": None, "rows": True, "cols": False}[order]
                for s in shapes:
                    row["tflops"][s[0] + ("" if order == "auto" else f" ({order})")] = time_shape(
                        r, tile, cfg, s, rng, operands=operands, order=first, accumulate=int(args.accumulate)
                    )
            results["rows"].append(row)
            print(
                f"{label}: err {err:.1e} " + " ".join(f"{k}={v:.1f}" for k, v in row["tflops"].items()),
                flush=True,
            )
            save(args.json, results)  # after every tile: a sweep cut short by its time limit keeps its rows
    save(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
