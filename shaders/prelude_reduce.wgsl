// Shared workgroup reductions, pasted by the loader where a shader has an include line naming this file
// (ddl_wgpu/runtime/gpu.py `shader_source`). The including shader defines `const WG: u32`, its workgroup size (a
// power of two), before the include line.
//
// Each reduction is a tree of fixed shape in workgroup memory: invocation lid adds lid + stride for
// stride = WG/2, WG/4, ..., 1, so the order of the additions depends on WG only and two runs give the
// same bits. Every invocation gets the result; a barrier after the read lets the caller reuse the arrays.
//
// Online softmax denominators travel as pairs ms = (m, s): the running maximum m and s = sum of exp(x - m).
// A pair that saw nothing is (a very negative m, 0).

var<workgroup> red: array<f32, WG>;    // tree_sum
var<workgroup> red_m: array<f32, WG>;  // ms_reduce: the pairs' maxima
var<workgroup> red_s: array<f32, WG>;  // ms_reduce: the pairs' sums

// (m1, s1) + (m2, s2) -> (m, s1 e^(m1-m) + s2 e^(m2-m)), m = max(m1, m2): merges two partial softmax
// denominators (the log-sum-exp merge).
fn combine_ms(m1: f32, s1: f32, m2: f32, s2: f32) -> vec2<f32> {
    let m = max(m1, m2);
    return vec2<f32>(m, s1 * exp(m1 - m) + s2 * exp(m2 - m));
}

// One online-softmax step: the running (m, s) absorbs z with a single exp.
fn online_ms(ms: vec2<f32>, z: f32) -> vec2<f32> {
    if (z > ms.x) {
        return vec2<f32>(z, ms.y * exp(ms.x - z) + 1.0);
    }
    return vec2<f32>(ms.x, ms.y + exp(z - ms.x));
}

// Tree-combine every invocation's (m, s) pair; every invocation gets the workgroup's pair.
fn ms_reduce(lid: u32, ms: vec2<f32>) -> vec2<f32> {
    red_m[lid] = ms.x;
    red_s[lid] = ms.y;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride = stride >> 1u) {
        if (lid < stride) {
            let c = combine_ms(red_m[lid], red_s[lid], red_m[lid + stride], red_s[lid + stride]);
            red_m[lid] = c.x;
            red_s[lid] = c.y;
        }
        workgroupBarrier();
    }
    let r = vec2<f32>(red_m[0], red_s[0]);
    workgroupBarrier();
    return r;
}

// The log-sum-exp of the workgroup's values from every invocation's (m, s) pair.
fn lse_reduce(lid: u32, ms: vec2<f32>) -> f32 {
    let r = ms_reduce(lid, ms);
    return r.x + log(r.y);
}

// Tree sum of one value per invocation; every invocation gets the total.
fn tree_sum(lid: u32, v: f32) -> f32 {
    red[lid] = v;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride = stride >> 1u) {
        if (lid < stride) {
            red[lid] = red[lid] + red[lid + stride];
        }
        workgroupBarrier();
    }
    let total = red[0];
    workgroupBarrier();
    return total;
}
