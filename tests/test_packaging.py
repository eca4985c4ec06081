"""The wheel carries the shaders and the package runs from outside the repository."""

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_contains_shaders_and_runs_outside_the_repo(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (wheel,) = dist.glob("ddl_wgpu-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    shipped = {Path(n).name for n in names if n.startswith("ddl_wgpu/shaders/")}
    assert shipped == {p.name for p in (ROOT / "shaders").glob("*.wgsl")}
    assert any(n.startswith("ddl_ref/") for n in names)
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
    )
    code = (
        "import ddl_wgpu.runtime.gpu as g, ddl_wgpu.runtime.shader_files as sf, pathlib, sys;"
        "d = sf.shader_dirs();"
        "assert d and pathlib.Path(sys.argv[1]) in d[0].parents, d;"
        "from ddl_wgpu.runtime.selftest import selftest;"
        "print(selftest(g.Gpu())[0])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(target)],
        cwd=tmp_path,
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
        check=True,
        capture_output=True,
        text=True,
    )
    assert "saxpy" in out.stdout


def test_the_test_extra_installs_what_the_parity_tests_need():
    """`make test` installs `.[test,...]`: the transformers parity tests must find torch and transformers."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {r.split("=")[0].split(">")[0].split("<")[0].strip(): r for r in extras["test"]}
    assert "transformers" in names
    # a pinned CPU build: an unpinned torch pulls the multi-GB CUDA wheel
    assert names["torch"].startswith("torch==")
