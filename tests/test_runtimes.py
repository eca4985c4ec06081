"""The two WebGPU runtimes (ddl_wgpu/runtime/runtimes.py): `auto` takes Dawn only where the adapter lists a
tensor-core subgroup-matrix configuration (the pure rule on fake adapter configurations), `devices --json`
lists both runtimes' adapters, a run's report names the runtime, and the device layer works on each runtime
that starts here (`Gpu(runtime=...)`: submit with an index, wait for it, read back)."""

import json
import os

import numpy as np
import pytest
from helpers import cli_sizes

from ddl_wgpu.runtime.runtimes import (
    TENSOR_CORE_CONFIGS,
    RuntimeUnavailable,
    choose_runtime,
    requested_runtime,
    tensor_core_configs,
)

NVIDIA = [(16, 16, 16, "f16", "f32"), (16, 8, 16, "f16", "f16"), (16, 16, 32, "i8", "i32")]
NVIDIA_NO_F16 = [(16, 16, 32, "i8", "i32"), (16, 16, 32, "u8", "u32")]  # without vulkan_enable_f16_on_nvidia
APPLE = [(8, 8, 8, "f32", "f32"), (8, 8, 8, "f16", "f16")]
AMD = [(16, 16, 16, "f16", "f32"), (16, 16, 16, "f16", "f16")]


def test_auto_takes_dawn_only_for_a_tensor_core_configuration():
    for configs in (NVIDIA, APPLE, AMD):
        name, reason = choose_runtime("auto", configs)
        assert name == "dawn" and "tensor-core" in reason, (configs, reason)
        assert any(f"{m}x{n}x{k}" in reason for m, n, k, _, _ in tensor_core_configs(configs))
    # int8 only, f16 results only, or no subgroup matrices at all: wgpu-native
    for configs, why in (
        (NVIDIA_NO_F16, "16x16x32 i8->i32"),
        ([(8, 8, 8, "f16", "f16")], "f16->f16"),
        ([], "no"),
    ):
        name, reason = choose_runtime("auto", configs)
        assert name == "native" and why in reason, (configs, reason)


def test_auto_falls_back_to_native_and_says_why():
    name, reason = choose_runtime("auto", None, "wgpudawn is not installed (No module named 'wgpudawn')")
    assert name == "native" and "wgpudawn is not installed" in reason


def test_forced_runtimes():
    assert choose_runtime("native", NVIDIA)[0] == "native"  # native even where Dawn has tensor cores
    assert choose_runtime("dawn", [])[0] == "dawn"  # dawn even without subgroup matrices
    with pytest.raises(RuntimeUnavailable, match="--runtime dawn: wgpudawn cannot start"):
        choose_runtime("dawn", None, "wgpudawn cannot start")


def test_the_accepted_set():
    assert {
        (16, 16, 16, "f16", "f32"),
        (16, 8, 16, "f16", "f32"),
        (8, 16, 16, "f16", "f32"),
    } <= TENSOR_CORE_CONFIGS
    assert (8, 8, 8, "f32", "f32") in TENSOR_CORE_CONFIGS  # Apple's
    assert all(r == "f32" for *_, r in TENSOR_CORE_CONFIGS)  # the kernels accumulate in f32
    assert tensor_core_configs([[16, 16, 16, "f16", "f32"], (16, 16, 32, "i8", "i32")]) == [
        (16, 16, 16, "f16", "f32")
    ]


def test_requested_runtime(monkeypatch):
    monkeypatch.delenv("DDL_WGPU_RUNTIME", raising=False)
    assert requested_runtime(None) == "auto"
    monkeypatch.setenv("DDL_WGPU_RUNTIME", "Dawn")
    assert requested_runtime(None) == "dawn" and requested_runtime("native") == "native"
    with pytest.raises(RuntimeUnavailable, match="unknown runtime 'vulkan'"):
        requested_runtime("vulkan")


def _dawn_starts() -> str | None:
    from ddl_wgpu.runtime import gpu as g

    try:
        g.resolve("dawn", None, g.select_adapter)
    except g.GpuError as e:
        return str(e)
    return None


@pytest.mark.parametrize("runtime", ["native", "dawn"])
def test_the_device_layer_on_each_runtime(runtime):
    """Submit with an index, wait for it, a read-back, the features under the project's names."""
    from ddl_wgpu.runtime.gpu import Gpu
    from ddl_wgpu.runtime.selftest import selftest

    if runtime == "dawn" and (problem := _dawn_starts()):
        pytest.skip(f"Dawn cannot run here: {problem}")
    gpu = Gpu(runtime=runtime)
    assert gpu.runtime_name == runtime and gpu.runtime_reason == f"{runtime} requested"
    assert "subgroups" not in gpu.features  # Dawn's name, mapped to the project's
    assert isinstance(gpu.matrix_configs, list) and (runtime == "dawn" or gpu.matrix_configs == [])
    assert gpu.info["runtime"] == runtime
    selftest(gpu, 1000)
    x = np.arange(40, dtype=np.float32)
    src, rb = gpu.upload(x), gpu.readback(160)
    rec = gpu.recorder()
    rec.copy(src, 0, rb.buffer, 0, 160)
    first = gpu.submit_indexed(rec.finish())
    rec = gpu.recorder()
    rec.copy(src, 0, rb.buffer, 0, 160)
    second = gpu.submit_indexed(rec.finish())
    assert second > first
    gpu.wait_for(first)
    np.testing.assert_array_equal(rb.read(np.float32, 7, 12, after=second), x[3:10])
    gpu.wait_for(first)  # an index already waited for is finished
    gpu.wait()
    if runtime == "dawn":
        assert {"allow_unsafe_apis", "vulkan_enable_f16_on_nvidia"} <= set(gpu.toggles)


