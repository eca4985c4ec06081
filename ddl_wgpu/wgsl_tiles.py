"""Register tiles of the small products inside one workgroup, as generated straight-line WGSL.

A kernel that multiplies small matrices held in workgroup memory (the chunked gated delta rule's C x C and
C x D products) spreads each output over its threads: a `Tile` of `wy` x `wx` threads, thread (ty, tx)
owning the `tm` x `tn` elements at rows ty + wy*a and columns tx + wx*b. Its accumulators are separate
variables (`acc_a_b`) of generated code, never a private array indexed at run time (which NVIDIA's compiler
puts in slow memory: docs/wgpu-notes.md#why-straight-line-wgsl). The strided ownership makes the threads of
a warp read consecutive addresses of the column operand and few distinct ones (broadcasts) of the row
operand, so workgroup-memory reads have no bank conflicts when a row operand's rows are padded to an odd
stride.

The generated code expects `lid` (the local invocation index) in scope; `coords` declares the tile's thread
coordinates (`ty_<name>`, `tx_<name>`). Threads beyond wy*wx (a product smaller than the workgroup) repeat
the coordinates of others and must not store: `active` is their guard.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Tile:
    name: str
    rows: int
    cols: int
    wy: int
    wx: int

    @property
    def tm(self) -> int:
        return self.rows // self.wy

    @property
    def tn(self) -> int:
        return self.cols // self.wx

    @property
    def threads(self) -> int:
        return self.wy * self.wx

    def coords(self) -> str:
        n = self.name
        return f"let ty_{n} = (lid / {self.wx}u) % {self.wy}u;\n    let tx_{n} = lid % {self.wx}u;"

    def row(self, a: int) -> str:
        return f"(ty_{self.name} + {a * self.wy}u)"

    def col(self, b: int) -> str:
        return f"(tx_{self.name} + {b * self.wx}u)"

    def active(self) -> str:
        return f"(lid < {self.threads}u)"

    def pairs(self) -> list[tuple[int, int]]:
        return [(a, b) for a in range(self.tm) for b in range(self.tn)]


def tile(name: str, rows: int, cols: int, threads: int) -> Tile:
    """The split of a rows x cols output (powers of two) over `threads`: the thread grid whose per-thread
    block is closest to square (fewest operand loads per FMA), more threads along the columns on a tie."""
    if rows * cols <= threads:
        return Tile(name, rows, cols, rows, cols)
    best = None
    wx = 1
    while wx <= min(cols, threads):
        wy = threads // wx
        if wy <= rows and rows % wy == 0 and cols % wx == 0 and wy * wx == threads:
            tm, tn = rows // wy, cols // wx
            key = (max(tm, tn) / min(tm, tn), -wx)
            if best is None or key < best[0]:
                best = (key, Tile(name, rows, cols, wy, wx))
        wx *= 2
    if best is None:
        raise ValueError(f"tile {name}: {rows} x {cols} does not split over {threads} threads")
    return best[1]


def decl(t: Tile, acc: str, init: str = "0.0") -> list[str]:
    return [f"var {acc}_{a}_{b} = {init};" for a, b in t.pairs()]


def each(t: Tile, fn: Callable[[int, int, str, str], str]) -> list[str]:
    """fn(a, b, row, col) for every element the thread owns."""
    return [fn(a, b, t.row(a), t.col(b)) for a, b in t.pairs()]


def rows(t: Tile, fn: Callable[[int, str], str]) -> list[str]:
    return [fn(a, t.row(a)) for a in range(t.tm)]


def cols(t: Tile, fn: Callable[[int, str], str]) -> list[str]:
    return [fn(b, t.col(b)) for b in range(t.tn)]


def fma(
    t: Tile,
    terms: list[tuple[str, str, str]],
    a_ops: dict[str, Callable[[str], str]],
    b_ops: dict[str, Callable[[str], str]],
) -> list[str]:
    """One step of the reduction for several accumulator sets: for each (acc, a_key, b_key) in `terms`,
    acc_a_b += A[a_key](row a) * B[b_key](col b). Each operand is loaded once per step (`let` temporaries),
    the block braced so the names can repeat."""
    used_a = list(dict.fromkeys(k for _, k, _ in terms))
    used_b = list(dict.fromkeys(k for _, _, k in terms))
    out = ["{"]
    out += [f"    let a{k}{a} = {a_ops[k](t.row(a))};" for k in used_a for a in range(t.tm)]
    out += [f"    let b{k}{b} = {b_ops[k](t.col(b))};" for k in used_b for b in range(t.tn)]
    for acc, ka, kb in terms:
        out += [f"    {acc}_{a}_{b} = fma(a{ka}{a}, b{kb}{b}, {acc}_{a}_{b});" for a, b in t.pairs()]
    out.append("}")
    return out


def indent(lines: list[str], n: int) -> str:
    pad = " " * n
    return ("\n" + pad).join(lines)
