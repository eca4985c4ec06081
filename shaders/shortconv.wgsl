// The d_v > 1 state's short convolutions: the TC and CC compressors (state -> x_in), the EC expander and
// plain repetition (embedding -> state). Reference: `ddl_ref.shortconv`; the math:
// docs/model.md#the-expanded-state-d_v--4-expansion-compressors-readout.
//
// Layout: rows r = b*T + t; the state X is (rows, C, dv) row-major, x_in / e are (rows, C). Conv weights:
//   TC, EC  conv (C*dv, k): channel i*dv + j, tap m multiplies time t - (k-1-m) (tap k-1 = the current
//           token); a row's history stops at t = 0 of its own sequence (t = r % T), zeros before.
//   CC      conv (C, dv): y[i, j] = sum_m conv[i, m] X[i, j + m - pad_left], pad_left = (dv-1)/2, zero
//           outside 0..dv-1.
//   read    (dv,): x_in[i] = sum_j read[j] y[i, j].
//
//   tc_forward / cc_forward      (X, conv, read, x_in, p)        thread per (row, i)
//   tc_backward_dX / cc_...      (dx_in, conv, read, dX, p)      thread per (row, i, j); dX (+)=
//   ec_forward                   (e, conv, X0, p)                thread per (row, i, j)
//   ec_backward_de               (dX0, conv, de, p)              thread per (row, i); de (+)=
//   repeat_forward / _backward   (e, X0, p) / (dX0, de, p)
//   tc_grad_partial / cc_...     (dx_in, X, conv, read, partials, p)   parameter-gradient pass 1
//   ec_grad_partial              (dX0, e, partials, p)                 parameter-gradient pass 1
//   colsum                       (partials, out, p)                    parameter-gradient pass 2
//
// Parameter gradients (no float atomics, docs/kernels.md#deterministic-reductions): pass 1 writes
// partials[b, col] = the sum over row block b of one "column" value per row, a column being one dconv entry
// (col < n_conv) or one (i, j) of the read gradient's integrand dx_in[r, i] * y[r, i, j] (col >= n_conv). A
// workgroup covers CW adjacent columns times WG / CW row lanes; each lane sums its rows in order, a fixed
// tree adds the lanes. Pass 2 (`colsum`) sums, per output o, the items
// partials[b * width + off + o * ostride + e * istride] over blocks b and e < n_inner in a fixed order
// (n_inner = C for dread: it also sums over the features i) and adds the total into the gradient. Launch
// sizes depend only on the shape, so the bits never change between runs.

const WG: u32 = 256u;
override CW: u32 = 32u;  // columns per workgroup in the two gradient passes; a power of two <= WG

// generated from its description in ddl_wgpu/ops/shortconv.py (`Uniform`)
{{struct Params}}

var<workgroup> red: array<f32, WG>;

fn linear_id(wid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return wid.x + wid.y * nwg.x;
}

// Sum of `v` over the WG / CW lanes of each column; meaningful in lane 0 (lid < CW).
fn col_sum(lid: u32, v: f32) -> f32 {
    let lane = lid / CW;
    red[lid] = v;
    workgroupBarrier();
    for (var s = (WG / CW) / 2u; s > 0u; s = s / 2u) {
        if (lane < s) {
            red[lid] = red[lid] + red[lid + s * CW];
        }
        workgroupBarrier();
    }
    return red[lid];
}

// ---------------------------------------------------------------------------------------------------------
// TC: x_in[r, i] = sum_j read[j] sum_m conv[i*dv + j, m] X[r - (k-1-m), i, j]  (within r's sequence)

@group(0) @binding(0) var<storage, read> tf_X: array<f32>;
@group(0) @binding(1) var<storage, read> tf_conv: array<f32>;
@group(0) @binding(2) var<storage, read> tf_read: array<f32>;
@group(0) @binding(3) var<storage, read_write> tf_x_in: array<f32>;
@group(0) @binding(4) var<uniform> tf_p: Params;

