"""`Uniform`: a kernel's uniform block declared once, as its WGSL struct and its packed bytes from the same
description (docs/kernels.md#uniforms-declared-once). `gpu.py` re-exports it, so launchers write
`gpu.Uniform` as before."""

from __future__ import annotations

import struct

_WGSL_TYPES = {"u32": "I", "i32": "i", "f32": "f", "pad": "I"}  # the `struct` code of each field type


def _scalar(ftype: str, value) -> bytes:
    return struct.pack("<" + _WGSL_TYPES[ftype], float(value) if ftype == "f32" else int(value))


class Uniform:
    """One kernel uniform, declared once: its WGSL struct name and its scalar fields in order.

    `Uniform("Params", ("rows", "u32"), ("eps", "f32", "added to the mean square"), ("pad0", "pad"))`: each
    field is (name, type) or (name, type, comment), type u32, i32, f32, or "pad" (a u32 always 0, never
    given). The WGSL side is generated from it (`wgsl()`, inserted where a shader has the hole
    `{{struct Params}}`; the launcher passes the description to `Gpu.kernel(..., uniforms=...)`), and the
    buffer is packed from it by field name (`pack(rows=..., eps=...)`), so the two cannot disagree; a
    per-step value is rewritten by name too, in place at its `offset` (`Gpu.write_fields`)."""

    def __init__(self, name: str, *fields: tuple):
        self.name = name
        self.fields = tuple((f[0], f[1], f[2] if len(f) > 2 else "") for f in fields)
        for fname, ftype, _ in self.fields:
            if ftype not in _WGSL_TYPES:
                raise ValueError(
                    f"uniform {name}.{fname}: type {ftype!r} is not one of {sorted(_WGSL_TYPES)}"
                )
        names = [f[0] for f in self.fields]
        if len(set(names)) != len(names):
            raise ValueError(f"uniform {name}: duplicate field names {names}")
        self.names = tuple(n for n, t, _ in self.fields if t != "pad")  # the fields `pack` takes
        self._types = {n: t for n, t, _ in self.fields}

    def offset(self, field: str) -> int:
        """Byte offset of `field` in the packed uniform (for rewriting one field in place)."""
        if field not in self.names:
            raise ValueError(f"uniform {self.name}: no field {field!r} (fields {list(self.names)})")
        return 4 * [n for n, _, _ in self.fields].index(field)

    def wgsl(self) -> str:
        """The WGSL `struct` declaration."""
        width = max(len(f"{n}: {'u32' if t == 'pad' else t},") for n, t, _ in self.fields)
        lines = []
        for n, t, doc in self.fields:
            decl = f"{n}: {'u32' if t == 'pad' else t},"
            lines.append(f"    {decl:<{width}}  // {doc}" if doc else f"    {decl}")
        return f"struct {self.name} {{\n" + "\n".join(lines) + "\n}"

    def pack(self, **values) -> bytes:
        """The uniform's bytes from every non-pad field by name; a missing or unknown field is an error."""
        given = set(values)
        wanted = {n for n, t, _ in self.fields if t != "pad"}
        if given != wanted:
            missing, unknown = sorted(wanted - given), sorted(given - wanted)
            raise ValueError(f"uniform {self.name}: missing fields {missing}, unknown fields {unknown}")
        data = b"".join(_scalar(t, values.get(n, 0)) for n, t, _ in self.fields)
        return data + b"\0" * (-len(data) % 16)  # WGSL's uniform layout: a multiple of 16 bytes

    def pack_field(self, field: str, value) -> tuple[int, bytes]:
        """(byte offset, bytes) of one field's value, for rewriting that field alone in place."""
        return self.offset(field), _scalar(self._types[field], value)

    def __repr__(self) -> str:
        return f"Uniform({self.name}: {', '.join(n for n, _, _ in self.fields)})"
