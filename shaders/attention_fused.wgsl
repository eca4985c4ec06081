// Causal grouped-query attention, fused forward with GEMM-style register tiles (flash formulation: the T x T
// scores never leave the workgroup). The same math as `attention.wgsl`'s forward and the scores path
// (`attention_scores.wgsl` + matmul), chosen with DDL_WGPU_ATTENTION=fused (`ddl_wgpu/ops/attention.py`).
//
// Layout: q (B,T,H,D), k and v (B,T,KH,D) row-major f32; kv head j serves q heads [j*G, (j+1)*G), G = H/KH.
// out (B,T,H,D); lse (B,H,T) = natural log-sum-exp of the scaled scores of each query row (the backward's
// input, as from the other implementations).
//
// Why this shape. The older flash kernels compute each score as a D-long dot product by one thread from shared
// memory: one shared load per FMA, a quarter of the GEMM's rate. Here a workgroup of WY x WX threads owns BQ
// query rows of one (batch, head) and walks the key tiles of BK keys up to the causal diagonal; both products
// of a key tile are register-tiled like `matmul.wgsl`:
//   S (BQ x BK) = Q K^T: thread (ty, tx) holds TM x TN scores (rows: the vec4 groups ty + WY*a, columns: the
//     vec4 groups tx + WX*b), summed over D in chunks of DK channels staged k-major in shared memory (Q and K
//     chunks side by side in `stage`), so per channel a thread does TM*TN FMAs for TM/4 + TN/4 vec4 loads.
//   online softmax, base 2 (scale * log2(e) folded into one multiply): each thread takes the max of its part of
//     a row, the WX partial maxima of a row meet in `red` (one barrier), every thread of the row reads them in
//     the same order (deterministic, no subgroup operations). The row sums stay per-thread partials, rescaled
//     with the row's shared running max, and are reduced once at the end the same way.
//   P goes to shared memory (`ps`, key-major: vec4 along query rows), then O (BQ x D) += P V with thread
//     (ty, tx) holding the same TM rows x the vec4 channel groups tx + WX*u of O, V staged in chunks of BJ keys
//     (reusing `stage`).
// Shared rows are padded to odd vec4 strides where threads walk across rows (the k-major copies). Every
// accumulator is its own variable, generated straight-line by the launcher (the template holes): a private
// array indexed in a loop is spilled to slow memory on NVIDIA (docs/wgpu-notes.md#why-straight-line-wgsl).
// Causality: a masked score is NEG (probability exactly 0); key tile 0 always holds key 0 <= every row, so
// the running max is finite from the first tile on. Query tiles are dispatched longest first (the last
// query tile has the most key tiles). Every sum runs in a fixed order and nothing uses atomics.

// generated from its description in ddl_wgpu/ops/attention_fused.py (`Uniform`)
{{struct Params}}

const D: u32 = {{D}}u;
const WX: u32 = {{WX}}u;  // threads along keys (S) / channel groups (O)
const WY: u32 = {{WY}}u;  // threads along query rows
const NT: u32 = WX * WY;
const BQ: u32 = {{BQ}}u;  // query rows per workgroup = WY * TM
const BK: u32 = {{BK}}u;  // keys per tile = WX * TN
const DK: u32 = {{DK}}u;  // channels per staged chunk of Q and K
const BJ: u32 = {{BJ}}u;  // keys per staged chunk of V
const SQ: u32 = BQ / 4u + 1u;  // odd vec4 strides of the k-major chunks
const SK: u32 = BK / 4u + 1u;
const KOFF: u32 = DK * SQ;  // the K chunk follows the Q chunk in `stage`
const SV: u32 = {{SV}}u;  // vec4s per staged V row: WX * ceil(ceil(D/4) / WX), zero past D
const SP: u32 = BQ / 4u + 1u;
const NEG: f32 = -3.0e38;  // "minus infinity" for masked scores: exp2(NEG - m) == 0
const LN2: f32 = 0.6931471805599453;

@group(0) @binding(0) var<storage, read> fq: array<f32>;
@group(0) @binding(1) var<storage, read> fk: array<f32>;
@group(0) @binding(2) var<storage, read> fv: array<f32>;
@group(0) @binding(3) var<storage, read_write> fout: array<f32>;
@group(0) @binding(4) var<storage, read_write> flse: array<f32>;
@group(0) @binding(5) var<uniform> fp: Params;

var<workgroup> stage: array<vec4<f32>, {{STAGE}}>;  // max(DK * (SQ + SK), BJ * SV)
var<workgroup> ps: array<vec4<f32>, BK * SP>;  // P, key-major: ps[j * SP + iv] = P[4iv .. 4iv + 3][j]
var<workgroup> red: array<f32, BQ * WX>;  // per-row partials of WX threads: row * WX + tx

fn max4(a: vec4<f32>) -> f32 {
    return max(max(a.x, a.y), max(a.z, a.w));
}

fn sum4(a: vec4<f32>) -> f32 {
    return (a.x + a.y) + (a.z + a.w);
}

