// Gated full attention (Qwen3.5's `attn_output_gate`): q_proj gives per head [query (D); gate (D)], and the
// attention output is multiplied by sigmoid(gate) before o_proj. Reference: `ddl_ref.ops.sigmoid_gate_forward`
// / `sigmoid_gate_backward`; docs/model.md#hybrid-trunks-qwen35.
//
// Rows are (token, head) pairs, rows = N * H; a row of the q_proj output `qg` holds 2D floats [query; gate].
//
//   split_heads     (qg, q, gate, p)          q[row, c] = qg[row, c];  gate[row, c] = qg[row, D + c]
//   gate_forward    (a, gate, out, p)         out = a * sigmoid(gate)
//   gate_backward   (dout, a, gate, da, dqg, p)
//       da = dout * s;  dqg[row, D + c] = dout * a * s * (1 - s)  (s = sigmoid(gate): the gate half of the
//       q_proj output's gradient, written in place, so q_proj's backward is one GEMM)
//   join_query      (dq, dqg, p)              dqg[row, c] = dq[row, c]  (the query half)
//
// One thread per (row, c) item; workgroups spread over x and y (`gpu.grid`).

const WG: u32 = 256u;

// generated from its description in ddl_wgpu/ops/attn_gate.py (`Uniform`)
{{struct Params}}

fn item(wid: vec3<u32>, nwg: vec3<u32>, lid: u32) -> u32 {
    return (wid.x + wid.y * nwg.x) * WG + lid;
}

// stable: exp only sees -|g|
fn sigmoid(g: f32) -> f32 {
    let e = exp(-abs(g));
    let r = 1.0 / (1.0 + e);
    return select(e * r, r, g >= 0.0);
}

// index of item i = row * D + c of a (rows, D) array in the interleaved (rows, 2D) one
fn wide(i: u32, D: u32) -> u32 {
    let row = i / D;
    return row * 2u * D + (i - row * D);
}

@group(0) @binding(0) var<storage, read> sp_qg: array<f32>;
@group(0) @binding(1) var<storage, read_write> sp_q: array<f32>;
@group(0) @binding(2) var<storage, read_write> sp_gate: array<f32>;
@group(0) @binding(3) var<uniform> sp_p: Params;

@compute @workgroup_size(WG)
fn split_heads(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let i = item(wid, nwg, lid);
    if (i >= sp_p.n) { return; }
    let w = wide(i, sp_p.D);
    sp_q[i] = sp_qg[w];
    sp_gate[i] = sp_qg[w + sp_p.D];
}

@group(0) @binding(0) var<storage, read> gf_a: array<f32>;
@group(0) @binding(1) var<storage, read> gf_gate: array<f32>;
@group(0) @binding(2) var<storage, read_write> gf_out: array<f32>;
@group(0) @binding(3) var<uniform> gf_p: Params;

@compute @workgroup_size(WG)
fn gate_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32) {
    let i = item(wid, nwg, lid);
    if (i >= gf_p.n) { return; }
    gf_out[i] = gf_a[i] * sigmoid(gf_gate[i]);
}

@group(0) @binding(0) var<storage, read> gb_dout: array<f32>;
@group(0) @binding(1) var<storage, read> gb_a: array<f32>;
@group(0) @binding(2) var<storage, read> gb_gate: array<f32>;
@group(0) @binding(3) var<storage, read_write> gb_da: array<f32>;
@group(0) @binding(4) var<storage, read_write> gb_dqg: array<f32>;
@group(0) @binding(5) var<uniform> gb_p: Params;

@compute @workgroup_size(WG)
fn gate_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_index) lid: u32) {
    let i = item(wid, nwg, lid);
    if (i >= gb_p.n) { return; }
    let s = sigmoid(gb_gate[i]);
    let d = gb_dout[i];
    gb_da[i] = d * s;
    gb_dqg[wide(i, gb_p.D) + gb_p.D] = d * gb_a[i] * s * (1.0 - s);
}

@group(0) @binding(0) var<storage, read> jq_dq: array<f32>;
@group(0) @binding(1) var<storage, read_write> jq_dqg: array<f32>;
@group(0) @binding(2) var<uniform> jq_p: Params;

@compute @workgroup_size(WG)
fn join_query(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let i = item(wid, nwg, lid);
    if (i >= jq_p.n) { return; }
    jq_dqg[wide(i, jq_p.D)] = jq_dq[i];
}
