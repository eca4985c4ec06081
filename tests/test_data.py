"""Tests for ddl_wgpu.data: specs, tokenizers, windows, batches, splits, summaries and errors."""

from __future__ import annotations

import importlib.util
import json
import sys

import numpy as np
import pytest

from ddl_wgpu import data
from ddl_wgpu.data import (
    ByteTokenizer,
    DataError,
    TokenDataset,
    check_vocab,
    eval_windows,
    load_datasets,
    load_records,
    make_windows,
    shuffle_windows,
    split_windows,
    tokenizer_for,
)

BYTES = ByteTokenizer()


def toks(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def as_lists(records) -> list[list[int]]:
    return [np.asarray(r).tolist() for r in records]


def write_llmc(path, tokens, magic=20240520, version=1, dtype="<u2", count=None):
    header = np.zeros(256, dtype="<i4")
    header[:3] = [magic, version, len(tokens) if count is None else count]
    path.write_bytes(header.tobytes() + np.asarray(tokens, dtype=dtype).tobytes())


# ------------------------------------------------------------------------------------------ tokenizers


def test_byte_tokenizer_round_trip():
    ids = BYTES.encode("héllo\n")
    assert ids.dtype == np.uint32
    assert ids.tolist() == toks("héllo\n")
    assert BYTES.decode(ids) == "héllo\n"
    assert BYTES.vocab_size == 256


def test_tokenizer_for_none_is_bytes():
    assert isinstance(tokenizer_for(None), ByteTokenizer)


def test_hf_tokenizer_without_package_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # what a machine without the `hf` extra sees
    with pytest.raises(DataError, match=r"pip install 'ddl-wgpu\[hf\]'"):
        tokenizer_for(b'{"version": "1.0"}')


@pytest.mark.skipif(importlib.util.find_spec("tokenizers") is None, reason="tokenizers not installed")
def test_hf_tokenizer_word_level_round_trip():
    spec = {
        "version": "1.0",
        "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "hello": 1, "world": 2}, "unk_token": "[UNK]"},
        "pre_tokenizer": {"type": "Whitespace"},
    }
    tok = tokenizer_for(json.dumps(spec).encode())
    assert tok.vocab_size == 3
    assert tok.encode("hello world").tolist() == [1, 2]


# ------------------------------------------------------------------------------------------ specs


def test_txt_file_is_one_record(tmp_path):
    f = tmp_path / "a.txt"
    f.write_bytes("first line\nsecond ü\n".encode())
    assert as_lists(load_records(f, BYTES)) == [toks("first line\nsecond ü\n")]


def test_txt_folder_sorted_recursive_and_only_txt(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_text("bb")
    (tmp_path / "a.txt").write_text("aa")
    (tmp_path / "sub" / "c.txt").write_text("cc")
    (tmp_path / "ignored.md").write_text("zz")
    (tmp_path / "empty.txt").write_text("")  # empty documents are dropped
    records = load_records(str(tmp_path), BYTES)
    assert as_lists(records) == [toks("aa"), toks("bb"), toks("cc")]
    assert all(r.dtype == np.uint32 for r in records)


def test_jsonl_records(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"text": "one", "id": 1}) + "\n\n" + json.dumps({"text": "two ✓"}) + "\n")
    assert as_lists(load_records(f, BYTES)) == [toks("one"), toks("two ✓")]


def test_raw_bin_uint16(tmp_path):
    tokens = [0, 1, 50256, 65535, 7]
    f = tmp_path / "train.bin"
    f.write_bytes(np.asarray(tokens, dtype="<u2").tobytes())
    (record,) = load_records(f)
    assert record.tolist() == tokens
    assert isinstance(record, np.memmap)


def test_llmc_bin_uint16_and_uint32(tmp_path):
    f16 = tmp_path / "gpt2.bin"
    write_llmc(f16, [5, 6, 7, 50000])
    assert as_lists(load_records(f16)) == [[5, 6, 7, 50000]]
    f32 = tmp_path / "llama.bin"
    write_llmc(f32, [1, 128000, 3], magic=20240801, version=7, dtype="<u4")
    assert as_lists(load_records(f32)) == [[1, 128000, 3]]


