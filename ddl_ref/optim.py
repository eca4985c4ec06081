"""Reference optimizer pieces: gradient-norm clipping (per tensor or global), AdamW, and the reference
trainer's cosine warm-up schedule.

Clipping has two modes (`CLIP_MODES`):
- "per-tensor" (the reference trainer's default: burn's `GradientClippingConfig::Norm`, which the optimizer
  applies to each parameter tensor's gradient on its own): tensor t is scaled by clip / ||g_t|| where its own
  L2 norm exceeds clip, every other tensor is left as it is;
- "global" (PyTorch's `clip_grad_norm_`, the official DDL code's): one norm over every gradient element,
  every tensor scaled by clip / ||g|| where that norm exceeds clip.

AdamW follows the PyTorch documentation (https://pytorch.org/docs/stable/generated/torch.optim.AdamW.html):
decoupled weight decay p <- p - lr*wd*p, then the bias-corrected Adam step. As in the reference trainer's burn
AdamW, every parameter decays unless the caller passes a narrower `decay` set (see `decayed_names`). The
schedule is a line-for-line port of the reference trainer's `CosineWarmupSchedule` (docs/reference-tools.md),
error messages included.

What this file deliberately does not do: keep flat buffers (the engine's `adamw.wgsl` does), schedule
anything but the learning rate, or decide the training loop.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable

import numpy as np

from ddl_ref.params import ParamSpec

CLIP_MODES = ("per-tensor", "global")


def global_grad_norm(grads: dict[str, np.ndarray]) -> float:
    """sqrt of the sum of squares of every gradient element, accumulated in float64."""
    return math.sqrt(sum(float(np.sum(np.square(g, dtype=np.float64))) for g in grads.values()))


def clip_multiplier(norm: float, clip: float) -> float:
    """min(1, clip / norm); 1 when the norm is 0 or already within the clip (no division by zero)."""
    if norm <= 0.0 or norm <= clip:
        return 1.0
    return clip / norm


def tensor_grad_norms(grads: dict[str, np.ndarray]) -> dict[str, float]:
    """Each gradient's own L2 norm, accumulated in float64."""
    return {n: math.sqrt(float(np.sum(np.square(g, dtype=np.float64)))) for n, g in grads.items()}


def clip_multipliers(grads: dict[str, np.ndarray], clip: float, mode: str) -> dict[str, float]:
    """The multiplier of every gradient under `mode` ("per-tensor": min(1, clip / ||g_t||) from each tensor's
    own norm; "global": min(1, clip / ||g||) for all, from the global norm), for `adamw_step`."""
    if mode == "per-tensor":
        return {n: clip_multiplier(norm, clip) for n, norm in tensor_grad_norms(grads).items()}
    if mode == "global":
        mult = clip_multiplier(global_grad_norm(grads), clip)
        return dict.fromkeys(grads, mult)
    raise ValueError(f"grad_clip_mode must be one of {list(CLIP_MODES)}, got {mode!r}")


def decayed_names(table: Iterable[ParamSpec]) -> set[str]:
    """Names whose table entry has decay=True (all of them today)."""
    return {spec.name for spec in table if spec.decay}


def adamw_step(
    params: dict[str, np.ndarray],
    grads: dict[str, np.ndarray],
    state: dict,
    lr: float,
    step: int,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    grad_multiplier: float | dict[str, float] = 1.0,
    trainable: Collection[str] | None = None,
    decay: Collection[str] | None = None,
) -> None:
    """One AdamW update, in place on `params` and `state` ({"m": {name: array}, "v": {name: array}}).

    step counts from 1 (bias correction). grad_multiplier carries gradient clipping so gradients need not be
    rescaled first: one float for every tensor (`clip_multiplier`), or one per name (`clip_multipliers`). trainable: names to update (None: all in grads); decay: names that
    get weight decay (None: all).
    """
    if step < 1:
        raise ValueError(f"AdamW step counts from 1, got {step}")
    m_all = state.setdefault("m", {})
    v_all = state.setdefault("v", {})
    bc1 = 1.0 - beta1**step
    bc2 = 1.0 - beta2**step
    for name, grad in grads.items():
        if trainable is not None and name not in trainable:
            continue
        p = params[name]
        m = m_all.setdefault(name, np.zeros_like(p))
        v = v_all.setdefault(name, np.zeros_like(p))
        mult = grad_multiplier[name] if isinstance(grad_multiplier, dict) else grad_multiplier
        g = grad * float(mult)
        if decay is None or name in decay:
            p -= float(lr * weight_decay) * p
        m *= float(beta1)
        m += float(1.0 - beta1) * g
        v *= float(beta2)
        v += float(1.0 - beta2) * (g * g)
        mhat = m / float(bc1)
        vhat = v / float(bc2)
        p -= float(lr) * mhat / (np.sqrt(vhat) + float(eps))


class CosineWarmupSchedule:
    """Linear warm-up to base_lr, then a half cosine down to min_lr (the reference trainer's exact semantics).

    Step is 0-based. Warm-up step s gives (s+1)/warmup * base, so the first step is not 0. The cosine runs over
    the remaining (total - warmup) steps with progress = cosine_step / (cosine_steps - 1), so the last step
    lands exactly on min_lr; steps past the end are clamped to total - 1.
    """

    def __init__(self, base_lr: float, min_lr: float, warmup_steps: int, total_steps: int):
        if total_steps < 0 or warmup_steps < 0:
            # The reference trainer's usize cannot be negative; Python ints can.
            raise ValueError("warmup_steps and total_steps must be non-negative")
        if total_steps == 0:
            raise ValueError("total_steps must be greater than zero")
        if warmup_steps > total_steps:
            raise ValueError("warmup_steps cannot exceed total_steps")
        if min_lr > base_lr:
            raise ValueError("min_learning_rate cannot exceed base_learning_rate")
        self.base_lr = float(base_lr)
        self.min_lr = float(min_lr)
        self.warmup_steps = int(warmup_steps)
        self.total_steps = int(total_steps)

    def learning_rate(self, step: int) -> float:
        step = min(max(int(step), 0), max(self.total_steps - 1, 0))
        if self.warmup_steps > 0 and step < self.warmup_steps:
            return self.base_lr * (step + 1) / self.warmup_steps
        cosine_steps = max(self.total_steps - self.warmup_steps, 0)
        if cosine_steps <= 1:
            return self.base_lr
        cosine_step = max(step - self.warmup_steps, 0)
        progress = cosine_step / (cosine_steps - 1)
        cosine = math.cos(math.pi * progress)
        return self.min_lr + (self.base_lr - self.min_lr) * 0.5 * (1.0 + cosine)

    def __call__(self, step: int) -> float:
        return self.learning_rate(step)
