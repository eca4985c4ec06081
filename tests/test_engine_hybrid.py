"""The GPU engine on hybrid (Qwen3.5) trunks against `ddl_ref` — loss, logits and every parameter gradient of
a training step — for Gated DeltaNet and gated full-attention layers mixed, partial RoPE, tied and untied
heads, a Deep Delta residual on a hybrid trunk and a jointly trained MTP draft; the forward-only nets (whose
layers share one activation set, f32 and f16 weights) give the training net's loss; and the training step's
gradients against torch autograd through transformers' own `Qwen3_5ForCausalLM`.

Shapes are off every tile: Dk 6 and Dv 5 (the delta rule pads both), Hv = 2·Hk, a full-attention head of 6 with
2 of its dims rotated, vocabulary 61, right padding.
"""

import numpy as np
import pytest
from helpers import check_grads, hybrid_cfg

from ddl_ref import model as rm
from ddl_ref.check import check, random_params
from ddl_ref.config import MtpConfig
from ddl_wgpu.engine.inference import InferenceWork
from ddl_wgpu.engine.net import Net
from ddl_wgpu.engine.trunk import TrunkWork
from ddl_wgpu.ops import gated_delta as k_gd

B, T = 2, 9
LENGTHS = np.array([9, 6])
# Dk 6 and Dv 5: the gated delta rule's widths off every tile and vec4, as the engine shape's widths are
OFF_TILE = dict(linear_k_dim=6, linear_v_dim=5)


def _params(cfg, seed=3):
    return {n: a.astype(np.float32) for n, a in random_params(cfg, seed=seed).items()}


def _step_against_reference(gpu, cfg, mtp_weight=None):
    p = _params(cfg)
    net = Net(gpu, cfg, p, work_class=TrunkWork, mtp_weight=mtp_weight or 0.0)
    work = net.work(B, T)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (B, T))
    res = work.step(ids, LENGTHS)
    p64 = {n: a.astype(np.float64) for n, a in p.items()}
    logits, loss, cache = rm.forward(p64, cfg, ids, LENGTHS, mtp_weight=mtp_weight)
    grads = rm.backward(p64, cfg, cache)
    check("loss", np.float64(res.loss), np.float64(loss), "model")
    check("logits", work.logits(ids), logits, "model")
    got = net.grads()
    check_grads(got, grads)
    return net, p, ids


@pytest.mark.parametrize("tied", [True, False])
def test_hybrid_step_matches_reference(gpu, tied):
    cfg = hybrid_cfg("engine", tie_embeddings=tied, **OFF_TILE)
    _step_against_reference(gpu, cfg)


def test_deep_delta_residual_on_a_hybrid_trunk(gpu):
    _step_against_reference(gpu, hybrid_cfg("engine", "ddl-cc", **OFF_TILE))


def test_hybrid_with_a_joint_draft(gpu):
    """The draft is a gated full-attention block with partial RoPE, also though trunk block 0 is linear."""
    _step_against_reference(gpu, hybrid_cfg("engine", mtp=MtpConfig(), **OFF_TILE), mtp_weight=0.3)


def test_forward_only_nets_give_the_training_nets_loss(gpu, monkeypatch):
    """With the chunked rule (per-token rows switched off) the forward-only net runs the training net's kernels
    in the same order: the same bits. By default rows this short run per token (`per_token_max_t`): the
    reference's loss to the model tolerance."""
    cfg = hybrid_cfg("engine", tie_embeddings=False, **OFF_TILE)
    p = _params(cfg)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (B, T))
    total, count = Net(gpu, cfg, p, work_class=TrunkWork).work(B, T).loss_sum(ids, LENGTHS)
    assert k_gd.per_token_max_t() >= T
    short = Net(gpu, cfg, p, inference=True, work_class=InferenceWork).work(B, T)
    assert short.gdn_per_token
    _, loss, _ = rm.forward({n: a.astype(np.float64) for n, a in p.items()}, cfg, ids, LENGTHS)
    t_short, c_short = short.loss_sum(ids, LENGTHS)
    assert c_short == count
    check("per-token loss", np.float64(t_short / c_short), np.float64(loss), "model")
    monkeypatch.setenv(k_gd.ENV_PER_TOKEN, "0")
    inf = Net(gpu, cfg, p, inference=True, work_class=InferenceWork).work(B, T)
    assert not inf.gdn_per_token
    assert inf.shares_acts and inf.L[0]["X"] is inf.L[2]["X"]  # one activation set per mixer type
    assert inf.loss_sum(ids, LENGTHS) == (total, count)  # the same kernels in the same order: the same bits
    if "shader-f16" in gpu.features:
        t16, c16 = (
            Net(gpu, cfg, p, inference=True, dtype="f16", work_class=InferenceWork)
            .work(B, T)
            .loss_sum(ids, LENGTHS)
        )
        assert c16 == count and abs(t16 - total) <= 1e-3 * abs(total)


def test_step_gradients_equal_transformers_autograd(gpu):
    """One training step's loss and gradients against torch autograd through transformers' Qwen3_5ForCausalLM
    (float64) with the same weights (1e-4 relative of each tensor's largest gradient)."""
    import torch  # the test extra's: a missing torch fails this test, as tests/test_hf.py's
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = hybrid_cfg("engine", tie_embeddings=False, rms_eps=1e-6, **OFF_TILE)
    hc = Qwen3_5TextConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.ffn_hidden,
                           num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                           num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, linear_num_key_heads=1,
                           linear_num_value_heads=2, linear_key_head_dim=6, linear_value_head_dim=5,
                           linear_conv_kernel_dim=3, max_position_embeddings=cfg.max_seq_len, rms_norm_eps=1e-6,
                           tie_word_embeddings=False, layer_types=list(cfg.layer_types),
                           rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta,
                                            "partial_rotary_factor": 2 / 6})  # fmt: skip
    model = Qwen3_5ForCausalLM(hc).double()
    p = _params(cfg, seed=11)
    sd = model.state_dict()
    with torch.no_grad():
        for name, a in p.items():
            sd[name].copy_(torch.as_tensor(a.astype(np.float64)).reshape(sd[name].shape))
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (B, T))
    labels = torch.as_tensor(ids).clone()
    labels[1, LENGTHS[1] :] = -100  # padding predicts nothing, as our lengths say
    out = model(input_ids=torch.as_tensor(ids), labels=labels)
    out.loss.backward()
    net = Net(gpu, cfg, p, work_class=TrunkWork)
    res = net.work(B, T).step(ids, LENGTHS)
    check("loss", np.float64(res.loss), out.loss.item(), "model", rtol=1e-5)
    got = net.grads()
    for name, t in model.named_parameters():
        g = t.grad.numpy().reshape(got[name].shape)
        scale = max(np.abs(g).max(), 1e-6)
        check(name, got[name] / scale, g / scale, "model", rtol=0, atol=1e-4)
