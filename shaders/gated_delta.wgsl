// The gated delta rule of a Gated DeltaNet layer (Qwen3.5's "linear attention"), forward and backward.
// Reference: `ddl_ref.gdn`; the math: docs/model.md#gated-deltanet; the design:
// docs/kernels.md#the-gated-delta-rule. Two forms: the chunked kernels below the line (training and every
// whole-sequence forward) and the per-token forward here (a decoder's few rows, whose every row's state it
// can keep).
//
// Per batch row b and value head h (its key head hk = h / (Hv / Hk)), a state S (Dk x Dv), zero or given at
// t = 0, runs over the row's T tokens:
//     a = exp(g_t);  u = a S^T k_t;  r_t = v_t - u;  S <- a S + k_t (beta_t r_t)^T;  o_t = S^T q_t
// (q, k already L2-normalised, q scaled by 1/sqrt(Dk)).
//
// gated_delta_forward (qkgb, v, state_in, o, r, states, p): one workgroup per (b, h) walks t in order; its
// TI x TJ threads share the state: thread (ti, tj) keeps the PI x PJ elements S[i_a, j_b], i_a = ti + TI*a,
// j_b = tj + TJ*b, in registers (generated straight-line code, `s_a_b`; rows >= Dk and columns >= Dv are
// padding that stays 0). A column sum (S^T k, S^T q) is one fixed-order pass through workgroup memory, so
// results are the same bits every run; 3 barriers per token. o = the outputs; r = v - u; states: the state
// before every chunk of `tc` tokens (slots 0..nck-1, when save_ckpt) and the final state (slot nck, when
// save_final): with tc = 1, every row's.
//
// Layouts (floats; rows n = b*T + t): one read-only buffer `qkgb` holds q[n, hk, i] at (n*Hk + hk)*Dk + i,
// k at k_off + the same, and g, beta at gb_off + (n*Hv + h)*2 (+ 1) (three parts written by other kernels,
// bound once: WebGPU's 8 storage buffers per stage); v[n, h, j] = v[v_off + n*v_stride + h*Dv + j] (the v
// columns of the conv output; dv is written the same way into its gradient); o, r, do: [(n*Hv + h)*Dv + j];
// states[((b*Hv + h)*(nck + 1) + c)*Dk*Dv + i*Dv + j]; dq[(n*Hv + h)*Dk + i], dk at dqk[dk_off + same].

const TI: u32 = {{TI}}u;  // thread rows (over Dk)
const TJ: u32 = {{TJ}}u;  // thread columns (over Dv)
const DVP: u32 = {{DVP}}u;  // TJ * PJ: Dv padded
const NT: u32 = TI * TJ;

// generated from its description in ddl_wgpu/ops/gated_delta.py (`Uniform`)
{{struct Params}}

var<workgroup> red_c: array<f32, TI * DVP>;  // column partials: [ti][j]
var<workgroup> red_o: array<f32, TI * DVP>;  // the second column partials (o), so no 4th barrier
var<workgroup> vec_c: array<f32, DVP>;  // a reduced column vector (u)

fn group_index(wid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return wid.x + wid.y * nwg.x;
}


// ---------------------------------------------------------------------------------------------------------
// forward

@group(0) @binding(0) var<storage, read> f_qk: array<f32>;
@group(0) @binding(1) var<storage, read> f_v: array<f32>;
@group(0) @binding(2) var<storage, read> f_state_in: array<f32>;
@group(0) @binding(3) var<storage, read_write> f_o: array<f32>;
@group(0) @binding(4) var<storage, read_write> f_r: array<f32>;
@group(0) @binding(5) var<storage, read_write> f_states: array<f32>;
@group(0) @binding(6) var<uniform> f_p: Params;

fn f_ldq(n: u32, hk: u32, i: u32) -> f32 {
    if (i >= f_p.Dk) { return 0.0; }
    return f_qk[(n * f_p.Hk + hk) * f_p.Dk + i];
}
fn f_ldk(n: u32, hk: u32, i: u32) -> f32 {
    if (i >= f_p.Dk) { return 0.0; }
    return f_qk[f_p.k_off + (n * f_p.Hk + hk) * f_p.Dk + i];
}
fn f_ldv(n: u32, h: u32, j: u32) -> f32 {
    if (j >= f_p.Dv) { return 0.0; }
    return f_v[f_p.v_off + n * f_p.v_stride + h * f_p.Dv + j];
}
fn f_ldinit(bh: u32, i: u32, j: u32) -> f32 {
    if (f_p.has_init == 0u || i >= f_p.Dk || j >= f_p.Dv) { return 0.0; }
    return f_state_in[bh * f_p.Dk * f_p.Dv + i * f_p.Dv + j];
}
fn f_store(slot: u32, i: u32, j: u32, x: f32) {
    if (i < f_p.Dk && j < f_p.Dv) { f_states[slot * f_p.Dk * f_p.Dv + i * f_p.Dv + j] = x; }
}

