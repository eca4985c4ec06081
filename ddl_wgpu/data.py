"""Training and evaluation data: corpus specs, tokenizers, windows and padded batches.

A data ``SPEC`` is one of:

``stdlib``
    The running Python's standard-library ``.py`` sources, read at run time (a real corpus present on every
    machine). Files are visited in sorted relative-path order; ``site-packages``/``dist-packages``,
    ``test``/``tests``, ``idlelib`` and ``__pycache__`` folders are skipped. One record per file. The exact
    word ``stdlib`` always means this corpus; write ``./stdlib`` for a path of that name.
``FILE.txt``
    One record: the whole file (UTF-8 text; the byte tokenizer takes the raw bytes as they are).
``FOLDER``
    Every ``*.txt`` file below it, recursively, in sorted relative-path order; one record per file.
``FILE.jsonl``
    One JSON object per line with a string ``text`` field; one record per line. Blank lines are skipped.
``FILE.bin``
    Token ids. Either an llm.c data file (a header of 256 little-endian int32: magic 20240520 with version 1
    for uint16 tokens, or magic 20240801 with version 7 for uint32 tokens; header[2] is the token count and
    the file must hold exactly that many tokens after the 1024-byte header), or, without that header, raw
    little-endian uint16 tokens (the nanoGPT ``train.bin`` layout). One record; memory-mapped.
``FILE.npy``
    A 1-D array of non-negative integers (uint16, uint32, int32, int64, …); one record; memory-mapped
    (``allow_pickle=False``).

A *record* is one document's tokens: a 1-D ``uint32`` array, or ``uint16`` when it is a memory map of a
uint16 token file (kept as a map so that large token files are never copied whole). Records keep their
lengths: they are never concatenated across documents.

Windows, batches and the split rule:

- ``make_windows`` cuts every record into consecutive non-overlapping windows of ``seq_len`` tokens; the last
  window of a record keeps its shorter length; windows shorter than 2 tokens are dropped (they predict
  nothing; `heal` and `accept` ask for a longer minimum and a token budget).
- ``split_windows`` picks the validation windows by a seeded, platform- and numpy-version-independent hash
  of each window's index (splitmix64): the ``round(val_fraction * n)`` windows (at least 1) with the smallest
  keys go to validation, the rest to training; both keep their original order.
- ``TokenDataset`` groups windows into batches of ``batch_size`` rows. Every batch has shape
  ``(batch_size, seq_len)``: ids are ``uint32`` padded with 0, ``lengths`` (int32) hold each row's real
  token count. A trailing partial batch is filled up with length-0 rows (all-zero ids). A row of length L
  contributes L-1 predictions (positions 0..L-2 predict tokens 1..L-1); padding and length-0 rows count
  nothing in any loss.
- ``TokenDataset.summary()`` is a JSON-able dict compared on resume: equal data, order and batching give an
  equal summary (it holds a sha256 fingerprint of the window contents and boundaries).

Every bad input raises ``DataError`` (a ``ValueError``) with one clear line.
"""

from __future__ import annotations

import hashlib
import io
import os
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ddl_wgpu.errors import UserError
from ddl_wgpu.files.safeio import load_json, open_regular, utf8_text

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_VAL_FRACTION",
    "STDLIB_SPEC",
    "Batch",
    "ByteTokenizer",
    "DataError",
    "HFTokenizer",
    "TokenDataset",
    "check_vocab",
    "eval_windows",
    "load_datasets",
    "load_records",
    "make_windows",
    "shuffle_windows",
    "split_windows",
    "tokenizer_for",
]

STDLIB_SPEC = "stdlib"
DEFAULT_MAX_TOKENS = 2_000_000  # a training run reads at most this many tokens per spec
DEFAULT_VAL_FRACTION = 0.05  # windows held out for validation when no validation spec is given
TEXT_SUFFIX = ".txt"
LLMC_HEADER_INTS = 256
LLMC_HEADER_BYTES = LLMC_HEADER_INTS * 4
# (magic, version) -> token dtype, as written by llm.c's dev/data/data_common.py.
LLMC_FORMATS: dict[tuple[int, int], np.dtype] = {
    (20240520, 1): np.dtype("<u2"),  # gpt-2
    (20240801, 7): np.dtype("<u4"),  # llama-3
}
LLMC_MAGICS = {magic for magic, _ in LLMC_FORMATS}
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"})
_UINT32_MAX = np.iinfo(np.uint32).max
_FINGERPRINT_TAG = b"ddl-wgpu/data/windows/v1\0"


