// Deterministic reductions: sums of squares (gradient norm), the global norm + clip multiplier, and a
// plain sum (row losses -> batch loss).
//
// No float atomics anywhere: each workgroup sums a fixed set of elements in a fixed order and a fixed-shape
// tree, so the same inputs (and the same launch sizes, which depend only on n) give the same bits.
//
// Gradient norm over several flat ranges, all on the GPU:
//   sum_squares   (one dispatch per range) partials[offset + w] = sum of x^2 over workgroup w's elements
//                 (grid-stride: element i belongs to workgroup (i / 256) % groups);
//   finalize_clip (one workgroup)          scalars[0] = sqrt(sum of partials[0..count)) * unscale
//                                                       (global norm of the unscaled gradient)
//                                          scalars[1] = clip multiplier min(1, clip / norm) * unscale
//                                                       (unscale if norm == 0, norm <= clip or clip <= 0;
//                                                        0 when the gradient is not finite)
//                                          scalars[2] = 1.0 if every partial is finite, else 0.0
//                                          scalars[3] = the sum of squares itself
// AdamW reads scalars[1] and scalars[2], so clipping and the non-finite skip need no host round trip.
//
// `unscale` (a uniform field) is 1 / S for a gradient computed of S * loss (mixed precision's loss scaling,
// docs/precision.md): the norm and the multiplier are those of the unscaled gradient, and AdamW's
// grad * multiplier unscales it on the way. S is a power of two, so both products are exact: a run at any S
// that does not overflow gives the bits of S = 1, and unscale = 1 gives the kernels' bits before the field.
//
// Per-tensor clipping (each tensor scaled by its own norm) adds, after finalize_clip:
//   finalize_tensors (one workgroup per tensor t) sums t's slice partials[start_t .. start_t + count_t) in
//                 a fixed order and writes t's record at records[t * stride ..]: (norm_t * unscale,
//                 multiplier min(1, clip / norm_t) * unscale, the GLOBAL finite flag scalars[2], sum of
//                 squares). A record has
//                 the layout of `scalars`, and stride is 256 bytes, so AdamW binds t's record as its
//                 scalars; the finite flag stays global, so one non-finite tensor still skips the whole step.
//
// sum_rows (one workgroup): out[index] = sum of x[0..n).

const WG: u32 = 256u;

{{include prelude_reduce.wgsl}}

// inf and NaN have an all-ones exponent; a bit test survives fast-math, `x != x` might not.
fn not_finite(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7f800000u) == 0x7f800000u;
}

// ---------------------------------------------------------------------------------------------------

// generated from its description in ddl_wgpu/ops/reduce.py (`Uniform`)
{{struct SumSquaresParams}}

@group(0) @binding(0) var<storage, read> ss_x: array<f32>;
@group(0) @binding(1) var<storage, read_write> ss_partials: array<f32>;
@group(0) @binding(2) var<uniform> ss_p: SumSquaresParams;

@compute @workgroup_size(256)
fn sum_squares(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_id) lid3: vec3<u32>,
) {
    let lid = lid3.x;
    let stride = nwg.x * WG;
    var acc = 0.0;
    for (var i = wid.x * WG + lid; i < ss_p.n; i += stride) {
        let v = ss_x[i];
        acc += v * v;
    }
    let total = tree_sum(lid, acc);
    if (lid == 0u) {
        ss_partials[ss_p.offset + wid.x] = total;
    }
}

// ---------------------------------------------------------------------------------------------------

// generated from its description in ddl_wgpu/ops/reduce.py (`Uniform`)
{{struct FinalizeParams}}

@group(0) @binding(0) var<storage, read> fc_partials: array<f32>;
@group(0) @binding(1) var<storage, read_write> fc_scalars: array<f32>;
@group(0) @binding(2) var<uniform> fc_p: FinalizeParams;

@compute @workgroup_size(256)
fn finalize_clip(@builtin(local_invocation_id) lid3: vec3<u32>) {
    let lid = lid3.x;
    var acc = 0.0;
    var bad = 0.0;
    for (var i = lid; i < fc_p.count; i += WG) {
        let v = fc_partials[i];
        acc += v;
        if (not_finite(v)) {
            bad = 1.0;
        }
    }
    let total = tree_sum(lid, acc);
    let nbad = tree_sum(lid, bad);
    if (lid == 0u) {
        let finite = nbad == 0.0 && !not_finite(total);
        let norm = sqrt(total) * fc_p.unscale;
        var mult = fc_p.unscale;
        if (!finite) {
            mult = 0.0;
        } else if (fc_p.clip > 0.0 && norm > fc_p.clip) {
            mult = (fc_p.clip / norm) * fc_p.unscale;
        }
        fc_scalars[0] = norm;
        fc_scalars[1] = mult;
        fc_scalars[2] = select(0.0, 1.0, finite);
        fc_scalars[3] = total;
    }
}

// ---------------------------------------------------------------------------------------------------

// generated from its description in ddl_wgpu/ops/reduce.py (`Uniform`)
{{struct TensorClipParams}}

@group(0) @binding(0) var<storage, read> ft_partials: array<f32>;
@group(0) @binding(1) var<storage, read> ft_ranges: array<u32>;
@group(0) @binding(2) var<storage, read> ft_scalars: array<f32>;
@group(0) @binding(3) var<storage, read_write> ft_records: array<f32>;
@group(0) @binding(4) var<uniform> ft_p: TensorClipParams;

@compute @workgroup_size(256)
fn finalize_tensors(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_id) lid3: vec3<u32>,
) {
    let t = wid.x;
    if (t >= ft_p.tensors) {
        return;
    }
    let lid = lid3.x;
    let start = ft_ranges[2u * t];
    let count = ft_ranges[2u * t + 1u];
    var acc = 0.0;
    for (var i = lid; i < count; i += WG) {
        acc += ft_partials[start + i];
    }
    let total = tree_sum(lid, acc);
    if (lid == 0u) {
        let finite = ft_scalars[2] != 0.0;
        let norm = sqrt(total) * ft_p.unscale;
        var mult = ft_p.unscale;
        if (!finite) {
            mult = 0.0;
        } else if (ft_p.clip > 0.0 && norm > ft_p.clip) {
            mult = (ft_p.clip / norm) * ft_p.unscale;
        }
        let at = t * ft_p.stride;
        ft_records[at] = norm;
        ft_records[at + 1u] = mult;
        ft_records[at + 2u] = select(0.0, 1.0, finite);
        ft_records[at + 3u] = total;
    }
}

// ---------------------------------------------------------------------------------------------------

// generated from its description in ddl_wgpu/ops/reduce.py (`Uniform`)
{{struct SumRowsParams}}

@group(0) @binding(0) var<storage, read> sr_x: array<f32>;
@group(0) @binding(1) var<storage, read_write> sr_out: array<f32>;
@group(0) @binding(2) var<uniform> sr_p: SumRowsParams;

@compute @workgroup_size(256)
fn sum_rows(@builtin(local_invocation_id) lid3: vec3<u32>) {
    let lid = lid3.x;
    var acc = 0.0;
    for (var i = lid; i < sr_p.n; i += WG) {
        acc += sr_x[i];
    }
    let total = tree_sum(lid, acc);
    if (lid == 0u) {
        sr_out[sr_p.index] = total;
    }
}
