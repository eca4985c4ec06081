"""What the CLI prints: progress of training and heal runs, the resolved configuration, the ranked table of a
sweep and acceptance results, all as readable lines (JSON lines only where `--json` asks for them).

Training progress is one rich progress bar per variant on a terminal and, elsewhere (CI logs, pipes), a plain
line every tenth of the run and at each evaluation that names the variant. heal's progress is the reference
heal tool's lines on stderr, including "no new best in N evaluations" when patience stops it.
"""

from __future__ import annotations

import json
import sys
import time

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn


def fields(d: dict) -> str:
    """A dict as `key=value` pairs (a nested dict's pairs in parentheses): the resolved configuration."""
    return "  ".join(f"{k}=({fields(v)})" if isinstance(v, dict) else f"{k}={v}" for k, v in d.items())


def summary_text(summary: dict) -> str:
    """A summary dict as `key: value` lines."""
    return "\n".join(f"{k}: {fields(v) if isinstance(v, dict) else v}" for k, v in summary.items())


class TrainConsole:
    """Progress of a sweep: one rich progress bar per variant on a terminal; elsewhere (CI logs, pipes) a
    plain line, with the variant's name, every tenth of the run and at each evaluation."""

    def __init__(self):
        self.console = Console(stderr=True)
        self.live = self.console.is_terminal
        self.bar = None
        self.val = ""
        self.started = False  # an event came: the run has begun

    def __call__(self, ev: dict):
        self.started = True
        kind = ev["event"]
        if kind == "start":
            self.console.print(f"[bold]{ev['variant']}[/bold]: {ev['num_params']:,} parameters")
        elif kind == "eval" and ev["step"] == 0:
            v = ev.get("validation")
            vtxt = f", validation {v['loss']:.4f}" if v else ""
            self.console.print(
                f"  initial evaluation: train {ev['train']['loss']:.4f}{vtxt} ({ev['seconds']:.1f} s)"
            )
        elif kind == "eval":
            self.val = f"  val {ev['validation']['loss']:.4f}"
            if not self.live:
                self.console.print(
                    f"  {ev['variant']} step {ev['step']}: validation {ev['validation']['loss']:.4f}"
                )
        elif kind == "step":
            info = f"loss {ev['loss']:.4f}  lr {ev['lr']:.2e}  {ev['tokens_per_s']:,.0f} tok/s  {ev['s_per_step']:.3f} s/step"
            if ev.get("loss_mtp") == ev.get("loss_mtp"):  # not NaN: joint MTP training
                info += f"  (trunk {ev['loss_main']:.4f}, draft {ev['loss_mtp']:.4f})"
            if self.live:
                self._bar(ev, info + self.val)
            elif ev["step"] % max(ev["total"] // 10, 1) == 0 or ev["step"] == ev["total"]:
                self.console.print(
                    f"  {ev['variant']} step {ev['step']}/{ev['total']}  {info}", soft_wrap=True
                )
        elif kind == "done":
            self.close()
        elif kind == "failed":
            self.close()
            self.console.print(
                f"  [bold red]{ev['variant']} failed[/bold red] at step {ev['step']}: {ev['reason']}"
            )

    def _bar(self, ev: dict, info: str):
        if self.bar is None:
            self.bar = Progress(
                TextColumn("  {task.description}"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total}"),
                TextColumn("{task.fields[info]}"),
                TimeRemainingColumn(),
                console=self.console,
            )
            self.bar.start()
            self.task = self.bar.add_task(ev["variant"], total=ev["total"], info="")
        self.bar.update(self.task, completed=ev["step"], info=info)

    def close(self):
        self.val = ""
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


def ranked_table(comp: dict) -> str:
    rows = []
    order = comp.get("final_validation_loss_ranking") or comp.get("final_train_loss_ranking") or []
    by = {r["variant"]: r for r in comp["reports"]}
    rows.append(
        f"{'rank':<5}{'variant':<14}{'final train':>12}{'final val':>11}{'best val':>10}{'ppl':>9}{'params':>13}{'tok/s':>10}"
    )
    for i, v in enumerate(order, 1):
        r = by[v]
        if r.get("status") == "failed":  # ranked last, with no final metrics
            f = r["failure"]
            rows.append(f"{i:<5}{v:<14}failed at step {f['step']}: {f['reason']}")
            continue
        fv = r.get("final_validation") or {}
        bv = r.get("best_validation") or {}
        ppl = (fv or r["final_train"])["perplexity"]
        tps = r.get("throughput", {}).get("tokens_per_s", float("nan"))
        rows.append(
            f"{i:<5}{v:<14}{r['final_train']['loss']:>12.4f}{fv.get('loss', float('nan')):>11.4f}"
            f"{bv.get('loss', float('nan')):>10.4f}{ppl:>9.2f}{r['num_params']:>13,}{tps:>10,.0f}"
        )
    return "\n".join(rows)


def accept_text(r: dict) -> str:
    lines = [
        f"depth {r['depth']}: acceptance length τ = {r['acceptance_length']:.4f} over {r['anchors']} anchors"
    ]
    for j, (a, c) in enumerate(zip(r["prefix_acceptance"], r["conditional_acceptance"], strict=True), 1):
        lines.append(f"  depth {j}: prefix A_{j} = {a:.4f}   conditional α_{j} = {c:.4f}")
    op = r.get("on_policy")
    if op:
        lines.append(
            f"  on-policy anchors: τ = {op.get('acceptance_length', float('nan')):.4f}, "
            f"A = {[round(float(x), 4) for x in op.get('prefix_acceptance', [])]}"
        )
    return "\n".join(lines)


class HealConsole:
    """heal's progress as readable lines on stderr (the reference heal tool's), or JSON lines with --json."""

    def __init__(self, as_json: bool):
        self.as_json = as_json
        self.t0 = time.perf_counter()
        self.trunk_quarter = -1

    def say(self, text: str):
        print(text, file=sys.stderr, flush=True)

    def __call__(self, ev: dict):
        if self.as_json:
            self.say(json.dumps(ev, default=str))
            return
        kind, dt = ev["event"], time.perf_counter() - self.t0
        if kind == "draft":
            came = "the init model's" if ev["init"] else "the model's"
            if ev["ffn_hidden"] < ev["source_ffn_hidden"]:
                came += f" {ev['source_ffn_hidden']} narrowed by importance"
            self.say(f"heal: the draft's SwiGLU {ev['ffn_hidden']} channels wide ({came}; --draft-width "
                     f"{ev['rule']}), chain attention {ev['chain_attention']}")  # fmt: skip
        elif kind == "plan":
            self.say(ev["line"])
        elif kind == "scratch":
            self.say(f"  host memory: the chain's rows ({ev['bytes'] / 2**30:.2f} GiB) pass --host-memory "
                     f"({ev['budget'] / 2**30:.2f} GiB): they live in {ev['path']} until heal ends")  # fmt: skip
        elif kind == "windows":
            self.say(
                f"heal: {ev['windows']} windows, {ev['tokens']:,} tokens of {ev['data']}; chain depth {ev['chain']}"
            )
        elif kind == "trunk":  # about every quarter of the windows, and the last
            quarter = 4 * ev["done"] // ev["windows"]
            if quarter != self.trunk_quarter or ev["done"] == ev["windows"]:
                self.trunk_quarter = quarter
                self.say(f"  trunk: {ev['done']}/{ev['windows']} windows ({dt:.1f} s)")
        elif kind == "refresh":
            steps = "step 2" if ev["chain"] == 2 else f"steps 2..{ev['chain']}"
            # rows rebuilt per batch of windows when first read, from the weights kept here
            full = (ev["chain"] - 1) * ev["batches"]
            last = f"; the last period rebuilt {ev['rebuilt']} of {full} batches" if ev["step"] else ""
            self.say(f"  chain {steps} stale from step {ev['step']}: rebuilt on demand from the draft "
                     f"kept here{last} ({dt:.0f} s)")  # fmt: skip
        elif kind == "eval" and ev["step"] == 0:
            self.say(
                f"  held-out KL to the trunk before training, per chain step: {kl_text(ev['heldout_kl'])}"
            )
            self.t_steps = time.perf_counter()
        elif kind == "eval":
            self.say(f"  step {ev['step']}: held-out KL {ev['mean']:.5f} (per step {kl_text(ev['heldout_kl'])}; "
                     f"best {ev['best']:.5f})")  # fmt: skip
        elif kind == "step" and (ev["step"] % 10 == 0 or ev["step"] == ev["total"]):
            sps = (time.perf_counter() - self.t_steps) / ev["step"]
            self.say(f"  step {ev['step']}/{ev['total']}  loss {ev['loss']:.4f}  lr {ev['lr']:.2e}  "
                     f"{sps:.2f} s/step  ~{sps * (ev['total'] - ev['step']):.0f} s left")  # fmt: skip
        elif kind == "skip":
            self.say(f"  step {ev['step']}: non-finite loss or gradient, skipped ({ev['skipped']} so far; loss "
                     f"scale {ev['loss_scale']:g})")  # fmt: skip
        elif kind == "patience":
            self.say(f"  no new best in {ev['evaluations']} evaluations: stopping at step {ev['step']} of "
                     f"{ev['total']}")  # fmt: skip


def kl_text(values) -> str:
    return ", ".join(f"{v:.5f}" for v in values)


class DraftConsole:
    """`draft`'s progress as readable lines on stderr (every tenth of the run and each evaluation), or JSON
    lines with --json."""

    def __init__(self, as_json: bool):
        self.as_json = as_json
        self.t0 = time.perf_counter()
        self.tenth = -1

    def say(self, text: str):
        print(text, file=sys.stderr, flush=True)

    def __call__(self, ev: dict):
        if self.as_json:
            self.say(json.dumps(ev, default=str))
            return
        kind, dt = ev["event"], time.perf_counter() - self.t0
        if kind == "windows":
            how = ", regenerated by the target" if ev["regenerated"] else ""
            self.say(f"draft: {ev['windows']} windows ({ev['heldout']} held out, {ev['evaluated']} of them evaluated), "
                     f"{ev['tokens']:,} tokens of "
                     f"{ev['data']}{how}")  # fmt: skip
        elif kind == "regenerate":
            self.say(f"  regenerate: {ev['done']}/{ev['windows']} windows ({dt:.1f} s)")
        elif kind == "aux":  # a run that starts from a draft file (heal): which target layers it reads
            self.say(f"draft: starting from {ev['start']}: {ev['line']}")
            for note in ev["notes"]:
                self.say(f"  {note}")
        elif kind == "draft":
            start = f", from {ev['start']}" if ev.get("start") else ""
            self.say(f"draft: EAGLE-3, {ev['params']:,} parameters{start}, aux layers {ev['aux_layers']}, draft "
                     f"vocabulary {ev['draft_vocab']} of {ev['vocab']}, TTT {ev['ttt']} deep, {ev['steps']} steps "
                     f"({ev['warmup']} warm-up)")  # fmt: skip
        elif kind == "resumed":
            self.say(f"  resumed after step {ev['step']} of {ev['steps']}")
        elif kind == "step":
            tenth = 10 * ev["step"] // ev["steps"]
            if tenth != self.tenth:
                self.tenth = tenth
                self.say(f"  step {ev['step']}/{ev['steps']}: loss {ev['loss']:.4f}, lr {ev['lr']:.2e}, "
                         f"grad norm {ev['grad_norm']:.3f} ({dt:.1f} s)")  # fmt: skip
        elif kind == "eval":
            per = " ".join(f"{v:.3f}" for v in ev["step_losses"])
            self.say(
                f"  step {ev['step']}: held-out TTT loss {ev['loss']:.4f} (per unroll step {per}) ({dt:.1f} s)"
            )
        elif kind == "accept":
            A = " ".join(f"{a:.4f}" for a in ev["prefix_acceptance"])
            of = " of the start draft" if ev.get("start") else ""
            self.say(f"  held-out greedy acceptance{of}, depth {ev['depth']}: A = {A}, "
                     f"τ = {ev['acceptance_length']:.4f}")  # fmt: skip
        elif kind == "written":
            self.say(f"  wrote {ev['out']} ({dt:.1f} s)")
