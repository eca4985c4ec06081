"""Every WGSL entry point is reached by a launcher whose output a family test checks against `ddl_ref`.

Most launchers are one entry point of the same name. The ones below are stages of multi-dispatch launchers
(a backward's passes, a two-pass reduction, an in-place variant); this test pins which launcher dispatches
each, so the family test named beside it is the check of that entry point's numbers. A new entry point in
`shaders/` must appear here or be dispatched by a launcher of its own name.
"""

import re
from pathlib import Path

from ddl_wgpu.ops import attention, decode, delta, gated_delta, matmul, reduce, rmsnorm, rope, shortconv

SHADERS = Path(__file__).resolve().parent.parent / "shaders"
MB = 1 << 20

# entry point -> the test file that compares its launcher's output with ddl_ref
STAGES = {
    "attention.wgsl:attention_backward_delta": "test_kernel_attention.py",
    "attention.wgsl:attention_backward_dq": "test_kernel_attention.py",
    "attention.wgsl:attention_backward_dkdv": "test_kernel_attention.py",
    "attention_scores.wgsl:scores_softmax": "test_kernel_attention.py",
    "attention_scores.wgsl:scores_backward": "test_kernel_attention.py",
    "attention.wgsl:attention_masked_backward_dq": "test_chain_attention.py",
    "attention.wgsl:attention_masked_backward_dkdv": "test_chain_attention.py",
    "decode.wgsl:conv_cache": "test_kernel_decode.py",  # tc_cache and ec_cache
    "decode.wgsl:attend_split": "test_kernel_decode.py",  # attend_cache
    "decode.wgsl:attend_merge": "test_kernel_decode.py",  # attend_cache
    "decode.wgsl:argmax_split": "test_kernel_decode.py",  # argmax
    "decode.wgsl:argmax_merge": "test_kernel_decode.py",  # argmax
    "delta.wgsl:delta_heads": "test_kernel_delta.py",  # delta_forward(fused=False)
    "delta.wgsl:delta_update": "test_kernel_delta.py",  # delta_forward(fused=False)
    "delta.wgsl:delta_backward_rows": "test_kernel_delta.py",
    "delta.wgsl:delta_backward_inputs": "test_kernel_delta.py",
    "delta.wgsl:delta_ksum": "test_kernel_delta.py",
    "gated_delta.wgsl:chunk_prep": "test_kernel_gated_delta.py",  # chunk_forward and chunk_backward
    "gated_delta.wgsl:chunk_output": "test_kernel_gated_delta.py",  # chunk_forward
    "gated_delta.wgsl:chunk_backward_state": "test_kernel_gated_delta.py",  # chunk_backward
    "gated_delta.wgsl:chunk_backward_grads": "test_kernel_gated_delta.py",  # chunk_backward
    "matmul.wgsl:splitk_reduce": "test_kernel_matmul.py",
    "reduce.wgsl:sum_squares": "test_kernel_reduce.py",
    "reduce.wgsl:finalize_clip": "test_kernel_reduce.py",
    "reduce.wgsl:finalize_tensors": "test_clipping.py",  # tensor_norm_clip (per-tensor clipping records)
    "rmsnorm.wgsl:rmsnorm_backward_dw_reduce": "test_kernel_rmsnorm.py",
    "rope.wgsl:rope_forward_inplace": "test_kernel_rope.py",
    "rope.wgsl:rope_backward_inplace": "test_kernel_rope.py",
    "shortconv.wgsl:tc_backward_dX": "test_kernel_shortconv.py",
    "shortconv.wgsl:tc_grad_partial": "test_kernel_shortconv.py",
    "shortconv.wgsl:cc_backward_dX": "test_kernel_shortconv.py",
    "shortconv.wgsl:cc_grad_partial": "test_kernel_shortconv.py",
    "shortconv.wgsl:ec_backward_de": "test_kernel_shortconv.py",
    "shortconv.wgsl:ec_grad_partial": "test_kernel_shortconv.py",
    "shortconv.wgsl:colsum": "test_kernel_shortconv.py",
}


def entry_points() -> set[str]:
    found = set()
    for f in SHADERS.glob("*.wgsl"):
        for name in re.findall(r"@compute[^{]*?\bfn\s+(\w+)", f.read_text(), re.S):
            found.add(f"{f.name}:{name}")
    return found


def dispatched(call) -> set[str]:
    return {kernel.name for kernel, _bg, _groups in call.dispatches}


