"""Incremental decoding with a per-layer cache: the numpy specification of `ddl-wgpu generate`.

`TrunkCache` holds, for positions 0..length−1 of one sequence (batch 1), everything a later token needs from
the earlier ones:

- per layer, the keys (after RoPE and q/k norm) and values of the attention;
- DDL d_v > 1 with TC: the inputs of every token convolution over time, per position: each block's
  compressor input before its attention sublayer and before its MLP sublayer, and the readout's input
  (C × d_v each). A TC output at t reads the last `ddl_conv_kernel` − 1 of them;
- EC: the embedding of every position (the expander's short conv reads the last kernel − 1).

The residual stream itself (d_v = 1 or 4) and the delta updates are per token and need nothing else; CC mixes
only the d_v channels of one token. Everything is stored by position, so rolling back to a position is setting
`length` (what speculative decoding does past rejected tokens); nothing has to be recomputed.

`trunk_step(params, cfg, cache, ids)` runs the trunk over n new tokens at positions length..length+n−1 in one
pass (a prompt, one decoded token, or the K + 1 rows of a speculative verify) and appends them to the cache.

`DraftCache` / `draft_step`: the MTP draft block (always a baseline block) with its own key/value cache,
appended in the order rows are run, each row with its own RoPE position. A row attends to every cached row
before it and to itself. The runtime's "stacked" chain layout (`ddl_ref.ops.chain_mask`) is exactly this
order: the step-1 rows of the verified anchors 0..p, then the step-2..σ rows of anchor p's current round at
positions p + 1 .. p + σ − 1; rolling back past the round's chain rows leaves the step-1 rows.

Verified (tests/test_generate.py): for all six variants, with and without a draft, `trunk_step` over a
sequence fed in pieces of any size (a prompt, then one token at a time, then rows after a roll-back) gives the
logits of `ddl_ref.model.forward` at every position (float64, 1e-10), and the draft rows equal
`ddl_ref.mtp.draft_forward` (step 1, causal) and the stacked chain (`chain=σ`) row for row.

Full-attention models only: the attention's output gate and partial RoPE are handled, but a hybrid trunk's
Gated DeltaNet layers (`linear_attention`) would need their conv window and recurrent state cached, which
`TrunkCache` does not hold yet; it refuses such a config. The draft block is full attention on any trunk.

What this file deliberately does not do: sampling or the speculative loop (`ddl_wgpu.generate`), batches of
several sequences, or any backward.
"""

from __future__ import annotations

import numpy as np

from ddl_ref import delta, ops, shortconv
from ddl_ref import mtp as ref_mtp
from ddl_ref.blocks import head_name
from ddl_ref.config import ConfigError, ModelConfig


