"""`--backend ref`: the numpy reference behind the engine's interface.

`RefNet` / `RefWork` mirror `net.Net` / `trunk.TrunkWork` (load, export, snapshot/restore, step, loss_sum),
so training, evaluation and healing run unchanged on either backend, and tests compare the two step by
step. `RefTeacher` / `RefDraft` are heal's trunk and draft (`backend.Teacher`, `backend.Draft`), and
`ref_runner` accept's draft step; `RefEngine` is generate's decoding engine (`backend.Engine`, over the
caches of `ddl_ref.decode`). Arithmetic is float32 numpy through `ddl_ref`; nothing here is fast, all of
it is readable. Nothing here imports wgpu.

The BLAS under numpy runs on one thread once a command has chosen this backend (`one_blas_thread`), so that
the same job gives the same bits wherever it runs: in a terminal, under `make` (OPENBLAS_NUM_THREADS=1), in a
worker process or in a Ray task (Ray sets OMP_NUM_THREADS=1).
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from ddl_ref import blocks as ref_blocks
from ddl_ref import decode as ref_decode
from ddl_ref import eagle3 as ref_eagle3
from ddl_ref import model as ref_model
from ddl_ref import mtp as ref_mtp
from ddl_ref import ops as ref_ops
from ddl_ref.blocks import head_name
from ddl_ref.config import ModelConfig
from ddl_ref.optim import adamw_step, clip_multiplier, clip_multipliers, global_grad_norm
from ddl_ref.params import init_params, param_table, trainable_names
from ddl_wgpu.engine.layout import EMBED
from ddl_wgpu.engine.step import DRAFT_ADAM, DRAFT_GRAD_CLIP, AdamW, Eagle3Batch, StepResult

if TYPE_CHECKING:
    from ddl_wgpu.files.modelfile import Model


F32_MAX = float(np.finfo(np.float32).max)


def one_blas_thread() -> None:
    """Run this process's BLAS (numpy's matrix products) on one thread from now on, whatever the environment
    says (OPENBLAS_NUM_THREADS, OMP_NUM_THREADS, the number of cores). OpenBLAS takes another path through a
    product, which sums in another order, when its thread count differs: its x86 kernels without AVX-512
    (Haswell, Zen) do at most of the tiny preset's shapes, so a sweep's job gave other bits in a Ray task
    (one thread) than in the driver (one per core). One thread is also the fastest at the shapes this
    backend trains (the Makefile's note). Done through threadpoolctl; without it the process's setting stays."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return
    threadpool_limits(1, user_api="blas")


class RefNet:
    def __init__(
        self,
        cfg: ModelConfig,
        params: dict | None = None,
        seed: int = 0,
        trainable=None,
        mtp_weight: float = 0.0,
    ):
        self.cfg = cfg
        self.mtp_weight = float(mtp_weight)  # joint MTP training (cfg.mtp set): the draft loss's weight
        self.table = param_table(cfg)
        self.trainable = trainable_names([s.name for s in self.table], trainable)
        self.load(params if params is not None else init_params(cfg, seed))
        self._works: dict = {}

    def load(self, params: dict):
        self.params = {s.name: np.array(params[s.name], np.float32) for s in self.table}
        self.state = {
            "m": {n: np.zeros_like(p) for n, p in self.params.items()},
            "v": {n: np.zeros_like(p) for n, p in self.params.items()},
        }
        self._grads = {n: np.zeros_like(p) for n, p in self.params.items()}

    @property
    def num_params(self) -> int:
        return sum(int(p.size) for p in self.params.values())

    def export(self) -> dict:
        return {n: p.copy() for n, p in self.params.items()}

    def grads(self) -> dict:
        return {n: g.copy() for n, g in self._grads.items()}

    def moments(self):
        return copy.deepcopy(self.state["m"]), copy.deepcopy(self.state["v"])

    def load_moments(self, m: dict, v: dict):
        self.state = {
            "m": {n: np.array(m[n], np.float32) for n in self.params},
            "v": {n: np.array(v[n], np.float32) for n in self.params},
        }

    def snapshot(self):
        return self.export()

    def export_snapshot(self, snap) -> dict:
        return {n: p.copy() for n, p in snap.items()}

    def restore(self, snap):
        for n, p in snap.items():
            self.params[n][...] = p

    def work(self, batch: int, seq: int) -> RefWork:
        if (batch, seq) not in self._works:
            self._works[(batch, seq)] = RefWork(self, batch, seq)
        return self._works[(batch, seq)]


class RefWork:
    def __init__(self, net: RefNet, batch: int, seq: int):
        self.net, self.B, self.T = net, batch, seq

    def step(self, ids, lengths=None, update: AdamW | None = None) -> StepResult:
        net = self.net
        w = net.mtp_weight if net.cfg.mtp is not None else None
        _logits, loss, cache = ref_model.forward(net.params, net.cfg, ids, lengths, mtp_weight=w)
        count = int(cache["loss"][1])
        parts = (
            {"loss_main": float(cache["loss_main"]), "loss_mtp": float(cache["loss_mtp"])}
            if w is not None
            else {}
        )
        # mixed precision: the gradient of S * loss (S = update.loss_scale, a power of two), checked for
        # overflow as the engine checks it (every element finite, and the sum of squares within f32, which
        # the engine sums in f32), then unscaled: g / S is exact, so the update is the unscaled run's
        scale = update.loss_scale if update is not None else 1.0
        grads = ref_model.backward(net.params, net.cfg, cache, dloss=scale)
        scaled = {n: np.asarray(g, np.float32) for n, g in grads.items()}
        finite = bool(np.isfinite(loss)) and all(np.isfinite(g).all() for g in scaled.values())
        if update is not None and finite:
            finite = global_grad_norm({n: scaled[n] for n in net.trainable}) ** 2 <= F32_MAX
        net._grads = scaled if scale == 1.0 else {n: g / np.float32(scale) for n, g in scaled.items()}
        norm = float("nan")
        if update is not None:
            tg = {n: net._grads[n] for n in net.trainable}
            norm = global_grad_norm(tg)
            if finite:
                mult = clip_multipliers(tg, update.grad_clip, update.grad_clip_mode)
                adamw_step(
                    net.params,
                    net._grads,
                    net.state,
                    update.lr,
                    update.step,
                    update.beta1,
                    update.beta2,
                    update.eps,
                    update.weight_decay,
                    mult,
                    trainable=net.trainable,
                )
        return StepResult(loss=float(loss), count=count, grad_norm=norm, finite=finite, **parts)

    def loss_sum(self, ids, lengths=None) -> tuple[float, int]:
        _logits, loss, cache = ref_model.forward(self.net.params, self.net.cfg, ids, lengths)
        count = int(cache["loss"][1])
        return float(loss) * count, count

    def spectral(self, ids, lengths=None) -> dict | None:
        """The spectral snapshot of one forward (None for a baseline model)."""
        if self.net.cfg.residual != "delta":
            return None
        cache = ref_model.forward(self.net.params, self.net.cfg, ids, lengths, spectral=True)[2]
        return cache["spectral"]

    def eval_batch(self, ids, lengths=None, spectral: bool = False) -> tuple[float, int, dict | None]:
        """The loss sum, the prediction count and, with `spectral`, the snapshot (the engine's interface; the
        reference keeps them as two readable forwards)."""
        total, count = self.loss_sum(ids, lengths)
        return total, count, (self.spectral(ids, lengths) if spectral else None)

    def logits(self, ids) -> np.ndarray:
        return ref_model.forward(self.net.params, self.net.cfg, ids)[0]


# ----------------------------------------------------------------------------------------------------------
# heal and accept: the frozen trunk, the draft trained alone, the draft's greedy step


class RefTeacher:
    """The trunk in numpy (`ddl_ref.mtp.trunk_topk_hidden`)."""

    def __init__(self, params: dict, cfg: ModelConfig):
        self.params, self.cfg = params, cfg

    def topk_hidden(self, ids_batch, k: int):
        return ref_mtp.trunk_topk_hidden(self.params, self.cfg, ids_batch, k)

    def topk_rows(self, ids_batch, lengths, k: int):
        """-> (top_ids, top_probs, the draft's step-1 block input rows (b, T, C) float32)
        (`ddl_ref.mtp.step_input`)."""
        ids = np.asarray(ids_batch)
        top_ids, top_probs, pre, post = self.topk_hidden(ids, k)
        hid = np.asarray(ref_mtp.pick_hidden(pre, post, self.cfg.mtp.trunk_hidden), np.float32)
        valid = ref_mtp.step_valid(lengths, ids.shape[1], 1)
        x = ref_mtp.step_input(self.params, self.cfg, ref_mtp.shifted(ids, 1), hid, valid)
        return top_ids, top_probs, x

    def release(self) -> None:
        """Nothing to free (the GPU trunk frees its blocks' weights here)."""


class RefDraft:
    """The draft block + final norm in numpy float32, trained with Adam (`step.DRAFT_ADAM`, no weight decay,
    the gradient scaled to a global norm <= `step.DRAFT_GRAD_CLIP`); everything else frozen. `kl_form`: the
    top-k KL's form (`ddl_ref.ops.KL_FORMS`)."""

    def __init__(self, params: dict, cfg: ModelConfig, init: dict | None = None, kl_form: str = "full"):
        if kl_form not in ref_ops.KL_FORMS:
            raise ValueError(f"kl form must be one of {list(ref_ops.KL_FORMS)}, got {kl_form!r}")
        self.cfg, self.kl_form = cfg, kl_form
        names = ref_mtp.trained_names(params)
        src = init if init is not None else params
        self.params = {n: np.array(src[n], np.float32) for n in names}
        head = ref_mtp.head_weight(params, cfg)
        self.shared = {head_name(cfg): head}
        # the frozen input projection and embedding the next chain step's rows are built from (`next_rows`)
        self.inputs = {n: params[n] for n in (EMBED, ref_mtp.ENORM, ref_mtp.HNORM, ref_mtp.EH_PROJ)}
        self.state: dict = {"m": {}, "v": {}}

    def _all(self) -> dict:
        return {**self.shared, **self.params}

    def step(self, x_rows, teacher_ids, teacher_probs, weights, lr, step, grad_scale, chain: int = 0):
        weights = np.asarray(weights, np.float32)
        count = max(float(weights.sum()), 1.0)
        p = self._all()
        with np.errstate(all="ignore"):
            kl, cache = ref_mtp.draft_kl_forward(p, self.cfg, np.asarray(x_rows, np.float32), teacher_ids,
                                                 teacher_probs, weights, chain, self.kl_form)  # fmt: skip
            loss = kl / count
            # gradient of grad_scale * loss, unscaled again (the engine's f16 loss scaling; exact in f32)
            _dx, grads = ref_mtp.draft_kl_backward(p, self.cfg, cache, dloss=float(grad_scale) / count)
            grads = {n: g / np.float32(grad_scale) for n, g in grads.items()}
            norm = global_grad_norm(grads)
        finite = math.isfinite(loss) and math.isfinite(norm)
        if finite:
            adamw_step(self.params, grads, self.state, lr, step, *DRAFT_ADAM, weight_decay=0.0,
                       grad_multiplier=clip_multiplier(norm, DRAFT_GRAD_CLIP))  # fmt: skip
        # gradients are not kept between steps: a skipped step leaves nothing behind ("zeroed")
        return float(loss), float(norm), bool(finite)

    def _kl(self, x_rows, teacher_ids, teacher_probs, weights, chain: int):
        return ref_mtp.draft_kl_forward(self._all(), self.cfg, np.asarray(x_rows, np.float32), teacher_ids,
                                        teacher_probs, np.asarray(weights, np.float32), chain,
                                        self.kl_form)  # fmt: skip

    def loss_sum(self, x_rows, teacher_ids, teacher_probs, weights, chain: int = 0) -> float:
        return float(self._kl(x_rows, teacher_ids, teacher_probs, weights, chain)[0])

    def loss_sum_next(self, x_rows, teacher_ids, teacher_probs, weights, next_tokens, valid, chain: int = 0):
        """`loss_sum` and `next_rows` from one forward -> (loss sum, the next chain step's rows)."""
        kl, cache = self._kl(x_rows, teacher_ids, teacher_probs, weights, chain)
        return float(kl), self._rows(cache["pre"], cache["post"], next_tokens, valid)

    def loss_chain(self, x_rows, steps, stacked: bool) -> list[float]:
        """heal's held-out evaluation of one batch right after a refresh: step 1 on x_rows (b, T, C), step
        j + 1 on the rows built from step j's forward (`loss_sum_next`) rounded to float16, as heal's host cache
        holds rows (`stacked`: on the rows of steps 1..j of each window). steps[j − 1] = (teacher ids, teacher
        probs, weights, next) of step j, next = (tokens, valid) of step j + 1 (None at the last) -> [the KL
        sum of step j]. The GPU draft keeps the rows on the GPU (`heal_gpu.WgpuDraft.loss_chain`)."""
        xs, out = [np.asarray(x_rows, np.float32)], []
        for j, (tid, tp, w, nxt) in enumerate(steps, 1):
            chain = j if stacked and j > 1 else 0
            x = np.concatenate(xs, axis=1) if chain else xs[-1]
            if nxt is None:
                out.append(self.loss_sum(x, tid, tp, w, chain))
                continue
            loss, rows = self.loss_sum_next(x, tid, tp, w, *nxt, chain=chain)
            out.append(loss)
            xs.append(np.asarray(rows).astype(np.float16).astype(np.float32))
        return out

    def loss_chains(self, batches, stacked: bool) -> list[list[float]]:
        """`loss_chain` of each (x_rows, steps) of `batches`."""
        return [self.loss_chain(x, steps, stacked) for x, steps in batches]

    def hidden_out(self, x_rows, chain: int = 0):
        pre, post, _ = ref_mtp.draft_forward(self._all(), self.cfg, np.asarray(x_rows, np.float32), chain)
        return pre, post

    def next_rows(self, x_rows, next_tokens, valid, chain: int = 0):
        """The block input rows of the next chain step from this draft's output on x_rows (with `chain`, the
        output's last step, whose rows alone the block's MLP runs on): `ddl_ref.mtp.step_input` of the tokens
        (b, T) on the `chain_hidden` rows."""
        x = np.asarray(x_rows, np.float32)
        pre, post, _ = ref_mtp.draft_forward(self._all(), self.cfg, x, chain, last_only=True)
        return self._rows(pre, post, next_tokens, valid)

    def _rows(self, pre, post, next_tokens, valid):
        T = np.shape(next_tokens)[1]
        hid = ref_mtp.pick_hidden(pre[:, -T:], post[:, -T:], self.cfg.mtp.chain_hidden)
        return ref_mtp.step_input(self.inputs, self.cfg, next_tokens, np.asarray(hid, np.float32), valid)

    def snapshot(self):
        return {n: p.copy() for n, p in self.params.items()}

    def restore(self, snap) -> None:
        for n, p in snap.items():
            self.params[n][...] = p

    def prepare(self, T: int, k: int, chain: int, stacked: bool) -> None:
        """Nothing: host memory is allocated as heal goes (the GPU draft allocates its phase up front)."""

    @contextlib.contextmanager
    def using(self, snap):
        """Within the block the draft's forwards run on the weights `snap` (heal's lazy refresh); the trained
        weights, untouched, are back after it."""
        own, self.params = self.params, snap
        try:
            yield
        finally:
            self.params = own

    def export(self) -> dict:
        return {n: p.copy() for n, p in self.params.items()}


def ref_runner(params: dict, cfg):
    """The numpy draft step for `accept.greedy_chain`: runner(x_rows, chain=0) -> (argmax, pre, post), all
    rows, on the weights in `params` as given (no float32 copy: the measurement reads them as stored)."""

    def run(x_rows, chain: int = 0):
        pre, post, _ = ref_mtp.draft_forward(params, cfg, x_rows, chain)
        return np.argmax(ref_mtp.draft_logits(params, cfg, post), axis=-1), pre, post

    return run


class RefEngine:
    """`backend.Engine` over `ddl_ref.decode` (float32 numpy): trunk and draft caches, the trunk's hidden rows
    and the tokens by position for the draft's catch-up rows. Every trunk decodes here, hybrids included; on a
    hybrid, `rollback` goes back only into the last `feed`'s rows or to 0 (`ddl_ref.decode.TrunkCache`)."""

    backend = "ref"

    def __init__(self, model: Model, depth: int = 0, capacity: int | None = None):
        self.params, self.cfg = model.params, model.cfg
        cap = self.cfg.max_seq_len if capacity is None else int(capacity)
        self.trunk = ref_decode.TrunkCache(self.cfg, cap)
        self.dcache = ref_decode.DraftCache(self.cfg, cap + depth) if depth else None
        self.hidden = np.zeros((cap, self.cfg.d_model), np.float32) if depth else None
        self.ids = np.zeros(cap + 1, np.int64)

    @property
    def length(self) -> int:
        return self.trunk.length

    def feed(self, ids, head: str, last_only: bool = False, ahead: bool = False) -> np.ndarray:
        start = self.trunk.length  # `ahead` is a GPU engine's hint: numpy has nothing to run ahead
        ids = np.asarray(ids, np.int64)
        pre, post, logits = ref_decode.trunk_step(self.params, self.cfg, self.trunk, ids)
        self.ids[start : start + ids.size] = ids
        if self.hidden is not None:
            self.hidden[start : start + ids.size] = ref_mtp.pick_hidden(pre, post, self.cfg.mtp.trunk_hidden)
        logits = logits[-1:] if last_only else logits
        return np.argmax(logits, axis=-1) if head == "argmax" else logits

    def rollback(self, length: int) -> None:
        self.trunk.rollback(length)
        if self.dcache is not None and self.dcache.length > length:
            self.dcache.rollback(length)

    def draft(self, token: int, depth: int, head: str, pick: Callable | None):
        """Draft `depth` tokens after `token` (the next, not yet fed token) -> (tokens, logits per step)."""
        n, dc = self.trunk.length, self.dcache
        self.ids[n] = token
        a = dc.length  # catch-up: step-1 rows for anchors a..n−1
        pre, post, logits = ref_decode.draft_step(self.params, self.cfg, dc, self.ids[a + 1 : n + 1],
                                                  self.hidden[a:n], np.arange(a, n))  # fmt: skip
        tokens, rows = [], []
        for sigma in range(1, depth + 1):
            rows.append(logits[-1])
            tokens.append(int(np.argmax(logits[-1])) if head == "argmax" else pick(logits[-1]))
            if sigma < depth:
                hid = ref_mtp.pick_hidden(pre, post, self.cfg.mtp.chain_hidden)[-1:]
                pre, post, logits = ref_decode.draft_step(self.params, self.cfg, dc, tokens[-1:], hid,
                                                          [n + sigma - 1])  # fmt: skip
        dc.rollback(n)  # the chain rows go; the step-1 rows of anchors 0..n−1 stay
        return tokens, rows

    def round(self, token: int, depth: int) -> tuple[list[int], np.ndarray]:
        """A greedy round: `depth` drafts after `token`, then the trunk over [token, drafts] -> (drafts, the
        argmax of every verify row)."""
        drafts, _ = self.draft(token, depth, "argmax", None)
        return drafts, self.feed([token, *drafts], "argmax")


# ----------------------------------------------------------------------------------------------------------
# EAGLE-3 drafts (`ddl_ref.eagle3`): the target's aux rows and logits, the draft trained alone, decoding


def aux_logits(params: dict, cfg: ModelConfig, ids, aux_layers) -> tuple[np.ndarray, np.ndarray]:
    """The target over ids (B, T) -> (its residual stream at the inputs of `aux_layers`, concatenated (B, T, 3C),
    its logits (B, T, V)), float32 (`ddl_ref.blocks.trunk_forward`'s taps)."""
    _pre, post, cache = ref_blocks.trunk_forward(params, cfg, np.asarray(ids), taps=tuple(aux_layers))
    logits = ref_ops.linear_forward(post, ref_mtp.head_weight(params, cfg))
    return np.concatenate(cache["taps"], axis=-1).astype(np.float32), np.asarray(logits, np.float32)


class RefEagle3Target:
    """The numpy target of an EAGLE-3 draft (`backend.Eagle3Target`): ids (B, T) -> `Eagle3Batch` of its aux rows
    and full argmax, and its teacher: the full logits (k = 0) or the top-k over the draft vocabulary
    (`ddl_ref.eagle3.teacher_topk`, the GPU teacher's form)."""

    def __init__(self, model: Model, aux_layers, d2t=None, t2d=None, k: int = 0):
        self.model, self.aux_layers, self.k = model, tuple(aux_layers), int(k)
        self.d2t, self.t2d = d2t, t2d
        if self.k and (d2t is None or t2d is None):
            raise ValueError("a top-k teacher needs the draft vocabulary (d2t, t2d)")

    def __call__(self, ids) -> Eagle3Batch:
        aux, logits = aux_logits(self.model.params, self.model.cfg, ids, self.aux_layers)
        greedy = np.argmax(logits, axis=-1)
        if not self.k:
            return Eagle3Batch(aux, greedy, logits)
        t_ids, t_probs, in_draft = ref_eagle3.teacher_topk(logits, self.d2t, self.t2d, self.k)
        return Eagle3Batch(aux, greedy, None, t_ids, t_probs, in_draft)


class RefEagle3Draft:
    """An EAGLE-3 draft in numpy float32 (`backend.Eagle3Draft`), trained alone by SpecForge's unrolled TTT
    loss (`ddl_ref.eagle3.ttt_forward`/`ttt_backward`) with AdamW (`ddl_ref.optim.adamw_step`; the gradient
    scaled to a global norm <= `clip`); the target's embedding frozen and shared."""

    def __init__(self, params: dict, cfg, embed, d2t, t2d, adam=(0.9, 0.999, 1e-8), weight_decay: float = 0.0,
                 clip: float = 0.5):  # fmt: skip
        self.cfg = cfg
        self.params = {n: np.array(p, np.float32) for n, p in params.items()}
        self.embed = np.asarray(embed, np.float32)
        self.d2t, self.t2d = np.asarray(d2t, np.int64), np.asarray(t2d, bool)
        self.adam, self.weight_decay, self.clip = adam, float(weight_decay), float(clip)
        self.state: dict = {"m": {}, "v": {}}

    def _forward(self, batch: Eagle3Batch, ids, loss_mask):
        return ref_eagle3.ttt_forward(self.params, self.cfg, batch.aux, ids, self.embed, batch.logits, self.d2t,
                                      self.t2d, loss_mask=loss_mask, teacher=batch.teacher)  # fmt: skip

    def step(self, batch: Eagle3Batch, ids, loss_mask, lr: float, step: int) -> tuple[float, float, bool]:
        """Forward, backward and (when finite) one AdamW update -> (loss, grad_norm, finite)."""
        with np.errstate(all="ignore"):
            loss, cache = self._forward(batch, ids, loss_mask)
            grads = ref_eagle3.ttt_backward(self.params, self.cfg, cache)
            norm = global_grad_norm(grads)
        finite = math.isfinite(loss) and math.isfinite(norm)
        if finite:
            adamw_step(self.params, grads, self.state, lr, step, *self.adam, weight_decay=self.weight_decay,
                       grad_multiplier=clip_multiplier(norm, self.clip))  # fmt: skip
        return float(loss), float(norm), bool(finite)

    def losses(self, batch: Eagle3Batch, ids, loss_mask) -> tuple[float, list[float]]:
        """The TTT loss and each unroll step's loss (unweighted), without a gradient."""
        loss, cache = self._forward(batch, ids, loss_mask)
        return float(loss), [float(v) for v in cache["step_losses"]]

    def greedy_chain(self, batch: Eagle3Batch, ids, depth: int) -> np.ndarray:
        """-> (B, depth, T) the draft's greedy target ids at every anchor (`ddl_ref.eagle3.ttt_greedy`)."""
        return ref_eagle3.ttt_greedy(self.params, self.cfg, batch.aux, ids, self.embed, self.d2t, depth)

    def snapshot(self):
        return {n: p.copy() for n, p in self.params.items()}

    def restore(self, snap) -> None:
        for n, p in snap.items():
            self.params[n][...] = p

    def export(self) -> dict:
        return self.snapshot()

    def moments(self) -> tuple[dict, dict]:
        return (
            {n: a.copy() for n, a in self.state["m"].items()},
            {n: a.copy() for n, a in self.state["v"].items()},
        )

    def load_moments(self, m: dict, v: dict) -> None:
        self.state = {"m": {n: np.array(a, np.float32) for n, a in m.items()},
                      "v": {n: np.array(a, np.float32) for n, a in v.items()}}  # fmt: skip


class RefEagle3Engine(RefEngine):
    """`backend.Engine` with an EAGLE-3 draft (float32 numpy): the trunk's cache taps its aux rows at every fed
    position; the draft keeps the keys and values of its step-1 rows (anchor a: token x_{a+1}, fc(aux_a),
    position a) and drafts as vLLM's proposer does (`ddl_ref.eagle3.propose`), one row per later step."""

    def __init__(self, model: Model, draft, depth: int = 0, capacity: int | None = None):
        super().__init__(model, 0, capacity)
        self.d, self.dcfg = draft, draft.cfg
        self.dparams = {n: np.asarray(p, np.float32) for n, p in draft.params.items()}
        cap = self.trunk.capacity
        self.aux = np.zeros((cap, 3 * self.cfg.d_model), np.float32)
        K, D = self.dcfg.n_kv_heads, self.dcfg.head_dim
        self.k = np.zeros((1, cap + depth, K, D), np.float32)
        self.v = np.zeros((1, cap + depth, K, D), np.float32)
        self.drafted = 0  # anchors whose step-1 keys are cached
        self.tmap = ref_eagle3.target_ids(draft.d2t)
        self.embed = np.asarray(self.params[EMBED], np.float32)

    def feed(self, ids, head: str, last_only: bool = False, ahead: bool = False) -> np.ndarray:
        start = self.trunk.length
        ids = np.asarray(ids, np.int64)
        _pre, _post, logits = ref_decode.trunk_step(
            self.params, self.cfg, self.trunk, ids, self.dcfg.aux_layers
        )
        self.ids[start : start + ids.size] = ids
        self.aux[start : start + ids.size] = np.concatenate(self.trunk.taps, axis=-1)
        logits = logits[-1:] if last_only else logits
        return np.argmax(logits, axis=-1) if head == "argmax" else logits

    def rollback(self, length: int) -> None:
        self.trunk.rollback(length)
        self.drafted = min(self.drafted, length)

    def _step(self, tokens, hidden, positions, start: int):
        """Draft rows at cache slots start.. over the cached keys before them -> (post, pre)."""
        n = len(tokens)
        mask = np.concatenate([np.ones((n, start), bool), np.tril(np.ones((n, n), bool))], axis=1)
        past = (self.k[:, :start], self.v[:, :start]) if start else None
        emb = self.embed[np.asarray(tokens, np.int64)][None]
        post, pre, (k, v), _ = ref_eagle3.step_forward(self.dparams, self.dcfg, emb, hidden, np.asarray(positions),
                                                       mask, past)  # fmt: skip
        self.k[:, start : start + n], self.v[:, start : start + n] = k, v
        return post, pre

    def draft(self, token: int, depth: int, head: str, pick: Callable | None):
        n = self.trunk.length
        self.ids[n] = token
        a = self.drafted  # catch-up: step-1 rows of anchors a..n−1
        hid = ref_ops.linear_forward(self.aux[a:n][None], self.dparams[ref_eagle3.FC])
        post, pre = self._step(self.ids[a + 1 : n + 1], hid, np.arange(a, n), a)
        self.drafted = n
        tokens, rows = [], []
        for j in range(depth):
            logits = ref_ops.linear_forward(post[0, -1], self.dparams[ref_eagle3.HEAD])
            full = np.full(self.cfg.vocab_size, -np.inf, np.float32)
            full[self.tmap] = logits  # vLLM's scatter into the target vocabulary
            rows.append(full)
            tokens.append(int(self.tmap[int(np.argmax(logits))]) if head == "argmax" else pick(full))
            if j < depth - 1:
                post, pre = self._step([tokens[-1]], pre[:, -1:], [n + j], n + j)
        return tokens, rows