@compute @workgroup_size(TI * TJ)
fn gated_delta_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                       @builtin(local_invocation_index) lid: u32) {
    let bh = group_index(wid, nwg);
    if (bh >= f_p.B * f_p.Hv) { return; }
    let b = bh / f_p.Hv;
    let h = bh - b * f_p.Hv;
    let hk = h / (f_p.Hv / f_p.Hk);
    let ti = lid / TJ;
    let tj = lid - ti * TJ;
    let slots = bh * (f_p.nck + 1u);
    {{F_INIT}}
    for (var t = 0u; t < f_p.T; t++) {
        let n = b * f_p.T + t;
        if (f_p.save_ckpt != 0u && t % f_p.tc == 0u) {
            let slot = slots + t / f_p.tc;
            {{F_STORE}}
        }
        let at = exp(f_qk[f_p.gb_off + (n * f_p.Hv + h) * 2u]);
        let bt = f_qk[f_p.gb_off + (n * f_p.Hv + h) * 2u + 1u];
        {{F_LOAD_K}}
        {{F_PARTIAL_U}}
        workgroupBarrier();
        for (var c = lid; c < DVP; c += NT) {
            var acc = 0.0;
            for (var x = 0u; x < TI; x++) { acc += red_c[x * DVP + c]; }
            vec_c[c] = acc;
        }
        workgroupBarrier();
        {{F_UPDATE}}
        {{F_PARTIAL_O}}
        workgroupBarrier();
        for (var c = lid; c < f_p.Dv; c += NT) {
            var acc = 0.0;
            for (var x = 0u; x < TI; x++) { acc += red_o[x * DVP + c]; }
            f_o[(n * f_p.Hv + h) * f_p.Dv + c] = acc;
        }
    }
    if (f_p.save_final != 0u) {
        let slot = slots + f_p.nck;
        {{F_STORE}}
    }
}

// =========================================================================================================
// The chunked form (`ddl_ref.gdn.gated_delta_chunked_forward` / `gated_delta_chunked_backward`, whose
// docstrings hold the math; docs/kernels.md#the-chunked-form). The T tokens of a row are cut into chunks of
// CC; per chunk (γ the cumulative log decay within it, Γ = exp(γ), L its last token, tokens past T padded
// with k = q = v = 0, g = 0, beta = 0, which changes nothing):
//
//   chunk_prep            (qkgb, tp, p)     one workgroup per (b, h, chunk), independent of the state:
//       tp[chunk] = [Tm, P, MKK] (each CC x CC, row-major): MKK = M ∘ K Kᵀ strictly below the diagonal,
//       P = M ∘ Q Kᵀ, Tm = (I + diag(beta) MKK)⁻¹ (blocks of TB: the diagonal ones by forward substitution,
//       a column per thread, then a block row at a time by products).
//   chunk_forward         (qkgb, v, state_in, tp, o, delta, states, p)   one workgroup per (b, h, BV value
//       columns), the chunks in order, the state's Dk x BV block in registers (a copy in workgroup memory
//       for the products that read it):
//           X_K, X_Q = K S, Q S;  R = beta (V - Γ X_K);  Δ = Tm R;  O = Γ X_Q + P Δ;  S <- Γ_L S + K̃ᵀ Δ
//       delta = Δ and states = the state before each chunk (with save_ckpt: what the backward reads),
//       slot nck the final state (save_final).
//   chunk_backward_state  (qkgb, do, scr, p)   one workgroup per (b, h, BV value columns), chunks in
//       reverse, dS in registers: scr's ds part gets dS at each chunk's end, its dr part dR:
//           dΔ = Pᵀ dO + K̃ dS;  dR = Tmᵀ dΔ;  dS <- Γ_L dS - Kᵀ (beta Γ dR) + Qᵀ (Γ dO)
//   chunk_backward_grads  (qkgb, v, do, delta, states, scr, dqk, dv, p)   one workgroup per (b, h, chunk):
//       dP, dA from [dO; dR] Δᵀ with P, MKK (tp); dq, dk = the intra-chunk products, then the products
//       with the chunk's start state (states) and end gradient (scr's ds): Z = dR S0ᵀ, Y = dO S0ᵀ,
//       dK̃ = Δ dSᵀ; dv = beta dR; per token dg (the reverse cumulative sum of dγ) and dbeta into scr's dg
//       part as (rows, Hv, 2).
//
// All sums run in a fixed order (no atomics): the same bits every run. Workgroup memory of each kernel is
// one array carved at constant offsets (generated: ddl_wgpu/ops/gated_delta.py `ChunkPlan`); rows written
// transposed are padded to odd strides. scr = [tp | dr | ds | dg] at the uniform's offsets (one binding,
// as each kernel may bind 8 storage buffers). A call runs batch rows b0 .. b0 + B - 1 (where one row's
// buffers would not fit a binding, the launcher makes several calls): token buffers (qkgb, v, o, delta,
// do, dqk, dv, dg) are indexed by the batch row b, the per-chunk ones (tp, states, state_in, dr, ds) by the
// call's own row bl = b - b0 (the launcher binds views of states and state_in at row b0).

