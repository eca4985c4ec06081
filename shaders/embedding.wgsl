// Token embedding: a gather forward and a deterministic, atomic-free backward.
//
//   embedding_forward  (ids, wte, out, p)              out[tok, c] = wte[ids[tok], c]
//   embedding_backward (dout, order, starts, dwte, p)  dwte[v, c] (+)= sum_{j in bucket v} dout[order[j], c]
//
// The backward follows llm.c's bucketed wte_backward idea: the host, which knows the ids of each step, sorts
// the token positions by id (stable) into `order` and gives the bucket bounds `starts` (V + 1), so bucket v
// is order[starts[v] .. starts[v+1]). One thread per (v, c) sums its bucket in that fixed order and writes
// its element once: same inputs, same bits, no float atomics.

const WG: u32 = 256u;

struct Params {
    rows: u32,        // forward: n_tokens; backward: V
    C: u32,
    accumulate: u32,  // backward: 1 adds into dwte, 0 overwrites it
}

fn item(wid: vec3<u32>, nwg: vec3<u32>, lid: vec3<u32>) -> u32 {
    return (wid.x + wid.y * nwg.x) * WG + lid.x;
}

// ---------------------------------------------------------------------------------------------------------

@group(0) @binding(0) var<storage, read> fw_ids: array<u32>;
@group(0) @binding(1) var<storage, read> fw_wte: array<f32>;
@group(0) @binding(2) var<storage, read_write> fw_out: array<f32>;
@group(0) @binding(3) var<uniform> fw_p: Params;

@compute @workgroup_size(WG)
fn embedding_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                     @builtin(local_invocation_id) lid: vec3<u32>) {
    let gid = item(wid, nwg, lid);
    if (gid >= fw_p.rows * fw_p.C) { return; }
    let tok = gid / fw_p.C;
    let c = gid - tok * fw_p.C;
    // An id past the table (a corrupt batch) reads as a zero row rather than another row's data.
    let src = fw_ids[tok] * fw_p.C + c;
    fw_out[gid] = select(0.0, fw_wte[src], src < arrayLength(&fw_wte));
}

// ---------------------------------------------------------------------------------------------------------

@group(0) @binding(0) var<storage, read> bw_dout: array<f32>;
@group(0) @binding(1) var<storage, read> bw_order: array<u32>;
@group(0) @binding(2) var<storage, read> bw_starts: array<u32>;
@group(0) @binding(3) var<storage, read_write> bw_dwte: array<f32>;
@group(0) @binding(4) var<uniform> bw_p: Params;

@compute @workgroup_size(WG)
fn embedding_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                      @builtin(local_invocation_id) lid: vec3<u32>) {
    let gid = item(wid, nwg, lid);
    if (gid >= bw_p.rows * bw_p.C) { return; }
    let v = gid / bw_p.C;
    let c = gid - v * bw_p.C;
    let lo = bw_starts[v];
    let hi = bw_starts[v + 1u];
    if (bw_p.accumulate != 0u && lo == hi) { return; }  // an unseen token: nothing to add
    var s = 0.0;
    for (var j = lo; j < hi; j++) {
        s += bw_dout[bw_order[j] * bw_p.C + c];
    }
    if (bw_p.accumulate != 0u) {
        s += bw_dwte[gid];
    }
    bw_dwte[gid] = s;
}
