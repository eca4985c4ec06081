"""Can wgpu-py 0.32 (wgpu-native 29) reach the tensor cores? Each way in, tried and its answer recorded.
(Through Dawn, the second runtime, the answer is yes: WGSL subgroup matrices, `bench/matmul_tc.py` records
that path: the adapter's configurations and the GEMM on them.)

    python3 bench/tensor_cores.py [--device N|name] [--json PATH]

Attempts (each in its own subprocess, so a Rust panic or abort in wgpu-native is an answer, not a crash):

- `versions`: wgpu-py and wgpu-native versions; the adapter's features; which wgpu-native functions and
  feature names mention cooperative matrices, experimental features or SPIR-V.
- `request_feature`: a device with the `cooperative-matrix` feature (the adapter may list it).
- `wgsl_enable`: WGSL `enable wgpu_cooperative_matrix;` with a coop_mat type, on a default device.
- `spirv_naga_plain` / `spirv_naga_coop`: SPIR-V through `create_shader_module(code=bytes)` (naga's SPIR-V
  front end re-translates it): an empty compute shader, and the same declaring the CooperativeMatrixKHR
  capability, the SPV_KHR_cooperative_matrix extension and a 16x16 f16 matrix type.
- `spirv_raw_plain` / `spirv_raw_coop`: the same modules through `wgpuDeviceCreateShaderModuleSpirV` (called
  through cffi: raw SPIR-V handed to the driver, if wgpu-native lets it), then a compute pipeline from each.
- `request_passthrough`: a device with the passthrough-shaders feature, requested by its number (the header
  comments the name out; wgpu-py's name table is extended for the request).
- `spirv_raw_passthrough`: the coop SPIR-V module through `wgpuDeviceCreateShaderModuleSpirV` on that device.

The SPIR-V is assembled here word by word (no SPIR-V tools are needed on the machine).
"""

from __future__ import annotations

import argparse
import json
import struct
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (puts the repository root on sys.path)

ATTEMPTS = ("versions", "request_feature", "wgsl_enable", "spirv_naga_plain", "spirv_naga_coop",
            "spirv_raw_plain", "spirv_raw_coop", "request_passthrough", "spirv_raw_passthrough")  # fmt: skip
# WGPUNativeFeature_PassthroughShaders: commented out in wgpu-native 29's wgpu.h, so wgpu-py has no name for it
PASSTHROUGH = 0x00030036

COOP_WGSL = """enable f16;
enable wgpu_cooperative_matrix;
@group(0) @binding(0) var<storage, read_write> buf: array<f16>;
@compute @workgroup_size(32)
fn main() {
    let a = coopLoad<coop_mat16x16<f16, A>>(&buf[0], 16u);
    let b = coopLoad<coop_mat16x16<f16, B>>(&buf[256], 16u);
    var c = coop_mat16x16<f16, C>();
    c = coopMultiplyAdd(a, b, c);
    coopStore(c, &buf[512], 16u);
}
"""


def _words(op: int, *operands: int) -> list[int]:
    return [((1 + len(operands)) << 16) | op, *operands]


def _string(s: str) -> list[int]:
    b = s.encode() + b"\0"
    b += b"\0" * (-len(b) % 4)
    return list(struct.unpack(f"<{len(b) // 4}I", b))


def spirv(coop: bool) -> bytes:
    """An empty GLCompute entry point "main" (1x1x1); with `coop`, also the CooperativeMatrixKHR and
    Float16 capabilities, the SPV_KHR_cooperative_matrix extension and a 16x16 f16 'A' matrix type
    (subgroup scope). SPIR-V 1.3 (the extension's minimum)."""
    w = _words(17, 1)  # OpCapability Shader
    if coop:
        w += _words(17, 9) + _words(17, 6022)  # Float16, CooperativeMatrixKHR
        w += _words(10, *_string("SPV_KHR_cooperative_matrix"))  # OpExtension
    w += _words(14, 0, 1)  # OpMemoryModel Logical GLSL450
    w += _words(15, 5, 3, *_string("main"))  # OpEntryPoint GLCompute %3 "main"
    w += _words(16, 3, 17, 1, 1, 1)  # OpExecutionMode %3 LocalSize 1 1 1
    w += _words(19, 1) + _words(33, 2, 1)  # %1 void, %2 fn() -> void
    if coop:
        w += _words(22, 5, 16) + _words(21, 6, 32, 0)  # %5 f16, %6 u32
        w += _words(43, 6, 7, 3) + _words(43, 6, 8, 16) + _words(43, 6, 9, 0)  # scope Subgroup, 16, use A
        w += _words(4456, 10, 5, 7, 8, 8, 9)  # %10 OpTypeCooperativeMatrixKHR f16 Subgroup 16 16 A
    w += _words(54, 1, 3, 0, 2) + _words(248, 4) + _words(253) + _words(56)  # main: return
    header = [0x07230203, 0x00010300, 0, 11, 0]
    return struct.pack(f"<{len(header) + len(w)}I", *header, *w)


