"""The reference decoder's blocks and trunk: embedding -> blocks -> final norm, forward and backward per block.

`ddl_ref.model` builds the whole model (head, loss, joint MTP) on these; `ddl_ref.mtp` reuses `block_forward` /
`block_backward` for the draft's block. Both import this module, neither imports the other's internals, so the
two have no import circle. See `ddl_ref.model` for the model's shape and the Deep Delta residual.

A block's token mixer follows `cfg.layer_type(i)`: softmax attention ("full_attention": GQA, RoPE on the
first `cfg.rope_dim` dims of each head, optional q/k norms, optional sigmoid output gate) or the Gated DeltaNet
("linear_attention", `ddl_ref.gdn`). Either is the sublayer output u of the residual (added, or the direction
of a Deep Delta update); nothing else in the block depends on the mixer.

Shape legend: B batch, T time, C d_model, H q heads, K kv heads, D head_dim, F ffn hidden, V vocab.
"""

from __future__ import annotations

import numpy as np

from ddl_ref import delta, gdn, ops, shortconv
from ddl_ref.config import ModelConfig


def _layer_prefix(i: int) -> str:
    return f"model.layers.{i}."


def head_name(cfg: ModelConfig) -> str:
    return "model.embed_tokens.weight" if cfg.tie_embeddings else "lm_head.weight"


# ----------------------------------------------------------------------------------------------------------
# the two sublayers (normalized input -> output before the residual), shared by both residuals


def _attn_forward(params, cfg: ModelConfig, p: str, h, cos, sin, mask=None):
    """h (B, T, C) normalized -> (o_proj output (B, T, C), cache). `mask` (T, T) bool replaces the causal
    mask (`ops.attention_masked_forward`); cos/sin rows are then the rows' positions. With
    `cfg.attn_output_gate` q_proj gives per head [query (D); gate (D)] and the attention output is multiplied
    by sigmoid(gate) before o_proj."""
    B, T, C = h.shape
    H, K, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    eps, style = cfg.rms_eps, cfg.norm_style
    c = {"h": h}
    q = ops.linear_forward(h, params[p + "self_attn.q_proj.weight"])
    if cfg.attn_output_gate:
        qg = q.reshape(B, T, H, 2 * D)
        q, c["gate"] = qg[..., :D], qg[..., D:].reshape(B, T, H * D)
    q = q.reshape(B, T, H, D)
    k = ops.linear_forward(h, params[p + "self_attn.k_proj.weight"]).reshape(B, T, K, D)
    v = ops.linear_forward(h, params[p + "self_attn.v_proj.weight"]).reshape(B, T, K, D)
    if cfg.qk_norm == "pre_rope":
        # Qwen3: RMSNorm over head_dim, then RoPE.
        q, c["qn"] = ops.rmsnorm_forward(q, params[p + "self_attn.q_norm.weight"], eps, style)
        k, c["kn"] = ops.rmsnorm_forward(k, params[p + "self_attn.k_norm.weight"], eps, style)
    q = ops.rope_forward(q, cos, sin)  # (B, T, H, D)
    k = ops.rope_forward(k, cos, sin)  # (B, T, K, D)
    if cfg.qk_norm == "post_rope":
        # Official DDL code: RoPE, then RMSNorm over head_dim.
        q, c["qn"] = ops.rmsnorm_forward(q, params[p + "self_attn.q_norm.weight"], eps, style)
        k, c["kn"] = ops.rmsnorm_forward(k, params[p + "self_attn.k_norm.weight"], eps, style)
    if mask is None:
        a, c["attn"] = ops.attention_forward(q, k, v)  # (B, T, H, D)
    else:
        a, c["attn"] = ops.attention_masked_forward(q, k, v, mask)
    a = a.reshape(B, T, H * D)
    if cfg.attn_output_gate:
        c["a_raw"] = a
        a = ops.sigmoid_gate_forward(a, c["gate"])
    c["a"] = a
    return ops.linear_forward(a, params[p + "self_attn.o_proj.weight"]), c


