"""Tests of the reference EAGLE-3 draft (`ddl_ref.eagle3`, docs/eagle3.md).

Finite differences in float64 for one draft step (every input, past keys and values included, and every step
tensor) and for the whole unrolled TTT loss against every draft tensor, under both residual conventions; one
step re-implemented independently as vLLM's `llama_eagle3.py` runs it (per-token loops) against `step_forward`;
the TTT mask against hand-written ones; the TTT loss against a per-row loop of SpecForge's formula; training
against inference (row n-1 of TTT step j is what `propose` drafts); the draft vocabulary's ranking, ties and
fill-up; the config, parameter table and config.json.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from ddl_ref import eagle3 as e3
from ddl_ref.check import assert_fd_grad, fakeloss
from ddl_ref.config import ConfigError


def tiny(**kw) -> e3.Eagle3Config:
    base = dict(hidden=8, n_heads=2, n_kv_heads=1, head_dim=4, intermediate=12, vocab=24, draft_vocab=12,
                aux_layers=(2, 3, 4), ttt=3, rope_theta=50.0)  # fmt: skip
    base.update(kw)
    return e3.Eagle3Config(**base)


def random_params(cfg, seed=0):
    """float64 values with signal everywhere (norm weights around 1, not exactly 1)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, (shape, init) in e3.eagle3_params(cfg).items():
        base = 1.0 if init == "ones" else 0.0
        out[name] = base + rng.standard_normal(shape) * 0.5
    return out


def ttt_data(cfg, B=2, T=6, seed=1):
    """aux, ids, embed, target logits, d2t, t2d, lengths, with some target argmax outside the draft vocab."""
    rng = np.random.default_rng(seed)
    V, H = cfg.vocab, cfg.hidden
    aux = rng.standard_normal((B, T, 3 * H))
    ids = rng.integers(0, V, size=(B, T))
    embed = rng.standard_normal((V, H))
    z = rng.standard_normal((B, T, V)) * 2.0
    counts = rng.integers(0, 50, size=V)
    d2t, t2d = e3.draft_vocab(counts, cfg.draft_vocab)
    outside = np.flatnonzero(~t2d)
    z[0, 2, outside[0]] = 20.0  # argmax outside the draft vocabulary: that row is dropped
    z[0, 1, np.flatnonzero(t2d)[0]] = 20.0  # and inside it: that row counts
    lengths = np.array([T, T - 2])
    return aux, ids, embed, z, d2t, t2d, lengths


# ----------------------------------------------------------------------------------------------------------
# config, table, config.json


def test_config_validates():
    cfg = tiny()
    assert cfg.target_hidden_size == cfg.hidden and cfg.aux_layers == (2, 3, 4)
    assert not cfg.norm_before_residual and cfg.step_weight == 0.8
    bad = [dict(n_heads=3, n_kv_heads=2), dict(head_dim=5), dict(draft_vocab=25), dict(aux_layers=(0, 2, 3)),
           dict(aux_layers=(1, 2)), dict(target_hidden_size=16), dict(ttt=0), dict(step_weight=0.0),
           dict(rms_eps=-1.0), dict(hidden=True), dict(norm_before_residual=1)]  # fmt: skip
    for kw in bad:
        with pytest.raises(ConfigError):
            tiny(**kw)


def test_default_aux_layers():
    # vLLM: the input of layers 2, L//2, L-3 = the outputs of layers 1, L//2-1, L-4
    assert e3.default_aux_layers(32) == (2, 16, 29)
    assert e3.default_aux_layers(28) == (2, 14, 25)
    with pytest.raises(ConfigError):
        e3.default_aux_layers(3)


def test_aux_hidden_picks_layer_inputs():
    stream = [np.full((1, 2, 3), float(j)) for j in range(6)]  # stream[j]: the input of layer j
    out = e3.aux_hidden(stream, (2, 3, 5))
    assert out.shape == (1, 2, 9)
    assert np.array_equal(out[0, 0], [2, 2, 2, 3, 3, 3, 5, 5, 5])


