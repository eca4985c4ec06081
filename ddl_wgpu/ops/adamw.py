"""AdamW over flat f32 ranges (`shaders/adamw.wgsl`), clip and non-finite skip read on the GPU.

Kernel path: `shaders/adamw.wgsl` -> `ddl_wgpu/ops/adamw.py` -> reference `ddl_ref.optim.adamw_step` -> test
`tests/test_kernel_adamw.py`.

    hyper = adamw_hyper(gpu, lr, step, beta1, beta2, eps, weight_decay)   # one uniform per step ...
    calls = [adamw(gpu, p_i, g_i, m_i, v_i, scalars, n_i, hyper) for each range]  # ... shared by all
    # every step:
    gpu.write_uniform(hyper, ADAMW, **adamw_fields(lr, step, beta1, beta2, eps, wd))

`scalars` is the buffer `reduce.finalize_clip` writes: the kernel multiplies gradients by scalars[1] (the
clip multiplier) and leaves p, m, v untouched when scalars[2] == 0 (a non-finite gradient). Semantics are
those of `ddl_ref.optim.adamw_step` (decoupled weight decay first, then Adam with bias correction; step
counts from 1).

What this does not do: zero the gradients (`elementwise`), or compute the norm (`reduce`).
"""

from __future__ import annotations

from ddl_wgpu.runtime.gpu import Call, Uniform

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


def adamw_fields(lr: float, step: int, beta1: float, beta2: float, eps: float, weight_decay: float) -> dict:
    """The ADAMW uniform's fields for `step` (from 1), by name; bias corrections and 1 - beta in float64 on
    the host (1 - f32(0.999) would be 1.3e-5 off)."""
    if step < 1:
        raise ValueError(f"adamw: step={step} counts from 1")
    b1, b2 = float(beta1), float(beta2)
    return dict(
        lr=float(lr),
        beta1=b1,
        beta2=b2,
        one_minus_beta1=1.0 - b1,
        one_minus_beta2=1.0 - b2,
        eps=float(eps),
        weight_decay=float(weight_decay),
        bc1=1.0 - b1**step,
        bc2=1.0 - b2**step,
    )


def adamw_hyper(gpu, lr: float, step: int, beta1: float, beta2: float, eps: float, weight_decay: float):
    """A hyper-parameter uniform that several `adamw` Calls can share (one write per step serves all)."""
    return gpu.uniform(ADAMW, **adamw_fields(lr, step, beta1, beta2, eps, weight_decay), label="adamw")


def _exact(name: str, r, n: int):
    """Bind exactly n floats, so the shader's arrayLength is n."""
    buf, off, nbytes = r if isinstance(r, tuple) else (r, 0, r.size)
    if nbytes < n * 4:
        raise ValueError(f"adamw {name}: {nbytes} bytes bound, the range has {n} f32")
    return (buf, off, n * 4)


def adamw(gpu, p, g, m, v, scalars, n: int, hyper) -> Call:
    """One AdamW step over n f32 of p (updated in place) with gradient g and moments m, v (updated).

    `hyper` is either a uniform buffer (from `adamw_hyper`, shareable across ranges; rewrite it with
    `gpu.write_uniform(hyper, ADAMW, **adamw_fields(...))`) or the fields from `adamw_fields` (then this
    Call owns the uniform: `call.uniforms[0]`).
    `scalars` is finalize_clip's output (clip multiplier at [1], finite flag at [2])."""
    if n < 1:
        raise ValueError(f"adamw: n={n} must be positive")
    if isinstance(hyper, dict):
        hyper = gpu.uniform(ADAMW, **hyper, label="adamw")
    elif not hasattr(hyper, "size"):  # a buffer (or a `gpumem.DryGpu`'s stand-in for one)
        raise TypeError("adamw: hyper must be a uniform buffer or the fields from adamw_fields")
    sbytes = scalars[2] if isinstance(scalars, tuple) else scalars.size
    if sbytes < 12:
        raise ValueError("adamw: scalars must hold finalize_clip's (norm, clip multiplier, finite flag)")
    k = gpu.kernel(FILE, "adamw", "rrwwwu", workgroup=(WG, 1, 1), uniforms=(ADAMW,))
    bg = gpu.bind(
        k, _exact("g", g, n), scalars, _exact("p", p, n), _exact("m", m, n), _exact("v", v, n), hyper
    )
    return Call([(k, bg, -(-n // WG))], [hyper])