def _attn_backward(params, cfg: ModelConfig, p: str, dout, c, cos, sin, grads):
    """dout (B, T, C) w.r.t. the o_proj output -> dh (B, T, C) w.r.t. the normalized input."""
    B, T, C = dout.shape
    H, K, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    da, grads[p + "self_attn.o_proj.weight"] = ops.linear_backward(
        dout, c["a"], params[p + "self_attn.o_proj.weight"]
    )
    if cfg.attn_output_gate:
        da, dgate = ops.sigmoid_gate_backward(da, c["a_raw"], c["gate"])
    dq, dk, dv = ops.attention_backward(da.reshape(B, T, H, D), c["attn"])
    if cfg.qk_norm == "post_rope":
        dq, grads[p + "self_attn.q_norm.weight"] = ops.rmsnorm_backward(dq, c["qn"])
        dk, grads[p + "self_attn.k_norm.weight"] = ops.rmsnorm_backward(dk, c["kn"])
    dq = ops.rope_backward(dq, cos, sin)
    dk = ops.rope_backward(dk, cos, sin)
    if cfg.qk_norm == "pre_rope":
        dq, grads[p + "self_attn.q_norm.weight"] = ops.rmsnorm_backward(dq, c["qn"])
        dk, grads[p + "self_attn.k_norm.weight"] = ops.rmsnorm_backward(dk, c["kn"])
    h = c["h"]
    dh_v, grads[p + "self_attn.v_proj.weight"] = ops.linear_backward(
        dv.reshape(B, T, K * D), h, params[p + "self_attn.v_proj.weight"]
    )
    dh_k, grads[p + "self_attn.k_proj.weight"] = ops.linear_backward(
        dk.reshape(B, T, K * D), h, params[p + "self_attn.k_proj.weight"]
    )
    if cfg.attn_output_gate:  # back to q_proj's per-head [query; gate] rows
        dq = np.concatenate([dq, dgate.reshape(B, T, H, D)], axis=-1)
    dh_q, grads[p + "self_attn.q_proj.weight"] = ops.linear_backward(
        dq.reshape(B, T, -1), h, params[p + "self_attn.q_proj.weight"]
    )
    return dh_v + dh_k + dh_q


def _mixer_forward(params, cfg: ModelConfig, i: int, p: str, h, cos, sin, mask=None):
    """Block i's token mixer on the normalized input h (B, T, C) -> (output (B, T, C), cache)."""
    if cfg.layer_type(i) == "linear_attention":
        if mask is not None:
            raise ValueError("an explicit attention mask needs a full-attention block")
        return gdn.gdn_forward(params, cfg, p, h)
    return _attn_forward(params, cfg, p, h, cos, sin, mask)


def _mixer_backward(params, cfg: ModelConfig, i: int, p: str, dout, c, cos, sin, grads):
    """dout (B, T, C) w.r.t. the mixer output -> dh (B, T, C)."""
    if cfg.layer_type(i) == "linear_attention":
        return gdn.gdn_backward(params, cfg, p, dout, c, grads)
    return _attn_backward(params, cfg, p, dout, c, cos, sin, grads)


def _mlp_forward(params, p: str, h2):
    """h2 (B, T, C) normalized -> (down_proj output (B, T, C), cache)."""
    gate = ops.linear_forward(h2, params[p + "mlp.gate_proj.weight"])  # (B, T, F)
    up = ops.linear_forward(h2, params[p + "mlp.up_proj.weight"])  # (B, T, F)
    s = ops.swiglu_forward(gate, up)  # (B, T, F)
    return ops.linear_forward(s, params[p + "mlp.down_proj.weight"]), dict(h2=h2, gate=gate, up=up, s=s)


def _mlp_backward(params, p: str, dout, c, grads):
    """dout (B, T, C) w.r.t. the down_proj output -> dh2 (B, T, C) w.r.t. the normalized input."""
    ds, grads[p + "mlp.down_proj.weight"] = ops.linear_backward(
        dout, c["s"], params[p + "mlp.down_proj.weight"]
    )
    dgate, dup = ops.swiglu_backward(ds, c["gate"], c["up"])
    dh2_u, grads[p + "mlp.up_proj.weight"] = ops.linear_backward(
        dup, c["h2"], params[p + "mlp.up_proj.weight"]
    )
    dh2_g, grads[p + "mlp.gate_proj.weight"] = ops.linear_backward(
        dgate, c["h2"], params[p + "mlp.gate_proj.weight"]
    )
    return dh2_u + dh2_g


# ----------------------------------------------------------------------------------------------------------
# DDL pieces: the Delta update of one sublayer and the d_v > 1 compressors, by parameter prefix


def _delta_forward(params, cfg: ModelConfig, q: str, X, u, c, x_v):
    return delta.delta_forward(
        X, u, c, x_v,
        params[q + "beta_proj.weight"], params[q + "beta_proj.bias"],
        params[q + "v_proj.weight"], params[q + "v_proj.bias"],
        cfg.ddl_k_eps, cfg.ddl_v_scale,
    )  # fmt: skip