class DataError(UserError):
    """A data spec, file or setting that cannot be used; the message is one line meant for the user."""


# --------------------------------------------------------------------------------------------- tokenizers


class ByteTokenizer:
    """Byte-level tokenizer: ids are the UTF-8 bytes of the text, ``vocab_size`` 256."""

    name = "byte"
    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return self.encode_bytes(text.encode("utf-8"))

    def encode_bytes(self, data: bytes) -> np.ndarray:
        """Raw bytes as they are (no decoding, so nothing is lost or replaced)."""
        return np.frombuffer(data, dtype=np.uint8).astype(np.uint32)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        arr = np.asarray(ids)
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 255):
            raise DataError("byte tokenizer: ids must lie in [0, 255]")
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (the bytes a model file carries), through the optional
    ``tokenizers`` package (``pip install 'ddl-wgpu[hf]'``). Encoding adds no special tokens."""

    name = "hf"

    def __init__(self, tokenizer_json: bytes | str):
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise DataError(
                "this model carries a Hugging Face tokenizer, which needs the 'tokenizers' package: "
                "pip install 'ddl-wgpu[hf]'"
            ) from exc
        text = utf8_text(tokenizer_json, "the model's tokenizer.json", DataError)  # at load, as at import
        try:
            self._tok = Tokenizer.from_str(text)
        except Exception as exc:  # the Rust side raises its own exception type
            raise DataError(f"invalid tokenizer.json: {_one_line(exc)}") from exc
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        raw = tokenizer_json if isinstance(tokenizer_json, bytes | bytearray) else tokenizer_json.encode()
        self.sha256 = hashlib.sha256(raw).hexdigest()

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.uint32)

    def encode_bytes(self, data: bytes) -> np.ndarray:
        """UTF-8 text; invalid bytes become U+FFFD before tokenization."""
        return self.encode(data.decode("utf-8", errors="replace"))

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._tok.decode([int(i) for i in np.asarray(ids).ravel()], skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HFTokenizer(vocab_size={self.vocab_size}, sha256={self.sha256[:12]})"


Tokenizer = ByteTokenizer | HFTokenizer


def tokenizer_for(tokenizer_json: bytes | str | None) -> Tokenizer:
    """The byte tokenizer when a model carries no tokenizer, else its Hugging Face tokenizer."""
    if tokenizer_json is None or len(tokenizer_json) == 0:
        return ByteTokenizer()
    return HFTokenizer(tokenizer_json)


# --------------------------------------------------------------------------------------------- records


def load_records(
    spec: str | os.PathLike[str], tokenizer: Tokenizer | None = None, max_tokens: int | None = None
) -> list[np.ndarray]:
    """The records (one token array per document) of a data ``SPEC``; see the module docstring.

    ``tokenizer`` (default: bytes) applies to text specs only; token files are taken as they are.
    ``max_tokens`` caps the total: reading stops as soon as that many tokens are in hand and the last record
    is cut so the total is exactly ``min(max_tokens, corpus size)``. Raises ``DataError`` for a missing
    path, an unknown extension, a malformed file or a corpus without tokens.
    """
    tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
    if max_tokens is not None and (
        isinstance(max_tokens, bool) or int(max_tokens) != max_tokens or max_tokens < 1
    ):
        raise DataError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    budget = _Budget(None if max_tokens is None else int(max_tokens))

    label = os.fspath(spec)
    if label == STDLIB_SPEC:
        records = _text_records(_stdlib_files(), tokenizer, budget)
    else:
        path = Path(label)
        if not path.exists():
            raise DataError(f"{label}: no such file or directory")
        if path.is_dir():
            files = _sorted_files(path, lambda p: p.suffix.lower() == TEXT_SUFFIX)
            if not files:
                raise DataError(f"{label}: folder holds no {TEXT_SUFFIX} files")
            records = _text_records(files, tokenizer, budget)
        else:
            suffix = path.suffix.lower()
            if suffix == TEXT_SUFFIX:
                records = _text_records([path], tokenizer, budget)
            elif suffix == ".jsonl":
                records = _jsonl_records(path, tokenizer, budget)
            elif suffix == ".bin":
                records = [budget.cut(_bin_tokens(path))]
            elif suffix == ".npy":
                records = [budget.cut(_npy_tokens(path))]
            else:
                raise DataError(
                    f"{label}: unknown data extension {path.suffix or '(none)'!r} (expected .txt, .jsonl, "
                    f".bin, .npy, a folder of .txt files, or '{STDLIB_SPEC}')"
                )
    records = [r for r in records if r.size > 0]
    if not records:
        raise DataError(f"{label}: empty corpus (no tokens)")
    return records


def check_vocab(records: Sequence[np.ndarray], vocab_size: int) -> None:
    """Raise ``DataError`` unless every token id is below ``vocab_size``."""
    if vocab_size < 1:
        raise DataError(f"vocab_size must be positive, got {vocab_size}")
    for index, record in enumerate(records):
        if record.size == 0:
            continue
        top = int(record.max())
        if top >= vocab_size:
            position = int(np.argmax(np.asarray(record) >= vocab_size))
            raise DataError(
                f"token id {top} >= vocab_size {vocab_size} (record {index}, first offending position "
                f"{position})"
            )


class _Budget:
    """How many more tokens ``max_tokens`` allows."""

    def __init__(self, limit: int | None):
        self.left = limit

    @property
    def done(self) -> bool:
        return self.left is not None and self.left <= 0

    def cut(self, tokens: np.ndarray) -> np.ndarray:
        if self.left is None:
            return tokens
        tokens = tokens[: self.left]
        self.left -= int(tokens.size)
        return tokens


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _sorted_files(root: Path, keep) -> list[Path]:
    """Files below ``root`` for which ``keep(path)`` holds, sorted by relative POSIX path."""
    found = [p for p in root.rglob("*") if p.is_file() and keep(p)]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise DataError(f"{STDLIB_SPEC}: the standard-library sources are not on this machine ({root})")
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _STDLIB_SKIP_DIRS)
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath) / name
                found.append((path.relative_to(root).as_posix(), path))
    found.sort()
    if not found:
        raise DataError(f"{STDLIB_SPEC}: no .py sources under {root}")
    return [path for _, path in found]


def _read_bytes(path: Path, limit: int | None = None) -> bytes:
    """At most `limit` bytes (None: all) of a regular file; a FIFO or a device (`/dev/zero`) is refused, so
    reading never blocks or grows without bound, and a file larger than the budget is never read whole."""
    with open_regular(path, "a data file", DataError) as f:
        try:
            return f.read() if limit is None else f.read(limit)
        except OSError as exc:
            raise DataError(f"{path}: cannot read ({exc.strerror or _one_line(exc)})") from exc


def _check_regular(path: Path) -> None:
    open_regular(path, "a data file", DataError).close()


def _text_records(files: Sequence[Path], tokenizer: Tokenizer, budget: _Budget) -> list[np.ndarray]:
    records = []
    for path in files:
        if budget.done:
            break
        # bytes are tokens: never read more than the budget needs
        limit = budget.left if isinstance(tokenizer, ByteTokenizer) else None
        data = _read_bytes(path, limit)
        records.append(budget.cut(tokenizer.encode_bytes(data)))
    return records


def _jsonl_records(path: Path, tokenizer: Tokenizer, budget: _Budget) -> list[np.ndarray]:
    records = []
    handle = io.BufferedReader(open_regular(path, "a data file", DataError))  # lines need a buffer
    with handle:
        for lineno, raw in enumerate(handle, start=1):
            if budget.done:
                break
            if not raw.strip():
                continue
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark
                raw = raw[3:]
            obj = load_json(raw, f"{path}:{lineno}", DataError)  # hostile JSON: one DataError
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise DataError(f"{path}:{lineno}: expected a JSON object with a string 'text' field")
            records.append(budget.cut(tokenizer.encode(obj["text"])))
    return records


def _bin_tokens(path: Path) -> np.ndarray:
    _check_regular(path)
    size = path.stat().st_size
    if size == 0:
        return np.zeros(0, dtype=np.uint16)
    if size >= LLMC_HEADER_BYTES:
        header = np.fromfile(path, dtype="<i4", count=LLMC_HEADER_INTS)
        magic, version, count = (int(v) for v in header[:3])
        if magic in LLMC_MAGICS:
            dtype = LLMC_FORMATS.get((magic, version))
            if dtype is None:
                supported = ", ".join(f"magic {m} version {v}" for m, v in LLMC_FORMATS)
                raise DataError(
                    f"{path}: llm.c header magic {magic} version {version} is not supported ({supported})"
                )
            expected = LLMC_HEADER_BYTES + count * dtype.itemsize
            if count < 0 or size != expected:
                raise DataError(
                    f"{path}: llm.c header says {count} tokens ({expected} bytes) but the file holds {size} bytes"
                )
            if count == 0:
                return np.zeros(0, dtype=dtype)
            return _native(np.memmap(path, dtype=dtype, mode="r", offset=LLMC_HEADER_BYTES, shape=(count,)))
    if size % 2:
        raise DataError(f"{path}: raw uint16 token file has an odd size ({size} bytes)")
    return _native(np.memmap(path, dtype="<u2", mode="r"))


def _native(arr: np.ndarray) -> np.ndarray:
    """A little-endian map stays a map on little-endian hosts; elsewhere it becomes a native copy."""
    return arr if arr.dtype.isnative else arr.astype(arr.dtype.newbyteorder("="))


def _npy_tokens(path: Path) -> np.ndarray:
    _check_regular(path)
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise DataError(f"{path}: not a readable .npy array ({_one_line(exc)})") from exc
    if not isinstance(arr, np.ndarray):
        raise DataError(f"{path}: expected one array, found an archive")
    if arr.dtype.kind not in "iu":
        raise DataError(
            f"{path}: .npy dtype {arr.dtype} is not an integer type (use uint16/uint32/int32/int64)"
        )
    if arr.ndim != 1:
        raise DataError(f"{path}: .npy token array must be 1-D, got shape {tuple(arr.shape)}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.uint32)
    if arr.dtype.kind == "i" and int(arr.min()) < 0:
        raise DataError(f"{path}: negative token id {int(arr.min())}")
    if arr.dtype.itemsize > 4 and int(arr.max()) > _UINT32_MAX:
        raise DataError(f"{path}: token id {int(arr.max())} does not fit in uint32")
    if arr.dtype.kind == "u" and arr.dtype.itemsize in (2, 4):
        return _native(arr)
    return np.asarray(arr, dtype=np.uint32)


# --------------------------------------------------------------------------------------------- windows


def make_windows(
    records: Sequence[np.ndarray],
    seq_len: int,
    min_len: int = 2,
    max_tokens: int | None = None,
    cut_min_len: int | None = None,
) -> list[np.ndarray]:
    """Each record cut into consecutive non-overlapping windows of ``seq_len`` tokens (views, no copies).

    The last window of a record keeps its shorter length; windows of fewer than ``min_len`` tokens are
    dropped (2 by default: a shorter window predicts nothing; `heal` and `accept` ask for room for their
    chain). With ``max_tokens`` the windows hold at most that many tokens in all: the window that reaches
    the budget is cut to fit and is the last (dropped when the cut leaves it shorter than ``cut_min_len``,
    by default ``min_len``; the reference heal tool keeps it whatever its length: `heal` passes 1).
    """
    cut_min_len = min_len if cut_min_len is None else cut_min_len
    _check_seq_len(seq_len)
    windows: list[np.ndarray] = []
    left = max_tokens
    for record in records:
        for start in range(0, int(record.shape[0]), seq_len):
            if left is not None and left <= 0:
                return windows
            window = record[start : start + seq_len]
            if window.shape[0] < min_len:
                continue
            if left is not None:
                window = window[:left]
                if window.shape[0] < cut_min_len:
                    return windows
                left -= int(window.shape[0])
            windows.append(window)
    return windows


def _splitmix64(values: np.ndarray) -> np.ndarray:
    """The splitmix64 finalizer on uint64 values (a fixed, version-independent integer hash)."""
    z = values.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _keys(n: int, seed: int) -> np.ndarray:
    salt = _splitmix64(np.array([seed & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))[0]
    with np.errstate(over="ignore"):
        return _splitmix64(np.arange(n, dtype=np.uint64) ^ salt)


def split_windows(
    windows: Sequence[np.ndarray], val_fraction: float, seed: int = 0
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Deterministic split into ``(train, val)``.

    Window ``i`` gets the key ``splitmix64(i ^ splitmix64(seed))``; the ``round(val_fraction * n)`` windows
    (at least 1, at most n-1) with the smallest keys form ``val``. Both parts keep their original order and
    are disjoint. ``val_fraction == 0`` gives ``(all windows, [])``.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction must lie in [0, 1), got {val_fraction}")
    windows = list(windows)
    if val_fraction == 0.0:
        return windows, []
    n = len(windows)
    if n < 2:
        raise DataError(
            f"cannot split {n} window(s) into training and validation; give more data or separate validation "
            "data",
            kind="split_too_small",
        )
    n_val = min(max(round(val_fraction * n), 1), n - 1)
    with np.errstate(over="ignore"):
        order = np.argsort(_keys(n, seed), kind="stable")
    is_val = np.zeros(n, dtype=bool)
    is_val[order[:n_val]] = True
    train = [w for w, v in zip(windows, is_val, strict=True) if not v]
    val = [w for w, v in zip(windows, is_val, strict=True) if v]
    return train, val


def shuffle_windows(windows: Sequence[np.ndarray], seed: int = 0) -> list[np.ndarray]:
    """Windows in a seeded order (sorted by the same splitmix64 keys as ``split_windows``, salted apart),
    so that batches mix documents; the same seed gives the same order on every machine."""
    n = len(windows)
    with np.errstate(over="ignore"):
        order = np.argsort(_keys(n, seed ^ 0x5F3759DF), kind="stable")
    return [windows[i] for i in order]


def _check_seq_len(seq_len: int) -> None:
    if isinstance(seq_len, bool) or int(seq_len) != seq_len or seq_len < 2:
        raise DataError(f"seq_len must be an integer >= 2, got {seq_len!r}")


# --------------------------------------------------------------------------------------------- batches


@dataclass(frozen=True)
class Batch:
    """One batch: ``ids`` (B, T) uint32 padded with 0; ``lengths`` (B,) int32 real tokens per row.

    Row ``b`` predicts ``ids[b, 1:lengths[b]]`` from positions ``0..lengths[b]-2``; everything else (padding,
    length-0 rows) counts nothing in any loss.
    """

    ids: np.ndarray
    lengths: np.ndarray

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def num_predictions(self) -> int:
        return int(np.maximum(self.lengths.astype(np.int64) - 1, 0).sum())

    def prediction_mask(self) -> np.ndarray:
        """(B, T-1) float32: 1 where position t predicts a real token (t < length - 1), else 0."""
        positions = np.arange(self.ids.shape[1] - 1)
        return (positions[None, :] < (self.lengths[:, None].astype(np.int64) - 1)).astype(np.float32)


class _Batches(Sequence):
    """The batches of a ``TokenDataset``, built on access (a read-only list)."""

    def __init__(self, dataset: TokenDataset):
        self._ds = dataset

    def __len__(self) -> int:
        return self._ds.num_batches

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError("batch index out of range")
        return self._ds.batch(index)

    def __iter__(self) -> Iterator[Batch]:
        for i in range(len(self)):
            yield self._ds.batch(i)


class TokenDataset:
    """Windows grouped into fixed-shape batches (see the module docstring for the conventions).

    ``batches[i]`` holds windows ``i*B .. i*B+B-1`` in order; the last batch is completed with length-0 rows,
    so every batch is ``(batch_size, seq_len)``. ``source`` and ``split`` are labels for ``summary()``.
    """

    def __init__(
        self,
        windows: Sequence[np.ndarray],
        *,
        batch_size: int,
        seq_len: int,
        source: str = "",
        split: str = "all",
    ):
        _check_seq_len(seq_len)
        if isinstance(batch_size, bool) or int(batch_size) != batch_size or batch_size < 1:
            raise DataError(f"batch_size must be a positive integer, got {batch_size!r}")
        self.windows = list(windows)
        self.batch_size = int(batch_size)
        self.seq_len = int(seq_len)
        self.source = str(source)
        self.split = str(split)
        for i, w in enumerate(self.windows):
            if w.ndim != 1 or w.shape[0] > self.seq_len:
                raise DataError(
                    f"window {i} has shape {tuple(w.shape)}; windows are 1-D with <= {self.seq_len} tokens"
                )
        self.lengths = np.array([w.shape[0] for w in self.windows], dtype=np.int32)
        self._fingerprint: str | None = None
        self.batches: Sequence[Batch] = _Batches(self)

    @property
    def num_windows(self) -> int:
        return len(self.windows)

    @property
    def num_batches(self) -> int:
        return -(-len(self.windows) // self.batch_size)

    @property
    def num_tokens(self) -> int:
        """Real tokens (padding excluded)."""
        return int(self.lengths.astype(np.int64).sum())

    @property
    def num_predictions(self) -> int:
        """Σ max(length − 1, 0): the positions any loss averages over."""
        return int(np.maximum(self.lengths.astype(np.int64) - 1, 0).sum())

    def batch(self, index: int) -> Batch:
        rows = self.windows[index * self.batch_size : (index + 1) * self.batch_size]
        ids = np.zeros((self.batch_size, self.seq_len), dtype=np.uint32)
        lengths = np.zeros(self.batch_size, dtype=np.int32)
        for r, w in enumerate(rows):
            ids[r, : w.shape[0]] = w
            lengths[r] = w.shape[0]
        return Batch(ids=ids, lengths=lengths)

    def fingerprint(self) -> str:
        """sha256 over the window lengths (uint64 LE) and then all window tokens (uint32 LE), in order."""
        if self._fingerprint is None:
            h = hashlib.sha256(_FINGERPRINT_TAG)
            h.update(self.lengths.astype("<u8").tobytes())
            chunk: list[np.ndarray] = []
            pending = 0
            for w in self.windows:
                chunk.append(w)
                pending += w.shape[0]
                if pending >= 1 << 20:
                    h.update(np.concatenate(chunk).astype("<u4").tobytes())
                    chunk, pending = [], 0
            if chunk:
                h.update(np.concatenate(chunk).astype("<u4").tobytes())
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def summary(self) -> dict[str, Any]:
        """JSON-able description compared on resume; equal data gives an equal dict."""
        return {
            "source": self.source,
            "split": self.split,
            "num_windows": self.num_windows,
            "num_batches": self.num_batches,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "num_tokens": self.num_tokens,
            "num_predictions": self.num_predictions,
            "sha256": self.fingerprint(),
        }

    def __len__(self) -> int:
        return self.num_batches

    def __repr__(self) -> str:
        return (
            f"TokenDataset(source={self.source!r}, split={self.split!r}, windows={self.num_windows}, "
            f"batches={self.num_batches}x({self.batch_size},{self.seq_len}), tokens={self.num_tokens})"
        )


# --------------------------------------------------------------------------------------------- entry points


def _windows_of(spec, tokenizer, seq_len, max_tokens, vocab_size) -> list[np.ndarray]:
    _check_seq_len(seq_len)
    records = load_records(spec, tokenizer, max_tokens=max_tokens)
    if vocab_size is not None:
        check_vocab(records, vocab_size)
    windows = make_windows(records, seq_len)
    if not windows:
        raise DataError(f"{os.fspath(spec)}: no window of at least 2 tokens")
    return windows


def load_datasets(
    spec: str | os.PathLike[str],
    *,
    tokenizer: Tokenizer | None = None,
    seq_len: int,
    batch_size: int,
    val_spec: str | os.PathLike[str] | None = None,
    val_fraction: float = 0.0,
    max_tokens: int | None = None,
    vocab_size: int | None = None,
    shuffle: bool = True,
    seed: int = 0,
) -> tuple[TokenDataset, TokenDataset | None]:
    """Training and (optional) validation datasets of a ``SPEC``.

    With ``val_spec`` the validation data is loaded from it (``val_fraction`` is then ignored); otherwise
    ``val_fraction > 0`` splits the windows with ``split_windows(…, seed)`` and ``0`` means no validation.
    ``max_tokens`` caps each spec separately; ``vocab_size`` checks every id. With ``shuffle`` the training
    windows are put in the seeded order of ``shuffle_windows`` so batches mix documents; validation windows
    keep the corpus order.
    """
    source = os.fspath(spec)
    windows = _windows_of(spec, tokenizer, seq_len, max_tokens, vocab_size)
    if val_spec is not None:
        train_w = windows
        val_w: list[np.ndarray] | None = _windows_of(val_spec, tokenizer, seq_len, max_tokens, vocab_size)
        val_source, val_split = os.fspath(val_spec), "val"
    elif val_fraction:
        train_w, val_w = split_windows(windows, val_fraction, seed=seed)
        val_source, val_split = source, f"val:{val_fraction:g}:{seed}"
    else:
        train_w, val_w = windows, None
        val_source, val_split = "", ""
    train_split = "train" if val_spec is not None or not val_fraction else f"train:{val_fraction:g}:{seed}"
    if shuffle:
        train_w = shuffle_windows(train_w, seed)
    train = TokenDataset(train_w, batch_size=batch_size, seq_len=seq_len, source=source, split=train_split)
    val = (
        None
        if val_w is None
        else TokenDataset(val_w, batch_size=batch_size, seq_len=seq_len, source=val_source, split=val_split)
    )
    return train, val


def eval_windows(
    spec: str | os.PathLike[str],
    *,
    tokenizer: Tokenizer | None = None,
    seq_len: int,
    batch_size: int,
    max_tokens: int | None = None,
    vocab_size: int | None = None,
) -> TokenDataset:
    """Evaluation batches: every record cut by ``make_windows`` (consecutive, non-overlapping), corpus
    order, no split, no shuffle. The consumer's loss is the mean over all predicted positions
    (``num_predictions``)."""
    windows = _windows_of(spec, tokenizer, seq_len, max_tokens, vocab_size)
    return TokenDataset(windows, batch_size=batch_size, seq_len=seq_len, source=os.fspath(spec), split="eval")


def data_source(data: str, val_data: str | None, val_fraction: float, max_tokens: int) -> dict:
    """How a run loads its data, recorded in its checkpoints (and a sweep's `sweep.json`): paths made
    absolute so that `resume` finds them from any folder. `load_source` loads it."""

    def spec(s):
        return s if s is None or s == STDLIB_SPEC else os.path.abspath(s)

    return {
        "data": spec(data),
        "val_data": spec(val_data),
        "val_fraction": val_fraction,
        "max_tokens": max_tokens,
    }


def load_source(source: dict, seq_len: int, batch_size: int, vocab_size: int, seed: int):
    """(train, validation) datasets of a `data_source` record, byte tokens."""
    return load_datasets(
        source["data"],
        tokenizer=ByteTokenizer(),
        seq_len=seq_len,
        batch_size=batch_size,
        val_spec=source["val_data"],
        val_fraction=source["val_fraction"],
        max_tokens=source["max_tokens"] or None,
        vocab_size=vocab_size,
        seed=seed,
    )