def attempt(name: str, device: str | None) -> dict:
    """Run one attempt in this process; returns what it answered."""
    import wgpu
    from wgpu.backends.wgpu_native import _api, ffi, lib

    from ddl_wgpu.runtime.gpu import Gpu

    out: dict = {}
    if name == "versions":
        v = lib.wgpuGetVersion()
        out["wgpu_py"] = wgpu.__version__
        out["wgpu_native"] = ".".join(str((v >> s) & 0xFF) for s in (24, 16, 8, 0))
        gpu = Gpu(device)
        out["adapter"] = common.adapter_line(gpu)
        out["adapter_features"] = sorted(gpu.adapter.features)
        keys = ("ooperative", "xperimental", "pirv", "assthrough")
        out["lib_names"] = sorted(n for n in dir(lib) if any(k in n for k in keys))
        from wgpu.backends.wgpu_native import _mappings

        names = set()
        for table in vars(_mappings).values():
            if isinstance(table, dict):
                names |= {
                    k
                    for k in table
                    if isinstance(k, str)
                    and any(x in k for x in ("cooperative", "passthrough", "experimental", "spirv"))
                }
        out["wgpu_py_feature_names"] = sorted(names)
        return out
    gpu = Gpu(device)
    if name in ("request_passthrough", "spirv_raw_passthrough"):
        _api.enum_str2int["NativeFeature"]["passthrough-shaders"] = PASSTHROUGH
        dev = gpu.adapter.request_device_sync(required_features=["passthrough-shaders"])
        out["device_has_passthrough"] = bool(lib.wgpuDeviceHasFeature(dev._internal, PASSTHROUGH))
        if name == "request_passthrough":
            return out
        gpu.device = dev
    if name == "request_feature":
        listed = "cooperative-matrix" in gpu.adapter.features
        out["listed"] = listed
        dev = gpu.adapter.request_device_sync(required_features=["cooperative-matrix"])
        out["device_features"] = sorted(dev.features)
        return out
    if name == "wgsl_enable":
        gpu.device.create_shader_module(code=COOP_WGSL)
        out["compiled"] = True
        return out
    code = spirv(name.endswith(("coop", "passthrough")))
    if name.startswith("spirv_naga"):
        sm = gpu.device.create_shader_module(code=code)
    else:
        words = ffi.new("uint32_t[]", list(struct.unpack(f"<{len(code) // 4}I", code)))
        desc = _api.new_struct_p("WGPUShaderModuleDescriptorSpirV *", label=_api.to_c_string_view("probe"),
                                 sourceSize=len(code) // 4, source=words)  # fmt: skip
        handle = lib.wgpuDeviceCreateShaderModuleSpirV(gpu.device._internal, desc)
        out["handle_null"] = handle == ffi.NULL
        if handle == ffi.NULL:
            return out
        sm = _api.GPUShaderModule("probe", handle, gpu.device)
    out["module"] = True
    pl = gpu.device.create_pipeline_layout(bind_group_layouts=[])
    gpu.device.create_compute_pipeline(layout=pl, compute={"module": sm, "entry_point": "main"})
    out["pipeline"] = True
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--attempt", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.attempt:  # the child: print one JSON line
        try:
            res = {"ok": True, **attempt(args.attempt, args.device)}
        except Exception as e:
            res = {"ok": False, "error": f"{e.__class__.__name__}: {e}"}
        print("RESULT " + json.dumps(res))
        return 0
    results = {}
    for name in ATTEMPTS:
        cmd = [sys.executable, __file__, "--attempt", name] + (
            ["--device", args.device] if args.device else []
        )
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
            res = (
                json.loads(lines[-1][7:])
                if lines
                else {"ok": False, "error": f"exit {p.returncode}, no result"}
            )
            res["returncode"] = p.returncode
            res["stderr_tail"] = p.stderr[-1500:]
        except subprocess.TimeoutExpired:
            res = {"ok": False, "error": "timed out after 120 s"}
        results[name] = res
        print(f"== {name}: " + json.dumps({k: v for k, v in res.items() if k != "stderr_tail"}), flush=True)
        if res.get("stderr_tail"):
            print("   stderr: " + res["stderr_tail"].strip().replace("\n", "\n   ")[-800:], flush=True)
    common.write_json(
        common.json_path(args.json, "tensor_cores"), {"date": common.now_iso(), "attempts": results}
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