const CC: u32 = {{CC}}u;  // tokens per chunk
const CDK: u32 = {{CDK}}u;  // Dk padded to a power of two
const CDV: u32 = {{CDV}}u;  // Dv padded
const BV: u32 = {{BV}}u;  // value columns per workgroup of the sequential kernels
const NVB: u32 = CDV / BV;
const CNT: u32 = {{CNT}}u;  // threads per workgroup of the sequential kernels (chunk_forward, chunk_backward_state)
const CNTP: u32 = {{CNTP}}u;  // ... and of the per-chunk ones (chunk_prep, chunk_backward_grads)
const BR: u32 = {{BR}}u;  // rows of an operand staged into workgroup memory at a time
const CC2: u32 = CC * CC;
const TB: u32 = {{TB}}u;  // the prep's blocks of Tm (rows and columns)
{{CHUNK_CONSTS}}  // workgroup-memory offsets of each chunked kernel's parts (floats)

var<workgroup> c_g: array<f32, CC>;  // the chunk's log decays g
var<workgroup> c_gam: array<f32, CC>;  // γ: their cumulative sum within the chunk
var<workgroup> c_bet: array<f32, CC>;  // beta

fn c_cumsum(lid: u32) {
    // after c_g is filled (and a barrier): each thread sums its prefix in order (deterministic)
    if (lid < CC) {
        var acc = 0.0;
        for (var s = 0u; s <= lid; s++) { acc += c_g[s]; }
        c_gam[lid] = acc;
    }
}

fn c_decay(t: u32, s: u32) -> f32 {
    // M_ts = exp(γ_t - γ_s) for s <= t, else 0 (the exponent is never positive where it is used)
    if (s > t) { return 0.0; }
    return exp(c_gam[t] - c_gam[s]);
}


// ---------------------------------------------------------------------------------------------------------
// chunk_prep

@group(0) @binding(0) var<storage, read> cp_qk: array<f32>;
@group(0) @binding(1) var<storage, read_write> cp_tp: array<f32>;
@group(0) @binding(2) var<uniform> cp_p: Params;
var<workgroup> cp_sm: array<f32, {{CP_SM}}>;

fn cp_ld(part: u32, b: u32, t: u32, hk: u32, i: u32) -> f32 {
    // part 0: q, 1: k
    if (t >= cp_p.T || i >= cp_p.Dk) { return 0.0; }
    return cp_qk[part * cp_p.k_off + ((b * cp_p.T + t) * cp_p.Hk + hk) * cp_p.Dk + i];
}

