"""Launchers for `shaders/decode.wgsl`: the kernels of decoding with a cache (`ddl_wgpu.engine.decode`).

Kernel path: `shaders/decode.wgsl` -> `ddl_wgpu/ops/decode.py` -> references `ddl_ref.decode.attend_cached`,
`ddl_ref.ops.rope_forward`, `ddl_ref.shortconv.tc_forward`, `ddl_ref.shortconv.ec_forward`,
`ddl_ref.mtp.topk_probs` -> test `tests/test_kernel_decode.py`.

The n new rows of a decoding pass sit at positions start .. start + n − 1, and `start` is not a launch
constant: it is the first u32 of a `meta` storage buffer the host rewrites before each submit (`set_start`),
so the Calls are built once per row count and recorded at every position.

- `store_rows(dst, src, meta, n, W, stride=W, col0=0, at_meta=True)`: rows of src into a cache at start (or
  into columns col0.. of a wider buffer at row 0: the draft's concatenated input);
- `rope_at(out, x, cos, sin, meta, n, N, D, rotary=None)`: RoPE at positions start + r on the first R =
  `rotary` (default D) dims of each head, the rest passed through (tables (cap, R));
- `rope_store(q_out, kc, vc, q, k, v, rope, meta, n, H, K, D, rotary=None)`: `rope_at` of q, and of k into
  the key cache, v into the value cache, at rows start + r, in one launch (what a decoding pass runs before
  `attend_cache` when RoPE is the only op on q and k);
- `qk_finish(q_out, kc, q, k, w, wq, wk, rope, meta, n, H, K, D, order, eps, style, rotary)`: q and k through
  a q/k chain with a norm (RMSNorm then RoPE, or RoPE then RMSNorm) in one launch, k into the key cache;
- `attend_cache(out, q, kc, vc, meta, n, H, K, D)`: attention of the n rows over cache slots 0 .. start + r,
  the keys split over many workgroups and the splits merged in a fixed order (`attend_scratch`: the partial
  results, shareable between the layers of a pass);
- `argmax(ids_out, probs_out, logits, rows, V)`: each row's argmax and its full-softmax probability (the top-k
  kernel's k = 1) over many workgroups, merged per row (greedy decoding's head);
- `tc_cache(out, hist, conv, read, meta, n, C, dv, k)` / `ec_cache(out, hist, conv, meta, n, C, dv, k)`: the
  causal short convolutions over time reading their inputs from a per-position history cache;
- `take_rows(dst, src, meta, heads, E, hs, rs, slot=None)`: one slot of E floats per head out of a strided
  buffer (slot `slot`, or meta's u32 when None): a Gated DeltaNet layer's state after some row of a pass, and
  its conv window (`ddl_wgpu.engine.decode`); `take_rows2` does two in one launch (the state and the window);
- `concat_rows(dst, a, b, na, nb, W)`: dst = [a; b] (a layer's window before a pass and the pass's rows).

The test checks each at sizes that are not multiples of the workgroup sizes and at several starts (the RoPE,
`rope_store` included, and the convolutions against the whole-sequence reference's rows, the attention against
`attend_cached`; `take_rows` against numpy indexing).
"""

from __future__ import annotations

import numpy as np

from ddl_wgpu.ops import need
from ddl_wgpu.runtime.gpu import Call, Gpu, Uniform, grid

