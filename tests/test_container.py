"""Tests for the .ddlw checkpoint container: round trips, determinism, sharding, hostile files, crash safety,
lazy reads and hash verification."""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
import sys
from pathlib import Path

import msgpack
import numpy as np
import pytest
from helpers import tiny_cfg
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddl_wgpu.files import container as C
from ddl_wgpu.files import container_format as CF
from ddl_wgpu.files import container_read as CR
from ddl_wgpu.files.container import CheckpointError, Writer, bf16_to_f32, f32_to_bf16, open_checkpoint, save

# ------------------------------------------------------------------------------------------------ helpers


def h8(b: bytes) -> str:
    return hashlib.blake2b(b, digest_size=8).hexdigest()


def sample_tensors(rng) -> dict[str, np.ndarray]:
    return {
        "emb": rng.standard_normal((5, 7)).astype(np.float32),
        "scalar": np.array(3.5, dtype=np.float64),
        "empty": np.zeros((0, 3), dtype=np.float16),
        "odd": rng.integers(0, 255, size=13, dtype=np.uint8),
        "w4": rng.integers(-9, 9, size=(2, 3, 1, 5), dtype=np.int32),
    }


def craft(path, header, data: bytes = b"", *, magic=C.MAGIC, version=1, n=None, pad_byte=0) -> str:
    """Write magic + version + length + header + padding + data by hand, so each reader check is hit exactly.
    `header` is a dict (packed here) or raw bytes."""
    raw = header if isinstance(header, bytes) else msgpack.packb(header, use_bin_type=True)
    n = len(raw) if n is None else n
    start = C.align_up(16 + len(raw))
    blob = magic + struct.pack("<IQ", version, n) + raw + bytes([pad_byte]) * (start - 16 - len(raw)) + data
    with open(path, "wb") as f:
        f.write(blob)
    return str(path)


def data_start(path) -> int:
    """Where the tensor data of a written (version 2) file starts: after the header and its checksum."""
    n = struct.unpack("<Q", Path(path).read_bytes()[8:16])[0]
    return C.align_up(16 + n + 8)


def flip(path, pos: int, out, mask: int = 0x10):
    blob = bytearray(Path(path).read_bytes())
    blob[pos] ^= mask
    Path(out).write_bytes(bytes(blob))
    return out


def entry(dtype="f32", shape=(4,), offset=0, nbytes=None, data=None, hash=None):
    if nbytes is None:
        nbytes = int(np.prod(shape)) * C.DTYPES[dtype].itemsize if dtype in C.DTYPES else 16
    if hash is None:
        hash = h8(data if data is not None else b"\0" * nbytes)
    return {"dtype": dtype, "shape": list(shape), "offset": offset, "nbytes": nbytes, "hash": hash}


def header(tensors=None, **over):
    h = {
        "format": "ddlw",
        "version": 1,
        "tensors": {} if tensors is None else tensors,
        "config": None,
        "metadata": {},
        "provenance": {},
        "tokenizer": None,
        "shard": None,
    }
    h.update(over)
    return h


def expect_error(path, *fragments, file=None):
    """Opening `path` and reading every tensor raises one CheckpointError: a single line that starts with
    the offending file (`path`, or `file` for a shard of the set) and contains every fragment."""
    with pytest.raises(CheckpointError) as ei, open_checkpoint(path) as ck:
        for n in ck.names():
            ck.tensor(n)
    msg = str(ei.value)
    assert "\n" not in msg
    assert msg.startswith(str(file or path) + ": "), msg
    for frag in fragments:
        assert frag in msg, msg
    return msg


# --------------------------------------------------------------------------------------------- round trip


@pytest.mark.parametrize(
    "dtype", ["f32", "f16", "bf16", "f64", "i32", "u32", "i64", "u8", "i8", "u16", "bool"]
)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (7,), (2, 3, 4, 5)])
def test_round_trip_every_dtype_and_shape(tmp_path, rng, dtype, shape):
    npd = C.DTYPES[dtype]
    if dtype == "bool":
        arr = rng.integers(0, 2, size=shape).astype(bool)
    else:
        arr = rng.integers(0, 200, size=shape).astype(npd)
    p = tmp_path / "t.ddlw"
    save(p, [("x", arr, dtype), ("tail", np.arange(3, dtype=np.int8))])
    with open_checkpoint(p) as ck:
        info = ck.info("x")
        assert (info.dtype, info.shape, info.nbytes) == (dtype, shape, arr.nbytes)
        got = ck.tensor("x")
        assert got.shape == shape and got.dtype == npd
        np.testing.assert_array_equal(got, arr)
        view = ck.tensor("x", copy=False)
        np.testing.assert_array_equal(view, arr)
        assert not view.flags.writeable
        np.testing.assert_array_equal(ck.tensor("tail"), np.arange(3))
        ck.verify()


def test_round_trip_header_fields_and_api(tmp_path, rng):
    t = sample_tensors(rng)
    cfg = {"d_model": 64, "n_layer": 2, "rope_theta": 1e6, "tie": True, "layers": ["a", "b"], "none": None}
    meta = {"model": {"variant": "ddl"}, "train": {"step": 1200, "loss": 2.5}}
    prov = {"train": {"seed": 1, "argv": ["ddl-wgpu", "train"]}, "heal_mtp": {"steps": 10}}
    tok = b'{"model": {"type": "BPE"}}'
    p = tmp_path / "m.ddlw"
    assert save(p, t, config=cfg, metadata=meta, provenance=prov, tokenizer=tok) == [p]
    with open_checkpoint(p) as ck:
        assert ck.config == cfg and ck.metadata == meta and ck.provenance == prov and ck.tokenizer == tok
        assert ck.header["format"] == "ddlw" and ck.header["shard"] is None
        assert ck.names() == list(t)
        assert "emb" in ck and "nope" not in ck and len(ck) == 5
        assert ck.nbytes == sum(a.nbytes for a in t.values())
        assert ck.path == p and ck.files == [p]
        for k, a in ck.tensors().items():
            np.testing.assert_array_equal(a, t[k])
        assert ck.info("emb").hash == h8(t["emb"].tobytes())
        np.testing.assert_array_equal(ck.tensor_f32("scalar"), np.float32(3.5))
        assert ck.tensor_f32("empty").dtype == np.float32
        with pytest.raises(CheckpointError, match="expected a float dtype"):
            ck.tensor_f32("odd")
        with pytest.raises(KeyError):
            ck.tensor("nope")


