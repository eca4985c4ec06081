"""The files of a Hugging Face model folder: safetensors files (read and written here, untrusted), the sharded
index, config.json and tokenizer.json, for `ddl_wgpu.files.hf.convert`.

Safetensors files are read by parsing the header here (8-byte little-endian length + JSON) and memory-mapping
each tensor's byte range, which treats bf16, f16 and f32 alike (bf16 is not a numpy dtype) and never reads a
whole shard to get one tensor. The tensors' data_offsets must tile the data section exactly (no overlap, hole
or trailing bytes), as the format requires. Every file is treated as untrusted (JSON through
`safeio.load_json`, only regular files opened); every bad input raises one `HfError`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from ddl_wgpu.files.container_format import DTYPES
from ddl_wgpu.files.lazy import Lazy, from_array, rows_per_piece
from ddl_wgpu.files.safeio import load_json, open_regular, read_regular

__all__ = ["MAX_JSON_FILE", "MAX_TOKENIZER", "OURS_OF", "ST_ITEMSIZE", "ST_OF", "HfError", "SafetensorsFile", "StTensor",
           "Weights", "encode", "read_json", "write_bytes", "write_safetensors"]  # fmt: skip


class HfError(ValueError):
    """A Hugging Face folder or export request that cannot be handled; the message says which file and why."""


# ------------------------------------------------------------------------------------------ safetensors

_ST_DTYPES = {"F32": "f32", "F16": "f16", "BF16": "bf16"}  # the float dtypes parameters are read from
ST_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "U16": 2, "U32": 4, "U64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}  # fmt: skip
_MAX_HEADER = 100 * 1024 * 1024
MAX_JSON_FILE = 64 * 1024 * 1024  # config.json and the index are KBs; refuse absurd ones before reading
MAX_TOKENIZER = 32 * 1024 * 1024  # it travels in the container header, which is capped at 64 MiB


def read_json(path: Path) -> Any:
    return load_json(read_regular(path, "a JSON file", HfError, MAX_JSON_FILE), str(path), HfError)


def _nonneg_ints(xs: Any) -> bool:
    return isinstance(xs, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in xs)


class _StInfo:
    __slots__ = ("dtype", "shape", "start", "end")

    def __init__(self, dtype: str, shape: tuple[int, ...], start: int, end: int):
        self.dtype, self.shape, self.start, self.end = dtype, shape, start, end


class SafetensorsFile:
    """One .safetensors file: header parsed and checked on open, tensors memory-mapped on request."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            with open_regular(self.path, "a safetensors file", HfError) as f:
                size = os.fstat(f.fileno()).st_size
                head = f.read(8)
                if len(head) < 8:
                    raise HfError(f"{self.path}: too short for a safetensors file ({size} bytes)")
                n = int.from_bytes(head, "little")
                if n < 2 or n > _MAX_HEADER or 8 + n > size:
                    raise HfError(f"{self.path}: bad safetensors header length {n} (file is {size} bytes)")
                raw = f.read(n)
        except OSError as e:
            raise HfError(f"{self.path}: cannot read: {e.strerror or e}") from None
        header = load_json(raw, f"{self.path}: safetensors header", HfError)
        if not isinstance(header, dict):
            raise HfError(f"{self.path}: safetensors header must be a JSON object")
        self.data_start = 8 + n
        data_len = size - self.data_start
        self.metadata = header.pop("__metadata__", None) or {}
        self.tensors: dict[str, _StInfo] = {}
        for name, t in header.items():
            self.tensors[name] = self._check_entry(name, t, data_len)
        self._check_layout(data_len)

    def _check_layout(self, data_len: int) -> None:
        """Every byte of the data section belongs to exactly one tensor, as the safetensors format requires:
        an overlap would let one tensor read another's bytes, a hole or trailing bytes hide data."""
        end, prev = 0, None
        for name, t in sorted(self.tensors.items(), key=lambda kv: (kv[1].start, kv[1].end)):
            if t.start < end:
                raise HfError(f"{self.path}: tensor {name!r} data_offsets [{t.start}, {t.end}) overlap tensor "
                              f"{prev!r}, which ends at {end}")  # fmt: skip
            if t.start > end:
                after = f"after tensor {prev!r}" if prev else "at the start of the data section"
                raise HfError(f"{self.path}: tensor {name!r} starts at {t.start}, leaving a hole of "
                              f"{t.start - end} bytes {after}")  # fmt: skip
            end, prev = t.end, name
        if end != data_len:
            raise HfError(f"{self.path}: {data_len - end} bytes after the last tensor's data (the data "
                          f"section is {data_len} bytes, the tensors cover {end})")  # fmt: skip

    def _check_entry(self, name: str, t: Any, data_len: int) -> _StInfo:
        bad = f"{self.path}: tensor {name!r}"
        if not isinstance(t, dict) or not {"dtype", "shape", "data_offsets"} <= set(t):
            raise HfError(f"{bad}: header entry needs dtype, shape and data_offsets")
        dtype, shape, offs = t["dtype"], t["shape"], t["data_offsets"]
        if not isinstance(dtype, str) or not _nonneg_ints(shape) or not _nonneg_ints(offs) or len(offs) != 2:
            raise HfError(f"{bad}: malformed header entry {t!r:.120}")
        start, end = offs
        if not start <= end <= data_len:
            raise HfError(f"{bad}: data_offsets {offs} outside the data section ({data_len} bytes)")
        if dtype in ST_ITEMSIZE and math.prod(shape) * ST_ITEMSIZE[dtype] != end - start:
            raise HfError(f"{bad}: {dtype}{shape} needs {math.prod(shape) * ST_ITEMSIZE[dtype]} bytes, "
                          f"data_offsets span {end - start}")  # fmt: skip
        return _StInfo(dtype, tuple(shape), start, end)

    def names(self) -> list[str]:
        return list(self.tensors)

    def lazy(self, name: str) -> Lazy:
        """A float tensor (F32, F16, BF16) as stored, read piece by piece when iterated (`ddl_wgpu.files.lazy`)."""
        t = self.tensors[name]
        if t.dtype not in _ST_DTYPES:
            raise HfError(f"{self.path}: tensor {name!r} has unsupported dtype {t.dtype}; "
                          f"supported: {sorted(_ST_DTYPES)}")  # fmt: skip
        return self._lazy(name, t.shape, _ST_DTYPES[t.dtype])

    def lazy_raw(self, name: str) -> Lazy:
        """The tensor's stored bytes (u8, 1-D), whatever its dtype (a tensor kept byte for byte)."""
        t = self.tensors[name]
        if t.dtype not in ST_ITEMSIZE:  # its size is unknown, so its bytes cannot be told from a hole
            raise HfError(
                f"{self.path}: tensor {name!r} has unknown dtype {t.dtype}; known: {sorted(ST_ITEMSIZE)}"
            )
        return self._lazy(name, (t.end - t.start,), "u8")

    def _lazy(self, name: str, shape: tuple[int, ...], dtype: str) -> Lazy:
        t, path, start = self.tensors[name], self.path, self.data_start + self.tensors[name].start
        dt = DTYPES[dtype]

        def pieces():
            if t.end == t.start:  # nothing to read (an empty tensor)
                if shape and shape[0]:
                    yield np.zeros(shape, dt)
                return
            step = rows_per_piece(shape, dt.itemsize) if shape else 1
            row = (t.end - t.start) // shape[0] if shape else t.end - t.start
            with open_regular(path, "a safetensors file", HfError) as f:
                for r in range(0, shape[0] if shape else 1, step):
                    k = min(step, shape[0] - r) if shape else 1
                    arr = np.empty((k, *shape[1:]) if shape else (), dt)
                    mv = memoryview(arr.reshape(-1).view(np.uint8))
                    try:
                        f.seek(start + r * row)
                        got = f.readinto(mv) or 0
                        while got < len(mv) and (n := f.readinto(mv[got:])):
                            got += n
                    except OSError as e:
                        raise HfError(f"{path}: cannot read tensor {name!r}: {e.strerror or e}") from None
                    if got != len(mv):
                        raise HfError(
                            f"{path}: tensor {name!r} is cut short (the file changed since it was opened?)"
                        )
                    yield arr

        return Lazy(tuple(shape), dtype, pieces)


