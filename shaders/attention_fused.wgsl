// Causal grouped-query attention, forward and backward, with GEMM-style register tiles (flash formulation: the
// T x T scores never leave the workgroup). The same math as `attention.wgsl` and the scores path
// (`attention_scores.wgsl` + matmul), chosen with DDL_WGPU_ATTENTION=fused (`ddl_wgpu/ops/attention.py`).
//
// Layout: q (B,T,H,D), k and v (B,T,KH,D) row-major f32; kv head j serves q heads [j*G, (j+1)*G), G = H/KH.
// out (B,T,H,D); lse (B,H,T) = natural log-sum-exp of the scaled scores of each query row (saved by the
// forward for the backward); delta (B,H,T) = rowsum(dout * out) (`attention.wgsl`'s delta pass).
//
// Why this shape. The older flash kernels compute each score as a D-long dot product by one thread from shared
// memory: one shared load per FMA, a quarter of the GEMM's rate. Here every product is register-tiled like
// `matmul.wgsl`. A workgroup of WY x WX threads owns a "row tile" of BQ rows and walks "column tiles" of BK:
//   a score product X Y^T (BQ x BK, summed over D): thread (ty, tx) holds TM x TN of it (rows: the vec4 groups
//     ty + WY*a, columns: the vec4 groups tx + WX*b), the operands staged k-major in shared memory DK channels
//     at a time (`stage`: the row operand, then the column operand), so per channel a thread does TM*TN FMAs
//     for TM/4 + TN/4 vec4 loads;
//   a row product A += W Z (BQ x D, summed over the BK columns): W (probabilities or their gradients) goes to
//     shared memory (`ps`, column-major: vec4 along rows), Z's rows are staged BJ at a time (`stage` again),
//     and thread (ty, tx) holds the same TM rows x the vec4 channel groups tx + WX*u of A.
// The kernels:
//   attention_fused_forward: rows = BQ queries of one (b, h), columns = key tiles up to the diagonal. S = Q K^T,
//     online softmax in base 2 (scale * log2(e) folded into one multiply): each thread takes the max of its
//     part of a row, the WX partial maxima of a row meet in `red` (one barrier) and every thread of the row
//     reads them in the same order (deterministic, no subgroup operations); the row sums stay per-thread
//     partials rescaled with the row's running max and are reduced once at the end. O += P V.
//   attention_fused_backward_dq: rows = BQ queries, columns = key tiles up to the diagonal. S = Q K^T and
//     dP = dO V^T, P = exp(S - lse), dS = P (dP - delta), dQ += dS K (times the scale at the end).
//   attention_fused_backward_dkdv: rows = BQ keys of one (b, kv head), columns = query tiles from the diagonal
//     on, for each query head of the group in order. S^T = K Q^T, dP^T = V dO^T, then dV += P^T dO and
//     dK += dS^T Q (P^T and dS^T take turns in `ps`). No atomics: each dK, dV row is owned by one workgroup.
// Every accumulator is its own variable, generated straight-line by the launcher (the template holes): a
// private array indexed in a loop is spilled to slow memory on NVIDIA (docs/wgpu-notes.md#why-straight-line-wgsl).
// The k-major copies walk channels across neighbouring threads, so their rows are padded to odd vec4 strides.
// Causality: a masked score has probability exactly 0 (NEG in the forward: key tile 0 always holds key
// 0 <= every row, so the running max is finite from the first tile on). Workgroups are dispatched longest
// first. Every sum runs in a fixed order and nothing uses atomics: same inputs, same bits.
// Bounds: every global read goes through at_X / lse2_at / delta_at (row < T, channel < D), every store is
// guarded, every shared index is in range by its loop bounds, and the launchers check every binding's size:
// the module is safe to build without naga's runtime checks (DDL_WGPU_TRUSTED, `gpu.TRUSTED_FILES`).

// generated from its description in ddl_wgpu/ops/attention_fused.py (`Uniform`)
{{struct Params}}

const D: u32 = {{D}}u;
const WX: u32 = {{WX}}u;  // threads along columns (scores) / channel groups (row products)
const WY: u32 = {{WY}}u;  // threads along rows
const NT: u32 = WX * WY;
const BQ: u32 = {{BQ}}u;  // rows per workgroup = WY * TM
const BK: u32 = {{BK}}u;  // columns per tile = WX * TN
const DK: u32 = {{DK}}u;  // channels per staged chunk of a score product's operands
const BJ: u32 = {{BJ}}u;  // rows per staged chunk of a row product's right operand
const UNROLL: u32 = {{UNROLL}}u;  // inner steps generated per loop trip (constant shared offsets); divides DK, BJ
const SQ: u32 = BQ / 4u + 1u;  // odd vec4 strides of the k-major chunks
const SK: u32 = BK / 4u + 1u;
const KOFF: u32 = DK * SQ;  // the column operand follows the row operand in `stage`
const SV: u32 = {{SV}}u;  // vec4s per staged row of a row product: WX * ceil(ceil(D/4) / WX), zero past D
const SP: u32 = BQ / 4u + 1u;
const NEG: f32 = -3.0e38;  // "minus infinity" for masked scores: exp2(NEG - m) == 0
const LN2: f32 = 0.6931471805599453;
const LOG2E: f32 = 1.4426950408889634;

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> k: array<f32>;
@group(0) @binding(3) var<storage, read> v: array<f32>;
// forward
@group(0) @binding(4) var<storage, read_write> fout: array<f32>;
@group(0) @binding(5) var<storage, read_write> flse: array<f32>;
// backward
@group(0) @binding(4) var<storage, read> gdout: array<f32>;
@group(0) @binding(5) var<storage, read> glse: array<f32>;
@group(0) @binding(6) var<storage, read> gdelta: array<f32>;
@group(0) @binding(7) var<storage, read_write> gdq: array<f32>;
@group(0) @binding(7) var<storage, read_write> gdk: array<f32>;
@group(0) @binding(8) var<storage, read_write> gdv: array<f32>;

