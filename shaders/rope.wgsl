// Rotary position embedding, rotate-half convention (HF Llama/Qwen3), on x (B, T, N, D) row-major,
// with tables cos/sin (>= T, R) whose row t is position t (ddl_ref.ops.rope_tables). Partial rotary
// (Qwen3.5): only the first R <= D items of a row rotate, h = R / 2; the other D - R pass through.
//
// forward:  out = x * cos + rotate_half(x) * sin,   rotate_half(x) = concat(-x[h:], x[:h])
//   out[i]   = x[i]   * cos[i]   - x[i+h] * sin[i]
//   out[i+h] = x[i+h] * cos[i+h] + x[i]   * sin[i+h]
// backward (the transpose):  dx = dout * cos + concat((dout*sin)[h:], -(dout*sin)[:h])
//   dx[i]    = g[i]   * cos[i]   + g[i+h] * sin[i+h]
//   dx[i+h]  = g[i+h] * cos[i+h] - g[i]   * sin[i]
//
// One thread per pair slot i < D / 2 of one (b, t, n) row: slot i < h rotates the pair (i, i+h); a slot
// i >= h (partial rotary) copies the two pass-through items R + 2(i - h) and the next one (out of place;
// in place it has nothing to do). A thread reads its items before writing them, so the in-place entry
// points (one read_write buffer) are race-free. Template: an item is F = f32, or vec4<f32> when h % 4 == 0
// and D / 2 % 4 == 0 (4 adjacent i at once; head_dim 64 or 128), and Params count items of F.
//
//   rope_forward / rope_backward                  (x_or_dout, cos, sin, out_or_dx, p)
//   rope_forward_inplace / rope_backward_inplace  (cos, sin, x, p)

const WG: u32 = 256u;
alias F = {{F}};

// generated from its description in ddl_wgpu/ops/rope.py (`Uniform`)
{{struct Params}}

fn item(wid: vec3<u32>, nwg: vec3<u32>, lid: vec3<u32>) -> u32 {
    return (wid.x + wid.y * nwg.x) * WG + lid.x;
}

// Where slot `gid` lives: (index of item i in x, index of item i in the tables, i); item i+h is h further
// on. For a pass-through slot (i >= h) the first index is that of its first pass-through item.
fn locate(gid: u32, p: Params) -> vec3<u32> {
    let slots = p.D / 2u;
    let row = gid / slots;  // (b * T + t) * N + n
    let i = gid - row * slots;
    let t = (row / p.N) % p.T;
    let h = p.R / 2u;
    if (i >= h) {
        return vec3<u32>(row * p.D + p.R + 2u * (i - h), 0u, i);
    }
    return vec3<u32>(row * p.D + i, t * p.R + i, i);
}

// The forward rotation of the pair (a, b) = (x[i], x[i+h]), or its transpose for the backward.
fn rotate(a: F, b: F, c1: F, s1: F, c2: F, s2: F, backward: bool) -> array<F, 2> {
    if (backward) {
        return array<F, 2>(a * c1 + b * s2, b * c2 - a * s1);
    }
    return array<F, 2>(a * c1 - b * s1, b * c2 + a * s2);
}

// ---------------------------------------------------------------------------------------------------------
// out of place

@group(0) @binding(0) var<storage, read> op_x: array<F>;
@group(0) @binding(1) var<storage, read> op_cos: array<F>;
@group(0) @binding(2) var<storage, read> op_sin: array<F>;
@group(0) @binding(3) var<storage, read_write> op_out: array<F>;
@group(0) @binding(4) var<uniform> op_p: Params;

fn rope_out_of_place(gid: u32, backward: bool) {
    let h = op_p.R / 2u;
    let at = locate(gid, op_p);
    if (at.z >= h) {  // pass-through items: the rotation is the identity, forward and backward
        op_out[at.x] = op_x[at.x];
        op_out[at.x + 1u] = op_x[at.x + 1u];
        return;
    }
    let r = rotate(op_x[at.x], op_x[at.x + h], op_cos[at.y], op_sin[at.y], op_cos[at.y + h], op_sin[at.y + h],
                   backward);
    op_out[at.x] = r[0];
    op_out[at.x + h] = r[1];
}

@compute @workgroup_size(WG)
fn rope_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_id) lid: vec3<u32>) {
    let gid = item(wid, nwg, lid);
    if (gid >= op_p.pairs) { return; }
    rope_out_of_place(gid, false);
}

@compute @workgroup_size(WG)
fn rope_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_id) lid: vec3<u32>) {
    let gid = item(wid, nwg, lid);
    if (gid >= op_p.pairs) { return; }
    rope_out_of_place(gid, true);
}

// ---------------------------------------------------------------------------------------------------------
// in place: x is read and overwritten

@group(0) @binding(0) var<storage, read> ip_cos: array<F>;
@group(0) @binding(1) var<storage, read> ip_sin: array<F>;
@group(0) @binding(2) var<storage, read_write> ip_x: array<F>;
@group(0) @binding(3) var<uniform> ip_p: Params;

fn rope_in_place(gid: u32, backward: bool) {
    let h = ip_p.R / 2u;
    let at = locate(gid, ip_p);
    if (at.z >= h) {
        return;
    }
    let r = rotate(ip_x[at.x], ip_x[at.x + h], ip_cos[at.y], ip_sin[at.y], ip_cos[at.y + h], ip_sin[at.y + h],
                   backward);
    ip_x[at.x] = r[0];
    ip_x[at.x + h] = r[1];
}

@compute @workgroup_size(WG)
fn rope_forward_inplace(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                        @builtin(local_invocation_id) lid: vec3<u32>) {
    let gid = item(wid, nwg, lid);
    if (gid >= ip_p.pairs) { return; }
    rope_in_place(gid, false);
}

@compute @workgroup_size(WG)
fn rope_backward_inplace(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                         @builtin(local_invocation_id) lid: vec3<u32>) {
    let gid = item(wid, nwg, lid);
    if (gid >= ip_p.pairs) { return; }
    rope_in_place(gid, true);
}