def test_param_table_names_and_shapes():
    cfg = tiny(intermediate=10)
    table = e3.eagle3_params(cfg)
    assert list(table) == [
        "fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
        "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
        "midlayer.self_attn.o_proj.weight", "midlayer.post_attention_layernorm.weight",
        "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
        "norm.weight", "lm_head.weight",
    ]  # fmt: skip
    shapes = {k: s for k, (s, _) in table.items()}
    assert shapes["fc.weight"] == (8, 24)
    assert shapes["midlayer.self_attn.q_proj.weight"] == (8, 16)  # (N*D, 2H)
    assert shapes["midlayer.self_attn.k_proj.weight"] == (4, 16)
    assert shapes["midlayer.self_attn.o_proj.weight"] == (8, 8)
    assert shapes["midlayer.mlp.down_proj.weight"] == (8, 10)
    assert shapes["lm_head.weight"] == (12, 8)
    assert table["fc.weight"][1] == f"uniform:{1 / math.sqrt(24)!r}"
    p = e3.init_eagle3(cfg, 0)
    assert all(p[k].shape == s for k, s in shapes.items())
    assert np.all(p["norm.weight"] == 1.0) and np.abs(p["fc.weight"]).max() <= 1 / math.sqrt(24)
    assert np.array_equal(e3.init_eagle3(cfg, 0)["lm_head.weight"], p["lm_head.weight"])


def test_config_json():
    cfg = tiny(aux_layers=(2, 16, 29))
    j = e3.config_json(cfg, max_position_embeddings=4096)
    assert j["architectures"] == ["LlamaForCausalLMEagle3"] and j["model_type"] == "llama"
    assert j["num_hidden_layers"] == 1 and j["draft_vocab_size"] == 12 and j["vocab_size"] == 24
    assert j["target_hidden_size"] == 8 and j["norm_before_residual"] is False
    assert j["tie_word_embeddings"] is False  # SGLang ties lm_head to the embedding otherwise
    assert j["eagle_aux_hidden_state_layer_ids"] == [2, 16, 29]  # vLLM: used as given
    assert j["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 15, 28]  # SGLang adds 1


# ----------------------------------------------------------------------------------------------------------
# draft vocabulary


def test_draft_vocab_ranks_and_breaks_ties_by_id():
    counts = np.array([5, 3, 3, 0, 7, 3, 1, 0])
    d2t, t2d = e3.draft_vocab(counts, 4)
    # 4 (7), 0 (5), then the count-3 tie {1, 2, 5}: the smaller ids 1 and 2
    assert np.array_equal(e3.target_ids(d2t), [0, 1, 2, 4])
    assert np.array_equal(d2t, [0, 0, 0, 1]) and d2t.dtype == np.int64
    assert np.array_equal(np.flatnonzero(t2d), [0, 1, 2, 4]) and t2d.dtype == bool


def test_draft_vocab_fills_with_lowest_unused_ids():
    counts = np.array([0, 0, 9, 0, 0, 0, 4, 0])
    d2t, t2d = e3.draft_vocab(counts, 4)
    assert np.array_equal(e3.target_ids(d2t), [0, 1, 2, 6])  # 2 and 6 occur; 0 and 1 fill up
    assert np.array_equal(d2t, [0, 0, 0, 3])


@pytest.mark.parametrize("seed", range(5))
def test_draft_vocab_is_consistent(seed):
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 6, size=40)
    cfg = tiny(vocab=40, draft_vocab=15)
    d2t, t2d = e3.draft_vocab(counts, 15)
    e3.check_vocab_map(cfg, d2t, t2d)
    assert t2d.sum() == 15 and np.all(np.diff(e3.target_ids(d2t)) > 0)
    # every chosen token is at least as frequent as every left-out one
    assert counts[t2d].min() >= counts[~t2d].max()


def test_check_vocab_map_rejects_inconsistent_maps():
    cfg = tiny()
    d2t, t2d = e3.draft_vocab(np.arange(24), 12)
    bad = t2d.copy()
    bad[np.flatnonzero(~t2d)[0]] = True
    bad[np.flatnonzero(t2d)[0]] = False
    with pytest.raises(ValueError):
        e3.check_vocab_map(cfg, d2t, bad)
    with pytest.raises(ValueError):
        e3.check_vocab_map(cfg, d2t[::-1] * 0, t2d)


