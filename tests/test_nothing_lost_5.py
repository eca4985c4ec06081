"""Issue 41 (round 5), the file writers: nothing a user has is lost, whatever runs beside a command, whatever
the file system or a signal does to it.

- two writers of one output never share a file: one paused in the middle of its write (SIGSTOP) while the other
  writes the same `--out`, then resumed (item 1); a link planted under a writer's old fixed temporary name is
  never followed (every writer: the container, the JSON reports);
- heal's scratch file: a link or a model planted under its old name (item 2), two spilled heals of one OUT
  (item 4), a full disk (a 16 KB tmpfs, item 6), `ulimit -f` (item 7), OUT names of 250 and 256 bytes (item 8),
  SIGTERM (item 9), and the report's `scratch_bytes` (item 16);
- `export-hf --force` onto the folder a Qwen3 model was imported from keeps its small files (item 3);
- refused `compress`, `heal` and `import-hf` runs leave no empty `--out` folder (item 15);
- a Ctrl-C that lands after the output is in place is success (item 18).

Tiny models on the numpy backend: each command takes about a second.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import cli_sizes, make_model, make_text, tiny_cfg

from ddl_ref.config import MtpConfig
from ddl_ref.params import init_params
from ddl_wgpu.files import hostmem
from ddl_wgpu.files.container import open_checkpoint
from ddl_wgpu.files.hf.convert import export_hf_from_file, import_hf_to_file
from ddl_wgpu.files.modelfile import Model, save_model
from ddl_wgpu.jobs import heal, rundir

REPO = Path(__file__).resolve().parents[1]
MODEL = cli_sizes(n_layers=1)
HEAL = ["--window", "24", "--tokens", "600", "--batch", "2", "--chain", "2", "--epochs", "0.3", "--eval-every",
        "4", "--patience", "0", "--backend", "ref"]  # fmt: skip
SPILL = ["--host-memory", "1KB"]  # the chain's rows (about 38 KB here) in the scratch file

# Runs the command line with a pause: the process stops itself (SIGSTOP) where the first argument says, so that a
# test can run another command beside it and then resume it (SIGCONT), every time at the same point.
PAUSED = r"""
import os, signal, sys
from ddl_wgpu.files import container
from ddl_wgpu.jobs import heal
where, sys.argv = sys.argv[1], ["ddl-wgpu", *sys.argv[2:]]
def pause(cls, name):
    real, done = getattr(cls, name), []
    def paused(self, *a, **kw):
        if not done:
            done.append(1)
            os.kill(os.getpid(), signal.SIGSTOP)
        return real(self, *a, **kw)
    setattr(cls, name, paused)
if where == "finish":  # the output's data written, its header not yet: the middle of the write
    pause(container._Part, "finish")
elif where == "refresh":  # heal's trunk pass done (step 1's rows in the scratch file), the chain not yet built
    pause(heal._Chain, "refresh")
from ddl_wgpu.cli.app import main
main()
"""


def _env() -> dict:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path, "PYTHONDONTWRITEBYTECODE": "1"}


def start(*args, paused: str | None = None, **kw) -> subprocess.Popen:
    head = ["-c", PAUSED, paused] if paused else ["-m", "ddl_wgpu.cli"]
    return subprocess.Popen([sys.executable, *head, *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(), **kw)  # fmt: skip


def finish(p: subprocess.Popen, timeout: float = 120) -> subprocess.CompletedProcess:
    out, err = p.communicate(timeout=timeout)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def wait_stopped(p: subprocess.Popen, timeout: float = 120) -> None:
    """Until `p` has stopped itself (its state in /proc is T)."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        if p.poll() is not None:
            raise AssertionError(f"exited {p.returncode} before pausing: {p.communicate()[1]}")
        with open(f"/proc/{p.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.02)
    p.kill()
    raise AssertionError("never paused")


def leftovers(folder: Path) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.endswith((".partial", ".scratch")))


def verified(path: Path) -> bytes:
    with open_checkpoint(path) as ck:
        ck.verify()
    return path.read_bytes()


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    """m.ddlw (a tiny model with a draft), t.txt and u.txt (two texts), and heal's output on t.txt alone."""
    d = tmp_path_factory.mktemp("lost5")
    make_model(d / "m.ddlw", tiny_cfg(qk_norm="pre_rope", mtp=MtpConfig()))
    make_text(d / "t.txt", 400)
    make_text(d / "u.txt", 400, seed=5)
    return d


