"""The GPU parameter layout: where every parameter of a model lives in `net.Net`'s flat arenas, as a pure
function of the parameter table and the adapter's limits (`plan`), plus the constants the engines share when
they bind views of the arenas (byte sizes, the binding alignment, the names they address directly).

`plan` lays the table out into arenas of at most `min(max_buffer, arena_bytes)` bytes, each tensor at a
256-byte-aligned offset (so any tensor can be bound as a sub-range on any adapter), a new arena begun where
the next tensor would not fit. One layout serves the four arena kinds (parameters, gradients, first and
second moments): a tensor has the same arena and offset in each. A tensor larger than a storage binding is
fine (it is bound in row chunks, `chunk_rows`); larger than a buffer is an error. With `frozen_state=False`
the trainable tensors come first, so the gradient and moment arenas (`state_sizes`) can stop where the last
trainable tensor ends. Shared tensors (read from another net's parameter arena) get no bytes here: their
slots keep the owner's offset, at arena indices after this net's own.

Nothing here touches a device: the tests lay out tables without a GPU (`tests/test_layout.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ALIGN = 256  # WebGPU's default min-storage-buffer-offset-alignment; lavapipe needs 32, NVIDIA 32-256
F32 = 4
F16 = 2
EMBED = "model.embed_tokens.weight"
MTP_ENORM = "model.mtp.enorm.weight"
MTP_HNORM = "model.mtp.hnorm.weight"
MTP_EH = "model.mtp.eh_proj.weight"
MTP_NORM = "model.mtp.norm.weight"
MTP_BLOCK = "model.mtp.layers.0."

# Names (by suffix) of the matrices an f16 inference Net stores as f16: the large 2-D ones. Everything else
# (1-D norm weights and biases, the DDL beta/v projections, compressor and conv weights) stays f32.
F16_SUFFIXES = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "model.embed_tokens.weight",
    "lm_head.weight",
    "model.mtp.eh_proj.weight",
    "linear_attn.in_proj_qkv.weight",
    "linear_attn.in_proj_z.weight",
    "linear_attn.in_proj_a.weight",
    "linear_attn.in_proj_b.weight",
    "linear_attn.out_proj.weight",
)


class LayoutError(ValueError):
    """A table that cannot be laid out within the limits (`net.Net` raises it as a `GpuError`)."""


def align(n: int) -> int:
    """n bytes rounded up to a multiple of ALIGN."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def is_f16_matrix(name: str, shape) -> bool:
    """Whether an f16 inference Net stores this parameter as f16 (`F16_SUFFIXES`, 2-D only)."""
    return len(shape) == 2 and name.endswith(F16_SUFFIXES)


@dataclass(frozen=True)
class Slot:
    """Where one parameter lives: arena index and byte range (the same in every arena kind)."""

    name: str
    shape: tuple
    arena: int
    offset: int
    numel: int
    dtype: str = "f32"

    @property
    def itemsize(self) -> int:
        return F16 if self.dtype == "f16" else F32

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def bind_bytes(self) -> int:
        """Bytes of a binding of the whole tensor: nbytes rounded up to 4 (WebGPU binding sizes)."""
        return -(-self.nbytes // 4) * 4


@dataclass(frozen=True)
class Layout:
    """`plan`'s result: every slot (own tensors in layout order, then the shared ones), the bytes of each
    parameter arena, of each gradient/moment arena (as many, each at least ALIGN: an arena without a
    trainable tensor keeps a minimal buffer, so arena indices stay the same), and the tensors that have
    gradient and moment storage."""

    slots: dict[str, Slot]
    arena_sizes: list[int]
    state_sizes: list[int]
    has_state: frozenset[str]


def plan(table, max_buffer: int, arena_bytes: int | None = None, dtype: str = "f32", trainable=(),
         frozen_state: bool = True, shared: dict[str, Slot] | None = None) -> Layout:  # fmt: skip
    """Lay out `table` (specs with `name`, `shape`, `numel`, as `ddl_ref.params.param_table` gives) in arenas
    of at most min(max_buffer, arena_bytes) bytes (module docstring). `dtype` "f16" stores the
    `F16_SUFFIXES` matrices as f16. `trainable`: the names with state when `frozen_state` is False (they lead
    the arenas). `shared` {name: the owner's Slot}: tensors held by another net, placed at arena indices
    len(arena_sizes), len(arena_sizes) + 1, ... in the order given, at the owner's offset and dtype."""
    shared = dict(shared or {})
    trainable = set(trainable)
    limit = min(max_buffer, arena_bytes or max_buffer) // ALIGN * ALIGN
    order = list(table)
    if not frozen_state:
        order = [t for t in order if t.name in trainable] + [t for t in order if t.name not in trainable]
    slots: dict[str, Slot] = {}
    sizes, state_sizes = [0], []
    for spec in order:
        if spec.name in shared:
            continue
        dt = "f16" if dtype == "f16" and is_f16_matrix(spec.name, spec.shape) else "f32"
        nbytes = spec.numel * (F16 if dt == "f16" else F32)
        if align(nbytes) > max_buffer:
            raise LayoutError(
                f"parameter {spec.name} needs {nbytes} bytes, more than this adapter's max-buffer-size "
                f"{max_buffer}: it cannot be held in one buffer"
            )
        if sizes[-1] + align(nbytes) > limit and sizes[-1] > 0:
            sizes.append(0)
        slots[spec.name] = Slot(spec.name, tuple(spec.shape), len(sizes) - 1, sizes[-1], spec.numel, dt)
        sizes[-1] += align(nbytes)
        if frozen_state or spec.name in trainable:
            state_sizes += [0] * (len(sizes) - len(state_sizes))
            state_sizes[-1] = sizes[-1]
    state_sizes = [max(ALIGN, n) for n in state_sizes + [0] * (len(sizes) - len(state_sizes))]
    has_state = frozenset(n for n in slots if frozen_state or n in trainable)
    for i, (name, s) in enumerate(shared.items()):
        slots[name] = Slot(name, s.shape, len(sizes) + i, s.offset, s.numel, s.dtype)
    return Layout(slots, sizes, state_sizes, has_state)


def chunk_rows(slot: Slot, max_binding: int) -> int:
    """Rows per chunk of a tensor bound in row chunks: its row count when it fits one binding, else the most
    rows whose view fits the binding limit, a multiple of 64 where 64 rows fit (then every chunk's first row
    is a multiple of 64: 256-byte aligned as a vocabulary offset into logits rows as well as a view), else a
    multiple of the rows that keep views 256-byte aligned."""
    rows = slot.shape[0] if slot.shape else 1
    if slot.nbytes <= max_binding:
        return rows
    row_bytes = slot.nbytes // rows
    fit = max_binding // row_bytes
    step = 64 if fit >= 64 and 64 * row_bytes % ALIGN == 0 else ALIGN // math.gcd(ALIGN, row_bytes)
    if fit < step:
        raise LayoutError(
            f"parameter {slot.name}: one aligned row chunk ({step} rows of {row_bytes} bytes) exceeds this "
            f"adapter's storage binding limit {max_binding}"
        )
    return fit // step * step


def pieces(arena: int, offset: int, nbytes: int, max_binding: int) -> list[tuple[int, int, int]]:
    """A byte range of an arena as 256-aligned pieces [(arena, offset, nbytes)], each within the binding
    limit."""
    cap = max_binding // ALIGN * ALIGN
    return [(arena, offset + o, min(cap, nbytes - o)) for o in range(0, nbytes, cap)]
