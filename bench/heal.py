"""Heal throughput at a realistic shape: the trunk teacher's tokens/s and the MTP draft's seconds per step.

    python3 bench/heal.py                       # d 2048, vocab 151936, 4 layers, 4 x 128 (heal's defaults)
    python3 bench/heal.py --layers 28 --trunk-dtype f16   # the whole Qwen3-1.7B-like trunk in f16
    python3 bench/heal.py --d-model 4096        # Qwen3-8B-like blocks (32 heads, ffn 12288)
    python3 bench/heal.py --quick               # d 64, vocab 512, 2 layers, 2 x 32 (lavapipe smoke test)
    python3 bench/heal.py --shape qwen38-27b --trunk-dtype f16 --forward 16x1024   # the reference tool's job
    python3 bench/heal.py --shape qwen38-14b --trunk-dtype f16   # its compressed trunk (half the GDN layers)

`--shape` builds a Qwen3.5-family hybrid (`bench/hybrid.py`'s Qwen3.8-27B shape: 64 layers, 3 Gated DeltaNet :
1 gated attention, hidden 5120, FFN 17408, vocabulary 248320, untied) with its Qwen3.5 MTP draft (a gated
full-attention block with partial RoPE, post-norm hiddens as vLLM feeds them); `qwen38-14b` drops every other
Gated DeltaNet layer (`ddl_ref.config.select_layers`: 40 layers). Its weights are random (`common.RandomWeights`:
one tensor per shape) because the float32 init of 27 B parameters does not fit the host, and for the same
reason the float64 checks below are skipped at these shapes (they read "-", never "ok"); the kernels and the
whole hybrid engine are checked against the reference at small shapes by the tests. `--forward BxT` adds, on the
same loaded trunk, the forward of B x T tokens with the evaluation loss, its GPU memory and its GPU time per
layer type (`bench/hybrid.py forward_profile`). `--shape quick-hybrid` is a tiny hybrid for a lavapipe smoke run.

The model is built in memory with `ddl_ref.params.init_params(cfg, --seed)`: a Qwen3-like baseline trunk (tied
embedding, pre-RoPE q/k norm, GQA, SwiGLU) plus a one-layer MTP draft head. Nothing is read or written but the
JSON. The numbers come from the classes `ddl-wgpu heal --backend wgpu` runs (`ddl_wgpu.jobs.heal`), called as
`heal` calls them:

- trunk: `WgpuTeacher.topk_hidden(ids, k)` on one batch of --batch windows of --seq tokens: upload, forward,
  next-token top-k from chunked logits, download of the top-k and of both hidden rows (pre/post final norm).
  Tokens/s = B·T / (median wall-clock s per call).
- step-1 rows (GPU): `heal_gpu.DraftInput.rows` on the teacher's hidden rows still on the GPU after its forward
  (embedding gather from the trunk's table, enorm/hnorm, eh_proj; download of the rows), as
  `WgpuTeacher.topk_rows` builds the draft's step-1 block input of every batch; checked against the numpy
  `ddl_ref.mtp.step_input`, which is also timed ("host rows (numpy)": what heal ran before).
- refresh batch: `WgpuDraft.next_rows` (the draft's forward and the next step's rows from its output on the
  GPU), what heal's refresh runs for chain steps 2..chain of a batch of windows a job reads.
- held-out evaluation batch, per chain step j: `WgpuDraft.loss_sum` on the job's rows of step j (an evaluation
  whose rows a refresh built); and chained: `WgpuDraft.loss_chain`, every chain step of a stale batch right
  after a refresh, each step's rows built on the GPU from the forward of the step before and kept there, alone
  and per batch of a series of 16 (`loss_chains`, what heal's evaluations at a refresh run: the host prepares a
  batch while the GPU runs the one before; the epoch estimate's figure). Checked: the chained sums have the per-step sums' bits (the rows of
  steps 2.. are built as heal builds them, float16 as its cache holds them).
- acceptance chain: `WgpuDraft.greedy_chain` to depth --chain on the batch (accept's, and heal's acceptance
  before and after), every row on the GPU.
- draft: `WgpuDraft.step` for each chain step j = 1..--chain (one job of heal's list: forward, top-k KL,
  backward, gradient clip, Adam). With --chain-attention stacked step j stacks the rows of
  steps 1..j, so it runs j·B·T rows; "per-step" runs B·T. heal's jobs cycle uniformly over j, so the job-mix row
  is the mean of the per-step times. Tokens/s = B·T anchor tokens / (s per step).

Timing: every call ends synchronised (each one reads results back; a `gpu.wait()` follows) and is timed on
its own with `time.perf_counter`. After --warmup calls and `common.settle` (calls until the time stops
falling), the figure is the median of --steps calls (best and worst are in the JSON). "GPU ms" is the device
time alone, from timestamp queries (`common.gpu_time_ms`, its best repeat), over the Calls the library
records (`InferenceWork.topk`: forward + top-k; `DraftWork.step_rows`: zero-grads, forward, head + KL, backward,
optimizer), reached through private `Work` attributes as `bench/train_step.py` does; it reads '-' (the
error is in the JSON) if those change.

Work counted (model TFLOP/s): trunk 2·(block matrix params) + 2·C·V + 2·L·T·H·D (causal attention) per token;
draft 6·(block matrix params) + 4·C·V per row (the head is frozen: no dW), attention left out (< 1 % at
T <= 1024). "GPU mem" is what the library allocates through `Gpu.buffer` (`Gpu.allocated`):
parameters plus the activations and scratch of the Works built here (heal builds a few more for evaluation);
the draft's Net holds gradients and Adam moments of its trained tensors only, and reads the trunk's
embedding/head (`Net(shared=...)`): "total" is everything allocated at the end.

The epoch estimate (1 M window tokens): the trunk pass as heal runs it (`WgpuTeacher.topk_rows`: forward,
top-k, step-1 rows; timed as "heal's trunk pass"), the draft's jobs (chain per batch, 10 % of windows held
out), and the refresh batches heal's lazy refresh rebuilds: per --refresh steps those its jobs and its
held-out evaluation read, counted by running heal's job loop on a stand-in draft (`bench/heal_count.py`;
the eager rebuild of every batch at each refresh is in the JSON for comparison); and the held-out
evaluations (every --eval-every steps, at the start and at the last step: every held-out batch, chained where
the evaluation follows a refresh, else step by step). The acceptance measurements before and after are not
counted.

Checks (same run; any failure exits 1 after the table and the JSON): on the first --check-rows tokens of
window 0 (causal, so they do not depend on later tokens) against float64 numpy (`ddl_ref`):
- trunk: hidden rows pre/post (max|Δ| / max|ref|); the top-k probabilities, and the reference probability of
  every id the GPU returned (ties may reorder ids, never change these); with --trunk-dtype f16 the reference
  uses the same f16-rounded matrices.
- draft, each chain step j before timing it: the loss and gradient norm of one `WgpuDraft.step` on window 0
  (rows past --check-rows weighted 0) against `ddl_ref.mtp.draft_kl_forward/backward` on the weights
  `WgpuDraft.export` returns just before.

No PyTorch peer: heal has no PyTorch implementation in this repository.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (puts the repository root on sys.path)
import numpy as np  # noqa: E402
from heal_count import SERIES, evaluation_calls, evaluation_s, heal_rows, refresh_forwards  # noqa: E402
from hybrid import forward_profile, qwen38_27b  # noqa: E402

from ddl_ref import model as ref_model  # noqa: E402
from ddl_ref import mtp as ref_mtp  # noqa: E402
from ddl_ref import ops as ref_ops  # noqa: E402
from ddl_ref.config import ModelConfig, MtpConfig  # noqa: E402
from ddl_ref.optim import global_grad_norm  # noqa: E402
from ddl_ref.params import init_params, param_table  # noqa: E402
from ddl_wgpu import backend
from ddl_wgpu.engine.layout import is_f16_matrix  # noqa: E402
from ddl_wgpu.engine.step import draft_adamw  # noqa: E402
from ddl_wgpu.files.modelfile import Model  # noqa: E402
from ddl_wgpu.jobs import heal

TOL = 1e-4  # f32 GPU against float64 numpy
HEAL = heal.HealConfig()  # heal's defaults: batch, window, top-k, chain, lr
HEADS = ("model.embed_tokens.weight", "lm_head.weight")  # the shared head: whichever the model has


# ---------------------------------------------------------------------------------------------------------
# the model


SHAPES = ("qwen38-27b", "qwen38-14b", "quick-hybrid")


def shape_config(name: str, seq: int) -> ModelConfig:
    """A Qwen3.5-family hybrid with its MTP draft (module docstring)."""
    from ddl_ref.config import apply_arch, preset, select_layers

    draft = MtpConfig(trunk_hidden="post_norm", chain_hidden="post_norm")  # the Qwen3.5 layout's conventions
    if name == "quick-hybrid":
        cfg = apply_arch(preset("tiny", n_layers=4, vocab_size=512, max_seq_len=max(seq, 32)), "qwen3_5")
        return dataclasses.replace(cfg, tie_embeddings=False, mtp=draft)
    cfg = dataclasses.replace(qwen38_27b(64, max(seq, 1024)), mtp=draft)
    if name == "qwen38-14b":  # every other Gated DeltaNet layer dropped, every full-attention layer kept
        linear = [i for i in range(cfg.n_layers) if cfg.layer_type(i) == "linear_attention"]
        drop = set(linear[1::2])
        cfg = select_layers(cfg, [i for i in range(cfg.n_layers) if i not in drop])
    return cfg


def model_config(args) -> ModelConfig:
    """Qwen3-like: rope 1e6, eps 1e-6, pre-RoPE q/k norm, tied embedding; a one-layer draft (DeepSeek-V3/Qwen
    concatenation, pre-norm hiddens, the MtpConfig defaults). With --shape, that hybrid."""
    if args.shape:
        return shape_config(args.shape, args.seq)
    return ModelConfig(
        vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
        n_kv_heads=args.kv_heads, head_dim=args.head_dim, ffn_hidden=args.ffn, max_seq_len=args.seq,
        rope_theta=1e6, rms_eps=1e-6, tie_embeddings=True, qk_norm="pre_rope", mtp=MtpConfig(),
    )  # fmt: skip


def matrix_params(cfg: ModelConfig, prefix: str) -> int:
    return sum(s.numel for s in param_table(cfg) if s.name.startswith(prefix) and len(s.shape) == 2)


def trunk_flops_per_token(cfg: ModelConfig, T: int) -> float:
    C, V = cfg.d_model, cfg.vocab_size
    attn = 2.0 * cfg.n_layers * T * cfg.n_heads * cfg.head_dim
    return 2.0 * matrix_params(cfg, "model.layers.") + 2.0 * C * V + attn


def draft_flops_per_row(cfg: ModelConfig) -> float:
    return 6.0 * matrix_params(cfg, ref_mtp.MTP_LAYER_PREFIX) + 4.0 * cfg.d_model * cfg.vocab_size


# ---------------------------------------------------------------------------------------------------------
# timing


def wall_ms(gpu, fn, warmup: int, steps: int) -> dict:
    """Median wall-clock ms of one synchronised `fn()` over `steps` calls, each timed alone. Before them,
    `warmup` calls, then calls until one is no longer 3 % faster than the one before (`common.settle`): the
    H200's clocks drop while the host computes the float64 checks."""

    def once(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        gpu.wait()
        return (time.perf_counter() - t0) * 1e3 / n

    for _ in range(warmup):
        fn()
    common.settle(once, 1)
    times = [once(1) for _ in range(steps)]
    return {"ms": common.median(times), "min_ms": min(times), "max_ms": max(times), "calls": steps}


def gpu_ms(gpu, make_call, quick: bool) -> dict:
    """GPU time of the Call `make_call()` returns; {'error': ...} when the library's internals moved."""
    try:
        call = make_call()
    except Exception as e:
        return {"error": f"{e.__class__.__name__}: {e}"}
    return common.gpu_time_ms(gpu, [call], target_ms=5.0 if quick else 40.0)


# ---------------------------------------------------------------------------------------------------------
# the trunk


def bench_trunk(gpu, model: Model, ids, args) -> tuple[dict, tuple, object]:
    """-> (timings and memory, the last `topk_hidden` outputs, the teacher)."""
    a0 = gpu.allocated
    teacher = backend.make_teacher("wgpu", model, args.batch, args.device, args.trunk_dtype)
    r = {"param_bytes": gpu.allocated - a0}
    a1, t0 = gpu.allocated, time.perf_counter()
    out = teacher.topk_hidden(ids, args.k)  # builds the Work and compiles its pipelines
    r["first_call_s"] = time.perf_counter() - t0
    r["work_bytes"] = gpu.allocated - a1
    r.update(wall_ms(gpu, lambda: teacher.topk_hidden(ids, args.k), args.warmup, args.steps))
    work = teacher.work(args.seq)
    # as InferenceWork.topk records
    r["gpu"] = gpu_ms(gpu, lambda: work._fwd + work._topk[args.k][0], args.quick)
    return r, out, teacher


def check_trunk(model: Model, ids, out, args) -> dict:
    """The GPU teacher's window 0, first n tokens, against float64 `ddl_ref` on the same (rounded) weights."""
    cfg, n, k = model.cfg, args.check_rows, args.k

    def f64(name, a):
        if args.trunk_dtype == "f16" and is_f16_matrix(name, a.shape):
            a = a.astype(np.float16)
        return a.astype(np.float64)

    p64 = {name: f64(name, a) for name, a in model.params.items() if not name.startswith(ref_mtp.MTP_PREFIX)}
    rpre, rpost, _ = ref_model.trunk_forward(p64, cfg, ids[:1, :n])
    logits = ref_ops.linear_forward(rpost[0], ref_mtp.head_weight(p64, cfg))  # (n, V)
    del p64
    rids, rprobs = ref_mtp.topk_probs(logits, k)
    gids, gprobs, gpre, gpost = (a[0, :n] for a in out)
    lse = ref_ops.logsumexp(logits, axis=-1, keepdims=True)
    p_at = np.exp(np.take_along_axis(logits, gids.astype(np.int64), axis=-1) - lse)  # ref prob of GPU ids
    r = {
        "rows": n,
        "hidden_err": max(common.rel_err(gpre, rpre[0]), common.rel_err(gpost, rpost[0])),
        "topk_probs_err": common.rel_err(gprobs, rprobs),
        "topk_ids_err": common.rel_err(gprobs, p_at),
        "argmax_agree": float((gids[:, 0] == rids[:, 0]).mean()),
    }
    r["err"] = max(r["hidden_err"], r["topk_probs_err"], r["topk_ids_err"])
    r["ok"] = bool(r["err"] <= TOL)
    return r


# ---------------------------------------------------------------------------------------------------------
# the draft


class Jobs:
    """The draft's inputs for chain steps 1..chain, built as `heal` builds them (step 1 on the GPU from the
    teacher's hidden rows, `DraftInput`; step j > 1 from the draft's own step j−1 output, `next_rows`), and one
    job per step as heal's `join`."""

    def __init__(self, model: Model, teacher, draft, ids, out, args):
        self.args, self.T = args, args.seq
        gpu = draft.net.gpu
        self.lengths = np.full(args.batch, args.seq)
        self.top_ids, self.top_probs = out[0], out[1]
        mtp, cfg = model.cfg.mtp, model.cfg
        p = {**model.params, **frozen_as_stored(model, args)}  # the embedding the GPU rows gather from

        def tok_valid(j):
            return ref_mtp.shifted(ids, j), ref_mtp.step_valid(self.lengths, self.T, j)

        def host_rows(j, hid):
            return ref_mtp.step_input(p, cfg, *tok_valid(j)[:1], hid, tok_valid(j)[1])

        # the teacher's hidden rows of `ids` are on the GPU after its last forward (bench_trunk's)
        work = teacher.work(args.seq)
        hid_buf = work.xL if mtp.trunk_hidden == "pre_norm" else work.xf

        def gpu_rows():
            return teacher.input.rows(*tok_valid(1), hid_buf)

        x1 = gpu_rows()
        self.gpu_rows = wall_ms(gpu, gpu_rows, args.warmup, args.steps)
        self.gpu_rows["gpu"] = gpu_ms(gpu, lambda: next(iter(teacher.input._calls.values()))[0], args.quick)
        hid = ref_mtp.pick_hidden(out[2], out[3], mtp.trunk_hidden)
        self.host = wall_ms(gpu, lambda: host_rows(1, hid), args.warmup, args.steps)
        err = common.rel_err(x1, host_rows(1, hid))  # the reference rows on the GPU's (rounded) hidden
        self.rows_check = {"err": err, "ok": bool(err <= TOL)}
        self.x = heal_rows(draft, x1, tok_valid, args.chain, args.chain_attention == "stacked")
        self.refresh = wall_ms(gpu, lambda: draft.next_rows(x1, *tok_valid(2)), args.warmup, args.steps)
        # a held-out evaluation batch: each chain step's KL forward on rows already built, and the whole chain
        # of a stale batch right after a refresh, each step's rows built from the forward before
        jobs = {
            j: (*self.job(j), tok_valid(j + 1) if j < args.chain else None) for j in range(1, args.chain + 1)
        }
        per_step, chained, series = evaluation_calls(draft, jobs, args.chain_attention == "stacked")
        self.evals = {j: wall_ms(gpu, call, args.warmup, args.steps) for j, call in per_step.items()}
        self.eval_chain = wall_ms(gpu, chained, args.warmup, args.steps)
        self.eval_chain["series_ms"] = wall_ms(gpu, series, args.warmup, args.steps)["ms"] / SERIES
        self.eval_chain["same_bits"] = series()[-1] == chained() == [call() for call in per_step.values()]
        # the trunk pass as heal runs it: forward, top-k, the step-1 rows (no hidden rows downloaded)
        self.pass_ = wall_ms(
            gpu, lambda: teacher.topk_rows(ids, self.lengths, args.k), args.warmup, args.steps
        )

    def stacked(self, j: int) -> int:
        """How many chain steps' rows the step-j job stacks (1 in per-step mode and for step 1)."""
        return j if self.args.chain_attention == "stacked" else 1

    def job(self, j: int):
        """-> (x, teacher ids, teacher probs, weights, keywords) of step j on the whole batch."""
        tid = ref_mtp.shifted(self.top_ids, j)
        tp = ref_mtp.shifted(self.top_probs, j, fill=1.0)  # masked rows: any finite distribution
        w = ref_mtp.step_valid(self.lengths, self.T, j).astype(np.float32)
        s = self.stacked(j)
        if s == 1:
            return self.x[j], tid, tp, w, {}
        pad = (s - 1) * self.T  # steps < j carry K/V only: weight 0
        B, k = self.args.batch, tid.shape[-1]
        tid = np.concatenate([np.zeros((B, pad, k), tid.dtype), tid], axis=1)
        tp = np.concatenate([np.ones((B, pad, k), tp.dtype), tp], axis=1)
        w = np.concatenate([np.zeros((B, pad), w.dtype), w], axis=1)
        return np.concatenate([self.x[i] for i in range(1, j + 1)], axis=1), tid, tp, w, {"chain": j}

    def check_job(self, j: int):
        """Window 0 of step j's job with the rows at positions >= check_rows weighted 0 (for the GPU), and
        the same window cut to those positions in every stacked step (for the reference)."""
        x, tid, tp, w, kw = (a[:1] if isinstance(a, np.ndarray) else a for a in self.job(j))
        s, n = self.stacked(j), self.args.check_rows
        w = w.copy()
        w.reshape(s, self.T)[:, n:] = 0.0

        def cut(a):
            return a.reshape(1, s, self.T, *a.shape[2:])[:, :, :n].reshape(1, s * n, *a.shape[2:])

        return (x, tid, tp, w, kw), (cut(x), cut(tid), cut(tp), cut(w), kw)


def frozen_as_stored(model: Model, args) -> dict:
    """The embedding/head the draft reads, as the GPU holds them: the trunk's tensors (shared), rounded to f16
    under --trunk-dtype f16."""
    out = {}
    for n in HEADS:
        if n in model.params:
            a = model.params[n]
            f16 = args.trunk_dtype == "f16" and is_f16_matrix(n, a.shape)
            out[n] = a.astype(np.float16).astype(np.float32) if f16 else a
    return out


def check_draft_step(draft, model: Model, jobs: Jobs, j: int, step: int, head64: dict) -> dict:
    """One `WgpuDraft.step` on window 0 against float64 `ddl_ref` on the weights the draft holds before it."""
    cfg = model.cfg
    p64 = {**{n: a.astype(np.float64) for n, a in draft.export().items()}, **head64}
    gpu_job, (x, tid, tp, w, kw) = jobs.check_job(j)
    count = float(w.sum())
    kl, cache = ref_mtp.draft_kl_forward(p64, cfg, x.astype(np.float64), tid, tp, w, kw.get("chain", 0))
    _dx, grads = ref_mtp.draft_kl_backward(p64, cfg, cache, 1.0 / count)
    ref_loss, ref_norm = kl / count, global_grad_norm(grads)
    x, tid, tp, w, kw = gpu_job
    loss, norm, finite = draft.step(x, tid, tp, w, HEAL.lr, step, heal.LOSS_SCALE_START, **kw)
    r = {"weighted_rows": count, "loss": loss, "ref_loss": ref_loss, "grad_norm": norm,
         "ref_grad_norm": ref_norm, "loss_err": common.rel_err(loss, ref_loss),
         "grad_norm_err": common.rel_err(norm, ref_norm)}  # fmt: skip
    r["err"] = max(r["loss_err"], r["grad_norm_err"])
    r["ok"] = bool(finite and r["err"] <= TOL)
    return r


def bench_draft(gpu, model: Model, teacher, ids, out, args, progress) -> dict:
    a0 = gpu.allocated
    draft = backend.make_draft("wgpu", model, None, args.batch, args.device, teacher=teacher)
    r = {"param_bytes": gpu.allocated - a0, "steps": {}}
    a1 = gpu.allocated
    jobs = Jobs(model, teacher, draft, ids, out, args)
    r["host_rows"], r["gpu_rows"], r["refresh_batch"] = jobs.host, jobs.gpu_rows, jobs.refresh
    r["trunk_pass"] = jobs.pass_
    r["eval_batch"], r["eval_chain"] = jobs.evals, jobs.eval_chain
    r["rows_check"] = jobs.rows_check
    # accept's greedy chain on the batch, every row on the GPU, as heal measures acceptance before and after
    hidden = teacher.greedy_hidden(ids, model.cfg.mtp.trunk_hidden)[1]
    tok, valid = ref_mtp.shifted(ids, 1), ref_mtp.step_valid(jobs.lengths, args.seq, 1)
    stacked = args.chain_attention == "stacked"
    r["accept_chain"] = wall_ms(gpu, lambda: draft.greedy_chain(hidden, tok, valid, args.chain, stacked),
                                args.warmup, args.steps)  # fmt: skip
    evals = ", ".join(f"{e['ms']:.2f}" for e in jobs.evals.values())
    progress(f"  step-1 rows: GPU {jobs.gpu_rows['ms']:.2f} ms, numpy {jobs.host['ms']:.2f} ms per batch, "
             f"check {_status(jobs.rows_check)}; refresh batch {jobs.refresh['ms']:.2f} ms; held-out evaluation "
             f"batch per chain step {evals} ms, chained {jobs.eval_chain['ms']:.2f} ms alone, "
             f"{jobs.eval_chain['series_ms']:.2f} ms in a series of {SERIES} "
             f"({'the' if jobs.eval_chain['same_bits'] else 'NOT the'} per-step sums' bits); acceptance chain "
             f"{r['accept_chain']['ms']:.2f} ms")  # fmt: skip
    head64 = (
        {} if args.no_check else {n: a.astype(np.float64) for n, a in frozen_as_stored(model, args).items()}
    )
    steps = itertools.count(1)  # Adam's step counter, across every chain step as in heal's job loop
    for j in range(1, args.chain + 1):
        x, tid, tp, w, kw = jobs.job(j)
        e = {"rows": x.shape[0] * x.shape[1]}
        e["check"] = None if args.no_check else check_draft_step(draft, model, jobs, j, next(steps), head64)
        losses = []

        def one(x=x, tid=tid, tp=tp, w=w, kw=kw, losses=losses):
            loss, _norm, finite = draft.step(x, tid, tp, w, HEAL.lr, next(steps), heal.LOSS_SCALE_START, **kw)
            losses.append(loss if finite else math.nan)

        e.update(wall_ms(gpu, one, args.warmup, args.steps))
        e["finite"] = bool(np.all(np.isfinite(losses)))
        e["last_loss"] = losses[-1]
        work = draft._work(x.shape[1], args.k, kw.get("chain", 0))

        def step_call(work=work):  # as DraftWork.step_rows records one training step
            upd = draft_adamw(HEAL.lr, next(steps))
            return SimpleNamespace(record=lambda rec: work.record_step(rec, upd))

        e["gpu"] = gpu_ms(gpu, step_call, args.quick)
        r["steps"][j] = e
        progress(f"  draft chain step {j}: {e['rows']} rows, {e['ms']:.2f} ms/step (median of {e['calls']}), "
                 f"check {_status(e['check'])}")  # fmt: skip
    r["work_bytes"] = gpu.allocated - a1
    return r


# ---------------------------------------------------------------------------------------------------------
# driver


def _status(c: dict | None) -> str:
    if c is None:
        return "-"
    return f"{'ok' if c['ok'] else 'FAIL'} {c['err']:.1e}"


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="d 64, vocab 512, 2 layers, 2 x 32 (lavapipe smoke)")
    ap.add_argument("--d-model", type=int, default=None, help="default 2048 (64 with --quick)")
    ap.add_argument("--vocab", type=int, default=None, help="default 151936, Qwen's (512 with --quick)")
    ap.add_argument("--layers", type=int, default=None, help="trunk blocks (default 4; 2 with --quick)")
    ap.add_argument("--head-dim", type=int, default=None, help="default 128 (16 with --quick)")
    ap.add_argument("--heads", type=int, default=None, help="default d_model / head_dim")
    ap.add_argument("--kv-heads", type=int, default=None, help="default min(8, heads / 2)")
    ap.add_argument("--ffn", type=int, default=None, help="SwiGLU hidden (default 3 x d_model, as Qwen3)")
    ap.add_argument(
        "--batch", type=int, default=None, help=f"windows per step (default {HEAL.batch}; 2 with --quick)"
    )
    ap.add_argument(
        "--seq", type=int, default=None, help=f"window tokens (default {HEAL.window}; 32 with --quick)"
    )
    ap.add_argument("--topk", type=int, default=HEAL.topk, help="teacher top-k width (default heal's)")
    ap.add_argument("--chain", type=int, default=HEAL.chain, help="chain steps timed (default heal's)")
    # per-step: the BENCHMARKS rows' (heal's own default follows the draft's layout: stacked for these shapes')
    ap.add_argument("--chain-attention", default="per-step", choices=heal.CHAIN_ATTENTION)
    ap.add_argument("--trunk-dtype", default=HEAL.trunk_dtype, choices=heal.TRUNK_DTYPES)
    ap.add_argument("--refresh", type=int, default=HEAL.refresh, help="heal's refresh period (the estimate)")
    ap.add_argument(
        "--steps", type=int, default=None, help="timed calls per measurement (default 10; 3 with --quick)"
    )
    ap.add_argument("--warmup", type=int, default=None, help="warm-up calls (default 2; 1 with --quick)")
    ap.add_argument(
        "--check-rows", type=int, default=None, help="window-0 tokens checked (default 64; 16 quick)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None, help="wgpu adapter (index or name substring)")
    ap.add_argument(
        "--shape", default=None, choices=SHAPES, help="a Qwen3.5-family hybrid (module docstring)"
    )
    ap.add_argument("--forward", default=None, help="BxT: also time a forward of B x T tokens on the trunk")
    ap.add_argument(
        "--gpu-memory",
        default=None,
        help="SIZE: heal's trunk pass resident and streamed within SIZE, then the draft (bench/heal_stream.py)",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="with --gpu-memory: GPU ms per phase and kernel of each chain step's draft step and evaluation",
    )
    ap.add_argument(
        "--pass-windows",
        type=int,
        default=None,
        help="windows of the --gpu-memory trunk passes (default: two resident blocks)",
    )
    ap.add_argument(
        "--smi-every",
        type=float,
        default=0.2,
        help="with --gpu-memory: seconds between nvidia-smi's memory samples (0: none, for timings undisturbed "
        "by its driver queries)",
    )
    ap.add_argument(
        "--no-check", action="store_true", help="skip the float64 checks (implied by --shape qwen38-*)"
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    q = args.quick
    if args.shape:  # the shape's sizes (the float64 reference of a 17-27 B model does not fit the host)
        big = args.shape.startswith("qwen38")
        args.no_check = args.no_check or big
        q = args.quick = args.quick or not big
        cfg = shape_config(args.shape, args.seq or (HEAL.window if big else 32))
        args.d_model, args.vocab, args.layers, args.ffn = (
            cfg.d_model,
            cfg.vocab_size,
            cfg.n_layers,
            cfg.ffn_hidden,
        )
        args.head_dim, args.heads, args.kv_heads = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    args.d_model = args.d_model or (64 if q else 2048)
    args.vocab = args.vocab or (512 if q else 151936)
    args.layers = args.layers or (2 if q else 4)
    args.head_dim = args.head_dim or (16 if q else 128)
    args.heads = args.heads or args.d_model // args.head_dim
    args.kv_heads = args.kv_heads or min(8, max(args.heads // 2, 1))
    args.ffn = args.ffn or 3 * args.d_model
    args.batch = args.batch or (2 if q else HEAL.batch)
    args.seq = args.seq or (32 if q else HEAL.window)
    args.steps = args.steps or (3 if q else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if q else 2)
    args.k = min(args.topk, args.vocab)  # as heal clamps it
    args.check_rows = min(args.check_rows or (16 if q else 64), args.seq)
    return args


def main(argv=None) -> int:
    args = parse(argv)
    B, T = args.batch, args.seq
    print(f"heal bench: d_model {args.d_model}, vocab {args.vocab}, {args.layers} trunk layers + 1 draft "
          f"layer, heads {args.heads}/{args.kv_heads} x {args.head_dim}, ffn {args.ffn}; batch {B} x seq "
          f"{T}, top-k {args.k}, chain {args.chain} ({args.chain_attention}), trunk {args.trunk_dtype}; "
          f"{args.warmup} warm-up + {args.steps} timed calls; check {args.check_rows} rows, seed {args.seed}",
          flush=True)  # fmt: skip
    t_start = time.perf_counter()

    def progress(line: str) -> None:
        print(line, flush=True)

    # heal's backends open their device through `backend.open_gpu` (one per adapter choice): the same one
    # here, so the bench reports that device and `gpu.allocated` counts what both backends allocate
    gpu = backend.open_gpu(args.device)
    # an f16 trunk's products on the matrix units now, as heal's teacher will put them: the line says so
    backend.trunk_products(gpu, args.trunk_dtype)
    progress(f"adapter: {common.adapter_line(gpu)}")
    cfg = model_config(args)
    t0 = time.perf_counter()
    model = Model(
        cfg,
        common.RandomWeights(cfg, args.seed, f16=args.trunk_dtype == "f16")
        if args.shape
        else init_params(cfg, args.seed),
    )
    n_trunk = sum(a.size for n, a in model.params.items() if not n.startswith(ref_mtp.MTP_PREFIX))
    n_draft = sum(a.size for n, a in model.params.items() if n.startswith(ref_mtp.MTP_PREFIX))
    progress(f"model: {n_trunk / 1e6:.1f}M trunk + {n_draft / 1e6:.1f}M draft parameters, "
             f"initialised in {time.perf_counter() - t0:.1f}s")  # fmt: skip
    ids = np.random.default_rng(args.seed + 1).integers(0, cfg.vocab_size, (B, T)).astype(np.int64)

    if args.gpu_memory:
        return main_memory(args, model, gpu, progress, t_start)
    failed: list[str] = []
    trunk = draft = error_tb = None
    try:
        trunk, out, teacher = bench_trunk(gpu, model, ids, args)
        progress(f"  trunk: {trunk['ms']:.2f} ms per batch (median of {trunk['calls']}; first call "
                 f"{trunk['first_call_s']:.1f}s)")  # fmt: skip
        trunk["check"] = None if args.no_check else check_trunk(model, ids, out, args)
        c = trunk["check"]
        if c is not None:
            progress(f"  trunk check: {_status(c)} (hidden {c['hidden_err']:.1e}, top-k probs "
                     f"{c['topk_probs_err']:.1e}, ids {c['topk_ids_err']:.1e})")  # fmt: skip
        if args.forward:
            fb, ft = (int(x) for x in args.forward.lower().split("x"))
            trunk["forward"] = forward_profile(gpu, teacher.trunk, fb, ft)
            f = trunk["forward"]
            progress(f"  forward {fb} x {ft}: {f['forward_ms']:.1f} ms, {f['tokens_per_s'] / 1e3:.2f}K tokens/s, "
                     f"our buffers {f['ours_gib']:.1f} GiB; ms per layer "
                     f"{', '.join(f'{k} {v:.2f}' for k, v in f['ms_per_layer'].items())}")  # fmt: skip
        draft = bench_draft(gpu, model, teacher, ids, out, args, progress)
    except Exception as e:
        failed.append(f"{e.__class__.__name__}: {e}")
        error_tb = traceback.format_exc()
        print(error_tb, file=sys.stderr)

    tok = B * T
    rows, mix = [], []
    trunk_fpt = trunk_flops_per_token(cfg, T)
    draft_fpr = draft_flops_per_row(cfg)
    if trunk is not None:
        trunk["tokens_per_s"] = tok / (trunk["ms"] / 1e3)
        trunk["model_tflops"] = trunk_fpt * trunk["tokens_per_s"] / 1e12
        mem = (trunk["param_bytes"] + trunk["work_bytes"]) / 1e9
        check = trunk.get("check")
        rows.append(["trunk forward + top-k + hidden", f"{B}x{T} tok, k {args.k}", f"{trunk['ms']:.2f}",
                     f"{trunk['tokens_per_s']:,.0f}", "-", common.fmt(trunk["gpu"].get("ms"), ".3g"),
                     f"{trunk['model_tflops']:.3g}", f"{mem:.3g}", _status(check)])  # fmt: skip
        if check is not None and not check["ok"]:
            failed.append(f"trunk check: error {check['err']:.2e} > {TOL:.0e}")
    if draft is not None:
        h, gr, rb = draft["host_rows"], draft["gpu_rows"], draft["refresh_batch"]
        rows.append(["draft step-1 rows on the GPU", f"{B}x{T} tok", f"{gr['ms']:.2f}",
                     f"{tok / (gr['ms'] / 1e3):,.0f}", "-", common.fmt(gr["gpu"].get("ms"), ".3g"), "-", "-",
                     _status(draft["rows_check"])])  # fmt: skip
        rows.append(["  (before: the same rows in numpy)", f"{B}x{T} tok", f"{h['ms']:.2f}",
                     f"{tok / (h['ms'] / 1e3):,.0f}", "-", "-", "-", "-", "-"])  # fmt: skip
        tp = draft["trunk_pass"]
        rows.append(["heal's trunk pass (topk_rows: + rows)", f"{B}x{T} tok", f"{tp['ms']:.2f}",
                     f"{tok / (tp['ms'] / 1e3):,.0f}", "-", "-", "-", "-", "-"])  # fmt: skip
        rows.append(["refresh batch (draft forward + rows)", f"{B}x{T} tok", f"{rb['ms']:.2f}",
                     f"{tok / (rb['ms'] / 1e3):,.0f}", "-", "-", "-", "-", "-"])  # fmt: skip
        ec = draft["eval_chain"]
        for label, ms in (("alone", ec["ms"]), (f"in a series of {SERIES}", ec["series_ms"])):
            rows.append([f"held-out evaluation batch, chained, {label}", f"{B}x{T} tok x {args.chain}",
                         f"{ms:.2f}", f"{tok / (ms / 1e3):,.0f}", "-", "-", "-", "-",
                         "same bits" if ec["same_bits"] else "FAILED"])  # fmt: skip
        if not draft["rows_check"]["ok"]:
            failed.append(f"step-1 rows check: error {draft['rows_check']['err']:.2e} > {TOL:.0e}")
        if not ec["same_bits"]:
            failed.append("the chained held-out evaluation: not the per-step sums' bits")
        mem = (draft["param_bytes"] + draft["work_bytes"]) / 1e9
        for j, e in draft["steps"].items():
            s = e["ms"] / 1e3
            mix.append(s)
            e["s_per_step"], e["tokens_per_s"] = s, tok / s
            e["model_tflops"] = draft_fpr * e["rows"] / s / 1e12
            rows.append([f"draft step, chain step {j}", f"{e['rows']} rows", f"{e['ms']:.2f}",
                         f"{e['tokens_per_s']:,.0f}", f"{s:.4g}", common.fmt(e["gpu"].get("ms"), ".3g"),
                         f"{e['model_tflops']:.3g}", f"{mem:.3g}", _status(e["check"])])  # fmt: skip
            if e["check"] is not None and not e["check"]["ok"]:
                failed.append(f"draft chain step {j} check: error {e['check']['err']:.2e} > {TOL:.0e}")
            if not e["finite"]:
                failed.append(f"draft chain step {j}: non-finite loss")
        s = sum(mix) / len(mix)
        draft["job_mix_s_per_step"] = s
        rows.append([f"draft step, job mix (mean of {len(mix)})", f"{B}x{T} tok", f"{s * 1e3:.2f}",
                     f"{tok / s:,.0f}", f"{s:.4g}", "-", "-", f"{mem:.3g}", "-"])  # fmt: skip
    estimate = None
    if trunk is not None and draft is not None:
        # one epoch of heal over 1 M window tokens: the trunk pass and step-1 rows once, `chain` jobs per
        # training batch (9 windows in 10), and the refresh batches heal's lazy refresh rebuilds (those its jobs
        # and evaluations read each --refresh steps), counted by heal's own job loop (`heal_count.py`)
        batches = 1e6 / tok
        run = heal.HealConfig(chain=args.chain, refresh=args.refresh, window=T, batch=B,
                              chain_attention=args.chain_attention)  # fmt: skip
        windows = round(1e6 / T)
        lazy = refresh_forwards(windows, run)
        eager = lazy["refreshes"] * (args.chain - 1) * lazy["batches"]  # every batch of windows each time
        rb_s = draft["refresh_batch"]["ms"] / 1e3
        estimate = {
            "trunk_s": batches * draft["trunk_pass"]["ms"] / 1e3,
            "draft_s": lazy["steps"] * draft["job_mix_s_per_step"],
            "steps": lazy["steps"],
            "refreshes": lazy["refreshes"],
            "refresh_forwards": lazy["forwards"],
            "refresh_s": lazy["forwards"] * rb_s,
            "eager_refresh_forwards": eager,  # before: every window at every refresh
            "eager_refresh_s": eager * rb_s,
            "evaluations": lazy["evaluations"],  # each: chain steps x the held-out batches
            "eval_built": lazy["eval_built"],  # rows evaluations built from their own forwards
            "eval_s": evaluation_s(
                lazy,
                args.chain,
                draft["eval_chain"]["series_ms"] / 1e3,
                sum(e["ms"] for e in draft["eval_batch"].values()) / 1e3,
            ),
        }
        estimate["total_s"] = sum(estimate[k] for k in ("trunk_s", "draft_s", "refresh_s", "eval_s"))

    headers = ["measurement", "shape", "ms", "tokens/s", "s/step", "GPU ms", "model TFLOP/s", "GPU mem GB",
               "check (err)"]  # fmt: skip
    data = {
        "bench": "heal", "date": common.now_iso(),
        "command": " ".join(["python3", "bench/heal.py", *sys.argv[1:]]),
        "adapter": common.adapter_line(gpu), "adapter_info": gpu.info, "host": common.host_info(),
        "model": cfg.to_dict(), "trunk_params": n_trunk, "draft_params": n_draft,
        "args": vars(args), "heal_defaults": HEAL.to_dict(), "tol": TOL,
        "trunk_flops_per_token": trunk_fpt, "draft_flops_per_row": draft_fpr,
        "trunk": trunk, "draft": draft, "estimate_per_1M_tokens": estimate,
        "failed": failed, "traceback": error_tb, "wall_s": time.perf_counter() - t_start,
        "gpu_allocated_bytes": gpu.allocated,
    }  # fmt: skip
    common.write_json(common.json_path(args.json, "heal.json"), data)
    print()
    print(f"adapter: {data['adapter']}")
    title = (f"heal (d {args.d_model}, vocab {args.vocab}, {args.layers} trunk layers, "
             f"trunk {args.trunk_dtype}, chain {args.chain_attention})")  # fmt: skip
    print(common.table(headers, rows, title=title))
    print(f"GPU memory allocated (Gpu.allocated, trunk + draft + works): {gpu.allocated / 1e9:.3f} GB")
    if estimate is not None:
        e = estimate
        print(f"one heal epoch over 1M window tokens: {e['total_s']:.1f}s = trunk pass with step-1 rows "
              f"{e['trunk_s']:.1f}s, draft {e['draft_s']:.1f}s ({e['steps']:.0f} steps), refresh "
              f"{e['refresh_s']:.1f}s ({e['refresh_forwards']} refresh batches rebuilt lazily over "
              f"{e['refreshes']} refreshes every {args.refresh} steps; eager: {e['eager_refresh_forwards']}, "
              f"{e['eager_refresh_s']:.1f}s), held-out evaluation {e['eval_s']:.1f}s ({e['evaluations']} "
              f"evaluations, {e['eval_built']} chain steps of held-out batches built by their forwards); "
              f"the acceptance measurements not counted")  # fmt: skip
    verdict = "all checks passed" if not failed else "FAILED: " + "; ".join(failed)
    print(f"total {data['wall_s']:.0f}s; {verdict}")
    return 1 if failed else 0


STALL_DUMP_S = 150  # --gpu-memory: every thread's stack to stderr each time this long passes


def main_memory(args, model, gpu, progress, t_start) -> int:
    """--gpu-memory: `heal_stream.run`'s phases, its table and JSON; exit 1 when a streamed pass's bits differ."""
    import faulthandler

    import heal_stream

    # a pass that stalls on a real GPU (a mapped upload ring did, 2026-12-03) leaves every thread's stack in the log
    faulthandler.dump_traceback_later(STALL_DUMP_S, repeat=True)
    failed, r, error_tb = [], None, None
    try:
        r = heal_stream.run(args, model, gpu, progress)
        failed += [
            f"{e['label']}: not the resident pass's bits" for e in r["phases"] if e.get("same_bits") is False
        ]
        if not r["draft"]["eval_chain_same_bits"]:
            failed.append("the chained held-out evaluation: not the per-step sums' bits")
    except Exception as e:
        failed.append(f"{e.__class__.__name__}: {e}")
        error_tb = traceback.format_exc()
        print(error_tb, file=sys.stderr)
    data = {
        "bench": "heal-gpu-memory", "date": common.now_iso(),
        "command": " ".join(["python3", "bench/heal.py", *sys.argv[1:]]),
        "adapter": common.adapter_line(gpu), "adapter_info": gpu.info, "host": common.host_info(),
        "model": model.cfg.to_dict(), "args": vars(args), "gpu_memory": r, "failed": failed, "traceback": error_tb,
        "wall_s": time.perf_counter() - t_start,
    }  # fmt: skip
    faulthandler.cancel_dump_traceback_later()
    common.write_json(common.json_path(args.json, "heal_gpu_memory.json"), data)
    print()
    print(f"adapter: {data['adapter']}")
    if r is not None:
        headers, rows = heal_stream.rows(r)
        title = (f"heal's trunk pass within --gpu-memory {args.gpu_memory} (d {args.d_model}, {args.layers} layers, "
                 f"trunk {args.trunk_dtype}, {r['windows']} windows x {args.seq})")  # fmt: skip
        print(common.table(headers, rows, title=title))
        e = r["estimate"]
        print(f"one heal epoch over 1M window tokens, streamed: {e['total_s']:.0f}s = trunk pass {e['trunk_s']:.0f}s, "
              f"draft {e['draft_s']:.0f}s ({e['steps']:.0f} steps), refresh {e['refresh_s']:.0f}s "
              f"({e['refresh_forwards']} refresh batches), held-out evaluation {e['eval_s']:.0f}s "
              f"({e['evaluations']} evaluations of {e['heldout_batches']} batches); the acceptance measurements "
              "not counted")  # fmt: skip
    verdict = "all checks passed" if not failed else "FAILED: " + "; ".join(failed)
    print(f"total {data['wall_s']:.0f}s; {verdict}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
