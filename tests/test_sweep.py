"""Sweeps (`ddl_wgpu.jobs.sweep`): a job run by a worker process, or a Ray task, gives the same report and
checkpoint as the sequential `train` of that variant and seed; seeds get their own folders and the comparison
ranks variants by their mean over seeds; a failed job is marked and the others go on; a sweep stopped part way
resumes as a whole to the same result.

Every sweep here trains a tiny model (d_model 32, one block) on the numpy backend (what CI has), except the
one test of two wgpu workers on one adapter."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from helpers import SHAPES, tiny_cfg

from ddl_ref.config import ModelVariant
from ddl_wgpu.data import ByteTokenizer, load_datasets
from ddl_wgpu.files.container import open_checkpoint
from ddl_wgpu.jobs import sweep as S
from ddl_wgpu.jobs import sweep_job as J
from ddl_wgpu.jobs import sweep_ray as SR
from ddl_wgpu.jobs import train as T

REPO = Path(__file__).resolve().parents[1]
MODEL = SHAPES["train"]  # also given to the CLI as options
CFG = tiny_cfg("train")
TCFG = T.TrainingConfig(max_steps=6, eval_interval=2, learning_rate=1e-2, min_learning_rate=1e-3, warmup_steps=2,
                        batch_size=2, seq_len=16, eval_batches=2, seed=0)  # fmt: skip
HAS_MPL = importlib.util.find_spec("matplotlib") is not None
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "pack", "my", "box", "with", "five"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text(" ".join(rng.choice(WORDS, 2500)))
    return path


@pytest.fixture
def quiet() -> S.SweepView:
    """The sweep's progress view, into a string."""
    return S.SweepView(io.StringIO())


def source(corpus: Path) -> dict:
    return {"data": str(corpus), "val_data": None, "val_fraction": 0.1, "max_tokens": 0}


def make_sweep(corpus, variants=("baseline", "ddl"), seeds=(0,), backend="ref", **kw) -> S.Sweep:
    return S.Sweep(CFG.to_dict(), TCFG.to_dict() | {"seed": seeds[0]}, list(variants), list(seeds),
                   source(corpus), backend, **kw)  # fmt: skip


def sequential(corpus, out: Path, variants=("baseline", "ddl"), seed=0, backend="ref", **training) -> dict:
    """What `train` without a sweep does: `train_variants` on data loaded once."""
    trn, val = load_datasets(str(corpus), tokenizer=ByteTokenizer(), seq_len=16, batch_size=2, val_fraction=0.1,
                             vocab_size=256, seed=seed)  # fmt: skip
    tcfg = T.TrainingConfig(**(TCFG.to_dict() | {"seed": seed} | training))
    opts = T.RunOptions(backend=backend, data=source(corpus))
    return T.train_variants(CFG, [ModelVariant.parse(v) for v in variants], trn, val, tcfg, out, opts)


def numbers(report: dict) -> dict:
    """A report without its wall-clock throughput (the only field that is not a function of the inputs)."""
    return {k: v for k, v in report.items() if k != "throughput"}


def tensors(path: Path) -> dict:
    with open_checkpoint(path) as ck:
        return {n: ck.tensor_f32(n) for n in ck.names()}


def assert_same_job(a: Path, b: Path) -> None:
    """Two job folders hold the same report numbers and bit-identical checkpoint tensors."""
    ra, rb = (json.loads((d / T.REPORT).read_text()) for d in (a, b))
    assert numbers(ra) == numbers(rb)
    ta, tb = tensors(a / T.CHECKPOINT), tensors(b / T.CHECKPOINT)
    assert sorted(ta) == sorted(tb)
    for n in ta:
        assert np.array_equal(ta[n], tb[n]), n


def assert_same_comparison(seq: dict, sweep: dict) -> None:
    for key in seq:
        if key == "reports":
            assert [numbers(r) for r in seq[key]] == [numbers(r) for r in sweep[key]]
        else:
            assert seq[key] == sweep[key], key


def test_two_workers_equal_the_sequential_sweep(corpus, tmp_path, quiet):
    seq = sequential(corpus, tmp_path / "seq")
    comp = S.run(make_sweep(corpus), tmp_path / "par", S.Runner((None, None)), view=quiet)
    assert_same_comparison(seq, comp)
    assert_same_comparison(seq, json.loads((tmp_path / "par" / T.REPORT).read_text()))
    for v in ("baseline", "ddl"):
        assert_same_job(tmp_path / "seq" / v, tmp_path / "par" / v)
    assert [j["status"] for j in comp["jobs"]] == ["completed", "completed"]