def test_token_counts_under_mask():
    ids = np.array([[1, 2, 2, 3], [2, 0, 0, 3]])
    mask = np.array([[0, 1, 1, 1], [1, 1, 0, 0]])
    assert np.array_equal(e3.token_counts(ids, mask, 5), [1, 0, 3, 1, 0])


def test_head_from_target_takes_the_draft_rows():
    head = np.arange(24 * 2, dtype=float).reshape(24, 2)
    d2t, _ = e3.draft_vocab(np.array([0, 5, 0, 5] + [0] * 20), 2)
    assert np.array_equal(e3.head_from_target(head, d2t), head[[1, 3]])


# ----------------------------------------------------------------------------------------------------------
# the TTT mask and positions


def _rows(text):
    return np.array([[c == "1" for c in row.replace(" ", "")] for row in text], dtype=bool)


def test_ttt_mask_is_specforges():
    # rows (step i, row p), columns (step j, row p'), ttt=3, T=3: step-0 keys causal, steps 1..i on the diagonal
    want = _rows(["100 000 000", "110 000 000", "111 000 000",
                  "100 100 000", "110 010 000", "111 001 000",
                  "100 100 100", "110 010 010", "111 001 001"])  # fmt: skip
    assert np.array_equal(e3.ttt_mask(3, 3), want)


def test_ttt_mask_shifted_is_the_pre_pr244_layout():
    want = _rows(["100 000 000", "110 000 000", "111 000 000",
                  "000 100 000", "100 010 000", "110 001 000",
                  "000 100 100", "000 010 010", "100 001 001"])  # fmt: skip
    assert np.array_equal(e3.ttt_mask(3, 3, shifted=True), want)


def test_ttt_positions():
    assert np.array_equal(e3.ttt_positions(0, 4), [0, 1, 2, 3])
    assert np.array_equal(e3.ttt_positions(2, 4), [2, 3, 4, 5])


def test_ttt_rows_see_only_their_past():
    """Changing the aux row p' changes the logits of every step at rows >= p' and nowhere before."""
    cfg = tiny()
    p = random_params(cfg)
    aux, ids, embed, z, d2t, t2d, lengths = ttt_data(cfg)
    _, c0 = e3.ttt_forward(p, cfg, aux, ids, embed, z, d2t, t2d, lengths)
    aux2 = aux.copy()
    aux2[:, 3] += 1.0
    _, c1 = e3.ttt_forward(p, cfg, aux2, ids, embed, z, d2t, t2d, lengths)
    for s0, s1 in zip(c0["steps"], c1["steps"], strict=True):
        diff = np.abs(s0["logits"] - s1["logits"]).max(axis=(0, 2))
        assert np.all(diff[:3] == 0) and np.all(diff[3:] > 1e-6)


# ----------------------------------------------------------------------------------------------------------
# one step, as vLLM runs it


