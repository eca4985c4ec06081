"""The GPU engine: `Work`, the activations of one (batch, seq) shape with every launch prepared once, and the
model's forward and backward over a `Net` (`ddl_wgpu/net.py`: parameters, gradients and AdamW moments resident
on the GPU; re-exported here).

A training step (`Work.step`) is: per-step host data written with `queue.write_buffer` (ids, targets,
weights, the embedding's buckets, the loss scale), then ONE command encoder holding zero-grads, the
forward, the backward, and optionally the global gradient norm, clipping and AdamW; one submit; one small
read-back (loss sum, gradient norm, clip multiplier, finite flag). Nothing reads the GPU inside a step.

The model's forward (`_forward_calls`) and backward (`_backward_calls`) sit next to each other and mirror
each other op for op, like `ddl_ref.model`; the reference is the specification and the tests compare
every loss, logit and gradient with it.

MTP draft (`cfg.mtp` set): joint training, DeepSeek-V3 style. After the trunk, `Work` records the draft:
the embedding of the shifted ids x_{p+1}, `enorm` and `hnorm` (of the trunk's pre- or post-final-norm
hidden, `MtpConfig.trunk_hidden`), their concatenation (a row gather), `eh_proj`, one baseline block through
the same `_block_forward` with the draft's names, `model.mtp.norm`, and the chunked head + cross-entropy on
the targets x_{p+2} (loss scale mtp_weight / count2). Its backward runs first and its input gradient joins
the trunk's hidden, embedding and head, so the trunk learns from the draft's loss too (`ddl_ref.model`).
`Net.mtp_weight` is read at every step; `Work.step` returns the combined loss and both parts.

Input-rows mode (`Work(..., rows_in=True, kl_k=k)`, for healing a draft alone as a one-layer model): the
first block reads uploaded rows instead of the embedding, the loss is the top-k KL to a teacher's top-k
(`ops.topk_kl`, chunked like the cross-entropy), and nothing flows into the embedding. With `chain=j` the
seq rows are the stacked rows of chain steps 1..j of one window (row (σ−1)·W + p, seq = j·W): attention uses
the runtime's diagonal mask (`ops.attention.attention_masked_*`, `ddl_ref.ops.chain_mask`) and RoPE the
positions p + σ − 1 (per-row tables); the caller weights the rows of steps < j with 0 (mtp-heal.md §6.2).

Inference nets (`Net(..., inference=True, dtype="f32"|"f16")`, the heal teacher's frozen trunk): only the
parameter arenas exist (no gradients, no moments: 4 or ~2 bytes per parameter instead of 16); `step`, the
optimizer and gradient views raise GpuError, and their `Work` builds no backward (forward, loss_sum, logits,
hidden, topk, spectral only). With dtype="f16" the large 2-D matrices (`F16_SUFFIXES`: attention q/k/v/o,
MLP gate/up/down, the embedding, an untied LM head and the MTP draft's eh_proj) are stored as f16 and read by
the f16-B matmul / f16 embedding gather (converted to f32 on load, f32 accumulation); every 1-D tensor
(norms, biases) and the small DDL/compressor/conv weights stay f32. f16 needs the adapter's shader-f16.
"""

from __future__ import annotations

import math

import numpy as np

from ddl_ref import ops as ref_ops
from ddl_wgpu.gpu import Call, GpuError
from ddl_wgpu.layout import ALIGN, EMBED, F32, MTP_BLOCK, MTP_EH, MTP_ENORM, MTP_HNORM, MTP_NORM
from ddl_wgpu.layout import align as _align
from ddl_wgpu.net import Net
from ddl_wgpu.ops import attention as k_attn
from ddl_wgpu.ops import crossentropy as k_ce
from ddl_wgpu.ops import delta as k_delta
from ddl_wgpu.ops import elementwise as k_ew
from ddl_wgpu.ops import embedding as k_emb
from ddl_wgpu.ops import matmul as k_mm
from ddl_wgpu.ops import reduce as k_red
from ddl_wgpu.ops import rmsnorm as k_norm
from ddl_wgpu.ops import rope as k_rope
from ddl_wgpu.ops import shortconv as k_sc
from ddl_wgpu.ops import swiglu as k_swiglu
from ddl_wgpu.ops import topk_kl as k_topk
from ddl_wgpu.step import AdamW, StepResult


