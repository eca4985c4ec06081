// Top-k KL distillation loss (for healing an MTP draft head) and the top-k selection that makes its
// teacher data.
//
// `topk_kl` works in place on a (rows, V) chunk of student logits, like cross_entropy. With the teacher's
// k ids and probabilities for the row, p~ = teacher probs renormalised over the k ids (0 for a row without
// teacher mass), row_loss[g] = weight * sum_i p~_i (log p~_i - log q_i) (0 log 0 = 0), where log q is
//   form 1 ("full", the reference heal tool's): the student's log-softmax over the whole row at the ids;
//            the logits row becomes weight * scale * (m * softmax(z) - p~ at the k ids);
//   form 0 ("topk"): the student's softmax restricted to the k ids and renormalised (q~); the logits row
//            becomes weight * scale * (m * q~_i - p~_i) at the k ids and zero elsewhere;
// m = sum of p~ (1, or 0 for a row without teacher mass). A repeated id accumulates, as np.add.at does in
// the reference. g = row_offset + r indexes the per-step teacher_ids / teacher_probs / weights / row_loss
// buffers. With grad = 0 (an evaluation) only row_loss is written and the logits are left as they are: the
// row is read once instead of read twice and written once.
//
// `topk` writes, per row, the k largest logits' ids (ties: lower id first) and their full-softmax
// probabilities (not renormalised). k <= 64.
//
// Both are one workgroup per row and deterministic.

const WG: u32 = 256u;
const KMAX: u32 = 64u;
const NEG_BIG: f32 = -3.0e38;
const NONE: u32 = 0xffffffffu;

// generated from its description in ddl_wgpu/ops/topk_kl.py (`Uniform`)
{{struct Params}}

{{include prelude_reduce.wgsl}}

// ---------------------------------------------------------------------------------------------------
// top-k KL: loss + gradient, in place

@group(0) @binding(0) var<storage, read> kl_teacher_ids: array<u32>;
@group(0) @binding(1) var<storage, read> kl_teacher_probs: array<f32>;
@group(0) @binding(2) var<storage, read> kl_weights: array<f32>;
@group(0) @binding(3) var<storage, read> kl_scale: array<f32>;
@group(0) @binding(4) var<storage, read_write> kl_logits: array<f32>;
@group(0) @binding(5) var<storage, read_write> kl_row_loss: array<f32>;
@group(0) @binding(6) var<uniform> kl_p: Params;

var<workgroup> kl_z: array<f32, 64>;
var<workgroup> kl_id: array<u32, 64>;

@compute @workgroup_size(256)
fn topk_kl(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_id) lid3: vec3<u32>,
) {
    let row = wid.x + wid.y * nwg.x;
    if (row >= kl_p.rows) {
        return;
    }
    let lid = lid3.x;
    let V = kl_p.V;
    let k = kl_p.k;
    let base = row * V;
    let g = kl_p.row_offset + row;

    // 1. gather the student logits at the teacher ids (ids out of range are clipped: memory safety only),
    //    and the row's log-sum-exp (read before step 2 overwrites the row)
    if (lid < k) {
        let id = min(kl_teacher_ids[g * k + lid], V - 1u);
        kl_id[lid] = id;
        kl_z[lid] = kl_logits[base + id];
    }
    var ms = vec2<f32>(NEG_BIG, 0.0);
    if (kl_p.form == 1u) {
        for (var i = lid; i < V; i += WG) {
            ms = online_ms(ms, kl_logits[base + i]);
        }
    }
    let lse_row = lse_reduce(lid, ms);
    storageBarrier();
    workgroupBarrier();

    // the teacher's mass (every invocation reads the k probabilities: k <= 64)
    var psum = 0.0;
    for (var j = 0u; j < k; j++) {
        psum += kl_teacher_probs[g * k + j];
    }
    // A row without teacher mass (padding, zero-filled) gets p~ = 0 and m = 0 rather than 0/0 = NaN, so a
    // padding row contributes exactly 0 instead of poisoning the gradient norm.
    let has_mass = psum > 0.0;
    let inv_psum = select(0.0, 1.0 / psum, has_mass);
    let w = kl_weights[g];
    let ws = w * kl_scale[0];
    let mass = select(0.0, 1.0, has_mass);
    let mws = mass * ws;

    // 2. "full": m * softmax(z) over the whole row; "topk": zero off the k ids
    if (kl_p.grad == 1u) {
        for (var i = lid; i < V; i += WG) {
            var d = 0.0;
            if (kl_p.form == 1u) {
                d = exp(kl_logits[base + i] - lse_row) * mws;
            }
            kl_logits[base + i] = d;
        }
    }
    storageBarrier();
    workgroupBarrier();

    // 3. k <= 64 terms: one invocation, in a fixed order (duplicate ids accumulate deterministically)
    if (lid == 0u) {
        var lse = lse_row;
        if (kl_p.form == 0u) {
            var m = NEG_BIG;
            for (var j = 0u; j < k; j++) {
                m = max(m, kl_z[j]);
            }
            var s = 0.0;
            for (var j = 0u; j < k; j++) {
                s += exp(kl_z[j] - m);
            }
            lse = m + log(s);
        }
        var kl = 0.0;
        for (var j = 0u; j < k; j++) {
            let p = kl_teacher_probs[g * k + j] * inv_psum;
            let logq = kl_z[j] - lse;
            if (p > 0.0) {
                kl += p * (log(p) - logq);
            }
            if (kl_p.grad == 0u) {
                continue;
            }
            let at = base + kl_id[j];
            if (kl_p.form == 1u) {
                kl_logits[at] = kl_logits[at] - p * ws;
            } else {
                kl_logits[at] = kl_logits[at] + (exp(logq) * mass - p) * ws;
            }
        }
        kl_row_loss[g] = w * kl;
    }
}

