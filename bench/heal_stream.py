"""`bench/heal.py --gpu-memory SIZE`: heal's trunk pass resident and streamed within SIZE in one call, then the
draft's phase after the streamed trunk is released.

    python3 bench/heal.py --shape qwen38-27b --trunk-dtype f16 --gpu-memory 16GB    # the issue's measurement
    python3 bench/heal.py --shape quick-hybrid --gpu-memory 2MB                      # lavapipe smoke run

Phases, one after the other on one device, each starting from what the one before released:
- resident: heal's plan without a budget (`gpumem.plan_trunk`: every layer uploaded once, blocks of
  BLOCK_TOKENS), then `heal._trunk_pass` over --pass-windows windows of --seq tokens (default: three resident
  blocks), as heal runs it (forward, top-k, the draft's step-1 rows downloaded); tokens/s over the blocks after
  the first (which compiles the kernels and, streamed, starts the uploads);
- streamed: heal's plan within SIZE, the same pass; its top-k and rows compared with the resident pass's bit for
  bit (the "same bits" column; a difference fails the run), and how long the host waited on the uploads;
- draft: after the streamed trunk is released (`WgpuTeacher.release`), heal's draft on its resident
  embedding/head, one training step per chain step (the first of each untimed), as `bench/heal.py` times them;
  with --profile, each chain step's training step and evaluation again with every dispatch timed alone
  (`profiler.profile_parts`): GPU ms per phase (forward, head and KL, backward, ...) and the largest kernels.

Per phase: wall time, tokens/s (and the streamed pass's ratio to the resident one), the plan's estimate, the
engine's own peak (`Gpu.peak`: every buffer it creates, the upload and read-back staging included) and the
driver's (nvidia-smi's memory.used, sampled every 0.2 s; "-" without nvidia-smi). The epoch estimate over 1 M window
tokens: the streamed pass at its measured rate, the draft's jobs at the measured job mix, the refresh batches
heal's lazy refresh rebuilds (`heal_count.refresh_forwards`) at the measured refresh-batch time, and heal's
held-out evaluations (every --eval-every steps and at the last: each chain step of every held-out batch) at the
measured evaluation-batch time per chain step. The acceptance measurements before and after are not counted.

Weights are `common.RandomWeights` (the 27B's float32 init does not fit the host); the streamed trunk reads them
from host arrays here (`bench/heal_e2e.py` reads a checkpoint on disk).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import subprocess
import sys
import threading
import time
from functools import partial

import common  # noqa: F401  (puts the repository root on sys.path)
import numpy as np
from heal_count import SERIES, evaluation_calls, evaluation_s, heal_rows, refresh_forwards
from profiler import phase_totals, profile_parts

from ddl_ref import mtp as ref_mtp
from ddl_wgpu import backend
from ddl_wgpu.engine import gpumem, stream
from ddl_wgpu.engine.heal_gpu import plan_trunk_job
from ddl_wgpu.engine.step import draft_adamw
from ddl_wgpu.jobs import heal
from ddl_wgpu.jobs.run import Events


class Smi:
    """nvidia-smi's memory.used (MiB) sampled every `every` s on a thread; `peak(t0, t1)` the most in [t0, t1]."""

    def __init__(self, every: float = 0.2):
        self.samples: list[tuple[float, float]] = []
        self.ok = every > 0 and self._read() is not None  # 0: no sampling (each query is a driver call)
        self._stop = threading.Event()
        if self.ok:
            threading.Thread(target=self._run, args=(every,), daemon=True).start()

    @staticmethod
    def _read() -> float | None:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=10).stdout  # fmt: skip
            return float(out.split()[0])
        except Exception:
            return None

    def _run(self, every: float) -> None:
        while not self._stop.is_set():
            v = self._read()
            if v is not None:
                self.samples.append((time.perf_counter(), v))
            time.sleep(every)

    def peak(self, t0: float, t1: float) -> float | None:
        inside = [v for t, v in self.samples if t0 <= t <= t1 + 0.3]
        return max(inside) * 2**20 if inside else None

    def stop(self) -> None:
        self._stop.set()


