"""`eval` on the GPU: the loss (and a Deep Delta model's spectral diagnostics) of every batch of a dataset, the
trunk resident or streamed layer by layer (`stream.Trunk`, by a `gpumem.TrunkPlan`), several batches per pass
over the layers (`EvalPass`).

Each batch's numbers are those a work of that one batch computes (`inference.InferenceWork.eval_batch`, what
`train.evaluate` runs): every op of the forward and the head is row by row, and the reductions over a batch's
rows (the loss sum, the k sums of the spectral diagnostics) run on a copy of that batch's rows alone, with the
same kernel and size. So the result is the same bits whatever the block, resident or streamed.
"""

from __future__ import annotations

import numpy as np

from ddl_wgpu.engine.inference import spectral_snapshot
from ddl_wgpu.engine.layout import F32
from ddl_wgpu.engine.layout import align as _align
from ddl_wgpu.engine.stream import Trunk
from ddl_wgpu.ops import delta as k_delta
from ddl_wgpu.ops import reduce as k_red


def predictions(lengths: np.ndarray, T: int) -> int:
    """Predictions of a batch (position p predicts p + 1 < length): `InferenceWork.upload_ids`'s count."""
    pos = np.arange(T)[None, :]
    return int((pos < np.minimum(np.asarray(lengths)[:, None] - 1, T - 1)).sum())