@pytest.fixture
def tmpfs(tmp_path):
    """A 16 KB tmpfs (root only): a disk that fills up."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root; this test runs as another user")
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


# ---------------------------------------------------------------------------------------------------------
# item 1: two writers of one output


@pytest.mark.parametrize("force", [False, True])
def test_two_writers_of_one_output_never_share_a_file(tmp_path, cli, ok, user_error, force):
    """The first `init` stops in the middle of its write; a second writes the same --out and says so. Without
    --force the first to finish keeps the name and the other says another run wrote it; with --force the last
    wins. Either way the output is one writer's whole file (it verifies). The two used to share `o.ddlw.partial`:
    the first went on writing into the second's file, now under the final name (a hash mismatch), and said
    that nothing was written."""
    out = tmp_path / "o.ddlw"
    extra = ["--force"] if force else []
    first = start("init", "--seed", "1", "--out", out, *MODEL, *extra, paused="finish")
    wait_stopped(first)
    assert len(leftovers(tmp_path)) == 1  # its own partial file, complete but for the header
    ok(cli("init", "--seed", "2", "--out", out, *MODEL, *extra))
    second = verified(out)
    os.kill(first.pid, signal.SIGCONT)
    r = finish(first)
    if force:
        ok(r)
        ok(cli("init", "--seed", "1", "--out", tmp_path / "alone.ddlw", *MODEL))
        assert verified(out) == (tmp_path / "alone.ddlw").read_bytes() != second  # the last rename's, whole
    else:
        user_error(r, str(out), "another run wrote it", "left as it is")
        assert verified(out) == second
    assert leftovers(tmp_path) == []


def test_a_link_under_a_temporary_name_is_never_followed(tmp_path, cli, ok):
    """Every writer used to open `NAME.partial` (the container's model files, the runs' JSON reports) following
    a link planted there: the file it points to was overwritten, and the link renamed over NAME."""
    precious = tmp_path / "precious.txt"
    precious.write_text("mine")
    out = tmp_path / "o.ddlw"
    (tmp_path / "o.ddlw.partial").symlink_to(precious)
    ok(cli("init", "--out", out, *MODEL))
    report = tmp_path / "report.json"
    (tmp_path / "report.json.partial").symlink_to(precious)
    rundir.write_json(report, {"a": 1})
    assert precious.read_text() == "mine"
    assert not out.is_symlink() and not report.is_symlink() and json.loads(report.read_text()) == {"a": 1}
    verified(out)


# ---------------------------------------------------------------------------------------------------------
# heal's scratch file (items 2, 4, 6-9, 16)


def test_heal_scratch_never_writes_into_what_is_there(kit, tmp_path, cli, ok):
    """Item 2: a link at `.OUT.scratch` had its target overwritten with chain rows, then unlinked; a model
    stored at that name and given as the input was truncated and deleted."""
    precious = tmp_path / "precious.txt"
    precious.write_text("mine")
    (tmp_path / ".g.ddlw.scratch").symlink_to(precious)
    ok(cli("heal", kit / "m.ddlw", "--data", kit / "t.txt", "--out", tmp_path / "g.ddlw", *HEAL, *SPILL))
    assert precious.read_text() == "mine" and (tmp_path / ".g.ddlw.scratch").is_symlink()
    model = tmp_path / ".h.ddlw.scratch"
    model.write_bytes((kit / "m.ddlw").read_bytes())
    ok(cli("heal", model, "--data", kit / "t.txt", "--out", tmp_path / "h.ddlw", *HEAL, *SPILL))
    assert model.read_bytes() == (kit / "m.ddlw").read_bytes()
    assert (tmp_path / "h.ddlw").read_bytes() == (tmp_path / "g.ddlw").read_bytes()  # same model, same bits
    assert leftovers(tmp_path) == [".g.ddlw.scratch", ".h.ddlw.scratch"]  # the two planted, nothing of heal's


def test_two_spilled_heals_of_one_out_keep_their_own_rows(kit, tmp_path, cli, ok):
    """Item 4: the first heal (paused after its trunk pass) and a second on other data, with the same --out,
    shared `.OUT.scratch`: the first then trained on the second's rows (or died of SIGBUS). Each has its own
    file now, so the first writes what it writes alone, bit for bit."""
    alone = tmp_path / "alone.ddlw"
    ok(cli("heal", kit / "m.ddlw", "--data", kit / "t.txt", "--out", alone, *HEAL, *SPILL))
    out = tmp_path / "o.ddlw"
    first = start("heal", kit / "m.ddlw", "--data", kit / "t.txt", "--out", out, *HEAL, *SPILL, "--force",
                  paused="refresh")  # fmt: skip
    wait_stopped(first)
    ok(cli("heal", kit / "m.ddlw", "--data", kit / "u.txt", "--out", out, *HEAL, *SPILL, "--force"))
    os.kill(first.pid, signal.SIGCONT)
    ok(finish(first))
    assert out.read_bytes() == alone.read_bytes()
    assert leftovers(tmp_path) == []


def test_heal_on_a_full_disk_is_one_line(kit, tmpfs, cli, user_error):
    """Item 6: the sparse scratch file met the full disk when a page of its map was first written: SIGBUS (exit
    135, no line), the file left behind and the disk full. Its space is reserved up front now."""
    r = cli("heal", kit / "m.ddlw", "--data", kit / "t.txt", "--out", tmpfs / "g.ddlw", *HEAL, *SPILL)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert lines[-1].startswith("error: ") and "no space left" in lines[-1] and "scratch" in lines[-1], (
        r.stderr
    )
    assert os.listdir(tmpfs) == [] and os.statvfs(tmpfs).f_bfree == os.statvfs(tmpfs).f_blocks


def _file_limit(limit: int):
    def set_limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit, write() fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return set_limit


def test_heal_under_a_file_size_limit_is_one_line(kit, tmp_path):
    """Item 7: `ulimit -f` made the scratch file's growth an `OSError: [Errno 27] File too large` traceback."""
    p = start("heal", kit / "m.ddlw", "--data", kit / "t.txt", "--out", tmp_path / "g.ddlw", *HEAL, *SPILL,
              preexec_fn=_file_limit(16 * 1024))  # fmt: skip
    r = finish(p)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert lines[-1].startswith("error: ") and "file too large" in lines[-1], r.stderr
    assert leftovers(tmp_path) == [] and not (tmp_path / "g.ddlw").exists()


