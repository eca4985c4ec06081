"""Launchers for `shaders/gated_delta.wgsl`: the gated delta rule of a Gated DeltaNet layer, forward and
backward (docs/model.md#gated-deltanet, docs/kernels.md#the-gated-delta-rule).

Kernel path: `shaders/gated_delta.wgsl` -> `ddl_wgpu/ops/gated_delta.py` -> reference
`ddl_ref.gdn.gated_delta_chunked_forward`, `gated_delta_chunked_backward` (the chunked kernels) and
`gated_delta_forward` (the per-token one) -> test `tests/test_kernel_gated_delta.py`.

The chunked form (`chunk_forward`, `chunk_backward`: what the engine trains and evaluates with) cuts a row's
tokens into chunks and does each chunk's work as small matrix products (docs/kernels.md#the-chunked-form):
everything local to a chunk runs per chunk (`chunk_prep`, `chunk_output`, `chunk_backward_grads`), and only
the recurrence's own products run in order over a row's chunks (`chunk_forward`, `chunk_backward_state`:
per batch row, value head and block of value columns, the state's block in registers). Their tunables are a
`ChunkPlan` (`ddl_wgpu/ops/codegen/gdn_plan.py`, which also generates every product's straight-line per-thread code),
the default the first of `PLANS` the adapter's limits allow, or DDL_WGPU_GDN_PLAN; `bench/hybrid.py kernel
--sweep` times them.

The per-token forward (`gated_delta_forward`: a decoder's pass of a few rows, `ddl_wgpu.engine.decode`, and an
inference net's forward of short rows, up to `PER_TOKEN_MAX_T` tokens, where it measured faster) walks the
tokens in order with the Dk x Dv state spread over TI x TJ threads of PI x PJ elements each (`tile`), and can
write the state before every tc-th token (with tc = 1 every row's: what a speculative verify rolls back to).

q, k and the gates travel in one read-only buffer (`qkgb`, three parts at aligned offsets) so each kernel
binds at most 8 storage buffers (WebGPU's default per stage).
"""

from __future__ import annotations

import os
from dataclasses import replace
from functools import lru_cache

from ddl_wgpu.ops import need_all as _need
from ddl_wgpu.ops import pow2_at_least, sub
from ddl_wgpu.ops.codegen import gdn_plan
from ddl_wgpu.ops.codegen.gdn_plan import ChunkPlan, parse_plan
from ddl_wgpu.ops.gdn_inputs import align_floats, planar_offsets, qk_floats
from ddl_wgpu.runtime.gpu import Call, Gpu, GpuError, Uniform

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
    ("dd_off", "u32", "chunked backward: floats, dΔ's (then dR's) start in scr"),
    ("ds_off", "u32", "chunked backward: floats, the chunk-end state gradients' start in scr"),
    ("e_off", "u32", "chunked backward: floats, the per-chunk [dP ∘ M; dA ∘ M]'s start in scr"),
    ("dg_off", "u32", "chunked backward: floats, [dg, dbeta]'s start in scr"),
    ("b0", "u32", "chunked: the call's first batch row"),
    ("mode", "u32", "chunk_prep: 0 the forward's (U), 1 the backward's (Tm)"),
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
    limit = gpu.limits.get("max-compute-workgroup-storage-size", 16 << 10)
    if entry.startswith("chunk"):  # the per-token part filled at its smallest: compiled, never run
        plan = chunk_plan(gpu, Dk, Dv, plan)
        threads = plan.threads if entry in SEQUENTIAL else plan.pthreads
        templates = _templates(1, 1, 1, 1) | _chunk_templates(plan, Dk, Dv, limit)
    else:
        ti, tj, pi, pj = tile(gpu, Dk, Dv)
        templates, threads = _templates(ti, tj, pi, pj) | _chunk_templates(_IDLE_PLAN, 4, 4, limit), ti * tj
    return gpu.kernel(FILE, entry, sig, templates=templates, workgroup=(threads, 1, 1), uniforms=(PARAMS,))


@lru_cache(maxsize=32)
def _chunk_templates(plan: ChunkPlan, Dk: int, Dv: int, limit: int) -> dict[str, str]:
    return gdn_plan.chunk_templates(plan, Dk, Dv, limit)


def _check_sizes(entry: str, B: int, T: int, Hk: int, Hv: int, tc: int) -> None:
    if Hk <= 0 or Hv % Hk:
        raise ValueError(f"{entry}: value heads {Hv} must be a multiple of key heads {Hk}")
    if tc < 1:
        raise ValueError(f"{entry}: chunk length {tc} must be positive")


