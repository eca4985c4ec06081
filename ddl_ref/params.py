"""The one parameter table of the model family: names, shapes, init and weight decay, computed from the config.

`param_table(cfg)` drives everything that enumerates parameters: `init_params` here, the engine's flat buffers
and their offsets, the checkpoint order and the per-tensor gradient report. Names follow Hugging Face
(docs/model.md#parameters-names-and-the-one-table-ddl_refparamspy), so import/export is a rename table, not a
translation.

Init (the DDL code's `init_gpt_weights`): embeddings N(0, 0.02²); every other 2-D weight N(0, (0.5/√C)²); the
residual-output projections o_proj and down_proj N(0, (0.5/√C/√L)²); norm weights 1 for the "standard" style
and 0 for the "offset" style (so both start as the identity scale).

Hybrid trunks (`cfg.layer_types`, Qwen3.5, docs/model.md#hybrid-trunks-qwen35): a "linear_attention" block has
`linear_attn.*` (the Gated DeltaNet, `_linear_attention_specs`) where a full-attention block has `self_attn.*`;
its norms and MLP are the same. With `attn_output_gate` a full-attention q_proj is (2·H·D, C), per head
[query_h; gate_h] as Qwen3.5 stores it.

DDL parameters (residual "delta", docs/model.md#deep-delta-learning), appended after each block's baseline
parameters so the baseline layout of a block never moves:

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
that a reading of the official DDL code suggests (unverified). Reason: with read = 1/dv an identity compressor
makes x_in = mean over d_v of the state, which at init (state = repeated embedding, EC identity) is exactly
the embedding, so every DDL variant starts from the same trunk input as the baseline and the d_v = 1 model,
and x_in (the v input) keeps the stream's scale instead of being shrunk by ~0.5/√C·√k.

MTP draft (cfg.mtp set, docs/heal.md#the-draft-block), appended after everything else so the trunk's layout
never moves:

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
    # "normal:STD", "uniform:A" (U(-A, A)), "loguniform:LO:HI" (log of U(LO, HI)), "const:VALUE",
    # "tap:M" (zeros, [..., M] = 1), "ones", "zeros"
    init: str
    # AdamW weight decay applies; True for all, as the reference trainer's burn AdamW decays everything
    decay: bool = True

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _norm_init(cfg: ModelConfig) -> str:
    # "offset" norms scale by (1 + w), so w = 0 is the identity, like w = 1 for "standard".
    return "ones" if cfg.norm_style == "standard" else "zeros"


def _normal(std: float) -> str:
    return f"normal:{std!r}"


def _beta_bias(beta_init: float) -> float:
    """logit(β₀/2) with β₀ clamped to [0, 2] and the logit input clipped to [1e-6, 1-1e-6]
    (docs/model.md#the-delta-residual)."""
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


def _attention_specs(cfg: ModelConfig, p: str, hidden: str, out: str, norm: str) -> list[ParamSpec]:
    """A full-attention mixer's parameters. With `attn_output_gate` q_proj is twice as wide: per head h its rows
    are [query_h (D); gate_h (D)] (Qwen3.5's layout), and the attention output is times sigmoid(gate)."""
    C, H, K, D = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    q_rows = 2 * H * D if cfg.attn_output_gate else H * D
    specs = [
        ParamSpec(p + "self_attn.q_proj.weight", (q_rows, C), hidden),
        ParamSpec(p + "self_attn.k_proj.weight", (K * D, C), hidden),
        ParamSpec(p + "self_attn.v_proj.weight", (K * D, C), hidden),
        ParamSpec(p + "self_attn.o_proj.weight", (C, H * D), out),
    ]
    if cfg.qk_norm != "none":
        specs += [
            ParamSpec(p + "self_attn.q_norm.weight", (D,), norm),
            ParamSpec(p + "self_attn.k_norm.weight", (D,), norm),
        ]
    return specs


def linear_conv_channels(cfg: ModelConfig) -> int:
    """Channels of a Gated DeltaNet's q/k/v projection and conv: [q (Hk·Dk); k (Hk·Dk); v (Hv·Dv)]."""
    return 2 * cfg.linear_k_heads * cfg.linear_k_dim + cfg.linear_v_heads * cfg.linear_v_dim


def _linear_attention_specs(cfg: ModelConfig, p: str, hidden: str, out: str) -> list[ParamSpec]:
    """A Gated DeltaNet mixer's parameters (Qwen3.5's `linear_attn.*`, docs/model.md#gated-deltanet), in
    forward order. The conv weight drops PyTorch's in-channel axis ((channels, 1, k) -> (channels, k)). Init:
    the projections as any 2-D weight; the conv U(±1/√k) (PyTorch's Conv1d default); dt_bias 1 and
    A = exp(A_log) ~ U(0.01, 16) (Qwen3.5's init); the gated norm's weight 1 (it is a plain w·x̂ norm in every
    norm style)."""
    C, Hv, Dv, k = cfg.d_model, cfg.linear_v_heads, cfg.linear_v_dim, cfg.linear_conv_kernel
    q = p + "linear_attn."
    return [
        ParamSpec(q + "in_proj_qkv.weight", (linear_conv_channels(cfg), C), hidden),
        ParamSpec(q + "in_proj_z.weight", (Hv * Dv, C), hidden),
        ParamSpec(q + "in_proj_b.weight", (Hv, C), hidden),
        ParamSpec(q + "in_proj_a.weight", (Hv, C), hidden),
        ParamSpec(q + "conv1d.weight", (linear_conv_channels(cfg), k), f"uniform:{1.0 / math.sqrt(k)!r}"),
        ParamSpec(q + "dt_bias", (Hv,), "ones"),
        ParamSpec(q + "A_log", (Hv,), "loguniform:0.01:16"),
        ParamSpec(q + "norm.weight", (Dv,), "ones"),
        ParamSpec(q + "out_proj.weight", (C, Hv * Dv), out),
    ]


def layer_specs(cfg: ModelConfig, i: int, mixer: str | None = None) -> list[ParamSpec]:
    """The baseline (residual "add") parameters of block i, in forward order: its norm, its token mixer
    (`mixer`, default the block's `cfg.layer_type(i)`: self_attn.* or linear_attn.*), its norm, its MLP."""
    C, F, L = cfg.d_model, cfg.ffn_hidden, cfg.n_layers
    hidden = _normal(0.5 / math.sqrt(C))
    # Output projections write into the residual stream; scaling by 1/√L keeps its variance O(1) in depth.
    out = _normal(0.5 / math.sqrt(C) / math.sqrt(L))
    norm = _norm_init(cfg)
    p = f"model.layers.{i}."
    mixer = cfg.layer_type(i) if mixer is None else mixer
    specs = [ParamSpec(p + "input_layernorm.weight", (C,), norm)]
    if mixer == "linear_attention":
        specs += _linear_attention_specs(cfg, p, hidden, out)
    else:
        specs += _attention_specs(cfg, p, hidden, out, norm)
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
    # The block is a trunk block 0 renamed (same shapes, q/k norms when the trunk has them, same init), always
    # a full-attention block (also on a hybrid trunk: Qwen3.5's draft), with its own SwiGLU width when
    # `MtpConfig.ffn_hidden` is set (a draft kept whole by `compress --ffn-keep`).
    width = cfg.mtp.ffn_hidden if cfg.mtp.ffn_hidden is not None else cfg.ffn_hidden
    trunk = layer_specs(dataclasses.replace(cfg, ffn_hidden=width), 0, mixer="full_attention")
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
    if spec.init.startswith("loguniform:"):
        lo, hi = (float(v) for v in spec.init.split(":")[1:])
        return np.log(rng.uniform(lo, hi, size=spec.shape)).astype(dtype)
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
