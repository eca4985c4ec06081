"""The chunked gated delta rule's two sequential kernels on the matrix units: `shaders/gated_delta_tc.wgsl`'s
`chunk_forward_tc` and `chunk_backward_state_tc`, the same kernels as `gated_delta.wgsl`'s `chunk_forward` and
`chunk_backward_state` (same buffers, same grid, same outputs) with their products on subgroup matrices
(docs/kernels.md#the-sequential-kernels-on-the-matrix-units).

Kernel path: `shaders/gated_delta_tc.wgsl` -> `ddl_wgpu/ops/gated_delta_tc.py` (generated code and the plans;
`ops.gated_delta.chunk_forward` and `chunk_backward` launch them) -> reference
`ddl_ref.gdn.gated_delta_chunked_forward`, `gated_delta_backward` -> test `tests/test_kernel_gated_delta_tc.py`
(on a GPU with an f16 -> f32 configuration, and emulated under Dawn on lavapipe).

The launchers take them where the Gpu's products are on the matrix units (`Gpu.products == "matrix"`, as
`ops.matmul`) with a 16 x 16 x 16 f16 -> f32 configuration, and a `TcPlan` tiles the shape within the adapter's
limits; DDL_WGPU_GDN_TC=0 keeps the SIMT kernels (what `bench/hybrid.py kernel` compares against).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ddl_wgpu.ops import matmul_tc
from ddl_wgpu.ops.codegen.gdn_plan import PARAMS, ChunkPlan, tp_block  # PARAMS: the family's uniform

FILE = "gated_delta_tc.wgsl"
ENV = "DDL_WGPU_GDN_TC"  # "0": the SIMT chunk_forward even where the matrix units are in use; else a plan
MM = 16  # the configuration's m = n = k
LEFT, RIGHT, RESULT = (f"subgroup_matrix_{k}<{t}, 16, 16>" for k, t in
                       (("left", "f16"), ("right", "f16"), ("result", "f32")))  # fmt: skip


@dataclass(frozen=True)
class TcPlan:
    """`bv` value columns per workgroup, `subgroups` per workgroup, `kx` Dk per staged slab of [W; Q], `kt`
    tokens per staged slab of K̃. None of them changes a result's bits except through f16 rounding, which
    they do not touch: every sum runs in the same k order."""

    bv: int = 32
    subgroups: int = 4
    kx: int = 32
    kt: int = 32

    def name(self) -> str:
        return f"bv={self.bv},subgroups={self.subgroups},kx={self.kx},kt={self.kt}"


PLANS = (
    TcPlan(32, 4),
    TcPlan(32, 4, 16, 16),  # the backward's at Dk 128 within 48 KiB
    TcPlan(16, 4),
    TcPlan(16, 2, 16, 16),
)  # best first (`plan_for` takes the first that fits)


def parse(text: str) -> TcPlan:
    """'bv=32,subgroups=4,kx=32,kt=32' (any subset) -> a TcPlan."""
    fields = {}
    for part in filter(None, text.split(",")):
        k, _, v = part.partition("=")
        if k.strip() not in TcPlan.__dataclass_fields__ or not v.strip().isdigit():
            raise ValueError(f"{ENV}: {part!r} is not one of bv=, subgroups=, kx=, kt= with a whole number")
        fields[k.strip()] = int(v)
    return TcPlan(**fields)


ENTRIES = ("chunk_forward_tc", "chunk_backward_state_tc")


def sizes(p: TcPlan, C: int, cdk: int, entry: str = ENTRIES[0]) -> dict[str, int]:
    """Elements of each workgroup array of `entry`: Ss (f32), Bh (f16), Ah (f16), Xs (f32)."""
    bh = max(cdk, C) if entry == ENTRIES[0] else 2 * C + cdk  # rows: S (then Δ); [dΔ; dO; dS]
    ax = (2 * C if entry == ENTRIES[0] else C) * (p.kx + 8)  # a slab of KX columns: [W; Q] or [Pᵀ | K̃]
    return {"SS_SIZE": cdk * (p.bv + 4), "BH_SIZE": bh * (p.bv + 8), "AH_SIZE": max(ax, p.kt * (cdk + 8)),
            "XS_SIZE": p.subgroups * MM * MM}  # fmt: skip


def workgroup_bytes(p: TcPlan, C: int, cdk: int, entry: str = ENTRIES[0]) -> int:
    s = sizes(p, C, cdk, entry)
    return 4 * s["SS_SIZE"] + 2 * s["BH_SIZE"] + 2 * s["AH_SIZE"] + 4 * s["XS_SIZE"] + 3 * 4 * C


def _tiles(p: TcPlan, C: int, cdk: int, entry: str) -> tuple[int, int]:
    """Result matrices of each kernel's two products: X or dΔ (2C or C rows), and the state's (cdk rows)."""
    return (2 * C if entry == ENTRIES[0] else C) // MM * (p.bv // MM), cdk // MM * (p.bv // MM)


def fits(gpu, p: TcPlan, C: int, cdk: int, cdv: int, entry: str = ENTRIES[0]) -> bool:
    """Whether the plan tiles this shape for `entry` (every size a multiple of the 16 x 16 matrices, each
    subgroup the same number of result matrices) and fits the adapter's workgroup memory and threads."""
    return (
        all(v % MM == 0 for v in (C, cdk, p.bv, p.kx, p.kt))
        and cdv % p.bv == 0 and cdk % p.kx == 0 and C % p.kx == 0 and C % p.kt == 0
        and all(t % p.subgroups == 0 for t in _tiles(p, C, cdk, entry))
        and workgroup_bytes(p, C, cdk, entry) <= gpu.limits.get("max-compute-workgroup-storage-size", 16384)
        and p.subgroups * matmul_tc.subgroup_size(gpu) <= gpu.limits.get("max-compute-invocations-per-workgroup", 256)
    )  # fmt: skip


