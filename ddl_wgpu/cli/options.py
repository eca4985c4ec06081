"""The options the `ddl-wgpu` commands share, declared once (typer `Annotated` types with their help), and the
small helpers the commands use to read them. `cli/app.py` holds the commands themselves."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Annotated

import typer

from ddl_ref.config import ARCH_MTP, ARCHES, ConfigError, apply_arch
from ddl_ref.config import preset as make_preset
from ddl_wgpu.backend import BackendChoice


def emit(obj, as_json: bool, text: str):
    typer.echo(json.dumps(obj, indent=2) if as_json else text)


NoVerify = Annotated[
    bool,
    typer.Option(
        "--no-verify", help="Skip the tensor hash check of trusted inputs (it costs one hashing pass)."
    ),
]

ForceOpt = Annotated[
    bool, typer.Option("--force", help="Replace the output file when it exists (else refused).")
]


# ---------------------------------------------------------------------------------------------------------
# the backend

BackendOpt = Annotated[
    str,
    typer.Option(
        "--backend",
        help="auto (wgpu on a real GPU adapter, the numpy reference on CPU-only adapters), wgpu or ref.",
    ),
]
DeviceOpt = Annotated[str | None, typer.Option("--device", help="Adapter index or name substring.")]
RuntimeOpt = Annotated[
    str | None,
    typer.Option(
        "--runtime",
        help="The WebGPU implementation under --backend wgpu: auto (Dawn where the adapter has tensor-core "
        "subgroup matrices, else wgpu-native), native (wgpu-native) or dawn (Dawn, wgpudawn). Default: env "
        "DDL_WGPU_RUNTIME, else auto.",
    ),
]


DevicesOpt = Annotated[
    str | None,
    typer.Option(
        "--devices",
        help="Run the jobs in worker processes, one per adapter: 'all' or a comma list of "
        "adapter indices or names (name one twice for two workers on it).",
        rich_help_panel="Sweep",
    ),
]
WorkersOpt = Annotated[
    int,
    typer.Option(
        "--workers",
        help="Worker processes (the numpy backend's; on wgpu spread over --devices; 0: one per --devices entry, "
        "else none: the jobs run in this process).",
        rich_help_panel="Sweep",
    ),
]
RayOpt = Annotated[
    str | None,
    typer.Option(
        "--ray",
        help="Run the jobs as Ray tasks: 'local' (start a local cluster) or a running "
        "cluster's ADDRESS ('auto', HOST:PORT, ray://HOST:PORT); needs the ray extra.",
        rich_help_panel="Sweep",
    ),
]


def backend_line(choice: BackendChoice) -> str:
    line = f"backend: {choice.name} ({choice.reason})"
    return line + (f", runtime: {choice.runtime} ({choice.runtime_reason})" if choice.runtime else "")


# ---------------------------------------------------------------------------------------------------------
# models

MODEL_HELP = "Model options (override the preset)"


def model_opt(kind, help_: str):
    """A model option shared by `init` and `train`: None means "the preset's value"."""
    return Annotated[kind | None, typer.Option(help=help_, rich_help_panel=MODEL_HELP)]


VocabSize = model_opt(int, "Vocabulary size.")
DModel = model_opt(int, "Residual width.")
NLayers = model_opt(int, "Blocks.")
NHeads = model_opt(int, "Query heads.")
NKvHeads = model_opt(int, "Key/value heads (GQA).")
HeadDim = model_opt(int, "Head dimension.")
FfnHidden = model_opt(int, "SwiGLU hidden size.")
MaxSeqLen = model_opt(int, "Longest sequence.")
RopeTheta = model_opt(float, "RoPE base.")
QkNorm = model_opt(str, "none, pre_rope or post_rope.")
NormStyle = model_opt(str, "standard (w*x) or offset ((1+w)*x).")
TieEmbeddings = model_opt(bool, "Tie the LM head to the embedding.")
MODEL_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_hidden",
                "max_seq_len", "rope_theta", "qk_norm", "norm_style", "tie_embeddings")  # fmt: skip


Arch = Annotated[
    str,
    typer.Option(
        "--arch",
        help="transformer (the plain decoder) or qwen3_5 (the Qwen3.5 hybrid at the preset's sizes: Gated DeltaNet "
        "layers with a gated full-attention layer every 4th and the last, zero-centred norms, partial RoPE).",
        rich_help_panel=MODEL_HELP,
    ),
]
# what an architecture decides itself: a model option that says otherwise is refused, not silently replaced
ARCH_FIXED = ("norm_style", "qk_norm")


def model_config(preset: str, options: dict, mtp: bool = False, arch: str = "transformer"):
    """The preset with every model option the user gave (`options`: a command's locals()) applied, built as
    architecture `arch` (`ddl_ref.config.apply_arch`: sizes kept), and an MTP draft in the architecture's
    layout (`ARCH_MTP`) when `mtp`."""
    given = {k: options[k] for k in MODEL_FIELDS if options.get(k) is not None}
    if arch not in ARCHES:
        raise ConfigError(f"--arch must be one of {', '.join(ARCHES)}, got {arch!r}")
    cfg = apply_arch(make_preset(preset, **given), arch)
    for k in ARCH_FIXED:
        if k in given and given[k] != getattr(cfg, k):
            flag = "--" + k.replace("_", "-")
            raise ConfigError(f"--arch {arch} builds {flag} {getattr(cfg, k)}; {flag} {given[k]} contradicts it "
                              f"(leave {flag} out, or use --arch transformer)")  # fmt: skip
    return replace(cfg, mtp=ARCH_MTP[arch]) if mtp else cfg


def opt(default, help_: str, panel: str = MODEL_HELP, **kw):
    return typer.Option(default, help=help_, rich_help_panel=panel, **kw)


# ---------------------------------------------------------------------------------------------------------
# MTP draft

ChainAttention = Annotated[
    str | None,
    typer.Option(
        "--chain-attention",
        help="Attention of chain steps: per-step (each step its own causal pass, as the reference heal tool) "
        "or stacked (steps 1..j stacked with the runtime's diagonal mask, as vLLM/SGLang draft). Default: the "
        "draft's layout's (stacked for a Qwen3.5-layout draft, per-step otherwise).",
    ),
]
DraftWidth = Annotated[
    str | None,
    typer.Option(
        "--draft-width",
        help="The draft's FFN width: model (the model's FFN width, the starting draft narrowed by importance; what "
        "vLLM/SGLang build a Qwen3.5 draft at) or init (the starting draft's, the reference heal tool's rule). "
        "Default: model for a Qwen3.5-layout model, init otherwise.",
    ),
]
SIZE_HELP = "e.g. 16GB or 512MiB (binary units; env DDL_WGPU_GPU_MEMORY; read the same way by every command)"
GpuMemory = Annotated[
    str | None,
    typer.Option(
        "--gpu-memory",
        help=f"GPU memory this run may use, {SIZE_HELP}: on wgpu the trunk stays resident when it fits, else "
        "streams layer by layer, and a budget too small is refused naming the least one this job takes (the numpy "
        "backend only reads the size). wgpu cannot ask the card: give what it has free "
        "(docs/heal.md#choosing-the-budget).",
    ),
]
DecodeGpuMemory = Annotated[
    str | None,
    typer.Option(
        "--gpu-memory",
        help=f"GPU memory this run may use, {SIZE_HELP}: on wgpu a model whose weights do not fit is refused, "
        "naming the least budget it takes (generate reads every weight once per token, so nothing streams; the "
        "numpy backend only reads the size).",
    ),
]
HostMemory = Annotated[
    str | None,
    typer.Option(
        "--host-memory",
        help="Host memory for heal's chain rows, e.g. 32GB (binary units, read as --gpu-memory is; default: half "
        "of what is available at the start); past it they live in a scratch file beside --out, removed when heal "
        "ends.",
    ),
]
Precision = Annotated[
    str,
    typer.Option(
        "--precision",
        help="auto (mixed where the adapter has a subgroup matrix, else f32), f32, or mixed: f16 operands for the "
        "products with f32 accumulation, f32 weights and optimizer, dynamic loss scaling (docs/precision.md).",
    ),
]
TrunkDtype = Annotated[
    str,
    typer.Option(
        "--trunk-dtype",
        help="wgpu: the trunk's big matrices in f32, or f16 (half the memory; needs the adapter's shader-f16).",
    ),
]
