"""The heal draft on the GPU (`WgpuDraft`): the MTP draft's block and final norm trained alone as a one-layer
model whose first block reads given input rows, against a teacher's top-k (top-k KL).
"""

from __future__ import annotations

import math

import numpy as np

from ddl_ref import mtp as ref_mtp
from ddl_ref.config import ModelConfig
from ddl_wgpu.engine import Work
from ddl_wgpu.gpu import Gpu
from ddl_wgpu.inference import pad_rows
from ddl_wgpu.net import Net
from ddl_wgpu.step import draft_adamw


class WgpuDraft:
    """The draft block + its final norm on the GPU, as a one-layer model (`ddl_ref.mtp.draft_config`) whose
    first block reads the given input rows; the shared embedding/head is loaded but frozen. Adam
    (`step.draft_adamw`) as `refnet.RefDraft`; a non-finite step leaves weights and moments untouched (the
    AdamW kernel's skip)."""

    def __init__(self, gpu: Gpu, params: dict, cfg: ModelConfig, init: dict | None = None, batch: int = 4):
        self.cfg, self.B = cfg, batch
        src = init if init is not None else params
        n = len(ref_mtp.MTP_LAYER_PREFIX)
        self.names = {}  # one-layer name -> model.mtp.* name
        for name in ref_mtp.trained_names(params):
            local = "model.norm.weight" if name == ref_mtp.NORM else "model.layers.0." + name[n:]
            self.names[local] = name
        dp = {local: np.asarray(src[name], np.float32) for local, name in self.names.items()}
        dp["model.embed_tokens.weight"] = params["model.embed_tokens.weight"]
        if not cfg.tie_embeddings:
            dp["lm_head.weight"] = params["lm_head.weight"]
        # the frozen embedding/head gets no gradient or moment storage (the input-rows Work never writes it)
        self.net = Net(gpu, ref_mtp.draft_config(cfg), dp, trainable=list(self.names), frozen_state=False)
        self._works: dict = {}

    def _work(self, T: int, k: int = 1, chain: int = 0):
        if (T, k, chain) not in self._works:
            self._works[(T, k, chain)] = Work(self.net, self.B, T, rows_in=True, kl_k=k, chain=chain)
        return self._works[(T, k, chain)]

    def _args(self, x_rows, teacher_ids, teacher_probs, weights, chain: int = 0):
        b = np.shape(x_rows)[0]
        x, tid, tp, w = (pad_rows(a, self.B) for a in (np.asarray(x_rows, np.float32), teacher_ids,
                                                         np.asarray(teacher_probs, np.float32),
                                                         np.asarray(weights, np.float32)))  # fmt: skip
        return b, self._work(x.shape[1], tid.shape[-1], chain), (x, tid, tp, w)

    def step(self, x_rows, teacher_ids, teacher_probs, weights, lr, step, grad_scale, chain: int = 0):
        """Forward, backward and (when finite) one Adam update -> (loss, grad_norm, finite). Gradients are
        float32, so `grad_scale` (the reference's loss scale) is never needed here."""
        _b, work, args = self._args(x_rows, teacher_ids, teacher_probs, weights, chain)
        r = work.step_rows(*args, update=draft_adamw(lr, step))
        return float(r.loss), float(r.grad_norm), bool(r.finite and math.isfinite(r.grad_norm))

    def grads(self) -> dict:
        """The last step's gradients of the trained tensors, by their model.mtp.* names (tests)."""
        g = self.net.grads()
        return {name: g[local] for local, name in self.names.items()}

    def loss_sum(self, x_rows, teacher_ids, teacher_probs, weights, chain: int = 0) -> float:
        _b, work, args = self._args(x_rows, teacher_ids, teacher_probs, weights, chain)
        return work.loss_sum_rows(*args)

    def hidden_out(self, x_rows, chain: int = 0):
        x = np.asarray(x_rows, np.float32)
        b = x.shape[0]
        pre, post = self._work(x.shape[1], 1, chain).forward_rows(pad_rows(x, self.B))
        return pre[:b], post[:b]

    def greedy(self, x_rows, chain: int = 0):
        """Forward only -> (argmax (b, T) int32, pre, post): one chained draft step (`accept`), any b; `chain`
        as in `hidden_out` (the stacked rows of steps 1..chain, every row's argmax and hiddens returned)."""
        x = np.asarray(x_rows, np.float32)
        work = self._work(x.shape[1], 1, chain)
        out = []
        for s in range(0, x.shape[0], self.B):
            part = x[s : s + self.B]
            ids, _p = work.topk(pad_rows(part, self.B), 1)
            pre, post = work.hidden()
            n = part.shape[0]
            out.append((ids[:n, :, 0], pre[:n], post[:n]))
        return tuple(np.concatenate(parts) for parts in zip(*out, strict=True))

    def snapshot(self):
        return self.net.snapshot()

    def restore(self, snap) -> None:
        self.net.restore(snap)

    def export(self) -> dict:
        p = self.net.export()
        return {name: p[local].copy() for local, name in self.names.items()}
