// A smoke test for a fresh machine (`ddl-wgpu check`, `make demo`): y = alpha * x + y over n floats.
// Small enough to compile in milliseconds on any adapter; exercises storage reads and writes, a uniform,
// a 2-D dispatch grid and the bounds guard.

{{struct Params}}

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;
@group(0) @binding(2) var<uniform> p: Params;

@compute @workgroup_size(64)
fn saxpy(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
         @builtin(local_invocation_index) lid: u32) {
  let i = (wid.x + wid.y * nwg.x) * 64u + lid;
  if (i >= p.n) {
    return;
  }
  y[i] = p.alpha * x[i] + y[i];
}