def test_every_entry_point_has_a_launcher():
    launched_by_name = {e for e in entry_points() if e not in STAGES}
    # a launcher function (or, for selftest, the selftest module) of the entry point's own name exists
    ops_src = " ".join(p.read_text() for p in (SHADERS.parent / "ddl_wgpu").rglob("*.py"))
    for e in sorted(launched_by_name):
        entry = e.split(":")[1]
        assert re.search(rf'"{entry}"', ops_src), f"{e} is dispatched by no launcher"
    assert set(STAGES) <= entry_points(), set(STAGES) - entry_points()
    for test_file in set(STAGES.values()):
        assert (Path(__file__).parent / test_file).is_file()


def test_multi_stage_launchers_dispatch_their_stages(gpu):
    buf = [gpu.buffer(MB, label=f"b{i}") for i in range(12)]
    B, T, H, K, D, C, dv, k = 1, 8, 2, 1, 8, 8, 4, 4
    rows = B * T
    seen = set()
    seen |= dispatched(attention.attention_backward(gpu, *buf[:9], B, T, H, K, D))
    seen |= dispatched(attention.attention_forward(gpu, *buf[:5], B, T, H, K, D, impl="scores"))
    seen |= dispatched(attention.attention_backward(gpu, *buf[:9], B, T, H, K, D, impl="scores"))
    seen |= dispatched(attention.attention_masked_backward(gpu, *buf[:9], B, T, H, K, D, 4, impl="flash"))
    seen |= dispatched(delta.delta_forward(gpu, *buf[:10], rows, C, dv, 1e-5, 4.0, fused=False))
    seen |= dispatched(delta.delta_backward(gpu, *buf[:12], rows, C, dv, 4.0))
    seen |= dispatched(delta.ksum(gpu, *buf[:4], rows, C, dv))
    seen |= dispatched(matmul.matmul(gpu, buf[0], buf[1], buf[2], 16, 16, 256, split_k=2))
    parts = gpu.buffer(reduce.total_partials([64]) * 4)
    seen |= dispatched(reduce.grad_norm_clip(gpu, buf[0], parts, [(buf[1], 64)], 1.0))
    seen |= dispatched(reduce.tensor_norm_clip(gpu, buf[0], buf[2], parts, [[(buf[1], 64)]], 1.0))
    seen |= dispatched(decode.tc_cache(gpu, *buf[:5], rows, C, dv, k))
    seen |= dispatched(decode.attend_cache(gpu, *buf[:5], rows, H, K, D, splits=2))
    seen |= dispatched(decode.argmax(gpu, *buf[:3], rows, 64))
    seen |= dispatched(gated_delta.chunk_forward(gpu, *buf[:6], B, T, K, H, D, D))
    seen |= dispatched(gated_delta.chunk_backward(gpu, *buf[:8], B, T, K, H, D, D))
    seen |= dispatched(rmsnorm.rmsnorm_backward(gpu, *buf[:6], rows, C))
    seen |= dispatched(rope.rope_forward(gpu, buf[0], buf[0], buf[1], buf[2], B, T, H, D))
    seen |= dispatched(rope.rope_backward(gpu, buf[0], buf[0], buf[1], buf[2], B, T, H, D))
    seen |= dispatched(shortconv.tc_backward(gpu, *buf[:7], B, T, C, dv, k))
    seen |= dispatched(shortconv.cc_backward(gpu, *buf[:7], rows, C, dv))
    seen |= dispatched(shortconv.ec_backward(gpu, *buf[:5], B, T, C, dv, k))
    missing = set(STAGES) - seen
    assert not missing, f"stages no launcher dispatched: {sorted(missing)}"


def test_each_family_has_one_findable_path():
    """shaders/X.wgsl <-> ddl_wgpu/ops/X.py <-> tests/test_kernel_X.py; each launcher module's docstring names
    its shader, its test and its `ddl_ref` reference functions, and every name it gives resolves."""
    import importlib

    from ddl_wgpu import ops

    ops_dir = Path(ops.__file__).parent
    families = (
        {f.stem for f in SHADERS.glob("*.wgsl")} - {"selftest"} - {f.stem for f in SHADERS.glob("prelude_*")}
    )
    assert families == {p.stem for p in ops_dir.glob("*.py")} - {"__init__"}
    for fam in sorted(families):
        doc = importlib.import_module(f"ddl_wgpu.ops.{fam}").__doc__
        assert f"`shaders/{fam}.wgsl`" in doc, fam
        tests = re.findall(r"`tests/(test_kernel_\w+\.py)`", doc)
        assert tests and all((Path(__file__).parent / t).is_file() for t in tests), (fam, tests)
        for ref in re.findall(r"`(ddl_ref\.[\w.]+)`", " ".join(doc.split())):
            module, _, name = ref.rpartition(".")
            assert hasattr(importlib.import_module(module), name), f"{fam}: {ref} does not exist"
    assert {p.stem.removeprefix("test_kernel_") for p in Path(__file__).parent.glob("test_kernel_*.py")} == (
        families - {"attention_scores"}
    )
