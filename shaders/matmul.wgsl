// matmul.wgsl: one generic f32 GEMM, C = alpha * op(A) * op(B) (+ C), row-major everywhere, batched on z.
//
// The three products of a linear layer with the Hugging Face weight layout W (OUT, IN) are all this kernel:
//   forward  y[M,N]  = x[M,K] * W[N,K]^T   (TRANS_B = 1)
//   backward dx[M,K] = dy[M,N] * W[N,K]    (no transposes)
//   backward dW[N,K] (+)= dy[M,N]^T * x[M,K]  (TRANS_A = 1; `accumulate` for tied / accumulated weights)
// op(A) is M x K, stored (M, K) or, with TRANS_A, (K, M) with row stride lda; op(B) is K x N, stored (K, N)
// or, with TRANS_B, (N, K) with row stride ldb; C is (M, N) with row stride ldc.
// Batch z is two-level, (zo, zi) = (z / inner, z % inner), so that per-(batch, head) products of (B, T, H, D)
// tensors need no transposed copies: operand X starts at off_x + zo * stride_x + (zi / div_x) * istride_x
// (div > 1 lets H query heads share K/V heads: GQA). inner = 1, div = 1 is the plain batched GEMM.
// Causal modes, for the products of attention with T x T scores (rows m and columns n are positions):
//   1: skip every tile wholly above the diagonal (n0 > m0 + BM - 1): those C elements are left unwritten;
//   2: op(A) is zero right of the diagonal (k > m): the k loop stops after the tile's last row;
//   3: op(A) is zero left of the diagonal (k < m): the k loop starts at the tile's first row.
//
// Tiling. A workgroup of WX x WY threads owns a BM x BN block of C, BM = WY*TM and BN = WX*TN; each thread
// owns a TM x TN sub-block held as TM*TN/4 separate vec4<f32> accumulators (generated straight-line by
// ddl_wgpu/ops/matmul.py: a private array indexed in a loop is spilled to slow memory on NVIDIA,
// docs/wgpu-notes.md#why-straight-line-wgsl).
// The K axis is walked in steps of BK (the step's BK products generated unrolled, so shared-memory offsets are
// constants): each step the workgroup copies op(A)[m0:m0+BM, k0:k0+BK] into As and op(B)[k0:k0+BK, n0:n0+BN]
// into Bs, both k-major and packed as vec4 along m / n:
//   As[k * SA + mv] = op(A)[m0 + 4mv .. m0 + 4mv + 3, k0 + k]       (BMV = BM / 4, row stride SA = BMV + 1)
//   Bs[k * SB + nv] = op(B)[k0 + k, n0 + 4nv .. n0 + 4nv + 3]       (BNV = BN / 4, SB = BNV + 1)
// The odd row strides matter for operands stored k-contiguous (A as (M, K), B as (N, K)): their copies walk k
// across neighbouring threads, and with a stride of BMV = 32 vec4s every thread of a quarter-warp would store
// to the same banks (8-way conflicts; the H200's NT products ran ~10% slower than NN and TN).
// Transposition lives only in those copies (TRANS_A / TRANS_B are pipeline constants; each layout's copy
// reads global memory along its contiguous axis), so the inner product loop is the same for every layout:
// per k, a thread reads TM/4 vec4 of As and TN/4 vec4 of Bs and does TM*TN/4 vec4 FMAs. A thread's rows are
// the vec4 groups ty, ty + WY, ty + 2WY, ...; its columns the vec4 groups tx, tx + WX, ...: neighbouring
// threads read neighbouring vec4s of Bs (no bank conflicts) and threads of a row broadcast the same As.
// Out-of-range elements of A and B are copied as 0, so the edge tiles of M, N and K need no special case;
// stores are guarded element by element. Each C element is summed by one thread in a fixed k order: the
// result is deterministic (same inputs, same bits).
//
// f16 weights (`{{b_array}}` = f16, with `{{enable}}` = `enable f16;`, the module built only when the launcher
// is asked for b_dtype="f16" and the adapter has shader-f16): B is read as array<f16> and converted to f32 as
// it is copied into Bs; A, C, the shared tiles and every accumulation stay f32. The f32 module has both
// placeholders filled as `f32` / nothing, so its source is unchanged.
//
{{enable}}

