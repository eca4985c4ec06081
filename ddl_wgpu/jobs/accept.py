"""Greedy speculative acceptance of a model's MTP draft, measured offline.

Per window the trunk runs once (its greedy token g_p and its hidden rows), then the draft runs `depth` steps
chained on itself (`ddl_ref.mtp.draft_chain`, tokens="greedy": step 1 reads the data token x_{p+1}, step j > 1
the draft's own step j−1 argmax). At anchor p, with d_{p,j} the draft's argmax at step j:

    m_{p,j} = [d_{p,j} == g_{p+j}]                 the drafted token equals the trunk's greedy token
    A_j     = mean_p prod_{i<=j} m_{p,i}           prefix acceptance
    alpha_j = A_j / A_{j-1}  (A_0 = 1; 0 when A_{j-1} = 0)   conditional acceptance
    tau     = 1 + sum_j A_j                        acceptance length (tokens per verify)

Anchors are every p with p + depth < length (all depths use the same anchors). "On-policy" anchors are those
where the data follows the trunk's greedy path for the whole depth (x_{p+i} == g_{p+i-1}, i = 1..depth): only
there does the teacher-forced measure equal what a greedy decode would see. on_policy measures every depth on
that one set, so its prefix acceptance cannot rise with depth and every conditional is <= 1.

JSON keys: depth, prefix_acceptance [A_1..A_K], conditional_acceptance [alpha_1..alpha_K], acceptance_length,
anchors, on_policy {anchors, prefix_acceptance, conditional_acceptance, acceptance_length},
chain_attention; and `probe` (one entry per concat / trunk-hidden / chain-hidden convention) when asked for.

Chain attention (`chain_attention`; by default the one the draft's layout runs, `draft_layout.chain_attention_for`:
"stacked" for a Qwen3.5-layout draft, "per-step" otherwise): "per-step" runs each step as its own causal pass
over that step's rows of the window (positions 0..T−1), as the reference heal tool trains. "stacked" does what a
speculative runtime does: step 1 as in "per-step"; step σ >= 2 is read off the stacked forward of steps 1..σ
(`ddl_ref.mtp.draft_forward(chain=σ)`: row (s, p) at position p + s − 1 sees the step-1 rows at positions <= p
and the steps 2..s rows of its own anchor, the runtime's diagonal mask), step s's input rows built from the
draft's own step s−1 output and greedy token. Step 1 and the counting are the same in both; at depth 1 the two
agree. The JSON adds `chain_attention` (and `accept_file` why it was chosen: `chain_attention_why`).

Backends: "ref" runs trunk and draft in numpy; "wgpu" runs everything on the GPU, forward only
(`gpu_acceptance`): the trunk over blocks of windows (`heal_gpu.WgpuTeacher.topk_rows`, resident or streamed
within a `gpumem` plan; its greedy token from the `topk` kernel with k = 1, the draft's step-1 input rows
eh_proj·[enorm(e); hnorm(h)] built on the GPU from its hidden rows, `heal_gpu.DraftInput`), its weights then
freed, then the chain (`heal_gpu.WgpuDraft.greedy_chain`): step 1 from those rows, step j + 1's rows from the
draft's step-j argmax ids and output rows, the block (the masked attention kernels for a stacked step), norm,
head and argmax; only the step-1 rows and the argmax ids come down. `--probe-conventions`
re-measures on the host rows (`greedy_chain`: `ddl_ref.mtp.step_input`, the draft's steps by
`WgpuDraft.greedy`) from the same trunk pass's hidden rows, downloaded for it. Argmax ties go to the lower id
on both backends, so the numbers agree up to float near-ties.

What this file deliberately does not do: sampling acceptance (min(1, P/Q)).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
from collections.abc import Sequence

import numpy as np

from ddl_ref import mtp as ref_mtp
from ddl_ref.config import MtpConfig
from ddl_wgpu.backend import (
    check_trunk_dtype,
    choose_backend,
    make_draft,
    make_teacher,
    plan_trunk,
    runtime_name,
)
from ddl_wgpu.data import check_vocab, load_records, make_windows, tokenizer_for
from ddl_wgpu.engine.refnet import ref_runner
from ddl_wgpu.errors import UserError
from ddl_wgpu.files.container import open_checkpoint
from ddl_wgpu.files.hf.draft_layout import chain_attention_for
from ddl_wgpu.files.modelfile import Model, load_config, load_model
from ddl_wgpu.files.safeio import load_json, read_regular

KEYS = (
    "depth",
    "prefix_acceptance",
    "conditional_acceptance",
    "acceptance_length",
    "anchors",
    "on_policy",
    "chain_attention",
)
DEPTH, WINDOW, TOKENS = 3, 128, 20_000  # `accept`'s defaults: chain depth, window length, token budget (CLI)
BATCH = 8  # windows per draft batch (and per trunk batch on numpy)
EMBED = "model.embed_tokens.weight"
# Chain attention: "per-step" (each chain step its own causal pass, the reference heal tool's way) or
# "stacked" (steps 1..j stacked with the runtime's diagonal mask). `acceptance`, `accept_file` and `heal` take
# the draft's layout's by default (`resolve_chain_attention`); the functions below them are handed it, and
# default to the reference's.
CHAIN_ATTENTION = ("per-step", "stacked")
DEFAULT_CHAIN_ATTENTION = "per-step"


class AcceptError(UserError):
    """An acceptance measurement that cannot run, with one clear line."""


def check_chain_attention(chain_attention: str) -> None:
    if chain_attention not in CHAIN_ATTENTION:
        raise AcceptError(
            f"chain attention must be one of {', '.join(CHAIN_ATTENTION)}, got {chain_attention!r}",
            field="chain_attention",
        )


def resolve_chain_attention(cfg, chain_attention: str | None) -> tuple[str, str]:
    """(the chain attention to measure with, why): `chain_attention` when given ("as given"), else the draft's
    layout's ("default: REASON")."""
    if chain_attention is None:
        mode, reason = chain_attention_for(cfg)
        return mode, f"default: {reason}"
    check_chain_attention(chain_attention)
    return chain_attention, "as given"


