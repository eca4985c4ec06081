"""The Qwen3.5 family of `ddl_wgpu.files.hf.convert`: `Qwen3_5ForCausalLM` and `Qwen3_5ForConditionalGeneration` folders
(docs/container.md#hugging-face-interop, the trunk in docs/model.md#hybrid-trunks-qwen35).

Layouts (`LAYOUTS`): "causal_lm" (model_type `qwen3_5_text`, the text keys at the top of config.json, tensors
`model.*` + `lm_head.weight`, exactly our names) and "conditional_generation" (model_type `qwen3_5`, the text keys
in `text_config`, tensors `model.language_model.*` + `lm_head.weight`, a vision tower `model.visual.*`). Both
carry the draft as `mtp.*` (`hf_common`, layout "mtp.", post-norm hiddens as vLLM feeds them). The one shape
that differs from ours: `linear_attn.conv1d.weight` is (channels, 1, k) there, (channels, k) here.

Config: `layer_types` (or `full_attention_interval`, default 4), the `linear_*` sizes, `head_dim` (default 256),
`partial_rotary_factor` (default 0.25, in `rope_parameters` in transformers 5) -> `rotary_dim`, `rope_theta`,
`mrope_section` / `mrope_interleaved` accepted (a text position is the same in all three sections: plain RoPE),
(1+w) norms ("offset"), q/k norms before RoPE, the attention output gate (transformers' Qwen3.5 attention always
gates), the tie flag of the class (the top-level one for the conditional-generation class). Defaults are
`Qwen3_5TextConfig`'s. Refused in one line naming the key: mixture-of-experts keys and classes (`num_experts`,
Qwen3.5-MoE, Qwen3-Next), `attention_bias`, another `hidden_act`, `attn_output_gate: false`, RoPE scaling or other
RoPE keys, `mtp_use_dedicated_embeddings: true`, more than one draft layer.

Nothing lost (`ddl_wgpu.files.hf.keep`): the folder's tensors we do not run (`KEEP_TENSORS`, the vision tower) are kept
as raw bytes with their dtype and shape in the record, config.json and the small files a transformers folder
carries (`KEEP_FILES`) beside them; every parameter keeps the folder's dtype. Export writes the layout the model
came from: its config.json with our changes (`num_hidden_layers`, `layer_types`, `intermediate_size`, an untied
head, the draft's conventions), each tensor in its dtype (an unchanged bf16 tensor is the same bytes, a changed
one rounded to nearest even), the kept tensors and files as they were, sharded when the folder was. A model made
here exports as `Qwen3_5ForCausalLM`.

The family's interface to the driver (`ddl_wgpu.files.hf.convert`): `claims` / `plan` / `config_from_hf` on import,
`exports` / `export_plan` on export, `LAYOUTS` and `KEEP_FILES` for the record of what is kept.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from ddl_ref.config import ConfigError, ModelConfig, MtpConfig, qwen35_layer_types
from ddl_ref.params import MTP_PREFIX, param_table
from ddl_wgpu.files.hf import served_draft
from ddl_wgpu.files.hf.common import (
    _LAYOUT_DEFAULTS,
    LAYOUT_QWEN35,
    MTP_CONVENTION_KEY,
    RAW_HINT,
    Draft,
    ExportPlan,
    ImportPlan,
    declared_mtp_layers,
    find_draft,
    need,
    optional,
    our_to_hf_name,
    swap_eh_halves,
)
from ddl_wgpu.files.hf.folder import ST_OF, HfError, StTensor
from ddl_wgpu.files.hf.keep import FILE_PREFIX, KEEP_PREFIX
from ddl_wgpu.files.modelfile import LazyModel
from ddl_wgpu.files.safeio import load_json

CAUSAL, COND = "causal_lm", "conditional_generation"
LAYOUTS = {  # layout -> (architecture, model_type, the trunk's tensor prefix in place of our "model.")
    CAUSAL: ("Qwen3_5ForCausalLM", "qwen3_5_text", "model."),
    COND: ("Qwen3_5ForConditionalGeneration", "qwen3_5", "model.language_model."),
}
_BY_ARCH = {a: k for k, (a, _, _) in LAYOUTS.items()}
ARCHS = tuple(_BY_ARCH)
_BY_TYPE = {t: k for k, (_, t, _) in LAYOUTS.items()}
# model_type / architectures prefixes (lower case) of the family we refuse, and why
_REFUSED = (
    ("qwen3_5_moe", "Qwen3.5-MoE, a mixture-of-experts trunk"),
    ("qwen3_5moe", "Qwen3.5-MoE, a mixture-of-experts trunk"),
    ("qwen3_next", "Qwen3-Next, a mixture-of-experts trunk"),
    ("qwen3next", "Qwen3-Next, a mixture-of-experts trunk"),
)
_MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")
_ROPE_KEYS = {
    "rope_type",
    "type",
    "rope_theta",
    "partial_rotary_factor",
    "mrope_section",
    "mrope_interleaved",
}

KEEP_TENSORS = re.compile(r"^model\.visual\.")  # the vision tower: kept byte for byte, never run
KEEP_FILES = re.compile(
    r"(generation_config|tokenizer_config|special_tokens_map|added_tokens|vocab|preprocessor_config"
    r"|video_preprocessor_config|processor_config|chat_template)\.json|merges\.txt|chat_template\.jinja"
)
MAX_LAYERS = 1 << 16
MTP_NOTE = ("transformers' Qwen3.5 classes drop the mtp.* tensors on load (the trunk loads); vLLM's and SGLang's "
            "Qwen3.5 MTP loaders read them (mtp.fc embedding first)")  # fmt: skip


def _names(hf: dict) -> list[str]:
    """model_type and architectures entries, of config.json and of its text_config, lower case."""
    out = []
    for d in (hf, hf.get("text_config")):
        if not isinstance(d, dict):
            continue
        archs = d.get("architectures")
        for v in [d.get("model_type"), *(archs if isinstance(archs, list) else [])]:
            if isinstance(v, str):
                out.append(v.lower())
    return out


def layout_of(arch: str) -> str:
    return _BY_ARCH[arch]


def claims(hf: dict) -> bool:
    """Whether a config.json belongs to this family (to read it, or to refuse it here with the key that says why)."""
    return any(n.startswith(("qwen3_5", "qwen3next", "qwen3_next")) for n in _names(hf))


# ------------------------------------------------------------------------------------------------ config


@dataclasses.dataclass(frozen=True)
class Source:
    """Where a folder keeps its text model: the layout, the dict holding the text keys, how messages name it."""

    layout: str
    text: dict
    where: str

    @property
    def arch(self) -> str:
        return LAYOUTS[self.layout][0]

    @property
    def prefix(self) -> str:
        return LAYOUTS[self.layout][2]


def _layout(hf: dict, where: str) -> Source:
    for d, at in ((hf, ""), (hf.get("text_config"), "text_config.")):
        if not isinstance(d, dict):
            continue
        for key in ("model_type", "architectures"):
            vals = d.get(key) if isinstance(d.get(key), list) else [d.get(key)]
            for v in vals:
                why = next((w for p, w in _REFUSED if isinstance(v, str) and v.lower().startswith(p)), None)
                if why:
                    raise HfError(f"{where}: {at}{key} {v!r} ({why}) is not supported; ddl-wgpu runs the dense "
                                  "Qwen3.5 trunk (Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration)")  # fmt: skip
    archs, model_type = hf.get("architectures"), hf.get("model_type")
    if archs is not None and (not isinstance(archs, list) or not all(isinstance(a, str) for a in archs)):
        raise HfError(f"{where}: 'architectures' must be a list of names, got {archs!r:.80}")
    known = [a for a in archs or [] if a in _BY_ARCH]
    if archs and not known:
        raise HfError(f"{where}: unsupported architectures {archs}; supported: {', '.join(_BY_ARCH)}")
    if known:
        layout = _BY_ARCH[known[0]]
        if model_type is not None and model_type != LAYOUTS[layout][1]:
            raise HfError(f"{where}: architectures says {known[0]} but model_type is {model_type!r} "
                          f"(expected {LAYOUTS[layout][1]!r})")  # fmt: skip
    elif model_type in _BY_TYPE:
        layout = _BY_TYPE[model_type]
    else:
        raise HfError(
            f"{where}: model_type {model_type!r} is not a Qwen3.5 model type ({', '.join(_BY_TYPE)})"
        )
    if layout == CAUSAL:
        if hf.get("text_config") is not None:  # two readings in transformers itself: refuse, do not guess
            raise HfError(f"{where}: a {LAYOUTS[CAUSAL][0]} config with a 'text_config': transformers' "
                          f"{LAYOUTS[CAUSAL][0]} reads the text_config, its AutoConfig the top level (two different "
                          "models); keep the text keys in one place")  # fmt: skip
        return Source(layout, hf, where)
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise HfError(f"{where}: a {LAYOUTS[COND][0]} config needs a 'text_config' object, got {text!r:.60}")
    tt = text.get("model_type", "qwen3_5_text")
    if tt != "qwen3_5_text":
        raise HfError(f"{where}: text_config.model_type is {tt!r}, expected 'qwen3_5_text'")
    return Source(layout, text, f"{where} (text_config)")


def _refuse(text: dict, where: str) -> None:
    """One line naming the key of anything in the text config that our blocks cannot run."""
    for key in _MOE_KEYS:
        v = text.get(key)
        if v not in (None, 0, False, []):
            raise HfError(
                f"{where}: {key} {v!r}: a mixture-of-experts trunk is not supported (dense SwiGLU only)"
            )
    checks = (("attention_bias", True, "our blocks have no biases"), ("mlp_bias", True, "our blocks have no biases"),
              ("use_sliding_window", True, "full causal attention only"),
              ("attn_output_gate", False, "transformers' Qwen3.5 attention always gates its output"),
              ("mtp_use_dedicated_embeddings", True, "the draft shares the trunk's embedding"))  # fmt: skip
    for key, bad, why in checks:
        v = text.get(key)
        if v is not None and not isinstance(v, bool):
            raise HfError(f"{where}: {key!r} must be true or false, got {v!r:.40}")
        if v is bad:
            raise HfError(f"{where}: {key} {str(bad).lower()} is not supported ({why})")
    act = text.get("hidden_act", "silu")
    if act != "silu":
        raise HfError(
            f"{where}: hidden_act {act!r} is not supported (SiLU: SwiGLU and the Gated DeltaNet conv)"
        )


def _rope(text: dict, head_dim: int, where: str) -> tuple[float, int | None]:
    """(rope_theta, rotary_dim or None for the whole head) as transformers 5 reads them: `rope_scaling`, when
    set, replaces `rope_parameters` whole; `rope_theta` and `partial_rotary_factor` at the top level fill in what
    the dict leaves out."""
    key = "rope_scaling" if text.get("rope_scaling") else "rope_parameters"
    rp = text.get(key)
    if rp is not None and not isinstance(rp, dict):
        raise HfError(f"{where}: {key} must be an object or null, got {rp!r:.80}")
    rp = rp or {}
    rtype = rp.get("rope_type", rp.get("type", "default"))
    if rtype != "default":
        raise HfError(f"{where}: {key}.rope_type {rtype!r}: RoPE scaling is not supported (plain RoPE)")
    extra = sorted(set(rp) - _ROPE_KEYS)
    if extra:
        raise HfError(f"{where}: {key}.{extra[0]} is not supported (known: {sorted(_ROPE_KEYS)})")
    sec = rp.get("mrope_section")  # text positions are equal in every section: any split is plain RoPE
    if sec is not None and not (isinstance(sec, list) and all(isinstance(v, int) and not isinstance(v, bool)
                                                               and v >= 0 for v in sec)):  # fmt: skip
        raise HfError(f"{where}: {key}.mrope_section must be a list of non-negative integers")
    optional(rp, "mrope_interleaved", False, f"{where}: {key}", bool)
    theta = rp.get("rope_theta", text.get("rope_theta", 10000.0))  # transformers' default_theta
    if isinstance(theta, bool) or not isinstance(theta, int | float) or not 0 < theta < math.inf:
        raise HfError(f"{where}: rope_theta must be a positive number, got {theta!r}")
    # Qwen3_5TextConfig's default when neither place has it
    prf = rp.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
    if isinstance(prf, bool) or not isinstance(prf, int | float) or not 0 < prf <= 1:
        raise HfError(f"{where}: partial_rotary_factor must be in (0, 1], got {prf!r}")
    dim = int(head_dim * prf)  # transformers' own rounding (Qwen3_5TextRotaryEmbedding)
    if dim < 2 or dim % 2:
        raise HfError(f"{where}: partial_rotary_factor {prf} gives {dim} rotary dims of head_dim {head_dim}; "
                      "rotate-half RoPE needs an even number, at least 2")  # fmt: skip
    return float(theta), None if dim == head_dim else dim


def _layer_types(text: dict, n_layers: int, where: str) -> tuple[str, ...]:
    lt = text.get("layer_types")
    if lt is None:
        interval = optional(text, "full_attention_interval", 4, where, float)
        if not isinstance(interval, int) or interval < 1:
            raise HfError(f"{where}: full_attention_interval must be a positive integer, got {interval!r}")
        return qwen35_layer_types(n_layers, interval)
    if not isinstance(lt, list) or len(lt) != n_layers:
        raise HfError(
            f"{where}: layer_types must be a list of {n_layers} names (num_hidden_layers), got {lt!r:.80}"
        )
    bad = [t for t in lt if t not in ("full_attention", "linear_attention")]
    if bad:
        raise HfError(
            f"{where}: layer_types {bad[0]!r:.40} is not supported (full_attention, linear_attention)"
        )
    return tuple(lt)


def read_config(hf: dict, where: str) -> tuple[ModelConfig, Source]:
    """A Qwen3.5-family config.json -> (ModelConfig without the draft, Source). HfError for what we cannot run."""
    src = _layout(hf, where)
    text, w = src.text, src.where
    _refuse(text, w)
    C, H = need(text, "hidden_size", w), need(text, "num_attention_heads", w)
    L = need(text, "num_hidden_layers", w)
    if L > MAX_LAYERS:  # before a per-layer list of that length is built (the memory check comes after)
        raise HfError(f"{w}: num_hidden_layers {L} is beyond any model (at most {MAX_LAYERS})")
    D = optional(text, "head_dim", 256, w, float)
    if not isinstance(D, int) or D < 1:
        raise HfError(f"{w}: 'head_dim' must be a positive integer, got {D!r}")
    lt = _layer_types(text, L, w) if isinstance(L, int) and L > 0 else ()
    theta, rot = _rope(text, D, w)
    sizes = {}
    for ours, key, default in (("linear_k_heads", "linear_num_key_heads", 16), ("linear_v_heads", "linear_num_value_heads", 32),
                               ("linear_k_dim", "linear_key_head_dim", 128), ("linear_v_dim", "linear_value_head_dim", 128),
                               ("linear_conv_kernel", "linear_conv_kernel_dim", 4)):  # fmt: skip
        v = optional(text, key, default, w, float)
        if not isinstance(v, int):
            raise HfError(f"{w}: {key!r} must be an integer, got {v!r}")
        sizes[ours] = v
    if "linear_attention" not in lt:  # no Gated DeltaNet layer: its sizes are unused (ours are then 0)
        sizes = {k: (4 if k == "linear_conv_kernel" else 0) for k in sizes}
    tie_in = hf if src.layout == COND else text  # the conditional-generation class ties by its own flag
    try:
        cfg = ModelConfig(
            vocab_size=need(text, "vocab_size", w),
            d_model=C,
            n_layers=L,
            n_heads=H,
            n_kv_heads=optional(text, "num_key_value_heads", 4, w, float),
            head_dim=D,
            ffn_hidden=need(text, "intermediate_size", w),
            max_seq_len=optional(text, "max_position_embeddings", 32768, w, float),
            rope_theta=theta,
            rms_eps=float(optional(text, "rms_norm_eps", 1e-6, w, float)),
            tie_embeddings=optional(tie_in, "tie_word_embeddings", False, where, bool),
            norm_style="offset",
            qk_norm="pre_rope",
            residual="add",
            layer_types=lt,
            attn_output_gate=True,
            rotary_dim=rot,
            **sizes,
        )
    except (ConfigError, TypeError) as e:
        raise HfError(f"{w}: {e}") from None
    return cfg, src


def config_from_hf(hf: dict, where: str) -> tuple[ModelConfig, str]:
    cfg, src = read_config(hf, where)
    return cfg, src.arch


def is_qwen35(cfg: ModelConfig) -> bool:
    """Whether a config has a Qwen3.5 trunk's features (export_hf then writes this family)."""
    return cfg.layer_types is not None or cfg.attn_output_gate or cfg.rotary_dim is not None


