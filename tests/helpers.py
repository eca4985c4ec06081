"""What several test modules share, as plain functions (not a test module: nothing here is collected, and no
test module imports another). The one factory of tiny model configurations (`tiny_cfg`) and the tiny
models built from it (`random_model`, `perturbed`, `make_model`), and the heal tests' text (`make_text`).

`tiny_cfg(shape, variant, **overrides)`: the sizes of `SHAPES[shape]`, then `overrides`, then `variant`'s
residual fields (`ModelVariant.resolve_config`). Each shape is small for a reason the tests rely on (its
comment); a test states what else it needs as overrides, so every configuration a test trains is written
where it is used or here, nowhere else.
"""

from __future__ import annotations

import numpy as np

from ddl_ref.check import random_params
from ddl_ref.config import ModelConfig, ModelVariant, MtpConfig
from ddl_ref.params import init_params
from ddl_wgpu.modelfile import Model, save_model

SHAPES = {
    # byte-level and small enough for every job end to end on lavapipe: files, CLI runs, heal, accept
    "default": dict(
        vocab_size=256, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8, ffn_hidden=24,
        max_seq_len=32),
    # the train and sweep jobs end to end (one block, 32 wide: a few steps take seconds on numpy)
    "train": dict(
        vocab_size=256, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8, ffn_hidden=48,
        max_seq_len=32),
    # the engine against the reference: widths that are multiples of no tile or workgroup (vocab 61, head
    # dim 6, SwiGLU 40) and GQA 4 over 2, so every kernel's edge guards run
    "engine": dict(
        vocab_size=61, d_model=24, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=6, ffn_hidden=40,
        max_seq_len=32),
    # a 300 x 32 table: 64-row chunks under test_engine_chunked's lowered binding limit (8192 bytes)
    "chunked": dict(
        vocab_size=300, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_hidden=48,
        max_seq_len=16),
    # the Deep Delta engine and clipping against the reference, off every tile (53, 20, 36)
    "ddl": dict(
        vocab_size=53, d_model=20, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8, ffn_hidden=36,
        max_seq_len=16),
    # the reference's float64 finite differences: as small as the model family allows
    "numpy": dict(
        vocab_size=11, d_model=8, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=6, ffn_hidden=10,
        max_seq_len=8),
    # the numpy decoder: a context of 12 and a conv of 3, so caches fill and conv histories wrap
    "generate": dict(
        vocab_size=13, d_model=8, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=6, ffn_hidden=10,
        max_seq_len=12, ddl_conv_kernel=3),
    # the MTP draft's finite differences and joint loss: the numpy shape, vocabulary 13, with a draft
    "mtp": dict(
        vocab_size=13, d_model=8, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=6, ffn_hidden=10,
        max_seq_len=8, mtp=MtpConfig()),
    # the GPU decoder against the numpy one: GQA 4 over 2, a short conv of 3 (the cache's edge)
    "decode": dict(
        vocab_size=19, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_hidden=24,
        max_seq_len=24, ddl_conv_kernel=3),
}  # fmt: skip


def tiny_cfg(shape: str = "default", variant: ModelVariant | str | None = None, **overrides) -> ModelConfig:
    """A tiny `ModelConfig`: `SHAPES[shape]` updated with `overrides`, then `variant` resolved (module
    docstring)."""
    cfg = ModelConfig(**{**SHAPES[shape], **overrides})
    return ModelVariant(variant).resolve_config(cfg) if variant is not None else cfg


def check_grads(got: dict, want: dict, label: str = "") -> None:
    """Every gradient of `want` (the reference's, in table order) in `got` (the engine's, the same names), each
    tensor scaled by its largest reference value so the model tolerance is relative to the tensor."""
    from ddl_ref.check import check

    assert list(got) == list(want)
    for name, g in want.items():
        scale = max(np.abs(g).max(), 1e-3)
        check(f"{label}{name}", got[name] / scale, g / scale, "model")


def random_model(cfg: ModelConfig, seed: int = 0, variant: ModelVariant | str = "baseline") -> Model:
    """A `Model` of `cfg` with random (not initial) float32 weights (`ddl_ref.check.random_params`)."""
    params = {k: v.astype(np.float32) for k, v in random_params(cfg, seed=seed).items()}
    return Model(cfg=cfg, params=params, variant=str(variant))


HEAL_WORDS = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]


def perturbed(cfg: ModelConfig, seed: int = 0) -> dict:
    """Init params with the draft's norms and projection moved off their init (so every path matters)."""
    p = init_params(cfg, seed)
    rng = np.random.default_rng(seed + 1)
    return {n: (a + 0.2 * rng.standard_normal(a.shape).astype(np.float32)) if "mtp" in n else a
            for n, a in p.items()}  # fmt: skip


def make_text(path, words=200, seed=0):
    """A text of `words` random words."""
    rng = np.random.default_rng(seed)
    path.write_text(" ".join(rng.choice(HEAL_WORDS, words)))
    return path


def make_model(path, cfg: ModelConfig, seed: int = 0):
    """A tiny model with a perturbed draft, saved to `path`."""
    save_model(path, Model(cfg, perturbed(cfg, seed)))
    return path
