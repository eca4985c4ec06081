"""Forward-only work of the token model on the GPU: `InferenceWork`.

One forward of a batch of token ids (the embedding — expanded into the d_v state by EC or repetition for the
DDL variants —, every block, the readout, the final norm), then one of: the evaluation loss (cross-entropy in
row chunks of logits, no gradients), the spectral diagnostics of a DDL forward, full logits (tests and small
models), the next-token top-k (heal's teacher, accept's greedy trunk), the final hidden rows. An
inference-only `Net` (heal's frozen f32 or f16 trunk) gets this Work; `trunk.TrunkWork` extends it with the
training step. Decoding with a key/value cache is not here: it is `decode.WgpuEngine`, on the same `Blocks`.
"""

from __future__ import annotations

import numpy as np

from ddl_wgpu.engine.blocks import Blocks
from ddl_wgpu.engine.layout import F32
from ddl_wgpu.engine.layout import align as _align
from ddl_wgpu.ops import crossentropy as k_ce
from ddl_wgpu.ops import delta as k_delta
from ddl_wgpu.ops import reduce as k_red
from ddl_wgpu.ops import shortconv as k_sc
from ddl_wgpu.runtime.gpu import Call, GpuError

EMBED_EXPAND = "model.embed_expand.conv.weight"


class InferenceWork(Blocks):
    """The token model's forward for one (batch, seq) shape, every launch built once."""

    def __init__(self, net, batch: int, seq: int, chunk_rows: int | None = None):
        super().__init__(net, batch, seq, chunk_rows)
        N, V = self.N, self.cfg.vocab_size
        self.ids = self.gpu.buffer(N * 4, label="ids")
        self.targets = self.gpu.buffer(N * 4, label="targets")
        self.weights = self.act(N, "weights")
        self.real = self.act(N, "real_tokens")  # 1 where t < length (spectral diagnostics)
        self.scale = self.act(4, "loss_scale")
        self.order = self.gpu.buffer(N * 4, label="emb_order")
        self.starts = self.gpu.buffer((V + 1) * 4, label="emb_starts")
        self.emb = (
            self.act(N * self.C, "embedding_out") if self.dv > 1 else None
        )  # e, kept for the EC backward
        self._fwd = self.forward_calls()
        self._head_eval = self.head_calls(self.xf, self._cross_entropy_eval)
        self._sum = k_red.sum_rows(self.gpu, self.loss_acc, self.row_loss, N)
        self._spectral = None
        self._logit_calls = None

    # -- the forward ------------------------------------------------------------------------------------

    def record_forward(self, rec):
        """Record the forward into `rec` -> the recorder to go on recording in (a streamed trunk submits its layers
        one by one between uploads and hands back a new one: `stream.TrunkPass`)."""
        self._fwd.record(rec)
        return rec

    def forward_calls(self) -> Call:
        """ids -> embedding (-> the d_v state) -> blocks -> readout -> final norm (xf)."""
        x0 = self.L[0]["x"] if self.L else self.xS
        return self.embed_forward(x0) + self.blocks_forward() + self.final_norm_forward()

    def embed_forward(self, x0) -> Call:
        """x0 = E[ids]; d_v > 1: the embedding expanded into the state by EC (short conv) or repetition."""
        cfg = self.cfg
        if self.dv == 1:
            return self.vocab.embed_forward(x0, self.ids, self.N)
        call = self.vocab.embed_forward(self.emb, self.ids, self.N)
        if cfg.ddl_expand_embed:
            conv = self.net.view(EMBED_EXPAND)
            return call + k_sc.ec_forward(self.gpu, x0, self.emb, conv, self.B, self.T, self.C, self.dv,
                                          cfg.ddl_conv_kernel)  # fmt: skip
        return call + k_sc.repeat_forward(self.gpu, x0, self.emb, self.N, self.C, self.dv)

    def _cross_entropy_eval(self, logits, n: int, r0: int) -> Call:
        return k_ce.cross_entropy_eval(self.gpu, self.row_loss, logits, self.targets, self.weights, n,
                                       self.cfg.vocab_size, row_offset=r0)  # fmt: skip

    # -- per-batch host data ----------------------------------------------------------------------------

    def upload_ids(self, ids: np.ndarray, lengths: np.ndarray | None, loss_scale: float = 1.0) -> int:
        """ids (B, T) and their next-token targets, weights (1 where position p predicts p + 1 < length) and
        the loss gradient's scale (1 / count, times mixed precision's power-of-two `loss_scale`, in f32: the
        product is exact) -> the number of predictions."""
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
        count = int(valid.sum())
        g = self.gpu
        g.write(self.ids, ids32.reshape(-1))
        g.write(self.targets, targets.reshape(-1))
        g.write(self.weights, valid.astype(np.float32).reshape(-1))
        g.write(self.scale, np.array([1.0 / max(count, 1)], np.float32) * np.float32(loss_scale))
        return count

    # -- evaluation -------------------------------------------------------------------------------------

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
        count = self.upload_ids(ids, lengths)
        real = None
        if spectral and self.ddl:
            lengths = np.full(self.B, self.T) if lengths is None else np.asarray(lengths)
            real = (np.arange(self.T)[None, :] < lengths[:, None]).reshape(-1)
            if real.any():
                self.gpu.write(self.real, real.astype(np.float32))
                self._spectral_calls()
            else:
                real = None
        rec = self.record_forward(self.gpu.recorder())
        self._head_eval.record(rec)
        self._sum.record(rec)
        if real is not None:
            self._spectral.record(rec)
        out = self.finish(rec, False)
        return float(out[0]), count, (self._read_spectral(real) if real is not None else None)

    def _spectral_calls(self):
        """The k-sum launches of every DDL sublayer, built once."""
        C, dv, N = self.C, self.dv, self.N
        subs = [(a, sub) for a in self.L for sub in ("attn", "mlp")]
        if self._spectral is None:
            self._kslot = _align(C * F32)  # one 256-aligned slot per sublayer, so each binds as a view
            self._ksums = self.gpu.buffer(len(subs) * self._kslot, label="ksums")
            call = Call()
            for j, (a, sub) in enumerate(subs):
                ksum = (self._ksums, j * self._kslot, C * F32)
                call += k_delta.ksum(self.gpu, ksum, a["u_" + sub], a["st_" + sub], self.real, N, C, dv)
            self._spectral = call

    def _read_spectral(self, real: np.ndarray) -> dict:
        """The snapshot of the last forward from its delta stats (one read-back per sublayer) and k sums."""
        C, dv, N = self.C, self.dv, self.N
        subs = [(a, sub) for a in self.L for sub in ("attn", "mlp")]
        slots = self.gpu.download(self._ksums, np.float32).reshape(len(subs), self._kslot // F32)
        S = k_delta.stats_size(dv)
        stats = [self.gpu.download(a["st_" + sub], np.float32, N * S).reshape(N, S) for a, sub in subs]
        return spectral_snapshot(stats, slots[:, :C], real, dv)

    # -- outputs of a forward ---------------------------------------------------------------------------

    def topk(self, ids, k: int, lengths=None) -> tuple[np.ndarray, np.ndarray]:
        """One forward of ids (B, T), then per row the k most likely next tokens and their probabilities
        (`Blocks.run_topk`)."""
        self.upload_ids(ids, lengths)
        return self.topk_after(self.record_forward(self.gpu.recorder()), min(int(k), self.cfg.vocab_size))

    def logits(self, ids) -> np.ndarray:
        """Full logits (B, T, V) — for tests and small models only (downloads chunk by chunk)."""
        self.upload_ids(ids, None)
        g, C, V, N = self.gpu, self.C, self.cfg.vocab_size, self.N
        self.record_forward(g.recorder()).submit()
        if self._logit_calls is None:  # one head Call per row chunk, built once like every other launch
            self._logit_calls = []
            for r0 in range(0, N, self.chunk):
                n = min(self.chunk, N - r0)
                xf = (self.xf, r0 * C * F32, n * C * F32)
                self._logit_calls.append(
                    (r0, n, self.vocab.head_forward((self.logit_chunk, 0, n * V * F32), xf, n))
                )
        out = np.empty((N, V), np.float32)
        for r0, n, call in self._logit_calls:
            call.run(g)
            out[r0 : r0 + n] = g.download(self.logit_chunk, np.float32, n * V).reshape(n, V)
        return out.reshape(self.B, self.T, V)

    def step(self, ids, lengths=None, update=None):
        raise GpuError("this Work belongs to an inference-only Net: no training steps (forward only)")


def spectral_snapshot(stats: list[np.ndarray], ksums: np.ndarray, real: np.ndarray, dv: int) -> dict:
    """The spectral snapshot (`ddl_ref.spectral`'s definitions) of one forward from each DDL sublayer's per-row
    delta stats (N, stats_size) and k sums (C,), over the rows where `real`."""
    from ddl_ref.spectral import LAYER_KEYS, finish_snapshot

    ksums = np.asarray(ksums).astype(np.float64)
    per_layer: dict[str, list[float]] = {k: [] for k in LAYER_KEYS}
    n_real = float(real.sum())
    for j, st in enumerate(stats):
        st = st[real].astype(np.float64)
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