@compute @workgroup_size(CNTP)
fn chunk_prep(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let id = group_index(wid, nwg);
    if (id >= cp_p.B * cp_p.Hv * cp_p.nck) { return; }
    let bh = id / cp_p.nck;
    let c = id - bh * cp_p.nck;
    let bl = bh / cp_p.Hv;  // the batch row within this call's rows
    let b = bl + cp_p.b0;  // ... and within the whole batch (token buffers)
    let h = bh - bl * cp_p.Hv;
    let hk = h / (cp_p.Hv / cp_p.Hk);
    let t0 = c * CC;
    let base = id * 3u * CC2;
    {{CP_COORDS}}
    if (lid < CC) {
        let t = t0 + lid;
        var g = 0.0;
        var be = 0.0;
        if (t < cp_p.T) {
            let at = cp_p.gb_off + ((b * cp_p.T + t) * cp_p.Hv + h) * 2u;
            g = cp_qk[at];
            be = cp_qk[at + 1u];
        }
        c_g[lid] = g;
        c_bet[lid] = be;
    }
    workgroupBarrier();
    c_cumsum(lid);
    // K Kᵀ and Q Kᵀ over Dk in steps of BR: staged transposed, [k rows; q rows] of each i
    {{CP_DECL}}
    for (var i0 = 0u; i0 < CDK; i0 += BR) {
        workgroupBarrier();
        for (var e = lid; e < 2u * CC * BR; e += CNTP) {
            let m = e / BR;
            let r = e - m * BR;
            cp_sm[CP_STG + r * (2u * CC + 1u) + m] = cp_ld(select(0u, 1u, m < CC), b, t0 + m % CC, hk, i0 + r);
        }
        workgroupBarrier();
        {{CP_FMA}}
    }
    workgroupBarrier();
    {{CP_MATS}}
    workgroupBarrier();
    // Tm = (I + A)⁻¹, A = diag(beta) MKK, by TB x TB blocks: each diagonal block's inverse by forward
    // substitution (a column per thread, reading only its own column), then block row by block row
    // Tm_ij = -Tm_ii Σ_{j <= k < i} A_ik Tm_kj (blocks j < i), the sums in a fixed order
    if (lid < CC) {
        let j = lid;
        let d0 = (j / TB) * TB;
        for (var t = 0u; t < d0; t++) { cp_sm[CP_T + t * (CC + 1u) + j] = 0.0; }
        for (var t = d0; t < d0 + TB; t++) {
            var x = select(0.0, 1.0, t == j);
            for (var s = j; s < t; s++) {
                x -= cp_sm[CP_A + t * (CC + 1u) + s] * cp_sm[CP_T + s * (CC + 1u) + j];
            }
            cp_sm[CP_T + t * (CC + 1u) + j] = x;
        }
    }
    for (var ib = 1u; ib < CC / TB; ib++) {
        workgroupBarrier();
        let i0 = ib * TB;
        for (var e = lid; e < i0 * TB; e += CNTP) {  // X = Σ_k A_ik Tm_kj for every block j < i
            let r = e / i0;
            let col = e - r * i0;
            var acc = 0.0;
            for (var k = col; k < i0; k++) {
                acc += cp_sm[CP_A + (i0 + r) * (CC + 1u) + k] * cp_sm[CP_T + k * (CC + 1u) + col];
            }
            cp_sm[CP_X + e] = acc;
        }
        workgroupBarrier();
        for (var e = lid; e < i0 * TB; e += CNTP) {  // Tm_ij = -Tm_ii X
            let r = e / i0;
            let col = e - r * i0;
            var acc = 0.0;
            for (var k = 0u; k <= r; k++) {
                acc += cp_sm[CP_T + (i0 + r) * (CC + 1u) + i0 + k] * cp_sm[CP_X + k * i0 + col];
            }
            cp_sm[CP_T + (i0 + r) * (CC + 1u) + col] = -acc;
        }
    }
    workgroupBarrier();
    for (var e = lid; e < CC2; e += CNTP) {
        let t = e / CC;
        cp_tp[base + e] = cp_sm[CP_T + t * (CC + 1u) + e - t * CC];
    }
}


// ---------------------------------------------------------------------------------------------------------
// chunk_forward

@group(0) @binding(0) var<storage, read> cf_qk: array<f32>;
@group(0) @binding(1) var<storage, read> cf_v: array<f32>;
@group(0) @binding(2) var<storage, read> cf_init: array<f32>;
@group(0) @binding(3) var<storage, read> cf_tp: array<f32>;
@group(0) @binding(4) var<storage, read_write> cf_o: array<f32>;
@group(0) @binding(5) var<storage, read_write> cf_d: array<f32>;
@group(0) @binding(6) var<storage, read_write> cf_states: array<f32>;
@group(0) @binding(7) var<uniform> cf_p: Params;
var<workgroup> cf_sm: array<f32, {{CF_SM}}>;

fn cf_ld(part: u32, b: u32, t: u32, hk: u32, i: u32) -> f32 {
    if (t >= cf_p.T || i >= cf_p.Dk) { return 0.0; }
    return cf_qk[part * cf_p.k_off + ((b * cf_p.T + t) * cf_p.Hk + hk) * cf_p.Dk + i];
}
fn cf_ldv(b: u32, t: u32, h: u32, j: u32) -> f32 {
    if (t >= cf_p.T || j >= cf_p.Dv) { return 0.0; }
    return cf_v[cf_p.v_off + (b * cf_p.T + t) * cf_p.v_stride + h * cf_p.Dv + j];
}
fn cf_ldinit(bh: u32, i: u32, j: u32) -> f32 {
    if (cf_p.has_init == 0u || i >= cf_p.Dk || j >= cf_p.Dv) { return 0.0; }
    return cf_init[(bh * cf_p.Dk + i) * cf_p.Dv + j];
}
fn cf_store_state(slot: u32, i: u32, j: u32, x: f32) {
    if (i < cf_p.Dk && j < cf_p.Dv) { cf_states[(slot * cf_p.Dk + i) * cf_p.Dv + j] = x; }
}

