"""The chunked gated delta rule's plan: its tunables (`ChunkPlan`), each kernel's workgroup-memory layout, and
the straight-line WGSL every product of `shaders/gated_delta.wgsl`'s chunked kernels runs
(docs/kernels.md#the-chunked-form).

Every product is a register `Tile` (`ddl_wgpu/ops/codegen/wgsl_tiles.py`) over operands in workgroup memory. An operand
that streams from global memory is staged a slab of `bk` rows of k at a time into one of two buffers (`Stage`,
`slab_loop`): each step loads the next slab into registers, runs this slab's bk FMA steps, stores the next
slab into the other buffer and meets one barrier. A slab row is k-major and packed as vec4 along the
output's rows (A) or columns (B); rows copied from a matrix stored along the other axis ("transposed") have
one vec4 of padding, so the transposing stores of neighbouring threads fall in different banks.

The layouts are one `array<vec4<f32>>` per kernel carved at constant offsets (vec4 units; scalar regions are
read as `sm[i >> 2][i & 3]` from float offsets). A kernel whose workgroup memory would exceed the adapter's
limit at the plan's slab depth halves it (`Layout.bk`): the depth changes no bit of any result.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from ddl_wgpu.ops import pow2_at_least
from ddl_wgpu.ops.codegen import wgsl_tiles as tl
from ddl_wgpu.runtime.gpu import GpuError

KERNELS = (
    "CP",
    "CF",
    "CO",
    "CB",
    "CG",
)  # chunk_prep, chunk_forward, chunk_output, chunk_backward_state, _grads
GATES_FLOATS = {"CP": 3, "CF": 3, "CO": 3, "CB": 3, "CG": 7}  # per token: the f32 arrays beside the vec4 one


@dataclass(frozen=True)
class ChunkPlan:
    """The tunables of the chunked kernels, all powers of two. `chunk`: tokens per chunk (C); `bv`: value
    columns of the state per workgroup of the two sequential kernels (chunk_forward, chunk_backward_state:
    their grid is batch rows x value heads x Dv/bv); `threads` per workgroup of those, `pthreads` of the
    per-chunk ones (chunk_prep, chunk_output, chunk_backward_grads); `bk`: rows of k per staged slab (the
    most: a kernel short of workgroup memory halves it); `tb`: the prep's blocks of Tm (the diagonal ones
    solved a column per thread, tb steps long). Only chunk, tb and pthreads change the rounding; bv, threads
    and bk change which thread computes what, not the order of any sum."""

    chunk: int = 64
    bv: int = 32
    threads: int = 128
    bk: int = 16
    tb: int = 16
    pthreads: int = 256

    def dims(self, Dk: int, Dv: int) -> tuple[int, int]:
        """Dk, Dv padded to powers of two (at least 4, and Dv at least bv)."""
        return max(pow2_at_least(Dk), 4), max(pow2_at_least(Dv), self.bv, 4)

    def layouts(self, Dk: int, Dv: int, limit: int) -> dict[str, Layout]:
        """Each kernel's layout within `limit` bytes of workgroup memory (GpuError when one cannot fit)."""
        out = {}
        for k in KERNELS:
            bk = min(self.bk, self.chunk)
            while True:
                lay = _layout(k, self, Dk, Dv, bk)
                if lay.bytes <= limit or bk == 1:
                    break
                bk //= 2
            if lay.bytes > limit:
                raise GpuError(f"gated delta plan {self}: {_NAMES[k]} needs {lay.bytes} bytes of workgroup memory, "
                               f"more than the limit {limit}")  # fmt: skip
            out[k] = lay
        return out

    def shared_bytes(self, Dk: int, Dv: int, limit: int = 1 << 30) -> dict[str, int]:
        """Workgroup memory of each kernel, bytes (within `limit`: the slab depths it would run with)."""
        return {k: lay.bytes for k, lay in self.layouts(Dk, Dv, limit).items()}

    def check(self, gpu, Dk: int, Dv: int) -> None:
        """Raise GpuError (one line) when this plan cannot run on the adapter."""
        cdk, cdv = self.dims(Dk, Dv)
        pow2 = all(x >= 1 and x & (x - 1) == 0 for x in (self.chunk, self.bv, self.threads, self.bk, self.tb,
                                                             self.pthreads))  # fmt: skip
        if (
            not pow2
            or self.chunk < 4
            or self.bv < 4
            or self.bv > cdv
            or min(self.threads, self.pthreads) < self.chunk
        ):
            raise GpuError(f"gated delta plan {self}: needs powers of two with 4 <= chunk <= threads and pthreads, "
                           "4 <= bv <= Dv padded")  # fmt: skip
        most = max(self.threads, self.pthreads)
        if most > gpu.limits.get("max-compute-invocations-per-workgroup", 256):
            raise GpuError(f"gated delta plan {self}: {most} threads exceed the adapter's limit")
        self.layouts(Dk, Dv, gpu.limits.get("max-compute-workgroup-storage-size", 16 << 10))

    def text(self) -> str:
        """The DDL_WGPU_GDN_PLAN form."""
        return ",".join(f"{k}={getattr(self, k)}" for k in ChunkPlan.__dataclass_fields__)


_NAMES = {"CP": "chunk_prep", "CF": "chunk_forward", "CO": "chunk_output", "CB": "chunk_backward_state",
          "CG": "chunk_backward_grads"}  # fmt: skip


