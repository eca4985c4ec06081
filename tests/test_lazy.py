"""Tensors in pieces (ddl_wgpu.files.lazy) and the file commands that stream them: with pieces of a few rows
(PIECE_BYTES made tiny), every source, transform and writer gives the bytes the whole tensor gives, a corrupt
tensor read a piece at a time is refused before its output is in place, and compress and the HF round trip give
the same files whatever the piece size."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from helpers import tiny_cfg

from ddl_ref.check import random_params
from ddl_ref.config import MtpConfig, apply_arch
from ddl_wgpu.files import lazy
from ddl_wgpu.files.container import CheckpointError, bf16_to_f32, f32_to_bf16, open_checkpoint, save
from ddl_wgpu.files.hf.convert import export_hf_from_file, import_hf_to_file
from ddl_wgpu.files.hf.folder import StTensor, Weights, write_safetensors
from ddl_wgpu.files.modelfile import Model, open_model, save_model, write_model
from ddl_wgpu.jobs.compress import compress_file, ffn_importance


@pytest.fixture
def small_pieces(monkeypatch):
    monkeypatch.setattr(lazy, "PIECE_BYTES", 40)  # a few rows (or elements) per piece


def test_sources_and_transforms_piece_by_piece(small_pieces, tmp_path):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((13, 5)).astype(np.float32)
    a[2, 3] = np.nan
    t = lazy.from_array(a)
    assert len(list(t.pieces())) > 3 and np.array_equal(t.array(), a, equal_nan=True)
    assert np.array_equal(t.to("bf16").array(), f32_to_bf16(a) | 0)  # f32_to_bf16's rounding, NaN quiet
    bits = f32_to_bf16(a)
    back = lazy.from_array(bits, "bf16").to("f32").to("bf16").array()
    assert np.array_equal(back, bits)  # a bf16 value read and written back is the same bytes
    assert np.array_equal(lazy.from_array(bits, "bf16").to("f32").array(), bf16_to_f32(bits), equal_nan=True)
    rows = np.array([0, 4, 5, 12])
    assert np.array_equal(t.take_rows(rows).array(), a[rows], equal_nan=True)
    assert np.array_equal(t.reshape((13, 1, 5)).array(), a.reshape(13, 1, 5), equal_nan=True)
    assert np.array_equal(lazy.from_array(np.float32(3.0)).array(), np.float32(3.0))
    assert lazy.from_array(np.zeros((0, 4), np.float32)).array().shape == (0, 4)
    # the container and safetensors readers hand out the same rows
    save(tmp_path / "c.ddlw", {"a": a, "b": bits.view(np.uint16)})
    with open_checkpoint(tmp_path / "c.ddlw") as ck:
        assert (
            np.array_equal(ck.lazy("a").array(), a, equal_nan=True) and len(list(ck.lazy("a").pieces())) > 3
        )
    write_safetensors(tmp_path / "model.safetensors", [StTensor("w", "BF16", (13, 5), lazy.from_array(bits, "bf16"))],
                      {"format": "pt"})  # fmt: skip
    (tmp_path / "config.json").write_text("{}")
    w = Weights(tmp_path)
    assert np.array_equal(w.lazy("w").array(), bits) and w.read_raw("w").tobytes() == bits.tobytes()


def test_a_corrupt_tensor_read_in_pieces_leaves_no_output(small_pieces, tmp_path):
    m = Model(tiny_cfg(), random_params(tiny_cfg(), seed=0))
    save_model(tmp_path / "m.ddlw", m)
    with open_checkpoint(tmp_path / "m.ddlw") as ck:
        info = ck.info("model.layers.1.mlp.down_proj.weight")
        start = ck._file_of[info.name].data_start
    blob = bytearray((tmp_path / "m.ddlw").read_bytes())
    blob[start + info.offset + info.nbytes - 1] ^= 1  # in the last piece
    (tmp_path / "bad.ddlw").write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match="hash mismatch"):
        compress_file(tmp_path / "bad.ddlw", tmp_path / "c.ddlw", drop=[0])
    assert not (tmp_path / "c.ddlw").exists() and not list(tmp_path.glob("*.partial"))


def test_piece_size_changes_no_byte(monkeypatch, tmp_path):
    """compress (both methods) and an HF round trip of a bf16 hybrid with a draft: the same files with pieces of
    a few rows as with whole tensors, and the importance of ffn_keep is numpy's over the whole tensor."""
    cfg = apply_arch(tiny_cfg(n_layers=4, mtp=MtpConfig()), "qwen3_5")
    m = Model(cfg, {n: a.astype(np.float32) for n, a in random_params(cfg, seed=3).items()})
    save_model(tmp_path / "m.ddlw", m, dtype="bf16")

    def run() -> dict[str, bytes]:
        d = tmp_path / "run"  # one path for both runs: the import records its source folder
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
        compress_file(tmp_path / "m.ddlw", d / "keep.ddlw", keep=0.5)
        compress_file(tmp_path / "m.ddlw", d / "drop.ddlw", drop=[1])
        export_hf_from_file(tmp_path / "m.ddlw", d / "hf")
        import_hf_to_file(d / "hf", d / "back.ddlw")
        return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}

    whole = run()
    monkeypatch.setattr(lazy, "PIECE_BYTES", 40)
    assert run() == whole
    with open_checkpoint(tmp_path / "m.ddlw") as ck:
        tensors = {n: ck.lazy(n) for n in ck.names()}
        p = "model.layers.2."
        g, u, d = (
            bf16_to_f32(ck.tensor(p + f"mlp.{k}_proj.weight")).astype(np.float64)
            for k in ("gate", "up", "down")
        )
        want = np.linalg.norm(g, axis=1) * np.linalg.norm(u, axis=1) * np.linalg.norm(d, axis=0)
        assert np.array_equal(ffn_importance(tensors, p), want)


def test_a_long_write_says_its_progress(small_pieces, monkeypatch, tmp_path):
    """A write of more than `quiet` bytes says how far it is, at most every `every` seconds; a small one is quiet."""
    m = Model(tiny_cfg(), random_params(tiny_cfg(), seed=0))
    lines = []
    p = lazy.Progress(
        "writing x", [lazy.from_array(a) for a in m.params.values()], lines.append, every=0, quiet=0
    )
    for a in m.params.values():
        list(p.wrap(lazy.from_array(a)).pieces())
    assert lines and lines[-1].startswith("writing x: 0.00 of 0.00 GB written (100 %") and p.done == p.total
    quiet = []
    save_model(tmp_path / "m.ddlw", m)  # through write_model: nothing said for a small model
    with open_model(tmp_path / "m.ddlw") as lm:
        write_model(tmp_path / "c.ddlw", lm, quiet.append)
    assert quiet == [] and (tmp_path / "c.ddlw").read_bytes() == (tmp_path / "m.ddlw").read_bytes()
