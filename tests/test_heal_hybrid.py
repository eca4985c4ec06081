"""heal and accept on a hybrid (Qwen3.5-family) model, the GPU backend against the numpy one: the draft (a gated
full-attention block with partial RoPE) one step and its gradients, per-step and stacked (the stacked chain's
RoPE at explicit positions); the trunk's rows; a short heal (held-out KL at every evaluation, acceptance before
and after, the healed weights); acceptance with every convention probed; the f16 trunk; the defaults a
Qwen3.5-layout draft gets (stacked chain, the model's FFN width) and the export of its healed draft. The heal and
accept runs use a tiny hybrid trained here with its draft (a few seconds of numpy) and compressed, so acceptance
is far from zero and heal has something to repair."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from helpers import check_acceptance_backends, check_draft_step, perturbed, tiny_cfg

from ddl_ref import mtp as ref_mtp
from ddl_ref.config import MtpConfig, apply_arch
from ddl_ref.params import init_params
from ddl_wgpu import backend
from ddl_wgpu.engine.refnet import RefDraft, RefNet, RefTeacher
from ddl_wgpu.engine.step import AdamW
from ddl_wgpu.files.hf import served_draft
from ddl_wgpu.files.hf.convert import export_hf_from_file
from ddl_wgpu.files.modelfile import Model, load_model, save_model
from ddl_wgpu.jobs import accept, compress, heal


def hybrid_cfg(**overrides):
    """The heal tests' tiny shape built as Qwen3.5 (L F: a Gated DeltaNet block, then a gated full-attention
    block; RoPE on 4 of 8 dims, so a table of the wrong width moves every rotated pair), with a draft."""
    cfg = apply_arch(tiny_cfg(**{"mtp": MtpConfig(), **overrides}), "qwen3_5")
    return replace(cfg, rotary_dim=4)


def test_the_hybrid_config_has_what_these_tests_check():
    cfg = hybrid_cfg()
    assert cfg.layer_types == ("linear_attention", "full_attention")
    assert cfg.attn_output_gate and cfg.rope_dim == 4 < cfg.head_dim and cfg.norm_style == "offset"
    q = init_params(cfg, 0)["model.mtp.layers.0.self_attn.q_proj.weight"]
    assert q.shape == (2 * cfg.n_heads * cfg.head_dim, cfg.d_model)  # the draft's block is gated too


@pytest.mark.parametrize("chain", [0, 2])
def test_hybrid_draft_step_matches_the_reference(gpu, chain):
    """helpers.check_draft_step on the gated partial-RoPE draft; chain=2 uses the partial-width RoPE tables at
    the chain's positions (a full-width table here failed this test)."""
    cfg = hybrid_cfg()
    check_draft_step(perturbed(cfg), cfg, batch=2, window=10, chain=chain)


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_hybrid_step_rows_match_the_reference(gpu, dtype):
    """The draft's block input rows built on the GPU from a hybrid trunk's hidden rows (step 1) and from the
    draft's own output rows (steps 2 and 3, per-step and stacked) against the numpy path, on the weights as the
    GPU holds them (f16: the trunk's rounded matrices, the Gated DeltaNet projections among them)."""
    cfg = hybrid_cfg(mtp=MtpConfig(trunk_hidden="post_norm", chain_hidden="pre_norm"))
    m = Model(cfg, perturbed(cfg))
    B, T = 3, 10
    ids = np.random.default_rng(6).integers(0, 256, (B, T))
    lengths = np.array([10, 7, 3])
    teacher = backend.make_teacher("wgpu", m, batch=4, trunk_dtype=dtype)
    draft = backend.make_draft("wgpu", m, batch=4, teacher=teacher)
    f16 = [n for n in m.params if n in teacher.net.slots and teacher.net.wdtype(n) == "f16"]
    assert (dtype == "f16") == any("linear_attn.in_proj_qkv" in n for n in f16)
    p = {n: a.astype(np.float16).astype(np.float32) if n in f16 else a for n, a in m.params.items()}
    ref_t, ref_d = RefTeacher(p, cfg), RefDraft(p, cfg)
    ti, tp, x1 = teacher.topk_rows(ids, lengths, 8)
    ri, rp, rx1 = ref_t.topk_rows(ids, lengths, 8)
    np.testing.assert_allclose(x1, rx1, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(tp, rp, rtol=1e-4, atol=1e-6)
    tok2, val2 = ref_mtp.shifted(ids, 2), ref_mtp.step_valid(lengths, T, 2)
    x2 = draft.next_rows(rx1, tok2, val2)
    np.testing.assert_allclose(x2, ref_d.next_rows(rx1, tok2, val2), rtol=1e-4, atol=1e-5)
    tok3, val3 = ref_mtp.shifted(ids, 3), ref_mtp.step_valid(lengths, T, 3)
    stacked = np.concatenate([rx1, x2], axis=1)
    x3 = draft.next_rows(stacked, tok3, val3, chain=2)
    np.testing.assert_allclose(x3, ref_d.next_rows(stacked, tok3, val3, chain=2), rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------
# a trained, compressed hybrid: heal and accept on both backends

TEXT_WORDS = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]


@pytest.fixture(scope="module")
def story(tmp_path_factory):
    """(trained model file, compressed model file, text file): a tiny hybrid trained with its draft (joint MTP,
    numpy, 150 steps of 8 x 24 bytes) on a text of random words, then compressed (--ffn-keep 0.5)."""
    d = tmp_path_factory.mktemp("hybrid_story")
    rng = np.random.default_rng(0)
    text = " ".join(rng.choice(TEXT_WORDS, 400))
    (d / "t.txt").write_text(text)
    cfg = hybrid_cfg()
    net = RefNet(cfg, init_params(cfg, 0), mtp_weight=0.3)
    data = np.frombuffer(text.encode(), np.uint8).astype(np.int64)
    work = net.work(8, 24)
    for step in range(1, 151):
        ids = np.stack([data[s : s + 24] for s in rng.integers(0, data.size - 24, 8)])
        work.step(ids, None, AdamW(lr=1e-2, step=step, weight_decay=0.0))
    save_model(d / "trained.ddlw", Model(cfg, net.export()))
    compress.compress_file(d / "trained.ddlw", d / "compressed.ddlw", keep=0.5)
    return d / "trained.ddlw", d / "compressed.ddlw", d / "t.txt"


HEAL = heal.HealConfig(chain=3, window=24, tokens=1600, batch=2, eval_every=5, patience=0, lr=3e-3, epochs=0.2,
                       refresh=5)  # fmt: skip


@pytest.mark.parametrize("mode, kl_form", [("per-step", "full"), ("stacked", "topk")])
def test_gpu_heal_of_a_hybrid_matches_numpy(gpu, tmp_path, story, mode, kl_form):
    """A short heal of the compressed hybrid's draft from the trained model's (--init), with lazy refreshes, on
    both backends: the same held-out KL per chain step at every evaluation, the same best step, the acceptance
    before and after, and the healed weights, within the engine's tolerances (tests/test_heal_gpu.py)."""
    trained, compressed, text = story
    run = replace(HEAL, chain_attention=mode, kl_form=kl_form)
    r = heal.heal(compressed, str(text), tmp_path / "r.ddlw", run, init_path=trained, backend="ref")
    g = heal.heal(compressed, str(text), tmp_path / "g.ddlw", run, init_path=trained, backend="wgpu")
    assert r["steps"] == g["steps"] >= 10 and len(r["history"]) == len(g["history"]) >= 3
    assert r["refresh_forwards"] == g["refresh_forwards"] > 0
    for hr, hg in zip(r["history"], g["history"], strict=True):
        assert hr["step"] == hg["step"]
        np.testing.assert_allclose(hg["heldout_kl"], hr["heldout_kl"], atol=1e-4, rtol=0)
    assert g["best_step"] == r["best_step"] and g["chain_attention"] == mode
    assert r["heldout_kl_best"] < r["heldout_kl_start"]  # the heal did something
    for key in ("acceptance_before", "acceptance_after"):
        np.testing.assert_allclose(g[key]["prefix_acceptance"], r[key]["prefix_acceptance"], atol=0.02)
        assert r[key]["prefix_acceptance"][0] > 0.2  # a trained draft: the comparison has teeth
    a, b = load_model(tmp_path / "r.ddlw").params, load_model(tmp_path / "g.ddlw").params
    for n in ref_mtp.trained_names(a):
        np.testing.assert_allclose(b[n], a[n], rtol=1e-2, atol=run.lr, err_msg=n)


@pytest.mark.parametrize("mode", ["per-step", "stacked"])
def test_gpu_acceptance_of_a_hybrid_matches_numpy(gpu, story, mode):
    """accept on the trained hybrid, chained 3 deep with every convention probed: the same numbers on both
    backends (the GPU chain keeps every row there)."""
    m = load_model(story[0])
    data = np.frombuffer(story[2].read_bytes(), np.uint8).astype(np.int64)
    windows = [data[s : s + n] for s, n in ((0, 24), (30, 20), (60, 24), (100, 9), (140, 24))]
    r = check_acceptance_backends(m, windows, mode)
    assert r["prefix_acceptance"][0] > 0.3 and r["prefix_acceptance"][2] > 0.0


def test_gpu_heal_and_accept_of_a_hybrid_with_an_f16_trunk(gpu, tmp_path, story):
    """--trunk-dtype f16 on a hybrid: the Gated DeltaNet and attention matrices in f16 move the teacher by their
    rounding only, so a heal's held-out KLs and the acceptance stay close to the f32 trunk's."""
    trained, compressed, text = story
    a = heal.heal(compressed, str(text), tmp_path / "a.ddlw", HEAL, init_path=trained, backend="wgpu")
    h = heal.heal(compressed, str(text), tmp_path / "h.ddlw", replace(HEAL, trunk_dtype="f16"),
                  init_path=trained, backend="wgpu")  # fmt: skip
    assert h["trunk_dtype"] == "f16" and a["steps"] == h["steps"]
    for ha, hh in zip(a["history"], h["history"], strict=True):
        np.testing.assert_allclose(hh["heldout_kl"], ha["heldout_kl"], rtol=2e-2, atol=1e-4)
    x = accept.accept_file(trained, str(text), depth=2, window=24, backend="wgpu")
    y = accept.accept_file(trained, str(text), depth=2, window=24, backend="wgpu", trunk_dtype="f16")
    np.testing.assert_allclose(y["prefix_acceptance"], x["prefix_acceptance"], atol=0.05)


def test_gpu_heal_and_accept_follow_the_layout_defaults(gpu, tmp_path, story):
    """The story's hybrid with its draft read in Qwen3.5's layout (post-norm hiddens): without --chain-attention
    or --draft-width, heal on the GPU and on numpy trains stacked, from the trained draft narrowed to the
    compressed model's FFN width, with the same held-out KLs; accept measures stacked on both backends; the
    healed model exports a draft vLLM and SGLang build as it is."""
    post = {"trunk_hidden": "post_norm", "chain_hidden": "post_norm"}
    files = []
    for src in story[:2]:
        m = load_model(src)
        cfg = replace(m.cfg, mtp=replace(m.cfg.mtp, **post))
        save_model(tmp_path / src.name, replace(m, cfg=cfg))
        files.append(tmp_path / src.name)
    trained, compressed = files
    text = str(story[2])
    r = heal.heal(compressed, text, tmp_path / "r.ddlw", HEAL, init_path=trained, backend="ref")
    g = heal.heal(compressed, text, tmp_path / "g.ddlw", HEAL, init_path=trained, backend="wgpu")
    width = load_model(compressed).cfg.ffn_hidden
    for rep in (r, g):
        assert rep["chain_attention"] == "stacked" and rep["acceptance_after"]["chain_attention"] == "stacked"
        assert rep["draft_width"]["rule"] == "model" and rep["draft_width"]["ffn_hidden"] == width
        assert rep["draft_width"]["source_ffn_hidden"] == 2 * width  # the trained draft, narrowed
    for hr, hg in zip(r["history"], g["history"], strict=True):
        np.testing.assert_allclose(hg["heldout_kl"], hr["heldout_kl"], atol=1e-4, rtol=0)
    a = [accept.accept_file(trained, text, depth=3, window=24, backend=b) for b in ("ref", "wgpu")]
    assert a[0]["chain_attention"] == a[1]["chain_attention"] == "stacked"
    np.testing.assert_allclose(a[1]["prefix_acceptance"], a[0]["prefix_acceptance"], atol=0.02)
    export_hf_from_file(tmp_path / "g.ddlw", tmp_path / "hf")
    assert served_draft.check_folder(tmp_path / "hf").ok
