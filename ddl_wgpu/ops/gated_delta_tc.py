"""The chunked gated delta rule's sequential forward on the matrix units: `shaders/gated_delta_tc.wgsl`'s
`chunk_forward_tc`, the same kernel as `gated_delta.wgsl`'s `chunk_forward` (same buffers, same grid, same
outputs) with its two products, X = [W; Q] S and K̃ᵀ Δ, on subgroup matrices (docs/kernels.md#the-chunked-
rules-sequential-forward-on-the-matrix-units).

Kernel path: `shaders/gated_delta_tc.wgsl` -> `ddl_wgpu/ops/gated_delta_tc.py` (generated code and the plan;
`ops.gated_delta.chunk_forward` launches it) -> reference `ddl_ref.gdn.gated_delta_chunked_forward` -> test
`tests/test_kernel_gated_delta.py` (on a GPU with an f16 -> f32 configuration, and emulated under Dawn on
lavapipe).

`chunk_forward` takes it where the Gpu's products are on the matrix units (`Gpu.products == "matrix"`, as
`ops.matmul`) with a 16 x 16 x 16 f16 -> f32 configuration, and the shape and the adapter's limits allow a
`TcPlan`; DDL_WGPU_GDN_TC=0 keeps the SIMT kernel (what `bench/hybrid.py kernel` compares against).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ddl_wgpu.ops import matmul_tc
from ddl_wgpu.ops.codegen.gdn_plan import ChunkPlan, tp_block

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


def sizes(p: TcPlan, C: int, cdk: int) -> dict[str, int]:
    """Elements of each workgroup array: Ss (f32), Bh (f16), Ah (f16), Xs (f32)."""
    return {"SS_SIZE": cdk * (p.bv + 4), "BH_SIZE": max(cdk, C) * (p.bv + 8),
            "AH_SIZE": max(2 * C * (p.kx + 8), p.kt * (cdk + 8)), "XS_SIZE": p.subgroups * MM * MM}  # fmt: skip


def workgroup_bytes(p: TcPlan, C: int, cdk: int) -> int:
    s = sizes(p, C, cdk)
    return 4 * s["SS_SIZE"] + 2 * s["BH_SIZE"] + 2 * s["AH_SIZE"] + 4 * s["XS_SIZE"] + 3 * 4 * C


def fits(gpu, p: TcPlan, C: int, cdk: int, cdv: int) -> bool:
    """Whether the plan tiles this shape (every size a multiple of the 16 x 16 matrices, each subgroup the same
    number of result matrices) and fits the adapter's workgroup memory and threads."""
    x_tiles, s_tiles = (2 * C // MM) * (p.bv // MM), (cdk // MM) * (p.bv // MM)
    return (
        all(v % MM == 0 for v in (C, cdk, p.bv, p.kx, p.kt))
        and cdv % p.bv == 0 and cdk % p.kx == 0 and C % p.kt == 0
        and x_tiles % p.subgroups == 0 and s_tiles % p.subgroups == 0
        and workgroup_bytes(p, C, cdk) <= gpu.limits.get("max-compute-workgroup-storage-size", 16384)
        and p.subgroups * matmul_tc.subgroup_size(gpu) <= gpu.limits.get("max-compute-invocations-per-workgroup", 256)
    )  # fmt: skip


def plan_for(gpu, plan: ChunkPlan, Dk: int, Dv: int) -> TcPlan | None:
    """The plan `chunk_forward` runs the matrix-unit kernel with, or None for the SIMT kernel: None unless the
    Gpu's products are on the matrix units with a 16 x 16 x 16 f16 -> f32 configuration; env
    DDL_WGPU_GDN_TC ("0", or a plan) decides before PLANS."""
    cfg = matmul_tc.usable_config(gpu)
    env = os.environ.get(ENV, "")
    if cfg != matmul_tc.Config(MM, MM, MM) or env == "0":
        return None
    cdk, cdv = plan.dims(Dk, Dv)
    for p in (parse(env),) if env else PLANS:
        if fits(gpu, p, plan.chunk, cdk, cdv):
            return p
    return None


def _coords(name: str, per: int, nct: int) -> list[str]:
    """Each subgroup's result matrices: slot u is matrix sid * per + u, row-major over nct columns."""
    return [f"    let {name}r{u} = (sid * {per}u + {u}u) / {nct}u; let {name}c{u} = (sid * {per}u + {u}u) % {nct}u;"
            for u in range(per)]  # fmt: skip


def _x(p: TcPlan, per: int) -> list[str]:
    sx = p.kx + 8
    lines = [f"        var x{u} = {RESULT}();" for u in range(per)]
    lines += ["        for (var k0 = 0u; k0 < CDK; k0 += KX) {",
              "            for (var e = li; e < 2u * CC * KX; e += NT) {",
              "                Ah[(e / KX) * SX + e % KX] = f16(cf_xa(blk, b, t0, hk, e / KX, k0 + e % KX));",
              "            }", "            workgroupBarrier();"]  # fmt: skip
    for kk in range(0, p.kx, MM):
        for u in range(per):
            lines += [
                f"            let lx{u}_{kk} = subgroupMatrixLoad<{LEFT}>(&Ah, xr{u} * {MM * sx}u + {kk}u, false, SX);",
                f"            let rx{u}_{kk} = subgroupMatrixLoad<{RIGHT}>(&Bh, (k0 + {kk}u) * SB + xc{u} * {MM}u, false, SB);",
                f"            x{u} = subgroupMatrixMultiplyAccumulate(lx{u}_{kk}, rx{u}_{kk}, x{u});",
            ]  # fmt: skip
    return lines + ["            workgroupBarrier();", "        }"]


def _x_epilogue(per: int) -> list[str]:
    lines = []
    for u in range(per):
        lines += [
            f"        subgroupMatrixStore(&Xs, slab, x{u}, false, {MM}u);",
            "        workgroupBarrier();",
            f"        for (var e = lane; e < {MM * MM}u; e += sg_size) {{",
            f"            let r = xr{u} * {MM}u + e / {MM}u;",
            f"            let j = xc{u} * {MM}u + e % {MM}u;",
            "            let v = Xs[slab + e];",
            "            if (r < CC) {",
            "                let dd = cf_scr[blk + TP_X + r * CDV + j0 + j] - v;",
            "                Bh[r * SB + j] = f16(dd);",
            "                cf_store_delta(b, t0 + r, h, j0 + j, dd);",
            "            } else {",
            "                cf_store_o(b, t0 + r - CC, h, j0 + j, exp(c_gam[r - CC]) * v);",
            "            }",
            "        }",
            "        workgroupBarrier();",
        ]
    return lines


def _s(p: TcPlan, per: int) -> list[str]:
    ss = p.bv + 4
    at = [f"sr{u} * {MM * ss}u + sc{u} * {MM}u" for u in range(per)]
    lines = [f"        var s{u} = subgroupMatrixLoad<{RESULT}>(&Ss, {at[u]}, false, SS);" for u in range(per)]
    lines += ["        for (var k0 = 0u; k0 < CC; k0 += KT) {",
              "            for (var e = li; e < KT * CDK; e += NT) {",
              "                let tt = e / CDK;",
              "                let kw = exp(c_gam[CC - 1u] - c_gam[k0 + tt]) * cf_ld(1u, b, t0 + k0 + tt, hk, e % CDK);",
              "                Ah[tt * SK + e % CDK] = f16(kw);",
              "            }", "            workgroupBarrier();"]  # fmt: skip
    for kk in range(0, p.kt, MM):
        for u in range(per):
            lines += [  # K̃ᵀ's matrix: K̃'s rows kk.. read column-major
                f"            let ls{u}_{kk} = subgroupMatrixLoad<{LEFT}>(&Ah, {kk}u * SK + sr{u} * {MM}u, true, SK);",
                f"            let rs{u}_{kk} = subgroupMatrixLoad<{RIGHT}>(&Bh, (k0 + {kk}u) * SB + sc{u} * {MM}u, false, SB);",
                f"            s{u} = subgroupMatrixMultiplyAccumulate(ls{u}_{kk}, rs{u}_{kk}, s{u});",
            ]  # fmt: skip
    lines += ["            workgroupBarrier();", "        }"]
    return lines + [f"        subgroupMatrixStore(&Ss, {at[u]}, s{u}, false, SS);" for u in range(per)]


def templates(p: TcPlan, plan: ChunkPlan, Dk: int, Dv: int, subgroup_size: int) -> dict[str, str]:
    """The placeholders of gated_delta_tc.wgsl for one plan, chunk plan (its chunk and padding: chunk_prep's
    output layout) and subgroup size."""
    C = plan.chunk
    cdk, cdv = plan.dims(Dk, Dv)
    nct = p.bv // MM
    px, ps = (2 * C // MM) * nct // p.subgroups, (cdk // MM) * nct // p.subgroups
    consts = {"CC": C, "CDK": cdk, "CDV": cdv, "BV": p.bv, "NVB": cdv // p.bv, "NT": p.subgroups * subgroup_size,
              "TPB": tp_block(plan, Dk, Dv), "KX": p.kx, "KT": p.kt}  # fmt: skip
    return {
        **{k: str(v) for k, v in consts.items()},
        **{k: str(v) for k, v in sizes(p, C, cdk).items()},
        "COORDS": "\n".join(_coords("x", px, nct) + _coords("s", ps, nct)),
        "X": "\n".join(_x(p, px)),
        "X_EPI": "\n".join(_x_epilogue(px)),
        "S": "\n".join(_s(p, ps)),
    }


def kernel(gpu, p: TcPlan, plan: ChunkPlan, Dk: int, Dv: int, params):
    """The compiled `chunk_forward_tc` for a plan and a chunk plan (its signature and uniform, `params`:
    chunk_forward's)."""
    sg = matmul_tc.subgroup_size(gpu)
    return gpu.kernel(FILE, "chunk_forward_tc", "rrrwwwu", templates=templates(p, plan, Dk, Dv, sg),
                      workgroup=(p.subgroups * sg, 1, 1), uniforms=(params,))  # fmt: skip
