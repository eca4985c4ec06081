"""The trunk's training on the GPU: `TrunkWork`, a training step of the token model in one submit.

A step (`TrunkWork.step`) is: per-step host data written with `queue.write_buffer` (ids, targets, weights,
the embedding's buckets, the loss scale), then ONE command encoder holding zero-grads, the forward
(`inference.InferenceWork.forward_calls`), the LM head with its cross-entropy and backward in row chunks, the
backward of the model (`backward_calls`, the forward's ops in reverse), and optionally the global gradient
norm, clipping and AdamW; one submit; one small read-back (loss sum, gradient norm, clip multiplier, finite
flag). Nothing reads the GPU inside a step. The reference `ddl_ref.model` is the specification and the tests
compare every loss, logit and gradient with it.

Joint MTP draft (`cfg.mtp` set, `train --mtp`), DeepSeek-V3 style. After the trunk the step records the draft
(`_mtp_forward_calls`): the embedding of the shifted ids x_{p+1}, `enorm` and `hnorm` (of the trunk's pre- or
post-final-norm hidden, `MtpConfig.trunk_hidden`), their concatenation (a row gather), `eh_proj`, one
baseline block with the draft's names, `model.mtp.norm`, and the chunked head + cross-entropy on the targets
x_{p+2} (loss scale mtp_weight / count2). Its backward runs first and its input gradient joins the trunk's
hidden, embedding and head, so the trunk learns from the draft's loss too. `Net.mtp_weight` is read at every
step; the result carries the combined loss and both parts.
"""

from __future__ import annotations

import math

import numpy as np

from ddl_ref import mtp as ref_mtp
from ddl_wgpu.engine.inference import EMBED_EXPAND, InferenceWork
from ddl_wgpu.engine.layout import ALIGN, F32, MTP_BLOCK, MTP_EH, MTP_ENORM, MTP_HNORM, MTP_NORM
from ddl_wgpu.engine.step import AdamW, StepResult
from ddl_wgpu.ops import crossentropy as k_ce
from ddl_wgpu.ops import elementwise as k_ew
from ddl_wgpu.ops import embedding as k_emb
from ddl_wgpu.ops import reduce as k_red
from ddl_wgpu.ops import shortconv as k_sc
from ddl_wgpu.runtime.gpu import Call, GpuError


