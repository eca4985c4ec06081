"""The ceiling of the GPU's matrix units as WGSL subgroup matrices reach them on Dawn: what bounds the GEMM
(`shaders/matmul_tc.wgsl`) on the matrix units, the multiply-accumulate instruction path itself, the matrix
loads from workgroup memory, or the barriers and global staging the GEMM adds around them.

    DDL_WGPU_RUNTIME=dawn python3 bench/matrix_ceiling.py [--json PATH] [--points mma/4/2x2,...]
    DDL_WGPU_RUNTIME=dawn python3 bench/matrix_ceiling.py --emulate    # lavapipe: the WGSL checked, no speed

Three generated kernels, each a workgroup of S subgroups (2 x 2 or 4 x 2, as the GEMM's tiles) that fills its
workgroup memory once from a storage buffer, in the GEMM's layout (A rows 32 + 8 f16 apart, B rows BN + 8),
then loops R times, each subgroup owning TM x TN f32 accumulators:
- `mma`: the TM left and TN right matrices loaded once before the loop; the loop only multiplies-accumulates.
  Its rate is the instruction path's ceiling (on Hopper, Vulkan's cooperative matrices become warp-level
  mma.sync, not wgmma).
- `smem`: each k32 step loads its 2 x (TM + TN) matrices from workgroup memory again, then the products: the
  GEMM's inner loop without global traffic or barriers. Below `mma` by what the loads cost.
- `smem-barrier`: `smem` with a workgroupBarrier() per k32 step: what the barrier adds.
The GEMM's own rate below `smem-barrier` is then the global staging's share. Each point's accumulators are
stored (by one workgroup: every workgroup computes the same) and checked against numpy, so nothing is dead
code and a wrong kernel is reported (exit 1 after the table). Dawn is opened as bench/matmul_tc.py opens it;
timing: GPU timestamps around a pass of enough dispatches to last ~25 ms (wall clock without timestamp-query),
after settling (`common.settle`), best of 3. PyTorch f16 at 8192^3 is printed beside it where CUDA is there.
An adapter without an f16 -> f32 configuration exits 2. `--emulate` runs the kernels at tiny R on any Dawn
adapter (lavapipe) with the matrix builtins replaced by tests/test_kernel_matmul_tc.py's WGSL emulation.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (puts the repository root on sys.path)
from matmul_tc import TOGGLES, Runner, dawn_device  # noqa: E402

from ddl_wgpu.ops.matmul_tc import Config  # noqa: E402

KERNELS = ("mma", "smem", "smem-barrier")
SG_ROWS = {4: 2, 8: 4}  # subgroups -> rows of them (2 columns): the GEMM's 2x2sg and 4x2sg tiles
DEFAULT_TILES = ((2, 2), (2, 4), (4, 4))
BK, PAD = 32, 8  # the GEMM's k step and row padding (f16 elements)
SMS = 132  # H100 SXM / H200: the default grid is 256 workgroups per SM
WORK = 16384  # multiply-accumulates per workgroup: every point's dispatch does the same FLOPs
TOL = 1e-2  # relative to max |expected|: f32 accumulation over up to 1024 steps, which tensor cores may truncate


@dataclass(frozen=True)
class Point:
    kernel: str
    s: int  # subgroups per workgroup
    tm: int
    tn: int

    @property
    def name(self) -> str:
        return f"{self.kernel}/{self.s}/{self.tm}x{self.tn}"

    def iters(self, work: int, slices: int) -> int:
        """R: each subgroup's matrix steps for `work` multiply-accumulates per workgroup, a multiple of `slices`
        (a turn of the loop is the GEMM's k32 step: two k16 slices)."""
        return max(slices, work // (self.s * self.tm * self.tn) // slices * slices)


def parse_points(text: str | None) -> list[Point]:
    if not text:
        return [Point(k, s, tm, tn) for s in SG_ROWS for tm, tn in DEFAULT_TILES for k in KERNELS]
    out = []
    for item in text.split(","):
        try:
            k, s, tile = item.strip().split("/")
            tm, tn = map(int, tile.split("x"))
            if k not in KERNELS or int(s) not in SG_ROWS or min(tm, tn) < 1:
                raise ValueError
        except ValueError:
            raise SystemExit(
                f"--points {item!r}: KERNEL/S/TMxTN, KERNEL one of {KERNELS}, S 4 or 8"
            ) from None
        out.append(Point(k, int(s), tm, tn))
    return out


def layout(p: Point, cfg: Config) -> dict:
    """The workgroup-memory tiles as the GEMM stages them for this subgroup grid and TM x TN at k32."""
    rows, cols = SG_ROWS[p.s], p.s // SG_ROWS[p.s]
    bm, bn = rows * p.tm * cfg.m, cols * p.tn * cfg.n
    sa, sb = BK + PAD, bn + PAD
    return {"cols": cols, "sa": sa, "sb": sb, "as": bm * sa, "bs": BK * sb}


def wgsl(p: Point, cfg: Config, sg: int) -> str:
    """The kernel, straight-line per step: each matrix its own variable (arrays of matrices are not allowed,
    and a loop over them would spill)."""
    g = layout(p, cfg)
    left = f"subgroup_matrix_left<f16, {cfg.k}, {cfg.m}>"
    right = f"subgroup_matrix_right<f16, {cfg.n}, {cfg.k}>"
    result = f"subgroup_matrix_result<f32, {cfg.n}, {cfg.m}>"
    pairs = [(i, j) for i in range(p.tm) for j in range(p.tn)]

    def loads(tag: str, kk: str) -> list[str]:
        return ([f"let l{i}{tag} = subgroupMatrixLoad<{left}>(&As, (sm + {i * cfg.m}u) * {g['sa']}u + {kk}, false, {g['sa']}u);"
                 for i in range(p.tm)]
                + [f"let r{j}{tag} = subgroupMatrixLoad<{right}>(&Bs, ({kk}) * {g['sb']}u + sn + {j * cfg.n}u, false, {g['sb']}u);"
                   for j in range(p.tn)])  # fmt: skip

    def products(tag: str) -> list[str]:
        return [
            f"c{i}_{j} = subgroupMatrixMultiplyAccumulate(l{i}{tag}, r{j}{tag}, c{i}_{j});" for i, j in pairs
        ]

    slices = BK // cfg.k  # a turn of the loop is one GEMM k step
    if p.kernel == "mma":
        before, body = loads("", "0u"), sum((products("") for _ in range(slices)), [])
    else:
        # the slice's k offset comes from the uniform kmask (1 at run time): the compiler cannot tell the offsets
        # repeat, so it can neither hoist the loads out of the loop nor unroll it into loop-invariant ones
        before, body = [], []
        for s in range(slices):
            body += loads(f"_{s}", f"((it + {s}u) & P.kmask) * {cfg.k}u") + products(f"_{s}")
        if p.kernel == "smem-barrier":
            body.append("workgroupBarrier();")
    stores = [f"subgroupMatrixStore(&c, ((sid * {p.tm}u + {i}u) * {p.tn}u + {j}u) * {cfg.m * cfg.n}u, c{i}_{j}, false, {cfg.n}u);"
              for i, j in pairs]  # fmt: skip
    ind = "\n" + " " * 8
    return f"""enable f16;
enable subgroups;
enable chromium_experimental_subgroup_matrix;

struct Params {{ iters: u32, kmask: u32, keep: u32, pad: u32 }}
@group(0) @binding(0) var<storage, read> src: array<f16>;
@group(0) @binding(1) var<storage, read_write> c: array<f32>;
@group(0) @binding(2) var<uniform> P: Params;

var<workgroup> As: array<f16, {g["as"]}>;
var<workgroup> Bs: array<f16, {g["bs"]}>;

@compute @workgroup_size({p.s * sg}, 1, 1)
fn ceiling(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32,
           @builtin(subgroup_id) sid: u32, @builtin(subgroup_invocation_id) lane: u32,
           @builtin(subgroup_size) sg_size: u32) {{
    for (var e = li; e < {g["as"]}u; e += {p.s * sg}u) {{ As[e] = src[e]; }}
    for (var e = li; e < {g["bs"]}u; e += {p.s * sg}u) {{ Bs[e] = src[{g["as"]}u + e]; }}
    workgroupBarrier();
    let sm = (sid / {g["cols"]}u) * {p.tm * cfg.m}u;  // the subgroup's first row of A and column of B
    let sn = (sid % {g["cols"]}u) * {p.tn * cfg.n}u;
    {(chr(10) + "    ").join(f"var c{i}_{j} = {result}();" for i, j in pairs)}
    {(chr(10) + "    ").join(before)}
    for (var it = 0u; it < P.iters; it += {slices}u) {{
        {ind.join(body)}
    }}
    // one workgroup stores (all compute the same); the compiler cannot know which, so none is dead code
    if (wid.x == P.keep) {{
        {ind.join(stores)}
    }}
}}
"""


def expected(p: Point, cfg: Config, src: np.ndarray, iters: int) -> np.ndarray:
    """What each subgroup's accumulators hold after `iters` steps: (S, TM, TN, m, n), in float64."""
    g = layout(p, cfg)
    A = src[: g["as"]].astype(np.float64).reshape(-1, g["sa"])
    B = src[g["as"] :].astype(np.float64).reshape(BK, g["sb"])
    slices = BK // cfg.k
    out = np.zeros((p.s, p.tm, p.tn, cfg.m, cfg.n))
    for s in range(p.s):
        sm, sn = (s // g["cols"]) * p.tm * cfg.m, (s % g["cols"]) * p.tn * cfg.n
        for i in range(p.tm):
            for j in range(p.tn):
                ks = [0] if p.kernel == "mma" else [t * cfg.k for t in range(slices)]
                prod = sum(A[sm + i * cfg.m : sm + (i + 1) * cfg.m, k : k + cfg.k]
                           @ B[k : k + cfg.k, sn + j * cfg.n : sn + (j + 1) * cfg.n] for k in ks)  # fmt: skip
                out[s, i, j] = prod * (iters if p.kernel == "mma" else iters // slices)
    return out


class Bench:
    """One Dawn device: compiles a point's kernel, runs it, times it, checks what it stored."""

    def __init__(self, wgpu, dev, sg: int, emulate: bool):
        self.wgpu, self.dev, self.sg, self.emulate = wgpu, dev, sg, emulate
        self.r = Runner(wgpu, dev, sg)  # for its storage buffers
        self.timed = "timestamp-query" in dev.features
        if self.timed:
            U = wgpu.BufferUsage
            self.qs = dev.create_query_set(type="timestamp", count=2)
            self.qbuf = dev.create_buffer(size=16, usage=U.QUERY_RESOLVE | U.COPY_SRC)

    def prepare(self, p: Point, cfg: Config, iters: int, rng):
        src = wgsl(p, cfg, self.sg)
        if self.emulate:
            src = emulated(src)
        pipe = self.dev.create_compute_pipeline(
            layout="auto",
            compute={"module": self.dev.create_shader_module(code=src), "entry_point": "ceiling"},
        )
        g = layout(p, cfg)
        host = rng.standard_normal(g["as"] + g["bs"]).astype(np.float16)  # random data: realistic power draw
        out = self.r.buffer(np.zeros(p.s * p.tm * p.tn * cfg.m * cfg.n, np.float32))
        params = np.array([iters, 1, 0, 0], np.uint32)  # iters, kmask, keep (the storing workgroup), pad
        ub = self.dev.create_buffer_with_data(data=params, usage=self.wgpu.BufferUsage.UNIFORM)
        bufs = (self.r.buffer(host), out, ub)
        bg = self.dev.create_bind_group(layout=pipe.get_bind_group_layout(0),
                                        entries=[{"binding": i, "resource": {"buffer": b}} for i, b in enumerate(bufs)])  # fmt: skip
        return pipe, bg, host, bufs

    def run_ms(self, pipe, bg, out, groups: int, n: int) -> float:
        """ms per dispatch of `n` dispatches in one pass: GPU timestamps, else wall clock to a read-back."""
        enc = self.dev.create_command_encoder()
        kw = {}
        if self.timed:
            kw["timestamp_writes"] = {"query_set": self.qs, "beginning_of_pass_write_index": 0,
                                      "end_of_pass_write_index": 1}  # fmt: skip
        ps = enc.begin_compute_pass(**kw)
        ps.set_pipeline(pipe)
        ps.set_bind_group(0, bg)
        for _ in range(n):
            ps.dispatch_workgroups(groups)
        ps.end()
        if self.timed:
            enc.resolve_query_set(self.qs, 0, 2, self.qbuf, 0)
        t0 = time.perf_counter()
        self.dev.queue.submit([enc.finish()])
        if self.timed:
            t = np.frombuffer(self.dev.queue.read_buffer(self.qbuf), np.uint64)
            return float(t[1] - t[0]) / 1e6 / n  # Dawn's timestamps are nanoseconds
        self.dev.queue.read_buffer(out, 0, 16)
        return (time.perf_counter() - t0) * 1e3 / n

    def point(self, p: Point, cfg: Config, groups: int, iters: int, rng, warm_s: float = 0.0) -> dict:
        """Run once and check the stored accumulators; unless emulating, keep the GPU busy `warm_s` seconds
        (clocks up), then time: enough dispatches per pass for ~25 ms, settled, best of 3."""
        pipe, bg, host, (inp, out, ub) = self.prepare(p, cfg, iters, rng)
        row = {"point": p.name, "kernel": p.kernel, "subgroups": p.s, "tile": f"{p.tm}x{p.tn}", "iters": iters,
               "groups": groups}  # fmt: skip
        try:
            est = self.run_ms(pipe, bg, out, groups, 1)  # also the driver's compile and first touches
            got = np.frombuffer(self.dev.queue.read_buffer(out), np.float32)
            row["max_rel_err"] = common.rel_err(got.reshape(p.s, p.tm, p.tn, cfg.m, cfg.n),
                                                expected(p, cfg, host, iters))  # fmt: skip
            if self.emulate:
                return row
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < warm_s:
                est = self.run_ms(pipe, bg, out, groups, 1)
            n = max(1, round(25.0 / max(est, 1e-3)))
            if est < 100:  # a slower dispatch is its own warm-up: bounds a pathological point's time
                common.settle(lambda k: self.run_ms(pipe, bg, out, groups, k), n, tries=4)
            ms = min(self.run_ms(pipe, bg, out, groups, n) for _ in range(3))
            flop = 2 * cfg.m * cfg.n * cfg.k * p.tm * p.tn * iters * p.s * groups
            row.update(ms=ms, tflops=flop / ms / 1e9, dispatches_per_pass=n)
            return row
        finally:
            for b in (inp, out, ub):
                b.destroy()


def emulated(src: str) -> str:
    """The kernel with tests/emulated_matrices.py's WGSL stand-ins for the matrix types and builtins (a 32-lane
    subgroup; the results stored to c, and a `Cs` the stand-ins' store into it wants declared)."""
    from tests.emulated_matrices import emulated as emulate
    from tests.emulated_matrices import emulation

    return emulate(
        src.replace("var<workgroup> As", "var<workgroup> Cs: array<f32, 256>;\nvar<workgroup> As", 1),
        emulation("As", "Bs", ("c", "Cs")),
    )


def torch_peer() -> tuple[float | None, str]:
    """PyTorch f16 8192^3 TFLOP/s on CUDA (cuBLAS: wgmma on Hopper), or None and why not."""
    torch, dev = common.torch_setup("auto")
    if torch is None or dev != "cuda":
        return None, f"torch f16 peer skipped: {dev}"
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.float16)
    b = torch.randn(n, n, device="cuda", dtype=torch.float16)
    ms = common.torch_time_ms(torch, dev, [lambda: a @ b], repeats=3)["ms"]
    return (
        2 * n * n * n / ms / 1e9,
        f"torch {torch.__version__} f16 matmul 8192^3 ({torch.cuda.get_device_name(0)})",
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", default=None, help="KERNEL/S/TMxTN,... (default: the 18-point sweep)")
    ap.add_argument("--groups", type=int, default=SMS * 256, help="workgroups per dispatch (1-D, <= 65535)")
    ap.add_argument("--work", type=int, default=WORK, help="multiply-accumulates per workgroup (sets R)")
    ap.add_argument("--emulate", action="store_true",
                    help="check the WGSL on any Dawn adapter (lavapipe): emulated matrices, tiny R, no timing")  # fmt: skip
    ap.add_argument("--json", default=None, help="default $OUT/matrix_ceiling.json, else bench/results/")
    args = ap.parse_args(argv)
    points = parse_points(
        args.points or ("mma/4/2x2,smem/4/2x2,smem-barrier/4/2x2" if args.emulate else None)
    )
    wgpu, ad, dev, props = dawn_device()
    cfgs = props.get("subgroup_matrix_configs") or []
    print("adapter:", ad.summary)
    print("toggles:", TOGGLES, "| timestamps:", "timestamp-query" in dev.features)
    f16 = [c for c in cfgs
           if c["component_type"] == "f16" and c["result_component_type"] == "f32" and BK % c["k"] == 0]  # fmt: skip
    f16.sort(key=lambda c: (c["m"], c["n"], c["k"]) != (16, 16, 16))  # the shape the GEMM uses, where listed
    if args.emulate:
        cfg, groups, sg = Config(16, 16, 16), 2, 32  # the emulation's shape and lanes; two workgroups
    elif not f16:
        print("no f16 -> f32 subgroup-matrix configuration on this adapter: nothing to measure")
        return 2
    else:
        # workgroups counted in the configuration's largest subgroup size, as Dawn sizes them
        cfg, groups = Config(f16[0]["m"], f16[0]["n"], f16[0]["k"]), args.groups
        sg = f16[0].get("max_subgroup_size") or ad.limits.get("max-subgroup-size") or 32
    print(
        f"configuration {cfg.m}x{cfg.n}x{cfg.k} f16 -> f32, {groups} workgroups, subgroup size {sg}",
        flush=True,
    )
    limit = ad.limits["max-compute-workgroup-storage-size"]
    bench, rng, rows = Bench(wgpu, dev, sg, args.emulate), np.random.default_rng(0), []
    warm = 0.0 if args.emulate else 1.0  # seconds of load before the first timed point
    for p in points:
        g = layout(p, cfg)
        if 2 * (g["as"] + g["bs"]) > limit:
            rows.append(
                {"point": p.name, "error": f"needs {2 * (g['as'] + g['bs'])} B of workgroup memory > {limit}"}
            )
        else:
            iters = 4 if args.emulate else p.iters(args.work, BK // cfg.k)
            # an idle GPU's clocks ramp for a second and more (bench/common.py, `warm_up`): load it first
            rows.append({"point": p.name, **common.attempt(bench.point, p, cfg, groups, iters, rng, warm)})
            if "error" not in rows[-1]:
                warm = 0.0  # only before the first point that runs
        r = rows[-1]
        tail = (f"error {r['error'][:300]}" if "error" in r else
                f"err {r['max_rel_err']:.1e}" + (f"  {r['ms']:.3f} ms  {r['tflops']:.1f} TFLOP/s" if "ms" in r else ""))  # fmt: skip
        print(f"{p.name}: {tail}", flush=True)
    tol = 1e-5 if args.emulate else TOL
    bad = [r["point"] for r in rows if "error" in r or r["max_rel_err"] > tol]
    peer, why = (None, "torch peer skipped: --emulate") if args.emulate else torch_peer()
    print()
    print(common.table(["kernel", "S", "TMxTN", "R", "ms", "TFLOP/s", "max rel err"], [
        [r["point"].split("/")[0], r["point"].split("/")[1], r["point"].split("/")[2], r.get("iters", "-"),
         common.fmt(r.get("ms"), ".3f"), common.fmt(r.get("tflops"), ".1f"),
         "ERROR" if "error" in r else common.fmt(r["max_rel_err"], ".1e")] for r in rows]))  # fmt: skip
    best = {k: max((r["tflops"] for r in rows if r.get("kernel") == k and "tflops" in r), default=None)
            for k in KERNELS}  # fmt: skip
    if not args.emulate:
        print("best TFLOP/s: " + ", ".join(f"{k} {common.fmt(v, '.1f')}" for k, v in best.items()))
    print(f"{why}: {peer:.1f} TFLOP/s" if peer else why)
    if bad:
        print(f"FAILED (error, or max rel err over {tol:g}): {', '.join(bad)}")
    # --json, else $OUT/ or bench/results/ as every script (common.json_path); --emulate only with --json
    if args.json or not args.emulate:
        common.write_json(common.json_path(args.json, "matrix_ceiling.json"), {
            "adapter": ad.summary, "configs": cfgs, "toggles": TOGGLES, "config": [cfg.m, cfg.n, cfg.k],
            "emulated": args.emulate, "timestamps": bench.timed, "torch_f16_8192_tflops": peer, "torch": why,
            "best_tflops": best, "points": rows, "date": common.now_iso()})  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