// generated from its description in ddl_wgpu/ops/matmul.py (`Uniform`)
{{struct Params}}

@group(0) @binding(0) var<storage, read> a: array<f32>;
@group(0) @binding(1) var<storage, read> b: array<{{b_array}}>;
@group(0) @binding(2) var<storage, read_write> c: array<f32>;
@group(0) @binding(3) var<uniform> P: Params;

override TRANS_A: u32 = 0u;
override TRANS_B: u32 = 0u;

// Tile shape, filled in by the launcher (ddl_wgpu/ops/matmul.py `Tile`).
const WX: u32 = {{wx}}u;    // threads along n
const WY: u32 = {{wy}}u;    // threads along m
const BK: u32 = {{bk}}u;    // k depth of one shared-memory tile
const BMV: u32 = {{bmv}}u;  // BM / 4 = WY * TM / 4
const BNV: u32 = {{bnv}}u;  // BN / 4 = WX * TN / 4
const NT: u32 = WX * WY;

const SA: u32 = BMV + 1u;
const SB: u32 = BNV + 1u;
var<workgroup> As: array<vec4<f32>, {{as_len}}>;  // BK * SA
var<workgroup> Bs: array<vec4<f32>, {{bs_len}}>;  // BK * SB

// Element (row, col) of the stored A / B of this batch, or 0 outside the stored rows x cols (B widened to f32
// when stored as f16).
fn a_at(base: u32, row: u32, col: u32, rows: u32, cols: u32) -> f32 {
    if (row < rows && col < cols) {
        return a[base + row * P.lda + col];
    }
    return 0.0;
}

fn b_at(base: u32, row: u32, col: u32, rows: u32, cols: u32) -> f32 {
    if (row < rows && col < cols) {
        return f32(b[base + row * P.ldb + col]);
    }
    return 0.0;
}

// The tile copies. Slot i (< BK*BMV for A) of a k step is one vec4 of As: row k, vec4 column mv. Consecutive
// threads take consecutive elements along the stored contiguous axis: k when A is (M, K), m when A is stored
// transposed (K, M); likewise n or k for B. `fetch_*` reads a slot's 4 values from global memory (zero
// outside the stored matrix or past the tile), `stash_*` writes them to shared memory: the launcher's
// generated loop issues the next k step's fetches before this step's FMAs, so their latency is hidden.
fn a_slot(i: u32) -> vec2<u32> {  // (k, mv)
    if (TRANS_A == 0u) {
        return vec2<u32>(i % BK, i / BK);
    }
    return vec2<u32>(i / BMV, i % BMV);
}

fn fetch_a(base: u32, m0: u32, k0: u32, i: u32) -> vec4<f32> {
    if (i >= BK * BMV) {
        return vec4<f32>(0.0);
    }
    let s = a_slot(i);
    let m = m0 + 4u * s.y;
    let kg = k0 + s.x;
    if (TRANS_A == 0u) {
        return vec4<f32>(a_at(base, m, kg, P.M, P.K), a_at(base, m + 1u, kg, P.M, P.K),
                         a_at(base, m + 2u, kg, P.M, P.K), a_at(base, m + 3u, kg, P.M, P.K));
    }
    return vec4<f32>(a_at(base, kg, m, P.K, P.M), a_at(base, kg, m + 1u, P.K, P.M),
                     a_at(base, kg, m + 2u, P.K, P.M), a_at(base, kg, m + 3u, P.K, P.M));
}

fn stash_a(i: u32, v: vec4<f32>) {
    if (i < BK * BMV) {
        let s = a_slot(i);
        As[s.x * SA + s.y] = v;
    }
}

fn b_slot(i: u32) -> vec2<u32> {  // (k, nv)
    if (TRANS_B == 0u) {
        return vec2<u32>(i / BNV, i % BNV);
    }
    return vec2<u32>(i % BK, i / BK);
}