@compute @workgroup_size(WG)
fn tc_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_id) lid: vec3<u32>) {
    let C = tf_p.C;
    let idx = linear_id(wid, nwg) * WG + lid.x;
    if (idx >= tf_p.rows * C) { return; }
    let r = idx / C;
    let i = idx - r * C;
    let t = r % tf_p.T;
    let dv = tf_p.dv;
    let K = tf_p.k;
    var acc = 0.0;
    for (var j = 0u; j < dv; j++) {
        let ch = (i * dv + j) * K;
        var y = 0.0;
        for (var m = 0u; m < K; m++) {
            let s = K - 1u - m;
            if (t >= s) {
                y += tf_conv[ch + m] * tf_X[((r - s) * C + i) * dv + j];
            }
        }
        acc += tf_read[j] * y;
    }
    tf_x_in[idx] = acc;
}

// dX[r, i, j] (+)= read[j] sum_m conv[i*dv + j, m] dx_in[r + (k-1-m), i]  (within r's sequence)

@group(0) @binding(0) var<storage, read> tb_dx_in: array<f32>;
@group(0) @binding(1) var<storage, read> tb_conv: array<f32>;
@group(0) @binding(2) var<storage, read> tb_read: array<f32>;
@group(0) @binding(3) var<storage, read_write> tb_dX: array<f32>;
@group(0) @binding(4) var<uniform> tb_p: Params;

@compute @workgroup_size(WG)
fn tc_backward_dX(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_id) lid: vec3<u32>) {
    let C = tb_p.C;
    let dv = tb_p.dv;
    let idx = linear_id(wid, nwg) * WG + lid.x;
    if (idx >= tb_p.rows * C * dv) { return; }
    let ri = idx / dv;
    let j = idx - ri * dv;
    let r = ri / C;
    let i = ri - r * C;
    let t = r % tb_p.T;
    let K = tb_p.k;
    let ch = (i * dv + j) * K;
    var acc = 0.0;
    for (var m = 0u; m < K; m++) {
        let s = K - 1u - m;
        if (t + s < tb_p.T) {
            acc += tb_conv[ch + m] * tb_dx_in[(r + s) * C + i];
        }
    }
    var d = tb_read[j] * acc;
    if (tb_p.accumulate != 0u) { d += tb_dX[idx]; }
    tb_dX[idx] = d;
}

// pass 1. Columns: dconv (col < C*dv*k; col = (i*dv + j)*k + m): sum_r [t >= s] X[r - s, i, j] dx_in[r, i],
// times read[j]; then dread's integrand (col = C*dv*k + i*dv + j): dx_in[r, i] y[r, i, j].

@group(0) @binding(0) var<storage, read> tg_dx_in: array<f32>;
@group(0) @binding(1) var<storage, read> tg_X: array<f32>;
@group(0) @binding(2) var<storage, read> tg_conv: array<f32>;
@group(0) @binding(3) var<storage, read> tg_read: array<f32>;
@group(0) @binding(4) var<storage, read_write> tg_partials: array<f32>;
@group(0) @binding(5) var<uniform> tg_p: Params;

@compute @workgroup_size(WG)
fn tc_grad_partial(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_id) lid: vec3<u32>) {
    let W = tg_p.width;
    let n_chunks = (W + CW - 1u) / CW;
    let wg = linear_id(wid, nwg);
    if (wg >= tg_p.n_blocks * n_chunks) { return; }  // uniform over the workgroup: barriers stay uniform
    let b = wg / n_chunks;
    let col = (wg - b * n_chunks) * CW + lid.x % CW;
    let lane = lid.x / CW;
    let C = tg_p.C;
    let dv = tg_p.dv;
    let K = tg_p.k;
    let T = tg_p.T;
    let n_conv = C * dv * K;
    let r1 = min((b + 1u) * tg_p.rows_per_block, tg_p.rows);
    var acc = 0.0;
    if (col < n_conv) {
        let ij = col / K;
        let s = K - 1u - (col - ij * K);
        let i = ij / dv;
        let j = ij - i * dv;
        for (var r = b * tg_p.rows_per_block + lane; r < r1; r += WG / CW) {
            if (r % T >= s) {
                acc += tg_X[((r - s) * C + i) * dv + j] * tg_dx_in[r * C + i];
            }
        }
        acc *= tg_read[j];
    } else if (col < W) {
        let ij = col - n_conv;
        let i = ij / dv;
        let j = ij - i * dv;
        for (var r = b * tg_p.rows_per_block + lane; r < r1; r += WG / CW) {
            let t = r % T;
            var y = 0.0;
            for (var m = 0u; m < K; m++) {
                let s = K - 1u - m;
                if (t >= s) {
                    y += tg_conv[ij * K + m] * tg_X[((r - s) * C + i) * dv + j];
                }
            }
            acc += tg_dx_in[r * C + i] * y;
        }
    }
    let total = col_sum(lid.x, acc);
    if (lane == 0u && col < W) {
        tg_partials[b * W + col] = total;
    }
}