def vllm_step(params, cfg, embed, input_ids, positions, hidden, d2t, emb_first=True):
    """One EAGLE-3 draft step written from vLLM's `llama_eagle3.py` (LlamaModel.forward, the layer_idx 0
    decoder layer, Eagle3LlamaForCausalLM.compute_logits), token by token: hidden (T, 3H) is combined by fc,
    input_layernorm(embeds) and hidden_norm(hidden) are concatenated (embeds first), the residual is the raw
    hidden (or the normed one with norm_before_residual), causal attention with RoPE at `positions`,
    post_attention_layernorm's fused add, SwiGLU, the final norm's fused add, lm_head over the draft vocab
    scattered into the target vocab at i + d2t[i] (-inf elsewhere). -> (normed (T, H), prenorm (T, H),
    target logits (T, V))."""
    H, N, K, D, eps = cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.rms_eps
    W = params

    def rms(x, w):
        return w * (x / math.sqrt(sum(xi * xi for xi in x) / len(x) + eps))

    def rope(vec, pos):
        half = D // 2
        out = np.empty(D)
        for i in range(half):
            ang = pos * cfg.rope_theta ** (-2.0 * i / D)
            out[i] = vec[i] * math.cos(ang) - vec[i + half] * math.sin(ang)
            out[i + half] = vec[i + half] * math.cos(ang) + vec[i] * math.sin(ang)
        return out

    T = len(input_ids)
    h = [W["fc.weight"] @ hidden[t] if hidden.shape[-1] != H else hidden[t] for t in range(T)]
    qs, ks, vs, resid = [], [], [], []
    for t in range(T):
        e = rms(embed[input_ids[t]], W["midlayer.input_layernorm.weight"])
        hn = rms(h[t], W["midlayer.hidden_norm.weight"])
        resid.append(hn if cfg.norm_before_residual else h[t])
        x = np.concatenate([e, hn] if emb_first else [hn, e])
        q = W["midlayer.self_attn.q_proj.weight"] @ x
        k = W["midlayer.self_attn.k_proj.weight"] @ x
        v = W["midlayer.self_attn.v_proj.weight"] @ x
        qs.append([rope(q[n * D : (n + 1) * D], positions[t]) for n in range(N)])
        ks.append([rope(k[j * D : (j + 1) * D], positions[t]) for j in range(K)])
        vs.append([v[j * D : (j + 1) * D] for j in range(K)])
    normed, prenorm, logits = [], [], []
    for t in range(T):
        heads = []
        for n in range(N):
            j = n // (N // K)
            scores = [float(qs[t][n] @ ks[s][j]) / math.sqrt(D) for s in range(t + 1)]
            m = max(scores)
            w = [math.exp(sc - m) for sc in scores]
            heads.append(sum(w[s] * vs[s][j] for s in range(t + 1)) / sum(w))
        attn = W["midlayer.self_attn.o_proj.weight"] @ np.concatenate(heads)
        residual = attn + resid[t]  # post_attention_layernorm(hidden, residual): the fused add
        n2 = rms(residual, W["midlayer.post_attention_layernorm.weight"])
        gate, up = W["midlayer.mlp.gate_proj.weight"] @ n2, W["midlayer.mlp.up_proj.weight"] @ n2
        mlp = W["midlayer.mlp.down_proj.weight"] @ (gate / (1.0 + np.exp(-gate)) * up)
        pre = mlp + residual  # self.norm(hidden_states, residual): the fused add
        post = rms(pre, W["norm.weight"])
        draft = W["lm_head.weight"] @ post
        full = np.full(cfg.vocab, -np.inf)
        full[np.arange(cfg.draft_vocab) + d2t] = draft
        normed.append(post)
        prenorm.append(pre)
        logits.append(full)
    return np.array(normed), np.array(prenorm), np.array(logits)


