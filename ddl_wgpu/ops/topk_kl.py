"""Top-k KL distillation loss and top-k selection (`shaders/topk_kl.wgsl`), for healing an MTP draft head.

Kernel path: `shaders/topk_kl.wgsl` -> `ddl_wgpu/ops/topk_kl.py` -> reference `ddl_ref.ops.topk_kl_forward`,
`ddl_ref.ops.topk_kl_backward` -> test `tests/test_kernel_topk_kl.py`.

`topk_kl` is used like `crossentropy.cross_entropy`: in place on a (rows, V) chunk of student logits, which
become the gradient times weight * scale_buf[0], with per-row losses weight * KL (unscaled). Two forms
(`form`): "full" (the default, the reference heal tool's), the student's full-vocabulary log-softmax against
the teacher's renormalised top-k, gradient softmax(z) - p~ over the whole row; "topk", the student
renormalised over the k ids, gradient q~ - p~ at the k ids and zero elsewhere. The per-step buffers `teacher_ids` (N, k) u32,
`teacher_probs` (N, k) f32, `weights` (N,) f32 and `row_loss` (N,) f32 are indexed at row `row_offset + r`.
An evaluation (`grad=False`) writes the losses alone.

`topk` produces the teacher data from teacher logits: the k largest logits per row (ties: lower id first)
and their full-softmax probabilities (not renormalised; topk_kl renormalises), written at row
`row_offset + r` of ids_out / probs_out.
"""

from __future__ import annotations

from ddl_wgpu.ops import need_bytes as _need
from ddl_wgpu.runtime.gpu import Call, Uniform

FILE = "topk_kl.wgsl"
WG = 256
KMAX = 64
PARAMS = Uniform(
    "Params",
    ("rows", "u32"),
    ("V", "u32"),
    ("k", "u32"),
    ("row_offset", "u32"),
    ("form", "u32", "topk_kl: 1 the full-vocabulary log-softmax, 0 renormalised over the k ids"),
    ("grad", "u32", "topk_kl: 1 the gradient into the logits, 0 the losses alone (an evaluation)"),
    ("_b", "pad"),
    ("_c", "pad"),
)
# `ddl_ref.ops.KL_FORMS` -> the kernel's form code
FORMS = {"full": 1, "topk": 0}


def _check_sizes(rows: int, V: int, k: int):
    if rows < 1 or V < 1:
        raise ValueError(f"rows={rows}, V={V} must be positive")
    if not 1 <= k <= min(KMAX, V):
        raise ValueError(f"k={k} must be in [1, min({KMAX}, V={V})]")


def topk_kl(
    gpu,
    row_loss,
    logits,
    teacher_ids,
    teacher_probs,
    weights,
    rows: int,
    V: int,
    k: int,
    scale_buf,
    row_offset: int = 0,
    form: str = "full",
    grad: bool = True,
) -> Call:
    """The top-k KL of `form` ("full" or "topk", `ddl_ref.ops.topk_kl_forward`) and, with `grad`, its gradient
    in place on `logits` (rows, V); without, the losses alone and the logits left as they are."""
    _check_sizes(rows, V, k)
    if form not in FORMS:
        raise ValueError(f"kl form must be one of {list(FORMS)}, got {form!r}")
    _need("logits", logits, rows * V * 4)
    n = row_offset + rows
    _need("teacher_ids", teacher_ids, n * k * 4)
    _need("teacher_probs", teacher_probs, n * k * 4)
    _need("weights", weights, n * 4)
    _need("row_loss (whole-batch buffer, indexed at row_offset + r)", row_loss, n * 4)
    _need("scale_buf", scale_buf, 4)
    kern = gpu.kernel(FILE, "topk_kl", "rrrrwwu", workgroup=(WG, 1, 1), uniforms=(PARAMS,))
    u = gpu.uniform(PARAMS, rows=rows, V=V, k=k, row_offset=row_offset, form=FORMS[form], grad=int(grad),
                    label="topk_kl")  # fmt: skip
    bg = gpu.bind(kern, teacher_ids, teacher_probs, weights, scale_buf, logits, row_loss, u)
    return Call([(kern, bg, rows)], [u])


def topk(gpu, ids_out, probs_out, logits, rows: int, V: int, k: int, row_offset: int = 0) -> Call:
    """The k largest of each row of `logits` (rows, V): ids (u32) and full-softmax probabilities, in
    descending order, ties broken by the lower id; written at rows row_offset + r of ids_out / probs_out
    (each (N, k)). k <= 64."""
    _check_sizes(rows, V, k)
    _need("logits", logits, rows * V * 4)
    _need("ids_out", ids_out, (row_offset + rows) * k * 4)
    _need("probs_out", probs_out, (row_offset + rows) * k * 4)
    kern = gpu.kernel(FILE, "topk", "rwwu", workgroup=(WG, 1, 1), uniforms=(PARAMS,))
    u = gpu.uniform(PARAMS, rows=rows, V=V, k=k, row_offset=row_offset, form=0, grad=0, label="topk")
    bg = gpu.bind(kern, logits, ids_out, probs_out, u)
    return Call([(kern, bg, rows)], [u])
