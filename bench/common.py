"""Shared helpers of the benchmarks in `bench/`: timing (GPU timestamps, CUDA events), the optional PyTorch
peer, the H200 reference peaks, the result table and the JSON file.

Scripts run from the repository root as `python3 bench/<name>.py`; importing this module puts the root on
`sys.path`, so the checkout is used even when the package is not installed.

What this does not do: know any kernel or model (the scripts do).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# NVIDIA H200 SXM reference numbers (docs/wgpu-notes.md#h200-reference-numbers)
H200_FP32_TFLOPS = 66.9  # non-tensor FMA peak
H200_HBM_GBS = 4300.0  # measured device-to-device copy (read + write bytes); datasheet 4800


class Skip(Exception):
    """A case that cannot run here (missing launcher, size over a limit); reported, not a failure."""


def attempt(measure, *args) -> dict:
    """One measurement's result, or its error (the other runs still go on; the JSON records the failure)."""
    try:
        return measure(*args)
    except Exception as e:
        return {"error": f"{e.__class__.__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}


def now_iso() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def json_path(arg: str | None, name: str) -> Path:
    """--json, else $OUT/<name>, else bench/results/<name>."""
    if arg:
        p = Path(arg)
    elif os.environ.get("OUT"):
        p = Path(os.environ["OUT"]) / name
    else:
        p = ROOT / "bench" / "results" / name
    p.parent.mkdir(parents=True, exist_ok=True)
    return p


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, default=_jsonable) + "\n")
    print(f"wrote {path}")


def _jsonable(x):
    try:
        return float(x)
    except Exception:
        return str(x)


def rel_err(got, ref) -> float:
    """max|got - ref| / max|ref| in float64; inf when `got` holds a non-finite value."""
    import numpy as np

    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    if not np.all(np.isfinite(got)):
        return math.inf
    return float(np.max(np.abs(got - ref)) / max(float(np.max(np.abs(ref))), 1e-30))


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


# ---------------------------------------------------------------------------------------------------------
# the device under test


# Every bench script opens its device here: DDL_WGPU_RUNTIME picks the runtime (auto|native|dawn) as for the
# CLI, and BENCH_PRODUCTS=matrix puts the products on the matrix units (`ops/matmul_tc.py`, where the runtime
# lists a configuration; what `--precision mixed` and an f16 trunk do in the jobs), "simt" keeps them there.
ENV_PRODUCTS = "BENCH_PRODUCTS"


def open_gpu(device: str | None = None):
    import os

    from ddl_wgpu.runtime.gpu import Gpu

    gpu = Gpu(device)
    products = os.environ.get(ENV_PRODUCTS, "simt")
    if products not in ("simt", "matrix"):
        raise SystemExit(f"{ENV_PRODUCTS}={products!r}: simt or matrix")
    if products == "matrix" and not gpu.matrix_configs:
        raise SystemExit(f"{ENV_PRODUCTS}=matrix: {gpu.name} ({gpu.runtime_name}) lists no subgroup matrix")
    gpu.products = products
    return gpu


def adapter_line(gpu) -> str:
    i = gpu.info
    return (f"{i['name']} | {i['backend']} | {i['type']} | driver {i['driver']} | vendor {i['vendor']} | "
            f"runtime {gpu.runtime_name} | products {gpu.products}")  # fmt: skip


def host_info() -> dict:
    import numpy as np

    d = {"python": platform.python_version(), "numpy": np.__version__, "platform": platform.platform()}
    try:
        import wgpu

        d["wgpu"] = wgpu.__version__
    except Exception:
        pass
    return d


# Both peers report the best of their repeats as "ms" (the median is kept as "median_ms"): on the lent H200
# the wgpu side sometimes ran 2-4x slow for seconds at a time (the SM clock idles at 345 MHz between cases,
# while the host computes the float64 checks, and boosts to 1980 MHz under load), while the same kernels
# before and after ran at full speed (docs/benchmarks.md, "Best of N after settling"). So each case also runs until its time stops
# falling (`settle`) before the timed repeats; the best repeat is then the kernel's own speed.
REPEATS = 7


def settle(once, n: int, tries: int = 10) -> None:
    """Run `once(n)` until it is no longer 3 % faster than the run before (clocks up, caches warm)."""
    last = once(n)
    for _ in range(tries):
        t = once(n)
        if t > 0.97 * last:
            return
        last = t


def warm_up(gpu, seconds: float = 2.0) -> None:
    """Keep the GPU busy with 2048^3 GEMMs for `seconds` before the first timed case. `settle` alone was not
    enough on the H200: the first case of a run, timed from an idle GPU, measured 3.8x slower than the same
    product later in the run (bench/matmul_sweep.py, docs/experiments.md), as clocks ramped for over a second."""
    import numpy as np

    from ddl_wgpu.ops import matmul as k_mm

    if seconds <= 0:
        return
    n = 2048
    a = gpu.upload(np.ones((n, n), np.float32))
    c = gpu.buffer(n * n * 4, label="warm-up")
    call = k_mm.matmul(gpu, c, a, a, n, n, n)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        rec = gpu.recorder()
        for _ in range(8):
            call.record(rec)
        rec.submit()
        gpu.wait()


