"""EAGLE-3 drafts as a product (issue 40): the draft file, export-hf/import-hf of the vLLM/SGLang folder, the
`draft` command's training, Ctrl-C and resume, accept and generate with a draft, and every refusal. Tiny shapes
on the numpy backend (a 6-layer, 16-wide byte-level target)."""

from __future__ import annotations

import dataclasses
import json
import os
import signal

import numpy as np
import pytest
from helpers import make_text, random_model, tiny_cfg

from ddl_ref import eagle3 as e3
from ddl_ref.blocks import head_name
from ddl_wgpu.files import eagle3_aux as ea
from ddl_wgpu.files import eagle3file as ef
from ddl_wgpu.files.container import CheckpointError, open_checkpoint, save
from ddl_wgpu.files.hf import eagle3 as hf_e3
from ddl_wgpu.files.hf.convert import export_hf_from_file, import_hf_to_file
from ddl_wgpu.files.hf.folder import HfError
from ddl_wgpu.files.modelfile import load_model, save_model
from ddl_wgpu.jobs import draft as dj
from ddl_wgpu.jobs import generate as gen

SMALL = dict(tokens=4000, seq_len=32, ttt=3, batch_size=4, learning_rate=3e-3, eval_interval=10)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A 6-layer target, its text, and a draft trained on it for 28 steps."""
    d = tmp_path_factory.mktemp("eagle3")
    save_model(d / "t.ddlw", random_model(tiny_cfg("default", n_layers=6), 0))
    save_model(d / "other.ddlw", random_model(tiny_cfg("default", n_layers=6), 1))
    make_text(d / "text.txt", words=3000)
    rep = dj.train_draft(d / "t.ddlw", str(d / "text.txt"), d / "draft.ddlw", dj.DraftConfig(**SMALL))
    return d, rep


def _same(a: ef.Eagle3Draft, b: ef.Eagle3Draft) -> None:
    assert list(a.params) == list(b.params)
    for n in a.params:
        assert np.array_equal(a.params[n], b.params[n]), n
    assert np.array_equal(a.d2t, b.d2t) and np.array_equal(a.t2d, b.t2d)


# ----------------------------------------------------------------------------------------------------------
# the file and the folder


def test_training_lowers_the_loss_and_writes_a_bound_draft(setup):
    d, rep = setup
    assert rep["heldout_loss_end"] < 0.8 * rep["heldout_loss_start"]
    assert rep["acceptance"]["depth"] == 3 and rep["acceptance"]["anchors"] > 0
    draft = ef.load_draft(d / "draft.ddlw")
    assert draft.cfg.aux_layers == e3.default_aux_layers(6)
    assert draft.target["config_hash"] == ef.target_identity(d / "t.ddlw")["config_hash"]
    assert ea.plan_aux(draft, d / "draft.ddlw", d / "t.ddlw").how == ea.AS_IS  # its own target: accepted


def test_lm_head_starts_from_the_target_head(setup):
    d, _ = setup
    run = dj._Run(d / "t.ddlw", str(d / "text.txt"), dj.DraftConfig(**SMALL), "ref", dj.Events(None, "draft"))
    p = run.fresh_params()
    m = load_model(d / "t.ddlw")
    head = m.params[head_name(m.cfg)]
    assert np.array_equal(p[e3.HEAD], head[e3.target_ids(run.d2t)])
    run.cfg = dj.DraftConfig(**{**SMALL, "init": "random"})
    assert not np.array_equal(run.fresh_params()[e3.HEAD], p[e3.HEAD])


def test_export_import_round_trip(setup, tmp_path):
    d, _ = setup
    a = ef.load_draft(d / "draft.ddlw")
    s = export_hf_from_file(d / "draft.ddlw", tmp_path / "hf32", dtype="f32")
    assert s["served"]["tensors"] == 15
    import_hf_to_file(tmp_path / "hf32", tmp_path / "back.ddlw")
    b = ef.load_draft(tmp_path / "back.ddlw")
    _same(a, b)
    assert b.target == {k: a.target[k] for k in b.target}  # the export carries the target's identity back
    assert dataclasses.replace(a.cfg, ttt=b.cfg.ttt) == b.cfg  # ttt is a training setting, not served
    # bf16 by default: the weights come back rounded to bf16, d2t/t2d exact
    export_hf_from_file(d / "draft.ddlw", tmp_path / "hf16")
    import_hf_to_file(tmp_path / "hf16", tmp_path / "back16.ddlw")
    c = ef.load_draft(tmp_path / "back16.ddlw")
    assert set(c.dtypes.values()) == {"bf16"}
    for n in a.params:
        assert np.allclose(c.params[n], a.params[n], rtol=1e-2, atol=1e-2) and c.params[n].dtype == np.float32
    assert np.array_equal(c.d2t, a.d2t)


def _vllm_check(folder) -> None:
    """What vLLM's `Eagle3LlamaForCausalLM` (vllm/model_executor/models/llama_eagle3.py) reads, written from
    its loader independently of hf/eagle3.py: config fields, names after its renames, shapes, dtypes."""
    import safetensors.torch
    import torch
    import transformers

    cfg = json.loads((folder / "config.json").read_text())
    hc = transformers.LlamaConfig.from_pretrained(folder)  # the draft's config, as vLLM's hf_config
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert hc.num_hidden_layers == 1 and cfg["tie_word_embeddings"] is False
    assert cfg["norm_before_residual"] is False  # written, not defaulted (speculators' path defaults to True)
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [
        j + 1 for j in cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    ]
    assert "rope_theta" in cfg and cfg["rope_scaling"] is None
    H, N, K = hc.hidden_size, hc.num_attention_heads, hc.num_key_value_heads
    D = getattr(hc, "head_dim", H // N)
    Vd, V, F = hc.draft_vocab_size, hc.vocab_size, hc.intermediate_size
    t = safetensors.torch.load_file(folder / "model.safetensors")
    shapes = {}
    for name, w in t.items():
        if "t2d" in name:  # skipped by the loader
            assert w.dtype == torch.bool and tuple(w.shape) == (V,)
            continue
        if "d2t" in name:
            assert w.dtype == torch.int64
            name = name.replace("d2t", "draft_id_to_target_id")
        elif "lm_head" not in name:
            name = "model." + name.replace("midlayer.", "layers.0.")
        shapes[name] = tuple(w.shape)
        if "draft_id" not in name:
            assert w.dtype == torch.bfloat16, name
    L = "model.layers.0."
    assert shapes == {
        "model.fc.weight": (H, 3 * hc.target_hidden_size),
        L + "input_layernorm.weight": (H,), L + "hidden_norm.weight": (H,),
        L + "self_attn.q_proj.weight": (N * D, 2 * H), L + "self_attn.k_proj.weight": (K * D, 2 * H),
        L + "self_attn.v_proj.weight": (K * D, 2 * H), L + "self_attn.o_proj.weight": (H, N * D),
        L + "post_attention_layernorm.weight": (H,), L + "mlp.gate_proj.weight": (F, H),
        L + "mlp.up_proj.weight": (F, H), L + "mlp.down_proj.weight": (H, F), "model.norm.weight": (H,),
        "lm_head.weight": (Vd, H), "draft_id_to_target_id": (Vd,),
    }  # fmt: skip
    d2t = t["d2t"].numpy()
    assert np.all(np.diff(np.arange(Vd) + d2t) > 0) and (np.arange(Vd) + d2t).max() < V


def test_exported_folder_is_what_vllm_and_transformers_load(setup, tmp_path):
    d, _ = setup
    export_hf_from_file(d / "draft.ddlw", tmp_path / "hf")
    _vllm_check(tmp_path / "hf")
    hf_e3.check_folder(tmp_path / "hf")


def test_exported_check_catches_a_wrong_shape(setup, tmp_path):
    """The folder check can fail: a draft vocabulary in config.json other than lm_head's rows."""
    d, _ = setup
    export_hf_from_file(d / "draft.ddlw", tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf/config.json").read_text())
    cfg["draft_vocab_size"] -= 1
    (tmp_path / "hf/config.json").write_text(json.dumps(cfg))
    with pytest.raises(HfError, match="lm_head"):
        hf_e3.check_folder(tmp_path / "hf")
    with pytest.raises(AssertionError):
        _vllm_check(tmp_path / "hf")


def test_a_published_folder_with_fields_missing_takes_vllms_defaults(setup, tmp_path):
    d, _ = setup
    export_hf_from_file(d / "draft.ddlw", tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf/config.json").read_text())
    for k in (
        "norm_before_residual",
        "rope_theta",
        "eagle_aux_hidden_state_layer_ids",
        "ddl_target",
        "head_dim",
    ):
        cfg.pop(k)
    (tmp_path / "hf/config.json").write_text(json.dumps(cfg))
    s = import_hf_to_file(tmp_path / "hf", tmp_path / "pub.ddlw")
    assert not s["bound_to_target"] and any("norm_before_residual absent" in n for n in s["notes"])
    b = ef.load_draft(tmp_path / "pub.ddlw")
    assert b.cfg.aux_layers == e3.default_aux_layers(6)  # from SGLang's eagle_config ids + 1
    assert b.cfg.norm_before_residual is False and b.cfg.rope_theta == 10000.0
    assert (
        ea.plan_aux(b, "pub", d / "t.ddlw").how == ea.SHAPES
    )  # unbound: checked by its shapes, and they fit
    # without any aux ids, the target's default needs the target
    cfg.pop("eagle_config")
    (tmp_path / "hf/config.json").write_text(json.dumps(cfg))
    with pytest.raises(HfError, match="--target"):
        import_hf_to_file(tmp_path / "hf", tmp_path / "pub2.ddlw")
    import_hf_to_file(tmp_path / "hf", tmp_path / "pub2.ddlw", target=d / "t.ddlw")
    assert ef.load_draft(tmp_path / "pub2.ddlw").cfg.aux_layers == e3.default_aux_layers(6)


# ----------------------------------------------------------------------------------------------------------
# stop, Ctrl-C and resume


def _train_stopped(d, out, **kw):
    with pytest.raises(dj.DraftInterrupted) as e:
        dj.train_draft(d / "t.ddlw", str(d / "text.txt"), out, dj.DraftConfig(**SMALL), **kw)
    return e.value


def test_stop_and_resume_give_the_same_bits(setup, tmp_path):
    d, _ = setup
    stopped = _train_stopped(d, tmp_path / "r.ddlw", stop_after=13)
    assert stopped.step == 13 and stopped.run_file == dj.run_path(tmp_path / "r.ddlw")
    assert not (tmp_path / "r.ddlw").exists()
    dj.resume(stopped.run_file)
    _same(ef.load_draft(d / "draft.ddlw"), ef.load_draft(tmp_path / "r.ddlw"))
    assert not stopped.run_file.exists()  # removed once the draft is written


def test_ctrl_c_keeps_the_last_whole_step(setup, tmp_path):
    d, _ = setup

    def progress(ev):  # a real SIGINT, delivered while step 7 is being reported
        if ev["event"] == "step" and ev["step"] == 7:
            os.kill(os.getpid(), signal.SIGINT)

    stopped = _train_stopped(d, tmp_path / "c.ddlw", progress=progress)
    assert stopped.step == 7 and stopped.message.startswith("interrupted after step 7")
    with open_checkpoint(stopped.run_file) as ck:
        assert ck.metadata[dj.RUN_KEY]["step"] == 7
    dj.resume(stopped.run_file)
    _same(ef.load_draft(d / "draft.ddlw"), ef.load_draft(tmp_path / "c.ddlw"))


def test_cli_stop_after_and_resume(setup, tmp_path, cli):
    d, _ = setup
    args = [f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items()]
    out = tmp_path / "x.ddlw"
    r = cli("draft", str(d / "t.ddlw"), "--data", str(d / "text.txt"), "--out", str(out), "--backend", "ref",
            "--stop-after", "5", *args)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "resolved configuration:" in r.stdout and "ttt=3" in r.stdout
    assert f"ddl-wgpu resume {dj.run_path(out)}" in r.stderr
    r = cli("resume", str(dj.run_path(out)))
    assert r.returncode == 0, r.stderr
    _same(ef.load_draft(d / "draft.ddlw"), ef.load_draft(out))


# ----------------------------------------------------------------------------------------------------------
# accept and generate


def test_cli_accept_reports_tau_and_the_table_reads_it(setup, tmp_path, cli):
    d, _ = setup
    r = cli("accept", str(d / "t.ddlw"), "--draft", str(d / "draft.ddlw"), "--data", str(d / "text.txt"),
            "--tokens", "3000", "--window", "32", "--backend", "ref", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["depth"] == 3 and len(res["prefix_acceptance"]) == 3 and res["anchors"] > 0
    A = res["prefix_acceptance"]
    assert res["acceptance_length"] == pytest.approx(1 + sum(A)) and A[0] > 0 and A[0] >= A[1] >= A[2]
    (tmp_path / "a.json").write_text(r.stdout)
    t = cli("accept-table", f"eagle3={tmp_path / 'a.json'}")
    assert t.returncode == 0 and "eagle3" in t.stdout and f"{res['acceptance_length']:.4f}" in t.stdout


def test_ttt_greedy_row_is_propose():
    """accept's measure (ttt_greedy) at row n − 1 is what vLLM's proposer drafts (`propose`)."""
    rng = np.random.default_rng(0)
    cfg = e3.Eagle3Config(hidden=8, n_heads=2, n_kv_heads=1, head_dim=4, intermediate=12, vocab=24,
                          draft_vocab=12, aux_layers=(1, 2, 3))  # fmt: skip
    p = e3.init_eagle3(cfg, 1, np.float64)
    d2t, _ = e3.draft_vocab(rng.integers(0, 50, 24), 12)
    embed, aux, ids = (
        rng.standard_normal((24, 8)),
        rng.standard_normal((1, 7, 24)),
        rng.integers(0, 24, (1, 7)),
    )
    preds = e3.ttt_greedy(p, cfg, aux, ids, embed, d2t, 3)
    for n in (3, 6):
        tids, _, _ = e3.propose(p, cfg, embed, aux[0, :n], ids[0, :n], int(ids[0, n]), d2t, 3)
        assert list(preds[0, :, n - 1]) == list(tids)


@pytest.mark.parametrize("trained", [True, False])
def test_speculative_greedy_text_is_plain_greedy(setup, trained):
    d, _ = setup
    m = load_model(d / "t.ddlw")
    draft = ef.load_draft(d / "draft.ddlw")
    if not trained:  # a random draft: most drafts rejected, the reject path at every depth
        draft = dataclasses.replace(draft, params=e3.init_eagle3(draft.cfg, 5))
    kept = 0
    for prompt in ("alpha beta gamma", "zeta eta", "theta"):
        plain = gen.generate(m, prompt, max_new_tokens=24, backend="ref")
        for depth in (1, 3):
            spec = gen.generate(m, prompt, max_new_tokens=24, backend="ref", speculative=True, depth=depth,
                                draft=draft)  # fmt: skip
            assert spec["token_ids"] == plain["token_ids"] and spec["text"] == plain["text"]
            assert spec["rounds"] > 0
            kept += spec["mean_accepted"] * spec["rounds"]
    if trained:
        assert kept > 0  # the accept path ran too


def test_cli_generate_with_the_draft(setup, cli):
    d, _ = setup
    base = (
        "generate",
        str(d / "t.ddlw"),
        "--prompt",
        "alpha beta",
        "--max-new-tokens",
        "16",
        "--backend",
        "ref",
    )
    plain = cli(*base)
    spec = cli(*base, "--speculative", "--draft", str(d / "draft.ddlw"))
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout and "draft depth 3" in spec.stderr


# ----------------------------------------------------------------------------------------------------------
# refusals


def test_a_draft_for_another_target_is_refused(setup, cli, user_error):
    d, _ = setup
    for args in (("generate", str(d / "other.ddlw"), "--prompt", "a", "--speculative"),
                 ("accept", str(d / "other.ddlw"), "--data", str(d / "text.txt"))):  # fmt: skip
        user_error(
            cli(*args, "--draft", str(d / "draft.ddlw"), "--backend", "ref"), "was trained for", "other.ddlw"
        )


def _hostile(d, tmp_path, edit) -> str:
    """The trained draft file rewritten with `edit(tensors, metadata)` applied -> its path."""
    with open_checkpoint(d / "draft.ddlw") as ck:
        tensors = {n: np.array(ck.tensor(n)) for n in ck.names()}
        meta = json.loads(json.dumps(ck.metadata))
    edit(tensors, meta)
    path = tmp_path / "bad.ddlw"
    save(path, tensors, metadata=meta)
    return str(path)


def _cfg(key, value):
    def edit(_t, meta):
        meta["eagle3"]["config"][key] = value

    return edit


HOSTILE = {
    "missing tensor": (lambda t, m: t.pop(e3.O_PROJ), "missing tensor"),
    "extra tensor": (lambda t, m: t.update(x=np.zeros(2, np.float32)), "unexpected tensor"),
    "wrong shape": (lambda t, m: t.update({e3.FC: t[e3.FC][:, :-1].copy()}), "has shape"),
    "non-finite": (lambda t, m: t[e3.NORM].__setitem__(0, np.nan), "non-finite"),
    "d2t not ascending": (lambda t, m: t["d2t"].__setitem__(0, 5), "ascending"),
    "t2d other ids": (lambda t, m: t["t2d"].__setitem__(slice(None), ~t["t2d"]), "t2d"),
    "d2t int32": (lambda t, m: t.update(d2t=t["d2t"].astype(np.int32)), "not i64"),
    "bad config": (_cfg("n_heads", -1), "bad EAGLE-3 config"),
    "unknown field": (_cfg("surprise", 1), "unknown field"),
    "no metadata": (lambda t, m: m.pop("eagle3"), "not an EAGLE-3 draft"),
    "bad positions": (lambda t, m: m["eagle3"].__setitem__("max_position_embeddings", "x"), "max_position"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_draft_files_are_refused(setup, tmp_path, case):
    d, _ = setup
    edit, match = HOSTILE[case]
    path = _hostile(d, tmp_path, edit)
    with pytest.raises(CheckpointError, match=match) as e:
        ef.load_draft(path)
    assert "\n" not in str(e.value) and path in str(e.value)


def test_hostile_draft_on_the_command_line_is_one_line(setup, tmp_path, cli, user_error):
    d, _ = setup
    path = _hostile(d, tmp_path, HOSTILE["wrong shape"][0])
    user_error(cli("generate", str(d / "t.ddlw"), "--prompt", "a", "--speculative", "--draft", path, "--backend", "ref"),
               "has shape")  # fmt: skip
    user_error(cli("export-hf", path, str(tmp_path / "out")), "has shape")
    user_error(
        cli("import-hf", str(tmp_path), str(tmp_path / "x.ddlw"))
    )  # no config.json: a model folder's line
    assert not (tmp_path / "out").exists() and not (tmp_path / "x.ddlw").exists()


def test_a_model_file_is_not_a_draft(setup):
    d, _ = setup
    with pytest.raises(CheckpointError, match="not an EAGLE-3 draft"):
        ef.load_draft(d / "t.ddlw")
    with pytest.raises(dj.DraftError, match="at least 4"):
        save_model(d / "short.ddlw", random_model(tiny_cfg("default", n_layers=3), 0))
        dj.train_draft(d / "short.ddlw", str(d / "text.txt"), d / "never.ddlw", dj.DraftConfig(**SMALL))
    assert not (d / "never.ddlw").exists()


def test_regenerate_trains_on_the_targets_greedy_continuations(setup):
    d, _ = setup
    cfg = dj.DraftConfig(**{**SMALL, "tokens": 1200, "regenerate": True, "prompt_len": 8})
    run = dj._Run(d / "t.ddlw", str(d / "text.txt"), cfg, "ref", dj.Events(None, "draft"))
    plain = dj._Run(d / "t.ddlw", str(d / "text.txt"), dataclasses.replace(cfg, regenerate=False), "ref",
                    dj.Events(None, "draft"))  # fmt: skip
    m = load_model(d / "t.ddlw")
    for w in (0, 7):
        n = int(run.lengths[w])
        ids = run.ids[w, :n]
        assert np.array_equal(ids[:8], plain.ids[w, :8])  # the data's prompt kept
        assert not np.array_equal(ids, plain.ids[w, :n])  # the rest is not the data
        logits = dj.make_eagle3_target("ref", m, (1, 2, 3))(ids[None]).logits[0]
        assert np.array_equal(ids[8:], np.argmax(logits, axis=-1)[7 : n - 1])  # each the target's argmax