def plan_for(gpu, plan: ChunkPlan, Dk: int, Dv: int, entry: str = ENTRIES[0]) -> TcPlan | None:
    """The plan the launcher runs `entry` on the matrix units with, or None for the SIMT kernel: None unless
    the Gpu's products are on the matrix units with a 16 x 16 x 16 f16 -> f32 configuration; env
    DDL_WGPU_GDN_TC ("0", or a plan) decides before PLANS."""
    cfg = matmul_tc.usable_config(gpu)
    env = os.environ.get(ENV, "")
    if cfg != matmul_tc.Config(MM, MM, MM) or env == "0":
        return None
    cdk, cdv = plan.dims(Dk, Dv)
    for p in (parse(env),) if env else PLANS:
        if fits(gpu, p, plan.chunk, cdk, cdv, entry):
            return p
    return None


def _coords(name: str, per: int, nct: int) -> list[str]:
    """Each subgroup's result matrices: slot u is matrix sid * per + u, row-major over nct columns."""
    return [f"    let {name}r{u} = (sid * {per}u + {u}u) / {nct}u; let {name}c{u} = (sid * {per}u + {u}u) % {nct}u;"
            for u in range(per)]  # fmt: skip


def _product(
    acc: str, per: int, init, k_end: str, step: str, depth: int, stage: list[str], left, right
) -> list[str]:
    """One product into the subgroup's `per` result matrices `{acc}{u}` (declared with `init(u)`): k from 0 to
    k_end in slabs of `step` (`depth` at generation), each slab staged by `stage` into Ah, then per 16-deep
    slice the left matrix at `left(kk, u)` = (offset, column-major, stride) in Ah and the right one at
    `right(kk, u)` = (offset, stride) in Bh, multiplied into the accumulator."""
    lines = [f"        var {acc}{u} = {init(u)};" for u in range(per)]
    lines += [f"        for (var k0 = 0u; k0 < {k_end}; k0 += {step}) {{", *("            " + x for x in stage),
              "            workgroupBarrier();"]  # fmt: skip
    for kk in range(0, depth, MM):
        for u in range(per):
            (lo, cm, ls), (ro, rs) = left(kk, u), right(kk, u)
            lines += [f"            let l{acc}{u}_{kk} = subgroupMatrixLoad<{LEFT}>(&Ah, {lo}, {cm}, {ls});",
                      f"            let r{acc}{u}_{kk} = subgroupMatrixLoad<{RIGHT}>(&Bh, {ro}, false, {rs});",
                      f"            {acc}{u} = subgroupMatrixMultiplyAccumulate(l{acc}{u}_{kk}, r{acc}{u}_{kk}, {acc}{u});"]  # fmt: skip
    return lines + ["            workgroupBarrier();", "        }"]


