"""An end-to-end `ddl-wgpu heal` of a Qwen3.8-27B-shaped checkpoint on disk within a GPU memory budget: the wall
time, the peak GPU memory (the engine's own count, from heal's report, and nvidia-smi's), the peak host RSS.

    python3 bench/heal_e2e.py                         # the 40-layer cut (qwen38-14b), --gpu-memory 16GB, 20000 tokens
    python3 bench/heal_e2e.py --shape qwen38-27b      # the whole 27B: 54 GB of f16 on disk, and as much for OUT
    python3 bench/heal_e2e.py --smoke                 # a tiny hybrid on lavapipe (the test of this script)

The model (`bench/heal.py --shape`'s config: a Qwen3.5-family hybrid with its MTP draft; random weights,
`common.RandomWeights`, its big matrices stored in f16 as a Hugging Face checkpoint stores them in bf16) is written
to --dir (default runs/heal_e2e); heal's output goes to --out-dir (default /dev/shm when it has room, so the disk
holds one copy of the model: the H200 machine's 64 GB disk cannot hold the 40-layer cut twice) and a corpus of
random words to --dir. Then, as a user runs it:

    ddl-wgpu heal MODEL --data TEXT --out OUT --gpu-memory SIZE --tokens N --trunk-dtype f16 --backend wgpu --json

in a subprocess, timed from start to exit, nvidia-smi's memory.used sampled every 0.2 s, the peak RSS from the
kernel's accounting of the child (`getrusage(RUSAGE_CHILDREN).ru_maxrss`; /proc sampled every 0.2 s splits it into
anonymous memory and the model file's mapped pages, which belong to the page cache), the trunk pass timed from heal's
progress lines (from its plan line to its last `trunk` line). The files are removed at the end (--keep keeps them).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (puts the repository root on sys.path)
import numpy as np  # noqa: E402
from heal import shape_config  # noqa: E402
from heal_stream import Smi  # noqa: E402

from ddl_ref.params import param_table  # noqa: E402
from ddl_wgpu.engine.layout import is_f16_matrix  # noqa: E402
from ddl_wgpu.files.container import save  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
WORDS = ["the", "model", "heals", "its", "draft", "on", "a", "trunk", "that", "was", "compressed", "and", "runs",
         "over", "many", "windows", "of", "text", "in", "blocks"]  # fmt: skip


def write_model(path: Path, cfg, seed: int = 0) -> int:
    """The model file: random weights, the big matrices in f16 (what a bf16 checkpoint costs on disk) -> bytes."""
    weights = common.RandomWeights(cfg, seed, f16=True)

    def tensors():
        for s in param_table(cfg):
            a = weights[s.name]
            yield s.name, a.astype(np.float16, copy=False) if is_f16_matrix(s.name, s.shape) else a

    n = sum(s.numel for s in param_table(cfg))
    save(path, tensors(), config=cfg.to_dict(), metadata={"model.variant": "baseline", "model.num_params": n},
         provenance={"bench": "heal_e2e: random weights"})  # fmt: skip
    return path.stat().st_size


class Rss:
    """A process's resident memory sampled every 0.2 s from /proc: the most of its anonymous pages (what it
    allocated) and of its file-backed ones (a memory-mapped model's pages it touched; the page cache's, which the
    kernel takes back under pressure)."""

    def __init__(self, pid: int):
        import threading

        self.pid, self.anon, self.file = pid, 0, 0
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                text = Path(f"/proc/{self.pid}/status").read_text()
            except OSError:
                return
            for line in text.splitlines():
                key, _, value = line.partition(":")
                if key in ("RssAnon", "RssFile") and value.strip():
                    n = int(value.split()[0]) * 1024
                    if key == "RssAnon":
                        self.anon = max(self.anon, n)
                    else:
                        self.file = max(self.file, n)
            time.sleep(0.2)

    def stop(self) -> None:
        self._stop.set()


def out_dir(arg: str | None, need: int, fallback: Path) -> Path:
    if arg:
        return Path(arg)
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 1.2 * need:
        return shm / "heal_e2e"
    return fallback


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen38-14b", choices=("qwen38-27b", "qwen38-14b", "quick-hybrid"))
    ap.add_argument("--gpu-memory", default="16GB")
    ap.add_argument("--tokens", type=int, default=20000)
    ap.add_argument("--trunk-dtype", default="f16", choices=("f32", "f16"))
    ap.add_argument(
        "--dir", default=str(REPO / "runs" / "heal_e2e"), help="where the model and corpus are written"
    )
    ap.add_argument("--out-dir", default=None, help="where heal writes (default /dev/shm when it has room)")
    ap.add_argument(
        "--smoke", action="store_true", help="a tiny hybrid within 6MB: a lavapipe run (the test)"
    )
    ap.add_argument("--keep", action="store_true", help="keep the model, corpus and output")
    ap.add_argument("--heal-args", default="", help="more heal options, e.g. '--no-verify --epochs 0.5'")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    heal_args = args.heal_args.split()
    if args.smoke:
        args.shape, args.gpu_memory, args.tokens, args.trunk_dtype = "quick-hybrid", "6MB", 800, "f32"
        heal_args = ["--window", "32", "--batch", "2", "--chain", "2", "--epochs", "0.2", *heal_args]
    cfg = shape_config(args.shape, 128)
    work = Path(args.dir)
    work.mkdir(parents=True, exist_ok=True)
    model, text = work / f"{args.shape}.ddlw", work / "corpus.txt"
    t0 = time.perf_counter()
    size = write_model(model, cfg)
    write_s = time.perf_counter() - t0
    rng = np.random.default_rng(1)
    text.write_text(" ".join(rng.choice(WORDS, max(2000, args.tokens // 3))))
    dest = out_dir(args.out_dir, size, work)
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / "healed.ddlw"
    print(f"wrote {model} ({size / 2**30:.2f} GiB, {write_s:.0f} s); heal writes {out}", flush=True)
    cmd = [sys.executable, "-m", "ddl_wgpu.cli", "heal", str(model), "--data", str(text), "--out", str(out),
           "--gpu-memory", args.gpu_memory, "--tokens", str(args.tokens), "--trunk-dtype", args.trunk_dtype,
           "--backend", "wgpu", "--force", "--json", *heal_args]  # fmt: skip
    path = os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p
    )  # keep the caller's (wgpu's)
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}
    smi = Smi()
    smi0 = smi._read() if smi.ok else None
    print("$ " + " ".join(cmd[1:]), flush=True)
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    stopped: list = []

    def stop(signum, frame) -> None:  # `timeout`'s SIGTERM: heal ends, and what it did so far is reported
        stopped.append(signum)
        p.terminate()

    signal.signal(signal.SIGTERM, stop)
    sampled = Rss(p.pid)
    marks, events = {}, []
    for line in p.stderr:  # heal's JSON progress lines, timed as they come
        now = time.perf_counter() - t0
        try:
            ev = json.loads(line)
        except ValueError:
            print(line, end="", file=sys.stderr)
            continue
        events.append(ev)
        kind = ev.get("event")
        if kind in ("plan", "windows") or (kind == "trunk" and ev["done"] == ev["windows"]):
            marks[kind] = now
        if kind in ("plan", "trunk", "refresh", "eval", "skip", "written"):
            print(f"  {now:7.1f}s {ev.get('line') or json.dumps(ev)}", flush=True)
    stdout = p.stdout.read()
    code = p.wait()
    wall = time.perf_counter() - t0
    t_end = time.perf_counter()
    smi.stop()
    sampled.stop()
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux
    report = json.loads(stdout) if code == 0 and stdout.strip() else None
    plan = report.get("plan") if report else next((e for e in events if e.get("event") == "plan"), None)
    trunk_s = marks["trunk"] - marks.get("plan", marks.get("windows", 0.0)) if "trunk" in marks else None
    windows_tokens = report["tokens"] if report else None
    r = {
        "shape": args.shape, "model_bytes": size, "write_s": write_s, "command": " ".join(cmd[1:]), "exit": code,
        "stopped": bool(stopped), "wall_s": wall, "trunk_pass_s": trunk_s, "events": events[-20:],
        "trunk_tokens_per_s": windows_tokens / trunk_s if trunk_s and windows_tokens else None,
        "plan": plan, "engine_peak_bytes": report.get("gpu_peak_bytes") if report else None,
        "engine_phase_peak_bytes": report.get("gpu_phase_peak_bytes") if report else None,
        "smi_peak_bytes": smi.peak(t0, t_end), "smi_before_bytes": smi0 * 2**20 if smi0 else None,
        "peak_rss_bytes": rss, "peak_rss_anon_bytes": sampled.anon, "peak_rss_file_bytes": sampled.file,
        "steps": report.get("steps") if report else None,
        "heldout_kl": [report["heldout_kl_start"], report["heldout_kl_best"]] if report else None,
    }  # fmt: skip
    data = {"bench": "heal_e2e", "date": common.now_iso(), "host": common.host_info(), "args": vars(args),
            "model": cfg.to_dict(), "result": r}  # fmt: skip
    common.write_json(common.json_path(args.json, "heal_e2e.json"), data)
    if not args.keep:
        for f in (model, text, out):
            f.unlink(missing_ok=True)

    def gib(n):
        return "-" if n is None else f"{n / 2**30:.2f} GiB"

    print(f"heal of {args.shape} ({gib(size)} on disk) with --gpu-memory {args.gpu_memory}, --tokens {args.tokens}: "
          f"exit {code}, wall {wall:.0f} s (trunk pass {trunk_s or 0:.0f} s, "
          f"{r['trunk_tokens_per_s'] or 0:,.0f} tokens/s); peak GPU memory {gib(r['engine_peak_bytes'])} (engine: "
          f"{', '.join(f'{k} {gib(v)}' for k, v in (r['engine_phase_peak_bytes'] or {}).items())}; plan "
          f"{gib(plan['peak_bytes'] if plan else None)}), "
          f"{gib(r['smi_peak_bytes'])} (nvidia-smi); peak host RSS {gib(rss)} (sampled: anonymous "
          f"{gib(sampled.anon)}, file-backed {gib(sampled.file)})")  # fmt: skip
    if code != 0:
        print(f"FAILED: heal exited {code}" + (" (stopped by SIGTERM)" if stopped else ""), file=sys.stderr)
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
