// Cross-entropy over rows of logits, fused with its gradient, in place.
//
// The engine computes the LM head in row chunks into a (rows, V) logits buffer and calls this on each
// chunk: the logits are overwritten with dlogits = (softmax(z) - onehot(t)) * weight * scale, and
// row_loss[g] = weight * (logsumexp(z) - z[t]) (unscaled), where g = row_offset + r indexes the per-step
// targets / weights / row_loss buffers, so one set of those serves every chunk.
//
// One workgroup per row. Each invocation keeps an online (max, sum-of-exp) pair over its strided slice
// of the row; the pairs are combined by a fixed-shape tree in workgroup memory (deterministic: same inputs,
// same bits), so the row is read twice and written once, for any V (tested up to 200k in the engine).
//
// `scale` comes from a storage buffer (ce_scale[0]) so one per-step write (1 / number of valid
// predictions) serves every chunk's call.
//
// Entry points: `cross_entropy` (loss + gradient, logits read_write) and `cross_entropy_eval` (loss only,
// logits read-only).

const WG: u32 = 256u;
const NEG_BIG: f32 = -3.0e38; // "minus infinity" that keeps exp(a - b) free of inf - inf = NaN

// generated from its description in ddl_wgpu/ops/crossentropy.py (`Uniform`)
{{struct Params}}

{{include prelude_reduce.wgsl}}

// ---------------------------------------------------------------------------------------------------
// loss + gradient, in place

@group(0) @binding(0) var<storage, read> ce_targets: array<u32>;
@group(0) @binding(1) var<storage, read> ce_weights: array<f32>;
@group(0) @binding(2) var<storage, read> ce_scale: array<f32>;
@group(0) @binding(3) var<storage, read_write> ce_logits: array<f32>;
@group(0) @binding(4) var<storage, read_write> ce_row_loss: array<f32>;
@group(0) @binding(5) var<uniform> ce_p: Params;

@compute @workgroup_size(256)
fn cross_entropy(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_id) lid3: vec3<u32>,
) {
    let row = wid.x + wid.y * nwg.x;
    if (row >= ce_p.rows) {
        return;
    }
    let lid = lid3.x;
    let V = ce_p.V;
    let base = row * V;
    let g = ce_p.row_offset + row;
    // Rows with weight 0 may carry any target: clip it into range, as the reference does.
    let t = min(ce_targets[g], V - 1u);
    // Only invocation 0 needs z[t]; it is read before the barriers below, ahead of any overwrite.
    var zt = 0.0;
    if (lid == 0u) {
        zt = ce_logits[base + t];
    }

    var ms = vec2<f32>(NEG_BIG, 0.0);
    for (var i = lid; i < V; i += WG) {
        ms = online_ms(ms, ce_logits[base + i]);
    }
    let lse = lse_reduce(lid, ms);
    storageBarrier();

    let w = ce_weights[g];
    let ws = w * ce_scale[0];
    for (var i = lid; i < V; i += WG) {
        var d = exp(ce_logits[base + i] - lse);
        if (i == t) {
            d -= 1.0;
        }
        ce_logits[base + i] = d * ws;
    }
    if (lid == 0u) {
        ce_row_loss[g] = w * (lse - zt);
    }
}

// ---------------------------------------------------------------------------------------------------
// loss only (evaluation)

@group(0) @binding(0) var<storage, read> ev_logits: array<f32>;
@group(0) @binding(1) var<storage, read> ev_targets: array<u32>;
@group(0) @binding(2) var<storage, read> ev_weights: array<f32>;
@group(0) @binding(3) var<storage, read_write> ev_row_loss: array<f32>;
@group(0) @binding(4) var<uniform> ev_p: Params;

@compute @workgroup_size(256)
fn cross_entropy_eval(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_id) lid3: vec3<u32>,
) {
    let row = wid.x + wid.y * nwg.x;
    if (row >= ev_p.rows) {
        return;
    }
    let lid = lid3.x;
    let V = ev_p.V;
    let base = row * V;
    var ms = vec2<f32>(NEG_BIG, 0.0);
    for (var i = lid; i < V; i += WG) {
        ms = online_ms(ms, ev_logits[base + i]);
    }
    let lse = lse_reduce(lid, ms);
    if (lid == 0u) {
        let g = ev_p.row_offset + row;
        let t = min(ev_targets[g], V - 1u);
        ev_row_loss[g] = ev_weights[g] * (lse - ev_logits[base + t]);
    }
}
