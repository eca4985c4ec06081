// The Deep Delta residual update (ddl.md §1.2, §1.5, §5), per token (row r = b*T + t), d_v = DV in 1..4:
//
//   n = sqrt(|u|^2 + eps^2),  k = u / n           a = w_beta . c + b_beta,  beta = 2 sigmoid(a)
//   z = W_v x_v + b_v,        v = s sigmoid(z)     p = X^T k,  X_new = X + k (beta (v - p))^T
//
// X is (rows, C, DV) row-major, u, c, x_v are (rows, C); W_v is (DV, C). Per row the forward saves
// stats[r] = [n, beta, v_0..v_{DV-1}, p_0..p_{DV-1}] (S = 2 + 2 DV floats), which the backward and the
// spectral diagnostics read.
//
//   delta_heads            (c, x_v, w_beta, b_beta, W_v, b_v, stats, p)   stats[beta, v] of each row
//   delta_update           (X, u, X_new, stats, p)                       n, p into stats; X_new
//   delta_backward_rows    (G, X, u, stats, dX, du, da, dz, p)           dX, du, da = dL/da, dz = dL/dz
//   delta_backward_inputs  (da, dz, w_beta, W_v, dc, dx_v, p)            dc (+)= da w_beta, dx_v (+)= dz W_v
//   delta_ksum             (u, stats, weights, out, p)                   out[i] = sum_r weights[r] u[r,i] / n_r
//
// Why the forward is two dispatches and not one: fused, it would bind 10 storage buffers (8 inputs, 2
// outputs), over the portable limit of 8. The split costs no memory traffic: `delta_heads` reads only c and
// x_v (the beta and v heads), `delta_update` only X and u (normalisation, p = X^T k and the rank-1 update),
// and they exchange 1 + DV floats per row through `stats`. The backward splits the same way (12 buffers).
//
// Row kernels: one workgroup of WG threads per row (WG a power of two set by the launcher from C). Each
// thread sums a strided slice of the row; a fixed-shape tree in workgroup memory adds the slices, so the
// order of additions depends only on the shape (deterministic). The d_v components live in a vec4 (unused
// components stay 0), with DV an override so the component branches fold away: no private arrays indexed
// at run time (wgpu.md §4).
//
// Backward, with G = dL/dX_new and q = G^T k (one reduction per row):
//   dX = G - beta k q^T,  dk = beta (G delta - X q),  du = (dk - k (k . dk)) / n,
//   k . dk = beta q . (delta - p) = beta q . (v - 2p)  (closed form: no second reduction),
//   da = (delta . q) beta (1 - beta / 2),  dz = beta q * v (1 - v / s).

override WG: u32 = 256u;  // threads per row (a power of two <= 256)
override DV: u32 = 1u;    // value channels d_v, 1..4

struct Params {
    rows: u32,
    C: u32,
    eps2: f32,             // k_eps^2
    v_scale: f32,          // s
    accumulate_dc: u32,    // delta_backward_inputs: 1 adds into dc, 0 overwrites it
    accumulate_dx_v: u32,  // delta_backward_inputs: 1 adds into dx_v
    _pad0: u32,
    _pad1: u32,
}

var<workgroup> red_s: array<f32, 256>;
var<workgroup> red_v: array<vec4<f32>, 256>;

// Sums (s, v) over the WG threads of the workgroup (every thread must call it: it holds barriers).
fn wg_sum(lid: u32, s: f32, v: vec4<f32>) -> vec4<f32> {
    red_s[lid] = s;
    red_v[lid] = v;
    workgroupBarrier();
    for (var h = WG / 2u; h > 0u; h = h / 2u) {
        if (lid < h) {
            red_s[lid] = red_s[lid] + red_s[lid + h];
            red_v[lid] = red_v[lid] + red_v[lid + h];
        }
        workgroupBarrier();
    }
    return red_v[0];
}

fn row_id(wid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return wid.x + wid.y * nwg.x;
}

fn stats_size() -> u32 {
    return 2u + 2u * DV;
}

fn sigmoid(x: f32) -> f32 {
    return 1.0 / (1.0 + exp(-x));
}

// ---------------------------------------------------------------------------------------------------------
// forward, part 1: the beta and v heads.

