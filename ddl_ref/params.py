"""The one parameter table of the model family: names, shapes, init and weight decay, computed from the config.

`param_table(cfg)` drives everything that enumerates parameters: `init_params` here, the engine's flat
buffers and their offsets, the checkpoint order and the per-tensor gradient report (style.md rule 5). Names
follow Hugging Face (design.md §3), so import/export is a rename table, not a translation.

Init (ddl.md §1.4, the DDL code's `init_gpt_weights`): embeddings N(0, 0.02²); every other 2-D weight
N(0, (0.5/√C)²); the residual-output projections o_proj and down_proj N(0, (0.5/√C/√L)²); norm weights 1 for
the "standard" style and 0 for the "offset" style (so both start as the identity scale).

DDL parameters (residual "delta", ddl.md §1.2–1.5), appended after each block's baseline parameters so the
baseline layout of a block never moves:

    model.embed_expand.conv.weight          (C*dv, k)  EC only; identity ("tap:k-1")
    per block i, after layer_specs(cfg, i):
    model.layers.{i}.compress.conv.weight   (C*dv, k)  TC; or (C, dv) CC; identity (see below)
    model.layers.{i}.compress.read.weight   (dv,)      1/dv
    model.layers.{i}.ddl_{s}.beta_proj.weight  (C,)    N(0, (0.5/√C)²)        s in (attn, mlp)
    model.layers.{i}.ddl_{s}.beta_proj.bias    (1,)    logit(β₀/2)
    model.layers.{i}.ddl_{s}.v_proj.weight     (dv, C) N(0, (0.5/√C)²)
    model.layers.{i}.ddl_{s}.v_proj.bias       (dv,)   U(−1/√C, 1/√C) (nn.Linear's default bias init)
    model.readout.conv.weight / model.readout.read.weight   as a block compressor, before model.norm

Conv tap convention (TC, EC): PyTorch's, so official weights load by dropping the in-channel axis: tap m of
a kernel of size k multiplies the input at time t − (k−1−m); tap k−1 is the current token. CC: tap m reads
value channel j + m − (dv−1)//2 for output channel j (PyTorch cross-correlation with that left pad).

Compressor init: identity (TC: tap k−1 = 1; CC: tap (dv−1)//2 = 1; all others 0), not the N(0, 0.5/√C)
that ddl.md §1.4 infers (unverified) for the official code. Reason: with read = 1/dv an identity compressor
makes x_in = mean over d_v of the state, which at init (state = repeated embedding, EC identity) is exactly
the embedding, so every DDL variant starts from the same trunk input as the baseline and the d_v = 1 model,
and x_in (the v input) keeps the stream's scale instead of being shrunk by ~0.5/√C·√k.

MTP draft (cfg.mtp set, mtp-heal.md §2), appended after everything else so the trunk's layout never moves:

    model.mtp.enorm.weight        (C,)      norm init (as the trunk's norms)
    model.mtp.hnorm.weight        (C,)      norm init
    model.mtp.eh_proj.weight      (C, 2C)   N(0, (0.5/√(2C))²): the DDL 2-D rule with the projection's fan-in 2C
    model.mtp.layers.0.*                    a baseline block with the trunk's block names and init
    model.mtp.norm.weight         (C,)      norm init

The draft block is always a baseline (residual "add") block, also under a DDL trunk; it shares the trunk's
embedding and head.

What this file deliberately does not do: compute offsets or alignment (the engine's arena does that from
this table).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from ddl_ref.config import ConfigError, ModelConfig


@dataclass(frozen=True)
class ParamSpec:
    name: str  # Hugging Face name, e.g. "model.layers.0.self_attn.q_proj.weight"
    shape: tuple[int, ...]
    init: str  # "normal:STD", "uniform:A" (U(-A, A)), "const:VALUE", "tap:M" (zeros, [..., M] = 1), "ones", "zeros"
    decay: bool = True  # AdamW weight decay applies; True for all, as the seed's burn AdamW decays everything

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _norm_init(cfg: ModelConfig) -> str:
    # "offset" norms scale by (1 + w), so w = 0 is the identity, like w = 1 for "standard".
    return "ones" if cfg.norm_style == "standard" else "zeros"


def _normal(std: float) -> str:
    return f"normal:{std!r}"


def _beta_bias(beta_init: float) -> float:
    """logit(β₀/2) with β₀ clamped to [0, 2] and the logit input clipped to [1e-6, 1-1e-6] (ddl.md §1.4)."""
    p = min(max(min(max(float(beta_init), 0.0), 2.0) / 2.0, 1e-6), 1.0 - 1e-6)
    return math.log(p) - math.log(1.0 - p)


def compressor_specs(cfg: ModelConfig, prefix: str) -> list[ParamSpec]:
    """A d_v > 1 compressor (TC or CC) under `prefix` ("model.layers.{i}.compress." or "model.readout.")."""
    C, dv, k = cfg.d_model, cfg.ddl_dv, cfg.ddl_conv_kernel
    if cfg.ddl_compressor == "tc":
        conv = ParamSpec(prefix + "conv.weight", (C * dv, k), f"tap:{k - 1}")
    elif cfg.ddl_compressor == "cc":
        conv = ParamSpec(prefix + "conv.weight", (C, dv), f"tap:{(dv - 1) // 2}")
    else:
        raise ValueError(f"no compressor for ddl_compressor={cfg.ddl_compressor!r}")
    return [conv, ParamSpec(prefix + "read.weight", (dv,), f"const:{1.0 / dv!r}")]


def ddl_layer_specs(cfg: ModelConfig, i: int) -> list[ParamSpec]:
    """The Deep Delta parameters of block i (empty for residual "add"), in forward order."""
    if cfg.residual != "delta":
        return []
    C, dv = cfg.d_model, cfg.ddl_dv
    p = f"model.layers.{i}."
    specs = compressor_specs(cfg, p + "compress.") if dv > 1 else []
    hidden = _normal(0.5 / math.sqrt(C))
    for s in ("attn", "mlp"):
        q = f"{p}ddl_{s}."
        specs += [
            ParamSpec(q + "beta_proj.weight", (C,), hidden),
            ParamSpec(q + "beta_proj.bias", (1,), f"const:{_beta_bias(cfg.ddl_beta_init)!r}"),
            ParamSpec(q + "v_proj.weight", (dv, C), hidden),
            ParamSpec(q + "v_proj.bias", (dv,), f"uniform:{1.0 / math.sqrt(C)!r}"),
        ]
    return specs


def layer_specs(cfg: ModelConfig, i: int) -> list[ParamSpec]:
    """The baseline (residual "add") parameters of block i, in forward order."""
    C, H, K, D, F, L = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_hidden, cfg.n_layers
    hidden = _normal(0.5 / math.sqrt(C))
    # Output projections write into the residual stream; scaling by 1/√L keeps its variance O(1) in depth.
    out = _normal(0.5 / math.sqrt(C) / math.sqrt(L))
    norm = _norm_init(cfg)
    p = f"model.layers.{i}."
    specs = [
        ParamSpec(p + "input_layernorm.weight", (C,), norm),
        ParamSpec(p + "self_attn.q_proj.weight", (H * D, C), hidden),
        ParamSpec(p + "self_attn.k_proj.weight", (K * D, C), hidden),
        ParamSpec(p + "self_attn.v_proj.weight", (K * D, C), hidden),
        ParamSpec(p + "self_attn.o_proj.weight", (C, H * D), out),
    ]
    if cfg.qk_norm != "none":
        specs += [
            ParamSpec(p + "self_attn.q_norm.weight", (D,), norm),
            ParamSpec(p + "self_attn.k_norm.weight", (D,), norm),
        ]
    specs += [
        ParamSpec(p + "post_attention_layernorm.weight", (C,), norm),
        ParamSpec(p + "mlp.gate_proj.weight", (F, C), hidden),
        ParamSpec(p + "mlp.up_proj.weight", (F, C), hidden),
        ParamSpec(p + "mlp.down_proj.weight", (C, F), out),
    ]
    return specs


MTP_PREFIX = "model.mtp."
MTP_LAYER_PREFIX = "model.mtp.layers.0."


def mtp_specs(cfg: ModelConfig) -> list[ParamSpec]:
    """The MTP draft's parameters (empty when cfg.mtp is None), in forward order."""
    if cfg.mtp is None:
        return []
    C = cfg.d_model
    norm = _norm_init(cfg)
    specs = [
        ParamSpec(MTP_PREFIX + "enorm.weight", (C,), norm),
        ParamSpec(MTP_PREFIX + "hnorm.weight", (C,), norm),
        ParamSpec(MTP_PREFIX + "eh_proj.weight", (C, 2 * C), _normal(0.5 / math.sqrt(2 * C))),
    ]
    # The block is a trunk block 0 renamed (same shapes, q/k norms when the trunk has them, same init), with
    # its own SwiGLU width when `MtpConfig.ffn_hidden` is set (a draft kept whole by `compress --ffn-keep`).
    width = cfg.mtp.ffn_hidden if cfg.mtp.ffn_hidden is not None else cfg.ffn_hidden
    trunk = layer_specs(dataclasses.replace(cfg, ffn_hidden=width), 0)
    specs += [
        ParamSpec(MTP_LAYER_PREFIX + s.name[len("model.layers.0.") :], s.shape, s.init, s.decay)
        for s in trunk
    ]
    specs.append(ParamSpec(MTP_PREFIX + "norm.weight", (C,), norm))
    return specs


