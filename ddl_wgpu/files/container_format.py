"""The layout constants, dtypes, errors and small helpers shared by the `.ddlw` writer (`ddl_wgpu.files.container`)
and reader (`ddl_wgpu.files.container_read`); the format itself is described in `ddl_wgpu.files.container`."""

from __future__ import annotations

import hashlib
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

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