def _uniform(gpu, label, B, T, Hk, Hv, Dk, Dv, tc, v_off, v_stride, k_off_rows=None, **flags):
    # qkgb's parts are laid out for all its rows (k_off_rows, default B*T) even when a call runs fewer
    k_off, gb_off = qkgb_offsets(B * T if k_off_rows is None else k_off_rows, Hk, Dk)
    values = (
        dict(
            has_init=0,
            save_ckpt=0,
            save_final=0,
            dk_off=0,
            dd_off=0,
            ds_off=0,
            e_off=0,
            dg_off=0,
            b0=0,
            mode=0,
        )
        | flags
    )
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
# the chunked form: chunk_prep, chunk_forward, chunk_output; chunk_prep, chunk_backward_state, _grads

ENV_PLAN = "DDL_WGPU_GDN_PLAN"  # e.g. "chunk=64,bv=32,threads=128,bk=16": the chunked kernels' plan
SEQUENTIAL = ("chunk_forward", "chunk_backward_state")  # the kernels that walk a row's chunks in order

# In order of preference; the first that fits the adapter is the default (`chunk_plan`). The first is the
# H200's (48 KiB, 1024 threads); the later ones fit WebGPU's default limits (16 KiB, 256 threads). To adopt
# a measured winner (`bench/hybrid.py kernel --sweep` prints it in this form), put it first.
PLANS = (
    # the H200's sweep winner at the 27B layer and the small hybrid's alike (2026-12-03, BENCHMARKS.md)
    ChunkPlan(chunk=64, bv=32, threads=128, bk=16, tb=16, pthreads=512),
    ChunkPlan(chunk=64, bv=32, threads=128, bk=16, tb=16, pthreads=256),
    ChunkPlan(chunk=32, bv=16, threads=128, bk=8, tb=16, pthreads=256),
    ChunkPlan(chunk=32, bv=8, threads=64, bk=8, tb=16, pthreads=256),
    ChunkPlan(chunk=16, bv=8, threads=64, bk=4, tb=8, pthreads=64),
    ChunkPlan(chunk=16, bv=4, threads=64, bk=2, tb=8, pthreads=64),
)

# The chunked part of a module compiled for a per-token entry point: the smallest code, never run.
_IDLE_PLAN = ChunkPlan(chunk=4, bv=4, threads=4, bk=1, tb=1, pthreads=4)

# An inference net's forward runs the per-token kernel for rows of at most PER_TOKEN_MAX_T tokens, and for
# rows of any length in a model of at least PER_TOKEN_MIN_HEADS value heads; else the chunked kernels above.
# Measured on the H200 (Vulkan, 2026-12-03, `bench/hybrid.py kernel`): at the 27B layer (48 value heads, 16
# rows) the per-token forward took 0.44 / 1.69 / 6.76 ms at 64 / 256 / 1024 tokens against the chunked form's
# 0.83 / 3.14 / 12.33; at the small hybrid's (6 value heads, 8 rows x 1024) 1.97 against 1.05. The per-token
# kernel runs one workgroup per (row, value head): with many heads that fills the GPU, with few it does not.
# The choice depends on the model and the row length, never on how many rows a pass holds, so a streamed
# trunk's blocks and a resident trunk's batches run the same kernels (same bits). A training forward is always
# chunked (its backward reads the chunked forward's Δ and checkpoints).
ENV_PER_TOKEN = "DDL_WGPU_GDN_PER_TOKEN_T"
PER_TOKEN_MAX_T = 64
PER_TOKEN_MIN_HEADS = 32  # between the 6 measured chunked-faster and the 48 measured per-token-faster


def per_token_max_t() -> int:
    """The longest row an inference forward runs per token: env DDL_WGPU_GDN_PER_TOKEN_T, else
    PER_TOKEN_MAX_T (0: always chunked)."""
    value = os.environ.get(ENV_PER_TOKEN, "").strip()
    if not value:
        return PER_TOKEN_MAX_T
    if not value.isdigit():
        raise GpuError(f"{ENV_PER_TOKEN}={value!r}: expected a token count (0: always the chunked kernels)")
    return int(value)


def per_token(T: int, Hv: int) -> bool:
    """Whether an inference forward of rows of T tokens in a model of Hv value heads runs per token (the
    measurements above); DDL_WGPU_GDN_PER_TOKEN_T=0 always runs the chunked kernels."""
    max_t = per_token_max_t()
    return max_t >= T or (max_t > 0 and Hv >= PER_TOKEN_MIN_HEADS)


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
        p = replace(p, bv=min(p.bv, max(4, pow2_at_least(Dv))))
        try:
            p.check(gpu, Dk, Dv)
            return p
        except GpuError:
            continue
    raise GpuError(f"gated delta rule: no chunk plan fits Dk={Dk}, Dv={Dv} in this adapter's limits")