def test_layout_on_disk(tmp_path, rng):
    t = sample_tensors(rng)
    p = tmp_path / "m.ddlw"
    save(p, t, metadata={"a": 1})
    blob = p.read_bytes()
    assert blob[:4] == b"DDLW"
    version, n = struct.unpack("<IQ", blob[4:16])
    assert version == 2
    hdr = msgpack.unpackb(blob[16 : 16 + n])
    assert hdr["version"] == 2
    assert blob[16 + n : 24 + n] == hashlib.blake2b(blob[: 16 + n], digest_size=8).digest()
    start = C.align_up(16 + n + 8, 64)
    assert blob[24 + n : start] == b"\0" * (start - 24 - n)
    end = 0
    for name, e in hdr["tensors"].items():
        assert e["offset"] % 64 == 0 and e["offset"] == C.align_up(end)
        assert blob[start + end : start + e["offset"]] == b"\0" * (e["offset"] - end)
        assert blob[start + e["offset"] : start + e["offset"] + e["nbytes"]] == t[name].tobytes()
        end = e["offset"] + e["nbytes"]
    assert len(blob) == start + end


def test_no_tensors_file_ends_at_data_start(tmp_path):
    p = tmp_path / "e.ddlw"
    save(p, {}, config={"x": 1})
    n = struct.unpack("<Q", p.read_bytes()[8:16])[0]
    assert p.stat().st_size == C.align_up(16 + n)
    with open_checkpoint(p) as ck:
        assert ck.names() == [] and ck.config == {"x": 1}
        ck.verify()


def test_deterministic_bytes(tmp_path, rng):
    t = sample_tensors(rng)
    a, b = tmp_path / "a.ddlw", tmp_path / "b.ddlw"
    save(a, t, config={"b": 1, "a": 2}, metadata={"z": {"y": 1, "x": 2}}, provenance={"train": {}})
    # same content, other dict insertion order and other container types: same bytes
    save(
        b,
        list(t.items()),
        config={"a": 2, "b": 1},
        metadata={"z": {"x": 2, "y": np.int64(1)}},
        provenance={"train": {}},
    )
    assert a.read_bytes() == b.read_bytes()


def test_big_endian_and_non_contiguous_inputs(tmp_path, rng):
    x = rng.standard_normal((6, 8)).astype(np.float32)
    p = tmp_path / "m.ddlw"
    save(p, {"be": x.astype(">f4"), "t": x.T, "s": x[::2, 1::3]})
    with open_checkpoint(p) as ck:
        np.testing.assert_array_equal(ck.tensor("be"), x)
        np.testing.assert_array_equal(ck.tensor("t"), x.T)
        np.testing.assert_array_equal(ck.tensor("s"), x[::2, 1::3])
        assert ck.info("be").dtype == "f32"


def test_writer_rejects_bad_input(tmp_path):
    p = tmp_path / "m.ddlw"
    with pytest.raises(TypeError, match="not storable"):
        save(p, {"c": np.zeros(2, np.complex64)})
    with pytest.raises(TypeError, match="does not match"):
        save(p, [("x", np.zeros(2, np.float32), "f16")])
    with pytest.raises(ValueError, match="unknown dtype"):
        save(p, [("x", np.zeros(2, np.float32), "q4")])
    with pytest.raises(ValueError, match="duplicate tensor name"):
        save(p, [("x", np.zeros(2)), ("x", np.zeros(2))])
    with pytest.raises(ValueError, match="non-empty str"):
        save(p, [("", np.zeros(2))])
    with pytest.raises(TypeError, match="keys must be str"):
        save(p, {}, metadata={1: 2})
    with pytest.raises(TypeError, match="cannot store"):
        save(p, {}, config={"x": np.zeros(3)})
    with pytest.raises(ValueError, match="declared but not written"), Writer(p, [("a", "f32", (2,))]):
        pass
    with (
        pytest.raises(ValueError, match="out of order"),
        Writer(p, [("a", "f32", (2,)), ("b", "f32", (2,))]) as w,
    ):
        w.write("b", np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="shape"), Writer(p, [("a", "f32", (2,))]) as w:
        w.write("a", np.zeros(3, np.float32))
    assert os.listdir(tmp_path) == []


def test_writer_streaming(tmp_path, rng):
    a = rng.standard_normal((3, 4)).astype(np.float32)
    p = tmp_path / "w.ddlw"
    with Writer(p, [("a", "bf16", a.shape), ("b", "i64", (2,))], provenance={"compress": {"k": 1}}) as w:
        w.write("a", a)  # float32 declared bf16: rounded on write
        w.write("b", np.array([1, 2]))
    assert w.paths == [p]
    with open_checkpoint(p) as ck:
        np.testing.assert_array_equal(ck.tensor("a"), f32_to_bf16(a))
        np.testing.assert_allclose(ck.tensor_f32("a"), a, rtol=2**-8)
        assert ck.provenance == {"compress": {"k": 1}}


# ---------------------------------------------------------------------------------------------------- bf16


def test_bf16_helpers():
    def bits(u32s):
        return f32_to_bf16(np.array(u32s, dtype=np.uint32).view(np.float32))

    assert f32_to_bf16(np.float32(1.0)) == 0x3F80
    assert bits([0x3F808000])[0] == 0x3F80  # tie, even kept
    assert bits([0x3F818000])[0] == 0x3F82  # tie, odd rounds up to even
    assert bits([0x3F808001])[0] == 0x3F81  # above half rounds up
    assert bits([0x3F807FFF])[0] == 0x3F80  # below half rounds down
    assert bits([0x7F7FFFFF])[0] == 0x7F80  # max float32 overflows to +inf
    assert bits([0xFF800000])[0] == 0xFF80  # -inf stays
    nan = bits([0x7FFFFFFF, 0xFFC00001, 0x7F800001])
    assert np.isnan(bf16_to_f32(nan)).all()
    assert list(nan >> 15) == [0, 1, 0]  # sign kept
    # exact for every bf16 value: bits -> f32 -> bits
    allbits = np.arange(1 << 16, dtype=np.uint16)
    f = bf16_to_f32(allbits)
    ok = ~np.isnan(f)
    np.testing.assert_array_equal(f32_to_bf16(f)[ok], allbits[ok])
    assert bf16_to_f32(np.zeros((2, 3), np.uint16)).shape == (2, 3)
    with pytest.raises(TypeError):
        bf16_to_f32(np.zeros(3, np.float32))


# ------------------------------------------------------------------------------------------------ sharding


