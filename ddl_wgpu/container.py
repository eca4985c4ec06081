"""The ddl-wgpu checkpoint container (``.ddlw``): one file format for models, training checkpoints and
healed outputs.

Layout (all integers little-endian; design.md §5, style.md rule 12, modelled on safetensors and GGUF)::

    offset 0        b"DDLW"                     magic, 4 bytes
    offset 4        u32 format version          = 2; bumped only for structural changes
    offset 8        u64 N                       exact length of the msgpack header
    offset 16       N bytes msgpack header      a map, see below
    16 + N          8 bytes header checksum     blake2b (digest_size=8) of bytes [0, 16 + N): the preamble
                                                and the header (version 2 on; version 1 files have none)
    16 + N + 8      zero padding                up to data_start = align_up(16 + N + 8, 64)
    data_start      tensor data                 tensors in header order, each at data_start + offset,
                                                zero padding between them up to the next multiple of 64;
                                                the file ends exactly at the last tensor's last byte
                                                (a file without tensors ends at data_start)

msgpack cannot be space-padded the way safetensors pads its JSON (``unpackb`` rejects trailing bytes), so
the header length is exact and the padding comes after it.

Header (a msgpack map with str keys; every key is required)::

    {"format": "ddlw", "version": 2,
     "tensors": {name: {"dtype": "f32", "shape": [4, 8], "offset": 0, "nbytes": 128,
                        "hash": "<16 hex chars: blake2b, digest_size=8, of the tensor bytes>"}, ...},
     "config": {...} | None,        model config (free-form)
     "metadata": {...},             hierarchical lower_snake_case keys (nested maps), free-form
     "provenance": {...},           one key per tool: "train", "heal_mtp", "compress", ...
     "tokenizer": bytes | None,     the Hugging Face tokenizer.json bytes
     "shard": None | {"index": i, "count": n, "set_id": "<16 hex>", "names": [...] | None}}

The tensor table is a map whose order is the file order. dtypes: f32 f16 bf16 f64 i32 u32 i64 u8 i8 u16 bool,
little-endian, C order. numpy has no bfloat16, so bf16 tensors are handed out as uint16 arrays of raw bits;
:func:`bf16_to_f32` and :func:`f32_to_bf16` convert. Free-form maps are written with sorted keys, so the same
inputs always give the same bytes.

Sharding: ``save(..., shard_bytes=B)`` with more than ``B`` bytes of tensor data writes
``stem-00001-of-00003.ddlw`` ... instead of ``stem.ddlw``. Every shard is a complete container holding a
subset of the tensors plus the same config/metadata/provenance/tokenizer; its ``shard`` entry gives its
0-based index, the count, a ``set_id`` (a hash of every name and tensor hash of the set, so shards of two
different saves cannot be mixed) and, in shard 0 only, the names of all tensors of the set.
``open_checkpoint`` given ``stem.ddlw`` (when only the shards exist) or any shard opens the whole set.

Version 1 (no header checksum, data_start = align_up(16 + N, 64)) is still read; a flipped byte in its header
that keeps it well formed (a renamed tensor, say) goes unnoticed there, which is why version 2 adds the
checksum. Files are always written as version 2.

Writing streams tensor by tensor into ``NAME.partial``: the table (and so the header length) follows from
names, dtypes and shapes alone, and hashes are fixed-length strings, so the data is written and hashed in one
pass and the header goes in at the end. Then fsync and ``os.replace``; on any exception the partial files are
removed and whatever was at the final name is left untouched. An ``OSError`` while writing (disk full,
read-only folder, ...) becomes a one-line :class:`CheckpointError` saying so.

The reader treats every file as hostile. It parses only the header; tensor data is read on demand (a
``pread``-style read of exactly that range, or a read-only ``numpy.memmap``). It checks, in this order, and
raises :class:`CheckpointError` with a one-line message naming the file for the first failure:

0. the path is a regular file (a FIFO or a device is refused, without blocking on it);
1. the file is at least 16 bytes long;
2. the magic (the four bytes read are printed);
3. the version (0, too new, or byte-swapped);
4. the header length: at most ``MAX_HEADER_BYTES``, within the file; the header checksum (version 2) and the
   zero padding after it;
5. ``msgpack.unpackb(raw=False, strict_map_key=True)`` with length limits; no trailing bytes, no duplicate
   map keys, no extension types, nesting at most ``MAX_DEPTH``; the top-level keys and their types;
6. each tensor entry: a non-empty name (duplicates are caught in 5), exactly the five keys, a whitelisted
   dtype, a shape of at most 8 non-negative ints, ``nbytes == prod(shape) * itemsize`` (Python ints, capped
   at the file size), an offset that is a non-negative multiple of 64, and bytes inside the file;
7. contiguity: each offset equals the previous end rounded up to 64 (no overlap, no hole) and the data ends
   exactly at EOF (no trailing bytes);
8. every hash is 16 lowercase hex characters.

Tensor hashes are checked as tensors are read: ``open_checkpoint(path)`` hashes the bytes of every tensor
the first time it is handed out (``verify=False`` skips this for trusted inputs), so a command never
computes with, nor writes into a derived file, a tensor whose bytes differ from what was saved.
:meth:`Checkpoint.verify` checks every tensor (and the zero padding) at once. What it costs: blake2b hashes
0.45-0.6 GiB/s on one core of a 2-core Xeon VM (measured with other jobs running); reading a 1 GiB tensor
from the page cache took 0.3-0.4 s without verification and 2.3-2.8 s with it. A 1 B-parameter f32 model
(4 GB) therefore takes about 8-10 s longer to read verified, a few seconds on a faster core. Tensors that
are never read (extra tensors, ``load_model(names=...)``) are not hashed. Nothing is allocated beyond the file
size, nothing else than ``CheckpointError`` escapes for a bad file, and no pickle is involved anywhere.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import re
import struct
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from ddl_wgpu.safeio import open_regular

__all__ = [
    "ALIGNMENT",
    "DTYPES",
    "FORMAT_VERSION",
    "READABLE_VERSIONS",
    "MAGIC",
    "Checkpoint",
    "CheckpointError",
    "TensorInfo",
    "Writer",
    "bf16_to_f32",
    "f32_to_bf16",
    "open_checkpoint",
    "save",
    "shard_paths",
]

MAGIC = b"DDLW"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # version 1 has no header checksum
CHECKSUM_BYTES = 8  # the header checksum after the msgpack header (version 2 on)
ALIGNMENT = 64  # every tensor starts at a multiple of this, relative to data_start (good for memmap and SIMD)
PREAMBLE = 16  # magic + u32 version + u64 header length
MAX_HEADER_BYTES = 64 << 20  # a real header is KBs (tokenizer.json a few MB); refuse absurd lengths early
MAX_NDIM = 8
MAX_DEPTH = 64  # nesting of header maps/lists; keeps every consumer (json.dumps, recursion) safe
HASH_HEX = 16
_CHUNK = 16 << 20  # bytes per write/hash/verify step: bounded memory for memmapped inputs
_HASH_RE = re.compile(r"[0-9a-f]{16}")
_SHARD_RE = re.compile(r"^(?P<stem>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})(?P<suffix>\.[^.]*)?$")

# name -> little-endian numpy dtype; bf16 has no numpy dtype and travels as raw uint16 bits.
DTYPES: dict[str, np.dtype] = {
    "f32": np.dtype("<f4"),
    "f16": np.dtype("<f2"),
    "bf16": np.dtype("<u2"),
    "f64": np.dtype("<f8"),
    "i32": np.dtype("<i4"),
    "u32": np.dtype("<u4"),
    "i64": np.dtype("<i8"),
    "u8": np.dtype("u1"),
    "i8": np.dtype("i1"),
    "u16": np.dtype("<u2"),
    "bool": np.dtype("?"),
}
_FLOAT_DTYPES = ("f32", "f16", "bf16", "f64")
# numpy dtype (native order) -> name, for inferring the dtype of a plain array; uint16 means u16, not bf16.
_FROM_NUMPY = {np.dtype(v).newbyteorder("="): k for k, v in DTYPES.items() if k != "bf16"}
_HEADER_KEYS = ("format", "version", "tensors", "config", "metadata", "provenance", "tokenizer", "shard")
_ENTRY_KEYS = ("dtype", "shape", "offset", "nbytes", "hash")


class CheckpointError(ValueError):
    """A checkpoint file is missing, unreadable, malformed or inconsistent (always one line, naming the file)."""


def align_up(n: int, a: int = ALIGNMENT) -> int:
    return (n + a - 1) // a * a


# --------------------------------------------------------------------------------------------------- bf16


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """Raw bfloat16 bits (uint16 array) -> float32 array of the same shape (exact)."""
    bits = np.asarray(bits)
    if bits.dtype.kind != "u" or bits.dtype.itemsize != 2:
        raise TypeError(f"bf16_to_f32 expects a uint16 array of raw bits, got {bits.dtype}")
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 array -> raw bfloat16 bits (uint16), rounding to nearest, ties to even.

    Overflow rounds to ±inf as IEEE rounding does; NaN maps to a quiet NaN of the same sign (adding the
    rounding bias to a NaN could otherwise carry into the exponent and turn it into inf or flip the sign).
    """
    x = np.asarray(x, dtype=np.float32)
    bits = x.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    out = (rounded & 0xFFFF).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = ((bits[nan] >> 16) & 0x8000).astype(np.uint16) | 0x7FC0
    return out


