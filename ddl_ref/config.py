"""Model configuration for the ddl-wgpu model family: one frozen `ModelConfig`, presets and `ModelVariant`.

`ModelConfig` describes the architecture only (docs/model.md#configuration-ddl_refconfigpy); training settings
live in `TrainConfig` elsewhere. Every field is validated on construction and `from_dict` rejects unknown keys
and wrong types, so a sweep override or a checkpoint header with a typo fails loudly (nanoGPT
`configurator.py`).

What this file deliberately does not do: compute parameter shapes (`params.py`) or know anything about the
GPU engine. `ModelVariant` holds the six rows of the DDL paper's Table 3
(docs/model.md#the-six-variants-modelvariant): `baseline`, `ddl` (d_v = 1), `ddl-tc-noec`, `ddl-cc-noec`,
`ddl-tc`, `ddl-cc`.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """An invalid model configuration (bad value, unknown key, wrong type or unknown name)."""


NORM_STYLES = ("standard", "offset")
QK_NORMS = ("none", "pre_rope", "post_rope")
RESIDUALS = ("add", "delta")
DDL_DVS = (1, 4)
DDL_COMPRESSORS = ("none", "tc", "cc")
LAYER_TYPES = ("full_attention", "linear_attention")  # a block's token mixer (Hugging Face's names)
MTP_CONCATS = ("emb_first", "hidden_first")
MTP_HIDDENS = ("pre_norm", "post_norm")


def _check_type(owner: str, name: str, value: Any, kind: type) -> None:
    # bool is a subclass of int: reject it for int/float fields, and accept an int for a float field.
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise ConfigError(f"{owner}.{name} must be {kind.__name__}, got {type(value).__name__} {value!r}")


def _check_enum(owner: str, name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"{owner}.{name} must be one of {list(allowed)}, got {value!r}")


def _unknown_keys(owner: str, d: dict, cls: type) -> None:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ConfigError(f"unknown {owner} keys: {unknown}; valid keys: {sorted(known)}")


@dataclass(frozen=True)
class MtpConfig:
    """One multi-token-prediction draft block: how its input is built and which hiddens it reads
    (docs/heal.md#the-draft-block)."""

    concat: str = (
        "emb_first"  # eh_proj input order: [enorm(emb), hnorm(h)] (DeepSeek-V3/Qwen) or hidden first
    )
    trunk_hidden: str = "pre_norm"  # trunk hidden fed to hnorm: before or after the trunk's final model.norm
    chain_hidden: str = "pre_norm"  # draft hidden chained to the next draft step: before or after mtp.norm
    # the draft block's SwiGLU width; None: the trunk's (ModelConfig.ffn_hidden)
    ffn_hidden: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for name, allowed in (
            ("concat", MTP_CONCATS),
            ("trunk_hidden", MTP_HIDDENS),
            ("chain_hidden", MTP_HIDDENS),
        ):
            _check_type("MtpConfig", name, getattr(self, name), str)
            _check_enum("MtpConfig", name, getattr(self, name), allowed)
        if self.ffn_hidden is not None:
            _check_type("MtpConfig", "ffn_hidden", self.ffn_hidden, int)
            if self.ffn_hidden < 1:
                raise ConfigError(f"MtpConfig.ffn_hidden must be positive, got {self.ffn_hidden}")

    def to_dict(self) -> dict[str, Any]:
        """Plain dict; `ffn_hidden` only when the draft's width differs from the trunk's (set)."""
        d = dataclasses.asdict(self)
        if d["ffn_hidden"] is None:
            del d["ffn_hidden"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MtpConfig:
        if not isinstance(d, dict):
            raise ConfigError(f"mtp must be a dict or null, got {type(d).__name__}")
        _unknown_keys("mtp", d, cls)
        return cls(**d)


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of one decoder-only model (docs/model.md#configuration-ddl_refconfigpy). Defaults are
    the DDL paper's small model."""

    # --- trunk
    vocab_size: int = 50304  # GPT-2 BPE 50257 padded up to a multiple of 128 (nanoGPT, DDL code)
    d_model: int = 768  # residual width C
    n_layers: int = 12  # number of blocks
    n_heads: int = 6  # query heads H
    n_kv_heads: int = 6  # key/value heads K (GQA when K < H); must divide n_heads
    head_dim: int = 128  # D, explicit: may differ from d_model / n_heads (DDL: 128 with 6 heads; Qwen3-0.6B)
    ffn_hidden: int = 2048  # SwiGLU hidden F = floor(8 * d_model / 3) in the DDL code
    max_seq_len: int = 1024  # longest sequence the RoPE tables are built for
    rope_theta: float = 10000.0  # RoPE base (Qwen3 uses 1e6)
    rms_eps: float = 1e-5  # RMSNorm epsilon; 1e-5 matches the DDL code's norm eps (Qwen3 uses 1e-6)
    tie_embeddings: bool = True  # lm_head shares embed_tokens (DDL code, Qwen3 <= 4B)
    norm_style: str = "standard"  # "standard": w*xhat (Llama/Qwen3); "offset": (1+w)*xhat (Gemma/Qwen3.5)
    qk_norm: str = "post_rope"  # "none", "pre_rope" (Qwen3) or "post_rope" (official DDL code)
    # --- residual: "add" is the baseline; "delta" is Deep Delta Learning (docs/model.md#deep-delta-learning)
    residual: str = "add"  # "add" or "delta"
    ddl_dv: int = 1  # value channels d_v of the delta state: 1, or 4 for the expanded state
    ddl_compressor: str = "none"  # d_v > 1 compressor: "none", "tc" (token conv) or "cc" (channel conv)
    ddl_expand_embed: bool = False  # EC: expand the embedding into the d_v state with a short conv
    ddl_k_eps: float = 1e-5  # epsilon of the k normalisation (docs/model.md#configuration-ddl_refconfigpy)
    # beta at init, in [0, 2]; 1.0 for baseline comparability (the beta bias:
    # docs/model.md#the-delta-residual)
    ddl_beta_init: float = 1.0
    ddl_v_scale: float = 4.0  # v = scale * sigmoid(...) (ddl_v_sigmoid_scale)
    ddl_conv_kernel: int = 4  # short-conv kernel size of the compressors and EC
    # --- hybrid trunks (Qwen3.5, docs/model.md#hybrid-trunks-qwen35): per-layer token mixers, gated attention,
    # partial RoPE. The defaults are the plain transformer above, so older configs load unchanged.
    # per block "full_attention" (softmax attention) or "linear_attention" (Gated DeltaNet); None: all full
    layer_types: tuple[str, ...] | None = None
    attn_output_gate: bool = False  # full attention's output times sigmoid(gate); q_proj gives [q_h; gate_h]
    rotary_dim: int | None = None  # RoPE rotates the first rotary_dim dims of a head (Qwen3.5: D/4); None: D
    linear_k_heads: int = 0  # Gated DeltaNet query/key heads (Qwen3.5-27B: 16); 0 without linear layers
    linear_v_heads: int = 0  # value heads, a multiple of linear_k_heads (27B: 48)
    linear_k_dim: int = 0  # query/key head dim (27B: 128)
    linear_v_dim: int = 0  # value head dim: the delta-rule state is linear_k_dim x linear_v_dim per head
    linear_conv_kernel: int = 4  # depthwise causal conv over time on q, k, v (Qwen3.5: 4)
    # --- optional multi-token-prediction draft block
    mtp: MtpConfig | None = field(default=None)  # None: no draft head

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        kinds = {
            "vocab_size": int,
            "d_model": int,
            "n_layers": int,
            "n_heads": int,
            "n_kv_heads": int,
            "head_dim": int,
            "ffn_hidden": int,
            "max_seq_len": int,
            "rope_theta": float,
            "rms_eps": float,
            "tie_embeddings": bool,
            "norm_style": str,
            "qk_norm": str,
            "residual": str,
            "ddl_dv": int,
            "ddl_compressor": str,
            "ddl_expand_embed": bool,
            "ddl_k_eps": float,
            "ddl_beta_init": float,
            "ddl_v_scale": float,
            "ddl_conv_kernel": int,
            "attn_output_gate": bool,
            "linear_k_heads": int,
            "linear_v_heads": int,
            "linear_k_dim": int,
            "linear_v_dim": int,
            "linear_conv_kernel": int,
        }
        for name, kind in kinds.items():
            _check_type("ModelConfig", name, getattr(self, name), kind)
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_hidden",
                     "max_seq_len", "ddl_conv_kernel"):  # fmt: skip
            if getattr(self, name) <= 0:
                raise ConfigError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        for name in ("rope_theta", "rms_eps", "ddl_k_eps", "ddl_v_scale"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"ModelConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"ModelConfig.n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"ModelConfig.head_dim must be even for rotate-half RoPE, got {self.head_dim}")
        _check_enum("ModelConfig", "norm_style", self.norm_style, NORM_STYLES)
        _check_enum("ModelConfig", "qk_norm", self.qk_norm, QK_NORMS)
        _check_enum("ModelConfig", "residual", self.residual, RESIDUALS)
        _check_enum("ModelConfig", "ddl_dv", self.ddl_dv, DDL_DVS)
        _check_enum("ModelConfig", "ddl_compressor", self.ddl_compressor, DDL_COMPRESSORS)
        if not 0.0 <= self.ddl_beta_init <= 2.0:
            raise ConfigError(f"ModelConfig.ddl_beta_init must be in [0, 2], got {self.ddl_beta_init}")
        self._validate_residual()
        self._validate_hybrid()
        if self.mtp is not None and not isinstance(self.mtp, MtpConfig):
            raise ConfigError(f"ModelConfig.mtp must be an MtpConfig or None, got {type(self.mtp).__name__}")

    def _validate_residual(self) -> None:
        # The consistent (residual, d_v, compressor, EC) combinations: the six variants and nothing else.
        dv, comp, ec = self.ddl_dv, self.ddl_compressor, self.ddl_expand_embed
        if self.residual == "add":
            if dv != 1 or comp != "none" or ec:
                raise ConfigError(
                    "ModelConfig: residual='add' needs ddl_dv=1, ddl_compressor='none' and "
                    f"ddl_expand_embed=False, got ddl_dv={dv}, ddl_compressor={comp!r}, ddl_expand_embed={ec}"
                )
        elif dv == 1:
            if comp != "none" or ec:
                raise ConfigError(
                    "ModelConfig: residual='delta' with ddl_dv=1 has no expanded state: it needs "
                    f"ddl_compressor='none' and ddl_expand_embed=False, got {comp!r} and {ec}"
                )
        elif comp not in ("tc", "cc"):
            raise ConfigError(
                f"ModelConfig: residual='delta' with ddl_dv={dv} needs ddl_compressor 'tc' or 'cc', got {comp!r}"
            )

    def _validate_hybrid(self) -> None:
        lt = self.layer_types
        if lt is not None:
            if not isinstance(lt, tuple) or not all(isinstance(t, str) for t in lt):
                raise ConfigError(f"ModelConfig.layer_types must be a tuple of names or None, got {lt!r:.80}")
            if len(lt) != self.n_layers:
                raise ConfigError(
                    f"ModelConfig.layer_types has {len(lt)} entries for n_layers {self.n_layers}"
                )
            for t in lt:
                _check_enum("ModelConfig", "layer_types[]", t, LAYER_TYPES)
        if self.rotary_dim is not None:
            _check_type("ModelConfig", "rotary_dim", self.rotary_dim, int)
            if not 2 <= self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
                raise ConfigError(
                    f"ModelConfig.rotary_dim must be even and in [2, head_dim={self.head_dim}], "
                    f"got {self.rotary_dim}"
                )
        sizes = ("linear_k_heads", "linear_v_heads", "linear_k_dim", "linear_v_dim")
        for name in (*sizes, "linear_conv_kernel"):
            if getattr(self, name) < 0:
                raise ConfigError(f"ModelConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.has_linear:
            for name in (*sizes, "linear_conv_kernel"):
                if getattr(self, name) <= 0:
                    raise ConfigError(f"ModelConfig.{name} must be positive when a layer is linear_attention")
            if self.linear_v_heads % self.linear_k_heads:
                raise ConfigError(
                    f"ModelConfig.linear_v_heads ({self.linear_v_heads}) must be a multiple of "
                    f"linear_k_heads ({self.linear_k_heads})"
                )

    def layer_type(self, i: int) -> str:
        """Block i's token mixer: "full_attention" or "linear_attention"."""
        return "full_attention" if self.layer_types is None else self.layer_types[i]

    @property
    def has_linear(self) -> bool:
        """True when some block is a Gated DeltaNet (linear_attention) layer."""
        return self.layer_types is not None and "linear_attention" in self.layer_types

    @property
    def rope_dim(self) -> int:
        """The dims of a head that RoPE rotates (the rest pass through)."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def uses_ddl(self) -> bool:
        """True for the Deep Delta residual."""
        return self.residual == "delta"

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (JSON/msgpack-able); `mtp` becomes a nested dict (`MtpConfig.to_dict`) or None."""
        d = dataclasses.asdict(self)
        d["mtp"] = self.mtp.to_dict() if self.mtp is not None else None
        d["layer_types"] = list(self.layer_types) if self.layer_types is not None else None
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Inverse of `to_dict`; missing keys take the defaults, unknown keys are rejected."""
        if not isinstance(d, dict):
            raise ConfigError(f"model config must be a dict, got {type(d).__name__}")
        _unknown_keys("ModelConfig", d, cls)
        d = dict(d)
        if isinstance(d.get("mtp"), dict):
            d["mtp"] = MtpConfig.from_dict(d["mtp"])
        if isinstance(d.get("layer_types"), list):  # JSON/msgpack give lists; the frozen config keeps a tuple
            d["layer_types"] = tuple(d["layer_types"])
        return cls(**d)


def select_layers(cfg: ModelConfig, layers) -> ModelConfig:
    """`cfg` with blocks `layers` (indices into cfg's blocks, in the new order, repeats allowed) and nothing
    else changed: `n_layers` and, on a hybrid trunk, `layer_types` follow (a plain
    `dataclasses.replace(cfg, n_layers=...)` fails there, the per-layer list no longer matching)."""
    layers = [int(i) for i in layers]
    lt = None if cfg.layer_types is None else tuple(cfg.layer_types[i] for i in layers)
    return dataclasses.replace(cfg, n_layers=len(layers), layer_types=lt)


# Presets. Sizes of "small" and "medium" follow the DDL paper (docs/model.md#configuration-ddl_refconfigpy);
# "tiny" is a byte-level model for tests and smoke runs.
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        vocab_size=256,  # byte-level
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,  # exercises GQA
        head_dim=16,
        ffn_hidden=128,
        max_seq_len=128,
    ),
    "small": ModelConfig(),  # 12 x 768, 6 heads x 128, F = 2048
    "medium": ModelConfig(
        d_model=1024,
        n_layers=24,
        n_heads=8,
        n_kv_heads=8,
        head_dim=128,
        # floor(8 * 1024 / 3) = 2730, exactly as the DDL code computes it (not rounded to 2752): parity with
        # the paper's parameter count matters more than alignment, and every kernel has bounds guards.
        ffn_hidden=2730,
    ),
}


def preset(name: str, **overrides: Any) -> ModelConfig:
    """A preset with overrides applied, validated like `from_dict` (unknown keys and wrong types rejected)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; valid presets: {sorted(PRESETS)}")
    d = PRESETS[name].to_dict()
    if isinstance(overrides.get("mtp"), MtpConfig):
        overrides["mtp"] = overrides["mtp"].to_dict()
    _unknown_keys("ModelConfig", overrides, ModelConfig)
    d.update(overrides)
    return ModelConfig.from_dict(d)


# Architectures: the trunk family a preset is built as. "transformer" is the plain pre-norm decoder above;
# "qwen3_5" is the Qwen3.5 hybrid at the same sizes (docs/model.md#hybrid-trunks-qwen35): Gated DeltaNet layers
# with one gated full-attention layer in every `interval` (the last layer of each group, Qwen3.5's
# full_attention_interval 4; fewer layers than that: the last one), zero-centred (1+w) norms, q/k norms before
# RoPE, RoPE on a quarter of each head, and Gated DeltaNet heads with the attention's geometry (key heads =
# n_kv_heads, value heads = n_heads, both of head_dim).
ARCHES = ("transformer", "qwen3_5")
QWEN35_INTERVAL = 4


def qwen35_layer_types(n_layers: int, interval: int = QWEN35_INTERVAL) -> tuple[str, ...]:
    """Qwen3.5's pattern as transformers reads `full_attention_interval`: layer i is full attention when
    (i + 1) % interval == 0, the rest linear (Gated DeltaNet); a trunk shorter than the interval has none."""
    return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers))


def apply_arch(cfg: ModelConfig, arch: str) -> ModelConfig:
    """`cfg` built as architecture `arch` (ARCHES); sizes, residual and the draft are kept."""
    if arch not in ARCHES:
        raise ConfigError(f"unknown architecture {arch!r}; valid: {list(ARCHES)}")
    if arch == "transformer":
        return cfg
    rot = max(2, cfg.head_dim // 4 // 2 * 2)
    return dataclasses.replace(
        cfg,
        norm_style="offset",
        qk_norm="pre_rope",
        attn_output_gate=True,
        rotary_dim=rot,
        layer_types=qwen35_layer_types(cfg.n_layers, max(1, min(QWEN35_INTERVAL, cfg.n_layers))),
        linear_k_heads=cfg.n_kv_heads,
        linear_v_heads=cfg.n_heads,
        linear_k_dim=cfg.head_dim,
        linear_v_dim=cfg.head_dim,
        linear_conv_kernel=4,
    )


# The draft `--mtp` adds to a model of each architecture: Qwen3.5's layout for `qwen3_5` (post-norm trunk hidden
# and chained hidden, as vLLM's and SGLang's Qwen3.5 MTP feed it, so an exported draft runs there), our own
# pre-norm one for the transformer (docs/heal.md#the-draft-block).
ARCH_MTP = {
    "transformer": MtpConfig(),
    "qwen3_5": MtpConfig(trunk_hidden="post_norm", chain_hidden="post_norm"),
}


# Variants: one row per trained architecture (the reference trainer's `ModelVariant`). Each row gives
# `uses_ddl` and the config fields the variant forces; adding a DDL row is one entry here plus one enum
# member.
def _variant(uses_ddl: bool, residual: str, dv: int, compressor: str, ec: bool) -> dict[str, Any]:
    overrides = {"residual": residual, "ddl_dv": dv, "ddl_compressor": compressor, "ddl_expand_embed": ec}
    return {"uses_ddl": uses_ddl, "overrides": overrides}


_VARIANTS: dict[str, dict[str, Any]] = {
    "baseline": _variant(False, "add", 1, "none", False),  # additive residual (gpt_base)
    "ddl": _variant(True, "delta", 1, "none", False),  # DDL d_v = 1 (DDL-vdim1-gpt-mha-rope-TC.py)
    "ddl-tc-noec": _variant(True, "delta", 4, "tc", False),  # token-conv compressor, repeated embedding
    "ddl-cc-noec": _variant(True, "delta", 4, "cc", False),  # channel-conv compressor, repeated embedding
    "ddl-tc": _variant(True, "delta", 4, "tc", True),  # token-conv compressor + embedding expander (EC)
    "ddl-cc": _variant(True, "delta", 4, "cc", True),  # channel-conv + EC: the paper's default "DDL-CC"
}


class ModelVariant(enum.StrEnum):
    """A named architecture variant; `resolve_config(base)` gives the config it trains."""

    BASELINE = "baseline"
    DDL = "ddl"
    DDL_TC_NOEC = "ddl-tc-noec"
    DDL_CC_NOEC = "ddl-cc-noec"
    DDL_TC = "ddl-tc"
    DDL_CC = "ddl-cc"

    @property
    def slug(self) -> str:
        """Stable lower-case name used in file names, checkpoints and the CLI."""
        return self.value

    @property
    def uses_ddl(self) -> bool:
        return bool(_VARIANTS[self.value]["uses_ddl"])

    def resolve_config(self, base: ModelConfig) -> ModelConfig:
        """`base` with the variant's residual fields forced (trunk sizes and DDL hyper-parameters kept)."""
        return dataclasses.replace(base, **_VARIANTS[self.value]["overrides"])

    @classmethod
    def of_config(cls, cfg: ModelConfig) -> ModelVariant:
        """The variant whose residual fields `cfg` has: a model's variant from its config alone (every valid
        config has the fields of exactly one row of `_VARIANTS`)."""
        for v in cls:
            if all(getattr(cfg, k) == x for k, x in _VARIANTS[v.value]["overrides"].items()):
                return v
        raise ConfigError(f"no variant has the residual fields of {cfg}")

    @classmethod
    def parse(cls, name: str) -> ModelVariant:
        try:
            return cls(name.strip())
        except ValueError:
            raise ConfigError(
                f"unknown variant {name.strip()!r}; valid variants: {[v.value for v in cls]} or 'all'"
            ) from None


def parse_variants(spec: str) -> list[ModelVariant]:
    """'a,b' or 'all' -> variants in the given order, duplicates dropped."""
    if spec.strip() == "all":
        return list(ModelVariant)
    names = [s for s in (p.strip() for p in spec.split(",")) if s]
    if not names:
        raise ConfigError(f"no variants given; valid variants: {[v.value for v in ModelVariant]} or 'all'")
    out: list[ModelVariant] = []
    for name in names:
        v = ModelVariant.parse(name)
        if v not in out:
            out.append(v)
    return out


assert {v.value for v in ModelVariant} == set(_VARIANTS), "ModelVariant members and _VARIANTS rows must match"