def _epilogue(acc: str, per: int, body: list[str]) -> list[str]:
    """Each result matrix through the subgroup's slab of Xs; `body` runs per element with its row r, column j
    (within the block) and value v."""
    lines = []
    for u in range(per):
        lines += [f"        subgroupMatrixStore(&Xs, slab, {acc}{u}, false, {MM}u);", "        workgroupBarrier();",
                  f"        for (var e = lane; e < {MM * MM}u; e += sg_size) {{",
                  f"            let r = {acc}r{u} * {MM}u + e / {MM}u;", f"            let j = {acc}c{u} * {MM}u + e % {MM}u;",
                  "            let v = Xs[slab + e];", *("            " + x for x in body), "        }",
                  "        workgroupBarrier();"]  # fmt: skip
    return lines


def _state(per: int, k_end: str, depth: int, stage: list[str], ss: int) -> list[str]:
    """The state's (or its gradient's) update: its result matrices loaded from Ss, a product over KT-row slabs
    read column-major (Kᵀ-like), stored back."""
    at = [f"sr{u} * {MM * ss}u + sc{u} * {MM}u" for u in range(per)]
    return _product("s", per, lambda u: f"subgroupMatrixLoad<{RESULT}>(&Ss, {at[u]}, false, SS)", k_end, "KT", depth,
                    stage, lambda kk, u: (f"{kk}u * SK + sr{u} * {MM}u", "true", "SK"),
                    lambda kk, u: (f"(k0 + {kk}u) * SB + sc{u} * {MM}u", "SB")) + [
        f"        subgroupMatrixStore(&Ss, {at[u]}, s{u}, false, SS);" for u in range(per)]  # fmt: skip


def _forward(p: TcPlan, px: int, ps: int, nct: int) -> dict[str, str]:
    sx, ss, zero = p.kx + 8, p.bv + 4, f"{RESULT}()"
    x = _product("x", px, lambda u: zero, "CDK", "KX", p.kx,
                 ["for (var e = li; e < 2u * CC * KX; e += NT) {",
                  "    Ah[(e / KX) * SX + e % KX] = f16(cf_xa(blk, b, t0, hk, e / KX, k0 + e % KX));", "}"],
                 lambda kk, u: (f"xr{u} * {MM * sx}u + {kk}u", "false", "SX"),
                 lambda kk, u: (f"(k0 + {kk}u) * SB + xc{u} * {MM}u", "SB"))  # fmt: skip
    epi = _epilogue("x", px, [
        "if (r < CC) {",  # Δ = U - X_W, to delta and to Bh (the update's right operand)
        "    let dd = cf_scr[blk + TP_X + r * CDV + j0 + j] - v;",
        "    Bh[r * SB + j] = f16(dd);",
        "    cf_store_delta(b, t0 + r, h, j0 + j, dd);",
        "} else {",  # o = Γ X_Q
        "    cf_store_o(b, t0 + r - CC, h, j0 + j, exp(c_gam[r - CC]) * v);",
        "}"])  # fmt: skip
    s = _state(ps, "CC", p.kt, [
        "for (var e = li; e < KT * CDK; e += NT) {",  # K̃'s rows k0.., as stored
        "    let tt = e / CDK;",
        "    Ah[tt * SK + e % CDK] = f16(exp(c_gam[CC - 1u] - c_gam[k0 + tt]) * cf_ld(1u, b, t0 + k0 + tt, hk, e % CDK));",
        "}"], ss)  # fmt: skip
    return {"F_COORDS": "\n".join(_coords("x", px, nct) + _coords("s", ps, nct)), "X": "\n".join(x),
            "X_EPI": "\n".join(epi), "F_S": "\n".join(s)}  # fmt: skip


