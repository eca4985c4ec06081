"""Kernel launchers: one module per WGSL family (`shaders/<family>.wgsl`), forward above backward.

One family X has one path: `shaders/X.wgsl` -> `ddl_wgpu/ops/X.py` -> its `ddl_ref` reference (named in the
module's docstring) -> `tests/test_kernel_X.py`. A module declares its shader's uniforms once, as
`gpu.Uniform` descriptions: the WGSL structs are generated from them (the shader has a `{{struct NAME}}`
hole) and the launchers pack them by field name. Reductions shared by several shaders live in
`shaders/prelude_reduce.wgsl`, pasted in by an include line. `DDL_WGPU_DUMP_WGSL=DIR` writes every shader
source as compiled (`shader_files.dump_shader`).

Every launcher takes the GPU, then outputs, then inputs (llm.c's order), then sizes, and returns a
`gpu.Call`: bind groups and uniforms built once, recorded into a step as many times as needed. A buffer
argument is either a `wgpu` buffer or a `(buffer, byte_offset, nbytes)` view into a flat arena.
"""


def view(res) -> tuple:
    """(buffer, byte_offset, nbytes) of a buffer or of a view."""
    return res if isinstance(res, tuple) else (res, 0, res.size)


def sub(res, offset_floats: int, n_floats: int) -> tuple:
    """The view of `n_floats` f32 values starting `offset_floats` values into a buffer or view."""
    buf, off, _ = view(res)
    return (buf, off + 4 * int(offset_floats), 4 * int(n_floats))


def pow2_at_least(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


def nbytes(res) -> int:
    """Bytes bound by a buffer or a view."""
    return view(res)[2]


def need_bytes(what: str, res, n: int) -> None:
    """Raise if `res` binds fewer than n bytes: the shader's bounds guards would read zeros or drop writes."""
    if nbytes(res) < n:
        raise ValueError(f"{what}: {nbytes(res)} bytes bound, the call needs {n}")


def need(entry: str, name: str, res, n: int) -> None:
    """Raise if `res` holds fewer than n f32 (or u32) values."""
    need_bytes(f"{entry}: {name}", res, 4 * n)


def need_all(entry: str, **named) -> None:
    """`need` for several bindings given as name=(buffer_or_view, n_values)."""
    for name, (res, n) in named.items():
        need(entry, name, res, n)
