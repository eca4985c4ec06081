// Matrix-vector products of decoding: y[r, col0 + o] (+)= Σ_i x[r, i] · W[o, i] for the n ≤ a few rows of a
// decoding pass, W (OUT, IN) row-major (the Hugging Face linear layout) in f32 or f16. Memory-bound: every
// weight is read once per row of x, in coalesced runs along IN.
//
// One workgroup of GW threads per output o: for each row r, each thread sums the products of its items
// i = lid, lid + GW, ... (items of type X: f32, or vec4<f32> when IN % 4 == 0), then a tree in shared memory
// adds the GW partial sums in a fixed order (deterministic). f16 weights are read as u32 pairs and widened
// with unpack2x16float (no shader-f16 needed), so the result equals the f32 kernel on the f16-rounded
// weights up to the summation order.
//
//   gemv (x, w, y, p)

const GW: u32 = 64u;
alias X = {{X}};
alias WT = {{WT}};

{{struct GemvParams}}

@group(0) @binding(0) var<storage, read> gx: array<X>;
@group(0) @binding(1) var<storage, read> gw: array<WT>;
@group(0) @binding(2) var<storage, read_write> gy: array<f32>;
@group(0) @binding(3) var<uniform> gp: GemvParams;

var<workgroup> part: array<f32, GW>;

fn weight(j: u32) -> X {
    let w = gw[j];
    return {{LOADW}};
}

@compute @workgroup_size(GW)
fn gemv(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let o = wid.x + wid.y * nwg.x;
    if (o >= gp.out_) { return; }  // uniform per workgroup
    let wrow = o * gp.items;
    for (var r = 0u; r < gp.n; r++) {
        let xrow = r * gp.items;
        var s = 0.0;
        for (var i = lid.x; i < gp.items; i += GW) {
            let v = gx[xrow + i] * weight(wrow + i);
            s += {{HSUM}};
        }
        part[lid.x] = s;
        workgroupBarrier();
        for (var w = GW / 2u; w > 0u; w >>= 1u) {
            if (lid.x < w) { part[lid.x] = part[lid.x] + part[lid.x + w]; }
            workgroupBarrier();
        }
        if (lid.x == 0u) {
            let at = r * gp.ldy + gp.col0 + o;
            gy[at] = select(0.0, gy[at], gp.acc == 1u) + part[0];
        }
        workgroupBarrier();  // part is rewritten for the next row
    }
}
