// The gated delta rule of a Gated DeltaNet layer (Qwen3.5's "linear attention"), forward and backward.
// Reference: `ddl_ref.gdn.gated_delta_forward` / `gated_delta_backward`; the math:
// docs/model.md#gated-deltanet; the design: docs/kernels.md#the-gated-delta-rule.
//
// Per batch row b and value head h (its key head hk = h / (Hv / Hk)), a state S (Dk x Dv), zero or given at
// t = 0, runs over the row's T tokens:
//     a = exp(g_t);  u = a S^T k_t;  r_t = v_t - u;  S <- a S + k_t (beta_t r_t)^T;  o_t = S^T q_t
// (q, k already L2-normalised, q scaled by 1/sqrt(Dk)).
//
// One workgroup per (b, h) walks t in order; its TI x TJ threads share the state: thread (ti, tj) keeps the
// PI x PJ elements S[i_a, j_b], i_a = ti + TI*a, j_b = tj + TJ*b, in registers (generated straight-line code,
// `s_a_b`; rows >= Dk and columns >= Dv are padding that stays 0). A column sum (S^T k, S^T q) or a row sum
// (S dO) is one fixed-order pass through workgroup memory, so results are the same bits every run.
//
//   gated_delta_forward   (qkgb, v, state_in, o, r, states, p)    3 barriers per token
//       o = the outputs; r = v - u (what the backward needs to rebuild S without a reduction);
//       states: the state before every chunk of `tc` tokens (slots 0..nck-1, when save_ckpt) and the final
//       state (slot nck, when save_final).
//   gated_delta_backward  (qkgb, r, do, states, scratch, dqk, dv, dgb, p)  4 barriers per token
//       chunks in reverse: rebuild the chunk's states from its checkpoint (S_{t-1} of each token kept in
//       `scratch`, tc states per (b, h), shared by every layer), then walk the chunk backwards with dS in
//       registers:
//           dS += q dO^T;  dq = S_t dO;  dd = dS^T k;  dv = beta dd;  du = -beta dd;
//           dk = dS (beta r) + a S_{t-1} du;  dS~ = dS + k du^T;  dg = <dS~, a S_{t-1}>;  dbeta = dd . r;
//           dS <- a dS~
//       dq, dk are per value head (a key head's gradient is the sum of its G value heads':
//       `gdn_inputs.l2norm_backward`); dg and dbeta are written as per-column terms (dgb: (rows, Hv, 2, Dv)),
//       summed by `gdn_inputs.gates_backward`.
//
// Layouts (floats; rows n = b*T + t): one read-only buffer `qkgb` holds q[n, hk, i] at (n*Hk + hk)*Dk + i,
// k at k_off + the same, and g, beta at gb_off + (n*Hv + h)*2 (+ 1) (three parts written by other kernels,
// bound once: WebGPU's 8 storage buffers per stage); v[n, h, j] = v[v_off + n*v_stride + h*Dv + j] (the v
// columns of the conv output; dv is written the same way into its gradient); o, r, do: [(n*Hv + h)*Dv + j];
// states[((b*Hv + h)*(nck + 1) + c)*Dk*Dv + i*Dv + j]; scratch[((b*Hv + h)*tc + s)*Dk*Dv + i*Dv + j];
// dq[(n*Hv + h)*Dk + i], dk at dqk[dk_off + same].

const TI: u32 = {{TI}}u;  // thread rows (over Dk)
const TJ: u32 = {{TJ}}u;  // thread columns (over Dv)
const DKP: u32 = {{DKP}}u;  // TI * PI: Dk padded
const DVP: u32 = {{DVP}}u;  // TJ * PJ: Dv padded
const NT: u32 = TI * TJ;

// generated from its description in ddl_wgpu/ops/gated_delta.py (`Uniform`)
{{struct Params}}

var<workgroup> red_c: array<f32, TI * DVP>;  // column partials: [ti][j]
var<workgroup> red_o: array<f32, TI * DVP>;  // the forward's second column partials (o), so no 4th barrier
var<workgroup> red_r: array<f32, TJ * DKP>;  // row partials: [tj][i]
var<workgroup> vec_c: array<f32, DVP>;  // a reduced column vector (u, dd)

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

// ---------------------------------------------------------------------------------------------------------
// backward

@group(0) @binding(0) var<storage, read> b_qk: array<f32>;
@group(0) @binding(1) var<storage, read> b_r: array<f32>;
@group(0) @binding(2) var<storage, read> b_do: array<f32>;
@group(0) @binding(3) var<storage, read> b_states: array<f32>;
@group(0) @binding(4) var<storage, read_write> b_scratch: array<f32>;
@group(0) @binding(5) var<storage, read_write> b_dqk: array<f32>;
@group(0) @binding(6) var<storage, read_write> b_dv: array<f32>;
@group(0) @binding(7) var<storage, read_write> b_dgb: array<f32>;
@group(0) @binding(8) var<uniform> b_p: Params;