@compute @workgroup_size(CNT)
fn chunk_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_index) lid: u32) {
    let id = group_index(wid, nwg);
    if (id >= cf_p.B * cf_p.Hv * NVB) { return; }
    let bh = id / NVB;
    let j0 = (id - bh * NVB) * BV;
    let bl = bh / cf_p.Hv;  // the batch row within this call's rows
    let b = bl + cf_p.b0;  // ... and within the whole batch (token buffers)
    let h = bh - bl * cf_p.Hv;
    let hk = h / (cf_p.Hv / cf_p.Hk);
    let slots = bh * (cf_p.nck + 1u);
    {{CF_COORDS}}
    {{CF_S_INIT}}
    for (var c = 0u; c < cf_p.nck; c++) {
        let t0 = c * CC;
        let tbase = (bh * cf_p.nck + c) * 3u * CC2;
        if (cf_p.save_ckpt != 0u) {
            {{CF_S_STORE}}
        }
        if (lid < CC) {
            let t = t0 + lid;
            var g = 0.0;
            var be = 0.0;
            if (t < cf_p.T) {
                let at = cf_p.gb_off + ((b * cf_p.T + t) * cf_p.Hv + h) * 2u;
                g = cf_qk[at];
                be = cf_qk[at + 1u];
            }
            c_g[lid] = g;
            c_bet[lid] = be;
        }
        workgroupBarrier();
        c_cumsum(lid);
        // X_K = K S, X_Q = Q S over Dk in steps of BR (k and q staged transposed; S from its copy)
        {{CF_X_DECL}}
        {{CF_X_PF}}
        for (var i0 = 0u; i0 < CDK; i0 += BR) {
            workgroupBarrier();
            {{CF_X_STAGE}}
            workgroupBarrier();
            {{CF_X_NEXT}}
            {{CF_X_FMA}}
        }
        // R = beta (V - Γ X_K)
        {{CF_R}}
        // Δ = Tm R (Tm staged transposed)
        {{CF_D_DECL}}
        {{CF_D_PF}}
        for (var s0 = 0u; s0 < CC; s0 += BR) {
            workgroupBarrier();
            {{CF_D_STAGE}}
            workgroupBarrier();
            {{CF_D_NEXT}}
            {{CF_D_FMA}}
        }
        workgroupBarrier();
        {{CF_D_STORE}}
        // O = Γ X_Q + P Δ (P staged transposed)
        {{CF_O_INIT}}
        {{CF_O_PF}}
        for (var s0 = 0u; s0 < CC; s0 += BR) {
            workgroupBarrier();
            {{CF_O_STAGE}}
            workgroupBarrier();
            {{CF_O_NEXT}}
            {{CF_O_FMA}}
        }
        {{CF_O_STORE}}
        // S <- Γ_L S + K̃ᵀ Δ, K̃ = exp(γ_L - γ) K (rows staged as they are)
        {{CF_S_DECAY}}
        {{CF_S_PF}}
        for (var u0 = 0u; u0 < CC; u0 += BR) {
            workgroupBarrier();
            {{CF_S_STAGE}}
            workgroupBarrier();
            {{CF_S_NEXT}}
            {{CF_S_FMA}}
        }
        workgroupBarrier();
        {{CF_S_MIRROR}}
    }
    if (cf_p.save_final != 0u) {
        let c = cf_p.nck;
        {{CF_S_STORE}}
    }
}


// ---------------------------------------------------------------------------------------------------------
// chunk_backward_state

@group(0) @binding(0) var<storage, read> cb_qk: array<f32>;
@group(0) @binding(1) var<storage, read> cb_do: array<f32>;
@group(0) @binding(2) var<storage, read_write> cb_scr: array<f32>;
@group(0) @binding(3) var<uniform> cb_p: Params;
var<workgroup> cb_sm: array<f32, {{CB_SM}}>;

fn cb_ld(part: u32, b: u32, t: u32, hk: u32, i: u32) -> f32 {
    if (t >= cb_p.T || i >= cb_p.Dk) { return 0.0; }
    return cb_qk[part * cb_p.k_off + ((b * cb_p.T + t) * cb_p.Hk + hk) * cb_p.Dk + i];
}
fn cb_lddo(b: u32, t: u32, h: u32, j: u32) -> f32 {
    if (t >= cb_p.T || j >= cb_p.Dv) { return 0.0; }
    return cb_do[((b * cb_p.T + t) * cb_p.Hv + h) * cb_p.Dv + j];
}