def chunk_sizes(
    plan: ChunkPlan, rows: int, T: int, Hv: int, Dk: int, Dv: int, N: int | None = None
) -> dict[str, int]:
    """Floats of the chunked kernels' scratch `scr` = [tp | dd | ds | e | dg] for calls of `rows` batch
    rows (each part 256-byte aligned): tp the prep's block per (row, value head, chunk) (`gdn_plan.tp_block`),
    dd = dΔ then dR (rows*T, Hv, Dv), ds the state gradient at each chunk's end, e the grads' 2C x C per
    chunk, dg = [dg, dbeta] for all N = B*T tokens ((N, Hv, 2); default rows*T). "forward": what the forward
    alone needs (tp); "floats": the whole."""
    C = plan.chunk
    nck, rt, rh = n_chunks(T, C), int(rows) * int(T), int(rows) * int(Hv)
    N = rt if N is None else int(N)
    tp = align_floats(rh * nck * gdn_plan.tp_block(plan, Dk, Dv))
    dd = align_floats(rt * int(Hv) * int(Dv))
    ds = align_floats(rh * nck * int(Dk) * int(Dv))
    e = align_floats(rh * nck * 2 * C * C)
    return {"tp": tp, "forward": tp, "dd_off": tp, "ds_off": tp + dd, "e_off": tp + dd + ds,
            "dg_off": tp + dd + ds + e, "floats": tp + dd + ds + e + align_floats(2 * N * int(Hv))}  # fmt: skip


def chunk_rows(gpu: Gpu, B: int, T: int, Hv: int, Dk: int, Dv: int, plan: ChunkPlan, backward: bool) -> int:
    """Batch rows per call of the chunked kernels: all B, unless `scr` (the backward's with `backward`, else
    the forward's) or one layer's checkpoints would exceed a storage binding; then the most that fit, such
    that the views of the checkpoints and of a start state at row offsets stay aligned."""
    nck = n_chunks(T, plan.chunk)
    state_row = 4 * int(Hv) * (nck + 1) * int(Dk) * int(Dv)  # bytes of one batch row's checkpoints

    def fits(g: int) -> bool:
        sz = chunk_sizes(plan, g, T, Hv, Dk, Dv, int(B) * int(T))
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
    g = chunk_rows(gpu, B, T, Hv, Dk, Dv, plan, backward)
    return chunk_sizes(plan, g, T, Hv, Dk, Dv, int(B) * int(T))["floats" if backward else "forward"]


def _row_views(res, per_row: int, groups: list[tuple[int, int]]) -> list:
    """Views of `res` at each group's first row (per_row floats per batch row)."""
    return [sub(res, b0 * per_row, g * per_row) for b0, g in groups]


def _groups(B: int, g: int) -> list[tuple[int, int]]:
    return [(b0, min(g, B - b0)) for b0 in range(0, B, g)]


def _unused(gpu: Gpu):
    """A 16-byte buffer bound where a kernel's output is switched off (never written)."""
    if "_gated_delta_unused" not in gpu.__dict__:
        gpu.__dict__["_gated_delta_unused"] = gpu.buffer(16, label="gated_delta_unused")
    return gpu.__dict__["_gated_delta_unused"]