def param_table(cfg: ModelConfig) -> list[ParamSpec]:
    """Every parameter of the model, in a fixed order.

    Embedding, [EC], blocks 0..L-1 (baseline parameters, then DDL ones), [readout], final norm, [head],
    [MTP draft].
    """
    C, V = cfg.d_model, cfg.vocab_size
    specs = [ParamSpec("model.embed_tokens.weight", (V, C), _normal(0.02))]
    if cfg.ddl_expand_embed:
        k = cfg.ddl_conv_kernel
        specs.append(ParamSpec("model.embed_expand.conv.weight", (C * cfg.ddl_dv, k), f"tap:{k - 1}"))
    for i in range(cfg.n_layers):
        specs += layer_specs(cfg, i)
        specs += ddl_layer_specs(cfg, i)
    if cfg.residual == "delta" and cfg.ddl_dv > 1:
        specs += compressor_specs(cfg, "model.readout.")
    specs.append(ParamSpec("model.norm.weight", (C,), _norm_init(cfg)))
    if not cfg.tie_embeddings:
        # An untied head follows the DDL rule for any 2-D weight (0.5/√C, ≈0.018 at C=768, close to the
        # embedding's 0.02 anyway) rather than inventing a third scale.
        specs.append(ParamSpec("lm_head.weight", (V, C), _normal(0.5 / math.sqrt(C))))
    specs += mtp_specs(cfg)
    names = [s.name for s in specs]
    assert len(set(names)) == len(names), "duplicate parameter names"
    return specs