@compute @workgroup_size(CNT)
fn chunk_backward_state(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                        @builtin(local_invocation_index) lid: u32) {
    let id = group_index(wid, nwg);
    if (id >= cb_p.B * cb_p.Hv * NVB) { return; }
    let bh = id / NVB;
    let j0 = (id - bh * NVB) * BV;
    let bl = bh / cb_p.Hv;  // the batch row within this call's rows
    let b = bl + cb_p.b0;  // ... and within the whole batch (token buffers)
    let h = bh - bl * cb_p.Hv;
    let hk = h / (cb_p.Hv / cb_p.Hk);
    {{CB_COORDS}}
    {{CB_S_INIT}}
    for (var cc = 0u; cc < cb_p.nck; cc++) {
        let c = cb_p.nck - 1u - cc;
        let t0 = c * CC;
        let tbase = (bh * cb_p.nck + c) * 3u * CC2;
        {{CB_S_STORE}}
        if (lid < CC) {
            let t = t0 + lid;
            var g = 0.0;
            var be = 0.0;
            if (t < cb_p.T) {
                let at = cb_p.gb_off + ((b * cb_p.T + t) * cb_p.Hv + h) * 2u;
                g = cb_qk[at];
                be = cb_qk[at + 1u];
            }
            c_g[lid] = g;
            c_bet[lid] = be;
        }
        for (var e = lid; e < CC * BV; e += CNT) {
            let t = e / BV;
            cb_sm[CB_DO + e] = cb_lddo(b, t0 + t, h, j0 + e - t * BV);
        }
        workgroupBarrier();
        c_cumsum(lid);
        // dΔ = Pᵀ dO (P's rows staged as they are) ...
        {{CB_DD_DECL}}
        {{CB_DD1_PF}}
        for (var s0 = 0u; s0 < CC; s0 += BR) {
            workgroupBarrier();
            {{CB_DD1_STAGE}}
            workgroupBarrier();
            {{CB_DD1_NEXT}}
            {{CB_DD_FMA1}}
        }
        // ... + K̃ dS (K̃ staged transposed)
        {{CB_DD2_PF}}
        for (var i0 = 0u; i0 < CDK; i0 += BR) {
            workgroupBarrier();
            {{CB_DD2_STAGE}}
            workgroupBarrier();
            {{CB_DD2_NEXT}}
            {{CB_DD_FMA2}}
        }
        workgroupBarrier();
        {{CB_DD_STORE}}
        // dR = Tmᵀ dΔ (Tm's rows staged as they are)
        {{CB_R_DECL}}
        {{CB_R_PF}}
        for (var s0 = 0u; s0 < CC; s0 += BR) {
            workgroupBarrier();
            {{CB_R_STAGE}}
            workgroupBarrier();
            {{CB_R_NEXT}}
            {{CB_R_FMA}}
        }
        workgroupBarrier();
        // dR out; the dΔ copy becomes -beta Γ dR, the dO copy Γ dO
        {{CB_R_STORE}}
        for (var e = lid; e < CC * BV; e += CNT) {
            cb_sm[CB_DO + e] = exp(c_gam[e / BV]) * cb_sm[CB_DO + e];
        }
        // dS <- Γ_L dS + Kᵀ (-beta Γ dR) + Qᵀ (Γ dO) (k and q rows staged as they are)
        {{CB_S_DECAY}}
        {{CB_S_PF}}
        for (var u0 = 0u; u0 < CC; u0 += BR) {
            workgroupBarrier();
            {{CB_S_STAGE}}
            workgroupBarrier();
            {{CB_S_NEXT}}
            {{CB_S_FMA}}
        }
        workgroupBarrier();
        {{CB_S_MIRROR}}
    }
}


// ---------------------------------------------------------------------------------------------------------
// chunk_backward_grads

@group(0) @binding(0) var<storage, read> cg_qk: array<f32>;
@group(0) @binding(1) var<storage, read> cg_v: array<f32>;
@group(0) @binding(2) var<storage, read> cg_do: array<f32>;
@group(0) @binding(3) var<storage, read> cg_d: array<f32>;
@group(0) @binding(4) var<storage, read> cg_states: array<f32>;
@group(0) @binding(5) var<storage, read_write> cg_scr: array<f32>;
@group(0) @binding(6) var<storage, read_write> cg_dqk: array<f32>;
@group(0) @binding(7) var<storage, read_write> cg_dv: array<f32>;
@group(0) @binding(8) var<uniform> cg_p: Params;
var<workgroup> cg_sm: array<f32, {{CG_SM}}>;
var<workgroup> cg_dgam: array<f32, CC>;  // dγ per token, summed over the phases
var<workgroup> cg_dbet: array<f32, CC>;  // dbeta per token
var<workgroup> cg_last: f32;  // Σ K̃·dK̃ over the chunk (its last token's dγ gets it)