def chunk_forward(
    gpu: Gpu, o, delta, states, scr, qkgb, v, B: int, T: int, Hk: int, Hv: int, Dk: int, Dv: int, *,
    plan: ChunkPlan | None = None, v_off: int = 0, v_stride: int | None = None, state_in=None,
    save_ckpt: bool = True, save_final: bool = False,
) -> Call:  # fmt: skip
    """The chunked forward (`chunk_prep`, `chunk_forward`, `chunk_output`): o (B*T, Hv, Dv) and delta = Δ
    (B*T, Hv, Dv: the per-token corrections, what the backward reads) from `qkgb` and v as
    `gated_delta_forward`'s, starting from `state_in` (B, Hv, Dk, Dv) or zeros. With `save_ckpt`, `states`
    (`states_floats` with tc = plan.chunk) gets the state before each chunk, what `chunk_backward` reads;
    with `save_final`, the final state in slot nck. `scr`: scratch of `chunk_scratch_floats`
    (backward=save_ckpt; the backward's serves)."""
    B, T, Hk, Hv, Dk, Dv = (int(x) for x in (B, T, Hk, Hv, Dk, Dv))
    plan = chunk_plan(gpu, Dk, Dv, plan)
    C = plan.chunk
    _check_sizes("chunk_forward", B, T, Hk, Hv, C)
    N, nck = B * T, n_chunks(T, C)
    v_stride = Hv * Dv if v_stride is None else int(v_stride)
    g = chunk_rows(gpu, B, T, Hv, Dk, Dv, plan, save_ckpt)
    tpf = chunk_sizes(plan, g, T, Hv, Dk, Dv)["tp"]
    _need("chunk_forward", o=(o, N * Hv * Dv), delta=(delta, N * Hv * Dv), qkgb=(qkgb, qkgb_floats(N, Hk, Hv, Dk)),
          scr=(scr, tpf), v=(v, v_off + (N - 1) * v_stride + Hv * Dv))  # fmt: skip
    if save_ckpt or save_final:
        _need("chunk_forward", states=(states, states_floats(B, Hv, Dk, Dv, T, C)))
    if state_in is not None:
        _need("chunk_forward", state_in=(state_in, B * Hv * Dk * Dv))
    kp = _kernel(gpu, "chunk_prep", "rrwu", Dk, Dv, plan)
    kf = _kernel(gpu, "chunk_forward", "rrrwwwu", Dk, Dv, plan)
    ko = _kernel(gpu, "chunk_output", "rrwu", Dk, Dv, plan)
    tp = sub(scr, 0, tpf)
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
        call += Call([(kp, gpu.bind(kp, qkgb, v, tp, p), rows * Hk * nck),
                      (kf, gpu.bind(kf, qkgb, init, tp, o, delta, st, p), rows * Hv * nvb),
                      (ko, gpu.bind(ko, tp, delta, o, p), rows * Hv * nck)], [p])  # fmt: skip
    return call


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
    g = chunk_rows(gpu, B, T, Hv, Dk, Dv, plan, True)
    sz = chunk_sizes(plan, g, T, Hv, Dk, Dv, N)
    _need("chunk_backward", dqk=(dqk, qk_floats(N, Hv, Dk)), dv=(dv, v_off + (N - 1) * v_stride + Hv * Dv),
          scr=(scr, sz["floats"]), states=(states, states_floats(B, Hv, Dk, Dv, T, C)),
          delta=(delta, N * Hv * Dv), qkgb=(qkgb, qkgb_floats(N, Hk, Hv, Dk)), do=(do, N * Hv * Dv),
          v=(v, v_off + (N - 1) * v_stride + Hv * Dv))  # fmt: skip
    kp = _kernel(gpu, "chunk_prep", "rrwu", Dk, Dv, plan)
    ks = _kernel(gpu, "chunk_backward_state", "rrwu", Dk, Dv, plan)
    kg = _kernel(gpu, "chunk_backward_grads", "rrrrrwwwu", Dk, Dv, plan)
    nvb = plan.dims(Dk, Dv)[1] // plan.bv
    groups = _groups(B, g)
    sts = _row_views(states, Hv * (nck + 1) * Dk * Dv, groups)
    scr = sub(scr, 0, sz["floats"])
    offs = {k: sz[k] for k in ("dd_off", "ds_off", "e_off", "dg_off")}
    call = Call()
    for i, (b0, rows) in enumerate(groups):
        p = _uniform(gpu, "chunk_backward", rows, T, Hk, Hv, Dk, Dv, C, v_off, v_stride, b0=b0, k_off_rows=N,
                     dk_off=align_floats(N * Hv * Dk), mode=1, **offs)  # fmt: skip
        call += Call([(kp, gpu.bind(kp, qkgb, v, sub(scr, 0, sz["tp"]), p), rows * Hk * nck),
                      (ks, gpu.bind(ks, qkgb, do, scr, p), rows * Hv * nvb),
                      (kg, gpu.bind(kg, qkgb, v, do, delta, sts[i], scr, dqk, dv, p), rows * Hv * nck)], [p])  # fmt: skip
    return call


def chunk_dg_view(gpu: Gpu, scr, B: int, T: int, Hv: int, Dk: int, Dv: int, plan: ChunkPlan | None = None):
    """The view of `scr` holding [dg, dbeta] (B*T, Hv, 2) after `chunk_backward`."""
    plan = chunk_plan(gpu, Dk, Dv, plan)
    g = chunk_rows(gpu, B, T, Hv, Dk, Dv, plan, True)
    sz = chunk_sizes(plan, g, T, Hv, Dk, Dv, int(B) * int(T))
    return sub(scr, sz["dg_off"], 2 * int(B) * int(T) * int(Hv))
