// prelude_gdn_chunk.wgsl: what the chunked gated delta rule's kernels share (an include line pastes it into
// gated_delta.wgsl and gated_delta_tc.wgsl, which define CC, CDK and the `Params` struct): the chunk's gates
// in workgroup memory with their cumulative sum, and the bindings and loads/stores of the two sequential kernels,
// chunk_forward and chunk_backward_state (the SIMT kernels and their matrix-unit forms take the same buffers
// and write the same outputs). No entry point.

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


// chunk_forward's buffers (binding order: the launcher's)
@group(0) @binding(0) var<storage, read> cf_qk: array<f32>;
@group(0) @binding(1) var<storage, read> cf_init: array<f32>;
@group(0) @binding(2) var<storage, read> cf_scr: array<f32>;
@group(0) @binding(3) var<storage, read_write> cf_o: array<f32>;
@group(0) @binding(4) var<storage, read_write> cf_d: array<f32>;
@group(0) @binding(5) var<storage, read_write> cf_states: array<f32>;
@group(0) @binding(6) var<uniform> cf_p: Params;

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

// chunk_backward_state's buffers
@group(0) @binding(0) var<storage, read> cb_qk: array<f32>;
@group(0) @binding(1) var<storage, read> cb_do: array<f32>;
@group(0) @binding(2) var<storage, read_write> cb_scr: array<f32>;
@group(0) @binding(3) var<uniform> cb_p: Params;

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
