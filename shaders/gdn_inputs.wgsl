// What turns a Gated DeltaNet layer's projections into the inputs of the gated delta rule, forward and
// backward: the depthwise causal conv over time with SiLU, the decay and write gates, and the per-key-head
// sum of the rule's q/k gradients. Reference: `ddl_ref.gdn.causal_conv_forward` / `_backward`,
// `ddl_ref.gdn.gdn_forward` (the gates); docs/model.md#gated-deltanet.
//
// Layouts (floats, rows n = b*T + t): the projection x (rows, Ch) with channels [q (Hk*Dk); k (Hk*Dk);
// v (Hv*Dv)], Ch = 2*qk_cols + v_cols. The conv output is written PLANAR, q (rows, Hk*Dk) then k then v
// (`planar`, k at k_off, v at v_off), so the q and k heads are contiguous rows of Dk for the L2 norm (an RMSNorm, ops/gdn_inputs.py)
// and the rule reads v as (rows, Hv*Dv). Conv weight w (Ch, k): tap m multiplies the input at t - (k-1-m);
// before t = 0 the input is the history `hist` (B, k-1, Ch) (the decoding cache: row j is position j-(k-1))
// when has_hist, else 0.
//
//   conv_forward        (x, w, hist, out, p)            thread per (row, channel)  out = silu(conv(x))
//   conv_backward_pre   (dout, x, w, hist, dpre, p)     thread per (row, channel)  dpre = dout * silu'(pre)
//   conv_backward_dx    (dpre, w, dx, p)                thread per (row, channel)  dx (+)= conv^T dpre
//   conv_grad_partial   (dpre, x, hist, partials, p)    workgroup per (row block, 256 channels)
//   conv_grad_reduce    (partials, dw, p)               thread per weight: dw += sum over blocks, in order
//   gates_forward       (a, b, A_log, dt, gb, p)        thread per (row, value head)
//       g = -exp(A_log) * softplus(a + dt_bias),  beta = sigmoid(b);  gb = [g, beta]
//   gates_backward      (dgb, a, b, A_log, dt, da, db, dgg, p)
//       dg, dbeta = the sums over Dv of the rule's per-column terms (dgb (rows, Hv, 2, Dv)), then
//       da = dg * (-exp(A_log)) * sigmoid(a + dt_bias), db = dbeta * beta (1 - beta), dgg = dg * g (the
//       A_log gradient's per-row term; dt_bias's is da); the launcher sums them over rows with a GEMM.
//   head_group_sum      (src, dst, p)                   dst[s, n, hk, i] = sum_g src[s, n, hk*G + g, i]
//       (s = 0: q at offset 0, s = 1: k at src_off / dst_off)
//
// No atomics: every sum is one thread's fixed-order loop, so the bits never change between runs.

const WG: u32 = 256u;

// generated from its description in ddl_wgpu/ops/gdn_inputs.py (`Uniform`)
{{struct Params}}

fn flat(wid: vec3<u32>, nwg: vec3<u32>, lid: u32) -> u32 {
    return (wid.x + wid.y * nwg.x) * WG + lid;
}

fn silu(x: f32) -> f32 {
    return x / (1.0 + exp(-x));
}

fn sigmoid(x: f32) -> f32 {
    return 1.0 / (1.0 + exp(-x));
}

// softplus(x) = log(1 + e^x), stable for large |x|
fn softplus(x: f32) -> f32 {
    return max(x, 0.0) + log(1.0 + exp(-abs(x)));
}

// Where channel c of row n goes in the planar conv output (k and v start at 256-byte aligned offsets, so
// each part can be bound on its own).
fn planar(n: u32, c: u32, p: Params) -> u32 {
    let q = p.qk_cols;
    if (c < q) { return n * q + c; }
    if (c < 2u * q) { return p.k_off + n * q + (c - q); }
    return p.v_off + n * p.v_cols + (c - 2u * q);
}

// ---------------------------------------------------------------------------------------------------------
// the causal conv

@group(0) @binding(0) var<storage, read> cf_x: array<f32>;
@group(0) @binding(1) var<storage, read> cf_w: array<f32>;
@group(0) @binding(2) var<storage, read> cf_hist: array<f32>;
@group(0) @binding(3) var<storage, read_write> cf_out: array<f32>;
@group(0) @binding(4) var<uniform> cf_p: Params;

// The conv's input at time t - s (s >= 0) of row n's sequence, channel c.
fn cf_in(n: u32, t: u32, s: u32, c: u32) -> f32 {
    if (t >= s) { return cf_x[(n - s) * cf_p.Ch + c]; }
    if (cf_p.has_hist == 0u) { return 0.0; }
    let b = n / cf_p.T;
    return cf_hist[(b * (cf_p.k - 1u) + (cf_p.k - 1u) + t - s) * cf_p.Ch + c];
}

