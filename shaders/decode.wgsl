// Decoding with a cache: n new rows at positions start .. start + n − 1 of one sequence, where `start` (the
// cache's length before these rows) is read from a small storage buffer `meta` written by the host before
// each submit, so every bind group and uniform is built once (ddl_wgpu/ops/decode.py).
//
//   store_rows   (src, meta, dst, p)          dst[(base + r) * stride + col0 + c] = src[r * W + c],
//                                             base = meta[0] when p.at_meta, else 0 (KV/history/hidden
//                                             caches; the draft's [enorm(e); hnorm(h)] concatenation)
//   rope_at      (x, cos, sin, meta, out, p)  rotate-half RoPE of x (n, N, D) at positions start + r, on the
//                                             first R dims of each head (tables (cap, R)); the other D − R
//                                             pass through (partial RoPE, Qwen3.5: R = D/4)
//   rope_store   (q, k, v, rope, meta, qo, kc, vc, p)
//                                             a decoding pass's last step before attention in one launch:
//                                             qo = RoPE(q), and RoPE(k), v stored into the caches at rows
//                                             start + r (rope: the cos table, then the sin table)
//   qk_finish    (q, k, w, rope, meta, qo, kc, p)
//                                             q and k through their chain with a q/k norm (RMSNorm then
//                                             RoPE, or RoPE then RMSNorm): q into qo, k into the key cache
//                                             at rows start + r
//   attend_split (q, kc, vc, meta, part, p)   row r's attention over cache slots 0 .. start + r (GQA: kv
//                                             head h / (H/K)) in up to p.ns splits of the keys, each
//                                             split's (max, sum, unnormalised output) into part
//   attend_merge (part, meta, out, p)         out (n, H, D): the splits combined in split order
//   argmax_split (logits, part, p)            per (row, block of the vocabulary): its best logit and id
//                                             and its softmax pair
//   argmax_merge (part, ids, probs, p)        per row: the argmax (ties: the lower id) and its
//                                             full-softmax probability (topk's k = 1, over workgroups)
//   conv_cache   (hist, conv, read, meta, out, p)
//                                             the causal short conv over time from a history cache
//                                             hist (cap, C, dv) holding every position's input: TC
//                                             (with the read over d_v: out (n, C)) or EC (hist (cap, C)
//                                             of embeddings: out (n, C, dv))
//   concat_rows  (a, b, dst, p)               dst = [a (na rows); b (nb rows)], rows of W floats (a Gated
//                                             DeltaNet layer's [window before the pass; the pass's rows])
//   take_rows2   (src, src2, meta, dst, dst2, p)
//                                             two take_rows in one launch (a layer's state and window)
//   take_rows    (src, meta, dst, p)          dst[h * E + e] = src[h * hs + s * rs + e], s = p.slot or
//                                             meta[0]: one slot per head out of a strided buffer (a Gated
//                                             DeltaNet layer's state after row s of a pass; its conv window,
//                                             rows s .. s + k − 2 of [window; the pass's rows])
//
// Every entry point is one thread per output item (attend_split: one workgroup per (row, head, split);
// attend_merge and qk_finish: one per (row, head)); the launchers spread workgroups over x and y
// (`gpu.grid`) and every index is guarded.

const WG: u32 = 256u;

fn item(wid: vec3<u32>, nwg: vec3<u32>, lid: vec3<u32>) -> u32 {
    return (wid.x + wid.y * nwg.x) * WG + lid.x;
}

// ---------------------------------------------------------------------------------------------------------
// store_rows

{{struct StoreParams}}

@group(0) @binding(0) var<storage, read> st_src: array<f32>;
@group(0) @binding(1) var<storage, read> st_meta: array<u32>;
@group(0) @binding(2) var<storage, read_write> st_dst: array<f32>;
@group(0) @binding(3) var<uniform> st_p: StoreParams;