def test_sharded_round_trip(tmp_path, rng):
    t = {f"t{i}": rng.standard_normal(250 + i).astype(np.float32) for i in range(5)}  # ~1 KB each
    p = tmp_path / "model.ddlw"
    paths = save(p, t, config={"c": 1}, metadata={"m": 2}, tokenizer=b"tok", shard_bytes=2100)
    assert [q.name for q in paths] == [f"model-0000{i}-of-00003.ddlw" for i in (1, 2, 3)]
    assert not p.exists() and sorted(os.listdir(tmp_path)) == [q.name for q in paths]
    seen = []
    for i, q in enumerate(paths):
        with open_checkpoint(q, single_file=True) as ck:
            ck.verify()
            assert ck.config == {"c": 1} and ck.tokenizer == b"tok"
            assert ck.shard["index"] == i and ck.shard["count"] == 3
            assert (ck.shard["names"] == list(t)) == (i == 0)
            seen += ck.names()
            for n in ck.names():
                np.testing.assert_array_equal(ck.tensor(n), t[n])
    assert seen == list(t)
    for q in (p, paths[0], paths[2]):
        with open_checkpoint(q) as ck:
            assert ck.names() == list(t) and ck.shard_count == 3 and ck.files == paths
            assert ck.nbytes == sum(a.nbytes for a in t.values())
            for n, a in ck.tensors().items():
                np.testing.assert_array_equal(a, t[n])
            ck.verify()


def test_shard_set_validation(tmp_path, rng):
    t = {f"t{i}": np.full(300, i, np.float32) for i in range(3)}
    d1, d2 = tmp_path / "one", tmp_path / "two"
    d1.mkdir()
    d2.mkdir()
    p1 = save(d1 / "m.ddlw", t, shard_bytes=1300)
    t2 = dict(t, t1=np.full(300, 9, np.float32))
    p2 = save(d2 / "m.ddlw", t2, shard_bytes=1300)
    # a shard of another save (same names, other data) is caught by the set id
    os.replace(p2[1], p1[1])
    expect_error(d1 / "m.ddlw", "set_id", "differs", file=p1[1])
    # a missing shard
    os.unlink(p1[1])
    with pytest.raises(CheckpointError, match=f"no such file: {p1[1]}"):
        open_checkpoint(d1 / "m.ddlw")
    # a renamed shard cannot locate its siblings
    os.replace(p2[0], d2 / "renamed.ddlw")
    expect_error(d2 / "renamed.ddlw", "cannot be located")


def test_save_replaces_previous_shard_set(tmp_path, rng):
    p = tmp_path / "m.ddlw"
    t = {f"t{i}": np.full(300, i, np.float32) for i in range(4)}
    save(p, t, shard_bytes=1300)
    assert len(os.listdir(tmp_path)) == 4
    save(p, t, shard_bytes=2500)  # a set of another count replaces the old set
    assert sorted(os.listdir(tmp_path)) == ["m-00001-of-00002.ddlw", "m-00002-of-00002.ddlw"]
    save(p, {"x": np.zeros(1)})  # a single file replaces the set
    assert os.listdir(tmp_path) == ["m.ddlw"]
    save(p, t, shard_bytes=1300)  # and a set replaces the single file
    assert "m.ddlw" not in os.listdir(tmp_path)
    with open_checkpoint(p) as ck:
        assert ck.names() == list(t)


# ------------------------------------------------------------------------------------------ hostile files


@pytest.fixture
def good_file(tmp_path, rng):
    p = tmp_path / "good.ddlw"
    t = sample_tensors(rng)
    save(p, t, config={"d": 1}, metadata={"k": "v"}, tokenizer=b"x" * 10)
    return p, t


def test_truncation_at_every_length(good_file, tmp_path):
    p, _ = good_file
    blob = p.read_bytes()
    q = tmp_path / "cut.ddlw"
    for cut in range(len(blob)):
        q.write_bytes(blob[:cut])
        expect_error(q)
    q.write_bytes(blob + b"\0")
    expect_error(q, "1 trailing bytes")


def test_truncation_messages_at_section_boundaries(good_file, tmp_path):
    p, t = good_file
    blob = p.read_bytes()
    n = struct.unpack("<Q", blob[8:16])[0]
    start = C.align_up(16 + n)
    with open_checkpoint(p) as ck:
        emb, w4 = ck.info("emb"), ck.info("w4")
    q = tmp_path / "cut.ddlw"
    cases = [
        (0, "shorter than the 16-byte preamble"),
        (4, "shorter than the 16-byte preamble"),  # after magic
        (8, "shorter than the 16-byte preamble"),  # after version
        (16, f"header length {n} exceeds file size 16"),  # after length
        (16 + n // 2, f"header length {n} exceeds file size"),  # inside the header
        (16 + n, f"data section starts at {start}"),  # header complete, padding cut
        (start, "tensor 'emb': bytes"),  # at data start
        (start + emb.offset + 5, "extend past the end of the file"),  # inside the first tensor
        (start + w4.offset + w4.nbytes - 1, "tensor 'w4'"),  # inside the last tensor
    ]
    assert start > 16 + n  # the padding case above is real
    for cut, frag in cases:
        q.write_bytes(blob[:cut])
        expect_error(q, frag)


@settings(
    max_examples=400,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_random_corruption_only_raises_checkpoint_error(tmp_path_factory, data):
    base = tmp_path_factory.getbasetemp() / "fuzz"
    base.mkdir(exist_ok=True)
    src = base / "src.ddlw"
    if not src.exists():
        rng = np.random.default_rng(0)
        t = sample_tensors(rng)
        t["flag"] = np.array([True, False, True])
        t["half"] = np.arange(6, dtype=np.uint16).reshape(2, 3)
        save(src, [*t.items(), ("bf", np.arange(4, dtype=np.uint16), "bf16")], metadata={"a": {"b": [1, 2]}})
    blob = bytearray(src.read_bytes())
    n = struct.unpack("<Q", blob[8:16])[0]
    region = data.draw(st.sampled_from(["header", "any"]))
    hi = 16 + n if region == "header" else len(blob)
    flips = data.draw(
        st.lists(st.tuples(st.integers(0, hi - 1), st.integers(1, 255)), min_size=1, max_size=4)
    )
    for pos, x in flips:
        blob[pos] ^= x
    if data.draw(st.booleans()):
        blob = blob[: data.draw(st.integers(0, len(blob)))]
    q = base / "bad.ddlw"
    q.write_bytes(bytes(blob))
    try:
        ck = open_checkpoint(q)
    except CheckpointError as e:
        assert "\n" not in str(e)
        return
    with ck:
        # it opened: it must be self-consistent, and reading anything may only raise CheckpointError
        assert len(ck.names()) == len(set(ck.names()))
        for name in ck.names():
            info = ck.info(name)
            try:
                a = ck.tensor(name)
                assert a.shape == info.shape and a.nbytes == info.nbytes
                ck.tensor(name, copy=False)
                if info.dtype in ("f32", "f16", "bf16", "f64"):
                    assert ck.tensor_f32(name).dtype == np.float32
            except CheckpointError:
                pass
        with contextlib.suppress(CheckpointError):
            ck.verify()


_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=4), kids, max_size=3),
    max_leaves=6,
)


