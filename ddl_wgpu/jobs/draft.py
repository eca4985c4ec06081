"""`draft`: train a new EAGLE-3 draft for a target that ships none (docs/eagle3.md#training-a-draft).

The flow:

1. Windows: the data's records cut into windows of `seq_len` tokens (`data.make_windows`, at least ttt + 2
   tokens each) until `tokens` tokens are in hand, the window reaching the budget cut to fit (heal's count).
   Every tenth window (i % 10 == 9) is held out. With `regenerate`, each window is first replaced by the
   target's own greedy continuation: its first `prompt_len` tokens as the prompt, then `seq_len − prompt_len`
   tokens decoded by the numpy decoder (`refnet.RefEngine`, `generate.run`'s greedy loop).
2. The draft vocabulary (`ddl_ref.eagle3.draft_vocab`): the `draft_vocab` (capped at the target's V) most
   frequent tokens of the training windows under the loss mask (p < length − 1), SpecForge's rule.
3. The draft: `Eagle3Config` from the target (width, heads, head dim, SwiGLU width, RoPE theta, RMS eps; the
   aux layers `default_aux_layers(L)` unless given), fresh weights (`init_eagle3`, seeded), `lm_head` the
   target's head rows of the draft vocabulary (`head_from_target`) unless init is "random".
4. Training, online: each step runs the frozen target over a batch of windows (`backend.make_eagle3_target`:
   its residual stream at the inputs of the aux layers, its logits) and the draft's unrolled TTT loss and
   gradient (`ddl_ref.eagle3.ttt_forward`/`ttt_backward`, SpecForge's, `ttt` steps) with AdamW (0.9, 0.999,
   1e-8, no weight decay; the gradient scaled to a global norm <= 0.5). Step s trains batch s mod n of its
   epoch's order, a permutation drawn from a generator seeded with (seed, epoch), so a step depends only on
   its number and the weights: stopped and resumed, the run gives the same bits. Learning rate: linear warm-up
   over `warmup_steps` (default 10 % of the steps), then a cosine down to 0.1 × lr.
5. Every `eval_interval` steps and at the last, the held-out TTT loss over the first `eval_windows` held-out
   windows; at the last also the greedy acceptance on them at depth 3 (τ, as `accept` measures it).
6. OUT: the draft file (`files/eagle3file.py`) with the target's identity; `provenance.draft` the run.

Interrupting (Ctrl-C, or `stop_after` steps) writes the last whole step into the run file `OUT.run.ddlw`
(`run_path`: the weights, the AdamW moments, the vocabulary, the step, the settings, the target and data), and
`resume(run_file)` continues from it. The run file is removed once OUT is written.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ddl_ref import eagle3 as e3
from ddl_ref.blocks import head_name
from ddl_ref.config import ConfigError
from ddl_wgpu.backend import (
    BackendError,
    choose_backend,
    eagle3_teacher_k,
    make_eagle3_draft,
    make_eagle3_target,
    make_engine,
)
from ddl_wgpu.data import DataError, check_vocab, load_records, make_windows, tokenizer_for
from ddl_wgpu.errors import UserError
from ddl_wgpu.files.container import CheckpointError, open_checkpoint, save
from ddl_wgpu.files.eagle3_aux import AuxPlan, on_model, plan_aux
from ddl_wgpu.files.eagle3file import (
    Eagle3Draft,
    config_dict,
    config_from_dict,
    identity_of,
    is_draft_file,
    load_draft,
    save_draft,
)
from ddl_wgpu.files.modelfile import Model, load_model
from ddl_wgpu.jobs import accept as accept_mod
from ddl_wgpu.jobs.run import Events

KINDS = ("eagle3",)
INITS = ("target", "random")
HELD_OUT_EVERY = 10
WARMUP_FRACTION = 0.1
MIN_LR_FRACTION = 0.1
ACCEPT_DEPTH = 3
ADAM = (0.9, 0.999, 1e-8)
GRAD_CLIP = 0.5
RUN_KEY = "eagle3_run"
TENSOR_PREFIX_M, TENSOR_PREFIX_V = "adam.m.", "adam.v."


class DraftError(UserError):
    """A draft run that cannot start or go on, with one clear line."""


class DraftInterrupted(Exception):
    """The run stopped (Ctrl-C or stop_after) after writing its run file; `message` says how to continue."""

    def __init__(self, message: str, run_file: Path, step: int):
        super().__init__(message)
        self.message, self.run_file, self.step = message, run_file, step


@dataclass(frozen=True)
class DraftConfig:
    """Settings of one `draft` run."""

    kind: str = "eagle3"
    draft_vocab: int = 32000  # capped at the target's vocabulary
    aux_layers: tuple[int, int, int] | None = None  # None: default_aux_layers(L)
    ttt: int = 7  # the TTT unroll depth (SpecForge's 7)
    tokens: int = 200_000  # token budget of all windows (heal's count)
    seq_len: int = 128
    batch_size: int = 4
    epochs: float = 1.0
    learning_rate: float = 1e-4
    warmup_steps: int | None = None  # None: 10 % of the steps
    eval_interval: int = 50
    seed: int = 0
    init: str = "target"  # lm_head from the target's head rows ("target") or uniform ("random")
    regenerate: bool = False  # train on the target's own greedy continuations
    prompt_len: int = 32  # regenerate: the prompt taken from each window; the rest is decoded
    eval_windows: int = 64  # held-out windows each evaluation reads (the first of them; all when fewer)
    # the teacher's top-k over the draft vocabulary (None: the backend's default, numpy 0 = the full logits,
    # the GPU 64; `backend.eagle3_teacher_k`); the same k gives the same loss on both backends
    teacher_k: int | None = None
    # a draft file to start from (heal: `heal --draft`, `draft --init FILE`): its weights, vocabulary and
    # settings, its aux layers mapped onto the target (`files.eagle3_aux`); `draft_vocab` and `init` are then
    # not read. None: a fresh draft
    start: str | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise DraftError(
                f"draft: kind must be one of {', '.join(KINDS)}, got {self.kind!r}", field="kind"
            )
        if self.init not in INITS:
            raise DraftError(
                f"draft: init must be one of {', '.join(INITS)}, got {self.init!r}", field="init"
            )
        if self.start is not None and not isinstance(self.start, str):
            raise DraftError(f"draft: start must be a draft file's path, got {self.start!r}", field="start")
        for name in ("draft_vocab", "ttt", "tokens", "seq_len", "batch_size", "eval_interval", "prompt_len",
                     "eval_windows"):  # fmt: skip
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise DraftError(f"draft: {name} must be a positive integer, got {v!r}", field=name)
        if self.teacher_k is not None and (isinstance(self.teacher_k, bool) or not isinstance(self.teacher_k, int)
                                           or self.teacher_k < 0):  # fmt: skip
            raise DraftError(f"draft: teacher_k must be a non-negative integer, got {self.teacher_k!r}",
                             field="teacher_k")  # fmt: skip
        if self.seed < 0 or (self.warmup_steps is not None and self.warmup_steps < 0):
            raise DraftError("draft: seed and warmup_steps must be non-negative", field="seed")
        for name in ("epochs", "learning_rate"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not (math.isfinite(v) and v > 0):
                raise DraftError(f"draft: {name} must be a positive number, got {v!r}", field=name)
        if self.seq_len < self.ttt + 2:
            raise DraftError(f"draft: seq_len {self.seq_len} must be at least ttt + 2 = {self.ttt + 2}",
                             field="seq_len")  # fmt: skip
        if self.regenerate and self.prompt_len >= self.seq_len:
            raise DraftError(f"draft: prompt_len {self.prompt_len} leaves nothing to regenerate in seq_len "
                             f"{self.seq_len}", field="prompt_len")  # fmt: skip
        if self.aux_layers is not None:
            aux = tuple(self.aux_layers)
            if len(aux) != 3 or not all(isinstance(j, int) and not isinstance(j, bool) for j in aux):
                raise DraftError(f"draft: aux_layers must be three layer ids, got {self.aux_layers!r}",
                                 field="aux_layers")  # fmt: skip
            object.__setattr__(self, "aux_layers", aux)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["aux_layers"] = None if self.aux_layers is None else list(self.aux_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> DraftConfig:
        d = dict(d)
        if isinstance(d.get("aux_layers"), list):
            d["aux_layers"] = tuple(d["aux_layers"])
        try:
            return cls(**d)
        except TypeError as e:
            raise DraftError(f"draft: bad recorded settings: {e}") from None


def run_path(out_path) -> Path:
    """The run file beside OUT: `draft.ddlw` -> `draft.run.ddlw`."""
    out = Path(out_path)
    return out.with_name(out.stem + ".run.ddlw")


def lr_at(step: int, total: int, warmup: int, lr: float) -> float:
    """Step `step` (1-based): linear warm-up over `warmup` steps, then a cosine from lr to 0.1 lr at `total`."""
    if warmup > 0 and step <= warmup:
        return lr * step / warmup
    progress = min((step - warmup) / max(total - warmup, 1), 1.0)
    return lr * (MIN_LR_FRACTION + (1.0 - MIN_LR_FRACTION) * 0.5 * (1.0 + math.cos(math.pi * progress)))


# ----------------------------------------------------------------------------------------------------------
# the pieces


def _target(target_path, verify: bool) -> tuple[Model, dict]:
    try:
        with open_checkpoint(target_path, verify=False) as ck:
            ident = identity_of(ck)
    except CheckpointError as e:
        raise DraftError(f"draft: {e}") from None
    model = load_model(target_path, verify=verify)
    cfg = model.cfg
    if cfg.residual == "delta" and cfg.ddl_dv > 1:
        raise DraftError(f"draft: {target_path} carries a d_v = {cfg.ddl_dv} Deep Delta state, not a residual "
                         "stream of vectors an EAGLE-3 draft reads")  # fmt: skip
    return model, {**ident, "path": os.fspath(target_path)}


def eagle3_config(model: Model, cfg: DraftConfig, draft_vocab: int) -> e3.Eagle3Config:
    m = model.cfg
    if cfg.aux_layers is None and m.n_layers < 4:  # (2, L//2, L−3) needs four layers
        raise DraftError(f"draft: an EAGLE-3 draft reads three layer inputs, by default (2, L//2, L-3) of a target "
                         f"of at least 4 layers; this one has {m.n_layers}: give them with --aux-layers a,b,c "
                         f"(inputs 1..{m.n_layers - 1})", field="aux_layers")  # fmt: skip
    aux = cfg.aux_layers if cfg.aux_layers is not None else e3.default_aux_layers(m.n_layers)
    if not all(1 <= j < m.n_layers for j in aux):
        raise DraftError(f"draft: aux layers {list(aux)} must name layer inputs 1..{m.n_layers - 1} of the "
                         f"{m.n_layers}-layer target", field="aux_layers")  # fmt: skip
    try:
        return e3.Eagle3Config(hidden=m.d_model, n_heads=m.n_heads, n_kv_heads=m.n_kv_heads, head_dim=m.head_dim,
                               intermediate=m.ffn_hidden, vocab=m.vocab_size, draft_vocab=draft_vocab,
                               aux_layers=tuple(aux), rope_theta=float(m.rope_theta), rms_eps=float(m.rms_eps),
                               ttt=cfg.ttt)  # fmt: skip
    except ConfigError as e:
        raise DraftError(f"draft: {e}") from None


@dataclass
class Start:
    """The draft a run starts from (heal): its config (the aux ids those it reads on this target, `ttt` the
    run's), weights, vocabulary, and how its aux ids were found (`eagle3_aux.AuxPlan.to_dict`)."""

    cfg: e3.Eagle3Config
    params: dict
    d2t: np.ndarray
    t2d: np.ndarray
    aux: dict
    path: str


def load_start(path, target_path, aux_layers=None, verify: bool = True) -> tuple[Start, AuxPlan]:
    """The draft file at `path` as a run's start on the target at `target_path`: read as untrusted input
    (`load_draft`), its aux ids planned on the target (`eagle3_aux.plan_aux`; `aux_layers` given: those)."""
    draft, plan = plan_for(target_path, path, verify, aux_layers)
    return Start(draft.cfg, draft.params, draft.d2t, draft.t2d, plan.to_dict(), os.fspath(path)), plan


def windows(model: Model, data_spec: str, cfg: DraftConfig) -> list[np.ndarray]:
    """The run's windows (module docstring, step 1; before any regeneration)."""
    tok = tokenizer_for(model.tokenizer)
    seq = min(cfg.seq_len, model.cfg.max_seq_len)
    try:
        records = load_records(data_spec, tok, 2 * cfg.tokens)
        check_vocab(records, model.cfg.vocab_size)
    except DataError as e:
        raise DraftError(f"draft: {e}") from e
    wins = make_windows(records, seq, min_len=cfg.ttt + 2, max_tokens=cfg.tokens, cut_min_len=cfg.ttt + 2)
    if len(wins) < HELD_OUT_EVERY or len(wins) - len(wins) // HELD_OUT_EVERY < cfg.batch_size:
        raise DraftError(f"draft: {len(wins)} windows in {data_spec}, need {HELD_OUT_EVERY} and a batch of "
                         f"{cfg.batch_size} to train (every tenth is held out)", kind="too_few_windows")  # fmt: skip
    return wins


def regenerate(model: Model, wins: list[np.ndarray], cfg: DraftConfig, events: Events) -> list[np.ndarray]:
    """Each window's first `prompt_len` tokens, then the target's greedy continuation to the window's length
    (`seq_len` at most): the numpy decoder, one token per step."""
    out = []
    for i, w in enumerate(wins):
        p = min(cfg.prompt_len, w.size - 1)
        eng = make_engine("ref", model, 0, None, "f32", w.size)
        ids = [int(t) for t in w[:p]]
        nxt = int(eng.feed(ids, "argmax", last_only=True)[-1])
        while len(ids) < w.size:
            ids.append(nxt)
            if len(ids) < w.size:
                nxt = int(eng.feed([nxt], "argmax")[-1])
        out.append(np.asarray(ids, np.int64))
        if (i + 1) % max(len(wins) // 4, 1) == 0 or i + 1 == len(wins):
            events("regenerate", done=i + 1, windows=len(wins))
    return out


def split(n: int) -> tuple[list[int], list[int]]:
    val = [i for i in range(n) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    return [i for i in range(n) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1], val


class _Run:
    """Everything a run (or its resumption) needs, rebuilt the same way from the target, data and settings."""

    def __init__(self, target_path, data_spec: str, cfg: DraftConfig, backend: str, events: Events,
                 verify: bool = True, device=None, streamed: bool = False, start: Start | None = None):  # fmt: skip
        self.cfg, self.events, self.backend, self.device = cfg, events, backend, device
        self.start = start
        self.data_spec = str(data_spec)
        self.model, self.identity = _target(target_path, verify)
        self.target_path = Path(target_path)
        wins = windows(self.model, data_spec, cfg)
        if cfg.regenerate:
            wins = regenerate(self.model, wins, cfg, events)
        self.T = max(w.size for w in wins)
        self.ids, self.lengths = accept_mod.pad_batch(wins, self.T)
        self.train, held = split(len(wins))
        self.heldout_total = len(held)
        self.val = held[: cfg.eval_windows]  # an evaluation's cost does not grow with the data
        self.tokens = int(sum(w.size for w in wins))
        self.per_epoch = len(self.train) // cfg.batch_size
        self.total = max(math.ceil(cfg.epochs * self.per_epoch), 1)
        self.warmup = (
            cfg.warmup_steps if cfg.warmup_steps is not None else max(int(self.total * WARMUP_FRACTION), 1)
        )
        self.V = self.model.cfg.vocab_size
        if start is not None:  # heal: the start's vocabulary and shapes kept, the run's unroll depth
            self.Vd, self.d2t, self.t2d = start.cfg.draft_vocab, start.d2t, start.t2d
            self.ecfg = dataclasses.replace(start.cfg, ttt=cfg.ttt)
        else:
            mask = e3.loss_mask_from_lengths(self.lengths[self.train], self.T)
            self.Vd = min(cfg.draft_vocab, self.V)
            self.counts = e3.token_counts(self.ids[self.train], mask, self.V)
            self.d2t, self.t2d = e3.draft_vocab(self.counts, self.Vd)
            self.ecfg = eagle3_config(self.model, cfg, self.Vd)
        try:
            self.k = eagle3_teacher_k(backend, cfg.teacher_k, self.Vd, device)
        except BackendError as e:
            raise DraftError(f"draft: {e}", field="teacher_k") from None
        self.target = make_eagle3_target(backend, self.model, self.ecfg.aux_layers, device, self.d2t, self.t2d,
                                         self.k, cfg.batch_size, streamed=streamed)  # fmt: skip
        self.embed = self.model.params["model.embed_tokens.weight"]

    def fresh_params(self) -> dict:
        if self.start is not None:
            return {n: np.array(a, np.float32) for n, a in self.start.params.items()}
        p = e3.init_eagle3(self.ecfg, self.cfg.seed)
        if self.cfg.init == "target":
            head = self.model.params[head_name(self.model.cfg)]  # the embedding when tied
            p[e3.HEAD] = e3.head_from_target(head, self.d2t).astype(np.float32)
        return p

    def drafter(self, params: dict):
        return make_eagle3_draft(self.backend, params, self.ecfg, self.embed, self.d2t, self.t2d, self.device,
                                 target=self.target, batch=self.cfg.batch_size, k=self.k, adam=ADAM,
                                 clip=GRAD_CLIP)  # fmt: skip

    def batch(self, step: int) -> np.ndarray:
        """The windows of step `step` (1-based): batch (step−1) mod n of its epoch's permutation."""
        epoch, k = divmod(step - 1, self.per_epoch)
        order = np.random.default_rng([self.cfg.seed, epoch]).permutation(len(self.train))
        b = self.cfg.batch_size
        return np.asarray(self.train)[order[k * b : (k + 1) * b]]

    def inputs(self, sel):
        ids, lengths = self.ids[sel], self.lengths[sel]
        return ids, lengths, self.target(ids), e3.loss_mask_from_lengths(lengths, self.T)

    def heldout(self, draft) -> dict:
        b = self.cfg.batch_size
        tot, steps, n = 0.0, np.zeros(self.ecfg.ttt), 0
        for s in range(0, len(self.val), b):
            ids, _lengths, batch, mask = self.inputs(self.val[s : s + b])
            loss, per = draft.losses(batch, ids, mask)
            tot += loss * len(ids)
            steps += np.asarray(per) * len(ids)
            n += len(ids)
        return {"loss": tot / max(n, 1), "step_losses": [float(v) / max(n, 1) for v in steps]}

    def acceptance(self, draft, depth: int = ACCEPT_DEPTH) -> dict:
        tally = accept_mod.Tally(depth, "eagle3")
        b = self.cfg.batch_size
        for s in range(0, len(self.val), b):
            ids, lengths, batch, _ = self.inputs(self.val[s : s + b])
            preds = draft.greedy_chain(batch, ids, depth)
            greedy = batch.greedy
            for i in range(len(ids)):
                tally.add(preds[i], greedy[i], ids[i], int(lengths[i]))
        return tally.result()


# ----------------------------------------------------------------------------------------------------------
# the GPU memory plan

# the settings that shrink a run, as `draft` spells them (`plan_memory`'s `flags`; heal --draft maps its own)
DRAFT_FLAGS = {"seq_len": "--seq-len", "batch_size": "--batch-size", "ttt": "--ttt",
               "draft_vocab": "--draft-vocab"}  # fmt: skip


def plan_memory(target_path, cfg: DraftConfig, backend: str, device=None, gpu_memory: int | None = None,
                flags: dict | None = None):  # fmt: skip
    """The GPU memory plan of this run (`engine.eagle3_plan.Eagle3Plan`: the target resident, or streamed where the
    resident one does not fit `gpu_memory` bytes) from the configs alone, before any weight or data is read:
    the target's header, the start draft's (a heal), windows of seq_len tokens (the longest the data can give).
    None on the numpy backend, or where the start is no draft file (`train_draft` refuses it in its own words).
    `gpumem.GpuBudgetError` (one line) where the run cannot fit, naming the least budget and `flags` (setting ->
    option) with their values: what to lower."""
    from ddl_wgpu.backend import open_gpu
    from ddl_wgpu.engine.eagle3_plan import plan_eagle3
    from ddl_wgpu.files.modelfile import load_config

    if choose_backend(backend, device).name != "wgpu":
        return None
    try:
        with open_checkpoint(target_path, verify=False) as ck:
            mcfg = load_config(ck, target_path, resident=False)
    except CheckpointError as e:
        raise DraftError(f"draft: {e}") from None
    if mcfg.residual == "delta" and mcfg.ddl_dv > 1:  # no draft reads it: `_target` refuses it
        return None
    if cfg.start is not None:  # a heal: the start's shapes and vocabulary, the run's unroll depth
        try:
            with open_checkpoint(cfg.start, verify=False) as ck:
                scfg = config_from_dict(ck.metadata["eagle3"]["config"], cfg.start)
        except (CheckpointError, KeyError, TypeError):  # no draft file: `load_start` refuses it in one line
            return None
        ecfg = dataclasses.replace(scfg, ttt=cfg.ttt)
    else:
        ecfg = eagle3_config(Model(mcfg, {}), cfg, min(cfg.draft_vocab, mcfg.vocab_size))
    try:
        k = eagle3_teacher_k(backend, cfg.teacher_k, ecfg.draft_vocab, device)
    except BackendError as e:
        raise DraftError(f"draft: {e}", field="teacher_k") from None
    T = min(cfg.seq_len, mcfg.max_seq_len)
    values = {"seq_len": T, "batch_size": cfg.batch_size, "ttt": cfg.ttt, "draft_vocab": ecfg.draft_vocab}
    keep = {"draft_vocab"} if cfg.start is not None else set()  # a heal keeps the start's vocabulary
    named = [f"{flag} {values[key]}" for key, flag in (flags or DRAFT_FLAGS).items() if key not in keep]
    lower = "one of " + ", ".join(named)
    return plan_eagle3(open_gpu(device), mcfg, ecfg, cfg.batch_size, T, k, gpu_memory, "f32", ACCEPT_DEPTH,
                       lower)  # fmt: skip


# ----------------------------------------------------------------------------------------------------------
# running


def train_draft(target_path, data_spec: str, out_path, cfg: DraftConfig | None = None, backend: str = "ref",
                progress: Callable[[dict], None] | None = None, device=None, verify: bool = True,
                stop_after: int | None = None, streamed: bool = False) -> dict:  # fmt: skip
    """Train an EAGLE-3 draft for the target at `target_path` on `data_spec`; write OUT. -> the report
    (provenance.draft plus `out`). DraftInterrupted after writing the run file when stopped. `streamed`: the
    GPU target streams its layers through two slots (`stream.Trunk`) instead of holding them all."""
    cfg = cfg if cfg is not None else DraftConfig()
    backend = choose_backend(backend, device).name
    events = Events(progress, "draft")
    start = None
    if cfg.start is not None:
        start, plan = load_start(cfg.start, target_path, cfg.aux_layers, verify)
        events("aux", start=start.path, line=plan.line(), notes=list(plan.notes))
    run = _Run(target_path, data_spec, cfg, backend, events, verify, device, streamed, start)
    _announce(run, events)
    draft = run.drafter(run.fresh_params())
    return _loop(run, draft, 0, [], Path(out_path), events, stop_after)


def _announce(run: _Run, events: Events) -> None:
    events("windows", windows=len(run.ids), tokens=run.tokens, train=len(run.train), heldout=run.heldout_total,
           evaluated=len(run.val),
           data=run.data_spec, regenerated=run.cfg.regenerate)  # fmt: skip
    events("draft", aux_layers=list(run.ecfg.aux_layers), draft_vocab=run.Vd, vocab=run.V, ttt=run.ecfg.ttt,
           steps=run.total, warmup=run.warmup, params=int(sum(math.prod(s) for s, _ in
                                                              e3.eagle3_params(run.ecfg).values())),
           start=None if run.start is None else run.start.path)  # fmt: skip


def _loop(run: _Run, draft, done: int, history: list, out: Path, events: Events, stop_after) -> dict:
    cfg = run.cfg
    if done == 0:
        ev = run.heldout(draft)
        history.append({"step": 0, **ev})
        events("eval", step=0, **ev)
        if run.start is not None:  # a heal: the start draft's acceptance on the held-out windows, to compare
            history[0]["acceptance"] = run.acceptance(draft)
            events("accept", start=True, **history[0]["acceptance"])
    stop = None if stop_after is None else done + stop_after
    interrupted = []
    old = signal.getsignal(signal.SIGINT)

    def hold(*_):  # a Ctrl-C lands between steps: the step under way completes, then the run file
        interrupted.append(True)

    try:
        signal.signal(signal.SIGINT, hold)
    except ValueError:  # not the main thread: Ctrl-C is not ours to catch
        old = None
    try:
        while done < run.total:
            step = done + 1
            ids, _lengths, batch, mask = run.inputs(run.batch(step))
            lr = lr_at(step, run.total, run.warmup, cfg.learning_rate)
            loss, gnorm, finite = draft.step(batch, ids, mask, lr, step)
            if not finite:
                raise DraftError(f"draft: non-finite loss or gradient at step {step} (loss {loss}, gradient norm "
                                 f"{gnorm}): lower --learning-rate")  # fmt: skip
            done = step
            events("step", step=step, steps=run.total, loss=loss, lr=lr, grad_norm=gnorm)
            if done % cfg.eval_interval == 0 or done == run.total:
                ev = run.heldout(draft)
                history.append({"step": done, **ev})
                events("eval", step=done, **ev)
            if done < run.total and (interrupted or (stop is not None and done >= stop)):
                path = save_run(run, draft, done, history, out)
                why = "interrupted" if interrupted else "stopped"
                raise DraftInterrupted(f"{why} after step {done} of {run.total}: the run is saved in {path}; "
                                       f"continue it with `ddl-wgpu resume {path}`", path, done)  # fmt: skip
    finally:
        if old is not None:
            signal.signal(signal.SIGINT, old)
    acc = run.acceptance(draft)
    events("accept", **acc)
    record = {
        "kind": cfg.kind,
        "target": os.fspath(run.target_path),
        "data": run.data_spec,
        "tokens": run.tokens,
        "windows": len(run.ids),
        "heldout_windows": len(run.val),
        "steps": done,
        "draft_vocab": run.Vd,
        "aux_layers": list(run.ecfg.aux_layers),
        "start": None if run.start is None else {"path": run.start.path, "aux": run.start.aux},
        "acceptance_start": history[0].get("acceptance"),
        "heldout_loss_start": history[0]["loss"],
        "heldout_loss_end": history[-1]["loss"],
        "acceptance": acc,
        "backend": run.backend,
        "config": cfg.to_dict(),
        "history": history,
    }
    d = Eagle3Draft(run.ecfg, draft.export(), run.d2t, run.t2d, run.identity, run.model.cfg.max_seq_len,
                    {"draft": record})  # fmt: skip
    path = save_draft(out, d, "f32")[0]
    events("written", out=os.fspath(path))
    stale = run_path(out)
    if stale.exists():
        stale.unlink()
    return {**record, "out": os.fspath(path)}


def save_run(run: _Run, draft, done: int, history: list, out: Path) -> Path:
    """The run file: weights, AdamW moments, vocabulary, step and settings (module docstring)."""
    m, v = draft.moments()
    params = draft.export()
    tensors = [(n, a) for n, a in params.items()]
    tensors += [(TENSOR_PREFIX_M + n, m[n]) for n in params if n in m]
    tensors += [(TENSOR_PREFIX_V + n, v[n]) for n in params if n in v]
    tensors += [("d2t", run.d2t), ("t2d", run.t2d)]
    meta = {RUN_KEY: {"target": os.fspath(run.target_path.absolute()), "identity": run.identity,
                      "data": run.data_spec, "config": run.cfg.to_dict(), "eagle3": config_dict(run.ecfg),
                      "step": done, "total": run.total, "history": history, "backend": run.backend,
                      "out": os.fspath(out.absolute()),
                      "start": None if run.start is None else {"path": run.start.path, "aux": run.start.aux}}}  # fmt: skip
    path = run_path(out)
    save(path, tensors, metadata=meta)
    return path


def is_run_file(path) -> bool:
    try:
        with open_checkpoint(path, verify=False) as ck:
            return isinstance((ck.metadata or {}).get(RUN_KEY), dict)
    except (CheckpointError, OSError):
        return False


def resume(run_file, progress: Callable[[dict], None] | None = None, verify: bool = True,
           stop_after: int | None = None, data_spec: str | None = None) -> dict:  # fmt: skip
    """Continue a stopped run from its run file: the same target (refused if it changed), data and settings
    rebuild the same windows, vocabulary and order; the weights and moments go on from the saved step."""
    where = os.fspath(run_file)
    with open_checkpoint(run_file, verify=verify) as ck:
        rec = (ck.metadata or {}).get(RUN_KEY)
        if not isinstance(rec, dict):
            raise DraftError(f"{where}: not a draft run file (no metadata '{RUN_KEY}')")
        tensors = {n: np.asarray(ck.tensor(n)) for n in ck.names()}
    try:
        cfg = DraftConfig.from_dict(rec["config"])
        step, target, spec, out = int(rec["step"]), rec["target"], rec["data"], Path(rec["out"])
        history, backend = list(rec["history"]), str(rec["backend"])
    except (KeyError, TypeError, ValueError) as e:
        raise DraftError(f"{where}: a damaged run record ({e})") from None
    events = Events(progress, "draft")
    start = None
    if cfg.start is not None:  # a heal: the start as the run recorded it (its file is not read again)
        try:
            scfg = config_from_dict(rec["eagle3"], where)
            names = list(e3.eagle3_params(scfg))
            start = Start(scfg, {n: tensors[n] for n in names}, tensors["d2t"], tensors["t2d"],
                          dict(rec["start"]["aux"]), str(rec["start"]["path"]))  # fmt: skip
        except (KeyError, TypeError) as e:
            raise DraftError(f"{where}: a damaged run record ({e})") from None
    run = _Run(target, data_spec or spec, cfg, backend, events, verify, start=start)
    if run.identity["config_hash"] != rec["identity"].get("config_hash") or \
            run.identity["tensors_hash"] != rec["identity"].get("tensors_hash"):  # fmt: skip
        raise DraftError(f"{where}: the target {target} changed since the run began; it cannot be continued")
    if config_from_dict(rec["eagle3"], where) != run.ecfg or not np.array_equal(tensors["d2t"], run.d2t):
        raise DraftError(
            f"{where}: the data or settings give another draft than the run's; it cannot be continued"
        )
    _announce(run, events)
    names = list(e3.eagle3_params(run.ecfg))
    missing = [n for n in names if n not in tensors]
    if missing:
        raise DraftError(f"{where}: missing tensor {missing[0]!r}")
    draft = run.drafter({n: tensors[n] for n in names})
    draft.load_moments({n: tensors[TENSOR_PREFIX_M + n] for n in names if TENSOR_PREFIX_M + n in tensors},
                       {n: tensors[TENSOR_PREFIX_V + n] for n in names if TENSOR_PREFIX_V + n in tensors})  # fmt: skip
    events("resumed", step=step, steps=run.total)
    return _loop(run, draft, step, history, out, events, stop_after)


# ----------------------------------------------------------------------------------------------------------
# accept and generate with a draft file


def plan_for(target_path, draft_path, verify: bool = True, aux_layers=None) -> tuple[Eagle3Draft, AuxPlan]:
    """The draft file at `draft_path` as it runs on the model at `target_path`, and how its aux layers were
    found there (`eagle3_aux.plan_aux`: its own target's, `aux_layers` as given, or mapped through the model's
    compress provenance); refused in one line when none of these applies."""
    if not is_draft_file(draft_path) and Path(draft_path).is_file():
        try:
            with open_checkpoint(draft_path, verify=False) as ck:
                what = "a model file" if ck.config else "a container"
        except CheckpointError:
            what = "not a .ddlw container"
        raise DraftError(f"{os.fspath(draft_path)}: not an EAGLE-3 draft ({what}); an EAGLE-3 draft file is what "
                         f"`ddl-wgpu draft` or `ddl-wgpu import-hf EAGLE_FOLDER` writes")  # fmt: skip
    draft = load_draft(draft_path, verify)
    plan = plan_aux(draft, draft_path, target_path, aux_layers)
    return on_model(draft, plan), plan


def accept_file(target_path, draft_path, data_spec: str, depth: int = accept_mod.DEPTH, window: int | None = None,
                tokens: int | None = None, backend: str = "ref", device=None, verify: bool = True,
                aux_layers=None, say: Callable[[str], None] | None = None) -> dict:  # fmt: skip
    """`accept TARGET --draft DRAFT`: the EAGLE-3 draft's greedy acceptance chained `depth` deep, measured as
    `accept` measures an MTP draft (`accept.Tally`: the same windows and anchors, A_j, α_j, τ) from the
    target's pass over each batch of windows (`ddl_ref.eagle3.ttt_greedy`: step 1 reads the data token and the
    aux rows, every later step its own previous draft). The aux layers as `plan_for` finds them (`aux_layers`:
    --aux-layers); `say` hears the plan's line and notes."""
    backend = choose_backend(backend, device).name
    draft, plan = plan_for(target_path, draft_path, verify, aux_layers)
    for line in (plan.line(), *plan.notes):
        if say is not None:
            say(line)
    model = load_model(target_path, verify=verify)
    if window is not None and window > model.cfg.max_seq_len:
        raise accept_mod.AcceptError(f"window {window} exceeds the model's context (max_seq_len "
                                     f"{model.cfg.max_seq_len})", field="window")  # fmt: skip
    records = load_records(data_spec, tokenizer_for(model.tokenizer), tokens)
    check_vocab(records, model.cfg.vocab_size)
    wins = make_windows(records, min(window or accept_mod.WINDOW, model.cfg.max_seq_len), depth + 1)
    wins = [w for w in wins if w.size > depth]
    if not wins:
        raise accept_mod.AcceptError(f"no window longer than depth {depth}: nothing to measure")
    # the teacher is not read (acceptance compares with the target's argmax): the smallest top-k on the GPU
    k = 0 if choose_backend(backend, device).name == "ref" else 1
    target = make_eagle3_target(backend, model, draft.cfg.aux_layers, device, draft.d2t, draft.t2d, k,
                                accept_mod.BATCH)  # fmt: skip
    embed = model.params["model.embed_tokens.weight"]
    drafter = make_eagle3_draft(backend, draft.params, draft.cfg, embed, draft.d2t, draft.t2d, device, target=target,
                                batch=accept_mod.BATCH, k=max(k, 1))  # fmt: skip
    T = max(w.size for w in wins)
    tally = accept_mod.Tally(depth, "eagle3")
    for s in range(0, len(wins), accept_mod.BATCH):
        ids, lengths = accept_mod.pad_batch(wins[s : s + accept_mod.BATCH], T)
        batch = target(ids)
        preds = drafter.greedy_chain(batch, ids, depth)
        greedy = batch.greedy
        for b in range(len(ids)):
            tally.add(preds[b], greedy[b], ids[b], int(lengths[b]))
    out = tally.result()
    out.update(
        data=str(data_spec), backend=backend, draft=os.fspath(draft_path), kind="eagle3", aux=plan.to_dict()
    )
    return out
