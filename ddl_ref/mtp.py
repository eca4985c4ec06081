"""The MTP draft head (docs/heal.md) as forward/backward pairs on numpy arrays.

One draft block under `model.mtp.*` predicts the token after next from the trunk's hidden row:

    x_p    = eh_proj · [enorm(E[t]); hnorm(h_p)]        (or [hnorm(h_p); enorm(E[t])] for concat "hidden_first")
    pre_p  = block(x)_p                                 a baseline decoder block (`ddl_ref.blocks.block_forward`)
    post_p = model.mtp.norm(pre_p)
    logits = post_p @ head.T                            the trunk's (shared) head

Step 1 at anchor p reads the trunk's hidden h_p (pre- or post-final-norm: `MtpConfig.trunk_hidden`) and the
token t = x_{p+1}; step j > 1 reads the draft's own step j−1 output at row p (`MtpConfig.chain_hidden`:
`pre` or `post`) and the token at p + j (the data token when teacher-forced, the draft's own argmax when
drafting greedily). The target of step j at row p is the trunk's distribution at p + j.

Attention of a step-j pass is by default causal over the step-j rows of the same window at RoPE positions
0..T−1, as the reference heal tool trains it (one window through a one-layer model). With `chain=j` the rows
of steps 1..j are stacked and attend with the runtime's training-time-test "diagonal" mask
(docs/heal.md#chain-attention-per-step-or-stacked: step-j rows attend to step-1 rows ≤ p plus the same
anchor's step-2..j rows, at positions p + j − 1).

The block reuses `ddl_ref.blocks.block_forward/block_backward` through a name-mapped view of the parameters
(`model.mtp.layers.0.X` seen as `model.layers.0.X`) and a one-layer baseline config (`draft_config`), so the
draft block is the trunk's block, line for line, even under a DDL trunk.

Joint training (`joint_forward`/`joint_backward`, used by `ddl_ref.model.forward(..., mtp_weight=w)`): the
draft's cross-entropy on x_{p+2} at every anchor p < length − 2, with its input gradient returned for the
trunk's hidden, the shared embedding and the shared head (DeepSeek-V3 trains them all through the draft).

What this file deliberately does not do: heal (that is `ddl_wgpu.jobs.heal`; there the embedding and head are
frozen and get no gradient), or measure acceptance (that is `ddl_wgpu.jobs.accept`).

Shape legend: B batch, T time, C d_model, V vocab, k top-k width.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ddl_ref import blocks as ref_blocks
from ddl_ref import ops
from ddl_ref.config import ModelConfig, MtpConfig
from ddl_ref.params import MTP_LAYER_PREFIX, MTP_PREFIX

ENORM = MTP_PREFIX + "enorm.weight"
HNORM = MTP_PREFIX + "hnorm.weight"
EH_PROJ = MTP_PREFIX + "eh_proj.weight"
NORM = MTP_PREFIX + "norm.weight"
_BLOCK_PREFIX = "model.layers.0."  # the name the draft block has inside its one-layer config


def draft_config(cfg: ModelConfig) -> ModelConfig:
    """The draft block as a one-layer baseline model: the trunk's geometry (the draft's own FFN width when
    `MtpConfig.ffn_hidden` is set), additive residual, no draft, and always a full-attention block (on a
    hybrid trunk too: Qwen3.5's draft; it keeps the trunk's output gate and partial RoPE)."""
    return dataclasses.replace(
        cfg,
        n_layers=1,
        layer_types=None,
        residual="add",
        ddl_dv=1,
        ddl_compressor="none",
        ddl_expand_embed=False,
        mtp=None,
        ffn_hidden=draft_ffn_hidden(cfg),
    )


def draft_ffn_hidden(cfg: ModelConfig) -> int:
    """The draft block's SwiGLU width: its own when set, else the trunk's."""
    return cfg.mtp.ffn_hidden if cfg.mtp is not None and cfg.mtp.ffn_hidden is not None else cfg.ffn_hidden


def mtp_of(cfg: ModelConfig) -> MtpConfig:
    if cfg.mtp is None:
        raise ValueError("the model config has no MTP draft (cfg.mtp is None)")
    return cfg.mtp


def block_view(params: dict) -> dict:
    """`model.mtp.layers.0.X` -> `model.layers.0.X` (the same arrays, not copies)."""
    n = len(MTP_LAYER_PREFIX)
    return {_BLOCK_PREFIX + k[n:]: v for k, v in params.items() if k.startswith(MTP_LAYER_PREFIX)}


def trained_names(params: dict) -> list[str]:
    """The tensors a draft heal trains: the block and the final norm (the input projection stays as it is)."""
    return [k for k in params if k.startswith(MTP_LAYER_PREFIX)] + [NORM]


def head_weight(params: dict, cfg: ModelConfig) -> np.ndarray:
    return params[ref_blocks.head_name(cfg)]


def pick_hidden(pre, post, which: str):
    """`which` is "pre_norm" or "post_norm" (`MtpConfig.trunk_hidden` / `chain_hidden`)."""
    if which not in ("pre_norm", "post_norm"):
        raise ValueError(f"hidden choice must be 'pre_norm' or 'post_norm', got {which!r}")
    return pre if which == "pre_norm" else post


# ----------------------------------------------------------------------------------------------------------
# the block input: x = eh_proj · [enorm(e); hnorm(h)]


def draft_input_forward(e_next, h, enorm_w, hnorm_w, eh_w, cfg: ModelConfig):
    """e_next (..., C) embedding of the next token, h (..., C) hidden -> (x (..., C), cache)."""
    mtp = mtp_of(cfg)
    eps, style = cfg.rms_eps, cfg.norm_style
    en, c_e = ops.rmsnorm_forward(e_next, enorm_w, eps, style)  # (..., C)
    hn, c_h = ops.rmsnorm_forward(h, hnorm_w, eps, style)  # (..., C)
    parts = (en, hn) if mtp.concat == "emb_first" else (hn, en)
    cat = np.concatenate(parts, axis=-1)  # (..., 2C): eh_proj columns [:C] multiply the first part
    x = ops.linear_forward(cat, eh_w)  # (..., C)
    return x, (c_e, c_h, cat, eh_w, mtp.concat)


def draft_input_backward(dx, cache):
    """-> (de_next, dh, denorm_w, dhnorm_w, deh_w)."""
    c_e, c_h, cat, eh_w, concat = cache
    dcat, deh = ops.linear_backward(dx, cat, eh_w)
    C = dcat.shape[-1] // 2
    first, second = dcat[..., :C], dcat[..., C:]
    den, dhn = (first, second) if concat == "emb_first" else (second, first)
    dh, dhnorm = ops.rmsnorm_backward(dhn, c_h)
    de, denorm = ops.rmsnorm_backward(den, c_e)
    return de, dh, denorm, dhnorm, deh


# ----------------------------------------------------------------------------------------------------------
# the draft block and its final norm


def chain_rows(chain: int, T: int) -> int:
    """Window length of `chain` stacked steps over T' rows (T' = chain·T), checked."""
    if chain < 1 or T % chain:
        raise ValueError(f"{T} stacked rows are not {chain} chain steps of one window")
    return T // chain


def draft_forward(params: dict, cfg: ModelConfig, x_rows, chain: int = 0, last_only: bool = False):
    """x_rows (B, T, C) block input -> (hidden_pre (B, T, C), hidden_post (B, T, C), cache).

    hidden_pre is the block's residual output (what cortiq chains), hidden_post = model.mtp.norm(pre).
    chain = 0: one step's rows, causal attention at positions 0..T−1 (as the reference heal tool).
    chain = j >= 1: the rows of steps 1..j of one window stacked (row (σ−1)·W + p, T = j·W), attending with the
    runtime's diagonal mask (`ops.chain_mask`) at positions p + σ − 1 (`ops.chain_positions`),
    docs/heal.md#chain-attention-per-step-or-stacked. `last_only` (chain >= 1): the block's MLP and the final
    norm run on step j's rows alone, and pre and post are those rows, (B, W, C): the earlier steps' rows only
    feed the attention (`ref_blocks.block_forward`'s tail).
    """
    B, T, C = x_rows.shape
    W = chain_rows(chain, T) if chain else T
    if cfg.max_seq_len < W:
        raise ValueError(f"sequence length {W} exceeds max_seq_len {cfg.max_seq_len}")
    dcfg = draft_config(cfg)
    mask = None
    if chain:
        pos = ops.chain_positions(chain, W)
        cos, sin = ops.rope_tables_at(pos, cfg.head_dim, cfg.rope_theta, x_rows.dtype, cfg.rope_dim)
        mask = ops.chain_mask(chain, W)
    else:
        # positions 0..T-1
        cos, sin = ops.rope_tables(T, cfg.head_dim, cfg.rope_theta, x_rows.dtype, cfg.rope_dim)
    tail = W if chain and last_only else 0
    pre, c_block = ref_blocks.block_forward(block_view(params), dcfg, 0, x_rows, cos, sin, mask, tail)
    post, c_norm = ops.rmsnorm_forward(pre, params[NORM], cfg.rms_eps, cfg.norm_style)
    return pre, post, {"block": c_block, "norm": c_norm, "cos": cos, "sin": sin}


def draft_backward(params: dict, cfg: ModelConfig, cache, dpost, dpre=None):
    """Gradients w.r.t. hidden_post (and optionally hidden_pre) -> (dx_rows, grads {model.mtp.* name: array})."""
    dx, dnorm = ops.rmsnorm_backward(dpost, cache["norm"])
    if dpre is not None:
        dx = dx + dpre
    bgrads: dict = {}
    dx = ref_blocks.block_backward(
        block_view(params), draft_config(cfg), 0, dx, cache["block"], cache["cos"], cache["sin"], bgrads
    )
    n = len(_BLOCK_PREFIX)
    grads = {MTP_LAYER_PREFIX + k[n:]: g for k, g in bgrads.items()}
    grads[NORM] = dnorm
    return dx, {k: grads[k] for k in trained_names(params) if k in grads}


def draft_logits(params: dict, cfg: ModelConfig, hidden_post):
    """hidden_post (..., C) -> logits (..., V) through the shared head."""
    return ops.linear_forward(hidden_post, head_weight(params, cfg))


def draft_kl_forward(params: dict, cfg: ModelConfig, x_rows, teacher_ids, teacher_probs, weights,
                     chain: int = 0, form: str = "full"):  # fmt: skip
    """Top-k KL of the draft against a teacher, summed over rows.

    x_rows (B, T, C), teacher_ids/probs (B, T, k), weights (B, T) 0/1 -> (kl_sum, cache). `chain` as in
    `draft_forward`: stacked steps, of which only step `chain`'s rows (the last T / chain of each window) carry
    the loss, so the block's MLP, the final norm, the head and the KL run on those rows alone (the rows of
    earlier steps only feed the attention; their weights are ignored, and callers give them 0); the cache's
    pre and post are those rows. `form`: "full" (the reference heal tool's:
    the draft's full-vocabulary log-softmax against the teacher's renormalised top-k) or "topk" (the draft
    renormalised over the teacher's k ids); `ops.topk_kl_forward`.
    """
    B, T, C = x_rows.shape
    # the rows that carry the loss: the last `last` of each window (in a stacked chain, the block's MLP and
    # the final norm run on those alone: pre and post are (B, last, C))
    pre, post, c_draft = draft_forward(params, cfg, x_rows, chain, last_only=True)
    last = chain_rows(chain, T) if chain else T
    logits = draft_logits(params, cfg, post)  # (B, last, V)
    k = np.shape(teacher_ids)[-1]
    kl_sum, c_kl = ops.topk_kl_forward(
        logits.reshape(B * last, -1),
        np.asarray(teacher_ids)[:, T - last :].reshape(B * last, k),
        np.asarray(teacher_probs, x_rows.dtype)[:, T - last :].reshape(B * last, k),
        np.asarray(weights)[:, T - last :].reshape(B * last),
        form,
    )
    return kl_sum, {"draft": c_draft, "kl": c_kl, "pre": pre, "post": post, "shape": (B, T), "last": last}


def draft_kl_backward(params: dict, cfg: ModelConfig, cache, dloss: float = 1.0):
    """-> (dx_rows (B, T, C), grads of dloss * kl_sum for the trained draft tensors)."""
    B, _T = cache["shape"]
    dlogits = ops.topk_kl_backward(cache["kl"]) * float(dloss)  # (B*last, V)
    dpost, _dhead = ops.linear_backward(
        dlogits.reshape(B, cache["last"], -1), cache["post"], head_weight(params, cfg)
    )  # the head is shared and frozen: its gradient is dropped
    return draft_backward(params, cfg, cache["draft"], dpost)


# ----------------------------------------------------------------------------------------------------------
# chained steps


def step_input(params: dict, cfg: ModelConfig, next_tokens, hid, valid):
    """One chain step's block input rows.

    next_tokens (B, T) int: row p's token (x_{p+j} for step j); hid (B, T, C): row p's hidden (the trunk's for
    step 1, the draft's step j−1 output after); valid (B, T) bool: rows past the window's end are zeroed.
    """
    dtype = params[EH_PROJ].dtype
    e = ops.embedding_forward(np.asarray(next_tokens), params["model.embed_tokens.weight"])
    x, _ = draft_input_forward(e, np.asarray(hid, dtype), params[ENORM], params[HNORM], params[EH_PROJ], cfg)
    return np.where(np.asarray(valid)[..., None], x, 0.0).astype(dtype, copy=False)


def shifted(a, j: int, fill=0):
    """a (B, T, ...) -> out with out[:, p] = a[:, p + j] for p < T − j, `fill` after."""
    out = np.full_like(a, fill)
    if j < a.shape[1]:
        out[:, : a.shape[1] - j] = a[:, j:]
    return out


def step_valid(lengths, T: int, j: int):
    """(B, T) bool: rows p with p + j < length (the token at p + j exists)."""
    return np.arange(T)[None, :] + j < np.asarray(lengths).reshape(-1, 1)


def draft_chain(params: dict, cfg: ModelConfig, ids, lengths, trunk_pre, trunk_post, depth: int,
                tokens: str = "greedy"):  # fmt: skip
    """Run the draft `depth` steps deep over whole windows -> list of logits (B, T, V), one per step.

    Row p of step j predicts x_{p+j+1}. Step 1 reads the data token x_{p+1}; step j > 1 reads the draft's own
    step j−1 argmax at row p (tokens="greedy", a speculative round) or the data token x_{p+j}
    (tokens="teacher", how `heal` trains). Hiddens follow `cfg.mtp.trunk_hidden` / `chain_hidden`.
    """
    if tokens not in ("greedy", "teacher"):
        raise ValueError(f"tokens must be 'greedy' or 'teacher', got {tokens!r}")
    mtp = mtp_of(cfg)
    ids = np.asarray(ids)
    B, T = ids.shape
    hid = pick_hidden(trunk_pre, trunk_post, mtp.trunk_hidden)
    tok = shifted(ids, 1)
    valid = step_valid(lengths, T, 1)
    out = []
    for j in range(1, depth + 1):
        x = step_input(params, cfg, tok, hid, valid)
        pre, post, _ = draft_forward(params, cfg, x)
        logits = draft_logits(params, cfg, post)
        out.append(logits)
        hid = pick_hidden(pre, post, mtp.chain_hidden)
        if tokens == "greedy":
            tok = np.argmax(logits, axis=-1)
        else:
            tok = shifted(ids, j + 1)
            valid = step_valid(lengths, T, j + 1)
    return out


# ----------------------------------------------------------------------------------------------------------
# the teacher: the trunk's hidden rows and next-token top-k


def topk_probs(logits, k: int):
    """logits (..., V) -> (ids (..., k) int32, probs (..., k) float32), by decreasing probability.

    probs are the full softmax's (not renormalised over the k). Ties go to the smaller id, so ids[..., 0] is
    exactly np.argmax (the trunk's greedy token).
    """
    V = logits.shape[-1]
    k = min(int(k), V)
    z = np.asarray(logits, np.float64)
    lse = ops.logsumexp(z, axis=-1, keepdims=True)
    part = (
        np.sort(np.argpartition(-z, k - 1, axis=-1)[..., :k], axis=-1)
        if k < V
        else np.broadcast_to(np.arange(V), z.shape)
    )
    vals = np.take_along_axis(z, part, axis=-1)
    order = np.argsort(-vals, axis=-1, kind="stable")
    ids = np.take_along_axis(part, order, axis=-1)
    probs = np.exp(np.take_along_axis(vals, order, axis=-1) - lse)
    return ids.astype(np.int32), probs.astype(np.float32)


def trunk_topk_hidden(params: dict, cfg: ModelConfig, ids, k: int):
    """ids (B, T) -> (top_ids (B, T, k), top_probs (B, T, k), hidden_pre (B, T, C), hidden_post (B, T, C))."""
    pre, post, _ = ref_blocks.trunk_forward(params, cfg, np.asarray(ids))
    top_ids, top_probs = topk_probs(ops.linear_forward(post, head_weight(params, cfg)), k)
    return top_ids, top_probs, pre, post


# ----------------------------------------------------------------------------------------------------------
# joint training (DeepSeek-V3 style): the draft's cross-entropy added to the trunk's


def joint_targets(ids, lengths):
    """ids (B, T), lengths (B,) -> (draft tokens (B, T), targets (B, T), weights (B, T) 0/1).

    Row p reads the token x_{p+1} and predicts x_{p+2}; it counts for p < length − 2 (and p < T − 2).
    Tokens and targets past the window are 0 (their rows carry weight 0; attention is causal, so they never
    reach a counted row).
    """
    ids = np.asarray(ids)
    B, T = ids.shape
    lengths = np.asarray(lengths).reshape(B)
    limit = np.minimum(lengths - 2, T - 2)
    weights = np.arange(T)[None, :] < limit[:, None]
    return shifted(ids, 1), shifted(ids, 2), weights


def joint_forward(params: dict, cfg: ModelConfig, ids, lengths, trunk_pre, trunk_post):
    """The draft's loss in joint training -> (loss_mtp (mean over counted rows, 0.0 when none), cache).

    The block input is built from the shared embedding of x_{p+1} and the trunk's hidden h_p
    (`MtpConfig.trunk_hidden`); gradients flow back into both (`joint_backward`), as in DeepSeek-V3.
    """
    mtp = mtp_of(cfg)
    ids = np.asarray(ids)
    B, T = ids.shape
    tok, targets, weights = joint_targets(ids, lengths)
    e = ops.embedding_forward(tok, params["model.embed_tokens.weight"])  # (B, T, C)
    hid = pick_hidden(trunk_pre, trunk_post, mtp.trunk_hidden)
    x, c_in = draft_input_forward(e, hid, params[ENORM], params[HNORM], params[EH_PROJ], cfg)
    pre, post, c_draft = draft_forward(params, cfg, x)
    logits = draft_logits(params, cfg, post)  # (B, T, V)
    V = logits.shape[-1]
    w = weights.astype(logits.dtype)
    count = int(weights.sum())
    loss_sum, drows = ops.cross_entropy_rows(logits.reshape(B * T, V), targets.reshape(-1), w.reshape(-1))
    loss = loss_sum / count if count > 0 else 0.0
    cache = {"tok": tok, "in": c_in, "draft": c_draft, "post": post, "drows": drows.reshape(B, T, V),
             "count": count}  # fmt: skip
    return loss, cache


def joint_backward(params: dict, cfg: ModelConfig, cache, dloss: float):
    """Gradient of dloss * loss_mtp -> (dhidden (B, T, C) w.r.t. the trunk hidden the draft read,
    dembedding (V, C) from the draft's input, dhead (the shared head's part), grads {model.mtp.*: array})."""
    count = cache["count"]
    dlogits = cache["drows"] * (float(dloss) / count) if count > 0 else np.zeros_like(cache["drows"])
    dpost, dhead = ops.linear_backward(dlogits, cache["post"], head_weight(params, cfg))
    dx, grads = draft_backward(params, cfg, cache["draft"], dpost)
    de, dh, denorm, dhnorm, deh = draft_input_backward(dx, cache["in"])
    grads.update({ENORM: denorm, HNORM: dhnorm, EH_PROJ: deh})
    vocab = params["model.embed_tokens.weight"].shape[0]
    demb = ops.embedding_backward(de, cache["tok"], vocab)
    return dh, demb, dhead, grads
