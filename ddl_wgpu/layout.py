"""Constants of the GPU parameter layout shared by `net.Net` (which lays the arenas out) and the engines
(which bind views of them): byte sizes, the binding alignment, and the names of the parameters the engines
address directly.
"""

from __future__ import annotations

ALIGN = 256  # WebGPU's default min-storage-buffer-offset-alignment; lavapipe needs 32, NVIDIA 32-256
F32 = 4
F16 = 2
EMBED = "model.embed_tokens.weight"
MTP_ENORM = "model.mtp.enorm.weight"
MTP_HNORM = "model.mtp.hnorm.weight"
MTP_EH = "model.mtp.eh_proj.weight"
MTP_NORM = "model.mtp.norm.weight"
MTP_BLOCK = "model.mtp.layers.0."


def align(n: int) -> int:
    """n bytes rounded up to a multiple of ALIGN."""
    return (n + ALIGN - 1) // ALIGN * ALIGN
