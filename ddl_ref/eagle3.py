"""The EAGLE-3 draft (docs/eagle3.md) as forward/backward pairs on numpy arrays: one Llama decoder layer that
vLLM and SGLang serve as `LlamaForCausalLMEagle3`, and its training-time-test (TTT) loss as SpecForge trains it.

A draft step at row p reads the token embedding e_p (the target's embedding table, shared and frozen) and a
hidden row h_p of width H, and returns the normed row for the logits and the pre-norm row fed back:

    en = input_layernorm(e_p)                    hn = hidden_norm(h_p)
    x  = [en ; hn]                               (2H: the embedding first, columns [:H] of q/k/v_proj)
    a  = o_proj(attention(rope(q_proj x), rope(k_proj x), v_proj x))
    r  = h_p + a                                 (hn + a with norm_before_residual)
    pre  = r + down_proj(silu(gate_proj n) * up_proj n),   n = post_attention_layernorm(r)
    post = norm(pre);      logits = lm_head post   (Vd draft ids; draft id d is target id d + d2t[d])

Step 0's hidden is h = fc · [a_1 ; a_2 ; a_3], the target's residual stream at the inputs of its layers
`aux_layers` (3·H wide, `aux_hidden`); every later step's hidden is the previous step's `pre` (H wide, so fc
is skipped).

Training (`ttt_forward`, SpecForge's `OnlineEagle3Model`): the step is unrolled `ttt` times over a window of T
rows. Row p of step i (i = 0..ttt-1) reads the data token x_{p+i+1} at RoPE position p + i, step i-1's `pre`
at row p (step 0: fc of the aux rows at p), and attends to step 0's keys at rows <= p plus the keys of steps
1..i at row p itself (`ttt_mask`). Its target is the target model's distribution at position p + i + 1 (over
x_{p+i+2}) restricted to the draft vocabulary and renormalised, p~ = softmax(z_{p+i+1}[draft ids]); its weight
is w_i,p = loss_mask[p + i] · t2d[argmax z_{p+i+1}] (rows whose target argmax lies outside the draft
vocabulary drop out). The loss is

    loss = sum_i step_weight^i · ( -1/(B·T) · sum_{b,p} w_i,p · sum_d p~_d log softmax(logits_i,p)_d )

(the soft cross-entropy; `kl=True` subtracts the targets' entropy, which changes the value, not the gradient).
The loss mask from `lengths` counts p < length − 1, so every counted row's target position exists.

Inference (`propose`): step 0 over a prefix of n rows (token x_{p+1}, the last one the target's new token),
then one row per step at position n − 1 + j, attending to every prefix key and the earlier drafted keys, the
greedy draft id mapped to a target id through d2t. Row n − 1 of TTT step j computes exactly this.

Top-k teacher targets (`teacher_topk`, `ttt_forward(..., teacher=...)`): the target's full logits (B, T, V)
do not scale (V = 128K at 8B), so a teacher may give per row only the top k of p~ (the softmax over the Vd
draft columns, SpecForge's target, then truncated to its k largest and renormalised over them) and a flag
whether the full-vocabulary argmax lies in the draft vocabulary (SpecForge's row weight). With k = Vd this is
exactly the full-logit loss; the GPU engine's teacher gives this form (docs/eagle3.md#the-gpu-engine).

What this file deliberately does not do: the target model (aux rows and logits are inputs), the files (`ddl_wgpu/files/eagle3file.py`, `ddl_wgpu/files/hf/eagle3.py`), training runs
(`ddl_wgpu/jobs/draft.py`), the GPU engine (`ddl_wgpu/engine/eagle3.py`, docs/eagle3.md#the-gpu-engine).

Shape legend: B batch, T window, H hidden, N q heads, K kv heads, D head_dim, F intermediate, V target vocab,
Vd draft vocab.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ddl_ref import ops
from ddl_ref.config import ConfigError

FC = "fc.weight"
IN_NORM = "midlayer.input_layernorm.weight"
HID_NORM = "midlayer.hidden_norm.weight"
Q_PROJ = "midlayer.self_attn.q_proj.weight"
K_PROJ = "midlayer.self_attn.k_proj.weight"
V_PROJ = "midlayer.self_attn.v_proj.weight"
O_PROJ = "midlayer.self_attn.o_proj.weight"
POST_NORM = "midlayer.post_attention_layernorm.weight"
GATE = "midlayer.mlp.gate_proj.weight"
UP = "midlayer.mlp.up_proj.weight"
DOWN = "midlayer.mlp.down_proj.weight"
NORM = "norm.weight"
HEAD = "lm_head.weight"


# ----------------------------------------------------------------------------------------------------------
# configuration


@dataclass(frozen=True)
class Eagle3Config:
    """An EAGLE-3 draft's shape and training settings (validated; docs/eagle3.md#the-config)."""

    hidden: int  # H, the draft's width (= the target's: the embedding is shared)
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int  # F, the SwiGLU width
    vocab: int  # V, the target's vocabulary
    draft_vocab: int  # Vd
    aux_layers: tuple[int, int, int]  # vLLM's ids: the residual stream at the INPUT of these target layers
    target_hidden_size: int | None = None  # None -> hidden; only equal widths are supported for now
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    ttt: int = 7  # unroll depth of training (SpecForge 7, speculators 3)
    step_weight: float = 0.8  # step i of the unroll weighs step_weight ** i
    norm_before_residual: bool = False  # the residual is the raw hidden (False) or hidden_norm of it (True)

    def __post_init__(self):
        for name in ("hidden", "n_heads", "n_kv_heads", "head_dim", "intermediate", "vocab", "draft_vocab",
                     "ttt"):  # fmt: skip
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 1:
                raise ConfigError(f"Eagle3Config.{name} must be a positive int, got {v!r}")
        if self.target_hidden_size is None:
            object.__setattr__(self, "target_hidden_size", self.hidden)
        if self.target_hidden_size != self.hidden:
            raise ConfigError(
                f"Eagle3Config.target_hidden_size {self.target_hidden_size} != hidden {self.hidden}: a draft "
                "narrower than its target needs its own embedding, which is not supported yet"
            )
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_heads {self.n_heads} must be a multiple of n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim {self.head_dim} must be even (RoPE rotates halves)")
        if self.draft_vocab > self.vocab:
            raise ConfigError(f"draft_vocab {self.draft_vocab} exceeds the target vocab {self.vocab}")
        aux = tuple(self.aux_layers)
        ints = all(not isinstance(j, bool) and isinstance(j, int | np.integer) for j in aux)
        if len(aux) != 3 or not ints or min(aux) < 1:
            raise ConfigError(f"aux_layers must be 3 target layer ids >= 1, got {self.aux_layers!r}")
        object.__setattr__(self, "aux_layers", tuple(int(j) for j in aux))
        for name in ("rope_theta", "rms_eps", "step_weight"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
                raise ConfigError(f"Eagle3Config.{name} must be a positive number, got {v!r}")
        if not isinstance(self.norm_before_residual, bool):
            raise ConfigError(f"norm_before_residual must be a bool, got {self.norm_before_residual!r}")


def default_aux_layers(n_layers: int) -> tuple[int, int, int]:
    """vLLM's `get_eagle3_aux_hidden_state_layers` (and SGLang's default): (2, L//2, L−3), the residual stream
    at the input of those target layers, i.e. after layers 1, L//2−1 and L−4 (HF `output_hidden_states`
    indices 2, L//2, L−3). SpecForge names the same rows by layer output: (1, L//2−1, L−4)."""
    L = int(n_layers)
    if L < 4:
        raise ConfigError(f"EAGLE-3 needs a target of at least 4 layers, got {L}")
    return (2, L // 2, L - 3)


def aux_hidden(stream, aux_layers) -> np.ndarray:
    """stream: a sequence where stream[j] (B, T, H) is the target's residual stream at the input of layer j
    (stream[0] the embedding output; HF `output_hidden_states[j]` for j < L) -> (B, T, 3H), in aux order."""
    return np.concatenate([np.asarray(stream[j]) for j in aux_layers], axis=-1)


def config_json(cfg: Eagle3Config, max_position_embeddings: int) -> dict:
    """The draft's config.json as vLLM and SGLang load it (docs/eagle3.md#configjson). The aux ids are written
    twice: top level with vLLM's meaning (input of layer j), and under `eagle_config` for SGLang, whose
    `set_eagle3_layers_to_capture` adds 1 to explicit ids (so it is given j − 1)."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": cfg.hidden,
        "target_hidden_size": cfg.target_hidden_size,
        "intermediate_size": cfg.intermediate,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "vocab_size": cfg.vocab,
        "draft_vocab_size": cfg.draft_vocab,
        "rms_norm_eps": cfg.rms_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": int(max_position_embeddings),
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "norm_before_residual": cfg.norm_before_residual,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layers),
        "eagle_config": {
            "use_aux_hidden_state": True,
            "eagle_aux_hidden_state_layer_ids": [j - 1 for j in cfg.aux_layers],
        },
    }


# ----------------------------------------------------------------------------------------------------------
# parameters


def eagle3_params(cfg: Eagle3Config) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, init), Hugging Face names as vLLM/SGLang load them. Init as a fresh SpecForge draft:
    norms 1, every linear nn.Linear's default U(−1/√fan_in, 1/√fan_in) ("uniform:A")."""
    H, F, Vd = cfg.hidden, cfg.intermediate, cfg.draft_vocab
    qo, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim

    def lin(out, inp):
        return (out, inp), f"uniform:{1.0 / math.sqrt(inp)!r}"

    return {
        FC: lin(H, 3 * cfg.target_hidden_size),
        IN_NORM: ((H,), "ones"),
        HID_NORM: ((H,), "ones"),
        Q_PROJ: lin(qo, 2 * H),
        K_PROJ: lin(kv, 2 * H),
        V_PROJ: lin(kv, 2 * H),
        O_PROJ: lin(H, qo),
        POST_NORM: ((H,), "ones"),
        GATE: lin(F, H),
        UP: lin(F, H),
        DOWN: lin(H, F),
        NORM: ((H,), "ones"),
        HEAD: lin(Vd, H),
    }


def init_eagle3(cfg: Eagle3Config, seed: int, dtype=np.float32) -> dict[str, np.ndarray]:
    """Fresh parameters from one seeded generator in table order (drawn in float64, then cast)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, (shape, init) in eagle3_params(cfg).items():
        if init == "ones":
            out[name] = np.ones(shape, dtype=dtype)
        else:
            a = float(init.split(":", 1)[1])
            out[name] = rng.uniform(-a, a, size=shape).astype(dtype)
    return out


def head_from_target(target_head, d2t) -> np.ndarray:
    """The target's head rows of the draft vocabulary (Vd, H): the speculators trainer's lm_head init."""
    d2t = np.asarray(d2t, np.int64)
    return np.asarray(target_head)[np.arange(d2t.size) + d2t].copy()


# ----------------------------------------------------------------------------------------------------------
# draft vocabulary


def token_counts(ids, mask, vocab: int) -> np.ndarray:
    """(V,) int64: how often each token occurs where mask == 1 (SpecForge counts under its loss mask)."""
    ids = np.asarray(ids).reshape(-1)
    keep = np.asarray(mask).reshape(-1) == 1
    return np.bincount(ids[keep].astype(np.int64), minlength=vocab)[:vocab].astype(np.int64)


def draft_vocab(counts, Vd: int) -> tuple[np.ndarray, np.ndarray]:
    """counts (V,) -> (d2t int64 (Vd,), t2d bool (V,)), SpecForge's `process_token_dict_to_mappings`.

    The Vd most frequent tokens of count > 0, ties to the smaller id; when fewer than Vd tokens occur, the
    lowest unused ids below Vd fill up (count 0). The chosen ids sorted ascending are the draft ids 0..Vd−1:
    target id of draft id d = d + d2t[d]; t2d marks the chosen target ids. No token is forced in.
    """
    counts = np.asarray(counts)
    if counts.ndim != 1 or np.any(counts < 0):
        raise ValueError("counts must be a 1-D array of non-negative counts")
    V = counts.size
    if not 1 <= Vd <= V:
        raise ValueError(f"draft vocabulary size {Vd} must be in [1, {V}]")
    seen = np.flatnonzero(counts > 0)
    order = seen[np.lexsort((seen, -counts[seen]))]  # by count descending, then id ascending
    chosen = list(order[:Vd])
    if len(chosen) < Vd:
        have = set(chosen)
        chosen += [t for t in range(Vd) if t not in have][: Vd - len(chosen)]
    used = np.sort(np.asarray(chosen, np.int64))
    d2t = used - np.arange(Vd, dtype=np.int64)
    t2d = np.zeros(V, dtype=bool)
    t2d[used] = True
    return d2t, t2d


def target_ids(d2t) -> np.ndarray:
    """(Vd,) int64: the target id of each draft id."""
    d2t = np.asarray(d2t, np.int64)
    return np.arange(d2t.size, dtype=np.int64) + d2t


def check_vocab_map(cfg: Eagle3Config, d2t, t2d) -> None:
    """d2t and t2d describe the same Vd target ids, ascending (as `draft_vocab` builds them)."""
    d2t, t2d = np.asarray(d2t), np.asarray(t2d)
    if d2t.shape != (cfg.draft_vocab,) or t2d.shape != (cfg.vocab,) or t2d.dtype != bool:
        raise ValueError(f"d2t must be ({cfg.draft_vocab},) and t2d bool ({cfg.vocab},)")
    tid = target_ids(d2t)
    if np.any(tid < 0) or np.any(tid >= cfg.vocab) or np.any(np.diff(tid) <= 0):
        raise ValueError("d2t must map the draft ids to ascending target ids inside the vocabulary")
    if not np.array_equal(np.flatnonzero(t2d), tid):
        raise ValueError("t2d must mark exactly the target ids d2t maps to")


# ----------------------------------------------------------------------------------------------------------
# the TTT attention layout


def ttt_mask(ttt: int, T: int, shifted: bool = False) -> np.ndarray:
    """(ttt·T, ttt·T) bool [query, key] over the stacked rows r = i·T + p of steps i = 0..ttt−1: key (j, p')
    is visible to query (i, p) iff (j == 0 and p' <= p) or (1 <= j <= i and p' == p). This is SpecForge's
    layout since its PR 244 (`generate_eagle3_mask`; the sdpa path's causal keys + per-step dot products), and
    the layout of inference (`propose`). shifted=True: the older layout (SafeAILab/EAGLE's trainer, SpecForge
    before PR 244), whose step-0 window shrinks by one row per step: (j == 0 and p' <= p − i)."""
    base = ops.chain_mask(ttt, T)
    if not shifted:
        return base
    i, p = np.divmod(np.arange(ttt * T), T)
    step0 = (i[None, :] == 0) & (p[None, :] <= (p - i)[:, None])
    return np.where(i[None, :] == 0, step0, base)


def ttt_positions(i: int, T: int) -> np.ndarray:
    """(T,) int64: the RoPE positions p + i of step i's queries and keys (SpecForge's `position_ids + lck`)."""
    return np.arange(T, dtype=np.int64) + int(i)


# ----------------------------------------------------------------------------------------------------------
# one draft step


def _attend_forward(q, k_all, v_all, mask):
    """q (B, T, N, D) against k_all/v_all (B, Tp+T, K, D) under mask (T, Tp+T) -> (out (B, T, N, D), cache).

    Computed with the square `ops.attention_masked_forward` over Tp+T rows: the Tp rows in front are zero
    queries that see their own key (their output is dropped and gets no gradient)."""
    B, T, N, D = q.shape
    Tk = k_all.shape[1]
    Tp = Tk - T
    qf = np.concatenate([np.zeros((B, Tp, N, D), q.dtype), q], axis=1)
    full = np.zeros((Tk, Tk), dtype=bool)
    full[:Tp, :Tp] = np.eye(Tp, dtype=bool)
    full[Tp:] = mask
    out, c = ops.attention_masked_forward(qf, k_all, v_all, full)
    return out[:, Tp:], (c, Tp)


def _attend_backward(dout, cache):
    """-> (dq (B, T, N, D), dk_all, dv_all (B, Tp+T, K, D))."""
    c, Tp = cache
    B, T, N, D = dout.shape
    dfull = np.concatenate([np.zeros((B, Tp, N, D), dout.dtype), dout], axis=1)
    dq, dk, dv = ops.attention_masked_backward(dfull, c)
    return dq[:, Tp:], dk, dv


def step_forward(params: dict, cfg: Eagle3Config, emb, hidden, positions, mask, past=None):
    """One draft step over B×T rows.

    emb (B, T, H) token embeddings, hidden (B, T, H) (fc output or the previous step's `pre`), positions (T,)
    RoPE positions, mask (T, Tp + T) bool [query, key] over the keys [past ; this step's], past None or
    (k, v) each (B, Tp, K, D), already rotated. -> (post (B, T, H), pre (B, T, H), (k, v) this step's rotated
    keys and values (B, T, K, D), cache).
    """
    emb = np.asarray(emb)
    hidden = np.asarray(hidden, emb.dtype)
    B, T, H = hidden.shape
    N, K, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    eps = cfg.rms_eps
    en, c_en = ops.rmsnorm_forward(emb, params[IN_NORM], eps)
    hn, c_hn = ops.rmsnorm_forward(hidden, params[HID_NORM], eps)
    x = np.concatenate([en, hn], axis=-1)  # (B, T, 2H): the embedding first
    cos, sin = ops.rope_tables_at(positions, D, cfg.rope_theta, emb.dtype)
    q = ops.rope_forward(ops.linear_forward(x, params[Q_PROJ]).reshape(B, T, N, D), cos, sin)
    k = ops.rope_forward(ops.linear_forward(x, params[K_PROJ]).reshape(B, T, K, D), cos, sin)
    v = ops.linear_forward(x, params[V_PROJ]).reshape(B, T, K, D)
    k_all = k if past is None else np.concatenate([past[0], k], axis=1)
    v_all = v if past is None else np.concatenate([past[1], v], axis=1)
    if np.shape(mask) != (T, k_all.shape[1]):
        raise ValueError(f"mask must be ({T}, {k_all.shape[1]}), got {np.shape(mask)}")
    att, c_att = _attend_forward(q, k_all, v_all, np.asarray(mask, bool))
    att = att.reshape(B, T, N * D)
    a = ops.linear_forward(att, params[O_PROJ])
    r = (hn if cfg.norm_before_residual else hidden) + a
    n2, c_post = ops.rmsnorm_forward(r, params[POST_NORM], eps)
    g = ops.linear_forward(n2, params[GATE])
    u = ops.linear_forward(n2, params[UP])
    s = ops.swiglu_forward(g, u)
    pre = r + ops.linear_forward(s, params[DOWN])
    post, c_norm = ops.rmsnorm_forward(pre, params[NORM], eps)
    cache = dict(c_en=c_en, c_hn=c_hn, x=x, cos=cos, sin=sin, c_att=c_att, att=att, c_post=c_post, n2=n2, g=g,
                 u=u, s=s, c_norm=c_norm, Tp=k_all.shape[1] - T)  # fmt: skip
    return post, pre, (k, v), cache


def step_backward(params: dict, cfg: Eagle3Config, cache, dpost, dpre=None, dk=None, dv=None):
    """Gradients of a step's outputs -> (demb, dhidden, (dk_past, dv_past), grads {name: array}).

    dpost/dpre (B, T, H) w.r.t. `post` and `pre`; dk/dv (B, T, K, D) w.r.t. this step's returned (rotated)
    keys and values, as later steps used them. dk_past/dv_past (B, Tp, K, D) are w.r.t. `past`, None when
    there was none. grads holds every step tensor except fc and lm_head.
    """
    c = cache
    B, T, _ = dpost.shape
    N, K, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    grads = {}
    dr, grads[NORM] = ops.rmsnorm_backward(dpost, c["c_norm"])
    if dpre is not None:
        dr = dr + dpre
    ds, grads[DOWN] = ops.linear_backward(dr, c["s"], params[DOWN])
    dg, du = ops.swiglu_backward(ds, c["g"], c["u"])
    dn2, grads[GATE] = ops.linear_backward(dg, c["n2"], params[GATE])
    dn2u, grads[UP] = ops.linear_backward(du, c["n2"], params[UP])
    dr_post, grads[POST_NORM] = ops.rmsnorm_backward(dn2 + dn2u, c["c_post"])
    dr = dr + dr_post  # the gradient of r = resid + a, for both terms
    datt, grads[O_PROJ] = ops.linear_backward(dr, c["att"], params[O_PROJ])
    dq, dk_all, dv_all = _attend_backward(datt.reshape(B, T, N, D), c["c_att"])
    Tp = c["Tp"]
    dk_own, dv_own = dk_all[:, Tp:], dv_all[:, Tp:]
    if dk is not None:
        dk_own = dk_own + dk
    if dv is not None:
        dv_own = dv_own + dv
    dq = ops.rope_backward(dq, c["cos"], c["sin"]).reshape(B, T, N * D)
    dk_own = ops.rope_backward(dk_own, c["cos"], c["sin"]).reshape(B, T, K * D)
    dx, grads[Q_PROJ] = ops.linear_backward(dq, c["x"], params[Q_PROJ])
    dxk, grads[K_PROJ] = ops.linear_backward(dk_own, c["x"], params[K_PROJ])
    dxv, grads[V_PROJ] = ops.linear_backward(dv_own.reshape(B, T, K * D), c["x"], params[V_PROJ])
    dx = dx + dxk + dxv
    H = dx.shape[-1] // 2
    den, dhn = dx[..., :H], dx[..., H:]
    if cfg.norm_before_residual:
        dhn = dhn + dr
    dhidden, grads[HID_NORM] = ops.rmsnorm_backward(dhn, c["c_hn"])
    if not cfg.norm_before_residual:
        dhidden = dhidden + dr
    demb, grads[IN_NORM] = ops.rmsnorm_backward(den, c["c_en"])
    past = (dk_all[:, :Tp], dv_all[:, :Tp]) if Tp else (None, None)
    return demb, dhidden, past, grads


# ----------------------------------------------------------------------------------------------------------
# the unrolled training loss


def _ahead(a, j: int, fill=0):
    """a (B, T, ...) -> out[:, p] = a[:, p + j] for p < T − j, `fill` after."""
    out = np.full_like(a, fill)
    if j < a.shape[1]:
        out[:, : a.shape[1] - j] = a[:, j:]
    return out


def loss_mask_from_lengths(lengths, T: int) -> np.ndarray:
    """(B, T) 0/1: p < length − 1 (row p's step-0 target, position p + 1, is a real token)."""
    return (np.arange(T)[None, :] < np.asarray(lengths).reshape(-1, 1) - 1).astype(np.int64)


def teacher_topk(target_logits, d2t, t2d, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The top-k teacher of a target's logits (B, T, V) -> (ids (B, T, k) int64 DRAFT ids, probs (B, T, k)
    float32, in_draft (B, T) bool).

    probs are p~ = softmax(z[target_ids(d2t)]) over the Vd draft columns (SpecForge's target p), its k largest
    in descending order (ties to the lower draft id), not renormalised after the cut (`dense_teacher` and the
    loss renormalise over the k). in_draft: the full-vocabulary argmax (ties to the lower id) is a draft
    token, i.e. equals the target id of the draft top-1 (how the GPU teacher computes it)."""
    z = np.asarray(target_logits, np.float64)
    Vd = np.asarray(d2t).size
    if not 1 <= int(k) <= Vd:
        raise ValueError(f"teacher top-k width {k} must be in [1, {Vd}]")
    zd = z[..., target_ids(d2t)]
    p = ops.softmax(zd, axis=-1)
    order = np.argsort(-zd, axis=-1, kind="stable")[..., : int(k)]  # descending, ties to the lower id
    probs = np.take_along_axis(p, order, axis=-1)
    in_draft = np.asarray(t2d)[np.argmax(z, axis=-1)]
    return order.astype(np.int64), probs.astype(np.float32), in_draft.astype(bool)


def dense_teacher(ids, probs, Vd: int) -> np.ndarray:
    """A top-k teacher as dense targets (B, T, Vd): probs renormalised over the k ids (a row without mass
    stays zero: `ops.topk_kl_forward`'s p~), zero elsewhere."""
    ids = np.asarray(ids, np.int64)
    probs = np.asarray(probs, np.float64)
    psum = probs.sum(axis=-1, keepdims=True)
    pn = np.divide(probs, psum, out=np.zeros_like(probs), where=psum > 0)
    out = np.zeros((*ids.shape[:-1], int(Vd)))
    np.put_along_axis(out, ids, pn, axis=-1)
    return out


def ttt_forward(params: dict, cfg: Eagle3Config, aux, ids, embed, target_logits, d2t, t2d, lengths=None,
                loss_mask=None, kl: bool = False, teacher=None):  # fmt: skip
    """The unrolled TTT loss of SpecForge (module docstring) -> (loss, cache).

    aux (B, T, 3H) the target's aux rows, ids (B, T) the tokens, embed (V, H) the target's embedding (frozen),
    target_logits (B, T, V) the target's logits (row p predicts x_{p+1}), d2t/t2d the draft vocabulary.
    loss_mask (B, T) 0/1, or from `lengths` (`loss_mask_from_lengths`; default: all rows T long).
    teacher: instead of target_logits (then None), a top-k teacher (ids, probs, in_draft) as `teacher_topk`
    gives it: the targets are its probs renormalised over the k ids, the row weights its in_draft flags.
    """
    ids = np.asarray(ids)
    B, T = ids.shape
    dtype = params[FC].dtype
    check_vocab_map(cfg, d2t, t2d)
    if loss_mask is None:
        loss_mask = loss_mask_from_lengths(np.full(B, T) if lengths is None else lengths, T)
    loss_mask = np.asarray(loss_mask).reshape(B, T)
    if teacher is None:
        z = np.asarray(target_logits, np.float64)
        cols = target_ids(d2t)
        # the targets of row r: the target model at position r + 1, over the draft vocabulary, renormalised
        z_next = _ahead(z, 1)  # zero logits past the window (SpecForge's right padding)
        p_tgt = ops.softmax(z_next[..., cols], axis=-1).astype(dtype)  # (B, T, Vd)
        in_next = np.asarray(t2d)[np.argmax(z_next, axis=-1)]
    else:  # the same at the teacher's top-k (rows past the window: no mass, weight 0)
        t_ids, t_probs, in_draft = teacher
        p_tgt = _ahead(dense_teacher(t_ids, t_probs, cfg.draft_vocab), 1).astype(dtype)
        in_next = _ahead(np.asarray(in_draft, bool), 1, fill=False)
    keep = in_next & (loss_mask == 1)  # (B, T): step-0 weights
    aux = np.asarray(aux, dtype)
    hid = ops.linear_forward(aux, params[FC])  # (B, T, H)
    mask = ttt_mask(cfg.ttt, T)
    embed = np.asarray(embed, dtype)
    steps, past, kv = [], None, []
    loss, losses = 0.0, []
    scale = 1.0 / (B * T)
    for i in range(cfg.ttt):
        tok = _ahead(ids, i + 1)
        emb = ops.embedding_forward(tok, embed)
        m_i = mask[i * T : (i + 1) * T, : (i + 1) * T]
        post, pre, (k, v), c = step_forward(params, cfg, emb, hid, ttt_positions(i, T), m_i, past)
        logits = ops.linear_forward(post, params[HEAD])  # (B, T, Vd)
        w = _ahead(keep, i, fill=False).astype(dtype)  # (B, T)
        pt = _ahead(p_tgt, i)
        logq = logits - ops.logsumexp(logits, axis=-1, keepdims=True)
        ce = -np.sum(pt * logq, axis=-1)  # (B, T)
        if kl:
            ce = ce + np.sum(np.where(pt > 0, pt * np.log(np.where(pt > 0, pt, 1.0)), 0.0), axis=-1)
        loss_i = float(np.sum(w * ce)) * scale
        losses.append(loss_i)
        loss += cfg.step_weight**i * loss_i
        steps.append(dict(c=c, post=post, logits=logits, w=w, pt=pt))
        kv.append((k, v))
        past = (np.concatenate([a for a, _ in kv], axis=1), np.concatenate([b for _, b in kv], axis=1))
        hid = pre
    cache = dict(steps=steps, aux=aux, shape=(B, T), step_losses=losses, loss_mask=loss_mask)
    return loss, cache


def ttt_backward(params: dict, cfg: Eagle3Config, cache, dloss: float = 1.0) -> dict[str, np.ndarray]:
    """Gradients of dloss · loss for every draft tensor (table order). The embedding and the aux rows are the
    target's and get none. Steps run in reverse: step i's keys and values collect the gradients of every later
    step that attended to them before step i's own backward consumes them."""
    B, T = cache["shape"]
    steps = cache["steps"]
    scale = float(dloss) / (B * T)
    grads = {name: np.zeros_like(v) for name, v in params.items()}
    dk = [None] * len(steps)
    dv = [None] * len(steps)
    dnext = None  # gradient w.r.t. step i's `pre` from step i+1's hidden input
    for i in reversed(range(len(steps))):
        s = steps[i]
        q = ops.softmax(s["logits"], axis=-1)
        mass = np.sum(s["pt"], axis=-1, keepdims=True)  # 1 (0 only where p~ is all zeros)
        dlogits = (q * mass - s["pt"]) * (s["w"][..., None] * scale * cfg.step_weight**i)
        dpost, dhead = ops.linear_backward(dlogits, s["post"], params[HEAD])
        grads[HEAD] += dhead
        _demb, dhid, (dkp, dvp), g = step_backward(params, cfg, s["c"], dpost, dnext, dk[i], dv[i])
        for name, val in g.items():
            grads[name] += val
        for j in range(i):  # the past keys are steps 0..i-1, T rows each
            sl = slice(j * T, (j + 1) * T)
            dk[j] = dkp[:, sl] if dk[j] is None else dk[j] + dkp[:, sl]
            dv[j] = dvp[:, sl] if dv[j] is None else dv[j] + dvp[:, sl]
        dnext = dhid
    _daux, grads[FC] = ops.linear_backward(dnext, cache["aux"], params[FC])
    return grads


# ----------------------------------------------------------------------------------------------------------
# drafting


def propose(params: dict, cfg: Eagle3Config, embed, aux, ids, next_token: int, d2t, k: int):
    """Greedy drafting of k tokens after a prefix, as vLLM's EAGLE proposer runs the draft.

    aux (n, 3H) the target's aux rows of the prefix positions 0..n−1, ids (n,) the prefix tokens, next_token
    the target's token at position n. Step 0 runs over the n rows (row p: token x_{p+1}, the last row
    next_token, position p, causal); step j >= 1 runs one row: the previous draft token, the previous step's
    `pre` at the last row, position n − 1 + j, attending to all prefix keys and the earlier drafted keys.
    -> (target ids (k,), draft ids (k,), draft logits (k, Vd)).
    """
    dtype = params[FC].dtype
    ids = np.asarray(ids).reshape(-1)
    n = ids.size
    embed = np.asarray(embed, dtype)
    tok = np.append(ids[1:], int(next_token))[None, :]
    hid = ops.linear_forward(np.asarray(aux, dtype).reshape(1, n, -1), params[FC])
    causal = np.tril(np.ones((n, n), dtype=bool))
    post, pre, (kk, vv), _ = step_forward(params, cfg, embed[tok], hid, np.arange(n), causal)
    tids, dids, logits_out = [], [], []
    tmap = target_ids(d2t)
    for j in range(k):
        logits = ops.linear_forward(post[:, -1], params[HEAD])[0]  # (Vd,)
        d = int(np.argmax(logits))
        dids.append(d)
        tids.append(int(tmap[d]))
        logits_out.append(logits)
        if j == k - 1:
            break
        past = (kk, vv)
        visible = np.zeros((1, kk.shape[1] + 1), dtype=bool)
        visible[0, :n] = True  # every prefix row's step-0 key
        visible[0, n:] = True  # the drafted chain so far, and this row's own key
        post, pre, (k1, v1), _ = step_forward(params, cfg, embed[[[tids[-1]]]], pre[:, -1:],
                                              np.array([n - 1 + j + 1]), visible, past)  # fmt: skip
        kk = np.concatenate([kk, k1], axis=1)
        vv = np.concatenate([vv, v1], axis=1)
    return np.asarray(tids, np.int64), np.asarray(dids, np.int64), np.stack(logits_out)


def ttt_greedy(params: dict, cfg: Eagle3Config, aux, ids, embed, d2t, depth: int) -> np.ndarray:
    """Greedy drafting at every row at once, the layout of `ttt_forward` with the draft's own tokens:
    aux (B, T, 3H), ids (B, T) -> (B, depth, T) target ids. Row p of step 0 reads x_{p+1} and fc(aux_p) and
    drafts the token at p + 2; step i >= 1 reads step i−1's drafted id at row p, its `pre`, at position p + i,
    attending as `ttt_mask`. Row n − 1 of step i is `propose`'s (i+1)-th token after the prefix x_0..x_{n−1}
    with next token x_n (accept's measure, as `ddl_wgpu.jobs.accept` measures an MTP draft)."""
    dtype = params[FC].dtype
    ids = np.asarray(ids)
    B, T = ids.shape
    embed = np.asarray(embed, dtype)
    tmap = target_ids(d2t)
    hid = ops.linear_forward(np.asarray(aux, dtype), params[FC])
    mask = ttt_mask(depth, T)
    tok = _ahead(ids, 1)
    past, kv, out = None, [], []
    for i in range(depth):
        m_i = mask[i * T : (i + 1) * T, : (i + 1) * T]
        post, pre, (k, v), _ = step_forward(params, cfg, embed[tok], hid, ttt_positions(i, T), m_i, past)
        tok = tmap[np.argmax(ops.linear_forward(post, params[HEAD]), axis=-1)]
        out.append(tok)
        kv.append((k, v))
        past = (np.concatenate([a for a, _ in kv], axis=1), np.concatenate([b for _, b in kv], axis=1))
        hid = pre
    return np.stack(out, axis=1)