def parse_plan(text: str) -> ChunkPlan:
    """A plan from "chunk=64,bv=32,threads=128,bk=16" (any subset; the rest the dataclass's defaults)."""
    plan = ChunkPlan()
    names = ", ".join(ChunkPlan.__dataclass_fields__)
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, _, value = item.partition("=")
        key = key.strip()
        if key not in ChunkPlan.__dataclass_fields__ or not value.strip().isdigit():
            raise GpuError(f"gated delta plan {text!r}: expected name=integer with names {names}")
        plan = replace(plan, **{key: int(value)})
    return plan


# ---------------------------------------------------------------------------------------------------------
# staging and the slab loop


@dataclass(frozen=True)
class Src:
    """One way of filling a stage's slab: `split` names kk (the slab row) and g (the vec4 group) from the slot
    e; `fetch(k)` is the slot's vec4 for the slab whose first k is the WGSL expression k (it may use kk and
    g); `when(k)` the condition choosing this source (None: the last one, the otherwise)."""

    split: str
    fetch: Callable[[str], str]
    when: Callable[[str], str] | None = None


def direct(groups: int, fetch: Callable[[str], str], **kw) -> Src:
    """A slab copied as stored: slot e -> row kk = e / groups, group g (neighbouring threads: neighbouring
    vec4 of one row)."""
    return Src(f"let kk = e / {groups}u; let g = e - kk * {groups}u;", fetch, **kw)


def transposed(fetch: Callable[[str], str], **kw) -> Src:
    """A slab copied from a matrix stored along the other axis: slot e -> group g = e / bk, row kk
    (neighbouring threads read neighbouring columns of the stored rows and store to slab rows an odd number
    of vec4 apart: different banks)."""
    return Src("let g = e / BK_u; let kk = e - g * BK_u;", fetch, **kw)


@dataclass(frozen=True)
class Stage:
    name: str
    base: str  # WGSL constant: vec4 offset of buffer 0 (buffer 1 follows at + bk * stride)
    stride: int  # vec4 per slab row
    groups: int  # vec4 groups filled per slab row
    srcs: tuple[Src, ...]


def stage(name: str, base: str, stride: int, groups: int, *srcs: Src) -> Stage:
    return Stage(name, base, stride, groups, tuple(srcs))


