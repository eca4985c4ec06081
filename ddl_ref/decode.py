"""Incremental decoding with a per-layer cache: the numpy specification of `ddl-wgpu generate`.

`TrunkCache` holds, for positions 0..length−1 of one sequence (batch 1), everything a later token needs from
the earlier ones:

- per full-attention layer, the keys (after RoPE and q/k norm) and values, by position;
- per Gated DeltaNet layer (`linear_attention`, a hybrid trunk), the conv window (the last k−1 projected qkv
  rows, k = `linear_conv_kernel`) and the recurrent state S (Hv × Dk × Dv) after position length−1, and the
  record of the last pass that a roll-back replays (below);
- DDL d_v > 1 with TC: the inputs of every token convolution over time, per position: each block's
  compressor input before its token mixer and before its MLP sublayer, and the readout's input (C × d_v
  each). A TC output at t reads the last `ddl_conv_kernel` − 1 of them;
- EC: the embedding of every position (the expander's short conv reads the last kernel − 1).

The residual stream itself (d_v = 1 or 4) and the delta updates are per token and need nothing else; CC mixes
only the d_v channels of one token.

`trunk_step(params, cfg, cache, ids)` runs the trunk over n new tokens at positions length..length+n−1 in one
pass (a prompt, one decoded token, or the K + 1 rows of a speculative verify) and appends them to the cache; a
Gated DeltaNet layer runs its conv and its recurrence over the n rows from the cached window and state.

Roll-back (`TrunkCache.rollback(length)`, what speculative decoding does past rejected drafts). What is stored
by position (K/V, TC and EC histories) rolls back by setting `length`. A recurrent state cannot be rolled
back: the delta rule's step S ← (I − β k kᵀ)·a·S + β k vᵀ has no inverse in general (with β = 1 it projects
out k). So each Gated DeltaNet layer keeps, for the last pass only, the window and state from before it and
the recurrence's inputs per row (k, v, decay, β, and the conv inputs: `ddl_ref.gdn.gated_delta_forward`'s
cache, which also keeps the state before every 64th row), and a roll-back to r rows into that pass replays
the recurrence over them (`ddl_ref.gdn.state_after`): the same steps on the same stored inputs, so exactly
the state the pass held after its r-th row. That was chosen over keeping the state after every row of the
pass because a row's record (its conv input and the recurrence's inputs, about 2·Ch numbers) is small against
a state's Hv·Dk·Dv (Qwen3.5-27B: some 29 K against 786 K per layer), so even a prompt pass's record stays
small; the price is the replay, at most
63 steps of the recurrence from the nearest kept state (≤ K steps after a verify of K + 1 rows, less than the
verify itself, and no projections). A roll-back further back than the start of the last pass is refused
(`ValueError`): the speculative loop never needs one. Roll-back to 0 is always exact (the empty state).

Rows are computed apart. The n new rows travel as a batch of one-row rows, arrays (n, 1, ·), so every product
hands BLAS the same one-row call a single decoded token makes, and a row attends over exactly the slots it
sees (not a masked longer row, whose softmax would sum extra zeros in another order). A row's arithmetic
therefore does not depend on how many rows share its pass: after a verify of K + 1 rows and a roll-back to
the accepted ones, the cache is bit for bit the cache of a plain decode of the same tokens, and greedy
speculative decoding emits exactly the plain decode's tokens (not only up to near ties). A plain (n, C) @ W
would be one GEMM, whose rows differ in the last bits from the one-row product (OpenBLAS here);
tests/test_generate_hybrid.py pins the one-row property and the cache's bit-exactness.

`DraftCache` / `draft_step`: the MTP draft block (always a baseline, full-attention block) with its own
key/value cache, appended in the order rows are run, each row with its own RoPE position. A row attends to
every cached row before it and to itself. The runtime's "stacked" chain layout (`ddl_ref.ops.chain_mask`) is
exactly this order: the step-1 rows of the verified anchors 0..p, then the step-2..σ rows of anchor p's
current round at positions p + 1 .. p + σ − 1; rolling back past the round's chain rows leaves the step-1
rows.

Verified (tests/test_generate.py, tests/test_generate_hybrid.py): for all six variants and for hybrid trunks
(Gated DeltaNet and gated full attention with partial RoPE, baseline and DDL residuals), with and without a
draft, `trunk_step` over a sequence fed in pieces of any size (a prompt, then one token at a time, then rows
after a roll-back) gives the logits of `ddl_ref.model.forward` at every position (float64, 1e-10); after a
verify pass and a roll-back into it, the cache equals a plain decode's bit for bit; the draft rows equal
`ddl_ref.mtp.draft_forward` (step 1, causal) and the stacked chain (`chain=σ`) row for row.

What this file deliberately does not do: sampling or the speculative loop (`ddl_wgpu.jobs.generate`), batches of
several sequences, or any backward.
"""