var<workgroup> stage: array<vec4<f32>, {{STAGE}}>;  // max(DK * (SQ + SK), BJ * SV)
var<workgroup> ps: array<vec4<f32>, BK * SP>;  // ps[j * SP + iv] = W[4iv .. 4iv + 3][j]
var<workgroup> red: array<f32, BQ * WX>;  // the forward's per-row partials of WX threads: row * WX + tx

fn max4(a: vec4<f32>) -> f32 {
    return max(max(a.x, a.y), max(a.z, a.w));
}

fn sum4(a: vec4<f32>) -> f32 {
    return (a.x + a.y) + (a.z + a.w);
}

// Per binding X of q, k, v, dout (generated; WGSL cannot pass a storage array):
//   at_X(base, stride, row, d): one element, 0 past T or D;
//   rows_X(base, stride, r0, d0, lid) / cols_X(...): channels d0 .. d0 + DK of rows r0 .. r0 + BQ (or BK) into
//     `stage`, k-major (slot i: channel i % DK, vec4 row group i / DK: consecutive threads read consecutive
//     channels of a row);
//   chunk_X(base, stride, j0, lid): rows j0 .. j0 + BJ into `stage`, row-major (stage[j * SV + c] =
//     X[j0 + j][4c .. 4c + 3]).
{{HELPERS}}

@compute @workgroup_size(NT)
fn attention_fused_forward(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let w = wid.x + wid.y * nwg.x;
    let nq = (P.T + BQ - 1u) / BQ;
    if (w >= P.B * P.H * nq) {  // uniform over the workgroup
        return;
    }
    let qt = nq - 1u - w % nq;  // longest query tiles first
    let bh = w / nq;
    let b = bh / P.H;
    let h = bh % P.H;
    let kh = h / (P.H / P.KH);
    let q0 = qt * BQ;
    let qbase = (b * P.T * P.H + h) * D;
    let kbase = (b * P.T * P.KH + kh) * D;
    let qs = P.H * D;  // row strides
    let ks = P.KH * D;
    let tx = lid % WX;
    let ty = lid / WX;
    let c2 = P.scale * LOG2E;  // scores in base 2
    let last = min(q0 + BQ - 1u, P.T - 1u) / BK;  // the last key tile with a key <= some row of this tile

{{FW_DECL}}
    for (var kt = 0u; kt <= last; kt++) {
        let k0 = kt * BK;
{{FW_S_ZERO}}
        for (var d0 = 0u; d0 < D; d0 += DK) {
            workgroupBarrier();  // the previous users of `stage` are done
            rows_q(qbase, qs, q0, d0, lid);
            cols_k(kbase, ks, k0, d0, lid);
            workgroupBarrier();
            for (var dd = 0u; dd < DK; dd += UNROLL) {  // UNROLL channels per trip, d = dd + c
{{FW_S_STEP}}
            }
        }
        // scale, mask (keys past the row or past T), and this thread's part of each row's max
{{FW_MASK}}
        workgroupBarrier();
{{FW_SOFTMAX}}
        for (var j0 = 0u; j0 < BK; j0 += BJ) {
            if (k0 + j0 <= q0 + BQ - 1u) {  // chunks wholly above the diagonal hold only zeros of P
                workgroupBarrier();  // P is in `ps`; the previous users of `stage` are done
                chunk_v(kbase, ks, k0 + j0, lid);
                workgroupBarrier();
                for (var jj = 0u; jj < BJ; jj += UNROLL) {  // j = jj + c
{{FW_PV_STEP}}
                }
            }
        }
    }
    // the row sums: each thread's partials meet in `red` (its last reads were before the barriers above)
{{FW_L_PUT}}
    workgroupBarrier();
{{FW_STORE}}
}

