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
// CC; per chunk (γ the cumulative log decay within it, Γ = exp(γ), L its last token, M_ts = exp(γ_t - γ_s)
// for s <= t, tokens past T padded with k = q = v = 0, g = 0, beta = 0, which changes nothing). Only the
// recurrence's own products run in the sequential kernels; everything local to a chunk runs per chunk:
//
//   chunk_prep            (qkgb, v, tp, p)   one workgroup per (b, key head, chunk), independent of the state:
//       K Kᵀ and Q Kᵀ once for the key head's value heads, then per value head P = M ∘ Q Kᵀ,
//       A = diag(beta) (M ∘ K Kᵀ) strictly lower, Tm = (I + A)⁻¹ (blocks of TB), W = Tm diag(beta Γ) K and,
//       the forward's, U = Tm diag(beta) V (the backward's: Tm). tp[chunk] = [W | P | U or Tm].
//   chunk_forward         (qkgb, state_in, tp, o, delta, states, p)   one workgroup per (b, h, BV value
//       columns), the chunks in order, the state's CDK x BV block in registers (a copy in workgroup memory
//       for the product that reads it):  X = [W; Q] S;  Δ = U - X_W;  o = Γ X_Q;  S <- Γ_L S + K̃ᵀ Δ
//       (K̃ = exp(γ_L - γ) K). delta = Δ (always: chunk_output reads it); states = the state before each
//       chunk (save_ckpt: the backward's) and after the last (save_final).
//   chunk_output          (tp, delta, o, p)   one workgroup per (b, h, chunk):  o += P Δ.
//   chunk_backward_state  (qkgb, do, scr, p)   one workgroup per (b, h, BV value columns), the chunks in
//       reverse with dS in registers:  dΔ = Pᵀ dO + K̃ dS;  dS <- Γ_L dS - Wᵀ dΔ + Qᵀ (Γ dO); scr's dd part
//       gets dΔ, its ds part dS at each chunk's end.
//   chunk_backward_grads  (qkgb, v, do, delta, states, scr, dqk, dv, p)   one workgroup per (b, h, chunk):
//       dR = Tmᵀ dΔ (in place of dΔ), dv = beta dR; [dP; -dA] = [dO; dR] Δᵀ -> E = [dP ∘ M; dA ∘ M]
//       (scr's e part); y = [Γ dO; -Γ dR] S₀ᵀ + E K: dq (its first C rows) and dk⁺ = beta (its last);
//       z = exp(γ_L - γ) Δ dSᵀ + [dQKᵀ | (dA ∘ M)ᵀ] [Q; beta K] = dk⁻; dk = dk⁺ + dk⁻; per token
//       dbeta = V·dR + k·y_last and dγ = q·dq + k·dk⁺ - k·dk⁻ (+ <dS, S_n> on the last token), dg their
//       reverse cumulative sum within the chunk, [dg, dbeta] into scr's dg part.
//
// All sums run in a fixed order (no atomics): the same bits every run. Each kernel's workgroup memory is one
// vec4 array carved at constant offsets (generated: ddl_wgpu/ops/gdn_plan.py), with the per-token arrays of the
// gates beside it. scr = [tp | dd | ds | e | dg] at the uniform's offsets (one binding: each kernel may
// bind 8 storage buffers). A call runs batch rows b0 .. b0 + B - 1 (where one row group's buffers would not
// fit a binding, the launcher makes several calls): token buffers (qkgb, v, o, delta, do, dqk, dv, dg) are
// indexed by the batch row b, the per-chunk ones (tp, states, state_in, dd, ds, e) by the call's own row
// bl = b - b0 (the launcher binds views of states and state_in at row b0).