@compute @workgroup_size(WG)
fn store_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = item(wid, nwg, lid);
    if (i >= st_p.n * st_p.W) { return; }
    let r = i / st_p.W;
    let c = i - r * st_p.W;
    let base = select(0u, st_meta[0], st_p.at_meta == 1u);
    let at = (base + r) * st_p.stride + st_p.col0 + c;
    if (at < arrayLength(&st_dst)) {
        st_dst[at] = st_src[i];
    }
}

// ---------------------------------------------------------------------------------------------------------
// rope_at: x (n, N, D), tables (cap, R) whose row t is position t. One thread per pair slot i < D/2 of a
// (row, head): i < R/2 rotates the pair (i, i + R/2), as `ops.rope` (rotate-half within the R rotated dims);
// i >= R/2 copies the two pass-through items R + 2 (i − R/2) and the next one.

{{struct RopeParams}}

@group(0) @binding(0) var<storage, read> ro_x: array<f32>;
@group(0) @binding(1) var<storage, read> ro_cos: array<f32>;
@group(0) @binding(2) var<storage, read> ro_sin: array<f32>;
@group(0) @binding(3) var<storage, read> ro_meta: array<u32>;
@group(0) @binding(4) var<storage, read_write> ro_out: array<f32>;
@group(0) @binding(5) var<uniform> ro_p: RopeParams;

@compute @workgroup_size(WG)
fn rope_at(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_id) lid: vec3<u32>) {
    let gid = item(wid, nwg, lid);
    if (gid >= ro_p.pairs) { return; }
    let slots = ro_p.D / 2u;
    let row = gid / slots;  // r * N + head
    let i = gid - row * slots;
    let h = ro_p.R / 2u;
    let x0 = row * ro_p.D;
    if (i >= h) {
        let at = x0 + ro_p.R + 2u * (i - h);
        ro_out[at] = ro_x[at];
        ro_out[at + 1u] = ro_x[at + 1u];
        return;
    }
    let pos = min(ro_meta[0] + row / ro_p.N, ro_p.cap - 1u);
    let a = ro_x[x0 + i];
    let b = ro_x[x0 + i + h];
    let t = pos * ro_p.R + i;
    ro_out[x0 + i] = a * ro_cos[t] - b * ro_sin[t];
    ro_out[x0 + i + h] = b * ro_cos[t + h] + a * ro_sin[t + h];
}

// ---------------------------------------------------------------------------------------------------------
// rope_store: one thread per item of three ranges: the q pair slots (as rope_at's, into qo), the k pair
// slots (rotated into kc's rows start + r), v's items (copied into vc's rows start + r). q (n, H, D), k and v
// (n, K, D); the caches (cap, K, D); rope (2, cap, R): cos then sin.

{{struct RopeStoreParams}}

@group(0) @binding(0) var<storage, read> rs_q: array<f32>;
@group(0) @binding(1) var<storage, read> rs_k: array<f32>;
@group(0) @binding(2) var<storage, read> rs_v: array<f32>;
@group(0) @binding(3) var<storage, read> rs_rope: array<f32>;
@group(0) @binding(4) var<storage, read> rs_meta: array<u32>;
@group(0) @binding(5) var<storage, read_write> rs_qo: array<f32>;
@group(0) @binding(6) var<storage, read_write> rs_kc: array<f32>;
@group(0) @binding(7) var<storage, read_write> rs_vc: array<f32>;
@group(0) @binding(8) var<uniform> rs_p: RopeStoreParams;

