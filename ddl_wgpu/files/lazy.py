"""Tensors in pieces: what the file commands (`import-hf`, `export-hf`, `compress`) carry from their input to
their output, so that their memory is a few pieces of `PIECE_BYTES` whatever the model's size.

A `Lazy` is a tensor's shape, its container dtype (`container_format.DTYPES`: bf16 as uint16 bits) and a way to
produce its rows in order, a piece of whole rows at a time (a 1-D tensor's rows are its elements; a scalar is
one piece). Nothing is read until a consumer iterates `pieces()`, and each iteration reads again.

- sources: an array (`from_array`), a `.ddlw` tensor (`Checkpoint.lazy`, hashed as it is read), a safetensors
  tensor (`hf_files.SafetensorsFile.lazy`);
- transforms, piece by piece: a float conversion (`to`), a reshape within rows (`reshape`), a selection of rows
  (`take_rows`), any other row-wise change (`map`);
- consumers: the writers take a Lazy where they take an array (`container.Writer.write`,
  `hf_files.write_safetensors`); `array()` gathers the whole tensor for the library calls that want one.

`finite` wraps a Lazy so that each piece is checked as it passes (`refuse_non_finite`: a NaN or an infinity in a weight
is one `NonFiniteError` line naming the tensor): every reader of a model's weights for a job goes through it or
through `refuse_non_finite` (import-hf as it converts, `modelfile` as it reads, the GPU trunk as it uploads).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from ddl_wgpu.errors import UserError
from ddl_wgpu.files.container_format import _FROM_NUMPY, DTYPES, bf16_to_f32, f32_to_bf16

PIECE_BYTES = 4 << 20  # a piece of about 4 MiB: a few of them are a command's whole working set
FLOATS = ("f32", "f16", "bf16", "f64")


# the exponent bits of each float dtype (as its unsigned integer view): all set is an infinity or a NaN
_EXPONENT = {"f16": (np.uint16, 0x7C00), "bf16": (np.uint16, 0x7F80), "f32": (np.uint32, 0x7F800000),
             "f64": (np.uint64, 0x7FF0000000000000)}  # fmt: skip


class NonFiniteError(UserError):
    """A weight that is NaN or infinite: a model holding one computes NaN (generate emits one token forever,
    accept measures nonsense), so every job refuses it where it reads it, naming the tensor."""


def refuse_non_finite(piece: np.ndarray, dtype: str, name: str, where) -> np.ndarray:
    """`piece` (values of tensor `name` in container dtype `dtype`: bf16 as its uint16 bits) back unchanged,
    or NonFiniteError naming the tensor and `where` (the file or folder) when a value is NaN or infinite. One
    pass of integer masks over the piece (no float conversion): cheaper than the hash every read pays."""
    if dtype not in _EXPONENT or not piece.size:
        return piece
    bits, mask = _EXPONENT[dtype]
    flat = np.ascontiguousarray(piece).reshape(-1).view(bits)
    bad = np.flatnonzero((flat & bits(mask)) == mask)
    if bad.size:
        one = flat[bad[:1]]
        value = float((bf16_to_f32(one) if dtype == "bf16" else one.view(DTYPES[dtype]))[0])
        raise NonFiniteError(f"{where}: tensor {name} holds {value} (a weight that is not a finite number: every "
                             f"output of the model would be NaN); refused", kind="non_finite_weight")  # fmt: skip
    return piece


def finite(t: Lazy, name: str, where) -> Lazy:
    """`t` with every piece checked by `refuse_non_finite` as it passes (a non-float tensor as it is)."""
    if t.dtype not in _EXPONENT:
        return t
    dtype = t.dtype
    return t.map(lambda p: refuse_non_finite(p, dtype, name, where))


def rows_per_piece(shape: tuple[int, ...], itemsize: int) -> int:
    """How many rows (first-axis slices) make a piece of about PIECE_BYTES."""
    row = math.prod(shape[1:]) * itemsize
    return max(1, PIECE_BYTES // max(1, row))


@dataclass(frozen=True)
class Lazy:
    shape: tuple[int, ...]
    dtype: str  # one of container_format.DTYPES
    source: Callable[[], Iterator[np.ndarray]]  # a fresh iterator of pieces, each (k, *shape[1:]) in `dtype`

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPES[self.dtype].itemsize

    def pieces(self) -> Iterator[np.ndarray]:
        return self.source()

    def array(self) -> np.ndarray:
        """The whole tensor as one new array."""
        out = np.empty(self.shape, DTYPES[self.dtype])
        flat, pos = out.reshape(-1), 0
        for p in self.pieces():
            flat[pos : pos + p.size] = p.reshape(-1)
            pos += p.size
        if pos != out.size:
            raise ValueError(f"a lazy tensor of shape {self.shape} produced {pos} of {out.size} values")
        return out

    def map(self, fn: Callable[[np.ndarray], np.ndarray], shape: tuple[int, ...] | None = None,
            dtype: str | None = None) -> Lazy:  # fmt: skip
        """`fn` applied to every piece; it keeps the rows (a row of the input is a row of the output), so the
        output's first axis is the input's, unless `shape` says otherwise for a function that drops rows."""
        src = self.source
        return Lazy(tuple(shape or self.shape), dtype or self.dtype, lambda: (fn(p) for p in src()))

    def reshape(self, shape: tuple[int, ...]) -> Lazy:
        """The same values in `shape`, which must keep the first axis (e.g. (C, 1, k) <-> (C, k))."""
        shape = tuple(shape)
        if math.prod(shape) != self.numel or (shape[:1] != self.shape[:1] and self.numel):
            raise ValueError(f"cannot reshape {self.shape} to {shape} piece by piece")
        return self.map(lambda p: p.reshape((p.shape[0] if p.ndim else 1, *shape[1:])), shape)

    def to(self, dtype: str) -> Lazy:
        """The values converted to the float dtype `dtype` (`convert`); the same Lazy when it is already so."""
        if dtype == self.dtype:
            return self
        src = self.dtype
        return self.map(lambda p: convert(p, src, dtype), dtype=dtype)

    def take_rows(self, rows: np.ndarray) -> Lazy:
        """The rows `rows` (sorted, unique) of the tensor, in that order."""
        rows = np.asarray(rows, np.int64)
        if rows.size and (np.any(np.diff(rows) <= 0) or rows[0] < 0 or rows[-1] >= self.shape[0]):
            raise ValueError("take_rows needs sorted, unique rows inside the tensor")
        src = self.source

        def pieces():
            start = 0
            for p in src():
                lo, hi = np.searchsorted(rows, [start, start + p.shape[0]])
                if hi > lo:
                    yield p[rows[lo:hi] - start]
                start += p.shape[0]

        return Lazy((len(rows), *self.shape[1:]), self.dtype, pieces)


def from_array(a, dtype: str | None = None) -> Lazy:
    """An array as a Lazy (its rows are views, read when a piece is taken). `dtype` names the container dtype
    when the array's own does not say it (uint16 bits of a bf16 tensor)."""
    a = np.asarray(a)
    if dtype is None:
        native = a.dtype.newbyteorder("=") if a.dtype.byteorder not in "|=" else a.dtype
        if native not in _FROM_NUMPY:
            raise TypeError(f"numpy dtype {a.dtype} is not a container dtype")
        dtype = _FROM_NUMPY[native]
    want = DTYPES[dtype]
    if a.dtype.newbyteorder("=") != want.newbyteorder("="):
        raise TypeError(f"an array of {a.dtype} is not {dtype}")
    shape = tuple(a.shape)

    def pieces():
        if a.ndim == 0:
            yield np.ascontiguousarray(a, want)
            return
        step = rows_per_piece(shape, want.itemsize)
        for i in range(0, shape[0], step):
            yield np.ascontiguousarray(a[i : i + step], want)

    return Lazy(shape, dtype, pieces)


