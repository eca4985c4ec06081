"""AdamW over flat f32 ranges (`shaders/adamw.wgsl`), clip and non-finite skip read on the GPU.

Kernel path: `shaders/adamw.wgsl` -> `ddl_wgpu/ops/adamw.py` -> reference `ddl_ref.optim.adamw_step` -> test
`tests/test_kernel_adamw.py`.

    hyper = adamw_hyper(gpu, lr, step, beta1, beta2, eps, weight_decay)   # one uniform per step ...
    calls = [adamw(gpu, p_i, g_i, m_i, v_i, scalars, n_i, hyper) for each range]  # ... shared by all
    # every step:
    gpu.write_uniform(hyper, ADAMW_FMT, *adamw_uniform_values(lr, step, beta1, beta2, eps, wd))

`scalars` is the buffer `reduce.finalize_clip` writes: the kernel multiplies gradients by scalars[1] (the
clip multiplier) and leaves p, m, v untouched when scalars[2] == 0 (a non-finite gradient). Semantics are
those of `ddl_ref.optim.adamw_step` (decoupled weight decay first, then Adam with bias correction; step
counts from 1).

What this does not do: zero the gradients (`elementwise`), or compute the norm (`reduce`).
"""

from __future__ import annotations

import wgpu

from ddl_wgpu.gpu import Call, Uniform

FILE = "adamw.wgsl"
WG = 256

ADAMW = Uniform(
    "Params",
    ("lr", "f32"),
    ("beta1", "f32"),
    ("beta2", "f32"),
    ("one_minus_beta1", "f32"),
    ("one_minus_beta2", "f32"),
    ("eps", "f32"),
    ("weight_decay", "f32"),
    ("bc1", "f32", "1 - beta1^step"),
    ("bc2", "f32", "1 - beta2^step"),
)
ADAMW_FMT = ADAMW.fmt  # the positional form, for callers that pack `adamw_uniform_values` in order


def adamw_uniform_values(
    lr: float, step: int, beta1: float, beta2: float, eps: float, weight_decay: float
) -> tuple:
    """The uniform's values for `step` (from 1), in ADAMW_FMT order; bias corrections and 1 - beta in
    float64 on the host (1 - f32(0.999) would be 1.3e-5 off)."""
    if step < 1:
        raise ValueError(f"adamw: step={step} counts from 1")
    b1, b2 = float(beta1), float(beta2)
    return (
        float(lr),
        b1,
        b2,
        1.0 - b1,
        1.0 - b2,
        float(eps),
        float(weight_decay),
        1.0 - b1**step,
        1.0 - b2**step,
    )


def adamw_hyper(gpu, lr: float, step: int, beta1: float, beta2: float, eps: float, weight_decay: float):
    """A hyper-parameter uniform that several `adamw` Calls can share (one write per step serves all)."""
    values = adamw_uniform_values(lr, step, beta1, beta2, eps, weight_decay)
    return gpu.uniform(ADAMW, **dict(zip(ADAMW.names, values, strict=True)), label="adamw")


def _exact(name: str, r, n: int):
    """Bind exactly n floats, so the shader's arrayLength is n."""
    buf, off, nbytes = r if isinstance(r, tuple) else (r, 0, r.size)
    if nbytes < n * 4:
        raise ValueError(f"adamw {name}: {nbytes} bytes bound, the range has {n} f32")
    return (buf, off, n * 4)


def adamw(gpu, p, g, m, v, scalars, n: int, hyper) -> Call:
    """One AdamW step over n f32 of p (updated in place) with gradient g and moments m, v (updated).

    `hyper` is either a uniform buffer (from `adamw_hyper`, shareable across ranges; rewrite it with
    `gpu.write_uniform(hyper, ADAMW_FMT, *adamw_uniform_values(...))`) or a tuple of values from
    `adamw_uniform_values` (then this Call owns the uniform: `call.uniforms[0]`).
    `scalars` is finalize_clip's output (clip multiplier at [1], finite flag at [2])."""
    if n < 1:
        raise ValueError(f"adamw: n={n} must be positive")
    if isinstance(hyper, tuple | list):
        hyper = gpu.uniform(ADAMW, **dict(zip(ADAMW.names, hyper, strict=True)), label="adamw")
    elif not isinstance(hyper, wgpu.GPUBuffer):
        raise TypeError("adamw: hyper must be a uniform buffer or a tuple from adamw_uniform_values")
    sbytes = scalars[2] if isinstance(scalars, tuple) else scalars.size
    if sbytes < 12:
        raise ValueError("adamw: scalars must hold finalize_clip's (norm, clip multiplier, finite flag)")
    k = gpu.kernel(FILE, "adamw", "rrwwwu", workgroup=(WG, 1, 1), uniforms=(ADAMW,))
    bg = gpu.bind(
        k, _exact("g", g, n), scalars, _exact("p", p, n), _exact("m", m, n), _exact("v", v, n), hyper
    )
    return Call([(k, bg, -(-n // WG))], [hyper])
