// Token embedding: a gather forward and a deterministic, atomic-free backward.
//
//   embedding_forward  (ids, wte, out, p)              out[tok, c] = wte[ids[tok], c]
//   embedding_forward_range (ids, wte, out, p)         the same for ids in [v0, hi) only, wte holding the
//                                                      table's rows from v0 (one row chunk of a table larger
//                                                      than a binding); other tokens' rows are not written
//   embedding_backward (dout, order, starts, dwte, p)  dwte[v, c] (+)= sum_{j in bucket v0 + v} dout[order[j], c]
//                                                      (dwte: the table's rows from v0; v0 = 0 when whole)
//
// The backward follows llm.c's bucketed wte_backward idea: the host, which knows the ids of each step, sorts
// the token positions by id (stable) into `order` and gives the bucket bounds `starts` (V + 1), so bucket v
// is order[starts[v] .. starts[v+1]). One thread per (v, c) sums its bucket in a fixed order (four
// interleaved partial sums, for memory-level parallelism on the long buckets of frequent tokens, added as
// (s0 + s1) + (s2 + s3)) and writes its element once: same inputs, same bits, no float atomics.
//
// Template: an item is F = f32, or vec4<f32> (4 adjacent channels) when C % 4 == 0; Params.C counts items
// of F. The forward's table is read as W items: W = F, or for an f16 table (the inference Net's
// `dtype="f16"`) f16 / vec4<f16>, converted to F on load; `{{enable}}` is `enable f16;` only then.
{{enable}}

const WG: u32 = 256u;
alias F = {{F}};
alias W = {{W}};

// generated from its description in ddl_wgpu/ops/embedding.py (`Uniform`)
{{struct Params}}

fn item(wid: vec3<u32>, nwg: vec3<u32>, lid: vec3<u32>) -> u32 {
    return (wid.x + wid.y * nwg.x) * WG + lid.x;
}

// ---------------------------------------------------------------------------------------------------------

@group(0) @binding(0) var<storage, read> fw_ids: array<u32>;
@group(0) @binding(1) var<storage, read> fw_wte: array<W>;
@group(0) @binding(2) var<storage, read_write> fw_out: array<F>;
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
    fw_out[gid] = select(F(0.0), F(fw_wte[src]), src < arrayLength(&fw_wte));
}

// One row chunk [v0, hi) of a table too large for one binding: each chunk's dispatch writes only the rows of
// its ids, so the chunks together write every row once. The last chunk (hi = 0xFFFFFFFF) reads an id past
// the table as a zero row, as the whole-table entry does.
@compute @workgroup_size(WG)
fn embedding_forward_range(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                           @builtin(local_invocation_id) lid: vec3<u32>) {
    let gid = item(wid, nwg, lid);
    if (gid >= fw_p.rows * fw_p.C) { return; }
    let tok = gid / fw_p.C;
    let c = gid - tok * fw_p.C;
    let id = fw_ids[tok];
    if (id < fw_p.v0 || id >= fw_p.hi) { return; }
    let src = (id - fw_p.v0) * fw_p.C + c;
    fw_out[gid] = select(F(0.0), F(fw_wte[src]), src < arrayLength(&fw_wte));
}

// ---------------------------------------------------------------------------------------------------------

@group(0) @binding(0) var<storage, read> bw_dout: array<F>;
@group(0) @binding(1) var<storage, read> bw_order: array<u32>;
@group(0) @binding(2) var<storage, read> bw_starts: array<u32>;
@group(0) @binding(3) var<storage, read_write> bw_dwte: array<F>;
@group(0) @binding(4) var<uniform> bw_p: Params;

@compute @workgroup_size(WG)
fn embedding_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                      @builtin(local_invocation_id) lid: vec3<u32>) {
    let gid = item(wid, nwg, lid);
    if (gid >= bw_p.rows * bw_p.C) { return; }
    let v = gid / bw_p.C;
    let c = gid - v * bw_p.C;
    let lo = bw_starts[bw_p.v0 + v];
    let hi = bw_starts[bw_p.v0 + v + 1u];
    if (bw_p.accumulate != 0u && lo == hi) { return; }  // an unseen token: nothing to add
    let C = bw_p.C;
    var s0 = F(0.0);
    var s1 = F(0.0);
    var s2 = F(0.0);
    var s3 = F(0.0);
    var j = lo;
    for (; j + 4u <= hi; j += 4u) {
        s0 += bw_dout[bw_order[j] * C + c];
        s1 += bw_dout[bw_order[j + 1u] * C + c];
        s2 += bw_dout[bw_order[j + 2u] * C + c];
        s3 += bw_dout[bw_order[j + 3u] * C + c];
    }
    for (; j < hi; j++) {
        s0 += bw_dout[bw_order[j] * C + c];
    }
    var s = (s0 + s1) + (s2 + s3);
    if (bw_p.accumulate != 0u) {
        s += bw_dwte[gid];
    }
    bw_dwte[gid] = s;
}