fn b_ldq(n: u32, hk: u32, i: u32) -> f32 {
    if (i >= b_p.Dk) { return 0.0; }
    return b_qk[(n * b_p.Hk + hk) * b_p.Dk + i];
}
fn b_ldk(n: u32, hk: u32, i: u32) -> f32 {
    if (i >= b_p.Dk) { return 0.0; }
    return b_qk[b_p.k_off + (n * b_p.Hk + hk) * b_p.Dk + i];
}
fn b_ldcol(buf: u32, n: u32, h: u32, j: u32) -> f32 {
    if (j >= b_p.Dv) { return 0.0; }
    if (buf == 0u) { return b_r[(n * b_p.Hv + h) * b_p.Dv + j]; }
    return b_do[(n * b_p.Hv + h) * b_p.Dv + j];
}
fn b_ldckpt(at: u32, i: u32, j: u32) -> f32 {
    if (i >= b_p.Dk || j >= b_p.Dv) { return 0.0; }
    return b_states[at + i * b_p.Dv + j];
}
fn b_ldscratch(at: u32, i: u32, j: u32) -> f32 {
    if (i >= b_p.Dk || j >= b_p.Dv) { return 0.0; }
    return b_scratch[at + i * b_p.Dv + j];
}
fn b_stscratch(at: u32, i: u32, j: u32, x: f32) {
    if (i < b_p.Dk && j < b_p.Dv) { b_scratch[at + i * b_p.Dv + j] = x; }
}

@compute @workgroup_size(TI * TJ)
fn gated_delta_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                        @builtin(local_invocation_index) lid: u32) {
    let bh = group_index(wid, nwg);
    if (bh >= b_p.B * b_p.Hv) { return; }
    let b = bh / b_p.Hv;
    let h = bh - b * b_p.Hv;
    let hk = h / (b_p.Hv / b_p.Hk);
    let ti = lid / TJ;
    let tj = lid - ti * TJ;
    let S = b_p.Dk * b_p.Dv;
    let scratch = bh * b_p.tc * S;
    {{B_INIT}}
    for (var cc = 0u; cc < b_p.nck; cc++) {
        let c = b_p.nck - 1u - cc;
        let t0 = c * b_p.tc;
        let t1 = min(b_p.T, t0 + b_p.tc);
        // rebuild the chunk: S_{t-1} of each of its tokens into the scratch
        let ckpt = (bh * (b_p.nck + 1u) + c) * S;
        {{B_LOAD_CKPT}}
        for (var t = t0; t < t1; t++) {
            let n = b * b_p.T + t;
            {{B_SCRATCH_STORE}}
            let at = exp(b_qk[b_p.gb_off + (n * b_p.Hv + h) * 2u]);
            let bt = b_qk[b_p.gb_off + (n * b_p.Hv + h) * 2u + 1u];
            {{B_RECOMPUTE}}
        }
        // walk the chunk backwards
        for (var tt = t1; tt > t0; tt--) {
            let t = tt - 1u;
            let n = b * b_p.T + t;
            let at = exp(b_qk[b_p.gb_off + (n * b_p.Hv + h) * 2u]);
            let bt = b_qk[b_p.gb_off + (n * b_p.Hv + h) * 2u + 1u];
            {{B_LOAD_STEP}}
            {{B_PHASE_A}}
            workgroupBarrier();
            for (var x = lid; x < DVP; x += NT) {
                var acc = 0.0;
                for (var y = 0u; y < TI; y++) { acc += red_c[y * DVP + x]; }
                vec_c[x] = acc;
            }
            for (var i = lid; i < b_p.Dk; i += NT) {
                var acc = 0.0;
                for (var y = 0u; y < TJ; y++) { acc += red_r[y * DKP + i]; }
                b_dqk[(n * b_p.Hv + h) * b_p.Dk + i] = acc;
            }
            workgroupBarrier();
            {{B_PHASE_B}}
            workgroupBarrier();
            for (var i = lid; i < b_p.Dk; i += NT) {
                var acc = 0.0;
                for (var y = 0u; y < TJ; y++) { acc += red_r[y * DKP + i]; }
                b_dqk[b_p.dk_off + (n * b_p.Hv + h) * b_p.Dk + i] = acc;
            }
            for (var x = lid; x < b_p.Dv; x += NT) {
                var acc = 0.0;
                for (var y = 0u; y < TI; y++) { acc += red_c[y * DVP + x]; }
                b_dgb[((n * b_p.Hv + h) * 2u) * b_p.Dv + x] = acc;
            }
            workgroupBarrier();
            {{B_DECAY}}
        }
    }
}