// ---------------------------------------------------------------------------------------------------------
// CC: y[r, i, j] = sum_m conv[i, m] X[r, i, j + m - pad_left];  x_in[r, i] = sum_j read[j] y[r, i, j]

@group(0) @binding(0) var<storage, read> cf_X: array<f32>;
@group(0) @binding(1) var<storage, read> cf_conv: array<f32>;
@group(0) @binding(2) var<storage, read> cf_read: array<f32>;
@group(0) @binding(3) var<storage, read_write> cf_x_in: array<f32>;
@group(0) @binding(4) var<uniform> cf_p: Params;

@compute @workgroup_size(WG)
fn cc_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_id) lid: vec3<u32>) {
    let C = cf_p.C;
    let idx = linear_id(wid, nwg) * WG + lid.x;
    if (idx >= cf_p.rows * C) { return; }
    let dv = cf_p.dv;
    let K = cf_p.k;
    let i = idx % C;
    let xb = idx * dv;  // X[r, i, 0]
    var acc = 0.0;
    for (var j = 0u; j < dv; j++) {
        var y = 0.0;
        for (var m = 0u; m < K; m++) {
            let src = i32(j + m) - i32(cf_p.pad_left);
            if (src >= 0 && src < i32(dv)) {
                y += cf_conv[i * K + m] * cf_X[xb + u32(src)];
            }
        }
        acc += cf_read[j] * y;
    }
    cf_x_in[idx] = acc;
}

// dX[r, i, j'] (+)= sum_m conv[i, m] read[j' - o] dx_in[r, i], o = m - pad_left, 0 <= j' - o < dv

@group(0) @binding(0) var<storage, read> cb_dx_in: array<f32>;
@group(0) @binding(1) var<storage, read> cb_conv: array<f32>;
@group(0) @binding(2) var<storage, read> cb_read: array<f32>;
@group(0) @binding(3) var<storage, read_write> cb_dX: array<f32>;
@group(0) @binding(4) var<uniform> cb_p: Params;

@compute @workgroup_size(WG)
fn cc_backward_dX(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_id) lid: vec3<u32>) {
    let C = cb_p.C;
    let dv = cb_p.dv;
    let idx = linear_id(wid, nwg) * WG + lid.x;
    if (idx >= cb_p.rows * C * dv) { return; }
    let ri = idx / dv;  // r * C + i
    let jp = idx - ri * dv;
    let i = ri % C;
    let K = cb_p.k;
    var acc = 0.0;
    for (var m = 0u; m < K; m++) {
        let j = i32(jp) - i32(m) + i32(cb_p.pad_left);  // j' - o
        if (j >= 0 && j < i32(dv)) {
            acc += cb_conv[i * K + m] * cb_read[u32(j)];
        }
    }
    var d = acc * cb_dx_in[ri];
    if (cb_p.accumulate != 0u) { d += cb_dX[idx]; }
    cb_dX[idx] = d;
}

// pass 1. Columns: dconv (col = i*k + m < C*k): sum_j X[r, i, j + o] read[j] dx_in[r, i]; then dread's
// integrand (col = C*k + i*dv + j): dx_in[r, i] y[r, i, j].

@group(0) @binding(0) var<storage, read> cg_dx_in: array<f32>;
@group(0) @binding(1) var<storage, read> cg_X: array<f32>;
@group(0) @binding(2) var<storage, read> cg_conv: array<f32>;
@group(0) @binding(3) var<storage, read> cg_read: array<f32>;
@group(0) @binding(4) var<storage, read_write> cg_partials: array<f32>;
@group(0) @binding(5) var<uniform> cg_p: Params;

