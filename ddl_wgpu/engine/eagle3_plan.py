"""The GPU memory plan of an EAGLE-3 draft job (`ddl-wgpu draft`, `draft --init`, `heal --draft`;
docs/eagle3.md#the-gpu-memory-plan): the bytes the job allocates, by part, counted by running the job's own
constructors (`engine.eagle3`) on a `gpumem.DryGpu`, as heal's `gpumem.TrunkPlan` counts its trunk, so a
buffer added to the engine is counted without a change here; the plan within a `--gpu-memory` budget, the
target resident where that fits, else streamed, else one line naming what to lower."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ddl_ref import eagle3 as e3
from ddl_ref.config import ModelConfig
from ddl_wgpu.engine.eagle3 import GpuAux, WgpuEagle3Draft, WgpuEagle3Target
from ddl_wgpu.runtime.gpu import GpuError


@dataclass(frozen=True)
class Eagle3Plan:
    """The GPU bytes a draft job allocates, by part (`plan_eagle3`, counted on a `gpumem.DryGpu` from the job's
    own constructors): the target's weights (every layer resident, or `streamed`: the embedding, final norm and
    head resident, two layer slots and their upload staging) with the draft vocabulary's head rows; the target's
    work for B windows of T (its forward's activations, the three aux row buffers, the teacher's logits chunk
    and top-k); the draft's parameters with their gradients and AdamW's two moments (f32); the TTT unroll's
    buffers (every step's activations, the stacked q/k/v/o rows and their gradients, the head's logits chunk,
    the backward's scratch, the device-wide attention and split-K scratch its Calls bind) and the read-back
    staging. `peak_bytes`: the most alive at once (the parts, or more while a resident target loads)."""

    streamed: bool
    batch: int
    seq: int
    ttt: int
    draft_vocab: int
    target_weight_bytes: int
    target_work_bytes: int
    draft_param_bytes: int
    draft_work_bytes: int
    peak_bytes: int
    budget_bytes: int | None = None
    chain: int = 0  # the greedy chain's own work of this many steps (0: it runs on the training work)

    @property
    def target_bytes(self) -> int:
        return self.target_weight_bytes + self.target_work_bytes

    @property
    def draft_bytes(self) -> int:
        return self.draft_param_bytes + self.draft_work_bytes

    def parts(self) -> str:
        from ddl_wgpu.engine.gpumem import gib

        how = "streamed (2 layer slots)" if self.streamed else "resident"
        chain = f" and a {self.chain}-step greedy chain" if self.chain else ""
        return (f"draft {gib(self.draft_bytes)} (parameters, gradients and AdamW moments "
                f"{gib(self.draft_param_bytes)}, TTT work for {self.batch} x {self.seq} tokens x ttt {self.ttt}"
                f"{chain} {gib(self.draft_work_bytes)}), target {how} {gib(self.target_bytes)} (weights "
                f"{gib(self.target_weight_bytes)}, work {gib(self.target_work_bytes)})")  # fmt: skip

    def line(self) -> str:
        """The plan a draft job prints at its start (one line)."""
        from ddl_wgpu.engine.gpumem import gib

        budget = "(no --gpu-memory budget)" if self.budget_bytes is None else f"of {gib(self.budget_bytes)}"
        return f"gpu memory plan: {self.parts()}; total {gib(self.peak_bytes)} {budget}"

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "mode": "streamed" if self.streamed else "resident",
                "target_bytes": self.target_bytes, "draft_bytes": self.draft_bytes}  # fmt: skip


def eagle3_build(gpu, cfg: ModelConfig, ecfg: e3.Eagle3Config, batch: int, seq: int, k: int, dtype: str = "f32",
                 streamed: bool = False, chain: int = 0, params=None, draft_params=None,
                 marks: list | None = None):  # fmt: skip
    """A draft job's GPU objects as the job builds them (`jobs.draft`: the target, the draft, its training work
    and, for the acceptance's greedy chain `chain` deep, the work of max(ttt, chain) steps), each Call built and
    the read-back staging grown to the largest download -> (target, draft). On a `gpumem.DryGpu` with no
    weights given it counts them (`plan_eagle3`); `marks` hears `gpu.live` after each part."""
    from ddl_wgpu.engine.heal_gpu import fake_params

    def mark() -> None:
        if marks is not None:
            marks.append(gpu.live)

    Vd = ecfg.draft_vocab
    d2t = np.zeros(Vd, np.int64)  # any vocabulary of Vd ids: the sizes depend on Vd alone
    t2d = np.zeros(cfg.vocab_size, bool)
    t2d[:Vd] = True
    if params is None:
        params = fake_params(cfg)
    if draft_params is None:
        draft_params = {n: np.broadcast_to(np.float32(0), s) for n, (s, _) in e3.eagle3_params(ecfg).items()}
    mark()
    target = WgpuEagle3Target(gpu, params, cfg, ecfg.aux_layers, d2t, k, batch, dtype, streamed)
    mark()
    work, aux, _call, _ids, _probs = target._bufs(seq)
    work._topk_call(1)  # the full top-1 `__call__` reads
    mark()
    draft = WgpuEagle3Draft(target, draft_params, ecfg, d2t, t2d, batch, k)
    mark()
    # training and evaluation; the greedy chain, its own forward-only work where it runs deeper than the unroll
    for steps in sorted({ecfg.ttt, max(ecfg.ttt, chain)}):
        draft.work(seq, steps).prepare(GpuAux(aux, target.B, seq), train=steps == ecfg.ttt)
    N = batch * seq
    gpu.reserve_staging(max(N * k, N) * 4)  # the largest download: the teacher's top-k ids (or probabilities)
    mark()
    return target, draft


def eagle3_count(gpu, cfg: ModelConfig, ecfg: e3.Eagle3Config, batch: int, seq: int, k: int, dtype: str = "f32",
                 streamed: bool = False, chain: int = 0) -> Eagle3Plan:  # fmt: skip
    """The draft job's bytes by part (`Eagle3Plan`, no budget): `eagle3_build` on a `gpumem.DryGpu` of `gpu`
    (nothing allocated); GpuError where the adapter's limits cannot hold a buffer or binding."""
    from ddl_wgpu.engine import gpumem

    dry, marks = gpumem.DryGpu(gpu), []
    eagle3_build(dry, cfg, ecfg, batch, seq, k, dtype, streamed, chain, marks=marks)
    # the parts: the target's weights, its work, the draft's parameters, its work
    parts = [b - a for a, b in zip(marks, marks[1:], strict=False)]
    return Eagle3Plan(streamed, batch, seq, ecfg.ttt, ecfg.draft_vocab, *parts, dry.peak,
                      chain=chain if chain > ecfg.ttt else 0)  # fmt: skip


def plan_eagle3(gpu, cfg: ModelConfig, ecfg: e3.Eagle3Config, batch: int, seq: int, k: int, budget: int | None,
                dtype: str = "f32", chain: int = 0,
                lower: str = "the batch, the sequence length or ttt") -> Eagle3Plan:  # fmt: skip
    """The plan of a draft job (`Eagle3Plan`): without a budget the target resident (as the job runs it then);
    within `budget` bytes (less `gpumem.reserve_bytes`) resident when that fits, else streamed; else a
    `gpumem.GpuBudgetError` in one line naming the parts, the least budget this plan takes and `lower`
    (the options that shrink it, as the command spells them)."""
    from ddl_wgpu.engine import gpumem

    counted: dict[bool, Eagle3Plan | None] = {}
    limits: list[str] = []

    def count(streamed: bool) -> Eagle3Plan | None:
        if streamed not in counted:
            try:
                counted[streamed] = eagle3_count(gpu, cfg, ecfg, batch, seq, k, dtype, streamed, chain)
            except GpuError as e:  # a buffer or binding the adapter's limits cannot hold, whatever the budget
                limits.append(str(e))
                counted[streamed] = None
        return counted[streamed]

    def fits(plan: Eagle3Plan | None, b: int) -> bool:
        return plan is not None and plan.peak_bytes <= b - gpumem.reserve_bytes(b)

    modes = (False,) if budget is None else (False, True)
    for streamed in modes:
        plan = count(streamed)
        if plan is not None and (budget is None or fits(plan, budget)):
            return dataclasses.replace(plan, budget_bytes=budget)
    if all(count(s) is None for s in modes):
        raise gpumem.GpuBudgetError(f"draft: this adapter's buffer or binding limits cannot hold the draft job's "
                                    f"{batch} x {seq} tokens x ttt {ecfg.ttt} ({limits[-1]}); lower {lower}",
                                    kind="adapter_limits")  # fmt: skip
    least = gpumem._named(lambda b: fits(count(True), b) or fits(count(False), b), budget)
    smaller = min((p for p in (count(False), count(True)) if p is not None), key=lambda p: p.peak_bytes)
    raise gpumem.GpuBudgetError(f"draft: --gpu-memory {gpumem.gib(budget)} cannot hold this run: "
                                f"{smaller.parts()}, {gpumem.gib(smaller.peak_bytes)} in all; it needs at least "
                                f"--gpu-memory {least}, or lower {lower}")  # fmt: skip