class LayerLog:
    """While a streamed pass runs: how long the main thread waits for each layer's upload (`LayerStream.bring`),
    a time-stamped line every `every` layers (a pass that stalls shows where), the total in `wait_s`."""

    def __init__(self, progress, label: str, t0: float, every: int = 16):
        self.progress, self.label, self.t0, self.every, self.wait_s = progress, label, t0, every, 0.0

    def __enter__(self):
        self.orig = orig = stream.LayerStream.bring

        def bring(ls, i, rec, **kw):
            t = time.perf_counter()
            orig(ls, i, rec, **kw)
            self.wait_s += time.perf_counter() - t
            if i % self.every == 0:
                self.progress(f"    {self.label}: layer {i} in its slot at {time.perf_counter() - self.t0:.1f}s; "
                              f"upload waits so far {self.wait_s:.1f}s")  # fmt: skip

        stream.LayerStream.bring = bring
        return self

    def __exit__(self, *exc):
        stream.LayerStream.bring = self.orig


def _gib(n) -> str:
    return "-" if n is None else gpumem.gib(n)


def run(args, model, gpu, progress) -> dict:
    """The phases (module docstring) -> the JSON's `gpu_memory` part and the rows of its table."""
    cfg, T = model.cfg, args.seq
    budget = gpumem.parse_size(args.gpu_memory)
    kk = min(args.topk, cfg.vocab_size)
    draft_cfg = {
        "k": kk,
        "chain": args.chain,
        "stacked": args.chain_attention == "stacked",
        "kl_form": "full",
    }

    def plan(b):
        return plan_trunk_job(gpu, "heal", cfg, args.trunk_dtype, args.pass_windows or 10**6, T, args.batch, b, kk,
                              draft=draft_cfg)  # fmt: skip

    resident_plan = plan(None)
    windows = args.pass_windows or 3 * resident_plan.block
    resident_plan, streamed_plan = (
        plan_trunk_job(gpu, "heal", cfg, args.trunk_dtype, windows, T, args.batch, b, kk, draft=draft_cfg)
        for b in (None, budget)
    )
    progress(resident_plan.line())
    progress(streamed_plan.line())
    rng = np.random.default_rng(args.seed + 2)
    wins = [rng.integers(0, cfg.vocab_size, T) for _ in range(windows)]
    smi = Smi(args.smi_every)
    gc.collect()
    base = gpu.live  # before any phase: the draft's peak counts what the trunk leaves it, as the plan does
    phases, out, last_teacher = [], {}, None
    for label, p, mode in [("resident", resident_plan, None), ("streamed", streamed_plan, "streamed")]:
        gc.collect()
        gpu.reset_peak()
        live0, t0 = gpu.live, time.perf_counter()
        teacher = backend.make_teacher("wgpu", model, args.batch, args.device, args.trunk_dtype, p)
        t1 = time.perf_counter()
        blocks: list = []  # (windows done, time) at the end of each block

        def mark(ev, blocks=blocks):
            if ev["event"] == "trunk":
                blocks.append((ev["done"], time.perf_counter()))

        events = Events(mark, "heal")
        with LayerLog(progress, label, t1) if mode else contextlib.nullcontext() as layer_log:
            cache = heal._trunk_pass(teacher, wins, cfg, kk, teacher.block, events)
        t2 = time.perf_counter()
        # the rate after the first block (its time holds the kernels' compilation and the first uploads)
        (w0, s0), (w1, s1) = (blocks[0], blocks[-1]) if len(blocks) > 1 else ((0, t1), blocks[-1])
        e = {"label": label, "plan": p.to_dict(), "load_s": t1 - t0, "pass_s": t2 - t1, "tokens": windows * T,
             "timed_tokens": (w1 - w0) * T, "tokens_per_s": (w1 - w0) * T / (s1 - s0),
             "engine_peak_bytes": gpu.peak - live0, "smi_peak_bytes": smi.peak(t0, t2)}  # fmt: skip
        if layer_log is not None:
            e["upload_wait_s"] = layer_log.wait_s
        e["upload"] = teacher.trunk.stream.mode  # the way the layers went up (`stream.host_uploads`)
        if mode is None:
            out["resident"] = cache
        else:
            ref = out["resident"]
            e["same_bits"] = bool(np.array_equal(ref.top_ids, cache.top_ids)
                                  and np.array_equal(ref.top_probs, cache.top_probs)
                                  and np.array_equal(ref.x[1], cache.x[1]))  # fmt: skip
            e["vs_resident"] = e["tokens_per_s"] / phases[0]["tokens_per_s"]
        progress(f"  {label}: {e['tokens_per_s']:,.0f} tokens/s over {windows} windows (blocks of {p.block}); "
                 f"peak {_gib(e['engine_peak_bytes'])} engine, {_gib(e['smi_peak_bytes'])} nvidia-smi"
                 + (f"; same bits as resident: {e['same_bits']}" if mode else "") + f"; uploads: {e['upload']}")  # fmt: skip
        phases.append(e)
        teacher.release()
        if mode is None:
            del teacher
        else:
            last_teacher = teacher
        cache = None
    draft = draft_phase(args, model, gpu, last_teacher, out["resident"], smi, progress, base)
    smi.stop()
    estimate = epoch_estimate(args, phases[1]["tokens_per_s"], draft)
    return {"budget_bytes": budget, "windows": windows, "phases": phases, "draft": draft, "estimate": estimate,
            "nvidia_smi": smi.ok}  # fmt: skip


