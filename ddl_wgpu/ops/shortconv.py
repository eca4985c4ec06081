"""Launchers for `shaders/shortconv.wgsl`: the d_v > 1 state's compressors and expanders
(docs/model.md#the-expanded-state-d_v--4-expansion-compressors-readout).

Kernel path: `shaders/shortconv.wgsl` -> `ddl_wgpu/ops/shortconv.py` -> reference
`ddl_ref.shortconv.tc_forward`, `ddl_ref.shortconv.tc_backward`, `ddl_ref.shortconv.cc_forward`,
`ddl_ref.shortconv.cc_backward`, `ddl_ref.shortconv.ec_forward`, `ddl_ref.shortconv.ec_backward`,
`ddl_ref.shortconv.repeat_forward`, `ddl_ref.shortconv.repeat_backward` -> test
`tests/test_kernel_shortconv.py`.

Rows r = b*T + t; the state X is (rows, C, dv) row-major; x_in, e are (rows, C). The tap conventions are
the reference's:

- TC (token compression): causal depthwise conv over time on the C*dv channels, conv (C*dv, k), tap k-1 the
  current token, then x_in = y @ read, read (dv,). A row's history stops at t = 0 of its own sequence.
- CC (channel compression): depthwise conv along the d_v axis, conv (C, dv), left pad (dv-1)//2, then read.
- EC (embedding expansion): causal depthwise conv over time, conv (C*dv, k), e (rows, C) -> X0 (rows, C, dv).
- repeat: X0 = e 1ᵀ.

Backwards: the state / embedding gradient per element (dX accumulates by default for TC/CC, since the state's
gradient also flows through the Delta path), and the parameter gradients (dconv, dread) always *accumulate*
(+=) through a deterministic two-pass reduction: pass 1 per (row block, column) partial sums into a scratch
buffer (`partials`, allocated here unless given; see `partials_size`), pass 2 a fixed-order sum of the blocks.
The blocking depends only on the shape (`grad_blocks`), so results are bit-identical run to run.

What it does not do: token caches for incremental decoding, or a causal CC.
"""

from __future__ import annotations

import math

from ddl_wgpu.ops import need_all as _need
from ddl_wgpu.runtime.gpu import Call, Gpu, Uniform

FILE = "shortconv.wgsl"
WG = 256  # threads per workgroup, as in the shader
PARAMS = Uniform(
    "Params",
    ("rows", "u32"),
    ("T", "u32"),
    ("C", "u32"),
    ("dv", "u32"),
    ("k", "u32", "TC/EC taps (CC: the d_v-axis kernel, = dv)"),
    ("pad_left", "u32", "CC"),
    ("accumulate", "u32", "dX / de kernels and colsum: 1 adds into the output, 0 overwrites it"),
    ("rows_per_block", "u32", "gradient pass 1"),
    ("n_blocks", "u32"),
    ("width", "u32", "columns of a partials row"),
    ("n_out", "u32", "colsum: outputs"),
    ("off", "u32", "colsum: first column"),
    ("ostride", "u32", "colsum: column step between outputs"),
    ("n_inner", "u32", "colsum: columns summed into one output (besides the blocks)"),
    ("istride", "u32", "colsum: column step between them"),
    ("_pad", "pad"),
)
CW_PARTIAL = 32  # columns per workgroup in pass 1 (8 row lanes)
CW_CONV = 32  # outputs per workgroup in pass 2 of dconv (8 block lanes)
CW_READ = 1  # outputs per workgroup in pass 2 of dread (256 lanes over blocks x features)