def check_exportable(cfg: ModelConfig) -> None:
    """HfError naming the raw export unless transformers' Qwen3.5 classes compute exactly this model."""
    for field, want, why in (("residual", "add", "Deep Delta Learning has no transformers class"),
                             ("norm_style", "offset", "Qwen3.5's norms are (1+w)·x̂"),
                             ("qk_norm", "pre_rope", "Qwen3.5 normalises q/k before RoPE"),
                             ("attn_output_gate", True, "Qwen3.5's attention always gates its output")):  # fmt: skip
        if getattr(cfg, field) != want:
            raise HfError(
                f"{field} {getattr(cfg, field)!r} cannot be exported as Qwen3.5 ({why}); {RAW_HINT}"
            )


# ------------------------------------------------------------------------------------------------ names


def folder_name(name: str, prefix: str) -> str:
    """Our parameter name -> its name in a folder whose trunk lives under `prefix`."""
    if name.startswith(MTP_PREFIX):
        return our_to_hf_name(name)  # mtp.*
    if name.startswith("model."):
        return prefix + name[len("model.") :]
    return name  # lm_head.weight


def folder_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The folder's shape of our tensor: PyTorch's Conv1d keeps an in-channel axis of 1."""
    return (shape[0], 1, shape[1]) if name.endswith("linear_attn.conv1d.weight") else tuple(shape)


def plan(hf: dict, have: set[str], where: str) -> ImportPlan:
    """How to read a Qwen3.5 folder with tensors `have`: the config, our name -> the folder's name and shape, the
    draft, the layout it is written back in, the tensors and files kept, a note when a declared draft is absent."""
    cfg, src = read_config(hf, where)
    trunk_layer = re.compile("^" + re.escape(src.prefix) + r"layers\.(\d+)\.")
    drafty = [n for n in have if n.startswith(("mtp.", "model.mtp", f"{src.prefix}mtp"))]
    declared, by = declared_mtp_layers(src.text, src.where)
    draft: Draft | None = None
    note = None
    if drafty or MTP_CONVENTION_KEY in src.text:
        draft = find_draft(src.text, have, cfg.n_layers, src.where, trunk_layer)
        if draft is not None and draft.layout != LAYOUT_QWEN35:
            raise HfError(f"{src.where}: a Qwen3.5 folder's draft is under mtp.*, found {sorted(drafty)[:2]}")
    elif declared:
        if declared > 1:
            raise HfError(f"{src.where}: {by} {declared}: ddl-wgpu supports exactly one draft block")
        # transformers drops mtp.* on load, so a folder it saved declares a draft it does not hold
        note = f"{by} {declared} but the folder holds no mtp.* tensors: imported without a draft"
    if draft is not None:
        cfg = dataclasses.replace(cfg, mtp=draft.mtp)
    table = param_table(cfg)
    return ImportPlan(cfg=cfg, arch=src.arch, names={s.name: folder_name(s.name, src.prefix) for s in table},
                      shapes={s.name: folder_shape(s.name, s.shape) for s in table}, draft=draft, note=note,
                      keep_dtypes=True, layout=src.layout, kept=tuple(sorted(n for n in have if KEEP_TENSORS.match(n))),
                      keep_files=KEEP_FILES)  # fmt: skip


def exports(cfg: ModelConfig, record: dict | None) -> bool:
    """Whether export writes this model as this family: one imported from it, or a hybrid trunk made here."""
    return (record is not None and record["layout"] in LAYOUTS) or is_qwen35(cfg)


# ------------------------------------------------------------------------------------------------ export


def _trunk(cfg: ModelConfig) -> ModelConfig:
    """What a config.json says of the trunk: the layer types listed; without a Gated DeltaNet layer its sizes say
    nothing (`read_config` reads them as 0), whatever a compressed model still carries."""
    lt = tuple(cfg.layer_type(i) for i in range(cfg.n_layers))
    out = dataclasses.replace(cfg, mtp=None, layer_types=lt)
    if "linear_attention" not in lt:
        out = dataclasses.replace(out, linear_k_heads=0, linear_v_heads=0, linear_k_dim=0, linear_v_dim=0,
                                  linear_conv_kernel=4)  # fmt: skip
    return out


def _draft_keys(text: dict, mtp: MtpConfig | None) -> None:
    if mtp is None:
        return
    text["mtp_num_hidden_layers"] = 1
    if mtp == _LAYOUT_DEFAULTS[LAYOUT_QWEN35]:
        text.pop(MTP_CONVENTION_KEY, None)
    else:  # what vLLM would not assume: our import reads it back exactly
        text[MTP_CONVENTION_KEY] = mtp.to_dict()


def _fresh_config(model: LazyModel) -> dict:
    cfg = model.cfg
    prf = cfg.rope_dim / cfg.head_dim
    if int(cfg.head_dim * prf) != cfg.rope_dim:
        raise HfError(f"rotary_dim {cfg.rope_dim} of head_dim {cfg.head_dim} has no partial_rotary_factor that "
                      f"transformers rounds back to it; {RAW_HINT}")  # fmt: skip
    ids = {k: v for k in ("bos_token_id", "eos_token_id")
           if isinstance(v := model.metadata.get(f"hf.{k}"), int) and not isinstance(v, bool)}  # fmt: skip
    d: dict[str, Any] = {
        "architectures": [LAYOUTS[CAUSAL][0]], "model_type": LAYOUTS[CAUSAL][1], "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model, "intermediate_size": cfg.ffn_hidden, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "layer_types": [cfg.layer_type(i) for i in range(cfg.n_layers)], "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": float(cfg.rms_eps),
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False, "attention_dropout": 0.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(cfg.rope_theta), "partial_rotary_factor": prf},
        "initializer_range": 0.02, "use_cache": True, "dtype": "float32",
        "bos_token_id": ids.get("bos_token_id"), "eos_token_id": ids.get("eos_token_id"),
    }  # fmt: skip
    if cfg.has_linear:
        d.update(linear_num_key_heads=cfg.linear_k_heads, linear_num_value_heads=cfg.linear_v_heads,
                 linear_key_head_dim=cfg.linear_k_dim, linear_value_head_dim=cfg.linear_v_dim,
                 linear_conv_kernel_dim=cfg.linear_conv_kernel)  # fmt: skip
    if cfg.mtp is not None:
        d["mtp_use_dedicated_embeddings"] = False
    _draft_keys(d, cfg.mtp)
    return d


def _source_config(model: LazyModel, rec: dict) -> dict:
    """The folder's own config.json with our changes: the blocks kept (`num_hidden_layers`, `layer_types`), the
    SwiGLU width, an untied head, the draft's conventions. Checked: it must describe exactly this model's trunk."""
    raw = model.extra[FILE_PREFIX + "config.json"].array().tobytes()
    conf = load_json(raw, "the imported folder's config.json", HfError)
    if not isinstance(conf, dict):
        raise HfError("the imported folder's config.json is not a JSON object")
    _, src = read_config(conf, "the imported folder's config.json")  # read as untrusted before it is edited
    if src.layout != rec["layout"]:
        raise HfError(
            f"the imported folder's config.json is a {src.layout} config, its record says {rec['layout']}"
        )
    cfg, text = model.cfg, src.text
    lt = [cfg.layer_type(i) for i in range(cfg.n_layers)]
    text["num_hidden_layers"], text["intermediate_size"] = cfg.n_layers, cfg.ffn_hidden
    if "layer_types" in text or "full_attention_interval" not in text:
        text["layer_types"] = lt
    elif tuple(lt) != qwen35_layer_types(cfg.n_layers, text["full_attention_interval"]):
        del text["full_attention_interval"]  # compress broke the interval's pattern: list the layers
        text["layer_types"] = lt
    tie_at = conf if src.layout == COND else text  # where the class reads its tie flag (read_config)
    if optional(tie_at, "tie_word_embeddings", False, "config.json", bool) != cfg.tie_embeddings:
        tie_at["tie_word_embeddings"] = cfg.tie_embeddings  # a head the import kept apart from the embedding
    _draft_keys(text, cfg.mtp)
    back, _ = read_config(conf, "the exported config.json")
    if _trunk(back) != _trunk(cfg):
        diff = [
            f.name
            for f in dataclasses.fields(cfg)
            if getattr(_trunk(back), f.name) != getattr(_trunk(cfg), f.name)
        ]
        raise HfError(f"the model's {diff[0]} differs from what its source folder's config.json can say "
                      f"({getattr(_trunk(cfg), diff[0])!r:.60}); {RAW_HINT}")  # fmt: skip
    return conf


def export_plan(model: LazyModel, rec: dict | None) -> ExportPlan:
    """What export_hf writes for a Qwen3.5-family model: config.json, the tensors (ours in their dtypes, then the
    kept ones as they were), the kept files and the shard size. `rec`: the model's checked `hf_keep` record."""
    check_exportable(model.cfg)
    layout = rec["layout"] if rec else CAUSAL
    config = _source_config(model, rec) if rec else _fresh_config(model)
    prefix = LAYOUTS[layout][2]
    tensors = []
    for spec in param_table(model.cfg):
        t = model.tensors[spec.name]
        if spec.name == "model.mtp.eh_proj.weight" and model.cfg.mtp.concat == "hidden_first":
            t = t.map(swap_eh_halves)  # mtp.fc is embedding first
        tensors.append(
            StTensor(folder_name(spec.name, prefix), ST_OF[t.dtype], folder_shape(spec.name, spec.shape), t)
        )
    files: dict[str, bytes] = {}
    if rec:
        for name, info in rec["keep"].items():
            tensors.append(
                StTensor(name, info["dtype"], tuple(info["shape"]), model.extra[KEEP_PREFIX + name])
            )
        files = {
            f: model.extra[FILE_PREFIX + f].array().tobytes() for f in rec["files"] if f != "config.json"
        }
    taken = {t.name for t in tensors}
    if len(taken) != len(tensors):
        raise HfError("the model's kept tensors collide with its parameters' names in the folder")
    # vLLM and SGLang build the draft from config.json: a tensor of another shape is refused before writing
    served_draft.refuse_unservable(config, {t.name: t.shape for t in tensors})
    return ExportPlan(config=config, tensors=tensors, files=files, shard_bytes=rec.get("shard_bytes", 0) if rec else 0,
                      layout=layout, mtp_note=MTP_NOTE,
                      check_draft=lambda folder: served_draft.check_folder(folder).summary())  # fmt: skip
