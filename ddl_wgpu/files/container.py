"""The ddl-wgpu checkpoint container (``.ddlw``): one file format for models, training checkpoints and
healed outputs.

Layout (all integers little-endian; docs/container.md; modelled on safetensors and GGUF)::

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

Writing streams tensor by tensor into a file of the writer's own, ``.NAME.<pid>.<random>.partial``
(`safeio.create_exclusive`: created exclusively, never through a link, so two writers of one output never
share a file): the table (and so the header length) follows from names, dtypes and shapes alone, and hashes
are fixed-length strings, so the data is written and hashed in one pass and the header goes in at the end.
Then fsync and a rename (`safeio.commit`); on any exception the partial files are removed and whatever was at
the final name is left untouched. Inside ``keep_existing(path)`` (a command without --force) the rename never
replaces a file: when another writer put one at the final name meanwhile, that file stays and this writer
fails with one line. An ``OSError`` while writing (disk full, read-only folder, ...) becomes a one-line
:class:`CheckpointError` saying so.

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

This module is the public face and the writer; the reader lives in ``ddl_wgpu.files.container_read`` and what both
share (constants, dtypes, errors, hashing, shard names) in ``ddl_wgpu.files.container_format``.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import os
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from ddl_wgpu.files.container_format import (
    _FROM_NUMPY,
    ALIGNMENT,
    CHECKSUM_BYTES,
    DTYPES,
    FORMAT_VERSION,
    HASH_HEX,
    MAGIC,
    MAX_DEPTH,
    MAX_NDIM,
    PREAMBLE,
    READABLE_VERSIONS,
    CheckpointError,
    TensorInfo,
    _byte_chunks,
    _hasher,
    _stale_set_files,
    align_up,
    bf16_to_f32,
    f32_to_bf16,
    header_checksum,
    shard_paths,
)
from ddl_wgpu.files.container_read import Checkpoint, open_checkpoint
from ddl_wgpu.files.lazy import Lazy
from ddl_wgpu.files.safeio import AppearedError, commit, create_exclusive

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


# The outputs (absolute paths) a writer must not replace: a command asked to write a new file only
# (`keep_existing`)
_KEEP: contextvars.ContextVar[frozenset] = contextvars.ContextVar("ddlw_keep_existing", default=frozenset())


@contextlib.contextmanager
def keep_existing(path: str | os.PathLike):
    """Inside the block, a Writer of `path` never replaces what stands at its final names: the first writer's
    rename wins, and a later one fails with one line (its file removed), instead of writing over a file that
    appeared after the command checked that none was there."""
    token = _KEEP.set(_KEEP.get() | {os.path.abspath(path)})
    try:
        yield
    finally:
        _KEEP.reset(token)


class _Part:
    """One output file (the whole checkpoint, or one shard) while it is being written."""

    def __init__(self, final: Path, names: list[str], table: dict[str, dict], data_bytes: int):
        self.final = final
        self.partial: Path | None = None  # the writer's own file, made when the first byte goes out
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
        fd, self.partial = create_exclusive(self.final)
        self.file = os.fdopen(fd, "wb")  # closed in finish()/abort()
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
        if self.partial is not None:
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
        "bf16" is rounded to bf16, a uint16 array is taken as raw bf16 bits. A `Lazy` (ddl_wgpu.files.lazy) of the
        declared dtype and shape is written piece by piece, never whole."""
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
        if isinstance(array, Lazy):
            if array.dtype != decl_dtype:
                raise ValueError(
                    f"tensor {name!r}: dtype {array.dtype!r} differs from the declared {decl_dtype!r}"
                )
            shape = array.shape
        else:
            array, _ = _as_storable(name, array, decl_dtype)
            shape = array.shape
        if shape != decl_shape:
            raise ValueError(f"tensor {name!r}: shape {shape} differs from the declared {decl_shape}")
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
            pieces = array.pieces() if isinstance(array, Lazy) else [array]
            for chunk in (c for p in pieces for c in _byte_chunks(p)):
                h.update(chunk)
                f.write(chunk)
        except OSError as e:
            self.abort()
            raise _write_error(part.final, e) from None
        except BaseException:  # a bad piece of a Lazy (its source's error): nothing is left half written
            self.abort()
            raise
        if f.tell() != part.data_start + entry["offset"] + nb:
            self.abort()
            raise ValueError(f"tensor {name!r}: {f.tell() - part.data_start - entry['offset']} bytes written, "
                             f"{nb} declared")  # fmt: skip
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
            replace = os.path.abspath(self.path) not in _KEEP.get()
            for k, part in enumerate(self._parts):
                try:
                    commit(part.partial, part.final, replace)
                except AppearedError:
                    for done in self._parts[:k]:  # this writer's shards already in place: not a set alone
                        with contextlib.suppress(OSError):
                            os.unlink(done.final)
                    raise
        except AppearedError as e:
            self.abort()
            raise CheckpointError(
                f"{e.filename}: another run wrote it while this one was writing; that file is left as it is "
                "and nothing of this run was written"
            ) from None
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
    (name, array, dtype) — e.g. ("w", uint16_bits, "bf16"). Arrays may be numpy memmaps or `Lazy` tensors
    (`ddl_wgpu.files.lazy`, in their own dtype); they are written and hashed chunk by chunk, never concatenated.
    Tensors keep the given order.

    Returns the written paths: `[path]`, or the shard files when `shard_bytes` forced a split (then `path`
    itself is not created; `open_checkpoint(path)` finds the set). A previous checkpoint at `path` is
    replaced only once the new one is complete.
    """
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    prepared: list[tuple[str, np.ndarray | Lazy, str]] = []
    for item in items:
        if not isinstance(item, tuple) or len(item) not in (2, 3):
            raise TypeError(f"tensors must yield (name, array) or (name, array, dtype), got {item!r:.80}")
        name = item[0]
        if not isinstance(name, str) or not name:
            raise ValueError(f"tensor name must be a non-empty str, got {name!r}")
        if isinstance(item[1], Lazy):
            if len(item) == 3 and item[2] != item[1].dtype:
                raise ValueError(
                    f"tensor {name!r}: dtype {item[2]!r} differs from its Lazy's {item[1].dtype!r}"
                )
            prepared.append((name, item[1], item[1].dtype))
            continue
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
        for i in range(len(prepared)):
            w.write(*prepared[i])
            prepared[i] = (
                None  # let a memory-mapped source go once written (else a model's worth of pages stay)
            )
    return w.paths
