// AdamW over one flat range of f32 parameters, with the global gradient clip and the non-finite skip read
// from the `scalars` buffer that reduce.wgsl's finalize_clip wrote (no host round trip).
//
// Semantics of ddl_ref.optim.adamw_step (PyTorch AdamW, decoupled weight decay applied first):
//   if scalars[2] == 0 (a non-finite gradient somewhere): p, m, v are left unchanged;
//   p <- p - lr * wd * p
//   g <- grad * scalars[1]                      (clip multiplier)
//   m <- beta1 m + (1 - beta1) g ;  v <- beta2 v + (1 - beta2) g^2
//   p <- p - lr * (m / bc1) / (sqrt(v / bc2) + eps),   bc1 = 1 - beta1^step, bc2 = 1 - beta2^step
// https://pytorch.org/docs/stable/generated/torch.optim.AdamW.html
//
// 1 - beta1, 1 - beta2, bc1 and bc2 come from the host, computed in float64: 1 - f32(0.999) is off by
// 1.3e-5 relative, which would show up in v.
//
// n is the bound length of p (the launcher binds p, g, m, v as views of exactly n floats), so the Params
// uniform holds only hyper-parameters and one uniform can serve every range of a step.

// generated from its description in ddl_wgpu/ops/adamw.py (`Uniform`)
{{struct Params}}

@group(0) @binding(0) var<storage, read> ad_g: array<f32>;
@group(0) @binding(1) var<storage, read> ad_scalars: array<f32>;
@group(0) @binding(2) var<storage, read_write> ad_p: array<f32>;
@group(0) @binding(3) var<storage, read_write> ad_m: array<f32>;
@group(0) @binding(4) var<storage, read_write> ad_v: array<f32>;
@group(0) @binding(5) var<uniform> ad: Params;

@compute @workgroup_size(256)
fn adamw(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
) {
    let i = (wid.x + wid.y * nwg.x) * 256u + lid.x;
    if (i >= arrayLength(&ad_p)) {
        return;
    }
    if (ad_scalars[2] == 0.0) {
        return;
    }
    let g = ad_g[i] * ad_scalars[1];
    var p = ad_p[i];
    p = p - ad.lr * ad.weight_decay * p;
    let m = ad.beta1 * ad_m[i] + ad.one_minus_beta1 * g;
    let v = ad.beta2 * ad_v[i] + ad.one_minus_beta2 * (g * g);
    p = p - ad.lr * (m / ad.bc1) / (sqrt(v / ad.bc2) + ad.eps);
    ad_p[i] = p;
    ad_m[i] = m;
    ad_v[i] = v;
}