@compute @workgroup_size(WG)
fn rope_store(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_id) lid: vec3<u32>) {
    let gid = item(wid, nwg, lid);
    let D = rs_p.D;
    let slots = D / 2u;
    let nq = rs_p.n * rs_p.H * slots;
    let nk = rs_p.n * rs_p.K * slots;
    let start = rs_meta[0];
    if (gid < nq + nk) {
        let is_k = gid >= nq;
        let g = select(gid, gid - nq, is_k);
        let row = g / slots;  // r · heads + head
        let i = g - row * slots;
        let heads = select(rs_p.H, rs_p.K, is_k);
        let pos = min(start + row / heads, rs_p.cap - 1u);
        let x0 = row * D;
        let h = rs_p.R / 2u;
        let rot = i < h;  // slots past R/2 pass two items through
        let ia = select(rs_p.R + 2u * (i - min(i, h)), i, rot);
        let ib = select(ia + 1u, i + h, rot);
        var a = 0.0;
        var b = 0.0;
        if (is_k) {
            a = rs_k[x0 + ia];
            b = rs_k[x0 + ib];
        } else {
            a = rs_q[x0 + ia];
            b = rs_q[x0 + ib];
        }
        var oa = a;
        var ob = b;
        if (rot) {  // as rope_at: rotate-half within the R rotated dims
            let t = pos * rs_p.R + i;
            let c = rs_p.cap * rs_p.R;  // the sin table follows the cos table
            oa = a * rs_rope[t] - b * rs_rope[c + t];
            ob = b * rs_rope[t + h] + a * rs_rope[c + t + h];
        }
        if (is_k) {
            let kc0 = start * rs_p.K * D + x0;  // row r of the pass is cache row start + r
            if (kc0 + D <= arrayLength(&rs_kc)) {
                rs_kc[kc0 + ia] = oa;
                rs_kc[kc0 + ib] = ob;
            }
        } else {
            rs_qo[x0 + ia] = oa;
            rs_qo[x0 + ib] = ob;
        }
        return;
    }
    let j = gid - nq - nk;
    if (j < rs_p.n * rs_p.K * D) {
        let at = start * rs_p.K * D + j;
        if (at < arrayLength(&rs_vc)) {
            rs_vc[at] = rs_v[j];
        }
    }
}

// ---------------------------------------------------------------------------------------------------------
// qk_finish: one workgroup of QW threads per head row (r, head) of q (the first n·H workgroups) and of k (the
// next n·K). The head's D values go to workgroup memory and through its chain in order: p.order 1 ("pre_rope")
// RMSNorm then RoPE, 2 ("post_rope") RoPE then RMSNorm. RMSNorm as rmsnorm.wgsl's: out = weff · x · rstd,
// rstd = 1/sqrt(mean(x²) + eps), weff = w (style 0) or 1 + w (style 1, offset); its sum a fixed tree.
// RoPE as rope_at's (rotate-half within the first R dims). The norm weights share one binding: q's at
// float p.wq, k's at p.wk.

const QW: u32 = 64u;

{{struct QkParams}}

@group(0) @binding(0) var<storage, read> qk_q: array<f32>;
@group(0) @binding(1) var<storage, read> qk_k: array<f32>;
@group(0) @binding(2) var<storage, read> qk_w: array<f32>;
@group(0) @binding(3) var<storage, read> qk_rope: array<f32>;
@group(0) @binding(4) var<storage, read> qk_meta: array<u32>;
@group(0) @binding(5) var<storage, read_write> qk_qo: array<f32>;
@group(0) @binding(6) var<storage, read_write> qk_kc: array<f32>;
@group(0) @binding(7) var<uniform> qk_p: QkParams;

var<workgroup> qk_x: array<f32, MAXD>;  // the head
var<workgroup> qk_red: array<f32, QW>;

fn qk_rope_step(lid: u32, pos: u32) {
    let h = qk_p.R / 2u;
    let c = qk_p.cap * qk_p.R;  // the sin table follows the cos table
    for (var i = lid; i < h; i += QW) {
        let t = pos * qk_p.R + i;
        let a = qk_x[i];
        let b = qk_x[i + h];
        qk_x[i] = a * qk_rope[t] - b * qk_rope[c + t];
        qk_x[i + h] = b * qk_rope[t + h] + a * qk_rope[c + t + h];
    }
    workgroupBarrier();
}