const CC: u32 = {{CC}}u;  // tokens per chunk
const CDK: u32 = {{CDK}}u;  // Dk padded to a power of two
const CDV: u32 = {{CDV}}u;  // Dv padded
const BV: u32 = {{BV}}u;  // value columns per workgroup of the sequential kernels
const SV: u32 = BV / 4u;  // ... in vec4
const NVB: u32 = CDV / BV;
const CNT: u32 = {{CNT}}u;  // threads per workgroup of the sequential kernels
const CNTP: u32 = {{CNTP}}u;  // ... and of the per-chunk ones
const CC2: u32 = CC * CC;
const TB: u32 = {{TB}}u;  // the prep's blocks of Tm
const TPB: u32 = {{TPB}}u;  // floats of one chunk's block of tp: W (CC x CDK), P (CC x CC), U (CC x CDV) or Tm
const TP_P: u32 = CC * CDK;
const TP_X: u32 = CC * CDK + CC2;
{{CHUNK_CONSTS}}  // workgroup-memory offsets of each chunked kernel's parts (vec4; _F: floats)

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
@group(0) @binding(1) var<storage, read> cp_val: array<f32>;
@group(0) @binding(2) var<storage, read_write> cp_scr: array<f32>;
@group(0) @binding(3) var<uniform> cp_p: Params;
var<workgroup> cp_sm: array<vec4<f32>, {{CP_SM}}>;

fn cp_rd(i: u32) -> f32 { return cp_sm[i >> 2u][i & 3u]; }
fn cp_wr(i: u32, x: f32) { cp_sm[i >> 2u][i & 3u] = x; }
fn cp_ld(part: u32, b: u32, t: u32, hk: u32, i: u32) -> f32 {
    // part 0: q, 1: k
    if (t >= cp_p.T || i >= cp_p.Dk) { return 0.0; }
    return cp_qk[part * cp_p.k_off + ((b * cp_p.T + t) * cp_p.Hk + hk) * cp_p.Dk + i];
}
fn cp_ldv(b: u32, t: u32, h: u32, j: u32) -> f32 {
    if (t >= cp_p.T || j >= cp_p.Dv) { return 0.0; }
    return cp_val[cp_p.v_off + (b * cp_p.T + t) * cp_p.v_stride + h * cp_p.Dv + j];
}

@compute @workgroup_size(CNTP)
fn chunk_prep(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let id = group_index(wid, nwg);
    if (id >= cp_p.B * cp_p.Hk * cp_p.nck) { return; }
    let bkh = id / cp_p.nck;
    let c = id - bkh * cp_p.nck;
    let bl = bkh / cp_p.Hk;  // the batch row within this call's rows
    let b = bl + cp_p.b0;  // ... and within the whole batch (token buffers)
    let hk = bkh - bl * cp_p.Hk;
    let G = cp_p.Hv / cp_p.Hk;
    let t0 = c * CC;
    {{CP_COORDS}}
    // [K; Q] Kᵀ over Dk, once for the key head's value heads ([k; q] rows staged transposed)
    {{CP_KQ}}
    for (var gi = 0u; gi < G; gi++) {
        let h = hk * G + gi;
        let blk = ((bl * cp_p.Hv + h) * cp_p.nck + c) * TPB;
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
        workgroupBarrier();
        // A (workgroup memory, row-major, odd stride) and P (tp) from the K Kᵀ and Q Kᵀ registers
        {{CP_MASK}}
        workgroupBarrier();
        // Tm = (I + A)⁻¹ by TB x TB blocks: each diagonal block's inverse by forward substitution (a column
        // per thread, reading only its own column), then block row by block row
        // Tm_ij = -Tm_ii Σ_{j <= k < i} A_ik Tm_kj (blocks j < i), the sums in a fixed order
        if (lid < CC) {
            let j = lid;
            let d0 = (j / TB) * TB;
            for (var t = 0u; t < d0; t++) { cp_wr(CP_T_F + t * (CC + 1u) + j, 0.0); }
            for (var t = d0; t < d0 + TB; t++) {
                var x = select(0.0, 1.0, t == j);
                for (var s = j; s < t; s++) {
                    x -= cp_rd(CP_A_F + t * (CC + 1u) + s) * cp_rd(CP_T_F + s * (CC + 1u) + j);
                }
                cp_wr(CP_T_F + t * (CC + 1u) + j, x);
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
                    acc += cp_rd(CP_A_F + (i0 + r) * (CC + 1u) + k) * cp_rd(CP_T_F + k * (CC + 1u) + col);
                }
                cp_wr(CP_X_F + e, acc);
            }
            workgroupBarrier();
            for (var e = lid; e < i0 * TB; e += CNTP) {  // Tm_ij = -Tm_ii X
                let r = e / i0;
                let col = e - r * i0;
                var acc = 0.0;
                for (var k = 0u; k <= r; k++) {
                    acc += cp_rd(CP_T_F + (i0 + r) * (CC + 1u) + i0 + k) * cp_rd(CP_X_F + k * i0 + col);
                }
                cp_wr(CP_T_F + (i0 + r) * (CC + 1u) + col, -acc);
            }
        }
        workgroupBarrier();
        if (cp_p.mode != 0u) {  // the backward's Tm (row-major)
            for (var e = lid; e < CC2; e += CNTP) {
                let t = e / CC;
                cp_scr[blk + TP_X + e] = cp_rd(CP_T_F + t * (CC + 1u) + e - t * CC);
            }
        }
        // W = Tm diag(beta Γ) K (the rows of beta Γ K staged as they are; Tm read as scalars)
        {{CP_W}}
        if (cp_p.mode == 0u) {
            // U = Tm diag(beta) V
            {{CP_U}}
        }
    }
}


