"""The backend-neutral types of one optimizer step, shared by the GPU engine and the numpy backend.

`AdamW` is what a caller asks of a step (the optimizer's hyper-parameters and the loss scale); `StepResult`
is what a step reports; `LossScaler` is mixed precision's dynamic loss scale (docs/precision.md), the host's
half of it. Nothing here imports wgpu: `--backend ref` runs without it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


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
    # mixed precision (docs/precision.md): the backward computes the gradient of loss_scale * loss and the
    # clip unscales it (`reduce.finalize_clip`'s unscale); a power of two, so 1 and any S that does not
    # overflow give the same bits. The reported loss and gradient norm are the unscaled ones.
    loss_scale: float = 1.0


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


# Mixed precision's dynamic loss scale: PyTorch's `torch.amp.GradScaler` defaults (init_scale 2^16,
# growth_factor 2, backoff_factor 0.5, growth_interval 2000). Every factor is a power of two, so the scale is
# one and the scaled gradient, its norm and the unscaled multiplier are exact in f32 (docs/precision.md).
LOSS_SCALE_INIT = 2.0**16
LOSS_SCALE_GROWTH = 2.0
LOSS_SCALE_BACKOFF = 0.5
LOSS_SCALE_INTERVAL = 2000
# Below this the run fails as non-finite: the scale has been halved 30 times from its default start without
# a finite gradient at a finite loss, which no overflow explains (a gradient past 2^14 * f32's range): the
# gradient itself is NaN or infinite. PyTorch has no floor and would skip forever.
LOSS_SCALE_MIN = 2.0**-14
# The largest power of two f32 holds: GradScaler grows only to a finite scale, and f32 is where S lives on
# the GPU (`AdamW.loss_scale` times 1 / count in a uniform).
LOSS_SCALE_MAX = 2.0**127


def is_scale(value) -> bool:
    """A loss scale the engine takes: a power of two in [LOSS_SCALE_MIN, LOSS_SCALE_MAX]."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        return False
    mant, _ = math.frexp(float(value))
    return mant == 0.5 and LOSS_SCALE_MIN <= value <= LOSS_SCALE_MAX


class LossScaler:
    """GradScaler's rules on the host: after each step `update(finite)`; a finite gradient counts a good step
    and every `interval`-th one in a row doubles the scale (never past LOSS_SCALE_MAX); a non-finite one skips
    the step (the engine already left weights and moments untouched), halves the scale and restarts the count.
    `failed` once the scale has fallen below LOSS_SCALE_MIN. `state()` / `from_state` round-trip a
    checkpoint, so resume continues with the same scale and count."""

    def __init__(self, scale: float = LOSS_SCALE_INIT, interval: int = LOSS_SCALE_INTERVAL, good: int = 0,
                 skipped: int = 0):  # fmt: skip
        self.scale, self.interval, self.good, self.skipped = (
            float(scale),
            int(interval),
            int(good),
            int(skipped),
        )

    def update(self, finite: bool) -> bool:
        """Record one step's outcome; -> True when the step was applied, False when it was skipped."""
        if finite:
            self.good += 1
            if self.good >= self.interval:
                self.good = 0
                if self.scale * LOSS_SCALE_GROWTH <= LOSS_SCALE_MAX:
                    self.scale *= LOSS_SCALE_GROWTH
            return True
        self.scale *= LOSS_SCALE_BACKOFF
        self.good = 0
        self.skipped += 1
        return False

    @property
    def failed(self) -> bool:
        return self.scale < LOSS_SCALE_MIN

    def state(self) -> dict:
        """What a checkpoint keeps: the scale, the good steps since the last change, the steps skipped."""
        return {"scale": self.scale, "good_steps": self.good, "skipped_steps": self.skipped}

    @classmethod
    def from_state(cls, state: dict, interval: int) -> LossScaler:
        return cls(state["scale"], interval, state["good_steps"], state["skipped_steps"])


@dataclass
class Eagle3Batch:
    """What an EAGLE-3 target gives its draft for one batch of b windows of T tokens (`backend.Eagle3Target`).

    aux: the residual stream at the inputs of the aux layers, where the backend keeps it: a host array
    (b, T, 3C) (numpy) or the GPU engine's buffers (`eagle3.GpuAux`, valid until the target's next call).
    greedy (b, T): the target's full-vocabulary argmax (accept's reference). The teacher is either the full
    logits (b, T, V) (`logits`, the numpy backend with teacher_k 0) or a top-k over the draft vocabulary
    (`top_ids` (b, T, k) draft ids, `top_probs` (b, T, k) the draft-vocabulary softmax, `in_draft` (b, T) the
    full argmax is a draft token; `ddl_ref.eagle3.teacher_topk`)."""

    aux: object
    greedy: np.ndarray
    logits: np.ndarray | None = None
    top_ids: np.ndarray | None = None
    top_probs: np.ndarray | None = None
    in_draft: np.ndarray | None = None

    @property
    def teacher(self):
        """(ids, probs, in_draft) of a top-k teacher, None for full logits."""
        return None if self.top_ids is None else (self.top_ids, self.top_probs, self.in_draft)
