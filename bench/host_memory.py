"""Host memory of the file commands: the peak anonymous memory (RSS less the file-backed pages) of `export-hf`,
`import-hf` and `compress` on the `medium` hybrid with its draft, and on a larger synthetic Hugging Face folder
(a bf16 `Qwen3_5ForCausalLM` written shard by shard), each command run as the user runs it (`python -m
ddl_wgpu.cli ...`, a fresh process).

Per command: the peak of RssAnon sampled every 5 ms from /proc/PID/status, the process's own VmHWM (its peak
RSS, file-backed pages included) and the wall time. Linux only (/proc). CPU only: the commands touch no GPU.

    python3 bench/host_memory.py                  # medium hybrid + a 2.5 GB bf16 folder (a few minutes)
    python3 bench/host_memory.py --smoke          # a tiny hybrid and a 20 MB folder (seconds)
    python3 bench/host_memory.py --cases hybrid   # the medium hybrid only

What this does not do: measure the GPU (`bench/heal.py` does) or check the outputs' values (the tests do).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from common import ROOT, host_info, json_path, now_iso, write_json

SAMPLE_S = 0.005


def _status(pid: int) -> dict[str, int]:
    """RssAnon and VmHWM of a running process, in bytes ({} once it is gone)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("RssAnon", "VmHWM"):
                    out[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return {}
    return out


def measure(args: list[str]) -> dict:
    """Run `python -m ddl_wgpu.cli ARGS`, sampling its memory until it exits."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OPENBLAS_NUM_THREADS": "1", "LP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "ddl_wgpu.cli", *map(str, args)]
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    anon = hwm = 0
    while p.poll() is None:
        s = _status(p.pid)
        anon, hwm = max(anon, s.get("RssAnon", 0)), max(hwm, s.get("VmHWM", 0))
        time.sleep(SAMPLE_S)
    wall = time.perf_counter() - t0
    out = p.stdout.read().decode(errors="replace")
    if p.returncode:
        raise RuntimeError(f"{' '.join(map(str, args))}: exit {p.returncode}: {out[-2000:]}")
    return {"command": "ddl-wgpu " + " ".join(map(str, args)), "peak_anon_mb": anon / 1e6, "vm_hwm_mb": hwm / 1e6,
            "seconds": wall}  # fmt: skip


def _size_mb(path: Path) -> float:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files) / 1e6


def medium_hybrid(work: Path, preset: str) -> tuple[str, float, list[dict]]:
    """init --arch qwen3_5 --preset PRESET --mtp, then export-hf, import-hf, compress --drop-layers 1-3."""
    m = work / "m.ddlw"
    layers = ["--n-layers", "5"] if preset == "tiny" else []  # tiny has 2 blocks; 1-3 are dropped
    subprocess.run([sys.executable, "-m", "ddl_wgpu.cli", "init", "--arch", "qwen3_5", "--preset", preset, "--mtp",
                    *layers, "--out", m], check=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                   stdout=subprocess.DEVNULL)  # fmt: skip
    rows = [
        measure(["export-hf", m, work / "hf"]),
        measure(["import-hf", work / "hf", work / "back.ddlw"]),
        measure(["compress", work / "back.ddlw", "--out", work / "c.ddlw", "--drop-layers", "1-3"]),
    ]
    return f"{preset} hybrid + draft, f32", _size_mb(m), rows


def synthetic_folder(folder: Path, gb: float, smoke: bool) -> None:
    """A bf16 Qwen3_5ForCausalLM folder of about `gb` GB with an mtp.* draft, in 1 GB shards (smoke: 2 MB),
    written tensor by tensor (each a tiled random block: writing is fast, values are not all alike): 2,048 wide,
    a tied vocabulary of 151,936, as many layers (a multiple of 4) as the size takes (2.5 GB: 20)."""
    from ddl_ref.config import ModelConfig, MtpConfig, apply_arch
    from ddl_ref.params import param_table
    from ddl_wgpu.files.container import f32_to_bf16
    from ddl_wgpu.files.hf.folder import StTensor, write_safetensors
    from ddl_wgpu.files.hf.qwen35 import folder_name, folder_shape

    width, vocab = (256, 4096) if smoke else (2048, 151936)

    def hybrid(n_layers: int) -> ModelConfig:
        base = ModelConfig(vocab_size=vocab, d_model=width, n_layers=n_layers, n_heads=width // 128,
                           n_kv_heads=2, head_dim=128, ffn_hidden=3 * width, max_seq_len=4096)  # fmt: skip
        return apply_arch(base, "qwen3_5")

    count = [sum(s.numel for s in param_table(hybrid(n))) for n in (4, 8)]
    per_layer = (count[1] - count[0]) / 4
    layers = max(4, 4 * round((gb * 1e9 / 2 - (count[0] - 4 * per_layer)) / per_layer / 4))
    cfg = dataclasses.replace(
        hybrid(layers), mtp=MtpConfig(trunk_hidden="post_norm", chain_hidden="post_norm")
    )
    folder.mkdir(parents=True)
    block = f32_to_bf16(np.random.default_rng(0).standard_normal(1 << 16).astype(np.float32) * 0.02)
    shard_bytes = (2 << 20) if smoke else (1 << 30)
    groups, used = [[]], 0
    for s in param_table(cfg):
        n = math.prod(s.shape) * 2
        if groups[-1] and used + n > shard_bytes:
            groups.append([])
            used = 0
        groups[-1].append(s)
        used += n
    weight_map = {}
    for k, group in enumerate(groups):
        shard = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = [StTensor(folder_name(s.name, "model."), "BF16", folder_shape(s.name, s.shape),
                            np.resize(block, s.numel) if "norm" not in s.name else np.zeros(s.numel, np.uint16))
                   for s in group]  # fmt: skip
        write_safetensors(folder / shard, tensors, {"format": "pt"})
        del tensors
        weight_map.update({folder_name(s.name, "model."): shard for s in group})
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    text = {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "vocab_size": vocab,
            "hidden_size": width, "intermediate_size": cfg.ffn_hidden, "num_hidden_layers": layers,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
            "layer_types": list(cfg.layer_types), "linear_num_key_heads": cfg.linear_k_heads,
            "linear_num_value_heads": cfg.linear_v_heads, "linear_key_head_dim": cfg.linear_k_dim,
            "linear_value_head_dim": cfg.linear_v_dim, "linear_conv_kernel_dim": 4, "tie_word_embeddings": cfg.tie_embeddings,
            "max_position_embeddings": 4096, "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e7,
                                "partial_rotary_factor": cfg.rotary_dim / cfg.head_dim}}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(text, indent=2))


def large_folder(work: Path, gb: float, smoke: bool) -> tuple[str, float, list[dict]]:
    """import-hf of the synthetic folder, export-hf of the result, compress --drop-layers 1-3."""
    synthetic_folder(work / "big", gb, smoke)
    rows = [
        measure(["import-hf", work / "big", work / "big.ddlw"]),
        measure(["export-hf", work / "big.ddlw", work / "big-out"]),
        measure(["compress", work / "big.ddlw", "--out", work / "big-c.ddlw", "--drop-layers", "1-3"]),
    ]
    return "synthetic bf16 Qwen3_5ForCausalLM folder + draft, sharded", _size_mb(work / "big"), rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny models: check the script runs (seconds)")
    ap.add_argument("--preset", default=None, help="the hybrid's preset (default medium; --smoke: tiny)")
    ap.add_argument("--large-gb", type=float, default=None, help="the synthetic folder's size (default 2.5)")
    ap.add_argument("--cases", default="hybrid,large", help="which of hybrid,large to run")
    ap.add_argument("--work", default=None, help="folder for the models (default: a temporary one, removed)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not Path("/proc/self/status").exists():
        print("error: bench/host_memory.py reads /proc (Linux only)", file=sys.stderr)
        return 2
    preset = args.preset or ("tiny" if args.smoke else "medium")
    gb = args.large_gb if args.large_gb is not None else (0.02 if args.smoke else 2.5)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="ddl-host-memory-"))
    work.mkdir(parents=True, exist_ok=True)
    results = []
    try:
        chosen = args.cases.split(",")
        cases = [lambda: medium_hybrid(work, preset)] if "hybrid" in chosen else []
        if "large" in chosen:
            cases.append(lambda: large_folder(work, gb, args.smoke))
        for case in cases:
            what, mb, rows = case()
            results.append({"model": what, "model_mb": mb, "rows": rows})
            for r in rows:
                print(f"{what} ({mb:,.0f} MB): {r['command'].split()[1]}: peak anon {r['peak_anon_mb']:,.0f} MB, "
                      f"VmHWM {r['vm_hwm_mb']:,.0f} MB, {r['seconds']:.1f} s", flush=True)  # fmt: skip
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    print()
    print("| model | size | command | peak anon MB | VmHWM MB | s |\n|---|---|---|---|---|---|")
    for res in results:
        for r in res["rows"]:
            print(f"| {res['model']} | {res['model_mb']:,.0f} MB | `{r['command'].split()[1]}` | "
                  f"{r['peak_anon_mb']:,.0f} | {r['vm_hwm_mb']:,.0f} | {r['seconds']:.1f} |")  # fmt: skip
    write_json(json_path(args.json, "host_memory.json"),
               {"when": now_iso(), "host": host_info(), "cpus": os.cpu_count(), "results": results})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