fn cg_ld(part: u32, b: u32, t: u32, hk: u32, i: u32) -> f32 {
    if (t >= cg_p.T || i >= cg_p.Dk) { return 0.0; }
    return cg_qk[part * cg_p.k_off + ((b * cg_p.T + t) * cg_p.Hk + hk) * cg_p.Dk + i];
}
fn cg_row(part: u32, b: u32, t: u32, h: u32, j: u32) -> f32 {
    // part 0: dO, 1: dR, 2: Δ (rows (n, Hv, Dv)); b the batch row (dR's rows are this call's: b - b0)
    if (t >= cg_p.T || j >= cg_p.Dv) { return 0.0; }
    if (part == 1u) { return cg_scr[cg_p.dr_off + (((b - cg_p.b0) * cg_p.T + t) * cg_p.Hv + h) * cg_p.Dv + j]; }
    let at = ((b * cg_p.T + t) * cg_p.Hv + h) * cg_p.Dv + j;
    if (part == 0u) { return cg_do[at]; }
    return cg_d[at];
}
fn cg_ldstate(part: u32, bh: u32, c: u32, i: u32, j: u32) -> f32 {
    // part 0: the state before chunk c (the forward's checkpoint), 1: dS at its end
    if (i >= cg_p.Dk || j >= cg_p.Dv) { return 0.0; }
    if (part == 0u) { return cg_states[((bh * (cg_p.nck + 1u) + c) * cg_p.Dk + i) * cg_p.Dv + j]; }
    return cg_scr[cg_p.ds_off + ((bh * cg_p.nck + c) * cg_p.Dk + i) * cg_p.Dv + j];
}
fn cg_dqk_at(part: u32, b: u32, t: u32, h: u32, i: u32) -> u32 {
    return part * cg_p.dk_off + ((b * cg_p.T + t) * cg_p.Hv + h) * cg_p.Dk + i;
}
fn cg_ok(t: u32, i: u32) -> bool {
    return t < cg_p.T && i < cg_p.Dk;
}

