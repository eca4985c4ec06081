"""Reading `.ddlw` checkpoints: every file is validated as the `ddl_wgpu.files.container` docstring lists, tensors are
read lazily and hashed the first time they are read."""

from __future__ import annotations

import mmap
import os
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from ddl_wgpu.files.container_format import (
    _CHUNK,
    _ENTRY_KEYS,
    _FLOAT_DTYPES,
    _HASH_RE,
    _HEADER_KEYS,
    _SHARD_RE,
    ALIGNMENT,
    CHECKSUM_BYTES,
    DTYPES,
    FORMAT_VERSION,
    HASH_HEX,
    MAGIC,
    MAX_DEPTH,
    MAX_HEADER_BYTES,
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
    header_checksum,
    shard_paths,
)
from ddl_wgpu.files.lazy import Lazy, rows_per_piece
from ddl_wgpu.files.safeio import open_regular

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
                # the pages hashed stay in the page cache, not in this process: a reader that maps a whole model
                # tensor by tensor keeps its resident memory at what it is using
                mm = getattr(arr, "_mmap", None)
                if mm is not None and hasattr(mmap, "MADV_DONTNEED"):
                    mm.madvise(mmap.MADV_DONTNEED)
        if t.dtype == "bool" and arr.size and arr.view(np.uint8).max() > 1:
            raise self.fail(f"tensor {t.name!r}: bool tensor holds bytes other than 0 and 1")
        return arr

    def pieces(self, t: TensorInfo, verify: bool) -> Iterator[np.ndarray]:
        """The tensor's rows, a piece of about PIECE_BYTES at a time, each read into a new array (nothing mapped,
        so the process holds one piece, not the tensor). With `verify`, the bytes are hashed as they are read and
        checked before the last piece is handed out: a consumer never finishes with bytes that differ from what
        was saved (a writer it feeds aborts on the error)."""
        self._check_unchanged()
        dt = DTYPES[t.dtype]
        verify = verify and t.name not in self._verified
        h = _hasher() if verify else None
        if not t.shape:
            pieces = [((), 0, t.nbytes)]
        else:
            step = rows_per_piece(t.shape, dt.itemsize)
            row = t.nbytes // t.shape[0] if t.shape[0] else 0
            pieces = [((min(step, t.shape[0] - r), *t.shape[1:]), r * row, min(step, t.shape[0] - r) * row)
                      for r in range(0, t.shape[0], step)]  # fmt: skip
        if not pieces:
            if verify:
                self._check_hash(t, h)
            return
        for i, (shape, start, n) in enumerate(pieces):
            arr = np.empty(shape, dt)
            got = self.read_into(
                self.data_start + t.offset + start, memoryview(arr.reshape(-1).view(np.uint8))
            )
            if got != n:
                raise self.fail(
                    f"tensor {t.name!r}: short read of {start + got} of {t.nbytes} bytes (file truncated?)"
                )
            if verify:
                h.update(memoryview(arr.reshape(-1).view(np.uint8)))
                if i == len(pieces) - 1:
                    self._check_hash(t, h)
            if t.dtype == "bool" and arr.size and arr.view(np.uint8).max() > 1:
                raise self.fail(f"tensor {t.name!r}: bool tensor holds bytes other than 0 and 1")
            yield arr

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

    def lazy(self, name: str) -> Lazy:
        """The tensor as stored, read piece by piece each time it is iterated (`ddl_wgpu.files.lazy`), hashed on the
        first complete read when the checkpoint was opened with verify=True."""
        t, f, verify = self._infos[name], self._file_of[name], self.verify_reads
        return Lazy(t.shape, t.dtype, lambda: f.pieces(t, verify))

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