@pytest.mark.parametrize("nbr", [False, True])
def test_step_matches_vllm(nbr):
    cfg = tiny(norm_before_residual=nbr)
    p = random_params(cfg, seed=3)
    rng = np.random.default_rng(4)
    T = 5
    embed = rng.standard_normal((cfg.vocab, cfg.hidden))
    ids = rng.integers(0, cfg.vocab, size=T)
    aux = rng.standard_normal((T, 3 * cfg.hidden))
    positions = np.arange(T) + 7
    d2t, _ = e3.draft_vocab(rng.integers(0, 9, size=cfg.vocab), cfg.draft_vocab)
    want_post, want_pre, want_logits = vllm_step(p, cfg, embed, ids, positions, aux, d2t)

    hid = e3.ops.linear_forward(aux[None], p[e3.FC])
    causal = np.tril(np.ones((T, T), dtype=bool))
    post, pre, _, _ = e3.step_forward(p, cfg, embed[ids][None], hid, positions, causal)
    logits = e3.ops.linear_forward(post, p[e3.HEAD])[0]
    np.testing.assert_allclose(post[0], want_post, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(pre[0], want_pre, rtol=1e-12, atol=1e-12)
    cols = e3.target_ids(d2t)
    np.testing.assert_allclose(logits, want_logits[:, cols], rtol=1e-12, atol=1e-12)
    assert np.all(np.isneginf(np.delete(want_logits, cols, axis=1)))
    assert np.array_equal(cols[np.argmax(logits, -1)], np.argmax(want_logits, -1))

    # the comparison is sensitive: the other concatenation order, or the other residual, differ
    swapped = vllm_step(p, cfg, embed, ids, positions, aux, d2t, emb_first=False)[0]
    assert np.abs(swapped - want_post).max() > 1e-3
    other, _, _, _ = e3.step_forward(p, tiny(norm_before_residual=not nbr), embed[ids][None], hid, positions,
                                     causal)  # fmt: skip
    assert np.abs(other[0] - want_post).max() > 1e-3


# ----------------------------------------------------------------------------------------------------------
# gradient checks


@pytest.mark.parametrize("nbr", [False, True])
def test_step_backward_fd(nbr):
    """A step with past keys (Tp = 3 rows) under a TTT-like mask: every input, past and own k/v gradients
    included, and every step tensor, on fakeloss = sum(out * dout) over (post, pre, k, v)."""
    cfg = tiny(norm_before_residual=nbr)
    p = random_params(cfg, seed=5)
    rng = np.random.default_rng(6)
    B, T, Tp, H, K, D = 2, 3, 3, cfg.hidden, cfg.n_kv_heads, cfg.head_dim
    emb = rng.standard_normal((B, T, H))
    hid = rng.standard_normal((B, T, H))
    pk = rng.standard_normal((B, Tp, K, D))
    pv = rng.standard_normal((B, Tp, K, D))
    mask = e3.ttt_mask(2, T)[T:, :]
    pos = e3.ttt_positions(1, T)

    def run():
        post, pre, (k, v), _ = e3.step_forward(p, cfg, emb, hid, pos, mask, (pk, pv))
        return post, pre, k, v

    outs = run()
    douts = tuple(rng.standard_normal(o.shape) for o in outs)
    _, _, _, cache = e3.step_forward(p, cfg, emb, hid, pos, mask, (pk, pv))
    demb, dhid, (dpk, dpv), grads = e3.step_backward(p, cfg, cache, douts[0], douts[1], douts[2], douts[3])

    def f():
        return fakeloss(run(), douts)

    mag = fakeloss(tuple(np.abs(o) for o in outs), tuple(np.abs(d) for d in douts))
    for name, g, x in [("emb", demb, emb), ("hidden", dhid, hid), ("past k", dpk, pk), ("past v", dpv, pv)]:
        assert_fd_grad(name, g, f, x, magnitude=mag)
    assert set(grads) == set(p) - {e3.FC, e3.HEAD}
    for name, g in grads.items():
        assert_fd_grad(name, g, f, p[name], magnitude=mag)


@pytest.mark.parametrize("nbr", [False, True])
def test_ttt_loss_grad_fd(nbr):
    """The whole unrolled TTT loss (H=8, 2 heads over 1 kv head of dim 4, V=24, Vd=12, T=6, ttt=3, lengths
    6 and 4) against every draft tensor."""
    cfg = tiny(norm_before_residual=nbr)
    p = random_params(cfg, seed=7)
    aux, ids, embed, z, d2t, t2d, lengths = ttt_data(cfg)

    def f():
        return e3.ttt_forward(p, cfg, aux, ids, embed, z, d2t, t2d, lengths)[0]

    loss, cache = e3.ttt_forward(p, cfg, aux, ids, embed, z, d2t, t2d, lengths)
    assert loss > 0 and len(cache["step_losses"]) == 3
    grads = e3.ttt_backward(p, cfg, cache)
    assert list(grads) == list(e3.eagle3_params(cfg))
    for name, g in grads.items():
        assert np.abs(g).max() > 0, name
        assert_fd_grad(name, g, f, p[name])


def test_ttt_kl_differs_by_a_constant():
    cfg = tiny()
    p = random_params(cfg, seed=8)
    args = ttt_data(cfg)
    ce, c_ce = e3.ttt_forward(p, cfg, *args)
    kl, c_kl = e3.ttt_forward(p, cfg, *args, kl=True)
    assert kl < ce and kl > 0
    g_ce, g_kl = e3.ttt_backward(p, cfg, c_ce), e3.ttt_backward(p, cfg, c_kl)
    for name in g_ce:
        np.testing.assert_array_equal(g_ce[name], g_kl[name])


# ----------------------------------------------------------------------------------------------------------
# the loss is SpecForge's


def test_ttt_loss_is_specforges_formula():
    """A per-row loop of SpecForge's OnlineEagle3Model: step i row p reads the target's logits at p + i + 1
    over the draft vocabulary (softmax), weighs loss_mask[p + i] * t2d[argmax], and the step's loss is the
    masked soft cross-entropy summed over rows / (B * T), steps weighted 0.8^i."""
    cfg = tiny()
    p = random_params(cfg, seed=9)
    aux, ids, embed, z, d2t, t2d, lengths = ttt_data(cfg)
    loss, cache = e3.ttt_forward(p, cfg, aux, ids, embed, z, d2t, t2d, lengths)
    B, T, _ = z.shape
    lm = e3.loss_mask_from_lengths(lengths, T)
    cols = e3.target_ids(d2t)
    want = 0.0
    for i, step in enumerate(cache["steps"]):
        li = 0.0
        for b in range(B):
            for r in range(T):
                if r + i + 1 >= T or lm[b, r + i] == 0 or not t2d[np.argmax(z[b, r + i + 1])]:
                    continue
                zt = z[b, r + i + 1, cols]
                pt = np.exp(zt - zt.max()) / np.exp(zt - zt.max()).sum()
                lg = step["logits"][b, r]
                logq = lg - (lg.max() + math.log(np.exp(lg - lg.max()).sum()))
                li -= float(pt @ logq)
        want += 0.8**i * li / (B * T)
    assert loss == pytest.approx(want, rel=1e-12)
    # the dropped row: z[0, 2] has its argmax outside the draft vocabulary, read by step 0 at row 1
    assert cache["steps"][0]["w"][0, 1] == 0 and cache["steps"][0]["w"][0, 0] == 1
    # lengths: row 1 is 4 long, so p + i < 3 counts
    w1 = np.array([s["w"][1] for s in cache["steps"]])
    assert np.all(w1[:, 3:] == 0)


def test_loss_mask_from_lengths():
    assert np.array_equal(e3.loss_mask_from_lengths([4, 2], 5), [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])


# ----------------------------------------------------------------------------------------------------------
# training against inference


def _drafted_window(cfg, p, seed=11, n=4, k=3):
    rng = np.random.default_rng(seed)
    embed = rng.standard_normal((cfg.vocab, cfg.hidden))
    d2t, t2d = e3.draft_vocab(rng.integers(0, 9, size=cfg.vocab), cfg.draft_vocab)
    T = n + k + 1
    aux = rng.standard_normal((1, T, 3 * cfg.hidden))
    ids = rng.integers(0, cfg.vocab, size=(1, T))
    nxt = int(rng.integers(0, cfg.vocab))
    tids, dids, logits = e3.propose(p, cfg, embed, aux[0, :n], ids[0, :n], nxt, d2t, k)
    # the window a TTT pass would train on if the data continued with the drafted tokens
    ids[0, n] = nxt
    ids[0, n + 1 : n + k] = tids[: k - 1]
    z = rng.standard_normal((1, T, cfg.vocab))
    return embed, d2t, t2d, aux, ids, z, tids, dids, logits


def test_propose_is_row_n_minus_1_of_ttt():
    """TTT step j at row n-1 reads the token at n + j at position n - 1 + j and attends to step-0 rows <= n-1
    plus its own chain: exactly what `propose` computes for draft j + 1 (vLLM's proposer layout)."""
    cfg = tiny(ttt=3)
    p = random_params(cfg, seed=10)
    n, k = 4, 3
    embed, d2t, t2d, aux, ids, z, tids, dids, logits = _drafted_window(cfg, p, n=n, k=k)
    _, cache = e3.ttt_forward(p, cfg, aux, ids, embed, z, d2t, t2d)
    for j in range(k):
        np.testing.assert_allclose(cache["steps"][j]["logits"][0, n - 1], logits[j], rtol=1e-10, atol=1e-12)
    assert np.array_equal(tids, e3.target_ids(d2t)[dids])


def test_propose_consistency_needs_the_position_shift(monkeypatch):
    """Without the p + i positions (all steps at p) training would no longer match inference."""
    cfg = tiny(ttt=3)
    p = random_params(cfg, seed=10)
    embed, d2t, t2d, aux, ids, z, tids, dids, logits = _drafted_window(cfg, p)
    monkeypatch.setattr(e3, "ttt_positions", lambda i, T: np.arange(T))
    _, cache = e3.ttt_forward(p, cfg, aux, ids, embed, z, d2t, t2d)
    assert np.abs(cache["steps"][1]["logits"][0, 3] - logits[1]).max() > 1e-6


# ----------------------------------------------------------------------------------------------------------
# the top-k teacher (the GPU teacher's form)


def test_teacher_topk_is_the_draft_softmax_truncated():
    cfg = tiny()
    _aux, _ids, _embed, z, d2t, t2d, _lengths = ttt_data(cfg)
    z[1, 0, e3.target_ids(d2t)[:2]] = 7.0  # a tie at the top: the lower draft id first
    ids, probs, in_draft = e3.teacher_topk(z, d2t, t2d, 4)
    cols = e3.target_ids(d2t)
    for b in range(z.shape[0]):
        for r in range(z.shape[1]):
            zd = z[b, r, cols]
            p = np.exp(zd - zd.max()) / np.exp(zd - zd.max()).sum()
            order = sorted(range(zd.size), key=lambda d: (-zd[d], d))[:4]
            assert list(ids[b, r]) == order
            np.testing.assert_allclose(probs[b, r], p[order], rtol=1e-6)
            top = int(np.argmax(z[b, r]))
            assert in_draft[b, r] == bool(t2d[top]) == (int(cols[ids[b, r, 0]]) == top)
    assert ids[1, 0, 0] == 0 and ids[1, 0, 1] == 1
    assert not in_draft[0, 2] and in_draft[0, 1]  # ttt_data's rows outside and inside the draft vocabulary
    with pytest.raises(ValueError):
        e3.teacher_topk(z, d2t, t2d, cfg.draft_vocab + 1)


@pytest.mark.parametrize("kl", [False, True])
def test_topk_teacher_with_k_vd_is_the_full_logit_loss(kl):
    cfg = tiny()
    p = random_params(cfg, seed=12)
    aux, ids, embed, z, d2t, t2d, lengths = ttt_data(cfg)
    full, c_full = e3.ttt_forward(p, cfg, aux, ids, embed, z, d2t, t2d, lengths, kl=kl)
    teacher = e3.teacher_topk(z, d2t, t2d, cfg.draft_vocab)
    top, c_top = e3.ttt_forward(p, cfg, aux, ids, embed, None, d2t, t2d, lengths, kl=kl, teacher=teacher)
    # the probs went through float32: equal to that rounding
    assert top == pytest.approx(full, rel=1e-6)
    g_full, g_top = e3.ttt_backward(p, cfg, c_full), e3.ttt_backward(p, cfg, c_top)
    for name in g_full:
        np.testing.assert_allclose(g_top[name], g_full[name], rtol=1e-5, atol=1e-9, err_msg=name)
    # a truncated teacher is another loss
    cut, _ = e3.ttt_forward(p, cfg, aux, ids, embed, None, d2t, t2d, lengths, kl=kl,
                            teacher=e3.teacher_topk(z, d2t, t2d, 3))  # fmt: skip
    assert abs(cut - full) > 1e-3


@pytest.mark.parametrize("nbr", [False, True])
def test_topk_teacher_loss_grad_fd(nbr):
    """The unrolled loss on a top-k teacher (k = 3 of Vd = 12) against every draft tensor."""
    cfg = tiny(norm_before_residual=nbr)
    p = random_params(cfg, seed=13)
    aux, ids, embed, z, d2t, t2d, lengths = ttt_data(cfg)
    t_ids, t_probs, in_draft = e3.teacher_topk(z, d2t, t2d, 3)
    teacher = (t_ids, t_probs.astype(np.float64), in_draft)

    def f():
        return e3.ttt_forward(p, cfg, aux, ids, embed, None, d2t, t2d, lengths, teacher=teacher)[0]

    loss, cache = e3.ttt_forward(p, cfg, aux, ids, embed, None, d2t, t2d, lengths, teacher=teacher)
    grads = e3.ttt_backward(p, cfg, cache)
    assert loss > 0
    for name, g in grads.items():
        assert np.abs(g).max() > 0, name
        assert_fd_grad(name, g, f, p[name])
    # the row whose target argmax lies outside the draft vocabulary weighs 0 (step 0, row 1 reads z[0, 2])
    assert cache["steps"][0]["w"][0, 1] == 0 and cache["steps"][0]["w"][0, 0] == 1