def test_heal_with_the_longest_out_names(kit, tmp_path, cli, ok, user_error):
    """Item 8: OUT names of 247-255 bytes made the scratch's name too long, at the end, after OUT was written
    (exit 2 for a complete heal, or a message masking the real error). The temporary names are cut to fit now;
    a name no file system holds is refused before any work."""
    out = tmp_path / ("g" * 245 + ".ddlw")  # 250 bytes
    ok(cli("heal", kit / "m.ddlw", "--data", kit / "t.txt", "--out", out, *HEAL, *SPILL))
    verified(out)
    ok(cli("heal", kit / "m.ddlw", "--data", kit / "t.txt", "--out", out, *HEAL, "--force"))  # in RAM
    too_long = tmp_path / ("g" * 251 + ".ddlw")  # 256 bytes
    user_error(cli("heal", kit / "m.ddlw", "--data", kit / "t.txt", "--out", too_long, *HEAL), "too long")
    assert leftovers(tmp_path) == []


def test_sigterm_removes_the_scratch_file(kit, tmp_path):
    """Item 9: SIGTERM (kill, timeout, a batch scheduler) left `.OUT.scratch` behind; it is handled as Ctrl-C
    now: the run's files removed, one line, exit 143."""
    out = tmp_path / "g.ddlw"
    args = [a if a != "0.3" else "50" for a in HEAL]  # many epochs: still training when SIGTERM comes
    p = start("heal", kit / "m.ddlw", "--data", kit / "t.txt", "--out", out, *args, *SPILL)
    t0 = time.time()
    while not hostmem.scratch_files(out) and p.poll() is None and time.time() - t0 < 120:
        time.sleep(0.02)
    assert hostmem.scratch_files(out), finish(p).stderr
    p.send_signal(signal.SIGTERM)
    r = finish(p)
    assert r.returncode == 143 and r.stderr.strip().splitlines()[-1] == "terminated", r.stderr
    assert "Traceback" not in r.stderr and leftovers(tmp_path) == [] and not out.exists()


def test_scratch_bytes_are_what_the_rows_occupy(kit, tmp_path):
    """Item 16: each refresh mapped a new region per chain step (35.7 MB of scratch for 0.98 MB of rows at
    --refresh 1); one region per chain step now, rewritten in place."""
    cfg = heal.HealConfig(
        chain=3, window=24, tokens=600, batch=2, eval_every=4, patience=0, epochs=0.3, refresh=1
    )
    r = heal.heal(kit / "m.ddlw", str(kit / "t.txt"), tmp_path / "g.ddlw", cfg, host_memory=1024)
    d_model = tiny_cfg().d_model
    assert r["scratch_bytes"] == cfg.chain * r["windows"] * cfg.window * d_model * 2
    assert leftovers(tmp_path) == []