def gpu_time_ms(gpu, calls, target_ms: float = 40.0, repeats: int = REPEATS, max_n: int = 200) -> dict:
    """GPU time of one `Call` (ms), best and median of `repeats`: each repeat records the calls N times,
    round-robin (so inputs rotate among `calls`), into one timestamped recorder; elapsed / N. A warm-up
    recording picks N so a repeat lasts about `target_ms`. Falls back to host wall-clock around
    `gpu.wait()` without timestamp-query."""
    calls = list(calls)

    def once(n: int) -> float:
        rec = gpu.recorder(timestamps=True)
        for i in range(n):
            calls[i % len(calls)].record(rec)
        t0 = time.perf_counter()
        rec.submit()
        if rec.timed:
            return rec.elapsed_ms() / n
        gpu.wait()
        return (time.perf_counter() - t0) * 1e3 / n

    once(len(calls))  # compile / first-touch warm-up
    est = once(len(calls))
    n = int(min(max_n, max(len(calls), round(target_ms / max(est, 1e-4)))))
    settle(once, n)
    times = [once(n) for _ in range(repeats)]
    return {"ms": min(times), "median_ms": statistics.median(times), "n_per_repeat": n, "repeats": repeats,
            "timestamps": "timestamp-query" in gpu.features}  # fmt: skip


# ---------------------------------------------------------------------------------------------------------
# the PyTorch peer


def torch_setup(mode: str):
    """mode 'auto' (CUDA when present, else none), 'cuda', 'cpu' (for testing the peer code) or 'none'.
    Returns (torch, device) or (None, reason). TF32 is switched off for the fp32 peer."""
    if mode == "none":
        return None, "disabled (--torch none)"
    try:
        import torch
    except Exception as e:  # torch missing
        return None, f"torch not importable: {e.__class__.__name__}"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    with contextlib.suppress(Exception):
        torch.set_float32_matmul_precision("highest")
    if mode in ("auto", "cuda"):
        if torch.cuda.is_available():
            return torch, "cuda"
        return None, "no CUDA device"
    return torch, "cpu"


def torch_info(torch, dev) -> dict:
    d = {"torch": torch.__version__, "device": dev}
    if dev == "cuda":
        d["cuda_device"] = torch.cuda.get_device_name(0)
        d["cuda"] = torch.version.cuda
    return d


def torch_time_ms(torch, dev, fns, target_ms: float = 40.0, repeats: int = REPEATS, max_n: int = 200) -> dict:
    """Time of one call of `fns[i]` (rotating), best and median of `repeats`; CUDA events on the GPU,
    perf_counter on the CPU."""
    fns = list(fns)

    def once(n: int) -> float:
        if dev == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for i in range(n):
                fns[i % len(fns)]()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / n
        t0 = time.perf_counter()
        for i in range(n):
            fns[i % len(fns)]()
        return (time.perf_counter() - t0) * 1e3 / n

    once(len(fns))
    if dev == "cuda":
        torch.cuda.synchronize()
    est = once(len(fns))
    n = int(min(max_n, max(len(fns), round(target_ms / max(est, 1e-4)))))
    settle(once, n)
    times = [once(n) for _ in range(repeats)]
    return {"ms": min(times), "median_ms": statistics.median(times), "n_per_repeat": n, "repeats": repeats}


def torch_free(torch, dev):
    import gc

    gc.collect()
    if torch is not None and dev == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------------
# tables


def fmt(x, spec: str = ".3g", none: str = "-") -> str:
    if x is None:
        return none
    if isinstance(x, str):
        return x
    return format(x, spec)


def table(headers: list[str], rows: list[list], title: str = "") -> str:
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in cells]
    return "\n".join(([title] if title else []) + [line, sep, *body])


# ---------------------------------------------------------------------------------------------------------
# weights for shapes too large to initialise on the host


class RandomWeights(Mapping):
    """Parameters of `cfg` made on demand (a read-only mapping in table order): one random tensor per
    (shape, init) kind, shared by every tensor of that kind, drawn as the table says (normal matrices, norm
    weights, the Gated DeltaNet's A_log and dt_bias). For shapes whose `init_params` would not fit the host
    (the Qwen3.8-27B trunk: 108 GB in float32): timing does not depend on the values, and the host holds one
    layer's worth of arrays. A tensor of more than `DRAW` elements repeats a block of its first rows (drawing
    the 27B shape's 2.5 G embedding and head elements took most of a minute), and with `f16=True` the layers'
    matrices an f16 net stores in half precision come in float16 (`layout.is_f16_matrix`): converted once
    per kind here instead of once per layer in `Net.load`, which took the 27B loads past 3 minutes on the
    H200's host."""

    DRAW = 1 << 24

    def __init__(self, cfg, seed: int = 0, f16: bool = False):
        import numpy as np

        from ddl_ref.params import param_table

        self.specs = {s.name: s for s in param_table(cfg)}
        self.rng = np.random.default_rng(seed)
        self.f16 = f16
        self.cache: dict = {}

    def __iter__(self):
        return iter(self.specs)

    def __len__(self) -> int:
        return len(self.specs)

    def __getitem__(self, name):
        import dataclasses

        import numpy as np

        from ddl_ref.params import _draw
        from ddl_wgpu.engine.layout import is_f16_matrix

        s = self.specs[name]
        half = self.f16 and is_f16_matrix(name, s.shape) and name.startswith("model.layers.")
        key = (s.shape, s.init, half)
        if key not in self.cache:
            rows = max(1, self.DRAW // max(1, int(np.prod(s.shape[1:]))))
            block = dataclasses.replace(s, shape=(min(rows, s.shape[0]), *s.shape[1:])) if s.shape else s
            a = _draw(block, self.rng, np.float32)
            if a.shape != s.shape:
                a = np.resize(a, s.shape)
            self.cache[key] = a.astype(np.float16) if half else a
        return self.cache[key]
