"""`ddl_wgpu.backend`: the "auto" rule on described adapters (no GPU needed) and on this machine's adapters,
forced and unknown backends, the numpy backend's freedom from wgpu, and the makers on both backends."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from ddl_ref.params import init_params
from ddl_wgpu import backend
from ddl_wgpu.files.modelfile import Model


def info(device, adapter_type="DiscreteGPU", backend_type="Vulkan", vendor="", description=""):
    return dict(device=device, adapter_type=adapter_type, backend_type=backend_type, vendor=vendor,
                description=description)  # fmt: skip


LAVAPIPE = info("llvmpipe (LLVM 15.0.6, 256 bits)", "CPU", vendor="llvmpipe", description="Mesa 22.3.6")
H200 = info("NVIDIA H200", vendor="NVIDIA")


@pytest.mark.parametrize(
    "adapter",
    [
        LAVAPIPE,
        info("llvmpipe (LLVM 15.0.6, 256 bits)", "Unknown"),  # a driver that does not report its type
        info("lavapipe", "Unknown"),
        info("Microsoft Basic Render Driver", "Unknown", "D3D12"),
        info("WARP", "Unknown", "D3D12"),
        info("SwiftShader Device (Subzero)", "Unknown", vendor="Google"),
    ],
)
def test_cpu_implementations_choose_numpy(adapter):
    assert backend.cpu_implementation(adapter) is not None
    c = backend.choose_from_adapters([adapter])
    assert c.name == "ref" and "only CPU adapters" in c.reason and "numpy is faster" in c.reason


@pytest.mark.parametrize(
    "adapter",
    [
        H200,
        info("Intel(R) UHD Graphics 620", "IntegratedGPU", vendor="Intel"),
        info("Apple M2", "IntegratedGPU", "Metal"),
        info("Virtio-GPU Venus (NVIDIA A10G)", "VirtualGPU"),
        info("AMD Radeon RX 7900 XTX", "DiscreteGPU", "D3D12", description="Hardware rasteriser"),
    ],
)
def test_real_gpus_choose_the_engine(adapter):
    assert backend.cpu_implementation(adapter) is None
    c = backend.choose_from_adapters([LAVAPIPE, adapter])
    assert c.name == "wgpu" and c.reason.startswith(adapter["device"]) and adapter["backend_type"] in c.reason


def test_best_real_gpu_named_and_no_adapter_is_numpy():
    igpu = info("Intel UHD", "IntegratedGPU")
    c = backend.choose_from_adapters([igpu, H200])
    assert c == backend.BackendChoice(
        "wgpu", "NVIDIA H200 (DiscreteGPU, Vulkan)", "NVIDIA H200 (DiscreteGPU, Vulkan)"
    )
    assert backend.choose_from_adapters([]).name == "ref"
    # wgpu's OpenGL fallback is not a backend the engine picks by itself
    assert backend.choose_from_adapters([info("NVIDIA GeForce", backend_type="OpenGL")]).name == "ref"


def test_this_machine_lavapipe_chooses_numpy_and_forcing_works():
    c = backend.choose_backend("auto")
    assert c.name == "ref" and "llvmpipe" in c.reason and "llvmpipe" in c.adapter
    assert backend.choose_backend("wgpu").name == "wgpu" and backend.choose_backend("ref").name == "ref"
    with pytest.raises(backend.UnknownBackendError, match="unknown backend 'cuda': one of auto, wgpu, ref"):
        backend.choose_backend("cuda")
    assert issubclass(backend.UnknownBackendError, ValueError)


@pytest.mark.parametrize(
    "module", ["ddl_wgpu", "ddl_wgpu.engine.refnet", "ddl_wgpu.backend", "ddl_wgpu.engine.step"]
)
def test_numpy_backend_imports_no_wgpu(module):
    code = f"import sys, {module}; assert 'wgpu' not in sys.modules, [m for m in sys.modules if 'wgpu' in m]"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_the_net_imports_no_work():
    """net.py (the GPU state) sits below the works: importing it loads neither trunk.py nor inference.py."""
    code = "import sys, ddl_wgpu.engine.net; assert not {'ddl_wgpu.engine.trunk', 'ddl_wgpu.engine.inference'} & set(sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_makers_on_both_backends_agree(gpu, heal_kit):
    cfg = heal_kit.tiny_cfg()
    m = Model(cfg, heal_kit.perturbed(cfg))
    ref_net = backend.make_net(cfg, None, "ref", None, seed=3)
    gpu_net = backend.make_net(cfg, None, "wgpu", None, seed=3)
    assert type(ref_net).__name__ == "RefNet" and type(gpu_net).__name__ == "Net"
    for name, a in ref_net.export().items():
        np.testing.assert_array_equal(gpu_net.export()[name], a)
    ids = np.random.default_rng(0).integers(0, 256, (2, 12))
    (ri, rp, _, rpost), (gi, gp, _, gpost) = (
        backend.make_teacher(b, m, batch=2).topk_hidden(ids, 4) for b in ("ref", "wgpu")
    )
    assert (ri[..., 0] == gi[..., 0]).mean() > 0.9
    np.testing.assert_allclose(gpost, rpost, rtol=1e-3, atol=1e-4)
    for b in ("ref", "wgpu"):
        d = backend.make_draft(b, m, batch=2)
        assert sorted(d.export()) == sorted(n for n in m.params if n.startswith("model.mtp.layers.") or
                                            n == "model.mtp.norm.weight")  # fmt: skip
    assert backend.make_accept_backend("ref", m) == (None, None)
    with pytest.raises(backend.BackendError, match="f16 trunk needs the wgpu backend"):
        backend.make_teacher("ref", m, trunk_dtype="f16")


def test_make_engine_on_both_backends(gpu, heal_kit):
    """generate's engine from the backend layer: the numpy and the GPU engine feed the same prompt to the same
    logits, each says which backend it is, and a f16 trunk on numpy is refused like the other makers'."""
    cfg = heal_kit.tiny_cfg()
    m = Model(cfg, heal_kit.perturbed(cfg))
    ref, dev = (backend.make_engine(b, m, depth=2, capacity=16) for b in ("ref", "wgpu"))
    assert (type(ref).__name__, ref.backend) == ("RefEngine", "ref")
    assert (type(dev).__name__, dev.backend) == ("WgpuEngine", "wgpu")
    ids = [3, 1, 4, 1, 5]
    want, got = ref.feed(ids, "logits"), dev.feed(ids, "logits")
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4)
    assert ref.length == dev.length == len(ids)
    assert ref.draft(9, 2, "argmax", None)[0] == dev.draft(9, 2, "argmax", None)[0]
    with pytest.raises(backend.BackendError, match="f16 trunk needs the wgpu backend"):
        backend.make_engine("ref", m, trunk_dtype="f16")
    plain = heal_kit.tiny_cfg(mtp=None)
    with pytest.raises(backend.BackendError, match="decoding on the GPU: speculative decoding needs"):
        backend.make_engine("wgpu", Model(plain, init_params(plain, 0)), depth=1)
