// RMSNorm over the last axis of x (rows, C), row-major:
//   rstd = 1 / sqrt(mean(x^2) + eps),  xhat = x * rstd,  out = weff * xhat,
//   weff = w ("standard", Llama/Qwen3) or 1 + w ("offset", Gemma/Qwen3.5).
// Also the per-head q/k norm: rows = B * T * heads, C = head_dim.
//
//   rmsnorm_forward              (x, w, out, rstd, p)            out (rows, C), rstd (rows,) for the backward
//   rmsnorm_backward             (dout, x, w, rstd, dx, p)       dx (+)= rstd * (g*weff - xhat * mean(g*weff*xhat))
//   rmsnorm_backward_dw_partial  (dout, x, rstd, partials, p)    partials[b, c] = sum over row block b of dout*xhat
//   rmsnorm_backward_dw_reduce   (partials, dw, p)               dw[c] (+)= sum over blocks b of partials[b, c]
//
// Row kernels: a workgroup of WG threads holds WG / TPR rows, TPR threads per row (TPR a power of two, set
// by the launcher from C through the `TPR` override: about 4 items per thread, so a head_dim of 128 takes
// 32 threads and a short tree instead of idling most of a 256-thread workgroup on barriers).
// Each thread sums a strided slice of its row, then a tree reduction in workgroup memory adds the TPR slices.
// The dw reduction is two passes over fixed row blocks (style rule 9): no float atomics, and the summation
// order depends only on the shape, so two runs give the same bits.
//
// Template: an item is F = f32, or vec4<f32> (4 adjacent channels) when C % 4 == 0; HSUM adds the lanes of
// an item. Params.C is the true channel count; the kernels walk C / LANES items per row.

const WG: u32 = 256u;
alias F = {{F}};
const LANES: u32 = {{LANES}}u;
override TPR: u32 = 256u;  // threads per row; a power of two <= WG

struct Params {
    rows: u32,
    C: u32,               // channels (not items of F)
    eps: f32,
    style: u32,           // 0 standard (w), 1 offset (1 + w)
    accumulate_dx: u32,   // backward: 1 adds into dx, 0 overwrites it
    accumulate_dw: u32,   // dw reduce: 1 adds into dw, 0 overwrites it
    rows_per_block: u32,  // dw partials: rows summed by one partial
    n_blocks: u32,        // dw partials: ceil(rows / rows_per_block)
}

var<workgroup> red: array<f32, WG>;   // row kernels
var<workgroup> redv: array<F, WG>;    // dw passes

fn hsum(v: F) -> f32 {
    return {{HSUM}};
}

fn weff(w: F, style: u32) -> F {
    return select(w, F(1.0) + w, style != 0u);
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

@group(0) @binding(0) var<storage, read> fw_x: array<F>;
@group(0) @binding(1) var<storage, read> fw_w: array<F>;
@group(0) @binding(2) var<storage, read_write> fw_out: array<F>;
@group(0) @binding(3) var<storage, read_write> fw_rstd: array<f32>;
@group(0) @binding(4) var<uniform> fw_p: Params;

@compute @workgroup_size(WG)
fn rmsnorm_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_id) lid: vec3<u32>) {
    // Bounds guard as a flag, not an early return: every thread must reach row_sum's barriers.
    let row = row_of(wid, nwg, lid.x);
    let valid = row < fw_p.rows;
    let lane = lid.x % TPR;
    let C = fw_p.C / LANES;
    let base = row * C;
    var ss = 0.0;
    if (valid) {
        for (var c = lane; c < C; c += TPR) {
            let v = fw_x[base + c];
            ss += hsum(v * v);
        }
    }
    let total = row_sum(lid.x, ss);
    if (!valid) { return; }
    let r = 1.0 / sqrt(total / f32(fw_p.C) + fw_p.eps);
    for (var c = lane; c < C; c += TPR) {
        fw_out[base + c] = weff(fw_w[c], fw_p.style) * (fw_x[base + c] * r);
    }
    if (lane == 0u) {
        fw_rstd[row] = r;
    }
}

// ---------------------------------------------------------------------------------------------------------

@group(0) @binding(0) var<storage, read> bw_dout: array<F>;
@group(0) @binding(1) var<storage, read> bw_x: array<F>;
@group(0) @binding(2) var<storage, read> bw_w: array<F>;
@group(0) @binding(3) var<storage, read> bw_rstd: array<f32>;
@group(0) @binding(4) var<storage, read_write> bw_dx: array<F>;
@group(0) @binding(5) var<uniform> bw_p: Params;

