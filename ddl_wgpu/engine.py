"""The GPU engine's names in one place, for callers written before the engine was split by job.

The engine itself: `net.Net` (parameters, gradients, AdamW moments), `blocks.Blocks` (the shared transformer
blocks, forward and backward), `inference.InferenceWork` (forward-only: evaluation, logits, top-k),
`trunk.TrunkWork` (the training step, with the joint MTP draft), `draft.DraftWork` (heal's draft on input
rows) and `vocab` (embedding and LM head in row chunks). New code imports from those modules, and builds
backend objects through `backend`; `Work` here maps the old mode arguments onto the per-job classes.
"""

from __future__ import annotations

from ddl_wgpu.draft import DraftWork
from ddl_wgpu.layout import EMBED
from ddl_wgpu.net import Net
from ddl_wgpu.step import AdamW, StepResult
from ddl_wgpu.trunk import TrunkWork
from ddl_wgpu.vocab import head_chunk_rows

__all__ = ["EMBED", "AdamW", "Net", "StepResult", "Work", "head_chunk_rows"]


def Work(net, batch: int, seq: int, chunk_rows: int | None = None, rows_in: bool = False, kl_k: int = 0,
         chain: int = 0):  # fmt: skip
    """The work of the old single-class engine's modes: `DraftWork` for input rows, else the net's own."""
    if rows_in:
        return DraftWork(net, batch, seq, kl_k=kl_k, chain=chain, chunk_rows=chunk_rows)
    if chunk_rows is None:
        return net.work(batch, seq)
    return TrunkWork(net, batch, seq, chunk_rows)