@group(0) @binding(0) var<storage, read> hd_c: array<f32>;
@group(0) @binding(1) var<storage, read> hd_x_v: array<f32>;
@group(0) @binding(2) var<storage, read> hd_w_beta: array<f32>;
@group(0) @binding(3) var<storage, read> hd_b_beta: array<f32>;
@group(0) @binding(4) var<storage, read> hd_W_v: array<f32>;
@group(0) @binding(5) var<storage, read> hd_b_v: array<f32>;
@group(0) @binding(6) var<storage, read_write> hd_stats: array<f32>;
@group(0) @binding(7) var<uniform> hd_p: Params;

@compute @workgroup_size(WG)
fn delta_heads(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_id) lid3: vec3<u32>) {
    // Bounds guard as a flag, not an early return: every thread must reach wg_sum's barriers.
    let row = row_id(wid, nwg);
    let valid = row < hd_p.rows;
    let lid = lid3.x;
    let C = hd_p.C;
    let base = row * C;
    var a = 0.0;
    var z = vec4<f32>(0.0);
    if (valid) {
        for (var i = lid; i < C; i += WG) {
            a += hd_w_beta[i] * hd_c[base + i];
            let xv = hd_x_v[base + i];
            z.x += hd_W_v[i] * xv;
            if (DV > 1u) { z.y += hd_W_v[C + i] * xv; }
            if (DV > 2u) { z.z += hd_W_v[2u * C + i] * xv; }
            if (DV > 3u) { z.w += hd_W_v[3u * C + i] * xv; }
        }
    }
    let zt = wg_sum(lid, a, z);
    let at = red_s[0];
    if (!valid || lid != 0u) { return; }
    let sb = row * stats_size();
    hd_stats[sb + 1u] = 2.0 * sigmoid(at + hd_b_beta[0]);
    let s = hd_p.v_scale;
    hd_stats[sb + 2u] = s * sigmoid(zt.x + hd_b_v[0]);
    if (DV > 1u) { hd_stats[sb + 3u] = s * sigmoid(zt.y + hd_b_v[1]); }
    if (DV > 2u) { hd_stats[sb + 4u] = s * sigmoid(zt.z + hd_b_v[2]); }
    if (DV > 3u) { hd_stats[sb + 5u] = s * sigmoid(zt.w + hd_b_v[3]); }
}

// ---------------------------------------------------------------------------------------------------------
// forward, part 2: normalisation, p = X^T k and the rank-1 update.

@group(0) @binding(0) var<storage, read> up_X: array<f32>;
@group(0) @binding(1) var<storage, read> up_u: array<f32>;
@group(0) @binding(2) var<storage, read_write> up_X_new: array<f32>;
@group(0) @binding(3) var<storage, read_write> up_stats: array<f32>;
@group(0) @binding(4) var<uniform> up_p: Params;

fn up_load_X(e: u32) -> vec4<f32> {
    var x = vec4<f32>(up_X[e], 0.0, 0.0, 0.0);
    if (DV > 1u) { x.y = up_X[e + 1u]; }
    if (DV > 2u) { x.z = up_X[e + 2u]; }
    if (DV > 3u) { x.w = up_X[e + 3u]; }
    return x;
}

@compute @workgroup_size(WG)
fn delta_update(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_id) lid3: vec3<u32>) {
    let row = row_id(wid, nwg);
    let valid = row < up_p.rows;  // a flag: wg_sum holds barriers
    let lid = lid3.x;
    let C = up_p.C;
    let base = row * C;
    var uu = 0.0;
    var ux = vec4<f32>(0.0);  // sum_i u_i X[i, :]
    if (valid) {
        for (var i = lid; i < C; i += WG) {
            let ui = up_u[base + i];
            uu += ui * ui;
            ux += ui * up_load_X((base + i) * DV);
        }
    }
    let uxt = wg_sum(lid, uu, ux);
    let n = sqrt(red_s[0] + up_p.eps2);
    if (!valid) { return; }
    let pr = uxt / n;  // p = X^T k
    let sb = row * stats_size();
    let beta = up_stats[sb + 1u];
    var v = vec4<f32>(up_stats[sb + 2u], 0.0, 0.0, 0.0);
    if (DV > 1u) { v.y = up_stats[sb + 3u]; }
    if (DV > 2u) { v.z = up_stats[sb + 4u]; }
    if (DV > 3u) { v.w = up_stats[sb + 5u]; }
    let gamma = beta * (v - pr);  // unused components: v = p = 0
    for (var i = lid; i < C; i += WG) {
        let ki = up_u[base + i] / n;
        let e = (base + i) * DV;
        let y = up_load_X(e) + ki * gamma;
        up_X_new[e] = y.x;
        if (DV > 1u) { up_X_new[e + 1u] = y.y; }
        if (DV > 2u) { up_X_new[e + 2u] = y.z; }
        if (DV > 3u) { up_X_new[e + 3u] = y.w; }
    }
    if (lid == 0u) {
        up_stats[sb] = n;
        let pb = sb + 2u + DV;
        up_stats[pb] = pr.x;
        if (DV > 1u) { up_stats[pb + 1u] = pr.y; }
        if (DV > 2u) { up_stats[pb + 2u] = pr.z; }
        if (DV > 3u) { up_stats[pb + 3u] = pr.w; }
    }
}