@compute @workgroup_size(WG)
fn cc_grad_partial(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_id) lid: vec3<u32>) {
    let W = cg_p.width;
    let n_chunks = (W + CW - 1u) / CW;
    let wg = linear_id(wid, nwg);
    if (wg >= cg_p.n_blocks * n_chunks) { return; }  // uniform over the workgroup
    let b = wg / n_chunks;
    let col = (wg - b * n_chunks) * CW + lid.x % CW;
    let lane = lid.x / CW;
    let C = cg_p.C;
    let dv = cg_p.dv;
    let K = cg_p.k;
    let pl = i32(cg_p.pad_left);
    let n_conv = C * K;
    let r1 = min((b + 1u) * cg_p.rows_per_block, cg_p.rows);
    var acc = 0.0;
    if (col < n_conv) {
        let i = col / K;
        let o = i32(col - i * K) - pl;
        for (var r = b * cg_p.rows_per_block + lane; r < r1; r += WG / CW) {
            let xb = (r * C + i) * dv;
            var sx = 0.0;
            for (var j = 0u; j < dv; j++) {
                let src = i32(j) + o;
                if (src >= 0 && src < i32(dv)) {
                    sx += cg_X[xb + u32(src)] * cg_read[j];
                }
            }
            acc += sx * cg_dx_in[r * C + i];
        }
    } else if (col < W) {
        let ij = col - n_conv;
        let i = ij / dv;
        let j = ij - i * dv;
        for (var r = b * cg_p.rows_per_block + lane; r < r1; r += WG / CW) {
            let xb = (r * C + i) * dv;
            var y = 0.0;
            for (var m = 0u; m < K; m++) {
                let src = i32(j + m) - pl;
                if (src >= 0 && src < i32(dv)) {
                    y += cg_conv[i * K + m] * cg_X[xb + u32(src)];
                }
            }
            acc += cg_dx_in[r * C + i] * y;
        }
    }
    let total = col_sum(lid.x, acc);
    if (lane == 0u && col < W) {
        cg_partials[b * W + col] = total;
    }
}

// ---------------------------------------------------------------------------------------------------------
// EC: X0[r, i, j] = sum_m conv[i*dv + j, m] e[r - (k-1-m), i]  (within r's sequence)

@group(0) @binding(0) var<storage, read> ef_e: array<f32>;
@group(0) @binding(1) var<storage, read> ef_conv: array<f32>;
@group(0) @binding(2) var<storage, read_write> ef_X0: array<f32>;
@group(0) @binding(3) var<uniform> ef_p: Params;

@compute @workgroup_size(WG)
fn ec_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_id) lid: vec3<u32>) {
    let C = ef_p.C;
    let dv = ef_p.dv;
    let idx = linear_id(wid, nwg) * WG + lid.x;
    if (idx >= ef_p.rows * C * dv) { return; }
    let ri = idx / dv;
    let r = ri / C;
    let i = ri - r * C;
    let t = r % ef_p.T;
    let K = ef_p.k;
    let ch = (idx % (C * dv)) * K;  // (i*dv + j) * k
    var acc = 0.0;
    for (var m = 0u; m < K; m++) {
        let s = K - 1u - m;
        if (t >= s) {
            acc += ef_conv[ch + m] * ef_e[(r - s) * C + i];
        }
    }
    ef_X0[idx] = acc;
}

// de[r, i] (+)= sum_j sum_m conv[i*dv + j, m] dX0[r + (k-1-m), i, j]  (within r's sequence)

@group(0) @binding(0) var<storage, read> eb_dX0: array<f32>;
@group(0) @binding(1) var<storage, read> eb_conv: array<f32>;
@group(0) @binding(2) var<storage, read_write> eb_de: array<f32>;
@group(0) @binding(3) var<uniform> eb_p: Params;

@compute @workgroup_size(WG)
fn ec_backward_de(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_id) lid: vec3<u32>) {
    let C = eb_p.C;
    let idx = linear_id(wid, nwg) * WG + lid.x;
    if (idx >= eb_p.rows * C) { return; }
    let r = idx / C;
    let i = idx - r * C;
    let t = r % eb_p.T;
    let dv = eb_p.dv;
    let K = eb_p.k;
    var acc = 0.0;
    for (var j = 0u; j < dv; j++) {
        let ch = (i * dv + j) * K;
        for (var m = 0u; m < K; m++) {
            let s = K - 1u - m;
            if (t + s < eb_p.T) {
                acc += eb_conv[ch + m] * eb_dX0[((r + s) * C + i) * dv + j];
            }
        }
    }
    if (eb_p.accumulate != 0u) { acc += eb_de[idx]; }
    eb_de[idx] = acc;
}

// pass 1. Columns: dconv (col = (i*dv + j)*k + m): sum_r [t >= s] e[r - s, i] dX0[r, i, j].

