// SwiGLU over flat arrays of n items: out = silu(gate) * up, silu(g) = g * sigmoid(g).
// One thread per item of type F (template: f32, or vec4<f32> when n % 4 == 0, as in elementwise.wgsl);
// workgroups spread over x and y by the launcher (`gpu.grid`). Params.n counts items of F.
//
//   swiglu_forward  (gate, up, out, p)
//   swiglu_backward (dout, gate, up, dgate, dup, p)
//     dup   = dout * silu(g)
//     dgate = dout * up * silu'(g),  silu'(g) = s + g * s * (1 - s),  s = sigmoid(g)

const WG: u32 = 256u;
alias F = {{F}};

// generated from its description in ddl_wgpu/ops/swiglu.py (`Uniform`)
{{struct Params}}

// Numerically stable sigmoid: exp only ever sees -|g| <= 0, so it never overflows (1/(1+exp(-g)) would
// reach inf for g < -88 and lean on IEEE inf arithmetic, which fast-math drivers do not promise); for
// g << 0 the result underflows gracefully towards 0.
fn sigmoid(g: F) -> F {
    let e = exp(-abs(g));
    let r = 1.0 / (1.0 + e);
    return select(e * r, r, g >= F(0.0));
}

fn item(wid: vec3<u32>, nwg: vec3<u32>, lid: vec3<u32>) -> u32 {
    return (wid.x + wid.y * nwg.x) * WG + lid.x;
}

// ---------------------------------------------------------------------------------------------------------

@group(0) @binding(0) var<storage, read> fw_gate: array<F>;
@group(0) @binding(1) var<storage, read> fw_up: array<F>;
@group(0) @binding(2) var<storage, read_write> fw_out: array<F>;
@group(0) @binding(3) var<uniform> fw_p: Params;

@compute @workgroup_size(WG)
fn swiglu_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = item(wid, nwg, lid);
    if (i >= fw_p.n) { return; }
    let g = fw_gate[i];
    fw_out[i] = g * sigmoid(g) * fw_up[i];
}

// ---------------------------------------------------------------------------------------------------------

@group(0) @binding(0) var<storage, read> bw_dout: array<F>;
@group(0) @binding(1) var<storage, read> bw_gate: array<F>;
@group(0) @binding(2) var<storage, read> bw_up: array<F>;
@group(0) @binding(3) var<storage, read_write> bw_dgate: array<F>;
@group(0) @binding(4) var<storage, read_write> bw_dup: array<F>;
@group(0) @binding(5) var<uniform> bw_p: Params;

@compute @workgroup_size(WG)
fn swiglu_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = item(wid, nwg, lid);
    if (i >= bw_p.n) { return; }
    let d = bw_dout[i];
    let g = bw_gate[i];
    let s = sigmoid(g);
    bw_dup[i] = d * g * s;
    bw_dgate[i] = d * bw_up[i] * (s + g * s * (1.0 - s));
}
