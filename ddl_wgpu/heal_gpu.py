"""heal's and accept's GPU backend objects (`backend.Teacher`, `backend.Draft`; their numpy twins are
`refnet.RefTeacher` and `refnet.RefDraft`): the frozen trunk as an inference-only `Net` (`WgpuTeacher`, over
`inference.InferenceWork`) and the draft trained alone (`WgpuDraft`, over `draft.DraftWork`).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ddl_ref import mtp as ref_mtp
from ddl_ref.blocks import head_name
from ddl_ref.config import ModelConfig
from ddl_wgpu.draft import DraftWork
from ddl_wgpu.gpu import Gpu, GpuError
from ddl_wgpu.net import Net
from ddl_wgpu.step import draft_adamw


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


class WgpuDraft:
    """The draft block + its final norm on the GPU, as a one-layer model (`ddl_ref.mtp.draft_config`) whose
    first block reads the given input rows; the shared embedding/head is loaded but frozen. Adam
    (`step.draft_adamw`) and the top-k KL's form (`kl_form`) as `refnet.RefDraft`; a non-finite step leaves
    weights and moments untouched (the AdamW kernel's skip)."""

    def __init__(self, gpu: Gpu, params: dict, cfg: ModelConfig, init: dict | None = None, batch: int = 4,
                 kl_form: str = "full"):  # fmt: skip
        self.cfg, self.B, self.kl_form = cfg, batch, kl_form
        src = init if init is not None else params
        n = len(ref_mtp.MTP_LAYER_PREFIX)
        self.names = {}  # one-layer name -> model.mtp.* name
        for name in ref_mtp.trained_names(params):
            local = "model.norm.weight" if name == ref_mtp.NORM else "model.layers.0." + name[n:]
            self.names[local] = name
        dp = {local: np.asarray(src[name], np.float32) for local, name in self.names.items()}
        for name in ("model.embed_tokens.weight", head_name(cfg)):  # the head is the embedding when tied
            dp[name] = params[name]
        # the frozen embedding/head gets no gradient or moment storage (the draft work never writes it)
        self.net = Net(gpu, ref_mtp.draft_config(cfg), dp, trainable=list(self.names), frozen_state=False)
        self._works: dict = {}

    def _work(self, T: int, k: int = 1, chain: int = 0) -> DraftWork:
        if (T, k, chain) not in self._works:
            self._works[(T, k, chain)] = DraftWork(
                self.net, self.B, T, kl_k=k, chain=chain, kl_form=self.kl_form
            )
        return self._works[(T, k, chain)]

    def _args(self, x_rows, teacher_ids, teacher_probs, weights, chain: int = 0):
        x, tid, tp, w = (pad_rows(a, self.B) for a in (np.asarray(x_rows, np.float32), teacher_ids,
                                                         np.asarray(teacher_probs, np.float32),
                                                         np.asarray(weights, np.float32)))  # fmt: skip
        return self._work(x.shape[1], tid.shape[-1], chain), (x, tid, tp, w)

    def step(self, x_rows, teacher_ids, teacher_probs, weights, lr, step, grad_scale, chain: int = 0):
        """Forward, backward and (when finite) one Adam update -> (loss, grad_norm, finite). Gradients are
        float32, so `grad_scale` (the reference's loss scale) is never needed here."""
        work, args = self._args(x_rows, teacher_ids, teacher_probs, weights, chain)
        r = work.step_rows(*args, update=draft_adamw(lr, step))
        return float(r.loss), float(r.grad_norm), bool(r.finite and math.isfinite(r.grad_norm))

    def grads(self) -> dict:
        """The last step's gradients of the trained tensors, by their model.mtp.* names (tests)."""
        g = self.net.grads()
        return {name: g[local] for local, name in self.names.items()}

    def loss_sum(self, x_rows, teacher_ids, teacher_probs, weights, chain: int = 0) -> float:
        work, args = self._args(x_rows, teacher_ids, teacher_probs, weights, chain)
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
