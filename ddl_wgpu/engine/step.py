"""The backend-neutral types of one optimizer step, shared by the GPU engine and the numpy backend.

`AdamW` is what a caller asks of a step (the optimizer's hyper-parameters); `StepResult` is what a step
reports. Nothing here imports wgpu: `--backend ref` runs without it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class AdamW:
    """The optimizer's hyper-parameters for one step (`step` counts from 1)."""

    lr: float
    step: int
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-5
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    # "per-tensor" (each tensor by its own norm, the reference trainer's rule) or "global" (one norm for all;
    # `ddl_ref.optim.CLIP_MODES`). The engine's default stays "global"; `train.TrainingConfig` chooses
    # per-tensor for training runs.
    grad_clip_mode: str = "global"


@dataclass
class StepResult:
    loss: float  # mean over valid predictions
    count: int  # valid predictions
    grad_norm: float  # global gradient norm before clipping (nan when not computed)
    finite: bool  # loss and gradients finite
    loss_main: float = math.nan  # joint MTP training: the trunk's next-token loss
    loss_mtp: float = math.nan  # joint MTP training: the draft's loss (before its weight)


# The heal draft's optimizer: Adam with these betas and eps, no weight decay, the gradient scaled to a global
# norm of at most DRAFT_GRAD_CLIP (the same on both backends). Global, not per tensor: the reference heal tool
# measures one gradient norm over the draft's trained tensors and multiplies every gradient by 1 / norm when
# the norm exceeds 1.
DRAFT_ADAM = (0.9, 0.999, 1e-8)
DRAFT_GRAD_CLIP = 1.0


def draft_adamw(lr: float, step: int) -> AdamW:
    """The heal draft's optimizer settings for one step."""
    beta1, beta2, eps = DRAFT_ADAM
    return AdamW(lr=float(lr), step=int(step), beta1=beta1, beta2=beta2, eps=eps, weight_decay=0.0,
                 grad_clip=DRAFT_GRAD_CLIP, grad_clip_mode="global")  # fmt: skip