def chain_attention_of(model_path, chain_attention: str | None) -> tuple[str, str]:
    """`resolve_chain_attention` for the model file at `model_path` (its header only, before the run)."""
    with open_checkpoint(model_path) as ck:
        return resolve_chain_attention(load_config(ck, model_path), chain_attention)


# ----------------------------------------------------------------------------------------------------------
# counting


class Tally:
    """Running counts of prefix-accepted anchors, over all anchors and over the on-policy anchors."""

    def __init__(self, depth: int, chain_attention: str = DEFAULT_CHAIN_ATTENTION):
        self.depth = depth
        self.chain_attention = chain_attention
        self.anchors = 0
        self.hits = np.zeros(depth, np.int64)  # anchors whose first j drafts were all accepted
        self.on_anchors = 0
        self.on_hits = np.zeros(depth, np.int64)

    def add(self, preds, greedy, ids, length: int) -> None:
        """One window: preds (depth, T) draft argmax per step, greedy (T,) trunk argmax, ids (T,) data."""
        K = self.depth
        n = int(length) - K  # anchors p = 0..length-1-K
        if n <= 0:
            return
        p = np.arange(n)
        greedy, ids = np.asarray(greedy), np.asarray(ids)
        on = np.ones(n, bool)  # data on the trunk's greedy path for the whole depth
        for j in range(1, K + 1):
            on &= ids[p + j] == greedy[p + j - 1]
        ok = np.ones(n, bool)  # still accepted
        for j in range(1, K + 1):
            ok &= np.asarray(preds[j - 1])[p] == greedy[p + j]
            self.hits[j - 1] += int(ok.sum())
            self.on_hits[j - 1] += int((ok & on).sum())
        self.anchors += n
        self.on_anchors += int(on.sum())

    @staticmethod
    def _rates(hits, anchors):
        A = [float(h) / a if a > 0 else 0.0 for h, a in zip(hits, anchors, strict=True)]
        alpha, prev = [], 1.0
        for a in A:
            alpha.append(a / prev if prev > 0 else 0.0)
            prev = a
        return A, alpha, 1.0 + float(sum(A))

    def result(self) -> dict:
        A, alpha, tau = self._rates(self.hits, [self.anchors] * self.depth)
        oA, oalpha, otau = self._rates(self.on_hits, [self.on_anchors] * self.depth)
        return {
            "depth": self.depth,
            "prefix_acceptance": A,
            "conditional_acceptance": alpha,
            "acceptance_length": tau,
            "anchors": int(self.anchors),
            "on_policy": {
                "anchors": int(self.on_anchors),
                "prefix_acceptance": oA,
                "conditional_acceptance": oalpha,
                "acceptance_length": otau,
            },
            "chain_attention": self.chain_attention,
        }