@compute @workgroup_size(WG)
fn conv_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32) {
    let idx = flat(wid, nwg, lid);
    if (idx >= cf_p.rows * cf_p.Ch) { return; }
    let n = idx / cf_p.Ch;
    let c = idx - n * cf_p.Ch;
    let t = n % cf_p.T;
    let K = cf_p.k;
    var acc = 0.0;
    for (var m = 0u; m < K; m++) {
        acc += cf_w[c * K + m] * cf_in(n, t, K - 1u - m, c);
    }
    cf_out[planar(n, c, cf_p)] = silu(acc);
}

@group(0) @binding(0) var<storage, read> cp_dout: array<f32>;
@group(0) @binding(1) var<storage, read> cp_x: array<f32>;
@group(0) @binding(2) var<storage, read> cp_w: array<f32>;
@group(0) @binding(3) var<storage, read> cp_hist: array<f32>;
@group(0) @binding(4) var<storage, read_write> cp_dpre: array<f32>;
@group(0) @binding(5) var<uniform> cp_p: Params;

fn cp_in(n: u32, t: u32, s: u32, c: u32) -> f32 {
    if (t >= s) { return cp_x[(n - s) * cp_p.Ch + c]; }
    if (cp_p.has_hist == 0u) { return 0.0; }
    let b = n / cp_p.T;
    return cp_hist[(b * (cp_p.k - 1u) + (cp_p.k - 1u) + t - s) * cp_p.Ch + c];
}

@compute @workgroup_size(WG)
fn conv_backward_pre(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                     @builtin(local_invocation_index) lid: u32) {
    let idx = flat(wid, nwg, lid);
    if (idx >= cp_p.rows * cp_p.Ch) { return; }
    let n = idx / cp_p.Ch;
    let c = idx - n * cp_p.Ch;
    let t = n % cp_p.T;
    let K = cp_p.k;
    var pre = 0.0;
    for (var m = 0u; m < K; m++) {
        pre += cp_w[c * K + m] * cp_in(n, t, K - 1u - m, c);
    }
    let s = sigmoid(pre);
    // silu'(x) = s + x s (1 - s)
    cp_dpre[idx] = cp_dout[planar(n, c, cp_p)] * (s + pre * s * (1.0 - s));
}

@group(0) @binding(0) var<storage, read> cx_dpre: array<f32>;
@group(0) @binding(1) var<storage, read> cx_w: array<f32>;
@group(0) @binding(2) var<storage, read_write> cx_dx: array<f32>;
@group(0) @binding(3) var<uniform> cx_p: Params;

@compute @workgroup_size(WG)
fn conv_backward_dx(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                    @builtin(local_invocation_index) lid: u32) {
    let idx = flat(wid, nwg, lid);
    if (idx >= cx_p.rows * cx_p.Ch) { return; }
    let n = idx / cx_p.Ch;
    let c = idx - n * cx_p.Ch;
    let t = n % cx_p.T;
    let K = cx_p.k;
    var acc = 0.0;
    for (var m = 0u; m < K; m++) {
        let s = K - 1u - m;  // the input at t feeds the output at t + s
        if (t + s < cx_p.T) {
            acc += cx_w[c * K + m] * cx_dpre[(n + s) * cx_p.Ch + c];
        }
    }
    if (cx_p.accumulate != 0u) {
        acc += cx_dx[idx];
    }
    cx_dx[idx] = acc;
}

@group(0) @binding(0) var<storage, read> cg_dpre: array<f32>;
@group(0) @binding(1) var<storage, read> cg_x: array<f32>;
@group(0) @binding(2) var<storage, read> cg_hist: array<f32>;
@group(0) @binding(3) var<storage, read_write> cg_partials: array<f32>;
@group(0) @binding(4) var<uniform> cg_p: Params;

fn cg_in(n: u32, t: u32, s: u32, c: u32) -> f32 {
    if (t >= s) { return cg_x[(n - s) * cg_p.Ch + c]; }
    if (cg_p.has_hist == 0u) { return 0.0; }
    let b = n / cg_p.T;
    return cg_hist[(b * (cg_p.k - 1u) + (cg_p.k - 1u) + t - s) * cg_p.Ch + c];
}

// partials[block, c, m] = sum over the block's rows n (in order) of dpre[n, c] * x(n - (k-1-m), c)
@compute @workgroup_size(WG)
fn conv_grad_partial(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                     @builtin(local_invocation_index) lid: u32) {
    let tiles = (cg_p.Ch + WG - 1u) / WG;
    let g = wid.x + wid.y * nwg.x;
    let blk = g / tiles;
    let c = (g - blk * tiles) * WG + lid;
    if (blk >= cg_p.n_blocks || c >= cg_p.Ch) { return; }
    let K = cg_p.k;
    let r0 = blk * cg_p.rows_per_block;
    let r1 = min(cg_p.rows, r0 + cg_p.rows_per_block);
    for (var m = 0u; m < K; m++) {
        var acc = 0.0;
        for (var n = r0; n < r1; n++) {
            acc += cg_dpre[n * cg_p.Ch + c] * cg_in(n, n % cg_p.T, K - 1u - m, c);
        }
        cg_partials[(blk * cg_p.Ch + c) * K + m] = acc;
    }
}

