"""What several test modules share, as plain functions (not a test module: nothing here is collected, and no
test module imports another). The one factory of tiny model configurations (`tiny_cfg`; `hybrid_cfg` for
Qwen3.5-family trunks), the CLI's size flags of one (`cli_sizes`), the tiny models built from it
(`random_model`, `perturbed`, `make_model`), the heal tests' text (`make_text`), the engine tests' gradient
check (`check_grads`) and the speculative-sampling check (`check_speculative_sampling`).

`tiny_cfg(shape, variant, **overrides)`: the sizes of `SHAPES[shape]`, then `overrides`, then `variant`'s
residual fields (`ModelVariant.resolve_config`). Each shape is small for a reason the tests rely on (its
comment); a test states what else it needs as overrides, so every configuration a test trains is written
where it is used or here, nowhere else. `hybrid_cfg` lays the `HYBRID` overlay (the layer types and the
Gated DeltaNet's sizes) over a shape the same way; `cli_sizes` spells a shape's sizes as `init`/`train` flags.
"""

from __future__ import annotations

import numpy as np

from ddl_ref.check import random_params
from ddl_ref.config import ModelConfig, ModelVariant, MtpConfig
from ddl_ref.params import init_params
from ddl_wgpu.files.modelfile import Model, save_model

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


# Qwen3.5's layout at test size, laid over any shape by `hybrid_cfg`: Gated DeltaNets around a gated
# full-attention block with RoPE on 2 dims of a head, zero-centred norms, q/k norms before RoPE; Hv = 2·Hk
# and Dk != Dv, and a conv of 3 taps (a window shorter than a verify pass, so it wraps). A test that relies on
# other values (Dk and Dv off every tile on the GPU, a conv of Qwen3.5's 4) overrides them at the call.
HYBRID = dict(
    n_layers=3, layer_types=("linear_attention", "full_attention", "linear_attention"), attn_output_gate=True,
    rotary_dim=2, norm_style="offset", qk_norm="pre_rope", linear_k_heads=1, linear_v_heads=2, linear_k_dim=3,
    linear_v_dim=4, linear_conv_kernel=3)  # fmt: skip


def tiny_cfg(shape: str = "default", variant: ModelVariant | str | None = None, **overrides) -> ModelConfig:
    """A tiny `ModelConfig`: `SHAPES[shape]` updated with `overrides`, then `variant` resolved (module
    docstring)."""
    cfg = ModelConfig(**{**SHAPES[shape], **overrides})
    return ModelVariant(variant).resolve_config(cfg) if variant is not None else cfg


def hybrid_cfg(shape: str = "default", variant: ModelVariant | str | None = None, **overrides) -> ModelConfig:
    """`tiny_cfg` of a hybrid (Qwen3.5-family) trunk: `SHAPES[shape]`, then `HYBRID`, then `overrides`."""
    return tiny_cfg(shape, variant, **{**HYBRID, **overrides})


# the sizes `init` and `train` take as flags (`--d-model 16`, ...): every field of a SHAPES entry that has one
SIZE_FLAGS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_hidden",
              "max_seq_len")  # fmt: skip


def cli_sizes(shape: str = "default", **overrides) -> list[str]:
    """The size flags of `tiny_cfg(shape, **overrides)` for `ddl-wgpu init|train`, every size spelt out (the
    preset's never leak in). A shape or override the flags cannot express (a conv kernel, a draft) is refused
    here rather than silently dropped."""
    fields = {**SHAPES[shape], **overrides}
    extra = sorted(set(fields) - set(SIZE_FLAGS))
    if extra:
        raise ValueError(f"cli_sizes: {extra} have no size flag (pass the option itself to the command)")
    cfg = tiny_cfg(shape, **overrides)
    return [a for f in SIZE_FLAGS for a in ("--" + f.replace("_", "-"), str(getattr(cfg, f)))]


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


# Chi-square critical value at p = 0.001 with 26 degrees of freedom (27 cells: 3 tokens of a vocabulary of 3).
CHI2_26_P001 = 54.05


def _chi2(counts, probs):
    expected = probs * counts.sum()
    return float(np.sum((counts - expected) ** 2 / expected))


