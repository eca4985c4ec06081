"""The MTP draft's normed input halves (`shaders/mtp_input.wgsl`, `ddl_wgpu/ops/mtp_input.py`) against
`ddl_ref.mtp.draft_input_forward`, with the row mask and the stacked-hidden row mapping heal uses."""

import numpy as np
import pytest
from helpers import tiny_cfg

from ddl_ref import mtp as ref_mtp
from ddl_ref.check import check, f64
from ddl_ref.config import MtpConfig
from ddl_wgpu.ops import mtp_input

f32 = np.float32


@pytest.mark.parametrize(
    ("C", "concat", "style", "S"),
    [(24, "emb_first", "standard", 1), (300, "hidden_first", "offset", 1), (24, "emb_first", "standard", 3)],
)  # C 300: more channels than invocations (two per thread); S 3: the last T rows of a stacked forward
def test_mtp_input_rows(gpu, rng, C, concat, style, S):
    B, T = 3, 5
    cfg = tiny_cfg(vocab_size=64, d_model=C, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=C, ffn_hidden=8,
                   norm_style=style, mtp=MtpConfig(concat=concat))  # fmt: skip
    e = rng.standard_normal((B, T, C)).astype(f32)
    h = (3.0 * rng.standard_normal((B, S * T, C))).astype(f32)
    h[1, -1] = np.nan  # a masked row may hold anything: its output is still zero
    wn = rng.standard_normal((2, C)).astype(f32)
    valid = np.ones((B, T), f32)
    valid[1, 3:] = 0
    valid[2, -1] = 0
    out = gpu.buffer(B * T * 2 * C * 4)
    call = mtp_input.mtp_input_rows(gpu, out, gpu.upload(e), gpu.upload(h), gpu.upload(wn), gpu.upload(valid),
                                    B * T, C, T, cfg.rms_eps, style, concat, h_stride=S * T,
                                    h_offset=(S - 1) * T)  # fmt: skip
    call.run(gpu)
    got = gpu.read(out, (B, T, 2 * C))
    eh = np.zeros((C, 2 * C))  # the projection is matmul's: only the halves are this kernel's
    hid = f64(h[:, -T:])
    _x, (_ce, _ch, cat, _w, _c) = ref_mtp.draft_input_forward(f64(e), hid, f64(wn[0]), f64(wn[1]), eh, cfg)
    cat = np.where(valid[..., None] != 0, np.nan_to_num(cat), 0.0)
    check("mtp_input_rows", got, cat, "norm")
    assert not got[valid == 0].any()  # exact zeros, NaN input included


def test_mtp_input_rows_checks_its_arguments(gpu):
    b = gpu.buffer(4096)
    with pytest.raises(ValueError, match="concat"):
        mtp_input.mtp_input_rows(gpu, b, b, b, b, b, 4, 8, 4, 1e-6, concat="middle")
    with pytest.raises(ValueError, match="bytes bound"):
        mtp_input.mtp_input_rows(gpu, gpu.buffer(64), b, b, b, b, 4, 8, 4, 1e-6)
    with pytest.raises(ValueError, match="windows"):
        mtp_input.mtp_input_rows(gpu, b, b, b, b, b, 4, 8, 4, 1e-6, h_stride=6, h_offset=3)
