// RMSNorm over the last axis of x (rows, C), row-major:
//   rstd = 1 / sqrt(mean(x^2) + eps),  xhat = x * rstd,  out = weff * xhat,
//   weff = w ("standard", Llama/Qwen3) or 1 + w ("offset", Gemma/Qwen3.5).
// Also the per-head q/k norm: rows = B * T * heads, C = head_dim.
//
//   rmsnorm_forward              (x, w, out, rstd, p)            out (rows, C), rstd (rows,) for the backward
//   rmsnorm_backward             (dout, x, w, rstd, dx, p)       dx (+)= rstd * (g*weff - xhat * mean(g*weff*xhat))
//   rmsnorm_backward_dw_partial  (dout, x, rstd, partials, p)    partials[b, c] = sum over row block b of dout*xhat
//   rmsnorm_backward_dw_reduce   (partials, dw, p)               dw[c] (+)= sum over b of partials[b, c]
//
// Row kernels: a workgroup of WG threads holds WG / TPR rows, TPR threads per row (TPR a power of two, set
// by the launcher from C through the `TPR` override, so a head_dim of 16 does not idle 240 of 256 threads).
// Each thread sums a strided slice of its row, then a tree reduction in workgroup memory adds the TPR slices.
// The dw reduction is two passes over fixed row blocks (style rule 9): no float atomics, and the summation
// order depends only on the shape, so two runs give the same bits.

const WG: u32 = 256u;
override TPR: u32 = 256u;  // threads per row; a power of two <= WG

struct Params {
    rows: u32,
    C: u32,
    eps: f32,
    style: u32,           // 0 standard (w), 1 offset (1 + w)
    accumulate_dx: u32,   // backward: 1 adds into dx, 0 overwrites it
    accumulate_dw: u32,   // dw reduce: 1 adds into dw, 0 overwrites it
    rows_per_block: u32,  // dw partials: rows summed by one partial
    n_blocks: u32,        // dw partials: ceil(rows / rows_per_block)
}

var<workgroup> red: array<f32, WG>;

fn weff(w: f32, style: u32) -> f32 {
    return select(w, 1.0 + w, style != 0u);
}

// Sum of `v` over the TPR threads of this thread's row (every thread of the workgroup must call it: it
// holds barriers). The tree halves the active lanes each round, so the order of the additions is fixed.
fn row_sum(lid: u32, v: f32) -> f32 {
    let lane = lid % TPR;
    red[lid] = v;
    workgroupBarrier();
    for (var s = TPR / 2u; s > 0u; s = s / 2u) {
        if (lane < s) {
            red[lid] = red[lid] + red[lid + s];
        }
        workgroupBarrier();
    }
    return red[lid - lane];
}

fn row_of(wid: vec3<u32>, nwg: vec3<u32>, lid: u32) -> u32 {
    return (wid.x + wid.y * nwg.x) * (WG / TPR) + lid / TPR;
}

// ---------------------------------------------------------------------------------------------------------

@group(0) @binding(0) var<storage, read> fw_x: array<f32>;
@group(0) @binding(1) var<storage, read> fw_w: array<f32>;
@group(0) @binding(2) var<storage, read_write> fw_out: array<f32>;
@group(0) @binding(3) var<storage, read_write> fw_rstd: array<f32>;
@group(0) @binding(4) var<uniform> fw_p: Params;

@compute @workgroup_size(WG)
fn rmsnorm_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_id) lid: vec3<u32>) {
    // Bounds guard as a flag, not an early return: every thread must reach row_sum's barriers.
    let row = row_of(wid, nwg, lid.x);
    let valid = row < fw_p.rows;
    let lane = lid.x % TPR;
    let C = fw_p.C;
    let base = row * C;
    var ss = 0.0;
    if (valid) {
        for (var c = lane; c < C; c += TPR) {
            let v = fw_x[base + c];
            ss += v * v;
        }
    }
    let total = row_sum(lid.x, ss);
    if (!valid) { return; }
    let r = 1.0 / sqrt(total / f32(C) + fw_p.eps);
    for (var c = lane; c < C; c += TPR) {
        fw_out[base + c] = weff(fw_w[c], fw_p.style) * (fw_x[base + c] * r);
    }
    if (lane == 0u) {
        fw_rstd[row] = r;
    }
}