def test_devices_json_lists_both_runtimes(cli, ok):
    adapters = json.loads(ok(cli("devices", "--json")).stdout)
    runtimes = {a["runtime"] for a in adapters}
    problem = _dawn_starts()
    assert runtimes == ({"native"} if problem else {"native", "dawn"}), problem
    for a in adapters:
        assert isinstance(a["subgroup_matrix_configs"], list) and isinstance(a["toggles"], list)
        assert (a["runtime"] == "native") == (a["toggles"] == [])
    dawn = [a for a in adapters if a["runtime"] == "dawn"]
    assert all({"allow_unsafe_apis", "vulkan_enable_f16_on_nvidia"} <= set(a["toggles"]) for a in dawn)


@pytest.mark.parametrize("runtime", ["native", "dawn"])
def test_the_runtime_reaches_the_report(runtime, tmp_path, cli, ok, user_error):
    """eval's JSON and its resolved-configuration line name the runtime a wgpu run used, and why."""
    if runtime == "dawn" and (problem := _dawn_starts()):
        assert "Dawn" in user_error(cli("check", "--runtime", "dawn")) or problem
        pytest.skip(f"Dawn cannot run here: {problem}")
    model = tmp_path / "m.ddlw"
    ok(cli("init", "--preset", "tiny", "--out", model, *cli_sizes("train")))
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    r = ok(cli("eval", model, "--data", text, "--seq-len", "16", "--batch", "2", "--max-tokens", "200",
               "--backend", "wgpu", "--runtime", runtime, "--json"))  # fmt: skip
    ev = json.loads(r.stdout)
    assert (
        ev["backend"] == "wgpu"
        and ev["runtime"] == runtime
        and ev["runtime_reason"] == f"{runtime} requested"
    )
    assert f"runtime: {runtime} ({runtime} requested)" in r.stderr.splitlines()[0]


def test_an_unknown_runtime_is_one_line(cli, user_error):
    line = user_error(cli("check", "--runtime", "metal"), "unknown runtime 'metal'", "--runtime")
    assert line.startswith("error: ")


def test_env_runtime_is_read(monkeypatch):
    from ddl_wgpu.backend import set_runtime

    monkeypatch.setenv("DDL_WGPU_RUNTIME", "auto")
    set_runtime("native")
    assert os.environ["DDL_WGPU_RUNTIME"] == "native"
    set_runtime(None)  # no --runtime: the environment's stays
    assert os.environ["DDL_WGPU_RUNTIME"] == "native"


def test_tint_gets_enable_subgroups_only_where_used():
    from ddl_wgpu.runtime.dawn import for_tint

    uses = "@compute @workgroup_size(32) fn f(@builtin(subgroup_size) n: u32) { let s = subgroupShuffleXor(1.0, 1u); }"
    assert for_tint(uses).startswith("enable subgroups;\n") and for_tint(uses).endswith(uses)
    assert for_tint("enable f16;\nenable subgroups;\n" + uses).count("enable subgroups;") == 1
    plain = "// a subgroup of nothing\n@compute @workgroup_size(1) fn f() { let subgroups_x = 1u; }"
    assert for_tint(plain) == plain


def test_dawn_that_cannot_run_is_one_line(cli, user_error):
    """--runtime dawn on an adapter Dawn does not have (it lists no OpenGL adapter): one line, exit 2; auto
    falls back to wgpu-native there, saying why."""
    user_error(cli("check", "--runtime", "dawn", "--device", "OpenGL"), "--runtime dawn: ", "Dawn")


def test_without_wgpudawn_auto_is_native_and_dawn_an_error():
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['wgpudawn'] = None\n"  # as if wgpudawn were not installed
        "from ddl_wgpu.runtime import gpu as g, runtimes as r\n"
        "rt, why = r.resolve('auto', None, g.select_adapter); print(rt.name, '|', why)\n"
        "try:\n    r.resolve('dawn', None, g.select_adapter)\nexcept r.RuntimeUnavailable as e:\n    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    auto, dawn = out.stdout.strip().splitlines()
    assert auto.startswith("native | auto: wgpudawn is not installed"), auto
    assert dawn.startswith("--runtime dawn: wgpudawn is not installed"), dawn