from __future__ import annotations

import numpy as np

from ddl_ref import delta, gdn, ops, shortconv
from ddl_ref import mtp as ref_mtp
from ddl_ref.blocks import head_name
from ddl_ref.config import ModelConfig
from ddl_ref.params import linear_conv_channels


def attend_cached(q, k, v, start: int):
    """q (n, H, D) rows at cache slots start..start+n−1; k, v (start+n, K, D) the whole cache -> (n, H, D).

    Row i sees slots 0..start+i (causal over the cache order), and only those are in its sums (module
    docstring: rows computed apart). GQA: kv head j serves q heads j·H/K ... (j+1)·H/K − 1.
    """
    n, H, D = q.shape
    Kh = k.shape[1]
    out = np.empty_like(q)
    for i in range(n):
        S = start + i + 1
        qi = q[i].reshape(Kh, H // Kh, D)  # (K, G, D): query head j·G + g is group g of kv head j
        scores = np.einsum("kgd,skd->kgs", qi, k[:S]) * (float(D) ** -0.5)
        e = np.exp(scores - np.max(scores, axis=-1, keepdims=True))
        probs = e / np.sum(e, axis=-1, keepdims=True)
        out[i] = np.einsum("kgs,skd->kgd", probs, v[:S]).reshape(H, D)
    return out


def _attention(params, cfg: ModelConfig, p: str, h, kc, vc, start: int, cos, sin):
    """One attention sublayer over n rows h (n, 1, C); writes its keys/values into kc, vc (slots, K, D) at
    start..start+n−1 and attends over slots 0..start+n−1; cos/sin (n, R) the rows' RoPE. -> o_proj out."""
    n = h.shape[0]
    H, K, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    eps, style = cfg.rms_eps, cfg.norm_style
    q = ops.linear_forward(h, params[p + "self_attn.q_proj.weight"])
    gate = None
    if cfg.attn_output_gate:  # per head [query; gate] (`ddl_ref.blocks._attn_forward`)
        qg = q.reshape(n, 1, H, 2 * D)
        q, gate = qg[..., :D], qg[..., D:].reshape(n, 1, H * D)
    # RoPE and the q/k norms are per row: the rows as one sequence (1, n, ·) at their own positions
    q = q.reshape(1, n, H, D)
    k = ops.linear_forward(h, params[p + "self_attn.k_proj.weight"]).reshape(1, n, K, D)
    v = ops.linear_forward(h, params[p + "self_attn.v_proj.weight"]).reshape(n, K, D)
    norms = (p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight")
    if cfg.qk_norm == "pre_rope":
        q = ops.rmsnorm_forward(q, params[norms[0]], eps, style)[0]
        k = ops.rmsnorm_forward(k, params[norms[1]], eps, style)[0]
    q, k = ops.rope_forward(q, cos, sin), ops.rope_forward(k, cos, sin)
    if cfg.qk_norm == "post_rope":
        q = ops.rmsnorm_forward(q, params[norms[0]], eps, style)[0]
        k = ops.rmsnorm_forward(k, params[norms[1]], eps, style)[0]
    kc[start : start + n] = k[0]
    vc[start : start + n] = v
    a = attend_cached(q[0], kc[: start + n], vc[: start + n], start).reshape(n, 1, H * D)
    if gate is not None:
        a = ops.sigmoid_gate_forward(a, gate)
    return ops.linear_forward(a, params[p + "self_attn.o_proj.weight"])


class Recurrent:
    """One Gated DeltaNet layer's decoding state: `window` (k−1, Ch) the last k−1 conv inputs and `state`
    (Hv, Dk, Dv) the recurrent state, both after the cache's last position; and the last pass's record,
    `rows` (k−1+n, Ch) (the window before it, then its n conv inputs) and `delta` (its
    `gdn.gated_delta_forward` cache: the state before it, kept states, the recurrence's inputs)."""

    def __init__(self, cfg: ModelConfig, dtype):
        self.k = cfg.linear_conv_kernel
        self.window = np.zeros((self.k - 1, linear_conv_channels(cfg)), dtype)
        self.state = np.zeros((cfg.linear_v_heads, cfg.linear_k_dim, cfg.linear_v_dim), dtype)
        self.rows = self.delta = None

    def record(self, rows, delta_cache, state) -> None:
        """After a pass: its record, and the window and state after its last row."""
        self.rows, self.delta = rows, delta_cache
        self.window, self.state = rows[rows.shape[0] - (self.k - 1) :].copy(), state

    def rewind(self, r: int) -> None:
        """The window and state after the first r rows of the last pass (module docstring: the replay)."""
        self.window = self.rows[r : r + self.k - 1].copy()
        self.state = gdn.state_after(self.delta, r)[0]

    def reset(self) -> None:
        self.window, self.state = np.zeros_like(self.window), np.zeros_like(self.state)
        self.rows = self.delta = None


def _gated_deltanet(params, cfg: ModelConfig, p: str, h, rc: Recurrent):
    """`ddl_ref.gdn.gdn_forward` over n new rows h (n, 1, C) from rc's window and state -> (n, 1, C); rc then
    holds the state after the last row and the pass's record. The projections run per row, the conv and the
    recurrence over the rows in time order (1, n, ·)."""
    n = h.shape[0]
    Hk, Hv, Dk, Dv = cfg.linear_k_heads, cfg.linear_v_heads, cfg.linear_k_dim, cfg.linear_v_dim
    w = gdn.param_names(p)
    qkv = ops.linear_forward(h, params[w["qkv"]]).reshape(1, n, -1)  # (1, n, Ch)
    z = ops.linear_forward(h, params[w["z"]]).reshape(1, n, Hv, Dv)
    braw = ops.linear_forward(h, params[w["b"]]).reshape(1, n, Hv)
    araw = ops.linear_forward(h, params[w["a"]]).reshape(1, n, Hv)
    c, (xp, _, _) = gdn.causal_conv_forward(qkv, params[w["conv"]], rc.window[None])
    kd = Hk * Dk
    qn = gdn.l2norm_forward(c[..., :kd].reshape(1, n, Hk, Dk))[0]
    kn = gdn.l2norm_forward(c[..., kd : 2 * kd].reshape(1, n, Hk, Dk))[0]
    vv = c[..., 2 * kd :].reshape(1, n, Hv, Dv)
    g, beta, _ = gdn.gates_forward(araw, braw, params[w["A_log"]], params[w["dt_bias"]])
    o, S, dcache = gdn.gated_delta_forward(qn * float(Dk) ** -0.5, kn, vv, g, beta, rc.state[None])
    y = gdn.gated_rmsnorm_forward(o, z, params[w["norm"]], cfg.rms_eps)[0]  # (1, n, Hv, Dv)
    rc.record(xp[0], dcache, S[0])
    return ops.linear_forward(y.reshape(n, 1, Hv * Dv), params[w["out"]])


def _mlp(params, p: str, h):
    gate = ops.linear_forward(h, params[p + "mlp.gate_proj.weight"])
    up = ops.linear_forward(h, params[p + "mlp.up_proj.weight"])
    return ops.linear_forward(ops.swiglu_forward(gate, up), params[p + "mlp.down_proj.weight"])


def _norm(params, cfg: ModelConfig, name: str, x):
    return ops.rmsnorm_forward(x, params[name], cfg.rms_eps, cfg.norm_style)[0]


def _mixer(params, cfg: ModelConfig, i: int, p: str, h, cache: TrunkCache, start: int, cos, sin):
    """Block i's token mixer over n rows h (n, 1, C) with its part of the trunk cache."""
    if cfg.layer_type(i) == "linear_attention":
        return _gated_deltanet(params, cfg, p, h, cache.recurrent[i])
    return _attention(params, cfg, p, h, cache.k[i], cache.v[i], start, cos, sin)


def baseline_block(params, cfg: ModelConfig, p: str, x, kc, vc, start: int, cos, sin):
    """An additive full-attention block over n rows x (n, 1, C) with its key/value cache (the draft)."""
    x = x + _attention(params, cfg, p, _norm(params, cfg, p + "input_layernorm.weight", x), kc, vc, start,
                       cos, sin)  # fmt: skip
    return x + _mlp(params, p, _norm(params, cfg, p + "post_attention_layernorm.weight", x))


class TrunkCache:
    """The trunk's state of one sequence (module docstring); `capacity` positions at most. `k[i]`, `v[i]`
    (capacity, K, D) for a full-attention layer i, `recurrent[i]` (a `Recurrent`) for a Gated DeltaNet one
    (the other entry None); `conv`, `embed` the TC and EC histories by position; `pass_start` where the last
    pass began."""

    def __init__(self, cfg: ModelConfig, capacity: int | None = None, dtype=np.float32):
        cap = cfg.max_seq_len if capacity is None else int(capacity)
        if not 0 < cap <= cfg.max_seq_len:
            raise ValueError(f"cache capacity {cap} must be in 1..max_seq_len {cfg.max_seq_len}")
        L, K, D, C, dv = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, cfg.d_model, cfg.ddl_dv
        self.cfg, self.capacity, self.length, self.pass_start = cfg, cap, 0, 0
        linear = [cfg.layer_type(i) == "linear_attention" for i in range(L)]
        self.k = [None if lin else np.zeros((cap, K, D), dtype) for lin in linear]
        self.v = [None if lin else np.zeros((cap, K, D), dtype) for lin in linear]
        self.recurrent = [Recurrent(cfg, dtype) if lin else None for lin in linear]
        self.cos, self.sin = ops.rope_tables(cap, D, cfg.rope_theta, dtype, cfg.rope_dim)
        tc = cfg.residual == "delta" and cfg.ddl_dv > 1 and cfg.ddl_compressor == "tc"
        # One history per token-conv site: block i's mixer and MLP compressor inputs, then the readout.
        self.conv = np.zeros((2 * L + 1, cap, C, dv), dtype) if tc else None
        self.embed = np.zeros((cap, C), dtype) if cfg.ddl_expand_embed else None
        self.taps: list = []  # the last step's tapped layer inputs (`trunk_step(taps=...)`)

    @property
    def floor(self) -> int:
        """The earliest position `rollback` can return to besides 0: the last pass's start on a hybrid trunk
        (a recurrent state is replayed only within the pass that made it), 0 otherwise."""
        return self.pass_start if self.cfg.has_linear else 0

    def rollback(self, length: int) -> None:
        """Forget positions length.. (stored rows are overwritten when run again; a Gated DeltaNet layer's
        window and state are replayed to the position, module docstring)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: the cache holds {self.length} positions")
        if 0 < length < self.floor:
            raise ValueError(
                f"cannot roll back a hybrid trunk to {length}: a Gated DeltaNet's recurrent state can be "
                f"recovered only inside the last pass (positions {self.pass_start}..{self.length}) or at 0"
            )
        if length == self.length:
            return
        for rc in self.recurrent:
            if rc is not None and length == 0:
                rc.reset()
            elif rc is not None:
                rc.rewind(length - self.pass_start)
        self.length, self.pass_start = int(length), min(self.pass_start, int(length))


def _history(store, start: int, n: int, kernel: int):
    """store[max(0, start−kernel+1) : start+n] and how many leading rows are history (not output rows)."""
    lo = max(0, start - kernel + 1)
    return store[lo : start + n], start - lo


def _compress(params, cfg: ModelConfig, prefix: str, cache: TrunkCache, site: int, X, start: int):
    """The compressor of d_v > 1 over n rows X (n, 1, C, dv) -> x_in (n, 1, C); TC reads and extends its
    history."""
    conv, read = params[prefix + "conv.weight"], params[prefix + "read.weight"]
    if cfg.ddl_compressor == "cc":
        return shortconv.cc_forward(X, conv, read)[0]
    n = X.shape[0]
    cache.conv[site, start : start + n] = X[:, 0]
    rows, skip = _history(cache.conv[site], start, n, cfg.ddl_conv_kernel)
    return shortconv.tc_forward(rows[None], conv, read)[0][0, skip:, None]


def _expand(params, cfg: ModelConfig, cache: TrunkCache, e, start: int):
    """Embeddings e (n, 1, C) -> the d_v > 1 state X0 (n, 1, C, dv): EC's short conv, or repetition."""
    if not cfg.ddl_expand_embed:
        return shortconv.repeat_forward(e, cfg.ddl_dv)
    n = e.shape[0]
    cache.embed[start : start + n] = e[:, 0]
    rows, skip = _history(cache.embed, start, n, cfg.ddl_conv_kernel)
    return shortconv.ec_forward(rows[None], params["model.embed_expand.conv.weight"])[0][0, skip:, None]


def _ddl_block(params, cfg: ModelConfig, i: int, X, cache: TrunkCache, start: int, cos, sin):
    """`ddl_ref.blocks._ddl_block_forward` over n new rows with the cache: X (n, 1, C) or (n, 1, C, dv)."""
    p = f"model.layers.{i}."
    expanded = cfg.ddl_dv > 1
    for s, norm_name in (("attn", "input_layernorm"), ("mlp", "post_attention_layernorm")):
        if expanded:
            x_in = _compress(params, cfg, p + "compress.", cache, 2 * i + (s == "mlp"), X, start)
            Xs = X
        else:
            x_in, Xs = X, X[..., None]
        h = _norm(params, cfg, p + norm_name + ".weight", x_in)
        u = _mixer(params, cfg, i, p, h, cache, start, cos, sin) if s == "attn" else _mlp(params, p, h)
        q = f"{p}ddl_{s}."
        Xs, _ = delta.delta_forward(Xs, u, h, x_in, params[q + "beta_proj.weight"], params[q + "beta_proj.bias"],
                                    params[q + "v_proj.weight"], params[q + "v_proj.bias"], cfg.ddl_k_eps,
                                    cfg.ddl_v_scale)  # fmt: skip
        X = Xs if expanded else Xs[..., 0]
    return X


def _add_block(params, cfg: ModelConfig, i: int, x, cache: TrunkCache, start: int, cos, sin):
    """An additive block of the trunk over n rows x (n, 1, C): its mixer, then the MLP."""
    p = f"model.layers.{i}."
    x = x + _mixer(
        params, cfg, i, p, _norm(params, cfg, p + "input_layernorm.weight", x), cache, start, cos, sin
    )
    return x + _mlp(params, p, _norm(params, cfg, p + "post_attention_layernorm.weight", x))


def trunk_step(params, cfg: ModelConfig, cache: TrunkCache, ids, taps=()):
    """ids (n,) new tokens at positions cache.length.. -> (pre (n, C), post (n, C), logits (n, V)).

    pre/post are the hiddens before/after the final norm (what a draft may read); the cache grows by n.
    `taps`: layer ids whose input rows (n, C) go into `cache.taps`, in the order given (an EAGLE-3 draft's
    aux rows)."""
    ids = np.asarray(ids, np.int64).reshape(-1)
    n, start = ids.size, cache.length
    if n == 0:
        raise ValueError("trunk_step needs at least one token")
    if start + n > cache.capacity:
        raise ValueError(f"{start + n} positions exceed the cache capacity {cache.capacity}")
    cos, sin = cache.cos[start : start + n], cache.sin[start : start + n]
    x = ops.embedding_forward(ids[:, None], params["model.embed_tokens.weight"])  # (n, 1, C): rows apart
    expanded = cfg.residual == "delta" and cfg.ddl_dv > 1
    if expanded:
        x = _expand(params, cfg, cache, x, start)
    block = _ddl_block if cfg.residual == "delta" else _add_block
    tapped = {}
    for i in range(cfg.n_layers):
        if i in taps:
            tapped[i] = x[:, 0]
        x = block(params, cfg, i, x, cache, start, cos, sin)
    cache.taps = [tapped[j] for j in taps]
    if expanded:
        x = _compress(params, cfg, "model.readout.", cache, 2 * cfg.n_layers, x, start)
    post = _norm(params, cfg, "model.norm.weight", x)
    cache.length, cache.pass_start = start + n, start
    return x[:, 0], post[:, 0], ops.linear_forward(post, params[head_name(cfg)])[:, 0]


# ----------------------------------------------------------------------------------------------------------
# the MTP draft


class DraftCache:
    """The draft block's keys/values, in the order its rows were run (module docstring)."""

    def __init__(self, cfg: ModelConfig, capacity: int | None = None, dtype=np.float32):
        ref_mtp.mtp_of(cfg)
        cap = cfg.max_seq_len if capacity is None else int(capacity)
        K, D = cfg.n_kv_heads, cfg.head_dim
        self.cfg, self.capacity, self.length = cfg, cap, 0
        self.k = np.zeros((cap, K, D), dtype)
        self.v = np.zeros((cap, K, D), dtype)
        # Positions of a chain row run past the slots (anchor + depth), so the table covers both.
        self.cos, self.sin = ops.rope_tables(cfg.max_seq_len + cap, D, cfg.rope_theta, dtype, cfg.rope_dim)

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: the draft cache holds {self.length} rows")
        self.length = int(length)


def draft_step(params, cfg: ModelConfig, cache: DraftCache, tokens, hidden, positions):
    """Draft rows: tokens (n,) the token each row reads, hidden (n, C) the hidden it reads (the trunk's for a
    step-1 row, the draft's own previous output for a chain row), positions (n,) RoPE positions.
    -> (pre (n, C), post (n, C), logits (n, V)); the rows are appended to the cache."""
    tokens = np.asarray(tokens, np.int64).reshape(-1)
    positions = np.asarray(positions, np.int64).reshape(-1)
    n, start = tokens.size, cache.length
    if start + n > cache.capacity:
        raise ValueError(f"{start + n} draft rows exceed the cache capacity {cache.capacity}")
    e = ops.embedding_forward(tokens[:, None], params["model.embed_tokens.weight"])  # (n, 1, C): rows apart
    hid = np.asarray(hidden, e.dtype).reshape(n, 1, -1)
    x, _ = ref_mtp.draft_input_forward(e, hid, params[ref_mtp.ENORM], params[ref_mtp.HNORM],
                                       params[ref_mtp.EH_PROJ], cfg)  # fmt: skip
    view = ref_mtp.block_view(params)
    dcfg = ref_mtp.draft_config(cfg)
    pre = baseline_block(view, dcfg, "model.layers.0.", x, cache.k, cache.v, start, cache.cos[positions],
                         cache.sin[positions])  # fmt: skip
    post = _norm(params, cfg, ref_mtp.NORM, pre)
    cache.length = start + n
    return pre[:, 0], post[:, 0], ops.linear_forward(post, params[head_name(cfg)])[:, 0]