# ----------------------------------------------------------------------------------------------------------
# windows and the trunk pass


def pad_batch(windows: Sequence[np.ndarray], T: int, pad: int = 0):
    """-> (ids (B, T) int64 padded with `pad`, lengths (B,) int64)."""
    ids = np.full((len(windows), T), pad, np.int64)
    lengths = np.array([w.size for w in windows], np.int64)
    for b, w in enumerate(windows):
        ids[b, : w.size] = w
    return ids, lengths


@dataclasses.dataclass
class TrunkBatch:
    """The trunk's pass over one batch of windows: what acceptance needs, computed once."""

    ids: np.ndarray  # (B, T) int64
    lengths: np.ndarray  # (B,)
    greedy: np.ndarray  # (B, T) trunk argmax at each position
    pre: np.ndarray  # (B, T, C) pre-final-norm hidden
    post: np.ndarray  # (B, T, C) post-final-norm hidden
    x1: np.ndarray | None = None  # (B, T, C) the draft's step-1 input rows when given (pre, post then unused)


def trunk_batches(
    model: Model, windows: Sequence[np.ndarray], batch: int = BATCH, teacher=None
) -> list[TrunkBatch]:
    """The trunk over the windows in batches; `teacher` (a `backend.Teacher`) runs it, numpy when None."""
    T = max(w.size for w in windows)
    out = []
    for s in range(0, len(windows), batch):
        ids, lengths = pad_batch(windows[s : s + batch], T)
        if teacher is None:
            top, _probs, pre, post = ref_mtp.trunk_topk_hidden(model.params, model.cfg, ids, 1)
        else:
            top, _probs, pre, post = teacher.topk_hidden(ids, 1)
        out.append(TrunkBatch(ids, lengths, top[..., 0], pre, post))
    return out


# ----------------------------------------------------------------------------------------------------------
# acceptance


def _with_conventions(cfg, conventions):
    if conventions is None:
        return cfg
    if isinstance(conventions, dict):
        base = cfg.mtp.to_dict() if cfg.mtp is not None else {}
        conventions = MtpConfig.from_dict({**base, **conventions})
    return dataclasses.replace(cfg, mtp=conventions)