// ---------------------------------------------------------------------------------------------------------
// chunk_forward

@group(0) @binding(0) var<storage, read> cf_qk: array<f32>;
@group(0) @binding(1) var<storage, read> cf_init: array<f32>;
@group(0) @binding(2) var<storage, read> cf_scr: array<f32>;
@group(0) @binding(3) var<storage, read_write> cf_o: array<f32>;
@group(0) @binding(4) var<storage, read_write> cf_d: array<f32>;
@group(0) @binding(5) var<storage, read_write> cf_states: array<f32>;
@group(0) @binding(6) var<uniform> cf_p: Params;
var<workgroup> cf_sm: array<vec4<f32>, {{CF_SM}}>;

fn cf_ld(part: u32, b: u32, t: u32, hk: u32, i: u32) -> f32 {
    if (t >= cf_p.T || i >= cf_p.Dk) { return 0.0; }
    return cf_qk[part * cf_p.k_off + ((b * cf_p.T + t) * cf_p.Hk + hk) * cf_p.Dk + i];
}
fn cf_xa(blk: u32, b: u32, t0: u32, hk: u32, tq: u32, i: u32) -> f32 {
    // row tq of [W; Q]: W from tp (CDK wide, padded with zeros), then q
    if (tq < CC) { return cf_scr[blk + tq * CDK + i]; }
    return cf_ld(0u, b, t0 + tq - CC, hk, i);
}
fn cf_ldinit(bh: u32, i: u32, j: u32) -> f32 {
    if (cf_p.has_init == 0u || i >= cf_p.Dk || j >= cf_p.Dv) { return 0.0; }
    return cf_init[(bh * cf_p.Dk + i) * cf_p.Dv + j];
}
fn cf_store_state(slot: u32, i: u32, j: u32, x: f32) {
    if (i < cf_p.Dk && j < cf_p.Dv) { cf_states[(slot * cf_p.Dk + i) * cf_p.Dv + j] = x; }
}
fn cf_store_delta(b: u32, t: u32, h: u32, j: u32, x: f32) {
    if (t < cf_p.T && j < cf_p.Dv) { cf_d[((b * cf_p.T + t) * cf_p.Hv + h) * cf_p.Dv + j] = x; }
}
fn cf_store_o(b: u32, t: u32, h: u32, j: u32, x: f32) {
    if (t < cf_p.T && j < cf_p.Dv) { cf_o[((b * cf_p.T + t) * cf_p.Hv + h) * cf_p.Dv + j] = x; }
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
    // the state block in registers, and its copy
    {{CF_S_INIT}}
    for (var c = 0u; c < cf_p.nck; c++) {
        let t0 = c * CC;
        let blk = (bh * cf_p.nck + c) * TPB;
        if (cf_p.save_ckpt != 0u) {
            let slot = slots + c;
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
        workgroupBarrier();
        // X = [W; Q] S over Dk ([W; Q] staged transposed, S from its copy)
        {{CF_X}}
        // Δ = U - X_W (its copy and delta), o = Γ X_Q
        {{CF_X_EPI}}
        // S <- Γ_L S + K̃ᵀ Δ (K̃'s rows staged as they are, Δ from its copy)
        {{CF_S_DECAY}}
        {{CF_S}}
        {{CF_S_MIRROR}}
    }
    if (cf_p.save_final != 0u) {
        let slot = slots + cf_p.nck;
        {{CF_S_STORE}}
    }
}


// ---------------------------------------------------------------------------------------------------------
// chunk_output

@group(0) @binding(0) var<storage, read> co_scr: array<f32>;
@group(0) @binding(1) var<storage, read> co_d: array<f32>;
@group(0) @binding(2) var<storage, read_write> co_o: array<f32>;
@group(0) @binding(3) var<uniform> co_p: Params;
var<workgroup> co_sm: array<vec4<f32>, {{CO_SM}}>;

fn co_ldd(b: u32, t: u32, h: u32, j: u32) -> f32 {
    if (t >= co_p.T || j >= co_p.Dv) { return 0.0; }
    return co_d[((b * co_p.T + t) * co_p.Hv + h) * co_p.Dv + j];
}
fn co_add_o(b: u32, t: u32, h: u32, j: u32, x: f32) {
    if (t < co_p.T && j < co_p.Dv) {
        let at = ((b * co_p.T + t) * co_p.Hv + h) * co_p.Dv + j;
        co_o[at] = co_o[at] + x;
    }
}

@compute @workgroup_size(CNTP)
fn chunk_output(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32) {
    let id = group_index(wid, nwg);
    if (id >= co_p.B * co_p.Hv * co_p.nck) { return; }
    let bh = id / co_p.nck;
    let c = id - bh * co_p.nck;
    let bl = bh / co_p.Hv;
    let b = bl + co_p.b0;
    let h = bh - bl * co_p.Hv;
    let t0 = c * CC;
    let blk = id * TPB;
    {{CO_COORDS}}
    // o += P Δ over the chunk (P staged transposed, Δ's rows as they are)
    {{CO_O}}
}


// ---------------------------------------------------------------------------------------------------------
// chunk_backward_state

@group(0) @binding(0) var<storage, read> cb_qk: array<f32>;
@group(0) @binding(1) var<storage, read> cb_do: array<f32>;
@group(0) @binding(2) var<storage, read_write> cb_scr: array<f32>;
@group(0) @binding(3) var<uniform> cb_p: Params;
var<workgroup> cb_sm: array<vec4<f32>, {{CB_SM}}>;

fn cb_ld(part: u32, b: u32, t: u32, hk: u32, i: u32) -> f32 {
    if (t >= cb_p.T || i >= cb_p.Dk) { return 0.0; }
    return cb_qk[part * cb_p.k_off + ((b * cb_p.T + t) * cb_p.Hk + hk) * cb_p.Dk + i];
}
fn cb_lddo(b: u32, t: u32, h: u32, j: u32) -> f32 {
    if (t >= cb_p.T || j >= cb_p.Dv) { return 0.0; }
    return cb_do[((b * cb_p.T + t) * cb_p.Hv + h) * cb_p.Dv + j];
}
fn cb_store_ds(bh: u32, c: u32, i: u32, j: u32, x: f32) {
    if (i < cb_p.Dk && j < cb_p.Dv) { cb_scr[cb_p.ds_off + ((bh * cb_p.nck + c) * cb_p.Dk + i) * cb_p.Dv + j] = x; }
}
fn cb_store_dd(bl: u32, t: u32, h: u32, j: u32, x: f32) {
    if (t < cb_p.T && j < cb_p.Dv) { cb_scr[cb_p.dd_off + ((bl * cb_p.T + t) * cb_p.Hv + h) * cb_p.Dv + j] = x; }
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
    // dS (zero after the last token) in registers, and its copy
    {{CB_S_INIT}}
    for (var cc = 0u; cc < cb_p.nck; cc++) {
        let c = cb_p.nck - 1u - cc;
        let t0 = c * CC;
        let blk = (bh * cb_p.nck + c) * TPB;
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
        for (var e = lid; e < CC * SV; e += CNT) {  // dO of the block's columns, rows CC .. 2CC - 1
            let t = e / SV;
            let j = j0 + 4u * (e - t * SV);
            cb_sm[CB_RB + CC * SV + e] = vec4<f32>(cb_lddo(b, t0 + t, h, j), cb_lddo(b, t0 + t, h, j + 1u),
                                                   cb_lddo(b, t0 + t, h, j + 2u), cb_lddo(b, t0 + t, h, j + 3u));
        }
        workgroupBarrier();
        c_cumsum(lid);
        workgroupBarrier();
        // dΔ = Pᵀ dO + K̃ dS (P's rows as stored, then K̃ transposed; B = the rows [dO; dS])
        {{CB_A}}
        {{CB_A_EPI}}
        // dS <- Γ_L dS + [-W; ΓQ]ᵀ [dΔ; dO] (the rows as stored)
        {{CB_S_DECAY}}
        {{CB_B}}
        {{CB_S_MIRROR}}
    }
}


// ---------------------------------------------------------------------------------------------------------
// chunk_backward_grads

@group(0) @binding(0) var<storage, read> cg_qk: array<f32>;
@group(0) @binding(1) var<storage, read> cg_val: array<f32>;
@group(0) @binding(2) var<storage, read> cg_do: array<f32>;
@group(0) @binding(3) var<storage, read> cg_d: array<f32>;
@group(0) @binding(4) var<storage, read> cg_states: array<f32>;
@group(0) @binding(5) var<storage, read_write> cg_scr: array<f32>;
@group(0) @binding(6) var<storage, read_write> cg_dqk: array<f32>;
@group(0) @binding(7) var<storage, read_write> cg_dv: array<f32>;
@group(0) @binding(8) var<uniform> cg_p: Params;
var<workgroup> cg_sm: array<vec4<f32>, {{CG_SM}}>;
var<workgroup> c_dgam: array<f32, CC>;  // dγ per token, summed over the phases
var<workgroup> c_dbet: array<f32, CC>;  // dbeta per token
var<workgroup> c_rs: array<f32, 2 * CC>;  // row sums of a product's tile

fn cg_rd(i: u32) -> f32 { return cg_sm[i >> 2u][i & 3u]; }
fn cg_wr(i: u32, x: f32) { cg_sm[i >> 2u][i & 3u] = x; }
fn cg_ld(part: u32, b: u32, t: u32, hk: u32, i: u32) -> f32 {
    if (t >= cg_p.T || i >= cg_p.Dk) { return 0.0; }
    return cg_qk[part * cg_p.k_off + ((b * cg_p.T + t) * cg_p.Hk + hk) * cg_p.Dk + i];
}
fn cg_ldv(b: u32, t: u32, h: u32, j: u32) -> f32 {
    if (t >= cg_p.T || j >= cg_p.Dv) { return 0.0; }
    return cg_val[cg_p.v_off + (b * cg_p.T + t) * cg_p.v_stride + h * cg_p.Dv + j];
}
fn cg_ldd(b: u32, t: u32, h: u32, j: u32) -> f32 {  // Δ
    if (t >= cg_p.T || j >= cg_p.Dv) { return 0.0; }
    return cg_d[((b * cg_p.T + t) * cg_p.Hv + h) * cg_p.Dv + j];
}
fn cg_lddd(bl: u32, t: u32, h: u32, j: u32) -> f32 {  // dΔ, then dR in its place (scr's dd part)
    if (t >= cg_p.T || j >= cg_p.Dv) { return 0.0; }
    return cg_scr[cg_p.dd_off + ((bl * cg_p.T + t) * cg_p.Hv + h) * cg_p.Dv + j];
}
fn cg_ldodr(b: u32, bl: u32, t0: u32, tq: u32, h: u32, j: u32) -> f32 {  // row tq of [dO; dR]
    if (tq < CC) {
        let t = t0 + tq;
        if (t >= cg_p.T || j >= cg_p.Dv) { return 0.0; }
        return cg_do[((b * cg_p.T + t) * cg_p.Hv + h) * cg_p.Dv + j];
    }
    return cg_lddd(bl, t0 + tq - CC, h, j);
}
fn cg_lds0(bh: u32, c: u32, i: u32, j: u32) -> f32 {  // the state before chunk c (the forward's checkpoint)
    if (i >= cg_p.Dk || j >= cg_p.Dv) { return 0.0; }
    return cg_states[((bh * (cg_p.nck + 1u) + c) * cg_p.Dk + i) * cg_p.Dv + j];
}
fn cg_ldds(bh: u32, c: u32, i: u32, j: u32) -> f32 {  // dS at chunk c's end
    if (i >= cg_p.Dk || j >= cg_p.Dv) { return 0.0; }
    return cg_scr[cg_p.ds_off + ((bh * cg_p.nck + c) * cg_p.Dk + i) * cg_p.Dv + j];
}
fn cg_ldqbk(b: u32, t0: u32, s: u32, hk: u32, i: u32) -> f32 {  // row s of [Q; diag(beta) K]
    if (s < CC) { return cg_ld(0u, b, t0 + s, hk, i); }
    return c_bet[s - CC] * cg_ld(1u, b, t0 + s - CC, hk, i);
}
fn cg_put_dr(bl: u32, t: u32, h: u32, j: u32, x: f32, be: u32) {  // dR into scr's dd part, dv = beta dR
    if (t < cg_p.T && j < cg_p.Dv) {
        cg_scr[cg_p.dd_off + ((bl * cg_p.T + t) * cg_p.Hv + h) * cg_p.Dv + j] = x;
        let n = (bl + cg_p.b0) * cg_p.T + t;
        cg_dv[cg_p.v_off + n * cg_p.v_stride + h * cg_p.Dv + j] = c_bet[be] * x;
    }
}
fn cg_put_dq(b: u32, t: u32, h: u32, i: u32, x: f32) {
    if (t < cg_p.T && i < cg_p.Dk) { cg_dqk[((b * cg_p.T + t) * cg_p.Hv + h) * cg_p.Dk + i] = x; }
}
fn cg_put_dk(b: u32, t: u32, h: u32, i: u32, x: f32) {
    if (t < cg_p.T && i < cg_p.Dk) { cg_dqk[cg_p.dk_off + ((b * cg_p.T + t) * cg_p.Hv + h) * cg_p.Dk + i] = x; }
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
    let blk = id * TPB;
    let eb = cg_p.e_off + id * 2u * CC2;  // E: this chunk's 2CC x CC in scr's e part
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
    workgroupBarrier();
    c_cumsum(lid);
    workgroupBarrier();
    // dR = Tmᵀ dΔ (Tm's and dΔ's rows as stored); dR replaces dΔ, dv = beta dR, dbeta = V·dR
    {{CG_R}}
    {{CG_R_EPI}}
    storageBarrier();
    workgroupBarrier();
    // [dP; -dA] = [dO; dR] Δᵀ over Dv (both staged transposed) -> E = [dP ∘ M (s <= t); dA ∘ M (s < t)]
    {{CG_E}}
    {{CG_E_EPI}}
    storageBarrier();
    workgroupBarrier();
    // y = [Γ dO S₀ᵀ; -Γ dR S₀ᵀ] + E K: dq (rows < CC), then dk⁺ = beta y (rows >= CC, kept)
    {{CG_Y}}
    {{CG_Y_EPI}}
    // z = exp(γ_L - γ) Δ dSᵀ + [dQKᵀ | (dA ∘ M)ᵀ] [Q; beta K] = dk⁻
    {{CG_Z}}
    {{CG_Z_EPI}}
    // the last token's dγ gets <dS, S_n> (= Γ_L <S₀, dS> + Σ K̃·dK̃), S_n the state after the chunk (the next
    // checkpoint; after the last chunk dS is 0), summed over a fixed assignment of elements to threads
    var sdot = 0.0;
    if (c + 1u < cg_p.nck) {
        let ds = cg_p.ds_off + (bh * cg_p.nck + c) * cg_p.Dk * cg_p.Dv;
        let sn = (bh * (cg_p.nck + 1u) + c + 1u) * cg_p.Dk * cg_p.Dv;
        for (var e = lid; e < cg_p.Dk * cg_p.Dv; e += CNTP) { sdot += cg_scr[ds + e] * cg_states[sn + e]; }
    }
    cg_wr(CG_RED_F + lid, sdot);
    workgroupBarrier();
    if (lid == 0u) {
        var acc = 0.0;
        for (var x = 0u; x < CNTP; x++) { acc += cg_rd(CG_RED_F + x); }
        c_dgam[CC - 1u] += acc;
    }
    workgroupBarrier();
    // dg = the reverse cumulative sum of dγ within the chunk
    if (lid < CC && t0 + lid < cg_p.T) {
        var dg = 0.0;
        for (var s = lid; s < CC; s++) { dg += c_dgam[s]; }
        let at = cg_p.dg_off + ((b * cg_p.T + t0 + lid) * cg_p.Hv + h) * 2u;
        cg_scr[at] = dg;
        cg_scr[at + 1u] = c_dbet[lid];
    }
}