def slab_loop(
    sm: str, stages: list[Stage], K: int, body, bk: int, nt: int, skip: str | None = None
) -> list[str]:
    """The generated k loop of K (a multiple of bk) over `stages` (module docstring): registers
    pf_<stage>_<j>, the first slab loaded and stored, then per slab: the next one loaded into registers,
    `body(kk, bufs)` for kk < bk (bufs: each stage's current buffer offset), the next stored into the other
    buffer, one barrier. Inside, k0 is the slab's first k. Starts and ends with a barrier's guarantees: the
    buffers are free before (the caller's last barrier) and after. `skip`: a condition on k0 (and the
    thread's rows) under which this thread's FMAs of the slab are all by exact zeros, left out (the sums
    keep their order: the same bits)."""
    ns = K // bk
    assert ns * bk == K and ns >= 1, (K, bk)

    def regs(st: Stage) -> int:
        return -(-bk * st.groups // nt)

    def per_src(st: Stage, k: str, j: int, what: Callable[[Src], str]) -> str:
        parts = []
        for i, s in enumerate(st.srcs):
            split = s.split.replace("BK_u", f"{bk}u")
            inner = f"{{ let e = lid + {j * nt}u; if (e < {bk * st.groups}u) {{ {split} {what(s)} }} }}"
            if s.when is None:
                parts.append(inner if i == 0 else f"else {inner}")
            else:
                parts.append(f"{'if' if i == 0 else 'else if'} ({s.when(k)}) {inner}")
        return " ".join(parts)

    def fetch(k: str) -> list[str]:
        out = []
        for st in stages:
            for j in range(regs(st)):
                reg = f"pf_{st.name}_{j}"

                out.append(per_src(st, k, j, lambda s, reg=reg: f"{reg} = {s.fetch(k)};"))
        return out

    def store(k: str, buf: str) -> list[str]:
        out = []
        for st in stages:
            for j in range(regs(st)):
                dst = (
                    f"{sm}[{st.base} + {buf} * {bk * st.stride}u + kk * {st.stride}u + g] = pf_{st.name}_{j};"
                )
                out.append(per_src(st, k, j, lambda s, dst=dst: dst))
        return out

    lines = [f"var pf_{st.name}_{j} = vec4<f32>(0.0);" for st in stages for j in range(regs(st))]
    lines += [
        "{",
        "    let k0 = 0u;",
        *("    " + x for x in fetch("k0")),
        *("    " + x for x in store("k0", "0u")),
        "}",
    ]
    lines += ["workgroupBarrier();", f"for (var sl = 0u; sl < {ns}u; sl++) {{", f"    let k0 = sl * {bk}u;",
              "    let cur = sl & 1u;"]  # fmt: skip
    if ns > 1:
        lines += [f"    if (sl + 1u < {ns}u) {{", f"        let kn = k0 + {bk}u;", *("        " + x for x in fetch("kn")),
                  "    }"]  # fmt: skip
    bufs = {st.name: f"({st.base} + cur * {bk * st.stride}u)" for st in stages}
    pad = "    "
    if skip:
        lines.append(f"    if (!({skip})) {{")
        pad = "        "
    for kk in range(bk):
        lines += [pad + x for x in body(kk, bufs)]
    if skip:
        lines.append("    }")
    if ns > 1:
        lines += [f"    if (sl + 1u < {ns}u) {{", f"        let kn = k0 + {bk}u;",
                  *("        " + x for x in store("kn", "(1u - cur)")), "    }"]  # fmt: skip
    lines += ["    workgroupBarrier();", "}"]
    return lines


def vec4_of(fn: Callable[[int], str]) -> str:
    """vec4<f32>(fn(0), fn(1), fn(2), fn(3))."""
    return "vec4<f32>(" + ", ".join(fn(f) for f in range(4)) + ")"


def slab(sm: str, buf: str, stride: int, kk: int) -> Callable[[str], str]:
    """The reader of vec4 group g at row kk of a slab buffer."""
    return lambda g: f"{sm}[{buf} + {kk}u * {stride}u + {g}]"


def resident(sm: str, base: str, stride: int, kk: int) -> Callable[[str], str]:
    """The reader of vec4 group g at row k0 + kk of a region that stays in workgroup memory."""
    return lambda g: f"{sm}[{base} + (k0 + {kk}u) * {stride}u + {g}]"


def product(t: tl.Tile, acc: str, a, b):
    """The FMA step of acc += A B for `slab_loop`: a(kk, bufs), b(kk, bufs) give the operands' readers."""
    return lambda kk, bufs: tl.fma(t, [(acc, "a", "b")], {"a": a(kk, bufs)}, {"b": b(kk, bufs)})


def stores(t: tl.Tile, acc: str, fn: Callable[[str, str, str], str]) -> list[str]:
    """Per accumulator of the active threads: the statements fn(row, colg, the vec4 variable)."""
    return tl.each(
        t, lambda a, e, b, nm: f"if {t.active()} {{ {fn(t.row(a, e), t.colg(b), f'{acc}_{nm}')} }}"
    )


def scalars(target: Callable[[int], str], value: str) -> str:
    """target(f) = value.f for f < 4: a vec4 into f32 storage."""
    return " ".join(f"{target(f)} = {value}.{tl.XYZW[f]};" for f in range(4))


def row_sums(pre: str, t: tl.Tile, red: str, nt: int, part: Callable[[int, int], str], out: str) -> list[str]:
    """Per output row of tile t, the sum of a per-element quantity: the thread's partial of row (a, e) is
    part(a, e) (an f32 expression over its columns), put at float red + row * wx + tx; then a row's wx
    partials are summed in order into the f32 array `out`[row]. Barriers after both steps."""
    lines = [f"if {t.active()} {{ {pre}_wr({red} + {t.row(a, e)} * {t.wx}u + tx_{t.name}, {part(a, e)}); }}"
             for a in range(t.gm) for e in range(4)]  # fmt: skip
    return lines + [
        "workgroupBarrier();",
        f"for (var r = lid; r < {t.rows}u; r += {nt}u) {{",
        "    var acc = 0.0;",
        f"    for (var x = 0u; x < {t.wx}u; x++) {{ acc += {pre}_rd({red} + r * {t.wx}u + x); }}",
        f"    {out}[r] = acc;",
        "}",
        "workgroupBarrier();",
    ]


def dots(t: tl.Tile, acc: str, a: int, e: int, other: Callable[[str, str], str]) -> str:
    """Σ over the thread's columns of row (a, e): acc · other(row, colg) (a vec4 expression per group)."""
    return " + ".join(f"dot({acc}_{a}_{e}_{b}, {other(t.row(a, e), t.colg(b))})" for b in range(t.gn))


# ---------------------------------------------------------------------------------------------------------
# layouts


@dataclass
class Layout:
    """One kernel's workgroup memory: offsets (vec4 units; float units for names ending in _F), its size in
    vec4, the slab depth it runs with, and the floats of its f32 arrays (gates, row sums)."""

    bk: int
    offsets: dict[str, int] = field(default_factory=dict)
    size: int = 1
    extra_floats: int = 0

    @property
    def bytes(self) -> int:
        return 16 * self.size + 4 * self.extra_floats


def tiles(plan: ChunkPlan, Dk: int, Dv: int) -> dict[str, tl.Tile]:
    """The register tile of every product (the grads' y and z tiles share thread rows: z's rows are y's
    second half, so the dk terms of y stay in the registers that z's are added to)."""
    cdk, cdv = plan.dims(Dk, Dv)
    C, V, n, m = plan.chunk, plan.bv, plan.threads, plan.pthreads
    ty = tl.tile("y", 2 * C, cdk, m, wy=C // 4)
    tz = tl.tile("z", C, cdk, m, wy=C // 4)
    assert ty.wx == tz.wx and ty.gm == 2 and tz.gm == 1, (ty, tz)
    return {
        "kq": tl.tile("kq", 2 * C, C, m),  # prep: [K; Q] Kᵀ
        "w": tl.tile("w", C, cdk, m, contig=True),  # prep: W = Tm diag(βΓ) K
        "u": tl.tile("u", C, cdv, m, contig=True),  # prep: U = Tm diag(β) V
        "x": tl.tile("x", 2 * C, V, n),  # forward: [W; Q] S
        "s": tl.tile("s", cdk, V, n),  # the state block (forward S, backward dS)
        "o": tl.tile("o", C, cdv, m, contig=True),  # output: P Δ
        "d": tl.tile("d", C, V, n, contig=True),  # backward state: dΔ
        "r": tl.tile("r", C, cdv, m, contig=True),  # grads: dR = Tmᵀ dΔ
        "e": tl.tile("e", 2 * C, C, m),  # grads: [dO; dR] Δᵀ
        "y": ty,  # grads: [dO; dR] S₀ᵀ, then + E K
        "z": tz,  # grads: Δ dSᵀ, then + E'ᵀ [Q; βK]
    }


# the grads kernel's loops: (A stride, B stride) as functions of (C, cdk, cdv), vec4
def _cg_strides(C: int, cdk: int, cdv: int) -> dict[str, tuple[int, int]]:
    T2, T1, TK = 2 * C // 4 + 1, C // 4 + 1, cdk // 4 + 1
    return {"R": (C // 4, cdv // 4), "E": (T2, T1), "Y1": (T2, TK), "Y2": (T2, cdk // 4), "Z1": (T1, TK),
            "Z2": (C // 4, cdk // 4)}  # fmt: skip


def _layout(kernel: str, plan: ChunkPlan, Dk: int, Dv: int, bk: int) -> Layout:
    cdk, cdv = plan.dims(Dk, Dv)
    C, tb, sv = plan.chunk, min(plan.tb, plan.chunk), plan.bv // 4
    bk = min(bk, C, cdk)
    t = tiles(plan, Dk, Dv)
    T2, T1 = 2 * C // 4 + 1, C // 4 + 1  # slab strides of transposed copies (vec4)
    lay = Layout(bk, extra_floats=GATES_FLOATS[kernel] * C)

    def q(floats: int) -> int:
        return -(-floats // 4)

    if kernel == "CP":
        # region 1: the [K; Q] slabs, then A and the solve's sums, then the W / U slabs; region 2: Tm
        solve = q(C * (C + 1) + max(1, (C - tb) * tb))
        r1 = max(2 * bk * T2, solve, 2 * bk * (cdk // 4), 2 * bk * (cdv // 4))
        lay.offsets = {"KQ": 0, "RW": 0, "A_F": 0, "X_F": C * (C + 1), "T_F": 4 * r1}
        lay.size = r1 + q(C * (C + 1))
    elif kernel == "CF":  # the state block S, Δ of the block's columns, then the slabs
        lay.offsets = {"SS": 0, "DS": cdk * sv, "SLAB": (cdk + C) * sv}
        lay.size = (cdk + C) * sv + max(2 * bk * T2, 2 * bk * (cdk // 4))
    elif kernel == "CO":
        lay.offsets = {"PA": 0, "DB": 2 * bk * T1}
        lay.size = 2 * bk * T1 + 2 * bk * (cdv // 4)
    elif kernel == "CB":  # rows [dΔ; dO; dS] of the block's columns, then the slabs
        rb = (2 * C + cdk) * sv
        lay.offsets = {"RB": 0, "SLAB": rb}
        lay.size = rb + max(2 * bk * T1, 2 * bk * (cdk // 4))
    else:  # CG: per loop its A buffers then its B buffers; the row-sum partials in the same place after
        size = 1
        for name, (sa, sb) in _cg_strides(C, cdk, cdv).items():
            lay.offsets[name + "A"] = 0
            lay.offsets[name + "B"] = 2 * bk * sa
            size = max(size, 2 * bk * (sa + sb))
        red = max(C * t["r"].wx, 2 * C * t["y"].wx, C * t["z"].wx, plan.pthreads)
        lay.offsets["RED_F"] = 0
        lay.size = max(size, q(red))
        lay.extra_floats += 2 * C  # the row sums c_rs
    return lay


def tp_block(plan: ChunkPlan, Dk: int, Dv: int) -> int:
    """Floats of one chunk's block of the prep's output (`tp`): W (C x Dk padded), P (C x C), then U (C x Dv
    padded: the forward's) or Tm (C x C: the backward's)."""
    cdk, cdv = plan.dims(Dk, Dv)
    C = plan.chunk
    return C * cdk + C * C + C * max(cdv, C)


def chunk_templates(plan: ChunkPlan, Dk: int, Dv: int, limit: int) -> dict[str, str]:
    """The `{{name}}` values of the chunked kernels for an adapter with `limit` bytes of workgroup memory:
    sizes, offsets and the generated code of every product."""
    cdk, cdv = plan.dims(Dk, Dv)
    C = plan.chunk
    lays = plan.layouts(Dk, Dv, limit)
    tt = tiles(plan, Dk, Dv)
    out = {"CC": str(C), "CDK": str(cdk), "CDV": str(cdv), "BV": str(plan.bv), "CNT": str(plan.threads),
           "CNTP": str(plan.pthreads), "TB": str(min(plan.tb, C)), "TPB": str(tp_block(plan, Dk, Dv))}  # fmt: skip
    consts = []
    for k, lay in lays.items():
        out[k + "_SM"] = str(lay.size)
        consts += [f"const {k}_{name}: u32 = {v}u;" for name, v in lay.offsets.items()]
    out["CHUNK_CONSTS"] = "\n".join(consts)
    gen = _Gen(plan, lays, tt, cdk, cdv)
    for part in (gen.prep(), gen.forward(), gen.output(), gen.backward_state(), gen.grads()):
        out |= {k: tl.indent(v, 4) if isinstance(v, list) else v for k, v in part.items()}
    return out


@dataclass
class _Gen:
    """The generated parts of each chunked kernel (placeholders of shaders/gated_delta.wgsl, by kernel
    prefix). Every part is a list of lines placed at the kernel body's indentation."""

    plan: ChunkPlan
    lays: dict[str, Layout]
    tt: dict[str, tl.Tile]
    cdk: int
    cdv: int

    def loop(self, kernel: str, stages, K: int, body, threads: int, skip=None) -> list[str]:
        """A product's slab loop; `skip(bk)` the condition (on k0) of a triangular operand's zero slabs."""
        sm = {"CP": "cp_sm", "CF": "cf_sm", "CO": "co_sm", "CB": "cb_sm", "CG": "cg_sm"}[kernel]
        bk = self.lays[kernel].bk
        lines = slab_loop(sm, stages, K, body, bk, threads, skip(bk) if skip else None)
        return ["{", *("    " + x for x in lines), "}"]

    # -- chunk_prep ---------------------------------------------------------------------------------------

    def prep(self) -> dict[str, list[str]]:
        C, nt, cdk, cdv = self.plan.chunk, self.plan.pthreads, self.cdk, self.cdv
        tk, tw, tu = self.tt["kq"], self.tt["w"], self.tt["u"]
        T2, c4 = 2 * C // 4 + 1, C // 4
        kq = stage("kq", "CP_KQ", T2, 2 * c4, transposed(lambda k: vec4_of(
            lambda f: f"cp_ld(select(0u, 1u, g < {c4}u), b, t0 + 4u * (g % {c4}u) + {f}u, hk, {k} + kk)")))  # fmt: skip
        # [K; Q] Kᵀ: B = Kᵀ is the slab's K part (column groups < C/4 of the same buffer)
        body = product(tk, "kq", lambda kk, bufs: slab("cp_sm", bufs["kq"], T2, kk),
                       lambda kk, bufs: slab("cp_sm", bufs["kq"], T2, kk))  # fmt: skip
        out = {"CP_COORDS": [tk.coords(), tw.coords(), tu.coords()]}
        out["CP_KQ"] = tl.decl(tk, "kq") + self.loop("CP", [kq], cdk, body, nt)

        def mask(row: str, colg: str, v: str) -> str:  # A (workgroup) and P (tp) from the KK / QK rows
            a_ = " ".join(
                f"{{ let s = 4u * {colg} + {f}u; cp_wr(CP_A_F + t * {C + 1}u + s, select(0.0, c_bet[t] * c_decay(t, s) * {v}.{tl.XYZW[f]}, s < t)); }}"
                for f in range(4))  # fmt: skip
            p_ = " ".join(
                f"{{ let s = 4u * {colg} + {f}u; cp_scr[blk + TP_P + t * CC + s] = select(0.0, c_decay(t, s) * {v}.{tl.XYZW[f]}, s <= t); }}"
                for f in range(4))  # fmt: skip
            return f"let tq = {row}; if (tq < CC) {{ let t = tq; {a_} }} else {{ let t = tq - CC; {p_} }}"

        out["CP_MASK"] = stores(tk, "kq", mask)

        def wu(t: tl.Tile, acc: str, width: int, src, scale: str, dst: str) -> list[str]:
            g4 = width // 4
            st = stage(acc, "CP_RW", g4, g4, direct(g4, lambda k: f"({scale.format(s=f'{k} + kk')}) * " + vec4_of(
                lambda f: src(f"{k} + kk", f"4u * g + {f}u"))))  # fmt: skip

            def a(kk, bufs):  # Tm[t, s] read as scalars (row-major, odd stride)
                return tl.Scalar(lambda row: f"cp_rd(CP_T_F + {row} * {C + 1}u + k0 + {kk}u)")

            body = product(t, acc, a, lambda kk, bufs: slab("cp_sm", bufs[acc], g4, kk))
            put = stores(t, acc, lambda row, colg, v: f"let o = blk + {dst} + {row} * {width}u + 4u * {colg}; "
                         + scalars(lambda f: f"cp_scr[o + {f}u]", v))  # fmt: skip
            lower = lambda bk: f"k0 > {t.rows_range()[1]}"  # noqa: E731 (Tm[t, s] = 0 for s > t)
            return tl.decl(t, acc) + self.loop("CP", [st], C, body, nt, lower) + put

        out["CP_W"] = wu(
            tw,
            "w",
            cdk,
            lambda s, i: f"cp_ld(1u, b, t0 + {s}, hk, {i})",
            "c_bet[{s}] * exp(c_gam[{s}])",
            "0u",
        )
        out["CP_U"] = wu(tu, "u", cdv, lambda s, i: f"cp_ldv(b, t0 + {s}, h, {i})", "c_bet[{s}]", "TP_X")
        return out

    # -- chunk_forward ------------------------------------------------------------------------------------

    def forward(self) -> dict[str, list[str]]:
        C, V, nt, cdk = self.plan.chunk, self.plan.bv, self.plan.threads, self.cdk
        tx, ts = self.tt["x"], self.tt["s"]
        sv, T2, k4 = V // 4, 2 * C // 4 + 1, cdk // 4
        out = {"CF_COORDS": [tx.coords(), ts.coords()]}
        out["CF_S_INIT"] = [f"var s_{nm} = " + vec4_of(lambda f, a=a, e=e, b=b: f"cf_ldinit(bh, {ts.row(a, e)}, j0 + 4u * {ts.colg(b)} + {f}u)") + ";"
                            for a, e, b, nm in ((a, e, b, f"{a}_{e}_{b}") for a, e, b in ts.blocks())]  # fmt: skip
        mirror = stores(ts, "s", lambda row, colg, v: f"cf_sm[CF_SS + {row} * {sv}u + {colg}] = {v};")
        out["CF_S_INIT"] += mirror
        out["CF_S_MIRROR"] = mirror
        out["CF_S_STORE"] = stores(ts, "s", lambda row, colg, v: " ".join(
            f"cf_store_state(slot, {row}, j0 + 4u * {colg} + {f}u, {v}.{tl.XYZW[f]});" for f in range(4)))  # fmt: skip
        # X = [W; Q] S over Dk: the rows of W (tp) and Q staged transposed, S from its copy
        xa = stage("xa", "CF_SLAB", T2, 2 * C // 4, transposed(lambda k: vec4_of(
            lambda f: f"cf_xa(blk, b, t0, hk, 4u * g + {f}u, {k} + kk)")))  # fmt: skip
        body = product(tx, "x", lambda kk, bufs: slab("cf_sm", bufs["xa"], T2, kk),
                       lambda kk, bufs: resident("cf_sm", "CF_SS", sv, kk))  # fmt: skip
        out["CF_X"] = tl.decl(tx, "x") + self.loop("CF", [xa], cdk, body, nt)

        def epi(row: str, colg: str, v: str) -> str:  # Δ = U - X_W (workgroup and delta); o = Γ X_Q
            j = f"j0 + 4u * {colg}"
            u = vec4_of(lambda f: f"cf_scr[blk + TP_X + t * CDV + {j} + {f}u]")
            d = " ".join(f"cf_store_delta(b, t0 + t, h, {j} + {f}u, dd.{tl.XYZW[f]});" for f in range(4))
            o = " ".join(f"cf_store_o(b, t0 + t, h, {j} + {f}u, gm * {v}.{tl.XYZW[f]});" for f in range(4))
            return (f"let tq = {row}; if (tq < CC) {{ let t = tq; let dd = {u} - {v}; cf_sm[CF_DS + t * {sv}u + {colg}] = dd; "
                    f"{d} }} else {{ let t = tq - CC; let gm = exp(c_gam[t]); {o} }}")  # fmt: skip

        out["CF_X_EPI"] = stores(tx, "x", epi)
        out["CF_S_DECAY"] = ["let decay = exp(c_gam[CC - 1u]);"] + [
            f"s_{a}_{e}_{b} = decay * s_{a}_{e}_{b};" for a, e, b in ts.blocks()
        ]
        # S += K̃ᵀ Δ over the chunk: K̃'s rows staged as they are, Δ from its copy
        kt = stage("kt", "CF_SLAB", k4, k4, direct(k4, lambda k: f"exp(c_gam[CC - 1u] - c_gam[{k} + kk]) * " + vec4_of(
            lambda f: f"cf_ld(1u, b, t0 + {k} + kk, hk, 4u * g + {f}u)")))  # fmt: skip
        body = product(ts, "s", lambda kk, bufs: slab("cf_sm", bufs["kt"], k4, kk),
                       lambda kk, bufs: resident("cf_sm", "CF_DS", sv, kk))  # fmt: skip
        out["CF_S"] = self.loop("CF", [kt], C, body, nt)
        return out

    # -- chunk_output -------------------------------------------------------------------------------------

    def output(self) -> dict[str, list[str]]:
        C, nt, cdv = self.plan.chunk, self.plan.pthreads, self.cdv
        to = self.tt["o"]
        T1, v4 = C // 4 + 1, cdv // 4
        pa = stage("pa", "CO_PA", T1, C // 4, transposed(lambda k: vec4_of(
            lambda f: f"co_scr[blk + TP_P + (4u * g + {f}u) * CC + {k} + kk]")))  # fmt: skip
        db = stage("db", "CO_DB", v4, v4, direct(v4, lambda k: vec4_of(
            lambda f: f"co_ldd(b, t0 + {k} + kk, h, 4u * g + {f}u)")))  # fmt: skip
        body = product(to, "o", lambda kk, bufs: slab("co_sm", bufs["pa"], T1, kk),
                       lambda kk, bufs: slab("co_sm", bufs["db"], v4, kk))  # fmt: skip
        put = stores(to, "o", lambda row, colg, v: " ".join(
            f"co_add_o(b, t0 + {row}, h, 4u * {colg} + {f}u, {v}.{tl.XYZW[f]});" for f in range(4)))  # fmt: skip
        return {
            "CO_COORDS": [to.coords()],
            "CO_O": tl.decl(to, "o")
            + self.loop("CO", [pa, db], C, body, nt, lambda bk: f"k0 > {to.rows_range()[1]}")
            + put,
        }

    # -- chunk_backward_state -----------------------------------------------------------------------------

    def backward_state(self) -> dict[str, list[str]]:
        C, V, nt, cdk = self.plan.chunk, self.plan.bv, self.plan.threads, self.cdk
        td, ts = self.tt["d"], self.tt["s"]
        sv, T1, k4 = V // 4, C // 4 + 1, cdk // 4
        out = {"CB_COORDS": [td.coords(), ts.coords()]}
        mirror = stores(
            ts, "ds", lambda row, colg, v: f"cb_sm[CB_RB + (2u * CC + {row}) * {sv}u + {colg}] = {v};"
        )
        out["CB_S_INIT"] = tl.decl(ts, "ds") + mirror
        out["CB_S_MIRROR"] = mirror
        out["CB_S_STORE"] = stores(ts, "ds", lambda row, colg, v: " ".join(
            f"cb_store_ds(bh, c, {row}, j0 + 4u * {colg} + {f}u, {v}.{tl.XYZW[f]});" for f in range(4)))  # fmt: skip
        # dΔ = Pᵀ dO + K̃ dS: k over the chunk's tokens (P's rows as stored) then over Dk (K̃ transposed);
        # B = the rows [dO; dS] of the block's columns, contiguous in workgroup memory
        aa = stage("aa", "CB_SLAB", T1, C // 4,
                   direct(C // 4, lambda k: vec4_of(lambda f: f"cb_scr[blk + TP_P + ({k} + kk) * CC + 4u * g + {f}u]"),
                          when=lambda k: f"{k} < CC"),
                   transposed(lambda k: vec4_of(
                       lambda f: f"exp(c_gam[CC - 1u] - c_gam[4u * g + {f}u]) * cb_ld(1u, b, t0 + 4u * g + {f}u, hk, {k} - CC + kk)")))  # fmt: skip
        body = product(td, "d", lambda kk, bufs: slab("cb_sm", bufs["aa"], T1, kk),
                       lambda kk, bufs: lambda g: f"cb_sm[CB_RB + (CC + k0 + {kk}u) * {sv}u + {g}]")  # fmt: skip
        upper = lambda bk: f"k0 < CC && k0 + {bk - 1}u < {td.rows_range()[0]}"  # noqa: E731 (P[s, t] = 0 for s < t)
        out["CB_A"] = tl.decl(td, "d") + self.loop("CB", [aa], C + cdk, body, nt, upper)
        out["CB_A_EPI"] = stores(td, "d", lambda row, colg, v: f"cb_sm[CB_RB + {row} * {sv}u + {colg}] = {v}; " + " ".join(
            f"cb_store_dd(bl, t0 + {row}, h, j0 + 4u * {colg} + {f}u, {v}.{tl.XYZW[f]});" for f in range(4)))  # fmt: skip
        out["CB_S_DECAY"] = ["let decay = exp(c_gam[CC - 1u]);"] + [
            f"ds_{a}_{e}_{b} = decay * ds_{a}_{e}_{b};" for a, e, b in ts.blocks()
        ]
        # dS += [-W; ΓQ]ᵀ [dΔ; dO]: k over the chunk's tokens twice, the rows as stored
        ba = stage("ba", "CB_SLAB", k4, k4,
                   direct(k4, lambda k: "-" + vec4_of(lambda f: f"cb_scr[blk + ({k} + kk) * CDK + 4u * g + {f}u]"),
                          when=lambda k: f"{k} < CC"),
                   direct(k4, lambda k: f"exp(c_gam[{k} - CC + kk]) * " + vec4_of(
                       lambda f: f"cb_ld(0u, b, t0 + {k} - CC + kk, hk, 4u * g + {f}u)")))  # fmt: skip
        body = product(ts, "ds", lambda kk, bufs: slab("cb_sm", bufs["ba"], k4, kk),
                       lambda kk, bufs: resident("cb_sm", "CB_RB", sv, kk))  # fmt: skip
        out["CB_B"] = self.loop("CB", [ba], 2 * C, body, nt)
        return out

    # -- chunk_backward_grads -----------------------------------------------------------------------------

    def grads(self) -> dict[str, list[str]]:
        C, nt, cdk, cdv = self.plan.chunk, self.plan.pthreads, self.cdk, self.cdv
        tr, te, ty, tz = self.tt["r"], self.tt["e"], self.tt["y"], self.tt["z"]
        c4, k4, v4 = C // 4, cdk // 4, cdv // 4
        S = _cg_strides(C, cdk, cdv)
        out = {"CG_COORDS": [t.coords() for t in (tr, te, ty, tz)]}

        def two(
            name: str, a_src: Src, b_src: Src, a_groups: int, b_groups: int
        ) -> tuple[list[Stage], Callable]:
            sa, sb = S[name]
            st = [stage(name.lower() + "a", f"CG_{name}A", sa, a_groups, a_src),
                  stage(name.lower() + "b", f"CG_{name}B", sb, b_groups, b_src)]  # fmt: skip
            return (
                st,
                (lambda kk, bufs: slab("cg_sm", bufs[st[0].name], sa, kk)),
                (lambda kk, bufs: slab("cg_sm", bufs[st[1].name], sb, kk)),
            )

        # dR = Tmᵀ dΔ: Tm's rows and dΔ's rows as stored
        st, a, b = two("R", direct(c4, lambda k: vec4_of(lambda f: f"cg_scr[blk + TP_X + ({k} + kk) * CC + 4u * g + {f}u]")),
                       direct(v4, lambda k: vec4_of(lambda f: f"cg_lddd(bl, t0 + {k} + kk, h, 4u * g + {f}u)")), c4, v4)  # fmt: skip
        upper = lambda bk: f"k0 + {bk - 1}u < {tr.rows_range()[0]}"  # noqa: E731 (Tm[s, t] = 0 for s < t)
        out["CG_R"] = tl.decl(tr, "r") + self.loop("CG", st, C, product(tr, "r", a, b), nt, upper)
        # dR replaces dΔ (this workgroup alone reads those rows, all before the loop's last barrier); dv = β dR
        out["CG_R_EPI"] = stores(tr, "r", lambda row, colg, v: " ".join(
            f"cg_put_dr(bl, t0 + {row}, h, 4u * {colg} + {f}u, {v}.{tl.XYZW[f]}, {row});" for f in range(4)))  # fmt: skip
        out["CG_R_EPI"] += row_sums("cg", tr, "CG_RED_F", nt, lambda a_, e: dots(tr, "r", a_, e, lambda row, colg: vec4_of(
            lambda f: f"cg_ldv(b, t0 + {row}, h, 4u * {colg} + {f}u)")), "c_rs")  # fmt: skip
        out["CG_R_EPI"] += ["if (lid < CC) { c_dbet[lid] = c_rs[lid]; }"]

        # [dP; -dA] = [dO; dR] Δᵀ over Dv (both transposed)
        od = lambda k: vec4_of(lambda f: f"cg_ldodr(b, bl, t0, 4u * g + {f}u, h, {k} + kk)")  # noqa: E731
        st, a, b = two("E", transposed(od), transposed(lambda k: vec4_of(
            lambda f: f"cg_ldd(b, t0 + 4u * g + {f}u, h, {k} + kk)")), 2 * c4, c4)  # fmt: skip
        out["CG_E"] = tl.decl(te, "pe") + self.loop("CG", st, cdv, product(te, "pe", a, b), nt)

        def emask(row: str, colg: str, v: str) -> str:  # E = [dQK; dA ∘ M] into the scratch
            up = " ".join(f"{{ let s = 4u * {colg} + {f}u; cg_scr[eb + tq * CC + s] = select(0.0, c_decay(tq, s) * {v}.{tl.XYZW[f]}, s <= tq); }}"
                          for f in range(4))  # fmt: skip
            lo = " ".join(f"{{ let s = 4u * {colg} + {f}u; cg_scr[eb + tq * CC + s] = select(0.0, -c_decay(t, s) * {v}.{tl.XYZW[f]}, s < t); }}"
                          for f in range(4))  # fmt: skip
            return f"let tq = {row}; if (tq < CC) {{ {up} }} else {{ let t = tq - CC; {lo} }}"

        out["CG_E_EPI"] = stores(te, "pe", emask)

        # y = [dO; dR] S₀ᵀ over Dv (both transposed), scaled by Γ / -Γ, then + E K over the chunk
        st, a, b = two("Y1", transposed(od), transposed(lambda k: vec4_of(
            lambda f: f"cg_lds0(bh, c, 4u * g + {f}u, {k} + kk)")), 2 * c4, k4)  # fmt: skip
        y = tl.decl(ty, "y") + self.loop("CG", st, cdv, product(ty, "y", a, b), nt)
        y += [f"y_{a_}_{e}_{b_} = {'-' if a_ else ''}exp(c_gam[{ty.row(a_, e)} % CC]) * y_{a_}_{e}_{b_};"
              for a_, e, b_ in ty.blocks()]  # fmt: skip
        st, a, b = two("Y2", transposed(lambda k: vec4_of(lambda f: f"cg_scr[eb + (4u * g + {f}u) * CC + {k} + kk]")),
                       direct(k4, lambda k: vec4_of(lambda f: f"cg_ld(1u, b, t0 + {k} + kk, hk, 4u * g + {f}u)")), 2 * c4, k4)  # fmt: skip
        # E[t', s] = 0 for s > t (both halves' rows are t = 4 ty + e)
        y += self.loop("CG", st, C, product(ty, "y", a, b), nt, lambda bk: "k0 > 4u * ty_y + 3u")
        out["CG_Y"] = y
        # rows < C: dq; rows >= C: r = k · y (dβ += r, dγ += β r), then dk⁺ = β y stays in registers
        epi = stores(ty, "y", lambda row, colg, v: f"if ({row} < CC) {{ " + " ".join(
            f"cg_put_dq(b, t0 + {row}, h, 4u * {colg} + {f}u, {v}.{tl.XYZW[f]});" for f in range(4)) + " }")  # fmt: skip

        def qk(
            part: int,
        ) -> Callable[[str, str], str]:  # the vec4 of q (part 0) or k (1) at a tile's (row, colg)
            return lambda row, colg: vec4_of(
                lambda f: f"cg_ld({part}u, b, t0 + {row} % CC, hk, 4u * {colg} + {f}u)"
            )

        epi += row_sums("cg", ty, "CG_RED_F", nt, lambda a_, e: dots(ty, "y", a_, e, qk(a_)), "c_rs")
        epi += [
            "if (lid < CC) { let r = c_rs[CC + lid]; c_dgam[lid] = c_rs[lid] + c_bet[lid] * r; c_dbet[lid] += r; }"
        ]
        epi += [
            f"y_1_{e}_{b_} = c_bet[{ty.row(1, e)} - CC] * y_1_{e}_{b_};"
            for e in range(4)
            for b_ in range(ty.gn)
        ]
        out["CG_Y_EPI"] = epi

        # z = tail Δ dSᵀ over Dv (both transposed), then + E'ᵀ [Q; βK] over 2C
        st, a, b = two("Z1", transposed(lambda k: vec4_of(lambda f: f"cg_ldd(b, t0 + 4u * g + {f}u, h, {k} + kk)")),
                       transposed(lambda k: vec4_of(lambda f: f"cg_ldds(bh, c, 4u * g + {f}u, {k} + kk)")), c4, k4)  # fmt: skip
        z = tl.decl(tz, "z") + self.loop("CG", st, cdv, product(tz, "z", a, b), nt)
        z += [
            f"z_{a_}_{e}_{b_} = exp(c_gam[CC - 1u] - c_gam[{tz.row(a_, e)}]) * z_{a_}_{e}_{b_};"
            for a_, e, b_ in tz.blocks()
        ]
        st, a, b = two("Z2", direct(c4, lambda k: vec4_of(lambda f: f"cg_scr[eb + ({k} + kk) * CC + 4u * g + {f}u]")),
                       direct(k4, lambda k: vec4_of(lambda f: f"cg_ldqbk(b, t0, {k} + kk, hk, 4u * g + {f}u)")), c4, k4)  # fmt: skip
        # E[s', t] = 0 unless s' mod C >= t
        z += self.loop(
            "CG", st, 2 * C, product(tz, "z", a, b), nt, lambda bk: f"k0 % CC + {bk - 1}u < 4u * ty_z"
        )
        out["CG_Z"] = z
        # dk = dk⁺ + z; dγ -= k · z
        epi = tl.each(tz, lambda a_, e, b_, nm: f"if {tz.active()} {{ let kv = z_{nm} + y_1_{e}_{b_}; " + " ".join(
            f"cg_put_dk(b, t0 + {tz.row(a_, e)}, h, 4u * {tz.colg(b_)} + {f}u, kv.{tl.XYZW[f]});" for f in range(4)) + " }")  # fmt: skip
        epi += row_sums("cg", tz, "CG_RED_F", nt, lambda a_, e: dots(tz, "z", a_, e, qk(1)), "c_rs")
        epi += ["if (lid < CC) { c_dgam[lid] -= c_rs[lid]; }"]
        out["CG_Z_EPI"] = epi
        return out