fn qk_norm_step(lid: u32, w0: u32) {
    var ss = 0.0;
    for (var d = lid; d < qk_p.D; d += QW) { ss += qk_x[d] * qk_x[d]; }
    qk_red[lid] = ss;
    workgroupBarrier();
    for (var m = QW / 2u; m > 0u; m >>= 1u) {
        if (lid < m) { qk_red[lid] = qk_red[lid] + qk_red[lid + m]; }
        workgroupBarrier();
    }
    let r = 1.0 / sqrt(qk_red[0] / f32(qk_p.D) + qk_p.eps);
    for (var d = lid; d < qk_p.D; d += QW) {
        let w = qk_w[w0 + d];
        qk_x[d] = select(w, 1.0 + w, qk_p.style != 0u) * qk_x[d] * r;
    }
    workgroupBarrier();
}

@compute @workgroup_size(QW)
fn qk_finish(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_id) lid3: vec3<u32>) {
    let g = wid.x + wid.y * nwg.x;
    let nq = qk_p.n * qk_p.H;
    if (g >= nq + qk_p.n * qk_p.K) { return; }  // uniform per workgroup: no barrier is skipped by half of it
    let lid = lid3.x;
    let is_k = g >= nq;
    let row = select(g, g - nq, is_k);  // r · heads + head
    let heads = select(qk_p.H, qk_p.K, is_k);
    let start = qk_meta[0];
    let pos = min(start + row / heads, qk_p.cap - 1u);
    let D = qk_p.D;
    let x0 = row * D;
    for (var d = lid; d < D; d += QW) {
        qk_x[d] = select(qk_q[x0 + d], qk_k[x0 + d], is_k);
    }
    workgroupBarrier();
    let w0 = select(qk_p.wq, qk_p.wk, is_k);
    if (qk_p.order == 1u) {
        qk_norm_step(lid, w0);
        qk_rope_step(lid, pos);
    } else {
        qk_rope_step(lid, pos);
        qk_norm_step(lid, w0);
    }
    let kc0 = start * qk_p.K * D + x0;  // row r of the pass is cache row start + r
    for (var d = lid; d < D; d += QW) {
        if (is_k) {
            if (kc0 + d < arrayLength(&qk_kc)) { qk_kc[kc0 + d] = qk_x[d]; }
        } else {
            qk_qo[x0 + d] = qk_x[d];
        }
    }
}

// ---------------------------------------------------------------------------------------------------------
// attend_split / attend_merge: attention over the cache split by keys (flash-decoding). Row r's keys
// 0 .. S − 1 (S = start + r + 1) are taken in blocks of KB; the blocks are dealt to at most p.ns splits in
// runs of bps = ceil(blocks / ns), so the partition depends on S alone (a row's bits are the same in a
// one-row pass and in a verify: docs/generate.md#rows-computed-apart). attend_split: one workgroup per
// (row, head, split) runs an online softmax over its blocks and writes (m, l, o): its running max, its sum
// of exp(score − m) and its unnormalised output o[d] = Σ exp(score − m) v[d]. attend_merge: one workgroup
// per (row, head) combines the splits in split order: out = Σ_p e^(m_p − M) o_p / Σ_p e^(m_p − M) l_p.
//
// In a block each key has LPK lanes: lane l sums q[d] k[d] over d = l, l + LPK, ... and the key's LPK
// partial sums are added in lane order; every thread then reads the block's KB scores (the same max and
// sums in every thread, in key order) and accumulates its output dims d = lid, lid + AW, ... over the
// block's keys in key order. Fixed orders throughout: deterministic.

const AW: u32 = 64u;                 // threads per workgroup (and per merge)
const KB: u32 = 16u;                 // keys per block
const LPK: u32 = AW / KB;            // lanes per key
const MAXD: u32 = 256u;              // head_dim at most MAXD (checked by the launcher)
const DPT: u32 = MAXD / AW;          // output dims per thread
const MAXNS: u32 = 64u;              // splits at most (checked by the launcher)
const NEG: f32 = -3.0e38;            // a running max before any value

{{struct AttnParams}}

