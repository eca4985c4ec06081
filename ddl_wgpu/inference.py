"""Forward-only work on the GPU: heal's frozen trunk (`WgpuTeacher`).

`WgpuTeacher` holds the trunk as an inference-only `Net` (parameters alone; "f16" stores the big matrices
in f16) and runs one forward per batch of windows: the next-token top-k from chunked logits and the hidden
rows before and after the final norm.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ddl_ref.config import ModelConfig
from ddl_wgpu.gpu import Gpu, GpuError
from ddl_wgpu.net import Net


def pad_rows(a, B: int):
    """a (b, ...) -> (B, ...) with zero rows appended (a Work has a fixed batch)."""
    a = np.asarray(a)
    if a.shape[0] == B:
        return a
    if a.shape[0] > B:
        raise GpuError(f"a batch of {a.shape[0]} windows, this GPU work was built for {B}")
    return np.concatenate([a, np.zeros((B - a.shape[0], *a.shape[1:]), a.dtype)])


class WgpuTeacher:
    """The trunk on the GPU: one forward per batch of windows, the next-token top-k from chunked logits, the
    hidden rows before and after the final norm downloaded as float32 (heal keeps the one the draft reads in
    float16). Frozen: the trunk is an inference-only Net (no gradients or optimizer state); `dtype` "f16"
    stores its big matrices in f16 (`net.F16_SUFFIXES`: about 2 bytes per parameter, so a 4 B-parameter trunk
    fits a 16 GB card), which needs the adapter feature shader-f16."""

    def __init__(self, gpu: Gpu, params: dict, cfg: ModelConfig, batch: int, dtype: str = "f32"):
        cfg = dataclasses.replace(cfg, mtp=None)  # the trunk alone
        trunk = {n: a for n, a in params.items() if not n.startswith("model.mtp.")}
        self.net = Net(gpu, cfg, trunk, inference=True, dtype=dtype)
        self.dtype = dtype
        self.B = batch

    def topk_hidden(self, ids_batch, k: int):
        ids = np.asarray(ids_batch)
        b, T = ids.shape
        work = self.net.work(self.B, T)
        top_ids, top_probs = work.topk(pad_rows(ids, self.B), k)
        pre, post = work.hidden()
        return top_ids[:b], top_probs[:b], pre[:b], post[:b]