def draft_phase(args, model, gpu, teacher, cache, smi, progress, base: int) -> dict:
    """heal's draft after the trunk's release: built on the teacher's resident head and prepared as heal prepares
    it (`WgpuDraft.prepare`: what the plan's `draft_bytes` counts), one timed step per chain step on the pass's
    first batch (the rows of step j > 1 from the draft's own output, as heal's refresh); its engine peak counts
    from `base` (what was alive before the trunk's phases), as the plan does."""
    gc.collect()
    gpu.reset_peak()
    t0 = time.perf_counter()
    draft = backend.make_draft("wgpu", model, None, args.batch, args.device, teacher=teacher)
    B, T = args.batch, args.seq
    draft.prepare(T, min(args.topk, model.cfg.vocab_size), args.chain, args.chain_attention == "stacked")
    ids, lengths = cache.ids[:B], cache.lengths[:B]
    stacked = args.chain_attention == "stacked"

    def tok_valid(j):
        return ref_mtp.shifted(ids, j), ref_mtp.step_valid(lengths, T, j)

    x = heal_rows(draft, cache.x[1][:B].astype(np.float32), tok_valid, args.chain, stacked)
    refresh = []
    for _ in range(3):
        t = time.perf_counter()
        draft.next_rows(x[1], ref_mtp.shifted(ids, 2), ref_mtp.step_valid(lengths, T, 2))
        refresh.append(time.perf_counter() - t)
    steps, jobs = {}, {}
    adam_steps = itertools.count(1)  # Adam's step counter, across the chain steps as in heal's job loop

    def times_s(call, runs: int) -> list[float]:
        times = []
        for _ in range(runs):
            t = time.perf_counter()
            call()
            times.append(time.perf_counter() - t)
        return times[1:]  # the first builds the work and compiles

    def median_s(call, runs: int) -> float:
        return float(np.median(times_s(call, runs)))

    for j in range(1, args.chain + 1):
        tid, tp = ref_mtp.shifted(cache.top_ids[:B], j), ref_mtp.shifted(cache.top_probs[:B], j, fill=1.0)
        w = ref_mtp.step_valid(lengths, T, j).astype(np.float32)
        kw, xs = {}, x[j]
        if args.chain_attention == "stacked" and j > 1:
            pad = (j - 1) * T
            tid = np.concatenate([np.zeros((B, pad, tid.shape[-1]), tid.dtype), tid], axis=1)
            tp = np.concatenate([np.ones((B, pad, tp.shape[-1]), tp.dtype), tp], axis=1)
            w = np.concatenate([np.zeros((B, pad), w.dtype), w], axis=1)
            xs, kw = np.concatenate([x[i] for i in range(1, j + 1)], axis=1), {"chain": j}
        nxt = (ref_mtp.shifted(ids, j + 1), ref_mtp.step_valid(lengths, T, j + 1)) if j < args.chain else None
        jobs[j] = (xs, tid, tp, w, kw, nxt)
    # a held-out evaluation batch, as bench/heal.py times it: step by step, and chained right after a refresh
    # (before the steps below move the weights on from those the rows were built with)
    per_step, chained, series = evaluation_calls(draft, jobs, stacked)
    evals = {j: median_s(call, 1 + args.steps) for j, call in per_step.items()}
    one_s = median_s(chained, 1 + args.steps)
    # the series' time varied 1.7x between two runs of the same code on an H100 (BENCHMARKS.md, "tenth
    # session") while its GPU work did not: timed SERIES_RUNS times, its spread printed and kept
    series_s = [t / SERIES for t in times_s(series, 1 + max(args.steps, SERIES_RUNS))]
    chain_s = float(np.median(series_s))
    # the same forwards on the same rows: the bits, alone and in a series
    same = series()[-1] == chained() == [call() for call in per_step.values()]
    for j, (xs, tid, tp, w, kw, _nxt) in jobs.items():
        step = partial(draft.step, xs, tid, tp, w, heal.HealConfig().lr)
        steps[j] = median_s(
            lambda s=step, kw=kw: s(next(adam_steps), heal.LOSS_SCALE_START, **kw), 1 + args.steps
        )
    t1 = time.perf_counter()
    # each chain step's dispatches, filled by its profile
    timed = {j: [] for j in jobs} if args.profile else {}
    profiles = {j: profile_draft(draft, jobs[j], gpu, t) for j, t in timed.items()}
    r = {"steps_s": steps, "job_mix_s": float(np.mean(list(steps.values()))), "refresh_batch_s": float(np.median(refresh)),
         "eval_batch_s": evals, "eval_chain_s": chain_s, "eval_chain_runs_s": series_s, "eval_chain_one_s": one_s,
         "eval_chain_same_bits": same,
         "profile_ms": profiles, "profile_dispatches": {j: sorted(t, key=lambda d: -d[2])[:TOP_DISPATCHES]
                                                        for j, t in timed.items()},
         "engine_peak_bytes": gpu.peak - base,
         "smi_peak_bytes": smi.peak(t0, t1)}  # fmt: skip
    progress(f"  draft: {', '.join(f'step {j} {s * 1e3:.1f} ms' for j, s in steps.items())}; held-out evaluation "
             f"batch {', '.join(f'step {j} {s * 1e3:.1f} ms' for j, s in evals.items())}, chained after a refresh "
             f"{one_s * 1e3:.1f} ms alone, {chain_s * 1e3:.1f} ms in a series of {SERIES} (median of {len(series_s)}: "
             f"{min(series_s) * 1e3:.1f}-{max(series_s) * 1e3:.1f}; {'the' if same else 'NOT the'} per-step sums' bits); peak "
             f"{_gib(r['engine_peak_bytes'])} engine, {_gib(r['smi_peak_bytes'])} nvidia-smi")  # fmt: skip
    for j, prof in profiles.items():
        top = sorted(prof.items(), key=lambda kv: -kv[1])[:8]
        progress(f"  profile of chain step {j} (GPU ms, every dispatch alone): "
                 + ", ".join(f"{k} {v:.2f}" for k, v in phase_totals(prof).items())
                 + "; largest: " + ", ".join(f"{k} {v:.2f}" for k, v in top))  # fmt: skip
        progress(f"  chain step {j}'s largest dispatches (phase|kernel grid: GPU ms): "
                 + ", ".join(f"{n} {'x'.join(map(str, g))}: {ms:.2f}"
                             for n, g, ms in r["profile_dispatches"][j]))  # fmt: skip
    return r


