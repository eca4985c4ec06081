"""The device layer: round trips, a kernel against numpy, errors that name the file and entry point,
adapter selection, uniforms, recording and timestamps."""

import re
import struct

import numpy as np
import pytest

from ddl_wgpu.runtime import gpu as G
from ddl_wgpu.runtime import host_writes as HW
from ddl_wgpu.runtime import readback as RB
from ddl_wgpu.runtime import selftest as st
from ddl_wgpu.runtime import shader_files as SF
from ddl_wgpu.runtime.selftest import selftest


@pytest.mark.parametrize(
    "dtype,n",
    [(np.float32, 1), (np.float32, 1001), (np.uint32, 77), (np.int32, 4096), (np.float16, 10), (np.uint8, 3)],
)
def test_upload_download_round_trip(gpu, dtype, n):
    rng = np.random.default_rng(n)
    a = (rng.standard_normal(n) * 100).astype(dtype)
    buf = gpu.upload(a)
    assert np.array_equal(gpu.download(buf, dtype, n), a)


def test_download_at_offset_and_large(gpu):
    a = np.arange(300_000, dtype=np.float32)
    buf = gpu.upload(a)
    assert np.array_equal(gpu.download(buf, np.float32, 5, offset=400), a[100:105])
    assert np.array_equal(gpu.download(buf, np.float32, 300_000), a)


def test_large_writes_go_through_host_memory_in_queue_order(gpu, monkeypatch):
    """`Gpu.write(via_host=True)` from host_writes.MIN bytes on a device with host buffers (Dawn; lavapipe's has them): the
    bytes land, in pieces through host buffers, ordered with `write_buffer` writes on either side, and within
    a pool of host buffers whose bound makes the host wait; elsewhere (wgpu-native) the same through
    `write_buffer`."""
    monkeypatch.setattr(HW, "MIN", 4096)
    monkeypatch.setattr(HW, "PIECE", 1 << 14)  # 4,096 words: the writes below go up in 2-13 pieces
    rng = np.random.default_rng(5)
    a, b = (rng.standard_normal(50_000).astype(np.float32) for _ in range(2))
    buf_a, buf_b = gpu.buffer(a.nbytes), gpu.buffer(b.nbytes)
    gpu.write(buf_a, np.zeros(10, np.float32), 400)  # write_buffer, before: overwritten
    gpu.write(buf_a, a, via_host=True)
    gpu.write(buf_b, b[:8192], 4 * 4096, via_host=True)  # 2 pieces, at an offset
    gpu.write(buf_b, b[:4096], via_host=True)
    gpu.write(buf_b, b[12288:], 4 * 12288, via_host=True)
    gpu.write(buf_a, np.full(10, 7.0, np.float32), 400)  # write_buffer, after: kept
    want_a = a.copy()
    want_a[100:110] = 7.0
    assert np.array_equal(gpu.download(buf_a), want_a)
    assert np.array_equal(gpu.download(buf_b), np.concatenate([b[:4096], b[:8192], b[12288:]]))
    assert bool(gpu._host_writes.slots) == gpu.host_buffers
    gpu.write(buf_a, b, via_host=True)  # again into a buffer the GPU has read: the new bytes
    assert np.array_equal(gpu.download(buf_a), b)
    held = sum(len(s.host) for s in gpu._host_writes.slots)
    monkeypatch.setattr(HW, "POOL", 1 << 15)  # no growth past what is held: the host waits instead
    for k in range(4):
        gpu.write(buf_b, a + k, via_host=True)
    assert np.array_equal(gpu.download(buf_b), a + 3)
    assert sum(len(s.host) for s in gpu._host_writes.slots) <= max(held, 1 << 15)
    monkeypatch.setattr(HW, "PIECE", 1 << 17)  # pieces larger than every buffer held: they make way
    gpu.write(buf_b, b, via_host=True)
    assert np.array_equal(gpu.download(buf_b), b)