// Element (row, channel) of q or k at `base` (row stride `stride`), 0 past T or D.
fn q_at(base: u32, stride: u32, row: u32, d: u32) -> f32 {
    if (row < fp.T && d < D) {
        return fq[base + row * stride + d];
    }
    return 0.0;
}

fn k_at(base: u32, stride: u32, row: u32, d: u32) -> f32 {
    if (row < fp.T && d < D) {
        return fk[base + row * stride + d];
    }
    return 0.0;
}

fn v_at(base: u32, stride: u32, row: u32, d: u32) -> f32 {
    if (row < fp.T && d < D) {
        return fv[base + row * stride + d];
    }
    return 0.0;
}

// Copy channels d0 .. d0 + DK of query rows q0.. and key rows k0.. into `stage`, k-major (slot i: channel
// i % DK, vec4 row group i / DK, so consecutive threads read consecutive channels of a row).
fn stage_qk(qbase: u32, kbase: u32, q0: u32, k0: u32, d0: u32, lid: u32) {
    for (var n = 0u; n < (DK * BQ / 4u + NT - 1u) / NT; n++) {
        let i = lid + n * NT;
        if (i < DK * BQ / 4u) {
            let d = d0 + i % DK;
            let r = q0 + 4u * (i / DK);
            let st = fp.H * D;
            stage[(i % DK) * SQ + i / DK] = vec4<f32>(q_at(qbase, st, r, d), q_at(qbase, st, r + 1u, d),
                                                      q_at(qbase, st, r + 2u, d), q_at(qbase, st, r + 3u, d));
        }
    }
    for (var n = 0u; n < (DK * BK / 4u + NT - 1u) / NT; n++) {
        let i = lid + n * NT;
        if (i < DK * BK / 4u) {
            let d = d0 + i % DK;
            let r = k0 + 4u * (i / DK);
            let st = fp.KH * D;
            stage[KOFF + (i % DK) * SK + i / DK] = vec4<f32>(k_at(kbase, st, r, d), k_at(kbase, st, r + 1u, d),
                                                             k_at(kbase, st, r + 2u, d), k_at(kbase, st, r + 3u, d));
        }
    }
}

// Copy value rows j0 .. j0 + BJ into `stage` row-major (stage[j * SV + c] = V[j0 + j][4c .. 4c + 3]).
fn stage_v(vbase: u32, j0: u32, lid: u32) {
    for (var n = 0u; n < (BJ * SV + NT - 1u) / NT; n++) {
        let i = lid + n * NT;
        if (i < BJ * SV) {
            let r = j0 + i / SV;
            let d = 4u * (i % SV);
            let st = fp.KH * D;
            stage[i] = vec4<f32>(v_at(vbase, st, r, d), v_at(vbase, st, r, d + 1u), v_at(vbase, st, r, d + 2u),
                                 v_at(vbase, st, r, d + 3u));
        }
    }
}

@compute @workgroup_size(NT)
fn attention_fused_forward(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let w = wid.x + wid.y * nwg.x;
    let nq = (fp.T + BQ - 1u) / BQ;
    if (w >= fp.B * fp.H * nq) {  // uniform over the workgroup
        return;
    }
    let qt = nq - 1u - w % nq;  // longest query tiles first
    let bh = w / nq;
    let b = bh / fp.H;
    let h = bh % fp.H;
    let kh = h / (fp.H / fp.KH);
    let q0 = qt * BQ;
    let qbase = (b * fp.T * fp.H + h) * D;
    let kbase = (b * fp.T * fp.KH + kh) * D;
    let tx = lid % WX;
    let ty = lid / WX;
    let c2 = fp.scale * 1.4426950408889634;  // scores in base 2
    let last = min(q0 + BQ - 1u, fp.T - 1u) / BK;  // the last key tile with a key <= some row of this tile

{{DECL}}
    for (var kt = 0u; kt <= last; kt++) {
        let k0 = kt * BK;
{{S_ZERO}}
        for (var d0 = 0u; d0 < D; d0 += DK) {
            workgroupBarrier();  // the previous users of `stage` are done
            stage_qk(qbase, kbase, q0, k0, d0, lid);
            workgroupBarrier();
            for (var d = 0u; d < DK; d++) {
{{S_STEP}}
            }
        }
        // scale, mask (keys past the row or past T), and this thread's part of each row's max
{{S_MASK}}
        workgroupBarrier();
{{S_SOFTMAX}}
        for (var j0 = 0u; j0 < BK; j0 += BJ) {
            if (k0 + j0 <= q0 + BQ - 1u) {  // chunks wholly above the diagonal hold only zeros of P
                workgroupBarrier();  // P is in `ps`; the previous users of `stage` are done
                stage_v(kbase, k0 + j0, lid);
                workgroupBarrier();
                for (var j = 0u; j < BJ; j++) {
{{PV_STEP}}
                }
            }
        }
    }
    // the row sums: each thread's partials meet in `red` (its last reads were before the barriers above)
{{L_PUT}}
    workgroupBarrier();
{{STORE}}
}
