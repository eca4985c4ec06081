"""The WGSL a kernel compiles: the file found in the wheel or the repository (`shader_dirs`), its
`{{include NAME}}` lines and `{{name}}` template holes filled (`shader_source`), written out for reading when
DDL_WGPU_DUMP_WGSL is set (`dump_shader`), and whether it is compiled without naga's runtime checks
(`trusted_files`). `gpu.Gpu.kernel` is the one caller in the engine."""

from __future__ import annotations

import hashlib
import os
import re
import secrets
from pathlib import Path

from ddl_wgpu.runtime.gpu_errors import KernelError

# A directory: every shader source a kernel compiles is written there, after includes and template
# substitution, so generated WGSL can be read (`dump_shader`).
ENV_DUMP = "DDL_WGPU_DUMP_WGSL"
# Shader files compiled without naga's runtime checks (index clamping, loop bounding): "default" (the
# files in TRUSTED_FILES), "none", or a comma-separated list of files.
ENV_TRUSTED = "DDL_WGPU_TRUSTED"
# Kernels whose every index is guarded by construction (explicit bounds tests on global reads and writes,
# shared-memory indices in range by their loop bounds) and whose launchers check every binding's size.
# naga otherwise clamps each array index and counts every loop's iterations: in a GEMM's inner loop that is
# integer work beside every shared-memory load.
TRUSTED_FILES = frozenset({"matmul.wgsl", "attention.wgsl", "gated_delta.wgsl"})


def trusted_files() -> frozenset:
    """The shader files compiled without runtime checks (`DDL_WGPU_TRUSTED`, default TRUSTED_FILES)."""
    value = os.environ.get(ENV_TRUSTED, "default").strip()
    if value == "default":
        return TRUSTED_FILES
    if value in ("", "none"):
        return frozenset()
    return frozenset(f.strip() for f in value.split(",") if f.strip())


def shader_dirs() -> list[Path]:
    """Where the WGSL lives: inside the wheel (`ddl_wgpu/shaders`) or at the repository root (`shaders/`)."""
    package = Path(__file__).resolve().parents[1]
    return [p for p in (package / "shaders", package.parent / "shaders") if p.is_dir()]


def _read_shader(file: str) -> str:
    candidates = [Path(file)] if Path(file).is_absolute() else [d / file for d in shader_dirs()]
    for p in candidates:
        if p.is_file():
            return p.read_text()
    raise KernelError(f"{file}: shader file not found in {[str(d) for d in shader_dirs()]}")


def shader_source(file: str, templates: dict | None = None) -> str:
    """Read a WGSL file; a line `{{include NAME}}` is replaced by the shader file NAME (shared helpers such as
    `prelude_reduce.wgsl`), then `{{name}}` placeholders from `templates` (generated code, and the uniform
    structs `{{struct Params}}` that `Uniform.wgsl` emits). Any placeholder left is an error (a generated
    kernel with a hole must not compile silently)."""
    src = _read_shader(file)
    for name in re.findall(r"^\{\{include ([\w.]+)\}\}$", src, re.M):
        src = src.replace("{{include " + name + "}}", _read_shader(name).rstrip("\n"))
    for k, v in (templates or {}).items():
        src = src.replace("{{" + k + "}}", str(v))
    if "{{" in src:
        start = src.index("{{")
        raise KernelError(f"{file}: unfilled template placeholder {src[start : src.index('}}', start) + 2]}")
    return src


def dump_shader(
    file: str, entry: str, constants: dict | None, templates: dict | None, src: str
) -> Path | None:
    """With env DDL_WGPU_DUMP_WGSL=DIR, write the source a kernel compiles (includes, uniform structs and
    template values filled in) to DIR/<family>.<entry>.<hash>.wgsl, the hash over the constants and template
    values (so each generated variant has its own file); the override constants head the file as a comment.
    Returns the path written, or None when the variable is unset."""
    out = os.environ.get(ENV_DUMP)
    if not out:
        return None
    key = repr((sorted((constants or {}).items()), sorted((templates or {}).items())))
    digest = hashlib.sha256(key.encode()).hexdigest()[:10]
    path = Path(out) / f"{Path(file).stem}.{entry}.{digest}.wgsl"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        consts = ", ".join(f"{k}={v}" for k, v in sorted((constants or {}).items())) or "none"
        text = f"// {file}:{entry}, override constants: {consts}\n{src}".encode()
        # as every writer (files/safeio.py, a layer above): a file of its own, created exclusively, then a rename
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.partial")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(text)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    return path