def convert(x: np.ndarray, src: str, dst: str) -> np.ndarray:
    """A piece of float values from `src` to `dst` (container names). To bf16: rounded to nearest even, and a
    NaN that bf16 holds exactly keeps its bits (so a bf16 value read and written back is the same bytes); any
    other NaN becomes a quiet NaN of its sign (`f32_to_bf16`). f64 beyond the f32 range becomes ±inf."""
    if src not in FLOATS or dst not in FLOATS:
        raise TypeError(f"cannot convert {src} to {dst} (float dtypes: {', '.join(FLOATS)})")
    if src == dst:
        return x
    f = bf16_to_f32(x) if src == "bf16" else x
    if dst == "bf16":
        f = np.ascontiguousarray(f, np.float32) if f.dtype != np.float32 else np.ascontiguousarray(f)
        out = f32_to_bf16(f)
        bits = f.view(np.uint32)
        exact = np.isnan(f) & ((bits & 0xFFFF) == 0)
        if exact.any():
            out[exact] = (bits[exact] >> 16).astype(np.uint16)
        return out
    with np.errstate(over="ignore"):
        return f.astype(DTYPES[dst])


class Progress:
    """A long write's progress line: the bytes of the tensors `wrap`ped as their pieces pass, said through `say`
    at most every `every` seconds, and not at all for a write smaller than `quiet` bytes (seconds of work)."""

    def __init__(self, what: str, tensors: Iterable[Lazy], say: Callable[[str], None] | None,
                 every: float = 10.0, quiet: int = 256 << 20):  # fmt: skip
        self.what, self.say, self.every = what, say, every
        self.total = sum(t.nbytes for t in tensors)
        self.done, self.start = 0, time.monotonic()
        self.last = self.start
        if self.total < quiet:
            self.say = None

    def wrap(self, t):
        """`t` counted as its pieces pass (an array, written whole, is not counted)."""
        return t.map(self._count) if self.say is not None and isinstance(t, Lazy) else t

    def _count(self, piece: np.ndarray) -> np.ndarray:
        self.done += piece.nbytes
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            self.say(f"{self.what}: {self.done / 1e9:.2f} of {self.total / 1e9:.2f} GB written "
                     f"({100 * self.done / self.total:.0f} %, {now - self.start:.0f} s)")  # fmt: skip
        return piece