def greedy_chain(
    params: dict, cfg, tb: TrunkBatch, depth: int, runner, chain_attention: str = DEFAULT_CHAIN_ATTENTION
) -> np.ndarray:
    """`ddl_ref.mtp.draft_chain(tokens="greedy")` with each step's block, norm, head and argmax done by
    `runner(x_rows, chain=0) -> (argmax (B, T'), pre, post)` -> preds (B, depth, T).

    chain_attention "stacked": step σ >= 2 runs the stacked input rows of steps 1..σ (T' = σ·T) with
    `chain=σ` and keeps its last T rows (the step-σ rows); "per-step": every step its own pass (chain 0)."""
    mtp = cfg.mtp
    T = tb.ids.shape[1]
    hid = ref_mtp.pick_hidden(tb.pre, tb.post, mtp.trunk_hidden)
    tok = ref_mtp.shifted(tb.ids, 1)
    valid = ref_mtp.step_valid(tb.lengths, T, 1)
    preds, xs = [], []
    for j in range(1, depth + 1):
        given = j == 1 and tb.x1 is not None
        xs.append(
            np.asarray(tb.x1, np.float32) if given else ref_mtp.step_input(params, cfg, tok, hid, valid)
        )
        if chain_attention == "stacked" and j > 1:  # the step-j rows of the stacked forward of steps 1..j
            tok, pre, post = (a[:, -T:] for a in runner(np.concatenate(xs, axis=1), chain=j))
        else:
            tok, pre, post = runner(xs[-1])
        preds.append(tok)
        hid = ref_mtp.pick_hidden(pre, post, mtp.chain_hidden)
    return np.stack(preds, axis=1)


def acceptance_from_trunk(params: dict, cfg, trunk: Sequence[TrunkBatch], depth: int, runner=None,
                          chain_attention: str = DEFAULT_CHAIN_ATTENTION) -> dict:  # fmt: skip
    """Acceptance of the draft in `params` (numpy, `model.mtp.*` plus the shared embedding and head) over
    trunk passes already made; `runner` (e.g. `heal_gpu.WgpuDraft.greedy`) runs the draft's steps, numpy when
    None; `chain_attention` "per-step" or "stacked" (module docstring)."""
    check_chain_attention(chain_attention)
    tally = Tally(depth, chain_attention)
    for tb in trunk:
        if runner is None and chain_attention == "per-step" and tb.x1 is None:
            steps = ref_mtp.draft_chain(
                params, cfg, tb.ids, tb.lengths, tb.pre, tb.post, depth, tokens="greedy"
            )
            preds = np.stack([np.argmax(s, axis=-1) for s in steps], axis=1)  # (B, depth, T)
        else:
            run = runner if runner is not None else ref_runner(params, cfg)
            preds = greedy_chain(params, cfg, tb, depth, run, chain_attention)
        for b in range(tb.ids.shape[0]):
            tally.add(preds[b], tb.greedy[b], tb.ids[b], int(tb.lengths[b]))
    return tally.result()


def gpu_acceptance(model: Model, cfg, windows: Sequence[np.ndarray], depth: int, batch: int, device: str | None,
                   trunk_dtype: str = "f32", chain_attention: str = DEFAULT_CHAIN_ATTENTION,
                   keep_hidden: bool = False, plan=None, checkpoint=None) -> tuple[dict, list[TrunkBatch], object]:  # fmt: skip
    """`acceptance_from_trunk` on the GPU: the trunk's pass over blocks of windows (`heal_gpu.WgpuTeacher`,
    resident or streamed by `plan`, reading its tensors from `checkpoint` when given), keeping per window its
    greedy tokens and the draft's step-1 rows (built on the GPU with `cfg`'s conventions); the trunk's weights
    released; then the draft's greedy chain from those rows (`backend.AcceptDraft.greedy_chain`, `batch` windows
    at a time, every later step's rows built there). Only token ids and the step-1 rows come down. -> (the
    result, the `TrunkBatch`es of `batch` windows with their hidden rows downloaded when `keep_hidden`, for a
    host-side measure on the same trunk pass, else [], the draft)."""
    check_chain_attention(chain_attention)
    T = max(w.size for w in windows)
    teacher = make_teacher("wgpu", model, batch, device, trunk_dtype, plan, checkpoint)
    kept = []
    for s in range(0, len(windows), teacher.block):
        ids, lengths = pad_batch(windows[s : s + teacher.block], T)
        top, _probs, x1 = teacher.topk_rows(ids, lengths, 1, mtp=cfg.mtp)
        pre = post = [None] * len(ids)
        if keep_hidden:
            pre, post = teacher.hidden_rows(len(ids), T)
        for b in range(0, len(ids), batch):
            part = slice(b, b + batch)
            kept.append(
                TrunkBatch(ids[part], lengths[part], top[part, :, 0], pre[part], post[part], x1[part])
            )
    teacher.release()  # the draft runs after the trunk's weights are gone
    draft = make_draft("wgpu", model, None, batch, device, teacher=teacher)
    draft.prepare(
        T, 1, depth, chain_attention == "stacked"
    )  # its works, largest first: what the plan counted
    tally = Tally(depth, chain_attention)
    for tb in kept:
        tok, valid = ref_mtp.shifted(tb.ids, 1), ref_mtp.step_valid(tb.lengths, T, 1)
        preds = draft.greedy_chain(None, tok, valid, depth, chain_attention == "stacked", cfg.mtp, rows=tb.x1)
        for b in range(tb.ids.shape[0]):
            tally.add(preds[b], tb.greedy[b], tb.ids[b], int(tb.lengths[b]))
    if keep_hidden:  # the probe measures other conventions from the hidden rows: not these step-1 rows
        kept = [dataclasses.replace(tb, x1=None) for tb in kept]
    return tally.result(), kept if keep_hidden else [], draft


