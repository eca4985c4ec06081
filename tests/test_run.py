"""The run driver `train` and `heal` share (`ddl_wgpu.jobs.run`): evaluation cadence, best tracking, patience,
skipped steps, a resumable stop and the one event schema."""

import pytest

from ddl_wgpu.jobs.run import Best, Cadence, Events, LossScale, drive


class FakeJob:
    """Scores given per evaluation; steps listed in `skips` are skipped once (non-finite)."""

    def __init__(self, scores, skips=(), stop_at=None):
        self.scores, self.skips, self.stop_at = list(scores), set(skips), stop_at
        self.tried, self.evaluated = [], []

    def step(self, done):
        self.tried.append(done)
        if done in self.skips:
            self.skips.discard(done)
            return None
        return {"loss": float(done)}

    def evaluate(self, done):
        self.evaluated.append(done)
        return self.scores.pop(0)

    def snapshot(self):
        return f"weights after {self.evaluated[-1]}"

    def after_step(self, done):
        return done == self.stop_at


def run(job, end, every, patience=0, start=0, origin=0, best=None):
    events = []
    best = best or Best(10.0, origin, "initial")
    out = drive(job, start, Cadence(every, end, origin), best, Events(events.append, "test"), patience)
    return out, best, events


def test_cadence_counts_from_the_phase_start_and_ends_on_the_last_step():
    c = Cadence(every=4, end=13, origin=3)
    assert [n for n in range(4, 14) if c.due(n)] == [7, 11, 13]


def test_best_keeps_the_lowest_score_and_its_snapshot():
    job = FakeJob([5.0, 6.0, 4.0, 4.0])
    (why, done), best, events = run(job, end=8, every=2)
    assert (why, done) == ("steps", 8) and job.evaluated == [2, 4, 6, 8]
    assert (best.value, best.step, best.snapshot) == (4.0, 6, "weights after 6")  # a tie is no new best
    assert [e["step"] for e in events if e["event"] == "step"] == list(range(1, 9))
    assert all(e["job"] == "test" and e["total"] == 8 for e in events)


def test_patience_stops_after_evaluations_without_a_new_best():
    job = FakeJob([5.0, 6.0, 7.0, 1.0])
    (why, done), best, events = run(job, end=10, every=2, patience=2)
    assert (why, done) == ("patience", 6) and best.step == 2
    assert events[-1] == {"event": "patience", "job": "test", "step": 6, "total": 10, "evaluations": 2}


def test_patience_never_stops_the_last_step_or_with_zero():
    assert run(FakeJob([5.0, 6.0, 7.0]), end=6, every=2, patience=2)[0] == ("steps", 6)
    assert run(FakeJob([5.0, 6.0, 7.0, 8.0]), end=8, every=2, patience=0)[0] == ("steps", 8)


def test_a_skipped_step_does_not_count():
    job = FakeJob([5.0, 4.0], skips={1})
    (why, done), _best, _events = run(job, end=4, every=2)
    assert (why, done) == ("steps", 4) and job.tried == [0, 1, 1, 2, 3]


def test_the_job_can_end_the_process_with_a_resumable_stop():
    job = FakeJob([5.0], stop_at=3)
    assert run(job, end=8, every=2)[0] == ("stopped", 3)
    # continued from where it stopped (a resumed run): same cadence, counted from its phase's start
    job2 = FakeJob([4.0, 3.0, 2.0])
    (why, done), best, _ = run(job2, end=8, every=2, start=3)
    assert (why, done, job2.evaluated, best.step) == ("steps", 8, [4, 6, 8], 8)


def test_loss_scale_halves_to_one_and_ends_at_the_limit():
    s = LossScale(4.0, limit=4)
    assert [s.skip() for _ in range(4)] == [False, False, False, True]
    assert (s.value, s.skipped) == (1.0, 4)


def test_events_without_a_sink_are_dropped():
    Events(None, "x")("step", step=1)  # no error, nothing to send to


@pytest.mark.parametrize("value", [float("nan")])
def test_a_nan_score_is_never_a_new_best(value):
    best = Best(1.0, 0, "w")
    assert not best.offer(value, 2, lambda: "new") and best.snapshot == "w"
