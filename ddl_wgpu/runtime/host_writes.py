"""`HostWrites`: `Gpu.write(..., via_host=True)` through host memory the GPU copies from itself.

Dawn's `queue.write_buffer` moved 1.06 GB/s on the H100 against 19.5-20.0 for host buffers (`bench/upload.py`),
and a heal draft step uploads 10-31 MB of rows at the 27B. From MIN bytes on, where the device has host buffers
(`Gpu.host_buffer`: Dawn's host-mapped-pointer), a write goes up in pieces of at most PIECE bytes: each copied
into a host buffer that no pending copy reads, then copied by the GPU in a submit of its own, which the queue
runs before every later submit, as it would a `write_buffer`. The buffers held stay within POOL bytes; past it
the host waits for the oldest copy. A caller asks for it only where the queue is idle when it writes: with every
large write routed here, a streamed trunk's pass ran 0.749x resident against an earlier run's 0.864x (on
another machine both trees ran at 0.75x; docs/experiments.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MIN = 1 << 20
PIECE = 64 << 20
POOL = 1 << 30


@dataclass
class Slot:
    """One host buffer: its bytes, the COPY_SRC buffer on them, the submission of its last copy (None: none
    pending)."""

    host: np.ndarray
    buffer: object
    pending: int | None = None


class HostWrites:
    """A Gpu's pool of host buffers for `write(..., via_host=True)`."""

    def __init__(self, gpu):
        self.gpu = gpu
        self.slots: list[Slot] = []

    def applies(self, nbytes: int, offset: int) -> bool:
        """Whether a write of `nbytes` at byte `offset` goes this way: a device with host buffers, whole words,
        at least MIN bytes."""
        return self.gpu.host_buffers and nbytes >= MIN and nbytes % 4 == 0 and offset % 4 == 0

    def write(self, buf, data: np.ndarray, offset: int) -> None:
        """data (bytes, uint8) into `buf` at byte `offset`, piece by piece."""
        for lo in range(0, len(data), PIECE):
            piece = data[lo : lo + PIECE]
            slot = self._slot(len(piece))
            slot.host[: len(piece)] = piece
            enc = self.gpu.device.create_command_encoder()
            enc.copy_buffer_to_buffer(slot.buffer, 0, buf, offset + lo, len(piece))
            slot.pending = self.gpu.submit_indexed(enc.finish())

    def _free(self, slot: Slot) -> bool:
        return slot.pending is None or self.gpu.rt.done(self.gpu.device, slot.pending)

    def _slot(self, n: int) -> Slot:
        """A host buffer of at least n bytes that no pending copy reads: a free one, else a new one (sized to a
        power of two) while the pool stays within POOL, else the oldest one once its copy is done (free ones make
        way first)."""
        for slot in sorted(self.slots, key=lambda s: len(s.host)):
            if len(slot.host) >= n and self._free(slot):
                return slot
        size = max(MIN, 1 << (n - 1).bit_length())
        held = sum(len(s.host) for s in self.slots)
        while self.slots and held + size > POOL:
            oldest = min(self.slots, key=lambda s: -1 if s.pending is None else s.pending)
            if oldest.pending is not None:
                self.gpu.wait_for(oldest.pending)
                oldest.pending = None
            if len(oldest.host) >= n:
                return oldest
            self.slots = [s for s in self.slots if s is not oldest]
            held -= len(oldest.host)
        slot = Slot(*self.gpu.host_buffer(size, label=f"write_host{len(self.slots)}"))
        self.slots.append(slot)
        return slot