def acceptance_from_rows(params: dict, cfg, tb: TrunkBatch, depth: int, draft=None,
                         chain_attention: str = DEFAULT_CHAIN_ATTENTION) -> dict:  # fmt: skip
    """`acceptance_from_trunk` of one `TrunkBatch` carrying the draft's step-1 rows `x1` (heal's held-out
    windows): on the GPU (`backend.AcceptDraft.greedy_chain`, in batches of `draft.B` windows, every later
    step's rows built there) when `draft` is given, else numpy (`greedy_chain` on `refnet.ref_runner`)."""
    if draft is None:
        return acceptance_from_trunk(params, cfg, [tb], depth, None, chain_attention)
    check_chain_attention(chain_attention)
    T = tb.ids.shape[1]
    tok, valid = ref_mtp.shifted(tb.ids, 1), ref_mtp.step_valid(tb.lengths, T, 1)
    tally = Tally(depth, chain_attention)
    for s in range(0, tb.ids.shape[0], draft.B):
        part = slice(s, s + draft.B)
        preds = draft.greedy_chain(None, tok[part], valid[part], depth, chain_attention == "stacked", cfg.mtp,
                                   rows=tb.x1[part])  # fmt: skip
        for b in range(preds.shape[0]):
            tally.add(preds[b], tb.greedy[s + b], tb.ids[s + b], int(tb.lengths[s + b]))
    return tally.result()