# ------------------------------------------------------------------------------------------- tensor info


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # one of DTYPES
    shape: tuple[int, ...]
    offset: int  # relative to the data start of `file`
    nbytes: int
    hash: str  # 16 hex chars, blake2b(digest_size=8) of the tensor bytes
    file: str  # the file (shard) holding the tensor

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _hasher() -> Any:
    return hashlib.blake2b(digest_size=8)


def header_checksum(head: bytes) -> bytes:
    """The 8 checksum bytes that follow the preamble and header (`head`) in a version 2 file."""
    return hashlib.blake2b(head, digest_size=CHECKSUM_BYTES).digest()


def _write_error(path: Path, e: OSError) -> CheckpointError:
    return CheckpointError(
        f"{path}: cannot write: {e.strerror or e} (nothing was written at {path.name}; "
        "what was there before is unchanged)"
    )


# ---------------------------------------------------------------------------------------------- writing


def _canonical(obj: Any, where: str, depth: int = 0) -> Any:
    """Copy a free-form header value into plain msgpack types with sorted map keys (deterministic bytes),
    rejecting anything the reader would refuse, so a bad value fails at save time, not at load time."""
    if depth > MAX_DEPTH - 4:  # the header nests these maps a few levels down
        raise ValueError(f"{where}: nested deeper than {MAX_DEPTH - 4} levels")
    if obj is None or isinstance(obj, bool | str | float):
        return obj
    if isinstance(obj, int):
        if not -(1 << 63) <= obj < (1 << 64):
            raise ValueError(f"{where}: integer {obj} does not fit in 64 bits")
        return obj
    if isinstance(obj, np.generic) and obj.dtype.kind in "biuf":
        return _canonical(obj.item(), where, depth)
    if isinstance(obj, bytes | bytearray | memoryview):
        return bytes(obj)
    if isinstance(obj, Mapping):
        for k in obj:
            if not isinstance(k, str):
                raise TypeError(f"{where}: map keys must be str, got {type(k).__name__} {k!r}")
        return {k: _canonical(obj[k], f"{where}.{k}", depth + 1) for k in sorted(obj)}
    if isinstance(obj, list | tuple):
        return [_canonical(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(obj)]
    raise TypeError(f"{where}: cannot store a {type(obj).__name__} in the header (tensors go in `tensors`)")


def _pack(header: dict) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def _check_spec(name: Any, dtype: Any, shape: Any) -> tuple[str, str, tuple[int, ...]]:
    if not isinstance(name, str) or not name:
        raise ValueError(f"tensor name must be a non-empty str, got {name!r}")
    if dtype not in DTYPES:
        raise ValueError(f"tensor {name!r}: unknown dtype {dtype!r} (allowed: {', '.join(DTYPES)})")
    shape = tuple(shape)
    if len(shape) > MAX_NDIM or not all(isinstance(d, int | np.integer) and d >= 0 for d in shape):
        raise ValueError(f"tensor {name!r}: shape {shape} must be at most {MAX_NDIM} non-negative ints")
    return name, dtype, tuple(int(d) for d in shape)


def _as_storable(name: str, array: Any, dtype: str | None) -> tuple[np.ndarray, str]:
    """Return (little-endian array of exactly the stored dtype, dtype name). No silent casts: only the byte
    order may change, and a float32 array given as "bf16" is rounded with f32_to_bf16."""
    arr = np.asarray(array)
    native = arr.dtype.newbyteorder("=") if arr.dtype.byteorder not in "|=" else arr.dtype
    if dtype is None:
        if native not in _FROM_NUMPY:
            raise TypeError(
                f"tensor {name!r}: numpy dtype {arr.dtype} is not storable (allowed: {', '.join(DTYPES)})"
            )
        dtype = _FROM_NUMPY[native]
    elif dtype == "bf16" and native == np.float32:
        arr = f32_to_bf16(arr)
    elif dtype not in DTYPES:
        raise ValueError(f"tensor {name!r}: unknown dtype {dtype!r} (allowed: {', '.join(DTYPES)})")
    elif native != DTYPES[dtype].newbyteorder("="):
        raise TypeError(f"tensor {name!r}: array dtype {arr.dtype} does not match dtype {dtype!r}")
    target = DTYPES[dtype]
    if arr.dtype != target:  # only the byte order differs here
        arr = arr.astype(target)
    return arr, dtype


def _byte_chunks(arr: np.ndarray) -> Iterator[memoryview]:
    """The array's bytes in C order, in chunks of about _CHUNK bytes, without copying a contiguous array
    (a memmap input is paged in chunk by chunk)."""
    if arr.nbytes == 0:
        return
    if arr.flags.c_contiguous:
        mv = memoryview(arr.reshape(-1).view(np.uint8))
        for i in range(0, len(mv), _CHUNK):
            yield mv[i : i + _CHUNK]
        return
    rows = max(1, _CHUNK // max(1, arr[0].nbytes))
    for i in range(0, arr.shape[0], rows):
        yield memoryview(np.ascontiguousarray(arr[i : i + rows]).reshape(-1).view(np.uint8))


def shard_paths(path: str | os.PathLike, count: int) -> list[Path]:
    """The file names of a `count`-shard set for `path` (`stem.ddlw` -> `stem-00001-of-0000N.ddlw`, ...)."""
    p = Path(path)
    suffix = p.suffix or ".ddlw"
    stem = p.name[: -len(p.suffix)] if p.suffix else p.name
    return [p.with_name(f"{stem}-{i + 1:05d}-of-{count:05d}{suffix}") for i in range(count)]


def _stale_set_files(path: Path) -> list[Path]:
    """Existing shard files of any set for `path` (any count)."""
    suffix = path.suffix or ".ddlw"
    stem = path.name[: -len(path.suffix)] if path.suffix else path.name
    parent = path.parent
    pat = re.compile(re.escape(stem) + r"-\d{5}-of-\d{5}" + re.escape(suffix))
    try:
        listing = os.listdir(parent)
    except OSError:  # a missing or unreadable directory holds no shards we could use
        return []
    return sorted(parent / n for n in listing if pat.fullmatch(n))


def _fsync_dir(d: Path) -> None:
    # Makes the renames durable on POSIX; directories cannot be opened this way on Windows.
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class _Part:
    """One output file (the whole checkpoint, or one shard) while it is being written."""

    def __init__(self, final: Path, names: list[str], table: dict[str, dict], data_bytes: int):
        self.final = final
        self.partial = final.with_name(final.name + ".partial")
        self.names = names
        self.table = table  # name -> entry dict; hashes filled in as tensors are written
        self.data_bytes = data_bytes
        self.file: Any = None
        self.header_len = 0
        self.data_start = 0

    def layout(self, header: dict) -> None:
        # Hashes are fixed-length strings, so a header packed with placeholder hashes has the final length.
        self.header_len = len(_pack(header))
        self.data_start = align_up(PREAMBLE + self.header_len + CHECKSUM_BYTES)

    def open(self) -> None:
        self.file = open(self.partial, "wb")  # noqa: SIM115 -- closed in finish()/abort()
        # Reserve the header region; the real header is written over it once every hash is known.
        self.file.write(b"\0" * self.data_start)

    def finish(self, header: dict) -> None:
        if self.file is None:
            self.open()
        f = self.file
        assert f.tell() == self.data_start + self.data_bytes, "tensor data does not end where the table says"
        packed = _pack(header)
        assert len(packed) == self.header_len, "header length changed between layout and finish"
        f.seek(0)
        head = MAGIC + struct.pack("<IQ", FORMAT_VERSION, len(packed)) + packed
        f.write(head + header_checksum(head))
        f.flush()
        os.fsync(f.fileno())
        f.close()
        self.file = None

    def abort(self) -> None:
        if self.file is not None:
            with contextlib.suppress(OSError):
                self.file.close()
            self.file = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.partial)


class Writer:
    """Streaming writer. Declare every tensor up front (name, dtype, shape), then write them in that order::

        specs = [("embed", "bf16", (V, D)), ("norm", "f32", (D,))]
        with Writer("model.ddlw", specs, config=cfg) as w:
            w.write("embed", embed_bits)   # uint16 raw bits (or float32, rounded to bf16)
            w.write("norm", norm)

    Leaving the block normally commits (fsync + rename); an exception removes the partial files. `save`
    is the one-call form. With `shard_bytes`, the set is split greedily in declaration order so that each
    shard holds at most `shard_bytes` of tensor data (a single larger tensor gets a shard of its own).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        specs: Iterable[tuple[str, str, Iterable[int]]],
        *,
        config: Mapping | None = None,
        metadata: Mapping | None = None,
        provenance: Mapping | None = None,
        tokenizer: bytes | str | None = None,
        shard_bytes: int | None = None,
    ):
        self.path = Path(path)
        entries: dict[str, tuple[str, tuple[int, ...], int]] = {}
        for spec in specs:
            name, dtype, shape = _check_spec(*spec)
            if name in entries:
                raise ValueError(f"duplicate tensor name {name!r}")
            entries[name] = (dtype, shape, math.prod(shape) * DTYPES[dtype].itemsize)
        if config is not None and not isinstance(config, Mapping):
            raise TypeError(f"config must be a mapping or None, got {type(config).__name__}")
        for label, m in (("metadata", metadata), ("provenance", provenance)):
            if m is not None and not isinstance(m, Mapping):
                raise TypeError(f"{label} must be a mapping or None, got {type(m).__name__}")
        if isinstance(tokenizer, str):
            tokenizer = tokenizer.encode("utf-8")
        if tokenizer is not None and not isinstance(tokenizer, bytes | bytearray | memoryview):
            raise TypeError(f"tokenizer must be bytes, str or None, got {type(tokenizer).__name__}")
        self._common = {
            "config": None if config is None else _canonical(config, "config"),
            "metadata": _canonical(metadata or {}, "metadata"),
            "provenance": _canonical(provenance or {}, "provenance"),
            "tokenizer": None if tokenizer is None else bytes(tokenizer),
        }
        self._entries = entries
        self._order = list(entries)

        # Greedy split in declaration order.
        groups: list[list[str]] = [[]]
        total = sum(e[2] for e in entries.values())
        if shard_bytes is not None and shard_bytes <= 0:
            raise ValueError(f"shard_bytes must be positive, got {shard_bytes}")
        if shard_bytes is not None and total > shard_bytes:
            used = 0
            for name in self._order:
                nb = entries[name][2]
                if groups[-1] and used + nb > shard_bytes:
                    groups.append([])
                    used = 0
                groups[-1].append(name)
                used += nb
        else:
            groups[0] = list(self._order)
        self.sharded = len(groups) > 1
        finals = shard_paths(self.path, len(groups)) if self.sharded else [self.path]

        self._parts: list[_Part] = []
        for i, (final, group) in enumerate(zip(finals, groups, strict=True)):
            table, off = {}, 0
            for name in group:
                dtype, shape, nb = entries[name]
                off = align_up(off)
                table[name] = {
                    "dtype": dtype,
                    "shape": list(shape),
                    "offset": off,
                    "nbytes": nb,
                    "hash": "0" * HASH_HEX,
                }
                off += nb
            part = _Part(final, group, table, off)
            part.layout(self._header(part, i, len(groups), "0" * HASH_HEX))
            self._parts.append(part)
        self._part_of = {n: p for p in self._parts for n in p.names}
        self._next = 0  # index into self._order of the next tensor to write
        self._done = False

    @property
    def paths(self) -> list[Path]:
        """The final file names this writer produces."""
        return [p.final for p in self._parts]

    def _header(self, part: _Part, index: int, count: int, set_id: str) -> dict:
        shard = None
        if self.sharded:
            shard = {
                "index": index,
                "count": count,
                "set_id": set_id,
                "names": self._order if index == 0 else None,
            }
        return {
            "format": "ddlw",
            "version": FORMAT_VERSION,
            "tensors": part.table,
            **self._common,
            "shard": shard,
        }

    def write(self, name: str, array: Any, dtype: str | None = None) -> None:
        """Write the next declared tensor. `dtype` defaults to the declared one; a float32 array declared
        "bf16" is rounded to bf16, a uint16 array is taken as raw bf16 bits."""
        if self._done:
            raise RuntimeError("writer is closed")
        if self._next >= len(self._order):
            raise ValueError(f"tensor {name!r} was not declared (all {len(self._order)} tensors are written)")
        expected = self._order[self._next]
        if name != expected:
            raise ValueError(f"tensor {name!r} written out of order: expected {expected!r}")
        decl_dtype, decl_shape, nb = self._entries[name]
        if dtype is not None and dtype != decl_dtype:
            raise ValueError(f"tensor {name!r}: dtype {dtype!r} differs from the declared {decl_dtype!r}")
        arr, _ = _as_storable(name, array, decl_dtype)
        if arr.shape != decl_shape:
            raise ValueError(f"tensor {name!r}: shape {arr.shape} differs from the declared {decl_shape}")
        part = self._part_of[name]
        entry = part.table[name]
        h = _hasher()
        try:
            if part.file is None:
                part.open()
            f = part.file
            pad = part.data_start + entry["offset"] - f.tell()
            assert 0 <= pad < ALIGNMENT
            f.write(b"\0" * pad)
            for chunk in _byte_chunks(arr):
                h.update(chunk)
                f.write(chunk)
        except OSError as e:
            self.abort()
            raise _write_error(part.final, e) from None
        assert f.tell() == part.data_start + entry["offset"] + nb
        entry["hash"] = h.hexdigest()
        self._next += 1

    def close(self) -> list[Path]:
        """Finish every file, fsync, and rename all of them onto their final names. Returns the paths."""
        if self._done:
            return self.paths
        try:
            if self._next != len(self._order):
                raise ValueError(f"tensor {self._order[self._next]!r} was declared but not written")
            set_id = "0" * HASH_HEX
            if self.sharded:
                # Ties the shards of one save together: a shard of another save (same names, other data) fails.
                h = _hasher()
                h.update(_pack([[n, self._part_of[n].table[n]["hash"]] for n in self._order]))
                set_id = h.hexdigest()
            for i, part in enumerate(self._parts):
                part.finish(self._header(part, i, len(self._parts), set_id))
            stale = [p for p in _stale_set_files(self.path) if p not in self.paths]
            if self.sharded and self.path.exists():
                stale.append(self.path)
            # Renames go last, after every file is complete and durable.
            for part in self._parts:
                os.replace(part.partial, part.final)
        except OSError as e:
            self.abort()
            raise _write_error(self.path, e) from None
        except BaseException:
            self.abort()
            raise
        self._done = True
        # What used to be at this path (a single file or a set with another count) is superseded: remove
        # it so that open_checkpoint(path) cannot find the old checkpoint instead of the new one.
        for p in stale:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
        _fsync_dir(self.path.parent)
        return self.paths

    def abort(self) -> None:
        """Remove every partial file; leaves the final names untouched."""
        self._done = True
        for part in self._parts:
            part.abort()

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def save(
    path: str | os.PathLike,
    tensors: Mapping[str, Any] | Iterable[tuple],
    *,
    config: Mapping | None = None,
    metadata: Mapping | None = None,
    provenance: Mapping | None = None,
    tokenizer: bytes | str | None = None,
    shard_bytes: int | None = None,
) -> list[Path]:
    """Write a checkpoint. `tensors` is a dict name -> array or an iterable of (name, array) or
    (name, array, dtype) — e.g. ("w", uint16_bits, "bf16"). Arrays may be numpy memmaps; they are written
    and hashed chunk by chunk, never concatenated. Tensors keep the given order.

    Returns the written paths: `[path]`, or the shard files when `shard_bytes` forced a split (then `path`
    itself is not created; `open_checkpoint(path)` finds the set). A previous checkpoint at `path` is
    replaced only once the new one is complete.
    """
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    prepared: list[tuple[str, np.ndarray, str]] = []
    for item in items:
        if not isinstance(item, tuple) or len(item) not in (2, 3):
            raise TypeError(f"tensors must yield (name, array) or (name, array, dtype), got {item!r:.80}")
        name = item[0]
        if not isinstance(name, str) or not name:
            raise ValueError(f"tensor name must be a non-empty str, got {name!r}")
        arr, dtype = _as_storable(name, item[1], item[2] if len(item) == 3 else None)
        prepared.append((name, arr, dtype))
    specs = [(n, d, a.shape) for n, a, d in prepared]
    with Writer(
        path,
        specs,
        config=config,
        metadata=metadata,
        provenance=provenance,
        tokenizer=tokenizer,
        shard_bytes=shard_bytes,
    ) as w:
        for name, arr, dtype in prepared:
            w.write(name, arr, dtype)
    return w.paths


# ---------------------------------------------------------------------------------------------- reading


class _DupMap(dict):
    """Stands in for a msgpack map that had a duplicate key (a plain dict would keep the last silently)."""

    dup: Any = None


def _pairs_hook(pairs: list[tuple[Any, Any]]) -> dict:
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set = set()
        out = _DupMap(d)
        for k, _ in pairs:
            if k in seen:
                out.dup = k
                break
            seen.add(k)
        return out
    return d


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # msgpack bools are Python bools, a subclass of int


def _type_name(v: Any) -> str:
    return "nil" if v is None else type(v).__name__


class _File:
    """One validated container file, kept open for lazy reads."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self.fh = open_regular(self.path, "a checkpoint file", CheckpointError)
        self._lock = threading.Lock()
        self._verified: set[str] = set()  # tensors whose bytes were hashed and matched
        try:
            self._parse()
        except BaseException:
            self.fh.close()
            raise

    def fail(self, msg: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: {msg}")

    def close(self) -> None:
        self.fh.close()

    def pread(self, offset: int, n: int) -> bytes:
        buf = bytearray(n)
        got = self.read_into(offset, memoryview(buf))
        if got != n:
            raise self.fail(f"short read: {got} of {n} bytes at offset {offset} (file truncated?)")
        return bytes(buf)

    def read_into(self, offset: int, mv: memoryview) -> int:
        """Fill `mv` from absolute file `offset`; returns the number of bytes read (short at EOF)."""
        try:
            with self._lock:  # seek + read is not atomic across threads
                self.fh.seek(offset)
                got = 0
                while got < len(mv):
                    n = self.fh.readinto(mv[got:])
                    if not n:
                        break
                    got += n
            return got
        except (OSError, ValueError) as e:  # ValueError: read from a closed file
            raise self.fail(f"read failed at offset {offset}: {e}") from None

    def current_size(self) -> int:
        try:
            return os.fstat(self.fh.fileno()).st_size
        except (OSError, ValueError) as e:
            raise self.fail(f"cannot stat: {e}") from None

    def _parse(self) -> None:
        size = self.size = self.current_size()
        # 1. preamble
        if size < PREAMBLE:
            raise self.fail(
                f"file is {size} bytes, shorter than the {PREAMBLE}-byte preamble (not a checkpoint)"
            )
        pre = self.pread(0, PREAMBLE)
        # 2. magic
        if pre[:4] != MAGIC:
            raise self.fail(f"bad magic {pre[:4]!r}, expected {MAGIC!r} (not a ddl-wgpu checkpoint)")
        # 3. version
        version, n = struct.unpack("<IQ", pre[4:16])
        if version not in READABLE_VERSIONS:
            if version == 0:
                raise self.fail("unsupported format version 0")
            if version > 0xFFFF:
                raise self.fail(
                    f"format version {version} is absurd (0x{version:08x}; byte-swapped or corrupt preamble?)"
                )
            raise self.fail(
                f"format version {version} is newer than this reader supports ({FORMAT_VERSION}); "
                "HINT: upgrade ddl-wgpu"
            )
        self.version = version
        # 4. header length
        if n == 0:
            raise self.fail("header length is 0")
        if n > MAX_HEADER_BYTES:
            raise self.fail(f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte cap")
        if PREAMBLE + n > size:
            raise self.fail(f"header length {n} exceeds file size {size}")
        check = CHECKSUM_BYTES if version >= 2 else 0
        self.data_start = align_up(PREAMBLE + n + check)
        if self.data_start > size:
            raise self.fail(f"data section starts at {self.data_start} but file size is {size} (truncated)")
        region = self.pread(PREAMBLE, self.data_start - PREAMBLE)
        raw, stored, padding = region[:n], region[n : n + check], region[n + check :]
        if check and stored != header_checksum(pre + raw):
            raise self.fail(
                f"header checksum mismatch: stored {stored.hex()}, header hashes to "
                f"{header_checksum(pre + raw).hex()} (the header is corrupt)"
            )
        if padding.count(0) != len(padding):
            raise self.fail(f"non-zero padding between the header (ends at {PREAMBLE + n}) and the data")
        # 5. msgpack, strictly
        header = self._unpack(raw, n)
        self._check_top(header)
        self.header = header
        # 6.-8. tensor table
        self.entries = self._check_tensors(header["tensors"])

    def _unpack(self, raw: bytes, n: int) -> dict:
        try:
            header = msgpack.unpackb(
                raw,
                raw=False,
                strict_map_key=True,
                use_list=True,
                object_pairs_hook=_pairs_hook,
                max_str_len=n,
                max_bin_len=n,
                max_array_len=n,
                max_map_len=n,
                max_ext_len=n,
            )
        except msgpack.ExtraData as e:
            raise self.fail(
                f"header has {len(e.extra)} trailing bytes after the msgpack map, inside the declared length {n}"
            ) from None
        except Exception as e:  # noqa: BLE001 -- msgpack raises many types (ValueError, UnicodeDecodeError,
            # TypeError, StackError, ...) for hostile bytes; each must become a CheckpointError.
            msg = (str(e).splitlines() or [""])[0] or type(e).__name__
            raise self.fail(f"header is not valid msgpack: {msg}") from None
        # Walk every value once (iteratively: no recursion on hostile depth): types, depth, duplicates.
        stack: list[tuple[Any, str, int]] = [(header, "", 0)]
        while stack:
            v, where, depth = stack.pop()
            if depth > MAX_DEPTH:
                raise self.fail(f"header nests deeper than {MAX_DEPTH} levels at {where or 'top'}")
            if isinstance(v, dict):
                if isinstance(v, _DupMap):
                    if where == "tensors":
                        raise self.fail(f"duplicate tensor name {v.dup!r}")
                    raise self.fail(f"duplicate key {v.dup!r} in header map {where or 'top'}")
                for k, x in v.items():
                    if not isinstance(k, str):
                        raise self.fail(f"header map key {k!r} at {where or 'top'} is not a str")
                    stack.append((x, f"{where}.{k}" if where else k, depth + 1))
            elif isinstance(v, list):
                stack.extend((x, f"{where}[{i}]", depth + 1) for i, x in enumerate(v))
            elif not (v is None or isinstance(v, bool | int | float | str | bytes)):
                raise self.fail(
                    f"header value at {where or 'top'} has unsupported msgpack type {type(v).__name__}"
                )
        if not isinstance(header, dict):
            raise self.fail(f"header is a msgpack {_type_name(header)}, expected a map")
        return header

    def _check_top(self, h: dict) -> None:
        for k in _HEADER_KEYS:
            if k not in h:
                raise self.fail(f"header is missing required key {k!r}")
        for k in h:
            if k not in _HEADER_KEYS:
                raise self.fail(f"header has unknown key {k!r} (non-structural data belongs in metadata)")
        if h["format"] != "ddlw":
            raise self.fail(f"header format is {h['format']!r}, expected 'ddlw'")
        if not _is_int(h["version"]) or h["version"] != self.version:
            raise self.fail(f"header version {h['version']!r} does not match the file version {self.version}")
        types = {
            "tensors": (dict,),
            "config": (dict, type(None)),
            "metadata": (dict,),
            "provenance": (dict,),
            "tokenizer": (bytes, type(None)),
            "shard": (dict, type(None)),
        }
        for k, allowed in types.items():
            if not isinstance(h[k], allowed):
                want = " or ".join(
                    "nil" if t is type(None) else {"dict": "map", "bytes": "bin"}[t.__name__] for t in allowed
                )
                raise self.fail(f"header {k!r} is a {_type_name(h[k])}, expected {want}")
        s = h["shard"]
        if s is not None:
            keys = ("index", "count", "set_id", "names")
            if sorted(s) != sorted(keys):
                raise self.fail(f"header 'shard' has keys {sorted(s)}, expected {sorted(keys)}")
            idx, cnt = s["index"], s["count"]
            if not (_is_int(cnt) and 1 <= cnt <= 99999 and _is_int(idx) and 0 <= idx < cnt):
                raise self.fail(f"header 'shard' has index {idx!r} of count {cnt!r}")
            if not (isinstance(s["set_id"], str) and _HASH_RE.fullmatch(s["set_id"])):
                raise self.fail(f"header 'shard' set_id {s['set_id']!r} is not {HASH_HEX} hex chars")
            names = s["names"]
            if idx == 0:
                if not (isinstance(names, list) and all(isinstance(x, str) for x in names)):
                    raise self.fail("header 'shard' of shard 0 must list every tensor name of the set")
            elif names is not None:
                raise self.fail(f"header 'shard' names must be nil outside shard 0 (this is shard {idx})")

    def _check_tensors(self, table: dict) -> dict[str, TensorInfo]:
        size, ds = self.size, self.data_start
        parsed: list[tuple[str, str, tuple[int, ...], int, int, Any]] = []
        # 6. each entry on its own
        for name, e in table.items():
            if not name:
                raise self.fail("tensor with an empty name")
            if not isinstance(e, dict):
                raise self.fail(f"tensor {name!r}: entry is a {_type_name(e)}, expected a map")
            if sorted(e) != sorted(_ENTRY_KEYS):
                missing = [k for k in _ENTRY_KEYS if k not in e]
                extra = [k for k in e if k not in _ENTRY_KEYS]
                raise self.fail(f"tensor {name!r}: entry keys missing {missing}, unknown {extra}")
            dtype = e["dtype"]
            if not isinstance(dtype, str) or dtype not in DTYPES:
                raise self.fail(f"tensor {name!r}: unknown dtype {dtype!r} (allowed: {', '.join(DTYPES)})")
            shape = e["shape"]
            if not isinstance(shape, list):
                raise self.fail(f"tensor {name!r}: shape is a {_type_name(shape)}, expected a list")
            if len(shape) > MAX_NDIM:
                raise self.fail(f"tensor {name!r}: {len(shape)} dimensions, at most {MAX_NDIM} allowed")
            for d in shape:
                if not _is_int(d) or d < 0:
                    raise self.fail(
                        f"tensor {name!r}: shape {shape!r} has a dimension that is not a non-negative int"
                    )
            # Size in Python ints, capped at the file size as it grows, so a hostile shape cannot make
            # anything big (not even a big int).
            want = DTYPES[dtype].itemsize
            if 0 in shape:
                want = 0
            else:
                for d in shape:
                    want *= d
                    if want > size:
                        raise self.fail(
                            f"tensor {name!r}: shape {shape} needs more bytes than the file size {size}"
                        )
            nb = e["nbytes"]
            if not _is_int(nb) or nb != want:
                raise self.fail(f"tensor {name!r}: nbytes {nb!r} != {want} (shape {shape} x {dtype})")
            off = e["offset"]
            if not _is_int(off) or off < 0:
                raise self.fail(f"tensor {name!r}: offset {off!r} is not a non-negative int")
            if off % ALIGNMENT:
                raise self.fail(f"tensor {name!r}: offset {off} is not a multiple of {ALIGNMENT}")
            if ds + off + nb > size:
                raise self.fail(
                    f"tensor {name!r}: bytes [{ds + off}, {ds + off + nb}) extend past the end of the file "
                    f"(size {size}; truncated?)"
                )
            parsed.append((name, dtype, tuple(shape), off, nb, e["hash"]))
        # 7. contiguity: every byte of the data section belongs to exactly one tensor or its alignment padding
        end, prev = 0, None
        for name, _, _, off, nb, _ in parsed:
            expect = align_up(end)
            if off < end:
                raise self.fail(
                    f"tensor {name!r}: offset {off} overlaps tensor {prev!r}, which ends at {end}"
                )
            if off != expect:
                raise self.fail(
                    f"tensor {name!r}: offset {off} leaves a hole; expected {expect} after {prev!r}"
                )
            end, prev = off + nb, name
        if ds + end != size:
            raise self.fail(
                f"{size - ds - end} trailing bytes after the tensor data (data ends at {ds + end})"
            )
        # 8. hash strings
        out: dict[str, TensorInfo] = {}
        for name, dtype, shape, off, nb, hsh in parsed:
            if not isinstance(hsh, str) or not _HASH_RE.fullmatch(hsh):
                raise self.fail(f"tensor {name!r}: hash {hsh!r} is not {HASH_HEX} lowercase hex chars")
            out[name] = TensorInfo(name, dtype, shape, off, nb, hsh, self.path)
        return out

    # reads -------------------------------------------------------------------------------------------
    def _check_unchanged(self) -> None:
        # Reading past EOF of a memmap raises SIGBUS, so a file truncated since open must be caught here.
        now = self.current_size()
        if now != self.size:
            raise self.fail(f"file size changed from {self.size} to {now} since it was opened")

    def _check_hash(self, t: TensorInfo, h: Any) -> None:
        if h.hexdigest() != t.hash:
            raise self.fail(
                f"tensor {t.name!r}: hash mismatch: header says {t.hash}, data hashes to {h.hexdigest()} "
                "(the file is corrupt)"
            )
        self._verified.add(t.name)

    def tensor(self, t: TensorInfo, copy: bool, verify: bool) -> np.ndarray:
        self._check_unchanged()
        dt = DTYPES[t.dtype]
        verify = verify and t.name not in self._verified
        if t.nbytes == 0:  # nothing to map (mmap refuses empty ranges)
            arr = np.zeros(t.shape, dt)
            arr.flags.writeable = copy
            if verify:
                self._check_hash(t, _hasher())
        elif copy:
            arr = np.empty(t.shape, dt)
            mv = memoryview(arr.reshape(-1).view(np.uint8))
            h = _hasher() if verify else None
            # Chunk by chunk, each hashed right after it is read, while it is still in the CPU cache.
            for pos in range(0, t.nbytes, _CHUNK):
                piece = mv[pos : pos + _CHUNK]
                got = self.read_into(self.data_start + t.offset + pos, piece)
                if got != len(piece):
                    raise self.fail(
                        f"tensor {t.name!r}: short read of {pos + got} of {t.nbytes} bytes (file truncated?)"
                    )
                if verify:
                    h.update(piece)
            if verify:
                self._check_hash(t, h)
        else:
            try:
                with self._lock:  # np.memmap seeks the shared file object to find its size
                    arr = np.memmap(
                        self.fh, dtype=dt, mode="r", offset=self.data_start + t.offset, shape=t.numel
                    )
            except (OSError, ValueError) as e:
                raise self.fail(f"tensor {t.name!r}: cannot memory-map: {e}") from None
            arr = arr.reshape(t.shape)
            if verify:
                h = _hasher()
                for chunk in _byte_chunks(arr):
                    h.update(chunk)
                self._check_hash(t, h)
        if t.dtype == "bool" and arr.size and arr.view(np.uint8).max() > 1:
            raise self.fail(f"tensor {t.name!r}: bool tensor holds bytes other than 0 and 1")
        return arr

    def verify(self) -> None:
        self._check_unchanged()
        buf = bytearray(min(_CHUNK, max(self.size - self.data_start, 1)))
        end = 0
        for t in self.entries.values():
            gap = t.offset - end
            if gap and self.pread(self.data_start + end, gap).count(0) != gap:
                raise self.fail(f"non-zero padding before tensor {t.name!r}")
            h = _hasher()
            pos = 0
            while pos < t.nbytes:
                n = min(len(buf), t.nbytes - pos)
                mv = memoryview(buf)[:n]
                if self.read_into(self.data_start + t.offset + pos, mv) != n:
                    raise self.fail(f"tensor {t.name!r}: short read while verifying (file truncated?)")
                h.update(mv)
                pos += n
            self._check_hash(t, h)
            end = t.offset + t.nbytes


class Checkpoint:
    """An opened checkpoint (one file, or a whole shard set presented as one). Use as a context manager or
    call `close()`; arrays returned with copy=False stay valid after closing.

    `header` is the first file's decoded header (for a set, its `tensors` lists only shard 0's tensors;
    `names()`/`info()` cover the whole set). `path` is the path it was opened with, `files` the file(s).
    """

    def __init__(self, files: list[_File], path: str | os.PathLike, verify: bool = True):
        self._files = files
        self.path = Path(path)
        self.verify_reads = verify
        first = files[0]
        self.header: dict = first.header
        self.version: int = first.version
        self._infos: dict[str, TensorInfo] = {}
        self._file_of: dict[str, _File] = {}
        for f in files:
            for name, t in f.entries.items():
                assert name not in self._infos, "set validation lets no duplicate through"
                self._infos[name] = t
                self._file_of[name] = f

    # header views
    @property
    def config(self) -> dict | None:
        return self.header["config"]

    @property
    def metadata(self) -> dict:
        return self.header["metadata"]

    @property
    def provenance(self) -> dict:
        return self.header["provenance"]

    @property
    def tokenizer(self) -> bytes | None:
        return self.header["tokenizer"]

    @property
    def files(self) -> list[Path]:
        """The file(s) behind this checkpoint, in shard order."""
        return [Path(f.path) for f in self._files]

    @property
    def shard_count(self) -> int:
        return len(self._files)

    @property
    def shard(self) -> dict | None:
        """The `shard` header entry of the first file (None for an unsharded checkpoint)."""
        return self.header["shard"]

    @property
    def nbytes(self) -> int:
        """Total tensor bytes (without padding)."""
        return sum(t.nbytes for t in self._infos.values())

    @property
    def file_size(self) -> int:
        """Total bytes of the file(s)."""
        return sum(f.size for f in self._files)

    # tensors
    def names(self) -> list[str]:
        return list(self._infos)

    def info(self, name: str) -> TensorInfo:
        return self._infos[name]

    def __contains__(self, name: object) -> bool:
        return name in self._infos

    def __iter__(self) -> Iterator[str]:
        return iter(self._infos)

    def __len__(self) -> int:
        return len(self._infos)

    def tensor(self, name: str, copy: bool = True) -> np.ndarray:
        """The tensor as stored (bf16 as uint16 raw bits). copy=True reads exactly its byte range into a new
        array; copy=False returns a read-only memmap view (no bytes read until touched, unless the checkpoint
        was opened with verify=True: then its bytes are hashed once, here). With verify=True (the default of
        `open_checkpoint`) the first read of each tensor checks its hash and raises CheckpointError on a
        mismatch."""
        t = self._infos[name]
        return self._file_of[name].tensor(t, copy, self.verify_reads)

    def __getitem__(self, name: str) -> np.ndarray:
        return self.tensor(name)

    def tensor_f32(self, name: str) -> np.ndarray:
        """A float tensor (f32/f16/bf16/f64) converted to float32."""
        t = self._infos[name]
        if t.dtype not in _FLOAT_DTYPES:
            raise CheckpointError(
                f"{t.file}: tensor {name!r} has dtype {t.dtype}, expected a float dtype "
                f"({', '.join(_FLOAT_DTYPES)})"
            )
        arr = self.tensor(name, copy=t.dtype == "f32")
        if t.dtype == "bf16":
            return bf16_to_f32(arr)
        with np.errstate(over="ignore"):  # f64 beyond the f32 range becomes ±inf, as a cast should
            return arr.astype(np.float32, copy=t.dtype != "f32")

    def tensors(self) -> dict[str, np.ndarray]:
        return {n: self.tensor(n) for n in self._infos}

    def verify(self) -> None:
        """Check every tensor's hash (and that alignment padding is zero); raises CheckpointError naming the
        file and the first bad tensor. Reads all tensor data, a chunk at a time."""
        for f in self._files:
            f.verify()

    def close(self) -> None:
        for f in self._files:
            f.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Checkpoint({os.fspath(self.path)!r}, {len(self)} tensors, {self.nbytes} bytes, {self.shard_count} file(s))"


def _open_set(first: _File, single_file: bool) -> list[_File]:
    """Given one validated file, the validated files of its whole set (itself alone when unsharded)."""
    s = first.header["shard"]
    if s is None or single_file:
        return [first]
    count = s["count"]
    m = _SHARD_RE.match(Path(first.path).name)
    if not m or int(m["count"]) != count or int(m["index"]) != s["index"] + 1:
        raise first.fail(
            f"is shard {s['index']} of {count} but its name does not follow 'stem-{s['index'] + 1:05d}-of-"
            f"{count:05d}.ddlw', so the other shards cannot be located"
        )
    base = Path(first.path).with_name(m["stem"] + (m["suffix"] or ""))
    files: list[_File] = []
    try:
        for i, p in enumerate(shard_paths(base, count)):
            f = first if p == Path(first.path) else _File(p)
            files.append(f)
            fs = f.header["shard"]
            if fs is None:
                raise f.fail(f"is not a shard, but belongs by name to a set of {count}")
            if fs["count"] != count or fs["index"] != i:
                raise f.fail(
                    f"header says shard {fs['index']} of {fs['count']}, expected shard {i} of {count}"
                )
            if fs["set_id"] != s["set_id"]:
                raise f.fail(f"set_id {fs['set_id']} differs from {s['set_id']} (shard of another save)")
            for k in ("config", "metadata", "provenance", "tokenizer"):
                if f.header[k] != first.header[k]:
                    raise f.fail(f"header {k!r} differs from that of {first.path}")
        seen: dict[str, str] = {}
        order: list[str] = []
        for f in files:
            for name in f.entries:
                if name in seen:
                    raise f.fail(f"tensor {name!r} is also in shard {seen[name]}")
                seen[name] = f.path
                order.append(name)
        listed = files[0].header["shard"]["names"]
        if listed != order:
            raise files[0].fail("the set's tensor list in shard 0 does not match the tensors of the shards")
    except BaseException:
        for f in files:
            if f is not first:
                f.close()
        raise
    return files


def open_checkpoint(path: str | os.PathLike, *, single_file: bool = False, verify: bool = True) -> Checkpoint:
    """Open a checkpoint lazily (header only) after validating it; see the module docstring for the checks.

    `path` may be a single file, any shard of a set (the whole set is opened and cross-checked), or
    `stem.ddlw` when only `stem-00001-of-N.ddlw`... exist. `single_file=True` opens just the given file,
    even if it is one shard of a set. `verify=True` checks each tensor's hash the first time it is read
    (about 2 s per GB on one slow core, 8-10 s for a 1 B-parameter f32 model; `verify=False` for trusted
    inputs). Every problem raises CheckpointError.
    """
    p = Path(path)
    if not p.exists():
        candidates = [c for c in _stale_set_files(p) if int(_SHARD_RE.match(c.name)["index"]) == 1]
        if len(candidates) > 1:
            raise CheckpointError(
                f"{os.fspath(path)}: several shard sets found ({', '.join(c.name for c in candidates)})"
            )
        if candidates:
            p = candidates[0]
    first = _File(p)
    try:
        files = _open_set(first, single_file)
    except BaseException:
        first.close()
        raise
    return Checkpoint(files, path, verify)