def test_llmc_bin_bad_count_and_version(tmp_path):
    f = tmp_path / "torn.bin"
    write_llmc(f, [1, 2, 3], count=10)
    with pytest.raises(DataError, match="header says 10 tokens"):
        load_records(f)
    g = tmp_path / "v9.bin"
    write_llmc(g, [1, 2], version=9)
    with pytest.raises(DataError, match="version 9 is not supported"):
        load_records(g)


@pytest.mark.parametrize("dtype", ["uint16", "uint32", "int32", "int64"])
def test_npy_record(tmp_path, dtype):
    f = tmp_path / "t.npy"
    np.save(f, np.array([3, 1, 4, 1, 5], dtype=dtype))
    (record,) = load_records(f)
    assert record.tolist() == [3, 1, 4, 1, 5]
    assert record.dtype in (np.uint16, np.uint32)


def test_max_tokens_cuts_exactly(tmp_path):
    for i in range(5):
        (tmp_path / f"{i}.txt").write_text("x" * 10)
    records = load_records(tmp_path, BYTES, max_tokens=25)
    assert [r.size for r in records] == [10, 10, 5]
    f = tmp_path / "t.npy"
    np.save(f, np.arange(100, dtype=np.uint16))
    assert load_records(f, max_tokens=7)[0].tolist() == list(range(7))


# ------------------------------------------------------------------------------------------ stdlib


def test_stdlib_is_real_and_deterministic():
    a = load_records("stdlib", BYTES, max_tokens=200_000)
    b = load_records("stdlib", BYTES, max_tokens=200_000)
    assert len(a) > 1 and all(r.size > 0 for r in a)
    assert sum(r.size for r in a) == 200_000
    assert as_lists(a) == as_lists(b)
    text = BYTES.decode(np.concatenate(a))
    assert "import" in text or "def " in text


def test_stdlib_max_tokens_reads_only_what_it_needs(monkeypatch):
    reads = []
    real = data._read_bytes
    monkeypatch.setattr(data, "_read_bytes", lambda p, limit=None: reads.append(p) or real(p, limit))
    records = load_records("stdlib", BYTES, max_tokens=1000)
    assert sum(r.size for r in records) == 1000
    assert len(reads) == len(records) < 10
    assert not any(part in {"test", "tests", "idlelib", "site-packages"} for p in reads for part in p.parts)


# ------------------------------------------------------------------------------------------ windows and batches


def test_make_windows_lengths_and_drop_short():
    records = [np.arange(10, dtype=np.uint32), np.arange(9, dtype=np.uint32), np.arange(1, dtype=np.uint32)]
    windows = make_windows(records, 4)
    # 10 -> 4,4,2 ; 9 -> 4,4,(1 dropped) ; 1 -> (dropped)
    assert [w.size for w in windows] == [4, 4, 2, 4, 4]
    assert windows[2].tolist() == [8, 9]
    assert windows[4].tolist() == [4, 5, 6, 7]


def test_make_windows_minimum_length_and_token_budget():
    """heal's and accept's windows: a longer minimum, and a token budget that cuts the window reaching it."""
    records = [np.arange(10, dtype=np.uint32), np.arange(9, dtype=np.uint32)]
    assert [w.size for w in make_windows(records, 4, min_len=3)] == [4, 4, 4, 4]  # 2 and 1 dropped
    assert [w.size for w in make_windows(records, 4, min_len=3, max_tokens=11)] == [4, 4, 3]
    assert [w.size for w in make_windows(records, 4, min_len=3, max_tokens=10)] == [
        4,
        4,
    ]  # a cut to 2: the end
    assert [w.size for w in make_windows(records, 4, max_tokens=14)] == [4, 4, 2, 4]
    assert make_windows(records, 4, max_tokens=14)[3].tolist() == [0, 1, 2, 3]