FILE = "decode.wgsl"
WG = 256  # threads per workgroup of the one-thread-per-item entry points
AW = 64  # threads per workgroup of qk_finish, attend_split and attend_merge
MAXD = 256  # largest head_dim qk_finish and attend_cache hold
SPLITS = 32  # attend_cache: the most splits of a row's keys (of blocks of KB keys), at most MAXNS
MAXNS = 64
STORE = Uniform(
    "StoreParams",
    ("n", "u32", "rows"),
    ("W", "u32", "floats per source row"),
    ("stride", "u32", "floats per destination row"),
    ("col0", "u32", "first destination column"),
    ("at_meta", "u32", "1: destination rows start at meta[0]; 0: at 0"),
)
ROPE = Uniform(
    "RopeParams",
    ("pairs", "u32", "n * N * D / 2"),
    ("N", "u32"),
    ("D", "u32"),
    ("cap", "u32", "rows of the tables"),
    ("R", "u32", "rotated dims per head (<= D)"),
)
ROPE_STORE = Uniform(
    "RopeStoreParams",
    ("n", "u32", "rows"),
    ("H", "u32", "query heads"),
    ("K", "u32", "key/value heads"),
    ("D", "u32", "head dim"),
    ("R", "u32", "rotated dims per head (<= D)"),
    ("cap", "u32", "rows of each table"),
)
QK = Uniform(
    "QkParams",
    ("n", "u32", "rows"),
    ("H", "u32", "query heads"),
    ("K", "u32", "key heads"),
    ("D", "u32", "head dim (<= MAXD)"),
    ("R", "u32", "rotated dims per head"),
    ("cap", "u32", "rows of each table"),
    ("order", "u32", "1: RMSNorm then RoPE (pre_rope); 2: RoPE then RMSNorm (post_rope)"),
    ("style", "u32", "0: w·x̂, 1: (1 + w)·x̂"),
    ("wq", "u32", "q's norm weight: first float in the weight binding"),
    ("wk", "u32", "k's"),
    ("eps", "f32"),
)
QK_ORDERS = {"pre_rope": 1, "post_rope": 2}
ATTN = Uniform(
    "AttnParams",
    ("n", "u32"),
    ("H", "u32"),
    ("K", "u32"),
    ("D", "u32"),
    ("scale", "f32"),
    ("ns", "u32", "the most splits of a row's keys"),
)
CONV = Uniform(
    "ConvParams",
    ("n", "u32"),
    ("C", "u32"),
    ("dv", "u32"),
    ("k", "u32"),
    ("ec", "u32", "0: TC (with the read), 1: EC"),
)
TAKE = Uniform(
    "TakeParams",
    ("heads", "u32"),
    ("E", "u32", "floats taken per head"),
    ("hs", "u32", "floats between heads in src"),
    ("rs", "u32", "floats between slots in src"),
    ("slot", "u32", "the slot, when not at_meta"),
    ("at_meta", "u32", "1: the slot is meta[0]"),
)
CONCAT = Uniform(
    "ConcatParams", ("na", "u32", "rows of a"), ("nb", "u32", "rows of b"), ("W", "u32", "floats a row")
)
TAKE2 = Uniform(
    "Take2Params",
    *TAKE.fields,
    ("heads2", "u32", "the second take's fields"),
    ("E2", "u32"),
    ("hs2", "u32"),
    ("rs2", "u32"),
    ("slot2", "u32"),
    ("at_meta2", "u32"),
)
ARGMAX = Uniform(
    "ArgmaxParams",
    ("rows", "u32"),
    ("V", "u32", "logits per row"),
    ("bv", "u32", "logits per block"),
    ("nb", "u32", "blocks per row"),
    ("row_offset", "u32", "first output row"),
)
ARGMAX_BLOCK = 2048  # logits per argmax_split workgroup (a 248K vocabulary: 122 workgroups a row)
UNIFORMS = (
    STORE,
    ROPE,
    ROPE_STORE,
    QK,
    ATTN,
    CONV,
    TAKE,
    CONCAT,
    TAKE2,
    ARGMAX,
)  # the file compiles as a whole


def set_start(gpu: Gpu, meta, start: int) -> None:
    """The position of the next pass's first row (read by every kernel bound to `meta`)."""
    gpu.queue.write_buffer(meta, 0, np.array([start], np.uint32).tobytes())