def head_chunk_rows(gpu, N: int, C: int, V: int) -> int:
    """Rows per chunk of the LM head over N rows (full logits never exist). Chunks are multiples of 64 rows
    (64·C·4 bytes keeps every chunk's view offset 256-aligned), bounded to 512 MiB of logits (half the binding
    limit on small adapters) and of equal height (no short last chunk of thin products). Tall chunks matter:
    the head's dx product has K = V, and a 320-row chunk gave the H200 only 15 workgroups (3.9 TFLOP/s,
    BENCHMARKS.md). Where 64 rows of logits do not fit the budget (lowered test limits), the smallest row
    count that keeps views aligned."""
    budget = min(512 << 20, gpu.max_binding // 2)
    fit = budget // (V * F32)
    step = 64 if fit >= 64 else ALIGN // math.gcd(ALIGN, C * F32)
    rows = max(step, fit // step * step)
    if rows < N:
        chunks = -(-N // rows)
        per = -(-N // chunks)
        rows = -(-per // step) * step
    return min(N, rows)


class Work:
    """Activations and scratch for one (batch, seq) shape; every Call built once here, recorded per step.

    Shapes are fixed: a different (B, T) is an error, not a silent reallocation (style.md rule 4).

    The residual stream is (N, C) for the baseline and DDL d_v = 1, and the DDL state (N, C, dv) for the
    expanded variants (N = B·T rows). Names of saved activations follow `ddl_ref.model`'s caches.
    """

    def __init__(
        self,
        net: Net,
        batch: int,
        seq: int,
        chunk_rows: int | None = None,
        rows_in: bool = False,
        kl_k: int = 0,
        chain: int = 0,
    ):
        cfg = net.cfg
        if chain and (not rows_in or chain < 1 or seq % chain):
            raise GpuError(f"chain={chain} needs input-rows mode and {seq} rows of whole chain windows")
        self.chain = int(chain)
        if (seq // chain if chain else seq) > cfg.max_seq_len:
            raise GpuError(f"sequence length {seq} exceeds the model's max_seq_len {cfg.max_seq_len}")
        if rows_in and (cfg.residual != "add" or kl_k < 1 or cfg.mtp is not None):
            raise GpuError(
                "input-rows mode needs a baseline model without a draft and a top-k width kl_k >= 1"
            )
        self.net, self.gpu, self.cfg = net, net.gpu, cfg
        self.rows_in, self.kl_k = rows_in, int(kl_k)
        self._chunk_rows = chunk_rows
        self.inference = net.inference  # forward only: no backward scratch, no backward Calls, no draft
        self.mtp = cfg.mtp if not (rows_in or self.inference) else None
        self.B, self.T = batch, seq
        self.N = N = batch * seq  # rows (tokens)
        C, D, V = cfg.d_model, cfg.head_dim, cfg.vocab_size
        self.ddl = cfg.residual == "delta"
        self.dv = dv = cfg.ddl_dv if self.ddl else 1
        S = N * C * dv  # floats in one stream/state
        gpu = self.gpu
        buf = gpu.buffer

        def act(n, label):
            return buf(n * F32, label=label)

        # per-step inputs
        self.ids = buf(N * 4, label="ids")
        self.targets = buf(N * 4, label="targets")
        self.weights = act(N, "weights")
        self.real = act(N, "real_tokens")  # 1 where t < length (spectral diagnostics)
        self.scale = act(4, "loss_scale")
        self.order = buf(N * 4, label="emb_order")
        self.starts = buf((V + 1) * 4, label="emb_starts")
        if chain:  # stacked chain steps: row (σ−1)·W + p sits at position p + σ − 1
            cos, sin = ref_ops.rope_tables_at(ref_ops.chain_positions(chain, seq // chain), D, cfg.rope_theta,
                                              np.float64)  # fmt: skip
        else:
            cos, sin = ref_ops.rope_tables(seq, D, cfg.rope_theta, np.float64)
        self.cos = gpu.upload(cos.astype(np.float32), "rope_cos")
        self.sin = gpu.upload(sin.astype(np.float32), "rope_sin")
        self.emb = act(N * C, "embedding_out") if dv > 1 else None  # e, kept for the EC backward
        # saved activations, per layer; the block output is the next block's "x" (or self.xS)
        self.L = []
        for i in range(cfg.n_layers):
            a = self._block_acts(act, str(i), S)
            if self.ddl:
                stats = k_delta.stats_size(dv)
                for sub in ("attn", "mlp"):
                    a["u_" + sub] = act(N * C, f"u_{sub}{i}")  # sublayer output: only its direction is used
                    a["st_" + sub] = act(N * stats, f"stats_{sub}{i}")
                    # x_in: the compressed readout (d_v > 1); d_v = 1 reads the stream itself
                    a["xin_" + sub] = (
                        act(N * C, f"xin_{sub}{i}") if dv > 1 else a["x" if sub == "attn" else "xm"]
                    )
            self.L.append(a)
        self._init_rest(act, S)

    def _block_acts(self, act, tag: str, S: int) -> dict:
        """Saved activations of one block (`x` is the block input: stream or DDL state of S floats)."""
        cfg, N, C, B, T = self.cfg, self.N, self.cfg.d_model, self.B, self.T
        H, K, D, F = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_hidden
        i = tag
        a = {
            "x": act(S, f"x{i}"),  # block input: stream or DDL state
            "h": act(N * C, f"h{i}"),
            "r1": act(N, f"rstd1_{i}"),
            "q": act(N * H * D, f"q{i}"),
            "k": act(N * K * D, f"k{i}"),
            "v": act(N * K * D, f"v{i}"),
            "a": act(N * H * D, f"att{i}"),
            "lse": act(B * H * T, f"lse{i}"),
            "xm": act(S, f"xm{i}"),  # stream/state after the attention sublayer
            "h2": act(N * C, f"h2{i}"),
            "r2": act(N, f"rstd2_{i}"),
            "gate": act(N * F, f"gate{i}"),
            "up": act(N * F, f"up{i}"),
            "s": act(N * F, f"swiglu{i}"),
        }
        for t, n_heads in (("q", H), ("k", K)):  # q/k after each op of their chain
            a[t + "1"] = act(N * n_heads * D, f"{t}1_{i}")
            if cfg.qk_norm != "none":
                a[t + "2"] = act(N * n_heads * D, f"{t}2_{i}")
                a[t + "r"] = act(N * n_heads, f"{t}rstd{i}")
        return a

    def _init_rest(self, act, S: int):
        N, C, dv = self.N, self.cfg.d_model, self.dv
        self.xS = act(S, "x_last")  # the last block's output (stream or state)
        self.xL = act(N * C, "x_final") if dv > 1 else self.xS  # readout of the state, before the final norm
        self.xf = act(N * C, "x_normed")
        self.rf = act(N, "rstd_final")
        self.row_loss = act(N, "row_loss")
        self.loss_acc = act(4, "loss_sum")
        if self.inference:
            self.dxf = None
        else:
            self._init_backward_scratch(act, S)
        self._init_head(act)

    def _init_backward_scratch(self, act, S: int):
        cfg, gpu, N, dv = self.cfg, self.gpu, self.N, self.dv
        C, H, K, D, F = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_hidden
        # backward scratch, shared by every layer
        self.dx = act(N * C, "dx")
        self.dxf = act(N * C, "dxf")
        self.dh = act(N * C, "dh")
        self.da = act(N * H * D, "da")
        self.dq = [act(N * H * D, "dq0"), act(N * H * D, "dq1")]
        self.dk = [act(N * K * D, "dk0"), act(N * K * D, "dk1")]
        self.dv_ = act(N * K * D, "dv")
        self.ds = act(N * F, "ds")
        self.dgate = act(N * F, "dgate")
        self.dup = act(N * F, "dup")
        if self.ddl:
            self.dS = [act(S, "dS0"), act(S, "dS1")]  # gradient of the stream/state, ping-pong
            self.du = act(N * C, "du")
            self.dxin = act(N * C, "dxin")
            self.dbeta = act(N, "dbeta_logit")
            self.dz = act(N * dv, "dv_logit")
            self.ones = gpu.upload(np.ones(N, np.float32), "ones")
            self.ksum = act(C, "ksum")

    def _init_head(self, act):
        gpu, N, C, V = self.gpu, self.N, self.cfg.d_model, self.cfg.vocab_size
        self.chunk = min(N, self._chunk_rows or head_chunk_rows(gpu, N, C, V))
        self.logit_chunk = act(self.chunk * V, "logits_chunk")
        # loss sum, grad norm, clip multiplier, finite; the draft's loss sum
        self.readback = gpu.buffer(32, label="readback")
        self.trunk_head = {
            "xf": self.xf,
            "dxf": self.dxf,
            "targets": self.targets,
            "weights": self.weights,
            "scale": self.scale,
            "row_loss": self.row_loss,
        }
        if self.rows_in:  # the teacher's top-k per row (the top-k KL's targets)
            self.t_ids = buf_u32 = gpu.buffer(N * self.kl_k * 4, label="teacher_ids")
            self.t_probs = act(N * self.kl_k, "teacher_probs")
            self.trunk_head.update(t_ids=buf_u32, t_probs=self.t_probs)
        if self.mtp is not None:
            self._init_mtp(act)
        self._fwd = self._forward_calls()
        self._head_train = None if self.inference else self._head_calls(True, self.trunk_head)
        self._head_eval = self._head_calls(False, self.trunk_head)
        self._sum = k_red.sum_rows(gpu, self.loss_acc, self.row_loss, N)
        if self.mtp is not None:
            self._fwd_mtp = self._mtp_forward_calls()
            self._head_mtp = self._head_calls(True, self.mtp_head)
            self._sum_mtp = k_red.sum_rows(gpu, self.loss_acc, self.m["row_loss"], N, index=1)
            self._bwd = self._mtp_backward_calls() + self._backward_calls()
        elif self.inference:
            self._bwd = None
        else:
            self._bwd = self._backward_calls()
        self._spectral = None
        self._logit_calls = None
        self._topk: dict = {}

    # -- the MTP draft (joint training) -----------------------------------------------------------------

    def _init_mtp(self, act):
        """Buffers of the draft: its per-step inputs, the block input's pieces, its block, its head."""
        gpu, N, C, V = self.gpu, self.N, self.cfg.d_model, self.cfg.vocab_size
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
        self.M = self._block_acts(act, "mtp", N * C)  # the draft block's saved activations
        self.mtp_head = {
            "xf": m["post"],
            "dxf": m["dxf"],
            "targets": m["targets"],
            "weights": m["weights"],
            "scale": m["scale"],
            "row_loss": m["row_loss"],
        }

    def _mtp_hidden(self):
        return self.xL if self.mtp.trunk_hidden == "pre_norm" else self.xf

    def _mtp_forward_calls(self) -> Call:
        """The draft after the trunk: x = eh_proj·[enorm(E[x_{p+1}]); hnorm(h_p)] -> block -> mtp.norm."""
        cfg, g, N, C, m = self.cfg, self.gpu, self.N, self.cfg.d_model, self.m
        P, eps, style = self.net.view, cfg.rms_eps, cfg.norm_style
        call = self._embed_forward(m["e"], m["ids"], N)
        call += k_norm.rmsnorm_forward(g, m["en"], m["re"], m["e"], P(MTP_ENORM), N, C, eps, style)
        call += k_norm.rmsnorm_forward(
            g, m["hn"], m["rh"], self._mtp_hidden(), P(MTP_HNORM), N, C, eps, style
        )
        call += k_emb.embedding_forward(g, m["cat"], m["cat_idx"], m["eh"], 2 * N, C)  # the concat, (2N, C)
        call += k_mm.linear_forward(g, self.M["x"], m["cat"], P(MTP_EH), N, C, 2 * C, self.net.wdtype(MTP_EH))
        call += self._block_forward(0, self.M, m["pre"], prefix=MTP_BLOCK, ddl=False)
        return call + k_norm.rmsnorm_forward(g, m["post"], m["rf"], m["pre"], P(MTP_NORM), N, C, eps, style)

    def _mtp_backward_calls(self) -> Call:
        """The reverse of `_mtp_forward_calls`; ends with d(trunk hidden) in m["dhid"] and the embedding's
        gradient accumulated (the trunk's backward adds m["dhid"] where the draft read the hidden)."""
        cfg, g, N, C, m = self.cfg, self.gpu, self.N, self.cfg.d_model, self.m
        P, G, style = self.net.view, self._grad, cfg.norm_style
        call = k_norm.rmsnorm_backward(
            g, m["dx"], G(MTP_NORM), m["dxf"], m["pre"], P(MTP_NORM), m["rf"], N, C, style
        )
        c, dx = self._block_backward(0, self.M, m["dx"], prefix=MTP_BLOCK, ddl=False)
        call += c
        call += k_mm.linear_backward(
            g, m["dcat"], G(MTP_EH), dx, m["cat"], P(MTP_EH), N, C, 2 * C, accumulate_dw=True
        )
        call += k_emb.embedding_forward(g, m["deh"], m["inv_idx"], m["dcat"], self.N2 + N, C)  # un-concat
        call += k_norm.rmsnorm_backward(
            g, m["de"], G(MTP_ENORM), m["den"], m["e"], P(MTP_ENORM), m["re"], N, C, style
        )
        call += k_norm.rmsnorm_backward(
            g, m["dhid"], G(MTP_HNORM), m["dhn"], self._mtp_hidden(), P(MTP_HNORM), m["rh"], N, C, style
        )
        return call + self._embed_backward(m["de"], m["order"], m["starts"])

    # -- per-step host data -----------------------------------------------------------------------------

    def _upload(self, ids: np.ndarray, lengths: np.ndarray | None, train: bool) -> int:
        ids = np.asarray(ids)
        if ids.shape != (self.B, self.T):
            raise GpuError(f"batch of shape {ids.shape}, this Work was built for {(self.B, self.T)}")
        lengths = np.full(self.B, self.T) if lengths is None else np.asarray(lengths)
        V = self.cfg.vocab_size
        if ids.size and int(ids.max()) >= V:
            raise GpuError(f"token id {int(ids.max())} out of range for vocab_size {V}")
        ids32 = ids.astype(np.uint32)
        targets = np.zeros((self.B, self.T), np.uint32)
        targets[:, :-1] = ids32[:, 1:]
        pos = np.arange(self.T)[None, :]
        valid = pos < np.minimum(lengths[:, None] - 1, self.T - 1)  # (B, T): position predicts p+1
        weights = valid.astype(np.float32)
        count = int(valid.sum())
        g = self.gpu
        g.write(self.ids, ids32.reshape(-1))
        g.write(self.targets, targets.reshape(-1))
        g.write(self.weights, weights.reshape(-1))
        g.write(self.scale, np.array([1.0 / max(count, 1)], np.float32))
        if train:
            order, starts = k_emb.embedding_buckets(ids32.reshape(-1), V)
            g.write(self.order, order.astype(np.uint32))
            g.write(self.starts, starts.astype(np.uint32))
        if train and self.mtp is not None:  # the draft: row p reads x_{p+1}, predicts x_{p+2}
            tok = np.zeros_like(ids32)
            tok[:, :-1] = ids32[:, 1:]
            tgt = np.zeros_like(ids32)
            tgt[:, :-2] = ids32[:, 2:]
            valid2 = pos < np.minimum(lengths[:, None] - 2, self.T - 2)
            self.count_mtp = count2 = int(valid2.sum())
            m = self.m
            g.write(m["ids"], tok.reshape(-1))
            g.write(m["targets"], tgt.reshape(-1))
            g.write(m["weights"], valid2.astype(np.float32).reshape(-1))
            scale = self.net.mtp_weight / count2 if count2 else 0.0
            g.write(m["scale"], np.array([scale], np.float32))
            order, starts = k_emb.embedding_buckets(tok.reshape(-1), V)
            g.write(m["order"], order.astype(np.uint32))
            g.write(m["starts"], starts.astype(np.uint32))
        return count

    def _upload_rows(self, x, teacher_ids=None, teacher_probs=None, weights=None) -> float:
        """Input-rows mode: x (B, T, C) into the first block's input; with a teacher, its top-k and the
        row weights (the loss scale is 1 / their sum). -> the sum of the weights."""
        x = np.asarray(x, np.float32)
        C, N = self.cfg.d_model, self.N
        if x.shape != (self.B, self.T, C):
            raise GpuError(f"input rows of shape {x.shape}, this Work was built for {(self.B, self.T, C)}")
        g = self.gpu
        g.write(self.L[0]["x"], x.reshape(-1))
        if teacher_ids is None:
            return 0.0
        k = self.kl_k
        tid = np.asarray(teacher_ids).reshape(N, -1)
        if tid.shape[1] != k:
            raise GpuError(f"teacher top-k of width {tid.shape[1]}, this Work was built for {k}")
        w = np.asarray(weights, np.float32).reshape(N)
        count = float(w.sum())
        g.write(self.t_ids, np.clip(tid, 0, self.cfg.vocab_size - 1).astype(np.uint32).reshape(-1))
        g.write(self.t_probs, np.asarray(teacher_probs, np.float32).reshape(-1))
        g.write(self.weights, w)
        g.write(self.scale, np.array([1.0 / max(count, 1.0)], np.float32))
        return count

    # -- the model: forward and backward, mirrored ------------------------------------------------------

    def _forward_calls(self) -> Call:
        cfg, g, N, C, dv = self.cfg, self.gpu, self.N, self.cfg.d_model, self.dv
        P = self.net.view
        x0 = self.L[0]["x"] if self.L else self.xS
        if self.rows_in:  # the first block reads the uploaded rows
            call = Call()
        elif dv == 1:
            call = self._embed_forward(x0, self.ids, N)
        else:  # expand the embedding into the d_v state: EC (short conv) or repetition
            call = self._embed_forward(self.emb, self.ids, N)
            if cfg.ddl_expand_embed:
                call += k_sc.ec_forward(
                    g,
                    x0,
                    self.emb,
                    P("model.embed_expand.conv.weight"),
                    self.B,
                    self.T,
                    C,
                    dv,
                    cfg.ddl_conv_kernel,
                )
            else:
                call += k_sc.repeat_forward(g, x0, self.emb, N, C, dv)
        for i, a in enumerate(self.L):
            out = self.L[i + 1]["x"] if i + 1 < len(self.L) else self.xS
            call += self._block_forward(i, a, out)
        if dv > 1:
            call += self._compress_forward("model.readout.", self.xL, self.xS)
        call += k_norm.rmsnorm_forward(
            g, self.xf, self.rf, self.xL, P("model.norm.weight"), N, C, cfg.rms_eps, cfg.norm_style
        )
        return call

    def _block_forward(
        self, i: int, a: dict, out, prefix: str | None = None, ddl: bool | None = None
    ) -> Call:
        """One block, both sublayers; `out` receives the block output. Mirrors `ddl_ref.model`.
        `prefix`/`ddl` override the block's parameter names and residual kind (the MTP draft's block)."""
        cfg, g, N, C = self.cfg, self.gpu, self.N, self.cfg.d_model
        P = self.net.view
        p = prefix or f"model.layers.{i}."
        ddl = self.ddl if ddl is None else ddl
        call = Call()
        subs = (
            ("attn", "input_layernorm", a["x"], a["xm"], "h", "r1"),
            ("mlp", "post_attention_layernorm", a["xm"], out, "h2", "r2"),
        )
        for sub, norm, x_in_state, x_out, h, r in subs:
            if not ddl:  # baseline: x_out = x + sublayer(norm(x))
                call += k_norm.rmsnorm_forward(
                    g, a[h], a[r], x_in_state, P(p + norm + ".weight"), N, C, cfg.rms_eps, cfg.norm_style
                )
                call += k_ew.copy(g, x_out, x_in_state, N * C)
                call += self._sublayer_forward(sub, a, p, x_out, accumulate=True)
                continue
            # DDL: x_in = compress(X) (d_v > 1) or X; c = norm(x_in); u = sublayer(c); X = delta(X; u, c, x_in)
            xin = a["xin_" + sub]
            if self.dv > 1:
                call += self._compress_forward(p + "compress.", xin, x_in_state)
            call += k_norm.rmsnorm_forward(
                g, a[h], a[r], xin, P(p + norm + ".weight"), N, C, cfg.rms_eps, cfg.norm_style
            )
            call += self._sublayer_forward(sub, a, p, a["u_" + sub], accumulate=False)
            q = p + f"ddl_{sub}."
            call += k_delta.delta_forward(
                g,
                x_out,
                a["st_" + sub],
                x_in_state,
                a["u_" + sub],
                a[h],
                xin,
                P(q + "beta_proj.weight"),
                P(q + "beta_proj.bias"),
                P(q + "v_proj.weight"),
                P(q + "v_proj.bias"),
                N,
                C,
                self.dv,
                cfg.ddl_k_eps,
                cfg.ddl_v_scale,
            )
        return call

    def _sublayer_forward(self, sub: str, a: dict, p: str, out, accumulate: bool) -> Call:
        """Attention (from a["h"]) or SwiGLU MLP (from a["h2"]), its output projection into `out`."""
        cfg, g, N, C = self.cfg, self.gpu, self.N, self.cfg.d_model
        H, K, D, F = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_hidden
        P, W = self.net.view, self.net.wdtype
        if sub == "attn":
            q, k, v = (p + f"self_attn.{t}_proj.weight" for t in "qkv")
            call = k_mm.linear_forward(g, a["q"], a["h"], P(q), N, H * D, C, W(q))
            call += k_mm.linear_forward(g, a["k"], a["h"], P(k), N, K * D, C, W(k))
            call += k_mm.linear_forward(g, a["v"], a["h"], P(v), N, K * D, C, W(v))
            for t, nh in (("q", H), ("k", K)):
                call += self._qk_chain_forward(a, t, nh, p)
            qf, kf = self._qk_final(a, "q"), self._qk_final(a, "k")
            if self.chain:
                call += k_attn.attention_masked_forward(
                    g, a["a"], a["lse"], qf, kf, a["v"], self.B, self.T, H, K, D, self.T // self.chain
                )
            else:
                call += k_attn.attention_forward(g, a["a"], a["lse"], qf, kf, a["v"], self.B, self.T, H, K, D)
            return call + k_mm.matmul(
                g,
                out,
                a["a"],
                P(p + "self_attn.o_proj.weight"),
                N,
                C,
                H * D,
                trans_b=True,
                accumulate=accumulate,
                b_dtype=W(p + "self_attn.o_proj.weight"),
            )
        gate, up, down = (p + f"mlp.{t}_proj.weight" for t in ("gate", "up", "down"))
        call = k_mm.linear_forward(g, a["gate"], a["h2"], P(gate), N, F, C, W(gate))
        call += k_mm.linear_forward(g, a["up"], a["h2"], P(up), N, F, C, W(up))
        call += k_swiglu.swiglu_forward(g, a["s"], a["gate"], a["up"], N * F)
        return call + k_mm.matmul(
            g, out, a["s"], P(down), N, C, F, trans_b=True, accumulate=accumulate, b_dtype=W(down)
        )

    def _compress_forward(self, prefix: str, x_in, X) -> Call:
        cfg, P = self.cfg, self.net.view
        conv, read = P(prefix + "conv.weight"), P(prefix + "read.weight")
        if cfg.ddl_compressor == "tc":
            return k_sc.tc_forward(
                self.gpu, x_in, X, conv, read, self.B, self.T, cfg.d_model, self.dv, cfg.ddl_conv_kernel
            )
        return k_sc.cc_forward(self.gpu, x_in, X, conv, read, self.N, cfg.d_model, self.dv)

    def _compress_backward(self, prefix: str, dX, dx_in, X) -> Call:
        """dX += d(compress)/dX · dx_in; the compressor's parameter gradients accumulate."""
        cfg, P, G = self.cfg, self.net.view, self._grad
        args = (P(prefix + "conv.weight"), P(prefix + "read.weight"))
        dconv, dread = G(prefix + "conv.weight"), G(prefix + "read.weight")
        if cfg.ddl_compressor == "tc":
            return k_sc.tc_backward(
                self.gpu,
                dX,
                dconv,
                dread,
                dx_in,
                X,
                *args,
                self.B,
                self.T,
                cfg.d_model,
                self.dv,
                cfg.ddl_conv_kernel,
                accumulate_dX=True,
            )
        return k_sc.cc_backward(
            self.gpu, dX, dconv, dread, dx_in, X, *args, self.N, cfg.d_model, self.dv, accumulate_dX=True
        )

    def _grad(self, name: str):
        return self.net.view(name, "g")

    def _qk_order(self) -> list[str]:
        return {"none": ["rope"], "pre_rope": ["norm", "rope"], "post_rope": ["rope", "norm"]}[
            self.cfg.qk_norm
        ]

    def _qk_final(self, a: dict, t: str):
        return a[t + str(len(self._qk_order()))]

    def _qk_chain_forward(self, a: dict, t: str, nh: int, p: str) -> Call:
        cfg, g, N, D = self.cfg, self.gpu, self.N, self.cfg.head_dim
        call, src = Call(), a[t]
        for j, op in enumerate(self._qk_order(), start=1):
            dst = a[t + str(j)]
            if op == "rope":
                call += k_rope.rope_forward(g, dst, src, self.cos, self.sin, self.B, self.T, nh, D)
            else:
                w = self.net.view(p + f"self_attn.{t}_norm.weight")
                call += k_norm.rmsnorm_forward(
                    g, dst, a[t + "r"], src, w, N * nh, D, cfg.rms_eps, cfg.norm_style
                )
            src = dst
        return call

    def _qk_chain_backward(self, a: dict, t: str, nh: int, p: str, dfinal, scratch) -> tuple[Call, object]:
        """Reverse of `_qk_chain_forward`: from d(final q/k) to d(projection output)."""
        cfg, g, N, D = self.cfg, self.gpu, self.N, self.cfg.head_dim
        order = self._qk_order()
        call, dcur = Call(), dfinal
        for j in range(len(order), 0, -1):
            op = order[j - 1]
            src = a[t + str(j - 1)] if j > 1 else a[t]
            dnext = scratch if dcur is dfinal else dfinal
            if op == "rope":
                call += k_rope.rope_backward(g, dnext, dcur, self.cos, self.sin, self.B, self.T, nh, D)
            else:
                w = self.net.view(p + f"self_attn.{t}_norm.weight")
                dw = self.net.view(p + f"self_attn.{t}_norm.weight", "g")
                call += k_norm.rmsnorm_backward(
                    g, dnext, dw, dcur, src, w, a[t + "r"], N * nh, D, cfg.norm_style
                )
            dcur = dnext
        return call, dcur

    def _head_calls(self, train: bool, src: dict) -> Call:
        """LM head + loss in row chunks; with `train`, also the head's backward per chunk. `src` names the
        rows (xf), their gradient (dxf), the per-step targets, weights, loss scale and per-row losses (the
        trunk's or the draft's). The loss is the cross-entropy, or in input-rows mode the top-k KL to the
        teacher's top-k (its kernel writes the gradient in place even when evaluating: harmless scratch).
        A frozen head gets no gradient product."""
        cfg, g, net = self.cfg, self.gpu, self.net
        C, V, N = cfg.d_model, cfg.vocab_size, self.N
        head_trained = net.head_name in net.trainable or not self.rows_in
        call = Call()
        for r0 in range(0, N, self.chunk):
            n = min(self.chunk, N - r0)
            xf = (src["xf"], r0 * C * F32, n * C * F32)
            logits = (self.logit_chunk, 0, n * V * F32)
            call += self._head_forward(logits, xf, n)
            if self.rows_in:
                call += k_topk.topk_kl(
                    g,
                    src["row_loss"],
                    logits,
                    src["t_ids"],
                    src["t_probs"],
                    src["weights"],
                    n,
                    V,
                    self.kl_k,
                    src["scale"],
                    row_offset=r0,
                )
            elif train:
                call += k_ce.cross_entropy(
                    g,
                    src["row_loss"],
                    logits,
                    src["targets"],
                    src["weights"],
                    n,
                    V,
                    src["scale"],
                    row_offset=r0,
                )
            else:
                call += k_ce.cross_entropy_eval(
                    g, src["row_loss"], logits, src["targets"], src["weights"], n, V, row_offset=r0
                )
            if train:
                dxf = (src["dxf"], r0 * C * F32, n * C * F32)
                call += self._head_backward(dxf, logits, xf, n, head_trained)
        return call

    # -- the embedding and the LM head, in row chunks of a table larger than one binding --------------

    def _embed_forward(self, out, ids, n: int) -> Call:
        """out (n, C) = E[ids]; a table larger than a binding runs one range-gather per row chunk."""
        g, C = self.gpu, self.cfg.d_model
        chunks, dt = self.net.row_views(EMBED), self.net.wdtype(EMBED)
        if len(chunks) == 1:
            return k_emb.embedding_forward(g, out, ids, chunks[0][2], n, C, w_dtype=dt)
        call = Call()
        for j, (v0, rows, w) in enumerate(chunks):
            last = j == len(chunks) - 1
            call += k_emb.embedding_forward_range(g, out, ids, w, n, C, v0, rows, last=last, w_dtype=dt)
        return call

    def _embed_backward(self, dout, order, starts) -> Call:
        """dE (+)= the bucketed sums of dout, one deterministic pass per row chunk of the gradient."""
        g, C = self.gpu, self.cfg.d_model
        call = Call()
        for v0, rows, dw in self.net.row_views(EMBED, "g"):
            call += k_emb.embedding_backward(g, dw, dout, order, starts, rows, C, accumulate=True, v0=v0)
        return call

    def _head_chunks(self) -> list[tuple[int, int, tuple, tuple]]:
        """The head's vocabulary chunks [(v0, rows, W view, dW view)]: one when it fits a binding. Tied
        embeddings share the embedding's chunks; an inference Net has no dW views (None)."""
        net = self.net
        pv = net.row_views(net.head_name, "p")
        frozen = net.inference or net.head_name not in net.has_state
        gv = [(None, None, None)] * len(pv) if frozen else net.row_views(net.head_name, "g")
        if len(pv) > 1 and any(v0 % 64 for v0, _, _ in pv):
            raise GpuError(
                f"{net.head_name}: vocabulary chunks of {pv[0][1]} rows do not keep logits column offsets "
                f"256-byte aligned (64 rows of {net.slots[net.head_name].nbytes // net.cfg.vocab_size} bytes "
                f"exceed the binding limit {self.gpu.max_binding})"
            )
        return [(v0, rows, w, dw) for (v0, rows, w), (_, _, dw) in zip(pv, gv, strict=True)]

    def _logit_cols(self, logits, n: int, v0: int, rows: int) -> tuple:
        """Columns [v0, v0 + rows) of an (n, V) logits view, as a view whose rows are V floats apart."""
        buf, off, _ = logits
        V = self.cfg.vocab_size
        return (buf, off + v0 * F32, ((n - 1) * V + rows) * F32)

    def _head_forward(self, logits, xf, n: int) -> Call:
        """logits (n, V) = xf (n, C) · Wᵀ, vocabulary chunk by vocabulary chunk (ldc = V)."""
        g, C, V = self.gpu, self.cfg.d_model, self.cfg.vocab_size
        call = Call()
        dt = self.net.wdtype(self.net.head_name)
        for v0, rows, w, _dw in self._head_chunks():
            cols = self._logit_cols(logits, n, v0, rows)
            call += k_mm.matmul(g, cols, xf, w, n, rows, C, trans_b=True, ldc=V, b_dtype=dt)
        return call

    def _head_backward(self, dxf, dlogits, xf, n: int, with_dw: bool) -> Call:
        """dxf (n, C) = dlogits · W, summed over the vocabulary chunks; with `with_dw`, each chunk's
        dW (+)= dlogits[:, chunk]ᵀ · xf into its own rows of the gradient."""
        g, C, V = self.gpu, self.cfg.d_model, self.cfg.vocab_size
        call = Call()
        for j, (v0, rows, w, dw) in enumerate(self._head_chunks()):
            d = self._logit_cols(dlogits, n, v0, rows)
            call += k_mm.matmul(g, dxf, d, w, n, C, rows, lda=V, accumulate=j > 0)
            if with_dw:
                call += k_mm.matmul(g, dw, d, xf, rows, C, n, trans_a=True, lda=V, accumulate=True)
        return call

    def _backward_calls(self) -> Call:
        """The reverse of `_forward_calls`, op for op."""
        cfg, g, N, C, dv = self.cfg, self.gpu, self.N, self.cfg.d_model, self.dv
        P, G = self.net.view, self._grad
        # final norm (and the readout of the d_v state)
        d_last = self.dx if not self.ddl else (self.dS[0] if dv == 1 else self.dxin)
        call = k_norm.rmsnorm_backward(
            g,
            d_last,
            G("model.norm.weight"),
            self.dxf,
            self.xL,
            P("model.norm.weight"),
            self.rf,
            N,
            C,
            cfg.norm_style,
        )
        if self.mtp is not None:  # the draft read the trunk's hidden: its gradient joins here
            dhid = self.m["dhid"]
            if self.mtp.trunk_hidden == "post_norm":
                call = k_ew.add_inplace(g, self.dxf, dhid, N * C) + call
            else:
                call += k_ew.add_inplace(g, d_last, dhid, N * C)
        dcur = d_last
        if dv > 1:
            call += k_ew.fill(g, self.dS[0], N * C * dv, 0.0)
            call += self._compress_backward("model.readout.", self.dS[0], self.dxin, self.xS)
            dcur = self.dS[0]
        for i in reversed(range(len(self.L))):
            c, dcur = self._block_backward(i, self.L[i], dcur)
            call += c
        if self.rows_in:  # the rows came from outside: nothing flows into the embedding
            return call
        # embedding (through EC or the repetition when d_v > 1)
        demb = dcur
        if dv > 1:
            demb = self.dxin
            if cfg.ddl_expand_embed:
                call += k_sc.ec_backward(
                    g,
                    demb,
                    G("model.embed_expand.conv.weight"),
                    dcur,
                    self.emb,
                    P("model.embed_expand.conv.weight"),
                    self.B,
                    self.T,
                    C,
                    dv,
                    cfg.ddl_conv_kernel,
                )
            else:
                call += k_sc.repeat_backward(g, demb, dcur, N, C, dv)
        return call + self._embed_backward(demb, self.order, self.starts)

    def _block_backward(
        self, i: int, a: dict, dout, prefix: str | None = None, ddl: bool | None = None
    ) -> tuple[Call, object]:
        """From d(block output) to d(block input); returns (call, buffer holding d(block input))."""
        cfg, g, N, C = self.cfg, self.gpu, self.N, self.cfg.d_model
        P, G = self.net.view, self._grad
        p = prefix or f"model.layers.{i}."
        ddl = self.ddl if ddl is None else ddl
        call = Call()
        subs = (
            ("mlp", "post_attention_layernorm", a["xm"], "h2", "r2"),
            ("attn", "input_layernorm", a["x"], "h", "r1"),
        )
        for sub, norm, x_state, h, r in subs:
            if not ddl:  # dx flows through the residual; the branch adds its gradient to it
                call += self._sublayer_backward(sub, a, p, dout, self.dh, accumulate_dh=False)
                call += k_norm.rmsnorm_backward(
                    g,
                    dout,
                    G(p + norm + ".weight"),
                    self.dh,
                    x_state,
                    P(p + norm + ".weight"),
                    a[r],
                    N,
                    C,
                    cfg.norm_style,
                    accumulate_dx=True,
                )
                continue
            dnext = self.dS[1] if dout is self.dS[0] else self.dS[0]
            xin, q = a["xin_" + sub], p + f"ddl_{sub}."
            # the Delta update: dX, du (the sublayer's output), dc (-> dh), dx_v (-> dxin)
            call += k_delta.delta_backward(
                g,
                dnext,
                self.du,
                self.dbeta,
                self.dz,
                self.dh,
                self.dxin,
                dout,
                x_state,
                a["u_" + sub],
                a["st_" + sub],
                P(q + "beta_proj.weight"),
                P(q + "v_proj.weight"),
                N,
                C,
                self.dv,
                cfg.ddl_v_scale,
                accumulate_dc=False,
                accumulate_dx_v=False,
            )
            call += k_delta.delta_param_grads(
                g,
                G(q + "beta_proj.weight"),
                G(q + "beta_proj.bias"),
                G(q + "v_proj.weight"),
                G(q + "v_proj.bias"),
                self.dbeta,
                self.dz,
                a[h],
                xin,
                self.ones,
                N,
                C,
                self.dv,
            )
            call += self._sublayer_backward(sub, a, p, self.du, self.dh, accumulate_dh=True)
            call += k_norm.rmsnorm_backward(
                g,
                self.dxin,
                G(p + norm + ".weight"),
                self.dh,
                xin,
                P(p + norm + ".weight"),
                a[r],
                N,
                C,
                cfg.norm_style,
                accumulate_dx=True,
            )
            if self.dv > 1:  # x_in = compress(X): back through the (shared) block compressor
                call += self._compress_backward(p + "compress.", dnext, self.dxin, x_state)
            else:  # d_v = 1: x_in is the stream itself
                call += k_ew.add_inplace(g, dnext, self.dxin, N * C)
            dout = dnext
        return call, dout

    def _sublayer_backward(self, sub: str, a: dict, p: str, dout, dh, accumulate_dh: bool) -> Call:
        """Reverse of `_sublayer_forward`: from d(sublayer output) to d(its normalized input) in `dh`."""
        cfg, g, N, C = self.cfg, self.gpu, self.N, self.cfg.d_model
        H, K, D, F = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_hidden
        P, G = self.net.view, self._grad
        acc = accumulate_dh
        if sub == "mlp":
            call = k_mm.linear_backward(
                g,
                self.ds,
                G(p + "mlp.down_proj.weight"),
                dout,
                a["s"],
                P(p + "mlp.down_proj.weight"),
                N,
                C,
                F,
                accumulate_dw=True,
            )
            call += k_swiglu.swiglu_backward(g, self.dgate, self.dup, self.ds, a["gate"], a["up"], N * F)
            call += k_mm.linear_backward(
                g,
                dh,
                G(p + "mlp.up_proj.weight"),
                self.dup,
                a["h2"],
                P(p + "mlp.up_proj.weight"),
                N,
                F,
                C,
                accumulate_dx=acc,
                accumulate_dw=True,
            )
            return call + k_mm.linear_backward(
                g,
                dh,
                G(p + "mlp.gate_proj.weight"),
                self.dgate,
                a["h2"],
                P(p + "mlp.gate_proj.weight"),
                N,
                F,
                C,
                accumulate_dx=True,
                accumulate_dw=True,
            )
        call = k_mm.linear_backward(
            g,
            self.da,
            G(p + "self_attn.o_proj.weight"),
            dout,
            a["a"],
            P(p + "self_attn.o_proj.weight"),
            N,
            C,
            H * D,
            accumulate_dw=True,
        )
        attn_args = (g, self.dq[0], self.dk[0], self.dv_, self.da, a["a"], a["lse"], self._qk_final(a, "q"),
                     self._qk_final(a, "k"), a["v"], self.B, self.T, H, K, D)  # fmt: skip
        if self.chain:
            call += k_attn.attention_masked_backward(*attn_args, self.T // self.chain)
        else:
            call += k_attn.attention_backward(*attn_args)
        c_q, dq = self._qk_chain_backward(a, "q", H, p, self.dq[0], self.dq[1])
        c_k, dk = self._qk_chain_backward(a, "k", K, p, self.dk[0], self.dk[1])
        call += c_q + c_k
        call += k_mm.linear_backward(
            g,
            dh,
            G(p + "self_attn.v_proj.weight"),
            self.dv_,
            a["h"],
            P(p + "self_attn.v_proj.weight"),
            N,
            K * D,
            C,
            accumulate_dx=acc,
            accumulate_dw=True,
        )
        call += k_mm.linear_backward(
            g,
            dh,
            G(p + "self_attn.k_proj.weight"),
            dk,
            a["h"],
            P(p + "self_attn.k_proj.weight"),
            N,
            K * D,
            C,
            accumulate_dx=True,
            accumulate_dw=True,
        )
        return call + k_mm.linear_backward(
            g,
            dh,
            G(p + "self_attn.q_proj.weight"),
            dq,
            a["h"],
            P(p + "self_attn.q_proj.weight"),
            N,
            H * D,
            C,
            accumulate_dx=True,
            accumulate_dw=True,
        )

    # -- steps ------------------------------------------------------------------------------------------

    def _finish(self, rec, with_scalars: bool, with_mtp: bool = False):
        rec.copy(self.loss_acc, 0, self.readback, 0, 4)
        if with_scalars:
            rec.copy(self.net.scalars, 0, self.readback, 4, 12)
        if with_mtp:
            rec.copy(self.loss_acc, 4, self.readback, 16, 4)
        rec.submit()
        return self.gpu.download(self.readback, np.float32, 5)

    def _record_step(self, update: AdamW | None):
        if self.inference:
            raise GpuError("this Work belongs to an inference-only Net: no training steps (forward only)")
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
        return self._finish(rec, update is not None, self.mtp is not None)

    def step(self, ids, lengths=None, update: AdamW | None = None) -> StepResult:
        """Forward + backward (gradients overwritten, not accumulated), and with `update` the global
        gradient norm, clipping and AdamW, all in one encoder and one submit. With a draft (`cfg.mtp`) the
        loss is loss_main + net.mtp_weight · loss_mtp, and both parts are in the result."""
        if self.rows_in:
            raise GpuError("this Work reads input rows: use step_rows")
        if self.inference:
            raise GpuError("this Work belongs to an inference-only Net: no training steps (forward only)")
        count = self._upload(ids, lengths, train=True)
        out = self._record_step(update)
        loss = float(out[0]) / max(count, 1)
        extra = {}
        if self.mtp is not None:
            loss_mtp = float(out[4]) / self.count_mtp if self.count_mtp else 0.0
            extra = {"loss_main": loss, "loss_mtp": loss_mtp}
            loss = loss + self.net.mtp_weight * loss_mtp
        finite = bool(np.isfinite(loss)) and (update is None or out[3] != 0)
        norm = float(out[1]) if update is not None else math.nan
        return StepResult(loss=loss, count=count, grad_norm=norm, finite=finite, **extra)

    # -- input-rows mode (a draft block healed alone) ---------------------------------------------------

    def step_rows(self, x, teacher_ids, teacher_probs, weights, update: AdamW | None = None) -> StepResult:
        """x (B, T, C) block input rows; teacher top-k ids/probs (B, T, k); weights (B, T) 0/1. Forward,
        top-k KL (mean over weighted rows), backward, and with `update` the clip and AdamW; one submit."""
        count = self._upload_rows(x, teacher_ids, teacher_probs, weights)
        out = self._record_step(update)
        loss = float(out[0]) / max(count, 1.0)
        finite = bool(np.isfinite(loss)) and (update is None or out[3] != 0)
        norm = float(out[1]) if update is not None else math.nan
        return StepResult(loss=loss, count=int(count), grad_norm=norm, finite=finite)

    def loss_sum_rows(self, x, teacher_ids, teacher_probs, weights) -> float:
        """Sum over rows of weight · top-k KL (evaluation; no gradients)."""
        self._upload_rows(x, teacher_ids, teacher_probs, weights)
        rec = self.gpu.recorder()
        self._fwd.record(rec)
        self._head_eval.record(rec)
        self._sum.record(rec)
        return float(self._finish(rec, False)[0])

    def forward_rows(self, x) -> tuple[np.ndarray, np.ndarray]:
        """Forward of input rows x (B, T, C) -> the block's (output, final-normed output), each (B, T, C)."""
        self._upload_rows(x)
        rec = self.gpu.recorder()
        self._fwd.record(rec)
        rec.submit()
        return self.hidden()

    # -- top-k of the next-token distribution ---------------------------------------------------------

    def topk(self, inputs, k: int, lengths=None) -> tuple[np.ndarray, np.ndarray]:
        """One forward (ids (B, T), or input rows (B, T, C) in input-rows mode), then per row the k most
        likely next tokens and their full-softmax probabilities, from chunked logits (`ops.topk_kl.topk`;
        ties to the lower id, so ids[..., 0] is the argmax) -> (ids (B, T, k) int32, probs (B, T, k) f32).
        The forward's hidden rows stay readable through `hidden()`."""
        cfg, g, N = self.cfg, self.gpu, self.N
        C, V = cfg.d_model, cfg.vocab_size
        k = min(int(k), V)
        if k not in self._topk:
            ids_out = g.buffer(N * k * 4, label="topk_ids")
            probs_out = g.buffer(N * k * F32, label="topk_probs")
            call = Call()
            for r0 in range(0, N, self.chunk):
                n = min(self.chunk, N - r0)
                xf = (self.xf, r0 * C * F32, n * C * F32)
                logits = (self.logit_chunk, 0, n * V * F32)
                call += self._head_forward(logits, xf, n)
                call += k_topk.topk(g, ids_out, probs_out, logits, n, V, k, row_offset=r0)
            self._topk[k] = (call, ids_out, probs_out)
        call, ids_out, probs_out = self._topk[k]
        if self.rows_in:
            self._upload_rows(inputs)
        else:
            self._upload(inputs, lengths, train=False)
        rec = g.recorder()
        self._fwd.record(rec)
        call.record(rec)
        rec.submit()
        shape = (self.B, self.T, k)
        ids = g.download(ids_out, np.uint32, N * k).reshape(shape).astype(np.int32)
        return ids, g.download(probs_out, np.float32, N * k).reshape(shape)

    def loss_sum(self, ids, lengths=None) -> tuple[float, int]:
        """Sum of the per-prediction losses and the number of predictions (evaluation; no gradients)."""
        total, count, _ = self.eval_batch(ids, lengths)
        return total, count

    def spectral(self, ids, lengths=None) -> dict | None:
        """The spectral diagnostics of one forward (`ddl_ref.spectral`'s definitions), over real tokens
        (t < length); None for a baseline model (on request, never inside a training step)."""
        return self.eval_batch(ids, lengths, spectral=True)[2]

    def eval_batch(self, ids, lengths=None, spectral: bool = False) -> tuple[float, int, dict | None]:
        """One forward of a batch in one submit: the loss sum and prediction count, and with `spectral` (DDL
        models) the spectral snapshot of that same forward, read from the per-token stats of every Delta
        update and the k sums over real tokens."""
        count = self._upload(ids, lengths, train=False)
        real = None
        if spectral and self.ddl:
            lengths = np.full(self.B, self.T) if lengths is None else np.asarray(lengths)
            real = (np.arange(self.T)[None, :] < lengths[:, None]).reshape(-1)
            if real.any():
                self.gpu.write(self.real, real.astype(np.float32))
                self._spectral_calls()
            else:
                real = None
        rec = self.gpu.recorder()
        self._fwd.record(rec)
        self._head_eval.record(rec)
        self._sum.record(rec)
        if real is not None:
            self._spectral.record(rec)
        out = self._finish(rec, False)
        return float(out[0]), count, (self._read_spectral(real) if real is not None else None)

    def _spectral_calls(self):
        """The k-sum launches of every DDL sublayer, built once."""
        C, dv, N = self.cfg.d_model, self.dv, self.N
        subs = [(a, sub) for a in self.L for sub in ("attn", "mlp")]
        if self._spectral is None:
            self._kslot = _align(C * F32)  # one 256-aligned slot per sublayer, so each binds as a view
            self._ksums = self.gpu.buffer(len(subs) * self._kslot, label="ksums")
            call = Call()
            for j, (a, sub) in enumerate(subs):
                call += k_delta.ksum(
                    self.gpu,
                    (self._ksums, j * self._kslot, C * F32),
                    a["u_" + sub],
                    a["st_" + sub],
                    self.real,
                    N,
                    C,
                    dv,
                )
            self._spectral = call

    def _read_spectral(self, real: np.ndarray) -> dict:
        """The snapshot of the last forward from its delta stats (one read-back per sublayer) and k sums."""
        from ddl_ref.spectral import LAYER_KEYS, finish_snapshot

        C, dv, N = self.cfg.d_model, self.dv, self.N
        subs = [(a, sub) for a in self.L for sub in ("attn", "mlp")]
        slots = self.gpu.download(self._ksums, np.float32).reshape(len(subs), self._kslot // F32)
        ksums = slots[:, :C].astype(np.float64)
        per_layer: dict[str, list[float]] = {k: [] for k in LAYER_KEYS}
        n_real = float(real.sum())
        S = k_delta.stats_size(dv)
        for j, (a, sub) in enumerate(subs):
            st = self.gpu.download(a["st_" + sub], np.float32, N * S).reshape(N, S)[real].astype(np.float64)
            beta = st[:, k_delta.STAT_BETA]
            v = st[:, k_delta.STAT_V : k_delta.STAT_V + dv]
            pr = st[:, k_delta.STAT_V + dv : k_delta.STAT_V + 2 * dv]
            gamma = beta[:, None] * (v - pr)
            one_minus = 1.0 - beta
            per_layer["beta_per_layer"].append(float(beta.mean()))
            per_layer["k_eigenvalue_per_layer"].append(float(one_minus.mean()))
            per_layer["spatial_determinant_per_layer"].append(float(one_minus.mean()))
            per_layer["lifted_determinant_per_layer"].append(float((one_minus**dv).mean()))
            per_layer["k_coherence_per_layer"].append(float(np.linalg.norm(ksums[j] / n_real)))
            per_layer["correction_norm_per_layer"].append(float(np.linalg.norm(gamma, axis=-1).mean()))
        return finish_snapshot(per_layer)

    def logits(self, ids) -> np.ndarray:
        """Full logits (B, T, V) — for tests and small models only (downloads chunk by chunk)."""
        self._upload(ids, None, train=False)
        cfg, g = self.cfg, self.gpu
        C, V, N = cfg.d_model, cfg.vocab_size, self.N
        rec = g.recorder()
        self._fwd.record(rec)
        rec.submit()
        if self._logit_calls is None:  # one head Call per row chunk, built once like every other launch
            self._logit_calls = [
                (
                    r0,
                    n,
                    self._head_forward(
                        (self.logit_chunk, 0, n * V * F32), (self.xf, r0 * C * F32, n * C * F32), n
                    ),
                )
                for r0 in range(0, N, self.chunk)
                for n in [min(self.chunk, N - r0)]
            ]
        out = np.empty((N, V), np.float32)
        for r0, n, call in self._logit_calls:
            call.run(g)
            out[r0 : r0 + n] = g.download(self.logit_chunk, np.float32, n * V).reshape(n, V)
        return out.reshape(self.B, self.T, V)

    def hidden(self) -> tuple[np.ndarray, np.ndarray]:
        """The last forward's (pre-norm, post-norm) final hidden rows, each (B, T, C)."""
        C = self.cfg.d_model
        shape = (self.B, self.T, C)
        return (
            self.gpu.download(self.xL, np.float32, self.N * C).reshape(shape),
            self.gpu.download(self.xf, np.float32, self.N * C).reshape(shape),
        )
