"""Launchers for `shaders/gated_delta.wgsl`: the gated delta rule of a Gated DeltaNet layer, forward and
backward (docs/model.md#gated-deltanet, docs/kernels.md#the-gated-delta-rule).

Kernel path: `shaders/gated_delta.wgsl` -> `ddl_wgpu/ops/gated_delta.py` -> reference
`ddl_ref.gdn.gated_delta_forward`, `ddl_ref.gdn.gated_delta_backward` -> test
`tests/test_kernel_gated_delta.py`.

One workgroup per (batch row, value head) walks the tokens in order with the Dk x Dv state spread over its
threads, TI x TJ of them, each holding a PI x PJ block in registers (`tile`). The generated straight-line
code (`_templates`) is what keeps the block in registers: a private array indexed at run time would live in
slow memory on NVIDIA (docs/kernels.md#generated-wgsl).

The forward saves, for the backward, r = v − u per token and value head (so the backward rebuilds every state
without a reduction) and the state before every chunk of `tc` tokens (`states`, slots 0..nck−1); slot nck
gets the final state (`save_final`: the decoding cache). The backward rebuilds one chunk at a time from its
checkpoint, keeping each token's previous state in a scratch buffer (`tc` states per (batch row, value head),
one for every layer), then walks the chunk backwards. Memory: `states_floats`, `scratch_floats`: with T
tokens, L layers and chunks of tc, L·T/tc + tc states per (batch row, value head), least near tc = √(L·T).

q, k and the gates travel in one read-only buffer (`qkgb`, three parts at aligned offsets) so each kernel
binds at most 8 storage buffers (WebGPU's default per stage).

What it does not do: the chunked (WY) form, which puts the work into matrix products; with no tensor cores
in WGSL it saves no arithmetic here (docs/kernels.md#the-gated-delta-rule).
"""

from __future__ import annotations

from ddl_wgpu.gpu import Call, Gpu, GpuError, Uniform
from ddl_wgpu.ops import need_all as _need
from ddl_wgpu.ops import pow2_at_least
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
    ("tc", "u32", "tokens per checkpointed chunk"),
    ("nck", "u32", "chunks: ceil(T / tc)"),
    ("has_init", "u32", "forward: 1 starts from state_in, 0 from zeros"),
    ("save_ckpt", "u32", "forward: 1 writes the chunk checkpoints"),
    ("save_final", "u32", "forward: 1 writes the final state to slot nck"),
    ("gb_off", "u32", "floats: g, beta's start in qkgb"),
    ("dk_off", "u32", "backward: floats, dk's start in dqk"),
)
MAX_THREADS = 256  # the most threads a workgroup gets (WebGPU's default limit)
MAX_SIDE = 16  # threads along Dk or Dv


