"""The decode benches' smoke paths on lavapipe, under a binding limit whose half is odd (the H200's 2^31 − 1
bytes: its first run died on the buffer copy's size, `bench/decode_kernels.py` `copy_bytes`): the copy and
matrix-vector rows (`bench/kernels.py --quick --only copy,gemv`) and the tunables' sweep (`--gemv-sweep
--quick`) run, check their products against `ddl_ref` and write their JSON. Speed is not asserted."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ODD_LIMIT = str((32 << 20) - 1)  # half of it is not a multiple of 4


def bench(tmp_path, *args) -> dict:
    out = tmp_path / "out.json"
    env = {**os.environ, "DDL_WGPU_MAX_BINDING": ODD_LIMIT}
    cmd = [
        sys.executable,
        str(REPO / "bench" / "kernels.py"),
        "--quick",
        "--torch",
        "none",
        "--json",
        str(out),
        *args,
    ]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return json.loads(out.read_text())


def test_copy_size_arithmetic():
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import decode_kernels
    finally:
        sys.path.remove(str(REPO / "bench"))
    for limit in (2**31 - 1, int(ODD_LIMIT), 1 << 20):
        for quick in (False, True):
            n = decode_kernels.copy_bytes(limit, quick)
            assert 0 < n <= limit // 2 and n % 256 == 0, (limit, quick, n)


@pytest.mark.parametrize(
    "args", [["--only", "copy,gemv"], ["--gemv-sweep", "--gemv-grid", "rows=0;rt=1,2;unroll=0"]]
)
def test_decode_benches_run(tmp_path, args):
    data = bench(tmp_path, *args)
    if "sweep" in data:
        rows = data["sweep"]["results"]
        assert rows and all(r.get("ok") for r in rows), rows
        assert data["sweep"]["best"]
    else:
        names = [r["name"] for r in data["results"]]
        assert names[0] == "buffer copy" and len(names) > 1
        assert not data["failed"], data["failed"]