@settings(
    max_examples=300,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_random_header_values_only_raise_checkpoint_error(tmp_path_factory, data):
    """Structured fuzzing: replace one field of a valid header (top-level, shard or a tensor entry) with an
    arbitrary msgpack value; the reader must reject it with CheckpointError or open a consistent file."""
    base = tmp_path_factory.getbasetemp() / "fuzz2"
    base.mkdir(exist_ok=True)
    payload = np.arange(4, dtype=np.float32).tobytes() + bytes(48) + bytes([1, 0, 1])
    t = {"a": entry("f32", (4,), 0, data=payload[:16]), "b": entry("bool", (3,), 64, data=payload[64:])}
    shard = {"index": 0, "count": 1, "set_id": "0" * 16, "names": ["a", "b"]}
    h = header(t, shard=data.draw(st.sampled_from([None, shard])))
    where = data.draw(st.sampled_from(["top", "a", "b"] + (["shard"] if h["shard"] else [])))
    target = h if where == "top" else h["shard"] if where == "shard" else h["tensors"][where]
    key = data.draw(st.sampled_from(sorted(target)) | st.text(max_size=6))
    target[key] = data.draw(_values)
    q = craft(base / "h.ddlw", h, payload)
    try:
        ck = open_checkpoint(q, single_file=True)
    except CheckpointError as e:
        assert "\n" not in str(e)
        return
    with ck:
        for name in ck.names():
            with contextlib.suppress(CheckpointError):
                assert ck.tensor(name).nbytes == ck.info(name).nbytes


def _nested(depth):
    v = []
    for _ in range(depth):
        v = [v]
    return v


def _two(offset_b=64, nbytes_a=16, **kw_b):
    return {"a": entry("f32", (4,), 0, nbytes=nbytes_a), "b": entry(offset=offset_b, **kw_b)}


HOSTILE = [
    # (id, header or raw bytes, data, craft kwargs, expected fragments)
    ("magic", header(), b"", {"magic": b"GGUF"}, ["bad magic b'GGUF'"]),
    ("version0", header(), b"", {"version": 0}, ["unsupported format version 0"]),
    ("version_new", header(), b"", {"version": 3}, ["format version 3 is newer", "HINT"]),
    ("version_swapped", header(), b"", {"version": 0x01000000}, ["byte-swapped"]),
    ("len0", header(), b"", {"n": 0}, ["header length is 0"]),
    (
        "len_cap",
        header(),
        b"",
        {"n": 99999999999},
        ["header length 99999999999 exceeds the 67108864-byte cap"],
    ),
    ("len_huge", header(), b"", {"n": 2**64 - 1}, ["exceeds the 67108864-byte cap"]),
    ("len_file", header(), b"", {"n": 5000}, ["header length 5000 exceeds file size"]),
    ("pad_nonzero", header(), b"", {"pad_byte": 7}, ["non-zero padding"]),
    ("not_msgpack", b"\xc1" * 10, b"", {}, ["not valid msgpack"]),
    ("bad_utf8", b"\x81\xa2\xff\xfe\x01", b"", {}, ["not valid msgpack"]),
    ("int_key", msgpack.packb({1: 2}), b"", {}, ["not valid msgpack"]),
    ("header_list", msgpack.packb([1, 2]), b"", {}, ["header is a msgpack list, expected a map"]),
    (
        "missing_key",
        {k: v for k, v in header().items() if k != "metadata"},
        b"",
        {},
        ["missing required key 'metadata'"],
    ),
    ("unknown_key", header(extra=1), b"", {}, ["unknown key 'extra'"]),
    ("format", header(format="gguf"), b"", {}, ["format is 'gguf'"]),
    ("hdr_version", header(version=2), b"", {}, ["header version 2 does not match the file version 1"]),
    ("tensors_list", header(tensors=[]), b"", {}, ["header 'tensors' is a list, expected map"]),
    ("tokenizer_str", header(tokenizer="x"), b"", {}, ["header 'tokenizer' is a str, expected bin or nil"]),
    ("config_list", header(config=[1]), b"", {}, ["header 'config' is a list, expected map or nil"]),
    ("ext", header(metadata={"x": msgpack.ExtType(5, b"ab")}), b"", {}, ["unsupported msgpack type ExtType"]),
    (
        "timestamp",
        header(metadata={"t": msgpack.Timestamp(1, 0)}),
        b"",
        {},
        ["unsupported msgpack type Timestamp"],
    ),
    ("deep", header(metadata={"x": _nested(70)}), b"", {}, ["nests deeper than 64"]),
    ("empty_name", header({"": entry()}), bytes(16), {}, ["tensor with an empty name"]),
    ("entry_not_map", header({"a": [1]}), b"", {}, ["tensor 'a': entry is a list, expected a map"]),
    ("entry_keys", header({"a": {**entry(), "foo": 1}}), bytes(16), {}, ["unknown ['foo']"]),
    (
        "entry_missing",
        header({"a": {k: v for k, v in entry().items() if k != "hash"}}),
        bytes(16),
        {},
        ["missing ['hash']"],
    ),
    ("dtype", header({"a": entry("q4")}), bytes(16), {}, ["tensor 'a': unknown dtype 'q4'"]),
    ("dtype_int", header({"a": {**entry(), "dtype": 0}}), bytes(16), {}, ["unknown dtype 0"]),
    ("shape_neg", header({"a": {**entry(), "shape": [-4]}}), bytes(16), {}, ["shape [-4] has a dimension"]),
    (
        "shape_float",
        header({"a": {**entry(), "shape": [4.0]}}),
        bytes(16),
        {},
        ["shape [4.0] has a dimension"],
    ),
    (
        "shape_bool",
        header({"a": {**entry(), "shape": [True]}}),
        bytes(16),
        {},
        ["shape [True] has a dimension"],
    ),
    ("shape_str", header({"a": {**entry(), "shape": "4"}}), bytes(16), {}, ["shape is a str"]),
    ("ndim", header({"a": entry(shape=(1,) * 9)}), bytes(4), {}, ["9 dimensions, at most 8"]),
    (
        "shape_huge",
        header({"a": entry(shape=(2**40, 2**40), nbytes=16)}),
        bytes(16),
        {},
        ["needs more bytes than the file size"],
    ),
    (
        "shape_u64",
        header({"a": entry(shape=(2**64 - 1,) * 8, nbytes=16)}),
        bytes(16),
        {},
        ["needs more bytes"],
    ),
    ("nbytes", header({"a": entry(nbytes=12)}), bytes(12), {}, ["tensor 'a': nbytes 12 != 16"]),
    ("nbytes_bool", header({"a": entry("u8", (1,), nbytes=True)}), bytes(1), {}, ["nbytes True != 1"]),
    ("offset_neg", header({"a": entry(offset=-64)}), bytes(16), {}, ["offset -64 is not a non-negative int"]),
    (
        "offset_misaligned",
        header({"a": entry(offset=8)}),
        bytes(24),
        {},
        ["offset 8 is not a multiple of 64"],
    ),
    ("offset_oob", header({"a": entry(offset=2**40)}), bytes(16), {}, ["extend past the end of the file"]),
    (
        "offset_hole_first",
        header({"a": entry(offset=64)}),
        bytes(80),
        {},
        ["offset 64 leaves a hole; expected 0"],
    ),
    (
        "overlap",
        header(_two(offset_b=0)),
        bytes(16),
        {},
        ["tensor 'b': offset 0 overlaps tensor 'a', which ends at 16"],
    ),
    (
        "overlap_big",
        header({"a": entry("f32", (32,), 0), "b": entry(offset=64)}),
        bytes(144),
        {},
        ["overlaps tensor 'a', which ends at 128"],
    ),
    (
        "hole",
        header(_two(offset_b=128)),
        bytes(144),
        {},
        ["tensor 'b': offset 128 leaves a hole; expected 64"],
    ),
    ("trailing", header({"a": entry()}), bytes(17), {}, ["1 trailing bytes after the tensor data"]),
    ("hash_short", header({"a": entry(hash="abc")}), bytes(16), {}, ["hash 'abc' is not 16 lowercase hex"]),
    ("hash_upper", header({"a": entry(hash="ABCDEF0123456789")}), bytes(16), {}, ["is not 16 lowercase hex"]),
    (
        "hash_bytes",
        header({"a": entry(hash=b"0123456789abcdef")}),
        bytes(16),
        {},
        ["is not 16 lowercase hex"],
    ),
    ("shard_keys", header(shard={"index": 0}), b"", {}, ["header 'shard' has keys"]),
    (
        "shard_index",
        header(shard={"index": 3, "count": 2, "set_id": "0" * 16, "names": None}),
        b"",
        {},
        ["index 3 of count 2"],
    ),
    (
        "shard_names",
        header(shard={"index": 0, "count": 2, "set_id": "0" * 16, "names": None}),
        b"",
        {},
        ["must list every tensor name"],
    ),
]


@pytest.mark.parametrize("case", HOSTILE, ids=[c[0] for c in HOSTILE])
def test_hostile_headers(tmp_path, case):
    _, hdr, data, kw, fragments = case
    p = craft(tmp_path / "model.ddlw", hdr, data, **kw)
    expect_error(p, *fragments)


def test_crafted_good_file_opens(tmp_path):
    # the crafting helper itself makes valid files: the hostile cases above differ only in what they break
    data = np.arange(4, dtype=np.float32).tobytes() + bytes(48) + np.arange(3, dtype=np.int8).tobytes()
    t = {"a": entry("f32", (4,), 0, data=data[:16]), "b": entry("i8", (3,), 64, data=data[64:])}
    p = craft(tmp_path / "ok.ddlw", header(t), data)
    with open_checkpoint(p) as ck:
        ck.verify()
        np.testing.assert_array_equal(ck.tensor("b"), [0, 1, 2])


def _raw_dup_header(dup_in_tensors: bool) -> bytes:
    pk = msgpack.Packer(use_bin_type=True)
    h = header()
    out = pk.pack_map_header(len(h) + (0 if dup_in_tensors else 1))
    for k, v in h.items():
        out += pk.pack(k)
        if k == "tensors" and dup_in_tensors:
            out += pk.pack_map_pairs([("w", entry()), ("w", entry(offset=64))])
        else:
            out += pk.pack(v)
    if not dup_in_tensors:
        out += pk.pack("config") + pk.pack({"x": 1})
    return out


def test_duplicate_names_and_keys(tmp_path):
    p = craft(tmp_path / "dup.ddlw", _raw_dup_header(True), bytes(80))
    expect_error(p, "duplicate tensor name 'w'")
    p = craft(tmp_path / "dupk.ddlw", _raw_dup_header(False), b"")
    expect_error(p, "duplicate key 'config' in header map top")


def test_trailing_bytes_inside_header(tmp_path):
    raw = msgpack.packb(header(), use_bin_type=True) + b"\x00\x01"
    p = craft(tmp_path / "x.ddlw", raw)
    expect_error(p, "header has 2 trailing bytes after the msgpack map")


def test_bool_tensor_with_bad_bytes(tmp_path):
    data = bytes([0, 1, 2])
    p = craft(tmp_path / "b.ddlw", header({"m": entry("bool", (3,), data=data)}), data)
    with (
        open_checkpoint(p) as ck,
        pytest.raises(CheckpointError, match="bool tensor holds bytes other than 0 and 1"),
    ):
        ck.tensor("m")


def test_missing_and_unreadable_paths(tmp_path):
    with pytest.raises(CheckpointError, match="no such file: .*nothere.ddlw"):
        open_checkpoint(tmp_path / "nothere.ddlw")
    with pytest.raises(CheckpointError, match="is a directory"):
        open_checkpoint(tmp_path)


def test_file_truncated_after_open(good_file):
    p, _ = good_file
    with open_checkpoint(p) as ck:
        os.truncate(p, 100)
        with pytest.raises(CheckpointError, match="size changed"):
            ck.tensor("emb", copy=False)


# ---------------------------------------------------------------------------------------------- crash safety


def _assert_untouched(p, before):
    assert p.read_bytes() == before
    assert not [n for n in os.listdir(p.parent) if n.endswith(".partial")]


def test_failing_iterable_leaves_previous_file(good_file):
    p, _ = good_file
    before = p.read_bytes()

    def gen():
        yield "a", np.zeros(3, np.float32)
        raise RuntimeError("producer died")

    with pytest.raises(RuntimeError, match="producer died"):
        save(p, gen())
    _assert_untouched(p, before)


def test_failure_mid_stream_leaves_previous_file(good_file):
    p, _ = good_file
    before = p.read_bytes()
    with pytest.raises(RuntimeError, match="boom"), Writer(p, [("a", "f32", (3,)), ("b", "f32", (3,))]) as w:
        w.write("a", np.ones(3, np.float32))
        assert [n for n in os.listdir(p.parent) if n.endswith(".partial")]  # really mid-write
        raise RuntimeError("boom")
    _assert_untouched(p, before)


def test_failure_inside_data_write_leaves_previous_file(good_file, monkeypatch):
    p, _ = good_file
    before = p.read_bytes()
    real = C._byte_chunks
    calls = []

    def flaky(arr):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(arr)

    monkeypatch.setattr(C, "_byte_chunks", flaky)
    with pytest.raises(CheckpointError, match=r"cannot write: No space left on device .*unchanged\)$"):
        save(p, {"a": np.ones(5), "b": np.ones(5), "c": np.ones(5)})
    _assert_untouched(p, before)


@pytest.mark.parametrize("fail", ["fsync", "replace"])
def test_failure_at_commit_of_a_shard_set(good_file, monkeypatch, fail):
    p, _ = good_file
    before = p.read_bytes()
    real = getattr(os, fail)
    calls = []

    def flaky(*a):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(5, f"{fail} failed")
        return real(*a)

    monkeypatch.setattr(os, fail, flaky)
    t = {f"t{i}": np.full(300, i, np.float32) for i in range(3)}
    with pytest.raises(CheckpointError, match=f"cannot write: {fail} failed"):
        save(p, t, shard_bytes=1300)
    monkeypatch.undo()
    assert p.read_bytes() == before
    names = os.listdir(p.parent)
    assert not [n for n in names if n.endswith(".partial")]
    if fail == "fsync":  # nothing renamed yet: no shard reaches its final name
        assert names == ["good.ddlw"]


# ------------------------------------------------------------------------------------------------ lazy reads


def _rchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise AssertionError("no rchar")


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs Linux /proc/self/io read counters")
def test_lazy_read_does_not_touch_big_tensor(tmp_path):
    big_n = 16 << 20  # 64 MiB of float32
    src = tmp_path / "src.bin"
    big = np.memmap(src, dtype=np.float32, mode="w+", shape=(big_n,))  # sparse zeros, never in memory
    p = tmp_path / "big.ddlw"
    save(p, {"big": big, "small": np.arange(10, dtype=np.float32)})
    del big
    os.unlink(src)

    r0 = _rchar()
    ck = open_checkpoint(p)
    r1 = _rchar()
    small = ck.tensor("small")
    r2 = _rchar()
    view = ck.tensor("big", copy=False)
    r3 = _rchar()
    np.testing.assert_array_equal(small, np.arange(10))
    assert isinstance(view, np.memmap) and view.shape == (big_n,)
    assert r1 - r0 < 1 << 20, "open read more than the header"
    assert r2 - r1 < 1 << 20, "reading the small tensor read the big one"
    assert r3 - r2 < 1 << 20, "a memmap view read the data"
    # the measurement is sensitive: a real read of the big tensor shows up
    ck.tensor("big")
    assert _rchar() - r3 >= big_n * 4
    ck.close()


# -------------------------------------------------------------------------------------------------- verify


def test_verify_detects_flipped_data_byte(good_file, tmp_path):
    p, _ = good_file
    with open_checkpoint(p) as ck:
        ck.verify()
        w4 = ck.info("w4")
        pos = data_start(p) + w4.offset + 7
    blob = bytearray(p.read_bytes())
    blob[pos] ^= 0x10
    q = tmp_path / "flipped.ddlw"
    q.write_bytes(bytes(blob))
    # opening does not hash; verify does (reading the tensor does too: see below)
    with (
        open_checkpoint(q) as ck,
        pytest.raises(CheckpointError, match=r"'w4': hash mismatch: header says [0-9a-f]{16}"),
    ):
        ck.verify()
    # non-zero alignment padding between tensors is also caught by verify
    with open_checkpoint(p) as ck:
        emb = ck.info("emb")
    blob = bytearray(p.read_bytes())
    blob[data_start(p) + emb.offset + emb.nbytes] = 1
    q.write_bytes(bytes(blob))
    with (
        open_checkpoint(q) as ck,
        pytest.raises(CheckpointError, match="non-zero padding before tensor 'scalar'"),
    ):
        ck.verify()


def test_no_pickle_anywhere():
    for module in (C, CF, CR):
        src = Path(module.__file__).read_text()
        assert "pickle" not in src.replace("No pickle", "").replace("no pickle", "")
        assert "allow_pickle" not in src
    assert sys.modules.get("ddl_wgpu.files.container") is C


# ------------------------------------------------------------------- verification while reading (issue 14.4)


def test_reading_a_tensor_checks_its_hash(good_file, tmp_path):
    p, t = good_file
    with open_checkpoint(p) as ck:
        emb = ck.info("emb")
    q = flip(p, data_start(p) + emb.offset + 3, tmp_path / "flipped.ddlw")
    for read in (
        lambda ck: ck.tensor("emb"),
        lambda ck: ck.tensor("emb", copy=False),
        lambda ck: ck.tensor_f32("emb"),
        lambda ck: ck.tensors(),
    ):
        with (
            open_checkpoint(q) as ck,
            pytest.raises(CheckpointError, match=r"^.*flipped\.ddlw: tensor 'emb': hash mismatch.*corrupt"),
        ):
            read(ck)
    with open_checkpoint(q) as ck:  # the other tensors are intact and read fine
        np.testing.assert_array_equal(ck.tensor("w4"), t["w4"])
    with open_checkpoint(q, verify=False) as ck:  # trusted input: no hashing, the flipped value comes back
        assert not np.array_equal(ck.tensor("emb"), t["emb"])


def test_a_corrupt_tensor_is_never_copied_into_a_derived_file(good_file, tmp_path):
    """The heal write-back pattern (memmap views streamed into save) fails before the output exists."""
    p, _ = good_file
    with open_checkpoint(p) as ck:
        odd = ck.info("odd")
    q = flip(p, data_start(p) + odd.offset, tmp_path / "flipped.ddlw")
    out = tmp_path / "derived.ddlw"
    with open_checkpoint(q) as ck, pytest.raises(CheckpointError, match="'odd': hash mismatch"):
        save(out, [(n, ck.tensor(n, copy=False)) for n in ck.names()])
    assert not out.exists() and not list(tmp_path.glob("*.partial"))


def test_each_tensor_is_hashed_once_and_unread_tensors_are_not_read(tmp_path, monkeypatch):
    p = tmp_path / "m.ddlw"
    save(p, {"small": np.ones(4, np.float32), "big_extra": np.zeros(1 << 20, np.float32)})
    hashed = []
    real = CR._hasher

    def counting():
        hashed.append(1)
        return real()

    monkeypatch.setattr(CR, "_hasher", counting)
    before = _rchar()
    with open_checkpoint(p) as ck:
        ck.tensor("small")
        ck.tensor("small", copy=False)
        ck.tensor_f32("small")
    assert len(hashed) == 1
    assert _rchar() - before < 1 << 20  # the 4 MiB extra tensor was neither read nor hashed


# ------------------------------------------------------------------------------ header checksum (issue 14.19)


def test_header_checksum_catches_a_renamed_tensor(good_file, tmp_path):
    p, _ = good_file
    blob = p.read_bytes()
    pos = blob.index(b"emb")
    q = flip(p, pos, tmp_path / "renamed.ddlw", mask=ord("e") ^ ord("f"))  # "emb" -> "fmb": still well formed
    assert b"fmb" in q.read_bytes()
    expect_error(q, "header checksum mismatch", "header is corrupt")
    # any flipped byte of the preamble's length or the header is caught too (not just well-formed renames)
    n = struct.unpack("<Q", blob[8:16])[0]
    for pos in (16, 16 + n // 2, 16 + n - 1, 16 + n, 16 + n + 7):
        with pytest.raises(CheckpointError):
            open_checkpoint(flip(p, pos, tmp_path / "f.ddlw")).close()


def v1_copy(path, out) -> Path:
    """The same checkpoint as a version 1 file (no header checksum), as ddl-wgpu wrote it before."""
    blob = Path(path).read_bytes()
    n = struct.unpack("<Q", blob[8:16])[0]
    hdr = msgpack.unpackb(blob[16 : 16 + n], raw=False)
    hdr["version"] = 1
    data = blob[data_start(path) :]
    return Path(craft(out, hdr, data, version=1))


def test_version_1_files_are_still_read(good_file, tmp_path):
    p, t = good_file
    old = v1_copy(p, tmp_path / "v1.ddlw")
    with open_checkpoint(old) as ck:
        assert ck.version == 1
        for name, a in t.items():
            np.testing.assert_array_equal(ck.tensor(name), a)
        ck.verify()
    # version 1 has no header checksum: a rename there is not detected, but data hashes still are
    renamed = flip(old, old.read_bytes().index(b"emb"), tmp_path / "r1.ddlw", mask=ord("e") ^ ord("f"))
    with open_checkpoint(renamed) as ck:
        assert "fmb" in ck
    with open_checkpoint(old) as ck:
        emb = ck.info("emb")
        n = struct.unpack("<Q", old.read_bytes()[8:16])[0]
    bad = flip(old, C.align_up(16 + n) + emb.offset, tmp_path / "b1.ddlw")
    expect_error(bad, "'emb': hash mismatch")
    # a version 2 preamble on a version 1 layout fails (checksum), not misreads
    blob = bytearray(old.read_bytes())
    blob[4] = 2
    (tmp_path / "mixed.ddlw").write_bytes(bytes(blob))
    with pytest.raises(CheckpointError):
        open_checkpoint(tmp_path / "mixed.ddlw").close()


# ------------------------------------------------------------------------ non-regular files (issue 14.17)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="POSIX FIFOs")
def test_a_fifo_is_refused_without_blocking(tmp_path):
    import signal

    fifo = tmp_path / "model.ddlw"
    os.mkfifo(fifo)
    signal.alarm(20)  # a regression would block forever on open(); fail loudly instead
    try:
        with pytest.raises(CheckpointError, match=r"model\.ddlw: is a FIFO, not a regular file"):
            open_checkpoint(fifo)
    finally:
        signal.alarm(0)
    with pytest.raises(CheckpointError, match="is a device"):
        open_checkpoint("/dev/zero")


# ----------------------------------------------------- model files: config against tensors (issue 14.6/14/16/17)


def _model_file(path, cfg=None, config=None, extra=(), cast=None, metadata=None):
    """A model file whose header config may differ from the config its tensors were made for."""
    from ddl_ref.params import init_params

    cfg = cfg or tiny_cfg(vocab_size=64)
    params = init_params(cfg, 0)
    items = [(n, a.astype(cast[1]) if cast and n == cast[0] else a) for n, a in params.items()]
    save(path, items + list(extra), config=config or cfg.to_dict(), metadata=metadata or {})
    return path


def test_param_count_and_estimate_bytes_are_closed_forms():
    from ddl_ref.config import MtpConfig
    from ddl_ref.params import param_table
    from ddl_wgpu.files.modelfile import estimate_bytes, param_count

    for cfg in (
        tiny_cfg(vocab_size=64),
        tiny_cfg(vocab_size=64, n_layers=1, tie_embeddings=False),
        tiny_cfg(vocab_size=64, n_layers=3, mtp=MtpConfig(), qk_norm="none"),
        tiny_cfg(vocab_size=64, residual="delta", ddl_dv=4, ddl_compressor="tc", ddl_expand_embed=True),
    ):
        n = sum(s.numel for s in param_table(cfg))
        assert param_count(cfg) == n
        rope = 2 * cfg.max_seq_len * cfg.head_dim * 4
        assert estimate_bytes(cfg, training=False) == 4 * n + rope
        assert estimate_bytes(cfg, training=True) == 20 * n + rope
    huge = tiny_cfg(vocab_size=64, n_layers=10**9)  # instant, where param_table would take minutes
    assert param_count(huge) > 10**11


@pytest.mark.parametrize(
    "override",
    [
        {"n_layers": 10**9},
        {"vocab_size": 10**12},
        {"d_model": 10**9},
        {"ffn_hidden": 10**9},
        {"max_seq_len": 10**15},
    ],  # fmt: skip
)
def test_an_absurd_config_is_refused_before_any_allocation(tmp_path, override):
    import time

    from ddl_wgpu.files.modelfile import load_model

    cfg = tiny_cfg(vocab_size=64).to_dict() | override
    p = _model_file(tmp_path / "m.ddlw", config=cfg)
    t0 = time.perf_counter()
    with pytest.raises(
        CheckpointError, match=r"m\.ddlw: the model needs about [\d.e+]+ GiB of memory to load"
    ):
        load_model(p)
    assert time.perf_counter() - t0 < 5


def test_check_fits_names_the_memory_it_needs_and_has(monkeypatch):
    from ddl_ref.config import ConfigError
    from ddl_wgpu.files import modelfile

    cfg = tiny_cfg(vocab_size=64)
    need = modelfile.estimate_bytes(cfg, training=True)
    monkeypatch.setattr(modelfile, "available_bytes", lambda: need - 1)
    assert modelfile.check_fits(cfg, training=False) < need
    with pytest.raises(ConfigError, match="needs about .* to train .* this machine has .* available"):
        modelfile.check_fits(cfg, training=True)
    with pytest.raises(ConfigError, match="rope_theta is inf"):
        modelfile.check_fits(tiny_cfg(vocab_size=64, rope_theta=float("inf")), training=False)


def test_config_is_checked_against_the_tensors(tmp_path):
    from ddl_wgpu.files.modelfile import load_config, load_model, read_params

    cfg = tiny_cfg(vocab_size=64)
    big_vocab = cfg.to_dict() | {"vocab_size": 1000}
    p = _model_file(tmp_path / "v.ddlw", config=big_vocab)
    with pytest.raises(
        CheckpointError, match=r"model.embed_tokens.weight has shape \(64, 16\), the config needs"
    ):
        load_model(p)
    # the same check for a training checkpoint's tensor groups (resume reads params, best., optim.m., ...)
    from ddl_ref.params import init_params

    params = init_params(cfg, 0)
    q = tmp_path / "ck.ddlw"
    save(q, [*params.items(), *((f"optim.m.{n}", a) for n, a in params.items() if "norm" not in n)],
         config=cfg.to_dict())  # fmt: skip
    with open_checkpoint(q) as ck:
        c = load_config(ck, q, training=True)
        assert read_params(ck, c, q).keys() == params.keys()
        with pytest.raises(
            CheckpointError, match=r"missing tensor optim\.m\.model\.layers\.0\.input_layernorm"
        ):
            read_params(ck, c, q, prefix="optim.m.")
        present = read_params(ck, c, q, prefix="optim.m.", require_all=False)  # moments of some slots only
        assert present and all("norm" not in n for n in present) and set(present) < set(params)
    r = tmp_path / "renamed.ddlw"
    save(r, [*params.items(), ("optim.v.model.layers.0.mlp.gate_prox.weight", np.zeros(3, np.float32))],
         config=cfg.to_dict())  # fmt: skip
    with (
        open_checkpoint(r) as ck,
        pytest.raises(CheckpointError, match="gate_prox.weight is not a parameter"),
    ):
        read_params(ck, cfg, r, prefix="optim.v.", require_all=False)


def test_integer_tensors_where_parameters_are_expected_are_refused(tmp_path):
    from ddl_wgpu.files.modelfile import load_model

    for dtype in (np.int32, np.uint32):
        p = _model_file(tmp_path / "i.ddlw", cast=("model.norm.weight", dtype))
        want = {np.int32: "i32", np.uint32: "u32"}[dtype]
        with pytest.raises(
            CheckpointError, match=rf"model\.norm\.weight has dtype {want}; parameters must be float"
        ):
            load_model(p)


def test_token_ids_must_lie_in_the_vocabulary(tmp_path):
    from ddl_wgpu.files.modelfile import load_model

    p = _model_file(tmp_path / "t.ddlw", metadata={"hf.eos_token_id": 64})
    with pytest.raises(CheckpointError, match=r"hf\.eos_token_id = 64 is not a token id .*vocab_size 64"):
        load_model(p)


def test_extra_tensors_are_not_read_and_corrupt_ones_do_not_matter(tmp_path):
    from ddl_wgpu.files.modelfile import load_model

    extra = [("unused.big", np.zeros(1 << 21, np.float32))]  # 8 MiB
    p = _model_file(tmp_path / "x.ddlw", extra=extra)
    before = _rchar()
    m = load_model(p)
    assert _rchar() - before < 1 << 20 and "unused.big" not in m.params
    with open_checkpoint(p) as ck:
        big = ck.info("unused.big")
    q = flip(p, data_start(p) + big.offset + 5, tmp_path / "y.ddlw")
    load_model(q)  # never read, so never hashed
    with open_checkpoint(p) as ck:
        norm = ck.info("model.norm.weight")
    r = flip(p, data_start(p) + norm.offset + 1, tmp_path / "z.ddlw")
    with pytest.raises(CheckpointError, match="'model.norm.weight': hash mismatch"):
        load_model(r)
    assert load_model(r, verify=False).params["model.norm.weight"].shape == (16,)


# -------------------------------------------------------------- hostile JSON, every reader (issue 14.15)

HOSTILE_JSON = [
    (b"[" * 100_000 + b"]" * 100_000, "nests deeper than 64 levels"),
    (b'{"text": "\\ud800"}', "lone UTF-16 surrogate"),
    (b'{"text": ' + b"9" * 5000 + b"}", "too many digits"),
    (b'{"text": NaN}', "NaN is not valid JSON"),
    (b'{"text": "a", "text": "b"}', "duplicate key 'text'"),
    (b'{"text": "\xff"}', "not UTF-8"),
]


@pytest.mark.parametrize("raw, pattern", HOSTILE_JSON)
def test_load_json_turns_hostile_json_into_one_error(raw, pattern):
    from ddl_wgpu.files.safeio import load_json

    with pytest.raises(KeyError, match=rf"^.src: .*{pattern}") as ei:
        load_json(raw, "src", KeyError)
    assert "\n" not in str(ei.value)
    assert load_json(b'{"a": [1, {"b": "\\u00e9"}]}', "src", KeyError) == {"a": [1, {"b": "é"}]}
    assert load_json('"[{" ', "src", KeyError) == "[{"  # brackets inside strings do not count as nesting


@pytest.mark.parametrize("raw, pattern", HOSTILE_JSON)
def test_hostile_jsonl_data_lines(tmp_path, raw, pattern):
    from ddl_wgpu.data import ByteTokenizer, DataError, load_datasets

    f = tmp_path / "d.jsonl"
    f.write_bytes(b'{"text": "fine"}\n' + raw + b"\n")
    with pytest.raises(DataError, match=rf"d\.jsonl:2: .*{pattern}"):
        load_datasets(str(f), tokenizer=ByteTokenizer(), seq_len=4, batch_size=1, val_fraction=0.0)
