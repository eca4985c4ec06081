"""EAGLE-3 drafts as the Hugging Face folders vLLM and SGLang load (docs/eagle3.md#serving): `export_plan`
turns a draft file (`files/eagle3file.py`) into config.json (`ddl_ref.eagle3.config_json`) and one
model.safetensors; `read_folder` reads such a folder back, ours or one published by others, into an
`Eagle3Draft`. `hf/convert.py` dispatches here (`export_hf_from_file` on a draft file, `import_hf_to_file` on
a folder whose config.json `claims` it).

model.safetensors holds exactly what vLLM's `Eagle3LlamaForCausalLM.load_weights` maps onto its parameters
(`vllm/model_executor/models/llama_eagle3.py`: "midlayer." -> "layers.0.", every name but lm_head under
"model.", q/k/v into qkv_proj with input 2H, gate/up into gate_up_proj, "d2t" -> draft_id_to_target_id,
"t2d" skipped): the weights in `dtype` (bf16 by default, what published drafts use), d2t int64 (Vd,),
t2d bool (V,); no embed_tokens (vLLM then shares the target's, SGLang always does).

Reading a folder others wrote, a missing optional field takes the value vLLM gives it, and the summary says
so (`notes`): draft_vocab_size -> vocab_size (and without d2t the identity map), num_key_value_heads ->
num_attention_heads, head_dim -> hidden_size / num_attention_heads, rms_norm_eps 1e-6, rope_theta 10000,
max_position_embeddings 2048 (transformers' LlamaConfig defaults), norm_before_residual false (vLLM's
llama_eagle3.py; its speculators-format path defaults to true), target_hidden_size -> hidden_size, the aux
layer ids -> SGLang's `eagle_config` ids + 1, else the target's (2, L//2, L−3) (needs `target_layers`).

What this module does not read: a draft with its own `embed_tokens.weight`, rope scaling, more than one
layer, the speculators format (`Eagle3Speculator` configs) or bias terms; each is refused in one line.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from ddl_ref import eagle3 as e3
from ddl_ref.config import ConfigError
from ddl_wgpu.files.eagle3file import D2T, T2D, Eagle3Draft
from ddl_wgpu.files.hf.common import ExportPlan
from ddl_wgpu.files.hf.folder import (
    MAX_JSON_FILE,
    OURS_OF,
    ST_OF,
    HfError,
    StTensor,
    Weights,
    encode,
)
from ddl_wgpu.files.lazy import from_array
from ddl_wgpu.files.safeio import load_json, read_regular

ARCHITECTURES = ("LlamaForCausalLMEagle3",)  # what vLLM's registry maps to Eagle3LlamaForCausalLM
TORCH_DTYPE = {"bf16": "bfloat16", "f16": "float16", "f32": "float32"}
TARGET_KEY = "ddl_target"  # config.json: the target's identity, so that an import binds the draft again


def claims(hf) -> bool:
    arch = hf.get("architectures") if isinstance(hf, dict) else None
    return isinstance(arch, list) and any(a in ARCHITECTURES for a in arch)


def export_plan(draft: Eagle3Draft, dtype: str = "bf16") -> ExportPlan:
    """config.json and the tensors of the folder (module docstring); `dtype` bf16, f16 or f32."""
    if dtype not in TORCH_DTYPE:
        raise HfError(f"--dtype must be one of {', '.join(TORCH_DTYPE)}, got {dtype!r}")
    st = ST_OF[dtype]
    tensors = []
    for name in e3.eagle3_params(draft.cfg):
        a = np.asarray(draft.params[name], np.float32)
        tensors.append(StTensor(name, st, a.shape, encode(from_array(a), st)))
    d2t = np.ascontiguousarray(draft.d2t, dtype="<i8")
    t2d = np.ascontiguousarray(draft.t2d, dtype=bool)
    tensors.append(StTensor(D2T, "I64", d2t.shape, d2t.view(np.uint8)))
    tensors.append(StTensor(T2D, "BOOL", t2d.shape, t2d.view(np.uint8)))
    config = e3.config_json(draft.cfg, draft.max_position_embeddings)
    config["torch_dtype"] = TORCH_DTYPE[dtype]
    if draft.target.get("config_hash"):
        config[TARGET_KEY] = {k: draft.target[k] for k in ("config_hash", "tensors_hash", "n_layers", "path")
                              if k in draft.target}  # fmt: skip
    return ExportPlan(config=config, tensors=tensors, layout="eagle3")


def check_folder(folder) -> dict:
    """What vLLM's loader reads and requires, checked against a written folder (config.json and
    model.safetensors): every tensor mapped onto a parameter of `Eagle3LlamaForCausalLM` with its shape, the
    fused q/k/v input 2·hidden, d2t int64 (draft_vocab_size,), t2d (vocab_size,) skipped, no unknown name.
    -> {"tensors": n, "draft_vocab_size": Vd}; HfError on the first mismatch."""
    folder = Path(folder)
    hf = load_json(read_regular(folder / "config.json", "a JSON file", HfError, MAX_JSON_FILE),
                   str(folder / "config.json"), HfError)  # fmt: skip
    w = Weights(folder)
    H, N = hf["hidden_size"], hf["num_attention_heads"]
    K = hf.get("num_key_value_heads", N)
    D = hf.get("head_dim", H // N)
    F, V = hf["intermediate_size"], hf["vocab_size"]
    Vd = hf.get("draft_vocab_size") or V
    Ht = hf.get("target_hidden_size", H)
    if hf.get("num_hidden_layers") != 1:
        raise HfError(f"{folder}: num_hidden_layers must be 1")
    # vLLM's parameter names (after its renames) and shapes
    want = {
        "model.fc.weight": (H, 3 * Ht),
        "model.layers.0.input_layernorm.weight": (H,),
        "model.layers.0.hidden_norm.weight": (H,),
        "model.layers.0.self_attn.q_proj.weight": (N * D, 2 * H),
        "model.layers.0.self_attn.k_proj.weight": (K * D, 2 * H),
        "model.layers.0.self_attn.v_proj.weight": (K * D, 2 * H),
        "model.layers.0.self_attn.o_proj.weight": (H, N * D),
        "model.layers.0.post_attention_layernorm.weight": (H,),
        "model.layers.0.mlp.gate_proj.weight": (F, H),
        "model.layers.0.mlp.up_proj.weight": (F, H),
        "model.layers.0.mlp.down_proj.weight": (H, F),
        "model.norm.weight": (H,),
        "lm_head.weight": (Vd, H),
        "draft_id_to_target_id": (Vd,),
    }
    seen = set()
    for name in w.names():
        if "t2d" in name:  # skipped by the loader; its shape is the target vocabulary
            if w.shape(name) != (V,):
                raise HfError(f"{folder}: t2d has shape {w.shape(name)}, vocab_size is {V}")
            continue
        if "d2t" in name:
            mapped = name.replace("d2t", "draft_id_to_target_id")
            if w.dtype(name) != "I64":
                raise HfError(
                    f"{folder}: d2t is {w.dtype(name)}; the loader copies it into a torch.long buffer"
                )
        else:
            mapped = name if "lm_head" in name else "model." + name.replace("midlayer.", "layers.0.")
        if mapped not in want:
            raise HfError(f"{folder}: tensor {name!r} maps to {mapped!r}, which Eagle3LlamaForCausalLM lacks")
        if tuple(w.shape(name)) != want[mapped]:
            raise HfError(f"{folder}: {name} has shape {w.shape(name)}, the loader builds {want[mapped]}")
        seen.add(mapped)
    missing = sorted(set(want) - seen)
    if missing:
        raise HfError(f"{folder}: no tensor for the loader's parameter {missing[0]!r}")
    return {"tensors": len(w.names()), "draft_vocab_size": Vd}


# ------------------------------------------------------------------------------------------------ import


def _int(hf: dict, key: str, where: str, default=None, notes=None) -> int:
    v = hf.get(key)
    if v is None:
        if default is None:
            raise HfError(f"{where}: needs an integer '{key}'")
        if notes is not None:
            notes.append(f"{key} absent: {default} (as vLLM)")
        return int(default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise HfError(f"{where}: '{key}' is {v!r:.40}, not a positive integer")
    return v


def _number(hf: dict, key: str, where: str, default: float, notes: list) -> float:
    v = hf.get(key)
    if v is None:
        notes.append(f"{key} absent: {default} (LlamaConfig's default)")
        return float(default)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
        raise HfError(f"{where}: '{key}' is {v!r:.40}, not a positive number")
    return float(v)


def _aux_ids(hf: dict, where: str, target_layers: int | None, notes: list) -> tuple:
    ids = hf.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ec = hf.get("eagle_config")
        sg = ec.get("eagle_aux_hidden_state_layer_ids") if isinstance(ec, dict) else None
        if sg is not None:
            if not (isinstance(sg, list) and all(isinstance(j, int) and not isinstance(j, bool) for j in sg)):
                raise HfError(f"{where}: eagle_config.eagle_aux_hidden_state_layer_ids is not a list of ints")
            notes.append("aux layer ids from SGLang's eagle_config (layer outputs), + 1 as SGLang reads them")
            return tuple(j + 1 for j in sg)
        if target_layers is None:
            raise HfError(f"{where}: names no aux layer ids (eagle_aux_hidden_state_layer_ids): give the target "
                          "(--target MODEL.ddlw) to take vLLM's default (2, L//2, L-3)")  # fmt: skip
        notes.append(
            f"aux layer ids absent: the target's default {e3.default_aux_layers(target_layers)} (as vLLM)"
        )
        return e3.default_aux_layers(target_layers)
    if not (isinstance(ids, list) and all(isinstance(j, int) and not isinstance(j, bool) for j in ids)):
        raise HfError(f"{where}: eagle_aux_hidden_state_layer_ids is not a list of ints")
    return tuple(ids)


def _floats(w: Weights, name: str, where: str) -> np.ndarray:
    if w.dtype(name) not in OURS_OF:
        raise HfError(f"{where}: tensor {name!r} is {w.dtype(name)}, not a float tensor")
    a = np.asarray(w.lazy(name).to("f32").array(), np.float32).reshape(w.shape(name))
    if not np.all(np.isfinite(a)):
        raise HfError(f"{where}: tensor {name!r} holds a non-finite value")
    return a


def read_folder(folder, target_layers: int | None = None) -> tuple[Eagle3Draft, list[str], list[Path]]:
    """An EAGLE-3 folder -> (the draft, notes on the defaults taken, the files read). `target_layers`: the
    target's layer count, for the default aux ids of a folder that names none."""
    folder = Path(folder)
    cfg_path = folder / "config.json"
    where = str(cfg_path)
    hf = load_json(read_regular(cfg_path, "a JSON file", HfError, MAX_JSON_FILE), where, HfError)
    if not isinstance(hf, dict) or not claims(hf):
        raise HfError(f"{where}: not an EAGLE-3 draft (architectures {ARCHITECTURES[0]})")
    notes: list[str] = []
    if hf.get("num_hidden_layers", 1) != 1:
        raise HfError(
            f"{where}: num_hidden_layers {hf.get('num_hidden_layers')!r}: only one-layer drafts are read"
        )
    if hf.get("rope_scaling") not in (None, {}):
        raise HfError(
            f"{where}: rope_scaling {json.dumps(hf['rope_scaling'])[:60]} is not modelled (plain RoPE only)"
        )
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise HfError(f"{where}: attention or MLP biases are not supported")
    H = _int(hf, "hidden_size", where)
    N = _int(hf, "num_attention_heads", where)
    K = _int(hf, "num_key_value_heads", where, N, notes)
    D = _int(hf, "head_dim", where, H // N, notes)
    V = _int(hf, "vocab_size", where)
    Vd = _int(hf, "draft_vocab_size", where, V, notes)
    Ht = _int(hf, "target_hidden_size", where, H, notes)
    nbr = hf.get("norm_before_residual")
    if nbr is None:
        notes.append("norm_before_residual absent: false (vLLM's llama_eagle3.py)")
        nbr = False
    if not isinstance(nbr, bool):
        raise HfError(f"{where}: norm_before_residual is {nbr!r:.40}, not a bool")
    try:
        cfg = e3.Eagle3Config(hidden=H, n_heads=N, n_kv_heads=K, head_dim=D,
                              intermediate=_int(hf, "intermediate_size", where), vocab=V, draft_vocab=Vd,
                              aux_layers=_aux_ids(hf, where, target_layers, notes), target_hidden_size=Ht,
                              rope_theta=_number(hf, "rope_theta", where, 10000.0, notes),
                              rms_eps=_number(hf, "rms_norm_eps", where, 1e-6, notes),
                              norm_before_residual=nbr)  # fmt: skip
    except ConfigError as e:
        raise HfError(f"{where}: {str(e).splitlines()[0]}") from None
    maxpos = _int(hf, "max_position_embeddings", where, 2048, notes)
    w = Weights(folder)
    have = set(w.names())
    if "embed_tokens.weight" in have:
        raise HfError(f"{folder}: the draft carries its own embed_tokens.weight; only drafts that share the "
                      "target's embedding are supported")  # fmt: skip
    table = e3.eagle3_params(cfg)
    extra = sorted(have - set(table) - {D2T, T2D})
    if extra:
        raise HfError(f"{folder}: unexpected tensor {extra[0]!r} in an EAGLE-3 draft")
    params = {}
    for name, (shape, _) in table.items():
        if name not in have:
            raise HfError(f"{folder}: missing tensor {name!r}")
        if tuple(w.shape(name)) != tuple(shape):
            raise HfError(
                f"{folder}: tensor {name!r} has shape {list(w.shape(name))}, the config needs {list(shape)}"
            )
        params[name] = _floats(w, name, str(folder))
    if D2T in have:
        if w.dtype(D2T) != "I64" or tuple(w.shape(D2T)) != (Vd,):
            raise HfError(f"{folder}: d2t must be I64 ({Vd},), got {w.dtype(D2T)} {list(w.shape(D2T))}")
        d2t = w.read_raw(D2T).view("<i8").astype(np.int64)
    else:
        if Vd != V:
            raise HfError(f"{folder}: no d2t for a draft vocabulary of {Vd} < {V}")
        notes.append("d2t absent: the identity map (as vLLM)")
        d2t = np.zeros(Vd, np.int64)
    tids = np.arange(Vd, dtype=np.int64) + d2t
    if np.any(tids < 0) or np.any(tids >= V):
        raise HfError(f"{folder}: d2t maps a draft id outside the target vocabulary of {V}")
    t2d = np.zeros(V, bool)
    t2d[tids] = True
    if T2D in have:
        if w.dtype(T2D) not in ("BOOL", "U8") or tuple(w.shape(T2D)) != (V,):
            raise HfError(f"{folder}: t2d must be BOOL ({V},), got {w.dtype(T2D)} {list(w.shape(T2D))}")
        stored = w.read_raw(T2D)
        if np.any(stored > 1) or not np.array_equal(stored.astype(bool), t2d):
            raise HfError(f"{folder}: t2d does not mark exactly the target ids d2t maps to")
    try:
        e3.check_vocab_map(cfg, d2t, t2d)
    except ValueError as e:
        raise HfError(f"{folder}: {e}") from None
    tgt = hf.get(TARGET_KEY)
    target = {"config_hash": None, "tensors_hash": None}
    if isinstance(tgt, dict) and all(isinstance(tgt.get(k), str) for k in ("config_hash", "tensors_hash")):
        target = {k: tgt[k] for k in ("config_hash", "tensors_hash", "n_layers", "path") if k in tgt}
    else:
        notes.append("no target recorded: checked against a target by its shapes only")
    dtypes = {n: OURS_OF[w.dtype(n)] for n in table}
    files = [cfg_path, *(f.path for f in w.files)]
    prov = {"import_hf": {"folder": str(folder), "notes": notes, "dtypes": sorted(set(dtypes.values()))}}
    return Eagle3Draft(cfg, params, d2t, t2d, target, maxpos, prov, dtypes), notes, files