@pytest.mark.parametrize("mode", ["spin", "block"])
def test_readback_reads_each_submit(gpu, monkeypatch, mode):
    """A read-back buffer maps on the calling thread (`Readback.read`, either wait): each read returns what
    the submit before it copied in, at an offset, after its submission index or after all work; the buffer
    is unmapped again (the next copy into it validates)."""
    monkeypatch.setenv(RB.ENV_WAIT, mode)
    rb = gpu.readback(64)
    assert rb.spin == (mode == "spin")
    for i in range(3):
        src = gpu.upload(np.arange(16, dtype=np.uint32) * (i + 1))
        rec = gpu.recorder()
        rec.copy(src, 0, rb.buffer, 0, 64)
        index = gpu.submit_indexed(rec.finish())
        after = index if i % 2 else None
        assert np.array_equal(rb.read(np.uint32, 5, 12, after), np.arange(3, 8, dtype=np.uint32) * (i + 1))
    monkeypatch.setenv(RB.ENV_WAIT, "sometimes")
    with pytest.raises(G.GpuError, match="DDL_WGPU_WAIT must be spin or block"):
        gpu.readback(16)


def test_small_kernel_against_numpy(gpu):
    lines = selftest(gpu, n=70_001)  # raises on a wrong result
    assert lines[0].startswith("saxpy n=70001")


def test_recorder_timestamps(gpu):
    if "timestamp-query" not in gpu.features:
        pytest.skip("adapter has no timestamp-query")
    k = gpu.kernel(st.FILE, "saxpy", "rwu", uniforms=(st.PARAMS,))
    x, y = gpu.upload(np.ones(1000, np.float32)), gpu.upload(np.zeros(1000, np.float32))
    rec = gpu.recorder(timestamps=True)
    rec.dispatch(k, gpu.bind(k, x, y, gpu.uniform(st.PARAMS, n=1000, alpha=3.0)), 16)
    rec.submit()
    assert rec.elapsed_ms() >= 0.0
    assert np.all(gpu.download(y, np.float32, 1000) == 3.0)


def test_pipeline_cache(gpu):
    a = gpu.kernel(st.FILE, "saxpy", "rwu", uniforms=(st.PARAMS,))
    b = gpu.kernel(st.FILE, "saxpy", "rwu", uniforms=(st.PARAMS,))
    assert a is b


def test_broken_shader_names_file_and_entry(gpu, tmp_path):
    bad = tmp_path / "broken.wgsl"
    bad.write_text("@compute @workgroup_size(1) fn oops() { let x: f32 = 1u; }\n")
    with pytest.raises(G.KernelError) as e:
        gpu.kernel(str(bad), "oops", "")
    assert "broken.wgsl:oops" in str(e.value)


def test_trusted_module_compiles_and_reports_errors(gpu, tmp_path, monkeypatch):
    """A file in the trusted set goes through wgpuDeviceCreateShaderModuleTrusted: a good kernel still
    runs, a broken one still raises KernelError naming file and entry."""
    bad = tmp_path / "broken_trusted.wgsl"
    bad.write_text("@compute @workgroup_size(1) fn oops() { let x: f32 = 1u; }\n")
    monkeypatch.setenv(SF.ENV_TRUSTED, f"{bad},selftest.wgsl")
    assert str(bad) in SF.trusted_files()
    with pytest.raises(G.KernelError) as e:
        gpu.kernel(str(bad), "oops", "")
    assert "broken_trusted.wgsl:oops" in str(e.value)
    monkeypatch.setenv(SF.ENV_TRUSTED, "none")
    assert SF.trusted_files() == frozenset()
    monkeypatch.setenv(SF.ENV_TRUSTED, "default")
    assert SF.trusted_files() == SF.TRUSTED_FILES


def test_missing_entry_point_names_file_and_entry(gpu):
    with pytest.raises(G.KernelError, match=r"selftest\.wgsl:nope"):
        gpu.kernel(st.FILE, "nope", "rwu", uniforms=(st.PARAMS,))


def test_missing_shader_file(gpu):
    with pytest.raises(G.KernelError, match="not found"):
        gpu.kernel("no_such.wgsl", "main", "r")


def test_unfilled_template_is_an_error(tmp_path):
    f = tmp_path / "t.wgsl"
    f.write_text("const N = {{n}};\nconst M = {{m}};\n")
    assert "const N = 3;" in SF.shader_source(str(f), {"n": 3, "m": 4})
    with pytest.raises(G.KernelError, match=r"\{\{m\}\}"):
        SF.shader_source(str(f), {"n": 3})


def test_bind_checks_signature(gpu):
    k = gpu.kernel(st.FILE, "saxpy", "rwu", uniforms=(st.PARAMS,))
    with pytest.raises(G.GpuError, match="signature"):
        gpu.bind(k, gpu.buffer(16))


def test_pack_pads_to_16_bytes():
    assert len(G.Uniform("A", ("a", "u32"), ("b", "f32")).pack(a=1, b=2.0)) == 16
    five = G.Uniform("B", *[(f"u{i}", "u32") for i in range(4)], ("f", "f32"))
    assert len(five.pack(u0=1, u1=2, u2=3, u3=4, f=5.0)) == 32