def _delta_backward(q: str, dX_new, cache, grads):
    """-> (dX, du, dc, dx_v); the parameter gradients go into `grads`."""
    dX, du, dc, dx_v, dwb, dbb, dWv, dbv = delta.delta_backward(dX_new, cache)
    grads[q + "beta_proj.weight"] = dwb
    grads[q + "beta_proj.bias"] = dbb
    grads[q + "v_proj.weight"] = dWv
    grads[q + "v_proj.bias"] = dbv
    return dX, du, dc, dx_v


def _compress_forward(params, cfg: ModelConfig, prefix: str, X):
    fwd = shortconv.tc_forward if cfg.ddl_compressor == "tc" else shortconv.cc_forward
    return fwd(X, params[prefix + "conv.weight"], params[prefix + "read.weight"])


def compress_backward(cfg: ModelConfig, prefix: str, dx_in, cache, grads):
    """-> dX; conv/read gradients are *accumulated* into `grads` (a block's compressor is used twice)."""
    bwd = shortconv.tc_backward if cfg.ddl_compressor == "tc" else shortconv.cc_backward
    dX, dconv, dread = bwd(dx_in, cache)
    for name, g in ((prefix + "conv.weight", dconv), (prefix + "read.weight", dread)):
        grads[name] = grads[name] + g if name in grads else g
    return dX


# ----------------------------------------------------------------------------------------------------------
# one block


def block_forward(params, cfg: ModelConfig, i: int, x, cos, sin, mask=None, tail: int = 0):
    """x -> (x, cache) for block i.

    x is the residual stream: (B, T, C) for residual "add" and DDL d_v = 1, the state X (B, T, C, dv) for
    DDL d_v > 1. `mask` (T, T) bool replaces the causal attention mask (residual "add" only; the chained
    draft's training layout, `ddl_ref.mtp.draft_forward`). `tail` > 0 (residual "add" only): the MLP sublayer
    runs on the last `tail` rows alone and only they are returned, (B, tail, C); the earlier rows then only feed
    the attention (a stacked chain's earlier steps, whose outputs nothing reads).
    """
    if (mask is not None or tail) and cfg.residual == "delta":
        raise ValueError("an explicit attention mask or a tail needs residual 'add'")
    if cfg.residual == "delta":
        return _ddl_block_forward(params, cfg, i, x, cos, sin)
    p = _layer_prefix(i)
    eps, style = cfg.rms_eps, cfg.norm_style
    c = {"rows": x.shape[1], "tail": tail}
    # --- attention sublayer
    h, c["n1"] = ops.rmsnorm_forward(x, params[p + "input_layernorm.weight"], eps, style)  # (B, T, C)
    out, c["attn_sub"] = _mixer_forward(params, cfg, i, p, h, cos, sin, mask)
    x = x + out
    if tail:
        x = x[:, -tail:]
    # --- MLP sublayer
    h2, c["n2"] = ops.rmsnorm_forward(x, params[p + "post_attention_layernorm.weight"], eps, style)
    out2, c["mlp_sub"] = _mlp_forward(params, p, h2)
    x = x + out2
    return x, c


def block_backward(params, cfg: ModelConfig, i: int, dx, c, cos, sin, grads):
    """dx w.r.t. the block output -> dx w.r.t. its input (shapes as in `block_forward`); parameter gradients
    go into `grads`."""
    if cfg.residual == "delta":
        return _ddl_block_backward(params, cfg, i, dx, c, cos, sin, grads)
    p = _layer_prefix(i)
    # --- MLP sublayer (reverse). The residual passes dx straight through and the branch adds to it.
    dh2 = _mlp_backward(params, p, dx, c["mlp_sub"], grads)
    dxn, grads[p + "post_attention_layernorm.weight"] = ops.rmsnorm_backward(dh2, c["n2"])
    dx = dx + dxn
    if c.get("tail"):  # the rows before the tail got no gradient through the MLP or the output
        full = np.zeros((dx.shape[0], c["rows"], *dx.shape[2:]), dx.dtype)
        full[:, -c["tail"] :] = dx
        dx = full
    # --- attention sublayer (reverse)
    dh = _mixer_backward(params, cfg, i, p, dx, c["attn_sub"], cos, sin, grads)
    dxn, grads[p + "input_layernorm.weight"] = ops.rmsnorm_backward(dh, c["n1"])
    return dx + dxn