def _backward(p: TcPlan, pa: int, ps: int, nct: int) -> dict[str, str]:
    sx, ss, zero = p.kx + 8, p.bv + 4, f"{RESULT}()"
    a = _product("a", pa, lambda u: zero, "CC + CDK", "KX", p.kx, [
        "if (k0 < CC) {",  # Pᵀ's columns k0..: P's rows, read along them
        "    for (var e = li; e < CC * KX; e += NT) {",
        "        Ah[(e % CC) * SX + e / CC] = f16(cb_scr[blk + TP_P + (k0 + e / CC) * CC + e % CC]);",
        "    }",
        "} else {",  # K̃'s columns k0 - CC..
        "    for (var e = li; e < CC * KX; e += NT) {",
        "        let s = e / KX;",
        "        Ah[s * SX + e % KX] = f16(exp(c_gam[CC - 1u] - c_gam[s]) * cb_ld(1u, b, t0 + s, hk, k0 - CC + e % KX));",
        "    }",
        "}"],
        lambda kk, u: (f"ar{u} * {MM * sx}u + {kk}u", "false", "SX"),
        lambda kk, u: (f"(CC + k0 + {kk}u) * SB + ac{u} * {MM}u", "SB"))  # fmt: skip
    epi = _epilogue("a", pa, ["cb_store_dd(bl, t0 + r, h, j0 + j, v);", "Bh[r * SB + j] = f16(v);"])
    s = _state(ps, "2u * CC", p.kt, [
        "for (var e = li; e < KT * CDK; e += NT) {",  # the rows k0.. of [-W; ΓQ], as stored
        "    let t = k0 + e / CDK;",
        "    let i = e % CDK;",
        "    var w = 0.0;",
        "    if (t < CC) { w = -cb_scr[blk + t * CDK + i]; } else { w = exp(c_gam[t - CC]) * cb_ld(0u, b, t0 + t - CC, hk, i); }",
        "    Ah[(e / CDK) * SK + i] = f16(w);",
        "}"], ss)  # fmt: skip
    return {"B_COORDS": "\n".join(_coords("a", pa, nct) + _coords("s", ps, nct)), "A": "\n".join(a),
            "A_EPI": "\n".join(epi), "B_S": "\n".join(s)}  # fmt: skip


def templates(
    p: TcPlan, plan: ChunkPlan, Dk: int, Dv: int, subgroup_size: int, entry: str = ENTRIES[0]
) -> dict[str, str]:
    """The placeholders of gated_delta_tc.wgsl for one plan, chunk plan (its chunk and padding: chunk_prep's
    output layout), subgroup size and entry point (its workgroup arrays' sizes; both entry points' code is
    generated, the module holding both)."""
    C = plan.chunk
    cdk, cdv = plan.dims(Dk, Dv)
    nct = p.bv // MM
    consts = {"CC": C, "CDK": cdk, "CDV": cdv, "BV": p.bv, "NVB": cdv // p.bv, "NT": p.subgroups * subgroup_size,
              "TPB": tp_block(plan, Dk, Dv), "KX": p.kx, "KT": p.kt}  # fmt: skip
    fx, fs = (t // p.subgroups for t in _tiles(p, C, cdk, ENTRIES[0]))
    ba, bs = (t // p.subgroups for t in _tiles(p, C, cdk, ENTRIES[1]))
    return {
        **{k: str(v) for k, v in consts.items()},
        **{k: str(v) for k, v in sizes(p, C, cdk, entry).items()},
        **_forward(p, fx, fs, nct),
        **_backward(p, ba, bs, nct),
    }


SIGS = {ENTRIES[0]: "rrrwwwu", ENTRIES[1]: "rrwu"}  # chunk_forward's and chunk_backward_state's


def kernel(gpu, p: TcPlan, plan: ChunkPlan, Dk: int, Dv: int, entry: str = ENTRIES[0]):
    """The compiled `entry` for a plan and a chunk plan (its signature and uniform: the SIMT kernel's)."""
    sg = matmul_tc.subgroup_size(gpu)
    return gpu.kernel(FILE, entry, SIGS[entry], templates=templates(p, plan, Dk, Dv, sg, entry),
                      workgroup=(p.subgroups * sg, 1, 1), uniforms=(PARAMS,))  # fmt: skip