@compute @workgroup_size(WG)
fn rmsnorm_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                    @builtin(local_invocation_id) lid: vec3<u32>) {
    let row = row_of(wid, nwg, lid.x);
    let valid = row < bw_p.rows;  // a flag, as in the forward: row_sum holds barriers
    let lane = lid.x % TPR;
    let C = bw_p.C / LANES;
    let base = row * C;
    var r = 0.0;
    var dot = 0.0;  // sum over the row of (dout * weff) * xhat
    if (valid) {
        r = bw_rstd[row];
        for (var c = lane; c < C; c += TPR) {
            dot += hsum(bw_dout[base + c] * weff(bw_w[c], bw_p.style) * (bw_x[base + c] * r));
        }
    }
    let mean = row_sum(lid.x, dot) / f32(bw_p.C);
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
// dw. Both passes are column sums of a (rows, C) table done the same way: a workgroup covers CW adjacent
// channels (coalesced loads) times WG / CW row lanes; lane j sums rows j, j + WG/CW, ... of its span, then a
// tree over the lanes (col_sum) adds the lanes in a fixed order. The launcher sets CW per pass (override) and
// sizes the row blocks so both passes have short serial sums (rmsnorm_dw_blocks in ops/rmsnorm.py).

override CW: u32 = 32u;  // dw passes: channels per workgroup; a power of two <= WG

// Sum of `v` over the WG / CW lanes of each channel column; the result is meaningful in lane 0 (lid < CW).
fn col_sum(lid: u32, v: F) -> F {
    let lane = lid / CW;
    redv[lid] = v;
    workgroupBarrier();
    for (var s = (WG / CW) / 2u; s > 0u; s = s / 2u) {
        if (lane < s) {
            redv[lid] = redv[lid] + redv[lid + s * CW];
        }
        workgroupBarrier();
    }
    return redv[lid];
}

// pass 1: workgroup (row block b, channel chunk) -> partials[b, c] = sum over the block's rows of dout * xhat.

@group(0) @binding(0) var<storage, read> p1_dout: array<F>;
@group(0) @binding(1) var<storage, read> p1_x: array<F>;
@group(0) @binding(2) var<storage, read> p1_rstd: array<f32>;
@group(0) @binding(3) var<storage, read_write> p1_partials: array<F>;
@group(0) @binding(4) var<uniform> p1_p: Params;

@compute @workgroup_size(WG)
fn rmsnorm_backward_dw_partial(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                               @builtin(local_invocation_id) lid: vec3<u32>) {
    let C = p1_p.C / LANES;
    let n_chunks = (C + CW - 1u) / CW;
    let wg = wid.x + wid.y * nwg.x;
    // The same for the whole workgroup (uniform), so returning here leaves col_sum's barriers uniform.
    if (wg >= p1_p.n_blocks * n_chunks) { return; }
    let b = wg / n_chunks;
    let c = (wg - b * n_chunks) * CW + lid.x % CW;
    let lane = lid.x / CW;
    let r1 = min((b + 1u) * p1_p.rows_per_block, p1_p.rows);
    var s = F(0.0);
    if (c < C) {
        for (var r = b * p1_p.rows_per_block + lane; r < r1; r += WG / CW) {
            s += p1_dout[r * C + c] * (p1_x[r * C + c] * p1_rstd[r]);
        }
    }
    let total = col_sum(lid.x, s);
    if (lane == 0u && c < C) {
        p1_partials[b * C + c] = total;
    }
}

// pass 2: workgroup (channel chunk) -> dw[c] (+)= sum over all blocks of partials[b, c].

@group(0) @binding(0) var<storage, read> p2_partials: array<F>;
@group(0) @binding(1) var<storage, read_write> p2_dw: array<F>;
@group(0) @binding(2) var<uniform> p2_p: Params;

@compute @workgroup_size(WG)
fn rmsnorm_backward_dw_reduce(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                              @builtin(local_invocation_id) lid: vec3<u32>) {
    let C = p2_p.C / LANES;
    let wg = wid.x + wid.y * nwg.x;
    if (wg * CW >= C) { return; }  // uniform, as in pass 1
    let c = wg * CW + lid.x % CW;
    let lane = lid.x / CW;
    var s = F(0.0);
    if (c < C) {
        for (var b = lane; b < p2_p.n_blocks; b += WG / CW) {
            s += p2_partials[b * C + c];
        }
    }
    let total = col_sum(lid.x, s);
    if (lane == 0u && c < C) {
        if (p2_p.accumulate_dw != 0u) {
            p2_dw[c] = p2_dw[c] + total;
        } else {
            p2_dw[c] = total;
        }
    }
}