def acceptance(model: Model, windows: Sequence[np.ndarray], depth: int = DEPTH, backend: str = "ref",
               conventions: MtpConfig | dict | None = None, probe_conventions: bool = False,
               batch: int = BATCH, device: str | None = None, trunk_dtype: str = "f32",
               chain_attention: str | None = None, plan=None, checkpoint=None) -> dict:  # fmt: skip
    """Greedy speculative acceptance of `model`'s draft over `windows` (1-D token arrays, each at most
    max_seq_len long), chained `depth` deep, with `chain_attention` "per-step" or "stacked" (None: the draft's
    layout's; module docstring). `conventions` overrides the model's MtpConfig (concat, hiddens);
    `probe_conventions` adds `probe`: the same measure under every concat x trunk_hidden x chain_hidden.
    `trunk_dtype` "f16" (wgpu only) keeps the GPU trunk's big matrices in f16 (`heal_gpu.WgpuTeacher`); on wgpu
    `plan` (a `gpumem.TrunkPlan`) runs the trunk resident or streamed, and `checkpoint` (the model's open file)
    gives its tensors when the model was loaded without them."""
    if chain_attention is not None:
        check_chain_attention(chain_attention)
    if depth < 1:
        raise AcceptError(f"depth must be at least 1, got {depth}", field="depth")
    if model.cfg.mtp is None:
        raise AcceptError("the model has no MTP draft (missing tensor model.mtp.eh_proj.weight)")
    chain_attention, _ = resolve_chain_attention(model.cfg, chain_attention)
    windows = [np.asarray(w, np.int64) for w in windows if np.asarray(w).size > depth]
    if not windows:
        raise AcceptError(f"no window longer than depth {depth}: nothing to measure")
    if max(w.size for w in windows) > model.cfg.max_seq_len:
        raise AcceptError(f"a window is longer than the model's max_seq_len {model.cfg.max_seq_len}")
    backend = choose_backend(backend, device).name
    check_trunk_dtype(backend, trunk_dtype)
    cfg = _with_conventions(model.cfg, conventions)
    if backend == "ref":
        runner = None
        trunk = trunk_batches(model, windows, batch)
        result = acceptance_from_trunk(model.params, cfg, trunk, depth, None, chain_attention)
    else:  # the chain on the GPU; the probe (other conventions) on the host, from the downloaded hidden rows
        result, trunk, draft = gpu_acceptance(model, cfg, windows, depth, batch, device, trunk_dtype,
                                              chain_attention, probe_conventions, plan, checkpoint)  # fmt: skip
        runner = draft.greedy
    if probe_conventions:
        probe = []
        for concat, th, ch in itertools.product(("emb_first", "hidden_first"), ("pre_norm", "post_norm"),
                                                ("pre_norm", "post_norm")):  # fmt: skip
            conv = dataclasses.replace(cfg.mtp, concat=concat, trunk_hidden=th, chain_hidden=ch)
            r = acceptance_from_trunk(model.params, dataclasses.replace(cfg, mtp=conv), trunk, depth, runner,
                                      chain_attention)  # fmt: skip
            probe.append({**conv.to_dict(), "current": conv == cfg.mtp,
                          "prefix_acceptance": r["prefix_acceptance"],
                          "acceptance_length": r["acceptance_length"]})  # fmt: skip
        result["probe"] = probe
    return result


def accept_file(model_path, data_spec: str, depth: int = DEPTH, window: int | None = None,
                tokens: int | None = TOKENS, backend: str = "ref", probe_conventions: bool = False,
                device: str | None = None, trunk_dtype: str = "f32",
                chain_attention: str | None = None, verify: bool = True,
                gpu_memory: int | None = None, say=None) -> dict:  # fmt: skip
    """The `accept MODEL --data SPEC [--depth K]` entry point: load, cut windows, measure; `tokens` the token
    budget (the CLI's default, TOKENS; None: every token of the data). `window` None:
    WINDOW, or the model's context when shorter; a longer one is refused (it would silently be cut);
    `chain_attention` None: the draft's layout's. On wgpu the trunk's tensors are read from the file as the
    trunk needs them (never the whole model in host memory) and its pass runs by the GPU memory plan (`gpumem`)
    for `gpu_memory` bytes (None: no budget), which `say(line)` is told before the pass; the result's `plan`
    records it (None on numpy)."""
    backend = choose_backend(backend, device).name
    if chain_attention is not None:
        check_chain_attention(chain_attention)
    check_trunk_dtype(backend, trunk_dtype)
    on_gpu = backend == "wgpu"
    # on the GPU the host needs the draft's tensors (and, to probe conventions on the host, the embedding)
    wanted = (
        (lambda n: n.startswith(ref_mtp.MTP_PREFIX) or (probe_conventions and n == EMBED)) if on_gpu else None
    )
    model = load_model(model_path, names=wanted, verify=verify, check_memory=not on_gpu)
    chain_attention, why = resolve_chain_attention(model.cfg, chain_attention)
    if window is not None and window > model.cfg.max_seq_len:
        ctx = model.cfg.max_seq_len
        raise AcceptError(f"window {window} exceeds the model's context (max_seq_len {ctx})", field="window")
    if model.cfg.mtp is None:
        raise AcceptError("the model has no MTP draft (missing tensor model.mtp.eh_proj.weight)")
    records = load_records(data_spec, tokenizer_for(model.tokenizer), tokens)
    check_vocab(records, model.cfg.vocab_size)
    windows = make_windows(records, min(window or WINDOW, model.cfg.max_seq_len), depth + 1)
    usable = [w for w in windows if w.size > depth]
    plan = None
    if on_gpu and usable:
        T = max(w.size for w in usable)
        draft = {"k": 1, "chain": depth, "stacked": chain_attention == "stacked", "kl_form": "full"}
        plan = plan_trunk(backend, "accept", model.cfg, device, trunk_dtype, len(usable), T, BATCH, gpu_memory,
                          draft=draft)  # fmt: skip
        if say is not None:
            say(plan.line())
    with open_checkpoint(model_path, verify=verify) if on_gpu else contextlib.nullcontext() as ck:
        result = acceptance(model, windows, depth, backend, probe_conventions=probe_conventions, device=device,
                            trunk_dtype=trunk_dtype, chain_attention=chain_attention, plan=plan,
                            checkpoint=ck)  # fmt: skip
    result["data"] = str(data_spec)
    result["backend"] = backend
    result["runtime"] = runtime_name(backend, device)
    result["trunk_dtype"] = trunk_dtype
    result["chain_attention_why"] = why
    result["plan"] = plan.to_dict() if plan is not None else None
    return result