def test_batches_padding_and_lengths():
    windows = make_windows([np.arange(1, 11, dtype=np.uint32)], 4)  # 4,4,2
    ds = TokenDataset(windows, batch_size=2, seq_len=4, source="x")
    assert ds.num_batches == len(ds.batches) == 2
    b0, b1 = ds.batches
    assert b0.ids.dtype == np.uint32 and b0.lengths.dtype == np.int32
    assert b0.ids.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert b1.ids.shape == (2, 4)
    assert b1.ids.tolist() == [[9, 10, 0, 0], [0, 0, 0, 0]]
    assert b1.lengths.tolist() == [2, 0]  # length-0 filler row
    assert b1.prediction_mask().tolist() == [[1, 0, 0], [0, 0, 0]]
    assert ds.num_tokens == 10 == sum(b.num_tokens for b in ds.batches)
    assert ds.num_predictions == 3 + 3 + 1 == sum(b.num_predictions for b in ds.batches)
    assert ds.batches[-1].lengths.tolist() == [2, 0]


def test_dataset_rejects_bad_settings():
    with pytest.raises(DataError, match="batch_size"):
        TokenDataset([], batch_size=0, seq_len=4)
    with pytest.raises(DataError, match="seq_len"):
        make_windows([np.arange(4)], 1)
    with pytest.raises(DataError, match="<= 2 tokens"):
        TokenDataset([np.arange(3)], batch_size=1, seq_len=2)


# ------------------------------------------------------------------------------------------ split


def _windows(n):
    return [np.array([i, i + 1], dtype=np.uint32) for i in range(n)]


def test_split_deterministic_disjoint_and_sized():
    ws = _windows(100)
    train, val = split_windows(ws, 0.1, seed=3)
    train2, val2 = split_windows(ws, 0.1, seed=3)
    assert len(val) == 10 and len(train) == 90
    ids = lambda part: [int(w[0]) for w in part]  # noqa: E731
    assert ids(train) == ids(train2) and ids(val) == ids(val2)
    assert set(ids(train)).isdisjoint(ids(val))
    assert sorted(ids(train) + ids(val)) == list(range(100))
    assert ids(val) == sorted(ids(val))  # original order kept
    assert ids(split_windows(ws, 0.1, seed=4)[1]) != ids(val)


def test_split_zero_and_tiny_and_bad():
    ws = _windows(5)
    train, val = split_windows(ws, 0.0)
    assert len(train) == 5 and val == []
    assert len(split_windows(ws, 0.01)[1]) == 1  # at least one validation window
    with pytest.raises(DataError, match="val_fraction"):
        split_windows(ws, 1.0)
    with pytest.raises(DataError, match="cannot split"):
        split_windows(_windows(1), 0.5)


def test_shuffle_is_a_stable_permutation():
    ws = _windows(50)
    a = [int(w[0]) for w in shuffle_windows(ws, 1)]
    assert a == [int(w[0]) for w in shuffle_windows(ws, 1)]
    assert sorted(a) == list(range(50)) and a != list(range(50))


# ------------------------------------------------------------------------------------------ summary and datasets


def test_summary_equality_and_inequality(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("the quick brown fox jumps over the lazy dog " * 20)
    kw = dict(tokenizer=BYTES, seq_len=16, batch_size=4, val_fraction=0.2, seed=1)
    t1, v1 = load_datasets(f, **kw)
    t2, v2 = load_datasets(f, **kw)
    assert t1.summary() == t2.summary() and v1.summary() == v2.summary()
    json.dumps(t1.summary())  # JSON-able
    s = t1.summary()
    assert s["num_tokens"] == t1.num_tokens and s["num_predictions"] == t1.num_predictions
    assert s["num_windows"] + v1.num_windows == len(make_windows(load_records(f), 16))
    assert t1.summary() != v1.summary()
    t3, _ = load_datasets(str(f), **kw)  # str or Path spec: same summary
    assert t3.summary() == t1.summary()
    f.write_text("the quick brown fox jumps over the lazy cat " * 20)  # same length, other tokens
    t4, _ = load_datasets(f, **kw)
    assert t4.summary()["num_tokens"] == s["num_tokens"]
    assert t4.summary()["sha256"] != s["sha256"]
    assert load_datasets(f, **{**kw, "batch_size": 8})[0].summary() != t4.summary()


def test_load_datasets_val_spec_and_no_val(tmp_path):
    (tmp_path / "train.txt").write_text("abcdefgh" * 8)
    (tmp_path / "val.txt").write_text("zyxw" * 4)
    train, val = load_datasets(tmp_path / "train.txt", seq_len=8, batch_size=3)
    assert val is None and train.num_windows == 8 and train.num_batches == 3
    train, val = load_datasets(
        tmp_path / "train.txt", seq_len=8, batch_size=3, val_spec=tmp_path / "val.txt", val_fraction=0.5
    )
    assert train.num_windows == 8 and val.num_windows == 2
    assert val.batches[0].ids[0].tolist() == toks("zyxwzyxw")


def test_eval_windows_in_order(tmp_path):
    f = tmp_path / "e.npy"
    np.save(f, np.arange(11, dtype=np.uint32))
    ds = eval_windows(f, seq_len=4, batch_size=2)
    assert [w.tolist() for w in ds.windows] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10]]
    assert ds.num_predictions == 3 + 3 + 2
    assert ds.batches[1].lengths.tolist() == [3, 0]