@group(0) @binding(0) var<storage, read> at_q: array<f32>;
@group(0) @binding(1) var<storage, read> at_k: array<f32>;
@group(0) @binding(2) var<storage, read> at_v: array<f32>;
@group(0) @binding(3) var<storage, read> at_meta: array<u32>;
@group(0) @binding(4) var<storage, read_write> at_part: array<f32>;
@group(0) @binding(5) var<uniform> at_p: AttnParams;

var<workgroup> at_qs: array<f32, MAXD>;   // the row's query head
var<workgroup> at_pd: array<f32, AW>;     // the lanes' partial dot products
var<workgroup> at_sc: array<f32, KB>;     // the block's scores

// (blocks of row r's keys, blocks per split)
fn at_blocks(r: u32) -> vec2<u32> {
    let S = at_meta[0] + r + 1u;
    let nb = (S + KB - 1u) / KB;
    return vec2<u32>(nb, (nb + at_p.ns - 1u) / at_p.ns);
}

@compute @workgroup_size(AW)
fn attend_split(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_id) lid3: vec3<u32>) {
    let g = wid.x + wid.y * nwg.x;  // (r · H + h) · ns + split
    let ns = at_p.ns;
    if (g >= at_p.n * at_p.H * ns) { return; }  // uniform per workgroup: no barrier is skipped by half of it
    let lid = lid3.x;
    let rh = g / ns;
    let r = rh / at_p.H;
    let h = rh - r * at_p.H;
    let kvh = h / (at_p.H / at_p.K);
    let D = at_p.D;
    let S = at_meta[0] + r + 1u;
    let nb = at_blocks(r);
    let b0 = (g - rh * ns) * nb.y;
    if (b0 >= nb.x) { return; }  // a split past the row's keys (uniform)
    let b1 = min(nb.x, b0 + nb.y);
    for (var d = lid; d < D; d += AW) { at_qs[d] = at_q[rh * D + d]; }
    workgroupBarrier();
    let j = lid / LPK;
    let lane = lid - j * LPK;
    var acc: array<f32, DPT>;
    for (var t = 0u; t < DPT; t++) { acc[t] = 0.0; }
    var m = NEG;
    var l = 0.0;
    for (var b = b0; b < b1; b++) {
        let s0 = b * KB;
        let s = s0 + j;
        var dot = 0.0;
        if (s < S) {
            let ko = (s * at_p.K + kvh) * D;
            for (var d = lane; d < D; d += LPK) { dot += at_qs[d] * at_k[ko + d]; }
        }
        at_pd[lid] = dot;
        workgroupBarrier();
        if (lane == 0u) {
            var sum = 0.0;
            for (var u = 0u; u < LPK; u++) { sum += at_pd[lid + u]; }
            at_sc[j] = select(NEG, sum * at_p.scale, s < S);
        }
        workgroupBarrier();
        let cnt = min(KB, S - s0);
        var bm = m;
        for (var t = 0u; t < cnt; t++) { bm = max(bm, at_sc[t]); }
        let f = exp(m - bm);
        for (var u = 0u; u < DPT; u++) { acc[u] *= f; }
        var bl = 0.0;
        for (var t = 0u; t < cnt; t++) {
            let e = exp(at_sc[t] - bm);
            bl += e;
            let vo = ((s0 + t) * at_p.K + kvh) * D;
            for (var u = 0u; u < DPT; u++) {
                let d = lid + u * AW;
                if (d < D) { acc[u] += e * at_v[vo + d]; }
            }
        }
        l = l * f + bl;
        m = bm;
        workgroupBarrier();  // at_pd and at_sc are rewritten by the next block
    }
    let base = g * (D + 2u);
    if (lid == 0u) {
        at_part[base] = m;
        at_part[base + 1u] = l;
    }
    for (var u = 0u; u < DPT; u++) {
        let d = lid + u * AW;
        if (d < D) { at_part[base + 2u + d] = acc[u]; }
    }
}

@group(0) @binding(0) var<storage, read> am_part: array<f32>;
@group(0) @binding(1) var<storage, read> am_meta: array<u32>;
@group(0) @binding(2) var<storage, read_write> am_out: array<f32>;
@group(0) @binding(3) var<uniform> am_p: AttnParams;

