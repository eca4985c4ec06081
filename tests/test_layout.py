"""`ddl_wgpu.engine.layout.plan`, the GPU parameter layout as a pure function of the parameter table and the limits,
without a GPU: several arenas, f16 matrices, the trainable-first order of frozen_state=False, shared tensors,
a tensor too large for a buffer; and the row chunks and binding pieces of a tensor."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from helpers import tiny_cfg

from ddl_ref.config import MtpConfig
from ddl_ref.params import param_table
from ddl_wgpu.engine import layout
from ddl_wgpu.engine.layout import ALIGN, F16_SUFFIXES, LayoutError, Slot, plan


@dataclass(frozen=True)
class Spec:
    """What `plan` reads of a `ddl_ref.params.ParamSpec`."""

    name: str
    shape: tuple

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def spans(lay) -> dict[int, list[tuple[int, int]]]:
    """Per arena, the sorted (start, end) byte ranges of its own tensors, aligned ends."""
    out: dict[int, list] = {}
    for s in lay.slots.values():
        if s.arena < len(lay.arena_sizes):
            out.setdefault(s.arena, []).append((s.offset, s.offset + layout.align(s.nbytes)))
    return {a: sorted(r) for a, r in out.items()}


def test_one_arena_in_table_order_when_everything_fits():
    table = param_table(tiny_cfg())
    lay = plan(table, max_buffer=1 << 30)
    assert list(lay.slots) == [t.name for t in table] and {s.arena for s in lay.slots.values()} == {0}
    offsets = [lay.slots[t.name].offset for t in table]
    assert offsets[0] == 0 and offsets == sorted(offsets)
    assert lay.arena_sizes == [sum(layout.align(4 * t.numel) for t in table)]
    assert lay.state_sizes == lay.arena_sizes and lay.has_state == frozenset(lay.slots)


def test_a_new_arena_begins_where_the_next_tensor_would_not_fit():
    # 512 + 1280 bytes exceed the 1536-byte arena: b opens arena 1, c (256 bytes) still fits beside it
    table = [Spec("a", (100,)), Spec("b", (300,)), Spec("c", (50,)), Spec("d", (384,))]
    lay = plan(table, max_buffer=1 << 20, arena_bytes=1536 + 100)  # the limit is rounded down to ALIGN
    where = {n: (s.arena, s.offset) for n, s in lay.slots.items()}
    assert where == {"a": (0, 0), "b": (1, 0), "c": (1, 1280), "d": (2, 0)}
    assert lay.arena_sizes == [512, 1536, 1536] and lay.state_sizes == lay.arena_sizes


def test_several_arenas_hold_every_tensor_aligned_without_overlap():
    table = param_table(tiny_cfg(n_layers=3))
    limit = 8 * ALIGN
    lay = plan(table, max_buffer=1 << 30, arena_bytes=limit)
    assert len(lay.arena_sizes) > 3
    for a, ranges in spans(lay).items():
        assert all(start % ALIGN == 0 for start, _ in ranges)
        assert all(e0 <= s1 for (_, e0), (s1, _) in zip(ranges, ranges[1:], strict=False))  # no overlap
        big = len(ranges) == 1 and ranges[0][1] > limit  # a tensor larger than the limit has its own arena
        assert ranges[-1][1] == lay.arena_sizes[a] and (lay.arena_sizes[a] <= limit or big)
    assert sum(lay.arena_sizes) == sum(layout.align(4 * t.numel) for t in table)


def test_f16_stores_the_big_matrices_in_half_the_bytes():
    table = param_table(tiny_cfg())
    f32, f16 = plan(table, 1 << 30), plan(table, 1 << 30, dtype="f16")
    for t in table:
        s = f16.slots[t.name]
        big = len(t.shape) == 2 and t.name.endswith(F16_SUFFIXES)
        assert s.dtype == ("f16" if big else "f32") and s.nbytes == t.numel * (2 if big else 4)
    assert any(s.dtype == "f16" for s in f16.slots.values())
    assert f16.arena_sizes[0] < f32.arena_sizes[0]
    assert sum(f16.arena_sizes) == sum(layout.align(s.nbytes) for s in f16.slots.values())


def test_frozen_state_false_lays_the_trainable_tensors_first_and_stops_the_state_there():
    table = param_table(tiny_cfg(mtp=MtpConfig()))  # heal's case: the draft (last in the table) trains alone
    names = [t.name for t in table]
    trainable = [n for n in names if n.startswith("model.mtp.")]
    lay = plan(table, 1 << 30, arena_bytes=16 * ALIGN, trainable=trainable, frozen_state=False)
    order = list(lay.slots)
    assert order[: len(trainable)] == trainable  # table order within each group
    assert order[len(trainable) :] == [n for n in names if n not in trainable]
    assert lay.has_state == frozenset(trainable)
    last = max(trainable, key=lambda n: (lay.slots[n].arena, lay.slots[n].offset))
    s = lay.slots[last]
    assert lay.state_sizes[s.arena] == s.offset + layout.align(s.nbytes)
    assert len(lay.state_sizes) == len(lay.arena_sizes) > s.arena + 1
    assert all(n == ALIGN for n in lay.state_sizes[s.arena + 1 :])  # arenas with no trainable tensor
    # in one arena the state stops inside it, where the last trainable tensor ends
    one = plan(table, 1 << 30, trainable=trainable, frozen_state=False)
    s = one.slots[last]
    assert one.state_sizes == [s.offset + layout.align(s.nbytes)] and one.state_sizes[0] < one.arena_sizes[0]
    # frozen_state=True keeps table order and state for every tensor, whatever is trainable
    full = plan(table, 1 << 30, arena_bytes=16 * ALIGN, trainable=trainable)
    assert list(full.slots) == names and full.state_sizes == full.arena_sizes
    assert full.has_state == frozenset(names)


def test_shared_tensors_take_no_bytes_and_keep_the_owners_place():
    table = param_table(tiny_cfg())
    emb = next(t for t in table if t.name == layout.EMBED)
    owner = Slot(emb.name, tuple(emb.shape), 3, 7 * ALIGN, emb.numel, "f16")
    alone, lay = plan(table, 1 << 30), plan(table, 1 << 30, shared={emb.name: owner})
    assert lay.arena_sizes[0] == alone.arena_sizes[0] - layout.align(4 * emb.numel)
    assert lay.slots[emb.name] == Slot(
        emb.name, owner.shape, len(lay.arena_sizes), owner.offset, emb.numel, "f16"
    )
    assert list(lay.slots)[-1] == emb.name and emb.name not in lay.has_state
    assert layout.EMBED not in [n for a in spans(lay).values() for n in a]


def test_a_tensor_larger_than_a_buffer_is_refused_by_name():
    table = param_table(tiny_cfg())
    emb = next(t for t in table if t.name == layout.EMBED)
    with pytest.raises(
        LayoutError, match=rf"parameter {layout.EMBED} needs {4 * emb.numel} bytes.*max-buffer-size"
    ):
        plan(table, max_buffer=4 * emb.numel - ALIGN)
    # larger than an arena limit but within a buffer: its own arena
    lay = plan(table, max_buffer=1 << 30, arena_bytes=ALIGN)
    assert lay.arena_sizes[lay.slots[layout.EMBED].arena] == layout.align(4 * emb.numel)


def test_row_chunks_and_binding_pieces():
    s = Slot("w", (300, 32), 0, 0, 300 * 32)  # 128-byte rows
    assert layout.chunk_rows(s, 1 << 20) == 300  # fits one binding: one chunk
    assert layout.chunk_rows(s, 8192) == 64  # 64 rows fit: a multiple of 64
    odd = Slot("v", (100, 3), 0, 0, 300)  # 12-byte rows: 64 of them are 768 bytes, 256-aligned
    assert layout.chunk_rows(odd, 1000) == 64
    wide = Slot("u", (10, 1000), 0, 0, 10_000)  # 4000-byte rows: 16 rows keep views 256-aligned
    with pytest.raises(LayoutError, match="one aligned row chunk"):
        layout.chunk_rows(wide, 8192)
    assert layout.pieces(1, 512, 2000, 1000) == [(1, 512, 768), (1, 1280, 768), (1, 2048, 464)]
    assert layout.pieces(0, 0, 100, 1 << 20) == [(0, 0, 100)]
