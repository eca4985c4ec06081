"""Issue 30: `import-hf`, `export-hf` and `compress` go tensor by tensor, a piece at a time, so a command's peak
memory is a small fixed amount whatever the model's size. A hybrid with its draft of about 330 MB (float32;
written piece by piece from broadcast rows, so the test itself stays small) goes through the three commands as a
user runs them, each a fresh process; each one's peak resident memory (its own high-water mark, VmHWM) must
stay under BOUND, well below the model's size (before the change each held the whole model, compress twice).
The figures on the `medium` hybrid and a larger folder: bench/host_memory.py (BENCHMARKS.md)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ddl_ref.config import ARCH_MTP, ModelConfig, apply_arch
from ddl_ref.params import param_table
from ddl_wgpu.files.lazy import from_array
from ddl_wgpu.files.modelfile import LazyModel, write_model

REPO = Path(__file__).resolve().parents[1]
BOUND = 150 << 20  # the interpreter with numpy and the CLI takes about 60 MB; the pieces a few MB each


# The command run in a process that writes its own peak resident memory (VmHWM) to a file as it exits. Not the
# parent's wait4/getrusage figure: on Linux that carries over the parent's RSS at fork/vfork (pytest's, hundreds
# of MB late in `make test`).
_RUN = ("import atexit, runpy, sys; out = sys.argv.pop(1); atexit.register(lambda: open(out, 'w').write("
        "next(line for line in open('/proc/self/status') if line.startswith('VmHWM:')))); "
        "runpy.run_module('ddl_wgpu.cli', run_name='__main__', alter_sys=True)")  # fmt: skip


def _peak_rss(tmp_path: Path, *args) -> int:
    """Run `ddl-wgpu ARGS` in a fresh process (it must succeed) -> its peak resident memory in bytes."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OPENBLAS_NUM_THREADS": "1"}
    out = tmp_path / "vmhwm.txt"
    r = subprocess.run([sys.executable, "-c", _RUN, str(out), *map(str, args)], env=env, cwd=REPO, capture_output=True,
                       text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, (args, r.stderr)
    return int(out.read_text().split()[1]) * 1024  # "VmHWM:  65432 kB"


def _big_hybrid(path: Path) -> int:
    """A ~330 MB hybrid with a draft, written without ever holding it: every tensor a broadcast row."""
    base = ModelConfig(vocab_size=50304, d_model=512, n_layers=8, n_heads=8, n_kv_heads=2, head_dim=64,
                       ffn_hidden=1536, max_seq_len=256, tie_embeddings=False)  # fmt: skip
    cfg = dataclasses.replace(apply_arch(base, "qwen3_5"), mtp=ARCH_MTP["qwen3_5"])
    rng = np.random.default_rng(0)
    tensors = {}
    for s in param_table(cfg):
        row = (rng.standard_normal(s.shape[-1]) * 0.02).astype(np.float32)
        tensors[s.name] = from_array(np.broadcast_to(row, s.shape))
    write_model(path, LazyModel(cfg=cfg, tensors=tensors))
    return sum(t.nbytes for t in tensors.values())


@pytest.mark.skipif(
    not os.path.exists("/proc/self/status"), reason="a process's peak memory is read from /proc (Linux)"
)
def test_file_commands_hold_a_few_pieces_not_the_model(tmp_path):
    size = _big_hybrid(tmp_path / "m.ddlw")
    assert size > 300e6
    peaks = {
        "export-hf": _peak_rss(tmp_path, "export-hf", tmp_path / "m.ddlw", tmp_path / "hf"),
        "import-hf": _peak_rss(tmp_path, "import-hf", tmp_path / "hf", tmp_path / "back.ddlw"),
        "compress": _peak_rss(
            tmp_path, "compress", tmp_path / "back.ddlw", "--out", tmp_path / "c.ddlw", "--drop-layers", "1-3"
        ),
    }
    mb = {k: f"{v / 1e6:.0f} MB" for k, v in peaks.items()}
    assert all(v <= BOUND for v in peaks.values()), (
        f"peaks {mb} for a {size / 1e6:.0f} MB model (bound {BOUND >> 20} MiB)"
    )
