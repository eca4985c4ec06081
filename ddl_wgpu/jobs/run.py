"""The run driver `train` and `heal` share: the step loop with its evaluation cadence, best tracking,
patience and progress events, configured by a job that knows what one step and one evaluation are.

    job.step(n)        one optimizer step that becomes step n + 1; returns the progress fields of the step,
                       or None when the step was skipped (it does not count; the same n is tried again)
    job.evaluate(n)    the score (lower is better) after step n, or None when there is nothing to rank by
    job.snapshot()     the weights to keep when the score is a new best
    job.after_step(n)  True: end this process now (a resumable stop)

Progress events have one schema: `{"event": NAME, "job": "train" | "heal", **fields}`; the CLI turns them
into readable lines (or JSON lines with `--json`), the reports keep their own records.

What it deliberately does not do: schedules, optimizers or data. Each job's learning-rate rule is its own
(`train`: the reference trainer's cosine with warm-up per phase; `heal`: the reference heal tool's warm-up
then cosine to a floor), as are its non-finite policies (`train` marks the variant failed, checkpoints its last
good weights and goes on with the sweep; `heal` halves its loss scale and skips, `LossScale`).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


class Events:
    """Progress events of one job, sent to `sink` (a callable taking the event dict) when there is one."""

    def __init__(self, sink: Callable[[dict], None] | None, job: str):
        self.sink, self.job = sink, job

    def __call__(self, name: str, **fields) -> None:
        if self.sink is not None:
            self.sink({"event": name, "job": self.job, **fields})


@dataclass(frozen=True)
class Cadence:
    """When to evaluate: every `every` steps counted from `origin` (the first step of the phase), and at the
    last step `end`."""

    every: int
    end: int
    origin: int = 0

    def due(self, done: int) -> bool:
        return (done - self.origin) % self.every == 0 or done == self.end


@dataclass
class Best:
    """The best score so far, the step that reached it and the weights kept then."""

    value: float | None
    step: int | None
    snapshot: object = None

    def offer(self, value: float, step: int, snapshot: Callable[[], object]) -> bool:
        """Keep `value` (and take a snapshot) when it beats the best so far; True when it did."""
        if self.value is not None and not value < self.value:
            return False
        self.value, self.step, self.snapshot = value, step, snapshot()
        return True

    def stale(self, done: int, patience: int, every: int) -> bool:
        """`patience` evaluations (`every` steps apart) have passed without a new best (0: never)."""
        return patience > 0 and self.step is not None and done - self.step >= patience * every


class LossScale:
    """The reference heal tool's non-finite policy: every non-finite step halves the loss scale (down to 1)
    and is skipped; the `limit`-th one ends the run."""

    def __init__(self, start: float, limit: int):
        self.value, self.limit, self.skipped = start, limit, 0

    def skip(self) -> bool:
        """Count one non-finite step; True when that was the last one allowed."""
        self.skipped += 1
        self.value = max(self.value / 2.0, 1.0)
        return self.skipped >= self.limit


class DeferredInterrupt:
    """Ctrl-C (SIGINT) held back while a step is in flight, so that an interrupt never lands between a step's
    update and its record (a checkpoint labelled step N holding step N + 1's weights).

    Inside `with DeferredInterrupt() as intr:` the first SIGINT only sets `intr.pending`; the job calls
    `intr.check()` where its state is whole (a step recorded, an evaluation done), which raises
    KeyboardInterrupt there. A second SIGINT raises at once (the way out of a long step) and sets `intr.hard`:
    the state may then be torn, so nothing should be saved. Outside the main thread (where Python cannot
    install handlers), when one is already installed by an enclosing `with`, or under a SIGINT handler that
    stops jobs between steps itself (`stops_between_steps`), it changes nothing."""

    _active: DeferredInterrupt | None = None

    def __init__(self):
        self.pending = self.hard = False
        self._previous = None
        self._owner = False

    def __enter__(self) -> DeferredInterrupt:
        outer = DeferredInterrupt._active
        if outer is not None:
            return outer
        # A caller whose SIGINT handler ends the job between steps itself (a sweep's `StopRequest`, through
        # `RunOptions.stop_after`; it says so with `stops_between_steps`) keeps its handler.
        if threading.current_thread() is threading.main_thread() and not getattr(
            signal.getsignal(signal.SIGINT), "stops_between_steps", False
        ):
            self._previous = signal.signal(signal.SIGINT, self._handler)
            self._owner = True
            DeferredInterrupt._active = self
        return self

    def __exit__(self, *exc) -> None:
        if self._owner:
            signal.signal(signal.SIGINT, self._previous)
            DeferredInterrupt._active = None
            self._owner = False

    def _handler(self, signum, frame) -> None:
        if self.pending:
            self.hard = True
            raise KeyboardInterrupt
        self.pending = True

    def check(self) -> None:
        """KeyboardInterrupt if a Ctrl-C came since the `with` began (call where the state is whole)."""
        if self.pending:
            raise KeyboardInterrupt


class Job(Protocol):
    def step(self, done: int) -> dict | None: ...

    def evaluate(self, done: int) -> float | None: ...

    def snapshot(self) -> object: ...

    def after_step(self, done: int) -> bool: ...


def drive(job: Job, start: int, cadence: Cadence, best: Best, events: Events, patience: int = 0):
    """Steps `start`..`cadence.end` of `job`, evaluating on the cadence and keeping the best. -> (why it
    ended, steps done): "steps" (all done), "patience" (no new best in `patience` evaluations) or "stopped"
    (`job.after_step` asked to end the process)."""
    done = start
    while done < cadence.end:
        fields = job.step(done)
        if fields is None:
            continue
        done += 1
        events("step", step=done, total=cadence.end, **fields)
        if cadence.due(done):
            score = job.evaluate(done)
            improved = score is not None and best.offer(score, done, job.snapshot)
            if (
                score is not None
                and not improved
                and done < cadence.end
                and best.stale(done, patience, cadence.every)
            ):
                events("patience", step=done, total=cadence.end, evaluations=patience)
                return "patience", done
        if job.after_step(done):
            return "stopped", done
    return "steps", done
