"""Register tiles of the small products inside one workgroup, as generated straight-line WGSL.

A kernel that multiplies matrices staged in workgroup memory (the chunked gated delta rule's C x C and
C x D products) spreads each output over its threads: a `Tile` of `wy` x `wx` threads, thread (ty, tx)
owning the 4 x 4 blocks at row groups ty + wy*a (rows 4(ty + wy*a) .. + 3; with `contig`, the gm
consecutive groups ty*gm + a, so a thread's rows are one range: a product by a triangular matrix can skip
the steps where they meet only zeros) and column groups tx + wx*b. Its
accumulators are separate `vec4<f32>` variables of generated code (`acc_a_e_b`: row e of row group a,
the 4 columns of column group b), never a private array indexed at run time (which NVIDIA's compiler puts
in slow memory: docs/wgpu-notes.md#why-straight-line-wgsl).

Operands live in workgroup memory k-major and packed as vec4 along the output's rows (A) or columns (B),
like `shaders/matmul.wgsl`'s tiles: per k a thread loads gm vec4 of A (shared by the threads of its row,
broadcasts) and gn vec4 of B (neighbouring threads, neighbouring addresses) and does 16*gm*gn FMAs. An A
operand may also be read as scalars (`Scalar`: four loads per row group) where it is stored row-major.

The generated code expects `lid` (the local invocation index) in scope; `coords` declares the tile's thread
coordinates (`ty_<name>`, `tx_<name>`). Threads beyond wy*wx (a product smaller than the workgroup) repeat
the coordinates of others (so their loads stay in range) and must not store: `active` is their guard.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

XYZW = "xyzw"


@dataclass(frozen=True)
class Tile:
    name: str
    rows: int
    cols: int
    wy: int
    wx: int
    contig: bool = False

    @property
    def gm(self) -> int:
        """Row groups (of 4 rows) per thread."""
        return self.rows // (4 * self.wy)

    @property
    def gn(self) -> int:
        """Column groups (of 4 columns) per thread."""
        return self.cols // (4 * self.wx)

    @property
    def threads(self) -> int:
        return self.wy * self.wx

    def coords(self) -> str:
        n = self.name
        return f"let ty_{n} = (lid / {self.wx}u) % {self.wy}u;\n    let tx_{n} = lid % {self.wx}u;"

    def rowg(self, a: int) -> str:
        """The index of row group a (rows 4*rowg .. 4*rowg + 3)."""
        if self.contig:
            return f"(ty_{self.name} * {self.gm}u + {a}u)"
        return f"(ty_{self.name} + {a * self.wy}u)"

    def rows_range(self) -> tuple[str, str]:
        """The first and last row of a contiguous tile's thread."""
        assert self.contig or self.gm == 1, self
        lo = f"(ty_{self.name} * {4 * self.gm}u)"
        return lo, f"({lo} + {4 * self.gm - 1}u)"

    def row(self, a: int, e: int) -> str:
        return f"(4u * {self.rowg(a)} + {e}u)"

    def colg(self, b: int) -> str:
        """The index of column group b (columns 4*colg .. 4*colg + 3)."""
        return f"(tx_{self.name} + {b * self.wx}u)"

    def active(self) -> str:
        return f"(lid < {self.threads}u)"

    def blocks(self) -> list[tuple[int, int, int]]:
        """(a, e, b) of every accumulator: row e of row group a, column group b."""
        return [(a, e, b) for a in range(self.gm) for e in range(4) for b in range(self.gn)]


def tile(name: str, rows: int, cols: int, threads: int, wy: int | None = None, contig: bool = False) -> Tile:
    """The split of a rows x cols output (multiples of 4, powers of two) over at most `threads` threads (all
    of them when the output has that many 4 x 4 blocks): the grid whose per-thread block has twice as many
    rows as columns or else is closest to that (A's vec4 are broadcasts, B's are not), more threads along the
    columns on a tie. `wy` fixes the thread rows (tiles whose rows must line up with another's)."""
    r4, c4 = rows // 4, cols // 4
    if r4 * 4 != rows or c4 * 4 != cols or r4 < 1 or c4 < 1:
        raise ValueError(f"tile {name}: {rows} x {cols} is not made of 4 x 4 blocks")
    n = min(threads, r4 * c4)
    best = None
    wx = 1
    while wx <= c4:
        wy_ = n // wx if wy is None else wy
        if wy_ >= 1 and wy_ <= r4 and r4 % wy_ == 0 and c4 % wx == 0 and wy_ * wx <= threads:
            gm, gn = r4 // wy_, c4 // wx
            ratio = gm / (2 * gn)
            key = (-(wy_ * wx), max(ratio, 1 / ratio), -wx)
            if best is None or key < best[0]:
                best = (key, Tile(name, rows, cols, wy_, wx, contig))
        wx *= 2
    if best is None:
        raise ValueError(f"tile {name}: {rows} x {cols} does not split over {threads} threads (wy={wy})")
    return best[1]


def decl(t: Tile, acc: str) -> list[str]:
    return [f"var {acc}_{a}_{e}_{b} = vec4<f32>(0.0);" for a, e, b in t.blocks()]


def each(t: Tile, fn: Callable[[int, int, int, str], str]) -> list[str]:
    """fn(a, e, b, name) for every accumulator (`name` its variable name without the prefix's `acc_`)."""
    return [fn(a, e, b, f"{a}_{e}_{b}") for a, e, b in t.blocks()]


@dataclass(frozen=True)
class Scalar:
    """An A operand read as scalars: fn(row expression) -> f32 expression."""

    fn: Callable[[str], str]


def fma(
    t: Tile,
    terms: list[tuple[str, str, str]],
    a_ops: dict[str, Callable[[str], str] | Scalar],
    b_ops: dict[str, Callable[[str], str]],
) -> list[str]:
    """One k of the reduction for several accumulator sets: for each (acc, a_key, b_key) in `terms`,
    acc_a_e_b += A[a_key](row 4*rowg(a) + e) * B[b_key](columns of colg(b)). a_ops give the vec4 of a row group
    (fn(rowg expression)) or, wrapped in `Scalar`, one row's value; b_ops the vec4 of a column group. Each
    operand is loaded once (`let` temporaries), the block braced so the names can repeat."""
    used_a = list(dict.fromkeys(k for _, k, _ in terms))
    used_b = list(dict.fromkeys(k for _, _, k in terms))
    out = ["{"]
    for k in used_a:
        op = a_ops[k]
        for a in range(t.gm):
            if isinstance(op, Scalar):
                parts = ", ".join(op.fn(t.row(a, e)) for e in range(4))
                out.append(f"    let a{k}{a} = vec4<f32>({parts});")
            else:
                out.append(f"    let a{k}{a} = {op(t.rowg(a))};")
    out += [f"    let b{k}{b} = {b_ops[k](t.colg(b))};" for k in used_b for b in range(t.gn)]
    for acc, ka, kb in terms:
        out += [
            f"    {acc}_{a}_{e}_{b} = fma(vec4<f32>(a{ka}{a}.{XYZW[e]}), b{kb}{b}, {acc}_{a}_{e}_{b});"
            for a, e, b in t.blocks()
        ]
    out.append("}")
    return out


def indent(lines: list[str], n: int) -> str:
    pad = " " * n
    return ("\n" + pad).join(lines)
