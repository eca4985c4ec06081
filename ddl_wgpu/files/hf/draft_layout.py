"""Which runtime a model's MTP draft is laid out for, and the defaults that follow from it: the draft's FFN width
(`compress --ffn-keep`, `heal --draft-width`) and its chain attention (`heal`/`accept --chain-attention`);
docs/heal.md#which-runtime-serves-the-draft.

Two layouts:

- **Qwen3.5's** (vLLM's and SGLang's Qwen3.5 MTP): the draft reads the trunk's post-norm hidden and chains its own
  post-`mtp.norm` output, embedding first (`ddl_ref.config.ARCH_MTP["qwen3_5"]`, what `import-hf` reads from
  `mtp.*` and `train --arch qwen3_5 --mtp` builds). Those runtimes draft step j at position p + j − 1 with the
  step-1 rows up to p in the draft's KV cache and this round's own chain rows: `stacked` chain attention.
- **the reference heal tool's** (any other conventions; ours by default: pre-norm hiddens): each chain step its
  own causal pass, `per-step`.

The FFN width is the trunk's business, not the draft's conventions: a model that `export-hf` writes as Qwen3.5
(`hf_qwen35.is_qwen35`) has its draft built at `intermediate_size` by those runtimes, whose loaders narrow a wider
tensor silently (`served_draft`); so for such a model `compress --ffn-keep` narrows the draft with the trunk and
`heal` heals at the model's width unless `--draft-width init` asks for the reference tool's rule (the init
draft's width).
"""

from __future__ import annotations

from ddl_ref.config import ARCH_MTP, ModelConfig, MtpConfig
from ddl_wgpu.files.hf.qwen35 import is_qwen35

RUNTIME_MTP = ARCH_MTP["qwen3_5"]  # vLLM's and SGLang's conventions
DRAFT_WIDTHS = ("model", "init")  # heal --draft-width


def runtime_conventions(mtp: MtpConfig) -> bool:
    """Whether a draft reads its inputs as vLLM's and SGLang's Qwen3.5 MTP feed them (its width aside)."""
    keys = ("concat", "trunk_hidden", "chain_hidden")
    return all(getattr(mtp, k) == getattr(RUNTIME_MTP, k) for k in keys)


def chain_attention_for(cfg: ModelConfig) -> tuple[str, str]:
    """(the default chain attention of `cfg`'s draft, why)."""
    if cfg.mtp is not None and runtime_conventions(cfg.mtp):
        return "stacked", ("the draft is in Qwen3.5's layout (post-norm hiddens, as vLLM and SGLang feed it), whose "
                           "drafting attends to the step-1 rows and this round's chain rows")  # fmt: skip
    return (
        "per-step",
        "the draft is in the reference heal tool's layout (pre-norm hiddens), which trains per-step",
    )


def width_follows_trunk(cfg: ModelConfig) -> tuple[bool, str]:
    """(whether the runtime that serves `cfg`'s draft builds it at the trunk's FFN width, why)."""
    if is_qwen35(cfg):
        return True, ("a Qwen3.5-layout model: vLLM and SGLang build its draft at intermediate_size, the trunk's "
                      "FFN width")  # fmt: skip
    return (
        False,
        "not a Qwen3.5-layout model: the draft keeps its own FFN width (the reference heal tool's rule)",
    )


def draft_width_for(cfg: ModelConfig) -> tuple[str, str]:
    """(heal's default `--draft-width` for a model of `cfg`, why)."""
    follows, why = width_follows_trunk(cfg)
    return ("model" if follows else "init"), why