def test_grid_splits_large_dispatches():
    assert G.grid(10) == (10, 1, 1)
    x, y, z = G.grid(200_000)
    assert x <= 65535 and x * y >= 200_000 and z == 1


def test_adapter_selection_by_index_and_name():
    adapters = G.enumerate_adapters()
    assert adapters, "the test machine has an adapter (lavapipe in CI)"
    first = G.select_adapter("0")
    assert G._info(first) == G._info(adapters[0])
    name = G._info(adapters[0])["name"]
    assert G._info(G.select_adapter(name[:6].upper())) is not None  # case-insensitive substring
    with pytest.raises(G.NoAdapterError, match="out of range"):
        G.select_adapter(str(len(adapters)))
    with pytest.raises(G.NoAdapterError, match="no adapter matches 'zzz-no-such-gpu'"):
        G.select_adapter("zzz-no-such-gpu")


def test_env_variable_chooses_adapter(monkeypatch):
    monkeypatch.setenv(G.ENV_ADAPTER, "zzz-no-such-gpu")
    with pytest.raises(G.NoAdapterError):
        G.select_adapter(None)


def test_default_prefers_a_real_backend():
    a = G.select_adapter(None)
    assert G._info(a)["backend"] not in ("OpenGL", "OpenGLES")


def test_no_adapter_message(monkeypatch):
    monkeypatch.setattr(G, "enumerate_adapters", lambda runtime=None: [])
    with pytest.raises(G.NoAdapterError) as e:
        G.select_adapter(None)
    assert "mesa-vulkan-drivers" in str(e.value)


def test_buffer_too_large_is_a_clear_error(gpu):
    with pytest.raises(G.GpuError, match="max-buffer-size"):
        gpu.buffer(gpu.max_buffer + 16, label="huge")


# ---------------------------------------------------------------------------------------------------------
# uniform descriptions, generated WGSL, the portability mode

P = G.Uniform("P", ("n", "u32", "items"), ("alpha", "f32"), ("_pad", "pad"))


def test_uniform_description_emits_the_struct_and_packs_by_name():
    assert P.wgsl() == "struct P {\n    n: u32,      // items\n    alpha: f32,\n    _pad: u32,\n}"
    assert P.names == ("n", "alpha") and P.offset("alpha") == 4
    assert P.pack(alpha=2.5, n=7) == struct.pack("<IfI", 7, 2.5, 0) + bytes(4)
    assert P.pack_field("alpha", 0.5) == (4, struct.pack("<f", 0.5))
    with pytest.raises(ValueError, match="no field '_pad'"):
        P.offset("_pad")
    with pytest.raises(ValueError, match=r"missing fields \['alpha'\]"):
        P.pack(n=7)
    with pytest.raises(ValueError, match=r"unknown fields \['beta'\]"):
        P.pack(n=7, alpha=1.0, beta=2.0)
    with pytest.raises(ValueError, match="type"):
        G.Uniform("Q", ("x", "f64"))


def test_uniform_buffers_take_fields_by_name(gpu):
    with pytest.raises(TypeError):
        gpu.uniform(P, 7, 2.5)  # positional values have no path any more
    with pytest.raises(G.GpuError, match="gpu.Uniform"):
        gpu.uniform("uf", n=7, alpha=2.5)
    with pytest.raises(ValueError, match="missing"):
        gpu.uniform(P, n=7)
    buf = gpu.uniform(P, n=7, alpha=2.5)
    assert buf.size == 16
    gpu.write_uniform(buf, P, n=8, alpha=1.0)
    with pytest.raises(ValueError, match="unknown"):
        gpu.write_uniform(buf, P, n=8, alpha=1.0, beta=0.0)
    with pytest.raises(ValueError, match="no field 'beta'"):
        gpu.write_fields(buf, P, beta=0.0)


def test_write_fields_rewrites_one_field_in_place(gpu):
    """saxpy over the first n = 5 of 8 floats: after alpha alone is rewritten, n is still 5."""
    k = gpu.kernel(st.FILE, "saxpy", "rwu", uniforms=(st.PARAMS,))
    x, y = gpu.upload(np.ones(8, np.float32)), gpu.upload(np.zeros(8, np.float32))
    u = gpu.uniform(st.PARAMS, n=5, alpha=2.0)
    gpu.write_fields(u, st.PARAMS, alpha=-3.0)
    gpu.run(k, [x, y, u], 1)
    assert gpu.download(y, np.float32, 8).tolist() == [-3.0] * 5 + [0.0] * 3