@compute @workgroup_size(NT)
fn attention_fused_backward_dq(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let w = wid.x + wid.y * nwg.x;
    let nq = (P.T + BQ - 1u) / BQ;
    if (w >= P.B * P.H * nq) {
        return;
    }
    let qt = nq - 1u - w % nq;
    let bh = w / nq;
    let b = bh / P.H;
    let h = bh % P.H;
    let kh = h / (P.H / P.KH);
    let q0 = qt * BQ;
    let qbase = (b * P.T * P.H + h) * D;
    let kbase = (b * P.T * P.KH + kh) * D;
    let qs = P.H * D;
    let ks = P.KH * D;
    let tx = lid % WX;
    let ty = lid / WX;
    let c2 = P.scale * LOG2E;
    let last = min(q0 + BQ - 1u, P.T - 1u) / BK;

{{DQ_DECL}}
    for (var kt = 0u; kt <= last; kt++) {
        let k0 = kt * BK;
{{DQ_S_ZERO}}
        for (var d0 = 0u; d0 < D; d0 += DK) {  // S = Q K^T
            workgroupBarrier();
            rows_q(qbase, qs, q0, d0, lid);
            cols_k(kbase, ks, k0, d0, lid);
            workgroupBarrier();
            for (var dd = 0u; dd < DK; dd += UNROLL) {  // UNROLL channels per trip, d = dd + c
{{DQ_S_STEP}}
            }
        }
        for (var d0 = 0u; d0 < D; d0 += DK) {  // dP = dO V^T
            workgroupBarrier();
            rows_dout(qbase, qs, q0, d0, lid);
            cols_v(kbase, ks, k0, d0, lid);
            workgroupBarrier();
            for (var dd = 0u; dd < DK; dd += UNROLL) {  // UNROLL channels per trip, d = dd + c
{{DQ_DP_STEP}}
            }
        }
        // P and dS = P (dP - delta) into `ps` (its last readers finished before the barriers above)
{{DQ_DS}}
        for (var j0 = 0u; j0 < BK; j0 += BJ) {
            if (k0 + j0 <= q0 + BQ - 1u) {
                workgroupBarrier();
                chunk_k(kbase, ks, k0 + j0, lid);
                workgroupBarrier();
                for (var jj = 0u; jj < BJ; jj += UNROLL) {  // j = jj + c
{{DQ_PV_STEP}}
                }
            }
        }
    }
{{DQ_STORE}}
}

@compute @workgroup_size(NT)
fn attention_fused_backward_dkdv(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let w = wid.x + wid.y * nwg.x;
    let nk = (P.T + BQ - 1u) / BQ;
    if (w >= P.B * P.KH * nk) {
        return;
    }
    let kt = w % nk;  // key tile 0 sees every query tile: longest first
    let bkh = w / nk;
    let b = bkh / P.KH;
    let kh = bkh % P.KH;
    let G = P.H / P.KH;
    let k0 = kt * BQ;
    let kbase = (b * P.T * P.KH + kh) * D;
    let qs = P.H * D;
    let ks = P.KH * D;
    let tx = lid % WX;
    let ty = lid / WX;
    let c2 = P.scale * LOG2E;
    let nc = (P.T + BK - 1u) / BK;

{{KV_DECL}}
    for (var g = 0u; g < G; g++) {
        let h = kh * G + g;
        let qbase = (b * P.T * P.H + h) * D;
        let lbase = (b * P.H + h) * P.T;
        for (var ct = k0 / BK; ct < nc; ct++) {  // query tiles holding a query >= some key of this tile
            let c0 = ct * BK;
{{KV_S_ZERO}}
            for (var d0 = 0u; d0 < D; d0 += DK) {  // S^T = K Q^T
                workgroupBarrier();
                rows_k(kbase, ks, k0, d0, lid);
                cols_q(qbase, qs, c0, d0, lid);
                workgroupBarrier();
                for (var dd = 0u; dd < DK; dd += UNROLL) {  // UNROLL channels per trip, d = dd + c
{{KV_S_STEP}}
                }
            }
            for (var d0 = 0u; d0 < D; d0 += DK) {  // dP^T = V dO^T
                workgroupBarrier();
                rows_v(kbase, ks, k0, d0, lid);
                cols_dout(qbase, qs, c0, d0, lid);
                workgroupBarrier();
                for (var dd = 0u; dd < DK; dd += UNROLL) {  // UNROLL channels per trip, d = dd + c
{{KV_DP_STEP}}
                }
            }
            // P^T into `ps` (kept in s for dS^T below), dV += P^T dO
{{KV_P}}
            for (var j0 = 0u; j0 < BK; j0 += BJ) {
                if (c0 + j0 + BJ - 1u >= k0 && c0 + j0 < P.T) {  // queries >= some key, and < T
                    workgroupBarrier();
                    chunk_dout(qbase, qs, c0 + j0, lid);
                    workgroupBarrier();
                    for (var jj = 0u; jj < BJ; jj += UNROLL) {  // j = jj + c
{{KV_DV_STEP}}
                    }
                }
            }
            workgroupBarrier();  // every thread is done with P^T in `ps`
{{KV_DS}}
            for (var j0 = 0u; j0 < BK; j0 += BJ) {
                if (c0 + j0 + BJ - 1u >= k0 && c0 + j0 < P.T) {
                    workgroupBarrier();
                    chunk_q(qbase, qs, c0 + j0, lid);
                    workgroupBarrier();
                    for (var jj = 0u; jj < BJ; jj += UNROLL) {  // j = jj + c
{{KV_DK_STEP}}
                    }
                }
            }
        }
    }
{{KV_STORE}}
}
