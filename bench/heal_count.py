"""`refresh_forwards`: how many refresh-batch forwards (`Draft.next_rows` calls) a heal over N windows runs,
counted by running heal's own job loop (`heal._HealJob`, `heal._Chain`, `run.drive`) on a stand-in draft
that does no arithmetic. `bench/heal.py` turns the count into its epoch estimate; `tests/test_heal.py` and
`tests/test_heal_gpu.py` check it against the forwards of real runs, so the estimate counts what heal does.

A benchmark's instrument: it reaches into heal's private classes, which is why it lives in `bench/` and not
in the package.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from types import SimpleNamespace

import numpy as np

from ddl_wgpu.jobs.heal import HealConfig, _batches, _Chain, _HealJob, split_heldout
from ddl_wgpu.jobs.run import Best, Events, drive


class _CountingDraft:
    """The stand-in draft: no arithmetic, every loss 0."""

    def step(self, *args, **kw):
        return 1.0, 1.0, True

    def loss_sum(self, *args, **kw) -> float:
        return 0.0

    def loss_chains(self, batches, stacked: bool) -> list[list[float]]:
        return [[0.0] * len(steps) for _x, steps in batches]

    def snapshot(self):
        return None


class _CountingChain(_Chain):
    """Which refresh batches are stale and when, as `heal._Chain` decides; the forwards of a rebuild counted,
    not run, and no rows."""

    def _rebuild(self, stale: list, j: int, weights=None) -> None:
        for k in stale:
            n = j - int(self.built[k])
            self.forwards += n
            self.period_forwards += n
            self.built[k] = j

    def join(self, b: np.ndarray, j: int):
        if j > 1:
            self._current(b, j)
        return None, None, None, np.ones(1), {}

    evaluations = 0  # held-out evaluations run

    def heldout_kl(self, batches: list[np.ndarray]) -> list[float]:
        self.evaluations += 1
        return super().heldout_kl(batches)

    def _chain_inputs(self, b: np.ndarray) -> tuple:
        return None, [(None, None, np.ones(1), None)] * self.chain


def refresh_forwards(windows: int, cfg: HealConfig) -> dict:
    """The refresh-batch forwards a heal over `windows` windows runs when nothing stops it early (patience
    off) -> {"forwards", "steps", "refreshes", "batches", "eval_built", "evaluations", "heldout_batches"}. An
    eager rebuild of every batch at each refresh would run refreshes x (chain − 1) x batches. `eval_built`:
    the batches' chain steps an evaluation right after a refresh built from its own forwards
    (`Draft.loss_chain`), no forward of their own. `evaluations` (the one before the first step included)
    each run chain x `heldout_batches` forwards of the draft with its head and KL."""
    cfg = dataclasses.replace(cfg, patience=0)
    N = windows
    cache = SimpleNamespace(ids=np.zeros((N, 1)), x={}, zeros=np.zeros)  # `_CountingChain` reads no rows
    model = SimpleNamespace(cfg=SimpleNamespace(d_model=0))
    chain = _CountingChain(model, cfg, cache, _CountingDraft())
    refreshes = []
    events = Events(lambda e: refreshes.append(e) if e["event"] == "refresh" else None, "heal")
    train, val = split_heldout(N)
    vb = _batches(val, cfg.batch)
    job = _HealJob(chain, cfg, _batches(train, cfg.batch), vb, events)
    job.refresh(0)
    best = Best(0.0, 0, None)
    job.start(best, chain.heldout_kl(vb))
    _stopped, done = drive(job, 0, job.cadence, best, events, 0)
    return {
        "forwards": chain.forwards,
        "steps": done,
        "refreshes": len(refreshes),
        "batches": chain.batches,
        "eval_built": chain.eval_built,
        "evaluations": chain.evaluations,
        "heldout_batches": len(vb),
    }


def heal_rows(draft, x1, tok_valid, chain: int, stacked: bool) -> dict:
    """{j: step j's block input rows} of one batch as heal's refresh builds them (`_Chain._next_rows`): step j
    from the draft's output on step j − 1's rows (stacked, j > 2: on the stacked rows of steps 1..j − 1), float16
    as heal's cache holds them; `tok_valid(j)` gives step j's (tokens, valid)."""
    x = {1: x1}
    for j in range(2, chain + 1):
        if stacked and j > 2:
            rows = draft.next_rows(
                np.concatenate([x[i] for i in range(1, j)], axis=1), *tok_valid(j), chain=j - 1
            )
        else:
            rows = draft.next_rows(x[j - 1], *tok_valid(j))
        x[j] = rows.astype(np.float16).astype(np.float32)
    return x


SERIES = 16  # `evaluation_calls`: held-out batches chained in one go (heal's evaluation runs all of them so)


def evaluation_calls(draft, jobs: dict, stacked: bool) -> tuple[dict, partial, partial]:
    """heal's held-out evaluation of one batch (`_Chain.heldout_kl`) as calls to time -> ({j: step j's KL
    forward on rows already built (`Draft.loss_sum`: an evaluation whose rows a refresh built)}, all chain
    steps of one stale batch right after a refresh, each on rows built from the forward of the step before
    (`Draft.loss_chain`), and SERIES such batches in one go as heal's evaluation runs them (`loss_chains`: the
    host prepares a batch while the GPU runs the one before)). jobs[j] = (x, teacher ids, teacher probs,
    weights, keywords, next) of step j as heal's `join` gives them, next = (tokens, valid) of step j + 1
    (None at the last)."""
    per_step = {
        j: partial(draft.loss_sum, x, tid, tp, w, **kw) for j, (x, tid, tp, w, kw, _n) in jobs.items()
    }
    steps = [(tid, tp, w, nxt) for _x, tid, tp, w, _kw, nxt in jobs.values()]
    one = (jobs[1][0], steps)
    return (
        per_step,
        partial(draft.loss_chain, *one, stacked),
        partial(draft.loss_chains, [one] * SERIES, stacked),
    )


def evaluation_s(lazy: dict, chain: int, chain_s: float, steps_s: float) -> float:
    """An epoch's held-out evaluations in seconds (`lazy` from `refresh_forwards`): the batches evaluated right
    after a refresh as chains (`chain_s` each, a batch of a `Draft.loss_chains` series), every other one step by
    step (`steps_s`, the sum of its steps' `Draft.loss_sum`)."""
    batches = lazy["evaluations"] * lazy["heldout_batches"]
    chained = lazy["eval_built"] // (chain - 1) if chain > 1 else 0
    return chained * chain_s + (batches - chained) * steps_s