def test_every_shader_uniform_comes_from_a_description():
    """No hand-written uniform struct is left in shaders/: each `var<uniform>` type is a `{{struct NAME}}`
    hole, and the family's launcher module (`ddl_wgpu/runtime/selftest.py` for the smoke test of a fresh machine)
    declares exactly those structs as `Uniform`s."""
    import importlib

    for f in sorted(SF.shader_dirs()[0].glob("*.wgsl")):
        if f.name.startswith("prelude_"):
            continue
        src = f.read_text()
        used = set(re.findall(r"var<uniform>\s+\w+\s*:\s*(\w+)", src))
        holes = set(re.findall(r"\{\{struct (\w+)\}\}", src))
        assert used and used == holes, (f.name, used, holes)
        assert not re.search(r"^\s*struct\s+\w*Params\b", src, re.M), (
            f"{f.name}: a hand-written Params struct"
        )
        module = importlib.import_module(
            "ddl_wgpu.runtime.selftest" if f.stem == "selftest" else f"ddl_wgpu.ops.{f.stem}"
        )
        declared = {v.name for v in vars(module).values() if isinstance(v, G.Uniform)}
        assert declared == holes, (f.name, declared, holes)


def test_dump_wgsl_writes_each_generated_shader(gpu, tmp_path, monkeypatch):
    shader = tmp_path / "dumptest.wgsl"
    shader.write_text(
        "{{struct P}}\n@group(0) @binding(0) var<storage, read_write> y: array<f32>;\n"
        "@group(0) @binding(1) var<uniform> p: P;\n"
        "@compute @workgroup_size(64) fn scale(@builtin(global_invocation_id) g: vec3<u32>) {\n"
        "  if (g.x < p.n) { y[g.x] = {{FACTOR}} * p.alpha * y[g.x]; }\n}\n"
    )
    out = tmp_path / "dump"
    monkeypatch.setenv(SF.ENV_DUMP, str(out))
    for factor in ("2.0", "3.0"):
        k = gpu.kernel(str(shader), "scale", "wu", templates={"FACTOR": factor}, uniforms=(P,))
        y = gpu.upload(np.ones(10, np.float32))
        gpu.run(k, [y, gpu.uniform(P, n=10, alpha=0.5)], 1)
        assert np.all(gpu.download(y, np.float32, 10) == float(factor) * 0.5)
    files = sorted(out.glob("dumptest.scale.*.wgsl"))
    assert len(files) == 2
    texts = [f.read_text() for f in files]
    for text in texts:
        assert P.wgsl() in text and "{{" not in text
    assert {"2.0", "3.0"} == {t for t in ("2.0", "3.0") for text in texts if f"{t} * p.alpha" in text}
    monkeypatch.delenv(SF.ENV_DUMP)
    assert SF.dump_shader("x.wgsl", "e", None, None, "src") is None


def test_include_inserts_a_shared_file(tmp_path):
    f = tmp_path / "inc.wgsl"
    f.write_text("{{include prelude_reduce.wgsl}}\nconst N = 1;\n")
    src = SF.shader_source(str(f))
    assert "{{" not in src and src.endswith("const N = 1;\n")
    assert (SF.shader_dirs()[0] / "prelude_reduce.wgsl").read_text().rstrip("\n") in src


def test_webgpu_limits_mode(monkeypatch):
    """The portability mode reports WebGPU's default limits (where the adapter has at least those)."""
    monkeypatch.setenv(G.ENV_LIMITS, "webgpu")
    g = G.Gpu()
    assert g.limits_mode == "webgpu"
    for key, value in G.WEBGPU_LIMITS.items():
        adapter = int(g.adapter.limits[key])
        want = max(value, adapter) if key.startswith("min-") else min(value, adapter)
        assert g.limits[key] == want, key
    assert g.limits["max-storage-buffers-per-shader-stage"] <= 8
    assert g.limits["max-compute-workgroup-storage-size"] <= 16 << 10
    assert g.limits["max-compute-invocations-per-workgroup"] <= 256
    assert g.max_binding <= 128 << 20 and g.max_buffer <= 256 << 20
    monkeypatch.setenv(G.ENV_LIMITS, "nonsense")
    with pytest.raises(G.GpuError, match="limits mode"):
        G.Gpu()
