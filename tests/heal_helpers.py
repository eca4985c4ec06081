"""Shared pieces of the heal/accept tests: a tiny byte-level model with an MTP draft, its perturbed weights,
and a text of random words."""

import numpy as np

from ddl_ref.config import ModelConfig, MtpConfig
from ddl_ref.params import init_params

WORDS = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]


def tiny_cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=256, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8, ffn_hidden=24,
                max_seq_len=32, qk_norm="pre_rope", mtp=MtpConfig())  # fmt: skip
    base.update(kw)
    return ModelConfig(**base)


def perturbed(cfg, seed=0):
    """Init params with the draft's norms and projection moved off their init (so every path matters)."""
    p = init_params(cfg, seed)
    rng = np.random.default_rng(seed + 1)
    return {n: (a + 0.2 * rng.standard_normal(a.shape).astype(np.float32)) if "mtp" in n else a
            for n, a in p.items()}  # fmt: skip


def make_text(path, words: int, seed=0):
    rng = np.random.default_rng(seed)
    path.write_text(" ".join(rng.choice(WORDS, words)))
    return path