// ---------------------------------------------------------------------------------------------------
// top-k selection with full-softmax probabilities

@group(0) @binding(0) var<storage, read> tk_logits: array<f32>;
@group(0) @binding(1) var<storage, read_write> tk_ids: array<u32>;
@group(0) @binding(2) var<storage, read_write> tk_probs: array<f32>;
@group(0) @binding(3) var<uniform> tk_p: Params;

var<workgroup> tk_v: array<f32, 256>;
var<workgroup> tk_i: array<u32, 256>;

// The total order of the selection: larger value first, then lower id. NONE (no candidate) is last.
fn better(av: f32, ai: u32, bv: f32, bi: u32) -> bool {
    if (ai == NONE) {
        return false;
    }
    if (bi == NONE) {
        return true;
    }
    return av > bv || (av == bv && ai < bi);
}

@compute @workgroup_size(256)
fn topk(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_id) lid3: vec3<u32>,
) {
    let row = wid.x + wid.y * nwg.x;
    if (row >= tk_p.rows) {
        return;
    }
    let lid = lid3.x;
    let V = tk_p.V;
    let k = tk_p.k;
    let base = row * V;
    let out = (tk_p.row_offset + row) * k;

    // Each invocation holds its best candidate among its strided slice of the row. After a round picks
    // the workgroup's best, only the invocation that owned it rescans (for its best element strictly
    // after the pick in the order); every other candidate is still its slice's best. So the row is read
    // once plus k slices, not k times.
    var cv = NEG_BIG;
    var ci = NONE;
    var ms = vec2<f32>(NEG_BIG, 0.0);
    for (var i = lid; i < V; i += WG) {
        let z = tk_logits[base + i];
        ms = online_ms(ms, z);
        if (better(z, i, cv, ci)) {
            cv = z;
            ci = i;
        }
    }
    let lse = lse_reduce(lid, ms);

    for (var r = 0u; r < k; r++) {
        tk_v[lid] = cv;
        tk_i[lid] = ci;
        workgroupBarrier();
        for (var stride = WG / 2u; stride > 0u; stride = stride >> 1u) {
            if (lid < stride && better(tk_v[lid + stride], tk_i[lid + stride], tk_v[lid], tk_i[lid])) {
                tk_v[lid] = tk_v[lid + stride];
                tk_i[lid] = tk_i[lid + stride];
            }
            workgroupBarrier();
        }
        let wv = tk_v[0];
        let wi = tk_i[0];
        workgroupBarrier();
        if (lid == 0u) {
            tk_ids[out + r] = wi;
            tk_probs[out + r] = exp(wv - lse);
        }
        if (ci == wi) {
            cv = NEG_BIG;
            ci = NONE;
            for (var i = lid; i < V; i += WG) {
                let z = tk_logits[base + i];
                let after = z < wv || (z == wv && i > wi);
                if (after && better(z, i, cv, ci)) {
                    cv = z;
                    ci = i;
                }
            }
        }
    }
}
