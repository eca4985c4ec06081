"""How long a k chunk the f16-product GEMM may sum in f16: error against float64 per chunk length, and
(on a GPU, `--time`) the speed of each chunk length at training shapes.

    python3 bench/f16_chunk.py            # error table (any adapter with shader-f16; lavapipe: ~1 min)
    python3 bench/f16_chunk.py --time     # + GPU ms and TFLOP/s per chunk at the small preset's GEMMs

Error: for each K and data kind, the largest |C_f16 - C_exact| / (|A| @ |B|) over a 64 x 64 output (the
error per unit of the sum of |products|, which is what `ops.matmul.f16_rel_bound` bounds), and the same for
"rounding only": the operands rounded to f16 and multiplied exactly, i.e. the floor any chunk length adds
to; "bf16 rounding": the same with bf16 operands (what PyTorch's bf16 autocast starts from). Data: "normal" (zero mean: products cancel, as in activations times weights) and "uniform+" (all
products positive: no cancellation, partials as large as they get).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (puts the repository root on sys.path)
import numpy as np  # noqa: E402

from ddl_wgpu.ops import matmul as k_mm  # noqa: E402

CHUNKS = (1, 2, 4, 8, 16)
KS = (768, 2048, 16384)
# (label, M, N, K, trans_a, trans_b): the small preset's forward gate/up and dW gate/up products
TIMED = (
    ("fwd gate/up x W^T", 16384, 2048, 768, False, True),
    ("bwd dW gate/up dy^T x", 2048, 768, 16384, True, False),
)


def _bf16(x: np.ndarray) -> np.ndarray:
    """x rounded to bfloat16 (nearest, ties to even) as float64: the operand rounding of bf16 autocast."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


def error_table(gpu, rng) -> list[dict]:
    rows = []
    M = N = 64
    for K in KS:
        for kind in ("normal", "uniform+"):
            draw = rng.standard_normal if kind == "normal" else rng.random
            A, B = draw((M, K)).astype(np.float32), draw((K, N)).astype(np.float32)
            a64, b64 = A.astype(np.float64), B.astype(np.float64)
            ref, scale = a64 @ b64, np.abs(a64) @ np.abs(b64)
            floor = np.abs(A.astype(np.float16).astype(np.float64) @ B.astype(np.float16) - ref) / scale
            a, b, c = gpu.upload(A), gpu.upload(B), gpu.buffer(4 * M * N)
            bf = np.abs(_bf16(A) @ _bf16(B) - ref) / scale
            row = {
                "K": K,
                "data": kind,
                "rounding only": float(floor.max()),
                "bf16 rounding": float(bf.max()),
            }
            for ch in CHUNKS:
                k_mm.matmul(gpu, c, a, b, M, N, K, compute="f16", chunk=ch, split_k=1).run(gpu)
                got = gpu.download(c, np.float32, M * N).reshape(M, N)
                row[f"c{ch}"] = float((np.abs(got - ref) / scale).max())
            k_mm.matmul(gpu, c, a, b, M, N, K, split_k=1).run(gpu)
            row["f32"] = float((np.abs(gpu.download(c, np.float32, M * N).reshape(M, N) - ref) / scale).max())
            rows.append(row)
    return rows


def time_table(gpu, rng) -> list[dict]:
    rows = []
    for label, M, N, K, ta, tb in TIMED:
        A = gpu.upload(rng.standard_normal((K, M) if ta else (M, K)).astype(np.float32))
        B = gpu.upload(rng.standard_normal((N, K) if tb else (K, N)).astype(np.float32))
        c = gpu.buffer(4 * M * N)
        row = {"product": f"{label} {M}x{N}x{K}"}
        for name, kw in [("f32", {})] + [(f"c{ch}", {"compute": "f16", "chunk": ch}) for ch in CHUNKS]:
            t = common.gpu_time_ms(gpu, [k_mm.matmul(gpu, c, A, B, M, N, K, trans_a=ta, trans_b=tb, **kw)])
            row[name] = t["ms"]
            row[name + " TF/s"] = 2.0 * M * N * K / t["ms"] / 1e9
        rows.append(row)
    return rows


# (wx, wy, tm, tn[, bk]) candidates for F16_LARGE_TILE: the f32 tile, tiles with half or a quarter of its
# outputs per thread (fewer registers for the f16 partials) over the same or a smaller block, and a deeper
# k step (f16 halves the shared tiles' bytes)
TILES = ((16, 16, 8, 8), (16, 16, 8, 4), (16, 16, 4, 8), (16, 32, 4, 8), (32, 16, 8, 4), (16, 16, 4, 4),
         (32, 32, 4, 4), (32, 16, 4, 4), (16, 16, 4, 4, 32), (16, 16, 4, 8, 32))  # fmt: skip