def attend_cached(q, k, v, start: int):
    """q (n, H, D) rows at cache slots start..start+n−1; k, v (start+n, K, D) the whole cache -> (n, H, D).

    Row i sees slots 0..start+i (causal over the cache order). GQA: kv head j serves q heads j·H/K...
    """
    n, H, D = q.shape
    S, Kh = k.shape[0], k.shape[1]
    kh = np.repeat(k, H // Kh, axis=1)  # (S, H, D)
    vh = np.repeat(v, H // Kh, axis=1)
    scores = np.einsum("nhd,shd->hns", q, kh) * (float(D) ** -0.5)  # (H, n, S)
    visible = np.arange(S)[None, :] <= start + np.arange(n)[:, None]  # (n, S)
    scores = np.where(visible[None], scores, -np.inf)
    m = np.max(scores, axis=-1, keepdims=True)
    e = np.exp(scores - m)
    probs = e / np.sum(e, axis=-1, keepdims=True)
    return np.einsum("hns,shd->nhd", probs, vh).astype(q.dtype, copy=False)


def _attention(params, cfg: ModelConfig, p: str, h, kc, vc, start: int, cos, sin):
    """One attention sublayer over n rows h (n, C); writes its keys/values into kc, vc (slots, K, D) at
    start..start+n−1 and attends over slots 0..start+n−1; cos/sin (n, D) the rows' RoPE. -> o_proj out."""
    n = h.shape[0]
    H, K, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    eps, style = cfg.rms_eps, cfg.norm_style
    q = ops.linear_forward(h, params[p + "self_attn.q_proj.weight"])
    gate = None
    if cfg.attn_output_gate:  # per head [query; gate] (`ddl_ref.blocks._attn_forward`)
        qg = q.reshape(n, H, 2 * D)
        q, gate = qg[..., :D], qg[..., D:].reshape(n, H * D)
    q = q.reshape(1, n, H, D)
    k = ops.linear_forward(h, params[p + "self_attn.k_proj.weight"]).reshape(1, n, K, D)
    v = ops.linear_forward(h, params[p + "self_attn.v_proj.weight"]).reshape(n, K, D)
    norms = [(p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight")]
    if cfg.qk_norm == "pre_rope":
        q = ops.rmsnorm_forward(q, params[norms[0][0]], eps, style)[0]
        k = ops.rmsnorm_forward(k, params[norms[0][1]], eps, style)[0]
    q, k = ops.rope_forward(q, cos, sin), ops.rope_forward(k, cos, sin)
    if cfg.qk_norm == "post_rope":
        q = ops.rmsnorm_forward(q, params[norms[0][0]], eps, style)[0]
        k = ops.rmsnorm_forward(k, params[norms[0][1]], eps, style)[0]
    kc[start : start + n] = k[0]
    vc[start : start + n] = v
    a = attend_cached(q[0], kc[: start + n], vc[: start + n], start).reshape(n, H * D)
    if gate is not None:
        a = ops.sigmoid_gate_forward(a, gate)
    return ops.linear_forward(a, params[p + "self_attn.o_proj.weight"])


def _mlp(params, p: str, h):
    gate = ops.linear_forward(h, params[p + "mlp.gate_proj.weight"])
    up = ops.linear_forward(h, params[p + "mlp.up_proj.weight"])
    return ops.linear_forward(ops.swiglu_forward(gate, up), params[p + "mlp.down_proj.weight"])


def _norm(params, cfg: ModelConfig, name: str, x):
    return ops.rmsnorm_forward(x, params[name], cfg.rms_eps, cfg.norm_style)[0]


def baseline_block(params, cfg: ModelConfig, p: str, x, kc, vc, start: int, cos, sin):
    """An additive block over n rows x (n, C) with its key/value cache (the trunk's `add` blocks, the draft)."""
    x = x + _attention(params, cfg, p, _norm(params, cfg, p + "input_layernorm.weight", x), kc, vc, start,
                       cos, sin)  # fmt: skip
    return x + _mlp(params, p, _norm(params, cfg, p + "post_attention_layernorm.weight", x))


class TrunkCache:
    """The trunk's per-position state of one sequence (module docstring); `capacity` positions at most."""

    def __init__(self, cfg: ModelConfig, capacity: int | None = None, dtype=np.float32):
        if cfg.has_linear:  # ConfigError: a user's model, one line in the CLI, not a traceback
            raise ConfigError(
                "incremental decoding of a hybrid trunk (linear_attention layers) is not implemented yet: "
                "its cache would need each Gated DeltaNet's conv window and recurrent state"
            )
        cap = cfg.max_seq_len if capacity is None else int(capacity)
        if not 0 < cap <= cfg.max_seq_len:
            raise ValueError(f"cache capacity {cap} must be in 1..max_seq_len {cfg.max_seq_len}")
        L, K, D, C, dv = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, cfg.d_model, cfg.ddl_dv
        self.cfg, self.capacity, self.length = cfg, cap, 0
        self.k = np.zeros((L, cap, K, D), dtype)
        self.v = np.zeros((L, cap, K, D), dtype)
        self.cos, self.sin = ops.rope_tables(cap, D, cfg.rope_theta, dtype, cfg.rope_dim)
        tc = cfg.residual == "delta" and cfg.ddl_dv > 1 and cfg.ddl_compressor == "tc"
        # One history per token-conv site: block i's attention and MLP compressor inputs, then the readout.
        self.conv = np.zeros((2 * L + 1, cap, C, dv), dtype) if tc else None
        self.embed = np.zeros((cap, C), dtype) if cfg.ddl_expand_embed else None

    def rollback(self, length: int) -> None:
        """Forget positions length.. (they are overwritten when run again)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: the cache holds {self.length} positions")
        self.length = int(length)


def _history(store, start: int, n: int, kernel: int):
    """store[max(0, start−kernel+1) : start+n] and how many leading rows are history (not output rows)."""
    lo = max(0, start - kernel + 1)
    return store[lo : start + n], start - lo


def _compress(params, cfg: ModelConfig, prefix: str, cache: TrunkCache, site: int, X, start: int):
    """The compressor of d_v > 1 over n rows X (n, C, dv) -> x_in (n, C); TC reads and extends its history."""
    conv, read = params[prefix + "conv.weight"], params[prefix + "read.weight"]
    if cfg.ddl_compressor == "cc":
        return shortconv.cc_forward(X, conv, read)[0]
    n = X.shape[0]
    cache.conv[site, start : start + n] = X
    rows, skip = _history(cache.conv[site], start, n, cfg.ddl_conv_kernel)
    return shortconv.tc_forward(rows[None], conv, read)[0][0, skip:]


def _expand(params, cfg: ModelConfig, cache: TrunkCache, e, start: int):
    """Embeddings e (n, C) -> the d_v > 1 state X0 (n, C, dv): EC's short conv, or repetition."""
    if not cfg.ddl_expand_embed:
        return shortconv.repeat_forward(e, cfg.ddl_dv)
    n = e.shape[0]
    cache.embed[start : start + n] = e
    rows, skip = _history(cache.embed, start, n, cfg.ddl_conv_kernel)
    return shortconv.ec_forward(rows[None], params["model.embed_expand.conv.weight"])[0][0, skip:]


def _ddl_block(params, cfg: ModelConfig, i: int, X, cache: TrunkCache, start: int, cos, sin):
    """`ddl_ref.model._ddl_block_forward` over n new rows with the cache: X (n, C) or (n, C, dv)."""
    p = f"model.layers.{i}."
    expanded = cfg.ddl_dv > 1
    for s, norm_name in (("attn", "input_layernorm"), ("mlp", "post_attention_layernorm")):
        if expanded:
            x_in = _compress(params, cfg, p + "compress.", cache, 2 * i + (s == "mlp"), X, start)
            Xs = X
        else:
            x_in, Xs = X, X[..., None]
        h = _norm(params, cfg, p + norm_name + ".weight", x_in)
        if s == "attn":
            u = _attention(params, cfg, p, h, cache.k[i], cache.v[i], start, cos, sin)
        else:
            u = _mlp(params, p, h)
        q = f"{p}ddl_{s}."
        Xs, _ = delta.delta_forward(Xs, u, h, x_in, params[q + "beta_proj.weight"], params[q + "beta_proj.bias"],
                                    params[q + "v_proj.weight"], params[q + "v_proj.bias"], cfg.ddl_k_eps,
                                    cfg.ddl_v_scale)  # fmt: skip
        X = Xs if expanded else Xs[..., 0]
    return X


def trunk_step(params, cfg: ModelConfig, cache: TrunkCache, ids):
    """ids (n,) new tokens at positions cache.length.. -> (pre (n, C), post (n, C), logits (n, V)).

    pre/post are the hiddens before/after the final norm (what a draft may read); the cache grows by n."""
    ids = np.asarray(ids, np.int64).reshape(-1)
    n, start = ids.size, cache.length
    if n == 0:
        raise ValueError("trunk_step needs at least one token")
    if start + n > cache.capacity:
        raise ValueError(f"{start + n} positions exceed the cache capacity {cache.capacity}")
    cos, sin = cache.cos[start : start + n], cache.sin[start : start + n]
    x = ops.embedding_forward(ids, params["model.embed_tokens.weight"])  # (n, C)
    expanded = cfg.residual == "delta" and cfg.ddl_dv > 1
    if expanded:
        x = _expand(params, cfg, cache, x, start)
    for i in range(cfg.n_layers):
        if cfg.residual == "delta":
            x = _ddl_block(params, cfg, i, x, cache, start, cos, sin)
        else:
            x = baseline_block(params, cfg, f"model.layers.{i}.", x, cache.k[i], cache.v[i], start, cos, sin)
    if expanded:
        x = _compress(params, cfg, "model.readout.", cache, 2 * cfg.n_layers, x, start)
    post = _norm(params, cfg, "model.norm.weight", x)
    cache.length = start + n
    return x, post, ops.linear_forward(post, params[head_name(cfg)])


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
    e = ops.embedding_forward(tokens, params["model.embed_tokens.weight"])
    x, _ = ref_mtp.draft_input_forward(e, np.asarray(hidden, e.dtype), params[ref_mtp.ENORM],
                                       params[ref_mtp.HNORM], params[ref_mtp.EH_PROJ], cfg)  # fmt: skip
    view = ref_mtp.block_view(params)
    dcfg = ref_mtp.draft_config(cfg)
    pre = baseline_block(view, dcfg, "model.layers.0.", x, cache.k, cache.v, start, cache.cos[positions],
                         cache.sin[positions])  # fmt: skip
    post = _norm(params, cfg, ref_mtp.NORM, pre)
    cache.length = start + n
    return pre, post, ops.linear_forward(post, params[head_name(cfg)])