def test_seeds_have_their_folders_and_the_ranking_is_by_the_mean(corpus, tmp_path, quiet):
    comp = S.run(make_sweep(corpus, seeds=(0, 1)), tmp_path / "sw", S.Runner(), view=quiet)
    assert [j["job"] for j in comp["jobs"]] == [
        "baseline/seed-0",
        "baseline/seed-1",
        "ddl/seed-0",
        "ddl/seed-1",
    ]
    assert len(comp["reports"]) == 4
    # a job is `train --variants V --seed S`
    sequential(corpus, tmp_path / "one", variants=("ddl",), seed=1)
    assert_same_job(tmp_path / "one" / "ddl", tmp_path / "sw" / "ddl" / "seed-1")
    means = {}
    for v in ("baseline", "ddl"):
        losses = [r["final_validation"]["loss"] for r in comp["reports"] if r["variant"] == v]
        st = comp["seed_summary"][v]["final_validation"]
        assert st["mean"] == pytest.approx(np.mean(losses), abs=1e-12)
        assert st["std"] == pytest.approx(np.std(losses, ddof=1), abs=1e-12)
        assert (st["min"], st["max"], st["n"]) == (min(losses), max(losses), 2)
        means[v] = st["mean"]
    assert comp["final_validation_loss_ranking"] == sorted(means, key=means.get)
    assert comp["seeds"] == [0, 1] and set(comp["datasets"]) == {"0", "1"}
    assert "mean ± std" in S.table(comp)


def test_a_failed_job_is_marked_and_the_rest_go_on(corpus, tmp_path, monkeypatch, quiet):
    real = T.train_variant

    def broken(base, variant, *a, **kw):
        if variant.slug == "ddl":
            raise RuntimeError("the adapter was lost")
        return real(base, variant, *a, **kw)

    monkeypatch.setattr(T, "train_variant", broken)
    comp = S.run(make_sweep(corpus), tmp_path / "sw", S.Runner(), view=quiet)
    jobs = {j["job"]: j for j in comp["jobs"]}
    assert jobs["baseline"]["status"] == "completed"
    assert jobs["ddl"]["status"] == "failed" and "the adapter was lost" in jobs["ddl"]["error"]
    assert comp["final_train_loss_ranking"] == ["baseline"]


def test_a_worker_that_cannot_see_the_data_fails_its_job_with_the_reason(corpus, tmp_path):
    sw = make_sweep(corpus)
    sw = S.Sweep(**{**sw.__dict__, "data": source(tmp_path / "elsewhere.txt")})
    res = J.attempt(sw, sw.jobs()[0], tmp_path / "sw", None, None)
    assert res["status"] == "failed"
    assert "cannot see the training data" in res["error"] and "elsewhere.txt" in res["error"]


def test_a_stopped_sweep_resumes_as_a_whole(corpus, tmp_path, quiet):
    sequential(corpus, tmp_path / "seq")
    out = tmp_path / "sw"
    stopped = S.run(make_sweep(corpus), out, S.Runner((None, None)), stop_after=3, view=quiet)
    assert stopped["status"] == "stopped" and not (out / T.REPORT).exists()
    comp = S.resume(out, view=quiet)  # the sweep's own two workers
    for v in ("baseline", "ddl"):
        assert_same_job(tmp_path / "seq" / v, out / v)
    assert (
        comp["final_validation_loss_ranking"]
        == json.loads((tmp_path / "seq" / T.REPORT).read_text())["final_validation_loss_ranking"]
    )
    again = S.resume(out, view=quiet)  # every job finished: kept as it is, the comparison written anew
    assert_same_comparison(comp, again)


def test_a_sweep_recorded_with_precision_f16_resumes_in_f32(corpus, tmp_path, quiet):
    """`train --precision f16` (removed) recorded its precision in sweep.json: such a sweep resumes in f32,
    says so in one line, and ends where an f32 sweep ends."""
    sequential(corpus, tmp_path / "seq", variants=("baseline",))
    out = tmp_path / "sw"
    S.run(make_sweep(corpus, variants=("baseline",)), out, S.Runner(), stop_after=3, view=quiet)
    record = json.loads((out / J.SWEEP).read_text())
    assert "precision" not in record
    (out / J.SWEEP).write_text(json.dumps({**record, "precision": "f16"}))
    said = []
    assert S.Sweep.load(out, say=said.append) == S.Sweep(**record)
    assert said == [f"{out} was trained with --precision f16, which no longer exists: it resumes in f32"]
    r = cli("resume", out)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("--precision f16, which no longer exists: it resumes in f32") == 1
    assert_same_job(tmp_path / "seq" / "baseline", out / "baseline")


