"""Healing an EAGLE-3 draft on a compressed target (issue 40, docs/eagle3.md#a-draft-on-a-compressed-target):
the draft's aux layer ids mapped through `compress`'s provenance (`files/eagle3_aux.py`), the `draft` job started
from a draft file (`heal --draft`, `draft --init FILE`), its acceptance before and after, resume, and the
refusals. Tiny shapes on the numpy backend (a 6-layer, 16-wide byte-level target, as tests/test_eagle3.py)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from helpers import make_text, random_model, tiny_cfg

from ddl_wgpu.files import eagle3_aux as ea
from ddl_wgpu.files import eagle3file as ef
from ddl_wgpu.files.container import CheckpointError
from ddl_wgpu.files.hf.convert import export_hf_from_file, import_hf_to_file
from ddl_wgpu.files.modelfile import load_model, save_model
from ddl_wgpu.jobs import draft as dj
from ddl_wgpu.jobs.compress import compress_file

SMALL = dict(tokens=4000, seq_len=32, ttt=3, batch_size=4, learning_rate=3e-3, eval_interval=10)
DROP = 3  # of the 6-layer target: its draft reads (2, 3, 3), and layer 3 is one of them


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    """A 6-layer target, a draft trained on it, the target with block 3 dropped, and the heal of the draft on
    that compressed target."""
    d = tmp_path_factory.mktemp("eagle3_heal")
    save_model(d / "t.ddlw", random_model(tiny_cfg("default", n_layers=6), 0))
    make_text(d / "text.txt", words=3000)
    dj.train_draft(d / "t.ddlw", str(d / "text.txt"), d / "draft.ddlw", dj.DraftConfig(**SMALL))
    compress_file(d / "t.ddlw", d / "small.ddlw", drop=[DROP])
    cfg = dj.DraftConfig(**{**SMALL, "learning_rate": 1e-2}, start=str(d / "draft.ddlw"))
    rep = dj.train_draft(d / "small.ddlw", str(d / "text.txt"), d / "healed.ddlw", cfg)
    return d, rep


# ----------------------------------------------------------------------------------------------------------
# the mapping


def test_compress_records_its_source_and_the_draft_maps_through_it(kit):
    d, _ = kit
    rec = load_model(d / "small.ddlw").provenance["compress"]
    assert rec["kept_layers"] == [0, 1, 2, 4, 5]
    assert rec["source"]["config_hash"] == ef.target_identity(d / "t.ddlw")["config_hash"]
    draft = ef.load_draft(d / "draft.ddlw")
    assert draft.cfg.aux_layers == (2, 3, 3)
    plan = ea.plan_aux(draft, d / "draft.ddlw", d / "small.ddlw")
    # 2 kept (still layer 2); 3 dropped: the input of old layer 4, now layer 3, is the same point of the stream
    assert plan.how == ea.MAPPED and plan.aux_layers == (2, 3, 3)
    assert (
        len(plan.notes) == 2 and "aux layer 3 was dropped" in plan.notes[0] and "now layer 3" in plan.notes[0]
    )
    assert ea.plan_aux(draft, d / "draft.ddlw", d / "t.ddlw").how == ea.AS_IS


def test_map_ids_is_the_count_of_kept_layers_below():
    origin = [0, 1, 4, 5, 7]  # layers 2, 3 and 6 of an 8-layer target dropped
    ids, notes = ea.map_ids((1, 3, 5), origin)
    assert (
        ids == (1, 2, 3)
        and len(notes) == 1
        and "aux layer 3 was dropped" in notes[0]
        and "4 (now layer 2)" in notes[0]
    )
    assert ea.map_ids((2, 4, 7), origin)[0] == (2, 2, 4)
    # the input of old layer 8 would be the final stream, of old layer 0's the embedding: no tap
    assert ea.map_ids((1, 2, 8), origin)[0] is None
    assert ea.map_ids((1, 2, 3), [3, 4, 5])[0] is None


def test_layer_origin_follows_the_chain_by_identity_and_by_layer_count():
    t = {"config_hash": "a", "tensors_hash": "b", "n_layers": 8}
    first = {"method": "drop_layers", "kept_layers": [0, 1, 2, 3, 5, 6, 7], "n_layers_before": 8,
             "n_layers_after": 7, "source": {"config_hash": "a", "tensors_hash": "b"}}  # fmt: skip
    narrow = {"method": "ffn_keep", "source": {"config_hash": "c", "tensors_hash": "d"}, "previous": first}
    second = {"method": "drop_layers", "kept_layers": [0, 2, 3, 4, 5, 6], "n_layers_before": 7, "n_layers_after": 6,
              "source": {"config_hash": "e", "tensors_hash": "f"}, "previous": narrow}  # fmt: skip
    records = ea.compress_records({"compress": second})
    assert [r["method"] for r in records] == ["drop_layers", "ffn_keep", "drop_layers"]
    assert ea.layer_origin(records, 6, t) == [0, 2, 3, 5, 6, 7]
    # another target's identity: not linked, even with the same layer count
    assert ea.layer_origin(records, 6, {**t, "config_hash": "x"}) is None
    # records from before `source` are matched by the layer count before them
    old = [{k: v for k, v in r.items() if k not in ("source", "previous")} for r in records]
    assert ea.layer_origin(old, 6, {**t, "config_hash": "x"}) == [0, 2, 3, 5, 6, 7]
    assert ea.layer_origin(old, 6, {**t, "n_layers": 9}) is None
    # a hostile record: kept_layers not a list of ints
    assert ea.layer_origin([{**old[0], "kept_layers": "0,1"}], 6, {**t, "config_hash": "x"}) is None


def test_an_unbound_draft_on_a_model_with_dropped_blocks_needs_aux_layers(kit):
    d, _ = kit
    draft = ef.load_draft(d / "draft.ddlw")
    unbound = dataclasses.replace(draft, target={"config_hash": None, "tensors_hash": None})
    with pytest.raises(CheckpointError, match="--aux-layers"):
        ea.plan_aux(unbound, "pub", d / "small.ddlw")
    plan = ea.plan_aux(unbound, "pub", d / "small.ddlw", given=(1, 2, 4))
    assert plan.how == ea.GIVEN and plan.aux_layers == (1, 2, 4)
    with pytest.raises(CheckpointError, match="inputs 1..4"):
        ea.plan_aux(unbound, "pub", d / "small.ddlw", given=(1, 2, 5))
    # an unbound draft that knows its target's layer count follows an older record's layer count
    counted = dataclasses.replace(draft, target={"config_hash": None, "tensors_hash": None, "n_layers": 6})
    assert ea.plan_aux(counted, "pub", d / "small.ddlw").aux_layers == (2, 3, 3)


def test_a_published_folder_imported_with_its_target_maps_onto_the_compressed_copy(kit, tmp_path):
    """The user story's `import-hf EAGLE_FOLDER draft.ddlw --target base.ddlw`: a folder that names no target is
    bound to --target's model, so its layers map onto a compressed copy as a draft trained here does."""
    d, _ = kit
    export_hf_from_file(d / "draft.ddlw", tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf/config.json").read_text())
    cfg.pop("ddl_target")  # as published by others
    (tmp_path / "hf/config.json").write_text(json.dumps(cfg))
    unbound = import_hf_to_file(tmp_path / "hf", tmp_path / "pub.ddlw")
    assert not unbound["bound_to_target"]
    with pytest.raises(CheckpointError, match="--aux-layers"):
        dj.plan_for(d / "small.ddlw", tmp_path / "pub.ddlw")
    bound = import_hf_to_file(tmp_path / "hf", tmp_path / "pub2.ddlw", target=d / "t.ddlw")
    assert bound["bound_to_target"] and any("bound to the target" in n for n in bound["notes"])
    _draft, plan = dj.plan_for(d / "small.ddlw", tmp_path / "pub2.ddlw")
    assert plan.how == ea.MAPPED and plan.aux_layers == (2, 3, 3)


# ----------------------------------------------------------------------------------------------------------
# the heal


def test_heal_lowers_the_loss_and_raises_tau_on_the_compressed_target(kit):
    d, rep = kit
    assert rep["start"]["aux"]["how"] == ea.MAPPED
    assert rep["heldout_loss_end"] < 0.9 * rep["heldout_loss_start"], rep["history"]
    before, after = rep["acceptance_start"], rep["acceptance"]
    assert after["anchors"] == before["anchors"] > 0
    assert after["acceptance_length"] > before["acceptance_length"] + 0.05, (before, after)
    healed, draft = ef.load_draft(d / "healed.ddlw"), ef.load_draft(d / "draft.ddlw")
    assert healed.cfg.aux_layers == (2, 3, 3)
    assert np.array_equal(healed.d2t, draft.d2t) and np.array_equal(healed.t2d, draft.t2d)
    assert healed.target["config_hash"] == ef.target_identity(d / "small.ddlw")["config_hash"]
    # now bound to the compressed target
    assert ea.plan_aux(healed, "healed", d / "small.ddlw").how == ea.AS_IS
    # `accept` measures both drafts on the compressed target with the same mapping, on other windows
    kw = dict(depth=3, window=32, tokens=3000)
    unhealed = dj.accept_file(d / "small.ddlw", d / "draft.ddlw", str(d / "text.txt"), **kw)
    fixed = dj.accept_file(d / "small.ddlw", d / "healed.ddlw", str(d / "text.txt"), **kw)
    assert unhealed["aux"]["aux_layers"] == [2, 3, 3] and unhealed["anchors"] == fixed["anchors"]
    assert fixed["acceptance_length"] > unhealed["acceptance_length"], (unhealed, fixed)


def test_the_start_draft_is_where_the_heal_begins(kit, tmp_path):
    """Step 0's held-out loss is the start draft's on the compressed target, well below a fresh draft's."""
    d, rep = kit
    seen = []
    fresh = dj.DraftConfig(**{**SMALL, "draft_vocab": ef.load_draft(d / "draft.ddlw").cfg.draft_vocab,
                              "aux_layers": (2, 3, 3)})  # fmt: skip
    with pytest.raises(dj.DraftInterrupted):
        dj.train_draft(d / "small.ddlw", str(d / "text.txt"), tmp_path / "f.ddlw", fresh, stop_after=1,
                       progress=lambda ev: seen.append(ev))  # fmt: skip
    step0 = next(ev["loss"] for ev in seen if ev["event"] == "eval" and ev["step"] == 0)
    assert rep["heldout_loss_start"] < 0.8 * step0


def test_heal_on_the_gpu_is_the_numpy_heal(gpu, kit, tmp_path):
    """`heal --draft --backend wgpu` (lavapipe): the same losses within float32 and the same acceptance."""
    d, _ = kit
    cfg = dj.DraftConfig(**{**SMALL, "learning_rate": 1e-2, "teacher_k": 4}, start=str(d / "draft.ddlw"))
    reps = [dj.train_draft(d / "small.ddlw", str(d / "text.txt"), tmp_path / f"{b}.ddlw", cfg, backend=b)
            for b in ("ref", "wgpu")]  # fmt: skip
    ref, wgpu = reps
    assert wgpu["backend"] == "wgpu" and wgpu["start"] == ref["start"]
    for key in ("heldout_loss_start", "heldout_loss_end"):
        assert wgpu[key] == pytest.approx(ref[key], rel=1e-5), key
    assert ref["heldout_loss_end"] < 0.9 * ref["heldout_loss_start"]
    assert wgpu["acceptance"]["prefix_acceptance"] == ref["acceptance"]["prefix_acceptance"]


def test_a_stopped_heal_resumes_to_the_same_bits(kit, tmp_path):
    d, _ = kit
    cfg = dj.DraftConfig(**SMALL, start=str(d / "draft.ddlw"))
    whole = dj.train_draft(d / "small.ddlw", str(d / "text.txt"), tmp_path / "a.ddlw", cfg)
    with pytest.raises(dj.DraftInterrupted) as e:
        dj.train_draft(d / "small.ddlw", str(d / "text.txt"), tmp_path / "b.ddlw", cfg, stop_after=11)
    (tmp_path / "moved.ddlw").write_bytes((d / "draft.ddlw").read_bytes())  # the start is not read again
    rep = dj.resume(e.value.run_file)
    a, b = ef.load_draft(tmp_path / "a.ddlw"), ef.load_draft(tmp_path / "b.ddlw")
    for n in a.params:
        assert np.array_equal(a.params[n], b.params[n]), n
    assert rep["acceptance_start"] == whole["acceptance_start"] and rep["history"] == whole["history"]
    assert rep["start"] == whole["start"]


# ----------------------------------------------------------------------------------------------------------
# the command line


def test_cli_heal_with_a_draft_and_accept_with_the_mapping(kit, tmp_path, cli, ok):
    d, _ = kit
    r = ok(cli("heal", d / "small.ddlw", "--draft", d / "draft.ddlw", "--data", d / "text.txt", "--out",
               tmp_path / "h.ddlw", "--tokens", "2000", "--window", "32", "--chain", "2", "--lr", "2e-3",
               "--backend", "ref"))  # fmt: skip
    assert (
        "aux layers [2, 3, 3] (the draft's [2, 3, 3] mapped" in r.stderr
        and "aux layer 3 was dropped" in r.stderr
    )
    assert "healed" in r.stdout and "τ at depth 3" in r.stdout and "->" in r.stdout
    assert ef.load_draft(tmp_path / "h.ddlw").cfg.ttt == 2
    r = ok(cli("accept", d / "small.ddlw", "--draft", d / "draft.ddlw", "--data", d / "text.txt", "--tokens",
               "1500", "--backend", "ref", "--json"))  # fmt: skip
    assert json.loads(r.stdout)["aux"]["how"] == ea.MAPPED and "was dropped" in r.stderr
    # draft --init FILE is the same trainer with all of its options
    r = ok(cli("draft", d / "small.ddlw", "--init", d / "draft.ddlw", "--data", d / "text.txt", "--out",
               tmp_path / "i.ddlw", "--tokens", "2000", "--seq-len", "32", "--ttt", "2", "--stop-after", "3",
               "--backend", "ref"))  # fmt: skip
    assert "from " in r.stderr and (tmp_path / "i.run.ddlw").is_file()


def test_cli_refusals_are_one_line(kit, tmp_path, cli, user_error):
    d, _ = kit
    heal = (
        "heal",
        d / "small.ddlw",
        "--data",
        d / "text.txt",
        "--out",
        tmp_path / "o.ddlw",
        "--backend",
        "ref",
    )
    user_error(cli(*heal, "--draft", d / "t.ddlw"), "not an EAGLE-3 draft", "a model file")
    user_error(cli(*heal, "--draft", d / "draft.ddlw", "--refresh", "10"), "--refresh", "draft MODEL --init")
    user_error(cli(*heal, "--aux-layers", "1,2,3"), "--aux-layers", "--draft")
    user_error(cli("draft", d / "small.ddlw", "--init", "targte", "--data", d / "text.txt", "--out",
                   tmp_path / "x.ddlw", "--backend", "ref"), "--init takes target, random or an EAGLE-3 draft")  # fmt: skip
    user_error(cli(*heal, "--draft", d / "draft.ddlw", "--aux-layers", "1,2,9"), "--aux-layers", "1..4")
    wide = tmp_path / "wide.ddlw"
    save_model(wide, random_model(tiny_cfg("default", n_layers=6, d_model=32, n_heads=4), 0))
    user_error(cli("heal", wide, "--draft", d / "draft.ddlw", "--data", d / "text.txt", "--out",
                   tmp_path / "w.ddlw", "--backend", "ref"), "hidden size is 16", "32")  # fmt: skip
    other = tmp_path / "other.ddlw"
    save_model(other, random_model(tiny_cfg("default", n_layers=6), 1))
    user_error(cli("accept", other, "--draft", d / "draft.ddlw", "--data", d / "text.txt", "--backend", "ref"),
               "was trained for", "--aux-layers")  # fmt: skip
    r = cli("accept", other, "--draft", d / "draft.ddlw", "--aux-layers", "2,3,3", "--data", d / "text.txt",
            "--tokens", "800", "--backend", "ref")  # fmt: skip
    assert r.returncode == 0 and "as given (--aux-layers)" in r.stderr, r.stderr
    assert not (tmp_path / "o.ddlw").exists()


def test_a_target_too_shallow_for_the_default_names_aux_layers(kit, tmp_path):
    d, _ = kit
    save_model(tmp_path / "s.ddlw", random_model(tiny_cfg("default", n_layers=3), 0))
    with pytest.raises(dj.DraftError, match="--aux-layers"):
        dj.train_draft(tmp_path / "s.ddlw", str(d / "text.txt"), tmp_path / "x.ddlw", dj.DraftConfig(**SMALL))
