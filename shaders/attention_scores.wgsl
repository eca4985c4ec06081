// Row kernels of causal attention with materialised scores (`ddl_wgpu/ops/attention_scores.py`).
//
// That path runs attention as GEMMs (`matmul.wgsl` with its two-level batch and causal tile bounds) on a
// (Z, R, Tk) buffer of scores, Z = (batch, head) pairs of one chunk, R query rows r0 .. r0+R-1 of each (all T
// rows, r0 = 0, unless rows are chunked), Tk keys 0 .. Tk-1 per row (T, or r0+R when rows are chunked: no
// query of the block sees a later key), row (z, t) at float (z*R + t - r0)*Tk: the GEMM
// kernel is the best-tuned code we have, and on a GPU it beats the flash kernels of attention.wgsl by several
// times at T = 1024. What the GEMMs cannot do lives here:
//   - scores_softmax (forward): S (already scaled) -> P = softmax over keys s <= t, written in place, zeros for
//     s > t (the causal GEMMs that read P rely on them); lse = max + log(sum) of each row, as the flash kernel.
//     One read for the max and the sum (online, per thread, merged over one tree), one read + write for P.
//   - scores_backward: S -> P = exp(S - lse) and dP -> dS = P (dP - delta), both in place, zeros for s > t.
// Scores above the diagonal are never read (the GEMM that wrote S may have skipped those tiles, leaving old
// values). lse and delta of row (z, t) sit at (z0 + z)*T + t.
// Reductions run over a fixed tree in workgroup memory: same inputs, same bits.
//
// The mask: causal (W = 0), or the chained draft's (W = window, `ddl_ref.ops.chain_mask`,
// docs/heal.md#chain-attention-per-step-or-stacked):
// T = C*W stacked rows, row (σ-1)*W + p; key (σ', p') visible to query (σ, p) iff (σ' == 1 and p' <= p) or
// (2 <= σ' <= σ and p' == p). Every visible key of row r sits at a row <= r, so the causal GEMM bounds hold
// for both masks; masked entries get P = dS = 0 like the ones above the diagonal.

// generated from its description in ddl_wgpu/ops/attention_scores.py (`Uniform`)
{{struct Params}}

fn visible(t: u32, s: u32, W: u32) -> bool {
    if (W == 0u) {
        return s <= t;
    }
    let pq = t % W;
    let sk = s / W;
    let pk = s % W;
    return (sk == 0u && pk <= pq) || (sk >= 1u && sk <= t / W && pk == pq);
}

const WG: u32 = 128u;
const NEG: f32 = -3.0e38;

{{include prelude_reduce.wgsl}}

@group(0) @binding(0) var<storage, read_write> sm_s: array<f32>;
@group(0) @binding(1) var<storage, read_write> sm_lse: array<f32>;
@group(0) @binding(2) var<uniform> sm_p: Params;

@compute @workgroup_size(WG)
fn scores_softmax(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let row = wid.x + wid.y * nwg.x;  // uniform over the workgroup: the barriers below are safe
    if (row >= sm_p.rows) {
        return;
    }
    let T = sm_p.T;
    let z = row / sm_p.R;
    let t = sm_p.r0 + row % sm_p.R;  // query position within T
    let base = row * sm_p.Tk;
    let W = sm_p.W;
    // one pass over the row: a running max and sum per thread (online softmax), then one tree
    var m = NEG;
    var l = 0.0;
    for (var s = lid; s <= t; s += WG) {
        if (visible(t, s, W)) {
            let x = sm_s[base + s];
            let mn = max(m, x);
            l = l * exp(m - mn) + exp(x - mn);
            m = mn;
        }
    }
    let ml = ms_reduce(lid, vec2<f32>(m, l));
    m = ml.x;
    l = ml.y;
    let inv = 1.0 / l;  // every row sees at least itself: l >= 1
    for (var s = lid; s < sm_p.Tk; s += WG) {
        var p = 0.0;
        if (s <= t && visible(t, s, W)) {
            p = exp(sm_s[base + s] - m) * inv;
        }
        sm_s[base + s] = p;
    }
    if (lid == 0u) {
        sm_lse[(sm_p.z0 + z) * T + t] = m + log(l);
    }
}

@group(0) @binding(0) var<storage, read> bw_lse: array<f32>;
@group(0) @binding(1) var<storage, read> bw_delta: array<f32>;
@group(0) @binding(2) var<storage, read_write> bw_s: array<f32>;
@group(0) @binding(3) var<storage, read_write> bw_dp: array<f32>;
@group(0) @binding(4) var<uniform> bw_p: Params;

@compute @workgroup_size(256)
fn scores_backward(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let T = bw_p.T;
    let Tk = bw_p.Tk;
    let i = (wid.x + wid.y * nwg.x) * 256u + lid;  // element (row, s) of the chunk
    if (i >= bw_p.rows * Tk) {
        return;
    }
    let row = i / Tk;
    let s = i % Tk;
    let t = bw_p.r0 + row % bw_p.R;  // query position within T
    var p = 0.0;
    var ds = 0.0;
    if (visible(t, s, bw_p.W)) {
        let r = (bw_p.z0 + row / bw_p.R) * T + t;
        p = exp(bw_s[i] - bw_lse[r]);
        ds = p * (bw_dp[i] - bw_delta[r]);
    }
    bw_s[i] = p;
    bw_dp[i] = ds;
}