def test_two_wgpu_workers_on_one_adapter(corpus, tmp_path, quiet):
    pytest.importorskip("wgpu")
    sequential(corpus, tmp_path / "seq", variants=("ddl",), backend="wgpu")
    S.run(make_sweep(corpus, variants=("baseline", "ddl"), backend="wgpu"), tmp_path / "sw",
          S.Runner(("0", "0")), view=quiet)  # fmt: skip
    assert_same_job(tmp_path / "seq" / "ddl", tmp_path / "sw" / "ddl")


def test_ray_local_cluster_runs_the_sweep(corpus, tmp_path, quiet):
    pytest.importorskip("ray")
    seq = sequential(corpus, tmp_path / "seq")
    comp = S.run(make_sweep(corpus), tmp_path / "ray", S.Runner((None, None), "local"),
                 view=quiet)  # fmt: skip
    assert_same_comparison(seq, comp)
    for v in ("baseline", "ddl"):
        assert_same_job(tmp_path / "seq" / v, tmp_path / "ray" / v)


def _x86_kernel_without_avx512() -> dict:
    """OPENBLAS_CORETYPE=Haswell where the CPU runs it (x86 with AVX2): the kernel of most x86 servers without
    AVX-512, under which OpenBLAS sums many products in another order with another thread count."""
    try:
        flags = next(
            (ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), ""
        )
    except OSError:
        flags = ""
    return {"OPENBLAS_CORETYPE": "Haswell"} if " avx2" in flags else {}