SWEEP_CHUNKS = (16,)  # the fastest chunk at every tile of the first sweep (chunk 8 and 16: BENCHMARKS.md)


def sweep_table(gpu, rng, tiles=TILES, chunks=SWEEP_CHUNKS) -> list[dict]:
    """GPU ms of the TIMED products for every tile x chunk with f16 products, and f32 for reference."""
    ops = []
    for label, M, N, K, ta, tb in TIMED:
        A = gpu.upload(rng.standard_normal((K, M) if ta else (M, K)).astype(np.float32))
        B = gpu.upload(rng.standard_normal((N, K) if tb else (K, N)).astype(np.float32))
        ops.append((label, M, N, K, ta, tb, A, B, gpu.buffer(4 * M * N)))
    rows = []
    for tile, chunk in [(None, 0)] + [(t, c) for t in tiles for c in chunks]:
        row = {
            "tile": "f32 (LARGE_TILE)" if tile is None else "x".join(map(str, tile)),
            "chunk": chunk,
            "ms": [],
        }
        for _label, M, N, K, ta, tb, A, B, c in ops:
            kw = {} if tile is None else {"compute": "f16", "chunk": chunk, "tile": k_mm.Tile(*tile)}
            kw["split_k"] = None if tile is None else k_mm.auto_split_k(gpu, M, N, K, 1)
            t = common.gpu_time_ms(gpu, [k_mm.matmul(gpu, c, A, B, M, N, K, trans_a=ta, trans_b=tb, **kw)])
            row["ms"].append(t["ms"])
        row["tflops"] = [
            2.0 * M * N * K / ms / 1e9 for (_l, M, N, K, *_), ms in zip(ops, row["ms"], strict=True)
        ]
        rows.append(row)
        print(f"  {row['tile']} chunk {chunk}: " + ", ".join(f"{m:.3f} ms" for m in row["ms"]), flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--time", action="store_true", help="also time each chunk length (GPU)")
    ap.add_argument(
        "--sweep", default=None, help="time every f16 tile x chunk; write the fastest to this file"
    )
    ap.add_argument("--tiles", default=None,
                    help="--sweep's f16 tiles, 'wx,wy,tm,tn[,bk];...' (default: TILES)")  # fmt: skip
    ap.add_argument("--sweep-chunks", default=None, help="--sweep's chunk lengths, '4,16' (default 16)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    gpu = common.open_gpu(args.device)
    print("adapter:", common.adapter_line(gpu))
    rng = np.random.default_rng(0)
    err = error_table(gpu, rng)
    heads = ["K", "data", "bf16 rounding", "rounding only", *[f"c{c}" for c in CHUNKS], "f32"]
    bound = ["bound", "(any)", "", "", *[f"{k_mm.f16_rel_bound(16384, c):.2e}" for c in CHUNKS], ""]
    cells = [[r["K"], r["data"], *[common.fmt(r[h], ".2e") for h in heads[2:]]] for r in err]
    print(common.table(heads, cells + [bound],
                       "max |C - C64| / (|A||B|) per chunk length (64 x 64 x K)"))  # fmt: skip
    out = {"adapter": common.adapter_line(gpu), "errors": err}
    if args.time:
        tt = time_table(gpu, rng)
        heads = ["product", "f32", *[f"c{c}" for c in CHUNKS]]
        print(common.table(heads, [[r["product"], *[f"{r[h]:.3f} ms ({r[h + ' TF/s']:.1f})" for h in heads[1:]]]
                                   for r in tt], "GPU ms (TFLOP/s) per chunk length"))  # fmt: skip
        out["times"] = tt
    if args.sweep:
        tiles = [tuple(int(x) for x in t.split(",")) for t in args.tiles.split(";")] if args.tiles else TILES
        chunks = [int(c) for c in args.sweep_chunks.split(",")] if args.sweep_chunks else SWEEP_CHUNKS
        sw = sweep_table(gpu, rng, tiles, chunks)
        best = min(sw[1:], key=lambda r: sum(r["ms"]))
        print(f"fastest f16 tile: {best['tile']} chunk {best['chunk']} ({sum(best['ms']):.3f} ms for both products; "
              f"f32 {sum(sw[0]['ms']):.3f})")  # fmt: skip
        Path(args.sweep).write_text(f"{best['tile'].replace('x', ',')} {best['chunk']}\n")
        out["sweep"] = sw
    common.write_json(common.json_path(args.json, "f16_chunk"), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
