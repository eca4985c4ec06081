// Elementwise utilities over flat f32 arrays of n items: the residual add, copies, fills (zeroing
// gradients), scaling and axpy. One thread per item of type F, 256 threads per workgroup; the launcher
// spreads the workgroups over x and y (`gpu.grid`) and every entry point recovers the linear index and
// guards it.
//
// Template: F is f32 or vec4<f32> (the launcher picks vec4 when n % 4 == 0 and every view offset is a
// multiple of 16: on the H200 vec4 moves about twice the bytes per second of scalar f32), U the u32 type of
// the same width. Params.n counts items of F.
//
// Entry points (bindings: read-only inputs, then read_write outputs, then Params):
//   add_forward      (a, b, out, p)   out = a + b
//   add_inplace      (x, y, p)        y += x
//   axpy             (x, y, p)        y += alpha * x
//   copy             (src, dst, p)    dst = src
//   fill             (buf, p)         buf = alpha
//   scale_inplace    (y, p)           y *= alpha
//   round_f16        (y, p)           y = f32(f16(y)), to nearest even, as numpy's astype(float16)

const WG: u32 = 256u;
alias F = {{F}};
alias U = {{U}};

// generated from its description in ddl_wgpu/ops/elementwise.py (`Uniform`)
{{struct Params}}

fn item(wid: vec3<u32>, nwg: vec3<u32>, lid: vec3<u32>) -> u32 {
    return (wid.x + wid.y * nwg.x) * WG + lid.x;
}

// ---------------------------------------------------------------------------------------------------------
// out = a + b

@group(0) @binding(0) var<storage, read> add_a: array<F>;
@group(0) @binding(1) var<storage, read> add_b: array<F>;
@group(0) @binding(2) var<storage, read_write> add_out: array<F>;
@group(0) @binding(3) var<uniform> add_p: Params;

@compute @workgroup_size(WG)
fn add_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = item(wid, nwg, lid);
    if (i >= add_p.n) { return; }
    add_out[i] = add_a[i] + add_b[i];
}

// ---------------------------------------------------------------------------------------------------------
// y += x   and   y += alpha * x

@group(0) @binding(0) var<storage, read> acc_x: array<F>;
@group(0) @binding(1) var<storage, read_write> acc_y: array<F>;
@group(0) @binding(2) var<uniform> acc_p: Params;

@compute @workgroup_size(WG)
fn add_inplace(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = item(wid, nwg, lid);
    if (i >= acc_p.n) { return; }
    acc_y[i] = acc_y[i] + acc_x[i];
}

@compute @workgroup_size(WG)
fn axpy(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = item(wid, nwg, lid);
    if (i >= acc_p.n) { return; }
    acc_y[i] = acc_y[i] + acc_p.alpha * acc_x[i];
}

// ---------------------------------------------------------------------------------------------------------
// dst = src

@group(0) @binding(0) var<storage, read> copy_src: array<F>;
@group(0) @binding(1) var<storage, read_write> copy_dst: array<F>;
@group(0) @binding(2) var<uniform> copy_p: Params;

@compute @workgroup_size(WG)
fn copy(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = item(wid, nwg, lid);
    if (i >= copy_p.n) { return; }
    copy_dst[i] = copy_src[i];
}

// ---------------------------------------------------------------------------------------------------------
// buf = alpha   and   y *= alpha

@group(0) @binding(0) var<storage, read_write> one_y: array<F>;
@group(0) @binding(1) var<uniform> one_p: Params;

@compute @workgroup_size(WG)
fn fill(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = item(wid, nwg, lid);
    if (i >= one_p.n) { return; }
    one_y[i] = F(one_p.alpha);
}

@compute @workgroup_size(WG)
fn scale_inplace(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = item(wid, nwg, lid);
    if (i >= one_p.n) { return; }
    one_y[i] = one_y[i] * one_p.alpha;
}

// ---------------------------------------------------------------------------------------------------------
// y = f32(f16(y)): what heal's host cache of draft rows (float16) does to a row, on the GPU, so that rows kept
// there between chain steps have the cache's bits. Integer arithmetic, not WGSL's f16 conversion: that needs
// shader-f16 and leaves the rounding direction to the implementation; numpy rounds to nearest, ties to even.

fn to_half(v: F) -> F {
    let b = bitcast<U>(v);
    let a = b & U(0x7fffffffu);
    // |v| >= 2^-14 (an f16 normal): the 23-bit mantissa cut to 10 bits; + 0xfff + the kept lsb rounds a tie
    // to even, and a carry moves into the exponent as it should
    let nrm = (a + U(0xfffu) + ((a >> U(13u)) & U(1u))) & U(0xffffe000u);
    // below: f16 subnormals, the multiples of 2^-24 (exact scalings; WGSL's round() takes ties to even)
    let sub = bitcast<U>(round(bitcast<F>(a) * F(16777216.0)) * F(5.9604644775390625e-8));
    var r = select(sub, nrm, a >= U(0x38800000u));
    r = select(r, U(0x7f800000u), a >= U(0x477ff000u));  // from 65520 on (and inf): inf
    r = select(r, a, a > U(0x7f800000u));  // NaN stays NaN
    return bitcast<F>((b & U(0x80000000u)) | r);
}

@compute @workgroup_size(WG)
fn round_f16(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = item(wid, nwg, lid);
    if (i >= one_p.n) { return; }
    one_y[i] = to_half(one_y[i]);
}
