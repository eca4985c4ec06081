// The MTP draft's block input before its projection: per row r, the two RMS-normed halves
//
//   mtp_input_rows (e, h, wn, valid, cat, p)   cat[r] = [enorm(e[r]); hnorm(h[hr])]   (order: p.e_col, p.h_col)
//                                              zeroed where valid[r] == 0
//
// The projection x = cat · eh_projᵀ runs on `matmul` after it (ddl_wgpu/ops/mtp_input.py), so the rows the
// draft reads are built from buffers already on the GPU: e is the gather of the row tokens from the shared
// embedding, h the trunk's hidden rows (heal's step 1) or the draft's own output rows (steps 2..chain).
// A zero row of cat gives an exactly zero row of x, which is how `ddl_ref.mtp.step_input` masks rows past a
// window's end. Forward only: heal keeps enorm, hnorm and eh_proj frozen (joint training's backward of the
// input projection is `ddl_ref.mtp.draft_input_backward` and runs elsewhere).
//
// Row mapping: r = b·T + t reads the hidden row hr = b·h_stride + h_offset + t, so one kernel reads the
// trunk's (B, T, C) rows (h_stride = T, h_offset = 0) or the last T rows of a stacked (B, S·T, C) draft
// forward (h_stride = S·T, h_offset = (S − 1)·T).
//
// One workgroup per row: each invocation sums the squares of channels lid, lid + WG, ... of both inputs, the
// fixed-shape tree of prelude_reduce.wgsl adds the partial sums (same bits every run), then each invocation
// writes its channels. norm = (x · rstd) · w (style 0) or (x · rstd) · (1 + w) (style 1), rstd =
// 1 / sqrt(sum(x²) / C + eps), the association of `ddl_ref.ops.rmsnorm_forward`.

const WG: u32 = 256u;

{{include prelude_reduce.wgsl}}

// generated from its description in ddl_wgpu/ops/mtp_input.py (`Uniform`)
{{struct Params}}

@group(0) @binding(0) var<storage, read> e: array<f32>;               // (rows, C) embeddings of the tokens
@group(0) @binding(1) var<storage, read> h: array<f32>;               // hidden rows, indexed by hr
@group(0) @binding(2) var<storage, read> wn: array<f32>;              // (2, C): enorm weight, hnorm weight
@group(0) @binding(3) var<storage, read> valid: array<f32>;           // (rows,): 0 zeroes the row
@group(0) @binding(4) var<storage, read_write> cat: array<f32>;       // (rows, 2C)
@group(0) @binding(5) var<uniform> p: Params;

@compute @workgroup_size(WG)
fn mtp_input_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_id) lid3: vec3<u32>) {
    let r = wid.x + wid.y * nwg.x;
    if (r >= p.rows) { return; }  // the same for the whole workgroup: the barriers below stay uniform
    let lid = lid3.x;
    let C = p.C;
    let b = r / p.T;
    let hr = b * p.h_stride + p.h_offset + (r - b * p.T);
    var se = 0.0;
    var sh = 0.0;
    for (var c = lid; c < C; c += WG) {
        let x = e[r * C + c];
        let y = h[hr * C + c];
        se += x * x;
        sh += y * y;
    }
    se = tree_sum(lid, se);
    sh = tree_sum(lid, sh);
    let re = 1.0 / sqrt(se / f32(C) + p.eps);
    let rh = 1.0 / sqrt(sh / f32(C) + p.eps);
    let keep = valid[r] != 0.0;
    let one = select(0.0, 1.0, p.style == 1u);  // offset style: (1 + w)
    let out = r * 2u * C;
    for (var c = lid; c < C; c += WG) {
        let en = (e[r * C + c] * re) * (one + wn[c]);
        let hn = (h[hr * C + c] * rh) * (one + wn[C + c]);
        cat[out + p.e_col + c] = select(0.0, en, keep);
        cat[out + p.h_col + c] = select(0.0, hn, keep);
    }
}