class StTensor(NamedTuple):
    """One tensor to write: its safetensors dtype and shape, and its stored bytes: an array or a `Lazy` whose
    bytes, in C order, are exactly prod(shape) * itemsize (raw uint8, uint16 bf16 bits, or the little-endian
    values)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray | Lazy


ST_OF = {"f32": "F32", "f16": "F16", "bf16": "BF16", "f64": "F64"}  # container float dtype -> safetensors
OURS_OF = {v: k for k, v in ST_OF.items()}


def encode(t: Lazy, dtype: str) -> Lazy:
    """A float tensor stored as safetensors `dtype` (F32, F16, BF16 or F64), rounded to nearest, ties to even
    (`lazy.convert`: a bf16 value read and written back is the same bytes)."""
    if dtype not in OURS_OF:
        raise HfError(f"cannot write a float tensor as {dtype} (F32, F16, BF16 or F64)")
    return t.to(OURS_OF[dtype])


def _entry(t) -> StTensor:
    if isinstance(t, StTensor):
        return t
    name, a = t  # (name, array or Lazy): float32, as every export before the Qwen3.5 layouts
    a = encode(a if isinstance(a, Lazy) else from_array(np.asarray(a, np.float32)), "F32")
    return StTensor(name, "F32", a.shape, a)


def write_safetensors(
    path: Path, tensors: Iterable[StTensor | tuple[str, np.ndarray]], metadata: dict[str, str]
) -> int:
    """Write one safetensors file, streaming tensor by tensor (into the export's fresh folder, which is renamed
    into place as a whole): `StTensor`s as given, (name, array) pairs as F32. -> the data section's size."""
    items = [_entry(t) for t in tensors]
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    off = 0
    for t in items:
        n = math.prod(t.shape) * ST_ITEMSIZE[t.dtype]
        if t.data.nbytes != n:
            raise ValueError(
                f"tensor {t.name!r}: {t.data.nbytes} bytes for {t.dtype}{list(t.shape)} ({n} needed)"
            )
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [off, off + n]}
        off += n
    hb = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hb += b" " * (-len(hb) % 8)  # the data section starts 8-byte aligned

    def write(f):
        f.write(len(hb).to_bytes(8, "little"))
        f.write(hb)
        for t in items:
            pieces = t.data.pieces() if isinstance(t.data, Lazy) else [t.data]
            for p in pieces:
                f.write(memoryview(np.ascontiguousarray(p).reshape(-1)).cast("B"))

    write_file(path, write)
    return off