def test_a_job_gives_the_same_bits_whatever_the_blas_threads(corpus, tmp_path):
    """Issue 31 item 7: a `--ray local` sweep on numpy differed from the same sweep run in the driver in the last
    bits of a job: a Ray worker runs with OMP_NUM_THREADS=1, the driver with a BLAS thread per core, and OpenBLAS
    takes another path through a product with another thread count. The numpy backend runs its BLAS on one
    thread whatever the environment (`refnet.one_blas_thread`), so one job, trained under 1 and 2 threads,
    gives the same report and checkpoint. Products of 1024 rows, large enough to be split over threads."""
    model = [f"--{k.replace('_', '-')}={v}" for k, v in MODEL.items()]
    args = ["train", "--data", corpus, "--variants", "baseline", "--backend", "ref", "--no-plots", *model,
            "--max-steps", 2, "--eval-interval", 2, "--batch-size", 32, "--seq-len", 32, "--eval-batches", 1,
            "--val-fraction", 0, "--max-tokens", 0]  # fmt: skip
    for threads in ("1", "2"):
        env = {**os.environ, **_x86_kernel_without_avx512(), "OPENBLAS_NUM_THREADS": threads, "OMP_NUM_THREADS": threads,
               "PYTHONPATH": str(REPO)}  # fmt: skip
        r = subprocess.run([sys.executable, "-m", "ddl_wgpu.cli", *map(str, args), "--out", tmp_path / threads],
                           cwd=REPO, capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
        assert r.returncode == 0, r.stderr
    assert_same_job(tmp_path / "1" / "baseline", tmp_path / "2" / "baseline")


def test_the_numpy_backend_runs_its_blas_on_one_thread():
    """What makes item 7 hold on any CPU: once a command chose the numpy backend, the process's BLAS runs on
    one thread, whatever it ran on before."""
    threadpoolctl = pytest.importorskip("threadpoolctl")
    from ddl_wgpu.backend import make_net

    def blas_threads() -> set[int]:
        return {lib["num_threads"] for lib in threadpoolctl.threadpool_info() if lib["user_api"] == "blas"}

    if not blas_threads():
        pytest.skip("numpy's BLAS is not one threadpoolctl can see")
    before = threadpoolctl.threadpool_limits(2, user_api="blas")  # a Ray driver's, a terminal's
    try:
        assert blas_threads() == {2}
        make_net(CFG, None, "ref", None)
        assert blas_threads() == {1}
    finally:
        before.restore_original_limits()


def test_runner_options():
    assert S.Runner.parse("ref", None, 2, None, None) == S.Runner((None, None))
    assert S.Runner.parse("ref", None, 0, None, None) == S.Runner()  # --seeds alone: one after another
    with pytest.raises(S.SweepError, match="--workers N"):
        S.Runner.parse("ref", "0,1", 0, None, None)
    assert S.Runner.parse("wgpu", "0,0", 0, None, None).devices == ("0", "0")
    assert S.Runner.parse("wgpu", "0,1", 3, None, None).devices == ("0", "1", "0")
    assert S.Runner.parse("wgpu", None, 2, None, "1").devices == ("1", "1")  # two workers on --device 1
    assert S.Runner.parse("wgpu", None, 0, "ray://head:10001", None) == S.Runner((), "ray://head:10001")
    with pytest.raises(S.SweepError, match="declare their own"):
        S.Runner.parse("wgpu", "0", 0, "auto", None)
    assert S.parse_seeds("0, 1,2") == [0, 1, 2]
    for bad in ("", "1,1", "-1", "a"):
        with pytest.raises(S.SweepError):
            S.parse_seeds(bad)


def test_adapter_slots_are_held_until_released(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    a, fa = SR._claim_slot()
    b, fb = SR._claim_slot()
    assert (a, b) == (0, 1)
    fa.close()
    c, fc = SR._claim_slot()
    assert c == 0
    fb.close()
    fc.close()


class Events(list):
    """A Ray queue's two methods the task calls, in this process."""

    put_nowait = list.append

    def empty(self):
        return not self


def test_a_ray_task_writes_into_a_shared_out_else_returns_its_folder(corpus, tmp_path):
    sequential(corpus, tmp_path / "seq", variants=("ddl",))
    sw = make_sweep(corpus, variants=("ddl",))
    events = Events()
    res = SR._ray_task(sw, sw.jobs()[0], str(tmp_path / "not-here"), [], {}, (0, False), events, Events())
    assert res["status"] == "completed" and not (tmp_path / "not-here").exists()
    assert set(res["files"]) == {T.REPORT, T.CHECKPOINT}
    for rel, data in res["files"].items():
        (tmp_path / "got" / "ddl").mkdir(parents=True, exist_ok=True)
        (tmp_path / "got" / "ddl" / rel).write_bytes(data)
    assert_same_job(tmp_path / "seq" / "ddl", tmp_path / "got" / "ddl")
    assert [e["event"] for _, e in events][:2] == ["start", "eval"]
    sw.save(tmp_path / "shared")  # the driver's OUT/sweep.json, seen by the task: it writes there itself
    res = SR._ray_task(sw, sw.jobs()[0], str(tmp_path / "shared"), [], {}, (0, False), Events(), Events())
    assert "files" not in res
    assert_same_job(tmp_path / "seq" / "ddl", tmp_path / "shared" / "ddl")


def cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "ddl_wgpu.cli", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


def train_args(corpus, out, steps=6):
    model = [f"--{k.replace('_', '-')}={v}" for k, v in MODEL.items()]
    return ["train", "--data", corpus, "--out", out, "--variants", "baseline,ddl", "--backend", "ref", *model,
            "--max-steps", steps, "--eval-interval", max(steps // 3, 1), "--learning-rate", "1e-2",
            "--min-learning-rate", "1e-3", "--warmup-steps", 2, "--batch-size", 2, "--seq-len", 16,
            "--eval-batches", 2, "--val-fraction", 0.1, "--max-tokens", 0]  # fmt: skip


def test_cli_seed_sweep_with_two_workers_and_resume(corpus, tmp_path):
    out = tmp_path / "sw"
    r = cli(*train_args(corpus, out), "--seeds", "0,1", "--workers", 2)
    assert r.returncode == 0, r.stderr
    assert "4 jobs (2 variants x 2 seeds), 2 worker processes" in r.stdout
    assert "mean ± std" in r.stdout and "ddl/seed-1" in r.stdout
    assert "[baseline/seed-0] completed" in r.stderr and "[ddl/seed-1] step 6/6" in r.stderr
    if HAS_MPL:
        assert (out / "loss.png").is_file()
    first = json.loads((out / T.REPORT).read_text())
    r = cli("resume", out)  # every job finished: kept, the comparison written again
    assert r.returncode == 0, r.stderr
    assert json.loads((out / T.REPORT).read_text())["seed_summary"] == first["seed_summary"]
    r = cli("resume", tmp_path)
    assert r.returncode == 2 and "not a sweep folder" in r.stderr


def test_ctrl_c_stops_every_worker_resumably_and_resume_finishes_the_sweep(corpus, tmp_path):
    out, steps = tmp_path / "sw", 600
    proc = subprocess.Popen([sys.executable, "-m", "ddl_wgpu.cli", *map(str, train_args(corpus, out, steps)),
                             "--workers", "2"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    stepping = set()
    for line in proc.stderr:
        if line.startswith("[") and "] step " in line:
            stepping.add(line[1 : line.index("]")])
        if stepping == {"baseline", "ddl"}:
            break
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole process group
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert f"resume {out}" in err
    stopped = [json.loads((out / v / T.REPORT).read_text())["steps_completed"] for v in ("baseline", "ddl")]
    assert all(0 < n < steps for n in stopped), stopped
    r = cli("resume", out)
    assert r.returncode == 0, r.stderr
    sequential(corpus, tmp_path / "seq", max_steps=steps, eval_interval=steps // 3)
    for v in ("baseline", "ddl"):
        assert_same_job(tmp_path / "seq" / v, out / v)