fn fetch_b(base: u32, n0: u32, k0: u32, i: u32) -> vec4<f32> {
    if (i >= BK * BNV) {
        return vec4<f32>(0.0);
    }
    let s = b_slot(i);
    let n = n0 + 4u * s.y;
    let kg = k0 + s.x;
    if (TRANS_B == 0u) {
        return vec4<f32>(b_at(base, kg, n, P.K, P.N), b_at(base, kg, n + 1u, P.K, P.N),
                         b_at(base, kg, n + 2u, P.K, P.N), b_at(base, kg, n + 3u, P.K, P.N));
    }
    return vec4<f32>(b_at(base, n, kg, P.N, P.K), b_at(base, n + 1u, kg, P.N, P.K),
                     b_at(base, n + 2u, kg, P.N, P.K), b_at(base, n + 3u, kg, P.N, P.K));
}

fn stash_b(i: u32, v: vec4<f32>) {
    if (i < BK * BNV) {
        let s = b_slot(i);
        Bs[s.x * SB + s.y] = v;
    }
}

// C[m, n] = alpha * v (+ C[m, n]) for the element in range; `row` is the offset of row m in c.
fn put(row: u32, n: u32, v: f32) {
    if (n < P.N) {
        let i = row + n;
        var r = P.alpha * v;
        if (P.accumulate != 0u) {
            r += c[i];
        }
        c[i] = r;
    }
}

// Four consecutive columns n .. n+3 of row m.
fn store4(base: u32, m: u32, n: u32, v: vec4<f32>) {
    if (m < P.M) {
        let row = base + m * P.ldc;
        put(row, n, v.x);
        put(row, n + 1u, v.y);
        put(row, n + 2u, v.z);
        put(row, n + 3u, v.w);
    }
}

@compute @workgroup_size(WX, WY, 1)
fn matmul(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let n0 = wid.x * BNV * 4u;
    let m0 = wid.y * BMV * 4u;
    let z = wid.z;
    // Bounds guard, uniform over the workgroup (the barriers below need every thread of a live tile).
    if (m0 >= P.M || n0 >= P.N || z >= P.batch) {
        return;
    }
    if (P.causal == 1u && n0 > m0 + BMV * 4u - 1u) {
        return;
    }
    var k_begin = 0u;
    var k_end = P.K;
    if (P.causal == 2u) {
        k_end = min(P.K, m0 + BMV * 4u);
    } else if (P.causal == 3u) {
        k_begin = (m0 / BK) * BK;
    }
    let t = lid.y * WX + lid.x;  // the copies' thread index
    let tx = lid.x;
    let ty = lid.y;
    let zo = z / P.inner;
    let zi = z % P.inner;
    let base_a = P.off_a + zo * P.stride_a + (zi / P.div_a) * P.istride_a;
    let base_b = P.off_b + zo * P.stride_b + (zi / P.div_b) * P.istride_b;
    let base_c = P.off_c + zo * P.stride_c + zi * P.istride_c;

{{acc_decl}}
{{kloop}}

{{store}}
}

// Split-K reduction (deterministic, no atomics). A product with few output tiles and a long K (the weight
// gradients dW = dy^T x with K = tokens, the LM head's dx with K = vocabulary) leaves most of a large GPU idle;
// the launcher then runs it as `parts` products over consecutive K slices, written to a partials buffer
// (parts, M, N), and this pass sums them in slice order: C = alpha * sum_p partials[p] (+ C).
// generated from its description in ddl_wgpu/ops/matmul.py (`Uniform`)
{{struct RParams}}

@group(0) @binding(0) var<storage, read> r_parts: array<f32>;
@group(0) @binding(1) var<storage, read_write> r_c: array<f32>;
@group(0) @binding(2) var<uniform> R: RParams;

@compute @workgroup_size(256)
fn splitk_reduce(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_index) lid: u32) {
    let i = (wid.x + wid.y * nwg.x) * 256u + lid;
    if (i >= R.n) {
        return;
    }
    var s = 0.0;
    for (var p = 0u; p < R.parts; p++) {
        s += r_parts[p * R.stride + i];
    }
    var r = R.alpha * s;
    if (R.accumulate != 0u) {
        r += r_c[i];
    }
    r_c[i] = r;
}