def write_file(path: Path, write) -> None:
    """`write(f)` into a new file `path`, then fsync it."""
    with open(path, "xb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def write_bytes(path: Path, data: bytes) -> None:
    write_file(path, lambda f: f.write(data))


# ------------------------------------------------------------------------------------------------ folder


class Weights:
    """Tensor name -> the safetensors file holding it, for a single-file or sharded folder."""

    def __init__(self, folder: Path):
        single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
        self.where: dict[str, SafetensorsFile] = {}
        self.files: list[SafetensorsFile] = []
        if single.exists():
            f = SafetensorsFile(single)
            self.files = [f]
            self.where = dict.fromkeys(f.names(), f)
            return
        if not index.exists():
            found = sorted(p.name for p in folder.glob("*.safetensors"))
            raise HfError(f"{folder}: no model.safetensors or model.safetensors.index.json"
                          + (f" (found {found[:4]})" if found else ""))  # fmt: skip
        idx = read_json(index)
        wm = idx.get("weight_map") if isinstance(idx, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            raise HfError(f"{index}: needs a 'weight_map' object of tensor name -> shard file name")
        opened: dict[str, SafetensorsFile] = {}
        for shard in sorted(set(wm.values())):
            if Path(shard).name != shard or shard in ("", ".", ".."):
                raise HfError(f"{index}: shard name {shard!r} is not a plain file name in the folder")
            p = folder / shard
            if not p.exists():
                users = [n for n, s in wm.items() if s == shard]
                raise HfError(f"{index}: shard {shard} is missing from {folder} (it holds {users[0]!r}"
                              + (f" and {len(users) - 1} more)" if len(users) > 1 else ")"))  # fmt: skip
            opened[shard] = SafetensorsFile(p)
        for name, shard in wm.items():
            if name not in opened[shard].tensors:
                raise HfError(f"{index}: maps {name!r} to {shard}, which has no such tensor")
            self.where[name] = opened[shard]
        self.files = list(opened.values())

    def names(self) -> list[str]:
        return list(self.where)

    def dtype(self, name: str) -> str:
        return self.where[name].tensors[name].dtype

    def shape(self, name: str) -> tuple[int, ...]:
        return self.where[name].tensors[name].shape

    def lazy(self, name: str) -> Lazy:
        return self.where[name].lazy(name)

    def lazy_raw(self, name: str) -> Lazy:
        return self.where[name].lazy_raw(name)

    def read_raw(self, name: str) -> np.ndarray:
        """The tensor's stored bytes as a new uint8 array."""
        return self.lazy_raw(name).array()

    def total_bytes(self) -> int:
        """The tensor bytes of every file the folder's weights are read from."""
        return sum(max((t.end for t in f.tensors.values()), default=0) for f in self.files)

    def data_bytes(self) -> int:
        """The largest shard's tensor bytes (an export shards at about this size)."""
        return max((max((t.end for t in f.tensors.values()), default=0) for f in self.files), default=0)