def _one(gpu: Gpu, entry: str, sig: str, resources: list, items: int, layout: Uniform, **params) -> Call:
    k = gpu.kernel(FILE, entry, sig, workgroup=(WG, 1, 1), uniforms=UNIFORMS)
    u = gpu.uniform(layout, label=entry, **params)
    return Call([(k, gpu.bind(k, *resources, u), grid(-(-items // WG)))], [u])


def store_rows(gpu: Gpu, dst, src, meta, n: int, W: int, stride: int | None = None, col0: int = 0,
               at_meta: bool = True) -> Call:  # fmt: skip
    """dst[(base + r) * stride + col0 + c] = src[r * W + c]; base = meta's start, or 0 when not at_meta.
    Rows past the end of dst are dropped (the caller keeps start + n within its capacity)."""
    stride = W if stride is None else int(stride)
    need("store_rows", "src", src, n * W)
    need("store_rows", "dst", dst, n * stride if not at_meta else W)
    return _one(gpu, "store_rows", "rrwu", [src, meta, dst], n * W, STORE, n=n, W=W, stride=stride, col0=col0,
                at_meta=int(at_meta))  # fmt: skip


def rope_at(gpu: Gpu, out, x, cos, sin, meta, n: int, N: int, D: int, rotary: int | None = None) -> Call:
    """out (n, N, D) = RoPE of x at positions start + r on the first R = `rotary` (default D) dims of each
    head, dims R.. copied; cos/sin (cap, R) f32."""
    R = D if rotary is None else int(rotary)
    if D % 2 or R % 2 or not 0 < R <= D:
        raise ValueError(f"rope needs an even head_dim and an even rotary width in [2, D], got {D}, {R}")
    need("rope_at", "x", x, n * N * D)
    need("rope_at", "out", out, n * N * D)
    cap = (cos.size if not isinstance(cos, tuple) else cos[2]) // (4 * R)
    pairs = n * N * D // 2
    return _one(
        gpu, "rope_at", "rrrrwu", [x, cos, sin, meta, out], pairs, ROPE, pairs=pairs, N=N, D=D, cap=cap, R=R
    )


def rope_store(gpu: Gpu, q_out, kc, vc, q, k, v, rope, meta, n: int, H: int, K: int, D: int,
               rotary: int | None = None) -> Call:  # fmt: skip
    """One launch for what precedes attention over the cache: q_out (n, H, D) = RoPE of q at positions
    start + r, and RoPE of k (n, K, D) and v (n, K, D) stored into kc / vc (cap, K, D) at rows start + r;
    rope (2, cap, R): the cos table, then the sin table (`rope_at`'s, R = `rotary`, default D)."""
    R = D if rotary is None else int(rotary)
    if D % 2 or R % 2 or not 0 < R <= D:
        raise ValueError(f"rope needs an even head_dim and an even rotary width in [2, D], got {D}, {R}")
    need("rope_store", "q", q, n * H * D)
    need("rope_store", "q_out", q_out, n * H * D)
    need("rope_store", "k", k, n * K * D)
    need("rope_store", "v", v, n * K * D)
    cap = (rope.size if not isinstance(rope, tuple) else rope[2]) // (8 * R)
    items = n * (H + K) * D // 2 + n * K * D
    return _one(gpu, "rope_store", "rrrrrwwwu", [q, k, v, rope, meta, q_out, kc, vc], items, ROPE_STORE, n=n, H=H,
                K=K, D=D, R=R, cap=cap)  # fmt: skip


def qk_finish(gpu: Gpu, q_out, kc, q, k, w, wq: int, wk: int, rope, meta, n: int, H: int, K: int, D: int,
              order: str, eps: float, style: str = "standard", rotary: int | None = None) -> Call:  # fmt: skip
    """q (n, H, D) and k (n, K, D) through their q/k chain (`order` "pre_rope": RMSNorm then RoPE; "post_rope":
    RoPE then RMSNorm) in one launch: q into q_out, k into the key cache kc (cap, K, D) at rows start + r.
    The two norm weights (D each) lie in one binding `w`, at floats `wq` and `wk`; rope (2, cap, R) as
    `rope_store`'s; `style` "standard" (w·x̂) or "offset" ((1 + w)·x̂)."""
    R = D if rotary is None else int(rotary)
    if D % 2 or R % 2 or not 0 < R <= D or D > MAXD:
        raise ValueError(
            f"qk_finish needs an even head_dim <= {MAXD} and an even rotary width in [2, D], got {D}, {R}"
        )
    if order not in QK_ORDERS or style not in ("standard", "offset"):
        raise ValueError(f"qk_finish: order {order!r} / style {style!r}")
    need("qk_finish", "q", q, n * H * D)
    need("qk_finish", "q_out", q_out, n * H * D)
    need("qk_finish", "k", k, n * K * D)
    need("qk_finish", "w", w, max(wq, wk) + D)
    cap = (rope.size if not isinstance(rope, tuple) else rope[2]) // (8 * R)
    kern = gpu.kernel(FILE, "qk_finish", "rrrrrwwu", workgroup=(AW, 1, 1), uniforms=UNIFORMS)
    u = gpu.uniform(QK, label="qk_finish", n=n, H=H, K=K, D=D, R=R, cap=cap, order=QK_ORDERS[order],
                    style=int(style == "offset"), wq=wq, wk=wk, eps=eps)  # fmt: skip
    return Call([(kern, gpu.bind(kern, q, k, w, rope, meta, q_out, kc, u), grid(n * (H + K)))], [u])


def attend_scratch(gpu: Gpu, n: int, H: int, D: int, splits: int = SPLITS):
    """The buffer `attend_cache` keeps its splits' partial results in: (n, H, splits, D + 2) floats. Passes
    of one row count may share one (a layer's merge reads it before the next layer's split writes it)."""
    return gpu.buffer(n * H * splits * (D + 2) * 4, label="attend_splits")


def attend_cache(gpu: Gpu, out, q, kc, vc, meta, n: int, H: int, K: int, D: int, scratch=None,
                 splits: int = SPLITS) -> Call:  # fmt: skip
    """out (n, H, D) = causal attention of q (n, H, D) over the cache kc/vc (cap, K, D), row r seeing slots
    0 .. start + r (the rows' own keys must be stored first). Two launches (flash-decoding): `attend_split`
    spreads each row's keys over up to `splits` workgroups per head, `attend_merge` combines them in a
    fixed order (shaders/decode.wgsl); `scratch` holds the partial results (`attend_scratch`, made here when
    None)."""
    if D > MAXD:
        raise ValueError(f"attend_cache holds head_dim <= {MAXD}, got {D}")
    if H % K:
        raise ValueError(f"n_heads {H} must be a multiple of n_kv_heads {K}")
    if not 1 <= splits <= MAXNS:
        raise ValueError(f"attend_cache: 1..{MAXNS} splits, got {splits}")
    need("attend_cache", "q", q, n * H * D)
    need("attend_cache", "out", out, n * H * D)
    scratch = attend_scratch(gpu, n, H, D, splits) if scratch is None else scratch
    need("attend_cache", "scratch", scratch, n * H * splits * (D + 2))
    u = gpu.uniform(ATTN, label="attend_cache", n=n, H=H, K=K, D=D, scale=float(D) ** -0.5, ns=splits)
    ks = gpu.kernel(FILE, "attend_split", "rrrrwu", workgroup=(AW, 1, 1), uniforms=UNIFORMS)
    km = gpu.kernel(FILE, "attend_merge", "rrwu", workgroup=(AW, 1, 1), uniforms=UNIFORMS)
    return Call([(ks, gpu.bind(ks, q, kc, vc, meta, scratch, u), grid(n * H * splits)),
                 (km, gpu.bind(km, scratch, meta, out, u), grid(n * H))], [u])  # fmt: skip


def argmax(gpu: Gpu, ids_out, probs_out, logits, rows: int, V: int, row_offset: int = 0,
           block: int = ARGMAX_BLOCK) -> Call:  # fmt: skip
    """Per row of `logits` (rows, V) the argmax (ties: the lower id) and its full-softmax probability, written
    at rows row_offset + r of ids_out (u32) / probs_out: `ops.topk_kl.topk` with k = 1, the vocabulary
    spread over workgroups of `block` logits (`argmax_split`) and merged per row (`argmax_merge`)."""
    need("argmax", "logits", logits, rows * V)
    need("argmax", "ids_out", ids_out, row_offset + rows)
    need("argmax", "probs_out", probs_out, row_offset + rows)
    nb = -(-V // block)
    part = gpu.buffer(rows * nb * 16, label="argmax_blocks")
    u = gpu.uniform(ARGMAX, label="argmax", rows=rows, V=V, bv=block, nb=nb, row_offset=row_offset)
    ks = gpu.kernel(FILE, "argmax_split", "rwu", workgroup=(WG, 1, 1), uniforms=UNIFORMS)
    km = gpu.kernel(FILE, "argmax_merge", "rwwu", workgroup=(WG, 1, 1), uniforms=UNIFORMS)
    return Call([(ks, gpu.bind(ks, logits, part, u), grid(rows * nb)),
                 (km, gpu.bind(km, part, ids_out, probs_out, u), grid(rows))], [u])  # fmt: skip


def tc_cache(gpu: Gpu, out, hist, conv, read, meta, n: int, C: int, dv: int, k: int) -> Call:
    """out (n, C) = TC's conv over time + read, from hist (cap, C, dv) of every position's state."""
    need("tc_cache", "out", out, n * C)
    need("tc_cache", "conv", conv, C * dv * k)
    return _one(gpu, "conv_cache", "rrrrwu", [hist, conv, read, meta, out], n * C, CONV, n=n, C=C, dv=dv, k=k,
                ec=0)  # fmt: skip


def ec_cache(gpu: Gpu, out, hist, conv, meta, n: int, C: int, dv: int, k: int) -> Call:
    """out (n, C, dv) = EC's expansion from hist (cap, C) of every position's embedding."""
    need("ec_cache", "out", out, n * C * dv)
    need("ec_cache", "conv", conv, C * dv * k)
    # The read binding is unused by EC; the conv weights stand in so the layout stays one signature.
    return _one(gpu, "conv_cache", "rrrrwu", [hist, conv, conv, meta, out], n * C * dv, CONV, n=n, C=C, dv=dv,
                k=k, ec=1)  # fmt: skip


def take_rows(
    gpu: Gpu, dst, src, meta, heads: int, E: int, hs: int, rs: int, slot: int | None = None
) -> Call:
    """dst[h * E + e] = src[h * hs + s * rs + e] for h < heads, e < E; s = `slot`, or meta's first u32 when
    `slot` is None (a roll-back's row, set in the command stream)."""
    need("take_rows", "dst", dst, heads * E)
    s = 0 if slot is None else int(slot)
    return _one(gpu, "take_rows", "rrwu", [src, meta, dst], heads * E, TAKE, heads=heads, E=E, hs=hs, rs=rs,
                slot=s, at_meta=int(slot is None))  # fmt: skip


def concat_rows(gpu: Gpu, dst, a, b, na: int, nb: int, W: int) -> Call:
    """dst (na + nb, W) = [a (na, W); b (nb, W)] in one launch."""
    need("concat_rows", "a", a, na * W)
    need("concat_rows", "b", b, nb * W)
    need("concat_rows", "dst", dst, (na + nb) * W)
    return _one(gpu, "concat_rows", "rrwu", [a, b, dst], (na + nb) * W, CONCAT, na=na, nb=nb, W=W)


def take_rows2(gpu: Gpu, first: tuple, second: tuple, meta) -> Call:
    """Two `take_rows` in one launch: `first` and `second` are each (dst, src, heads, E, hs, rs, slot), slot
    None for meta's first u32."""
    (d1, s1, h1, e1, hs1, rs1, sl1), (d2, s2, h2, e2, hs2, rs2, sl2) = first, second
    need("take_rows2", "dst", d1, h1 * e1)
    need("take_rows2", "dst2", d2, h2 * e2)
    return _one(gpu, "take_rows2", "rrrwwu", [s1, s2, meta, d1, d2], h1 * e1 + h2 * e2, TAKE2, heads=h1, E=e1,
                hs=hs1, rs=rs1, slot=sl1 or 0, at_meta=int(sl1 is None), heads2=h2, E2=e2, hs2=hs2, rs2=rs2,
                slot2=sl2 or 0, at_meta2=int(sl2 is None))  # fmt: skip