def tile(gpu: Gpu, Dk: int, Dv: int) -> tuple[int, int, int, int]:
    """(TI, TJ, PI, PJ): TI x TJ threads of PI x PJ state elements each, for the adapter's limits. Up to 16 x 16
    threads; both sides halve (more elements per thread) while the workgroup memory the backward needs
    (TI·DVP + TJ·DKP + DVP floats) or the thread count exceeds the limits. A function of the shape and the
    limits only, so the sums' order (and the bits) never change between runs."""
    limit = gpu.limits.get("max-compute-workgroup-storage-size", 16 << 10)
    threads = min(MAX_THREADS, gpu.limits.get("max-compute-invocations-per-workgroup", 256))
    ti, tj = min(MAX_SIDE, pow2_at_least(Dk)), min(MAX_SIDE, pow2_at_least(Dv))

    def shared(ti: int, tj: int) -> int:
        dkp, dvp = ti * -(-Dk // ti), tj * -(-Dv // tj)
        return 4 * max(ti * dvp + tj * dkp + dvp, 2 * ti * dvp + dvp)

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
    """The straight-line per-thread code: state s_a_b (and its gradient d_a_b) for a < PI rows, b < PJ columns."""
    A, Bs = range(pi), range(pj)
    row = {a: f"ti + {a}u * TI" for a in A}
    col = {b: f"tj + {b}u * TJ" for b in Bs}
    pairs = [(a, b) for a in A for b in Bs]
    nl = "\n        "
    t = {"TI": str(ti), "TJ": str(tj), "DKP": str(ti * pi), "DVP": str(tj * pj)}
    # -- forward
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
    # -- backward
    nl2 = nl + "    "
    t["B_INIT"] = nl.join(f"var d_{a}_{b} = 0.0;" for a, b in pairs)
    t["B_LOAD_CKPT"] = nl.join(f"var s_{a}_{b} = b_ldckpt(ckpt, {row[a]}, {col[b]});" for a, b in pairs)
    t["B_SCRATCH_STORE"] = nl2.join(
        f"b_stscratch(scratch + (t - t0) * S, {row[a]}, {col[b]}, s_{a}_{b});" for a, b in pairs
    )
    rec = [f"let k{a} = b_ldk(n, hk, {row[a]});" for a in A]
    rec += [f"let e{b} = bt * b_ldcol(0u, n, h, {col[b]});" for b in Bs]
    rec += [f"s_{a}_{b} = at * s_{a}_{b} + k{a} * e{b};" for a, b in pairs]
    t["B_RECOMPUTE"] = nl2.join(rec)
    step = [f"let p_{a}_{b} = b_ldscratch(scratch + (t - t0) * S, {row[a]}, {col[b]});" for a, b in pairs]
    step += [f"let k{a} = b_ldk(n, hk, {row[a]});{nl2}let q{a} = b_ldq(n, hk, {row[a]});" for a in A]
    step += [
        f"let r{b} = b_ldcol(0u, n, h, {col[b]});{nl2}let o{b} = b_ldcol(1u, n, h, {col[b]});"
        f"{nl2}let e{b} = bt * r{b};"
        for b in Bs
    ]
    t["B_LOAD_STEP"] = nl2.join(step)
    # phase A: dS += q dO^T; column partials of dd = dS^T k; row partials of dq = S_t dO, S_t = a p + k e^T
    pa = [f"d_{a}_{b} = d_{a}_{b} + q{a} * o{b};" for a, b in pairs]
    pa += [f"red_c[ti * DVP + {col[b]}] = {_sum([f'd_{a}_{b} * k{a}' for a in A])};" for b in Bs]
    pa += [
        f"red_r[tj * DKP + {row[a]}] = {_sum([f'(at * p_{a}_{b} + k{a} * e{b}) * o{b}' for b in Bs])};"
        for a in A
    ]
    t["B_PHASE_A"] = nl2.join(pa)
    # phase B: dd, du; dv and the beta terms; row partials of dk; dS~ = dS + k du^T; column partials of dg
    pb = [f"let dd{b} = vec_c[{col[b]}];{nl2}let du{b} = -bt * dd{b};" for b in Bs]
    pb += [
        f"if (ti == 0u && {col[b]} < b_p.Dv) {{{nl2}    "
        f"b_dv[b_p.v_off + n * b_p.v_stride + h * b_p.Dv + {col[b]}] = bt * dd{b};{nl2}    "
        f"b_dgb[((n * b_p.Hv + h) * 2u + 1u) * b_p.Dv + {col[b]}] = dd{b} * r{b};{nl2}}}"
        for b in Bs
    ]
    pb += [
        f"red_r[tj * DKP + {row[a]}] = {_sum([f'd_{a}_{b} * e{b} + at * p_{a}_{b} * du{b}' for b in Bs])};"
        for a in A
    ]
    pb += [f"d_{a}_{b} = d_{a}_{b} + k{a} * du{b};" for a, b in pairs]
    pb += [f"red_c[ti * DVP + {col[b]}] = {_sum([f'd_{a}_{b} * (at * p_{a}_{b})' for a in A])};" for b in Bs]
    t["B_PHASE_B"] = nl2.join(pb)
    t["B_DECAY"] = nl2.join(f"d_{a}_{b} = at * d_{a}_{b};" for a, b in pairs)
    return t


def n_chunks(T: int, tc: int) -> int:
    return -(-int(T) // int(tc))


def chunk_tokens(gpu: Gpu, B: int, Hv: int, Dk: int, Dv: int, T: int, default: int = 64) -> int:
    """Tokens per checkpointed chunk: `default`, fewer when the backward's scratch (tc states per (batch row,
    value head)) would not fit one storage binding (the Qwen3.8-27B shape at 16 x 1024: 42)."""
    per = 4 * int(B) * int(Hv) * int(Dk) * int(Dv)
    fit = gpu.max_binding // per
    if fit < 1:
        raise GpuError(
            f"gated delta rule: one state per (batch row, value head) ({per} bytes) exceeds a binding"
        )
    return max(1, min(int(T), int(default), fit))


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


def scratch_floats(B: int, Hv: int, Dk: int, Dv: int, tc: int) -> int:
    """Floats of the backward's scratch: tc states per (batch row, value head); one serves every layer."""
    return int(B) * int(Hv) * int(tc) * int(Dk) * int(Dv)


def _kernel(gpu: Gpu, entry: str, sig: str, Dk: int, Dv: int):
    ti, tj, pi, pj = tile(gpu, Dk, Dv)
    return gpu.kernel(FILE, entry, sig, templates=_templates(ti, tj, pi, pj), workgroup=(ti * tj, 1, 1),
                      uniforms=(PARAMS,))  # fmt: skip


def _check_sizes(entry: str, B: int, T: int, Hk: int, Hv: int, tc: int) -> None:
    if Hk <= 0 or Hv % Hk:
        raise ValueError(f"{entry}: value heads {Hv} must be a multiple of key heads {Hk}")
    if tc < 1:
        raise ValueError(f"{entry}: chunk length {tc} must be positive")


def _uniform(gpu, label, B, T, Hk, Hv, Dk, Dv, tc, v_off, v_stride, **flags):
    k_off, gb_off = qkgb_offsets(B * T, Hk, Dk)
    values = dict(has_init=0, save_ckpt=0, save_final=0, dk_off=0) | flags
    return gpu.uniform(PARAMS, B=B, T=T, Hk=Hk, Hv=Hv, Dk=Dk, Dv=Dv, k_off=k_off, v_off=v_off, v_stride=v_stride,
                       tc=tc, nck=n_chunks(T, tc), gb_off=gb_off, label=label, **values)  # fmt: skip


def gated_delta_forward(
    gpu: Gpu, o, r, states, qkgb, v, B: int, T: int, Hk: int, Hv: int, Dk: int, Dv: int, *,
    tc: int, v_off: int = 0, v_stride: int | None = None, state_in=None, save_ckpt: bool = True,
    save_final: bool = False,
) -> Call:  # fmt: skip
    """o, r (B*T, Hv, Dv) and `states` (`states_floats`: the chunk checkpoints with `save_ckpt`, the final
    state with `save_final`; unused otherwise) from `qkgb` (`qkgb_offsets`: q (B*T, Hk, Dk) normalised and
    scaled, k (B*T, Hk, Dk) normalised, [g, beta] (B*T, Hv, 2)) and v (`v_off` + n*`v_stride` + h*Dv + j;
    default planar), starting from `state_in` (B, Hv, Dk, Dv) when given, else zeros."""
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


def gated_delta_backward(
    gpu: Gpu, dqk, dv, dgb, scratch, states, qkgb, r, do, B: int, T: int, Hk: int, Hv: int, Dk: int, Dv: int,
    *, tc: int, v_off: int = 0, v_stride: int | None = None,
) -> Call:  # fmt: skip
    """From do (B*T, Hv, Dv) and the forward's r and checkpoints: dqk = [dq; dk] (dk at float
    `align_floats(B*T*Hv*Dk)`), each (B*T, Hv, Dk) per VALUE head (a key head's gradient is the sum over its
    value heads: `gdn_inputs.l2norm_backward` adds them), dv written like v (`v_off`, `v_stride`), dgb
    (B*T, Hv, 2, Dv): per-column terms of dg (0) and dbeta (1), whose sums over the Dv columns are the
    gradients (`gdn_inputs.gates_backward`). `scratch`: `scratch_floats` (any layer's backward may share it)."""
    B, T, Hk, Hv, Dk, Dv, tc = (int(x) for x in (B, T, Hk, Hv, Dk, Dv, tc))
    _check_sizes("gated_delta_backward", B, T, Hk, Hv, tc)
    N = B * T
    v_stride = Hv * Dv if v_stride is None else int(v_stride)
    _need("gated_delta_backward", dqk=(dqk, qk_floats(N, Hv, Dk)), dv=(dv, v_off + (N - 1) * v_stride + Hv * Dv),
          dgb=(dgb, 2 * N * Hv * Dv), scratch=(scratch, scratch_floats(B, Hv, Dk, Dv, tc)),
          states=(states, states_floats(B, Hv, Dk, Dv, T, tc)), qkgb=(qkgb, qkgb_floats(N, Hk, Hv, Dk)),
          r=(r, N * Hv * Dv), do=(do, N * Hv * Dv))  # fmt: skip
    p = _uniform(gpu, "gated_delta_backward", B, T, Hk, Hv, Dk, Dv, tc, v_off, v_stride,
                 dk_off=align_floats(N * Hv * Dk))  # fmt: skip
    k = _kernel(gpu, "gated_delta_backward", "rrrrwwwwu", Dk, Dv)
    return Call([(k, gpu.bind(k, qkgb, r, do, states, scratch, dqk, dv, dgb, p), B * Hv)], [p])
