// Matrix-vector products of decoding at batch 1: y[r, o] (+)= Σ_i x[r, i] · W[o, i] for the NX ≤ a few rows
// of a decoding pass, W (OUT, IN) row-major (the Hugging Face linear layout) in f32 or f16. Memory-bound:
// every weight is read once per pass, in coalesced 16-byte loads along IN, so the kernel is built to keep
// many loads in flight and do little else.
//
// Layout of the work. A workgroup of WG threads owns ROWS consecutive outputs. Its threads form teams: on the
// subgroup path a team is one subgroup (its size and count are the device's, read from the builtins), on the
// workgroup-memory path TEAM consecutive threads. A team takes RT of the workgroup's rows at a time; each
// lane sums, for each of those rows and each x row, the products of the items lane, lane + T, lane + 2T, ...
// (an item: 4 f32, or 8 or 4 f16 read as u32 pairs and widened with unpack2x16float, so no shader-f16 is
// needed), UNROLL items per loop turn with every load issued before the arithmetic. The lanes' sums are then
// added by a butterfly of subgroupShuffleXor (subgroup path) or a tree in workgroup memory: a fixed order in
// both, and a lane adds its items in increasing i whatever UNROLL is, so a row's result does not depend on
// UNROLL, RT, ROWS, on how many x rows share the pass, or on the run (deterministic). It does depend on the
// team size T (the subgroup size, or TEAM).
//
// Two forms (template MODE):
// - stacked segments: up to 4 matrices whose rows follow one another in one weight binding (a layer's
//   q/k/v, or a Gated DeltaNet's four input projections: adjacent in the parameter arena) computed as one
//   OUT = Σ rows product; segment s starts at output row st_s, its weights at item wb_s of the binding, and
//   its outputs go to binding yb_s at float yo_s + r·ld_s + (o − st_s). One segment is the plain product
//   (with a column offset and row stride: the LM head's vocabulary chunks).
// - swiglu: the MLP's gate and up products for output column o at once (gate rows from item wb0, up rows
//   from wb1) and y = silu(gate) · up written directly (`swiglu.wgsl`'s sigmoid): no gate/up buffers and no
//   separate SwiGLU pass.
//
// Either form can fuse an RMSNorm of x into its input read (generated so when `gemv.Norm` is given): a
// lane also sums the squares of the x items it loads (one more accumulator per x row, reduced with the
// others, so every team sums them in the same order) and multiplies each item by the norm weight (+ p.noff:
// 1 for the offset style) before it meets W; the row's sums are scaled by rstd = 1 / sqrt(mean(x²) + eps)
// when stored. The normalised row is never written: no norm pass before the product.
//
//   gemv (x, w [, w_up] [, norm_w], y0 [, y1, y2, y3], p)

override WG: u32 = 256u;   // threads per workgroup
override ROWS: u32 = 16u;  // outputs per workgroup
override TEAM: u32 = 32u;  // threads per row on the workgroup-memory path
const RT: u32 = {{RT}}u;   // rows a team computes at once (weight rows per loop turn: RT, 2·RT for swiglu)
const UNROLL: u32 = {{UNROLL}}u;

alias XA = {{XA}};  // one load of x: vec4<f32>, or f32 for the scalar form
alias WV = {{WV}};  // one item of W: vec4<f32>, vec4<u32> (8 halves), vec2<u32> (4 halves) or f32

{{struct GemvParams}}

{{BINDINGS}}
@group(0) @binding({{UBIND}}) var<uniform> gp: GemvParams;

var<workgroup> part: array<f32, {{PART}}>;

// Numerically stable sigmoid, as swiglu.wgsl's: exp only sees −|g|.
fn sigmoid(g: f32) -> f32 {
    let e = exp(-abs(g));
    let r = 1.0 / (1.0 + e);
    return select(e * r, r, g >= 0.0);
}

// the segment of output row o, its first row, its first weight item
fn seg(o: u32) -> u32 {
    return select(0u, 1u, o >= gp.st1) + select(0u, 1u, o >= gp.st2) + select(0u, 1u, o >= gp.st3);
}

fn seg_start(s: u32) -> u32 {
    return select(select(select(0u, gp.st1, s >= 1u), gp.st2, s >= 2u), gp.st3, s >= 3u);
}

fn seg_w(s: u32) -> u32 {
    return select(select(select(gp.wb0, gp.wb1, s >= 1u), gp.wb2, s >= 2u), gp.wb3, s >= 3u);
}

// the weight item of row o's first column
fn wrow(o: u32) -> u32 {
{{WROW}}
}

// y[r, o] (+)= v for an output row o < OUT
fn store(o: u32, r: u32, v: f32) {
{{STORE}}
}

{{TEAMSUM}}
@compute @workgroup_size(WG)
fn gemv(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) li: u32{{BUILTINS}}) {
    let wg_row = (wid.x + wid.y * nwg.x) * ROWS;
{{TEAMS}}
    let items = gp.items;
    let last = gp.out_ - 1u;
    {{ROWLOOP}} {
        let o0 = wg_row + {{RR}};
{{ROWBASES}}
{{DECL}}
        var i = lane;
        for (; i + (UNROLL - 1u) * T < items; i += UNROLL * T) {
{{BODY_UNROLLED}}
        }
        for (; i < items; i += T) {
{{BODY_ONE}}
        }
{{REDUCE_STORE}}
    }
}