# ------------------------------------------------------------------------------------------ errors


def test_error_missing_path(tmp_path):
    with pytest.raises(DataError, match="no such file or directory"):
        load_records(tmp_path / "nope.txt")


def test_error_empty_folder(tmp_path):
    (tmp_path / "notes.md").write_text("hi")
    with pytest.raises(DataError, match=r"folder holds no \.txt files"):
        load_records(tmp_path)


def test_error_empty_corpus(tmp_path):
    (tmp_path / "a.txt").write_text("")
    with pytest.raises(DataError, match="empty corpus"):
        load_records(tmp_path)


def test_error_unknown_extension(tmp_path):
    f = tmp_path / "d.csv"
    f.write_text("a,b")
    with pytest.raises(DataError, match="unknown data extension '.csv'"):
        load_records(f)


def test_error_bad_jsonl_line_number(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"text": "ok"}\n{"text": "ok"}\n{"text": broken}\n')
    with pytest.raises(DataError, match=r"d\.jsonl:3: invalid JSON"):
        load_records(f)


def test_error_jsonl_without_text(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"text": "ok"}\n{"body": "no"}\n')
    with pytest.raises(DataError, match=r":2: expected a JSON object with a string 'text' field"):
        load_records(f)
    f.write_text('{"text": 5}\n')
    with pytest.raises(DataError, match=r":1: expected"):
        load_records(f)


def test_error_npy_dtype_and_ndim_and_negative(tmp_path):
    f = tmp_path / "t.npy"
    np.save(f, np.zeros(4, dtype=np.float32))
    with pytest.raises(DataError, match="dtype float32 is not an integer type"):
        load_records(f)
    np.save(f, np.zeros((2, 3), dtype=np.uint16))
    with pytest.raises(DataError, match=r"must be 1-D, got shape \(2, 3\)"):
        load_records(f)
    np.save(f, np.array([1, -2], dtype=np.int32))
    with pytest.raises(DataError, match="negative token id -2"):
        load_records(f)


def test_error_odd_raw_bin(tmp_path):
    f = tmp_path / "t.bin"
    f.write_bytes(b"\x01\x02\x03")
    with pytest.raises(DataError, match="odd size"):
        load_records(f)


def test_error_token_beyond_vocab(tmp_path):
    check_vocab([np.array([1, 2, 3], dtype=np.uint32)], 4)
    with pytest.raises(
        DataError, match=r"token id 300 >= vocab_size 256 \(record 1, first offending position 2\)"
    ):
        check_vocab([np.array([1], dtype=np.uint32), np.array([0, 5, 300, 1], dtype=np.uint32)], 256)
    f = tmp_path / "t.npy"
    np.save(f, np.array([1, 2, 999], dtype=np.uint16))
    with pytest.raises(DataError, match="999 >= vocab_size 512"):
        load_datasets(f, seq_len=4, batch_size=1, vocab_size=512)


def test_error_no_window(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("x")
    with pytest.raises(DataError, match="no window of at least 2 tokens"):
        load_datasets(f, seq_len=4, batch_size=1)


def test_data_error_is_value_error_with_one_line(tmp_path):
    with pytest.raises(ValueError) as info:
        load_records(tmp_path / "missing")
    assert "\n" not in str(info.value)
