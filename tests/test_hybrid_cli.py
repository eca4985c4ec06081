"""Every command on a hybrid (Qwen3.5-family) model, run as a user runs them (`python -m ddl_wgpu.cli`): init and
train with `--arch qwen3_5` (a sweep with a Deep Delta residual on the hybrid trunk, joint MTP, resume bit for
bit and a new phase), inspect's layer types, eval on both backends, compress keeping the layer types, accept on
both backends and heal with its options (numpy; wgpu with an f16 trunk). `--arch transformer`, the default,
builds today's models bit for bit. Tiny shapes; the jobs run on the numpy backend unless a test compares."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from helpers import cli_sizes

from ddl_ref import mtp as ref_mtp
from ddl_ref.config import preset
from ddl_wgpu.files.container import save
from ddl_wgpu.files.hf.folder import Weights
from ddl_wgpu.files.inspect import describe
from ddl_wgpu.files.modelfile import load_model
from ddl_wgpu.jobs import heal

SIZES = cli_sizes("train", n_layers=3)
HYBRID = ["--arch", "qwen3_5", *SIZES]  # L L F: two Gated DeltaNet blocks, then gated full attention
TRAIN = ["--max-steps", "4", "--eval-interval", "2", "--batch-size", "2", "--seq-len", "16", "--eval-batches",
         "1", "--learning-rate", "1e-2", "--min-learning-rate", "1e-3", "--warmup-steps", "1", "--no-plots"]  # fmt: skip
HEAL = ["--window", "32", "--tokens", "1600", "--batch", "2", "--epochs", "0.3", "--eval-every", "5"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, corpus_words) -> Path:
    rng = np.random.default_rng(0)
    text = " ".join(corpus_words[int(i)] for i in rng.integers(0, len(corpus_words), 600))
    p = tmp_path_factory.mktemp("hybrid_data") / "corpus.txt"
    p.write_text(text)
    return p


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus, cli, ok) -> Path:
    """A hybrid with a draft trained a few steps jointly (numpy): the model the draft commands run on."""
    out = tmp_path_factory.mktemp("hybrid_run")
    ok(cli("train", "--data", corpus, "--out", out, "--variants", "baseline", "--mtp", *TRAIN, "--max-steps",
           "8", "--backend", "ref", *HYBRID))  # fmt: skip
    return out / "baseline" / "checkpoint.ddlw"


def _json(r):
    return json.loads(r.stdout)


def test_init_and_inspect_a_hybrid(tmp_path, cli, ok):
    out = tmp_path / "h.ddlw"
    ok(cli("init", "--out", out, "--mtp", *HYBRID))
    text = ok(cli("inspect", out)).stdout
    assert ("layers      3 blocks LLF: 2 linear_attention (Gated DeltaNet), 1 full_attention (softmax attention, "
            "gated, RoPE on 2 of 8 dims); draft: full_attention (softmax attention, gated, RoPE on 2 of 8 dims)"
            ) in text  # fmt: skip
    desc = _json(ok(cli("inspect", out, "--json")))
    assert desc["layers"]["types"] == ["linear_attention", "linear_attention", "full_attention"]
    assert (
        desc["config"]["layer_types"] == desc["layers"]["types"] and desc["config"]["norm_style"] == "offset"
    )
    assert desc["provenance"]["init"]["arch"] == "qwen3_5"
    # the draft in Qwen3.5's layout, as vLLM/SGLang feed it; a transformer's in our own
    assert {k: desc["config"]["mtp"][k] for k in ("concat", "trunk_hidden", "chain_hidden")} == {
        "concat": "emb_first", "trunk_hidden": "post_norm", "chain_hidden": "post_norm"}  # fmt: skip
    ok(cli("init", "--out", tmp_path / "t.ddlw", "--mtp", *SIZES))
    plain = _json(ok(cli("inspect", tmp_path / "t.ddlw", "--json")))["config"]["mtp"]
    assert (plain["trunk_hidden"], plain["chain_hidden"]) == ("pre_norm", "pre_norm")
    assert "model.layers.0.linear_attn.in_proj_qkv.weight" in {t["name"] for t in desc["tensors"]}


def test_the_default_arch_builds_todays_models_bit_for_bit(tmp_path, cli, ok):
    ok(cli("init", "--out", tmp_path / "a.ddlw", *SIZES))
    ok(cli("init", "--out", tmp_path / "b.ddlw", "--arch", "transformer", *SIZES))
    a, b = (_json(ok(cli("inspect", tmp_path / f, "--json"))) for f in ("a.ddlw", "b.ddlw"))
    assert [t["hash"] for t in a["tensors"]] == [t["hash"] for t in b["tensors"]]
    assert a["config"] == b["config"] and a["config"]["layer_types"] is None
    assert a["layers"]["types"] is None and a["layers"]["counts"] == {"full_attention": 3}
    assert (
        "layers      3 blocks: 3 full_attention (softmax attention)\n"
        in ok(cli("inspect", tmp_path / "a.ddlw")).stdout
    )


def test_inspect_summarises_a_header_of_any_depth_without_listing_it(tmp_path):
    """A header may claim any number of blocks (inspect shows hostile files too): the layer summary counts
    them without building a list that long, and a header whose config is no model config has none."""
    cfg = {**preset("tiny").to_dict(), "n_layers": 10**12}
    save(tmp_path / "deep.ddlw", [("x", np.zeros(4, np.float32), "f32")], config=cfg)
    lay = describe(tmp_path / "deep.ddlw")["layers"]
    assert lay["counts"] == {"full_attention": 10**12} and lay["types"] is None
    save(tmp_path / "odd.ddlw", [("x", np.zeros(4, np.float32), "f32")], config={"n_layers": "many"})
    assert describe(tmp_path / "odd.ddlw")["layers"] is None


@pytest.mark.parametrize("command", ["init", "train"])
def test_arch_refusals_are_one_line(command, corpus, tmp_path, cli, user_error):
    args = ["--out", tmp_path / "x"] + (["--data", corpus, "--backend", "ref"] if command == "train" else [])
    user_error(cli(command, *args, "--arch", "mamba"), "--arch must be one of transformer, qwen3_5")
    user_error(cli(command, *args, *HYBRID, "--qk-norm", "post_rope"),
               "--arch qwen3_5 builds --qk-norm pre_rope; --qk-norm post_rope contradicts it")  # fmt: skip
    assert not (tmp_path / "x").exists()


def test_train_a_hybrid_sweep_resume_and_a_new_phase(corpus, tmp_path, cli, ok):
    """A sweep of a baseline and a Deep Delta residual on the hybrid trunk, with joint MTP: the spectral
    diagnostics only where the Delta residual is; a stopped run resumed gives the straight run's history bit
    for bit; a new phase continues it."""
    ok(cli("train", "--data", corpus, "--out", tmp_path / "a", "--variants", "baseline,ddl", "--mtp", *TRAIN,
           "--backend", "ref", *HYBRID))  # fmt: skip
    reps = {v: json.loads((tmp_path / "a" / v / "report.json").read_text()) for v in ("baseline", "ddl")}
    assert (
        reps["baseline"]["final_train_spectral"] is None and reps["ddl"]["final_train_spectral"] is not None
    )
    for rep in reps.values():
        assert rep["final_train"]["loss"] < rep["initial_train"]["loss"]
        assert math.isfinite(rep["history"][-1]["train_loss_mtp"])  # the joint draft trained
    ck = load_model(tmp_path / "a" / "ddl" / "checkpoint.ddlw")
    assert ck.cfg.layer_types == ("linear_attention", "linear_attention", "full_attention")
    assert ck.cfg.residual == "delta" and ck.cfg.mtp is not None
    r = ok(cli("train", "--data", corpus, "--out", tmp_path / "b", "--variants", "baseline", "--mtp", *TRAIN,
               "--stop-after", "2", "--backend", "ref", *HYBRID))  # fmt: skip
    assert "stopped after step 2" in r.stdout
    ckpt = tmp_path / "b" / "baseline" / "checkpoint.ddlw"
    ok(cli("resume", ckpt))
    b = json.loads((tmp_path / "b" / "baseline" / "report.json").read_text())
    assert [h["train"] for h in b["history"]] == [h["train"] for h in reps["baseline"]["history"]]
    r = ok(cli("resume", ckpt, "--steps", "2"))
    assert "baseline: 6 steps, status completed" in r.stdout


def test_train_and_eval_a_hybrid_on_both_backends(trained, corpus, tmp_path, cli, ok):
    """eval gives the same loss on both backends; train's first steps on the GPU engine follow numpy's."""
    ev = {b: _json(ok(cli("eval", trained, "--data", corpus, "--seq-len", "16", "--batch", "2", "--backend", b,
                          "--json"))) for b in ("ref", "wgpu")}  # fmt: skip
    assert ev["wgpu"]["loss"] == pytest.approx(ev["ref"]["loss"], rel=1e-5)
    assert ev["wgpu"]["windows"] == ev["ref"]["windows"] > 10
    losses = {}
    for b in ("ref", "wgpu"):
        ok(cli("train", "--data", corpus, "--out", tmp_path / b, "--variants", "baseline", "--mtp", *TRAIN,
               "--max-steps", "3", "--backend", b, *HYBRID))  # fmt: skip
        rep = json.loads((tmp_path / b / "baseline" / "report.json").read_text())
        losses[b] = [h["train"]["loss"] for h in rep["history"]]
    np.testing.assert_allclose(losses["wgpu"], losses["ref"], rtol=1e-4)


def test_a_hybrid_trained_here_exports_a_draft_the_qwen35_runtimes_read(trained, tmp_path, cli, ok):
    """`train --arch qwen3_5 --mtp` trains its draft on post-norm hiddens, so export-hf writes Qwen3.5's mtp.*
    with nothing to warn about (docs/heal.md#the-draft-block)."""
    assert load_model(trained).cfg.mtp.trunk_hidden == "post_norm"
    summary = _json(ok(cli("export-hf", trained, tmp_path / "hf", "--json")))
    assert summary["architecture"] == "Qwen3_5ForCausalLM" and summary["mtp"]["names"] == "mtp.*"
    assert "warning" not in summary["mtp"], summary["mtp"]
    assert summary["mtp"]["served"] == "vLLM and SGLang build all 15 mtp.* tensors at the written shapes"
    names = set(Weights(tmp_path / "hf").names())
    assert {"mtp.fc.weight", "mtp.norm.weight", "mtp.pre_fc_norm_hidden.weight"} <= names


def test_compress_a_hybrid_keeps_its_layer_types(trained, corpus, tmp_path, cli, ok):
    ok(cli("compress", trained, "--drop-layers", "1", "--out", tmp_path / "d.ddlw"))
    text = ok(cli("inspect", tmp_path / "d.ddlw")).stdout
    assert "layers      2 blocks LF: 1 linear_attention (Gated DeltaNet), 1 full_attention" in text
    src, d = load_model(trained), load_model(tmp_path / "d.ddlw")
    assert d.cfg.layer_types == ("linear_attention", "full_attention")
    for new, old in ((0, 0), (1, 2)):  # blocks 0 and 2 kept, renumbered, every tensor moved with its block
        for name, a in src.params.items():
            if name.startswith(f"model.layers.{old}."):
                assert np.array_equal(d.params[name.replace(f".{old}.", f".{new}.", 1)], a), name
    ok(cli("compress", trained, "--ffn-keep", "0.5", "--out", tmp_path / "f.ddlw"))
    f = load_model(tmp_path / "f.ddlw")
    # the draft narrowed with the trunk: vLLM and SGLang build a Qwen3.5 draft at intermediate_size
    assert (
        f.cfg.ffn_hidden == 24 and f.cfg.mtp.ffn_hidden is None and f.cfg.layer_types == src.cfg.layer_types
    )
    for m in ("d.ddlw", "f.ddlw"):  # each loads and runs
        ev = _json(
            ok(cli("eval", tmp_path / m, "--data", corpus, "--seq-len", "16", "--backend", "ref", "--json"))
        )
        assert math.isfinite(ev["loss"])


@pytest.mark.parametrize("mode", ["per-step", "stacked"])
def test_accept_a_hybrid_on_both_backends(trained, corpus, cli, ok, mode):
    args = ["--data", corpus, "--depth", "3", "--window", "24", "--chain-attention", mode, "--json"]
    r, g = (_json(ok(cli("accept", trained, *args, "--backend", b))) for b in ("ref", "wgpu"))
    assert g["backend"] == "wgpu" and r["chain_attention"] == g["chain_attention"] == mode
    for key in ("prefix_acceptance", "acceptance_length", "anchors", "on_policy"):
        assert g[key] == r[key], key


def test_heal_a_hybrid_with_its_options(trained, corpus, tmp_path, cli, ok):
    """heal of a compressed hybrid from the trained draft (--init), chained 3 deep, stacked, without refreshes,
    the top-k-renormalised KL and patience 1 (numpy); and on the GPU with an f16 trunk. The healed file holds
    the trained draft tensors and the compressed model's config."""
    ok(cli("compress", trained, "--ffn-keep", "0.5", "--out", tmp_path / "c.ddlw"))
    out = tmp_path / "h.ddlw"
    rep = _json(ok(cli("heal", tmp_path / "c.ddlw", "--data", corpus, "--out", out, "--init", trained, *HEAL,
                       "--chain", "3", "--refresh", "0", "--chain-attention", "stacked", "--kl-form", "topk",
                       "--patience", "1", "--backend", "ref", "--json")))  # fmt: skip
    assert rep["chain"] == 3 and rep["chain_attention"] == "stacked" and rep["config"]["kl_form"] == "topk"
    assert rep["init"] == str(trained) and rep["config"]["refresh"] == 0
    # --refresh 0: steps 2..3 are built once, before training, and never rebuilt (each refresh batch at most once)
    held = rep["heldout_windows"]
    batches = -(-(rep["windows"] - held) // 2) + -(-held // 2)
    assert 0 < rep["refresh_forwards"] <= 2 * batches
    assert len(rep["acceptance_after"]["prefix_acceptance"]) == 3
    healed, comp = load_model(out), load_model(tmp_path / "c.ddlw")
    assert healed.cfg == comp.cfg and healed.provenance["mtp_heal"]["chain"] == 3
    assert all(
        np.array_equal(healed.params[n], comp.params[n]) for n in comp.params if not n.startswith("model.mtp")
    )
    g = _json(ok(cli("heal", tmp_path / "c.ddlw", "--data", corpus, "--out", tmp_path / "g.ddlw", "--init", trained,
                     *HEAL, "--chain", "2", "--trunk-dtype", "f16", "--backend", "wgpu", "--json")))  # fmt: skip
    assert g["backend"] == "wgpu" and g["trunk_dtype"] == "f16" and g["steps"] > 0
    assert g["heldout_kl_best"] <= g["heldout_kl_start"]


def test_lazy_refresh_on_a_hybrid_gives_the_eager_rows(trained, corpus, tmp_path, eager_refresh):
    """heal's lazy refresh on a hybrid (numpy): bit for bit the results of rebuilding every window at each
    refresh, per-step and stacked."""
    run = heal.HealConfig(chain=3, window=32, tokens=1600, batch=2, epochs=0.5, eval_every=4, refresh=3,
                          patience=0, lr=3e-3)  # fmt: skip
    for mode in ("per-step", "stacked"):
        got = []
        for eager in (True, False):
            eager_refresh(eager)
            out = tmp_path / f"{mode}-{eager}.ddlw"
            r = heal.heal(
                trained, str(corpus), out, heal.HealConfig(**{**run.to_dict(), "chain_attention": mode})
            )
            p = load_model(out).params
            got.append((r, {n: p[n] for n in ref_mtp.trained_names(p)}))
        (e, pe), (lz, pl) = got
        assert lz["history"] == e["history"] and len(e["history"]) >= 3
        assert all(np.array_equal(pl[n], pe[n]) for n in pe)
        assert 0 < lz["refresh_forwards"] < e["refresh_forwards"]