var<workgroup> am_w: array<f32, MAXNS>;  // e^(m_p − M) per split

@compute @workgroup_size(AW)
fn attend_merge(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_id) lid3: vec3<u32>) {
    let rh = wid.x + wid.y * nwg.x;  // r · H + h
    if (rh >= am_p.n * am_p.H) { return; }  // uniform per workgroup
    let lid = lid3.x;
    let r = rh / am_p.H;
    let D = am_p.D;
    let S = am_meta[0] + r + 1u;
    let nb = (S + KB - 1u) / KB;
    let bps = (nb + am_p.ns - 1u) / am_p.ns;
    let P = (nb + bps - 1u) / bps;  // the splits that hold keys
    let stride = D + 2u;
    let base = rh * am_p.ns * stride;
    var M = NEG;
    for (var p = 0u; p < P; p++) { M = max(M, am_part[base + p * stride]); }
    if (lid < P) { am_w[lid] = exp(am_part[base + lid * stride] - M); }
    workgroupBarrier();
    var L = 0.0;
    for (var p = 0u; p < P; p++) { L += am_w[p] * am_part[base + p * stride + 1u]; }
    for (var d = lid; d < D; d += AW) {
        var o = 0.0;
        for (var p = 0u; p < P; p++) { o += am_w[p] * am_part[base + p * stride + 2u + d]; }
        am_out[rh * D + d] = o / L;
    }
}

// ---------------------------------------------------------------------------------------------------------
// argmax_split / argmax_merge: each row's argmax over the vocabulary (ties: the lower id) and its
// full-softmax probability, as topk_kl.wgsl's topk with k = 1, spread over workgroups: argmax_split, one
// workgroup per (row, block of p.bv logits), writes the block's best (value, id) and its softmax pair
// (m, s = Σ exp(z − m)); argmax_merge, one workgroup per row, combines the row's blocks. Both trees have a
// fixed shape (deterministic); the pairs merge as prelude_reduce.wgsl's.

const NONE: u32 = 0xffffffffu;

{{include prelude_reduce.wgsl}}

{{struct ArgmaxParams}}

@group(0) @binding(0) var<storage, read> ax_logits: array<f32>;
@group(0) @binding(1) var<storage, read_write> ax_part: array<u32>;  // per (row, block): best, id, m, s
@group(0) @binding(2) var<uniform> ax_p: ArgmaxParams;

var<workgroup> ax_v: array<f32, WG>;
var<workgroup> ax_i: array<u32, WG>;

// larger value first, then the lower id; NONE (no candidate) last (topk_kl.wgsl's order)
fn ax_better(av: f32, ai: u32, bv: f32, bi: u32) -> bool {
    if (ai == NONE) { return false; }
    if (bi == NONE) { return true; }
    return av > bv || (av == bv && ai < bi);
}

// the workgroup's best of every invocation's (cv, ci), in every invocation
fn ax_reduce(lid: u32, cv: f32, ci: u32) -> vec2<u32> {
    ax_v[lid] = cv;
    ax_i[lid] = ci;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
        if (lid < stride && ax_better(ax_v[lid + stride], ax_i[lid + stride], ax_v[lid], ax_i[lid])) {
            ax_v[lid] = ax_v[lid + stride];
            ax_i[lid] = ax_i[lid + stride];
        }
        workgroupBarrier();
    }
    let best = vec2<u32>(bitcast<u32>(ax_v[0]), ax_i[0]);
    workgroupBarrier();
    return best;
}