@compute @workgroup_size(CNTP)
fn chunk_backward_grads(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                        @builtin(local_invocation_index) lid: u32) {
    let id = group_index(wid, nwg);
    if (id >= cg_p.B * cg_p.Hv * cg_p.nck) { return; }
    let bh = id / cg_p.nck;
    let c = id - bh * cg_p.nck;
    let bl = bh / cg_p.Hv;  // the batch row within this call's rows
    let b = bl + cg_p.b0;  // ... and within the whole batch (token buffers)
    let h = bh - bl * cg_p.Hv;
    let hk = h / (cg_p.Hv / cg_p.Hk);
    let t0 = c * CC;
    let tbase = id * 3u * CC2;
    {{CG_COORDS}}
    if (lid < CC) {
        let t = t0 + lid;
        var g = 0.0;
        var be = 0.0;
        if (t < cg_p.T) {
            let at = cg_p.gb_off + ((b * cg_p.T + t) * cg_p.Hv + h) * 2u;
            g = cg_qk[at];
            be = cg_qk[at + 1u];
        }
        c_g[lid] = g;
        c_bet[lid] = be;
    }
    // P and MKK of the chunk (from chunk_prep)
    for (var e = lid; e < CC2; e += CNTP) {
        let t = e / CC;
        let s = e - t * CC;
        cg_sm[CG_P + t * (CC + 1u) + s] = cg_scr[tbase + CC2 + e];
        cg_sm[CG_A + t * (CC + 1u) + s] = cg_scr[tbase + 2u * CC2 + e];
    }
    workgroupBarrier();
    c_cumsum(lid);
    // dP = dO Δᵀ and -dA = dR Δᵀ over Dv ([dO; dR] and Δ staged transposed)
    {{CG_E_DECL}}
    for (var j0 = 0u; j0 < CDV; j0 += BR) {
        workgroupBarrier();
        for (var e = lid; e < 2u * CC * BR; e += CNTP) {
            let m = e / BR;
            let r = e - m * BR;
            cg_sm[CG_STG + r * (2u * CC + 1u) + m] = cg_row(select(0u, 1u, m >= CC), b, t0 + m % CC, h, j0 + r);
        }
        for (var e = lid; e < CC * BR; e += CNTP) {
            let s = e / BR;
            let r = e - s * BR;
            cg_sm[CG_STG2 + r * (CC + 1u) + s] = cg_row(2u, b, t0 + s, h, j0 + r);
        }
        workgroupBarrier();
        {{CG_E_FMA}}
    }
    workgroupBarrier();
    // dQK = dP ∘ M and dKK = dA ∘ diag(beta) M in place of P and MKK; dP ∘ P + dA ∘ A summed by rows and
    // by columns into dγ, dA ∘ MKK by rows into dbeta
    {{CG_E_ELEM}}
    // dKK + dKKᵀ in place: dKK is strictly lower, so its upper triangle takes the transpose
    for (var e = lid; e < CC2; e += CNTP) {
        let t = e / CC;
        let s = e - t * CC;
        if (s > t) { cg_sm[CG_A + t * (CC + 1u) + s] = cg_sm[CG_A + s * (CC + 1u) + t]; }
    }
    workgroupBarrier();
    // dq = dQK K, dk = dQKᵀ Q + (dKK + dKKᵀ) K over the chunk's tokens (k, q rows staged as they are)
    {{CG_Q_DECL}}
    for (var u0 = 0u; u0 < CC; u0 += BR) {
        workgroupBarrier();
        for (var e = lid; e < BR * CDK; e += CNTP) {
            let r = e / CDK;
            let i = e - r * CDK;
            cg_sm[CG_STG + e] = cg_ld(1u, b, t0 + u0 + r, hk, i);
            cg_sm[CG_STG + BR * CDK + e] = cg_ld(0u, b, t0 + u0 + r, hk, i);
        }
        workgroupBarrier();
        {{CG_Q_FMA}}
    }
    {{CG_Q_STORE}}
    // Z = dR S0ᵀ, Y = dO S0ᵀ over Dv ([dR; dO] and S0 staged transposed; P and MKK are no longer needed)
    {{CG_Z_DECL}}
    for (var j0 = 0u; j0 < CDV; j0 += BR) {
        workgroupBarrier();
        for (var e = lid; e < 2u * CC * BR; e += CNTP) {
            let m = e / BR;
            let r = e - m * BR;
            cg_sm[CG_ZA + r * (2u * CC + 1u) + m] = cg_row(select(1u, 0u, m >= CC), b, t0 + m % CC, h, j0 + r);
        }
        for (var e = lid; e < CDK * BR; e += CNTP) {
            let i = e / BR;
            let r = e - i * BR;
            cg_sm[CG_ZB + r * (CDK + 1u) + i] = cg_ldstate(0u, bh, c, i, j0 + r);
        }
        workgroupBarrier();
        {{CG_Z_FMA}}
    }
    // dq += Γ Y, dk -= beta Γ Z; dγ += Γ q·Y - beta Γ k·Z, dbeta -= Γ k·Z
    {{CG_Z_ELEM}}
    // dK̃ = Δ dSᵀ over Dv (Δ and dS staged transposed), and <S0, dS> on the side
    {{CG_K_DECL}}
    var sdot = 0.0;
    for (var j0 = 0u; j0 < CDV; j0 += BR) {
        workgroupBarrier();
        for (var e = lid; e < CC * BR; e += CNTP) {
            let m = e / BR;
            let r = e - m * BR;
            cg_sm[CG_ZA + r * (CC + 1u) + m] = cg_row(2u, b, t0 + m, h, j0 + r);
        }
        for (var e = lid; e < CDK * BR; e += CNTP) {
            let i = e / BR;
            let r = e - i * BR;
            let ds = cg_ldstate(1u, bh, c, i, j0 + r);
            cg_sm[CG_ZB + r * (CDK + 1u) + i] = ds;
            sdot += ds * cg_ldstate(0u, bh, c, i, j0 + r);
        }
        workgroupBarrier();
        {{CG_K_FMA}}
    }
    // dk += exp(γ_L - γ) dK̃; dγ -= K̃·dK̃; the last token gets Γ_L <S0, dS> + Σ K̃·dK̃
    {{CG_K_ELEM}}
    workgroupBarrier();
    cg_sm[CG_RED + lid] = sdot;
    workgroupBarrier();
    if (lid == 0u) {
        var acc = 0.0;
        for (var x = 0u; x < CNTP; x++) { acc += cg_sm[CG_RED + x]; }
        cg_dgam[CC - 1u] += cg_last + exp(c_gam[CC - 1u]) * acc;
    }
    workgroupBarrier();
    // dv = beta dR and dbeta += V·dR: CNTP / CC threads per token
    let per = CNTP / CC;
    let tt = lid / per;
    let part = lid - tt * per;
    var vdr = 0.0;
    if (tt < CC && t0 + tt < cg_p.T) {
        let n = b * cg_p.T + t0 + tt;
        let nl = bl * cg_p.T + t0 + tt;
        for (var j = part; j < cg_p.Dv; j += per) {
            let dr = cg_scr[cg_p.dr_off + (nl * cg_p.Hv + h) * cg_p.Dv + j];
            cg_dv[cg_p.v_off + n * cg_p.v_stride + h * cg_p.Dv + j] = c_bet[tt] * dr;
            vdr += cg_v[cg_p.v_off + n * cg_p.v_stride + h * cg_p.Dv + j] * dr;
        }
    }
    workgroupBarrier();
    cg_sm[CG_RED + lid] = vdr;
    workgroupBarrier();
    // dg = the reverse cumulative sum of dγ within the chunk
    if (lid < CC && t0 + lid < cg_p.T) {
        var db = cg_dbet[lid];
        for (var x = 0u; x < per; x++) { db += cg_sm[CG_RED + lid * per + x]; }
        var dg = 0.0;
        for (var s = lid; s < CC; s++) { dg += cg_dgam[s]; }
        let at = cg_p.dg_off + ((b * cg_p.T + t0 + lid) * cg_p.Hv + h) * 2u;
        cg_scr[at] = dg;
        cg_scr[at + 1u] = db;
    }
}