// ---------------------------------------------------------------------------------------------------------
// backward, part 1 (per row): dX, du, da, dz.

@group(0) @binding(0) var<storage, read> br_G: array<f32>;
@group(0) @binding(1) var<storage, read> br_X: array<f32>;
@group(0) @binding(2) var<storage, read> br_u: array<f32>;
@group(0) @binding(3) var<storage, read> br_stats: array<f32>;
@group(0) @binding(4) var<storage, read_write> br_dX: array<f32>;
@group(0) @binding(5) var<storage, read_write> br_du: array<f32>;
@group(0) @binding(6) var<storage, read_write> br_da: array<f32>;
@group(0) @binding(7) var<storage, read_write> br_dz: array<f32>;
@group(0) @binding(8) var<uniform> br_p: Params;

fn br_load_G(e: u32) -> vec4<f32> {
    var x = vec4<f32>(br_G[e], 0.0, 0.0, 0.0);
    if (DV > 1u) { x.y = br_G[e + 1u]; }
    if (DV > 2u) { x.z = br_G[e + 2u]; }
    if (DV > 3u) { x.w = br_G[e + 3u]; }
    return x;
}

fn br_load_X(e: u32) -> vec4<f32> {
    var x = vec4<f32>(br_X[e], 0.0, 0.0, 0.0);
    if (DV > 1u) { x.y = br_X[e + 1u]; }
    if (DV > 2u) { x.z = br_X[e + 2u]; }
    if (DV > 3u) { x.w = br_X[e + 3u]; }
    return x;
}

fn br_load_stats(e: u32) -> vec4<f32> {
    var x = vec4<f32>(br_stats[e], 0.0, 0.0, 0.0);
    if (DV > 1u) { x.y = br_stats[e + 1u]; }
    if (DV > 2u) { x.z = br_stats[e + 2u]; }
    if (DV > 3u) { x.w = br_stats[e + 3u]; }
    return x;
}

@compute @workgroup_size(WG)
fn delta_backward_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                       @builtin(local_invocation_id) lid3: vec3<u32>) {
    let row = row_id(wid, nwg);
    let valid = row < br_p.rows;  // a flag: wg_sum holds barriers
    let lid = lid3.x;
    let C = br_p.C;
    let base = row * C;
    let sb = row * stats_size();
    var n = 1.0;
    var qa = vec4<f32>(0.0);  // sum_i k_i G[i, :]
    if (valid) {
        n = br_stats[sb];
        for (var i = lid; i < C; i += WG) {
            qa += (br_u[base + i] / n) * br_load_G((base + i) * DV);
        }
    }
    let q = wg_sum(lid, 0.0, qa);
    if (!valid) { return; }
    let beta = br_stats[sb + 1u];
    let v = br_load_stats(sb + 2u);
    let pr = br_load_stats(sb + 2u + DV);
    let delta = v - pr;
    let kdk = beta * dot(q, v - 2.0 * pr);  // k . dk
    let bq = beta * q;
    for (var i = lid; i < C; i += WG) {
        let ki = br_u[base + i] / n;
        let e = (base + i) * DV;
        let g = br_load_G(e);
        let dk = beta * (dot(g, delta) - dot(br_load_X(e), q));
        br_du[base + i] = (dk - ki * kdk) / n;
        let dx = g - ki * bq;
        br_dX[e] = dx.x;
        if (DV > 1u) { br_dX[e + 1u] = dx.y; }
        if (DV > 2u) { br_dX[e + 2u] = dx.z; }
        if (DV > 3u) { br_dX[e + 3u] = dx.w; }
    }
    if (lid == 0u) {
        br_da[row] = dot(delta, q) * beta * (1.0 - 0.5 * beta);
        let dz = bq * v * (1.0 - v / br_p.v_scale);
        let zb = row * DV;
        br_dz[zb] = dz.x;
        if (DV > 1u) { br_dz[zb + 1u] = dz.y; }
        if (DV > 2u) { br_dz[zb + 2u] = dz.z; }
        if (DV > 3u) { br_dz[zb + 3u] = dz.w; }
    }
}