@compute @workgroup_size(WG)
fn argmax_split(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_id) lid3: vec3<u32>) {
    let g = wid.x + wid.y * nwg.x;  // row · nb + block
    if (g >= ax_p.rows * ax_p.nb) { return; }  // uniform per workgroup
    let lid = lid3.x;
    let r = g / ax_p.nb;
    let lo = (g - r * ax_p.nb) * ax_p.bv;
    let hi = min(ax_p.V, lo + ax_p.bv);
    var cv = NEG;
    var ci = NONE;
    var ms = vec2<f32>(NEG, 0.0);
    for (var i = lo + lid; i < hi; i += WG) {
        let z = ax_logits[r * ax_p.V + i];
        ms = online_ms(ms, z);
        if (ax_better(z, i, cv, ci)) {
            cv = z;
            ci = i;
        }
    }
    let tot = ms_reduce(lid, ms);
    let best = ax_reduce(lid, cv, ci);
    if (lid == 0u) {
        ax_part[4u * g] = best.x;
        ax_part[4u * g + 1u] = best.y;
        ax_part[4u * g + 2u] = bitcast<u32>(tot.x);
        ax_part[4u * g + 3u] = bitcast<u32>(tot.y);
    }
}

@group(0) @binding(0) var<storage, read> axm_part: array<u32>;
@group(0) @binding(1) var<storage, read_write> axm_ids: array<u32>;
@group(0) @binding(2) var<storage, read_write> axm_probs: array<f32>;
@group(0) @binding(3) var<uniform> axm_p: ArgmaxParams;

@compute @workgroup_size(WG)
fn argmax_merge(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_id) lid3: vec3<u32>) {
    let r = wid.x + wid.y * nwg.x;
    if (r >= axm_p.rows) { return; }  // uniform per workgroup
    let lid = lid3.x;
    var cv = NEG;
    var ci = NONE;
    var ms = vec2<f32>(NEG, 0.0);
    for (var b = lid; b < axm_p.nb; b += WG) {
        let at = 4u * (r * axm_p.nb + b);
        let v = bitcast<f32>(axm_part[at]);
        if (ax_better(v, axm_part[at + 1u], cv, ci)) {
            cv = v;
            ci = axm_part[at + 1u];
        }
        ms = combine_ms(ms.x, ms.y, bitcast<f32>(axm_part[at + 2u]), bitcast<f32>(axm_part[at + 3u]));
    }
    let tot = ms_reduce(lid, ms);
    let best = ax_reduce(lid, cv, ci);
    if (lid == 0u) {
        axm_ids[axm_p.row_offset + r] = best.y;
        axm_probs[axm_p.row_offset + r] = exp(bitcast<f32>(best.x) - (tot.x + log(tot.y)));
    }
}

// ---------------------------------------------------------------------------------------------------------
// conv_cache: tap m of kernel k multiplies the input at position t − (k − 1 − m); positions before 0 are
// zeros. TC: out[r, i] = Σ_j read[j] Σ_m conv[i·dv + j, m] hist[t, i, j]. EC: out[r, i, j] =
// Σ_m conv[i·dv + j, m] hist[t, i] (hist holds embeddings, (cap, C)).

{{struct ConvParams}}

@group(0) @binding(0) var<storage, read> cv_hist: array<f32>;
@group(0) @binding(1) var<storage, read> cv_conv: array<f32>;
@group(0) @binding(2) var<storage, read> cv_read: array<f32>;
@group(0) @binding(3) var<storage, read> cv_meta: array<u32>;
@group(0) @binding(4) var<storage, read_write> cv_out: array<f32>;
@group(0) @binding(5) var<uniform> cv_p: ConvParams;

@compute @workgroup_size(WG)
fn conv_cache(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_id) lid: vec3<u32>) {
    let gid = item(wid, nwg, lid);
    let C = cv_p.C;
    let dv = cv_p.dv;
    let K = cv_p.k;
    if (cv_p.ec == 1u) {
        if (gid >= cv_p.n * C * dv) { return; }
        let r = gid / (C * dv);
        let ij = gid - r * C * dv;  // i * dv + j
        let i = ij / dv;
        let t = cv_meta[0] + r;
        var y = 0.0;
        for (var m = 0u; m < K; m++) {
            let back = K - 1u - m;
            if (back <= t) { y += cv_conv[ij * K + m] * cv_hist[(t - back) * C + i]; }
        }
        cv_out[gid] = y;
        return;
    }
    if (gid >= cv_p.n * C) { return; }
    let r = gid / C;
    let i = gid - r * C;
    let t = cv_meta[0] + r;
    var x = 0.0;
    for (var j = 0u; j < dv; j++) {
        var y = 0.0;
        for (var m = 0u; m < K; m++) {
            let back = K - 1u - m;
            if (back <= t) { y += cv_conv[(i * dv + j) * K + m] * cv_hist[((t - back) * C + i) * dv + j]; }
        }
        x += cv_read[j] * y;
    }
    cv_out[gid] = x;
}