class EvalPass:
    """`per_block` batches of `batch` windows of T tokens per forward of a `Trunk`'s work, each batch's loss
    sum (and spectral snapshot) computed on its own rows (module docstring)."""

    def __init__(self, trunk: Trunk, batch: int, T: int, per_block: int):
        self.trunk, self.gpu = trunk, trunk.gpu
        self.B, self.T, self.k = batch, T, per_block
        self.work = w = trunk.work(batch * per_block, T)
        g, n = self.gpu, batch * T
        self.rows = g.buffer(n * F32, label="batch_row_loss")
        self.sum = k_red.sum_rows(g, w.loss_acc, self.rows, n)
        self.sums = g.buffer(per_block * F32, label="batch_loss_sums")
        self.spectral = None
        if w.ddl:
            C, dv = w.C, w.dv
            S = k_delta.stats_size(dv)
            self.subs = [(a, sub) for a in w.L for sub in ("attn", "mlp")]
            self.kslot = _align(C * F32)  # one aligned slot per sublayer, each bound as a view
            self.u = g.buffer(n * C * F32, label="batch_u")
            self.st = g.buffer(n * S * F32, label="batch_stats")
            self.real = g.buffer(n * F32, label="batch_real")
            self.ksums = g.buffer(len(self.subs) * self.kslot, label="batch_ksums")
            self.spectral = [k_delta.ksum(g, (self.ksums, j * self.kslot, C * F32), self.u, self.st, self.real, n,
                                          C, dv) for j in range(len(self.subs))]  # fmt: skip

    def run(self, batches: list[tuple[np.ndarray, np.ndarray]], spectral: bool) -> list[tuple]:
        """Up to `per_block` batches (ids (B, T), lengths (B,)) in one forward -> per batch (loss sum, count,
        spectral snapshot or None), as `InferenceWork.eval_batch` gives them."""
        g, w, B, T = self.gpu, self.work, self.B, self.T
        n = B * T
        ids = np.zeros((self.k * B, T), np.int64)
        lengths = np.full(self.k * B, T)
        for i, (bi, bl) in enumerate(batches):
            ids[i * B : (i + 1) * B], lengths[i * B : (i + 1) * B] = bi, bl
        w.upload_ids(ids, lengths)
        rec = w.record_forward(g.recorder())
        w._head_eval.record(rec)
        for i in range(len(batches)):
            rec.copy(w.row_loss, i * n * F32, self.rows, 0, n * F32)
            self.sum.record(rec)
            rec.copy(w.loss_acc, 0, self.sums, i * F32, F32)
        rec.submit()
        sums = g.download(self.sums, np.float32, len(batches))
        out = []
        for i, (_bi, bl) in enumerate(batches):
            snap = self._spectral(i, bl) if spectral and self.spectral is not None else None
            out.append((float(sums[i]), predictions(bl, T), snap))
        return out

    def _spectral(self, i: int, lengths) -> dict | None:
        """Batch i's snapshot: its rows of every sublayer's k and stats copied out, k summed over them."""
        g, w, n = self.gpu, self.work, self.B * self.T
        real = (np.arange(self.T)[None, :] < np.asarray(lengths)[:, None]).reshape(-1)
        if not real.any():
            return None
        C, S = w.C, k_delta.stats_size(w.dv)
        g.write(self.real, real.astype(np.float32))
        rec = g.recorder()
        for (a, sub), call in zip(self.subs, self.spectral, strict=True):
            rec.copy(a["u_" + sub], i * n * C * F32, self.u, 0, n * C * F32)
            rec.copy(a["st_" + sub], i * n * S * F32, self.st, 0, n * S * F32)
            call.record(rec)
        rec.submit()
        slots = g.download(self.ksums, np.float32).reshape(len(self.subs), self.kslot // F32)
        stats = [
            g.download(a["st_" + sub], np.float32, n * S, i * n * S * F32).reshape(n, S)
            for a, sub in self.subs
        ]
        return spectral_snapshot(stats, slots[:, :C], real, w.dv)


def evaluate(trunk: Trunk, dataset, per_block: int, spectral: bool = False) -> dict:
    """`train.evaluate` of every batch of `dataset` on the GPU trunk, `per_block` batches per pass over its
    layers: the same loss and spectral snapshot, batch by batch in the same order."""
    from ddl_wgpu.jobs.train import summarize_eval

    ep = EvalPass(trunk, dataset.batch_size, dataset.seq_len, per_block)
    n = dataset.num_batches

    def results():
        for s in range(0, n, per_block):
            batches = [
                (b.ids, b.lengths) for b in (dataset.batch(i) for i in range(s, min(n, s + per_block)))
            ]
            yield from ep.run(batches, spectral)

    return summarize_eval(results())


def plan_eval(gpu, cfg, batch: int, T: int, batches: int, budget: int | None, dtype: str = "f32"):
    """The `gpumem.TrunkPlan` of eval over `batches` batches of `batch` windows of T tokens: blocks of whole
    batches, counted by building the trunk and its `EvalPass` on a `gpumem.DryGpu`."""
    from ddl_wgpu.engine import gpumem

    S = k_delta.stats_size(cfg.ddl_dv) if cfg.residual == "delta" else 0

    def build(dry, streamed: bool, block: int) -> None:
        EvalPass(Trunk(dry, cfg, None, dtype, streamed), batch, T, block // batch)
        down = max(block, batch * T * max(S, 1)) * F32  # the largest download: the sums, or a batch's stats
        dry.reserve_staging(down)

    def trunk_bytes(streamed: bool, block: int) -> int:
        return gpumem.dry_bytes(gpu, lambda dry: build(dry, streamed, block))

    def weight_bytes(streamed: bool) -> int:
        return gpumem.dry_bytes(gpu, lambda dry: Trunk(dry, cfg, None, dtype, streamed).weights)

    return gpumem.plan_trunk("eval", batches * batch, T, budget, trunk_bytes, weight_bytes, multiple=batch,
                             dtype=dtype)  # fmt: skip


def evaluate_file(path, cfg, dataset, device: str | None, budget: int | None, verify: bool = True,
                  say=None) -> tuple[dict, object]:  # fmt: skip
    """`evaluate` of the model in file `path` (config `cfg`; its tensors read from the file as the trunk needs
    them) by the plan for `budget` bytes (None: no budget), which `say(line)` is told first -> (the evaluation,
    the plan)."""
    from ddl_wgpu.backend import open_gpu
    from ddl_wgpu.engine.stream import WeightSource
    from ddl_wgpu.files.container import open_checkpoint

    gpu = open_gpu(device)
    plan = plan_eval(gpu, cfg, dataset.batch_size, dataset.seq_len, dataset.num_batches, budget)
    if say is not None:
        say(plan.line())
    with open_checkpoint(path, verify=verify) as ck:
        trunk = Trunk(gpu, cfg, WeightSource(checkpoint=ck), "f32", plan.streamed)
        try:
            return evaluate(trunk, dataset, plan.block // dataset.batch_size, spectral=True), plan
        finally:
            trunk.release()