def grad_blocks(rows: int) -> tuple[int, int]:
    """(rows_per_block, n_blocks) of the parameter-gradient reduction: blocks of about sqrt(rows) rows (at
    least 4 steps per pass-1 lane), a multiple of the pass-1 lanes. A function of the shape only."""
    lanes = WG // CW_PARTIAL
    rpb = max(4 * lanes, math.isqrt(max(0, int(rows) - 1)) + 1)
    rpb = -(-rpb // lanes) * lanes
    return rpb, -(-max(1, int(rows)) // rpb)


def partials_width(kind: str, C: int, dv: int, k: int = 4) -> int:
    """Columns of one partials row: the dconv entries, plus C*dv dread integrands for the compressors."""
    C, dv, k = int(C), int(dv), int(k)
    return {"tc": C * dv * k + C * dv, "cc": 2 * C * dv, "ec": C * dv * k}[kind]


def partials_size(kind: str, rows: int, C: int, dv: int, k: int = 4) -> int:
    """Bytes of the scratch a `tc_backward` / `cc_backward` / `ec_backward` needs (several calls of one
    shape may share one: the dispatches of a step run in order)."""
    return 4 * grad_blocks(rows)[1] * partials_width(kind, C, dv, k)


def _params(gpu, label, rows, T, C, dv, k, pad_left=0, accumulate=0, rpb=0, n_blocks=0, width=0, n_out=0,
            off=0, ostride=0, n_inner=0, istride=0):  # fmt: skip
    return gpu.uniform(PARAMS, rows=rows, T=T, C=C, dv=dv, k=k, pad_left=pad_left, accumulate=int(bool(accumulate)),
                       rows_per_block=rpb, n_blocks=n_blocks, width=width, n_out=n_out, off=off, ostride=ostride,
                       n_inner=n_inner, istride=istride, label=label)  # fmt: skip


def _k(gpu: Gpu, entry: str, sig: str, cw: int | None = None):
    return gpu.kernel(
        FILE,
        entry,
        sig,
        constants=None if cw is None else {"CW": cw},
        workgroup=(WG, 1, 1),
        uniforms=(PARAMS,),
    )


def _elementwise(n: int) -> int:
    return -(-int(n) // WG)


def _param_grads(gpu, entry, sig, inputs, dconv, dread, rows, T, C, dv, k, pad_left, n_conv, kind,
                 partials) -> Call:  # fmt: skip
    """Pass 1 (`entry`) into partials, then pass 2 into dconv (and dread when given), both accumulated."""
    rpb, n_blocks = grad_blocks(rows)
    width = partials_width(kind, C, dv, k)
    if partials is None:
        partials = gpu.buffer(4 * n_blocks * width, label=f"{kind} grad partials")
    _need(entry, partials=(partials, n_blocks * width))
    p1 = _params(gpu, entry, rows, T, C, dv, k, pad_left, 0, rpb, n_blocks, width)
    k1 = _k(gpu, entry, sig, CW_PARTIAL)
    k2c = _k(gpu, "colsum", "rwu", CW_CONV)
    pc = _params(gpu, "colsum dconv", rows, T, C, dv, k, 0, 1, rpb, n_blocks, width, n_conv, 0, 1, 1, 0)
    call = Call(
        [
            (k1, gpu.bind(k1, *inputs, partials, p1), n_blocks * -(-width // CW_PARTIAL)),
            (k2c, gpu.bind(k2c, partials, dconv, pc), -(-n_conv // CW_CONV)),
        ],
        [p1, pc],
    )
    if dread is not None:
        k2r = _k(gpu, "colsum", "rwu", CW_READ)
        pr = _params(gpu, "colsum dread", rows, T, C, dv, k, 0, 1, rpb, n_blocks, width, dv, n_conv, 1, C, dv)
        call += Call([(k2r, gpu.bind(k2r, partials, dread, pr), -(-dv // CW_READ))], [pr])
    call.scratch = partials  # kept alive with the call (the bind groups refer to it)
    return call


# ---------------------------------------------------------------------------------------------------------
# TC


def tc_forward(gpu: Gpu, x_in, X, conv, read, B: int, T: int, C: int, dv: int, k: int) -> Call:
    """x_in (B*T, C)[r, i] = sum_j read[j] sum_m conv[i*dv + j, m] X[r - (k-1-m), i, j] (same sequence)."""
    rows, T, C, dv, k = int(B) * int(T), int(T), int(C), int(dv), int(k)
    _need("tc_forward", x_in=(x_in, rows * C), X=(X, rows * C * dv), conv=(conv, C * dv * k), read=(read, dv))
    p = _params(gpu, "tc_forward", rows, T, C, dv, k)
    kf = _k(gpu, "tc_forward", "rrrwu")
    return Call([(kf, gpu.bind(kf, X, conv, read, x_in, p), _elementwise(rows * C))], [p])


def tc_backward(
    gpu: Gpu, dX, dconv, dread, dx_in, X, conv, read, B: int, T: int, C: int, dv: int, k: int,
    accumulate_dX: bool = True, partials=None,
) -> Call:  # fmt: skip
    """dX (B*T, C, dv) (+)= the state gradient; dconv (C*dv, k) += and dread (dv,) += the parameter
    gradients. `partials`: scratch of `partials_size("tc", B*T, C, dv, k)` bytes (allocated when None)."""
    rows, T, C, dv, k = int(B) * int(T), int(T), int(C), int(dv), int(k)
    _need("tc_backward", dX=(dX, rows * C * dv), dconv=(dconv, C * dv * k), dread=(dread, dv),
          dx_in=(dx_in, rows * C), X=(X, rows * C * dv), conv=(conv, C * dv * k), read=(read, dv))  # fmt: skip
    p = _params(gpu, "tc_backward", rows, T, C, dv, k, 0, accumulate_dX)
    kd = _k(gpu, "tc_backward_dX", "rrrwu")
    call = Call([(kd, gpu.bind(kd, dx_in, conv, read, dX, p), _elementwise(rows * C * dv))], [p])
    grads = _param_grads(gpu, "tc_grad_partial", "rrrrwu", (dx_in, X, conv, read), dconv, dread, rows, T, C, dv,
                         k, 0, C * dv * k, "tc", partials)  # fmt: skip
    out = call + grads
    out.scratch = grads.scratch
    return out


# ---------------------------------------------------------------------------------------------------------
# CC


def cc_forward(gpu: Gpu, x_in, X, conv, read, rows: int, C: int, dv: int) -> Call:
    """x_in (rows, C)[r, i] = sum_j read[j] sum_m conv[i, m] X[r, i, j + m - (dv-1)//2] (zero outside)."""
    rows, C, dv = int(rows), int(C), int(dv)
    _need("cc_forward", x_in=(x_in, rows * C), X=(X, rows * C * dv), conv=(conv, C * dv), read=(read, dv))
    p = _params(gpu, "cc_forward", rows, 1, C, dv, dv, (dv - 1) // 2)
    kf = _k(gpu, "cc_forward", "rrrwu")
    return Call([(kf, gpu.bind(kf, X, conv, read, x_in, p), _elementwise(rows * C))], [p])


def cc_backward(
    gpu: Gpu, dX, dconv, dread, dx_in, X, conv, read, rows: int, C: int, dv: int, accumulate_dX: bool = True,
    partials=None,
) -> Call:  # fmt: skip
    """dX (rows, C, dv) (+)= the state gradient; dconv (C, dv) += and dread (dv,) += the parameter gradients.
    `partials`: scratch of `partials_size("cc", rows, C, dv)` bytes (allocated when None)."""
    rows, C, dv = int(rows), int(C), int(dv)
    _need("cc_backward", dX=(dX, rows * C * dv), dconv=(dconv, C * dv), dread=(dread, dv), dx_in=(dx_in, rows * C),
          X=(X, rows * C * dv), conv=(conv, C * dv), read=(read, dv))  # fmt: skip
    pl = (dv - 1) // 2
    p = _params(gpu, "cc_backward", rows, 1, C, dv, dv, pl, accumulate_dX)
    kd = _k(gpu, "cc_backward_dX", "rrrwu")
    call = Call([(kd, gpu.bind(kd, dx_in, conv, read, dX, p), _elementwise(rows * C * dv))], [p])
    grads = _param_grads(gpu, "cc_grad_partial", "rrrrwu", (dx_in, X, conv, read), dconv, dread, rows, 1, C, dv,
                         dv, pl, C * dv, "cc", partials)  # fmt: skip
    out = call + grads
    out.scratch = grads.scratch
    return out


# ---------------------------------------------------------------------------------------------------------
# EC and repetition


def ec_forward(gpu: Gpu, X0, e, conv, B: int, T: int, C: int, dv: int, k: int) -> Call:
    """X0 (B*T, C, dv)[r, i, j] = sum_m conv[i*dv + j, m] e[r - (k-1-m), i] (same sequence)."""
    rows, T, C, dv, k = int(B) * int(T), int(T), int(C), int(dv), int(k)
    _need("ec_forward", X0=(X0, rows * C * dv), e=(e, rows * C), conv=(conv, C * dv * k))
    p = _params(gpu, "ec_forward", rows, T, C, dv, k)
    kf = _k(gpu, "ec_forward", "rrwu")
    return Call([(kf, gpu.bind(kf, e, conv, X0, p), _elementwise(rows * C * dv))], [p])


def ec_backward(
    gpu: Gpu, de, dconv, dX0, e, conv, B: int, T: int, C: int, dv: int, k: int, accumulate_de: bool = False,
    partials=None,
) -> Call:  # fmt: skip
    """de (B*T, C) (+)= the embedding gradient; dconv (C*dv, k) += its gradient.
    `partials`: scratch of `partials_size("ec", B*T, C, dv, k)` bytes (allocated when None)."""
    rows, T, C, dv, k = int(B) * int(T), int(T), int(C), int(dv), int(k)
    _need("ec_backward", de=(de, rows * C), dconv=(dconv, C * dv * k), dX0=(dX0, rows * C * dv), e=(e, rows * C),
          conv=(conv, C * dv * k))  # fmt: skip
    p = _params(gpu, "ec_backward", rows, T, C, dv, k, 0, accumulate_de)
    kd = _k(gpu, "ec_backward_de", "rrwu")
    call = Call([(kd, gpu.bind(kd, dX0, conv, de, p), _elementwise(rows * C))], [p])
    grads = _param_grads(gpu, "ec_grad_partial", "rrwu", (dX0, e), dconv, None, rows, T, C, dv, k, 0, C * dv * k,
                         "ec", partials)  # fmt: skip
    out = call + grads
    out.scratch = grads.scratch
    return out


def repeat_forward(gpu: Gpu, X0, e, rows: int, C: int, dv: int) -> Call:
    """X0 (rows, C, dv) = e 1ᵀ."""
    rows, C, dv = int(rows), int(C), int(dv)
    _need("repeat_forward", X0=(X0, rows * C * dv), e=(e, rows * C))
    p = _params(gpu, "repeat_forward", rows, 1, C, dv, 0)
    kf = _k(gpu, "repeat_forward", "rwu")
    return Call([(kf, gpu.bind(kf, e, X0, p), _elementwise(rows * C * dv))], [p])


def repeat_backward(gpu: Gpu, de, dX0, rows: int, C: int, dv: int) -> Call:
    """de (rows, C) = sum_j dX0[:, :, j] (overwritten)."""
    rows, C, dv = int(rows), int(C), int(dv)
    _need("repeat_backward", de=(de, rows * C), dX0=(dX0, rows * C * dv))
    p = _params(gpu, "repeat_backward", rows, 1, C, dv, 0)
    kb = _k(gpu, "repeat_backward", "rwu")
    return Call([(kb, gpu.bind(kb, dX0, de, p), _elementwise(rows * C))], [p])