def _ddl_block_forward(params, cfg: ModelConfig, i: int, X, cos, sin):
    """The Deep Delta block for d_v = 1 and d_v > 1 (docs/model.md#deep-delta-learning).

    d_v = 1, x (B, T, C):   c = ln_1(x); h = attn(c); x = delta(x; u=h, c=c, x_v=x); same with ln_2/mlp.
    d_v > 1, X (B, T, C, dv): x_in = compress(X); c = ln_1(x_in); h = attn(c); X = delta(X; u=h, c=c,
    x_v=x_in); then the same with the *same* compressor, ln_2 and mlp. The sublayer output only gives the
    direction k: it is never added to the stream.
    """
    p = _layer_prefix(i)
    eps, style = cfg.rms_eps, cfg.norm_style
    expanded = cfg.ddl_dv > 1
    cache = {}
    for s, norm_name, sub in (
        ("attn", "input_layernorm", "attn_sub"),
        ("mlp", "post_attention_layernorm", "mlp_sub"),
    ):
        if expanded:
            x_in, cache[s + "_compress"] = _compress_forward(params, cfg, p + "compress.", X)  # (B, T, C)
            Xs = X
        else:
            x_in, Xs = X, X[..., None]  # d_v = 1: the stream is its own readout and the v input
        h, cache[s + "_norm"] = ops.rmsnorm_forward(x_in, params[p + norm_name + ".weight"], eps, style)
        if s == "attn":
            u, cache[sub] = _mixer_forward(params, cfg, i, p, h, cos, sin)
        else:
            u, cache[sub] = _mlp_forward(params, p, h)
        Xs, cache["ddl_" + s] = _delta_forward(params, cfg, f"{p}ddl_{s}.", Xs, u, h, x_in)
        X = Xs if expanded else Xs[..., 0]
    return X, cache


def _ddl_block_backward(params, cfg: ModelConfig, i: int, dX, cache, cos, sin, grads):
    p = _layer_prefix(i)
    expanded = cfg.ddl_dv > 1
    for s, norm_name, sub in (
        ("mlp", "post_attention_layernorm", "mlp_sub"),
        ("attn", "input_layernorm", "attn_sub"),
    ):
        dXs = dX if expanded else dX[..., None]
        dXs, du, dc, dx_in = _delta_backward(f"{p}ddl_{s}.", dXs, cache["ddl_" + s], grads)
        if s == "attn":
            dh = _mixer_backward(params, cfg, i, p, du, cache[sub], cos, sin, grads)
        else:
            dh = _mlp_backward(params, p, du, cache[sub], grads)
        dxn, grads[p + norm_name + ".weight"] = ops.rmsnorm_backward(dh + dc, cache[s + "_norm"])
        dx_in = dx_in + dxn
        if expanded:
            dX = dXs + compress_backward(cfg, p + "compress.", dx_in, cache[s + "_compress"], grads)
        else:
            dX = dXs[..., 0] + dx_in
    return dX


# ----------------------------------------------------------------------------------------------------------
# the whole model


def _rope(cfg: ModelConfig, T: int, dtype):
    if cfg.max_seq_len < T:
        raise ValueError(f"sequence length {T} exceeds max_seq_len {cfg.max_seq_len}")
    return ops.rope_tables(T, cfg.head_dim, cfg.rope_theta, dtype, cfg.rope_dim)


def trunk_forward(params, cfg: ModelConfig, ids, taps=()):
    """ids (B, T) -> (pre-norm last hidden (B, T, C), post-norm hidden (B, T, C), cache).

    DDL d_v > 1: the embedding is expanded to the state X0 (B, T, C, dv) by EC or repetition, and the last
    hidden is the readout compressor's output. `taps`: layer ids whose input rows (the residual stream before
    the layer, what an EAGLE-3 draft reads) go into cache["taps"], in the order given.
    """
    ids = np.asarray(ids)
    B, T = ids.shape
    dtype = params["model.embed_tokens.weight"].dtype
    cos, sin = _rope(cfg, T, dtype)  # (T, rope_dim) each; positions 0..T-1
    x = ops.embedding_forward(ids, params["model.embed_tokens.weight"])  # (B, T, C)
    cache = {"ids": ids, "cos": cos, "sin": sin}
    expanded = cfg.residual == "delta" and cfg.ddl_dv > 1
    if expanded:
        if cfg.ddl_expand_embed:
            x, cache["expand"] = shortconv.ec_forward(x, params["model.embed_expand.conv.weight"])
        else:
            x = shortconv.repeat_forward(x, cfg.ddl_dv)  # (B, T, C, dv)
    blocks, tapped = [], {}
    for i in range(cfg.n_layers):
        if i in taps:
            tapped[i] = x
        x, bc = block_forward(params, cfg, i, x, cos, sin)
        blocks.append(bc)
    if expanded:
        x, cache["readout"] = _compress_forward(params, cfg, "model.readout.", x)  # (B, T, C)
    xf, cnorm = ops.rmsnorm_forward(x, params["model.norm.weight"], cfg.rms_eps, cfg.norm_style)
    cache.update(blocks=blocks, norm=cnorm, taps=[tapped[j] for j in taps])
    return x, xf, cache
