"""The training configuration of `train` / `resume` (`TrainingConfig`, the reference trainer's with its
validation), its errors (`TrainingError`, each kind keeping the reference trainer's message), and the
schedule of a phase. What a run is and how it is driven are `train.py`; its checkpoint is `checkpoint.py`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from ddl_ref.optim import CLIP_MODES, CosineWarmupSchedule
from ddl_wgpu.backend import PRECISIONS
from ddl_wgpu.engine.step import LOSS_SCALE_INIT, LOSS_SCALE_INTERVAL, is_scale
from ddl_wgpu.errors import UserError

MAX_INT = (1 << 63) - 1  # every integer setting is stored in the checkpoint's msgpack header (int64)
PHASE_FIXED = ("batch_size", "seq_len", "seed")  # the data's batching and order: the run's, in every phase


class TrainingError(UserError):
    """The reference trainer's `TrainingError`: each kind keeps its message."""

    @classmethod
    def invalid_config(cls, message: str, **kw) -> TrainingError:
        """`message` starts with the field it is about (e.g. "max_steps must be ..."), when about one."""
        first = message.split()[0] if message else ""
        field = first if first in {f.name for f in fields(TrainingConfig)} else None
        return cls(f"invalid training configuration: {message}", field=kw.pop("field", field), **kw)

    @classmethod
    def empty_training_dataset(cls) -> TrainingError:
        return cls("training dataset does not contain any batches")

    @classmethod
    def empty_validation_dataset(cls) -> TrainingError:
        return cls("validation dataset does not contain any batches")

    @classmethod
    def empty_variant_set(cls) -> TrainingError:
        return cls("at least one model variant is required")

    @classmethod
    def resume_mismatch(cls, message: str, **kw) -> TrainingError:
        return cls(f"invalid resume state: {message}", **kw)


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C ended a run; `message` says truthfully what was saved (and where)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


@dataclass(frozen=True)
class TrainingConfig:
    """The reference trainer's `TrainingConfig` (same fields, defaults and validation), plus the batch shape, the
    random seed and the evaluation budget, which the reference trainer kept elsewhere."""

    max_steps: int = 32  # optimizer steps in this phase
    eval_interval: int = 4  # evaluate (and record spectral telemetry) every N steps and on the last
    learning_rate: float = 1e-3  # peak learning rate (the DDL paper's 1e-3)
    min_learning_rate: float = 0.0  # cosine floor
    warmup_steps: int = 0  # linear warm-up steps at the start of the first phase
    weight_decay: float = (
        0.1  # decoupled (AdamW), applied to every parameter as the reference trainer's burn AdamW
    )
    beta1: float = 0.9
    beta2: float = 0.95
    epsilon: float = 1e-5
    grad_clip: float = 1.0  # gradient-norm clip
    # "per-tensor": each tensor by its own norm (the reference trainer's burn clipping); "global": one norm
    # over all (PyTorch's clip_grad_norm_). A checkpoint written before the field existed resumes "global".
    grad_clip_mode: str = "per-tensor"
    batch_size: int = 8  # rows per step
    seq_len: int = 128  # tokens per row
    seed: int = 0  # parameter init (and data shuffle) seed
    eval_batches: int = (
        0  # 0: every evaluation covers the whole split (the reference's); N: its first N batches
    )
    mtp_weight: float = 0.3  # joint MTP training (a model with a draft): weight of the draft's loss
    # docs/precision.md: "f32", "mixed" (f16 products, f32 weights and optimizer, dynamic loss scaling) or
    # "auto" (mixed where the adapter has a subgroup matrix; the CLI's default); a run records what "auto"
    # resolved to. The library's default stays "f32", the bits its callers had, and a checkpoint written
    # before the field existed resumes "f32".
    precision: str = "f32"
    loss_scale: float = LOSS_SCALE_INIT  # mixed: the first loss scale, a power of two
    loss_scale_interval: int = LOSS_SCALE_INTERVAL  # mixed: good steps in a row before the scale doubles

    def validate(self) -> None:
        bad = TrainingError.invalid_config
        for name in (
            "max_steps",
            "eval_interval",
            "warmup_steps",
            "batch_size",
            "seq_len",
            "seed",
            "eval_batches",
            "loss_scale_interval",
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise bad(f"{name} must be a non-negative integer")
            if v > MAX_INT:
                raise bad(f"{name} must be at most 2^63-1, got {v}")
        if self.max_steps == 0:
            raise bad("max_steps must be greater than zero")
        if self.eval_interval == 0:
            raise bad("eval_interval must be greater than zero")
        if not (math.isfinite(self.learning_rate) and self.learning_rate > 0.0):
            raise bad("learning_rate must be finite and positive")
        if not (math.isfinite(self.min_learning_rate) and self.min_learning_rate >= 0.0):
            raise bad("min_learning_rate must be finite and non-negative")
        if self.min_learning_rate > self.learning_rate:
            raise bad("min_learning_rate cannot exceed learning_rate")
        if self.warmup_steps > self.max_steps:
            raise bad("warmup_steps cannot exceed max_steps")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0.0):
            raise bad("weight_decay must be finite and non-negative")
        if not (math.isfinite(self.beta1) and 0.0 <= self.beta1 < 1.0):
            raise bad("beta1 must be in [0, 1)")
        if not (math.isfinite(self.beta2) and 0.0 <= self.beta2 < 1.0):
            raise bad("beta2 must be in [0, 1)")
        if not (math.isfinite(self.epsilon) and self.epsilon > 0.0):
            raise bad("epsilon must be finite and positive")
        if not (math.isfinite(self.grad_clip) and self.grad_clip > 0.0):
            raise bad("grad_clip must be finite and positive")
        if self.grad_clip_mode not in CLIP_MODES:
            raise bad(f"grad_clip_mode must be one of {', '.join(CLIP_MODES)}")
        if self.batch_size == 0:
            raise bad("batch_size must be greater than zero")
        if self.seq_len < 2:
            raise bad("seq_len must be at least 2")
        if self.precision not in PRECISIONS:
            raise bad(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if not is_scale(self.loss_scale):
            raise bad(f"loss_scale must be a power of two in [2^-14, 2^127], got {self.loss_scale!r}")
        if self.loss_scale_interval == 0:
            raise bad("loss_scale_interval must be greater than zero")
        w = self.mtp_weight
        if isinstance(w, bool) or not isinstance(w, int | float) or not (math.isfinite(w) and w >= 0.0):
            raise bad("mtp_weight must be finite and non-negative")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TrainingConfig:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise TrainingError.invalid_config(f"unknown field(s) {unknown}")
        return cls(**d)


def schedule_for_phase(tcfg: TrainingConfig, previous_lr: float | None) -> CosineWarmupSchedule:
    """The reference trainer's phase schedule: the first phase warms up to `learning_rate`; a later phase starts its
    cosine at the previous phase's last rate, clamped to [min_learning_rate, learning_rate], no warm-up."""
    if previous_lr is None:
        base, warmup = tcfg.learning_rate, tcfg.warmup_steps
    else:
        base, warmup = min(max(previous_lr, tcfg.min_learning_rate), tcfg.learning_rate), 0
    try:
        return CosineWarmupSchedule(base, tcfg.min_learning_rate, warmup, tcfg.max_steps)
    except ValueError as e:
        raise TrainingError.invalid_config(str(e).removeprefix("invalid training configuration: ")) from e