def check_speculative_sampling(model: Model, gen, n: int) -> None:
    """The first three tokens `gen(model, prompt, depth=2, sampling=, max_new=4)` draws over `n` seeds against
    the trunk's exact joint P(x1) P(x2 | x1) P(x3 | x1, x2) (float64, a vocabulary of 3, temperature 0.8). x1
    comes from the prefill; the first round drafts two tokens, so x2 and x3 are kept drafts, residual draws
    after a rejection at depth 1 or 2, or the bonus token: every path of the acceptance runs. The statistic
    first rejects the draft chain's own joint by a wide margin (what a rule that always keeps drafts yields),
    so the check can fail."""
    from ddl_ref import model as ref_model
    from ddl_wgpu.engine.refnet import RefEngine
    from ddl_wgpu.jobs.generate import Sampling, distribution

    V = model.cfg.vocab_size
    assert V == 3
    params64 = {k: v.astype(np.float64) for k, v in model.params.items()}
    prompt, s = [1, 2], Sampling(temperature=0.8)

    def trunk_next(ids):
        return distribution(ref_model.forward(params64, model.cfg, np.array([ids]))[0][0, -1], s)

    joint, qjoint = np.zeros((V, V, V)), np.zeros((V, V, V))
    p1 = trunk_next(prompt)
    for x1 in range(V):
        for x2 in range(V):
            joint[x1, x2] = p1[x1] * trunk_next([*prompt, x1])[x2] * trunk_next([*prompt, x1, x2])
            engine = RefEngine(model, 2)
            engine.feed(prompt, "logits")
            _, (q1, q2) = engine.draft(x1, 2, "logits", lambda row, x2=x2: x2)  # the chain given d1 = x2
            qjoint[x1, x2] = p1[x1] * distribution(q1, s)[x2] * distribution(q2, s)
    assert _chi2(qjoint.ravel() * n, joint.ravel()) > 4 * CHI2_26_P001  # the draft alone is far off
    counts = np.zeros(V**3)
    for seed in range(n):
        out = gen(model, prompt, depth=2, sampling=Sampling(temperature=0.8, seed=seed), max_new=4)
        x1, x2, x3 = out["token_ids"][:3]
        counts[(x1 * V + x2) * V + x3] += 1
    assert _chi2(counts, joint.ravel()) < CHI2_26_P001


def check_draft_step(p: dict, cfg: ModelConfig, batch: int, window: int, chain: int = 0) -> None:
    """One draft step on the GPU (`WgpuDraft`) against `RefDraft` and the float64 reference on weights `p`: the
    loss, every gradient, three Adam steps, the trained tensors and the output rows (of a partial batch).
    chain > 0: the stacked rows of two chain steps of `window` tokens, RoPE at positions p + σ − 1, the loss on
    the last step's rows only (as heal stacks them)."""
    import pytest

    from ddl_ref import mtp as ref_mtp
    from ddl_wgpu import backend
    from ddl_wgpu.engine.heal_gpu import WgpuDraft
    from ddl_wgpu.engine.refnet import RefDraft

    rng = np.random.default_rng(3)
    B, T, k = batch, 2 * window if chain else window, 8
    x = rng.standard_normal((B, T, cfg.d_model)).astype(np.float32)
    tid = rng.integers(0, 256, (B, T, k))
    tp = rng.random((B, T, k)).astype(np.float32)
    w = (rng.random((B, T)) < 0.8).astype(np.float32)
    if chain:
        w[:, :window] = 0.0
    kw = {"chain": chain} if chain else {}
    ref, gpu_d = RefDraft(p, cfg), WgpuDraft(backend.open_gpu(), p, cfg, batch=B)
    assert gpu_d.loss_sum(x, tid, tp, w, **kw) == pytest.approx(ref.loss_sum(x, tid, tp, w, **kw), rel=1e-5)
    p64 = {n: a.astype(np.float64) for n, a in p.items()}
    kl, cache = ref_mtp.draft_kl_forward(p64, cfg, x.astype(np.float64), tid, tp, w, chain)
    _dx, rgrads = ref_mtp.draft_kl_backward(p64, cfg, cache, 1.0 / w.sum())
    for step in range(1, 4):
        rl, rn, rf = ref.step(x, tid, tp, w, 1e-2, step, 4096.0, **kw)
        gl, gn, gf = gpu_d.step(x, tid, tp, w, 1e-2, step, 4096.0, **kw)
        assert rf and gf
        assert gl == pytest.approx(rl, rel=1e-4) and gn == pytest.approx(rn, rel=1e-4)
        if step == 1:
            assert gl == pytest.approx(kl / w.sum(), rel=1e-5)
            got = gpu_d.grads()
            assert set(got) == set(rgrads)
            for n, g in rgrads.items():
                scale = max(np.abs(g).max(), 1e-4)
                np.testing.assert_allclose(got[n] / scale, g / scale, atol=2e-5, err_msg=n)
    a, b = ref.export(), gpu_d.export()
    for n in a:
        np.testing.assert_allclose(b[n], a[n], rtol=1e-3, atol=1e-5, err_msg=n)
    pairs = zip(gpu_d.hidden_out(x[:1], chain), ref.hidden_out(x[:1], chain), strict=True)  # pre-, post-norm
    for got, want in pairs:
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def check_acceptance_backends(model: Model, windows, mode: str) -> dict:
    """`accept.acceptance` chained 3 deep with every convention probed, on the GPU and on numpy: the same
    report, key for key. -> the numpy report."""
    from ddl_wgpu.jobs import accept

    kw = dict(depth=3, batch=2, probe_conventions=True, chain_attention=mode)
    r = accept.acceptance(model, windows, **kw)
    g = accept.acceptance(model, windows, backend="wgpu", **kw)
    assert list(g) == list(r) and g["chain_attention"] == mode
    for key in ("prefix_acceptance", "conditional_acceptance", "acceptance_length", "anchors", "on_policy"):
        assert g[key] == r[key], key
    assert [p["prefix_acceptance"] for p in g["probe"]] == [p["prefix_acceptance"] for p in r["probe"]]
    return r
