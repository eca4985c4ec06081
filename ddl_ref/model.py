"""The reference model: a pre-norm decoder (Llama/Qwen3 layout) built from `ddl_ref.ops`, forward and backward.

    x = embed(ids)
    per block:  x = x + o_proj(attention(rope/qk-norm(q_proj(n1(x))), ..., v_proj(n1(x))))
                x = x + down_proj(silu(gate_proj(n2(x))) * up_proj(n2(x)))
    logits = model.norm(x) @ (lm_head or embed_tokens).T

`block_backward` calls the same ops as `block_forward` in exactly reverse order, and `backward` mirrors
`forward`, so the two can be read line against line. The whole model is checked against
finite differences in tests/test_ref_model.py, and the engine is checked against this file.

With `residual="delta"` (Deep Delta Learning, docs/model.md#deep-delta-learning) each sublayer's output only
sets the direction k of a rank-1 Delta update of the stream (`ddl_ref.delta`); for d_v > 1 the stream is a
state X (B, T, C, dv), expanded from the embedding (EC or repetition, `ddl_ref.shortconv`), read by a
per-block compressor (TC or CC, shared by both sublayers) and by a final readout compressor before model.norm.

Joint MTP training (DeepSeek-V3 style, `forward(..., mtp_weight=w)` with `cfg.mtp` set): the loss is
CE(trunk, x_{p+1}) + w · CE(draft, x_{p+2}), the draft reading eh_proj·[enorm(E[x_{p+1}]); hnorm(h_p)]
(`ddl_ref.mtp.joint_forward`). Its gradient flows into the draft AND back into the trunk, through h_p
(pre- or post-final-norm, `MtpConfig.trunk_hidden`) and through the shared embedding and head, as DeepSeek
trains it. Without `mtp_weight` the draft is ignored (the trunk is computed as if `cfg.mtp` were None).

What this file deliberately does not do: KV caching, dropout, or anything for speed.

Shape legend: B batch, T time, C d_model, H q heads, K kv heads, D head_dim, F ffn hidden, V vocab.
"""

from __future__ import annotations

import numpy as np

from ddl_ref import mtp, ops, shortconv
from ddl_ref.blocks import block_backward, compress_backward, head_name, trunk_forward
from ddl_ref.config import ModelConfig
from ddl_ref.spectral import spectral_snapshot


def hidden_states(params, cfg: ModelConfig, ids):
    """-> (pre_norm_last_hidden, post_norm), each (B, T, C): the hiddens an MTP draft head may read."""
    x, xf, _ = trunk_forward(params, cfg, ids)
    return x, xf


def forward(params, cfg: ModelConfig, ids, lengths=None, spectral: bool = False, mtp_weight=None):
    """ids (B, T) int, lengths (B,) (default: all T) -> (logits (B, T, V), loss, cache).

    spectral=True adds `cache["spectral"]`: the DDL spectral snapshot over the real tokens
    (`ddl_ref.spectral.spectral_snapshot`), None for a baseline model.

    mtp_weight (a number, with `cfg.mtp` set): joint training; loss = loss_main + mtp_weight · loss_mtp, both
    kept in the cache (`loss_main`, `loss_mtp`); the logits stay the trunk's.
    """
    ids = np.asarray(ids)
    B, T = ids.shape
    lengths = np.full(B, T, dtype=np.int64) if lengths is None else np.asarray(lengths)
    _x, xf, cache = trunk_forward(params, cfg, ids)
    logits = ops.linear_forward(xf, params[head_name(cfg)])  # (B, T, V)
    loss, cache["loss"] = ops.lm_loss_forward(logits, ids, lengths)
    cache["xf"] = xf
    if spectral:
        cache["spectral"] = spectral_snapshot(cache, cfg, lengths)
    if mtp_weight is not None and cfg.mtp is not None:
        loss_mtp, cache["mtp"] = mtp.joint_forward(params, cfg, ids, lengths, _x, xf)
        cache.update(mtp_weight=float(mtp_weight), loss_main=loss, loss_mtp=loss_mtp)
        loss = loss + float(mtp_weight) * loss_mtp
    return logits, loss, cache


def backward(params, cfg: ModelConfig, cache, dloss=1.0, dlogits=None):
    """-> grads {name: array of the parameter's shape}.

    The gradient is of `dloss * loss`, or, when `dlogits` (B, T, V) is given, of `sum(logits * dlogits)` (for
    losses computed outside the model, such as top-k KL). A tied embedding gets the head's contribution too.
    After a joint forward (`mtp_weight`), the draft's term is included: its tensors get gradients and its
    input gradient joins the trunk's hidden, embedding and head.
    """
    grads: dict[str, np.ndarray] = {}
    if dlogits is None:
        dlogits = ops.lm_loss_backward(cache["loss"], dloss)
    head = head_name(cfg)
    dxf, dhead = ops.linear_backward(dlogits, cache["xf"], params[head])
    demb_mtp = dhid = None
    if "mtp" in cache:  # the draft first: its input gradient joins the trunk's below
        dhid, demb_mtp, dhead_mtp, mgrads = mtp.joint_backward(
            params, cfg, cache["mtp"], float(dloss) * cache["mtp_weight"]
        )
        dhead = dhead + dhead_mtp
        grads.update(mgrads)
        if cfg.mtp.trunk_hidden == "post_norm":
            dxf = dxf + dhid
    dx, grads["model.norm.weight"] = ops.rmsnorm_backward(dxf, cache["norm"])
    if dhid is not None and cfg.mtp.trunk_hidden == "pre_norm":
        dx = dx + dhid
    expanded = cfg.residual == "delta" and cfg.ddl_dv > 1
    if expanded:
        dx = compress_backward(cfg, "model.readout.", dx, cache["readout"], grads)  # (B, T, C, dv)
    for i in reversed(range(cfg.n_layers)):
        dx = block_backward(params, cfg, i, dx, cache["blocks"][i], cache["cos"], cache["sin"], grads)
    if expanded:
        if cfg.ddl_expand_embed:
            dx, grads["model.embed_expand.conv.weight"] = shortconv.ec_backward(dx, cache["expand"])
        else:
            dx = shortconv.repeat_backward(dx)
    vocab = params["model.embed_tokens.weight"].shape[0]
    grads["model.embed_tokens.weight"] = ops.embedding_backward(dx, cache["ids"], vocab)
    if demb_mtp is not None:
        grads["model.embed_tokens.weight"] = grads["model.embed_tokens.weight"] + demb_mtp
    if cfg.tie_embeddings:
        grads["model.embed_tokens.weight"] = grads["model.embed_tokens.weight"] + dhead
    else:
        grads["lm_head.weight"] = dhead
    # Same order as `params` (the parameter table's order), so reports and flat buffers line up.
    return {name: grads[name] for name in params if name in grads}
