"""Launchers for `shaders/gated_delta.wgsl`: the gated delta rule of a Gated DeltaNet layer, forward and
backward (docs/model.md#gated-deltanet, docs/kernels.md#the-gated-delta-rule).

Kernel path: `shaders/gated_delta.wgsl` -> `ddl_wgpu/ops/gated_delta.py` -> reference
`ddl_ref.gdn.gated_delta_chunked_forward`, `gated_delta_chunked_backward` (the chunked kernels) and
`gated_delta_forward` (the per-token one) -> test `tests/test_kernel_gated_delta.py`.

The chunked form (`chunk_forward`, `chunk_backward`: what the engine trains and evaluates with) cuts a row's
tokens into chunks and does each chunk's work as small matrix products (docs/kernels.md#the-chunked-form):
`chunk_prep` (per chunk, independent of the state), `chunk_forward` and `chunk_backward_state` (per batch
row, value head and block of value columns, the chunks in order with the state's block in registers) and
`chunk_backward_grads` (per chunk again). Their tunables are a `ChunkPlan` (chunk length, value columns per
workgroup, threads, staging depth), the default the first of `PLANS` the adapter's limits allow, or
DDL_WGPU_GDN_PLAN; `bench/hybrid.py kernel --sweep` times them. Each product's per-thread code is generated
straight-line (`ddl_wgpu/wgsl_tiles.py`): a private array indexed at run time would live in slow memory on
NVIDIA (docs/kernels.md#generated-wgsl).

The per-token forward (`gated_delta_forward`: a decoder's pass of a few rows, `ddl_wgpu.decode`) walks the
tokens in order with the Dk x Dv state spread over TI x TJ threads of PI x PJ elements each (`tile`), and can
write the state before every tc-th token (with tc = 1 every row's: what a speculative verify rolls back to).

q, k and the gates travel in one read-only buffer (`qkgb`, three parts at aligned offsets) so each kernel
binds at most 8 storage buffers (WebGPU's default per stage).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace

from ddl_wgpu import wgsl_tiles as tl
from ddl_wgpu.gpu import Call, Gpu, GpuError, Uniform
from ddl_wgpu.ops import need_all as _need
from ddl_wgpu.ops import pow2_at_least, sub
from ddl_wgpu.ops.gdn_inputs import align_floats, planar_offsets, qk_floats

FILE = "gated_delta.wgsl"
PARAMS = Uniform(
    "Params",
    ("B", "u32", "batch rows"),
    ("T", "u32", "tokens per row"),
    ("Hk", "u32", "key heads"),
    ("Hv", "u32", "value heads (a multiple of Hk)"),
    ("Dk", "u32"),
    ("Dv", "u32"),
    ("k_off", "u32", "floats: k's start in qk"),
    ("v_off", "u32", "floats: v's first column in its buffer"),
    ("v_stride", "u32", "floats per token row of v's buffer"),
    ("tc", "u32", "tokens per chunk (chunked: C; per-token: between two saved states)"),
    ("nck", "u32", "chunks: ceil(T / tc)"),
    ("has_init", "u32", "forward: 1 starts from state_in, 0 from zeros"),
    ("save_ckpt", "u32", "forward: 1 writes the state before each chunk (chunked: and Δ)"),
    ("save_final", "u32", "forward: 1 writes the final state to slot nck"),
    ("gb_off", "u32", "floats: g, beta's start in qkgb"),
    ("dk_off", "u32", "chunked backward: floats, dk's start in dqk"),
    ("dr_off", "u32", "chunked backward: floats, dR's start in scr"),
    ("ds_off", "u32", "chunked backward: floats, the chunk-end state gradients' start in scr"),
    ("dg_off", "u32", "chunked backward: floats, [dg, dbeta]'s start in scr"),
    ("b0", "u32", "chunked: the call's first batch row"),
)
MAX_THREADS = 256  # the most threads a workgroup gets (WebGPU's default limit)
MAX_SIDE = 16  # threads along Dk or Dv


def tile(gpu: Gpu, Dk: int, Dv: int) -> tuple[int, int, int, int]:
    """(TI, TJ, PI, PJ) of the per-token forward: TI x TJ threads of PI x PJ state elements each, for the
    adapter's limits. Up to 16 x 16 threads; both sides halve (more elements per thread) while the workgroup
    memory (2·TI·DVP + DVP floats) or the thread count exceeds the limits. A function of the shape and the
    limits only, so the sums' order (and the bits) never change between runs."""
    limit = gpu.limits.get("max-compute-workgroup-storage-size", 16 << 10)
    threads = min(MAX_THREADS, gpu.limits.get("max-compute-invocations-per-workgroup", 256))
    ti, tj = min(MAX_SIDE, pow2_at_least(Dk)), min(MAX_SIDE, pow2_at_least(Dv))

    def shared(ti: int, tj: int) -> int:
        dvp = tj * -(-Dv // tj)
        return 4 * (2 * ti * dvp + dvp)

    while (shared(ti, tj) > limit or ti * tj > threads) and (ti > 1 or tj > 1):
        if ti >= tj:
            ti //= 2
        else:
            tj //= 2
    if shared(ti, tj) > limit:
        raise GpuError(f"gated delta rule: Dk={Dk}, Dv={Dv} need more workgroup memory than {limit} bytes")
    return ti, tj, -(-Dk // ti), -(-Dv // tj)


def _sum(terms: list[str]) -> str:
    return " + ".join(terms)


def _templates(ti: int, tj: int, pi: int, pj: int) -> dict[str, str]:
    """The per-token forward's straight-line per-thread code: state s_a_b for a < PI rows, b < PJ columns."""
    A, Bs = range(pi), range(pj)
    row = {a: f"ti + {a}u * TI" for a in A}
    col = {b: f"tj + {b}u * TJ" for b in Bs}
    pairs = [(a, b) for a in A for b in Bs]
    nl = "\n        "
    t = {"TI": str(ti), "TJ": str(tj), "DVP": str(tj * pj)}
    t["F_INIT"] = nl.join(f"var s_{a}_{b} = f_ldinit(bh, {row[a]}, {col[b]});" for a, b in pairs)
    t["F_STORE"] = (nl + "    ").join(f"f_store(slot, {row[a]}, {col[b]}, s_{a}_{b});" for a, b in pairs)
    t["F_LOAD_K"] = nl.join(
        f"let k{a} = f_ldk(n, hk, {row[a]});{nl}let q{a} = f_ldq(n, hk, {row[a]});" for a in A
    )
    t["F_PARTIAL_U"] = nl.join(
        f"red_c[ti * DVP + {col[b]}] = {_sum([f's_{a}_{b} * k{a}' for a in A])};" for b in Bs
    )
    upd = [f"let r{b} = f_ldv(n, h, {col[b]}) - at * vec_c[{col[b]}];{nl}let e{b} = bt * r{b};" for b in Bs]
    upd += [
        f"if (ti == 0u && {col[b]} < f_p.Dv) {{ f_r[(n * f_p.Hv + h) * f_p.Dv + {col[b]}] = r{b}; }}"
        for b in Bs
    ]
    upd += [f"s_{a}_{b} = at * s_{a}_{b} + k{a} * e{b};" for a, b in pairs]
    t["F_UPDATE"] = nl.join(upd)
    t["F_PARTIAL_O"] = nl.join(
        f"red_o[ti * DVP + {col[b]}] = {_sum([f's_{a}_{b} * q{a}' for a in A])};" for b in Bs
    )
    return t


def n_chunks(T: int, tc: int) -> int:
    return -(-int(T) // int(tc))


def qkgb_offsets(rows: int, Hk: int, Dk: int) -> tuple[int, int]:
    """Float offsets of k and of [g, beta] in the `qkgb` buffer (q at 0), each 256-byte aligned so the L2 norm
    and the gates write their parts through views of their own: the planar conv output's k and v offsets."""
    return planar_offsets(rows, Hk, Dk)


def qkgb_floats(rows: int, Hk: int, Hv: int, Dk: int) -> int:
    """Floats of `qkgb`: q, k (rows, Hk, Dk) and [g, beta] (rows, Hv, 2)."""
    return qkgb_offsets(rows, Hk, Dk)[1] + 2 * int(rows) * int(Hv)


def states_floats(B: int, Hv: int, Dk: int, Dv: int, T: int, tc: int) -> int:
    """Floats of the `states` buffer: nck + 1 slots per (batch row, value head)."""
    return int(B) * int(Hv) * (n_chunks(T, tc) + 1) * int(Dk) * int(Dv)


def _kernel(gpu: Gpu, entry: str, sig: str, Dk: int, Dv: int, plan: ChunkPlan | None = None):
    """An entry point of the family's one module, whose per-token and chunked parts are both generated: the
    part it belongs to for the shape and the adapter (the chunked kernels for `plan`, default `chunk_plan`),
    the other at its smallest (a module compiles every entry point's code)."""
    if entry.startswith("chunk"):  # the per-token part filled at its smallest: compiled, never run
        plan = chunk_plan(gpu, Dk, Dv, plan)
        threads = plan.pthreads if entry in ("chunk_prep", "chunk_backward_grads") else plan.threads
        templates = _templates(1, 1, 1, 1) | plan.templates(Dk, Dv)
    else:
        ti, tj, pi, pj = tile(gpu, Dk, Dv)
        templates, threads = _templates(ti, tj, pi, pj) | _IDLE_PLAN.templates(1, 1), ti * tj
    return gpu.kernel(FILE, entry, sig, templates=templates, workgroup=(threads, 1, 1), uniforms=(PARAMS,))


def _check_sizes(entry: str, B: int, T: int, Hk: int, Hv: int, tc: int) -> None:
    if Hk <= 0 or Hv % Hk:
        raise ValueError(f"{entry}: value heads {Hv} must be a multiple of key heads {Hk}")
    if tc < 1:
        raise ValueError(f"{entry}: chunk length {tc} must be positive")


def _uniform(gpu, label, B, T, Hk, Hv, Dk, Dv, tc, v_off, v_stride, k_off_rows=None, **flags):
    # qkgb's parts are laid out for all its rows (k_off_rows, default B*T) even when a call runs fewer
    k_off, gb_off = qkgb_offsets(B * T if k_off_rows is None else k_off_rows, Hk, Dk)
    values = dict(has_init=0, save_ckpt=0, save_final=0, dk_off=0, dr_off=0, ds_off=0, dg_off=0, b0=0) | flags
    return gpu.uniform(PARAMS, B=B, T=T, Hk=Hk, Hv=Hv, Dk=Dk, Dv=Dv, k_off=k_off, v_off=v_off, v_stride=v_stride,
                       tc=tc, nck=n_chunks(T, tc), gb_off=gb_off, label=label, **values)  # fmt: skip


def gated_delta_forward(
    gpu: Gpu, o, r, states, qkgb, v, B: int, T: int, Hk: int, Hv: int, Dk: int, Dv: int, *,
    tc: int, v_off: int = 0, v_stride: int | None = None, state_in=None, save_ckpt: bool = True,
    save_final: bool = False,
) -> Call:  # fmt: skip
    """The per-token forward: o, r = v − u (B*T, Hv, Dv) and `states` (`states_floats`: the state before every
    tc-th token with `save_ckpt`, the final state with `save_final`; unused otherwise) from `qkgb`
    (`qkgb_offsets`: q (B*T, Hk, Dk) normalised and scaled, k (B*T, Hk, Dk) normalised, [g, beta] (B*T, Hv,
    2)) and v (`v_off` + n*`v_stride` + h*Dv + j; default planar), starting from `state_in` (B, Hv, Dk, Dv)
    when given, else zeros."""
    B, T, Hk, Hv, Dk, Dv, tc = (int(x) for x in (B, T, Hk, Hv, Dk, Dv, tc))
    _check_sizes("gated_delta_forward", B, T, Hk, Hv, tc)
    N = B * T
    v_stride = Hv * Dv if v_stride is None else int(v_stride)
    _need("gated_delta_forward", o=(o, N * Hv * Dv), r=(r, N * Hv * Dv), qkgb=(qkgb, qkgb_floats(N, Hk, Hv, Dk)),
          v=(v, v_off + (N - 1) * v_stride + Hv * Dv))  # fmt: skip
    if save_ckpt or save_final:
        _need("gated_delta_forward", states=(states, states_floats(B, Hv, Dk, Dv, T, tc)))
    if state_in is not None:
        _need("gated_delta_forward", state_in=(state_in, B * Hv * Dk * Dv))
    p = _uniform(gpu, "gated_delta_forward", B, T, Hk, Hv, Dk, Dv, tc, v_off, v_stride,
                 has_init=int(state_in is not None), save_ckpt=int(save_ckpt), save_final=int(save_final))  # fmt: skip
    k = _kernel(gpu, "gated_delta_forward", "rrrwwwu", Dk, Dv)
    init = state_in if state_in is not None else v  # any buffer: not read when has_init is 0
    return Call([(k, gpu.bind(k, qkgb, v, init, o, r, states, p), B * Hv)], [p])


# ---------------------------------------------------------------------------------------------------------
# the chunked form: chunk_prep, chunk_forward, chunk_backward_state, chunk_backward_grads

ENV_PLAN = "DDL_WGPU_GDN_PLAN"  # e.g. "chunk=64,bv=32,threads=256,br=8": the chunked kernels' plan


@dataclass(frozen=True)
class ChunkPlan:
    """The tunables of the chunked kernels, all powers of two. `chunk`: tokens per chunk (C); `bv`: value
    columns of the state per workgroup of the two sequential kernels (their grid is batch rows x value heads x
    Dv/bv); `threads` per workgroup of those, `pthreads` of the two per-chunk kernels (chunk_prep,
    chunk_backward_grads); `br`: rows of an operand staged into workgroup memory per step (the steps of a
    product between two barriers); `unroll`: the br steps as straight-line code; `tb`: the prep's blocks of
    Tm (the diagonal ones solved a column per thread, tb steps long); `pf`: the sequential kernels load the
    next step's staged rows into registers during this step's products (prefetch). A plan fits an adapter
    when every kernel's workgroup memory and thread count do (`check`). Only chunk, tb and pthreads change
    the rounding; the others change which thread adds what, not the order of any sum."""

    chunk: int = 64
    bv: int = 32
    threads: int = 256
    br: int = 8
    unroll: bool = True
    tb: int = 16
    pf: bool = True
    pthreads: int = 256

    def dims(self, Dk: int, Dv: int) -> tuple[int, int]:
        """Dk, Dv padded to powers of two (and to at least bv and br)."""
        return max(pow2_at_least(Dk), self.br), max(pow2_at_least(Dv), self.bv, self.br)

    def tiles(self, Dk: int, Dv: int) -> dict[str, tl.Tile]:
        cdk, cdv = self.dims(Dk, Dv)
        C, n, m = self.chunk, self.threads, self.pthreads
        return {"p": tl.tile("p", C, C, m), "x": tl.tile("x", C, self.bv, n), "s": tl.tile("s", cdk, self.bv, n),
                "e": tl.tile("e", C, C, m), "q": tl.tile("q", C, cdk, m)}  # fmt: skip

    def layout(self, Dk: int, Dv: int) -> dict[str, int]:
        """Offsets (floats) of each kernel's parts of its workgroup memory, and its size (*_SM)."""
        cdk, _ = self.dims(Dk, Dv)
        C, R, V = self.chunk, self.br, self.bv
        t = self.tiles(Dk, Dv)
        sq = C * (C + 1)  # a C x C matrix with rows padded to an odd stride
        tb = min(C, self.tb)
        L = {"CP_STG": 0, "CP_T": 0, "CP_A": max(sq, R * (2 * C + 1))}
        L["CP_X"] = L["CP_A"] + sq  # the block solve's sums: up to (C - TB) x TB
        L["CP_SM"] = L["CP_X"] + max(1, (C - tb) * tb)
        L |= {"CF_S": 0, "CF_R": cdk * V, "CF_STG": cdk * V + C * V}
        L["CF_SM"] = L["CF_STG"] + max(R * (2 * C + 1), R * (C + 1), R * cdk)
        L |= {"CB_S": 0, "CB_DO": cdk * V, "CB_DD": cdk * V + C * V, "CB_STG": cdk * V + 2 * C * V}
        L["CB_SM"] = L["CB_STG"] + max(R * (C + 1), 2 * R * cdk)
        # grads: region 1 = P, MKK (then the Z/Y/dK̃ staging); region 2 = the other staging, or reductions
        red = max(C * t["e"].wx, C * t["e"].wy, C * t["q"].wx, self.pthreads)  # one partial sum at a time
        r1 = max(2 * sq, R * (2 * C + 1) + R * (cdk + 1))
        L |= {"CG_P": 0, "CG_A": sq, "CG_ZA": 0, "CG_ZB": R * (2 * C + 1), "CG_STG": r1, "CG_RED": r1,
              "CG_STG2": r1 + R * (2 * C + 1)}  # fmt: skip
        L["CG_SM"] = r1 + max(R * (2 * C + 1) + R * (C + 1), 2 * R * cdk, red)
        return L

    def shared_bytes(self, Dk: int, Dv: int) -> dict[str, int]:
        """Workgroup memory of each kernel, bytes (its array plus the per-token gate arrays)."""
        L, C = self.layout(Dk, Dv), self.chunk
        extra = {"CP": 3 * C, "CF": 3 * C, "CB": 3 * C, "CG": 5 * C + 1}
        return {k: 4 * (L[k + "_SM"] + extra[k]) for k in ("CP", "CF", "CB", "CG")}

    def check(self, gpu: Gpu, Dk: int, Dv: int) -> None:
        """Raise GpuError (one line) when this plan cannot run on the adapter."""
        for name in ("chunk", "bv", "threads", "br", "tb", "pthreads"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise GpuError(f"gated delta plan {self}: {name} must be a power of two")
        cdk, cdv = self.dims(Dk, Dv)
        if (
            self.chunk < 2
            or self.br > self.chunk
            or self.bv > cdv
            or min(self.threads, self.pthreads) < self.chunk
        ):
            raise GpuError(f"gated delta plan {self}: needs 2 <= chunk, br <= chunk <= threads and pthreads, "
                           "bv <= Dv padded")  # fmt: skip
        most = max(self.threads, self.pthreads)
        if most > gpu.limits.get("max-compute-invocations-per-workgroup", 256):
            raise GpuError(f"gated delta plan {self}: {most} threads exceed the adapter's limit")
        limit = gpu.limits.get("max-compute-workgroup-storage-size", 16 << 10)
        need = max(self.shared_bytes(Dk, Dv).values())
        if need > limit:
            raise GpuError(
                f"gated delta plan {self}: {need} bytes of workgroup memory exceed the limit {limit}"
            )

    def templates(self, Dk: int, Dv: int) -> dict[str, str]:
        return _chunk_templates(self, Dk, Dv)


# In order of preference; the first that fits the adapter is the default (`chunk_plan`). The first is the
# H200's (48 KiB, 1024 threads); the later ones fit WebGPU's default limits (16 KiB, 256 threads).
PLANS = (
    ChunkPlan(64, 32, 256, 8),
    ChunkPlan(32, 32, 256, 8),
    ChunkPlan(32, 16, 128, 8),
    ChunkPlan(32, 8, 128, 4),
    ChunkPlan(16, 8, 64, 4),
    ChunkPlan(16, 4, 64, 2),
)


# The chunked part of a module compiled for a per-token entry point: the smallest code, never run.
_IDLE_PLAN = ChunkPlan(chunk=2, bv=1, threads=2, br=1, unroll=False, pthreads=2)


def parse_plan(text: str) -> ChunkPlan:
    """A plan from "chunk=64,bv=32,threads=256,br=8,unroll=1" (any subset; the rest the dataclass's)."""
    plan = ChunkPlan()
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, _, value = item.partition("=")
        if key not in ChunkPlan.__dataclass_fields__ or not value.strip().isdigit():
            raise GpuError(f"gated delta plan {text!r}: expected name=integer with names chunk, bv, threads, br, "
                           "unroll, tb, pf, pthreads")  # fmt: skip
        plan = replace(plan, **{key: bool(int(value)) if key in ("unroll", "pf") else int(value)})
    return plan


def chunk_plan(gpu: Gpu, Dk: int, Dv: int, plan: ChunkPlan | None = None) -> ChunkPlan:
    """The chunked kernels' plan: `plan`, else env DDL_WGPU_GDN_PLAN, else the first of PLANS that fits;
    checked against the adapter (a function of the shape and the limits only, so the bits never change
    between runs on one adapter)."""
    if plan is None and os.environ.get(ENV_PLAN):
        plan = parse_plan(os.environ[ENV_PLAN])
    if plan is not None:
        plan.check(gpu, Dk, Dv)
        return plan
    for p in PLANS:
        p = replace(p, bv=min(p.bv, pow2_at_least(Dv)))
        try:
            p.check(gpu, Dk, Dv)
            return p
        except GpuError:
            continue
    raise GpuError(f"gated delta rule: no chunk plan fits Dk={Dk}, Dv={Dv} in this adapter's limits")


def _steps(plan: ChunkPlan, t: tl.Tile, terms, a_ops, b_ops, ind: int = 8) -> str:
    """The br steps of a staged product: a_ops/b_ops map a key to fn(row or col, r) -> WGSL."""
    if plan.unroll:
        lines = []
        for r in range(plan.br):
            a = {k: (lambda x, f=f, r=r: f(x, f"{r}u")) for k, f in a_ops.items()}
            b = {k: (lambda x, f=f, r=r: f(x, f"{r}u")) for k, f in b_ops.items()}
            lines += tl.fma(t, terms, a, b)
        return tl.indent(lines, ind)
    a = {k: (lambda x, f=f: f(x, "r")) for k, f in a_ops.items()}
    b = {k: (lambda x, f=f: f(x, "r")) for k, f in b_ops.items()}
    body = ["for (var r = 0u; r < BR; r++) {", *("    " + x for x in tl.fma(t, terms, a, b)), "}"]
    return tl.indent(body, ind)


def _staged(arr: str, base: str, stride: int | str, k0: str = "") -> Callable[[str, str], str]:
    """An operand of a staged product: element (k0 + r, x) of rows of `stride` floats at arr[base]."""
    k = f"({k0} + {{r}})" if k0 else "{r}"
    return lambda x, r: f"{arr}[{base} + {k.format(r=r)} * {stride}u + {x}]"


def _chunk_templates(plan: ChunkPlan, Dk: int, Dv: int) -> dict[str, str]:
    """The `{{name}}` values of the chunked kernels: sizes, workgroup-memory offsets and the straight-line
    per-thread code of every product (ddl_wgpu/wgsl_tiles.py). Products over a staged operand read its rows
    r of the step; the output element (row, col) is `row`/`col` of the product's tile."""
    cdk, cdv = plan.dims(Dk, Dv)
    C, R, V = plan.chunk, plan.br, plan.bv
    tiles, L = plan.tiles(Dk, Dv), plan.layout(Dk, Dv)
    p, x, st, e, q = (tiles[k] for k in "pxseq")
    C1, C2 = C + 1, 2 * C + 1
    ind, each = tl.indent, tl.each
    out = {
        "TB": str(min(C, plan.tb)),
        "CC": str(C),
        "CDK": str(cdk),
        "CDV": str(cdv),
        "BV": str(V),
        "CNT": str(plan.threads),
        "CNTP": str(plan.pthreads),
        "BR": str(R),
    }
    out |= {k: str(L[k]) for k in ("CP_SM", "CF_SM", "CB_SM", "CG_SM")}
    out["CHUNK_CONSTS"] = "\n".join(f"const {k}: u32 = {v}u;" for k, v in L.items() if not k.endswith("_SM"))

    def steps(t, terms, a_ops, b_ops, ind_=12):
        return _steps(plan, t, terms, a_ops, b_ops, ind_)

    def state_copy(sm: str, base: str, acc: str) -> list[str]:  # registers -> the workgroup copy
        return each(
            st,
            lambda a, b, row, col: (
                f"if {st.active()} {{ {sm}[{base} + {row} * {V}u + {col}] = {acc}_{a}_{b}; }}"
            ),
        )

    def decay(acc: str) -> str:  # the state times Γ_L
        return ind(
            ["let decay = exp(c_gam[CC - 1u]);"]
            + each(st, lambda a, b, r, c: f"{acc}_{a}_{b} = decay * {acc}_{a}_{b};"),
            8,
        )

    # -- chunk_prep: [k; q] rows staged transposed, K Kᵀ and Q Kᵀ
    out["CP_COORDS"] = p.coords()
    out["CP_DECL"] = ind(tl.decl(p, "kk") + tl.decl(p, "qk"), 4)
    out["CP_FMA"] = steps(
        p,
        [("kk", "k", "k"), ("qk", "q", "k")],
        {"k": _staged("cp_sm", "CP_STG", C2), "q": _staged("cp_sm", f"CP_STG + {C}u", C2)},
        {"k": _staged("cp_sm", "CP_STG", C2)},
        8,
    )

    def mats(a, b, row, col):
        return (
            f"{{ let t = {row}; let s = {col}; let m = c_decay(t, s); if {p.active()} {{ "
            f"cp_sm[CP_A + t * {C1}u + s] = select(0.0, c_bet[t] * m * kk_{a}_{b}, s < t); "
            f"cp_tp[base + CC2 + t * CC + s] = m * qk_{a}_{b}; "
            f"cp_tp[base + 2u * CC2 + t * CC + s] = select(0.0, m * kk_{a}_{b}, s < t); }} }}"
        )

    out["CP_MATS"] = ind(each(p, mats), 4)

    # -- chunk_forward
    out["CF_COORDS"] = x.coords() + "\n    " + st.coords()
    init = each(st, lambda a, b, row, col: f"var s_{a}_{b} = cf_ldinit(bh, {row}, j0 + {col});")
    out["CF_S_INIT"] = ind(init + state_copy("cf_sm", "CF_S", "s"), 4)
    out["CF_S_STORE"] = ind(
        each(
            st,
            lambda a, b, row, col: (
                f"if {st.active()} {{ cf_store_state(slots + c, {row}, j0 + {col}, s_{a}_{b}); }}"
            ),
        ),
        12,
    )
    out["CF_X_DECL"] = ind(tl.decl(x, "xk") + tl.decl(x, "xq"), 8)
    out["CF_X_FMA"] = steps(
        x,
        [("xk", "k", "s"), ("xq", "q", "s")],
        {"k": _staged("cf_sm", "CF_STG", C2), "q": _staged("cf_sm", f"CF_STG + {C}u", C2)},
        {"s": _staged("cf_sm", "CF_S", V, "i0")},
    )
    out["CF_R"] = ind(
        each(
            x,
            lambda a, b, row, col: (
                f"if {x.active()} {{ cf_sm[CF_R + {row} * {V}u + {col}] = c_bet[{row}] * (cf_ldv(b, t0 + {row}, h, j0 + {col}) "
                f"- exp(c_gam[{row}]) * xk_{a}_{b}); }}"
            ),
        ),
        8,
    )
    out["CF_D_DECL"] = ind(tl.decl(x, "d"), 8)
    out["CF_D_FMA"] = steps(
        x, [("d", "t", "r")], {"t": _staged("cf_sm", "CF_STG", C1)}, {"r": _staged("cf_sm", "CF_R", V, "s0")}
    )
    out["CF_D_STORE"] = ind(
        each(
            x,
            lambda a, b, row, col: (
                f"if {x.active()} {{ cf_sm[CF_R + {row} * {V}u + {col}] = d_{a}_{b}; "
                f"if (cf_p.save_ckpt != 0u && t0 + {row} < cf_p.T && j0 + {col} < cf_p.Dv) {{ "
                f"cf_d[((b * cf_p.T + t0 + {row}) * cf_p.Hv + h) * cf_p.Dv + j0 + {col}] = d_{a}_{b}; }} }}"
            ),
        ),
        8,
    )
    out["CF_O_INIT"] = ind(each(x, lambda a, b, row, col: f"xq_{a}_{b} = exp(c_gam[{row}]) * xq_{a}_{b};"), 8)
    out["CF_O_FMA"] = steps(
        x, [("xq", "t", "r")], {"t": _staged("cf_sm", "CF_STG", C1)}, {"r": _staged("cf_sm", "CF_R", V, "s0")}
    )
    out["CF_O_STORE"] = ind(
        each(
            x,
            lambda a, b, row, col: (
                f"if ({x.active()} && t0 + {row} < cf_p.T && j0 + {col} < cf_p.Dv) {{ "
                f"cf_o[((b * cf_p.T + t0 + {row}) * cf_p.Hv + h) * cf_p.Dv + j0 + {col}] = xq_{a}_{b}; }}"
            ),
        ),
        8,
    )
    out["CF_S_DECAY"] = decay("s")
    out["CF_S_FMA"] = steps(
        st,
        [("s", "k", "d")],
        {"k": _staged("cf_sm", "CF_STG", cdk)},
        {"d": _staged("cf_sm", "CF_R", V, "u0")},
    )
    out["CF_S_MIRROR"] = ind(state_copy("cf_sm", "CF_S", "s"), 8)

    # -- chunk_backward_state
    out["CB_COORDS"] = out["CF_COORDS"]
    out["CB_S_INIT"] = ind(tl.decl(st, "ds") + state_copy("cb_sm", "CB_S", "ds"), 4)
    out["CB_S_STORE"] = ind(
        each(
            st,
            lambda a, b, row, col: (
                f"if ({st.active()} && {row} < cb_p.Dk && j0 + {col} < cb_p.Dv) {{ "
                f"cb_scr[cb_p.ds_off + ((bh * cb_p.nck + c) * cb_p.Dk + {row}) * cb_p.Dv + j0 + {col}] = ds_{a}_{b}; }}"
            ),
        ),
        8,
    )
    out["CB_DD_DECL"] = ind(tl.decl(x, "dd"), 8)
    stg = _staged("cb_sm", "CB_STG", C1)
    out["CB_DD_FMA1"] = steps(x, [("dd", "p", "o")], {"p": stg}, {"o": _staged("cb_sm", "CB_DO", V, "s0")})
    out["CB_DD_FMA2"] = steps(x, [("dd", "k", "s")], {"k": stg}, {"s": _staged("cb_sm", "CB_S", V, "i0")})
    out["CB_DD_STORE"] = ind(
        each(
            x,
            lambda a, b, row, col: f"if {x.active()} {{ cb_sm[CB_DD + {row} * {V}u + {col}] = dd_{a}_{b}; }}",
        ),
        8,
    )
    out["CB_R_DECL"] = ind(tl.decl(x, "dr"), 8)
    out["CB_R_FMA"] = steps(x, [("dr", "m", "d")], {"m": stg}, {"d": _staged("cb_sm", "CB_DD", V, "s0")})
    out["CB_R_STORE"] = ind(
        each(
            x,
            lambda a, b, row, col: (
                f"if {x.active()} {{ if (t0 + {row} < cb_p.T && j0 + {col} < cb_p.Dv) {{ "
                f"cb_scr[cb_p.dr_off + ((bl * cb_p.T + t0 + {row}) * cb_p.Hv + h) * cb_p.Dv + j0 + {col}] = dr_{a}_{b}; }} "
                f"cb_sm[CB_DD + {row} * {V}u + {col}] = -c_bet[{row}] * exp(c_gam[{row}]) * dr_{a}_{b}; }}"
            ),
        ),
        8,
    )
    out["CB_S_DECAY"] = decay("ds")
    out["CB_S_FMA"] = steps(
        st,
        [("ds", "k", "d"), ("ds", "q", "o")],
        {"k": _staged("cb_sm", "CB_STG", cdk), "q": _staged("cb_sm", f"CB_STG + {R * cdk}u", cdk)},
        {"d": _staged("cb_sm", "CB_DD", V, "u0"), "o": _staged("cb_sm", "CB_DO", V, "u0")},
    )
    out["CB_S_MIRROR"] = ind(state_copy("cb_sm", "CB_S", "ds"), 8)

    out |= _staging(plan, cdk)

    # -- chunk_backward_grads
    out["CG_COORDS"] = e.coords() + "\n    " + q.coords()
    out |= _grads_templates(plan, e, q, cdk)
    return out


@dataclass(frozen=True)
class _Stage:
    """One operand staged per step of a sequential kernel's product: `n` elements, element e at `dst` (an
    index into the kernel's workgroup array, from the names `split` defines) holding `src` (a function of
    the step's first row k0)."""

    sm: str
    n: int
    split: str
    dst: str
    src: Callable[[str], str]


def _staging(plan: ChunkPlan, cdk: int) -> dict[str, str]:
    """The staging of the sequential kernels' products: per loop XX, {{XX_STAGE}} fills the workgroup copy
    of this step's rows (between the loop's two barriers); with `plan.pf` the rows come from registers
    loaded one step ahead ({{XX_PF}} before the loop, {{XX_NEXT}} after its second barrier)."""
    C, R = plan.chunk, plan.br
    by_t = "let t = e / BR; let r = e - t * BR;"  # transposed: e over (token t, staged row r)
    by_r = "let r = e / CC; let t = e - r * CC;"  # as stored: e over (staged row r, token t)
    by_i = "let r = e / CDK; let i = e - r * CDK;"  # rows of Dk: e over (staged row r, column i)
    loops = {
        "CF_X": ("i0", "CDK", [_Stage("cf_sm", 2 * C * R, "let m = e / BR; let r = e - m * BR;",
                                      "CF_STG + r * (2u * CC + 1u) + m",
                                      lambda k: f"cf_ld(select(0u, 1u, m < CC), b, t0 + m % CC, hk, {k} + r)")]),
        "CF_D": ("s0", "CC", [_Stage("cf_sm", C * R, by_t, "CF_STG + r * (CC + 1u) + t",
                                     lambda k: f"cf_tp[tbase + t * CC + {k} + r]")]),
        "CF_O": ("s0", "CC", [_Stage("cf_sm", C * R, by_t, "CF_STG + r * (CC + 1u) + t",
                                     lambda k: f"cf_tp[tbase + CC2 + t * CC + {k} + r]")]),
        "CF_S": ("u0", "CC", [_Stage("cf_sm", R * cdk, by_i, "CF_STG + e",
                                     lambda k: f"exp(c_gam[CC - 1u] - c_gam[{k} + r]) * cf_ld(1u, b, t0 + {k} + r, hk, i)")]),
        "CB_DD1": ("s0", "CC", [_Stage("cb_sm", R * C, by_r, "CB_STG + r * (CC + 1u) + t",
                                       lambda k: f"cb_scr[tbase + CC2 + ({k} + r) * CC + t]")]),
        "CB_DD2": ("i0", "CDK", [_Stage("cb_sm", C * R, by_t, "CB_STG + r * (CC + 1u) + t",
                                        lambda k: f"exp(c_gam[CC - 1u] - c_gam[t]) * cb_ld(1u, b, t0 + t, hk, {k} + r)")]),
        "CB_R": ("s0", "CC", [_Stage("cb_sm", R * C, by_r, "CB_STG + r * (CC + 1u) + t",
                                     lambda k: f"cb_scr[tbase + ({k} + r) * CC + t]")]),
        "CB_S": ("u0", "CC", [_Stage("cb_sm", R * cdk, by_i, "CB_STG + e", lambda k: f"cb_ld(1u, b, t0 + {k} + r, hk, i)"),
                              _Stage("cb_sm", R * cdk, by_i, f"CB_STG + {R * cdk}u + e",
                                     lambda k: f"cb_ld(0u, b, t0 + {k} + r, hk, i)")]),
    }  # fmt: skip
    out = {}
    n_threads = plan.threads
    for name, (k0, end, stages) in loops.items():
        if not plan.pf:
            out[name + "_PF"] = out[name + "_NEXT"] = ""
            out[name + "_STAGE"] = tl.indent([
                f"for (var e = lid; e < {st.n}u; e += CNT) {{ {st.split} {st.sm}[{st.dst}] = {st.src(k0)}; }}"
                for st in stages], 12)  # fmt: skip
            continue
        init, store, nxt = [], [], []
        for si, st in enumerate(stages):
            for j in range(-(-st.n // n_threads)):
                reg = f"pf_{name.lower()}_{si}_{j}"
                at = f"let e = lid + {j * n_threads}u; if (e < {st.n}u) {{ {st.split}"
                init += [f"var {reg} = 0.0;", f"{{ {at} {reg} = {st.src('0u')}; }} }}"]
                store.append(f"{{ {at} {st.sm}[{st.dst}] = {reg}; }} }}")
                nxt.append(f"{{ {at} {reg} = {st.src(f'({k0} + BR)')}; }} }}")
        out[name + "_PF"] = tl.indent(init, 8)
        out[name + "_STAGE"] = tl.indent(store, 12)
        out[name + "_NEXT"] = tl.indent([f"if ({k0} + BR < {end}) {{", *("    " + x for x in nxt), "}"], 12)
    return out


def _row_sums(t: tl.Tile, parts: list[str], target: str, op: str) -> list[str]:
    """Reduce the per-thread row partials `parts` (one variable per row a of the tile) through CG_RED into
    `target[t] op= Σ` for every row t (a fixed order), barriers around."""
    lines = [
        f"if {t.active()} {{ cg_sm[CG_RED + {t.row(a)} * {t.wx}u + tx_{t.name}] = {v}; }}"
        for a, v in enumerate(parts)
    ]
    lines += [
        "workgroupBarrier();",
        "if (lid < CC) {",
        "    var acc = 0.0;",
        f"    for (var x = 0u; x < {t.wx}u; x++) {{ acc += cg_sm[CG_RED + lid * {t.wx}u + x]; }}",
        f"    {target}[lid] {op} acc;",
        "}",
        "workgroupBarrier();",
    ]
    return lines


def _grads_templates(plan: ChunkPlan, e: tl.Tile, q: tl.Tile, cdk: int) -> dict[str, str]:
    """The generated parts of chunk_backward_grads: tile e over the chunk's C x C, tile q over its C x Dk."""
    C, R = plan.chunk, plan.br
    C1, C2 = C + 1, 2 * C + 1
    ind, each = tl.indent, tl.each
    out = {"CG_E_DECL": ind(tl.decl(e, "dp") + tl.decl(e, "da"), 4)}
    out["CG_E_FMA"] = _steps(
        plan,
        e,
        [("dp", "o", "d"), ("da", "r", "d")],
        {"o": _staged("cg_sm", "CG_STG", C2), "r": _staged("cg_sm", f"CG_STG + {C}u", C2)},
        {"d": _staged("cg_sm", "CG_STG2", C1)},
    )

    def elem(a, b, row, col):  # dQK, dKK in place of P, MKK; E = dP∘P + dA∘A by rows and columns
        return (
            f"{{ let t = {row}; let s = {col}; let m = c_decay(t, s); "
            f"let p = cg_sm[CG_P + t * {C1}u + s]; let mkk = cg_sm[CG_A + t * {C1}u + s]; "
            f"let da = select(0.0, -da_{a}_{b}, s < t); let ee = dp_{a}_{b} * p + da * c_bet[t] * mkk; "
            f"er{a} += ee; ec{b} += ee; eb{a} += da * mkk; "
            f"if {e.active()} {{ cg_sm[CG_P + t * {C1}u + s] = dp_{a}_{b} * m; "
            f"cg_sm[CG_A + t * {C1}u + s] = da * c_bet[t] * m; }} }}"
        )

    lines = [f"var er{a} = 0.0;\n    var eb{a} = 0.0;" for a in range(e.tm)]
    lines += [f"var ec{b} = 0.0;" for b in range(e.tn)] + each(e, elem)
    # dγ = row sums - column sums of E (the columns first), dbeta = row sums of dA ∘ MKK
    lines += [
        f"if {e.active()} {{ cg_sm[CG_RED + {e.col(b)} * {e.wy}u + ty_e] = ec{b}; }}" for b in range(e.tn)
    ]
    lines += [
        "workgroupBarrier();",
        "if (lid < CC) {",
        "    var acc = 0.0;",
        f"    for (var y = 0u; y < {e.wy}u; y++) {{ acc += cg_sm[CG_RED + lid * {e.wy}u + y]; }}",
        "    cg_dgam[lid] = -acc;",
        "}",
        "workgroupBarrier();",
    ]
    lines += _row_sums(e, [f"er{a}" for a in range(e.tm)], "cg_dgam", "+=")
    lines += ["if (lid < CC) { cg_dbet[lid] = 0.0; }"]
    lines += _row_sums(e, [f"eb{a}" for a in range(e.tm)], "cg_dbet", "+=")
    out["CG_E_ELEM"] = ind(lines, 4)
    out["CG_Q_DECL"] = ind(tl.decl(q, "dq") + tl.decl(q, "dk"), 4)

    def sq(mat: str, t_: str, s_: str) -> str:  # element (t_, s_) of a C x C matrix in workgroup memory
        return f"cg_sm[{mat} + {t_} * {C1}u + {s_}]"

    out["CG_Q_FMA"] = _steps(
        plan,
        q,
        [("dq", "qk", "k"), ("dk", "qkt", "q"), ("dk", "kk", "k")],
        {
            "qk": lambda row, r: sq("CG_P", row, f"(u0 + {r})"),
            "qkt": lambda row, r: sq("CG_P", f"(u0 + {r})", row),
            "kk": lambda row, r: sq("CG_A", row, f"(u0 + {r})"),  # dKK + dKKᵀ, completed in place
        },
        {"k": _staged("cg_sm", "CG_STG", cdk), "q": _staged("cg_sm", f"CG_STG + {R * cdk}u", cdk)},
    )
    out["CG_Q_STORE"] = ind(
        each(
            q,
            lambda a, b, row, col: (
                f"if ({q.active()} && cg_ok(t0 + {row}, {col})) {{ cg_dqk[cg_dqk_at(0u, b, t0 + {row}, h, {col})] = dq_{a}_{b}; "
                f"cg_dqk[cg_dqk_at(1u, b, t0 + {row}, h, {col})] = dk_{a}_{b}; }}"
            ),
        ),
        4,
    )
    out["CG_Z_DECL"] = ind(tl.decl(q, "z") + tl.decl(q, "y"), 4)
    zs = _staged("cg_sm", "CG_ZB", cdk + 1)
    out["CG_Z_FMA"] = _steps(
        plan,
        q,
        [("z", "r", "s"), ("y", "o", "s")],
        {"r": _staged("cg_sm", "CG_ZA", C2), "o": _staged("cg_sm", f"CG_ZA + {C}u", C2)},
        {"s": zs},
    )

    def zel(a, b, row, col):  # dq += Γ Y, dk -= beta Γ Z; the row terms of dγ and dbeta
        return (
            f"if ({q.active()} && cg_ok(t0 + {row}, {col})) {{ let gm = exp(c_gam[{row}]); let be = c_bet[{row}]; "
            f"let qv = cg_ld(0u, b, t0 + {row}, hk, {col}); let kv = cg_ld(1u, b, t0 + {row}, hk, {col}); "
            f"let a0 = cg_dqk_at(0u, b, t0 + {row}, h, {col}); let a1 = cg_dqk_at(1u, b, t0 + {row}, h, {col}); "
            f"cg_dqk[a0] = cg_dqk[a0] + gm * y_{a}_{b}; cg_dqk[a1] = cg_dqk[a1] - be * gm * z_{a}_{b}; "
            f"zr{a} += gm * (qv * y_{a}_{b} - be * kv * z_{a}_{b}); zb{a} -= gm * kv * z_{a}_{b}; }}"
        )

    lines = [f"var zr{a} = 0.0;\n    var zb{a} = 0.0;" for a in range(q.tm)] + each(q, zel)
    lines += _row_sums(q, [f"zr{a}" for a in range(q.tm)], "cg_dgam", "+=")
    lines += _row_sums(q, [f"zb{a}" for a in range(q.tm)], "cg_dbet", "+=")
    out["CG_Z_ELEM"] = ind(lines, 4)
    out["CG_K_DECL"] = ind(tl.decl(q, "kt"), 4)
    out["CG_K_FMA"] = _steps(plan, q, [("kt", "d", "s")], {"d": _staged("cg_sm", "CG_ZA", C1)}, {"s": zs})

    def kel(a, b, row, col):  # dk += exp(γ_L − γ) dK̃; the row terms K̃·dK̃
        return (
            f"if ({q.active()} && cg_ok(t0 + {row}, {col})) {{ let tail = exp(c_gam[CC - 1u] - c_gam[{row}]); "
            f"let kv = cg_ld(1u, b, t0 + {row}, hk, {col}); let a1 = cg_dqk_at(1u, b, t0 + {row}, h, {col}); "
            f"cg_dqk[a1] = cg_dqk[a1] + tail * kt_{a}_{b}; kr{a} += tail * kv * kt_{a}_{b}; }}"
        )

    lines = [f"var kr{a} = 0.0;" for a in range(q.tm)] + each(q, kel)
    lines += [
        f"if {q.active()} {{ cg_sm[CG_RED + {q.row(a)} * {q.wx}u + tx_q] = kr{a}; }}" for a in range(q.tm)
    ]
    lines += [
        "workgroupBarrier();",
        "if (lid < CC) {",
        "    var acc = 0.0;",
        f"    for (var x = 0u; x < {q.wx}u; x++) {{ acc += cg_sm[CG_RED + lid * {q.wx}u + x]; }}",
        "    cg_dgam[lid] -= acc;",
        "}",
        "if (lid == 0u) {",
        "    var tot = 0.0;",
        f"    for (var y = 0u; y < {C * q.wx}u; y++) {{ tot += cg_sm[CG_RED + y]; }}",
        "    cg_last = tot;",
        "}",
    ]
    out["CG_K_ELEM"] = ind(lines, 4)
    return out


def chunk_sizes(
    rows: int, T: int, Hv: int, Dk: int, Dv: int, chunk: int, N: int | None = None
) -> dict[str, int]:
    """Floats of the chunked kernels' scratch `scr` = [tp | dr | ds | dg] for calls of `rows` batch rows
    (each part 256-byte aligned): tp the prep's three C x C matrices per (row, value head, chunk), dr = dR
    (rows*T, Hv, Dv), ds the state gradient at each chunk's end, dg = [dg, dbeta] for all N = B*T tokens
    ((N, Hv, 2); default rows*T). "forward": what the forward alone needs (tp); "floats": the whole."""
    nck, rt = n_chunks(T, chunk), int(rows) * int(T)
    N = rt if N is None else int(N)
    tp = align_floats(int(rows) * int(Hv) * nck * 3 * chunk * chunk)
    dr = align_floats(rt * int(Hv) * int(Dv))
    ds = align_floats(int(rows) * int(Hv) * nck * int(Dk) * int(Dv))
    return {"tp": tp, "forward": tp, "dr_off": tp, "ds_off": tp + dr, "dg_off": tp + dr + ds,
            "floats": tp + dr + ds + align_floats(2 * N * int(Hv))}  # fmt: skip


def chunk_rows(gpu: Gpu, B: int, T: int, Hv: int, Dk: int, Dv: int, chunk: int, backward: bool) -> int:
    """Batch rows per call of the chunked kernels: all B, unless `scr` (the backward's with `backward`, else
    the forward's) or one layer's checkpoints would exceed a storage binding; then the most that fit, such
    that the views of the checkpoints and of a start state at row offsets stay aligned."""
    nck = n_chunks(T, chunk)
    state_row = 4 * int(Hv) * (nck + 1) * int(Dk) * int(Dv)  # bytes of one batch row's checkpoints

    def fits(g: int) -> bool:
        sz = chunk_sizes(g, T, Hv, Dk, Dv, chunk, int(B) * int(T))
        return (
            4 * sz["floats" if backward else "forward"] <= gpu.max_binding
            and g * state_row <= gpu.max_binding
        )

    def aligned(g: int) -> bool:
        return g == B or (g * state_row % gpu.align == 0 and 4 * g * Hv * Dk * Dv % gpu.align == 0)

    for g in range(int(B), 0, -1):
        if fits(g) and aligned(g):
            return g
    raise GpuError(f"gated delta rule: one batch row of {T} tokens x {Hv} heads of {Dk} x {Dv} needs more than a "
                   f"storage binding ({gpu.max_binding} bytes)")  # fmt: skip


def chunk_scratch_floats(gpu: Gpu, B: int, T: int, Hv: int, Dk: int, Dv: int, backward: bool,
                         plan: ChunkPlan | None = None) -> int:  # fmt: skip
    """Floats of the `scr` buffer the chunked launchers need (the forward's alone without `backward`)."""
    plan = chunk_plan(gpu, Dk, Dv, plan)
    g = chunk_rows(gpu, B, T, Hv, Dk, Dv, plan.chunk, backward)
    return chunk_sizes(g, T, Hv, Dk, Dv, plan.chunk, int(B) * int(T))["floats" if backward else "forward"]


def _row_views(res, per_row: int, groups: list[tuple[int, int]]) -> list:
    """Views of `res` at each group's first row (per_row floats per batch row)."""
    return [sub(res, b0 * per_row, g * per_row) for b0, g in groups]


def _groups(B: int, g: int) -> list[tuple[int, int]]:
    return [(b0, min(g, B - b0)) for b0 in range(0, B, g)]


def chunk_forward(
    gpu: Gpu, o, delta, states, scr, qkgb, v, B: int, T: int, Hk: int, Hv: int, Dk: int, Dv: int, *,
    plan: ChunkPlan | None = None, v_off: int = 0, v_stride: int | None = None, state_in=None,
    save_ckpt: bool = True, save_final: bool = False,
) -> Call:  # fmt: skip
    """The chunked forward (`chunk_prep` then `chunk_forward`): o (B*T, Hv, Dv) from `qkgb` and v as
    `gated_delta_forward`'s, starting from `state_in` (B, Hv, Dk, Dv) or zeros. With `save_ckpt`, delta = Δ
    (B*T, Hv, Dv) and `states` (`states_floats` with tc = plan.chunk) the state before each chunk, what
    `chunk_backward` reads; with `save_final`, the final state in slot nck. `scr`: scratch of
    `chunk_scratch_floats` (backward=save_ckpt; the backward's serves)."""
    B, T, Hk, Hv, Dk, Dv = (int(x) for x in (B, T, Hk, Hv, Dk, Dv))
    plan = chunk_plan(gpu, Dk, Dv, plan)
    C = plan.chunk
    _check_sizes("chunk_forward", B, T, Hk, Hv, C)
    N, nck = B * T, n_chunks(T, C)
    v_stride = Hv * Dv if v_stride is None else int(v_stride)
    g = chunk_rows(gpu, B, T, Hv, Dk, Dv, C, save_ckpt)
    tpf = chunk_sizes(g, T, Hv, Dk, Dv, C)["tp"]
    _need("chunk_forward", o=(o, N * Hv * Dv), qkgb=(qkgb, qkgb_floats(N, Hk, Hv, Dk)), scr=(scr, tpf),
          v=(v, v_off + (N - 1) * v_stride + Hv * Dv))  # fmt: skip
    if save_ckpt:
        _need("chunk_forward", delta=(delta, N * Hv * Dv))
    if save_ckpt or save_final:
        _need("chunk_forward", states=(states, states_floats(B, Hv, Dk, Dv, T, C)))
    if state_in is not None:
        _need("chunk_forward", state_in=(state_in, B * Hv * Dk * Dv))
    kp = _kernel(gpu, "chunk_prep", "rwu", Dk, Dv, plan)
    kf = _kernel(gpu, "chunk_forward", "rrrrwwwu", Dk, Dv, plan)
    tp = sub(scr, 0, tpf)
    delta = delta if save_ckpt else _unused(gpu)
    nvb = plan.dims(Dk, Dv)[1] // plan.bv
    groups = _groups(B, g)
    sts = _row_views(states, Hv * (nck + 1) * Dk * Dv, groups) if (save_ckpt or save_final) else None
    ins = _row_views(state_in, Hv * Dk * Dv, groups) if state_in is not None else None
    call = Call()
    for i, (b0, rows) in enumerate(groups):
        p = _uniform(gpu, "chunk_forward", rows, T, Hk, Hv, Dk, Dv, C, v_off, v_stride, b0=b0, save_ckpt=int(save_ckpt),
                     has_init=int(state_in is not None), save_final=int(save_final), k_off_rows=N)  # fmt: skip
        init = ins[i] if ins else v  # any buffer: not read without has_init
        st = sts[i] if sts else _unused(gpu)
        call += Call([(kp, gpu.bind(kp, qkgb, tp, p), rows * Hv * nck),
                      (kf, gpu.bind(kf, qkgb, v, init, tp, o, delta, st, p), rows * Hv * nvb)], [p])  # fmt: skip
    return call


def _unused(gpu: Gpu):
    """A 16-byte buffer bound where a kernel's output is switched off (never written)."""
    if "_gated_delta_unused" not in gpu.__dict__:
        gpu.__dict__["_gated_delta_unused"] = gpu.buffer(16, label="gated_delta_unused")
    return gpu.__dict__["_gated_delta_unused"]


def chunk_backward(
    gpu: Gpu, dqk, dv, scr, states, delta, qkgb, v, do, B: int, T: int, Hk: int, Hv: int, Dk: int, Dv: int, *,
    plan: ChunkPlan | None = None, v_off: int = 0, v_stride: int | None = None,
) -> Call:  # fmt: skip
    """The chunked backward (`chunk_prep` again, `chunk_backward_state`, `chunk_backward_grads`) from do
    (B*T, Hv, Dv) and the forward's `states` and `delta` (saved with save_ckpt, same plan): dqk as
    `gated_delta_backward`'s (per value head), dv written like v (`v_off`, `v_stride`), and scr's dg part
    (`chunk_dg_view`) = [dg, dbeta] per (row, value head): `gdn_inputs.gates_backward` with Dv = 1."""
    B, T, Hk, Hv, Dk, Dv = (int(x) for x in (B, T, Hk, Hv, Dk, Dv))
    plan = chunk_plan(gpu, Dk, Dv, plan)
    C = plan.chunk
    _check_sizes("chunk_backward", B, T, Hk, Hv, C)
    N, nck = B * T, n_chunks(T, C)
    v_stride = Hv * Dv if v_stride is None else int(v_stride)
    g = chunk_rows(gpu, B, T, Hv, Dk, Dv, C, True)
    sz = chunk_sizes(g, T, Hv, Dk, Dv, C, N)
    _need("chunk_backward", dqk=(dqk, qk_floats(N, Hv, Dk)), dv=(dv, v_off + (N - 1) * v_stride + Hv * Dv),
          scr=(scr, sz["floats"]), states=(states, states_floats(B, Hv, Dk, Dv, T, C)),
          delta=(delta, N * Hv * Dv), qkgb=(qkgb, qkgb_floats(N, Hk, Hv, Dk)), do=(do, N * Hv * Dv),
          v=(v, v_off + (N - 1) * v_stride + Hv * Dv))  # fmt: skip
    kp = _kernel(gpu, "chunk_prep", "rwu", Dk, Dv, plan)
    ks = _kernel(gpu, "chunk_backward_state", "rrwu", Dk, Dv, plan)
    kg = _kernel(gpu, "chunk_backward_grads", "rrrrrwwwu", Dk, Dv, plan)
    nvb = plan.dims(Dk, Dv)[1] // plan.bv
    groups = _groups(B, g)
    sts = _row_views(states, Hv * (nck + 1) * Dk * Dv, groups)
    scr = sub(scr, 0, sz["floats"])
    call = Call()
    for i, (b0, rows) in enumerate(groups):
        p = _uniform(gpu, "chunk_backward", rows, T, Hk, Hv, Dk, Dv, C, v_off, v_stride, b0=b0, k_off_rows=N,
                     dk_off=align_floats(N * Hv * Dk), dr_off=sz["dr_off"], ds_off=sz["ds_off"], dg_off=sz["dg_off"])  # fmt: skip
        call += Call([(kp, gpu.bind(kp, qkgb, sub(scr, 0, sz["tp"]), p), rows * Hv * nck),
                      (ks, gpu.bind(ks, qkgb, do, scr, p), rows * Hv * nvb),
                      (kg, gpu.bind(kg, qkgb, v, do, delta, sts[i], scr, dqk, dv, p), rows * Hv * nck)], [p])  # fmt: skip
    return call


def chunk_dg_view(gpu: Gpu, scr, B: int, T: int, Hv: int, Dk: int, Dv: int, plan: ChunkPlan | None = None):
    """The view of `scr` holding [dg, dbeta] (B*T, Hv, 2) after `chunk_backward`."""
    plan = chunk_plan(gpu, Dk, Dv, plan)
    g = chunk_rows(gpu, B, T, Hv, Dk, Dv, plan.chunk, True)
    sz = chunk_sizes(g, T, Hv, Dk, Dv, plan.chunk, int(B) * int(T))
    return sub(scr, sz["dg_off"], 2 * int(B) * int(T) * int(Hv))