# ---------------------------------------------------------------------------------------------------------
# item 3: export-hf --force


def test_export_hf_force_keeps_the_files_it_does_not_write(tmp_path):
    """Item 3: export-hf --force onto the folder a Qwen3 model was imported from deleted its vocab.json,
    merges.txt, tokenizer_config.json and generation_config.json (the import keeps none of them for Qwen3 or
    Llama, and the export writes none back)."""
    cfg = tiny_cfg(qk_norm="pre_rope")
    save_model(tmp_path / "q.ddlw", Model(cfg, init_params(cfg, 0)))
    folder = tmp_path / "hf"
    export_hf_from_file(tmp_path / "q.ddlw", folder)
    small = {"vocab.json": b'{"a": 0}', "merges.txt": b"a b\n", "tokenizer_config.json": b"{}",
             "generation_config.json": b'{"do_sample": false}'}  # fmt: skip
    for name, data in small.items():
        (folder / name).write_bytes(data)
    import_hf_to_file(folder, tmp_path / "i.ddlw")
    weights = (folder / "model.safetensors").read_bytes()
    save_model(tmp_path / "j.ddlw", Model(cfg, init_params(cfg, 1)))  # other weights, written over the folder
    export_hf_from_file(tmp_path / "j.ddlw", folder, overwrite=True)
    assert {n: (folder / n).read_bytes() for n in small} == small
    assert (folder / "model.safetensors").read_bytes() != weights
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "i.ddlw", "j.ddlw", "q.ddlw"]


# ---------------------------------------------------------------------------------------------------------
# item 15: refused runs leave no folder


def test_refused_runs_leave_no_out_folder(kit, tmp_path, cli):
    """Item 15: the output's folder was made before the refusal (bad layers, missing data, a window past the
    context, a folder that is not a model)."""
    out = tmp_path / "new" / "deeper" / "o.ddlw"
    runs = [("compress", kit / "m.ddlw", "--out", out, "--drop-layers", "7"),
            ("heal", kit / "m.ddlw", "--data", tmp_path / "missing.txt", "--out", out, *HEAL),
            ("heal", kit / "m.ddlw", "--data", kit / "t.txt", "--out", out, *HEAL[2:], "--window", "4096"),
            ("import-hf", kit, out)]  # fmt: skip
    for args in runs:
        r = cli(*args)
        assert r.returncode == 2 and "Traceback" not in r.stderr, (args[0], r.stderr)
        assert not (tmp_path / "new").exists(), (args[0], r.stderr)


# ---------------------------------------------------------------------------------------------------------
# item 18: a Ctrl-C once the output is in place


def test_ctrl_c_once_the_output_is_in_place_is_success(kit, tmp_path, monkeypatch, capsys):
    """Item 18: a Ctrl-C that landed after `compress` had renamed its output, once the command returned and
    before the entry point ignored Ctrl-C, said "interrupted" (exit 130) over a complete output."""
    from ddl_wgpu.cli import app

    real = app._invoke

    def ctrl_c_as_it_returns() -> int:
        real()
        raise KeyboardInterrupt

    out = tmp_path / "c.ddlw"
    monkeypatch.setattr(app, "_invoke", ctrl_c_as_it_returns)
    monkeypatch.setattr(sys, "argv", ["ddl-wgpu", "compress", str(kit / "m.ddlw"), "--out", str(out),
                                      "--drop-layers", "1"])  # fmt: skip
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = app._main()
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    err = capsys.readouterr().err
    assert code == 0 and "Ctrl-C came after it was written" in err and "interrupted" not in err, err
    verified(out)
    # Before anything is in place, the same Ctrl-C is an interruption
    out.unlink()
    monkeypatch.setattr(app, "_invoke", lambda: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        code = app._main()
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    assert code == 130 and capsys.readouterr().err.strip() == "interrupted"


def test_scratch_left_by_a_kill_9_goes_with_the_next_run(kit, tmp_path, cli, ok):
    """A kill -9 leaves the run's scratch file; the next run of the same OUT removes it (its process is gone),
    and never one of a live process."""
    out = tmp_path / "g.ddlw"
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    stale = tmp_path / f".g.ddlw.{int(dead.stdout)}.0123abcd.scratch"
    live = tmp_path / f".g.ddlw.{os.getpid()}.0123abcd.scratch"
    for p in (stale, live):
        p.write_bytes(b"x" * 100)
    ok(cli("heal", kit / "m.ddlw", "--data", kit / "t.txt", "--out", out, *HEAL, *SPILL))
    assert not stale.exists() and live.exists()
    verified(out)