class TrunkWork(InferenceWork):
    """The token model's training step for one (batch, seq) shape (and everything `InferenceWork` does),
    with the joint MTP draft when the model has one."""

    def __init__(self, net, batch: int, seq: int, chunk_rows: int | None = None):
        if net.inference:
            raise GpuError("an inference-only Net has no training steps: its work is an InferenceWork")
        super().__init__(net, batch, seq, chunk_rows)
        self.init_backward_scratch()
        self.mtp = self.cfg.mtp
        self._head_train = self.head_calls(self.xf, self._cross_entropy(self._trunk_loss()), self.dxf, True)
        if self.mtp is not None:
            self._init_mtp()
            self._fwd_mtp = self._mtp_forward_calls()
            mtp_loss = self._cross_entropy(self._mtp_loss())
            self._head_mtp = self.head_calls(self.m["post"], mtp_loss, self.m["dxf"], True)
            self._sum_mtp = k_red.sum_rows(self.gpu, self.loss_acc, self.m["row_loss"], self.N, index=1)
            self._bwd = self._mtp_backward_calls() + self.backward_calls()
        else:
            self._bwd = self.backward_calls()

    def _trunk_loss(self) -> dict:
        return {
            "row_loss": self.row_loss,
            "targets": self.targets,
            "weights": self.weights,
            "scale": self.scale,
        }

    def _cross_entropy(self, src: dict):
        """The training cross-entropy of one chunk of logits (loss per row, gradient in place)."""

        def loss(logits, n: int, r0: int) -> Call:
            return k_ce.cross_entropy(self.gpu, src["row_loss"], logits, src["targets"], src["weights"], n,
                                      self.cfg.vocab_size, src["scale"], row_offset=r0)  # fmt: skip

        return loss

    # -- the backward: the forward's ops in reverse -----------------------------------------------------

    def backward_calls(self) -> Call:
        """final norm -> (the joint draft's gradient joins) -> readout -> blocks -> embedding (through EC or
        the repetition when d_v > 1)."""
        d_last = self.dx if not self.ddl else (self.dS[0] if self.dv == 1 else self.dxin)
        call = self.final_norm_backward(d_last)
        if self.mtp is not None:  # the draft read the trunk's hidden: its gradient joins here
            dhid = self.m["dhid"]
            if self.mtp.trunk_hidden == "post_norm":
                call = k_ew.add_inplace(self.gpu, self.dxf, dhid, self.N * self.C) + call
            else:
                call += k_ew.add_inplace(self.gpu, d_last, dhid, self.N * self.C)
        c, dcur = self.blocks_backward(d_last)
        return call + c + self.embed_backward(dcur)

    def embed_backward(self, dx0) -> Call:
        """The reverse of `embed_forward`: dE from d(x0)."""
        cfg, C, dv = self.cfg, self.C, self.dv
        if dv == 1:
            return self.vocab.embed_backward(dx0, self.order, self.starts)
        demb = self.dxin
        if cfg.ddl_expand_embed:
            conv, dconv = self.net.view(EMBED_EXPAND), self.net.view(EMBED_EXPAND, "g")
            call = k_sc.ec_backward(self.gpu, demb, dconv, dx0, self.emb, conv, self.B, self.T, C, dv,
                                    cfg.ddl_conv_kernel)  # fmt: skip
        else:
            call = k_sc.repeat_backward(self.gpu, demb, dx0, self.N, C, dv)
        return call + self.vocab.embed_backward(demb, self.order, self.starts)

    # -- the step ---------------------------------------------------------------------------------------

    def step(self, ids, lengths=None, update: AdamW | None = None) -> StepResult:
        """Forward + backward (gradients overwritten, not accumulated), and with `update` the global
        gradient norm, clipping and AdamW, all in one encoder and one submit. With a draft (`cfg.mtp`) the
        loss is loss_main + net.mtp_weight · loss_mtp, and both parts are in the result."""
        # mixed precision: the backward runs on the gradient of S * loss (both losses' scales times S), the
        # optimizer's clip unscales it (`Net.optimizer_call`); the loss sums read back are unscaled
        scale = update.loss_scale if update is not None else 1.0
        count = self.upload_ids(ids, lengths, scale)
        self._upload_buckets(np.asarray(ids).astype(np.uint32), self.order, self.starts)
        if self.mtp is not None:
            self._upload_mtp(ids, lengths, scale)
        return self._run(count, update)

    def _run(self, count: int, update: AdamW | None) -> StepResult:
        """Record and submit one step over the uploaded batch; read its scalars."""
        rec = self.gpu.recorder()
        self.net.zero_grads_call().record(rec)
        self._fwd.record(rec)
        self._head_train.record(rec)
        self._sum.record(rec)
        if self.mtp is not None:
            self._fwd_mtp.record(rec)
            self._head_mtp.record(rec)
            self._sum_mtp.record(rec)
        self._bwd.record(rec)
        if update is not None:
            self.net.optimizer_call(update).record(rec)
        out = self.finish(rec, update is not None, self.mtp is not None)
        loss = float(out[0]) / max(count, 1)
        extra = {}
        if self.mtp is not None:
            loss_mtp = float(out[4]) / self.count_mtp if self.count_mtp else 0.0
            extra = {"loss_main": loss, "loss_mtp": loss_mtp}
            loss = loss + self.net.mtp_weight * loss_mtp
        finite = bool(np.isfinite(loss)) and (update is None or out[3] != 0)
        norm = float(out[1]) if update is not None else math.nan
        return StepResult(loss=loss, count=count, grad_norm=norm, finite=finite, **extra)

    def _upload_buckets(self, ids32: np.ndarray, order, starts) -> None:
        """The embedding backward's buckets of `ids32` (rows grouped by token, deterministic sums)."""
        o, s = k_emb.embedding_buckets(ids32.reshape(-1), self.cfg.vocab_size)
        self.gpu.write(order, o.astype(np.uint32))
        self.gpu.write(starts, s.astype(np.uint32))

    # -- the joint MTP draft ----------------------------------------------------------------------------

    def _init_mtp(self):
        """Buffers of the draft: its per-step inputs, the block input's pieces, its block, its head."""
        gpu, N, C, V, act = self.gpu, self.N, self.C, self.cfg.vocab_size, self.act
        width = ref_mtp.draft_ffn_hidden(self.cfg)
        if width != self.cfg.ffn_hidden:  # the joint draft block is sized as a trunk block (`block_acts`)
            raise GpuError(f"joint MTP training needs the draft's SwiGLU width ({width}) to equal the trunk's "
                           f"({self.cfg.ffn_hidden}); `heal` retrains a draft of its own width")  # fmt: skip
        u32 = lambda n, label: gpu.buffer(n * 4, label=label)  # noqa: E731
        # [enorm(e); hnorm(h)] is built as a row gather from one table holding enorm(e) in rows [0, N) and
        # hnorm(h) in rows [N2, N2 + N), N2 >= N chosen so both halves bind at 256-byte-aligned offsets.
        step = ALIGN // math.gcd(ALIGN, C * F32)
        self.N2 = N2 = -(-N // step) * step
        m = {
            "ids": u32(N, "mtp_ids"),
            "targets": u32(N, "mtp_targets"),
            "weights": act(N, "mtp_weights"),
            "scale": act(4, "mtp_loss_scale"),
            "order": u32(N, "mtp_emb_order"),
            "starts": u32(V + 1, "mtp_emb_starts"),
            "e": act(N * C, "mtp_embedding"),
            "eh": act((N2 + N) * C, "mtp_eh_normed"),
            "re": act(N, "mtp_rstd_e"),
            "rh": act(N, "mtp_rstd_h"),
            "cat": act(N * 2 * C, "mtp_cat"),
            "pre": act(N * C, "mtp_pre"),
            "post": act(N * C, "mtp_post"),
            "rf": act(N, "mtp_rstd_final"),
            "row_loss": act(N, "mtp_row_loss"),
            "dx": act(N * C, "mtp_dx"),
            "dxf": act(N * C, "mtp_dxf"),
            "dcat": act(N * 2 * C, "mtp_dcat"),
            "deh": act((N2 + N) * C, "mtp_deh"),
            "de": act(N * C, "mtp_de"),
            "dhid": act(N * C, "mtp_dhidden"),
        }
        first, second = (0, N2) if self.mtp.concat == "emb_first" else (N2, 0)
        p = np.arange(N, dtype=np.uint32)
        cat_idx = np.stack([p + first, p + second], axis=1).reshape(-1)  # cat row 2p <- table row ...
        inv = np.full(N2 + N, 0xFFFFFFFF, np.uint32)  # padding rows gather zeros
        inv[cat_idx] = np.arange(2 * N, dtype=np.uint32)
        m["cat_idx"] = gpu.upload(cat_idx.astype(np.uint32), "mtp_cat_idx")
        m["inv_idx"] = gpu.upload(inv, "mtp_cat_inv")
        m["en"] = (m["eh"], 0, N * C * F32)
        m["hn"] = (m["eh"], N2 * C * F32, N * C * F32)
        m["den"] = (m["deh"], 0, N * C * F32)
        m["dhn"] = (m["deh"], N2 * C * F32, N * C * F32)
        self.m = m
        self.M = self.block_acts("mtp", N * C)  # the draft block's saved activations

    def _mtp_loss(self) -> dict:
        m = self.m
        return {
            "row_loss": m["row_loss"],
            "targets": m["targets"],
            "weights": m["weights"],
            "scale": m["scale"],
        }

    def _mtp_hidden(self):
        return self.xL if self.mtp.trunk_hidden == "pre_norm" else self.xf

    def _mtp_forward_calls(self) -> Call:
        """The draft after the trunk: x = eh_proj·[enorm(E[x_{p+1}]); hnorm(h_p)] -> block -> mtp.norm."""
        g, N, C, m = self.gpu, self.N, self.C, self.m
        call = self.vocab.embed_forward(m["e"], m["ids"], N)
        call += self._norm(m["en"], m["re"], m["e"], MTP_ENORM)
        call += self._norm(m["hn"], m["rh"], self._mtp_hidden(), MTP_HNORM)
        call += k_emb.embedding_forward(g, m["cat"], m["cat_idx"], m["eh"], 2 * N, C)  # the concat, (2N, C)
        call += self._linear(self.M["x"], m["cat"], MTP_EH, C, 2 * C)
        call += self.block_forward(self.M, m["pre"], MTP_BLOCK, ddl=False)
        return call + self._norm(m["post"], m["rf"], m["pre"], MTP_NORM)

    def _mtp_backward_calls(self) -> Call:
        """The reverse of `_mtp_forward_calls`; ends with d(trunk hidden) in m["dhid"] and the embedding's
        gradient accumulated (the trunk's backward adds m["dhid"] where the draft read the hidden)."""
        g, N, C, m = self.gpu, self.N, self.C, self.m
        call = self._norm_backward(m["dx"], m["dxf"], m["pre"], MTP_NORM, m["rf"])
        c, dx = self.block_backward(self.M, m["dx"], MTP_BLOCK, ddl=False)
        call += c
        call += self._linear_backward(m["dcat"], dx, m["cat"], MTP_EH, C, 2 * C)
        call += k_emb.embedding_forward(g, m["deh"], m["inv_idx"], m["dcat"], self.N2 + N, C)  # un-concat
        call += self._norm_backward(m["de"], m["den"], m["e"], MTP_ENORM, m["re"])
        call += self._norm_backward(m["dhid"], m["dhn"], self._mtp_hidden(), MTP_HNORM, m["rh"])
        return call + self.vocab.embed_backward(m["de"], m["order"], m["starts"])

    def _upload_mtp(self, ids, lengths, loss_scale: float = 1.0) -> None:
        """The draft's inputs: row p reads x_{p+1} and predicts x_{p+2}; loss scale mtp_weight / count2 (times
        mixed precision's power-of-two `loss_scale`, exact in f32)."""
        ids32 = np.asarray(ids).astype(np.uint32)
        lengths = np.full(self.B, self.T) if lengths is None else np.asarray(lengths)
        pos = np.arange(self.T)[None, :]
        tok = np.zeros_like(ids32)
        tok[:, :-1] = ids32[:, 1:]
        tgt = np.zeros_like(ids32)
        tgt[:, :-2] = ids32[:, 2:]
        valid2 = pos < np.minimum(lengths[:, None] - 2, self.T - 2)
        self.count_mtp = count2 = int(valid2.sum())
        g, m = self.gpu, self.m
        g.write(m["ids"], tok.reshape(-1))
        g.write(m["targets"], tgt.reshape(-1))
        g.write(m["weights"], valid2.astype(np.float32).reshape(-1))
        scale = self.net.mtp_weight / count2 if count2 else 0.0
        g.write(m["scale"], np.array([scale], np.float32) * np.float32(loss_scale))
        self._upload_buckets(tok, m["order"], m["starts"])