TOP_DISPATCHES = 12  # the single dispatches `--profile` prints per chain step (a product's grid names it)
SERIES_RUNS = 8  # timed series of held-out batches, at least (each SERIES batches: about a second at the 27B)


def profile_draft(draft, job, gpu, timed: list | None = None) -> dict[str, float]:
    """GPU ms per phase and kernel of one training step and one evaluation of a chain step's `job` (its work's
    Calls as `DraftWork.record_step` and `loss_sum_rows` record them: private attributes, a bench's reach)."""
    xs, tid, tp, w, kw, _nxt = job
    work, args = draft._args(xs, tid, tp, w, kw.get("chain", 0))
    work.upload_rows(*args)
    upd = draft_adamw(heal.HealConfig().lr, 1)
    return profile_parts(gpu, [
        ("train zero", lambda rec: work.net.zero_grads_call().record(rec)),
        ("train forward", work.record_forward),
        ("train head+kl", lambda rec: work._record_head(rec, True)),
        ("train backward", work._record_backward),
        ("train adamw", lambda rec: work.net.optimizer_call(upd).record(rec)),
        ("eval forward", work.record_forward),
        ("eval head+kl", lambda rec: work._record_head(rec, False)),
    ], timed)  # fmt: skip


def epoch_estimate(args, tokens_per_s: float, draft: dict) -> dict:
    """One heal epoch over 1 M window tokens at these rates (module docstring)."""
    run = heal.HealConfig(chain=args.chain, refresh=args.refresh, window=args.seq, batch=args.batch,
                          chain_attention=args.chain_attention)  # fmt: skip
    lazy = refresh_forwards(round(1e6 / args.seq), run)
    e = {"trunk_s": 1e6 / tokens_per_s, "draft_s": lazy["steps"] * draft["job_mix_s"], "steps": lazy["steps"],
         "refresh_forwards": lazy["forwards"], "refresh_s": lazy["forwards"] * draft["refresh_batch_s"],
         "evaluations": lazy["evaluations"], "heldout_batches": lazy["heldout_batches"],
         "eval_built": lazy["eval_built"],
         "eval_s": evaluation_s(lazy, args.chain, draft["eval_chain_s"], sum(draft["eval_batch_s"].values()))}  # fmt: skip
    e["total_s"] = e["trunk_s"] + e["draft_s"] + e["refresh_s"] + e["eval_s"]
    return e


def rows(r: dict) -> tuple[list, list]:
    """The table: one row per phase."""
    headers = [
        "phase",
        "block",
        "tokens/s",
        "vs resident",
        "plan",
        "engine peak",
        "nvidia-smi peak",
        "same bits",
    ]
    out = []
    for e in r["phases"]:
        p = e["plan"]
        out.append([e["label"], f"{p['block_windows']} x {p['window']}", f"{e['tokens_per_s']:,.0f}",
                    f"{e['vs_resident']:.3f}" if "vs_resident" in e else "-", _gib(p["trunk_bytes"]),
                    _gib(e["engine_peak_bytes"]), _gib(e["smi_peak_bytes"]),
                    str(e.get("same_bits", "-"))])  # fmt: skip
    d = r["draft"]
    out.append(["draft (after the trunk)", f"{len(d['steps_s'])} steps", "-", "-",
                _gib(r["phases"][-1]["plan"]["draft_bytes"]), _gib(d["engine_peak_bytes"]), _gib(d["smi_peak_bytes"]),
                "-"])  # fmt: skip
    return headers, out


if __name__ == "__main__":
    sys.exit("run it through bench/heal.py --gpu-memory SIZE")
