"""WGSL subgroup matrices emulated in plain WGSL, so the generated matrix-unit kernels (`matmul_tc`, and
bench/matrix_ceiling.py's) run where no GPU lists a subgroup-matrix configuration (lavapipe under Dawn): the matrix
types and builtins are replaced by WGSL functions that do the same arithmetic, spread over a 32-lane
"subgroup" as the matrix units spread it, and the subgroup builtins by a fixed 32-lane split of the
workgroup. A result matrix is 8 f32 per lane (lane l holds elements l, l + 32, ...); a left or right operand
is where it lies in workgroup memory (the kernels only ever load them from there, and multiply them before
the next barrier). 16 x 16 x 16 matrices, f16 operands, f32 results. What this checks is everything the
generators and launchers compute; the matrix units themselves are checked on a GPU (make test-gpu). The
multiply-accumulate's inner loop runs to a bound set at run time: lavapipe then compiles a kernel with several
result matrices per subgroup in seconds, where unrolled it took tens of seconds to minutes."""

from __future__ import annotations

import re

_TYPES = """
var<private> em_lane: u32;
var<private> em_n: u32;  // 16, set at run time: loops the compiler cannot unroll compile in seconds, not minutes
struct ML { o: u32, s: u32, cm: bool }
struct MRt { o: u32, s: u32, cm: bool }
struct MR { v: array<f32, 8> }
"""


def emulation(left: str, right: str, stores: tuple[str, ...], result_loads: tuple[str, ...] = ()) -> str:
    """The emulating functions for a kernel whose left matrices are loaded from the workgroup array `left`,
    its right ones from `right`, whose result matrices are stored into the arrays `stores` and loaded from
    `result_loads`."""
    fns = [f"fn ld_ML_{left}(o: u32, cm: bool, s: u32) -> ML {{ return ML(o, s, cm); }}",
           f"fn ld_MRt_{right}(o: u32, cm: bool, s: u32) -> MRt {{ return MRt(o, s, cm); }}"]  # fmt: skip
    for a in stores:
        fns.append(f"fn st_{a}(o: u32, m: MR, cm: bool, s: u32) {{\n"
                   f"    for (var t = 0u; t < 8u; t++) {{ let e = em_lane + 32u * t; {a}[o + (e / 16u) * s + e % 16u] = m.v[t]; }}\n}}")  # fmt: skip
    for a in result_loads:
        fns.append(f"fn ld_MR_{a}(o: u32, cm: bool, s: u32) -> MR {{\n    var m: MR;\n"
                   f"    for (var t = 0u; t < 8u; t++) {{ let e = em_lane + 32u * t; m.v[t] = {a}[o + (e / 16u) * s + e % 16u]; }}\n"
                   "    return m;\n}")  # fmt: skip
    fns.append(f"""fn mma(l: ML, r: MRt, acc: MR) -> MR {{
    var out = acc;
    for (var t = 0u; t < 8u; t++) {{
        let e = em_lane + 32u * t;
        var sum = out.v[t];
        for (var k = 0u; k < em_n; k++) {{
            // element (row, k) of the left matrix and (k, col) of the right, row- or column-major
            let ia = select(l.o + (e / 16u) * l.s + k, l.o + k * l.s + e / 16u, l.cm);
            let ib = select(r.o + k * r.s + e % 16u, r.o + (e % 16u) * r.s + k, r.cm);
            sum += f32({left}[ia]) * f32({right}[ib]);
        }}
        out.v[t] = sum;
    }}
    return out;
}}""")
    return _TYPES + "\n".join(fns) + "\n"


def emulated(src: str, emulation_text: str) -> str:
    """A kernel's WGSL with the 16 x 16 x 16 matrix types and builtins replaced by `emulation_text`'s
    functions, and the subgroup builtins by a fixed 32-lane split of the workgroup (what the launchers
    counted threads in)."""
    src = src.replace("enable chromium_experimental_subgroup_matrix;\n", "")
    src = src.replace("subgroup_matrix_result<f32, 16, 16>()", "MR()")
    for wgsl, ours in (("result<f32", "MR"), ("left<f16", "ML"), ("right<f16", "MRt")):
        src = src.replace(f"subgroup_matrix_{wgsl}, 16, 16>", ours)
    src = re.sub(r"subgroupMatrixLoad<(\w+)>\(&(\w+), ", r"ld_\1_\2(", src)
    src = re.sub(r"subgroupMatrixStore\(&(\w+), ", r"st_\1(", src)
    src = src.replace("subgroupMatrixMultiplyAccumulate(", "mma(")
    head, body = src.split("@compute", 1)
    body = re.sub(r",\s*@builtin\(subgroup_id\) sid: u32, @builtin\(subgroup_invocation_id\) lane: u32,\s*"
                  r"@builtin\(subgroup_size\) sg_size: u32\) \{", ") {\n    let sid = li / 32u; let lane = li % 32u; "
                  "let sg_size = 32u; em_lane = lane; em_n = select(16u, 17u, wid.x == 0xffffffffu);", body)  # fmt: skip
    assert "subgroupMatrix" not in body and "sg_size = 32u" in body, "the generated kernel changed its shape"
    return head + emulation_text + "@compute" + body
