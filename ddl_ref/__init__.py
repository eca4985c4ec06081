"""ddl_ref: the numpy reference of the ddl-wgpu model family (ops, DDL ops, config, parameter table, model,
optimizer, spectral diagnostics).

Pure numpy and imports nothing from `ddl_wgpu`: the engine is tested against this package, never the reverse.
"""

from ddl_ref import delta, ops, shortconv, spectral
from ddl_ref.blocks import block_backward, block_forward
from ddl_ref.config import (
    PRESETS,
    ConfigError,
    ModelConfig,
    ModelVariant,
    MtpConfig,
    parse_variants,
    preset,
)
from ddl_ref.model import backward, forward, hidden_states
from ddl_ref.optim import (
    CosineWarmupSchedule,
    adamw_step,
    clip_multiplier,
    clip_multipliers,
    global_grad_norm,
)
from ddl_ref.params import ParamSpec, init_params, num_params, param_table
from ddl_ref.spectral import DeltaRegime, SpectralAccumulator, beta_histogram, spectral_snapshot

__all__ = [
    "PRESETS",
    "ConfigError",
    "DeltaRegime",
    "CosineWarmupSchedule",
    "ModelConfig",
    "ModelVariant",
    "MtpConfig",
    "ParamSpec",
    "SpectralAccumulator",
    "adamw_step",
    "backward",
    "beta_histogram",
    "block_backward",
    "block_forward",
    "clip_multiplier",
    "clip_multipliers",
    "delta",
    "forward",
    "global_grad_norm",
    "hidden_states",
    "init_params",
    "num_params",
    "ops",
    "param_table",
    "parse_variants",
    "preset",
    "shortconv",
    "spectral",
    "spectral_snapshot",
]
