"""`heal`: retrain a model's MTP draft on its own trunk (self-distillation, as the reference heal
tool `mtp heal` does; docs/ describes it).

A draft stops agreeing with a trunk that was compressed or fine-tuned; the fix that works is training it on the
trunk's own predictions. The flow:

1. Windows (`heal_windows`, the reference heal tool's rule): every record cut into windows of `window` tokens
   (a record's short last window kept when it holds at least 16 + chain tokens, shorter ones skipped), records
   read until `tokens` tokens are in hand, the window that reaches the budget cut to fit. Windows are padded
   with the tokenizer's first EOS id (0 without one). Every tenth window (index % 10 == 9) is held out. Fewer
   than 10 x batch windows is an error.
2. The trunk runs once (`backend.Teacher.topk_rows`): per window its next-token top-k and the draft's step-1
   block input rows, built from its hidden rows (pre- or post-final-norm, per `MtpConfig.trunk_hidden`) where
   they are: on the GPU on wgpu (`heal_gpu.DraftInput`), so the hidden rows never come back to the host (the
   acceptance starts from the held-out windows' step-1 rows, kept in float32). On wgpu the windows go in blocks,
   the trunk resident or streamed layer by layer by the GPU memory plan (`gpumem`, `stream`), its tensors read
   from MODEL's file as it needs them; its blocks' weights are freed before the draft is built (the peak is the
   larger phase). The rows of every chain step stay in RAM, or past `host_memory` in a scratch file beside OUT
   (`hostmem`).
3. The draft is trained alone as a one-layer model (`backend.Draft`): its block `model.mtp.layers.0.*` and final
   norm `model.mtp.norm`, from `--init` weights when given, else the model's own. Trunk, embedding, head and the
   draft's input projection (enorm, hnorm, eh_proj) are frozen, as in the reference heal tool. Its FFN width
   (`HealConfig.draft_width`, `heal_files.fit_draft`): "model", the model's own FFN width (the starting draft narrowed by
   `compress.narrow_ffn`'s importance rule when wider), what vLLM and SGLang build a Qwen3.5 draft at; or "init",
   the starting draft's width (the reference heal tool's rule); by default the one the model's layout needs
   (`draft_layout.draft_width_for`).
4. Chained training: the block input of step 1 is `eh_proj·[enorm(E[x_{p+1}]); hnorm(h_p)]` from the trunk's
   hidden; step j > 1 reads the token x_{p+j} and the draft's own step j−1 output at row p (`chain_hidden`),
   rebuilt from the weights at every `refresh`-th step (`backend.Draft.next_rows`: on wgpu the draft's output
   rows never leave the GPU; every step's block inputs are kept on the host in float16). A refresh rebuilds
   only the refresh batches (`batch` training windows, or `batch` held-out ones: never a mix, so an evaluation
   rebuilds only held-out batches) that the coming period's jobs and evaluations read (`_HealJob.plan`), and
   any other one lazily from a copy of the weights when first read (`_Chain`), bit for bit the rows of a
   rebuild of every window. The target
   of step j at row p is the trunk's top-k at p + j. Loss: top-k KL (teacher renormalised over its k ids,
   `ddl_ref.ops.topk_kl_forward`), mean over rows.
5. One job = (train batch, chain step); every pass over the jobs reshuffles the same order array in place
   (Fisher-Yates, the reference's xorshift64 generator, `XorShift64`, continuing its state across passes).
   Learning rate: linear warm-up over the first 10 % of steps, then a cosine down to 0.1 x lr. Adam (0.9, 0.999,
   1e-8, no weight decay), gradient scaled to global norm <= 1. A non-finite loss or gradient zeroes the
   gradients, halves the loss scale and skips the step; the 20th such step aborts with `HealError`.
6. Every `eval_every` steps (and at the last) the held-out KL per chain step is measured; checkpoints rank by
   its mean; `patience` evaluations without a new best stop the run. The best weights are restored. An
   evaluation right after a refresh runs each held-out batch's chain steps in turn, each on rows built from
   the forward of the step before (`backend.Draft.loss_chain`; on wgpu those rows never leave the GPU).
7. OUT = MODEL with the trained tensors written back (in their stored dtype) and every other tensor copied byte
   for byte; `provenance.mtp_heal` (the reference's key; `heal_files.heal_record` also reads the older `heal_mtp`) records the run (acceptance before and after on the held-out windows).
   Written atomically by the container (a `.OUT.<pid>.<random>.partial` of its own, then a rename; removed on
   any failure).

Backends: `backend.make_teacher` and `backend.make_draft` build the trunk (`backend.Teacher`) and the draft
(`backend.Draft`) on the chosen backend: numpy (`refnet.RefTeacher`, `refnet.RefDraft`) or the GPU
(`heal_gpu.WgpuTeacher`, `heal_gpu.WgpuDraft`). Gradients are float32 on both, so the loss scale is carried
but never needed.

Chain attention (`HealConfig.chain_attention`; by default the one the draft's layout runs,
`draft_layout.chain_attention_for`: "stacked" for a Qwen3.5-layout draft, "per-step" otherwise): "per-step"
trains step j as its own pass whose rows attend causally to the other step-j rows of the window at positions
0..T−1, as the reference heal tool.
"stacked" reproduces the inference's "diagonal" mask: a step-j job stacks the block inputs of steps 1..j of
each window (j·T rows, row (σ−1)·T + p, step σ's rows the stored/refreshed step-σ inputs), row (j, p) attends
to the step-1 rows at positions <= p and to the same anchor's step-2..j rows, RoPE position p + σ − 1; the
top-k KL counts the step-j rows only (the others carry K/V and get gradients through attention). The refresh
builds step j's input from the step j−1 rows of the stacked forward of steps 1..j−1, and the held-out KL is
measured the same way. Step 1 is the same in both modes. The acceptance before/after (`accept`) is measured
with the same `chain_attention`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ddl_ref import mtp as ref_mtp
from ddl_ref.config import ModelConfig
from ddl_ref.ops import KL_FORMS
from ddl_wgpu.backend import (
    TRUNK_DTYPES,
    choose_backend,
    make_draft,
    make_teacher,
    open_gpu,
    plan_trunk,
    runtime_name,
)
from ddl_wgpu.data import DataError, check_vocab, load_records, make_windows, tokenizer_for
from ddl_wgpu.files.container import CheckpointError, open_checkpoint
from ddl_wgpu.files.hf.draft_layout import DRAFT_WIDTHS, chain_attention_for, draft_width_for
from ddl_wgpu.files.hostmem import HostArrays
from ddl_wgpu.files.modelfile import Model, load_config
from ddl_wgpu.jobs import accept as accept_mod
from ddl_wgpu.jobs import heal_files as files
from ddl_wgpu.jobs.accept import CHAIN_ATTENTION
from ddl_wgpu.jobs.heal_files import HealError
from ddl_wgpu.jobs.run import Best, Cadence, Events, LossScale, drive

LOSS_SCALE_START = 4096.0  # the reference heal tool's first loss scale; halved (to >= 1) per non-finite step
MAX_NONFINITE = 20  # the 20th non-finite step aborts
WARMUP_FRACTION = 0.1  # linear warm-up over the first 10 % of steps
MIN_LR_FRACTION = 0.1  # the cosine ends at 0.1 x lr
MIN_WINDOW = 16  # windows shorter than MIN_WINDOW + chain are skipped
HELD_OUT_EVERY = 10  # window i is held out when i % 10 == 9
XORSHIFT_START = 0x9E3779B97F4A7C15  # the reference heal tool's job-shuffle state
_U64 = (1 << 64) - 1


@dataclass(frozen=True)
class HealConfig:
    """Settings of one `heal` run; defaults are the reference heal tool's."""

    chain: int = 3  # chain steps trained (the runtime drafts 3-5 deep)
    refresh: int = 50  # steps between rebuilds of chain steps 2..chain from the current weights (0: never)
    tokens: int = 200_000  # token budget of all windows together
    window: int = 128  # window length in tokens (at most the model's max_seq_len)
    epochs: float = 1.0  # passes over the job list (train batch x chain step); fractional allowed
    lr: float = 5e-5  # peak learning rate, reached after the warm-up
    topk: int = 32  # width of the trunk's stored next-token distribution
    batch: int = 4  # windows per step
    eval_every: int = 50  # steps between held-out evaluations (also at the last step)
    patience: int = 3  # evaluations without a new best before stopping (0: never stop early)
    seed: int = 0  # job shuffle: 0 is the reference's xorshift state; another seed is xored into it
    trunk_dtype: str = "f32"  # the GPU trunk's big matrices: f32, or f16 (half the memory; needs shader-f16)
    # "per-step": step j causal over its own rows; "stacked"; None: the draft's layout's (`resolve`)
    chain_attention: str | None = None
    # the draft's FFN width: "model" (the model's), "init" (the starting draft's); None: the layout's (`resolve`)
    draft_width: str | None = None
    # the top-k KL: "full" (the reference heal tool's: the draft's full-vocabulary log-softmax against the
    # teacher's renormalised top-k) or "topk" (the draft renormalised over the k ids); `ddl_ref.ops.KL_FORMS`
    kl_form: str = "full"

    def __post_init__(self) -> None:
        if self.kl_form not in KL_FORMS:
            raise HealError(f"heal: kl_form must be one of {', '.join(KL_FORMS)}, got {self.kl_form!r}",
                            field="kl_form")  # fmt: skip
        if self.chain_attention is not None and self.chain_attention not in CHAIN_ATTENTION:
            raise HealError(f"heal: chain attention must be one of {', '.join(CHAIN_ATTENTION)}, "
                            f"got {self.chain_attention!r}", field="chain_attention")  # fmt: skip
        if self.draft_width is not None and self.draft_width not in DRAFT_WIDTHS:
            raise HealError(f"heal: draft width must be one of {', '.join(DRAFT_WIDTHS)}, got {self.draft_width!r}",
                            field="draft_width")  # fmt: skip
        if self.trunk_dtype not in TRUNK_DTYPES:
            raise HealError(
                f"heal: trunk_dtype must be one of {list(TRUNK_DTYPES)}, got {self.trunk_dtype!r}",
                field="trunk_dtype",
            )
        for name in ("chain", "tokens", "window", "topk", "batch", "eval_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise HealError(f"heal: {name} must be a positive integer, got {v!r}", field=name)
        for name in ("refresh", "patience", "seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise HealError(f"heal: {name} must be a non-negative integer, got {v!r}", field=name)
        for name in ("epochs", "lr"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not (math.isfinite(v) and v > 0):
                raise HealError(f"heal: {name} must be a positive number, got {v!r}", field=name)
        if self.window < MIN_WINDOW + self.chain:  # every window would be skipped (`heal_windows`)
            raise HealError(f"heal: a window holds at least {MIN_WINDOW} + chain tokens, and window {self.window} "
                            f"is shorter than {MIN_WINDOW} + {self.chain} (give a window of at least "
                            f"{MIN_WINDOW + self.chain}, or a shorter chain)", field="window")  # fmt: skip

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------------------------------------
# pieces


def lr_multiplier(done: int, total: int) -> float:
    """Step `done` (1-based) of `total`: linear warm-up over the first 10 %, then cosine from 1 to 0.1."""
    warm = max(int(total * WARMUP_FRACTION), 1)
    if done <= warm:
        return done / warm
    progress = min((done - warm) / max(total - warm, 1), 1.0)
    return MIN_LR_FRACTION + (1.0 - MIN_LR_FRACTION) * 0.5 * (1.0 + math.cos(math.pi * progress))


def split_heldout(n: int) -> tuple[list[int], list[int]]:
    """Window indices -> (train, held out): every tenth window (i % 10 == 9) is held out."""
    val = [i for i in range(n) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    return [i for i in range(n) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1], val


class XorShift64:
    """The reference heal tool's job shuffle: xorshift64 (shifts 13, 7, 17) from 0x9e3779b97f4a7c15 (xored
    with `seed`; seed 0 is the reference's state), Fisher-Yates from the last index down."""

    def __init__(self, seed: int = 0):
        self.state = (XORSHIFT_START ^ seed) & _U64 or XORSHIFT_START  # xorshift never leaves state 0

    def next(self) -> int:
        x = self.state
        x ^= (x << 13) & _U64
        x ^= x >> 7
        x ^= (x << 17) & _U64
        self.state = x
        return x

    def shuffle(self, order: list) -> None:
        for i in range(len(order) - 1, 0, -1):
            j = self.next() % (i + 1)
            order[i], order[j] = order[j], order[i]


def resolve(model_cfg: ModelConfig, cfg: HealConfig) -> tuple[HealConfig, dict]:
    """`cfg` with the defaults that follow the model's layout filled in (`draft_layout`) -> (the config, why:
    {"chain_attention": ..., "draft_width": ...}, "as given" for a value set by the caller, "default: REASON" for
    one filled in here). A caller that shows the resolved values first passes its own unresolved `cfg` to `heal`,
    so the report and the healed file's record say which values were defaulted."""
    why = {"chain_attention": "as given", "draft_width": "as given"}
    if cfg.chain_attention is None:
        mode, reason = chain_attention_for(model_cfg)
        cfg, why["chain_attention"] = dataclasses.replace(cfg, chain_attention=mode), f"default: {reason}"
    if cfg.draft_width is None:
        rule, reason = draft_width_for(model_cfg)
        cfg, why["draft_width"] = dataclasses.replace(cfg, draft_width=rule), f"default: {reason}"
    return cfg, why


def resolve_file(model_path, cfg: HealConfig) -> tuple[HealConfig, dict]:
    """`resolve` for the model file at `model_path` (its header only, as `heal` will read it)."""
    files.require_draft(model_path)
    try:
        with open_checkpoint(model_path) as ck:
            return resolve(load_config(ck, model_path), cfg)
    except CheckpointError as e:
        raise HealError(f"heal: {e}") from e


@dataclass
class _Cache:
    """The trunk's pass over all windows, on the host."""

    ids: np.ndarray  # (N, T) int64, padded with `pad_id` (the tokenizer's first EOS id; 0 without one)
    lengths: np.ndarray  # (N,)
    top_ids: np.ndarray  # (N, T, k) int32
    top_probs: np.ndarray  # (N, T, k) float32
    heldout_x: np.ndarray  # (held-out windows, T, C) float32: their step-1 block input rows (the acceptance)
    x: dict  # chain step j -> (N, T, C) float16 block input rows (step 1 from the trunk's pass)
    # (shape, dtype) -> a zero array for the rows of a chain step: in RAM or in heal's scratch file (`hostmem`)
    zeros: Callable = field(default=np.zeros)


# ----------------------------------------------------------------------------------------------------------
# heal


class _Chain:
    """The draft's block inputs per chain step over all windows (float16 on the host), built from the trunk's
    pass and rebuilt from the draft by `refresh`; `join` gives a training or evaluation job's arrays.

    Refresh batches, the grouping the draft's forwards run in, never mix training and held-out windows: the
    training windows in index order cut into runs of `batch` (the last run may be short), then the held-out
    windows likewise (`split_heldout`). A training job's batch (`_batches`: the same runs, a short last one
    dropped) is then exactly one refresh batch, and so is a held-out evaluation batch; with consecutive windows
    (the older grouping) nearly every refresh batch held a held-out window, so each evaluation rebuilt almost
    all of them. A refresh marks every refresh batch stale and rebuilds at once, from the current weights, those
    its `plan` names (what the period's jobs and evaluations will read, up to the chain step each needs); it
    keeps a copy of the weights in host memory (`Draft.snapshot`), from which `join` rebuilds any other stale
    batch its windows lie in when first asked (`Draft.using`: a job a non-finite step pushed past the plan, or
    a refresh without one). Every row is the one an eager rebuild of all windows at the refresh gives, bit for
    bit (same weights, same batches of windows, same order of chain steps; the tests compare the two), at the
    cost of the batches the jobs and evaluations of a period touch instead of all of them; and the GPU holds no
    copy of the weights for it (what the copy costs is a download per refresh).

    An evaluation right after a refresh (no draft step between: `fresh`) is the refresh's own forward: the
    draft's forward of chain step j's rows is both what step j's KL reads and what step j + 1's rows are built
    from. So the plan leaves such an evaluation's held-out batches stale and `heldout_kl` runs each batch's
    chain steps one after the other (`Draft.loss_chain`), one forward per batch and step instead of two; the
    rows are the same forward's on the same weights, rounded to float16 as the cache holds them, so the bits do
    not change. They are not kept (on the GPU they never leave it): the batches stay stale, and an evaluation
    later in the period reads rows the refresh built for it (`_HealJob.plan`)."""

    def __init__(self, model: Model, cfg: HealConfig, cache: _Cache, draft):
        self.model, self.mcfg, self.cache, self.draft = model, model.cfg, cache, draft
        self.chain, self.nb = cfg.chain, cfg.batch
        self.stacked_mode = cfg.chain_attention == "stacked"
        self.N, self.T = cache.ids.shape
        train, val = split_heldout(self.N)
        # refresh batch k's windows (index arrays): training windows first, then held-out ones, `nb` at a time
        self.members = _batches(train, self.nb, short=True) + _batches(val, self.nb, short=True)
        self.batches = len(self.members)  # refresh batches
        self.batch_of = np.zeros(self.N, np.int64)  # window -> its refresh batch
        for k, m in enumerate(self.members):
            self.batch_of[m] = k
        self.built = np.full(self.batches, self.chain)  # per refresh batch: chain steps 1..built are current
        self.weights = None  # the draft's weights at the last refresh
        self.forwards = 0  # refresh-batch forwards (draft forward + the next step's rows), all told
        self.period_forwards = 0  # ... since the last `refresh`
        self.fresh = False  # no draft step since the last refresh: the weights are the kept ones
        self.eval_built = 0  # rows of a chain step built by an evaluation's own forwards, all told

    def stacked(self, sel, j: int) -> np.ndarray:
        """Block inputs of steps 1..j of the windows `sel`, stacked along time -> (b, j·T, C) float32."""
        return np.concatenate([self.cache.x[s][sel] for s in range(1, j + 1)], axis=1).astype(np.float32)

    def _next_rows(self, sel: np.ndarray, j: int) -> np.ndarray:
        """Step j's block inputs of the windows `sel` (a refresh batch's index array) from the draft's step j−1
        output."""
        x = self.cache.x
        tok, valid = self._tok_valid(sel, j)
        self.forwards += 1
        self.period_forwards += 1
        if self.stacked_mode and j > 2:  # step j−1's rows of the stacked forward of steps 1..j−1
            return self.draft.next_rows(self.stacked(sel, j - 1), tok, valid, chain=j - 1)
        return self.draft.next_rows(x[j - 1][sel].astype(np.float32), tok, valid)

    def _tok_valid(self, sel, j: int) -> tuple:
        """Step j's tokens and valid rows of the windows `sel` (what its rows are built from)."""
        return ref_mtp.shifted(self.cache.ids[sel], j), ref_mtp.step_valid(self.cache.lengths[sel], self.T, j)

    def refresh(self, plan=()) -> int:
        """Chain steps 2..chain from the current draft's outputs: every refresh batch marked stale, those `plan`
        names ((windows, chain step) pairs) rebuilt now, the weights kept for the others -> the refresh-batch
        forwards run since the previous refresh."""
        if self.chain < 2:
            return 0
        self.weights = self.draft.snapshot()
        self.fresh = True
        self.built[:] = 1
        for j in range(
            2, self.chain + 1
        ):  # made at the first refresh, then rewritten in place (one region each)
            if j not in self.cache.x:
                self.cache.x[j] = self.cache.zeros((self.N, self.T, self.mcfg.d_model), np.float16)
        done, self.period_forwards = self.period_forwards, 0
        need: dict[int, int] = {}  # refresh batch -> the chain step the period reads it to
        for windows, j in plan:
            for k in np.unique(self.batch_of[np.asarray(windows)]):
                need[int(k)] = max(need.get(int(k), 1), min(int(j), self.chain))
        for j in sorted(set(need.values()) - {1}):  # each batch's rows independent of the others
            self._rebuild([k for k in sorted(need) if need[k] == j], j, None)
        return done

    def refresh_event(self, events: Events, step: int, plan=()) -> None:
        """`refresh`, then its event: `rebuilt` the refresh-batch forwards since the previous refresh (the ones
        the period's jobs and evaluations read), `batches` the refresh batches (a full rebuild is (chain − 1) x
        batches forwards); `lazy` is true (the event's schema from when an eager rebuild was an option)."""
        rebuilt = self.refresh(plan)
        if self.chain > 1:
            events("refresh", step=step, chain=self.chain, lazy=True, rebuilt=rebuilt, batches=self.batches)

    def _current(self, windows: np.ndarray, j: int) -> None:
        """Chain steps 2..j of the refresh batches holding `windows` rebuilt from the kept weights where stale
        (step by step, as an eager refresh of every batch orders them)."""
        stale = [k for k in np.unique(self.batch_of[np.asarray(windows)]) if self.built[k] < j]
        if not stale:
            return
        self._rebuild(stale, j, self.weights)

    def _rebuild(self, stale: list, j: int, weights) -> None:
        """Chain steps built + 1..j of the refresh batches `stale` from the kept `weights` (None: the current
        ones, at the refresh)."""
        x = self.cache.x
        with self.draft.using(weights) if weights is not None else contextlib.nullcontext():
            for k in stale:
                sel = self.members[k]
                for s in range(int(self.built[k]) + 1, j + 1):
                    x[s][sel] = self._next_rows(sel, s)
                self.built[k] = j

    def join(self, b: np.ndarray, j: int):
        """-> (x, teacher ids, teacher probs, weights, the trainer's chain keyword) of step j on windows b."""
        if j > 1:
            self._current(b, j)
        tid, tp, w, kw = self._targets(b, j)
        return (self.stacked(b, j) if kw else self.cache.x[j][b].astype(np.float32)), tid, tp, w, kw

    def _targets(self, b: np.ndarray, j: int):
        """-> (teacher ids, teacher probs, weights, the trainer's chain keyword) of step j on windows b."""
        c, T = self.cache, self.T
        tid = ref_mtp.shifted(c.top_ids[b], j)
        tp = ref_mtp.shifted(c.top_probs[b], j, fill=1.0)  # masked rows: any finite distribution
        w = ref_mtp.step_valid(c.lengths[b], T, j).astype(np.float32)
        if not self.stacked_mode or j == 1:  # step 1 is the same in both modes; no `chain` keyword
            return tid, tp, w, {}
        # stacked: steps 1..j stacked; only the step-j rows (the last T) carry the loss
        pad = (j - 1) * T
        tid = np.concatenate([np.zeros((len(b), pad, tid.shape[-1]), tid.dtype), tid], axis=1)
        tp = np.concatenate([np.ones((len(b), pad, tp.shape[-1]), tp.dtype), tp], axis=1)
        w = np.concatenate([np.zeros((len(b), pad), w.dtype), w], axis=1)
        return tid, tp, w, {"chain": j}

    def heldout_kl(self, batches: list[np.ndarray]) -> list[float]:
        """The draft's mean top-k KL to the trunk per chain step over the held-out batches. Right after a
        refresh (`fresh`) each stale batch runs its chain steps one after the other, each step's rows built
        from the forward of the one before (`Draft.loss_chains`, all such batches in one go); otherwise the
        stale held-out refresh batches are rebuilt first, in one go, from the kept weights."""
        fresh = self.fresh and self.chain > 1
        if batches and self.chain > 1 and not fresh:
            self._current(np.concatenate(batches), self.chain)
        chained = [i for i, b in enumerate(batches) if fresh and self._stale(b)]
        counts: dict = {}  # chained batch -> its weight sum per step, noted as its inputs are built

        def inputs():
            for i in chained:
                x1, steps = self._chain_inputs(batches[i])
                counts[i] = [float(w.sum()) for _tid, _tp, w, _next in steps]
                yield x1, steps

        got = dict(zip(chained, self.draft.loss_chains(inputs(), self.stacked_mode), strict=True))
        self.eval_built += (self.chain - 1) * len(chained)
        s, n = [0.0] * self.chain, [0.0] * self.chain
        for i, b in enumerate(batches):
            for j in range(1, self.chain + 1):  # each step's sums over the batches in order
                if i in got:
                    s[j - 1] += got[i][j - 1]
                    n[j - 1] += counts[i][j - 1]
                else:
                    x, tid, tp, w, c = self.join(b, j)
                    s[j - 1] += self.draft.loss_sum(x, tid, tp, w, **c)
                    n[j - 1] += float(w.sum())
        return [sj / max(nj, 1e-9) for sj, nj in zip(s, n, strict=True)]

    def _stale(self, b: np.ndarray) -> bool:
        """Whether held-out batch b is a whole refresh batch with only its step-1 rows current."""
        k = int(self.batch_of[b[0]])
        return self.built[k] == 1 and np.array_equal(self.members[k], b)

    def _chain_inputs(self, b: np.ndarray) -> tuple:
        """`Draft.loss_chain`'s (step-1 rows, steps) of held-out batch b; the later steps' rows are built from
        the forwards and not kept (the batch stays stale)."""
        steps = []
        for j in range(1, self.chain + 1):
            tid, tp, w, _kw = self._targets(b, j)
            steps.append((tid, tp, w, self._tok_valid(b, j + 1) if j < self.chain else None))
        return self.cache.x[1][b].astype(np.float32), steps


def heal_windows(records, window: int, chain: int, tokens: int) -> list[np.ndarray]:
    """The reference heal tool's windows: each record cut into chunks of `window` tokens; a chunk shorter
    than 16 + chain is skipped; the chunk that reaches the `tokens` budget is cut to fit and is the last."""
    return make_windows(records, window, min_len=MIN_WINDOW + chain, max_tokens=tokens, cut_min_len=1)


def _windows(model: Model, data_spec: str, cfg: HealConfig) -> list[np.ndarray]:
    """Records read until the windows hold `cfg.tokens` tokens or the corpus ends (the read doubles each
    time a read of that many tokens gave fewer window tokens: skipped short chunks)."""
    tok, cap = tokenizer_for(model.tokenizer), 2 * cfg.tokens
    try:
        while True:
            records = load_records(data_spec, tok, cap)
            wins = heal_windows(records, cfg.window, cfg.chain, cfg.tokens)
            if sum(w.size for w in wins) >= cfg.tokens or sum(r.size for r in records) < cap:
                break
            cap *= 2
        check_vocab(records, model.cfg.vocab_size)
    except DataError as e:
        raise HealError(f"heal: {e}") from e
    if len(wins) < HELD_OUT_EVERY * cfg.batch:
        raise HealError(f"heal: {len(wins)} windows in {data_spec}, need {HELD_OUT_EVERY * cfg.batch} (every "
                        f"tenth is held out; a window holds {MIN_WINDOW} + chain = {MIN_WINDOW + cfg.chain} to "
                        f"{cfg.window} tokens of one record)", kind="too_few_windows")  # fmt: skip
    return wins


def pad_id(model: Model) -> int:
    """The id windows are padded with: the tokenizer's first EOS id, 0 without one."""
    eos = (model.metadata or {}).get("hf.eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return int(eos) if isinstance(eos, int) and not isinstance(eos, bool) else 0


def _trunk_pass(teacher, wins: list[np.ndarray], mcfg: ModelConfig, k: int, nb: int, events: Events,
                pad: int = 0, keep: list[int] = (), zeros: Callable = np.zeros) -> _Cache:  # fmt: skip
    """The trunk once over every window, `nb` windows per pass: its top-k and the draft's step-1 block input
    rows (float16, in `zeros`' arrays; those of the windows in `keep`, the held-out ones, in that order, also in
    float32 for the acceptance)."""
    N, T, C = len(wins), max(w.size for w in wins), mcfg.d_model
    ids, lengths = accept_mod.pad_batch(wins, T, pad)
    cache = _Cache(ids, lengths, np.zeros((N, T, k), np.int32), np.zeros((N, T, k), np.float32),
                   np.zeros((len(keep), T, C), np.float32), {1: zeros((N, T, C), np.float16)}, zeros)  # fmt: skip
    slot = {w: i for i, w in enumerate(keep)}
    for s in range(0, N, nb):
        mine = [w for w in range(s, min(s + nb, N)) if w in slot]
        ti, tp, x = teacher.topk_rows(ids[s : s + nb], lengths[s : s + nb], k)
        cache.top_ids[s : s + nb], cache.top_probs[s : s + nb] = ti, tp
        cache.x[1][s : s + nb] = x
        for w in mine:
            cache.heldout_x[slot[w]] = x[w - s]
        events("trunk", done=min(s + nb, N), windows=N)
    return cache


class _HealJob:
    """The draft's training steps over shuffled (train batch, chain step) jobs; the `run.Job` of the loop.
    `refresh(0)` before the evaluation at step 0, then `start` with its result."""

    def __init__(self, chain: _Chain, cfg: HealConfig, train_batches, val_batches, events: Events):
        self.chain, self.cfg, self.events = chain, cfg, events
        self.val_batches = val_batches
        self.jobs = [(b, j) for b in train_batches for j in range(1, cfg.chain + 1)]
        self.total = max(math.ceil(cfg.epochs * len(self.jobs)), 1)
        self.order = self._job_order(XorShift64(cfg.seed))
        self.ahead: collections.deque = collections.deque()  # jobs drawn from `order` for a plan, not yet run
        self.scale = LossScale(LOSS_SCALE_START, MAX_NONFINITE)
        self.cadence = Cadence(cfg.eval_every, self.total)

    def start(self, best: Best, start_kl) -> None:
        """The evaluation at step 0 done: `best` its score and weights, `start_kl` its KL per chain step."""
        self.best = best
        self.history = [{"step": 0, "heldout_kl": start_kl, "mean": best.value}]
        self.best_per_step = start_kl  # the held-out KL per chain step at the best evaluation

    def refresh(self, n: int) -> None:
        """The refresh after step n (0: before the first), with what the period reads (`plan`)."""
        self.chain.refresh_event(self.events, n, self.plan(n))

    def plan(self, n: int) -> list:
        """What the period after the refresh at step n reads, as (windows, chain step) pairs: the jobs of its steps
        n + 1.. to the next refresh (after `refresh` steps) or the last step, and every held-out batch to the
        last chain step when an evaluation falls in it after n (at a due step before the next refresh's, or the
        last step); one at n itself builds its rows from its own forwards and keeps none (`_Chain.heldout_kl`).
        A non-finite step takes one job more than planned: `_Chain` rebuilds that job's rows from its copy of
        the weights."""
        cfg = self.cfg
        last = n + cfg.refresh if cfg.refresh > 0 and n + cfg.refresh < self.total else self.total
        while len(self.ahead) < last - n:
            self.ahead.append(next(self.order))
        reads = list(itertools.islice(self.ahead, last - n))
        # an evaluation at n itself follows this refresh with no step between: it builds the held-out rows
        # from its own forwards (and keeps none)
        evals = range(n + 1, last + 1 if last == self.total else last)
        if any(self.cadence.due(s) for s in evals):
            reads += [(b, cfg.chain) for b in self.val_batches]
        return reads

    def _next_job(self):
        return self.ahead.popleft() if self.ahead else next(self.order)

    def _job_order(self, rng: XorShift64):
        """The jobs, each pass over them after a reshuffle of the previous pass's order."""
        order = list(range(len(self.jobs)))
        while True:
            rng.shuffle(order)
            for oi in order:
                yield self.jobs[oi]

    def step(self, done: int) -> dict | None:
        b, j = self._next_job()
        x, tid, tp, w, c = self.chain.join(b, j)
        self.chain.fresh = False  # the weights move on from the kept ones
        lr = self.cfg.lr * lr_multiplier(done + 1, self.total)
        loss, gnorm, finite = self.chain.draft.step(x, tid, tp, w, lr, done + 1, self.scale.value, **c)
        if not (finite and math.isfinite(loss) and math.isfinite(gnorm)):
            last = self.scale.skip()
            self.events("skip", step=done + 1, skipped=self.scale.skipped, loss_scale=self.scale.value)
            if last:
                raise HealError(f"heal: {self.scale.skipped} non-finite steps (last loss {loss}, gradient norm "
                                f"{gnorm}) after {done} good ones: aborting, nothing written")  # fmt: skip
            return None
        n = done + 1
        if self.cfg.chain > 1 and self.cfg.refresh > 0 and n % self.cfg.refresh == 0 and n < self.total:
            self.refresh(n)
        return {"loss": loss, "lr": lr, "grad_norm": gnorm}

    def evaluate(self, done: int) -> float:
        v = self.chain.heldout_kl(self.val_batches)
        e = float(np.mean(v))
        self.history.append({"step": done, "heldout_kl": v, "mean": e})
        self.events("eval", step=done, heldout_kl=v, mean=e, best=min(self.best.value, e))
        if e < self.best.value:
            self.best_per_step = v
        return e

    def snapshot(self):
        return self.chain.draft.snapshot()

    def after_step(self, done: int) -> bool:
        return False


def _batches(windows: list[int], nb: int, short: bool = False) -> list[np.ndarray]:
    """`nb` windows of the list at a time: the jobs' batches (a short last one dropped) or, `short`, the
    refresh batches (`_Chain`: a short last one kept)."""
    end = len(windows) if short else len(windows) - nb + 1
    return [np.array(windows[s : s + nb]) for s in range(0, end, nb)]


def _inputs(model_path, init_path, cfg: HealConfig, verify: bool = True,
            lazy: bool = False) -> tuple[Model, dict | None, dict]:  # fmt: skip
    """The model (with a draft at the width `cfg.draft_width` gives; `lazy`: its draft's tensors only, `_load`)
    and the draft's starting weights from `init_path`, checked against `cfg` -> (model, init weights, the draft
    width record)."""
    files.require_draft(model_path)
    model = files.load(model_path, "model", verify, lazy)
    if model.cfg.mtp is None:  # tensors present but the config says no draft
        raise HealError(f"heal: {model_path} carries no MTP draft (config has no mtp; missing tensor "
                        "model.mtp.eh_proj.weight in its table)")  # fmt: skip
    if init_path is not None:
        files.require_draft(init_path, files.INIT_REQUIRED)
    model, init, width = files.fit_draft(model, init_path, resolve(model.cfg, cfg)[0].draft_width, verify)
    if init is not None:
        model = dataclasses.replace(model, params=collections.ChainMap(init, model.params))
    if cfg.window > model.cfg.max_seq_len:
        raise HealError(f"heal: window {cfg.window} exceeds the model's max_seq_len {model.cfg.max_seq_len}",
                        field="window")  # fmt: skip
    return model, init, width


def _heldout_acceptance(model: Model, cache: _Cache, val: list[int], draft, on_gpu: bool,
                        cfg: HealConfig) -> dict:  # fmt: skip
    """`accept`'s greedy acceptance of the current draft on the held-out windows, from the trunk's pass (their
    step-1 rows; on the GPU every later step's rows are built there, `accept.acceptance_from_rows`)."""
    vi = np.array(val)
    tb = accept_mod.TrunkBatch(cache.ids[vi], cache.lengths[vi], cache.top_ids[vi][..., 0], None, None,
                               cache.heldout_x)  # fmt: skip
    params = {**model.params, **draft.export()}
    return accept_mod.acceptance_from_rows(params, model.cfg, tb, cfg.chain, draft if on_gpu else None,
                                           cfg.chain_attention)  # fmt: skip


def heal(model_path, data_spec: str, out_path, cfg: HealConfig | None = None, init_path=None,
         backend: str = "ref", progress: Callable[[dict], None] | None = None,
         device: str | None = None, verify: bool = True, gpu_memory: int | None = None,
         host_memory: int | None = None) -> dict:  # fmt: skip
    """Retrain MODEL's draft on MODEL's trunk over `data_spec`; write OUT. -> the report (provenance.mtp_heal
    plus `out`, `history` of evaluations and `stopped`, and the GPU memory `plan`). Raises HealError with one
    line on bad input or abort. `gpu_memory` (bytes): the GPU budget the trunk's pass and the draft plan within
    (`gpumem`: the trunk resident or streamed layer by layer from MODEL's file); `host_memory` (bytes, default
    `hostmem.HOST_FRACTION` of the available memory): past it the draft's rows of every chain step live in a
    scratch file beside OUT (`hostmem.HostArrays`), removed however the run ends."""
    cfg = cfg if cfg is not None else HealConfig()
    with contextlib.ExitStack() as stack:
        host = stack.enter_context(HostArrays(out_path, host_memory))
        return _heal(model_path, data_spec, out_path, cfg, init_path, backend, Events(progress, "heal"), device,
                     verify, gpu_memory, host, stack)  # fmt: skip


def _heal(model_path, data_spec, out_path, cfg: HealConfig, init_path, backend: str, events: Events, device,
          verify: bool, gpu_memory: int | None, host: HostArrays, stack: contextlib.ExitStack) -> dict:  # fmt: skip
    backend = choose_backend(backend, device).name
    on_gpu = backend == "wgpu"
    model, init, width = _inputs(model_path, init_path, cfg, verify, lazy=on_gpu)
    cfg, why = resolve(model.cfg, cfg)
    mcfg = model.cfg
    wins = _windows(model, data_spec, cfg)
    total_tokens = int(sum(w.size for w in wins))
    kk = min(cfg.topk, mcfg.vocab_size)
    T = max(w.size for w in wins)
    plan = plan_trunk(backend, "heal", mcfg, device, cfg.trunk_dtype, len(wins), T, cfg.batch, gpu_memory, kk,
                      draft={"k": kk, "chain": cfg.chain, "stacked": cfg.chain_attention == "stacked",
                             "kl_form": cfg.kl_form})  # fmt: skip
    events("draft", **width, init=init_path is not None, chain_attention=cfg.chain_attention)
    events("windows", windows=len(wins), tokens=total_tokens, chain=cfg.chain, data=str(data_spec))
    if plan is not None:  # made before anything is said: a budget it refuses is one line
        events("plan", line=plan.line(), **plan.to_dict())
    # the draft's rows of every chain step: in RAM, or past --host-memory in the scratch file
    rows_bytes = cfg.chain * len(wins) * T * mcfg.d_model * 2
    in_ram = host.fits(rows_bytes)
    if not in_ram:  # the file and its whole size now: a full disk is one line before any work, not a SIGBUS
        host.reserve(rows_bytes)
        events("scratch", path=str(host.path), bytes=rows_bytes, budget=host.budget)

    def zeros(shape, dtype):
        return host.zeros(shape, dtype, in_ram)

    ck = stack.enter_context(open_checkpoint(model_path, verify=verify)) if on_gpu else None
    peaks = _PhasePeaks(open_gpu(device) if on_gpu else None)
    teacher = make_teacher(backend, model, cfg.batch, device, cfg.trunk_dtype, plan, ck)
    train, val = split_heldout(len(wins))
    nb = getattr(teacher, "block", cfg.batch)
    cache = _trunk_pass(teacher, wins, mcfg, kk, nb, events, pad_id(model), val, zeros)
    teacher.release()  # the trunk has run: its blocks' weights go before the draft trains (the peak is the larger)
    peaks.next("draft")
    draft = make_draft(backend, model, init, cfg.batch, device, cfg.kl_form, teacher)
    # all the draft's phase allocates, now (what the plan counted): nothing after this adds to the peak
    draft.prepare(T, kk, cfg.chain, cfg.chain_attention == "stacked")
    chain = _Chain(model, cfg, cache, draft)
    tb, vb = _batches(train, cfg.batch), _batches(val, cfg.batch)
    job = _HealJob(chain, cfg, tb, vb, events)
    job.refresh(0)

    acc_before = _heldout_acceptance(model, cache, val, draft, backend == "wgpu", cfg)
    v0 = chain.heldout_kl(vb)
    e0 = float(np.mean(v0))
    events("eval", step=0, heldout_kl=v0, mean=e0, best=e0)
    best = Best(e0, 0, draft.snapshot())
    job.start(best, v0)
    total = job.total
    stopped, done = drive(job, 0, job.cadence, best, events, cfg.patience)

    draft.restore(best.snapshot)
    trained = draft.export()
    acc_after = _heldout_acceptance(model, cache, val, draft, backend == "wgpu", cfg)
    record = {
        "data": str(data_spec),
        "tokens": total_tokens,
        "windows": len(wins),
        "heldout_windows": len(val),
        "steps": done,
        "total_steps": total,
        "best_step": best.step,
        "skipped_steps": job.scale.skipped,
        "stopped": stopped,
        "lr": float(cfg.lr),
        "topk": kk,
        "chain": cfg.chain,
        "heldout_kl_start": e0,
        "heldout_kl_best": best.value,
        "heldout_kl_per_step_start": v0,
        "heldout_kl_per_step_best": job.best_per_step,
        "init": None if init_path is None else os.fspath(init_path),
        "acceptance_before": acc_before,
        "acceptance_after": acc_after,
        "backend": backend,
        "runtime": runtime_name(backend, device),
        "trunk_dtype": cfg.trunk_dtype,
        "chain_attention": cfg.chain_attention,
        "chain_attention_why": why["chain_attention"],
        "draft_width": {**width, "why": why["draft_width"]},
        "config": cfg.to_dict(),
        "conventions": mcfg.mtp.to_dict(),
    }
    path = files.write_back(
        model_path, out_path, trained, files.PROVENANCE_KEY, record, mcfg.to_dict(), verify
    )
    events("written", out=os.fspath(path))
    # refresh_forwards: the draft forwards all refreshes ran (those the jobs and evaluations needed); the plan
    # and the scratch file are the run's, not the healed model's (its file is the same under any budget)
    return {
        **record,
        "out": os.fspath(path),
        "history": job.history,
        "refresh_forwards": chain.forwards,
        "eval_built_rows": chain.eval_built,  # chain steps evaluations built from their own forwards
        "plan": plan.to_dict() if plan is not None else None,
        "scratch_bytes": host.scratch_bytes,
        # the engine's own count: the most of its phases (trunk, draft), each beside the plan's estimate
        **peaks.report(),
    }


class _PhasePeaks:
    """The engine's own count of the GPU memory heal's phases peak at (`Gpu.peak` from the start of each, less
    what was alive before heal began): `next` ends a phase, `report` gives the most of all and each phase's."""

    def __init__(self, gpu):
        self.gpu, self.phase, self.done = gpu, "trunk", {}
        if gpu is not None:
            self.base = gpu.live
            gpu.reset_peak()

    def next(self, phase: str) -> None:
        if self.gpu is not None:
            self.done[self.phase] = self.gpu.peak - self.base
            self.gpu.reset_peak()
        self.phase = phase

    def report(self) -> dict:
        if self.gpu is None:
            return {"gpu_peak_bytes": None, "gpu_phase_peak_bytes": None}
        self.next(self.phase)
        return {"gpu_peak_bytes": max(self.done.values()), "gpu_phase_peak_bytes": dict(self.done)}