# ----------------------------------------------------------------------------------------------------------
# a side-by-side table of saved results (`make demo`'s heal story)


MAX_RESULT_BYTES = 16 << 20  # a saved result is a few kilobytes (with --probe-conventions a few more)
MAX_TABLE_DEPTH = 1024  # columns of the table; `accept --depth` is a few (a window's length at most)


def _number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def load_result(path) -> dict:
    """A saved `accept --json` result, read as untrusted input: a regular file of at most MAX_RESULT_BYTES of
    JSON with an integer depth in 1..MAX_TABLE_DEPTH, that many prefix acceptances, a number τ and an anchor
    count; AcceptError (one line naming the file) otherwise."""
    where = str(path)
    r = load_json(read_regular(path, "a saved accept --json result", AcceptError, MAX_RESULT_BYTES), where,
                  AcceptError)  # fmt: skip
    if not isinstance(r, dict):
        raise AcceptError(f"{where}: a JSON {type(r).__name__}, not a saved `accept --json` result")
    depth, prefix = r.get("depth"), r.get("prefix_acceptance")
    if not (isinstance(depth, int) and not isinstance(depth, bool) and 1 <= depth <= MAX_TABLE_DEPTH):
        raise AcceptError(
            f"{where}: 'depth' is {depth!r:.40}, not an integer between 1 and {MAX_TABLE_DEPTH}"
        )
    if not (isinstance(prefix, list) and len(prefix) == depth and all(_number(a) for a in prefix)):
        raise AcceptError(f"{where}: 'prefix_acceptance' is not a list of {depth} numbers (one per depth)")
    if not _number(r.get("acceptance_length")):
        raise AcceptError(f"{where}: 'acceptance_length' (tau) is not a number")
    anchors = r.get("anchors")
    if not (isinstance(anchors, int) and not isinstance(anchors, bool) and anchors >= 0):
        raise AcceptError(f"{where}: 'anchors' is not a non-negative integer")
    return r


def table(results: Sequence[tuple[str, dict]]) -> str:
    """[(label, accept JSON)] -> prefix acceptance per depth and τ, one row per result (`load_result`'s; a
    result less deep than another leaves its deeper cells blank)."""
    depth = max(r["depth"] for _, r in results)
    head = (
        f"{'':<12}" + "".join(f"{'A_' + str(j + 1):>9}" for j in range(depth)) + f"{'tau':>9}{'anchors':>9}"
    )
    rows = [head]
    for label, r in results:
        cells = "".join(f"{a:>9.4f}" for a in r["prefix_acceptance"]) + " " * 9 * (depth - r["depth"])
        rows.append(f"{label:<12}{cells}{r['acceptance_length']:>9.4f}{r['anchors']:>9}")
    return "\n".join(rows)