@group(0) @binding(0) var<storage, read> cr_partials: array<f32>;
@group(0) @binding(1) var<storage, read_write> cr_dw: array<f32>;
@group(0) @binding(2) var<uniform> cr_p: Params;

@compute @workgroup_size(WG)
fn conv_grad_reduce(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                    @builtin(local_invocation_index) lid: u32) {
    let e = flat(wid, nwg, lid);  // c * k + m
    let n_w = cr_p.Ch * cr_p.k;
    if (e >= n_w) { return; }
    var acc = 0.0;
    for (var blk = 0u; blk < cr_p.n_blocks; blk++) {
        acc += cr_partials[blk * n_w + e];
    }
    if (cr_p.accumulate != 0u) {
        acc += cr_dw[e];
    }
    cr_dw[e] = acc;
}

// ---------------------------------------------------------------------------------------------------------
// the gates

@group(0) @binding(0) var<storage, read> gf_a: array<f32>;
@group(0) @binding(1) var<storage, read> gf_b: array<f32>;
@group(0) @binding(2) var<storage, read> gf_A_log: array<f32>;
@group(0) @binding(3) var<storage, read> gf_dt: array<f32>;
@group(0) @binding(4) var<storage, read_write> gf_gb: array<f32>;
@group(0) @binding(5) var<uniform> gf_p: Params;

@compute @workgroup_size(WG)
fn gates_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_index) lid: u32) {
    let idx = flat(wid, nwg, lid);  // n * Hv + h
    if (idx >= gf_p.rows * gf_p.Hv) { return; }
    let h = idx % gf_p.Hv;
    gf_gb[2u * idx] = -exp(gf_A_log[h]) * softplus(gf_a[idx] + gf_dt[h]);
    gf_gb[2u * idx + 1u] = sigmoid(gf_b[idx]);
}

@group(0) @binding(0) var<storage, read> gb_dgb: array<f32>;
@group(0) @binding(1) var<storage, read> gb_a: array<f32>;
@group(0) @binding(2) var<storage, read> gb_b: array<f32>;
@group(0) @binding(3) var<storage, read> gb_A_log: array<f32>;
@group(0) @binding(4) var<storage, read> gb_dt: array<f32>;
@group(0) @binding(5) var<storage, read_write> gb_da: array<f32>;
@group(0) @binding(6) var<storage, read_write> gb_db: array<f32>;
@group(0) @binding(7) var<storage, read_write> gb_dgg: array<f32>;
@group(0) @binding(8) var<uniform> gb_p: Params;

@compute @workgroup_size(WG)
fn gates_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_index) lid: u32) {
    let idx = flat(wid, nwg, lid);  // n * Hv + h
    if (idx >= gb_p.rows * gb_p.Hv) { return; }
    let h = idx % gb_p.Hv;
    let Dv = gb_p.Dv;
    var dg = 0.0;
    var dbeta = 0.0;
    for (var j = 0u; j < Dv; j++) {
        dg += gb_dgb[(2u * idx) * Dv + j];
        dbeta += gb_dgb[(2u * idx + 1u) * Dv + j];
    }
    let A = exp(gb_A_log[h]);
    let x = gb_a[idx] + gb_dt[h];
    let beta = sigmoid(gb_b[idx]);
    gb_da[idx] = -dg * A * sigmoid(x);  // softplus' = sigmoid
    gb_db[idx] = dbeta * beta * (1.0 - beta);
    gb_dgg[idx] = dg * (-A * softplus(x));  // dg * g: d/dA_log of g = g
}

// ---------------------------------------------------------------------------------------------------------
// the per-key-head sum of the rule's per-value-head q/k gradients

@group(0) @binding(0) var<storage, read> hs_src: array<f32>;
@group(0) @binding(1) var<storage, read_write> hs_dst: array<f32>;
@group(0) @binding(2) var<uniform> hs_p: Params;

@compute @workgroup_size(WG)
fn head_group_sum(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_index) lid: u32) {
    let Dk = hs_p.Dk;
    let Hk = hs_p.Hk;
    let half = hs_p.rows * Hk * Dk;
    let e = flat(wid, nwg, lid);  // s * half + (n * Hk + hk) * Dk + i, s = 0 (q) or 1 (k)
    if (e >= 2u * half) { return; }
    let s = e / half;
    let idx = e - s * half;
    let i = idx % Dk;
    let n_hk = idx / Dk;
    let hk = n_hk % Hk;
    let n = n_hk / Hk;
    let G = hs_p.G;
    var acc = 0.0;
    for (var g = 0u; g < G; g++) {
        acc += hs_src[s * hs_p.src_off + ((n * Hk + hk) * G + g) * Dk + i];
    }
    hs_dst[s * hs_p.dst_off + idx] = acc;
}