// ---------------------------------------------------------------------------------------------------------
// backward, part 2 (elementwise over (row, i)): the gradients of the heads' inputs c and x_v.

@group(0) @binding(0) var<storage, read> bi_da: array<f32>;
@group(0) @binding(1) var<storage, read> bi_dz: array<f32>;
@group(0) @binding(2) var<storage, read> bi_w_beta: array<f32>;
@group(0) @binding(3) var<storage, read> bi_W_v: array<f32>;
@group(0) @binding(4) var<storage, read_write> bi_dc: array<f32>;
@group(0) @binding(5) var<storage, read_write> bi_dx_v: array<f32>;
@group(0) @binding(6) var<uniform> bi_p: Params;

@compute @workgroup_size(WG)
fn delta_backward_inputs(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                         @builtin(local_invocation_id) lid3: vec3<u32>) {
    let C = bi_p.C;
    let idx = row_id(wid, nwg) * WG + lid3.x;
    if (idx >= bi_p.rows * C) { return; }
    let row = idx / C;
    let i = idx - row * C;
    var dc = bi_da[row] * bi_w_beta[i];
    let zb = row * DV;
    var dxv = bi_dz[zb] * bi_W_v[i];
    if (DV > 1u) { dxv += bi_dz[zb + 1u] * bi_W_v[C + i]; }
    if (DV > 2u) { dxv += bi_dz[zb + 2u] * bi_W_v[2u * C + i]; }
    if (DV > 3u) { dxv += bi_dz[zb + 3u] * bi_W_v[3u * C + i]; }
    if (bi_p.accumulate_dc != 0u) { dc += bi_dc[idx]; }
    if (bi_p.accumulate_dx_v != 0u) { dxv += bi_dx_v[idx]; }
    bi_dc[idx] = dc;
    bi_dx_v[idx] = dxv;
}

// ---------------------------------------------------------------------------------------------------------
// spectral k-coherence: out[i] = sum_r weights[r] * u[r, i] / n_r. A workgroup covers KW adjacent channels
// times WG / KW row lanes; lane l sums rows l, l + WG/KW, ... in order, then a fixed tree adds the lanes.

const KW: u32 = 8u;  // channels per ksum workgroup

@group(0) @binding(0) var<storage, read> ks_u: array<f32>;
@group(0) @binding(1) var<storage, read> ks_stats: array<f32>;
@group(0) @binding(2) var<storage, read> ks_weights: array<f32>;
@group(0) @binding(3) var<storage, read_write> ks_out: array<f32>;
@group(0) @binding(4) var<uniform> ks_p: Params;

@compute @workgroup_size(WG)
fn delta_ksum(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_id) lid3: vec3<u32>) {
    let C = ks_p.C;
    let wg = row_id(wid, nwg);
    if (wg * KW >= C) { return; }  // the same for the whole workgroup, so the barriers stay uniform
    let lid = lid3.x;
    let i = wg * KW + lid % KW;
    let lane = lid / KW;
    let lanes = WG / KW;
    let S = stats_size();
    var s = 0.0;
    if (i < C) {
        for (var r = lane; r < ks_p.rows; r += lanes) {
            s += ks_weights[r] * (ks_u[r * C + i] / ks_stats[r * S]);
        }
    }
    red_s[lid] = s;
    workgroupBarrier();
    for (var h = lanes / 2u; h > 0u; h = h / 2u) {
        if (lane < h) {
            red_s[lid] = red_s[lid] + red_s[lid + h * KW];
        }
        workgroupBarrier();
    }
    if (lane == 0u && i < C) {
        ks_out[i] = red_s[lid];
    }
}