def _draw(spec: ParamSpec, rng: np.random.Generator, dtype) -> np.ndarray:
    if spec.init == "ones":
        return np.ones(spec.shape, dtype=dtype)
    if spec.init == "zeros":
        return np.zeros(spec.shape, dtype=dtype)
    if spec.init.startswith("const:"):
        return np.full(spec.shape, float(spec.init.split(":", 1)[1]), dtype=dtype)
    if spec.init.startswith("tap:"):
        w = np.zeros(spec.shape, dtype=dtype)
        w[..., int(spec.init.split(":", 1)[1])] = 1.0
        return w
    if spec.init.startswith("uniform:"):
        a = float(spec.init.split(":", 1)[1])
        return rng.uniform(-a, a, size=spec.shape).astype(dtype)
    if spec.init.startswith("normal:"):
        std = float(spec.init.split(":", 1)[1])
        # Draw in float64 then cast, so float32 and float64 models start from the same values.
        return (rng.standard_normal(spec.shape) * std).astype(dtype)
    raise ValueError(f"{spec.name}: unknown init {spec.init!r}")


def init_params(cfg: ModelConfig, seed: int, dtype=np.float32) -> dict[str, np.ndarray]:
    """Fresh parameters, drawn from one seeded generator in table order (deterministic for a given seed)."""
    rng = np.random.default_rng(seed)
    return {spec.name: _draw(spec, rng, dtype) for spec in param_table(cfg)}


def num_params(cfg: ModelConfig) -> int:
    """Total number of scalars (a tied head is counted once)."""
    return sum(spec.numel for spec in param_table(cfg))


def trainable_names(names: list[str], trainable=None) -> list[str]:
    """The trained subset of `names` (in their order): all of them (None), those a predicate accepts, or those
    listed (every listed name must be one of `names`)."""
    if trainable is None:
        return list(names)
    if callable(trainable):
        return [n for n in names if trainable(n)]
    unknown = set(trainable) - set(names)
    if unknown:
        raise ConfigError(f"unknown trainable parameter(s): {sorted(unknown)}")
    return [n for n in names if n in set(trainable)]