// ---------------------------------------------------------------------------------------------------------

@group(0) @binding(0) var<storage, read> bw_dout: array<f32>;
@group(0) @binding(1) var<storage, read> bw_x: array<f32>;
@group(0) @binding(2) var<storage, read> bw_w: array<f32>;
@group(0) @binding(3) var<storage, read> bw_rstd: array<f32>;
@group(0) @binding(4) var<storage, read_write> bw_dx: array<f32>;
@group(0) @binding(5) var<uniform> bw_p: Params;

@compute @workgroup_size(WG)
fn rmsnorm_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                    @builtin(local_invocation_id) lid: vec3<u32>) {
    let row = row_of(wid, nwg, lid.x);
    let valid = row < bw_p.rows;  // a flag, as in the forward: row_sum holds barriers
    let lane = lid.x % TPR;
    let C = bw_p.C;
    let base = row * C;
    var r = 0.0;
    var dot = 0.0;  // sum over the row of (dout * weff) * xhat
    if (valid) {
        r = bw_rstd[row];
        for (var c = lane; c < C; c += TPR) {
            dot += bw_dout[base + c] * weff(bw_w[c], bw_p.style) * (bw_x[base + c] * r);
        }
    }
    let mean = row_sum(lid.x, dot) / f32(C);
    if (!valid) { return; }
    for (var c = lane; c < C; c += TPR) {
        let g = bw_dout[base + c] * weff(bw_w[c], bw_p.style);
        var d = r * (g - bw_x[base + c] * r * mean);
        if (bw_p.accumulate_dx != 0u) {
            d += bw_dx[base + c];
        }
        bw_dx[base + c] = d;
    }
}

// ---------------------------------------------------------------------------------------------------------
// dw, pass 1: one thread per (row block b, channel c), adjacent threads on adjacent channels.

@group(0) @binding(0) var<storage, read> p1_dout: array<f32>;
@group(0) @binding(1) var<storage, read> p1_x: array<f32>;
@group(0) @binding(2) var<storage, read> p1_rstd: array<f32>;
@group(0) @binding(3) var<storage, read_write> p1_partials: array<f32>;
@group(0) @binding(4) var<uniform> p1_p: Params;

@compute @workgroup_size(WG)
fn rmsnorm_backward_dw_partial(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                               @builtin(local_invocation_id) lid: vec3<u32>) {
    let gid = (wid.x + wid.y * nwg.x) * WG + lid.x;
    let C = p1_p.C;
    if (gid >= p1_p.n_blocks * C) { return; }
    let b = gid / C;
    let c = gid - b * C;
    let r0 = b * p1_p.rows_per_block;
    let r1 = min(r0 + p1_p.rows_per_block, p1_p.rows);
    var s = 0.0;
    for (var r = r0; r < r1; r++) {
        s += p1_dout[r * C + c] * (p1_x[r * C + c] * p1_rstd[r]);
    }
    p1_partials[gid] = s;
}

// ---------------------------------------------------------------------------------------------------------
// dw, pass 2: one thread per channel sums the blocks in order 0, 1, ..., n_blocks - 1.

@group(0) @binding(0) var<storage, read> p2_partials: array<f32>;
@group(0) @binding(1) var<storage, read_write> p2_dw: array<f32>;
@group(0) @binding(2) var<uniform> p2_p: Params;

@compute @workgroup_size(WG)
fn rmsnorm_backward_dw_reduce(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                              @builtin(local_invocation_id) lid: vec3<u32>) {
    let c = (wid.x + wid.y * nwg.x) * WG + lid.x;
    let C = p2_p.C;
    if (c >= C) { return; }
    var s = 0.0;
    for (var b = 0u; b < p2_p.n_blocks; b++) {
        s += p2_partials[b * C + c];
    }
    if (p2_p.accumulate_dw != 0u) {
        s += p2_dw[c];
    }
    p2_dw[c] = s;
}
