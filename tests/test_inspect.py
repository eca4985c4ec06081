"""Tests for ddl_wgpu.files.inspect: describe() and render_text() on good, sharded and corrupt checkpoints."""

from __future__ import annotations

import json
import struct

import msgpack
import numpy as np
import pytest

from ddl_wgpu.files import container as C
from ddl_wgpu.files.container import CheckpointError, save
from ddl_wgpu.files.inspect import describe, render_text


@pytest.fixture
def ckpt(tmp_path):
    p = tmp_path / "model.ddlw"
    save(
        p,
        [
            ("embed.weight", np.ones((10, 4), np.uint16), "bf16"),
            ("norm.weight", np.ones(4, np.float32)),
            ("step", np.array(7, np.int64)),
        ],
        config={"d_model": 4, "vocab_size": 10, "rope_theta": float("inf")},
        metadata={"model": {"variant": "ddl"}, "train": {"step": 7}},
        provenance={"train": {"seed": 3, "blob": b"\x00\x01"}},
        tokenizer=b'{"version": "1.0"}',
    )
    return p


def test_describe_good_file(ckpt):
    d = describe(ckpt)
    json.dumps(d, allow_nan=False)  # strictly JSON-serialisable
    assert d["path"] == str(ckpt)
    assert d["format_version"] == 2
    assert d["file_size"] == ckpt.stat().st_size
    assert d["num_tensors"] == 3
    assert d["total_params"] == 40 + 4 + 1
    assert d["tensor_bytes"] == 80 + 16 + 8
    assert d["dtypes"] == {
        "bf16": {"tensors": 1, "params": 40, "nbytes": 80},
        "f32": {"tensors": 1, "params": 4, "nbytes": 16},
        "i64": {"tensors": 1, "params": 1, "nbytes": 8},
    }
    assert d["config"]["d_model"] == 4 and d["config"]["rope_theta"] == "inf"
    assert d["metadata"] == {"model": {"variant": "ddl"}, "train": {"step": 7}}
    assert d["provenance"] == {"train": {"blob": "<2 bytes>", "seed": 3}}
    assert d["has_tokenizer"] is True and d["tokenizer_bytes"] == 18
    assert d["shard"] is None
    assert [t["name"] for t in d["tensors"]] == ["embed.weight", "norm.weight", "step"]
    assert d["tensors"][0] == {
        "name": "embed.weight",
        "dtype": "bf16",
        "shape": [10, 4],
        "nbytes": 80,
        "hash": d["tensors"][0]["hash"],
        "file": "model.ddlw",
    }
    assert len(d["tensors"][0]["hash"]) == 16
    assert d["tensors"][2]["shape"] == []
    assert d["verified"] is False


def test_describe_verify(ckpt, tmp_path):
    assert describe(ckpt, verify=True)["verified"] is True
    # flip a byte of the last tensor's data: opening still works, verification names the tensor
    blob = bytearray(ckpt.read_bytes())
    blob[-1] ^= 0xFF
    bad = tmp_path / "bad.ddlw"
    bad.write_bytes(bytes(blob))
    assert describe(bad)["num_tensors"] == 3
    with pytest.raises(CheckpointError, match="tensor 'step': hash mismatch"):
        describe(bad, verify=True)


def test_describe_corrupt_file_raises(ckpt, tmp_path):
    blob = bytearray(ckpt.read_bytes())
    bad = tmp_path / "trunc.ddlw"
    bad.write_bytes(bytes(blob[:-3]))
    with pytest.raises(CheckpointError, match="truncated"):
        describe(bad)
    blob[:4] = b"GGUF"
    bad.write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match="bad magic b'GGUF'"):
        describe(bad)
    with pytest.raises(CheckpointError, match="no such file"):
        describe(tmp_path / "missing.ddlw")


def test_render_text(ckpt):
    text = render_text(describe(ckpt, verify=True))
    lines = text.splitlines()
    assert lines[0] == f"checkpoint  {ckpt}"
    assert "ddlw v2" in text and "3, 45 parameters" in text
    assert "bf16: 1 tensors / 40" in text
    assert "verified    header checksum and all tensor hashes match" in text
    assert "  model.variant = 'ddl'" in text  # hierarchical metadata shown with dotted keys
    assert "  train.seed = 3" in text
    header_row = next(i for i, line in enumerate(lines) if line.startswith("name"))
    assert lines[header_row].split() == ["name", "dtype", "shape", "size", "hash"]
    assert set(lines[header_row + 1]) <= {"-", " "}
    row = lines[header_row + 2].split()
    assert row[:3] == ["embed.weight", "bf16", "[10,"] and row[-1] == describe(ckpt)["tensors"][0]["hash"]
    assert any(line.startswith("step ") and "[]" in line for line in lines)
    assert lines[-1].startswith("  train.")  # provenance last
    assert text.index("provenance:") > header_row


def test_describe_sharded_and_empty(tmp_path):
    p = tmp_path / "s.ddlw"
    t = {f"t{i}": np.zeros(100, np.float32) for i in range(3)}
    save(p, t, shard_bytes=500)
    d = describe(p)
    assert d["shard"]["count"] == 3 and len(d["files"]) == 3
    assert d["num_tensors"] == 3 and [x["file"] for x in d["tensors"]] == [
        f"s-0000{i}-of-00003.ddlw" for i in (1, 2, 3)
    ]
    assert "shards      3" in render_text(d)
    e = tmp_path / "e.ddlw"
    save(e, {})
    d = describe(e)
    assert d["num_tensors"] == 0 and d["total_params"] == 0 and d["config"] is None
    text = render_text(d)
    assert "dtypes      (none)" in text and "config: (none)" in text
    n = struct.unpack("<Q", e.read_bytes()[8:16])[0]
    assert d["file_size"] == C.align_up(16 + n + 8)  # header, its 8-byte checksum, padding; no tensors


def test_inspect_catches_a_renamed_tensor_and_says_what_was_checked(ckpt, tmp_path):
    assert describe(ckpt)["header_checksum"] is True
    blob = bytearray(ckpt.read_bytes())
    blob[blob.index(b"embed.weight")] ^= ord("e") ^ ord("f")  # "fmbed.weight": a well-formed header
    bad = tmp_path / "renamed.ddlw"
    bad.write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match="header checksum mismatch"):
        describe(bad)
    # a version 1 file (no checksum) is still inspected, and the report says what was not checked
    n = struct.unpack("<Q", blob[8:16])[0]
    hdr = msgpack.unpackb(ckpt.read_bytes()[16 : 16 + n], raw=False)
    hdr["version"] = 1
    raw = msgpack.packb(hdr, use_bin_type=True)
    start = C.align_up(16 + len(raw))
    data = ckpt.read_bytes()[C.align_up(16 + n + 8) :]
    old = tmp_path / "v1.ddlw"
    old.write_bytes(b"DDLW" + struct.pack("<IQ", 1, len(raw)) + raw + bytes(start - 16 - len(raw)) + data)
    d = describe(old, verify=True)
    assert d["format_version"] == 1 and d["header_checksum"] is False
    assert "verified    all tensor hashes match (format version 1 has no header checksum)" in render_text(d)