@group(0) @binding(0) var<storage, read> eg_dX0: array<f32>;
@group(0) @binding(1) var<storage, read> eg_e: array<f32>;
@group(0) @binding(2) var<storage, read_write> eg_partials: array<f32>;
@group(0) @binding(3) var<uniform> eg_p: Params;

@compute @workgroup_size(WG)
fn ec_grad_partial(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_id) lid: vec3<u32>) {
    let W = eg_p.width;
    let n_chunks = (W + CW - 1u) / CW;
    let wg = linear_id(wid, nwg);
    if (wg >= eg_p.n_blocks * n_chunks) { return; }  // uniform over the workgroup
    let b = wg / n_chunks;
    let col = (wg - b * n_chunks) * CW + lid.x % CW;
    let lane = lid.x / CW;
    let C = eg_p.C;
    let dv = eg_p.dv;
    let K = eg_p.k;
    let r1 = min((b + 1u) * eg_p.rows_per_block, eg_p.rows);
    var acc = 0.0;
    if (col < W) {
        let ij = col / K;
        let s = K - 1u - (col - ij * K);
        let i = ij / dv;
        for (var r = b * eg_p.rows_per_block + lane; r < r1; r += WG / CW) {
            if (r % eg_p.T >= s) {
                acc += eg_e[(r - s) * C + i] * eg_dX0[r * C * dv + ij];
            }
        }
    }
    let total = col_sum(lid.x, acc);
    if (lane == 0u && col < W) {
        eg_partials[b * W + col] = total;
    }
}

// ---------------------------------------------------------------------------------------------------------
// repetition (no EC): X0[r, i, j] = e[r, i];  de[r, i] = sum_j dX0[r, i, j]

@group(0) @binding(0) var<storage, read> rf_e: array<f32>;
@group(0) @binding(1) var<storage, read_write> rf_X0: array<f32>;
@group(0) @binding(2) var<uniform> rf_p: Params;

@compute @workgroup_size(WG)
fn repeat_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_id) lid: vec3<u32>) {
    let idx = linear_id(wid, nwg) * WG + lid.x;
    if (idx >= rf_p.rows * rf_p.C * rf_p.dv) { return; }
    rf_X0[idx] = rf_e[idx / rf_p.dv];
}

@group(0) @binding(0) var<storage, read> rb_dX0: array<f32>;
@group(0) @binding(1) var<storage, read_write> rb_de: array<f32>;
@group(0) @binding(2) var<uniform> rb_p: Params;

@compute @workgroup_size(WG)
fn repeat_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_id) lid: vec3<u32>) {
    let idx = linear_id(wid, nwg) * WG + lid.x;
    if (idx >= rb_p.rows * rb_p.C) { return; }
    let dv = rb_p.dv;
    var acc = 0.0;
    for (var j = 0u; j < dv; j++) {
        acc += rb_dX0[idx * dv + j];
    }
    rb_de[idx] = acc;
}

// ---------------------------------------------------------------------------------------------------------
// pass 2: out[o] (+)= sum over blocks b and e < n_inner of partials[b*width + off + o*ostride + e*istride].

@group(0) @binding(0) var<storage, read> cs_partials: array<f32>;
@group(0) @binding(1) var<storage, read_write> cs_out: array<f32>;
@group(0) @binding(2) var<uniform> cs_p: Params;

@compute @workgroup_size(WG)
fn colsum(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_id) lid: vec3<u32>) {
    let wg = linear_id(wid, nwg);
    if (wg * CW >= cs_p.n_out) { return; }  // uniform over the workgroup
    let o = wg * CW + lid.x % CW;
    let lane = lid.x / CW;
    let E = cs_p.n_inner;
    var acc = 0.0;
    if (o < cs_p.n_out) {
        let base = cs_p.off + o * cs_p.ostride;
        for (var it = lane; it < cs_p.n_blocks * E; it += WG / CW) {
            let b = it / E;
            acc += cs_partials[b * cs_p.width + base + (it - b * E) * cs_p.istride];
        }
    }
    let total = col_sum(lid.x, acc);
    if (lane == 0u && o < cs_p.n_out) {
        if (cs_p.accumulate != 0u) {
            cs_out[o] = cs_out[o] + total;
        } else {
            cs_out[o] = total;
        }
    }
}
