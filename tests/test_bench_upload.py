"""`bench/upload.py`, the upload bandwidth per mode: on each runtime that starts here its `--quick` run checks every
upload it times and writes its JSON, Dawn's host-pointer modes present exactly where the runtime is Dawn with
`host-mapped-pointer`; and an upload that leaves the destination wrong is caught (the bench exits 1).
Speed is not asserted."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
HOST_MODES = ("host-pointer", "host-pointer-file", "host-pointer-file-shared")


def _bench():
    saved = list(sys.path)  # upload.py puts bench/ on the path, whose kernels.py shadows HF's `kernels`
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import upload
    finally:
        sys.path[:] = saved
    return upload


@pytest.mark.parametrize("runtime", ["native", "dawn"])
def test_every_mode_runs_and_is_checked(runtime, tmp_path):
    from ddl_wgpu.runtime import gpu as g

    if runtime == "dawn":
        try:
            g.resolve("dawn", None, g.select_adapter)
        except g.GpuError as e:
            pytest.skip(f"Dawn cannot run here: {e}")
    out = tmp_path / "upload.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "DDL_WGPU_RUNTIME": runtime}
    r = subprocess.run([sys.executable, "bench/upload.py", "--quick", "--mb", "1", "--dir", str(tmp_path),
                        "--json", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["runtime"] == runtime and res["bytes"] == 1 << 20
    modes = res["modes"]
    host = runtime == "dawn" and "host-mapped-pointer" in res["features"]
    for name, m in modes.items():
        assert "error" not in m, (name, m)
        assert m["available"] == (host or name not in HOST_MODES), (name, m)
        if m["available"]:
            assert len(m["seconds"]["total"]) == 2 and m["gbs"]["total"] > 0
        else:
            assert m["reason"] and f"| {name}" in r.stdout and m["reason"] in r.stdout
    if host:  # the fill from the file is timed apart from the GPU's copy
        assert {"fill", "fill_file", "copy"} <= set(modes["host-pointer"]["seconds"])


def test_a_wrong_upload_is_caught(gpu, tmp_path, monkeypatch):
    """A copy that stops 4 bytes short leaves the destination's last word cleared: the check names the byte,
    and the bench exits 1."""
    upload = _bench()
    n = 64 << 10
    src = np.frombuffer(np.random.default_rng(0).bytes(n), np.uint8)
    path = tmp_path / "t.bin"
    upload.write_file(path, src)
    b = upload.Bench(gpu, src, path, 1, False)
    try:
        assert upload.measure(b, "staging-ring", 1, 60)["available"]

        def short(self, src_buf, src_offset=0):
            enc = self.gpu.device.create_command_encoder()
            enc.copy_buffer_to_buffer(src_buf, src_offset, self.dst, 0, self.n - 4)
            self.gpu.queue.submit([enc.finish()])
            self.gpu.wait()

        monkeypatch.setattr(upload.Bench, "copy_wait", short)
        with pytest.raises(upload.Mismatch, match=f"byte {n - 4} "):
            upload.measure(b, "staging-ring", 1, 60)
    finally:
        b.close()
    out = tmp_path / "u.json"
    assert upload.main(["--quick", "--mb", "1", "--modes", "staging-new", "--dir", str(tmp_path),
                        "--json", str(out)]) == 1  # fmt: skip
    assert "differs" in json.loads(out.read_text())["modes"]["staging-new"]["error"]