// ---------------------------------------------------------------------------------------------------------
// take_rows: one slot of E floats per head out of a buffer laid out [head][slot][E] (head stride hs, slot
// stride rs, both in floats); the slot is a launch constant or, for a roll-back whose position the host only
// knows at run time, meta[0] (so the Call is built once).

{{struct TakeParams}}

@group(0) @binding(0) var<storage, read> tk_src: array<f32>;
@group(0) @binding(1) var<storage, read> tk_meta: array<u32>;
@group(0) @binding(2) var<storage, read_write> tk_dst: array<f32>;
@group(0) @binding(3) var<uniform> tk_p: TakeParams;

@compute @workgroup_size(WG)
fn take_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = item(wid, nwg, lid);
    if (i >= tk_p.heads * tk_p.E) { return; }
    let h = i / tk_p.E;
    let e = i - h * tk_p.E;
    let s = select(tk_p.slot, tk_meta[0], tk_p.at_meta == 1u);
    tk_dst[i] = tk_src[h * tk_p.hs + s * tk_p.rs + e];
}

// ---------------------------------------------------------------------------------------------------------
// concat_rows: one thread per item of [a; b].

{{struct ConcatParams}}

@group(0) @binding(0) var<storage, read> cc_a: array<f32>;
@group(0) @binding(1) var<storage, read> cc_b: array<f32>;
@group(0) @binding(2) var<storage, read_write> cc_dst: array<f32>;
@group(0) @binding(3) var<uniform> cc_p: ConcatParams;

@compute @workgroup_size(WG)
fn concat_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = item(wid, nwg, lid);
    let na = cc_p.na * cc_p.W;
    if (i < na) {
        cc_dst[i] = cc_a[i];
    } else if (i < na + cc_p.nb * cc_p.W) {
        cc_dst[i] = cc_b[i - na];
    }
}

// ---------------------------------------------------------------------------------------------------------
// take_rows2: take_rows of (src, dst, p's first fields) for the items below heads * E, then of (src2, dst2,
// the fields ending in 2); each slot a launch constant or meta[0].

{{struct Take2Params}}

@group(0) @binding(0) var<storage, read> t2_src: array<f32>;
@group(0) @binding(1) var<storage, read> t2_src2: array<f32>;
@group(0) @binding(2) var<storage, read> t2_meta: array<u32>;
@group(0) @binding(3) var<storage, read_write> t2_dst: array<f32>;
@group(0) @binding(4) var<storage, read_write> t2_dst2: array<f32>;
@group(0) @binding(5) var<uniform> t2_p: Take2Params;

@compute @workgroup_size(WG)
fn take_rows2(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = item(wid, nwg, lid);
    let n1 = t2_p.heads * t2_p.E;
    if (i < n1) {
        let h = i / t2_p.E;
        let s = select(t2_p.slot, t2_meta[0], t2_p.at_meta == 1u);
        t2_dst[i] = t2_src[h * t2_p.hs + s * t2_p.rs + i - h * t2_p.E];
    } else if (i < n1 + t2_p.heads2 * t2_p.E2) {
        let j = i - n1;
        let h = j / t2_p.E2;
        let s = select(t2_p.slot2, t2_meta[0], t2_p.at_meta2 == 1u);
        t2_dst2[j] = t2_src2[h * t2_p.hs2 + s * t2_p.rs2 + j - h * t2_p.E2];
    }
}

